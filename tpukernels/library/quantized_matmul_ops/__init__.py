"""Quantized matmul: ``y = (x @ dequant(w_q)^T)`` with int8 / fp8 weights, per-output-channel scales.

Public op::

    torch.ops.tpukernels.quantized_matmul(x, w_q, w_scale, x_quant=None, out_dtype=None) -> Tensor
    tpukernels.library.quantized_matmul(x, w_q, w_scale, *, x_quant=None, out_dtype=None, config=None)

Shapes: ``x [..., K]`` (leading dims flattened to ``M`` tokens), ``w_q [N, K]`` (an ``nn.Linear`` weight
layout), ``w_scale [N]`` float32; result ``[..., N]``. The dequantized weight is
``W[n, k] = w_q[n, k] * w_scale[n]`` (symmetric, per output channel, no zero point). Modes:

=============  ===================  =====================================================================
mode           ``x`` / ``w_q``        what runs
=============  ===================  =====================================================================
w8a16          bf16|f32 / int8|fp8  ``w_q`` tile converted to ``x.dtype`` in VMEM (exact: int8 and fp8
                                    values are representable in bf16), ``x . w^T`` accumulated in f32,
                                    then ``* w_scale[n]``. On chips whose MXU takes ``bf16 x fp8``
                                    natively (jax ``tpu_info.is_matmul_supported``) the fp8 tile is fed as is.
w8a8 int8      bf16|f32 / int8      ``x`` quantized per token, int8 x int8 accumulated exactly in int32 on
                                    the MXU, then ``* x_scale[m] * w_scale[n]`` in f32. One fused kernel
                                    (``quantized_matmul_w8a8_kernel``) where :func:`fused_plan` has a plan
                                    (``x`` read once, ``x_q`` never written to HBM), else
                                    ``quantize_per_token_kernel`` then ``quantized_matmul_kernel``; both
                                    give the same values (one quantization formula, the same epilogue).
w8a8 fp8       bf16|f32 / fp8       same with ``x`` quantized to ``w_q``'s fp8 dtype, f32 accumulation.
=============  ===================  =====================================================================

Quantization (``quantize_weight`` and the per-token activation kernel; symmetric absmax, all f32):
``s = max_k |v[k]| * f32(1 / qmax)``, ``r = f32(1 / s)`` (one division per row; ``r = 0`` where ``s = 0``),
``q = clip(round_half_even(v * r), -qmax, qmax)`` for int8 (``qmax = 127``, so -128 is never produced and
the grid is symmetric), ``q = fp8(clip(v * r, -qmax, qmax))`` (round to nearest even) for fp8 with ``qmax``
the dtype's largest finite value (448 for e4m3fn, 57344 for e5m2). The per-element work is one f32
multiply by the row's reciprocal, not a division (a TPU divides in several vector ops: with the division,
the down-projection's quantization no longer fit under the MXU, see the bench reasons); ``v * r`` is
within 2 ulps of ``v / s``. A zero row gets ``s = 0`` and ``q = 0``. In cpu interpret mode the kernel's
``(q, s)`` equal :func:`quantize_reference` bit for bit; on a TPU, the per-row f32 division is not
guaranteed correctly rounded, so a ``q`` may differ by one grid step where ``v * r`` is within an ulp of a
rounding boundary (the error bounds below are stated for the quantized values the kernel used, so they
hold either way). Source: the absmax (symmetric) scheme of LLM.int8()
(Dettmers et al., arXiv:2208.07339, section 3.1, per-row "vector-wise" scaling) and SmoothQuant's per-token
activation / per-channel weight granularity (Xiao et al., arXiv:2211.10438, section 3).

Error (what the tests check, ``u`` = unit roundoff of the output dtype, 2^-8 bf16 / 2^-24 f32, and
``u32 = 2^-24``): against a float64 product of the **dequantized** operands,

* w8a8 int8: the int32 sum is exact (``|acc| <= 127^2 K < 2^31`` for ``K <= 133143``, checked), so the only
  errors are the int32->f32 conversion and two f32 scale products (3 ``u32`` relative) and the final
  rounding: ``|y - ref| <= (u + 4 u32) |ref| + (K + 2) 2^-52 (|x'| @ |W|^T)`` elementwise (the last term
  is the float64 reference's own rounding: it matters only where the sum cancels to ~0);
* w8a16 / fp8: products are exact in f32, the f32 sum of K terms errs by at most ``(K - 1) u32 sum|x||W|``
  (any summation order; Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5), plus
  the scale product and the final rounding: ``|y - ref| <= u |ref| + (K + 2) u32 (|x| @ |W|^T)``.

Range. The scales are applied after the dot, so the f32 accumulator holds ``x · w_q`` (w8a16) and
overflows to ``inf`` once ``sum_k |x[k]| |w_q[n, k]|`` passes the f32 maximum (3.4e38): already for one
element ``|x| > 3.4e38 / qmax`` (2.7e36 for int8 weights, 7.6e35 e4m3fn, 5.9e33 e5m2) where the float64
product with the small dequantized weights is finite. w8a8 quantizes ``x`` first and has no such limit.

NaN. A NaN in a row of ``x`` gives that row a NaN absmax on a TPU (the max propagates NaN), so the w8a8 row is
NaN. In cpu interpret mode XLA:CPU's vectorized max reduction can drop NaN (jax 0.10.2; seen with >= 16
rows, cf. openxla/xla#21461), so there a NaN can vanish from the scale: interpret-mode w8a8 results for
non-finite activations are not the TPU's.

Chip support comes from jax's ``pltpu.get_tpu_info_for_chip(...).is_matmul_supported(lhs, rhs)`` (see
:func:`supported_modes`), never a table here: w8a8 int8 needs ``(int8, int8)``; w8a8 fp8 needs
``(fp8, fp8)``; fp8 weights need the chip to take that fp8 dtype on the MXU at all (``(fp8, fp8)`` or
``(bf16, fp8)``). With libtpu 0.0.52 / jax 0.10.2 that gives: v5e, v6e: int8 both modes, float8_e5m2 both
modes, no float8_e4m3fn; tpu7x: no int8 MXU (w8a16 with int8 weights still works: it runs on the bf16
MXU), float8_e4m3fn and float8_e5m2 in both modes (``bf16 x fp8`` natively). The chip checked is the
target of the call: the live TPU, the compile-only target (``tk.compile_for``), or on cpu
``TPUKERNELS_TARGET_CHIP``; a cpu interpret run with no target chip checks nothing (the interpreter has
every dtype) — set ``TPUKERNELS_TARGET_CHIP`` to get the error a TPU would give. An unsupported pair
raises :class:`~tpukernels.errors.ChipError` naming the chip and the modes it supports.

Kernels (torch ops, ``[rows, cols]`` operands):

* ``tpukernels::quantized_matmul_kernel(x [M,K], w_q [N,K], w_scale [1,N], x_scale [M,1]?, out_dtype)``:
  grid ``(M/bm, N/bn, K/bk)``, K innermost (``arbitrary``), f32 or int32 VMEM accumulator, scales in the
  epilogue. K tails are masked on both operands (``tk.mask_tail``, NaN-safe) on the last K step only.
  Decode (one row block of at most ``STREAM_MAX_M = 128`` rows, blocks that tile ``w_q`` exactly:
  :func:`stream_plan`) takes a weight-streaming launch instead: ``x`` whole in VMEM, ``w_q`` left in HBM and
  copied by the body, tile by tile over the grid ``(1, N/bn, K/bk)``, into a two-slot scratch, each tile as
  ``WEIGHT_DMAS = 2`` concurrent row-slab DMAs (the next tile's copies start before the current tile's dot);
  same dot, accumulator and epilogue, so the same values as the blocked launch at the same ``bk``.
* ``tpukernels::quantize_per_token_kernel(x [M,K], dtype) -> (x_q [M,K], x_scale [M,1])``: row blocks
  of the whole K (absmax needs the full row).
* ``tpukernels::quantized_matmul_w8a8_kernel(x [M,K] bf16|f32, w_q [N,K], w_scale [1,N], out_dtype)``: the
  fused w8a8 path. Grid ``(M/bm, N/bn, K/bk)``, all sequential; ``x`` stays in HBM (``pl.ANY``) and each
  row block at full K is DMA'd once into VMEM; row block ``i+1`` is DMA'd during row block ``i``'s first
  N sweeps and its absmax and quantization (into the second slot of a two-slot int8 / fp8 VMEM scratch)
  run during the last N sweeps, in the same branch as those steps' dots so vector and MXU work can
  overlap; only row block 0 is prepared serially. Blocks and the fallback rule: :func:`fused_plan`
  (``bm`` divides ``M``, footprint within 3/4 of the chip's VMEM from tpu_info).
* ``tpukernels::quantized_matmul_bwd_dx(g [M,N], w_q [N,K], w_scale [1,N]) -> [M,K]``: ``d_x = (g * w_scale)
  @ w_q`` (the scale is applied to the ``g`` tile in f32 and rounded once to ``g.dtype``).

Autograd: ``d_x`` for w8a16 (weights frozen: ``w_q`` and ``w_scale`` get no gradient). w8a8 has no
gradient (rounding has derivative zero almost everywhere): its forward runs with ``x.requires_grad``
(inference without ``torch.no_grad()``), and a backward that reaches it raises ArgumentError rather than
silently returning zeros.

Tunables ``bm, bk, bn`` (clamped to the problem as in :mod:`tpukernels.library.matmul_ops`); defaults:
:func:`heuristic`, then per-chip shipped data ``tpukernels/data/autotuning/<chip>/
tpukernels.quantized_matmul_kernel.json`` / ``tpukernels.quantized_matmul_w8a8_kernel.json`` chosen by
libtpu's static estimate (a model, not a measurement): the w8a16 prefill entries from full-program
estimates at 2048 tokens (the bench family's method; each entry's evidence lists the candidates), the decode
entries from full-program estimates of every streaming ``(bk, bn)`` (``benchmarks/quantized_matmul.py
--decode-sweep``: lowest libtpu cycles), the two-kernel w8a8 entries from ``benchmarks/quantized_matmul.py
--write-defaults``; the fused kernel's from
2048-token estimates on v6e (v5e takes the same blocks, tpu7x those with ``bm`` halved for its VMEM and
compile-only evidence: libtpu cannot estimate its fp8 pack). A public call reaches them: it passes
``out_dtype=None`` to the kernel for the default output dtype, the statics the entries are keyed under.

Performance (libtpu 0.0.52 static estimates + rooflines, a MODEL, not measurements; ``tpukernels bench
--family quantized_matmul``; Llama-3-8B MLP, 8192 tokens): w8a16 runs at the bf16 matmul's speed where
the MXU is the limit — 95-98% of the bf16 roofline at the shipped blocks (bm=1024, bn=2048, bk 2048-4096);
against XLA's dequantize + dot the up-projection is 1.03x (v5e), 1.04x (v6e), 1.00x (tpu7x); on the
down-projection libtpu aborts on XLA's program, so XLA's figure is only its roofline (a floor), which ours
reaches to 95-98% — and halves the weight bytes where HBM is the limit (decode, 16-64 tokens, below).
Decode (w8a16, Llama-3-8B MLP at 16 / 64 tokens; the full programs estimated by libtpu, ``benchmarks/
quantized_matmul.py --decode-sweep``): with the blocked launch (one weight DMA in flight) libtpu counted
more cycles than the HBM time on v6e (16x4096 -> 14336: 38.9 µs of cycles, HBM roofline 36.2 µs; XLA's
fusion 34.8 µs, so 0.93x XLA) and on v5e at 64 tokens (79.3 µs vs 74.6 µs). The parts, estimated apart (v6e,
16 tokens, bk=4096, bn=1024): the weight DMAs alone 24.6 µs, the dots with the weight tile resident in VMEM
(conversion included) 29.2 µs, both together 38.5 µs — a third of the DMA time exposed; with the tile copied
as two concurrent DMAs (or three slots deep) the whole kernel is 28.6 µs (30.0 µs), the dots' time. The
int8 -> bf16 conversion is not the limit (a bf16 tile of the same shape, no conversion: 32.3 µs; the scale
epilogue: < 0.1%). The streaming launch: v5e 49.3 / 50.6 / 51.5 µs of cycles, v6e 28.1 / 28.6 / 29.4 µs
(16x4096, 64x4096, 64x14336), all below the HBM roofline, so the model time is the roofline (100%: XLA's
figure on those chips, 1.00x) — how the hardware's DMA engines behave with one or two copies in flight is
not measured here. tpu7x: 21.1 / 21.9 / 21.4 µs, 75-77% of its HBM roofline (was 72%): not the weight
stream but the MXU's intake of bf16 weights bounds it — the same dots with the weights resident in VMEM take
22.4 µs (int8 converted) / 23.8 µs (bf16), and the whole streaming kernel with fp8 weights fed natively
(bf16 x fp8) 12.3 µs (HBM-bound); every weight element passes the bf16 MXU once whatever the blocking
(~1200 per cycle in libtpu's model, 2.6e12/s, below tpu7x's 3.7e12 1-byte weights/s of HBM).
w8a8 int8 (tpu_info's int8 peak is 2x bf16 on v5e and v6e), fused kernel, before the reciprocal
quantization and the shipped entries: 1.93x / 1.78x the bf16 matmul (up / down projection; 96% / 88% of
the int8 roofline) on v5e, 1.78x / 1.42x on v6e (86% / 68%); against XLA's fused quantize + int8 dot
1.02x (v5e) / 1.05x (v6e) up, 0.97x on v6e down; the current figures are the bench family's
(``benchmarks/results/quantized_matmul.json``). Before the fusion (separate quantize pass: 3 bytes of HBM
traffic per activation) the same rows were 1.84x / 1.69x and 1.42x / 1.27x the bf16 matmul and 0.84-0.97x
XLA. What remains is the serial quantization of the first row block and the part of the later ones not
hidden under the MXU (vector work proportional to K: the down-projection's; bench reasons). tpu7x's fp8
kernels compile but libtpu's static profiler dies on the f32 -> fp8 pack (no figure).

Layout of this package (every name above is importable from ``tpukernels.library.quantized_matmul_ops``):
``common`` (dtypes, chip support), ``quantize`` (absmax quantization: reference, weights, per-token kernel),
``references`` (float64 references, error bounds), ``w8a16`` (``quantized_matmul_kernel``, its streaming
decode launch, ``quantized_matmul_bwd_dx``), ``w8a8`` (the fused w8a8 kernel), ``public`` (the op and
``TPUQuantLinear``), ``blockwise`` (sub-channel scales along K: w4a16 int4 with zero points, block-scaled int8 /
fp8; ``quantized_matmul_blockwise``, ``TPUBlockQuantLinear``; its own docstring has the layout, the padding
rule and the error bound), ``blockwise_a8`` (block-quantized 8-bit activations: fp8 1x128 activations with
128x128 fp8 weight blocks or packed int4 / fp4 weights, w4a8 / w8a8 int8 with per-block activation scales; ``quantize_per_block_kernel``,
``quantized_matmul_blockwise_a8_kernel``, ``quantized_matmul_blockwise_a8_prefill_kernel`` (fp8 prefill); reached by
``quantized_matmul_blockwise(..., x_quant=...)``),
``blockwise_bwd`` (its ``d_x`` kernel ``quantized_matmul_blockwise_bwd_dx``: the
backward with respect to the activations, weights frozen; formula and error bound there).

Sources: JAX Pallas TPU matmul guide (blocked matmul, f32 scratch accumulator) and JAX's
``jax/experimental/pallas/ops/tpu/matmul.py``; tpu-inference's quantized matmul (int8 weights with
per-channel scales applied after the dot) for the layout of the epilogue.
"""

