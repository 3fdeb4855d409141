"""RMSNorm: the forward and backward kernels (``tpukernels::rms_norm_fwd`` / ``rms_norm_bwd``), their
bodies and tunable space, the public op :func:`rms_norm` and its float64 reference.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl

from ... import dsl as tk
from ...errors import ArgumentError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .common import (
    DEFAULT_RMS_EPS,
    F32,
    LIB,
    NAMESPACE,
    check_2d as _check_2d,
    check_casting as _check_casting,
    check_dtypes as _check_dtypes,
    check_number,
    check_rms_args,
    check_vec as _check_vec,
    cost as _cost,
    fit_block_rows,
    heuristic_rows as _heuristic_rows,
    inv_rms as _rstd,
    masked_row_sum as _masked_row_sum,
    round_to,
    row_bytes,
    row_spec as _row,
    spec_nbytes as _nbytes,
    stat as _stat,
    stat_out,
    tunables as _tunables,
    vec as _vec,
    vec2d,
    vec_bytes,
    weight_grad,
    widen,
)


def rms_scale(n, w_ref, offset, casting, dtype, round_f16):
    """``y`` from the float32 normalized rows ``n`` (casting points: see module docstring)."""
    if w_ref is None:
        return n.astype(dtype)
    bm, h = n.shape
    if (casting == "llama" and offset == 0.0 and not round_f16 and bm % 16 == 0
            and np.dtype(dtype) == np.dtype(jnp.bfloat16) and np.dtype(w_ref.dtype) == np.dtype(jnp.bfloat16)):
        # bf16 x bf16 product: exact in float32, so rounding it once equals HF's ``w * n.to(bf16)``; multiplied
        # as bf16 it saves the float32 round trip of n (tpu7x is VALU-bound here: 46.4 -> 36.5 us model
        # estimate at 8192x4096). The weight is broadcast to one (16, H) bf16 tile row in float32 first.
        w16 = jnp.broadcast_to(w_ref[...].astype(F32), (16, h)).astype(dtype)
        return (n.astype(dtype).reshape(bm // 16, 16, h) * w16[None]).reshape(bm, h)
    scale = offset + w_ref[...].astype(F32)  # the offset is added in float32, never in the weight dtype
    if casting == "llama":
        n = round_to(n, dtype, round_f16)
    return (n * scale).astype(dtype)


_rms_scale = rms_scale  # the kernel bodies here keep this name: the tuning DB keys them by their source


def _rms_fwd_body(*refs, has_weight: bool, eps: float, offset: float, casting: str, round_f16: bool):
    x_ref, *refs = refs
    w_ref = refs.pop(0) if has_weight else None
    y_ref, rstd_ref = refs
    x = x_ref[...].astype(F32)
    rstd = _rstd(x, eps)
    y_ref[...] = _rms_scale(x * rstd, w_ref, offset, casting, y_ref.dtype, round_f16)
    rstd_ref[...] = rstd


def _rms_bwd_body(*refs, has_weight: bool, has_dres: bool, offset: float, n_rows: int):
    dy_ref, x_ref, rstd_ref, *refs = refs
    w_ref = refs.pop(0) if has_weight else None
    dres_ref = refs.pop(0) if has_dres else None
    dx_ref, dw_ref = refs

    @pl.when(pl.program_id(0) == 0)
    def _init():
        dw_ref[...] = jnp.zeros_like(dw_ref)

    # dx = rstd * (g - n * mean(g * n)) with n = x * rstd, g = dy * s, s = offset + w, rearranged to share
    # products (11 VALU ops per element instead of 12; the kernel is VALU-bound on tpu7x):
    #   q = dy * rstd, p = q * x (= dy * n), mean(g * n) = mean(p * s), dx = q * s - (rstd**2 * mean(p * s)) * x
    x = x_ref[...].astype(F32)
    rstd = rstd_ref[...]
    q = dy_ref[...].astype(F32) * rstd
    p = q * x
    if w_ref is not None:
        s = offset + w_ref[...].astype(F32)
        dx = q * s - (rstd * rstd * jnp.mean(p * s, axis=-1, keepdims=True)) * x
    else:
        dx = q - (rstd * rstd * jnp.mean(p, axis=-1, keepdims=True)) * x
    if dres_ref is not None:
        dx = dx + dres_ref[...].astype(F32)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dw_ref[...] += _masked_row_sum(p, n_rows)


def _rms_fwd_sizes(x, weight):
    h = x.shape[1]
    return row_bytes(h, [x.dtype, x.dtype], 1), vec_bytes(h, [weight.dtype] if weight is not None else [])


def _rms_fwd_out(x, weight, eps, offset, casting, round_f16=False):
    return tk.like(x), stat_out(x.shape[0])


@tk.tpu_kernel(
    _rms_fwd_body, name="rms_norm_fwd", namespace=NAMESPACE, tunables=_tunables(), rows=("x",),
    heuristic=lambda x, weight, **_: _heuristic_rows(*_rms_fwd_sizes(x, weight)), out_shape=_rms_fwd_out,
)
def rms_norm_fwd(
    x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float, casting: str,
    round_f16: bool, *, block_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm forward on rows (internal op ``tpukernels::rms_norm_fwd``; use :func:`rms_norm`).

    Args:
        x: ``[rows, H]`` bf16/f32. weight: ``[1, H]`` bf16/f32, or None.
        eps: added to the mean square (float32). offset: added to the weight in float32.
        casting: ``"llama"`` or ``"gemma"`` (module docstring).
        round_f16: x is float16 widened to float32 by the caller: round ``n`` (casting="llama") to float16
            precision inside the kernel.

    Returns:
        ``(y [rows, H] x.dtype, rstd [rows, 1] float32)``; ``rstd`` carries no gradient.

    Raises:
        DTypeError: a float16 tensor (Mosaic cannot load float16; widen it, as the public op does).
    """
    _check_dtypes(x, weight)
    _check_2d("x", x)
    n, h = x.shape
    _check_vec("weight", weight, h)
    _check_casting(casting)
    bm = fit_block_rows(block_rows, n, *_rms_fwd_sizes(x, weight))
    return tk.Launch(
        grid=(tk.cdiv(n, bm),),
        in_specs=[_row(bm, h)] + ([_vec(h)] if weight is not None else []),
        out_specs=[_row(bm, h), _stat(bm)],
        out_shape=_rms_fwd_out(x, weight, eps, offset, casting),
        dimension_semantics=("parallel",),
        cost_estimate=_cost(5, n, h, 2 * _nbytes(x) + _nbytes(weight) + 4 * n),
        body_kwargs={"has_weight": weight is not None},
    )


