"""Ragged paged attention and the paged KV-cache update vs the float64 reference (NaN-poisoned caches)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError, ConfigError, DTypeError
from tpukernels.library import paged_attention as pa
from tpukernels.library import ragged_paged_attention, update_kv_cache

D = 128
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def make_batch(q_lens, kv_lens, *, S, T, Hq, Hkv, ps, pps, P, dtype=torch.float32, seed=0, kv_dtype=None, D=D):
    """A NaN-poisoned paged batch: unused pages, slots past kv_len and padding query rows are NaN;
    pages of each sequence are a random permutation of the cache's pages."""
    g = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    kv = torch.full((P, ps, 2 * Hkv, D), float("nan"))
    page_indices = torch.full((S, pps), 0, dtype=torch.int32)
    perm = torch.randperm(P, generator=g)
    c = 0
    for s, kl in enumerate(kv_lens):
        for p in range(-(-kl // ps)):
            page_indices[s, p] = perm[c]
            rows = min(ps, kl - p * ps)
            kv[perm[c], :rows] = torch.randn(rows, 2 * Hkv, D, generator=g)
            c += 1
    q = torch.randn(T, Hq, D, generator=g)
    q[sum(q_lens):] = float("nan")
    cu = [0]
    for ql in q_lens:
        cu.append(cu[-1] + ql)
    cu += [cu[-1]] * (S + 1 - len(cu))
    kvl = torch.tensor(list(kv_lens) + [0] * (S - n), dtype=torch.int32)
    return (q.to(dtype), kv.to(kv_dtype or dtype), kvl, page_indices, torch.tensor(cu, dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32))


def check(args, out, tol, **kw):
    ref = pa.paged_attention_reference(*args, **kw)
    n_tok = int(args[4][int(args[5][0])])
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs()
    assert n_tok == 0 or err[:n_tok].max().item() <= tol * max(1.0, ref.abs().max().item()), err.max().item()
    assert (out[n_tok:] == 0).all()  # padding rows


@st.composite
def batches(draw, S=4, T=16, ps=4, pps=6):
    """Ragged batches at one fixed shape (one compile per interpret mode): decode rows, chunked prefill,
    prefill, kv_len = 0 sequences and num_seqs < S."""
    n = draw(st.integers(1, S))
    q_lens, kv_lens, budget = [], [], T
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "chunk", "prefill", "empty"]))
        kl = 0 if kind == "empty" else draw(st.integers(1, ps * pps))
        ql = {"decode": 1, "chunk": draw(st.integers(1, kl)) if kl else 0, "prefill": kl, "empty": 0}[kind]
        ql = min(ql, budget, kl)
        budget -= ql
        q_lens.append(ql)
        kv_lens.append(kl)
    return q_lens, kv_lens, draw(st.integers(0, 1000))


@pytest.mark.parametrize("mode", ["fast", "tpu"])
@settings(max_examples=10)
@given(batch=batches())
def test_ragged_batches_match_reference(mode, batch):
    q_lens, kv_lens, seed = batch
    args = make_batch(q_lens, kv_lens, S=4, T=16, Hq=4, Hkv=2, ps=4, pps=6, P=26, seed=seed)
    out = ragged_paged_attention(*args, config={"block_q": 8, "pages_per_block": 2}, interpret=mode)
    check(args, out, TOL[torch.float32])


