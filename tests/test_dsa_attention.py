"""DeepSeek sparse attention (DSA): the lightning indexer, top-k selection and sparse MLA vs float64 references
(the dense DSA definition), dense MLA when top-k covers the context, transformers' ``DeepseekV32Indexer`` and
fla-core's ``naive_dsa_indexer``; NaN-poisoned caches; compile-only at DeepSeek-V3.2 decode shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fla_naive  # tests/ is on sys.path (rootdir-relative import)
from tpukernels.errors import ArgumentError, ConfigError, DTypeError
from tpukernels.library import dsa_attention as dsa
from tpukernels.library import indexer_topk, lightning_indexer, sparse_mla_attention
from tpukernels.library import mla_attention as mla

L, R = 128, 64  # kv_lora_rank, rope dim (DeepSeek: 512, 64)
I32 = dict(dtype=torch.int32)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def make_batch(q_lens, kv_lens, *, S, T, ps, pps, P, Hi=4, D=16, H=4, dtype=torch.float32, k_dtype=None, seed=0,
               poison=True):
    """Metadata, indexer inputs and caches. Each sequence's pages are a random choice of the cache's; with
    ``poison`` unused pages, slots past kv_len and padding rows of the token inputs are NaN (this step's tokens
    are already in the caches, as the ops expect)."""
    g = torch.Generator().manual_seed(seed)
    fill = (lambda *s: torch.full(s, math.nan)) if poison else (lambda *s: torch.randn(*s, generator=g))
    kcache, lcache = fill(P, ps, D), fill(P, ps, L + R)
    page_indices = torch.zeros(S, pps, **I32)
    perm = torch.randperm(P, generator=g)
    c = 0
    for s, kl in enumerate(kv_lens):
        for p in range(-(-kl // ps)):
            page_indices[s, p] = perm[c]
            rows = min(ps, kl - p * ps)
            kcache[perm[c], :rows] = torch.randn(rows, D, generator=g)
            lcache[perm[c], :rows] = torch.randn(rows, L + R, generator=g)
            c += 1
    n = sum(q_lens)
    q_idx, w = torch.randn(T, Hi, D, generator=g), torch.randn(T, Hi, generator=g)
    ql, qpe = torch.randn(T, H, L, generator=g), torch.randn(T, H, R, generator=g)
    if poison:
        for x in (q_idx, w, ql, qpe):
            x[n:] = math.nan
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    cu = np.concatenate([cu, np.full(S + 1 - len(cu), cu[-1])])
    meta = (torch.tensor(list(kv_lens) + [0] * (S - len(kv_lens)), **I32), page_indices, torch.tensor(cu, **I32),
            torch.tensor([len(q_lens)], **I32))
    kd = k_dtype or dtype
    return dict(q_idx=q_idx.to(dtype), weights=w, kcache=kcache.to(kd), ql=ql.to(dtype), qpe=qpe.to(dtype),
                lcache=lcache.to(kd), meta=meta, n=n)


def check_scores(got, ref, tol):
    """Same -inf pattern; finite entries within tol of the float64 reference."""
    assert got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "visibility mask differs"
    fin = torch.isfinite(ref)
    assert torch.isfinite(got[fin]).all()
    if fin.any():
        err = (got.double()[fin] - ref[fin]).abs().max().item()
        assert err <= tol * max(1.0, ref[fin].abs().max().item()), err


def check_out(out, ref, n, tol):
    assert not torch.isnan(out).any()
    err = (out[:n].double() - ref[:n]).abs()
    assert n == 0 or err.max().item() <= tol * max(1.0, ref.abs().max().item()), err.max().item()
    assert (out[n:] == 0).all()  # padding rows


@st.composite
def batches(draw, S=3, T=10, ps=4, pps=5):
    """Ragged batches at one shape: decode rows, chunked prefill, prefill, kv_len 1 / page boundaries,
    num_seqs < S."""
    n = draw(st.integers(1, S))
    q_lens, kv_lens, budget = [], [], T
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "chunk", "prefill", "boundary", "one"]))
        kl = {"one": 1, "boundary": ps * draw(st.integers(1, pps))}.get(kind) or draw(st.integers(1, ps * pps))
        ql = {"decode": 1, "one": 1, "chunk": draw(st.integers(1, kl)), "prefill": kl,
              "boundary": draw(st.sampled_from([1, kl]))}[kind]
        ql = max(0, min(ql, budget))
        budget -= ql
        q_lens.append(ql)
        kv_lens.append(kl)
    return q_lens, kv_lens, draw(st.integers(0, 1000))


# --------------------------------------------------------------------------------------------- indexer


@pytest.mark.parametrize("mode", ["fast", "tpu"])  # "tpu": uninitialized VMEM is NaN too
@settings(max_examples=3)
@given(batch=batches())
def test_indexer_ragged_batches_match_reference(mode, batch):
    q_lens, kv_lens, seed = batch
    b = make_batch(q_lens, kv_lens, S=3, T=10, ps=4, pps=5, P=18, seed=seed)
    got = lightning_indexer(b["q_idx"], b["weights"], b["kcache"], *b["meta"],
                            config={"block_q": 2, "pages_per_block": 2}, interpret=mode)
    ref = dsa.lightning_indexer_reference(b["q_idx"], b["weights"], b["kcache"], *b["meta"])
    check_scores(got, ref, TOL[torch.float32])


@settings(max_examples=2)  # each example compiles its own kernel
@given(ps=st.sampled_from([2, 8, 16]), Hi=st.sampled_from([1, 4, 16]), dtype=st.sampled_from([torch.float32,
       torch.bfloat16]), bq=st.sampled_from([1, 4]), ppb=st.sampled_from([1, 2, 4]), batch=batches(ps=8, pps=3))
def test_indexer_page_sizes_heads_dtypes_configs(ps, Hi, dtype, bq, ppb, batch):
    q_lens, kv_lens, seed = batch
    kv_lens = [min(k, ps * 3) for k in kv_lens]
    q_lens = [min(q, k) for q, k in zip(q_lens, kv_lens)]
    b = make_batch(q_lens, kv_lens, S=3, T=10, ps=ps, pps=3, P=10, Hi=Hi, D=32, dtype=dtype, seed=seed)
    got = lightning_indexer(b["q_idx"], b["weights"], b["kcache"], *b["meta"], sm_scale=0.3,
                            config={"block_q": bq, "pages_per_block": ppb}, interpret="tpu")
    ref = dsa.lightning_indexer_reference(b["q_idx"], b["weights"], b["kcache"], *b["meta"], sm_scale=0.3)
    check_scores(got, ref, TOL[dtype])


@pytest.mark.parametrize("k_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_indexer_fp8_index_keys_with_static_scale(k_dtype):
    b = make_batch([1, 3], [7, 5], S=2, T=6, ps=4, pps=2, P=6, dtype=torch.bfloat16, k_dtype=k_dtype, seed=3)
    got = lightning_indexer(b["q_idx"], b["weights"], b["kcache"], *b["meta"], k_scale=0.5, interpret="tpu")
    ref = dsa.lightning_indexer_reference(b["q_idx"], b["weights"], b["kcache"], *b["meta"], k_scale=0.5)
    check_scores(got, ref, TOL[torch.bfloat16])
    assert torch.isfinite(ref).sum() > 10


def test_indexer_fp8_keys_with_per_token_scales():
    """DeepSeek's fp8_index format: fp8 keys, one float32 scale per cached token (NaN in slots no sequence uses):
    vs the float64 reference that dequantizes each key first."""
    b = make_batch([1, 3], [7, 5], S=2, T=6, ps=4, pps=2, P=6, dtype=torch.bfloat16, k_dtype=torch.float8_e4m3fn,
                   seed=4)
    g = torch.Generator().manual_seed(4)
    sc = torch.rand(6, 4, generator=g) + 0.1
    kl, pi = b["meta"][0], b["meta"][1]
    used = {(int(pi[s, p]), r) for s in range(2) for p in range(2) for r in range(4) if p * 4 + r < int(kl[s])}
    for p in range(6):
        for r in range(4):
            if (p, r) not in used:
                sc[p, r] = math.nan
    got = lightning_indexer(b["q_idx"], b["weights"], b["kcache"], *b["meta"], index_k_scale=sc, interpret="fast")
    ref = dsa.lightning_indexer_reference(b["q_idx"], b["weights"], b["kcache"], *b["meta"], index_k_scale=sc)
    check_scores(got, ref, TOL[torch.bfloat16])
    plain = dsa.lightning_indexer_reference(b["q_idx"], b["weights"], b["kcache"], *b["meta"])
    assert (ref - plain).nan_to_num(0).abs().max() > 0.1  # the scales matter


def test_indexer_definition_by_hand():
    """One sequence, one query at position 2 of 3 cached tokens: sum_h w_h ReLU(D^-0.5 q_h . k_j), by hand."""
    D, ps = 8, 4
    q = torch.zeros(1, 2, D)
    q[0, 0, 0], q[0, 1, 1] = 2.0, -1.0
    k = torch.full((1, ps, D), math.nan)  # slot 3 is past kv_len
    k[0, :3] = 0.0
    k[0, 0, 0], k[0, 1, 1], k[0, 2, 0], k[0, 2, 1] = 1.0, 1.0, -1.0, -3.0
    w = torch.tensor([[0.5, 2.0]])
    meta = (torch.tensor([3], **I32), torch.tensor([[0]], **I32), torch.tensor([0, 1], **I32), torch.tensor([1], **I32))
    got = lightning_indexer(q, w, k, *meta, interpret="tpu")
    s = D ** -0.5
    want = [0.5 * 2 * s, 2.0 * 0.0, 0.5 * 0.0 + 2.0 * 3 * s, -math.inf]  # ReLU(-2s) = 0, ReLU(-s) = 0
    assert torch.allclose(got[0], torch.tensor(want), atol=1e-6), got


# --------------------------------------------------------------------------------------------- top-k


def test_topk_order_ties_and_short_rows():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.5, -math.inf], [-math.inf] * 5, [2.0, 2.0, 2.0, 2.0, 2.0],
                           [0.0, -math.inf, -math.inf, -math.inf, -math.inf]])
    got = indexer_topk(scores, 3)
    assert got.dtype == torch.int32
    assert got.tolist() == [[1, 2, 0], [-1, -1, -1], [0, 1, 2], [0, -1, -1]]  # ties: lowest index first
    assert indexer_topk(scores, 7).tolist()[0] == [1, 2, 0, 3, -1, -1, -1]  # topk > max_kv: padded with -1


# --------------------------------------------------------------------------------------------- sparse MLA


def random_selection(b, K, seed):
    """[T, K] int32: per owned row distinct positions drawn from [-2, kv_len + 2) (so -1, past pos and past kv_len
    all occur), padding rows random."""
    g = torch.Generator().manual_seed(seed)
    kl, pi, cu, ns = b["meta"]
    T = b["ql"].shape[0]
    out = torch.randint(-3, 40, (T, K), generator=g, **I32)
    for s in range(int(ns[0])):
        for t in range(int(cu[s]), int(cu[s + 1])):
            cand = torch.randperm(int(kl[s]) + 4, generator=g)[:K] - 2
            cand = torch.where(cand < 0, -1, cand)
            out[t, : len(cand)] = cand
            out[t, len(cand):] = -1
    return out


@pytest.mark.parametrize("mode", ["fast", "tpu"])
@settings(max_examples=3)
@given(batch=batches(), K=st.sampled_from([5, 16]))
def test_sparse_ragged_batches_match_dense_dsa_reference(mode, batch, K):
    q_lens, kv_lens, seed = batch
    b = make_batch(q_lens, kv_lens, S=3, T=10, ps=4, pps=5, P=18, seed=seed)
    idx = random_selection(b, K, seed)
    out = sparse_mla_attention(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], sm_scale=0.08, interpret=mode)
    ref = dsa.sparse_mla_attention_reference(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], sm_scale=0.08)
    check_out(out, ref, b["n"], TOL[torch.float32])


@settings(max_examples=2)
@given(ps=st.sampled_from([2, 8]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       bk=st.sampled_from([128, 256]), batch=batches(ps=8, pps=3))
def test_sparse_page_sizes_dtypes_block_k(ps, dtype, bk, batch):
    """K = 300 > block_k: several chunks per query (the online softmax across chunks), the last one padded."""
    q_lens, kv_lens, seed = batch
    kv_lens = [min(k, ps * 3) for k in kv_lens]
    q_lens = [min(q, k) for q, k in zip(q_lens, kv_lens)]
    b = make_batch(q_lens, kv_lens, S=3, T=10, ps=ps, pps=3, P=10, dtype=dtype, seed=seed)
    idx = torch.full((10, 300), -1, **I32)
    sel = random_selection(b, 30, seed)
    idx[:, 150:180] = sel  # the selection sits across the first chunk boundary (128)
    out = sparse_mla_attention(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], sm_scale=0.1, config={"block_k": bk},
                               interpret="tpu")
    ref = dsa.sparse_mla_attention_reference(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], sm_scale=0.1)
    check_out(out, ref, b["n"], TOL[dtype])


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
def test_sparse_equals_dense_mla_when_topk_covers_the_context(dtype):
    """indexer -> top-k with k >= max_kv selects every visible token: the op equals dense MLA (the float64
    reference of mla_attention, itself checked against the dense MLA kernel) on a NaN-poisoned ragged batch."""
    q_lens, kv_lens = [1, 4, 2], [7, 4, 10]
    b = make_batch(q_lens, kv_lens, S=4, T=9, ps=4, pps=3, P=14, dtype=dtype, seed=5)
    scores = lightning_indexer(b["q_idx"], b["weights"], b["kcache"], *b["meta"], interpret="fast")
    idx = indexer_topk(scores, 16)
    assert ((idx >= 0).sum(1)[: b["n"]] == torch.tensor([7, 1, 2, 3, 4, 9, 10])).all()  # pos + 1 tokens each
    out = sparse_mla_attention(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], sm_scale=0.1, interpret="tpu")
    # dense MLA sees the same cache when this step's "new" latents are the ones already in it
    T, P, ps = 9, 14, 4
    slots = mla.new_token_slots_torch(*b["meta"], T=T, P=P, ps=ps)
    flat = b["lcache"].reshape(P * ps, L + R)
    new = torch.where((slots >= 0)[:, None], flat[slots.clamp(0)], 0)
    ref, _ = mla.mla_attention_reference(b["ql"], b["qpe"], new[:, :L], new[:, L:], b["lcache"], *b["meta"],
                                         sm_scale=0.1)
    check_out(out, ref, b["n"], TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_sparse_fp8_latent_cache(kv_dtype):
    b = make_batch([1, 3], [7, 5], S=2, T=6, ps=4, pps=2, P=6, dtype=torch.bfloat16, k_dtype=kv_dtype, seed=8)
    idx = random_selection(b, 6, 8)
    kw = dict(sm_scale=0.1, k_scale=1.5, v_scale=0.25)
    out = sparse_mla_attention(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], **kw, interpret="tpu")
    ref = dsa.sparse_mla_attention_reference(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], **kw)
    check_out(out, ref, b["n"], TOL[torch.bfloat16])
    assert ref.abs().max() > 0.05


def test_a_query_never_reads_another_sequences_pages():
    """Positions past the query's own kv_len (which would be other sequences' tokens in a flat cache) are not
    read: poisoning every page but the sequence's own leaves the output unchanged."""
    b = make_batch([1, 1], [5, 9], S=2, T=2, ps=4, pps=3, P=6, seed=2)
    idx = torch.tensor([[0, 4, 5, 8, 11], [8, 0, -1, 12, 3]], **I32)  # row 0: 5, 8, 11 are past its kv_len 5
    out = sparse_mla_attention(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], sm_scale=0.1, interpret="tpu")
    kl, pi = b["meta"][0], b["meta"][1]
    c = b["lcache"].clone()
    own0 = set(pi[0, :2].tolist())
    for p in range(6):
        if p not in own0:
            c[p] = math.nan
    out0 = sparse_mla_attention(b["ql"], b["qpe"], c, idx, *b["meta"], sm_scale=0.1, interpret="tpu")
    assert torch.equal(out0[0], out[0])
    ref = dsa.sparse_mla_attention_reference(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], sm_scale=0.1)
    check_out(out, ref, 2, TOL[torch.float32])


