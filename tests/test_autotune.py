"""Autotuner without libtpu: spaces and pruning, strategies, budgets, failure handling, worker processes,
the measure evaluator (cpu interpret mode), DB writes and dispatch after a sweep, the CLI."""

import json
import multiprocessing as mp
import os
import time

import pytest
import torch

import tpukernels as tk
from kernels_for_tests import copy_rows, load_example, scale
from test_autotune_helpers import SyntheticEvaluator, bump, key, tiles, twice
from tpukernels.autotune import db
from tpukernels.autotune.evaluators import MeasureEvaluator
from tpukernels.autotune.executors import ProcessExecutor
from tpukernels.autotune.model import block_fetches, reduce_grid, spearman
from tpukernels.autotune.space import Problem, Space
from tpukernels.autotune.tuner import tune
from tpukernels.cli import main
from tpukernels.lowering import specs_from_values

HERE = os.path.dirname(os.path.abspath(__file__))
HELPERS = os.path.join(HERE, "test_autotune_helpers.py")
OPT = {"a": 32, "b": 512, "c": 4}


# ------------------------------------------------------------------------------------------ space
def test_pruning_records_reasons_before_compiling():
    space = Space(Problem.from_args(copy_rows, "4096x1024:f32"), tk.get_chip("v5e"))
    got = {c["br"]: space.check(c) for c in space.all_configs()}
    assert got[8] is None and got[16] is None
    assert got[12].kind == "block_shape" and "(8,128) rule" in got[12].reason
    assert got[4096].kind == "vmem" and "scoped limit 16 MiB on v5e" in got[4096].reason
    assert sorted(p.config["br"] for p in space.pruned) == [12, 4096]
    zero = space.check(tk.Config(br=0))  # a value the tunable cannot take is a config error, not a launch one
    assert zero.kind == "config" and "must be positive" in zero.reason


def test_constraint_and_duplicate_pruning():
    space = Space(Problem.from_args(tiles, "256x128:f32"), None)
    bad = space.check(tk.Config(a=128, b=1024, c=1))
    assert bad.kind == "constraint" and bad.reason == "a * b must be <= 65536"
    # softmax clamps every block_rows to 8 for 32768-wide f32 rows: all configs but the first are duplicates
    softmax = load_example("softmax").softmax
    sp = Space(Problem.from_args(softmax, "64x32768:f32"), tk.get_chip("v6e"))
    checks = [sp.check(c) for c in sp.all_configs()]
    assert checks[0] is None
    assert all(p is not None and p.kind == "duplicate" for p in checks[1:])
    assert "block_rows" in checks[1].reason
    # a normal shape: distinct launches, nothing pruned
    sp2 = Space(Problem.from_args(softmax, "1024x256:f32"), tk.get_chip("v6e"))
    assert all(sp2.check(c) is None for c in sp2.all_configs())


def test_restricted_values_keep_the_default():
    space = Space(Problem.from_args(tiles, "256x128:f32"), None, values={"a": [64, 8, 64]})
    assert space.values["a"] == (16, 64, 8) and space.size() == 3 * 25
    with pytest.raises(tk.ArgumentError, match="no tunable 'zz'"):
        Space(Problem.from_args(tiles, "256x128:f32"), None, values={"zz": [1]})


def test_model_helpers():
    assert reduce_grid((32, 32, 32), 64) == (1, 2, 32)
    assert reduce_grid((16, 8, 8), 64) == (1, 8, 8)
    assert reduce_grid((3, 5), 64) == (3, 5)
    from jax.experimental import pallas as pl

    a = pl.BlockSpec((128, 128), lambda i, j, k: (i, k))
    o = pl.BlockSpec((128, 128), lambda i, j, k: (i, j))
    c = pl.BlockSpec((128, 128), lambda i, j, k: (0, 0))
    assert block_fetches(a, (4, 5, 6)) == 120 and block_fetches(o, (4, 5, 6)) == 20 and block_fetches(c, (4, 5, 6)) == 1
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)


# ------------------------------------------------------------------------------------------ strategies
def _run(strategy, budget=None, **kw):
    ev = SyntheticEvaluator(optimum=OPT, **kw.pop("ev", {}))
    return tune(tiles, "256x128:f32", evaluator=ev, strategy=strategy, budget=budget, **kw)


