"""NSA (tpukernels.library.nsa_ops): forward and gradients (q, k, v, gates) against the dense float64
definition, each branch against fla-core's naive NSA where the semantics coincide, typed errors, and compile-only
checks of the compressed and sliding-window branches' kernels at tokamax's default sizes."""

import math
import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fla_naive  # tests/ is on sys.path (rootdir-relative import)
from tpukernels.errors import ArgumentError, DTypeError
from tpukernels.library.moba_ops import moba_block_indices
from tpukernels.library.nsa_ops import cmp_mask, nsa_attention, nsa_attention_reference

#: (out, grads) absolute tolerances against the float64 reference of the same low-precision inputs.
TOL = {torch.float32: (3e-5, 1e-4), torch.bfloat16: (3e-2, 6e-2)}
#: the shapes most tests share (so the kernels are lowered once per process): T = 2 * 128 + 44, GQA 2/1
SHAPE = dict(B=1, T=300, Hq=2, Hkv=1, D=32, Dv=32)
STATICS = dict(chunk_size=128, topk=1, window=40, cmp_block_size=32)


def _inputs(B, T, Hq, Hkv, D, Dv, dtype=torch.float32, seed=0, gate_shape="fla"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, T, Hkv, Dv, generator=g).to(dtype)
    shape = (B, T, Hq) if gate_shape == "fla" else (B, T, Hq, Dv)
    gates = [None] * 3 if gate_shape is None else [torch.rand(shape, generator=g) for _ in range(3)]
    return q, k, v, gates


def _check(q, k, v, gates, statics, interpret, grads=True):
    out_tol, grad_tol = TOL[q.dtype]
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    gl = [None if g is None else g.clone().requires_grad_(True) for g in gates]
    out = nsa_attention(*leaves, *gl, **statics, interpret=interpret)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[3])
    wide = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    gw = [None if g is None else g.double().requires_grad_(True) for g in gates]
    ref = nsa_attention_reference(*wide, *gw, **statics)
    torch.testing.assert_close(out.double(), ref.detach(), atol=out_tol, rtol=0)
    if not grads:
        return
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(q.dtype)
    mine = [x for x in leaves + gl if x is not None]
    theirs = [x for x in wide + gw if x is not None]
    got = torch.autograd.grad(out, mine, do)
    want = torch.autograd.grad(ref, theirs, do.double())
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == mine[i].dtype
        torch.testing.assert_close(a.double(), b, atol=grad_tol, rtol=0, msg=lambda m: f"grad {i}: {m}")


def test_forward_and_gradients_match_float64_reference(interpret):
    """GQA 2/1, short last chunk and compression block, top-1, window 40, gates [B, T, Hq] (fla's layout):
    out and the gradients of q, k, v and the three gates, float32."""
    q, k, v, gates = _inputs(**SHAPE)
    _check(q, k, v, gates, STATICS, interpret)


