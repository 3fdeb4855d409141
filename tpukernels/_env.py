"""Process environment tpukernels sets up before jax/libtpu load: quiet libtpu defaults, lazy library ops.

Nothing here overrides a variable the user has set.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import Callable

#: libtpu environment for machines without a TPU (compile-only targets): without these, libtpu probes the
#: host at backend start-up and prints "could not determine TPU accelerator type" and an INVALID_ARGUMENT
#: "unexpected worker hostname" block; several processes (sweep workers, estimate subprocesses) may load it.
COMPILE_ONLY_ENV = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}

#: values of a boolean ``TPUKERNELS_*`` flag that mean "off" (case-insensitive, surrounding blanks ignored)
FALSE_VALUES = ("", "0", "false", "no", "off", "n", "f")
#: values that mean "on"
TRUE_VALUES = ("1", "true", "yes", "on", "y", "t")


def env_flag(name: str, default: bool = False, env=None) -> bool:
    """The boolean environment flag ``name``: the one parser for every ``TPUKERNELS_*`` on/off variable.

    Unset -> ``default``; ``1/true/yes/on`` -> True; ``0/false/no/off`` or empty -> False (case-insensitive).

    Raises:
        ArgumentError: any other value (e.g. ``TPUKERNELS_LOG_CONFIG=maybe``), naming the variable.
    """
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in TRUE_VALUES:
        return True
    if v in FALSE_VALUES:
        return False
    from .errors import ArgumentError

    raise ArgumentError(f"environment variable {name}={raw!r} is not a boolean; use 1/true/yes/on or 0/false/no/off")


def install_hint(extra: str) -> str:
    """How to install tpukernels' optional ``extra`` (tpukernels is not on the package index): the line for a
    source checkout and the line for a built wheel."""
    return (f"from a tpukernels checkout: pip install -e '.[{extra}]'; from a built wheel: "
            f"pip install 'tpukernels-<version>-py3-none-any.whl[{extra}]' (make the wheel with `python -m build`)")


_GOOGLE_PCI_VENDOR = "0x1ae0"  # the PCI vendor id of TPU chips (what torch_tpu's hardware scan matches)


def tpu_present() -> bool:
    """A TPU is attached to this host: ``/dev/accel*`` / ``/dev/vfio`` TPU nodes or a Google PCI device."""
    if glob.glob("/dev/accel[0-9]*"):
        return True
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def quiet_libtpu_defaults(env=None) -> dict:
    """Set :data:`COMPILE_ONLY_ENV` as defaults (``setdefault``) when no TPU is attached; returns ``env``."""
    env = os.environ if env is None else env
    if env_flag("TPUKERNELS_NO_ENV_DEFAULTS") or tpu_present():
        return env
    for k, v in COMPILE_ONLY_ENV.items():
        env.setdefault(k, v)
    return env


_LIBRARY_LOADING = False
_LOAD_LIBRARY: Callable[[], None] | None = None


def install_lazy_library_ops(load_library: Callable[[], None]) -> None:
    """Make ``torch.ops.tpukernels.<op>`` import :mod:`tpukernels.library` on first use (``load_library()``,
    which the package passes in: this module, below every other, does not import the library itself).

    The library costs the jax import (~1.5 s) and its op registrations, so ``import tpukernels`` does not
    pay for it; the first ``torch.ops.tpukernels.rms_norm`` (or any other op lookup) does, once. Nor does
    ``import tpukernels`` import torch (~1.4 s; ``tpukernels --help`` answers without it): when torch is not
    loaded yet, the namespace is installed right after its first import (:class:`_AfterTorchImport`).
    """
    global _LOAD_LIBRARY
    _LOAD_LIBRARY = load_library
    if "torch" in sys.modules:
        _install_lazy_namespace()
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport(_install_lazy_namespace))


class _AfterTorchImport:
    """A one-shot ``sys.meta_path`` finder: runs ``callback()`` once ``import torch`` has executed torch's
    ``__init__`` (a post-import hook; the spec itself comes from the other finders, unchanged)."""

    def __init__(self, callback: Callable[[], None]):
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_install(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_install  # this spec's own loader instance
        return spec


def _install_lazy_namespace() -> None:
    import torch
    from torch._ops import _OpNamespace

    if getattr(torch.ops.__dict__.get("tpukernels"), "_tpukernels_lazy", False):
        return

    class LazyNamespace(_OpNamespace):
        """``torch.ops.tpukernels``: loads the tpukernels library before the first op lookup."""

        _tpukernels_lazy = True
        __module__ = _OpNamespace.__module__  # op packets derive their import path from it (inductor, pickle)

        def __getattr__(self, op_name: str):
            if not op_name.startswith("__"):
                _load_library()
            return super().__getattr__(op_name)

    torch.ops.__dict__["tpukernels"] = LazyNamespace("tpukernels")
    if "tpukernels" not in torch.ops._dir:
        torch.ops._dir.append("tpukernels")


def _load_library() -> None:
    global _LIBRARY_LOADING
    if _LIBRARY_LOADING:
        return
    _LIBRARY_LOADING = True
    try:
        if _LOAD_LIBRARY is not None:
            _LOAD_LIBRARY()  # registers every library op
    finally:
        _LIBRARY_LOADING = False
