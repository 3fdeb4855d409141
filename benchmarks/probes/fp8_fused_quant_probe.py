"""Model estimate (libtpu static estimated_cycles + rooflines, NOT a measurement) of fusing the fp8 block-scaled
prefill path's activation quantization into the matmul kernel, at the Llama-3-8B down projection
``8192x14336 @ (4096x14336)^T`` on v6e (float8_e5m2, 1x128 activation blocks, 128x128 weight blocks; estimated
at 1/4 of the rows and scaled x4), blocks ``bm=1024, bk=2048, bn=4096`` (one column block, so each activation
is quantized once), a dot per accumulator branch as the shipped prefill kernel. What the public op runs
instead: ``quantize_per_block_kernel(..., dequantize=True)`` (an HBM-bound pass, 286 us in the v6e bench row)
feeding ``quantized_matmul_blockwise_a8_prefill_kernel`` (1,144 us at its 1024 / 2048 / 2048:
benchmarks/probes/fp8_prefill_forms.py ``PREFILL=1 DOWN=1``).

    .venv/bin/python benchmarks/probes/fp8_fused_quant_probe.py QUANT WEIGHTS  # QUANT: none|noround|magic|exact
    .venv/bin/python benchmarks/probes/fp8_fused_quant_probe.py check          # the roundings, bit for bit

``QUANT``: ``none`` = the activations enter the dot as given (no quantization: the floor); ``noround`` = the
block absmax, scale, reciprocal, clip and rescale of the quantization but no rounding to the fp8 grid;
``magic`` / ``exact`` = all of it, the fp8 rounding emulated by float adds (:func:`fp8_round_magic`) or by
integer ops on the bits (:func:`fp8_round`). The f32 -> fp8 convert itself cannot be estimated: libtpu
0.0.52's profiler fails on tpu7x's ``vpack.c.f32.eXmY``, and on v6e an integer add on a bitcast vreg fails
its type check (``Expected vector-int32, got vector-f32 ... vadd.s32``), which both forms here avoid.
``WEIGHTS``: ``fp8`` = each weight tile dequantized in VMEM per step (as the prefill kernel); ``bf16`` = the
weights dequantized beforehand (that pass not counted).

Figures (2026-12-08, libtpu 0.0.52, v6e, us): fp8 weights: none 1,136, noround 1,374, magic 1,425, exact
1,775; bf16 weights: none 1,138, magic 1,410. The weight tile's dequantization is hidden under the MXU (fp8
and bf16 weights estimate alike), but the activations' quantization is not: the step's dot waits for the
whole quantized tile, and its vector work (+238 us without rounding, +289 / +640 with it) matches or exceeds
the separate pass's 286 us of HBM time, so it is not shipped (v6e: 1,425 fused vs 286 + 1,144 = 1,430; on
tpu7x the pass is cheaper still, ~127 us at its HBM bandwidth). ``check``: both roundings equal XLA's
f32 -> fp8 convert bit for bit on 20M random f32 values plus every tie and its neighbours on the fp8 grids
(both dtypes).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout
for _k, _v in (("JAX_PLATFORMS", "cpu"), ("TPU_ACCELERATOR_TYPE", "v5litepod-1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
               ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(_k, _v)
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

FP8 = {"float8_e4m3fn": (448.0, 3, -6), "float8_e5m2": (57344.0, 2, -14)}  # qmax, mantissa bits, min exponent


def fp8_round(v, mb, emin):
    """Round-to-nearest-even of f32 ``v`` (``|v| <=`` the fp8 max) onto the fp8 grid, as f32: normal range by
    integer ops on the bits (keep ``mb`` mantissa bits), the subnormal range by ``round(v * 2^(mb - emin))``."""
    sh = 23 - mb
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    hi = bits >> sh
    half = (bits >> (sh - 1)) & 1
    sticky = ((bits << (33 - sh)) != 0).astype(jnp.uint32)
    normal = jax.lax.bitcast_convert_type((hi + (half & (sticky | (hi & 1)))) << sh, jnp.float32)
    sub = jax.lax.round(v * np.float32(2.0 ** (mb - emin)), jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    return jnp.where(jnp.abs(v) < np.float32(2.0 ** emin), sub * np.float32(2.0 ** (emin - mb)), normal)


def fp8_round_magic(v, mb, emin):
    """:func:`fp8_round` by float adds: ``(v + c) - c`` with ``c = 1.5 * 2^(23 - mb)`` times ``v``'s power of two
    (at least ``2^emin``) rounds to the fp8 grid in f32's own round-to-nearest-even (``c`` is data-dependent, so
    no compiler folds the pair), and ``v``'s sign bit is put back (``-0`` where fp8 gives it)."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    c = jnp.maximum(jax.lax.bitcast_convert_type(bits & np.uint32(0x7F800000), jnp.float32), np.float32(2.0 ** emin))
    c = c * np.float32(1.5 * 2.0 ** (23 - mb))
    r = jax.lax.bitcast_convert_type((v + c) - c, jnp.uint32) | (bits & np.uint32(0x80000000))
    return jax.lax.bitcast_convert_type(r, jnp.float32)


