"""How many evaluations each autotune strategy needs to come within 3% of the exhaustive best.

For five library kernels (the first standard case of each) on two chips, this

1. computes the whole space's table ONCE with ``tpukernels.autotune.tuner.tune(..., strategy="exhaustive")``
   and the evaluator ``TpuModelEvaluator(chip, cycles=False, compile=False)``: the tpu-model's roofline +
   grid-step-overhead terms (``max(HBM bytes / bandwidth + steps x 0.35 us, FLOPs / peak)``) from the lowering,
   with the space's static pruning (constraints, block rules, VMEM). It is a MODEL, and the cheaper one: the
   default tpu-model also compiles every candidate with libtpu and adds libtpu's static cycle estimate, which
   took 20-60 s per candidate on this loaded 2-core host (a full table of ~150-500 candidates: hours);
2. replays each strategy over the cached table (the real strategy classes, asked and told one candidate at a
   time, as a 1-worker sweep) with seeds 0..N-1, counting the evaluations until the best so far is within 3%
   of the table's best (pruned configs are free, as in a sweep).

The study's baseline (every strategy's first point) is the kernel's declared defaults, i.e. a chip without
tuning data (a shipped table's config would make every strategy's first evaluation the answer).

    .venv/bin/python -m tpukernels.bench.strategy_study              # tables (cached in the JSON) + replays
    .venv/bin/python -m tpukernels.bench.strategy_study --markdown   # print the table from the saved JSON

Writes ``benchmarks/results/strategy_study.json`` (``--out``); ``tpukernels bench`` renders it into BENCHMARKS.md
("Tuner strategies"). In the package, not in ``benchmarks/``: it computes a published figure (ARCHITECTURE.md).
"""

import argparse
import json
import os
import statistics
import sys
import time

from .report import STRATEGIES as _REPORT_STRATEGIES
from .report import strategy_table

#: Where the study's results live by default (``tpukernels bench --results-dir`` reads them from there too).
DEFAULT_OUT = os.path.join("benchmarks", "results", "strategy_study.json")
KERNELS = ["tpukernels::matmul_nt", "tpukernels::quantized_matmul_kernel", "tpukernels::grouped_matmul_fwd",
           "tpukernels::flash_attention_fwd", "tpukernels::ragged_paged_attention_kernel"]
CHIPS = ["v5e", "v6e"]
STRATEGIES = list(_REPORT_STRATEGIES)
WITHIN = 0.03
OBJECTIVE = ("tpu-model roofline + grid-step overhead, no libtpu compile or static estimate "
             "(TpuModelEvaluator(cycles=False, compile=False)); a model, not a measurement")


def _key(config) -> str:
    return json.dumps(dict(config), sort_keys=True, default=repr)


def _case(name):
    from .. import library

    return next((k, a, kw) for k, a, kw in library.standard_cases() if k.qualname == name)


def _space(kernel, args, kwargs, chip):
    from ..autotune.space import Problem, Space
    from ..chips import get_chip

    space = Space(Problem.from_args(kernel, *args, **kwargs), get_chip(chip))
    space.baseline, space.baseline_source = kernel.space.default(), "default"  # a chip without tuning data
    return space


def table(name: str, chip: str) -> dict:
    """The exhaustive sweep of one kernel x chip with the study's objective."""
    import warnings

    from ..autotune.evaluators import TpuModelEvaluator
    from ..autotune.tuner import tune

    kernel, args, kwargs = _case(name)
    space = _space(kernel, args, kwargs, chip)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = tune(kernel, *args, evaluator=TpuModelEvaluator(chip=chip, cycles=False, compile=False),
                 strategy=lambda s, seed: _Fixed(s, space), executor="inline", **kwargs)
    times = {_key(t.config): (t.time_us if t.ok else None) for t in r.trials}
    return {"kernel": name, "chip": chip, "problem": r.problem, "space_size": r.space_size,
            "evaluated": len(r.trials), "pruned": len(space.pruned), "best_us": r.best.time_us,
            "best_config": r.best.config, "seconds": round(time.monotonic() - t0, 1), "times_us": times}


class _Fixed:
    """Exhaustive over the study's space (declared defaults first)."""

    name = "exhaustive"

    def __init__(self, _space, space):
        from ..autotune.strategies import Exhaustive

        self._s = Exhaustive(space)

    def ask(self):
        return self._s.ask()

    def tell(self, config, time_us):
        pass

    def resume(self, prior):
        return []


def replay(strategy: str, space, times: dict, seed: int, target: float) -> int | None:
    """Evaluations until the best so far <= target (None: never)."""
    from ..autotune.strategies import make_strategy

    s = make_strategy(strategy, space, seed)
    best, n = float("inf"), 0
    while True:
        try:
            c = s.ask()
        except StopIteration:
            return None
        if c is None:  # serial replay: nothing is pending
            return None
        n += 1
        t = times[_key(c)]
        s.tell(c, t)
        if t is not None and t < best:
            best = t
        if best <= target:
            return n


def study(seeds: int, log, out: str = DEFAULT_OUT) -> dict:
    """Tables (cached in ``out``) and the replays (module docstring); returns the data written to ``out``."""
    data = {"objective": OBJECTIVE, "within": WITHIN, "seeds": seeds, "tables": [], "rows": []}
    if os.path.exists(out):
        with open(out) as f:
            old = json.load(f)
        if old.get("objective") == OBJECTIVE:
            data["tables"] = old.get("tables", [])
    have = {(t["kernel"], t["chip"]) for t in data["tables"]}
    for name in KERNELS:
        for chip in CHIPS:
            if (name, chip) not in have:
                log(f"table {name} {chip} ...")
                data["tables"].append(table(name, chip))
                log(f"  {data['tables'][-1]['evaluated']} configs in {data['tables'][-1]['seconds']} s")
    _save(data, out)  # the tables are the expensive part: keep them before the replays
    import warnings

    for tab in data["tables"]:
        kernel, args, kwargs = _case(tab["kernel"])
        space = _space(kernel, args, kwargs, tab["chip"])
        for c in space.all_configs():  # check in the table's order: the same configs are pruned as duplicates
            space.check(c)
        target = tab["best_us"] * (1 + WITHIN)
        valid = tab["evaluated"]
        row = {"kernel": tab["kernel"], "chip": tab["chip"], "valid": valid, "space_size": tab["space_size"]}
        for strat in STRATEGIES:
            t0 = time.monotonic()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ns = [replay(strat, space, tab["times_us"], seed, target)
                      for seed in range(1 if strat == "exhaustive" else seeds)]
            ns = [valid + 1 if n is None else n for n in ns]
            row[strat] = {"median": statistics.median(ns), "worst": max(ns), "runs": ns}
            log(f"{tab['kernel']} {tab['chip']} {strat}: median {row[strat]['median']} worst {max(ns)} of {valid}"
                f" ({time.monotonic() - t0:.1f} s)")
        data["rows"].append(row)
    return data


def _save(data: dict, out: str) -> None:
    from ..autotune.db import versions

    data["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    data["versions"] = versions()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def markdown(data: dict) -> str:
    """The study's table (the same lines BENCHMARKS.md gets)."""
    return "\n".join(strategy_table(data))


def main(argv=None):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="the study's JSON (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--markdown", action="store_true", help="print the markdown table of the saved results only")
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.out) as f:
            print(markdown(json.load(f)))
        return
    data = study(args.seeds, lambda m: print(m, file=sys.stderr, flush=True), args.out)
    _save(data, args.out)
    print(markdown(data))


if __name__ == "__main__":
    main()
