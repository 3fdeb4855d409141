"""Normalization layers: RMSNorm, LayerNorm and fused residual-add + RMSNorm, forward and backward.

Written with the tpukernels DSL (``@tpu_kernel``), torch namespace ``tpukernels``.

Public API (torch tensors; ``x: [..., H]``, any leading dims, normalized over the last dim)::

    torch.ops.tpukernels.rms_norm(x, weight=None, eps=1e-6, offset=0.0, casting="llama") -> y
    torch.ops.tpukernels.fused_add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0, casting="llama")
        -> (y, new_residual)
    torch.ops.tpukernels.layer_norm(x, weight=None, bias=None, eps=1e-5) -> y

    tpukernels.library.rms_norm / fused_add_rms_norm / layer_norm     the same, as Python functions
    tpukernels.library.TPURMSNorm / TPULayerNorm                       nn.Module drop-ins

Formulas. Statistics are always float32, whatever the input dtype (a float16 sum of squares would overflow
at |x| > 256); ``cast`` rounds to the input dtype; ``w`` is the weight upcast to float32::

    rms_norm     rstd = 1 / sqrt(mean(x**2) + eps),  n = x * rstd
                 casting="llama" (default): y = cast(cast(n) * (offset + w))   HF ``LlamaRMSNorm``
                 casting="gemma":           y = cast(n * (offset + w))         HF ``GemmaRMSNorm`` (offset=1)
    layer_norm   mean = mean(x),  rstd = 1 / sqrt(mean((x - mean)**2) + eps),  y = cast((x - mean) * rstd * w + b)
    fused_add    new_residual = cast(x + residual),  y = rms_norm(new_residual)      (vLLM ``fused_add_rms_norm``)

``offset + w`` is formed in float32 (Gemma stores ``w`` around 0 and scales by ``1 + w``; in bfloat16 the
``1 +`` would round away every |w| <= 2**-8). The variance is two-pass (``mean((x - mean)**2)``), not
``E[x**2] - E[x]**2``, since each kernel holds the full row. Backward (Zhang & Sennrich 2019; Ba et al.
2016), with ``g = dy * (offset + w)`` (rms) or ``g = dy * w`` (layer norm), ``xhat = (x - mean) * rstd``::

    rms:   dx = rstd * (g - n * mean(g * n)),                          dw = sum_rows(dy * n)
    layer: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),          dw = sum_rows(dy * xhat), db = sum_rows(dy)

Sources: HF transformers ``modeling_llama.LlamaRMSNorm`` / ``modeling_gemma.GemmaRMSNorm`` (casting points),
vLLM ``fused_add_rms_norm``, ``torch.nn.functional.layer_norm``.

float16: Mosaic (libtpu 0.0.52) cannot load, store or convert float16 vectors on v5e/v6e/tpu7x, so the
public ops widen float16 tensors to float32 (exact), run the float32 kernels with the float16 roundings of
the formulas (``cast`` above) emulated in float32/int32 arithmetic (:func:`round_to_f16`), and round the
outputs once to float16. Same numbers as a native float16 kernel, about 4x the HBM traffic of bfloat16.

casting="llama" with bfloat16 x, bfloat16 weight and offset 0 multiplies ``cast(n) * w`` in bfloat16: the
product of two bfloat16 values is exact in float32, so one rounding gives the same number as HF's float32
multiply, without the float32 round trip of ``n`` (the kernel is VALU-bound on tpu7x in libtpu's model).

Defaults: ``eps=1e-6`` for RMSNorm (Gemma/Qwen/Llama-3 configs use 1e-6..1e-5), ``1e-5`` for LayerNorm
(torch's default); never derived from the input dtype. ``casting="llama"`` is the default casting mode.

Design. Five internal kernel ops carry the work, each one ``@tpu_kernel`` on ``[rows, H]`` blocks of
``(block_rows, H)`` (the full hidden size is one block, which satisfies the (8, 128) rule for every H)::

    tpukernels::rms_norm_fwd(x, weight, eps, offset, casting, round_f16) -> (y, rstd[rows, 1] f32)
    tpukernels::fused_add_rms_norm_fwd(x, residual, weight, ..., round_f16) -> (y, new_residual, rstd)
    tpukernels::rms_norm_bwd(dy, x, rstd, weight, dres, offset)          -> (dx, dweight[1, H] f32)
    tpukernels::layer_norm_fwd(x, weight, bias, eps)                     -> (y, mean, rstd)
    tpukernels::layer_norm_bwd(dy, x, mean, rstd, weight)                -> (dx, dweight[1, H] f32, dbias[1, H] f32)

The forward ops return the float32 statistics as extra outputs; their backward (``def_backward``) calls
the backward op with them. The statistic outputs carry no gradient (an incoming gradient for them is
ignored), which is why they are internal: the public ops are ``CompositeImplicitAutograd`` functions that
flatten ``x`` to rows, call the forward op and return only ``y`` (autograd and ``torch.compile`` then see
the kernel ops). ``dweight``/``dbias`` accumulate in a float32 ``(1, H)`` output resident across the
(sequential) row grid; the last row block may overhang the array, its rows read NaN in TPU interpret mode
(garbage on a TPU), so they are masked with :func:`tpukernels.mask_tail` before the reduction. Row counts
are bucketed (``rows=``) so changing token counts reuse compiled kernels; the weight-gradient outputs are
``OutSpec(rows=False)``. The fused-add backward reuses ``rms_norm_bwd`` with ``dres`` (the gradient of
``new_residual``) added to ``dx``. No double backward.

Tuning: one tunable, ``block_rows``, an upper bound: the launch lowers it until the double-buffered blocks
fit :data:`VMEM_BUDGET_BYTES` (below the smallest default scoped VMEM, 16 MiB on v5e) and to the row count.
Per-chip defaults ship in ``tpukernels/data/autotuning/<chip>/tpukernels.<op>.json`` (written by
``benchmarks/norms.py --write-defaults`` from libtpu's static estimates); elsewhere the VMEM-aware
heuristic picks the largest block that fits.

Performance (MODEL ESTIMATES: libtpu 0.0.52 static cost model combined with the HBM roofline by
:func:`tpukernels.perf.model_time`; not measurements), bf16, ``benchmarks/norms.py``: on v5e and v6e every
kernel sits at the HBM roofline at [8192, 4096] and [8192, 8192], like or ahead of XLA's fusion of the same
formula (one exception: layer_norm backward, v6e, H=8192: 88% of roofline, 0.94x XLA). On tpu7x
libtpu's model makes these kernels VALU-bound: rms_norm forward 97-99% of roofline and fused-add 100%, but
the backward kernels and layer_norm reach 48-76%; at H=4096 they beat XLA (1.10-1.33x), at H=8192 they
trail it by 3-9%.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl

from .. import dsl as tk
from ..chips import MiB
from ..dsl.validate import LANES, padded_bytes
from ..errors import ArgumentError, DeviceError, DTypeError

__all__ = [
    "rms_norm", "fused_add_rms_norm", "layer_norm", "TPURMSNorm", "TPULayerNorm",
    "rms_norm_reference", "fused_add_rms_norm_reference", "layer_norm_reference",
    "rms_norm_fwd", "rms_norm_bwd", "fused_add_rms_norm_fwd", "layer_norm_fwd", "layer_norm_bwd",
    "DEFAULT_RMS_EPS", "DEFAULT_LAYER_NORM_EPS", "CASTINGS", "BLOCK_ROWS", "VMEM_BUDGET_BYTES",
]

NAMESPACE = "tpukernels"
DEFAULT_RMS_EPS = 1e-6
DEFAULT_LAYER_NORM_EPS = 1e-5
#: RMSNorm casting modes: where the normalized value is rounded to the input dtype (see module docstring).
CASTINGS = ("llama", "gemma")
#: Candidate rows per grid step.
BLOCK_ROWS = (8, 16, 32, 64, 128, 256, 512, 1024)
#: VMEM for the double-buffered blocks of one launch, bytes: 12 MiB leaves 4 MiB of the smallest default
#: scoped limit (16 MiB on v4/v5e/v5p; 32 MiB on v6e/tpu7x) to Mosaic's internal scratch (the float32
#: temporaries of a block). Verified by compile-only tests on v5e/v6e/tpu7x.
VMEM_BUDGET_BYTES = 12 * MiB
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
F32 = jnp.float32


# ----------------------------------------------------------------------------------------- block sizing
def _row_bytes(h: int, row_dtypes, n_stats: int) -> int:
    """VMEM bytes per block row: each row-blocked array (and each ``(rows, 1)`` f32 statistic, padded to 128
    lanes) in two pipeline buffers."""
    lanes = tk.cdiv(h, LANES) * LANES
    return 2 * (sum(lanes * np.dtype(d).itemsize for d in row_dtypes) + n_stats * LANES * 4)


def _vec_bytes(h: int, dtypes) -> int:
    """VMEM bytes of the ``(1, H)`` blocks (weight, bias, weight gradients), two buffers each."""
    return 2 * sum(padded_bytes([1, h], d) for d in dtypes)


def fit_block_rows(block_rows: int, n: int, per_row: int, fixed: int = 0) -> int:
    """Rows per block actually launched.

    ``block_rows`` halved (down to 8) until ``rows * per_row + fixed <= VMEM_BUDGET_BYTES``; then the whole
    array as one block when it has no more rows than that (a block equal to the full dim is always legal).

    Args:
        block_rows: the config value (upper bound); n: rows of the array (bucketed: a multiple of 8).
        per_row: VMEM bytes per block row (:func:`_row_bytes`); fixed: bytes of row-independent blocks.
    """
    bm = int(block_rows)
    while bm > 8 and bm * per_row + fixed > VMEM_BUDGET_BYTES:
        bm //= 2
    return int(n) if 0 < n <= bm else bm


def _heuristic_rows(per_row: int, fixed: int) -> dict:
    """Largest ``block_rows`` whose blocks fit the VMEM budget (memory-bound: bigger steps amortize the
    ~0.35 us per-step pipeline overhead)."""
    fits = [b for b in BLOCK_ROWS if b * per_row + fixed <= VMEM_BUDGET_BYTES]
    return {"block_rows": max(fits) if fits else BLOCK_ROWS[0]}


def _tunables():
    return {"block_rows": tk.Tunable(BLOCK_ROWS, default=256,
                                     doc="rows per grid step (upper bound; lowered to fit VMEM and the row count)")}


def _check_2d(name: str, x, h: int | None = None):
    if len(x.shape) != 2 or (h is not None and x.shape[1] != h):
        want = "[rows, H]" if h is None else f"[rows, {h}]"
        raise ArgumentError(f"{NAMESPACE}: {name} must be {want}, got shape {tuple(x.shape)}")


def _check_vec(name: str, v, h):
    if v is not None and tuple(v.shape) != (1, h):
        raise ArgumentError(f"{NAMESPACE}: {name} must have shape [1, {h}] (internal op), got {tuple(v.shape)}")


def _check_dtypes(*specs):
    for s in specs:
        if s is None:
            continue
        name = np.dtype(s.dtype).name
        if name not in ("bfloat16", "float32"):
            why = ("Mosaic cannot load float16 on TPU; widen to float32 (the public ops do)" if name == "float16"
                   else "use bfloat16 or float32")
            raise DTypeError(f"{NAMESPACE}: argument {s.name!r} has dtype {name}: {why}")


def _check_casting(casting: str):
    if casting not in CASTINGS:
        raise ArgumentError(f"{NAMESPACE}: casting must be one of {CASTINGS}, got {casting!r}")


def _row(bm, h):
    return pl.BlockSpec((bm, h), lambda i: (i, 0))


def _stat(bm):
    return pl.BlockSpec((bm, 1), lambda i: (i, 0))


def _vec(h):
    return pl.BlockSpec((1, h), lambda i: (0, 0))


def _stat_out(n):
    return tk.OutSpec((n, 1), F32)


def _cost(flops_per_elem, n, h, nbytes):
    return pl.CostEstimate(flops=int(flops_per_elem * n * h), transcendentals=int(n), bytes_accessed=int(nbytes))


def _nbytes(*specs) -> int:
    return int(sum(s.size * s.itemsize for s in specs if s is not None))


# ----------------------------------------------------------------------------------------- kernel bodies
def _rstd(v, eps):
    """float32 ``1 / sqrt(mean(v**2) + eps)`` over the last axis, ``(rows, 1)``."""
    return jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)


def round_to_f16(v):
    """float32 ``v`` rounded to the nearest float16 value (ties to even, overflow to inf), as float32.

    Integer/float32 ops only: Mosaic (libtpu 0.0.52) cannot convert to float16 on v5e/v6e/tpu7x. Normal
    range: round the 23-bit mantissa to 10 bits (add ``0xFFF`` plus the lowest kept bit, clear 13 bits; a
    carry moves into the exponent, as it should). Below ``2**-14`` (float16 subnormals) the spacing is
    ``2**-24``: ``round_half_even(|v| * 2**24) * 2**-24`` with an explicit tie rule.
    """
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    sign = bits & jnp.int32(-(2**31))
    mag = bits & jnp.int32(0x7FFFFFFF)
    normal = jax.lax.bitcast_convert_type((mag + (0xFFF + ((mag >> 13) & 1))) & jnp.int32(~0x1FFF), F32)
    t = jax.lax.bitcast_convert_type(mag, F32) * 2.0**24  # exact (power-of-two scale); < 1024 where used
    fl = jnp.minimum(t, 2048.0).astype(jnp.int32)  # trunc == floor for t >= 0
    frac = t - fl.astype(F32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
    sub = (fl + up.astype(jnp.int32)).astype(F32) * 2.0**-24
    r = jnp.where(mag < 0x38800000, sub, normal)  # 0x38800000 = bits of 2**-14
    r = jnp.where((r > 65504.0) & (mag < 0x7F800000), jnp.inf, r)
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(r, jnp.int32) | sign, F32)


def _round(v, dtype, round_f16: bool):
    """float32 ``v`` rounded to the public dtype (float16 emulated: the kernel sees it widened to float32)."""
    return round_to_f16(v) if round_f16 else v.astype(dtype).astype(F32)


def _rms_scale(n, w_ref, offset, casting, dtype, round_f16):
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
        n = _round(n, dtype, round_f16)
    return (n * scale).astype(dtype)


def _rms_fwd_body(*refs, has_weight: bool, eps: float, offset: float, casting: str, round_f16: bool):
    x_ref, *refs = refs
    w_ref = refs.pop(0) if has_weight else None
    y_ref, rstd_ref = refs
    x = x_ref[...].astype(F32)
    rstd = _rstd(x, eps)
    y_ref[...] = _rms_scale(x * rstd, w_ref, offset, casting, y_ref.dtype, round_f16)
    rstd_ref[...] = rstd


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


def _masked_row_sum(v, n_rows: int):
    """Sum of a ``(rows, H)`` f32 block over rows, dropping rows past ``n_rows`` (NaN/garbage in the last,
    overhanging block; ``jnp.where``, since ``NaN * 0`` is NaN). Static no-op when blocks tile exactly."""
    bm = v.shape[0]
    if n_rows % bm:
        v = tk.mask_tail(v, 0, pl.program_id(0) * bm, n_rows)
    return jnp.sum(v, axis=0, keepdims=True)


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


# ----------------------------------------------------------------------------------------- kernels
def _rms_fwd_sizes(x, weight):
    h = x.shape[1]
    return _row_bytes(h, [x.dtype, x.dtype], 1), _vec_bytes(h, [weight.dtype] if weight is not None else [])


def _rms_fwd_out(x, weight, eps, offset, casting, round_f16=False):
    return tk.like(x), _stat_out(x.shape[0])


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


def _fused_fwd_sizes(x, residual, weight):
    h = x.shape[1]
    return (_row_bytes(h, [x.dtype, residual.dtype, x.dtype, x.dtype], 1),
            _vec_bytes(h, [weight.dtype] if weight is not None else []))


def _fused_fwd_out(x, residual, weight, eps, offset, casting, round_f16=False):
    return tk.like(x), tk.like(x), _stat_out(x.shape[0])


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


def _rms_bwd_sizes(dy, x, weight, dres):
    h = x.shape[1]
    rows = [dy.dtype, x.dtype, x.dtype] + ([dres.dtype] if dres is not None else [])
    return _row_bytes(h, rows, 1), _vec_bytes(h, [np.float32] + ([weight.dtype] if weight is not None else []))


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


def _ln_fwd_sizes(x, weight, bias):
    h = x.shape[1]
    return _row_bytes(h, [x.dtype, x.dtype], 2), _vec_bytes(h, [v.dtype for v in (weight, bias) if v is not None])


def _ln_fwd_out(x, weight, bias, eps):
    return tk.like(x), _stat_out(x.shape[0]), _stat_out(x.shape[0])


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
    return (_row_bytes(h, [dy.dtype, x.dtype, x.dtype], 2),
            _vec_bytes(h, [np.float32, np.float32] + ([weight.dtype] if weight is not None else [])))


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


# ----------------------------------------------------------------------------------------- backward wiring
def _weight_grad(ctx, name: str, g):
    w = ctx.args[name]
    if w is None or not ctx.needs_input_grad.get(name):
        return None
    return g.reshape(w.shape).to(w.dtype)


@rms_norm_fwd.def_backward
def _rms_norm_fwd_backward(ctx, dy, _drstd):
    dx, dw = rms_norm_bwd(dy, ctx.x, ctx.outputs[1], ctx.weight, None, ctx.offset)
    return {"x": dx, "weight": _weight_grad(ctx, "weight", dw)}


@fused_add_rms_norm_fwd.def_backward
def _fused_add_rms_norm_fwd_backward(ctx, dy, dres, _drstd):
    # new_residual = x + residual feeds y and is an output itself: d(new_residual) = rms_bwd(dy) + dres
    dh, dw = rms_norm_bwd(dy, ctx.outputs[1], ctx.outputs[2], ctx.weight, dres, ctx.offset)
    return {"x": dh, "residual": dh, "weight": _weight_grad(ctx, "weight", dw)}


@layer_norm_fwd.def_backward
def _layer_norm_fwd_backward(ctx, dy, _dmean, _drstd):
    dx, dw, db = layer_norm_bwd(dy, ctx.x, ctx.outputs[1], ctx.outputs[2], ctx.weight)
    return {"x": dx, "weight": _weight_grad(ctx, "weight", dw), "bias": _weight_grad(ctx, "bias", db)}


# ----------------------------------------------------------------------------------------- argument checks
def _check_x(op: str, x) -> int:
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"{op}: x must be a torch.Tensor [..., H], got {type(x).__name__}")
    if x.dim() < 1:
        raise ArgumentError(f"{op}: x must have at least one dim [..., H], got a 0-dim tensor")
    if x.dtype not in _SUPPORTED:
        hint = "; cast to float32 (TPUs have no float64)" if x.dtype == torch.float64 else ""
        raise DTypeError(f"{op}: x dtype {x.dtype} is not supported: use bfloat16, float16 or float32{hint}")
    h = x.shape[-1]
    if h == 0:
        raise ArgumentError(f"{op}: x has hidden size H = 0 (shape {tuple(x.shape)}); normalizing needs H >= 1")
    return h


def _check_param(op: str, name: str, p, x, h):
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise ArgumentError(f"{op}: {name} must be a torch.Tensor [H] or None, got {type(p).__name__}")
    if p.dim() != 1 or p.shape[0] != h:
        raise ArgumentError(f"{op}: {name} must have shape [H] = [{h}] (H = x.shape[-1]), got {tuple(p.shape)}")
    if p.dtype not in _SUPPORTED:
        raise DTypeError(f"{op}: {name} dtype {p.dtype} is not supported: use bfloat16, float16 or float32")
    if p.device != x.device:
        raise DeviceError(f"{op}: {name} is on {p.device} but x is on {x.device}")


def _check_float(op: str, name: str, v, minimum: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ArgumentError(f"{op}: {name} must be a finite float, got {v!r}")
    if minimum is not None and v < minimum:
        raise ArgumentError(f"{op}: {name} must be >= {minimum}, got {v!r}")
    return float(v)


def _check_number(op: str, **values) -> None:
    """Type check of float arguments before the op's schema check (which raises an untyped RuntimeError);
    plain isinstance tests, so torch.compile traces it without a graph break. Ranges: in the op impl."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ArgumentError(f"{op}: {name} must be a finite float, got {v!r}")


