"""tpukernels.library.rope: RoPE (rotate-half and interleaved layouts, partial rotary), forward and backward.

Ground truth: :func:`rope_reference`, float64 from the same low-precision inputs, written as HF writes it
(``rotate_half`` / ``rotate_every_two``), independent of the kernel's lane-roll formulation; HF's own
``apply_rotary_pos_emb`` with cos/sin from HF's ``LlamaRotaryEmbedding`` for every scaling variant.
Kernels run in Pallas interpret mode (both modes via the ``interpret`` fixture); the ``aot`` test builds the
real Mosaic kernel for v5e / v6e / tpu7x.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpukernels as tk
from tpukernels.errors import ArgumentError, DTypeError
from tpukernels.library import rope as R

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# Unit roundoff of the output dtype: y is computed in float32 and rounded once.
U = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24}


def check(got, want, mag, dtype, what=""):
    """|got - want| <= U[dtype] * |want| + 4 * 2**-24 * mag (float32 products and two sums of terms whose
    magnitudes add up to at most ``mag``; float64 ``want``)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got.double() - want).abs()
    bound = U[dtype] * want.abs() + 4 * 2.0**-24 * mag + 1e-30
    bad = ~(err <= bound)
    worst = (err - bound)[bad].max() if bad.any() else 0
    assert not bad.any(), f"{what}: {int(bad.sum())}/{bad.numel()} out of tolerance, worst excess {worst:.3g}"


def magnitude(x, cos, sin, seq_dim):
    """Per-element bound on the sum of |terms|: |x| * max|cos| + max|x| over the row * max|sin|."""
    xa = x.double().abs()
    return xa * cos.double().abs().max() + xa.amax(-1, keepdim=True) * sin.double().abs().max()


def tables(s, r, batch=None, dtype=F32, base=10000.0, interleaved=False, seed=0):
    """HF-convention cos/sin of real RoPE angles (positions 0..S-1; a random offset per batch row)."""
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    off = torch.randint(0, 1000, (batch or 1, 1), generator=g).double()
    f = (torch.arange(s, dtype=torch.float64)[None] + off)[..., None] * inv  # [B, S, R/2]
    emb = f.repeat_interleave(2, -1) if interleaved else torch.cat((f, f), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return (cos, sin) if batch else (cos[0], sin[0])


def rand(*shape, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------------------------------------- reference
def test_reference_is_a_rotation_of_pairs():
    # neox: lanes (i, i + R/2) rotate by the angle of lane i; GPT-J: lanes (2i, 2i + 1); the rest pass through
    x = rand(1, 1, 3, 10, dtype=torch.float64)
    for inter in (False, True):
        cos, sin = tables(3, 6, dtype=torch.float64, interleaved=inter)
        y = R.rope_reference(x, cos, sin, interleaved=inter)
        pairs = [(2 * i, 2 * i + 1) for i in range(3)] if inter else [(i, i + 3) for i in range(3)]
        for a, b in pairs:
            c, s = cos[:, a], sin[:, a]
            torch.testing.assert_close(y[0, 0, :, a], x[0, 0, :, a] * c - x[0, 0, :, b] * s)
            torch.testing.assert_close(y[0, 0, :, b], x[0, 0, :, b] * c + x[0, 0, :, a] * s)
        torch.testing.assert_close(y[..., 6:], x[..., 6:])


# ---------------------------------------------------------------------------------------------- forward + backward
@pytest.mark.parametrize("interleaved,r", [(False, 64), (True, 32)], ids=["neox-full", "gptj-partial"])
def test_forward_backward_match_float64(interpret, interleaved, r):
    if interpret == "tpu" and not interleaved:
        pytest.skip("NaN-poisoned mode on one representative case")
    b, h, s, d = 2, 3, 20, 64  # S=20: a tail block
    x = rand(b, h, s, d).requires_grad_()
    cos, sin = tables(s, r, batch=b, interleaved=interleaved)
    cos.requires_grad_(), sin.requires_grad_()
    y = R.apply_rope(x, cos, sin, interleaved=interleaved)
    ref = R.rope_reference(x, cos, sin, interleaved=interleaved)
    check(y, ref, magnitude(x, cos, sin, 2), F32, "y")
    dy = rand(b, h, s, d, seed=1)
    dx, dcos, dsin = torch.autograd.grad(y, (x, cos, sin), dy)
    rdx, rdcos, rdsin = torch.autograd.grad(ref, (x, cos, sin), dy.double())
    check(dx, rdx, magnitude(dy, cos, sin, 2), F32, "dx")
    # table gradients: float32 sums over heads of products: h terms of |dy| * |x|
    scale = h * dy.abs().max().double() * x.detach().abs().max().double()
    check(dcos, rdcos, scale.expand_as(rdcos), F32, "dcos")
    check(dsin, rdsin, 2 * scale.expand_as(rdsin), F32, "dsin")


def test_bshd_layout_positions_cache_and_bf16():
    # [B, S, H, D] (TorchTitan / flash-attn layout), cos/sin cache indexed by per-batch positions, bf16
    b, s, h, d, r = 2, 16, 4, 128, 128
    cache_c, cache_s = tables(64, r, dtype=BF16)
    pos = torch.stack([torch.arange(s), torch.arange(s) + 40])
    x = rand(b, s, h, d, dtype=BF16).requires_grad_()
    y = R.apply_rope(x, cache_c, cache_s, pos, seq_dim=1)
    assert y.dtype == BF16
    ref = R.rope_reference(x, cache_c, cache_s, pos, seq_dim=1)
    check(y, ref, magnitude(x, cache_c, cache_s, 1), BF16, "y")
    dy = rand(b, s, h, d, dtype=BF16, seed=3)
    (dx,) = torch.autograd.grad(y, x, dy)
    (rdx,) = torch.autograd.grad(ref, x, dy.double())
    check(dx, rdx, magnitude(dy, cache_c, cache_s, 1), BF16, "dx")


@settings(max_examples=4)
@given(
    dtype=st.sampled_from([BF16, F16, F32]),
    shape=st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 40)),
    d_r=st.sampled_from([(64, 64), (64, 16), (128, 96), (32, 32)]),
    interleaved=st.booleans(),
    shared=st.booleans(),
)
def test_hypothesis_shapes_dtypes(dtype, shape, d_r, interleaved, shared):
    (b, h, s), (d, r) = shape, d_r
    x = rand(b, h, s, d, dtype=dtype)
    cos, sin = tables(s, r, batch=None if shared else b, dtype=dtype, interleaved=interleaved)
    y = R.apply_rope(x, cos, sin, interleaved=interleaved)
    assert y.dtype == dtype
    check(y, R.rope_reference(x, cos, sin, interleaved=interleaved), magnitude(x, cos, sin, 2), dtype, "y")