def test_exhaustive_covers_every_valid_config_default_first():
    r = _run("exhaustive")
    configs = [tuple(sorted(t.config.items())) for t in r.trials]
    assert len(configs) == len(set(configs)) == 125 - len(r.pruned)
    assert r.trials[0].config == {"a": 16, "b": 256, "c": 1} and r.trials[0].details["is_default"]
    assert r.best.config == OPT and r.stopped == "space exhausted"
    assert {p.kind for p in r.pruned} == {"constraint"}


def test_the_baseline_is_the_config_a_call_gets_today(tmp_cache):
    """Sweeps start from (and compare with) what a call resolves to: the shipped per-chip entry of a library
    kernel, else its heuristic; before, the declared defaults (a config no call used), so ``--write-db``
    could store a config never compared with the shipped one."""
    import importlib

    from tpukernels.chips import get_chip

    mm = importlib.import_module("tpukernels.library.matmul_ops")
    kernel, args, kwargs = mm.STANDARD_CASES[0]
    problem = Problem.from_args(kernel, *args, **kwargs)
    want, source = db.lookup(kernel, "v5e", problem.lowered_specs, problem.statics)
    assert source == "shipped-db"
    space = Space(problem, get_chip("v5e"))
    assert space.default() == want and space.baseline_source == "shipped-db:v5e"
    assert space.default() != kernel.space.default()  # the declared defaults differ: the test can fail
    others = [v for v in (128, 256, 512, 1024) if v != want["bm"]][:2]
    restricted = Space(problem, get_chip("v5e"), {"bm": others})
    assert restricted.values["bm"] == (want["bm"], *others) and next(restricted.all_configs()) == want
    no_chip = Space(problem, None)  # cpu, no target chip: no shipped entry applies, the heuristic does
    assert no_chip.baseline_source == "heuristic" and no_chip.default() == kernel.heuristic(*problem.lowered_specs,
                                                                                              **dict(problem.statics))
    r = _run("exhaustive", budget=1)  # a kernel with neither: the declared defaults
    assert r.baseline_source == "default" and r.default.config == tiles.space.default()


def test_random_is_seeded_and_never_repeats():
    r1, r2, r3 = _run("random", 20, seed=1), _run("random", 20, seed=1), _run("random", 20, seed=2)
    seq = lambda r: [tuple(sorted(t.config.items())) for t in r.trials]  # noqa: E731
    assert seq(r1) == seq(r2) != seq(r3)
    assert len(set(seq(r1))) == 20 and r1.stopped == "evaluation budget"


def test_coordinate_finds_the_optimum_with_fewer_evaluations():
    r = _run("coordinate", 40)
    assert r.best.config == OPT and len(r.trials) == 40
    found_at = next(t.index for t in r.trials if t.config == OPT)
    exhaustive_at = next(t.index for t in _run("exhaustive").trials if t.config == OPT)
    assert found_at < exhaustive_at / 2


def test_coordinate_exhausts_a_small_space_without_repeats():
    r = _run("coordinate", values={"a": [8, 32], "b": [512], "c": [4]})
    configs = [tuple(sorted(t.config.items())) for t in r.trials]
    assert len(configs) == len(set(configs)) == 2 * 3 * 2 and r.stopped == "space exhausted"


# ------------------------------------------------------------------------------------------ failures and budgets
def test_one_bad_candidate_never_stops_the_sweep():
    bad = key(**{**OPT, "c": 3})
    r = _run("exhaustive", ev={"fail": (key(a=16, b=256, c=2),), "raise_for": (bad,)})
    by = {tuple(sorted(t.config.items())): t for t in r.trials}
    assert by[key(a=16, b=256, c=2)].status == "failed" and by[key(a=16, b=256, c=2)].error_kind == "compile"
    assert by[bad].status == "failed" and "deliberate evaluator error" in by[bad].error
    assert r.failures == {"compile": 1, "error": 1}
    assert len(r.trials) == 125 - len(r.pruned) and r.best.config == OPT


