"""`tpukernels bench`: estimate cache, rows and ratios, credibility flags, version refusal, report, CLI."""

from __future__ import annotations

import json
import os

import pytest

from tpukernels.bench import core, report
from tpukernels.bench.core import Case, EstimateError, Estimator, Impl, VersionMismatch
from tpukernels.perf import clock_hz, hbm_bandwidth, peak_flops


class FakeClient:
    """Stands in for the libtpu estimate server: answers from a table, counts calls."""

    def __init__(self, answers):
        self.answers, self.calls = answers, 0

    def estimate(self, blob, chip, timeout_s):
        self.calls += 1
        a = self.answers(blob, chip)
        if isinstance(a, Exception):
            raise a
        return a


def _est(tmp_path, answers, name="est.json"):
    est = Estimator(str(tmp_path / name))
    fake = FakeClient(answers)
    est._client = lambda: fake
    return est, fake


def _prog(n=128):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x: x * 2), [jax.ShapeDtypeStruct((8, n), jnp.float32)]


def test_estimate_cache_keyed_by_program(tmp_path):
    est, fake = _est(tmp_path, lambda blob, chip: 1000 if chip == "v5e" else 2000)
    fn, st = _prog()
    assert est.cycles(fn, st, "v5e") == 1000
    assert est.cycles(fn, st, "v5e") == 1000 and fake.calls == 1  # cached in memory
    assert est.cycles(fn, st, "v6e") == 2000 and fake.calls == 2  # another chip is another key
    fn2, st2 = _prog(256)
    est.cycles(fn2, st2, "v5e")
    assert fake.calls == 3  # another program is another key
    # a new process (new Estimator) reads the file
    est2, fake2 = _est(tmp_path, lambda blob, chip: 7)
    assert est2.cycles(fn, st, "v5e") == 1000 and fake2.calls == 0
    data = json.load(open(tmp_path / "est.json"))
    assert len(data) == 3 and all(k.startswith(f"{est.libtpu}|") for k in data)


def test_estimate_server_keeps_libtpu_logs_in_its_own_folder(monkeypatch):
    """libtpu's log files (by default /tmp/tpu_logs, ~10 GB for one profile that fails its LLO checks) are written
    into the estimate server's own folder and removed with it when the server closes."""
    import jax

    from tpukernels.autotune.estimator import CycleEstimator

    monkeypatch.delenv("TPU_LOG_DIR", raising=False)
    fn, st = _prog()
    blob = jax.export.export(fn, platforms=["tpu"])(*st).serialize()
    server = CycleEstimator()
    try:
        assert server.estimate(blob, "v5e", timeout_s=300) > 0
        logs = os.path.join(server._dir, "tpu_logs")
        assert any(name.startswith("tpu_driver") for name in os.listdir(logs))
    finally:
        folder = server._dir
        server.close()
    assert not os.path.exists(folder)


_KILLED = RuntimeError("estimate server exited: ")


@pytest.mark.parametrize("error, match, calls", [
    # libtpu check failure / abort: deterministic, cached (one call for two estimates)
    (RuntimeError("estimate server exited: platforms/xla/llo_execution_graph.cc:146 | check failed"),
     "llo_execution_graph", 1),
    (RuntimeError("estimate server exited:  | === Source Location Tra | RAW: Raising signal 6 with default"),
     "signal 6", 1),
    # killed from outside (out of memory): retried once in a fresh server, never cached
    (_KILLED, "not cached", 4),
    # a SIGTERM from outside leaves libtpu's ".cc:" lines too (a real 2026-12-06 message, cached as an abort then)
    (RuntimeError("estimate server exited: https://symbolize.stripped_domain/r/?trace=7fd26d2a3f16 | E1206 "
                  "12:09:54.838519 24923 coredump_hook.cc:250] RAW: Remote crash gathering disabled for SIGTERM."),
     "not cached", 4),
])
def test_libtpu_abort_is_cached_but_a_killed_server_is_not(tmp_path, error, match, calls):
    fn, st = _prog()
    est, fake = _est(tmp_path, lambda b, c: error)
    for _ in range(2):
        with pytest.raises(EstimateError, match=match):
            est.cycles(fn, st, "v5e")
    assert fake.calls == calls
    assert os.path.exists(tmp_path / "est.json") == (calls == 1)


