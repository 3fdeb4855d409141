"""The public function :func:`flash_attention` (torch SDPA layout, differentiable) and the public op
``torch.ops.tpukernels.flash_attention`` (CompositeImplicitAutograd).
"""

from __future__ import annotations

import torch

from ...errors import ArgumentError, DeviceError, DTypeError
from .buckets import absent_id, bucket_len, pad_ids, pad_len, pad_tables, slice_len
from .forward import fa_forward
from .plan import NAMESPACE


def _to_int32_ids(ids, name: str):
    if ids is None:
        return None
    if ids.dtype in (torch.int64, torch.int16, torch.int8, torch.uint8):
        return ids.to(torch.int32)
    if ids.dtype != torch.int32:
        raise DTypeError(f"flash_attention: {name} must be an integer tensor (int32), got {ids.dtype}")
    return ids

def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    causal_alignment: str = "top_left",
    sm_scale: float | None = None,
    window: tuple[int | None, int | None] = (None, None),
    softcap: float | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    mask=None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    config: dict | None = None,
    interpret: str | None = None,
    bucket: bool = True,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_interleaved: bool = False,
):
    """Flash attention on TPU (and cpu via Pallas interpret mode), differentiable, torch SDPA layout.

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Skv, D]``; v: ``[B, Hkv, Skv, Dv]``; one dtype of bfloat16,
            float16 or float32. ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA: query head ``h`` uses kv head
            ``h // (Hq // Hkv)``; dK/dV are summed over each group). Any ``Sq, Skv >= 0`` (tails are masked);
            tested head dims 64, 80, 96, 128, 256.
        causal: mask keys after the query's diagonal (``window`` right bound 0).
        causal_alignment: where the diagonal sits when ``Sq != Skv``; also anchors ``window``.
            ``"top_left"`` (default, torch SDPA ``is_causal``): query ``i`` sees keys ``j <= i``.
            ``"bottom_right"`` (FlashAttention >= 2.1; KV-cache prefill/decode): query ``i`` sees keys
            ``j <= i + Skv - Sq``, so the last query sees every key.
        sm_scale: logit scale; ``None`` means ``1 / sqrt(D)`` (JAX's Pallas kernel defaults to 1.0).
        window: ``(left, right)`` sliding window, inclusive, ``None`` = unbounded: query ``i`` sees keys
            ``i + off - left <= j <= i + off + right`` (``off`` from ``causal_alignment``). ``(None, 0)`` is
            exactly ``causal=True``; ``(w, 0)`` is causal local attention over ``w + 1`` keys.
        softcap: logit soft-cap ``softcap * tanh(s / softcap)`` on the scaled logits, before masking (Gemma 2).
        q_segment_ids: ``[B, Sq]``, kv_segment_ids: ``[B, Skv]`` integer ids (packed sequences): a query sees
            only keys of its own segment. Both or neither; converted to int32.
        mask: a :mod:`tpukernels.library.attention.masks` mask (splash-attention API: ``CausalMask(shape,
            offset)``, ``LocalMask(shape, window_size, offset)``, ``ChunkedCausalMask``, ``FullMask``,
            ``NumpyMask(bool array or tensor [Sq, Skv])``, ``MultiHeadMask([... one per query head])``, combined
            with ``|`` and ``&``), shape ``(Sq, Skv)``. Runs the block-sparse kernels: the mask is compiled once
            per block shape into scalar-prefetched tables (cached by mask value); fully masked blocks are skipped
            without DMA, full blocks run without an element mask. ``causal`` / ``window`` / segment ids are
            intersected with it. ``config`` then takes ``block_q`` / ``block_kv`` (default 512, multiples of 128)
            and ``block_kv_compute``; query heads are not folded (``block_h = 1``). Under ``torch.compile``
            (fullgraph too) the tables are built at trace time; masks may be built inside the compiled code,
            except a ``NumpyMask`` (data: build it outside and close over it; a new one recompiles).
        sinks: ``[Hq]`` float attention-sink logits (gpt-oss): each joins its head's softmax denominator as a
            key with no value, ``out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink})``; differentiable (the
            sinks get a gradient). Applied as ``out * exp(-softplus(sink - lse))`` (f32) on the kernel's
            output, a form whose gradient stays exact at large ``lse``; the returned ``lse`` includes the sink.
        return_lse: also return ``lse`` ``[B, Hq, Sq]`` float32, the natural-log log-sum-exp of each row's
            visible logits (``-inf`` where nothing is visible); differentiable.
        config: tuning config for the forward kernel (keys ``block_q``, ``block_kv``, ``block_kv_compute``,
            ``block_h``); default: tuning DB, then a shape heuristic.
        interpret: ``"fast"`` / ``"tpu"`` for cpu runs (see :mod:`tpukernels.dsl.modes`).
        bucket: pad ``Sq`` and ``Skv`` to their shape bucket so that every length in a bucket runs one lowered
            program (default True; ``False``: one program per exact length). Bucket of ``n``: ``n`` if
            ``n <= 16``, else ``n`` rounded up to a multiple of ``max(8, 2**(bit_length(n - 1) - 3))`` (the
            ``rows=`` kernels' rule: four buckets per power of two, at most 25% padding; 1025..1280 -> 1280).
            Results are those of the unpadded call: the padding is hidden with runtime data (a segment id no
            real query has; bottom-right alignment pads at the front so the diagonal stays at
            ``j = i + Skv - Sq`` of the true lengths; with ``mask=`` the mask's block tables mask it), and
            outputs, ``lse`` and gradients of padded positions are sliced away. A length equal to its bucket
            runs unpadded (the dense kernels then run without the segment-id element mask, which padded calls
            pay on every block). See :mod:`tpukernels.library.attention.buckets`.
        rope_cos, rope_sin: rotary position embedding (RoPE) applied to q and k before attention, so q and k
            are passed **un-rotated**: ``[Skv, R]`` tables, one row per key position, HF's convention (as
            :func:`tpukernels.library.rope.apply_rope`; any HF scaling variant's cos/sin work unchanged); query
            ``i`` takes row ``i`` (top-left) or ``i + Skv - Sq`` (bottom-right alignment). ``R`` (even,
            ``2 <= R <= D``) lanes rotate, the rest pass through (partial rotary). dtype: q's or float32. k goes
            through the RoPE kernel; q is rotated inside the attention kernel as it is loaded
            (:mod:`tpukernels.library.attention.rope_fused`: in the libtpu static model at S=4096, causal GQA
            32/8, 4-5% faster than rotating q by the separate kernel on v5e / v6e / tpu7x; against that kernel's
            bare HBM floor, a tie on v6e / tpu7x and 2.7% faster on v5e). Differentiable in q, k, v and the
            tables. Not with ``mask=`` (rotate first with ``apply_rope``).
        rope_interleaved: False: llama / GPT-NeoX rotate-half; True: GPT-J pairs ``(2i, 2i + 1)``.

    Returns:
        ``out`` ``[B, Hq, Sq, Dv]`` in q's dtype, or ``(out, lse)``. A query row that sees no key (segments,
        window, mask, causal with ``Sq > Skv`` bottom-right, ``Skv = 0``) gives exactly 0 and zero gradients
        (as JAX's splash attention; ``lse`` is ``-inf``, or the sink with ``sinks``).

    Numerics: ``Q K^T`` and ``P V`` accumulate in float32 on the MXU (bf16 inputs are multiplied as bf16;
    float32 inputs at ``Precision.HIGHEST``); softmax statistics and the output accumulator are float32.
    float16 inputs are computed in float32 (exact upcast; Mosaic takes no float16 kernel arguments) and the
    output is cast back to float16.

    Raises:
        ArgumentError: ranks, batch / head / length / head-dim mismatches, ``Hq % Hkv != 0``, only one of
            the segment ids, bad window / softcap / sm_scale / causal_alignment values, a non-bool ``bucket``.
            A ``mask`` whose shape is not ``(Sq, Skv)`` or whose head count is not ``Hq``, a raw array as
            ``mask`` (wrap it: ``NumpyMask``), ``sinks`` not of shape ``[Hq]``.
            ``rope_cos`` / ``rope_sin``: only one given, not ``[Skv, R]``, shapes differ, ``R`` odd or outside
            ``[2, D]``, ``Sq > Skv`` (query positions beyond the table), combined with ``mask``.
        DTypeError: q, k, v dtypes differ or are not bf16 / fp16 / f32; non-integer segment ids; a non-bool
            mask array; non-float sinks; ``rope_cos`` / ``rope_sin`` neither q's dtype nor float32, or differing.
        DeviceError: ``sinks``, ``rope_cos`` / ``rope_sin`` on another device than q.

    Sources: Dao, "FlashAttention-2" (arXiv:2307.08691); JAX ``pallas/ops/tpu/flash_attention.py`` and
    ``splash_attention`` (block skipping, compute sub-blocks, key-major dK/dV); FlashAttention 2.1 release
    notes (bottom-right causal alignment).
    """
    for name, val in (("causal", causal), ("return_lse", return_lse), ("bucket", bucket)):
        if not isinstance(val, bool):  # bool("false") is True: never coerce a flag
            raise ArgumentError(f"flash_attention: {name} must be a bool, got {val!r}")
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ArgumentError(f"flash_attention: window must be a (left, right) pair, got {window!r}")
    for name, val in (("sm_scale", sm_scale), ("softcap", softcap)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, (int, float))):
            raise ArgumentError(f"flash_attention: {name} must be a float or None, got {val!r}")
    for name, val in (("window[0]", window[0]), ("window[1]", window[1])):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int)):
            raise ArgumentError(f"flash_attention: {name} must be an int >= 0 or None, got {val!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ArgumentError(f"flash_attention: {name} must be a torch.Tensor, got {type(x).__name__}")
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1:
        raise DTypeError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise ArgumentError(f"flash_attention: sinks must be a torch.Tensor [Hq], got {type(sinks).__name__}")
        if not sinks.dtype.is_floating_point:
            raise DTypeError(f"flash_attention: sinks must be a float tensor (logits), got {sinks.dtype}")
        if q.dim() == 4 and tuple(sinks.shape) != (q.shape[1],):
            raise ArgumentError(f"flash_attention: sinks must have shape [Hq] = ({q.shape[1]},) (one logit per query "
                                f"head), got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise DeviceError(f"flash_attention: sinks is on {sinks.device} but q is on {q.device}")
    rope = None
    if rope_cos is not None or rope_sin is not None:
        rope = _check_rope(q, k, rope_cos, rope_sin, rope_interleaved, mask)
    half = q.dtype == torch.float16
    if half:
        q, k, v = q.float(), k.float(), v.float()
    qs = _to_int32_ids(q_segment_ids, "q_segment_ids")
    ks = _to_int32_ids(kv_segment_ids, "kv_segment_ids")
    if (qs is None) != (ks is None):
        raise ArgumentError("flash_attention: q_segment_ids and kv_segment_ids must be given together (packed sequences)")
    if qs is not None:
        for name, ids, x in (("q_segment_ids", qs, q), ("kv_segment_ids", ks, k)):
            if ids.dim() != 2 or q.dim() != 4 or tuple(ids.shape) != (x.shape[0], x.shape[2]):
                want = (x.shape[0], x.shape[2]) if x.dim() == 4 else "[B, S]"
                raise ArgumentError(f"flash_attention: {name} must have shape [B, S] = {want}, got {tuple(ids.shape)}")
        qs, ks = qs.unsqueeze(1), ks.unsqueeze(1)
    if rope is not None:
        out, lse = _rope_forward(q, k, v, qs, ks, rope_cos, rope_sin, rope, rope_interleaved, causal=causal,
                                 causal_alignment=causal_alignment, sm_scale=sm_scale, window=window,
                                 softcap=softcap, config=config, interpret=interpret, bucket=bucket)
    elif mask is not None:
        out, lse = _masked_forward(q, k, v, qs, ks, mask, causal=causal, causal_alignment=causal_alignment,
                                   sm_scale=sm_scale, window=window, softcap=softcap, config=config,
                                   interpret=interpret, bucket=bucket)
    else:
        out, lse = _dense_forward(q, k, v, qs, ks, causal=causal, causal_alignment=causal_alignment,
                                  sm_scale=sm_scale, window=window, softcap=softcap, config=config,
                                  interpret=interpret, bucket=bucket)
    if sinks is not None:
        out, lse = _apply_sinks(out, lse, sinks)
    if half:
        out = out.to(torch.float16)
    return (out, lse.squeeze(2)) if return_lse else out

def _flash_attention_op(q, k, v, *, causal=False, causal_alignment="top_left", sm_scale=None, window_left=None,
                        window_right=None, softcap=None, q_segment_ids=None, kv_segment_ids=None, bucket=True):
    return flash_attention(q, k, v, causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale,
                           window=(window_left, window_right), softcap=softcap, q_segment_ids=q_segment_ids,
                           kv_segment_ids=kv_segment_ids, bucket=bucket)


# The public op means the public function (out only); the kernel op returning (out, lse) is flash_attention_fwd.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("flash_attention(Tensor q, Tensor k, Tensor v, *, bool causal=False, str causal_alignment=\"top_left\", "
            "float? sm_scale=None, int? window_left=None, int? window_right=None, float? softcap=None, "
            "Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None, bool bucket=True) -> Tensor")
_LIB.impl("flash_attention", _flash_attention_op, "CompositeImplicitAutograd")



#: Default block shape of the block-sparse masked kernels (smaller blocks find more empty / full blocks).
MASK_BLOCK = 512


def _bucketable(*xs) -> bool:
    """Padding applies to well-formed calls (rank 4, kernel dtypes); others go unpadded to the kernels, whose
    checks raise the typed errors."""
    q, k, v, qs, ks = xs
    return (all(x.dim() == 4 and x.dtype in (torch.bfloat16, torch.float32) for x in (q, k, v))
            and all(x is None or (x.dim() == 3 and x.dtype == torch.int32) for x in (qs, ks)))


def _check_lengths(k, v):
    """The one check padding would hide (k and v are padded to one length); every other rule is checked by the
    kernels on the padded call with the same outcome."""
    if k.shape[2] != v.shape[2]:
        raise ArgumentError(f"flash_attention: k and v must have the same length, got {k.shape[2]} and {v.shape[2]}")


def _dense_forward(q, k, v, qs, ks, *, causal, causal_alignment, sm_scale, window, softcap, config, interpret,
                   bucket):
    """The dense kernels; with ``bucket``, through :func:`_dense_bucketed` (as the op
    ``tpukernels::flash_attention_bucketed`` when no ``config`` / ``interpret`` is given, so that
    ``torch.compile`` traces the padding with symbolic lengths: one graph for every length)."""
    kw = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=None if sm_scale is None else float(sm_scale),
              window_left=window[0], window_right=window[1], softcap=None if softcap is None else float(softcap))
    if bucket and _bucketable(q, k, v, qs, ks):
        _check_lengths(k, v)
        if config is None and interpret is None:
            return torch.ops.tpukernels.flash_attention_bucketed(q, k, v, qs, ks, **kw)
        return _dense_bucketed(q, k, v, qs, ks, **kw, config=config, interpret=interpret)
    return fa_forward(q, k, v, qs, ks, **kw, config=config, interpret=interpret)