@pytest.mark.slow
@settings(max_examples=20)
@given(ps=st.sampled_from([1, 2, 4, 8, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       bq=st.sampled_from([1, 2, 4, 8]), ppb=st.sampled_from([1, 2, 4, 8]), K=st.sampled_from([1, 7, 40, 200]),
       mode=st.sampled_from(["fast", "tpu"]), batch=batches(S=4, T=16, ps=8, pps=4))
def test_sweep_slow(ps, dtype, bq, ppb, K, mode, batch):
    """Indexer and sparse MLA over page sizes, dtypes, configs and top-k sizes (K > context included)."""
    q_lens, kv_lens, seed = batch
    kv_lens = [min(k, ps * 4) for k in kv_lens]
    q_lens = [min(q, k) for q, k in zip(q_lens, kv_lens)]
    b = make_batch(q_lens, kv_lens, S=4, T=16, ps=ps, pps=4, P=20, dtype=dtype, seed=seed)
    got = lightning_indexer(b["q_idx"], b["weights"], b["kcache"], *b["meta"],
                            config={"block_q": bq, "pages_per_block": ppb}, interpret=mode)
    check_scores(got, dsa.lightning_indexer_reference(b["q_idx"], b["weights"], b["kcache"], *b["meta"]), TOL[dtype])
    idx = indexer_topk(got, K)
    out = sparse_mla_attention(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], sm_scale=0.1, interpret=mode)
    ref = dsa.sparse_mla_attention_reference(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], sm_scale=0.1)
    check_out(out, ref, b["n"], TOL[dtype])


