"""Flash attention (forward + backward) for TPU: causal / sliding-window / segment masks, GQA, soft-cap.

Public API: :func:`flash_attention` (torch tensors, torch SDPA layout) and the op of the same meaning,
``torch.ops.tpukernels.flash_attention(q, k, v, *, causal, causal_alignment, sm_scale, window_left,
window_right, softcap, q_segment_ids, kv_segment_ids, bucket) -> out`` (CompositeImplicitAutograd: autograd and
``torch.compile`` see the kernel ops). The kernel-level ops, named as such:

* ``torch.ops.tpukernels.flash_attention_fwd`` (kernel :data:`fa_forward`) -> ``(out, lse)``;
* ``torch.ops.tpukernels.flash_attention_bwd_dq`` / ``flash_attention_bwd_dkv`` (the split backward kernels) and
  ``flash_attention_bwd_fused`` (kernel :data:`fa_backward_fused`: dQ, dK, dV in one pass), wired into autograd
  with :meth:`TpuKernel.def_backward`; which backward runs is chosen per chip (:mod:`.backward_fused`).

What it computes, per batch ``b`` and query head ``h`` (kv head ``h // (Hq // Hkv)``)::

    s[i, j]   = sm_scale * q[i] . k[j]                         (f32 accumulation on the MXU)
    s[i, j]   = softcap * tanh(s[i, j] / softcap)              (only if softcap is given; before masking)
    visible   = j < Skv  and  i + off - left <= j <= i + off + right  and  qseg[i] == kvseg[j]
    out[i]    = sum_j softmax_j(s[i, :] over visible j) * v[j]
    lse[i]    = log sum_{visible j} exp(s[i, j])               (natural log, f32; -inf if nothing is visible)

with ``off = 0`` for top-left alignment and ``off = Skv - Sq`` for bottom-right alignment. ``causal=True``
is the window ``right = 0``; ``left``/``right`` of ``None`` are unbounded. A query row that sees no key
outputs exactly 0, has ``lse = -inf`` and gets zero gradients (never NaN, never mean(V)).

Algorithm: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) online softmax over key blocks, statistics
(running max ``m``, running sum ``l``) and the output accumulator in f32 VMEM scratch. Ideas taken from
JAX's Pallas TPU kernels (``jax/experimental/pallas/ops/tpu/flash_attention.py`` and
``splash_attention/``): block skipping with clamped index maps (a skipped step maps to the block already
resident, so no DMA is issued), a compute sub-block ``block_kv_compute`` inside the DMA block, and a
transposed (keys-in-sublanes) dK/dV kernel that needs no in-kernel transposes of big tiles. Differences:
``sm_scale`` defaults to ``1/sqrt(D)`` (JAX: 1.0); empty rows give 0 (JAX: mean of V); ``lse`` is one f32
per row (JAX keeps 128 lanes per row); GQA is native (no K/V repeat) with dK/dV summed over each group
inside the kernel; the kv grid axis only spans the blocks a window can reach.

Layouts (op level; :func:`flash_attention` converts):

* ``q``: ``[B, Hq, Sq, D]``; ``k``: ``[B, Hkv, Skv, D]``; ``v``: ``[B, Hkv, Skv, Dv]``; bf16 or f32, all the
  same dtype (float16: see ``_FLOAT_DTYPES``; :func:`flash_attention` accepts it). ``Hq`` a multiple of ``Hkv``.
* ``q_segment_ids``: ``[B, 1, Sq]`` int32, ``kv_segment_ids``: ``[B, 1, Skv]`` int32 (both or neither).
* outputs: ``out`` ``[B, Hq, Sq, Dv]`` (q's dtype), ``lse`` ``[B, Hq, 1, Sq]`` f32 (per-position vectors
  are stored as rows, the layout the kernels read without transposes).

Performance (libtpu 0.0.52 static estimates, a model, not measurements; ``benchmarks/attention.py``):
B=1, Hq=32, Hkv=8, D=128, causal bf16, at the shipped defaults vs JAX's Pallas flash attention at its best
swept blocks (K/V repeated to 32 heads): forward 0.81x / 0.77x (v6e, S=4096 / 8192) and 0.78x / 0.78x
(v5e); backward (dQ + dK/dV + rowsum) 0.73x / 0.71x (v6e). Boundary blocks (the causal diagonal, window
edges) are split into 512 x 512 sub-blocks, each skipped, run without mask, or masked on its own. The fused
backward (:data:`fa_backward_fused`, 5 matmul passes over the scores instead of the split kernels' 7) models
0.73-0.76x of the split one on v5e / v6e / tpu7x (B=1, 2 heads, S=8192, D=128; ``benchmarks/attention_fused_bwd.py``)
and is their default there.

Decode (``Sq <= 16`` with ``Hq > Hkv``): the query heads of one kv group are processed together, so one
grid step multiplies ``(Hq/Hkv) * Sq`` query rows against each K/V block (the K/V tile is read once

Package layout: :mod:`.plan` (argument checks, the static plan of a call, tunables, heuristics, VMEM budget),
:mod:`.tiles` (in-kernel helpers and element masks), :mod:`.forward` (:data:`fa_forward`), :mod:`.backward`
(:data:`fa_backward_dq`, :data:`fa_backward_dkv`), :mod:`.backward_fused` (:data:`fa_backward_fused`, the choice
of backward and the autograd wiring), :mod:`.masks` (splash-attention mask
objects and their block-sparse tables), :mod:`.masked` (the block-sparse masked kernels, same bodies),
:mod:`.api` (:func:`flash_attention`, sinks, the public op), :mod:`.reference` (:func:`attention_reference`),
:mod:`.rope_fused` (:data:`fa_forward_rope`: RoPE fused into the forward's q load), :mod:`.topk_sparse`
(:func:`topk_sparse_attention`: DeepSeek sparse attention's top-k ``indices`` on the block-sparse kernels).
"""

