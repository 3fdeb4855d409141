"""LayerNorm: the forward and backward kernels (``tpukernels::layer_norm_fwd`` / ``layer_norm_bwd``), their
bodies and tunable space, the public op :func:`layer_norm` and its float64 reference.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl

from ... import dsl as tk
from ...errors import ArgumentError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .common import (
    DEFAULT_LAYER_NORM_EPS,
    F32,
    LIB,
    NAMESPACE,
    check_2d as _check_2d,
    check_dtypes as _check_dtypes,
    check_float,
    check_number,
    check_param,
    check_vec as _check_vec,
    check_x,
    cost as _cost,
    fit_block_rows,
    heuristic_rows as _heuristic_rows,
    masked_row_sum as _masked_row_sum,
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


def _ln_fwd_body(*refs, has_weight: bool, has_bias: bool, eps: float):
    x_ref, *refs = refs
    w_ref = refs.pop(0) if has_weight else None
    b_ref = refs.pop(0) if has_bias else None
    y_ref, mean_ref, rstd_ref = refs
    x = x_ref[...].astype(F32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    d = x - mean
    rstd = jax.lax.rsqrt(jnp.mean(d * d, axis=-1, keepdims=True) + eps)
    y = d * rstd
    if w_ref is not None:
        y = y * w_ref[...].astype(F32)
    if b_ref is not None:
        y = y + b_ref[...].astype(F32)
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _ln_bwd_body(*refs, has_weight: bool, n_rows: int):
    dy_ref, x_ref, mean_ref, rstd_ref, *refs = refs
    w_ref = refs.pop(0) if has_weight else None
    dx_ref, dw_ref, db_ref = refs

    @pl.when(pl.program_id(0) == 0)
    def _init():
        dw_ref[...] = jnp.zeros_like(dw_ref)
        db_ref[...] = jnp.zeros_like(db_ref)

    dy = dy_ref[...].astype(F32)
    rstd = rstd_ref[...]
    xhat = (x_ref[...].astype(F32) - mean_ref[...]) * rstd
    t = dy * xhat  # dweight term
    if w_ref is not None:
        w = w_ref[...].astype(F32)
        g, gx = dy * w, t * w  # g * xhat == (dy * xhat) * w
    else:
        g, gx = dy, t
    c1 = jnp.mean(g, axis=-1, keepdims=True)
    c2 = jnp.mean(gx, axis=-1, keepdims=True)
    # rstd * (g - c1 - xhat * c2) with the per-row factors folded: g * rstd - xhat * (rstd * c2) - rstd * c1
    dx_ref[...] = (g * rstd - xhat * (rstd * c2) - rstd * c1).astype(dx_ref.dtype)
    dw_ref[...] += _masked_row_sum(t, n_rows)
    db_ref[...] += _masked_row_sum(dy, n_rows)


def _ln_fwd_sizes(x, weight, bias):
    h = x.shape[1]
    return row_bytes(h, [x.dtype, x.dtype], 2), vec_bytes(h, [v.dtype for v in (weight, bias) if v is not None])


def _ln_fwd_out(x, weight, bias, eps):
    return tk.like(x), stat_out(x.shape[0]), stat_out(x.shape[0])


@tk.tpu_kernel(
    _ln_fwd_body, name="layer_norm_fwd", namespace=NAMESPACE, tunables=_tunables(), rows=("x",),
    heuristic=lambda x, weight, bias, **_: _heuristic_rows(*_ln_fwd_sizes(x, weight, bias)), out_shape=_ln_fwd_out,
)
def layer_norm_fwd(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float, *, block_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm forward on rows (internal op ``tpukernels::layer_norm_fwd``; use :func:`layer_norm`).

    Args:
        x: ``[rows, H]`` bf16/f32. weight, bias: ``[1, H]`` bf16/f32, or None. eps: float32.

    Returns:
        ``(y [rows, H] x.dtype, mean [rows, 1] float32, rstd [rows, 1] float32)``.
    """
    _check_dtypes(x, weight, bias)
    _check_2d("x", x)
    n, h = x.shape
    _check_vec("weight", weight, h)
    _check_vec("bias", bias, h)
    bm = fit_block_rows(block_rows, n, *_ln_fwd_sizes(x, weight, bias))
    return tk.Launch(
        grid=(tk.cdiv(n, bm),),
        in_specs=[_row(bm, h)] + [_vec(h) for v in (weight, bias) if v is not None],
        out_specs=[_row(bm, h), _stat(bm), _stat(bm)],
        out_shape=_ln_fwd_out(x, weight, bias, eps),
        dimension_semantics=("parallel",),
        cost_estimate=_cost(7, n, h, 2 * _nbytes(x) + _nbytes(weight, bias) + 8 * n),
        body_kwargs={"has_weight": weight is not None, "has_bias": bias is not None},
    )


