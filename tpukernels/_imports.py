"""Loading user kernels from a module name or a ``.py`` path (``--import``; autotune workers)."""

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
