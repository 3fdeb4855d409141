"""Collective matmuls for tensor parallelism: all-gather -> matmul and matmul -> reduce-scatter with the
communication overlapped with the compute, built on the tpukernels matmul kernels (``matmul_nn`` /
``matmul_nt``) over one mesh axis in JAX (``jax.shard_map`` + ``lax.ppermute``).

Public API::

    all_gather_matmul(x, y, mesh, axis_name, *, rhs_transpose=False, interpret=None, chip=None)   # x: rows
    matmul_reduce_scatter(x, y, mesh, axis_name, *, rhs_transpose=False, interpret=None, chip=None)  # x: K

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
from .ring_attention import call_kernel, kernel_mode

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


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
