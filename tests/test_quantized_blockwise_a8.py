"""Block-quantized 8-bit activations (tpukernels.library.quantized_matmul_ops.blockwise_a8, issue 28): fp8 x fp8 with
1 x bs activation blocks and bs x bs (DeepSeek-V3 128 x 128) weight blocks, w4a8 (int4 unpacked to int8) and w8a8
int8 with per-block activation scales, through ``quantized_matmul_blockwise(..., x_quant=...)``.

Accuracy criterion: elementwise against the float64 product of the dequantized operands (``x' = x_q * x_scale``
with the kernel's own ``x_q, x_scale``, which equal ``quantize_per_block_reference`` bit for bit in interpret
mode, checked), ``|y - ref| <= error_bound_blockwise_a8(...)`` (the module docstring's bound).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tpukernels as tk
import tpukernels.library  # noqa: F401
from tpukernels.errors import ArgumentError, ChipError, DTypeError

qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")
SMALL = dict(bm=128, bk=256, bn=128)


@pytest.fixture(autouse=True)
def _no_target_chip(monkeypatch):
    monkeypatch.delenv("TPUKERNELS_TARGET_CHIP", raising=False)


def _weights(N, G, bs, fmt, asym, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, G * bs, generator=g) * (1 + torch.rand(N, G, generator=g).repeat_interleave(bs, 1) * 4)
    q, s, z = qmm.quantize_weight_blockwise(w, bs, fmt if fmt in ("int4", "fp4") else "int8", asymmetric=asym)
    if fmt.startswith("float8"):
        q = (q.float() / 4).to(getattr(torch, fmt))
    return q, s, z


def _check(y, x, q, s, bs, z, fmt, out_dtype=torch.bfloat16):
    """y against the float64 reference of the dequantized operands; x quantized by the reference quantizer (the
    kernel's, bit for bit: test_quantize_kernel_matches_reference)."""
    K_w = s.shape[0] * bs
    xp = torch.nn.functional.pad(x.reshape(-1, x.shape[-1]).float(), (0, K_w - x.shape[-1]))
    xq, xs = qmm.quantize_per_block_reference(xp, "int8" if fmt in ("int8", "int4") else fmt, bs)
    ref = qmm.reference_blockwise_a8(xq, xs, q, s, bs, z)
    bound = qmm.error_bound_blockwise_a8(xq, xs, q, s, bs, z, out_dtype)
    y2 = y.reshape(ref.shape).double()
    assert torch.isfinite(y2).all()
    bad = (y2 - ref).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements outside the bound"
    return ref


@given(M=st.integers(1, 40), N=st.integers(1, 300), G=st.integers(1, 5), bs=st.sampled_from([32, 64, 128, 256]),
       fmt=st.sampled_from(["float8_e4m3fn", "float8_e5m2", "int8", "int4"]), asym=st.booleans(),
       pad=st.integers(0, 31), f32=st.booleans())
@settings(max_examples=2)  # + 2 explicit examples; each draws two kernel compiles (~2-4 s)
@example(M=9, N=136, G=3, bs=128, fmt="float8_e4m3fn", asym=False, pad=7, f32=False)
@example(M=3, N=40, G=4, bs=64, fmt="int4", asym=True, pad=5, f32=True)
def test_a8_within_bound(M, N, G, bs, fmt, asym, pad, f32):
    """Every pair, int4 zero points or not, K padded by the rule (``pad`` missing columns of x: zero columns
    before quantization), tails in M / N, several K steps (bk=256), bf16 / f32 activations and outputs."""
    q, s, z = _weights(N, G, bs, fmt, asym and fmt == "int4", seed=M * 131 + N + G)
    x = torch.randn(M, G * bs - pad, generator=torch.Generator().manual_seed(M + N)) * 3
    x = x.float() if f32 else x.bfloat16()
    xq = "int8" if fmt in ("int8", "int4") else "fp8"
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=bs, w_zero_point=z, config=SMALL, x_quant=xq)
    assert y.dtype == x.dtype and y.shape == (M, N)
    _check(y, x, q, s, bs, z, fmt, x.dtype)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int8"])
