"""Block-scaled 8-bit activations times block-scaled weights: fp8 x fp8 with 1x128 activation blocks and 128x128
weight blocks (DeepSeek-V3's scheme), w4a8 (int4 weights unpacked to int8, int8 activations) and w8a8 int8 with
the same per-block activation scales, and fp8 activations with packed int4 or fp4 (e2m1) weights (tpu-inference's
blockwise int4 x fp8 and fp4 x fp8 cases). Public path: ``quantized_matmul_blockwise(..., x_quant="fp8" | "int8")``
(:mod:`.blockwise`).

Layout (``bs`` = ``block_size``, ``G = K_w / bs``):

* activations: ``x`` is quantized per token and per block of ``bs`` columns (``1 x bs``; ``1 x 128`` in DeepSeek-V3)
  by ``quantize_per_block_kernel``: ``x_q [M, K_w]`` (int8; the weight's fp8 dtype; float8_e4m3fn,
  :data:`FP8_FOR_PACKED`, for ``x_quant="fp8"`` with int4 / fp4 weights) and ``x_scale [M, G]``
  float32, ``x ~= x_q[m, k] * x_scale[m, k // bs]``. The formula is the package's per-token one applied to each
  block (symmetric absmax: ``s = max|v| * f32(1 / qmax)``, ``r = f32(1 / s)`` or 0, ``q = round_half_even(v * r)``
  clipped to ``+-127`` for int8, ``fp8(clip(v * r, +-qmax))`` for fp8; a zero block gets ``s = 0, q = 0``).
  :func:`quantize_per_block_reference` is the same in torch (bit for bit in cpu interpret mode).
* weights: as :mod:`.blockwise` (``w_q [N, K_w]`` int8 / fp8, or ``[N, K_w / 2]`` uint8 packed int4, optional int4
  zero points) with ``w_scale [G, 1, N]`` float32 (tpu-inference's block-wise layout). A 2-D ``w_scale`` given to
  the public op is the square-block layout of DeepSeek-V3 checkpoints (``weight_scale_inv [ceil(N / bs), G]``: one
  scale per ``bs x bs`` block): :func:`expand_block_scale` repeats each row ``bs`` times along N into
  ``[G, 1, N]`` (4 bytes per ``bs`` weights, ``N K_w / 32`` bytes for ``bs = 128``: 1/32 of the fp8 weight's bytes;
  :class:`~.blockwise.TPUBlockQuantLinear` stores the expanded form once, at load).

What runs: ``quantized_matmul_blockwise_a8_kernel(x_q, x_scale, w_q, w_scale, w_zero_point?, block_size,
out_dtype, weight_format)``, grid ``(M/bm, N/bn, K_w/bk)`` with ``bk`` a multiple of ``bs``
(:func:`~.blockwise.k_block`), f32 VMEM accumulator. Per K step, for each of its ``bk / bs`` groups (static loop):
one MXU dot of the group's ``x_q`` columns with the group's weight tile in the quantized dtypes themselves —
fp8 x fp8 accumulating in f32, int8 x int8 (int4 nibbles unpacked in VMEM to int8 ``q - 8``: two half-width
dots) accumulating exactly in int32 — then ``partial * x_scale[:, g] * w_scale[g]`` in f32 (a ``[bm, 1]``
column times a ``[1, bn]`` row), added to the accumulator; int4 zero points subtract ``rowsum(x_q) * (z - 8)``
(the row sum exact in int32) before the scaling. fp8 activations with packed int4 / fp4 weights: the group's
nibbles are decoded to bf16 (int4 ``q - 8``; fp4 its e2m1 value, integer ops as in :mod:`.blockwise`) and the
group's ``x_q`` columns widened to bf16 (both exact), two half-width dots accumulating in f32 on the bf16 MXU (the
same exact products and f32 sums an fp8 x fp8 dot would give; the zero-point row sum in f32). The ``x_scale`` block is the row block's whole ``[bm, G]`` (fetched
once per row block); the group's column is taken by a static lane slice (one K step) or a one-hot masked lane sum
(exact: one nonzero term) at the step's group index.

Prefill form (``form="dequant"``, fp8 activations with fp8 weights only; the heuristic's choice for ``M > 128``): per K step both tiles are
dequantized in VMEM (``x_q * x_scale`` per ``1 x bs`` block, ``w_q * w_scale`` per group, in f32, rounded to
bf16) and multiplied by one MXU dot accumulating in f32. The group form's ``bk / bs`` scaled partial products cost
three f32 vector operations per output element and group, which bounds it on the VPU at prefill sizes; the
dequant form's vector work is per input element, amortized over the other operand's block. v6e's fp8 peak equals its
bf16 peak (jax's tpu_info, 9.2e14), so the bf16 MXU gives nothing away there; on tpu7x (fp8 2x bf16) this form
is capped at half of the fp8 peak. Model (libtpu 0.0.52 static estimate, prefill ``8192x4096 @ (14336x4096)^T``,
estimated at M/4 x 4, the heuristic's blocks): v6e e5m2 1,447 us at ``bm=2048, bn=1024, bk=4096`` (72% of the
1,046 us fp8 = bf16 roofline; the group form at its earlier prefill blocks 512/1024/1024: 2,559 us, 41%; ``bk=512`` with its per-step scale-column pick: 1,993
us); tpu7x e4m3fn 1,111 us at ``bm=1024`` (38% of its 418 us fp8 roofline, 75% of the bf16 one; group form 2,046 us). What is left is
the VPU's dequantization (a cost probe with static scale columns reached 1,403 us on v6e: benchmarks/probes/fp8_dequant_cost_probe.py; the figures above: benchmarks/probes/fp8_prefill_forms.py).
int8 keeps the group form (its int8 x int8 MXU pair runs at twice the bf16 rate), and so does v5e (no fp8 rate in
tpu_info; libtpu's profiler aborts on the dequant form there). Its error bound adds the two
bf16 roundings (below).

Prefill kernel (what the public op runs for fp8 x fp8 at ``M > 128`` on v6e / tpu7x, :func:`prefill_form`): the
dequant form re-dequantizes each ``x_q`` tile for every column block. Instead the quantization pass writes the
dequantized activations ``x' = bf16(f32(x_q) * x_scale)`` (``quantize_per_block_kernel(..., dequantize=True)``: the
same formula, the same values) and ``quantized_matmul_blockwise_a8_prefill_kernel`` dequantizes only the weight
tile per K step (one bf16 dot, f32 accumulator): the same result bit for bit, at half the vector work. With
several K steps each accumulator branch issues its own dot (:func:`~.blockwise.accumulate_k_step`, as the
matmul kernel): Mosaic fuses the accumulation into the matmul, where one shared dot followed by ``acc +=`` cost
a pass over the f32 accumulator per step and a second ``[bm, bn]`` f32 copy. Model (as above, the kernel
alone; benchmarks/probes/fp8_prefill_forms.py ``PREFILL=1``): up projection v6e 1,120 us at ``bm=1024,
bk=4096, bn=2048`` (was 1,447; 1,139 at 2048 / 4096 / 1024; one K step), tpu7x 894 us at 1024 / 4096 / 1024
(was 1,111; the bf16 matmul 888); down projection ``8192x14336 @ (4096x14336)^T`` v6e 1,144 us (1024 / 2048 /
2048; 1,256 with the shared dot), tpu7x 944 us (1024 / 2048 / 1024; 1,122 with the shared dot at 512, whose
1024 overflowed VMEM). With the quantization pass (it writes 2 B per activation instead of 1; the bench rows):
0.90x / 0.96x the bf16 matmul (v6e / tpu7x, up) and 0.76x / 0.83x (down, where the pass moves 3.5x more
activation bytes: 286 us of v6e's 1,430). Not shipped: the quantization fused into this kernel. libtpu 0.0.52
cannot estimate the f32 -> fp8 convert (tpu7x: ``vpack.c.f32.eXmY``; v6e: a type-check abort), so
benchmarks/probes/fp8_fused_quant_probe.py emulates the rounding exactly (bit for bit) with float or integer
ops: on v6e's down projection the fused quantization's vector work (+289 us with the cheaper rounding) is not
hidden under the MXU and matches the separate pass (286 us), and on tpu7x the pass is cheaper still. Native
fp8 x fp8 on tpu7x (2x the bf16 rate) cannot beat the bf16 MXU with 128-deep scale blocks: rescaling each
group's partial sum costs two to three f32 vector operations per output element per 128 of K, about 2.3x the
fp8 MXU's time for that group at tpu7x's VPU : MXU ratio, i.e. more than the bf16 dot it would replace.

Chips: the pair must be native on the MXU (jax ``tpu_info.is_matmul_supported``, as
:func:`~tpukernels.library.quantized_matmul_ops.supported_modes`): fp8 x fp8 for ``x_quant="fp8"`` (libtpu 0.0.52:
float8_e4m3fn on tpu7x only, float8_e5m2 on v5e, v6e and tpu7x), ``(int8, int8)`` for ``x_quant="int8"`` with int8
or int4 weights (v5e, v6e; not tpu7x). Elsewhere :class:`~tpukernels.errors.ChipError` naming the chip and the
modes it supports (:func:`check_chip_a8`). fp8 activations with int4 / fp4 weights use the bf16 MXU and run on every
chip (libtpu 0.0.52 compiles the kernel and the float8_e4m3fn quantization for v5e, v6e and tpu7x); they do not use
tpu7x's fp8 rate (feeding the decoded nibbles as float8_e4m3fn would: not done).

Error (``u`` = unit roundoff of the output dtype, ``u32 = 2^-24``), against the float64 product of the
**dequantized** operands ``x' = x_q * x_scale`` and ``W`` (:func:`reference_blockwise_a8`), elementwise:
``|y - ref| <= u |ref| + (bs + G + 2) u32 (|x'| @ M^T) + (K_w + 2) 2^-52 (|x'| @ M^T)`` with ``M[n, k] = (|q'| +
|z'|) |s|`` as in :mod:`.blockwise` (``M = |W|`` without zero points). Derivation: int8 x int8 group sums are exact
in int32 and stay exact in f32 (``|sum| <= 127^2 * 512 < 2^24``); fp8 x fp8 products are exact in f32 (4-bit x
4-bit significands), and so are fp8 x int4 / e2m1 ones (4 x 3 bits, via bf16), their f32 sum of ``bs`` terms errs by at most ``(bs - 1) u32`` times the absolute sum (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5); the zero-point product and subtraction, the
two scale products and the ``G - 1`` additions across groups add ``G + 3`` roundings; then the output rounding.
The last term is the float64 reference's own rounding. The prefill form (fp8, ``form="dequant"``) rounds each
dequantized operand to bf16 (``(1 + 2^-8)(1 + u32)``), so each product errs by at most ``2^-7 + 2^-16 + 5 u32``
relative, its bf16 products are exact in f32 and their sum errs by ``(K_w + 2) u32`` relative: ``|y - ref| <=
u |ref| + 1.01 (2^-7 + 2^-16 + 5 u32 + 1.02 (K_w + 2) u32) (|x'| @ M^T) + (K_w + 2) 2^-52 (|x'| @ M^T)``
(``form="dequant"`` of :func:`error_bound_blockwise_a8`; the default ``form=None`` gives the larger of the two,
what a call with the heuristic's choice is within). The bound is on the quantized values the kernel used: the
activation quantization error itself (half a grid step of each block, ``x_scale / 2`` for int8) is the scheme's,
not the kernel's. :func:`error_bound_blockwise_a8`.

Padding rule: the public op pads ``x`` with zero columns to ``K_w`` before quantizing (:mod:`.blockwise`), so the
last block's absmax is that of its real columns. No gradient: the forward runs with ``x.requires_grad``, a
backward reaching it raises ArgumentError (rounding ``x`` has derivative zero almost everywhere).

Source: DeepSeek-V3 technical report (arXiv:2412.19437, section 3.3.2: 1x128 activation tiles, 128x128 weight
blocks, per-group scaling of the partial sums in the higher-precision accumulation); tpu-inference's
``kernels/quantized_matmul/blockwise_kernel.py`` (v0.32.0: ``[n_in // block_size, 1, n_out]`` weight scales, a dot
per block in the quantized dtypes, ``* lhs_scale * rhs_scale`` per block; read, not copied).
"""

