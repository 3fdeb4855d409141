"""Linear attention of hybrid models: gated DeltaNet (``gdn_ops``), KDA (``kda_ops``), Mamba2 SSD, written with the
DSL."""

from .gdn_ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, gated_delta_rule_reference  # noqa: F401
from .kda_ops import chunk_kda, fused_recurrent_kda, kda_reference  # noqa: F401
