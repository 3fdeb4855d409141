"""Context-parallel (ring) attention: the sequence split over one mesh axis, forward and backward, built on
the flash attention kernels of :mod:`tpukernels.library.attention` (``fa_forward``, ``fa_backward_dq``,
``fa_backward_dkv``), in JAX (``jax.shard_map`` + ``lax.ppermute``).

Public API::

    ring_attention(q, k, v, mesh, axis_name, *, causal=False, sm_scale=None, load_balance=True, interpret=None)
    zigzag_permute(x, n, axis=2) / zigzag_unpermute(x, n, axis=2)     # the load-balanced sequence order

Shapes (global arrays, the sequence axis sharded over ``axis_name``, ``n = mesh.shape[axis_name]``):
``q [B, Hq, S, D]``, ``k [B, Hkv, S, D]``, ``v [B, Hkv, S, Dv]`` (bf16 or f32, one dtype, ``Hq`` a multiple of
``Hkv``: GQA), ``S`` divisible by ``n`` (by ``2 n`` with ``causal`` and ``load_balance``). Result: ``out
[B, Hq, S, Dv]`` in q's dtype, sharded like ``q``; differentiable (``jax.custom_vjp``). It equals single-device
flash attention (``fa_forward(q, k, v, causal=...)``) of the same global arrays, the sequence in the order
given (with ``load_balance``: the zigzag order, see below), up to float32 rounding of the merges.

Why a ring (not all-gather of K/V): each device keeps one K/V shard and passes it on (``lax.ppermute`` to the
next device) while it computes attention against the shard it holds, so the memory per device stays
``O(S / n)`` and the transfer of step ``s + 1`` can overlap the compute of step ``s``. An all-gather needs the
whole ``[S, D]`` K/V per device (``n`` times the memory) and its transfer is not hidden behind compute
unless it is chunked — which is the ring again. (Liu et al., "Ring Attention with Blockwise Transformers",
arXiv:2310.01889; the zigzag balancing as in ring-flash-attention and Llama 3's context parallelism.)

Algorithm (device ``i`` of ``n``, holding the query shard ``q_i`` and, at step ``s``, the K/V shard of device
``j = (i - s) mod n``): ``(o_s, lse_s) = fa_forward(q_i, k_j, v_j)`` with the mask that the global positions
imply, merged into the running result with logsumexp weights (flash attention's own combine)::

    lse = logaddexp(lse_a, lse_b)      out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

(a row that sees nothing keeps ``lse = -inf`` and ``out = 0``). The backward walks the same ring: with the
final ``lse`` and ``di = rowsum(dout * out)`` (global, so each partial ``P = exp(s - lse)`` is the global
softmax), ``fa_backward_dq`` / ``fa_backward_dkv`` give each step's share of ``dq`` (summed locally) and of
``dk, dv`` (an f32 accumulator that travels around the ring with its K/V shard and is sent home by one last
``ppermute``). Steps are ``n`` kernel calls and ``n - 1`` K/V transfers forward, ``n`` calls of each
backward kernel and ``n`` transfers of ``(k, v, dk, dv)`` backward.

Causal load balance. With the plain contiguous split, device ``i`` has ``i + 1`` non-empty steps (the last
device works ``n`` times as long as the first). With ``load_balance=True`` (causal only) the sequence is cut
into ``2 n`` chunks and device ``i`` holds chunks ``i`` and ``2 n - 1 - i`` (:func:`zigzag_permute`; the caller
permutes tokens and positions once, e.g. in the data loader, and un-permutes with :func:`zigzag_unpermute`).
Then step 0 is the local causal block (``q`` first half vs ``k`` first half causal, ``q`` second half vs all of
``k`` causal with bottom-right alignment), and every later step is exactly half a block: all of ``q`` against
the first K/V half when the source device ``j < i``, else the second ``q`` half against all of K/V — the
same work on every device at every step (chosen with ``lax.cond`` on ``axis_index``; one branch runs).

Overlap model (per step, per device; ``c = S / n`` tokens per shard, ``Hkv`` kv heads, bf16): a step moves
``2 B Hkv c D * 2`` bytes (K and V) over one ICI link and computes ``4 B Hq c^2 D`` FLOPs (the half-block
steps of the balanced causal case: ``2 B Hq c^2 D``). The transfer hides behind the compute when
``bytes / link_bw <= flops / mxu_flops``, i.e. ``c >= (Hkv / Hq) * mxu_flops / link_bw`` (full blocks;
twice that for half blocks). With v5e's 197 TFLOP/s bf16 and ~45 GB/s per ICI link direction (a model
figure; 4 links per chip), GQA ``Hq / Hkv = 4``: ``c >= ~1.1 k`` tokens per shard (``~2.2 k`` for the
balanced causal half steps); without GQA 4x that. The backward moves twice the bytes (``dk, dv`` travel too,
in f32: ``2 + 4`` bytes per element pair) for ~2.5x the FLOPs, so the same ``c`` suffices. This model is
not measured: XLA schedules ``ppermute`` asynchronously (start / done around the kernel of the step), and
whether it overlaps on a real slice is not checked here (no TPU).

Errors (typed, before any kernel runs): :class:`~tpukernels.errors.ArgumentError` for a missing mesh axis,
ranks, shapes not divisible by the ring (``S % n``, ``S % 2 n`` balanced), ``load_balance`` without
``causal`` is ignored (nothing to balance). The attention arguments themselves are checked by the kernels.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

from ..errors import ArgumentError
from .sharding import process_group

__all__ = ["ring_attention", "ring_attention_torch", "zigzag_permute", "zigzag_unpermute", "TorchRingOps"]


# ----------------------------------------------------------------------------------------------- zigzag order
def _zigzag_order(n: int):
    """Chunk order of the load-balanced layout: device i holds chunks i and 2n-1-i (in that order)."""
    return [c for i in range(n) for c in (i, 2 * n - 1 - i)]


def zigzag_permute(x, n: int, axis: int = 2):
    """``x`` with its sequence ``axis`` (length ``L``, divisible by ``2 n``) cut into ``2 n`` chunks and
    reordered so that a contiguous split into ``n`` shards gives device ``i`` chunks ``i`` and ``2 n - 1 - i``.
    Works on jax and numpy arrays (and torch tensors: ``torch.cat``).

    Raises:
        ArgumentError: ``L`` not divisible by ``2 n``.
    """
    return _reorder(x, n, axis, _zigzag_order(n))


def zigzag_unpermute(x, n: int, axis: int = 2):
    """Inverse of :func:`zigzag_permute`."""
    order = _zigzag_order(n)
    inv = [order.index(c) for c in range(2 * n)]
    return _reorder(x, n, axis, inv)


def _reorder(x, n: int, axis: int, order):
    L = x.shape[axis]
    if n < 1 or L % (2 * n):
        raise ArgumentError(f"zigzag: sequence length {L} (axis {axis}) must be divisible by 2 * n = {2 * n}")
    c = L // (2 * n)
    idx = [slice(None)] * x.ndim
    parts = []
    for k in order:
        idx[axis] = slice(k * c, (k + 1) * c)
        parts.append(x[tuple(idx)])
    if type(x).__module__.startswith("torch"):
        import torch

        return torch.cat(parts, dim=axis)
    import jax.numpy as jnp

    return jnp.concatenate(parts, axis=axis)


# ----------------------------------------------------------------------------------------------- kernels (jax)
def kernel_mode(mesh, interpret: Optional[str]) -> str:
    """The kernels' mode on ``mesh``: ``interpret`` if given, Mosaic on TPU devices, else the process's
    interpret mode."""
    if interpret is not None:
        return interpret
    if all(getattr(d, "platform", "") == "tpu" for d in mesh.devices.flat):
        return "mosaic"
    from ..dsl.modes import current_interpret_mode

    return current_interpret_mode()


def call_kernel(kernel, mode: str, chip, *args, config=None, **kw):
    """One library kernel on jax values (tracers inside ``shard_map``), lowered for ``mode`` at ``config``
    (None: the tuning table / heuristic a call gets) (this package's internal API: the collective matmuls use
    it too)."""
    from ..lowering import lower, specs_from_values

    values = kernel.bind(args, kw)
    specs, statics = specs_from_values(kernel, values)
    arrays = [v for p, v, s in zip([p for p in kernel.params if p.kind != "static"],
                                   [v for p, v in zip(kernel.params, values) if p.kind != "static"], specs)
              if s is not None]
    low = lower(kernel, specs, statics, config, mode=mode, chip=chip)
    outs = low.fn(*arrays)
    return outs if low.multiple_outputs else outs[0]


def _kernels():
    from ..library import attention as A

    return A.fa_forward, A.fa_backward_dq, A.fa_backward_dkv


class _JaxOps:
    """The ring's array, control and communication operations on jax values inside ``shard_map``."""

    def __init__(self, axis_name: str, n: int, mode: str, chip):
        import jax
        import jax.numpy as jnp

        self.jax, self.np, self.axis, self.mode, self.chip = jax, jnp, axis_name, mode, chip
        self.perm = [(d, (d + 1) % n) for d in range(n)]

    def kernel(self, kern, *args, **kw):
        return call_kernel(kern, self.mode, self.chip, *args, **kw)

    def cat(self, xs, axis):
        return self.np.concatenate(xs, axis)

    def zeros(self, shape):
        return self.np.zeros(shape, self.np.float32)

    def neg_inf(self, shape):
        return self.np.full(shape, -self.np.inf, self.np.float32)

    def f32(self, x):
        return x.astype(self.np.float32)

    def cast(self, x, like):
        return x.astype(like.dtype)

    def index(self):
        return self.jax.lax.axis_index(self.axis)

    def cond(self, pred, f, g):
        return self.jax.lax.cond(pred, f, g)

    def shift(self, xs: tuple) -> tuple:
        """Every device's ``xs`` to the next device of the ring."""
        return self.jax.lax.ppermute(xs, self.axis, self.perm)

    def merge(self, o_a, l_a, o_b, l_b):
        return _merge(self.np, o_a, l_a, o_b, l_b)

    def di(self, do, out):
        """``rowsum(do * out)`` as ``[B, H, 1, S]`` f32."""
        return self.np.swapaxes(self.np.sum(self.f32(do) * self.f32(out), -1, keepdims=True), -1, -2)


