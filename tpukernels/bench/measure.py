"""``tpukernels bench --measure``: the library's kernels **timed on a live TPU**, next to their model.

Every other model family figure is a model (libtpu's static estimate with the chip's rooflines, see
:mod:`tpukernels.bench.core`). On a TPU host (TorchTPU, the ``tpu`` target) this module runs the same
tpukernels calls a family's cases model (:attr:`tpukernels.bench.core.Impl.parts`: the kernels at the full
problem, the config each call resolves to from the tuning DB or the heuristic) and times them:

* inputs: ``torch.randn`` (floating dtypes) / ``randint`` on the cpu from a fixed seed, moved to the device once
  (:func:`tpukernels.autotune.evaluators.random_inputs`);
* ``warmup`` untimed runs (the first one compiles), then ``repeats`` timed runs, each
  ``sync(); t0 = clock(); run(); sync(); t1 = clock()``: the device is synchronized (``torch.tpu.synchronize()``)
  before every clock read, so a sample is the wall clock of one complete call (host dispatch included);
* per call: the median of the samples (the figure), their minimum and spread (max - min), in µs
  (:class:`Timing`, ``statistics.median``). A case of several kernel calls (attention backward: dq and dkv)
  sums its calls' medians (each timed alone);
* per case, ``model / measured``: the family's saved model time of tpukernels on this chip
  (``<results_dir>/<family>.json``; none until ``tpukernels bench --family F --chips <this chip>`` has run, as
  it needs no TPU) over the measured time: below 1 the model is optimistic;
* calibration rows (:mod:`tpukernels.bench.calibration`, tokamax's measured flash-attention forward and backward
  times on this chip): tpukernels' ``fa_forward`` (or the backward kernels a call runs) at the same shape,
  ``tokamax measured / ours measured`` (above 1, tpukernels is faster on the chip) next to our model / measured.

Cases whose model includes work outside tpukernels' kernels (an XLA op the wrapper runs, a scaled reduced
problem) or whose implementation is not a list of kernel calls are listed with a note and not timed.
The rows are saved to ``<results_dir>/measured.json`` (:data:`MEASURED_FILE`) and rendered as a section of
BENCHMARKS.md. ``--write-db`` stores each timed call's config in the user tuning DB with
``evidence.measured = true`` (:func:`tpukernels.autotune.db.is_measured`), the fastest where one signature was
timed more than once: a model sweep never replaces it without ``force``. Only the config a call resolves to is
timed (no sweep: ``tpukernels autotune --evaluator measure`` searches the space).

The device runner (:class:`DeviceRunner`) takes the synchronization and the clock as arguments, so the timing
loop is tested on the cpu with a fake clock (``tests/test_bench_measure.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Any, Callable

from ..errors import ArgumentError, BackendUnavailableError, TpuKernelError

FAMILY = "measured"
#: the result file ``tpukernels bench --measure`` writes in the results dir (not a family: no model rows)
MEASURED_FILE = "measured.json"
DEFAULT_WARMUP = 3
DEFAULT_REPEATS = 20
#: the rule a machine without a TPU breaks (the text of :class:`NoTpuError`)
NO_TPU_RULE = ("--measure times kernels on a live TPU: it needs torch_tpu installed and a TPU device "
               "(torch.tpu.is_available()); without one, `tpukernels bench` (no --measure) gives the model")


class NoTpuError(BackendUnavailableError):
    """``--measure`` was asked for where no TPU device can be used (names the rule and what is missing)."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """The timed samples of one call, µs: ``median_us`` is the figure; ``min_us`` and ``spread_us``
    (max - min) say how steady it was."""

    samples_us: tuple

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def min_us(self) -> float:
        return min(self.samples_us)

    @property
    def spread_us(self) -> float:
        return max(self.samples_us) - min(self.samples_us)

    def as_dict(self) -> dict:
        return {"median_us": self.median_us, "min_us": self.min_us, "spread_us": self.spread_us,
                "samples_us": [round(s, 3) for s in self.samples_us]}


def check_counts(warmup, repeats) -> None:
    """Raises:
        ArgumentError: ``warmup`` is not an int >= 0, or ``repeats`` not an int >= 1 (names the argument)."""
    for name, value, low in (("--warmup", warmup, 0), ("--repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ArgumentError(f"{name} must be an integer >= {low}, got {value!r}")


def time_call(run: Callable[[], Any], sync: Callable[[], None], clock: Callable[[], float], *, warmup: int,
              repeats: int) -> Timing:
    """Time ``run()``: ``warmup`` untimed calls, then ``repeats`` samples of
    ``sync(); t0 = clock(); run(); sync(); t1 = clock()`` (``clock`` in seconds; samples in µs).

    Raises:
        ArgumentError: bad ``warmup`` / ``repeats`` (:func:`check_counts`), before anything runs.
    """
    check_counts(warmup, repeats)
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = clock()
        run()
        sync()
        samples.append((clock() - t0) * 1e6)
    return Timing(tuple(samples))


@dataclasses.dataclass
class Prepared:
    """One kernel call ready to run: ``run()`` calls the kernel on device inputs with ``config`` pinned;
    ``source`` says where the config came from (``"user-db:v5e"``, ``"heuristic"``, ...); ``problem`` is its
    :class:`tpukernels.autotune.space.Problem` (the DB key)."""

    run: Callable[[], Any]
    config: dict
    source: str
    problem: Any


class DeviceRunner:
    """Runs tpukernels kernel calls on a torch device; the synchronization and clock are injectable.

    Args:
        device: the torch device type of the inputs (``"tpu"``: TorchTPU).
        sync: waits for the device's queued work (default: ``torch.<device>.synchronize()``).
        clock: seconds (default ``time.perf_counter``).
        seed: inputs' random seed.
    """

    def __init__(self, device: str = "tpu", *, sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, seed: int = 0):
        self.device = device
        self._sync = sync
        self.clock = clock
        self.seed = seed

    def sync(self) -> None:
        if self._sync is not None:
            return self._sync()
        import torch

        getattr(torch, self.device).synchronize()

    def prepare(self, kernel, args, kwargs, chip: str) -> Prepared:
        """Inputs on the device for ``kernel(*args, **kwargs)`` (shape strings such as ``"8192x4096:bf16"``, as
        :func:`tpukernels.compile_for` takes them) and the config a call resolves to on ``chip``."""
        from ..autotune.evaluators import random_inputs
        from ..autotune.space import Problem
        from ..chips import get_chip
        from ..lowering import resolve

        problem = Problem.from_args(kernel, *args, **kwargs)
        resolved = resolve(kernel, problem.lowered_specs, problem.statics, None, chip=get_chip(chip))
        config = dict(resolved.config)
        values = random_inputs(problem, self.device, self.seed)
        return Prepared(lambda: kernel(**values, config=dict(config)), config, resolved.source, problem)


def require_tpu() -> str:
    """The live TPU chip's name (``"v5e"``, ...).

    Raises:
        NoTpuError: torch_tpu is not installed, reports no TPU device, or the chip cannot be told (the message
            names the rule, :data:`NO_TPU_RULE`, and what is missing).
    """
    try:
        import torch_tpu  # noqa: F401  (registers the "tpu" device and torch.tpu)
    except ImportError as e:
        raise NoTpuError(f"{NO_TPU_RULE}; torch_tpu cannot be imported ({e})") from e
    import torch

    mod = getattr(torch, "tpu", None)
    if mod is None or not mod.is_available():
        raise NoTpuError(f"{NO_TPU_RULE}; torch_tpu sees no TPU device here")
    from ..targets.tpu import live_chip

    chip = live_chip()
    if chip is None:
        raise NoTpuError(f"{NO_TPU_RULE}; the TPU's device_kind is not a chip tpukernels knows")
    return chip.name


# ----------------------------------------------------------------------------------------------- rows
def model_index(results: dict) -> dict:
    """``{(family, op, shape, chip): model µs}`` of tpukernels' credible estimates in saved family results
    (``{family: result}``), and the calibration rows' ``ours_model_ms`` (as µs)."""
    out = {}
    for fam, res in results.items():
        for r in res.get("rows", []):
            if fam == "calibration":
                if r.get("ours_model_ms"):
                    out[("calibration", r["op"], r["shape"], r["chip"])] = r["ours_model_ms"] * 1e3
            elif (r.get("kind") == "ours" and r.get("figure") == "estimate" and r.get("credible") is not False
                  and r.get("model_us")):
                out[(fam, r["op"], r["shape"], r["chip"])] = r["model_us"]
    return out


