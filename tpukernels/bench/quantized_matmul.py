"""Quantized matmul family: tpukernels' quantized_matmul vs XLA's quantized dot, tpu-inference's quantized matmul
and our bf16 matmul.

Shapes: the Llama-3-8B MLP (:data:`tpukernels.library.quantized_matmul_ops.STANDARD_CASES`): prefill 8192
tokens through the up-projection ``4096 -> 14336`` and the down-projection ``14336 -> 4096``, and decode
batches of 16 / 64 tokens. Modes per chip: w8a16 (int8 weights, bf16 activations) everywhere, and for the
prefill shapes the chip's w8a8 mode — int8 where jax's ``tpu_info.is_matmul_supported(int8, int8)`` (v5e,
v6e), else float8_e4m3fn (tpu7x, which has no int8 MXU).

* ``tpukernels``: what ``quantized_matmul`` runs, at the config a call gets on the chip: w8a16
  ``quantized_matmul_kernel`` (for the decode shapes its weight-streaming launch, ``stream_plan``); w8a8 the
  fused ``quantized_matmul_w8a8_kernel`` (per-token quantization inside the matmul, ``x`` read once as bf16,
  no ``x_q`` in HBM) where ``fused_plan`` has a plan on the chip, else ``quantize_per_token_kernel`` +
  ``quantized_matmul_kernel`` (both estimates summed).
* ``xla int8 dot`` (``xla fp8 dot``): the same op in jnp, compiled and fused by XLA: w8a16
  ``dot_general(x, w_q.astype(bf16), preferred_element_type=f32) * w_scale``; w8a8 the absmax
  quantization in jnp, ``lax.dot_general(x_q, w_q, preferred_element_type=int32)`` (f32 for fp8) and the two
  scales.
* ``tpu-inference quantized_matmul``: tpu-inference 0.32.0's ``kernels/quantized_matmul`` (installed ``--no-deps``):
  ``quantized_matmul_kernel`` with ``x_q_dtype=None`` (w8a16) or the weight dtype (w8a8: its per-token absmax in jnp
  outside the kernel, the quantization inside), per-channel ``w_scale [N]``; for the fp8 block rows its
  ``blockwise_kernel`` (``block_size=128``: each ``1 x 128`` activation block quantized inside the kernel, weight
  scales ``[K / 128, 1, N]``, the same format as ours; one dot and two scale multiplies per 128-deep block). Blocks:
  its tuned table at the full problem (:func:`tpu_inference_blocks`: it tunes only w8a8, int8 on v6e and fp8 on
  tpu7x; a w8a16 row takes that entry of the same chip and shape), else the blocks our call gets (its untuned default
  is 128 x 128 x 128); where libtpu cannot estimate it at its table's blocks (e.g. they overflow VMEM in the profiling
  compile), at our blocks. The row's config in the JSON names the blocks and why. Its ``get_tpu_version()`` answers the target chip
  (:func:`tpukernels.bench.paged_attention.tpu_inference_generation`), its VMEM limit is its table's for the
  generation (96 MiB where it has none). No w4a16 column: its blockwise kernel's 4-bit case is fp8 activations with
  ``float4_e2m1fn`` weights (tpu7x), not int4 weights with bf16 activations. libtpu 0.0.52 cannot estimate most of its
  activation-quantizing programs (its LLO type check fails on the fp8 operands on every chip and on the int8 ones on
  v6e; :data:`TPU_INFERENCE_NOT_ESTIMABLE`): those rows show the roofline floor.
* ``tpukernels bf16 matmul``: ``matmul_nt`` on bf16 ``x`` and a bf16 ``W`` (the unquantized layer). Its
  figure is ``max(its estimate, its own HBM roofline)`` with 2-byte weights, since the case's ``hbm_bytes``
  (what the quantized op must move: 1-byte weights) would undercount it. Estimated at full size.

libtpu 0.0.52's static profiler aborts on some of XLA's programs (``llo_execution_graph.cc``; e.g. the
w8a16 down-projection); those XLA rows show the roofline as a **floor** (a lower bound, marked as such).

Peak FLOP/s for the roofline: jax's ``tpu_info`` ``int8_ops_per_second`` / ``fp8_ops_per_second`` for w8a8
cases (:func:`tpukernels.perf.peak_flops`; v5e int8 3.94e14 = 2x bf16, v6e int8 1.84e15 = 2x bf16, tpu7x
fp8 2.3e15 per core = 2x bf16), the bf16 peak for w8a16 (which runs on the bf16 MXU). The int8 / bf16 speed-up
the hardware allows is therefore 2x on every chip for the MXU-bound prefill shapes; w8a16's gain is in the
HBM-bound decode shapes (half the weight bytes).

Bytes: ``x`` once (2 B), ``w_q`` once (1 B), scales, output once (2 B); FLOPs ``2*M*N*K``.

Block-scaled rows (``quantized_matmul_blockwise``, group 128): ``w4a16 int4 g128`` at the decode shapes on every
chip (int4 weights packed along N, weight format ``"int4n"``, 0.5 B each, symmetric, f32 scales ``[K/128, 1, N]``;
XLA: unpack, dequantize to bf16, one dot), and ``fp8 block <dtype> 1x128/128x128`` at the prefill shapes (DeepSeek-V3's scheme: ``x_quant="fp8"``,
the chip's fp8 pair — float8_e4m3fn where jax's tpu_info has it, else float8_e5m2; ours is
what the public op runs: on v6e / tpu7x ``quantize_per_block_kernel(..., dequantize=True)`` (x' in bf16) +
``quantized_matmul_blockwise_a8_prefill_kernel``, on v5e ``quantize_per_block_kernel`` +
``quantized_matmul_blockwise_a8_kernel`` (group form), the quantize pass at its HBM roofline
where libtpu cannot estimate its fp8 pack; XLA: the same quantization in jnp, dequantized operands, one bf16 dot).

Prefill cases (8192 tokens) are estimated at 2048 tokens and scaled by 4 for every implementation (the
token axis is an independent, uniform parallel grid axis; tpukernels keeps the config a full-size call gets),
which makes the family ~4x cheaper to estimate on 2 cores — except the fused w8a8 kernel, estimated at full
size: its first row block is loaded and quantized before the MXU starts (later ones are prepared during the
previous block), so its token axis is not uniform and a scaled 2048-token figure would overstate it.
"""

