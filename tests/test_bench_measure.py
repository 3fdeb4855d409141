"""``tpukernels bench --measure`` (tpukernels/bench/measure.py) on the cpu: a fake device runner (scripted clock,
recorded sync and kernel runs) stands in for the TPU, so every figure below is known exactly."""

from __future__ import annotations

import json
import os
import sys
import types
import warnings

import pytest

from tpukernels.autotune import db
from tpukernels.autotune.space import Problem
from tpukernels.bench import measure
from tpukernels.bench.measure import DeviceRunner, Prepared
from tpukernels.errors import ArgumentError, BackendUnavailableError


class FakeDevice(DeviceRunner):
    """A device whose kernel runs take ``durations_us[kernel qualname]`` (a list is used in turn, then its last
    value); records every run, sync and clock read in ``events``. Configs resolve as a real call would
    (tuning DB / heuristic on the chip), without making any tensor."""

    def __init__(self, durations_us):
        self.now = 0.0
        self.events: list = []
        self.durations = {k: list(v) if isinstance(v, (list, tuple)) else [v] for k, v in durations_us.items()}
        super().__init__("cpu", sync=lambda: self.events.append("sync"), clock=self._clock)

    def _clock(self) -> float:
        self.events.append("clock")
        return self.now

    def prepare(self, kernel, args, kwargs, chip):
        from tpukernels.chips import get_chip
        from tpukernels.lowering import resolve

        problem = Problem.from_args(kernel, *args, **kwargs)
        res = resolve(kernel, problem.lowered_specs, problem.statics, None, chip=get_chip(chip))
        queue = self.durations[kernel.qualname]

        def run():
            self.events.append(("run", kernel.qualname))
            self.now += (queue.pop(0) if len(queue) > 1 else queue[0]) * 1e-6

        return Prepared(run, dict(res.config), res.source, problem)


def script(samples_us, warmup):
    """A run callable taking 0 µs for the warm-up runs, then ``samples_us`` in turn; and its device."""
    dev = FakeDevice({"k": [0.0] * warmup + list(samples_us)})
    queue = dev.durations["k"]

    def run():
        dev.events.append("run")
        dev.now += (queue.pop(0) if len(queue) > 1 else queue[0]) * 1e-6

    return dev, run


# ------------------------------------------------------------------------------------------- timing loop
def test_warmup_then_sync_before_every_clock_read_and_median_of_n():
    dev, run = script([5.0, 1.0, 30.0, 3.0, 7.0], warmup=2)  # mean 9.2, median 5
    t = measure.time_call(run, dev.sync, dev.clock, warmup=2, repeats=5)
    assert dev.events == ["run", "run"] + ["sync", "clock", "run", "sync", "clock"] * 5
    assert all(dev.events[i - 1] == "sync" for i, e in enumerate(dev.events) if e == "clock")
    assert t.samples_us == pytest.approx((5.0, 1.0, 30.0, 3.0, 7.0))
    assert (t.median_us, t.min_us, t.spread_us) == pytest.approx((5.0, 1.0, 29.0))


def test_median_of_an_even_count_and_no_warmup():
    dev, run = script([4.0, 1.0, 10.0, 2.0], warmup=0)
    t = measure.time_call(run, dev.sync, dev.clock, warmup=0, repeats=4)
    assert dev.events[0] == "sync" and dev.events.count("run") == 4
    assert t.median_us == pytest.approx(3.0) and t.spread_us == pytest.approx(9.0)


@pytest.mark.parametrize("warmup, repeats, name", [(-1, 5, "--warmup"), (2, 0, "--repeats"), (2, 1.5, "--repeats"),
                                                   (True, 5, "--warmup"), (2, "3", "--repeats")])
def test_bad_counts_are_refused_before_anything_runs(warmup, repeats, name):
    dev, run = script([1.0], warmup=0)
    with pytest.raises(ArgumentError, match=f"{name} must be an integer >= {0 if name == '--warmup' else 1}"):
        measure.time_call(run, dev.sync, dev.clock, warmup=warmup, repeats=repeats)
    assert dev.events == []


def test_smallest_counts_are_accepted():
    dev, run = script([2.0], warmup=0)
    assert measure.time_call(run, dev.sync, dev.clock, warmup=0, repeats=1).samples_us == pytest.approx((2.0,))


