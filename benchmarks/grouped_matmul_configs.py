"""How the shipped forward grouped-matmul configs were chosen (issue 15): two models, no measurement.

* ``rank``: every ``(bm, bk, bn)`` whose scoped-VMEM request fits the chip (``scoped_vmem_limit`` of
  :mod:`tpukernels.library.vmem`: 7/8 of jax's ``vmem_capacity_bytes``), ranked by the *analytic
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

    return importlib.import_module("tpukernels.library.grouped_matmul_ops")


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
    bm_, bk_, bn_ = gm.clamp(M, bm), gm.clamp(K, bk), gm.clamp(N, bn)
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
    bk_, bn_ = gm.clamp(K, bk), gm.clamp(N, bn)
    steps = -(-N // bn_) * c["items"] * -(-K // bk_)
    mxu = c["mxu_flops"] / peak_flops(chip) * 1e6
    hbm = c["hbm_bytes"] / hbm_bandwidth(chip) * 1e6
    t = max(mxu, hbm) + STEP_US * steps
    ideal = 2 * M * K * N / peak_flops(chip) * 1e6
    return dict(model_time_us=round(t, 1), pct_of_peak=round(100 * ideal / t, 1), mxu_us=round(mxu), hbm_us=round(hbm),
                steps=steps, group_sizes=sizes)


def pipelined(chip, case, bm, bk, bn, rhs_prefetch=True) -> dict:
    """A step-by-step walk of the real schedule (what neither model above sees), copies sharing the HBM
    bandwidth equally while several are in flight (a fluid model): each grid step waits for its blocks, takes
    its MXU time + 0.35 µs, and at its start the pipeline issues the next step's changed blocks (lhs, and the
    previous output tile's write-back). The rhs block is copied

    * ``rhs_prefetch`` (the kernel's manual chain, at one K step with ``bn | N``): run q + 1's block (a run:
      consecutive items of one group) issued at the first step of run q, so a copy has a whole group to finish;
    * else by the grid pipeline, issued one step ahead: at ``bk = K`` a group change exposes the new ``[K, bn]``
      block's copy minus one item's compute.

    Returns ``{"pipelined_us", "pipelined_pct", "pipelined_variant"}``."""
    import jax.numpy as jnp
    import numpy as np

    from tpukernels.bench.grouped_matmul import SKEW
    from tpukernels.perf import hbm_bandwidth, peak_flops

    gm = _gm()
    _, _, _, M, K, N, tr = _dims(case)
    mx = gm.MIXTRAL
    sizes = gm.skewed_group_sizes(mx["tokens"], mx["top_k"], mx["experts"], SKEW)
    bm_, bk_, bn_ = gm.clamp(M, bm), gm.clamp(K, bk), gm.clamp(N, bn)
    T = gm.num_items(M, len(sizes), bm_)
    (tab,) = gm.fwd_schedule(jnp.asarray(sizes, jnp.int32), jnp.zeros(1, jnp.int32), M=M, G=len(sizes), bm=bm_, T=T)
    tab = np.asarray(tab).reshape(gm.N_FIELDS_FWD, T)
    compute = ((tab[gm.F_FLAGS] ^ gm.ALL) & gm.COMPUTE) != 0
    gk, gn = -(-K // bk_), -(-N // bn_)
    manual = bool(rhs_prefetch) and gk == 1 and N % bn_ == 0
    bw, pk = hbm_bandwidth(chip) / 1e6, peak_flops(chip) / 1e6  # bytes / µs, FLOP / µs
    steps = []  # per grid step: (MXU µs, lhs idx, rhs idx, out idx)
    for n in range(gn):
        for i in range(T):
            for k in range(gk):
                ke = k if compute[i] else gk - 1
                steps.append((2 * bm_ * bk_ * bn_ / pk if compute[i] else 0.0, (tab[gm.F_SRC_TILE, i], ke),
                              (tab[gm.F_GROUP, i], ke, n), (tab[gm.F_TILE, i], n)))
    lhs_b, rhs_b, out_b = bm_ * bk_ * 2, bk_ * bn_ * 2, bm_ * bn_ * 2
    active, done = {}, {}  # copy id -> bytes left; copy id -> completion time
    now = [0.0]

    def advance(until=None, need=()):
        """Run the fluid copies to time ``until`` or until every copy in ``need`` is done; returns the time."""
        while active and (until is None or now[0] < until) and not (need and all(c in done for c in need)):
            rate = bw / len(active)
            cid = min(active, key=active.get)
            t_fin = now[0] + active[cid] / rate
            if until is not None and t_fin > until:
                for c in active:
                    active[c] -= (until - now[0]) * rate
                now[0] = until
                break
            for c in list(active):
                active[c] -= active[cid] if c == cid else (t_fin - now[0]) * rate
            now[0] = t_fin
            for c in [c for c, b in active.items() if b <= 1e-6]:
                done[c] = t_fin
                del active[c]
        if until is not None:
            now[0] = max(now[0], until)
        return now[0]

    def issue(cid, nbytes):
        if cid not in done and cid not in active:
            active[cid] = float(nbytes)

    # rhs runs (the kernel's chain): consecutive steps with one rhs block index
    runs = [0]
    for s in range(1, len(steps)):
        runs.append(runs[-1] + (steps[s][2] != steps[s - 1][2]))
    first = {}
    for s, q in enumerate(runs):
        first.setdefault(q, s)
    issue(("lhs", 0), lhs_b)
    issue(("rhs", 0), rhs_b)
    t = 0.0
    for s, (c, li, ri, oi) in enumerate(steps):
        need = [("lhs", s) if s == 0 or steps[s - 1][1] != li else None,
                ("rhs", runs[s]) if s == 0 or steps[s - 1][2] != ri else None]
        need = [x for x in need if x is not None]
        advance(until=t)
        t = max(t, advance(need=need)) if need else t
        now[0] = t
        if s + 1 < len(steps):
            c1, l1, r1, o1 = steps[s + 1]
            if l1 != li:
                issue(("lhs", s + 1), lhs_b)
            if o1 != oi:
                issue(("out", s), out_b)  # write-back of this step's tile once the next step moves on
            if manual:
                if first.get(runs[s] + 1) is not None and first[runs[s]] == s:
                    issue(("rhs", runs[s] + 1), rhs_b)
            elif r1 != ri:
                issue(("rhs", runs[s + 1]), rhs_b)
        t += c + STEP_US
    t = advance(need=list(active)) if active else t
    ideal = 2 * M * K * N / pk
    return dict(pipelined_us=round(max(t, now[0]), 1), pipelined_pct=round(100 * ideal / max(t, now[0]), 1),
                pipelined_variant="manual rhs prefetch chain" if manual else "grid-pipeline rhs blocks")


def static(chip, case, bm, bk, bn, timeout_s=280, rhs_prefetch=True) -> dict:
    """libtpu's static estimate of ours at an explicit config, fitted as the bench does."""
    from _grouped_static import static_estimate

    kernel, args, kwargs, M, K, N, _ = _dims(case)
    return static_estimate(kernel, args, kwargs, M, K, N, chip,
                           dict(bm=bm, bk=bk, bn=bn, rhs_prefetch=bool(rhs_prefetch)), timeout_s)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("rank", "estimate", "write"))
    p.add_argument("chip")
    p.add_argument("case", choices=tuple(CASES))
    p.add_argument("configs", nargs="*", help="bm,bk,bn[,rhs_prefetch 1|0] (default 1)")
    p.add_argument("--max-need-mib", type=float, default=None, help="rank: only configs with a smaller footprint")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--timeout", type=float, default=280, help="per libtpu estimate, seconds (a short one: cache hits only)")
    p.add_argument("--why", default="", help="write: a sentence on why this config (goes into the evidence note)")
    p.add_argument("--allow-no-static", action="store_true",
                   help="write: record the config even where libtpu cannot estimate it (the error goes into the evidence)")
    a = p.parse_args(argv)
    gm = _gm()
    from tpukernels.library.vmem import MiB, vmem_cap
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
        bm, bk, bn, *rest = (int(v) for v in text.split(","))
        pf = bool(rest[0]) if rest else True
        r = analytic(a.chip, a.case, bm, bk, bn)
        try:
            s = static(a.chip, a.case, bm, bk, bn, a.timeout, pf)
        except Exception as e:  # noqa: BLE001 - report libtpu's failure and go on
            s = dict(static_error=str(e)[:300])
        pp = pipelined(a.chip, a.case, bm, bk, bn, pf)
        print(f"{a.chip} {a.case} bm={bm} bk={bk} bn={bn} rhs_prefetch={pf}: analytic {r['pct_of_peak']}%, "
              f"walk {pp['pipelined_pct']}% ({pp['pipelined_variant']}), static {s}", flush=True)
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
            ev.update(pp)
            if "static_error" in s:
                ev["static_estimate_error"] = s["static_error"]
            else:
                ev.update(static_estimate_us=s["static_us"], static_pct_of_peak=s["static_pct"])
            path = db.shipped_db_path(kernel.qualname, a.chip)
            db.record(kernel, a.chip, prob.specs, prob.statics, dict(bm=bm, bk=bk, bn=bn, rhs_prefetch=pf), ev,
                      path=path)
            print(f"  recorded in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
