"""Inside ``tpukernels/library/`` no underscore name crosses a module boundary (issue 41 item 3).

A package's shared helpers are its internal API: a name a sibling module uses has no leading underscore (or
lives beside its only user). A static walk of every module's AST flags, where the other module is also under
``tpukernels/library/``:

* ``from .plan import _make_plan`` / ``from tpukernels.library.attention.plan import _make_plan``;
* ``plan._make_plan`` where ``plan`` is bound by ``from . import plan``, ``import tpukernels.library.x as plan``
  or ``import tpukernels.library.x`` (then ``tpukernels.library.x._y``);
* a module file itself named with a leading underscore (``_vmem.py``): it is imported by its siblings, so it is
  internal API with a public name.

Dunders (``__all__``, ``__name__``) are not private names.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

from source_tree import modules  # tests/ is on sys.path (rootdir-relative import)

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tpukernels"
LIBRARY = "tpukernels.library"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _in_library(name: str) -> bool:
    return name == LIBRARY or name.startswith(LIBRARY + ".")


def crossings(root: pathlib.Path, only: str = LIBRARY) -> list[str]:
    """``"file:line: what"`` for every underscore name that one module under ``only`` takes from another."""
    mods = modules(root)
    out = []
    for mod, path in sorted(mods.items()):
        if not (mod == only or mod.startswith(only + ".")):
            continue
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        where = f"{path.relative_to(root.parent)}"
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}  # local name -> module it is bound to (per file, flow-insensitive)

        def resolve(node: ast.ImportFrom) -> str:
            if not node.level:
                return node.module or ""
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            return f"{base}.{node.module}" if node.module else base

        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = resolve(node)
                if not _in_library(src):
                    continue
                for a in node.names:
                    full = f"{src}.{a.name}"
                    if full in mods:  # ``from . import plan``: a module, bound to a local name
                        aliases[a.asname or a.name] = full
                        if _private(a.name):
                            out.append(f"{where}:{node.lineno}: imports module {full}")
                    elif _private(a.name) and src != mod:
                        out.append(f"{where}:{node.lineno}: imports {a.name} from {src}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if not _in_library(a.name):
                        if a.asname is None and a.name.split(".")[0] == "tpukernels":
                            aliases.setdefault("tpukernels", "tpukernels")
                        continue
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["tpukernels"] = "tpukernels"
                    if any(_private(p) for p in a.name.split(".")):
                        out.append(f"{where}:{node.lineno}: imports module {a.name}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            chain, base = [], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if not isinstance(base, ast.Name) or base.id not in aliases:
                continue
            target = ".".join([aliases[base.id], *reversed(chain)])
            if target in mods and _in_library(target) and target != mod:
                out.append(f"{where}:{node.lineno}: uses {target}.{node.attr}")
    for mod, path in sorted(mods.items()):
        if (mod == only or mod.startswith(only + ".")) and any(_private(p) for p in mod.split(".")):
            out.append(f"{path.relative_to(root.parent)}: module named with a leading underscore")
    return out


def test_no_underscore_name_crosses_a_module_boundary():
    bad = crossings(ROOT)
    assert not bad, f"{len(bad)} underscore names cross a module boundary in tpukernels/library/:\n" + "\n".join(bad)


def test_the_walk_sees_each_kind_of_crossing(tmp_path):
    root = tmp_path / "tpukernels"
    pkg = root / "library" / "fam"
    pkg.mkdir(parents=True)
    for d in (root, root / "library", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "plan.py").write_text("_plan = 1\npublic = 2\n_own = 3\nx = _own\n")
    (root / "library" / "_helper.py").write_text("")
    (pkg / "user.py").write_text(textwrap.dedent("""
        from .plan import _plan, public, __doc__
        from tpukernels.library.fam.plan import _plan as p2
        from . import plan
        from .. import fam
        import tpukernels.library.fam.plan as P
        import tpukernels.library.fam.plan
        from tpukernels.errors import _outside
        def f():
            return plan._plan, P._plan, plan.public, tpukernels.library.fam.plan._plan, fam.plan._plan, f._x
        """))
    got = crossings(root)
    assert [g.split(": ", 1)[1] for g in got] == [
        "imports _plan from tpukernels.library.fam.plan",
        "imports _plan from tpukernels.library.fam.plan",
        "uses tpukernels.library.fam.plan._plan",
        "uses tpukernels.library.fam.plan._plan",
        "uses tpukernels.library.fam.plan._plan",
        "uses tpukernels.library.fam.plan._plan",
        "module named with a leading underscore",
    ], got
