"""Block-wise (sub-channel) quantized matmul: w4a16 int4 (packed two per byte, optional zero points) and
block-scaled int8 / fp8 weights (tpukernels.library.quantized_matmul_ops.blockwise, issue 28).

Accuracy criterion: elementwise against the float64 product of the dequantized operands (x zero-padded by the
padding rule), ``|y - ref| <= error_bound_blockwise(...)`` (the module docstring's bound:
``u |ref| + (K_w + 2) u32 (|x| @ M^T)``, ``M = (|q'| + |z'|) |s|``). ``test_bound_is_sharp`` shows the bound
catches dequantizing the weight to bf16 before the dot.

Backward (``d_x = g @ W``, weights frozen; ``blockwise_bwd``): ``x.grad`` through torch.autograd against the float64
``g @ W`` of the dequantized weight, ``|d_x - ref| <= error_bound_blockwise_dx(...)``
(``u |ref| + (u_g + u32) (|g| @ |W|) + (2 N + 2) u32 (|g| @ M)``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tpukernels.library  # noqa: F401
from tpukernels.errors import ArgumentError, DTypeError

qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")
SMALL = dict(bm=128, bk=256, bn=128)


def _case(M, N, G, bs, fmt, asym, pad, seed, xdtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    K_w = G * bs
    w = torch.randn(N, K_w, generator=g) * (1 + torch.rand(N, G, generator=g).repeat_interleave(bs, 1) * 4)
    q, s, z = qmm.quantize_weight_blockwise(w, bs, fmt if fmt in ("int4", "fp4") else "int8", asymmetric=asym)
    if fmt.startswith("float8"):
        q = (q.float() / 4).to(getattr(torch, fmt))
    x = torch.randn(M, K_w - pad, generator=g).to(xdtype)
    return x, q, s, z


def _check(y, x, q, s, bs, z, out_dtype=None, fmt=None):
    ref = qmm.reference_blockwise(x, q, s, bs, z, fmt)
    bound = qmm.error_bound_blockwise(x, q, s, bs, z, out_dtype, fmt)
    assert y.shape == ref.shape
    bad = (y.double() - ref).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements outside the bound"


@given(M=st.integers(1, 40), N=st.integers(1, 300), G=st.integers(1, 6), bs=st.sampled_from([32, 64, 128, 256]),
       fmt=st.sampled_from(["int4", "int8", "float8_e4m3fn", "float8_e5m2", "fp4"]), asym=st.booleans(),
       pad=st.integers(0, 31), f32=st.booleans())
@settings(max_examples=5)  # + 2 explicit examples; each draws a new kernel compile (~3 s on one core)
@example(M=9, N=136, G=3, bs=64, fmt="fp4", asym=False, pad=7, f32=False)
@example(M=3, N=40, G=2, bs=32, fmt="int4", asym=True, pad=5, f32=True)
def test_blockwise_within_bound(M, N, G, bs, fmt, asym, pad, f32):
    """Every format, zero points or not, K padded by the rule (``pad`` missing columns of x), tails in M / N,
    bf16 and f32 activations."""
    x, q, s, z = _case(M, N, G, bs, fmt, asym and fmt == "int4", pad, seed=M * 131 + N + G,
                       xdtype=torch.float32 if f32 else torch.bfloat16)
    wf = "fp4" if fmt == "fp4" else None
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=bs, w_zero_point=z, config=SMALL, weight_format=wf)
    _check(y, x, q, s, bs, z, fmt=wf)


def test_fp4_codes_and_quantizer():
    """The 16 e2m1 codes decode to 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, in the kernel too (a one-hot
    x picks single weights); quantize_weight_blockwise('fp4') rounds to the nearest code value."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2, 2)  # [2, 32]: one group of 32
    w_q = qmm.pack_int4(codes, 32)
    s = torch.ones(1, 1, 2)
    want = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                        dtype=torch.float64).repeat(2, 2)
    assert torch.equal(qmm.dequantize_blockwise(w_q, s, 32, None, "fp4"), want)
    y = qmm.quantized_matmul_blockwise(torch.eye(32), w_q, s, block_size=32, weight_format="fp4")
    assert torch.equal(y.double(), want.T)
    w = torch.tensor([[0.26, -0.74, 2.4, 6.0] * 8])  # absmax 6: s = 1
    q, sc, _ = qmm.quantize_weight_blockwise(w, 32, "fp4")
    assert float(sc[0, 0, 0]) == 1.0
    W = qmm.dequantize_blockwise(q, sc, 32, None, "fp4")
    assert torch.equal(W[0, :4], torch.tensor([0.5, -0.5, 2.0, 6.0], dtype=torch.float64))
    with pytest.raises(DTypeError, match="weight_format 'fp4' does not fit w_q of dtype int8"):
        qmm.quantized_matmul_blockwise(torch.eye(32), codes.to(torch.int8), s, block_size=32, weight_format="fp4")


