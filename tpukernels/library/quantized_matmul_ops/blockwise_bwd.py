"""The backward of ``quantized_matmul_blockwise`` with respect to the activations: ``d_x = g @ W`` with the
block-quantized weight ``W`` frozen (QLoRA-style fine-tuning: gradients flow to ``x``, the adapters and the layers
below; ``w_q``, ``w_scale`` and ``w_zero_point`` get none).

Kernel ``tpukernels::quantized_matmul_blockwise_bwd_dx(g [M, N], w_q, w_scale [G, 1, N], w_zero_point?,
block_size, out_dtype, weight_format) -> [M, K_w]`` for every weight format of
:mod:`~tpukernels.library.quantized_matmul_ops.blockwise` (int8, float8_e4m3fn / e5m2, int4 with or without zero points,
fp4 e2m1; the same layout, packing and ``[K_w / bs, 1, N]`` scales). Formula, with ``q'`` the value fed to the
MXU (int4: nibble ``- 8``; fp4: its e2m1 value; int8 / fp8: ``w_q``), ``z' = z - 8`` (0 without zero points) and
``gs = round_{g.dtype}(g * s[grp])`` (the f32 product rounded once to ``g.dtype``):

    ``d_x[m, k] = sum_n gs[m, n] q'[n, k] - sum_n gs[m, n] z'[grp, n]``,  ``grp = k // block_size``

which is ``g @ W`` with ``W[n, k] = (q'[n, k] - z'[grp, n]) s[grp, n]`` (the forward's dequantized weight).

What runs: grid ``(M/bm, K_w/bk, N/bn)``, the contraction over ``N`` innermost (``arbitrary``), ``bk`` a multiple
of ``block_size`` (:func:`~tpukernels.library.quantized_matmul_ops.blockwise.k_block`: no K tail), an f32 VMEM
accumulator ``[bm, bk]``. Per N step, for each of the ``bk / bs`` groups (static loop): the ``g`` tile
``[bm, bn]`` times the group's scale row ``s[grp] [1, bn]`` (the scales run along N, the lanes of ``g``: a
broadcast, no transpose) rounded to ``g.dtype``; the group's weight tile ``[bn, bs]`` (int4 / fp4: ``[bn, bs/2]``
bytes, unpacked in VMEM into its two halves) converted exactly to ``g.dtype``; one MXU dot per half, f32
accumulation; zero points: minus the row sum ``sum_n gs * z'`` (one ``[bm, 1]`` column per group). The weight
is unpacked and dequantized only in VMEM; HBM holds the packed bytes (no bf16 weight is ever written). An N tail
(``N % bn != 0``) is masked on both operands (NaN-safe ``jnp.where``; at every N step, the mask all-true before the
last, so the step is traced once); M tails need nothing (rows are independent, writes past the end are dropped).

Error (``u`` = unit roundoff of the output dtype, ``u_g`` that of ``g.dtype`` (0 for float32 ``g``), ``u32 =
2^-24``), against the float64 ``g @ W`` of the dequantized weight (:func:`reference_blockwise_dx`), elementwise:
``|d_x - ref| <= u |ref| + (u_g + u32) (|g| @ |W|) + (2 N + 2) u32 (|g| @ M)`` with ``M[n, k] = (|q'| + |z'|) |s|``.
Derivation: ``gs`` carries relative error ``u32`` (the f32 product) plus ``u_g`` (the rounding to ``g.dtype``),
which enters every term of ``g @ W`` alike: the second term. The products ``gs q'`` are exact in f32 for bf16
``g`` (an 8-bit significand times an integer of at most 8 bits, an e2m1 or an 8-bit float; one f32 rounding
for float32 ``g``), ``gs z'`` is one f32 rounding; the ``2 N`` terms (the dot's ``N`` and the zero-point sum's ``N``, split over the N steps, with one
subtraction per step) are summed in f32 in some order: ``(2 N - 1) u32`` times their absolute sum (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5), ``+ 2`` for the product rounding and the
second-order terms; the final rounding to the output dtype, ``u |ref|``. :func:`error_bound_blockwise_dx`.

Gradients of the weight side: none. ``w_q`` is integer (or frozen fp8) data, and the scales / zero points are
frozen with it: the backward returns ``None`` for ``w_q``, ``w_scale`` and ``w_zero_point`` even when they
require grad (their ``.grad`` stays ``None``); train adapters (LoRA) next to the frozen layer instead.

Performance: not measured on hardware and not tuned (no shipped table; :func:`_dx_heuristic` gives the blocks).
libtpu 0.0.52 static estimate (a MODEL, not a measurement; ``tpukernels.bench.core.Estimator`` of the kernel at
blocks ``bm=512, bk=1024, bn=512``; the heuristic's ``bn=1024`` takes 8% less), v6e, Llama-3-8B down-projection's ``d_x`` at 2048 tokens
(``g [2048, 4096]``, ``W [4096, 14336]``, group 128): int4 with zero points 1556 µs, block-scaled int8 727 µs,
against the bf16 MXU roofline of the product (``2 M N K / peak``: 261 µs) 17% and 36%; the int4 forward of the same
layer (``quantized_matmul_blockwise_kernel`` at its heuristic blocks) is 1473 µs in the same model, so the backward
costs about what the forward does. Both are vector-bound: per MXU multiply-accumulate the backward does about
``3 / block_size`` vector operations for the ``g * s`` scaling (once per group) and ``~6 / bm`` for the weight
unpack, where the MXU leaves room for roughly ``1 / 128``; the zero-point row sum adds little (int4 without zero
points: 1468 µs).
Dequantizing the weight tile instead (``(q' - z') * s`` in f32 with the scales turned into columns by an exact
one-hot MXU product, then ``g @ W`` unscaled: ``bn * bk`` elements of vector work per step instead of
``bm * bn * bk / block_size``) was slower in the same model (int4 with zero points 1820 µs, int8 952 µs: the f32
weight arithmetic and the per-group lane broadcasts of the scale columns cost more than the ``g`` scaling saved),
so it was not kept. The int4 unpack (uint8 -> int32, mask / shift, -8, -> bf16, two half-width dots) is about
half the int4 time (int4 without zero points 1468 µs vs int8 727 µs), as in the forward (its docstring): a cheaper
unpack for both is the next step.

Source: the forward's layout (tpu-inference's block-wise ``[n_in // block_size, 1, n_out]`` scales); the
per-channel ``quantized_matmul_bwd_dx`` of this package for the ``g * s`` then dot structure; QLoRA (Dettmers
et al., arXiv:2305.14314, section 3: gradients through the frozen 4-bit weight to the adapters).
"""

