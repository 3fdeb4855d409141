"""tpukernels as an sglang-jax attention backend, vs sglang-jax's OWN reference semantics.

sglang-jax (Python >= 3.12) cannot be installed here (Python 3.11), so its reference is ported:
``ref_ragged_paged_attention`` of ``python/sgl_jax/srt/kernels/ragged_paged_attention/ragged_paged_attention_v3.py``
and the cache row layout of ``merge_kv`` in ``python/sgl_jax/srt/mem_cache/memory_pool.py``, sglang-jax commit
cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176 (2026-08-21), re-expressed in numpy (float64 from the low-precision
inputs; their reference computes the logits in float32, otherwise the same steps: per-sequence gather of the
pages, GQA by repeating kv heads, ``sm_scale``, causal + sliding-window mask ``q_span - W >= kv_span``, soft
cap before the additive ``mask_value``, the sink logit prepended to the softmax and dropped). The inputs are
built as their ``python/sgl_jax/test/flashattention_common.py`` builds them: per-sequence page-aligned
``cache_loc``; the reference's page table comes from ``cache_loc`` per sequence (their test's way), the
backend's metadata from the flat ``page_indices`` + ``cu_kv_lens`` (their ``get_forward_metadata``'s way), so
the two paths are independent.

Stubbed (their classes cannot be imported here): ``RadixAttention`` (a namespace with the attributes the
backend reads), ``ModelWorkerBatch`` / ``ForwardBatch`` (the fields read), the KV pool (``get_fused_kv_buffer``),
``ForwardMode`` (its two members used); for ``install()`` only, the ``sgl_jax...flashattention_backend`` module
path and a base ``FlashAttention`` with their constructor. The 2-device tensor-parallel test is ``slow``.
"""

from __future__ import annotations

import enum
import functools
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp

from tpukernels.errors import ArgumentError, BackendUnavailableError, DTypeError
from tpukernels.integrations import sglang_jax as sg

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class ForwardMode(enum.IntEnum):  # their enum's two members used here
    EXTEND = 1
    DECODE = 2


# ------------------------------------------------------------------------------------- their semantics, ported


def ref_ragged_paged_attention(queries, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               causal=True, sm_scale=1.0, sliding_window=None, soft_cap=None,
                               mask_value=DEFAULT_MASK_VALUE, k_scale=None, v_scale=None, attention_sink=None):
    """Port of their ``ref_ragged_paged_attention`` (see module doc); float64; returns ``[cu_q_lens[n], Hq, D]``."""
    f = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)  # noqa: E731
    queries, k_pages, v_pages = f(queries), f(k_pages), f(v_pages)
    _, _, Hkv, D = k_pages.shape
    Hq = queries.shape[1]
    r = Hq // Hkv
    outs = []
    for i in range(int(num_seqs[0])):
        q0, q1, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        q_len = q1 - q0
        k = k_pages[page_indices[i]].reshape(-1, Hkv, D)[:kv_len]
        v = v_pages[page_indices[i]].reshape(-1, Hkv, D)[:kv_len]
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        k, v = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
        attn = np.einsum("qhd,khd->hqk", queries[q0:q1], k) * sm_scale
        q_span = (kv_len - q_len) + np.arange(q_len)[None, :, None]
        kv_span = np.arange(kv_len)[None, None, :]
        mask = q_span < kv_span if causal else np.zeros(attn.shape, bool)
        if sliding_window is not None:
            mask = mask | (q_span - sliding_window >= kv_span)
        if soft_cap is not None:
            attn = soft_cap * np.tanh(attn / soft_cap)
        attn = attn + np.where(mask, mask_value, 0.0)
        if attention_sink is not None:
            sink = np.broadcast_to(np.asarray(attention_sink, np.float64), (Hq,))
            attn = np.concatenate([np.broadcast_to(sink[:, None, None], (Hq, q_len, 1)), attn], -1)
        attn = np.exp(attn - attn.max(-1, keepdims=True))
        attn = attn / attn.sum(-1, keepdims=True)
        if attention_sink is not None:
            attn = attn[..., 1:]
        outs.append(np.einsum("hqk,khd->qhd", attn, v))
    return np.concatenate(outs, 0)


