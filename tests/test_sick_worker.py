"""tests/sick_worker.py: a worker whose test fails with MemoryError / SystemError exits, the test reruns on a fresh
worker (make test's rerun options), and a genuine failure is still reported."""

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_a_sick_worker_exits_and_its_test_reruns_in_a_fresh_one(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        from sick_worker import pytest_runtest_makereport  # noqa: F401
    """))
    (tmp_path / "test_x.py").write_text(textwrap.dedent(f"""
        import os
        FLAG = {str(tmp_path / "flag")!r}

        def test_once_sick():  # the first process it runs in is broken; the next is not
            if not os.path.exists(FLAG):
                open(FLAG, "w").close()
                raise RuntimeError("lowering failed") from MemoryError("std::bad_alloc")

        def test_always_system_error():
            raise SystemError("error return without exception set")

        def test_plain_failure():
            assert 1 + 1 == 3

        def test_fine():
            pass
    """))
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-rfR", "-p", "no:cacheprovider",
                        "--reruns", "1", "--rerun-except", ".", "--max-suite-reruns", "4", str(tmp_path)],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "2 failed, 2 passed" in out and "RERUN test_x.py::test_once_sick" in out, out
    assert "FAILED test_x.py::test_plain_failure" in out and "FAILED test_x.py::test_always_system_error" in out, out
    assert "RERUN test_x.py::test_plain_failure" not in out, out
    assert "this worker process is broken" in out, out