from __future__ import annotations

import types
from typing import Optional

import numpy as np
import torch

from ... import dsl as _dsl
from ...dsl.validate import padded_bytes
from ..vmem import scoped_vmem_limit
from ...errors import ArgumentError, DTypeError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .blockwise import (INT4N, PACKED, dequantize_blockwise, dequantize_f32_jnp, fp4_decode as _fp4_decode, int4n_to_k,
                        k_block, problem,
                        quantized_matmul_blockwise_kernel, resolve_format)
from .common import (U32, X_DTYPES, check_chip, clamp as _clamp, dtype_name as _name, jnp_dtype as _jnp,
                     resolve_out_dtype as _out_dtype)

WHERE = "tpukernels::quantized_matmul_blockwise_bwd_dx"

TUNABLES_BWD = {
    "bm": _dsl.Tunable([512, 128, 256, 1024], default=512, doc="rows of the d_x block (tokens)"),
    "bk": _dsl.Tunable([1024, 512, 2048, 256], default=1024,
                       doc="columns of the d_x block (K; upper bound: the largest multiple of block_size tiling K, "
                           "k_block)"),
    "bn": _dsl.Tunable([512, 256, 1024, 2048], default=512,
                       doc="contraction block (N, the forward's output columns)"),
}


# ----------------------------------------------------------------------------------------------- references
def reference_blockwise_dx(g, w_q, w_scale, block_size: int, w_zero_point=None, weight_format_=None) -> torch.Tensor:
    """float64 ``g [..., N] @ W [N, K_w]`` (not rounded) of the dequantized weight -> ``[..., K_w]``."""
    W = dequantize_blockwise(w_q, w_scale, block_size, w_zero_point, weight_format_)
    return (g.reshape(-1, g.shape[-1]).double() @ W).reshape(*g.shape[:-1], W.shape[1])


