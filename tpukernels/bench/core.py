"""The benchmark engine: cached libtpu estimates, cases and implementations, rows, result files.

Every device figure here is a **model**: libtpu's static ``estimated_cycles`` of a program compiled for a
compile-only TPU target, combined with the chip's rooflines by :func:`tpukernels.perf.model_time`::

    model_us = max(estimated_cycles / clock, hbm_bytes / hbm_bandwidth, flops / peak_flops)

All implementations of one case (tpukernels, XLA, a public Pallas kernel) get the same ``hbm_bytes`` (the
bytes the op must move: inputs read once, outputs written once) and the same ``flops`` (the work the op
needs, e.g. half of the score matrix for causal attention), so they differ only in their cycle estimate.

Estimates are cached in ``$TPUKERNELS_CACHE_DIR/bench/estimates.json`` keyed by the libtpu version, the
chip and a hash of the exported program without its source locations (:func:`program_key`): the same
program is never estimated twice, and any change of kernel code, config, shape or jax lowering is a new
key (moving code around is not). libtpu
aborts its static profiler on some programs (XLA's attention at long sequences); such deterministic
failures are cached too, timeouts are not.

Result files (``<results_dir>/<family>.json``) carry the versions they were made with; reading files made
with different jax / jaxlib / libtpu / torch / tpukernels versions raises :class:`VersionMismatch`.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import threading
import time
from typing import Any, Callable

from ..errors import TpuKernelError
from ..perf import model_time
from .families import CALIBRATION_FAMILIES, DEFAULT_CHIPS, FAMILIES, MODEL_FAMILIES  # noqa: F401  (re-exported)

#: versions that must agree between result files merged into one report: they define the model (libtpu's
#: estimator, jax's lowering) and the measurement stack.
VERSION_KEYS = ("tpukernels", "jax", "jaxlib", "libtpu", "torch")
#: recorded per family, not required to agree: a digest of the package's code and shipped tuning data at the
#: time of the run (the package version does not change with every edit). A family is re-run when its
#: kernels change; the report lists each family's digest and flags those older than the current source.
SOURCE_KEY = "tpukernels_source"

#: a cycle estimate this far below the MXU roofline cannot be right (the roofline is a lower bound)
CREDIBLE_FRACTION = 0.95


class VersionMismatch(TpuKernelError):
    """Result files made with different package versions were about to be mixed in one report."""


class EstimateError(RuntimeError):
    """libtpu could not estimate a program (its static profiler aborted, or the compile failed)."""


def versions(family: str | None = None) -> dict:
    """Package versions (``VERSION_KEYS``) plus Python and the host CPU, for result headers; ``SOURCE_KEY`` is
    :func:`source_digest` of ``family`` (the whole package when None)."""
    from importlib import metadata

    out = {}
    out[SOURCE_KEY] = source_digest(family)
    for pkg in VERSION_KEYS:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    out["python"] = platform.python_version()
    out["libtpu_init_args"] = os.environ.get("LIBTPU_INIT_ARGS", "")
    out["host"] = _cpu_name()
    return out


#: package paths (relative, ``/``-separated; a trailing ``/`` is a folder) that cannot change a model family's
#: figures: command lines, report rendering, host-side measurements, framework integrations. They are left out
#: of a family's :func:`source_digest`, so that editing them does not mark every family's figures as stale.
NOT_IN_FIGURES = ("cli.py", "cli_common.py", "_imports.py", "demo.py", "integrations/", "frontends/", "distributed/",
                  "autotune/cli.py", "autotune/report.py", "autotune/executors.py", "bench/cli.py", "bench/report.py",
                  "bench/host.py", "bench/_host_kernels.py", "bench/executors.py",
                  "bench/measure.py", "bench/families.py",
                  # the torch runners (cpu interpret, torch_tpu): a model figure is a Mosaic lowering, never a torch call
                  "targets/cpu.py", "targets/tpu.py")


def _family_sources(family: str):
    """``(library modules, tuning-data file names, bench modules)`` a model family's figures depend on: the family
    module's ``LIBRARY`` (default ``(family,)``), the shipped tuning files of the kernels those modules define, and
    its ``BENCH`` (default ``()``): the other families' bench modules its cases are built from."""
    import importlib

    from ..dsl.kernel import TpuKernel

    mod = importlib.import_module(f"{__package__}.{family}")
    libs = tuple(getattr(mod, "LIBRARY", (family,)))
    data = set()
    for lib in libs:
        lm = importlib.import_module(f"tpukernels.library.{lib}")
        data |= {v.qualname.replace("::", ".") + ".json" for v in vars(lm).values() if isinstance(v, TpuKernel)}
    return libs, data, tuple(getattr(mod, "BENCH", ()))