@settings(max_examples=2)
@given(T=st.integers(1, 400), heads=st.sampled_from([(2, 2), (2, 1), (1, 1)]), topk=st.integers(0, 5),
       window=st.integers(0, 300), cmp=st.sampled_from([16, 32, 50, 64]), cmp_causal=st.booleans(),
       gate_shape=st.sampled_from([None, "fla", "tokamax"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 99))
def test_shapes_statics_dtypes_forward(T, heads, topk, window, cmp, cmp_causal, gate_shape, dtype, seed):
    """Any T, top-k beyond the chunks there are, windows past T, compression blocks not dividing T, both
    compressed-visibility rules, default / per-head / per-lane gates, bf16 and f32 (forward; the sweep below
    also checks gradients)."""
    q, k, v, gates = _inputs(1, T, heads[0], heads[1], 32, 32, dtype, seed, gate_shape)
    st_ = dict(chunk_size=128, topk=topk, window=window, cmp_block_size=cmp, cmp_causal=cmp_causal, scale=0.25)
    _check(q, k, v, gates, st_, "tpu", grads=False)


@pytest.mark.slow
@settings(max_examples=20)
@given(B=st.integers(1, 2), T=st.integers(1, 700), heads=st.sampled_from([(2, 2), (4, 1), (4, 2)]),
       topk=st.integers(0, 6), window=st.integers(0, 400), cmp=st.sampled_from([16, 64, 100]),
       cmp_causal=st.booleans(), chunk=st.sampled_from([128, 256]),
       gate_shape=st.sampled_from([None, "fla", "tokamax"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 999))
def test_sweep_slow(B, T, heads, topk, window, cmp, cmp_causal, chunk, gate_shape, dtype, seed):
    q, k, v, gates = _inputs(B, T, heads[0], heads[1], 64, 64, dtype, seed, gate_shape)
    st_ = dict(chunk_size=chunk, topk=topk, window=window, cmp_block_size=cmp, cmp_causal=cmp_causal)
    _check(q, k, v, gates, st_, "tpu")


# ----------------------------------------------------------------------------------------------- fla-core


def _fla_naive_nsa(monkeypatch):
    """fla-core's ``fla/ops/nsa/naive.py``: it imports ``fla.ops.utils`` (whose package imports triton) for helpers
    only its varlen paths call, so those modules are stubbed while it loads."""
    return fla_naive.load("nsa", stub=("fla", "fla.ops", "fla.ops.utils", "fla.ops.utils.pooling"),
                          stub_attrs=("prepare_chunk_offsets", "mean_pooling"), monkeypatch=monkeypatch)


def test_branches_match_fla_naive_nsa(monkeypatch):
    """With one gate 1 and the others 0: the compressed branch (``cmp_causal=True``) equals fla's
    ``naive_nsa_compression`` over the mean-pooled keys / values (0 where no block is visible yet), and the
    selected branch equals fla's ``naive_nsa_selection`` given each query token its chunk's blocks (the selected
    chunks and its own), per query head."""
    m = _fla_naive_nsa(monkeypatch)
    q, k, v, _ = _inputs(**SHAPE, seed=3)
    B, T, Hq, G = 1, 300, 2, 2
    one, zero = torch.ones(B, T, Hq), torch.zeros(B, T, Hq)
    cs, bs, sc = STATICS["chunk_size"], STATICS["cmp_block_size"], 32 ** -0.5
    got = nsa_attention(q, k, v, one, zero, zero, **STATICS, cmp_causal=True, interpret="tpu")
    pooled = [torch.cat([x[:, i:i + bs].mean(1, keepdim=True) for i in range(0, T, bs)], 1) for x in (k, v)]
    want, _ = m.naive_nsa_compression(q, *pooled, block_size=bs, scale=sc)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=0)
    assert torch.equal(got[:, :bs - 1], torch.zeros_like(got[:, :bs - 1]))  # no block wholly in the past yet

    got = nsa_attention(q, k, v, zero, one, zero, **STATICS, interpret="tpu")
    sel = moba_block_indices(q, k, chunk_size=cs, topk=STATICS["topk"])  # [B, Hq, n, K]
    n = sel.shape[2]
    own = torch.arange(n).view(1, 1, n, 1).expand(B, Hq, n, 1)
    blocks = torch.cat([sel.long(), own], -1)[:, :, torch.arange(T) // cs]  # [B, Hq, T, K + 1] per token
    for h in range(Hq):
        want = m.naive_nsa_selection(q[:, :, h:h + 1], k[:, :, h // G:h // G + 1], v[:, :, h // G:h // G + 1],
                                     blocks[:, h].unsqueeze(2), block_size=cs, scale=sc)
        torch.testing.assert_close(got[:, :, h:h + 1], want, atol=3e-5, rtol=0)


def test_tokamax_rule_differs_only_where_documented():
    """tokamax's compressed visibility (``c * bs < t``) vs the causal rule, on the reference: equal where both
    see the same blocks, and query 0 (nothing visible under tokamax's rule) gets 0, not tokamax's mean of all
    compressed values."""
    q, k, v, _ = _inputs(1, 96, 1, 1, 16, 16, seed=4)
    a = nsa_attention_reference(q, k, v, chunk_size=128, cmp_block_size=32, branches=True)[0]
    b = nsa_attention_reference(q, k, v, chunk_size=128, cmp_block_size=32, cmp_causal=True, branches=True)[0]
    assert torch.equal(a[:, 0], torch.zeros_like(a[:, 0]))
    same = [t for t in range(96) if (t - 1) // 32 == (t + 1) // 32 - 1]  # same visible count under both rules
    assert same and torch.allclose(a[:, same], b[:, same])
    assert not torch.allclose(a[:, 1:31], b[:, 1:31])  # tokamax sees block 0's mean from t = 1
    mask = cmp_mask(96, 32, False).array
    assert mask.shape == (96, 3) and not mask[0].any() and mask[1, 0] and not mask[32, 1] and mask[33, 1]


# ----------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("mutate, err, words", [
    (lambda a: dict(a, g_cmp=a["g_cmp"][..., :1]), ArgumentError, "g_cmp must have shape [B, T, Hq, Dv]"),
    (lambda a: dict(a, g_swa=a["g_swa"].long()), DTypeError, "g_swa must be a float tensor"),
    (lambda a: dict(a, g_slc=[1.0]), ArgumentError, "g_slc must be a torch.Tensor or None"),
    (lambda a: dict(a, window=-1), ArgumentError, "window must be an int >= 0"),
    (lambda a: dict(a, cmp_block_size=0), ArgumentError, "cmp_block_size must be an int >= 1"),
    (lambda a: dict(a, cmp_causal=1), ArgumentError, "cmp_causal must be a bool"),
    (lambda a: dict(a, chunk_size=100), ArgumentError, "chunk_size must be a positive multiple of 128"),
    (lambda a: dict(a, topk=None), ArgumentError, "topk must be an int >= 0"),
    (lambda a: dict(a, k=a["k"][:, :10]), ArgumentError, "k and v must have q's [B, T]"),
    (lambda a: dict(a, q=a["q"].double()), DTypeError, "not supported"),
    (lambda a: dict(a, scale=math.nan), ArgumentError, "scale must be a finite float"),
])
def test_bad_input_raises_typed_errors(mutate, err, words):
    q, k, v, gates = _inputs(2, 64, 2, 1, 16, 16)
    args = mutate(dict(q=q, k=k, v=v, g_cmp=gates[0], g_slc=gates[1], g_swa=gates[2], **STATICS))
    with pytest.raises(err, match="nsa_attention: .*" + re.escape(words)):
        nsa_attention(**args)


def test_empty_sequence():
    q, k, v, gates = _inputs(1, 0, 2, 1, 16, 8)
    assert nsa_attention(q, k, v, *gates, **STATICS).shape == (1, 0, 2, 8)


# ----------------------------------------------------------------------------------------------- compile-only

CHIPS = ("v5e", "v6e", "tpu7x")


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
def test_compile_only_cmp_branch(chip):
    """tokamax's defaults at T = 8192, 32 query / 8 kv heads, D = 128, bf16: the compressed branch's masked
    kernels (forward, dQ, dK/dV) over 128 mean-pooled keys with the cmp visibility tables. The selected branch
    is MoBA's (tests/test_moba_attention.py compiles it); the sliding window is the dense kernel with a window
    (tests/test_attention.py compiles windows)."""
    import tpukernels as tk
    from tpukernels.library.attention import (fa_backward_dkv_masked, fa_backward_dq_masked, fa_forward_masked,
                                              mask_tables)
    from tpukernels.library.attention.api import MASK_BLOCK
    from tpukernels.library.attention.masked import tensors

    T = 8192
    q, kc = f"1x32x{T}x128:bf16", "1x8x128x128:bf16"
    tabs = tensors(mask_tables(cmp_mask(T, 64, False), MASK_BLOCK, 128))  # 128 compressed keys: one key block
    ft, bt, mb, mbt = (f"{'x'.join(map(str, t.shape))}:{'i32' if t.dtype == torch.int32 else 'i8'}" for t in tabs)
    r = tk.compile_for(fa_forward_masked, chip, ft, bt, q, kc, kc, mb, mbt, sm_scale=0.088, softcap=None,
                       with_mlir=False)
    assert r.ok, r.error
    rows = (q, f"1x32x1x{T}:f32", f"1x32x1x{T}:f32")
    for kern in (fa_backward_dq_masked, fa_backward_dkv_masked):
        r = tk.compile_for(kern, chip, ft, bt, q, kc, kc, *rows, mb, mbt, sm_scale=0.088, softcap=None,
                           with_mlir=False)
        assert r.ok, (kern, r.error)