def new_row(family: str, op: str, shape: str, chip: str, model_us: float | None = None,
            tokamax_us: float | None = None) -> dict:
    """An untimed measured row (see :func:`measure_parts` for the fields it gets)."""
    return {"family": family, "op": op, "shape": shape, "chip": chip, "impl": "tpukernels", "kind": "measured",
            "parts": [], "measured_us": None, "min_us": None, "spread_us": None, "model_us": model_us,
            "model_over_measured": None, "tokamax_measured_us": tokamax_us, "tokamax_over_ours": None,
            "error": None, "note": None}


def measure_parts(row: dict, parts, chip: str, runner: DeviceRunner, *, warmup: int, repeats: int,
                  timed: list | None = None) -> dict:
    """Time each ``(kernel, args, kwargs)`` of ``parts`` and fill ``row`` (in place; returned): ``parts`` (one
    dict per call: kernel, args, config, config source, median/min/spread µs and samples), their sums
    ``measured_us`` / ``min_us`` / ``spread_us``, and the ratios. A call that fails sets ``error`` (the row
    keeps no time). ``timed``: a list to append ``(row, part dict, Prepared)`` of each timed call to (what
    :func:`store_winners` records)."""
    done = []
    try:
        for kernel, args, kwargs in parts:
            prep = runner.prepare(kernel, args, kwargs, chip)
            t = time_call(prep.run, runner.sync, runner.clock, warmup=warmup, repeats=repeats)
            part = {"kernel": kernel.qualname, "args": [None if a is None else str(a) for a in args],
                    "config": prep.config, "config_source": prep.source, **t.as_dict()}
            row["parts"].append(part)
            done.append((row, part, prep))
    except (TpuKernelError, RuntimeError, NotImplementedError) as e:
        # not swallowed: the row keeps the error and the report prints it; one case that cannot run on this chip
        # (a config the chip rejects, an op its torch_tpu lacks) must not abort the other cases' timings
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
        row["parts"] = []
        return row
    if timed is not None:
        timed.extend(done)
    row["measured_us"] = sum(p["median_us"] for p in row["parts"])
    row["min_us"] = sum(p["min_us"] for p in row["parts"])
    row["spread_us"] = sum(p["spread_us"] for p in row["parts"])
    if row["model_us"]:
        row["model_over_measured"] = row["model_us"] / row["measured_us"]
    if row["tokamax_measured_us"]:
        row["tokamax_over_ours"] = row["tokamax_measured_us"] / row["measured_us"]
    return row


