"""cpu target: run the kernel in Pallas interpret mode on torch tensors shared with JAX through DLPack.

Inputs are shared zero-copy (``jax.dlpack.from_dlpack``) when their strides are the standard row-major ones;
other inputs are given them first (:func:`row_major`: a view for a torch-"contiguous" tensor whose size-1
dimensions carry other strides, a copy otherwise, so the caller's tensor is never modified); outputs come back zero-copy with
``torch.from_dlpack``. Zero-size inputs are replaced by zero-size jax arrays (DLPack of empty storage is
not portable).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
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


def row_major_strides(shape) -> tuple[int, ...]:
    """The standard row-major (C-order) strides of ``shape``, in elements; size-1 dimensions included."""
    strides, acc = [], 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


_cached_strides = functools.lru_cache(maxsize=256)(row_major_strides)  # ~0.1 µs instead of ~5 µs per input


def row_major(t, copy_only: bool = False):
    """``t`` with the standard row-major strides, which DLPack consumers such as XLA read as the layout.

    torch calls a tensor contiguous whatever the strides of its size-1 dimensions are
    (``torch.randn(2, 1, 4, 32).transpose(1, 2)`` has strides ``(128, 32, 128, 1)``), and ``t.contiguous()``
    returns such a tensor unchanged; XLA would read those strides as a transposed layout and reject the
    array (``Computation was compiled for input layouts that disagree ...``). Such a tensor gets a
    zero-copy ``as_strided`` view with the standard strides (same elements: a size-1 dimension's stride
    addresses nothing); ``copy_only=True`` (device tensors) gives it a row-major copy instead. A
    non-contiguous tensor is copied (``contiguous()``). ``t`` itself is never modified.
    """
    if not t.is_contiguous():
        t = t.contiguous()
    shape = t.shape
    if 1 not in shape:  # contiguous with no size-1 dimension: the strides are the standard ones
        return t
    std = _cached_strides(shape)
    if t.stride() == std:
        return t
    if copy_only:
        import torch

        return t.clone(memory_format=torch.contiguous_format)
    return t.as_strided(shape, std)


def to_jax(t):
    """torch CPU tensor -> jax array (zero-copy when row-major and non-empty; see :func:`row_major`)."""
    if t.numel() == 0:
        import jax.numpy as jnp

        from ..dsl.dtypes import to_jax_dtype

        return jnp.zeros(tuple(t.shape), to_jax_dtype(t.dtype))
    if t.requires_grad:
        t = t.detach()
    return _dlpack_importer()(row_major(t))


def _pad_rows(t, n: int):
    import torch

    pad = t.new_zeros((n - t.shape[0], *t.shape[1:]))
    return torch.cat([t.detach(), pad], dim=0)


def run_plan_cpu(plan: Plan, values: Sequence):
    import torch

    low = plan.lowered
    if plan.runner is None:
        plan.runner = low.compiled()
    if low.mode == "fast" and low.resolved.launch is not None and low.resolved.launch.num_scalar_prefetch \
            and low.resolved.launch.prefetch is None:
        _check_prefetch_index_maps(plan, values)
    if plan.pad_idx:
        arrays = [to_jax(_pad_rows(values[i], plan.n_bucket) if i in plan.pad_idx else values[i]) for i in plan.tensor_idx]
    else:
        arrays = [to_jax(values[i]) for i in plan.tensor_idx]
    t0 = time.perf_counter()
    try:
        if low.mode == "fast":
            outs = plan.runner(*arrays)
        else:  # the TPU interpreter's checks raise inside io_callbacks: their tracebacks are not logged
            with _quiet_io_callback_log():
                outs = plan.runner(*arrays)
    except Exception as e:  # noqa: BLE001  (only the interpreter's out-of-bounds report is translated)
        err = _runtime_error(plan, e)
        if err is e:
            raise
        raise err from e
    if not _SAID_SLOW and time.perf_counter() - t0 > SLOW_CALL_S:
        _say_slow(low, time.perf_counter() - t0)
    if low.mode != "fast":
        _check_after_run(plan, values, outs)
    export = _dlpack_exporter()
    res = [export(o) for o in outs]
    if plan.n_rows is not None:
        res = [r[: plan.n_rows].clone() if rows else r for r, rows in zip(res, plan.row_outs)]
    return res[0] if plan.single else tuple(res)


class _DropIoCallbackTraceback:
    """Logging filter: drops jax's ``"jax.io_callback failed"`` record (a full traceback on stderr) while a
    checked interpret run is in progress; the error itself still propagates and becomes a typed error."""

    @staticmethod
    def filter(record) -> bool:
        return not str(record.msg).startswith("jax.io_callback failed")


@contextlib.contextmanager
def _quiet_io_callback_log():
    import logging

    logger = logging.getLogger("jax._src.callback")
    logger.addFilter(_DropIoCallbackTraceback)
    try:
        yield
    finally:
        logger.removeFilter(_DropIoCallbackTraceback)


#: a cpu (interpret-mode) call longer than this, in seconds, gets the one-time "interpret mode is slow" note
SLOW_CALL_S = 5.0
_SAID_SLOW = False


def _say_slow(low, seconds: float) -> None:
    """Once per process: interpret mode simulates the TPU on the cpu, so big shapes take long (not a hang)."""
    global _SAID_SLOW
    import logging

    _SAID_SLOW = True
    hint = ("mode 'tpu' checks every access; mode 'fast' (TPUKERNELS_INTERPRET=fast) is several times quicker"
            if low.mode != "fast" else "smaller shapes run proportionally faster")
    logging.getLogger("tpukernels").warning(
        "tpukernels: %s took %.1f s on the cpu: Pallas interpret mode simulates the TPU kernel step by step, so "
        "large shapes are slow here (a TPU runs them in micro- to milliseconds); %s. Said once per process.",
        low.kernel.qualname, seconds, hint)


def _check_prefetch_index_maps(plan: Plan, values: Sequence) -> None:
    """Fast interpret mode clamps an out-of-bounds block read silently (XLA's dynamic_slice), where mode
    ``"tpu"`` raises: evaluate the data-dependent index maps on this call's scalar-prefetch values first and
    raise :class:`KernelRuntimeError` naming the argument whose block would start past its end."""
    from ..dsl.validate import check_index_maps
    from ..errors import KernelRuntimeError

    low = plan.lowered
    launch = low.resolved.launch
    n = launch.num_scalar_prefetch
    present = [s for s in low.resolved.specs if s is not None]
    pref = [values[i].detach().cpu().numpy() for i in plan.tensor_idx[:n]]
    shapes = [tuple(values[i].shape) for i in plan.tensor_idx[n:]]
    if plan.pad_idx:
        shapes = [tuple(s.shape) for s in present[n:]]
    check_index_maps(low.kernel.qualname, launch.grid, [(s.name, sp, shp) for sp, s, shp in
                                                        zip(launch.in_specs, present[n:], shapes)], (),
                     prefetch=pref, error=KernelRuntimeError)


def _races_found() -> bool:
    """Pallas's TPU interpreter flagged a data race in the kernel it ran last (mode ``"races"``)."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:  # another jax layout: no report to read
        return False
    races = getattr(ipc, "races", None)
    return bool(getattr(races, "races_found", False))


def _all_nan_block(out, block: tuple) -> "tuple | None":
    """The first block (index tuple) of ``out`` whose in-bounds elements are all NaN, or None."""
    import numpy as np

    m = np.isnan(out)
    if not m.any():
        return None
    if not block or len(block) != m.ndim:
        return (0,) * m.ndim if m.all() else None
    pad = [(0, -(-s // b) * b - s) for s, b in zip(m.shape, block)]
    m = np.pad(m, pad, constant_values=True)
    shaped = m.reshape([x for s, b in zip(m.shape, block) for x in (s // b, b)])
    full = shaped.all(axis=tuple(range(1, 2 * m.ndim, 2)))
    hit = np.argwhere(full)
    return tuple(int(v) for v in hit[0]) if len(hit) else None


def _check_after_run(plan: Plan, values: Sequence, outs) -> None:
    """Checked interpret modes (``"tpu"``, ``"races"``): typed errors for what the TPU interpreter's run shows.

    * ``"races"``: the interpreter's race detector fired -> :class:`KernelRaceError`.
    * an output block whose every element is still NaN although every floating-point input is finite: the
      interpreter poisons uninitialized memory with NaN, so no grid step wrote that block, or it was computed
      from uninitialized memory (an unmasked tail); a kernel that computes NaN from finite inputs fills a
      whole block with it only by a bug of its own ->
      :class:`UnwrittenOutputError` naming the kernel, the output and the block. Skipped when an input holds
      NaN/inf (NaN results may then be right).
    """
    import numpy as np
    import torch

    from ..dsl.validate import block_dims
    from ..errors import KernelRaceError, UnwrittenOutputError

    low = plan.lowered
    name = low.kernel.qualname
    if low.mode == "races" and _races_found():
        raise KernelRaceError(f"{name}: Pallas's TPU interpreter detected a data race (the report above names the "
                              f"buffer and both accesses): order them with a DMA/semaphore wait or a barrier")
    float_outs = [i for i, o in enumerate(outs) if np.issubdtype(np.dtype(o.dtype), np.floating) or
                  np.dtype(o.dtype).name == "bfloat16"]
    if not float_outs:
        return
    for i in plan.tensor_idx:
        v = values[i]
        if v.is_floating_point() and v.numel():
            w = v if v.element_size() > 1 else v.float()  # torch has no isfinite for float8 dtypes
            if not bool(torch.isfinite(w).all()):
                return
    launch = low.resolved.launch  # None for front-ends that build their own BlockSpecs (Helion)
    specs = launch.out_spec_list if launch is not None else ()
    aliased = set(low.input_output_aliases.values())
    for i in float_outs:
        if i in aliased:
            continue
        spec = specs[i] if i < len(specs) else None
        bs = getattr(spec, "block_shape", None)
        block = block_dims(bs) if bs is not None else ()
        arr = np.asarray(outs[i].astype("float32")) if np.dtype(outs[i].dtype).name == "bfloat16" else np.asarray(outs[i])
        if arr.size == 0:
            continue
        hit = _all_nan_block(arr, block)
        if hit is not None:
            raise UnwrittenOutputError(
                f"{name}: output {i} {tuple(arr.shape)}: block {hit} (block shape {block or tuple(arr.shape)}) is "
                f"still all NaN after the kernel ran on finite inputs: interpret mode 'tpu' fills uninitialized "
                f"memory with NaN, so either no grid step wrote the block (a store skipped under pl.when, an "
                f"index_map that misses it) or what was written came from uninitialized memory (an unmasked "
                f"partial tail block, scratch read before it was set; see tpukernels.mask_tail)",
                kernel=name, output=i, block=hit)


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
    """Run ``kernel`` on CPU torch tensors in the current interpret mode (plans cached per signature and per
    ``TPUKERNELS_TARGET_CHIP``: the target chip decides VMEM checks, tuning-DB entries and chip-dependent launches)."""
    mode = current_interpret_mode()
    key = signature_key(values, config_json, (mode, os.environ.get("TPUKERNELS_TARGET_CHIP")))
    plan = kernel._plans.get(key)
    if plan is None:
        plan = plan_for(kernel, values, config_json, mode)
        kernel._plans[key] = plan
    return run_plan_cpu(plan, values)