from __future__ import annotations

from .core import Case, EstimateError, Impl, ours_impl, xla_impl

FAMILY = "quantized_matmul"
#: library modules whose code and tuning data the figures depend on (the bf16 comparison row is our matmul;
#: ``vmem``: the scoped-VMEM request)
LIBRARY = ("quantized_matmul_ops", "matmul_ops", "vmem")
#: bench modules the cases import (``paged_attention``: :func:`tpu_inference_generation`)
BENCH = ("paged_attention",)

_FUSED = ("the activation quantization is fused (quantized_matmul_w8a8_kernel: x read once as bf16, no x_q in HBM; "
          "before the fusion this op was 0.84-0.88x XLA on v6e). What is left, from the estimates: row block 0 is "
          "loaded and quantized before the first dot (a serial prologue, ~28 µs on v6e at K = 14336 with the earlier "
          "division formula: the intercept of 213 / 398 / 767 µs at 2048 / 4096 / 8192 tokens), and each later row "
          "block's absmax + quantization, run beside the previous block's dots, is only partly hidden under the MXU: "
          "it is vector work proportional to K, and the down-projection's 14336-wide rows make it 3.5x the "
          "up-projection's for the same MXU time per block. Multiplying by a per-row reciprocal instead of dividing "
          "per element and taking the absmax in bf16 cut it (v6e, 2048 tokens, K = 14336: 213.0 -> 204.1 µs; 193.7 "
          "with the next block's quantization switched off, earlier kernel)")
_FLOOR = " XLA's figure is its roofline, a floor (libtpu aborts on XLA's program)"
_W8A16 = ("MXU-bound: ours is 95-98% of the bf16 roofline (shipped blocks chosen from full-program estimates, "
          "bm=1024 with bn=2048); XLA's figure here is that roofline itself, a floor that no estimate reaches "
          "(libtpu aborts on XLA's program). The int8 -> bf16 conversion costs ~1% (libtpu, 2048x4096x14336 at 1024 "
          "blocks: w8a16 298.2 µs vs bf16 295.6 µs on v6e)")
_DECODE_7X = ("decode on tpu7x: 75-77% of the HBM roofline (XLA's figure is that roofline, a floor: libtpu aborts on "
              "XLA's program). Bound by the MXU's intake of bf16 weights, not by HBM: every int8 weight is converted "
              "and passes the bf16 MXU once (~1200 per cycle in libtpu's model, 2.6e12/s, below the 3.7e12 1-byte "
              "weights/s tpu7x's HBM delivers); the same dots with the weights resident in VMEM take 22.4 µs "
              "(16 tokens; bf16 weights, no conversion: 23.8 µs), fp8 weights fed natively (bf16 x fp8) make the "
              "whole kernel 12.3 µs (HBM-bound). XLA's program converts and multiplies the same weights on the same "
              "MXU")
_DECODE = ("decode: the weight-streaming launch (w_q copied by the kernel, two DMAs in flight per tile) is below the "
           "HBM roofline in libtpu's cycles, so the model time is the roofline, as XLA's; the blocked launch (one DMA "
           "in flight) was 0.93-0.95x XLA: libtpu left a third of its weight DMA time exposed")

