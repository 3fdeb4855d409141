"""Linear-attention kernels of hybrid models (KDA), written with the tpukernels DSL."""

from .kda_ops import chunk_kda, fused_recurrent_kda, kda_reference  # noqa: F401