def test_a_killed_server_is_retried_and_the_answer_cached(tmp_path):
    fn, st = _prog()
    answers = iter([_KILLED, 42])
    est, fake = _est(tmp_path, lambda b, c: next(answers))
    assert est.cycles(fn, st, "v5e") == 42 and est.cycles(fn, st, "v5e") == 42 and fake.calls == 2


def test_corrupt_cache_is_kept_aside(tmp_path):
    p = tmp_path / "est.json"
    p.write_text("{not json")
    est, fake = _est(tmp_path, lambda b, c: 5)
    assert (tmp_path / "est.json.corrupt").read_text() == "{not json"
    fn, st = _prog()
    assert est.cycles(fn, st, "v5e") == 5
    assert json.load(open(p))


def _impl(name, kind, cycles, **kw):
    def f(est, chip):
        if isinstance(cycles, Exception):
            raise cycles
        return cycles, None
    return Impl(name, kind, f, **kw)


def test_run_case_model_times_ratios_and_flags():
    chip, flops, hbm = "v6e", 10**12, 10**6
    mxu_us = flops / peak_flops(chip) * 1e6
    c = lambda us: int(us * 1e-6 * clock_hz(chip))  # noqa: E731
    case = Case("f", "op", "shape", chip, hbm_bytes=hbm, flops=flops, impls=[
        _impl("tpukernels", "ours", c(2 * mxu_us)),
        _impl("xla", "xla", c(3 * mxu_us)),
        _impl("fast public", "public", c(1.5 * mxu_us)),
        _impl("impossible", "public", c(0.5 * mxu_us)),
        _impl("crashes", "xla", EstimateError("profiler aborted"), floor_us=lambda chip: 4 * mxu_us),
        _impl("crashes, no floor", "public", EstimateError("profiler aborted")),
    ])
    rows = {r["impl"]: r for r in core.run_case(case, est=None)}
    ours = rows["tpukernels"]
    assert ours["model_us"] == pytest.approx(2 * mxu_us, rel=1e-3) and ours["credible"]
    assert ours["pct_roofline"] == pytest.approx(50, rel=1e-3) and ours["ours_speedup"] is None
    assert rows["xla"]["ours_speedup"] == pytest.approx(1.5, rel=1e-3)
    assert rows["fast public"]["ours_speedup"] == pytest.approx(0.75, rel=1e-3)
    imp = rows["impossible"]  # below the MXU roofline: clamped by the max(), and flagged
    assert imp["credible"] is False and "below the MXU roofline" in imp["flags"][0]
    assert imp["model_us"] == pytest.approx(mxu_us, rel=1e-3)
    fl = rows["crashes"]
    assert fl["figure"] == "floor" and fl["model_us"] == pytest.approx(4 * mxu_us) and "aborted" in fl["error"]
    assert rows["crashes, no floor"]["model_us"] is None and rows["crashes, no floor"]["ours_speedup"] is None
    # memory-bound: below the HBM roofline is expected (the max() takes the bytes), not a flag
    hbm_case = Case("f", "op", "s", chip, hbm_bytes=10**9, flops=0, impls=[_impl("tpukernels", "ours", 10)])
    (r,) = core.run_case(hbm_case, est=None)
    assert r["credible"] and r["bound"] == "hbm"
    assert r["model_us"] == pytest.approx(1e9 / hbm_bandwidth(chip) * 1e6)


def test_probe_flags_a_cost_model_that_misses_work():
    chip = "v6e"
    probe_flops = 10**12
    mxu_us = probe_flops / peak_flops(chip) * 1e6
    cyc = lambda us: int(us * 1e-6 * clock_hz(chip))  # noqa: E731
    good = _impl("tpukernels", "ours", cyc(100), probe=lambda e, c: (cyc(1.2 * mxu_us), probe_flops))
    blind = _impl("blind", "public", cyc(50), probe=lambda e, c: (cyc(0.5 * mxu_us), probe_flops))
    rows = {r["impl"]: r for r in core.run_case(Case("f", "op", "s", chip, 0, 0, [good, blind]), est=None)}
    assert rows["tpukernels"]["credible"] is True and not rows["tpukernels"]["flags"]
    assert rows["blind"]["credible"] is False and "misses work" in rows["blind"]["flags"][0]