_W4A16 = ("w4a16 decode, int4 packed along N (weight format int4n, TPUBlockQuantLinear's default): the kernel "
          "unpacks each weight tile with Mosaic's native uint8 -> int4 bitcast + convert to bf16 (rows 2i / 2i + 1 "
          "of a byte row), which replaced the K-packed unpack (uint8 -> int32, mask / shift, -8, -> bf16, one "
          "element per 32-bit lane) that made the kernel vector-bound: v6e 54.8 -> 28.7 µs at 16 tokens, 74.3 -> "
          "37.6 at 64; tpu7x 39.0 -> 22.0 and 56.4 -> 29.4; v5e 93.0 -> 48.4 and 102.4 -> 48.9 (libtpu estimates). "
          "Blocks: at <= 16 tokens the block-diagonal decode form (all groups' partial sums from one dot, bk=1024: "
          "128 rows) with the fewest N blocks of <= 8192 columns (per-step overhead dominates: bn=2048 33.3 µs on "
          "v6e, 7168 28.7), except v5e (its MXU has no room for the form: per-group dots, bk=4096, bn=1024); at "
          "64 tokens per-group dots, bk=4096, bn=1024. What is left is the per-group structure (a dot of 128 "
          "columns and a scale multiply per group) and, on tpu7x, its bf16-fed MXU (~22 µs to ingest these 58.7M "
          "weights as bf16, the w8a16 rows' reason): 1.5x the bf16 matmul there (22 µs at 16 tokens) is that floor, "
          "and 85% of the 8.6 µs roofline needs the weights fed as fp8, which libtpu 0.0.52's estimator cannot "
          "model. XLA's figure is its roofline, a floor: libtpu aborts on XLA's unpack + dot program")
_FP8_BLOCK = ("fp8 block-scaled prefill (1x128 activations, 128x128 weights). v6e / tpu7x (issue 40): "
              "the quantization pass writes the dequantized activations x' = bf16(x_q * x_scale) and "
              "quantized_matmul_blockwise_a8_prefill_kernel dequantizes only the weight tile per K step (the same "
              "values as the dequant form below, bit for bit; kernel alone, up projection: v6e 1,447 -> 1,120 us, "
              "tpu7x 1,111 -> 894 us against the bf16 matmul's 888). Down projection (several K steps), this "
              "round: a dot per accumulator branch, as the matmul kernel (Mosaic fuses the accumulation into the "
              "matmul), kernel alone v6e 1,256 -> 1,144 us, tpu7x 1,122 -> 944 us (bn 512 -> 1024); its pass moves "
              "3.5x the up projection's activation bytes, 286 us of v6e's total. Fusing the pass into the kernel "
              "(benchmarks/probes/fp8_fused_quant_probe.py, the fp8 rounding emulated exactly: libtpu 0.0.52 cannot "
              "estimate the f32 -> fp8 convert) costs as much vector work as the pass saves (v6e down: 1,425 vs "
              "1,430 us), and native fp8 x fp8 with 128-deep scale blocks spends more "
              "VPU time rescaling partial sums than the bf16 dot it replaces, so >= 1.3x bf16 on tpu7x is not "
              "reachable in this model (blockwise_a8 docstring). Before: the dequant form "
              "(both tiles dequantized to bf16 in VMEM, one bf16 dot per K step, bk up to 4096): v6e's fp8 rate "
              "equals its bf16 rate (tpu_info), so its roofline is reachable, and what is left is the VPU's "
              "dequantization (a cost probe with static scale columns reached 1,403 us of 1,046: benchmarks/probes/fp8_dequant_cost_probe.py); on tpu7x the bf16 "
              "MXU caps it at half the fp8 peak, and fp8 x fp8 needs the group form: one 128-deep dot per group "
              "with its partial sum scaled by x_scale[m, g] * w_scale[g, n], three f32 vector ops per output and "
              "group, which bound it on the VPU (2,073 us in this row before the dequant form). At K = 14336 the K step "
              "is 3584 (4 steps: each picks its scale columns at a dynamic lane). v5e (no fp8 rate in tpu_info; "
              "libtpu aborts on the dequant form there) keeps the group form. The per-block activation "
              "quantization is a separate kernel (x read once as bf16, x_q written once, 3 B per activation; "
              "v6e / tpu7x: x' written in bf16, 4 B)")

