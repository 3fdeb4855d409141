"""Tests of the quantized matmul (tpukernels.library.quantized_matmul, issue 15).

Accuracy criterion (every numeric test): elementwise against a float64 product of the **dequantized**
operands (``W = w_q * w_scale``, and for w8a8 ``x' = x_q * x_scale`` with the quantized activations the
kernel used), ``|y - ref| <= bound`` with ``bound = qmm.error_bound(...)``:

* w8a8 int8: ``(u + 4 u32) |ref| + (K + 2) 2^-52 (|x'| @ |W|^T)``: the int32 sum is exact, the int32->f32
  conversion and the two f32 scale products add 3 u32 relative, and the final rounding to the output dtype
  at most ``u`` (half an ulp: 2^-8 bf16, 2^-24 f32) relative; the last term is the float64 reference's own
  rounding, visible only where the sum cancels to ~0;
* w8a16 and fp8: ``u |ref| + (K + 2) u32 (|x'| @ |W|^T)``: f32 products of int8 / fp8 / bf16 values are
  exact, any f32 summation order of K terms errs by at most ``(K - 1) u32 sum|x'||W|`` (Higham, 2nd ed.,
  eq. 3.5), one more u32 for the scale product, then the final rounding.

``test_bound_is_sharp`` shows the bound catches a real mistake: dequantizing the weights to bf16 before
the dot (rounding ``w_q * w_scale``, as a naive implementation does) violates it.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tpukernels as tk
import tpukernels.library  # noqa: F401  (registers the ops)
from tpukernels.autotune import db
from tpukernels.errors import ArgumentError, ChipError, DeviceError, DTypeError

qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")
OPS = torch.ops.tpukernels
SMALL = dict(bm=128, bk=128, bn=128)  # several grid steps and tails in every dim for sizes > 128
#: (x_quant, weight dtype) of every mode; the chip check is off on cpu without TPUKERNELS_TARGET_CHIP
MODES = [(None, "int8"), ("int8", "int8"), (None, "float8_e4m3fn"), (None, "float8_e5m2"),
         ("fp8", "float8_e4m3fn"), ("fp8", "float8_e5m2")]
CHIPS = ("v5e", "v6e", "tpu7x")


@pytest.fixture(autouse=True)
def _no_target_chip(monkeypatch):
    monkeypatch.delenv("TPUKERNELS_TARGET_CHIP", raising=False)


def _mode_id(m):
    return f"{m[0] or 'w8a16'}-{m[1]}"


def run_and_check(x, w, x_quant, wdtype, out_dtype=None, config=SMALL):
    """quantized_matmul on ``x`` with ``w`` quantized to ``wdtype``; asserts the bound; returns max err/bound."""
    w_q, w_s = qmm.quantize_weight(w, wdtype)
    y = qmm.quantized_matmul(x, w_q, w_s, x_quant=x_quant, out_dtype=out_dtype, config=config)
    odt = out_dtype or x.dtype
    assert y.dtype == odt and y.shape == (*x.shape[:-1], w.shape[0])
    if x_quant is None:
        xv, xs = x, None
    else:
        xv, xs = qmm.quantize_per_token(x, wdtype)  # the kernel the op ran (deterministic)
    ref = qmm.reference(xv, w_q, w_s, xs)
    bound = qmm.error_bound(xv, w_q, w_s, xs, odt)
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all()
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} elements over the bound; worst err/bound "
                           f"{(err / bound.clamp_min(1e-300)).max().item():.3f}")
    return (err / bound.clamp_min(1e-300)).max().item()


def data(M, K, N, dtype=torch.bfloat16, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3  # per-channel magnitudes differ
    return x, w


# ----------------------------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_modes_within_bound_both_interpreters(mode, interpret):
    """Tails in M, N and K (200 x 300 -> 260 with 128 blocks); "tpu" interpret poisons padding with NaN."""
    x, w = data(200, 300, 260)
    run_and_check(x, w, *mode)


@pytest.mark.parametrize("mode", [(None, "int8"), ("int8", "int8"), ("fp8", "float8_e4m3fn")], ids=_mode_id)
def test_float32_in_and_out(mode):
    x, w = data(70, 260, 140, dtype=torch.float32, seed=1)
    run_and_check(x, w, *mode, out_dtype=torch.float32)
    run_and_check(x.bfloat16(), w, *mode, out_dtype=torch.float32)


@given(M=st.integers(1, 300), K=st.integers(1, 400), N=st.integers(1, 300), mode=st.sampled_from(MODES),
       blocks=st.sampled_from([SMALL, None]), seed=st.integers(0, 2**16))
def test_property_shapes(M, K, N, mode, blocks, seed):
    x, w = data(M, K, N, seed=seed)
    run_and_check(x, w, *mode, config=blocks)


def test_leading_dims_and_default_config():
    x, w = data(5, 96, 40, lead=(2, 3), seed=2)
    run_and_check(x, w, None, "int8", config=None)
    run_and_check(x, w, "int8", "int8", config=None)


def test_bound_is_sharp():
    """The same product with the weights dequantized to bf16 first (one rounding of w_q*w_scale) fails."""
    x, w = data(64, 512, 256, seed=3)
    w_q, w_s = qmm.quantize_weight(w, "int8")
    naive = (x.float() @ (w_q.float() * w_s[:, None]).bfloat16().float().T).bfloat16()
    bound = qmm.error_bound(x, w_q, w_s, None, torch.bfloat16)
    assert ((naive.double() - qmm.reference(x, w_q, w_s)).abs() > bound).any()


def test_int8_accumulation_is_exact():
    """Worst-case magnitudes (all +-127, K = 4096): int32 accumulation, so the f32 result is the exact sum."""
    K = 4096
    xq = torch.full((16, K), 127, dtype=torch.int8)
    wq = torch.full((128, K), 127, dtype=torch.int8)
    wq[1::2] = -127
    one = torch.ones(1, 128)
    y = qmm.quantized_matmul_kernel(xq, wq, one, torch.ones(16, 1), "float32", config=dict(bk=256))
    exact = torch.tensor([127 * 127 * K, -127 * 127 * K] * 64, dtype=torch.float64)
    assert torch.equal(y[0].double(), exact)  # 66 M is exactly representable in f32 (a multiple of 2^2)


def test_empty_and_k_zero():
    w_q, w_s = qmm.quantize_weight(torch.randn(7, 5), "int8")
    assert qmm.quantized_matmul(torch.randn(0, 5).bfloat16(), w_q, w_s).shape == (0, 7)
    y = qmm.quantized_matmul(torch.randn(3, 0).bfloat16(), torch.zeros(7, 0, dtype=torch.int8), w_s, x_quant="int8")
    assert y.shape == (3, 7) and not y.any()


# ----------------------------------------------------------------------------------------------- fused w8a8
#: (M, K, N, config): K and N tails, several row blocks (the next one loaded and quantized during the
#: current one's last N sweeps), 2 row parts (bm=64, 9 N blocks), a single row block, a single N block
FUSED_CASES = [(256, 300, 260, SMALL, "int8"), (256, 300, 260, SMALL, "float8_e5m2"),
               (256, 700, 1100, dict(bm=64, bk=256, bn=128), "float8_e4m3fn"), (40, 700, 130, None, "int8"),
               (256, 1024, 128, dict(bm=128, bk=512, bn=256), "int8")]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: "x".join(map(str, c[:3])) + "-" + c[4])
def test_fused_w8a8_equals_two_kernel_path(case, interpret):
    """The fused kernel gives bit for bit the result of quantize_per_token_kernel + quantized_matmul_kernel
    (one shared quantization formula, same int32 / f32 accumulation order per block, same epilogue), and
    that result is within the w8a8 bound of the float64 product of the dequantized operands."""
    M, K, N, cfg, wdtype = case
    x, w = data(M, K, N, seed=M + K)
    x[3] = 0  # a zero token: scale 0, output 0
    w_q, w_s = qmm.quantize_weight(w, wdtype)
    ws = w_s.reshape(1, N)
    assert qmm.fused_plan(M, K, N, qmm.jnp_dtype("bfloat16"), qmm.jnp_dtype(wdtype), qmm.jnp_dtype("bfloat16"),
                          **(cfg or qmm.w8a8_heuristic(x, w_q, ws))) is not None
    y = qmm.quantized_matmul_w8a8_kernel(x, w_q, ws, None, config=cfg)
    xq, xs = qmm.quantize_per_token_kernel(x, wdtype)
    assert torch.equal(y, qmm.quantized_matmul_kernel(xq, w_q, ws, xs, None, config=cfg))
    ref = qmm.reference(xq, w_q, w_s, xs[:, 0])
    assert not ((y.double() - ref).abs() > qmm.error_bound(xq, w_q, w_s, xs[:, 0], torch.bfloat16)).any()
    assert not y[3].float().any()


#: (M, K, N, config, x_quant, weight dtype, out dtype) taking the weight-streaming launch: several / one K
#: step, one / several N tiles, odd M, w8a8 int32 accumulation, fp8 weights with f32 output, the heuristic
STREAM_CASES = [(16, 512, 384, dict(bm=512, bk=128, bn=128), None, "int8", None),
                (5, 256, 128, dict(bm=512, bk=256, bn=128), None, "int8", None),
                (64, 384, 256, dict(bm=512, bk=128, bn=256), "int8", "int8", None),
                (33, 256, 64, dict(bm=128, bk=128, bn=64), None, "float8_e5m2", torch.float32),
                (128, 1024, 128, None, None, "int8", None)]


def _stream_args(M, K, N, x_quant, wdtype, seed):
    x, w = data(M, K, N, seed=seed)
    w_q, w_s = qmm.quantize_weight(w, wdtype)
    if x_quant is None:
        return x, w_q, w_s, None
    xq, xs = qmm.quantize_per_token_kernel(x, wdtype)
    return xq, w_q, w_s, xs


@pytest.mark.parametrize("case", STREAM_CASES, ids=lambda c: "x".join(map(str, c[:3])) + f"-{c[4] or 'w8a16'}-{c[5]}")
def test_stream_launch_equals_blocked(case, interpret, monkeypatch):
    """The decode launch (x resident, w_q streamed by the kernel as two DMAs per tile) gives bit for bit the
    blocked launch's result at the same blocks (same dot per K chunk, same accumulation order and epilogue), and
    that result is within the bound of the float64 product of the dequantized operands."""
    M, K, N, cfg, x_quant, wdtype, out_dtype = case
    xv, w_q, w_s, xs = _stream_args(M, K, N, x_quant, wdtype, seed=M + N)
    ws = w_s.reshape(1, N)
    odt = None if out_dtype is None else qmm.dtype_name(out_dtype)
    blocks = cfg or qmm.heuristic(xv, w_q, ws, xs)
    assert qmm.stream_plan(M, N, K, blocks["bm"], blocks["bk"], blocks["bn"]) is not None
    y = qmm.quantized_matmul_kernel(xv, w_q, ws, xs, odt, config=cfg)
    monkeypatch.setattr(qmm.w8a16, "STREAM_MAX_M", 0)  # the blocked launch; bm=M+1 clamps to the same row block
    assert qmm.stream_plan(M, N, K, blocks["bm"], blocks["bk"], blocks["bn"]) is None
    blocked = qmm.quantized_matmul_kernel(xv, w_q, ws, xs, odt, config=dict(blocks, bm=M + 1))
    assert torch.equal(y, blocked)
    ref = qmm.reference(xv, w_q, w_s, None if xs is None else xs[:, 0])
    bound = qmm.error_bound(xv, w_q, w_s, None if xs is None else xs[:, 0], out_dtype or torch.bfloat16)
    assert not ((y.double() - ref).abs() > bound).any()


def test_stream_plan_rule():
    """stream_plan: one row block of <= STREAM_MAX_M rows and blocks that tile w_q exactly (bk a multiple of 128
    unless it is K, bn / WEIGHT_DMAS a multiple of 32); the launch it selects has grid (1, N/bn, K/bk), w_q in
    HBM (pl.ANY) and two DMA semaphores per slot. The shipped decode configs and the decode heuristic take it;
    prefill never does."""
    from jax.experimental import pallas as pl

    plan = qmm.stream_plan
    assert plan(16, 14336, 4096, 512, 4096, 2048) == dict(n_j=7, blk_n=2048, ndma=2)
    assert plan(128, 256, 256, 512, 128, 128) is not None and plan(129, 256, 256, 512, 128, 128) is None
    assert plan(64, 256, 256, 32, 128, 128) is None  # bm < M: several row blocks
    assert plan(16, 14336, 4096, 512, 4096, 4096) is None  # 4096 does not divide 14336
    assert plan(16, 256, 300, 512, 4096, 128) is not None  # bk covers K = 300 (one K step)
    assert plan(16, 256, 640, 512, 320, 128) is None  # bk = 320 < K, not a multiple of 128
    assert plan(16, 96, 256, 512, 128, 96) is None and plan(16, 64, 256, 512, 128, 64) is not None  # 48 / 32 rows
    assert plan(8192, 14336, 4096, 1024, 4096, 2048) is None
    spec = tk.TensorSpec
    launch = qmm.make_launch("nt", spec((16, 4096), qmm.jnp_dtype("bfloat16"), "x"),
                             spec((14336, 4096), qmm.jnp_dtype("int8"), "w"),
                             spec((1, 14336), qmm.jnp_dtype("float32"), "s"),
                             None, None, 512, 2048, 3584)
    assert launch.grid == (1, 4, 2) and launch.in_specs[1].memory_space == pl.ANY
    assert launch.body_kwargs["stream"] == dict(n_j=4, blk_n=3584, ndma=2)
    for chip in CHIPS:
        for _, args, _ in qmm.STANDARD_CASES:
            specs = _case_specs(args)
            (M, K), (N, _) = specs[0].shape, specs[1].shape
            cfg, source = qmm.quantized_matmul_kernel.resolve_config(specs, (("out_dtype", None),), None,
                                                                      tk.get_chip(chip))
            if len(args) == 4 and not _runs_on(chip, args):
                continue
            assert (plan(M, N, K, cfg["bm"], cfg["bk"], cfg["bn"]) is not None) == (M <= 128), (chip, args, cfg)
    for M, K, N in ((16, 4096, 14336), (64, 14336, 4096), (1, 4096, 11008), (128, 5120, 13824), (8, 256, 64)):
        h = qmm.heuristic(spec((M, K), qmm.jnp_dtype("bfloat16"), "x"), spec((N, K), qmm.jnp_dtype("int8"), "w"), None)
        assert plan(M, N, K, h["bm"], h["bk"], h["bn"]) is not None, (M, K, N, h)


@given(M=st.integers(1, 128), kb=st.integers(1, 6), nb=st.integers(1, 8), bk=st.sampled_from([128, 256]),
       bn=st.sampled_from([128, 256]), mode=st.sampled_from(MODES), seed=st.integers(0, 2**16))
def test_property_stream_shapes(M, kb, nb, bk, bn, mode, seed):
    """Decode shapes through the public op on the streaming launch (K, N multiples of the blocks): within bound."""
    K, N = kb * bk, nb * bn
    assert qmm.stream_plan(M, N, K, 512, bk, bn) is not None
    x, w = data(M, K, N, seed=seed)
    run_and_check(x, w, *mode, config=dict(bm=512, bk=bk, bn=bn))


def test_fused_plan_rule():
    """fused_plan: bm halves until it divides M (multiples of 32), M itself when M <= bm, VMEM per chip
    from tpu_info (3/4 of vmem_capacity_bytes), None when no bm qualifies."""
    bf, i8 = qmm.jnp_dtype("bfloat16"), qmm.jnp_dtype("int8")
    plan = lambda M, K, N, bm, chip=None: qmm.fused_plan(M, K, N, bf, i8, bf, bm, 2048, 1024, chip)  # noqa: E731
    assert plan(8192, 4096, 14336, 1024)["bm"] == 1024
    assert plan(200, 256, 256, 1024)["bm"] == 200  # one row block
    assert plan(96, 256, 256, 64)["bm"] == 32  # 64 does not divide 96
    assert plan(300, 256, 256, 128) is None  # 300 = 4 * 75: no multiple of 32 divides it
    for chip in CHIPS:
        assert qmm.vmem_budget(chip) == tk.get_chip(chip).vmem_capacity_bytes * 3 // 4
    # Llama-3-8B down-projection (K = 14336): the 1024-row block fits v6e's 128 MiB, not tpu7x's 64 MiB
    assert plan(8192, 14336, 4096, 1024, "v6e")["bm"] == 1024
    got = plan(8192, 14336, 4096, 1024, "tpu7x")
    assert got["bm"] == 512 and got["need"] <= qmm.vmem_budget("tpu7x")
    assert qmm.fused_vmem_bytes(1024, 2048, 1024, 14336, bf, i8, bf, 7) > qmm.vmem_budget("tpu7x")
    w_q, w_s = _wq(8, 256)
    with pytest.raises(ArgumentError, match="no fused plan"):
        qmm.quantized_matmul_w8a8_kernel(torch.randn(300, 256), w_q, w_s.reshape(1, 8), config=dict(bm=128))


def test_public_w8a8_routes_by_the_rule(monkeypatch):
    """quantized_matmul(x_quant=...) runs the fused kernel where fused_plan has a plan (no separate
    quantization pass), else the two kernels; both give the same values."""
    x, w = data(96, 256, 200, seed=11)
    w_q, w_s = qmm.quantize_weight(w, "int8")
    want = qmm.quantized_matmul_kernel(*qmm.quantize_per_token_kernel(x, "int8")[:1], w_q, w_s.reshape(1, -1),
                                       qmm.quantize_per_token_kernel(x, "int8")[1], None)
    real = qmm.quantize_per_token_kernel
    calls = []
    monkeypatch.setattr(qmm.public, "quantize_per_token_kernel", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.equal(qmm.quantized_matmul(x, w_q, w_s, x_quant="int8", config=dict(bm=32, bk=128, bn=128)), want)
    assert calls == []  # fused: 32 divides 96
    y = qmm.quantized_matmul(x[:90], w_q, w_s, x_quant="int8", config=dict(bm=32, bk=128, bn=128))
    assert calls == [1] and torch.equal(y, want[:90])  # 90 rows: no multiple of 32 divides 90


# ----------------------------------------------------------------------------------------------- quantization
@pytest.mark.parametrize("dtype", qmm.WEIGHT_DTYPES)
def test_quantize_per_token_matches_reference(dtype, interpret):
    x, _ = data(100, 333, 1, seed=4)
    x[3] = 0  # a zero row: scale 0, q 0
    q, s = qmm.quantize_per_token(x, dtype)
    rq, rs = qmm.quantize_reference(x, dtype)
    assert q.dtype == getattr(torch, dtype) and s.dtype == torch.float32 and s.shape == (100,)
    assert torch.equal(s, rs) and s[3] == 0 and not q[3].float().any()
    # q: equal except where x / s lies within 1e-6 relative of a rounding boundary (the interpreter's f32
    # division is not always correctly rounded); there one grid step apart at most
    diff = q.double() - rq.double()
    if dtype == "int8":
        v = x.double() / torch.where(rs == 0, 1, rs).double()[:, None]
        near = ((v - v.floor() - 0.5).abs() < 1e-6 * v.abs().clamp_min(1))
        assert diff.abs().max() <= 1 and not diff[~near].any()
    else:  # fp8: one fp8 step (relative 2^-3 / 2^-2) at most, at a few ties
        assert (diff.abs() <= rq.double().abs() * 2**-2 + 1e-30).all() and (diff != 0).float().mean() < 1e-2


@pytest.mark.parametrize("dtype", qmm.WEIGHT_DTYPES)
def test_quantize_weight_error(dtype):
    w = torch.randn(33, 70) * torch.logspace(-3, 2, 33)[:, None]
    w[5] = 0
    q, s = qmm.quantize_weight(w, dtype)
    assert q.shape == w.shape and s.shape == (33,) and s[5] == 0
    err = (qmm.dequantize(q, s) - w.double()).abs()
    if dtype == "int8":
        assert (err <= s.double()[:, None] * 0.5 * (1 + 1e-6)).all()
        assert q.min() >= -127
    else:  # relative half-step of the fp8 grid (3 / 2 mantissa bits), subnormals absolute
        rel = 2.0**-4 if dtype == "float8_e4m3fn" else 2.0**-3
        tiny = s.double()[:, None] * float(torch.finfo(getattr(torch, dtype)).smallest_normal)
        assert (err <= rel * w.double().abs() * (1 + 1e-6) + tiny).all()
    assert (qmm.dequantize(q, s).abs().amax(1) - w.double().abs().amax(1)).abs().max() <= 1e-6 * w.abs().max()


# ----------------------------------------------------------------------------------------------- autograd
def test_backward_dx_w8a16(interpret):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 70, 300, generator=g).requires_grad_()
    w_q, w_s = qmm.quantize_weight(torch.randn(260, 300, generator=g), "int8")
    y = qmm.quantized_matmul(x, w_q, w_s, config=SMALL)
    go = torch.randn(*y.shape, generator=g)
    (dx,) = torch.autograd.grad(y, x, go)
    x64 = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(qmm.reference(x64, w_q, w_s), x64, go.double())
    # f32 accumulation over N = 260 terms and one f32 rounding of g * w_scale: ~ (N + 2) u32 relative
    mag = go.double().abs().reshape(-1, 260) @ qmm.dequantize(w_q, w_s).abs()
    bound = (260 + 2) * qmm.U32 * mag.reshape(ref.shape)
    assert dx.dtype == torch.float32 and ((dx.double() - ref).abs() <= bound).all()


def test_backward_bf16_and_frozen_weights():
    x = torch.randn(40, 256).bfloat16().requires_grad_()
    w = torch.randn(128, 256)
    w_q, w_s = qmm.quantize_weight(w, "float8_e4m3fn")
    qmm.quantized_matmul(x, w_q, w_s).float().square().sum().backward()
    x2 = x.detach().double().requires_grad_()
    qmm.reference(x2, w_q, w_s).square().sum().backward()
    # bf16: g (= 2y, rounded to bf16) and g * w_scale each round once (2^-8 relative), so ~2^-7
    assert x.grad.dtype == torch.bfloat16
    assert (x.grad.double() - x2.grad).pow(2).mean().sqrt() <= 2**-7 * x2.grad.pow(2).mean().sqrt()


def test_w8a8_refuses_gradients():
    """The forward runs with x.requires_grad (inference without no_grad); the backward raises, never zeros."""
    w_q, w_s = qmm.quantize_weight(torch.randn(8, 16), "int8")
    y = qmm.quantized_matmul(torch.randn(4, 16, requires_grad=True), w_q, w_s, x_quant="int8")
    with pytest.raises(ArgumentError, match="no gradient"):
        y.sum().backward()
    with torch.no_grad():
        assert not qmm.quantized_matmul(torch.randn(4, 16, requires_grad=True), w_q, w_s, x_quant="int8").requires_grad


def test_opcheck():
    w_q, w_s = qmm.quantize_weight(torch.randn(40, 130), "int8")
    x = torch.randn(3, 20, 130, requires_grad=True)
    torch.library.opcheck(OPS.quantized_matmul, (x, w_q, w_s, None, None))
    torch.library.opcheck(OPS.quantized_matmul, (x.detach().bfloat16(), w_q, w_s, "int8", "float32"))
    torch.library.opcheck(OPS.quantized_matmul_kernel, (x.detach()[0], w_q, w_s.reshape(1, -1), None, None))
    torch.library.opcheck(OPS.quantize_per_token_kernel, (x.detach()[0].bfloat16(), "float8_e5m2"))
    torch.library.opcheck(OPS.quantized_matmul_w8a8_kernel, (x.detach()[0].bfloat16(), w_q, w_s.reshape(1, -1), None))


def test_torch_compile_fullgraph_dynamic():
    """One graph for every token count (dynamic shapes through the fake kernels); w8a8 under aot_eager."""
    import torch._dynamo.testing as dt

    w_q, w_s = qmm.quantize_weight(torch.randn(40, 96), "int8")
    cnt = dt.CompileCounter()
    f = torch.compile(lambda x: qmm.quantized_matmul(x, w_q, w_s), fullgraph=True, dynamic=True, backend=cnt)
    for n in (3, 5, 17):
        x = torch.randn(n, 96)
        assert torch.equal(f(x), qmm.quantized_matmul(x, w_q, w_s))
    assert cnt.frame_count == 1
    g = torch.compile(lambda x: qmm.quantized_matmul(x, w_q, w_s, x_quant="int8"), fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 96)
    with torch.no_grad():
        assert torch.equal(g(x), qmm.quantized_matmul(x, w_q, w_s, x_quant="int8"))


# ----------------------------------------------------------------------------------------------- errors
def _wq(N=8, K=16, dtype="int8"):
    return qmm.quantize_weight(torch.randn(N, K), dtype)


@pytest.mark.parametrize("make, err, match", [
    (lambda: (torch.randn(4, 15), *_wq()), ArgumentError, r"x.shape\[-1\] must equal K = 16"),
    (lambda: (torch.randn(4, 16), _wq()[0], torch.ones(7)), ArgumentError, r"w_scale must have shape \(N,\) = \(8,\)"),
    (lambda: (torch.randn(4, 16), _wq()[0], torch.ones(8).double()), DTypeError, "w_scale must be float32"),
    (lambda: (torch.randn(4, 16), torch.randn(8, 16).bfloat16(), torch.ones(8)), DTypeError, "w_q dtype bfloat16"),
    (lambda: (torch.randn(4, 16).half(), *_wq()), DTypeError, "x dtype float16"),
    (lambda: (torch.randn(4, 16).double(), *_wq()), DTypeError, "x dtype float64"),
    (lambda: (torch.randn(4, 16), _wq()[0][0], _wq()[1]), ArgumentError, "w_q must be 2-D"),
    (lambda: (torch.randn(4, 16), *_wq(), "int4"), ArgumentError, "x_quant 'int4' is not one of"),
    (lambda: (torch.randn(4, 16), *_wq(dtype="float8_e5m2"), "int8"), DTypeError, "x_quant='int8' needs int8 w_q"),
    (lambda: (torch.randn(4, 16), *_wq(), "fp8"), DTypeError, "x_quant='fp8' needs float8 w_q"),
    (lambda: (torch.randn(4, 16), *_wq(), None, "float16"), DTypeError, "out_dtype 'float16'"),
    (lambda: (torch.randn(4, 16), _wq()[0], _wq()[1].to("meta")), DeviceError, "one device"),
    (lambda: (torch.randn(1, qmm.INT32_MAX_K + 1), torch.zeros(1, qmm.INT32_MAX_K + 1, dtype=torch.int8),
              torch.ones(1), "int8"), ArgumentError, "may overflow int32"),
])
def test_bad_input_typed_errors(make, err, match):
    args = make()
    kw = {}
    if len(args) > 3:
        kw["x_quant"] = args[3]
    if len(args) > 4:
        kw["out_dtype"] = args[4]
    with pytest.raises(err, match=match):
        qmm.quantized_matmul(*args[:3], **kw)


def test_kernel_op_typed_errors():
    w_q, w_s = _wq()
    with pytest.raises(ArgumentError, match=r"w_scale must have shape \(1, 8\)"):
        OPS.quantized_matmul_kernel(torch.randn(4, 16), w_q, torch.ones(1, 7))
    with pytest.raises(DTypeError, match="x must have w_q's dtype int8"):
        OPS.quantized_matmul_kernel(torch.randn(4, 16), w_q, w_s.reshape(1, 8), torch.ones(4, 1))
    with pytest.raises(DTypeError, match="dtype 'int4'"):
        OPS.quantize_per_token_kernel(torch.randn(4, 16), "int4")


def test_8bit_blocks_pack_32_rows():
    """int8 / fp8 tiles are (32, 128): VMEM estimates pad 8-bit blocks to 32 rows, and a partial 8-bit
    block of 16 rows warns (legal but half-empty loads)."""
    import warnings

    from jax.experimental import pallas as pl

    from tpukernels.dsl.validate import check_block, padded_bytes, sublane_tile
    from tpukernels.errors import PerformanceWarning

    for dt in ("int8", "float8_e4m3fn", "float8_e5m2"):
        assert sublane_tile(qmm.jnp_dtype(dt)) == 32 and padded_bytes((16, 128), qmm.jnp_dtype(dt)) == 32 * 128
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            check_block(pl.BlockSpec((16, 128), lambda i: (i, 0)), (64, 128), qmm.jnp_dtype(dt), "w_q")
        assert any(issubclass(r.category, PerformanceWarning) and "32" in str(r.message) for r in rec)


# ----------------------------------------------------------------------------------------------- chip support
def test_supported_modes_come_from_tpu_info():
    from tpukernels.chips import get_chip

    for name in CHIPS:
        info = get_chip(name).info
        modes = qmm.supported_modes(name)
        assert (("int8", "int8") in modes) == info.is_matmul_supported(np.int8, np.int8)
        for f8 in ("float8_e4m3fn", "float8_e5m2"):
            f8d = qmm.jnp_dtype(f8)
            assert (("fp8", f8) in modes) == info.is_matmul_supported(f8d, f8d)
        assert (None, "int8") in modes
    # what jax 0.10.2's tables say (the docstring's summary; fails if jax changes them)
    assert ("int8", "int8") not in qmm.supported_modes("tpu7x") and ("int8", "int8") in qmm.supported_modes("v6e")
    assert (None, "float8_e4m3fn") not in qmm.supported_modes("v5e")


@pytest.mark.parametrize("chip, mode, alt", [("tpu7x", ("int8", "int8"), "x_quant='fp8'"),
                                             ("v5e", (None, "float8_e4m3fn"), "float8_e5m2"),
                                             ("v6e", ("fp8", "float8_e4m3fn"), "w8a8 int8")])
def test_unsupported_pair_names_chip_and_alternatives(monkeypatch, chip, mode, alt):
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", chip)
    w_q, w_s = _wq(dtype=mode[1])
    with pytest.raises(ChipError, match=rf"not supported on {chip}.*supported on {chip}: .*{alt}"):
        qmm.quantized_matmul(torch.randn(4, 16).bfloat16(), w_q, w_s, x_quant=mode[0])


def test_supported_pair_runs_with_target_chip(monkeypatch):
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "tpu7x")
    x, w = data(40, 256, 130, seed=9)
    run_and_check(x, w, "fp8", "float8_e4m3fn", config=None)  # tpu7x: fp8 supported
    run_and_check(x, w, None, "int8", config=None)  # w8a16 runs on every chip


# ----------------------------------------------------------------------------------------------- module
def test_quant_linear_module():
    lin = torch.nn.Linear(96, 48)
    x = torch.randn(3, 7, 96)
    for dtype, xq in (("int8", None), ("int8", "int8"), ("fp8", None)):
        m = qmm.TPUQuantLinear.from_linear(lin, dtype, xq)
        assert dict(m.named_parameters()) == {}  # frozen: buffers only
        with torch.no_grad():
            y = m(x)
        exp = lin(x).detach()
        # int8 weights: half-step error per weight, ~sqrt(K) growth: a few % of the RMS output here
        assert (y - exp).pow(2).mean().sqrt() <= 0.03 * exp.pow(2).mean().sqrt()
        assert y.shape == exp.shape and y.dtype == exp.dtype


# ----------------------------------------------------------------------------------------------- shipped defaults + aot
def _spec(text, name):
    from tpukernels.targets.compile_only import parse_shape

    s = parse_shape(text)
    return tk.TensorSpec(s.shape, s.dtype, name)


def _case_specs(args):
    names = ("x", "w_q", "w_scale", "x_scale")
    specs = [_spec(a, n) for a, n in zip(args, names)]
    return tuple(specs + [None] * (4 - len(specs)))


def _runs_on(chip, args):
    w8a8 = len(args) == 4
    wd = qmm.dtype_name(_spec(args[1], "w").dtype)
    return (("int8" if wd == "int8" else "fp8") if w8a8 else None, wd) in qmm.supported_modes(chip)


def test_shipped_defaults_are_current():
    """Each chip has a shipped entry for each standard case it supports, for the current kernel source."""
    kernel = qmm.quantized_matmul_kernel
    for chip in CHIPS:
        path = db.shipped_db_path(kernel.qualname, chip)
        assert os.path.exists(path), path
        for _, args, _ in qmm.STANDARD_CASES:
            if not _runs_on(chip, args):
                continue
            key = db.entry_key(kernel, _case_specs(args), (("out_dtype", None),))
            entry, how = db.find(db.load(path), key)
            assert how == "exact", (f"{chip} {args}: no entry for the current source "
                                    f"(rerun benchmarks/quantized_matmul.py --write-defaults)")
            assert entry["evidence"]["evaluator"] == "tpu-model"  # libtpu static estimate + rooflines


def _w8a8_mode(chip):
    return ("int8", "int8") if ("int8", "int8") in qmm.supported_modes(chip) else ("fp8", "float8_e4m3fn")


def test_shipped_fused_w8a8_defaults_are_current():
    """Each chip has a shipped entry of the fused w8a8 kernel for its w8a8 mode at the standard prefill shapes
    (current kernel source), whose blocks have a fused plan on that chip; the evidence says what chose it."""
    kernel = qmm.quantized_matmul_w8a8_kernel
    bf = qmm.jnp_dtype("bfloat16")
    for chip in CHIPS:
        path = db.shipped_db_path(kernel.qualname, chip)
        wd = _w8a8_mode(chip)[1]
        for _, args, _ in qmm.STANDARD_CASES_W8A8:
            if qmm.dtype_name(_spec(args[1], "w").dtype) != wd:
                continue
            specs = tuple(_spec(a, n) for a, n in zip(args, ("x", "w_q", "w_scale")))
            entry, how = db.find(db.load(path), db.entry_key(kernel, specs, (("out_dtype", None),)))
            assert how == "exact", f"{chip} {args}: no shipped entry for the current fused kernel source"
            (M, K), (N, _) = specs[0].shape, specs[1].shape
            cfg = entry["config"]
            plan = qmm.fused_plan(M, K, N, bf, specs[1].dtype, bf, cfg["bm"], cfg["bk"], cfg["bn"], chip)
            assert plan is not None and plan["bm"] == cfg["bm"], (chip, args, cfg, plan)
            assert entry["evidence"]["label"] in ("model", "compile-only"), entry["evidence"]


class _Spy:
    """Stands in for a kernel: records each call's arguments, returns an empty meta result (nothing runs)."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, *args, **kw):
        self.calls.append((self.kernel, args, kw))
        return torch.empty(args[0].shape[0], args[1].shape[0], dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize("chip", CHIPS)
def test_public_full_size_calls_get_the_shipped_config(monkeypatch, chip):
    """quantized_matmul at every standard shape (meta tensors, target chip set) calls its kernel with a
    signature whose config resolves to the chip's exact shipped entry — w8a16 and the chip's w8a8 mode, the
    latter through the fused kernel —, not the heuristic (the statics are part of the DB key: a call passing
    ``out_dtype="bfloat16"`` where the entries were tuned under ``None`` used to miss them)."""
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", chip)
    calls = []
    for name in ("quantized_matmul_kernel", "quantized_matmul_w8a8_kernel", "quantize_per_token_kernel"):
        monkeypatch.setattr(qmm.public, name, _Spy(getattr(qmm.public, name), calls))  # the names the op calls
    xq, wd = _w8a8_mode(chip)
    cases = [(None, a) for _, a, _ in qmm.STANDARD_CASES if len(a) == 3]
    cases += [(xq, a) for _, a, _ in qmm.STANDARD_CASES_W8A8 if qmm.dtype_name(_spec(a[1], "w").dtype) == wd]
    for x_quant, args in cases:
        x, w = (_spec(a, "t") for a in args[:2])
        calls.clear()
        y = qmm.quantized_matmul(torch.empty(x.shape, dtype=torch.bfloat16, device="meta"),
                                 torch.empty(w.shape, dtype=getattr(torch, qmm.dtype_name(w.dtype)), device="meta"),
                                 torch.empty(w.shape[0], device="meta"), x_quant=x_quant)
        assert y.shape == (x.shape[0], w.shape[0])
        want = (qmm.public.quantized_matmul_kernel if x_quant is None else qmm.public.quantized_matmul_w8a8_kernel).kernel
        assert [c[0] for c in calls] == [want], (chip, args, calls)
        kernel, cargs, _ = calls[0]
        tensors = [a for a in cargs if isinstance(a, torch.Tensor) or a is None][:4 if x_quant is None else 3]
        specs = tuple(None if t is None else tk.TensorSpec(tuple(t.shape), qmm.jnp_dtype(qmm.dtype_name(t.dtype)), n)
                      for t, n in zip(tensors, ("x", "w_q", "w_scale", "x_scale")))
        out_dtype = cargs[len(tensors)]
        cfg, source = kernel.resolve_config(specs, (("out_dtype", out_dtype),), None, tk.get_chip(chip))
        assert source == f"shipped-db:{chip}", (chip, x_quant, args, out_dtype, source)


AOT_CASES = [args for _, args, _ in qmm.STANDARD_CASES] + [
    ("8192x4096:float8_e4m3fn", "14336x4096:float8_e4m3fn", "1x14336:f32", "8192x1:f32"),  # tpu7x w8a8 (heuristic)
    ("8192x4096:float8_e5m2", "14336x4096:float8_e5m2", "1x14336:f32", "8192x1:f32"),
    ("8192x4096:bf16", "14336x4096:float8_e5m2", "1x14336:f32"),
]


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("args", AOT_CASES, ids=lambda a: "@".join(s.split(":")[1] for s in a[:2]) + "-" + a[0])
def test_compile_only(chip, args):
    """Mosaic + XLA:TPU compile the shipped config (or heuristic) where the chip supports the pair, and the
    launch refuses it with ChipError where it does not."""
    kernel = qmm.quantized_matmul_kernel
    if not _runs_on(chip, args):
        with pytest.raises(ChipError, match=chip):
            tk.compile_for(kernel, chip, *args, with_mlir=False)
        return
    got = db.lookup(kernel, chip, _case_specs(args), (("out_dtype", None),))
    res = tk.compile_for(kernel, chip, *args, config=got[0] if got else None, with_mlir=False)
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 0)


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
def test_compile_only_quantize_and_dx(chip):
    for dt in qmm.WEIGHT_DTYPES:
        res = tk.compile_for(qmm.quantize_per_token_kernel, chip, "8192x14336:bf16", dt, with_mlir=False)
        assert res.ok, res.summary()
    res = tk.compile_for(qmm.quantized_matmul_bwd_dx, chip, "8192x14336:bf16", "14336x4096:int8", "1x14336:f32",
                         with_mlir=False)
    assert res.ok, res.summary()