def test_int4_interpret_modes(interpret):
    """Several K steps (bk=256 of bs=64: four groups per step), N and M tails; "tpu" mode poisons the padding
    of partial blocks with NaN: results stay within the bound (tails never reach valid outputs)."""
    x, q, s, z = _case(40, 136, 8, 64, "int4", True, 0, seed=5)
    y = qmm.quantized_matmul_blockwise(x[None], q, s, block_size=64, w_zero_point=z, out_dtype="float32",
                                       config=dict(bm=32, bk=256, bn=128))
    assert y.dtype == torch.float32 and y.shape == (1, 40, 136)
    _check(y[0], x, q, s, 64, z, torch.float32)


def test_bound_is_sharp():
    """Rounding the dequantized weight to bf16 before a single dot (what a naive dequantize-then-matmul does)
    breaks the bound; the kernel's per-group dot of exact integers does not."""
    x, q, s, z = _case(16, 128, 4, 128, "int4", True, 0, seed=9, xdtype=torch.float32)
    W = qmm.dequantize_blockwise(q, s, 128, z).float().bfloat16().double()
    naive = x.double() @ W.T
    bound = qmm.error_bound_blockwise(x, q, s, 128, z, torch.float32)
    assert ((naive - qmm.reference_blockwise(x, q, s, 128, z)).abs() > bound).any()
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=128, w_zero_point=z, config=SMALL)
    _check(y, x, q, s, 128, z)


def test_pack_unpack_and_layout():
    """pack_int4's documented order: byte j of group g holds columns g*bs + j (low) and g*bs + bs/2 + j (high)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (3, 128), generator=g, dtype=torch.uint8)
    p = qmm.pack_int4(q, 64)
    assert p.shape == (3, 64) and p.dtype == torch.uint8
    assert torch.equal(qmm.unpack_int4(p, 64), q)
    assert int(p[1, 64 // 2 + 5]) == int(q[1, 64 + 5]) | (int(q[1, 64 + 32 + 5]) << 4)
    with pytest.raises(ArgumentError, match="0..15"):
        qmm.pack_int4(q.to(torch.int16) + 1, 64)


def test_int4n_pack_layout():
    """pack_int4(layout="n"): byte [i, k] holds q[2i, k] - 8 (low nibble) and q[2i + 1, k] - 8 (high) as two's
    complement int4, the order Mosaic's uint8 -> int4 bitcast unpacks (rows 2i, 2i + 1, low nibble first);
    round trip; typed errors."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (6, 64), generator=g, dtype=torch.uint8)
    p = qmm.pack_int4(q, 32, "n")
    assert p.shape == (3, 64) and p.dtype == torch.uint8
    assert torch.equal(qmm.unpack_int4(p, 32, "n"), q)
    assert int(p[1, 5]) == ((int(q[2, 5]) - 8) & 15) | (((int(q[3, 5]) - 8) & 15) << 4)
    assert torch.equal(qmm.int4n_to_k(p, 32), qmm.pack_int4(q, 32))
    with pytest.raises(ArgumentError, match="N = 5 of q must be even"):
        qmm.pack_int4(q[:5], 32, "n")
    with pytest.raises(ArgumentError, match="layout 'm'"):
        qmm.pack_int4(q, 32, "m")
    # a layout mix-up never runs: the shapes cannot agree with x and w_scale ([G, 1, N])
    s = torch.ones(2, 1, 6)
    with pytest.raises(ArgumentError, match="padding rule"):
        qmm.quantized_matmul_blockwise(torch.ones(2, 64), p, s, block_size=32)  # int4n read as int4
    with pytest.raises(ArgumentError, match="padding rule"):
        qmm.quantized_matmul_blockwise(torch.ones(2, 64), qmm.pack_int4(q, 32), s, block_size=32,
                                       weight_format="int4n")  # int4 read as int4n
    bw = importlib.import_module("tpukernels.library.quantized_matmul_ops.blockwise")
    with pytest.raises(DTypeError, match="'int4n' .* is not taken here"):  # callers that take the K layout only
        bw.resolve_format(p, "grouped_matmul_quantized", "int4n")


