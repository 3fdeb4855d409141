"""Rotary position embedding (RoPE), forward and backward: llama / GPT-NeoX (rotate-half) and GPT-J
(interleaved) layouts, partial rotary, cos/sin given by the caller.

Written with the tpukernels DSL (``@tpu_kernel``), torch namespace ``tpukernels``.

Public API (torch tensors)::

    torch.ops.tpukernels.rope(x, cos, sin, positions=None, interleaved=False, seq_dim=2) -> y
    tpukernels.library.rope.apply_rope(...)                     the same, as a Python function
    tpukernels.library.rope.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        -> (q_embed, k_embed)                                   HF ``apply_rotary_pos_emb`` drop-in

``x`` is ``[B, H, S, D]`` (``seq_dim=2``, HF's layout) or ``[B, S, H, D]`` (``seq_dim=1``, TorchTitan's /
flash-attn's). ``cos`` / ``sin`` hold one value per rotated lane, **as HF's rotary embedding modules return
them** (``[B, S, R]`` or ``[S, R]``; or a cache ``[max_pos, R]`` indexed by ``positions``), so every HF scaling
variant (default, linear, dynamic NTK, YaRN, llama3, longrope: they differ only in the frequencies and the
attention factor folded into cos/sin) works unchanged through HF's own ``*RotaryEmbedding`` module. ``R`` =
``cos.shape[-1]`` is the rotary dim: lanes ``[0, R)`` rotate, lanes ``[R, D)`` pass through (partial rotary).

Formulas (``x1 = x[..., :R/2]``, ``x2 = x[..., R/2:R]``)::

    interleaved=False (llama, GPT-NeoX; HF ``rotate_half``):
        y[..., :R] = x[..., :R] * cos + cat(-x2, x1) * sin
    interleaved=True (GPT-J, GPT-NeoX-J; HF ``rotate_every_two``, lanes (2i, 2i+1) form one pair):
        y[2i] = x[2i] * cos[2i] - x[2i+1] * sin[2i],   y[2i+1] = x[2i+1] * cos[2i+1] + x[2i] * sin[2i+1]
    y[..., R:] = x[..., R:]

Sources: Su et al. 2021 (RoFormer); HF transformers ``modeling_llama.apply_rotary_pos_emb`` /
``rotate_half``, ``modeling_gptj.apply_rotary_pos_emb`` / ``rotate_every_two``, ``modeling_rope_utils``.

Design. Both layouts are one formula on lanes: with ``s = R/2`` (rotate-half) or ``s = 1`` (interleaved),
``roll(v, k)[i] = v[i - k]`` (``jnp.roll`` on the last axis, a lane rotation on TPU: ``pltpu.roll``)::

    y  = x * C + roll(x, D - s) * A + roll(x, s) * B
    A  = -sin on the lanes that take their partner from above (i < s, or even i < R), else 0
    B  =  sin on the lanes that take it from below (s <= i < R, or odd i < R), else 0
    C  =  cos on [0, R), 1 on the pass-through lanes

``A`` / ``B`` are built in the kernel from ``sin`` with a lane mask (nothing extra is read from HBM). The
backward is the transpose of that linear map, the same kernel with ``transpose=True``:
``dx = dy * C + roll(dy * A, s) + roll(dy * B, D - s)`` (exact for any cos/sin, not only for true
rotations). Everything is computed in float32 and rounded once to x's dtype (HF multiplies and adds in
x's dtype: 2-3 roundings; the difference is within one unit of x's dtype). ``cos``/``sin`` are differentiable
too (HF computes them under ``no_grad``; their gradient, when asked for, is formed with torch ops from the
same formula).

One internal kernel op carries the work::

    tpukernels::rope_fwd(x, cos, sin, rotary_dim, interleaved, seq_dim, transpose) -> y

``x`` ``[B, H, S, D]`` or ``[B, S, H, D]``, ``cos``/``sin`` ``[Bc, S, D]`` (``Bc`` in ``{1, B}``, padded to
``D`` lanes by the public op when ``R < D``), grid ``(B, cdiv(S, block_s))`` of blocks holding every head of
``block_s`` positions, so each cos/sin block is read once per block of heads; the overhanging tail block of
S is elementwise (its garbage rows are never stored). float16 is widened to float32 (Mosaic, libtpu 0.0.52,
cannot load float16 vectors on v5e/v6e/tpu7x), as in :mod:`tpukernels.library.norms`.

Tuning: one tunable, ``block_s`` (positions per grid step, an upper bound lowered to fit
:data:`VMEM_BUDGET_BYTES`, counting the float32 temporaries). No per-chip tables are shipped yet; the
heuristic takes the largest block that fits (the kernel is HBM-bound: 2 reads + 1 write of x per
element, bigger steps amortize the per-step overhead).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import dsl as tk
from ..chips import MiB
from ..dsl.validate import LANES
from ..errors import ArgumentError, DeviceError, DTypeError

__all__ = [
    "apply_rope", "apply_rotary_pos_emb", "rope_fwd", "rope_reference", "BLOCK_S", "VMEM_BUDGET_BYTES",
]

NAMESPACE = "tpukernels"
#: Candidate positions (sequence rows) per grid step.
BLOCK_S = (8, 16, 32, 64, 128, 256, 512, 1024)
#: VMEM for the double-buffered blocks plus the float32 temporaries of one step (below v5e's 16 MiB
#: default scoped limit, as :data:`tpukernels.library.norms.VMEM_BUDGET_BYTES`).
VMEM_BUDGET_BYTES = 12 * MiB
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
F32 = jnp.float32


# ----------------------------------------------------------------------------------------- kernel body
def lane_tables(cos, sin, rotary_dim: int, interleaved: bool):
    """float32 ``(C, A, B, s)`` of the module docstring from ``(rows, D)`` cos/sin blocks."""
    lane = jax.lax.broadcasted_iota(jnp.int32, cos.shape, cos.ndim - 1)
    rot = lane < rotary_dim
    if interleaved:
        s = 1
        take_above = rot & (lane % 2 == 0)
        take_below = rot & (lane % 2 == 1)
    else:
        s = rotary_dim // 2
        take_above = lane < s
        take_below = rot & (lane >= s)
    zero = jnp.zeros_like(sin)
    return jnp.where(rot, cos, 1.0), jnp.where(take_above, -sin, zero), jnp.where(take_below, sin, zero), s


_lane_tables = lane_tables  # the kernel bodies here keep this name: the tuning DB keys them by their source


def _rope_body(x_ref, cos_ref, sin_ref, y_ref, *, rotary_dim: int, interleaved: bool, seq_dim: int,
               transpose: bool):
    d = x_ref.shape[-1]
    cos, sin = cos_ref[0].astype(F32), sin_ref[0].astype(F32)  # (bs, D)
    c, a, b, s = _lane_tables(cos, sin, rotary_dim, interleaved)
    if seq_dim == 1:  # x block (bs, H, D): the tables broadcast over heads (sublanes)
        c, a, b = c[:, None, :], a[:, None, :], b[:, None, :]
    x = x_ref[0].astype(F32)  # (H, bs, D) or (bs, H, D)
    ax = x.ndim - 1
    if not transpose:
        y = x * c + pltpu.roll(x, d - s, ax) * a + pltpu.roll(x, s, ax) * b
    else:
        y = x * c + pltpu.roll(x * a, s, ax) + pltpu.roll(x * b, d - s, ax)
    y_ref[0] = y.astype(y_ref.dtype)


# ----------------------------------------------------------------------------------------- kernel
def _padded(n: int, m: int) -> int:
    return tk.cdiv(int(n), m) * m


def fit_block_s(block_s: int, s: int, per_row: int) -> int:
    """Positions per block actually launched: ``block_s`` halved (down to 8) until the block fits
    :data:`VMEM_BUDGET_BYTES`, then all of S when S is no larger (a block equal to the full dim is legal)."""
    bs = int(block_s)
    while bs > 8 and bs * per_row > VMEM_BUDGET_BYTES:
        bs //= 2
    return int(s) if 0 < s <= bs else bs


def _dims(x, seq_dim: int):
    b, a1, a2, d = x.shape
    return (b, a1, a2, d) if seq_dim == 2 else (b, a2, a1, d)  # (B, H, S, D)


def _row_bytes(x, cos, seq_dim: int) -> int:
    _, h, _, d = _dims(x, seq_dim)
    lanes = _padded(d, LANES)
    xb, cb = np.dtype(x.dtype).itemsize, np.dtype(cos.dtype).itemsize
    return 2 * (2 * h * lanes * xb + 2 * lanes * cb) + 4 * _padded(h, 8) * lanes * 4


def _heuristic(x, cos, sin, rotary_dim, interleaved, seq_dim, transpose):
    per = _row_bytes(x, cos, seq_dim)
    fits = [b for b in BLOCK_S if b * per <= VMEM_BUDGET_BYTES]
    return {"block_s": max(fits) if fits else BLOCK_S[0]}


def _check_kernel_args(x, cos, sin, rotary_dim, seq_dim):
    for t in (x, cos, sin):
        name = np.dtype(t.dtype).name
        if name not in ("bfloat16", "float32"):
            raise DTypeError(f"{NAMESPACE}::rope_fwd: {t.name!r} has dtype {name}: use bfloat16 or float32 "
                             f"(the public op widens float16)")
    if seq_dim not in (1, 2):
        raise ArgumentError(f"{NAMESPACE}::rope_fwd: seq_dim must be 1 ([B, S, H, D]) or 2 ([B, H, S, D]), "
                            f"got {seq_dim}")
    if len(x.shape) != 4:
        raise ArgumentError(f"{NAMESPACE}::rope_fwd: x must be 4-D, got shape {tuple(x.shape)}")
    b, _, s, d = _dims(x, seq_dim)
    for t in (cos, sin):
        if len(t.shape) != 3 or t.shape[0] not in (1, b) or t.shape[1] != s or t.shape[2] != d:
            raise ArgumentError(f"{NAMESPACE}::rope_fwd: {t.name} must be [1 or {b}, {s}, {d}] (internal op), "
                                f"got {tuple(t.shape)}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ArgumentError(f"{NAMESPACE}::rope_fwd: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if not (2 <= rotary_dim <= d and rotary_dim % 2 == 0):
        raise ArgumentError(f"{NAMESPACE}::rope_fwd: rotary_dim must be even and in [2, D={d}], got {rotary_dim}")


@tk.tpu_kernel(
    _rope_body, name="rope_fwd", namespace=NAMESPACE, heuristic=_heuristic,
    tunables={"block_s": tk.Tunable(BLOCK_S, default=256,
                                    doc="positions per grid step (upper bound; lowered to fit VMEM and S)")},
    out_shape=lambda x, *_, **__: tk.like(x),
)
def rope_fwd(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool, seq_dim: int,
    transpose: bool, *, block_s: int,
) -> torch.Tensor:
    """RoPE on a 4-D tensor (internal op ``tpukernels::rope_fwd``; use :func:`apply_rope`).

    Args:
        x: ``[B, H, S, D]`` (``seq_dim=2``) or ``[B, S, H, D]`` (``seq_dim=1``), bf16/f32.
        cos, sin: ``[Bc, S, D]`` bf16/f32, ``Bc`` 1 (shared by the batch) or B; lanes ``>= rotary_dim`` unused.
        rotary_dim: R, even, ``2 <= R <= D``. interleaved: GPT-J pairs ``(2i, 2i+1)`` instead of rotate-half.
        transpose: apply the transposed map (the backward: ``dx`` from ``dy``).

    Returns:
        ``y`` shaped and typed like x.
    """
    _check_kernel_args(x, cos, sin, rotary_dim, seq_dim)
    b, h, s, d = _dims(x, seq_dim)
    bs = fit_block_s(block_s, s, _row_bytes(x, cos, seq_dim))
    shared = cos.shape[0] == 1
    if seq_dim == 2:
        xspec = pl.BlockSpec((1, h, bs, d), lambda i, j: (i, 0, j, 0))
    else:
        xspec = pl.BlockSpec((1, bs, h, d), lambda i, j: (i, j, 0, 0))
    cspec = pl.BlockSpec((1, bs, d), (lambda i, j: (0, j, 0)) if shared else (lambda i, j: (i, j, 0)))
    nbytes = 2 * x.size * x.itemsize + 2 * cos.size * cos.itemsize
    return tk.Launch(
        grid=(b, tk.cdiv(s, bs)),
        in_specs=[xspec, cspec, cspec],
        out_specs=xspec,
        out_shape=tk.like(x),
        dimension_semantics=("parallel", "parallel"),
        cost_estimate=pl.CostEstimate(flops=5 * x.size, transcendentals=0, bytes_accessed=int(nbytes)),
    )


@rope_fwd.def_backward(op="apply_rope", double_backward=True)  # the backward is rope_fwd itself
def _rope_fwd_backward(ctx, dy):
    """dx: the transposed map; dcos / dsin (only when asked for): torch ops on the same formula."""
    out = {"x": rope_fwd(dy, ctx.cos, ctx.sin, ctx.rotary_dim, ctx.interleaved, ctx.seq_dim, not ctx.transpose)}
    if ctx.needs_input_grad.get("cos") or ctx.needs_input_grad.get("sin"):
        dcos, dsin = table_grads(dy, ctx.x, ctx.cos, ctx.rotary_dim, ctx.interleaved, ctx.seq_dim, ctx.transpose)
        out["cos"] = dcos.to(ctx.cos.dtype) if ctx.needs_input_grad.get("cos") else None
        out["sin"] = dsin.to(ctx.sin.dtype) if ctx.needs_input_grad.get("sin") else None
    return out


def table_grads(dy, x, cos, r, interleaved, seq_dim, transpose):
    """float32 gradients w.r.t. the ``[Bc, S, D]`` cos / sin tables (summed over heads and, when shared, the
    batch), for an incoming gradient ``dy``. With ``Pu v = roll(v, D - s)``, ``Pd v = roll(v, s)``:
    forward ``y = x C + Pu(x) A + Pd(x) B`` gives ``dC = dy x``, ``dA = dy Pu(x)``, ``dB = dy Pd(x)``;
    transposed ``y = x C + Pd(x A) + Pu(x B)`` gives ``dA = Pu(dy) x``, ``dB = Pd(dy) x``.
    Then ``dcos = dC`` and ``dsin = -dA + dB``, each on the lanes where that table is built from cos/sin."""
    d = x.shape[-1]
    s = 1 if interleaved else r // 2
    xf, gf = x.float(), dy.float()
    if seq_dim == 1:
        xf, gf = xf.transpose(1, 2), gf.transpose(1, 2)  # [B, H, S, D]
    if not transpose:
        t_c, t_a, t_b = gf * xf, gf * torch.roll(xf, d - s, -1), gf * torch.roll(xf, s, -1)
    else:
        t_c, t_a, t_b = gf * xf, torch.roll(gf, d - s, -1) * xf, torch.roll(gf, s, -1) * xf
    t_c, t_a, t_b = (t.sum(1) for t in (t_c, t_a, t_b))  # over heads -> [B, S, D]
    lane = torch.arange(d, device=x.device)
    rot = lane < r
    above = rot & (lane % 2 == 0) if interleaved else lane < s
    below = rot & (lane % 2 == 1) if interleaved else rot & (lane >= s)
    dcos = torch.where(rot, t_c, 0.0)
    dsin = torch.where(above, -t_a, 0.0) + torch.where(below, t_b, 0.0)
    if cos.shape[0] == 1:
        dcos, dsin = dcos.sum(0, keepdim=True), dsin.sum(0, keepdim=True)
    return dcos, dsin


# ----------------------------------------------------------------------------------------- public op
def _check_public(x, cos, sin, positions, interleaved, seq_dim):
    op = "tpukernels.rope"
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ArgumentError(f"{op}: x must be a 4-D tensor [B, H, S, D] (seq_dim=2) or [B, S, H, D] (seq_dim=1), "
                            f"got {got}")
    if seq_dim not in (1, 2):
        raise ArgumentError(f"{op}: seq_dim must be 1 ([B, S, H, D]) or 2 ([B, H, S, D]), got {seq_dim!r}")
    if x.dtype not in _SUPPORTED:
        raise DTypeError(f"{op}: x dtype {x.dtype} is not supported: use bfloat16, float16 or float32")
    b, _, s, d = _dims(x, seq_dim)
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _SUPPORTED:
            raise DTypeError(f"{op}: {name} dtype {t.dtype} is not supported: use bfloat16, float16 or float32")
        if t.device != x.device:
            raise DeviceError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ArgumentError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    r = cos.shape[-1] if cos.dim() else 0
    if r % 2 or not 2 <= r <= d:
        raise ArgumentError(
            f"{op}: rotary dim mismatch: cos/sin have R = {r} lanes (cos.shape[-1]) but x has head dim D = {d}; "
            f"R must be even and 2 <= R <= D (R < D rotates the first R lanes: partial rotary)")
    if positions is None:
        if cos.dim() == 2:
            want = (s, r)
        elif cos.dim() == 3:
            want = (cos.shape[0] if cos.shape[0] in (1, b) else b, s, r)
        else:
            want = None
        if want is None or tuple(cos.shape) != want:
            raise ArgumentError(
                f"{op}: without positions, cos/sin must be [S, R] = [{s}, {r}] or [B or 1, S, R] = [{b}, {s}, {r}] "
                f"(x has S = {s}, B = {b}), got {tuple(cos.shape)}; pass positions= to index a [max_pos, R] cache")
        return r
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        raise DTypeError(f"{op}: positions must be an int32/int64 tensor [S] or [B, S], got "
                         f"{getattr(positions, 'dtype', type(positions).__name__)}")
    if positions.device != x.device:
        raise DeviceError(f"{op}: positions are on {positions.device} but x is on {x.device}")
    if cos.dim() != 2:
        raise ArgumentError(f"{op}: with positions, cos/sin must be a cache [max_pos, R], got {tuple(cos.shape)}")
    if tuple(positions.shape) not in ((s,), (1, s), (b, s)):
        raise ArgumentError(f"{op}: positions must be [S] = [{s}] or [B, S] = [{b}, {s}], got {tuple(positions.shape)}")
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos.shape[0]:
            raise ArgumentError(
                f"{op}: positions beyond the cos/sin cache: positions span [{lo}, {hi}] but the cache has "
                f"max_pos = {cos.shape[0]} rows (valid positions 0..{cos.shape[0] - 1}); build a longer cache")
    return r


def _widen(t):
    return t.float() if t.dtype == torch.float16 else t


def _rope_impl(x, cos, sin, positions=None, interleaved=False, seq_dim=2):
    r = _check_public(x, cos, sin, positions, interleaved, seq_dim)
    b, _, s, d = _dims(x, seq_dim)
    if positions is not None:
        pos = positions.reshape(-1, s).long()
        cos, sin = cos[pos], sin[pos]  # [1 or B, S, R]
    elif cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if r < d:  # pad the tables to D lanes (the pass-through lanes' values are never used)
        cos = torch.nn.functional.pad(cos, (0, d - r))
        sin = torch.nn.functional.pad(sin, (0, d - r))
    cos, sin = _widen(cos).contiguous(), _widen(sin).contiguous()
    if seq_dim == 2 and not x.is_contiguous() and x.transpose(1, 2).is_contiguous():
        # HF's q/k: ``proj(h).view(B, S, H, D).transpose(1, 2)``: run the [B, S, H, D] kernel on the storage
        # as it is (no copy) and return the same kind of view
        y = torch.ops.tpukernels.rope_fwd(_widen(x.transpose(1, 2)), cos, sin, r, bool(interleaved), 1, False)
        return y.transpose(1, 2).to(x.dtype)
    y = torch.ops.tpukernels.rope_fwd(_widen(x), cos, sin, r, bool(interleaved), int(seq_dim), False)
    return y.to(x.dtype)


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("rope(Tensor x, Tensor cos, Tensor sin, Tensor? positions=None, bool interleaved=False, "
            "int seq_dim=2) -> Tensor")
_LIB.impl("rope", _rope_impl, "CompositeImplicitAutograd")


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: Optional[torch.Tensor] = None, *,
    interleaved: bool = False, seq_dim: int = 2,
) -> torch.Tensor:
    """Rotary position embedding of ``x`` (formulas: module docstring).

    Args:
        x: ``[B, H, S, D]`` (``seq_dim=2``, HF layout) or ``[B, S, H, D]`` (``seq_dim=1``), bf16/f16/f32.
        cos, sin: one value per rotated lane, HF's convention (rotate-half: ``cat(c, c)``; interleaved:
            ``repeat_interleave(c, 2)``): ``[S, R]`` or ``[B or 1, S, R]`` for the positions of x, or, with
            ``positions``, a cache ``[max_pos, R]``. Any float dtype (computed in float32). ``R`` even,
            ``2 <= R <= D``; lanes ``[R, D)`` of x pass through unchanged (partial rotary).
        positions: None, or int ``[S]`` / ``[B, S]`` rows of the cos/sin cache for each position of x.
        interleaved: False: llama / GPT-NeoX rotate-half; True: GPT-J pairs ``(2i, 2i+1)``.
        seq_dim: 2 for ``[B, H, S, D]``, 1 for ``[B, S, H, D]``.

    Returns:
        ``y``: same shape and dtype as x, differentiable in x (and in cos/sin when they require grad).

    Raises:
        ArgumentError: mismatched rotary dims (R odd, R > D, cos/sin shapes differ or do not match x's S/B),
            positions beyond the cos/sin cache (or negative), bad seq_dim (not an int: a float included). DTypeError: dtype not bf16/f16/f32,
            positions not int. DeviceError: cos/sin/positions on another device than x.
    """
    seq_dim = tk.check_int("tpukernels::rope", "seq_dim", seq_dim)  # typed, before the op schema's RuntimeError
    return torch.ops.tpukernels.rope(x, cos, sin, positions, interleaved, seq_dim)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Drop-in for HF ``modeling_llama.apply_rotary_pos_emb`` (transformers 5.x signature; same result up to
    rounding: computed in float32, rounded once).

    Args:
        q: ``[B, Hq, S, D]``, k: ``[B, Hkv, S, D]`` (``unsqueeze_dim=1``; ``unsqueeze_dim=2`` means
            ``[B, S, H, D]``). cos, sin: ``[B, S, R]`` from HF's rotary embedding module (any ``rope_type``).

    Returns:
        ``(q_embed, k_embed)``.

    Raises:
        ArgumentError: unsqueeze_dim not 1 or 2; as :func:`apply_rope`.
    """
    if unsqueeze_dim not in (1, 2):
        raise ArgumentError(f"tpukernels.apply_rotary_pos_emb: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim!r}")
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    return apply_rope(q, cos, sin, seq_dim=seq_dim), apply_rope(k, cos, sin, seq_dim=seq_dim)


# ----------------------------------------------------------------------------------------- float64 reference
def rope_reference(x, cos, sin, positions=None, interleaved=False, seq_dim=2):
    """float64 RoPE of the given values, written as HF writes it (``rotate_half`` / ``rotate_every_two``)."""
    xd = x.double()
    if seq_dim == 1:
        xd = xd.transpose(1, 2)
    c, s_ = cos.double(), sin.double()
    if positions is not None:
        c, s_ = c[positions.long()], s_[positions.long()]
    if c.dim() == 2:
        c, s_ = c[None], s_[None]
    c, s_ = c[:, None], s_[:, None]  # [B, 1, S, R]
    r = c.shape[-1]
    xr, xp = xd[..., :r], xd[..., r:]
    if interleaved:
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        rot = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), dim=-1)
    y = torch.cat((xr * c + rot * s_, xp), dim=-1)
    return y.transpose(1, 2) if seq_dim == 1 else y


#: ``(kernel, compile_for args, kwargs)``: Llama-3-8B-like q (32 heads, D=128, 4096 positions), bf16.
STANDARD_CASES = [
    (rope_fwd, ("1x32x4096x128:bf16", "1x4096x128:bf16", "1x4096x128:bf16"),
     {"rotary_dim": 128, "interleaved": False, "seq_dim": 2, "transpose": False}),
]