def source_digest(family: str | None = None, root: str | None = None) -> str:
    """SHA-256 (12 hex digits) of the installed ``tpukernels`` sources a benchmark family's figures depend on.

    ``family=None`` (and ``"host"``, whose figures time the whole package): every ``.py`` and ``.json`` file.
    A model family: every ``.py`` file except :data:`NOT_IN_FIGURES`, the other families' bench modules (but those
    in its ``BENCH``) and the library modules the family does not use (``LIBRARY``), plus the shipped tuning files of its own
    kernels. So a family is flagged stale in BENCHMARKS.md only when something its figures depend on changed.
    ``root``: the package folder to digest (default: this installed package; which files a family depends on
    always comes from the installed modules)."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scoped = family is not None and family != "host"
    if scoped:
        libs, data, bench = _family_sources(family)
        skip = set(NOT_IN_FIGURES) | {f"bench/{f}.py" for f in MODEL_FAMILIES if f != family and f not in bench}

    def wanted(rel: str) -> bool:
        if not rel.endswith((".py", ".json")):
            return False
        if not scoped:
            return True
        if rel.endswith(".json"):
            return rel.startswith("data/autotuning/") and rel.rsplit("/", 1)[1] in data
        if rel in skip or any(rel.startswith(p) for p in skip if p.endswith("/")):
            return False
        if rel.startswith("library/") and rel != "library/__init__.py":  # a module, or a package's files
            return rel[len("library/"):].split("/")[0].removesuffix(".py") in libs
        return True

    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for name in sorted(files):
            path = os.path.join(d, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if wanted(rel):
                h.update(rel.encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:12]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def check_versions(headers: dict[str, dict]) -> dict:
    """The common versions of several result files (``{name: versions}``).

    Raises:
        VersionMismatch: two files disagree on a package of ``VERSION_KEYS`` (names the files and versions).
    """
    common: dict = {}
    seen: dict = {}
    for name, v in headers.items():
        for k in VERSION_KEYS:
            if k in common and v.get(k) != common[k]:
                raise VersionMismatch(
                    f"{name} was made with {k} {v.get(k)}, {seen[k]} with {k} {common[k]}: figures from "
                    f"different versions are not mixed; re-run `tpukernels bench` for the older families")
            common.setdefault(k, v.get(k))
            seen.setdefault(k, name)
    return common


# ------------------------------------------------------------------------------------------- estimates
def _atomic_write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def default_cache_path() -> str:
    from ..autotune.db import user_cache_dir

    return os.path.join(user_cache_dir(), "bench", "estimates.json")


_MOSAIC_BODY = re.compile(r'(\\22body\\22: \\22)([A-Za-z0-9+/=]+)(\\22)')
_LOC_DEF = re.compile(r"^#loc\d*\s*=.*(?:\n|$)", re.M)  # the whole line: their count depends on the call stack
_LOC_USE = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")


def _mosaic_digest(match) -> str:
    """SHA-256 of a Mosaic kernel body (base64 bytecode in ``tpu_custom_call``'s backend_config), printed
    without debug locations."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import tpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager

    with jmlir.make_ir_context() as ctx:
        tpu.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True  # the serialized form's versioned op names
        module = ir.Module.parse(base64.b64decode(match.group(2)))
        PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
        asm = module.operation.get_asm(enable_debug_info=False)
    return match.group(1) + hashlib.sha256(asm.encode()).hexdigest() + match.group(3)


def program_key(exported) -> str:
    """A content hash of an exported program that ignores source locations.

    ``jax.export`` embeds file:line locations in the StableHLO and inside each Mosaic kernel body, so an
    edit that only moves code would change a hash of the serialized bytes. The key hashes the module text
    with locations removed (whole ``#loc`` lines: how many there are depends on the caller's stack; until
    2026-12-02 their blank lines stayed, so entries cached before then are misses once) and each Mosaic
    body re-printed without debug info. Falls back to the hash of
    the serialized bytes (only ever a cache miss) if the text cannot be canonicalised."""
    try:
        text = _MOSAIC_BODY.sub(_mosaic_digest, exported.mlir_module())
        text = _LOC_USE.sub("", _LOC_DEF.sub("", text))
        return "t" + hashlib.sha256(text.encode()).hexdigest()
    except Exception:  # noqa: BLE001  (a new jax printing format: a cache miss, never a wrong hit)
        return "b" + hashlib.sha256(bytes(exported.serialize())).hexdigest()


class Estimator:
    """libtpu static cycle estimates of jitted JAX programs, cached by program hash (see module docstring).

    One estimate server (:class:`tpukernels.autotune.estimator.CycleEstimator`) per thread, so
    ``jobs`` threads estimate in parallel (each server holds its own libtpu; an 8192^3 matmul estimate
    needs ~14 GB of host memory).

    Args:
        cache_path: JSON file of cached estimates (None: no cache).
        timeout_s: per-estimate limit, seconds.
    """

    def __init__(self, cache_path: str | None = None, timeout_s: float = 1800):
        from ..autotune.db import versions as _v

        self.cache_path = cache_path
        self.timeout_s = timeout_s
        self.libtpu = _v().get("libtpu")
        self._lock = threading.Lock()
        self._local = threading.local()
        self._cache = self._load()
        self.hits = self.misses = 0

    def _load(self) -> dict:
        if not self.cache_path or not os.path.exists(self.cache_path):
            return {}
        try:
            with open(self.cache_path) as f:
                return json.load(f)
        except (OSError, ValueError):  # a torn or foreign file: keep it aside, start empty
            os.replace(self.cache_path, self.cache_path + ".corrupt")
            return {}

    def _save(self, key: str, value: dict) -> None:
        if not self.cache_path:
            return
        from filelock import FileLock

        with self._lock, FileLock(self.cache_path + ".lock"):
            disk = {}
            if os.path.exists(self.cache_path):
                try:
                    with open(self.cache_path) as f:
                        disk = json.load(f)
                except (OSError, ValueError):
                    disk = {}
            disk[key] = value
            _atomic_write_json(self.cache_path, disk)

    def _client(self):
        from ..autotune.estimator import CycleEstimator

        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = CycleEstimator()
            import atexit

            atexit.register(c.close)
        return c

    def _recycle(self, max_rss_bytes: int = 2 << 30) -> None:
        """Close this thread's server once it holds more than ``max_rss_bytes`` (libtpu keeps the memory
        of a big estimate: an 8192^3 matmul leaves ~14 GB, and a second one in the same process runs the
        2-core, 24 GB machine out of memory)."""
        c = getattr(self._local, "client", None)
        proc = getattr(c, "_proc", None)
        if proc is None:
            return
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            return
        if rss > max_rss_bytes:
            c.close()

    def cycles(self, fn, structs, chip: str) -> int:
        """libtpu's ``estimated_cycles`` of ``fn`` (jitted) at ``structs`` on ``chip`` (cached).

        Raises:
            EstimateError: libtpu's profiler aborted or wrote no profile (cached: it is deterministic), or
                the estimate timed out or its process was killed (not cached).
        """
        from ..chips import get_chip
        from ..targets.compile_only import export_for_chip

        target = get_chip(chip)
        chip = target.name
        exported = export_for_chip(fn, target, structs)
        flags = os.environ.get("LIBTPU_INIT_ARGS", "").strip()  # compiler flags change the estimate
        key = f"{self.libtpu}|{chip}|{program_key(exported)}" + (f"|{flags}" if flags else "")
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            if "error" in hit:
                raise EstimateError(hit["error"])
            return int(hit["cycles"])
        self.misses += 1
        blob = exported.serialize()
        t0 = time.perf_counter()
        for attempt in (1, 2):
            try:
                cyc = self._client().estimate(bytes(blob), chip, self.timeout_s)
                entry = {"cycles": cyc} if cyc is not None else {"error": "libtpu wrote no static profile"}
                break
            except RuntimeError as e:
                from ..autotune.estimator import EstimateTimeout

                msg = str(e)
                # a server that died without a libtpu check failure or abort (".cc:" or "signal 6" in its
                # last lines) was killed from outside (out of memory): not a property of the program, so
                # not cached; retried once in a fresh server (the client restarts it)
                # (a SIGTERM / SIGKILL from outside also leaves ".cc:" lines, e.g. coredump_hook.cc: not an abort)
                aborted = (".cc:" in msg or "signal 6" in msg) and not any(k in msg for k in ("SIGTERM", "SIGKILL"))
                if isinstance(e, EstimateTimeout) or (msg.startswith("estimate server exited") and not aborted):
                    if attempt == 1 and not isinstance(e, EstimateTimeout):
                        continue
                    raise EstimateError(f"{msg or 'estimate server exited'} (not cached; out of host memory?)") from e
                entry = {"error": msg[:300]}
                break
            finally:
                self._recycle()
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        with self._lock:
            self._cache[key] = entry
        self._save(key, entry)
        if "error" in entry:
            raise EstimateError(entry["error"])
        return int(entry["cycles"])


# --------------------------------------------------------------------------------------- cases and rows
Program = tuple[Callable, list]  # (jitted fn, ShapeDtypeStructs)


@dataclasses.dataclass
class Impl:
    """One implementation of a case.

    Attributes:
        name: e.g. ``"tpukernels"``, ``"xla"``, ``"jax flash_attention"``.
        kind: ``"ours"``, ``"xla"`` or ``"public"``.
        cycles: ``fn(estimator, chip) -> (cycles, config)``; cycles for the whole case (already scaled).
        config: a description of the configuration when known before estimating.
        floor_us: for when libtpu cannot estimate: a lower bound on the model time, µs (marked as such).
        probe: ``fn(estimator, chip) -> (cycles, flops)`` of a variant whose work is known exactly (e.g.
            attention without the causal mask); an estimate below that variant's MXU roofline shows that
            libtpu's cost model misses work in this kernel, and the row is flagged.
        memory: ``fn(chip) -> dict`` of compile-only memory figures (e.g. ``{"peak_temp_MiB": 4.0}``), kept in
            the row's ``memory`` field whether or not the estimate succeeds (the report shows them).
        parts: ``[(kernel, args, kwargs)]``, the tpukernels kernel calls whose sum *is* the modelled program at
            the full problem (set by :func:`ours_impl` when nothing else is modelled): what ``tpukernels bench
            --measure`` runs on a TPU (:mod:`tpukernels.bench.measure`). None: not measurable part by part.
    """

    name: str
    kind: str
    cycles: Callable[[Estimator, str], tuple[int, Any]]
    config: Any = None
    floor_us: Callable[[str], float] | None = None
    probe: Callable[[Estimator, str], tuple[int, int]] | None = None
    memory: Callable[[str], dict] | None = None
    parts: list | None = None


@dataclasses.dataclass
class Case:
    """One op at one shape on one chip; ``hbm_bytes`` / ``flops``: what the op must move / compute."""

    family: str
    op: str
    shape: str
    chip: str
    hbm_bytes: int
    flops: int
    impls: list[Impl]
    dtype: str = "bfloat16"


def _fmt_config(config) -> str:
    if config is None:
        return "-"
    if isinstance(config, str):
        return config
    if isinstance(config, (list, tuple)):
        return " + ".join(_fmt_config(c) for c in config) if config and isinstance(config[0], dict) else \
            ",".join(map(str, config))
    return ",".join(f"{k}={v}" for k, v in sorted(config.items()))


def run_case(case: Case, est: Estimator, log: Callable[[str], None] = lambda m: None) -> list[dict]:
    """Estimate every implementation of ``case``; one row (dict) per implementation.

    Row fields: family, op, shape, chip, impl, kind, config, cycles, model_us, cycles_us, roofline_us,
    pct_roofline, bound, figure (``"estimate"`` or ``"floor"``), credible (bool), flags (list of str),
    error, seconds, and ``ours_speedup`` (this implementation's time / tpukernels' time: > 1 means
    tpukernels is faster; None for tpukernels itself or when either is missing).
    """
    from ..autotune.estimator import EstimateTimeout

    rows = []
    for impl in case.impls:
        t0 = time.perf_counter()
        row = {"family": case.family, "op": case.op, "shape": case.shape, "chip": case.chip, "impl": impl.name,
               "kind": impl.kind, "config": _fmt_config(impl.config), "flags": [],
               "error": None, "cycles": None, "model_us": None, "cycles_us": None, "figure": None,
               "credible": None, "hbm_bytes": case.hbm_bytes, "flops": case.flops}
        mt = None
        try:
            cyc, cfg = impl.cycles(est, case.chip)
            if cfg is not None:
                row["config"] = _fmt_config(cfg)
            mt = model_time(case.chip, cyc, case.hbm_bytes, case.flops, case.dtype)
            row.update(cycles=int(cyc), figure="estimate")
        except (EstimateError, EstimateTimeout, TpuKernelError) as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
            if impl.floor_us is not None:
                floor = impl.floor_us(case.chip)
                mt = model_time(case.chip, None, case.hbm_bytes, case.flops, case.dtype)
                row.update(figure="floor", model_us=floor)
        if mt is not None:
            row.update(cycles_us=mt.cycles_us, roofline_us=mt.roofline_us,
                       bound=mt.bound if row["figure"] == "estimate" else "floor")
            if row["figure"] == "estimate":
                row["model_us"] = mt.time_us
                # below the HBM roofline is expected (libtpu does not model HBM fully: the max() handles
                # it); below the MXU roofline is impossible
                row["credible"] = mt.cycles_us >= CREDIBLE_FRACTION * mt.compute_us
                if not row["credible"]:
                    row["flags"].append(f"libtpu estimate {mt.cycles_us:.1f} µs is below the MXU roofline "
                                        f"{mt.compute_us:.1f} µs")
            row["pct_roofline"] = 100.0 * mt.roofline_us / row["model_us"]
        if impl.probe is not None and row["figure"] == "estimate":
            try:
                pc, pflops = impl.probe(est, case.chip)
                pm = model_time(case.chip, pc, 0, pflops, case.dtype)
                row["probe_cycles_us"], row["probe_roofline_us"] = pm.cycles_us, pm.compute_us
                if pm.cycles_us < CREDIBLE_FRACTION * pm.compute_us:
                    row["credible"] = False
                    row["flags"].append(
                        f"without the mask libtpu estimates {pm.cycles_us:.1f} µs, below that variant's MXU "
                        f"roofline {pm.compute_us:.1f} µs: the cost model misses work in this kernel")
            except (EstimateError, EstimateTimeout, TpuKernelError) as e:
                row["flags"].append(f"credibility probe failed (estimate unchecked): {str(e).splitlines()[0][:160]}")
        if impl.memory is not None:
            try:
                row["memory"] = impl.memory(case.chip)
            except Exception as e:  # noqa: BLE001  (a compile failure: recorded, the time figure stands)
                row["flags"].append(f"memory analysis failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        row["seconds"] = round(time.perf_counter() - t0, 1)
        log(f"  {case.chip:6} {case.op:24} {case.shape:18} {impl.name:24} "
            + (f"{row['model_us']:10.1f} µs ({row['figure']})" if row["model_us"] is not None else f"{row['error']}")
            + (" [not credible]" if row["credible"] is False else "") + f"  [{row['seconds']}s]")
        rows.append(row)
    ours = next((r for r in rows if r["kind"] == "ours"), None)
    for r in rows:
        r["ours_speedup"] = None
        if r is not ours and ours and ours["model_us"] and r["model_us"]:
            r["ours_speedup"] = r["model_us"] / ours["model_us"]
    return rows


# ------------------------------------------------------------------------------------------ result files
def save_result(path: str, family: str, kind: str, rows: list, extra: dict | None = None) -> dict:
    """Write one family's result file (atomically) and return it (the source digest is of the family's sources
    for a model family, of the whole package otherwise: ``host``, ``measured``)."""
    result = {"family": family, "kind": kind, "versions": versions(family if family in MODEL_FAMILIES else None),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "rows": rows, **(extra or {})}
    _atomic_write_json(path, result)
    return result


def load_results(results_dir: str, families) -> dict[str, dict]:
    """``{family: result}`` for the families whose files exist; versions are checked (:func:`check_versions`).

    Raises:
        VersionMismatch: the files were made with different versions.
    """
    out = {}
    for fam in families:
        p = os.path.join(results_dir, f"{fam}.json")
        if os.path.exists(p):
            with open(p) as f:
                out[fam] = json.load(f)
    check_versions({f"{fam}.json": r["versions"] for fam, r in out.items()})
    return out


def kernel_program(kernel, chip: str, args, kwargs, config=None):
    """``(fn, structs, config, source)`` of a tpukernels kernel lowered for ``chip`` (Mosaic).

    ``args`` as for :func:`tpukernels.compile_for` (shape strings such as ``"8192x4096:bf16"``);
    ``config=None`` resolves as a call would (tuning DB for ``chip``, else the heuristic); ``source`` says
    which (``"shipped"``, ``"user"``, ``"heuristic"``, ``"explicit"``, ...).
    """
    from ..chips import get_chip
    from ..lowering import lower
    from ..targets import bucket_specs
    from ..targets.compile_only import example_specs

    specs, statics = example_specs(kernel, args, kwargs)
    low = lower(kernel, bucket_specs(kernel, specs), statics, config, mode="mosaic", chip=get_chip(chip))
    return low.fn, list(low.arg_structs), dict(low.config), low.resolved.source


def ours_impl(parts, *, scale: int = 1, extra: Callable | None = None, probe=None) -> Impl:
    """The tpukernels implementation: (the sum of the estimates of ``parts`` plus ``extra(estimator, chip)``
    cycles, e.g. an XLA op the wrapper runs) times ``scale``.

    ``parts``: ``[(kernel, args, kwargs)]`` or ``[(kernel, args, kwargs, full_args)]``: with ``full_args``
    the config is the one a call at ``full_args`` gets (tuning DB / heuristic), and the estimate is of
    ``args`` at that config (a reduced problem, e.g. 1/8 of the heads, scaled back by ``scale``).

    The Impl's ``parts`` are the calls at the full problem (``full_args`` where given), what ``--measure``
    runs; None when ``extra`` is given (the model then includes work outside the kernels) or a part without
    ``full_args`` is scaled (the model is of a problem no single call makes)."""

    def cycles(est: Estimator, chip: str):
        total, cfgs = 0, []
        for kernel, args, kwargs, *full in parts:
            fn, structs, cfg, source = kernel_program(kernel, chip, full[0] if full else args, kwargs)
            if full:  # the reduced problem at the full problem's config
                fn, structs, _, _ = kernel_program(kernel, chip, args, kwargs, cfg)
            total += est.cycles(fn, structs, chip)
            cfgs.append((kernel.qualname.split("::")[-1], dict(cfg, source=source)))
        total += extra(est, chip) if extra else 0
        if len(cfgs) == 1:
            return total * scale, cfgs[0][1]
        return total * scale, "; ".join(f"{name}: {_fmt_config(c)}" for name, c in cfgs)

    whole = extra is None and (scale == 1 or all(len(p) == 4 for p in parts))  # the parts are the full problem
    runnable = [(kernel, full[0] if full else args, kwargs) for kernel, args, kwargs, *full in parts] if whole else None
    return Impl("tpukernels", "ours", cycles, probe=probe, parts=runnable)


def xla_impl(fn, structs, *, name: str = "xla", scale: int = 1, floor_us=None) -> Impl:
    """XLA's own compilation of ``fn`` (jnp code, fused by XLA) at ``structs``."""
    return Impl(name, "xla", lambda est, chip: (est.cycles(fn, structs, chip) * scale, None),
                config="XLA fusion", floor_us=floor_us)