# --------------------------------------------------------------------------------------------- against peers


def test_pipeline_matches_transformers_deepseek_v32_indexer():
    """transformers 5.24's ``DeepseekV32Indexer`` on a tiny random config (one prefill sequence, bool causal
    mask): its top-k indices == ours (kernel scores -> indexer_topk) for every visible slot; its q / k / weights
    are computed from the module's own projections and RoPE (the caller's side of our op)."""
    mod = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config

    torch.manual_seed(0)
    cfg = DeepseekV32Config(hidden_size=64, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                            v_head_dim=16, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                            index_topk=6, index_head_dim=32, index_n_heads=8, num_hidden_layers=1,
                            intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                            num_experts_per_tok=2, vocab_size=32)
    idxr = mod.DeepseekV32Indexer(cfg, 0).eval()
    rope = mod.DeepseekV32RotaryEmbedding(cfg)
    S = 13
    h, qr = torch.randn(1, S, 64), torch.randn(1, S, 32)
    pos_ids = torch.arange(S)[None]
    cos, sin = rope(h, pos_ids)
    mask = torch.tril(torch.ones(S, S, dtype=torch.bool))[None]
    theirs = idxr(h, qr, (cos, sin), mask, pos_ids, None)[0]  # [S, 6]
    with torch.no_grad():  # the caller's side: projections + half-split RoPE, as the module does
        q = idxr.wq_b(qr).view(1, S, 8, 32)
        k = idxr.k_norm(idxr.wk(h)).unsqueeze(2)
        q_rot, k_rot = mod.apply_rotary_pos_emb(q[..., :16], k[..., :16], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., 16:]], -1)[0]
        k = torch.cat([k_rot, k[..., 16:]], -1)[0, :, 0]
        w = idxr.weights_proj(h)[0].float() * 8 ** -0.5
    ps, pps = 4, 4
    kc = torch.full((6, ps, 32), math.nan)
    pages = [5, 1, 3, 0]
    for p in range(pps):
        kc[pages[p], : min(ps, S - p * ps)] = k[p * ps:(p + 1) * ps]
    meta = (torch.tensor([S], **I32), torch.tensor([pages], **I32), torch.tensor([0, S], **I32),
            torch.tensor([1], **I32))
    ours = indexer_topk(lightning_indexer(q.contiguous(), w.contiguous(), kc, *meta, interpret="fast"), 6)
    for t in range(S):
        n = min(t + 1, 6)
        assert sorted(ours[t, :n].tolist()) == sorted(theirs[t, :n].tolist()), t
        assert (ours[t, n:] == -1).all()