def test_time_budget_stops_the_sweep():
    t0 = time.monotonic()
    r = _run("exhaustive", seconds=1.0, ev={"sleep_s": 0.15})
    assert time.monotonic() - t0 < 1.0 + 0.5
    assert r.stopped == "time budget" and 3 <= len(r.trials) <= 8


def test_workers_run_in_parallel_and_survive_crashes_and_hangs():
    crash, hang = key(a=16, b=256, c=2), key(a=8, b=256, c=1)
    ev = SyntheticEvaluator(optimum=OPT, crash=(crash,), hang=(hang,), hang_s=120)
    t0 = time.monotonic()
    r = tune(tiles, "256x128:f32", evaluator=ev, strategy="exhaustive", values={"a": [8], "b": [256], "c": [2, 3]},
             executor=ProcessExecutor(2, imports=[HELPERS]), candidate_timeout_s=6)
    assert time.monotonic() - t0 < 90
    by = {tuple(sorted(t.config.items())): t for t in r.trials}
    assert by[crash].status == "crashed" and by[hang].status == "timeout"
    oks = [t for t in r.trials if t.ok]
    assert len(oks) == len(r.trials) - 2 == 4
    assert len({t.details["pid"] for t in oks}) >= 2 and os.getpid() not in {t.details["pid"] for t in oks}
    assert r.failures == {"crashed": 1, "timeout": 1}


# ------------------------------------------------------------------------------------------ measure (cpu)
def test_measure_checks_correctness_and_reports_samples():
    ev = MeasureEvaluator(repeats=3, warmup=1)
    r = tune(twice, "64x128:f32", evaluator=ev, strategy="exhaustive")
    by = {t.config["br"]: t for t in r.trials}
    assert by[16].status == "wrong" and "kernel.reference" in by[16].error
    for br in (8, 32):
        t = by[br]
        assert t.ok and len(t.details["samples_us"]) == 3
        assert t.time_us == pytest.approx(sorted(t.details["samples_us"])[1], rel=1e-3)
        assert t.details["check"] == "kernel.reference" and t.details["max_rel_err"] < 1e-6
    assert r.chip is None and "cpu interpret" in r.label
    again = tune(twice, "64x128:f32", evaluator=ev, strategy="exhaustive", budget=1, write_db="user")
    assert "not stored" in again.db_note and again.db_path is None


@pytest.mark.parametrize("kernel_name, shapes", [
    ("matmul_nn", ("1x256x128:bf16", "1x128x256:bf16")),
    ("quantized_matmul_kernel", ("64x256:bf16", "128x256:i8", "1x128:f32")),
    ("quantized_matmul_w8a8_kernel", ("64x256:bf16", "128x256:i8", "1x128:f32")),
])
def test_measure_checks_library_kernels_against_their_jax_references(kernel_name, shapes):
    """The library's references are written in jnp (``tpukernels.dsl.jax_reference``); the measure evaluator
    calls references with torch tensors (every candidate failed with "'Tensor' object has no attribute
    'astype'" before the adapter)."""
    import tpukernels.library  # noqa: F401  (registers the kernels)
    from tpukernels.dsl import REGISTRY

    r = tune(REGISTRY[f"tpukernels::{kernel_name}"], *shapes, evaluator=MeasureEvaluator(repeats=1, warmup=1), budget=1)
    (t,) = r.trials
    assert t.ok, t.error
    assert t.details["check"] == "kernel.reference" and t.details["max_rel_err"] < 1e-2


def test_a_wrong_jax_reference_is_a_mismatch():
    """The adapter's outputs are compared, not trusted: a jnp reference computing 3x for a 2x kernel fails."""
    wrong = tk.tpu_kernel(twice.body, name="twice_vs_jnp", namespace="tktest_autotune",
                          tunables={"br": tk.Tunable([8, 16], default=8)},
                          reference=tk.dsl.jax_reference(lambda x: x * 3))(twice.launch_fn)
    r = tune(wrong, "64x128:f32", evaluator=MeasureEvaluator(repeats=1, warmup=1), strategy="exhaustive")
    assert r.trials and all(t.status == "wrong" and "kernel.reference" in t.error for t in r.trials)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int32, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_torch_jax_round_trip_is_bit_exact(dtype):
    from tpukernels.dsl.dtypes import jax_to_torch, torch_to_jax

    g = torch.Generator().manual_seed(0)
    t = (torch.randn(7, 33, generator=g) * 50).to(dtype) if dtype.is_floating_point else \
        torch.randint(-100, 100, (7, 33), generator=g, dtype=dtype)
    a = torch_to_jax(t)
    assert str(a.dtype) == str(dtype).replace("torch.", "") and a.shape == (7, 33)
    back = jax_to_torch(a)
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.uint8) if dtype.itemsize == 1 else back, t.view(torch.uint8) if dtype.itemsize == 1 else t)


