"""Quantized experts: ``grouped_matmul_quantized``, the grouped matmul with int8 / fp8 / int4 / fp4 expert weights
and per-channel or block (sub-channel) scales, dequantized in VMEM; forward and ``d_lhs`` (issue 28, item 2).

Semantics: those of :func:`~tpukernels.library.grouped_matmul_ops.grouped_matmul` (ragged row groups, empty groups,
``group_offset`` shards, rows of no local group are zero) with ``rhs[g]`` replaced by its dequantized weight.

Layout (``K_w`` = in features of the stored weight, ``N`` = out features, ``G`` = local experts):

* ``rhs``: ``[G, K_w, N]`` (megablox / tpu-inference's ``gmm`` layout) or, with ``transpose_rhs=True``,
  ``[G, N, K_w]`` (``nn.Linear`` / HF fused experts; each ``rhs[g]`` is then exactly a
  :func:`~tpukernels.library.quantized_matmul_ops.quantized_matmul_blockwise` ``w_q``). Dtypes int8,
  float8_e4m3fn, float8_e5m2, or uint8 for 4-bit weights (``weight_format="int4"``, the default for uint8, or
  ``"fp4"`` e2m1) packed two per byte **along K** (``[G, K_w/2, N]`` / ``[G, N, K_w/2]``) in the per-block order of
  :func:`~tpukernels.library.quantized_matmul_ops.pack_int4` (byte ``j`` of block ``b`` holds K index ``b*bs + j`` in
  its low nibble and ``b*bs + bs/2 + j`` in its high nibble; :func:`pack_int4_experts`).
* ``rhs_scale``: float32 ``[G, num_blocks, 1, N]``, tpu-inference's megablox ``gmm`` layout (``rhs_scale: [num_groups,
  num_blocks, 1, n]``, ``quant_block_size = k // num_blocks``), so ``block_size = K_w / num_blocks``.
  ``num_blocks == 1``: one scale per (expert, output channel); a ``[G, N]`` tensor is accepted as that.
  ``num_blocks > 1``: block scales along K, ``block_size`` a multiple of 32 in 32..512 (the blockwise quantized
  matmul's rule). ``W[g][k, n] = (q[g][k, n] - z) * rhs_scale[g, k // block_size, 0, n]``, ``z = 0`` for 8-bit
  weights, for int4 ``z = rhs_zero_point[g, k // block_size, 0, n]`` (float32, same shape as ``rhs_scale``; GPTQ /
  AWQ asymmetric zero points in grid units) or 8 without zero points (signed int4 stored offset by 8); fp4:
  ``W = e2m1(code) * s``.
* ``rhs_bias`` (optional): ``[G, 1, N]`` bfloat16 / float32, tpu-inference's megablox ``gmm`` ``rhs_bias``: the
  forward kernel adds ``rhs_bias[g]`` in float32 to the accumulator of the rows of group ``g`` in its epilogue (a
  BlockSpec indexed by the work item's group, after the per-channel scale), before the cast to ``out_dtype``; rows
  of no local group stay 0 (megablox leaves them unwritten). Absent: no extra operand (the same program as
  before). Its gradient ``d_rhs_bias[g]`` = the sum of ``dO`` over the rows of group ``g``, float32 accumulated,
  in ``rhs_bias.dtype`` (:func:`~tpukernels.library.grouped_matmul_ops.common.bias_grad`, torch ops).
* Padding rule (as the blockwise quantized matmul): with block scales the weight side is padded to
  ``K_w = num_blocks * block_size``; ``lhs`` may have ``K_x`` columns, ``K_w - block_size < K_x <= K_w``, and is
  then zero-padded to ``K_w`` (a copy of ``lhs``, only then). Per-channel scales need ``K_x == K_w``.

What runs (two kernel ops, new bodies; the bf16 / f32 grouped matmul kernels are untouched):

* ``tpukernels::grouped_matmul_quant_fwd`` — grid ``(N/bn, T, K/bk)`` over the forward's work-item schedule
  (:func:`~tpukernels.library.grouped_matmul_ops.schedule.fwd_schedule`, scalar-prefetched, the same visits, row
  selects and ``PARTIAL`` flags as ``grouped_matmul_fwd``; the grid pipeline's rhs blocks, no manual prefetch
  chain). The expert's weight tile (int8 / fp8 / packed bytes) is copied as stored and converted to ``lhs.dtype``
  in VMEM (exact: 8-bit and 4-bit values are bf16 values); fp8 tiles are fed to the MXU as they are where the
  target chip takes ``(lhs.dtype, fp8)`` natively (jax ``tpu_info``). Per-channel 8-bit (``num_blocks == 1``):
  any ``bk``, K tails masked on both operands (NaN-safe), the f32 accumulator scaled by ``rhs_scale[g, 0]`` once
  in the epilogue. Block scales (and every 4-bit format): ``bk`` a multiple of ``block_size``
  (:func:`~tpukernels.library.quantized_matmul_ops.blockwise.k_block`), per block one MXU dot (two for the two
  nibble halves), minus ``rowsum(lhs_block) * (z - 8)`` for zero points, times the block's scale row, summed
  in f32. HBM holds only the stored (packed) weights.
* ``tpukernels::grouped_matmul_quant_dx`` — ``d_lhs[rows of g] = dO[rows of g] @ W[g]^T`` (``[M, K_w]``, the
  transposed grouped matmul): grid ``(K_w/bk, T, N/bn)`` (contraction over N innermost) on the same schedule;
  per N step and K block ``gs = round_{dO.dtype}(dO * s[g, b])`` (the scales run along N, the lanes of ``dO``),
  one dot per block (two per nibble half) with the weight tile converted in VMEM, zero points as
  ``- rowsum(gs * (z - 8))``; N tails masked on both operands. Per-channel scales are the ``num_blocks = 1``
  case of the same formula.

Gradients: ``lhs`` only. ``rhs`` (integer / frozen fp8 data), ``rhs_scale`` and ``rhs_zero_point`` are frozen
and get ``None`` even when they require grad (as the blockwise quantized matmul's ``d_x``); ``group_sizes``
and ``group_offset`` get none either.

Error (what the tests check; ``u`` = unit roundoff of the output dtype, ``u32 = 2^-24``), elementwise against
the float64 product of the **dequantized** experts (:func:`reference_quantized`), for the rows of group ``g``:
forward ``|y - ref| <= u |ref| + (K_w + 2) u32 (|x| @ M_g^T)`` (with ``rhs_bias``: :func:`error_bound_quantized`)
with ``M_g[n, k] = (|q'| + |z'|) |s|`` (``q'`` the
value fed to the MXU: int4 ``q - 8``, fp4 its e2m1 value, 8-bit the stored value; ``z' = z - 8``, 0 without
zero points); rows of no local group are exactly 0. ``d_lhs``: ``|d - ref| <= u |ref| + (u_g + u32) (|dO| @
|W_g|) + (2 N + 2) u32 (|dO| @ M_g)`` (``u_g`` the unit roundoff of ``dO``'s dtype, 0 for float32). These are the
bounds of :mod:`~tpukernels.library.quantized_matmul_ops.blockwise` / ``blockwise_bwd`` applied per group (same
per-block arithmetic; derivations there, after Higham, "Accuracy and Stability of Numerical Algorithms", 2nd
ed., eq. 3.5); per-channel scales are the one-block case (the epilogue scale is one more f32 rounding, inside
the ``+ 2``). :func:`error_bound_quantized`, :func:`error_bound_quantized_dx`.

Chips: the weight tile reaches the MXU as ``lhs.dtype`` (or as fp8 where native), so int8 / int4 / fp4 run on
every chip; fp8 weights need the target chip's MXU to take that fp8 dtype at all, from jax's
``tpu_info.is_matmul_supported`` (:func:`~tpukernels.library.quantized_matmul_ops.check_chip`): ChipError before any
kernel runs (the target chip: the live TPU, ``tk.compile_for``'s, or ``TPUKERNELS_TARGET_CHIP`` on cpu).

Performance: not measured on hardware and not tuned (no shipped table; :func:`heuristic_quant` /
:func:`heuristic_quant_dx`). libtpu 0.0.52 static estimates (a MODEL, not measurements; one reduced problem of
``tpukernels.bench.grouped_matmul``: v6e, Mixtral up projection at 2048 rows over 8 experts, one 2048-column
output block, int8 experts with per-channel scales): ``bm, bk, bn = 256, 4096 (= K), 1024`` 87.2 µs, ``256,
1024, 1024`` 123.6 µs, ``512, 4096, 2048`` 117.6 µs, against 37.3 µs of MXU roofline for the rows once. The static
model reads the work-item table as zeros, so it charges all ``T = 15`` items for 8 row tiles (1.9x the ideal
MXU work at this size; amortised at full size, 71 items for 64 tiles); the rest is the int8 -> bf16
conversion of each ``[bn, K]`` weight tile, vector work per item. The int4 estimate (``bk = K``, 32 blocks of
128 with zero points) exceeded 150 s and was abandoned: the per-block half-width dots (64-deep) and the unpack
are the known cost of the blockwise kernels (:mod:`~tpukernels.library.quantized_matmul_ops.blockwise`: the same
unpack). All heuristic configs compile for v5e / v6e / tpu7x at Mixtral shapes (tests, aot).

Source: tpu-inference 0.32.0 ``kernels/megablox/gmm.py`` (the ``rhs_scale [G, num_blocks, 1, n]`` layout and the
per-quant-block dot then scale; read, not copied: it takes no zero points, no 4-bit packing and no transposed
rhs); this package's schedule; the blockwise quantized matmul for the dequantization formulas.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ... import dsl as _dsl
from ...dsl.validate import padded_bytes
from ..vmem import scoped_vmem_limit
from ...errors import ArgumentError, DTypeError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from ..quantized_matmul_ops.blockwise import (BLOCK_SIZES, PACKED, dequantize_blockwise, dequantize_f32_jnp,
                                              error_bound_blockwise, fp4_decode as _fp4_decode, k_block, pack_int4,
                                              quantize_weight_blockwise, resolve_format)
from ..quantized_matmul_ops.blockwise_bwd import error_bound_blockwise_dx
from ..quantized_matmul_ops.common import native_fp8, check_chip
from .common import KERNEL_DTYPES, clamp, dtype_name, resolve_out_dtype, bias_grad, canonical_out_dtype, check_bias
from .kernels import check_meta
from .references import ref_bounds_np, reference_fwd_jnp
from .schedule import (COMPUTE, FIRST, F_GROUP, F_HI, F_LO, F_SRC_TILE, F_TILE, PARTIAL, STORE, bits as _bits,
                       fwd_schedule, item_flags as _flags, num_items)

WHERE_FWD = "tpukernels::grouped_matmul_quant_fwd"
WHERE_DX = "tpukernels::grouped_matmul_quant_dx"

TUNABLES_QUANT = {
    "bm": _dsl.Tunable([256, 128, 512, 1024], default=256, doc="rows per output tile (M)"),
    "bk": _dsl.Tunable([1024, 512, 2048, 4096], default=1024,
                       doc="contraction block (K); with block scales an upper bound (k_block: a multiple of "
                           "block_size tiling K_w)"),
    "bn": _dsl.Tunable([1024, 256, 512, 2048], default=1024, doc="output columns per block (N)"),
}
TUNABLES_QUANT_DX = {
    "bm": _dsl.Tunable([256, 128, 512, 1024], default=256, doc="rows per d_lhs tile (M)"),
    "bk": _dsl.Tunable([1024, 512, 2048, 4096], default=1024,
                       doc="d_lhs columns per block (K); with block scales an upper bound (k_block)"),
    "bn": _dsl.Tunable([1024, 256, 512, 2048], default=1024, doc="contraction block (N, the forward's outputs)"),
}


# ----------------------------------------------------------------------------------------------- checks
def _resolve(rhs, where, weight_format):
    """The blockwise quantized matmul's :func:`resolve_format`, its messages naming ``rhs`` (its ``w_q``)."""
    try:
        return resolve_format(rhs, where, weight_format)
    except DTypeError as e:
        raise DTypeError(str(e).replace("w_q", "rhs")) from None


