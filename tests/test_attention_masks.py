"""Block-sparse masks (splash-attention API), attention sinks and QK/V head dims of flash attention.

Every kernel result is compared with a float64 dense reference written here from the definitions (a
visibility matrix built with numpy formulas independent of the mask classes, float64 softmax with the sink
logit as an extra column, autograd for gradients), computed from the same inputs the kernel gets. Shapes are
small (S <= 300) and blocks 128 so that tails, skipped, full and partial blocks all occur.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError, DeviceError, DTypeError
from tpukernels.library.attention import (CausalMask, ChunkedCausalMask, FullMask, LocalMask, MultiHeadMask,
                                          NumpyMask, flash_attention, mask_tables)
from tpukernels.library.attention import masks as M

B128 = dict(block_q=128, block_kv=128, block_kv_compute=128)
ATOL = 1e-4  # float32: observed ~1e-6; masking / indexing bugs give O(0.1-1)


def causal_np(Sq, Skv, offset=0):
    return np.arange(Sq)[:, None] + offset >= np.arange(Skv)[None, :]


def local_np(Sq, Skv, left, right, offset=0):
    i, j = np.arange(Sq)[:, None] + offset, np.arange(Skv)[None, :]
    out = np.ones((Sq, Skv), bool)
    if left is not None:
        out &= j >= i - left
    if right is not None:
        out &= j <= i + right
    return out


def reference(q, k, v, vis, sinks=None, sm_scale=None):
    """float64 attention with a dense visibility [Hq or 1, Sq, Skv]; rows seeing nothing give 0."""
    q, k, v = (x.double() for x in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * (sm_scale if sm_scale is not None else 1 / math.sqrt(q.shape[-1]))
    s = s.masked_fill(~vis, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


def run_and_compare(q, k, v, vis, *, sinks=None, interpret="fast", **kw):
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    out, lse = flash_attention(q, k, v, sinks=sinks, return_lse=True, interpret=interpret, **kw)
    g = torch.Generator().manual_seed(7)
    do, dl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    grads = torch.autograd.grad((out, lse), leaves, (do, dl))
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    r_out, r_lse = reference(*leaves64[:3], torch.as_tensor(vis), sinks=leaves64[3] if sinks is not None else None,
                             sm_scale=kw.get("sm_scale"))
    fin = torch.isfinite(r_lse)
    r_grads = torch.autograd.grad((r_out, r_lse), leaves64, (do.double(), torch.where(fin, dl.double(), 0.0)),
                                  allow_unused=True)
    torch.testing.assert_close(out.double(), r_out, atol=ATOL, rtol=ATOL)
    assert torch.equal(torch.isneginf(lse), ~fin), "lse is -inf exactly where a row sees nothing"
    torch.testing.assert_close(lse[fin].double(), r_lse[fin], atol=ATOL, rtol=ATOL)
    for name, a, r in zip(("q", "k", "v", "sinks"), grads, r_grads):
        assert not a.isnan().any(), f"d{name} has NaN"
        r = torch.zeros_like(a, dtype=torch.float64) if r is None else r
        torch.testing.assert_close(a.double(), r, atol=ATOL, rtol=ATOL, msg=lambda m, n=name: f"d{n}: {m}")
    return out, lse, grads


def make(B, Hq, Hkv, Sq, Skv, D, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Sq, D, generator=g).requires_grad_(),
            torch.randn(B, Hkv, Skv, D, generator=g).requires_grad_(),
            torch.randn(B, Hkv, Skv, Dv or D, generator=g).requires_grad_())


# ------------------------------------------------------------------------------------------ mask objects
def test_mask_objects_match_formulas_and_combine():
    Sq, Skv = 37, 53
    rng = np.random.default_rng(0)
    arr = rng.random((Sq, Skv)) < 0.4
    assert np.array_equal(CausalMask((Sq, Skv), offset=3)[:, :], causal_np(Sq, Skv, 3))
    assert np.array_equal(LocalMask((Sq, Skv), (4, 2), offset=-5)[:, :], local_np(Sq, Skv, 4, 2, -5))
    assert np.array_equal(LocalMask((Sq, Skv), (None, 0))[:, :], causal_np(Sq, Skv))
    assert FullMask((Sq, Skv))[:, :].all()
    i, j = np.arange(Sq)[:, None], np.arange(Skv)[None, :]
    assert np.array_equal(ChunkedCausalMask((Sq, Skv), 8)[:, :], (i >= j) & (i // 8 == j // 8))
    both = (NumpyMask(arr) | CausalMask((Sq, Skv))) & LocalMask((Sq, Skv), (10, None))
    assert np.array_equal(both[:, :], (arr | causal_np(Sq, Skv)) & local_np(Sq, Skv, 10, None))
    assert np.array_equal(both[5:20, 7:9], ((arr | causal_np(Sq, Skv)) & local_np(Sq, Skv, 10, None))[5:20, 7:9])
    assert NumpyMask(torch.from_numpy(arr)) == NumpyMask(arr.copy()) and CausalMask((3, 3)) != CausalMask((3, 3), 1)
    mh = MultiHeadMask([CausalMask((Sq, Skv)), NumpyMask(arr)]) & FullMask((Sq, Skv))
    assert mh.num_heads == 2 and np.array_equal(M.head_masks(mh)[1][:, :], arr)


def test_tables_skip_empty_blocks_run_full_ones_plain_and_are_cached():
    S, b = 512, 128
    t = mask_tables(CausalMask((S, S)), b, b)
    n = S // b
    assert t.counts == {"empty": n * (n - 1) // 2, "partial": n, "full": n * (n - 1) // 2}
    assert t.blocks.shape == (1, b, b) and np.array_equal(t.blocks[0], np.tril(np.ones((b, b), np.int8)))
    fwd = t.fwd  # [3, Hm, nq, T]: query block 1 visits key blocks 0 (full) and 1 (partial), then repeats 1 (skip)
    assert fwd.shape == (3, 1, n, n)
    assert list(fwd[0, 0, 1]) == [0, 1, 1, 1] and list(fwd[1, 0, 1]) == [2, 1, 0, 0]
    assert list(t.bwd[0, 0, 2]) == [2, 3, 3, 3] and list(t.bwd[1, 0, 2]) == [1, 2, 0, 0]  # key-major lists
    before = M.mask_cache_info().hits
    assert mask_tables(CausalMask((S, S)), b, b) is t  # an equal mask built anew hits the cache
    assert M.mask_cache_info().hits == before + 1
    # identical heads of a multi-head mask share one table; different heads get their own
    assert mask_tables(MultiHeadMask([CausalMask((S, S))] * 4), b, b).heads == 1
    assert mask_tables(MultiHeadMask([CausalMask((S, S)), FullMask((S, S))]), b, b).heads == 2


# ------------------------------------------------------------------------------------------ kernels
@settings(max_examples=3)
@given(data=st.data(), Sq=st.integers(1, 200), Skv=st.integers(1, 200), group=st.sampled_from([1, 2]),
       density=st.sampled_from([0.0, 0.05, 0.5, 1.0]), per_head=st.booleans(), offset=st.integers(-64, 64))
def test_random_masks_forward_backward_match_float64(data, Sq, Skv, group, density, per_head, offset):
    """Random per-head / shared masks (densities 0 to 1, so fully masked rows and blocks occur) unioned with
    a causal mask with an offset: out, lse and dq, dk, dv vs the float64 reference."""
    Hkv = 1
    Hq = Hkv * group
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    arrs = [rng.random((Sq, Skv)) < density for _ in range(Hq if per_head else 1)]
    cm = CausalMask((Sq, Skv), offset=offset)
    if per_head:
        mask = MultiHeadMask([NumpyMask(a) for a in arrs]) & cm
        vis = np.stack(arrs) & causal_np(Sq, Skv, offset)
    else:
        mask = NumpyMask(arrs[0]) | cm
        vis = (arrs[0] | causal_np(Sq, Skv, offset))[None]
    q, k, v = make(1, Hq, Hkv, Sq, Skv, 32, seed=seed)
    run_and_compare(q, k, v, vis, mask=mask, config=B128)


def test_fully_masked_rows_blocks_segments_gqa_sinks_nan_poisoned():
    """Rows that see nothing give 0 (with sinks: lse = sink; without, -inf: see the random-mask test) and zero
    gradients; fully masked
    key blocks are skipped; a multi-head mask with GQA, segment ids, a window folded into the mask, tails
    and sinks, in the NaN-poisoned interpreter (``tpu``: padding and uninitialized memory are NaN)."""
    Sq, Skv, Hq, Hkv = 200, 300, 4, 2
    q, k, v = make(1, Hq, Hkv, Sq, Skv, 64, seed=3)
    i = np.arange(Sq)[:, None]
    per = [local_np(Sq, Skv, 20, 0, offset=100), np.zeros((Sq, Skv), bool),  # head 1 sees nothing
           np.broadcast_to(i % 3 == 0, (Sq, Skv)).copy(),  # two of three rows of head 2 see nothing
           np.pad(np.ones((Sq, 130), bool), ((0, 0), (0, Skv - 130)))]  # head 3: key blocks 2 fully masked
    mask = MultiHeadMask([NumpyMask(a) for a in per])
    qs = torch.tensor([[0] * 120 + [1] * 80])
    ks = torch.tensor([[0] * 180 + [1] * 120])
    seg = (qs.view(Sq, 1) == ks.view(1, Skv)).numpy()
    win = local_np(Sq, Skv, None, 150)  # window=(None, 150) folded into the mask
    vis = np.stack(per) & seg & win
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    out, lse, grads = run_and_compare(q, k, v, vis, sinks=sinks, mask=mask, window=(None, 150), q_segment_ids=qs,
                                      kv_segment_ids=ks, config=B128, interpret="tpu")
    assert (out[0, 1] == 0).all() and torch.equal(lse[0, 1], torch.full((Sq,), -1.0))
    assert grads[3].abs().min() > 0  # every head's sink gets a gradient


def test_sinks_without_mask_and_qk_v_head_dims_192_128():
    """gpt-oss sinks on the dense path (causal, sliding window) and MLA-style D=192 / Dv=128, forward and
    backward (including the sinks' gradient)."""
    Sq = Skv = 140
    q, k, v = make(1, 4, 2, Sq, Skv, 192, Dv=128, seed=5)
    sinks = torch.tensor([1.0, 0.0, -2.0, 3.0], requires_grad=True)
    vis = local_np(Sq, Skv, 32, 0)[None]
    out, _, _ = run_and_compare(q, k, v, vis, sinks=sinks, causal=True, window=(32, None), config=B128)
    assert out.shape == (1, 4, Sq, 128)
    # the same through a mask object: LocalMask((Sq, Skv), (32, 0))
    out2, _, _ = run_and_compare(q, k, v, vis, sinks=sinks, mask=LocalMask((Sq, Skv), (32, 0)), config=B128)
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)


