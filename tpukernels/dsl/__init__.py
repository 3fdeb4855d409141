"""The kernel-authoring DSL: ``@tpu_kernel``, tunables, launch descriptions and their checks.

In-kernel helpers: :mod:`.tails` (partial blocks), :mod:`.scan` (chunked linear recurrences: carried state,
segment-aware cumulative sums and decays, the unit lower-triangular inverse).
"""

from . import scan
from .dtypes import jax_reference
from .kernel import REGISTRY, BackwardContext, TpuKernel, bucket, check_int, dtype_default, tpu_kernel
from .modes import current_interpret_mode, interpret_mode, set_interpret_mode
from .spec import Config, Launch, OutSpec, TensorSpec, Tunable, TunableSpace, like
from .tails import mask_tail, tail_valid
from .validate import cdiv, estimate_vmem

__all__ = [
    "REGISTRY", "BackwardContext", "TpuKernel", "bucket", "check_int", "tpu_kernel", "current_interpret_mode",
    "interpret_mode", "set_interpret_mode", "dtype_default", "Config", "Launch", "OutSpec", "TensorSpec", "Tunable",
    "TunableSpace", "like", "scan", "mask_tail", "tail_valid", "cdiv", "estimate_vmem", "jax_reference",
]
