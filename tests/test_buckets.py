"""Shape buckets of flash attention (Sq / Skv) and matmul (M): every length in a bucket runs one lowered program,
and results equal the unpadded definition (float64 references from the low-precision inputs).

Lengths 65..72 share the bucket 80 (multiples of 16 between 64 and 128), so the padded programs stay small for
cpu interpret mode; the reference is written from the definitions of :mod:`tpukernels.library.attention`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpukernels as tk
from tpukernels.library import attention as A
from tpukernels.library.attention import NumpyMask, flash_attention
from tpukernels.library.attention.buckets import absent_id, bucket_len
from tpukernels.library.matmul_ops import matmul, matmul_nn, matmul_nt, matmul_tn

ATOL = 5e-5  # float32 inputs: kernel vs float64 reference (observed ~1e-6; masking/offset bugs give O(0.1))
BF16_TOL = 3e-2  # bfloat16 inputs: P and dS rounded to bf16 (relative 2^-9 each) and the bf16 result


def visibility(B, Hq, Sq, Skv, *, causal=False, alignment="top_left", window=(None, None), qs=None, ks=None,
               mask=None):
    """[B, Hq, Sq, Skv] bool: query i sees key j, from the definitions (true lengths, no padding)."""
    i, j = torch.arange(Sq)[:, None], torch.arange(Skv)[None, :]
    off = Skv - Sq if alignment == "bottom_right" else 0
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    vis = torch.ones(Sq, Skv, dtype=torch.bool)
    if right is not None:
        vis &= j <= i + off + right
    if left is not None:
        vis &= j >= i + off - left
    vis = vis.expand(B, Hq, Sq, Skv).clone()
    if qs is not None:
        vis &= qs[:, None, :, None] == ks[:, None, None, :]
    if mask is not None:
        vis &= torch.as_tensor(mask)
    return vis


def reference(q, k, v, vis, sinks=None):
    """float64 attention (out, lse); rows that see nothing give 0 / -inf (or the sink)."""
    q, k, v = (x.double() for x in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~vis, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return (p[..., :-1] if sinks is not None else p) @ v, lse


def make(B, Hq, Hkv, Sq, Skv, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, S, D, generator=g).to(dtype).requires_grad_()
                 for H, S in ((Hq, Sq), (Hkv, Skv), (Hkv, Skv)))


def compare(q, k, v, vis, *, sinks=None, tol=ATOL, **kw):
    """Forward (out, lse) and backward (dq, dk, dv[, dsinks], with an lse gradient) against float64."""
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    out, lse = flash_attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    assert out.shape == (*q.shape[:3], v.shape[3]) and lse.shape == q.shape[:3]
    g = torch.Generator().manual_seed(7)
    do, dl = torch.randn(out.shape, generator=g).to(out.dtype), torch.randn(lse.shape, generator=g)
    grads = torch.autograd.grad((out, lse), leaves, (do, dl))
    l64 = [x.detach().double().requires_grad_() for x in leaves]
    r_out, r_lse = reference(*l64[:3], vis, sinks=l64[3] if sinks is not None else None)
    fin = torch.isfinite(r_lse)
    r_grads = torch.autograd.grad((r_out, r_lse), l64, (do.double(), torch.where(fin, dl.double(), 0.0)),
                                  allow_unused=True)
    torch.testing.assert_close(out.double(), r_out, atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(lse), ~fin), "lse is -inf exactly where a row sees nothing"
    torch.testing.assert_close(lse[fin].double(), r_lse[fin], atol=tol, rtol=tol)
    for name, a, r in zip(("q", "k", "v", "sinks"), grads, r_grads):
        assert not a.isnan().any(), f"d{name} has NaN"
        r = torch.zeros_like(a, dtype=torch.float64) if r is None else r
        torch.testing.assert_close(a.double(), r, atol=tol, rtol=tol, msg=lambda m, n=name: f"d{n}: {m}")
    return out, lse, grads


# ------------------------------------------------------------------------------------------ the bucket rule
@pytest.mark.parametrize("n, b", [(0, 0), (1, 1), (16, 16), (17, 24), (65, 80), (72, 80), (80, 80), (81, 96),
                                  (1025, 1280), (1280, 1280), (4000, 4096), (4097, 5120)])
def test_bucket_len_follows_the_rows_rule_above_16(n, b):
    assert bucket_len(n) == b
    if n > 16:
        assert bucket_len(n) == tk.bucket(n) and b - n < max(8, n / 4)  # at most 25% padding (steps of 8 minimum)


@settings(max_examples=20)
@given(st.lists(st.integers(-3, 40), min_size=1, max_size=40))
def test_absent_id_is_the_smallest_missing_nonnegative_id(ids):
    got = int(absent_id(torch.tensor(ids, dtype=torch.int32).view(1, 1, -1)))
    assert got not in ids and got >= 0 and all(m in ids for m in range(got))


# ------------------------------------------------------------------------------------------ attention: exactness
ATTN_CASES = {
    # id: (B, Hq, Hkv, Sq, Skv, kwargs): padded lengths with every semantic padding could change
    "causal-top-left-sq<skv-gqa": (1, 4, 2, 65, 70, dict(causal=True)),
    "causal-bottom-right-sq>skv-empty-rows": (1, 2, 1, 70, 66, dict(causal=True, causal_alignment="bottom_right")),
    "window-bottom-right-sinks": (1, 2, 2, 67, 71, dict(window=(9, 3), causal_alignment="bottom_right", sinks=True)),
    "segments-window-top-left": (2, 2, 1, 69, 69, dict(window=(20, 0), segments=3)),
    "decode-bottom-right-kv-padded": (2, 4, 2, 3, 70, dict(causal=True, causal_alignment="bottom_right")),
}


@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_bucketed_attention_matches_the_unpadded_definition(case):
    B, Hq, Hkv, Sq, Skv, kw = ATTN_CASES[case]
    kw = dict(kw)
    q, k, v = make(B, Hq, Hkv, Sq, Skv, 64, seed=len(case))
    qs = ks = None
    if kw.pop("segments", None):
        g = torch.Generator().manual_seed(3)
        qs = torch.randint(0, 3, (B, Sq), generator=g).sort(-1).values
        ks = torch.randint(0, 3, (B, Skv), generator=g).sort(-1).values
        kw.update(q_segment_ids=qs, kv_segment_ids=ks)
    sinks = torch.randn(Hq).requires_grad_() if kw.pop("sinks", None) else None
    vis = visibility(B, Hq, Sq, Skv, causal=kw.get("causal", False), alignment=kw.get("causal_alignment", "top_left"),
                     window=kw.get("window", (None, None)), qs=qs, ks=ks)
    assert bucket_len(Skv) != Skv  # the case is padded
    compare(q, k, v, vis, sinks=sinks, **kw)


def test_bucketed_attention_nan_poisoned_bf16_segments_with_large_ids(interpret):
    """NaN-poisoned interpret mode, bf16, user segment ids that include 0 and 1 (the padding takes the smallest
    id no query uses), bottom-right causal: the padding is never seen and adds nothing to real gradients."""
    B, Sq, Skv = 1, 66, 73
    q, k, v = make(B, 2, 1, Sq, Skv, 64, dtype=torch.bfloat16, seed=5)
    qs = torch.cat([torch.zeros(1, 30), torch.ones(1, 20), torch.full((1, 16), 7)], 1).long()
    ks = torch.cat([torch.zeros(1, 35), torch.ones(1, 30), torch.full((1, 8), 7)], 1).long()
    vis = visibility(B, 2, Sq, Skv, causal=True, alignment="bottom_right", qs=qs, ks=ks)
    compare(q, k, v, vis, causal=True, causal_alignment="bottom_right", q_segment_ids=qs, kv_segment_ids=ks,
            tol=BF16_TOL)


def test_bucketed_masked_attention_matches_the_mask_at_true_lengths():
    """A NumpyMask sized to the true lengths, intersected with bottom-right causal: the padded call uses the
    mask's tables at the true lengths (padding masked) padded to the bucket's block counts."""
    Sq, Skv = 67, 75
    rng = np.random.default_rng(0)
    arr = rng.random((Sq, Skv)) < 0.6
    arr[5] = False  # a fully masked row
    q, k, v = make(1, 2, 1, Sq, Skv, 64, seed=9)
    sinks = torch.randn(2).requires_grad_()
    vis = visibility(1, 2, Sq, Skv, causal=True, alignment="bottom_right", mask=arr)
    compare(q, k, v, vis, sinks=sinks, mask=NumpyMask(arr), causal=True, causal_alignment="bottom_right")


# ------------------------------------------------------------------------------------------ attention: one lowering
def _entries(*kernels):
    return sum(len(kk._entries) for kk in kernels)


def test_eight_lengths_in_one_bucket_lower_the_attention_kernels_once():
    """Sq = Skv = 65..72 (bucket 80), causal, forward + backward: one lowering per kernel, 0 re-lowers;
    ``bucket=False`` lowers per length (the counter can fail)."""
    kernels = (A.fa_forward, A.fa_backward_dq, A.fa_backward_dkv)
    torch.manual_seed(0)
    q0, k0, v0 = (torch.randn(1, 2, 72, 96) for _ in range(3))  # head dim 96: no other test lowers this program
    before = [len(kk._entries) for kk in kernels]
    for n in range(65, 73):
        q, k, v = (x[:, :, :n].clone().requires_grad_() for x in (q0, k0, v0))
        out = flash_attention(q, k, v, causal=True)
        out.sum().backward()
        if n in (65, 72):
            vis = visibility(1, 2, n, n, causal=True)
            torch.testing.assert_close(out.double(), reference(q, k, v, vis)[0], atol=ATOL, rtol=ATOL)
    assert [len(kk._entries) - b for kk, b in zip(kernels, before)] == [1, 1, 1]
    before = len(A.fa_forward._entries)
    for n in (65, 66):
        flash_attention(q0[:, :, :n], k0[:, :, :n], v0[:, :, :n], causal=True, bucket=False)
    assert len(A.fa_forward._entries) - before == 2


def test_eight_lengths_in_one_bucket_one_graph_and_one_lowering_under_dynamic_compile():
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()

    def f(q, k, v):
        return flash_attention(q, k, v, causal=True, causal_alignment="bottom_right") * 2

    fn = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    torch.manual_seed(1)
    q0, k0, v0 = torch.randn(1, 2, 80, 80), torch.randn(1, 1, 80, 80), torch.randn(1, 1, 80, 80)  # D=80: a fresh program
    before = len(A.fa_forward._entries)
    for n, m in [(n, n + 3) for n in range(65, 73)] + [(77, 80), (80, 80)]:  # Sq = n, Skv = m, both in bucket 80
        q, k, v = q0[:, :, :n], k0[:, :, :m], v0[:, :, :m]
        got = fn(q, k, v)
        if n in (65, 72, 77, 80):
            vis = visibility(1, 2, n, m, causal=True, alignment="bottom_right")
            torch.testing.assert_close(got.double(), 2 * reference(q, k, v, vis)[0], atol=2 * ATOL, rtol=ATOL)
        if n == 72:
            assert len(A.fa_forward._entries) - before == 1, "the kernel was lowered more than once for one bucket"
    # lengths equal to their bucket (no padding) reuse the graph too: no guard "length == bucket" in it (this
    # eager backend runs the op on concrete lengths, where the bucket's own length skips the padding)
    assert counter.frame_count == 1, "dynamo recompiled the graph"


# ------------------------------------------------------------------------------------------ matmul
def test_matmul_rows_in_one_bucket_lower_once_and_match_float64_with_gradients():
    """M = 65..72 (bucket 80) for the nn / nt / tn layouts (a row-major, W.t(), a column-major), with bias
    and activation, forward and backward: one lowering per kernel, results and gradients of the true rows."""
    torch.manual_seed(2)
    w = torch.randn(96, 40)  # [N, K]
    bias = torch.randn(96)
    kernels = (matmul_nn, matmul_nt, matmul_tn)
    before = _entries(*kernels)
    for n in range(65, 73):
        a = torch.randn(n, 40).requires_grad_()
        a_col = torch.randn(40, n).t().requires_grad_()  # column-major: the tn kernel
        wt = w.t().clone().requires_grad_()  # row-major [K, N]: the nn kernel
        outs = [matmul(a, w.t(), bias, "silu"), matmul(a, wt), matmul(a_col, wt)]
        if n in (65, 72):
            refs = [torch.nn.functional.silu(a.double() @ w.t().double() + bias.double()), a.double() @ wt.double(),
                    a_col.double() @ wt.double()]
            for o, r in zip(outs, refs):
                assert o.shape == (n, 96)
                torch.testing.assert_close(o.double(), r, atol=1e-4, rtol=1e-4)
            g = torch.randn(n, 96)
            grads = torch.autograd.grad(outs, (a, wt, a_col), (g, g, g))
            a64, wt64, ac64 = (x.detach().double().requires_grad_() for x in (a, wt, a_col))
            r = [torch.nn.functional.silu(a64 @ w.t().double() + bias.double()), a64 @ wt64, ac64 @ wt64]
            r_grads = torch.autograd.grad(r, (a64, wt64, ac64), (g.double(),) * 3)
            for x, y in zip(grads, r_grads):
                torch.testing.assert_close(x.double(), y, atol=1e-4, rtol=1e-4)
        else:
            torch.autograd.grad(outs, (a, wt, a_col), [torch.ones(n, 96)] * 3)
        if n == 65:
            after_first = _entries(*kernels)
    assert _entries(*kernels) == after_first, "a row count inside the bucket lowered a new program"
    before = len(matmul_nn._entries)
    for n in (65, 66):
        matmul(torch.randn(n, 40), torch.randn(40, 96), bucket=False)
    assert len(matmul_nn._entries) - before == 2


def test_matmul_rows_under_dynamic_compile_one_graph_one_lowering():
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    w = torch.randn(40, 96)
    fn = torch.compile(lambda a: matmul(a, w) + 1, fullgraph=True, dynamic=True, backend=counter)
    before = len(matmul_nn._entries)
    for n in [*range(1025, 1033), 1280]:  # bucket 1280, and 1280 itself (no padding: no second graph)
        a = torch.randn(n, 40)
        torch.testing.assert_close(fn(a).double(), a.double() @ w.double() + 1, atol=1e-4, rtol=1e-4)
    assert counter.frame_count == 1
    assert len(matmul_nn._entries) - before == 1


def test_bad_inputs_at_padded_lengths_raise_typed_errors_naming_the_argument():
    """Padding never hides a caller's mistake: checks run on the caller's shapes."""
    from tpukernels.errors import ArgumentError

    q, k, v = (x.detach() for x in make(1, 2, 1, 70, 70, 64))
    with pytest.raises(ArgumentError, match="k and v must have the same length, got 70 and 69"):
        flash_attention(q, k, v[:, :, :69])
    with pytest.raises(ArgumentError, match=r"kv_segment_ids must have shape \[B, S\] = \(1, 70\)"):
        flash_attention(q, k, v, q_segment_ids=torch.zeros(1, 70, dtype=torch.int32),
                        kv_segment_ids=torch.zeros(1, 69, dtype=torch.int32))
    with pytest.raises(ArgumentError, match="bucket must be a bool"):
        flash_attention(q, k, v, bucket=1)
    with pytest.raises(ArgumentError, match="bucket must be a bool"):
        matmul(torch.randn(70, 8), torch.randn(8, 8), bucket="no")
