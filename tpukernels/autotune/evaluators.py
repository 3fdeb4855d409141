"""Evaluators: what one candidate config costs, as a :class:`Trial`.

* :class:`TpuModelEvaluator` (``"tpu-model"``): compile-only with libtpu for a named chip, time from
  :mod:`tpukernels.autotune.model`. A **model**, never a measurement; needs no TPU.
* :class:`MeasureEvaluator` (``"measure"``): wall-clock of the torch op on the device its tensors live on
  (warm-up, median of N, outliers flagged), each candidate checked against the kernel's reference. On a
  machine without a TPU that device is the cpu and the kernel runs in Pallas interpret mode: the numbers
  test the tuning machinery, they say nothing about TPU performance (the label says so).

An evaluator is a small picklable object: the sweep sends it with each job to a worker process. Its
:meth:`Evaluator.evaluate` never raises for a bad candidate: compile errors, VMEM overflows, wrong results
and exceptions come back as a failed Trial with a reason.
"""

from __future__ import annotations

import abc

import dataclasses
import importlib
import importlib.util
import os
import sys
import time
from typing import Any

import numpy as np

from ..chips import get_chip
from ..dsl.kernel import REGISTRY, TpuKernel
from ..dsl.spec import Config
from .space import Problem

#: Max |got - want| / max(1, max |want|) accepted per output dtype (ints and bools: exact).
TOLERANCES = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}


@dataclasses.dataclass
class Trial:
    """The outcome of evaluating one config.

    Attributes:
        config: the config (a plain dict).
        status: ``"ok"``; ``"failed"`` (compile / lowering / runtime error), ``"wrong"`` (result differs from
            the reference), ``"timeout"``, ``"crashed"`` (the worker process died), ``"cancelled"`` (the time
            budget ran out while it was in flight).
        time_us: model or measured time in µs (``ok`` only).
        error_kind: short machine-readable reason (``"vmem"``, ``"compile"``, ``"mismatch"``, ...).
        error: human-readable reason.
        details: evaluator-specific figures (model terms, samples, ...).
        seconds: wall-clock seconds the evaluation took.
        index: evaluation order in the sweep (0 = first finished).
    """

    config: dict
    status: str
    time_us: float | None = None
    error_kind: str | None = None
    error: str | None = None
    details: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    index: int = -1

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.time_us is not None

    @property
    def ranked(self) -> bool:
        """False for an ok trial whose time is only a bound (tpu-model without libtpu's estimate): it is
        ranked after every trial with a real figure, since a bound would beat them all."""
        return not self.details.get("unranked")

    @property
    def rank_key(self) -> tuple:
        """Sort key of ok trials: ranked ones first, then by time."""
        return (0 if self.ranked else 1, self.time_us)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Evaluator(abc.ABC):
    """Base class. Subclasses set :attr:`name`, :attr:`label` and implement :meth:`evaluate`."""

    name = "evaluator"
    #: shown next to every time: ``"model"`` or ``"measured"``
    label = "model"
    #: False when candidates must not run concurrently (timings would interfere)
    parallel = True

    def chip_name(self) -> str | None:
        """The chip whose tuning data this evaluator produces (None: not a TPU chip)."""
        return None

    def check_chip(self):
        """The chip the static checks (VMEM) use."""
        name = self.chip_name()
        return None if name is None else get_chip(name)

    @abc.abstractmethod
    def evaluate(self, problem: Problem, config: Config) -> Trial:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------- tpu-model