def quant_dims(group_sizes, group_offset, a, rhs, rhs_scale, rhs_zero_point, transpose_rhs, weight_format,
               where, *, dx: bool = False):
    """``(M, K_w, N, G, block_size, fmt, per_channel)`` of a kernel call after checking every operand (typed
    errors naming the tensor). ``a`` is ``lhs [M, K_w]`` (forward) or ``dO [M, N]`` (``dx``)."""
    if len(rhs.shape) != 3:
        raise ArgumentError(f"{where}: rhs must be 3-D [G, {'N, K' if transpose_rhs else 'K, N'}] (K halved for "
                            f"packed 4-bit), got shape {tuple(rhs.shape)}")
    fmt = _resolve(rhs, where, weight_format)
    G, d1, d2 = rhs.shape
    kc, N = (d2, d1) if transpose_rhs else (d1, d2)
    packed = fmt in PACKED
    K_w = 2 * kc if packed else kc
    if len(rhs_scale.shape) != 4 or rhs_scale.shape[0] != G or rhs_scale.shape[2] != 1 or rhs_scale.shape[3] != N:
        raise ArgumentError(f"{where}: rhs_scale must have shape [G, num_blocks, 1, N] = [{G}, num_blocks, 1, {N}] "
                            f"(tpu-inference's gmm layout), got {tuple(rhs_scale.shape)}")
    if dtype_name(rhs_scale.dtype) != "float32":
        raise DTypeError(f"{where}: rhs_scale must be float32, got {dtype_name(rhs_scale.dtype)}")
    nb = rhs_scale.shape[1]
    if nb < 1 or K_w % nb:
        raise ArgumentError(f"{where}: rhs_scale has num_blocks = {nb} blocks along K but rhs holds K_w = {K_w}: the "
                            f"block size K_w / num_blocks must be a whole number (pad the weight's K to a multiple "
                            f"of the block: the padding rule)")
    bs = K_w // nb
    if packed and kc % nb:
        raise ArgumentError(f"{where}: rhs ({fmt}, packed two per byte along K) has {kc} bytes along K, which "
                            f"rhs_scale's {nb} blocks do not split into whole bytes: an odd or partial packed block "
                            f"cannot be unpacked (each block of block_size K indices is block_size / 2 bytes)")
    if nb > 1 and bs not in BLOCK_SIZES:
        raise ArgumentError(f"{where}: rhs_scale's block size K_w / num_blocks = {K_w} / {nb} = {bs} is not a "
                            f"multiple of 32 in 32..512")
    if rhs_zero_point is not None:
        if fmt != "int4":
            raise ArgumentError(f"{where}: rhs_zero_point is for int4 weights (asymmetric); {fmt} weights are "
                                f"symmetric")
        if tuple(rhs_zero_point.shape) != tuple(rhs_scale.shape):
            raise ArgumentError(f"{where}: rhs_zero_point must have rhs_scale's shape {tuple(rhs_scale.shape)}, got "
                                f"{tuple(rhs_zero_point.shape)}")
        if dtype_name(rhs_zero_point.dtype) != "float32":
            raise DTypeError(f"{where}: rhs_zero_point must be float32, got {dtype_name(rhs_zero_point.dtype)}")
    name = "dO" if dx else "lhs"
    if len(a.shape) != 2:
        raise ArgumentError(f"{where}: {name} must be 2-D, got shape {tuple(a.shape)}")
    if dtype_name(a.dtype) not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: {name} dtype {dtype_name(a.dtype)} is not one of {KERNEL_DTYPES}")
    want = N if dx else K_w
    if a.shape[1] != want:
        raise ArgumentError(f"{where}: {name} {tuple(a.shape)} must have {want} columns ({'N' if dx else 'K_w'} of "
                            f"rhs {tuple(rhs.shape)}, transpose_rhs={transpose_rhs}; the public op pads lhs)")
    check_meta(group_sizes, group_offset, G, where)
    return a.shape[0], K_w, N, G, bs, fmt, nb == 1 and not packed


