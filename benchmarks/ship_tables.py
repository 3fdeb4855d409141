"""Shipped tuning entries for chips without them (v4, v5p): every library kernel at its standard shapes.

For each ``library.standard_cases()`` case without an exact shipped entry on ``--chip``, this runs the
autotuner (``tpukernels.autotune.tuner.tune``, strategy ``exhaustive``) with the cheap model objective
``TpuModelEvaluator(chip, cycles=False, compile=False)``: the tpu-model's ``max(HBM bytes / bandwidth + grid
steps x 0.35 us, FLOPs / peak)`` over the whole space after its static pruning (constraints, block rules,
VMEM over the chip's scoped limit) -- a MODEL, without libtpu's static cycle estimate (20-60 s per candidate on
a loaded 2-core host). The best configs, in model order, are then compiled for the chip with libtpu
(compile-only ``compile_for``) until one compiles (at most ``--tries``); that one is written to
``tpukernels/data/autotuning/<chip>/`` with its evidence (objective, model time, compile result). A case where
none compiles is printed with the compiler's reasons (record it in ``tpukernels/data/autotuning/coverage.json``).

    nice -n 10 .venv/bin/python benchmarks/ship_tables.py --chip v4 [--kernel matmul_nn] [--force]
    .venv/bin/python benchmarks/ship_tables.py --chip v4 --prune-stale   # entries of an earlier kernel source
    .venv/bin/python benchmarks/ship_tables.py --chip v6e --kernel K --rekey  # keep a changed kernel's configs
    .venv/bin/python benchmarks/ship_tables.py --chip v6e --drop-failing   # then a plain run re-tunes them

``--drop-failing`` drops the standard cases' shipped entries whose config the kernel's own static checks reject
on the chip (``Space.check``: constraints, block rules, VMEM over the scoped limit): dispatch would warn and fall
back from them. A plain run afterwards tunes those cases again over the checked space.

``--rekey`` is for a kernel whose source changed without changing what its tunables mean (e.g. control flow
decided statically that was decided at run time): each standard case's config from the newest entry keyed to an
earlier source (same chip, dtypes and statics; a static added since counts as its default) is compiled for the
chip with the current source and, if it compiles, written under the current source's key; its evidence says so,
and its figures stay labelled as the earlier source's.
"""

import argparse
import inspect
import json
import os
import sys
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's tpukernels

OBJECTIVE = ("tpu-model roofline + grid-step overhead over the whole space (exhaustive, no libtpu static "
             "estimate); winner compile-checked with libtpu compile-only")


def ship(chip: str, only: str | None, force: bool, tries: int) -> int:
    from tpukernels import library
    from tpukernels.autotune import db
    from tpukernels.autotune.evaluators import TpuModelEvaluator
    from tpukernels.autotune.space import Problem
    from tpukernels.autotune.tuner import tune
    from tpukernels.targets.compile_only import compile_for, compile_only_env

    compile_only_env()
    with open(os.path.join(os.path.dirname(os.path.dirname(db.shipped_db_path("x", chip))), "coverage.json")) as f:
        reasons = {(m["kernel"], m["chip"], m["problem"]) for m in json.load(f)["missing"]}
    missing = 0
    slow = ("flash_attention", "ragged_paged")  # the longest compiles last: the cheap cases land first
    cases = sorted(library.standard_cases(), key=lambda c: c[0].name.startswith(slow))
    for kernel, args, kwargs in cases:
        if only and kernel.name != only:
            continue
        problem = Problem.from_args(kernel, *args, **kwargs)
        path = db.shipped_db_path(kernel.qualname, chip)
        key = db.entry_key(kernel, problem.lowered_specs, problem.statics)
        if not force and db.find(db.load(path), key)[1] == "exact":
            continue
        if (kernel.qualname, chip, problem.describe()) in reasons:  # no entry, by design (coverage.json)
            continue
        t0 = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = tune(kernel, *args, evaluator=TpuModelEvaluator(chip=chip, cycles=False, compile=False),
                     strategy="exhaustive", executor="inline", resume=False, **kwargs)
        ranked = sorted(r.ok_trials, key=lambda t: t.rank_key)
        print(f"  {kernel.name} {r.problem}: {len(r.trials)} configs modelled in {time.monotonic() - t0:.0f} s",
              file=sys.stderr, flush=True)
        call_args, call_kwargs = problem.call_args()
        reasons = []
        for i, t in enumerate(ranked[:tries]):
            res = compile_for(kernel, chip, *call_args, config=dict(t.config), with_mlir=False, **call_kwargs)
            if not res.ok:
                reasons.append(f"{t.config}: {res.error_kind}: {(res.error or '')[:200]}")
                continue
            default = r.default
            evidence = {
                "evaluator": "tpu-model", "label": "model", "objective": OBJECTIVE, "time_us": round(t.time_us, 3),
                "default_time_us": None if default is None or not default.ok else round(default.time_us, 3),
                "strategy": "exhaustive", "evaluated": len(r.trials), "pruned": len(r.pruned), "problem": r.problem,
                "model_rank": i + 1, "bound": t.details.get("bound"),
                "compiled": f"ok (compile-only for {chip}, {res.compile_seconds:.1f} s)",
                "vmem_estimate_bytes": res.vmem_estimate_bytes,
            }
            db.record(kernel, chip, problem.lowered_specs, problem.statics, t.config, evidence, path=path)
            print(f"{chip} {kernel.name} {r.problem}: {t.config} {t.time_us:.1f} us (model, rank {i + 1} of "
                  f"{len(ranked)}), compiled; {time.monotonic() - t0:.0f} s", flush=True)
            break
        else:
            missing += 1
            print(f"{chip} {kernel.name} {r.problem}: NO ENTRY ({len(ranked)} ok by the model); "
                  + " | ".join(reasons), flush=True)
    return missing