#: the K = 14336 standard cases take 8-30 s each to compile (large unrolled blocks): slow-marked
FUSED_AOT = [pytest.param(args, marks=[pytest.mark.slow] if "x14336:bf16" in args[0] else [])
             for _, args, _ in qmm.STANDARD_CASES_W8A8] + [
    ("256x4160:bf16", "640x4160:i8", "1x640:f32"),  # K tail (4160 = 2 * 2048 + 64), N tail, 2 row parts
    ("256x4160:bf16", "640x4160:float8_e4m3fn", "1x640:f32"),
]


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("args", FUSED_AOT, ids=lambda a: a[1].split(":")[1] + "-" + a[0] if isinstance(a, tuple) else None)
def test_compile_only_fused_w8a8(chip, args):
    """Mosaic compiles the fused w8a8 kernel at the shipped config (or heuristic) where the chip has the
    pair, within the VMEM limit it requests; ChipError where it does not."""
    kernel = qmm.quantized_matmul_w8a8_kernel
    wd = qmm.dtype_name(_spec(args[1], "w").dtype)
    if ("int8" if wd == "int8" else "fp8", wd) not in qmm.supported_modes(chip):
        with pytest.raises(ChipError, match=chip):
            tk.compile_for(kernel, chip, *args, with_mlir=False)
        return
    specs = tuple(_spec(a, n) for a, n in zip(args, ("x", "w_q", "w_scale")))
    got = db.lookup(kernel, chip, specs, (("out_dtype", None),))
    cfg = got[0] if got else (dict(bm=128, bk=2048, bn=128) if args[0].startswith("256x") else None)
    res = tk.compile_for(kernel, chip, *args, config=cfg, with_mlir=False)
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 0)


