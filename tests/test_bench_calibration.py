"""The calibration bench family: tokamax's shipped measured TPU times, model / measured, implied real times."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from tpukernels.bench import calibration as cal
from tpukernels.bench import core, report

# tokamax's own __init__ needs packages outside the tested set: only its files are read (make test installs it)
if importlib.util.find_spec("tokamax") is None:
    pytest.skip("tokamax is not installed (make test installs it --no-deps)", allow_module_level=True)


def test_loader_reads_tokamax_shipped_caches():
    """tokamax 0.0.12's TPU folders: tpu7x (attention, cross-entropy, ragged_dot, norms) and v5e (ragged_dot
    only); its tpu7x/ragged_dot.json is not valid JSON and is reported, not silently dropped."""
    skipped = []
    rows = cal.load_rows(skipped=skipped)
    assert {r.chip for r in rows} == {"tpu7x", "v5e"}
    assert [p for p, _ in skipped] == ["tpu7x/ragged_dot.json"]
    count = lambda chip, op: sum(r.chip == chip and r.op == op for r in rows)  # noqa: E731
    assert count("tpu7x", cal.ATTENTION_OP) == 76 and count("tpu7x", "pallas_mosaic_tpu_flash_attention_vjp") == 36
    assert count("v5e", "pallas_mosaic_tpu_ragged_dot") == 16 and count("tpu7x", "normalization") == 5
    assert {r.op for r in rows if r.chip == "v5e"} == {"ragged_dot", "pallas_mosaic_tpu_ragged_dot"}
    for r in rows:
        assert r.times_ms and min(r.times_ms) <= r.median_ms <= max(r.times_ms) and r.median_ms > 0
    a = [r for r in rows if r.op == cal.ATTENTION_OP]
    assert all(cal.array_shape(r.args["q"])[0] == "bf16" and "is_causal" in r.args["mask"] for r in a)
    assert all({"block_q", "block_kv", "block_kv_compute"} <= set(r.config) for r in a)
    with pytest.raises(cal.TokamaxFormatError, match="ragged_dot.json: not JSON"):
        cal.load_rows(chips={"tpu7x"}, ops={"ragged_dot"})


@pytest.mark.parametrize("text,match", [
    ("[1, 2]", "top level is list"),
    ('{"{\\"x\\": \\"bf16[2]\\"}": {"{}": {"compile_time_ms": 1.0}}}', "KeyError"),
    ('{"{\\"x\\": \\"bf16[2]\\"}": {"{}": {"evaluation_times_ms": [1.0, -2.0]}}}', "positive numbers"),
    ('{"not json": {"{}": {"evaluation_times_ms": [1.0]}}}', "JSONDecodeError"),
    ('{"{}": [1.0]}', "not an object"),
])
def test_unexpected_format_is_a_typed_error_naming_the_file(tmp_path, text, match):
    (tmp_path / "tpu7x").mkdir()
    (tmp_path / "tpu7x" / "op.json").write_text(text)
    with pytest.raises(cal.TokamaxFormatError, match=match) as e:
        cal.load_rows(str(tmp_path))
    assert "op.json" in str(e.value)


def test_loader_maps_chip_folders_skips_gpus_and_empty_files(tmp_path):
    entry = {json.dumps({"x": "bf16[8,4]"}): {"{}": {"evaluation_times_ms": [3.0, 1.0, 2.0]}}}
    for d in ("tpu_v5_lite", "nvidia_h100_80gb_hbm3", "tpu9z"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "op.json").write_text(json.dumps(entry))
    (tmp_path / "tpu_v5_lite" / "empty.json").write_text("")
    rows = cal.load_rows(str(tmp_path))
    assert sorted((r.chip, r.op) for r in rows) == [("tpu9z", "op"), ("v5e", "op")]
    assert rows[0].median_ms == 2.0 and rows[0].args == {"x": "bf16[8,4]"} and rows[0].config == {}
    assert cal.array_shape("bf16[4,4096,16,128]") == ("bf16", (4, 4096, 16, 128))
    with pytest.raises(cal.TokamaxFormatError, match="not an array spec"):
        cal.array_shape("bf16(4)")


def test_attention_rows_pick_the_fastest_plain_forward_per_shape():
    rows = cal.attention_rows(cal.load_rows(ops={cal.ATTENTION_OP}))
    got = [(tuple(cal.array_shape(r.args["q"])[1]), cal.array_shape(r.args["k"])[1][2], r.args["mask"]["is_causal"])
           for r in rows]
    assert len(got) == 9 and len(set(got)) == 9  # 4 MHA shapes x causal/full + the GQA row (causal only)
    assert ((32, 4096, 32, 128), 8, True) in got and ((1, 16384, 16, 128), 16, False) in got
    assert not any(r.args["return_residuals"] for r in rows)
    by = {g: r for g, r in zip(got, rows)}
    r = by[((1, 16384, 16, 128), 16, True)]  # the config tokamax's autotuner kept there, and its median
    assert r.median_ms == 3.659 and r.config["k_layout"] == 2 and r.config["block_q"] == 2048


def test_vjp_rows_are_the_backward_at_the_same_shapes():
    fwd = cal.attention_rows(cal.load_rows(ops={cal.ATTENTION_OP}))
    vjp = cal.attention_rows(cal.load_rows(ops={cal.VJP_OP}), cal.VJP_OP)
    assert all(r.op == cal.VJP_OP for r in vjp) and not any(r.op == cal.VJP_OP for r in fwd)
    assert [(r.chip, cal.shape_text(r)) for r in vjp] == [(r.chip, cal.shape_text(r)) for r in fwd]
    r = next(x for x in vjp if cal.shape_text(x) == "B=1 S=16384 Hq=16 Hkv=16 D=128 full")
    assert set(r.config) == {"block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute", "use_base2_exp"}
    assert r.median_ms > next(x for x in fwd if cal.shape_text(x) == cal.shape_text(r)).median_ms  # bwd > fwd
    with pytest.raises(cal.TokamaxFormatError, match="block_q.*not modelled"):
        cal.tokamax_vjp_fn(1024, False, dict(r.config, block_q=512), 0.1)
    # loading splash without tokamax's __init__ leaves a findable package: the shipped caches are still found
    assert cal.load_rows(chips={"tpu7x"}, ops={cal.VJP_OP}) and os.path.isdir(cal.autotuning_dir())


def test_best_per_args_keeps_the_fastest_config():
    mk = lambda args, cfg, t: cal.MeasuredRow("tpu7x", "op", args, cfg, (t, t))  # noqa: E731
    rows = [mk({"q": 1}, {"b": 1}, 2.0), mk({"q": 1}, {"b": 2}, 1.5), mk({"q": 2}, {"b": 1}, 3.0),
            mk({"q": 1}, {"b": 3}, 1.7)]
    assert sorted((r.args["q"], r.config["b"]) for r in cal.best_per_args(rows)) == [(1, 2), (2, 1)]


@pytest.mark.parametrize("B,hq,hkv", [(16, 16, 16), (4, 16, 16), (1, 16, 16), (32, 32, 8), (2, 8, 2), (1, 4, 1)])
def test_reduced_problem_keeps_group_size_and_scales_back(B, hq, hkv):
    b, h, kv, scale = cal.reduced_problem(B, hq, hkv)
    assert b * h * scale == B * hq and h // kv == hq // hkv and B % b == 0
    assert b == 1 and (kv == 2 or kv == hkv)


def test_calibration_arithmetic():
    # the reported v6e figure: S=16k causal, model 4.14 ms vs 3.98 measured -> credible
    c = cal.calibrate(4.14, 3.98, ours_model_ms=3.5)
    assert c["ratio"] == pytest.approx(4.14 / 3.98) and c["credible"] is True
    assert c["implied_ours_ms"] == pytest.approx(3.5 / (4.14 / 3.98))
    assert c["measured_over_implied"] == pytest.approx(3.98 / c["implied_ours_ms"])
    # 3x and 1/20 off: not credible, no implied time
    for model in (3 * 1.0, 1.0 / 20):
        c = cal.calibrate(model, 1.0, ours_model_ms=0.5)
        assert c["credible"] is False and c["implied_ours_ms"] is None and c["measured_over_implied"] is None
    lo, hi = cal.CREDIBLE_RANGE
    assert cal.calibrate(lo, 1.0, 1.0)["credible"] and cal.calibrate(hi, 1.0, 1.0)["credible"]
    assert not cal.calibrate(lo * 0.99, 1.0, 1.0)["credible"] and not cal.calibrate(hi * 1.01, 1.0, 1.0)["credible"]
    assert cal.calibrate(None, 1.0, 1.0) == {"ratio": None, "credible": None, "implied_ours_ms": None,
                                             "measured_over_implied": None}
    assert cal.calibrate(1.0, 1.0, None)["implied_ours_ms"] is None  # no model of ours: nothing implied


def _cal_row(chip, model, measured, ours, family="matmul"):
    r = {"family": family, "op": "op fwd", "shape": f"S={measured}", "chip": chip, "kind": "calibration",
         "measured_ms": measured, "model_ms": model, "ours_model_ms": ours, "error": None, "reason": None,
         "note": None if model / measured <= 1.3 else "model 2x off", **cal.calibrate(model, measured, ours)}
    return r


def test_report_calibration_section_and_summary_column(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "plot", lambda *a: None)  # the PNGs are tested in test_bench.py (20 s here)
    from test_bench import _synthetic  # tests/ is on sys.path (rootdir-relative import)

    _synthetic(tmp_path)
    rows = [_cal_row("v5e", 1.1, 1.0, 0.8), _cal_row("v5e", 2.0, 1.0, 0.5), _cal_row("v5e", 0.9, 1.0, 1.2)]
    rows[2]["flags"] = ["libtpu aborted on {...}: abort", "tokamax estimated at S=4096 x 4: libtpu could not"]
    core.save_result(str(tmp_path / "results" / "calibration.json"), "calibration", "model estimate", rows,
                     {"tokamax": "0.0.12", "doc": "Calibration doc :data:`x`."})
    results = core.load_results(str(tmp_path / "results"), ["matmul", "calibration", "host"])
    text = report.render(results, str(tmp_path / "B.md"), "tpukernels bench")
    # implied: 0.8 / 1.1 and 1.2 / 0.9; measured / implied: 1.1 / 0.8 and 0.9 / 1.2, geometric mean
    gm = math.sqrt((1.1 / 0.8) * (0.9 / 1.2))
    assert f"| {gm:.2f}× (2 of 3 rows implied) |" in text
    line = next(x for x in text.splitlines() if x.startswith("| matmul | v6e |"))
    assert line.endswith("| - |")  # no calibration rows on v6e
    assert "implied real vs tokamax measured |" in text
    sec = text[text.index("## Calibration against tokamax"):]
    assert "tokamax 0.0.12" in sec and "Calibration doc `x`." in sec
    assert "| matmul | op fwd | S=1.0 | v5e | 1.000 | 1.100 | 1.10 | yes | 0.800 | 0.727 | 1.38× | - |" in sec
    assert "| 2.00 | **no** | 0.500 | n/a | - | [1] |" in sec and "1. model 2x off" in sec
    # a row estimated at a shorter length says so (the other flags stay in the JSON)
    assert "| 0.75× | [2] |" in sec and "2. tokamax estimated at S=4096 x 4: libtpu could not" in sec
    assert "libtpu aborted on" not in sec
    assert "## calibration (model)" not in text  # not rendered as a family of implementations
    assert report.implied_vs_measured({"rows": [_cal_row("v5e", 2.0, 1.0, 1.0)]}, "matmul", "v5e") == \
        "model not credible (1 rows)"
    assert "within 0.7-1.3 of the measured time at 2 of 3 rows" in report.summary(results, "c")


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("op", [cal.ATTENTION_OP, cal.VJP_OP])
def test_real_attention_calibration_row_on_tpu7x(tmp_path, op):
    """One measured row modelled end to end (tokamax's splash kernel and ours lowered for tpu7x, libtpu
    estimates): the figures are filled in and the arithmetic is the one tested above (the backward at S=1k is
    not credible, 0.66x, so ours is not modelled there)."""
    pytest.importorskip("libtpu")
    rows = cal.attention_rows(cal.load_rows(chips={"tpu7x"}, ops={op}), op)
    r = next(x for x in rows if x.args["q"] == "bf16[16,1024,16,128]" and not x.args["mask"]["is_causal"])
    row = cal.attention_case(r, core.Estimator(str(tmp_path / "e.json")))
    assert row["error"] is None and row["model_ms"] > 0
    assert row["ratio"] == pytest.approx(row["model_ms"] / r.median_ms)
    assert (row["ours_model_ms"] is not None) == row["credible"]


def test_attention_case_falls_back_when_libtpu_aborts_and_implies_only_when_credible(tmp_path):
    """The whole row with a stand-in estimate server: libtpu aborts on the measured (experimental) scheduler,
    the default one is estimated at the measured time x 1.1 (credible), then tpukernels at half of that."""
    from test_bench import _est

    from tpukernels.perf import clock_hz

    r = next(x for x in cal.attention_rows(cal.load_rows(chips={"tpu7x"}, ops={cal.ATTENTION_OP}))
             if x.args["q"] == "bf16[4,4096,16,128]" and x.args["mask"]["is_causal"])
    assert r.config["use_experimental_scheduler"] and r.config["use_base2_exp"]
    _, h, kv, scale = cal.reduced_problem(4, 16, 16)
    cyc = round(1.1 * r.median_ms * 1e-3 * clock_hz("tpu7x") / scale)
    answers = iter([RuntimeError("estimate server exited: fifo_tracker.cc:436 abort"), cyc, cyc // 2])
    est, fake = _est(tmp_path, lambda blob, chip: next(answers))
    row = cal.attention_case(r, est)
    assert fake.calls == 3 and row["error"] is None
    assert row["modelled_config"]["use_experimental_scheduler"] is False and not row["modelled_config"]["use_base2_exp"]
    assert len(row["flags"]) == 1 and "fifo_tracker" in row["flags"][0]
    assert row["ratio"] == pytest.approx(1.1, rel=1e-3) and row["credible"] is True
    assert row["implied_ours_ms"] == pytest.approx(row["ours_model_ms"] / row["ratio"])
    assert row["ours_model_ms"] == pytest.approx(row["model_ms"] / 2, rel=1e-3)  # same bytes / FLOPs, half the cycles
    # far off: tpukernels is not estimated, nothing is implied, the note says why
    answers = iter([RuntimeError("estimate server exited: fifo_tracker.cc:436 abort"), cyc * 20])
    est, fake = _est(tmp_path, lambda blob, chip: next(answers), name="e2.json")
    row = cal.attention_case(r, est)
    assert fake.calls == 2 and row["credible"] is False and row["ours_model_ms"] is None
    assert row["implied_ours_ms"] is None and "22.00x the measured time" in row["note"] and "scheduler" in row["note"]


_VMEM = RuntimeError("JaxRuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
                     "memory space vmem. Used 66.01M of 63.94M vmem.")


_ABORT = RuntimeError("estimate server exited: llo_execution_graph.cc:46 | process_state.cc:796] RAW: Raising signal 6")


@pytest.mark.parametrize("case", ["ours out of VMEM", "tokamax aborts", "causal"])
def test_vjp_case_models_tokamax_backward_and_estimates_at_half_length_where_libtpu_cannot(tmp_path, case):
    """A VJP row (B=1, S=16k) with a stand-in estimate server. tokamax's backward is estimated once (no scheduler
    fallback: its config has none) at 0.8x the measured time (credible). Where libtpu cannot estimate a program
    at S (our fused backward, tpu7x's default, out of VMEM in the profiling compile; tokamax's aborting) and there
    is no mask, it is estimated at S/2 and scaled by 4 -- ours at tokamax's length or shorter; with the causal
    mask the error stays (the work does not scale by 4)."""
    from test_bench import _est

    from tpukernels.perf import clock_hz, model_time

    causal = case == "causal"
    r = next(x for x in cal.attention_rows(cal.load_rows(chips={"tpu7x"}, ops={cal.VJP_OP}), cal.VJP_OP)
             if x.args["q"] == "bf16[1,16384,16,128]" and x.args["mask"]["is_causal"] == causal)
    _, h, kv, scale = cal.reduced_problem(1, 16, 16)
    cyc = round(0.8 * r.median_ms * 1e-3 * clock_hz("tpu7x") / scale)
    parts = [cyc // 16, cyc // 32, cyc // 64]  # at S=8k: our kernel, the rowsum, the dQ cast
    tokamax = [_ABORT, cyc // 4] if case == "tokamax aborts" else [cyc]
    answers = iter(tokamax + ([] if case == "tokamax aborts" else [_VMEM]) + parts)

    def answer(blob, chip):
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    est, fake = _est(tmp_path, answer)
    row = cal.attention_case(r, est)
    assert row["op"] == "flash_attention bwd" and row["modelled_config"] == dict(r.config, use_base2_exp=False)
    byts, flops = cal.attention_bytes_flops(1, 16384, 16, 16, 128, causal, True)
    assert (row["hbm_bytes"], row["flops"]) == (byts, flops) and flops == 2.5 * 4 * 16 * 16384 ** 2 * 128 / (1 + causal)
    if causal:
        assert fake.calls == 2 and row["ours_model_ms"] is None and "vmem" in row["error"].lower()
        return
    assert fake.calls == 5 and row["error"] is None
    assert row["ratio"] == pytest.approx(0.8, rel=1e-3) and row["credible"]
    who = "tokamax" if case == "tokamax aborts" else "tpukernels"
    assert [f.split(":")[0] for f in row["flags"]] == [f"{who} estimated at S=8192 x 4"]
    want = model_time("tpu7x", 4 * sum(parts) * scale, byts, flops).time_us / 1e3
    assert row["ours_model_ms"] == pytest.approx(want)
    assert row["ours_config"]["source"] and row["implied_ours_ms"] == pytest.approx(want / row["ratio"])