from __future__ import annotations

from .common import (INT32_MAX_K, OUT_DTYPES, U32, WEIGHT_DTYPES, X_DTYPES, X_QUANT, check_chip, dtype_name, jnp_dtype,
                     qmax, supported_modes)
from .quantize import (TUNABLES_Q, quantize_per_token, quantize_per_token_kernel, quantize_reference, quantize_weight,
                       weight_dtype_name)
from .references import dequantize, error_bound, reference
from .w8a16 import (STANDARD_CASES, STREAM_MAX_M, TUNABLES, WEIGHT_DMAS, heuristic, make_launch, problem,
                    quantized_matmul_bwd_dx, quantized_matmul_kernel, stream_plan, vmem_bytes)
from .w8a8 import (QCHUNK, STANDARD_CASES_W8A8, TUNABLES_W8A8, fused_plan, fused_vmem_bytes,
                   quantized_matmul_w8a8_kernel, vmem_budget, w8a8_heuristic)
from .public import TPUQuantLinear, canon_x_quant, check_public, check_pair, quantized_matmul
from .blockwise import (BLOCK_SIZES, FP4_VALUES, INT4_LAYOUTS, WEIGHT_FORMATS, TPUBlockQuantLinear,
                        dequantize_blockwise, error_bound_blockwise, fp4_values, int4n_to_k, k_block, pack_int4, pad_k,
                        quantize_weight_blockwise,
                        quantized_matmul_blockwise,
                        quantized_matmul_blockwise_kernel, reference_blockwise, unpack_int4)