# ----------------------------------------------------------------------------------------------- HF transformers
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _fake_quant_(model, dtype):
    """Stock modules with each quantized Linear's weight replaced by its dequantized value (float32 exact)."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if type(mod) is torch.nn.Linear and not name.endswith("lm_head"):
                q, s = qmm.quantize_weight(mod.weight, dtype)
                mod.weight.copy_((q.float() * s[:, None]))


def test_apply_tpukernels_quantize_llama():
    """w8a16 int8 Llama: (1) equal to the stock model run with the same dequantized weights up to f32
    rounding (2e-4, the tolerance of the other HF tests: f32 accumulation in a different order through two
    layers); (2) within 5% of the logits' RMS of the unquantized model (int8 per-channel weights: each
    weight off by at most half a step, 1/254 of its row's max, ~0.1-0.3% per matmul here). lm_head stays float."""
    import tpukernels.integrations.transformers as tki

    stock, fake, model = _tiny_llama(), _tiny_llama(), _tiny_llama()
    _fake_quant_(fake, "int8")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, want_fq = stock(input_ids=ids).logits.double(), fake(input_ids=ids).logits.double()
    counts = tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize="int8")
    assert counts["quantized"] == 2 * 7  # q, k, v, o, gate, up, down per layer; not lm_head
    assert isinstance(model.model.layers[0].mlp.up_proj, qmm.TPUQuantLinear)
    assert type(model.lm_head) is torch.nn.Linear
    with torch.no_grad():
        got = model(input_ids=ids).logits.double()
    torch.testing.assert_close(got, want_fq, rtol=2e-4, atol=2e-4)
    rms = want.pow(2).mean().sqrt()
    assert (got - want).pow(2).mean().sqrt() <= 0.05 * rms
    # w8a8: activations quantized too (per token, 1/254 of each row's max): looser, 10% of the RMS
    model8 = _tiny_llama()
    tki.apply_tpukernels(model8, attention=False, rms_norm=False, quantize="int8", x_quant="int8")
    with torch.no_grad():
        got8 = model8(input_ids=ids).logits.double()
    assert (got8 - want).pow(2).mean().sqrt() <= 0.10 * rms


