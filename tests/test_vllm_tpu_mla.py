"""tpukernels' MLA kernel as vLLM-TPU's MLA attention (tpukernels.integrations.vllm_tpu_mla): on tpu-inference
0.32.0's own MLA cache layout and AttentionMetadata, against tpu-inference's MLA reference
(``ref_mla_ragged_paged_attention``) on ragged batches with NaN in unused pages; the vLLM impl end to end (W_UK
/ W_UV absorbed) against the float64 unabsorbed MLA formula; the opt-in registration through vLLM's
``register_backend``."""

from __future__ import annotations

import numpy as np
import pytest

tpu_inference = pytest.importorskip("tpu_inference", reason="tpu-inference 0.32.0 (make test installs it --no-deps)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpukernels.errors import ArgumentError  # noqa: E402
from tpukernels.integrations import vllm_tpu_mla as vm  # noqa: E402

L, R = 128, 64  # kv_lora_rank, rope dim (DeepSeek: 512, 64)


def _md(kv_lens, q_lens, pages, pps):
    from tpu_inference.layers.common.attention_metadata import AttentionMetadata

    S = len(kv_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return AttentionMetadata(input_positions=jnp.zeros((int(cu[-1]),), jnp.int32),
                             block_tables=jnp.asarray(np.asarray(pages, np.int32).reshape(-1)),
                             seq_lens=jnp.asarray(np.asarray(kv_lens, np.int32)),
                             query_start_loc=jnp.asarray(cu), request_distribution=jnp.asarray([0, 0, S], jnp.int32))


def _batch(dtype, seed, q_lens=(1, 5, 3), kv_lens=(9, 5, 11), H=4, ps=8, pps=2, P=10):
    """A ragged batch on tpu-inference's MLA v2 cache ``[P, ps / packing, packing, align(L) + align(R)]``; pages no
    sequence owns are NaN (and so is every pad lane)."""
    from tpu_inference.kernels.mla.v1.kernel import get_kv_cache_shape

    rng = np.random.default_rng(seed)
    T = sum(q_lens)
    shape = get_kv_cache_shape(P, ps, L + R, dtype)
    cache = np.full(shape, np.nan, np.float32)
    pages = rng.permutation(P)[: len(kv_lens) * pps].reshape(len(kv_lens), pps)
    flat = cache.reshape(P, ps, -1)
    for s, kl in enumerate(kv_lens):  # cached tokens before this step's: real values in lanes [0, L + R)
        for pos in range(kl - q_lens[s]):
            flat[pages[s, pos // ps], pos % ps, :L + R] = rng.standard_normal(L + R)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.5, dtype)  # noqa: E731
    return dict(ql=arr(T, H, L), qpe=arr(T, H, R), c=arr(T, L), kpe=arr(T, R),
                cache=jnp.asarray(flat.reshape(shape), dtype), md=_md(kv_lens, q_lens, pages, pps), T=T)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32-packing1", "bf16-packing2"])
def test_matches_tpu_inference_reference_on_its_cache_layout(dtype):
    from tpu_inference.kernels.mla.v1.kernel import ref_mla_ragged_paged_attention

    b = _batch(dtype, seed=3)
    md = b["md"]
    new_cache, out = vm.mla_attention(b["ql"], b["qpe"], b["c"], b["kpe"], b["cache"], md, sm_scale=0.09,
                                      interpret="tpu")
    ref_cache = jnp.where(jnp.isnan(b["cache"]), 0, b["cache"])  # its reference multiplies NaN pages by 0
    ref, ref_new = ref_mla_ragged_paged_attention(b["ql"], b["qpe"], b["c"], b["kpe"], ref_cache, md.seq_lens,
                                                  md.block_tables, md.query_start_loc, md.request_distribution,
                                                  sm_scale=0.09)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32).reshape(out.shape)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert not np.isnan(out).any() and np.abs(out - ref).max() <= tol * np.abs(ref).max()
    assert new_cache.shape == b["cache"].shape and new_cache.dtype == b["cache"].dtype
    got, want = np.asarray(new_cache, np.float32), np.asarray(ref_new, np.float32)
    written = ~np.isnan(got) & np.isnan(np.asarray(b["cache"], np.float32))
    assert written.any() and np.array_equal(got[written], want[written])  # this step's latents, as theirs
    keep = ~np.isnan(np.asarray(b["cache"], np.float32))
    assert np.array_equal(got[keep], np.asarray(b["cache"], np.float32)[keep])  # nothing else touched


def test_bad_layouts_raise_before_any_kernel():
    b = _batch(jnp.float32, seed=4)
    flat = b["cache"].reshape(b["cache"].shape[0], -1, b["cache"].shape[-1])
    with pytest.raises(ArgumentError, match="MLA v2 cache"):
        vm.mla_attention(b["ql"], b["qpe"], b["c"], b["kpe"], flat, b["md"], sm_scale=0.1)
    narrow = b["cache"][..., : L + R - 8]
    with pytest.raises(ArgumentError, match="cache_kv last dim"):
        vm.mla_attention(b["ql"], b["qpe"], b["c"], b["kpe"], narrow, b["md"], sm_scale=0.1)


def test_registration_is_opt_in(monkeypatch):
    """Without TPUKERNELS_VLLM_MLA nothing changes; with it, vLLM's FLASH_ATTN_MLA resolves to ours (registered
    after tpu-inference's backends import, stubbed here: vllm's full dependency set is not installed)."""
    import sys
    import types

    reg = pytest.importorskip("vllm.v1.attention.backends.registry")
    enum = reg.AttentionBackendEnum.FLASH_ATTN_MLA
    monkeypatch.delenv(vm.ENV, raising=False)
    before = enum.get_path()
    assert vm.register() is False and enum.get_path() == before
    monkeypatch.setenv(vm.ENV, "1")
    monkeypatch.setitem(sys.modules, "tpu_inference.layers.vllm.backends", types.ModuleType("backends"))
    try:
        assert vm.register() is True and enum.get_path() == vm.VLLM_MLA_BACKEND
    finally:
        enum.clear_override()
    assert enum.get_path() == before


def test_vllm_mla_classes_import_or_name_the_cause():
    from tpukernels.errors import BackendUnavailableError

    try:
        cls = vm.TpuKernelsMLABackend
    except BackendUnavailableError as e:  # vllm installed --no-deps here: its config module needs cbor2, zmq
        assert "not importable here (" in str(e)
    else:
        assert cls.get_impl_cls() is vm.TpuKernelsMLABackendImpl


def test_absorbed_forward_matches_unabsorbed_mla_float64():
    """What the vLLM impl runs, with a layer's W_UK_T / W_UV: equals the unabsorbed formula
    ``softmax(q_nope k_nope^T + q_pe k_pe^T) v`` with ``k_nope = c W_UK``, ``v = c W_UV``, in float64 from the
    same inputs, over the latents as the written cache holds them."""
    H, Pn, V = 4, 32, 48  # heads, qk_nope_head_dim, v_head_dim
    b = _batch(jnp.float32, seed=5, q_lens=(1, 4), kv_lens=(7, 4))
    rng = np.random.default_rng(0)
    T = b["T"]
    q_nope = rng.standard_normal((T, H, Pn)).astype(np.float32)
    w_uk = (rng.standard_normal((H, Pn, L)) / Pn ** 0.5).astype(np.float32)  # W_UK_T
    w_uv = (rng.standard_normal((H, L, V)) / L ** 0.5).astype(np.float32)
    new_cache, out = vm.absorbed_forward(jnp.asarray(q_nope), b["qpe"], b["c"], b["kpe"][:, None, :], b["cache"],
                                         b["md"], w_uk_t=jnp.asarray(w_uk), w_uv=jnp.asarray(w_uv), sm_scale=0.11,
                                         interpret="tpu")
    assert out.shape == (T, H * V)
    flat = np.asarray(new_cache, np.float64).reshape(new_cache.shape[0], -1, new_cache.shape[-1])
    ps = flat.shape[1]
    pages = np.asarray(b["md"].block_tables).reshape(2, -1)
    cu = np.asarray(b["md"].query_start_loc)
    q_pe = np.asarray(b["qpe"], np.float64)
    ref = np.zeros((T, H, V))
    for s, kl in enumerate(np.asarray(b["md"].seq_lens)):
        lat = np.stack([flat[pages[s, p // ps], p % ps] for p in range(kl)])
        c_s, kpe_s = lat[:, :L], lat[:, L:L + R]
        k_nope = np.einsum("jl,hpl->jhp", c_s, w_uk.astype(np.float64))
        v = np.einsum("jl,hlv->jhv", c_s, w_uv.astype(np.float64))
        q0, q1 = int(cu[s]), int(cu[s + 1])
        logits = (np.einsum("ihp,jhp->hij", q_nope[q0:q1].astype(np.float64), k_nope)
                  + np.einsum("ihr,jr->hij", q_pe[q0:q1], kpe_s)) * 0.11
        pos = kl - (q1 - q0) + np.arange(q1 - q0)[:, None]
        logits = np.where(np.arange(kl)[None, :] > pos, -np.inf, logits)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        ref[q0:q1] = np.einsum("hij,jhv->ihv", p / p.sum(-1, keepdims=True), v)
    got = np.asarray(out, np.float64).reshape(T, H, V)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
