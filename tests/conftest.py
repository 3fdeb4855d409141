"""Test setup: CPU-only JAX, a quiet libtpu, hypothesis profiles sized for 2 cores."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from sick_worker import pytest_runtest_makereport  # noqa: E402,F401  (a broken worker exits: its test reruns)

settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=["fast", "tpu"])
def interpret(request):
    """Run the test body in both cpu interpret modes ("tpu" poisons uninitialized memory with NaN).

    ``make test`` runs the "tpu" half (the faithful one: NaN memory, TPU semantics) and leaves the "fast" half
    (``interpret=True``) to ``make test-slow`` (:func:`_fast_interpret_is_slow`).

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


#: Test modules that import torchax: ``import torchax`` renames torch's PrivateUse1 backend to "jax" for the
#: rest of the process, after which torch.compile fails on cpu ("PyTorch is not linked with support for jax
#: devices", torch 2.13 + torchax 0.0.13). They are marked ``torchax`` and ``make test`` runs them in a pytest
#: run of their own, after the rest. Ordering alone was not enough: when a worker crashes (XLA:CPU's compile
#: SIGSEGV, about once per run), pytest-xdist puts the crashed worker's remaining items at the END of its queue,
#: behind these modules, so a torch.compile test could land in a process torchax had already renamed (seen:
#: 7 failures after one crash at 58%). Within one run they still sort last (plain ``pytest`` and ``make test-slow``).
TORCHAX_MODULES = ("test_torchax_ops.py", "test_vllm_tpu.py", "test_vllm_tpu_linear_attention.py",
                   "test_vllm_tpu_mla.py")


def _sample_compile_only_chips(items):
    """``make test`` compiles each compile-only case for ONE of its chips; ``make test-slow`` for all of them.

    A test named ``test_compile_only*`` / ``test_compiles_for_chip*`` (marked ``aot``) parametrized over 3 or more
    chips keeps, per combination of its other parameters, the chip ``sorted(chips)[crc32(case) % n]`` (a fixed
    choice, so every chip is compiled for across the cases); the other chips' items are marked ``slow``. The
    static checks of every shipped config on every chip (tests/test_shipped_tables.py) still run in make test.
    """
    import zlib

    groups: dict = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        name = getattr(item, "originalname", item.name)
        if (spec is None or "chip" not in spec.params or item.get_closest_marker("aot") is None
                or not name.startswith(("test_compile_only", "test_compiles_for_chip"))):
            continue
        case = f"{item.path.name}::{name}[" + ",".join(
            f"{k}={spec.params[k]!r}" for k in sorted(spec.params) if k != "chip") + "]"
        groups.setdefault(case, []).append(item)
    for case, group in groups.items():
        chips = sorted({str(it.callspec.params["chip"]) for it in group})
        if len(chips) < 3:
            continue
        keep = chips[zlib.crc32(case.encode()) % len(chips)]
        for it in group:
            if str(it.callspec.params["chip"]) != keep:
                it.add_marker(pytest.mark.slow)


def _fast_interpret_is_slow(items):
    """The "fast" half of an interpret-mode parameter is marked ``slow``: ``make test`` runs such a test in mode
    "tpu" only (NaN-poisoned memory, the mode whose semantics match the chip), ``make test-slow`` in both. The
    "fast" half was ~15% of make test's time and checks nothing the "tpu" half does not, on a correct kernel.

    It covers the ``interpret`` fixture and a test's own ``mode`` parameter ("fast" / "tpu"), the latter only where
    the same test has the "tpu" twin with the same other parameters, so no case loses its last make-test run.
    """
    def key(item, name):
        spec = item.callspec
        others = tuple(sorted((k, repr(v)) for k, v in spec.params.items() if k != name))
        return (item.path.name, getattr(item, "originalname", item.name), others)

    tpu_twins = set()
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and spec.params.get("mode") == "tpu":
            tpu_twins.add(key(item, "mode"))
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None:
            continue
        if spec.params.get("interpret") == "fast" or (
                spec.params.get("mode") == "fast" and key(item, "mode") in tpu_twins):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselection reads the slow marks added here
def pytest_collection_modifyitems(config, items):
    _sample_compile_only_chips(items)
    _fast_interpret_is_slow(items)
    for item in items:
        if item.path.name in TORCHAX_MODULES:
            item.add_marker(pytest.mark.torchax)
    items.sort(key=lambda item: item.path.name in TORCHAX_MODULES)  # stable: the order is otherwise kept


@pytest.fixture(autouse=True, scope="module")
def release_compiled_code_after_each_module():
    """Drop jax's compiled executables and traces when a test module ends.

    A ``make test`` worker runs ~850 tests in one process; jax keeps every jitted function's executables (and
    interpret mode's traced kernels) for the life of the process, so a worker grew past 6 GiB by the last modules
    and CI's runner killed one (``worker 'gw0' crashed``, no traceback). Modules rarely share compiled code, so
    clearing between modules costs little time and bounds the growth to one module's worth.
    """
    yield
    import gc
    import sys

    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
    gc.collect()