def test_mask_bad_inputs_raise_typed_errors():
    q, k, v = make(1, 4, 2, 64, 96, 32)
    cases = [
        (dict(mask=CausalMask((64, 95))), ArgumentError, "mask shape"),
        (dict(mask=MultiHeadMask([CausalMask((64, 96))] * 3)), ArgumentError, "heads"),
        (dict(mask=np.ones((64, 96), np.int32)), DTypeError, "mask must be bool"),
        (dict(mask=torch.ones(64, 96, dtype=torch.bool)), ArgumentError, "NumpyMask"),
        (dict(mask="causal"), ArgumentError, "mask must be"),
        (dict(sinks=torch.zeros(3)), ArgumentError, "sinks must have shape"),
        (dict(sinks=torch.zeros(4, dtype=torch.int32)), DTypeError, "sinks must be a float tensor"),
        (dict(sinks=torch.zeros(1, 4)), ArgumentError, r"sinks must have shape \[Hq\] = \(4,\)"),
        (dict(sinks=[0.0] * 4), ArgumentError, "sinks must be a torch.Tensor"),
        # a sink table on another device: torch's prims device message before (issue 36 item 7)
        (dict(sinks=torch.zeros(4, device="meta")), DeviceError, "sinks is on meta but q is on cpu"),
        (dict(sinks=torch.zeros(4, device="meta"), mask=CausalMask((64, 96))), DeviceError, "sinks is on meta"),
        (dict(mask=CausalMask((64, 96)), config=dict(block_h=2)), ArgumentError, "block_h"),
    ]
    for kw, err, words in cases:
        with pytest.raises(err, match=words):
            flash_attention(q, k, v, interpret="fast", **kw)
    with pytest.raises(DTypeError, match="bool"):
        NumpyMask(np.ones((4, 4), np.float32))
    with pytest.raises(ArgumentError, match="window_size"):
        LocalMask((4, 4), (1, -1))
    with pytest.raises(ArgumentError, match="shapes differ"):
        CausalMask((4, 4)) | CausalMask((4, 5))