def _ln_bwd_sizes(dy, x, weight):
    h = x.shape[1]
    return (row_bytes(h, [dy.dtype, x.dtype, x.dtype], 2),
            vec_bytes(h, [np.float32, np.float32] + ([weight.dtype] if weight is not None else [])))


def _ln_bwd_out(dy, x, mean, rstd, weight):
    h = x.shape[1]
    return tk.like(x), tk.OutSpec((1, h), F32, rows=False), tk.OutSpec((1, h), F32, rows=False)


@tk.tpu_kernel(
    _ln_bwd_body, name="layer_norm_bwd", namespace=NAMESPACE, tunables=_tunables(),
    rows=("dy", "x", "mean", "rstd"), out_shape=_ln_bwd_out,
    heuristic=lambda dy, x, mean, rstd, weight, **_: _heuristic_rows(*_ln_bwd_sizes(dy, x, weight)),
)
def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: Optional[torch.Tensor],
    *, block_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm backward on rows (internal op ``tpukernels::layer_norm_bwd``).

    Returns:
        ``(dx [rows, H] x.dtype, dweight [1, H] float32, dbias [1, H] float32)``, float32 accumulation over
        all rows.
    """
    _check_dtypes(dy, x, weight)
    _check_2d("x", x)
    n, h = x.shape
    _check_2d("dy", dy, h)
    _check_vec("weight", weight, h)
    for name, s in (("mean", mean), ("rstd", rstd)):
        if tuple(s.shape) != (n, 1):
            raise ArgumentError(f"{NAMESPACE}: {name} must be [{n}, 1] float32, got {tuple(s.shape)}")
    bm = fit_block_rows(block_rows, n, *_ln_bwd_sizes(dy, x, weight))
    row = _row(bm, h)
    return tk.Launch(
        grid=(tk.cdiv(n, bm),),
        in_specs=[row, row, _stat(bm), _stat(bm)] + ([_vec(h)] if weight is not None else []),
        out_specs=[row, _vec(h), _vec(h)],
        out_shape=_ln_bwd_out(dy, x, mean, rstd, weight),
        dimension_semantics=("arbitrary",),  # dweight / dbias accumulate across the row grid
        cost_estimate=_cost(10, n, h, _nbytes(dy, x, mean, rstd, weight) + _nbytes(x) + 8 * h),
        body_kwargs={"has_weight": weight is not None, "n_rows": int(n)},
    )


@layer_norm_fwd.def_backward(op="layer_norm")
def _layer_norm_fwd_backward(ctx, dy, _dmean, _drstd):
    dx, dw, db = layer_norm_bwd(dy, ctx.x, ctx.outputs[1], ctx.outputs[2], ctx.weight)
    return {"x": dx, "weight": weight_grad(ctx, "weight", dw), "bias": weight_grad(ctx, "bias", db)}


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
    eps: float = DEFAULT_LAYER_NORM_EPS,
) -> torch.Tensor:
    """LayerNorm over the last dim: ``y = (x - mean) / sqrt(var + eps) * weight + bias`` (biased variance).

    Computed in float32 and rounded once to x.dtype (as ``torch.nn.functional.layer_norm``).

    Args:
        x: ``[..., H]`` bf16/f16/f32, any layout. weight, bias: ``[H]`` or None. eps: default ``1e-5``.

    Returns:
        ``y`` shaped and typed like x; differentiable in x, weight and bias.

    Raises:
        ArgumentError, DTypeError, DeviceError: as :func:`rms_norm`.
    """
    check_number("tpukernels.layer_norm", eps=eps)
    return torch.ops.tpukernels.layer_norm(x, weight, bias, eps)


def _layer_norm_impl(x, weight=None, bias=None, eps=DEFAULT_LAYER_NORM_EPS):
    op = "tpukernels.layer_norm"
    h = check_x(op, x)
    check_param(op, "weight", weight, x, h)
    check_param(op, "bias", bias, x, h)
    eps = check_float(op, "eps", eps, 0.0)
    y, _, _ = torch.ops.tpukernels.layer_norm_fwd(widen(x).reshape(-1, h), vec2d(weight), vec2d(bias), eps)
    return y.reshape(x.shape).to(x.dtype)


# the public torch op: CompositeImplicitAutograd, so autograd / torch.compile see the kernel ops
LIB.define(f"layer_norm(Tensor x, Tensor? weight=None, Tensor? bias=None, float eps={DEFAULT_LAYER_NORM_EPS!r}) "
           "-> Tensor")
LIB.impl("layer_norm", _layer_norm_impl, "CompositeImplicitAutograd")


def layer_norm_reference(x, weight=None, bias=None, eps=DEFAULT_LAYER_NORM_EPS):
    """float64 LayerNorm of the given values (biased variance, as torch)."""
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    y = (xd - mean) * torch.rsqrt((xd - mean).pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    return y if bias is None else y + bias.double()