def quantized_tile(x_ref, quant, dt, bs=128):
    """``x' = bf16(fp8(x * r) * s)`` per ``1 x bs`` block (the package's formula), or its parts (``quant``); the
    ref sliced per block (a loaded tile sliced as a value costs ~35% more in libtpu's estimate)."""
    from tpukernels.library.quantized_matmul_ops.quantize import reciprocal

    if quant == "none":
        return x_ref[...]
    qm, mb, emin = FP8[dt]
    out = []
    for g in range(x_ref.shape[1] // bs):
        v = x_ref[:, g * bs:(g + 1) * bs]
        s = jnp.max(jnp.abs(v), axis=1, keepdims=True).astype(jnp.float32) * np.float32(1.0 / qm)
        q = jnp.clip(v.astype(jnp.float32) * reciprocal(s), -qm, qm)
        if quant in ("exact", "magic"):
            q = (fp8_round if quant == "exact" else fp8_round_magic)(q, mb, emin)
        out.append((q * s).astype(jnp.bfloat16))
    return jnp.concatenate(out, axis=1)


def program(quant, weights, dt="float8_e5m2", M=2048, N=4096, K=14336, bm=1024, bk=2048, bs=128):
    """The fused kernel (one column block: ``bn = N``) and its argument structs."""
    from tpukernels.library.quantized_matmul_ops.blockwise import accumulate_k_step

    n_sub, gk = bk // bs, K // bk

    def body(x_ref, w_ref, s_ref, o_ref, acc_ref):
        k = pl.program_id(2)
        def dequantized_w():  # as the prefill kernel's _w_dequant
            if weights == "bf16":
                return w_ref[...]
            ws = s_ref[...].reshape(n_sub, N).T
            return jnp.concatenate([(w_ref[:, g * bs:(g + 1) * bs].astype(jnp.float32) * ws[:, g:g + 1])
                                    .astype(jnp.bfloat16) for g in range(n_sub)], axis=1)

        def part():  # a dot per accumulator branch, as the prefill kernel (accumulate_k_step)
            return jax.lax.dot_general(quantized_tile(x_ref, quant, dt), dequantized_w(), (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)

        accumulate_k_step(part, k, gk, acc_ref, o_ref)

    f = pl.pallas_call(
        body, grid=(M // bm, 1, gk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)), pl.BlockSpec((N, bk), lambda i, j, k: (j, k)),
                  pl.BlockSpec((n_sub, 1, N), lambda i, j, k: (k, 0, j))],
        out_specs=pl.BlockSpec((bm, N), lambda i, j, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.bfloat16), scratch_shapes=[pltpu.VMEM((bm, N), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=100 << 20))
    wdt = jnp.bfloat16 if weights == "bf16" else getattr(jnp, dt)
    return jax.jit(f), [jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((N, K), wdt),
                        jax.ShapeDtypeStruct((K // bs, 1, N), jnp.float32)]


def check():
    rng = np.random.default_rng(1)
    for dt, (qm, mb, emin) in FP8.items():
        v = rng.integers(0, 2**32, size=20_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
        grid = np.concatenate([np.arange(-2**14, 2**14) * 2.0**-12, np.arange(-2**14, 2**14) * 2.0**-20,
                               np.arange(-2**16, 2**16) * 2.0**-3]).astype(np.float32)
        v = np.concatenate([v[np.isfinite(v)], grid, np.nextafter(grid, np.float32(np.inf)),
                            np.nextafter(grid, np.float32(-np.inf))])
        v = jnp.asarray(np.clip(v, -qm, qm).astype(np.float32))
        ref = np.asarray(jax.jit(lambda x: x.astype(getattr(jnp, dt)).astype(jnp.float32))(v)).view(np.uint32)
        for fn in (fp8_round, fp8_round_magic):
            got = np.asarray(jax.jit(lambda x: fn(x, mb, emin))(v)).view(np.uint32)
            print(dt, fn.__name__, v.size, "values,", int((ref != got).sum()), "differ from XLA's convert", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "check":
        check()
    else:
        from tpukernels.bench.core import Estimator
        from tpukernels.perf import model_time

        fn, structs = program(sys.argv[1], sys.argv[2])
        cyc = Estimator(cache_path=None).cycles(fn, structs, "v6e") * 4
        m = model_time("v6e", cyc, 4 * 2048 * 14336 * 2 + 4096 * 14336 + 4 * 2048 * 4096 * 2,
                       2 * 8192 * 4096 * 14336, dtype="float8_e5m2")
        print(sys.argv[1:], cyc, f"cycles; model {m.time_us:.1f} us (MXU roofline {m.compute_us:.1f})", flush=True)
