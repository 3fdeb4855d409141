"""Flash attention (tpukernels.library.attention): forward + backward against a float64 reference.

The reference below is written from the definitions in the module docstring (dense visibility matrix,
float64 softmax, autograd for gradients), computed from the same low-precision inputs the kernel gets.
Interpret-mode shapes stay small (S <= 300, except two S ~ 1100 cases that exercise the sub-block split of
1024-blocks) so the file runs in a few minutes on 2 cores; block sizes of 128 are forced where a test
needs several blocks, tails, skipped blocks and mask-free interior blocks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tpukernels as tk
from tpukernels.errors import ArgumentError, DTypeError
from tpukernels.library import attention as A
from tpukernels.library.attention import fa_backward_dkv, fa_backward_dq, fa_forward, flash_attention

#: (atol, rtol) per input dtype, for out / gradients. Errors are |kernel - float64 reference| on the same inputs.
#: float32: f32 dots at Precision.HIGHEST and f32 softmax; observed max error ~3e-6 at S <= 300, so 5e-5
#:   leaves >10x headroom while still catching any masking / scaling / indexing bug (those give O(0.1-1)).
#: bfloat16: P is rounded to bf16 before P @ V and dS before dS @ K / dS^T @ Q (relative 2^-9 each), and
#:   the result is rounded to bf16 (2^-9 relative); observed max ~8e-3 (out) and ~2e-2 (grads).
#: float16: computed in f32, only the final cast to fp16 rounds (2^-11 relative on values up to ~4);
#:   observed ~1e-3 (out) and ~2e-3 (grads).
TOL = {
    torch.float32: ((5e-5, 5e-5), (5e-5, 5e-5)),
    torch.bfloat16: ((2e-2, 2e-2), (4e-2, 4e-2)),
    torch.float16: ((3e-3, 3e-3), (6e-3, 6e-3)),
}

B128 = dict(block_q=128, block_kv=128, block_kv_compute=128)
SPLIT = dict(block_q=1024, block_kv=1024, block_kv_compute=512)  # boundary blocks split (see _Plan.row_split)


# ------------------------------------------------------------------------------------------ reference
def visibility(Sq, Skv, *, causal, alignment, window, qs=None, ks=None, B=1):
    """[B, Sq, Skv] bool: query i sees key j (definitions of the module docstring)."""
    i = torch.arange(Sq).view(Sq, 1)
    j = torch.arange(Skv).view(1, Skv)
    off = Skv - Sq if alignment == "bottom_right" else 0
    left, right = window
    vis = torch.ones(Sq, Skv, dtype=torch.bool)
    if causal:
        vis = vis & (j <= i + off)
    if right is not None:
        vis = vis & (j <= i + off + right)
    if left is not None:
        vis = vis & (j >= i + off - left)
    vis = vis.unsqueeze(0).expand(B, Sq, Skv)
    if qs is not None:
        vis = vis & (qs.view(B, Sq, 1) == ks.view(B, 1, Skv))
    return vis


def reference(q, k, v, *, causal=False, alignment="top_left", sm_scale=None, window=(None, None), softcap=None,
              qs=None, ks=None):
    """float64 attention: (out [B,Hq,Sq,Dv], lse [B,Hq,Sq]); rows seeing nothing give out 0, lse -inf."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kk = k.double()[:, [h // group for h in range(Hq)]]  # query head h uses kv head h // group
    vv = v.double()[:, [h // group for h in range(Hq)]]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    s = q.double() @ kk.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    vis = visibility(Sq, Skv, causal=causal, alignment=alignment, window=window, qs=qs, ks=ks, B=B).unsqueeze(1)
    s = torch.where(vis, s, torch.tensor(-math.inf, dtype=torch.float64))
    lse = torch.logsumexp(s, dim=-1)
    any_vis = vis.any(-1, keepdim=True)
    p = torch.where(any_vis, torch.exp(s - torch.where(any_vis.squeeze(-1), lse, 0.0).unsqueeze(-1)), 0.0)
    return p @ vv, lse


def make(B, Hq, Hkv, Sq, Skv, D, dtype, Dv=None, seed=0):
    """Distinct random q, k, v (independent normal draws), requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, Skv, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Skv, Dv or D, generator=g).to(dtype).requires_grad_()
    return q, k, v


def segments(B, S, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (B, S), generator=g).sort(-1).values


def check(q, k, v, *, config=None, lse_grad=False, qs=None, ks=None, **kw):
    """Run forward + backward through torch autograd and compare with the float64 reference."""
    out, lse = flash_attention(q, k, v, return_lse=True, config=config, q_segment_ids=qs, kv_segment_ids=ks, **kw)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == (*q.shape[:3], v.shape[3]) and lse.shape == q.shape[:3]
    g = torch.Generator().manual_seed(123)
    do = torch.randn(out.shape, generator=g).to(out.dtype)
    dl = torch.randn(lse.shape, generator=g) if lse_grad else None
    grads = torch.autograd.grad((out, lse) if lse_grad else (out,), (q, k, v), (do, dl) if lse_grad else (do,))

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    r_out, r_lse = reference(q64, k64, v64, alignment=kw.pop("causal_alignment", "top_left"), qs=qs, ks=ks, **kw)
    finite = torch.isfinite(r_lse)
    r_grads = torch.autograd.grad(
        (r_out, r_lse) if lse_grad else (r_out,), (q64, k64, v64),
        (do.double(), torch.where(finite, dl.double(), 0.0)) if lse_grad else (do.double(),), allow_unused=True,
    )
    (oa, orr), (ga, gr) = TOL[q.dtype]
    torch.testing.assert_close(out.double(), r_out, atol=oa, rtol=orr)
    assert torch.equal(torch.isneginf(lse), ~finite), "lse must be -inf exactly for rows that see no key"
    torch.testing.assert_close(lse[finite].double(), r_lse[finite], atol=oa, rtol=orr)
    for name, a, r in zip("qkv", grads, r_grads):
        assert not a.isnan().any(), f"d{name} has NaN"
        torch.testing.assert_close(a.double(), torch.zeros_like(a, dtype=torch.float64) if r is None else r,
                                   atol=ga, rtol=gr, msg=lambda m, n=name: f"d{n}: {m}")
    return out, lse, grads


# ------------------------------------------------------------------------------------------ features
CASES = {
    # id: (B, Hq, Hkv, Sq, Skv, D, Dv, kwargs, config); head dims 64, 80, 96, 128, 256 and Dv != D all appear
    "dense-one-block-d256": (1, 2, 2, 128, 128, 256, 256, {}, None),
    "causal-gqa-tails": (1, 4, 2, 200, 300, 64, 64, dict(causal=True), B128),
    "causal-bottom-right-lse-grad-dv128": (1, 4, 2, 200, 300, 64, 128, dict(causal=True, causal_alignment="bottom_right"), B128),
    "window-softcap-sq>skv": (2, 4, 2, 200, 150, 64, 64, dict(window=(40, 10), softcap=3.0, sm_scale=0.2), B128),
    "segments-causal-mqa": (2, 4, 1, 150, 130, 64, 64, dict(causal=True, segments=3), B128),
    "decode-fold-bottom-right": (2, 8, 2, 3, 300, 64, 64, dict(causal=True, causal_alignment="bottom_right"), B128),
    "bottom-right-sq>skv-empty-rows-d128": (1, 2, 1, 260, 130, 128, 128, dict(causal=True, causal_alignment="bottom_right"), B128),
    "block_h-2-window-d96": (1, 4, 1, 256, 256, 96, 96, dict(window=(100, 0)), dict(B128, block_h=2)),
    "compute-subblocks-d80": (1, 2, 2, 200, 300, 80, 80, dict(causal=True), dict(block_q=128, block_kv=256, block_kv_compute=128)),
    # 1024-blocks split into 2 x 2 (query x key) 512-sub-blocks: each skipped / mask-free / masked on its own
    "subblock-split-causal": (1, 2, 1, 1100, 1100, 64, 64, dict(causal=True), SPLIT),
    # no tails, block_q == block_kv: the diagonal blocks' sub-blocks are decided statically (diagonal_only)
    "subblock-split-causal-diagonal": (1, 2, 1, 2048, 2048, 64, 64, dict(causal=True), SPLIT),
    "subblock-split-segments-window": (1, 2, 1, 1030, 1100, 64, 64,
                                       dict(window=(300, 40), causal_alignment="bottom_right", softcap=4.0, segments=3),
                                       SPLIT),
}
#: Cases whose tails / padding the TPU-faithful interpreter poisons with NaN (run in interpret="tpu")
TPU_MODE = ("causal-gqa-tails", "window-softcap-sq>skv", "decode-fold-bottom-right", "subblock-split-causal")


def _run_case(case):
    B, Hq, Hkv, Sq, Skv, D, Dv, kw, config = CASES[case]
    kw = dict(kw)
    q, k, v = make(B, Hq, Hkv, Sq, Skv, D, torch.float32, Dv=Dv, seed=len(case))
    qs = ks = None
    if "segments" in kw:
        n = kw.pop("segments")
        qs, ks = segments(B, Sq, n, 1), segments(B, Skv, n, 2)
    check(q, k, v, config=config, lse_grad="lse-grad" in case, qs=qs, ks=ks, **kw)


def test_segments_both_interpret_modes(interpret):
    _run_case("segments-causal-mqa")


@pytest.mark.parametrize("case", TPU_MODE)
def test_features_match_float64_tpu_mode(case):
    with tk.interpret_mode("tpu"):
        _run_case(case)


@pytest.mark.parametrize("case", [c for c in CASES if c not in TPU_MODE and c != "segments-causal-mqa"])
def test_features_match_float64(case):
    _run_case(case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    q, k, v = make(2, 4, 2, 200, 300, 128 if dtype == torch.bfloat16 else 64, dtype, seed=5)
    check(q, k, v, config=B128, causal=True, window=(150, None), softcap=5.0)


def test_fp16_logits_do_not_overflow():
    """|q.k| ~ 1e5 overflows float16 (max 65504); the kernel accumulates dots in f32."""
    q, k, v = make(1, 2, 2, 64, 64, 64, torch.float16, seed=3)
    with torch.no_grad():
        q[0, 0, 0] = 40.0  # q.k = 64 * 40 * 40 = 102400 for key 0
        k[0, 0, 0] = 40.0
    raw = (q.double() @ k.double().transpose(-1, -2)).abs().max().item()
    assert raw > 65504, raw
    with torch.no_grad():
        out = flash_attention(q, k, v, sm_scale=1e-4)
        ref = reference(q, k, v, sm_scale=1e-4)[0]
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float16][0][0], rtol=TOL[torch.float16][0][1])


def test_window_none_0_equals_causal_exactly():
    q, k, v = make(1, 2, 2, 200, 260, 64, torch.bfloat16, seed=11)
    with torch.no_grad():
        for align in ("top_left", "bottom_right"):
            a = flash_attention(q, k, v, causal=True, causal_alignment=align, config=B128, return_lse=True)
            b = flash_attention(q, k, v, window=(None, 0), causal_alignment=align, config=B128, return_lse=True)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_tests_distinguish_semantics():
    """The float64 comparison is not vacuous: each semantic switch changes the answer by >> tolerance."""
    q, k, v = make(1, 2, 2, 100, 160, 64, torch.float32, seed=4)
    with torch.no_grad():
        out = flash_attention(q, k, v, causal=True, causal_alignment="bottom_right")
        for other in (dict(causal=True), dict(), dict(causal=True, causal_alignment="bottom_right", sm_scale=1.0),
                      dict(causal=True, causal_alignment="bottom_right", window=(20, None)),
                      dict(causal=True, causal_alignment="bottom_right", softcap=1.0)):
            ref = reference(q, k, v, alignment=other.pop("causal_alignment", "top_left"), **other)[0]
            assert (out.double() - ref).abs().max() > 1e-2, other


# ------------------------------------------------------------------------------------------ empty rows / sizes
def test_rows_that_see_nothing_are_zero_with_zero_grads(interpret):
    """Segment ids with a query segment absent from the keys, in the TPU-faithful NaN-poisoning mode too."""
    B, Sq, Skv = 2, 150, 140
    q, k, v = make(B, 4, 2, Sq, Skv, 64, torch.float32, seed=21)
    qs = torch.zeros(B, Sq, dtype=torch.int32)
    qs[:, 100:] = 7  # segment 7 has no keys
    ks = torch.zeros(B, Skv, dtype=torch.int32)
    out, lse, (dq, dk, dv) = check(q, k, v, config=B128, qs=qs, ks=ks, lse_grad=True)
    assert torch.equal(out[:, :, 100:], torch.zeros_like(out[:, :, 100:]))
    assert torch.isneginf(lse[:, :, 100:]).all() and torch.isfinite(lse[:, :, :100]).all()
    assert torch.equal(dq[:, :, 100:], torch.zeros_like(dq[:, :, 100:]))


def test_empty_kv_gives_zeros_and_neg_inf_lse():
    q, k, v = make(2, 4, 2, 50, 0, 64, torch.float32, seed=2)
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape


def test_empty_queries():
    q, k, v = make(1, 2, 2, 0, 70, 64, torch.float32, seed=2)
    out, lse = flash_attention(q, k, v, return_lse=True, causal=True)
    assert out.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))


# ------------------------------------------------------------------------------------------ randomized
@given(
    data=st.data(),
    Sq=st.integers(1, 260),
    Skv=st.integers(1, 260),
    group=st.sampled_from([1, 2, 4]),
    D=st.sampled_from([64, 80, 96, 128, 256]),
    causal=st.booleans(),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
)
def test_random_features_forward_match_float64(data, Sq, Skv, group, D, causal, alignment):
    """Forward + lse on random sizes (tails anywhere) and feature mixes (gradients: the cases above)."""
    left = data.draw(st.one_of(st.none(), st.integers(0, 300)), label="window_left")
    right = data.draw(st.one_of(st.none(), st.integers(0, 300)), label="window_right")
    softcap = data.draw(st.one_of(st.none(), st.floats(0.5, 20.0)), label="softcap")
    seg = data.draw(st.booleans(), label="segments")
    q, k, v = make(1, 2 * group, 2, Sq, Skv, D, torch.float32, seed=Sq * 1000 + Skv)
    qs, ks = (segments(1, Sq, 3, Sq), segments(1, Skv, 3, Skv)) if seg else (None, None)
    kw = dict(causal=causal, window=(left, right), softcap=softcap)
    with torch.no_grad(), tk.interpret_mode("fast"):
        out, lse = flash_attention(q, k, v, causal_alignment=alignment, config=B128, q_segment_ids=qs,
                                   kv_segment_ids=ks, return_lse=True, **kw)
    r_out, r_lse = reference(q, k, v, alignment=alignment, qs=qs, ks=ks, **kw)
    (oa, orr), _ = TOL[torch.float32]
    torch.testing.assert_close(out.double(), r_out, atol=oa, rtol=orr)
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isneginf(lse), ~finite)
    torch.testing.assert_close(lse[finite].double(), r_lse[finite], atol=oa, rtol=orr)


# ------------------------------------------------------------------------------------------ plan: skipping, decode
def _plan(Sq, Skv, **kw):
    statics = dict(causal=False, causal_alignment="top_left", sm_scale=None, window_left=None, window_right=None,
                   softcap=None)
    statics.update(kw)
    q = tk.TensorSpec((1, 8, Sq, 128), np.dtype("float32"))
    k = tk.TensorSpec((1, 2, Skv, 128), np.dtype("float32"))
    return A.make_plan(q, k, k, None, **statics, block_q=512, block_kv=512, block_kv_compute=512, block_h=1)


def _blocks_run(p):
    return sum(max(0, j1 - j0 + 1) for j0, j1 in (p.kv_range(i) for i in range(p.nq)))


def test_causal_runs_about_half_the_blocks_and_windows_shrink_the_grid():
    full, causal = _plan(8192, 8192), _plan(8192, 8192, causal=True)
    assert _blocks_run(full) == 256 and _blocks_run(causal) == 136  # 16 * 17 / 2: half plus the diagonal
    local = _plan(8192, 8192, window_left=1000, window_right=0)
    # keys [512 i - 1000, 512 i + 511] lie in kv blocks i-2 .. i: the grid axis spans 3 blocks, not 16
    assert local.kv_steps == 3 and _blocks_run(local) == 3 * 16 - 3
    # dK/dV side: each kv block only walks the query blocks that can see it
    assert local.q_steps == 3 and causal.q_steps == 16


def test_plain_causal_boundary_blocks_are_diagonal_and_their_sub_blocks_static():
    """Under ``diagonal_only`` the kernels decide a boundary block's sub-blocks from their offsets alone: the
    boundary blocks must be exactly ``j == i`` and each static decision must equal the general (traced)
    rule at every diagonal block."""
    def plan(Sq, Skv, bq, bkv, bkvc, **kw):
        statics = dict(causal=True, causal_alignment="top_left", sm_scale=None, window_left=None,
                       window_right=None, softcap=None)
        statics.update(kw)
        q = tk.TensorSpec((1, 8, Sq, 128), np.dtype("bfloat16"))
        k = tk.TensorSpec((1, 2, Skv, 128), np.dtype("bfloat16"))
        return A.make_plan(q, k, k, None, **statics, block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_h=1)

    p = plan(8192, 8192, 2048, 2048, 512)
    assert p.diagonal_only and p.row_split == 4
    for i in range(p.nq):
        j0, j1 = p.kv_range(i)
        for j in range(j0, j1 + 1):
            assert (not p.interior(i, j, q_tail_matters=True)) == (i == j), (i, j)
        nr = p.rows // p.row_split
        for r0 in range(0, p.bq, nr):
            for c0 in range(0, p.bkv, p.bkvc):
                qa, ka = i * p.bq + r0, i * p.bkv + c0
                want = (p.any_visible(qa, nr, ka, p.bkvc), p.all_visible(qa, nr, ka, p.bkvc, q_tail_matters=True))
                assert p.sub_visibility(i, i, r0, nr, c0, p.bkvc, q_tail_matters=True) == want, (i, r0, c0)
    # anything else keeps the runtime checks
    assert not plan(8192, 8192, 2048, 1024, 512).diagonal_only  # block_q != block_kv
    assert not plan(8000, 8000, 2048, 2048, 512).diagonal_only  # tails
    assert not plan(4096, 8192, 2048, 2048, 512, causal_alignment="bottom_right").diagonal_only  # offset
    assert not plan(8192, 8192, 2048, 2048, 512, causal=False, window_left=1000, window_right=0).diagonal_only


def test_decode_folds_the_group_into_query_rows():
    low = tk.lower(fa_forward, "2x16x1x128:bf16", "2x4x4096x128:bf16", "2x4x4096x128:bf16", causal=True,
                   causal_alignment="bottom_right")
    launch = low.resolved.launch
    assert launch.grid[:3] == (2, 4, 1)  # one step per kv head, all 4 query heads of its group
    assert tuple(launch.in_specs[0].block_shape)[1:] == (4, 1, 128)


# ------------------------------------------------------------------------------------------ errors
def test_bad_inputs_raise_typed_errors():
    q, k, v = make(1, 4, 2, 16, 16, 64, torch.float32)
    cases = [
        (lambda: flash_attention(q[0], k, v), ArgumentError, "rank 4"),
        (lambda: flash_attention(q, k[:, :1].expand(1, 3, 16, 64), v[:, :1].expand(1, 3, 16, 64)), ArgumentError, "multiple of k/v heads"),
        (lambda: flash_attention(q, k, v.to(torch.bfloat16)), DTypeError, "share one dtype"),
        (lambda: flash_attention(q, k[..., :32], v), ArgumentError, "head dim"),
        (lambda: flash_attention(q, k, v[:, :, :8]), ArgumentError, "same length"),
        (lambda: flash_attention(q, k, v, q_segment_ids=torch.zeros(1, 16, dtype=torch.int32)), ArgumentError, "together"),
        (lambda: flash_attention(q, k, v, q_segment_ids=torch.zeros(1, 15), kv_segment_ids=torch.zeros(1, 16)), DTypeError, "integer"),
        (lambda: flash_attention(q, k, v, q_segment_ids=torch.zeros(1, 15, dtype=torch.int32),
                                 kv_segment_ids=torch.zeros(1, 16, dtype=torch.int32)), ArgumentError, "q_segment_ids must have shape"),
        (lambda: flash_attention(q, k, v, window=(-1, None)), ArgumentError, "window left"),
        (lambda: flash_attention(q, k, v, window=3), ArgumentError, "(left, right) pair"),
        (lambda: flash_attention(q, k, v, causal="false"), ArgumentError, "causal must be a bool"),
        (lambda: flash_attention(q, k, v, return_lse="yes"), ArgumentError, "return_lse must be a bool"),
        (lambda: flash_attention(q, k, v, softcap=0.0), ArgumentError, "softcap"),
        (lambda: flash_attention(q, k, v, sm_scale=float("nan")), ArgumentError, "sm_scale"),
        (lambda: flash_attention(q, k, v, causal_alignment="bottom-right"), ArgumentError, "causal_alignment"),
        (lambda: flash_attention(q.double(), k.double(), v.double()), DTypeError, "float64"),
        (lambda: fa_forward(q.half(), k.half(), v.half()), DTypeError, "float16"),
    ]
    for fn, exc, words in cases:
        with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
            fn()


def test_int64_segment_ids_are_accepted():
    q, k, v = make(1, 2, 2, 40, 40, 64, torch.float32)
    qs = ks = torch.arange(40).div(10, rounding_mode="floor").unsqueeze(0)  # int64
    with torch.no_grad():
        a = flash_attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks)
        b = flash_attention(q, k, v, q_segment_ids=qs.int(), kv_segment_ids=ks.int())
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ torch integration
def test_opcheck():
    q, k, v = make(1, 4, 2, 40, 72, 64, torch.float32)
    qs = segments(1, 40, 2, 0).int().unsqueeze(1)
    ks = segments(1, 72, 2, 1).int().unsqueeze(1)
    statics = dict(causal=True, causal_alignment="bottom_right", sm_scale=None, window_left=30, window_right=None,
                   softcap=4.0)
    torch.library.opcheck(torch.ops.tpukernels.flash_attention_fwd, (q, k, v, qs, ks), statics)
    out, lse = torch.ops.tpukernels.flash_attention_fwd(q, k, v, qs, ks, **statics)
    do, di = torch.randn_like(out), torch.randn_like(lse)
    args = tuple(x.detach() for x in (q, k, v, do, lse, di)) + (qs, ks)
    torch.library.opcheck(torch.ops.tpukernels.flash_attention_bwd_dq, args, statics)
    torch.library.opcheck(torch.ops.tpukernels.flash_attention_bwd_dkv, args, statics)


def test_public_op_means_the_public_function():
    """torch.ops.tpukernels.flash_attention returns what flash_attention returns (out only), with autograd."""
    q, k, v = make(1, 4, 2, 40, 56, 64, torch.float32, seed=3)
    qs, ks = segments(1, 40, 2, 5), segments(1, 56, 2, 6)
    kw = dict(causal=True, causal_alignment="bottom_right", softcap=5.0, q_segment_ids=qs, kv_segment_ids=ks)
    want = flash_attention(q, k, v, window=(20, None), **kw)
    got = torch.ops.tpukernels.flash_attention(q, k, v, window_left=20, window_right=None, **kw)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    g = torch.autograd.grad(got.sum(), (q, k, v))
    g_ref = torch.autograd.grad(flash_attention(q, k, v, window=(20, None), **kw).sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)
    ref, _ = reference(q, k, v, causal=True, alignment="bottom_right", window=(20, None), softcap=5.0, qs=qs, ks=ks)
    torch.testing.assert_close(got.double(), ref, atol=5e-5, rtol=5e-5)


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = make(2, 4, 2, 48, 80, 64, torch.float32, seed=8)
    qs, ks = segments(2, 48, 2, 3), segments(2, 80, 2, 4)

    def f(q, k, v):
        out, lse = flash_attention(q, k, v, causal=True, causal_alignment="bottom_right", window=(40, None),
                                   q_segment_ids=qs, kv_segment_ids=ks, return_lse=True)
        return (out * 2).sum() + lse.clamp(min=-1e4).sum()

    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ compile-only
STATICS_CAUSAL = dict(causal=True, causal_alignment="top_left", sm_scale=None, window_left=None, window_right=None,
                      softcap=None)


@pytest.mark.aot
@pytest.mark.parametrize("chip", [pytest.param("v5e", marks=pytest.mark.slow), "v6e",
                                  pytest.param("tpu7x", marks=pytest.mark.slow)])  # make test: v6e (~60 s each)
def test_compiles_for_chip_forward_and_backward(chip):
    """B=1, Hq=32, Hkv=8, S=4096, D=128, causal, bf16: forward, dQ and dK/dV kernels compile with Mosaic."""
    q, kv = "1x32x4096x128:bf16", "1x8x4096x128:bf16"
    rows = "1x32x1x4096:f32"
    for kernel, args in ((fa_forward, (q, kv, kv)), (fa_backward_dq, (q, kv, kv, q, rows, rows)),
                         (fa_backward_dkv, (q, kv, kv, q, rows, rows))):
        res = tk.compile_for(kernel, chip, *args, with_mlir=False, **STATICS_CAUSAL)
        assert res.ok, res.summary()
        assert res.vmem_estimate_bytes <= res.vmem_limit_bytes


@pytest.mark.aot
def test_compiles_decode_segments_window_softcap():
    """Feature combinations hit different Mosaic lowering paths (fold relayouts, transposes, int compares)."""
    st_ = dict(STATICS_CAUSAL, causal_alignment="bottom_right", window_left=512, softcap=30.0)
    for args in (("2x16x5x128:bf16", "2x4x1000x128:bf16", "2x4x1000x128:bf16", "2x1x5:i32", "2x1x1000:i32"),
                 ("1x4x300x80:f32", "1x2x200x80:f32", "1x2x200x80:f32", "1x1x300:i32", "1x1x200:i32")):
        q, k, v = args[:3]
        rows = q.replace(f"x{q.split('x')[3].split(':')[0]}:", "x1:").split(":")[0]
        r = tk.compile_for(fa_forward, "v6e", *args[:3], *args[3:], with_mlir=False, **st_)
        assert r.ok, r.summary()
        B, H, S = (int(x) for x in q.split(":")[0].split("x")[:3])
        lse = f"{B}x{H}x1x{S}:f32"
        for kernel in (fa_backward_dq, fa_backward_dkv):
            r = tk.compile_for(kernel, "v6e", *args[:3], q, lse, lse, *args[3:], with_mlir=False, **st_)
            assert r.ok, r.summary()


@pytest.mark.parametrize("causal", [False, True])
def test_huge_sm_scale_stays_finite_like_sdpa(causal):
    """sm_scale=1e30 (logits ~1e31, where one f32 ulp is ~1e24): torch SDPA float32 gives the row's argmax
    value; so must we (before: NaN / rows wrongly empty), and the gradients stay finite."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 72, 64, generator=g).requires_grad_() for _ in range(3))
    for scale in (1e30, 1e36):
        out = flash_attention(q, k, v, sm_scale=scale, causal=causal, interpret="fast")
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)
        assert torch.isfinite(ref).all()
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in grads)


