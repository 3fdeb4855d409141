"""tpukernels: write a Pallas TPU kernel once, call it as a torch op on ``tpu`` and ``cpu``.

Quick start::

    import torch, tpukernels as tk
    from jax.experimental import pallas as pl

    def add_body(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    @tk.tpu_kernel(add_body, tunables={"block_rows": tk.Tunable([256, 512, 64], default=256)},
                   shapes={"x": "R C", "y": "R C"})     # y of another shape: ArgumentError, not a stray read
    def add(x: torch.Tensor, y: torch.Tensor, *, block_rows: int) -> torch.Tensor:
        spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
        return tk.Launch(grid=(tk.cdiv(x.shape[0], block_rows),), in_specs=[spec, spec],
                         out_specs=spec, out_shape=tk.like(x))

    z = add(torch.randn(1000, 256), torch.randn(1000, 256))   # torch.ops.tpukernels_user.add
    print(tk.compile_for(add, "v6e", "4096x256:bf16", "4096x256:bf16").summary())
"""

from __future__ import annotations

from ._env import install_lazy_library_ops, quiet_libtpu_defaults

quiet_libtpu_defaults()  # before jax/libtpu start: no "could not determine TPU accelerator type" on cpu hosts

from .chips import CHIPS, Chip, get_chip  # noqa: E402
from .dsl import (
    REGISTRY,
    BackwardContext,
    Config,
    Launch,
    OutSpec,
    TensorSpec,
    TpuKernel,
    Tunable,
    TunableSpace,
    bucket,
    cdiv,
    current_interpret_mode,
    estimate_vmem,
    interpret_mode,
    like,
    mask_tail,
    set_interpret_mode,
    tail_valid,
    tpu_kernel,
)
from .errors import (
    ArgumentError,
    BackendUnavailableError,
    BlockShapeError,
    ChipError,
    ConfigError,
    DeviceError,
    DTypeError,
    KernelBodyError,
    KernelRuntimeError,
    KernelDefinitionError,
    LoweringError,
    NotSupportedError,
    PerformanceWarning,
    TpuKernelError,
    VmemError,
)

__version__ = "0.1.0"

from . import _plugins  # noqa: E402

_plugins.install()  # dispatch, torch ops, Helion, DTensor rules: registered into the dsl's hooks

from . import autotune  # noqa: E402  (registers the tuning-DB config resolver)

install_lazy_library_ops(_plugins.load_library)  # torch.ops.tpukernels.* load the library on first use


def compile_for(kernel, chip, *args, **kwargs):
    """Compile ``kernel`` for a TPU chip without a TPU; see :func:`tpukernels.targets.compile_only.compile_for`."""
    from .targets.compile_only import compile_for as _compile_for

    return _compile_for(kernel, chip, *args, **kwargs)


def jax_call(kernel, *arrays, config=None, interpret=None, **statics):
    """Run ``kernel`` on jax arrays, trace-safe (``jax.jit`` / ``vmap`` / ``shard_map`` / ``grad``); see
    :func:`tpukernels.targets.jax_entry.jax_call`."""
    from .targets.jax_entry import jax_call as _jax_call

    return _jax_call(kernel, *arrays, config=config, interpret=interpret, **statics)


def lower(kernel, *args, config=None, mode="mosaic", **kwargs):
    """The :class:`tpukernels.lowering.Lowered` for example args (``.fn`` is the jitted JAX function)."""
    from .lowering import lower as _lower
    from .targets.compile_only import example_specs

    specs, statics = example_specs(kernel, args, kwargs)
    return _lower(kernel, specs, statics, config, mode=mode)


__all__ = [
    "CHIPS", "Chip", "get_chip", "REGISTRY", "BackwardContext", "Config", "Launch", "OutSpec", "TensorSpec",
    "TpuKernel", "Tunable", "TunableSpace", "bucket", "cdiv", "current_interpret_mode", "estimate_vmem",
    "interpret_mode", "like", "mask_tail", "set_interpret_mode", "tail_valid", "tpu_kernel", "compile_for", "jax_call",
    "lower", "ArgumentError", "BackendUnavailableError", "BlockShapeError", "ChipError", "ConfigError",
    "DeviceError", "DTypeError", "KernelBodyError", "KernelDefinitionError", "KernelRuntimeError", "LoweringError",
    "NotSupportedError", "PerformanceWarning", "TpuKernelError", "VmemError", "__version__",
]