def error_bound_blockwise_dx(g, w_q, w_scale, block_size: int, w_zero_point=None, out_dtype=None,
                             weight_format_=None) -> torch.Tensor:
    """The elementwise bound of the module docstring on ``|d_x - reference_blockwise_dx(...)|`` (float64)."""
    from .blockwise import fp4_values, unpack_int4

    odt = out_dtype or g.dtype
    u = 2.0**-8 if odt == torch.bfloat16 else U32
    u_g = 2.0**-8 if g.dtype == torch.bfloat16 else 0.0
    fmt = resolve_format(w_q, "error_bound_blockwise_dx", weight_format_, int4n=True)
    W = dequantize_blockwise(w_q, w_scale, block_size, w_zero_point, weight_format_)
    s = w_scale.double()[:, 0, :].T.repeat_interleave(block_size, 1).abs()
    if fmt in ("int4", INT4N):
        qp = unpack_int4(w_q, block_size, "n" if fmt == INT4N else "k").double() - 8
        zp = 0.0 if w_zero_point is None else (w_zero_point.double()[:, 0, :].T - 8).repeat_interleave(block_size, 1)
        mag_w = (qp.abs() + (zp.abs() if torch.is_tensor(zp) else 0.0)) * s
    elif fmt == "fp4":
        mag_w = fp4_values(unpack_int4(w_q, block_size)).abs() * s
    else:
        mag_w = w_q.double().abs() * s
    g2 = g.reshape(-1, g.shape[-1]).double()
    N = W.shape[0]
    out = (u * (g2 @ W).abs() + (u_g + U32) * (g2.abs() @ W.abs()) + (2 * N + 2) * U32 * (g2.abs() @ mag_w))
    return out.reshape(*g.shape[:-1], W.shape[1])