# ------------------------------------------------------------------------------------------------- rows
def _matmul_cases(chip):
    from tpukernels.bench import matmul

    return matmul.cases([chip])


def test_case_rows_time_the_modelled_calls_and_give_model_over_measured():
    cases = _matmul_cases("v5e")
    kernels = {c.impls[0].parts[0][0].qualname for c in cases}
    dev = FakeDevice({k: 200.0 for k in kernels})
    first = cases[0]
    models = measure.model_index({"matmul": {"rows": [
        {"kind": "ours", "op": first.op, "shape": first.shape, "chip": "v5e", "figure": "estimate",
         "credible": True, "model_us": 150.0},
        {"kind": "ours", "op": cases[1].op, "shape": cases[1].shape, "chip": "v5e", "figure": "estimate",
         "credible": False, "model_us": 1.0}]}})  # not credible: no model figure to compare
    rows = measure.measure_cases(cases, dev, warmup=1, repeats=3, models=models)
    assert [(r["op"], r["shape"]) for r in rows] == [(c.op, c.shape) for c in cases]
    assert all(r["measured_us"] == pytest.approx(200.0) and r["kind"] == "measured" for r in rows)
    assert rows[0]["model_us"] == 150.0 and rows[0]["model_over_measured"] == pytest.approx(0.75)
    assert rows[1]["model_us"] is None and rows[1]["model_over_measured"] is None
    part = rows[0]["parts"][0]
    assert part["kernel"] == first.impls[0].parts[0][0].qualname and part["args"] == list(first.impls[0].parts[0][1])
    assert len(part["samples_us"]) == 3 and part["config"] and part["config_source"]
    assert dev.events.count("clock") == 2 * 3 * len(cases)


def test_a_case_of_several_calls_sums_their_medians_and_extra_work_is_not_timed():
    from tpukernels.bench import attention

    cases = attention.cases(["v5e"])
    dev = FakeDevice({"tpukernels::flash_attention_fwd": 100.0,
                      "tpukernels::flash_attention_bwd_dq": [30.0, 10.0, 50.0, 20.0],
                      "tpukernels::flash_attention_bwd_dkv": 40.0})
    rows = measure.measure_cases(cases, dev, warmup=1, repeats=3)
    fwd = [r for r in rows if "fwd" in r["op"]]
    bwd = [r for r in rows if "bwd" in r["op"]]
    assert fwd and all(r["measured_us"] == pytest.approx(100.0) for r in fwd)
    # the backward model includes an XLA op besides dq and dkv (the softmax rowsum), so it is listed, not timed
    assert bwd and all(r["measured_us"] is None and "not timed" in r["note"] for r in bwd)
    row = measure.new_row("attention", "fa bwd", "small", "v5e", model_us=140.0)
    assert measure.measure_parts(row, _bwd_parts(), "v5e", dev, warmup=1, repeats=3) is row
    # dq: warm-up 30, samples 10, 50, 20 -> median 20, min 10, spread 40; dkv: 40 each
    assert row["measured_us"] == pytest.approx(60.0) and row["min_us"] == pytest.approx(50.0)
    assert row["spread_us"] == pytest.approx(40.0) and row["model_over_measured"] == pytest.approx(140.0 / 60.0)


def _bwd_parts():
    from tpukernels.library.attention import CAUSAL, fa_backward_dkv, fa_backward_dq

    q, kv, rows = "1x2x256x128:bf16", "1x2x256x128:bf16", "1x2x1x256:f32"
    return [(k, (q, kv, kv, q, rows, rows), dict(CAUSAL)) for k in (fa_backward_dq, fa_backward_dkv)]


TOKAMAX_ROWS = {  # B, S, Hq, Hkv, D, causal: measured ms of two configs (the fastest is tokamax's)
    (4, 4096, 16, 16, 128, True): (0.5, 0.4),
    (16, 1024, 16, 16, 128, False): (0.3,),
}