def test_pipeline_matches_fla_naive_dsa():
    """fla-core 0.6.0's ``naive_dsa_indexer`` (relu, varlen prefill) selects the same positions as our indexer +
    top-k, and its ``naive_dsa`` (MQA over the selected keys) equals our sparse MLA when the key of head ``h`` is
    the latent row and the value its first L lanes (f32)."""
    m = fla_naive.load("dsa")
    g = torch.Generator().manual_seed(1)
    q_lens = [5, 9]
    T, Hi, D, H, K, ps = 14, 4, 16, 2, 4, 4
    b = make_batch(q_lens, q_lens, S=2, T=T, ps=ps, pps=3, P=8, Hi=Hi, D=D, H=H, seed=11, poison=False)
    kl, pi, cu, ns = b["meta"]
    scores = lightning_indexer(b["q_idx"], b["weights"], b["kcache"], *b["meta"], interpret="fast")
    ours = indexer_topk(scores, K)
    rows = lambda c, s: c[pi[s, : -(-q_lens[s] // ps)].long()].reshape(-1, c.shape[-1])[: q_lens[s]]
    k_idx = torch.cat([rows(b["kcache"], s) for s in range(2)])
    cu64 = cu.long()
    theirs = m.naive_dsa_indexer(b["q_idx"][None], k_idx[None], b["weights"][None], topk=K, activation="relu",
                                 cu_seqlens=cu64)[0]
    for t in range(T):
        assert sorted(ours[t].tolist()) == sorted(theirs[t].tolist()), t
    lat = torch.cat([rows(b["lcache"], s) for s in range(2)])  # [T, L + R]
    q = torch.cat([b["ql"], b["qpe"]], -1)  # [T, H, L + R]
    o_theirs = m.naive_dsa(q[None], lat[None, :, None], lat[None, :, None, :L], b["q_idx"][None], k_idx[None],
                           indices=theirs[None], scale=0.1, cu_seqlens=cu64)[0]
    out = sparse_mla_attention(b["ql"], b["qpe"], b["lcache"], ours, *b["meta"], sm_scale=0.1, interpret="fast")
    assert (out - o_theirs.float()).abs().max() <= 1e-4 * o_theirs.abs().max()


# --------------------------------------------------------------------------------------------- validation


def _good():
    return make_batch([1, 3], [4, 6], S=2, T=6, ps=4, pps=2, P=6, poison=False)


def _run_indexer(b, **kw):
    return lightning_indexer(b["q_idx"], b["weights"], b["kcache"], *b["meta"], **kw)


def _run_sparse(b, idx=None, **kw):
    idx = torch.zeros(6, 3, **I32) if idx is None else idx
    return sparse_mla_attention(b["ql"], b["qpe"], b["lcache"], idx, *b["meta"], **kw)


@pytest.mark.parametrize("mutate, err, words", [
    (lambda b: b.__setitem__("weights", b["weights"][:, :3]), ArgumentError, "weights must have shape"),
    (lambda b: b.__setitem__("kcache", b["kcache"][..., :8]), ArgumentError, "index_k_cache last dim 8"),
    (lambda b: b.__setitem__("q_idx", b["q_idx"][..., :12]), ArgumentError, "D a positive multiple of 8"),
    (lambda b: b.__setitem__("q_idx", b["q_idx"].half()), DTypeError, "q_idx dtype float16"),
    (lambda b: b.__setitem__("weights", b["weights"].double()), DTypeError, "weights dtype float64"),
    (lambda b: b.__setitem__("kcache", b["kcache"].to(torch.int8)), DTypeError, "index_k_cache dtype int8"),
    (lambda b: b.__setitem__("meta", (torch.tensor([9, 6], **I32),) + b["meta"][1:]), ArgumentError,
     "kv_lens[0] = 9"),
    (lambda b: b.__setitem__("meta", (b["meta"][0].long(),) + b["meta"][1:]), DTypeError, "kv_lens must be int32"),
    (lambda b: b.__setitem__("q_idx", b["q_idx"][0]), ArgumentError, "q_idx must have rank 3"),
])
def test_indexer_bad_input_raises_before_running(mutate, err, words):
    b = _good()
    mutate(b)
    with pytest.raises(err) as e:
        _run_indexer(b)
    assert words in str(e.value), str(e.value)


def test_bad_statics_config_and_topk():
    b = _good()
    with pytest.raises(ArgumentError, match="sm_scale"):
        _run_indexer(b, sm_scale=-1.0)
    with pytest.raises(ArgumentError, match="k_scale"):
        _run_indexer(b, k_scale=math.nan)
    with pytest.raises(ConfigError, match="block_qq"):
        _run_indexer(b, config={"block_qq": 2})
    with pytest.raises(ArgumentError, match="index_k_scale must have shape"):
        _run_indexer(b, index_k_scale=torch.ones(6, 3))
    with pytest.raises(DTypeError, match="index_k_scale must be float32"):
        _run_indexer(b, index_k_scale=torch.ones(6, 4, dtype=torch.float16))
    with pytest.raises(ArgumentError, match="topk must be a positive int"):
        indexer_topk(torch.zeros(2, 3), 0)
    with pytest.raises(DTypeError, match="scores must be float32"):
        indexer_topk(torch.zeros(2, 3, dtype=torch.float64), 2)
    with pytest.raises(ArgumentError, match="topk_indices must have shape"):
        _run_sparse(b, torch.zeros(5, 3, **I32))
    with pytest.raises(DTypeError, match="topk_indices must be int32"):
        _run_sparse(b, torch.zeros(6, 3, dtype=torch.int64))
    with pytest.raises(ArgumentError, match="cache_kv last dim"):
        sparse_mla_attention(b["ql"], b["qpe"], b["lcache"][..., :-1], torch.zeros(6, 3, **I32), *b["meta"])
    with pytest.raises(ArgumentError, match="sm_scale"):
        _run_sparse(b, sm_scale=math.inf)
    with pytest.raises(ConfigError, match="block_kk"):
        _run_sparse(b, config={"block_kk": 128})
    with pytest.raises(ArgumentError, match="bool"):
        sparse_mla_attention(b["ql"], b["qpe"], b["lcache"], torch.zeros(6, 3, **I32), *b["meta"][:3], True)


def test_num_seqs_int_and_empty_batch():
    b = _good()
    kl, pi, cu, ns = b["meta"]
    a = lightning_indexer(b["q_idx"], b["weights"], b["kcache"], kl, pi, cu, 2, interpret="fast")
    assert torch.equal(a, _run_indexer(b, interpret="fast"))
    e = lightning_indexer(b["q_idx"][:0], b["weights"][:0], b["kcache"], kl * 0, pi, cu * 0, 0)
    assert e.shape == (0, 8)
    o = sparse_mla_attention(b["ql"][:0], b["qpe"][:0], b["lcache"], torch.zeros(0, 3, **I32), kl * 0, pi, cu * 0, 0)
    assert o.shape == (0, 4, L)


def test_sharding_rules():
    from tpukernels.distributed.sharding import _MESH_SHAPE, LIBRARY_RULES, Split, TensorMeta

    rule = LIBRARY_RULES["sparse_mla_attention_kernel"]
    args = {"ql_nope": TensorMeta((8, 128, 512), torch.bfloat16), "q_pe": TensorMeta((8, 128, 64), torch.bfloat16),
            "kv_sel": TensorMeta((8, 2048, 576), torch.bfloat16), "sel": TensorMeta((8, 1, 2048), torch.int32)}
    for mesh, want in (((4,), [Split({"ql_nope": 0, "q_pe": 0, "kv_sel": 0, "sel": 0}, (0,))]),
                       ((16,), [Split({"ql_nope": 1, "q_pe": 1}, (1,))]), ((3,), [])):
        token = _MESH_SHAPE.set(mesh)
        try:
            assert rule(args) == want, mesh
        finally:
            _MESH_SHAPE.reset(token)
    assert LIBRARY_RULES["lightning_indexer_kernel"]({}) == []


# --------------------------------------------------------------------------------------------- compile-only

CHIPS = ("v5e", "v6e", "tpu7x")


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
def test_compile_only_deepseek_v32_decode_shapes(chip):
    """DeepSeek-V3.2 decode, 64 sequences x 8192 cached tokens, page 64: the indexer (64 heads of 128, bf16
    keys) and sparse MLA (128 heads, 512 + 64, top-2048)."""
    import tpukernels as tk

    for kern, args, kw in dsa.STANDARD_CASES:
        r = tk.compile_for(kern, chip, *args, with_mlir=False, **kw)
        assert r.ok, (chip, args, r.error)


@pytest.mark.aot
@pytest.mark.parametrize("chip, dtype", [("v5e", "f32"), ("v6e", "float8_e4m3fn"), ("tpu7x", "float8_e5m2")])
def test_compile_only_prefill_blocks_and_fp8(chip, dtype):
    """The indexer with 4-token blocks (256 rows) over a mixed batch, fp8 / f32 index keys; sparse MLA with an
    fp8 latent cache and block_k 256."""
    import tpukernels as tk

    q = "f32" if dtype == "f32" else "bf16"
    args = ("16:i32", "16x64:i32", "17:i32", "1:i32", f"256x64x128:{q}", "256x1x64:f32", f"1024x64x128:{dtype}")
    r = tk.compile_for(dsa.indexer_kernel, chip, *args, config={"block_q": 4, "pages_per_block": 8},
                       with_mlir=False, sm_scale=0.088, k_scale=None if dtype == "f32" else 2.0)
    assert r.ok, r.error
    args = (f"8x128x512:{q}", f"8x128x64:{q}", f"8x2048x576:{dtype}", "8x1x2048:i32")
    r = tk.compile_for(dsa.sparse_kernel, chip, *args, config={"block_k": 256}, with_mlir=False, sm_scale=0.07,
                       k_scale=None if dtype == "f32" else 1.5, v_scale=None)
    assert r.ok, r.error
