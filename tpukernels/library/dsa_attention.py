"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): the lightning indexer and sparse MLA over a paged cache, for TPU.

DeepSeek-V3.2 keeps MLA (see :mod:`tpukernels.library.mla_attention`) but lets each query attend only to the
``index_topk`` (2048) cached tokens its *lightning indexer* scores highest. The indexer has ``Hi``
(``index_n_heads``, 64) query heads of dim ``D`` (``index_head_dim``, 128) and one key per cached token shared by
all of them (MQA), cached in its own paged cache ``[P, page_size, D]`` that uses the latent cache's pages
(same ``page_indices``). Definition (transformers 5.24 ``DeepseekV32Indexer.forward``; fla-core 0.6.0
``fla/ops/dsa/naive.py`` ``naive_dsa_indexer`` with ``activation="relu"``)::

    index_score[t, j] = sum_h weights[t, h] * ReLU(sm_scale * k_scale * q_idx[t, h] . k_idx[j])     (f32)

for the cached tokens ``j <= pos`` of ``t``'s sequence (causal, bottom-right aligned as in
:func:`~tpukernels.library.ragged_paged_attention`: token ``t = cu_q_lens[s] + i`` sits at position
``pos = kv_len - q_len + i``); every other column is ``-inf``. ``sm_scale`` defaults to ``D ** -0.5``
(transformers' ``softmax_scale``); ``weights`` are the caller's ``weights_proj(x) * index_n_heads ** -0.5``
(transformers folds ``n_heads ** -0.5`` into the weights, in float32). The Hadamard rotation of DeepSeek's
reference indexer preserves dot products and is the caller's (transformers skips it too).

Public API (torch tensors; the metadata conventions of :func:`mla_ragged_paged_attention`: ``kv_lens``
counts this step's tokens, whose latents / index keys the caller has already written to the caches):

* :func:`lightning_indexer` (kernel op ``torch.ops.tpukernels.lightning_indexer_kernel``) -> scores
  ``[T, pages_per_seq * page_size]`` float32;
* :func:`indexer_topk` -> int32 ``[T, topk]`` positions (within the sequence) of the ``topk`` highest scores,
  ``-1`` where a query sees fewer than ``topk`` tokens;
* :func:`sparse_mla_attention` (kernel op ``torch.ops.tpukernels.sparse_mla_attention_kernel``) -> ``[T, H, L]``:
  absorbed MLA (the formula of :func:`mla_ragged_paged_attention`) over only the selected tokens;
* :func:`lightning_indexer_reference`, :func:`sparse_mla_attention_reference`: float64 references.

Layout::

    q_idx          [T, Hi, D]              indexer queries (RoPE applied), bfloat16 / float32
    weights        [T, Hi]                 per query token and index head, float32 (or q_idx's dtype)
    index_k_cache  [P, page_size, D]       one index key per cached token; q_idx's dtype or fp8 (k_scale)
    ql_nope, q_pe  [T, H, L], [T, H, R]    as mla_ragged_paged_attention
    cache_kv       [P, page_size, L + R]   the latent cache, as mla_ragged_paged_attention (already written)
    topk_indices   int32 [T, K]            positions in the query's own sequence; -1: none
    kv_lens, page_indices, cu_q_lens, num_seqs: as mla_ragged_paged_attention

Kernels (written with the tpukernels DSL). *Indexer*: the schedule of :func:`mla_ragged_paged_attention`
(work items = (query block, sequence) pairs, ``block_q`` tokens' ``Hi`` heads folded into ``block_q * Hi``
rows, the sequence's index-key pages DMA'd ``pages_per_block`` at a time into a double buffer, only the kv
blocks some row can see); per kv block one ``[rows, D] x [D, bkv]`` matmul, ReLU, then per token the
weighted head sum as a ``[1, Hi] x [Hi, bkv]`` matmul; the ``[block_q, max_kv]`` score rows stay in VMEM
across the block's items (``-inf`` first, own rows selected in). *Sparse MLA*: the op first gathers each
query's selected latent rows from the pages (:func:`gather_selected`, a torch / XLA row gather into
``[T, Kp, L + R]``, invalid slots 0 by ``torch.where``), then the kernel runs one grid row per query token
(its ``H`` heads are the rows; DeepSeek: 128) over ``block_k``-row chunks of its gathered rows: one
``[H, L + R] x [L + R, block_k]`` score matmul, the selection mask, online softmax, one value matmul over the
first ``L`` lanes. A selected position outside ``[0, pos]`` (``-1``, past the query's causal position, or past
``kv_len``) is treated as ``-1``: it contributes nothing and its page is never read, so a query never reads
another sequence's pages. Pages no sequence uses and slots past ``kv_len`` may hold anything (NaN included):
the indexer selects them away with ``jnp.where``, never multiplies by 0. Why the gather is not in the kernel:
a DMA of one token's row out of the ``[P, page_size, L + R]`` HBM cache does not compile (Mosaic: "offsets
along tiled dimensions must be aligned to tiles", the page dimension is tiled by 8), reading aligned 8-row
tiles instead would read 8x the selected bytes, and a row-addressable layout (tpu-inference's packed
``[P, page_size / packing, packing, W]``) is another cache format. The gather costs about 3x the ideal HBM
traffic (read, write, read ``K`` rows per query) and ``T * Kp * (L + R)`` bytes of HBM (64 decode tokens x
2048 x 576 bf16: 151 MB); the op gathers in token chunks of at most ~256 MiB.

Top-k is not a kernel here: :func:`indexer_topk` is a stable descending ``torch.sort`` of the scores cut at
``topk`` (not ``torch.topk``: its order among equal scores is unspecified, and on cpu not lowest-index-first;
the stable sort gives ties lowest index first, ``jax.lax.top_k``'s documented order), then ``-1`` where the
score is ``-inf``. A fused indexer + top-k kernel could avoid writing the ``[T, max_kv]`` scores to HBM
(4 bytes per cached token per query, against the indexer's ``D``-wide key read per cached token), but for
decode (one query per sequence, bf16 keys of 128: 256 bytes) that write is ~1.5% of the key read, so it
would gain little; a general top-k kernel is separate work. The order of the selected positions does not
change attention.

fp8 index keys: a static ``k_scale`` and / or DeepSeek's per-token scales (``index_k_scale [P, page_size]``,
applied to the scores after the kernel: a positive per-key scale factors out of the ReLU and the head sum).
Gaps: DeepSeek quantizes the indexer *queries* to fp8 too (``act_quant``); here they are bf16 / f32. No JAX entries yet (torch
tensors only; the kernels themselves run under :func:`tpukernels.jax_call`). Forward only (no backward / the
indexer's training loss). Not run on a TPU; compile-only checked for v5e / v6e / tpu7x at DeepSeek-V3.2 decode
shapes (:data:`STANDARD_CASES`); performance not measured.

Rooflines (v6e, DeepSeek-V3.2 decode, 64 sequences x 8192 cached tokens, bf16; not measurements): indexer:
64 heads x 128 keys read once per sequence, 134 MB -> 82 us HBM vs 9 us MXU (HBM-bound; libtpu's static
profiler answers 47,023 cycles, below that floor, so no credible estimate); sparse MLA at top-2048: the
gather reads and writes 151 MB and the kernel reads it again (453 MB, 276 us HBM; the in-kernel gather this
module could not compile would be 92 us) vs 40 us MXU; dense MLA over the same 8192 tokens reads 604 MB
(368 us). libtpu's static profiler aborts on the sparse kernel (``llo_execution_graph.cc:46``, as on the
dense MLA kernel's 576-lane rows).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ..dsl import Launch, OutSpec, Tunable, cdiv, tpu_kernel
from ..errors import ArgumentError, DTypeError
from .mla_attention import check_mla_shapes, check_mla_statics
from .paged_attention import check_metadata, item_range, n_work_items, work_items

NAMESPACE = "tpukernels"
_Q_DTYPES = ("bfloat16", "float32")
_FP8 = ("float8_e4m3fn", "float8_e5m2")
_NEW_TOKENS = ("kv_lens counts this step's new tokens (the caller writes their index keys / latents to the caches "
               "first), so q_len <= kv_len")

# ----------------------------------------------------------------------------------------------- tunables

_INDEXER_TUNABLES = {
    "block_q": Tunable((1, 2, 4, 8, 16), default=1, doc="query tokens per block; their Hi heads fold into rows"),
    "pages_per_block": Tunable((1, 2, 4, 8, 16, 32, 64), default=8,
                               doc="index-key pages gathered per DMA block (halved until it divides pages_per_seq)"),
}
_SPARSE_TUNABLES = {
    "block_k": Tunable((128, 256, 512, 1024), default=128,
                       doc="gathered selected rows per kernel chunk (K <= block_k: one chunk of K rounded up to 8)"),
}


def _indexer_heuristic(kv_lens, page_indices, cu_q_lens, num_seqs, q_idx, weights, index_k_cache, *extras,
                       **statics):
    """One token per block for decode-like batches (``T <= S``), else about 256 rows (``block_q * Hi``); about
    512 cached tokens per kv block."""
    if len(q_idx.shape) != 3 or len(index_k_cache.shape) != 3 or len(page_indices.shape) != 2:
        return {}
    T, Hi, S, ps = int(q_idx.shape[0]), int(q_idx.shape[1]), int(page_indices.shape[0]), int(index_k_cache.shape[1])
    pow2 = lambda n: 1 << (max(1, n).bit_length() - 1)
    bq = 1 if T <= S else min(16, pow2(256 // max(Hi, 1)), pow2(T))
    return {"block_q": bq, "pages_per_block": min(64, pow2(512 // max(ps, 1)))}


def _sparse_heuristic(*args, **statics):
    return {"block_k": 128}


# ----------------------------------------------------------------------------------------------- checks


def _dt(x) -> str:
    if isinstance(x.dtype, torch.dtype):
        return str(x.dtype).replace("torch.", "")
    return np.dtype(x.dtype).name


def _check_indexer(kv_lens, page_indices, cu_q_lens, num_seqs, q_idx, weights, index_k_cache, *, where: str):
    """Ranks, shapes, dtypes of the indexer's operands; returns ``(T, Hi, D, P, ps, S, pps)``."""
    ranks = (("q_idx", q_idx, 3, "[T, index_n_heads, index_head_dim]"), ("weights", weights, 2, "[T, index_n_heads]"),
             ("index_k_cache", index_k_cache, 3, "[num_pages, page_size, index_head_dim]"),
             ("kv_lens", kv_lens, 1, "[S]"), ("page_indices", page_indices, 2, "[S, pages_per_seq]"),
             ("cu_q_lens", cu_q_lens, 1, "[S + 1]"), ("num_seqs", num_seqs, 1, "[1]"))
    for name, x, r, shape in ranks:
        if len(x.shape) != r:
            raise ArgumentError(f"{where}: {name} must have rank {r} {shape}, got shape {tuple(x.shape)}")
    T, Hi, D = (int(d) for d in q_idx.shape)
    P, ps, Dk = (int(d) for d in index_k_cache.shape)
    S, pps = (int(d) for d in page_indices.shape)
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("num_seqs", num_seqs)):
        if _dt(x) != "int32":
            raise DTypeError(f"{where}: {name} must be int32, got {_dt(x)}")
    if _dt(q_idx) not in _Q_DTYPES:
        raise DTypeError(f"{where}: q_idx dtype {_dt(q_idx)} is not supported; use bfloat16 or float32")
    if _dt(weights) not in ("float32", _dt(q_idx)):
        raise DTypeError(f"{where}: weights dtype {_dt(weights)} must be float32 or q_idx's ({_dt(q_idx)})")
    if _dt(index_k_cache) != _dt(q_idx) and _dt(index_k_cache) not in _FP8:
        raise DTypeError(f"{where}: index_k_cache dtype {_dt(index_k_cache)} must equal q_idx's ({_dt(q_idx)}) or be "
                         f"float8_e4m3fn / float8_e5m2 (with a static k_scale)")
    if Hi == 0 or D == 0 or D % 8:
        raise ArgumentError(f"{where}: q_idx must be [T, Hi, D] with Hi > 0 and D a positive multiple of 8 "
                            f"(DeepSeek-V3.2: 64 heads of 128), got {tuple(q_idx.shape)}")
    if tuple(weights.shape) != (T, Hi):
        raise ArgumentError(f"{where}: weights must have shape [T, index_n_heads] = ({T}, {Hi}), got "
                            f"{tuple(weights.shape)}")
    if Dk != D:
        raise ArgumentError(f"{where}: index_k_cache last dim {Dk} must be index_head_dim = q_idx.shape[2] = {D}")
    if ps == 0 or P == 0:
        raise ArgumentError(f"{where}: index_k_cache must have num_pages > 0 and page_size > 0, got "
                            f"{tuple(index_k_cache.shape)}")
    if S == 0 or pps == 0:
        raise ArgumentError(f"{where}: page_indices must be [S, pages_per_seq] with S, pages_per_seq > 0, got "
                            f"{tuple(page_indices.shape)}")
    if tuple(kv_lens.shape) != (S,):
        raise ArgumentError(f"{where}: kv_lens must have shape [S] = ({S},) (S = page_indices.shape[0]), got "
                            f"{tuple(kv_lens.shape)}")
    if tuple(cu_q_lens.shape) != (S + 1,):
        raise ArgumentError(f"{where}: cu_q_lens must have shape [S + 1] = ({S + 1},), got {tuple(cu_q_lens.shape)}")
    if tuple(num_seqs.shape) != (1,):
        raise ArgumentError(f"{where}: num_seqs must have shape [1], got {tuple(num_seqs.shape)}")
    return T, Hi, D, P, ps, S, pps


class _Shaped:
    """Shape and dtype of a reshaped operand (the kernel op's ``weights [T, 1, Hi]`` checked as ``[T, Hi]``)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def _check_scale(name, s, where: str, allow_none=True) -> None:
    if s is None and allow_none:
        return
    if isinstance(s, bool) or not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
        raise ArgumentError(f"{where}: {name} must be {'None or ' if allow_none else ''}a finite float > 0, got {s!r}")


def _check_topk_indices(topk_indices, T: int, where: str) -> int:
    if len(topk_indices.shape) != 2 or int(topk_indices.shape[0]) != T or int(topk_indices.shape[1]) == 0:
        raise ArgumentError(f"{where}: topk_indices must have shape [T, K] = ({T}, K) with K > 0, got "
                            f"{tuple(topk_indices.shape)}")
    if _dt(topk_indices) != "int32":
        raise DTypeError(f"{where}: topk_indices must be int32, got {_dt(topk_indices)}")
    return int(topk_indices.shape[1])


def _check_tensors(where: str, **named) -> None:
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _num_seqs_tensor(num_seqs, device, where: str):
    if isinstance(num_seqs, (bool, np.bool_)):
        raise ArgumentError(f"{where}: num_seqs must be an int32 [1] tensor or a Python int, got bool {num_seqs!r}")
    if isinstance(num_seqs, (int, np.integer)):
        return torch.tensor([int(num_seqs)], dtype=torch.int32, device=device)
    return num_seqs


# ----------------------------------------------------------------------------------------------- token metadata


def token_positions_torch(kv_lens, page_indices, cu_q_lens, num_seqs, *, T: int):
    """Per query token (torch ops, any device): ``(seq, pos)`` int64 ``[T]``: its sequence (clamped to ``[0, S)``)
    and causal position ``kv_len - q_len + i``; ``pos = -1`` for rows no sequence owns (the rule of
    :func:`~tpukernels.library.mla_attention.new_token_slots_torch`)."""
    S = page_indices.shape[0]
    dev = kv_lens.device
    n = num_seqs[0].clamp(0, S)
    cu = torch.where(torch.arange(S + 1, device=dev) <= n, cu_q_lens.clamp(0, T), 0).cummax(0).values
    t = torch.arange(T, device=dev)
    s = torch.searchsorted(cu[1:].contiguous(), t.to(cu.dtype), right=True).clamp(0, S - 1)
    q0, q1 = cu[s].long(), cu[s + 1].long()
    pos = kv_lens[s].long() - (q1 - q0) + (t - q0)
    ok = (t < cu[-1].long()) & (pos >= 0)
    return s, torch.where(ok, pos, -1)


def gather_selected(cache_kv, topk_indices, kv_lens, page_indices, seq, pos, *, width: int):
    """The selected latent rows, gathered from the pages (torch ops, any device): ``(kv_sel [T, width, W] in
    cache_kv's dtype, sel int32 [T, 1, width])`` for query rows with sequence ``seq`` / position ``pos``
    (:func:`token_positions_torch`). Slot ``k < K`` holds ``cache_kv[page_indices[s, j // ps], j % ps]`` for
    ``j = topk_indices[t, k]`` when ``0 <= j <= pos(t)`` and ``j < kv_len`` (``t``'s own sequence's pages) and
    the page index is in the cache; ``sel`` is then ``j``. Every other slot (``-1``, out of range, past ``K``,
    rows no sequence owns) is 0 with ``sel = -1``: selected by ``torch.where``, never read from another
    sequence's pages."""
    T, K = topk_indices.shape
    P, ps, W = cache_kv.shape
    pps = page_indices.shape[1]
    j = torch.cat([topk_indices.long(), topk_indices.new_full((T, width - K), -1).long()], dim=1)
    kvl = kv_lens[seq].long().clamp(0, pps * ps)
    valid = (j >= 0) & (j <= pos[:, None]) & (j < kvl[:, None])
    page = page_indices[seq[:, None], (j // ps).clamp(0, pps - 1)].long()
    valid = valid & (page >= 0) & (page < P)
    row = torch.where(valid, page * ps + j % ps, 0)
    flat = cache_kv.reshape(P * ps, W).view(torch.uint8)  # bytes: fp8 caches gather and select as bf16 ones
    rows = torch.where(valid[..., None], flat[row.reshape(-1)].reshape(T, width, -1), 0)
    return rows.view(cache_kv.dtype), torch.where(valid, j, -1).to(torch.int32).reshape(T, 1, width)


# ----------------------------------------------------------------------------------------------- indexer kernel


def _indexer_body(kv_lens, page_indices, cu_q_lens, num_seqs, item_seq, item_blk, q_ref, w_ref, k_hbm, o_ref,
                  k_buf, sems, qf_ref, slot_ref, *, sm_scale, k_scale):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    del num_seqs
    bq, Hi, D = q_ref.shape
    _, ppb, ps, _ = k_buf.shape
    rows, bkv, n_pages = bq * Hi, ppb * ps, k_hbm.shape[0]
    pps = page_indices.shape[1]
    i, n_items = pl.program_id(0), pl.num_programs(0)
    rng = lambda j: item_range(j, item_seq, item_blk, kv_lens, cu_q_lens, bq=bq, bkv=bkv, max_kv=pps * ps,
                               window=None)
    seq, kv_len, kb_lo, kb_hi = rng(i)

    def page_copies(s, kvl, kb, slot, fn):  # start or wait the page DMAs of kv block kb of sequence s
        for p in range(ppb):
            page = kb * ppb + p

            @pl.when(page * ps < kvl)
            def _():
                src = jnp.clip(page_indices[s, jnp.minimum(page, pps - 1)], 0, n_pages - 1)
                fn(pltpu.make_async_copy(k_hbm.at[src], k_buf.at[slot, p], sems.at[slot]))

    start, wait = (lambda c: c.start()), (lambda c: c.wait())
    _, _, prev_lo, prev_hi = rng(jnp.maximum(i - 1, 0))
    prefetched = (i > 0) & (prev_lo < prev_hi)

    @pl.when(i == 0)
    def _():
        slot_ref[0] = 0

    @pl.when((kb_lo < kb_hi) & jnp.logical_not(prefetched))
    def _():
        page_copies(seq, kv_len, kb_lo, slot_ref[0], start)

    blk = item_blk[i]
    first = (i == 0) | (item_blk[jnp.maximum(i - 1, 0)] != blk)
    cdt = q_ref.dtype

    @pl.when(first)
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, jnp.float32)
        qf_ref[...] = q_ref[...].astype(qf_ref.dtype).reshape(rows, D)

    f32 = np.dtype(cdt) == np.dtype(np.float32)
    prec = jax.lax.Precision.HIGHEST if f32 else None
    scale = sm_scale * (1.0 if k_scale is None else k_scale)
    mm = lambda a, b, dims: jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32,
                                                precision=prec)

    def kv_step(t, carry):
        kb = kb_lo + t

        @pl.when(kb < kb_hi)
        def _():
            slot = slot_ref[0]

            @pl.when(kb + 1 < kb_hi)
            def _():
                page_copies(seq, kv_len, kb + 1, 1 - slot, start)

            @pl.when((kb + 1 >= kb_hi) & (i + 1 < n_items))
            def _():
                nseq, nlen, nlo, nhi = rng(jnp.minimum(i + 1, n_items - 1))

                @pl.when(nlo < nhi)
                def _():
                    page_copies(nseq, nlen, nlo, 1 - slot, start)

            page_copies(seq, kv_len, kb, slot, wait)
            q0, q1 = cu_q_lens[seq], cu_q_lens[seq + 1]
            k = k_buf[slot].reshape(bkv, D)
            if k.dtype != cdt:  # fp8 -> f32 -> q's dtype: exact
                k = k.astype(jnp.float32).astype(cdt)
            s = jnp.maximum(mm(qf_ref[...].astype(cdt), k, ((1,), (1,))) * scale, 0.0)  # [rows, bkv] ReLU
            s = s.astype(jnp.float32)
            col = kb * bkv + jax.lax.broadcasted_iota(jnp.int32, (1, bkv), 1)
            for b in range(bq):  # weighted head sum per token: [1, Hi] x [Hi, bkv]
                tok = blk * bq + b
                own = (tok >= q0) & (tok < q1)
                pos = kv_len - (q1 - q0) + tok - q0
                w = w_ref[b].astype(jnp.float32)  # [1, Hi]
                sb = s[b * Hi:(b + 1) * Hi]
                sc = jax.lax.dot_general(w, sb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                                         precision=jax.lax.Precision.HIGHEST)  # [1, bkv]
                cols = pl.ds(pl.multiple_of(kb * bkv, bkv), bkv)
                # select, not multiply: keys past kv_len (NaN allowed) and other sequences' rows stay -inf / theirs
                o_ref[b, :, cols] = jnp.where(own & (col <= pos), sc, o_ref[b, :, cols])
            slot_ref[0] = 1 - slot

        return carry

    jax.lax.fori_loop(0, cdiv(pps, ppb), kv_step, 0)


def _indexer_out_shape(kv_lens, page_indices, cu_q_lens, num_seqs, q_idx, weights, index_k_cache, **statics):
    return OutSpec((int(q_idx.shape[0]), 1, int(page_indices.shape[1]) * int(index_k_cache.shape[1])), "float32")


def _vmem_limit(est_bytes: int) -> int | None:
    return None if est_bytes <= 6 << 20 else int(min(40 << 20, 2 * est_bytes + (8 << 20)))


@tpu_kernel(_indexer_body, name="lightning_indexer_kernel", namespace=NAMESPACE, tunables=_INDEXER_TUNABLES,
            heuristic=_indexer_heuristic, out_shape=_indexer_out_shape)
def indexer_kernel(
    kv_lens: torch.Tensor,
    page_indices: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_seqs: torch.Tensor,
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    sm_scale: float = 1.0,
    k_scale: Optional[float] = None,
    *,
    block_q: int,
    pages_per_block: int,
) -> torch.Tensor:
    """Kernel op ``torch.ops.tpukernels.lightning_indexer_kernel``: the scalar-prefetch operands first, then
    ``q_idx [T, Hi, D]``, ``weights [T, 1, Hi]`` and ``index_k_cache [P, page_size, D]``; returns the scores
    ``[T, 1, pages_per_seq * page_size]`` float32. See :func:`lightning_indexer`."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::lightning_indexer_kernel"
    if len(weights.shape) != 3 or tuple(weights.shape[1:2]) != (1,):
        raise ArgumentError(f"{where}: weights must have shape [T, 1, Hi], got {tuple(weights.shape)}")
    w2 = _Shaped((int(weights.shape[0]), int(weights.shape[2])), weights.dtype)
    T, Hi, D, P, ps, S, pps = _check_indexer(kv_lens, page_indices, cu_q_lens, num_seqs, q_idx, w2, index_k_cache,
                                             where=where)
    _check_scale("sm_scale", sm_scale, where, allow_none=False)
    _check_scale("k_scale", k_scale, where)
    bq, ppb = int(block_q), min(int(pages_per_block), pps)
    while pps % ppb:  # kv blocks tile the [max_kv] score row exactly
        ppb //= 2
    rows, bkv, max_kv = bq * Hi, ppb * ps, pps * ps
    idx = lambda i, kl, pi, cu, ns, iseq, iblk: (iblk[i], 0, 0)
    it, kit = np.dtype(q_idx.dtype).itemsize, np.dtype(index_k_cache.dtype).itemsize
    est = 2 * bq * Hi * D * it + 2 * bq * 128 * 4 + 2 * bkv * D * kit + rows * D * 4 + 2 * bq * 8 * max_kv * 4 \
        + 3 * rows * bkv * 4
    return Launch(
        grid=(n_work_items(T, S, bq) if T > 0 else 0,),
        in_specs=[pl.BlockSpec((bq, Hi, D), idx), pl.BlockSpec((bq, 1, Hi), idx),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((bq, 1, max_kv), idx),
        out_shape=OutSpec((T, 1, max_kv), jnp.float32),
        scratch_shapes=[
            pltpu.VMEM((2, ppb, ps, D), index_k_cache.dtype),  # index-key page double buffer
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((rows, D), q_idx.dtype if Hi % (32 // it) == 0 else jnp.float32),  # folded queries
            pltpu.SMEM((1,), jnp.int32),  # current buffer slot
        ],
        num_scalar_prefetch=4,
        prefetch=lambda kl, pi, cu, ns: work_items(kl, pi, cu, ns, T=T, S=S, bq=bq),
        dimension_semantics=("arbitrary",),
        vmem_limit_bytes=_vmem_limit(est),
    )


# ----------------------------------------------------------------------------------------------- sparse MLA kernel


def _sparse_body(ql_ref, qpe_ref, kv_ref, sel_ref, o_ref, qf_ref, m_ref, l_ref, acc_ref, *, sm_scale, k_scale,
                 v_scale):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    _, H, L = ql_ref.shape
    c, n_chunks = pl.program_id(1), pl.num_programs(1)
    cdt = ql_ref.dtype

    @pl.when(c == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        qf_ref[:, :L] = ql_ref[0].astype(qf_ref.dtype)
        qf_ref[:, L:] = qpe_ref[0].astype(qf_ref.dtype)

    f32 = np.dtype(cdt) == np.dtype(np.float32)
    prec = jax.lax.Precision.HIGHEST if f32 else None
    scale = sm_scale * (1.0 if k_scale is None else k_scale)
    mm = lambda a, b, dims: jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32,
                                                precision=prec)
    kv = kv_ref[0]  # [bk, L + R]; rows of invalid slots are 0 (selected by the gather)
    if kv.dtype != cdt:  # fp8 -> f32 -> q's dtype: exact
        kv = kv.astype(jnp.float32).astype(cdt)
    s = mm(qf_ref[...].astype(cdt), kv, ((1,), (1,))) * scale  # [H, bk]
    s = jnp.where(sel_ref[0] >= 0, s, -jnp.inf)  # [1, bk] selection mask
    m_prev = m_ref[:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    l_ref[...] = jnp.broadcast_to(alpha * l_ref[:, :1] + jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
    m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
    acc_ref[...] = alpha * acc_ref[...] + mm(p.astype(cdt), kv[:, :L], ((1,), (0,)))

    @pl.when(c == n_chunks - 1)
    def _():
        l = l_ref[:, :1]
        o = acc_ref[...] * jnp.where(l > 0, (1.0 if v_scale is None else v_scale) / jnp.where(l > 0, l, 1.0), 0.0)
        o_ref[0] = o.astype(o_ref.dtype)


def _sparse_out_shape(ql_nope, q_pe, kv_sel, sel, **statics):
    return OutSpec(tuple(ql_nope.shape), ql_nope.dtype)


@tpu_kernel(_sparse_body, name="sparse_mla_attention_kernel", namespace=NAMESPACE, tunables=_SPARSE_TUNABLES,
            heuristic=_sparse_heuristic, out_shape=_sparse_out_shape)
def sparse_kernel(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_sel: torch.Tensor,
    sel: torch.Tensor,
    sm_scale: float = 1.0,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    *,
    block_k: int,
) -> torch.Tensor:
    """Kernel op ``torch.ops.tpukernels.sparse_mla_attention_kernel``: ``ql_nope [T, H, L]``, ``q_pe [T, H, R]``,
    the gathered latent rows ``kv_sel [T, Kp, L + R]`` (0 in invalid slots) and ``sel`` int32 ``[T, 1, Kp]``
    (``>= 0``: the slot is a selected token; ``Kp`` a multiple of ``block_k``); returns ``out [T, H, L]``. See
    :func:`sparse_mla_attention`."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::sparse_mla_attention_kernel"
    for name, x, r in (("ql_nope", ql_nope, 3), ("q_pe", q_pe, 3), ("kv_sel", kv_sel, 3), ("sel", sel, 3)):
        if len(x.shape) != r:
            raise ArgumentError(f"{where}: {name} must have rank {r}, got shape {tuple(x.shape)}")
    T, H, L = (int(d) for d in ql_nope.shape)
    R, Kp, W = int(q_pe.shape[2]), int(kv_sel.shape[1]), int(kv_sel.shape[2])
    if tuple(q_pe.shape[:2]) != (T, H) or W != L + R or int(kv_sel.shape[0]) != T or tuple(sel.shape) != (T, 1, Kp):
        raise ArgumentError(f"{where}: shapes must be ql_nope [T, H, L], q_pe [T, H, R], kv_sel [T, Kp, L + R], "
                            f"sel [T, 1, Kp]; got {tuple(ql_nope.shape)}, {tuple(q_pe.shape)}, {tuple(kv_sel.shape)}, "
                            f"{tuple(sel.shape)}")
    if _dt(sel) != "int32":
        raise DTypeError(f"{where}: sel must be int32, got {_dt(sel)}")
    check_mla_statics(sm_scale, k_scale, v_scale, None, where)
    bk = min(int(block_k), Kp)
    if Kp % bk:
        raise ArgumentError(f"{where}: the padded top-k width Kp = {Kp} must be a multiple of block_k = {bk}")
    it, kit = np.dtype(ql_nope.dtype).itemsize, np.dtype(kv_sel.dtype).itemsize
    tok = lambda t, c: (t, 0, 0)
    est = 2 * H * (2 * L + R) * it + 2 * bk * W * kit + 2 * 8 * bk * 4 + H * (W * 4 + L * 4 + 2 * 128 * 4) \
        + 4 * H * bk * 4
    return Launch(
        grid=(T, Kp // bk),
        in_specs=[pl.BlockSpec((1, H, L), tok), pl.BlockSpec((1, H, R), tok),
                  pl.BlockSpec((1, bk, W), lambda t, c: (t, c, 0)), pl.BlockSpec((1, 1, bk), lambda t, c: (t, 0, c))],
        out_specs=pl.BlockSpec((1, H, L), tok),
        out_shape=OutSpec((T, H, L), ql_nope.dtype),
        scratch_shapes=[
            pltpu.VMEM((H, W), ql_nope.dtype),  # [ql_nope | q_pe]
            pltpu.VMEM((H, 128), jnp.float32),  # running max (lane-broadcast)
            pltpu.VMEM((H, 128), jnp.float32),  # running sum
            pltpu.VMEM((H, L), jnp.float32),  # output accumulator
        ],
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=_vmem_limit(est),
    )


# ----------------------------------------------------------------------------------------------- public ops


def _config_json(kernel, config):
    from collections.abc import Mapping

    from ..targets import config_to_json

    return None if config is None or (isinstance(config, Mapping) and not config) else config_to_json(kernel, config)


def lightning_indexer(q_idx: torch.Tensor, weights: torch.Tensor, index_k_cache: torch.Tensor, kv_lens: torch.Tensor,
                      page_indices: torch.Tensor, cu_q_lens: torch.Tensor, num_seqs, *, sm_scale: float | None = None,
                      k_scale: float | None = None, index_k_scale: torch.Tensor | None = None,
                      config: dict | None = None, interpret: str | None = None) -> torch.Tensor:
    """DeepSeek-V3.2's lightning indexer over a paged index-key cache: the score of every cached token per query.

    Args:
        q_idx: ``[T, Hi, D]`` bfloat16 or float32: indexer queries (``wq_b(q_resid)``, RoPE applied, Hadamard
            rotated if the caller's keys are); ``Hi = index_n_heads`` (64), ``D = index_head_dim`` (128, a
            multiple of 8). All sequences' tokens concatenated (``T`` may include padding rows).
        weights: ``[T, Hi]`` float32 (or q_idx's dtype): per-head weights, transformers'
            ``weights_proj(x) * index_n_heads ** -0.5``.
        index_k_cache: ``[P, page_size, D]``: one index key per cached token (after ``k_norm`` and RoPE), in the
            pages of ``page_indices`` (the latent cache's); q_idx's dtype, or float8_e4m3fn / float8_e5m2 with a
            static ``k_scale``. Not modified.
        kv_lens, page_indices, cu_q_lens, num_seqs: int32 metadata as :func:`mla_ragged_paged_attention`
            (``num_seqs`` may be a Python int).
        sm_scale: scale of the dot products inside the ReLU; default ``D ** -0.5`` (transformers'
            ``softmax_scale``).
        k_scale: static dequantization scale of fp8 index keys (multiplies the dot products).
        index_k_scale: float32 ``[P, page_size]`` or None: a positive dequantization scale per cached token
            (DeepSeek's ``fp8_index`` keys: fp8 with one scale per token), slot for slot with
            ``index_k_cache``. It factors out of the head sum (``ReLU(c x) = c ReLU(x)`` for ``c > 0``), so it
            multiplies the kernel's scores afterwards, gathered per sequence from its pages (``torch.where``
            keeps ``-inf``; slots past ``kv_len`` may hold anything). Positivity is the caller's (not checked).
        config: ``{"block_q": .., "pages_per_block": ..}``; default: a heuristic.
        interpret: ``"fast"`` / ``"tpu"`` for cpu runs.

    Returns:
        float32 ``[T, pages_per_seq * page_size]``: ``scores[t, j] = sum_h weights[t, h] * ReLU(sm_scale *
        k_scale * q_idx[t, h] . k[j])`` for positions ``j <= pos(t)`` of ``t``'s sequence, ``-inf`` elsewhere
        (past the causal position or ``kv_len``, and whole rows no sequence owns).

    Raises:
        ArgumentError: non-tensor arguments; ranks / shapes (``weights [T, Hi]``, ``index_k_cache`` last dim
            ``!= D``, metadata shapes); ``sm_scale`` / ``k_scale`` not finite and > 0; on host tensors the metadata
            values (as :func:`mla_ragged_paged_attention`).
        DTypeError: q_idx not bf16 / f32, weights not f32 / q_idx's dtype, index_k_cache not q_idx's dtype or fp8,
            metadata not int32.
        ConfigError: a bad ``config``.
    """
    from ..dsl.modes import interpret_mode

    where = "tpukernels::lightning_indexer"
    num_seqs = _num_seqs_tensor(num_seqs, getattr(kv_lens, "device", None), where)
    _check_tensors(where, q_idx=q_idx, weights=weights, index_k_cache=index_k_cache, kv_lens=kv_lens,
                   page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs)
    T, Hi, D, P, ps, S, pps = _check_indexer(kv_lens, page_indices, cu_q_lens, num_seqs, q_idx, weights, index_k_cache,
                                             where=where)
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    _check_scale("sm_scale", sm_scale, where, allow_none=False)
    _check_scale("k_scale", k_scale, where)
    if index_k_scale is not None:
        _check_tensors(where, index_k_scale=index_k_scale)
        if tuple(index_k_scale.shape) != (P, ps):
            raise ArgumentError(f"{where}: index_k_scale must have shape [num_pages, page_size] = ({P}, {ps}), got "
                                f"{tuple(index_k_scale.shape)}")
        if index_k_scale.dtype != torch.float32:
            raise DTypeError(f"{where}: index_k_scale must be float32, got {_dt(index_k_scale)}")
    check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, T, P, ps, where, hint=_NEW_TOKENS)
    if T == 0:
        return torch.empty(0, pps * ps, dtype=torch.float32, device=q_idx.device)
    cfg = _config_json(indexer_kernel, config)
    args = (kv_lens, page_indices, cu_q_lens, num_seqs, q_idx, weights.reshape(T, 1, Hi), index_k_cache,
            float(sm_scale), None if k_scale is None else float(k_scale))
    if interpret:
        with interpret_mode(interpret):
            out = torch.ops.tpukernels.lightning_indexer_kernel(*args, config=cfg)
    else:
        out = torch.ops.tpukernels.lightning_indexer_kernel(*args, config=cfg)
    out = out.reshape(T, pps * ps)
    if index_k_scale is not None:
        seq, _ = token_positions_torch(kv_lens, page_indices, cu_q_lens, num_seqs, T=T)
        rows = index_k_scale[page_indices.long().clamp(0, P - 1)].reshape(S, pps * ps)  # [S, max_kv]
        out = torch.where(torch.isneginf(out), out, out * rows[seq])
    return out


def indexer_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` highest-scoring positions per query row of :func:`lightning_indexer`'s scores.

    Args:
        scores: float32 ``[T, max_kv]`` (``-inf``: not visible).
        topk: positive int (DeepSeek-V3.2's ``index_topk``: 2048).

    Returns:
        int32 ``[T, topk]``: positions (within each query's sequence) in descending score order, ties lowest
        index first (a stable sort; ``jax.lax.top_k``'s documented order); ``-1`` in the slots past the tokens a
        query sees (``-inf`` scores) and past ``max_kv``. Why not a kernel: see the module docstring.

    Raises:
        ArgumentError: ``scores`` not a 2-D tensor, ``topk`` not a positive int.
        DTypeError: ``scores`` not float32.
    """
    where = "tpukernels::indexer_topk"
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        raise ArgumentError(f"{where}: scores must be a 2-D [T, max_kv] torch.Tensor, got "
                            f"{type(scores).__name__} {tuple(getattr(scores, 'shape', ()))}")
    if scores.dtype != torch.float32:
        raise DTypeError(f"{where}: scores must be float32, got {_dt(scores)}")
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk <= 0:
        raise ArgumentError(f"{where}: topk must be a positive int, got {topk!r}")
    T, n = scores.shape
    k = min(int(topk), n)
    # a stable descending sort, not torch.topk: topk's order among equal scores is unspecified (on cpu it is not
    # lowest-index-first); this is, as jax.lax.top_k documents
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :k], idx[:, :k]
    idx = torch.where(torch.isneginf(vals), -1, idx).to(torch.int32)
    if k < topk:
        idx = torch.cat([idx, idx.new_full((T, int(topk) - k), -1)], dim=-1)
    return idx


def sparse_mla_attention(ql_nope: torch.Tensor, q_pe: torch.Tensor, cache_kv: torch.Tensor,
                         topk_indices: torch.Tensor, kv_lens: torch.Tensor, page_indices: torch.Tensor,
                         cu_q_lens: torch.Tensor, num_seqs, *, sm_scale: float = 1.0, k_scale: float | None = None,
                         v_scale: float | None = None, config: dict | None = None,
                         interpret: str | None = None) -> torch.Tensor:
    """Absorbed MLA over only the selected cached tokens of each query (DeepSeek-V3.2's sparse attention).

    Args:
        ql_nope, q_pe: ``[T, H, L]`` / ``[T, H, R]`` as :func:`mla_ragged_paged_attention` (bf16 / f32).
        cache_kv: ``[P, page_size, L + R]`` latent cache, this step's latents already written (e.g. by
            :func:`mla_ragged_paged_attention`'s returned cache or the caller's scatter); ql_nope's dtype or fp8
            (``k_scale`` / ``v_scale``). Not modified.
        topk_indices: int32 ``[T, K]``: positions within each query's own sequence (:func:`indexer_topk`);
            ``-1`` (and any position outside ``[0, pos]``) selects nothing. Duplicates count twice (as a dense
            mask would not): pass distinct positions.
        kv_lens, page_indices, cu_q_lens, num_seqs: as :func:`mla_ragged_paged_attention`.
        sm_scale: logit scale (DeepSeek: ``qk_head_dim ** -0.5`` times YaRN's ``mscale ** 2``).
        k_scale, v_scale: static fp8 dequantization scales (logits / output).
        config: ``{"block_k": ..}`` (selected rows gathered per chunk); default 128.
        interpret: ``"fast"`` / ``"tpu"`` for cpu runs.

    Returns:
        ``[T, H, L]`` in ql_nope's dtype: ``softmax_j(sm_scale * (ql_nope . c_kv[j] + q_pe . k_pe[j])) @
        c_kv[j]`` over the selected ``j``; 0 for rows no sequence owns or that select nothing.

    Raises:
        ArgumentError: non-tensor arguments; shapes as :func:`mla_ragged_paged_attention`; ``topk_indices`` not
            ``[T, K]``; bad scales; host metadata values.
        DTypeError: as :func:`mla_ragged_paged_attention`; ``topk_indices`` not int32.
        ConfigError: a bad ``config``.
    """
    from ..dsl.modes import interpret_mode

    where = "tpukernels::sparse_mla_attention"
    num_seqs = _num_seqs_tensor(num_seqs, getattr(kv_lens, "device", None), where)
    _check_tensors(where, ql_nope=ql_nope, q_pe=q_pe, cache_kv=cache_kv, topk_indices=topk_indices, kv_lens=kv_lens,
                   page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs)
    T, H, L, R, P, ps, S, pps = check_mla_shapes(kv_lens, page_indices, cu_q_lens, num_seqs, ql_nope, q_pe, cache_kv,
                                                 where=where)
    check_mla_statics(sm_scale, k_scale, v_scale, None, where)
    K = _check_topk_indices(topk_indices, T, where)
    check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, T, P, ps, where, hint=_NEW_TOKENS)
    if T == 0:
        return ql_nope.new_zeros(ql_nope.shape)
    cfg = _config_json(sparse_kernel, config)  # ConfigError on bad keys / values
    bk = int((config or {}).get("block_k", _SPARSE_TUNABLES["block_k"].default))
    Kp = -(-K // 8) * 8 if K <= bk else -(-K // bk) * bk  # the kernel's chunk: min(block_k, Kp)
    seq, pos = token_positions_torch(kv_lens, page_indices, cu_q_lens, num_seqs, T=T)
    # the gathered rows are [T, Kp, L + R] in HBM: tokens go in chunks of at most ~256 MiB of them (prefill)
    chunk = max(1, min(T, (256 << 20) // (Kp * (L + R) * cache_kv.element_size())))
    outs = []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        kv_sel, sel = gather_selected(cache_kv, topk_indices[t0:t1], kv_lens, page_indices, seq[t0:t1], pos[t0:t1],
                                      width=Kp)
        args = (ql_nope[t0:t1], q_pe[t0:t1], kv_sel, sel, float(sm_scale),
                *(None if x is None else float(x) for x in (k_scale, v_scale)))
        if interpret:
            with interpret_mode(interpret):
                outs.append(torch.ops.tpukernels.sparse_mla_attention_kernel(*args, config=cfg))
        else:
            outs.append(torch.ops.tpukernels.sparse_mla_attention_kernel(*args, config=cfg))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# ----------------------------------------------------------------------------------------------- references


def _seq_rows(cache, page_indices, s, kl, ps):
    return cache[page_indices[s, : -(-kl // ps)].long()].reshape(-1, cache.shape[-1])[:kl]


def lightning_indexer_reference(q_idx, weights, index_k_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                                sm_scale=None, k_scale=None, index_k_scale=None, dtype=torch.float64) -> torch.Tensor:
    """:func:`lightning_indexer` dense per sequence in ``dtype`` (float64) from the given low-precision tensors:
    ``[T, pages_per_seq * page_size]``, ``-inf`` where not visible."""
    T, Hi, D = q_idx.shape
    ps = index_k_cache.shape[1]
    max_kv = page_indices.shape[1] * ps
    scale = (D ** -0.5 if sm_scale is None else sm_scale) * (1.0 if k_scale is None else k_scale)
    out = torch.full((T, max_kv), -math.inf, dtype=dtype)
    wide = index_k_cache.to(torch.float32).to(dtype)
    for s in range(int(num_seqs[0])):
        q0, q1, kl = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        if q1 == q0:
            continue
        k = _seq_rows(wide, page_indices, s, kl, ps)  # [kl, D]
        if index_k_scale is not None:  # dequantize the keys per token, as DeepSeek's fp8_index
            k = k * _seq_rows(index_k_scale.to(dtype)[..., None], page_indices, s, kl, ps)
        sc = torch.relu(torch.einsum("ihd,jd->ihj", q_idx[q0:q1].to(dtype), k) * scale)
        sc = torch.einsum("ihj,ih->ij", sc, weights[q0:q1].to(dtype))
        pos = kl - (q1 - q0) + torch.arange(q1 - q0)[:, None]
        out[q0:q1, :kl] = sc.masked_fill(torch.arange(kl)[None, :] > pos, -math.inf)
    return out


def sparse_mla_attention_reference(ql_nope, q_pe, cache_kv, topk_indices, kv_lens, page_indices, cu_q_lens, num_seqs,
                                   *, sm_scale=1.0, k_scale=None, v_scale=None, dtype=torch.float64) -> torch.Tensor:
    """The dense DSA definition in ``dtype`` (float64): per sequence, the dense absorbed-MLA logits masked to the
    selected positions (a selection mask, ``j <= pos``), softmax over that set, times the latent values:
    ``[T, H, L]`` (0 for rows that select nothing)."""
    L = ql_nope.shape[2]
    ps = cache_kv.shape[1]
    scale = sm_scale * (1.0 if k_scale is None else k_scale)
    out = torch.zeros(ql_nope.shape, dtype=dtype)
    wide = cache_kv.to(torch.float32).to(dtype)
    for s in range(int(num_seqs[0])):
        q0, q1, kl = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        if q1 == q0:
            continue
        lat = _seq_rows(wide, page_indices, s, kl, ps)
        q = torch.cat([ql_nope[q0:q1], q_pe[q0:q1]], dim=-1).to(dtype)
        logits = torch.einsum("ihw,jw->ihj", q, lat) * scale
        sel = torch.zeros(q1 - q0, kl + 1, dtype=torch.bool)
        ix = topk_indices[q0:q1].long()
        sel.scatter_(1, torch.where((ix >= 0) & (ix < kl), ix, kl), True)
        pos = kl - (q1 - q0) + torch.arange(q1 - q0)[:, None]
        sel = sel[:, :kl] & (torch.arange(kl)[None, :] <= pos)
        logits = logits.masked_fill(~sel[:, None, :], -math.inf)
        p = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)  # rows that select nothing: 0
        out[q0:q1] = torch.einsum("ihj,jl->ihl", p, lat[:, :L]) * (1.0 if v_scale is None else v_scale)
    return out


# ----------------------------------------------------------------------------------------------- standard cases


def _indexer_case(T, S, ctx, ps, dtype="bf16"):
    pps = ctx // ps
    return (indexer_kernel, (f"{S}:i32", f"{S}x{pps}:i32", f"{S + 1}:i32", "1:i32", f"{T}x64x128:{dtype}",
                             f"{T}x1x64:f32", f"{S * pps}x{ps}x128:{dtype}"),
            dict(sm_scale=128 ** -0.5, k_scale=None))


def _sparse_case(T, K=2048, dtype="bf16", H=128):
    return (sparse_kernel, (f"{T}x{H}x512:{dtype}", f"{T}x{H}x64:{dtype}", f"{T}x{K}x576:{dtype}", f"{T}x1x{K}:i32"),
            dict(sm_scale=192 ** -0.5, k_scale=None, v_scale=None))


#: DeepSeek-V3.2 decode: 64 sequences x 8192 cached tokens at page size 64 (indexer: 64 heads of 128; sparse
#: MLA: 128 heads, 512 + 64, top-2048), bf16.
STANDARD_CASES = [_indexer_case(64, 64, 8192, 64), _sparse_case(64)]

__all__ = ["lightning_indexer", "indexer_topk", "sparse_mla_attention", "lightning_indexer_reference",
           "sparse_mla_attention_reference", "indexer_kernel", "sparse_kernel", "gather_selected",
           "token_positions_torch",
           "STANDARD_CASES"]
