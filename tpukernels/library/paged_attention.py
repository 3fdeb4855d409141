"""Ragged paged attention (the serving kernel) and the paged KV-cache update, for TPU.

Public API (torch tensors; layout of JAX's ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` and
tpu-inference, so either can be swapped for this one):

* :func:`ragged_paged_attention` = ``torch.ops.tpukernels.ragged_paged_attention`` (a composite over the
  kernel op ``torch.ops.tpukernels.ragged_paged_attention_kernel``, which takes the scalar-prefetch
  operands first);
* :func:`update_kv_cache` = ``torch.ops.tpukernels.update_kv_cache`` (kernel op
  ``update_kv_cache_kernel``): writes new K/V tokens into their page slots. **Functional**: it returns the
  updated cache and leaves its input unchanged (no ``mutates_args``), so a decode step is two ops::

      kv_cache = update_kv_cache(kv_cache, k_new, v_new, slot_mapping)
      out = ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=...)

  The price of functional semantics is one copy of the cache per update (XLA copies the aliased input).
* :func:`update_kv_cache_` = ``torch.ops.tpukernels.update_kv_cache_`` (schema ``Tensor(a!) kv_cache``): the
  same write **in place**, with no whole-cache copy (the serving path: ``update_kv_cache_(kv_cache, ...)``).

Layout::

    q             [T, Hq, D]              all sequences' query tokens concatenated (T may include padding)
    kv_cache      [P, page_size, 2*Hkv, D] K of kv head h at combined head 2h, V at 2h + 1
    sinks         f32 [Hq] (optional)     per-head sink logit (gpt-oss)
    k_scales      f32 [P, page_size] or [P, page_size, Hkv] (opt) per-token K scale, shared by the kv heads
                  or one per kv head (v_scales likewise, either layout); int8 / fp8 caches
    kv_lens       int32 [S]               tokens in the cache per sequence (only the first num_seqs count)
    page_indices  int32 [S, pages_per_seq] page p of sequence s is kv_cache[page_indices[s, p]]
    cu_q_lens     int32 [S + 1]           sequence s owns query tokens [cu_q_lens[s], cu_q_lens[s + 1])
    num_seqs      int32 [1]               sequences in use (<= S)
    out           [T, Hq, D]              q's dtype; rows no sequence owns are 0

What it computes, for sequence ``s`` with ``q_len = cu[s+1] - cu[s]`` and its ``kv_len`` keys, query token
``i`` (``0 <= i < q_len``) of query head ``h`` (kv head ``h // (Hq // Hkv)``) sits at key position
``pos = kv_len - q_len + i`` (causal, bottom-right aligned: the sequence's new tokens are its last ones) and
sees keys ``j`` with ``j <= pos`` and, with a sliding window ``W``, ``j > pos - W``::

    s[i, j] = sm_scale * q[i] . (k_scale * K[j])        (f32 accumulation)
    s[i, j] = soft_cap * tanh(s[i, j] / soft_cap)        (if soft_cap)
    out[i]  = sum_j exp(s[i, j]) * (v_scale * V[j]) / (exp(sinks[h]) + sum_j exp(s[i, j]))
              (no sinks: the exp(sinks[h]) term is absent; K and V also times k_scales / v_scales per slot,
              or per slot and kv head)

Mixed batches (decode rows ``q_len = 1``, chunked prefill, prefill) go in one call. ``kv_lens = 0``
sequences (then ``q_len = 0``) and ``num_seqs < S`` are legal; cache pages and slots past a sequence's
``kv_len`` may hold anything (NaN included) without changing the result.

Kernel (written with the tpukernels DSL). Work items: the query axis is cut into blocks of ``block_q``
tokens; one grid step is one (query block, sequence) pair, so a block shared by several sequences is
visited once per sequence, consecutively, and the output block is written back once, after its last visit.
The item list is computed on device from ``cu_q_lens`` (``Launch.prefetch``) into SMEM, its static length
``ceil(T/block_q) + min(S - 1, T - ceil(T/block_q))`` is an exact bound (only sequences starting inside a
block add a visit; a decode batch with ``T = S`` has exactly ``S`` items). Per item, the sequence's K/V
pages are gathered from HBM (``kv_cache`` stays in ``pl.ANY``) by ``pages_per_block`` page DMAs per kv block
into a double buffer (``pltpu.make_async_copy``, one DMA semaphore per buffer); the next block is fetched
while the current one is computed, across sequence and item boundaries. Only pages below ``kv_len`` are
fetched (and, with causal / window limits, only the kv blocks the item's rows can see). K and V of kv head
``g`` are strided loads (combined heads ``2g``, ``2g+1``) from the buffer; the ``Hq/Hkv`` query heads of a
group are folded into the rows of one matmul (``block_q * Hq/Hkv`` rows), with online softmax (running
max / sum and the output accumulator in f32 VMEM). Loops have static trip counts (``pl.when`` guards
skip the unused iterations), which also keeps libtpu's static cost model meaningful for this kernel.

Ideas from JAX's ``ragged_paged_attention`` (page DMAs into a double buffer, strided K/V loads, folding the
GQA group into rows); differences: ``sm_scale`` defaults to ``1/sqrt(D)`` (JAX: 1.0), rows that see no key
and padding rows give 0, static-trip-count loops over a work list instead of data-dependent while loops,
pages past ``kv_len`` are not fetched.

Performance (model, not a measurement: ``tpukernels autotune`` tpu-model evaluator, libtpu 0.0.52): decode
batch 64 x 2048 keys, Hq 32 / Hkv 8 / D 128 bf16, page 16 and 64, shipped default ``block_q=1,
pages_per_block=16``: v6e 350 us (94% of the HBM roofline), tpu7x 168 us (87%), v5e 678 us (97%); libtpu's
cycles are below the HBM time there (HBM-bound), so configs differ only by grid-step overhead. The mixed
batch is not tuned yet (heuristic ``block_q=64``).

Quantized KV caches (int8, float8_e4m3fn / float8_e5m2) with static ``k_scale`` / ``v_scale`` and / or
per-token scales ``k_scales`` / ``v_scales`` ``[num_pages, page_size]`` (one per slot, all kv heads) or
``[num_pages, page_size, Hkv]`` (one per slot and kv head: JAX's paged attention quantizes so, its scales
``[Hkv, P, page_size, 1]`` transposed, over 127.5) (their pages DMA'd beside the K/V pages; kv head ``g`` reads its
column): the cache moves half (a quarter vs f32) the bytes of bf16 while the matmuls stay bf16/f32, and no
scaled tile is ever rounded to q's dtype: int8 / fp8 values are exact in bf16, so static scales fold into
the logit scale and the P.V product; per-token scales dequantize in f32 (JAX's paged attention does too) and
the f32 tile enters the MXU as a bf16 hi + lo pair (two passes for bf16 queries; exact to ~2^-17). It
compiles for v5e, v6e and tpu7x (:data:`FP8_KV_CHIPS`, compile-only). Attention sinks ``sinks [Hq]`` (gpt-oss) initialise each
row's running max to its head's sink logit and its running sum to 1 (``exp(sink - sink)``), so the sink
enters the softmax denominator with no value. Head dims: any multiple of 32 (64, 96, 128, 256 compile-checked
on v5e / v6e / tpu7x); rows narrower than 128 lanes are padded by Mosaic in VMEM, never in HBM.

JAX: :func:`ragged_paged_attention_jax` (jax arrays or tracers, via :func:`tpukernels.jax_call`); vLLM-TPU:
:mod:`tpukernels.integrations.vllm_tpu` maps tpu-inference's 5-D cache and metadata onto this kernel.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import numpy as np
import torch

from ..dsl import Launch, OutSpec, Tunable, cdiv, tpu_kernel
from ..errors import ArgumentError, DTypeError

NAMESPACE = "tpukernels"
_Q_DTYPES = ("bfloat16", "float32")
_FP8 = ("float8_e4m3fn", "float8_e5m2")
#: quantized KV-cache dtypes (widened to q's dtype in VMEM, with static and / or per-token scales)
_QUANT_KV = _FP8 + ("int8",)
#: Chips whose compile-only target (libtpu 0.0.52) compiles the fp8 KV cache path (``tests/
#: test_paged_attention.py::test_compile_only_fp8``): all three, because K/V are widened to q's dtype in
#: VMEM (fp8 -> f32 -> bf16/f32) and the MXU never sees fp8 (v5e/v6e have no e4m3 MXU path).
FP8_KV_CHIPS = ("v5e", "v6e", "tpu7x")

# ----------------------------------------------------------------------------------------------- tunables

_TUNABLES = {
    "block_q": Tunable((1, 2, 4, 8, 16, 32, 64, 128, 256), default=32,
                       doc="query tokens per block (work items are (block, sequence) pairs)"),
    "pages_per_block": Tunable((1, 2, 4, 8, 16, 32, 64), default=16,
                               doc="KV pages gathered per DMA block (clamped to pages_per_seq)"),
}


def _heuristic(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache, *extras, **statics):
    """Defaults when no tuning entry applies: decode-like batches (``T <= S``: mostly one token per sequence)
    take one-token query blocks (a visit then computes only its own rows: the softmax work per key is
    ``block_q * Hq/Hkv`` rows); long pages take fewer pages per block so a kv block stays near 512 keys."""
    if len(q.shape) != 3 or len(kv_cache.shape) != 4 or len(page_indices.shape) != 2:
        return {}
    T, S, ps = int(q.shape[0]), int(page_indices.shape[0]), int(kv_cache.shape[1])
    bq = 1 if T <= S else 64
    ppb = max(1, min(64, 512 // max(ps, 1)))
    return {"block_q": bq, "pages_per_block": 1 << (ppb.bit_length() - 1)}


# ----------------------------------------------------------------------------------------------- checks


def _dt(x) -> str:
    return np.dtype(x.dtype).name if not isinstance(x, torch.Tensor) else str(x.dtype).replace("torch.", "")


def _check_shapes(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache, *, where: str):
    """Ranks, shape agreement and dtypes (metadata only); raises ArgumentError / DTypeError naming the argument."""
    ranks = (("q", q, 3, "[T, Hq, D]"), ("kv_cache", kv_cache, 4, "[num_pages, page_size, 2*Hkv, D]"),
             ("kv_lens", kv_lens, 1, "[S]"), ("page_indices", page_indices, 2, "[S, pages_per_seq]"),
             ("cu_q_lens", cu_q_lens, 1, "[S + 1]"), ("num_seqs", num_seqs, 1, "[1]"))
    for name, x, r, shape in ranks:
        if len(x.shape) != r:
            raise ArgumentError(f"{where}: {name} must have rank {r} {shape}, got shape {tuple(x.shape)}")
    T, Hq, D = (int(d) for d in q.shape)
    P, ps, H2, Dk = (int(d) for d in kv_cache.shape)
    S, pps = (int(d) for d in page_indices.shape)
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("num_seqs", num_seqs)):
        if _dt(x) != "int32":
            raise DTypeError(f"{where}: {name} must be int32, got {_dt(x)}")
    if _dt(q) not in _Q_DTYPES:
        raise DTypeError(f"{where}: q dtype {_dt(q)} is not supported; use bfloat16 or float32")
    if _dt(kv_cache) != _dt(q) and _dt(kv_cache) not in _QUANT_KV:
        raise DTypeError(f"{where}: kv_cache dtype {_dt(kv_cache)} must equal q's ({_dt(q)}) or be a quantized "
                         f"dtype {_QUANT_KV} (with k_scale / v_scale or per-token k_scales / v_scales)")
    if Dk != D:
        raise ArgumentError(f"{where}: kv_cache head dim {Dk} must equal q head dim {D}")
    if D == 0 or D % 32:
        raise ArgumentError(f"{where}: head dim D = {D} must be a positive multiple of 32 (64, 96, 128, 256 "
                            f"compile for v5e / v6e / tpu7x; rows narrower than 128 lanes are padded in VMEM)")
    if H2 == 0 or H2 % 2:
        raise ArgumentError(f"{where}: kv_cache dim 2 must be 2*Hkv (K and V interleaved), got {H2}")
    Hkv = H2 // 2
    if Hq == 0 or Hq % Hkv:
        raise ArgumentError(f"{where}: q heads ({Hq}) must be a positive multiple of kv heads ({Hkv} = "
                            f"kv_cache.shape[2] / 2) (GQA: query head h uses kv head h // (Hq // Hkv))")
    if ps == 0 or P == 0:
        raise ArgumentError(f"{where}: kv_cache must have num_pages > 0 and page_size > 0, got {tuple(kv_cache.shape)}")
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
    return T, Hq, D, P, ps, Hkv, S, pps


def _check_statics(sm_scale, sliding_window, soft_cap, k_scale, v_scale, kv_dtype: str, where: str):
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        raise ArgumentError(f"{where}: sm_scale must be a finite float (or None for 1/sqrt(D)), got {sm_scale!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ArgumentError(f"{where}: sliding_window must be None or an int >= 1 (keys j > pos - W), got "
                            f"{sliding_window!r}")
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and math.isfinite(soft_cap) and soft_cap > 0):
        raise ArgumentError(f"{where}: soft_cap must be None or a finite float > 0, got {soft_cap!r}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise ArgumentError(f"{where}: {name} must be None or a finite float > 0, got {s!r}")


def _check_extras(sinks, k_scales, v_scales, Hq: int, P: int, ps: int, Hkv: int, where: str) -> None:
    """sinks ``[Hq]`` float32; per-token scales float32, both or neither, each ``[P, page_size]`` /
    ``[P, page_size, 1]`` (one per slot) or ``[P, page_size, Hkv]`` (one per slot and kv head)."""
    if sinks is not None:
        if tuple(sinks.shape) != (Hq,):
            raise ArgumentError(f"{where}: sinks must have shape [Hq] = ({Hq},) (one logit per query head), got "
                                f"{tuple(sinks.shape)}")
        if _dt(sinks) != "float32":
            raise DTypeError(f"{where}: sinks must be float32, got {_dt(sinks)}")
    if (k_scales is None) != (v_scales is None):
        raise ArgumentError(f"{where}: pass both k_scales and v_scales (per-token scales) or neither")
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if t is None:
            continue
        if tuple(t.shape) not in ((P, ps), (P, ps, 1), (P, ps, Hkv)):
            raise ArgumentError(f"{where}: {name} must have shape [num_pages, page_size] = ({P}, {ps}) (one scale "
                                f"per cache slot, shared by the kv heads) or [num_pages, page_size, Hkv] = ({P}, {ps}, "
                                f"{Hkv}) (one per slot and kv head), got {tuple(t.shape)}")
        if _dt(t) != "float32":
            raise DTypeError(f"{where}: {name} must be float32, got {_dt(t)}")


def _is_tracing(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or torch.compiler.is_compiling()


_NEW_KV_HINT = "its new tokens' K/V must already be in the cache (update_kv_cache first)"


def check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, T: int, P: int, ps: int, where: str,
                   hint: str = _NEW_KV_HINT) -> None:
    """Value rules, checked on the host for cpu tensors outside tracing (device tensors would need a sync;
    fake tensors have no values). On device, unchecked values are clamped instead (see the kernel).
    ``hint`` ends the ``q_len > kv_len`` message (how the caller's new tokens reach the cache)."""
    ts = (kv_lens, page_indices, cu_q_lens, num_seqs)
    if any(t.device.type != "cpu" or _is_tracing(t) for t in ts):
        return
    check_metadata_values(*(t.numpy() for t in ts), T=T, P=P, ps=ps, where=where, hint=hint)


def check_metadata_values(kl, pi, cu, ns, *, T: int, P: int, ps: int, where: str, hint: str = _NEW_KV_HINT) -> None:
    """:func:`check_metadata` on host numpy arrays (the JAX entries' concrete metadata)."""
    kl, pi, cu, ns = (np.asarray(a).astype(np.int64) for a in (kl, pi, cu, ns))
    S, pps = pi.shape
    n = int(ns[0])
    if not 0 <= n <= S:
        raise ArgumentError(f"{where}: num_seqs[0] = {n} must be in [0, S] = [0, {S}]")
    if int(cu[0]) != 0:
        raise ArgumentError(f"{where}: cu_q_lens[0] must be 0, got {int(cu[0])}")
    d = np.diff(cu[: n + 1])
    if (d < 0).any():
        s = int(np.argmax(d < 0))
        raise ArgumentError(f"{where}: cu_q_lens must be non-decreasing over the first num_seqs + 1 entries: "
                            f"cu_q_lens[{s + 1}] = {int(cu[s + 1])} < cu_q_lens[{s}] = {int(cu[s])}")
    if int(cu[n]) > T:
        raise ArgumentError(f"{where}: cu_q_lens[num_seqs] = {int(cu[n])} query tokens exceed q's T = {T}")
    for s in range(n):
        if not 0 <= kl[s] <= pps * ps:
            raise ArgumentError(f"{where}: kv_lens[{s}] = {int(kl[s])} must be in [0, pages_per_seq * page_size] = "
                                f"[0, {pps * ps}] (the pages of page_indices[{s}] hold at most {pps * ps} tokens)")
        if d[s] > kl[s]:
            raise ArgumentError(f"{where}: sequence {s} has q_len {int(d[s])} > kv_lens[{s}] = {int(kl[s])}; {hint}")
        used = pi[s, : -(-int(kl[s]) // ps)]
        bad = (used < 0) | (used >= P)
        if bad.any():
            p = int(np.argmax(bad))
            raise ArgumentError(f"{where}: page_indices[{s}, {p}] = {int(used[p])} is out of range [0, num_pages) = "
                                f"[0, {P}) (page {p} holds tokens of kv_lens[{s}] = {int(kl[s])})")


_check_values, _check_value_arrays = check_metadata, check_metadata_values


# ----------------------------------------------------------------------------------------------- schedule


def n_work_items(T: int, S: int, bq: int) -> int:
    """Static work-item count (ragged paged attention and the MLA kernel share the schedule): one visit per
    query block plus one per sequence starting inside a block."""
    nb = cdiv(T, bq)
    return nb + max(0, min(S - 1, T - nb))


def work_items(kv_lens, page_indices, cu_q_lens, num_seqs, *, T: int, S: int, bq: int):
    """Work items on device (XLA, inside the same jitted function): ``item_seq`` (-1: no sequence, the block
    is padding or the item is unused) and ``item_blk`` (query block), in (block, sequence) order."""
    import jax.numpy as jnp

    nb, G = cdiv(T, bq), n_work_items(T, S, bq)
    n = jnp.clip(num_seqs[0], 0, S)
    cu = jnp.clip(cu_q_lens, 0, T)
    q0, q1 = cu[:-1], jnp.maximum(cu[1:], cu[:-1])
    live = (jnp.arange(S) < n) & (q1 > q0)
    fb, lb = q0 // bq, (q1 - 1) // bq
    cnt = jnp.where(live, lb - fb + 1, 0)
    cum = jnp.cumsum(cnt)
    total = cum[-1]
    j = jnp.arange(G, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cum, j, side="right"), 0, S - 1).astype(jnp.int32)
    blk = fb[seq] + j - (cum[seq] - cnt[seq])
    first_pad = cdiv(jnp.max(jnp.where(live, q1, 0)), bq)  # first block with no sequence's token
    k = j - total
    is_pad = (k >= 0) & (first_pad + k < nb)
    item_seq = jnp.where(j < total, seq, -1).astype(jnp.int32)
    item_blk = jnp.where(j < total, blk, jnp.where(is_pad, first_pad + k, nb - 1)).astype(jnp.int32)
    return kv_lens, page_indices, cu_q_lens, num_seqs, item_seq, item_blk


# ----------------------------------------------------------------------------------------------- kernel body


def item_range(i, item_seq, item_blk, kv_lens, cu_q_lens, *, bq, bkv, max_kv, window):
    """Item ``i`` -> (seq (clamped to >= 0), kv_len, first kv block, end kv block); empty when lo >= hi."""
    import jax
    import jax.numpy as jnp

    s_raw = item_seq[i]
    s = jnp.maximum(s_raw, 0)
    kv_len = jnp.clip(kv_lens[s], 0, max_kv)
    q0, q1 = cu_q_lens[s], cu_q_lens[s + 1]
    b0 = item_blk[i] * bq
    t0, t1 = jnp.maximum(q0, b0), jnp.minimum(q1, b0 + bq)  # this item's own tokens [t0, t1)
    base = kv_len - (q1 - q0) - q0  # key position of token t is base + t
    hi = jnp.minimum(base + t1, kv_len)  # keys [lo, hi) are visible to some own row
    lo = jnp.maximum(base + t0 - window + 1, 0) if window is not None else 0
    live = (s_raw >= 0) & (t1 > t0) & (hi > 0)
    kb_lo = jax.lax.div(lo, bkv)  # non-negative operands: lax.div (jnp's floor division lowers through sign)
    kb_hi = jnp.where(live, jax.lax.div(jnp.maximum(hi, 0) + bkv - 1, bkv), kb_lo)
    return s, kv_len, kb_lo, kb_hi


# the kernel body and launch function (whose source keys their tuning entries) use the old names
_n_items, _schedule, _item_range = n_work_items, work_items, item_range


def _rpa_body(*refs, sm_scale, sliding_window, soft_cap, k_scale, v_scale, has_sinks, has_scales):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    refs = list(refs)
    kv_lens, page_indices, cu_q_lens, num_seqs, item_seq, item_blk, q_ref, kv_hbm = refs[:8]
    del num_seqs
    rest = refs[8:]
    sinks_ref = rest.pop(0) if has_sinks else None
    ks_hbm, vs_hbm = (rest.pop(0), rest.pop(0)) if has_scales else (None, None)
    o_ref, kv_buf, sems, qf_ref, m_ref, l_ref, acc_ref, slot_ref = rest[:8]
    ks_buf, vs_buf = (rest[8], rest[9]) if has_scales else (None, None)

    bq, Hq, D = q_ref.shape
    _, ppb, ps, H2, _ = kv_buf.shape
    Hkv, n_pages = H2 // 2, kv_hbm.shape[0]
    r, bkv = Hq // Hkv, ppb * ps
    R = bq * r
    pps = page_indices.shape[1]
    nkb = cdiv(pps, ppb)
    i, n_items = pl.program_id(0), pl.num_programs(0)
    rng = lambda j: _item_range(j, item_seq, item_blk, kv_lens, cu_q_lens, bq=bq, bkv=bkv, max_kv=pps * ps,
                                window=sliding_window)
    seq, kv_len, kb_lo, kb_hi = rng(i)

    def page_copies(s, kvl, kb, slot, fn):  # start or wait the page DMAs of kv block kb of sequence s
        for p in range(ppb):
            page = kb * ppb + p

            @pl.when(page * ps < kvl)
            def _():
                src = jnp.clip(page_indices[s, jnp.minimum(page, pps - 1)], 0, n_pages - 1)
                fn(pltpu.make_async_copy(kv_hbm.at[src], kv_buf.at[slot, p], sems.at[slot]))
                if has_scales:  # the page's per-token scales ride on the same semaphore
                    fn(pltpu.make_async_copy(ks_hbm.at[src], ks_buf.at[slot, p], sems.at[slot]))
                    fn(pltpu.make_async_copy(vs_hbm.at[src], vs_buf.at[slot, p], sems.at[slot]))

    start = lambda c: c.start()
    wait = lambda c: c.wait()
    prev_seq, prev_len, prev_lo, prev_hi = rng(jnp.maximum(i - 1, 0))
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
    cdt = q_ref.dtype
    packed = np.dtype(cdt).itemsize < 4 and r % 2 != 0  # fold through f32 (no odd-row packed reshapes)
    qdt = jnp.float32 if packed else cdt

    @pl.when(first)
    def _():
        if has_sinks:  # gpt-oss sinks: one extra logit per head in the softmax denominator, with no value
            head = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (R, 128), 0), r)
            for g in range(Hkv):
                m0 = jnp.zeros((R, 128), jnp.float32)
                for h in range(r):
                    m0 = jnp.where(head == h, sinks_ref[g * r + h], m0)
                m_ref[g] = m0
            l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
        else:
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        for g in range(Hkv):
            qf_ref[g] = q_ref[:, g * r:(g + 1) * r, :].astype(qdt).reshape(R, D)

    f32 = np.dtype(cdt) == np.dtype(np.float32)
    prec = jax.lax.Precision.HIGHEST if f32 else None
    scale = (1.0 / math.sqrt(D)) if sm_scale is None else sm_scale

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
            # row -> token: rows g-major inside qf (row = token_in_block * r + head_in_group)
            q0, q1 = cu_q_lens[seq], cu_q_lens[seq + 1]
            tok = blk * bq + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0), r)
            own = (tok >= q0) & (tok < q1)
            pos = jnp.where(own, kv_len - (q1 - q0) + tok - q0, -1)  # -1: sees nothing
            col = kb * bkv + jax.lax.broadcasted_iota(jnp.int32, (1, bkv), 1)
            vis = col <= pos
            if sliding_window is not None:
                vis = vis & (col > pos - sliding_window)
            vrow = (kb * bkv + jax.lax.broadcasted_iota(jnp.int32, (bkv, 1), 0)) < kv_len
            for g in range(Hkv):
                k = kv_buf[slot, :, :, 2 * g, :].reshape(bkv, D)
                v = kv_buf[slot, :, :, 2 * g + 1, :].reshape(bkv, D)
                qg = qf_ref[g].astype(cdt)
                mm = lambda a, b, dims: jax.lax.dot_general(a, b, (dims, ((), ())),
                                                            preferred_element_type=jnp.float32, precision=prec)
                # Dequantization never rounds a scaled tile to q's dtype (int8 / fp8 values are exact in bf16,
                # their products with scales are not): static scales fold into the logits / the P.V product;
                # per-token scales give an f32 tile, fed to the MXU as a bf16 hi + lo pair (two passes).
                if has_scales:  # per-token dequantization scales, [bkv, 1] f32: kv head g's column, or the
                    # one column all kv heads share
                    kc, vc = (g if ks_buf.shape[-1] > 1 else 0), (g if vs_buf.shape[-1] > 1 else 0)
                    ksc = ks_buf[slot, :, :, kc:kc + 1].reshape(bkv, 1)
                    vsc = vs_buf[slot, :, :, vc:vc + 1].reshape(bkv, 1)
                    kf = k.astype(jnp.float32) * ksc * (1.0 if k_scale is None else k_scale)
                    k_hi = kf.astype(cdt)
                    s = mm(qg, k_hi, ((1,), (1,)))
                    if not f32:
                        s = s + mm(qg, (kf - k_hi.astype(jnp.float32)).astype(cdt), ((1,), (1,)))
                    s = s * scale
                else:
                    s = mm(qg, k.astype(jnp.float32).astype(cdt) if k.dtype != cdt else k, ((1,), (1,)))
                    s = s * (scale if k_scale is None else scale * k_scale)
                if has_scales:
                    vf = v.astype(jnp.float32) * vsc * (1.0 if v_scale is None else v_scale)
                    vf = jnp.where(vrow, vf, 0.0)  # slots past kv_len may hold NaN
                    v, v_lo = vf.astype(cdt), None
                    if not f32:
                        v_lo = (vf - v.astype(jnp.float32)).astype(cdt)
                else:
                    v = v.astype(jnp.float32).astype(cdt) if v.dtype != cdt else v
                    v, v_lo = jnp.where(vrow, v, jnp.zeros_like(v)), None  # slots past kv_len may hold NaN
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(vis, s, -jnp.inf)
                m_prev = m_ref[g][:, :1]
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp(m_prev - m_safe)
                p = jnp.exp(s - m_safe)
                l_ref[g] = jnp.broadcast_to(alpha * l_ref[g][:, :1] + jnp.sum(p, axis=1, keepdims=True), (R, 128))
                m_ref[g] = jnp.broadcast_to(m_new, (R, 128))
                pc = p.astype(cdt)
                pv = mm(pc, v, ((1,), (0,)))
                if v_lo is not None:
                    pv = pv + mm(pc, v_lo, ((1,), (0,)))
                if v_scale is not None and not has_scales:
                    pv = pv * v_scale
                # select, not multiply: rows of another sequence (or padding) have p = 0 here, and 0 * NaN
                # in this sequence's V / v_scales would still poison them
                acc_ref[g] = alpha * acc_ref[g] + jnp.where(own, pv, 0.0)
            slot_ref[0] = 1 - slot

        return carry

    jax.lax.fori_loop(0, nkb, kv_step, 0)

    @pl.when(last)
    def _():
        for g in range(Hkv):
            l = l_ref[g][:, :1]
            o = acc_ref[g] * jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
            if packed:
                o_ref[:, g * r:(g + 1) * r, :] = o.reshape(bq, r, D).astype(o_ref.dtype)
            else:
                o_ref[:, g * r:(g + 1) * r, :] = o.astype(o_ref.dtype).reshape(bq, r, D)


