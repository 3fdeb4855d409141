"""BENCHMARKS.md layout: a summary table first, short per-family tables, long reasons as numbered notes."""

from tpukernels.bench.report import render

REASON = "libtpu estimates this kernel VPU-bound " + "and explains why at length " * 40


def _row(impl, us, chip="v6e", shape="8192x4096", reason=None):
    return {"op": "rms_norm", "shape": shape, "chip": chip, "impl": impl, "kind": "ours" if impl == "tpukernels" else "other",
            "model_us": us, "figure": "estimate", "credible": True, "pct_roofline": 80.0, "bound": "cycles",
            "ours_speedup": None if impl == "tpukernels" else us / 10.0, "reason": reason, "config": "block_rows=64",
            "flags": [], "error": None, "memory": {}}


def test_summary_first_and_reasons_as_notes(tmp_path):
    rows = [_row("tpukernels", 10.0, reason=REASON), _row("xla", 9.0),
            _row("tpukernels", 10.0, shape="4096x4096"), _row("xla", 20.0, shape="4096x4096")]
    versions = {"jax": "0.10.2"}
    res = {"norms": {"rows": rows, "versions": versions, "kind": "model", "created": "now", "doc": "", "chips": ["v6e"]}}
    text = render(res, str(tmp_path / "B.md"), "tpukernels bench --chips v6e", figures_dir=str(tmp_path))
    assert text.index("## Summary") < text.index("## What the figures are") < text.index("## Where tpukernels is slower")
    # per family and chip: ours 20 µs vs best other 29 µs over 2 compared cases, 1 faster / 1 slower
    assert "| norms | v6e | 2 (2 compared) | 20.0 | 29.0 | 1.45× | 1 / 1 | 80% |" in text
    table_lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert max(map(len, table_lines)) < 400 and all(REASON[:60] not in ln for ln in table_lines)
    assert "| [1] |" in text and "\n1. " + REASON[:60] in text


def test_strategy_study_table_in_the_report(tmp_path):
    """BENCHMARKS.md gets the tuner-strategy study (python -m tpukernels.bench.strategy_study) from its JSON."""
    import json

    from tpukernels.bench.report import _strategy_section

    row = {"kernel": "tpukernels::matmul_nt", "chip": "v6e", "valid": 200, "space_size": 210,
           "exhaustive": {"median": 150, "worst": 150}, "random": {"median": 8, "worst": 40},
           "coordinate": {"median": 16, "worst": 16}, "surrogate": {"median": 10, "worst": 24}}
    (tmp_path / "strategy_study.json").write_text(json.dumps(
        {"created": "2026-12-03T00:00:00Z", "objective": "a model", "within": 0.03, "seeds": 10, "rows": [row]}))
    lines = _strategy_section(str(tmp_path))
    assert lines[0] == "## Tuner strategies (model)"
    assert "| matmul_nt | v6e | 200 | 150 / 150 (75% / 75%) | 8 / 40 (4% / 20%) | 16 / 16 (8% / 8%) | " \
           "10 / 24 (5% / 12%) |" in lines
    assert _strategy_section(str(tmp_path / "none")) == []  # no study run: no section


def test_rows_sharing_a_reason_share_one_note_and_show_their_model_times(tmp_path):
    """Two slower rows with the same reason: one note, each row its own model times (bound, % roofline) in cells;
    a missing tpukernels figure's reason is a note too, its error cut at a word."""
    missing = dict(_row("tpukernels", None, shape="1x1"), reason=REASON,
                   error="EstimateError: JaxRuntimeError: RESOURCE_EXHAUSTED: ran out of memory in memory space "
                         "vmem. Used 75.37M of 63.94M vmem. Exceeded the scoped limit " * 3)
    rows = [_row("tpukernels", 10.0, reason=REASON), _row("xla", 9.0),
            _row("tpukernels", 10.0, chip="tpu7x", reason=REASON), _row("xla", 8.0, chip="tpu7x"), missing]
    text = render({"norms": {"rows": rows, "versions": {}, "kind": "model", "created": "now", "doc": "",
                             "chips": ["v6e", "tpu7x"]}}, str(tmp_path / "B.md"), "cmd", figures_dir=str(tmp_path))
    assert text.count(REASON[:60]) == 1
    assert "| norms | rms_norm | 8192x4096 | v6e | xla | 10.0 (cycles, 80%) | 9.0 (cycles, 80%) | 0.900 | [1] |" in text
    assert "| 8192x4096 | tpu7x | xla | 10.0 (cycles, 80%) | 8.0 (cycles, 80%) | 0.800 | [1] |" in text
    bullet = next(ln for ln in text.splitlines() if ln.startswith("* norms: rms_norm 1x1"))
    assert bullet.endswith(" limit … [1]") and bullet.count("RESOURCE_EXHAUSTED") == 1 and len(bullet) < 240
    assert "cause not analysed yet" not in text


def test_peer_configs_are_listed_under_their_family_table(tmp_path):
    rows = [_row("tpukernels", 10.0), dict(_row("jax", 12.0), config="block_q=512"),
            _row("tpukernels", 10.0, chip="tpu7x"), dict(_row("jax", 12.0, chip="tpu7x"), config="block_q=1024"),
            _row("tpukernels", 10.0, shape="1x1"), dict(_row("xla", 11.0, shape="1x1"), config="XLA fusion")]
    text = render({"norms": {"rows": rows, "versions": {}, "kind": "model", "created": "now", "doc": "",
                             "chips": ["v6e", "tpu7x"]}}, str(tmp_path / "B.md"), "cmd", figures_dir=str(tmp_path))
    assert "* jax:\n  * `block_q=512`: rms_norm 8192x4096 v6e\n  * `block_q=1024`: rms_norm 8192x4096 tpu7x" in text
    assert "* xla: `XLA fusion`" in text


def test_every_committed_slower_or_floor_row_has_a_reason():
    """BENCHMARKS.md's promise (issue 40): no case where a peer is faster, or above a peer's floor, without a note
    saying why: every such item of the committed results carries its family's reason."""
    import os

    from tpukernels.bench import core, report
    from tpukernels.bench.families import CALIBRATION_FAMILIES, MODEL_FAMILIES

    root = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
    results = core.load_results(root, [f for f in MODEL_FAMILIES if f not in CALIBRATION_FAMILIES])
    items = [(f, s) for f, r in results.items() for s in report.slower(r["rows"]) + report.above_floor(r["rows"])]
    assert items
    assert [(f, s["op"], s["shape"], s["chip"]) for f, s in items if not s["ours"].get("reason")] == []
