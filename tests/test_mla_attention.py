"""MLA ragged paged attention over a latent cache vs float64 references: the absorbed form, the unabsorbed MLA
formula (W_UK / W_UV applied explicitly), and tpu-inference's own MLA reference; NaN-poisoned caches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError, ConfigError, DTypeError
from tpukernels.library import mla_attention as mla
from tpukernels.library import mla_ragged_paged_attention

L, R = 128, 64  # kv_lora_rank, rope dim (DeepSeek: 512, 64; 128 keeps the cpu runs short)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
I32 = dict(dtype=torch.int32)


def make_batch(q_lens, kv_lens, *, S, T, H, ps, pps, P, dtype=torch.float32, cache_dtype=None, seed=0, poison=True,
               L=L, R=R):
    """A paged MLA batch: each sequence's pages a random choice of the cache's; with ``poison``, unused pages,
    slots past kv_len, this step's slots (the op writes them) and padding rows of every token input are NaN."""
    g = torch.Generator().manual_seed(seed)
    fill = (lambda *s: torch.full(s, math.nan)) if poison else (lambda *s: torch.randn(*s, generator=g))
    cache = fill(P, ps, L + R)
    page_indices = torch.zeros(S, pps, **I32)
    perm = torch.randperm(P, generator=g)
    c = 0
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        for p in range(-(-kl // ps)):
            page_indices[s, p] = perm[c]
            rows = min(ps, kl - p * ps)
            cache[perm[c], :rows] = torch.randn(rows, L + R, generator=g)
            c += 1
        if poison:
            for pos in range(kl - ql, kl):
                cache[page_indices[s, pos // ps], pos % ps] = math.nan
    n_tok = sum(q_lens)
    ql_nope, q_pe = torch.randn(T, H, L, generator=g), torch.randn(T, H, R, generator=g)
    new_c, new_pe = torch.randn(T, L, generator=g), torch.randn(T, R, generator=g)
    for t in (ql_nope, q_pe, new_c, new_pe):
        t[n_tok:] = math.nan if poison else t[n_tok:]
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    cu = np.concatenate([cu, np.full(S + 1 - len(cu), cu[-1])])
    cdt = cache_dtype or dtype
    return (ql_nope.to(dtype), q_pe.to(dtype), new_c.to(cdt), new_pe.to(cdt), cache.to(cdt),
            torch.tensor(list(kv_lens) + [0] * (S - len(kv_lens)), **I32), page_indices,
            torch.tensor(cu, **I32), torch.tensor([len(q_lens)], **I32))


def check(args, out, cache, tol, **kw):
    """out vs the float64 absorbed reference; the cache: this step's slots written, everything else unchanged
    (NaN where it was NaN); padding rows 0; the input cache not modified."""
    before = args[4].clone()
    ref, ref_cache = mla.mla_attention_reference(*args, **kw)
    n_tok = int(args[7][int(args[8][0])])
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs()
    assert n_tok == 0 or err[:n_tok].max().item() <= tol * max(1.0, ref.abs().max().item()), err.max().item()
    assert (out[n_tok:] == 0).all()  # padding rows
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bitwise, NaN == NaN
    assert same(cache, ref_cache)
    assert same(args[4], before)
    return ref


@st.composite
def batches(draw, S=4, T=16, ps=4, pps=6):
    """Ragged batches at one fixed shape (one compile per interpret mode): decode rows, chunked prefill,
    prefill, kv_len 1 and page-boundary lengths, num_seqs < S."""
    n = draw(st.integers(1, S))
    q_lens, kv_lens, budget = [], [], T
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "chunk", "prefill", "boundary", "one"]))
        kl = {"one": 1, "boundary": ps * draw(st.integers(1, pps))}.get(kind) or draw(st.integers(1, ps * pps))
        ql = {"decode": 1, "one": 1, "chunk": draw(st.integers(1, kl)), "prefill": kl,
              "boundary": draw(st.sampled_from([1, min(kl, ps + 1), kl]))}[kind]
        ql = max(0, min(ql, budget))
        budget -= ql
        q_lens.append(ql)
        kv_lens.append(kl)
    return q_lens, kv_lens, draw(st.integers(0, 1000))


@pytest.mark.parametrize("mode", ["fast", "tpu"])  # "tpu": uninitialized VMEM is NaN too
@settings(max_examples=4)
@given(batch=batches())
def test_ragged_batches_match_reference(mode, batch):
    q_lens, kv_lens, seed = batch
    args = make_batch(q_lens, kv_lens, S=4, T=16, H=4, ps=4, pps=6, P=26, seed=seed)
    out, cache = mla_ragged_paged_attention(*args, sm_scale=0.08, config={"block_q": 4, "pages_per_block": 2},
                                            interpret=mode)
    check(args, out, cache, TOL[torch.float32], sm_scale=0.08)


@settings(max_examples=3)  # each example compiles its own kernel
@given(ps=st.sampled_from([2, 8, 16]), H=st.sampled_from([1, 3, 8]), dtype=st.sampled_from([torch.float32,
       torch.bfloat16]), bq=st.sampled_from([1, 2, 8]), ppb=st.sampled_from([1, 2, 4]), batch=batches(S=3, T=12,
       ps=8, pps=3))
def test_page_sizes_heads_dtypes_configs(ps, H, dtype, bq, ppb, batch):
    q_lens, kv_lens, seed = batch
    kv_lens = [min(k, ps * 3) for k in kv_lens]
    q_lens = [min(q, k) for q, k in zip(q_lens, kv_lens)]
    args = make_batch(q_lens, kv_lens, S=3, T=12, H=H, ps=ps, pps=3, P=10, dtype=dtype, seed=seed)
    out, cache = mla_ragged_paged_attention(*args, sm_scale=0.1, config={"block_q": bq, "pages_per_block": ppb},
                                            interpret="tpu")
    check(args, out, cache, TOL[dtype], sm_scale=0.1)


@pytest.mark.slow
@settings(max_examples=30)
@given(ps=st.sampled_from([1, 2, 4, 8, 16, 32]), H=st.sampled_from([1, 2, 3, 8, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bq=st.sampled_from([1, 2, 4, 8, 16]),
       ppb=st.sampled_from([1, 2, 4, 8]), mode=st.sampled_from(["fast", "tpu"]),
       batch=batches(S=4, T=24, ps=8, pps=4))
def test_sweep_slow(ps, H, dtype, bq, ppb, mode, batch):
    q_lens, kv_lens, seed = batch
    kv_lens = [min(k, ps * 4) for k in kv_lens]
    q_lens = [min(q, k) for q, k in zip(q_lens, kv_lens)]
    args = make_batch(q_lens, kv_lens, S=4, T=24, H=H, ps=ps, pps=4, P=18, dtype=dtype, seed=seed)
    out, cache = mla_ragged_paged_attention(*args, sm_scale=0.1, config={"block_q": bq, "pages_per_block": ppb},
                                            interpret=mode)
    check(args, out, cache, TOL[dtype], sm_scale=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepseek_v3_dims_slow(dtype):
    """DeepSeek-V3's attention dims (128 heads, kv_lora_rank 512, rope 64), page 16, a mixed batch (decode rows,
    a chunk, a prefill) at the heuristic config, NaN-poisoned; "tpu" interpret mode."""
    args = make_batch([1, 1, 3, 5], [40, 17, 33, 5], S=5, T=12, H=128, ps=16, pps=3, P=12, dtype=dtype, seed=9,
                      L=512, R=64)
    sm_scale = 192 ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2  # YaRN mscale (factor 40, mscale_all_dim 1)
    out, cache = mla_ragged_paged_attention(*args, sm_scale=sm_scale, interpret="tpu")
    check(args, out, cache, TOL[dtype], sm_scale=sm_scale)


# --------------------------------------------------------------------------------------------- MLA semantics


def unabsorbed_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, q_lens, kv_lens, sm_scale):
    """DeepSeek's MLA as written (no absorption), float64: per head ``k_nope = c_kv @ W_UK[h]^T``,
    ``v = c_kv @ W_UV[h]^T``, ``softmax(sm_scale * (q_nope . k_nope + q_pe . k_pe)) @ v`` over each sequence's
    tokens ``j <= pos``. ``c_kv [S, kv_len, L]`` etc. per sequence (lists); returns ``[T, H, v_head_dim]``."""
    outs, t = [], 0
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qn, qp = q_nope[t:t + ql].double(), q_pe[t:t + ql].double()
        c, kp = c_kv[s].double(), k_pe[s].double()
        k_nope = torch.einsum("jl,hdl->jhd", c, w_uk.double())
        v = torch.einsum("jl,hdl->jhd", c, w_uv.double())
        logits = (torch.einsum("ihd,jhd->hij", qn, k_nope) + torch.einsum("ihr,jr->hij", qp, kp)) * sm_scale
        pos = kl - ql + torch.arange(ql)[:, None]
        logits = logits.masked_fill(torch.arange(kl)[None, :] > pos, -math.inf)
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(logits, -1), v))
        t += ql
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_kernel_equals_unabsorbed_mla(dtype):
    """ql_nope = q_nope @ W_UK, kernel, then @ W_UV^T per head == unabsorbed attention with k_nope / v from the
    latent (float64, from the same low-precision q_nope, q_pe, c_kv, k_pe, W_UK, W_UV)."""
    g = torch.Generator().manual_seed(3)
    H, dn, dv, ps = 4, 32, 48, 4  # qk_nope_head_dim, v_head_dim (DeepSeek: 128, 128)
    q_lens, kv_lens = [1, 5, 3], [7, 5, 9]  # decode, prefill, chunked prefill
    T, S, pps, P = 12, 3, 3, 12
    args = list(make_batch(q_lens, kv_lens, S=S, T=T, H=H, ps=ps, pps=pps, P=P, dtype=dtype, seed=4))
    w_uk = (torch.randn(H, dn, L, generator=g) / math.sqrt(L)).to(dtype)  # kv_b_proj's k_nope rows, per head
    w_uv = (torch.randn(H, dv, L, generator=g) / math.sqrt(L)).to(dtype)
    q_nope = torch.randn(T, H, dn, generator=g).to(dtype)
    n = sum(q_lens)
    ql = torch.einsum("thd,hdl->thl", q_nope[:n].double(), w_uk.double())  # absorbed in float64, then rounded
    args[0] = torch.cat([ql, torch.full((T - n, H, L), math.nan, dtype=torch.float64)]).to(dtype)
    sm_scale = (dn + R) ** -0.5
    out, cache = mla_ragged_paged_attention(*args, sm_scale=sm_scale, interpret="fast")
    # the latents each sequence sees, from the returned cache (its own write is checked against the reference)
    ref_abs = check(args, out, cache, TOL[dtype], sm_scale=sm_scale)
    flat = lambda s: cache[args[6][s, : -(-kv_lens[s] // ps)].long()].reshape(-1, L + R)[:kv_lens[s]]
    c_kv = [flat(s)[:, :L] for s in range(S)]
    k_pe = [flat(s)[:, L:] for s in range(S)]
    want = unabsorbed_mla(q_nope, args[1], c_kv, k_pe, w_uk, w_uv, q_lens, kv_lens, sm_scale)
    got = torch.einsum("thl,hdl->thd", out[:n].double(), w_uv.double())
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]  # bf16: ql_nope rounded once, out rounded once
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    # and the float64 absorbed reference is the unabsorbed formula up to the rounding of ql_nope (f32: tight)
    ref_unabs = torch.einsum("thl,hdl->thd", ref_abs[:n], w_uv.double())
    if dtype == torch.float32:
        assert (ref_unabs - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_matches_tpu_inference_reference():
    """tpu-inference 0.32.0's ``ref_mla_ragged_paged_attention`` (mla/v1: its ``[P, page/packing, packing,
    align(L,128) + align(R,128)]`` cache, ``distribution``, flattened page indices) on a ragged f32 batch: the
    same output rows and the same written cache."""
    jnp = pytest.importorskip("jax.numpy")
    v1 = pytest.importorskip("tpu_inference.kernels.mla.v1.kernel")
    q_lens, kv_lens = [1, 5, 3], [9, 5, 11]  # decode, prefill, chunk; its reference needs q_len >= 1
    S, T, H, ps, pps, P = 3, 10, 4, 4, 3, 12
    args = make_batch(q_lens, kv_lens, S=S, T=T, H=H, ps=ps, pps=pps, P=P, seed=7, poison=False)
    out, cache = mla_ragged_paged_attention(*args, sm_scale=0.07, interpret="fast")
    ql_nope, q_pe, new_c, new_pe, cache_kv, kl, pi, cu, ns = args
    pad = lambda x: np.pad(x.numpy(), ((0, 0), (0, 0), (0, 128 - R)))
    their_cache = np.concatenate([cache_kv[..., :L].numpy(), pad(cache_kv[..., L:])], -1)[:, :, None, :]  # packing 1
    n = int(cu[-1])
    got, got_cache = v1.ref_mla_ragged_paged_attention(
        jnp.asarray(ql_nope[:n].numpy()), jnp.asarray(q_pe[:n].numpy()), jnp.asarray(new_c[:n].numpy()),
        jnp.asarray(new_pe[:n].numpy()), jnp.asarray(their_cache), jnp.asarray(kl.numpy()),
        jnp.asarray(pi.reshape(-1).numpy()), jnp.asarray(cu.numpy()), jnp.asarray([0, 0, S], jnp.int32),
        sm_scale=0.07)
    got = torch.from_numpy(np.array(got)).reshape(n, H, L)
    assert (out[:n] - got).abs().max().item() <= 1e-5 * got.abs().max().item()
    got_cache = torch.from_numpy(np.array(got_cache))[:, :, 0]
    assert torch.equal(cache, torch.cat([got_cache[..., :L], got_cache[..., L:L + R]], -1))
    # ours on their padded cache rows as they are (a reshape of their [P, page/packing, packing, W] cache), the
    # pad lanes NaN-poisoned where no write reaches them: the same output, and their written cache bit for bit
    poisoned = their_cache[:, :, 0].copy()
    poisoned[..., L + R:] = np.nan
    out_p, cache_p = mla_ragged_paged_attention(ql_nope, q_pe, new_c, new_pe, torch.from_numpy(poisoned), kl, pi, cu,
                                                ns, sm_scale=0.07, interpret="tpu")
    assert torch.equal(out_p[:n], out[:n]) and not out_p.isnan().any()
    written = ~torch.isnan(cache_p[..., L + R])  # rows this step wrote: their pad lanes are 0, as tpu-inference's
    assert written.sum() == n and torch.equal(cache_p[written], got_cache[written])
    assert torch.equal(cache_p[..., :L + R], got_cache[..., :L + R])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_latent_cache_with_static_scales(kv_dtype):
    """fp8 cache (new latents quantized by the caller), k_scale / v_scale / q_scale: vs the float64 reference
    from the fp8 values; bf16 queries."""
    args = make_batch([1, 4, 2], [6, 4, 9], S=3, T=8, H=4, ps=4, pps=3, P=12, dtype=torch.bfloat16,
                      cache_dtype=kv_dtype, seed=11)
    kw = dict(sm_scale=0.1, k_scale=1.5, v_scale=0.25, q_scale=2.0)
    out, cache = mla_ragged_paged_attention(*args, **kw, interpret="tpu")
    ref = check(args, out, cache, TOL[torch.bfloat16], **kw)
    assert cache.dtype == kv_dtype and ref.abs().max() > 0.1


def test_jax_entry_matches_torch_op_under_jit():
    import jax
    import jax.numpy as jnp

    args = make_batch([1, 1, 3], [5, 8, 3], S=4, T=6, H=4, ps=4, pps=2, P=10, seed=2)
    out, cache = mla_ragged_paged_attention(*args, sm_scale=0.1, interpret="fast")
    ja = [jnp.asarray(a.numpy()) for a in args]
    f = jax.jit(lambda *a: mla.mla_ragged_paged_attention_jax(*a, sm_scale=0.1, interpret="fast"))
    jout, jcache = f(*ja)
    assert np.allclose(np.asarray(jout), out.numpy(), atol=1e-6, equal_nan=False)
    assert np.array_equal(np.asarray(jcache), cache.numpy(), equal_nan=True)


def test_new_token_slots_jax_and_torch_agree_with_the_rule():
    """Slot of token t = page_indices[s, pos // ps] * ps + pos % ps with pos = kv_len - q_len + i; -1 for padding
    rows and rows past num_seqs (cu_q_lens past num_seqs may hold anything); both implementations."""
    import jax.numpy as jnp

    ps, T = 4, 10
    kl = torch.tensor([6, 1, 9, 3], **I32)
    pi = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 3, 4], [6, 0, 0]], **I32)
    cu = torch.tensor([0, 2, 3, 7, 2], **I32)  # 3 sequences in use; cu[4] is junk
    ns = torch.tensor([3], **I32)
    want = [2 * 4 + 0, 2 * 4 + 1, 7 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 4 * 4 + 0, -1, -1, -1]
    assert mla.new_token_slots_torch(kl, pi, cu, ns, T=T, P=8, ps=ps).tolist() == want
    got = mla.new_token_slots(*(jnp.asarray(t.numpy()) for t in (kl, pi, cu, ns)), T=T, P=8, ps=ps)
    assert np.asarray(got).tolist() == want
    # a page index out of the cache is skipped (device metadata is not checked on host), never written
    pi_bad = pi.clone()
    pi_bad[2, 1] = 99
    assert mla.new_token_slots_torch(kl, pi_bad, cu, ns, T=T, P=8, ps=ps).tolist()[3:6] == [-1, -1, -1]


def test_num_seqs_as_int_and_torch_compile():
    args = make_batch([1, 2], [3, 5], S=2, T=4, H=2, ps=4, pps=2, P=4, seed=5)
    out, cache = mla_ragged_paged_attention(*args[:8], 2, sm_scale=0.1, interpret="fast")
    check(args, out, cache, TOL[torch.float32], sm_scale=0.1)
    f = torch.compile(lambda *a: torch.ops.tpukernels.mla_ragged_paged_attention(*a, 0.1), backend="aot_eager",
                      fullgraph=True)
    out2, cache2 = f(*args)
    assert torch.equal(out2, out) and torch.equal(cache2.view(torch.uint8), cache.view(torch.uint8))


# --------------------------------------------------------------------------------------------- validation


def _good():
    return list(make_batch([1, 3], [4, 6], S=2, T=8, H=4, ps=4, pps=2, P=6, poison=False))


@pytest.mark.parametrize("mutate, err, words", [
    (lambda a: a.__setitem__(6, a[6].index_fill(1, torch.tensor([0]), 99)), ArgumentError, "page_indices[0, 0] = 99"),
    (lambda a: a.__setitem__(5, torch.tensor([9, 6], **I32)), ArgumentError, "kv_lens[0] = 9"),
    (lambda a: a.__setitem__(7, torch.tensor([0, 3, 1], **I32)), ArgumentError, "non-decreasing"),
    (lambda a: a.__setitem__(7, torch.tensor([0, 1, 9], **I32)), ArgumentError, "exceed q's T"),
    (lambda a: a.__setitem__(7, torch.tensor([1, 2, 4], **I32)), ArgumentError, "cu_q_lens[0]"),
    (lambda a: a.__setitem__(8, torch.tensor([3], **I32)), ArgumentError, "num_seqs[0] = 3"),
    (lambda a: a.__setitem__(5, torch.tensor([0, 6], **I32)), ArgumentError, "kv_lens counts this step's new"),
    (lambda a: a.__setitem__(4, a[4][..., :L + R - 1]), ArgumentError, "cache_kv last dim 191 must be"),
    (lambda a: a.__setitem__(0, a[0][..., :96]), ArgumentError, "kv_lora_rank L = ql_nope.shape[2] = 96"),
    (lambda a: a.__setitem__(1, a[1][:, :3]), ArgumentError, "q_pe must have shape [T, H, rope_dim]"),
    (lambda a: a.__setitem__(2, a[2][:5]), ArgumentError, "new_kv_c must have shape"),
    (lambda a: a.__setitem__(3, a[3][:, :32]), ArgumentError, "new_k_pe must have shape"),
    (lambda a: a.__setitem__(0, a[0].half()), DTypeError, "ql_nope dtype float16"),
    (lambda a: a.__setitem__(1, a[1].bfloat16()), DTypeError, "q_pe dtype bfloat16"),
    (lambda a: a.__setitem__(4, a[4].to(torch.int8)), DTypeError, "integer caches"),
    (lambda a: a.__setitem__(2, a[2].bfloat16()), DTypeError, "new_kv_c dtype bfloat16"),
    (lambda a: a.__setitem__(5, a[5].long()), DTypeError, "kv_lens must be int32"),
    (lambda a: a.__setitem__(5, torch.zeros(3, **I32)), ArgumentError, "kv_lens must have shape"),
    (lambda a: a.__setitem__(7, torch.zeros(2, **I32)), ArgumentError, "cu_q_lens must have shape"),
    (lambda a: a.__setitem__(8, torch.zeros(2, **I32)), ArgumentError, "num_seqs must have shape"),
    (lambda a: a.__setitem__(8, True), ArgumentError, "bool"),
    (lambda a: a.__setitem__(0, a[0][0]), ArgumentError, "ql_nope must have rank 3"),
    (lambda a: a.__setitem__(4, a[4].requires_grad_()), ArgumentError, "cache_kv requires grad"),
])
def test_bad_input_raises_before_running(mutate, err, words):
    a = _good()
    mutate(a)
    with pytest.raises(err) as e:
        mla_ragged_paged_attention(*a)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("kw, words", [({"sm_scale": math.inf}, "sm_scale"), ({"sm_scale": None}, "sm_scale"),
                                       ({"k_scale": 0.0}, "k_scale"), ({"v_scale": -1.0}, "v_scale"),
                                       ({"q_scale": math.nan}, "q_scale")])
def test_bad_statics(kw, words):
    with pytest.raises(ArgumentError, match=words):
        mla_ragged_paged_attention(*_good(), **kw)


def test_bad_config_and_jax_entry_checks():
    import jax.numpy as jnp

    with pytest.raises(ConfigError, match="block_qq"):
        mla_ragged_paged_attention(*_good(), config={"block_qq": 8})
    ja = [jnp.asarray(t.numpy()) for t in _good()]
    ja[6] = ja[6].at[0, 0].set(99)
    with pytest.raises(ArgumentError, match="page_indices\\[0, 0\\] = 99"):
        mla.mla_ragged_paged_attention_jax(*ja)
    with pytest.raises(ArgumentError, match="must be a jax array"):
        mla.mla_ragged_paged_attention_jax(*_good())


def test_heuristic_and_sharding_rule():
    from tpukernels.distributed.sharding import _MESH_SHAPE, LIBRARY_RULES, Split, TensorMeta

    a = _good()
    assert mla._heuristic(*(a[i] for i in (5, 6, 7, 8, 0, 1, 4))) == {"block_q": 8, "pages_per_block": 64}  # T = 8
    rule = LIBRARY_RULES["mla_ragged_paged_attention_kernel"]
    args = {"ql_nope": TensorMeta((8, 128, 512), torch.bfloat16), "q_pe": TensorMeta((8, 128, 64), torch.bfloat16),
            "cache_kv": TensorMeta((64, 64, 576), torch.bfloat16)}
    for mesh, want in (((4,), [Split({"ql_nope": 1, "q_pe": 1}, (1,))]), ((3,), [])):
        token = _MESH_SHAPE.set(mesh)
        try:
            assert rule(args) == want, mesh
        finally:
            _MESH_SHAPE.reset(token)


# --------------------------------------------------------------------------------------------- compile-only

CHIPS = ("v5e", "v6e", "tpu7x")


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
def test_compile_only_deepseek_v3_shapes(chip):
    """DeepSeek-V3 attention (128 heads, 512 + 64, bf16): decode 64 x 2048 at page 64 and 128, a mixed batch."""
    import tpukernels as tk

    for kern, args, kw in mla.STANDARD_CASES:
        r = tk.compile_for(kern, chip, *args, with_mlir=False, **kw)
        assert r.ok, (chip, args, r.error)


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
def test_compile_only_fp8_latent_cache(chip, kv):
    """fp8 caches, in our 576-lane rows and in tpu-inference's padded 640-lane rows (the vLLM MLA path)."""
    import tpukernels as tk

    kern, args, kw = mla.STANDARD_CASES[0]
    for width in ("576", "640"):
        a = args[:6] + (args[6].replace("bf16", kv).replace("x576:", f"x{width}:"),)
        r = tk.compile_for(kern, chip, *a, with_mlir=False, **dict(kw, k_scale=2.0, v_scale=0.5))
        assert r.ok, (chip, width, r.error)


@pytest.mark.aot
@pytest.mark.parametrize("chip, H, dtype, ps", [("v5e", 8, "bf16", 16), ("v6e", 16, "bf16", 32), ("tpu7x", 12, "f32", 16)])
def test_compile_only_head_counts_and_float32(chip, H, dtype, ps):
    """Head counts that are not (8) and are (16) a multiple of bf16's sublane tile (the folded query goes through
    f32 or stays bf16), float32 queries and cache."""
    import tpukernels as tk

    args = ("8:i32", "8x4:i32", "9:i32", "1:i32", f"16x{H}x512:{dtype}", f"16x{H}x64:{dtype}", f"64x{ps}x576:{dtype}")
    r = tk.compile_for(mla.mla_kernel, chip, *args, with_mlir=False, sm_scale=0.1, k_scale=None, v_scale=None,
                       q_scale=None)
    assert r.ok, r.error
