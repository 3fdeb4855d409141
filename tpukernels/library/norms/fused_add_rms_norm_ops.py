"""Fused residual add + RMSNorm: the forward kernel (``tpukernels::fused_add_rms_norm_fwd``; its backward is
:data:`~.rms_norm.rms_norm_bwd` with the residual gradient), the public op :func:`fused_add_rms_norm` and its
float64 reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import dsl as tk
from ...errors import ArgumentError, DeviceError, DTypeError
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
    round_to as _round,
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
from .rms_norm_ops import rms_norm_bwd, rms_norm_reference, rms_scale as _rms_scale


def _fused_fwd_body(*refs, has_weight: bool, eps: float, offset: float, casting: str, round_f16: bool):
    x_ref, r_ref, *refs = refs
    w_ref = refs.pop(0) if has_weight else None
    y_ref, h_ref, rstd_ref = refs
    # new_residual is rounded to the input dtype first, so y == rms_norm(new_residual) exactly
    v = _round(x_ref[...].astype(F32) + r_ref[...].astype(F32), h_ref.dtype, round_f16)
    h_ref[...] = v.astype(h_ref.dtype)
    rstd = _rstd(v, eps)
    y_ref[...] = _rms_scale(v * rstd, w_ref, offset, casting, y_ref.dtype, round_f16)
    rstd_ref[...] = rstd


def _fused_fwd_sizes(x, residual, weight):
    h = x.shape[1]
    return (row_bytes(h, [x.dtype, residual.dtype, x.dtype, x.dtype], 1),
            vec_bytes(h, [weight.dtype] if weight is not None else []))


def _fused_fwd_out(x, residual, weight, eps, offset, casting, round_f16=False):
    return tk.like(x), tk.like(x), stat_out(x.shape[0])


@tk.tpu_kernel(
    _fused_fwd_body, name="fused_add_rms_norm_fwd", namespace=NAMESPACE, tunables=_tunables(),
    rows=("x", "residual"), out_shape=_fused_fwd_out,
    heuristic=lambda x, residual, weight, **_: _heuristic_rows(*_fused_fwd_sizes(x, residual, weight)),
)
def fused_add_rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float,
    casting: str, round_f16: bool, *, block_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm forward on rows (internal op; use :func:`fused_add_rms_norm`).

    Args:
        x, residual: ``[rows, H]``, same dtype (bf16/f32). weight: ``[1, H]`` or None. round_f16: inputs are
            float16 widened to float32: round new_residual (and n for casting="llama") to float16 precision.

    Returns:
        ``(y, new_residual = cast(x + residual), rstd [rows, 1] float32)``.
    """
    _check_dtypes(x, residual, weight)
    _check_2d("x", x)
    n, h = x.shape
    _check_2d("residual", residual, h)
    _check_vec("weight", weight, h)
    _check_casting(casting)
    bm = fit_block_rows(block_rows, n, *_fused_fwd_sizes(x, residual, weight))
    return tk.Launch(
        grid=(tk.cdiv(n, bm),),
        in_specs=[_row(bm, h), _row(bm, h)] + ([_vec(h)] if weight is not None else []),
        out_specs=[_row(bm, h), _row(bm, h), _stat(bm)],
        out_shape=_fused_fwd_out(x, residual, weight, eps, offset, casting),
        dimension_semantics=("parallel",),
        cost_estimate=_cost(6, n, h, 4 * _nbytes(x) + _nbytes(weight) + 4 * n),
        body_kwargs={"has_weight": weight is not None},
    )


@fused_add_rms_norm_fwd.def_backward(op="fused_add_rms_norm")
def _fused_add_rms_norm_fwd_backward(ctx, dy, dres, _drstd):
    # new_residual = x + residual feeds y and is an output itself: d(new_residual) = rms_bwd(dy) + dres
    dh, dw = rms_norm_bwd(dy, ctx.outputs[1], ctx.outputs[2], ctx.weight, dres, ctx.offset)
    return {"x": dh, "residual": dh, "weight": weight_grad(ctx, "weight", dw)}


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = DEFAULT_RMS_EPS,
    offset: float = 0.0, casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, one pass: ``new_residual = x + residual``, ``y = rms_norm(new_residual)``.

    Functional (inputs are not modified). ``new_residual`` is rounded to x.dtype before the norm, so ``y``
    equals :func:`rms_norm` of the returned ``new_residual``.

    Args:
        x, residual: ``[..., H]``, same shape and dtype (bf16/f16/f32). weight, eps, offset, casting: see
            :func:`rms_norm`.

    Returns:
        ``(y, new_residual)``, both shaped and typed like x; differentiable in x, residual and weight.

    Raises:
        As :func:`rms_norm`; also ArgumentError / DTypeError when residual's shape / dtype differ from x's.
    """
    op = "tpukernels.fused_add_rms_norm"
    check_number(op, eps=eps, offset=offset)
    return torch.ops.tpukernels.fused_add_rms_norm(x, residual, weight, eps, offset, casting)


def _fused_add_rms_norm_impl(x, residual, weight=None, eps=DEFAULT_RMS_EPS, offset=0.0, casting="llama"):
    op = "tpukernels.fused_add_rms_norm"
    h, eps, offset = check_rms_args(op, x, weight, eps, offset, casting)
    if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
        got = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise ArgumentError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {got}")
    if residual.dtype != x.dtype:
        raise DTypeError(f"{op}: residual dtype {residual.dtype} must equal x dtype {x.dtype}")
    if residual.device != x.device:
        raise DeviceError(f"{op}: residual is on {residual.device} but x is on {x.device}")
    y, new_res, _ = torch.ops.tpukernels.fused_add_rms_norm_fwd(
        widen(x).reshape(-1, h), widen(residual).reshape(-1, h), vec2d(weight), eps, offset, casting,
        x.dtype == torch.float16,
    )
    return y.reshape(x.shape).to(x.dtype), new_res.reshape(x.shape).to(x.dtype)


# the public torch op: CompositeImplicitAutograd, so autograd / torch.compile see the kernel ops
LIB.define(f"fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight=None, float eps={DEFAULT_RMS_EPS!r}, "
           "float offset=0.0, str casting='llama') -> (Tensor, Tensor)")
LIB.impl("fused_add_rms_norm", _fused_add_rms_norm_impl, "CompositeImplicitAutograd")


def fused_add_rms_norm_reference(x, residual, weight=None, eps=DEFAULT_RMS_EPS, offset=0.0):
    """float64 ``(rms_norm(x + residual), x + residual)``; the sum is exact in float64."""
    h = x.double() + residual.double()
    return rms_norm_reference(h, weight, eps, offset), h
