"""PyTorch's async tensor-parallel ops on tpukernels' collective matmuls.

PyTorch defines two fused collective matmuls in its ``symm_mem`` library (``torch.distributed._symmetric_memory``)
and implements them for CUDA only, on symmetric memory:

* ``torch.ops.symm_mem.fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True)`` ->
  ``(all_gather(A_shard) or None, [all_gather(A_shard) @ B for B in Bs])``;
* ``torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)`` ->
  ``reduce_scatter(A @ B)``.

Code written for async TP calls these ops: TorchTitan's fused TP linears (``tp_gemm_backend="dist_gemm"``:
``torchtitan.distributed.linear.AllGatherLinear``, ``AllGatherLinearMulti``, ``LinearReduceScatter``, behind
``AllGatherFusedQKVLinear`` / ``AllGatherFusedFeedForward`` / ``RowParallelLinear``), and torch.compile's
micro-pipeline TP pass, which rewrites all-gather + matmul into them. :func:`register_symm_mem_ops` implements
both for other device types -- the ``tpu`` device (``PrivateUse1``) by default, ``CPU`` for tests on a gloo
group -- with :func:`~tpukernels.distributed.collective_matmul.all_gather_matmul_torch` and
:func:`~tpukernels.distributed.collective_matmul.matmul_reduce_scatter_torch` (shards on a ring of batched isend /
irecv, each arrived shard multiplied by the library's matmul), so that code runs unchanged on TorchTPU.

Semantics are the ops' schema and torch's reference implementation (its ``Meta`` fallback, an all-gather or
reduce-scatter around ``torch.matmul``):

* a ``gather_dim`` / ``scatter_dim`` other than ``A``'s last dim is the ring; the last dim (the contraction dim:
  torch's reference gathers it and concatenates the shards along K) is a plain all-gather / reduce-scatter around
  one matmul (no overlap: the ring passes rows);
* ``Bs`` / ``B`` are ``[K, N]``; a transposed view of a contiguous ``[N, K]`` weight (``w.T``, what TorchTitan
  passes) is read in place (``rhs_transpose``), anything else is made contiguous;
* ``reduce_op`` ``"sum"`` or ``"avg"`` (the sum divided by the group size), the two torch's CUDA path takes.

Every rank of the group must call, as with any collective; ranks that disagree on shapes, dtypes or
``reduce_op`` raise on every rank (compared first, one all-gather of a few int64), and so do operands the
collective matmuls refuse (dtypes other than bf16 / f16 / f32 or not shared, contraction dims that differ), on
the unfused paths too. Not differentiable by themselves (neither are torch's:
callers wrap them in an ``autograd.Function``, as TorchTitan does).
"""

from __future__ import annotations

import threading

#: the device types :func:`register_symm_mem_ops` has registered (a torch.library kernel is registered once)
_REGISTERED: set[str] = set()
_LOCK = threading.Lock()
_LIB: list = []  # the torch.library.Library the kernels are registered through (kept alive)
REDUCE_OPS = ("sum", "avg")


def _group(group_name: str):
    # The ops carry the group's registered name (their schema): resolve it as torch's own implementations do.
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(group_name)  # noqa: SLF001  (torch's symm_mem ops resolve names this way)


#: the dtypes the collective matmuls take (the unfused last-dim paths keep the same rule)
DTYPES = ("bfloat16", "float16", "float32")


def _dtype_code(t) -> int:
    name = str(t.dtype).removeprefix("torch.")
    return DTYPES.index(name) if name in DTYPES else len(DTYPES)