# ----------------------------------------------------------------------------------------------- kernel body
def _qgmm_body(tab, a_ref, w_ref, s_ref, *refs, T, bm, n_c, c_size, blk_c, bs, n_sub, per_channel, packed, fp4,
               has_zp, has_bias, transpose_rhs, conv, dot_dtype, precision, dx):
    """Work item ``i`` (grid axis 1), contraction step ``c`` (axis 2) of either kernel (module docstring).

    Forward: ``a`` = lhs tile ``[bm, bk]``, contraction over K (``c_size = K_w``). ``dx``: ``a`` = dO tile ``[bm, bn]``,
    contraction over N (``c_size = N``), output columns = the K block. ``refs`` = ``[z_ref,] [bias_ref,] out_ref,
    acc_ref`` (``bias_ref``: the forward's ``rhs_bias[g]`` block ``[1, bn]``, added in f32 in the epilogue).
    The weight tile is ``[bn, kc]`` (``transpose_rhs``) or ``[kc, bn]``; its K axis is ``kax``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    refs = list(refs)
    z_ref = refs.pop(0) if has_zp else None
    bias_ref = refs.pop(0) if has_bias else None
    out_ref, acc_ref = refs
    i, c = pl.program_id(1), pl.program_id(2)
    flags = _flags(tab, T, i)
    compute = _bits(flags, COMPUTE)
    kax = 1 if transpose_rhs else 0
    nax = 1 - kax
    masked = c_size % blk_c != 0  # a contraction tail: mask at every step (all-true before the last; traced once)
    half = bs // 2

    def ksl(w, a0, a1):  # slice along the weight tile's K axis
        return w[:, a0:a1] if kax == 1 else w[a0:a1, :]

    def cv(w):
        return w if conv is None else w.astype(conv)

    def decode(byts):  # int32 packed bytes -> (low half, high half) in dot_dtype, exact
        if fp4:
            return _fp4_decode(byts & 15, dot_dtype), _fp4_decode(byts >> 4, dot_dtype)
        return ((byts & 15) - 8).astype(dot_dtype), ((byts >> 4) - 8).astype(dot_dtype)

    def dot(x, w, wdim):
        return jax.lax.dot_general(x, w, (((1,), (wdim,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    def fwd_pieces():
        a = a_ref[...]
        if per_channel:  # 8-bit, one scale per channel: unscaled dot, the scale in the epilogue
            w = cv(w_ref[...])
            if masked:  # K tail: both operands (NaN-safe select)
                a = _dsl.mask_tail(a, 1, c * blk_c, c_size)
                w = _dsl.mask_tail(w, kax, c * blk_c, c_size)
            return [(0, out_ref.shape[1], dot(a, w, kax))]
        wint = w_ref[...].astype(jnp.int32) if packed and kax == 0 else None  # sublane slices on int32
        part = None
        for b in range(n_sub):
            ab = a[:, b * bs:(b + 1) * bs]
            if packed:
                byts = w_ref[:, b * half:(b + 1) * half].astype(jnp.int32) if kax == 1 else \
                    wint[b * half:(b + 1) * half, :]
                lo, hi = decode(byts)
                d = dot(ab[:, :half], lo, kax) + dot(ab[:, half:], hi, kax)
            else:
                wb = w_ref[:, b * bs:(b + 1) * bs] if kax == 1 else w_ref[b * bs:(b + 1) * bs, :]
                d = dot(ab, cv(wb), kax)
            if z_ref is not None:  # x . (q - z) = x . (q - 8) - rowsum(x) (z - 8)
                d = d - jnp.sum(ab.astype(jnp.float32), axis=1, keepdims=True) * (z_ref[b] - 8.0)
            d = d * s_ref[b]
            part = d if part is None else part + d
        return [(0, out_ref.shape[1], part)]

    def dx_pieces():
        g = a_ref[...].astype(jnp.float32)
        if masked:  # N tail: lanes of dO (and of s, z) and the weight's N axis hold garbage (NaN in "tpu" mode)
            lanes = _dsl.tail_valid((1, blk_c), 1, c * blk_c, c_size)
            wvalid = _dsl.tail_valid((blk_c, 1) if nax == 0 else (1, blk_c), nax, c * blk_c, c_size)
        wint = w_ref[...].astype(jnp.int32) if packed and kax == 0 else None
        out = []
        for b in range(n_sub):
            gs = (g * s_ref[b]).astype(dot_dtype)  # [bm, bn] * [1, bn]: one rounding to dO's dtype
            if masked:
                gs = jnp.where(lanes, gs, jnp.zeros((), dot_dtype))
            w0 = 0 if per_channel else b * bs
            if packed:
                byts = w_ref[:, b * half:(b + 1) * half].astype(jnp.int32) if kax == 1 else \
                    wint[b * half:(b + 1) * half, :]
                lo, hi = decode(byts)
                ws = [(w0, lo), (w0 + half, hi)]
            elif per_channel:
                ws = [(0, cv(w_ref[...]))]
            else:
                ws = [(w0, cv(w_ref[:, b * bs:(b + 1) * bs] if kax == 1 else w_ref[b * bs:(b + 1) * bs, :]))]
            corr = None
            if z_ref is not None:  # gs . (q' - z') = gs . q' - rowsum(gs * z')
                t = gs.astype(jnp.float32) * (z_ref[b] - 8.0)
                if masked:
                    t = jnp.where(lanes, t, 0.0)
                corr = jnp.sum(t, axis=1, keepdims=True)
            for c0, w in ws:
                if masked:
                    w = jnp.where(wvalid, w, jnp.zeros((), w.dtype))
                d = dot(gs, w, nax)
                if corr is not None:
                    d = d - corr
                out.append((c0, w.shape[kax], d))
        return out

    def store(z):
        tile = tab[F_TILE * T + i]
        rows = tile * bm + jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
        mask = (rows >= tab[F_LO * T + i]) & (rows < tab[F_HI * T + i])
        prev = jnp.where(_bits(flags, FIRST), 0.0, out_ref[...].astype(jnp.float32))
        out_ref[...] = jnp.where(mask, z, prev).astype(out_ref.dtype)

    def store_all(z):  # an interior tile: its only visit, every row is the group's
        out_ref[...] = z.astype(out_ref.dtype)

    def epilogue(z):
        z = z * s_ref[0] if per_channel and not dx else z
        return z if bias_ref is None else z + bias_ref[...].astype(jnp.float32)  # megablox: f32, before the cast

    last = c == n_c - 1
    finish = _bits(flags, STORE) & last
    partial = _bits(flags, PARTIAL)
    interior = jnp.logical_not(partial)
    pl.when(finish & jnp.logical_not(compute))(lambda: store(jnp.zeros(out_ref.shape, jnp.float32)))

    @pl.when(compute)
    def _():
        for c0, wd, d in (dx_pieces() if dx else fwd_pieces()):
            if n_c == 1:
                acc_ref[:, c0:c0 + wd] = d
            else:  # select, not arithmetic: the first step never reads the (uninitialised) accumulator
                acc_ref[:, c0:c0 + wd] = jnp.where(c == 0, d, acc_ref[:, c0:c0 + wd] + d)

    pl.when(finish & compute & partial)(lambda: store(epilogue(acc_ref[...])))
    pl.when(finish & compute & interior)(lambda: store_all(epilogue(acc_ref[...])))


# ----------------------------------------------------------------------------------------------- launches
def _quant_launch(group_sizes, group_offset, a, rhs, rhs_scale, rhs_zero_point, transpose_rhs, out_dtype,
                  weight_format, bm, bk, bn, *, dx: bool, rhs_bias=None):
    """The Launch of either kernel (module docstring): forward grid ``(N/bn, T, K/bk)``, ``dx`` grid
    ``(K_w/bk, T, N/bn)``."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = WHERE_DX if dx else WHERE_FWD
    M, K_w, N, G, bs, fmt, per_channel = quant_dims(group_sizes, group_offset, a, rhs, rhs_scale, rhs_zero_point,
                                                    transpose_rhs, weight_format, where, dx=dx)
    if fmt.startswith("float8"):
        check_chip(None, fmt, where=where)
    if rhs_bias is not None:
        check_bias(rhs_bias, G, N, where)
    odt = resolve_out_dtype(out_dtype, a)
    packed = fmt in PACKED
    adt = dtype_name(a.dtype)
    native = fmt.startswith("float8") and native_fp8(adt, fmt)
    dot_dtype = np.dtype(getattr(jnp, adt))
    bm_ = clamp(M, bm)
    bk_ = clamp(K_w, bk) if per_channel else k_block(K_w, bs, bk, packed)
    bn_ = clamp(N, bn)
    n_sub = 1 if per_channel else bk_ // bs
    T = num_items(M, G, bm_)
    gk, gn = _dsl.cdiv(K_w, bk_), _dsl.cdiv(N, bn_)
    kc = bk_ // 2 if packed else bk_
    w_blk = (bn_, kc) if transpose_rhs else (kc, bn_)
    s_blk = (None, n_sub, 1, bn_)
    n_c = gn if dx else gk

    def c_eff(t, c, i):  # items that do not compute stay on the previous item's last contraction block (no DMA)
        return jnp.where(_bits(_flags(t, T, i), COMPUTE), c, n_c - 1)

    if dx:  # grid (kk, i, j): output K block kk, contraction over N (j)
        a_spec = pl.BlockSpec((bm_, bn_), lambda kk, i, j, t: (t[F_SRC_TILE * T + i], c_eff(t, j, i)))
        if transpose_rhs:
            w_spec = pl.BlockSpec((None, *w_blk), lambda kk, i, j, t: (t[F_GROUP * T + i], c_eff(t, j, i), kk))
        else:
            w_spec = pl.BlockSpec((None, *w_blk), lambda kk, i, j, t: (t[F_GROUP * T + i], kk, c_eff(t, j, i)))
        s_spec = pl.BlockSpec(s_blk, lambda kk, i, j, t: (t[F_GROUP * T + i], 0 if per_channel else kk, 0,
                                                          c_eff(t, j, i)))
        out_spec = pl.BlockSpec((bm_, bk_), lambda kk, i, j, t: (t[F_TILE * T + i], kk))
        grid, out_shape, acc_shape = (gk, T, gn), (M, K_w), (bm_, bk_)
        a_blk = (bm_, bn_)
    else:  # grid (n, i, k)
        a_spec = pl.BlockSpec((bm_, bk_), lambda n, i, k, t: (t[F_SRC_TILE * T + i], c_eff(t, k, i)))
        if transpose_rhs:
            w_spec = pl.BlockSpec((None, *w_blk), lambda n, i, k, t: (t[F_GROUP * T + i], n, c_eff(t, k, i)))
        else:
            w_spec = pl.BlockSpec((None, *w_blk), lambda n, i, k, t: (t[F_GROUP * T + i], c_eff(t, k, i), n))
        s_spec = pl.BlockSpec(s_blk, lambda n, i, k, t: (t[F_GROUP * T + i], 0 if per_channel else c_eff(t, k, i),
                                                         0, n))
        out_spec = pl.BlockSpec((bm_, bn_), lambda n, i, k, t: (t[F_TILE * T + i], n))
        grid, out_shape, acc_shape = (gn, T, gk), (M, N), (bm_, bn_)
        a_blk = (bm_, bk_)
    in_specs = [a_spec, w_spec, s_spec] + ([s_spec] if rhs_zero_point is not None else [])
    if rhs_bias is not None:  # the forward's bias block of the item's group (megablox gmm's rhs_bias BlockSpec)
        in_specs.append(pl.BlockSpec((None, 1, bn_), lambda n, i, k, t: (t[F_GROUP * T + i], 0, n)))
    zs = 1 + (rhs_zero_point is not None) + (rhs_bias is not None)
    need = (2 * (padded_bytes(a_blk, a.dtype) + padded_bytes(w_blk, rhs.dtype)
                 + zs * n_sub * padded_bytes((1, bn_), "float32") + padded_bytes(acc_shape, odt))
            + 2 * padded_bytes(acc_shape, "float32")  # the accumulator, one step's f32 part
            + 3 * padded_bytes(w_blk, dot_dtype) + 2 * padded_bytes(w_blk, "int32")  # converted / unpacked tile
            + 2 * padded_bytes((bm_, bn_), "float32"))  # dx: dO in f32 and one scaled copy
    wbytes = G * K_w * N // (2 if packed else 1)
    isz, osz = np.dtype(a.dtype).itemsize, np.dtype(odt).itemsize
    passes = gk if dx else gn
    cost = pl.CostEstimate(flops=2 * M * K_w * N, transcendentals=0,
                           bytes_accessed=int(passes * M * a.shape[1] * isz + T * wbytes // max(G, 1)
                                              + M * out_shape[1] * osz))
    f32 = adt == "float32"
    return _dsl.Launch(
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=_dsl.OutSpec(out_shape, odt),
        scratch_shapes=[pltpu.VMEM(acc_shape, jnp.float32)],
        num_scalar_prefetch=2,
        prefetch=lambda gs, go: fwd_schedule(gs, go, M=int(M), G=int(G), bm=int(bm_), T=int(T)),
        dimension_semantics=("parallel", "arbitrary", "arbitrary"),
        vmem_limit_bytes=scoped_vmem_limit(need),
        cost_estimate=cost,
        body_kwargs=dict(T=int(T), bm=int(bm_), n_c=int(n_c), c_size=int(N if dx else K_w),
                         blk_c=int(bn_ if dx else bk_), bs=int(bs), n_sub=int(n_sub), per_channel=per_channel,
                         packed=packed, fp4=fmt == "fp4", has_zp=rhs_zero_point is not None,
                         has_bias=rhs_bias is not None,
                         transpose_rhs=bool(transpose_rhs), conv=None if native else dot_dtype,
                         dot_dtype=dot_dtype, precision=lax.Precision.HIGHEST if f32 else None, dx=dx),
    )