def test_hf_attention_interface_passes_gpt_oss_sinks_and_sliding_window():
    """transformers' attention interface (gpt-oss calls it with ``s_aux=self.sinks`` and a sliding window):
    the kernel path and the eager fallback (a mask the kernel cannot express) both honour the sinks."""
    pytest.importorskip("transformers")
    from tpukernels.integrations.transformers import attention_forward

    class Layer(torch.nn.Module):
        is_causal = True

    Sq = 96
    q, k, v = make(1, 4, 2, Sq, Sq, 32, seed=9)
    sinks = torch.tensor([0.3, -0.5, 1.5, 0.0])
    win = 16  # HF convention: query i sees keys i - 16 < j <= i
    vis = local_np(Sq, Sq, win - 1, 0)[None]
    ref, _ = reference(q, k, v, torch.as_tensor(vis), sinks=sinks)
    hf_mask = torch.as_tensor(vis)[None]  # [B, 1, Sq, Skv] as transformers' mask builder gives sliding layers
    out, _ = attention_forward(Layer(), q, k, v, hf_mask, scaling=None, sliding_window=win, s_aux=sinks)
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=ATOL, rtol=ATOL)
    odd = torch.as_tensor(vis & (np.arange(Sq)[None, :] % 5 != 1))[None]  # not causal x window x padding
    ref2, _ = reference(q, k, v, odd[0], sinks=sinks)
    out2, _ = attention_forward(Layer(), q, k, v, odd, scaling=None, s_aux=sinks)
    torch.testing.assert_close(out2.transpose(1, 2).double(), ref2, atol=ATOL, rtol=ATOL)


