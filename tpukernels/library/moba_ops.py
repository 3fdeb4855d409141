"""Mixture of Block Attention (MoBA, Lu et al. 2025, arXiv:2502.13189), forward + backward, for TPU.

Causal attention where each query *chunk* of ``chunk_size`` tokens attends to its own chunk (causally) and to the
``topk`` earlier chunks whose mean key scores highest against its mean query. The semantics, argument names and
layout are those of tokamax's torch_tpu MoBA op (``tokamax/experimental/torch_tpu/ops/moba``:
``moba(q, k, v, chunk_size=256, topk=4, scale=None)``, ``[B, T, H, D]``, the JAX reference
``tokamax/_src/ops/experimental/moba/reference.py``), so it can be swapped in. Per batch ``b`` and query head
``h`` (kv head ``h // (Hq // Hkv)``), chunks ``i, j`` of ``chunk_size`` tokens, ``n = ceil(T / chunk_size)``::

    qbar[i]   = mean of q over chunk i;   kbar[j] = mean of k over chunk j               (float32)
    r[i, j]   = scale * qbar[i] . kbar[j]   for j < i  (earlier chunks only; -inf otherwise)
    sel[i]    = the min(topk, i) chunks j < i of highest r[i, j] (ties: lowest j first)
    visible   = key s of chunk j sees query t of chunk i  iff  (j == i and s <= t)  or  j in sel[i]
    out[t]    = sum_s softmax_s(scale * q[t] . k[s] over visible s) * v[s]

Public API (torch tensors):

* :func:`moba_attention` ``(q, k, v, chunk_size=256, topk=4, scale=None)`` -> ``[B, T, Hq, Dv]``,
  differentiable in q, k, v;
* :func:`moba_block_indices` -> the routing, int32 ``[B, Hq, n, min(topk, n)]`` (``-1``: no chunk);
* :func:`moba_attention_reference`: the dense float64 definition.

Kernels: no new kernel body. The attention is the block-sparse masked flash attention of
:mod:`tpukernels.library.attention.masked` (``torch.ops.tpukernels.flash_attention_masked_fwd`` and its
backward kernels ``flash_attention_masked_bwd_dq`` / ``flash_attention_masked_bwd_dkv``, written with the DSL),
with blocks of ``chunk_size`` and scalar-prefetched block tables built here from the routing (on the tensors'
device, torch ops): per query chunk the selected chunks (full blocks, no element mask) and its own chunk (one
shared lower-triangular int8 mask block), per key chunk the query chunks that read it (the dK/dV kernel's
list). The batch is folded into the head axis (``[1, B * Hq, T, D]``, kv head ``b * Hkv + h // G``, exactly the
GQA map of the folded heads) so the per-(batch, head) routing becomes a per-head table. The routing (chunk
means, scores, top-k by a stable descending sort) is torch code outside the kernels, not differentiated (as
tokamax's ``stop_gradient``). Backward: the masked kernels' ``def_backward`` (dQ kernel over each query
chunk's list, dK/dV kernel over each key chunk's list, GQA groups summed in the kernel); the mean pooling of
the routing has no gradient. One host sync per call of the op: the dK/dV tables' list length is the largest number of
query chunks reading one key chunk (rounded up to a power of two, so few distinct programs), since a static
bound of ``n`` would cost ``n`` grid steps per key chunk. Both tables are scalar-prefetched into SMEM (1 MiB on
v5e / v6e / tpu7x, last dim padded to 128 words), so the op splits its kernel calls over head groups and ranges
of query chunks until each call's tables fit :data:`SMEM_TABLE_BUDGET` (tokamax's defaults at T = 8192 with 32
heads: 4 calls of 8 heads; a range ``[i0, i1)`` reads only keys ``[0, i1 * chunk_size)``; the heads of one
GQA group may go to separate calls, their dK / dV adding up through autograd); past about 500 chunks (T = 128K
at chunk 256) even one query chunk of one head per call does not fit (:class:`ArgumentError`: use a larger
``chunk_size``).

Extensions over tokamax (which raises for them): GQA / MQA (``k``, ``v`` with ``Hkv`` dividing ``Hq``; routing
per query head against its kv head's chunk means), ``T`` not a multiple of ``chunk_size`` (the last chunk is
shorter; its mean is over its own tokens; the kernels mask the tail), ``v`` head dim ``Dv != D``.
Differences: ``scale=0.0`` is a scale of 0 (tokamax's torch fallback reads ``scale or D ** -0.5``);
the routing runs in float32 from the inputs (tokamax's JAX reference upcasts to float32 too).
Gaps: no ``cu_seqlens`` (variable-length packed batches; tokamax takes none either: pad to one length,
or run sequences separately); bf16 / f32 only (Mosaic takes no float16 kernel arguments); ``chunk_size`` a
multiple of 128 (tokamax's tests use 64: the masked kernels' lse rows are 128-lane blocks, so a 64-token query
block is no legal TPU block once T holds more than one; :class:`ArgumentError`). No DTensor rule of its own: the
kernel calls see the folded ``[1, B * Hq, T, D]`` tensors with per-head tables, which the masked kernels' rule
splits neither over batch (1 after folding) nor over heads (it splits heads only for one shared table).

Tuning: the masked kernels' one tunable, ``block_kv_compute`` (key positions per compute sub-block, used when
it divides ``chunk_size``), through ``config``; their per-chip defaults apply.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import ArgumentError, DTypeError

_DTYPES = (torch.bfloat16, torch.float32)

#: tokamax's defaults (``tokamax/experimental/torch_tpu/ops/moba/torch_base.py``).
CHUNK_SIZE = 256
TOPK = 4


# ----------------------------------------------------------------------------------------------- checks


def check_qkv(q, k, v, chunk_size, topk, scale, where: str) -> tuple[int, int, int, int, int, int]:
    """Typed checks of ``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]``, ``v [B, T, Hkv, Dv]`` and the statics;
    returns ``(B, T, Hq, Hkv, D, Dv)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ArgumentError(f"{where}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ArgumentError(f"{where}: {name} must have rank 4 [B, T, H, D] (tokamax's layout), got shape "
                                f"{tuple(x.shape)}")
        if x.dtype not in _DTYPES:
            raise DTypeError(f"{where}: {name} dtype {x.dtype} is not supported; use bfloat16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise DTypeError(f"{where}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, Hq, D = (int(d) for d in q.shape)
    if tuple(k.shape[:2]) != (B, T) or tuple(v.shape[:2]) != (B, T):
        raise ArgumentError(f"{where}: k and v must have q's [B, T] = ({B}, {T}), got k {tuple(k.shape)}, "
                            f"v {tuple(v.shape)}")
    Hkv = int(k.shape[2])
    if int(v.shape[2]) != Hkv:
        raise ArgumentError(f"{where}: k and v must have the same number of heads, got {Hkv} and {int(v.shape[2])}")
    if Hkv == 0 or Hq % Hkv:
        raise ArgumentError(f"{where}: the query heads ({Hq}) must be a multiple of the kv heads ({Hkv}) (GQA)")
    if int(k.shape[3]) != D:
        raise ArgumentError(f"{where}: k head dim {int(k.shape[3])} must equal q head dim {D}")
    if D == 0 or int(v.shape[3]) == 0:
        raise ArgumentError(f"{where}: head dims must be positive, got q {D}, v {int(v.shape[3])}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % 128:
        raise ArgumentError(f"{where}: chunk_size must be a positive multiple of 128 (the kernels' query block: "
                            f"their lse rows are laid out in 128-lane windows), got {chunk_size!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
        raise ArgumentError(f"{where}: topk must be an int >= 0, got {topk!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ArgumentError(f"{where}: scale must be a finite float or None, got {scale!r}")
    return B, T, Hq, Hkv, D, int(v.shape[3])


# ----------------------------------------------------------------------------------------------- routing


def chunk_means(x: torch.Tensor, chunk_size: int, dtype=torch.float32) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[B, H, n, D]``: the mean of each chunk of ``chunk_size`` tokens (the last chunk over
    its own tokens when ``T % chunk_size``), computed in ``dtype``."""
    B, T, H, D = x.shape
    n = -(-T // chunk_size)
    xf = x.to(dtype)
    if n * chunk_size != T:
        xf = torch.cat([xf, xf.new_zeros(B, n * chunk_size - T, H, D)], dim=1)
    sums = xf.reshape(B, n, chunk_size, H, D).sum(2).transpose(1, 2)  # [B, H, n, D]
    counts = torch.clamp(T - torch.arange(n, device=x.device) * chunk_size, max=chunk_size).to(dtype)
    return sums / counts[:, None]


def select_blocks(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-``topk`` over the last axis of causal routing ``scores [..., n, n]`` (``-inf`` where a block may not
    be chosen): int32 ``[..., n, min(topk, n)]`` in descending score order, ties lowest index first (a stable
    sort, ``jax.lax.top_k``'s documented order), ``-1`` where the score is ``-inf``."""
    k = min(int(topk), int(scores.shape[-1]))
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :k], idx[..., :k]
    return torch.where(torch.isneginf(vals), -1, idx).to(torch.int32)


def moba_block_indices(q: torch.Tensor, k: torch.Tensor, *, chunk_size: int = CHUNK_SIZE, topk: int = TOPK,
                       scale: float | None = None) -> torch.Tensor:
    """MoBA's routing: the earlier chunks each query chunk attends to, besides its own.

    Args:
        q: ``[B, T, Hq, D]``; k: ``[B, T, Hkv, D]`` (``Hkv`` divides ``Hq``); bf16 / f32.
        chunk_size, topk, scale: as :func:`moba_attention`.

    Returns:
        int32 ``[B, Hq, n, min(topk, n)]``, ``n = ceil(T / chunk_size)``: per query head and query chunk ``i``
        the chunks ``j < i`` of highest ``scale * mean(q chunk i) . mean(k chunk j)`` (float32), in descending
        score order (ties lowest ``j`` first), ``-1`` past the ``i`` earlier chunks there are. No gradient.

    Raises:
        ArgumentError, DTypeError: as :func:`moba_attention`.
    """
    where = "tpukernels::moba_block_indices"
    B, T, Hq, Hkv, D, _ = check_qkv(q, k, k, chunk_size, topk, scale, where)
    return route_chunks(q.detach(), k.detach(), chunk_size, topk, D ** -0.5 if scale is None else float(scale))


def route_chunks(q, k, chunk_size, topk, scale, dtype=torch.float32):
    Hq, Hkv = q.shape[2], k.shape[2]
    qm = chunk_means(q, chunk_size, dtype)
    km = chunk_means(k, chunk_size, dtype).repeat_interleave(Hq // Hkv, dim=1)
    n = qm.shape[2]
    scores = torch.einsum("bhid,bhjd->bhij", qm, km) * scale
    earlier = torch.arange(n, device=q.device)[None, :] < torch.arange(n, device=q.device)[:, None]
    return select_blocks(torch.where(earlier, scores, -math.inf), topk)


# ----------------------------------------------------------------------------------------------- tables


_DIAG, _FULL, _TAIL = 1, 2, 3  # table codes: own chunk (causal mask block 0), a full chunk, a chunk read by the
# shorter last query chunk (mask block 1: its rows past T masked, so the dK/dV sums never see the NaN-able rows)


def _compact(code: torch.Tensor, length: int) -> torch.Tensor:
    """Lists of the nonzero columns of ``code [H, n, m]`` (:data:`_DIAG` / :data:`_FULL` / :data:`_TAIL`) as the
    masked kernels' table ``[3, H, n, length]``: row 0 the column (ascending; past the list the last listed one,
    so no DMA is issued), row 1 the kind (1 partial, 2 full; 0 past the list: the step does nothing), row 2 the
    mask block of a partial step (repeated past the list likewise)."""
    m = code.shape[-1]
    col = torch.arange(m, device=code.device, dtype=torch.int32)
    order = torch.sort(torch.where(code > 0, col, col + m), dim=-1, stable=True).indices[..., :length].long()
    if order.shape[-1] < length:
        order = torch.cat([order, order[..., -1:].expand(*order.shape[:-1], length - order.shape[-1])], -1)
    count = (code > 0).sum(-1, keepdim=True)  # >= 1: every chunk lists its own (diagonal) block
    listed = torch.arange(length, device=code.device) < count
    order = torch.where(listed, order, torch.gather(order, -1, (count - 1).clamp(min=0)))
    c = torch.gather(code, -1, order)
    kind = torch.where(listed, torch.where(c == _FULL, 2, 1), 0)
    return torch.stack([order, kind, (c == _TAIL).long()]).to(torch.int32)


def chunk_codes(sel: torch.Tensor, n: int, tail: int, chunk_size: int) -> torch.Tensor:
    """``[H, n, n]`` int32 per (query chunk, key chunk) from routing ``sel [H, n, K]`` (``-1``: none):
    :data:`_DIAG` on the diagonal, :data:`_FULL` where selected (:data:`_TAIL` for a last query chunk of
    ``tail < chunk_size`` tokens), 0 elsewhere."""
    H, _, K = sel.shape
    dev = sel.device
    code = torch.zeros(H, n, n + 1, dtype=torch.int32, device=dev)  # column n collects the -1 slots
    code.scatter_(2, torch.where(sel >= 0, sel, n).long(), _FULL)
    code = code[..., :n]
    if tail < chunk_size:
        code[:, n - 1] = torch.where(code[:, n - 1] == _FULL, _TAIL, code[:, n - 1])
    return torch.where(torch.eye(n, dtype=torch.bool, device=dev), _DIAG, code)


def _pow2_at_most(x: int, cap: int) -> int:
    return min(cap, 1 << (max(1, x) - 1).bit_length())


def block_tables(sel: torch.Tensor, n: int, tail: int, chunk_size: int):
    """The masked kernels' ``(fwd_table [3, H, n, 1 + K], bwd_table [3, H, n, Tq])`` for routing ``sel [H, n, K]``
    (``-1``: none): each query chunk visits its selected chunks (full, or partial with mask block 1 for a last
    chunk of ``tail < chunk_size`` tokens) and itself (partial, the causal mask block 0); ``Tq``, the longest
    list of query chunks reading one key chunk, rounded up to a power of two (at most ``n``; one host sync)."""
    code = chunk_codes(sel, n, tail, chunk_size)
    code_t = code.transpose(1, 2)
    tq = _pow2_at_most(int((code_t > 0).sum(-1).max()), n)
    return _compact(code, 1 + sel.shape[-1]), _compact(code_t, tq)


def _mask_blocks(bs: int, tail: int, device):
    """int8 ``[2, bs, bs]``: the causal block, and the block of a short last query chunk (rows < ``tail``)."""
    tril = torch.tril(torch.ones(bs, bs, dtype=torch.int8, device=device))
    rows = (torch.arange(bs, device=device) < tail).to(torch.int8)[:, None].expand(bs, bs)
    mb = torch.stack([tril, rows])
    return mb, mb.transpose(1, 2).contiguous()


#: Bytes of scalar memory the two block tables of one kernel call may take. Both are scalar-prefetched into SMEM
#: (1 MiB on v5e / v6e / tpu7x) with their last dim padded to 128 words: a ``[3, H, n, L]`` int32 table takes
#: ``12 * H * n * ceil(L / 128) * 128`` bytes (libtpu: tables for 16 heads x 32 chunks "Used 1.50M of 1.00M
#: smem"). Calls whose tables would be larger are split over head groups and ranges of query chunks.
SMEM_TABLE_BUDGET = 768 * 1024


def _table_bytes(heads: int, rows: int, length: int) -> int:
    return 12 * heads * rows * (-(-length // 128) * 128)


def call_split(BH: int, G: int, n: int, K: int, budget: int = SMEM_TABLE_BUDGET) -> tuple[int, int]:
    """``(heads per call, query chunks per call)`` whose tables fit ``budget`` bytes (worst case: every key chunk
    read by every query chunk of the call): the most query chunks (a power of two, or all ``n``), then the most
    heads, a multiple of the GQA group ``G`` or a divisor of it (the heads of one group may go to separate calls:
    their dK / dV add up through autograd). Raises :class:`ArgumentError` where one query chunk of one head per
    call does not fit (about 500 chunks)."""
    r = n
    while r >= 1:
        per_head = _table_bytes(1, r, 1 + K) + _table_bytes(1, n, r)
        hc = budget // per_head
        if hc >= 1:
            hc = hc // G * G if hc >= G else max(d for d in range(1, hc + 1) if G % d == 0)
            return min(hc, BH), r
        r = 1 << ((r - 1).bit_length() - 1) if r > 1 else 0
    raise ArgumentError(f"tpukernels::moba_attention: {n} chunks are more than the kernels' block tables can list "
                        f"in TPU scalar memory ({budget} bytes); use a larger chunk_size")


def block_sparse_attention(q, k, v, sel, *, chunk_size: int, scale: float, config=None, interpret=None):
    """Attention of ``q [B, T, Hq, D]`` over its own chunk (causal) and the chunks ``sel [B, Hq, n, K]`` (int,
    ``-1``: none; each below its query chunk), by the masked flash-attention kernels (differentiable in q, k, v):
    ``[B, T, Hq, Dv]``. The batch is folded into the heads; calls are split so the tables fit
    :data:`SMEM_TABLE_BUDGET` (a range of query chunks ``[i0, i1)`` reads keys ``[0, i1 * chunk_size)`` only;
    the gradients of the calls add up through autograd)."""
    from .attention.masked import fa_forward_masked

    B, T, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    G = Hq // Hkv
    n = -(-T // chunk_size)
    bs = min(chunk_size, T)  # the kernels' block: all of T when shorter than one chunk
    tail = T - (n - 1) * chunk_size
    code = chunk_codes(sel.reshape(B * Hq, n, sel.shape[-1]), n, tail, bs)
    fwd_all = _compact(code, 1 + sel.shape[-1])
    hc, r = call_split(B * Hq, G, n, sel.shape[-1], SMEM_TABLE_BUDGET)
    # ranges end at n, the leftover range at the front; a range of only a short last chunk would make the
    # kernels' block that chunk's length, so it takes the chunk before it too (SMEM_TABLE_BUDGET keeps room)
    ranges = [(max(0, e - r), e) for e in range(n, 0, -r)][::-1]
    if tail < bs and len(ranges) > 1 and ranges[-1][0] == n - 1:
        ranges[-1] = (n - 2, n)
        ranges[-2] = (ranges[-2][0], n - 2)
        ranges = [x for x in ranges if x[1] > x[0]]
    readers = (code > 0).transpose(1, 2)  # [BH, key chunk, query chunk]
    tq = torch.stack([readers[..., i0:i1].sum(-1).amax() for i0, i1 in ranges]).tolist()  # one host sync
    mb, mbt = _mask_blocks(bs, tail, q.device)
    fold = lambda x: x.transpose(1, 2).reshape(1, B * x.shape[2], T, x.shape[3])  # noqa: E731
    qf, kf, vf = fold(q), fold(k), fold(v)
    rows = []
    for (i0, i1), t in zip(ranges, tq):
        q0, q1, kv1 = i0 * chunk_size, min(T, i1 * chunk_size), min(T, i1 * chunk_size)
        heads = []
        for h0 in range(0, B * Hq, hc):
            h1 = min(B * Hq, h0 + hc)
            fwd = fwd_all[:, h0:h1, i0:i1]
            bwd = _compact(code[h0:h1, i0:i1, :i1].transpose(1, 2), _pow2_at_most(int(t), i1 - i0))
            g0, g1 = h0 // G, -(-h1 // G)  # the kv heads of query heads [h0, h1) (part of one group, or whole ones)
            out, _ = fa_forward_masked(fwd, bwd, qf[:, h0:h1, q0:q1], kf[:, g0:g1, :kv1], vf[:, g0:g1, :kv1], mb,
                                       mbt, None, None, sm_scale=float(scale),
                                       softcap=None, config=config, interpret=interpret)
            heads.append(out)
        rows.append(heads[0] if len(heads) == 1 else torch.cat(heads, 1))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, 2)
    return out.reshape(B, Hq, T, Dv).transpose(1, 2)


# ----------------------------------------------------------------------------------------------- public


def moba_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = CHUNK_SIZE,
                   topk: int = TOPK, scale: Optional[float] = None, *, config: dict | None = None,
                   interpret: str | None = None) -> torch.Tensor:
    """Mixture of Block Attention (causal), tokamax's torch_tpu ``moba`` signature and layout.

    Args:
        q: ``[B, T, Hq, D]``; k: ``[B, T, Hkv, D]``; v: ``[B, T, Hkv, Dv]``; one dtype, bfloat16 or float32.
            ``Hkv`` divides ``Hq`` (GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``; tokamax: ``Hkv ==
            Hq``). Any ``T >= 0`` (tokamax: a multiple of ``chunk_size``; here the last chunk may be shorter).
        chunk_size: tokens per chunk (MoBA's block size), a multiple of 8; TPU compilation needs a multiple of
            128 or one of 8, 16, 32, 64. Default 256 (tokamax's).
        topk: earlier chunks each query chunk attends to besides its own (``>= 0``; more than there are: all of
            them). Default 4 (tokamax's).
        scale: logit scale; ``None``: ``D ** -0.5``.
        config: ``{"block_kv_compute": ..}`` for the masked attention kernels; default their tuned value.
        interpret: ``"fast"`` / ``"tpu"`` for cpu runs (see :mod:`tpukernels.dsl.modes`).

    Returns:
        ``[B, T, Hq, Dv]`` in q's dtype (the formula in the module docstring). Differentiable in q, k, v (the
        routing is not differentiated).

    Raises:
        ArgumentError: not tensors, ranks, ``B`` / ``T`` / head / head-dim mismatches, ``Hq % Hkv``,
            ``chunk_size`` not a positive multiple of 8, ``topk`` not an int ``>= 0``, ``scale`` not finite.
        DTypeError: q, k, v not one dtype of bfloat16 / float32.

    Sources: tokamax ``experimental/torch_tpu/ops/moba`` (signature, layout, routing by chunk means, own chunk
    causal) and ``_src/ops/experimental/moba/reference.py``; Lu et al., "MoBA: Mixture of Block Attention for
    Long-Context LLMs" (arXiv:2502.13189).
    """
    where = "tpukernels::moba_attention"
    B, T, Hq, Hkv, D, Dv = check_qkv(q, k, v, chunk_size, topk, scale, where)
    scale = D ** -0.5 if scale is None else float(scale)
    if B == 0 or T == 0 or Hq == 0:
        return q.new_zeros(B, T, Hq, Dv)
    sel = route_chunks(q.detach(), k.detach(), chunk_size, topk, scale)
    return block_sparse_attention(q, k, v, sel, chunk_size=chunk_size, scale=scale, config=config,
                                  interpret=interpret)


# ----------------------------------------------------------------------------------------------- reference


def visible_mask(sel: torch.Tensor, T: int, chunk_size: int) -> torch.Tensor:
    """Dense ``[B, Hq, T, T]`` bool: query ``t`` sees key ``s`` (own chunk causal, or ``s``'s chunk in ``sel``)."""
    B, Hq, n, K = sel.shape
    blk = torch.arange(T, device=sel.device) // chunk_size
    chosen = torch.zeros(B, Hq, n, n + 1, dtype=torch.bool, device=sel.device)
    chosen.scatter_(3, torch.where(sel >= 0, sel, n).long(), True)
    chosen = chosen[..., :n]
    pos = torch.arange(T, device=sel.device)
    own = (blk[:, None] == blk[None, :]) & (pos[None, :] <= pos[:, None])
    return own | chosen[:, :, blk][:, :, :, blk]


def moba_attention_reference(q, k, v, chunk_size: int = CHUNK_SIZE, topk: int = TOPK, scale=None, *,
                             block_indices: torch.Tensor | None = None, dtype=torch.float64) -> torch.Tensor:
    """The dense MoBA definition in ``dtype`` (float64) from the given (low-precision) tensors: routing from the
    chunk means in ``dtype`` (or ``block_indices [B, Hq, n, K]`` if given), a dense visibility mask, softmax.
    Returns ``[B, T, Hq, Dv]`` in ``dtype``."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    qd, kd, vd = (x.to(dtype) for x in (q, k, v))
    sel = route_chunks(qd, kd, chunk_size, topk, scale, dtype) if block_indices is None else block_indices
    kd, vd = (x.repeat_interleave(G, dim=2) for x in (kd, vd))
    s = torch.einsum("bthd,bshd->bhts", qd, kd) * scale
    s = s.masked_fill(~visible_mask(sel, T, chunk_size), -math.inf)
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), vd)


__all__ = ["moba_attention", "moba_block_indices", "moba_attention_reference", "block_sparse_attention",
           "block_tables", "chunk_means", "select_blocks", "visible_mask", "check_qkv", "CHUNK_SIZE", "TOPK"]