def _tokamax_root(tmp_path, vjp=False):
    """A tokamax autotuning folder with TOKAMAX_ROWS (forward); with ``vjp``, also one backward row (0.9 ms)."""
    def args(B, S, hq, hkv, D, causal):
        return json.dumps({"q": f"bf16[{B},{S},{hq},{D}]", "k": f"bf16[{B},{S},{hkv},{D}]",
                           "v": f"bf16[{B},{S},{hkv},{D}]", "bias": None, "mask": {"is_causal": causal}})

    data = {args(*dims): {json.dumps({"block_q": 512, "block_kv": 512 + i}): {"evaluation_times_ms": [t, t]}
                          for i, t in enumerate(times)} for dims, times in TOKAMAX_ROWS.items()}
    folder = tmp_path / "tokamax" / "tpu7x"
    folder.mkdir(parents=True)
    (folder / "pallas_mosaic_tpu_flash_attention.json").write_text(json.dumps(data))
    if vjp:
        cfg = json.dumps({"block_q_dkv": 512, "block_kv_dkv": 512, "block_kv_dkv_compute": 512})
        (folder / "pallas_mosaic_tpu_flash_attention_vjp.json").write_text(json.dumps(
            {args(4, 4096, 16, 16, 128, True): {cfg: {"evaluation_times_ms": [0.9, 0.9]}}}))
    return str(tmp_path / "tokamax")


def test_calibration_rows_put_ours_measured_next_to_tokamax_measured(tmp_path):
    root = _tokamax_root(tmp_path, vjp=True)
    dev = FakeDevice({"tpukernels::flash_attention_fwd": [0.0, 250.0], "tpukernels::flash_attention_bwd_fused": 250.0})
    models = {("calibration", "flash_attention fwd", "B=4 S=4096 Hq=16 Hkv=16 D=128 causal", "tpu7x"): 300.0}
    rows_all = measure.measure_calibration("tpu7x", dev, warmup=1, repeats=2, models=models, root=root)
    rows = [r for r in rows_all if r["op"] == "flash_attention fwd"]
    by = {r["shape"]: r for r in rows}
    assert set(by) == {"B=4 S=4096 Hq=16 Hkv=16 D=128 causal", "B=16 S=1024 Hq=16 Hkv=16 D=128 full"}
    causal = by["B=4 S=4096 Hq=16 Hkv=16 D=128 causal"]
    assert causal["tokamax_measured_us"] == pytest.approx(400.0)  # the faster config
    assert causal["measured_us"] == pytest.approx(250.0)
    assert causal["tokamax_over_ours"] == pytest.approx(1.6) and causal["model_over_measured"] == pytest.approx(1.2)
    full = by["B=16 S=1024 Hq=16 Hkv=16 D=128 full"]
    assert full["model_us"] is None and full["tokamax_over_ours"] == pytest.approx(300.0 / 250.0)
    assert causal["parts"][0]["args"][0] == "4x16x4096x128:bf16"
    # tokamax's backward row: the backward a tpukernels call runs on tpu7x (the fused kernel), timed alone
    bwd = next(r for r in rows_all if r["op"] == "flash_attention bwd")
    assert bwd["shape"] == "B=4 S=4096 Hq=16 Hkv=16 D=128 causal" and bwd["tokamax_measured_us"] == pytest.approx(900.0)
    assert [p["kernel"] for p in bwd["parts"]] == ["tpukernels::flash_attention_bwd_fused"]
    assert bwd["parts"][0]["args"][4] == "4x16x1x4096:f32" and bwd["tokamax_over_ours"] == pytest.approx(900 / 250)


def test_a_failing_call_is_an_error_row_without_a_time():
    class Broken(FakeDevice):
        def prepare(self, kernel, args, kwargs, chip):
            raise RuntimeError("device lost\nsecond line")

    timed: list = []
    rows = measure.measure_cases(_matmul_cases("v5e")[:1], Broken({}), warmup=1, repeats=1, models={}, timed=timed)
    assert rows[0]["measured_us"] is None and rows[0]["error"] == "RuntimeError: device lost"
    assert rows[0]["parts"] == [] and timed == []  # nothing to store in the DB


