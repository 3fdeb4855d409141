"""How the shipped tgmm (grouped-matmul weight gradient) configs were chosen (issue 15): models, no measurement.

* ``estimate``: libtpu's static cycle estimate of ours at given ``bm,bk,bn`` configs, fitted from reduced
  problems exactly as ``tpukernels bench --family grouped_matmul`` does (the bench's ``_ours`` at an explicit
  config; cached in the shared estimate cache, so the bench later reuses it). Also prints the analytic
  schedule model (:func:`tpukernels.bench.grouped_matmul.data_cost` at skewed Mixtral group sizes). Heavy
  (a few GB per estimate): run it under ``flock /tmp/tpuk-heavy.lock``.
* ``write``: the same, then record the config into the shipped tuning file of the chip with both figures as
  evidence.

    flock /tmp/tpuk-heavy.lock python benchmarks/grouped_matmul_tgmm_configs.py estimate v6e 256,2048,2048
    flock /tmp/tpuk-heavy.lock python benchmarks/grouped_matmul_tgmm_configs.py write v6e 256,2048,2048 --why "..."

The case is ``STANDARD_CASES``' tgmm: ``x [16384, 4096]^T @ dO [16384, 14336]`` per group, 8 groups.
"""

from __future__ import annotations

import argparse
import importlib
import sys

STEP_US = 0.35


def _gm():
    import tpukernels.library  # noqa: F401

    return importlib.import_module("tpukernels.library.grouped_matmul_ops")


def _case():
    gm = _gm()
    kernel, args, kwargs = next(c for c in gm.STANDARD_CASES if c[0] is gm.grouped_matmul_tgmm)
    M, K = (int(d) for d in args[2].split(":")[0].split("x"))
    N = int(args[3].split(":")[0].split("x")[1])
    return kernel, args, kwargs, M, K, N


def analytic(chip, bm, bk, bn) -> dict:
    from tpukernels.bench import grouped_matmul as bgm
    from tpukernels.perf import hbm_bandwidth, peak_flops

    gm = _gm()
    _, _, _, M, K, N = _case()
    mx = gm.MIXTRAL
    sizes = gm.skewed_group_sizes(mx["tokens"], mx["top_k"], mx["experts"], bgm.SKEW)
    c = bgm.data_cost("tgmm", M, K, N, sizes, dict(bm=bm, bk=bk, bn=bn))
    bm_, bk_, bn_ = gm.clamp(M, bm), gm.clamp(K, bk), gm.clamp(N, bn)
    steps = c["items"] * -(-K // bk_) * -(-N // bn_)
    t = max(c["mxu_flops"] / peak_flops(chip), c["hbm_bytes"] / hbm_bandwidth(chip)) * 1e6 + steps * STEP_US
    ideal = 2 * M * K * N / peak_flops(chip) * 1e6
    return dict(model_time_us=round(t, 1), pct_of_peak=round(100 * ideal / t, 1), group_sizes=sizes)


def static(chip, bm, bk, bn, timeout_s=280) -> dict:
    """libtpu's static estimate of ours at an explicit config, fitted as the bench does."""
    from _grouped_static import static_estimate

    kernel, args, kwargs, M, K, N = _case()
    return static_estimate(kernel, args, kwargs, M, K, N, chip, dict(bm=bm, bk=bk, bn=bn), timeout_s)


def _drop_stale(path, current_hash):
    """Remove entries recorded for an older kernel source (they can never match again)."""
    import json

    with open(path) as f:
        data = json.load(f)
    data["entries"] = [e for e in data["entries"] if e["key"].get("source_hash") == current_hash]
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("estimate", "write"))
    p.add_argument("chip")
    p.add_argument("configs", nargs="+", help="bm,bk,bn")
    p.add_argument("--timeout", type=float, default=280, help="per libtpu estimate, seconds")
    p.add_argument("--why", default="", help="write: a sentence on why this config (goes into the evidence note)")
    p.add_argument("--allow-no-static", action="store_true",
                   help="write: record the config even where libtpu cannot estimate it (the error goes into the evidence)")
    a = p.parse_args(argv)
    for text in a.configs:
        bm, bk, bn = (int(v) for v in text.split(","))
        r = analytic(a.chip, bm, bk, bn)
        try:
            s = static(a.chip, bm, bk, bn, a.timeout)
        except Exception as e:  # noqa: BLE001 - report libtpu's failure and go on
            s = dict(static_error=str(e)[:300])
        print(f"{a.chip} tgmm bm={bm} bk={bk} bn={bn}: analytic {r['pct_of_peak']}% ({r['model_time_us']:,} µs), "
              f"static {s}", flush=True)
        if a.what == "write":
            if "static_error" in s and not a.allow_no_static:
                print("  not written: the static estimate failed (--allow-no-static records it anyway)", file=sys.stderr)
                continue
            from tpukernels.autotune import db
            from tpukernels.autotune.space import Problem

            kernel, args, kwargs, *_ = _case()
            prob = Problem.from_args(kernel, *args, **kwargs)
            note = ("models, not measurements: the libtpu static estimate (fitted from reduced problems as in "
                    "`tpukernels bench --family grouped_matmul`; every item of the static bound ceil(M/bm) + G - 1 "
                    "computing) and the analytic schedule model (exact Pallas block copies and MXU work of the real "
                    f"schedule at group_sizes, HBM/MXU rooflines, {STEP_US} µs per grid step); chosen by "
                    "benchmarks/grouped_matmul_tgmm_configs.py. " + a.why).strip()
            if "static_error" in s:
                ev = dict(evaluator="analytic-schedule-model", model_time_us=r["model_time_us"],
                          pct_of_peak=r["pct_of_peak"], group_sizes=r["group_sizes"], note=note,
                          static_estimate_error=s["static_error"])
            else:
                ev = dict(evaluator="libtpu-static-estimate+analytic-schedule-model", model_time_us=s["static_us"],
                          pct_of_peak=s["static_pct"], analytic_time_us=r["model_time_us"],
                          analytic_pct_of_peak=r["pct_of_peak"], group_sizes=r["group_sizes"], note=note)
            path = db.shipped_db_path(kernel.qualname, a.chip)
            db.record(kernel, a.chip, prob.specs, prob.statics, dict(bm=bm, bk=bk, bn=bn), ev, path=path)
            _drop_stale(path, db.source_hash(kernel))
            print(f"  recorded in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
