"""Tests of the matmul library (tpukernels.library.matmul, issue 5).

Accuracy criterion (every numeric test): the kernel's error against a float64 product of the *same*
low-precision inputs must stay within 1.2x of the error of an ideal kernel that accumulates in float32
and rounds once to the output dtype (``torch.matmul`` on float32 copies, then ``.to(out_dtype)``):

* normwise (RMS over all elements), for every dtype;
* elementwise maximum as well for 16-bit outputs, where the final rounding dominates both errors.
  For float32 outputs two valid f32 summation orders differ elementwise by up to ~1.3x (measured over
  random shapes: max-abs ratio up to 1.27, RMS ratio <= 1.02), so there only the RMS criterion applies.

Both criteria get an absolute slack of one float32 unit (2^-24) times the RMS of ``|a| @ |b|``: the
scale of a single reordered f32 addition, negligible next to a 16-bit rounding (2^-9) and what lets
K = 1..3 f32 products (where FMA vs separate rounding decides) pass. ``test_bf16_accumulator_breaks_bound``
shows the criterion is sharp: the same kernel with a bfloat16 accumulator (rounding per K tile) fails it.

Gradients: float32 operands, compared with float64 autograd of the reference; tolerance 2e-5 relative
to the largest reference gradient (f32 accumulation over <= 1e3 terms: ~sqrt(1e3) * 6e-8 = 2e-6, x10).
"""

from __future__ import annotations

import importlib
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tpukernels as tk
import tpukernels.library  # noqa: F401  (registers torch.ops.tpukernels.matmul*)
from tpukernels.autotune import db
from tpukernels.errors import ArgumentError, DTypeError

mm = importlib.import_module("tpukernels.library.matmul_ops")
OPS = torch.ops.tpukernels
U32 = 2.0**-24
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMALL = dict(bm=128, bk=128, bn=128)  # many grid steps and tails in every dim for sizes > 128


# ----------------------------------------------------------------------------------------------- helpers
def rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item() if x.numel() else 0.0


def ideal(a, b, bias=None, activation=None, out_dtype=None):
    """f32 accumulation, bias and activation in f32, one rounding to the output dtype."""
    z = torch.matmul(a.float(), b.float())
    if bias is not None:
        z = z + bias.float()
    return mm.activation_torch(z, activation).to(out_dtype or a.dtype)


def assert_within_bound(out, a, b, bias=None, activation=None, out_dtype=None, factor=1.2):
    """The accuracy criterion of the module docstring; returns (kernel RMS error, ideal RMS error)."""
    odt = out_dtype or a.dtype
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    assert out.dtype == odt and out.shape == shape
    ref = mm.reference(a, b, bias, activation)
    idl = ideal(a, b, bias, activation, odt)
    assert torch.isfinite(out).all() == torch.isfinite(ref).all()
    slack = U32 * rms(torch.matmul(a.double().abs(), b.double().abs()))
    ek, ei = rms(out.double() - ref), rms(idl.double() - ref)
    assert ek <= factor * ei + slack, f"RMS error {ek:.3e} > {factor} x {ei:.3e} (+{slack:.1e})"
    if odt != torch.float32 and out.numel():
        mk, mi = (out.double() - ref).abs().max().item(), (idl.double() - ref).abs().max().item()
        assert mk <= factor * mi + slack, f"max error {mk:.3e} > {factor} x {mi:.3e} (+{slack:.1e})"
    return ek, ei