from .api import flash_attention  # noqa: E402
from .backward import fa_backward_dkv, fa_backward_dq  # noqa: E402
from .backward_fused import fa_backward_fused  # noqa: E402
from .forward import fa_forward  # noqa: E402
from .masked import fa_backward_dkv_masked, fa_backward_dq_masked, fa_forward_masked  # noqa: E402
from .masks import (CausalMask, ChunkedCausalMask, FullMask, LocalMask, LogicalAnd, LogicalOr, Mask,  # noqa: E402
                    MultiHeadMask, NumpyMask, mask_tables)
from .plan import CAUSAL, ALIGNMENTS, DECODE_FOLD_MAX_SQ, NAMESPACE, make_plan, Plan  # noqa: E402,F401
from .reference import attention_reference  # noqa: E402
from .rope_fused import fa_forward_rope  # noqa: E402
from .topk_sparse import topk_sparse_attention  # noqa: E402

#: The shapes the shipped defaults are tuned for (``benchmarks/attention.py``, ``tpukernels autotune
#: --library``): Llama-3-8B-like attention (32 query heads, 8 kv heads, D=128), causal, bf16.
STANDARD_CASES = [
    (fa_forward, (f"1x32x{S}x128:bf16", f"1x8x{S}x128:bf16", f"1x8x{S}x128:bf16"), dict(CAUSAL)) for S in (4096, 8192)
] + [
    (kernel, (f"1x32x{S}x128:bf16", f"1x8x{S}x128:bf16", f"1x8x{S}x128:bf16", f"1x32x{S}x128:bf16",
              f"1x32x1x{S}:f32", f"1x32x1x{S}:f32"), dict(CAUSAL))
    for kernel in (fa_backward_dq, fa_backward_dkv) for S in (4096, 8192)
]

__all__ = ["flash_attention", "attention_reference", "topk_sparse_attention", "fa_forward", "fa_backward_dq",
           "fa_backward_dkv", "fa_backward_fused", "fa_forward_rope", "fa_forward_masked", "fa_backward_dq_masked",
           "fa_backward_dkv_masked", "Mask", "CausalMask", "LocalMask",
           "ChunkedCausalMask", "FullMask", "NumpyMask", "MultiHeadMask", "LogicalOr", "LogicalAnd", "mask_tables",
           "STANDARD_CASES", "DECODE_FOLD_MAX_SQ"]