# ------------------------------------------------------------------------------------ tuning DB (--write-db)
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUKERNELS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_write_db_stores_the_fastest_timing_per_key_marked_measured_and_readable_back(cache_dir):
    cases = _matmul_cases("v6e")[:2]
    dev = FakeDevice({c.impls[0].parts[0][0].qualname: 80.0 for c in cases})
    timed: list = []
    rows = measure.measure_cases(cases, dev, warmup=0, repeats=1, timed=timed)
    dev.durations = {k: [50.0] for k in dev.durations}
    rows += measure.measure_cases(cases[:1], dev, warmup=0, repeats=1, timed=timed)  # the first again, faster
    assert len(timed) == 3 and all(row is r for (row, _, _), r in zip(timed, rows))
    files = measure.store_winners(timed, "v6e", warmup=0, repeats=1)
    entries = [e for f in files for e in db.load(f)]
    assert len(entries) == 2 and all(db.is_measured(e) and e["evidence"]["measured"] is True for e in entries)
    kernel, args, kwargs = cases[0].impls[0].parts[0]
    problem = Problem.from_args(kernel, *args, **kwargs)
    key = db.entry_key(kernel, problem.lowered_specs, problem.statics)
    first = next(e for e in entries if e["key"] == key)
    assert first["evidence"]["time_us"] == 50.0 and first["evidence"]["evaluator"] == "measure"
    assert first["config"] == rows[0]["parts"][0]["config"]
    assert db.lookup(kernel, "v6e", problem.lowered_specs, problem.statics) == (first["config"], "user-db")


def test_measured_marker_is_backward_compatible_and_validated(tmp_path):
    base = {"key": {"source_hash": "x", "shapes": [[8]], "dtypes": ["float32"], "statics": {}}, "config": {"a": 1}}
    old_measured = dict(base, evidence={"evaluator": "measure", "time_us": 3.0})
    old_model = dict(base, evidence={"evaluator": "tpu-model"})
    assert db.is_measured(old_measured) and not db.is_measured(old_model)
    assert not db.is_measured(dict(base, evidence={"evaluator": "measure", "measured": False}))
    assert not db.is_measured(base)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"version": 1, "entries": [old_measured, dict(base, evidence={"measured": "yes"})]}))
    with pytest.warns(RuntimeWarning, match="measured 'yes' is not true or false"):
        assert db.load(str(path)) == [old_measured]


def test_every_shipped_tuning_file_still_loads_whole():
    import glob

    import tpukernels

    files = glob.glob(os.path.join(os.path.dirname(tpukernels.__file__), "data", "autotuning", "*", "*.json"))
    assert files
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for f in files:
            with open(f) as fh:
                assert len(db.load(f)) == len(json.load(fh)["entries"]), f


# ------------------------------------------------------------------------------------------ the command
def _args(argv):
    from tpukernels.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


@pytest.mark.parametrize("argv, match", [
    (["--measure", "--repeats", "0"], "--repeats must be an integer >= 1"),
    (["--measure", "--warmup", "-1"], "--warmup must be an integer >= 0"),
    (["--write-db"], "--write-db: only with --measure"),
    (["--repeats", "5"], "--repeats: only with --measure"),
    (["--measure", "--report-only"], "--report-only runs nothing"),
    (["--measure", "--family", "host"], "the host family is already a measurement"),
])
def test_command_line_validation_before_any_device_check(argv, match, tmp_path, monkeypatch):
    monkeypatch.setattr(measure, "require_tpu", lambda: pytest.fail("the device was looked for"))
    with pytest.raises(ArgumentError, match=match):
        args = _args(argv + ["--results-dir", str(tmp_path)])
        args.func(args)


