"""``tpukernels bench``: every library kernel against XLA and the best public Pallas TPU kernels, by the
same estimator, plus host-side costs on this CPU; writes ``BENCHMARKS.md`` (tables + PNG plots).

Families (one module each; long runs can be split by family): ``norms``, ``matmul``, ``attention``
(model estimates for compile-only TPU chips, see :mod:`tpukernels.bench.core`) and ``host`` (wall-clock
measurements on this CPU, see :mod:`tpukernels.bench.host`). Each family's figures are saved to
``<results_dir>/<family>.json`` with the package versions; the report is rebuilt from all saved families
and refuses to mix versions (:class:`tpukernels.bench.core.VersionMismatch`).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import os
import sys
import threading
import time

from .core import (  # noqa: F401  (the family lists live in core, which this package's modules share)
    CALIBRATION_FAMILIES,
    DEFAULT_CHIPS,
    FAMILIES,
    MODEL_FAMILIES,
    Estimator,
    VersionMismatch,
    default_cache_path,
    load_results,
    run_case,
    save_result,
)


def family_module(name: str):
    if name not in FAMILIES:
        from ..errors import ArgumentError

        raise ArgumentError(f"family {name!r} is not one of {', '.join(FAMILIES)}")
    return importlib.import_module(f"{__name__}.{name}")


def attach_reasons(name: str, rows: list[dict]) -> list[dict]:
    """Set each tpukernels row's ``reason`` from the family module's current ``reason()`` (in place)."""
    mod = family_module(name)
    for r in rows:
        r["reason"] = mod.reason(r) if r["kind"] == "ours" else None
    return rows


def model_kind() -> str:
    from ..autotune.db import versions

    return (f"model estimate: libtpu {versions().get('libtpu')} static estimated_cycles of the program compiled "
            "for a compile-only TPU target, combined with the chip's HBM and MXU rooflines "
            "(tpukernels.perf.model_time); not a TPU measurement")


def run_family(name: str, chips, results_dir: str, *, jobs: int = 1, cache_path: str | None = None,
               timeout_s: float = 1800, log=None, progress=None) -> dict:
    """Run one family and save ``<results_dir>/<name>.json``; returns the result dict.

    ``progress(done, total)``, if given, is called with ``(0, cases)`` before the first case and after each
    finished case (from the worker threads; ``tpukernels bench`` draws its bar and ETA from it)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    mod = family_module(name)
    path = os.path.join(results_dir, f"{name}.json")
    t0 = time.perf_counter()
    if name == "host":
        result = mod.run(log=log)
        return save_result(path, name, mod.KIND, result.pop("rows"), dict(result, seconds=round(time.perf_counter() - t0)))
    from ..targets.compile_only import require_libtpu

    require_libtpu()
    est = Estimator(cache_path if cache_path is not None else default_cache_path(), timeout_s)
    if name in CALIBRATION_FAMILIES:  # measured peer rows, each modelled (bench/calibration.py)
        result = mod.run(list(chips), est, log=log)
        rows = attach_reasons(name, result.pop("rows"))
        extra = dict(result, chips=list(chips), seconds=round(time.perf_counter() - t0),
                     cache={"hits": est.hits, "misses": est.misses}, doc=(mod.__doc__ or "").strip())
        return save_result(path, name, model_kind(), rows, extra)
    cases = mod.cases(list(chips))
    log(f"== {name}: {len(cases)} cases x {len(cases[0].impls) if cases else 0} implementations on {', '.join(chips)}")
    from ..autotune.sweep_warnings import once_per_run

    done = [0]
    lock = threading.Lock()

    def one(case):
        rows = run_case(case, est, log)
        if progress is not None:
            with lock:
                done[0] += 1
                progress(done[0], len(cases))
        return rows

    if progress is not None:
        progress(0, len(cases))
    with once_per_run(f"tpukernels bench {name} ({len(cases)} cases)"), cf.ThreadPoolExecutor(max(1, jobs)) as ex:
        per_case = list(ex.map(one, cases))  # warnings: one summary per category
    rows = attach_reasons(name, [r for rs in per_case for r in rs])
    extra = {"chips": list(chips), "seconds": round(time.perf_counter() - t0),
             "cache": {"hits": est.hits, "misses": est.misses}, "doc": (mod.__doc__ or "").strip()}
    return save_result(path, name, model_kind(), rows, extra)


__all__ = ["FAMILIES", "MODEL_FAMILIES", "DEFAULT_CHIPS", "run_family", "load_results", "VersionMismatch",
           "Estimator"]
