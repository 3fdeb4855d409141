"""Collective matmuls for tensor parallelism: all-gather -> matmul and matmul -> reduce-scatter with the
communication overlapped with the compute, built on the tpukernels matmul kernels (``matmul_nn`` /
``matmul_nt``) over one mesh axis in JAX (``jax.shard_map`` + ``lax.ppermute``).

Public API::

    all_gather_matmul(x, y, mesh, axis_name, *, rhs_transpose=False, interpret=None, chip=None)   # x: rows
    matmul_reduce_scatter(x, y, mesh, axis_name, *, rhs_transpose=False, interpret=None, chip=None)  # x: K
    # torch, one rank's shards, differentiable; w may be a list of weights sharing x (q, k, v)
    all_gather_matmul_torch(x, w, group=None, *, gather_dim=0, rhs_transpose=False, return_gathered=False,
                            compute_dtype=None, check_ranks=True)
    matmul_reduce_scatter_torch(x, w, group=None, *, scatter_dim=0, rhs_transpose=False, check_ranks=True)

The torch pair runs the same rings over a ``torch.distributed`` group (batched isend / irecv, the library's matmul
torch op) and backs the tensor-parallel styles of :mod:`tpukernels.distributed.tensor_parallel`.

Shapes (global arrays; ``n = mesh.shape[axis_name]``; ``y`` is ``[K, N]``, or ``[N, K]`` with
``rhs_transpose`` (an ``nn.Linear`` weight), in the layouts of tpu-inference 0.32.0's
``kernels/collectives/all_gather_matmul.py``):

* ``all_gather_matmul``: ``x [M, K]`` sharded on M, ``y`` sharded on N -> ``out [M, N] = all_gather(x) @ y``,
  sharded on N (the column-parallel linear after a sequence-parallel region). ``M`` and ``N`` divisible by n.
* ``matmul_reduce_scatter``: ``x [M, K]`` sharded on K, ``y`` sharded on K -> ``out [M, N] = x @ y`` (the sum
  of the n partial products), sharded on M (the row-parallel linear before a sequence-parallel region). ``M``
  and ``K`` divisible by n; the partial sums travel in float32 and are rounded once to x's dtype.

Algorithm (device ``i`` of ``n``, a one-directional ring ``i -> i + 1``):

* all-gather matmul: step ``s`` multiplies the x shard of device ``(i - s) mod n`` (its own at step 0) into its
  rows of the output while ``lax.ppermute`` passes that shard on; the matmul of step ``s`` and the transfer
  feeding step ``s + 1`` are independent, so XLA overlaps them (async ``collective-permute`` start / done around
  the kernel). ``n`` kernel calls, ``n - 1`` transfers of ``M/n x K``: the bytes of the all-gather, never
  waited on whole.
* matmul reduce-scatter: step ``s`` computes this device's partial product for row chunk
  ``c = (i - 1 - s) mod n`` and adds the running sum received from the left; the sum moves right. Chunk ``c``
  starts at device ``c + 1`` and ends, complete, at device ``c`` after ``n - 1`` hops. The partial product of
  step ``s + 1`` does not depend on the incoming sum, so it overlaps the transfer.

Two implementations of the all-gather matmul (``impl=``): the default ring at the JAX level, whose overlap comes
from XLA's async collectives around our kernels (checked on the compiled HLO of a 4-chip ``v5e:2x2``: kernels
scheduled between a collective-permute's start and done) and whose per-step matmul is the tuned library kernel;
and ``impl="kernel"``, one Pallas kernel per device (:mod:`.all_gather_matmul_kernel`: remote DMAs and
semaphores, as tpu-inference's), which also hides the per-step launches and the output's dynamic-update-slice.
Which is faster is not known here: no TPU, and libtpu 0.0.52's static profiler aborts on the kernel and writes
no estimate for the ring's collective-permutes (it does for XLA's all-gather), so neither has a model figure. The
reduce-scatter has the same two (``impl="kernel"``: :mod:`.matmul_reduce_scatter_kernel`, the float32 sums sent on
tile by tile).

Errors (typed, before anything traces): a missing mesh axis, ranks, shapes not divisible by the ring, the
contraction dims disagreeing. The matmul arguments themselves are checked by the kernels.

Sources: Wang et al., "Overlap Communication with Dependent Computation via Decomposition in Large Deep
Learning Models" (ASPLOS 2023); JAX's shard_map collective matmul notes; tpu-inference's all_gather_matmul.
"""