def test_masked_attention_under_torch_compile_fullgraph():
    """A mask object closed over by a compiled function: fullgraph torch.compile, forward and backward, equal
    to eager."""
    m = CausalMask((128, 128), offset=3)
    q, k, v = make(1, 2, 1, 128, 128, 32, seed=2)

    def f(q, k, v):
        return flash_attention(q, k, v, mask=m)

    got = torch.compile(f, fullgraph=True)(q, k, v)
    want = f(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    g1 = torch.autograd.grad(got.sum(), (q, k, v))
    g2 = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("path", ["dense", "dense_causal_window", "mask"])
def test_sinks_gradient_exact_at_large_lse(path):
    """d_sinks at lse ~ 15 (float32) against float64: a sink near 0 then has probability ~1e-7 per row, and
    a scale written as ``sigmoid(lse - sink)`` resolves ``1 - sigmoid`` only in float32 steps of ~6e-8 (its
    backward is ``y (1 - y)``), putting d_sinks percents off (issue 36: splash's own test saw 28%). Checked
    relative to the gradient itself, on the dense and the ``mask=`` paths."""
    B, Hq, Hkv, S, D = 1, 4, 2, 64, 32
    Sq = 24 if path == "dense_causal_window" else S  # bottom-right: every row sees 41 keys
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, Hq, Sq, D, generator=g) / D ** 0.25
    k = torch.randn(B, Hkv, S, D, generator=g) / D ** 0.25
    q[..., 0], k[..., 0] = 12 ** 0.5, 12 ** 0.5  # every logit ~ 12 + N(0, 1): lse ~ 12 + log(#keys) ~ 15-16
    v = torch.randn(B, Hkv, S, D, generator=g)
    sinks = torch.tensor([0.0, -1.0, 0.5, 2.0])
    leaves = [x.requires_grad_() for x in (q, k, v, sinks)]
    kw, vis = dict(sm_scale=1.0, config=B128), np.ones((S, S), bool)
    if path == "dense_causal_window":
        kw.update(causal=True, causal_alignment="bottom_right", window=(40, None))
        vis = local_np(Sq, S, 40, 0, offset=S - Sq)
    elif path == "mask":
        kw["mask"] = LocalMask((S, S), (None, 50))
        vis = local_np(S, S, None, 50)
    out, lse = flash_attention(q, k, v, sinks=sinks, return_lse=True, interpret="fast", **kw)
    do = torch.randn(out.shape, generator=g)
    d_sinks = torch.autograd.grad(out, sinks, do)[0]
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    r_out, r_lse = reference(*leaves64[:3], torch.as_tensor(vis)[None], sinks=leaves64[3], sm_scale=1.0)
    r_d_sinks = torch.autograd.grad(r_out, leaves64[3], do.double())[0]
    assert 14 < float(lse.min()) and float(lse.max()) < 18, "the case is meant to sit at lse ~ 15"
    torch.testing.assert_close(lse.double(), r_lse, atol=1e-5, rtol=1e-6)
    # |d_sinks| ~ 1e-6 here: an absolute tolerance would pass anything; the relative error is ~1e-6 exact and
    # 1e-2..1e-1 with the sigmoid form
    rel = ((d_sinks.double() - r_d_sinks).abs() / r_d_sinks.abs()).max().item()
    assert rel < 1e-4, f"d_sinks {d_sinks.tolist()} vs float64 {r_d_sinks.tolist()}: relative error {rel:.2e}"


