"""Short causal depthwise conv1d (the conv in front of GDN / KDA / Mamba2 mixers), prefill and decode.

Written with the tpukernels DSL (``@tpu_kernel``), torch namespace ``tpukernels``.

Public API (torch tensors)::

    causal_conv1d_fn(x, weight, bias=None, *, activation="silu", seq_idx=None, cu_seqlens=None,
                     initial_states=None, return_final_states=False, final_states_out=None)
        -> out, or (out, final_states)                         Dao-AILab causal-conv1d ``causal_conv1d_fn``
    causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None) -> out        decode; ``conv_state`` updated in place
    torch.ops.tpukernels.causal_conv1d(...) -> (out, final_states)     the op behind causal_conv1d_fn
    causal_conv1d_reference / causal_conv1d_update_reference        float64 references

Formula (``x [B, D, L]`` channels-first, ``weight [D, W]``, ``W`` the kernel width, ``xp`` = x with the
``W - 1`` columns of ``initial_states`` (zeros without) in front)::

    pre[b, d, t] = bias[d] + sum_{k < W} weight[d, k] * xp[b, d, t + k]      (= x[b, d, t - (W-1) + k])
    out = silu(pre) if activation in ("silu", "swish") else pre
    final_states[b] = xp[b, :, -(W-1):]                       (the last W - 1 inputs, state padded in front)

Packed sequences: with ``seq_idx [B, L]`` (int) a tap reads ``x[b, d, t - s]`` only when ``seq_idx[b, t - s] ==
seq_idx[b, t]`` (else 0), so sequences packed in one row never read each other's tokens. ``cu_seqlens [N + 1]``
(int, 0 = c_0 < ... <= c_N = L, with B = 1) says the same by offsets, and also allows per-sequence
``initial_states [N, D, W-1]`` and per-sequence ``final_states [N, D, W-1]`` (Dao's CUDA op refuses states
with ``seq_idx``: so do we; cu_seqlens is the form tpu-inference and vLLM use for them).

Sources: Dao-AILab/causal-conv1d ``causal_conv1d_interface.py`` (``causal_conv1d_fn``, ``causal_conv1d_ref``,
``causal_conv1d_update_ref``: the update's ``cache_seqlens`` circular buffer and ``conv_state_indices``);
tpu-inference 0.32.0 ``layers/common/ragged_conv1d_jax.py`` (the ragged token-major form, ``query_start_loc``
= our cu_seqlens, per-sequence states) and ``kernels/causal_conv1d``. Differences from Dao: the default
activation is ``"silu"`` (as the issue and vLLM's port; Dao's own default is None: pass
``activation=None`` for it); the arithmetic is float32 whatever the dtypes (Dao's reference computes in
the weight's dtype), rounded once to x's dtype.

Not covered (vs the anchors): tpu-inference's token-major ``x [T, D]`` and ``conv_state [S, W-1, D]`` are the
transposes of Dao's layout used here (a copy each way); its prefill reads and writes a state cache in place through
``state_indices`` / ``has_initial_state``, which here is a gather into ``initial_states`` and a scatter of
``final_states`` by the caller; vLLM's ``pad_slot_id`` (skip a row whose state index is -1) is a typed error.

Design. One kernel op does every form::

    tpukernels::causal_conv1d_fwd(x, x_halo, weight, bias, seg, seg_halo, init, silu) -> out

grid ``(B, cdiv(D, block_d), cdiv(L, block_l))``, every axis parallel: a block of ``block_l`` tokens reads the
128 tokens before it as a second, small block of the same tensor (``x_halo`` is ``x`` itself, ``seg_halo``
``seg``), so no state is carried between grid steps and the halo costs ``128 / block_l`` extra reads. The
taps are lane rotations (``pltpu.roll``) of the block, the first ``W - 1`` lanes patched from the halo (or
``init`` / zeros in the first block). ``seg [B, 1, L]`` int32 (segment id per token, from seq_idx or
cu_seqlens) masks taps that cross a segment (``jnp.where``, so a NaN in one sequence never reaches another).
The overhanging tail block's garbage lanes only feed outputs past L (causal), which are never stored.
With cu_seqlens and ``initial_states``, the first ``W - 1`` outputs of each sequence (the only ones that read
a state) are recomputed from the state and scattered over the kernel's (a ``N * (W-1) * D`` fix-up in torch,
as tpu-inference's ragged reference does); the final states are gathers (no arithmetic).
``causal_conv1d_update`` is the same kernel over the ``T`` new tokens with ``init`` = the state window.
float16 is widened to float32 (Mosaic cannot load float16 vectors on v5e/v6e/tpu7x).

Backward (``dx``, ``dweight``, ``dbias``, ``dinitial_states``): the pre-activation is recomputed by the
forward kernel (``silu=False``); ``dx`` is the same kernel on the time-reversed ``dpre`` with the taps
reversed (the transpose of a causal conv is an anti-causal one); ``dweight`` / ``dbias`` / ``dinitial_states``
are float32 reductions in torch. Not differentiable: the cu_seqlens + initial_states fix-up path (a typed
error if a gradient is asked for there); ``causal_conv1d_update`` is for inference (its in-place state write is
outside autograd; its gradients are untested).

Tuning: ``block_d`` (channels per step) and ``block_l`` (tokens per step; a multiple of 128, or all of L
when L is no larger). No per-chip tables are shipped yet: the heuristic takes the largest block that fits
:data:`VMEM_BUDGET_BYTES` (HBM-bound: one read and one write of x per element, W multiply-adds).
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
    "causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_fwd", "causal_conv1d_reference",
    "causal_conv1d_update_reference", "ACTIVATIONS", "BLOCK_D", "BLOCK_L", "VMEM_BUDGET_BYTES", "MAX_WIDTH",
]

NAMESPACE = "tpukernels"
#: ``activation`` values: None (identity), ``"silu"`` and ``"swish"`` (the same function), as Dao's.
ACTIVATIONS = (None, "silu", "swish")
#: Widest kernel supported (Dao's CUDA kernels: 2..4; the taps are unrolled).
MAX_WIDTH = 8
BLOCK_D = (8, 16, 32, 64, 128, 256, 512, 1024)
BLOCK_L = (128, 256, 512, 1024, 2048, 4096)
#: VMEM for the double-buffered blocks plus the float32 temporaries (as the norms' budget).
VMEM_BUDGET_BYTES = 12 * MiB
HALO = LANES  # tokens of the halo block read before each block of L
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
_INT = (torch.int32, torch.int64)
F32 = jnp.float32


# ----------------------------------------------------------------------------------------- kernel body
def _fwd_body(*refs, width: int, silu: bool, has_halo: bool, has_bias: bool, has_seg: bool, has_init: bool):
    it = iter(refs)
    x_ref = next(it)
    halo_ref = next(it) if has_halo else None
    w_ref = next(it)
    b_ref = next(it) if has_bias else None
    seg_ref = next(it) if has_seg else None
    seg_halo_ref = next(it) if has_seg and has_halo else None
    init_ref = next(it) if has_init else None
    o_ref = next(it)

    x = x_ref[0].astype(F32)  # (bd, bl)
    bd, bl = x.shape
    w = w_ref[...].astype(F32)  # (bd, W)
    first = pl.program_id(2) == 0
    # prev[c]: the input W-1-c tokens before this block's first token, (bd, 1)
    prev = []
    for c in range(width - 1):
        v = init_ref[0, :, c:c + 1].astype(F32) if has_init else jnp.zeros((bd, 1), F32)
        if has_halo:
            v = jnp.where(first, v, halo_ref[0, :, HALO - (width - 1) + c:HALO - (width - 1) + c + 1].astype(F32))
        prev.append(v)
    if has_seg:
        sg = seg_ref[0]  # (1, bl) int32
        prev_seg = []
        for c in range(width - 1):
            if has_halo:  # first block: prev values are the state / zeros, never another sequence's tokens
                hs = seg_halo_ref[0, :, HALO - (width - 1) + c:HALO - (width - 1) + c + 1]
                prev_seg.append(jnp.where(first, sg[:, 0:1], hs))
            else:
                prev_seg.append(sg[:, 0:1])
    lane = jax.lax.broadcasted_iota(jnp.int32, (bd, bl), 1)
    lane1 = jax.lax.broadcasted_iota(jnp.int32, (1, bl), 1)
    acc = x * w[:, width - 1:width]
    for s in range(1, width):  # tap k = W-1-s reads the token s before
        xs = pltpu.roll(x, s % bl, 1) if s % bl else x
        for t in range(min(s, bl)):
            xs = jnp.where(lane == t, prev[width - 1 - s + t], xs)
        if has_seg:
            ss = pltpu.roll(sg, s % bl, 1) if s % bl else sg
            for t in range(min(s, bl)):
                ss = jnp.where(lane1 == t, prev_seg[width - 1 - s + t], ss)
            xs = jnp.where(ss == sg, xs, 0.0)
        k = width - 1 - s
        acc = acc + xs * w[:, k:k + 1]
    if has_bias:
        acc = acc + b_ref[...].astype(F32)
    if silu:
        acc = acc * jax.nn.sigmoid(acc)
    o_ref[0] = acc.astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------- kernel
def _elem_bytes(x, w) -> int:
    """VMEM bytes per (channel, token) of a block: x and out double-buffered, ~6 float32 temporaries."""
    return 2 * 2 * np.dtype(x.dtype).itemsize + 6 * 4


def fit_blocks(block_d: int, block_l: int, d: int, l: int, per_elem: int) -> tuple[int, int]:
    """``(bd, bl)`` launched: all of L when L <= block_l (else block_l, a multiple of 128), all of D when
    D <= block_d; then bd, then bl halved until the block fits :data:`VMEM_BUDGET_BYTES`."""
    bd, bl = int(block_d), int(block_l)
    bl = int(l) if l <= bl else bl
    bd = int(d) if d <= bd else bd

    def size(a, b):
        return max(a, 8) * tk.cdiv(b, LANES) * LANES * per_elem

    while bd > 8 and bd % 16 == 0 and size(bd, bl) > VMEM_BUDGET_BYTES:
        bd //= 2
    while bl > LANES and bl % (2 * LANES) == 0 and size(bd, bl) > VMEM_BUDGET_BYTES:
        bl //= 2
    return bd, bl


def _heuristic(x, x_halo, weight, bias, seg, seg_halo, init, silu):
    _, d, l = x.shape
    per = _elem_bytes(x, weight)
    best = None
    lanes = tk.cdiv(max(l, 1), LANES) * LANES  # a block never holds more lanes than L padded (decode: 128)
    for bl in BLOCK_L:
        for bd in BLOCK_D:
            if bd * min(bl, lanes) * per <= VMEM_BUDGET_BYTES:
                key = (min(bd, max(d, 8)) * min(bl, lanes), bl)
                if best is None or key > best[0]:
                    best = (key, {"block_d": bd, "block_l": bl})
    return best[1]


def _check_kernel_args(x, x_halo, weight, bias, seg, seg_halo, init):
    op = f"{NAMESPACE}::causal_conv1d_fwd"
    for t in (x, weight, bias, init):
        if t is not None and np.dtype(t.dtype).name not in ("bfloat16", "float32"):
            raise DTypeError(f"{op}: {t.name!r} has dtype {np.dtype(t.dtype).name}: use bfloat16 or float32 "
                             f"(the public op widens float16)")
    if len(x.shape) != 3:
        raise ArgumentError(f"{op}: x must be [B, D, L], got {tuple(x.shape)}")
    b, d, l = x.shape
    if len(weight.shape) != 2 or weight.shape[0] != d or not 1 <= weight.shape[1] <= MAX_WIDTH:
        raise ArgumentError(f"{op}: weight must be [D={d}, W] with 1 <= W <= {MAX_WIDTH}, got {tuple(weight.shape)}")
    w = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (d, 1):
        raise ArgumentError(f"{op}: bias must be [D, 1] = [{d}, 1] (internal op), got {tuple(bias.shape)}")
    if init is not None and (w < 2 or tuple(init.shape) != (b, d, w - 1)):
        raise ArgumentError(f"{op}: init must be [B, D, W-1] = [{b}, {d}, {w - 1}], got {tuple(init.shape)}")
    for name, t, want in (("x_halo", x_halo, tuple(x.shape)), ("seg", seg, (b, 1, l)),
                          ("seg_halo", seg_halo, (b, 1, l))):
        if t is not None and tuple(t.shape) != want:
            raise ArgumentError(f"{op}: {name} must be {list(want)}, got {tuple(t.shape)}")
    for name, t in (("seg", seg), ("seg_halo", seg_halo)):
        if t is not None and np.dtype(t.dtype).name != "int32":
            raise DTypeError(f"{op}: {name} must be int32, got {np.dtype(t.dtype).name}")
    if (seg_halo is not None) != (seg is not None and x_halo is not None):
        raise ArgumentError(f"{op}: seg_halo must be given exactly when seg and x_halo are (it is seg itself)")
    if x_halo is not None and l <= HALO:
        raise ArgumentError(f"{op}: x_halo is for L > {HALO} (got L = {l}); pass None")


@tk.tpu_kernel(
    _fwd_body, name="causal_conv1d_fwd", namespace=NAMESPACE, heuristic=_heuristic,
    tunables={"block_d": tk.Tunable(BLOCK_D, default=256, doc="channels per grid step (upper bound)"),
              "block_l": tk.Tunable(BLOCK_L, default=1024, doc="tokens per grid step (upper bound; multiple of 128)")},
    out_shape=lambda x, *_, **__: tk.like(x),
    # depthwise: channels are independent (x, weight, bias, init on their channel dim); batch rows too
    sharding=lambda x, x_halo=None, weight=None, bias=None, seg=None, seg_halo=None, init=None, **_: _splits(
        x_halo, bias, seg, seg_halo, init),
)
def causal_conv1d_fwd(
    x: torch.Tensor, x_halo: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
    seg: Optional[torch.Tensor], seg_halo: Optional[torch.Tensor], init: Optional[torch.Tensor], silu: bool, *,
    block_d: int, block_l: int,
) -> torch.Tensor:
    """Causal depthwise conv1d (internal op ``tpukernels::causal_conv1d_fwd``; use :func:`causal_conv1d_fn`).

    Args:
        x: ``[B, D, L]`` bf16/f32. x_halo: x itself when ``L > 128`` (read as the 128 tokens before each
            block), else None. weight: ``[D, W]`` bf16/f32, ``W <= 8``. bias: ``[D, 1]`` or None.
        seg, seg_halo: int32 ``[B, 1, L]`` segment ids (taps across segments read 0) or None; seg_halo is seg
            itself when x_halo is given. init: ``[B, D, W-1]`` the inputs before ``x[..., 0]``, or None (zeros).
        silu: apply ``silu`` to the result.

    Returns:
        ``out`` shaped and typed like x.
    """
    _check_kernel_args(x, x_halo, weight, bias, seg, seg_halo, init)
    b, d, l = x.shape
    w = weight.shape[1]
    bd, bl = fit_blocks(block_d, block_l, d, l, _elem_bytes(x, weight))
    nl = tk.cdiv(l, bl)
    hb = max(bl // HALO, 1)  # halo block index = the 128 tokens before block j (unused, index 0, when nl == 1)

    def halo_map(i, c, j):
        return (i, c, jnp.maximum(j * hb - 1, 0))

    def seg_halo_map(i, c, j):
        return (i, 0, jnp.maximum(j * hb - 1, 0))

    xspec = pl.BlockSpec((1, bd, bl), lambda i, c, j: (i, c, j))
    in_specs = [xspec]
    if x_halo is not None:
        in_specs.append(pl.BlockSpec((1, bd, HALO), halo_map))
    in_specs.append(pl.BlockSpec((bd, w), lambda i, c, j: (c, 0)))
    if bias is not None:
        in_specs.append(pl.BlockSpec((bd, 1), lambda i, c, j: (c, 0)))
    if seg is not None:
        in_specs.append(pl.BlockSpec((1, 1, bl), lambda i, c, j: (i, 0, j)))
        if x_halo is not None:
            in_specs.append(pl.BlockSpec((1, 1, HALO), seg_halo_map))
    if init is not None:
        in_specs.append(pl.BlockSpec((1, bd, w - 1), lambda i, c, j: (i, c, 0)))
    nbytes = 2 * x.size * x.itemsize + (x.size * x.itemsize * HALO // bl if x_halo is not None else 0)
    return tk.Launch(
        grid=(b, tk.cdiv(d, bd), nl),
        in_specs=in_specs,
        out_specs=xspec,
        out_shape=tk.like(x),
        dimension_semantics=("parallel", "parallel", "parallel"),
        body_kwargs={"width": w, "has_halo": x_halo is not None, "has_bias": bias is not None,
                     "has_seg": seg is not None, "has_init": init is not None},
        cost_estimate=pl.CostEstimate(flops=int((2 * w + 4) * x.size), transcendentals=int(x.size) if silu else 0,
                                      bytes_accessed=int(nbytes)),
    )


def _splits(x_halo, bias, seg, seg_halo, init):
    from ..distributed.sharding import Split

    over_d = {"x": 1, "weight": 0, **({"x_halo": 1} if x_halo is not None else {}),
              **({"bias": 0} if bias is not None else {}), **({"init": 1} if init is not None else {})}
    over_b = {"x": 0, **({"x_halo": 0} if x_halo is not None else {}), **({"seg": 0} if seg is not None else {}),
              **({"seg_halo": 0} if seg_halo is not None else {}), **({"init": 0} if init is not None else {})}
    return [Split(over_d, (1,)), Split(over_b, (0,))]


@causal_conv1d_fwd.def_backward
def _fwd_backward(ctx, dout):
    """dx / dweight / dbias / dinit of ``out = act(conv(x))`` (module docstring: Backward)."""
    x, weight, bias, seg, init, silu = ctx.x, ctx.weight, ctx.bias, ctx.seg, ctx.init, ctx.silu
    w = weight.shape[1]
    g = dout.float()
    if silu:
        pre = _pre_f32(ctx)
        sig = torch.sigmoid(pre)
        g = g * sig * (1 + pre * (1 - sig))
    out = {}
    if ctx.needs_input_grad.get("x"):
        # transpose of a causal conv: anti-causal, dx[t] = sum_k w[k] g[t + W-1-k], i.e. the causal conv (same
        # taps) of the time-reversed g, reversed back
        gr = g.flip(-1).contiguous()
        segr = None if seg is None else seg.flip(-1).contiguous()
        halo = gr if ctx.x_halo is not None else None
        dx = causal_conv1d_fwd(gr, halo, weight.float().contiguous(), None, segr,
                               segr if halo is not None and segr is not None else None, None, False)
        out["x"] = dx.flip(-1).to(x.dtype)
    need_w, need_b, need_i = (ctx.needs_input_grad.get(n) for n in ("weight", "bias", "init"))
    if need_w or need_i:
        xp = _padded_input(x.float(), None if init is None else init.float(), w)  # [B, D, W-1+L]
        l = x.shape[-1]
        if need_w:
            cols = []
            for k in range(w):
                xs = xp[..., k:k + l]
                if seg is not None:
                    xs = torch.where(_seg_shift(seg, w - 1 - k) == seg, xs, 0.0)
                cols.append((g * xs).sum((0, 2)))
            out["weight"] = torch.stack(cols, -1).to(weight.dtype)
        if need_i:  # init column c is xp[c]: read by out[t] through tap k = c - t, for 0 <= t <= c
            gi = torch.zeros(init.shape, dtype=torch.float32, device=init.device)
            wf = weight.float()
            for c in range(w - 1):
                for t in range(min(c + 1, l)):
                    gi[..., c] += g[..., t] * wf[:, c - t]
            out["init"] = gi.to(init.dtype)
    if need_b:
        out["bias"] = g.sum((0, 2))[:, None].to(bias.dtype)
    return out


def _pre_f32(ctx):
    """The pre-activation in float32 (the kernel on the float32-widened inputs: nothing rounded to bf16)."""
    x, init = ctx.x.float(), None if ctx.init is None else ctx.init.float()
    return causal_conv1d_fwd(x, x if ctx.x_halo is not None else None, ctx.weight.float(),
                             None if ctx.bias is None else ctx.bias.float(), ctx.seg, ctx.seg_halo, init, False)


def _padded_input(xf, init, w):
    pad = init if init is not None else xf.new_zeros(xf.shape[0], xf.shape[1], w - 1)
    return torch.cat([pad, xf], -1)


def _seg_shift(seg, s):
    """``seg`` shifted right by s along L: the segment of the token s before (before the start: the first
    token's, since the padded input there is the state, which belongs to the first segment)."""
    if s == 0:
        return seg
    first = seg[..., :1].expand(*seg.shape[:-1], s)
    return torch.cat([first, seg[..., :-s]], -1)


# ----------------------------------------------------------------------------------------- public op
def _is_t(v):
    return isinstance(v, torch.Tensor)


def _shape(v):
    return tuple(v.shape) if _is_t(v) else type(v).__name__


def _check_activation(op, activation):
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"{op}: activation must be None, 'silu' or 'swish', got {activation!r}")


