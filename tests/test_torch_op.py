"""Kernels as torch ops on cpu: correctness in both interpret modes, opcheck, autograd, torch.compile,
bucketing, bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tpukernels as tk
from kernels_for_tests import (_scale_bwd, add_mul, broken, chip_scale, gather_rows, load_example, rowsum_masked,
                               rowsum_unmasked, scale)
from tpukernels.errors import UnwrittenOutputError

softmax = load_example("softmax").softmax
matmul = load_example("matmul").matmul
vector_add = load_example("vector_add").vector_add

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Tolerances: f32 -> accumulation order only; 16-bit -> f32 math then one rounding of the output
# (half an ulp: 2^-9 relative for bf16, 2^-12 for fp16), plus slack for exp/division in f32.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def test_op_is_registered_under_its_namespace():
    assert torch.ops.examples.softmax.default is not None
    assert "config" in str(torch.ops.tktest.scale.default._schema)


@given(rows=st.integers(1, 70), cols=st.sampled_from([1, 7, 128, 300]), dtype=st.sampled_from(DTYPES),
       mode=st.sampled_from(["fast", "tpu"]))
def test_softmax_matches_float64_reference(rows, cols, dtype, mode):
    x = (torch.randn(rows, cols) * 3).to(dtype)
    got = softmax(x, interpret=mode)
    want = torch.softmax(x.double(), dim=-1)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=RTOL[dtype], atol=ATOL[dtype])


@given(n=st.integers(0, 20000), dtype=st.sampled_from(DTYPES), mode=st.sampled_from(["fast", "tpu"]))
def test_vector_add_any_length(n, dtype, mode):
    x, y = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    got = vector_add(x, y, interpret=mode)
    torch.testing.assert_close(got.double(), x.double() + y.double(), rtol=RTOL[dtype], atol=ATOL[dtype])


@given(m=st.integers(1, 150), k=st.integers(0, 700), n=st.integers(1, 300), mode=st.sampled_from(["fast", "tpu"]))
def test_matmul_tails_on_every_axis(m, k, n, mode):
    a, b = torch.randn(m, k), torch.randn(k, n)
    got = matmul(a, b, interpret=mode, config={"bm": 128, "bk": 256, "bn": 128})
    want = a.double() @ b.double()
    # f32 accumulation over <= 700 terms of O(1) products: |err| <~ K * 2^-24 * sum|a||b|
    bound = 4 * max(k, 1) * 2**-24 * (a.double().abs() @ b.double().abs()) + 1e-6
    assert ((got.double() - want).abs() <= bound).all()


def test_tpu_interpret_mode_catches_an_unmasked_tail():
    x = torch.randn(16, 200)  # 200 columns in blocks of 128: the second block reads 56 columns past the end
    want = x.double().sum(1)
    with tk.interpret_mode("tpu"):
        # TPU-faithful interpret mode poisons reads past the array end with NaN; the checked run turns the all-NaN
        # output block into a typed error that points at the fix.
        with pytest.raises(UnwrittenOutputError, match=r"rowsum_unmasked: output 0 .*unmasked partial tail"):
            rowsum_unmasked(x)
        good = rowsum_masked(x)[:, 0]
    torch.testing.assert_close(good.double(), want, rtol=1e-5, atol=1e-5)


def test_multiple_outputs_and_optional_tensor():
    x, y, b = torch.randn(8, 128), torch.randn(8, 128), torch.randn(8, 128)
    s, p = add_mul(x, y)
    torch.testing.assert_close(s, x + y)
    torch.testing.assert_close(p, x * y)
    s2, _ = add_mul(x, y, b)
    torch.testing.assert_close(s2, x + y + b)


@pytest.mark.parametrize("op, args", [
    ("scale", lambda: (torch.randn(37, 128, requires_grad=True), 3.0)),
    ("add_mul", lambda: (torch.randn(8, 128), torch.randn(8, 128), None)),
    ("add_mul", lambda: (torch.randn(8, 128), torch.randn(8, 128), torch.randn(8, 128))),
])
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.tktest, op), args())


def test_opcheck_examples():
    torch.library.opcheck(torch.ops.examples.softmax, (torch.randn(33, 128),))
    torch.library.opcheck(torch.ops.examples.matmul, (torch.randn(16, 256), torch.randn(256, 128)))


def test_default_static_arguments_reach_the_kernel():
    x = torch.randn(16, 128)
    torch.testing.assert_close(scale(x), 2.0 * x)  # alpha defaults to 2.0
    torch.testing.assert_close(torch.ops.tktest.scale(x), 2.0 * x)


def test_backward_matches_float64_autograd():
    x = torch.randn(37, 128, dtype=torch.float32, requires_grad=True)
    g = torch.randn(37, 128)
    (scale(x, 3.0) * g).sum().backward()
    torch.testing.assert_close(x.grad.double(), 3.0 * g.double(), rtol=1e-6, atol=1e-6)


def test_backward_through_a_kernel_without_one_names_def_backward():
    x = torch.randn(16, 128, requires_grad=True)
    y = softmax(x)  # the forward runs (inference without torch.no_grad() is common)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-6)
    with pytest.raises(tk.KernelDefinitionError, match=r"examples::softmax: this kernel has no backward.*"
                                                       r"@softmax.def_backward"):
        y.sum().backward()


def test_double_backward_is_a_typed_error_unless_the_backward_is_declared_differentiable():
    """A double backward used to run the backward's own ops wherever they led (an inner kernel's "no backward"
    KernelDefinitionError, or a term silently dropped); now it is NotSupportedError naming the op, unless the
    kernel declares def_backward(..., double_backward=True), as scale (whose backward is scale) may."""
    x = torch.randn(16, 128, requires_grad=True)
    (gx,) = torch.autograd.grad((scale(x, 3.0) ** 2).sum(), x, create_graph=True)  # 18 x
    torch.testing.assert_close(gx.double(), 18.0 * x.detach().double(), rtol=1e-6, atol=1e-6)
    with pytest.raises(tk.NotSupportedError, match=r"^tktest::scale: double backward is not supported") as e:
        gx.sum().backward()
    assert e.value.op == "tktest::scale" and x.grad is None
    scale.def_backward(_scale_bwd, op="scale", double_backward=True)
    try:
        (gx,) = torch.autograd.grad((scale(x, 3.0) ** 2).sum(), x, create_graph=True)
        gx.sum().backward()
        torch.testing.assert_close(x.grad.double(), torch.full((16, 128), 18.0, dtype=torch.float64))
    finally:
        scale.def_backward(_scale_bwd)


def test_fullgraph_compile_has_no_graph_break():
    fn = torch.compile(lambda x: softmax(x * 2) + 1, fullgraph=True)
    x = torch.randn(20, 128)
    torch.testing.assert_close(fn(x).double(), torch.softmax(2 * x.double(), -1) + 1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", [{"block_rows": 8}, tk.Config(block_rows=8)])
def test_fullgraph_compile_with_a_config_in_the_call(config):
    """``kernel(x, config=...)`` inside the compiled function: the config becomes the op's JSON string while
    Dynamo traces (json's C encoder and Config's attribute lookup did not trace)."""
    fn = torch.compile(lambda x: softmax(x, config=config) * 3, fullgraph=True)
    x = torch.randn(20, 128)
    torch.testing.assert_close(fn(x).double(), 3 * torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-6)
    inside = torch.compile(lambda x: softmax(x, config=tk.Config({"block_rows": 16})), fullgraph=True)
    torch.testing.assert_close(inside(x).double(), torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-6)


def test_interpret_argument_under_fullgraph_compile_names_the_fix():
    x = torch.randn(16, 128)
    with pytest.raises(Exception, match="cannot be traced by torch.compile.*interpret_mode"):
        torch.compile(lambda x: softmax(x, interpret="tpu"), fullgraph=True)(x)
    fn = torch.compile(lambda x: softmax(x) + 1, fullgraph=True)
    with tk.interpret_mode("tpu"):
        torch.testing.assert_close(fn(x).double(), torch.softmax(x.double(), -1) + 1, rtol=1e-5, atol=1e-6)


def test_out_of_bounds_index_in_tpu_interpret_mode_is_a_typed_error():
    table = torch.randn(10, 1, 128)
    good = torch.tensor([3, 0, 9], dtype=torch.int32)
    torch.testing.assert_close(gather_rows(good, table, interpret="tpu"), 2 * table[good.long()])
    with pytest.raises(tk.KernelRuntimeError, match=r"tktest::gather_rows: Out-of-bounds block index \(10, 0, 0\)"):
        gather_rows(torch.tensor([3, 10], dtype=torch.int32), table, interpret="tpu")
    torch.testing.assert_close(gather_rows(good, table, interpret="tpu"), 2 * table[good.long()])  # still usable


def test_dynamic_compile_does_not_recompile_within_a_bucket():
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda x: scale(x, 0.5) + 1, fullgraph=True, dynamic=True, backend=counter)
    before = len(scale._entries)
    for n in range(1025, 1033):  # 8 leading sizes, all in bucket 1280
        x = torch.randn(n, 128)
        torch.testing.assert_close(fn(x), 0.5 * x + 1)
    assert counter.frame_count == 1, "dynamo recompiled the graph"
    assert len(scale._entries) - before == 1, "the kernel was lowered more than once for one bucket"


def test_zero_size_inputs_return_empty_or_zero_results():
    assert softmax(torch.zeros(0, 128)).shape == (0, 128)
    out = matmul(torch.randn(8, 0), torch.randn(0, 128))
    assert out.shape == (8, 128) and bool((out == 0).all())
    assert vector_add(torch.zeros(0), torch.zeros(0)).shape == (0,)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(128, 64).t(),  # transposed
    lambda: torch.randn(40, 256)[:, ::2],  # strided
    lambda: torch.randn(50, 128)[5:45],  # sliced with an offset
])
def test_non_contiguous_inputs_give_contiguous_results_and_are_not_modified(make):
    x = make()
    before = x.clone()
    got = softmax(x)
    torch.testing.assert_close(got, softmax(x.contiguous()))
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype, match", [(torch.float64, "TPUs have no float64"), (torch.int64, "cast to int32")])
def test_unsupported_dtypes_are_rejected_before_lowering(dtype, match):
    with pytest.raises(tk.DTypeError, match=f"argument 'x'.*{match}"):
        softmax(torch.zeros(8, 128, dtype=dtype))


def test_rank_and_shape_errors_name_the_argument():
    with pytest.raises(tk.ArgumentError, match="x must be 2-D"):
        softmax(torch.zeros(2, 3, 4))
    with pytest.raises(tk.ArgumentError, match=r"b has shape \(8, 16\), but shapes= declares b: 'K N' and K=16 from a"):
        matmul(torch.zeros(8, 16), torch.zeros(8, 16))
    with pytest.raises(tk.ArgumentError, match="must be a tensor"):
        softmax([1.0, 2.0])


def test_kernel_body_error_is_typed_and_names_the_body():
    with pytest.raises(tk.KernelBodyError, match="kernel body '_broken_body' raised RuntimeError: deliberate bug"):
        broken(torch.zeros(8, 128))


def test_unsupported_device_is_a_device_error():
    from tpukernels.targets.dispatch import run_torch

    # No GPU here: a tensor subclass that reports a cuda device stands in for one.
    with pytest.raises(tk.DeviceError, match="'cuda' are not supported"):
        run_torch(scale, [_with_device(torch.zeros(1), "cuda"), 2.0], None)


def _with_device(t, kind):
    class T(torch.Tensor):
        @property
        def device(self):
            return type("D", (), {"type": kind})()

    return t.as_subclass(T)


def test_explicit_config_unknown_tunable_is_a_config_error():
    with pytest.raises(tk.ConfigError, match="unknown tunable 'bq'"):
        softmax(torch.zeros(8, 128), config={"bq": 8})


def test_results_are_bitwise_repeatable():
    a, b = torch.randn(100, 300), torch.randn(300, 200)
    assert torch.equal(matmul(a, b), matmul(a, b))


def test_jax_arrays_run_directly():
    import jax.numpy as jnp

    x = jnp.asarray(np.random.default_rng(0).standard_normal((10, 128)), jnp.float32)
    got = softmax(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(torch.softmax(torch.from_numpy(np.array(x)).double(), -1)),
                               rtol=1e-5, atol=1e-6)


def test_cpu_calls_follow_a_changed_target_chip(monkeypatch):
    """A cpu call's cached plan is per ``TPUKERNELS_TARGET_CHIP``: launches that plan per chip (VMEM caps, MXU
    widths, the tuning DB's chip) were reused for the next chip set in the same process."""
    x = torch.arange(8 * 128, dtype=torch.float32).reshape(8, 128)
    monkeypatch.delenv("TPUKERNELS_TARGET_CHIP", raising=False)
    torch.testing.assert_close(chip_scale(x), x, atol=0, rtol=0)
    for chip, cols in (("v5e", 128), ("v6e", 256), ("v5e", 128)):
        monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", chip)
        torch.testing.assert_close(chip_scale(x), x * cols, atol=0, rtol=0)
