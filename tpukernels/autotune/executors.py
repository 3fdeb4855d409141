"""Where candidate evaluations run: in this process, in a pool of worker processes, or as Ray tasks.

A sweep only needs :class:`Executor`'s methods, so another engine can run the same sweep by implementing
them: :class:`RayExecutor` does (``submit`` -> ``remote_fn.remote(...)`` and ``ObjectRef.future()``;
``cancel`` -> ``ray.cancel(force=True)``). Jobs are
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
import threading
import time
from collections.abc import Callable, Sequence


class Executor(abc.ABC):
    """Runs jobs; returns ``concurrent.futures.Future``-like objects."""

    #: how many jobs may be in flight at once
    slots: int = 1

    @abc.abstractmethod
    def submit(self, fn: Callable, *args) -> cf.Future:
        raise NotImplementedError

    def worker_died(self, exc: BaseException) -> bool:
        """True when ``exc`` (from a job's future) means the worker of *that job alone* died (e.g. a Ray
        task's worker crashed); the job is then recorded as crashed and the others go on."""
        return False

    def running_since(self, fut: cf.Future, submitted: float) -> float | None:
        """When (``time.monotonic()``) the job began to run, or None if it is still queued; a candidate's
        timeout counts from then. Default: its submission time ``submitted``."""
        return submitted

    def cancel(self, fut: cf.Future) -> bool:
        """Stop one job (a hung candidate) without touching the others; False when this executor can't
        (the sweep then calls :meth:`restart` and re-submits the others)."""
        return False

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
    from .._imports import import_source as _import  # (importing tpukernels registered the DB resolver)

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


# ---------------------------------------------------------------------------------------------- ray
_RAY_IMPORTED: set = set()
_RAY_IMPORT_ERRORS: dict = {}


class _StartBoard:
    """A Ray actor the tasks tell when their candidate starts (after the worker's imports), so a candidate's
    timeout counts from then (not from its submission: a fresh worker importing jax is not hung)."""

    def __init__(self):
        self.started: list = []

    def mark(self, job: int, pid: int = 0) -> None:
        self.started.append((job, pid))

    def take(self) -> list:
        out, self.started = self.started, []
        return out


def _ray_task(board, job: int, imports: Sequence[str], env: dict, blob: bytes):
    """One job in a Ray worker: import the kernels' modules (once per worker process), then run it.

    The job travels pickled *inside* the task (``blob``), so it is unpickled only after ``imports`` ran:
    evaluators and kernels defined in a user's ``.py`` file resolve like in a :class:`ProcessExecutor`.
    """
    import pickle

    for k, v in env.items():
        os.environ.setdefault(k, v)
    todo = [s for s in imports if s not in _RAY_IMPORTED]
    if todo:
        from .._imports import import_source as _import

        for spec in todo:
            _RAY_IMPORTED.add(spec)
            try:
                _import(spec)
            except Exception as e:  # the job then fails with "kernel ... not found"; say why
                _RAY_IMPORT_ERRORS[spec] = f"importing {spec!r} on this Ray worker failed: {type(e).__name__}: {e}"
    # started = the candidate itself begins: a fresh worker's imports (torch, jax: tens of seconds on a loaded
    # machine, e.g. the worker that replaces a crashed one) are not charged to its timeout
    board.mark.remote(job, os.getpid())  # a retry (its first worker was lost) reports again, from another pid
    fn, args = pickle.loads(blob)
    out = fn(*args)
    if _RAY_IMPORT_ERRORS and getattr(out, "status", "ok") != "ok" and getattr(out, "error", None):
        out.error += "; " + "; ".join(_RAY_IMPORT_ERRORS.values())
    return out


class RayExecutor(Executor):
    """Every job is one Ray task (``num_cpus=1``, ``max_retries=retries``): on a local cluster or a user's.

    Without ``address`` this starts a local cluster of ``workers`` CPUs (``ray.init(num_cpus=workers,
    include_dashboard=False)``) and stops it on :meth:`shutdown`; with ``address`` (``"auto"``, or
    ``"ray://host:10001"``) it connects to a running cluster and leaves it running. If this process is
    already connected (``ray.is_initialized()``) that connection is used as is.

    A lost worker loses nothing: Ray re-runs a task whose worker process (or node) died, up to ``retries``
    times (task ``max_retries``: system failures only; an exception the candidate raises is its result), on a
    fresh worker, and the sweep gets that run's result. A candidate that kills its worker every time (segfault,
    ``os._exit``, out of memory) then fails with a Ray error (``WorkerCrashedError``) that :meth:`worker_died`
    recognises: only that candidate is recorded as crashed. :meth:`cancel` kills just the worker of one hung
    task (``ray.cancel(force=True)``; a cancelled task is never retried): one bad candidate never costs the
    others their work, unlike a process pool.
    Kernel modules given in ``imports`` (names or ``.py`` paths) must be importable on every node (on a
    local cluster they are). A candidate's timeout counts from when it starts (after its worker's imports;
    see ``startup_timeout_s``); :attr:`slots` (jobs in flight) defaults to the cluster's CPUs, so a submitted
    task does not wait in a queue, and :meth:`share` splits them between concurrent sweeps.

    Args:
        workers: CPUs of the local cluster (default: ``os.cpu_count()``); with ``address``, jobs in flight
            (default: the cluster's CPUs).
        imports: modules / ``.py`` files defining the kernels (and evaluators) to tune.
        env: environment defaults for the workers (``COMPILE_ONLY_ENV`` and this process's ``JAX_PLATFORMS``).
        address: a running cluster to connect to, or None for a local one.
        object_store_mb: object store size of a local cluster (jobs and trials are small).
        startup_timeout_s: a task's worker has this long (s) from submission to import ``imports`` and start
            the candidate; a candidate's timeout counts from its start (its latest, after a retry), or from the
            end of this allowance when it never starts (hung imports).
        retries: re-runs of a task whose worker died (Ray ``max_retries``), so a worker lost to the machine
            (killed, evicted, its node gone) costs a re-run, not the candidate's result.

    Raises:
        ImportError: ray is not installed (``pip install 'tpukernels[ray]'``).
    """

    def __init__(self, workers: int | None = None, imports: Sequence[str] = (), env: dict | None = None,
                 address: str | None = None, object_store_mb: int = 128, startup_timeout_s: float = 300.0,
                 retries: int = 1):
        try:
            import ray  # noqa: F401
        except ImportError as e:
            from .._env import install_hint

            raise ImportError(f"the ray executor needs ray, the ray extra: {install_hint('ray')}") from e
        self.workers = None if workers is None else max(1, int(workers))
        self.address = address
        self.object_store_mb = object_store_mb
        self.startup_timeout_s = float(startup_timeout_s)
        self.retries = max(0, int(retries))
        self.imports = list(dict.fromkeys(imports))
        self.env = {**_WORKER_ENV, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), **(env or {})}
        self._remote = None
        self._owns = False
        self._refs: dict = {}  # future -> ObjectRef, for cancel()
        self.capacity = self.workers or os.cpu_count() or 1
        self._sharers = 0
        self._lock = threading.Lock()
        self._board = None
        self._next_job = 0
        self._jobs: dict = {}  # future -> job id
        self._started: dict = {}  # job id -> time.monotonic() this process first heard it started (latest attempt)
        self._pids: dict = {}  # job id -> pid of the worker running its latest attempt
        self._waiting: dict = {}  # job id -> since when a retried job waits for its new worker (local cluster)
        self._polled = 0.0

    @property
    def slots(self) -> int:  # type: ignore[override]
        return max(1, self.capacity // max(1, self._sharers))

    def start(self) -> None:
        """Start (or connect to) the cluster now; :attr:`capacity` is then the jobs in flight at once."""
        self._ensure()

    def _ensure(self):
        import ray

        if self._remote is None:
            if not ray.is_initialized():
                # log_to_driver=False: workers' output (libtpu logs) would land on this process's stdout
                kw = dict(include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                          runtime_env={"env_vars": self.env})
                if self.address is None:
                    ray.init(num_cpus=self.capacity, object_store_memory=self.object_store_mb * 2**20, **kw)
                    self._owns = True
                else:
                    ray.init(address=self.address, **kw)
            if self.workers is None:
                self.capacity = max(1, int(ray.cluster_resources().get("CPU", 1)))
            self._remote = ray.remote(_ray_task).options(num_cpus=1, max_retries=self.retries, retry_exceptions=False)
            self._board = ray.remote(_StartBoard).options(num_cpus=0).remote()
        return self._remote

    def submit(self, fn: Callable, *args) -> cf.Future:
        import pickle

        remote = self._ensure()
        with self._lock:
            self._next_job += 1
            job = self._next_job
        ref = remote.remote(self._board, job, self.imports, self.env, pickle.dumps((fn, args)))
        fut = ref.future()
        self._refs[fut] = ref
        self._jobs[fut] = job
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut) -> None:
        self._refs.pop(fut, None)
        job = self._jobs.pop(fut, None)
        self._started.pop(job, None)
        self._pids.pop(job, None)
        self._waiting.pop(job, None)

    def running_since(self, fut: cf.Future, submitted: float) -> float | None:
        import ray

        now = time.monotonic()
        if now - self._polled > 0.25:  # one actor call per sweep-loop turn at most, not one per job
            self._polled = now
            try:
                for job, pid in ray.get(self._board.take.remote(), timeout=10):
                    if self._pids.get(job) != pid:  # a first start, or a retry on another worker
                        self._started[job], self._pids[job] = now, pid
                        self._waiting.pop(job, None)
            except Exception:  # the board is unreachable: fall back to submission times
                return submitted
            if self._owns:  # a local cluster: a job whose worker died is being retried (max_retries); its
                for job, pid in list(self._pids.items()):  # timeout restarts when the new worker reports
                    if job in self._started and not _alive(pid):
                        del self._started[job]
                        self._waiting[job] = now
        job = self._jobs.get(fut)
        started = self._started.get(job)
        since = self._waiting.get(job, submitted)
        if started is None and now - since > self.startup_timeout_s:
            # never reported a start: its worker's imports hang (jobs in flight never exceed the CPUs, so it
            # is not queued); its timeout then counts from the end of the start-up allowance
            return since + self.startup_timeout_s
        return started

    def worker_died(self, exc: BaseException) -> bool:
        from ray import exceptions as rex

        died = tuple(getattr(rex, n) for n in ("WorkerCrashedError", "NodeDiedError", "OutOfMemoryError",
                                                "LocalRayletDiedError") if hasattr(rex, n))
        return isinstance(exc, died)

    def cancel(self, fut: cf.Future) -> bool:
        import ray

        ref = self._refs.pop(fut, None)
        if ref is not None:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # already finished
                pass
        return True

    def share(self) -> "_SharedRay":
        """A handle for one of several concurrent sweeps (same cluster; the slots are split between the open
        handles; closing one with ``shutdown()`` leaves the cluster up)."""
        return _SharedRay(self)

    def restart(self) -> None:
        for fut in list(self._refs):
            self.cancel(fut)

    def shutdown(self) -> None:
        self.restart()
        if self._owns:
            import ray

            ray.shutdown()
            self._owns = False
        self._remote = self._board = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: a check, nothing is sent
    except ProcessLookupError:
        return False
    except OSError:  # exists, not ours to signal
        return True
    return True


class _SharedRay(Executor):
    """One concurrent sweep's handle on a :class:`RayExecutor` (its slots: the cluster's / active sweeps)."""

    def __init__(self, parent: RayExecutor):
        self.parent = parent
        self._mine: set = set()
        with parent._lock:
            parent._sharers += 1
        self._open = True

    @property
    def slots(self) -> int:  # type: ignore[override]
        return self.parent.slots

    def submit(self, fn: Callable, *args) -> cf.Future:
        fut = self.parent.submit(fn, *args)
        self._mine.add(fut)
        fut.add_done_callback(self._mine.discard)
        return fut

    def worker_died(self, exc: BaseException) -> bool:
        return self.parent.worker_died(exc)

    def running_since(self, fut: cf.Future, submitted: float) -> float | None:
        with self.parent._lock:
            return self.parent.running_since(fut, submitted)

    def cancel(self, fut: cf.Future) -> bool:
        self._mine.discard(fut)
        return self.parent.cancel(fut)

    def restart(self) -> None:
        for fut in list(self._mine):
            self.cancel(fut)

    def shutdown(self) -> None:  # the cluster stays up for the other sweeps
        self.restart()
        if self._open:
            with self.parent._lock:
                self.parent._sharers -= 1
            self._open = False
