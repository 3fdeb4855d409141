"""Block-wise (sub-channel) quantized weights: ``quantized_matmul_blockwise`` — w4a16 (int4 with optional zero
points: GPTQ / AWQ / compressed-tensors W4A16, or fp4 e2m1; both packed two per byte) and block-scaled w8a16
(int8 / fp8, e.g. DeepSeek-V3's 128x128 fp8 blocks expanded along N).

Layout (``K`` = in features, ``N`` = out features, ``bs`` = ``block_size``, ``G = K / bs`` groups along K):

* ``w_scale [G, 1, N]`` float32: the scale of group ``g`` (columns ``g*bs .. (g+1)*bs - 1``) of output channel
  ``n`` — the layout tpu-inference's block-wise ``quantized_matmul_kernel`` takes (``[n_in // block_size, 1,
  n_out]``), applied to each group's partial dot product (a row vector over the output block's lanes).
* int8 / float8_e4m3fn / float8_e5m2 ``w_q [N, K]``: ``W[n, k] = w_q[n, k] * w_scale[k // bs, 0, n]``.
* fp4 (e2m1, ``weight_format="fp4"``): ``w_q [N, K/2]`` uint8 packed as int4 below, each nibble an e2m1 code
  (bit 3 sign, bits 2..1 exponent, bit 0 mantissa: ``0, 0.5, 1, 1.5, 2, 3, 4, 6``), ``W = e2m1(code) * s``;
  decoded in VMEM with integer ops (``2v = m`` or ``(2 + m) << (e - 1)``), exact in bf16; no zero points.
* int4 ``w_q [N, K/2]`` uint8, packed per group: byte ``j`` (``0 <= j < bs/2``) of group ``g`` of row ``n``
  holds column ``g*bs + j`` in its low nibble and column ``g*bs + bs/2 + j`` in its high nibble (so the kernel
  unpacks a group into two contiguous halves, no lane interleave); nibbles ``q`` are unsigned ``0..15`` and
  ``W[n, k] = (q[n, k] - z) * w_scale[k // bs, 0, n]`` with ``z = w_zero_point[k // bs, 0, n]`` (float32,
  ``[G, 1, N]``, in units of the grid: GPTQ / AWQ's asymmetric zero points) or ``z = 8`` without zero points
  (symmetric signed int4 stored offset by 8, as compressed-tensors packs it). :func:`pack_int4` /
  :func:`unpack_int4` convert from / to ``q [N, K]``.
* int4 packed along N (``weight_format="int4n"``, :func:`pack_int4` with ``layout="n"``; TPUBlockQuantLinear's
  default for an even ``N``, which the checkpoint loaders fill, repacking GPTQ / AWQ / compressed-tensors orders
  once, at load): ``w_q [N/2, K]`` uint8, byte ``[i, k]`` holds ``q[2i, k] - 8`` in its low nibble and
  ``q[2i + 1, k] - 8`` in its high nibble as two's complement int4 (the stored nibble is ``q ^ 8``); ``q``, ``z``
  and ``W`` as for int4. This is the order in which Mosaic's ``pltpu.bitcast(uint8 [R, C] -> int4 [2R, C])``
  unpacks a tile (byte row ``i`` -> rows ``2i`` (low nibble), ``2i + 1``: jax's interpret lowering of the
  bitcast, which jax's TPU tests check against Mosaic), so the kernel unpacks a ``[bn/2, bk]`` byte tile with one
  bitcast and one int4 -> ``x.dtype`` convert (exact: ``-8..7``), no integer arithmetic.

Padding rule (K not a multiple of ``bs``): the weight side is padded, the activations are not. A checkpoint's
weight with ``K`` in-features and ``K % bs != 0`` is stored with ``K_w = ceil(K / bs) * bs`` columns (the padded
columns hold any finite value: int8 / fp8 zeros, int4 nibbles equal to the zero point) — :func:`pad_k` does
this. ``x`` may then have ``K_x`` columns with ``K_w - bs < K_x <= K_w``; the op pads ``x`` with zero columns to
``K_w`` (a copy of ``x`` in HBM, only then), so the padded weight columns contribute exactly nothing. Any other
``K_x`` raises.

What runs (int4n: each group's bytes ``[bn/2, bs]`` bitcast to int4 ``[bn, bs]`` and converted, one dot per
group; the decode form below with the whole tile converted once, one dot over ``bk``): ``quantized_matmul_blockwise_kernel``, grid ``(M/bm, N/bn, K_w/bk)`` with ``bk`` a multiple of
``bs`` (no K tail: :func:`k_block`), f32 VMEM accumulator across K steps. Per K step, for each of the
``bk / bs`` groups (a static loop): the group's weight tile is loaded from VMEM, unpacked (int4: ``b & 15``,
``b >> 4``, each minus 8) and converted to ``x.dtype`` (exact: integers ``-8..7`` and 8-bit values are bf16
values), multiplied on the MXU with the group's ``x`` columns accumulating in f32, then (zero points) corrected
by ``- rowsum(x_group) * (z - 8)`` and multiplied by the group's scale row. The weights are unpacked and
dequantized only in VMEM; HBM holds the packed bytes.

Error (``u`` = unit roundoff of the output dtype, ``u32 = 2^-24``), against the float64 product of the
**dequantized** operands (:func:`reference_blockwise`), elementwise:
``|y - ref| <= u |ref| + (K_w + 2) u32 (|x| @ M^T)`` with ``M[n, k] = (|q' [n, k]| + |z'[g, n]|) * |s[g, n]|``,
where ``q'`` is the value fed to the MXU (int4: ``q - 8``; int8 / fp8: ``w_q``; fp4: its e2m1 value) and
``z' = z - 8`` (0 without zero points, so then ``M = |W|``). Derivation: the group products are exact in f32
(bf16 times a small integer, an e2m1 or an 8-bit value), a group's f32 sum of ``bs`` terms (in any order, split
in two halves or not) errs by at most ``(bs - 1) u32`` times its absolute sum (Higham, "Accuracy and Stability
of Numerical Algorithms", 2nd ed., eq. 3.5), the zero-point row sum likewise with ``|z'|`` and two more
roundings (its product, the subtraction), the scale product one, the sum of the ``G`` scaled groups across the
K steps ``G - 1``: ``bs + G + 1 <= K_w + 2`` units of ``u32`` (to first order); then the final rounding to the
output dtype (``u |ref|``). :func:`error_bound_blockwise`.

Chips: the weight tile reaches the MXU as ``x.dtype`` (bf16 x bf16 everywhere; f32 at HIGHEST precision), so
int4 and int8 run on every chip; fp8 weights need the chip to take the fp8 dtype at all (as
:func:`~tpukernels.library.quantized_matmul_ops.check_chip` for w8a16). Gradient: differentiable in ``x`` (``d_x = g @ W``,
the kernel ``quantized_matmul_blockwise_bwd_dx`` of :mod:`.blockwise_bwd`, dequantizing in VMEM like this one);
``w_q``, ``w_scale`` and ``w_zero_point`` are frozen and get no gradient (``None``).

Decode form (packed int4 / fp4 weights, one row block, ``bm * bk / bs <= diag_rows(chip)``: ``min(256, bf16 peak
FLOP/s / HBM bytes/s)`` from jax's tpu_info, 240 on v5e, 256 on v6e and tpu7x): the weight tile is unpacked once,
whole, and every group's partial product comes from one pair of dots (low / high nibbles) with a block-diagonal
``x`` of ``n_sub * bm`` rows — row block ``g`` is ``x`` with the other groups' columns zeroed (exact zeros, so each
row block's sum is exactly that group's terms, and the bound above is unchanged) — then each row block is scaled
(and zero-point corrected) and summed. It spends ``n_sub``-fold MXU work to replace ``2 n_sub`` dots of ``bs / 2``
columns by two of ``bk / 2``, worth it only while the MXU has room next to the weight stream (hence the rule).

Performance (libtpu 0.0.52 static estimate of the whole kernel, a MODEL, not a measurement; w4a16 decode
``16x4096 @ (14336x4096)^T``, group 128, at the heuristic's blocks; bench rows ``w4a16 int4 g128`` of
``tpukernels bench --family quantized_matmul``). Before this round: v6e 80.6 µs (24% of the 19.4 µs HBM roofline
of its bytes), tpu7x 64.0 µs (13% of 8.6 µs), v5e 94.4 µs. Levers, v6e unless said:

* decode tiles ``bk=4096, bn=1024`` (were 2048 / 512): 70.5 µs (tpu7x 55.6, v5e 90.0); ``bk=1024, bn=2048`` 76.0,
  ``bk=4096, bn=256`` 78.9;
* the decode form above at ``bk=2048, bn=1024`` (the heuristic for ``M <= 16``): 54.8 µs, 35% (tpu7x 39.0 µs,
  22%); on v5e it loses (256 rows: 162.8 µs, 128 rows: 93.4 µs vs 90.0: its MXU has no room), hence the rule;
* not the cost: the nibble arithmetic (no mask / shift / -8: 80.3 vs 80.6 µs), unpacking before widening (80.4);
  int8 vector arithmetic is rejected by Mosaic (only i16 / i32 vectors); unpacking the whole tile, then per-group
  dots: 70.5 (the same as per group);
* unpacking to float8_e5m2 (``-8..7`` exact; bf16 x e5m2 is native on v5e, v6e and tpu7x per tpu_info) instead of
  bf16: 80.6 -> 68.6 µs, 70.5 -> 58.1 at the larger tiles, but libtpu's estimator aborts on the f32 -> fp8 pack
  on tpu7x (``vpack.c.f32.eXmY``, as for the fp8 w8a8 rows), so it was not kept;
* the floor of the group structure (one dot per K step, no per-group scaling, wrong values): 42.5 µs — the
  unpack (uint8 -> int32 -> bf16, one element per 32-bit lane) is what is left;
* a SWAR unpack probe (the packed bytes bitcast to int32 words, two nibbles per word placed into bf16 bit
  patterns ``0x4300 | q`` = ``128 + q`` with shifts and masks, one bf16 subtract of 136; rows come out permuted,
  so a cost probe only): 33.3 µs on v6e (58%), 25.8 µs on tpu7x (33%). Using it needs the nibbles packed along
  N (output rows) so that the bitcast rows come out in order: a weight format change, not done.

int4 packed along N (``"int4n"``, this round; the same model and rows, the bench's int4 rows now use it): the
native unpack removes the vector-bound unpack above. 16 tokens: v6e 54.8 -> 28.7 µs (the decode form, ``bk=1024``,
``bn=7168``: the fewest N blocks of at most 8192 columns; ``bn=2048`` 33.3, per-group dots ``bk=4096`` 37.3),
tpu7x 39.0 -> 22.0, v5e 93.0 -> 48.4 (per-group dots ``bk=4096, bn=1024``: libtpu's estimator aborts on v5e's
decode form at ``bk=1024`` and on its per-group form with ``bk < 4096`` at 16 tokens; ``bk=2048`` 55.4). 64 tokens
(per-group dots, ``bk=4096, bn=1024``): v6e 74.3 -> 37.6, tpu7x 56.4 -> 29.4, v5e 102.4 -> 48.9 µs. Against our
bf16 matmul (bench rows): v6e 2.5x / 1.9x, tpu7x 1.5x / 1.2x, v5e 3.0x / 3.0x at 16 / 64 tokens. tpu7x's
bf16-fed MXU floor (~22 µs, below) is what caps it; the per-group structure (a 128-column dot and a scale
multiply per group) is what is left elsewhere (one dot per K step, no scales: 32.3 µs on v6e in
``benchmarks/probes/int4_native_unpack_probe.py``). Gaps: fp4 stays packed along K; the backward (``d_x``) and
``x_quant`` kernels take the K layout, so with int4n weights they repack ``w_q`` per call (:func:`int4n_to_k`,
a copy of the weight); ``N`` must be even.

Before int4n, at 64 tokens (``64x4096 @ (14336x4096)^T``; bench rows) the decode form is past its row limit and the kernel is
74.3 µs on v6e (28%: the bf16 matmul's 73.0) and 56.4 µs on tpu7x (16%; the bf16 matmul 34.2): no gain over bf16
weights there yet (the form with ``bk=512``, 256 rows: v6e 75.2, tpu7x 59.4 µs).
So the issue's target (>= 85% of the HBM roofline on v6e and tpu7x) is not met: v6e 35%, tpu7x 22% at 16 tokens. On tpu7x
no bf16-fed form can meet it (its MXU takes ~22 µs to ingest these 58.7M weights as bf16, the w8a16 analysis in
the package docstring); it needs the weights fed as fp8 (native bf16 x fp8), which libtpu 0.0.52 cannot estimate.

Source: tpu-inference's ``kernels/quantized_matmul/blockwise_kernel.py`` (v0.32.0: the ``[G, 1, N]`` scale
layout and the per-group dot then scale; read, not copied — it supports no zero points and no int4 packing);
GPTQ (Frantar et al., arXiv:2210.17323) / AWQ (Lin et al., arXiv:2306.00978) for asymmetric group-wise int4.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ... import dsl as _dsl
from ...dsl.validate import padded_bytes
from ..vmem import scoped_vmem_limit
from ...errors import ArgumentError, DTypeError
from .quantize import quantize_weight
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .common import (U32, WEIGHT_DTYPES, X_DTYPES, check_chip, clamp as _clamp, dtype_name as _name, jnp_dtype as _jnp,
                     resolve_out_dtype as _out_dtype, target_chip as _target_chip)

#: block sizes (group sizes along K) the kernel takes: multiples of 32 from 32 to 512
BLOCK_SIZES = tuple(range(32, 513, 32))
#: weight formats: the 8-bit dtypes of :data:`WEIGHT_DTYPES`, ``"int4"`` and ``"fp4"`` (e2m1) (uint8 ``w_q``,
#: two per byte, the same per-group packing)
WEIGHT_FORMATS = (*WEIGHT_DTYPES, "int4", "int4n", "fp4")
#: packed two per byte along K (``w_q [N, K/2]``): the per-group order of the module docstring
PACKED = ("int4", "fp4")
#: int4 packed two per byte along N (``w_q [N/2, K]``, module docstring: "int4n"): Mosaic's native int4 unpack
INT4N = "int4n"
#: :func:`pack_int4` / :func:`unpack_int4` layouts: ``"k"`` (weight format ``"int4"``), ``"n"`` (``"int4n"``)
INT4_LAYOUTS = ("k", "n")
#: ``quantized_matmul_blockwise``'s ``x_quant`` path: ``blockwise_a8.quantized_matmul_blockwise_a8``, set when that
#: module (which builds on this one) is imported — the package's ``__init__`` imports it
X_QUANT_PATH = None
#: the e2m1 (OCP MX fp4) values of the codes 0..7 (sign bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

TUNABLES_BLOCK = {
    "bm": _dsl.Tunable([256, 128, 512, 1024], default=256, doc="rows of the output block (tokens)"),
    "bk": _dsl.Tunable([1024, 512, 2048, 4096], default=1024,
                       doc="contraction block (upper bound: the largest multiple of block_size tiling K, k_block)"),
    "bn": _dsl.Tunable([512, 256, 1024, 2048], default=512, doc="columns of the output block (N)"),
}


# ----------------------------------------------------------------------------------------------- formats
def resolve_format(w_q: torch.Tensor, where: str, fmt: Optional[str] = None, int4n: bool = False) -> str:
    """The format of ``w_q``: ``fmt`` (``"int4"`` default, ``"int4n"`` or ``"fp4"``) for a uint8 ``w_q`` (packed),
    else its 8-bit dtype name; DTypeError otherwise (a ``fmt`` that does not fit ``w_q``'s dtype included, and
    ``"int4n"`` where the caller takes only the K layout: ``int4n=False``, e.g. the grouped matmul)."""
    name = _name(w_q.dtype)
    if fmt is not None and fmt not in WEIGHT_FORMATS:
        raise DTypeError(f"{where}: weight_format {fmt!r} is not one of {WEIGHT_FORMATS}")
    if fmt == INT4N and not int4n:
        raise DTypeError(f"{where}: weight_format 'int4n' (int4 packed along N) is not taken here: pack int4 along "
                         f"K (weight_format 'int4', pack_int4 layout 'k'; int4n_to_k repacks)")
    if name == "uint8":
        if fmt not in (None, *PACKED, INT4N):
            raise DTypeError(f"{where}: weight_format {fmt!r} does not fit a uint8 (packed 4-bit) w_q")
        return fmt or "int4"
    if fmt is not None and fmt != name:
        raise DTypeError(f"{where}: weight_format {fmt!r} does not fit w_q of dtype {name}")
    if name not in WEIGHT_DTYPES:
        raise DTypeError(f"{where}: w_q dtype {name} is not one of {WEIGHT_DTYPES} or uint8 (int4 packed two per byte)")
    return name


def pack_int4(q: torch.Tensor, block_size: int, layout: str = "k") -> torch.Tensor:
    """Pack unsigned nibbles ``q [N, K]`` (integers ``0..15``, any integer dtype) two per byte (module docstring).

    ``layout="k"`` (weight format ``"int4"``): ``w_q [N, K/2]`` uint8 in the per-group order along K.
    ``layout="n"`` (weight format ``"int4n"``): ``w_q [N/2, K]`` uint8, byte ``[i, k]`` holding ``q[2i, k] - 8``
    in its low nibble and ``q[2i + 1, k] - 8`` in its high nibble, as two's complement int4 (``q ^ 8``).

    Raises ArgumentError for values outside ``0..15``, a ``K`` that is not a multiple of ``block_size`` (pad
    first: :func:`pad_k`), an odd ``block_size``, an odd ``N`` with ``layout="n"`` or another layout."""
    if layout not in INT4_LAYOUTS:
        raise ArgumentError(f"pack_int4: layout {layout!r} is not one of {INT4_LAYOUTS}")
    if q.dim() != 2:
        raise ArgumentError(f"pack_int4: q must be 2-D [N, K], got {tuple(q.shape)}")
    N, K = q.shape
    block_size = _dsl.check_int("pack_int4", "block_size", block_size)
    if block_size % 2 or block_size <= 0 or K % block_size:
        raise ArgumentError(f"pack_int4: K = {K} of q must be a multiple of block_size = {block_size} (an even "
                            f"number; pad K with pad_k)")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ArgumentError(f"pack_int4: q holds values outside 0..15 (min {int(q.min())}, max {int(q.max())})")
    if layout == "n":
        if N % 2:
            raise ArgumentError(f"pack_int4: layout 'n' packs pairs of rows: N = {N} of q must be even")
        t = q.to(torch.uint8) ^ 8  # q - 8 as a two's complement nibble
        return t[0::2] | (t[1::2] << 4)
    g = q.to(torch.uint8).reshape(N, K // block_size, 2, block_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(N, K // 2)


def unpack_int4(w_q: torch.Tensor, block_size: int, layout: str = "k") -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``w_q`` uint8 (``[N, K/2]`` for ``layout="k"``, ``[N/2, K]`` for ``"n"``)
    -> ``q [N, K]`` uint8 (``0..15``)."""
    if layout not in INT4_LAYOUTS:
        raise ArgumentError(f"unpack_int4: layout {layout!r} is not one of {INT4_LAYOUTS}")
    if layout == "n":
        return (torch.stack([w_q & 15, w_q >> 4], dim=1) ^ 8).reshape(2 * w_q.shape[0], w_q.shape[1])
    N, H = w_q.shape
    g = w_q.reshape(N, (2 * H) // block_size, 1, block_size // 2)
    return torch.cat([g & 15, g >> 4], dim=2).reshape(N, 2 * H)


def int4n_to_k(w_q: torch.Tensor, block_size: int) -> torch.Tensor:
    """Repack int4n ``w_q [N/2, K]`` into the K layout ``[N, K/2]`` (weight format ``"int4"``; a copy)."""
    return pack_int4(unpack_int4(w_q, block_size, "n"), block_size, "k")


def pad_k(w: torch.Tensor, block_size: int, fill=0) -> torch.Tensor:
    """``w [N, K]`` with columns ``fill`` appended up to a multiple of ``block_size`` (the padding rule)."""
    K = w.shape[-1]
    extra = -K % block_size
    if not extra:
        return w
    return torch.cat([w, torch.full((*w.shape[:-1], extra), fill, dtype=w.dtype, device=w.device)], dim=-1)


def quantize_weight_blockwise(w: torch.Tensor, block_size: int, dtype: str = "int4", *, asymmetric: bool = False,
                              layout: str = "k"):
    """Quantize ``w [N, K]`` (``K % block_size == 0``) per (output channel, group of ``block_size`` along K).

    ``dtype="int4"``: symmetric ``s = absmax / 7``, ``q = clip(round(w / s), -8, 7) + 8``; asymmetric (GPTQ /
    AWQ style min-max) ``s = (max - min) / 15``, ``z = round(-min / s)``, ``q = clip(round(w / s) + z, 0, 15)``.
    ``dtype="int8"``: symmetric ``s = absmax / 127``; ``"float8_e4m3fn"`` / ``"float8_e5m2"``: each group by
    :func:`~.quantize.quantize_weight`'s fp8 formula (``s = absmax / fp8 max``, ``q = fp8(w / s)``; a group with NaN
    / inf raises ArgumentError); other names: DTypeError. Returns ``(w_q, w_scale [G, 1, N] f32, w_zero_point
    [G, 1, N] f32 or None)`` in the module's layout (int4 packed by :func:`pack_int4` with ``layout``). A group of zeros gets ``s = 1`` (any scale
    gives 0). For tests and examples; real checkpoints bring their own scales (``integrations/checkpoints``).
    """
    block_size = _dsl.check_int("quantize_weight_blockwise", "block_size", block_size)
    kinds = ("int4", "int8", "fp4", "float8_e4m3fn", "float8_e5m2")
    if dtype not in kinds:  # any other name fell through to int8 before (an fp8 buffer then held int8 values)
        raise DTypeError(f"quantize_weight_blockwise: dtype {dtype!r} is not one of {kinds}")
    N, K = w.shape
    if K % block_size:
        raise ArgumentError(f"quantize_weight_blockwise: K = {K} is not a multiple of block_size = {block_size}")
    G = K // block_size
    wg = w.detach().double().reshape(N, G, block_size)
    z = None
    if dtype == "fp4":  # s = absmax / 6, nearest e2m1 value (ties to the lower magnitude code)
        s = (wg.abs().amax(-1) / 6).float()
        s = torch.where(s == 0, torch.ones_like(s), s)
        v = wg / s.double()[..., None]
        mag = (v.abs()[..., None] - torch.tensor(FP4_VALUES, dtype=torch.float64)).abs().argmin(-1)
        q = (mag + 8 * (v < 0)).reshape(N, K)
        return pack_int4(q.to(torch.uint8), block_size), s.T.reshape(G, 1, N).contiguous(), None
    if dtype.startswith("float8"):  # the per-channel fp8 formula (quantize_weight) applied to each group
        q, s = quantize_weight(w.detach().float().reshape(N * G, block_size), dtype)
        return q.reshape(N, K), s.reshape(N, G).T.reshape(G, 1, N).contiguous(), None
    if dtype == "int4" and asymmetric:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).float()
        s = torch.where(s == 0, torch.ones_like(s), s)
        z = torch.round(-lo / s.double()).clamp(0, 15)
        q = (torch.round(wg / s.double()[..., None]) + z[..., None]).clamp(0, 15)
        z = z.float().T.reshape(G, 1, N)
    else:
        qm = 7 if dtype == "int4" else 127
        s = (wg.abs().amax(-1) / qm).float()
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.round(wg / s.double()[..., None]).clamp(-qm - (dtype == "int4"), qm)
        if dtype == "int4":
            q = q + 8
    q = q.reshape(N, K)
    w_q = pack_int4(q.to(torch.uint8), block_size, layout) if dtype == "int4" else q.to(torch.int8)
    return w_q, s.T.reshape(G, 1, N).contiguous(), z


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """float64 e2m1 values of 4-bit codes (bit 3 the sign, bits 2..1 the exponent, bit 0 the mantissa)."""
    c = codes.long()
    return torch.tensor(FP4_VALUES, dtype=torch.float64)[c & 7] * (1 - 2 * (c >> 3))


