"""Linear attention and state-space kernels of hybrid models, written with the DSL: gated DeltaNet (``gdn_ops``),
KDA (``kda_ops``), Mamba2's SSD (``ssd_ops``: ``mamba_chunk_scan_combined``, ``selective_state_update``)."""

from .gdn_ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, gated_delta_rule_reference  # noqa: F401
from .kda_ops import chunk_kda, fused_recurrent_kda, kda_reference  # noqa: F401
from .ssd_ops import mamba_chunk_scan_combined, selective_state_step, selective_state_update  # noqa: F401