def randn(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


# ----------------------------------------------------------------------------------------------- forward accuracy
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mkn", [(1000, 999, 1001), (129, 257, 383), (7, 1025, 130), (1, 1, 1)], ids=str)
def test_odd_shapes_within_bound(mkn, dtype):
    M, K, N = mkn
    g = torch.Generator().manual_seed(M + K + N)
    a, b = randn(M, K, dtype=dtype, gen=g), randn(K, N, dtype=dtype, gen=g)
    bias = randn(N, dtype=dtype, gen=g)
    if dtype != torch.float16:  # the kernel op itself, with small blocks: tails in M, N and K
        cfg = SMALL if M * N * K < 1e8 else dict(bm=256, bk=256, bn=512)  # 1000^3: 32 steps, tails everywhere
        out = OPS.matmul_nn(a[None], b[None], bias.reshape(1, N), "silu", None, False, config=json.dumps(cfg))
        assert_within_bound(out[0], a, b, bias, "silu")
    assert_within_bound(mm.matmul(a, b, bias, "silu"), a, b, bias, "silu")


@pytest.mark.parametrize("activation", mm.ACTIVATIONS)
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_bias_activation_out_dtype(activation, out_dtype):
    g = torch.Generator().manual_seed(1)
    a, b = randn(3, 37, 300, dtype=torch.bfloat16, gen=g), randn(300, 140, dtype=torch.bfloat16, gen=g)
    bias = randn(140, gen=g)
    out = mm.matmul(a, b, bias, activation, out_dtype)
    assert_within_bound(out, a, b, bias, activation, out_dtype)


def test_bf16_accumulator_breaks_bound():
    """The criterion is sharp: rounding the accumulator to bf16 after every K tile violates it."""
    import jax.numpy as jnp

    def launch(a: torch.Tensor, b: torch.Tensor, *, bm: int, bk: int, bn: int) -> torch.Tensor:
        return mm.make_launch("nn", a, b, None, None, None, False, bm, bk, bn, acc_dtype=jnp.bfloat16)

    broken = tk.tpu_kernel(mm._matmul_body, name="matmul_bf16_acc", namespace="tpukernels_test",
                           tunables=mm.TUNABLES)(launch)
    g = torch.Generator().manual_seed(2)
    a, b = randn(64, 2048, dtype=torch.bfloat16, gen=g), randn(2048, 256, dtype=torch.bfloat16, gen=g)
    good = OPS.matmul_nn(a[None], b[None], config=json.dumps(SMALL))[0]
    bad = broken(a[None], b[None], config=SMALL)[0]
    ek, ei = assert_within_bound(good, a, b)
    with pytest.raises(AssertionError, match="RMS error"):
        assert_within_bound(bad, a, b)
    assert rms(bad.double() - mm.reference(a, b)) > 2 * ei  # 16 K tiles of 128: measured 2.9x the ideal error


def test_functional_api_is_the_op():
    import tpukernels.library as lib

    assert lib.matmul is mm.matmul and callable(lib.matmul)
    a, w = torch.randn(5, 130), torch.randn(7, 130)
    assert torch.equal(lib.matmul(a, w.t(), out_dtype=torch.bfloat16), OPS.matmul(a, w.t(), None, None, "bfloat16"))


def test_deterministic_bitwise():
    g = torch.Generator().manual_seed(3)
    a, w = randn(300, 515, dtype=torch.bfloat16, gen=g), randn(260, 515, dtype=torch.bfloat16, gen=g)
    outs = [mm.matmul(a, w.t(), activation="gelu_tanh") for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


# ----------------------------------------------------------------------------------------------- layouts
def test_linear_weight_is_read_in_place():
    """``b = W.t()`` of a contiguous [N, K] weight goes to matmul_nt with W itself (no copy)."""
    w = torch.randn(257, 383)
    x = torch.randn(2, 5, 383)
    layout, xa, yb, folded = mm.plan(x, w.t())
    assert layout == "nt" and folded and yb.data_ptr() == w.data_ptr() and yb.is_contiguous()
    assert xa.data_ptr() == x.data_ptr() and tuple(xa.shape) == (1, 10, 383)
    layout, xa, yb, _ = mm.plan(x.transpose(-1, -2).contiguous().transpose(-1, -2)[0], torch.randn(383, 257))
    assert layout == "tn" and xa.is_contiguous()
    wb = torch.randn(383, 257)
    layout, _, yb, _ = mm.plan(torch.randn(4, 5, 383), wb.expand(4, 383, 257))  # stride-0 batch: read once
    assert layout == "nn" and yb.shape[0] == 1 and yb.data_ptr() == wb.data_ptr()


def _make_operand(kind, batch, rows, cols, dtype, g):
    """An operand with logical shape batch + (rows, cols) in the memory layout ``kind``."""
    if kind == "row":
        return randn(*batch, rows, cols, dtype=dtype, gen=g)
    if kind == "col":
        return randn(*batch, cols, rows, dtype=dtype, gen=g).transpose(-1, -2)
    if kind == "sliced":
        return randn(*batch, rows + 3, 2 * cols, dtype=dtype, gen=g)[..., 1:rows + 1, ::2]
    if kind == "bcast":  # stride-0 batch dims
        return randn(rows, cols, dtype=dtype, gen=g).expand(*batch, rows, cols)
    raise AssertionError(kind)


dims = st.integers(0, 260)
layouts = st.sampled_from(["row", "col", "sliced", "bcast"])
batches = st.sampled_from([((), ()), ((2,), ()), ((), (3,)), ((2, 1), (1, 3)), ((2,), (2,))])


@given(M=dims, K=dims, N=dims, dtype=st.sampled_from(DTYPES), la=layouts, lb=layouts, batch=batches,
       bias=st.booleans(), activation=st.sampled_from(mm.ACTIVATIONS), seed=st.integers(0, 2**16))
def test_property_shapes_layouts(M, K, N, dtype, la, lb, batch, bias, activation, seed):
    g = torch.Generator().manual_seed(seed)
    a = _make_operand(la, batch[0], M, K, dtype, g)
    b = _make_operand(lb, batch[1], K, N, dtype, g)
    bias_t = randn(N, dtype=dtype, gen=g) if bias else None
    before = [t.clone() for t in (a, b)]
    versions = [a._version, b._version]
    out = OPS.matmul(a, b, bias_t, activation, None)
    assert_within_bound(out, a, b, bias_t, activation)
    assert torch.equal(a, before[0]) and torch.equal(b, before[1]) and [a._version, b._version] == versions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_k_zero_and_empty(dtype):
    a, b = torch.randn(4, 5, 0).to(dtype), torch.randn(0, 140).to(dtype)
    out = mm.matmul(a, b)
    assert out.shape == (4, 5, 140) and out.dtype == dtype and not out.any()
    bias = torch.randn(140)
    out = mm.matmul(a, b, bias, "gelu_tanh")
    expect = mm.activation_torch(bias.double(), "gelu_tanh").expand(4, 5, 140)
    torch.testing.assert_close(out.double(), expect, rtol=2**-8, atol=0)  # one rounding to dtype
    assert mm.matmul(torch.randn(0, 7).to(dtype), torch.randn(7, 9).to(dtype)).shape == (0, 9)
    assert mm.matmul(torch.randn(6, 7).to(dtype), torch.randn(7, 0).to(dtype)).shape == (6, 0)
    assert mm.matmul(torch.randn(0, 3, 7).to(dtype), torch.randn(7, 9).to(dtype)).shape == (0, 3, 9)
    with pytest.raises(ArgumentError, match="K = 0 with a bias"):
        OPS.matmul_nn(a[:1], b[None], torch.zeros(1, 140, dtype=dtype))


# ----------------------------------------------------------------------------------------------- TPU interpret (NaN)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_tails_tpu_interpret(interpret, layout):
    """M, N and K tails in every layout, broadcast batch, bias + activation, reduce_batch: no NaN leaks."""
    g = torch.Generator().manual_seed(4)
    M, K, N = 129, 300, 140
    x = randn(2, M, K, gen=g) if layout != "tn" else randn(2, K, M, gen=g)
    y = randn(1, K, N, gen=g) if layout != "nt" else randn(1, N, K, gen=g)
    bias = randn(1, N, gen=g)
    kernel = mm.KERNELS[layout]
    for reduce_batch in (False, True):
        out = kernel(x, y, None if reduce_batch else bias, "relu", None, reduce_batch, config=SMALL)
        a = x if layout != "tn" else x.transpose(1, 2)
        b = y if layout != "nt" else y.transpose(1, 2)
        ref = torch.matmul(a.double(), b.double())
        ref = ref.sum(0, keepdim=True) if reduce_batch else ref + bias.double()
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.double(), ref.clamp_min(0), rtol=0, atol=1e-4 * ref.abs().max().item())


def test_tpu_interpret_poisons_unmasked_tail():
    """Sanity of the harness: a K-tail that is multiplied by a 0/1 mask (not jnp.where) leaks NaN."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def body(a_ref, b_ref, o_ref, acc_ref):
        k = pl.program_id(0)

        @pl.when(k == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        valid = tk.tail_valid(a_ref.shape, 1, k * 128, 200).astype(jnp.float32)
        acc_ref[...] += jax.lax.dot(a_ref[...] * valid, b_ref[...] * valid.T[:, :1], preferred_element_type=jnp.float32)
        o_ref[...] = acc_ref[...]

    @tk.tpu_kernel(body, name="matmul_mul_mask", namespace="tpukernels_test")
    def broken(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return tk.Launch(grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda k: (0, k)),
                                              pl.BlockSpec((128, 128), lambda k: (k, 0))],
                         out_specs=pl.BlockSpec((8, 128), lambda k: (0, 0)), out_shape=tk.OutSpec((8, 128), a.dtype),
                         scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)])

    a, b = torch.randn(8, 200), torch.randn(200, 128)
    with pytest.raises(tk.errors.UnwrittenOutputError, match="matmul_mul_mask: output 0"):  # typed since issue 31
        broken(a, b, interpret="tpu")  # the leaked NaN poison fills the whole output block
    assert not torch.isnan(OPS.matmul_nn(a[None], b[None], config=json.dumps(SMALL))).any()


# ----------------------------------------------------------------------------------------------- backward
CASES = [  # (a shape, b shape, b is W.t())
    ((3, 43, 130), (130, 257), True),
    ((43, 130), (130, 257), False),
    ((2, 1, 5, 33), (3, 33, 140), False),
    ((5, 33), (4, 33, 140), False),
    ((4, 5, 33), (33, 140), False),
]


@pytest.mark.parametrize("activation", mm.ACTIVATIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}@{c[1]}{'T' if c[2] else ''}")
def test_backward_matches_float64(case, activation):
    ash, bsh, transposed = case
    g = torch.Generator().manual_seed(5)
    a = randn(*ash, gen=g).requires_grad_()
    w = randn(*(bsh[::-1] if transposed else bsh), gen=g).requires_grad_()
    bias = randn(bsh[-1], gen=g).requires_grad_()
    out = mm.matmul(a, w.t() if transposed else w, bias, activation)
    go = randn(*out.shape, gen=g)
    grads = torch.autograd.grad(out, (a, w, bias), go)
    a64, w64, b64 = (t.detach().double().requires_grad_() for t in (a, w, bias))
    ref = mm.reference(a64, w64.t() if transposed else w64, b64, activation)
    refs = torch.autograd.grad(ref, (a64, w64, b64), go.double())
    for name, got, exp in zip(("a", "b", "bias"), grads, refs):
        assert got.shape == exp.shape, name
        err = (got.double() - exp).abs().max().item() / exp.abs().max().item()
        assert err < 2e-5, f"grad {name}: relative error {err:.2e}"


def test_backward_bf16_linear():
    g = torch.Generator().manual_seed(6)
    x = randn(2, 40, 300, dtype=torch.bfloat16, gen=g).requires_grad_()
    lin = torch.nn.Linear(300, 130, dtype=torch.bfloat16)
    out = mm.matmul(x, lin.weight.t(), lin.bias, "silu")
    out.float().square().sum().backward()
    x2 = x.detach().float().requires_grad_()
    w2, b2 = lin.weight.detach().float().requires_grad_(), lin.bias.detach().float().requires_grad_()
    torch.nn.functional.silu(torch.nn.functional.linear(x2, w2, b2)).square().sum().backward()
    # bf16 operands: dZ is rounded to bf16 before the gradient matmuls, so errors ~ 2^-8 relative
    for got, exp in ((x.grad, x2.grad), (lin.weight.grad, w2.grad), (lin.bias.grad, b2.grad)):
        assert got.dtype == torch.bfloat16 and got.shape == exp.shape
        assert rms(got.float() - exp) <= 2**-7 * rms(exp)


# ----------------------------------------------------------------------------------------------- torch integration
def test_opcheck_public_and_kernels():
    a = torch.randn(3, 20, 130, requires_grad=True)
    w = torch.randn(40, 130, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    torch.library.opcheck(OPS.matmul, (a, w.t(), bias, "gelu_tanh", None))
    a16, b16 = a.detach().bfloat16(), torch.randn(3, 130, 17).bfloat16()
    torch.library.opcheck(OPS.matmul, (a16, b16, None, "relu", "float32"))

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    torch.library.opcheck(OPS.matmul_nt, (leaf(1, 60, 130), leaf(1, 40, 130), leaf(1, 40), "silu", None, False))
    torch.library.opcheck(OPS.matmul_tn, (leaf(2, 33, 20), leaf(1, 33, 40), None, None, "float32", True))
    torch.library.opcheck(OPS.matmul_nn, (leaf(1, 20, 33), leaf(2, 33, 40), None, "gelu_tanh", None, False))


def test_torch_compile_linear():
    """fullgraph + dynamic shapes: one graph for every batch size; backward through aot_eager."""
    import torch._dynamo.testing as dt

    lin = torch.nn.Linear(130, 60)
    cnt = dt.CompileCounter()
    f = torch.compile(lambda x: mm.matmul(x, lin.weight.t(), lin.bias, "relu"), fullgraph=True, dynamic=True,
                      backend=cnt)
    for n in (3, 5, 17):
        x = torch.randn(n, 9, 130)
        torch.testing.assert_close(f(x), torch.relu(lin(x)), rtol=1e-5, atol=1e-5)
    assert cnt.frame_count == 1
    g = torch.compile(lambda x: mm.matmul(x, lin.weight.t(), lin.bias, "silu").sum(), backend="aot_eager")
    x = torch.randn(4, 9, 130, requires_grad=True)
    g(x).backward()
    x2 = x.detach().requires_grad_()
    torch.nn.functional.silu(lin(x2)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("args, err, match", [
    ((torch.randn(5), torch.randn(5, 3)), ArgumentError, "a must have rank >= 2"),
    ((torch.randn(4, 5), torch.randn(6, 3)), ArgumentError, r"a.shape\[-1\] \(K = 5\) must equal b.shape\[-2\] \(6\)"),
    ((torch.randn(2, 4, 5), torch.randn(3, 5, 3)), ArgumentError, "batch dims .* do not broadcast"),
    ((torch.randn(4, 5).double(), torch.randn(5, 3).double()), DTypeError, "a dtype float64 .* no float64"),
    ((torch.ones(4, 5, dtype=torch.int32), torch.ones(5, 3, dtype=torch.int32)), DTypeError, "a dtype int32"),
    ((torch.randn(4, 5), torch.randn(5, 3).bfloat16()), DTypeError, "a is float32 but b is bfloat16"),
    ((torch.randn(4, 5), torch.randn(5, 3), torch.randn(4)), ArgumentError, r"bias must have shape \(N,\) = \(3,\)"),
    ((torch.randn(4, 5), torch.randn(5, 3), None, "gelu"), ArgumentError, "activation 'gelu' is not one of"),
    ((torch.randn(4, 5), torch.randn(5, 3), None, None, "int8"), DTypeError, "out_dtype 'int8' is not supported"),
])
def test_bad_input_typed_errors(args, err, match):
    with pytest.raises(err, match=match):
        mm.matmul(*args)


def test_kernel_op_typed_errors():
    with pytest.raises(DTypeError, match=r"float16 .* \(Mosaic cannot load float16"):
        OPS.matmul_nn(torch.randn(1, 4, 5).half(), torch.randn(1, 5, 3).half())
    with pytest.raises(ArgumentError, match="bt must be 3-D"):
        OPS.matmul_nt(torch.randn(1, 4, 5), torch.randn(3, 5))
    with pytest.raises(ArgumentError, match="batch sizes 2 \\(a\\) and 3 \\(b\\)"):
        OPS.matmul_nn(torch.randn(2, 4, 5), torch.randn(3, 5, 3))
    with pytest.raises(tk.ConfigError, match="rhs"):
        OPS.matmul_nn(torch.randn(1, 4, 5), torch.randn(1, 5, 3), config=json.dumps({"rhs": "xlu"}))


# ----------------------------------------------------------------------------------------------- blocks, defaults
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (7, 1025, 130), (100, 4096, 14336), (8192, 4096, 14336), (4096,) * 3],
                         ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_heuristic_blocks_legal(layout, mkn, dtype):
    """Clamped blocks obey the (8,128) rule, bf16's 16-row packing and the smallest default VMEM limit."""
    import warnings

    from tpukernels.dsl.validate import check_block

    M, K, N = mkn
    a = tk.TensorSpec((1, K, M) if layout == "tn" else (1, M, K), np.dtype(dtype), "a")
    b = tk.TensorSpec((1, N, K) if layout == "nt" else (1, K, N), np.dtype(dtype), "b")
    cfg = mm.heuristic(a, b, layout=layout)
    launch = mm.make_launch(layout, a, b, None, None, None, False, **cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tk.PerformanceWarning)
        for spec, s in zip(launch.in_specs, (a, b)):
            check_block(spec, s.shape, s.dtype, layout)
        check_block(launch.out_specs, (1, M, N), np.dtype(dtype), "out")
    _, bm, bn = launch.out_specs.block_shape
    assert bm in (M, *mm.TUNABLES["bm"].values) and bn in (N, *mm.TUNABLES["bn"].values)
    assert launch.body_kwargs["blk_k"] in (K, *mm.TUNABLES["bk"].values)
    need = mm.vmem_bytes(layout, bm, launch.body_kwargs["blk_k"], bn, np.dtype(dtype), np.dtype(dtype), False)
    assert need <= 12 * mm.MiB and launch.vmem_limit_bytes is None


CHIPS = ("v5e", "v6e", "tpu7x")
SHIPPED = [("nn", "1x1024x1024:bf16", "1x1024x1024:bf16"), ("nn", "1x4096x4096:bf16", "1x4096x4096:bf16"),
           ("nt", "1x8192x4096:bf16", "1x14336x4096:bf16")]


def test_shipped_defaults_are_current():
    """Every chip has shipped entries for the benchmark shapes, written for the current kernel source."""
    for chip in CHIPS:
        for layout, sa, sb in SHIPPED + [("nn", "1x8192x8192:bf16", "1x8192x8192:bf16")]:
            kernel = mm.KERNELS[layout]
            path = db.shipped_db_path(kernel.qualname, chip)
            assert os.path.exists(path), path
            specs = (_spec(sa, "a"), _spec(sb, "b"), None)
            statics = (("activation", None), ("out_dtype", None), ("reduce_batch", False))
            key = db.entry_key(kernel, specs, statics)
            entry, how = db.find(db.load(path), key)
            assert how == "exact", (f"{chip} {layout} {sa} @ {sb}: no entry for the current kernel source "
                                    f"(kernel changed? rerun benchmarks/matmul.py --sweep --write-defaults)")
            assert entry["evidence"]["evaluator"] == "libtpu-static-estimate"


def _spec(text, name):
    from tpukernels.targets.compile_only import parse_shape

    s = parse_shape(text)
    return tk.TensorSpec(s.shape, s.dtype, name)


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("case", SHIPPED, ids=lambda c: f"{c[0]}-{c[1]}@{c[2]}")
def test_compile_only(chip, case):
    """Mosaic + XLA:TPU compile the shipped config (or the heuristic) for each chip."""
    layout, sa, sb = case
    kernel = mm.KERNELS[layout]
    specs = (_spec(sa, "a"), _spec(sb, "b"), None)
    statics = (("activation", None), ("out_dtype", None), ("reduce_batch", False))
    got = db.lookup(kernel, chip, specs, statics)
    cfg = got[0] if got else None
    res = tk.compile_for(kernel, chip, sa, sb, config=cfg, with_mlir=False)
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 0)
