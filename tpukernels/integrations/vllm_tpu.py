"""tpukernels as vLLM-TPU's attention backend (tpu-inference's attention-backend registry).

Select it with ``vllm serve <model> --attention-backend tpukernels`` once tpukernels is installed with
``pip install "tpukernels[vllm]"``: vLLM runs the ``vllm.general_plugins`` entry point :func:`register` in each
process, which calls tpu-inference's ``register_attention_backend("tpukernels", ...)``
(``tpu_inference/layers/common/attention_backend.py``, tpu-inference 0.32.0).

What the backend does per attention layer (:meth:`TpuKernelsAttentionBackend.attention`, tpu-inference's
``AttentionBackend.attention`` signature):

1. the layer's new K/V tokens are written into the cache slots ``kv_len - q_len + i`` of their sequences (an
   XLA scatter into the cache; in vLLM-TPU's jitted step the cache is donated, so the write is in place);
2. attention runs with :func:`tpukernels.library.paged_attention.ragged_paged_attention_jax` on a **reshape**
   of the same cache (no copy, bit-exact: :func:`kv_cache_view`) and of the metadata
   (:func:`metadata_view`).

The same name fills tpu-inference's linear-attention slot (``LinearAttentionBackend``: the GDN layers of
Qwen3-Next / Qwen3.5) with :func:`tpukernels.integrations.vllm_tpu_gdn.fused_conv1d_gdn` (tpukernels' causal conv1d
and gated DeltaNet kernels; :mod:`tpukernels.integrations.vllm_tpu_gdn`).

Cache layouts (tpu-inference 0.32.0, ``get_kv_cache_shape`` of its RPA v3 kernels), all viewed as ours
``[P, page_size, 2*Hkv', D']`` (K of head h at combined head 2h, V at 2h+1):

* ``D != 64``: ``[P, page_size, 2*Hkv'/packing, packing, align(D, 128)]`` with ``Hkv' = align(2*Hkv,
  packing) / 2``: merging the two middle axes is our layout with ``D' = align(D, 128)`` (q is zero-padded to
  ``D'``, the padded K lanes are zero: tpu-inference's ``merge_kv`` writes them so);
* ``D == 64`` (``kernel_hd64``): ``[P, page_size, Hkv'/packing, packing, 128]`` with K in lanes 0..63 and V in
  64..127 of each head: splitting the last axis into ``(2, 64)`` is our layout with ``D' = 64``.

Padding heads (``Hkv' > Hkv`` for 8-bit caches with odd ``Hkv``) are never read: the query heads are laid
out to skip them.

Differences from tpu-inference's RPA v3 kernel: ``sinks`` work at every head dim (theirs: ``D == 64``
only); :func:`ragged_paged_attention_v3` also takes per-token scales of an int8 / fp8 cache, ``k_scales`` /
``v_scales`` ``[P, page_size]`` or per (token, kv head) ``[P, page_size, Hkv]`` (the cache layout stays
theirs); not supported, raising :class:`~tpukernels.errors.ArgumentError` before anything runs:
``use_causal_mask=False``, ``q_scale`` (their fp8 query quantization), ``update_kv_cache=False`` with new
tokens outside the cache (KV sharing: supported, the cache is then read as is), decode / prefill context
parallelism (``dcp`` / ``pcp`` mesh axes).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ArgumentError, BackendUnavailableError, DTypeError

#: the name ``--attention-backend`` selects
NAME = "tpukernels"
#: the vLLM-level backend class path tpu-inference registers for the name (built on first use: it needs
#: tpu-inference's vLLM layer, which imports torchax)
VLLM_BACKEND = "tpukernels.integrations.vllm_tpu.TpuKernelsPallasAttentionBackend"


def _packing(dtype) -> int:
    return max(1, 32 // (np.dtype(dtype).itemsize * 8))


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


# --------------------------------------------------------------------------------------------- layout maps


def kv_cache_shape(total_num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, kv_dtype) -> tuple:
    """tpu-inference's RPA v3 KV-cache shape (so vLLM-TPU allocates the cache it always does)."""
    p = _packing(kv_dtype)
    if head_dim == 64:
        return (total_num_pages, page_size, _align(num_kv_heads, p) // p, p, 128)
    return (total_num_pages, page_size, _align(2 * num_kv_heads, p) // p, p, _align(head_dim, 128))


def kv_cache_view(kv_cache, num_kv_heads: int, head_dim: int):
    """tpu-inference's 5-D RPA v3 cache as tpukernels' ``[P, page_size, 2*Hkv', D']`` (a reshape: no copy,
    bit-exact). Returns ``(view, Hkv')``.

    Raises:
        ArgumentError: the cache shape is not tpu-inference's layout for ``num_kv_heads`` / ``head_dim`` /
            its dtype (e.g. a cache allocated for another model config).
    """
    shape = tuple(int(d) for d in kv_cache.shape)
    want = kv_cache_shape(shape[0] if shape else 0, shape[1] if len(shape) > 1 else 0, num_kv_heads, head_dim,
                          kv_cache.dtype)
    if shape != want:
        raise ArgumentError(f"vllm_tpu: kv_cache has shape {shape}, but tpu-inference's RPA v3 layout for "
                            f"num_kv_heads={num_kv_heads}, head_dim={head_dim}, dtype {np.dtype(kv_cache.dtype).name} "
                            f"is {want} (a cache of another model config?)")
    P, ps, a, p, last = shape
    if head_dim == 64:  # [.., Hkv'/p, p, 128] = [.., Hkv', (K 64 | V 64)]
        return kv_cache.reshape(P, ps, 2 * a * p, 64), a * p
    return kv_cache.reshape(P, ps, a * p, last), a * p // 2


def metadata_view(kv_lens, page_indices, cu_q_lens, distribution):
    """tpu-inference's RPA metadata as tpukernels': ``page_indices`` flat ``[S * pages_per_seq]`` ->
    ``[S, pages_per_seq]``; ``distribution`` ``(decode_end, prefill_end, num_seqs)`` -> ``num_seqs [1]``
    (our kernel schedules decode, chunked-prefill and mixed sequences alike)."""
    S = int(kv_lens.shape[0])
    if int(page_indices.shape[0]) % S:
        raise ArgumentError(f"vllm_tpu: page_indices has {int(page_indices.shape[0])} entries, not a multiple of "
                            f"max_num_seqs = kv_lens.shape[0] = {S}")
    if tuple(distribution.shape) != (3,):
        raise ArgumentError(f"vllm_tpu: distribution must have shape (3,), got {tuple(distribution.shape)}")
    return kv_lens, page_indices.reshape(S, -1), cu_q_lens, distribution[2:3]


def _slot_mapping(kv_lens, page_indices2d, cu_q_lens, num_seqs, T: int, ps: int, P_total: int):
    """Cache slot of each new token (``-1``: padding): token ``t`` of sequence ``s`` goes to key position
    ``kv_len - q_len + (t - cu[s])`` (as tpu-inference's kernel writes it)."""
    import jax.numpy as jnp

    S, pps = page_indices2d.shape
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, S - 1)
    live = (t < cu_q_lens[jnp.clip(num_seqs[0], 0, S)]) & (seq < num_seqs[0])
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    page = page_indices2d[seq, jnp.clip(pos // ps, 0, pps - 1)]
    n_pages = P_total // ps
    live = live & (pos >= 0) & (pos < pps * ps) & (page >= 0) & (page < n_pages)  # never another page's slot
    return jnp.where(live, page * ps + pos % ps, -1), live


def write_kv(kv_cache, k, v, kv_lens, page_indices2d, cu_q_lens, num_seqs, *, use_kernel: bool = True):
    """Write the new tokens' K/V (``[T, Hkv, D]``, the cache's dtype) into tpu-inference's 5-D cache; returns
    the new cache. With ``use_kernel`` (default) tpukernels' ``update_kv_cache_kernel`` does it, its cache
    operand aliased to its output: in place when the caller's jit donates the cache (no cache copy; see
    tests/test_vllm_tpu.py::test_kv_write_is_in_place_when_donated); else an XLA scatter."""
    import jax.numpy as jnp

    P, ps = int(kv_cache.shape[0]), int(kv_cache.shape[1])
    T, Hkv, D = (int(d) for d in k.shape)
    p = _packing(kv_cache.dtype)
    slots, live = _slot_mapping(kv_lens, page_indices2d, cu_q_lens, num_seqs, T, ps, P * ps)
    if D == 64:
        hp = _align(Hkv, p)
        row = jnp.concatenate([k, v], axis=-1)  # [T, Hkv, 128]
        row = jnp.pad(row, ((0, 0), (0, hp - Hkv), (0, 0)))
    else:
        h2 = _align(2 * Hkv, p)
        row = jnp.stack([k, v], axis=2).reshape(T, 2 * Hkv, D)
        row = jnp.pad(row, ((0, 0), (0, h2 - 2 * Hkv), (0, _align(D, 128) - D)))
    view, _ = kv_cache_view(kv_cache, Hkv, D)
    row = row.reshape(T, *view.shape[2:]).astype(kv_cache.dtype)
    if not use_kernel:
        page = jnp.where(live, slots // ps, P)  # out of range: dropped by the scatter
        return kv_cache.at[page, slots % ps].set(row.reshape(T, *kv_cache.shape[2:]), mode="drop")
    from ..targets.jax_entry import jax_call
    from ..library.paged_attention import update_kernel

    # tpukernels' update kernel: one row DMA per token into the aliased cache (input_output_aliases), so a
    # donated cache is written in place; slots < 0 (padding, pages out of range) are skipped
    return jax_call(update_kernel, slots.astype(jnp.int32), row, view).reshape(kv_cache.shape)


def ragged_paged_attention_v3(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                              sinks=None, *, sm_scale: float = 1.0, sliding_window: int | None = None,
                              soft_cap: float | None = None, q_scale: float | None = None,
                              k_scale: float | None = None, v_scale: float | None = None,
                              update_kv_cache: bool = True, use_causal_mask: bool = True, k_scales=None,
                              v_scales=None, config=None, interpret: str | None = None):
    """tpu-inference's ``ragged_paged_attention`` (RPA v3) signature on tpukernels' kernel: returns
    ``(output [T, Hq, D], kv_cache)``; argument names and meanings are theirs (``distribution =
    (decode_end, prefill_end, num_seqs)``, flat ``page_indices``, ``sm_scale`` default 1.0).

    Args:
        queries: ``[T, Hq, D]``; keys, values: ``[T, Hkv, D]``, the cache's dtype (quantized outside, as
            theirs); kv_cache: their 5-D layout (module docstring); sinks: float32 ``[Hq]`` or None.
        k_scales, v_scales: optional float32 per-token dequantization scales of an int8 / fp8 cache (an
            extension: tpu-inference passes static ``k_scale`` / ``v_scale`` only), ``[P, page_size]`` (one
            per slot) or ``[P, page_size, Hkv]`` (one per slot and kv head, as JAX's paged attention
            quantizes); the cache keeps tpu-inference's layout. They hold every slot's scale, this call's new
            tokens' included (the caller quantizes ``keys`` / ``values`` and writes their scales, as it does
            for K/V).

    Raises:
        ArgumentError: ``use_causal_mask=False`` or ``q_scale`` (not supported); shapes that do not match
            their layout; ``k_scales`` / ``v_scales`` not ``[P, page_size]`` / ``[P, page_size, Hkv]`` or only
            one given; everything :func:`ragged_paged_attention_jax` rejects. Raised before the cache write.
        DTypeError: keys / values not the cache's dtype; scales not float32.
    """
    from ..library.paged_attention import adapter_scales, ragged_paged_attention_jax

    if not use_causal_mask:
        raise ArgumentError("vllm_tpu: use_causal_mask=False (bidirectional attention) is not supported")
    if q_scale is not None:
        raise ArgumentError("vllm_tpu: q_scale (fp8 query quantization) is not supported; pass q unquantized")
    T, Hq, D = (int(d) for d in queries.shape)
    if tuple(keys.shape) != tuple(values.shape) or len(keys.shape) != 3 or int(keys.shape[0]) != T or \
            int(keys.shape[2]) != D:
        raise ArgumentError(f"vllm_tpu: keys / values must be [T, Hkv, D] = [{T}, Hkv, {D}], got "
                            f"{tuple(keys.shape)} / {tuple(values.shape)}")
    Hkv = int(keys.shape[1])
    if Hq % Hkv:
        raise ArgumentError(f"vllm_tpu: query heads {Hq} must be a multiple of kv heads {Hkv}")
    if keys.dtype != kv_cache.dtype or values.dtype != kv_cache.dtype:
        raise DTypeError(f"vllm_tpu: keys / values dtype ({np.dtype(keys.dtype).name}, "
                         f"{np.dtype(values.dtype).name}) must be the cache's {np.dtype(kv_cache.dtype).name} "
                         f"(quantize before, as tpu-inference does)")
    view, hkv_pad = kv_cache_view(kv_cache, Hkv, D)  # validates the layout first
    k_scales, v_scales = adapter_scales(k_scales, v_scales, P=int(view.shape[0]), ps=int(view.shape[1]), Hkv=Hkv,
                                        hkv_pad=hkv_pad, where="vllm_tpu")
    kl, pi, cu, ns = metadata_view(kv_lens, page_indices, cu_q_lens, distribution)
    _check_metadata(kl, pi, cu, ns, T, view)  # before the cache write, not only before the attention
    if update_kv_cache:
        kv_cache = write_kv(kv_cache, keys, values, kl, pi, cu, ns)
        view, _ = kv_cache_view(kv_cache, Hkv, D)
    q, Dp = queries, int(view.shape[-1])
    if Dp != D:  # D = 96: the cache lanes 96..127 are zero; q's are padded with zeros (q is small)
        import jax.numpy as jnp

        q = jnp.pad(q, ((0, 0), (0, 0), (0, Dp - D)))
    q, sinks_p = _pad_heads(q, sinks, Hq, Hkv, hkv_pad)
    out = ragged_paged_attention_jax(q, view, kl, pi, cu, ns, sm_scale=sm_scale, sliding_window=sliding_window,
                                     soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, sinks=sinks_p,
                                     k_scales=k_scales, v_scales=v_scales, config=config, interpret=interpret)
    r = Hq // Hkv
    if hkv_pad != Hkv:
        out = out[:, : Hkv * r]
    return out[..., :D], kv_cache


def _check_metadata(kl, pi, cu, ns, T: int, view) -> None:
    import jax

    from ..library.paged_attention import _check_value_arrays

    where = "tpukernels::vllm_tpu"
    for name, t in (("kv_lens", kl), ("page_indices", pi), ("cu_q_lens", cu), ("distribution", ns)):
        if np.dtype(t.dtype) != np.int32:
            raise DTypeError(f"{where}: {name} must be int32, got {np.dtype(t.dtype).name}")
    if not any(isinstance(t, jax.core.Tracer) for t in (kl, pi, cu, ns)):
        _check_value_arrays(*(np.asarray(t) for t in (kl, pi, cu, ns)), T=T, P=int(view.shape[0]),
                            ps=int(view.shape[1]), where=where)


def _pad_heads(q, sinks, Hq: int, Hkv: int, hkv_pad: int):
    """Extra query heads for the cache's padding kv heads (their outputs are dropped)."""
    if hkv_pad == Hkv:
        return q, sinks
    import jax.numpy as jnp

    r = Hq // Hkv
    q = jnp.pad(q, ((0, 0), (0, (hkv_pad - Hkv) * r), (0, 0)))
    if sinks is not None:
        sinks = jnp.pad(sinks, (0, (hkv_pad - Hkv) * r))
    return q, sinks


# --------------------------------------------------------------------------------------------- the backend


def _backend_base():
    try:
        from tpu_inference.layers.common.attention_backend import AttentionBackend
    except ImportError as e:
        raise BackendUnavailableError(f"vllm_tpu: tpu-inference is not importable ({e}); install it with "
                                      f"pip install 'tpukernels[vllm]'") from e
    return AttentionBackend


def _make_backend_class():
    base = _backend_base()

    class TpuKernelsAttentionBackend(base):
        """tpu-inference ``AttentionBackend`` running tpukernels' ragged paged attention."""

        name = NAME

        def get_kv_cache_shape(self, total_num_pages, page_size, num_kv_heads, head_dim, kv_dtype):
            return kv_cache_shape(total_num_pages, page_size, num_kv_heads, head_dim, kv_dtype)

        def attention(self, kv_cache, q, k, v, md, shared_md, mesh, *, head_dim_original, sm_scale,
                      attention_chunk_size, q_scale, k_scale, v_scale, sinks, update_kv_cache, use_causal_mask,
                      attn_logits_soft_cap, decode_query_size):
            del head_dim_original, decode_query_size
            for axis in ("dcp", "pcp"):
                if axis in mesh.shape and mesh.shape[axis] > 1:
                    raise ArgumentError(f"vllm_tpu: {axis} (context parallelism) is not supported by the "
                                        f"tpukernels backend; use --attention-backend rpa")
            args = (q, k, v, kv_cache, shared_md.seq_lens, md.block_tables, shared_md.query_start_loc,
                    shared_md.request_distribution, sinks)
            kw = dict(sm_scale=sm_scale, sliding_window=attention_chunk_size, soft_cap=attn_logits_soft_cap,
                      q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, update_kv_cache=update_kv_cache,
                      use_causal_mask=use_causal_mask)
            if math.prod(mesh.devices.shape) == 1:
                out, kv_cache = ragged_paged_attention_v3(*args, **kw)
            else:
                out, kv_cache = _sharded(mesh, args, kw)
            return kv_cache, out

    return TpuKernelsAttentionBackend


def _sharded(mesh, args, kw):
    """Over kv heads, as tpu-inference's ``sharded_ragged_paged_attention`` (metadata per data shard)."""
    import jax
    from jax.sharding import PartitionSpec as P
    from tpu_inference.layers.common.sharding import ShardingAxisName

    qkv = P(ShardingAxisName.ATTN_DATA, ShardingAxisName.ATTN_HEAD, None)
    cache = P(ShardingAxisName.ATTN_DATA, None, ShardingAxisName.ATTN_HEAD, None, None)
    meta = P(ShardingAxisName.ATTN_DATA)
    sinks = args[-1]
    in_specs = (qkv, qkv, qkv, cache, meta, meta, meta, meta) + ((P(ShardingAxisName.ATTN_HEAD),) if sinks is not None
                                                                 else ())
    run = (lambda *a: ragged_paged_attention_v3(*a, **kw)) if sinks is not None else \
        (lambda *a: ragged_paged_attention_v3(*a, None, **kw))
    call_args = args if sinks is not None else args[:-1]
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=(qkv, cache), check_vma=False)(*call_args)


_CLASSES: dict = {}


def backend_class():
    """The ``AttentionBackend`` subclass (built once; needs tpu-inference importable)."""
    if "backend" not in _CLASSES:
        _CLASSES["backend"] = _make_backend_class()
    return _CLASSES["backend"]


def _make_vllm_backend():
    """vLLM-level classes tpu-inference's platform hands to attention layers: a ``PallasAttentionBackend``
    whose impl names this backend. Importing tpu-inference's vLLM layer needs torchax (a TPU host)."""
    from . import torchax_ops

    try:
        torchax_ops.import_torchax()  # torchax 0.0.13 fails a plain import on torch 2.13: the shimmed import
        from tpu_inference.layers.vllm.backends.flash_attn import PallasAttentionBackend, PallasAttentionBackendImpl
    except Exception as e:  # noqa: BLE001 - any failure (a missing module deep in vllm, an AttributeError)
        # is named as it is: a plain AttributeError here would make `from ... import` report only
        # "cannot import name", hiding the cause
        raise BackendUnavailableError(f"vllm_tpu: tpu-inference's vLLM attention layer is not importable here "
                                      f"({type(e).__name__}: {e}); it needs torchax and vllm-tpu (TPU hosts)") from e

    class TpuKernelsPallasAttentionBackendImpl(PallasAttentionBackendImpl):
        attention_backend = NAME

    class TpuKernelsPallasAttentionBackend(PallasAttentionBackend):
        @staticmethod
        def get_name() -> str:
            return NAME.upper()

        @staticmethod
        def get_impl_cls():
            return TpuKernelsPallasAttentionBackendImpl

    return TpuKernelsPallasAttentionBackend


def __getattr__(name: str):
    if name == "TpuKernelsAttentionBackend":
        return backend_class()
    if name == "TpuKernelsPallasAttentionBackend":
        if "vllm" not in _CLASSES:
            _CLASSES["vllm"] = _make_vllm_backend()
        return _CLASSES["vllm"]
    raise AttributeError(name)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``--attention-backend tpukernels`` select this backend
    for the attention layers and :class:`~tpukernels.integrations.vllm_tpu_gdn.TpuKernelsLinearAttentionBackend`
    (tpukernels' causal conv1d + gated DeltaNet) for the GDN linear-attention layers of hybrid models; with
    ``TPUKERNELS_VLLM_MLA=1``, also tpukernels' MLA kernel for MLA layers
    (:func:`tpukernels.integrations.vllm_tpu_mla.register`). Idempotent: vLLM may run plugins more than once
    per process.

    Raises:
        BackendUnavailableError: tpu-inference (or vllm) is not importable.
    """
    try:
        from tpu_inference.layers.common.attention_backend import register_attention_backend
    except ImportError as e:
        raise BackendUnavailableError(f"vllm_tpu: tpu-inference is not importable ({e}); install it with "
                                      f"pip install 'tpukernels[vllm]'") from e
    from .vllm_tpu_gdn import linear_backend_class

    register_attention_backend(NAME, attention=backend_class(), vllm_backend=VLLM_BACKEND,
                               linear_attention=linear_backend_class())
    from . import vllm_tpu_mla

    vllm_tpu_mla.register()  # MLA layers: only with TPUKERNELS_VLLM_MLA=1 (tpu-inference's registry has no MLA slot)


__all__ = ["NAME", "VLLM_BACKEND", "register", "backend_class", "kv_cache_shape", "kv_cache_view", "metadata_view",
           "write_kv", "ragged_paged_attention_v3"]
