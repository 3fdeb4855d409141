"""Where candidate evaluations run: in this process, or in a pool of worker processes.

A sweep only needs :class:`Executor`'s four methods, so another engine (e.g. Ray: ``submit`` ->
``remote_fn.remote(...)`` and ``ObjectRef.future()``) can run the same sweep by implementing them. Jobs are
``run_job(kernel_ref, problem_payload, config, evaluator)``: plain picklable data, and the kernel is
found in the worker by importing the module (or ``.py`` file) that defines it.

:class:`ProcessExecutor` uses ``concurrent.futures.ProcessPoolExecutor`` with the ``spawn`` start method
(safe with jax/libtpu threads) and ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` so every worker can load libtpu. Each
worker leads its own process group, so :meth:`ProcessExecutor.restart` (after a timeout) kills a worker
together with the libtpu estimate server it started.
"""

from __future__ import annotations

import abc

import concurrent.futures as cf
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable, Sequence


class Executor(abc.ABC):
    """Runs jobs; returns ``concurrent.futures.Future``-like objects."""

    #: how many jobs may be in flight at once
    slots: int = 1

    @abc.abstractmethod
    def submit(self, fn: Callable, *args) -> cf.Future:
        raise NotImplementedError

    def restart(self) -> None:
        """Abandon every running job (their futures are never resolved) and get ready for new ones."""

    def shutdown(self) -> None:
        """Release the workers (running jobs are abandoned)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class InlineExecutor(Executor):
    """Runs each job in this process when it is submitted (no parallelism, no timeouts; the simplest to debug)."""

    slots = 1

    def submit(self, fn: Callable, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - a job's failure belongs to its future
            if isinstance(e, KeyboardInterrupt):
                raise
            fut.set_exception(e)
        return fut


from ..targets.compile_only import COMPILE_ONLY_ENV as _WORKER_ENV  # noqa: E402


def _worker_init(imports: Sequence[str], env: dict) -> None:
    try:
        os.setpgid(0, 0)  # own process group: restart() kills this worker and its estimate server together
    except OSError:
        pass
    for k, v in env.items():
        os.environ.setdefault(k, v)
    from ..cli import _import  # (importing tpukernels registered the tuning-DB resolver, as in the parent)

    for spec in imports:
        try:
            _import(spec)
        except Exception as e:  # each job then fails with "kernel ... not found", naming the source
            print(f"tpukernels autotune worker: importing {spec!r} failed: {type(e).__name__}: {e}", file=sys.stderr)


class ProcessExecutor(Executor):
    """A pool of ``workers`` spawned processes; ``imports`` (module names or ``.py`` paths) load in each.

    Args:
        workers: number of processes (each loads jax and libtpu: ~1-2 s of start-up).
        imports: modules / files defining the kernels to tune, imported when a worker starts.
        env: environment defaults for the workers (``JAX_PLATFORMS`` is inherited from this process).
        startup_timeout_s: the pool's workers must all be up within this long (else RuntimeError).
    """

    def __init__(self, workers: int = 2, imports: Sequence[str] = (), env: dict | None = None,
                 startup_timeout_s: float = 300.0):
        self.slots = max(1, int(workers))
        self.startup_timeout_s = startup_timeout_s
        self.imports = list(dict.fromkeys(imports))
        self.env = {**_WORKER_ENV, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), **(env or {})}
        self._pool: cf.ProcessPoolExecutor | None = None

    def _ensure(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                max_workers=self.slots, mp_context=mp.get_context("spawn"),
                initializer=_worker_init, initargs=(self.imports, self.env),
            )
            # Start every worker now (one job each, submitted together), so worker start-up (seconds: jax,
            # torch, libtpu) is not charged to the first candidates' timeouts.
            warm = [self._pool.submit(os.getpid) for _ in range(self.slots)]
            try:
                for f in warm:
                    f.result(timeout=self.startup_timeout_s)
            except Exception as e:
                self._kill_workers()
                raise RuntimeError(f"autotune worker processes failed to start: {type(e).__name__}: {e}") from e
        return self._pool

    def submit(self, fn: Callable, *args) -> cf.Future:
        return self._ensure().submit(fn, *args)

    def _kill_workers(self) -> None:
        pool = self._pool
        if pool is None:
            return
        procs = dict(getattr(pool, "_processes", None) or {})  # CPython's pool keeps {pid: Process}
        pool.shutdown(wait=False, cancel_futures=True)
        for pid in procs:
            for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    kill()
                    break
                except (ProcessLookupError, PermissionError, OSError):
                    continue
        for p in procs.values():
            try:
                p.join(timeout=10)
            except Exception:
                pass
        self._pool = None

    def restart(self) -> None:
        self._kill_workers()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
