"""libtpu's static cycle estimate, served by one long-lived subprocess per tuning process.

libtpu reads ``--xla_jf_dump_static_llo_profile_to`` once, when it loads, and then profiles *every*
compile of that process (slowly, for big grids), so the estimate cannot share a process with ordinary
compiles. :func:`tpukernels.targets.compile_only.estimate_cycles_of` starts a fresh subprocess per call
(~1 s of Python + jax + libtpu start-up); a sweep instead keeps one server per worker and sends it
``jax.export`` blobs over a pipe: one JSON line per request and per reply (with the request id). The
estimate runs while the worker compiles the same config normally. The server exits when its stdin
closes (its owner exited or was killed).

    python -m tpukernels.autotune.estimator      # the server (started by CycleEstimator)
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

FLAG = "--xla_jf_dump_static_llo_profile_to"


class EstimateTimeout(TimeoutError):
    """The static estimate took longer than its timeout (the server was killed)."""


class CycleEstimator:
    """Client of one estimate server (started lazily, restarted after a timeout or a crash)."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._log = None
        self._next_id = 0

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="tpk_estimate_")
        from ..targets.compile_only import compile_only_env

        env = compile_only_env(dict(os.environ))
        env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + f" {FLAG}={self._dir}/llo").strip()
        env["JAX_PLATFORMS"] = "cpu"
        # libtpu's own log files (default /tmp/tpu_logs) go to this server's folder, removed by close(): a
        # profile that fails libtpu's LLO checks logs the whole program, ~10 GB per attempt, which filled a
        # 250 GB disk in a day of bench runs. Its fatal lines still reach stderr (server.log: the error text)
        env.setdefault("TPU_LOG_DIR", os.path.join(self._dir, "tpu_logs"))
        self._log = open(os.path.join(self._dir, "server.log"), "w")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tpukernels.autotune.estimator"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True, bufsize=1,
        )

    def submit(self, blob: bytes, chip: str) -> int:
        """Queue an estimate of a serialized ``jax.export`` on ``chip``; returns its request id.

        The server works while the caller does other things (e.g. the ordinary compile of the same config).

        Raises:
            RuntimeError: the server could not be started or died.
        """
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()
        self._next_id += 1
        path = os.path.join(self._dir, f"request-{self._next_id}.bin")
        with open(path, "wb") as f:
            f.write(blob)
        try:
            self._proc.stdin.write(json.dumps({"id": self._next_id, "blob": path, "chip": chip}) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self.close()
            raise RuntimeError(f"estimate server died: {e}") from None
        return self._next_id

    def result(self, request: int, timeout_s: float) -> int | None:
        """``estimated_cycles`` of request ``request`` (replies to abandoned requests are skipped).

        Raises:
            EstimateTimeout: no answer within ``timeout_s`` (the server is killed; the next call restarts it).
            RuntimeError: the compile failed or the server died (message has the reason).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is None:
                raise RuntimeError("estimate server is not running")
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._proc.stdout], [], [], max(0.0, left))
            if not ready:
                self.close()
                raise EstimateTimeout(f"libtpu static estimate took more than {timeout_s:.0f} s")
            line = self._proc.stdout.readline()
            if not line:
                tail = self._tail()
                self.close()
                raise RuntimeError(f"estimate server exited: {tail}")
            reply = json.loads(line)
            try:
                os.unlink(os.path.join(self._dir, f"request-{reply.get('id')}.bin"))
            except OSError:
                pass
            if reply.get("id") != request:
                continue  # an abandoned request (its candidate failed to compile)
            if "error" in reply:
                raise RuntimeError(reply["error"])
            return reply["cycles"]

    def estimate(self, blob: bytes, chip: str, timeout_s: float) -> int | None:
        """:meth:`submit` then :meth:`result`."""
        return self.result(self.submit(blob, chip), timeout_s)

    def _tail(self) -> str:
        try:
            with open(os.path.join(self._dir, "server.log")) as f:
                return " | ".join(f.read().strip().splitlines()[-3:])
        except OSError:
            return ""

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.kill()
                self._proc.wait(timeout=10)
            except Exception:
                pass
            for stream in (self._proc.stdin, self._proc.stdout):
                try:
                    stream.close()
                except Exception:
                    pass
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


_CLIENT: CycleEstimator | None = None


def client() -> CycleEstimator:
    """This process's estimate client (closed at exit)."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = CycleEstimator()
        atexit.register(_CLIENT.close)
    return _CLIENT


def _serve() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed to fd 1 by libtpu or jax goes to the log, never into the protocol
    dump = None
    for part in os.environ.get("LIBTPU_INIT_ARGS", "").split():
        if part.startswith(FLAG + "="):
            dump = part.split("=", 1)[1]
    from tpukernels.targets.compile_only import _compile_exported_main, parse_llo_profiles

    for line in sys.stdin:
        req = {}
        try:
            req = json.loads(line)
            shutil.rmtree(dump, ignore_errors=True)
            os.makedirs(dump, exist_ok=True)
            _compile_exported_main(req["blob"], req["chip"])
            reply = {"id": req.get("id"), "cycles": parse_llo_profiles(dump)}
        except Exception as e:  # reported to the client, the server stays up
            first = next((ln for ln in str(e).splitlines() if ln.strip()), str(e))
            reply = {"id": req.get("id"), "error": f"{type(e).__name__}: {first[:400]}"}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


if __name__ == "__main__":
    _serve()