def measure_cases(cases, runner: DeviceRunner, *, warmup: int, repeats: int, models: dict | None = None,
                  timed: list | None = None, log=lambda m: None) -> list[dict]:
    """One measured row per case (:class:`tpukernels.bench.core.Case`): tpukernels' ``parts`` timed (see
    :func:`measure_parts`, which appends to ``timed``); a case whose tpukernels implementation has no ``parts``
    gets a note, no time. ``models``: :func:`model_index` of the saved results (the rows' ``model_us``)."""
    check_counts(warmup, repeats)
    rows = []
    for case in cases:
        ours = next((i for i in case.impls if i.kind == "ours"), None)
        row = new_row(case.family, case.op, case.shape, case.chip,
                       (models or {}).get((case.family, case.op, case.shape, case.chip)))
        if ours is None or ours.parts is None:
            row["note"] = ("not timed: the model of this case includes work outside tpukernels' kernel calls "
                           "(or is not a list of kernel calls)")
        else:
            measure_parts(row, ours.parts, case.chip, runner, warmup=warmup, repeats=repeats, timed=timed)
        log(_log_line(row))
        rows.append(row)
    return rows


def calibration_cases(chip: str, root: str | None = None) -> list[tuple]:
    """``[(MeasuredRow, op, shape text, parts)]``: tokamax's measured flash-attention rows on ``chip``
    (:func:`tpukernels.bench.calibration.attention_rows`), forward then backward (VJP), and tpukernels' calls
    at that shape: ``fa_forward``, or the backward kernels a call runs there
    (:func:`tpukernels.bench.attention.bwd_kernels`: the fused kernel or dQ + dK/dV; the ``rowsum(dO * O)`` and
    dQ cast XLA ops around them, which the model of the row includes, are not timed)."""
    from ..library.attention import CAUSAL, fa_forward
    from . import calibration as cal
    from .attention import bwd_kernels

    out = []
    loaded = cal.load_rows(root, chips={chip}, ops={cal.ATTENTION_OP, cal.VJP_OP})
    for r in cal.attention_rows(loaded) + cal.attention_rows(loaded, cal.VJP_OP):
        B, S, hq, hkv, D, causal = cal.attention_dims(r)
        spec = lambda n: f"{B}x{n}x{S}x{D}:bf16"  # noqa: E731
        kw = dict(CAUSAL, causal=causal)
        if r.op == cal.VJP_OP:
            rows = f"{B}x{hq}x1x{S}:f32"
            args = (spec(hq), spec(hkv), spec(hkv), spec(hq), rows, rows)
            calls = [(k, args, kw) for k in bwd_kernels(chip, args, kw)]
            out.append((r, "flash_attention bwd", cal.shape_text(r), calls))
        else:
            calls = [(fa_forward, (spec(hq), spec(hkv), spec(hkv)), kw)]
            out.append((r, "flash_attention fwd", cal.shape_text(r), calls))
    return out


