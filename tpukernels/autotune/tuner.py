"""The sweep: search a kernel's tunable space for one problem under a budget, optionally store the winner.

    from tpukernels.autotune import tune
    res = tune(matmul, "4096x4096:bf16", "4096x4096:bf16", chip="v5e", strategy="coordinate", budget=16,
               workers=2, write_db="user")
    print(res.best.config, res.best.time_us, res.label)      # the time is a *model* for tpu-model sweeps

A sweep never stops because of one candidate: compile errors, VMEM overflows, wrong results, exceptions,
worker crashes and per-candidate timeouts are recorded on that candidate's :class:`Trial` and the search
goes on. It stops when the strategy has nothing left, ``budget`` candidates were evaluated, or ``seconds``
elapsed (candidates still running then are abandoned and recorded as ``cancelled``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import concurrent.futures.process  # noqa: F401 - cf.process.BrokenProcessPool below
import dataclasses
import time
from collections.abc import Callable

from ..dsl.kernel import TpuKernel
from ..dsl.spec import Config
from ..errors import ArgumentError
from . import db
from .evaluators import Evaluator, KernelRef, MeasureEvaluator, TpuModelEvaluator, Trial, run_job
from .executors import Executor, InlineExecutor, ProcessExecutor
from .space import Problem, Space
from .strategies import Strategy, make_strategy
from .sweep_warnings import emit_summary


@dataclasses.dataclass
class SweepResult:
    """Everything a sweep found (times are a model or a measurement: see :attr:`label`)."""

    kernel: str
    chip: str | None
    problem: str
    evaluator: str
    label: str
    strategy: str
    budget: dict
    space_size: int
    trials: list
    pruned: list
    elapsed_s: float
    stopped: str
    db_path: str | None = None
    db_note: str | None = None
    #: where the baseline (the :attr:`default` trial) came from: the config a call gets today, e.g.
    #: ``"shipped-db:v5e"``, ``"user-db:v6e"``, ``"heuristic"`` or ``"default"`` (``Space.default``)
    baseline_source: str = "default"

    @property
    def ok_trials(self) -> list[Trial]:
        return [t for t in self.trials if t.ok]

    @property
    def best(self) -> Trial | None:
        return min(self.ok_trials, key=lambda t: t.rank_key, default=None)

    @property
    def default(self) -> Trial | None:
        """The baseline's trial (the config a call gets today, :attr:`baseline_source`; every strategy
        evaluates it first), if it ran."""
        return next((t for t in self.trials if t.details.get("is_default")), None)

    @property
    def speedup(self) -> float | None:
        b, d = self.best, self.default
        return d.time_us / b.time_us if b and d and d.ok and b.time_us else None

    @property
    def failures(self) -> collections.Counter:
        """Failed candidates by reason kind (compile errors, mismatches, timeouts, crashes...)."""
        return collections.Counter(t.error_kind or t.status for t in self.trials if not t.ok)

    @property
    def pruned_kinds(self) -> collections.Counter:
        return collections.Counter(p.kind for p in self.pruned)

    def to_dict(self) -> dict:
        best, default = self.best, self.default
        return {
            "kernel": self.kernel, "chip": self.chip, "problem": self.problem, "evaluator": self.evaluator,
            "label": self.label, "strategy": self.strategy, "budget": self.budget, "space_size": self.space_size,
            "elapsed_s": round(self.elapsed_s, 3), "stopped": self.stopped,
            "best": None if best is None else best.to_dict(), "default": None if default is None else default.to_dict(),
            "speedup_vs_default": self.speedup, "evaluated": len(self.trials), "ok": len(self.ok_trials),
            "failures": dict(self.failures), "pruned": dict(self.pruned_kinds),
            "trials": [t.to_dict() for t in self.trials], "pruned_configs": [p.to_dict() for p in self.pruned],
            "db_path": self.db_path, "db_note": self.db_note, "baseline_source": self.baseline_source,
        }


def make_evaluator(evaluator: "str | Evaluator", chip: str | None = None, **options) -> Evaluator:
    """``"tpu-model"`` (needs ``chip``) or ``"measure"``, or an :class:`Evaluator` instance as is."""
    if isinstance(evaluator, Evaluator):
        return evaluator
    if evaluator == "tpu-model":
        if chip is None:
            raise ArgumentError("the tpu-model evaluator needs a chip (--chip v5e, v6e, tpu7x, ...)")
        return TpuModelEvaluator(chip=chip, **options)
    if evaluator == "measure":
        return MeasureEvaluator(**options)
    raise ArgumentError(f"evaluator {evaluator!r}: choose tpu-model or measure")


def _make_executor(workers: int, evaluator: Evaluator, kernel: TpuKernel, imports, kind: str | None = None
                   ) -> Executor:
    """``kind``: ``"inline"``, ``"process"``, ``"ray"`` (a local Ray cluster of ``workers`` CPUs), or None:
    process workers when ``workers > 1`` and the evaluator runs in parallel, else inline."""
    ref = KernelRef.of(kernel)
    mods = [*(imports or ()), *([ref.source] if ref.source else [])]
    if kind == "ray":
        from .executors import RayExecutor

        return RayExecutor(workers if workers > 1 else None, imports=mods)
    if kind not in (None, "inline", "process"):
        raise ArgumentError(f"executor {kind!r}: choose inline, process or ray")
    if kind == "inline" or not evaluator.parallel or (kind is None and workers <= 1):
        return InlineExecutor()
    return ProcessExecutor(workers, imports=mods)


def _config_label(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(config.items())) or "{}"


def tune(
    kernel: TpuKernel,
    *args,
    chip: str | None = None,
    evaluator: "str | Evaluator" = "tpu-model",
    strategy: "str | Callable" = "coordinate",
    budget: int | None = None,
    seconds: float | None = None,
    workers: int = 1,
    executor: "Executor | str | None" = None,
    seed: int = 0,
    write_db: str | None = None,
    force_db: bool = False,
    candidate_timeout_s: float = 600.0,
    imports=(),
    progress: Callable | None = None,
    values: dict | None = None,
    resume: bool = True,
    **kwargs,
) -> SweepResult:
    """Search ``kernel``'s tunable space for the call signature ``*args, **kwargs``.

    Args:
        *args, **kwargs: tensors, :class:`TensorSpec` or ``"8192x4096:bf16"`` strings, and static values.
        chip: the TPU generation (required for ``tpu-model``; ``measure`` uses the live device).
        evaluator: ``"tpu-model"``, ``"measure"`` or an :class:`Evaluator`.
        strategy: ``"exhaustive"``, ``"random"``, ``"coordinate"``, ``"surrogate"`` (needs optuna), or a factory
            ``fn(space, seed)`` returning a :class:`~tpukernels.autotune.strategies.Strategy` (a Strategy
            subclass works).
        budget: at most this many candidates evaluated (pruned ones are free). None: no limit.
        seconds: stop after this many seconds of wall-clock (in-flight candidates are abandoned).
        workers: parallel worker processes (``tpu-model`` only; ``measure`` runs serially: concurrent
            timings would interfere).
        executor: an :class:`Executor` to run jobs on (it is not shut down; overrides ``workers``), or
            ``"inline"`` / ``"process"`` / ``"ray"`` (a local Ray cluster of ``workers`` CPUs, or all of them).
        write_db: ``"user"`` (the user cache), ``"shipped"`` (package data, for maintainers), a file path,
            or None. The best config is stored under the kernel's source hash, chip, shape bucket, dtypes
            and static args.
        force_db: replace a stored *measured* entry with a *model* one (refused otherwise).
        candidate_timeout_s: a candidate running longer is recorded as ``timeout`` (its worker is killed;
            process executors only).
        imports: extra modules / ``.py`` files worker processes import (the kernel's own module is added).
        progress: ``fn(done, total, trial, best)`` after each finished candidate.
        values: ``{tunable: [values]}`` to search instead of the declared ones (the baseline is always kept).
        resume: a strategy that learns (``surrogate``) is told the results earlier sweeps stored for this
            kernel source, exact problem, chip and evaluator (:func:`~tpukernels.autotune.db.load_history`); they are
            reported as trials with ``details["resumed"]``, not evaluated again and not counted in ``budget``.
            Sweeps with ``write_db`` add their results to that history.

    The baseline, evaluated first, is the config a call of this problem gets today on the chip (its tuning
    DB entry, else the heuristic, else the declared defaults: ``Space.default``), so ``speedup_vs_default``
    is the gain over what users already run.

    Warnings the candidates raise (a :class:`~tpukernels.PerformanceWarning` per badly packed config, say) are
    kept in each trial's ``details["warnings"]`` and shown once for the sweep, one summary per category,
    when it ends (:mod:`.sweep_warnings`).

    Raises:
        ArgumentError: unknown evaluator or strategy, no chip for tpu-model, bad arguments.
    """
    t_start = time.monotonic()
    ev = make_evaluator(evaluator, chip)
    problem = Problem.from_args(kernel, *args, **kwargs)
    chip_name = ev.chip_name()
    space = Space(problem, ev.check_chip(), values)
    if isinstance(strategy, Strategy):
        strat = strategy
    elif callable(strategy):  # a Strategy subclass or any factory fn(space, seed)
        strat = strategy(space, seed)
    else:
        strat = make_strategy(strategy, space, seed)
    strat_name = strat.name
    own_executor = not isinstance(executor, Executor)
    ex = executor if not own_executor else _make_executor(workers, ev, kernel, imports, executor)
    ref = kernel if isinstance(ex, InlineExecutor) else KernelRef.of(kernel)
    payload = problem.payload()
    default = space.default()
    deadline = None if seconds is None else t_start + float(seconds)
    max_evals = None if budget is None else int(budget)
    trials: list[Trial] = []
    in_flight: dict = {}  # future -> (config, started)
    suspects: list[Config] = []  # in flight when a worker crashed: re-run one at a time to find the culprit
    stopped = "space exhausted"
    exhausted = False
    ev_id = evaluator_id(ev)
    if resume and chip_name is not None:
        prior = db.load_history(kernel, chip_name, problem.lowered_specs, problem.statics, ev_id, problem.describe())
        for config, time_us in (strat.resume(prior) if prior else ()):
            t = Trial(dict(config), "ok" if time_us is not None else "failed", time_us=time_us,
                      error_kind=None if time_us is not None else "resumed",
                      error=None if time_us is not None else "failed, or ranked only by a bound, in an earlier sweep",
                      details={"resumed": True, **({"is_default": True} if config == default else {})})
            t.index = len(trials)
            trials.append(t)
    n_resumed = len(trials)

    def finish(config: Config, trial: Trial) -> None:
        trial.index = len(trials)
        if config == default:
            trial.details["is_default"] = True
        notes = space.notes.get(config)
        if notes:
            trial.details["notes"] = notes
        trials.append(trial)
        # an unranked trial's time is only a bound: the strategy is not steered by it (as a failure)
        strat.tell(config, trial.time_us if trial.ok and trial.ranked else None)
        if progress is not None:
            best = min((t for t in trials if t.ok), key=lambda t: t.rank_key, default=None)
            progress(len(trials) - n_resumed, max_evals, trial, best)

    def submit(config: Config) -> None:
        fut = ex.submit(run_job, ref, payload, dict(config), ev)
        in_flight[fut] = (config, time.monotonic())

    try:
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                stopped = "time budget"
                break
            slots = 1 if suspects else ex.slots
            while len(in_flight) < slots:
                if suspects:  # already counted against the budget when first submitted
                    submit(suspects.pop(0))
                    continue
                if exhausted or (max_evals is not None and len(trials) - n_resumed + len(in_flight) >= max_evals):
                    break
                try:
                    cfg = strat.ask()
                except StopIteration:
                    exhausted = True
                    break
                if cfg is None:  # the strategy waits for results
                    break
                submit(cfg)
            if not in_flight:
                if max_evals is not None and len(trials) - n_resumed >= max_evals:
                    stopped = "evaluation budget"
                break
            wait_s = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            alone = len(in_flight) == 1
            done, _ = cf.wait(list(in_flight), timeout=wait_s, return_when=cf.FIRST_COMPLETED)
            crashed = []
            for fut in done:
                config, _ = in_flight.pop(fut)
                try:
                    trial = fut.result()
                except cf.process.BrokenProcessPool:
                    crashed.append(config)
                    continue
                except Exception as e:  # the job machinery itself raised (run_job catches evaluator errors)
                    if ex.worker_died(e):  # e.g. a Ray task's worker: only this job was lost
                        trial = Trial(dict(config), "crashed", error_kind="crashed",
                                      error=f"the worker died while evaluating this config ({type(e).__name__})")
                    else:
                        trial = Trial(dict(config), "failed", error_kind="error", error=f"{type(e).__name__}: {e}")
                finish(config, trial)
            if crashed:  # a worker died: every job in flight is lost with the pool
                lost = crashed + [c for c, _ in in_flight.values()]
                in_flight.clear()
                ex.restart()
                if alone:
                    finish(lost[0], Trial(dict(lost[0]), "crashed", error_kind="crashed",
                                          error="the worker process died while evaluating this config"))
                else:  # can't tell which one did it: re-run them one at a time
                    suspects.extend(c for c in lost if c not in suspects)
                continue
            now = time.monotonic()
            running = {f: ex.running_since(f, s) for f, (c, s) in in_flight.items()}  # None: still queued
            late = [(f, c) for f, (c, s) in in_flight.items()
                    if running[f] is not None and now - running[f] > candidate_timeout_s]
            if late and not isinstance(ex, InlineExecutor):
                alone_killed = [ex.cancel(fut) for fut, _ in late]  # per-job kill where the executor can
                for fut, config in late:
                    in_flight.pop(fut)
                    finish(config, Trial(dict(config), "timeout", error_kind="timeout",
                                         error=f"no result after {candidate_timeout_s:g} s (worker killed)"))
                if all(alone_killed):
                    continue
                requeue = [c for c, _ in in_flight.values()]
                in_flight.clear()
                ex.restart()
                for c in requeue:
                    submit(c)
        for fut, (config, _) in list(in_flight.items()):
            finish(config, Trial(dict(config), "cancelled", error_kind="cancelled",
                                 error="the time budget ran out while it was being evaluated"))
        if in_flight:
            if not all([ex.cancel(fut) for fut in in_flight]):
                ex.restart()
            in_flight.clear()
    finally:
        if own_executor:
            ex.restart() if in_flight else ex.shutdown()
        elif in_flight:  # a shared executor (e.g. one Ray cluster for many sweeps): stop only this sweep's jobs
            for fut in in_flight:
                ex.cancel(fut)

    evaluated = trials[n_resumed:]
    emit_summary(f"tpukernels autotune {kernel.qualname} ({problem.describe()}{', ' + chip_name if chip_name else ''})",
                 [(_config_label(t.config), t.details.get("warnings")) for t in evaluated], len(evaluated))
    result = SweepResult(
        kernel=kernel.qualname, chip=chip_name, problem=problem.describe(), evaluator=ev.name, label=ev.label,
        strategy=strat_name, budget={"evaluations": max_evals, "seconds": seconds}, space_size=space.size(),
        trials=trials, pruned=space.pruned, elapsed_s=time.monotonic() - t_start, stopped=stopped,
        baseline_source=space.baseline_source,
    )
    if write_db and chip_name is not None:
        new = [(t.config, t.time_us if t.ok and t.ranked else None) for t in trials[n_resumed:]
               if t.status in ("ok", "failed", "wrong")]
        if new:
            try:
                db.record_history(kernel, chip_name, problem.lowered_specs, problem.statics, ev_id, new,
                                  problem.describe(), errors="raise")
            except OSError:  # the winner's write below reports an unwritable cache
                pass
    if write_db and result.best is not None:
        result.db_path, result.db_note = store(result, problem, write_db, force=force_db)
        if result.db_path:
            forget_dispatch_choices(kernel)
    return result


def evaluator_id(ev: Evaluator) -> str:
    """What makes two evaluators' times comparable: name, label and settings (timeouts aside), as JSON."""
    import json

    fields = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)} if dataclasses.is_dataclass(ev) else {}
    fields = {k: v for k, v in fields.items() if "timeout" not in k}
    return json.dumps({"name": ev.name, "label": ev.label, **fields}, sort_keys=True, default=str)