from __future__ import annotations

from typing import Optional

from ..chips import get_chip
from ..errors import ArgumentError
from .ring_attention import TorchRingOps, call_kernel, kernel_mode

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "all_gather_matmul_torch", "matmul_reduce_scatter_torch"]


def _ring(op: str, x, y, mesh, axis_name: str, rhs_transpose: bool, split: str, interpret, chip):
    """The checks and the ring of both ops: ``(n, M, K, N, mode, chip, perm)``; ``split``: the dim besides M
    that the axis size must divide ("N" or "K")."""
    if axis_name not in mesh.shape:
        raise ArgumentError(f"{op}: mesh has no axis {axis_name!r} (axes: {tuple(mesh.shape)})")
    if len(x.shape) != 2 or len(y.shape) != 2:
        raise ArgumentError(f"{op}: x and y must be 2-D ([M, K] and [K, N], or [N, K] with rhs_transpose), got "
                            f"{tuple(x.shape)} and {tuple(y.shape)}")
    M, K = (int(d) for d in x.shape)
    Ky, N = (int(d) for d in (y.shape[::-1] if rhs_transpose else y.shape))
    if Ky != K:
        raise ArgumentError(f"{op}: contraction dims differ: x is [M, K] = {tuple(x.shape)}, y is "
                            f"{'[N, K]' if rhs_transpose else '[K, N]'} = {tuple(y.shape)}")
    n = int(mesh.shape[axis_name])
    other = N if split == "N" else K
    if M % n or other % n:
        raise ArgumentError(f"{op}: M = {M} and {split} = {other} must be divisible by the size {n} of axis "
                            f"{axis_name!r}")
    perm = [(j, (j + 1) % n) for j in range(n)]  # device j sends to j + 1
    return n, M, K, N, kernel_mode(mesh, interpret), None if chip is None else get_chip(chip), perm


def _use_kernel(op: str, impl: str, rhs_transpose: bool, n: int) -> bool:
    """Whether ``impl`` asks for the one-kernel version (checked: it takes ``[K, N]`` weights on >= 2 devices)."""
    if impl not in ("ring", "kernel"):
        raise ArgumentError(f"{op}: impl must be 'ring' or 'kernel', got {impl!r}")
    if impl == "kernel" and (rhs_transpose or n < 2):
        raise ArgumentError(f"{op}: impl='kernel' takes y as [K, N] (not rhs_transpose) on at least 2 devices, got "
                            f"rhs_transpose={rhs_transpose}, {n} device(s)")
    return impl == "kernel"


def _one_kernel(kernel, mode: str, chip, axis_name: str, n: int):
    """The per-device function of ``impl="kernel"``: the collective ``kernel``'s first output."""
    return lambda xs, ys: call_kernel(kernel, mode, chip, xs, ys, axis_name, n)[0]


def _mm(mode, chip, a, b, rhs_transpose: bool, out_dtype=None):
    from ..library.matmul_ops import matmul_nn, matmul_nt

    kern = matmul_nt if rhs_transpose else matmul_nn
    out = call_kernel(kern, mode, chip, a[None], b[None], out_dtype=out_dtype)
    return out[0]