class TorchRingOps:
    """:class:`_JaxOps`' operations on torch tensors of one rank of a ``torch.distributed`` group: the kernels run
    as their torch ops, ``cond`` is a Python branch (the rank is known), ``shift`` is a batched isend / irecv to
    the next / from the previous rank."""

    def __init__(self, group, n: int):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.group, self.n = torch, dist, group, n
        self.rank = dist.get_rank(group)
        self.right = dist.get_global_rank(group, (self.rank + 1) % n)
        self.left = dist.get_global_rank(group, (self.rank - 1) % n)

    def kernel(self, kern, *args, **kw):
        return kern(*args, **kw)

    def cat(self, xs, axis):
        return self.torch.cat(xs, axis)

    def zeros(self, shape):
        return self.torch.zeros(shape, dtype=self.torch.float32)

    def neg_inf(self, shape):
        return self.torch.full(shape, -math.inf, dtype=self.torch.float32)

    def f32(self, x):
        return x.float()

    def cast(self, x, like):
        return x.to(like.dtype)

    def index(self):
        return self.rank

    def cond(self, pred, f, g):
        return f() if pred else g()

    def start_shift(self, xs: tuple):
        """Start sending each of ``xs`` right and receiving its twin from the left: ``(receive buffers, pending)``;
        ``pending`` (for :meth:`wait`) also holds the buffers being sent until the transfers are done."""
        dist = self.dist
        sent = tuple(x.contiguous() for x in xs)  # contiguous buffers (an input may be a transposed view)
        outs = tuple(self.torch.empty_like(x) for x in sent)
        ops = [dist.P2POp(dist.isend, x, self.right, self.group) for x in sent]
        ops += [dist.P2POp(dist.irecv, o, self.left, self.group) for o in outs]
        return outs, (dist.batch_isend_irecv(ops), sent)

    @staticmethod
    def wait(pending) -> None:
        for req in pending[0]:
            req.wait()

    def shift(self, xs: tuple) -> tuple:
        outs, pending = self.start_shift(xs)
        self.wait(pending)
        return outs

    def merge(self, o_a, l_a, o_b, l_b):
        return _merge(self.torch, o_a, l_a, o_b, l_b)

    def di(self, do, out):
        return (do.float() * out.float()).sum(-1, keepdim=True).transpose(-1, -2)