#: why tpukernels is slower where it is (from the estimates; see the module docstring)
REASONS: dict = {
    **{(c, "w8a8 int8", s): _FUSED for c in ("v5e", "v6e")
       for s in ("8192x4096 @ (14336x4096).T", "8192x14336 @ (4096x14336).T")},
    ("v5e", "w8a8 int8", "8192x14336 @ (4096x14336).T"): _FUSED + ";" + _FLOOR,
    **{(c, "w8a16 int8", s): _W8A16 for c in ("v5e", "v6e", "tpu7x")
       for s in ("8192x4096 @ (14336x4096).T", "8192x14336 @ (4096x14336).T")},
    **{("tpu7x", "w8a16 int8", s): _DECODE_7X
       for s in ("16x4096 @ (14336x4096).T", "64x4096 @ (14336x4096).T", "64x14336 @ (4096x14336).T")},
    **{(c, "w8a16 int8", s): _DECODE
       for c in ("v5e", "v6e") for s in ("16x4096 @ (14336x4096).T", "64x4096 @ (14336x4096).T",
                                         "64x14336 @ (4096x14336).T")},
    **{("tpu7x", "w8a8 float8_e4m3fn", s): "no tpukernels figure: libtpu 0.0.52's static profiler dies on the "
       "fused kernel's f32 -> fp8 pack (vpack.c.f32.eXmY), as it does on the separate quantize pass and aborted "
       "on the unfused fp8 x fp8 matmul (fifo_tracker.cc); the kernel compiles "
       "(tests/test_quantized_matmul.py::test_compile_only_fused_w8a8)"
       for s in ("8192x4096 @ (14336x4096).T", "8192x14336 @ (4096x14336).T")},
}


_TI_LLO = ("not estimated: libtpu 0.0.52's profiling compile of tpu-inference's {what} fails its LLO type check on the "
           "{dtype} operands ({msg}, tried 2026-12-07) and writes ~10 GB of libtpu logs per attempt (a failed estimate is "
           "cached, the logs are not worth writing again)")
#: tpu-inference 0.32.0's quantized matmul where libtpu 0.0.52's static estimate of it fails (op prefix, chip) -> why;
#: its row is the roofline floor. Its int8 w8a8 kernel fails the same check on v6e, logging little: that one is
#: attempted (the failure is cached, the row keeps its error)
TPU_INFERENCE_NOT_ESTIMABLE = {
    ("fp8 block", "v5e"): _TI_LLO.format(what="blockwise kernel", dtype="float8_e5m2",
                                         msg="'Expected vector-bf16packed, got vector-int16' at a vunpack"),
    ("fp8 block", "v6e"): (
        "not estimated: the v6e attempt at tpu-inference's blockwise kernel (2048 tokens, bm=1024, bn=1024, bk=4096, "
        "2026-12-07) was stopped when libtpu's logs filled the disk; the same float8_e5m2 kernel fails libtpu "
        "0.0.52's LLO type check on v5e"),
    ("fp8 block", "tpu7x"): _TI_LLO.format(what="blockwise kernel", dtype="float8_e4m3fn",
                                           msg="'Expected vector-int16, got vector-f8packed'"),
    ("w8a8 float8_e4m3fn", "tpu7x"): _TI_LLO.format(what="w8a8 kernel", dtype="float8_e4m3fn",
                                                    msg="'Expected vector-int16, got vector-f8packed'"),
}
TPU_INFERENCE = "tpu-inference quantized_matmul"


def tpu_inference_blocks(T, generation: int, M: int, N: int, K: int, x_q: str | None, wdt: str):
    """``(TunedValue | None, source)``: the blocks tpu-inference 0.32.0's quantized matmul takes for the row, from its
    tuned table (``T``: its ``tuned_block_sizes`` module) at the full problem: its entry for the row's dtypes, else
    its entry for the same chip and shape with 1-byte weights in another activation dtype (it tunes only w8a8: int8
    on v6e, fp8 on tpu7x; it has no w8a16 entry, where its default would be 128 x 128 x 128); None where it has
    neither (then the bench uses our blocks, module docstring)."""
    import jax.numpy as jnp

    want = jnp.dtype(x_q or "bfloat16").name
    hits = [(k, v) for k, v in T.TUNED_BLOCK_SIZES.items() if (k.tpu_version, k.n_batch, k.n_out, k.n_in) ==
            (generation, M, N, K) and jnp.dtype(k.w_q_dtype).itemsize == jnp.dtype(wdt).itemsize]
    exact = [v for k, v in hits if (k.x_q_dtype, k.w_q_dtype) == (want, wdt)]
    if exact:
        return exact[0], "its tuned table"
    if hits:
        k, v = sorted(hits)[0]
        return v, f"its tuned table's {k.x_q_dtype} x {k.w_q_dtype} entry"
    return None, ""