def test_versions_are_never_mixed(tmp_path):
    v = core.versions()
    assert {"jax", "jaxlib", "libtpu", "torch", "tpukernels", "tpukernels_source"} <= set(v)
    assert len(v["tpukernels_source"]) == 12 and v["tpukernels_source"] == core.source_digest()
    core.save_result(str(tmp_path / "norms.json"), "norms", "model", [])
    core.save_result(str(tmp_path / "matmul.json"), "matmul", "model", [])
    assert set(core.load_results(str(tmp_path), ["norms", "matmul", "attention"])) == {"norms", "matmul"}
    data = json.load(open(tmp_path / "matmul.json"))
    data["versions"]["libtpu"] = "0.0.1"
    json.dump(data, open(tmp_path / "matmul.json", "w"))
    with pytest.raises(VersionMismatch, match=r"libtpu 0\.0\.1"):
        core.load_results(str(tmp_path), ["norms", "matmul"])


def test_families_from_other_sources_mix_and_are_labelled(tmp_path):
    """Families run separately may come from different source digests; the report names each and flags old ones."""
    from tpukernels.bench import report

    core.save_result(str(tmp_path / "norms.json"), "norms", "model", [])
    core.save_result(str(tmp_path / "matmul.json"), "matmul", "model", [])
    data = json.load(open(tmp_path / "matmul.json"))
    data["versions"]["tpukernels_source"] = "0123456789ab"
    json.dump(data, open(tmp_path / "matmul.json", "w"))
    results = core.load_results(str(tmp_path), ["norms", "matmul"])
    (line,) = report._source_lines(results)
    assert "matmul `0123456789ab`" in line and "(an earlier source" in line.split("matmul")[1]
    assert f"norms `{core.source_digest('norms')}`" in line and "(an earlier" not in line.split("matmul")[0]


def test_family_source_digest_covers_what_its_figures_depend_on(tmp_path):
    """A family's digest changes with its kernels, its tuning data and the shared spine, not with another
    family's kernels or with the CLI / report code (which would flag every family as stale on any edit)."""
    import shutil

    pkg = os.path.dirname(core.__file__).rsplit(os.sep, 1)[0]
    root = str(tmp_path / "tpukernels")
    shutil.copytree(pkg, root, ignore=shutil.ignore_patterns("__pycache__", "*.lock"))
    fams = ("norms", "matmul", "quantized_matmul")
    before = {f: core.source_digest(f, root) for f in fams}
    whole = core.source_digest(None, root)
    assert before["norms"] == core.source_digest("norms")  # the copy digests like the installed package

    def edit(rel):
        with open(os.path.join(root, rel), "a") as f:
            f.write("\n# edited\n")
        return {f: core.source_digest(f, root) for f in fams}

    after = edit("cli.py")  # not in any family's figures
    assert after == before and core.source_digest(None, root) != whole
    after = edit("bench/measure.py")  # `bench --measure` times kernels: no model figure depends on it
    assert after == before
    after = edit("targets/cpu.py")  # the cpu interpret runner: no figure runs a torch call
    assert after == before
    after = edit("bench/families.py")  # the family list: naming a new family stales no other
    assert after == before
    after = edit("targets/compile_only.py")  # the compile-only path every estimate goes through
    assert all(after[f] != before[f] for f in fams)
    before = after
    after = edit("library/norms/layer_norm_ops.py")  # norms only (a file of the norms package)
    assert after["norms"] != before["norms"] and after["matmul"] == before["matmul"]
    before = after
    after = edit("library/matmul_ops.py")  # matmul, and quantized_matmul (its bf16 comparison row)
    assert after["matmul"] != before["matmul"] and after["quantized_matmul"] != before["quantized_matmul"]
    assert after["norms"] == before["norms"]
    before = after
    after = edit("library/quantized_matmul_ops/w8a16.py")  # a library package's file: its family only
    assert after["quantized_matmul"] != before["quantized_matmul"] and after["matmul"] == before["matmul"]
    before = after
    after = edit("data/autotuning/v6e/tpukernels.rms_norm_fwd.json")  # tuning data: its own family only
    assert after["norms"] != before["norms"] and after["matmul"] == before["matmul"]
    before = after
    cal = core.source_digest("calibration", root)
    after = edit("bench/attention.py")  # attention's cases, which calibration's are built from (its BENCH)
    assert core.source_digest("calibration", root) != cal and after["norms"] == before["norms"]
    before = after
    after = edit("dsl/kernel.py")  # the spine: every family
    assert all(after[f] != before[f] for f in fams)


