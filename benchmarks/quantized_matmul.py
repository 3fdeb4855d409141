"""Shipped defaults of the quantized matmul: tune each STANDARD_CASE on each chip with the tpu-model evaluator.

For every chip and every case of :data:`tpukernels.library.quantized_matmul.STANDARD_CASES` the chip
supports (jax ``tpu_info``: tpu7x has no int8 x int8 MXU, so its w8a8 int8 cases are skipped), runs
``tpukernels.autotune.tune(..., evaluator="tpu-model", strategy="coordinate")`` — libtpu's static estimate
combined with the chip's rooflines, a MODEL, not a measurement — and with ``--write-defaults`` records the
best config in ``tpukernels/data/autotuning/<chip>/tpukernels.quantized_matmul_kernel.json``.

Usage (wrap in ``flock /tmp/tpuk-heavy.lock`` on a shared machine)::

    .venv/bin/python benchmarks/quantized_matmul.py --write-defaults            # ~20 min on 2 cores
    .venv/bin/python benchmarks/quantized_matmul.py --chips v6e --budget 12

The comparison with XLA and the bf16 matmul is the bench family: ``tpukernels bench --family quantized_matmul``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chips", default="v5e,v6e,tpu7x")
    p.add_argument("--budget", type=int, default=8, help="candidates per case (coordinate search)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--write-defaults", action="store_true", help="record the winners as shipped defaults")
    p.add_argument("--prefill-grid", action="store_true",
                   help="prefill cases: exhaustive over bm, bk, bn in {1024, 2048} (the large-block corner the "
                        "coordinate search from the heuristic does not reach within a small budget)")
    p.add_argument("--prefill-only", action="store_true", help="tune only the prefill-size (M > 128) cases")
    args = p.parse_args(argv)

    import importlib

    from tpukernels.autotune.tuner import tune
    from tpukernels.targets.compile_only import compile_only_env

    compile_only_env()
    qmm = importlib.import_module("tpukernels.library.quantized_matmul")
    for chip in args.chips.split(","):
        for kernel, case, kw in qmm.STANDARD_CASES:
            wdt = case[1].split(":")[1].replace("i8", "int8")
            mode = (None if len(case) == 3 else ("int8" if wdt == "int8" else "fp8"), wdt)
            if mode not in qmm.supported_modes(chip):
                print(f"{chip} {' '.join(case)}: not supported on {chip} (jax tpu_info), skipped", flush=True)
                continue
            t0 = time.time()
            M = int(case[0].split("x")[0])
            if args.prefill_only and M <= 128:
                continue
            # decode-size M: every bm >= M clamps to M (the same program), so search only bk / bn there
            values = {"bm": [512], "bk": [2048, 1024, 4096], "bn": [1024, 512, 2048, 4096]} if M <= 128 else None
            strategy = "coordinate"
            if M > 128 and args.prefill_grid:
                values, strategy = {"bm": [1024, 2048], "bk": [1024, 2048], "bn": [1024, 2048]}, "exhaustive"
            res = tune(kernel, *case, chip=chip, evaluator="tpu-model", strategy=strategy, budget=args.budget,
                       workers=args.workers, write_db="shipped" if args.write_defaults else None, values=values, **kw)
            b = res.best
            best = "no candidate compiled" if b is None else f"{dict(b.config)} {b.time_us:,.1f} us (model)"
            print(f"{chip} {' '.join(case)}: {best} [{time.time() - t0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