def _dequant_jnp(rhs, rhs_scale, rhs_zero_point, transpose_rhs, weight_format):
    """float32 ``W [G, N, K_w]`` of the stored experts (jnp; the kernels' references)."""
    import jax.numpy as jnp

    G = rhs.shape[0]
    kc = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    K_w = 2 * kc if np.dtype(rhs.dtype) == np.uint8 else kc
    bs = K_w // rhs_scale.shape[1]
    out = []
    for g in range(G):
        wq = rhs[g] if transpose_rhs else rhs[g].T
        zp = None if rhs_zero_point is None else rhs_zero_point[g]
        out.append(dequantize_f32_jnp(wq, rhs_scale[g], zp, bs, weight_format))
    return jnp.stack(out)


def _ref_fwd(group_sizes, group_offset, lhs, rhs, rhs_scale, rhs_zero_point=None, rhs_bias=None, transpose_rhs=False,
             out_dtype=None, weight_format=None):
    W = _dequant_jnp(rhs, rhs_scale, rhs_zero_point, transpose_rhs, weight_format)
    return reference_fwd_jnp(group_sizes, group_offset, lhs, W, rhs_bias, transpose_rhs=True, out_dtype=out_dtype)


def _ref_dx(group_sizes, group_offset, g, rhs, rhs_scale, rhs_zero_point=None, transpose_rhs=False,
            out_dtype=None, weight_format=None):
    W = _dequant_jnp(rhs, rhs_scale, rhs_zero_point, transpose_rhs, weight_format)
    return reference_fwd_jnp(group_sizes, group_offset, g, W, transpose_rhs=False, out_dtype=out_dtype)