def _check_rms_args(op, x, weight, eps, offset, casting):
    h = _check_x(op, x)
    _check_param(op, "weight", weight, x, h)
    eps = _check_float(op, "eps", eps, 0.0)
    offset = _check_float(op, "offset", offset)
    if casting not in CASTINGS:
        raise ArgumentError(f"{op}: casting must be one of {CASTINGS}, got {casting!r}")
    if weight is None and offset != 0.0:
        raise ArgumentError(f"{op}: offset={offset} needs a weight (y = n * (offset + weight)); pass weight or offset=0")
    return h, eps, offset


def _widen(t):
    """float16 -> float32 (exact). Mosaic (libtpu 0.0.52) cannot load, store or convert float16 vectors on
    v5e/v6e/tpu7x ("Invalid vector type for load"), so float16 goes through the float32 kernels, with the
    intermediate float16 roundings emulated in the kernel (``round_f16``), and the result is rounded once."""
    return None if t is None else (t.float() if t.dtype == torch.float16 else t)


def _vec2d(p):
    return None if p is None else _widen(p).reshape(1, -1)


# ----------------------------------------------------------------------------------------- public functions
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
    _check_number("tpukernels.rms_norm", eps=eps, offset=offset)
    return torch.ops.tpukernels.rms_norm(x, weight, eps, offset, casting)


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
    _check_number(op, eps=eps, offset=offset)
    return torch.ops.tpukernels.fused_add_rms_norm(x, residual, weight, eps, offset, casting)


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
    _check_number("tpukernels.layer_norm", eps=eps)
    return torch.ops.tpukernels.layer_norm(x, weight, bias, eps)