@dataclasses.dataclass
class TpuModelEvaluator(Evaluator):
    """Compile-only for ``chip`` with libtpu; time = :mod:`tpukernels.autotune.model` (a model).

    Args:
        chip: ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"`` or ``"tpu7x"``.
        cycles: ask libtpu for its static cycle estimate (else the model is roofline + step overhead).
        estimate_steps: estimate grids larger than this on a reduced grid and scale (default
            :data:`tpukernels.autotune.model.ESTIMATE_STEPS`; see that module for the accuracy / time trade).
        estimate_timeout_s: give up on one static estimate after this long (the trial stays ok, with the
            roofline + overhead model and a note).
        step_overhead_us: per-grid-step overhead of the model, µs.
        compile: compile each candidate with libtpu (a failing compile fails the candidate). False (with
            ``cycles=False``): the model's roofline + step-overhead terms from the lowering alone, no libtpu
            at all: seconds per candidate instead of minutes on a loaded host (strategy studies over whole
            spaces, ``tpukernels.bench.strategy_study``); a config Mosaic would reject still gets a time.
    """

    chip: str = "v5e"
    cycles: bool = True
    estimate_steps: int | None = None
    estimate_timeout_s: float = 120.0
    step_overhead_us: float | None = None
    compile: bool = True
    name = "tpu-model"
    label = "model"

    def __post_init__(self):
        self.chip = get_chip(self.chip).name

    def chip_name(self) -> str:
        return self.chip

    def evaluate(self, problem: Problem, config: Config) -> Trial:
        from ..lowering import lower
        from ..targets.compile_only import compile_for
        from . import estimator, model

        chip = get_chip(self.chip)
        specs = problem.lowered_specs
        details: dict[str, Any] = {}
        pending, note = None, None
        t_est = time.perf_counter()
        if self.cycles:  # start libtpu's static estimate first: it runs while this process compiles
            try:
                low = lower(problem.kernel, specs, problem.statics, config, mode="mosaic", chip=chip)
                if model.grid_steps(low.resolved.launch.grid) > 0:
                    cap = model.ESTIMATE_STEPS if self.estimate_steps is None else self.estimate_steps
                    pending = _submit_static_cycles(problem.kernel, low, chip, cap)
            except Exception as e:  # invalid configs fail in compile_for below, with the reason
                note = f"no static estimate ({type(e).__name__}: {e}); roofline + step overhead only"
        if self.compile:
            args, kwargs = problem.call_args()
            res = compile_for(problem.kernel, chip, *args, config=dict(config), with_mlir=False, **kwargs)
            details["compile_seconds"] = round(res.compile_seconds, 3)
            if not res.ok:
                return Trial(dict(config), "failed", error_kind=res.error_kind, error=res.error, details=details)
            details.update(vmem_estimate_bytes=res.vmem_estimate_bytes, code_size_bytes=res.code_size_bytes)
        low = lower(problem.kernel, specs, problem.statics, config, mode="mosaic", chip=chip)
        launch = low.resolved.launch
        steps = model.grid_steps(launch.grid)
        est = launch.cost_estimate
        min_bytes = model.io_bytes(specs, launch.out_shapes)
        hbm, hbm_src = None, ""
        if est is not None and getattr(est, "bytes_accessed", None):
            hbm, hbm_src = int(est.bytes_accessed), "cost_estimate"
        if hbm is None:
            hbm = model.pipeline_traffic(launch, specs)
            hbm_src = "pipeline blocks x fetches" if hbm is not None else ""
        if hbm is None and self.compile:
            hbm = _xla_bytes(low, chip)
            hbm_src = "xla cost_analysis" if hbm else ""
        if not hbm:
            hbm, hbm_src = min_bytes, "inputs + outputs"
        flops, flops_src = 0, "unknown (cycles carry compute)"
        if est is not None and getattr(est, "flops", None):
            flops, flops_src = int(est.flops), "cost_estimate"
        else:
            per_step = model.body_flops(low.fn, low.arg_structs)
            if per_step:
                flops, flops_src = per_step * steps, "kernel body jaxpr x grid steps"
        cycles = None
        if pending is not None:
            request, reduced, r_steps = pending
            try:
                cyc = estimator.client().result(request, self.estimate_timeout_s)
                if cyc is None:
                    note = "libtpu wrote no static profile; roofline + step overhead only"
                elif r_steps == steps:
                    cycles, note = int(cyc), "libtpu static estimate (full grid)"
                else:
                    cycles = int(round(cyc * steps / r_steps))
                    note = f"libtpu static estimate on grid {reduced} ({r_steps} of {steps} steps), scaled"
            except Exception as e:  # timeout or libtpu failure: keep the candidate, model without cycles
                note = f"no static estimate ({type(e).__name__}: {e}); roofline + step overhead only"
            details["estimate_seconds"] = round(time.perf_counter() - t_est, 3)
        if self.cycles and cycles is None:  # roofline + overhead is a lower bound: it must not win on it
            details["unranked"] = ("a lower bound, ranked after every config with a libtpu estimate ("
                                   + (note or "no libtpu static estimate") + ")")
        overhead = model.STEP_OVERHEAD_US if self.step_overhead_us is None else self.step_overhead_us
        m = model.combine(chip, cycles=cycles, steps=steps, hbm_bytes=hbm, flops=flops, min_bytes=min_bytes,
                          dtype=model.compute_dtype(specs), step_overhead_us=overhead, hbm_source=hbm_src,
                          flops_source=flops_src, cycles_note=note)
        details.update(m.to_dict())
        return Trial(dict(config), "ok", time_us=m.time_us, details=details)


