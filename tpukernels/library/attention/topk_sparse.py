"""Top-k sparse attention (DeepSeek Sparse Attention's prefill / training path) on the block-sparse masked kernels.

:func:`topk_sparse_attention` is softmax attention in which each query sees only the key positions its row of
``indices`` lists (DeepSeek-V3.2's lightning indexer picks them; one list per query, shared by all heads), ANDed
with an ordinary attention mask. It is what transformers' ``DeepseekV32Attention`` / ``GlmMoeDsaAttention``
compute in eager mode (the index set scattered into a boolean mask, ANDed into the attention mask), and what they
pass as ``indices=`` to any other attention implementation.

How it runs (a choice, and its cost): the index set is scattered into a dense boolean visibility
``[B, Sq, Skv]`` (ANDed with ``attention_mask`` and ``causal``), cut into ``bq x bkv`` blocks, and the
block-sparse tables of :mod:`.masked` (the kernels behind ``flash_attention(mask=...)``) are built **on the
tensors' device, without a host sync** (a block is skipped if nothing in it is visible, runs without an element
mask if all of it is, else ANDs its int8 element block). The batch is folded into the head axis
(``[1, B*Hq, S, D]``, the mask per folded head), so one call serves a per-sequence, per-step selection; forward,
dQ and dK/dV are the masked kernels' (autograd wired there). Costs, stated plainly:

* compute: every ``bq x bkv`` block holding at least one selected key is computed densely. A top-k selection
  scattered over the whole causal prefix touches nearly every block below the diagonal, so the work is that of
  dense causal attention (``~Sq*Skv/2`` score pairs), not ``Sq*topk`` (the last point: why a gather of the
  selected rows does not pay in this layout).
* memory: the element blocks take ``2 * B * Sq_b * Skv_b`` bytes (int8, and its transpose for dK/dV; padded to
  the blocks) plus the visibility itself; e.g. 32 MiB at ``B=1, S=4096``, 2 GiB at ``S=32768``, 32 GiB at
  DeepSeek-V3.2's 128K context: long-context training needs the selection as bits or built inside the
  kernel (the kernels take int8 element blocks): a gap.
* why not a gather kernel here: in this layout (transformers' expanded MLA heads, K / V per head) the selected
  rows differ per head and per query, so a gather reuses nothing across queries. DeepSeek-V3.2 at S=8192,
  top-2048, 128 heads, D 192 / Dv 128, bf16: gathering reads ``2048 * 128 * 320 * 2`` B = 168 MB per query,
  1.4 TB per sequence (~1.7 s of v5e HBM bandwidth), while the dense causal blocks are ~2.8 TFLOP (~14 ms at v5e's
  bf16 peak). Sparsity pays only in the absorbed form (one 576-wide latent row per key shared by all heads,
  FlashMLA's sparse prefill), which means rewriting the attention module, not the attention function the
  model calls: the gap.

``indices`` as a set: duplicates count once (as transformers' scatter), ``topk`` may exceed ``Skv``, and ``-1``
marks an unused slot (FlashMLA's convention). A query that sees no key outputs exactly 0 and gets zero gradients.

Sources: DeepSeek-AI, "DeepSeek-V3.2-Exp" (DSA: lightning indexer + top-k selection, 2025); transformers 5.x
``models/deepseek_v32/modeling_deepseek_v32.py`` (``DeepseekV32Attention.forward``: the index mask);
FlashMLA ``flash_mla_sparse_fwd`` (indices ``[s_q, h_kv, topk]``, ``-1`` invalid).
"""

from __future__ import annotations

import torch

from ...errors import ArgumentError, DeviceError, DTypeError
from .buckets import bucket_len, pad_len, slice_len
from .masks import EMPTY, FULL, PARTIAL, block_config

#: Default block shape (queries x keys) of the tables; as ``flash_attention(mask=...)`` (multiples of 128).
BLOCK = 512

_WHERE = "topk_sparse_attention"