def _rms_norm_impl(x, weight=None, eps=DEFAULT_RMS_EPS, offset=0.0, casting="llama"):
    h, eps, offset = _check_rms_args("tpukernels.rms_norm", x, weight, eps, offset, casting)
    half = x.dtype == torch.float16
    y, _ = torch.ops.tpukernels.rms_norm_fwd(_widen(x).reshape(-1, h), _vec2d(weight), eps, offset, casting, half)
    return y.reshape(x.shape).to(x.dtype)


def _fused_add_rms_norm_impl(x, residual, weight=None, eps=DEFAULT_RMS_EPS, offset=0.0, casting="llama"):
    op = "tpukernels.fused_add_rms_norm"
    h, eps, offset = _check_rms_args(op, x, weight, eps, offset, casting)
    if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
        got = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise ArgumentError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {got}")
    if residual.dtype != x.dtype:
        raise DTypeError(f"{op}: residual dtype {residual.dtype} must equal x dtype {x.dtype}")
    if residual.device != x.device:
        raise DeviceError(f"{op}: residual is on {residual.device} but x is on {x.device}")
    y, new_res, _ = torch.ops.tpukernels.fused_add_rms_norm_fwd(
        _widen(x).reshape(-1, h), _widen(residual).reshape(-1, h), _vec2d(weight), eps, offset, casting,
        x.dtype == torch.float16,
    )
    return y.reshape(x.shape).to(x.dtype), new_res.reshape(x.shape).to(x.dtype)


