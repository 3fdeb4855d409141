"""Cost probe (model: libtpu static estimate, NOT a measurement; the kernel's values are not checked) of
fp8 1x128 / 128x128 block-scaled prefill written directly in Pallas, v6e: the per-group form (``MODE=grp``) vs
dequantizing both tiles to bf16 (``MODE=deqs``; ``deq`` the same through reshapes, ``deqw`` the weights only).
Static scale columns (``x_scale[:, :ns]``: wrong values, the cost of a static pick). The grid covers
``N // BN`` blocks: with BN not dividing 14336 it skips the tail (e.g. BN=4096 covers 12288 of 14336 columns, which
made an early figure too low), so compare BNs that divide N.

    BM=1024 BN=3584 BK=512 MODE=deqs .venv/bin/python benchmarks/probes/fp8_dequant_cost_probe.py v6e

2026-12-03 (v6e, M=2048 x 4): grp 2,429 us at 1024/2048/512; deqs 1,591 (1024/2048/512), 1,433 (2048/2048/512),
1,403 (1024/3584/512).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout
for _k, _v in (("JAX_PLATFORMS", "cpu"), ("TPU_ACCELERATOR_TYPE", "v5litepod-1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
               ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(_k, _v)
import time
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from tpukernels.bench.core import Estimator
from tpukernels.targets.compile_only import compile_only_env
from tpukernels.perf import model_time
compile_only_env()
SC = 4
M, K, N, G = 8192 // SC, 4096, 14336, 128
BM, BN, BK = int(os.environ.get("BM", 512)), int(os.environ.get("BN", 1024)), int(os.environ.get("BK", 512))
MODE = os.environ.get("MODE", "deq")
DT = {"e5": jnp.float8_e5m2, "e4": jnp.float8_e4m3fn}[os.environ.get("DT", "e5")]
F32 = jnp.float32
ns = BK // G

def body(x_ref, xs_ref, w_ref, ws_ref, o_ref, acc_ref):
    k = pl.program_id(2)
    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
    if MODE == "deq":
        xs = xs_ref[:, :ns]  # [BM, ns]
        x = (x_ref[...].astype(F32).reshape(BM, ns, G) * xs[:, :, None]).reshape(BM, BK).astype(jnp.bfloat16)
        wsT = ws_ref[...].reshape(ns, BN).T  # [BN, ns]
        w = (w_ref[...].astype(F32).reshape(BN, ns, G) * wsT[:, :, None]).reshape(BN, BK).astype(jnp.bfloat16)
        acc_ref[...] += jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    elif MODE == "deqs":  # per-group slices scaled by a column vector, no reshape
        xs = xs_ref[:, :ns]
        wsT = ws_ref[...].reshape(ns, BN).T
        xd = jnp.concatenate([(x_ref[:, g * G:(g + 1) * G].astype(F32) * xs[:, g:g + 1]).astype(jnp.bfloat16) for g in range(ns)], axis=1)
        wd = jnp.concatenate([(w_ref[:, g * G:(g + 1) * G].astype(F32) * wsT[:, g:g + 1]).astype(jnp.bfloat16) for g in range(ns)], axis=1)
        acc_ref[...] += jax.lax.dot_general(xd, wd, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    elif MODE == "deqw":  # only W dequantized (x scale applied per group on the output would be needed; cost probe)
        wsT = ws_ref[...].reshape(ns, BN).T
        wd = jnp.concatenate([(w_ref[:, g * G:(g + 1) * G].astype(F32) * wsT[:, g:g + 1]).astype(jnp.bfloat16) for g in range(ns)], axis=1)
        acc_ref[...] += jax.lax.dot_general(x_ref[...].astype(jnp.bfloat16), wd, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    elif MODE == "deqbf":  # dequant in bf16 arithmetic
        xs = xs_ref[:, :ns].astype(jnp.bfloat16)
        x = (x_ref[...].astype(jnp.bfloat16).reshape(BM, ns, G) * xs[:, :, None]).reshape(BM, BK)
        wsT = ws_ref[...].reshape(ns, BN).T.astype(jnp.bfloat16)
        w = (w_ref[...].astype(jnp.bfloat16).reshape(BN, ns, G) * wsT[:, :, None]).reshape(BN, BK)
        acc_ref[...] += jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    else:  # per-group fp8 x fp8 dots, scaled in f32
        acc = acc_ref[...]
        xs = xs_ref[:, :ns]
        for g in range(ns):
            d = jax.lax.dot_general(x_ref[:, g * G:(g + 1) * G], w_ref[:, g * G:(g + 1) * G], (((1,), (1,)), ((), ())),
                                    preferred_element_type=F32)
            acc = acc + d * xs[:, g:g + 1] * ws_ref[g]
        acc_ref[...] = acc
    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)

f = pl.pallas_call(body, grid=(M // BM, N // BN, K // BK),
    in_specs=[pl.BlockSpec((BM, BK), lambda m, n, k: (m, k)), pl.BlockSpec((BM, K // G), lambda m, n, k: (m, 0)),
              pl.BlockSpec((BN, BK), lambda m, n, k: (n, k)), pl.BlockSpec((ns, 1, BN), lambda m, n, k: (k, 0, n))],
    out_specs=pl.BlockSpec((BM, BN), lambda m, n, k: (m, n)),
    out_shape=jax.ShapeDtypeStruct((M, N), jnp.bfloat16),
    scratch_shapes=[pltpu.VMEM((BM, BN), F32)],
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=48 << 20))
st = [jax.ShapeDtypeStruct((M, K), DT), jax.ShapeDtypeStruct((M, K // G), F32), jax.ShapeDtypeStruct((N, K), DT),
      jax.ShapeDtypeStruct((K // G, 1, N), F32)]
est = Estimator(cache_path=None)
for chip in sys.argv[1].split(","):
    t0 = time.time()
    try:
        c = est.cycles(jax.jit(f), st, chip) * SC
    except Exception as e:
        print(chip, MODE, "ERR", str(e)[:300], flush=True); continue
    hb = SC * M * K * 1 + N * K + SC * M * N * 2
    m = model_time(chip, c, hb, 2 * SC * M * N * K)
    print(chip, MODE, f"BM={BM} BN={BN} BK={BK}", c, f"cycles_us={m.cycles_us:.1f} model={m.time_us:.1f}", f"{time.time()-t0:.0f}s", flush=True)
