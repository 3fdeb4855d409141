"""tpukernels as vLLM-TPU's attention backend: ragged paged attention vs tpu-inference 0.32.0's OWN reference
(``ref_ragged_paged_attention`` of its RPA v3 kernel, and the head_dim-64 kernel's reference with attention
sinks) on random ragged batches in tpu-inference's 5-D cache layout, NaN in unused pages; the backend built
through tpu-inference's registry.

tpu-inference, vllm and torchax are installed --no-deps by the Makefile. torchax 0.0.13 fails at a plain import
against torch 2.13 (its amp table names named-tensor overloads such as ``aten.prod.dim_Dimname`` that torch
2.13 removed); the head_dim-64 module imports it (for dtype helpers its reference never calls) through
``tpukernels.integrations.torchax_ops.import_torchax`` (the real torchax, shimmed), or a stub of those
helpers where torchax is not installed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import numpy as np
import pytest

tpu_inference = pytest.importorskip("tpu_inference", reason="tpu-inference 0.32.0 (make test installs it --no-deps)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from tpukernels.errors import ArgumentError, DTypeError  # noqa: E402
from tpukernels.integrations import vllm_tpu as vt  # noqa: E402
from tpukernels.library import paged_attention as pa  # noqa: E402


@contextlib.contextmanager
def _torchax_stub():
    """``torchax.ops.mappings`` as a stub while tpu-inference's modules that import it load (see module doc)."""
    try:
        import torchax  # noqa: F401

        yield
        return
    except Exception:  # noqa: BLE001  (AttributeError at import with torch 2.13)
        for k in [k for k in sys.modules if k == "torchax" or k.startswith("torchax.")]:
            del sys.modules[k]
    mods = {n: types.ModuleType(n) for n in ("torchax", "torchax.ops", "torchax.ops.mappings")}
    for n in ("j2t_dtype", "t2j", "t2j_dtype"):
        setattr(mods["torchax.ops.mappings"], n, lambda *a, **k: (_ for _ in ()).throw(NotImplementedError(n)))
    mods["torchax"].ops, mods["torchax.ops"].mappings = mods["torchax.ops"], mods["torchax.ops.mappings"]
    sys.modules.update(mods)
    try:
        yield
    finally:
        for n in mods:
            sys.modules.pop(n, None)


@pytest.fixture(scope="module")
def rpa():
    env = dict(os.environ)
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel

    os.environ.clear()
    os.environ.update(env)  # vllm's env_override sets process-wide torch/inductor variables: undo them
    return kernel


@pytest.fixture(scope="module")
def hd64():
    from tpukernels.errors import BackendUnavailableError
    from tpukernels.integrations import torchax_ops

    try:
        torchax_ops.import_torchax()  # the real torchax 0.0.13, through tpukernels' shim for torch 2.13
        ctx = contextlib.nullcontext()
    except BackendUnavailableError:
        ctx = _torchax_stub()  # torchax not installed: stub the dtype helpers tpu-inference imports
    with ctx:
        from tpu_inference.kernels.ragged_paged_attention.v3 import kernel_hd64
    return kernel_hd64