def test_int4n_matches_mosaic_bitcast(interpret):
    """The layout's nibble / row order is the one pltpu.bitcast(uint8 -> int4) gives in a Pallas kernel (both
    interpret modes; the compile-only cases below lower the same op for v5e / v6e / tpu7x)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    q = torch.randint(0, 16, (64, 128), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    p = qmm.pack_int4(q, 128, "n")

    def body(w_ref, o_ref):
        o_ref[...] = pltpu.bitcast(w_ref[...], jnp.int4).astype(jnp.float32)

    params = pltpu.InterpretParams() if interpret == "tpu" else True
    out = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.float32), interpret=params)(
        jnp.asarray(p.numpy()))
    assert np.array_equal(np.asarray(out), q.numpy().astype(np.float32) - 8)


@given(M=st.integers(1, 40), N2=st.integers(1, 150), G=st.integers(1, 6), bs=st.sampled_from([32, 64, 128, 256]),
       asym=st.booleans(), pad=st.integers(0, 31), diag=st.booleans())
@settings(max_examples=4)  # + 1 explicit example; each draws a new kernel compile
@example(M=12, N2=68, G=4, bs=64, asym=True, pad=3, diag=True)
def test_int4n_within_bound(M, N2, G, bs, asym, pad, diag):
    """int4 packed along N: zero points or not, K padded by the rule, N tails (bn = 128: N = 2 * N2 rows), K
    steps, the decode form (one row block, M rounded up to a multiple of 8 as the form needs, bm * bk / bs <= 192
    rows) or per-group dots (M + 16 rows in blocks of 16: an M tail and several row blocks)."""
    M = -(-M // 8) * 8 if diag else M + 16
    g = torch.Generator().manual_seed(M * 131 + N2 + G)
    N, K_w = 2 * N2, G * bs
    w = torch.randn(N, K_w, generator=g)
    q, s, z = qmm.quantize_weight_blockwise(w, bs, "int4", asymmetric=asym, layout="n")
    x = torch.randn(M, K_w - pad, generator=g).bfloat16()
    cfg = dict(bm=48, bk=128, bn=128) if diag else dict(bm=16, bk=256, bn=128)
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=bs, w_zero_point=z, config=cfg, weight_format="int4n")
    _check(y, x, q, s, bs, z, fmt="int4n")


def test_int4n_interpret_modes(interpret):
    """int4n through both interpret modes ("tpu" poisons partial blocks with NaN): per-group dots with several
    K steps and N / M tails, and the decode form; equal to the K-packed weights' result within both bounds."""
    x, qk, s, z = _case(40, 136, 8, 64, "int4", True, 0, seed=5)
    q = qmm.pack_int4(qmm.unpack_int4(qk, 64), 64, "n")
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=64, w_zero_point=z, out_dtype="float32",
                                       config=dict(bm=32, bk=256, bn=128), weight_format="int4n")
    _check(y, x, q, s, 64, z, torch.float32, "int4n")
    y16 = qmm.quantized_matmul_blockwise(x[:16], q, s, block_size=64, w_zero_point=z, out_dtype="float32",
                                         config=dict(bm=16, bk=512, bn=128), weight_format="int4n")  # 128 rows
    _check(y16, x[:16], q, s, 64, z, torch.float32, "int4n")