def heuristic_quant(group_sizes, group_offset, lhs, rhs, rhs_scale, rhs_zero_point=None, rhs_bias=None,
                    transpose_rhs=False, out_dtype=None, weight_format=None) -> dict:
    """Not tuned: ``bm=256, bn=1024`` and ``bk = K`` up to 4096 (one K step: consecutive tiles of a group keep
    the expert's weight block resident, as the bf16 forward's heuristic; else 1024); float32 ``bn=512``. In
    libtpu's static model (v6e, up projection at 2048 rows, one 2048-column block, int8 per channel) ``bk = K``
    took 87.2 µs against 123.6 µs at ``bk=1024`` (module docstring)."""
    K = lhs.shape[1]
    return dict(bm=256, bk=4096 if K <= 4096 else 1024, bn=512 if dtype_name(lhs.dtype) == "float32" else 1024)


def heuristic_quant_dx(group_sizes, group_offset, g, rhs, rhs_scale, rhs_zero_point=None, transpose_rhs=False,
                       out_dtype=None, weight_format=None) -> dict:
    """Not tuned: as :func:`heuristic_quant`."""
    return dict(bm=256, bk=1024, bn=512 if dtype_name(g.dtype) == "float32" else 1024)


def _fwd_shape(gs, go, lhs, rhs, rhs_scale, rhs_zero_point=None, rhs_bias=None, transpose_rhs=False, out_dtype=None,
               weight_format=None):
    M, _, N, *_ = quant_dims(gs, go, lhs, rhs, rhs_scale, rhs_zero_point, transpose_rhs, weight_format, WHERE_FWD)
    return _dsl.OutSpec((M, N), resolve_out_dtype(out_dtype, lhs))


def _dx_shape(gs, go, g, rhs, rhs_scale, rhs_zero_point=None, transpose_rhs=False, out_dtype=None,
              weight_format=None):
    M, K_w, *_ = quant_dims(gs, go, g, rhs, rhs_scale, rhs_zero_point, transpose_rhs, weight_format, WHERE_DX,
                            dx=True)
    return _dsl.OutSpec((M, K_w), resolve_out_dtype(out_dtype, g))


@_dsl.tpu_kernel(_qgmm_body, name="grouped_matmul_quant_fwd", namespace="tpukernels", tunables=TUNABLES_QUANT,
                 heuristic=heuristic_quant, out_shape=_fwd_shape, reference=_dsl.jax_reference(_ref_fwd))
def grouped_matmul_quant_fwd(group_sizes: torch.Tensor, group_offset: torch.Tensor, lhs: torch.Tensor,
                             rhs: torch.Tensor, rhs_scale: torch.Tensor, rhs_zero_point: Optional[torch.Tensor] = None,
                             rhs_bias: Optional[torch.Tensor] = None, transpose_rhs: bool = False,
                             out_dtype: Optional[str] = None, weight_format: Optional[str] = None,
                             *, bm: int, bk: int, bn: int) -> torch.Tensor:
    """Quantized-expert grouped matmul kernel: ``lhs [M, K_w]`` bf16 / f32, ``rhs`` stored experts (module
    docstring), ``rhs_scale [G, num_blocks, 1, N]`` f32, ``rhs_zero_point`` (int4) same shape, ``rhs_bias
    [G, 1, N]`` bf16 / f32 (optional: added in f32 to the rows of its group before the cast) -> ``[M, N]``.

    Raises:
        ArgumentError: ranks, shapes, block size, packed width (each names the tensor). DTypeError: dtypes.
        ChipError: fp8 weights the target chip's MXU cannot take."""
    return _quant_launch(group_sizes, group_offset, lhs, rhs, rhs_scale, rhs_zero_point, transpose_rhs, out_dtype,
                         weight_format, bm, bk, bn, dx=False, rhs_bias=rhs_bias)