def merge_kv(k, v):
    """Port of their ``memory_pool.merge_kv`` rows: ``[T, 2*Hkv'/packing, packing, align(D, 128)]``, K of head h
    at combined head 2h, V at 2h + 1, zero padding."""
    T, Hkv, D = k.shape
    p = max(1, 4 // np.dtype(k.dtype).itemsize)
    h2 = -(-2 * Hkv // p) * p
    kv = jnp.stack([k, v], axis=2).reshape(T, 2 * Hkv, D)
    kv = jnp.pad(kv, ((0, 0), (0, h2 - 2 * Hkv), (0, -(-D // 128) * 128 - D)))
    return kv.reshape(T, h2 // p, p, -(-D // 128) * 128)


# ------------------------------------------------------------------------------------- batches


def make_batch(mode, lens, *, Hq, Hkv, D, ps, P, dtype=jnp.float32, T=None, pad_seqs=1, loc_pad=24, seed=0,
               data=True):
    """Their test's construction with a random page allocation: ``lens = [(q_len, kv_len)]``; the fused cache
    holds each sequence's first ``kv_len - q_len`` tokens (their ``merge_kv`` rows), the rest of it NaN (unused
    pages, slots past kv_len); ``keys`` / ``values`` are the new tokens; padding tokens are NaN; ``pad_seqs``
    sequences with seq_len 0 at the end and ``loc_pad`` zero entries after ``cache_loc`` (their bucket padding).
    ``data=False``: metadata only (q, keys, values, cache stay NaN)."""
    rng = np.random.default_rng(seed)
    n = len(lens)
    q_lens = [ql for ql, _ in lens]
    kv_lens = [kl for _, kl in lens]
    T = T or sum(q_lens) + 3
    Dp = -(-D // 128) * 128
    shape = sg.get_kv_cache_shape(P, ps, Hkv, D, dtype)
    cache = np.full(shape, np.nan, np.float32)
    k_pages = np.full((P, ps, Hkv, D), np.nan, np.float32)  # the reference's view: every token's K/V
    v_pages = np.full((P, ps, Hkv, D), np.nan, np.float32)
    perm = rng.permutation(P)
    cache_loc, out_loc, used = [], [], 0
    q = np.full((T, Hq, D), np.nan, np.float32)
    k_new = np.full((T, Hkv, D), np.nan, np.float32)
    v_new = np.full((T, Hkv, D), np.nan, np.float32)
    t = 0
    for ql, kl in lens:
        npg = -(-kl // ps)
        pages = perm[used: used + npg]
        used += npg
        locs = (pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1)  # page-contiguous, as their allocator
        cache_loc += list(locs)
        out_loc += list(locs[kl - ql:kl])
        if not data:
            continue
        k = np.asarray(jnp.asarray(rng.standard_normal((kl, Hkv, D)), dtype).astype(jnp.float32))
        v = np.asarray(jnp.asarray(rng.standard_normal((kl, Hkv, D)), dtype).astype(jnp.float32))
        k_pages.reshape(-1, Hkv, D)[locs[:kl]] = k
        v_pages.reshape(-1, Hkv, D)[locs[:kl]] = v
        old = kl - ql
        if old:
            rows = np.asarray(merge_kv(jnp.asarray(k[:old], dtype), jnp.asarray(v[:old], dtype)).astype(jnp.float32))
            cache.reshape(P * ps, *shape[2:])[locs[:old]] = rows
        k_new[t: t + ql], v_new[t: t + ql] = k[old:], v[old:]
        q[t: t + ql] = rng.standard_normal((ql, Hq, D))
        t += ql
    cache_loc = np.asarray(cache_loc + [0] * loc_pad, np.int32)
    seq_lens = np.asarray(kv_lens + [0] * pad_seqs, np.int32)
    batch = types.SimpleNamespace(
        forward_mode=ForwardMode[mode], seq_lens=seq_lens, cache_loc=cache_loc,
        extend_seq_lens=np.asarray(q_lens + [0] * pad_seqs, np.int32) if mode == "EXTEND" else None,
        extend_prefix_lens=np.asarray([kl - ql for ql, kl in lens] + [0] * pad_seqs, np.int32),
        out_cache_loc=np.asarray(out_loc, np.int32), dp_size=1, per_dp_bs_size=n + pad_seqs)
    # the reference's page table, their test's way: cache_loc[start:start+seq_len] // page_size, per sequence
    aligned = (seq_lens + ps - 1) // ps * ps
    starts = np.concatenate([[0], np.cumsum(aligned)])
    width = max(-(-kl // ps) for kl in kv_lens)
    table = np.zeros((n, width), np.int32)
    for s in range(n):
        pg = list(dict.fromkeys((cache_loc[starts[s]: starts[s] + seq_lens[s]] // ps).tolist()))
        table[s, : len(pg)] = pg
    ref_in = dict(k_pages=k_pages, v_pages=v_pages, kv_lens=seq_lens[:n], page_indices=table,
                  cu_q_lens=np.concatenate([[0], np.cumsum(q_lens)]), num_seqs=[n])
    return (jnp.asarray(q, dtype), jnp.asarray(k_new, dtype), jnp.asarray(v_new, dtype), jnp.asarray(cache, dtype),
            batch, ref_in, sum(q_lens))


def expected_cache(cache, k_new, v_new, out_loc):
    """The cache after their write path (``set_kv_buffer`` of ``merge_kv`` rows at ``out_cache_loc``)."""
    c = np.asarray(cache.astype(jnp.float32)).copy()
    n = len(out_loc)
    rows = np.asarray(merge_kv(k_new[:n], v_new[:n]).astype(jnp.float32))
    c.reshape(-1, *c.shape[2:])[out_loc] = rows
    return c


def _same(a, b) -> bool:
    a, b = np.asarray(jnp.asarray(a).astype(jnp.float32)), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(np.isnan(a), np.isnan(b))) and bool(
        np.array_equal(np.nan_to_num(a), np.nan_to_num(b)))


def _close(out, ref, n_tok, tol):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)[:n_tok]
    assert out.shape[0] == ref.shape[0] and not np.isnan(out).any()
    err = np.abs(out.reshape(ref.shape) - ref).max()
    assert err <= tol * max(1.0, np.abs(ref).max()), err


class Pool:
    """Stub of their KV pool: the fused buffer of each layer."""

    def __init__(self, cache):
        self.kv_buffer = [cache]

    def get_fused_kv_buffer(self, layer_id):
        return self.kv_buffer[layer_id]


def layer(D, *, scaling=None, sliding_window_size=0, logit_cap=0):
    """Stub of their ``RadixAttention`` (the attributes a backend reads; 0 means off, as theirs)."""
    return types.SimpleNamespace(layer_id=0, head_dim=D, scaling=scaling,
                                 sliding_window_size=sliding_window_size or None,
                                 logit_cap=logit_cap or None, xai_temperature_len=-1, softmax_dtype=None,
                                 attn_type=types.SimpleNamespace(value="decoder"))


CFG = {"block_q": 8, "pages_per_block": 2}
SHAPE = dict(Hq=4, Hkv=2, D=128, ps=8, P=40)
BATCHES = {  # (mode, [(q_len, kv_len)]): decode-only; mixed = an EXTEND batch with decode rows, chunked prefill
    "decode": ("DECODE", [(1, 37), (1, 5), (1, 64), (1, 17)]),
    "mixed": ("EXTEND", [(1, 23), (1, 40), (6, 30), (9, 9), (12, 12)]),
}


@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_backend_matches_their_reference(name):
    """The backend's ``__call__`` on a ForwardBatch (their metadata, their fused cache, GQA 4/2, sliding window +
    soft cap + per-head sinks, NaN in unused pages and padding) vs their reference; the cache after the step
    equals their write path's bit for bit (NaN pages untouched)."""
    mode, lens = BATCHES[name]
    q, k, v, cache, batch, ref_in, n_tok = make_batch(mode, lens, **SHAPE, T=32, pad_seqs=6 - len(lens), seed=len(name))
    sinks = jnp.asarray(np.random.default_rng(3).standard_normal(4) * 2, jnp.float32)
    be = sg.TpuKernelsFlashAttention(4, 2, 128, page_size=8, config=CFG, interpret="tpu")
    be.forward_metadata = be.get_forward_metadata(batch)
    lay = layer(128, scaling=0.1, sliding_window_size=13, logit_cap=5.0)
    fb = types.SimpleNamespace(forward_mode=batch.forward_mode, spec_info=None)
    out, new_cache = be(q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1), lay, fb,
                        Pool(cache), attention_sink=sinks)
    assert out.shape == (q.shape[0], 4 * 128)
    ref = ref_ragged_paged_attention(q, **ref_in, sm_scale=0.1, sliding_window=13, soft_cap=5.0,
                                     attention_sink=np.asarray(sinks))
    _close(out, ref.reshape(n_tok, -1), n_tok, 2e-5)
    assert _same(new_cache, expected_cache(cache, k, v, batch.out_cache_loc))


def test_under_jit_with_traced_metadata():
    """One step under ``jax.jit`` with the metadata traced and the cache donated (as their model step runs): the
    static page-table width comes from ``max_context_len``."""
    q, k, v, cache, batch, ref_in, n_tok = make_batch("EXTEND", BATCHES["mixed"][1], **SHAPE, T=32, seed=9)
    be = sg.TpuKernelsFlashAttention(4, 2, 128, page_size=8, max_context_len=64, config=CFG, interpret="tpu")
    assert be.pages_per_seq == 8
    md = be.get_forward_metadata(batch)
    sinks = jnp.asarray(np.random.default_rng(4).standard_normal(4), jnp.float32)
    lay = layer(128, scaling=0.1, sliding_window_size=13, logit_cap=5.0)

    @functools.partial(jax.jit, donate_argnums=3)
    def step(q, k, v, cache, md, sinks):
        be.forward_metadata = md
        return be(q, k, v, lay, types.SimpleNamespace(forward_mode=batch.forward_mode), Pool(cache),
                  attention_sink=sinks)

    want_cache = expected_cache(cache, k, v, batch.out_cache_loc)
    out, new_cache = step(q, k, v, cache, md, sinks)
    ref = ref_ragged_paged_attention(q, **ref_in, sm_scale=0.1, sliding_window=13, soft_cap=5.0,
                                     attention_sink=np.asarray(sinks))
    _close(out, ref.reshape(n_tok, -1), n_tok, 2e-5)
    assert _same(new_cache, want_cache)


def test_head_dim_96_fp8_cache_scalar_sink():
    """D = 96 (their cache pads lanes to 128 with zeros; q is padded likewise) with an fp8 (e4m3) cache, bf16
    queries, static k_scale / v_scale and a scalar attention sink (their reference broadcasts it); through the
    kernel-level entry (their ``ragged_paged_attention`` signature)."""
    lens = [(1, 20), (5, 14), (3, 3)]
    q, k, v, cache, batch, ref_in, n_tok = make_batch("EXTEND", lens, Hq=4, Hkv=2, D=96, ps=8, P=16,
                                                      dtype=jnp.float8_e4m3fn, seed=5)
    q = q.astype(jnp.bfloat16)
    md = sg.get_forward_metadata(batch, 8)
    args = (q, k, v, cache, md.seq_lens, md.page_indices, md.cu_q_lens, md.cu_kv_lens, md.distribution)
    kw = dict(sm_scale=96 ** -0.5, k_scale=0.5, v_scale=2.0)
    out, new_cache = sg.ragged_paged_attention(*args, None, jnp.float32(0.7), **kw, config=CFG)
    assert out.shape == (q.shape[0], 4, 96) and out.dtype == jnp.bfloat16
    ref = ref_ragged_paged_attention(q, **ref_in, **kw, attention_sink=0.7)
    _close(out, ref, n_tok, 3e-2)  # K/V widened to bf16 in VMEM, bf16 probabilities and output
    assert _same(new_cache, expected_cache(cache, k, v, batch.out_cache_loc))
    lanes = np.asarray(new_cache.astype(jnp.float32)).reshape(-1, 128)[:, 96:]
    assert np.all((lanes == 0) | np.isnan(lanes))  # written rows keep zero pad lanes


def test_cache_view_is_a_bit_exact_reshape():
    """Their 5-D fused cache seen as ours is a reshape (same bytes in order), and their merge_kv rows land at
    combined heads 2h (K) / 2h + 1 (V); fp8 with one kv head has padding heads (packing 4)."""
    cases = ((128, jnp.bfloat16, 2), (96, jnp.float32, 3), (64, jnp.bfloat16, 1), (128, jnp.float8_e4m3fn, 1))
    for D, dt, hkv in cases:
        shape = sg.get_kv_cache_shape(5, 16, hkv, D, dt)
        c = jnp.asarray(np.random.default_rng(0).integers(-100, 100, shape), dt)
        view, hpad = sg.kv_cache_view(c, hkv, D)
        assert view.shape == (5, 16, 2 * hpad, -(-D // 128) * 128)
        flat = lambda a: np.asarray(a.astype(jnp.float32)).reshape(-1)  # noqa: E731
        assert np.array_equal(flat(view), flat(c))
        k = jnp.asarray(np.random.default_rng(1).integers(-9, 9, (1, hkv, D)), dt)
        v = jnp.asarray(np.random.default_rng(2).integers(-9, 9, (1, hkv, D)), dt)
        row = np.asarray(merge_kv(k, v).astype(jnp.float32)).reshape(view.shape[2:])
        for h in range(hkv):
            assert np.array_equal(row[2 * h, :D], np.asarray(k.astype(jnp.float32))[0, h])
            assert np.array_equal(row[2 * h + 1, :D], np.asarray(v.astype(jnp.float32))[0, h])


def test_kv_write_is_in_place_when_donated():
    """XLA's memory analysis of a jitted, cache-donated write: the output aliases the cache, no cache-sized
    temporary (the check can fail: an XLA scatter of the same rows copies the cache on this backend)."""
    P, ps, Hkv, D, T = 256, 16, 2, 128, 8
    cache = jnp.zeros(sg.get_kv_cache_shape(P, ps, Hkv, D, jnp.bfloat16), jnp.bfloat16)
    k = jnp.ones((T, Hkv, D), jnp.bfloat16)
    meta = (jnp.asarray([3, 5, 0], jnp.int32), jnp.arange(24, dtype=jnp.int32), jnp.asarray([0, 3, 8, 8], jnp.int32),
            jnp.asarray([0, 16, 32, 32], jnp.int32), jnp.asarray([0, 2, 2], jnp.int32))

    def write(c, k, v, kl, pi, cu, ckv, dist):
        kl, table, cu, ns = sg.metadata_view(kl, pi, cu, ckv, dist, page_size=ps, pages_per_seq=4)
        return sg.write_kv(c, k, v, kl, table, cu, ns)

    m = jax.jit(write, donate_argnums=0).lower(cache, k, k, *meta).compile().memory_analysis()
    assert m.alias_size_in_bytes == cache.nbytes
    assert m.temp_size_in_bytes < cache.nbytes // 16, m.temp_size_in_bytes
    rows = jnp.ones((T,) + cache.shape[2:], jnp.bfloat16)
    scatter = jax.jit(lambda c, r, pg: c.at[pg, 0].set(r, mode="drop"), donate_argnums=0)
    assert scatter.lower(cache, rows, meta[1][:T]).compile().memory_analysis().temp_size_in_bytes >= cache.nbytes


def test_bad_input_is_a_typed_error():
    q, k, v, cache, batch, _, _ = make_batch("EXTEND", [(1, 4), (3, 6)], Hq=4, Hkv=2, D=128, ps=4, P=6, pad_seqs=0,
                                             loc_pad=0)
    md = sg.get_forward_metadata(batch, 4)
    args = [q, k, v, cache, md.seq_lens, md.page_indices, md.cu_q_lens, md.cu_kv_lens, md.distribution]
    call = lambda *a, **kw: sg.ragged_paged_attention(*a, **kw, config=CFG)  # noqa: E731
    with pytest.raises(ArgumentError, match="sglang-jax's layout"):
        call(*args[:3], cache[:, :, :, :, :64], *args[4:])  # a cache of another model config
    bad = list(args)
    bad[5] = bad[5].at[2].set(99)  # sequence 1's second page (its pages start at flat index 1)
    with pytest.raises(ArgumentError, match=r"page_indices\[2\] = 99 \(page 1 of sequence 1\)"):
        call(*bad)
    bad = list(args)
    bad[4] = jnp.asarray([9, 6], jnp.int32)  # kv_len beyond the slots cu_kv_lens leaves (the next sequence's)
    with pytest.raises(ArgumentError, match="overlap the next sequence"):
        call(*bad)
    with pytest.raises(DTypeError, match="keys / values dtype"):
        call(args[0], args[1].astype(jnp.bfloat16), *args[2:])
    with pytest.raises(DTypeError, match="must be int32"):
        call(*args[:4], args[4].astype(jnp.int16), *args[5:])
    with pytest.raises(DTypeError, match="must be floating"):
        call(*args[:3], args[3].astype(jnp.int8), *args[4:])
    with pytest.raises(DTypeError, match="attention_sink must be float32"):
        call(*args, None, jnp.zeros(4, jnp.float16))
    with pytest.raises(ArgumentError, match="attention_sink must be a scalar or have shape"):
        call(*args, None, jnp.zeros(3, jnp.float32))
    with pytest.raises(ArgumentError, match="custom_mask"):
        call(*args, jnp.ones(30, jnp.int32), causal=0)
    with pytest.raises(ArgumentError, match="xai_temperature_len"):
        call(*args, xai_temperature_len=64.0)
    with pytest.raises(ArgumentError, match="softmax_dtype"):
        call(*args, softmax_dtype=jnp.bfloat16)
    with pytest.raises(ArgumentError, match="pages_per_seq = 1"):
        call(*args, pages_per_seq=1)
    with pytest.raises(BackendUnavailableError, match="Python >= 3.12"):
        sg.install()


@functools.partial(jax.jit, static_argnums=0)
def _mapped(ps, kl, pi, cu, ckv, dist):
    """Traced metadata: the page table is as wide as the flat list (always enough)."""
    kl, table, cu, ns = sg.metadata_view(kl, pi, cu, ckv, dist, page_size=ps)
    return table, ns, sg._slot_mapping(kl, table, cu, ns, 48, ps, 400)


@settings(max_examples=12)
@given(st.sampled_from([1, 4, 16]), st.lists(st.tuples(st.integers(1, 9), st.integers(0, 40)), min_size=1,
                                             max_size=5), st.booleans())
def test_metadata_and_write_slots_match_their_cache_loc(ps, raw, decode):
    """For random ragged batches and page sizes: the page table built from their flat page_indices + cu_kv_lens
    holds each sequence's own pages (as their test derives from cache_loc), and the slots the new tokens are
    written to are their out_cache_loc."""
    lens = [(1 if decode else min(ql, kl + ql), kl + (1 if decode else min(ql, kl + ql))) for ql, kl in raw]
    # fixed padded sizes (S = 6 sequences, 352 cache_loc entries, T = 48, P = 400 pages): one compile per page size
    used = sum(-(-kl // ps) * ps for _, kl in lens)
    _, _, _, _, batch, ref_in, n_tok = make_batch("DECODE" if decode else "EXTEND", lens, Hq=2, Hkv=1, D=128, ps=ps,
                                                  P=400, pad_seqs=6 - len(lens), loc_pad=352 - used, T=48, data=False)
    md = sg.get_forward_metadata(batch, ps)
    table, ns, slots = _mapped(ps, md.seq_lens, md.page_indices, md.cu_q_lens, md.cu_kv_lens, md.distribution)
    assert int(ns[0]) == len(lens) and table.shape[1] == md.page_indices.shape[0]
    for s, row in enumerate(ref_in["page_indices"]):
        npg = -(-int(ref_in["kv_lens"][s]) // ps)
        assert np.array_equal(np.asarray(table[s, :npg]), row[:npg])
    slots = np.asarray(slots)
    assert np.array_equal(slots[:n_tok], batch.out_cache_loc) and np.all(slots[n_tok:] == -1)


class _StubFlashAttention:
    """Stand-in for their ``FlashAttention`` (not importable here): their constructor and attributes, their
    ``__call__`` raising (it must be overridden), ``get_forward_metadata`` = our port of theirs."""

    def __init__(self, num_attn_heads, num_kv_heads, head_dim, page_size=1, kv_partition_axis="tensor",
                 attention_data_partition_axis="data", mesh=None):
        self.num_heads, self.num_kv_heads, self.head_dim, self.page_size = num_attn_heads, num_kv_heads, head_dim, \
            page_size
        self.kv_partition_axis, self.attention_data_partition_axis, self.mesh = kv_partition_axis, \
            attention_data_partition_axis, mesh
        self.forward_metadata = sg.FlashAttentionMetadata()

    def get_forward_metadata(self, batch):
        return sg.get_forward_metadata(batch, self.page_size)

    def __call__(self, *a, **k):
        raise AssertionError("their kernel ran")


def test_install_swaps_their_flash_attention(monkeypatch):
    """install() replaces flashattention_backend.FlashAttention by a subclass of theirs whose __call__ is ours
    (stubbed sgl_jax package: only the module path and the base class)."""
    import sys

    mods = {n: types.ModuleType(n) for n in ("sgl_jax", "sgl_jax.srt", "sgl_jax.srt.layers",
                                             "sgl_jax.srt.layers.attention",
                                             "sgl_jax.srt.layers.attention.flashattention_backend")}
    fab = mods["sgl_jax.srt.layers.attention.flashattention_backend"]
    fab.FlashAttention = _StubFlashAttention
    mods["sgl_jax.srt.layers.attention"].flashattention_backend = fab
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.setattr(sg, "_CLASSES", {})
    cls = sg.install(max_context_len=64)
    assert fab.FlashAttention is cls and issubclass(cls, _StubFlashAttention)
    assert sg.install(max_context_len=64) is cls  # idempotent
    mode, lens = BATCHES["mixed"]
    q, k, v, cache, batch, ref_in, n_tok = make_batch(mode, lens, **SHAPE, T=32, pad_seqs=1, seed=4)
    be = fab.FlashAttention(4, 2, 128, page_size=8)  # what their model runner does for --attention-backend fa
    assert be.pages_per_seq == 8
    be.config, be.interpret = CFG, "tpu"
    be.forward_metadata = be.get_forward_metadata(batch)
    sinks = jnp.asarray(np.random.default_rng(3).standard_normal(4), jnp.float32)
    out, new_cache = be(q, k, v, layer(128, scaling=0.1, sliding_window_size=13, logit_cap=5.0),
                        types.SimpleNamespace(forward_mode=batch.forward_mode), Pool(cache), attention_sink=sinks)
    ref = ref_ragged_paged_attention(q, **ref_in, sm_scale=0.1, sliding_window=13, soft_cap=5.0,
                                     attention_sink=np.asarray(sinks))
    _close(out, ref.reshape(n_tok, -1), n_tok, 2e-5)
    assert _same(new_cache, expected_cache(cache, k, v, batch.out_cache_loc))


_SHARDED = r"""
import sys, types
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
sys.path.insert(0, sys.argv[1])
import test_sglang_jax as t
from tpukernels.integrations import sglang_jax as sg

assert len(jax.devices()) == 2
mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "tensor"))
mode, lens = t.BATCHES["mixed"]
q, k, v, cache, batch, ref_in, n_tok = t.make_batch(mode, lens, **t.SHAPE, T=32, pad_seqs=1, seed=8)
be = sg.TpuKernelsFlashAttention(4, 2, 128, page_size=8, mesh=mesh, max_context_len=64, config=t.CFG)
be.forward_metadata = be.get_forward_metadata(batch)
sinks = jnp.asarray(np.random.default_rng(2).standard_normal(4), jnp.float32)
lay = t.layer(128, scaling=0.1, sliding_window_size=13, logit_cap=5.0)
seen, orig = [], sg.ragged_paged_attention
sg.ragged_paged_attention = lambda *a, **kw: seen.append((a[0].shape, a[3].shape)) or orig(*a, **kw)
out, new_cache = be(q, k, v, lay, types.SimpleNamespace(forward_mode=batch.forward_mode), t.Pool(cache),
                    attention_sink=sinks)
ref = t.ref_ragged_paged_attention(q, **ref_in, sm_scale=0.1, sliding_window=13, soft_cap=5.0,
                                   attention_sink=np.asarray(sinks))
t._close(out, ref.reshape(n_tok, -1), n_tok, 2e-5)
assert t._same(new_cache, t.expected_cache(cache, k, v, batch.out_cache_loc))
assert seen == [((32, 2, 128), (40, 8, 2, 1, 128))], seen  # each shard: 2 query heads, 1 kv head's K/V
print("SHARDED OK")
"""


@pytest.mark.slow
def test_tensor_parallel_shard_map_two_cpu_devices():
    """Their shard_map specs (kv heads over "tensor") on 2 host devices: each shard runs our kernel on its half
    of the kv heads / fused cache; same output and cache as their reference (a fresh process: the device count
    is fixed at jax start)."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.path.dirname(here))
    proc = subprocess.run([sys.executable, "-c", _SHARDED, here], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "SHARDED OK" in proc.stdout, proc.stderr[-3000:]


def test_fp8_cache_per_head_token_scales():
    """Per-(token, kv head) scales ``[P, ps, Hkv]`` through the kernel-level entry: an fp8 cache with Hkv = 3
    (packing 4: a padding kv head, whose scale column the adapter adds), kv head g's scales ~8**g; vs their
    ported reference on the pages pre-multiplied by the scales (so the layout is read independently)."""
    lens = [(1, 20), (5, 14), (3, 3)]
    Hkv, P, ps = 3, 16, 8
    q, k, v, cache, batch, ref_in, n_tok = make_batch("EXTEND", lens, Hq=6, Hkv=Hkv, D=128, ps=ps, P=P,
                                                      dtype=jnp.float8_e4m3fn, seed=8)
    q = q.astype(jnp.bfloat16)
    rng = np.random.default_rng(2)
    ks = (rng.uniform(0.5, 2.0, (P, ps, Hkv)) * 8.0 ** np.arange(Hkv) / 16).astype(np.float32)
    vs = (rng.uniform(0.5, 2.0, (P, ps, Hkv)) * 8.0 ** np.arange(Hkv) / 16).astype(np.float32)
    md = sg.get_forward_metadata(batch, 8)
    args = (q, k, v, cache, md.seq_lens, md.page_indices, md.cu_q_lens, md.cu_kv_lens, md.distribution)
    out, new_cache = sg.ragged_paged_attention(*args, sm_scale=0.1, k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs),
                                               config=CFG)
    ref_in = dict(ref_in, k_pages=ref_in["k_pages"] * ks[..., None], v_pages=ref_in["v_pages"] * vs[..., None])
    ref = ref_ragged_paged_attention(q, **ref_in, sm_scale=0.1)
    _close(out, ref, n_tok, 2e-2)
    wrong = ref_ragged_paged_attention(q, **dict(ref_in, k_pages=ref_in["k_pages"] / ks[..., None] * ks[..., :1, None],
                                                 v_pages=ref_in["v_pages"] / vs[..., None] * vs[..., :1, None]),
                                       sm_scale=0.1)
    assert np.abs(wrong - ref).max() > 0.5 * np.abs(ref).max()  # kv head 0's scale for all heads is far off
    assert _same(new_cache, expected_cache(cache, k, v, batch.out_cache_loc))
    with pytest.raises(ArgumentError, match=r"v_scales must have shape .*\(16, 8, 3\)"):
        sg.ragged_paged_attention(*args, k_scales=jnp.asarray(ks), v_scales=jnp.ones((P, ps, 4), jnp.float32))