def tpu_inference_impl(M: int, Me: int, K: int, N: int, x_q: str | None, wdt: str, op: str, ours, scale: int,
                       floor_us, block_size: int | None = None) -> Impl:
    """tpu-inference 0.32.0's ``quantized_matmul_kernel`` (``block_size``: its blockwise kernel, weight scales
    ``[K / block_size, 1, N]``, activations quantized per ``1 x block_size`` inside the kernel) at ``Me`` of the
    row's ``M`` tokens, scaled by ``scale``; ``x_q``: the activation dtype it quantizes to (None: w8a16);
    ``ours``: ``(kernel, full args, kwargs)`` of our call, whose blocks it takes where its tuned table has none or
    libtpu cannot estimate it at its table's blocks (e.g. they overflow VMEM in the profiling compile; the config
    says so)."""
    def cycles(est, chip):
        import contextlib
        from unittest import mock

        import jax
        import jax.numpy as jnp

        from .._imports import import_tpu_inference
        from ..chips import get_chip
        from .core import kernel_program
        from .paged_attention import tpu_inference_generation

        why = next((w for (p, c), w in TPU_INFERENCE_NOT_ESTIMABLE.items() if op.startswith(p) and c == chip), None)
        if why:
            raise EstimateError(why)
        mod = import_tpu_inference(f"kernels.quantized_matmul.{'blockwise_kernel' if block_size else 'kernel'}",
                                   "quantized matmul")
        T = import_tpu_inference("kernels.quantized_matmul.tuned_block_sizes", "quantized matmul")
        gen = get_chip(chip).generation
        cfg = kernel_program(ours[0], chip, ours[1], ours[2])[2]
        mine = T.TunedValue(int(cfg["bm"]), int(cfg["bn"]), int(cfg["bk"]))
        tv, source = tpu_inference_blocks(T, gen, M, N, K, x_q, wdt)
        tries = [(tv, source)] * (tv is not None) + [(mine, "our blocks")] * (tv != mine)
        vmem = T.DEVICE_VMEM_LIMIT.get(gen, 96 << 20)  # its get_device_vmem_limit(), without its vllm warning
        xqd = None if x_q is None else getattr(jnp, wdt)
        s_shape = (K // block_size, 1, N) if block_size else (N,)
        structs = [jax.ShapeDtypeStruct((Me, K), jnp.bfloat16), jax.ShapeDtypeStruct((N, K), getattr(jnp, wdt)),
                   jax.ShapeDtypeStruct(s_shape, jnp.float32)]
        failed = []
        for tv, source in tries:
            tv = tv._replace(batch_block_size=min(tv.batch_block_size, Me))
            blocks = f"batch_block_size={tv.batch_block_size},out_block_size={tv.out_block_size},in_block_size=" \
                     f"{tv.in_block_size}"

            def tpu_inference_qmm(x, w, s, tv=tv):
                with contextlib.ExitStack() as stack:
                    stack.enter_context(tpu_inference_generation(T, chip))
                    stack.enter_context(mock.patch.object(mod, "get_device_vmem_limit", lambda: vmem))
                    if block_size:
                        return mod.quantized_matmul_kernel(x, w, s, block_size=block_size, x_q_dtype=xqd,
                                                           tuned_value=tv)
                    return mod.quantized_matmul_kernel(x, w, s, x_q_dtype=xqd, tuned_value=tv)

            try:
                cyc = est.cycles(jax.jit(tpu_inference_qmm), structs, chip)
            except EstimateError as e:  # e.g. its table's blocks overflow VMEM in libtpu's profiling compile
                failed.append(f"{source} ({blocks}): {str(e)[:160]}")
                continue
            note = f" (libtpu could not estimate {'; '.join(failed)})" if failed else ""
            return cyc * scale, f"{blocks},source={source}{note}"
        raise EstimateError("; ".join(failed))

    return Impl(TPU_INFERENCE, "public", cycles, floor_us=floor_us)


def _mk(text):
    return tuple(int(d) for d in text.split(":")[0].split("x"))


def cases(chips) -> list[Case]:
    import sys

    import jax
    import jax.numpy as jnp
    from jax import lax

    import tpukernels.library  # noqa: F401

    from ..perf import clock_hz, hbm_bandwidth, model_time

    qmm = sys.modules["tpukernels.library.quantized_matmul_ops"]
    mm = sys.modules["tpukernels.library.matmul_ops"]
    bf16, f32 = jnp.bfloat16, jnp.float32
    shapes = []  # (M, K, N, prefill?)
    for _, args, _ in qmm.STANDARD_CASES:
        (M, K), (N, _) = _mk(args[0]), _mk(args[1])
        if (M, K, N) not in [s[:3] for s in shapes]:
            shapes.append((M, K, N, M >= 1024))

    def xla_w8a16(x, w, s):
        z = lax.dot_general(x, w.astype(bf16), (((1,), (1,)), ((), ())), preferred_element_type=f32)
        return (z * s).astype(bf16)

    def xla_w8a8(qdt):
        qm = qmm.qmax(qdt)

        def fn(x, w, s):
            x32 = x.astype(f32)
            xs = jnp.max(jnp.abs(x32), axis=1, keepdims=True) * jnp.float32(1.0 / qm)
            q = x32 * jnp.where(xs == 0, 0.0, 1.0 / jnp.where(xs == 0, 1.0, xs))  # the library's formula
            if qdt == "int8":
                xq, acc = jnp.clip(jnp.round(q), -qm, qm).astype(jnp.int8), jnp.int32
            else:
                xq, acc = jnp.clip(q, -qm, qm).astype(getattr(jnp, qdt)), f32
            z = lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)
            return (z.astype(f32) * s * xs).astype(bf16)

        return jax.jit(fn)

    def bf16_impl(M, K, N):
        # full size (the matmul family's 8192x4096 -> 14336 estimate is shared through the cache; a reduced
        # 2048-token problem at the full problem's tpu7x config runs out of VMEM in XLA:TPU)
        part = ours_impl([(mm.matmul_nt, (f"1x{M}x{K}:bf16", f"1x{N}x{K}:bf16"), {})])

        def cycles(est, chip):
            cyc, cfg = part.cycles(est, chip)
            own_bytes = (M * K + N * K + M * N) * 2
            floor = own_bytes / hbm_bandwidth(chip) * clock_hz(chip)
            return max(int(cyc), int(floor)), cfg

        return Impl("tpukernels bf16 matmul", "public", cycles)

    def quantize_cycles(part, Me, K, nbytes=3):
        # the per-token quantize pass of w8a8; libtpu 0.0.52's static profiler aborts on its f32 -> fp8
        # pack (``vpack.c.f32.eXmY``, tpu7x): there the pass counts at its HBM roofline (read bf16 x,
        # write the 1-byte x_q: ``nbytes`` = 3 per element; 4 for the fp8 prefill's bf16 x'), a lower bound, and
        # the row's reason says so
        def f(est, chip):
            try:
                return ours_impl([part]).cycles(est, chip)[0]
            except EstimateError:
                return int(Me * K * nbytes / hbm_bandwidth(chip) * clock_hz(chip))

        return f

    def floor(M, K, N, dtype):
        # where libtpu's static profiler aborts on XLA's program: the roofline, a lower bound (labelled a floor)
        def f(chip):
            return model_time(chip, None, M * K * 2 + N * K + M * N * 2, 2 * M * N * K, dtype).roofline_us

        return f

    def fused_config(M, K, N, wdt, chip):
        # the blocks quantized_matmul's w8a8 path takes on ``chip`` (fused_plan at the config the fused
        # kernel resolves to), None where it takes the two-kernel path
        from ..chips import get_chip
        from ..dsl import TensorSpec

        specs = (TensorSpec((M, K), bf16, "x"), TensorSpec((N, K), getattr(jnp, wdt), "w_q"),
                 TensorSpec((1, N), f32, "w_scale"))
        ch = get_chip(chip)
        cfg, _ = qmm.quantized_matmul_w8a8_kernel.resolve_config(specs, (("out_dtype", None),), None, ch)
        return qmm.fused_plan(M, K, N, bf16, getattr(jnp, wdt), bf16, int(cfg["bm"]), int(cfg["bk"]), int(cfg["bn"]),
                              ch)

    out = []
    for M, K, N, prefill in shapes:
        scale = 4 if prefill else 1
        Me = M // scale  # the token count estimated
        x_s, xe_s, ws_s = f"{M}x{K}:bf16", f"{Me}x{K}:bf16", f"1x{N}:f32"
        sx = jax.ShapeDtypeStruct((Me, K), bf16)
        sws = jax.ShapeDtypeStruct((1, N), f32)
        for chip in chips:
            modes = qmm.supported_modes(chip)
            wanted = [(None, "int8")]
            if prefill:
                wanted.append(("int8", "int8") if ("int8", "int8") in modes else ("fp8", "float8_e4m3fn"))
            for xq, wdt in wanted:
                if (xq, wdt) not in modes:
                    continue
                w_s = f"{N}x{K}:{wdt}"
                sw = jax.ShapeDtypeStruct((N, K), getattr(jnp, wdt))
                if xq is None:
                    extra = None
                    parts = [(qmm.quantized_matmul_kernel, (xe_s, w_s, ws_s), {}, (x_s, w_s, ws_s))]
                    xla = xla_impl(jax.jit(xla_w8a16), [sx, sw, sws], name="xla int8 dot", scale=scale,
                                   floor_us=floor(M, K, N, "bfloat16"))
                    op, dtype = f"w8a16 {wdt}", "bfloat16"
                    ours = (qmm.quantized_matmul_kernel, (x_s, w_s, ws_s), {})
                else:
                    cfg = fused_config(M, K, N, wdt, chip)
                    own_scale = scale
                    if cfg is not None:  # the fused kernel (what quantized_matmul runs here), at full size
                        parts, extra, own_scale = [(qmm.quantized_matmul_w8a8_kernel, (x_s, w_s, ws_s), {})], None, 1
                        ours = parts[0]
                    else:
                        xq_s, xqe_s = f"{M}x{K}:{wdt}", f"{Me}x{K}:{wdt}"
                        parts = [(qmm.quantized_matmul_kernel, (xqe_s, w_s, ws_s, f"{Me}x1:f32"), {},
                                  (xq_s, w_s, ws_s, f"{M}x1:f32"))]
                        ours = (qmm.quantized_matmul_kernel, (xq_s, w_s, ws_s, f"{M}x1:f32"), {})
                        extra = quantize_cycles((qmm.quantize_per_token_kernel, (xe_s, wdt), {}, (x_s, wdt)), Me, K)
                    xla = xla_impl(xla_w8a8(wdt), [sx, sw, sws], name=f"xla {'int8' if wdt == 'int8' else 'fp8'} dot",
                                   scale=scale, floor_us=floor(M, K, N, wdt))
                    op, dtype = f"w8a8 {wdt}", wdt
                out.append(Case(
                    FAMILY, op, f"{M}x{K} @ ({N}x{K}).T", chip,
                    hbm_bytes=M * K * 2 + N * K + M * N * 2 + 4 * (N + M), flops=2 * M * N * K, dtype=dtype,
                    impls=[ours_impl(parts, scale=scale if xq is None else own_scale, extra=extra), xla,
                           tpu_inference_impl(M, Me, K, N, None if xq is None else wdt, wdt, op, ours, scale,
                                              floor(M, K, N, dtype)),
                           bf16_impl(M, K, N)]))
        for chip in chips:
            out.extend(_block_cases(qmm, M, K, N, prefill, scale, chip, bf16_impl, quantize_cycles))
    return out


