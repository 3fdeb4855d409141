"""tpukernels' MLA kernel as vLLM-TPU's attention for MLA models (DeepSeek-V2/V3/R1, Kimi-K2): the latent-cache
ragged paged attention of :func:`tpukernels.library.mla_attention.mla_ragged_paged_attention_jax` on
tpu-inference 0.32.0's own MLA cache, metadata and layer weights.

How it is selected. tpu-inference's attention-backend registry (the one ``--attention-backend tpukernels``
uses, :mod:`tpukernels.integrations.vllm_tpu`) has no MLA slot in 0.32.0: its platform raises
``--attention-backend X does not support MLA models`` for a registered backend and always gives MLA layers
vLLM's ``FLASH_ATTN_MLA`` backend. So the MLA path goes through vLLM's own extension point instead:
:func:`register` (run by the same ``vllm.general_plugins`` entry point) calls
``vllm.v1.attention.backends.registry.register_backend(AttentionBackendEnum.FLASH_ATTN_MLA, VLLM_MLA_BACKEND)``
when ``TPUKERNELS_VLLM_MLA=1`` is set, so MLA layers build :class:`TpuKernelsMLABackend`'s impl. Opt-in,
because the plugin runs in every vLLM process where tpukernels is installed.

What the impl does per MLA layer (the steps of tpu-inference's ``PallasMLAttentionBackendImpl.forward``, with
our kernel in the middle): ``ql_nope = q_nope @ W_UK`` per head (token-major ``[T, H, L]``, the layout our
kernel takes; theirs is head-major), then :func:`mla_attention` (cache write + attention), then ``out @ W_UV``
per head. A quantized latent cache (``layer.kv_cache_quantized_dtype``: fp8) stores ``kv_c`` / ``k_pe``
quantized with the layer's static ``k_scale`` (tpu-inference's ``quantize_kv``); the query stays bf16 (our
kernel takes no fp8 query: tpu-inference's optional fp8 query quantization is not done, so ``q_scale`` is
unused).

Cache and metadata (no copies): tpu-inference's MLA v2 cache ``[P, page_size / packing, packing,
align(L, 128) + align(R, 128)]`` is viewed as ``[P, page_size, W]`` (merging the two middle axes keeps token
order), which our kernel reads as is (k_pe's pad lanes are never read); ``md.block_tables`` (flattened
``[S * pages_per_seq]``) as ``[S, pages_per_seq]``; ``md.request_distribution[2]`` is the sequence count.
Not supported (``ArgumentError`` before anything runs): ``MLA_TRANSPOSE_KV_CACHE`` (the ``[P, W, page_size]``
cache), integer caches.

Functional: the updated cache is returned (vLLM-TPU donates it in its jitted step, so XLA writes in place).
Sharding: the same ``shard_map`` specs as tpu-inference's ``attention_interface.mla_attention`` (tokens over
``MLP_TENSOR``, the cache over ``BATCH``, metadata over ``ATTN_DATA``).
"""

from __future__ import annotations

import os

from ..errors import ArgumentError, BackendUnavailableError

#: the class path vLLM's FLASH_ATTN_MLA resolves to after :func:`register` (with ``TPUKERNELS_VLLM_MLA=1``)
VLLM_MLA_BACKEND = "tpukernels.integrations.vllm_tpu_mla.TpuKernelsMLABackend"
#: the environment variable that opts MLA layers in
ENV = "TPUKERNELS_VLLM_MLA"

_CLASSES: dict = {}


def cache_view(kv_cache):
    """tpu-inference's MLA v2 cache ``[P, page_size / packing, packing, W]`` as ``[P, page_size, W]`` (a
    reshape: no copy, bit-exact).

    Raises:
        ArgumentError: a cache of another rank (the transposed ``[P, W, page_size]`` layout included).
    """
    if len(kv_cache.shape) != 4:
        raise ArgumentError(f"vllm_tpu_mla: kv_cache must be tpu-inference's MLA v2 cache [num_pages, page_size / "
                            f"packing, packing, align(L, 128) + align(R, 128)], got shape {tuple(kv_cache.shape)} "
                            f"(MLA_TRANSPOSE_KV_CACHE's [P, W, page_size] layout is not supported)")
    P, pp, pk, W = (int(d) for d in kv_cache.shape)
    return kv_cache.reshape(P, pp * pk, W)


