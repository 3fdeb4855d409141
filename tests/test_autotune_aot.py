"""Autotuner with libtpu (compile-only): tpu-model sweeps for v5e and tpu7x that write the tuning DB and
change dispatch, and the model's validation against JAX's published v5e matmul measurements."""

import json
import os
import time

import pytest
import torch

import tpukernels as tk
from kernels_for_tests import EXAMPLES, load_example
from tpukernels.autotune.tuner import tune
from tpukernels.cli import main
from tpukernels.lowering import specs_from_values

pytestmark = pytest.mark.aot


def test_v5e_sweep_prunes_survives_a_compile_failure_writes_db_and_dispatches(tmp_cache, monkeypatch):
    matmul = load_example("matmul").matmul
    t0 = time.monotonic()
    r = tune(matmul, "1024x4096:bf16", "4096x2048:bf16", chip="v5e", strategy="exhaustive", seconds=300, write_db="user",
             values={"bm": [1024, 2048], "bk": [1024, 4096], "bn": [1024]})
    assert time.monotonic() - t0 < 300 and r.stopped == "space exhausted"
    assert r.evaluator == "tpu-model" and r.label == "model"
    # pruned before compiling: bk=4096 blocks overflow v5e's 16 MiB scoped VMEM; bm=2048 clamps to M=1024
    assert r.pruned_kinds["vmem"] == 6 and r.pruned_kinds["duplicate"] == 4  # (vmem is checked first)
    assert all(t.config["bk"] != 4096 and t.config["bm"] != 2048 for t in r.trials)
    # fits our estimate (16 MiB) but not Mosaic's: the compiler's failure is recorded, the sweep goes on
    worst = next(t for t in r.trials if t.config == {"bm": 1024, "bk": 1024, "bn": 1024})
    assert worst.status == "failed" and worst.error_kind == "vmem" and "scoped limit 16 MiB" in worst.error
    assert len(r.trials) == 8 and len(r.ok_trials) == 7
    best = r.best
    # libtpu's static estimate fed the model (one estimate may be lost to an overloaded machine: then that
    # candidate falls back to roofline + overhead and says so)
    notes = [t.details["cycles_note"] for t in r.ok_trials]
    assert sum(n.startswith("libtpu static estimate") for n in notes) >= len(notes) - 1
    assert best.details["grid_steps"] > 0 and 0 < best.details["pct_of_roofline"] <= 100
    assert r.db_path and json.load(open(r.db_path))["entries"][0]["evidence"]["evaluator"] == "tpu-model"
    # dispatch: the tuned config for this signature on v5e, the nearest bucket for another, miss for f32
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v5e")
    bf, f32 = torch.bfloat16, torch.float32
    specs, statics = specs_from_values(matmul, [torch.empty(1024, 4096, dtype=bf), torch.empty(4096, 2048, dtype=bf)])
    assert matmul.resolve_config(specs, statics, None) == (tk.Config(best.config), "user-db:v5e")
    s2, _ = specs_from_values(matmul, [torch.empty(1024, 4096, dtype=bf), torch.empty(4096, 3072, dtype=bf)])
    assert matmul.resolve_config(s2, statics, None) == (tk.Config(best.config), "user-db:nearest:v5e")
    s3, _ = specs_from_values(matmul, [torch.empty(1024, 4096, dtype=f32), torch.empty(4096, 2048, dtype=f32)])
    assert matmul.resolve_config(s3, statics, None)[1] == "default"


@pytest.mark.slow  # ~25-50 s of libtpu compiles; make test keeps the v5e sweep above (the same code path)
def test_tpu7x_cli_sweep_with_two_workers_within_budget(tmp_cache, monkeypatch, capsys):
    t0 = time.monotonic()
    rc = main(["--import", os.path.join(EXAMPLES, "matmul.py"), "autotune", "examples::matmul", "--chip", "tpu7x",
               "--shape", "1024x1024:bf16", "--shape", "1024x1024:bf16", "--strategy", "coordinate",
               "--budget", "4", "--seconds", "200", "--workers", "2", "--write-db", "--json", "--no-progress"])
    assert rc == 0 and time.monotonic() - t0 < 200
    (res,) = json.loads(capsys.readouterr().out)
    assert res["chip"] == "tpu7x" and res["evaluated"] == 4 and res["stopped"] == "evaluation budget"
    assert res["label"] == "model" and res["db_path"].endswith("tpu7x/examples.matmul.json")
    pids = {t["details"]["pid"] for t in res["trials"]}
    assert len(pids) == 2 and os.getpid() not in pids
    matmul = load_example("matmul").matmul
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "tpu7x")
    specs, statics = specs_from_values(matmul, [torch.empty(1024, 1024, dtype=torch.bfloat16)] * 2)
    assert matmul.resolve_config(specs, statics, None) == (tk.Config(res["best"]["config"]), "user-db:tpu7x")


@pytest.mark.slow  # ~90 s of libtpu estimates
def test_model_ranks_the_published_v5e_matmuls_in_published_order():
    from tpukernels.autotune.validation import validate

    v = validate()
    print("\n" + v.table())
    assert v.published_order and v.spearman["model"] == pytest.approx(1.0)
    assert v.median_abs_rel_err["model"] < 0.5
    # the rows not dominated by Python dispatch (>= 4096^3) are within 50%
    assert all(abs(r["rel_err"]["model"]) < 0.5 for r in v.rows if r["m"] >= 4096)


@pytest.mark.slow
def test_library_sweep_for_v5e_writes_every_case(tmp_cache, capsys):
    """`tpukernels autotune --library --chip v5e`: every library STANDARD_CASE tuned and stored (minutes)."""
    from tpukernels.library import standard_cases

    n = len(standard_cases())
    assert main(["autotune", "--library", "--chip", "v5e", "--budget", "2", "--seconds", "300", "--write-db",
                 "--json", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res) == n > 0
    assert all(r["best"] is not None and r["db_path"] and r["label"] == "model" for r in res)