def test_float32_block_q_64_forward_backward():
    """float32 with block_q=64 (< 128 and < Sq): the lse / di / segment rows move as whole-row blocks read
    and written through aligned 128-lane windows (a (1, 64) block broke the (8, 128) rule); NaN-poisoned
    interpreter, GQA heads folded (block_h=2), segments, causal; block_q=192 is a typed error."""
    q, k, v = make(1, 4, 2, 200, 230, 64, torch.float32, seed=4)
    qs, ks = segments(1, 200, 3, 1), segments(1, 230, 3, 2)
    with tk.interpret_mode("tpu"):
        check(q, k, v, config=dict(block_q=64, block_kv=128, block_kv_compute=128, block_h=2), causal=True,
              qs=qs, ks=ks)
    with pytest.raises(ArgumentError, match="block_q=192"):
        flash_attention(q, k, v, config=dict(block_q=192, block_kv=128, block_kv_compute=128))


@pytest.mark.parametrize("chip,wide", [("v5e", False), ("v6e", True), ("tpu7x", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_sums_ride_the_pv_product_where_the_mxu_has_room(monkeypatch, chip, wide, dtype):
    """``Plan.rowsum_on_mxu``: on chips whose MXU is >= Dv + 128 columns wide (jax's tpu_info: v6e, tpu7x) a
    mask-free forward sums the rows of P in the PV product (``P @ [V | 1]``); v5e's 128-column MXU, a mask (causal,
    a kv tail) or Dv = 256 keeps the VPU / XLU sum. Each path (the target chip picks it) equals float64, forward
    and backward, on a NaN-poisoned interpreter, over four K/V blocks of two sub-blocks each (the running max
    moves between them)."""
    from tpukernels.chips import get_chip
    from tpukernels.dsl.spec import TensorSpec
    from tpukernels.lowering import launching_for

    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", chip)
    cfg = dict(block_q=128, block_kv=256, block_kv_compute=128, block_h=1)
    q, k, v = make(1, 4, 2, 256, 1024, 128, dtype, seed=7)  # lengths of a shape bucket: no padding, no mask
    plain = dict(A.CAUSAL, causal=False)

    def plan(Skv=1024, D=128, **statics):
        q_, k_ = TensorSpec((1, 4, 256, D), np.dtype("float32")), TensorSpec((1, 2, Skv, D), np.dtype("float32"))
        return A.make_plan(q_, k_, k_, None, **dict(plain, **statics), **cfg)

    with launching_for(get_chip(chip)):
        assert plan().rowsum_on_mxu is wide
        assert not plan(causal=True).rowsum_on_mxu
        assert not plan(Skv=1000).rowsum_on_mxu  # a kv tail: masked
        assert not plan(D=256).rowsum_on_mxu
    with tk.interpret_mode("tpu"):
        check(q, k, v, config=cfg, lse_grad=True)


@pytest.mark.aot
def test_compiles_float32_block_q_64_and_masked_kernels():
    """Mosaic accepts the whole-row lse windows (block_q=64, float32) and the block-sparse masked kernels."""
    from tpukernels.library.attention import fa_backward_dkv_masked, fa_backward_dq_masked, fa_forward_masked

    q, kv, rows = "1x4x1000x128:f32", "1x2x1000x128:f32", "1x4x1x1000:f32"
    cfg = dict(block_q=64, block_kv=256, block_kv_compute=256, block_h=2)
    for kernel, args in ((fa_forward, (q, kv, kv)), (fa_backward_dq, (q, kv, kv, q, rows, rows)),
                         (fa_backward_dkv, (q, kv, kv, q, rows, rows))):
        r = tk.compile_for(kernel, "v6e", *args, with_mlir=False, config=cfg, **STATICS_CAUSAL)
        assert r.ok, r.summary()
    q, kv, rows = "1x32x4096x128:bf16", "1x8x4096x128:bf16", "1x32x1x4096:f32"
    tabs, mbs = ("3x1x8x8:i32", "3x1x8x8:i32"), ("1x512x512:i8", "1x512x512:i8")
    for kernel, args in ((fa_forward_masked, (*tabs, q, kv, kv, *mbs)),
                         (fa_backward_dq_masked, (*tabs, q, kv, kv, q, rows, rows, *mbs)),
                         (fa_backward_dkv_masked, (*tabs, q, kv, kv, q, rows, rows, *mbs))):
        r = tk.compile_for(kernel, "v6e", *args, with_mlir=False, sm_scale=None, softcap=None)
        assert r.ok, r.summary()


def _shipped_noncausal_entries():
    """(kernel, chip, entry) of every shipped non-causal attention entry (``benchmarks/attention.py --mask full``)."""
    from tpukernels.autotune import db
    from tpukernels.library.attention.backward_fused import fa_backward_fused

    out = []
    for kernel in (fa_forward, fa_backward_fused):
        for chip in ("v5e", "v6e", "tpu7x"):
            for e in db.load(db.shipped_db_path(kernel.qualname, chip)):
                if e["key"]["statics"].get("causal") is False and e["key"]["source_hash"] == db.source_hash(kernel):
                    out.append(pytest.param(kernel, chip, e, id=f"{kernel.qualname.split('::')[-1]}-{chip}-"
                                            f"S{e['key']['shapes'][0][2]}"))
    return out


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("kernel,chip,entry", _shipped_noncausal_entries())
def test_shipped_noncausal_entries_compile_at_their_shapes(kernel, chip, entry):
    """The non-causal entries were chosen by libtpu's static estimate; some use 4096-row blocks (beyond the
    tunables' BLOCKS): each compiles with Mosaic for its chip at its key's shapes, within its VMEM request."""
    q, k, v = ("x".join(map(str, s)) + ":bf16" for s in entry["key"]["shapes"][:3])  # the key's (bucketed) shapes
    B, Hq, S, _ = entry["key"]["shapes"][0]
    rows = f"{B}x{Hq}x1x{S}:f32"  # lse / di: [B, Hq, 1, Sq] (the key buckets their unit dim)
    args = (q, k, v) if kernel is fa_forward else (q, k, v, q, rows, rows)
    res = tk.compile_for(kernel, chip, *args, with_mlir=False, config=entry["config"], **entry["key"]["statics"])
    assert res.ok, res.summary()
    assert dict(res.config) == entry["config"] and res.vmem_estimate_bytes <= res.vmem_limit_bytes