def test_measure_gives_in_place_kernels_fresh_inputs():
    ev = MeasureEvaluator(repeats=2, warmup=2)
    from tpukernels.autotune import evaluators as evs

    problem = Problem.from_args(bump, "32x128:f32")
    t = ev.evaluate(problem, tk.Config(br=16))
    assert t.ok and t.details["fresh_inputs_per_run"] and t.details["check"] == "default config"
    cached = evs._MEASURE_CACHE[ev._key(problem)]["inputs"]["x"]
    assert torch.equal(cached, ev._inputs(problem)["x"])  # the shared inputs were never written to
    t2 = MeasureEvaluator(repeats=2).evaluate(Problem.from_args(scale, "32x128:f32", 2.0), tk.Config(block_rows=8))
    assert t2.ok and not t2.details["fresh_inputs_per_run"]


# ------------------------------------------------------------------------------------------ DB + dispatch
def test_sweep_writes_db_and_dispatch_uses_it(tmp_cache, monkeypatch, caplog):
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v6e")
    monkeypatch.setenv("TPUKERNELS_LOG_CONFIG", "1")
    x = torch.randn(1000, 384)
    specs, statics = specs_from_values(scale, [x, 2.0])
    with caplog.at_level("INFO", logger="tpukernels.dispatch"):  # before the sweep: the default
        torch.testing.assert_close(scale(x, 2.0), x * 2)
    assert "{'block_rows': 16} from default" in caplog.text
    caplog.clear()
    ev = SyntheticEvaluator(optimum={"block_rows": 32})
    r = tune(scale, x, 2.0, evaluator=ev, strategy="exhaustive", write_db="user")
    assert r.best.config == {"block_rows": 32} and r.db_path == db.user_db_path(scale.qualname, "v6e")
    assert scale.resolve_config(specs, statics, None) == (tk.Config(block_rows=32), "user-db:v6e")
    # the next call (same process, same signature) dispatches to the tuned config
    with caplog.at_level("INFO", logger="tpukernels.dispatch"):
        torch.testing.assert_close(scale(x, 2.0), x * 2)
    assert "{'block_rows': 32} from user-db:v6e" in caplog.text
    # another bucket, same dtypes/statics: nearest entry; another dtype: a miss
    s2, _ = specs_from_values(scale, [torch.zeros(3000, 384), 2.0])
    assert scale.resolve_config(s2, statics, None) == (tk.Config(block_rows=32), "user-db:nearest:v6e")
    s3, _ = specs_from_values(scale, [torch.zeros(1000, 384, dtype=torch.bfloat16), 2.0])
    assert scale.resolve_config(s3, statics, None)[1] == "default"
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v5e")  # other chip: no data
    assert scale.resolve_config(specs, statics, None)[1] == "default"


def test_measured_db_entry_is_not_replaced_by_a_model(tmp_cache):
    ev_meas = SyntheticEvaluator(optimum={"block_rows": 8}, name="measure", label="measured")
    ev_model = SyntheticEvaluator(optimum={"block_rows": 256})
    r1 = tune(scale, "512x128:f32", 2.0, evaluator=ev_meas, strategy="exhaustive", write_db="user")
    r2 = tune(scale, "512x128:f32", 2.0, evaluator=ev_model, strategy="exhaustive", write_db="user")
    assert r1.db_path and r2.db_path is None and "measured entry" in r2.db_note
    r3 = tune(scale, "512x128:f32", 2.0, evaluator=ev_model, strategy="exhaustive", write_db="user", force_db=True)
    entries = json.load(open(r3.db_path))["entries"]
    assert [e["config"] for e in entries] == [{"block_rows": 256}]


