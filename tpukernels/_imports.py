"""Loading user kernels from a module name or a ``.py`` path (``--import``; autotune workers), and importing a
package whose import edits the process environment without letting it (:func:`import_keeping_env`)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from .errors import ArgumentError


def import_source(spec: str) -> None:
    """Import a module by name (``my_pkg.kernels``) or a Python file by path (``./kernels.py``): how
    ``--import`` and the autotuner's workers load user kernels (importing registers them).

    Raises:
        ArgumentError: a file that cannot be loaded as a module.
    """
    if spec.endswith(".py") or os.path.sep in spec:
        path = os.path.abspath(spec)
        sys.path.insert(0, os.path.dirname(path))
        name = os.path.splitext(os.path.basename(path))[0]
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
            return  # already imported (its kernels are registered)
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise ArgumentError(f"--import: cannot load {spec!r}")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)


#: environment variables a package's import may not change for the rest of the process: libtpu's and XLA's flags
#: (a compile-only estimate's cache key and its compiler's behaviour depend on them)
KEPT_ENV = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")


def import_keeping_env(name: str, keep: tuple = KEPT_ENV) -> bool:
    """Import package ``name`` with the variables in ``keep`` restored afterwards; returns whether it imported
    (False: not installed). Why: tpu-inference 0.32.0's ``env_override`` prepends
    ``--xla_tpu_use_dynamic_smem_negotiation=true`` to ``LIBTPU_INIT_ARGS`` (and ``--xla_cpu_max_isa=AVX2`` to
    ``XLA_FLAGS``) on import, so every libtpu estimate after it in the process ran with another flag and was cached
    under another key: what a bench family hit in the cache depended on whether a family importing tpu-inference
    ran before it. Importing it once, first, this way keeps the flags of the whole run as the user set them."""
    saved = {k: os.environ.get(k) for k in keep}
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: the pip requirement of the peer kernels the bench compares with (installed ``--no-deps`` by ``make test``)
TPU_INFERENCE_REQUIREMENT = "tpu-inference==0.32.0"


def import_tpu_inference(module: str, what: str):
    """``tpu_inference.<module>`` (e.g. ``"kernels.megablox.gmm"``), the bench's peer kernels.

    Raises:
        BackendUnavailableError: it does not import; the message names ``what`` (e.g. "its megablox gmm") and how
            to install it.
    """
    from .errors import BackendUnavailableError

    try:
        return importlib.import_module(f"tpu_inference.{module}")
    except ImportError as e:
        raise BackendUnavailableError(f"tpu-inference's {what} does not import ({e}); install it with "
                                      f"`pip install --no-deps {TPU_INFERENCE_REQUIREMENT}` (make test does)") from e