def _merge(xp, o_a, l_a, o_b, l_b):
    """logsumexp merge of two partial attentions: ``o [.., S, Dv]`` f32, ``l [.., 1, S]`` f32 (-inf: empty);
    ``xp``: jax.numpy or torch."""
    m = xp.maximum(l_a, l_b)
    m = xp.where(xp.isneginf(m), xp.zeros_like(m), m)
    wa, wb = xp.exp(l_a - m), xp.exp(l_b - m)
    tot = wa + wb
    lse = m + xp.log(tot)
    pos = tot > 0
    inv = xp.where(pos, 1.0 / xp.where(pos, tot, xp.ones_like(tot)), xp.zeros_like(tot))
    col = lambda w: (w * inv).swapaxes(-1, -2)  # noqa: E731  [.., 1, S] -> [.., S, 1]
    return o_a * col(wa) + o_b * col(wb), lse


def _halves(x):
    h = x.shape[2] // 2
    return x[:, :, :h], x[:, :, h:]


def _row_halves(x):  # lse / di: [B, H, 1, S]
    h = x.shape[3] // 2
    return x[..., :h], x[..., h:]


# ----------------------------------------------------------------------------------------------- the ring
class _Ring:
    """The ring algorithm (module docstring) over ``ops``: :class:`_JaxOps` (shard_map) or
    :class:`TorchRingOps` (a torch.distributed group)."""

    def __init__(self, n, causal, balanced, sm_scale, ops):
        self.n, self.causal, self.balanced, self.sm_scale, self.ops = n, causal, balanced, sm_scale, ops

    def fa(self, q, k, v, causal=False, align="top_left"):
        fwd = _kernels()[0]
        o, lse = self.ops.kernel(fwd, q, k, v, causal=causal, causal_alignment=align, sm_scale=self.sm_scale)
        return self.ops.f32(o), lse

    def bwd(self, q, k, v, do, lse, di, causal=False, align="top_left"):
        _, dq_k, dkv_k = _kernels()
        kw = dict(causal=causal, causal_alignment=align, sm_scale=self.sm_scale)
        dq = self.ops.kernel(dq_k, q, k, v, do, lse, di, **kw)
        dk, dv = self.ops.kernel(dkv_k, q, k, v, do, lse, di, **kw)
        return self.ops.f32(dq), self.ops.f32(dk), self.ops.f32(dv)

    # ------------------------------------------------------------------ forward
    def local_block(self, q, k, v):
        """Step 0 (own K/V shard)."""
        if not self.causal:
            return self.fa(q, k, v)
        if not self.balanced:
            return self.fa(q, k, v, causal=True)
        (q1, q2), (k1, _), (v1, _) = _halves(q), _halves(k), _halves(v)
        o1, l1 = self.fa(q1, k1, v1, causal=True)
        o2, l2 = self.fa(q2, k, v, causal=True, align="bottom_right")
        return self.ops.cat([o1, o2], 2), self.ops.cat([l1, l2], 3)

    def remote_block(self, q, k, v, s):
        """Step ``s >= 1``: the K/V shard of device ``(i - s) mod n``."""
        ops = self.ops
        if not self.causal:
            return self.fa(q, k, v)
        i = ops.index()
        if not self.balanced:  # source j = i - s >= 0 iff s <= i: all visible; else nothing
            def empty():
                B, H, S, _ = q.shape
                return ops.zeros((B, H, S, v.shape[3])), ops.neg_inf((B, H, 1, S))

            return ops.cond(s <= i, lambda: self.fa(q, k, v), empty)
        (_, q2), (k1, _), (v1, _) = _halves(q), _halves(k), _halves(v)

        def lower_src():  # j < i: every query sees the first K/V chunk (chunk j), none the second
            return self.fa(q, k1, v1)

        def upper_src():  # j > i: only the second query chunk (2n-1-i) sees anything, and all of K/V
            o2, l2 = self.fa(q2, k, v)
            return ops.cat([ops.zeros(o2.shape), o2], 2), ops.cat([ops.neg_inf(l2.shape), l2], 3)

        return ops.cond(s <= i, lower_src, upper_src)

    def forward(self, q, k, v):
        o, lse = self.local_block(q, k, v)
        for s in range(1, self.n):
            k, v = self.ops.shift((k, v))
            o_s, l_s = self.remote_block(q, k, v, s)
            o, lse = self.ops.merge(o, lse, o_s, l_s)
        return self.ops.cast(o, q), lse

    # ------------------------------------------------------------------ backward
    def local_grads(self, q, k, v, do, lse, di):
        ops = self.ops
        if not self.causal:
            return self.bwd(q, k, v, do, lse, di)
        if not self.balanced:
            return self.bwd(q, k, v, do, lse, di, causal=True)
        (q1, q2), (k1, k2), (v1, v2) = _halves(q), _halves(k), _halves(v)
        (do1, do2), (l1, l2), (di1, di2) = _halves(do), _row_halves(lse), _row_halves(di)
        dq1, dk1, dv1 = self.bwd(q1, k1, v1, do1, l1, di1, causal=True)
        dq2, dk, dv = self.bwd(q2, k, v, do2, l2, di2, causal=True, align="bottom_right")
        pad = lambda a: ops.cat([a, ops.zeros(a.shape)], 2)  # noqa: E731  (first half only)
        return ops.cat([dq1, dq2], 2), dk + pad(dk1), dv + pad(dv1)

    def remote_grads(self, q, k, v, do, lse, di, s):
        ops = self.ops
        if not self.causal:
            return self.bwd(q, k, v, do, lse, di)
        i = ops.index()
        if not self.balanced:
            def none():
                return ops.zeros(q.shape), ops.zeros(k.shape), ops.zeros(v.shape)

            return ops.cond(s <= i, lambda: self.bwd(q, k, v, do, lse, di), none)
        (_, q2), (k1, _), (v1, _) = _halves(q), _halves(k), _halves(v)
        (_, do2), (_, l2), (_, di2) = _halves(do), _row_halves(lse), _row_halves(di)

        def lower_src():
            dq, dk1, dv1 = self.bwd(q, k1, v1, do, lse, di)
            return dq, ops.cat([dk1, ops.zeros(dk1.shape)], 2), ops.cat([dv1, ops.zeros(dv1.shape)], 2)

        def upper_src():
            dq2, dk, dv = self.bwd(q2, k, v, do2, l2, di2)
            return ops.cat([ops.zeros(dq2.shape), dq2], 2), dk, dv

        return ops.cond(s <= i, lower_src, upper_src)

    def backward(self, q, k, v, out, lse, do):
        ops = self.ops
        di = ops.di(do, out)
        dq, dk, dv = self.local_grads(q, k, v, do, lse, di)
        for s in range(1, self.n):
            k, v, dk, dv = ops.shift((k, v, dk, dv))
            dq_s, dk_s, dv_s = self.remote_grads(q, k, v, do, lse, di, s)
            dq, dk, dv = dq + dq_s, dk + dk_s, dv + dv_s
        if self.n > 1:  # the accumulators held now belong to device i + 1: send them home
            dk, dv = ops.shift((dk, dv))
        return ops.cast(dq, q), ops.cast(dk, k), ops.cast(dv, v)


