"""No package attribute shadows one of its submodules (issue 36 item 13).

``import tpukernels.library.quantized_matmul.blockwise as B`` failed: ``import a.b.c as m`` binds ``m`` by attribute
lookups (``a.b``, then ``.c``), and ``tpukernels.library.quantized_matmul`` was the re-exported *function*, not the
package. Worse, ``import tpukernels.library.matmul as M`` silently bound the function. The families' modules are
now named ``*_ops`` (``matmul_ops`` holds ``matmul``) and the float64 reference modules ``references``; this test
walks every package under ``tpukernels`` (``pkgutil.iter_modules``) so a new shadowing name fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import tpukernels

# submodules whose import needs an optional dependency that may be absent here; everything else must import
OPTIONAL = ("tpukernels.integrations.", "tpukernels.frontends.")


def _walk(pkg, out):
    for info in pkgutil.iter_modules(pkg.__path__):
        full = f"{pkg.__name__}.{info.name}"
        try:
            mod = importlib.import_module(full)
        except ImportError:
            if full.startswith(OPTIONAL):
                continue
            raise
        out.append((pkg, info.name, mod))
        if info.ispkg:
            _walk(mod, out)
    return out


SUBMODULES = _walk(tpukernels, [])


def test_walk_reaches_the_library():
    names = {m.__name__ for _, _, m in SUBMODULES}
    assert {"tpukernels.library.quantized_matmul_ops.blockwise", "tpukernels.library.norms.rms_norm_ops",
            "tpukernels.library.grouped_matmul_ops.references", "tpukernels.dsl.kernel"} <= names
    assert len(names) > 60


def test_no_attribute_shadows_a_submodule():
    bad = []
    for pkg, name, mod in SUBMODULES:
        attr = vars(pkg).get(name)
        if attr is not mod:
            bad.append(f"{pkg.__name__}.{name} is {type(attr).__name__} {attr!r:.60}, not the submodule")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", ["tpukernels.library.quantized_matmul_ops.blockwise",
                                  "tpukernels.library.matmul_ops", "tpukernels.library.norms.rms_norm_ops",
                                  "tpukernels.library.grouped_matmul_ops.references"])
def test_import_as_binds_the_module(path):
    """The reported form: ``import a.b.c.d as m`` gives the module (the attribute chain resolves)."""
    ns: dict = {}
    exec(f"import {path} as m", ns)
    assert isinstance(ns["m"], types.ModuleType) and ns["m"].__name__ == path


def test_public_function_names_are_kept():
    """The Library page's table names (docs/library.md, tests/test_library_exports.py) stay the functions they were."""
    import tpukernels.library as lib

    for name in ("matmul", "quantized_matmul", "quantized_matmul_blockwise", "grouped_matmul",
                 "linear_cross_entropy", "rms_norm", "layer_norm", "fused_add_rms_norm"):
        assert callable(getattr(lib, name)) and not isinstance(getattr(lib, name), types.ModuleType), name
    qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")
    assert qmm.reference is qmm.references.reference and callable(qmm.reference)
