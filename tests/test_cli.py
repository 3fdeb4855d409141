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
