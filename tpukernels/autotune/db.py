"""Tuning database: per chip, per kernel JSON files, shipped with the package and overridden per user.

Layout (like tokamax's ``data/autotuning/<device_kind>/<op>.json``)::

    tpukernels/data/autotuning/<chip>/<namespace>.<name>.json      shipped with the package
    $TPUKERNELS_CACHE_DIR/autotuning/<chip>/<namespace>.<name>.json  the user's (default ~/.cache/tpukernels)

File format (``version`` 1)::

    {"version": 1, "kernel": "tpukernels::rms_norm", "chip": "v6e",
     "entries": [{"key": {...see entry_key...}, "config": {"block_rows": 256},
                  "evidence": {"evaluator": "tpu-model", "time_us": 41.2, "date": "...",
                               "versions": {"tpukernels": "...", "jax": "...", "libtpu": "..."},
                               "measured": false}}]}

``evidence.measured`` (optional, a bool) marks a config timed on a TPU (``tpukernels autotune --evaluator
measure``, ``tpukernels bench --measure --write-db``) rather than chosen by a model; files written before the
field have none, and an entry without it is measured only when its ``evaluator`` is ``"measure"``
(:func:`is_measured`). A model entry never replaces a measured one without ``force``.

Key: kernel name + kernel source hash + chip (the file) + shape bucket + dtypes + static args. A lookup
tries the user file then the shipped file: exact key first, then the nearest bucket (same dtypes, statics
and ranks; smallest log-distance of shapes). Entries whose source hash differs from the kernel's current
source are stale and skipped. A corrupted file gives a warning and is ignored. Writes take a file lock
and replace the file atomically, so concurrent sweeps lose nothing and a killed sweep leaves a valid file.
A folder that cannot be written (read-only cache dir, read-only file system) gives one warning per folder and
no entry (:func:`record` returns None), never an exception after a sweep.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import tempfile
import warnings
from collections.abc import Mapping
from importlib import resources
from typing import Any

import numpy as np

from ..dsl.kernel import TpuKernel, bucket
from ..errors import ArgumentError

log = logging.getLogger("tpukernels.autotune")
VERSION = 1


def user_cache_dir() -> str:
    """``$TPUKERNELS_CACHE_DIR`` or ``~/.cache/tpukernels``."""
    return os.environ.get("TPUKERNELS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tpukernels")


def file_name(kernel_qualname: str) -> str:
    return kernel_qualname.replace("::", ".") + ".json"


def user_db_path(kernel_qualname: str, chip: str) -> str:
    return os.path.join(user_cache_dir(), "autotuning", chip, file_name(kernel_qualname))


def shipped_db_path(kernel_qualname: str, chip: str) -> str:
    return str(resources.files("tpukernels") / "data" / "autotuning" / chip / file_name(kernel_qualname))


@functools.lru_cache(maxsize=None)
def _source_hash(kernel: TpuKernel) -> str:
    parts = []
    for fn in (kernel.body, kernel.launch_fn):
        try:
            parts.append(inspect.getsource(fn))
        except (OSError, TypeError):
            parts.append(getattr(fn, "__qualname__", repr(fn)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def source_hash(kernel: TpuKernel) -> str:
    """Hash of the kernel body and launch function source (a changed kernel invalidates its entries)."""
    return _source_hash(kernel)


def entry_key(kernel: TpuKernel, specs, statics) -> dict:
    """The lookup key of one call signature (JSON-able); statics in the kernel's canonical form
    (:meth:`~tpukernels.dsl.kernel.TpuKernel.canonical_statics`), so a default and its explicit value are one key."""
    statics = kernel.canonical_statics(specs, statics) if hasattr(kernel, "canonical_statics") else tuple(statics)
    shapes, dtypes = [], []
    for s in specs:
        if s is None:
            shapes.append(None)
            dtypes.append(None)
        else:
            shapes.append([bucket(int(d)) if int(d) > 0 else 0 for d in s.shape])
            dtypes.append(np.dtype(s.dtype).name)
    return {
        "source_hash": source_hash(kernel),
        "shapes": shapes,
        "dtypes": dtypes,
        "statics": {k: v for k, v in statics},
    }


def entry_problem(e: Any) -> str | None:
    """Why ``e`` is not a well-formed entry (key with source_hash/shapes/dtypes/statics, config), or None."""
    if not isinstance(e, dict):
        return f"an entry is a {type(e).__name__}, not an object"
    key, cfg = e.get("key"), e.get("config")
    if not isinstance(key, dict):
        return f"entry key {key!r} is not an object"
    if not isinstance(cfg, dict):
        return f"entry config {cfg!r} is not an object"
    if not isinstance(key.get("source_hash"), str):
        return "entry key has no source_hash string"
    for field in ("shapes", "dtypes"):
        if not isinstance(key.get(field), list):
            return f"entry key {field} is not a list"
    if any(s is not None and not (isinstance(s, list) and all(isinstance(d, int) for d in s)) for s in key["shapes"]):
        return f"entry key shapes {key['shapes']!r} are not lists of ints"
    if not isinstance(key.get("statics", {}), dict):
        return "entry key statics is not an object"
    ev = e.get("evidence", {})
    if not isinstance(ev, dict):
        return f"entry evidence {ev!r} is not an object"
    if not isinstance(ev.get("measured", False), bool):
        return f"entry evidence measured {ev['measured']!r} is not true or false"
    return None


def is_measured(entry: Mapping) -> bool:
    """Whether a DB entry's config was timed on a TPU: ``evidence.measured`` when the entry has it, else (files
    written before the field) whether its evaluator is ``"measure"``."""
    ev = entry.get("evidence") or {}
    return bool(ev["measured"]) if "measured" in ev else ev.get("evaluator") == "measure"


def load(path: str) -> list[dict]:
    """Well-formed entries of one DB file; [] if missing.

    Never raises for bad content: a file that is not a version-1 tuning file, or entries of the wrong
    schema, give one ``RuntimeWarning`` each and are skipped (the file itself is left as it is).
    """
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), list):
            raise ValueError("not a version-1 tpukernels tuning file")
    except FileNotFoundError:
        return []
    except (OSError, ValueError, UnicodeDecodeError) as e:
        warnings.warn(f"tpukernels: ignoring corrupted tuning file {path}: {e}", RuntimeWarning, stacklevel=2)
        return []
    good = []
    for e in data["entries"]:
        why = entry_problem(e)
        if why is None:
            good.append(e)
        else:
            warnings.warn(f"tpukernels: skipping a malformed entry of {path}: {why}", RuntimeWarning, stacklevel=2)
    return good


@functools.lru_cache(maxsize=256)
def _load_cached(path: str, mtime: float) -> tuple:
    return tuple(load(path))


def _entries(path: str) -> tuple:
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return ()
    return _load_cached(path, mtime)


def _distance(a: list, b: list) -> float:
    d = 0.0
    for sa, sb in zip(a, b):
        if (sa is None) != (sb is None):
            return math.inf
        if sa is None:
            continue
        if len(sa) != len(sb):
            return math.inf
        d += sum(abs(math.log2(max(x, 1)) - math.log2(max(y, 1))) for x, y in zip(sa, sb))
    return d


def find(entries, key: dict) -> tuple[dict | None, str]:
    """Best entry for ``key``: (entry, "exact" | "nearest") or (None, "miss")."""
    candidates = [
        e for e in entries
        if e["key"].get("source_hash") == key["source_hash"]
        and e["key"].get("dtypes") == key["dtypes"]
        and e["key"].get("statics") == key["statics"]
    ]
    for e in candidates:
        if e["key"].get("shapes") == key["shapes"]:
            return e, "exact"
    best = min(candidates, key=lambda e: _distance(e["key"].get("shapes", []), key["shapes"]), default=None)
    if best is not None and _distance(best["key"]["shapes"], key["shapes"]) < math.inf:
        return best, "nearest"
    return None, "miss"


def lookup(kernel: TpuKernel, chip: str, specs, statics) -> tuple[dict, str] | None:
    """Config for a call from the user DB, then the shipped DB; ``(config, source)`` or None.

    ``source`` is e.g. ``"user-db"`` / ``"shipped-db"``, with ``":nearest"`` for a nearest-bucket hit.
    """
    key = entry_key(kernel, specs, statics)
    for label, path in (("user-db", user_db_path(kernel.qualname, chip)), ("shipped-db", shipped_db_path(kernel.qualname, chip))):
        entries = _entries(path)
        entry, how = find(entries, key)
        if entry is not None:
            return dict(entry["config"]), label if how == "exact" else f"{label}:nearest"
        if label == "user-db" and entries:
            _warn_stale(kernel.qualname, chip, path, entries, key)
    return None


_WARNED_STALE: set = set()  # (kernel, chip, path, source hash) already warned about


def _warn_stale(qualname: str, chip: str, path: str, entries, key: dict) -> None:
    """Warn once per kernel, chip and source when the user DB only has entries for an earlier source."""
    stale = sum(1 for e in entries if e["key"].get("source_hash") != key["source_hash"])
    seen = (qualname, chip, path, key["source_hash"])
    if stale and seen not in _WARNED_STALE and not any(e["key"].get("source_hash") == key["source_hash"] for e in entries):
        _WARNED_STALE.add(seen)
        warnings.warn(f"tpukernels: {qualname}: the user tuning DB for {chip} ({path}) has {stale} entr"
                      f"{'y' if stale == 1 else 'ies'} made for an earlier version of the kernel's source (its body "
                      f"or launch function changed, docstrings included), so none is used; re-run `tpukernels "
                      f"autotune ... --write-db`", RuntimeWarning, stacklevel=4)


def versions() -> dict:
    from importlib import metadata

    out = {}
    for pkg in ("tpukernels", "jax", "jaxlib", "libtpu", "torch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


_WARNED_UNWRITABLE: set = set()  # folders already warned about by record / record_history


def _unwritable(path: str, err: OSError, what: str, errors: str) -> None:
    """``errors="raise"``: re-raise ``err``; ``"warn"``: one ``RuntimeWarning`` per folder, then go on."""
    if errors == "raise":
        raise err
    folder = os.path.dirname(path) or "."
    if folder in _WARNED_UNWRITABLE:
        log.debug("tpukernels: %s not written to %s: %s", what, path, err)
        return
    _WARNED_UNWRITABLE.add(folder)
    warnings.warn(f"tpukernels: cannot write the {what} {path} ({type(err).__name__}: {err.strerror or err}); "
                  f"nothing is stored there (said once per folder). Set TPUKERNELS_CACHE_DIR to a writable folder "
                  f"or pass --write-db PATH", RuntimeWarning, stacklevel=3)


def record(
    kernel: TpuKernel,
    chip: str,
    specs,
    statics,
    config: Mapping,
    evidence: Mapping[str, Any],
    path: str | None = None,
    errors: str = "warn",
) -> str | None:
    """Store ``config`` for a signature in the user DB (or ``path``); returns the file path.

    The file is locked (``filelock``) and rewritten through a temporary file + ``os.replace``, so two
    concurrent writers keep both entries and a crash leaves the old or the new file, never a torn one.
    An existing corrupted file is moved aside to ``<file>.corrupt`` (never silently overwritten).

    A folder or file that cannot be written (``PermissionError`` from the lock file in a read-only cache dir, a
    read-only file system, ...: any ``OSError`` of the folder, lock or write): with ``errors="warn"`` (default)
    one ``RuntimeWarning`` per folder naming the path and the reason, nothing written, and None returned (as
    :func:`load` does for a corrupt file); ``errors="raise"`` re-raises the ``OSError``.

    Returns:
        The file written, or None where it could not be written (``errors="warn"``).

    Raises:
        ArgumentError: ``errors`` is not ``"warn"`` or ``"raise"``.
        OSError: with ``errors="raise"``, what the folder, lock or write raised.
    """
    if errors not in ("warn", "raise"):
        raise ArgumentError(f"tpukernels.autotune.db.record: errors must be 'warn' or 'raise', got {errors!r}")
    path = path or user_db_path(kernel.qualname, chip)
    try:
        return _record(kernel, chip, specs, statics, config, evidence, path)
    except OSError as e:
        _unwritable(path, e, "tuning DB file", errors)
        return None


def _record(kernel, chip, specs, statics, config, evidence, path: str) -> str:
    from filelock import FileLock

    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    key = entry_key(kernel, specs, statics)
    ev = dict(evidence)
    ev.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    ev.setdefault("versions", versions())
    tmp_prefix = f".tmp-{os.path.basename(path)}-"
    with FileLock(path + ".lock", timeout=60):
        _remove_orphans(folder, tmp_prefix)  # left by a writer killed mid-write (we hold the file's lock)
        entries, mode = [], None
        if os.path.exists(path):
            mode = os.stat(path).st_mode & 0o777
            try:
                with open(path) as f:
                    data = json.load(f)
                if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
                    raise ValueError("not a version-1 tpukernels tuning file")
                entries = [e for e in data["entries"] if entry_problem(e) is None]
                if len(entries) != len(data["entries"]):
                    raise ValueError(f"{len(data['entries']) - len(entries)} malformed entries")
            except (OSError, ValueError, UnicodeDecodeError) as e:
                aside = _set_aside(path)
                warnings.warn(f"tpukernels: kept the unreadable tuning file as {aside} ({e}); its well-formed "
                              f"entries ({len(entries)}) are carried over", RuntimeWarning, stacklevel=4)
        entries = [e for e in entries if e.get("key") != key]
        entries.append({"key": key, "config": dict(config), "evidence": ev})
        data = {"version": VERSION, "kernel": kernel.qualname, "chip": chip, "entries": entries}
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=tmp_prefix, suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())  # mkstemp makes 0600
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _set_aside(path: str) -> str:
    """Move ``path`` to the first free ``<path>.corrupt[.N]`` (an earlier copy is never overwritten)."""
    aside, n = path + ".corrupt", 1
    while os.path.exists(aside):
        aside, n = f"{path}.corrupt.{n}", n + 1
    os.replace(path, aside)
    return aside


def _remove_orphans(folder: str, prefix: str) -> None:
    for name in os.listdir(folder):
        if name.startswith(prefix) and name.endswith(".json"):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def dispatch_chip() -> str | None:
    """The chip whose tuning data applies to calls here: the live TPU, else ``TPUKERNELS_TARGET_CHIP``."""
    from ..chips import target_chip_from_env

    chip = target_chip_from_env()
    if chip is not None:
        return chip.name
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return None
    try:
        import jax

        from ..chips import get_chip

        return get_chip(jax.devices()[0].device_kind).name
    except Exception:  # no TPU backend, or not a known chip: no tuning data applies
        return None


def resolver(kernel: TpuKernel, specs, statics, chip=None):
    """The config resolver registered with :data:`tpukernels.dsl.kernel.CONFIG_RESOLVERS`.

    Uses the tuning data of ``chip`` (a compile target) when given, else of :func:`dispatch_chip`.
    """
    chip = chip.name if chip is not None else dispatch_chip()
    if chip is None:
        return None
    got = lookup(kernel, chip, specs, statics)
    if got is None:
        return None
    cfg, source = got
    return cfg, f"{source}:{chip}"


# ---------------------------------------------------------------------------------------------- sweep history
# Every result of the sweeps stored with --write-db, so a learning strategy (``surrogate``) resumes instead of
# evaluating them again: ``<user cache>/autotuning/<chip>/history/<namespace>.<name>.json``, version 1:
# {"version": 1, "kernel": ..., "chip": ..., "runs": [{"key": entry_key, "problem": "<exact shapes, statics>",
#  "evaluator": "<id>",
#  "trials": [{"config": {...}, "time_us": 12.3 | null}]}]}  (null: failed, or ranked only by a bound)


def history_path(kernel_qualname: str, chip: str) -> str:
    return os.path.join(user_cache_dir(), "autotuning", chip, "history", file_name(kernel_qualname))


def load_history(kernel: TpuKernel, chip: str, specs, statics, evaluator: str,
                 problem: str = "") -> list[tuple[dict, float | None]]:
    """``(config, time_us or None)`` of every stored result for this kernel source, problem key, exact problem
    ``problem`` (its description: a shape bucket holds several), chip and evaluator identity ``evaluator`` (a
    string: another evaluator's or option's times are not comparable).
    A missing, unreadable or malformed file is no history (never an error)."""
    key = entry_key(kernel, specs, statics)
    try:
        with open(history_path(kernel.qualname, chip)) as f:
            data = json.load(f)
        runs = data["runs"] if isinstance(data, dict) and data.get("version") == VERSION else []
        out = []
        for run in runs:
            if run.get("key") == key and run.get("evaluator") == evaluator and run.get("problem", "") == problem:
                for t in run.get("trials", ()):
                    time_us = t.get("time_us")
                    if isinstance(t.get("config"), dict) and (time_us is None or isinstance(time_us, (int, float))):
                        out.append(({k: tuple(v) if isinstance(v, list) else v for k, v in t["config"].items()},
                                    time_us))
        return out
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return []


def record_history(kernel: TpuKernel, chip: str, specs, statics, evaluator: str, results, problem: str = "",
                   errors: str = "warn") -> str | None:
    """Add ``results`` (``(config, time_us or None)``) to the history (same key as :func:`load_history`; a
    config already there is replaced). Locked and atomic like :func:`record`; an unreadable file is set aside.
    An unwritable folder: as :func:`record` (``errors="warn"``: one warning per folder, None returned)."""
    if errors not in ("warn", "raise"):
        raise ArgumentError(f"tpukernels.autotune.db.record_history: errors must be 'warn' or 'raise', got {errors!r}")
    path = history_path(kernel.qualname, chip)
    try:
        return _record_history(kernel, chip, specs, statics, evaluator, results, problem, path)
    except OSError as e:
        _unwritable(path, e, "tuning history", errors)
        return None


def _record_history(kernel, chip, specs, statics, evaluator, results, problem, path: str) -> str:
    from filelock import FileLock

    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    key = entry_key(kernel, specs, statics)
    with FileLock(path + ".lock", timeout=60):
        runs = []
        if os.path.exists(path):
            try:
                with open(path) as f:
                    data = json.load(f)
                runs = data["runs"] if isinstance(data, dict) and isinstance(data.get("runs"), list) else None
                if runs is None:
                    raise ValueError("not a version-1 history file")
            except (OSError, ValueError, KeyError) as e:
                aside = _set_aside(path)
                warnings.warn(f"tpukernels: kept the unreadable tuning history as {aside} ({e})", RuntimeWarning,
                              stacklevel=4)
                runs = []
        run = next((r for r in runs if r.get("key") == key and r.get("evaluator") == evaluator
                    and r.get("problem", "") == problem), None)
        if run is None:
            run = {"key": key, "problem": problem, "evaluator": evaluator, "trials": []}
            runs.append(run)
        new = {json.dumps(c, sort_keys=True, default=str): {"config": dict(c), "time_us": t} for c, t in results}
        run["trials"] = [t for t in run["trials"]
                         if json.dumps(t.get("config"), sort_keys=True, default=str) not in new] + list(new.values())
        data = {"version": VERSION, "kernel": kernel.qualname, "chip": chip, "runs": runs}
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".tmp-{os.path.basename(path)}-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return path
