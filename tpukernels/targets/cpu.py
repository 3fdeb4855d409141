"""cpu target: run the kernel in Pallas interpret mode on torch tensors shared with JAX through DLPack.

Inputs are shared zero-copy (``jax.dlpack.from_dlpack``) when contiguous; non-contiguous inputs are made
contiguous first (a copy, so the caller's tensor is never modified); outputs come back zero-copy with
``torch.from_dlpack``. Zero-size inputs are replaced by zero-size jax arrays (DLPack of empty storage is
not portable).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..dsl.kernel import TpuKernel
from ..dsl.modes import current_interpret_mode
from . import Plan, plan_for, signature_key


@functools.lru_cache(maxsize=1)
def _dlpack_importer():
    """``capsule -> jax.Array`` on the cpu device.

    ``jax.dlpack.from_dlpack`` spends ~20 µs per tensor in Python-level protocol checks; the jaxlib
    function it ends in (``dlpack_managed_tensor_to_buffer``) takes ~3 µs (``benchmarks/dispatch_overhead.py``).
    The private entry point is used when present, the public API otherwise.
    """
    import jax

    try:
        from jax._src.lib import _jax

        fn, dev = _jax.dlpack_managed_tensor_to_buffer, jax.devices("cpu")[0]
        from torch.utils.dlpack import to_dlpack

        return lambda t: fn(to_dlpack(t), dev, None)
    except (ImportError, AttributeError):
        return jax.dlpack.from_dlpack


@functools.lru_cache(maxsize=1)
def _dlpack_exporter():
    """``jax.Array -> torch.Tensor`` zero-copy (the direct jaxlib call: ~1 µs instead of ~4 µs)."""
    import torch

    try:
        from jax._src.lib import _jax
        from torch.utils.dlpack import from_dlpack

        fn = _jax.buffer_to_dlpack_managed_tensor
        return lambda a: from_dlpack(fn(a, stream=None))
    except (ImportError, AttributeError):
        return torch.from_dlpack


def to_jax(t):
    """torch CPU tensor -> jax array (zero-copy when contiguous and non-empty)."""
    if t.numel() == 0:
        import jax.numpy as jnp

        from ..dsl.dtypes import to_jax_dtype

        return jnp.zeros(tuple(t.shape), to_jax_dtype(t.dtype))
    if t.requires_grad:
        t = t.detach()
    return _dlpack_importer()(t.contiguous())


def _pad_rows(t, n: int):
    import torch

    pad = t.new_zeros((n - t.shape[0], *t.shape[1:]))
    return torch.cat([t.detach(), pad], dim=0)


def run_plan_cpu(plan: Plan, values: Sequence):
    import torch

    low = plan.lowered
    if plan.runner is None:
        plan.runner = low.compiled()
    if plan.pad_idx:
        arrays = [to_jax(_pad_rows(values[i], plan.n_bucket) if i in plan.pad_idx else values[i]) for i in plan.tensor_idx]
    else:
        arrays = [to_jax(values[i]) for i in plan.tensor_idx]
    try:
        outs = plan.runner(*arrays)
    except Exception as e:  # noqa: BLE001  (only the interpreter's out-of-bounds report is translated)
        err = _runtime_error(plan, e)
        if err is e:
            raise
        raise err from e
    export = _dlpack_exporter()
    res = [export(o) for o in outs]
    if plan.n_rows is not None:
        res = [r[: plan.n_rows].clone() if rows else r for r, rows in zip(res, plan.row_outs)]
    return res[0] if plan.single else tuple(res)


def _runtime_error(plan: Plan, e: Exception) -> Exception:
    """``e`` as a :class:`KernelRuntimeError` naming the kernel when it is Pallas's TPU interpreter reporting
    an out-of-bounds block index or DMA (it arrives as a ``JaxRuntimeError`` from a host callback, the
    interpreter's ``IndexError`` text inside); any other error unchanged."""
    import re

    from ..errors import KernelRuntimeError

    text = str(e)
    m = re.search(r"(?:IndexError|ValueError): ([^\n]*[Oo]ut[- ]of[- ]bounds[^\n]*)", text)
    if m is None:
        return e
    return KernelRuntimeError(f"{plan.lowered.kernel.qualname}: {m.group(1).strip()} (interpret mode 'tpu' checks every block index and "
                              f"DMA; on a TPU this access would touch memory outside the operand)")


def run_torch_cpu(kernel: TpuKernel, values: Sequence, config_json: str | None):
    """Run ``kernel`` on CPU torch tensors in the current interpret mode (plans cached per signature)."""
    mode = current_interpret_mode()
    key = signature_key(values, config_json, mode)
    plan = kernel._plans.get(key)
    if plan is None:
        plan = plan_for(kernel, values, config_json, mode)
        kernel._plans[key] = plan
    return run_plan_cpu(plan, values)