from .blockwise_bwd import (error_bound_blockwise_dx, quantized_matmul_blockwise_bwd_dx,
                            reference_blockwise_dx)
from .blockwise_a8 import (FP8_FOR_PACKED, XQ_DTYPES, check_chip_a8, error_bound_blockwise_a8, expand_block_scale,
                           quantize_per_block_kernel, quantize_per_block_reference,
                           quantized_matmul_blockwise_a8_kernel, quantized_matmul_blockwise_a8_prefill_kernel,
                           reference_blockwise_a8)

__all__ = ["quantized_matmul", "quantize_weight", "quantize_per_token", "TPUQuantLinear", "reference",
           "quantize_reference", "error_bound", "supported_modes", "check_chip", "quantized_matmul_kernel",
           "quantize_per_token_kernel", "quantized_matmul_bwd_dx", "quantized_matmul_w8a8_kernel", "fused_plan",
           "vmem_budget", "heuristic", "STANDARD_CASES", "STANDARD_CASES_W8A8", "quantized_matmul_blockwise",
           "quantized_matmul_blockwise_kernel", "TPUBlockQuantLinear", "quantize_weight_blockwise", "pack_int4",
           "unpack_int4", "int4n_to_k", "pad_k", "dequantize_blockwise", "reference_blockwise", "error_bound_blockwise",
           "quantized_matmul_blockwise_bwd_dx", "reference_blockwise_dx", "error_bound_blockwise_dx",
           "quantize_per_block_kernel", "quantize_per_block_reference", "quantized_matmul_blockwise_a8_kernel",
           "quantized_matmul_blockwise_a8_prefill_kernel",
           "reference_blockwise_a8", "error_bound_blockwise_a8", "expand_block_scale", "check_chip_a8"]