def _xla_bytes(low, chip) -> int | None:
    """Bytes accessed according to XLA's cost analysis of the compile-only executable."""
    import jax

    from ..targets.compile_only import tpu_device

    try:
        dev = tpu_device(chip.name)
        sharding = jax.sharding.SingleDeviceSharding(dev)
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in low.arg_structs]
        with jax.default_device(dev):
            ca = low.fn.lower(*structs).compile().cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        if "bytes accessed" in ca:
            return int(ca["bytes accessed"])
        return int(sum(v for k, v in ca.items() if k.startswith("bytes accessed"))) or None
    except Exception:
        return None


def _submit_static_cycles(kernel, low, chip, max_steps: int) -> tuple[int, tuple, int]:
    """Send ``low`` (on a reduced grid when large) to this process's estimate server.

    Returns ``(request id, reduced grid, its steps)``; the scaled cycles are ``cycles * steps / its steps``.
    """
    import jax

    from ..lowering import build_fn
    from ..targets.compile_only import export_for_chip
    from . import estimator, model

    launch = low.resolved.launch
    reduced = model.reduce_grid(launch.grid, max_steps)
    fn = low.fn
    if reduced != tuple(int(g) for g in launch.grid):
        resolved = dataclasses.replace(low.resolved, launch=dataclasses.replace(launch, grid=reduced))
        fn = jax.jit(build_fn(kernel, resolved, "mosaic")[0])
    blob = export_for_chip(fn, chip, low.arg_structs).serialize()
    return estimator.client().submit(bytes(blob), chip.name), reduced, model.grid_steps(reduced)