# ----------------------------------------------------------------------------------------------- launch


def _vmem_limit(est_bytes: int) -> int | None:
    """Scoped VMEM to request: the chip default for small footprints, else room for Mosaic's temporaries
    (logit tiles), capped at 40 MiB (tpu7x has 64 MiB per core; XLA needs some around the kernel)."""
    if est_bytes <= 6 << 20:
        return None
    return int(min(40 << 20, 2 * est_bytes + (8 << 20)))


def _launch_rpa(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache, sinks, k_scales, v_scales, statics,
                cfg) -> Launch:
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::ragged_paged_attention_kernel"
    T, Hq, D, P, ps, Hkv, S, pps = _check_shapes(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache, where=where)
    _check_statics(statics["sm_scale"], statics["sliding_window"], statics["soft_cap"], statics["k_scale"],
                   statics["v_scale"], _dt(kv_cache), where)
    _check_extras(sinks, k_scales, v_scales, Hq, P, ps, Hkv, where)
    has_sinks, has_scales = sinks is not None, k_scales is not None
    if has_scales and (len(k_scales.shape) != 3 or len(v_scales.shape) != 3):
        raise ArgumentError(f"{where}: the kernel op takes k_scales / v_scales as [num_pages, page_size, 1] or "
                            f"[num_pages, page_size, Hkv], got {tuple(k_scales.shape)} / {tuple(v_scales.shape)}")
    bq, ppb = int(cfg["block_q"]), min(int(cfg["pages_per_block"]), pps)
    r = Hq // Hkv
    R = bq * r
    G = _n_items(T, S, bq) if T > 0 else 0
    packed = np.dtype(q.dtype).itemsize < 4 and r % 2 != 0
    qf_dt = jnp.float32 if packed else q.dtype
    idx = lambda i, kl, pi, cu, ns, iseq, iblk: (iblk[i], 0, 0)
    qspec = pl.BlockSpec((bq, Hq, D), idx)
    scratch = [
        pltpu.VMEM((2, ppb, ps, 2 * Hkv, D), kv_cache.dtype),  # K/V page double buffer
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.VMEM((Hkv, R, D), qf_dt),  # q block, GQA group folded into rows
        pltpu.VMEM((Hkv, R, 128), jnp.float32),  # running max (lane-broadcast)
        pltpu.VMEM((Hkv, R, 128), jnp.float32),  # running sum
        pltpu.VMEM((Hkv, R, D), jnp.float32),  # output accumulator
        pltpu.SMEM((1,), jnp.int32),  # current buffer slot
    ]
    if has_scales:  # per-token K / V scale pages ([ps, 1] or [ps, Hkv] each), double-buffered like the cache pages
        scratch += [pltpu.VMEM((2, ppb, ps, int(t.shape[2])), jnp.float32) for t in (k_scales, v_scales)]
    extra_specs = ([pl.BlockSpec(memory_space=pltpu.SMEM)] if has_sinks else []) + \
        ([pl.BlockSpec(memory_space=pl.ANY)] * 2 if has_scales else [])
    it, kit = np.dtype(q.dtype).itemsize, np.dtype(kv_cache.dtype).itemsize
    bkv = ppb * ps
    est = (4 * bq * Hq * D * it + 2 * bkv * 2 * Hkv * D * kit + Hkv * R * (D * (4 + 4) + 2 * 128 * 4)
           + 4 * R * bkv * 4 + (2 * 2 * bkv * 128 * 4 if has_scales else 0))  # scale pages: lanes padded to 128
    return Launch(
        grid=(G,),
        in_specs=[qspec, pl.BlockSpec(memory_space=pl.ANY)] + extra_specs,
        out_specs=qspec,
        out_shape=OutSpec((T, Hq, D), q.dtype),
        scratch_shapes=scratch,
        num_scalar_prefetch=4,
        prefetch=lambda kl, pi, cu, ns: _schedule(kl, pi, cu, ns, T=T, S=S, bq=bq),
        dimension_semantics=("arbitrary",),
        vmem_limit_bytes=_vmem_limit(est),
        body_kwargs=dict(has_sinks=has_sinks, has_scales=has_scales),
    )