def mla_attention(ql_nope, q_pe, kv_c, k_pe, kv_cache, md, mesh=None, *, sm_scale: float, k_scale=None,
                  v_scale=None, config=None, interpret=None):
    """The MLA attention of one layer on tpu-inference's cache and metadata, with tpukernels' kernel.

    Args:
        ql_nope: ``[T, H, L]`` absorbed queries (``q_nope @ W_UK``), bf16/f32. q_pe: ``[T, H, R]`` rotated.
        kv_c: ``[T, L]`` this step's latents, k_pe: ``[T, R]`` rotated rope keys, in the cache's dtype.
        kv_cache: tpu-inference's MLA v2 cache ``[P, page_size / packing, packing, W]``.
        md: tpu-inference's ``AttentionMetadata`` (``seq_lens``, ``block_tables``, ``query_start_loc``,
            ``request_distribution``).
        mesh: a ``jax.sharding.Mesh`` to ``shard_map`` over with tpu-inference's MLA specs, or None (one device).
        sm_scale: the softmax scale. k_scale / v_scale: static dequantization scales of an fp8 cache.

    Returns:
        ``(new kv_cache in tpu-inference's layout, out [T, H, L] in ql_nope's dtype)``.

    Raises:
        ArgumentError / DTypeError: the checks of ``mla_ragged_paged_attention_jax`` and :func:`cache_view`.
    """
    import jax

    from ..library.mla_attention import mla_ragged_paged_attention_jax

    def run(q, qpe, c, kpe, cache, kv_lens, block_tables, cu_q_lens, distribution):
        view = cache_view(cache)
        S = int(kv_lens.shape[0])
        out, new = mla_ragged_paged_attention_jax(
            q, qpe, c, kpe, view, kv_lens, block_tables.reshape(S, -1), cu_q_lens, distribution[2:3],
            sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, config=config, interpret=interpret)
        return new.reshape(cache.shape), out

    args = (ql_nope, q_pe, kv_c, k_pe, kv_cache, md.seq_lens, md.block_tables, md.query_start_loc,
            md.request_distribution)
    if mesh is None:
        cache_view(kv_cache)  # the layout error before anything traces
        return run(*args)
    from jax.sharding import PartitionSpec as P
    from tpu_inference.layers.common.sharding import ShardingAxisName as A

    tok = P(A.MLP_TENSOR, None, None)
    in_specs = (tok, tok, P(A.MLP_TENSOR, None), P(A.MLP_TENSOR, None), P(A.BATCH)) + (P(A.ATTN_DATA),) * 4
    cache_view(kv_cache)
    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=(P(A.BATCH), tok),
                                 check_vma=False))(*args)


def absorbed_forward(q_nope, q_pe, kv_c, k_pe, kv_cache, md, mesh=None, *, w_uk_t, w_uv, sm_scale: float,
                     w_uk_t_scale=1.0, w_uv_scale=1.0, kv_quant_dtype=None, k_scale=None, v_scale=None,
                     interpret=None):
    """One MLA layer's attention in vLLM-TPU's terms (what :class:`TpuKernelsMLABackendImpl.forward` runs, on
    jax arrays): ``ql_nope = q_nope @ W_UK`` per head, :func:`mla_attention`, ``out @ W_UV`` per head.

    Args:
        q_nope: ``[T, H, qk_nope_head_dim]``, q_pe: ``[T, H, R]`` (rotated), kv_c: ``[T, L]`` (normed latents),
            k_pe: ``[T, R]`` or ``[T, 1, R]`` (rotated); bf16/f32.
        kv_cache, md, mesh: as :func:`mla_attention`.
        w_uk_t: ``[H, qk_nope_head_dim, L]`` (vLLM's ``W_UK_T``), w_uv: ``[H, L, v_head_dim]`` (``W_UV``), with
            their scales (1 for unquantized weights).
        kv_quant_dtype / k_scale / v_scale: an fp8 latent cache: kv_c and k_pe are quantized with ``k_scale``
            (tpu-inference's ``quantize_kv``) before the write.

    Returns:
        ``(new kv_cache, out [T, H * v_head_dim] in q_nope's dtype)``.
    """
    import jax.numpy as jnp

    dtype = q_nope.dtype
    ql = jnp.einsum("tnp,npl->tnl", q_nope, w_uk_t, preferred_element_type=jnp.float32)
    ql = (ql * w_uk_t_scale).astype(dtype)
    k_pe = k_pe.reshape(k_pe.shape[0], -1)  # [T, 1, R] -> [T, R]
    if kv_quant_dtype is not None:
        from tpu_inference.layers.common.quantization import quantize_kv

        kv_c, _ = quantize_kv(kv_quant_dtype, kv_c, value=None, k_scale=k_scale)
        k_pe, _ = quantize_kv(kv_quant_dtype, k_pe, value=None, k_scale=k_scale)
    new_cache, out = mla_attention(ql, q_pe.astype(dtype), kv_c, k_pe, kv_cache, md, mesh, sm_scale=sm_scale,
                                   k_scale=k_scale, v_scale=v_scale, interpret=interpret)
    out = (jnp.einsum("tnl,nlv->tnv", out, w_uv, preferred_element_type=jnp.float32) * w_uv_scale).astype(dtype)
    return new_cache, out.reshape(out.shape[0], -1)