def test_bench_tpu_inference_column_traces_its_kernel_at_its_tuned_blocks():
    """The tpu-inference column is its own quantized_matmul_kernel, traced for the target chip at the blocks its
    tuned table gives the full problem (a w8a16 row borrows the chip's w8a8 entry; no entry: our blocks), the
    token block cut to the estimated rows; rows libtpu cannot estimate raise before any import."""
    import jax

    pytest.importorskip("tpu_inference.kernels.quantized_matmul.kernel")
    from tpu_inference.kernels.quantized_matmul import tuned_block_sizes as T

    from tpukernels.bench import quantized_matmul as bq
    from tpukernels.bench.core import EstimateError

    assert bq.tpu_inference_blocks(T, 6, 8192, 14336, 4096, "int8", "int8") == (T.TunedValue(2048, 1792, 4096),
                                                                              "its tuned table")
    tv, src = bq.tpu_inference_blocks(T, 6, 8192, 14336, 4096, None, "int8")
    assert tv == T.TunedValue(2048, 1792, 4096) and "int8 x int8" in src
    assert bq.tpu_inference_blocks(T, 5, 8192, 14336, 4096, None, "int8")[0] is None  # no v5e table

    class Recorder:  # stands in for the estimator: keeps the program it is asked about
        def cycles(self, fn, structs, chip):
            self.fn, self.structs, self.chip = fn, structs, chip
            return 1000

    def row(chip, op, shape):
        case = next(c for c in bq.cases([chip]) if c.op == op and c.shape == shape)
        return next(i for i in case.impls if i.name == bq.TPU_INFERENCE)

    est = Recorder()
    cyc, cfg = row("v6e", "w8a16 int8", "8192x4096 @ (14336x4096).T").cycles(est, "v6e")
    assert cyc == 4000  # estimated at 2048 of the 8192 tokens, x4 like every implementation of the row
    assert cfg.startswith("batch_block_size=2048,out_block_size=1792,in_block_size=4096,")
    assert [s.shape for s in est.structs] == [(2048, 4096), (14336, 4096), (14336,)]
    assert jax.eval_shape(est.fn, *est.structs).shape == (2048, 14336)
    _, cfg = row("v5e", "w8a16 int8", "64x4096 @ (14336x4096).T").cycles(est, "v5e")  # no table: our blocks
    assert "source=our blocks" in cfg and cfg.startswith("batch_block_size=64,")
    assert jax.eval_shape(est.fn, *est.structs).shape == (64, 14336)
    assert T.get_tpu_version() == -1  # the chip's generation only while tracing

    class FailsFirst(Recorder):  # libtpu cannot estimate its table's blocks: our blocks, and the row says so
        def cycles(self, fn, structs, chip):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 1:
                raise EstimateError("Ran out of memory in memory space vmem")
            return super().cycles(fn, structs, chip)

    est = FailsFirst()
    _, cfg = row("v6e", "w8a16 int8", "8192x4096 @ (14336x4096).T").cycles(est, "v6e")
    assert est.calls == 2 and ",source=our blocks (libtpu could not estimate its tuned table's int8 x int8 entry " \
        "(batch_block_size=2048,out_block_size=1792,in_block_size=4096): Ran out of memory" in cfg
    with pytest.raises(EstimateError, match="LLO type check"):
        row("tpu7x", "w8a8 float8_e4m3fn", "8192x4096 @ (14336x4096).T").cycles(est, "tpu7x")