def _row(op, chip, impl, kind, us, ours_us, figure="estimate", credible=True, reason=None):
    return {"family": "f", "op": op, "shape": "s", "chip": chip, "impl": impl, "kind": kind, "config": "c",
            "flags": [] if credible else ["below"], "error": None, "cycles": 1, "model_us": us,
            "cycles_us": us, "figure": figure, "credible": credible, "roofline_us": 10.0, "bound": "cycles",
            "pct_roofline": 1000.0 / us, "ours_speedup": None if kind == "ours" else us / ours_us, "reason": reason}


def _synthetic(tmp_path):
    rows = [
        _row("a", "v5e", "tpukernels", "ours", 100, 100), _row("a", "v5e", "xla", "xla", 120, 100),
        _row("b", "v6e", "tpukernels", "ours", 100, 100, reason="known cause"), _row("b", "v6e", "xla", "xla", 90, 100),
        _row("c", "v6e", "tpukernels", "ours", 100, 100), _row("c", "v6e", "pub", "public", 50, 100, credible=False),
        _row("d", "v6e", "tpukernels", "ours", 100, 100), _row("d", "v6e", "xla", "xla", 80, 100, figure="floor"),
        # tpukernels itself only has a floor: no ratio is taken against it
        _row("e", "v6e", "tpukernels", "ours", 100, 100, figure="floor"), _row("e", "v6e", "xla", "xla", 90, 100),
        _row("f", "v6e", "tpukernels", "ours", 100, 100, figure="floor"),
        _row("f", "v6e", "pub", "public", 100, 100, figure="floor"),
    ]
    core.save_result(str(tmp_path / "results" / "matmul.json"), "matmul", "model estimate", rows,
                     {"chips": ["v5e", "v6e"], "doc": "Doc :data:`x`."})
    host = [{"what": "dispatch", "kernel": "k", "shapes": [[2, 3]], "torch_op_us": 30.0, "jax_jit_us": 10.0, "jax_compiled_us": 8.0,
             "overhead_us": 20.0},
            {"what": "compile", "kernel": "k", "call": "", "import_s": 1.0, "first_call_cold_s": 2.0,
             "first_call_warm_s": 1.5, "second_call_s": 0.001},
            {"what": "recompiles", "kernel": "k", "varying": "rows", "lengths": [1, 2], "dynamo_frames": 1,
             "kernel_lowerings": 2, "seconds": 0.1}]
    core.save_result(str(tmp_path / "results" / "host.json"), "host", "wall-clock", host)
    return rows


def test_slower_list_excludes_ties_floors_and_non_credible(tmp_path):
    rows = _synthetic(tmp_path)
    s = report.slower(rows)
    assert [(x["op"], x["vs"]) for x in s] == [("b", "xla")]
    assert "known cause" in report.diagnosis(s[0])
    assert [(x["op"], x["vs"]) for x in report.above_floor(rows)] == [("d", "xla")]


def test_render_report_and_readme_summary(tmp_path):
    _synthetic(tmp_path)
    results = core.load_results(str(tmp_path / "results"), ["matmul", "host"])
    out = tmp_path / "BENCHMARKS.md"
    text = report.render(results, str(out), "tpukernels bench --chips v5e,v6e")
    assert out.read_text() == text
    assert "| b | s | v6e | xla | 100.0 (cycles, 10%) | 90.0 (cycles, 11%) | 0.900 | [1] |" in text and "\n1. known cause\n" in text  # reasons as notes
    assert text.index("## Summary") < text.index("## Where tpukernels is slower")
    assert "50.0 (0.50×) †" in text and "≥ 80.0 (floor)" in text and "Doc `x`." in text
    assert "| k | 2x3 | 30.0 | 10.0 | 8.0 | 20.0 |" in text
    png = tmp_path / "benchmarks" / "results" / "matmul.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_BEGIN}\nold\n{report.README_END}\nrest\n")
    summary = report.summary(results, "tpukernels bench")
    assert report.update_readme(str(readme), summary)
    new = readme.read_text()
    assert new.startswith("intro\n") and new.endswith("rest\n") and "old" not in new
    assert "vs xla 0.90–1.20× (1/2 cases at least as fast)" in new and "2 cases with no tpukernels estimate (a floor or no figure)" in new
    assert "vs its floor pub" not in new  # floor vs floor (case f) is no comparison
    assert not report.update_readme(str(tmp_path / "nope.md"), summary)