@_dsl.tpu_kernel(_qgmm_body, name="grouped_matmul_quant_dx", namespace="tpukernels", tunables=TUNABLES_QUANT_DX,
                 heuristic=heuristic_quant_dx, out_shape=_dx_shape, reference=_dsl.jax_reference(_ref_dx))
def grouped_matmul_quant_dx(group_sizes: torch.Tensor, group_offset: torch.Tensor, g: torch.Tensor,
                            rhs: torch.Tensor, rhs_scale: torch.Tensor, rhs_zero_point: Optional[torch.Tensor] = None,
                            transpose_rhs: bool = False, out_dtype: Optional[str] = None,
                            weight_format: Optional[str] = None, *, bm: int, bk: int, bn: int) -> torch.Tensor:
    """``d_lhs = dO @ W[g]^T`` per group: ``g`` (= dO) ``[M, N]`` bf16 / f32 and the forward's weight side ->
    ``[M, K_w]`` (rows of no local group are 0).

    Raises: as :func:`grouped_matmul_quant_fwd`."""
    return _quant_launch(group_sizes, group_offset, g, rhs, rhs_scale, rhs_zero_point, transpose_rhs, out_dtype,
                         weight_format, bm, bk, bn, dx=True)


@grouped_matmul_quant_fwd.def_backward(op="grouped_matmul_quantized")
def _quant_backward(ctx, gy):
    """``d_lhs`` through :func:`grouped_matmul_quant_dx` (``dO`` rounded to ``lhs.dtype`` first, the dtype the
    forward's MXU ran in); the weight side and the group metadata get no gradient (module docstring)."""
    a = ctx.args
    grads = {}
    if ctx.needs_input_grad.get("lhs"):
        lhs = a["lhs"]
        grads["lhs"] = torch.ops.tpukernels.grouped_matmul_quant_dx.default(
            a["group_sizes"], a["group_offset"], gy.to(lhs.dtype), a["rhs"], a["rhs_scale"], a["rhs_zero_point"],
            a["transpose_rhs"], None, a["weight_format"])
    if a.get("rhs_bias") is not None and ctx.needs_input_grad.get("rhs_bias"):
        grads["rhs_bias"] = bias_grad(gy, a["group_sizes"], a["group_offset"], a["rhs_bias"])
    return grads


# ----------------------------------------------------------------------------------------------- public
def _canon_scale(rhs_scale, rhs, transpose_rhs, where):
    """A ``[G, N]`` per-channel scale as ``[G, 1, 1, N]``; any other shape as given (checked later)."""
    if not isinstance(rhs_scale, torch.Tensor):
        raise ArgumentError(f"{where}: rhs_scale must be a torch.Tensor, got {type(rhs_scale).__name__}")
    if rhs_scale.dim() == 2 and rhs.dim() == 3:
        return rhs_scale.reshape(rhs_scale.shape[0], 1, 1, rhs_scale.shape[1])
    return rhs_scale