def test_quantize_kernel_matches_reference(dtype):
    """quantize_per_block_kernel == quantize_per_block_reference bit for bit (cpu interpret), a zero block gets
    s = 0 and q = 0, and the per-block dequantization error is within half a grid step (int8) / 2^-4 (e4m3fn) or
    2^-3 (e5m2) relative to the block's absmax."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 384, generator=g) * torch.logspace(-3, 3, 384)).bfloat16()
    x[5, 128:256] = 0
    q, s = qmm.quantize_per_block_kernel(x, dtype, 128)
    qr, sr = qmm.quantize_per_block_reference(x.float(), dtype, 128)
    assert q.dtype == getattr(torch, dtype) and s.shape == (37, 3)
    assert torch.equal(s, sr) and torch.equal(q.float(), qr.float())
    assert s[5, 1] == 0 and (q[5, 128:256].float() == 0).all()
    deq = q.double() * s.double().repeat_interleave(128, 1)
    amax = x.double().abs().reshape(37, 3, 128).amax(-1).repeat_interleave(128, 1)
    tol = {"int8": amax / 127 * (0.5 + 2**-14), "float8_e4m3fn": amax * 2.0**-4,
           "float8_e5m2": amax * 2.0**-3}[dtype]
    assert ((deq - x.double()).abs() <= tol).all()


def test_a8_interpret_modes(interpret):
    """Two K steps (int4, bk=256 of bs=128: the dynamic lane pick of x_scale's column), N and M tails, f32 output;
    "tpu" mode poisons the padding of partial blocks (and of x_scale's block rows past M) with NaN: results stay
    within the bound."""
    q, s, z = _weights(136, 4, 128, "int4", True, seed=5)
    x = torch.randn(2, 20, 4 * 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=128, w_zero_point=z, out_dtype="float32",
                                       config=dict(bm=32, bk=256, bn=128), x_quant="int8")
    assert y.dtype == torch.float32 and y.shape == (2, 20, 136)
    _check(y, x, q, s, 128, z, "int4", torch.float32)


def test_square_block_scales_deepseek_layout():
    """A 2-D w_scale [ceil(N/128), K/128] (DeepSeek-V3's weight_scale_inv, N not a multiple of 128) means one scale
    per 128 x 128 block: the same result as the expanded [G, 1, N] layout, within the bound of that weight."""
    g = torch.Generator().manual_seed(3)
    N, K = 200, 256
    inv = torch.rand(2, 2, generator=g) + 0.1
    w_q = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn)
    x = torch.randn(7, K, generator=g).bfloat16()
    y2 = qmm.quantized_matmul_blockwise(x, w_q, inv, block_size=128, x_quant="fp8")
    s3 = qmm.expand_block_scale(inv, N, 128)
    assert s3.shape == (2, 1, N) and float(s3[1, 0, 199]) == float(inv[1, 1]) and float(s3[0, 0, 127]) == float(
        inv[0, 0])
    y3 = qmm.quantized_matmul_blockwise(x, w_q, s3, block_size=128, x_quant="fp8")
    assert torch.equal(y2, y3)
    _check(y2, x, w_q, s3, 128, None, "float8_e4m3fn")
    with pytest.raises(ArgumentError, match=r"w_scale \(square blocks, 2-D\) must have shape .* = \(2, 2\), got "
                                            r"\(2, 1\)"):
        qmm.quantized_matmul_blockwise(x, w_q, inv[:, :1], block_size=128, x_quant="fp8")
    with pytest.raises(ArgumentError, match=r"w_scale \(square 128x128 blocks\) has 1 rows"):
        qmm.quantized_matmul_blockwise(x, w_q, inv[:1], block_size=128, x_quant="fp8")


def test_bound_is_sharp():
    """Scaling each group's partial sum by one per-token scale (the whole row's absmax instead of the block's:
    what a per-token w8a8 path computes) misses the per-block reference by more than the bound."""
    q, s, _ = _weights(64, 4, 128, "float8_e5m2", False, seed=8)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(4)) * torch.tensor([1e-3, 1, 1e2, 1e-1]
                                                                                        ).repeat_interleave(128)
    xq, xs = qmm.quantize_per_block_reference(x, "float8_e5m2", 128)
    q_tok, s_tok = qmm.quantize_reference(x, "float8_e5m2")  # one scale per token
    naive = (q_tok.double() * s_tok.double()[:, None]) @ qmm.dequantize_blockwise(q, s, 128).T
    bound = qmm.error_bound_blockwise_a8(xq, xs, q, s, 128, form="groups")  # 16 tokens: the decode (group) form
    ref = qmm.reference_blockwise_a8(xq, xs, q, s, 128)
    assert ((naive - ref).abs() > bound).any()
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=128, x_quant="fp8")
    assert not ((y.double() - ref).abs() > bound).any()


def test_a8_bad_input_typed_errors():
    q8, s8, _ = _weights(64, 2, 128, "int8", False, seed=1)
    q4, s4, z4 = _weights(64, 2, 128, "int4", True, seed=1)
    qf, sf, _ = _weights(64, 2, 128, "float8_e5m2", False, seed=1)
    x = torch.randn(4, 256).bfloat16()
    with pytest.raises(DTypeError, match="x_quant='fp8' needs float8, int4 or fp4 w_q, got int8"):
        qmm.quantized_matmul_blockwise(x, q8, s8, block_size=128, x_quant="fp8")
    with pytest.raises(DTypeError, match="x_quant='int8' needs int8 or int4 w_q, got float8_e5m2"):
        qmm.quantized_matmul_blockwise(x, qf, sf, block_size=128, x_quant="int8")
    with pytest.raises(DTypeError, match="x_quant='int8' needs int8 or int4 w_q, got fp4"):
        qmm.quantized_matmul_blockwise(x, q4, s4, block_size=128, weight_format="fp4", x_quant="int8")
    with pytest.raises(ArgumentError, match="x_quant 'int4' is not one of"):
        qmm.quantized_matmul_blockwise(x, q8, s8, block_size=128, x_quant="int4")
    xq, xs = qmm.quantize_per_block_reference(x.float(), "int8", 128)
    with pytest.raises(ArgumentError, match=r"x_scale must have shape \(M, K/block_size\) = \(4, 2\)"):
        qmm.quantized_matmul_blockwise_a8_kernel(xq, xs[:, :1], q8, s8, None, 128)
    with pytest.raises(DTypeError, match="x_scale must be float32"):
        qmm.quantized_matmul_blockwise_a8_kernel(xq, xs.bfloat16(), q8, s8, None, 128)
    with pytest.raises(DTypeError, match="x_q dtype bfloat16 is not one of"):
        qmm.quantized_matmul_blockwise_a8_kernel(x, xs, q8, s8, None, 128)
    with pytest.raises(DTypeError, match="int8 x_q needs int8 or int4 w_q, got float8_e5m2"):
        qmm.quantized_matmul_blockwise_a8_kernel(xq, xs, qf, sf, None, 128)
    with pytest.raises(DTypeError, match="int8 x_q needs int8 or int4 w_q, got fp4"):  # w4a8 int8 is int4 only
        qmm.quantized_matmul_blockwise_a8_kernel(xq, xs, q4, s4, None, 128, None, "fp4")
    xq8, xs8 = qmm.quantize_per_block_reference(x.float(), "float8_e4m3fn", 128)
    with pytest.raises(DTypeError, match="float8_e4m3fn x_q needs w_q of the same fp8 dtype or packed int4 / fp4, "
                                         "got float8_e5m2"):
        qmm.quantized_matmul_blockwise_a8_kernel(xq8, xs8, qf, sf, None, 128)
    with pytest.raises(DTypeError, match="float8_e4m3fn x_q needs w_q .* got int8"):
        qmm.quantized_matmul_blockwise_a8_kernel(xq8, xs8, q8, s8, None, 128)
    with pytest.raises(ArgumentError, match="w_zero_point is for int4 weights"):  # fp4 has no zero points, with fp8 activations too
        qmm.quantized_matmul_blockwise(x, q4, s4, block_size=128, w_zero_point=z4, weight_format="fp4",
                                       x_quant="fp8")
    with pytest.raises(ArgumentError, match=r"w_zero_point must have shape"):
        qmm.quantized_matmul_blockwise_a8_kernel(xq, xs, q4, s4, z4[:1], 128)
    with pytest.raises(ArgumentError, match="not a multiple of block_size = 128"):
        qmm.quantize_per_block_kernel(x[:, :200], "int8", 128)
    # the K padding rule holds with x_quant too
    with pytest.raises(ArgumentError, match="padding rule"):
        qmm.quantized_matmul_blockwise(x[:, :100], q8, s8, block_size=128, x_quant="int8")


@pytest.mark.parametrize("chip,fmt,x_quant", [("tpu7x", "int4", "int8"), ("tpu7x", "int8", "int8"),
                                              ("v6e", "float8_e4m3fn", "fp8")])
def test_pair_the_chip_lacks_raises_chip_error(monkeypatch, chip, fmt, x_quant):
    """jax's tpu_info: tpu7x has no (int8, int8) MXU pair (so no w4a8 / w8a8), v6e no float8_e4m3fn: ChipError
    naming the chip and what it supports, before any kernel runs."""
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", chip)
    q, s, z = _weights(64, 2, 128, fmt, False, seed=1)
    want = {"int4": r"int4 weights \(w4a8", "int8": "int8 weights", "float8_e4m3fn": "float8_e4m3fn weights"}[fmt]
    with pytest.raises(ChipError, match=rf"{want}.*not supported on {chip}.*supported on {chip}: "):
        qmm.quantized_matmul_blockwise(torch.randn(4, 256), q, s, block_size=128, x_quant=x_quant)


def test_no_gradient_through_quantized_x():
    """The forward runs with x.requires_grad (inference without no_grad); a backward that reaches it raises."""
    q, s, _ = _weights(64, 2, 128, "int8", False, seed=1)
    x = torch.randn(4, 256, requires_grad=True)
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=128, x_quant="int8")
    _check(y.detach(), x.detach(), q, s, 128, None, "int8", torch.float32)
    with pytest.raises(ArgumentError, match="has no gradient"):
        y.sum().backward()


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only_a8(chip):
    """Mosaic + XLA:TPU compile the a8 kernel and the per-block quantization for each pair the chip has (decode
    16 x 4096 -> 14336; int4 with zero points), and refuse the others with ChipError."""
    kern = qmm.quantized_matmul_blockwise_a8_kernel
    modes = qmm.supported_modes(chip)
    cases = [("float8_e4m3fn", "fp8"), ("float8_e5m2", "fp8"), ("int8", "int8"), ("u8", "int8")]
    for wd, xq in cases:
        xd = "i8" if xq == "int8" else wd
        ok = ((xq, "int8") if wd == "u8" else (xq, "int8" if wd == "int8" else wd)) in modes
        for M, N in ((16, 14336),):
            wcols = 2048 if wd == "u8" else 4096
            args = [f"{M}x4096:{xd}", f"{M}x32:f32", f"{N}x{wcols}:{'i8' if wd == 'int8' else wd}", f"32x1x{N}:f32"]
            if wd == "u8":
                args.append(f"32x1x{N}:f32")
            if not ok:
                with pytest.raises(ChipError, match=chip):
                    tk.compile_for(kern, chip, *args, with_mlir=False)
                continue
            res = tk.compile_for(kern, chip, *args, with_mlir=False)
            assert res.ok, res.summary()
            assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 0)
    res = tk.compile_for(qmm.quantize_per_block_kernel, chip, "1024x4096:bf16", "int8", 128, with_mlir=False)
    assert res.ok, res.summary()


@pytest.mark.parametrize("fmt,out_dtype", [("float8_e4m3fn", "bfloat16"), ("float8_e5m2", "float32")])
def test_a8_dequant_form(interpret, fmt, out_dtype):
    """The fp8 prefill forms: the a8 kernel's ``form="dequant"`` (both tiles dequantized to bf16 in VMEM, one dot
    per K step) and the prefill kernel the public op runs at M > 128 (x dequantized once by the quantization pass,
    the weight tile in VMEM): three K steps (the dynamic lane pick of x_scale's columns; each accumulator branch,
    first, middle and last, with its own dot), M and N tails, NaN-poisoned padding in "tpu" mode. The two give the
    same values bit for bit, within the dequant bound, and outside the group form's tighter one somewhere (they
    really round the operands to bf16)."""
    q, s, _ = _weights(200, 6, 128, fmt, False, seed=11)
    x = torch.randn(150, 6 * 128, generator=torch.Generator().manual_seed(6)).bfloat16() * 4
    blocks = dict(bm=64, bk=256, bn=128)
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=128, out_dtype=out_dtype, x_quant="fp8",
                                       config=dict(blocks, form="dequant"))
    xq, xs = qmm.quantize_per_block_kernel(x, fmt, 128)
    xd, xs2 = qmm.quantize_per_block_kernel(x, fmt, 128, True)
    assert xd.dtype == torch.bfloat16 and torch.equal(xs2, xs)
    assert torch.equal(xd, (xq.float() * xs.repeat_interleave(128, 1)).bfloat16())  # x' = bf16(x_q * x_scale)
    y_a8 = qmm.quantized_matmul_blockwise_a8_kernel(xq, xs, q, s, None, 128, out_dtype,
                                                    config=dict(blocks, form="dequant"))
    y_pre = qmm.quantized_matmul_blockwise_a8_prefill_kernel(xd, q, s, 128, out_dtype, config=blocks)
    assert torch.equal(y_pre, y_a8) and torch.equal(y, y_pre)
    xq, xs = qmm.quantize_per_block_reference(x.float(), fmt, 128)
    ref = qmm.reference_blockwise_a8(xq, xs, q, s, 128)
    odt = getattr(torch, out_dtype)
    err = (y.double() - ref).abs()
    assert torch.isfinite(y.double()).all()
    assert not (err > qmm.error_bound_blockwise_a8(xq, xs, q, s, 128, None, odt, form="dequant")).any()
    assert (err > qmm.error_bound_blockwise_a8(xq, xs, q, s, 128, None, odt, form="groups")).any()


@given(M=st.integers(129, 300), N=st.integers(1, 300), G=st.integers(1, 5), bs=st.sampled_from([32, 64, 128, 256]),
       fmt=st.sampled_from(["float8_e4m3fn", "float8_e5m2"]), pad=st.integers(0, 31), f32=st.booleans())
@settings(max_examples=2)  # + 1 explicit example; each draws three kernel compiles (~3-6 s)
@example(M=200, N=136, G=3, bs=128, fmt="float8_e4m3fn", pad=7, f32=True)
def test_prefill_path_within_bound(M, N, G, bs, fmt, pad, f32):
    """The public op's fp8 prefill path (M > 128: the quantization pass writing x', then the prefill kernel) at
    random shapes: tails in M / N, several K steps, K padded by the rule, bf16 / f32 activations and outputs; within
    the dequant form's bound and bit-equal to the a8 kernel's dequant form on the same blocks."""
    q, s, _ = _weights(N, G, bs, fmt, False, seed=M * 131 + N + G)
    x = torch.randn(M, G * bs - pad, generator=torch.Generator().manual_seed(M + N)) * 3
    x = x.float() if f32 else x.bfloat16()
    blocks = dict(bm=128, bk=2 * bs, bn=128)
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=bs, config=blocks, x_quant="fp8")
    assert y.dtype == x.dtype and y.shape == (M, N)
    xp = torch.nn.functional.pad(x, (0, pad))
    xq, xs = qmm.quantize_per_block_kernel(xp, fmt, bs)
    y_a8 = qmm.quantized_matmul_blockwise_a8_kernel(xq, xs, q, s, None, bs, "float32" if f32 else "bfloat16",
                                                    config=dict(blocks, form="dequant"))
    assert torch.equal(y, y_a8)
    xq, xs = qmm.quantize_per_block_reference(xp.float(), fmt, bs)
    ref = qmm.reference_blockwise_a8(xq, xs, q, s, bs)
    bound = qmm.error_bound_blockwise_a8(xq, xs, q, s, bs, None, x.dtype, form="dequant")
    assert torch.isfinite(y.double()).all() and not ((y.double() - ref).abs() > bound).any()


def test_public_op_runs_the_prefill_kernel_where_the_rule_says(monkeypatch):
    """``prefill_form``: fp8 x fp8 at M > 128 on chips with an fp8 MXU rate (v6e, tpu7x) or none known; not v5e,
    decode, int8 or packed weights. The public op follows it, and a config with ``form="groups"`` keeps the a8
    kernel's group form."""
    from tpukernels.library.quantized_matmul_ops import blockwise_a8 as a8

    for chip, want in (("v6e", True), ("tpu7x", True), ("v5e", False)):
        assert a8.prefill_form(1024, "float8_e5m2", "fp8", tk.get_chip(chip)) is want
    assert a8.prefill_form(1024, "float8_e5m2", "fp8") is True  # no target chip (cpu interpret)
    assert not a8.prefill_form(128, "float8_e5m2", "fp8") and not a8.prefill_form(1024, "int8", "int8")
    assert not a8.prefill_form(1024, "int4", "fp8")
    ran = []
    for name in ("quantized_matmul_blockwise_a8_kernel", "quantized_matmul_blockwise_a8_prefill_kernel"):
        real = getattr(a8, name)
        monkeypatch.setattr(a8, name, lambda *a, _r=real, _n=name, **k: ran.append(_n) or _r(*a, **k))
    q, s, _ = _weights(128, 2, 128, "float8_e5m2", False, seed=3)
    x = torch.randn(136, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    for cfg, want in ((None, "prefill"), (dict(bm=64, bk=256, bn=128, form="groups"), "a8_kernel")):
        ran.clear()
        y = qmm.quantized_matmul_blockwise(x, q, s, block_size=128, x_quant="fp8", config=cfg)
        assert ran == [f"quantized_matmul_blockwise_{want}" if want == "a8_kernel" else
                       "quantized_matmul_blockwise_a8_prefill_kernel"]
        _check(y, x, q, s, 128, None, "float8_e5m2")
    ran.clear()
    qmm.quantized_matmul_blockwise(x[:16], q, s, block_size=128, x_quant="fp8")  # decode: the a8 kernel
    assert ran == ["quantized_matmul_blockwise_a8_kernel"]


def test_prefill_kernel_bad_input_typed_errors():
    q, s, _ = _weights(128, 2, 128, "float8_e5m2", False, seed=3)
    x = torch.randn(136, 256).bfloat16()
    with pytest.raises(ArgumentError, match="x must be the dequantized activations"):
        qmm.quantized_matmul_blockwise_a8_prefill_kernel(x.float(), q, s, 128)
    with pytest.raises(ArgumentError, match="x has K = 250 columns, w_q holds K_w = 256"):
        qmm.quantized_matmul_blockwise_a8_prefill_kernel(x[:, :250], q, s, 128)
    with pytest.raises(ArgumentError, match="'dequantize' must be bool"):
        qmm.quantize_per_block_kernel(x, "float8_e5m2", 128, 1)
    with pytest.raises(DTypeError, match="w_q must be float8"):
        qmm.quantized_matmul_blockwise_a8_prefill_kernel(x, q.float().to(torch.int8), s, 128)


def test_a8_prefill_heuristic_picks_dequant_for_fp8(monkeypatch):
    """Prefill (M > 128): fp8 takes the dequant form at bm=2048, bk=4096, bn=1024 on a 128 MiB-VMEM chip (v6e) and
    bm=1024 on tpu7x (64 MiB); int8, decode and v5e (no fp8 rate) keep the group form."""
    from tpukernels.library.quantized_matmul_ops import blockwise_a8 as a8

    f8 = torch.empty(1024, 512, dtype=torch.float8_e5m2)
    i8 = torch.empty(1024, 512, dtype=torch.int8)
    for chip, bm in (("v6e", 2048), ("tpu7x", 1024)):
        monkeypatch.setattr(a8, "target_chip", lambda c=chip: tk.get_chip(c))  # what a launch for chip sees
        assert a8._a8_heuristic(f8, None, None, None) == dict(bm=bm, bk=4096, bn=1024, form="dequant")
        assert a8._a8_heuristic(i8, None, None, None)["form"] == "groups"
        assert a8._a8_heuristic(f8[:16], None, None, None)["form"] == "groups"
    monkeypatch.setattr(a8, "target_chip", lambda: tk.get_chip("v5e"))  # no fp8 rate in tpu_info
    assert a8._a8_heuristic(f8, None, None, None)["form"] == "groups"


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v6e", "tpu7x"])
def test_a8_dequant_form_compiles(chip):
    """The dequant form at the prefill heuristic's blocks compiles (libtpu compile-only: real Mosaic) within the
    chip's VMEM: bm=2048 on v6e, 1024 on tpu7x."""
    r = tk.compile_for(qmm.quantized_matmul_blockwise_a8_kernel, chip, "2048x1024:float8_e5m2", "2048x8:f32",
                       "4096x1024:float8_e5m2", "8x1x4096:f32", with_mlir=False)
    assert r.ok, r.summary()
    assert r.config["form"] == "dequant" and r.config["bm"] == (2048 if chip == "v6e" else 1024)
    big = chip == "v6e"
    for K in (4096, 14336):  # one K step; several (a dot per accumulator branch)
        r = tk.compile_for(qmm.quantized_matmul_blockwise_a8_prefill_kernel, chip, f"2048x{K}:bf16",
                           f"4096x{K}:float8_e5m2", f"{K // 128}x1x4096:f32", with_mlir=False)
        assert r.ok, r.summary()
        assert r.config == dict(bm=1024, bk=4096 if K == 4096 else 2048, bn=2048 if big else 1024)


# ------------------------------------------------------------------ fp8 activations x packed int4 / fp4 weights
def _check_packed_fp8(y, x, q, s, bs, z, fmt, out_dtype):
    """y against the float64 reference of the dequantized operands, x quantized to float8_e4m3fn per 1 x bs block
    by the reference quantizer (the kernel's bit for bit: test_quantize_kernel_matches_reference)."""
    K_w = s.shape[0] * bs
    xp = torch.nn.functional.pad(x.reshape(-1, x.shape[-1]).float(), (0, K_w - x.shape[-1]))
    xq, xs = qmm.quantize_per_block_reference(xp, qmm.FP8_FOR_PACKED, bs)
    wf = "fp4" if fmt == "fp4" else None
    ref = qmm.reference_blockwise_a8(xq, xs, q, s, bs, z, weight_format=wf)
    bound = qmm.error_bound_blockwise_a8(xq, xs, q, s, bs, z, out_dtype, weight_format=wf)
    y2 = y.reshape(ref.shape).double()
    assert torch.isfinite(y2).all()
    bad = (y2 - ref).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements outside the bound, worst {float(((y2 - ref).abs() - bound).max())}"
    return ref, bound


@given(M=st.integers(1, 40), N=st.integers(1, 300), G=st.integers(1, 4), bs=st.sampled_from([32, 64, 128, 512]),
       fmt=st.sampled_from(["int4", "fp4"]), asym=st.booleans(), pad=st.integers(0, 31), f32=st.booleans())
@settings(max_examples=2)  # + 3 explicit examples; each draws two kernel compiles (~2-4 s)
@example(M=64, N=512, G=2, bs=512, fmt="fp4", asym=False, pad=0, f32=False)  # tpu-inference's w4a8 (fp4 x e4m3fn)
@example(M=64, N=512, G=2, bs=512, fmt="int4", asym=False, pad=0, f32=True)  # its int4_fp8 case, f32 activations
@example(M=9, N=136, G=3, bs=128, fmt="int4", asym=True, pad=7, f32=False)  # GPTQ-style zero points, K padded
def test_fp8_activations_with_packed_4bit_weights(M, N, G, bs, fmt, asym, pad, f32):
    """tpu-inference's blockwise int4 x fp8 and fp4 (e2m1) x fp8 cases (its test: block_size 512, x_q_dtype
    float8_e4m3fn, bf16 / f32 activations), which used to raise DTypeError: x quantized to float8_e4m3fn per
    1 x bs block, the nibbles decoded in VMEM; int4 zero points or not, K padded by the rule, M / N tails, several
    K steps (bk=256 where bs < 256). Within the a8 bound of the float64 product of the quantized operands."""
    q, s, z = _weights(N, G, bs, fmt, asym and fmt == "int4", seed=M * 131 + N + G)
    x = torch.randn(M, G * bs - pad, generator=torch.Generator().manual_seed(M + N)) * 3
    x = x.float() if f32 else x.bfloat16()
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=bs, w_zero_point=z, x_quant="fp8",
                                       weight_format="fp4" if fmt == "fp4" else None,
                                       config=dict(bm=128, bk=max(256, bs), bn=128))
    assert y.dtype == x.dtype and y.shape == (M, N)
    _check_packed_fp8(y, x, q, s, bs, z, fmt, x.dtype)