# ----------------------------------------------------------------------------------------------- kernel
def _dx_body(g_ref, w_ref, s_ref, *refs, bs, n_sub, n_n, n_size, blk_n, int4, fp4, has_zp, dot_dtype, precision):
    """One ``d_x`` block ``[bm, bk]``, one N step (module docstring); ``refs`` = ``[z_ref,] o_ref, acc_ref``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    if has_zp:
        z_ref, o_ref, acc_ref = refs
    else:
        z_ref, (o_ref, acc_ref) = None, refs
    j = pl.program_id(2)
    half = bs // 2
    dims = (((1,), (0,)), ((), ()))  # gs [bm, bn] . w [bn, cols]: contract over N

    def pieces(masked: bool):
        """``[(first column, width, f32 [bm, width])]``: this N step's contribution to the d_x block."""
        g = g_ref[...].astype(jnp.float32)
        if masked:  # N tail: lanes of g (and s, z) and rows of w past N hold garbage (NaN in "tpu" mode)
            lanes = _dsl.tail_valid((1, blk_n), 1, j * blk_n, n_size)
            rows = _dsl.tail_valid((blk_n, 1), 0, j * blk_n, n_size)
        out = []
        for grp in range(n_sub):
            gs = (g * s_ref[grp]).astype(dot_dtype)  # [bm, bn] * [1, bn]: one rounding to g.dtype
            if masked:
                gs = jnp.where(lanes, gs, jnp.zeros((), dot_dtype))
            if int4:  # unpack the group's bytes in VMEM: low nibbles = first half of the group, high = second
                b = w_ref[:, grp * half:(grp + 1) * half].astype(jnp.int32)
                if fp4:
                    lo, hi = _fp4_decode(b & 15, dot_dtype), _fp4_decode(b >> 4, dot_dtype)
                else:
                    lo, hi = ((b & 15) - 8).astype(dot_dtype), ((b >> 4) - 8).astype(dot_dtype)
                ws = [(grp * bs, lo), (grp * bs + half, hi)]
            else:  # int8 / fp8 -> g.dtype is exact
                ws = [(grp * bs, w_ref[:, grp * bs:(grp + 1) * bs].astype(dot_dtype))]
            corr = None
            if z_ref is not None:  # gs . (q' - z')  =  gs . q'  -  rowsum(gs * z')
                t = gs.astype(jnp.float32) * (z_ref[grp] - 8.0)
                if masked:
                    t = jnp.where(lanes, t, 0.0)
                corr = jnp.sum(t, axis=1, keepdims=True)
            for c0, w in ws:
                if masked:
                    w = jnp.where(rows, w, jnp.zeros((), dot_dtype))
                d = jax.lax.dot_general(gs, w, dims, precision=precision, preferred_element_type=jnp.float32)
                if corr is not None:
                    d = d - corr
                out.append((c0, w.shape[1], d))
        return out

    # one traced copy of the step (the branches below only store): with an N tail every step masks (the mask is
    # all-true before the last step), a few vector selects per element, only for N not a multiple of bn
    ps = pieces(n_size % blk_n != 0)
    if n_n == 1:
        for c0, wd, d in ps:
            o_ref[:, c0:c0 + wd] = d.astype(o_ref.dtype)
        return

    @pl.when(j == 0)
    def _():
        for c0, wd, d in ps:
            acc_ref[:, c0:c0 + wd] = d

    @pl.when(jnp.logical_and(j > 0, j < n_n - 1))
    def _():
        for c0, wd, d in ps:
            acc_ref[:, c0:c0 + wd] += d

    @pl.when(j == n_n - 1)
    def _():
        for c0, wd, d in ps:
            o_ref[:, c0:c0 + wd] = (acc_ref[:, c0:c0 + wd] + d).astype(o_ref.dtype)


def _dx_problem(g, w_q, w_scale, w_zero_point, block_size, weight_format):
    """``(M, N, K_w, fmt)`` of a ``d_x`` call: ``g [M, N]`` plus the forward's weight-side checks."""
    if len(g.shape) != 2:
        raise ArgumentError(f"{WHERE}: g must be 2-D [M, N], got shape {tuple(g.shape)}")
    if _name(g.dtype) not in X_DTYPES:
        raise DTypeError(f"{WHERE}: g dtype {_name(g.dtype)} is not one of {X_DTYPES}")
    if len(w_q.shape) != 2:
        raise ArgumentError(f"{WHERE}: w_q must be 2-D, got shape {tuple(w_q.shape)}")
    fmt = resolve_format(w_q, WHERE, weight_format, int4n=True)
    if fmt == INT4N:
        raise ArgumentError(f"{WHERE}: takes int4 packed along K (weight_format 'int4'); repack int4n weights "
                            f"with int4n_to_k (the autograd backward does)")
    K_w = w_q.shape[1] * (2 if fmt in PACKED else 1)
    if g.shape[1] != w_q.shape[0]:
        raise ArgumentError(f"{WHERE}: g {tuple(g.shape)} and w_q {tuple(w_q.shape)}: g's N = {g.shape[1]} must "
                            f"equal w_q's rows N = {w_q.shape[0]}")
    # the weight side exactly as the forward checks it (x stands in with the matching K)
    stand_in = types.SimpleNamespace(shape=(g.shape[0], K_w), dtype=g.dtype)
    M, N, K_w, fmt = problem(stand_in, w_q, w_scale, w_zero_point, block_size, WHERE, weight_format)
    return M, N, K_w, fmt


