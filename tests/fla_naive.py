"""Loading fla-core's naive torch references (``fla/ops/<op>/naive.py``) by file path, for the tests that compare
against them: ``fla``'s package ``__init__`` imports triton, which this machine does not have.

``load("gated_delta_rule")`` -> the module. Skips (naming why) when fla-core or einops is missing: ``make test``
installs both (``--no-deps``, Makefile target ``FLA``), so the skip only fires in a bare environment outside it.
``stub``: module names to stand in for while the file loads, holding ``stub_attrs`` (functions that raise if
called), for references that import varlen helpers they never call on the paths tested; pass pytest's
``monkeypatch`` with them.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types
import warnings

import pytest


def load(op: str, *, stub: tuple = (), stub_attrs: tuple = (), monkeypatch=None):
    spec = importlib.util.find_spec("fla")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed (make test installs it)")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops" / op / "naive.py"
    if not path.exists():
        pytest.skip(f"fla-core has no ops/{op}/naive.py")
    pytest.importorskip("einops")

    def unused(*a, **k):
        raise AssertionError(f"fla helper called by ops/{op}/naive.py")

    for name in stub:
        mod = types.ModuleType(name)
        for attr in stub_attrs:
            setattr(mod, attr, unused)
        monkeypatch.setitem(sys.modules, name, mod)
    s = importlib.util.spec_from_file_location(f"fla_{op}_naive", path)
    m = importlib.util.module_from_spec(s)
    with warnings.catch_warnings():  # e.g. nsa's "Flash Attention is not installed" (a path not used here)
        warnings.simplefilter("ignore", ImportWarning)
        s.loader.exec_module(m)
    return m