def test_sweep_into_corrupted_db_warns_and_keeps_the_old_file(tmp_cache):
    path = db.user_db_path(scale.qualname, "v6e")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.warns(RuntimeWarning, match="corrupted tuning file"):
        r = tune(scale, "64x128:f32", 2.0, evaluator=SyntheticEvaluator(), strategy="exhaustive", write_db="user")
    assert r.db_path == path and os.path.exists(path + ".corrupt")
    assert len(json.load(open(path))["entries"]) == 1


def _sweep_in_process(args):
    cache, rows = args
    os.environ["TPUKERNELS_CACHE_DIR"] = cache
    from kernels_for_tests import scale as k
    from test_autotune_helpers import SyntheticEvaluator as Ev

    from tpukernels.autotune.tuner import tune as t

    return t(k, f"{rows}x128:f32", 2.0, evaluator=Ev(), strategy="exhaustive", write_db="user").db_path


def test_concurrent_sweeps_keep_every_entry(tmp_cache):
    with mp.get_context("spawn").Pool(2) as pool:
        paths = pool.map(_sweep_in_process, [(str(tmp_cache), n) for n in (64, 512, 4096, 32768)])
    assert len(set(paths)) == 1
    entries = json.load(open(paths[0]))["entries"]
    assert sorted(e["key"]["shapes"][0][0] for e in entries) == [64, 512, 4096, 32768]


# ------------------------------------------------------------------------------------------ CLI
def test_cli_measure_json_report_and_refused_db(tmp_path, tmp_cache, capsys):
    rep = tmp_path / "rep"
    args = ["--import", HELPERS, "autotune", "twice", "--shape", "64x128:f32", "--evaluator", "measure",
            "--strategy", "exhaustive", "--repeats", "2", "--no-progress", "--report", str(rep), "--write-db"]
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res) == 1 and res[0]["failures"] == {"mismatch": 1} and res[0]["best"]["config"]["br"] in (8, 32)
    assert res[0]["db_path"] is None and "not stored" in res[0]["db_note"]
    md = (rep / "report.md").read_text()
    assert "tktest_autotune::twice" in md and "mismatch" in md
    pngs = list(rep.glob("*.png"))
    assert len(pngs) == 1 and pngs[0].read_bytes()[:4] == b"\x89PNG"
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "best config" in out and "failed candidates" in out and "cpu interpret" in out