def _dx_heuristic(g, w_q, w_scale, w_zero_point=None, block_size=128, out_dtype=None, weight_format=None):
    """Not tuned (module docstring): large ``d_x`` blocks for training-size ``M``; f32 ``g`` halves ``bn``. The
    ``bn = 1024`` of bf16 was the best of four blocks in libtpu's model (v6e, module docstring's d_x: ``bm, bk, bn``
    = 512, 1024, 1024: 1430 µs; 512, 1024, 512: 1556; 1024, 1024, 512: 1497; 512, 2048, 512: 1486)."""
    M = g.shape[0]
    f32 = _name(g.dtype) == "float32"
    if M <= 128:
        return dict(bm=128, bk=2048, bn=512 if f32 else 1024)
    return dict(bm=512, bk=1024, bn=512 if f32 else 1024)


def _dx_shape(g, w_q, w_scale, w_zero_point=None, block_size=128, out_dtype=None, weight_format=None):
    M, _, K_w, _ = _dx_problem(g, w_q, w_scale, w_zero_point, block_size, weight_format)
    return _dsl.OutSpec((M, K_w), _out_dtype(out_dtype, g, WHERE))


def _ref_dx(g, w_q, w_scale, w_zero_point=None, block_size=128, out_dtype=None, weight_format=None):
    """jnp version of the kernel (autotuner correctness check): dequantize in f32, one dot."""
    import jax.numpy as jnp
    from jax import lax

    W = dequantize_f32_jnp(w_q, w_scale, w_zero_point, block_size, weight_format)
    z = jnp.matmul(g.astype(jnp.float32), W, precision=lax.Precision.HIGHEST)
    return z.astype(_out_dtype(out_dtype, g, WHERE))


@_dsl.tpu_kernel(_dx_body, name="quantized_matmul_blockwise_bwd_dx", namespace="tpukernels",
                 tunables=TUNABLES_BWD, heuristic=_dx_heuristic, out_shape=_dx_shape,
                 reference=_dsl.jax_reference(_ref_dx))