def dequantize_blockwise(w_q, w_scale, block_size: int, w_zero_point=None, weight_format_=None) -> torch.Tensor:
    """``W [N, K_w]`` float64 (exact) of the module docstring's formulas (``weight_format_="fp4"`` for e2m1)."""
    fmt = resolve_format(w_q, "dequantize_blockwise", weight_format_, int4n=True)
    if fmt == "fp4":
        q = fp4_values(unpack_int4(w_q, block_size))
    elif fmt in ("int4", INT4N):
        q = unpack_int4(w_q, block_size, "n" if fmt == INT4N else "k").double()
        z = 8.0 if w_zero_point is None else w_zero_point.double()[:, 0, :].T.repeat_interleave(block_size, 1)
        q = q - z
    else:
        q = w_q.double()
    return q * w_scale.double()[:, 0, :].T.repeat_interleave(block_size, 1)


def expand_block_scale(weight_scale_inv: torch.Tensor, n_out: int, block_size: int) -> torch.Tensor:
    """Square-block weight scales ``[ceil(N / bs), G]`` (DeepSeek-V3's ``weight_scale_inv``: one scale per
    ``bs x bs`` block of ``w_q [N, K_w]``, multiplied into the weight: ``W = w_q * s``) -> the kernels'
    ``[G, 1, N]`` float32 layout (each row repeated ``bs`` times along N, the last block cut at ``N``).

    Raises:
        ArgumentError: not 2-D or the row count is not ``ceil(N / bs)``. DTypeError: not floating.
    """
    where = "expand_block_scale"
    if not isinstance(weight_scale_inv, torch.Tensor) or weight_scale_inv.dim() != 2:
        raise ArgumentError(f"{where}: w_scale (square blocks) must be a 2-D [ceil(N / block_size), K / block_size] "
                            f"tensor, got {getattr(weight_scale_inv, 'shape', type(weight_scale_inv).__name__)}")
    nb = -(-n_out // block_size)
    if weight_scale_inv.shape[0] != nb:
        raise ArgumentError(f"{where}: w_scale (square {block_size}x{block_size} blocks) has "
                            f"{weight_scale_inv.shape[0]} rows; N = {n_out} needs ceil(N / {block_size}) = {nb}")
    if not weight_scale_inv.dtype.is_floating_point:
        raise DTypeError(f"{where}: w_scale must be floating, got {_name(weight_scale_inv.dtype)}")
    s = weight_scale_inv.float().repeat_interleave(block_size, 0)[:n_out]  # [N, G]
    return s.T.unsqueeze(1).contiguous()


def _x_padded_double(x, K_w):
    xd = x.reshape(-1, x.shape[-1]).double()
    return torch.nn.functional.pad(xd, (0, K_w - xd.shape[1]))


def reference_blockwise(x, w_q, w_scale, block_size: int, w_zero_point=None, weight_format_=None) -> torch.Tensor:
    """float64 ``x @ W^T`` (not rounded) of the dequantized weight; ``x [..., K_x]`` zero-padded to ``K_w``."""
    W = dequantize_blockwise(w_q, w_scale, block_size, w_zero_point, weight_format_)
    return (_x_padded_double(x, W.shape[1]) @ W.T).reshape(*x.shape[:-1], W.shape[0])


def error_bound_blockwise(x, w_q, w_scale, block_size: int, w_zero_point=None, out_dtype=None,
                          weight_format_=None) -> torch.Tensor:
    """The elementwise bound of the module docstring on ``|y - reference_blockwise(...)|`` (float64)."""
    odt = out_dtype or x.dtype
    u = 2.0**-8 if odt == torch.bfloat16 else U32
    ref = reference_blockwise(x, w_q, w_scale, block_size, w_zero_point, weight_format_)
    fmt = resolve_format(w_q, "error_bound_blockwise", weight_format_, int4n=True)
    s = w_scale.double()[:, 0, :].T.repeat_interleave(block_size, 1).abs()
    if fmt in ("int4", INT4N):
        qp = unpack_int4(w_q, block_size, "n" if fmt == INT4N else "k").double() - 8
        zp = 0.0 if w_zero_point is None else (w_zero_point.double()[:, 0, :].T - 8).repeat_interleave(block_size, 1)
        mag_w = (qp.abs() + (zp.abs() if torch.is_tensor(zp) else 0.0)) * s
    elif fmt == "fp4":
        mag_w = fp4_values(unpack_int4(w_q, block_size)).abs() * s
    else:
        mag_w = w_q.double().abs() * s
    K_w = mag_w.shape[1]
    mag = (_x_padded_double(x, K_w).abs() @ mag_w.T).reshape(ref.shape)
    return u * ref.abs() + (K_w + 2) * U32 * mag


# ----------------------------------------------------------------------------------------------- kernel
def k_block(K_w: int, block_size: int, bk: int, int4: bool) -> int:
    """The K step of the kernel: the largest ``block_size * d`` (``d`` divides ``K_w / block_size``) up to
    ``max(bk, block_size)`` whose weight tile is lane-aligned (a multiple of 256 columns for int4, whose packed
    tile is half as wide; 128 otherwise), else all of ``K_w`` (one K step)."""
    G = K_w // block_size
    align = 256 if int4 else 128
    best = None
    for d in range(1, G + 1):
        c = block_size * d
        if G % d == 0 and c <= max(bk, block_size) and c % align == 0:
            best = c
    return best or K_w


def fp4_decode(n, dt):
    """e2m1 codes (int32 ``0..15``) -> values in ``dt`` (exact): ``2 v = m`` (exponent 0) or ``(2 + m) << (e - 1)``."""
    import jax.numpy as jnp

    e, m = (n >> 1) & 3, n & 1
    v2 = jnp.where(e == 0, m, jnp.left_shift(2 + m, jnp.maximum(e - 1, 0)))
    v2 = jnp.where(n >= 8, -v2, v2)
    return v2.astype(dt) * np.asarray(0.5, dtype=dt)


_fp4_decode = fp4_decode  # the kernel bodies here keep this name: the tuning DB keys them by their source


def _scale_groups(z, x_ref, s_ref, z_ref, *, bs, n_sub):
    """The decode form's last step: ``z [n_sub * bm, bn]`` f32 holds group ``g``'s partial product in row block
    ``g``; each is corrected for its zero point (``- rowsum(x_g) * (z_g - 8)``: the MXU was fed ``q - 8``) and
    scaled by its group's scale row, and the groups are summed: the K step's ``[bm, bn]`` f32 part."""
    import jax.numpy as jnp

    bm = x_ref.shape[0]
    part = None
    for g in range(n_sub):
        d = z[g * bm:(g + 1) * bm]
        if z_ref is not None:
            r = jnp.sum(x_ref[:, g * bs:(g + 1) * bs].astype(jnp.float32), axis=1, keepdims=True)
            d = d - r * (z_ref[g] - 8.0)
        d = d * s_ref[g]
        part = d if part is None else part + d
    return part


def _diag_part(x_ref, w_ref, s_ref, z_ref, *, bs, n_sub, fp4, dequant_to, precision):
    """Decode form of one K step for packed weights (module docstring, "Decode"): the tile unpacked once, every
    group's partial product from one pair of dots with a block-diagonal ``x`` (``n_sub * bm`` rows; row block
    ``g`` is ``x`` with the columns of the other groups zeroed: exact zeros), then scaled per group."""
    import jax
    import jax.numpy as jnp

    dims = (((1,), (1,)), ((), ()))
    half = bs // 2
    xl = jnp.concatenate([x_ref[:, g * bs:g * bs + half] for g in range(n_sub)], axis=1)  # [bm, bk/2]
    xh = jnp.concatenate([x_ref[:, g * bs + half:(g + 1) * bs] for g in range(n_sub)], axis=1)
    grp = jax.lax.broadcasted_iota(jnp.int32, xl.shape, 1) // half
    zero = jnp.zeros((), xl.dtype)
    XL = jnp.concatenate([jnp.where(grp == g, xl, zero) for g in range(n_sub)], axis=0)  # [n_sub * bm, bk/2]
    XH = jnp.concatenate([jnp.where(grp == g, xh, zero) for g in range(n_sub)], axis=0)
    b = w_ref[...].astype(jnp.int32)
    if fp4:
        lo, hi = fp4_decode(b & 15, dequant_to), fp4_decode(b >> 4, dequant_to)
    else:
        lo, hi = ((b & 15) - 8).astype(dequant_to), ((b >> 4) - 8).astype(dequant_to)
    Z = (jax.lax.dot_general(XL, lo, dims, precision=precision, preferred_element_type=jnp.float32)
         + jax.lax.dot_general(XH, hi, dims, precision=precision, preferred_element_type=jnp.float32))
    return _scale_groups(Z, x_ref, s_ref, z_ref, bs=bs, n_sub=n_sub)


def _diag_part_n(x_ref, w, s_ref, z_ref, *, bs, n_sub, precision):
    """Decode form of one K step for int4n weights: ``w [bn, bk]`` the unpacked tile (``q - 8`` in ``x.dtype``),
    every group's partial product from one dot with a block-diagonal ``x`` (``n_sub * bm`` rows, row block ``g``
    is ``x`` with the columns of the other groups zeroed: exact zeros), then scaled per group."""
    import jax
    import jax.numpy as jnp

    x = x_ref[...]
    grp = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) // bs
    zero = jnp.zeros((), x.dtype)
    xd = jnp.concatenate([jnp.where(grp == g, x, zero) for g in range(n_sub)], axis=0)  # [n_sub * bm, bk]
    z = jax.lax.dot_general(xd, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
    return _scale_groups(z, x_ref, s_ref, z_ref, bs=bs, n_sub=n_sub)


def accumulate_k_step(part, k, n_k: int, acc_ref, o_ref) -> None:
    """Add K step ``k``'s f32 partial product ``part`` to the output block: written at once when ``n_k == 1``,
    else kept in ``acc_ref`` (f32 VMEM) and rounded into ``o_ref`` at the last K step (``acc = part`` at the
    first step, ``acc += part`` in between, ``out = acc + part`` at the last).

    ``part`` may be a function of no arguments that computes it (e.g. one large dot): it is then called inside
    each of the three branches, so each branch issues its own dot, as the matmul kernel does
    (:mod:`tpukernels.library.matmul_ops`): Mosaic fuses the accumulation into the matmul, and no second
    ``[bm, bn]`` f32 copy of ``part`` stays live beside the accumulator (the same sums in the same order)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    get = part if callable(part) else (lambda: part)
    if n_k == 1:
        o_ref[...] = get().astype(o_ref.dtype)
        return

    @pl.when(k == 0)
    def _():
        acc_ref[...] = get()

    @pl.when(jnp.logical_and(k > 0, k < n_k - 1))
    def _():
        acc_ref[...] += get()

    @pl.when(k == n_k - 1)
    def _():
        o_ref[...] = (acc_ref[...] + get()).astype(o_ref.dtype)


def _block_body(x_ref, w_ref, s_ref, *refs, bs, n_sub, n_k, int4, has_zp, dequant_to, precision, fp4=False,
                diag=False, int4n=False):
    """One output block, one K step of ``n_sub`` groups (module docstring); ``refs`` = ``[z_ref,] o_ref, acc_ref``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    if has_zp:
        z_ref, o_ref, acc_ref = refs
    else:
        z_ref, (o_ref, acc_ref) = None, refs
    k = pl.program_id(2)
    dims = (((1,), (1,)), ((), ()))
    part = None
    half = bs // 2
    if diag and int4n:  # Mosaic's native unpack: uint8 [bn/2, bk] -> int4 [bn, bk] (rows 2i / 2i + 1) -> x.dtype
        wn = pltpu.bitcast(w_ref[...], jnp.int4).astype(dequant_to)
        part = _diag_part_n(x_ref, wn, s_ref, z_ref, bs=bs, n_sub=n_sub, precision=precision)
        n_sub = 0
    elif diag:
        part = _diag_part(x_ref, w_ref, s_ref, z_ref, bs=bs, n_sub=n_sub, fp4=fp4, dequant_to=dequant_to,
                          precision=precision)
        n_sub = 0  # the per-group loop below has nothing left to do
    for g in range(n_sub):
        xg = x_ref[:, g * bs:(g + 1) * bs]
        if int4n:  # the group's bytes [bn/2, bs] -> int4 [bn, bs] (Mosaic's native unpack) -> x.dtype, exact
            w = pltpu.bitcast(w_ref[:, g * bs:(g + 1) * bs], jnp.int4).astype(dequant_to)
            d = jax.lax.dot_general(xg, w, dims, precision=precision, preferred_element_type=jnp.float32)
        elif int4:  # unpack the group's bytes in VMEM: low nibbles = first half of the group, high = second;
            # two dots against the two halves of x's group (slicing the small x, not relayouting the weights)
            b = w_ref[:, g * half:(g + 1) * half].astype(jnp.int32)
            if fp4:
                lo, hi = _fp4_decode(b & 15, dequant_to), _fp4_decode(b >> 4, dequant_to)
            else:
                lo, hi = ((b & 15) - 8).astype(dequant_to), ((b >> 4) - 8).astype(dequant_to)
            d = (jax.lax.dot_general(xg[:, :half], lo, dims, precision=precision, preferred_element_type=jnp.float32)
                 + jax.lax.dot_general(xg[:, half:], hi, dims, precision=precision,
                                       preferred_element_type=jnp.float32))
        else:
            w = w_ref[:, g * bs:(g + 1) * bs]
            if dequant_to is not None:
                w = w.astype(dequant_to)
            d = jax.lax.dot_general(xg, w, dims, precision=precision, preferred_element_type=jnp.float32)
        if z_ref is not None:  # x . (q - z)^T = x . (q - 8)^T - rowsum(x) (z - 8)
            r = jnp.sum(xg.astype(jnp.float32), axis=1, keepdims=True)
            d = d - r * (z_ref[g] - 8.0)
        d = d * s_ref[g]
        part = d if part is None else part + d

    accumulate_k_step(part, k, n_k, acc_ref, o_ref)


def problem(x, w_q, w_scale, w_zero_point, block_size, where, wfmt=None):
    """``(M, N, K_w, fmt)`` after checking every operand against the layout (typed errors naming the tensor)."""
    for t, n in ((x, "x"), (w_q, "w_q"), (w_scale, "w_scale")):
        if len(t.shape) != (3 if n == "w_scale" else 2):
            raise ArgumentError(f"{where}: {n} must be {'3-D [K/block_size, 1, N]' if n == 'w_scale' else '2-D'}, "
                                f"got shape {tuple(t.shape)}")
    if not isinstance(block_size, int) or block_size not in BLOCK_SIZES:
        raise ArgumentError(f"{where}: block_size {block_size!r} is not a multiple of 32 in 32..512")
    fmt = resolve_format(w_q, where, wfmt, int4n=True)
    if _name(x.dtype) not in X_DTYPES:
        raise DTypeError(f"{where}: x dtype {_name(x.dtype)} is not one of {X_DTYPES}")
    N, cols = w_q.shape
    if fmt == INT4N:  # [N/2, K_w]: two output rows per byte
        N = 2 * N
        if cols % block_size:
            raise ArgumentError(f"{where}: w_q (int4n, packed along N) has K = {cols} columns, not a multiple of "
                                f"block_size = {block_size} (pad the weight's K with pad_k: the padding rule)")
        K_w = cols
    elif fmt in PACKED:
        if cols % (block_size // 2):
            raise ArgumentError(f"{where}: w_q ({fmt}, packed) has {cols} bytes per row: not a multiple of "
                                f"block_size / 2 = {block_size // 2} (each group of {block_size} columns is "
                                f"{block_size // 2} bytes; an odd or partial packed dimension cannot be unpacked)")
        K_w = 2 * cols
    else:
        if cols % block_size:
            raise ArgumentError(f"{where}: w_q has K = {cols} columns, not a multiple of block_size = {block_size} "
                                f"(pad the weight's K with pad_k: the padding rule)")
        K_w = cols
    G = K_w // block_size
    if tuple(w_scale.shape) != (G, 1, N):
        raise ArgumentError(f"{where}: w_scale must have shape (K/block_size, 1, N) = ({G}, 1, {N}), got "
                            f"{tuple(w_scale.shape)}")
    if _name(w_scale.dtype) != "float32":
        raise DTypeError(f"{where}: w_scale must be float32, got {_name(w_scale.dtype)}")
    if w_zero_point is not None:
        if fmt not in ("int4", INT4N):
            raise ArgumentError(f"{where}: w_zero_point is for int4 weights (asymmetric); {fmt} weights are symmetric")
        if tuple(w_zero_point.shape) != (G, 1, N):
            raise ArgumentError(f"{where}: w_zero_point must have shape (K/block_size, 1, N) = ({G}, 1, {N}), got "
                                f"{tuple(w_zero_point.shape)}")
        if _name(w_zero_point.dtype) != "float32":
            raise DTypeError(f"{where}: w_zero_point must be float32, got {_name(w_zero_point.dtype)}")
    M, K = x.shape
    if K != K_w:
        raise ArgumentError(f"{where}: x has K = {K} columns, w_q holds K_w = {K_w} (kernel operands must agree; "
                            f"the public op pads x)")
    return M, N, K_w, fmt


_problem = problem  # the kernel bodies here keep this name: the tuning DB keys them by their source


#: the most rows of the decode form's block-diagonal ``x`` (``bm * bk / block_size``; module docstring, "Decode")
DIAG_ROWS = 256


def diag_rows(chip=None) -> int:
    """Most rows of the decode form's block-diagonal ``x`` on ``chip``: ``min(DIAG_ROWS, bf16 peak FLOP/s / HBM
    bytes/s)`` from jax's tpu_info (the extra MXU work must stay small next to the weight stream: v5e 240, v6e and
    tpu7x 256); :data:`DIAG_ROWS` with no target chip (cpu interpret)."""
    if chip is None:
        return DIAG_ROWS
    from ...perf import hbm_bandwidth, peak_flops

    return int(min(DIAG_ROWS, peak_flops(chip, "bfloat16") / hbm_bandwidth(chip)))


def _block_heuristic(x, w_q, w_scale, w_zero_point=None, block_size=128, out_dtype=None, weight_format=None):
    """Prefill ``bm=256, bk=1024, bn=1024``; decode (``M <= 128``: one row block) ``bk=4096, bn=1024``: fewer,
    larger weight tiles (libtpu estimate, w4a16 ``16x4096 @ (14336x4096)^T``, group 128, against the earlier
    ``bk=2048, bn=512``: v5e 94.4 -> 90.0 µs, v6e 80.6 -> 70.5 µs, tpu7x 64.0 -> 55.6 µs; a model). int4n weights
    (module docstring, "int4 packed along N"): ``M <= 16`` the decode form at ``bk=1024`` with the fewest N blocks
    of at most 8192 columns where ``diag_rows(chip) >= 256`` (v6e, tpu7x), else (v5e, ``M <= 128``) per-group dots
    at ``bk=4096, bn=1024``; prefill as above."""
    M = x.shape[0]
    if weight_format == INT4N and M <= 128:  # int4 packed along N (native unpack; module docstring, "int4n")
        if M <= 16 and diag_rows(_target_chip()) >= DIAG_ROWS:  # the decode form, 16 * 1024 / 128 rows, and
            # the fewest N blocks of at most 8192 columns (14336 -> 2 x 7168, 4096 -> 1)
            nb = -(-w_scale.shape[2] // 8192)
            return dict(bm=128, bk=1024, bn=-(-w_scale.shape[2] // nb // 256) * 256)
        return dict(bm=128, bk=4096, bn=1024)  # per-group dots (v5e at 16 tokens too)
    if M <= 16:  # the decode form (block-diagonal x of 16 * bk / block_size rows)
        return dict(bm=128, bk=2048, bn=1024)
    if M <= 128:
        return dict(bm=128, bk=4096, bn=1024)
    return dict(bm=256, bk=1024, bn=1024)


def _block_shape(x, w_q, w_scale, w_zero_point=None, block_size=128, out_dtype=None, weight_format=None):
    where = "tpukernels::quantized_matmul_blockwise_kernel"
    M, N, _, _ = problem(x, w_q, w_scale, w_zero_point, block_size, where, weight_format)
    return _dsl.OutSpec((M, N), _out_dtype(out_dtype, x, where))


def dequantize_f32_jnp(w_q, w_scale, w_zero_point=None, block_size=128, weight_format=None):
    """The block-scaled weight ``W [N, K_w]`` in float32 (jnp; the kernels' references): int4 / fp4 nibbles
    unpacked (low nibble first), ``(q - z) * s`` per block of ``block_size`` columns."""
    import jax.numpy as jnp

    N = w_q.shape[0]
    if np.dtype(w_q.dtype) == np.uint8 and weight_format == INT4N:  # [N/2, K]: rows 2i / 2i + 1, stored q ^ 8
        b = w_q.astype(jnp.int32)
        c = jnp.stack([(b & 15) ^ 8, (b >> 4) ^ 8], axis=1).reshape(2 * N, -1)
        z = 8.0 if w_zero_point is None else jnp.repeat(w_zero_point[:, 0, :].T, block_size, axis=1)
        q = c.astype(jnp.float32) - z
    elif np.dtype(w_q.dtype) == np.uint8:
        b = w_q.astype(jnp.int32).reshape(N, -1, 1, block_size // 2)
        c = jnp.concatenate([b & 15, b >> 4], axis=2).reshape(N, -1)
        if weight_format == "fp4":
            q = fp4_decode(c, jnp.float32)
        else:
            z = 8.0 if w_zero_point is None else jnp.repeat(w_zero_point[:, 0, :].T, block_size, axis=1)
            q = c.astype(jnp.float32) - z
    else:
        q = w_q.astype(jnp.float32)
    return q * jnp.repeat(w_scale[:, 0, :].T, block_size, axis=1)


def reference_blockwise_jnp(x, w_q, w_scale, w_zero_point=None, block_size=128, out_dtype=None, weight_format=None):
    """jnp version of the kernel (autotuner correctness check): dequantize in f32, one dot (also the prefill
    kernel's, :mod:`.blockwise_a8`, whose ``x`` is already dequantized)."""
    import jax.numpy as jnp
    from jax import lax

    W = dequantize_f32_jnp(w_q, w_scale, w_zero_point, block_size, weight_format)
    z = jnp.matmul(x.astype(jnp.float32), W.T, precision=lax.Precision.HIGHEST)
    return z.astype(_out_dtype(out_dtype, x, "quantized_matmul_blockwise_kernel"))


@_dsl.tpu_kernel(_block_body, name="quantized_matmul_blockwise_kernel", namespace="tpukernels",
                 tunables=TUNABLES_BLOCK, heuristic=_block_heuristic, out_shape=_block_shape,
                 reference=_dsl.jax_reference(reference_blockwise_jnp))
def quantized_matmul_blockwise_kernel(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                                      w_zero_point: Optional[torch.Tensor] = None, block_size: int = 128,
                                      out_dtype: Optional[str] = None, weight_format: Optional[str] = None, *,
                                      bm: int, bk: int, bn: int) -> torch.Tensor:
    """``x [M, K_w] @ W^T`` with block-scaled weights (module docstring): ``w_q [N, K_w]`` int8 / fp8 or
    ``[N, K_w/2]`` uint8 (int4), ``w_scale [K_w/bs, 1, N]`` f32, ``w_zero_point`` (int4 only) same shape ->
    ``[M, N]`` in ``out_dtype`` (default ``x.dtype``).

    Raises:
        ArgumentError: ranks, block size, packed width, scale / zero-point shapes (each names the tensor).
        DTypeError: dtypes. ChipError: fp8 weights on a chip whose MXU lacks that fp8 dtype.
    """
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::quantized_matmul_blockwise_kernel"
    M, N, K_w, fmt = _problem(x, w_q, w_scale, w_zero_point, block_size, where, weight_format)
    if fmt.startswith("float8"):
        check_chip(None, fmt, where=where)
    odt = _out_dtype(out_dtype, x, where)
    int4 = fmt in PACKED  # packed two per byte along K (int4 or fp4)
    int4n = fmt == INT4N  # packed two per byte along N
    bk_ = k_block(K_w, block_size, bk, int4)
    bm_, bn_ = _clamp(M, bm), _clamp(N, bn)
    gi, gj, gk = _dsl.cdiv(M, bm_), _dsl.cdiv(N, bn_), K_w // bk_
    n_sub = bk_ // block_size
    wcols = bk_ // 2 if int4 else bk_
    wrows = bn_ // 2 if int4n else bn_
    in_specs = [pl.BlockSpec((bm_, bk_), lambda i, j, k: (i, k)),
                pl.BlockSpec((wrows, wcols), lambda i, j, k: (j, k)),
                pl.BlockSpec((n_sub, 1, bn_), lambda i, j, k: (k, 0, j))]
    if w_zero_point is not None:
        in_specs.append(pl.BlockSpec((n_sub, 1, bn_), lambda i, j, k: (k, 0, j)))
    dequant_to = _jnp(_name(x.dtype))
    acc_shape = (8, 128) if gk == 1 else (bm_, bn_)
    # decode form (module docstring): packed weights, one row block whose block-diagonal x has <= DIAG_ROWS rows
    diag = (int4 or int4n) and gi == 1 and bm_ % 8 == 0 and bm_ * n_sub <= diag_rows(_target_chip())
    need = (2 * (padded_bytes((bm_, bk_), x.dtype) + padded_bytes((wrows, wcols), w_q.dtype)
                 + (1 + (w_zero_point is not None)) * n_sub * padded_bytes((1, bn_), "float32")
                 + padded_bytes((bm_, bn_), odt))
            + 2 * padded_bytes((bn_, block_size), dequant_to) + 3 * padded_bytes((bm_, bn_), "float32")
            + padded_bytes(acc_shape, "float32"))
    if int4n:  # the whole unpacked tile (int4, then x.dtype)
        need += padded_bytes((bn_, bk_), "int8") + padded_bytes((bn_, bk_), dequant_to)
    if diag:  # the whole unpacked tile (int32 and x.dtype halves), the block-diagonal x and the dots' result
        need += (padded_bytes((bn_, wcols), "int32") + 2 * padded_bytes((bn_, wcols), dequant_to)
                 + 2 * padded_bytes((bm_ * n_sub, wcols), x.dtype) + padded_bytes((bm_ * n_sub, bn_), "float32"))
    wbytes = N * K_w // (2 if int4 or int4n else 1)
    cost = pl.CostEstimate(flops=2 * M * N * K_w, transcendentals=0,
                           bytes_accessed=int(gj * M * K_w * np.dtype(x.dtype).itemsize + gi * wbytes
                                              + M * N * np.dtype(odt).itemsize))
    f32 = np.dtype(dequant_to) == np.dtype("float32")
    return _dsl.Launch(
        grid=(gi, gj, gk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm_, bn_), lambda i, j, k: (i, j)),
        out_shape=_dsl.OutSpec((M, N), odt),
        scratch_shapes=[pltpu.VMEM(acc_shape, jnp.float32)],
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=scoped_vmem_limit(need),
        cost_estimate=cost,
        body_kwargs=dict(bs=int(block_size), n_sub=int(n_sub), n_k=int(gk), int4=int4, fp4=fmt == "fp4", diag=diag,
                         int4n=int4n,
                         has_zp=w_zero_point is not None, dequant_to=dequant_to,
                         precision=lax.Precision.HIGHEST if f32 else None),
    )


# ----------------------------------------------------------------------------------------------- public
def quantized_matmul_blockwise(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *, block_size: int,
                               w_zero_point: Optional[torch.Tensor] = None, out_dtype=None,
                               config: Optional[dict] = None, weight_format: Optional[str] = None,
                               x_quant: Optional[str] = None) -> torch.Tensor:
    """``x @ W^T`` with sub-channel (block-wise along K) quantized weights ``W`` (module docstring: layout,
    padding rule, error bound).

    Args:
        x: ``[..., K_x]`` bfloat16 / float32 activations, ``K_w - block_size < K_x <= K_w``.
        w_q: ``[N, K_w]`` int8 / float8_e4m3fn / float8_e5m2, ``[N, K_w / 2]`` uint8 (int4 packed along K,
            :func:`pack_int4`) or ``[N / 2, K_w]`` uint8 (int4 packed along N, ``weight_format="int4n"``).
        w_scale: ``[K_w / block_size, 1, N]`` float32 (tpu-inference's block-wise layout), or 2-D
            ``[ceil(N / block_size), K_w / block_size]``: square ``block_size x block_size`` blocks (DeepSeek-V3's
            ``weight_scale_inv``), expanded along N by :func:`expand_block_scale` before the kernel.
        block_size: group size along K, a multiple of 32 in 32..512.
        w_zero_point: int4 only: ``[K_w / block_size, 1, N]`` float32 zero points (grid units); None: symmetric.
        out_dtype: ``"bfloat16"`` / ``"float32"`` (or torch dtype); default ``x.dtype``.
        config: explicit ``{"bm", "bk", "bn"}`` (``bk`` an upper bound, see :func:`k_block`).
        weight_format: for a uint8 ``w_q``: ``"int4"`` (default; packed along K), ``"int4n"`` (int4 packed along
            N: the faster decode, module docstring) or ``"fp4"`` (e2m1 codes, packed along K, no zero points;
            ``W = e2m1(code) * s``); must match ``w_q``'s dtype otherwise. The layouts' shapes never coincide
            given ``w_scale``: a wrong ``weight_format`` raises ArgumentError (the ``w_scale`` shape).
        x_quant: None (weights dequantized in VMEM, ``x`` as is), ``"fp8"`` (``x`` quantized per token per
            ``1 x block_size`` block to ``w_q``'s fp8 dtype, fp8 x fp8 on the MXU: DeepSeek-V3's scheme; with int4
            or fp4 ``w_q``, to float8_e4m3fn, the weights decoded to bf16 in VMEM: tpu-inference's w4a8 fp8) or
            ``"int8"`` (the same to int8 with int8 or int4 weights: w8a8 / w4a8, int32 group sums);
            :mod:`.blockwise_a8` has the formulas and the error bound. No gradient with ``x_quant``.

    Returns:
        ``[..., N]`` in ``out_dtype``. Differentiable in ``x`` (QLoRA-style: the weight side is frozen, its
        tensors get no gradient; :mod:`.blockwise_bwd` has the backward kernel and its error bound).

    Raises:
        ArgumentError: block size not an int (a float included: never truncated) or not a multiple of 32 in
            32..512; ``w_q``'s K not a multiple of the block (int8 /
            fp8) or its packed width not a multiple of ``block_size / 2`` (int4); ``x``'s K outside the padding
            rule; ``w_scale`` / ``w_zero_point`` shapes; zero points with 8-bit weights.
        DTypeError: dtypes (``w_q``, ``x``, ``w_scale`` / ``w_zero_point`` not float32, ``out_dtype``); an
            ``x_quant`` the weights do not pair with (``"fp8"`` with int8 weights, ``"int8"`` with fp8 or fp4).
        DeviceError: operands on different devices. ChipError: fp8 weights the target chip cannot take; an
            ``x_quant`` pair its MXU does not multiply natively (names the chip and the modes it supports).
    """
    from ...errors import DeviceError
    from .public import QuantizedInputHasNoGradient, canon_out, canon_x_quant

    where = "tpukernels::quantized_matmul_blockwise"
    ts = [(x, "x"), (w_q, "w_q"), (w_scale, "w_scale")] + ([(w_zero_point, "w_zero_point")]
                                                          if w_zero_point is not None else [])
    for t, n in ts:
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(t).__name__}")
    if len({t.device for t, _ in ts}) > 1:
        raise DeviceError(f"{where}: " + ", ".join(f"{n} on {t.device}" for t, n in ts) + ": must be one device")
    block_size = _dsl.check_int(where, "block_size", block_size)  # 64.9 must not run as 64
    if x.dim() < 1:
        raise ArgumentError(f"{where}: x must have rank >= 1 ([..., K]), got a scalar")
    odt = canon_out(out_dtype)
    canon_x_quant(x_quant)
    if w_q.dim() != 2:
        raise ArgumentError(f"{where}: w_q must be 2-D, got shape {tuple(w_q.shape)}")
    fmt = resolve_format(w_q, where, weight_format, int4n=True)
    K_w = w_q.shape[1] * (2 if fmt in PACKED else 1)
    N = w_q.shape[0] * (2 if fmt == INT4N else 1)
    if w_scale.dim() == 2 and isinstance(block_size, int) and block_size in BLOCK_SIZES:
        if w_scale.shape[1] != K_w // block_size:
            raise ArgumentError(f"{where}: w_scale (square blocks, 2-D) must have shape (ceil(N / block_size), "
                                f"K_w / block_size) = ({-(-N // block_size)}, {K_w // block_size}), got "
                                f"{tuple(w_scale.shape)}")
        w_scale = expand_block_scale(w_scale, N, block_size)
    K_x = x.shape[-1]
    if isinstance(block_size, int) and block_size in BLOCK_SIZES and not (K_w - block_size < K_x <= K_w):
        raise ArgumentError(f"{where}: x has K = {K_x} columns but w_q holds K_w = {K_w} (block_size {block_size}): "
                            f"the padding rule allows K_w - block_size < K <= K_w")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K_x)
    if K_x < K_w and K_x > K_w - block_size:
        x2 = torch.nn.functional.pad(x2, (0, K_w - K_x))  # the padding rule: zero columns meet the padded weight
    kout = None if odt is None or odt == _name(x.dtype) else odt
    if x2.shape[0] == 0 or N == 0:
        problem(x2, w_q, w_scale, w_zero_point, block_size, where, weight_format)
        # an empty product (no kernel); a linear with an empty operand keeps autograd's graph (d_x = 0)
        y = torch.nn.functional.linear(x2, x2.new_zeros(N, K_w))
        return y.to(getattr(torch, odt or _name(x.dtype))).reshape(*lead, N)
    if x_quant is not None:
        # rounding x has no gradient: the forward runs (inference without no_grad), a backward raises
        guard = x.requires_grad and torch.is_grad_enabled()
        problem(x2, w_q, w_scale, w_zero_point, block_size, where, weight_format)
        if fmt == INT4N:  # the x_quant kernels take the K layout: repacked per call (a gap: a copy of w_q)
            w_q, fmt = int4n_to_k(w_q, int(block_size)), "int4"
        y = X_QUANT_PATH(x2.detach() if guard else x2, w_q, w_scale, w_zero_point, int(block_size),
                                          fmt, x_quant, odt or _name(x.dtype), config).reshape(*lead, N)
        return QuantizedInputHasNoGradient.apply(x, y, x_quant) if guard else y
    kw = {} if config is None else dict(config=config)
    y = quantized_matmul_blockwise_kernel(x2, w_q, w_scale, w_zero_point, int(block_size), kout,
                                          fmt if fmt in ("fp4", INT4N) else None, **kw)
    return y.reshape(*lead, N)


class TPUBlockQuantLinear(torch.nn.Module):
    """``nn.Linear`` with a frozen block-quantized weight: ``y = quantized_matmul_blockwise(x, ...) + bias``.

    Buffers: ``w_q`` (``[out, K_w]`` int8 / fp8, ``[out/2, K_w]`` uint8 int4 packed along N (``fmt`` ``"int4n"``,
    the default for int4) or ``[out, K_w/2]`` uint8 int4 / fp4 packed along K), ``w_scale [K_w/bs, 1, out]`` f32,
    optional ``w_zero_point`` (same shape, int4), optional ``bias [out]``, optional ``in_perm [in]`` (act-order
    checkpoints: ``x`` is gathered along K by it first). ``in_features`` may be below ``K_w``
    (the padding rule). Built by the checkpoint loaders (:mod:`tpukernels.integrations.checkpoints`) or
    :meth:`from_linear`. Differentiable in the input (the quantized buffers are frozen: QLoRA-style adapters train
    around it).

    ``fmt="int4"`` stores the weight packed along N (``self.fmt == "int4n"``: Mosaic's native int4 unpack, the
    faster decode) when ``out_features`` is even, else along K (``"int4"``); ``int4_layout="k"`` / ``"n"`` forces
    one (``"n"`` with an odd ``out_features`` raises ArgumentError). A state dict whose int4 ``w_q`` has the other
    layout's shape (``[out, K_w/2]`` vs ``[out/2, K_w]``, never equal) is repacked at load
    (:meth:`_load_from_state_dict`); any other shape raises torch's size-mismatch error.
    """

    def __init__(self, in_features: int, out_features: int, block_size: int, fmt: str = "int4", bias: bool = False,
                 zero_point: bool = False, int4_layout: Optional[str] = None):
        super().__init__()
        if fmt not in WEIGHT_FORMATS:
            raise DTypeError(f"TPUBlockQuantLinear: format {fmt!r} is not one of {WEIGHT_FORMATS}")
        if int4_layout not in (None, *INT4_LAYOUTS):
            raise ArgumentError(f"TPUBlockQuantLinear: int4_layout {int4_layout!r} is not one of {INT4_LAYOUTS}")
        if fmt in ("int4", INT4N):
            layout = int4_layout or ("n" if fmt == INT4N or out_features % 2 == 0 else "k")
            if layout == "n" and out_features % 2:
                raise ArgumentError(f"TPUBlockQuantLinear: int4 packed along N needs an even out_features, got "
                                    f"{out_features} (use int4_layout='k')")
            fmt = INT4N if layout == "n" else "int4"
        block_size = _dsl.check_int("TPUBlockQuantLinear", "block_size", block_size)
        if block_size not in BLOCK_SIZES:
            raise ArgumentError(f"TPUBlockQuantLinear: block_size {block_size!r} is not a multiple of 32 in 32..512")
        self.in_features, self.out_features, self.block_size, self.fmt = in_features, out_features, block_size, fmt
        K_w = math.ceil(in_features / block_size) * block_size
        G = K_w // block_size
        if fmt == INT4N:
            w = torch.zeros(out_features // 2, K_w, dtype=torch.uint8)
        elif fmt in PACKED:
            w = torch.zeros(out_features, K_w // 2, dtype=torch.uint8)
        else:
            w = torch.zeros(out_features, K_w, dtype=getattr(torch, fmt))
        self.register_buffer("w_q", w)
        self.register_buffer("w_scale", torch.zeros(G, 1, out_features, dtype=torch.float32))
        self.register_buffer("w_zero_point", torch.zeros(G, 1, out_features) if zero_point else None)
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        # act-order checkpoints (GPTQ g_idx): x's columns are gathered by in_perm [in_features] int64 first
        self.register_buffer("in_perm", None)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, block_size: int, fmt: str = "int4", asymmetric: bool = False,
                    int4_layout: Optional[str] = None):
        """Quantize ``linear.weight`` with :func:`quantize_weight_blockwise` (K padded by the padding rule)."""
        m = cls(linear.in_features, linear.out_features, block_size, fmt, linear.bias is not None,
                asymmetric and fmt in ("int4", INT4N), int4_layout)
        w = pad_k(linear.weight.detach().float(), block_size)
        q, s, z = quantize_weight_blockwise(w, block_size, "int4" if m.fmt == INT4N else fmt, asymmetric=asymmetric,
                                            layout=m.int4_layout or "k")
        m.w_q.copy_(q)
        m.w_scale.copy_(s)
        if z is not None:
            m.w_zero_point.copy_(z)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    @property
    def int4_layout(self) -> Optional[str]:
        """``"n"`` (int4 packed along N), ``"k"`` (int4 packed along K) or None (not int4)."""
        return {INT4N: "n", "int4": "k"}.get(self.fmt)

    def pack(self, q: torch.Tensor) -> torch.Tensor:
        """Unsigned nibbles ``q [out, K_w]`` (``0..15``) -> this module's int4 ``w_q`` (:func:`pack_int4`)."""
        return pack_int4(q, self.block_size, self.int4_layout)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """An int4 ``w_q`` saved in the other packing (its shape tells: ``[out, K_w/2]`` is K-packed, ``[out/2,
        K_w]`` N-packed) is repacked into this module's; the rest is torch's load (shape mismatches raise)."""
        key = prefix + "w_q"
        w = state_dict.get(key)
        layout = self.int4_layout
        if layout is not None and isinstance(w, torch.Tensor) and w.dtype == torch.uint8 and w.dim() == 2:
            out, K_w = self.out_features, self.w_q.shape[1] * (2 if layout == "k" else 1)
            other = "k" if layout == "n" else "n"
            if tuple(w.shape) == ((out, K_w // 2) if other == "k" else (out // 2, K_w)):
                state_dict = dict(state_dict)
                state_dict[key] = pack_int4(unpack_int4(w, self.block_size, other), self.block_size, layout)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        """Device moves only for the quantized buffers (as :class:`TPUQuantLinear`); ``bias`` follows casts."""
        names = [n for n in ("w_q", "w_scale", "w_zero_point", "in_perm") if self._buffers.get(n) is not None]
        keep = {n: self._buffers[n] for n in names}
        self._buffers.update(dict.fromkeys(keep))
        try:
            super()._apply(fn, recurse)
        finally:
            for n, t in keep.items():
                dev = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
                self._buffers[n] = t if dev == t.device else t.to(dev)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)
        cast = x.dtype not in (torch.bfloat16, torch.float32)
        y = quantized_matmul_blockwise(x.float() if cast else x, self.w_q, self.w_scale, block_size=self.block_size,
                                       w_zero_point=self.w_zero_point,
                                       weight_format=self.fmt if self.fmt in ("fp4", INT4N) else None)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype) if cast else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}, "
                f"format={self.fmt}, zero_point={self.w_zero_point is not None}, bias={self.bias is not None}")