def test_int4n_module_layouts_and_state_dict():
    """TPUBlockQuantLinear packs int4 along N by default (even out_features), along K for an odd one or on
    request; a state dict in the other layout is repacked at load (same forward), a wrong shape raises."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    mn = qmm.TPUBlockQuantLinear.from_linear(lin, 32, "int4")
    mk = qmm.TPUBlockQuantLinear.from_linear(lin, 32, "int4", int4_layout="k")
    assert (mn.fmt, tuple(mn.w_q.shape), mk.fmt, tuple(mk.w_q.shape)) == ("int4n", (24, 64), "int4", (48, 32))
    assert torch.equal(qmm.unpack_int4(mn.w_q, 32, "n"), qmm.unpack_int4(mk.w_q, 32))
    fresh = qmm.TPUBlockQuantLinear(64, 48, 32, "int4", bias=True)
    fresh.load_state_dict(mk.state_dict())  # an old (K-packed) checkpoint into the N-packed module
    assert fresh.fmt == "int4n" and torch.equal(fresh.w_q, mn.w_q)
    old = qmm.TPUBlockQuantLinear(64, 48, 32, "int4", bias=True, int4_layout="k")
    old.load_state_dict(mn.state_dict())
    assert torch.equal(old.w_q, mk.w_q)
    x = torch.randn(5, 64)
    with torch.no_grad():
        ref = qmm.reference_blockwise(x, mk.w_q, mk.w_scale, 32) + lin.bias.double()
        bound = qmm.error_bound_blockwise(x, mk.w_q, mk.w_scale, 32, None, torch.float32) + 2 * 2.0**-24 * ref.abs()
        assert ((fresh(x).double() - ref).abs() <= bound).all()
    bad = dict(mk.state_dict(), w_q=mk.w_q[:, :16])
    with pytest.raises(RuntimeError, match="size mismatch for w_q"):
        fresh.load_state_dict(bad)
    assert qmm.TPUBlockQuantLinear(64, 47, 32, "int4").fmt == "int4"  # odd N: packed along K
    with pytest.raises(ArgumentError, match="even out_features"):
        qmm.TPUBlockQuantLinear(64, 47, 32, "int4", int4_layout="n")


def test_bad_input_names_the_tensor():
    x, q, s, z = _case(4, 64, 2, 64, "int4", True, 0, seed=1)
    f = qmm.quantized_matmul_blockwise
    with pytest.raises(ArgumentError, match="block_size 48"):
        f(x, q, s, block_size=48, w_zero_point=z)
    with pytest.raises(ArgumentError, match="w_q .*not a multiple of block_size / 2"):
        f(x[:, :126], q[:, :63], s, block_size=64, w_zero_point=z)  # odd packed dimension
    with pytest.raises(ArgumentError, match=r"w_scale must have shape \(K/block_size, 1, N\) = \(2, 1, 64\)"):
        f(x, q, s.reshape(1, 2, 64), block_size=64, w_zero_point=z)
    with pytest.raises(ArgumentError, match=r"w_scale must have shape .* = \(4, 1, 64\)"):
        f(x, q, s, block_size=32, w_zero_point=z)  # block_size not what the scales were made for
    with pytest.raises(ArgumentError, match="w_zero_point must have shape"):
        f(x, q, s, block_size=64, w_zero_point=z[:1])
    with pytest.raises(DTypeError, match="w_zero_point must be float32"):
        f(x, q, s, block_size=64, w_zero_point=z.to(torch.uint8))
    with pytest.raises(DTypeError, match="w_scale must be float32"):
        f(x, q, s.bfloat16(), block_size=64)
    with pytest.raises(ArgumentError, match="padding rule"):
        f(x[:, :60], q, s, block_size=64)  # 60 <= 128 - 64: outside the rule
    x8, q8, s8, _ = _case(4, 64, 3, 64, "int8", False, 0, seed=2)
    with pytest.raises(ArgumentError, match="w_q has K = 160 columns, not a multiple of block_size = 64"):
        f(x8[:, :160], q8[:, :160], s8[:2], block_size=64)
    with pytest.raises(ArgumentError, match="w_zero_point is for int4"):
        f(x8, q8, s8, block_size=64, w_zero_point=torch.zeros(3, 1, 64))
    with pytest.raises(DTypeError, match="w_q dtype int16"):
        f(x8, q8.to(torch.int16), s8, block_size=64)


def test_block_quant_linear_pads_k():
    """TPUBlockQuantLinear.from_linear with in_features not a multiple of the block: K padded by the rule; its
    input gradient (the padded columns dropped) within the d_x bound."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(100, 48)
    m = qmm.TPUBlockQuantLinear.from_linear(lin, 32, "int4", asymmetric=True)
    assert m.fmt == "int4n" and m.w_q.shape == (24, 128) and m.w_scale.shape == (4, 1, 48)  # packed along N
    x = torch.randn(3, 100)
    with torch.no_grad():
        y = m(x)
    ref = qmm.reference_blockwise(x, m.w_q, m.w_scale, 32, m.w_zero_point, "int4n") + lin.bias.double()
    bound = qmm.error_bound_blockwise(x, m.w_q, m.w_scale, 32, m.w_zero_point, torch.float32, "int4n")
    assert ((y.double() - ref).abs() <= bound + 2 * 2.0**-24 * ref.abs()).all()  # + the f32 bias add
    xg = x.clone().requires_grad_()  # differentiable in the input (QLoRA): d_x of the 100 real columns
    gy = torch.randn(3, 48)
    m(xg).backward(gy)
    _check_dx(xg.grad, gy, m.w_q, m.w_scale, 32, m.w_zero_point, "int4n")
    assert m.w_scale.grad is None and lin.weight.grad is None