#: group (block) size of the block-scaled rows: 128 (GPTQ / AWQ's common group size; DeepSeek-V3's block)
BS = 128


def _block_cases(qmm, M, K, N, prefill, scale, chip, bf16_impl, quantize_cycles):
    """Rows of the block-scaled kernels (``quantized_matmul_blockwise``): w4a16 (int4, symmetric, group 128) at the
    decode shapes on every chip; fp8 x fp8 with 1x128 activation / 128x128 weight blocks (``x_quant="fp8"``) at the
    prefill shapes with the chip's fp8 pair (float8_e4m3fn where jax's tpu_info has it, else float8_e5m2)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from ..perf import model_time

    from ..chips import get_chip
    from ..library.quantized_matmul_ops.blockwise_a8 import prefill_form

    bf16, f32 = jnp.bfloat16, jnp.float32
    G = K // BS

    def roof(hbm_bytes, dtype):  # XLA's figure where libtpu aborts on its program: the roofline, a floor
        return lambda ch: model_time(ch, None, hbm_bytes, 2 * M * N * K, dtype).roofline_us

    Me = M // scale
    shape = f"{M}x{K} @ ({N}x{K}).T"
    if not prefill:
        def xla_w4a16(x, w, s):  # unpack (int4n: rows 2i / 2i + 1 per byte row), dequantize to bf16, one dot
            b = w.astype(jnp.int32)
            q = jnp.stack([(b & 15) ^ 8, (b >> 4) ^ 8], axis=1).reshape(N, K).astype(f32) - 8
            W = (q * jnp.repeat(s[:, 0, :].T, BS, axis=1)).astype(bf16)
            return lax.dot_general(x, W, (((1,), (1,)), ((), ())), preferred_element_type=f32).astype(bf16)

        structs = [jax.ShapeDtypeStruct((M, K), bf16), jax.ShapeDtypeStruct((N // 2, K), jnp.uint8),
                   jax.ShapeDtypeStruct((G, 1, N), f32)]
        part = (qmm.quantized_matmul_blockwise_kernel, (f"{M}x{K}:bf16", f"{N // 2}x{K}:u8", f"{G}x1x{N}:f32", None),
                {"block_size": BS, "weight_format": "int4n"})
        hb = M * K * 2 + N * K // 2 + 4 * G * N + M * N * 2
        return [Case(FAMILY, "w4a16 int4 g128", shape, chip, hbm_bytes=hb, flops=2 * M * N * K, dtype="bfloat16",
                     impls=[ours_impl([part]), xla_impl(jax.jit(xla_w4a16), structs, name="xla int4 dequant + dot",
                                                        floor_us=roof(hb, "bfloat16")),
                            bf16_impl(M, K, N)])]
    modes = qmm.supported_modes(chip)
    f8 = next((d for d in ("float8_e4m3fn", "float8_e5m2") if ("fp8", d) in modes), None)
    if f8 is None:
        return []
    fdt = getattr(jnp, f8)

    def xla_fp8_block(x, w, s):  # per-block quantization of x, dequantized operands, one bf16 dot
        x3 = x.astype(f32).reshape(Me, G, BS)
        xs = jnp.max(jnp.abs(x3), axis=2, keepdims=True) * jnp.float32(1.0 / qmm.qmax(f8))
        xq = jnp.clip(x3 * jnp.where(xs == 0, 0.0, 1.0 / jnp.where(xs == 0, 1.0, xs)), -qmm.qmax(f8), qmm.qmax(f8))
        xd = (xq.astype(fdt).astype(f32) * xs).reshape(Me, K).astype(bf16)
        W = (w.astype(f32) * jnp.repeat(jnp.repeat(s, BS, axis=0)[:N], BS, axis=1)).astype(bf16)
        return lax.dot_general(xd, W, (((1,), (1,)), ((), ())), preferred_element_type=f32).astype(bf16)

    structs = [jax.ShapeDtypeStruct((Me, K), bf16), jax.ShapeDtypeStruct((N, K), fdt),
               jax.ShapeDtypeStruct((N // BS, G), f32)]
    w_s, s_s = f"{N}x{K}:{f8}", f"{G}x1x{N}:f32"
    if prefill_form(M, f8, "fp8", get_chip(chip)):  # what the public op runs here: x dequantized by the quantize pass
        parts = [(qmm.quantized_matmul_blockwise_a8_prefill_kernel, (f"{Me}x{K}:bf16", w_s, s_s), {"block_size": BS},
                  (f"{M}x{K}:bf16", w_s, s_s))]
        ours = (parts[0][0], parts[0][3], parts[0][2])
        extra = quantize_cycles((qmm.quantize_per_block_kernel, (f"{Me}x{K}:bf16", f8, BS, True), {},
                                 (f"{M}x{K}:bf16", f8, BS, True)), Me, K, nbytes=4)
    else:
        parts = [(qmm.quantized_matmul_blockwise_a8_kernel, (f"{Me}x{K}:{f8}", f"{Me}x{G}:f32", w_s, s_s, None),
                  {"block_size": BS}, (f"{M}x{K}:{f8}", f"{M}x{G}:f32", w_s, s_s, None))]
        ours = (parts[0][0], parts[0][3], parts[0][2])
        extra = quantize_cycles((qmm.quantize_per_block_kernel, (f"{Me}x{K}:bf16", f8, BS), {},
                                 (f"{M}x{K}:bf16", f8, BS)), Me, K)
    hb = M * K * 2 + N * K + 4 * G * N + M * N * 2
    return [Case(FAMILY, f"fp8 block {f8} 1x128/128x128", shape, chip, hbm_bytes=hb, flops=2 * M * N * K, dtype=f8,
                 impls=[ours_impl(parts, scale=scale, extra=extra),
                        xla_impl(jax.jit(xla_fp8_block), structs, name="xla fp8 dequant + dot", scale=scale,
                                 floor_us=roof(hb, f8)),
                        tpu_inference_impl(M, Me, K, N, f8, f8, f"fp8 block {f8}", ours, scale, roof(hb, f8),
                                           block_size=BS),
                        bf16_impl(M, K, N)])]


def reason(row: dict) -> str | None:
    if row["op"].startswith("w4a16"):
        return _W4A16
    if row["op"].startswith("fp8 block"):
        return _FP8_BLOCK
    return REASONS.get((row["chip"], row["op"], row["shape"]))


def merge_rows(prefixes, chips, results_dir: str = "benchmarks/results", log=print) -> int:
    """Estimate only the cases whose op starts with one of ``prefixes`` and merge their rows into
    ``<results_dir>/quantized_matmul.json`` (rows of the same chip / op / shape / implementation replaced; the file is
    rewritten after each case, so an interrupted run keeps what it has). The other rows and the file's header
    (versions, source digest, date) are left as they were: a full ``tpukernels bench --family quantized_matmul``
    remakes them. Returns the number of rows written. Estimates come from the shared cache like the CLI's."""
    import json
    import os

    from . import attach_reasons
    from .core import Estimator, _atomic_write_json, default_cache_path, run_case

    path = os.path.join(results_dir, f"{FAMILY}.json")
    with open(path) as f:
        res = json.load(f)
    est = Estimator(default_cache_path())
    todo = [c for p in prefixes for c in cases(list(chips)) if c.op.startswith(p)]
    n = 0
    for c in todo:
        rows = attach_reasons(FAMILY, run_case(c, est, log))
        keys = {(r["chip"], r["op"], r["shape"], r["impl"]) for r in rows}
        res["rows"] = [r for r in res["rows"] if (r["chip"], r["op"], r["shape"], r["impl"]) not in keys] + rows
        _atomic_write_json(path, res)
        n += len(rows)
    return n


if __name__ == "__main__":  # python -m tpukernels.bench.quantized_matmul OP_PREFIXES [CHIPS]
    import sys

    import tpukernels.library  # noqa: F401

    print(merge_rows(sys.argv[1].split(","), (sys.argv[2] if len(sys.argv) > 2 else "v5e,v6e,tpu7x").split(",")),
          "rows merged")