def quantized_matmul_blockwise_bwd_dx(g: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                                      w_zero_point: Optional[torch.Tensor] = None, block_size: int = 128,
                                      out_dtype: Optional[str] = None, weight_format: Optional[str] = None, *,
                                      bm: int, bk: int, bn: int) -> torch.Tensor:
    """``d_x = g @ W`` (module docstring) with ``g [M, N]`` bfloat16 / float32, ``w_q [N, K_w]`` int8 / fp8 or
    ``[N, K_w/2]`` uint8 (int4, or fp4 with ``weight_format="fp4"``), ``w_scale [K_w/bs, 1, N]`` f32,
    ``w_zero_point`` (int4 only) same shape -> ``[M, K_w]`` in ``out_dtype`` (default ``g.dtype``).

    Raises:
        ArgumentError: ranks, ``g``'s N vs ``w_q``'s rows, block size, packed width, scale / zero-point shapes.
        DTypeError: dtypes. ChipError: fp8 weights on a chip whose MXU lacks that fp8 dtype.
    """
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    M, N, K_w, fmt = _dx_problem(g, w_q, w_scale, w_zero_point, block_size, weight_format)
    if fmt.startswith("float8"):
        check_chip(None, fmt, where=WHERE)
    odt = _out_dtype(out_dtype, g, WHERE)
    int4 = fmt in PACKED
    bk_ = k_block(K_w, block_size, bk, int4)
    bm_, bn_ = _clamp(M, bm), _clamp(N, bn)
    gi, gk, gj = _dsl.cdiv(M, bm_), K_w // bk_, _dsl.cdiv(N, bn_)
    n_sub = bk_ // block_size
    wcols = bk_ // 2 if int4 else bk_
    in_specs = [pl.BlockSpec((bm_, bn_), lambda i, k, j: (i, j)),
                pl.BlockSpec((bn_, wcols), lambda i, k, j: (j, k)),
                pl.BlockSpec((n_sub, 1, bn_), lambda i, k, j: (k, 0, j))]
    if w_zero_point is not None:
        in_specs.append(pl.BlockSpec((n_sub, 1, bn_), lambda i, k, j: (k, 0, j)))
    dot_dtype = _jnp(_name(g.dtype))
    acc_shape = (8, 128) if gj == 1 else (bm_, bk_)
    need = (2 * (padded_bytes((bm_, bn_), g.dtype) + padded_bytes((bn_, wcols), w_q.dtype)
                 + (1 + (w_zero_point is not None)) * n_sub * padded_bytes((1, bn_), "float32")
                 + padded_bytes((bm_, bk_), odt))
            + padded_bytes((bm_, bn_), "float32") + padded_bytes((bm_, bn_), dot_dtype)  # g in f32, one gs
            + 2 * padded_bytes((bn_, block_size), dot_dtype) + padded_bytes((bm_, block_size), "float32")
            + padded_bytes(acc_shape, "float32")
            + 4 * padded_bytes((bn_, block_size), "int32"))  # the unpack's / decode's int32 temporaries
    if np.dtype(dot_dtype) == np.dtype("float32"):  # HIGHEST: Mosaic splits both f32 operands into bf16 parts
        need += 3 * (padded_bytes((bm_, bn_), "bfloat16") + padded_bytes((bn_, block_size), "bfloat16"))
    wbytes = N * K_w // (2 if int4 else 1)
    cost = pl.CostEstimate(flops=2 * M * N * K_w, transcendentals=0,
                           bytes_accessed=int(gk * M * N * np.dtype(g.dtype).itemsize + gi * wbytes
                                              + M * K_w * np.dtype(odt).itemsize))
    f32 = np.dtype(dot_dtype) == np.dtype("float32")
    return _dsl.Launch(
        grid=(gi, gk, gj),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm_, bk_), lambda i, k, j: (i, k)),
        out_shape=_dsl.OutSpec((M, K_w), odt),
        scratch_shapes=[pltpu.VMEM(acc_shape, jnp.float32)],
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=scoped_vmem_limit(need),
        cost_estimate=cost,
        body_kwargs=dict(bs=int(block_size), n_sub=int(n_sub), n_n=int(gj), n_size=int(N), blk_n=int(bn_),
                         int4=int4, fp4=fmt == "fp4", has_zp=w_zero_point is not None, dot_dtype=dot_dtype,
                         precision=lax.Precision.HIGHEST if f32 else None),
    )


# ----------------------------------------------------------------------------------------------- autograd
def _backward(ctx, gy):
    """``d_x`` of :func:`quantized_matmul_blockwise_kernel` (``g`` rounded to ``x.dtype`` first, as the forward's
    MXU ran in ``x.dtype``); ``w_q``, ``w_scale`` and ``w_zero_point`` get no gradient (module docstring)."""
    a = ctx.args
    grads = {}
    if ctx.needs_input_grad.get("x"):
        x = a["x"]
        w_q, fmt = a["w_q"], a["weight_format"]
        if fmt == INT4N:  # the d_x kernel takes int4 packed along K: repacked per backward (a copy of w_q; a gap)
            w_q, fmt = int4n_to_k(w_q, a["block_size"]), None
        grads["x"] = torch.ops.tpukernels.quantized_matmul_blockwise_bwd_dx.default(
            gy.to(x.dtype), w_q, a["w_scale"], a["w_zero_point"], a["block_size"], None, fmt)
    return grads


quantized_matmul_blockwise_kernel.def_backward(_backward, op="quantized_matmul_blockwise")