def _check_unfused(op: str, A, Bs, group, k_of_b) -> None:
    """The unfused (last-dim) paths' checks. First the ranks are compared (a fixed number of int64 fields, so
    ranks that disagree raise on every rank instead of blocking in the collective; the ring paths compare inside
    the collective matmuls); then, identical on every rank, the operands: dtypes and contraction dims.
    ``k_of_b``: the contraction dim each B must have."""
    import zlib

    from ..errors import ArgumentError
    from .sharding import check_ranks_agree

    codes = "(0=bfloat16, 1=float16, 2=float32, 3=other)"
    fields = {"A.dim()": A.dim(), "A.numel()": A.numel(), "A.shape[-1]": A.shape[-1], "len(Bs)": len(Bs),
              "Bs[0].shape[0]": Bs[0].shape[0] if Bs and Bs[0].dim() else -1,
              "Bs[0].shape[-1]": Bs[0].shape[-1] if Bs and Bs[0].dim() else -1,
              "every B's shape (checksum)": zlib.crc32(repr([tuple(b.shape) for b in Bs]).encode()),
              f"A.dtype {codes}": _dtype_code(A),
              "every B's dtype (checksum)": zlib.crc32(repr([b.dtype for b in Bs]).encode())}
    check_ranks_agree(op, fields, group)
    if _dtype_code(A) == len(DTYPES) or any(b.dtype != A.dtype for b in Bs):
        raise ArgumentError(f"{op}: A and every B must share one of {', '.join(DTYPES)}, got A {A.dtype}, "
                            f"B {[str(b.dtype) for b in Bs]}")
    bad = [tuple(b.shape) for b in Bs if b.dim() != 2 or b.shape[0] != k_of_b]
    if bad:
        raise ArgumentError(f"{op}: every B must be [K, N] with K = {k_of_b} (A's contraction dim), got {bad}")


def as_rhs(Bs):
    """``(weights, rhs_transpose)``: ``[K, N]`` operands as the collective matmuls take them."""
    if all(b.dim() == 2 and b.T.is_contiguous() and not b.is_contiguous() for b in Bs):
        return [b.T for b in Bs], True  # w.T of a contiguous [N, K] weight: read in place
    return [b.contiguous() for b in Bs], False


def fused_all_gather_matmul(A_shard, Bs, gather_dim: int, group_name: str, *, return_A: bool = True):
    """``torch.ops.symm_mem.fused_all_gather_matmul`` on tpukernels' ring (see module docstring).

    Args:
        A_shard: ``[..., K]`` this rank's shard (the global A concatenates the ranks' shards along ``gather_dim``).
        Bs: ``[K, N_i]`` operands, A's dtype.
        gather_dim: the dim of A the shards are concatenated on.
        group_name: the process group's name (``group.group_name``).
        return_A: also return the gathered A.

    Returns:
        ``(gathered A or None, [gathered A @ B for B in Bs])``.

    Raises:
        ArgumentError: as :func:`~tpukernels.distributed.collective_matmul.all_gather_matmul_torch` (dtypes bf16 /
            f16 / f32, shared by A and the Bs; contraction dims; on every rank where the ranks disagree), on either
            path.
    """
    import torch
    import torch.distributed as dist

    from .collective_matmul import all_gather_matmul_torch

    group = _group(group_name)
    dim = gather_dim % A_shard.dim()
    if dim == A_shard.dim() - 1:  # the contraction dim: gather, then one matmul (torch's reference semantics)
        _check_unfused("symm_mem.fused_all_gather_matmul", A_shard, list(Bs), group, A_shard.shape[-1] * group.size())
        parts = [torch.empty_like(A_shard) for _ in range(group.size())]
        dist.all_gather(parts, A_shard.contiguous(), group=group)
        A = torch.cat(parts, dim=-1)
        return (A if return_A else None), [torch.matmul(A, b) for b in Bs]
    ws, rhs_transpose = as_rhs(list(Bs))
    with torch.no_grad():  # the op is not differentiable (as torch's): no graph, no saved gathered A
        A, outs = all_gather_matmul_torch(A_shard, ws, group, gather_dim=dim, rhs_transpose=rhs_transpose,
                                          return_gathered=True)
    return (A if return_A else None), list(outs)