def test_matches_hf_for_every_rope_scaling_variant():
    """HF's own LlamaRotaryEmbedding makes cos/sin (default, linear, dynamic NTK, YaRN, llama3); our
    apply_rotary_pos_emb equals HF's in float32 within float32 rounding."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ml

    b, hq, hkv, s, d = 1, 4, 2, 24, 64
    q, k = rand(b, hq, s, d), rand(b, hkv, s, d, seed=1)
    pos = torch.arange(s)[None] + 3000  # beyond original_max_position_embeddings: dynamic NTK rescales
    variants = [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
    ]
    seen = set()
    for params in variants:
        cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv,
                          max_position_embeddings=1024, rope_parameters=dict(params, rope_theta=10000.0))
        cos, sin = ml.LlamaRotaryEmbedding(cfg)(q, pos)
        seen.add(round(float(cos.sum()), 3))
        want_q, want_k = ml.apply_rotary_pos_emb(q, k, cos, sin)
        got_q, got_k = R.apply_rotary_pos_emb(q, k, cos, sin)
        for got, want, x in ((got_q, want_q, q), (got_k, want_k, k)):
            # HF rounds 3 times in float32, we round once after float32 products: both within 4u * mag
            check(got, want.double(), 2 * magnitude(x, cos, sin, 2), F32, params["rope_type"])
    assert len(seen) == len(variants)  # the variants really produce different tables


# ---------------------------------------------------------------------------------------------- bad input
def test_errors_are_typed_and_raised_before_the_kernel():
    x = rand(1, 2, 8, 64)
    cos, sin = tables(8, 64)
    cache_c, cache_s = tables(16, 64)
    with pytest.raises(ArgumentError, match="positions beyond the cos/sin cache"):
        R.apply_rope(x, cache_c, cache_s, torch.arange(8) + 10)
    with pytest.raises(ArgumentError, match="positions beyond the cos/sin cache"):
        R.apply_rope(x, cache_c, cache_s, torch.arange(8) - 1)
    with pytest.raises(ArgumentError, match="rotary dim mismatch.*R = 128.*D = 64"):
        R.apply_rope(x, *tables(8, 128))
    with pytest.raises(ArgumentError, match="rotary dim mismatch.*R = 7"):
        R.apply_rope(x, cos[:, :7], sin[:, :7])
    with pytest.raises(ArgumentError, match="same shape"):
        R.apply_rope(x, cos, sin[:, :32])
    with pytest.raises(ArgumentError, match=r"\[S, R\] = \[8, 64\]"):
        R.apply_rope(x, cache_c, cache_s)  # a cache without positions
    with pytest.raises(ArgumentError, match="seq_dim"):
        R.apply_rope(x, cos, sin, seq_dim=3)
    with pytest.raises(DTypeError, match="positions"):
        R.apply_rope(x, cache_c, cache_s, torch.arange(8.0))
    with pytest.raises(DTypeError, match="float64"):
        R.apply_rope(x.double(), cos, sin)
    with pytest.raises(ArgumentError, match="4-D"):
        R.apply_rope(x[0], cos, sin)


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only(chip, tmp_cache):
    from tpukernels.targets.compile_only import compile_for

    kernel, args, kw = R.STANDARD_CASES[0]
    for a, k in [(args, kw), (args, dict(kw, interleaved=True, rotary_dim=64, transpose=True)),
                 (("2x4096x8x128:bf16", "2x4096x128:f32", "2x4096x128:f32"), dict(kw, seq_dim=1))]:
        r = compile_for(kernel, chip, *a, with_mlir=False, **k)
        assert r.ok, r.summary()
        assert r.vmem_estimate_bytes <= R.VMEM_BUDGET_BYTES, r.summary()