@pytest.mark.parametrize("backend, kw", [
    ("aot_eager", dict(window=(20, 5))),
    ("aot_eager", dict(causal=True, causal_alignment="bottom_right", window=(30, None))),
    ("inductor", dict(causal=True)),
])
def test_mask_with_causal_or_window_under_torch_compile_fullgraph(backend, kw):
    """``mask=`` with ``causal`` / ``window`` (intersected with the mask inside flash_attention) under
    fullgraph torch.compile: the intersection used to be built in traced code and handed to the tables'
    constant-result function, which dynamo cannot do (``InternalTorchDynamoError: 'LogicalAnd' object has no
    attribute 'left'``, issue 36 item 6). Forward and backward against the float64 reference."""
    Sq, Skv = 100, 140
    arr = np.random.default_rng(4).random((Sq, Skv)) < 0.6
    m = NumpyMask(arr)
    q, k, v = make(1, 2, 1, Sq, Skv, 32, seed=6)
    off = Skv - Sq if kw.get("causal_alignment") == "bottom_right" else 0
    left, right = kw.get("window", (None, None))
    if kw.get("causal"):
        right = 0 if right is None else min(right, 0)
    vis = (arr & local_np(Sq, Skv, left, right, offset=off))[None]

    def f(q, k, v):
        return flash_attention(q, k, v, mask=m, config=B128, **kw)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    r_out, _ = reference(*leaves64, torch.as_tensor(vis))
    r_grads = torch.autograd.grad(r_out, leaves64, do.double())
    torch.testing.assert_close(out.double(), r_out, atol=ATOL, rtol=ATOL)
    for name, a, r in zip("qkv", grads, r_grads):
        torch.testing.assert_close(a.double(), r, atol=ATOL, rtol=ATOL, msg=lambda msg, n=name: f"d{n}: {msg}")