def forget_dispatch_choices(kernel: TpuKernel) -> None:
    """Drop this process's cached lowerings and call plans that dispatch chose (no explicit config).

    Calls cache the config dispatch picked per signature; after a DB write the next call must look again.
    """
    with kernel._lock:
        for k in [k for k in kernel._entries if k[2] is None]:  # lowering key: (specs, statics, config, mode, chip)
            del kernel._entries[k]
        for k in [k for k in kernel._plans if k[1] is None]:  # plan key: (mode, config_json, *values)
            del kernel._plans[k]


def store(result: SweepResult, problem: Problem, where: str, force: bool = False) -> tuple[str | None, str]:
    """Write the sweep's best config to the tuning DB (``"user"``, ``"shipped"`` or a path).

    Returns ``(path or None, note)``. Refuses (path None) when the evaluator produced no TPU chip data
    (cpu interpret measurements) or when a measured entry would be replaced by a model one without ``force``.
    """
    if result.chip is None:
        return None, "not stored: these timings are not of a TPU chip (cpu interpret mode)"
    kernel = problem.kernel
    specs, statics = problem.lowered_specs, problem.statics
    path = {"user": db.user_db_path(kernel.qualname, result.chip),
            "shipped": db.shipped_db_path(kernel.qualname, result.chip)}.get(where, where)
    key = db.entry_key(kernel, specs, statics)
    old, how = db.find(db.load(path), key)
    if old is not None and how == "exact" and not force:
        if db.is_measured(old) and result.evaluator != "measure":
            return None, (f"not stored: {path} has a measured entry for this key; a model does not replace it "
                          "(force to override)")
    best, default = result.best, result.default
    evidence = {
        "evaluator": result.evaluator, "label": result.label, "time_us": round(best.time_us, 3),
        "default_time_us": None if default is None or not default.ok else round(default.time_us, 3),
        "strategy": result.strategy, "evaluated": len(result.trials), "failed": sum(result.failures.values()),
        "pruned": len(result.pruned), "problem": result.problem, "measured": result.evaluator == "measure",
    }
    for k in ("bound", "pct_of_roofline", "step_overhead_us", "cycles_note"):
        if k in best.details:
            evidence[k] = best.details[k]
    try:
        written = db.record(kernel, result.chip, specs, statics, Config(best.config), evidence, path=path,
                            errors="raise")
    except OSError as e:  # a read-only cache dir must not hide the sweep's results
        return None, (f"not stored: cannot write {path} ({e.strerror or e}); set TPUKERNELS_CACHE_DIR to a "
                      f"writable folder or pass --write-db PATH")
    note = f"stored in {written}"
    if where == "user":
        note += (f"; TPU hosts ({result.chip}) use it automatically, cpu (interpret) calls only with "
                 f"TPUKERNELS_TARGET_CHIP={result.chip}")
    return written, note
