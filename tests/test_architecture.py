"""The package's import layers (ARCHITECTURE.md): no import cycles, no import against the layer order.

A static walk of every module's AST, so imports inside functions (lazy imports) count like top-level ones,
and so do ``importlib.import_module("tpukernels....")`` calls with a literal name. ``from pkg import name``
is an import of ``pkg.name`` when that is a module, else of ``pkg`` (grimp's rule); importing a module also
runs its parent packages' ``__init__``, which is the parents' business, not an arrow of the importer.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from source_tree import modules  # tests/ is on sys.path (rootdir-relative import)

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tpukernels"

#: The layers, lowest first: a module may import its own layer (acyclically) and the layers below it. Each
#: entry is a module or a package (all its modules); the longest matching entry places a module. Keep in step
#: with ARCHITECTURE.md.
LAYERS: list[tuple[str, ...]] = [
    ("tpukernels.errors", "tpukernels._env", "tpukernels.chips", "tpukernels.perf", "tpukernels._imports"),
    ("tpukernels.dsl",),
    ("tpukernels.lowering",),
    ("tpukernels.targets",),
    ("tpukernels.torch_op",),
    ("tpukernels.frontends", "tpukernels.distributed"),
    ("tpukernels.autotune",),
    ("tpukernels.library", "tpukernels.distributed.ring_attention",  # ring attention composes the flash kernels
     "tpukernels.distributed.expert_parallel",  # expert parallelism composes the MoE permute / combine kernels
     "tpukernels.distributed.collective_matmul",  # collective matmuls compose the matmul kernels
     "tpukernels.distributed.tensor_parallel",  # TP styles over the collective matmuls
     "tpukernels.distributed.async_tp",  # torch's symm_mem fused ops over the collective matmuls
     "tpukernels.distributed.all_gather_matmul_kernel",  # kernels (remote DMAs), like the library's
     "tpukernels.distributed.matmul_reduce_scatter_kernel"),
    ("tpukernels.integrations",),
    ("tpukernels", "tpukernels._plugins"),  # the public façade (tpukernels/__init__.py) and its wiring
    ("tpukernels.bench", "tpukernels.demo"),
    ("tpukernels.cli_common",),
    ("tpukernels.autotune.cli", "tpukernels.bench.cli"),
    ("tpukernels.cli",),
]


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def import_graph(root: pathlib.Path = ROOT) -> dict[str, dict[str, int]]:
    """``{module: {imported tpukernels module: first line}}`` over every import in the package at ``root``."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        pkg = mod if _is_package(path) else mod.rpartition(".")[0]
        edges = graph.setdefault(mod, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                names = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
                names = [node.args[0].value]
            for name in names:
                if name == "tpukernels" or name.startswith("tpukernels."):
                    target = resolve(name)
                    if target and target != mod:
                        edges.setdefault(target, node.lineno)
    return graph


def layer_of(module: str) -> tuple[int, str]:
    """``(layer index, the LAYERS entry that places it)``: the longest entry equal to or above ``module`` (the
    entry ``tpukernels`` is the façade ``__init__`` alone, so a new top-level module must be placed explicitly)."""
    best = None
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if module == entry or (entry != "tpukernels" and module.startswith(entry + ".")):  # the façade: itself
                if best is None or len(entry) > len(best[1]):
                    best = (i, entry)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_architecture.py LAYERS (and ARCHITECTURE.md)")
    return best


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if color.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if color.get(m) is None and (c := visit(m)):
                return c
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(graph):
        if color.get(n) is None and (c := visit(n)):
            return c
    return None


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_has_a_layer(graph):
    for mod in graph:
        layer_of(mod)


def test_no_module_cycle(graph):
    cycle = find_cycle({m: set(e) for m, e in graph.items()})
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_cycle_between_layer_units(graph):
    """Collapsed to the units of LAYERS (packages such as ``tpukernels.targets``), the graph is still acyclic."""
    units: dict[str, set[str]] = {}
    for mod, edges in graph.items():
        a = layer_of(mod)[1]
        units.setdefault(a, set()).update(b for b in (layer_of(t)[1] for t in edges) if b != a)
    cycle = find_cycle(units)
    assert cycle is None, "cycle between packages: " + " -> ".join(cycle)


def test_no_import_against_the_layer_order(graph):
    bad = []
    for mod, edges in sorted(graph.items()):
        lm, em = layer_of(mod)
        for target, line in sorted(edges.items()):
            lt, et = layer_of(target)
            if lt > lm:
                bad.append(f"{mod}:{line} imports {target} ({et}, layer {lt}) above its own layer ({em}, layer {lm})")
    assert not bad, "imports against the layer order (see ARCHITECTURE.md):\n" + "\n".join(bad)


def test_the_walk_sees_lazy_and_string_imports(tmp_path):
    """The walk is what the other tests trust: a function-level import, a relative ``from . import module``
    and an ``importlib.import_module`` literal each make an arrow; a cycle through them is found."""
    pkg = tmp_path / "tpukernels"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from .sub import high\n")
    (pkg / "sub" / "high.py").write_text("import importlib\nimportlib.import_module('tpukernels.other')\n")
    (pkg / "other.py").write_text("from tpukernels import low\n")
    g = import_graph(pkg)
    assert g["tpukernels.low"] == {"tpukernels.sub.high": 2}
    assert g["tpukernels.sub.high"] == {"tpukernels.other": 2}
    assert g["tpukernels.other"] == {"tpukernels.low": 1}
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("tpukernels.brand_new_module")
    assert layer_of("tpukernels.autotune.cli")[1] == "tpukernels.autotune.cli"
    assert layer_of("tpukernels.autotune.db")[1] == "tpukernels.autotune"
    assert find_cycle({m: set(e) for m, e in g.items()}) == [
        "tpukernels.low", "tpukernels.sub.high", "tpukernels.other", "tpukernels.low"]


#: what computes or publishes a bench family's figures: a study (benchmarks/*.py) imports none of it
_PUBLISHING = {"xla_fns", "xla_floor_us", "xla_impl", "_xla", "_xla_program", "save_result", "run_family",
               "render", "update_readme", "combined_json"}


def _study_problems(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tpukernels.bench"):
            if n.module == "tpukernels.bench.report" or any(a.name == "report" for a in n.names):
                bad.append(f"{path.name}:{n.lineno} imports the report")
            bad += [f"{path.name}:{n.lineno} imports {a.name}" for a in n.names if a.name in _PUBLISHING]
        elif (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
              and ("benchmarks/results" in n.value or n.value.endswith("BENCHMARKS.md"))):
            bad.append(f"{path.name}:{n.lineno} names {n.value!r}")
    return bad


def test_benchmark_studies_publish_no_figure(tmp_path):
    """One home per figure (ARCHITECTURE.md): ``tpukernels bench`` computes and writes what is published; the
    studies in benchmarks/ neither write ``benchmarks/results`` / BENCHMARKS.md nor reuse a family's baselines."""
    studies = sorted((ROOT.parent / "benchmarks").rglob("*.py"))  # probes/ too
    assert studies
    bad = [p for s in studies for p in _study_problems(s)]
    assert not bad, "\n".join(bad)
    fake = tmp_path / "study.py"  # the check can fail
    fake.write_text('"""doc: BENCHMARKS.md"""\nfrom tpukernels.bench.norms import xla_fns\nOUT = "benchmarks/results/x.json"\n')
    assert _study_problems(fake) == ["study.py:2 imports xla_fns", "study.py:3 names 'benchmarks/results/x.json'"]


def test_import_fills_every_registration_point_and_stays_light():
    """``import tpukernels`` provides every point of :mod:`tpukernels.dsl.hooks` (so a kernel can be defined and
    called) through lazy loaders: jax, Helion, the targets and ``torch.distributed.tensor`` are not imported."""
    import subprocess
    import sys

    code = ("import sys, tpukernels\nfrom tpukernels.dsl import hooks\n"
            "print(sorted(set(hooks.POINTS) - set(hooks._LOADERS)))\n"
            "print(sorted(m for m in ('jax', 'helion', 'tpukernels.targets', 'tpukernels.torch_op', "
            "'tpukernels.library', 'torch.distributed.tensor') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT.parent, check=True).stdout.split("\n")
    assert out[:2] == ["[]", "[]"], out