def all_gather_matmul(x, y, mesh, axis_name: str, *, rhs_transpose: bool = False, interpret: Optional[str] = None,
                      chip=None, impl: str = "ring"):
    """``all_gather(x, rows) @ y`` with the all-gather overlapped with the per-shard matmuls (module docstring).

    Args:
        x: ``[M, K]`` (bf16 or f32), sharded on M over ``axis_name``.
        y: ``[K, N]`` sharded on N, or ``[N, K]`` sharded on N with ``rhs_transpose``; x's dtype.
        mesh: a ``jax.sharding.Mesh`` holding ``axis_name``. interpret: the kernels' mode (default: Mosaic on
            TPU devices, else the process's interpret mode). chip: tuning-table chip for the matmul configs
            (default: the one a call resolves).
        impl: ``"ring"`` (default): ``lax.ppermute`` steps around the library matmul kernel, overlapped by XLA;
            ``"kernel"``: one Pallas kernel per device whose remote DMAs pass the shards on while its MXU
            multiplies (:mod:`tpukernels.distributed.all_gather_matmul_kernel`; ``[K, N]`` y only, at least 2
            devices, K whole in VMEM). Neither is measured here (no TPU); the ring is the default because its
            overlap is checked in XLA:TPU's schedule and its per-step matmul is the tuned kernel.

    Returns:
        ``[M, N]`` in x's dtype, sharded on N (``P(None, axis_name)``).

    Raises:
        ArgumentError: no such axis, ranks, contraction dims, ``M`` or ``N`` not divisible by the axis size, an
            unknown ``impl``, ``impl="kernel"`` with ``rhs_transpose`` or one device (and the kernel's own limits).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n, M, K, N, mode, chip, perm = _ring("tpukernels.all_gather_matmul", x, y, mesh, axis_name, rhs_transpose, "N",
                                         interpret, chip)
    m = M // n
    kernel = None
    if _use_kernel("tpukernels.all_gather_matmul", impl, rhs_transpose, n):
        from .all_gather_matmul_kernel import agmm_kernel as kernel

    def local(xs, ys):
        i = jax.lax.axis_index(axis_name)
        out = jnp.zeros((M, ys.shape[0] if rhs_transpose else ys.shape[1]), xs.dtype)
        chunk = xs
        for s in range(n):
            nxt = jax.lax.ppermute(chunk, axis_name, perm) if s < n - 1 else None  # overlaps the matmul below
            part = _mm(mode, chip, chunk, ys, rhs_transpose)
            out = jax.lax.dynamic_update_slice(out, part, (((i - s) % n) * m, 0))
            chunk = nxt
        return out

    y_spec = P(axis_name, None) if rhs_transpose else P(None, axis_name)
    return jax.shard_map(_one_kernel(kernel, mode, chip, axis_name, n) if kernel is not None else local, mesh=mesh,
                         in_specs=(P(axis_name, None), y_spec), out_specs=P(None, axis_name), check_vma=False)(x, y)


def matmul_reduce_scatter(x, y, mesh, axis_name: str, *, rhs_transpose: bool = False,
                          interpret: Optional[str] = None, chip=None, impl: str = "ring"):
    """``reduce_scatter(x @ y, rows)`` for K-sharded operands, the partial sums passed around a ring while the
    next partial product is computed (module docstring).

    Args:
        x: ``[M, K]`` (bf16 or f32), sharded on K over ``axis_name``.
        y: ``[K, N]`` sharded on K, or ``[N, K]`` sharded on K with ``rhs_transpose``; x's dtype.
        mesh, interpret, chip: as :func:`all_gather_matmul`.
        impl: ``"ring"`` (default) or ``"kernel"`` (:mod:`tpukernels.distributed.matmul_reduce_scatter_kernel`: one
            Pallas kernel per device passing the float32 sums on by remote DMA, tile by tile; ``[K, N]`` y only, at
            least 2 devices), as :func:`all_gather_matmul`'s.

    Returns:
        ``[M, N]`` in x's dtype (float32 sums, rounded once), sharded on M (``P(axis_name, None)``).

    Raises:
        ArgumentError: no such axis, ranks, contraction dims, ``M`` or ``K`` not divisible by the axis size, an
            unknown ``impl``, ``impl="kernel"`` with ``rhs_transpose`` or one device (and the kernel's own limits).
    """
    import jax
    from jax.sharding import PartitionSpec as P

    op = "tpukernels.matmul_reduce_scatter"
    n, M, K, N, mode, chip, perm = _ring(op, x, y, mesh, axis_name, rhs_transpose, "K", interpret, chip)
    m = M // n
    kernel = None
    if _use_kernel(op, impl, rhs_transpose, n):
        from .matmul_reduce_scatter_kernel import rsmm_kernel as kernel

    def local(xs, ys):
        i = jax.lax.axis_index(axis_name)
        acc = None
        for s in range(n):
            rows = jax.lax.dynamic_slice_in_dim(xs, ((i - 1 - s) % n) * m, m, axis=0)
            part = _mm(mode, chip, rows, ys, rhs_transpose, out_dtype="float32")  # independent of the sum
            acc = part if acc is None else part + jax.lax.ppermute(acc, axis_name, perm)
        return acc.astype(xs.dtype)

    y_spec = P(None, axis_name) if rhs_transpose else P(axis_name, None)
    return jax.shard_map(_one_kernel(kernel, mode, chip, axis_name, n) if kernel is not None else local, mesh=mesh,
                         in_specs=(P(None, axis_name), y_spec), out_specs=P(axis_name, None), check_vma=False)(x, y)


# ----------------------------------------------------------------------------------------------- torch
# The same two rings on the ranks of a torch.distributed group (each rank one process, as TorchTitan runs):
# the transfers are batched isend / irecv to the next / from the previous rank, started before the matmul they
# overlap; the matmuls are the library's torch op (``tpukernels.library.matmul``: matmul_nn / matmul_nt / matmul_tn
# by strides). Each op's backward is the other ring: d(all-gather matmul)/dx is a matmul reduce-scatter, and
# d(matmul reduce-scatter)/dx an all-gather matmul, whose gathered operand also gives the weight gradient.
_DTYPE_CODES = {"torch.float32": 0, "torch.bfloat16": 1, "torch.float16": 2}


def _mm_torch(a, w, rhs_transpose: bool, out_dtype=None):
    from ..library.matmul_ops import matmul

    return matmul(a, w.t() if rhs_transpose else w, out_dtype=out_dtype)  # w.t(): read in place (matmul_nt)


def _ag_mm_rows(ring: TorchRingOps, x, ws, rhs_transpose: bool):
    """``([all_gather(x) @ w for w in ws], all_gather(x))`` for 2-D ``x [m, K]``: rank ``i`` multiplies the shard of
    rank ``(i - s) mod n`` at step ``s`` by every weight while passing the shard on (one transfer for all ``ws``)."""
    import torch

    n, i = ring.n, ring.rank
    outs, shards, chunk = [[None] * n for _ in ws], [None] * n, x
    for s in range(n):
        pending = ring.start_shift((chunk,)) if s < n - 1 else None  # overlaps the matmuls below
        src = (i - s) % n
        for out, w in zip(outs, ws):  # x travels in its own dtype; compute_dtype casts it here
            out[src] = _mm_torch(chunk if chunk.dtype == w.dtype else chunk.to(w.dtype), w, rhs_transpose)
        shards[src] = chunk
        if pending is not None:
            ring.wait(pending[1])
            (chunk,) = pending[0]
    return [torch.cat(o) for o in outs], torch.cat(shards)


def _mm_rs_rows(ring: TorchRingOps, pairs, rhs_transpose: bool, extra, dtype):
    """``reduce_scatter(sum(x @ w for x, w in pairs) + extra, rows)`` for 2-D ``x [M, K_j]`` (``extra``: None or
    ``[M, N]`` added before the reduction): float32 partial sums passed right, row chunk ``(i - 1 - s) mod n`` at
    step ``s``, so chunk ``c`` ends complete at rank ``c``; rounded once to ``dtype``."""
    import torch

    n, i = ring.n, ring.rank
    M = (pairs[0][0] if pairs else extra).shape[0]
    m = M // n
    acc, pending = None, None
    for s in range(n):
        c = (i - 1 - s) % n
        part = None if extra is None else extra[c * m:(c + 1) * m].float()
        for x, w in pairs:  # overlap the transfer
            p = _mm_torch(x[c * m:(c + 1) * m], w, rhs_transpose, out_dtype=torch.float32)
            part = p if part is None else part + p
        if pending is not None:
            ring.wait(pending[1])
            part = part + pending[0][0]
        acc = part
        pending = ring.start_shift((acc,)) if s < n - 1 else None
    return acc.to(dtype)


def _torch_functions():
    import torch

    class AllGatherMatmul(torch.autograd.Function):
        """``(x, ring, rhs_transpose, return_gathered, *ws) -> ([gathered,] *outs)``."""

        @staticmethod
        def forward(ctx, x, ring, rhs_transpose, return_gathered, *ws):
            ctx.set_materialize_grads(False)  # an output nobody used gives its weight no gradient (None), as torch's
            outs, gathered = _ag_mm_rows(ring, x, ws, rhs_transpose)
            ctx.save_for_backward(gathered, *ws)
            ctx.ring, ctx.rhs_transpose, ctx.return_gathered = ring, rhs_transpose, return_gathered
            return (gathered, *outs) if return_gathered else tuple(outs)

        @staticmethod
        def backward(ctx, *grads):
            gathered, *ws = ctx.saved_tensors
            rt = ctx.rhs_transpose
            dgathered, douts = (grads[0], grads[1:]) if ctx.return_gathered else (None, grads)
            pairs = [(d.contiguous(), w) for d, w in zip(douts, ws) if d is not None]
            dx = None
            if ctx.needs_input_grad[0]:  # the same on every rank (one model), so every rank runs the ring or none
                if pairs or dgathered is not None:  # dx_full = dgathered + sum_j dout_j @ w_j^T over ranks
                    dx = _mm_rs_rows(ctx.ring, pairs, not rt, dgathered, gathered.dtype)
                else:
                    dx = torch.zeros(gathered.shape[0] // ctx.ring.n, gathered.shape[1], dtype=gathered.dtype,
                                     device=gathered.device)
            gx = {}  # the gathered x in each gradient's dtype (compute_dtype may differ from x's)
            dws = [None if d is None or not ctx.needs_input_grad[4 + j]
                   else _mm_torch(d.t(), gx.setdefault(d.dtype, gathered.to(d.dtype)), False) if rt
                   else _mm_torch(gx.setdefault(d.dtype, gathered.to(d.dtype)).t(), d, False)
                   for j, d in enumerate(douts)]
            return (dx, None, None, None, *dws)

    class MatmulReduceScatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, ring, rhs_transpose):
            ctx.save_for_backward(x, w)
            ctx.ring, ctx.rhs_transpose = ring, rhs_transpose
            return _mm_rs_rows(ring, [(x, w)], rhs_transpose, None, x.dtype)

        @staticmethod
        def backward(ctx, dout):
            x, w = ctx.saved_tensors
            rt = ctx.rhs_transpose
            (dx,), dout_full = _ag_mm_rows(ctx.ring, dout.contiguous(), [w], not rt)  # dx = dout_full @ w^T
            dw = _mm_torch(dout_full.t(), x, False) if rt else _mm_torch(x.t(), dout_full, False)
            return dx, dw, None, None

    return AllGatherMatmul, MatmulReduceScatter


_FUNCTIONS: list = []


_SIGNATURE_DIMS = 6  # x.shape entries the rank check names one by one (a checksum covers everything else)


def _rank_signature(x, ws, dim, rhs_transpose: bool, split: str) -> dict:
    """What every rank must agree on, as a fixed number of ints (so the all-gather that compares them has one size
    on every rank, whatever the ranks got): x's rank, leading dims and dtype, the weights' count, and a checksum of
    the rest (the weights' shapes and dtypes, the dims, x's further dims)."""
    import zlib

    other = "" if str(x.dtype) in _DTYPE_CODES else str(x.dtype)  # a dtype the code below does not name
    rest = repr((tuple(x.shape[_SIGNATURE_DIMS:]), other, [(tuple(w.shape), str(w.dtype)) for w in ws], repr(dim),
                 bool(rhs_transpose)))
    fields = {"x.dim()": x.dim()}
    fields.update({f"x.shape[{d}]": int(x.shape[d]) if d < x.dim() else -1 for d in range(_SIGNATURE_DIMS)})
    fields.update({"x.dtype (0 float32, 1 bfloat16, 2 float16, -1 other)": _DTYPE_CODES.get(str(x.dtype), -1),
                   "len(w)": len(ws),
                   f"the weights' shapes or dtypes, {split}_dim or rhs_transpose (a checksum)":
                       zlib.crc32(rest.encode())})
    return fields


def _torch_checked(op: str, x, ws, group, dim: int, rhs_transpose: bool, check_ranks: bool, split: str,
                   compute_dtype=None):
    """Checks shared by the two torch ops: ``(ring, dim, K, [N of each w])``; ``split``: "gather" or "scatter".

    The ranks are compared first (``check_ranks``), so that every later check, a function of what they agreed on,
    raises on all ranks or on none: a rank that raised alone would leave the others waiting in the ring."""
    import torch
    import torch.distributed as dist

    from .sharding import check_ranks_agree, process_group

    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if not ws:
        raise ArgumentError(f"{op}: w must be a tensor or a non-empty sequence of tensors")
    for j, w in enumerate(ws):
        if not isinstance(w, torch.Tensor):
            raise ArgumentError(f"{op}: w[{j}] must be a torch.Tensor, got {type(w).__name__}")
    g = process_group(group)
    ring = TorchRingOps(g, dist.get_world_size(g))
    if check_ranks and ring.n > 1:
        check_ranks_agree(op, _rank_signature(x, ws, dim, rhs_transpose, split), g, device=x.device)
    if x.dim() < 2 or any(w.dim() != 2 for w in ws):
        raise ArgumentError(f"{op}: x must be [..., K] with at least 2 dims and w 2-D ([K, N], or [N, K] with "
                            f"rhs_transpose), got {tuple(x.shape)} and {[tuple(w.shape) for w in ws]}")
    if compute_dtype is not None:
        if str(compute_dtype) not in _DTYPE_CODES or str(x.dtype) not in _DTYPE_CODES:
            raise ArgumentError(f"{op}: compute_dtype and x must be bfloat16, float16 or float32, got "
                                f"{compute_dtype} and {x.dtype}")
    elif str(x.dtype) not in _DTYPE_CODES or any(w.dtype != x.dtype for w in ws):
        raise ArgumentError(f"{op}: x and w must share one of bfloat16, float16, float32 (or name compute_dtype), "
                            f"got {x.dtype} and {[w.dtype for w in ws]}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ArgumentError(f"{op}: {split}_dim must be an int naming a dim of x {tuple(x.shape)}, got {dim!r}")
    dim = dim % x.dim()
    if dim == x.dim() - 1:
        raise ArgumentError(f"{op}: {split}_dim = {dim} is x's last dim, the contraction dim K; name a row dim")
    K = x.shape[-1]
    for w in ws:
        if (w.shape[1] if rhs_transpose else w.shape[0]) != K:
            raise ArgumentError(f"{op}: contraction dims differ: x is [..., K] = {tuple(x.shape)}, w is "
                                f"{'[N, K]' if rhs_transpose else '[K, N]'} = {tuple(w.shape)}")
    if split == "scatter" and x.shape[dim] % ring.n:
        raise ArgumentError(f"{op}: x.shape[{dim}] = {x.shape[dim]} must be divisible by the group size {ring.n} "
                            f"(each rank gets an equal share of the reduced rows)")
    return ring, dim, K, [w.shape[0] if rhs_transpose else w.shape[1] for w in ws]


def _functions():
    if not _FUNCTIONS:
        _FUNCTIONS.extend(_torch_functions())
    return _FUNCTIONS


def all_gather_matmul_torch(x, w, group=None, *, gather_dim: int = 0, rhs_transpose: bool = False,
                            return_gathered: bool = False, compute_dtype=None, check_ranks: bool = True):
    """:func:`all_gather_matmul` for torch tensors on the ranks of a ``torch.distributed`` group: every rank
    passes its shard of x (rows along ``gather_dim``) and its columns of one or several weights, and gets
    ``all_gather(x) @ w``'s columns for each; the shards travel a ring (batched isend / irecv) while each arrived
    shard is multiplied (by every weight: one transfer serves q, k and v). Differentiable: dx is one matmul
    reduce-scatter of the ``dout @ w^T`` sums, dw uses the gathered x the forward kept. Every rank of ``group``
    must call it. The counterpart of ``torch.ops.symm_mem.fused_all_gather_matmul(A_shard, Bs, gather_dim,
    group_name, return_A=...)`` (async TP; CUDA symmetric memory).

    Args:
        x: ``[..., K]`` this rank's shard of the rows (bf16 / f16 / f32): the global x is the concatenation of the
            ranks' shards along ``gather_dim`` in rank order. Shards are equal across ranks.
        w: ``[K, N_local]``, or ``[N_local, K]`` with ``rhs_transpose`` (an ``nn.Linear`` weight sharded as
            ``ColwiseParallel`` shards it), x's dtype; or a list / tuple of such weights (``N_local`` may differ).
        group: a ProcessGroup, a 1-D ``DeviceMesh`` or None (the default group).
        gather_dim: the dim of x the shards are concatenated on (any but the last; the sequence dim 1 of a
            ``[B, S, D]`` activation under sequence parallelism).
        return_gathered: also return the gathered x (differentiable: its gradient is reduce-scattered with dx).
        compute_dtype: the dtype the matmuls run in (as ``torch.autocast``): the weights are cast to it and each
            arrived shard of x too, while x travels and is gathered in its own dtype. Default: x's dtype, which the
            weights must share.
        check_ranks: first compare the ranks' shapes, dtype and dims (one all-gather of a few int64), so that ranks
            that disagree raise instead of blocking in the ring.

    Returns:
        For one weight, x's shape with ``gather_dim`` n times longer and the last dim ``N_local`` in x's dtype (or
        ``compute_dtype``); for
        a list, a list of those; with ``return_gathered``, ``(gathered x, that)``.

    Raises:
        ArgumentError: not tensors, ranks, dtypes, contraction dims, ``gather_dim`` the last dim or out of range;
            ranks that disagree (on every rank, with ``check_ranks``).
    """
    op = "tpukernels.distributed.all_gather_matmul_torch"
    many = isinstance(w, (list, tuple))
    ws = list(w) if many else [w]
    ring, dim, K, Ns = _torch_checked(op, x, ws, group, gather_dim, rhs_transpose, check_ranks, "gather",
                                      compute_dtype)
    if compute_dtype is not None:
        ws = [w.to(compute_dtype) for w in ws]
    xm = x.movedim(dim, 0)  # rows of one shard contiguous in gather order: [s_local * rest, K]
    rest = xm.shape[1:-1]
    res = _functions()[0].apply(xm.reshape(-1, K), ring, rhs_transpose, return_gathered, *ws)
    rows = ring.n * xm.shape[0]
    outs = [o.reshape(rows, *rest, N).movedim(0, dim) for o, N in zip(res[1:] if return_gathered else res, Ns)]
    out = outs if many else outs[0]
    return (res[0].reshape(rows, *rest, K).movedim(0, dim), out) if return_gathered else out


def matmul_reduce_scatter_torch(x, w, group=None, *, scatter_dim: int = 0, rhs_transpose: bool = False,
                                check_ranks: bool = True):
    """:func:`matmul_reduce_scatter` for torch tensors on the ranks of a ``torch.distributed`` group: every rank
    passes x with its slice of the contraction dim and w's matching rows, and gets its share (along
    ``scatter_dim``, in rank order) of the sum over ranks of ``x @ w``. The float32 partial sums travel a ring
    while the next chunk's partial product is computed, and are rounded once to x's dtype. Differentiable: dx is an
    all-gather matmul of ``dout``, whose gathered rows also give dw. The counterpart of
    ``torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", scatter_dim, group_name)``.

    Args:
        x: ``[..., K_local]`` (bf16 / f16 / f32), the same shape on every rank; ``x.shape[scatter_dim]`` divisible
            by the group size.
        w: ``[K_local, N]``, or ``[N, K_local]`` with ``rhs_transpose`` (an ``nn.Linear`` weight sharded as
            ``RowwiseParallel`` shards it), x's dtype.
        group, check_ranks: as :func:`all_gather_matmul_torch`.
        scatter_dim: the dim of the result split across ranks (any but the last).

    Returns:
        x's shape with ``scatter_dim`` n times shorter and the last dim ``N``, in x's dtype.

    Raises:
        ArgumentError: as :func:`all_gather_matmul_torch`, and ``x.shape[scatter_dim]`` not divisible by the group
            size.
    """
    op = "tpukernels.distributed.matmul_reduce_scatter_torch"
    ring, dim, K, (N,) = _torch_checked(op, x, [w], group, scatter_dim, rhs_transpose, check_ranks, "scatter")
    xm = x.movedim(dim, 0).contiguous()  # row chunk r (rank r's share) contiguous
    rest = xm.shape[1:-1]
    out = _functions()[1].apply(xm.reshape(-1, K), w, ring, rhs_transpose)
    return out.reshape(xm.shape[0] // ring.n, *rest, N).movedim(0, dim)