def _layer_norm_impl(x, weight=None, bias=None, eps=DEFAULT_LAYER_NORM_EPS):
    op = "tpukernels.layer_norm"
    h = _check_x(op, x)
    _check_param(op, "weight", weight, x, h)
    _check_param(op, "bias", bias, x, h)
    eps = _check_float(op, "eps", eps, 0.0)
    y, _, _ = torch.ops.tpukernels.layer_norm_fwd(_widen(x).reshape(-1, h), _vec2d(weight), _vec2d(bias), eps)
    return y.reshape(x.shape).to(x.dtype)


# Public torch ops: CompositeImplicitAutograd, so autograd / torch.compile decompose them into the kernel ops.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define(f"rms_norm(Tensor x, Tensor? weight=None, float eps={DEFAULT_RMS_EPS!r}, float offset=0.0, "
            "str casting='llama') -> Tensor")
_LIB.define(f"fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight=None, float eps={DEFAULT_RMS_EPS!r}, "
            "float offset=0.0, str casting='llama') -> (Tensor, Tensor)")
_LIB.define(f"layer_norm(Tensor x, Tensor? weight=None, Tensor? bias=None, float eps={DEFAULT_LAYER_NORM_EPS!r}) "
            "-> Tensor")
_LIB.impl("rms_norm", _rms_norm_impl, "CompositeImplicitAutograd")
_LIB.impl("fused_add_rms_norm", _fused_add_rms_norm_impl, "CompositeImplicitAutograd")
_LIB.impl("layer_norm", _layer_norm_impl, "CompositeImplicitAutograd")