@pytest.mark.aot
@pytest.mark.parametrize("chip,args", [
    ("v6e", ("16x4096:bf16", "14336x2048:u8", "32x1x14336:f32", "32x1x14336:f32", 128)),  # w4a16 decode, zero points
    ("tpu7x", ("16x4096:bf16", "14336x2048:u8", "32x1x14336:f32", "32x1x14336:f32", 128)),
    ("v6e", ("256x4096:bf16", "4096x4096:i8", "32x1x4096:f32", None, 128)),  # block-scaled int8 prefill
    ("v6e", ("64x512:bf16", "256x256:u8", "16x1x256:f32", None, 32)),  # 32-column groups
    ("tpu7x", ("16x4096:bf16", "4096x2048:u8", "32x1x4096:f32", None, 128, None, "fp4")),  # e2m1 weights
    # int4 packed along N (Mosaic's bitcast unpack) at the heuristic's decode blocks: the block-diagonal form
    # (v6e, tpu7x), per-group dots (v5e; 64 tokens), zero points, prefill
    ("v5e", ("16x4096:bf16", "7168x4096:u8", "32x1x14336:f32", "32x1x14336:f32", 128, None, "int4n")),
    ("v6e", ("16x4096:bf16", "7168x4096:u8", "32x1x14336:f32", "32x1x14336:f32", 128, None, "int4n")),
    ("tpu7x", ("16x4096:bf16", "7168x4096:u8", "32x1x14336:f32", None, 128, None, "int4n")),
    ("tpu7x", ("64x14336:bf16", "2048x14336:u8", "112x1x4096:f32", None, 128, None, "int4n")),
    ("v6e", ("512x4096:bf16", "2048x4096:u8", "32x1x4096:f32", None, 128, None, "int4n")),
], ids=["int4-zp-v6e", "int4-zp-tpu7x", "int8-v6e", "int4-bs32-v6e", "fp4-tpu7x", "int4n-zp-v5e", "int4n-zp-v6e",
        "int4n-tpu7x", "int4n-64-tpu7x", "int4n-prefill-v6e"])
def test_compile_only(chip, args):
    """Mosaic + XLA:TPU compile the block-wise kernel (in-VMEM nibble unpack, [G, 1, N] scale blocks)."""
    import tpukernels as tk

    res = tk.compile_for(qmm.quantized_matmul_blockwise_kernel, chip, *args, with_mlir=False)
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 32 * 2**20)


# ----------------------------------------------------------------------------------------------- backward (d_x)
def _grad(x, q, s, bs, z, fmt, config=SMALL, seed=0):
    """``x.grad`` of ``(quantized_matmul_blockwise(x) * gy).sum()`` and the ``gy`` used (in ``y``'s dtype)."""
    x = x.detach().clone().requires_grad_()
    y = qmm.quantized_matmul_blockwise(x, q, s, block_size=bs, w_zero_point=z, config=config, weight_format=fmt)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    y.backward(gy)
    return x.grad, gy


#: explicit d_x blocks (the backward of a public call takes the heuristic's, which cover these small shapes in one
#: block): M tails (bm = 16) and several N steps with a masked tail (bn = 128) and K steps (bk = 256)
SMALL_DX = dict(bm=16, bk=256, bn=128)


def _dx_kernel(gy, q, s, bs, z, fmt, config=SMALL_DX):
    """The d_x kernel called directly (explicit blocks) on ``gy [..., N]`` -> ``[M, K_w]``."""
    return qmm.quantized_matmul_blockwise_bwd_dx(gy.reshape(-1, gy.shape[-1]), q, s, z, bs, None, fmt, config=config)


def _check_dx(dx, gy, q, s, bs, z, fmt=None):
    """``dx [..., K_x]`` against the float64 ``gy @ W`` (the padding rule: x's missing columns get no gradient)."""
    K_x = dx.shape[-1]
    ref = qmm.reference_blockwise_dx(gy, q, s, bs, z, fmt)[..., :K_x]
    bound = qmm.error_bound_blockwise_dx(gy, q, s, bs, z, None, fmt)[..., :K_x]
    assert dx.shape == ref.shape and dx.dtype == gy.dtype
    bad = (dx.double() - ref).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements outside the bound"


