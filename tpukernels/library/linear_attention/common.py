"""What the linear-attention ops share: the argument rules of flash-linear-attention's delta-rule signature
(``q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size``; gated DeltaNet and KDA differ only in the rank of
the gate) and the head-major layout of packed tokens their kernels read."""

from __future__ import annotations

import math

import torch

from ...errors import ArgumentError, DeviceError, DTypeError

__all__ = ["CHUNK_SIZES", "INT_DTYPES", "check_delta_rule_args", "head_major", "shape_of"]

#: ``chunk_size`` values (tokens per chunk: powers of two; fla's GDN / KDA use 64).
CHUNK_SIZES = (16, 32, 64, 128)
INT_DTYPES = (torch.int32, torch.int64)


def shape_of(x):
    """``x``'s shape as a tuple, or its type name (for error messages)."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def check_delta_rule_args(op, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, chunk_size,
                          per_channel_gate: bool, dtypes=(torch.bfloat16, torch.float32), state_rows="N") -> int:
    """Every rule of fla's delta-rule arguments, before any kernel runs; returns N (rows or packed sequences).

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` (HV a multiple of H), ``g [B, T, HV]`` (per token) or
    ``[B, T, HV, K]`` (``per_channel_gate``: KDA), ``beta [B, T, HV]``, ``scale`` positive or None,
    ``chunk_size`` in :data:`CHUNK_SIZES`, ``cu_seqlens`` int ``[N + 1]`` (B = 1; 0, non-decreasing, T),
    ``initial_state`` float32 ``[N, HV, K, V]`` (``state_rows`` rows instead of N when an int; any number of rows
    when None: a state pool indexed by the caller).

    Raises:
        ArgumentError: ranks / shapes (mismatched head counts, gate rank), cu_seqlens, scale, chunk_size.
        DTypeError: q / k / v not in ``dtypes``, float gates, a state not float32. DeviceError.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ArgumentError(f"{op}: {name} must be a 4-D tensor [B, T, heads, dim], got {shape_of(x)}")
        if x.dtype not in dtypes:
            raise DTypeError(f"{op}: {name} dtype {x.dtype} is not supported: use "
                             f"{' or '.join(str(d).replace('torch.', '') for d in dtypes)}")
    if tuple(k.shape) != tuple(q.shape):
        raise ArgumentError(f"{op}: k must have q's shape [B, T, H, K] = {list(q.shape)}, got {list(k.shape)}")
    b, t, h, kd = q.shape
    if tuple(v.shape[:2]) != (b, t) or v.shape[2] % h or not v.shape[2]:
        raise ArgumentError(f"{op}: v must be [B, T, HV, V] with B, T = {b}, {t} and HV a multiple of the "
                            f"{h} q/k heads (mismatched head counts), got {list(v.shape)}")
    hv, vd = v.shape[2], v.shape[3]
    gate = (("g", [b, t, hv, kd], "[B, T, HV, K] (one log decay per token, value head and key channel)")
            if per_channel_gate else ("g", [b, t, hv], "[B, T, HV] (one gate per token and value head)"))
    for name, want, what in (gate, ("beta", [b, t, hv], "[B, T, HV] (one per token and value head)")):
        x = g if name == "g" else beta
        if not isinstance(x, torch.Tensor) or x.dim() != len(want):
            raise ArgumentError(f"{op}: {name} must be a {len(want)}-D tensor {what}, got {shape_of(x)}")
        if list(x.shape) != want:
            raise ArgumentError(f"{op}: {name} must be {what.split(' (')[0]} = {want}, got {list(x.shape)}")
        if not x.dtype.is_floating_point:
            raise DTypeError(f"{op}: {name} must be a float tensor, got {x.dtype}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens)):
        if isinstance(x, torch.Tensor) and x.device != q.device:
            raise DeviceError(f"{op}: {name} is on {x.device} but q is on {q.device}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0
                              or not math.isfinite(scale)):
        raise ArgumentError(f"{op}: scale must be a positive float or None (K ** -0.5), got {scale!r}")
    if chunk_size not in CHUNK_SIZES or isinstance(chunk_size, bool):
        raise ArgumentError(f"{op}: chunk_size must be a power of two in {CHUNK_SIZES}, got {chunk_size!r}")
    n = b
    if cu_seqlens is not None:
        if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in INT_DTYPES
                or cu_seqlens.numel() < 2):
            raise ArgumentError(f"{op}: cu_seqlens must be a 1-D int32/int64 tensor [N + 1] (N >= 1), got "
                                f"{shape_of(cu_seqlens)} {getattr(cu_seqlens, 'dtype', '')}")
        if b != 1:
            raise ArgumentError(f"{op}: with cu_seqlens the sequences are packed in one row: B must be 1, got {b}")
        c = cu_seqlens.tolist()
        if c[0] != 0:
            raise ArgumentError(f"{op}: cu_seqlens must start at 0, got {c[0]}")
        if any(y < x for x, y in zip(c, c[1:])):
            raise ArgumentError(f"{op}: cu_seqlens must be non-decreasing (increasing offsets), got {c[:8]}"
                                f"{' ...' if len(c) > 8 else ''}")
        if c[-1] != t:
            raise ArgumentError(f"{op}: cu_seqlens must end at the token count T = {t}, got {c[-1]}")
        n = len(c) - 1
    if initial_state is not None:
        rows = n if state_rows == "N" else state_rows
        st = initial_state
        if (not isinstance(st, torch.Tensor) or st.dim() != 4 or tuple(st.shape[1:]) != (hv, kd, vd)
                or (rows is not None and st.shape[0] != rows)):
            want = f"[{rows if rows is not None else 'S'}, {hv}, {kd}, {vd}]"
            raise ArgumentError(f"{op}: initial_state must be [N, HV, K, V] = {want}, got {shape_of(initial_state)}")
        if initial_state.dtype != torch.float32:
            raise DTypeError(f"{op}: initial_state must be float32 (the state is kept in float32), got "
                             f"{initial_state.dtype}")
    return n


def head_major(x):
    """``[B, T, H, D] -> [H, B*T, D]`` contiguous (the packed tokens of each head adjacent: the kernels' layout)."""
    b, t, h, d = x.shape
    return x.reshape(b * t, h, d).transpose(0, 1).contiguous()
