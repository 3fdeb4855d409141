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
    """Run the test body in both cpu interpret modes ("tpu" poisons uninitialized memory with NaN)."""
    import tpukernels as tk

    with tk.interpret_mode(request.param):
        yield request.param


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """A private user tuning-cache directory."""
    monkeypatch.setenv("TPUKERNELS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