# ---------------------------------------------------------------------------------------------- measure
@dataclasses.dataclass
class MeasureEvaluator(Evaluator):
    """Wall-clock of the kernel's torch op on ``device`` (a measurement), checked against the reference.

    Args:
        device: ``"cpu"`` (Pallas interpret mode) or ``"tpu"`` (TorchTPU).
        warmup: untimed runs first (the first one compiles).
        repeats: timed runs; the time is their median (robust to outliers). Samples outside Tukey's fences
            (1.5 IQR beyond the quartiles) are counted and listed as outliers in the trial's details.
        check: compare each candidate's outputs with ``kernel.reference`` (if set) or the default config's.
        interpret: cpu interpret mode (``"fast"`` or ``"tpu"``).
        seed: inputs are ``torch.randn`` / ``randint`` from this seed.
        tolerances: per output dtype name, max error relative to ``max(1, max|want|)``.
    """

    device: str = "cpu"
    warmup: int = 2
    repeats: int = 10
    check: bool = True
    interpret: str = "fast"
    seed: int = 0
    tolerances: dict | None = None
    name = "measure"
    parallel = False

    @property
    def label(self) -> str:
        return "measured (cpu interpret mode: not TPU performance)" if self.device == "cpu" else "measured"

    def chip_name(self) -> str | None:
        if self.device == "cpu":
            return None
        from ..targets.tpu import live_chip

        chip = live_chip()
        return None if chip is None else chip.name

    # inputs and reference are cached per problem in this process
    def _key(self, problem: Problem) -> tuple:
        shapes = tuple(problem.shape_strings(False))
        return (problem.kernel.qualname, shapes, tuple(map(repr, problem.statics)), self.seed)

    def _inputs(self, problem: Problem) -> dict:
        return random_inputs(problem, self.device, self.seed)

    def _run(self, kernel: TpuKernel, values: dict, config) -> tuple:
        from ..dsl.modes import interpret_mode

        with interpret_mode(self.interpret):
            out = kernel(**values, config=dict(config) if config is not None else None)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    @staticmethod
    def _sync(outs) -> None:
        import torch

        for o in outs:
            kind = getattr(getattr(o, "device", None), "type", "cpu")
            if kind != "cpu":
                mod = getattr(torch, kind, None)
                if mod is not None and hasattr(mod, "synchronize"):
                    mod.synchronize()
                return

    def _reference(self, problem: Problem, values: dict) -> tuple[tuple, str]:
        kernel = problem.kernel
        if kernel.reference is not None:
            pos = [values[p.name] for p in kernel.params if not p.keyword_only]
            kw = {p.name: values[p.name] for p in kernel.params if p.keyword_only}
            out = kernel.reference(*pos, **kw)
            return (tuple(out) if isinstance(out, (tuple, list)) else (out,)), "kernel.reference"
        return self._run(kernel, _fresh(values), kernel.space.default()), "default config"

    def evaluate(self, problem: Problem, config: Config) -> Trial:
        from ..lowering import resolve

        kernel = problem.kernel
        cache = _MEASURE_CACHE.setdefault(self._key(problem), {})
        if "inputs" not in cache:
            cache["inputs"] = self._inputs(problem)
        values = cache["inputs"]
        in_place = bool(resolve(kernel, problem.lowered_specs, problem.statics, config).launch.input_output_aliases)
        details: dict[str, Any] = {"device": self.device, "fresh_inputs_per_run": in_place,
                                   "mode": f"interpret:{self.interpret}" if self.device == "cpu" else "mosaic"}
        if self.check and "reference" not in cache:
            cache["reference"] = self._reference(problem, values)
        for i in range(max(1, self.warmup)):
            outs = self._run(kernel, _fresh(values) if in_place else values, config)
            self._sync(outs)
            if i == 0 and self.check:
                want, source = cache["reference"]
                err, why = _compare(outs, want, self.tolerances or TOLERANCES)
                details.update(check=source, max_rel_err=err)
                if why:
                    return Trial(dict(config), "wrong", error_kind="mismatch", error=f"vs {source}: {why}",
                                 details=details)
        samples = []
        for _ in range(max(1, self.repeats)):
            args = _fresh(values) if in_place else values
            t0 = time.perf_counter()
            outs = self._run(kernel, args, config)
            self._sync(outs)
            samples.append((time.perf_counter() - t0) * 1e6)
        arr = np.asarray(samples)
        q1, med, q3 = np.percentile(arr, [25, 50, 75])
        lo, hi = q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1)
        outliers = [float(s) for s in arr if s < lo or s > hi]
        details.update(samples_us=[round(float(s), 3) for s in arr], median_us=float(med), min_us=float(arr.min()),
                       iqr_us=float(q3 - q1), outliers=len(outliers), outlier_samples_us=outliers)
        return Trial(dict(config), "ok", time_us=float(med), details=details)


def random_inputs(problem: Problem, device: str = "cpu", seed: int = 0) -> dict:
    """``{parameter name: value}`` for one call of ``problem``: each tensor ``torch.randn`` (floating dtypes),
    ``torch.rand > 0.5`` (bool) or ``torch.randint(0, 8)`` (integers) from ``seed``, made on the cpu and moved to
    ``device``; an absent optional tensor None; static parameters their values."""
    import torch

    from ..dsl.dtypes import to_torch_dtype

    g = torch.Generator().manual_seed(seed)
    out, it, statics = {}, iter(problem.specs), dict(problem.statics)
    for p in problem.kernel.params:
        if p.kind == "static":
            out[p.name] = statics[p.name]
            continue
        s = next(it)
        if s is None:
            out[p.name] = None
            continue
        dt = to_torch_dtype(s.dtype)
        shape = tuple(int(d) for d in s.shape)
        if dt.is_floating_point:
            t = torch.randn(shape, generator=g).to(dt)
        elif dt == torch.bool:
            t = torch.rand(shape, generator=g) > 0.5
        else:
            t = torch.randint(0, 8, shape, generator=g).to(dt)
        out[p.name] = t.to(device)
    return out


_MEASURE_CACHE: dict = {}


def _fresh(values: dict) -> dict:
    """Copies of every tensor argument (in-place kernels must not see their own previous outputs)."""
    return {k: (v.clone() if hasattr(v, "clone") else v) for k, v in values.items()}