def grouped_matmul_quantized(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor,
                             rhs_scale: torch.Tensor, *, rhs_zero_point: Optional[torch.Tensor] = None,
                             transpose_rhs: bool = False, group_offset=None, out_dtype=None,
                             weight_format: Optional[str] = None, config: Optional[dict] = None,
                             rhs_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Grouped matmul with quantized expert weights: ``out[rows of g] = lhs[rows of g] @ W[g - group_offset]
    (+ rhs_bias[g - group_offset])``, ``W`` dequantized in VMEM from ``rhs`` / ``rhs_scale`` (/
    ``rhs_zero_point``); differentiable in ``lhs`` and ``rhs_bias``.

    Args:
        lhs: ``[M, K_x]`` bfloat16 / float32 activations (``K_x == K_w``, or with block scales
            ``K_w - block_size < K_x <= K_w``: zero-padded, the padding rule).
        rhs: ``[G, K_w, N]`` (``transpose_rhs``: ``[G, N, K_w]``) int8 / float8_e4m3fn / float8_e5m2, or uint8 4-bit
            packed two per byte along K (``[G, K_w/2, N]`` / ``[G, N, K_w/2]``; :func:`pack_int4_experts`).
        group_sizes: int32 ``[G_total]`` (as :func:`~tpukernels.library.grouped_matmul`).
        rhs_scale: float32 ``[G, num_blocks, 1, N]`` (tpu-inference's gmm layout; ``block_size = K_w /
            num_blocks``) or ``[G, N]`` (per channel).
        rhs_zero_point: int4 only, float32, ``rhs_scale``'s shape (grid units; None: symmetric, ``z = 8``).
        transpose_rhs: ``rhs`` stored ``[G, N, K]`` (``nn.Linear`` / HF expert layout).
        group_offset: int or int32 scalar tensor: the shard's first group (default 0).
        out_dtype: ``"bfloat16"`` / ``"float32"`` (or torch dtype); default ``lhs.dtype``.
        weight_format: for uint8 ``rhs``: ``"int4"`` (default) or ``"fp4"`` (e2m1 codes, no zero points).
        config: ``{"bm", "bk", "bn"}`` of the forward kernel (``bk`` an upper bound with block scales).
        rhs_bias: ``[G, 1, N]`` bfloat16 / float32 (megablox ``gmm``'s): added in float32 to the rows of each
            local group before the cast (module docstring); its gradient is the per-group sum of ``dO``.

    Returns:
        ``[M, N]`` in ``out_dtype``; rows of no local group are 0 (no bias). Error bound: module docstring
        (:func:`error_bound_quantized`).

    Raises:
        ArgumentError: ranks; ``rhs_scale`` / ``rhs_zero_point`` / ``rhs_bias`` shapes; a block size that does not
            divide ``K_w`` or is not a multiple of 32 in 32..512; an odd / partial packed dimension; ``lhs``'s K
            outside the padding rule; group metadata (as :func:`~tpukernels.library.grouped_matmul`).
        DTypeError: dtypes (``rhs``, ``lhs``, scales / zero points not float32, ``rhs_bias`` not bf16 / f32,
            ``weight_format``, ``out_dtype``).
        DeviceError: tensors on different devices. ChipError: fp8 weights the target chip cannot take.
    """
    from ...errors import DeviceError
    from ...targets import config_to_json
    from .public import check_values

    where = "tpukernels::grouped_matmul_quantized"
    for t, n in ((lhs, "lhs"), (rhs, "rhs"), (group_sizes, "group_sizes")):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(t).__name__}")
    if rhs_zero_point is not None and not isinstance(rhs_zero_point, torch.Tensor):
        raise ArgumentError(f"{where}: rhs_zero_point must be a torch.Tensor or None")
    if rhs_bias is not None and not isinstance(rhs_bias, torch.Tensor):
        raise ArgumentError(f"{where}: rhs_bias must be a torch.Tensor or None, got {type(rhs_bias).__name__}")
    rhs_scale = _canon_scale(rhs_scale, rhs, transpose_rhs, where)
    if rhs_zero_point is not None:
        rhs_zero_point = _canon_scale(rhs_zero_point, rhs, transpose_rhs, where)
    if group_offset is not None and not isinstance(group_offset, torch.Tensor):
        if isinstance(group_offset, bool) or not isinstance(group_offset, (int, np.integer)):
            raise ArgumentError(f"{where}: group_offset must be an int or an int32 scalar tensor, got "
                                f"{type(group_offset).__name__} {group_offset!r}")
        group_offset = torch.tensor(int(group_offset), dtype=torch.int32, device=lhs.device)
    ts = [lhs, rhs, group_sizes, rhs_scale] + [t for t in (rhs_zero_point, group_offset, rhs_bias) if t is not None]
    if len({t.device for t in ts}) > 1:
        raise DeviceError(f"{where}: lhs, rhs, group_sizes, rhs_scale (and rhs_zero_point, group_offset, rhs_bias) "
                          f"must be on one device, got {sorted({str(t.device) for t in ts})}")
    if len(lhs.shape) != 2:
        raise ArgumentError(f"{where}: lhs must be 2-D [M, K], got shape {tuple(lhs.shape)}")
    odt = canonical_out_dtype(out_dtype, where)
    go = group_offset if group_offset is not None else torch.zeros((), dtype=torch.int32, device=lhs.device)
    if len(rhs.shape) == 3 and len(rhs_scale.shape) == 4:
        fmt = _resolve(rhs, where, weight_format)
        kc = rhs.shape[2] if transpose_rhs else rhs.shape[1]
        K_w = 2 * kc if fmt in PACKED else kc
        nb = max(rhs_scale.shape[1], 1)
        bs = K_w // nb if K_w % nb == 0 else None
        K_x = lhs.shape[1]
        lo = K_w - bs if nb > 1 and bs is not None else K_w - 1
        if bs is not None and not lo < K_x <= K_w:
            rule = (f"K_w - block_size < K <= K_w with block_size {bs}" if nb > 1 else
                    "K == K_w (per-channel scales: no padding)")
            raise ArgumentError(f"{where}: lhs has K = {K_x} columns but rhs holds K_w = {K_w}: the padding rule "
                                f"allows {rule}")
        if bs is not None and K_x < K_w:
            lhs = torch.nn.functional.pad(lhs, (0, K_w - K_x))  # zero columns meet the padded weight
    M, K_w, N, G, bs, fmt, _ = quant_dims(group_sizes, go.reshape(1) if go.dim() == 0 else go, lhs, rhs, rhs_scale,
                                          rhs_zero_point, transpose_rhs, weight_format, where)
    if fmt.startswith("float8"):
        check_chip(None, fmt, where=where)
    if rhs_bias is not None:
        check_bias(rhs_bias, G, N, where)
    Gt = group_sizes.shape[0]
    if group_offset is None and Gt != G:
        raise ArgumentError(f"{where}: rhs has {G} groups but group_sizes has {Gt}; pass group_offset for a shard")
    check_values(group_sizes, go, M, G, where)
    wf = fmt if fmt == "fp4" else None
    if M == 0 or N == 0 or G == 0:
        y = torch.nn.functional.linear(lhs, lhs.new_zeros(N, K_w))  # no kernel; keeps autograd's graph (d_lhs 0)
        if rhs_bias is not None:  # no row takes a bias: a zero that keeps its graph (d_rhs_bias 0)
            y = y + rhs_bias.reshape(-1)[:0].sum().to(y.dtype)
        return y.to(getattr(torch, odt or dtype_name(lhs.dtype)))[:, :N]
    kw = {} if not config else dict(config=config_to_json(grouped_matmul_quant_fwd, config))
    y = torch.ops.tpukernels.grouped_matmul_quant_fwd(group_sizes, go.reshape(1), lhs, rhs, rhs_scale, rhs_zero_point,
                                                      rhs_bias, bool(transpose_rhs), odt, wf, **kw)
    return y


# ----------------------------------------------------------------------------------------------- quantizing
def pack_int4_experts(q: torch.Tensor, block_size: int, transpose_rhs: bool = True) -> torch.Tensor:
    """Pack unsigned nibbles ``q`` (``[G, N, K]`` with ``transpose_rhs``, else ``[G, K, N]``; integers 0..15) two per
    byte along K, per expert with :func:`~tpukernels.library.quantized_matmul_ops.pack_int4` (its per-block order)."""
    if q.dim() != 3:
        raise ArgumentError(f"pack_int4_experts: q must be 3-D, got {tuple(q.shape)}")
    if transpose_rhs:
        return torch.stack([pack_int4(q[g], block_size) for g in range(q.shape[0])])
    return torch.stack([pack_int4(q[g].T, block_size).T for g in range(q.shape[0])]).contiguous()


def quantize_experts(w: torch.Tensor, block_size: Optional[int] = None, dtype: str = "int8", *,
                     asymmetric: bool = False, transpose_rhs: bool = True):
    """Quantize expert weights ``w [G, N, K]`` (``nn.Linear`` layout, ``K`` a multiple of ``block_size``) with this
    library's quantizers (:func:`~tpukernels.library.quantized_matmul_ops.quantize_weight` per channel when
    ``block_size`` is None, else :func:`~tpukernels.library.quantized_matmul_ops.quantize_weight_blockwise`).

    Returns ``(rhs, rhs_scale [G, num_blocks, 1, N] f32, rhs_zero_point or None)`` for
    :func:`grouped_matmul_quantized` with the given ``transpose_rhs`` (``False``: ``rhs [G, K, N]``)."""
    from ..quantized_matmul_ops.quantize import quantize_weight

    if w.dim() != 3:
        raise ArgumentError(f"quantize_experts: w must be 3-D [G, N, K], got {tuple(w.shape)}")
    if block_size is not None and dtype not in ("int8", "int4", "fp4"):
        raise DTypeError(f"quantize_experts: block scales take dtype int8, int4 or fp4, got {dtype!r} (fp8 weights: "
                         f"per channel, block_size=None)")
    G, N, K = w.shape
    qs, ss, zs = [], [], []
    for g in range(G):
        if block_size is None:
            q, s = quantize_weight(w[g], dtype)
            qs.append(q)
            ss.append(s.reshape(1, 1, N))
        else:
            q, s, z = quantize_weight_blockwise(w[g], block_size, dtype, asymmetric=asymmetric)
            qs.append(q)
            ss.append(s)
            zs.append(z)
    rhs = torch.stack(qs)
    if not transpose_rhs:
        rhs = rhs.transpose(1, 2).contiguous()
    z = torch.stack(zs) if zs and zs[0] is not None else None
    return rhs, torch.stack(ss), z


# ----------------------------------------------------------------------------------------------- references
def _expert_args(rhs, rhs_scale, rhs_zero_point, transpose_rhs, weight_format, g):
    """``(w_q [N, K or K/2], w_scale [nb, 1, N], w_zero_point, block_size)`` of expert ``g`` in the blockwise
    quantized matmul's layout (so its references and bounds apply)."""
    rhs_scale = _canon_scale(rhs_scale, rhs, transpose_rhs, "reference_quantized")
    wq = rhs[g] if transpose_rhs else rhs[g].T.contiguous()
    fmt = resolve_format(rhs, "reference_quantized", weight_format)
    K_w = wq.shape[1] * (2 if fmt in PACKED else 1)
    zp = None if rhs_zero_point is None else _canon_scale(rhs_zero_point, rhs, transpose_rhs, "")[g]
    return wq, rhs_scale[g], zp, K_w // rhs_scale.shape[1]


def dequantize_experts(rhs, rhs_scale, rhs_zero_point=None, *, transpose_rhs=False, weight_format=None):
    """float64 ``W [G, N, K_w]`` (exact) of the stored experts (module docstring's formulas)."""
    out = []
    for g in range(rhs.shape[0]):
        wq, s, z, bs = _expert_args(rhs, rhs_scale, rhs_zero_point, transpose_rhs, weight_format, g)
        out.append(dequantize_blockwise(wq, s, bs, z, weight_format))
    return torch.stack(out)


def _per_group(fn, out_cols, lhs, rhs, rhs_scale, rhs_zero_point, group_sizes, transpose_rhs, group_offset,
               weight_format):
    off = 0 if group_offset is None else int(group_offset)
    M, G = lhs.shape[0], rhs.shape[0]
    out = torch.zeros(M, out_cols, dtype=torch.float64)
    for g, (s, e) in enumerate(ref_bounds_np(group_sizes.cpu().numpy(), [off], M, G)):
        if e > s:
            wq, sc, zp, bs = _expert_args(rhs, rhs_scale, rhs_zero_point, transpose_rhs, weight_format, g)
            out[s:e] = fn(lhs[s:e], wq, sc, bs, zp)[:, :out_cols]
    return out


def _k_w(rhs, transpose_rhs, weight_format):
    kc = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    return 2 * kc if resolve_format(rhs, "reference_quantized", weight_format) in PACKED else kc


def _n_out(rhs, transpose_rhs):
    return rhs.shape[1] if transpose_rhs else rhs.shape[2]


def _add_bias(out, rhs_bias, group_sizes, group_offset, G):
    """``out`` plus ``rhs_bias[g]`` (float64) on the rows of each local group ``g``."""
    if rhs_bias is None:
        return out
    off = 0 if group_offset is None else int(group_offset)
    for g, (s, e) in enumerate(ref_bounds_np(group_sizes.cpu().numpy(), [off], out.shape[0], G)):
        out[s:e] += rhs_bias[g].double()
    return out


def reference_quantized(lhs, rhs, group_sizes, rhs_scale, rhs_zero_point=None, *, transpose_rhs=False,
                        group_offset=None, weight_format=None, rhs_bias=None) -> torch.Tensor:
    """float64 reference (not rounded) of :func:`grouped_matmul_quantized` from the stored experts: ``lhs`` rows
    of group ``g`` (zero-padded to ``K_w``) times the dequantized ``W[g]^T`` (plus ``rhs_bias[g]``); other rows
    0."""
    from ..quantized_matmul_ops.blockwise import reference_blockwise

    out = _per_group(lambda x, wq, s, bs, z: reference_blockwise(x, wq, s, bs, z, weight_format),
                     _n_out(rhs, transpose_rhs), lhs, rhs, rhs_scale, rhs_zero_point, group_sizes, transpose_rhs,
                     group_offset, weight_format)
    return _add_bias(out, rhs_bias, group_sizes, group_offset, rhs.shape[0])


def error_bound_quantized(lhs, rhs, group_sizes, rhs_scale, rhs_zero_point=None, *, transpose_rhs=False,
                          group_offset=None, out_dtype=None, weight_format=None, rhs_bias=None) -> torch.Tensor:
    """The module docstring's elementwise forward bound on ``|y - reference_quantized(...)|`` (0 off-group).
    With ``rhs_bias``: ``E (1 + 2^-7) + (u + 2 u32) |ref|``, ``E`` the float32-output bound of the unbiased
    product and ``ref`` the biased reference (the f32 addition of the bias, then the cast to ``out_dtype``)."""
    b = _per_group(lambda x, wq, s, bs, z: error_bound_blockwise(x, wq, s, bs, z, torch.float32, weight_format),
                   _n_out(rhs, transpose_rhs), lhs, rhs, rhs_scale, rhs_zero_point, group_sizes,
                   transpose_rhs, group_offset, weight_format) if rhs_bias is not None else None
    if b is None:
        return _per_group(lambda x, wq, s, bs, z: error_bound_blockwise(x, wq, s, bs, z, out_dtype, weight_format),
                          _n_out(rhs, transpose_rhs), lhs, rhs, rhs_scale, rhs_zero_point, group_sizes,
                          transpose_rhs, group_offset, weight_format)
    ref = reference_quantized(lhs, rhs, group_sizes, rhs_scale, rhs_zero_point, transpose_rhs=transpose_rhs,
                              group_offset=group_offset, weight_format=weight_format, rhs_bias=rhs_bias).abs()
    odt = canonical_out_dtype(out_dtype) or dtype_name(lhs.dtype)
    u = {"bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}[odt]
    # E = the float32 accumulator's bound; fl32(acc + bias) then the cast: E (1 + u32 + u) + (u32 + u) |ref|
    return b * (1 + 2.0 ** -7) + (u + 2 * 2.0 ** -24) * ref


def reference_quantized_dx(dO, rhs, group_sizes, rhs_scale, rhs_zero_point=None, *, K: Optional[int] = None,
                           transpose_rhs=False, group_offset=None, weight_format=None) -> torch.Tensor:
    """float64 ``d_lhs`` (not rounded): rows of group ``g`` of ``dO [M, N]`` times the dequantized ``W[g]``,
    ``[M, K]`` (``K`` default ``K_w``: the first ``K`` columns, as the public op's gradient of an unpadded lhs)."""
    from ..quantized_matmul_ops.blockwise_bwd import reference_blockwise_dx

    K = K or _k_w(rhs, transpose_rhs, weight_format)
    return _per_group(lambda x, wq, s, bs, z: reference_blockwise_dx(x, wq, s, bs, z, weight_format), K,
                      dO, rhs, rhs_scale, rhs_zero_point, group_sizes, transpose_rhs, group_offset, weight_format)


def error_bound_quantized_dx(dO, rhs, group_sizes, rhs_scale, rhs_zero_point=None, *, K: Optional[int] = None,
                             transpose_rhs=False, group_offset=None, out_dtype=None,
                             weight_format=None) -> torch.Tensor:
    """The module docstring's elementwise ``d_lhs`` bound (0 off-group)."""
    K = K or _k_w(rhs, transpose_rhs, weight_format)
    return _per_group(lambda x, wq, s, bs, z: error_bound_blockwise_dx(x, wq, s, bs, z, out_dtype, weight_format),
                      K, dO, rhs, rhs_scale, rhs_zero_point, group_sizes, transpose_rhs, group_offset,
                      weight_format)