def test_measure_without_torch_tpu_is_a_typed_error_naming_the_rule(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_tpu", None)  # import torch_tpu raises ImportError
    args = _args(["--measure", "--family", "matmul", "--results-dir", str(tmp_path)])
    with pytest.raises(measure.NoTpuError, match="--measure times kernels on a live TPU: it needs torch_tpu") as e:
        args.func(args)
    assert isinstance(e.value, BackendUnavailableError) and "cannot be imported" in str(e.value)
    assert not (tmp_path / measure.MEASURED_FILE).exists()


def test_measure_with_torch_tpu_but_no_device_is_a_typed_error(monkeypatch):
    import torch

    monkeypatch.setitem(sys.modules, "torch_tpu", types.ModuleType("torch_tpu"))
    monkeypatch.setattr(torch, "tpu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    with pytest.raises(measure.NoTpuError, match="torch_tpu sees no TPU device here"):
        measure.require_tpu()


def test_the_command_saves_measured_rows_renders_them_and_writes_the_db(tmp_path, cache_dir, monkeypatch, capsys):
    from tpukernels.bench.core import save_result

    res = tmp_path / "results"
    res.mkdir()
    cases = _matmul_cases("v5e")
    case = cases[0]
    save_result(str(res / "matmul.json"), "matmul", "model", [
        {"family": "matmul", "kind": "ours", "impl": "tpukernels", "op": case.op, "shape": case.shape, "chip": "v5e",
         "figure": "estimate", "credible": True, "model_us": 90.0, "flags": [], "error": None, "config": "-",
         "ours_speedup": None, "pct_roofline": 50.0, "bound": "mxu", "cycles": 1}], {"chips": ["v5e"]})
    dev = FakeDevice({c.impls[0].parts[0][0].qualname: 120.0 for c in cases})
    monkeypatch.setattr(measure, "require_tpu", lambda: "v5e")
    monkeypatch.setattr(measure, "DeviceRunner", lambda device: dev)
    out = tmp_path / "B.md"
    args = _args(["--measure", "--family", "matmul", "--warmup", "2", "--repeats", "3", "--write-db",
                  "--results-dir", str(res), "--out", str(out), "--json", str(tmp_path / "all.json"),
                  "--no-progress"])
    assert args.func(args) == 0
    saved = measure.load_measured(str(res))
    assert saved["chip"] == "v5e" and (saved["warmup"], saved["repeats"]) == (2, 3)
    row = next(r for r in saved["rows"] if r["shape"] == case.shape)
    assert row["measured_us"] == pytest.approx(120.0) and row["model_over_measured"] == pytest.approx(0.75)
    assert sum(isinstance(e, tuple) for e in dev.events) == 5 * len(cases) == 5 * len(saved["rows"])
    text = out.read_text()
    assert "## Measured on a TPU" in text
    assert f"| matmul | {row['op']} | {case.shape} | v5e | 120.0 | 120.0 | 0.0 | 90.0 | 0.75 | - | - |" in text
    assert saved["db_files"] and all(db.is_measured(e) for f in saved["db_files"] for e in db.load(f))
    assert json.loads((tmp_path / "all.json").read_text())["families"]["measured"]["rows"] == saved["rows"]
    assert f"* measured on a TPU v5e (`tpukernels bench --measure`): {len(cases)} of {len(cases)} cases timed; " \
           "model / measured 0.75–0.75 (1 cases with a model)." in capsys.readouterr().out


def test_the_device_runner_runs_the_call_a_case_models_with_the_resolved_config_pinned():
    """The real :class:`DeviceRunner` on the cpu (interpret mode), its sync and clock injected: the prepared call
    is the kernel on the seeded inputs with the config a plain call resolves to, so it returns what that call does."""
    import torch

    from tpukernels.autotune.evaluators import random_inputs
    from tpukernels.bench.norms import norm_cases
    from tpukernels.chips import get_chip
    from tpukernels.lowering import resolve

    op, kernel, args, statics, _ = norm_cases(16, 256, "f32")[0]
    syncs = []
    runner = DeviceRunner("cpu", sync=lambda: syncs.append(1), clock=lambda: 0.0, seed=3)
    prep = runner.prepare(kernel, args, statics, "v5e")
    want = resolve(kernel, prep.problem.lowered_specs, prep.problem.statics, None, chip=get_chip("v5e"))
    assert op == "rms_norm fwd" and prep.config == dict(want.config) and prep.source == want.source
    got = prep.run()
    ref = kernel(**random_inputs(prep.problem, "cpu", 3), config=dict(want.config))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    runner.sync()
    assert syncs == [1]


def test_the_summary_line_gives_the_ranges_of_the_ratios():
    from tpukernels.bench.report import measured_summary

    rows = [dict(measure.new_row("matmul", "m", "a", "v5e", 80.0), measured_us=100.0, model_over_measured=0.8),
            dict(measure.new_row("matmul", "m", "b", "v5e", 90.0), measured_us=75.0, model_over_measured=1.2),
            dict(measure.new_row("calibration", "fa", "c", "v5e", None, 300.0), measured_us=250.0,
                 tokamax_over_ours=1.2),
            dict(measure.new_row("calibration", "fa", "d", "v5e", None, 100.0), measured_us=125.0,
                 tokamax_over_ours=0.8),
            dict(measure.new_row("attention", "bwd", "e", "v5e"), note="not timed")]
    assert measured_summary({"chip": "v5e", "rows": rows}) == (
        "* measured on a TPU v5e (`tpukernels bench --measure`): 4 of 5 cases timed; model / measured 0.80–1.20 "
        "(2 cases with a model); tokamax measured / ours 0.80–1.20× (1/2 rows at least as fast).")