def make_case(mod, q_lens, kv_lens, *, S, T, Hq, Hkv, D, ps, pps, P, dtype=jnp.float32, kv_dtype=None, seed=0):
    """tpu-inference inputs: decode sequences first, then chunked prefill, then mixed (``distribution``); the
    cache holds each sequence's first ``kv_len - q_len`` tokens, written with tpu-inference's own ``merge_kv``;
    unused pages, slots past kv_len and padding tokens of q / k / v are NaN."""
    rng = np.random.default_rng(seed)
    kv_dtype = kv_dtype or dtype
    shape = mod.get_kv_cache_shape(P, ps, Hkv, D, kv_dtype)
    cache = np.full(shape, np.nan, np.float32)
    n = len(q_lens)
    page_indices = np.zeros((S, pps), np.int32)
    perm = rng.permutation(P)
    c = 0
    for s, kl in enumerate(kv_lens):
        page_indices[s, : -(-kl // ps)] = perm[c: c + -(-kl // ps)]
        c += -(-kl // ps)
        old = kl - q_lens[s]
        if old:
            k = rng.standard_normal((old, Hkv, D)).astype(np.float32)
            v = rng.standard_normal((old, Hkv, D)).astype(np.float32)
            rows = np.asarray(mod.merge_kv(jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype)).astype(jnp.float32))
            for j in range(old):
                cache[page_indices[s, j // ps], j % ps] = rows[j]
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    used = sum(q_lens)
    q[used:], k[used:], v[used:] = np.nan, np.nan, np.nan
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(S - n, used)]).astype(np.int32)
    kvl = np.array(list(kv_lens) + [0] * (S - n), np.int32)
    n_dec = sum(1 for ql in q_lens if ql == 1)
    assert all(ql == 1 for ql in q_lens[:n_dec])
    dist = np.array([n_dec, n_dec, n], np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype),
            jnp.asarray(cache, kv_dtype), jnp.asarray(kvl), jnp.asarray(page_indices.reshape(-1)), jnp.asarray(cu),
            jnp.asarray(dist))


def their(ref, *args, **kw):
    """Their reference, unchanged, under one ``jax.jit`` with the int32 metadata closed over as numpy arrays
    (its Python loops over sequences and pages need concrete values): one XLA program instead of eager ops
    compiled per sequence shape (same values, same semantics; ~10x faster here)."""
    meta = [np.asarray(a) for a in args[4:8]]
    arrays = list(args[:4]) + list(args[8:])
    return jax.jit(lambda q, k, v, c, *rest: ref(q, k, v, c, *meta, *rest, **kw))(*arrays)


def _same(a, b) -> bool:
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    return a.shape == b.shape and bool(np.array_equal(np.isnan(a), np.isnan(b))) and bool(
        np.array_equal(np.nan_to_num(a), np.nan_to_num(b)))


def _check(out, ref, n_tok, tol):
    out, ref = np.asarray(out, np.float64)[:n_tok], np.asarray(ref.astype(jnp.float32), np.float64)[:n_tok]
    assert not np.isnan(out).any()
    err = np.abs(out - ref).max() if n_tok else 0.0
    assert err <= tol * max(1.0, np.abs(ref).max()), err


# batches: (q_lens, kv_lens): decode-only; mixed (decode + chunked prefill + prefill); chunked prefill only
BATCHES = {
    "decode": ([1, 1, 1, 1], [37, 5, 64, 17]),
    "mixed": ([1, 1, 6, 9, 12], [23, 40, 30, 9, 12]),
    "chunked_prefill": ([7, 5, 16], [48, 21, 16]),
}


@pytest.mark.parametrize("batch, D", [("decode", 128), ("mixed", 128), ("mixed", 96), ("chunked_prefill", 96)])
def test_matches_tpu_inference_reference(rpa, batch, D):
    """ours (jitted, interpret "tpu": NaN-poisoned VMEM) vs their reference: the same output and the same cache
    writes; sliding window with soft cap. (One kernel compile serves all four: D = 96 runs padded to 128.)"""
    q_lens, kv_lens = BATCHES[batch]
    args = make_case(rpa, q_lens, kv_lens, S=6, T=32, Hq=4, Hkv=2, D=D, ps=8, pps=8, P=40, seed=len(batch) + D)
    kw = dict(sm_scale=0.1, sliding_window=13, soft_cap=5.0)
    ref_out, ref_cache = their(rpa.ref_ragged_paged_attention, *args, **kw)
    run = lambda *a: vt.ragged_paged_attention_v3(*a, **kw, config={"block_q": 8, "pages_per_block": 2},  # noqa: E731
                                                  interpret="tpu")
    # eager (the compiled kernel is reused across the six cases); one case also under jax.jit (trace-safe)
    out, cache = (jax.jit(run) if (batch, D) == ("decode", 128) else run)(*args)
    assert _same(cache, ref_cache)  # our in-place write = their kernel's, bit for bit (NaN pages untouched)
    _check(out, ref_out, sum(q_lens), 2e-5)


@pytest.mark.slow  # ~30 s; make test keeps fp8 KV through test_sglang_jax (fp8 cache, per-head/token scales)
def test_fp8_kv_vs_their_reference(rpa):
    """bf16 q with an fp8 (e4m3) cache and static k_scale / v_scale; their reference rounds the softmax
    probabilities to the cache dtype (fp8), ours keeps them in q's dtype: the tolerance vs theirs says so, and
    ours is held tightly to the float64 reference on the same quantized cache."""
    q_lens, kv_lens = BATCHES["mixed"]
    for kv_dtype, kw, tol in ((jnp.float8_e4m3fn, dict(k_scale=0.5, v_scale=2.0), 0.15),):
        args = make_case(rpa, q_lens, kv_lens, S=6, T=32, Hq=8, Hkv=2, D=128, ps=8, pps=8, P=40,
                         dtype=jnp.bfloat16, kv_dtype=kv_dtype, seed=7)
        kw = dict(kw, sm_scale=128 ** -0.5)
        ref_out, ref_cache = their(rpa.ref_ragged_paged_attention, *args, **kw)
        out, cache = vt.ragged_paged_attention_v3(*args, **kw, config={"block_q": 16, "pages_per_block": 4})
        assert _same(cache, ref_cache)
        _check(out, ref_out, sum(q_lens), tol)
        # and tightly vs the float64 reference on the same (quantized) cache
        view, _ = vt.kv_cache_view(cache, 2, 128)
        kl, pi, cu, ns = vt.metadata_view(*args[4:8])
        want = pa.paged_attention_reference(*(torch.from_numpy(np.array(x.astype(jnp.float32))) for x in
                                              (args[0], view)), *(torch.from_numpy(np.array(x)) for x in
                                                                  (kl, pi, cu, ns)), **kw)
        _check(out, want.numpy(), sum(q_lens), 1e-2)


def test_head_dim_64_with_sinks_vs_their_hd64_reference(hd64):
    """gpt-oss shapes: D = 64, per-head attention sinks, sliding window, a mixed batch (decode rows, chunked
    prefill, prefill); their hd64 reference is the one tpu-inference's kernel_hd64 ships (their only kernel
    with sinks)."""
    q_lens, kv_lens = BATCHES["mixed"]
    args = make_case(hd64, q_lens, kv_lens, S=6, T=32, Hq=8, Hkv=2, D=64, ps=8, pps=8, P=40, seed=11)
    sinks = jnp.asarray(np.random.default_rng(3).standard_normal(8) * 2, jnp.float32)
    kw = dict(sm_scale=0.125, sliding_window=9)
    ref_out, ref_cache = their(hd64.ref_ragged_paged_attention_hd64, *args, sinks, **kw)
    out, cache = vt.ragged_paged_attention_v3(*args, sinks, **kw, config={"block_q": 8, "pages_per_block": 2},
                                              interpret="tpu")
    assert _same(cache, ref_cache)
    _check(out, ref_out, sum(q_lens), 2e-5)


def test_cache_view_is_a_bit_exact_reshape(rpa, hd64):
    """The 5-D cache seen as ours is a reshape (same buffer size, same bytes in order), for each layout."""
    for mod, D, dt, hkv in ((rpa, 128, jnp.bfloat16, 2), (rpa, 96, jnp.float32, 3), (hd64, 64, jnp.bfloat16, 2),
                            (rpa, 128, jnp.int8, 1)):
        shape = mod.get_kv_cache_shape(5, 16, hkv, D, dt)
        assert vt.kv_cache_shape(5, 16, hkv, D, dt) == shape
        c = jnp.asarray(np.random.default_rng(0).integers(-100, 100, shape), dt)
        view, _ = vt.kv_cache_view(c, hkv, D)
        assert view.size == c.size and np.array_equal(np.asarray(view).reshape(-1), np.asarray(c).reshape(-1))
        # K of kv head h sits at combined head 2h: the rows their merge_kv writes land there
        k = jnp.asarray(np.random.default_rng(1).integers(-9, 9, (1, hkv, D)), dt)
        v = jnp.asarray(np.random.default_rng(2).integers(-9, 9, (1, hkv, D)), dt)
        row = np.asarray(mod.merge_kv(k, v)).reshape(-1)
        vrow = np.zeros(np.prod(shape[2:]), row.dtype)
        vrow[: row.size] = row
        vrow = vrow.reshape(view.shape[2:])
        for h in range(hkv):
            assert np.array_equal(vrow[2 * h, :D], np.asarray(k)[0, h])
            assert np.array_equal(vrow[2 * h + 1, :D], np.asarray(v)[0, h])


def test_backend_through_the_registry_prefill_then_decode(rpa):
    """register() -> tpu-inference's registry -> create_attention_backend("tpukernels"); one prefill step and
    one decode step through its metadata (AttentionMetadata) vs their reference, the cache carried over."""
    from jax.sharding import Mesh
    from tpu_inference.layers.common import attention_backend as ab
    from tpu_inference.layers.common.attention_metadata import AttentionMetadata

    vt.register()
    vt.register()  # idempotent (vLLM may run plugins twice)
    backend = ab.create_attention_backend("tpukernels")
    assert backend.name == "tpukernels" and type(backend).__module__ == vt.__name__
    Hq, Hkv, D, ps, pps, P, S = 4, 2, 128, 8, 4, 16, 2
    assert backend.get_kv_cache_shape(P, ps, Hkv, D, jnp.float32) == rpa.get_kv_cache_shape(P, ps, Hkv, D, jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    # step 1: prefill 5 + 3 tokens; step 2: one decode token each (T = 8 both: padding tokens are NaN)
    pre = make_case(rpa, [5, 3], [5, 3], S=S, T=8, Hq=Hq, Hkv=Hkv, D=D, ps=ps, pps=pps, P=P, seed=21)
    kw = dict(head_dim_original=D, sm_scale=D ** -0.5, attention_chunk_size=None, q_scale=None, k_scale=None,
              v_scale=None, sinks=None, update_kv_cache=True, use_causal_mask=True, attn_logits_soft_cap=None,
              decode_query_size=1)
    cache_ours, cache_ref = pre[3], pre[3]
    steps = [pre]
    rng = np.random.default_rng(5)
    dec_q, dec_k, dec_v = (jnp.asarray(np.concatenate([rng.standard_normal((2, h, D)), np.full((6, h, D), np.nan)]),
                                       jnp.float32) for h in (Hq, Hkv, Hkv))
    steps.append((dec_q, dec_k, dec_v, None, jnp.asarray([6, 4], jnp.int32), pre[5],
                  jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([2, 2, 2], jnp.int32)))
    for q, k, v, _, kv_lens, page_indices, cu, dist in steps:
        md = AttentionMetadata(input_positions=jnp.zeros(q.shape[0], jnp.int32), block_tables=page_indices,
                               seq_lens=kv_lens, query_start_loc=cu, request_distribution=dist)
        cache_ours, out = backend.attention(cache_ours, q, k, v, md, md, mesh, **kw)
        ref_out, cache_ref = their(rpa.ref_ragged_paged_attention, q, k, v, cache_ref, kv_lens, page_indices, cu,
                                   dist, sm_scale=D ** -0.5)
        assert _same(cache_ours, cache_ref)
        _check(out, ref_out, int(cu[-1]), 2e-5)


def test_kv_write_is_in_place_when_donated(rpa):
    """Peak memory of one cache write under jax.jit (XLA's memory analysis of the compiled step): with the
    cache donated, the output aliases it and no temporary holds a cache copy; the XLA-scatter fallback
    (use_kernel=False) needs two cache-sized temporaries on this backend."""
    P, ps, Hkv, D, S, pps, T = 256, 16, 2, 128, 4, 8, 8
    cache = jnp.zeros(rpa.get_kv_cache_shape(P, ps, Hkv, D, jnp.bfloat16), jnp.bfloat16)
    k = jnp.ones((T, Hkv, D), jnp.bfloat16)
    meta = (jnp.asarray([3, 5, 0, 0], jnp.int32), jnp.arange(S * pps, dtype=jnp.int32),
            jnp.asarray([0, 3, 8, 8, 8], jnp.int32), jnp.asarray([0, 0, 2], jnp.int32))

    def analysis(use_kernel):
        step = lambda c, k, v, *m: vt.write_kv(c, k, v, *vt.metadata_view(*m), use_kernel=use_kernel)  # noqa: E731
        return jax.jit(step, donate_argnums=0).lower(cache, k, k, *meta).compile().memory_analysis()

    m = analysis(True)
    assert m.alias_size_in_bytes == cache.nbytes  # the new cache is the donated buffer
    assert m.temp_size_in_bytes < cache.nbytes // 16, m.temp_size_in_bytes  # no cache copy anywhere
    assert analysis(False).temp_size_in_bytes >= cache.nbytes  # the check can fail: a scatter copies here


def test_entry_point_is_declared():
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"tpukernels": "tpukernels.integrations.vllm_tpu:register"}


def test_vllm_backend_class_import_names_the_real_cause(monkeypatch):
    """``from vllm_tpu import TpuKernelsPallasAttentionBackend`` either gives the class or raises
    BackendUnavailableError naming why; never Python's bare "cannot import name" (a non-ImportError from the
    lazy ``__getattr__`` used to be turned into that, hiding e.g. a missing ``cbor2``)."""
    from tpukernels.errors import BackendUnavailableError

    monkeypatch.delitem(vt._CLASSES, "vllm", raising=False)
    try:
        from tpukernels.integrations.vllm_tpu import TpuKernelsPallasAttentionBackend
    except BackendUnavailableError as e:
        assert "not importable here (" in str(e) and "cannot import name" not in str(e)
    else:  # vllm's full dependency set is installed
        assert TpuKernelsPallasAttentionBackend.get_name() == "TPUKERNELS"
    # an AttributeError deep in the import chain (torchax on a newer torch) is named too
    from tpukernels.integrations import torchax_ops

    def broken():
        raise AttributeError("The underlying op of 'aten.prod' has no overload name 'dim_Dimname'")

    monkeypatch.delitem(vt._CLASSES, "vllm", raising=False)
    monkeypatch.setattr(torchax_ops, "import_torchax", broken)
    with pytest.raises(BackendUnavailableError, match="AttributeError: The underlying op of 'aten.prod'"):
        from tpukernels.integrations.vllm_tpu import TpuKernelsPallasAttentionBackend  # noqa: F401,F811


def test_bad_input_is_a_typed_error(rpa):
    args = list(make_case(rpa, [1, 3], [4, 6], S=2, T=8, Hq=4, Hkv=2, D=128, ps=4, pps=2, P=6))
    with pytest.raises(ArgumentError, match="tpu-inference's RPA v3 layout"):
        vt.ragged_paged_attention_v3(*args[:3], args[3][:, :, :1], *args[4:])  # a cache of another config
    bad = list(args)
    bad[5] = bad[5].at[2].set(99)  # sequence 1's first page
    with pytest.raises(ArgumentError, match="page_indices\\[1, 0\\] = 99"):
        vt.ragged_paged_attention_v3(*bad)
    bad = list(args)
    bad[4] = jnp.asarray([9, 6], jnp.int32)
    with pytest.raises(ArgumentError, match="kv_lens\\[0\\] = 9"):
        vt.ragged_paged_attention_v3(*bad)
    with pytest.raises(ArgumentError, match="sinks must have shape"):
        vt.ragged_paged_attention_v3(*args, jnp.zeros(3, jnp.float32))
    with pytest.raises(DTypeError, match="keys / values dtype"):
        vt.ragged_paged_attention_v3(args[0], args[1].astype(jnp.bfloat16), *args[2:])
    with pytest.raises(ArgumentError, match="use_causal_mask"):
        vt.ragged_paged_attention_v3(*args, use_causal_mask=False)


def _int8_head_scaled_case(rpa, q_lens, kv_lens, *, S, T, Hq, Hkv, D, ps, pps, P, seed):
    """An int8 cache in tpu-inference's layout quantized per (token, kv head) as JAX's paged attention does
    (``x = int8 * h / 127.5``, ``h`` the row's absmax), kv head g's values scaled by 8**g; the old tokens written
    with their ``merge_kv``, the new ones passed as keys / values; ``k_scales`` / ``v_scales`` ``[P, ps, Hkv]``
    hold every token's scale (NaN in unused slots). Also returns our ``[P, ps, 2*Hkv, D]`` int8 cache of all
    tokens (built without their layout) for the float64 reference."""
    rng = np.random.default_rng(seed)
    cache = np.zeros(rpa.get_kv_cache_shape(P, ps, Hkv, D, jnp.int8), np.int8)
    ours = np.zeros((P, ps, 2 * Hkv, D), np.int8)
    scales = np.full((2, P, ps, Hkv), np.nan, np.float32)
    pages = np.zeros((S, pps), np.int32)
    perm = rng.permutation(P)
    keys, values = np.zeros((T, Hkv, D), np.int8), np.zeros((T, Hkv, D), np.int8)
    c, t = 0, 0
    mag = 8.0 ** np.arange(Hkv)[None, :, None]
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        npg = -(-kl // ps)
        pages[s, :npg] = perm[c: c + npg]
        c += npg
        kvf = rng.standard_normal((2, kl, Hkv, D)) * mag
        h = np.abs(kvf).max(-1, keepdims=True)
        qv = np.clip(np.rint(kvf * (127.5 / h)), -128, 127).astype(np.int8)
        slot_p, slot_r = pages[s, np.arange(kl) // ps], np.arange(kl) % ps
        ours[slot_p, slot_r, 0::2], ours[slot_p, slot_r, 1::2] = qv[0], qv[1]
        scales[:, slot_p, slot_r] = (h[..., 0] / 127.5).astype(np.float32)
        old = kl - ql
        rows = np.asarray(rpa.merge_kv(jnp.asarray(qv[0, :old]), jnp.asarray(qv[1, :old])))
        cache[slot_p[:old], slot_r[:old]] = rows
        keys[t: t + ql], values[t: t + ql] = qv[0, old:], qv[1, old:]
        t += ql
    n = len(q_lens)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    q[sum(q_lens):] = np.nan
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(S - n, sum(q_lens))]).astype(np.int32)
    kvl = np.array(list(kv_lens) + [0] * (S - n), np.int32)
    n_dec = sum(1 for ql in q_lens if ql == 1)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(cache),
            jnp.asarray(kvl), jnp.asarray(pages.reshape(-1)), jnp.asarray(cu),
            jnp.asarray(np.array([n_dec, n_dec, n], np.int32)))
    return args, jnp.asarray(scales[0]), jnp.asarray(scales[1]), ours, pages