from __future__ import annotations

import types
from typing import Optional

import numpy as np
import torch

from ... import dsl as _dsl
from ...dsl.validate import padded_bytes
from ..vmem import MiB, scoped_vmem_limit, vmem_cap
from ...errors import ArgumentError, ChipError, DTypeError
from . import blockwise as _blockwise
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
# (BLOCK_SIZES, expand_block_scale, k_block: re-exported)
from .blockwise import (BLOCK_SIZES, PACKED, accumulate_k_step, expand_block_scale,  # noqa: F401
                        fp4_decode as _fp4_decode, k_block, problem, reference_blockwise_jnp)
from .common import (U32, X_DTYPES, check_chip, clamp as _clamp, describe, dtype_name, jnp_dtype as _jnp, qmax,
                     resolve_out_dtype as _out_dtype, target_chip)
from .quantize import quantize_values as _quantize_values, reciprocal as _reciprocal

#: activation dtypes of the a8 kernel
XQ_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
#: the fp8 dtype ``x_quant="fp8"`` quantizes ``x`` to for packed int4 / fp4 weights (tpu-inference's blockwise
#: kernel's ``x_q_dtype`` for its int4 x fp8 and fp4 x fp8 cases); fp8 weights keep their own dtype
FP8_FOR_PACKED = "float8_e4m3fn"

