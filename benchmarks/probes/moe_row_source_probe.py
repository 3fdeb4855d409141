"""Cost probe (model: libtpu 0.0.52's static estimate, NOT a measurement; values not checked) of the MoE row kernels'
source choices at Qwen3-30B-A3B prefill (8,192 tokens of D = 2048, top-8: 65,536 rows of 4 KiB), the figures the
``moe_routing.permute_ops`` docstrings quote:

* ``moe_gather_fwd`` with x in HBM (a row DMA per row) vs resident in VMEM (a row load per row), v6e and tpu7x;
* the resident gather of gpt-oss's rows (D = 2880: ``[16, 180]`` slabs, partial lane columns) on v6e;
* the combine: ``moe_gather_reduce_fwd`` (row DMAs; fitted from 1,024 / 512 tokens as the bench does) vs
  ``moe_scatter_add_fwd`` (y read in order into a float32 VMEM accumulator), v6e;
* tpu7x's resident gather with its scoped VMEM request at 52 MiB instead of the cap (56 MiB).

    .venv/bin/python benchmarks/probes/moe_row_source_probe.py

2026-12-07: v6e gather hbm 1,030.4 us (27.6 cycles per row) / vmem 229.4 us (6.1); tpu7x gather vmem 153.1 us
(5.1); gpt-oss's rows resident on v6e 968.7 us (25.9 cycles per row); v6e combine gather-reduce 1,173.9 us /
scatter-add 455.4 us (12.2); tpu7x resident gather at a 52 MiB request: RESOURCE_EXHAUSTED, "Used 92.25M of
63.94M vmem" (libtpu places another ~40 MiB beside the kernel's scoped VMEM; at the 56 MiB cap it compiles).
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout
for _k, _v in (("JAX_PLATFORMS", "cpu"), ("TPU_ACCELERATOR_TYPE", "v5litepod-1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
               ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(_k, _v)
from tpukernels.bench import moe  # noqa: E402
from tpukernels.bench.core import Estimator, default_cache_path, kernel_program  # noqa: E402
from tpukernels.library.moe_routing import permute_ops as P  # noqa: E402
from tpukernels.perf import clock_hz  # noqa: E402

est = Estimator(default_cache_path())
T, K, H = 8192, 8, 2048
X = (f"{T}x16x{H // 16}:bf16", f"{T * K}:i32")
Y = (f"{T * K}x16x{H // 16}:bf16", f"{T * K}:i32", f"{T * K}:f32")


def show(label, chip, fn):
    try:
        c = fn()
        print(f"{label} {chip}: {c / clock_hz(chip) * 1e6:,.1f} us ({c / (T * K):.1f} cycles per row)")
    except Exception as e:  # noqa: BLE001  (a compile or profiler failure is a result here)
        print(f"{label} {chip}: no estimate: {str(e)[:200]}")


def gather(chip, source, args=X):
    return lambda: est.cycles(*kernel_program(P.moe_gather_fwd, chip, args, {}, {"block_rows": 1024,
                                                                                  "source": source})[:2], chip)


if sys.argv[1:] == ["limit"]:  # in its own process: the lowering at the cap is cached once made
    P.vmem_cap = lambda chip=None: 52 << 20  # the scoped request below tpu7x's cap (56 MiB)
    show("gather, x resident, 52 MiB scoped request", "tpu7x", gather("tpu7x", "vmem"))
    sys.exit(0)
show("gather, x in HBM (row DMAs), 256-row blocks", "v6e", lambda: est.cycles(*kernel_program(
    P.moe_gather_fwd, "v6e", X, {}, {"block_rows": 256, "source": "hbm"})[:2], "v6e"))
for chip in ("v6e", "tpu7x"):
    show("gather, x resident in VMEM", chip, gather(chip, "vmem"))
show("gather of gpt-oss's [16, 180] rows, resident", "v6e",
     gather("v6e", "vmem", (f"{T}x16x180:bf16", f"{T * K}:i32")))
show("combine, gather-reduce (row DMAs)", "v6e", lambda: moe.row_copy_cycles(
    est, "v6e", P.moe_gather_reduce_fwd, lambda t: (f"{t * K}x16x{H // 16}:bf16", f"{t * K}:i32", f"{t * K}:f32"),
    {"top_k": K}, T, K, 2 * H))
show("combine, scatter-add", "v6e", lambda: est.cycles(*kernel_program(
    P.moe_scatter_add_fwd, "v6e", Y, {"num_tokens": T})[:2], "v6e"))
subprocess.run([sys.executable, os.path.abspath(__file__), "limit"], check=True)