def _rpa_out_shape(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache, sinks=None, k_scales=None,
                   v_scales=None, **statics):
    return OutSpec(tuple(q.shape), q.dtype)


@tpu_kernel(_rpa_body, name="ragged_paged_attention_kernel", namespace=NAMESPACE, tunables=_TUNABLES,
            heuristic=_heuristic, out_shape=_rpa_out_shape)
def rpa_kernel(
    kv_lens: torch.Tensor,
    page_indices: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_seqs: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    sinks: Optional[torch.Tensor] = None,
    k_scales: Optional[torch.Tensor] = None,
    v_scales: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    *,
    block_q: int,
    pages_per_block: int,
) -> torch.Tensor:
    """Kernel op ``torch.ops.tpukernels.ragged_paged_attention_kernel``: the scalar-prefetch operands
    (``kv_lens, page_indices, cu_q_lens, num_seqs``) first, then ``q [T, Hq, D]`` and
    ``kv_cache [P, page_size, 2*Hkv, D]``, optional ``sinks`` f32 ``[Hq]`` and per-token scales ``k_scales``,
    ``v_scales`` f32 ``[P, page_size, 1]`` or ``[P, page_size, Hkv]``; returns ``out [T, Hq, D]``. See
    :func:`ragged_paged_attention`."""
    statics = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
                   v_scale=v_scale)
    return _launch_rpa(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache, sinks, k_scales, v_scales,
                       statics, dict(block_q=block_q, pages_per_block=pages_per_block))