@settings(max_examples=3)  # each example compiles its own kernels (~25 s each on 2 cores)
@given(ps=st.sampled_from([4, 8, 16]), heads=st.sampled_from([(2, 2), (4, 2), (4, 1), (8, 2)]),
       window=st.sampled_from([None, 1, 5]), soft_cap=st.sampled_from([None, 3.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bq=st.sampled_from([8, 16]),
       ppb=st.sampled_from([1, 2, 4]), seed=st.integers(0, 100))
def test_shapes_windows_softcap(ps, heads, window, soft_cap, dtype, bq, ppb, seed):
    Hq, Hkv = heads
    pps = -(-40 // ps)
    q_lens, kv_lens = [1, 9, 0, 6], [33, 12, 0, 40]
    args = make_batch(q_lens, kv_lens, S=5, T=20, Hq=Hq, Hkv=Hkv, ps=ps, pps=pps, P=4 * pps + 1, dtype=dtype,
                      seed=seed)
    kw = dict(sliding_window=window, soft_cap=soft_cap, sm_scale=0.3)
    out = ragged_paged_attention(*args, config={"block_q": bq, "pages_per_block": ppb}, **kw)
    check(args, out, TOL[dtype], **kw)


@pytest.mark.slow
@settings(max_examples=40)
@given(ps=st.sampled_from([4, 8, 16, 32]), heads=st.sampled_from([(2, 2), (4, 2), (4, 1), (8, 2), (8, 4)]),
       window=st.sampled_from([None, 1, 5, 17]), soft_cap=st.sampled_from([None, 3.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bq=st.sampled_from([8, 16, 32]),
       ppb=st.sampled_from([1, 2, 4, 8]), mode=st.sampled_from(["fast", "tpu"]),
       batch=batches(S=6, T=40, ps=8, pps=8))
def test_sweep_slow(ps, heads, window, soft_cap, dtype, bq, ppb, mode, batch):
    q_lens, kv_lens, seed = batch
    Hq, Hkv = heads
    pps = -(-64 // ps)
    kv_lens = [min(k, 64) for k in kv_lens]
    q_lens = [min(q, k) for q, k in zip(q_lens, kv_lens)]
    args = make_batch(q_lens, kv_lens, S=6, T=40, Hq=Hq, Hkv=Hkv, ps=ps, pps=pps, P=6 * pps + 1, dtype=dtype,
                      seed=seed)
    kw = dict(sliding_window=window, soft_cap=soft_cap)
    out = ragged_paged_attention(*args, config={"block_q": bq, "pages_per_block": ppb}, interpret=mode, **kw)
    check(args, out, TOL[dtype], **kw)


@pytest.mark.parametrize("hd, dtype, kv, with_sinks", [
    (64, torch.float32, None, True),  # gpt-oss: head dim 64 with sinks
    (96, torch.bfloat16, torch.int8, True),  # int8 cache, per-token scales, sinks, head dim 96
    (128, torch.bfloat16, torch.float8_e4m3fn, False),  # fp8 cache, per-token x static scales
])
def test_sinks_per_token_scales_head_dims(hd, dtype, kv, with_sinks):
    """Sinks (one extra logit per head, no value), int8 / fp8 caches quantized with one scale per token (NaN
    scales in unused slots), head dims 64 / 96 vs the float64 reference; interpret "tpu" (NaN-poisoned)."""
    args = list(make_batch([1, 7, 3], [20, 7, 30], S=4, T=16, Hq=4, Hkv=2, ps=8, pps=4, P=13, dtype=dtype, seed=hd,
                           D=hd))
    kw = dict(sliding_window=11, soft_cap=4.0)
    g = torch.Generator().manual_seed(1)
    if with_sinks:
        kw["sinks"] = torch.randn(4, generator=g) * 2
    if kv is not None:
        cache = args[1].float()
        amax = cache.nan_to_num(0.0).abs().amax(dim=(2, 3))  # [P, page_size]: per-token absmax
        qmax = 127.0 if kv == torch.int8 else 448.0
        scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        q = (cache / scales[:, :, None, None])
        q = q.round().clamp(-127, 127) if kv == torch.int8 else q
        args[1] = q.nan_to_num(0.0).to(kv)
        used = ~torch.isnan(cache[:, :, 0, 0])
        scales = torch.where(used, scales, torch.full_like(scales, float("nan")))  # unused slots: NaN scales
        kw.update(k_scales=scales, v_scales=scales.clone())
        if kv == torch.float8_e4m3fn:
            kw.update(k_scale=0.5, v_scale=2.0, k_scales=scales * 2, v_scales=scales / 2)
    out = ragged_paged_attention(*args, config={"block_q": 8, "pages_per_block": 2}, interpret="tpu", **kw)
    check(args, out, TOL[dtype], **kw)
    if with_sinks:  # the sinks change the answer (a test that would pass without them is no test)
        ref = pa.paged_attention_reference(*args, **{k: v for k, v in kw.items() if k != "sinks"})
        assert (ref[:11] - out.double()[:11]).abs().max() > 10 * TOL[dtype]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_cache_with_scales(kv_dtype):
    args = list(make_batch([1, 7, 3], [20, 7, 30], S=3, T=16, Hq=4, Hkv=2, ps=8, pps=4, P=13, dtype=torch.bfloat16,
                           seed=3))
    kv = args[1].float()
    args[1] = torch.where(torch.isnan(kv), kv, kv / 4).to(kv_dtype)  # NaN survives in e5m2; e4m3fn has NaN too
    kw = dict(k_scale=4.0, v_scale=0.5)
    out = ragged_paged_attention(*args, config={"block_q": 8, "pages_per_block": 2}, **kw)
    check(args, out, 3e-2, **kw)


def test_heuristic_config_and_torch_op_name():
    args = make_batch([1, 1, 1], [5, 9, 2], S=4, T=4, Hq=4, Hkv=2, ps=4, pps=3, P=12)
    out = torch.ops.tpukernels.ragged_paged_attention(*args)  # the public op means the public function
    check(args, out, TOL[torch.float32])


@pytest.mark.parametrize("mode", ["fast", "tpu"])
def test_update_kv_cache_then_decode(mode):
    """A decode step as two ops: write the new token's K/V, then attend; the input cache is unchanged."""
    S, Hq, Hkv, ps, pps = 3, 4, 2, 4, 3
    q_lens, kv_lens = [1, 1, 1], [5, 8, 1]
    args = list(make_batch(q_lens, [k - 1 for k in kv_lens], S=S, T=3, Hq=Hq, Hkv=Hkv, ps=ps, pps=pps, P=10))
    page_indices = args[3]
    for s, kl in enumerate(kv_lens):  # the page of the new token may be new for this sequence
        if (kl - 1) % ps == 0:
            page_indices[s, (kl - 1) // ps] = 9 - s
    cache = args[1]
    before = cache.clone()
    k_new, v_new = torch.randn(S, Hkv, D), torch.randn(S, Hkv, D)
    slots = torch.tensor([int(page_indices[s, (kl - 1) // ps]) * ps + (kl - 1) % ps for s, kl in enumerate(kv_lens)],
                         dtype=torch.int32)
    new_cache = update_kv_cache(cache, k_new, v_new, slots, interpret=mode)
    assert torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0))  # functional: input untouched
    expect = before.clone()
    for t, sl in enumerate(slots.tolist()):
        expect[sl // ps, sl % ps, 0::2] = k_new[t]
        expect[sl // ps, sl % ps, 1::2] = v_new[t]
    assert torch.equal(new_cache.nan_to_num(7.0), expect.nan_to_num(7.0))
    args[1], args[2] = new_cache, torch.tensor(kv_lens, dtype=torch.int32)
    out = ragged_paged_attention(*args, config={"block_q": 8, "pages_per_block": 1}, interpret=mode)
    check(tuple(args), out, TOL[torch.float32])


def test_update_kv_cache_skips_negative_slots():
    cache = torch.zeros(2, 4, 2, D)
    k, v = torch.ones(3, 1, D), 2 * torch.ones(3, 1, D)
    out = update_kv_cache(cache, k, v, torch.tensor([5, -1, 0], dtype=torch.int32))
    assert out[1, 1, 0].eq(1).all() and out[1, 1, 1].eq(2).all() and out[0, 0].eq(torch.tensor([1.0, 2.0])[:, None]).all()
    assert out.sum().item() == 2 * 3 * D


# --------------------------------------------------------------------------------------------- validation

def _good():
    return list(make_batch([1, 3], [4, 6], S=2, T=8, Hq=4, Hkv=2, ps=4, pps=2, P=6))


@pytest.mark.parametrize("mutate, err, words", [
    (lambda a: a.__setitem__(3, a[3].index_fill(1, torch.tensor([0]), 99)), ArgumentError, "page_indices[0, 0] = 99"),
    (lambda a: a.__setitem__(2, torch.tensor([9, 6], dtype=torch.int32)), ArgumentError, "kv_lens[0] = 9"),
    (lambda a: a.__setitem__(4, torch.tensor([0, 3, 1], dtype=torch.int32)), ArgumentError, "non-decreasing"),
    (lambda a: a.__setitem__(4, torch.tensor([0, 1, 9], dtype=torch.int32)), ArgumentError, "exceed q's T"),
    (lambda a: a.__setitem__(4, torch.tensor([1, 2, 4], dtype=torch.int32)), ArgumentError, "cu_q_lens[0]"),
    (lambda a: a.__setitem__(5, torch.tensor([3], dtype=torch.int32)), ArgumentError, "num_seqs[0] = 3"),
    (lambda a: a.__setitem__(2, torch.tensor([0, 6], dtype=torch.int32)), ArgumentError, "q_len 1 > kv_lens[0]"),
    (lambda a: a.__setitem__(0, torch.zeros(8, 4, 64)), ArgumentError, "head dim"),
    (lambda a: a.__setitem__(0, torch.zeros(8, 3, 128)), ArgumentError, "multiple of kv heads"),
    (lambda a: a.__setitem__(0, a[0].to(torch.bfloat16)), DTypeError, "kv_cache dtype"),
    (lambda a: a.__setitem__(0, a[0].half()), DTypeError, "q dtype float16"),
    (lambda a: a.__setitem__(2, a[2].long()), DTypeError, "kv_lens must be int32"),
    (lambda a: a.__setitem__(2, torch.zeros(3, dtype=torch.int32)), ArgumentError, "kv_lens must have shape"),
    (lambda a: a.__setitem__(4, torch.zeros(2, dtype=torch.int32)), ArgumentError, "cu_q_lens must have shape"),
    (lambda a: a.__setitem__(1, a[1][:, :, :3]), ArgumentError, "2*Hkv"),
    (lambda a: a.__setitem__(0, a[0][0]), ArgumentError, "q must have rank 3"),
])
def test_bad_input_raises_before_running(mutate, err, words):
    a = _good()
    mutate(a)
    with pytest.raises(err, match=None) as e:
        ragged_paged_attention(*a)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("kw, err, words", [
    ({"sinks": torch.zeros(3)}, ArgumentError, "sinks must have shape \\[Hq\\] = \\(4,\\)"),
    ({"sinks": torch.zeros(4, dtype=torch.bfloat16)}, DTypeError, "sinks must be float32"),
    ({"k_scales": torch.ones(6, 4)}, ArgumentError, "both k_scales and v_scales"),
    ({"k_scales": torch.ones(6, 3), "v_scales": torch.ones(6, 3)}, ArgumentError, "k_scales must have shape"),
    ({"k_scales": torch.ones(6, 4), "v_scales": torch.ones(6, 4, dtype=torch.float64)}, DTypeError,
     "v_scales must be float32"),
])
def test_bad_sinks_and_scales(kw, err, words):
    with pytest.raises(err, match=words):
        ragged_paged_attention(*_good(), **kw)


@pytest.mark.parametrize("kw, words", [({"sliding_window": 0}, "sliding_window"), ({"soft_cap": -1.0}, "soft_cap"),
                                       ({"k_scale": 0.0}, "k_scale"), ({"sm_scale": math.inf}, "sm_scale")])
def test_bad_statics(kw, words):
    with pytest.raises(ArgumentError, match=words):
        ragged_paged_attention(*_good(), **kw)


@pytest.mark.parametrize("config, words", [("block_q=8", "config must be a dict"), ([("block_q", 8)], "config must be a dict"),
                                           ({"block_q": torch.tensor(8)}, "not JSON-serializable"),
                                           ({"block_qq": 8}, "block_qq")])
def test_bad_config_is_a_config_error(config, words):
    with pytest.raises(ConfigError, match=words):
        ragged_paged_attention(*_good(), config=config)


def test_update_validation():
    cache = torch.zeros(2, 4, 2, D)
    k = torch.ones(2, 1, D)
    with pytest.raises(ArgumentError, match="slot_mapping\\[1\\] = 8"):
        update_kv_cache(cache, k, k, torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ArgumentError, match="twice"):
        update_kv_cache(cache, k, k, torch.tensor([3, 3], dtype=torch.int32))
    with pytest.raises(DTypeError, match="k dtype"):
        update_kv_cache(cache, k.bfloat16(), k, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ArgumentError, match="\\[T, Hkv, D\\]"):
        update_kv_cache(cache, torch.ones(2, 2, D), k, torch.tensor([0, 1], dtype=torch.int32))


def test_schedule_bound_is_exact_for_decode():
    assert pa._n_items(64, 64, 8) == 64  # a decode batch: one visit per sequence, no idle grid steps
    import jax.numpy as jnp

    for T, S, bq, q_lens in [(16, 4, 8, [3, 5, 0, 7]), (20, 5, 8, [1, 9, 0, 6]), (8, 8, 8, [1] * 8), (9, 3, 4, [9])]:
        cu = np.concatenate([[0], np.cumsum(q_lens + [0] * (S - len(q_lens)))]).astype(np.int32)
        out = pa._schedule(jnp.zeros(S, jnp.int32), jnp.zeros((S, 1), jnp.int32), jnp.asarray(cu),
                           jnp.asarray([len(q_lens)], jnp.int32), T=T, S=S, bq=bq)
        seq, blk = np.asarray(out[4]), np.asarray(out[5])
        want = [(b, s) for b in range(-(-T // bq)) for s in range(len(q_lens))
                if q_lens[s] and cu[s] < (b + 1) * bq and cu[s + 1] > b * bq]
        got = [(int(b), int(s)) for b, s in zip(blk, seq) if s >= 0]
        assert got == want
        covered = set(int(b) for b in blk)
        assert covered == set(range(-(-T // bq)))  # every block is visited (padding blocks store zeros)
        assert list(blk) == sorted(blk)


# --------------------------------------------------------------------------------------------- compile-only

CHIPS = ("v5e", "v6e", "tpu7x")


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
def test_compile_only_standard_cases(chip):
    import tpukernels as tk

    for kern, args, kw in pa.STANDARD_CASES:
        r = tk.compile_for(kern, chip, *args, with_mlir=False, **kw)
        assert r.ok, (chip, args, r.error)


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
def test_compile_only_fp8(chip, kv):
    import tpukernels as tk

    kern, args, kw = pa.STANDARD_CASES[0]
    args = args[:5] + (args[5].replace("bf16", kv),)
    r = tk.compile_for(kern, chip, *args, with_mlir=False, **dict(kw, k_scale=2.0, v_scale=0.5))
    assert r.ok == (chip in pa.FP8_KV_CHIPS), (chip, r.error)


@pytest.mark.aot
@pytest.mark.parametrize("chip, D, kv, extra", [("v5e", 64, "bf16", "sinks"), ("v6e", 128, "i8", "scales"),
                                               ("tpu7x", 96, "bf16", ""), ("v6e", 256, "bf16", ""),
                                               ("tpu7x", 128, "float8_e4m3fn", "scales+sinks")])
def test_compile_only_head_dims_sinks_per_token_scales(chip, D, kv, extra):
    """Mosaic (libtpu 0.0.52) compiles head dims 64 / 96 / 256 (rows narrower than 128 lanes padded in
    VMEM), sinks (SMEM) and per-token scale pages (DMA'd beside the K/V pages)."""
    import tpukernels as tk

    S, pps, ps, P, T = 8, 8, 16, 64, 8
    args = [f"{S}:i32", f"{S}x{pps}:i32", f"{S + 1}:i32", "1:i32", f"{T}x8x{D}:bf16", f"{P}x{ps}x4x{D}:{kv}",
            "8:f32" if "sinks" in extra else None] + ([f"{P}x{ps}x1:f32"] * 2 if "scales" in extra else [None, None])
    r = tk.compile_for(pa.rpa_kernel, chip, *args, with_mlir=False, sm_scale=None, sliding_window=None,
                       soft_cap=None, k_scale=None, v_scale=None)
    assert r.ok, r.error


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
def test_compile_only_update(chip):
    import tpukernels as tk

    r = tk.compile_for(pa.update_kernel, chip, "64:i32", "64x16x128:bf16", "8192x16x16x128:bf16", with_mlir=False)
    assert r.ok, r.error


def test_paged_decode_example_matches_hf_generate():
    """examples/paged_decode.py: a tiny Llama decoded through a paged cache gives stock HF's greedy tokens."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "paged_decode.py")
    spec = importlib.util.spec_from_file_location("paged_decode_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.tiny_llama()
    prompts = [[5, 17, 99, 3, 42, 7, 64], [11, 200, 31]]
    got = mod.paged_generate(model, prompts, 4)
    want = [mod.hf_generate(model, p, 4) for p in prompts]
    assert got == want
    assert len({t for g in got for t in g}) > 2  # not a degenerate repeat of one token


def test_vmem_estimate_ignores_any_smem_and_semaphores():
    """The DSL's VMEM estimate counts the page double buffer but not the pl.ANY cache, SMEM or semaphores."""
    from tpukernels.lowering import resolve, validate
    from tpukernels.targets.compile_only import example_specs

    kern, args, kw = pa.STANDARD_CASES[0]
    specs, statics = example_specs(kern, args, kw)
    res = resolve(kern, specs, statics, {"block_q": 8, "pages_per_block": 16})
    est = validate(kern, res, None)
    labels = " ".join(lbl for lbl, _ in est.detail)
    assert "kv_cache" not in labels  # 8192 x 16 x 16 x 128 bf16 = 512 MiB would dominate
    assert est.total_bytes < 8 << 20
    buf = 2 * 16 * 16 * 16 * 128 * 2
    assert any(b == buf for _, b in est.detail)


def test_torch_compile_fullgraph():
    """The public op traces into one graph (fake kernels from the launch; value checks skip fake tensors)."""
    args = make_batch([1, 3], [4, 6], S=2, T=8, Hq=4, Hkv=2, ps=4, pps=2, P=6)
    f = torch.compile(lambda *a: torch.ops.tpukernels.ragged_paged_attention(*a), backend="aot_eager", fullgraph=True)
    check(args, f(*args), TOL[torch.float32])


# ------------------------------------------------------------------------------------------ in-place update
def _expect_update(cache, k, v, slots):
    ps = cache.shape[1]
    expect = cache.clone()
    for t, sl in enumerate(slots.tolist()):
        if sl >= 0:
            expect[sl // ps, sl % ps, 0::2] = k[t]
            expect[sl // ps, sl % ps, 1::2] = v[t]
    return expect


@pytest.mark.parametrize("mode", ["fast", "tpu"])
def test_update_kv_cache_in_place(mode, monkeypatch):
    """update_kv_cache_ writes the slots into the caller's cache (same storage), skips negative slots, and
    runs the kernel on the touched pages only (never on a whole-cache operand)."""
    from tpukernels.library.paged_attention import update_kv_cache_
    from tpukernels.targets import cpu

    g = torch.Generator().manual_seed(3)
    cache = torch.randn(16, 4, 4, D, generator=g)
    k, v = torch.randn(5, 2, D, generator=g), torch.randn(5, 2, D, generator=g)
    slots = torch.tensor([61, -1, 2, 3, 40], dtype=torch.int32)
    expect = _expect_update(cache, k, v, slots)
    seen, orig = [], cpu.run_torch_cpu

    def spy(kernel, values, config):
        seen.append(tuple(values[2].shape))
        return orig(kernel, values, config)

    monkeypatch.setattr(cpu, "run_torch_cpu", spy)
    ptr = cache.data_ptr()
    assert update_kv_cache_(cache, k, v, slots, interpret=mode) is cache
    assert cache.data_ptr() == ptr and torch.equal(cache, expect)
    assert seen == [(3, 4, 4, D)]  # pages 15, 0 and 10: the kernel's cache operand is those 3 pages
    # the op schema declares the mutation
    assert "Tensor(a!) kv_cache" in str(torch.ops.tpukernels.update_kv_cache_.default._schema)


def test_update_kv_cache_in_place_validation():
    from tpukernels.library.paged_attention import update_kv_cache_

    cache = torch.zeros(2, 4, 2, D)
    k = torch.ones(2, 1, D)
    with pytest.raises(ArgumentError, match="slot_mapping\\[1\\] = 8"):
        update_kv_cache_(cache, k, k, torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ArgumentError, match="contiguous"):
        update_kv_cache_(torch.zeros(4, 2, 2, D).transpose(0, 1), k, k, torch.tensor([0, 1], dtype=torch.int32))
    assert cache.eq(0).all()  # nothing written before the errors


_PEAK_SCRIPT = r"""
import json, sys, torch
from tpukernels.library.paged_attention import update_kv_cache, update_kv_cache_

def rss(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

def peak_of(fn):
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (the peak) to the current RSS
        f.write("5")
    before = rss("VmRSS:")
    fn()
    return rss("VmHWM:") - before

P, ps, H2, D = 1024, 16, 8, 128                      # float32: 64 MiB
cache = torch.zeros(P, ps, H2, D)
cache.fill_(1.0)                                      # touch every page
k = torch.randn(8, H2 // 2, D); v = torch.randn(8, H2 // 2, D)
slots = torch.arange(8, dtype=torch.int32) * 997
update_kv_cache_(cache, k, v, slots)                  # compile the small kernel first
ptr = cache.data_ptr()
inplace = peak_of(lambda: update_kv_cache_(cache, k, v, slots + 1))
ok = cache.data_ptr() == ptr and torch.equal(cache[997 // ps, 997 % ps + 1, 0::2], k[1])
warm = update_kv_cache(cache, k, v, slots)            # compile the functional one at the full cache
keep = []                                             # results stay alive: no buffer reuse hides a copy
functional = peak_of(lambda: keep.append(update_kv_cache(cache, k, v, slots + 2)))
print(json.dumps({"cache": cache.nbytes, "inplace": inplace, "functional": functional, "ok": bool(ok)}))
"""


def test_update_kv_cache_in_place_peak_memory():
    """Peak resident memory of one in-place step (a fresh process; VmHWM reset before the step) is far below
    one cache copy, while the functional op's step costs at least one copy (the measurement sees copies)."""
    import json
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPUKERNELS_INTERPRET="fast")
    res = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["ok"]
    assert r["inplace"] < r["cache"] / 16, r
    assert r["functional"] > r["cache"] / 2, r


def test_update_kv_cache_in_place_on_torch_tpu_donates_the_callers_cache(monkeypatch):
    """The tpu branch against torch-tpu's real pallas.py: the caller's cache itself is donated (not a clone);
    a runtime that reuses the donated buffer leaves nothing to copy, one that returns another buffer gets it
    copied into the cache."""
    import real_torch_tpu

    from tpukernels.library import paged_attention as pa

    try:
        _, registry = real_torch_tpu.install(monkeypatch)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    pa.update_kernel._plans.clear()
    monkeypatch.setattr(pa.update_kernel, "_plans", {})
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(3, 2, D, generator=g), torch.randn(3, 2, D, generator=g)
    slots = torch.tensor([9, -1, 0], dtype=torch.int32)
    kv_new = torch.stack([k, v], dim=2).reshape(3, 4, D)

    for reuse in (True, False):
        cache = torch.randn(4, 4, 4, D, generator=g)
        expect, ptr = _expect_update(cache, k, v, slots), cache.data_ptr()

        def run(name, inputs, outs, reuse=reuse):  # the device: writes the slots of the donated cache
            sl, new, c = inputs
            assert c.data_ptr() == ptr  # the caller's buffer was donated, not a clone
            res = c if reuse else c.clone()
            for t, s in enumerate(sl.tolist()):
                if s >= 0:
                    res[s // 4, s % 4] = new[t]
            if not reuse:
                c.fill_(float("nan"))  # a donated buffer's old contents are gone
            return [res]

        registry.runner = run
        pa._update_inplace_tpu(cache, kv_new, slots)
        assert registry.calls[-1]["donate_argnums"] == [2]
        assert cache.data_ptr() == ptr and torch.equal(cache, expect)


# --------------------------------------------------------------------------------------------- issue 36 item 7

@pytest.mark.parametrize("num_seqs", [True, False, np.bool_(True), 2.0, "2"])
def test_num_seqs_not_a_count_is_a_typed_error(num_seqs):
    """A bool (an int subclass) or a non-integer num_seqs is refused naming num_seqs, not by the op schema."""
    with pytest.raises(ArgumentError, match="num_seqs"):
        ragged_paged_attention(*_good()[:5], num_seqs)


@pytest.mark.parametrize("num_seqs", [2, np.int64(2)])
def test_num_seqs_as_an_int_means_the_tensor(num_seqs):
    a = _good()
    out = ragged_paged_attention(*a[:5], num_seqs, config={"block_q": 8, "pages_per_block": 1}, interpret="fast")
    check(a, out, TOL[torch.float32])


def _update_cases():
    from tpukernels.library.paged_attention import update_kv_cache_

    slots = torch.tensor([0, 5], dtype=torch.int32)
    odd = (torch.zeros(2, 4, 3, D), torch.ones(2, 1, D), torch.ones(2, 1, D), slots)
    grad = (torch.zeros(2, 4, 2, D, requires_grad=True), torch.ones(2, 1, D), torch.ones(2, 1, D), slots)
    return [(fn, args, words) for fn in (update_kv_cache, update_kv_cache_)
            for args, words in ((odd, "kv_cache dim 2 must be 2\\*Hkv"), (grad, "kv_cache requires grad"))]


@pytest.mark.parametrize("fn, args, words", _update_cases(), ids=lambda x: getattr(x, "__name__", None))
def test_update_bad_cache_is_a_typed_error_and_leaves_it_unchanged(fn, args, words):
    """An odd combined-head dim (was a raw view error) or a cache that requires grad (in place: torch's leaf
    message; functional: a KernelDefinitionError only at backward) raise ArgumentError naming kv_cache; the
    cache is not written."""
    cache = args[0]
    before = cache.detach().clone()
    with pytest.raises(ArgumentError, match=words):
        fn(*args, interpret="fast")
    assert torch.equal(cache.detach(), before)


def test_update_cache_requiring_grad_is_fine_under_no_grad():
    """Under torch.no_grad() a cache that requires grad is updated as any other (the optimizer-style rule)."""
    from tpukernels.library.paged_attention import update_kv_cache_

    cache = torch.zeros(2, 4, 2, D, requires_grad=True)
    k, v, slots = torch.ones(2, 1, D), 2 * torch.ones(2, 1, D), torch.tensor([0, 5], dtype=torch.int32)
    with torch.no_grad():
        out = update_kv_cache(cache, k, v, slots, interpret="fast")
        update_kv_cache_(cache, k, v, slots, interpret="fast")
    for c in (out, cache.detach()):
        assert c[0, 0, 0].eq(1).all() and c[0, 0, 1].eq(2).all() and c[1, 1, 0].eq(1).all()
        assert c.sum().item() == 2 * 3 * D
