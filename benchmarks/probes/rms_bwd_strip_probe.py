"""Probe (model: libtpu static estimate, NOT a measurement; values not checked) of two RMSNorm backward
bodies at ``[N, H]`` bf16: ``v0`` the shipped whole-block body, ``v1`` a two-pass strip loop (RS-row strips, CC-column
chunks, rolled fori_loops; ``UN=1`` unrolls them, ``CU=1`` unrolls the column loop in Python).

    RS=8 CC=2048 BM=128 .venv/bin/python benchmarks/probes/rms_bwd_strip_probe.py tpu7x v0,v1

2026-12-03, tpu7x 8192x8192: v0 160.5 us; v1 65-119 us rolled, but per-strip cycles are non-monotonic in CC
(1/2/4/8 chunks: ~700/240/114/306), H=2048 costs more per strip than H=8192, and the same body unrolled estimates
185 us (UN=1) / 287.7 us (CU=1): the static profile does not count rolled inner loops consistently, so v1 was
not shipped.
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
F32 = jnp.float32
N, H = int(os.environ.get("N", 8192)), int(os.environ.get("H", 8192))
chips = sys.argv[1].split(",")
variants = sys.argv[2].split(",")
BM = int(os.environ.get("BM", 64))

def body_v0(dy_ref, x_ref, rstd_ref, w_ref, dx_ref, dw_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
        dw_ref[...] = jnp.zeros_like(dw_ref)
    x = x_ref[...].astype(F32); rstd = rstd_ref[...]
    q = dy_ref[...].astype(F32) * rstd
    p = q * x
    s = w_ref[...].astype(F32)
    dx = q * s - (rstd * rstd * jnp.mean(p * s, axis=-1, keepdims=True)) * x
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dw_ref[...] += jnp.sum(p, axis=0, keepdims=True)

CU = bool(int(os.environ.get("CU", 0)))
UN = bool(int(os.environ.get("UN", 0)))
RS, CC = int(os.environ.get("RS", 16)), int(os.environ.get("CC", 512))
def body_v1(dy_ref, x_ref, rstd_ref, w_ref, dx_ref, dw_ref):
    """two streaming passes over strips: row stats (no stores), then dx + dw (columns outer, dw in regs)"""
    @pl.when(pl.program_id(0) == 0)
    def _():
        dw_ref[...] = jnp.zeros_like(dw_ref)
    bm, h = x_ref.shape
    nr, nc = bm // RS, h // CC
    def stat(r, _):
        rows = pl.ds(pl.multiple_of(r * RS, RS), RS)
        def col(c, acc):
            cols = pl.ds(pl.multiple_of(c * CC, CC), CC)
            x = x_ref[rows, cols].astype(F32); dy = dy_ref[rows, cols].astype(F32)
            s = w_ref[:, cols].astype(F32)
            return acc + (dy * x * s).reshape(RS, CC // 128, 128).sum(1)
        acc = jnp.zeros((RS, 128), F32)
        if CU:
            for c in range(nc): acc = col(c, acc)
        else:
            acc = jax.lax.fori_loop(0, nc, col, acc, unroll=UN)
        rstd = rstd_ref[rows, :]
        c_ref[rows, :] = rstd * rstd * rstd * jnp.sum(acc, axis=-1, keepdims=True) * (1.0 / h)
        return 0
    jax.lax.fori_loop(0, nr, stat, 0, unroll=UN)
    def colp(c, _):
        cols = pl.ds(pl.multiple_of(c * CC, CC), CC)
        s = w_ref[:, cols].astype(F32)
        def rowp(r, dw):
            rows = pl.ds(pl.multiple_of(r * RS, RS), RS)
            x = x_ref[rows, cols].astype(F32); dy = dy_ref[rows, cols].astype(F32)
            rstd = rstd_ref[rows, :]
            q = dy * rstd
            dx_ref[rows, cols] = (q * s - c_ref[rows, :] * x).astype(dx_ref.dtype)
            return dw + (q * x).reshape(RS // 8, 8, CC).sum(0)
        dw = jax.lax.fori_loop(0, nr, rowp, jnp.zeros((8, CC), F32), unroll=UN)
        dw_ref[:, cols] += jnp.sum(dw, axis=0, keepdims=True)
        return 0
    if CU:
        for c in range(nc): colp(c, 0)
    else:
        jax.lax.fori_loop(0, nc, colp, 0, unroll=UN)

def build(variant):
    global c_ref
    body = {"v0": body_v0, "v1": body_v1}[variant]
    row = pl.BlockSpec((BM, H), lambda i: (i, 0))
    stat = pl.BlockSpec((BM, 1), lambda i: (i, 0))
    vec = pl.BlockSpec((1, H), lambda i: (0, 0))
    scratch = [pltpu.VMEM((BM, 1), F32)] if variant == "v1" else []
    def wrapped(*refs):
        global c_ref
        if variant == "v1":
            *refs, c_ref = refs
        return body(*refs)
    f = pl.pallas_call(wrapped, grid=(N // BM,), in_specs=[row, row, stat, vec], out_specs=[row, vec],
                       out_shape=[jax.ShapeDtypeStruct((N, H), jnp.bfloat16), jax.ShapeDtypeStruct((1, H), F32)],
                       scratch_shapes=scratch,
                       compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=int(os.environ.get("VL", 32)) << 20))
    structs = [jax.ShapeDtypeStruct((N, H), jnp.bfloat16)] * 2 + [jax.ShapeDtypeStruct((N, 1), F32), jax.ShapeDtypeStruct((1, H), jnp.bfloat16)]
    return jax.jit(f), structs

est = Estimator(cache_path=None)
for chip in chips:
    for v in variants:
        fn, st = build(v)
        t0 = time.time()
        try:
            c = est.cycles(fn, st, chip)
        except Exception as e:
            print(chip, v, "ERR", str(e)[:400], flush=True); continue
        m = model_time(chip, c, 3 * N * H * 2 + 4 * N + 6 * H)
        print(chip, v, f"BM={BM} RS={RS} CC={CC}", c, f"cycles_us={m.cycles_us:.1f} model={m.time_us:.1f}", f"{time.time()-t0:.0f}s", flush=True)