# ----------------------------------------------------------------------------------------------- bench + model
def test_bench_cases_and_peaks():
    """The bench family builds a case per (shape, mode the chip has); w8a8 rooflines use tpu_info's peaks."""
    from tpukernels import perf
    from tpukernels.autotune.model import compute_dtype
    from tpukernels.bench import quantized_matmul as bq
    from tpukernels.chips import get_chip

    cs = bq.cases(["v5e", "tpu7x"])
    ops = {(c.chip, c.op) for c in cs}
    assert ("v5e", "w8a8 int8") in ops and ("tpu7x", "w8a8 float8_e4m3fn") in ops
    assert ("tpu7x", "w8a8 int8") not in ops
    # block-scaled rows: w4a16 at the decode shapes everywhere, fp8 blocks with the chip's fp8 pair (tpu_info)
    assert {("v5e", "w4a16 int4 g128"), ("tpu7x", "w4a16 int4 g128"), ("v5e", "fp8 block float8_e5m2 1x128/128x128"),
            ("tpu7x", "fp8 block float8_e4m3fn 1x128/128x128")} <= ops
    assert all(c.shape.startswith(("16x", "64x")) for c in cs if c.op.startswith("w4a16"))
    assert all([i.name for i in c.impls][:1] == ["tpukernels"] for c in cs)
    # tpu-inference's quantized matmul is a column wherever it has the op (not w4a16: its 4-bit case is fp8 x fp4)
    assert all((bq.TPU_INFERENCE in [i.name for i in c.impls]) == (not c.op.startswith("w4a16")) for c in cs)
    for chip in CHIPS:
        info = get_chip(chip).info
        assert perf.peak_flops(chip, "int8") == (info.int8_ops_per_second or info.bf16_ops_per_second)
    assert perf.peak_flops("v5e", "int8") == 2 * perf.peak_flops("v5e")
    # the tuner's model: per-channel f32 scales do not make it an f32 matmul
    spec = lambda s, d: tk.TensorSpec(s, qmm.jnp_dtype(d))  # noqa: E731
    w8a16 = [spec((64, 512), "bfloat16"), spec((256, 512), "int8"), spec((1, 256), "float32")]
    assert compute_dtype(w8a16) == "bfloat16"
    assert compute_dtype([spec((64, 512), "int8"), spec((256, 512), "int8"), spec((1, 256), "float32"),
                          spec((64, 1), "float32")]) == "int8"
    # small f32 inputs (norm weights, lse / g columns) are not MXU operands; two f32 operands are
    assert compute_dtype([spec((64, 64), "bfloat16"), spec((1, 64), "float32")]) == "bfloat16"
    assert compute_dtype([spec((256, 64), "bfloat16"), spec((512, 64), "bfloat16"), spec((256, 1), "int32"),
                          spec((256, 1), "float32"), spec((256, 1), "float32")]) == "bfloat16"
    assert compute_dtype([spec((64, 64), "float32"), spec((64, 64), "bfloat16")]) == "float32"
    assert compute_dtype([spec((64, 64), "float32"), spec((64, 64), "float32"), spec((8,), "int32")]) == "float32"
