"""Dense float64-capable torch reference with the semantics of :func:`flash_attention` (tests, benchmarks).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def attention_reference(q, k, v, *, causal=False, causal_alignment="top_left", sm_scale=None, window=(None, None),
                        softcap=None, q_segment_ids=None, kv_segment_ids=None, mask=None, sinks=None,
                        dtype=torch.float32):
    """Plain torch attention with the same semantics as :func:`flash_attention` (dense masks, O(S^2) memory).

    ``mask``: a bool tensor broadcastable to ``[B, Hq, Sq, Skv]`` (True = visible) or a :mod:`.masks` mask;
    ``sinks``: ``[Hq]`` sink logits joining each row's softmax denominator (gpt-oss).
    Computes in ``dtype`` (float32 default; float64 for tests). Returns ``(out, lse)`` with ``lse`` ``[B, Hq, Sq]``.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hkv, 1)
    v = v.repeat_interleave(Hq // Hkv, 1)
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Skv)[None, :]
    off = Skv - Sq if causal_alignment == "bottom_right" else 0
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    vis = torch.ones(Sq, Skv, dtype=torch.bool)
    if right is not None:
        vis = vis & (j <= i + off + right)
    if left is not None:
        vis = vis & (j >= i + off - left)
    vis = vis.expand(B, Hq, Sq, Skv)
    if q_segment_ids is not None:
        vis = vis & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            from .masks import head_masks

            mask = torch.stack([torch.from_numpy(np.array(m[0:Sq, 0:Skv])) for m in head_masks(mask)])
        vis = vis & mask
    s = s.masked_fill(~vis, -math.inf)
    if sinks is not None:  # an extra logit per row with no value
        sk = sinks.to(dtype).view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)
        lse = torch.logsumexp(torch.cat([s, sk], -1), -1)
    else:
        lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None]).masked_fill(~vis, 0)
    return p @ v, lse