@given(M=st.integers(1, 40), N=st.integers(1, 300), G=st.integers(1, 6), bs=st.sampled_from([32, 64, 128, 256]),
       fmt=st.sampled_from(["int4", "int8", "float8_e4m3fn", "float8_e5m2", "fp4"]), asym=st.booleans(),
       pad=st.integers(0, 31), f32=st.booleans())
@settings(max_examples=4)  # + 2 explicit examples; each compiles a forward and a backward kernel
@example(M=9, N=300, G=4, bs=64, fmt="fp4", asym=False, pad=7, f32=False)  # 3 N steps, N tail, 2 K steps
@example(M=33, N=136, G=2, bs=128, fmt="int4", asym=True, pad=0, f32=True)
def test_blockwise_dx_within_bound(M, N, G, bs, fmt, asym, pad, f32):
    """d_x through torch.autograd for every format (zero points or not), bf16 and f32 activations, K padded by the
    rule (x's missing columns get no gradient), the heuristic's blocks (one block at these sizes: the tiled
    grid is test_blockwise_dx_kernel_blocks' and test_blockwise_dx_interpret_modes')."""
    x, q, s, z = _case(M, N, G, bs, fmt, asym and fmt == "int4", pad, seed=M * 17 + N + G,
                       xdtype=torch.float32 if f32 else torch.bfloat16)
    wf = "fp4" if fmt == "fp4" else None
    dx, gy = _grad(x, q, s, bs, z, wf, seed=M + N)
    assert dx.shape == x.shape
    _check_dx(dx, gy, q, s, bs, z, wf)


def test_blockwise_dx_kernel_blocks():
    """The d_x kernel at SMALL_DX blocks: an M tail (40 rows, bm = 16), several N steps with a masked tail (N = 300,
    bn = 128), several K steps (int8, int4), for formats test_blockwise_dx_interpret_modes does not tile (int8, fp4
    with 32-column groups: 16-lane halves, symmetric int4 with float32 g)."""
    for fmt, G, bs, gdt in (("int8", 4, 128, torch.bfloat16), ("fp4", 8, 32, torch.bfloat16),
                            ("int4", 8, 64, torch.float32)):
        x, q, s, z = _case(40, 300, G, bs, fmt, False, 0, seed=G + bs)
        wf = "fp4" if fmt == "fp4" else None
        gy = torch.randn(40, 300, generator=torch.Generator().manual_seed(bs)).to(gdt)
        dx = _dx_kernel(gy, q, s, bs, z, wf)
        assert dx.shape == (40, G * bs)
        _check_dx(dx, gy, q, s, bs, z, wf)


def test_blockwise_dx_interpret_modes(interpret):
    """The d_x kernel with several N steps and a tail (N = 300, bn = 128), several K steps, an M tail (bm = 32 of
    40): "tpu" mode poisons the padding of partial blocks with NaN (g's lanes, the scales', and the weight's rows:
    fp8 padding decodes to NaN), so d_x stays within the bound only if both operands are masked. int4 with zero
    points (two K steps) and float8_e5m2 (one)."""
    for fmt, asym, G in (("int4", True, 8), ("float8_e5m2", False, 4)):
        x, q, s, z = _case(40, 300, G, 64, fmt, asym, 0, seed=11)
        gy = torch.randn(40, 300, generator=torch.Generator().manual_seed(2)).bfloat16()
        dx = _dx_kernel(gy, q, s, 64, z, None, config=dict(bm=32, bk=256, bn=128))
        assert dx.shape == (40, G * 64)
        _check_dx(dx, gy, q, s, 64, z)


def test_blockwise_dx_bound_is_sharp_and_weights_frozen():
    """f32 gradients: rounding the dequantized weight to bf16 before the product breaks the d_x bound, the kernel
    does not. The weight side is frozen: a w_scale that requires grad gets none (documented None), and a
    QLoRA-style adapter next to the frozen layer receives its gradient."""
    x, q, s, z = _case(16, 256, 2, 128, "int4", True, 0, seed=4, xdtype=torch.float32)
    gy = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    W = qmm.dequantize_blockwise(q, s, 128, z)
    naive = gy.double() @ W.float().bfloat16().double()
    bound = qmm.error_bound_blockwise_dx(gy, q, s, 128, z)
    assert ((naive - qmm.reference_blockwise_dx(gy, q, s, 128, z)).abs() > bound).any()
    s = s.clone().requires_grad_()
    a = torch.nn.Linear(256, 4, bias=False)  # LoRA A (x -> rank 4); B folded into the loss
    xr = x.clone().requires_grad_()
    y = qmm.quantized_matmul_blockwise(xr, q, s, block_size=128, w_zero_point=z, config=SMALL)
    ((y * gy).sum() + a(xr).sum()).backward()
    assert s.grad is None and a.weight.grad is not None
    _check_dx(xr.grad - a.weight.sum(0), gy, q, s.detach(), 128, z)


