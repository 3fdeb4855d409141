"""Typed errors raised by tpukernels.

Every error names the argument (or kernel / chip) at fault and the rule it broke, and is raised before
any compilation where the information exists. All derive from :class:`TpuKernelError` (a ``ValueError``
so that generic callers that catch bad-input ``ValueError`` keep working).
"""

from __future__ import annotations


class TpuKernelError(ValueError):
    """Base class of every tpukernels error."""


class KernelDefinitionError(TpuKernelError):
    """The ``@tpu_kernel`` definition itself is malformed (annotations, tunables, names)."""


class ArgumentError(TpuKernelError):
    """A call argument breaks a rule: rank, shape agreement, count, or a static value out of range."""


class DTypeError(ArgumentError):
    """A tensor argument has a dtype the kernel or the TPU cannot handle (e.g. float64, int64)."""


class DeviceError(ArgumentError):
    """Tensor arguments live on an unsupported device, or on different devices."""


class ConfigError(TpuKernelError):
    """A tuning config names an unknown tunable, or violates a declared constraint."""


class BlockShapeError(TpuKernelError):
    """A BlockSpec's block shape breaks the TPU (8, 128) tiling rule for its array."""


class VmemError(TpuKernelError):
    """The estimated (or compiler-reported) VMEM footprint exceeds the chip's capacity or scoped limit.

    Attributes (None when unknown): ``estimate_bytes`` (tpukernels' estimate of the footprint, bytes),
    ``limit_bytes`` (the limit it exceeded, bytes).
    """

    def __init__(self, message: str, *, estimate_bytes: int | None = None, limit_bytes: int | None = None):
        super().__init__(message)
        self.estimate_bytes, self.limit_bytes = estimate_bytes, limit_bytes


class ChipError(TpuKernelError):
    """Unknown TPU chip name, or a feature the chip does not have."""


class KernelBodyError(TpuKernelError):
    """The user's kernel body (or launch function) raised while tpukernels traced it."""


class LoweringError(TpuKernelError):
    """Pallas / Mosaic rejected the kernel while lowering or compiling it."""


class KernelRuntimeError(TpuKernelError):
    """The kernel failed while it ran: in ``interpret="tpu"`` mode Pallas's TPU interpreter found an
    out-of-bounds block index or DMA (an index map or a data-dependent index read past an operand: on a TPU
    the same access would read or write other memory)."""


class UnwrittenOutputError(KernelBodyError):
    """Part of a kernel output is written by no grid step (found from the out index maps before running),
    or, in interpret mode ``"tpu"``, a whole output block still holds the interpreter's NaN poison after the
    kernel ran on finite inputs (never written, or computed from uninitialized memory such as an unmasked
    partial tail block).

    Attributes: ``kernel`` (qualified name), ``output`` (output index), ``block`` (block index tuple, or
    None when unknown).
    """

    def __init__(self, message: str, *, kernel: str | None = None, output: int | None = None, block=None):
        super().__init__(message)
        self.kernel, self.output, self.block = kernel, output, block


class KernelRaceError(KernelRuntimeError):
    """Pallas's TPU interpreter's race detector (interpret mode ``"races"``) found a data race: two accesses
    to one buffer (a DMA and a load, two cores) not ordered by a semaphore wait or barrier."""


class NotSupportedError(TpuKernelError, NotImplementedError):
    """A well-formed request that an op does not support, e.g. a double backward (differentiating an op's
    gradient, ``torch.autograd.grad(..., create_graph=True)`` then backward) through an op whose backward is
    differentiable once.

    Attributes: ``op`` (the public op named in the message, or None).
    """

    def __init__(self, message: str, *, op: str | None = None):
        super().__init__(message)
        self.op = op


class BackendUnavailableError(TpuKernelError, ImportError):
    """An optional backend (libtpu for compile-only, torch_tpu for TPU tensors) is not installed."""


class PerformanceWarning(UserWarning):
    """A legal but slow choice, e.g. a bf16 block whose row count is not a multiple of 16."""