def _rms_bwd_sizes(dy, x, weight, dres):
    h = x.shape[1]
    rows = [dy.dtype, x.dtype, x.dtype] + ([dres.dtype] if dres is not None else [])
    return row_bytes(h, rows, 1), vec_bytes(h, [np.float32] + ([weight.dtype] if weight is not None else []))


def _rms_bwd_out(dy, x, rstd, weight, dres, offset):
    return tk.like(x), tk.OutSpec((1, x.shape[1]), F32, rows=False)


@tk.tpu_kernel(
    _rms_bwd_body, name="rms_norm_bwd", namespace=NAMESPACE, tunables=_tunables(),
    rows=("dy", "x", "rstd", "dres"), out_shape=_rms_bwd_out,
    heuristic=lambda dy, x, rstd, weight, dres, **_: _heuristic_rows(*_rms_bwd_sizes(dy, x, weight, dres)),
)
def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: Optional[torch.Tensor],
    dres: Optional[torch.Tensor], offset: float, *, block_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm backward on rows (internal op ``tpukernels::rms_norm_bwd``; bf16/f32 tensors).

    Args:
        dy: ``[rows, H]`` gradient of y. x: ``[rows, H]`` the normalized input. rstd: ``[rows, 1]`` float32
        from the forward. weight: ``[1, H]`` or None. dres: ``[rows, H]`` added to dx (the fused-add
        backward: gradient of new_residual), or None. offset: as in the forward.

    Returns:
        ``(dx [rows, H] x.dtype, dweight [1, H] float32)`` (float32 accumulation over all rows; zeros
        when weight is None).
    """
    _check_dtypes(dy, x, weight, dres)
    _check_2d("x", x)
    n, h = x.shape
    _check_2d("dy", dy, h)
    _check_vec("weight", weight, h)
    if tuple(rstd.shape) != (n, 1):
        raise ArgumentError(f"{NAMESPACE}: rstd must be [{n}, 1] float32, got {tuple(rstd.shape)}")
    if dres is not None:
        _check_2d("dres", dres, h)
    bm = fit_block_rows(block_rows, n, *_rms_bwd_sizes(dy, x, weight, dres))
    row = _row(bm, h)
    return tk.Launch(
        grid=(tk.cdiv(n, bm),),
        in_specs=[row, row, _stat(bm)] + ([_vec(h)] if weight is not None else []) + ([row] if dres is not None else []),
        out_specs=[row, _vec(h)],
        out_shape=_rms_bwd_out(dy, x, rstd, weight, dres, offset),
        dimension_semantics=("arbitrary",),  # dweight accumulates across the row grid
        cost_estimate=_cost(8, n, h, _nbytes(dy, x, rstd, weight, dres) + _nbytes(x) + 4 * h),
        body_kwargs={"has_weight": weight is not None, "has_dres": dres is not None, "n_rows": int(n)},
    )


@rms_norm_fwd.def_backward(op="rms_norm")
def _rms_norm_fwd_backward(ctx, dy, _drstd):
    dx, dw = rms_norm_bwd(dy, ctx.x, ctx.outputs[1], ctx.weight, None, ctx.offset)
    return {"x": dx, "weight": weight_grad(ctx, "weight", dw)}


def rms_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = DEFAULT_RMS_EPS, offset: float = 0.0,
    casting: str = "llama",
) -> torch.Tensor:
    """RMSNorm over the last dim: ``y = x / sqrt(mean(x**2) + eps) * (offset + weight)``.

    Args:
        x: ``[..., H]`` bfloat16, float16 or float32; any layout (strided / transposed / sliced views give
            the same result as ``.contiguous()``), any number of rows (including 0).
        weight: ``[H]`` (any of the three float dtypes, upcast to float32), or None for no scale.
        eps: added to the float32 mean square (default ``1e-6``, never taken from x's dtype).
        offset: added to the weight in float32: ``1.0`` gives Gemma's ``(1 + w)``. Needs a weight.
        casting: ``"llama"`` (default): round the normalized value to x.dtype, then multiply by the scale
            (HF ``LlamaRMSNorm``); ``"gemma"``: multiply in float32, round once (HF ``GemmaRMSNorm``).

    Returns:
        ``y``: same shape and dtype as x. Differentiable in x and weight (Pallas backward kernels).

    Raises:
        ArgumentError: x not ``[..., H]`` with H >= 1, weight not ``[H]``, eps < 0 or not finite, unknown
            casting, offset != 0 without weight. DTypeError: dtype not bf16/f16/f32. DeviceError: weight on
            another device.
    """
    check_number("tpukernels.rms_norm", eps=eps, offset=offset)
    return torch.ops.tpukernels.rms_norm(x, weight, eps, offset, casting)


def _rms_norm_impl(x, weight=None, eps=DEFAULT_RMS_EPS, offset=0.0, casting="llama"):
    h, eps, offset = check_rms_args("tpukernels.rms_norm", x, weight, eps, offset, casting)
    half = x.dtype == torch.float16
    y, _ = torch.ops.tpukernels.rms_norm_fwd(widen(x).reshape(-1, h), vec2d(weight), eps, offset, casting, half)
    return y.reshape(x.shape).to(x.dtype)


# the public torch op: CompositeImplicitAutograd, so autograd / torch.compile see the kernel ops
LIB.define(f"rms_norm(Tensor x, Tensor? weight=None, float eps={DEFAULT_RMS_EPS!r}, float offset=0.0, "
           "str casting='llama') -> Tensor")
LIB.impl("rms_norm", _rms_norm_impl, "CompositeImplicitAutograd")


def rms_norm_reference(x, weight=None, eps=DEFAULT_RMS_EPS, offset=0.0):
    """float64 RMSNorm of the given (low-precision) values, no intermediate rounding (tests' ground truth)."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (offset + weight.double())