@functools.lru_cache(maxsize=None)
def _ring_fn(n, axis_name, causal, balanced, sm_scale, mode, chip):
    import jax

    from ..chips import get_chip

    ring = _Ring(n, causal, balanced, sm_scale, _JaxOps(axis_name, n, mode, None if chip is None else get_chip(chip)))

    @jax.custom_vjp
    def f(q, k, v):
        return ring.forward(q, k, v)[0]

    def f_fwd(q, k, v):
        out, lse = ring.forward(q, k, v)
        return out, (q, k, v, out, lse)

    def f_bwd(res, do):
        return ring.backward(*res, do)

    f.defvjp(f_fwd, f_bwd)
    return f


def ring_attention(q, k, v, mesh, axis_name: str, *, causal: bool = False, sm_scale: Optional[float] = None,
                   load_balance: bool = True, interpret: Optional[str] = None, chip=None):
    """Attention over a sequence sharded along ``axis_name`` of ``mesh`` (module docstring: layout, algorithm,
    overlap model). Differentiable (``jax.grad`` / ``jax.vjp``); jit-able.

    Args:
        q: ``[B, Hq, S, D]``; k: ``[B, Hkv, S, D]``; v: ``[B, Hkv, S, Dv]`` jax arrays (bf16 / f32), global.
        mesh: a ``jax.sharding.Mesh``; the sequence axis is split over ``axis_name`` (other mesh axes replicate).
        causal: causal mask (top-left aligned, ``Sq == Skv``) over the *global* positions of the given order.
        sm_scale: logit scale (default ``1 / sqrt(D)``).
        load_balance: with ``causal``, the inputs are in :func:`zigzag_permute` order (and so is the output).
        interpret: ``"fast"`` / ``"tpu"`` Pallas interpret modes for cpu meshes (default: Mosaic on a TPU mesh,
            else the current :func:`tpukernels.interpret_mode`).
        chip: tuning-table chip for the kernels' configs (default: the one a call resolves).

    Returns:
        ``out [B, Hq, S, Dv]`` in q's dtype, sharded like ``q``.

    Raises:
        ArgumentError: ``axis_name`` not in the mesh, ranks other than 4, ``S`` of q and k differ, ``S`` not
            divisible by ``n`` (``2 n`` when balanced).
    """
    import jax
    from jax.sharding import PartitionSpec as P

    where = "tpukernels.distributed.ring_attention"
    if axis_name not in mesh.shape:
        raise ArgumentError(f"{where}: axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    for x, nm in ((q, "q"), (k, "k"), (v, "v")):
        if len(x.shape) != 4:
            raise ArgumentError(f"{where}: {nm} must be 4-D [B, H, S, D], got shape {tuple(x.shape)}")
    S = q.shape[2]
    if k.shape[2] != S or v.shape[2] != S:
        raise ArgumentError(f"{where}: q, k, v must share the sequence length (self-attention), got "
                            f"{q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    n = int(mesh.shape[axis_name])
    balanced = bool(causal and load_balance and n > 1)
    div = 2 * n if balanced else n
    if S % div:
        raise ArgumentError(f"{where}: sequence length {S} must be divisible by {div} "
                            f"({'2 x ' if balanced else ''}the {axis_name!r} axis size {n})")
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[3])
    f = _ring_fn(n, axis_name, bool(causal), balanced, scale, kernel_mode(mesh, interpret), chip)
    spec = P(None, None, axis_name, None)
    return jax.shard_map(f, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)


# ----------------------------------------------------------------------------------------------- torch
def _torch_ring_function():
    import torch

    class _RingFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, ring):
            out, lse = ring.forward(q.detach(), k.detach(), v.detach())
            ctx.ring = ring
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, do):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = ctx.ring.backward(q, k, v, out, lse, do.contiguous())
            return dq, dk, dv, None

    return _RingFn