def _bucket_ids(q, k, qs, ks, Sq, Skv):
    """``(q_segment_ids, kv_segment_ids, fill)`` for a bucketed call: all-zero ids (padding gets 1) when the call
    has none, else the caller's with an id none of them uses as the padding's (:func:`absent_id`)."""
    if qs is None:
        B = q.shape[0]
        return (torch.zeros(B, 1, Sq, dtype=torch.int32, device=q.device),
                torch.zeros(B, 1, Skv, dtype=torch.int32, device=k.device), 1)
    return qs, ks, absent_id(qs)


def _dense_bucketed(q, k, v, qs, ks, *, causal, causal_alignment, sm_scale, window_left, window_right, softcap,
                    config=None, interpret=None):
    """``(out, lse)`` of the dense kernels on ``Sq`` / ``Skv`` padded to their buckets, the padding hidden by
    segment ids (see :mod:`.buckets`); lengths equal to their buckets run unpadded."""
    kw = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale, window_left=window_left,
              window_right=window_right, softcap=softcap, config=config, interpret=interpret)
    Sq, Skv = q.shape[2], k.shape[2]
    Sq_b, Skv_b = bucket_len(Sq), bucket_len(Skv)
    # the unpadded shortcut only for concrete lengths: on SymInts (torch.compile(dynamic=True)) the test would
    # guard the graph on "length == bucket" and trace a second one; padding by 0 gives the same values
    symbolic = isinstance(Sq, torch.SymInt) or isinstance(Skv, torch.SymInt)
    if not symbolic and Sq_b == Sq and Skv_b == Skv:
        return fa_forward(q, k, v, qs, ks, **kw)
    front = causal_alignment == "bottom_right"  # keeps j <= i + Skv - Sq exact (module docstring of .buckets)
    qs, ks, fill = _bucket_ids(q, k, qs, ks, Sq, Skv)
    out, lse = fa_forward(pad_len(q, 2, Sq_b, front), pad_len(k, 2, Skv_b, front), pad_len(v, 2, Skv_b, front),
                          pad_ids(qs, Sq_b, front, fill), pad_ids(ks, Skv_b, front, fill), **kw)
    out, lse = slice_len(out, 2, Sq, front), slice_len(lse, 3, Sq, front)
    if symbolic:  # a slice's strides say whether Sq == its bucket; whoever reads them (contiguity, the strides of
        # an elementwise op's output) would guard on it and a length equal to its bucket would trace a second graph
        out, lse = out.clone(memory_format=torch.contiguous_format), lse.clone(memory_format=torch.contiguous_format)
    return out, lse

