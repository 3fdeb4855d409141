"""MLA (multi-head latent attention) ragged paged attention over a latent cache, absorbed form, for TPU.

DeepSeek-V2/V3/R1 and Kimi-K2 cache, per token, one compressed latent ``c_kv`` (``kv_lora_rank`` = 512) and one
RoPE key ``k_pe`` (``qk_rope_head_dim`` = 64) shared by all heads, instead of per-head K/V. In the absorbed form
the caller folds the key up-projection into the query (``ql_nope[t, h] = q_nope[t, h] @ W_UK[h]``, ``[T, H, L]``)
and the value up-projection into the output (``out[t, h] @ W_UV[h]``), so attention runs on the latent cache
directly: one "kv head" of width ``L + R`` (576) that every query head reads (MQA), with values its first
``L`` (512) lanes.

Public API (torch tensors; the arguments of tpu-inference 0.32.0's ``mla_ragged_paged_attention``
(``tpu_inference/kernels/mla/v2/kernel.py``) with this project's metadata conventions, those of
:func:`~tpukernels.library.ragged_paged_attention`):

* :func:`mla_ragged_paged_attention` = ``torch.ops.tpukernels.mla_ragged_paged_attention`` (composite) ->
  ``(out, updated cache_kv)``: writes this step's new latents into their cache slots (a scatter of ``T`` rows,
  slots computed from the metadata), then attends (kernel op ``mla_ragged_paged_attention_kernel``);
* :func:`mla_ragged_paged_attention_jax`: the same on jax arrays, trace-safe;
* :func:`mla_attention_reference`: the float64 reference (absorbed form).

Layout::

    ql_nope       [T, H, L]                q_nope absorbed by W_UK (L = kv_lora_rank), all sequences' tokens
    q_pe          [T, H, R]                RoPE part of the query (R = qk_rope_head_dim), rotated by the caller
    new_kv_c      [T, L]                   this step's latents c_kv (normalised: kv_a_layernorm applied)
    new_k_pe      [T, R]                   this step's rotated RoPE keys
    cache_kv      [P, page_size, W]        c_kv in lanes [0, L), k_pe in [L, L + R); W = L + R, or
                                           align(L, 128) + align(R, 128) (tpu-inference's padded rows; the
                                           pad lanes are never read and written 0)
    kv_lens       int32 [S]                cached tokens per sequence, this step's new ones included
    page_indices  int32 [S, pages_per_seq] page p of sequence s is cache_kv[page_indices[s, p]]
    cu_q_lens     int32 [S + 1]            sequence s owns rows [cu_q_lens[s], cu_q_lens[s + 1])
    num_seqs      int32 [1]                sequences in use (<= S)
    out           [T, H, L]                ql_nope's dtype; rows no sequence owns are 0

What it computes: token ``t = cu_q_lens[s] + i`` of sequence ``s`` (``q_len = cu_q_lens[s+1] - cu_q_lens[s]``)
sits at position ``pos = kv_len - q_len + i``; its latents go to cache slot ``pos`` of the sequence
(page ``page_indices[s, pos // page_size]``, row ``pos % page_size``), and then, for each head ``h``, over the
sequence's cached tokens ``j <= pos`` (causal, bottom-right aligned, as :func:`ragged_paged_attention`)::

    score[j]   = sm_scale * k_scale * q_scale * (ql_nope[t, h] . c_kv[j] + q_pe[t, h] . k_pe[j])  (f32)
    out[t, h]  = v_scale * softmax_j(score) @ c_kv[j]                                             [L]

which equals unabsorbed MLA, ``softmax(q_nope . k_nope + q_pe . k_pe) @ v`` with ``k_nope = c_kv @ W_UK^T``,
``v = c_kv @ W_UV^T``, once the caller applies ``W_UV`` to ``out`` (``tests/test_mla_attention.py`` checks
both forms against float64). This is dense MLA: every cached token is attended. DeepSeek-V3.2's sparse
DSA path (an indexer selecting top-k tokens) is not this kernel.

Softmax scale: ``sm_scale`` is the caller's (tpu-inference's default 1.0); DeepSeek's is
``qk_head_dim ** -0.5`` (``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``, 192) times ``mscale ** 2``
under YaRN rope scaling (``mscale = 0.1 * mscale_all_dim * log(factor) + 1``, transformers'
``DeepseekV3Attention.scaling``): that product is what to pass.

fp8 latent cache (``float8_e4m3fn`` / ``float8_e5m2``): ``new_kv_c`` / ``new_k_pe`` come quantized in the
cache's dtype (as tpu-inference requires) and static ``k_scale`` / ``v_scale`` dequantize it (tpu-inference has
only static scales for MLA; no per-token scales here either). Pages are widened to the query dtype in VMEM
(fp8 values are exact in bf16); ``k_scale`` folds into the logit scale and ``v_scale`` into the output, so no
scaled tile is rounded. ``q_scale`` (a static query dequantization scale in tpu-inference) folds into the
logits likewise; the query itself is bfloat16 / float32 here.

Kernel (written with the tpukernels DSL). The schedule of :func:`ragged_paged_attention`: work items are
(query block, sequence) pairs computed on device from ``cu_q_lens`` (``Launch.prefetch``); the H heads of a
query block are folded into ``block_q * H`` rows (DeepSeek decode: 128 rows for one token) whose query is
``[ql_nope | q_pe]`` (576 lanes) in VMEM, so the score is one matmul over the cached ``[c_kv | k_pe]`` rows
and the value product a second over their first ``L`` lanes (the latent page is read once for both). The
sequence's pages (only those below ``kv_len``, and only the kv blocks its rows can see) are DMA'd from HBM
(``pl.ANY``) ``pages_per_block`` at a time into a double buffer, the next block fetched while the current
is computed; online softmax with the running max / sum and an f32 ``[rows, L]`` accumulator in VMEM. Slots
past ``kv_len`` and pages no sequence uses may hold anything (NaN included): they are selected away
(``jnp.where``), never multiplied by 0. The cache write runs before the kernel as an XLA / torch scatter of
the ``T`` new rows (a Pallas row DMA into the ``[P, page_size, L + R]`` HBM cache does not compile: Mosaic
needs tile-aligned offsets along ``page_size``, a tiled dimension of that layout; tpu-inference's packed
``[P, page_size / packing, packing, W]`` layout is what lets its v2 kernel write in place). It compiles
for v5e, v6e and tpu7x (libtpu compile-only: :data:`STANDARD_CASES`, DeepSeek-V3 decode and mixed batches
at page size 64 / 128, bf16 and fp8 caches); it has not run on a TPU.

Performance: not measured (no TPU) and not estimated: libtpu 0.0.52's static profiler aborts on this kernel at
the 576-lane cache (``llo_execution_graph.cc:46``, v5e / v6e / tpu7x; it compiles) and on tpu-inference's MLA v2
(``llo_execution_graph.cc:146``); with a 640-lane cache it answers below the MXU floor (v6e, DeepSeek-V3
decode 64 x 8192: 27 us vs 159 us), so no credible figure. Rooflines of that decode (bf16, 128 heads, the
batch's latent pages read once): v5e HBM 758 us / MXU 741 us (both bound: 128 heads give ~240 flop per
cached byte), v6e 379 / 159 us, tpu7x 168 / 126 us (HBM-bound).

Differences from tpu-inference's MLA v2 kernel: ``ql_nope`` and ``out`` are token-major ``[T, H, L]`` (v2:
head-major ``[H, T, L]``; v1 and its reference: ``[T, H, L]``, as here); the cache is ``[P, page_size, L + R]``
unpadded (v2: ``[P, page_size / packing, packing, align(L, 128) + align(R, 128)]``, k_pe padded to 128
lanes); ``page_indices`` is 2-D ``[S, pages_per_seq]`` (v2: flattened); ``num_seqs [1]`` replaces
``distribution [3]`` (``distribution[2]`` is the sequence count; decode, prefill and mixed sequences go in one
call, in any order); the cache write is a scatter before the ``pallas_call`` (v2 fuses it, with the cache
donated); sliding window, soft cap and ``mask_value`` are not supported (DeepSeek / Kimi use none);
``chunk_prefill_size``, ``decode_batch_size``, block sizes per case and ``s_dtype`` are replaced by this
module's ``config`` (``block_q``, ``pages_per_block``). **Functional**: ``cache_kv`` is not modified; the
updated cache is returned (one cache copy per call: XLA copies the aliased input that is not donated).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import numpy as np
import torch

from ..dsl import Launch, OutSpec, Tunable, cdiv, tpu_kernel
from ..errors import ArgumentError, DTypeError
from .paged_attention import check_metadata, check_metadata_values, item_range, n_work_items, work_items

NAMESPACE = "tpukernels"
_Q_DTYPES = ("bfloat16", "float32")
_FP8 = ("float8_e4m3fn", "float8_e5m2")
#: the ``q_len > kv_len`` rule, in this op's terms
_NEW_TOKENS = ("kv_lens counts this step's new tokens (their latents are written at positions kv_len - q_len .. "
               "kv_len - 1), so q_len <= kv_len")

# ----------------------------------------------------------------------------------------------- tunables

_TUNABLES = {
    "block_q": Tunable((1, 2, 4, 8, 16, 32, 64), default=2,
                       doc="query tokens per block; its H heads fold into block_q * H rows"),
    "pages_per_block": Tunable((1, 2, 4, 8, 16, 32, 64), default=8,
                               doc="latent pages gathered per DMA block (clamped to pages_per_seq)"),
}


def _heuristic(kv_lens, page_indices, cu_q_lens, num_seqs, ql_nope, q_pe, cache_kv, *extras, **statics):
    """Defaults when no tuning entry applies: one token per block for decode-like batches (``T <= S``), else
    about 256 rows (``block_q * H``); about 512 cached tokens per kv block."""
    if len(ql_nope.shape) != 3 or len(cache_kv.shape) != 3 or len(page_indices.shape) != 2:
        return {}
    T, H, S, ps = int(ql_nope.shape[0]), int(ql_nope.shape[1]), int(page_indices.shape[0]), int(cache_kv.shape[1])
    pow2 = lambda n: 1 << (max(1, n).bit_length() - 1)
    bq = 1 if T <= S else min(64, pow2(256 // max(H, 1)), pow2(T))
    return {"block_q": bq, "pages_per_block": min(64, pow2(512 // max(ps, 1)))}


# ----------------------------------------------------------------------------------------------- checks


def _dt(x) -> str:
    return np.dtype(x.dtype).name if not isinstance(x, torch.Tensor) else str(x.dtype).replace("torch.", "")


def padded_width(L: int, R: int) -> int:
    """The cache row width of tpu-inference's MLA v2 layout: ``align(L, 128) + align(R, 128)`` (k_pe padded to
    128 lanes; the pad lanes are never read here: selected to 0 in VMEM)."""
    return -(-L // 128) * 128 + -(-R // 128) * 128


def _check_shapes(kv_lens, page_indices, cu_q_lens, num_seqs, ql_nope, q_pe, cache_kv, *, where: str):
    """Ranks, shape agreement and dtypes of the attention operands; returns ``(T, H, L, R, P, ps, S, pps)``."""
    ranks = (("ql_nope", ql_nope, 3, "[T, H, kv_lora_rank]"), ("q_pe", q_pe, 3, "[T, H, rope_dim]"),
             ("cache_kv", cache_kv, 3, "[num_pages, page_size, kv_lora_rank + rope_dim]"),
             ("kv_lens", kv_lens, 1, "[S]"), ("page_indices", page_indices, 2, "[S, pages_per_seq]"),
             ("cu_q_lens", cu_q_lens, 1, "[S + 1]"), ("num_seqs", num_seqs, 1, "[1]"))
    for name, x, r, shape in ranks:
        if len(x.shape) != r:
            raise ArgumentError(f"{where}: {name} must have rank {r} {shape}, got shape {tuple(x.shape)}")
    T, H, L = (int(d) for d in ql_nope.shape)
    P, ps, W = (int(d) for d in cache_kv.shape)
    S, pps = (int(d) for d in page_indices.shape)
    R = int(q_pe.shape[2])
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("num_seqs", num_seqs)):
        if _dt(x) != "int32":
            raise DTypeError(f"{where}: {name} must be int32, got {_dt(x)}")
    if _dt(ql_nope) not in _Q_DTYPES:
        raise DTypeError(f"{where}: ql_nope dtype {_dt(ql_nope)} is not supported; use bfloat16 or float32")
    if _dt(q_pe) != _dt(ql_nope):
        raise DTypeError(f"{where}: q_pe dtype {_dt(q_pe)} must equal ql_nope's ({_dt(ql_nope)})")
    if _dt(cache_kv) != _dt(ql_nope) and _dt(cache_kv) not in _FP8:
        raise DTypeError(f"{where}: cache_kv dtype {_dt(cache_kv)} must equal ql_nope's ({_dt(ql_nope)}) or be "
                         f"float8_e4m3fn / float8_e5m2 (with k_scale / v_scale; integer caches are not supported, "
                         f"as in tpu-inference)")
    if tuple(q_pe.shape[:2]) != (T, H):
        raise ArgumentError(f"{where}: q_pe must have shape [T, H, rope_dim] with ql_nope's T, H = ({T}, {H}), got "
                            f"{tuple(q_pe.shape)}")
    if L == 0 or L % 128:
        raise ArgumentError(f"{where}: kv_lora_rank L = ql_nope.shape[2] = {L} must be a positive multiple of 128 "
                            f"(the value lanes of the latent; DeepSeek / Kimi: 512)")
    if R == 0 or R % 8:
        raise ArgumentError(f"{where}: rope_dim R = q_pe.shape[2] = {R} must be a positive multiple of 8 "
                            f"(DeepSeek / Kimi: 64)")
    if W not in (L + R, padded_width(L, R)):
        raise ArgumentError(f"{where}: cache_kv last dim {W} must be kv_lora_rank + rope_dim = {L} + {R} = {L + R} "
                            f"(c_kv then k_pe per token), or {padded_width(L, R)} (k_pe padded to 128 lanes: "
                            f"tpu-inference's MLA v2 layout)")
    if H == 0:
        raise ArgumentError(f"{where}: ql_nope must have at least one head, got shape {tuple(ql_nope.shape)}")
    if ps == 0 or P == 0:
        raise ArgumentError(f"{where}: cache_kv must have num_pages > 0 and page_size > 0, got "
                            f"{tuple(cache_kv.shape)}")
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
    return T, H, L, R, P, ps, S, pps


def _check_new(new_kv_c, new_k_pe, cache_kv, T: int, L: int, R: int, where: str) -> None:
    """This step's latents: ``new_kv_c [T, L]``, ``new_k_pe [T, R]`` in the cache's dtype."""
    for name, t, d in (("new_kv_c", new_kv_c, L), ("new_k_pe", new_k_pe, R)):
        if tuple(t.shape) != (T, d):
            raise ArgumentError(f"{where}: {name} must have shape [T, {'kv_lora_rank' if d == L else 'rope_dim'}] = "
                                f"({T}, {d}), got {tuple(t.shape)}")
        if _dt(t) != _dt(cache_kv):
            raise DTypeError(f"{where}: {name} dtype {_dt(t)} must equal cache_kv's {_dt(cache_kv)} (quantize fp8 "
                             f"latents before, as tpu-inference requires)")


def _check_statics(sm_scale, k_scale, v_scale, q_scale, where: str) -> None:
    if isinstance(sm_scale, bool) or not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        raise ArgumentError(f"{where}: sm_scale must be a finite float (DeepSeek: qk_head_dim ** -0.5 * mscale ** 2), "
                            f"got {sm_scale!r}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale), ("q_scale", q_scale)):
        if s is not None and (isinstance(s, bool) or not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0)):
            raise ArgumentError(f"{where}: {name} must be None or a finite float > 0, got {s!r}")


#: public names of the checks (the DSA module validates the same MLA operands); the kernel sources keep theirs
check_mla_shapes, check_mla_statics = _check_shapes, _check_statics


# ----------------------------------------------------------------------------------------------- cache write


def new_token_slots(kv_lens, page_indices, cu_q_lens, num_seqs, *, T: int, P: int, ps: int):
    """Cache slot (``page * page_size + row``) of each of the ``T`` query tokens, -1 for rows no sequence owns
    (jax, on device: the JAX entry's write). Out-of-range metadata gives -1, never a slot outside the cache."""
    import jax
    import jax.numpy as jnp

    S, pps = page_indices.shape
    n = jnp.clip(num_seqs[0], 0, S)
    cu = jnp.where(jnp.arange(S + 1) <= n, jnp.clip(cu_q_lens, 0, T), 0)
    cu = jax.lax.cummax(cu, axis=0)  # non-decreasing, constant past num_seqs: searchsorted's precondition
    t = jnp.arange(T, dtype=jnp.int32)
    s = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, S - 1).astype(jnp.int32)
    q0, q1 = cu[s], cu[s + 1]
    pos = kv_lens[s] - (q1 - q0) + (t - q0)
    ok = (t < cu[-1]) & (pos >= 0) & (pos < pps * ps)  # cu[-1] = cu[num_seqs]: constant past it
    page = page_indices[s, jnp.clip(pos // ps, 0, pps - 1)]
    ok = ok & (page >= 0) & (page < P)
    return jnp.where(ok, page * ps + pos % ps, -1).astype(jnp.int32)


def new_token_slots_torch(kv_lens, page_indices, cu_q_lens, num_seqs, *, T: int, P: int, ps: int) -> torch.Tensor:
    """:func:`new_token_slots` in torch ops (the torch op's write; any device, fake tensors included): int64 ``[T]``,
    -1 for rows no sequence owns."""
    S, pps = page_indices.shape
    dev = kv_lens.device
    n = num_seqs[0].clamp(0, S)
    cu = torch.where(torch.arange(S + 1, device=dev) <= n, cu_q_lens.clamp(0, T), 0).cummax(0).values
    t = torch.arange(T, device=dev)
    s = torch.searchsorted(cu[1:].contiguous(), t.to(cu.dtype), right=True).clamp(0, S - 1)
    q0, q1 = cu[s].long(), cu[s + 1].long()
    pos = kv_lens[s].long() - (q1 - q0) + (t - q0)
    ok = (t < cu[-1].long()) & (pos >= 0) & (pos < pps * ps)  # cu[-1] = cu[num_seqs]: constant past it
    page = page_indices[s, (pos // ps).clamp(0, pps - 1)].long()
    ok = ok & (page >= 0) & (page < P)
    return torch.where(ok, page * ps + pos % ps, -1)


def write_latents(cache_kv: torch.Tensor, new_kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache_kv [P, page_size, W]`` with row ``t`` of ``new_kv [T, W]`` at slot ``slots[t]`` (-1: skipped);
    a new tensor (one cache copy), written as bytes (fp8 caches included)."""
    P, ps, W = cache_kv.shape
    flat = torch.cat([cache_kv.reshape(P * ps, W), cache_kv.new_zeros(1, W)])  # one extra row takes the skips
    idx = torch.where(slots >= 0, slots, P * ps)
    flat.view(torch.uint8).index_copy_(0, idx, new_kv.contiguous().view(torch.uint8))
    return flat[: P * ps].reshape(P, ps, W)


# ----------------------------------------------------------------------------------------------- attention body


def _mla_body(kv_lens, page_indices, cu_q_lens, num_seqs, item_seq, item_blk, ql_ref, qpe_ref, cache_hbm, o_ref,
              kv_buf, sems, qf_ref, m_ref, l_ref, acc_ref, slot_ref, *, sm_scale, k_scale, v_scale, q_scale):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    del num_seqs
    bq, H, L = ql_ref.shape
    R = qpe_ref.shape[2]
    _, ppb, ps, W = kv_buf.shape
    rows, bkv, n_pages = bq * H, ppb * ps, cache_hbm.shape[0]
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
                fn(pltpu.make_async_copy(cache_hbm.at[src], kv_buf.at[slot, p], sems.at[slot]))

    start, wait = (lambda c: c.start()), (lambda c: c.wait())
    _, _, prev_lo, prev_hi = rng(jnp.maximum(i - 1, 0))
    prefetched = (i > 0) & (prev_lo < prev_hi)  # the previous item fetched our first block

    @pl.when(i == 0)
    def _():
        slot_ref[0] = 0

    @pl.when((kb_lo < kb_hi) & jnp.logical_not(prefetched))
    def _():
        page_copies(seq, kv_len, kb_lo, slot_ref[0], start)

    blk = item_blk[i]
    first = (i == 0) | (item_blk[jnp.maximum(i - 1, 0)] != blk)
    last = (i == n_items - 1) | (item_blk[jnp.minimum(i + 1, n_items - 1)] != blk)
    cdt = ql_ref.dtype

    @pl.when(first)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        # heads folded into rows (row = token_in_block * H + head), [ql_nope | q_pe] side by side; folded through
        # f32 (scratch in f32) when H is not a multiple of the packed dtype's sublane tile (no packed reshapes)
        qf_ref[:, :L] = ql_ref[...].astype(qf_ref.dtype).reshape(rows, L)
        qf_ref[:, L:L + R] = qpe_ref[...].astype(qf_ref.dtype).reshape(rows, R)
        if W > L + R:  # a padded cache row (tpu-inference's layout): the query's pad lanes are 0
            qf_ref[:, L + R:] = jnp.zeros((rows, W - L - R), qf_ref.dtype)

    f32 = np.dtype(cdt) == np.dtype(np.float32)
    prec = jax.lax.Precision.HIGHEST if f32 else None
    scale = sm_scale * (1.0 if k_scale is None else k_scale) * (1.0 if q_scale is None else q_scale)
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
            tok = blk * bq + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), H)
            own = (tok >= q0) & (tok < q1)
            pos = jnp.where(own, kv_len - (q1 - q0) + tok - q0, -1)  # -1: sees nothing
            vis = (kb * bkv + jax.lax.broadcasted_iota(jnp.int32, (1, bkv), 1)) <= pos
            vrow = (kb * bkv + jax.lax.broadcasted_iota(jnp.int32, (bkv, 1), 0)) < kv_len
            kv = kv_buf[slot].reshape(bkv, W)
            if kv.dtype != cdt:  # fp8 -> f32 -> q's dtype: exact (fp8 values are bf16 values)
                kv = kv.astype(jnp.float32).astype(cdt)
            if W > L + R:  # the pad lanes of a padded cache may hold anything: selected away, not multiplied by 0
                kv = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (1, W), 1) < L + R, kv, jnp.zeros((), cdt))
            s = mm(qf_ref[...].astype(cdt), kv, ((1,), (1,))) * scale  # [rows, bkv]: nope and rope parts at once
            s = jnp.where(vis, s, -jnp.inf)
            v = jnp.where(vrow, kv[:, :L], jnp.zeros((), cdt))  # slots past kv_len may hold NaN: selected away
            m_prev = m_ref[:, :1]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe)
            l_ref[...] = jnp.broadcast_to(alpha * l_ref[:, :1] + jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
            m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
            pv = mm(p.astype(cdt), v, ((1,), (0,)))
            # select, not multiply: rows of another sequence (or padding) must not take this one's NaNs
            acc_ref[...] = alpha * acc_ref[...] + jnp.where(own, pv, 0.0)
            slot_ref[0] = 1 - slot

        return carry

    jax.lax.fori_loop(0, cdiv(pps, ppb), kv_step, 0)

    @pl.when(last)
    def _():
        l = l_ref[:, :1]
        o = acc_ref[...] * jnp.where(l > 0, (1.0 if v_scale is None else v_scale) / jnp.where(l > 0, l, 1.0), 0.0)
        o_ref[...] = o.reshape(bq, H, L).astype(o_ref.dtype)


def _vmem_limit(est_bytes: int) -> int | None:
    """Scoped VMEM to request: the chip default for small footprints, else room for Mosaic's temporaries,
    capped at 40 MiB (tpu7x has 64 MiB per core)."""
    return None if est_bytes <= 6 << 20 else int(min(40 << 20, 2 * est_bytes + (8 << 20)))


def _mla_out_shape(kv_lens, page_indices, cu_q_lens, num_seqs, ql_nope, q_pe, cache_kv, **statics):
    return OutSpec(tuple(ql_nope.shape), ql_nope.dtype)


@tpu_kernel(_mla_body, name="mla_ragged_paged_attention_kernel", namespace=NAMESPACE, tunables=_TUNABLES,
            heuristic=_heuristic, out_shape=_mla_out_shape)
def mla_kernel(
    kv_lens: torch.Tensor,
    page_indices: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_seqs: torch.Tensor,
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache_kv: torch.Tensor,
    sm_scale: float = 1.0,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    q_scale: Optional[float] = None,
    *,
    block_q: int,
    pages_per_block: int,
) -> torch.Tensor:
    """Kernel op ``torch.ops.tpukernels.mla_ragged_paged_attention_kernel``: the scalar-prefetch operands
    (``kv_lens, page_indices, cu_q_lens, num_seqs``) first, then ``ql_nope [T, H, L]``, ``q_pe [T, H, R]`` and
    the (already updated) ``cache_kv [P, page_size, L + R]``; returns ``out [T, H, L]``. See
    :func:`mla_ragged_paged_attention`."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::mla_ragged_paged_attention_kernel"
    T, H, L, R, P, ps, S, pps = _check_shapes(kv_lens, page_indices, cu_q_lens, num_seqs, ql_nope, q_pe, cache_kv,
                                              where=where)
    _check_statics(sm_scale, k_scale, v_scale, q_scale, where)
    bq, ppb = int(block_q), min(int(pages_per_block), pps)
    rows, bkv, W = bq * H, ppb * ps, int(cache_kv.shape[2])
    idx = lambda i, kl, pi, cu, ns, iseq, iblk: (iblk[i], 0, 0)
    it, kit = np.dtype(ql_nope.dtype).itemsize, np.dtype(cache_kv.dtype).itemsize
    est = (2 * bq * H * (2 * L + R) * it + 2 * bkv * W * kit + rows * (W * 4 + L * 4 + 2 * 128 * 4)
           + 4 * rows * bkv * 4 + bkv * W * it)
    return Launch(
        grid=(n_work_items(T, S, bq) if T > 0 else 0,),
        in_specs=[pl.BlockSpec((bq, H, L), idx), pl.BlockSpec((bq, H, R), idx), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((bq, H, L), idx),
        out_shape=OutSpec((T, H, L), ql_nope.dtype),
        scratch_shapes=[
            pltpu.VMEM((2, ppb, ps, W), cache_kv.dtype),  # latent page double buffer
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((rows, W), ql_nope.dtype if H % (32 // it) == 0 else jnp.float32),  # [ql_nope | q_pe]
            pltpu.VMEM((rows, 128), jnp.float32),  # running max (lane-broadcast)
            pltpu.VMEM((rows, 128), jnp.float32),  # running sum
            pltpu.VMEM((rows, L), jnp.float32),  # output accumulator
            pltpu.SMEM((1,), jnp.int32),  # current buffer slot
        ],
        num_scalar_prefetch=4,
        prefetch=lambda kl, pi, cu, ns: work_items(kl, pi, cu, ns, T=T, S=S, bq=bq),
        dimension_semantics=("arbitrary",),
        vmem_limit_bytes=_vmem_limit(est),
    )


# ----------------------------------------------------------------------------------------------- public ops


def _mla_impl(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens, num_seqs,
              sm_scale=1.0, k_scale=None, v_scale=None, q_scale=None, config=None):
    where = "tpukernels::mla_ragged_paged_attention"
    for name, t in (("ql_nope", ql_nope), ("q_pe", q_pe), ("new_kv_c", new_kv_c), ("new_k_pe", new_k_pe),
                    ("cache_kv", cache_kv), ("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    T, H, L, R, P, ps, S, pps = _check_shapes(kv_lens, page_indices, cu_q_lens, num_seqs, ql_nope, q_pe, cache_kv,
                                              where=where)
    _check_new(new_kv_c, new_k_pe, cache_kv, T, L, R, where)
    _check_statics(sm_scale, k_scale, v_scale, q_scale, where)
    if cache_kv.requires_grad and torch.is_grad_enabled():
        raise ArgumentError(f"{where}: cache_kv requires grad: a latent cache is state, not a differentiable input "
                            f"(this op has no backward); pass cache_kv.detach() or call under torch.no_grad()")
    check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, T, P, ps, where, hint=_NEW_TOKENS)
    if T == 0:
        return ql_nope.new_zeros(ql_nope.shape), cache_kv.clone()
    meta = (kv_lens, page_indices, cu_q_lens, num_seqs)
    slots = new_token_slots_torch(*meta, T=T, P=P, ps=ps)
    pad = [new_kv_c.new_zeros(T, cache_kv.shape[2] - L - R)] if cache_kv.shape[2] > L + R else []
    cache = write_latents(cache_kv, torch.cat([new_kv_c, new_k_pe] + pad, dim=-1), slots)
    out = torch.ops.tpukernels.mla_ragged_paged_attention_kernel(*meta, ql_nope, q_pe, cache, float(sm_scale), k_scale,
                                                                 v_scale, q_scale, config=config)
    return out, cache


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("mla_ragged_paged_attention(Tensor ql_nope, Tensor q_pe, Tensor new_kv_c, Tensor new_k_pe, "
            "Tensor cache_kv, Tensor kv_lens, Tensor page_indices, Tensor cu_q_lens, Tensor num_seqs, "
            "float sm_scale=1.0, float? k_scale=None, float? v_scale=None, float? q_scale=None, "
            "str? config=None) -> (Tensor, Tensor)")
_LIB.impl("mla_ragged_paged_attention", _mla_impl, "CompositeImplicitAutograd")


def _num_seqs_tensor(num_seqs, device, where: str):
    if isinstance(num_seqs, (bool, np.bool_)):
        raise ArgumentError(f"{where}: num_seqs must be an int32 [1] tensor or a Python int count of sequences, got "
                            f"bool {num_seqs!r} (a bool is not a count)")
    if isinstance(num_seqs, numbers.Integral):
        return torch.tensor([int(num_seqs)], dtype=torch.int32, device=device)
    return num_seqs


def mla_ragged_paged_attention(ql_nope: torch.Tensor, q_pe: torch.Tensor, new_kv_c: torch.Tensor,
                               new_k_pe: torch.Tensor, cache_kv: torch.Tensor, kv_lens: torch.Tensor,
                               page_indices: torch.Tensor, cu_q_lens: torch.Tensor, num_seqs: torch.Tensor, *,
                               sm_scale: float = 1.0, k_scale: float | None = None, v_scale: float | None = None,
                               q_scale: float | None = None, config: dict | None = None,
                               interpret: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA ragged paged attention over a latent cache (absorbed form), with this step's cache write.

    ``torch.ops.tpukernels.mla_ragged_paged_attention``. Mixed prefill + decode in one call; the arguments of
    tpu-inference's ``mla_ragged_paged_attention`` (see the module docstring for the differences).

    Args:
        ql_nope: ``[T, H, L]`` bfloat16 or float32: ``q_nope`` of each head times that head's ``W_UK``
            (``L = kv_lora_rank``, a multiple of 128; DeepSeek-V3 / Kimi-K2: 512), all sequences' tokens
            concatenated (``T`` may include padding rows).
        q_pe: ``[T, H, R]``, ql_nope's dtype: the rotated RoPE part of the query (``R = qk_rope_head_dim``, a
            multiple of 8; 64).
        new_kv_c: ``[T, L]``, cache_kv's dtype: this step's latents (after ``kv_a_layernorm``), row ``t`` for
            query token ``t``; rows no sequence owns are not written.
        new_k_pe: ``[T, R]``, cache_kv's dtype: this step's rotated RoPE keys.
        cache_kv: ``[num_pages, page_size, W]``: ``c_kv`` then ``k_pe`` per token, ``W = L + R`` or
            ``padded_width(L, R)`` (tpu-inference's rows, k_pe padded to 128 lanes); ql_nope's dtype, or
            float8_e4m3fn / float8_e5m2 (dequantized by ``k_scale`` / ``v_scale``, widened in VMEM). Not modified.
        kv_lens: int32 ``[S]``: cached tokens per sequence, this step's new tokens included.
        page_indices: int32 ``[S, pages_per_seq]``: the cache pages of each sequence, in order.
        cu_q_lens: int32 ``[S + 1]``: sequence ``s`` owns rows ``[cu_q_lens[s], cu_q_lens[s+1])``;
            ``cu_q_lens[0] = 0``, non-decreasing, ``q_len <= kv_len``.
        num_seqs: int32 ``[1]`` (or a Python int, not a bool): sequences in use (tpu-inference's
            ``distribution[2]``).
        sm_scale: logit scale (tpu-inference's default 1.0). DeepSeek: ``qk_head_dim ** -0.5`` times
            YaRN's ``mscale ** 2`` (transformers' ``DeepseekV3Attention.scaling``); the caller folds it in.
        k_scale: static dequantization scale of the cached keys (``c_kv`` and ``k_pe``): multiplies the logits.
        v_scale: static dequantization scale of the cached values (``c_kv``): multiplies the output.
        q_scale: static query scale (tpu-inference's, for quantized queries): multiplies the logits.
        config: ``{"block_q": .., "pages_per_block": ..}``; default: tuned per chip, else a heuristic.
        interpret: ``"fast"`` / ``"tpu"`` for cpu runs (see :mod:`tpukernels.dsl.modes`).

    Returns:
        ``(out, cache)``: ``out [T, H, L]`` in ql_nope's dtype (rows no sequence owns, and rows that see no
        token, are 0; apply ``W_UV`` per head for the attention output), and the updated cache (``cache_kv``
        with this step's latents at their slots), as tpu-inference returns it.

    Raises:
        ArgumentError: a tensor argument that is not a torch.Tensor (``num_seqs``: nor an int; a bool is
            refused); ranks / shapes (``q_pe [T, H, R]``, ``new_kv_c [T, L]``, ``new_k_pe [T, R]``,
            ``cache_kv`` last dim neither ``L + R`` nor ``padded_width(L, R)``, ``L`` not a multiple of 128, ``kv_lens [S]``, ``cu_q_lens
            [S + 1]``, ``num_seqs [1]``); bad statics; ``cache_kv`` requiring grad under grad mode; on host
            (cpu) tensors also the values: a page index out of ``[0, num_pages)``, ``kv_len > pages_per_seq *
            page_size``, ``cu_q_lens[0] != 0``, ``cu_q_lens`` decreasing or past ``T``, ``q_len > kv_len``,
            ``num_seqs`` out of ``[0, S]``. Device tensors are not synced to check values; the kernels clamp
            them (a defined, wrong, result; never an access outside the cache).
        DTypeError: ql_nope not bf16/f32, q_pe not ql_nope's dtype, cache_kv not ql_nope's dtype or fp8,
            new_kv_c / new_k_pe not cache_kv's dtype, index arrays not int32.
        ConfigError: ``config`` is not a dict of JSON values, or names unknown tunables / breaks their rules.
    """
    from collections.abc import Mapping

    from ..dsl.modes import interpret_mode
    from ..targets import config_to_json

    where = "tpukernels::mla_ragged_paged_attention"
    num_seqs = _num_seqs_tensor(num_seqs, getattr(kv_lens, "device", None), where)
    for name, t in (("ql_nope", ql_nope), ("q_pe", q_pe), ("new_kv_c", new_kv_c), ("new_k_pe", new_k_pe),
                    ("cache_kv", cache_kv), ("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {name} must be a torch.Tensor" + (" (or a Python int)" if name == "num_seqs"
                                else "") + f", got {type(t).__name__}")
    _check_statics(sm_scale, k_scale, v_scale, q_scale, where)
    cfg = None if config is None or (isinstance(config, Mapping) and not config) else config_to_json(mla_kernel, config)
    args = (ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens, num_seqs, float(sm_scale),
            *(None if x is None else float(x) for x in (k_scale, v_scale, q_scale)), cfg)
    if interpret:
        with interpret_mode(interpret):
            return torch.ops.tpukernels.mla_ragged_paged_attention(*args)
    return torch.ops.tpukernels.mla_ragged_paged_attention(*args)


# ----------------------------------------------------------------------------------------------- JAX entry


def mla_ragged_paged_attention_jax(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens,
                                   num_seqs, *, sm_scale=1.0, k_scale=None, v_scale=None, q_scale=None, config=None,
                                   interpret=None):
    """:func:`mla_ragged_paged_attention` on jax arrays; trace-safe (``jax.jit``, ``shard_map``): built on
    :func:`tpukernels.jax_call`, Mosaic when lowered for TPU, the interpreter on cpu.

    Arguments, semantics, layouts and the ``(out, cache)`` result are those of
    :func:`mla_ragged_paged_attention` (jax arrays instead of torch tensors).

    Raises:
        ArgumentError / DTypeError: as :func:`mla_ragged_paged_attention`, before any kernel runs. The value
            rules are checked when the metadata is concrete (not a tracer); traced metadata is clamped by the
            kernels, which never read or write outside the cache.
        ConfigError: a bad ``config``.
    """
    import jax
    import jax.numpy as jnp

    from ..targets.jax_entry import jax_call

    where = "tpukernels::mla_ragged_paged_attention"
    for name, t in (("ql_nope", ql_nope), ("q_pe", q_pe), ("new_kv_c", new_kv_c), ("new_k_pe", new_k_pe),
                    ("cache_kv", cache_kv), ("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if isinstance(t, torch.Tensor) or not (hasattr(t, "shape") and hasattr(t, "dtype")):
            raise ArgumentError(f"{where}: {name} must be a jax array, got {type(t).__name__} (torch tensors: use "
                                f"mla_ragged_paged_attention)")
    T, H, L, R, P, ps, S, pps = _check_shapes(kv_lens, page_indices, cu_q_lens, num_seqs, ql_nope, q_pe, cache_kv,
                                              where=where)
    _check_new(new_kv_c, new_k_pe, cache_kv, T, L, R, where)
    _check_statics(sm_scale, k_scale, v_scale, q_scale, where)
    meta = (kv_lens, page_indices, cu_q_lens, num_seqs)
    if not any(isinstance(t, jax.core.Tracer) for t in meta):
        check_metadata_values(*(np.asarray(t) for t in meta), T=T, P=P, ps=ps, where=where, hint=_NEW_TOKENS)
    if T == 0:
        return jnp.zeros(ql_nope.shape, ql_nope.dtype), cache_kv
    slots = new_token_slots(*meta, T=T, P=P, ps=ps)
    W = int(cache_kv.shape[2])  # L + R, or padded (tpu-inference's layout): pad lanes written 0
    rows = jnp.concatenate([new_kv_c, new_k_pe] + ([jnp.zeros((T, W - L - R), cache_kv.dtype)] if W > L + R else []),
                           axis=-1)
    flat = cache_kv.reshape(P * ps, W).at[jnp.where(slots >= 0, slots, P * ps)].set(
        rows, mode="drop")  # slot P * ps: dropped (a skipped row)
    cache = flat.reshape(P, ps, W)
    out = jax_call(mla_kernel, *meta, ql_nope, q_pe, cache, float(sm_scale),
                   *(None if x is None else float(x) for x in (k_scale, v_scale, q_scale)), config=config,
                   interpret=interpret)
    return out, cache


# ----------------------------------------------------------------------------------------------- reference


def mla_attention_reference(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens, num_seqs,
                            *, sm_scale=1.0, k_scale=None, v_scale=None, q_scale=None,
                            dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed MLA of :func:`mla_ragged_paged_attention`, dense per sequence, in ``dtype`` (float64 by
    default), computed from the given (low-precision) torch tensors.

    Returns:
        ``(out [T, H, L] in dtype, cache)``: ``cache`` is ``cache_kv`` (its dtype) with this step's latents
        written, as the op returns it; ``cache_kv`` itself is not modified.
    """
    L = ql_nope.shape[2]
    P, ps, W = cache_kv.shape
    n = int(num_seqs[0])
    cache = cache_kv.clone().reshape(P * ps, W)
    LR = L + q_pe.shape[2]
    new = torch.cat([new_kv_c, new_k_pe, new_kv_c.new_zeros(new_kv_c.shape[0], W - LR)], dim=-1)  # pad lanes: 0
    for s in range(n):
        q0, q1, kl = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        for i in range(q1 - q0):
            pos = kl - (q1 - q0) + i
            cache[int(page_indices[s, pos // ps]) * ps + pos % ps] = new[q0 + i]
    cache = cache.reshape(P, ps, W)
    scale = sm_scale * (1.0 if k_scale is None else k_scale) * (1.0 if q_scale is None else q_scale)
    out = torch.zeros(ql_nope.shape, dtype=dtype)
    wide = cache.to(torch.float32).to(dtype)
    for s in range(n):
        q0, q1, kl = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        if q1 == q0:
            continue
        lat = wide[page_indices[s, : -(-kl // ps)].long()].reshape(-1, W)[:kl, :LR]  # [kl, L + R]
        q = torch.cat([ql_nope[q0:q1], q_pe[q0:q1]], dim=-1).to(dtype)  # [q_len, H, L + R]
        logits = torch.einsum("ihw,jw->hij", q, lat) * scale
        pos = kl - (q1 - q0) + torch.arange(q1 - q0)[:, None]
        logits = logits.masked_fill(torch.arange(kl)[None, :] > pos, -math.inf)
        p = torch.softmax(logits, -1)
        out[q0:q1] = torch.einsum("hij,jl->ihl", p, lat[:, :L]) * (1.0 if v_scale is None else v_scale)
    return out, cache


# ----------------------------------------------------------------------------------------------- standard cases


def _case(T, S, ctx, ps, dtype="bf16", H=128):
    pps = ctx // ps
    return (mla_kernel, (f"{S}:i32", f"{S}x{pps}:i32", f"{S + 1}:i32", "1:i32", f"{T}x{H}x512:{dtype}",
                         f"{T}x{H}x64:{dtype}", f"{S * pps}x{ps}x576:{dtype}"),
            dict(sm_scale=192 ** -0.5, k_scale=None, v_scale=None, q_scale=None))


#: DeepSeek-V3 / Kimi-K2 attention shapes (128 heads, kv_lora_rank 512, rope 64, bf16): a decode batch of 64
#: sequences x 2048 cached tokens at page size 64 and 128, and a mixed batch (256 tokens over 16 sequences).
STANDARD_CASES = [_case(64, 64, 2048, ps) for ps in (64, 128)] + [_case(256, 16, 2048, 64)]

__all__ = ["mla_ragged_paged_attention", "mla_ragged_paged_attention_jax", "mla_attention_reference", "mla_kernel",
           "new_token_slots", "STANDARD_CASES"]
