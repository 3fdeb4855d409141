"""The newcomer's command line (issue 31 item 6): help answers at once, ``list`` fits the terminal, one
PerformanceWarning per sweep, an ETA in ``bench``. Fast tests: subprocesses only where a fresh interpreter
is the point (what ``--help`` imports)."""

import os
import subprocess
import sys

import pytest

import tpukernels as tk

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
    "heavy = sorted(m for m in ('torch', 'jax', 'jaxlib', 'helion', 'libtpu', 'tpukernels.library')\n"
    "               if m in sys.modules)\n"
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


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sweep_warns_once_not_once_per_candidate(workers, capfd):
    """Every candidate of a 12-config sweep raises a PerformanceWarning (in this process, or in 2 worker
    processes): the sweep shows one summary naming how many did, and keeps each one's on its trial."""
    import warnings

    from test_autotune_helpers import SyntheticEvaluator, tiles
    from tpukernels.autotune.tuner import tune

    ev = SyntheticEvaluator(optimum={"a": 32, "b": 512, "c": 4}, warn=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every emission: no registry dedup hides a repeat
        r = tune(tiles, "256x128:f32", evaluator=ev, strategy="exhaustive", budget=12, workers=workers)
    perf = [w for w in caught if issubclass(w.category, tk.PerformanceWarning)]
    assert len(r.trials) == 12 and len(perf) == 1, [str(w.message) for w in perf]
    msg = str(perf[0].message)
    assert "12 of 12 candidates raised PerformanceWarning" in msg and "packs its blocks badly" in msg
    assert "tktest_autotune::tiles" in msg
    for t in r.trials:
        assert t.details["warnings"] == [["tpukernels.errors.PerformanceWarning",
                                          f"config {t.config} packs its blocks badly"]]
    assert "packs its blocks badly" not in capfd.readouterr().err  # nor printed by the worker processes


def test_warning_summaries_group_by_category():
    from tpukernels.autotune.sweep_warnings import summaries

    perf = "tpukernels.errors.PerformanceWarning"
    items = [(f"a={i}", [[perf, f"rows {i}"]] + ([["RuntimeWarning", "slow"]] if i % 2 else [])) for i in range(6)]
    got = dict(summaries("sweep", items, total=7))
    assert set(got) == {tk.PerformanceWarning, RuntimeWarning}
    assert got[tk.PerformanceWarning].startswith("sweep: 6 of 7 candidates raised PerformanceWarning "
                                                 "(a=0, a=1, a=2, a=3, ... (2 more); 6 distinct messages")
    assert got[RuntimeWarning] == ("sweep: 3 of 7 candidates raised RuntimeWarning (a=1, a=3, a=5; each one's "
                                   "in --json); the first: slow")
    assert summaries("sweep", [("a=1", None), ("a=2", [])], total=2) == []


def test_a_bench_family_warns_once_not_once_per_case(tmp_path, monkeypatch):
    """A bench family (a stand-in for norms) whose 5 cases each warn (from 2 threads): one summary per category
    after the family, not a line per case."""
    import types
    import warnings

    import tpukernels.bench as bench
    from tpukernels.bench.core import Case, Impl

    def cycles(est, chip, i):
        warnings.warn(f"case {i}: rows 8 are not a multiple of 16", tk.PerformanceWarning)
        return 1000 + i, None

    fake = types.SimpleNamespace(
        KIND="model", reason=lambda row: None,
        cases=lambda chips: [Case("fake", "op", f"{i}", "v6e", 1 << 20, 1 << 20,
                                  [Impl("tpukernels", "ours", lambda est, chip, i=i: cycles(est, chip, i))])
                             for i in range(5)])
    monkeypatch.setattr(bench, "family_module", lambda name: fake)
    monkeypatch.setattr("tpukernels.targets.compile_only.require_libtpu", lambda: None)
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = bench.run_family("norms", ["v6e"], str(tmp_path), jobs=2, cache_path=str(tmp_path / "cache.json"),
                               log=lambda m: None, progress=lambda done, total: calls.append((done, total)))
    assert sorted(r["cycles"] for r in res["rows"]) == [1000, 1001, 1002, 1003, 1004]
    assert calls == [(i, 5) for i in range(6)]  # the bench ETA's feed: 0 first, then one per finished case
    perf = [str(w.message) for w in caught if issubclass(w.category, tk.PerformanceWarning)]
    assert len(perf) == 1 and perf[0].startswith("tpukernels bench norms (5 cases): PerformanceWarning, once for "
                                                 "the run; 5 distinct messages; the first: case "), perf


def test_bench_progress_shows_an_eta_on_a_terminal_only():
    """``tpukernels bench``'s bar (cases done, elapsed, ETA) is drawn on a terminal; piped stderr or
    ``--no-progress`` gets the plain log lines only."""
    import io

    from tpukernels.bench.cli import _Progress
    from tpukernels.cli import build_parser

    class Tty(io.StringIO):
        def isatty(self):
            return True

    piped = io.StringIO()
    for bar in (_Progress(True, piped), _Progress(False, Tty())):
        with bar:
            assert bar.bar is None and bar.family("norms") is None
    tty = Tty()
    with _Progress(True, tty) as bar:
        cb = bar.family("norms")
        cb(0, 4)
        cb(3, 4)
        bar.log("  v6e rms_norm ...")
    out = tty.getvalue()
    assert "bench norms" in out and "3/4" in out and "ETA" in out and "v6e rms_norm" in out
    assert build_parser().parse_args(["bench", "--no-progress"]).no_progress


def test_list_into_a_closed_pipe_is_quiet():
    """``tpukernels list | head -1``: the reader leaves early; no BrokenPipeError traceback, exit status 0. The
    read end closes before the listing is written (importing takes a second), so every write hits the closed pipe."""
    p = subprocess.Popen([sys.executable, "-m", "tpukernels.cli", "list"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "32"})
    p.stdout.close()  # as head does once it has its lines
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