# The bucketed dense path as an op: torch.compile traces its padding with symbolic lengths (dynamo sees one call).
_LIB.define("flash_attention_bucketed(Tensor q, Tensor k, Tensor v, Tensor? q_segment_ids, Tensor? kv_segment_ids, *, "
            "bool causal, str causal_alignment, float? sm_scale, int? window_left, int? window_right, "
            "float? softcap) -> (Tensor, Tensor)")
_LIB.impl("flash_attention_bucketed", _dense_bucketed, "CompositeImplicitAutograd")


def _masked_forward(q, k, v, qs, ks, mask, *, causal, causal_alignment, sm_scale, window, softcap, config, interpret,
                    bucket):
    """Run the block-sparse masked kernel: ``causal`` / ``window`` are folded into ``mask`` (intersection);
    with ``bucket``, on ``Sq`` / ``Skv`` padded at the end to their buckets (the tables mask the padding)."""
    from .masked import check_mask, fa_forward_masked
    from .masks import block_config, mask_spec

    if q.dim() != 4 or k.dim() != 4:
        raise ArgumentError(f"flash_attention: q and k must have rank 4 [B, H, S, D], got {tuple(q.shape)}, "
                            f"{tuple(k.shape)}")
    Hq, Sq, Skv = int(q.shape[1]), int(q.shape[2]), int(k.shape[2])
    check_mask(mask, Hq, Sq, Skv)
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ArgumentError(f"flash_attention: causal_alignment must be 'top_left' or 'bottom_right', got "
                            f"{causal_alignment!r}")
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    local = None  # (left, right, offset) of a LocalMask intersected with ``mask`` by _table_tensors
    if left is not None or right is not None:
        for name, w in (("window[0]", left), ("window[1]", right)):
            if w is not None and w < 0:
                raise ArgumentError(f"flash_attention: {name} must be an int >= 0 or None, got {w!r}")
        local = (left, right, Skv - Sq if causal_alignment == "bottom_right" else 0)
    blocks, cfg = block_config(config, MASK_BLOCK, "flash_attention", " to masked attention")
    Sq_b, Skv_b = (bucket_len(Sq), bucket_len(Skv)) if bucket else (Sq, Skv)
    bq = Sq_b if 0 < Sq_b <= blocks["block_q"] else blocks["block_q"]
    bkv = Skv_b if 0 < Skv_b <= blocks["block_kv"] else blocks["block_kv"]
    padded = (Sq_b, Skv_b) != (Sq, Skv) and _bucketable(q, k, v, qs, ks)
    if padded:
        _check_lengths(k, v)
        q, k, v = pad_len(q, 2, Sq_b, False), pad_len(k, 2, Skv_b, False), pad_len(v, 2, Skv_b, False)
        if qs is not None:  # any id: the tables mask the padding
            qs, ks = pad_ids(qs, Sq_b, False, 0), pad_ids(ks, Skv_b, False, 0)
    nq, nk = -(-Sq_b // max(bq, 1)), -(-Skv_b // max(bkv, 1))
    spec, leaves = mask_spec(mask)  # plain constants: a mask built inside torch.compiled code reaches the tables
    ft, bt, mb, mbt = _table_tensors(spec, max(bq, 1), max(bkv, 1), nq if bucket else None, nk if bucket else None,
                                     local, *leaves)
    out, lse = fa_forward_masked(ft, bt, q, k, v, mb, mbt, qs, ks,
                                 sm_scale=None if sm_scale is None else float(sm_scale),
                                 softcap=None if softcap is None else float(softcap), config=cfg or None,
                                 interpret=interpret)
    if padded:
        out, lse = slice_len(out, 2, Sq, False), slice_len(lse, 3, Sq, False)
    return out, lse


def _check_rope(q, k, cos, sin, interleaved, mask) -> int:
    """Typed checks of ``rope_cos`` / ``rope_sin`` / ``rope_interleaved``; returns the rotary dim ``R``."""
    if cos is None or sin is None:
        raise ArgumentError("flash_attention: rope_cos and rope_sin must be given together (RoPE tables)")
    if not isinstance(interleaved, bool):
        raise ArgumentError(f"flash_attention: rope_interleaved must be a bool, got {interleaved!r}")
    if mask is not None:
        raise ArgumentError("flash_attention: rope_cos / rope_sin are not supported with mask= (the block-sparse "
                            "kernels); rotate q and k first with tpukernels.library.rope.apply_rope")
    for name, t in (("rope_cos", cos), ("rope_sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"flash_attention: {name} must be a torch.Tensor [Skv, R], got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4:
        raise ArgumentError(f"flash_attention: q and k must have rank 4 [B, H, S, D], got {tuple(q.shape)}, "
                            f"{tuple(k.shape)}")
    Sq, Skv, D = int(q.shape[2]), int(k.shape[2]), int(q.shape[3])
    for name, t in (("rope_cos", cos), ("rope_sin", sin)):
        if t.dim() != 2 or int(t.shape[0]) != Skv:
            raise ArgumentError(f"flash_attention: {name} must be [Skv, rotary_dim] = [{Skv}, R] (one row per key "
                                f"position), got {tuple(t.shape)}")
        if t.dtype not in (q.dtype, torch.float32):
            raise DTypeError(f"flash_attention: {name} dtype {t.dtype} must be q's dtype ({q.dtype}) or float32")
        if t.device != q.device:
            raise DeviceError(f"flash_attention: {name} is on {t.device} but q is on {q.device}")
    if tuple(cos.shape) != tuple(sin.shape) or cos.dtype != sin.dtype:
        raise ArgumentError(f"flash_attention: rope_cos {tuple(cos.shape)} {cos.dtype} and rope_sin "
                            f"{tuple(sin.shape)} {sin.dtype} must have the same shape and dtype")
    r = int(cos.shape[1])
    if r % 2 or not 2 <= r <= D:
        raise ArgumentError(f"flash_attention: rotary_dim R = rope_cos.shape[-1] = {r} must be even and 2 <= R <= "
                            f"D = {D} (R < D: partial rotary)")
    if Sq > Skv:
        raise ArgumentError(f"flash_attention: with rope_cos / rope_sin, Sq = {Sq} > Skv = {Skv}: query positions "
                            f"beyond the [Skv, R] table")
    return r


def _rope_forward(q, k, v, qs, ks, cos, sin, r: int, interleaved: bool, *, causal, causal_alignment, sm_scale,
                  window, softcap, config, interpret, bucket):
    """k through the RoPE kernel (:func:`tpukernels.library.rope.apply_rope`), q rotated inside the forward
    kernel (:data:`.rope_fused.fa_forward_rope`) with the table rows of the query positions; padded to the
    shape buckets as :func:`_dense_bucketed` (the tables padded with the queries)."""
    from ..rope import apply_rope
    from .rope_fused import fa_forward_rope

    Sq, Skv, D = q.shape[2], k.shape[2], q.shape[3]
    if cos.dtype == torch.float16 or cos.dtype != q.dtype:  # float16 runs in float32 (see above)
        cos, sin = cos.float(), sin.float()
    k = apply_rope(k, cos, sin, interleaved=interleaved)
    front = causal_alignment == "bottom_right"
    off = Skv - Sq if front else 0
    cq, sq = cos[off:off + Sq], sin[off:off + Sq]
    if r < D:  # lanes [R, D) pass through; their table values are unused
        cq, sq = (torch.nn.functional.pad(t, (0, D - r)) for t in (cq, sq))
    kw = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=None if sm_scale is None else float(sm_scale),
              window_left=window[0], window_right=window[1], softcap=None if softcap is None else float(softcap),
              rotary_dim=r, interleaved=interleaved, config=config, interpret=interpret)
    Sq_b, Skv_b = (bucket_len(Sq), bucket_len(Skv)) if bucket else (Sq, Skv)
    symbolic = isinstance(Sq, torch.SymInt) or isinstance(Skv, torch.SymInt)
    if not (bucket and _bucketable(q, k, v, qs, ks)) or (not symbolic and (Sq_b, Skv_b) == (Sq, Skv)):
        out, lse, _ = fa_forward_rope(q, k, v, cq.contiguous(), sq.contiguous(), qs, ks, **kw)
        return out, lse
    _check_lengths(k, v)
    qs, ks, fill = _bucket_ids(q, k, qs, ks, Sq, Skv)
    out, lse, _ = fa_forward_rope(pad_len(q, 2, Sq_b, front), pad_len(k, 2, Skv_b, front), pad_len(v, 2, Skv_b, front),
                                  pad_len(cq, 0, Sq_b, front), pad_len(sq, 0, Sq_b, front),
                                  pad_ids(qs, Sq_b, front, fill), pad_ids(ks, Skv_b, front, fill), **kw)
    return slice_len(out, 2, Sq, front), slice_len(lse, 3, Sq, front)


def _apply_sinks(out, lse, sinks):
    """Attention sinks (gpt-oss): a per-head logit ``sink[h]`` joins every row's softmax denominator and
    contributes no value. With ``l = sum_j exp(s_ij)`` the kernel's row sum, ``out' = out * l / (l + e^sink)
    = out * exp(-softplus(sink - lse))`` and ``lse' = logaddexp(lse, sink)`` (f32). Differentiable: autograd
    carries d lse into the kernels' backward and gives the sinks' gradient. Rows that see no key: out 0,
    lse = sink.

    The scale is written as ``exp(-softplus(sink - lse))``, not ``sigmoid(lse - sink)``: both have the same
    value, but sigmoid's backward is ``y (1 - y)``, and where ``lse >> sink`` (lse ~ 15, a sink near 0) ``y``
    is within a few float32 ulps of 1, so ``1 - y`` (the sink's whole probability, ~1e-7) is resolved in steps
    of 6e-8 and d_sinks came out tens of percent off. softplus's backward is ``sigmoid(x)`` of its own input,
    computed from ``exp(x)``: exact at any lse."""
    s = sinks.float().view(1, -1, 1, 1)  # [1, Hq, 1, 1]
    lt = lse.transpose(2, 3)  # lse [B, Hq, 1, Sq] -> [B, Hq, Sq, 1]
    # a row that sees nothing (lse -inf) has out 0: scale 0 there, also for a -inf sink (-inf - -inf is NaN,
    # and a NaN left in where's other branch would still poison the backward)
    x = torch.where(torch.isneginf(lt), torch.inf, s - lt)
    scale = torch.exp(-torch.nn.functional.softplus(x))
    none = torch.isneginf(lse) & torch.isneginf(s)  # lse' = -inf; logaddexp's backward would give NaN there
    lse_s = torch.where(none, -torch.inf, torch.logaddexp(lse.masked_fill(none, 0.0), s.masked_fill(none, 0.0)))
    return (out.float() * scale).to(out.dtype), lse_s


def _table_tensors(spec: tuple, bq: int, bkv: int, nq_pad: int | None = None, nk_pad: int | None = None,
                   local: tuple | None = None, *leaves):
    """The block-sparse tables of the mask ``(spec, leaves)`` (:func:`.masks.mask_spec`) as torch tensors
    (built once per mask value and block shape, cached); under ``torch.compile`` evaluated at trace time and
    kept as constants (host-side numpy work). With ``nq_pad`` / ``nk_pad`` (bucketing): padded to those block
    counts, list lengths and partial-block count bucketed (:func:`.buckets.pad_tables`; cached per padding).
    With ``local = (left, right, offset)`` (``causal`` / ``window``): the tables of ``mask & LocalMask((Sq,
    Skv), (left, right), offset)``. Masks travel as a spec of constants and are (re)built here, not by the
    traced caller: dynamo cannot hand a mask object created in traced code to this constant-result function
    (it passes an instance without its attributes: ``'LogicalAnd' object has no attribute 'left'``)."""
    from .masked import tensors
    from .masks import LocalMask, mask_from_spec, mask_tables

    mask = mask_from_spec(spec, leaves)
    if local is not None:
        mask = mask & LocalMask(tuple(mask.shape[-2:]), local[:2], offset=local[2])
    tables = mask_tables(mask, bq, bkv)
    if nq_pad is None:
        return tensors(tables)
    cache = tables.__dict__.setdefault("_padded", {})
    key = (nq_pad, nk_pad)
    if key not in cache:
        cache[key] = tuple(torch.from_numpy(a) for a in pad_tables(tables, nq_pad, nk_pad))
    return cache[key]


# What ``torch.compiler.assume_constant_result`` does (torch/_dynamo/decorators.py sets this one attribute), done
# without calling it: the decorator imports torch._dynamo, which loads FSDP and DTensor at ``import tpukernels``
# (DTensor's sharding rules register lazily, tests/test_distributed.py). tests/test_attention_masks.py compiles a
# masked call with fullgraph=True, so a torch that renames the marker fails there.
_table_tensors._dynamo_marked_constant = True
