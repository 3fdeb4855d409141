"""tpukernels.library.linear_attention: the linear-attention / state-space kernels of hybrid models.

``ssd_ops``: Mamba2's SSD (``mamba_chunk_scan_combined``, ``selective_state_update``).
"""

from .ssd_ops import mamba_chunk_scan_combined, selective_state_step, selective_state_update  # noqa: F401