def test_blockwise_dx_torch_compile_and_opcheck():
    """torch.compile (fullgraph, aot_eager: the backward traced through the op's fake kernel) gives eager's
    gradient bit for bit; torch.library.opcheck on the d_x op and on the forward op with x requiring grad
    (schema, fake kernel, autograd registration)."""
    x, q, s, z = _case(8, 96, 2, 64, "int4", True, 3, seed=6)
    f = lambda x: (qmm.quantized_matmul_blockwise(x, q, s, block_size=64, w_zero_point=z) ** 2).sum()  # noqa: E731
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    f(xe).backward()
    torch.compile(f, fullgraph=True, backend="aot_eager")(xc).backward()
    assert xc.grad is not None and torch.equal(xe.grad, xc.grad)
    ops = torch.ops.tpukernels
    gy = torch.randn(8, 96).bfloat16()
    torch.library.opcheck(ops.quantized_matmul_blockwise_bwd_dx, (gy, q, s, z, 64, None, None))
    xp = torch.nn.functional.pad(x, (0, 3)).requires_grad_()
    torch.library.opcheck(ops.quantized_matmul_blockwise_kernel, (xp, q, s, z, 64, None, None))


def test_blockwise_dx_bad_input_and_sharding():
    """The d_x kernel's typed errors (g's N, g's dtype, scale shape); empty problems (no kernel) still give a zero
    d_x of x's shape; the DTensor rule of the d_x op: over M, over K only
    when the mesh divides the scale groups, over N as a partial sum for a float32 output."""
    from tpukernels.distributed.sharding import _MESH_SHAPE, PARTIAL, Split, TensorMeta, splits_for

    x, q, s, z = _case(4, 64, 2, 64, "int4", True, 0, seed=1)
    k = qmm.quantized_matmul_blockwise_bwd_dx
    with pytest.raises(ArgumentError, match="g's N = 63 must equal w_q's rows N = 64"):
        k(torch.zeros(4, 63, dtype=torch.bfloat16), q, s, z, 64)
    with pytest.raises(DTypeError, match="g dtype int32"):
        k(torch.zeros(4, 64, dtype=torch.int32), q, s, z, 64)
    with pytest.raises(ArgumentError, match=r"w_scale must have shape \(K/block_size, 1, N\) = \(4, 1, 64\)"):
        k(torch.zeros(4, 64, dtype=torch.bfloat16), q, s, z, 32)
    for xe, qe, se, ze in ((x[:0], q, s, z), (x, q[:0], s[..., :0], z[..., :0])):  # no rows / no outputs: no kernel
        xe = xe.clone().requires_grad_()
        y = qmm.quantized_matmul_blockwise(xe, qe, se, block_size=64, w_zero_point=ze)
        y.sum().backward()
        assert y.shape == (xe.shape[0], qe.shape[0]) and torch.equal(xe.grad, torch.zeros_like(xe))
    meta = {"g": TensorMeta((64, 512), torch.float32), "w_q": TensorMeta((512, 128), torch.uint8),
            "w_scale": TensorMeta((2, 1, 512), torch.float32), "w_zero_point": TensorMeta((2, 1, 512), torch.float32),
            "block_size": 128, "out_dtype": None, "weight_format": None}
    over_m = Split({"g": 0}, (0,))
    over_k = Split({"w_q": 1, "w_scale": 0, "w_zero_point": 0}, (1,))
    over_n = Split({"g": 1, "w_q": 0, "w_scale": 2, "w_zero_point": 2}, (PARTIAL,))
    for mesh, want in (((2,), [over_m, over_k, over_n]), ((4,), [over_m, over_n])):  # 4 shards: 2 groups split
        token = _MESH_SHAPE.set(mesh)
        try:
            assert splits_for(k, meta) == want, mesh
            assert splits_for(k, {**meta, "g": TensorMeta((64, 512), torch.bfloat16)}) == want[:-1]
        finally:
            _MESH_SHAPE.reset(token)