def measure_calibration(chip: str, runner: DeviceRunner, *, warmup: int, repeats: int, models: dict | None = None,
                        root: str | None = None, timed: list | None = None, log=lambda m: None) -> list[dict]:
    """One measured row per calibration row on ``chip``: tpukernels' forward or backward timed at tokamax's
    measured shape (:func:`calibration_cases`), next to tokamax's measured time (``tokamax_over_ours``) and our
    model (``model_over_measured``)."""
    check_counts(warmup, repeats)
    rows = []
    for r, op, shape, parts in calibration_cases(chip, root):
        row = new_row("calibration", op, shape, chip, (models or {}).get(("calibration", op, shape, chip)),
                      r.median_ms * 1e3)
        measure_parts(row, parts, chip, runner, warmup=warmup, repeats=repeats, timed=timed)
        log(_log_line(row))
        rows.append(row)
    return rows


def _log_line(row: dict) -> str:
    fig = (f"{row['measured_us']:10.1f} µs (min {row['min_us']:.1f}, spread {row['spread_us']:.1f})"
           if row["measured_us"] is not None else (row["error"] or row["note"]))
    return f"  {row['chip']:6} {row['family']:14} {row['op']:24} {row['shape']:24} {fig}"


def store_winners(timed: list, chip: str, *, warmup: int, repeats: int, path_for=None) -> list[str]:
    """Record the config of each timed call (``timed``: ``(row, part, Prepared)`` from :func:`measure_parts`) in
    the user tuning DB with ``evidence.measured = true``; where one DB key was timed more than once, the fastest.
    Returns the files written. ``path_for(kernel)``: the file to write (default: the user DB of ``chip``)."""
    from ..autotune import db

    best: dict = {}
    for row, p, prep in timed:
        kernel = prep.problem.kernel
        key = (kernel.qualname, json.dumps(db.entry_key(kernel, prep.problem.lowered_specs, prep.problem.statics),
                                           sort_keys=True, default=str))
        if key not in best or p["median_us"] < best[key][1]["median_us"]:
            best[key] = (row, p, prep)
    written = []
    for row, p, prep in best.values():
        kernel = prep.problem.kernel
        evidence = {"evaluator": "measure", "label": "measured", "measured": True,
                    "time_us": round(p["median_us"], 3), "min_us": round(p["min_us"], 3),
                    "spread_us": round(p["spread_us"], 3), "warmup": warmup, "repeats": repeats,
                    "config_source": prep.source, "problem": prep.problem.describe(),
                    "by": f"tpukernels bench --measure ({row['family']} {row['op']} {row['shape']})"}
        path = db.record(kernel, chip, prep.problem.lowered_specs, prep.problem.statics, prep.config, evidence,
                         path=path_for(kernel) if path_for else None)
        if path:
            written.append(path)
    return sorted(set(written))


