"""Cost probe (model: libtpu static estimate, NOT a measurement; values not checked) of DeepSeek-V3's gate/up
grouped matmul on tpu7x at the config fused_moe's bf16 output gets (the shipped table's nearest entry) and at
variants of it, bf16 and float32 out: which configs libtpu 0.0.52's profiler can estimate. One reduced problem
(8 groups, the MoE bench family's row tiles, one column block), the kernel alone.

    .venv/bin/python benchmarks/probes/moe_gmm_tpu7x_probe.py

2026-12-07: the config bm=128, bk=16384, bn=512, rhs prefetch aborts (fifo_tracker.cc:436) with either output
dtype; rhs_prefetch=False 50,777 cycles (bf16) / 50,826 (f32); bk=2048 106,317 / 106,362; bn=2048
and bm=512 exceed the scoped VMEM.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout
for _k, _v in (("JAX_PLATFORMS", "cpu"), ("TPU_ACCELERATOR_TYPE", "v5litepod-1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
               ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(_k, _v)
from tpukernels.bench import moe
from tpukernels.bench.core import Estimator, default_cache_path, kernel_program
from tpukernels.bench.grouped_matmul import ours_split

est, chip, m, T = Estimator(default_cache_path()), "tpu7x", moe.MODELS[2], 8192
gm = moe._gm()
kernel = gm.grouped_matmul_fwd
M, K, N = moe._mm_dims(m, T, "up")
_, _, cfg, source = kernel_program(kernel, chip, moe._mm_args(m, m.E, M, K, N, m.bias), moe._MM_KW)
print("config a call gets:", cfg, source)
for out_dtype in ("bfloat16", "float32"):
    for variant in ({}, {"rhs_prefetch": False}, {"bn": 256}, {"bn": 2048}, {"bm": 512}, {"bk": 2048}):
        c = dict(cfg, **variant)
        c["bm"] = gm.clamp(M, c["bm"])
        try:
            prog = ours_split(kernel, moe._mm_args(m, 8, moe.FIT_TILES * c["bm"], K, c["bn"], m.bias),
                              dict(moe._MM_KW, out_dtype=out_dtype), c, chip)[0]
            print(out_dtype, variant, est.cycles(*prog, chip), "cycles (model)")
        except Exception as e:  # noqa: BLE001  (a profiler abort is a result here)
            print(out_dtype, variant, "no estimate:", str(e)[:120])