def test_cli_library_uses_standard_cases(monkeypatch, capsys, tmp_cache):
    from tpukernels import library

    monkeypatch.setattr(library, "standard_cases", lambda: [(scale, ("64x128:f32",), {"alpha": 3.0}),
                                                            (twice, ("32x128:f32",), {})])
    assert main(["autotune", "--library", "--evaluator", "measure", "--budget", "2", "--repeats", "1",
                 "--no-progress", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["kernel"] for r in res] == ["tktest::scale", "tktest_autotune::twice"]
    assert all(r["evaluated"] == 2 for r in res) and "alpha=3.0" in res[0]["problem"]
    # --library KERNEL: that kernel's standard cases only (re-tune one shipped table)
    assert main(["autotune", "--library", "twice", "--evaluator", "measure", "--budget", "2", "--repeats", "1",
                 "--no-progress", "--json"]) == 0
    assert [r["kernel"] for r in json.loads(capsys.readouterr().out)] == ["tktest_autotune::twice"]
    assert main(["autotune", "--library", "add_mul", "--evaluator", "measure"]) == 2
    assert "has no STANDARD_CASES" in capsys.readouterr().err


def test_cli_errors_are_clean(capsys):
    assert main(["autotune", "scale", "--shape", "8x128:f32"]) == 2
    assert "--chip is required" in capsys.readouterr().err
    assert main(["autotune", "--library", "scale", "--shape", "8x128:f32", "--evaluator", "measure"]) == 2
    assert "give no --shape" in capsys.readouterr().err


def test_write_db_shipped_goes_to_package_data_path(tmp_path, tmp_cache, monkeypatch):
    shipped = tmp_path / "pkgdata" / "scale.json"
    monkeypatch.setattr(db, "shipped_db_path", lambda qualname, chip: str(shipped))
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v6e")
    r = tune(scale, "640x256:f32", 2.0, evaluator=SyntheticEvaluator(optimum={"block_rows": 8}),
             strategy="exhaustive", write_db="shipped")
    assert r.db_path == str(shipped) and not os.path.exists(db.user_db_path(scale.qualname, "v6e"))
    specs, statics = specs_from_values(scale, [torch.zeros(640, 256), 2.0])
    assert scale.resolve_config(specs, statics, None) == (tk.Config(block_rows=8), "shipped-db:v6e")


def test_cli_values_restrict_the_search(capsys):
    assert main(["--import", HELPERS, "autotune", "twice", "--shape", "32x128:f32", "--evaluator", "measure",
                 "--values", "br=32", "--strategy", "exhaustive", "--repeats", "1", "--no-progress", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)
    assert sorted(t["config"]["br"] for t in res["trials"]) == [8, 32] and res["failures"] == {}


def _addb_body(x_ref, b_ref, o_ref):
    o_ref[...] = x_ref[...] + b_ref[...]


@tk.tpu_kernel(_addb_body, namespace="tktest_autotune", tunables={"bm": tk.Tunable([8, 16], default=8)},
               shapes={"x": "M N", "b": "N"})
def addb_decl(x: torch.Tensor, b: torch.Tensor, *, bm: int) -> torch.Tensor:
    from jax.experimental import pallas as pl

    M, N = x.shape
    return tk.Launch(grid=(tk.cdiv(M, bm),), in_specs=[pl.BlockSpec((bm, N), lambda i: (i, 0)),
                                                       pl.BlockSpec((N,), lambda i: (0,))],
                     out_specs=pl.BlockSpec((bm, N), lambda i: (i, 0)), out_shape=tk.like(x))


def _no_sweep(monkeypatch):
    from tpukernels.autotune import tuner

    calls = []
    monkeypatch.setattr(tuner, "tune", lambda *a, **k: calls.append(a) or pytest.fail("a sweep started"))
    return calls


@pytest.mark.parametrize("flag,value,rule", [("--budget", "0", "an int >= 1"), ("--budget", "-3", "an int >= 1"),
                                             ("--budget", "x", "expected an int"), ("--seconds", "0", "a number > 0"),
                                             ("--workers", "0", "an int >= 1"), ("--repeats", "-1", "an int >= 1")])
def test_cli_non_positive_budget_is_a_usage_error(flag, value, rule, monkeypatch, capsys):
    """--budget 0 / -3 used to be accepted, evaluate nothing and exit 1 with no reason."""
    calls = _no_sweep(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["--import", HELPERS, "autotune", "twice", "--shape", "32x128:f32", "--evaluator", "measure",
              flag, value, "--no-progress"])
    assert e.value.code == 2 and not calls
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and rule in err


@pytest.mark.parametrize("item,msg", [("br=abc", "br='abc' is a str; br takes int values"),
                                      ("br=8,16.0", "br=16.0 is a float"),
                                      ("br=0", "br=0 must be positive"),
                                      ("bq=8", "has no tunable 'bq'")])
def test_cli_values_are_checked_with_the_tunables_rules(item, msg, monkeypatch, capsys):
    """--values br=abc used to be accepted; every candidate was then pruned as a str and the run exited 0."""
    calls = _no_sweep(monkeypatch)
    assert main(["--import", HELPERS, "autotune", "twice", "--shape", "32x128:f32", "--evaluator", "measure",
                 "--values", item, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert not calls and "--values" in err and msg in err


def test_cli_values_parse_tuples_and_keep_ints():
    from tpukernels.autotune.cli import _check_values, _parse_values

    assert _parse_values(["a=(16,128),(8,256)", "b=8,16", "c=tanh"]) == {"a": [(16, 128), (8, 256)], "b": [8, 16],
                                                                         "c": ["tanh"]}
    assert _check_values(twice, _parse_values(["br=32,8"])) == {"br": [32, 8]}


def test_cli_shapes_violating_the_declaration_are_an_argument_error(monkeypatch, capsys):
    """Used to show up as "N x launch pruned ... space exhausted", rc 1, after the sweep ran."""
    base = ["autotune", "tktest_autotune::addb_decl", "--evaluator", "measure", "--no-progress"]
    calls = _no_sweep(monkeypatch)
    assert main(base + ["--shape", "64x256:f32", "--shape", "128:f32"]) == 2
    err = capsys.readouterr().err
    assert not calls and "b has shape (128,), but shapes= declares b: 'N' and N=256 from x" in err
    monkeypatch.undo()
    assert main(base + ["--shape", "64x256:f32", "--shape", "256:f32", "--repeats", "1", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)
    assert res["best"] is not None and res["failures"] == {} and not res["pruned"]


def test_read_only_cache_dir_reports_instead_of_raising(tmp_cache):
    os.makedirs(tmp_cache / "autotuning" / "v6e", exist_ok=True)
    os.chmod(tmp_cache / "autotuning" / "v6e", 0o555)
    try:
        if os.access(tmp_cache / "autotuning" / "v6e", os.W_OK):
            pytest.skip("running as a user who can write to read-only folders (root)")
        r = tune(scale, "64x128:f32", 2.0, evaluator=SyntheticEvaluator(), strategy="exhaustive", write_db="user")
    finally:
        os.chmod(tmp_cache / "autotuning" / "v6e", 0o755)
    assert r.best is not None and r.db_path is None and "cannot write" in r.db_note


def test_read_only_db_file_reports_instead_of_raising(tmp_cache, monkeypatch):
    """Also as root: a write that fails with an OSError leaves the results and says why."""
    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(db, "record", refuse)
    r = tune(scale, "64x128:f32", 2.0, evaluator=SyntheticEvaluator(), strategy="exhaustive", write_db="user")
    assert r.best is not None and r.db_path is None and "cannot write" in r.db_note and "Permission denied" in r.db_note


def test_stored_note_says_when_cpu_calls_use_the_entry(tmp_cache):
    r = tune(scale, "64x128:f32", 2.0, evaluator=SyntheticEvaluator(), strategy="exhaustive", write_db="user")
    assert r.db_path and "TPUKERNELS_TARGET_CHIP=v6e" in r.db_note


def test_cli_text_output_says_why_each_config_was_pruned(capsys):
    assert main(["autotune", "tktest::copy_rows", "--shape", "64x128:f32", "--evaluator", "measure",
                 "--strategy", "exhaustive", "--repeats", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "pruned before compiling" in out and "br=12" in out and "(8,128)" in out.replace(", ", ",")


def test_a_config_without_a_libtpu_estimate_cannot_win_on_its_lower_bound():
    """tpu-model falls back to roofline + step overhead when libtpu cannot estimate a candidate: a lower
    bound, which would beat every real estimate. Such trials rank after all estimated ones."""
    from tpukernels.autotune.evaluators import Trial
    from tpukernels.autotune.report import markdown
    from tpukernels.autotune.tuner import SweepResult

    est = Trial({"b": 512}, "ok", time_us=120.0, details={"is_default": True})
    bound = Trial({"b": 2048}, "ok", time_us=80.0, details={"unranked": "no static estimate (abort)"})
    failed = Trial({"b": 4096}, "failed", error_kind="vmem", error="too big")
    r = SweepResult("k", "v5e", "p", "tpu-model", "model", "exhaustive", {}, 3, [bound, failed, est], [], 1.0, "done")
    assert r.best is est and est.ranked and not bound.ranked
    # with only unranked trials, the best bound is still reported (marked as such in the report)
    r2 = SweepResult("k", "v5e", "p", "tpu-model", "model", "exhaustive", {}, 1, [bound], [], 1.0, "done")
    assert r2.best is bound
    assert "unranked (no static estimate (abort))" in markdown(r, None)
    # the terminal output says so too: the best time is marked a bound, and why there is no estimate
    from tpukernels.autotune.report import summary_rows, unranked_lines

    (row,), header = summary_rows([r2])
    assert row[header.index("time us")] == "≥ 80.0 (model) unranked"
    assert "no candidate has a libtpu estimate" in unranked_lines(r2)[0] and "abort" in unranked_lines(r2)[0]
    assert "1 of 2 candidates have no libtpu estimate" in unranked_lines(r)[0]
    assert summary_rows([r])[0][0][header.index("time us")] == "120.0 (model)"
