"""How the shipped forward grouped-matmul configs were chosen (issue 15): two models, no measurement.

* ``rank``: every ``(bm, bk, bn)`` whose scoped-VMEM request fits the chip (``scoped_vmem_limit`` of
  :mod:`tpukernels.library._vmem`: 7/8 of jax's ``vmem_capacity_bytes``), ranked by the *analytic
  schedule model* ``max(MXU, HBM) + 0.35 µs per grid step``: the exact Pallas block copies and MXU work of the
  real work-item schedule at skewed Mixtral group sizes (:func:`tpukernels.bench.grouped_matmul.data_cost`).
* ``estimate``: libtpu's static cycle estimate of given configs, fitted from reduced problems exactly as
  ``tpukernels bench --family grouped_matmul`` does (the bench's ``_ours`` at an explicit config; cached in the
  shared estimate cache). Heavy (up to ~20 GB): run it under ``flock /tmp/tpuk-heavy.lock``.
* ``write``: record configs into the shipped tuning files with both models' figures as evidence (the static
  figure must already be in the estimate cache, or the estimate runs again).

    python benchmarks/grouped_matmul_configs.py rank v6e up [--max-need-mib 26]
    flock /tmp/tpuk-heavy.lock python benchmarks/grouped_matmul_configs.py estimate v6e up 256,4096,3584
    flock /tmp/tpuk-heavy.lock python benchmarks/grouped_matmul_configs.py write v6e up 256,4096,3584 --why "..."

Cases: ``up`` (x @ W1[g].T, K 4096, N 14336), ``down`` (h @ W2[g].T, K 14336, N 4096), ``kn`` (x @ W[g]).
"""

from __future__ import annotations

import argparse
import importlib
import sys

CASES = {"up": 0, "down": 1, "kn": 2}
BM = (128, 256, 512, 1024)
BK = (512, 1024, 2048, 3584, 4096, 7168, 16384)
BN = (256, 512, 1024, 2048, 3584, 4096, 7168)
STEP_US = 0.35


def _gm():
    import tpukernels.library  # noqa: F401

    return importlib.import_module("tpukernels.library.grouped_matmul")


def _dims(case):
    gm = _gm()
    kernel, args, kwargs = gm.STANDARD_CASES[CASES[case]]
    M, K = (int(d) for d in args[2].split(":")[0].split("x"))
    _, d1, d2 = (int(d) for d in args[3].split(":")[0].split("x"))
    tr = bool(kwargs.get("transpose_rhs"))
    return kernel, args, kwargs, M, K, (d1 if tr else d2), tr


