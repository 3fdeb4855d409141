"""Host-side costs on this CPU (wall-clock measurements, not models).

1. Dispatch overhead per op: torch op vs the compiled JAX executable (``benchmarks/dispatch_overhead.py``).
2. Compile latency per library kernel, first call in a fresh process: **cold** (empty JAX persistent
   compilation cache) and **warm** (a new process reusing the cache written by the cold run;
   ``JAX_COMPILATION_CACHE_DIR``). Tracing the Pallas kernel still happens in the warm process; only the
   XLA compile is cached.
3. Recompiles under ``torch.compile(dynamic=True)`` over varying sequence lengths: dynamo frames and
   tpukernels lowerings (``rms_norm`` has row bucketing; ``flash_attention`` specializes on Sq/Skv).

Run: ``.venv/bin/python benchmarks/host.py [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One first call per kernel at a small shape (cpu interpret, fast mode).
_FIRST_CALL = {
    "rms_norm": "L.rms_norm(torch.randn(256, 1024), torch.randn(1024))",
    "layer_norm": "L.layer_norm(torch.randn(256, 1024), torch.randn(1024), torch.randn(1024))",
    "matmul": "L.matmul(torch.randn(256, 512), torch.randn(512, 256))",
    "flash_attention": "L.flash_attention(torch.randn(1, 4, 256, 64), torch.randn(1, 2, 256, 64), torch.randn(1, 2, 256, 64), causal=True)",
}

_CHILD = """
import os, time, sys
t0 = time.perf_counter()
import torch, tpukernels.library as L
t1 = time.perf_counter()
out = {expr}
t2 = time.perf_counter()
out = {expr}
t3 = time.perf_counter()
print(f"{{t1 - t0:.3f}} {{t2 - t1:.3f}} {{t3 - t2:.4f}}")
"""


def compile_latency() -> list[dict]:
    rows = []
    for name, expr in _FIRST_CALL.items():
        with tempfile.TemporaryDirectory(prefix="tpk_jaxcache_") as cache:
            env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
            times = []
            for _ in ("cold", "warm"):
                proc = subprocess.run([sys.executable, "-c", _CHILD.format(expr=expr)], env=env, capture_output=True,
                                      text=True, cwd=ROOT, timeout=900)
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr[-2000:])
                times.append([float(t) for t in proc.stdout.split()[-3:]])
        (imp, cold, again), (_, warm, _) = times
        rows.append({"kernel": name, "import_s": imp, "first_call_cold_s": cold, "first_call_warm_s": warm,
                     "second_call_s": again})
    return rows


def recompiles() -> list[dict]:
    import torch
    import torch._dynamo.testing

    import tpukernels.library as L
    from tpukernels.library import attention as A
    from tpukernels.library import norms as N

    lengths = [100, 117, 128, 150, 200, 233, 256, 300]
    w = torch.randn(256)
    cases = [
        ("rms_norm", N.rms_norm_fwd, lambda x: L.rms_norm(x, w), lambda s: (torch.randn(s, 256),)),
        ("flash_attention", A.fa_forward, lambda q, k, v: L.flash_attention(q, k, v, causal=True),
         lambda s: tuple(torch.randn(1, 2, s, 64) for _ in range(3))),
    ]
    rows = []
    for name, kernel, fn, make in cases:
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounter()
        op = torch.compile(fn, dynamic=True, backend=counter)
        before = len(kernel._entries)
        t0 = time.perf_counter()
        for s in lengths:
            op(*make(s))
        rows.append({"kernel": name, "lengths": lengths, "dynamo_frames": counter.frame_count,
                     "kernel_lowerings": len(kernel._entries) - before, "seconds": time.perf_counter() - t0})
    return rows


def dispatch() -> dict:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "dispatch_overhead.py"), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    report = {"kind": "wall-clock measurement on this CPU", "dispatch": dispatch(), "compile": compile_latency(),
              "recompiles": recompiles()}
    d = report["dispatch"]
    print("dispatch overhead (µs/call, best-of-7 means):")
    for k, v in d["rows"].items():
        print(f"  {k:26} {v:8.1f}  (+{d['extra_vs_compiled'][k]:.1f} vs jax compiled)")
    print("first-call latency (s): import / cold compile / warm (persistent cache) / second call")
    for r in report["compile"]:
        print(f"  {r['kernel']:16} {r['import_s']:6.2f} {r['first_call_cold_s']:8.2f} {r['first_call_warm_s']:8.2f} "
              f"{r['second_call_s']:8.4f}")
    print("torch.compile(dynamic=True) over sequence lengths", report["recompiles"][0]["lengths"])
    for r in report["recompiles"]:
        print(f"  {r['kernel']:16} dynamo frames {r['dynamo_frames']}, kernel lowerings {r['kernel_lowerings']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
