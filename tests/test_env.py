"""What `import tpukernels` sets up: lazy library ops and quiet libtpu defaults (in fresh processes)."""

import os
import subprocess
import sys

import pytest

from tpukernels import _env


def _run(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_library_ops_need_only_import_tpukernels():
    r = _run("import sys, torch, tpukernels\n"
             "assert 'tpukernels.library' not in sys.modules\n"
             "x = torch.randn(4, 128)\n"
             "y = torch.ops.tpukernels.rms_norm(x)\n"
             "ref = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()\n"
             "assert 'tpukernels.library' in sys.modules\n"
             "print(float((y.double() - ref).abs().max()))\n")
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.strip()) < 1e-5


@pytest.mark.skipif(_env.tpu_present(), reason="a TPU is attached: no compile-only defaults are set")
def test_quiet_libtpu_defaults_without_a_tpu_and_user_values_win():
    code = "import os, tpukernels; print(os.environ['TPU_ACCELERATOR_TYPE'], os.environ['TPU_WORKER_HOSTNAMES'])"
    r = _run(code, TPU_ACCELERATOR_TYPE=None, TPU_WORKER_HOSTNAMES=None)
    assert r.returncode == 0 and r.stdout.split() == ["v5litepod-1", "localhost"], r.stderr
    r = _run(code, TPU_ACCELERATOR_TYPE="v6e-8", TPU_WORKER_HOSTNAMES=None)
    assert r.stdout.split() == ["v6e-8", "localhost"]  # never overrides the user's setting


@pytest.mark.aot
@pytest.mark.skipif(_env.tpu_present(), reason="a TPU is attached")
def test_no_libtpu_warnings_on_plain_cpu_use():
    """Outside the Makefile's environment: jax's TPU probe must stay silent once tpukernels is imported."""
    r = _run("import tpukernels, jax; print(jax.devices()[0].platform)",
             JAX_PLATFORMS=None, TPU_ACCELERATOR_TYPE=None, TPU_WORKER_HOSTNAMES=None)
    assert r.returncode == 0, r.stderr
    assert "could not determine TPU" not in r.stderr and "INVALID_ARGUMENT" not in r.stderr


def test_tpu_present_reads_pci_vendor_ids(tmp_path, monkeypatch):
    dev = tmp_path / "0000:00:04.0"
    dev.mkdir()
    (dev / "vendor").write_text("0x8086\n")
    monkeypatch.setattr(_env.glob, "glob", lambda pat: [] if "accel" in pat else [str(dev / "vendor")])
    assert not _env.tpu_present()
    (dev / "vendor").write_text("0x1ae0\n")
    assert _env.tpu_present()


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                            ("0", False), ("false", False), ("No", False), ("off", False),
                                            ("", False), (None, False)])
def test_env_flag_one_parser(value, expected, monkeypatch):
    """Every TPUKERNELS_* boolean flag goes through one parser: 0/false/no/off/"" are off."""
    env = {} if value is None else {"TPUKERNELS_X": value}
    assert _env.env_flag("TPUKERNELS_X", env=env) is expected


def test_env_flag_rejects_garbage_naming_the_variable():
    from tpukernels.errors import ArgumentError

    with pytest.raises(ArgumentError, match="TPUKERNELS_X='maybe'"):
        _env.env_flag("TPUKERNELS_X", env={"TPUKERNELS_X": "maybe"})


def test_no_env_defaults_zero_means_defaults_apply(monkeypatch):
    monkeypatch.setattr(_env, "tpu_present", lambda: False)
    monkeypatch.setenv("TPUKERNELS_NO_ENV_DEFAULTS", "0")
    assert _env.quiet_libtpu_defaults({}) == _env.COMPILE_ONLY_ENV
    monkeypatch.setenv("TPUKERNELS_NO_ENV_DEFAULTS", "1")
    assert _env.quiet_libtpu_defaults({}) == {}


@pytest.mark.parametrize("value,logged", [("0", False), ("off", False), ("1", True)])
def test_log_config_flag(value, logged, monkeypatch, caplog):
    """TPUKERNELS_LOG_CONFIG=0 does not log the config choice at INFO; =1 does."""
    import logging

    import torch

    from tpukernels.library import rms_norm

    monkeypatch.setenv("TPUKERNELS_LOG_CONFIG", value)
    from tpukernels.library.norms import rms_norm_fwd

    rms_norm_fwd._entries.clear()
    rms_norm_fwd._plans.clear()
    with caplog.at_level(logging.INFO, logger="tpukernels.dispatch"):
        rms_norm(torch.randn(8, 128))
    hits = [r for r in caplog.records if r.levelno == logging.INFO and "config" in r.getMessage()]
    assert bool(hits) is logged


@pytest.mark.parametrize("basic_config", [pytest.param(False, marks=pytest.mark.slow), True])  # True: the bug
def test_log_config_prints_each_choice_once(basic_config):
    """TPUKERNELS_LOG_CONFIG=1 prints each config choice once on stderr, with or without the application's
    logging.basicConfig (whose root handler used to print it a second time)."""
    import subprocess
    import sys

    code = ("import logging, torch\n"
            + ("logging.basicConfig(level=logging.INFO)\n" if basic_config else "")
            + "from tpukernels.library import rms_norm\nrms_norm(torch.randn(8, 128))\n")
    env = dict(os.environ, TPUKERNELS_LOG_CONFIG="1", JAX_PLATFORMS="cpu")
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stderr
    lines = [ln for ln in err.splitlines() if "rms_norm_fwd: config" in ln]
    assert len(lines) == 1, err[-2000:]
