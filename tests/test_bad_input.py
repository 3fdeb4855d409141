"""A bad-input sweep over the public ops: mixed devices (``meta`` beside cpu), wrong dtype, wrong rank,
mismatched shapes, bad config / static values -> a typed error naming the argument, raised before any kernel
runs, with the caller's tensors unchanged; non-contiguous, zero-size and NaN inputs -> the right answer.
Plus the messages of issue 31 item 5 (Python-int num_seqs, --import placement, install hints, bare
``constraints=``, libtpu failures, io_callback tracebacks)."""

from __future__ import annotations

import logging

import pytest
import torch

import tpukernels as tk
from tpukernels import library as L
from tpukernels.errors import ArgumentError, ConfigError, DeviceError, DTypeError, KernelDefinitionError

BF = torch.bfloat16


def r(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def _paged(nseq=2):
    q, kv = r(16, 4, 128, seed=1), r(8, 8, 4, 128, seed=2)
    kv_lens = torch.tensor([16, 16], dtype=torch.int32)
    pages = (torch.arange(nseq * 4, dtype=torch.int32) % 8).reshape(nseq, 4)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    return [q, kv, kv_lens, pages, cu, torch.tensor([nseq], dtype=torch.int32)]


def _qw():
    return L.quantize_weight(r(128, 256, seed=3))


# (op call taking the list of tensors, tensors, expected error, message regex naming the argument)
CASES = {
    "matmul/meta": (lambda a, b: L.matmul(a, b), [r(8, 128), r(128, 128).to("meta")], DeviceError, r"b on meta"),
    "matmul/float64": (lambda a, b: L.matmul(a, b), [r(8, 128, dtype=torch.float64)] * 2, DTypeError, r"\ba dtype float64"),
    "matmul/rank1": (lambda a, b: L.matmul(a, b), [r(128), r(128, 128)], ArgumentError, r"\ba must have rank >= 2"),
    "matmul/K-mismatch": (lambda a, b: L.matmul(a, b), [r(8, 128), r(64, 128)], ArgumentError, r"K = 128"),
    "matmul/out_dtype": (lambda a, b: L.matmul(a, b, out_dtype="int8"), [r(8, 128), r(128, 128)], DTypeError, r"out_dtype"),
    "rms_norm/meta": (lambda x, w: L.rms_norm(x, w), [r(8, 128), r(128).to("meta")], DeviceError, r"weight is on meta"),
    "rms_norm/int": (lambda x: L.rms_norm(x), [torch.ones(8, 128, dtype=torch.int32)], DTypeError, r"\bx dtype"),
    "rms_norm/rank0": (lambda x: L.rms_norm(x), [torch.tensor(1.0)], ArgumentError, r"\bx must have"),
    "rms_norm/weight": (lambda x, w: L.rms_norm(x, w), [r(8, 128), r(64)], ArgumentError, r"weight must have shape"),
    "rms_norm/eps-str": (lambda x: L.rms_norm(x, eps="1e-6"), [r(8, 128)], ArgumentError, r"eps"),
    "rms_norm/eps-neg": (lambda x: L.rms_norm(x, eps=-1.0), [r(8, 128)], ArgumentError, r"eps"),
    "layer_norm/bias": (lambda x, w, b: L.layer_norm(x, w, b), [r(8, 128), r(128), r(64)], ArgumentError, r"bias"),
    "fused_add_rms_norm/residual": (lambda x, res: L.fused_add_rms_norm(x, res), [r(8, 128), r(8, 64)], ArgumentError,
                                    r"residual"),
    "flash_attention/meta": (lambda q, k, v: L.flash_attention(q, k, v), [r(1, 2, 128, 128)] * 2 + [r(1, 2, 128, 128).to("meta")],
                             DeviceError, r"v on meta"),
    "flash_attention/rank3": (lambda q, k, v: L.flash_attention(q, k, v), [r(2, 128, 128)] * 3, ArgumentError, r"\bq must have rank 4"),
    "flash_attention/float64": (lambda q, k, v: L.flash_attention(q, k, v), [r(1, 2, 128, 128, dtype=torch.float64)] * 3,
                                DTypeError, r"'q'"),
    "flash_attention/head-dim": (lambda q, k, v: L.flash_attention(q, k, v), [r(1, 2, 128, 128), r(1, 2, 128, 64), r(1, 2, 128, 64)],
                                 ArgumentError, r"\bk head dim"),
    "flash_attention/causal-str": (lambda q, k, v: L.flash_attention(q, k, v, causal="yes"), [r(1, 2, 128, 128)] * 3,
                                   ArgumentError, r"causal"),
    "flash_attention/window-str": (lambda q, k, v: L.flash_attention(q, k, v, window=("a", None)), [r(1, 2, 128, 128)] * 3,
                                   ArgumentError, r"window\[0\]"),
    "flash_attention/block-neg": (lambda q, k, v: L.flash_attention(q, k, v, config={"block_q": -128}), [r(1, 2, 128, 128)] * 3,
                                  ConfigError, r"block_q"),
    "flash_attention/block-zero": (lambda q, k, v: L.flash_attention(q, k, v, config={"block_q": 0}), [r(1, 2, 128, 128)] * 3,
                                   ConfigError, r"block_q"),
    "flash_attention/block-float": (lambda q, k, v: L.flash_attention(q, k, v, config={"block_q": 128.0}), [r(1, 2, 128, 128)] * 3,
                                    ConfigError, r"block_q"),
    "flash_attention/block-str": (lambda q, k, v: L.flash_attention(q, k, v, config={"block_q": "128"}), [r(1, 2, 128, 128)] * 3,
                                  ConfigError, r"block_q"),
    "quantized_matmul/w_scale-1xN": (lambda x, q, s: L.quantized_matmul(x, q, s.reshape(1, -1)), [r(8, 256, dtype=BF), *_qw()],
                                     ArgumentError, r"w_scale must have shape \(N,\)"),
    "quantized_matmul/w_q-float": (lambda x, q, s: L.quantized_matmul(x, q.float(), s), [r(8, 256, dtype=BF), *_qw()],
                                   DTypeError, r"w_q dtype"),
    "quantized_matmul/meta": (lambda x, q, s: L.quantized_matmul(x, q.to("meta"), s.to("meta")), [r(8, 256, dtype=BF), *_qw()],
                              DeviceError, r"device"),
    "grouped_matmul/int64-sizes": (lambda a, b, g: L.grouped_matmul(a, b, g), [r(16, 128, dtype=BF), r(2, 128, 128, dtype=BF),
                                   torch.tensor([8, 8])], DTypeError, r"group_sizes must be int32"),
    "grouped_matmul/sum": (lambda a, b, g: L.grouped_matmul(a, b, g), [r(16, 128, dtype=BF), r(2, 128, 128, dtype=BF),
                           torch.tensor([8, 9], dtype=torch.int32)], ArgumentError, r"sum\(group_sizes\)"),
    "grouped_matmul/negative": (lambda a, b, g: L.grouped_matmul(a, b, g), [r(16, 128, dtype=BF), r(2, 128, 128, dtype=BF),
                                torch.tensor([-8, 24], dtype=torch.int32)], ArgumentError, r"group_sizes\[0\] = -8"),
    "linear_cross_entropy/labels-float": (lambda h, w, y: L.linear_cross_entropy(h, w, y), [r(8, 128), r(256, 128), torch.zeros(8)],
                                          DTypeError, r"labels"),
    "linear_cross_entropy/H": (lambda h, w, y: L.linear_cross_entropy(h, w, y), [r(8, 128), r(256, 64),
                               torch.zeros(8, dtype=torch.long)], ArgumentError, r"\bW \(256, 64\)"),
    "linear_cross_entropy/reduction": (lambda h, w, y: L.linear_cross_entropy(h, w, y, reduction="avg"),
                                       [r(8, 128), r(256, 128), torch.zeros(8, dtype=torch.long)], ArgumentError, r"reduction"),
    "ragged_paged_attention/int64-meta": (lambda *a: L.ragged_paged_attention(a[0], a[1], a[2].long(), *a[3:]), _paged(),
                                          DTypeError, r"kv_lens must be int32"),
    "ragged_paged_attention/meta": (lambda *a: L.ragged_paged_attention(a[0].to("meta"), *a[1:]), _paged(),
                                    DeviceError, r"device"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_a_typed_error_naming_the_argument(case):
    fn, tensors, err, pattern = CASES[case]
    before = [t.clone() if t.device.type != "meta" else t for t in tensors]
    with pytest.raises(err, match=pattern):
        fn(*tensors)
    for t, t0 in zip(tensors, before):
        if t.device.type != "meta":
            assert torch.equal(t, t0), f"{case}: an input changed"


def test_non_contiguous_zero_size_and_nan_inputs_give_the_right_answer():
    a, b = r(64, 128, seed=5), r(256, 128, seed=6)
    bt = b.t()  # non-contiguous [K, N]
    torch.testing.assert_close(L.matmul(a, bt).double(), a.double() @ bt.double(), rtol=1e-5, atol=1e-4)
    x = r(16, 256, seed=7)[:, ::2]  # non-contiguous rows
    ref = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(L.rms_norm(x).double(), ref, rtol=1e-5, atol=1e-5)
    assert L.rms_norm(torch.empty(0, 128)).shape == (0, 128)
    assert L.matmul(torch.empty(0, 128), r(128, 128)).shape == (0, 128)
    y = r(16, 128, seed=8)
    y[3, 5] = float("nan")
    out = L.rms_norm(y)
    assert out[3].isnan().all() and not out[torch.arange(16) != 3].isnan().any()


def test_num_seqs_as_a_python_int_is_the_tensor_it_means():
    args = _paged()
    want = L.ragged_paged_attention(*args)
    got = L.ragged_paged_attention(*args[:5], 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- messages
def test_import_works_before_and_after_the_subcommand(tmp_path, capsys):
    from tpukernels.cli import hoist_imports, main

    f = tmp_path / "my_kernels_iss31.py"
    f.write_text(
        "import torch, tpukernels as tk\nfrom jax.experimental import pallas as pl\n"
        "def _b(x_ref, o_ref):\n    o_ref[...] = x_ref[...]\n"
        "@tk.tpu_kernel(_b, name='iss31_copy', namespace='iss31cli')\n"
        "def iss31_copy(x: torch.Tensor) -> torch.Tensor:\n"
        "    s = pl.BlockSpec(tuple(x.shape), lambda: (0, 0))\n"
        "    return tk.Launch(grid=(), in_specs=[s], out_specs=s, out_shape=tk.like(x))\n")
    assert hoist_imports(["list", "--import", "a.py", "--json"]) == ["--import", "a.py", "list", "--json"]
    assert hoist_imports(["list", "--import=a.py"]) == ["--import=a.py", "list"]
    for argv in (["--import", str(f), "list", "--json"], ["list", "--json", "--import", str(f)]):
        assert main(argv) == 0
        assert "iss31cli::iss31_copy" in capsys.readouterr().out


def test_install_hints_work_without_a_package_index():
    from tpukernels.targets.compile_only import AOT_HINT
    from tpukernels.targets.tpu import INSTALL_HINT

    for hint, extra in ((AOT_HINT, "aot"), (INSTALL_HINT, "tpu")):
        assert f"pip install -e '.[{extra}]'" in hint and f".whl[{extra}]" in hint
        assert f"pip install 'tpukernels[{extra}]'" not in hint


def test_constraints_given_a_bare_callable():
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref, *, b):
        o_ref[...] = x_ref[...]

    def launch(x: torch.Tensor, *, b: int) -> torch.Tensor:
        s = pl.BlockSpec((b, 128), lambda i: (i, 0))
        return tk.Launch(grid=(tk.cdiv(x.shape[0], b),), in_specs=[s], out_specs=s, out_shape=tk.like(x))

    from tpukernels.dsl import TpuKernel

    k = TpuKernel(body, launch, name="iss31_bare_constraint", namespace="tktest_bad", register=False,
                  tunables={"b": tk.Tunable([8, 16])}, constraints=lambda c: c["b"] != 16 or "b=16 is banned")
    with pytest.raises(ConfigError, match="b=16 is banned"):
        k.space.complete({"b": 16})
    with pytest.raises(KernelDefinitionError, match="constraints="):
        TpuKernel(body, launch, name="iss31_bad_constraint", register=False,
                         tunables={"b": tk.Tunable([8, 16])}, constraints=[42])


def test_libtpu_failures_are_worded_with_the_chip_and_a_hint():
    from tpukernels.chips import get_chip
    from tpukernels.targets.compile_only import translate_error

    e = RuntimeError("INTERNAL: Mosaic failed to compile TPU kernel\n"
                     "F1203 10:00:00.123456   12345 layout.cc:77] Check failed: idx < size index_map out of range")
    kind, msg = translate_error(e, get_chip("v6e"), 32 << 20)
    assert kind == "compile" and "libtpu's compiler failed on v6e" in msg and "interpret='tpu'" in msg
    assert "F1203" not in msg and "index_map out of range" in msg  # the index-map line, not truncated away


def test_interpreter_oob_reports_no_io_callback_traceback(caplog):
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import kernels_for_tests as K

    idx = torch.tensor([0, 5, 1], dtype=torch.int32)
    from tpukernels.errors import KernelRuntimeError

    with caplog.at_level(logging.ERROR), pytest.raises(KernelRuntimeError, match="gather_rows: Out-of-bounds"):
        K.gather_rows(idx, r(4, 1, 128), interpret="tpu")
    assert not [rec for rec in caplog.records if "io_callback failed" in rec.getMessage()]
