"""Test setup: CPU-only JAX, a quiet libtpu, hypothesis profiles sized for 2 cores."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=["fast", "tpu"])
def interpret(request):
    """Run the test body in both cpu interpret modes ("tpu" poisons uninitialized memory with NaN).

    Debug runs: ``TPUKERNELS_DETECT_RACES=1 make test`` (or pytest) runs the "tpu" half in mode "races"
    (the interpreter's data-race detector on; a race fails the test with KernelRaceError).
    """
    import tpukernels as tk
    from tpukernels._env import env_flag

    mode = "races" if request.param == "tpu" and env_flag("TPUKERNELS_DETECT_RACES") else request.param
    with tk.interpret_mode(mode):
        yield request.param


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """A private user tuning-cache directory."""
    monkeypatch.setenv("TPUKERNELS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
