"""Model estimate (libtpu static estimated_cycles + rooflines, NOT a measurement) of
``quantized_matmul_blockwise_a8_kernel`` alone at the Llama-3-8B MLP prefill shape (8192 tokens, estimated at 1/4
of the rows and scaled x4): the up projection ``8192x4096 @ (14336x4096)^T`` or, with ``DOWN=1``, the down
projection ``8192x14336 @ (4096x14336)^T``.

    .venv/bin/python benchmarks/probes/fp8_prefill_forms.py v6e float8_e5m2              # the heuristic's config
    .venv/bin/python benchmarks/probes/fp8_prefill_forms.py tpu7x float8_e4m3fn '{"bm": 512, "bk": 1024, "bn": 1024, "form": "groups"}'
    PREFILL=1 DOWN=1 .venv/bin/python benchmarks/probes/fp8_prefill_forms.py tpu7x float8_e4m3fn '{"bm": 1024, "bk": 2048, "bn": 512}'

``PREFILL=1``: ``quantized_matmul_blockwise_a8_prefill_kernel`` (what the public op runs at prefill on v6e / tpu7x: the
activations dequantized to bf16 by the quantization pass, only the weight tile dequantized in VMEM). Figures
(2026-12-07, kernel alone, bm / bk / bn): up projection v6e 1,120 us (1024 / 4096 / 2048; 2048 / 4096 / 1024 1,139,
2048 / 4096 / 2048 1,137, 512 / 4096 / 2048 1,160), tpu7x 894 us (1024 / 4096 / 1024; 512 / 4096 / 2048 917); down
projection v6e 1,256 us (1024 / 2048 / 2048; 2048 / 2048 / 1024 1,264, 2048 / 2048 / 512 1,397, 1024 / 2048 / 1024
1,315), tpu7x 1,122 us (1024 / 2048 / 512; 512 / 2048 / 1024 1,147, 1024 / 1024 / 1024 1,212; 1024 / 2048 / 1024
overflows the profiling compile's VMEM).

2026-12-08, the kernel with a dot per accumulator branch (what ships; one-step blocks unchanged): down projection v6e
1,144 us (1024 / 2048 / 2048; 1024 / 2048 / 4096 1,136, 2048 / 1024 / 2048 1,146), tpu7x 944 us (1024 / 2048 /
1024, which now fits; 1024 / 2048 / 512 1,040, 512 / 2048 / 1024 1,068); up projection in two K steps v6e 1,144
(1024 / 2048 / 2048) and 1,131 (2048 / 2048 / 2048), tpu7x 944 (1024 / 2048 / 1024): no better than one step.

Figures quoted in ``blockwise_a8``'s docstring and README (2026-12-03, libtpu 0.0.52): up projection, dequant
form at the heuristic's blocks, v6e 1,447 us, tpu7x 1,111 us; the group form at 512/1024/1024 (the second command),
v6e 2,559 us, tpu7x 2,046 us. The bench family (``tpukernels bench --family
quantized_matmul``) adds the activation-quantization pass.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout
for _k, _v in (("JAX_PLATFORMS", "cpu"), ("TPU_ACCELERATOR_TYPE", "v5litepod-1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
               ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(_k, _v)
import json
import time
from tpukernels.bench.core import Estimator, kernel_program
import tpukernels.library, importlib
from tpukernels.perf import model_time
qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")
if os.environ.get("VL"):
    a8m = sys.modules["tpukernels.library.quantized_matmul_ops.blockwise_a8"]
    a8m.scoped_vmem_limit = lambda need, chip=None: int(os.environ["VL"]) << 20
chip, dt = sys.argv[1], sys.argv[2]
cfg = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
SC = 4; M = 8192 // SC; K, N = (14336, 4096) if os.environ.get("DOWN") else (4096, 14336)
if os.environ.get("PREFILL"):  # the prefill kernel (x dequantized by the quantization pass; that pass not counted)
    kern, args = (qmm.quantized_matmul_blockwise_a8_prefill_kernel,
                  (f"{M}x{K}:bf16", f"{N}x{K}:{dt}", f"{K//128}x1x{N}:f32"))
else:
    kern, args = (qmm.quantized_matmul_blockwise_a8_kernel,
                  (f"{M}x{K}:{dt}", f"{M}x{K//128}:f32", f"{N}x{K}:{dt}", f"{K//128}x1x{N}:f32"))
fn, st, c, src = kernel_program(kern, chip, args, {}, cfg)
t0 = time.time()
cyc = Estimator(cache_path=None).cycles(fn, st, chip) * SC
m = model_time(chip, cyc, SC * M * K + N * K + SC * M * N * 2, 2 * SC * M * N * K, dtype=dt)
print(chip, dt, c, src, cyc, f"model={m.time_us:.1f} us compute_roof={m.compute_us:.1f}", f"{time.time()-t0:.0f}s", flush=True)