def load_measured(results_dir: str) -> dict | None:
    """The saved ``<results_dir>/measured.json``, or None."""
    path = os.path.join(results_dir, MEASURED_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def kind(chip: str, warmup: int, repeats: int) -> str:
    return (f"measured on a TPU {chip}: wall clock of each tpukernels call on the device (torch_tpu), device "
            f"synchronized before every clock read; median of {repeats} runs after {warmup} warm-up runs")


def run(families, results_dir: str, *, runner: DeviceRunner | None = None, chip: str | None = None,
        warmup: int = DEFAULT_WARMUP, repeats: int = DEFAULT_REPEATS, write_db: bool = False,
        calibration_root: str | None = None, log=lambda m: None) -> dict:
    """Measure ``families`` (not ``host``) on this machine's TPU and save ``<results_dir>/measured.json``.

    ``runner`` / ``chip``: default a :class:`DeviceRunner` on ``"tpu"`` and the live chip (:func:`require_tpu`);
    tests pass a fake runner and a chip name. The model times come from the saved family results in
    ``results_dir``. Returns the saved result (``db_files``: what ``write_db`` wrote).

    Raises:
        ArgumentError: bad ``warmup`` / ``repeats``, or ``host`` among ``families``.
        NoTpuError: no runner given and no TPU here.
        VersionMismatch: the saved results in ``results_dir`` were made with other package versions.
    """
    from . import FAMILIES, family_module
    from .core import check_versions, load_results, save_result, versions

    check_counts(warmup, repeats)
    if "host" in families:
        raise ArgumentError("--measure: the host family is already a measurement (of this CPU); leave it out")
    if runner is None:
        chip = chip or require_tpu()
        runner = DeviceRunner("tpu")
    elif chip is None:
        raise ArgumentError("tpukernels.bench.measure.run: a runner needs its chip")
    t0 = time.perf_counter()
    saved = load_results(results_dir, FAMILIES)  # the report mixes them with these rows: refuse before timing
    check_versions({**{f"{f}.json": r["versions"] for f, r in saved.items()}, "this run": versions()})
    models = model_index({f: r for f, r in saved.items() if f in families})
    rows, timed = [], []
    for fam in families:
        log(f"== measure {fam} on {chip}")
        if fam == "calibration":
            rows += measure_calibration(chip, runner, warmup=warmup, repeats=repeats, models=models,
                                        root=calibration_root, timed=timed, log=log)
        else:
            rows += measure_cases(family_module(fam).cases([chip]), runner, warmup=warmup, repeats=repeats,
                                  models=models, timed=timed, log=log)
    files = store_winners(timed, chip, warmup=warmup, repeats=repeats) if write_db else []
    extra = {"chip": chip, "warmup": warmup, "repeats": repeats, "families": list(families), "db_files": files,
             "seconds": round(time.perf_counter() - t0), "doc": (__doc__ or "").strip()}
    return save_result(os.path.join(results_dir, MEASURED_FILE), FAMILY, kind(chip, warmup, repeats), rows, extra)