def test_int8_cache_per_head_token_scales_vs_float64(rpa):
    """Per-(token, kv head) scales through the adapter, with an odd Hkv = 3 (int8 packing 4: the cache has a
    padding kv head, whose scale column the adapter adds): output vs the float64 reference on the same int8
    values (0.01 + 2%, JAX's paged-attention tolerance, at its sm_scale = 1); the written cache holds the new
    int8 rows."""
    q_lens, kv_lens = BATCHES["mixed"]
    Hkv, Hq, D, ps, pps, P = 3, 6, 128, 8, 8, 40
    args, ks, vs, ours, pages = _int8_head_scaled_case(rpa, q_lens, kv_lens, S=6, T=32, Hq=Hq, Hkv=Hkv, D=D, ps=ps,
                                                       pps=pps, P=P, seed=13)
    out, cache = vt.ragged_paged_attention_v3(*args, sm_scale=1.0, k_scales=ks, v_scales=vs,
                                              config={"block_q": 8, "pages_per_block": 2}, interpret="tpu")
    view, hkv_pad = vt.kv_cache_view(cache, Hkv, D)
    assert hkv_pad == 4
    used = ~np.isnan(np.asarray(ks)[..., 0])
    assert np.array_equal(np.asarray(view)[:, :, : 2 * Hkv][used], ours[used])  # old + new tokens' int8 rows
    kl, pi, cu, ns = vt.metadata_view(*args[4:8])
    t = lambda x: torch.from_numpy(np.array(x))  # noqa: E731
    ref = pa.paged_attention_reference(t(args[0].astype(jnp.float32)).bfloat16(), torch.from_numpy(ours), t(kl),
                                       t(pi), t(cu), t(ns), sm_scale=1.0, k_scales=t(ks), v_scales=t(vs))
    n = sum(q_lens)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32), np.float64)[:n], ref[:n].numpy(), atol=1e-2,
                               rtol=2e-2)
    wrong = pa.paged_attention_reference(t(args[0].astype(jnp.float32)).bfloat16(), torch.from_numpy(ours), t(kl),
                                         t(pi), t(cu), t(ns), sm_scale=1.0, k_scales=t(ks)[..., 0],
                                         v_scales=t(vs)[..., 0])
    assert (wrong[:n] - ref[:n]).abs().max() > 1.0  # one scale per slot (kv head 0's) would be far off


def test_bad_scales_are_typed_errors_before_the_write(rpa):
    args = list(make_case(rpa, [1, 3], [4, 6], S=2, T=8, Hq=4, Hkv=2, D=128, ps=4, pps=2, P=6))
    ones = lambda *s: jnp.ones(s, jnp.float32)  # noqa: E731
    with pytest.raises(ArgumentError, match=r"k_scales must have shape .*\(6, 4, 2\)"):
        vt.ragged_paged_attention_v3(*args, k_scales=ones(6, 4, 3), v_scales=ones(6, 4, 2))
    with pytest.raises(ArgumentError, match="v_scales must have shape"):
        vt.ragged_paged_attention_v3(*args, k_scales=ones(6, 4), v_scales=ones(2, 6, 4))  # JAX's head-major layout
    with pytest.raises(ArgumentError, match="both k_scales and v_scales"):
        vt.ragged_paged_attention_v3(*args, k_scales=ones(6, 4))
    with pytest.raises(DTypeError, match="v_scales must be float32"):
        vt.ragged_paged_attention_v3(*args, k_scales=ones(6, 4), v_scales=ones(6, 4).astype(jnp.bfloat16))