def _compare(got: tuple, want: tuple, tolerances: dict) -> tuple[float, str | None]:
    import torch

    if len(got) != len(want):
        return float("inf"), f"{len(got)} outputs, reference has {len(want)}"
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        w = w if isinstance(w, torch.Tensor) else torch.from_numpy(np.asarray(w).astype(np.float64))
        g64, w64 = g.detach().cpu().double(), w.detach().cpu().double()
        if tuple(g64.shape) != tuple(w64.shape):
            return float("inf"), f"output {i} has shape {tuple(g64.shape)}, reference {tuple(w64.shape)}"
        if g64.numel() == 0:
            continue
        if not bool(torch.isfinite(g64).all()) and bool(torch.isfinite(w64).all()):
            return float("inf"), f"output {i} has non-finite values"
        err = float((g64 - w64).abs().max() / max(1.0, float(w64.abs().max())))
        worst = max(worst, err)
        name = str(g.dtype).replace("torch.", "")
        tol = tolerances.get(name, 0.0)
        if err > tol:
            return worst, f"output {i} ({name}) max error {err:.3g} (relative to max(1, max|ref|)) > {tol:g}"
    return worst, None


# ---------------------------------------------------------------------------------------------- jobs
@dataclasses.dataclass(frozen=True)
class KernelRef:
    """How a worker process finds a kernel: its qualname and the module (name or ``.py`` path) defining it."""

    qualname: str
    source: str | None = None

    @classmethod
    def of(cls, kernel: TpuKernel) -> "KernelRef":
        """Module name when a worker can import it by name (spawned workers share ``sys.path``), else the
        file path; None for ``__main__`` (spawn re-imports the main script in every worker itself)."""
        mod_name = getattr(kernel.launch_fn, "__module__", None) or ""
        if mod_name in ("", "__main__", "__mp_main__"):
            return cls(kernel.qualname, None)
        path = getattr(sys.modules.get(mod_name), "__file__", None)
        try:
            spec = importlib.util.find_spec(mod_name)
        except (ImportError, ValueError):
            spec = None
        origin = getattr(spec, "origin", None)
        if path is None or (origin and os.path.abspath(origin) == os.path.abspath(path)):
            return cls(kernel.qualname, mod_name)
        return cls(kernel.qualname, os.path.abspath(path))


_KERNELS: dict = {}


def resolve_kernel(ref: "KernelRef | TpuKernel") -> TpuKernel:
    """The kernel a :class:`KernelRef` names (importing its module in this process if needed)."""
    if isinstance(ref, TpuKernel):
        return ref
    if ref in _KERNELS:
        return _KERNELS[ref]
    kernel = REGISTRY.get(ref.qualname)
    module = None
    if kernel is None and ref.source:
        if ref.source.endswith(".py") or os.path.sep in ref.source:
            from .._imports import import_source as _import

            _import(ref.source)
            module = sys.modules.get(os.path.splitext(os.path.basename(ref.source))[0])
        else:
            module = importlib.import_module(ref.source)
        kernel = REGISTRY.get(ref.qualname)
    if kernel is None and module is not None:  # kernels made with register=False
        found = (v for v in vars(module).values() if isinstance(v, TpuKernel) and v.qualname == ref.qualname)
        kernel = next(found, None)
    if kernel is None:
        raise LookupError(f"kernel {ref.qualname} not found (source {ref.source!r})")
    _KERNELS[ref] = kernel
    return kernel


def run_job(ref: "KernelRef | TpuKernel", payload: dict, config: dict, evaluator: Evaluator) -> Trial:
    """Evaluate one config (in this process or a worker); never raises for a bad candidate. The warnings it
    raises are recorded in ``trial.details["warnings"]`` (``[[category, message], ...]``), not shown."""
    from .sweep_warnings import recording

    t0 = time.perf_counter()
    with recording() as found:  # shown once per sweep by tune(), not once per candidate
        try:
            kernel = resolve_kernel(ref)
            trial = evaluator.evaluate(Problem.from_payload(kernel, payload), Config(config))
        except Exception as e:
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
            trial = Trial(dict(config), "failed", error_kind="error", error=f"{type(e).__name__}: {first[:800]}")
    if found:
        trial.details["warnings"] = found
    trial.seconds = time.perf_counter() - t0
    trial.details.setdefault("pid", os.getpid())
    return trial