def test_cli_report_only_and_refusals(tmp_path, capsys):
    from tpukernels.cli import main

    _synthetic(tmp_path)
    res, out = str(tmp_path / "results"), str(tmp_path / "B.md")
    assert main(["bench", "--report-only", "--results-dir", res, "--out", out, "--readme", "",
                 "--json", str(tmp_path / "all.json")]) == 0
    assert "## matmul (model)" in open(out).read()
    assert set(json.load(open(tmp_path / "all.json"))["families"]) == {"matmul", "host"}
    # a second report-only run leaves an unchanged plot untouched (same bytes: no write, mtime kept)
    png = tmp_path / "results" / "matmul.png"
    os.utime(png, ns=(0, 0))
    assert main(["bench", "--report-only", "--results-dir", res, "--out", out, "--readme", ""]) == 0
    assert png.stat().st_mtime_ns == 0
    # with --report-only, --family chooses the families reported
    assert main(["bench", "--report-only", "--family", "host", "--results-dir", res, "--out", out,
                 "--readme", "", "--json", str(tmp_path / "host.json")]) == 0
    assert set(json.load(open(tmp_path / "host.json"))["families"]) == {"host"}
    assert "## matmul (model)" not in open(out).read()
    assert main(["bench", "--report-only", "--family", "norms", "--results-dir", res, "--out", out]) == 2
    assert "no results of norms" in capsys.readouterr().err
    assert main(["bench", "--family", "nope", "--results-dir", res]) == 2
    assert "--family: nope" in capsys.readouterr().err
    data = json.load(open(tmp_path / "results" / "host.json"))
    data["versions"]["jax"] = "0.0.0"
    json.dump(data, open(tmp_path / "results" / "host.json", "w"))
    # a run of another family refuses before estimating anything: the kept host.json would not mix
    assert main(["bench", "--family", "norms", "--results-dir", res, "--out", out]) == 2
    assert "jax 0.0.0" in capsys.readouterr().err


@pytest.mark.aot
def test_real_matmul_case_on_v5e(tmp_path):
    """One real libtpu estimate per implementation (1024^3 matmul on v5e, ~5 s)."""
    pytest.importorskip("libtpu")
    from tpukernels.bench import matmul as bm

    (case,) = [c for c in bm.cases(["v5e"]) if c.shape == "1024x1024x1024"]
    rows = {r["impl"]: r for r in core.run_case(case, Estimator(str(tmp_path / "e.json")))}
    assert set(rows) == {"tpukernels", "xla", "jax matmul"}
    for r in rows.values():
        assert r["figure"] == "estimate" and r["cycles"] > 0 and r["credible"], r
        assert r["model_us"] >= r["roofline_us"] > 0
    assert rows["xla"]["ours_speedup"] == pytest.approx(rows["xla"]["model_us"] / rows["tpukernels"]["model_us"])
    assert "bm=" in rows["tpukernels"]["config"]


def test_host_recompiles_counts_frames_and_lowerings():
    from tpukernels.bench import host

    rows = {r["kernel"]: r for r in host.recompiles()}
    assert all(r["dynamo_frames"] == 1 for r in rows.values())  # one graph for all 8 lengths
    n = len(rows["rms_norm"]["lengths"])
    assert 1 <= rows["rms_norm"]["kernel_lowerings"] < n  # row bucketing shares lowerings
    assert 1 <= rows["flash_attention"]["kernel_lowerings"] <= n


_KERNEL_SRC = '''
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
def body(x_ref, o_ref):
    o_ref[...] = x_ref[...] * SCALE
fn = jax.jit(lambda x: pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
    in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))], out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(x))
'''


def _exported(src: str, filename: str):
    import jax
    import jax.numpy as jnp

    ns: dict = {}
    exec(compile(src, filename, "exec"), ns)
    return jax.export.export(ns["fn"], platforms=["tpu"])(jax.ShapeDtypeStruct((16, 128), jnp.float32))


def test_program_key_ignores_source_locations_only():
    a = _exported(_KERNEL_SRC.replace("SCALE", "2"), "a.py")
    moved = _exported("\n\n\n" + _KERNEL_SRC.replace("SCALE", "2"), "b.py")
    other = _exported(_KERNEL_SRC.replace("SCALE", "3"), "a.py")
    assert bytes(a.serialize()) != bytes(moved.serialize())  # locations are in the bytes...
    assert core.program_key(a) == core.program_key(moved)  # ...but not in the key
    assert core.program_key(a).startswith("t")  # canonicalised (not the byte-hash fallback)
    assert core.program_key(a) != core.program_key(other)
    # the same program built through a deeper call stack (more #loc definitions) has the same key
    deeper = _KERNEL_SRC.replace("SCALE", "2").replace(
        "fn = jax.jit(lambda x: pl.pallas_call(", "def _h2(x):\n    return _h1(x)\ndef _h1(x):\n    return pl.pallas_call(",
    ).replace("(8, 128), lambda i: (i, 0)))(x))", "(8, 128), lambda i: (i, 0)))(x)\nfn = jax.jit(lambda x: _h2(x))")
    assert "_h2" in deeper and core.program_key(_exported(deeper, "c.py")) == core.program_key(a)


def test_tpu_dispatch_runs_the_tpu_path_with_a_no_op_runner():
    """The measurement really goes through run_torch_tpu (plans keyed 'mosaic'), and restores the cpu path."""
    import torch

    from tpukernels.bench import host
    from tpukernels.bench._host_kernels import add
    from tpukernels.targets import cpu as cpu_target

    real = cpu_target.run_torch_cpu
    seen = []
    orig_call = host._NoOpJaxCallable.__call__

    def spy(self, *tensors):
        seen.append(tuple(t.shape) for t in tensors)
        return orig_call(self, *tensors)

    host._NoOpJaxCallable.__call__ = spy
    try:
        rows = host.tpu_dispatch(n=20)
    finally:
        host._NoOpJaxCallable.__call__ = orig_call
    assert len(rows) == 3 and all(r["torch_op_us"] > 0 and r["empty_custom_op_us"] > 0 for r in rows)
    assert seen and cpu_target.run_torch_cpu is real and "torch_tpu" not in __import__("sys").modules
    x = torch.randn(8, 128)
    torch.testing.assert_close(add(x, x), 2 * x)  # the cpu path works again afterwards


def test_a_package_that_edits_the_environment_on_import_leaves_libtpu_flags_alone(tmp_path, monkeypatch):
    """``tpukernels bench`` imports tpu-inference first through ``import_keeping_env``: its ``env_override``
    prepends a libtpu flag to ``LIBTPU_INIT_ARGS`` (and one to ``XLA_FLAGS``), which changed the cache key of every
    later estimate in the process. A stand-in package that does the same is imported; the flags are as before
    (set, and unset), and a package that is not installed answers False."""
    import sys

    from tpukernels._imports import import_keeping_env

    pkg = tmp_path / "envtouch_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os\n"
        "os.environ['LIBTPU_INIT_ARGS'] = '--xla_tpu_use_dynamic_smem_negotiation=true ' + "
        "os.environ.get('LIBTPU_INIT_ARGS', '')\n"
        "os.environ['XLA_FLAGS'] = '--xla_cpu_max_isa=AVX2 ' + os.environ.get('XLA_FLAGS', '')\n"
        "os.environ['OTHER_VAR_SET_BY_IMPORT'] = '1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--my_flag=1")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("OTHER_VAR_SET_BY_IMPORT", raising=False)
    monkeypatch.delitem(sys.modules, "envtouch_pkg", raising=False)
    assert import_keeping_env("envtouch_pkg") is True and "envtouch_pkg" in sys.modules
    assert os.environ["LIBTPU_INIT_ARGS"] == "--my_flag=1" and "XLA_FLAGS" not in os.environ
    assert os.environ["OTHER_VAR_SET_BY_IMPORT"] == "1"  # only the kept flags are restored
    monkeypatch.delenv("OTHER_VAR_SET_BY_IMPORT")
    monkeypatch.delitem(sys.modules, "envtouch_pkg")
    assert import_keeping_env("no_such_package_here_xyz") is False


def test_a_missing_peer_kernel_is_a_typed_error_naming_it_and_its_install():
    """A tpu-inference module that does not import is a BackendUnavailableError naming the kernel and the pip
    requirement (the bench row keeps it as its error), not an ImportError from deep in a family."""
    from tpukernels._imports import TPU_INFERENCE_REQUIREMENT, import_tpu_inference
    from tpukernels.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=rf"megablox gmm .*--no-deps {TPU_INFERENCE_REQUIREMENT}"):
        import_tpu_inference("kernels.no_such_kernel_xyz", "megablox gmm")
    pytest.importorskip("tpu_inference")
    assert import_tpu_inference("kernels.megablox.gmm", "megablox gmm").__name__ == "tpu_inference.kernels.megablox.gmm"