def check_cu_seqlens(op: str, cu, l: int, device) -> list:
    """``cu_seqlens`` as a list after the checks every packed (varlen) op shares: a 1-D int32/int64 tensor of
    ``N + 1 >= 2`` offsets on ``device``, starting at 0, never decreasing, ending at the token count ``l``.

    Raises:
        ArgumentError: naming ``op`` and the rule broken. DeviceError: on another device.
    """
    if not _is_t(cu) or cu.dim() != 1 or cu.dtype not in _INT or cu.numel() < 2:
        raise ArgumentError(f"{op}: cu_seqlens must be a 1-D int32/int64 tensor [N + 1] (N >= 1 sequences), got "
                            f"{_shape(cu)} {getattr(cu, 'dtype', '')}")
    if cu.device != device:
        raise DeviceError(f"{op}: cu_seqlens is on {cu.device} but x is on {device}")
    c = cu.tolist()
    if c[0] != 0 or c[-1] != l or any(b < a for a, b in zip(c, c[1:])):
        raise ArgumentError(f"{op}: cu_seqlens must start at 0, never decrease and end at the token count L = {l}, "
                            f"got {c[:8]}{' ...' if len(c) > 8 else ''} (ends at {c[-1]})")
    return c


def _check_public(op, x, weight, bias, activation, seq_idx, cu_seqlens, initial_states, return_final_states,
                  final_states_out):
    if not _is_t(x) or x.dim() != 3:
        raise ArgumentError(f"{op}: x must be a 3-D tensor [B, D, L] (channels first), got {_shape(x)}")
    if x.dtype not in _SUPPORTED:
        raise DTypeError(f"{op}: x dtype {x.dtype} is not supported: use bfloat16, float16 or float32")
    b, d, l = x.shape
    if not _is_t(weight) or weight.dim() != 2 or weight.shape[0] != d:
        raise ArgumentError(f"{op}: weight must be [D, W] = [{d}, W] (depthwise, D = x.shape[1]), got {_shape(weight)}")
    w = weight.shape[1]
    if not 2 <= w <= MAX_WIDTH:
        raise ArgumentError(f"{op}: weight width W = {w} must be in [2, {MAX_WIDTH}] (Dao's kernels: 2..4)")
    for name, t in (("weight", weight), ("bias", bias), ("initial_states", initial_states),
                    ("final_states_out", final_states_out)):
        if t is None:
            continue
        if not _is_t(t):
            raise ArgumentError(f"{op}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype not in _SUPPORTED:
            raise DTypeError(f"{op}: {name} dtype {t.dtype} is not supported: use bfloat16, float16 or float32")
        if t.device != x.device:
            raise DeviceError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    if bias is not None and tuple(bias.shape) != (d,):
        raise ArgumentError(f"{op}: bias must be [D] = [{d}], got {tuple(bias.shape)}")
    _check_activation(op, activation)
    if not isinstance(return_final_states, bool):
        raise ArgumentError(f"{op}: return_final_states must be a bool, got {return_final_states!r}")
    if seq_idx is not None and cu_seqlens is not None:
        raise ArgumentError(f"{op}: pass seq_idx or cu_seqlens, not both")
    n = b
    if seq_idx is not None:
        if not _is_t(seq_idx) or seq_idx.dtype not in _INT or tuple(seq_idx.shape) != (b, l):
            raise ArgumentError(f"{op}: seq_idx must be an int32/int64 tensor [B, L] = [{b}, {l}], got "
                                f"{_shape(seq_idx)} {getattr(seq_idx, 'dtype', '')}")
        if seq_idx.device != x.device:
            raise DeviceError(f"{op}: seq_idx is on {seq_idx.device} but x is on {x.device}")
        if initial_states is not None or return_final_states or final_states_out is not None:
            raise ArgumentError(f"{op}: initial_states / return_final_states with seq_idx are not defined (Dao's op "
                                f"refuses them too): pass cu_seqlens for per-sequence states")
        if seq_idx.numel() and (int(seq_idx.min()) < -(2**31) or int(seq_idx.max()) >= 2**31):
            raise ArgumentError(f"{op}: seq_idx values must fit int32")
    if cu_seqlens is not None:
        if b != 1:
            raise ArgumentError(f"{op}: with cu_seqlens, x holds the packed tokens in one row: B must be 1, "
                                f"got B = {b}")
        n = len(check_cu_seqlens(op, cu_seqlens, l, x.device)) - 1
    if initial_states is not None and tuple(initial_states.shape) != (n, d, w - 1):
        what = "N sequences" if cu_seqlens is not None else "B"
        raise ArgumentError(f"{op}: initial_states must be [{what}, D, W-1] = [{n}, {d}, {w - 1}], got "
                            f"{tuple(initial_states.shape)}")
    if final_states_out is not None:
        if tuple(final_states_out.shape) != (n, d, w - 1):
            raise ArgumentError(f"{op}: final_states_out must be [{n}, {d}, {w - 1}], "
                                f"got {tuple(final_states_out.shape)}")
        if not return_final_states:
            raise ArgumentError(f"{op}: final_states_out is written only with return_final_states=True")
    return n


def _widen(t):
    return t.float() if t is not None and t.dtype == torch.float16 else t


def _run_kernel(x, weight, bias, seg, init, silu):
    """The kernel op on ``x [B, D, L]`` (halos attached when L > 128)."""
    l = x.shape[-1]
    halo = x if l > HALO else None
    seg_halo = seg if halo is not None and seg is not None else None
    b = None if bias is None else bias.reshape(-1, 1).contiguous()
    init = None if init is None else init.contiguous()
    return torch.ops.tpukernels.causal_conv1d_fwd(x, halo, weight, b, seg, seg_halo, init, silu)


def _final_states(xk, init, cu, w):
    """``[N, D, W-1]``: the last W-1 inputs of each sequence (the state in front when it is shorter)."""
    if cu is None:
        return _padded_input(xk, init, w)[..., -(w - 1):]
    d = xk.shape[1]
    cu = cu.long()
    n = cu.numel() - 1
    pad = init if init is not None else xk.new_zeros(n, d, w - 1)
    flat = torch.cat([pad.permute(1, 0, 2).reshape(d, -1), xk[0]], -1)  # [D, N*(W-1) + L]
    j = torch.arange(w - 1, device=xk.device)
    start, end = cu[:-1, None], cu[1:, None]
    pos = end - (w - 1) + j  # token index of each final column
    from_state = pos < start
    src = torch.where(from_state, torch.arange(n, device=xk.device)[:, None] * (w - 1) + (w - 1) - (start - pos),
                      n * (w - 1) + pos.clamp(min=0))
    return flat[:, src.reshape(-1)].reshape(d, n, w - 1).permute(1, 0, 2)


def _head_fixup(out, xk, weight, bias, init, cu, w, silu):
    """Recompute the first W-1 outputs of each sequence from its state (cu_seqlens + initial_states)."""
    d = xk.shape[1]
    cu = cu.long()
    n = cu.numel() - 1
    start, end = cu[:-1, None], cu[1:, None]
    p = torch.arange(w - 1, device=xk.device)
    t = start + p  # [N, W-1] target tokens
    valid = t < end
    flat = torch.cat([init.float().permute(1, 0, 2).reshape(d, -1), xk[0].float()], -1)
    k = torch.arange(w, device=xk.device)
    src_pos = t[..., None] - (w - 1) + k  # [N, W-1, W]
    in_state = src_pos < start[..., None]
    seq = torch.arange(n, device=xk.device)[:, None, None]
    src = torch.where(in_state, seq * (w - 1) + (w - 1) - (start[..., None] - src_pos),
                      n * (w - 1) + src_pos.clamp(min=0))
    src = torch.where(valid[..., None], src, 0)
    win = flat[:, src]  # [D, N, W-1, W]
    pre = (win * weight.float()[:, None, None, :]).sum(-1)
    if bias is not None:
        pre = pre + bias.float()[:, None, None]
    val = pre * torch.sigmoid(pre) if silu else pre
    tt = t[valid]
    out = out.clone()
    out[0][:, tt] = val[:, valid].to(out.dtype)
    return out


def _causal_conv1d_impl(x, weight, bias=None, seq_idx=None, cu_seqlens=None, initial_states=None,
                        activation="silu"):
    op = "tpukernels.causal_conv1d"
    _check_public(op, x, weight, bias, activation, seq_idx, cu_seqlens, initial_states, False, None)
    w = weight.shape[1]
    silu = activation in ("silu", "swish")
    xk = _widen(x)
    wk, bk = _widen(weight), _widen(bias)
    init = _widen(initial_states)  # in its own dtype: a float32 state with bf16 x is not rounded to bf16
    seg = None
    if seq_idx is not None:
        seg = seq_idx.to(torch.int32).reshape(x.shape[0], 1, -1).contiguous()
    elif cu_seqlens is not None:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        seg = torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int32, device=x.device), lens,
                                      output_size=x.shape[-1]).reshape(1, 1, -1)
    if x.shape[-1] == 0:
        out = torch.empty_like(x)
    else:
        out = _run_kernel(xk.contiguous(), wk.contiguous(), bk, seg, init if cu_seqlens is None else None, silu)
        if cu_seqlens is not None and init is not None:
            if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, init)):
                raise ArgumentError(f"{op}: backward is not supported with cu_seqlens and initial_states together "
                                    f"(the per-sequence state fix-up is forward only)")
            out = _head_fixup(out, xk, wk, bk, init, cu_seqlens, w, silu)
    final = (_final_states(xk, None if init is None else init.to(xk.dtype), cu_seqlens, w) if seq_idx is None
             else x.new_zeros(0))  # final states in x's dtype, as Dao's
    return out.to(x.dtype), final.to(x.dtype)


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("causal_conv1d(Tensor x, Tensor weight, Tensor? bias=None, Tensor? seq_idx=None, Tensor? cu_seqlens=None, "
            "Tensor? initial_states=None, str? activation='silu') -> (Tensor, Tensor)")
