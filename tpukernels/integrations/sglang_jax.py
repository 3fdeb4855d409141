"""tpukernels as an sglang-jax attention backend (SGLang's JAX/TPU runtime).

Mirrors sglang-jax's ``FlashAttention`` backend (``python/sgl_jax/srt/layers/attention/flashattention_backend.py``)
and its RPA v3 kernel entry (``python/sgl_jax/srt/kernels/ragged_paged_attention/ragged_paged_attention_v3.py::
ragged_paged_attention``), sglang-jax commit ``cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176`` (2026-08-21, after tag
v0.0.3rc98): same argument names, same KV-cache layout, same metadata; attention runs with
:func:`tpukernels.library.paged_attention.ragged_paged_attention_jax`.

sglang-jax needs Python >= 3.12, so this module never imports it except in :func:`backend_class` /
:func:`install` (``BackendUnavailableError`` when it is missing); everything else works on jax arrays.

Selecting it. sglang-jax has no attention-backend registry or plugin entry point: ``ModelRunner.
_get_attention_backend`` picks a class from ``--attention-backend`` (``fa``, ``fa_mha``, ``native``,
``dsa_sparse``; argparse ``choices``), importing ``FlashAttention`` from its module at call time. So the swap is
one line, :func:`install`, run in every process that builds a model runner. sglang-jax starts its scheduler
processes with ``multiprocessing`` "spawn", which re-imports the launching script (as ``__mp_main__``) in each
child, so a launcher whose top level calls it covers them (not verified here: no Python 3.12)::

    # serve_tpukernels.py; run: python serve_tpukernels.py --model-path ... --device tpu --attention-backend fa
    import tpukernels.integrations.sglang_jax as tk_sgl
    tk_sgl.install(max_context_len=8192)
    if __name__ == "__main__":
        from sgl_jax.launch_server import main
        main()

:func:`install` replaces ``sgl_jax.srt.layers.attention.flashattention_backend.FlashAttention`` by
:func:`backend_class` (a subclass of their ``FlashAttention`` that keeps their host-side metadata builders,
speculative-decoding ones included, and overrides only ``__call__``).

KV cache (sglang-jax ``MHATokenToKVPool`` / ``get_kv_cache_shape``): one fused buffer per layer
``[P, page_size, align(2*Hkv, packing) // packing, packing, align(D, 128)]``, K and V of kv head ``h``
interleaved at combined heads ``2h`` and ``2h + 1`` (their ``merge_kv``; head dims below a multiple of 128 are
zero-padded). Merging the two middle axes is tpukernels' ``[P, page_size, 2*Hkv', D']`` layout: a reshape, no
copy, bit-exact (:func:`kv_cache_view`). Padding heads (``Hkv' > Hkv``, 8-bit caches with odd ``Hkv``) are
never read.

Metadata (``FlashAttentionMetadata``): ``seq_lens`` (= ``kv_lens``, new tokens included), flat
``page_indices`` where sequence ``s``'s pages start at ``cdiv(cu_kv_lens[s], page_size)`` (ragged: each
sequence holds ``cdiv(kv_len, page_size)`` entries, not a fixed ``pages_per_seq``), ``cu_q_lens``,
``cu_kv_lens`` (cumsum of page-aligned ``seq_lens``), ``distribution = (decode_end, prefill_end, num_seqs)``.
:func:`metadata_view` gathers the flat list into tpukernels' ``page_indices [S, pages_per_seq]`` (a small int32
gather of the page table; the cache is never copied). ``pages_per_seq`` must be static: pass it (or
``max_context_len`` to the backend / :func:`install`); otherwise it is the smallest power of two that holds the
longest sequence when the metadata is concrete, and the flat length (always enough, but ``S`` times the page
table) when it is traced.

Per layer, as their kernel does: the new tokens' K/V are written into the cache at key positions
``kv_len - q_len + i`` of their sequences (tpukernels' ``update_kv_cache_kernel``, its cache operand aliased to
its output: in place when the step donates the cache), then attention reads the cache.

Beyond theirs: :func:`ragged_paged_attention` also takes per-token scales of an int8 / fp8 cache, ``k_scales`` /
``v_scales`` ``[P, page_size]`` or per (token, kv head) ``[P, page_size, Hkv]`` (the fused cache layout stays
theirs).

Semantics differences and what raises :class:`~tpukernels.errors.ArgumentError` before anything runs:
``causal=0`` / ``custom_mask`` (speculative-decoding tree masks and encoder-only layers),
``xai_temperature_len`` (Grok), ``q_scale``, ``mask_value`` above ``-1e9`` (tpukernels excludes masked keys
exactly; theirs adds ``mask_value``: identical for any very negative value), ``softmax_dtype`` narrower than
float32 (tpukernels' softmax is float32). Multi-device meshes go through their ``shard_map`` specs (kv heads
over ``"tensor"``, sequences over ``"data"``): tensor parallelism is checked on 2 host CPU devices
(``tests/test_sglang_jax.py::test_tensor_parallel_shard_map_two_cpu_devices``, slow); data parallelism
(``dp_size > 1``, per-rank metadata sections) is not verified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ArgumentError, BackendUnavailableError, DTypeError

#: sglang-jax commit this module mirrors
SGLANG_JAX_COMMIT = "cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176"
#: their kernel's default additive mask value
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_WHERE = "sglang_jax"


def _packing(dtype) -> int:
    return max(1, 32 // (np.dtype(dtype).itemsize * 8))


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _is_tracer(*xs) -> bool:
    import jax

    return any(isinstance(x, jax.core.Tracer) for x in xs)


# --------------------------------------------------------------------------------------------- layout maps


def get_kv_cache_shape(total_num_pages: int, page_size: int, actual_num_kv_heads: int, actual_head_dim: int,
                       kv_dtype) -> tuple:
    """sglang-jax's fused KV-cache shape (their ``get_kv_cache_shape``, same arguments)."""
    p = _packing(kv_dtype)
    return (total_num_pages, page_size, _align(2 * actual_num_kv_heads, p) // p, p, _align(actual_head_dim, 128))


def kv_cache_view(kv_cache_fused, num_kv_heads: int, head_dim: int):
    """sglang-jax's 5-D fused cache as tpukernels' ``[P, page_size, 2*Hkv', D']`` (a reshape: no copy,
    bit-exact). Returns ``(view, Hkv')``.

    Raises:
        ArgumentError: the cache is not sglang-jax's layout for ``num_kv_heads`` / ``head_dim`` / its dtype.
        DTypeError: the cache dtype is not floating (their kernel's rule; int8 caches are not theirs).
    """
    shape = tuple(int(d) for d in kv_cache_fused.shape)
    if len(shape) != 5:
        raise ArgumentError(f"{_WHERE}: kv_cache_fused must be 5-D [P, page_size, 2*Hkv // packing, packing, "
                            f"align(D, 128)], got shape {shape}")
    import jax.numpy as jnp

    dt = np.dtype(kv_cache_fused.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise DTypeError(f"{_WHERE}: kv_cache_fused dtype {dt.name} must be floating (bf16, f32, fp8), as "
                         f"sglang-jax's kernel requires")
    want = get_kv_cache_shape(shape[0], shape[1], num_kv_heads, head_dim, dt)
    if shape != want:
        raise ArgumentError(f"{_WHERE}: kv_cache_fused has shape {shape}, but sglang-jax's layout for "
                            f"num_kv_heads={num_kv_heads}, head_dim={head_dim}, dtype {dt.name} is {want} "
                            f"(a cache of another model config?)")
    P, ps, a, p, last = shape
    return kv_cache_fused.reshape(P, ps, a * p, last), a * p // 2


def metadata_view(kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution, *, page_size: int,
                  pages_per_seq: int | None = None):
    """sglang-jax's metadata as tpukernels': ``(kv_lens, page_indices [S, pages_per_seq], cu_q_lens, num_seqs
    [1])``. Row ``s`` of the page table is ``page_indices[cdiv(cu_kv_lens[s], page_size) + j]`` (their kernel's
    offset rule), clamped to the flat list; entries past a sequence's own pages are never read.

    Raises:
        ArgumentError: shapes (``cu_q_lens`` / ``cu_kv_lens`` ``[S + 1]``, ``distribution (3,)``); with concrete
            metadata also ``cu_kv_lens`` not starting at 0 / not leaving ``kv_len`` slots per sequence (pages
            would overlap the next sequence's), a sequence's pages running past the flat list, a page table
            narrower than a sequence's pages, and ``pages_per_seq < 1``.
        DTypeError: index arrays not int32.
    """
    import jax.numpy as jnp

    for name, t in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("cu_kv_lens", cu_kv_lens), ("distribution", distribution)):
        if np.dtype(t.dtype) != np.int32:
            raise DTypeError(f"{_WHERE}: {name} must be int32, got {np.dtype(t.dtype).name}")
        if len(t.shape) != 1:
            raise ArgumentError(f"{_WHERE}: {name} must be 1-D, got shape {tuple(t.shape)}")
    S, N = int(kv_lens.shape[0]), int(page_indices.shape[0])
    for name, t in (("cu_q_lens", cu_q_lens), ("cu_kv_lens", cu_kv_lens)):
        if tuple(t.shape) != (S + 1,):
            raise ArgumentError(f"{_WHERE}: {name} must have shape [S + 1] = ({S + 1},) (S = kv_lens.shape[0]), "
                                f"got {tuple(t.shape)}")
    if tuple(distribution.shape) != (3,):
        raise ArgumentError(f"{_WHERE}: distribution must have shape (3,), got {tuple(distribution.shape)}")
    if S == 0 or N == 0:
        raise ArgumentError(f"{_WHERE}: kv_lens and page_indices must be non-empty, got {S} and {N} entries")
    ps = int(page_size)
    concrete = not _is_tracer(kv_lens, page_indices, cu_kv_lens, distribution)
    if concrete:
        kl, ckv, dist = (np.asarray(a).astype(np.int64) for a in (kv_lens, cu_kv_lens, distribution))
        n = int(dist[2])
        if not 0 <= n <= S:
            raise ArgumentError(f"{_WHERE}: distribution[2] = {n} (num_seqs) must be in [0, S] = [0, {S}]")
        if int(ckv[0]) != 0:
            raise ArgumentError(f"{_WHERE}: cu_kv_lens[0] must be 0, got {int(ckv[0])}")
        need = -(-kl[:n] // ps)
        for s in range(n):
            if kl[s] < 0 or ckv[s + 1] - ckv[s] < kl[s]:
                raise ArgumentError(f"{_WHERE}: cu_kv_lens[{s + 1}] - cu_kv_lens[{s}] = {int(ckv[s + 1] - ckv[s])} "
                                    f"leaves fewer than kv_lens[{s}] = {int(kl[s])} slots: sequence {s}'s pages would "
                                    f"overlap the next sequence's")
            start = -(-int(ckv[s]) // ps)
            if start + need[s] > N:
                raise ArgumentError(f"{_WHERE}: sequence {s} needs page_indices[{start}:{start + int(need[s])}] "
                                    f"(cdiv(cu_kv_lens[{s}], page_size) + its {int(need[s])} pages), past the "
                                    f"{N} entries of page_indices")
        longest = int(need.max()) if n else 1
        if pages_per_seq is None:
            pages_per_seq = 1 << max(0, longest - 1).bit_length()
        elif pages_per_seq < longest:
            raise ArgumentError(f"{_WHERE}: pages_per_seq = {pages_per_seq} is smaller than the {longest} pages of "
                                f"the longest sequence")
    elif pages_per_seq is None:
        pages_per_seq = N  # always enough (one sequence's pages are a sub-range of the flat list)
    if isinstance(pages_per_seq, bool) or not isinstance(pages_per_seq, (int, np.integer)) or pages_per_seq < 1:
        raise ArgumentError(f"{_WHERE}: pages_per_seq must be an int >= 1, got {pages_per_seq!r}")
    start = (cu_kv_lens[:-1] + ps - 1) // ps
    idx = jnp.clip(start[:, None] + jnp.arange(int(pages_per_seq), dtype=jnp.int32)[None, :], 0, N - 1)
    return kv_lens, page_indices[idx], cu_q_lens, distribution[2:3]


def _slot_mapping(kv_lens, table, cu_q_lens, num_seqs, T: int, ps: int, n_pages: int):
    """Cache slot of each new token (-1: padding or outside the sequence's pages): token ``t`` of sequence
    ``s`` goes to key position ``kv_len - q_len + (t - cu_q_lens[s])``, as their kernel writes it."""
    import jax.numpy as jnp

    S, pps = table.shape
    t = jnp.arange(T, dtype=jnp.int32)
    n = jnp.clip(num_seqs[0], 0, S)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, S - 1)
    live = (t < cu_q_lens[n]) & (seq < n)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    page = table[seq, jnp.clip(pos // ps, 0, pps - 1)]
    live = live & (pos >= 0) & (pos < pps * ps) & (page >= 0) & (page < n_pages)  # never another page's slot
    return jnp.where(live, page * ps + pos % ps, -1).astype(jnp.int32)


def write_kv(kv_cache_fused, keys, values, kv_lens, table, cu_q_lens, num_seqs):
    """Write the new tokens' K/V (``[T, Hkv, D]``, the cache's dtype) into the fused cache; returns the new
    cache. tpukernels' ``update_kv_cache_kernel`` does it with its cache operand aliased to its output, so a
    cache the caller's jit donates is written in place (rows laid out as their ``merge_kv``)."""
    import jax.numpy as jnp

    from ..library.paged_attention import update_kernel
    from ..targets.jax_entry import jax_call

    T, Hkv, D = (int(d) for d in keys.shape)
    view, hkv_pad = kv_cache_view(kv_cache_fused, Hkv, D)
    P, ps, H2, Dp = (int(d) for d in view.shape)
    slots = _slot_mapping(kv_lens, table, cu_q_lens, num_seqs, T, ps, P)
    row = jnp.stack([keys, values], axis=2).reshape(T, 2 * Hkv, D)
    row = jnp.pad(row, ((0, 0), (0, H2 - 2 * Hkv), (0, Dp - D))).astype(kv_cache_fused.dtype)
    return jax_call(update_kernel, slots, row, view).reshape(kv_cache_fused.shape)


# --------------------------------------------------------------------------------------------- the kernel entry


def ragged_paged_attention(queries, keys, values, kv_cache_fused, kv_lens, page_indices, cu_q_lens, cu_kv_lens,
                           distribution, custom_mask=None, attention_sink=None, *, causal: int = 1,
                           sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
                           mask_value: float | None = DEFAULT_MASK_VALUE, q_scale: float | None = None,
                           k_scale: float | None = None, v_scale: float | None = None,
                           xai_temperature_len: float | None = None, softmax_dtype=None,
                           pages_per_seq: int | None = None, k_scales=None, v_scales=None, config=None,
                           interpret: str | None = None):
    """sglang-jax's RPA v3 ``ragged_paged_attention`` signature on tpukernels' kernel: returns
    ``(output [T, Hq, D], kv_cache_fused)`` with the new tokens written into the cache. Names and meanings are
    theirs (``sm_scale`` default 1.0, flat ``page_indices`` offset by ``cu_kv_lens``, ``distribution``).

    Args:
        queries: ``[T, Hq, D]`` bf16 / f32; keys, values: ``[T, Hkv, D]``, the cache's dtype.
        kv_cache_fused: their 5-D fused layout (module docstring), bf16 / f32 / fp8.
        kv_lens, cu_q_lens, cu_kv_lens: int32 ``[S]``, ``[S + 1]``, ``[S + 1]``; page_indices: int32 flat;
            distribution: int32 ``[3]`` (only ``num_seqs = distribution[2]`` matters: one kernel schedules
            decode, prefill and mixed sequences alike).
        attention_sink: float32 ``[Hq]`` or a scalar (broadcast), per-head sink logits (gpt-oss / MiMo).
        pages_per_seq: static width of the page table (module docstring); tpukernels' ``config`` /
            ``interpret`` pass through.
        k_scales, v_scales: optional float32 per-token dequantization scales of an int8 / fp8 cache (an
            extension: sglang-jax passes static ``k_scale`` / ``v_scale`` only), ``[P, page_size]`` (one per
            slot) or ``[P, page_size, Hkv]`` (one per slot and kv head, as JAX's paged attention quantizes); the
            cache keeps their fused layout. They hold every slot's scale, this call's new tokens' included (the
            caller quantizes ``keys`` / ``values`` and writes their scales).

    Raises:
        ArgumentError: ``causal != 1`` or ``custom_mask``, ``xai_temperature_len``, ``q_scale``, a
            ``mask_value`` above ``-1e9``, ``softmax_dtype`` narrower than float32 (not supported); shapes that
            are not their layout; ``k_scales`` / ``v_scales`` not ``[P, page_size]`` / ``[P, page_size, Hkv]``
            or only one given; bad metadata (:func:`metadata_view`, and everything
            :func:`~tpukernels.library.paged_attention.ragged_paged_attention_jax` rejects: a page index out of
            range, ``kv_len`` past the pages, ``q_len > kv_len`` ...), before any kernel runs.
        DTypeError: keys / values not the cache's dtype; index arrays not int32; sinks or scales not float32.
    """
    import jax.numpy as jnp

    from ..library.paged_attention import adapter_scales, ragged_paged_attention_jax

    if causal != 1 or custom_mask is not None:
        raise ArgumentError(f"{_WHERE}: causal={causal!r} / custom_mask (speculative-decoding tree masks, encoder-only "
                            f"layers) is not supported by tpukernels; serve those models with sglang-jax's own backend "
                            f"(without tpukernels.integrations.sglang_jax.install())")
    if xai_temperature_len is not None:
        raise ArgumentError(f"{_WHERE}: xai_temperature_len (Grok length-based temperature) is not supported")
    if q_scale is not None:
        raise ArgumentError(f"{_WHERE}: q_scale (query quantization) is not supported; pass q unquantized")
    if mask_value is not None and not mask_value <= -1e9:
        raise ArgumentError(f"{_WHERE}: mask_value = {mask_value!r}: tpukernels excludes masked keys exactly, the "
                            f"same as an additive mask_value <= -1e9 only")
    if softmax_dtype is not None and np.dtype(softmax_dtype).itemsize < 4:
        raise ArgumentError(f"{_WHERE}: softmax_dtype {np.dtype(softmax_dtype).name} is not supported: tpukernels' "
                            f"softmax runs in float32 (pass None or float32)")
    if len(queries.shape) != 3:
        raise ArgumentError(f"{_WHERE}: queries must be [T, Hq, D], got shape {tuple(queries.shape)}")
    T, Hq, D = (int(d) for d in queries.shape)
    if tuple(keys.shape) != tuple(values.shape) or len(keys.shape) != 3 or int(keys.shape[0]) != T or \
            int(keys.shape[2]) != D:
        raise ArgumentError(f"{_WHERE}: keys / values must be [T, Hkv, D] = [{T}, Hkv, {D}], got "
                            f"{tuple(keys.shape)} / {tuple(values.shape)}")
    Hkv = int(keys.shape[1])
    if Hkv == 0 or Hq % Hkv:
        raise ArgumentError(f"{_WHERE}: query heads {Hq} must be a multiple of kv heads {Hkv}")
    view, hkv_pad = kv_cache_view(kv_cache_fused, Hkv, D)  # validates the layout first
    if keys.dtype != kv_cache_fused.dtype or values.dtype != kv_cache_fused.dtype:
        raise DTypeError(f"{_WHERE}: keys / values dtype ({np.dtype(keys.dtype).name}, {np.dtype(values.dtype).name}) "
                         f"must be the cache's {np.dtype(kv_cache_fused.dtype).name} (quantize before, as theirs)")
    sinks = None
    if attention_sink is not None:
        sinks = jnp.asarray(attention_sink)
        if sinks.ndim == 0:
            sinks = jnp.full((Hq,), sinks, jnp.float32)
        if tuple(sinks.shape) != (Hq,):
            raise ArgumentError(f"{_WHERE}: attention_sink must be a scalar or have shape [Hq] = ({Hq},), got "
                                f"{tuple(sinks.shape)}")
        if np.dtype(sinks.dtype) != np.float32:
            raise DTypeError(f"{_WHERE}: attention_sink must be float32, got {np.dtype(sinks.dtype).name}")
    ps = int(view.shape[1])
    k_scales, v_scales = adapter_scales(k_scales, v_scales, P=int(view.shape[0]), ps=ps, Hkv=Hkv, hkv_pad=hkv_pad,
                                        where=_WHERE)
    kl, table, cu, ns = metadata_view(kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution, page_size=ps,
                                      pages_per_seq=pages_per_seq)
    if not _is_tracer(page_indices, cu_kv_lens, kv_lens, distribution):  # name the flat entry, not the table's
        _check_flat_pages(np.asarray(kl), np.asarray(page_indices), np.asarray(cu_kv_lens), int(ns[0]), ps,
                          int(view.shape[0]))
    r = Hq // Hkv
    _check_attention(queries, view, kl, table, cu, ns, hkv_pad, r)  # the kernel's checks, before the write
    kv_cache_fused = write_kv(kv_cache_fused, keys, values, kl, table, cu, ns)
    view, _ = kv_cache_view(kv_cache_fused, Hkv, D)
    q, Dp = queries, int(view.shape[-1])
    if Dp != D:  # the cache's lanes D..Dp are zero (their merge_kv pads them so); q is padded likewise
        q = jnp.pad(q, ((0, 0), (0, 0), (0, Dp - D)))
    if hkv_pad != Hkv:  # extra query heads for the cache's padding kv heads (outputs dropped)
        q = jnp.pad(q, ((0, 0), (0, (hkv_pad - Hkv) * r), (0, 0)))
        if sinks is not None:
            sinks = jnp.pad(sinks, (0, (hkv_pad - Hkv) * r))
    out = ragged_paged_attention_jax(q, view, kl, table, cu, ns, sm_scale=float(sm_scale),
                                     sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
                                     v_scale=v_scale, sinks=sinks, k_scales=k_scales, v_scales=v_scales,
                                     config=config, interpret=interpret)
    return out[:, : Hkv * r, :D], kv_cache_fused


def _check_flat_pages(kl, flat, ckv, n: int, ps: int, P: int) -> None:
    for s in range(n):
        start = -(-int(ckv[s]) // ps)
        used = flat[start: start + -(-int(kl[s]) // ps)].astype(np.int64)
        bad = (used < 0) | (used >= P)
        if bad.any():
            p = int(np.argmax(bad))
            raise ArgumentError(f"{_WHERE}: page_indices[{start + p}] = {int(used[p])} (page {p} of sequence {s}) is "
                                f"out of range [0, num_pages) = [0, {P})")


def _check_attention(q, view, kl, table, cu, ns, hkv_pad: int, r: int) -> None:
    """What :func:`ragged_paged_attention_jax` will check, on the padded shapes, before the cache write."""
    import jax

    from ..library.paged_attention import _check_shapes, _check_value_arrays

    where = f"tpukernels::{_WHERE}"
    qs = jax.ShapeDtypeStruct((int(q.shape[0]), hkv_pad * r, int(view.shape[-1])), q.dtype)
    _check_shapes(kl, table, cu, ns, qs, view, where=where)
    if not _is_tracer(kl, table, cu, ns):
        _check_value_arrays(*(np.asarray(t) for t in (kl, table, cu, ns)), T=int(q.shape[0]), P=int(view.shape[0]),
                            ps=int(view.shape[1]), where=where)


# --------------------------------------------------------------------------------------------- metadata


def _register_pytree(cls):
    import jax

    return jax.tree_util.register_pytree_node_class(cls)


@_register_pytree
@dataclass
class FlashAttentionMetadata:
    """sglang-jax's ``FlashAttentionMetadata`` (same fields, same pytree order)."""

    cu_q_lens: Any = None
    cu_kv_lens: Any = None
    page_indices: Any = None
    swa_page_indices: Any = None
    seq_lens: Any = None
    distribution: Any = None
    custom_mask: Any = None

    def tree_flatten(self):
        return (self.cu_q_lens, self.cu_kv_lens, self.page_indices, self.swa_page_indices, self.seq_lens,
                self.distribution, self.custom_mask), {}

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        return cls(*children)


def _mode_name(mode) -> str:
    return getattr(mode, "name", str(mode)).upper()


def get_forward_metadata(batch, page_size: int) -> FlashAttentionMetadata:
    """Host-side metadata of one step from a ``ModelWorkerBatch`` (fields ``forward_mode``, ``seq_lens``,
    ``cache_loc``, ``extend_seq_lens``, ``dp_size``, ``per_dp_bs_size``): a re-expression of their
    ``FlashAttention.get_forward_metadata`` (no SWA pool mapping, no speculative-decoding paths; with sglang-jax
    installed :func:`backend_class` uses theirs). EXTEND batches carry decode rows too (``extend_seq_lens`` 1:
    sglang's mixed chunked prefill).

    Raises:
        ArgumentError: inconsistent data-parallel sizes or a forward mode other than EXTEND / DECODE.
    """
    import jax.numpy as jnp

    dp, bs = int(batch.dp_size), int(batch.per_dp_bs_size)
    seq_lens = np.asarray(batch.seq_lens, np.int32)
    if dp <= 0 or bs <= 0 or dp * bs != len(seq_lens):
        raise ArgumentError(f"{_WHERE}: dp_size * per_dp_bs_size = {dp} * {bs} must equal len(seq_lens) = "
                            f"{len(seq_lens)}")
    cache_loc = np.asarray(batch.cache_loc, np.int32)
    if len(cache_loc) % dp:
        raise ArgumentError(f"{_WHERE}: len(cache_loc) = {len(cache_loc)} is not divisible by dp_size = {dp}")
    page_indices = (cache_loc.reshape(dp, -1)[:, ::page_size] // page_size).ravel()
    mode = _mode_name(batch.forward_mode)
    if mode == "EXTEND":
        ext = np.asarray(batch.extend_seq_lens, np.int32).reshape(dp, bs)
        cu_q = np.zeros((dp, bs + 1), np.int32)
        cu_q[:, 1:] = np.cumsum(ext, axis=1)
    elif mode == "DECODE":
        cu_q = np.tile(np.arange(bs + 1, dtype=np.int32), (dp, 1))
    else:
        raise ArgumentError(f"{_WHERE}: forward mode {mode} is not supported (EXTEND or DECODE)")
    aligned = (seq_lens + page_size - 1) // page_size * page_size
    cu_kv = np.zeros((dp, bs + 1), np.int32)
    cu_kv[:, 1:] = np.cumsum(aligned.reshape(dp, bs), axis=1)
    n = np.sum(seq_lens.reshape(dp, bs) > 0, axis=1, dtype=np.int32)
    dist = np.repeat(n, 3) if mode == "DECODE" else np.column_stack([np.zeros_like(n), n, n]).ravel()
    return FlashAttentionMetadata(cu_q_lens=jnp.asarray(cu_q.ravel()), cu_kv_lens=jnp.asarray(cu_kv.ravel()),
                                  page_indices=jnp.asarray(page_indices.astype(np.int32)),
                                  seq_lens=jnp.asarray(seq_lens), distribution=jnp.asarray(dist.astype(np.int32)))


# --------------------------------------------------------------------------------------------- the backend


class _TpuKernelsCall:
    """``__call__`` of the backend: their ``FlashAttention.__call__`` with tpukernels' kernel. Uses the
    attributes their backend has: ``forward_metadata``, ``num_kv_heads``, ``head_dim``, ``page_size``, ``mesh``,
    ``kv_partition_axis``, ``attention_data_partition_axis``; ``pages_per_seq`` (ours, optional)."""

    pages_per_seq: int | None = None
    config: dict | None = None
    interpret: str | None = None

    def __call__(self, q, k, v, layer, forward_batch, token_to_kv_pool, causal: int = 1, attention_sink=None):
        """Args: ``q [T, Hq*D]`` (or ``[T, Hq, D]``), ``k``, ``v`` ``[T, Hkv*D]`` (or 3-D), ``layer`` (their
        ``RadixAttention``: ``layer_id``, ``head_dim``, ``scaling``, ``sliding_window_size``, ``logit_cap``,
        ``xai_temperature_len``, ``softmax_dtype``, ``attn_type``), ``forward_batch``, ``token_to_kv_pool``
        (``get_fused_kv_buffer(layer_id)``). Returns ``(out [T, Hq*D], updated fused cache)`` (the caller
        persists the cache, as with theirs).

        Raises: as :func:`ragged_paged_attention` (encoder-only layers and custom masks: ArgumentError)."""
        import jax

        if token_to_kv_pool is None or forward_batch is None:
            raise ArgumentError(f"{_WHERE}: forward_batch and token_to_kv_pool are required (the tpukernels backend "
                                f"always reads and writes the paged KV cache)")
        md = self.forward_metadata
        head_dim = getattr(layer, "head_dim", self.head_dim)
        kv_cache_fused = token_to_kv_pool.get_fused_kv_buffer(layer.layer_id)
        scale = 1.0 / math.sqrt(head_dim) if getattr(layer, "scaling", None) is None else layer.scaling
        attn_type = getattr(layer, "attn_type", None)
        if getattr(attn_type, "value", attn_type) == "encoder_only" or md.custom_mask is not None:
            causal = 0
        page_indices = md.page_indices
        window = getattr(layer, "sliding_window_size", None)
        if window is not None and window > 0 and md.swa_page_indices is not None:
            page_indices = md.swa_page_indices
        elif hasattr(token_to_kv_pool, "remap_cache_loc") and self.page_size == 1:
            page_indices = token_to_kv_pool.remap_cache_loc(page_indices, layer.layer_id)
        xai = getattr(layer, "xai_temperature_len", -1)
        cap = getattr(layer, "logit_cap", None)
        kw = dict(causal=causal, sm_scale=float(scale), sliding_window=int(window) if window else None,
                  soft_cap=float(cap) if cap else None,
                  xai_temperature_len=xai if xai is not None and xai > 0 else None,
                  softmax_dtype=getattr(layer, "softmax_dtype", None), pages_per_seq=self.pages_per_seq,
                  config=self.config, interpret=self.interpret)
        T = q.shape[0]
        args = (q.reshape(T, -1, head_dim), k.reshape(k.shape[0], -1, head_dim), v.reshape(v.shape[0], -1, head_dim),
                kv_cache_fused, md.seq_lens, page_indices, md.cu_q_lens, md.cu_kv_lens, md.distribution,
                md.custom_mask, attention_sink)
        mesh = getattr(self, "mesh", None)
        if mesh is None or math.prod(mesh.devices.shape) == 1:
            out, cache = ragged_paged_attention(*args, **kw)
        else:  # their shard_map specs
            from jax.sharding import PartitionSpec as P

            d, h = self.attention_data_partition_axis, self.kv_partition_axis
            sink_spec = P(h) if attention_sink is not None else P()
            in_specs = (P(d, h), P(d, h), P(d, h), P(d, None, h, None, None), P(d), P(d), P(d), P(d), P(d), P(),
                        sink_spec)
            out, cache = jax.shard_map(lambda *a: ragged_paged_attention(*a, **kw), mesh=mesh, in_specs=in_specs,
                                       out_specs=(P(d, h), P(d, None, h, None, None)), check_vma=False)(*args)
        return out.reshape(T, -1), cache


class TpuKernelsFlashAttention(_TpuKernelsCall):
    """Standalone backend with their ``FlashAttention`` constructor and methods (for use and tests without
    sglang-jax; with sglang-jax installed, :func:`backend_class` is the one to register).

    Extra keyword arguments (ours): ``max_context_len`` (static page-table width ``cdiv(max_context_len,
    page_size)``; see the module docstring), ``config`` / ``interpret`` (passed to tpukernels' kernel)."""

    def __init__(self, num_attn_heads, num_kv_heads, head_dim, page_size: int = 1, kv_partition_axis: str = "tensor",
                 attention_data_partition_axis: str = "data", mesh=None, *, max_context_len: int | None = None,
                 config: dict | None = None, interpret: str | None = None):
        self.num_heads = num_attn_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_attn_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.kv_partition_axis = kv_partition_axis
        self.attention_data_partition_axis = attention_data_partition_axis
        self.mesh = mesh
        self.forward_metadata = FlashAttentionMetadata()
        self.pages_per_seq = None if max_context_len is None else -(-int(max_context_len) // page_size)
        self.config, self.interpret = config, interpret

    def get_forward_metadata(self, batch) -> FlashAttentionMetadata:
        return get_forward_metadata(batch, self.page_size)

    @staticmethod
    def get_max_running_reqests(max_context_len: int, page_size: int) -> int:  # their name and rule
        res = 1024 * 1024 // 2 // -(-max_context_len // page_size) // 4
        if res <= 0:
            raise ArgumentError(f"{_WHERE}: max running requests {res} must be > 0: increase page_size or decrease "
                                f"max_context_len")
        return res


_CLASSES: dict = {}


def backend_class(max_context_len: int | None = None):
    """A subclass of sglang-jax's ``FlashAttention`` whose ``__call__`` runs tpukernels (their metadata
    builders, pytree methods and constructor are kept).

    Raises:
        BackendUnavailableError: sglang-jax is not importable (it needs Python >= 3.12).
    """
    key = max_context_len
    if key not in _CLASSES:
        try:
            from sgl_jax.srt.layers.attention import flashattention_backend as fab
        except ImportError as e:
            raise BackendUnavailableError(f"{_WHERE}: sglang-jax is not importable ({e}); it needs Python >= 3.12: "
                                          f"pip install sglang-jax") from e
        base = _CLASSES.get("base", fab.FlashAttention)
        _CLASSES["base"] = base

        class TpuKernelsFlashAttentionBackend(_TpuKernelsCall, base):
            """sglang-jax ``FlashAttention`` running tpukernels' ragged paged attention."""

            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                ps = getattr(self, "page_size", 1)
                self.pages_per_seq = None if max_context_len is None else -(-int(max_context_len) // ps)

        _CLASSES[key] = TpuKernelsFlashAttentionBackend
    return _CLASSES[key]


def install(max_context_len: int | None = None) -> type:
    """The one-line swap: make ``--attention-backend fa`` build tpukernels' backend for MHA/GQA models
    (``sgl_jax.srt.layers.attention.flashattention_backend.FlashAttention = backend_class(...)``; call it before
    the model runner is created). Returns the class. Idempotent.

    Raises:
        BackendUnavailableError: sglang-jax is not importable.
    """
    cls = backend_class(max_context_len)
    from sgl_jax.srt.layers.attention import flashattention_backend as fab

    fab.FlashAttention = cls
    return cls


__all__ = ["SGLANG_JAX_COMMIT", "DEFAULT_MASK_VALUE", "get_kv_cache_shape", "kv_cache_view", "metadata_view",
           "write_kv", "ragged_paged_attention", "FlashAttentionMetadata", "get_forward_metadata",
           "TpuKernelsFlashAttention", "backend_class", "install"]