TUNABLES_A8 = {
    "bm": _dsl.Tunable([256, 128, 512, 1024, 2048], default=256, doc="rows of the output block (tokens)"),
    "bk": _dsl.Tunable([1024, 512, 2048, 4096], default=1024,
                       doc="contraction block (upper bound: the largest multiple of block_size tiling K, k_block)"),
    "bn": _dsl.Tunable([512, 256, 1024, 2048, 4096], default=512, doc="columns of the output block (N)"),
    "form": _dsl.Tunable(["groups", "dequant"], default="groups",
                         doc="fp8 only: 'groups' = one fp8 x fp8 dot per group, scaled in f32; 'dequant' = both tiles "
                             "dequantized to bf16 in VMEM, one dot per K step (module docstring, 'Prefill form')"),
}
TUNABLES_QB = {
    "bm": _dsl.Tunable([256, 32, 64, 128, 512], default=256, doc="rows per block (the block holds whole rows)"),
}


# ----------------------------------------------------------------------------------------------- chips, scales
def check_chip_a8(x_quant: str, fmt: str, where: str, chip=None) -> None:
    """ChipError unless the target chip (None: unchecked) multiplies the pair natively: ``(int8, int8)`` for
    ``x_quant="int8"`` (int8 or int4 weights: w8a8 / w4a8), ``(fp8, fp8)`` for ``"fp8"`` with fp8 weights. fp8
    activations with int4 / fp4 weights need nothing of the MXU (both tiles enter it as bf16, exactly): every chip."""
    if x_quant == "fp8" and fmt in PACKED:
        return None
    if fmt != "int4":
        return check_chip(x_quant, fmt, chip=chip, where=where)
    from .common import supported_modes

    chip = target_chip() if chip is None else chip
    if chip is None:
        return
    modes = supported_modes(chip)
    if ("int8", "int8") not in modes:
        raise ChipError(f"{where}: x_quant='int8' with int4 weights (w4a8: nibbles unpacked to int8 in VMEM) is not "
                        f"supported on {chip.name}: jax's tpu_info.is_matmul_supported says its MXU does not take "
                        f"(int8, int8) natively; supported on {chip.name}: {describe(modes)}, and w4a16 (int4 "
                        f"weights, x_quant=None) everywhere")


