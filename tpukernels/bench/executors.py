"""Autotune executors on this machine: candidates per second for inline, process and Ray (measurements).

Two sweeps of ``tpukernels::matmul_nn`` candidates (exhaustive order), each on every executor:

* ``overhead``: a :class:`NullEvaluator` that does no work, so the rate is what the executor itself can
  dispatch (job pickling, scheduling, result transport).
* ``tpu-model``: the real ``tpu-model`` evaluator without libtpu's cycle estimate (``cycles=False``: each
  candidate is a Mosaic + XLA:TPU compile for v5e, the work a sweep does), so the rate is compile-bound.

Worker start-up (spawning processes / starting the local Ray cluster and importing jax in the workers) is
measured separately and not in the rates. ``workers`` defaults to this machine's CPUs.
"""

from __future__ import annotations

import dataclasses
import os
import time

from ..autotune.evaluators import Evaluator, Trial


@dataclasses.dataclass
class NullEvaluator(Evaluator):
    """A candidate costs nothing: ``time_us`` = the sum of its config values (deterministic)."""

    name: str = "null"
    label: str = "model"

    def evaluate(self, problem, config):
        return Trial(dict(config), "ok", time_us=float(sum(v for v in dict(config).values() if isinstance(v, int))))


def _executor(kind: str, workers: int):
    from ..autotune.executors import InlineExecutor, ProcessExecutor, RayExecutor

    if kind == "inline":
        return InlineExecutor()
    if kind == "process":
        return ProcessExecutor(workers, imports=["tpukernels.library", __name__])
    return RayExecutor(workers, imports=["tpukernels.library", __name__])


def _warm(ex, kind: str) -> float:
    """Start the executor's workers (timed); every worker imports jax and the library."""
    t0 = time.perf_counter()
    if kind == "ray":
        ex.start()
    if kind != "inline":
        futs = [ex.submit(_ping) for _ in range(ex.slots * 2)]
        for f in futs:
            f.result(timeout=600)
    return time.perf_counter() - t0


def _ping() -> int:
    import tpukernels.library  # noqa: F401

    return os.getpid()


SWEEPS = {
    # name: (shapes, evaluator factory, candidates)
    "overhead": (("1x2048x2048:bf16", "1x2048x2048:bf16"), lambda: NullEvaluator(), 120),
    "tpu-model": (("1x1024x1024:bf16", "1x1024x1024:bf16"),
                  lambda: __import__("tpukernels.autotune.evaluators", fromlist=["x"]).TpuModelEvaluator(
                      chip="v5e", cycles=False), 16),
}


def run(workers: int | None = None, kinds=("inline", "process", "ray"), sweeps=tuple(SWEEPS), log=print) -> list[dict]:
    """Rows ``{"executor", "sweep", "workers", "candidates", "seconds", "candidates_per_s", "startup_s"}``."""
    import tpukernels.library  # noqa: F401
    from ..autotune.tuner import tune
    from ..dsl.kernel import REGISTRY
    from ..targets.compile_only import compile_only_env

    compile_only_env()
    workers = workers or os.cpu_count() or 1
    kernel = REGISTRY["tpukernels::matmul_nn"]
    rows = []
    for kind in kinds:
        with _executor(kind, workers) as ex:
            startup = _warm(ex, kind)
            for sweep in sweeps:
                shapes, make_ev, n = SWEEPS[sweep]
                ev = make_ev()
                if sweep == "tpu-model":  # first compile in each worker (jax + libtpu warm-up) is not the rate
                    tune(kernel, *shapes, evaluator=ev, strategy="exhaustive", budget=ex.slots, executor=ex)
                t0 = time.perf_counter()
                r = tune(kernel, *shapes, evaluator=ev, strategy="exhaustive", budget=n, executor=ex,
                         candidate_timeout_s=600)
                dt = time.perf_counter() - t0
                rows.append({"executor": kind, "sweep": sweep, "workers": 1 if kind == "inline" else ex.slots,
                             "candidates": len(r.trials), "ok": len(r.ok_trials), "seconds": round(dt, 3),
                             "candidates_per_s": len(r.trials) / dt, "startup_s": round(startup, 2)})
                log(f"   {kind:8s} {sweep:10s} {len(r.trials)} candidates in {dt:.2f} s: "
                    f"{len(r.trials) / dt:.1f}/s (start-up {startup:.1f} s)")
    return rows


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
