"""Where the host time of a cached tiny op goes (a study): torch op vs the jitted JAX function vs a naive round trip.

The published host costs of the library ops (BENCHMARKS.md) are ``tpukernels bench --family host``
(:mod:`tpukernels.bench.host`, whose timer this study shares); this script breaks one example kernel's call down.

Wall-clock measurement on this machine's CPU (not a model). The kernel is the example vector add on
1024 float32 elements in fast interpret mode, so the kernel itself is a few microseconds; what differs
between the rows is the host-side path:

* ``jax (compiled)``: the compiled executable called directly on jax arrays (the floor);
* ``jax (jit)``: the jitted function on jax arrays;
* ``naive DLPack round trip``: torch -> ``jax.dlpack`` -> jit -> ``torch.from_dlpack`` written inline;
* ``torch op``: ``torch.ops.examples.vector_add`` (dispatcher + tpukernels' cached plan + DLPack);
* ``kernel(...)``: the Python-level call (argument binding, then the torch op).

Run: ``.venv/bin/python benchmarks/dispatch_overhead.py [--json]``. Prints the best-of-7 mean µs per call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import jax  # noqa: E402
import torch  # noqa: E402

import tpukernels as tk  # noqa: E402
from tpukernels.bench.host import best_mean_us  # noqa: E402
from tpukernels.lowering import specs_from_values  # noqa: E402


def bench(fn, n=3000, repeats=7) -> float:
    """Best (min) over ``repeats`` of the mean µs per call over ``n`` calls (``tpukernels bench``'s timer)."""
    return best_mean_us(fn, n, repeats)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--n", type=int, default=1024)
    args = ap.parse_args()

    from vector_add import vector_add

    x, y = torch.randn(args.n), torch.randn(args.n)
    with tk.interpret_mode("fast"):
        vector_add(x, y)  # build and cache the plan
        specs, statics = specs_from_values(vector_add, [x, y])
        low = tk.lowering.lower(vector_add, specs, statics, None, mode="fast")
        compiled = low.compiled()
        jx, jy = jax.dlpack.from_dlpack(x), jax.dlpack.from_dlpack(y)

        def naive():
            out = low.fn(jax.dlpack.from_dlpack(x.contiguous()), jax.dlpack.from_dlpack(y.contiguous()))
            return torch.from_dlpack(out[0])

        rows = {
            "jax (compiled)": bench(lambda: compiled(jx, jy)[0].block_until_ready()),
            "jax (jit)": bench(lambda: low.fn(jx, jy)[0].block_until_ready()),
            "naive DLPack round trip": bench(naive),
            "torch op": bench(lambda: torch.ops.examples.vector_add(x, y)),
            "kernel(...)": bench(lambda: vector_add(x, y)),
        }
    base = rows["jax (compiled)"]
    if args.json:
        print(json.dumps({"unit": "us/call (best of 7 means, wall-clock, CPU)", "rows": rows,
                          "extra_vs_compiled": {k: v - base for k, v in rows.items()}}, indent=1))
        return
    print(f"vector_add, {args.n} float32, fast interpret mode; wall-clock on this CPU (best-of-7 mean µs per call)")
    print(f"{'path':26} {'µs/call':>9} {'extra vs jax (compiled)':>24}")
    for k, v in rows.items():
        print(f"{k:26} {v:9.1f} {v - base:24.1f}")


if __name__ == "__main__":
    main()