# ----------------------------------------------------------------------------------------- modules
class TPURMSNorm(torch.nn.Module):
    """Drop-in RMSNorm module (HF ``LlamaRMSNorm`` / ``GemmaRMSNorm``, vLLM ``RMSNorm``).

    ``forward(x)`` returns :func:`rms_norm`; ``forward(x, residual)`` returns ``(y, new_residual)`` of
    :func:`fused_add_rms_norm` (vLLM's convention). The parameter is ``weight`` ``[hidden_size]``, so HF
    state dicts load unchanged; it starts at ``1 - offset`` (scale 1: ones for Llama, zeros for Gemma).

    Args:
        hidden_size: H. eps: default ``1e-6``. offset: ``1.0`` for Gemma checkpoints. casting: ``"llama"``
            (default) or ``"gemma"`` (see :func:`rms_norm`). elementwise_affine: False for no weight.
    """

    def __init__(self, hidden_size: int, eps: float = DEFAULT_RMS_EPS, *, offset: float = 0.0,
                 casting: str = "llama", elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        op = "TPURMSNorm"
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ArgumentError(f"{op}: hidden_size must be an int >= 1, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = _check_float(op, "eps", eps, 0.0)
        self.offset = _check_float(op, "offset", offset)
        if casting not in CASTINGS:
            raise ArgumentError(f"{op}: casting must be one of {CASTINGS}, got {casting!r}")
        if not elementwise_affine and self.offset != 0.0:
            raise ArgumentError(f"{op}: offset={offset} needs a weight; use elementwise_affine=True or offset=0")
        self.casting = casting
        w = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype)) if elementwise_affine else None
        self.register_parameter("weight", w)
        self.reset_parameters()

    @property
    def variance_epsilon(self) -> float:  # HF LlamaRMSNorm's attribute name
        return self.eps

    def reset_parameters(self) -> None:
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(1.0 - self.offset)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.offset, self.casting)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset, self.casting)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, casting={self.casting!r}"