def fused_matmul_reduce_scatter(A, B, reduce_op: str, scatter_dim: int, group_name: str):
    """``torch.ops.symm_mem.fused_matmul_reduce_scatter`` on tpukernels' ring (see module docstring).

    Args:
        A: ``[..., K_local]``, the same shape on every rank.
        B: ``[K_local, N]``, A's dtype.
        reduce_op: ``"sum"`` or ``"avg"``.
        scatter_dim: the dim of ``A @ B`` split across ranks (its size divisible by the group size).
        group_name: the process group's name.

    Returns:
        this rank's share of the reduction of ``A @ B`` over ranks, in A's dtype.

    Raises:
        ArgumentError: ``reduce_op`` not one of :data:`REDUCE_OPS`, or not the same on every rank (the ranks compare
            it first: one all-gather of an int); as
            :func:`~tpukernels.distributed.collective_matmul.matmul_reduce_scatter_torch` (dtypes bf16 / f16 /
            f32, shared by A and B; contraction dims; ranks that disagree).
    """
    import torch
    import torch.distributed as dist

    from ..errors import ArgumentError
    from .collective_matmul import matmul_reduce_scatter_torch
    from .sharding import check_ranks_agree

    op = "symm_mem.fused_matmul_reduce_scatter"
    group = _group(group_name)
    n = group.size()
    # reduce_op decides the result on every rank: compared first, so one rank's bad or different value raises on
    # all of them (a rank that raised alone would leave the others blocked in the ring)
    check_ranks_agree(op, {f"reduce_op (index in {REDUCE_OPS}, -1: other)": REDUCE_OPS.index(reduce_op)
                           if reduce_op in REDUCE_OPS else -1}, group)
    if reduce_op not in REDUCE_OPS:
        raise ArgumentError(f"{op}: reduce_op must be one of {REDUCE_OPS}, got {reduce_op!r}")
    dim = scatter_dim % A.dim()
    if dim == A.dim() - 1:  # the output's last dim: one matmul, its sum over ranks, this rank's column block
        _check_unfused(op, A, [B], group, A.shape[-1])
        if B.shape[-1] % n:  # the same on every rank (just checked): all raise
            raise ArgumentError(f"{op}: A @ B has {B.shape[-1]} columns, not divisible by the group size {n}")
        full = torch.matmul(A, B).contiguous()
        dist.all_reduce(full, group=group)  # gloo has no reduce_scatter; this path is unfused either way
        out = full.chunk(n, dim=-1)[group.rank()].contiguous()
    else:
        (w,), rhs_transpose = as_rhs([B])
        with torch.no_grad():
            out = matmul_reduce_scatter_torch(A, w, group, scatter_dim=dim, rhs_transpose=rhs_transpose)
    return out / n if reduce_op == "avg" else out


def register_symm_mem_ops(device_types=("PrivateUse1",)) -> list[str]:
    """Implement ``torch.ops.symm_mem.fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter`` for
    ``device_types`` with tpukernels' collective matmuls (see module docstring); idempotent.

    Args:
        device_types: torch dispatch keys: ``"PrivateUse1"`` (the ``tpu`` device of TorchTPU, default), ``"CPU"``
            (gloo groups, e.g. tests). ``"CUDA"`` is refused: torch's symmetric-memory kernels own it.

    Returns:
        the device types registered by this call (already registered ones are skipped).

    Raises:
        ArgumentError: a device type outside ``PrivateUse1`` / ``CPU``.
    """
    import torch
    import torch.distributed._symmetric_memory  # noqa: F401  (defines the symm_mem ops)

    from ..errors import ArgumentError

    types = [device_types] if isinstance(device_types, str) else list(device_types)
    bad = [t for t in types if t not in ("PrivateUse1", "CPU")]
    if bad:
        raise ArgumentError(f"register_symm_mem_ops: device_types must be 'PrivateUse1' or 'CPU', got {bad}")
    done = []
    with _LOCK:
        if not _LIB:
            _LIB.append(torch.library.Library("symm_mem", "IMPL"))
        for t in types:
            if t in _REGISTERED:
                continue
            _LIB[0].impl("fused_all_gather_matmul", fused_all_gather_matmul, t)
            _LIB[0].impl("fused_matmul_reduce_scatter", fused_matmul_reduce_scatter, t)
            _REGISTERED.add(t)
            done.append(t)
    return done