@pytest.mark.parametrize("fmt", ["int4", "fp4"])
def test_fp8_packed_interpret_modes(interpret, fmt):
    """Two K steps (the dynamic pick of x_scale's column), M and N tails, f32 output, 3-D x; "tpu" mode poisons
    the padding of partial blocks with NaN: results stay finite and within the bound. The bound is tight enough
    to tell the activation dtype: x quantized to float8_e5m2 instead misses it."""
    q, s, z = _weights(136, 4, 128, fmt, fmt == "int4", seed=5)
    x = torch.randn(2, 20, 4 * 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=128, w_zero_point=z, out_dtype="float32", x_quant="fp8",
                                       weight_format="fp4" if fmt == "fp4" else None,
                                       config=dict(bm=32, bk=256, bn=128))
    assert y.dtype == torch.float32 and y.shape == (2, 20, 136)
    _, bound = _check_packed_fp8(y, x, q, s, 128, z, fmt, torch.float32)
    xq5, xs5 = qmm.quantize_per_block_reference(x.reshape(40, 512).float(), "float8_e5m2", 128)
    other = qmm.reference_blockwise_a8(xq5, xs5, q, s, 128, z, weight_format="fp4" if fmt == "fp4" else None)
    assert ((y.reshape(40, 136).double() - other).abs() > bound).any()