# ----------------------------------------------------------------------------------------------- quantization
def quantize_per_block_reference(x: torch.Tensor, dtype: str, block_size: int):
    """torch version of ``quantize_per_block_kernel``: ``x [M, K]`` (``K % block_size == 0``) ->
    ``(x_q [M, K] dtype, x_scale [M, K / block_size] float32)`` (module docstring formula)."""
    from .quantize import quantize_reference

    M, K = x.shape
    q, s = quantize_reference(x.reshape(M * (K // block_size), block_size), dtype)
    return q.reshape(M, K), s.reshape(M, K // block_size)


def block_quantize(v, qm, is_int, dtype):
    """One ``1 x bs`` block per row of ``v [rows, bs]`` -> ``(q [rows, bs] dtype, scale [rows, 1] f32)`` (module
    docstring formula). The one definition ``quantize_per_block_kernel`` and the prefill kernel use."""
    import jax.numpy as jnp

    s = jnp.max(jnp.abs(v), axis=1, keepdims=True).astype(jnp.float32) * np.float32(1.0 / qm)
    return _quantize_values(v, _reciprocal(s), qm, is_int, dtype), s


def _qb_body(x_ref, q_ref, s_ref, *, bs, n_groups, qm, is_int, qdt=None):
    """``qdt`` (the quantized dtype's name) given: ``q_ref`` is bf16 and receives ``x' = bf16(f32(q) * s)``."""
    import jax.numpy as jnp

    for g in range(n_groups):
        q, s = block_quantize(x_ref[:, g * bs:(g + 1) * bs], qm, is_int, q_ref.dtype if qdt is None else _jnp(qdt))
        if qdt is not None:  # the prefill kernel's x operand: what _a8_dequant_part makes of x_q, x_scale, bit for bit
            q = (q.astype(jnp.float32) * s).astype(q_ref.dtype)
        q_ref[:, g * bs:(g + 1) * bs] = q
        s_ref[:, g:g + 1] = s


def _qb_check(x, dtype, block_size, where):
    if len(x.shape) != 2:
        raise ArgumentError(f"{where}: x must be 2-D [M, K], got {tuple(x.shape)}")
    if dtype_name(x.dtype) not in X_DTYPES:
        raise DTypeError(f"{where}: x dtype {dtype_name(x.dtype)} is not one of {X_DTYPES}")
    if dtype not in XQ_DTYPES:
        raise DTypeError(f"{where}: dtype {dtype!r} is not one of {XQ_DTYPES}")
    if not isinstance(block_size, int) or block_size not in BLOCK_SIZES:
        raise ArgumentError(f"{where}: block_size {block_size!r} is not a multiple of 32 in 32..512")
    if x.shape[1] % block_size:
        raise ArgumentError(f"{where}: x has K = {x.shape[1]} columns, not a multiple of block_size = {block_size} "
                            f"(the public op pads x with zero columns first)")
    return x.shape[0], x.shape[1]


def _qb_shape(x, dtype="float8_e4m3fn", block_size=128, dequantize=False):
    M, K = _qb_check(x, dtype, block_size, "tpukernels::quantize_per_block_kernel")
    return (_dsl.OutSpec((M, K), _jnp("bfloat16" if dequantize else dtype)),
            _dsl.OutSpec((M, K // block_size), _jnp("float32")))


def _qb_heuristic(x, dtype="float8_e4m3fn", block_size=128, dequantize=False):
    K = max(1, x.shape[1])
    rows = (4 * MiB) // (K * 4)  # the f32 copy of a block within ~4 MiB
    return dict(bm=max(32, min(512, 1 << max(0, rows.bit_length() - 1))))


@_dsl.tpu_kernel(_qb_body, name="quantize_per_block_kernel", namespace="tpukernels", tunables=TUNABLES_QB,
                 heuristic=_qb_heuristic, out_shape=_qb_shape)
def quantize_per_block_kernel(x: torch.Tensor, dtype: str = "float8_e4m3fn", block_size: int = 128,
                              dequantize: bool = False, *, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-block (``1 x block_size``) absmax quantization of ``x [M, K]`` (bf16 / f32, ``K`` a multiple
    of ``block_size``) to ``dtype`` (int8 / fp8): ``(x_q [M, K], x_scale [M, K / block_size] float32)`` (module
    docstring). Blocks hold whole rows; grid ``(M / bm,)``.

    ``dequantize=True``: the first output is instead ``x' = bf16(f32(x_q) * x_scale)`` ``[M, K]`` bfloat16, the
    quantized activations dequantized (the ``x`` of ``quantized_matmul_blockwise_a8_prefill_kernel``; the values
    the a8 kernel's ``form="dequant"`` computes in VMEM).

    Raises:
        ArgumentError: rank, block size, K not a multiple of it. DTypeError: dtypes.
    """
    from jax.experimental import pallas as pl

    where = "tpukernels::quantize_per_block_kernel"
    M, K = _qb_check(x, dtype, block_size, where)
    G = K // block_size
    bm_ = _clamp(M, bm)
    odt = _jnp("bfloat16" if dequantize else dtype)
    need = (2 * (padded_bytes((bm_, K), x.dtype) + padded_bytes((bm_, K), odt)
                 + padded_bytes((bm_, G), "float32")) + 3 * padded_bytes((bm_, block_size), "float32"))
    return _dsl.Launch(
        grid=(_dsl.cdiv(M, bm_),),
        in_specs=[pl.BlockSpec((bm_, K), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((bm_, K), lambda i: (i, 0)), pl.BlockSpec((bm_, G), lambda i: (i, 0))],
        out_shape=_qb_shape(x, dtype, block_size, dequantize),
        dimension_semantics=("parallel",),
        vmem_limit_bytes=scoped_vmem_limit(need),
        cost_estimate=pl.CostEstimate(flops=4 * M * K, transcendentals=0,
                                      bytes_accessed=int(M * K * (np.dtype(x.dtype).itemsize + np.dtype(odt).itemsize)
                                                         + 4 * M * G)),
        body_kwargs=dict(bs=int(block_size), n_groups=int(G), qm=qmax(dtype), is_int=dtype == "int8",
                         qdt=dtype if dequantize else None),
    )


# ----------------------------------------------------------------------------------------------- references
def _mag_w(w_q, w_scale, block_size, w_zero_point, fmt):
    from .blockwise import fp4_values, unpack_int4

    s = w_scale.double()[:, 0, :].T.repeat_interleave(block_size, 1).abs()
    if fmt == "fp4":
        return fp4_values(unpack_int4(w_q, block_size)).abs() * s
    if fmt == "int4":
        qp = unpack_int4(w_q, block_size).double() - 8
        zp = 0.0 if w_zero_point is None else (w_zero_point.double()[:, 0, :].T - 8).abs().repeat_interleave(
            block_size, 1)
        return (qp.abs() + zp) * s
    return w_q.double().abs() * s


def _x_dequant(x_q, x_scale, block_size):
    return x_q.double() * x_scale.double().repeat_interleave(block_size, 1)


def reference_blockwise_a8(x_q, x_scale, w_q, w_scale, block_size: int, w_zero_point=None,
                           weight_format: Optional[str] = None) -> torch.Tensor:
    """float64 ``x' @ W^T`` (not rounded) of the dequantized operands ``x' = x_q * x_scale`` (per block) and ``W``
    (:func:`~.blockwise.dequantize_blockwise`; ``weight_format="fp4"`` for e2m1 codes in a uint8 ``w_q``);
    ``x_q [M, K_w]``, ``x_scale [M, K_w / bs]``."""
    from .blockwise import dequantize_blockwise

    W = dequantize_blockwise(w_q, w_scale, block_size, w_zero_point, weight_format)
    return _x_dequant(x_q, x_scale, block_size) @ W.T


def error_bound_blockwise_a8(x_q, x_scale, w_q, w_scale, block_size: int, w_zero_point=None,
                             out_dtype=torch.bfloat16, form: Optional[str] = None,
                             weight_format: Optional[str] = None) -> torch.Tensor:
    """The elementwise bound of the module docstring on ``|y - reference_blockwise_a8(...)|`` (float64).

    ``form``: ``"groups"``, ``"dequant"`` (fp8 x fp8 weights only) or None (fp8 weights: the larger of the two;
    int8 activations and int4 / fp4 weights: groups, the only form they run). ``weight_format`` as in
    :func:`reference_blockwise_a8`."""
    from .blockwise import resolve_format

    fmt = resolve_format(w_q, "error_bound_blockwise_a8", weight_format)
    u = 2.0**-8 if out_dtype == torch.bfloat16 else U32
    ref = reference_blockwise_a8(x_q, x_scale, w_q, w_scale, block_size, w_zero_point, weight_format)
    mw = _mag_w(w_q, w_scale, block_size, w_zero_point, fmt)
    K_w = mw.shape[1]
    G = K_w // block_size
    mag = _x_dequant(x_q, x_scale, block_size).abs() @ mw.T
    groups = u * ref.abs() + (block_size + G + 2) * U32 * mag + (K_w + 2) * 2.0**-52 * mag
    if form == "groups" or dtype_name(x_q.dtype) == "int8" or fmt in PACKED:
        return groups
    dequant = (u * ref.abs() + 1.01 * (2.0**-7 + 2.0**-16 + 5 * U32 + 1.02 * (K_w + 2) * U32) * mag
               + (K_w + 2) * 2.0**-52 * mag)
    return dequant if form == "dequant" else torch.maximum(groups, dequant)


# ----------------------------------------------------------------------------------------------- kernel
def _a8_dequant_part(x_ref, w_ref, s_ref, xs_cols, *, bs, n_sub):
    """Prefill form of one K step (module docstring): ``x_q`` and ``w_q`` tiles dequantized group by group in f32
    (``x_q * x_scale`` per ``1 x bs`` block, ``w_q * w_scale`` per row of each group), rounded to bf16, one MXU dot
    accumulating in f32."""
    import jax
    import jax.numpy as jnp

    f32, bf16 = jnp.float32, jnp.bfloat16
    xd = jnp.concatenate([(x_ref[:, g * bs:(g + 1) * bs].astype(f32) * xs_cols[g]).astype(bf16)
                          for g in range(n_sub)], axis=1)
    return jax.lax.dot_general(xd, _w_dequant(w_ref, s_ref, bs=bs, n_sub=n_sub), (((1,), (1,)), ((), ())),
                               preferred_element_type=f32)


def _w_dequant(w_ref, s_ref, *, bs, n_sub):
    """The ``[bn, bk]`` weight tile dequantized group by group in f32 (``w_q * w_scale`` per row of each group),
    rounded to bf16."""
    import jax.numpy as jnp

    ws_t = s_ref[...].reshape(n_sub, s_ref.shape[-1]).T  # [bn, n_sub]: each group's scales as a column
    return jnp.concatenate([(w_ref[:, g * bs:(g + 1) * bs].astype(jnp.float32) * ws_t[:, g:g + 1])
                            .astype(jnp.bfloat16) for g in range(n_sub)], axis=1)


def _a8_body(x_ref, xs_ref, w_ref, s_ref, *refs, bs, n_sub, n_k, int4, has_zp, acc_int, dequant=False, fp4=False):
    """One output block, one K step of ``n_sub`` groups (module docstring); ``refs`` = ``[z_ref,] o_ref, acc_ref``.
    ``int4``: packed weights (int4, or e2m1 codes with ``fp4``); with fp8 ``x_q`` (``acc_int`` False) both tiles
    enter the MXU as bf16 (exact values) accumulating in f32."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    if has_zp:
        z_ref, o_ref, acc_ref = refs
    else:
        z_ref, (o_ref, acc_ref) = None, refs
    k = pl.program_id(2)
    dims = (((1,), (1,)), ((), ()))
    pref = jnp.int32 if acc_int else jnp.float32
    half = bs // 2
    xs_all = xs_ref[...]
    lane = None if n_k == 1 else jax.lax.broadcasted_iota(jnp.int32, xs_all.shape, 1)

    def xs_col(g):
        if n_k == 1:
            return xs_all[:, g:g + 1]
        # the group's scale column at a dynamic lane: a one-hot masked lane sum (one nonzero term: exact)
        return jnp.sum(jnp.where(lane == k * n_sub + g, xs_all, 0.0), axis=1, keepdims=True)

    if dequant:
        if n_k == 1:
            cols = [xs_col(g) for g in range(n_sub)]
        else:  # the step's n_sub scale columns in one small MXU product with a one-hot [G, n_sub] selector (one
            # nonzero term per output, exact at HIGHEST precision) instead of n_sub masked lane sums over [bm, G]
            pick = (jax.lax.broadcasted_iota(jnp.int32, (xs_all.shape[1], n_sub), 0)
                    == k * n_sub + jax.lax.broadcasted_iota(jnp.int32, (xs_all.shape[1], n_sub), 1))
            xs_k = jax.lax.dot_general(xs_all, pick.astype(jnp.float32), (((1,), (0,)), ((), ())),
                                       precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
            cols = [xs_k[:, g:g + 1] for g in range(n_sub)]
        accumulate_k_step(lambda: _a8_dequant_part(x_ref, w_ref, s_ref, cols, bs=bs, n_sub=n_sub), k, n_k, acc_ref,
                          o_ref)
        return
    part = None
    for g in range(n_sub):
        xsg = xs_col(g)
        xg = x_ref[:, g * bs:(g + 1) * bs]
        if int4:  # unpack in VMEM: low nibbles = first half of the group, high = second half; int8 x_q: int8
            # q - 8 (int8 x int8 dots); fp8 x_q: q - 8 or the e2m1 value in bf16, x_q widened to bf16 (all exact)
            b = w_ref[:, g * half:(g + 1) * half].astype(jnp.int32)
            xa, xb = xg[:, :half], xg[:, half:]
            if acc_int:
                lo, hi = ((b & 15) - 8).astype(jnp.int8), ((b >> 4) - 8).astype(jnp.int8)
            else:
                bf16 = jnp.bfloat16
                xa, xb = xa.astype(bf16), xb.astype(bf16)
                if fp4:
                    lo, hi = _fp4_decode(b & 15, bf16), _fp4_decode(b >> 4, bf16)
                else:
                    lo, hi = ((b & 15) - 8).astype(bf16), ((b >> 4) - 8).astype(bf16)
            d = (jax.lax.dot_general(xa, lo, dims, preferred_element_type=pref)
                 + jax.lax.dot_general(xb, hi, dims, preferred_element_type=pref))
        else:
            d = jax.lax.dot_general(xg, w_ref[:, g * bs:(g + 1) * bs], dims, preferred_element_type=pref)
        d = d.astype(jnp.float32)
        if z_ref is not None:  # x . (q - z)^T = x . (q - 8)^T - rowsum(x) (z - 8); int8: the row sum exact in int32
            r = jnp.sum(xg.astype(jnp.int32 if acc_int else jnp.float32), axis=1, keepdims=True).astype(jnp.float32)
            d = d - r * (z_ref[g] - 8.0)
        d = (d * xsg) * s_ref[g]
        part = d if part is None else part + d

    accumulate_k_step(part, k, n_k, acc_ref, o_ref)


def _a8_problem(x_q, x_scale, w_q, w_scale, w_zero_point, block_size, where, weight_format=None):
    """``(M, N, K_w, fmt, x_quant)`` after the checks (typed errors naming the tensor)."""
    if len(x_q.shape) != 2:
        raise ArgumentError(f"{where}: x_q must be 2-D [M, K_w], got {tuple(x_q.shape)}")
    xd = dtype_name(x_q.dtype)
    if xd not in XQ_DTYPES:
        raise DTypeError(f"{where}: x_q dtype {xd} is not one of {XQ_DTYPES} (quantize x with "
                         f"quantize_per_block_kernel)")
    # the weight side's checks (block size, packing, w_scale / w_zero_point shapes) on a stand-in bf16 x
    stand_in = types.SimpleNamespace(shape=tuple(x_q.shape), dtype=np.dtype("float32"))
    M, N, K_w, fmt = problem(stand_in, w_q, w_scale, w_zero_point, block_size, where, weight_format)
    if xd == "int8" and fmt not in ("int8", "int4"):
        raise DTypeError(f"{where}: int8 x_q needs int8 or int4 w_q, got {fmt} (fp8 x_q for fp8, int4 or fp4 "
                         f"weights)")
    if xd != "int8" and fmt != xd and fmt not in PACKED:
        raise DTypeError(f"{where}: {xd} x_q needs w_q of the same fp8 dtype or packed int4 / fp4, got {fmt}")
    G = K_w // block_size
    if tuple(x_scale.shape) != (M, G):
        raise ArgumentError(f"{where}: x_scale must have shape (M, K/block_size) = ({M}, {G}), got "
                            f"{tuple(x_scale.shape)}")
    if dtype_name(x_scale.dtype) != "float32":
        raise DTypeError(f"{where}: x_scale must be float32, got {dtype_name(x_scale.dtype)}")
    return M, N, K_w, fmt, "int8" if xd == "int8" else "fp8"


def _a8_heuristic(x_q, x_scale, w_q, w_scale, w_zero_point=None, block_size=128, out_dtype=None,
                  weight_format=None):
    """Decode (``M <= 128``): one row block, large weight tiles. Prefill: fp8 takes the dequant form at
    ``bm=2048, bk=4096, bn=1024`` where :func:`prefill_form` holds (``bm=1024`` where the chip has < 128 MiB of
    VMEM: tpu7x; ``bk`` 4096 when that is one K step, whose scale columns are static slices, else 2048): chips
    with an fp8 MXU rate in jax's tpu_info (v6e, tpu7x; and cpu interpret); elsewhere (v5e: e5m2 is accepted, no
    fp8 rate is listed, and libtpu 0.0.52's profiler aborts on the dequant form there, so it has no model
    figure), for int8 and for packed int4 / fp4 weights, the group form."""
    M = x_q.shape[0]
    if M <= 128:
        return dict(bm=128, bk=2048, bn=512, form="groups")
    chip = target_chip()
    xd = dtype_name(x_q.dtype)
    fmt = dtype_name(w_q.dtype) if w_q is not None else xd  # fp8 x_q pairs with its own fp8 dtype or packed uint8
    if prefill_form(M, fmt, "int8" if xd == "int8" else "fp8", chip):  # the public op's prefill rule
        big = chip is None or chip.vmem_capacity_bytes >= 128 * MiB
        K_w = x_q.shape[1]
        one_step = k_block(K_w, block_size, 4096, False) == K_w
        return dict(bm=2048 if big else 1024, bk=4096 if one_step else 2048, bn=1024, form="dequant")
    return dict(bm=512, bk=1024, bn=1024, form="groups")


def _a8_shape(x_q, x_scale, w_q, w_scale, w_zero_point=None, block_size=128, out_dtype=None, weight_format=None):
    where = "tpukernels::quantized_matmul_blockwise_a8_kernel"
    M, N, _, _, _ = _a8_problem(x_q, x_scale, w_q, w_scale, w_zero_point, block_size, where, weight_format)
    return _dsl.OutSpec((M, N), _out_dtype(out_dtype, x_q, where))


def _ref_a8(x_q, x_scale, w_q, w_scale, w_zero_point=None, block_size=128, out_dtype=None, weight_format=None):
    """jnp version (autotuner correctness check): dequantize both operands in f32, one dot."""
    import jax.numpy as jnp
    from jax import lax

    from .blockwise import dequantize_f32_jnp

    W = dequantize_f32_jnp(w_q, w_scale, w_zero_point, block_size, weight_format)
    xd = x_q.astype(jnp.float32) * jnp.repeat(x_scale, block_size, axis=1)
    z = jnp.matmul(xd, W.T, precision=lax.Precision.HIGHEST)
    return z.astype(_out_dtype(out_dtype, x_q, "quantized_matmul_blockwise_a8_kernel"))


@_dsl.tpu_kernel(_a8_body, name="quantized_matmul_blockwise_a8_kernel", namespace="tpukernels", tunables=TUNABLES_A8,
                 heuristic=_a8_heuristic, out_shape=_a8_shape, reference=_dsl.jax_reference(_ref_a8))
def quantized_matmul_blockwise_a8_kernel(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                                         w_scale: torch.Tensor, w_zero_point: Optional[torch.Tensor] = None,
                                         block_size: int = 128, out_dtype: Optional[str] = None,
                                         weight_format: Optional[str] = None, *,
                                         bm: int, bk: int, bn: int, form: str = "groups") -> torch.Tensor:
    """``x' @ W^T`` with block-quantized activations and weights (module docstring): ``x_q [M, K_w]`` int8 / fp8,
    ``x_scale [M, K_w / bs]`` f32, ``w_q [N, K_w]`` (same fp8 dtype as ``x_q``; int8) or ``[N, K_w / 2]`` uint8
    (int4 with int8 or fp8 ``x_q``; fp4 e2m1 codes, ``weight_format="fp4"``, with fp8 ``x_q``), ``w_scale
    [K_w / bs, 1, N]`` f32, ``w_zero_point`` (int4) same shape -> ``[M, N]`` in ``out_dtype`` (default
    bfloat16).

    Raises:
        ArgumentError: ranks, block size, packed width, scale / zero-point shapes (each names the tensor).
        DTypeError: dtypes and pairs. ChipError: the target chip's MXU lacks the pair (:func:`check_chip_a8`).
    """
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::quantized_matmul_blockwise_a8_kernel"
    M, N, K_w, fmt, x_quant = _a8_problem(x_q, x_scale, w_q, w_scale, w_zero_point, block_size, where,
                                          weight_format)
    check_chip_a8(x_quant, fmt, where)
    odt = _out_dtype(out_dtype, x_q, where)
    int4 = fmt in PACKED  # packed two per byte (int4, or fp4 e2m1 codes)
    bk_ = k_block(K_w, block_size, bk, int4)
    bm_, bn_ = _clamp(M, bm), _clamp(N, bn)
    gi, gj, gk = _dsl.cdiv(M, bm_), _dsl.cdiv(N, bn_), K_w // bk_
    G = K_w // block_size
    n_sub = bk_ // block_size
    wcols = bk_ // 2 if int4 else bk_
    in_specs = [pl.BlockSpec((bm_, bk_), lambda i, j, k: (i, k)),
                pl.BlockSpec((bm_, G), lambda i, j, k: (i, 0)),
                pl.BlockSpec((bn_, wcols), lambda i, j, k: (j, k)),
                pl.BlockSpec((n_sub, 1, bn_), lambda i, j, k: (k, 0, j))]
    if w_zero_point is not None:
        in_specs.append(pl.BlockSpec((n_sub, 1, bn_), lambda i, j, k: (k, 0, j)))
    acc_shape = (8, 128) if gk == 1 else (bm_, bn_)
    # int8 keeps the group form (its MXU pair is 2x bf16's rate); so do packed weights (their nibbles are decoded
    # per group either way)
    dequant = form == "dequant" and x_quant == "fp8" and not int4
    io = 2 * (padded_bytes((bm_, bk_), x_q.dtype) + padded_bytes((bm_, G), "float32")
              + padded_bytes((bn_, wcols), w_q.dtype)
              + (1 + (w_zero_point is not None)) * n_sub * padded_bytes((1, bn_), "float32")
              + padded_bytes((bm_, bn_), odt))
    if dequant:  # the dequantized tiles (f32 group slices, bf16 tiles); a dot per accumulator branch (no copy)
        work = padded_bytes((bm_ + bn_, block_size), "float32") + padded_bytes((bm_ + bn_, bk_), "bfloat16")
    else:
        work = 2 * padded_bytes((bn_, block_size), "int32") + 3 * padded_bytes((bm_, bn_), "float32")
        if int4 and x_quant == "fp8":  # the bf16 halves of the group's weight and x tiles
            work += padded_bytes((bn_, block_size), "bfloat16") + padded_bytes((bm_, block_size), "bfloat16")
    need = io + work + padded_bytes(acc_shape, "float32")
    wbytes = N * K_w // (2 if int4 else 1)
    cost = pl.CostEstimate(flops=2 * M * N * K_w, transcendentals=0,
                           bytes_accessed=int(gj * M * (K_w + 4 * G) + gi * wbytes + M * N * np.dtype(odt).itemsize))
    return _dsl.Launch(
        grid=(gi, gj, gk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm_, bn_), lambda i, j, k: (i, j)),
        out_shape=_dsl.OutSpec((M, N), odt),
        scratch_shapes=[pltpu.VMEM(acc_shape, jnp.float32)],
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=scoped_vmem_limit(need),
        cost_estimate=cost,
        body_kwargs=dict(bs=int(block_size), n_sub=int(n_sub), n_k=int(gk), int4=int4,
                         has_zp=w_zero_point is not None, acc_int=x_quant == "int8", dequant=dequant,
                         fp4=fmt == "fp4"),
    )


# ------------------------------------------------------------------------------------------ prefill kernel
TUNABLES_PREFILL = {
    "bm": _dsl.Tunable([1024, 256, 512, 2048], default=1024, doc="rows of the output block (tokens)"),
    "bk": _dsl.Tunable([2048, 512, 1024, 4096], default=2048,
                       doc="contraction block (upper bound: the largest multiple of block_size tiling K, k_block)"),
    "bn": _dsl.Tunable([1024, 256, 512, 2048], default=1024, doc="columns of the output block (N)"),
}


def prefill_form(M: int, fmt: str, x_quant: str, chip=None) -> bool:
    """Does the public op run fp8 x fp8 at ``M`` tokens as the prefill kernel (module docstring, 'Prefill form')?
    fp8 activations with fp8 weights, ``M > 128``, on a chip with an fp8 MXU rate in jax's tpu_info (v6e, tpu7x)
    or none known (cpu interpret); the a8 kernel's group form elsewhere (v5e, decode)."""
    if x_quant != "fp8" or not fmt.startswith("float8") or M <= 128:
        return False
    chip = target_chip() if chip is None else chip
    return chip is None or bool(chip.info.fp8_ops_per_second)


def _prefill_body(x_ref, w_ref, s_ref, o_ref, acc_ref, *, bs, n_sub, n_k):
    """One output block, one K step: the weight tile dequantized to bf16 (:func:`_w_dequant`), one MXU dot with
    the already dequantized ``x'`` tile, accumulating in f32 (a dot per accumulator branch: accumulate_k_step)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def part():
        return jax.lax.dot_general(x_ref[...], _w_dequant(w_ref, s_ref, bs=bs, n_sub=n_sub), (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    accumulate_k_step(part, pl.program_id(2), n_k, acc_ref, o_ref)


def _prefill_problem(x, w_q, w_scale, block_size, where):
    """``(M, N, K_w, fmt)`` after the checks (typed errors naming the tensor)."""
    if len(x.shape) != 2 or dtype_name(x.dtype) != "bfloat16":
        raise ArgumentError(f"{where}: x must be the dequantized activations, 2-D [M, K_w] bfloat16 "
                            f"(quantize_per_block_kernel(..., dequantize=True)), got {tuple(x.shape)} "
                            f"{dtype_name(x.dtype)}")
    M, N, K_w, fmt = problem(x, w_q, w_scale, None, block_size, where)
    if not fmt.startswith("float8"):
        raise DTypeError(f"{where}: w_q must be float8_e4m3fn or float8_e5m2, got {fmt} (the a8 kernel takes int8 "
                         f"and packed weights)")
    return M, N, K_w, fmt


def _prefill_heuristic(x, w_q, w_scale, block_size=128, out_dtype=None):
    """``bm=1024``; ``bk=4096`` where that is one K step, else 2048; ``bn=2048`` on chips with >= 128 MiB of VMEM
    (v6e), else 1024 (tpu7x). From benchmarks/probes/fp8_prefill_forms.py (``PREFILL=1``), module docstring."""
    chip = target_chip()
    big = chip is None or chip.vmem_capacity_bytes >= 128 * MiB
    one_step = k_block(x.shape[1], block_size, 4096, False) == x.shape[1]
    return dict(bm=1024, bk=4096 if one_step else 2048, bn=2048 if big else 1024)


def _prefill_shape(x, w_q, w_scale, block_size=128, out_dtype=None):
    where = "tpukernels::quantized_matmul_blockwise_a8_prefill_kernel"
    M, N, _, _ = _prefill_problem(x, w_q, w_scale, block_size, where)
    return _dsl.OutSpec((M, N), _out_dtype(out_dtype, x, where))


def _ref_prefill(x, w_q, w_scale, block_size=128, out_dtype=None):
    """jnp version (autotuner correctness check): the weight dequantized in f32, one dot."""
    return reference_blockwise_jnp(x, w_q, w_scale, None, block_size, out_dtype)


@_dsl.tpu_kernel(_prefill_body, name="quantized_matmul_blockwise_a8_prefill_kernel", namespace="tpukernels",
                 tunables=TUNABLES_PREFILL, heuristic=_prefill_heuristic, out_shape=_prefill_shape,
                 reference=_dsl.jax_reference(_ref_prefill))
def quantized_matmul_blockwise_a8_prefill_kernel(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                                                 block_size: int = 128, out_dtype: Optional[str] = None, *,
                                                 bm: int, bk: int, bn: int) -> torch.Tensor:
    """``x' @ W^T`` for fp8 x fp8 prefill (module docstring, 'Prefill form'): ``x [M, K_w]`` bfloat16, the
    block-quantized activations already dequantized (``quantize_per_block_kernel(..., dequantize=True)``),
    ``w_q [N, K_w]`` float8_e4m3fn / float8_e5m2, ``w_scale [K_w / bs, 1, N]`` f32 -> ``[M, N]`` in ``out_dtype``
    (default bfloat16). Grid ``(M/bm, N/bn, K_w/bk)``; per K step the weight tile is dequantized to bf16 in VMEM
    and multiplied by one bf16 MXU dot accumulating in f32 (the a8 kernel's ``form="dequant"`` without its
    per-step activation dequantization; the same values).

    Raises:
        ArgumentError: ranks, block size, scale shapes (each names the tensor). DTypeError: dtypes. ChipError: the
            target chip's MXU lacks the fp8 pair (:func:`check_chip_a8`, as the a8 kernel).
    """
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::quantized_matmul_blockwise_a8_prefill_kernel"
    M, N, K_w, fmt = _prefill_problem(x, w_q, w_scale, block_size, where)
    check_chip_a8("fp8", fmt, where)
    odt = _out_dtype(out_dtype, x, where)
    bk_ = k_block(K_w, block_size, bk, False)
    bm_, bn_ = _clamp(M, bm), _clamp(N, bn)
    gi, gj, gk = _dsl.cdiv(M, bm_), _dsl.cdiv(N, bn_), K_w // bk_
    n_sub = bk_ // block_size
    acc_shape = (8, 128) if gk == 1 else (bm_, bn_)
    cost = pl.CostEstimate(flops=2 * M * N * K_w, transcendentals=0,
                           bytes_accessed=int(gj * M * K_w * 2 + gi * (N * K_w + 4 * N * K_w // block_size)
                                              + M * N * np.dtype(odt).itemsize))
    return _dsl.Launch(
        grid=(gi, gj, gk),
        in_specs=[pl.BlockSpec((bm_, bk_), lambda i, j, k: (i, k)),
                  pl.BlockSpec((bn_, bk_), lambda i, j, k: (j, k)),
                  pl.BlockSpec((n_sub, 1, bn_), lambda i, j, k: (k, 0, j))],
        out_specs=pl.BlockSpec((bm_, bn_), lambda i, j, k: (i, j)),
        out_shape=_dsl.OutSpec((M, N), odt),
        scratch_shapes=[pltpu.VMEM(acc_shape, jnp.float32)],
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        # the chip's cap, not scoped_vmem_limit of the blocks' bytes: libtpu 0.0.52's profiling compile of the tpu7x
        # down projection at 1024 / 2048 / 1024 overflows VMEM below it ("Used 64.95M of 63.94M"; the plain compile
        # passes either way); the estimates at the other blocks are unchanged by it (v6e, tpu7x)
        vmem_limit_bytes=vmem_cap(),
        cost_estimate=cost,
        body_kwargs=dict(bs=int(block_size), n_sub=int(n_sub), n_k=int(gk)),
    )


def quantized_matmul_blockwise_a8(x2: torch.Tensor, w_q, w_scale, w_zero_point, block_size: int, fmt: str,
                                  x_quant: str, out_dtype: str, config=None) -> torch.Tensor:
    """``x2 [M, K_w]`` (bf16 / f32, already padded to ``K_w``) quantized per ``1 x block_size`` block, then the a8
    kernel; the public op's ``x_quant`` path (:func:`~.blockwise.quantized_matmul_blockwise`)."""
    where = "tpukernels::quantized_matmul_blockwise"
    if x_quant == "fp8" and not (fmt.startswith("float8") or fmt in PACKED):
        raise DTypeError(f"{where}: x_quant='fp8' needs float8, int4 or fp4 w_q, got {fmt} (x_quant='int8' for "
                         f"int8)")
    if x_quant == "int8" and fmt not in ("int8", "int4"):
        raise DTypeError(f"{where}: x_quant='int8' needs int8 or int4 w_q, got {fmt} (x_quant='fp8' for fp8 weights;"
                         f" fp4 takes x_quant=None or 'fp8')")
    check_chip_a8(x_quant, fmt, where)
    # fp8 weights: x in their fp8 dtype (one MXU pair); int4 / fp4 weights: float8_e4m3fn (tpu-inference's choice)
    qdt = "int8" if x_quant == "int8" else (FP8_FOR_PACKED if fmt in PACKED else fmt)
    if prefill_form(int(x2.shape[0]), fmt, x_quant) and (config is None or config.get("form", "dequant") == "dequant"):
        # the prefill kernel: x dequantized once by the quantization pass, not per (row, column) block in VMEM
        xd, _ = quantize_per_block_kernel(x2, qdt, int(block_size), True)
        kw = {} if config is None else dict(config={k: v for k, v in config.items() if k != "form"})
        return quantized_matmul_blockwise_a8_prefill_kernel(xd, w_q, w_scale, int(block_size), out_dtype, **kw)
    xq, xs = quantize_per_block_kernel(x2, qdt, int(block_size))
    kw = {} if config is None else dict(config=config)
    return quantized_matmul_blockwise_a8_kernel(xq, xs, w_q, w_scale, w_zero_point, int(block_size), out_dtype,
                                                "fp4" if fmt == "fp4" else None, **kw)


# the public op's x_quant path (quantized_matmul_blockwise lives in .blockwise, which this module builds on: it
# reaches this function through the hook instead of importing this module back)
_blockwise.X_QUANT_PATH = quantized_matmul_blockwise_a8
