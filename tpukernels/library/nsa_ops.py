"""Native Sparse Attention (NSA, Yuan et al. 2025, arXiv:2502.11089), forward + backward, for TPU.

Three causal attention branches over the same queries, mixed by per-token gates. The semantics, argument names
and layout are those of tokamax's torch_tpu NSA op (``tokamax/experimental/torch_tpu/ops/nsa``:
``nsa(q, k, v, g_cmp=None, g_slc=None, g_swa=None, chunk_size=256, topk=4, window=128, cmp_block_size=64,
scale=None)``, ``[B, T, H, D]``; JAX reference ``tokamax/_src/ops/experimental/nsa/reference.py``), so it can be
swapped in. Per batch ``b`` and query head ``h`` (kv head ``h // (Hq // Hkv)``), ``scale`` default ``D ** -0.5``::

    cmp: kc[c], vc[c] = means of k, v over compression block c (cmp_block_size tokens)
         o_cmp[t] = softmax over visible c of (scale q[t] . kc[c]) @ vc
         visible: c * cmp_block_size < t (tokamax; cmp_causal=True: (c + 1) * cmp_block_size - 1 <= t)
    slc: o_slc = MoBA (:mod:`tpukernels.library.moba_ops`) with chunk_size, topk: each query chunk's own
         chunk causally plus the topk earlier chunks of highest scale * mean(q chunk) . mean(k chunk)
    swa: o_swa[t] = causal attention over keys t - window <= s <= t (window + 1 keys)
    out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa           (gates default 1/3 each, as tokamax)

Public API (torch tensors): :func:`nsa_attention` -> ``[B, T, Hq, Dv]``, differentiable in q, k, v and the
gates; :func:`nsa_attention_reference`, the dense float64 definition.

Kernels: the branches run on this library's attention kernels (written with the DSL), their gradients by the
kernels' own backward: *cmp* is the block-sparse masked flash attention (:mod:`tpukernels.library.attention`,
``flash_attention(mask=NumpyMask)``: the ``[T, ceil(T / cmp_block_size)]`` visibility mask, built once per
``(T, cmp_block_size, cmp_causal)`` and cached, compiled into block tables) over the mean-pooled keys / values;
*slc* is MoBA's block-sparse call (``flash_attention_masked_*`` kernels over routing tables built on device);
*swa* is the dense flash attention kernel with ``window=(window, 0)`` (key blocks outside the window skipped).
Composed in torch, and so differentiated by autograd: the mean pooling (its gradient spreads each compressed
key's / value's gradient evenly over its block), the routing (not differentiated, as tokamax's
``stop_gradient``), the gate mix (in float32, rounded once to q's dtype) and the ``[B, T, H, D]`` <->
``[B, H, T, D]`` transposes (a copy each way for the cmp / swa branches). No fused three-branch kernel: each
branch reads q once more.

Differences from tokamax: a query that sees no compressed block (``t = 0``; ``t < cmp_block_size`` with
``cmp_causal``) gets ``o_cmp = 0`` (tokamax's ``-1e9`` fill gives it the mean of *all* compressed values,
including the future: a leak). tokamax's rule ``c * cmp_block_size < t`` lets a query see the mean of a block
that ends up to ``cmp_block_size - 1`` tokens after it; ``cmp_causal=True`` takes the NSA paper's / fla's rule
(``naive_nsa_compression``: only blocks wholly at or before the query). ``scale=0.0`` is a scale of 0 (tokamax's
torch fallback reads ``scale or D ** -0.5``). Extensions (tokamax raises or has none): GQA / MQA, any ``T``
(the last chunk / compression block shorter: means over their own tokens), ``v`` head dim ``Dv != D``, gates
``[B, T, Hq]`` (fla's layout) besides tokamax's ``[B, T, Hq, Dv]``.
Differences from fla-core's ``naive_nsa`` (``fla/ops/nsa/naive.py``): fla selects per query token by the
compressed attention probabilities (forcing the first and the two local blocks), with learned gates
``[B, T, HQ]`` and a GQA group of at least 16; tokamax's selection (used here) routes per query chunk by chunk
means. Where they coincide (the selected attention given the same blocks, ``naive_nsa_selection``; the
compressed branch with ``cmp_causal=True``, ``naive_nsa_compression``) the tests compare.
Gaps: no ``cu_seqlens`` (tokamax takes none); no caller-given ``block_indices`` (fla's); bf16 / f32 only;
``chunk_size`` a multiple of 128 (see :func:`~tpukernels.library.moba_ops.moba_attention`).

Tuning: each branch's kernels keep their own tuned configs (``config`` is passed to the selected branch's masked
kernels: ``{"block_kv_compute": ..}``).
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from ..errors import ArgumentError, DeviceError, DTypeError
from .moba_ops import CHUNK_SIZE, TOPK, block_sparse_attention, check_qkv, chunk_means, route_chunks, visible_mask

#: tokamax's defaults (``tokamax/experimental/torch_tpu/ops/nsa/torch_base.py``).
WINDOW = 128
CMP_BLOCK_SIZE = 64


def _check_int(name, x, lo, where):
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise ArgumentError(f"{where}: {name} must be an int >= {lo}, got {x!r}")


def _check_gate(name, g, q, B, T, Hq, Dv, where):
    if g is None:
        return None
    if not isinstance(g, torch.Tensor):
        raise ArgumentError(f"{where}: {name} must be a torch.Tensor or None, got {type(g).__name__}")
    if not g.dtype.is_floating_point:
        raise DTypeError(f"{where}: {name} must be a float tensor, got {g.dtype}")
    if g.device != q.device:
        raise DeviceError(f"{where}: {name} is on {g.device} but q is on {q.device}")
    if tuple(g.shape) == (B, T, Hq):
        return g.unsqueeze(-1)
    if tuple(g.shape) != (B, T, Hq, Dv):
        raise ArgumentError(f"{where}: {name} must have shape [B, T, Hq, Dv] = {(B, T, Hq, Dv)} (tokamax) or "
                            f"[B, T, Hq] = {(B, T, Hq)} (fla), got {tuple(g.shape)}")
    return g


@functools.lru_cache(maxsize=32)
def cmp_mask(T: int, block: int, causal: bool):
    """The compressed branch's ``[T, ceil(T / block)]`` visibility as a
    :class:`~tpukernels.library.attention.NumpyMask` (cached: its block tables are then built once)."""
    from .attention import NumpyMask

    t = np.arange(T)[:, None]
    c = np.arange(-(-T // block))[None, :]
    return NumpyMask((c + 1) * block - 1 <= t if causal else c * block < t)


def nsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_cmp: Optional[torch.Tensor] = None,
                  g_slc: Optional[torch.Tensor] = None, g_swa: Optional[torch.Tensor] = None,
                  chunk_size: int = CHUNK_SIZE, topk: int = TOPK, window: int = WINDOW,
                  cmp_block_size: int = CMP_BLOCK_SIZE, scale: Optional[float] = None, *, cmp_causal: bool = False,
                  config: dict | None = None, interpret: str | None = None) -> torch.Tensor:
    """Native Sparse Attention (causal), tokamax's torch_tpu ``nsa`` signature and layout.

    Args:
        q: ``[B, T, Hq, D]``; k: ``[B, T, Hkv, D]``; v: ``[B, T, Hkv, Dv]``; one dtype, bfloat16 or float32;
            ``Hkv`` divides ``Hq`` (GQA; tokamax: ``Hkv == Hq``). Any ``T >= 0`` (tokamax: a multiple of
            ``chunk_size`` and ``cmp_block_size``).
        g_cmp, g_slc, g_swa: gates of the compressed, selected and sliding-window branches, ``[B, T, Hq, Dv]``
            (tokamax) or ``[B, T, Hq]`` (fla; one gate per head), any float dtype, q's device; ``None``: 1/3.
        chunk_size: tokens per selection chunk, a positive multiple of 128 (default 256).
        topk: earlier chunks each query chunk selects besides its own (``>= 0``; default 4).
        window: the sliding window: query ``t`` sees keys ``t - window .. t`` (``>= 0``; default 128).
        cmp_block_size: tokens per compression block (``>= 1``; default 64).
        scale: logit scale of all three branches and the routing; ``None``: ``D ** -0.5``.
        cmp_causal: False (tokamax): compressed block ``c`` is visible to query ``t`` when ``c *
            cmp_block_size < t``; True (the NSA paper, fla): when ``(c + 1) * cmp_block_size - 1 <= t``.
        config: ``{"block_kv_compute": ..}`` for the selected branch's masked kernels.
        interpret: ``"fast"`` / ``"tpu"`` for cpu runs (see :mod:`tpukernels.dsl.modes`).

    Returns:
        ``[B, T, Hq, Dv]`` in q's dtype (the formula in the module docstring). Differentiable in q, k, v and the
        gates (the chunk routing is not differentiated). A query that sees no compressed block has ``o_cmp = 0``.

    Raises:
        ArgumentError: as :func:`~tpukernels.library.moba_ops.moba_attention`; ``window`` not an int
            ``>= 0``, ``cmp_block_size`` not an int ``>= 1``, ``cmp_causal`` not a bool; a gate not a tensor of
            shape ``[B, T, Hq, Dv]`` or ``[B, T, Hq]``.
        DTypeError: q, k, v not one dtype of bfloat16 / float32; a gate not a float tensor.
        DeviceError: a gate on another device than q.

    Sources: tokamax ``experimental/torch_tpu/ops/nsa`` and ``_src/ops/experimental/nsa/reference.py``
    (signature, layout, the three branches); Yuan et al., "Native Sparse Attention: Hardware-Aligned and Natively
    Trainable Sparse Attention" (arXiv:2502.11089); fla-core 0.6.0 ``fla/ops/nsa/naive.py``.
    """
    from .attention import flash_attention

    where = "tpukernels::nsa_attention"
    B, T, Hq, Hkv, D, Dv = check_qkv(q, k, v, chunk_size, topk, scale, where)
    _check_int("window", window, 0, where)
    _check_int("cmp_block_size", cmp_block_size, 1, where)
    if not isinstance(cmp_causal, bool):
        raise ArgumentError(f"{where}: cmp_causal must be a bool, got {cmp_causal!r}")
    gates = [_check_gate(n, g, q, B, T, Hq, Dv, where) for n, g in (("g_cmp", g_cmp), ("g_slc", g_slc),
                                                                     ("g_swa", g_swa))]
    scale = D ** -0.5 if scale is None else float(scale)
    if B == 0 or T == 0 or Hq == 0:
        return q.new_zeros(B, T, Hq, Dv)
    heads_first = lambda x: x.transpose(1, 2)  # noqa: E731  [B, T, H, D] <-> [B, H, T, D]
    kc, vc = (chunk_means(x, cmp_block_size).to(q.dtype) for x in (k, v))  # [B, Hkv, nc, D], differentiable
    o_cmp = flash_attention(heads_first(q), kc, vc, sm_scale=scale, mask=cmp_mask(T, cmp_block_size, cmp_causal),
                            interpret=interpret)
    sel = route_chunks(q.detach(), k.detach(), chunk_size, topk, scale)
    o_slc = block_sparse_attention(q, k, v, sel, chunk_size=chunk_size, scale=scale, config=config,
                                   interpret=interpret)
    o_swa = flash_attention(heads_first(q), heads_first(k), heads_first(v), causal=True, sm_scale=scale,
                            window=(window, 0), interpret=interpret)
    out = 0.0
    for g, o in zip(gates, (heads_first(o_cmp), o_slc, heads_first(o_swa))):
        out = out + (1.0 / 3.0 if g is None else g.float()) * o.float()
    return out.to(q.dtype)


def nsa_attention_reference(q, k, v, g_cmp=None, g_slc=None, g_swa=None, chunk_size: int = CHUNK_SIZE,
                            topk: int = TOPK, window: int = WINDOW, cmp_block_size: int = CMP_BLOCK_SIZE,
                            scale=None, *, cmp_causal: bool = False, block_indices=None, dtype=torch.float64,
                            branches: bool = False):
    """The dense NSA definition in ``dtype`` (float64) from the given (low-precision) tensors: ``[B, T, Hq,
    Dv]`` (or, with ``branches=True``, the tuple ``(o_cmp, o_slc, o_swa)`` before gating). Routing from the chunk
    means in ``dtype`` (or ``block_indices [B, Hq, n, K]``); rows with nothing visible give 0."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    qd, kd, vd = (x.to(dtype) for x in (q, k, v))
    sel = route_chunks(qd, kd, chunk_size, topk, scale, dtype) if block_indices is None else block_indices
    kc, vc = (chunk_means(x, cmp_block_size, dtype).transpose(1, 2).repeat_interleave(G, 2) for x in (kd, vd))
    kr, vr = (x.repeat_interleave(G, 2) for x in (kd, vd))

    def attend(kx, vx, vis):  # vis [T, S] or [B, H, T, S]
        s = torch.einsum("bthd,bshd->bhts", qd, kx) * scale
        p = torch.nan_to_num(torch.softmax(s.masked_fill(~vis, -torch.inf), -1), nan=0.0)
        return torch.einsum("bhts,bshd->bthd", p, vx)

    t = torch.arange(T)[:, None]
    c = torch.arange(kc.shape[1])[None, :]
    o_cmp = attend(kc, vc, (c + 1) * cmp_block_size - 1 <= t if cmp_causal else c * cmp_block_size < t)
    o_slc = attend(kr, vr, visible_mask(sel, T, chunk_size))
    s = torch.arange(T)[None, :]
    o_swa = attend(kr, vr, (s <= t) & (s >= t - window))
    if branches:
        return o_cmp, o_slc, o_swa
    out = 0.0
    for g, o in zip((g_cmp, g_slc, g_swa), (o_cmp, o_slc, o_swa)):
        g = 1.0 / 3.0 if g is None else (g.to(dtype).unsqueeze(-1) if g.dim() == 3 else g.to(dtype))
        out = out + g * o
    return out


__all__ = ["nsa_attention", "nsa_attention_reference", "cmp_mask", "WINDOW", "CMP_BLOCK_SIZE"]