def _make_classes():
    """vLLM-level classes: tpu-inference's ``PallasMLAttentionBackend`` whose impl runs :func:`mla_attention`.
    Importing tpu-inference's vLLM layer needs torchax (a TPU host)."""
    from . import torchax_ops

    try:
        torchax_ops.import_torchax()  # torchax 0.0.13 fails a plain import on torch 2.13: the shimmed import
        from torchax.interop import jax_view, torch_view
        from tpu_inference import envs
        from tpu_inference.layers.vllm.backends.flash_attn_mla import (PallasMLAttentionBackend,
                                                                       PallasMLAttentionBackendImpl)
    except Exception as e:  # noqa: BLE001 - named as it is (see vllm_tpu._make_vllm_backend)
        raise BackendUnavailableError(f"vllm_tpu_mla: tpu-inference's vLLM MLA layer is not importable here "
                                      f"({type(e).__name__}: {e}); it needs torchax and vllm-tpu (TPU hosts)") from e

    class TpuKernelsMLABackendImpl(PallasMLAttentionBackendImpl):
        """``PallasMLAttentionBackendImpl`` with tpukernels' MLA kernel (module docstring)."""

        def forward(self, q, kv_c_normed, k_pe, kv_cache, attn_metadata, mesh, layer, output=None, **kwargs):
            if getattr(envs, "MLA_TRANSPOSE_KV_CACHE", False):
                raise ArgumentError("vllm_tpu_mla: MLA_TRANSPOSE_KV_CACHE ([P, W, page_size] cache) is not "
                                    "supported by tpukernels' MLA kernel; unset it")
            quant = layer.kv_cache_quantized_dtype or None
            new_cache, out = absorbed_forward(
                jax_view(q[0]), jax_view(q[1]), jax_view(kv_c_normed), jax_view(k_pe), kv_cache, attn_metadata,
                mesh, w_uk_t=jax_view(layer.W_UK_T), w_uv=jax_view(layer.W_UV), sm_scale=self.scale,
                w_uk_t_scale=jax_view(layer.W_UK_T_scale), w_uv_scale=jax_view(layer.W_UV_scale),
                kv_quant_dtype=quant, k_scale=layer._k_scale_float if quant else None,
                v_scale=layer._v_scale_float if quant else None)
            out = torch_view(out)
            if output is not None:
                output.copy_(out)
            return out, new_cache

    class TpuKernelsMLABackend(PallasMLAttentionBackend):
        @staticmethod
        def get_impl_cls():
            return TpuKernelsMLABackendImpl

    return TpuKernelsMLABackend, TpuKernelsMLABackendImpl


def __getattr__(name: str):
    if name in ("TpuKernelsMLABackend", "TpuKernelsMLABackendImpl"):
        if "classes" not in _CLASSES:
            _CLASSES["classes"] = _make_classes()
        return _CLASSES["classes"][name == "TpuKernelsMLABackendImpl"]
    raise AttributeError(name)


def register() -> bool:
    """With ``TPUKERNELS_VLLM_MLA=1``: point vLLM's ``FLASH_ATTN_MLA`` backend at :data:`VLLM_MLA_BACKEND`
    (after importing tpu-inference's backends, whose decorator registers theirs, so ours is the last word).
    Without it: nothing. Returns whether it registered. Called by :func:`tpukernels.integrations.vllm_tpu.register`.

    Raises:
        BackendUnavailableError: opted in but vllm / tpu-inference's backends are not importable.
    """
    if os.environ.get(ENV, "") not in ("1", "true", "True"):
        return False
    from . import torchax_ops

    try:
        torchax_ops.import_torchax()  # tpu-inference's vLLM backends import torchax (shimmed on torch 2.13)
        import tpu_inference.layers.vllm.backends  # noqa: F401 - its FLASH_ATTN_MLA registration runs first
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except Exception as e:  # noqa: BLE001
        raise BackendUnavailableError(f"vllm_tpu_mla: {ENV}=1 but tpu-inference's vLLM backends are not importable "
                                      f"({type(e).__name__}: {e})") from e
    register_backend(AttentionBackendEnum.FLASH_ATTN_MLA, VLLM_MLA_BACKEND)
    return True


__all__ = ["VLLM_MLA_BACKEND", "ENV", "cache_view", "mla_attention", "absorbed_forward", "register"]