class TPULayerNorm(torch.nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` over the last dim (same arguments, parameters and init).

    Raises:
        ArgumentError: ``normalized_shape`` names more than the last dim.
    """

    def __init__(self, normalized_shape, eps: float = DEFAULT_LAYER_NORM_EPS, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        op = "TPULayerNorm"
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
            raise ArgumentError(
                f"{op}: normalized_shape must be one int H >= 1 (normalization over the last dim), got {normalized_shape!r}"
            )
        self.normalized_shape = shape
        self.eps = _check_float(op, "eps", eps, 0.0)
        self.elementwise_affine = elementwise_affine
        kw = {"device": device, "dtype": dtype}
        # registered even when absent (None), as torch.nn.LayerNorm does
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(shape, **kw)) if elementwise_affine else None)
        self.register_parameter("bias", torch.nn.Parameter(torch.empty(shape, **kw)) if elementwise_affine and bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


# ----------------------------------------------------------------------------------------- float64 references
def rms_norm_reference(x, weight=None, eps=DEFAULT_RMS_EPS, offset=0.0):
    """float64 RMSNorm of the given (low-precision) values, no intermediate rounding (tests' ground truth)."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (offset + weight.double())


def fused_add_rms_norm_reference(x, residual, weight=None, eps=DEFAULT_RMS_EPS, offset=0.0):
    """float64 ``(rms_norm(x + residual), x + residual)``; the sum is exact in float64."""
    h = x.double() + residual.double()
    return rms_norm_reference(h, weight, eps, offset), h


def layer_norm_reference(x, weight=None, bias=None, eps=DEFAULT_LAYER_NORM_EPS):
    """float64 LayerNorm of the given values (biased variance, as torch)."""
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    y = (xd - mean) * torch.rsqrt((xd - mean).pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    return y if bias is None else y + bias.double()


#: ``(kernel, compile_for args, kwargs)`` at the shape the shipped defaults are tuned for (``tpukernels demo``).
STANDARD_CASES = [
    (rms_norm_fwd, ("8192x4096:bf16", "1x4096:bf16"), {"eps": DEFAULT_RMS_EPS, "offset": 0.0, "casting": "llama",
                                                        "round_f16": False}),
    (rms_norm_bwd, ("8192x4096:bf16", "8192x4096:bf16", "8192x1:f32", "1x4096:bf16", None), {"offset": 0.0}),
    (fused_add_rms_norm_fwd, ("8192x4096:bf16", "8192x4096:bf16", "1x4096:bf16"),
     {"eps": DEFAULT_RMS_EPS, "offset": 0.0, "casting": "llama", "round_f16": False}),
    (layer_norm_fwd, ("8192x4096:bf16", "1x4096:bf16", "1x4096:bf16"), {"eps": DEFAULT_LAYER_NORM_EPS}),
    (layer_norm_bwd, ("8192x4096:bf16", "8192x4096:bf16", "8192x1:f32", "8192x1:f32", "1x4096:bf16"), {}),
]
