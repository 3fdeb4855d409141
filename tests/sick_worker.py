"""A pytest-xdist worker whose process is broken exits, so its test reruns in a fresh one.

Seen in CI (2026-12-07, one run in three): after XLA:CPU's native heap went bad in a long-lived ``make test``
worker, five tests in a row failed with ``MemoryError`` / ``SystemError`` raised out of MLIR / nanobind calls
(15+ GiB free: not a real allocation failure), and then the worker died of a SIGSEGV. A crash is rerun on a fresh
worker (pytest-rerunfailures, ``make test``'s ``--reruns 1``); those failures were not, since an ordinary failure
is never rerun (``--rerun-except .``). This hook turns such a failure into the crash it foreshadows: the worker
exits at once, xdist starts a new one, and the failed test reruns there. A genuine failure of that kind fails
again in the fresh process and is reported; outside xdist nothing changes.
"""

import os
import sys

import pytest

#: exceptions that mean the process, not the test, is broken
SICK_PROCESS = (MemoryError, SystemError)
#: the exit status of a worker that left for that reason
EXIT_STATUS = 70


def chain(exc):
    """``exc`` and the exceptions it was raised from or during (``__cause__`` / ``__context__``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or not report.failed or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    sick = next((e for e in chain(call.excinfo.value) if isinstance(e, SICK_PROCESS)), None)
    if sick is not None:
        sys.stderr.write(f"\n{item.nodeid}: {type(sick).__name__} ({str(sick)[:200]}): this worker process is "
                         f"broken; it exits so the test reruns in a fresh one (tests/sick_worker.py)\n")
        sys.stderr.flush()
        os._exit(EXIT_STATUS)