def index_visibility(indices: torch.Tensor, Skv: int, attention_mask: torch.Tensor | None = None,
                     causal: bool = False, causal_alignment: str = "top_left") -> torch.Tensor:
    """Dense ``[B, Sq, Skv]`` bool: key ``j`` visible to query ``i`` iff ``j`` is in ``indices[b, i]`` (entries
    outside ``[0, Skv)``, such as ``-1``, ignored), ``attention_mask[b, i, j]`` (if given) and the causal bound
    (if ``causal``).

    This is the mask transformers' eager DSA attention builds (``ones.scatter(-1, indices, False)``, ANDed into
    the attention mask); :func:`topk_sparse_attention` and its tests' reference both use it."""
    B, Sq = int(indices.shape[0]), int(indices.shape[1])
    idx = indices.long()
    idx = torch.where((idx < 0) | (idx >= Skv), torch.full_like(idx, Skv), idx)  # -> a spill column, dropped below
    vis = torch.zeros(B, Sq, Skv + 1, dtype=torch.bool, device=indices.device)
    vis = vis.scatter(-1, idx, True)[..., :Skv]
    if attention_mask is not None:
        vis = vis & (attention_mask[:, 0] if attention_mask.dim() == 4 else attention_mask)
    if causal:
        off = Skv - Sq if causal_alignment == "bottom_right" else 0
        i = torch.arange(Sq, device=vis.device)[:, None]
        j = torch.arange(Skv, device=vis.device)[None, :]
        vis = vis & (j <= i + off)
    return vis


def _lists(kind: torch.Tensor, block_id: torch.Tensor) -> torch.Tensor:
    """Per major block, the non-empty minor blocks first, in order: int32 ``[3, B, n_major, n_minor]`` rows
    (block index, kind, element-block id); past the list the last listed block repeats with kind 0 (skip, no
    DMA), the layout of :class:`.masks.MaskTables`. ``kind``, ``block_id``: ``[B, n_major, n_minor]``."""
    n_minor = kind.shape[-1]
    nz = kind != EMPTY
    order = torch.argsort((~nz).to(torch.int8), dim=-1, stable=True)  # listed blocks first, ascending
    n = nz.sum(-1, keepdim=True)
    t = torch.arange(n_minor, device=kind.device)
    last = order.gather(-1, (n - 1).clamp(min=0))
    cols = torch.where(t < n, order, last)
    kinds = torch.where(t < n, kind.gather(-1, cols), torch.zeros_like(kind))
    return torch.stack([cols, kinds, block_id.gather(-1, cols)]).to(torch.int32)


def block_tables(vis: torch.Tensor, bq: int, bkv: int, heads: int):
    """Block-sparse tables (:mod:`.masked`'s kernel arguments) of a per-sequence visibility ``vis``
    ``[B, Sq, Skv]`` (lengths multiples of ``bq`` / ``bkv``) for the batch folded into ``B * heads`` heads:
    ``(fwd_table [3, B*heads, nq, nk], bwd_table [3, B*heads, nk, nq], blocks [B*nq*nk, bq, bkv] i8, blocks_t)``,
    every element block kept (no deduplication: nothing leaves the device)."""
    B, Sq, Skv = vis.shape
    nq, nk = Sq // bq, Skv // bkv
    blk = vis.view(B, nq, bq, nk, bkv).permute(0, 1, 3, 2, 4)  # [B, nq, nk, bq, bkv]
    full = blk.all(-1).all(-1)
    some = blk.any(-1).any(-1)
    kind = torch.where(full, FULL, torch.where(some, PARTIAL, EMPTY))  # [B, nq, nk]
    block_id = torch.arange(B * nq * nk, device=vis.device).view(B, nq, nk)
    fwd = _lists(kind, block_id)
    bwd = _lists(kind.transpose(1, 2), block_id.transpose(1, 2))

    def per_head(t):  # [3, B, n, T] -> [3, B*heads, n, T]: each folded head reads its sequence's lists
        return t[:, :, None].expand(3, B, heads, *t.shape[2:]).reshape(3, B * heads, *t.shape[2:]).contiguous()

    blocks = blk.reshape(B * nq * nk, bq, bkv).to(torch.int8)
    blocks_t = blk.transpose(-1, -2).reshape(B * nq * nk, bkv, bq).to(torch.int8)
    return per_head(fwd), per_head(bwd), blocks, blocks_t


