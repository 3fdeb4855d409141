"""The newcomer's command line (issue 31 item 6): help answers at once, ``list`` fits the terminal, one
PerformanceWarning per sweep, an ETA in ``bench``. Fast tests: subprocesses only where a fresh interpreter
is the point (what ``--help`` imports)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: runs ``python -m tpukernels.cli ARGV...`` in this interpreter and prints, after argparse's SystemExit,
#: the exit code and which heavy modules were imported by then (a module-set check, not a timing)
_HELP_PROBE = (
    "import runpy, sys\n"
    "sys.argv = ['tpukernels'] + sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_module('tpukernels.cli', run_name='__main__', alter_sys=True)\n"
    "    code = 'returned'\n"
    "except SystemExit as e:\n"
    "    code = e.code\n"
    "heavy = sorted(m for m in ('torch', 'jax', 'jaxlib', 'helion', 'libtpu', 'tpukernels.library') if m in sys.modules)\n"
    "print('PROBE', code, ','.join(heavy) or '-', file=sys.stderr)\n"
)


@pytest.mark.parametrize("argv", [["--help"], ["compile", "--help"], ["list", "--help"], ["autotune", "--help"],
                                  ["bench", "--help"], ["demo", "--help"]])
def test_help_imports_neither_torch_nor_jax(argv):
    """``tpukernels compile --help`` used to import torch (1.4 s) through ``import tpukernels`` before
    argparse saw ``--help``; now the parsers and the package import neither torch nor jax."""
    r = subprocess.run([sys.executable, "-c", _HELP_PROBE, *argv], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    probe = [ln for ln in r.stderr.splitlines() if ln.startswith("PROBE ")]
    assert probe, r.stderr
    _, code, heavy = probe[-1].split(" ")
    assert code == "0" and "usage: tpukernels" in r.stdout, r.stdout + r.stderr
    assert heavy == "-", f"`tpukernels {' '.join(argv)}` imported {heavy} before printing its help"


def test_torch_imported_after_tpukernels_still_gets_lazy_library_ops():
    """``import tpukernels`` no longer imports torch; a later ``import torch`` still finds
    ``torch.ops.tpukernels`` lazy (loads the library on the first op lookup)."""
    code = ("import sys, tpukernels\n"
            "assert 'torch' not in sys.modules, 'import tpukernels imported torch'\n"
            "import torch\n"
            "ns = torch.ops.tpukernels\n"
            "print(getattr(ns, '_tpukernels_lazy', False), 'tpukernels.library' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]


@pytest.mark.parametrize("columns", [80, 32])
def test_list_fits_the_terminal(columns, monkeypatch, capsys):
    """``tpukernels list`` with ``$COLUMNS`` set: every line fits, nothing is cut (each kernel's name,
    signature and tunables are all there, wrapped)."""
    from tpukernels.cli import main
    from tpukernels.cli_common import load_kernels

    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    long = [ln for ln in out.splitlines() if len(ln) > columns]
    assert not long, f"{len(long)} lines over {columns} columns, e.g. {long[0]!r}"
    joined = "".join(out.split())  # wrapping adds only blanks and newlines: the text is all there
    for q, k in load_kernels().items():
        assert q in joined
        assert all(f"{p.name}:" in joined for p in k.params)
