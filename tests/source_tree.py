"""The package's source files by dotted module name, for the tests that read the import graph
(``test_architecture.py``, ``test_library_internal_api.py``)."""

import pathlib


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{"tpukernels.library.vmem": path, "tpukernels.library": .../__init__.py, ...}`` for every ``*.py``
    under ``root`` (the package directory)."""
    mods = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods
