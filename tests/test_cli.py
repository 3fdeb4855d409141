"""The tpukernels command line (run in-process through main())."""

import json
import os

import pytest

from tpukernels.cli import main

EX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "list" in out and "compile" in out and "demo" in out


def test_list_json_includes_imported_kernels(capsys):
    assert main(["--import", os.path.join(EX, "softmax.py"), "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    sm = next(r for r in rows if r["kernel"] == "examples::softmax")
    assert "block_rows" in sm["tunables"] and sm["signature"] == "x:Tensor"


@pytest.mark.aot
def test_compile_table_and_json(capsys):
    args = ["--import", os.path.join(EX, "matmul.py"), "compile", "examples::matmul",
            "--shape", "512x512:bf16", "--shape", "512x512:bf16", "--chips", "v5e,tpu7x"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "v5e" in out and "tpu7x" in out and "ok" in out
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["chip"] for r in res] == ["v5e", "tpu7x"] and all(r["ok"] for r in res)


@pytest.mark.aot
def test_compile_failure_exits_nonzero_with_reason(capsys):
    args = ["--import", os.path.join(EX, "matmul.py"), "compile", "examples::matmul", "--shape", "1024x4096:bf16",
            "--shape", "4096x2048:bf16", "--chips", "v5e", "--config", "bm=1024,bn=1024,bk=1024"]
    assert main(args) == 1
    assert "VMEM overflow" in capsys.readouterr().out


def test_unknown_kernel_and_chip_are_clean_errors(capsys):
    assert main(["compile", "nope", "--shape", "8x128:f32"]) == 2
    assert "is not a registered kernel" in capsys.readouterr().err
    assert main(["--import", os.path.join(EX, "softmax.py"), "compile", "examples::softmax", "--shape", "8x128:f32",
                 "--chips", "v99"]) == 2
    assert "unknown TPU chip 'v99'" in capsys.readouterr().err


@pytest.mark.aot
def test_compile_a_public_name_compiles_the_kernels_it_calls(capsys):
    assert main(["compile", "tpukernels::matmul", "--shape", "512x256:bf16", "--shape", "256x384:bf16", "--chips", "v5e",
                 "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["kernel"] == "tpukernels::matmul_nn" and r["ok"] and r["chip"] == "v5e"


def test_a_library_kernel_exported_by_name_is_not_ambiguous():
    """``tpukernels.library.matmul_nn`` is the registered kernel itself: one match (was 'ambiguous')."""
    from tpukernels.cli import find_kernel
    from tpukernels.errors import ArgumentError
    from tpukernels.library import matmul as mm_module  # noqa: F401  (registers the kernels)
    import tpukernels.library as L

    for name in ("matmul_nn", "grouped_matmul_fwd", "grouped_matmul_tgmm"):
        assert find_kernel(name, public=True) is getattr(L, name)
    from tpukernels.dsl import REGISTRY

    if not any(q.split("::")[1] == "matmul" for q in REGISTRY):  # another test may have loaded examples::matmul
        assert find_kernel("matmul", public=True) is L.matmul  # the public function: no kernel has that name
    with pytest.raises(ArgumentError, match="ambiguous"):  # a user kernel and the library function share a name
        find_kernel("matmul", imports=[os.path.join(EX, "matmul.py")], public=True)


@pytest.mark.aot
def test_compile_for_accepts_public_functions_and_torch_ops():
    import torch

    import tpukernels as tk
    import tpukernels.library as L

    r = tk.compile_for(L.flash_attention, "v6e", "1x4x256x128:bf16", "1x2x256x128:bf16", "1x2x256x128:bf16",
                       causal=True, with_mlir=False)
    assert r.kernel == "tpukernels::flash_attention_fwd" and r.ok
    r = tk.compile_for(torch.ops.tpukernels.rms_norm, "v5e", "2x100x1024:bf16", "1024:bf16", with_mlir=False)
    assert r.kernel == "tpukernels::rms_norm_fwd" and r.ok and r.shapes[0] == "224x1024:bfloat16"  # 200 rows, bucketed
    with pytest.raises(tk.ArgumentError, match="called no tpukernels kernel"):
        tk.compile_for(lambda x: x + 1, "v5e", "8x128:f32")
    # string options of a public function stay strings (x_quant="int8" was parsed as a shape)
    r = tk.compile_for(L.quantized_matmul, "v5e", "64x256:bf16", "128x256:i8", "128:f32", x_quant="int8",
                       with_mlir=False)
    assert r.kernel == "tpukernels::quantized_matmul_w8a8_kernel" and r.ok
    from tpukernels.targets.compile_only import kernel_calls

    ((kernel, pos, kw, _),) = kernel_calls(L.matmul, ("256x256:bf16", "256x256:bf16"), {"activation": "silu"})
    bound = dict(zip([p.name for p in kernel.params], [*pos, *kw.values()]))
    assert kernel.name == "matmul_nn" and bound["activation"] == "silu"


@pytest.mark.aot
def test_cli_statics_are_typed_by_annotation(capsys):
    base = ["compile", "rms_norm_fwd", "--shape", "1024x4096:bf16", "--shape", "1x4096:bf16", "--chips", "v6e"]
    assert main(base + ["--static", "eps=1e-6,offset=0.0,casting=llama,round_f16=false", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["ok"] and r["vmem_estimate_bytes"] < 16 << 20  # round_f16=false really is False (no f32 widening)
    assert main(base + ["--static", "round_f16=maybe"]) == 2
    assert "takes bool" in capsys.readouterr().err
    assert main(base + ["--static", "epsilon=1"]) == 2
    assert "statics are weight" not in capsys.readouterr().err  # lists statics, not tensors


def test_cli_missing_statics_are_listed_at_once(capsys):
    assert main(["compile", "rms_norm_fwd", "--shape", "1024x4096:bf16", "--chips", "v6e"]) == 2
    err = capsys.readouterr().err
    assert "'eps', 'offset', 'casting', 'round_f16'" in err


def test_cli_import_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "badkernels.py"
    bad.write_text("x = 1\nimport nonexistent_module_for_tpukernels_test\n")
    assert main(["--import", str(bad), "list"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ModuleNotFoundError" in err and "badkernels.py:2" in err


def test_bench_writes_nothing_in_the_current_directory_by_default(tmp_path, tmp_cache, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["bench", "--report-only"]) == 2  # nothing to report yet
    assert "no results" in capsys.readouterr().err
    assert list(work.iterdir()) == [] and (tmp_cache / "bench" / "results").is_dir()


def test_table_piped_output_keeps_one_line_per_row(monkeypatch):
    """A table wider than a terminal prints as expanded blocks on a terminal, but piped output (not a TTY,
    no $COLUMNS) keeps one line per row so that ``| grep`` and files see whole rows."""
    import io

    from tpukernels.cli import table

    rows = [["tpukernels::kernel_%d" % i, "x" * 150, i] for i in range(3)]
    header = ["kernel", "signature", "n"]
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr("sys.stdout", io.StringIO())  # not a TTY
    piped = table(rows, header).splitlines()
    assert len(piped) == 2 + len(rows) and piped[2].startswith("tpukernels::kernel_0") and piped[2].endswith("0")
    narrow = table(rows, header, width=80)
    assert "-[ 1 ]" in narrow and len(narrow.splitlines()) > len(piped)
    monkeypatch.setenv("COLUMNS", "80")
    assert table(rows, header) == narrow