def _check(q, k, v, indices, attention_mask, causal, causal_alignment, sm_scale, softcap, bucket):
    for name, val in (("causal", causal), ("bucket", bucket)):
        if not isinstance(val, bool):
            raise ArgumentError(f"{_WHERE}: {name} must be a bool, got {val!r}")
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ArgumentError(f"{_WHERE}: causal_alignment must be 'top_left' or 'bottom_right', got "
                            f"{causal_alignment!r}")
    for name, val in (("sm_scale", sm_scale), ("softcap", softcap)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, (int, float))):
            raise ArgumentError(f"{_WHERE}: {name} must be a float or None, got {val!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("indices", indices)):
        if not isinstance(x, torch.Tensor):
            raise ArgumentError(f"{_WHERE}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ArgumentError(f"{_WHERE}: q, k, v must have rank 4 [B, H, S, D], got {tuple(q.shape)}, "
                            f"{tuple(k.shape)}, {tuple(v.shape)}")
    if len({q.dtype, k.dtype, v.dtype}) != 1 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"{_WHERE}: q, k, v must share one dtype of bfloat16 / float16 / float32, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, Sq = (int(s) for s in q.shape[:3])
    Skv = int(k.shape[2])
    if k.shape[0] != B or v.shape[0] != B or v.shape[1] != k.shape[1] or v.shape[2] != Skv or k.shape[3] != q.shape[3]:
        raise ArgumentError(f"{_WHERE}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                            f"[B, Hq, Sq, D], [B, Hkv, Skv, D], [B, Hkv, Skv, Dv]")
    if int(k.shape[1]) == 0 or Hq % int(k.shape[1]):
        raise ArgumentError(f"{_WHERE}: Hq = {Hq} must be a multiple of Hkv = {int(k.shape[1])}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise DTypeError(f"{_WHERE}: indices must be int32 or int64, got {indices.dtype}")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (B, Sq):
        raise ArgumentError(f"{_WHERE}: indices must be [B, Sq, topk] = [{B}, {Sq}, topk] (one key list per "
                            f"query, shared by the heads), got {tuple(indices.shape)}")
    for name, x in (("k", k), ("v", v), ("indices", indices)):
        if x.device != q.device:
            raise DeviceError(f"{_WHERE}: {name} is on {x.device} but q is on {q.device}")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
            raise DTypeError(f"{_WHERE}: attention_mask must be a bool tensor (True = visible), got "
                             f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)}")
        shape = tuple(attention_mask.shape)
        if shape not in ((B, Sq, Skv), (B, 1, Sq, Skv)):
            raise ArgumentError(f"{_WHERE}: attention_mask must be [B, Sq, Skv] or [B, 1, Sq, Skv] = "
                                f"{(B, 1, Sq, Skv)}, got {shape}")
        if attention_mask.device != q.device:
            raise DeviceError(f"{_WHERE}: attention_mask is on {attention_mask.device} but q is on {q.device}")
    # values checked on cpu tensors (on a device a check would be a host sync per call: there an index outside
    # [0, Skv) is ignored, as -1 is); under torch.compile the values are unknown here, so the graph asserts them
    if indices.numel() and indices.device.type == "cpu" and not torch.compiler.is_compiling():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= Skv:
            raise ArgumentError(f"{_WHERE}: indices must lie in [0, Skv) = [0, {Skv}) or be -1 (unused slot), got "
                                f"values in [{lo}, {hi}]")
    elif indices.numel() and indices.device.type == "cpu":
        torch._assert_async(((indices >= -1) & (indices < Skv)).all(),
                            f"{_WHERE}: indices must lie in [0, Skv) = [0, {Skv}) or be -1 (unused slot)")


def topk_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
    causal_alignment: str = "top_left",
    sm_scale: float | None = None,
    softcap: float | None = None,
    config: dict | None = None,
    interpret: str | None = None,
    bucket: bool = True,
) -> torch.Tensor:
    """Attention over each query's top-k selected keys (DeepSeek Sparse Attention), differentiable, SDPA layout.

    Per batch ``b``, query head ``h`` (kv head ``h // (Hq // Hkv)``) and query ``i``::

        visible[i, j] = j in indices[b, i, :]  and  attention_mask[b, i, j]  and  (not causal or j <= i + off)
        out[i]        = sum_j softmax_j(sm_scale * q[i] . k[j]  over visible j) * v[j]

    with ``off = Skv - Sq`` for ``causal_alignment="bottom_right"``, else 0; the soft-cap, if given, applies to
    the scaled logits before masking. Equal to transformers' eager ``DeepseekV32Attention`` (the index set
    scattered into a mask ANDed with the attention mask) on every row that sees a key.

    This is **not** a gather kernel: it runs the block-sparse masked flash-attention kernels on a dense
    visibility mask built from ``indices`` on the device (module docstring: compute is that of dense attention
    over the blocks the selection touches, ~dense causal for a DSA selection; memory ``2 * B * Sq * Skv`` bytes
    of element blocks). Gaps: no gather of only the selected K/V rows (FlashMLA's sparse prefill), no
    attention sinks, no absorbed-MLA latent form (q / k / v are the expanded heads transformers passes).

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Skv, D]``; v: ``[B, Hkv, Skv, Dv]``; one dtype of bfloat16,
            float16 (computed in float32) or float32; ``Hq`` a multiple of ``Hkv``; D and Dv may differ
            (DeepSeek MLA: 192 / 128).
        indices: ``[B, Sq, topk]`` int32 / int64 key positions in ``[0, Skv)`` per query, shared by all heads
            (transformers' ``DeepseekV32Indexer`` output); ``-1`` = unused slot. Read as a set: duplicates count
            once; ``topk`` may exceed ``Skv``.
        attention_mask: optional bool ``[B, Sq, Skv]`` or ``[B, 1, Sq, Skv]`` (True = visible), ANDed in
            (transformers' causal + padding mask).
        causal: also apply the causal bound; causal_alignment: ``"top_left"`` or ``"bottom_right"`` (KV cache).
        sm_scale: logit scale, ``None`` = ``1 / sqrt(D)``. softcap: logit soft-cap.
        config: ``block_q`` / ``block_kv`` (multiples of 128, default 512: the table's block shape) and
            ``block_kv_compute``. interpret: ``"fast"`` / ``"tpu"`` for cpu runs.
        bucket: pad ``Sq`` / ``Skv`` to their shape buckets (as :func:`flash_attention`; the padding is masked
            in the tables) so that growing lengths reuse one lowered program per bucket.

    Returns:
        ``out`` ``[B, Hq, Sq, Dv]`` in q's dtype. A query that sees no key gives exactly 0 (zero gradients).

    Raises:
        ArgumentError: ranks / shapes that do not fit, ``Hq % Hkv``, an ``indices`` value outside
            ``[-1, Skv)`` (checked on cpu tensors outside ``torch.compile``: on a device the check would cost a
            host sync per call, so there such a value is ignored like ``-1``, FlashMLA's rule), bad flags /
            scales / alignment, ``config`` keys other than the three above or blocks not multiples of 128.
        DTypeError: q / k / v dtypes differ or are not float; ``indices`` not int32 / int64; a non-bool mask.
        DeviceError: an argument on another device than q.

    Sources: DeepSeek-V3.2-Exp (DSA); transformers ``DeepseekV32Attention.forward``; FlashMLA
    ``flash_mla_sparse_fwd`` (the ``-1`` convention).
    """
    from .masked import fa_forward_masked

    _check(q, k, v, indices, attention_mask, causal, causal_alignment, sm_scale, softcap, bucket)
    blocks, cfg = block_config(config, BLOCK, _WHERE)
    B, Hq, Sq, _ = (int(s) for s in q.shape)
    Hkv, Skv, Dv = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    if Sq == 0 or Skv == 0 or B == 0:
        return q.new_zeros(B, Hq, Sq, Dv)
    half = q.dtype == torch.float16
    if half:
        q, k, v = q.float(), k.float(), v.float()
    vis = index_visibility(indices, Skv, attention_mask, causal, causal_alignment)
    Sq_b, Skv_b = (bucket_len(Sq), bucket_len(Skv)) if bucket else (Sq, Skv)
    bq = Sq_b if Sq_b <= blocks["block_q"] else blocks["block_q"]
    bkv = Skv_b if Skv_b <= blocks["block_kv"] else blocks["block_kv"]
    # the tables cover whole blocks (the padding invisible); the kernels take the bucketed lengths (tails masked)
    Sq_p, Skv_p = -(-Sq_b // bq) * bq, -(-Skv_b // bkv) * bkv
    vis = pad_len(pad_len(vis, 2, Skv_p, False), 1, Sq_p, False)
    ft, bt, mb, mbt = block_tables(vis, bq, bkv, Hq)
    qf = pad_len(q, 2, Sq_b, False).reshape(1, B * Hq, Sq_b, q.shape[3])
    kf = pad_len(k, 2, Skv_b, False).reshape(1, B * Hkv, Skv_b, k.shape[3])
    vf = pad_len(v, 2, Skv_b, False).reshape(1, B * Hkv, Skv_b, Dv)
    out, _ = fa_forward_masked(ft, bt, qf, kf, vf, mb, mbt, None, None,
                               sm_scale=None if sm_scale is None else float(sm_scale),
                               softcap=None if softcap is None else float(softcap), config=cfg or None,
                               interpret=interpret)
    out = slice_len(out.reshape(B, Hq, Sq_b, Dv), 2, Sq, False)
    return out.to(torch.float16) if half else out
