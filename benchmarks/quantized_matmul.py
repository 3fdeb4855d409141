"""Shipped defaults of the quantized matmul: tune each STANDARD_CASE on each chip with the tpu-model evaluator.

For every chip and every case of :data:`tpukernels.library.quantized_matmul_ops.STANDARD_CASES` the chip
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
    p.add_argument("--decode-sweep", action="store_true",
                   help="decode cases (M <= 128) only: full-program libtpu estimates of every (bk, bn) of "
                        "DECODE_BK x DECODE_BN that takes the weight-streaming launch (stream_plan), lowest cycles "
                        "wins (the model time saturates at the HBM roofline, so it cannot rank them)")
    args = p.parse_args(argv)
    if args.decode_sweep:
        return decode_sweep(args.chips.split(","), args.write_defaults)

    import importlib

    from tpukernels.autotune.tuner import tune
    from tpukernels.targets.compile_only import compile_only_env

    compile_only_env()
    qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")
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


#: decode sweep candidates (the weight tile ``bn x bk``; at most ``DECODE_MAX_TILE`` elements: two int8 slots plus
#: the bf16 copy of one stay within every chip's scoped-VMEM cap)
DECODE_BK = (512, 1024, 2048, 3584, 4096, 7168, 14336)
DECODE_BN = (512, 1024, 2048, 3584, 4096, 7168)
DECODE_MAX_TILE = 8 << 20


def decode_sweep(chips, write: bool) -> int:
    """Estimate every streaming (bk, bn) of each decode STANDARD_CASE per chip with the bench family's
    machinery (:class:`tpukernels.bench.core.Estimator`, cached); print them; with ``write`` record the lowest
    in the shipped DB with the candidates as evidence."""
    import importlib

    from tpukernels.autotune import db
    from tpukernels.bench.core import Estimator, EstimateError, default_cache_path, kernel_program
    from tpukernels.perf import clock_hz, hbm_bandwidth
    from tpukernels.targets.compile_only import example_specs

    qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")
    kernel = qmm.quantized_matmul_kernel
    est = Estimator(default_cache_path())
    for chip in chips:
        for _, case, kw in qmm.STANDARD_CASES:
            (M, K), (N, _) = [tuple(int(d) for d in a.split(":")[0].split("x")) for a in case[:2]]
            if M > qmm.STREAM_MAX_M or len(case) != 3:
                continue
            hbm_us = (M * K * 2 + N * K + M * N * 2 + 4 * (N + M)) / hbm_bandwidth(chip) * 1e6
            cands = {}
            for bk in DECODE_BK:
                for bn in DECODE_BN:
                    if bk * bn > DECODE_MAX_TILE or qmm.stream_plan(M, N, K, 512, bk, bn) is None or bk > K or bn > N:
                        continue
                    cfg = dict(bm=512, bk=bk, bn=bn)
                    try:
                        fn, structs, _, _ = kernel_program(kernel, chip, case, kw, cfg)
                        cyc = est.cycles(fn, structs, chip)
                        cands[f"bm=512,bk={bk},bn={bn}"] = round(cyc / clock_hz(chip) * 1e6, 2)
                    except EstimateError as e:
                        cands[f"bm=512,bk={bk},bn={bn}"] = f"libtpu: {str(e).splitlines()[0][:80]}"
            ok = {k: v for k, v in cands.items() if isinstance(v, float)}
            best = min(ok, key=ok.get)
            t = ok[best]
            print(f"{chip} {' '.join(case)}: {best} {t:.2f} us of libtpu cycles (model), HBM roofline {hbm_us:.2f} us; "
                  + ", ".join(f"{k}: {v}" for k, v in sorted(ok.items(), key=lambda kv: kv[1])[:6]), flush=True)
            if write:
                specs, statics = example_specs(kernel, case, kw)
                cfg = {k: int(v) for k, v in (p.split("=") for p in best.split(","))}
                db.record(kernel, chip, specs, statics, cfg, {
                    "evaluator": "tpu-model", "label": "model",
                    "strategy": "sweep of full-program estimates over the weight-streaming blocks "
                                "(benchmarks/quantized_matmul.py --decode-sweep)",
                    "note": "model estimate (libtpu static cost model), not a measurement; lowest libtpu cycles "
                            "(the model time max(cycles, HBM roofline) saturates at the roofline)",
                    "problem": " ".join(case), "cycles_us": t, "hbm_roofline_us": round(hbm_us, 2),
                    "time_us": round(max(t, hbm_us), 2), "pct_of_roofline": round(100 * hbm_us / max(t, hbm_us), 2),
                    "bound": "hbm" if hbm_us >= t else "libtpu-cycles", "candidates_us": cands},
                    path=db.shipped_db_path(kernel.qualname, chip))
    return 0


if __name__ == "__main__":
    sys.exit(main())