# ----------------------------------------------------------------------------------------------- cache update


def _update_body(slots_ref, new_ref, cache_in, cache_out, sems, *, bt: int, page_size: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    del cache_in  # aliased to cache_out
    i = pl.program_id(0)
    n_slots = cache_out.shape[0] * page_size
    T = slots_ref.shape[0]

    def copies(fn):
        for j in range(bt):
            t = i * bt + j
            slot = slots_ref[jnp.minimum(t, T - 1)]

            @pl.when((t < T) & (slot >= 0) & (slot < n_slots))
            def _():
                page, row = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)
                fn(pltpu.make_async_copy(new_ref.at[j], cache_out.at[page, row],
                                         sems.at[0]))

    copies(lambda c: c.start())
    copies(lambda c: c.wait())


def _launch_update(slot_mapping, kv_new, kv_cache) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::update_kv_cache_kernel"
    if len(kv_cache.shape) != 4 or len(kv_new.shape) != 3 or len(slot_mapping.shape) != 1:
        raise ArgumentError(f"{where}: expected kv_cache [P, page_size, 2*Hkv, D], kv_new [T, 2*Hkv, D], "
                            f"slot_mapping [T]; got {tuple(kv_cache.shape)}, {tuple(kv_new.shape)}, "
                            f"{tuple(slot_mapping.shape)}")
    T = int(kv_new.shape[0])
    bt = 8
    return Launch(
        grid=(cdiv(T, bt),),
        in_specs=[pl.BlockSpec((bt, kv_new.shape[1], kv_new.shape[2]), lambda i, s: (i, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=OutSpec(tuple(kv_cache.shape), kv_cache.dtype),
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        num_scalar_prefetch=1,
        input_output_aliases={2: 0},
        body_kwargs=dict(bt=bt, page_size=int(kv_cache.shape[1])),
    )


def _update_out_shape(slot_mapping, kv_new, kv_cache):
    return OutSpec(tuple(kv_cache.shape), kv_cache.dtype)


@tpu_kernel(_update_body, name="update_kv_cache_kernel", namespace=NAMESPACE, out_shape=_update_out_shape)
def update_kernel(slot_mapping: torch.Tensor, kv_new: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """Kernel op ``torch.ops.tpukernels.update_kv_cache_kernel(slot_mapping [T] int32, kv_new [T, 2*Hkv, D],
    kv_cache)`` -> the updated copy of ``kv_cache``. See :func:`update_kv_cache`."""
    return _launch_update(slot_mapping, kv_new, kv_cache)


# ----------------------------------------------------------------------------------------------- public ops


def _rpa_impl(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=None, sliding_window=None,
              soft_cap=None, k_scale=None, v_scale=None, sinks=None, k_scales=None, v_scales=None, config=None):
    where = "tpukernels::ragged_paged_attention"
    for name, t in (("q", q), ("kv_cache", kv_cache), ("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    T, Hq, D, P, ps, Hkv, S, pps = _check_shapes(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache,
                                                 where=where)
    _check_statics(sm_scale, sliding_window, soft_cap, k_scale, v_scale, _dt(kv_cache), where)
    _check_extras(sinks, k_scales, v_scales, Hq, P, ps, Hkv, where)
    _check_values(kv_lens, page_indices, cu_q_lens, num_seqs, T, P, ps, where)
    if k_scales is not None:  # [P, ps] -> [P, ps, 1] (views, no copy); [P, ps, Hkv] as is
        k_scales, v_scales = k_scales.reshape(P, ps, -1), v_scales.reshape(P, ps, -1)
    return torch.ops.tpukernels.ragged_paged_attention_kernel(
        kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache, sinks, k_scales, v_scales, sm_scale,
        sliding_window, soft_cap, k_scale, v_scale, config=config)


def _check_update(kv_cache, k, v, slot_mapping, where: str):
    """The update ops' checks (typed errors before any kernel runs); returns ``kv_new [T, 2*Hkv, D]``."""
    for name, t in (("kv_cache", kv_cache), ("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if kv_cache.dim() != 4:
        raise ArgumentError(f"{where}: kv_cache must have rank 4 [num_pages, page_size, 2*Hkv, D], got "
                            f"{tuple(kv_cache.shape)}")
    P, ps, H2, D = kv_cache.shape
    if H2 == 0 or H2 % 2:
        raise ArgumentError(f"{where}: kv_cache dim 2 must be 2*Hkv > 0 (K of kv head h at combined head 2h, V at "
                            f"2h + 1), got {H2} (shape {tuple(kv_cache.shape)})")
    if kv_cache.requires_grad and torch.is_grad_enabled():
        raise ArgumentError(f"{where}: kv_cache requires grad: a KV cache is state, not a differentiable input (the "
                            f"cache update has no backward); pass kv_cache.detach(), allocate it with "
                            f"requires_grad=False, or call under torch.no_grad()")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape[1:]) != (H2 // 2, D) or t.dim() != 3:
            raise ArgumentError(f"{where}: {name} must have shape [T, Hkv, D] = [T, {H2 // 2}, {D}], got "
                                f"{tuple(t.shape)}")
        if t.dtype != kv_cache.dtype:
            raise DTypeError(f"{where}: {name} dtype {_dt(t)} must equal kv_cache's {_dt(kv_cache)} (quantize first)")
    if k.shape[0] != v.shape[0] or tuple(slot_mapping.shape) != (k.shape[0],):
        raise ArgumentError(f"{where}: k, v and slot_mapping must have one length T, got {k.shape[0]}, "
                            f"{v.shape[0]}, {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int32:
        raise DTypeError(f"{where}: slot_mapping must be int32, got {_dt(slot_mapping)}")
    if _dt(kv_cache) not in _Q_DTYPES + _QUANT_KV:
        raise DTypeError(f"{where}: kv_cache dtype {_dt(kv_cache)} is not supported; use bfloat16, float32, int8 "
                         f"or fp8")
    if slot_mapping.device.type == "cpu" and not _is_tracing(slot_mapping):
        sm = slot_mapping.numpy()
        bad = sm >= P * ps
        if bad.any():
            t = int(np.argmax(bad))
            raise ArgumentError(f"{where}: slot_mapping[{t}] = {int(sm[t])} is out of range: slots are "
                                f"page * page_size + offset < num_pages * page_size = {P * ps} (negative = skip)")
        live = sm[sm >= 0]
        if len(np.unique(live)) != len(live):
            raise ArgumentError(f"{where}: slot_mapping writes one slot twice (the result would depend on DMA order)")
    return torch.stack([k, v], dim=2).reshape(k.shape[0], H2, D)


def _update_impl(kv_cache, k, v, slot_mapping):
    kv_new = _check_update(kv_cache, k, v, slot_mapping, "tpukernels::update_kv_cache")
    if k.shape[0] == 0:
        return kv_cache.clone()
    return torch.ops.tpukernels.update_kv_cache_kernel(slot_mapping, kv_new, kv_cache)


def _update_inplace_impl(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``torch.ops.tpukernels.update_kv_cache_`` (schema ``Tensor(a!) kv_cache``): see :func:`update_kv_cache_`."""
    where = "tpukernels::update_kv_cache_"
    kv_new = _check_update(kv_cache, k, v, slot_mapping, where)
    if k.shape[0] == 0:
        return
    if not kv_cache.is_contiguous():
        raise ArgumentError(f"{where}: kv_cache must be contiguous to be updated in place, got strides "
                            f"{tuple(kv_cache.stride())}")
    dev = kv_cache.device.type
    if dev == "cpu":
        # the interpreter would materialise the aliased output as a new buffer (a whole-cache copy): run the
        # kernel on the pages this step touches only, then write those pages back in place
        ps = kv_cache.shape[1]
        live = slot_mapping >= 0
        slots = slot_mapping[live].long()
        if slots.numel() == 0:
            return
        pages = torch.unique(slots // ps)  # sorted
        local = (torch.searchsorted(pages, slots // ps) * ps + slots % ps).to(torch.int32)
        block = torch.ops.tpukernels.update_kv_cache_kernel(local, kv_new[live].contiguous(), kv_cache[pages])
        kv_cache.index_copy_(0, pages, block)
        return
    _update_inplace_tpu(kv_cache, kv_new, slot_mapping)


def _update_inplace_tpu(kv_cache, kv_new, slot_mapping) -> None:
    """torch_tpu: the caller's cache is donated to the kernel's aliased output (no clone; no copy when the
    runtime reuses the donated buffer, as XLA does); a runtime that hands back another buffer gets one copy
    into the cache."""
    from ..targets import tpu

    out = tpu.run_torch_tpu(update_kernel, [slot_mapping, kv_new, kv_cache], None, donate_inputs=True)
    if out.data_ptr() != kv_cache.data_ptr():
        kv_cache.copy_(out)


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("ragged_paged_attention(Tensor q, Tensor kv_cache, Tensor kv_lens, Tensor page_indices, "
            "Tensor cu_q_lens, Tensor num_seqs, float? sm_scale=None, int? sliding_window=None, "
            "float? soft_cap=None, float? k_scale=None, float? v_scale=None, Tensor? sinks=None, "
            "Tensor? k_scales=None, Tensor? v_scales=None, str? config=None) -> Tensor")
_LIB.impl("ragged_paged_attention", _rpa_impl, "CompositeImplicitAutograd")
_LIB.define("update_kv_cache(Tensor kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> Tensor")
_LIB.impl("update_kv_cache", _update_impl, "CompositeImplicitAutograd")
_LIB.define("update_kv_cache_(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()")
_LIB.impl("update_kv_cache_", _update_inplace_impl, "CPU")
_LIB.impl("update_kv_cache_", _update_inplace_impl, "PrivateUse1")
_LIB.impl("update_kv_cache_", lambda kv_cache, k, v, slot_mapping: None, "Meta")


def ragged_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_lens: torch.Tensor,
                           page_indices: torch.Tensor, cu_q_lens: torch.Tensor, num_seqs: torch.Tensor, *,
                           sm_scale: float | None = None, sliding_window: int | None = None,
                           soft_cap: float | None = None, k_scale: float | None = None,
                           v_scale: float | None = None, sinks: torch.Tensor | None = None,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                           config: dict | None = None, interpret: str | None = None) -> torch.Tensor:
    """Ragged paged attention over a paged KV cache (mixed prefill + decode); ``torch.ops.tpukernels.ragged_paged_attention``.

    Args:
        q: ``[T, Hq, D]`` bfloat16 or float32, all sequences' query tokens concatenated.
        kv_cache: ``[num_pages, page_size, 2*Hkv, D]``: K of kv head ``h`` at combined head ``2h``, V at
            ``2h+1``; q's dtype, or int8 / float8_e4m3fn / float8_e5m2 (then with ``k_scale`` / ``v_scale``
            and / or ``k_scales`` / ``v_scales``; widened to q's dtype in VMEM). ``D`` a multiple of 32 (64, 96,
            128, 256 compile for v5e / v6e / tpu7x); ``Hq`` a multiple of ``Hkv`` (GQA/MQA).
        kv_lens: int32 ``[S]``: cached tokens per sequence, including this call's new tokens.
        page_indices: int32 ``[S, pages_per_seq]``: the cache pages of each sequence, in order.
        cu_q_lens: int32 ``[S + 1]``: sequence ``s`` owns query rows ``[cu_q_lens[s], cu_q_lens[s+1])``;
            ``cu_q_lens[0] = 0``, non-decreasing, ``q_len <= kv_len``.
        num_seqs: int32 ``[1]`` (or a Python int, not a bool): sequences in use (the rest of the ``S`` entries
            are ignored).
        sm_scale: logit scale; ``None`` means ``1/sqrt(D)`` (JAX's kernel defaults to 1.0).
        sliding_window: query at key position ``pos`` sees keys ``pos - W < j <= pos`` (JAX's convention).
        soft_cap: ``soft_cap * tanh(s / soft_cap)`` on the scaled logits.
        k_scale, v_scale: static dequantization scales of the cache (``K = k_scale * cache_K``).
        sinks: float32 ``[Hq]``: per-head attention-sink logits (gpt-oss): each row's softmax denominator
            gets ``exp(sinks[h])``, with no value (``out = sum_j e^{s_j} V_j / (e^{sink} + sum_j e^{s_j})``).
        k_scales, v_scales: float32 ``[num_pages, page_size]`` (one per cache slot, shared by the kv heads) or
            ``[num_pages, page_size, Hkv]`` (one per slot and kv head; each of the two in either layout):
            per-token dequantization scales, ``K[slot, h] = k_scales[slot] * cache_K[slot, h]`` (or
            ``k_scales[slot, h]``; times ``k_scale`` if given too); for int8 / fp8 caches written with one scale
            per token (JAX's paged attention: one absmax ``h`` per kv head and token, ``scales [Hkv, P,
            page_size, 1]``, ``x = int8 * h / 127.5``: pass ``(h[..., 0] / 127.5).permute(1, 2, 0)``).
            Dequantized in float32, never rounded to q's dtype.
        config: ``{"block_q": .., "pages_per_block": ..}``; default: tuned per chip, else a heuristic.
        interpret: ``"fast"`` / ``"tpu"`` for cpu runs (see :mod:`tpukernels.dsl.modes`).

    Returns:
        ``[T, Hq, D]`` in q's dtype; rows of no sequence (padding) and rows that see no key are 0.

    Raises:
        ArgumentError: a tensor argument that is not a torch.Tensor (``num_seqs``: nor an int; a bool is
            refused), ranks / shapes (``kv_lens [S]``, ``cu_q_lens [S+1]``, ``num_seqs [1]``), head dims,
            ``Hq % Hkv``, bad statics; on host (cpu) tensors also the values: a page index out of
            ``[0, num_pages)``, ``kv_len > pages_per_seq * page_size``, ``cu_q_lens`` not monotone or past
            ``T``, ``q_len > kv_len``, ``num_seqs`` out of ``[0, S]``; ``sinks`` not ``[Hq]``, ``k_scales`` /
            ``v_scales`` not ``[num_pages, page_size]`` / ``[num_pages, page_size, Hkv]`` or only one given.
            Device tensors are not synced to check values; the kernel clamps them (bad values give a defined,
            wrong, result; never an OOB access).
        DTypeError: q not bf16/f32, kv_cache not q's dtype or int8 / fp8, index arrays not int32, sinks or
            scales not float32.
        ConfigError: ``config`` is not a dict of JSON values, or names unknown tunables / breaks their rules.
    """
    from collections.abc import Mapping

    from ..dsl.modes import interpret_mode
    from ..targets import config_to_json

    where = "tpukernels::ragged_paged_attention"
    if isinstance(num_seqs, (bool, np.bool_)):
        raise ArgumentError(f"{where}: num_seqs must be an int32 [1] tensor or a Python int count of sequences, got "
                            f"bool {num_seqs!r} (a bool is not a count)")
    if isinstance(num_seqs, numbers.Integral):  # a Python / numpy int: the [1] int32 tensor it means
        num_seqs = torch.tensor([int(num_seqs)], dtype=torch.int32, device=getattr(kv_lens, "device", None))
    for name, t in (("q", q), ("kv_cache", kv_cache), ("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if not isinstance(t, torch.Tensor):  # before the op's schema check, which would name no rule
            raise ArgumentError(f"{where}: {name} must be a torch.Tensor" + (" (or a Python int)" if name == "num_seqs"
                                else "") + f", got {type(t).__name__}")
    cfg = None if config is None or (isinstance(config, Mapping) and not config) else \
        config_to_json(rpa_kernel, config)
    args = (q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
            None if sm_scale is None else float(sm_scale), sliding_window,
            None if soft_cap is None else float(soft_cap), None if k_scale is None else float(k_scale),
            None if v_scale is None else float(v_scale), sinks, k_scales, v_scales, cfg)
    if interpret:
        with interpret_mode(interpret):
            return torch.ops.tpukernels.ragged_paged_attention(*args)
    return torch.ops.tpukernels.ragged_paged_attention(*args)


def update_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, *,
                    interpret: str | None = None) -> torch.Tensor:
    """Write new K/V tokens into their cache slots; returns the updated cache (``kv_cache`` is not modified).

    ``torch.ops.tpukernels.update_kv_cache``. Token ``t`` goes to page ``slot_mapping[t] // page_size``, row
    ``slot_mapping[t] % page_size``: K at combined heads ``0::2``, V at ``1::2``.

    Args:
        kv_cache: ``[num_pages, page_size, 2*Hkv, D]`` (bf16, f32 or fp8).
        k, v: ``[T, Hkv, D]``, kv_cache's dtype (quantize fp8 caches before).
        slot_mapping: int32 ``[T]``; negative entries are skipped (padding tokens).

    Raises:
        ArgumentError: shapes (``kv_cache.shape[2]`` odd: not ``2*Hkv``); ``kv_cache`` requires grad while grad
            mode is on (the update has no backward); on host tensors a slot ``>= num_pages * page_size`` or a
            slot written twice. Raised before anything is written: ``kv_cache`` is unchanged.
        DTypeError: k / v dtype differs from the cache's; slot_mapping not int32.
    """
    from ..dsl.modes import interpret_mode

    if interpret:
        with interpret_mode(interpret):
            return torch.ops.tpukernels.update_kv_cache(kv_cache, k, v, slot_mapping)
    return torch.ops.tpukernels.update_kv_cache(kv_cache, k, v, slot_mapping)


def update_kv_cache_(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, *,
                     interpret: str | None = None) -> torch.Tensor:
    """Write new K/V tokens into their cache slots **in place**; returns ``kv_cache`` (the same tensor).

    ``torch.ops.tpukernels.update_kv_cache_`` (schema ``update_kv_cache_(Tensor(a!) kv_cache, Tensor k,
    Tensor v, Tensor slot_mapping) -> ()``: the mutation is declared, so torch.compile functionalizes it).
    No copy of the whole cache per step:

    * tpu (TorchTPU): ``update_kv_cache_kernel`` with the caller's cache donated to its aliased output
      (``input_output_aliases={2: 0}``, torch_tpu's ``donate_argnums``; not cloned as the functional op does);
      if the runtime hands back a buffer other than the donated one, that output is copied into ``kv_cache``
      (one copy; XLA reuses donated buffers, so none is expected);
    * cpu: Pallas interpret mode would return the aliased output as a new buffer, so the kernel runs on the
      pages this step touches (gathered: at most ``T`` pages) and those pages are written back with
      ``index_copy_``: memory and time scale with ``T``, not with the cache.

    Same slot semantics, arguments and errors as :func:`update_kv_cache`; also ArgumentError when
    ``kv_cache`` is not contiguous.
    """
    from ..dsl.modes import interpret_mode

    if interpret:
        with interpret_mode(interpret):
            torch.ops.tpukernels.update_kv_cache_(kv_cache, k, v, slot_mapping)
    else:
        torch.ops.tpukernels.update_kv_cache_(kv_cache, k, v, slot_mapping)
    return kv_cache


# ----------------------------------------------------------------------------------------------- JAX entry


def ragged_paged_attention_jax(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=None,
                               sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, sinks=None,
                               k_scales=None, v_scales=None, config=None, interpret=None):
    """:func:`ragged_paged_attention` on jax arrays; trace-safe (``jax.jit``, ``shard_map``): built on
    :func:`tpukernels.jax_call`, Mosaic when lowered for TPU, the interpreter on cpu.

    Arguments, semantics and layouts are those of :func:`ragged_paged_attention` (jax arrays instead of torch
    tensors; ``k_scales`` / ``v_scales`` ``[num_pages, page_size]`` or ``[num_pages, page_size, Hkv]`` float32).

    Raises:
        ArgumentError / DTypeError: as :func:`ragged_paged_attention`, before any kernel runs. The value rules
            (page index in ``[0, num_pages)``, ``kv_len <= pages_per_seq * page_size``, ``cu_q_lens``
            monotone and within ``T``, ``q_len <= kv_len``) are checked when the metadata is concrete (not a
            tracer: eager calls, or metadata closed over); traced metadata is clamped by the kernel, which never
            reads outside the cache (a bad value gives a defined, wrong result, never another sequence's pages
            beyond the page table the caller gave).
        ConfigError: a bad ``config``.
    """
    import jax

    from ..targets.jax_entry import jax_call

    where = "tpukernels::ragged_paged_attention"
    for name, t in (("q", q), ("kv_cache", kv_cache), ("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if isinstance(t, torch.Tensor) or not (hasattr(t, "shape") and hasattr(t, "dtype")):
            raise ArgumentError(f"{where}: {name} must be a jax array, got {type(t).__name__} (torch tensors: use "
                                f"ragged_paged_attention)")
    T, Hq, D, P, ps, Hkv, S, pps = _check_shapes(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache,
                                                 where=where)
    _check_statics(sm_scale, sliding_window, soft_cap, k_scale, v_scale, _dt(kv_cache), where)
    _check_extras(sinks, k_scales, v_scales, Hq, P, ps, Hkv, where)
    meta = (kv_lens, page_indices, cu_q_lens, num_seqs)
    if not any(isinstance(t, jax.core.Tracer) for t in meta):
        _check_value_arrays(*(np.asarray(t) for t in meta), T=T, P=P, ps=ps, where=where)
    if k_scales is not None:  # [P, ps] -> [P, ps, 1]; [P, ps, Hkv] as is
        k_scales, v_scales = k_scales.reshape(P, ps, -1), v_scales.reshape(P, ps, -1)
    return jax_call(rpa_kernel, kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_cache, sinks, k_scales,
                    v_scales, None if sm_scale is None else float(sm_scale), sliding_window,
                    None if soft_cap is None else float(soft_cap), None if k_scale is None else float(k_scale),
                    None if v_scale is None else float(v_scale), config=config, interpret=interpret)


def adapter_scales(k_scales, v_scales, *, P: int, ps: int, Hkv: int, hkv_pad: int, where: str):
    """Per-token scales given to a serving adapter (vLLM-TPU, sglang-jax) in the model's terms, as the kernel
    takes them on the adapter's cache view: ``[P, page_size]`` (one per slot) passes as is; ``[P, page_size,
    Hkv]`` (one per slot and kv head) gains ones for the view's padding kv heads (``hkv_pad > Hkv``: 8-bit
    caches with odd ``Hkv``; those heads' outputs are dropped). jax arrays in, jax arrays out.

    Raises:
        ArgumentError: only one of the two given, or a shape other than those two (naming the argument).
        DTypeError: not float32.
    """
    import jax.numpy as jnp

    if (k_scales is None) != (v_scales is None):
        raise ArgumentError(f"{where}: pass both k_scales and v_scales (per-token scales) or neither")
    if k_scales is None:
        return None, None
    out = []
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        shape = tuple(int(d) for d in t.shape)
        if shape not in ((P, ps), (P, ps, Hkv)):
            raise ArgumentError(f"{where}: {name} must have shape [num_pages, page_size] = ({P}, {ps}) (one scale per "
                                f"cache slot) or [num_pages, page_size, num_kv_heads] = ({P}, {ps}, {Hkv}) (one per "
                                f"slot and kv head), got {shape}")
        if np.dtype(t.dtype) != np.float32:
            raise DTypeError(f"{where}: {name} must be float32, got {np.dtype(t.dtype).name}")
        if len(shape) == 3 and hkv_pad != Hkv:
            t = jnp.pad(t, ((0, 0), (0, 0), (0, hkv_pad - Hkv)), constant_values=1.0)
        out.append(t)
    return tuple(out)


# ----------------------------------------------------------------------------------------------- reference


def paged_attention_reference(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=None,
                              sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, sinks=None,
                              k_scales=None, v_scales=None, dtype=torch.float64) -> torch.Tensor:
    """Dense per-sequence attention with the semantics of :func:`ragged_paged_attention`, in ``dtype``
    (float64 by default), computed from the given (low-precision) inputs. Returns ``[T, Hq, D]`` in ``dtype``."""
    T, Hq, D = q.shape
    H2 = kv_cache.shape[2]
    P, ps, Hkv = kv_cache.shape[0], kv_cache.shape[1], H2 // 2
    r = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.zeros(T, Hq, D, dtype=dtype)
    cache = kv_cache.to(torch.float32).to(dtype)
    for s in range(int(num_seqs[0])):
        q0, q1, kl = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        if q1 == q0:
            continue
        pages = page_indices[s, : -(-kl // ps)].long()
        kv = cache[pages].reshape(-1, H2, D)[:kl]
        k = kv[:, 0::2] * (1.0 if k_scale is None else k_scale)
        v = kv[:, 1::2] * (1.0 if v_scale is None else v_scale)
        if k_scales is not None:  # [P, ps] / [P, ps, 1]: one per slot; [P, ps, Hkv]: one per slot and kv head
            per_slot = lambda t: t.to(dtype).reshape(P, ps, -1)[pages].flatten(0, 1)  # [pages * ps, 1 or Hkv]
            k = k * per_slot(k_scales)[:kl, :, None]  # [kl, 1 or Hkv, 1]
            v = v * per_slot(v_scales)[:kl, :, None]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)  # [kl, Hq, D]
        qs = q[q0:q1].to(dtype)
        logits = torch.einsum("ihd,jhd->hij", qs, k) * scale
        if soft_cap is not None:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        pos = kl - (q1 - q0) + torch.arange(q1 - q0)[:, None]
        j = torch.arange(kl)[None, :]
        vis = j <= pos
        if sliding_window is not None:
            vis = vis & (j > pos - sliding_window)
        logits = logits.masked_fill(~vis, -math.inf)
        if sinks is not None:  # one extra logit per head with no value
            sink = sinks.to(dtype)[:, None, None].expand(Hq, q1 - q0, 1)
            p = torch.softmax(torch.cat([sink, logits], -1), -1)[..., 1:]
        else:
            p = torch.softmax(logits, -1)  # a NaN in this sequence's K/V stays NaN in its rows
            p = torch.where(vis.any(-1, keepdim=True), p, 0.0)  # rows that see nothing -> 0
        out[q0:q1] = torch.einsum("hij,jhd->ihd", p, v)
    return out


# ----------------------------------------------------------------------------------------------- standard cases


def _case(T, S, pps, ps, P, dtype="bf16", **statics):
    st = dict(sm_scale=None, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None)
    st.update(statics)
    return (rpa_kernel, (f"{S}:i32", f"{S}x{pps}:i32", f"{S + 1}:i32", "1:i32", f"{T}x32x128:{dtype}",
                         f"{P}x{ps}x16x128:{dtype}"), st)


#: Shapes the shipped defaults are tuned for (Llama-3-8B-like: Hq 32, Hkv 8, D 128, bf16): a decode batch of
#: 64 sequences x 2048 cached tokens, at page size 16 and 64, and a mixed batch (prefill chunks + decode,
#: 1024 tokens over 64 sequences with up to 2048 keys each).
STANDARD_CASES = [
    _case(64, 64, 2048 // ps, ps, 64 * 2048 // ps, ) for ps in (16, 64)
] + [
    _case(1024, 64, 2048 // ps, ps, 64 * 2048 // ps) for ps in (16, 64)
]

__all__ = ["ragged_paged_attention", "ragged_paged_attention_jax", "update_kv_cache", "update_kv_cache_", "paged_attention_reference", "rpa_kernel",
           "update_kernel", "STANDARD_CASES", "FP8_KV_CHIPS"]