def need_bytes(M, K, N, bm, bk, bn, tr) -> int:
    """The forward launch's VMEM footprint (the same formula as ``grouped_matmul_fwd``)."""
    import jax.numpy as jnp

    from tpukernels.dsl.validate import padded_bytes

    gm = _gm()
    bm_, bk_, bn_ = gm._clamp(M, bm), gm._clamp(K, bk), gm._clamp(N, bn)
    acc = (bm_, bn_) if -(-K // bk_) > 1 else (8, 128)
    rb = (bn_, bk_) if tr else (bk_, bn_)
    b16 = jnp.bfloat16
    return (2 * (padded_bytes((bm_, bk_), b16) + padded_bytes(rb, b16) + padded_bytes((bm_, bn_), b16))
            + padded_bytes(acc, jnp.float32))


def analytic(chip, case, bm, bk, bn) -> dict:
    """The analytic schedule model of one config (µs, % of the MXU roofline)."""
    from tpukernels.bench.grouped_matmul import SKEW, data_cost
    from tpukernels.perf import hbm_bandwidth, peak_flops

    gm = _gm()
    _, _, _, M, K, N, tr = _dims(case)
    mx = gm.MIXTRAL
    sizes = gm.skewed_group_sizes(mx["tokens"], mx["top_k"], mx["experts"], SKEW)
    c = data_cost("grouped_matmul_fwd", M, K, N, sizes, dict(bm=bm, bk=bk, bn=bn), tr)
    bk_, bn_ = gm._clamp(K, bk), gm._clamp(N, bn)
    steps = -(-N // bn_) * c["items"] * -(-K // bk_)
    mxu = c["mxu_flops"] / peak_flops(chip) * 1e6
    hbm = c["hbm_bytes"] / hbm_bandwidth(chip) * 1e6
    t = max(mxu, hbm) + STEP_US * steps
    ideal = 2 * M * K * N / peak_flops(chip) * 1e6
    return dict(model_time_us=round(t, 1), pct_of_peak=round(100 * ideal / t, 1), mxu_us=round(mxu), hbm_us=round(hbm),
                steps=steps, group_sizes=sizes)


def pipelined(chip, case, bm, bk, bn) -> dict:
    """A double-buffered pipeline walk of the real schedule (what neither model above sees): step ``s`` takes
    ``max(its MXU time, the copy of step s+1's new blocks) + 0.35 µs``, so a group change exposes the new
    ``rhs`` block's copy minus one item's compute (at ``bk = K`` a whole ``[K, bn]`` block)."""
    import jax.numpy as jnp
    import numpy as np

    from tpukernels.bench.grouped_matmul import SKEW
    from tpukernels.perf import hbm_bandwidth, peak_flops

    gm = _gm()
    _, _, _, M, K, N, tr = _dims(case)
    mx = gm.MIXTRAL
    sizes = gm.skewed_group_sizes(mx["tokens"], mx["top_k"], mx["experts"], SKEW)
    bm_, bk_, bn_ = gm._clamp(M, bm), gm._clamp(K, bk), gm._clamp(N, bn)
    T = gm.num_items(M, len(sizes), bm_)
    (tab,) = gm._fwd_schedule(jnp.asarray(sizes, jnp.int32), jnp.zeros(1, jnp.int32), M=M, G=len(sizes), bm=bm_, T=T)
    tab = np.asarray(tab).reshape(gm.N_FIELDS, T)
    compute = ((tab[gm.F_FLAGS] ^ gm.ALL) & gm.COMPUTE) != 0
    gk, gn = -(-K // bk_), -(-N // bn_)
    bw, pk = hbm_bandwidth(chip), peak_flops(chip)
    steps = []  # (compute µs, bytes first needed at this step)
    prev = {}
    for n in range(gn):
        for i in range(T):
            for k in range(gk):
                ke = k if compute[i] else gk - 1
                b = 0
                for name, idx, nbytes in (("lhs", (tab[gm.F_SRC_TILE, i], ke), bm_ * bk_ * 2),
                                          ("rhs", (tab[gm.F_GROUP, i], ke, n), bk_ * bn_ * 2),
                                          ("out", (tab[gm.F_TILE, i], n), bm_ * bn_ * 2)):
                    if prev.get(name) != idx:
                        b += nbytes
                        prev[name] = idx
                steps.append((2 * bm_ * bk_ * bn_ / pk * 1e6 if compute[i] else 0.0, b / bw * 1e6))
    t = steps[0][1] + sum(max(c, steps[j + 1][1] if j + 1 < len(steps) else 0.0) + STEP_US
                          for j, (c, _) in enumerate(steps))
    ideal = 2 * M * K * N / pk * 1e6
    return dict(pipelined_us=round(t, 1), pipelined_pct=round(100 * ideal / t, 1))


def static(chip, case, bm, bk, bn, timeout_s=280) -> dict:
    """libtpu's static estimate of ours at an explicit config, fitted as the bench does."""
    from _grouped_static import static_estimate

    kernel, args, kwargs, M, K, N, _ = _dims(case)
    return static_estimate(kernel, args, kwargs, M, K, N, chip, dict(bm=bm, bk=bk, bn=bn), timeout_s)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("rank", "estimate", "write"))
    p.add_argument("chip")
    p.add_argument("case", choices=tuple(CASES))
    p.add_argument("configs", nargs="*", help="bm,bk,bn")
    p.add_argument("--max-need-mib", type=float, default=None, help="rank: only configs with a smaller footprint")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--timeout", type=float, default=280, help="per libtpu estimate, seconds (a short one: cache hits only)")
    p.add_argument("--why", default="", help="write: a sentence on why this config (goes into the evidence note)")
    p.add_argument("--allow-no-static", action="store_true",
                   help="write: record the config even where libtpu cannot estimate it (the error goes into the evidence)")
    a = p.parse_args(argv)
    gm = _gm()
    from tpukernels.library._vmem import MiB, vmem_cap
    _, _, _, M, K, N, tr = _dims(a.case)
    if a.what == "rank":
        rows = []
        for bm in BM:
            for bk in BK:
                for bn in BN:
                    if (bk > K and bk != max(BK)) or (bk == K and K in BK and bk != max(BK)) or bn > N:
                        continue  # one spelling of "bk = K" (bk >= K clamps to K): the largest
                    nd = need_bytes(M, K, N, bm, bk, bn, tr)
                    if nd * 5 // 4 + 4 * MiB > vmem_cap(a.chip) or (a.max_need_mib and nd > a.max_need_mib * MiB):
                        continue
                    r = analytic(a.chip, a.case, bm, bk, bn)
                    rows.append((r, bm, bk, bn, nd, pipelined(a.chip, a.case, bm, bk, bn)))
        rows.sort(key=lambda r: -r[5]["pipelined_pct"])  # the walk: the analytic model plus exposed copies
        for r, bm, bk, bn, nd, pp in rows[: a.top]:
            print(f"{a.chip} {a.case} bm={bm} bk={bk} bn={bn}: {r['pct_of_peak']:5.1f}% ({r['model_time_us']:,.0f} µs; "
                  f"MXU {r['mxu_us']:,} µs, HBM {r['hbm_us']:,} µs, {r['steps']} steps), VMEM {nd / MiB:.1f} MiB; "
                  f"pipelined walk {pp['pipelined_pct']}%")
        return 0
    for text in a.configs:
        bm, bk, bn = (int(v) for v in text.split(","))
        r = analytic(a.chip, a.case, bm, bk, bn)
        try:
            s = static(a.chip, a.case, bm, bk, bn, a.timeout)
        except Exception as e:  # noqa: BLE001 - report libtpu's failure and go on
            s = dict(static_error=str(e)[:300])
        print(f"{a.chip} {a.case} bm={bm} bk={bk} bn={bn}: analytic {r['pct_of_peak']}%, static {s}", flush=True)
        if a.what == "write":
            if "static_error" in s and not a.allow_no_static:
                print("  not written: the static estimate failed (--allow-no-static records it anyway)", file=sys.stderr)
                continue
            from tpukernels.autotune import db
            from tpukernels.autotune.space import Problem

            kernel, args, kwargs, *_ = _dims(a.case)
            prob = Problem.from_args(kernel, *args, **kwargs)
            note = ("models, not measurements: the libtpu static estimate (fitted from reduced problems as in "
                    "`tpukernels bench --family grouped_matmul`) and the analytic schedule model (exact Pallas block "
                    f"copies and MXU work of the real schedule at group_sizes, HBM/MXU rooflines, {STEP_US} µs per "
                    "grid step; pipelined_*: the same walked step by step with each step's copies overlapping only the "
                    "previous step's compute); chosen by benchmarks/grouped_matmul_configs.py. " + a.why).strip()
            ev = dict(evaluator="libtpu-static-estimate+analytic-schedule-model", model_time_us=r["model_time_us"],
                      pct_of_peak=r["pct_of_peak"], group_sizes=r["group_sizes"], note=note)
            ev.update(pipelined(a.chip, a.case, bm, bk, bn))
            if "static_error" in s:
                ev["static_estimate_error"] = s["static_error"]
            else:
                ev.update(static_estimate_us=s["static_us"], static_pct_of_peak=s["static_pct"])
            path = db.shipped_db_path(kernel.qualname, a.chip)
            db.record(kernel, a.chip, prob.specs, prob.statics, dict(bm=bm, bk=bk, bn=bn), ev, path=path)
            print(f"  recorded in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
