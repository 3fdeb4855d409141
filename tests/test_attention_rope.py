"""flash_attention(rope_cos=, rope_sin=): RoPE fused into the forward kernel's q load (k through the RoPE kernel),
forward and backward.

Ground truth: float64 RoPE written as HF writes it (:func:`tpukernels.library.rope.rope_reference`) on the same
low-precision inputs, then float64 dense attention (:func:`attention_reference`); gradients by float64 autograd
through both. Kernels run in Pallas interpret mode (the ``interpret`` fixture adds the NaN-poisoned "tpu" mode);
the ``aot`` test builds the real Mosaic kernel.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpukernels as tk
from tpukernels.errors import ArgumentError, DTypeError
from tpukernels.library.attention import attention_reference, fa_forward_rope, flash_attention
from tpukernels.library.rope import rope_reference

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
#: (atol, rtol) for out / gradients: tests/test_attention.py's TOL (the attention kernels' own error), bf16 a
#: little wider: the rotated q and k are rounded to bf16 once more before the dots (2^-9 relative).
TOL = {F32: ((5e-5, 5e-5), (5e-5, 5e-5)), BF16: ((3e-2, 3e-2), (5e-2, 5e-2)), F16: ((3e-3, 3e-3), (6e-3, 6e-3))}
B128 = dict(block_q=128, block_kv=128, block_kv_compute=128, block_h=1)


def tables(S, R, *, interleaved=False, dtype=F32, base=10000.0):
    """HF-convention cos/sin ``[S, R]`` of real RoPE angles (positions 0..S-1)."""
    inv = 1.0 / base ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    f = torch.arange(S, dtype=torch.float64)[:, None] * inv
    emb = f.repeat_interleave(2, -1) if interleaved else torch.cat((f, f), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make(B, Hq, Hkv, Sq, Skv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, s, D, generator=g).to(dtype).requires_grad_()
                 for h, s in ((Hq, Sq), (Hkv, Skv), (Hkv, Skv)))


def reference(q, k, v, cos, sin, *, interleaved, causal=False, causal_alignment="top_left", qs=None, ks=None,
              softcap=None):
    """float64 (out, lse): RoPE of q (table rows of the query positions) and k, then dense attention."""
    Sq, Skv = q.shape[2], k.shape[2]
    off = Skv - Sq if causal_alignment == "bottom_right" else 0
    qr = rope_reference(q, cos[off:off + Sq], sin[off:off + Sq], interleaved=interleaved)
    kr = rope_reference(k, cos, sin, interleaved=interleaved)
    return attention_reference(qr, kr, v.double(), causal=causal, causal_alignment=causal_alignment, softcap=softcap,
                               q_segment_ids=qs, kv_segment_ids=ks, dtype=torch.float64)


def check(q, k, v, cos, sin, *, interleaved=False, config=None, grad_tables=False, lse_grad=False, **kw):
    """Forward + backward through autograd vs the float64 reference (q, k, v and, optionally, cos / sin; the
    gradient flows in through out and, with ``lse_grad``, through lse too)."""
    out, lse = flash_attention(q, k, v, rope_cos=cos, rope_sin=sin, rope_interleaved=interleaved, return_lse=True,
                               config=config, **kw)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[3])
    g = torch.Generator().manual_seed(7)
    do = torch.randn(out.shape, generator=g).to(out.dtype)
    dl = torch.randn(lse.shape, generator=g) if lse_grad else None
    wrt = (q, k, v) + ((cos, sin) if grad_tables else ())
    grads = torch.autograd.grad((out, lse) if lse_grad else (out,), wrt, (do, dl) if lse_grad else (do,))
    w64 = [x.detach().double().requires_grad_() for x in wrt]
    q64, k64, v64 = w64[:3]
    c64, s64 = (w64[3], w64[4]) if grad_tables else (cos.double(), sin.double())
    qs, ks = kw.pop("q_segment_ids", None), kw.pop("kv_segment_ids", None)
    r_out, r_lse = reference(q64, k64, v64, c64, s64, interleaved=interleaved, qs=qs, ks=ks, **kw)
    finite = torch.isfinite(r_lse)
    r_grads = torch.autograd.grad((r_out, r_lse) if lse_grad else (r_out,), w64,
                                  (do.double(), torch.where(finite, dl.double(), 0.0)) if lse_grad else (do.double(),))
    (oa, orr), (ga, gr) = TOL[q.dtype]
    torch.testing.assert_close(out.double(), r_out, atol=oa, rtol=orr)
    assert torch.equal(torch.isneginf(lse), ~finite)
    torch.testing.assert_close(lse[finite].double(), r_lse[finite], atol=oa, rtol=orr)
    for name, a, r in zip(("q", "k", "v", "cos", "sin"), grads, r_grads):
        assert not a.isnan().any(), f"d{name} has NaN"
        # table gradients sum over every head and position: scale the tolerance with the number of terms
        n = 1 if name in "qkv" else q.shape[0] * q.shape[1] * 4
        torch.testing.assert_close(a.double(), r, atol=ga * n, rtol=gr, msg=lambda m, n_=name: f"d{n_}: {m}")
    return out


@settings(max_examples=3)
@given(st.data())
def test_matches_rope_then_attention(data):
    """Shapes, GQA, causal / alignment, partial rotary, both layouts, bf16 / f32, blocks (tails, several blocks)."""
    dtype = data.draw(st.sampled_from([F32, BF16]), "dtype")
    B, Hkv, G = data.draw(st.integers(1, 2), "B"), data.draw(st.integers(1, 2), "Hkv"), data.draw(st.sampled_from([1, 2, 4]), "G")
    D = data.draw(st.sampled_from([64, 128]), "D")
    R = 2 * data.draw(st.integers(1, D // 2), "R/2")
    Skv = data.draw(st.integers(1, 260), "Skv")
    Sq = data.draw(st.integers(1, Skv), "Sq")
    causal = data.draw(st.booleans(), "causal")
    align = data.draw(st.sampled_from(["top_left", "bottom_right"]), "alignment")
    inter = data.draw(st.booleans(), "interleaved")
    cfg = data.draw(st.sampled_from([None, B128]), "config")
    q, k, v = make(B, G * Hkv, Hkv, Sq, Skv, D, dtype, seed=Sq + Skv)
    cos, sin = tables(Skv, R, interleaved=inter, dtype=dtype)
    check(q, k, v, cos, sin, interleaved=inter, config=cfg, causal=causal, causal_alignment=align)


def test_interpret_modes_gqa_tails_segments_partial(interpret):
    """NaN-poisoned "tpu" interpret mode: query / key tails (200 = 128 + 72), GQA 4/2, partial rotary, packed
    segments, bottom-right alignment (the q table rows start at Skv - Sq), float32 tables on bf16 q."""
    q, k, v = make(1, 4, 2, 136, 200, 64, BF16, seed=3)
    cos, sin = tables(200, 48)
    qs = torch.tensor([[0] * 60 + [1] * 76])
    ks = torch.tensor([[0] * 124 + [1] * 76])
    check(q, k, v, cos, sin, config=B128, causal=True, causal_alignment="bottom_right", q_segment_ids=qs,
          kv_segment_ids=ks, lse_grad=True)


def test_table_gradients_and_softcap():
    """cos / sin that require grad get float64-accurate gradients (q through the fused kernel, k through the RoPE
    kernel); soft-cap on; interleaved layout; float16 inputs (computed in float32)."""
    q, k, v = make(1, 2, 1, 96, 96, 64, F32, seed=5)
    cos, sin = tables(96, 64, interleaved=True)
    cos.requires_grad_(), sin.requires_grad_()
    check(q, k, v, cos, sin, interleaved=True, grad_tables=True, causal=True, softcap=20.0)
    qh, kh, vh = make(1, 2, 2, 40, 40, 64, F16, seed=6)
    ch, sh = tables(40, 32, dtype=F16)
    check(qh, kh, vh, ch, sh, causal=True)


def test_rotates_q_inside_the_kernel():
    """The kernel op's third output is the rotated q (what the backward uses), equal to the float64 RoPE of q up
    to float32 rounding."""
    q, k, v = make(1, 2, 1, 64, 64, 64, F32, seed=9)
    cos, sin = tables(64, 64)
    out, lse, q_rot = fa_forward_rope(q.detach(), k.detach(), v.detach(), cos, sin, rotary_dim=64, causal=True)
    torch.testing.assert_close(q_rot.double(), rope_reference(q.detach(), cos, sin), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ typed errors
def _qkv(dtype=BF16):
    return (torch.zeros(1, 2, 8, 64, dtype=dtype), torch.zeros(1, 1, 16, 64, dtype=dtype),
            torch.zeros(1, 1, 16, 64, dtype=dtype))


@pytest.mark.parametrize("case, err, words", [
    ("only_cos", ArgumentError, "rope_cos and rope_sin must be given together"),
    ("rows", ArgumentError, "rope_cos must be [Skv, rotary_dim] = [16, R]"),
    ("batched", ArgumentError, "rope_sin must be [Skv, rotary_dim]"),
    ("odd", ArgumentError, "rotary_dim R = rope_cos.shape[-1] = 5 must be even"),
    ("wide", ArgumentError, "= 66 must be even and 2 <= R <= D = 64"),
    ("differ", ArgumentError, "must have the same shape and dtype"),
    ("dtype", DTypeError, "rope_cos dtype torch.float16 must be q's dtype (torch.bfloat16) or float32"),
    ("long_q", ArgumentError, "Sq = 32 > Skv = 16"),
    ("mask", ArgumentError, "not supported with mask="),
    ("flag", ArgumentError, "rope_interleaved must be a bool"),
])
def test_typed_errors(case, err, words):
    from tpukernels.library.attention import CausalMask

    q, k, v = _qkv()
    cos, sin = tables(16, 64, dtype=BF16)
    kw = dict(rope_cos=cos, rope_sin=sin)
    if case == "only_cos":
        kw = dict(rope_cos=cos)
    elif case == "rows":
        kw["rope_cos"], kw["rope_sin"] = tables(17, 64, dtype=BF16)
    elif case == "batched":
        kw["rope_sin"] = sin[None]
    elif case == "odd":
        kw = dict(rope_cos=cos[:, :5], rope_sin=sin[:, :5])
    elif case == "wide":
        kw = dict(rope_cos=torch.zeros(16, 66, dtype=BF16), rope_sin=torch.zeros(16, 66, dtype=BF16))
    elif case == "differ":
        kw["rope_sin"] = sin[:, :32]
    elif case == "dtype":
        kw["rope_cos"] = cos.half()
    elif case == "long_q":
        q = torch.zeros(1, 2, 32, 64, dtype=BF16)
    elif case == "mask":
        kw["mask"] = CausalMask((8, 16))
    elif case == "flag":
        kw["rope_interleaved"] = 1
    with pytest.raises(err) as e:
        flash_attention(q, k, v, **kw)
    assert words in str(e.value), str(e.value)


def test_kernel_op_rejects_bad_tables():
    q, k, v = _qkv()
    cos, sin = tables(8, 64, dtype=BF16)
    with pytest.raises(ArgumentError, match=r"cos must be \[Sq, D\] = \[8, 64\]"):
        fa_forward_rope(q, k, v, cos[:4], sin[:4], rotary_dim=64)
    with pytest.raises(ArgumentError, match="rotary_dim must be even"):
        fa_forward_rope(q, k, v, cos, sin, rotary_dim=3)


# ------------------------------------------------------------------------------------------ compile-only
@pytest.mark.aot
def test_compile_only_rope_forward_v6e():
    """The fused kernel builds with Mosaic for v6e at the benchmark's blocks (2048) on a 1/8-head problem, with
    its VMEM within the requested limit."""
    res = tk.compile_for(fa_forward_rope, "v6e", "1x4x4096x128:bf16", "1x1x4096x128:bf16", "1x1x4096x128:bf16",
                         "4096x128:bf16", "4096x128:bf16", with_mlir=False, rotary_dim=128, causal=True,
                         config=dict(block_q=2048, block_kv=2048, block_kv_compute=512, block_h=1))
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= res.vmem_limit_bytes
    assert math.isfinite(res.compile_seconds)


def test_opcheck():
    """torch.library.opcheck of the kernel op (schema, fake tensor, autograd registration)."""
    q, k, v = make(1, 2, 1, 24, 40, 64, F32, seed=11)
    cos, sin = tables(24, 64)
    qs = torch.tensor([[0] * 10 + [1] * 14], dtype=torch.int32).unsqueeze(1)
    ks = torch.tensor([[0] * 20 + [1] * 20], dtype=torch.int32).unsqueeze(1)
    torch.library.opcheck(torch.ops.tpukernels.flash_attention_rope_fwd, (q, k, v, cos, sin, qs, ks),
                          dict(rotary_dim=32, interleaved=False, causal=True, causal_alignment="bottom_right",
                               sm_scale=None, window_left=None, window_right=None, softcap=None),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_sharding_rule_splits_batch_or_heads_and_replicates_the_tables():
    from tpukernels.distributed.sharding import Split, TensorMeta, splits_for

    m = lambda *s: TensorMeta(s, torch.bfloat16)  # noqa: E731
    args = {"q": m(2, 8, 64, 64), "k": m(2, 2, 64, 64), "v": m(2, 2, 64, 64), "cos": m(64, 64), "sin": m(64, 64),
            "q_segment_ids": None, "kv_segment_ids": None, "rotary_dim": 64, "interleaved": False, "causal": True}
    assert splits_for(fa_forward_rope, args) == [Split({"q": 0, "k": 0, "v": 0}, (0, 0, 0)),
                                                 Split({"q": 1, "k": 1, "v": 1}, (1, 1, 1))]