@pytest.mark.aot
@pytest.mark.parametrize("chip,args", [
    ("v6e", ("512x4000:bf16", "4000x2048:u8", "32x1x4000:f32", "32x1x4000:f32", 128)),  # int4 zp, N tail (bn 1024)
    ("v6e", ("256x256:bf16", "256x256:u8", "16x1x256:f32", None, 32, None, "fp4")),  # 16-lane halves of 32-col groups
    # float32 g at the heuristic's largest f32 blocks on v5e's 16 MiB default scoped VMEM (the f32 dot's bf16 parts
    # are counted in the VMEM request: without them this overflowed)
    ("v5e", ("512x1024:f32", "1024x7168:u8", "112x1x1024:f32", None, 128, None, "fp4")),
], ids=["int4-zp-ntail-v6e", "fp4-bs32-v6e", "fp4-f32-v5e"])
def test_blockwise_dx_compile_only(chip, args):
    """Mosaic + XLA:TPU compile the d_x kernel (g * s per group, in-VMEM unpack, lane-sliced stores)."""
    import tpukernels as tk

    res = tk.compile_for(qmm.quantized_matmul_blockwise_bwd_dx, chip, *args, with_mlir=False)
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 32 * 2**20)


def test_decode_form_block_diagonal(interpret, monkeypatch):
    """Decode (one row block, bm * bk / bs <= diag_rows): every group's partial product from one dot with a
    block-diagonal x (blockwise._diag_part, traced: spied), two K steps (bk=256 of bs=64), an N tail, zero points
    (and fp4 in the fast mode); within the bound. 8 rows with diag_rows forced to 0 take the per-group form
    (not traced), within the bound too. "tpu" mode poisons the padding of the N tail with NaN."""
    bw = importlib.import_module("tpukernels.library.quantized_matmul_ops.blockwise")
    calls = []
    real = bw._diag_part
    monkeypatch.setattr(bw, "_diag_part", lambda *a, **k: calls.append(k["n_sub"]) or real(*a, **k))
    cfg = dict(bm=128, bk=256, bn=128)
    for fmt, asym in [("int4", True)] + ([("fp4", False)] if interpret == "fast" else []):
        x, q, s, z = _case(16, 200, 8, 64, fmt, asym, 3, seed=11)
        wf = "fp4" if fmt == "fp4" else None
        calls.clear()
        y = qmm.quantized_matmul_blockwise(x, q, s, block_size=64, w_zero_point=z, config=cfg, weight_format=wf)
        assert calls and set(calls) == {4}
        _check(y, x, q, s, 64, z, fmt=wf)
    monkeypatch.setattr(bw, "DIAG_ROWS", 0)
    calls.clear()
    x, q, s, z = _case(8, 200, 8, 64, "int4", True, 3, seed=12)
    y2 = qmm.quantized_matmul_blockwise(x, q, s, block_size=64, w_zero_point=z, config=cfg)
    assert not calls
    _check(y2, x, q, s, 64, z)


@pytest.mark.parametrize("fmt,rel", [("float8_e4m3fn", 2.0**-4), ("float8_e5m2", 2.0**-3)])
def test_quantize_weight_blockwise_fp8_uses_the_fp8_grid(fmt, rel):
    """fp8 names quantize onto the fp8 grid (``s = absmax / fp8 max``), not int8's (a name other than the known
    ones fell through to int8 before, and ``from_linear`` copied those integers into its fp8 buffer): each weight
    within half an fp8 step (relative) of its value where it is a normal fp8 number; an unknown name is a
    DTypeError."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 0, 256)
    q, s, z = qmm.quantize_weight_blockwise(w, 128, fmt)
    assert q.dtype == getattr(torch, fmt) and z is None and s.shape == (2, 1, 64)
    deq = qmm.dequantize_blockwise(q, s, 128)
    normal = (w.double().abs() / s.double()[:, 0, :].T.repeat_interleave(128, 1)) >= torch.finfo(q.dtype).tiny
    assert normal.float().mean() > 0.9
    assert ((deq - w.double()).abs() <= rel * w.double().abs() * 1.0001)[normal].all()
    lin = torch.nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    m = qmm.TPUBlockQuantLinear.from_linear(lin, 128, fmt=fmt)
    assert m.w_q.dtype == q.dtype and torch.equal(m.w_q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(m.w_scale, s)
    with pytest.raises(DTypeError, match="dtype 'foo'"):
        qmm.quantize_weight_blockwise(w, 128, "foo")