def ring_attention_torch(q, k, v, group=None, *, causal: bool = False, sm_scale: Optional[float] = None,
                         load_balance: bool = True):
    """:func:`ring_attention` for torch tensors on the ranks of a ``torch.distributed`` group: each rank passes
    its own sequence shard and gets its shard of the output; differentiable (the ring backward). The
    transfers are batched isend / irecv to the next / from the previous rank of ``group`` (a ProcessGroup, a
    1-D DeviceMesh or None: the default group), so every rank must call it.

    Args:
        q: ``[B, Hq, S_local, D]``; k: ``[B, Hkv, S_local, D]``; v: ``[B, Hkv, S_local, Dv]`` (bf16 / f32), this
            rank's contiguous shard of the sequence in the given order (with ``causal`` and ``load_balance``:
            :func:`zigzag_permute` order, rank ``r`` holding chunks ``r`` and ``2n - 1 - r``).
        causal, sm_scale, load_balance: as :func:`ring_attention` (over the global positions).

    Returns:
        ``out [B, Hq, S_local, Dv]`` in q's dtype: this rank's rows of the global attention.

    Raises:
        ArgumentError: ranks other than 4, q / k / v sequence lengths differ, an odd ``S_local`` when balanced.
    """
    import torch.distributed as dist

    where = "tpukernels.distributed.ring_attention_torch"
    for x, nm in ((q, "q"), (k, "k"), (v, "v")):
        if x.dim() != 4:
            raise ArgumentError(f"{where}: {nm} must be 4-D [B, H, S_local, D], got shape {tuple(x.shape)}")
    S = q.shape[2]
    if k.shape[2] != S or v.shape[2] != S:
        raise ArgumentError(f"{where}: q, k, v must share the local sequence length (self-attention), got "
                            f"{q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    g = process_group(group)
    n = dist.get_world_size(g)
    balanced = bool(causal and load_balance and n > 1)
    if balanced and S % 2:
        raise ArgumentError(f"{where}: with causal load balance each rank holds two chunks, so S_local = {S} must "
                            f"be even")
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[3])
    ring = _Ring(n, bool(causal), balanced, scale, TorchRingOps(g, n))
    return _torch_ring_function().apply(q, k, v, ring)
