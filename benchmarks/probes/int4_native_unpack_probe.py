"""Cost probe (model: libtpu static estimate, NOT a measurement; values not checked) of w4a16 decode
``16x4096 @ (14336x4096)^T`` with int4 packed along N so that ``pltpu.bitcast(u8 -> int4)`` + ``astype`` is
Mosaic's native unpack. ``MODE=plain``: one dot, no scales (the floor of any bf16-fed form); ``scaled``: one
dot per 128-group times its scale row; ``cvt8`` / ``cvt5`` / ``cvtb8`` / ``cvtb5``: int4 -> fp8 (directly / via bf16).

    MODE=plain .venv/bin/python benchmarks/probes/int4_native_unpack_probe.py v6e,tpu7x

2026-12-03: plain v6e 32.3 us (60% of the 19.4 us HBM roofline), tpu7x 24.8 us (35% of 8.6); scaled 40.0 /
31.6 us; cvt8 aborts the estimator on both; cvt5 v6e 40.6, aborts on tpu7x; cvtb5 / cvtb8 abort on tpu7x.
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
M, K, N, G = int(os.environ.get("M", 16)), 4096, 14336, 128
BK, BN = int(os.environ.get("BK", 2048)), int(os.environ.get("BN", 1024))
MODE = os.environ.get("MODE", "scaled")
F32 = jnp.float32

def body(x_ref, w_ref, s_ref, o_ref, acc_ref):
    k = pl.program_id(1)
    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
    w = pltpu.bitcast(w_ref[...], jnp.int4)  # [BN, BK] int4
    if MODE.startswith("cvt"):
        dt = {"cvt8": jnp.float8_e4m3fn, "cvt5": jnp.float8_e5m2, "cvti8": jnp.int8, "cvtb5": jnp.float8_e5m2, "cvtb8": jnp.float8_e4m3fn}[MODE]
        if MODE.startswith("cvtb"): w = w.astype(jnp.bfloat16)
        wb = w.astype(dt)
        acc_ref[...] += jax.lax.dot_general(x_ref[...], wb, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    elif MODE == "plain":
        wb = w.astype(jnp.bfloat16)
        acc_ref[...] += jax.lax.dot_general(x_ref[...], wb, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    else:  # per-group scales: one dot per group, scale [1, BN] per group
        acc = acc_ref[...]
        for g in range(BK // G):
            wb = w[:, g * G:(g + 1) * G].astype(jnp.bfloat16)
            d = jax.lax.dot_general(x_ref[:, g * G:(g + 1) * G], wb, (((1,), (1,)), ((), ())), preferred_element_type=F32)
            acc = acc + d * s_ref[g]
        acc_ref[...] = acc
    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)

f = pl.pallas_call(body, grid=(N // BN, K // BK),
    in_specs=[pl.BlockSpec((M, BK), lambda n, k: (0, k)), pl.BlockSpec((BN // 2, BK), lambda n, k: (n, k)),
              pl.BlockSpec((BK // G, 1, BN), lambda n, k: (k, 0, n))],
    out_specs=pl.BlockSpec((M, BN), lambda n, k: (0, n)),
    out_shape=jax.ShapeDtypeStruct((M, N), jnp.bfloat16),
    scratch_shapes=[pltpu.VMEM((M, BN), F32)],
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))
st = [jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((N // 2, K), jnp.uint8),
      jax.ShapeDtypeStruct((K // G, 1, N), F32)]
est = Estimator(cache_path=None)
for chip in sys.argv[1].split(","):
    t0 = time.time()
    try:
        c = est.cycles(jax.jit(f), st, chip)
    except Exception as e:
        print(chip, "ERR", str(e)[:600], flush=True); continue
    hb = M * K * 2 + N * K // 2 + (K // G) * N * 4 + M * N * 2
    m = model_time(chip, c, hb, 2 * M * N * K)
    print(chip, MODE, f"BK={BK} BN={BN} M={M}", c, f"cycles_us={m.cycles_us:.1f} model={m.time_us:.1f} roof={hb/ m.time_us if False else ''}", f"{time.time()-t0:.0f}s", flush=True)