_LIB.impl("causal_conv1d", _causal_conv1d_impl, "CompositeImplicitAutograd")


def causal_conv1d_fn(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, activation: Optional[str] = "silu",
    seq_idx: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None, return_final_states: bool = False,
    final_states_out: Optional[torch.Tensor] = None,
):
    """Causal depthwise conv1d with Dao-AILab causal-conv1d's ``causal_conv1d_fn`` semantics (module docstring).

    Args:
        x: ``[B, D, L]`` channels-first, bf16/f16/f32 (any strides; copied to contiguous).
        weight: ``[D, W]`` depthwise taps, ``2 <= W <= 8``; ``weight[:, -1]`` multiplies the current token.
        bias: ``[D]`` or None.
        activation: None (identity), ``"silu"`` or ``"swish"`` (default ``"silu"``; Dao's default is None).
        seq_idx: int ``[B, L]``: taps never cross a change of id (packed sequences); no states with it.
        cu_seqlens: int ``[N + 1]`` offsets of N packed sequences in ``x [1, D, L]``: 0, increasing, ending at L.
        initial_states: the W-1 inputs before the first token: ``[B, D, W-1]``, or ``[N, D, W-1]`` per sequence
            with cu_seqlens. Never modified.
        return_final_states: also return ``final_states`` ``[B or N, D, W-1]`` (x's dtype): the last W-1 inputs
            of each row / sequence (the initial state, or zeros, in front when it is shorter).
        final_states_out: optional ``[B or N, D, W-1]`` tensor the final states are copied into (and returned).

    Returns:
        ``out`` ``[B, D, L]`` in x's dtype (float32 arithmetic, rounded once), or ``(out, final_states)``.
        Differentiable in x, weight, bias and initial_states (not with cu_seqlens and initial_states together).

    Raises:
        ArgumentError: wrong ranks / shapes (each argument named with the shape it must have), W outside
            [2, 8], unknown activation, seq_idx together with states or cu_seqlens, cu_seqlens not starting at 0,
            decreasing or not ending at L, B != 1 with cu_seqlens. DTypeError: float dtypes other than
            bf16/f16/f32, non-integer seq_idx / cu_seqlens. DeviceError: arguments on different devices.
    """
    op = "tpukernels.causal_conv1d_fn"
    _check_public(op, x, weight, bias, activation, seq_idx, cu_seqlens, initial_states, return_final_states,
                  final_states_out)
    out, final = torch.ops.tpukernels.causal_conv1d(x, weight, bias, seq_idx, cu_seqlens, initial_states, activation)
    if not return_final_states:
        return out
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