@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_fp8_packed_needs_no_fp8_mxu_pair(monkeypatch, chip):
    """fp8 activations with int4 / fp4 weights run on the bf16 MXU: no ChipError on any chip (v6e has no
    float8_e4m3fn pair, tpu7x no int8 one), and the prefill heuristic keeps the group form for them."""
    from tpukernels.library.quantized_matmul_ops import blockwise_a8 as a8

    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", chip)
    for fmt in ("int4", "fp4"):
        a8.check_chip_a8("fp8", fmt, "test")
    monkeypatch.setattr(a8, "target_chip", lambda: tk.get_chip(chip))
    f8 = torch.empty(1024, 512, dtype=torch.float8_e4m3fn)
    assert a8._a8_heuristic(f8, None, torch.empty(64, 256, dtype=torch.uint8), None)["form"] == "groups"


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only_fp8_packed(chip):
    """Mosaic + XLA:TPU compile the int4 (zero points or not; decode) and fp4 (prefill) x float8_e4m3fn kernel
    and the float8_e4m3fn per-block quantization, on every chip."""
    kern = qmm.quantized_matmul_blockwise_a8_kernel
    for M, wf, zp in ((16, None, False), (16, None, True), (1024, "fp4", False)):
        args = [f"{M}x4096:float8_e4m3fn", f"{M}x32:f32", "4096x2048:u8", "32x1x4096:f32",
                "32x1x4096:f32" if zp else None]
        res = tk.compile_for(kern, chip, *args, 128, None, wf, with_mlir=False)
        assert res.ok, res.summary()
        assert res.config["form"] == "groups"
    res = tk.compile_for(qmm.quantize_per_block_kernel, chip, "1024x4096:bf16", "float8_e4m3fn", 128,
                         with_mlir=False)
    assert res.ok, res.summary()
