"""Gated RMSNorm, the norm hybrid (linear-attention / SSM) layers end with: forward and backward kernels
(``tpukernels::gated_rms_norm_fwd`` / ``gated_rms_norm_bwd``), their bodies and tunable space, the public op
:func:`gated_rms_norm` and its float64 reference.

Formulas (``x, z: [..., H]``, ``w: [H]``; statistics float32 per group of ``group_size`` channels;
``R`` rounds to x.dtype; ``silu(z) = z * sigmoid(z)`` in float32)::

    norm_before_gate=True  (Qwen3-Next / Qwen3.5 gated DeltaNet, fla ``FusedRMSNormGated``):
        n = x * rsqrt(mean_group(x**2) + eps)
        y = R(R(R(n) * w) * silu(z))        the inner R only when weight.dtype == x.dtype (HF's promotion)
    norm_before_gate=False (Mamba2, Nemotron-H, Granite-4 hybrid, Bamba: gate BEFORE the norm):
        h = x * silu(z)                    (float32, not rounded)
        n = h * rsqrt(mean_group(h**2) + eps)
        y = R(R(n) * w)

``casting="gemma"`` drops every intermediate R (float32 throughout, one rounding of y), as transformers'
``FalconH1RMSNormGated`` / ``KimiLinearRMSNormGated`` and the fused kernels of mamba_ssm / fla do; and
``activation="sigmoid"`` replaces ``silu(z)`` by ``sigmoid(z)`` (Kimi-Linear's KDA output norm).

With casting="llama" (default) these are exactly the casting points of transformers' ``Qwen3NextRMSNormGated``
(``w * n.to(dtype)`` in the promoted dtype, then ``* silu(gate.float())``, then ``.to(dtype)``) and
``MambaRMSNormGated`` (``w * n.to(dtype)``); the weight is applied as ``w`` (both init it to ones), never
``1 + w``. One difference from ``MambaRMSNormGated``: with a float32 weight and bfloat16 x, HF returns float32
(torch's promotion); this op always returns x.dtype (the same product, rounded once). mamba_ssm's ``rmsnorm_fn``
keeps ``n * w`` in float32 (no intermediate rounding): casting="gemma".

Backward (rounding treated as identity, as autograd of the HF modules does), ``r`` the group's rstd,
``mean_g`` the mean over the element's group, ``s = act(z)``, ``s' = act'(z)`` (silu:
``sigmoid(z) * (1 + z * (1 - sigmoid(z)))``; sigmoid: ``sigmoid(z) * (1 - sigmoid(z))``)::

    before: dn = dy * s * w;  dx = r * (dn - n * mean_g(dn * n));  dz = dy * n * w * s';
            dw = sum_rows(dy * s * n)
    after:  dn = dy * w;      dh = r * (dn - n * mean_g(dn * n));  dx = dh * s;  dz = dh * x * s';
            dw = sum_rows(dy * n)

Groups: ``group_size`` must divide H (None: one group of H). A group at a lane-aligned offset (group_size a
multiple of 128) is reduced from a static lane slice; otherwise from a lane mask (one pass per group). rstd is
an internal ``[rows, H / group_size]`` float32 output, the backward's input. float16 runs as float32 kernels
with the float16 roundings emulated (``round_f16``), as :func:`tpukernels.library.norms.rms_norm` does.
Tuning: ``block_rows`` (upper bound, lowered to fit :data:`VMEM_BUDGET_BYTES` with the body's float32
temporaries counted), shipped per chip in
``tpukernels/data/autotuning/<chip>/tpukernels.gated_rms_norm_{fwd,bwd}.json`` (``benchmarks/ship_tables.py``,
model objective); elsewhere the VMEM-aware heuristic.

Sources: transformers ``modeling_qwen3_next.Qwen3NextRMSNormGated``, ``modeling_mamba2.MambaRMSNormGated``,
``modeling_falcon_h1.FalconH1RMSNormGated``, ``modeling_kimi_linear.KimiLinearRMSNormGated``;
argument names from mamba_ssm ``ops/triton/layernorm_gated.rmsnorm_fn`` (``z``, ``group_size``,
``norm_before_gate``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

from ... import dsl as tk
from ...dsl.validate import LANES
from ...errors import ArgumentError, DeviceError, DTypeError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .common import (
    CASTINGS,
    DEFAULT_RMS_EPS,
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
    round_to as _round,
    row_bytes,
    row_spec as _row,
    spec_nbytes as _nbytes,
    tunables as _tunables,
    vec as _vec,
    vec2d,
    vec_bytes,
    weight_grad,
    widen,
)

OP = "tpukernels.gated_rms_norm"


# ---------------------------------------------------------------------------------------------- body helpers
#: Gate activations: ``silu`` (``swish``: Qwen3-Next, Mamba2, Falcon-H1) and ``sigmoid`` (Kimi-Linear's KDA).
ACTIVATIONS = ("silu", "sigmoid")


def _gate_parts(z, activation: str):
    """float32 ``(act(z), act'(z))``."""
    sg = jax.nn.sigmoid(z)
    if activation == "sigmoid":
        return sg, sg * (1.0 - sg)
    return z * sg, sg * (1.0 + z * (1.0 - sg))


def _group_mean(v, gs: int):
    """``(rows, G)`` float32 mean of ``v (rows, H)`` over each group of ``gs`` consecutive channels."""
    h = v.shape[1]
    g = h // gs
    if g == 1:
        return jnp.mean(v, axis=-1, keepdims=True)
    if gs % LANES == 0:  # lane-aligned static slices: whole vregs
        parts = [jnp.sum(v[:, i * gs:(i + 1) * gs], axis=-1, keepdims=True) for i in range(g)]
    else:
        lane = jax.lax.broadcasted_iota(jnp.int32, v.shape, 1)
        parts = [jnp.sum(jnp.where((lane >= i * gs) & (lane < (i + 1) * gs), v, 0.0), axis=-1, keepdims=True)
                 for i in range(g)]
    col = jax.lax.broadcasted_iota(jnp.int32, (v.shape[0], g), 1)
    out = jnp.zeros((v.shape[0], g), F32)
    for i, p in enumerate(parts):
        out = jnp.where(col == i, p, out)
    return out * (1.0 / gs)


def _expand(s, h: int):
    """``(rows, G)`` per-group values broadcast to ``(rows, H)`` (each over its group's channels)."""
    g = s.shape[1]
    if g == 1:
        return s
    gs = h // g
    lane = jax.lax.broadcasted_iota(jnp.int32, (s.shape[0], h), 1)
    out = jnp.broadcast_to(s[:, 0:1], (s.shape[0], h))
    for i in range(1, g):
        out = jnp.where(lane >= i * gs, s[:, i:i + 1], out)
    return out


# ---------------------------------------------------------------------------------------------- kernel bodies
def _fwd_body(*refs, has_weight: bool, eps: float, norm_before_gate: bool, group_size: int, activation: str,
              casting: str, round_scaled: bool, round_f16: bool):
    x_ref, z_ref, *refs = refs
    w_ref = refs.pop(0) if has_weight else None
    y_ref, rstd_ref = refs
    h = x_ref.shape[1]

    def rnd(v):
        return _round(v, y_ref.dtype, round_f16)

    x = x_ref[...].astype(F32)
    s, _ = _gate_parts(z_ref[...].astype(F32), activation)
    v = x if norm_before_gate else x * s
    rstd = jax.lax.rsqrt(_group_mean(v * v, group_size) + eps)
    n = v * _expand(rstd, h)
    if casting == "llama":
        n = rnd(n)
    if w_ref is not None:
        n = n * w_ref[...].astype(F32)
        if casting == "llama" and norm_before_gate and round_scaled:
            n = rnd(n)
    y = n * s if norm_before_gate else n
    y_ref[...] = rnd(y).astype(y_ref.dtype)
    rstd_ref[...] = rstd


def _bwd_body(*refs, has_weight: bool, norm_before_gate: bool, group_size: int, activation: str, n_rows: int):
    dy_ref, x_ref, z_ref, rstd_ref, *refs = refs
    w_ref = refs.pop(0) if has_weight else None
    dx_ref, dz_ref, dw_ref = refs
    h = x_ref.shape[1]

    @pl.when(pl.program_id(0) == 0)
    def _init():
        dw_ref[...] = jnp.zeros_like(dw_ref)

    x = x_ref[...].astype(F32)
    z = z_ref[...].astype(F32)
    dy = dy_ref[...].astype(F32)
    s, ds = _gate_parts(z, activation)
    r = _expand(rstd_ref[...], h)
    w = w_ref[...].astype(F32) if w_ref is not None else None
    if norm_before_gate:
        n = x * r
        g = dy * s  # gradient of the scaled norm n * w
        dn = g * w if w is not None else g
        dx = r * (dn - n * _expand(_group_mean(dn * n, group_size), h))
        nw = n * w if w is not None else n
        dz = dy * nw * ds
        dw_term = g * n
    else:
        hx = x * s
        n = hx * r
        dn = dy * w if w is not None else dy
        dh = r * (dn - n * _expand(_group_mean(dn * n, group_size), h))
        dx = dh * s
        dz = dh * x * ds
        dw_term = dy * n
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dz_ref[...] = dz.astype(dz_ref.dtype)
    dw_ref[...] += _masked_row_sum(dw_term, n_rows)


# ---------------------------------------------------------------------------------------------- kernels
def _stat_lanes(h, group_size):
    return tk.cdiv(h // group_size, LANES)


#: float32 ``(rows, H)`` temporaries live at once in the bodies, counted per block row on top of the pipeline
#: buffers: without them the backward's 64-row heuristic block at H = 8192 overflows v5e's 16 MiB scoped VMEM
#: (compile-only, libtpu 0.0.52); with them it is 32 rows, which compiles on v4 / v5e / v5p / v6e / tpu7x.
_FWD_TEMPS, _BWD_TEMPS = 2, 5


def _temp_bytes(h, n):
    return n * tk.cdiv(h, LANES) * LANES * 4


def _fwd_sizes(x, z, weight, group_size):
    h = x.shape[1]
    return (row_bytes(h, [x.dtype, z.dtype, x.dtype], _stat_lanes(h, group_size)) + _temp_bytes(h, _FWD_TEMPS),
            vec_bytes(h, [weight.dtype] if weight is not None else []))


def _fwd_out(x, z, weight, eps, norm_before_gate, group_size, activation="silu", casting="llama", round_scaled=False,
             round_f16=False):
    return tk.like(x), tk.OutSpec((x.shape[0], x.shape[1] // group_size), F32)


def _check_groups(h, group_size):
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or h % group_size:
        raise ArgumentError(f"{NAMESPACE}: group_size must be an int >= 1 dividing H = {h}, got {group_size!r}")


def _check_modes(op, activation, casting=None):
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if casting is not None and casting not in CASTINGS:
        raise ArgumentError(f"{op}: casting must be one of {CASTINGS}, got {casting!r}")


@tk.tpu_kernel(
    _fwd_body, name="gated_rms_norm_fwd", namespace=NAMESPACE, tunables=_tunables(), rows=("x", "z"),
    heuristic=lambda x, z, weight, group_size, **_: _heuristic_rows(*_fwd_sizes(x, z, weight, group_size)),
    out_shape=_fwd_out,
)
def gated_rms_norm_fwd(
    x: torch.Tensor, z: torch.Tensor, weight: Optional[torch.Tensor], eps: float, norm_before_gate: bool,
    group_size: int, activation: str, casting: str, round_scaled: bool, round_f16: bool, *, block_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated RMSNorm forward on rows (internal op ``tpukernels::gated_rms_norm_fwd``; use :func:`gated_rms_norm`).

    Args:
        x, z: ``[rows, H]`` bf16/f32 (z may differ in dtype). weight: ``[1, H]`` bf16/f32, or None.
        eps: added to the float32 mean square. norm_before_gate: the gate order (module docstring).
        group_size: channels per normalization group (divides H). activation: ``"silu"`` or ``"sigmoid"``.
        casting: ``"llama"`` (HF's roundings) or ``"gemma"`` (float32 throughout, one rounding).
        round_scaled: casting="llama": round ``R(n) * w`` to x.dtype before the gate (norm_before_gate only;
            HF rounds it when weight.dtype == x.dtype).
        round_f16: x is float16 widened to float32: emulate float16 roundings.

    Returns:
        ``(y [rows, H] x.dtype, rstd [rows, H / group_size] float32)``; rstd carries no gradient.

    Raises:
        ArgumentError: shapes, group_size. DTypeError: float16 (widen it, as the public op does) or non-float.
    """
    _check_dtypes(x, z, weight)
    _check_2d("x", x)
    n, h = x.shape
    _check_2d("z", z, h)
    if z.shape[0] != n:
        raise ArgumentError(f"{NAMESPACE}: z must be [{n}, {h}] like x, got {tuple(z.shape)}")
    _check_vec("weight", weight, h)
    _check_groups(h, group_size)
    _check_modes(NAMESPACE, activation, casting)
    bm = fit_block_rows(block_rows, n, *_fwd_sizes(x, z, weight, group_size))
    g = h // group_size
    return tk.Launch(
        grid=(tk.cdiv(n, bm),),
        in_specs=[_row(bm, h), _row(bm, h)] + ([_vec(h)] if weight is not None else []),
        out_specs=[_row(bm, h), pl.BlockSpec((bm, g), lambda i: (i, 0))],
        out_shape=_fwd_out(x, z, weight, eps, norm_before_gate, group_size, activation, casting),
        dimension_semantics=("parallel",),
        cost_estimate=_cost(10 + 2 * g, n, h, 2 * _nbytes(x) + _nbytes(z, weight) + 4 * n * g),
        body_kwargs={"has_weight": weight is not None},
    )


def _bwd_sizes(dy, x, z, weight, group_size):
    h = x.shape[1]
    rows = [dy.dtype, x.dtype, z.dtype, x.dtype, z.dtype]
    return (row_bytes(h, rows, _stat_lanes(h, group_size)) + _temp_bytes(h, _BWD_TEMPS),
            vec_bytes(h, [jnp.float32] + ([weight.dtype] if weight is not None else [])))


def _bwd_out(dy, x, z, rstd, weight, norm_before_gate, group_size, activation="silu"):
    return tk.like(x), tk.like(z), tk.OutSpec((1, x.shape[1]), F32, rows=False)


@tk.tpu_kernel(
    _bwd_body, name="gated_rms_norm_bwd", namespace=NAMESPACE, tunables=_tunables(),
    rows=("dy", "x", "z", "rstd"), out_shape=_bwd_out,
    heuristic=lambda dy, x, z, rstd, weight, group_size, **_: _heuristic_rows(*_bwd_sizes(dy, x, z, weight,
                                                                                       group_size)),
)
def gated_rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor, rstd: torch.Tensor, weight: Optional[torch.Tensor],
    norm_before_gate: bool, group_size: int, activation: str, *, block_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated RMSNorm backward on rows (internal op ``tpukernels::gated_rms_norm_bwd``; bf16/f32 tensors).

    Args:
        dy, x, z: ``[rows, H]``. rstd: ``[rows, H / group_size]`` float32 from the forward. weight: ``[1, H]``
        or None. norm_before_gate, group_size, activation: as in the forward.

    Returns:
        ``(dx [rows, H] x.dtype, dz [rows, H] z.dtype, dweight [1, H] float32)`` (dweight: float32 sum over
        all rows; meaningless when weight is None).
    """
    _check_dtypes(dy, x, z, weight)
    _check_2d("x", x)
    n, h = x.shape
    _check_2d("dy", dy, h)
    _check_2d("z", z, h)
    _check_vec("weight", weight, h)
    _check_groups(h, group_size)
    _check_modes(NAMESPACE, activation)
    g = h // group_size
    if tuple(rstd.shape) != (n, g):
        raise ArgumentError(f"{NAMESPACE}: rstd must be [{n}, {g}] float32, got {tuple(rstd.shape)}")
    bm = fit_block_rows(block_rows, n, *_bwd_sizes(dy, x, z, weight, group_size))
    row = _row(bm, h)
    return tk.Launch(
        grid=(tk.cdiv(n, bm),),
        in_specs=[row, row, row, pl.BlockSpec((bm, g), lambda i: (i, 0))] + ([_vec(h)] if weight is not None else []),
        out_specs=[row, row, _vec(h)],
        out_shape=_bwd_out(dy, x, z, rstd, weight, norm_before_gate, group_size, activation),
        dimension_semantics=("arbitrary",),  # dweight accumulates across the row grid
        cost_estimate=_cost(20 + 4 * g, n, h, _nbytes(dy, x, z, rstd, weight) + _nbytes(x, z) + 4 * h),
        body_kwargs={"has_weight": weight is not None, "n_rows": int(n)},
    )


@gated_rms_norm_fwd.def_backward
def _gated_rms_norm_fwd_backward(ctx, dy, _drstd):
    dx, dz, dw = gated_rms_norm_bwd(dy, ctx.x, ctx.z, ctx.outputs[1], ctx.weight, ctx.norm_before_gate,
                                    ctx.group_size, ctx.activation)
    return {"x": dx, "z": dz, "weight": weight_grad(ctx, "weight", dw)}


# ---------------------------------------------------------------------------------------------- public op
def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: Optional[torch.Tensor], *, eps: float = DEFAULT_RMS_EPS,
    norm_before_gate: bool = True, group_size: Optional[int] = None, activation: str = "silu",
    casting: str = "llama",
) -> torch.Tensor:
    """Gated RMSNorm over the last dim: ``rmsnorm(x) * w * act(z)`` or ``rmsnorm(x * act(z)) * w``.

    Argument names follow mamba_ssm's ``rmsnorm_fn`` / ``RMSNormGated``; the two gate orders and their
    casting points reproduce transformers' ``Qwen3NextRMSNormGated`` (``norm_before_gate=True``) and
    ``MambaRMSNormGated`` (``norm_before_gate=False``, with ``group_size``) bit for bit up to the float32
    statistics (module docstring has the formulas).

    Args:
        x: ``[..., H]`` bfloat16, float16 or float32; any layout, any number of rows (including 0).
        z: the gate, ``[..., H]`` shaped like x (bf16/f16/f32; may differ from x's dtype).
        weight: ``[H]`` scale (applied as ``w``, not ``1 + w``), any of the three float dtypes, or None.
        eps: added to the float32 mean square of each group (default ``1e-6``).
        norm_before_gate: True: ``norm(x) * w * silu(z)`` (Qwen3-Next, fla); False: ``norm(x * silu(z)) * w``
            (Mamba2 / Nemotron-H).
        group_size: channels per normalization group (``H / n_groups`` in Mamba2); must divide H. None: H.
        activation: the gate's ``act``: ``"silu"`` (default; ``"swish"`` is accepted as its alias) or
            ``"sigmoid"`` (Kimi-Linear).
        casting: ``"llama"`` (default): HF's roundings (``Qwen3NextRMSNormGated`` / ``MambaRMSNormGated``);
            ``"gemma"``: float32 throughout, rounded once (``FalconH1RMSNormGated``, ``KimiLinearRMSNormGated``,
            mamba_ssm / fla fused kernels).

    Returns:
        ``y``: x's shape and dtype. Differentiable in x, z and weight (Pallas backward kernel).

    Raises:
        ArgumentError: x not ``[..., H]`` with H >= 1; z not shaped like x; weight not ``[H]``; group_size not
            an int >= 1 dividing H; eps < 0 or not finite; norm_before_gate not a bool; unknown activation or
            casting.
        DTypeError: x, z or weight not bf16/f16/f32. DeviceError: z or weight on another device than x.
    """
    check_number(OP, eps=eps)
    if not isinstance(norm_before_gate, bool):
        raise ArgumentError(f"{OP}: norm_before_gate must be a bool, got {norm_before_gate!r}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise ArgumentError(f"{OP}: group_size must be an int >= 1 dividing H, or None; got {group_size!r}")
    if activation == "swish":
        activation = "silu"
    _check_modes(OP, activation, casting)
    return torch.ops.tpukernels.gated_rms_norm(x, z, weight, eps, norm_before_gate, group_size, activation, casting)


def _check_gated_args(op, x, z, weight, eps, group_size):
    h = check_x(op, x)
    if not isinstance(z, torch.Tensor):
        raise ArgumentError(f"{op}: z (the gate) must be a torch.Tensor shaped like x {tuple(x.shape)}, "
                            f"got {type(z).__name__}")
    if z.shape != x.shape:
        raise ArgumentError(f"{op}: z (the gate) must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if z.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"{op}: z dtype {z.dtype} is not supported: use bfloat16, float16 or float32")
    if z.device != x.device:
        raise DeviceError(f"{op}: z is on {z.device} but x is on {x.device}")
    check_param(op, "weight", weight, x, h)
    eps = check_float(op, "eps", eps, 0.0)
    gs = h if group_size is None else group_size
    if gs < 1 or h % gs:
        raise ArgumentError(f"{op}: group_size must be an int >= 1 dividing H = {h} (x.shape[-1]), got {group_size}")
    return h, eps, int(gs)


def _gated_rms_norm_impl(x, z, weight=None, eps=DEFAULT_RMS_EPS, norm_before_gate=True, group_size=None,
                         activation="silu", casting="llama"):
    h, eps, gs = _check_gated_args(OP, x, z, weight, eps, group_size)
    _check_modes(OP, activation, casting)
    half = x.dtype == torch.float16
    round_scaled = weight is not None and weight.dtype == x.dtype
    y, _ = torch.ops.tpukernels.gated_rms_norm_fwd(
        widen(x).reshape(-1, h), widen(z).reshape(-1, h), vec2d(weight), eps, bool(norm_before_gate), gs,
        activation, casting, round_scaled, half)
    return y.reshape(x.shape).to(x.dtype)


# the public torch op: CompositeImplicitAutograd, so autograd / torch.compile see the kernel ops
LIB.define(f"gated_rms_norm(Tensor x, Tensor z, Tensor? weight, float eps={DEFAULT_RMS_EPS!r}, "
           "bool norm_before_gate=True, int? group_size=None, str activation='silu', str casting='llama') -> Tensor")
LIB.impl("gated_rms_norm", _gated_rms_norm_impl, "CompositeImplicitAutograd")


def gated_rms_norm_reference(x, z, weight=None, eps=DEFAULT_RMS_EPS, norm_before_gate=True, group_size=None,
                             activation="silu"):
    """float64 gated RMSNorm of the given (low-precision) values, no intermediate rounding (tests' ground truth)."""
    xd, zd = x.double(), z.double()
    h = xd.shape[-1]
    gs = h if group_size is None else group_size
    sz = torch.sigmoid(zd) if activation == "sigmoid" else zd * torch.sigmoid(zd)
    v = xd if norm_before_gate else xd * sz
    vg = v.unflatten(-1, (h // gs, gs))
    n = (vg * torch.rsqrt(vg.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    if weight is not None:
        n = n * weight.double()
    return n * sz if norm_before_gate else n



#: ``(kernel, compile_for args, kwargs)`` at the shapes the shipped defaults are tuned for: Qwen3-Next-80B-A3B's
#: gated DeltaNet output norm (2048 tokens x 32 value heads, head_dim 128, one group per head) and Nemotron-H's
#: Mamba2 mixer norm (8192 tokens, intermediate 8192 in 8 groups of 1024, gate before the norm).
STANDARD_CASES = [
    (gated_rms_norm_fwd, ("65536x128:bf16", "65536x128:bf16", "1x128:bf16"),
     {"eps": DEFAULT_RMS_EPS, "norm_before_gate": True, "group_size": 128, "activation": "silu",
      "casting": "llama", "round_scaled": True, "round_f16": False}),
    (gated_rms_norm_bwd, ("65536x128:bf16", "65536x128:bf16", "65536x128:bf16", "65536x1:f32", "1x128:bf16"),
     {"norm_before_gate": True, "group_size": 128, "activation": "silu"}),
    (gated_rms_norm_fwd, ("8192x8192:bf16", "8192x8192:bf16", "1x8192:bf16"),
     {"eps": DEFAULT_RMS_EPS, "norm_before_gate": False, "group_size": 1024, "activation": "silu",
      "casting": "llama", "round_scaled": True, "round_f16": False}),
    (gated_rms_norm_bwd, ("8192x8192:bf16", "8192x8192:bf16", "8192x8192:bf16", "8192x8:f32", "1x8192:bf16"),
     {"norm_before_gate": False, "group_size": 1024, "activation": "silu"}),
]