def test_mask_built_inside_compiled_code_and_swapped_data_masks():
    """Masks constructed inside the compiled function (``CausalMask(...) & LocalMask(...)``, a
    ``MultiHeadMask`` around a closed-over ``NumpyMask``) compile with fullgraph; the tables follow the mask:
    swapping the closed-over ``NumpyMask`` recompiles instead of reusing the first tables (a stale table would
    be a silent wrong answer). Forward against the float64 reference; masks round-trip through their spec."""
    Sq, Skv = 100, 140
    rng = np.random.default_rng(8)
    arrs = [rng.random((Sq, Skv)) < 0.5 for _ in range(2)]
    q, k, v = make(1, 2, 1, Sq, Skv, 32, seed=10)
    held = {}

    def f(q, k, v):
        m = (MultiHeadMask([held["data"], CausalMask((Sq, Skv), offset=20)])
             | (CausalMask((Sq, Skv)) & LocalMask((Sq, Skv), (5, None))))
        return flash_attention(q, k, v, mask=m, config=B128)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    outs = []
    for arr in arrs:
        held["data"] = NumpyMask(arr)
        vis = np.stack([arr, causal_np(Sq, Skv, 20)]) | (causal_np(Sq, Skv) & local_np(Sq, Skv, 5, None))
        r_out, _ = reference(q.detach(), k.detach(), v.detach(), torch.as_tensor(vis))
        outs.append(cf(q, k, v))
        torch.testing.assert_close(outs[-1].double(), r_out, atol=ATOL, rtol=ATOL)
    assert (outs[0] - outs[1]).abs().max() > 0.1  # the two data masks give different answers
    m = MultiHeadMask([NumpyMask(arrs[0]), ChunkedCausalMask((Sq, Skv), 16) & FullMask((Sq, Skv))]) | CausalMask(
        (Sq, Skv), offset=-3)
    spec, leaves = M.mask_spec(m)
    assert leaves == (NumpyMask(arrs[0]),) and M.mask_from_spec(spec, leaves) == m


def test_sinks_minus_inf_and_rows_that_see_nothing_stay_finite():
    """A ``-inf`` sink (no sink for that head) on rows that see no key (bottom-right causal, ``Sq > Skv``):
    out 0, lse -inf and finite gradients (``sink - lse`` and logaddexp's backward are NaN at ``-inf, -inf`` if
    not kept out); everything matches float64 (whose own d_sink of a ``-inf`` sink is NaN: it is 0)."""
    Sq, Skv = 12, 8
    q, k, v = make(1, 2, 1, Sq, Skv, 32, seed=12)
    sinks = torch.tensor([-math.inf, 0.5], requires_grad=True)
    vis = causal_np(Sq, Skv, Skv - Sq)[None]
    out, lse = flash_attention(q, k, v, sinks=sinks, causal=True, causal_alignment="bottom_right", return_lse=True)
    assert (out[0, :, :4] == 0).all() and torch.isneginf(lse[0, 0, :4]).all() and (lse[0, 1, :4] == 0.5).all()
    g = torch.Generator().manual_seed(3)
    do, dl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    grads = torch.autograd.grad((out, lse), (q, k, v, sinks), (do, dl))
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    r_out, r_lse = reference(*leaves64[:3], torch.as_tensor(vis), sinks=leaves64[3])
    fin = torch.isfinite(r_lse)
    r_grads = torch.autograd.grad((r_out, r_lse), leaves64, (do.double(), torch.where(fin, dl.double(), 0.0)))
    torch.testing.assert_close(out.double(), r_out, atol=ATOL, rtol=ATOL)
    assert torch.equal(torch.isneginf(lse), ~fin)
    torch.testing.assert_close(lse[fin].double(), r_lse[fin], atol=ATOL, rtol=ATOL)
    for name, a, r in zip("qkv", grads, r_grads):
        torch.testing.assert_close(a.double(), r, atol=ATOL, rtol=ATOL, msg=lambda m, n=name: f"d{n}: {m}")
    assert grads[3][0] == 0 and abs(float(grads[3][1]) - float(r_grads[3][1])) < ATOL