# ----------------------------------------------------------------------------------------- decode
def causal_conv1d_update(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None, cache_seqlens: Optional[torch.Tensor] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decode step (or T tokens) of the causal conv, Dao's ``causal_conv1d_update``: ``conv_state`` is
    updated **in place** (after every check and the kernel have run: a failing call leaves it unchanged).

    Args:
        x: ``[B, D]`` or ``[B, D, T]`` new tokens, bf16/f16/f32.
        conv_state: ``[B_s, D, S]``, ``S >= W - 1``, the last S inputs of each row (oldest first); same dtype as
            x. ``B_s = B``, or any size with ``conv_state_indices``.
        weight: ``[D, W]``. bias: ``[D]`` or None. activation: None (default, as Dao's), ``"silu"``, ``"swish"``.
        cache_seqlens: int ``[B]`` or None: conv_state is a circular buffer, the new tokens written at
            ``cache_seqlens % S`` onward and the window read ending just before it (Dao's semantics).
        conv_state_indices: int ``[B]`` or None: row b uses ``conv_state[conv_state_indices[b]]`` (continuous
            batching); values in ``[0, B_s)``, distinct.

    Returns:
        ``out`` shaped like x, in x's dtype.

    Raises:
        ArgumentError: shapes (named with the shape required), S < W - 1, indices out of range or repeated,
            negative cache_seqlens, unknown activation. DTypeError: float dtypes, conv_state dtype != x dtype,
            non-integer indices. DeviceError: arguments on different devices.
    """
    op = "tpukernels.causal_conv1d_update"
    if not _is_t(x) or x.dim() not in (2, 3):
        raise ArgumentError(f"{op}: x must be [B, D] or [B, D, T], got {_shape(x)}")
    squeeze = x.dim() == 2
    x3 = x[..., None] if squeeze else x
    b, d, t = x3.shape
    _check_public(op, x3, weight, bias, activation, None, None, None, False, None)
    w = weight.shape[1]
    if not _is_t(conv_state) or conv_state.dim() != 3 or conv_state.shape[1] != d or conv_state.shape[2] < w - 1:
        raise ArgumentError(f"{op}: conv_state must be [B, D, S] with D = {d} and S >= W-1 = {w - 1}, got "
                            f"{_shape(conv_state)}")
    if conv_state.dtype != x.dtype:
        raise DTypeError(f"{op}: conv_state dtype {conv_state.dtype} must equal x's {x.dtype}")
    if conv_state.device != x.device:
        raise DeviceError(f"{op}: conv_state is on {conv_state.device} but x is on {x.device}")
    s_len = conv_state.shape[2]
    for name, v in (("cache_seqlens", cache_seqlens), ("conv_state_indices", conv_state_indices)):
        if v is None:
            continue
        if not _is_t(v) or v.dtype not in _INT or tuple(v.shape) != (b,):
            raise ArgumentError(f"{op}: {name} must be an int32/int64 tensor [B] = [{b}], got {_shape(v)} "
                                f"{getattr(v, 'dtype', '')}")
        if v.device != x.device:
            raise DeviceError(f"{op}: {name} is on {v.device} but x is on {x.device}")
    if conv_state_indices is not None:
        idx = conv_state_indices.long()
        if b and (int(idx.min()) < 0 or int(idx.max()) >= conv_state.shape[0]):
            raise ArgumentError(f"{op}: conv_state_indices must be in [0, {conv_state.shape[0]}) "
                                f"(conv_state.shape[0]), got values in [{int(idx.min())}, {int(idx.max())}]")
        if idx.unique().numel() != b:
            raise ArgumentError(f"{op}: conv_state_indices must be distinct (two rows cannot update one state)")
    else:
        if conv_state.shape[0] != b:
            raise ArgumentError(f"{op}: conv_state must have B = {b} rows (x.shape[0]) without conv_state_indices, "
                                f"got {conv_state.shape[0]}")
        idx = torch.arange(b, device=x.device)
    if cache_seqlens is not None and b and int(cache_seqlens.min()) < 0:
        raise ArgumentError(f"{op}: cache_seqlens must be >= 0, got min {int(cache_seqlens.min())}")
    state = conv_state[idx]  # [B, D, S] (a copy)
    if cache_seqlens is None:
        window = state[..., s_len - (w - 1):]
    else:
        cs = cache_seqlens.long()[:, None]
        widx = torch.remainder(cs + torch.arange(-(w - 1), 0, device=x.device), s_len)
        window = state.gather(2, widx[:, None, :].expand(b, d, w - 1))
    silu = activation in ("silu", "swish")
    xk = _widen(x3).contiguous()
    out = _run_kernel(xk, _widen(weight).contiguous(), _widen(bias), None, window.to(xk.dtype).contiguous(), silu)
    # the new state (computed before anything is written)
    if cache_seqlens is None:
        new = torch.cat([state, x3], -1)[..., -s_len:]
    else:
        cidx = torch.remainder(cache_seqlens.long()[:, None] + torch.arange(t, device=x.device), s_len)
        new = state.scatter(2, cidx[:, None, :].expand(b, d, t)[..., -s_len:], x3[..., -s_len:])
    with torch.no_grad():
        conv_state[idx] = new
    out = out.to(x.dtype)
    return out[..., 0] if squeeze else out


# ----------------------------------------------------------------------------------------- float64 references
def causal_conv1d_reference(x, weight, bias=None, activation="silu", seq_idx=None, cu_seqlens=None,
                            initial_states=None):
    """float64 ``(out, final_states)`` of the given values, written as the naive loop over taps (module
    docstring): per row, or per packed sequence (cu_seqlens / runs of seq_idx) with its own state."""
    xd, wd = x.double(), weight.double()
    b, d, l = x.shape
    w = wd.shape[1]
    bd = None if bias is None else bias.double()

    def one(xs, init):  # xs [D, Ls], init [D, W-1] -> (out, final)
        xp = torch.cat([init, xs], -1)
        out = sum(wd[:, k:k + 1] * xp[:, k:k + xs.shape[-1]] for k in range(w))
        if bd is not None:
            out = out + bd[:, None]
        if activation in ("silu", "swish"):
            out = out * torch.sigmoid(out)
        return out, xp[:, -(w - 1):]

    out = torch.zeros_like(xd)
    finals = []
    if cu_seqlens is not None:
        c = [int(v) for v in cu_seqlens]
        for n in range(len(c) - 1):
            init = initial_states[n].double() if initial_states is not None else xd.new_zeros(d, w - 1)
            o, f = one(xd[0, :, c[n]:c[n + 1]], init)
            out[0, :, c[n]:c[n + 1]] = o
            finals.append(f)
        return out, torch.stack(finals)
    for i in range(b):
        if seq_idx is not None:
            ids = seq_idx[i].tolist()
            start = 0
            for t in range(1, l + 1):
                if t == l or ids[t] != ids[t - 1]:
                    out[i, :, start:t] = one(xd[i, :, start:t], xd.new_zeros(d, w - 1))[0]
                    start = t
            continue
        init = initial_states[i].double() if initial_states is not None else xd.new_zeros(d, w - 1)
        o, f = one(xd[i], init)
        out[i] = o
        finals.append(f)
    return out, (torch.stack(finals) if finals else None)


def causal_conv1d_update_reference(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None):
    """float64 ``(out, new_state)`` of one update (Dao's ``causal_conv1d_update_ref``, in float64, not in place)."""
    squeeze = x.dim() == 2
    x3 = (x[..., None] if squeeze else x).double()
    st = conv_state.double().clone()
    b, d, t = x3.shape
    w, s_len = weight.shape[1], st.shape[-1]
    if cache_seqlens is None:
        xn = torch.cat([st, x3], -1)
        st = xn[..., -s_len:]
    else:
        widx = torch.remainder(torch.arange(-(w - 1), 0)[None] + cache_seqlens.long()[:, None], s_len)
        xn = torch.cat([st.gather(2, widx[:, None].expand(-1, d, -1)), x3], -1)
        cidx = torch.remainder(torch.arange(t)[None] + cache_seqlens.long()[:, None], s_len)
        st = st.scatter(2, cidx[:, None].expand(-1, d, -1), x3)
    out = torch.nn.functional.conv1d(xn, weight.double()[:, None], None if bias is None else bias.double(),
                                     groups=d)[..., -t:]
    if activation in ("silu", "swish"):
        out = out * torch.sigmoid(out)
    return (out[..., 0] if squeeze else out), st


#: ``(args, kwargs)`` of :func:`causal_conv1d_fwd` at Qwen3-Next-80B-A3B's conv (q, k, v: 8192 channels, W = 4):
#: prefill 4096 tokens (one sequence, and packed with segment ids) and decode of 256 rows. Compiled by the aot
#: tests; not ``STANDARD_CASES`` yet (no tuning tables are shipped for this kernel).
STANDARD_SHAPES = [
    (("1x8192x4096:bf16", "1x8192x4096:bf16", "8192x4:bf16", None, None, None, None), {"silu": True}),
    (("1x8192x4096:bf16", "1x8192x4096:bf16", "8192x4:bf16", "8192x1:bf16", "1x1x4096:i32", "1x1x4096:i32", None),
     {"silu": True}),
    (("256x8192x1:bf16", None, "8192x4:bf16", None, None, None, "256x8192x3:bf16"), {"silu": True}),
]