def prune_stale(chip: str, only: str | None) -> int:
    """Drop shipped entries keyed to an earlier source of their kernel (``source_hash`` != today's): a lookup
    never matches them. Only package data; a user's tuning DB is never pruned. Returns the entries dropped."""
    from filelock import FileLock

    from tpukernels import library  # noqa: F401  (registers the library kernels)
    from tpukernels.autotune import db
    from tpukernels.dsl.kernel import REGISTRY

    dropped = 0
    for kernel in REGISTRY.values():
        if kernel.namespace != "tpukernels" or (only and kernel.name != only):
            continue
        path = db.shipped_db_path(kernel.qualname, chip)
        if not os.path.exists(path):
            continue
        with FileLock(path + ".lock", timeout=60):
            with open(path) as f:
                data = json.load(f)
            keep = [e for e in data["entries"] if e["key"].get("source_hash") == db.source_hash(kernel)]
            if len(keep) == len(data["entries"]):
                continue
            print(f"{chip} {kernel.name}: {len(data['entries']) - len(keep)} stale entries dropped, {len(keep)} kept")
            dropped += len(data["entries"]) - len(keep)
            data["entries"] = keep
            with open(path + ".tmp", "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(path + ".tmp", path)
    return dropped


def drop_failing(chip: str, only: str | None) -> int:
    """Drop the shipped entries of ``chip`` that a standard case would get and that fail its kernel's static
    checks (module docstring). Returns the entries dropped."""
    from filelock import FileLock

    from tpukernels import library
    from tpukernels.autotune import db
    from tpukernels.autotune.space import Problem, Space
    from tpukernels.chips import get_chip
    from tpukernels.dsl.spec import Config

    dropped = 0
    for kernel, args, kwargs in library.standard_cases():
        if only and kernel.name != only:
            continue
        problem = Problem.from_args(kernel, *args, **kwargs)
        path = db.shipped_db_path(kernel.qualname, chip)
        key = db.entry_key(kernel, problem.lowered_specs, problem.statics)
        entry, how = db.find(db.load(path), key)
        if how != "exact":
            continue
        config = Config({n: tuple(v) if isinstance(v, list) else v for n, v in entry["config"].items()})
        why = Space(problem, get_chip(chip)).check(config)
        if why is None:
            continue
        with FileLock(path + ".lock", timeout=60):
            with open(path) as f:
                data = json.load(f)
            data["entries"] = [e for e in data["entries"] if e["key"] != entry["key"]]
            with open(path + ".tmp", "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(path + ".tmp", path)
        print(f"{chip} {kernel.name} {problem.describe()}: {dict(config)} dropped ({why.kind}: "
              f"{why.reason[:160]})", flush=True)
        dropped += 1
    return dropped


def rekey(chip: str, only: str) -> int:
    """Re-key ``only``'s stale shipped entries on ``chip`` to its current source (module docstring). Returns
    the number of standard cases left without an exact entry."""
    from tpukernels import library
    from tpukernels.autotune import db
    from tpukernels.autotune.space import Problem
    from tpukernels.targets.compile_only import compile_for, compile_only_env

    compile_only_env()
    missing = 0
    for kernel, args, kwargs in library.standard_cases():
        if kernel.name != only:
            continue
        problem = Problem.from_args(kernel, *args, **kwargs)
        path = db.shipped_db_path(kernel.qualname, chip)
        key = db.entry_key(kernel, problem.lowered_specs, problem.statics)
        entries = db.load(path)
        if db.find(entries, key)[1] == "exact":
            continue
        same = {k: v for k, v in key.items() if k != "source_hash"}
        # a static the kernel gained since (with a default) is its default in an entry that predates it
        defaults = {q.name: q.default for q in kernel.params
                    if q.kind == "static" and q.default is not inspect.Parameter.empty}

        def as_now(k):
            k = {n: v for n, v in k.items() if n != "source_hash"}
            return dict(k, statics={n: k.get("statics", {}).get(n, defaults.get(n)) for n in same["statics"]})

        stale = [e for e in entries if e["key"].get("source_hash") != key["source_hash"]
                 and set(e["key"].get("statics", {})) <= set(same["statics"]) and as_now(e["key"]) == same]
        if not stale:
            print(f"{chip} {kernel.name} {problem.describe()}: no earlier entry to re-key", flush=True)
            missing += 1
            continue
        old = max(stale, key=lambda e: e.get("evidence", {}).get("date", ""))
        call_args, call_kwargs = problem.call_args()
        res = compile_for(kernel, chip, *call_args, config=dict(old["config"]), with_mlir=False, **call_kwargs)
        if not res.ok:
            print(f"{chip} {kernel.name} {problem.describe()}: {old['config']} does not compile: "
                  f"{res.error_kind}: {(res.error or '')[:200]}", flush=True)
            missing += 1
            continue
        ev = dict(old.get("evidence", {}))
        evidence = {k: v for k, v in ev.items() if k not in ("date", "versions", "compiled", "vmem_estimate_bytes")}
        evidence.update({
            "rekeyed": f"config of the entry for the earlier kernel source {old['key'].get('source_hash')} "
                       f"({ev.get('date', '?')}); its figures are that source's",
            "compiled": f"ok (compile-only for {chip}, {res.compile_seconds:.1f} s, current source)",
            "vmem_estimate_bytes": res.vmem_estimate_bytes,
        })
        db.record(kernel, chip, problem.lowered_specs, problem.statics, old["config"], evidence, path=path)
        print(f"{chip} {kernel.name} {problem.describe()}: {old['config']} re-keyed (compiled)", flush=True)
    return missing


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chip", required=True)
    p.add_argument("--kernel", help="only this kernel (its short name)")
    p.add_argument("--force", action="store_true", help="replace existing exact entries")
    p.add_argument("--tries", type=int, default=3, help="compile at most this many of the model's best configs")
    p.add_argument("--prune-stale", action="store_true",
                   help="only drop entries keyed to an earlier kernel source (no tuning)")
    p.add_argument("--rekey", action="store_true",
                   help="with --kernel: re-key the kernel's entries of an earlier source (compile-checked)")
    p.add_argument("--drop-failing", action="store_true",
                   help="only drop entries whose config fails the kernel's static checks on the chip (no tuning)")
    args = p.parse_args()
    if args.drop_failing:
        drop_failing(args.chip, args.kernel)
        sys.exit(0)
    if args.rekey:
        if not args.kernel:
            p.error("--rekey needs --kernel")
        sys.exit(1 if rekey(args.chip, args.kernel) else 0)
    if args.prune_stale:
        prune_stale(args.chip, args.kernel)
        sys.exit(0)
    sys.exit(1 if ship(args.chip, args.kernel, args.force, args.tries) else 0)


if __name__ == "__main__":
    main()
