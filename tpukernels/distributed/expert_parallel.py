"""Expert parallelism: each token copy of a top-k routing is sent to the rank that holds its expert (dispatch),
and the expert outputs come back to their tokens, weighted (combine). Torch over a ``torch.distributed`` group,
and JAX inside ``jax.shard_map`` over one mesh axis. Built on :mod:`tpukernels.library.moe_routing`'s
``moe_permute`` / ``moe_combine`` kernels and one ragged all-to-all each way.

Public API::

    x_local, group_sizes, handle = ep_dispatch(x, expert_ids, num_experts, group=None)      # torch
    out = ep_combine(y_local, weights, handle)
    x_local, group_sizes, handle = ep_dispatch_jax(x, expert_ids, num_experts, axis_name)   # in shard_map
    out = ep_combine_jax(y_local, weights, handle, axis_name)
    ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name)

Layout. ``n`` ranks (the group's size / the mesh axis' size) hold the ``E`` experts in contiguous slices:
rank ``r`` holds experts ``[r E/n, (r+1) E/n)`` (``E`` divisible by ``n``), as TorchTitan's and MaxText's
expert-parallel layouts do. Each rank routes its own tokens ``x [T, D]`` (``expert_ids [T, k]`` global expert
ids, ``weights [T, k]``). After dispatch, a rank holds the rows of every token copy routed to its experts, from
every rank, sorted by local expert (``group_sizes [E/n]``: the contiguous groups ``grouped_matmul`` takes);
within an expert, by source rank, then token order. ``ep_combine`` takes the experts' outputs in that row order
and returns ``out [T, D]`` on each rank, ``out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``: the same
result as single-device ``moe_permute`` -> experts -> ``moe_combine`` over all ``E`` experts.

Dropless: every copy is sent, whatever the load (no capacity factor). The torch path sizes its buffers from
the counts it exchanges (split sizes on the host: one device-to-host sync per dispatch). Under ``jit`` the
receive buffer must be static: the JAX path receives into ``max_recv_rows`` rows, ``n * T * k`` by default (the
worst case: every copy of every rank routed here), rows past the received ones zero; a smaller bound is the
caller's promise (rows beyond it are dropped by the collective) and is checked only for concrete counts.

Steps (both paths): ``moe_permute`` sorts the local copies by global expert, so the copies bound for rank ``d``
are one contiguous chunk; per-expert counts ``[n, E/n]`` go through a (dense) all-to-all; the rows go through
a ragged all-to-all (``all_to_all_single`` with split sizes / ``lax.ragged_all_to_all``); a second, local
``moe_permute`` (``k = 1``) regroups the received rows from (source, expert) order into expert order. Combine
runs the same steps backwards: the local un-sort is ``moe_combine`` with unit weights (exact), the reverse
all-to-all swaps the split sizes, and ``moe_combine`` applies the router weights. Gradients flow through every
step (torch: ``torch.distributed._functional_collectives.all_to_all_single_autograd``, whose backward is the
reverse all-to-all;
JAX: the collectives' transposes).

``lax.ragged_all_to_all`` has no XLA:CPU lowering (``UNIMPLEMENTED: HLO opcode ragged-all-to-all``), so on a
CPU mesh the JAX path runs :func:`ragged_all_to_all_emulated`: the same arguments and semantics (jax's
docstring of ``ragged_all_to_all``) built from ``all_gather`` and a row gather — the emulator is what the CPU
tests check our offsets against; the TPU path passes the identical arguments to the real collective
(compile-checked on ``v5e:2x2``).

Errors (typed, before any collective): ``num_experts`` not divisible by the group / axis size, ranks and
shapes, ids out of range (``moe_permute``'s checks); in torch, ranks that disagree on ``num_experts``, the
ranks or sizes of x and the ids, the dtype, or whether their ids are in range raise ``ArgumentError`` on every rank
(one small all-gather of those numbers before any other check, so no rank is left waiting in a collective whose
peer raised).

Sources: DeepSpeed-MoE / GShard expert parallelism; MaxText's ``ragged_all_to_all`` MoE dispatch
(``get_all_to_all_params``); TorchTitan's ``expert_parallel`` (``all_to_all_single`` with split sizes).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..errors import ArgumentError, DTypeError
from ..library.moe_routing import MoEPermutation, moe_combine, moe_combine_jax, moe_permute, moe_permute_jax
from .sharding import check_ranks_agree, process_group

__all__ = ["ep_dispatch", "ep_combine", "EPHandle", "ep_dispatch_jax", "ep_combine_jax", "EPHandleJax",
           "ragged_all_to_all_emulated"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# ----------------------------------------------------------------------------------------- torch
class EPHandle(NamedTuple):
    """What :func:`ep_combine` needs from :func:`ep_dispatch`: the local sort (``meta``), the regrouping of the
    received rows (``local_meta``), the row counts sent to / received from each rank, and the group."""

    meta: MoEPermutation
    local_meta: Optional[MoEPermutation]
    send_splits: list
    recv_splits: list
    group: object


def _all_to_all_rows(rows: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    # torch's functional collective with autograd (its backward is the reverse all-to-all), as TorchTitan's
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group))


def ep_dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, group=None):
    """Send each token copy to the rank holding its expert (module docstring: layout, dropless, steps).

    Args:
        x: ``[T, D]`` this rank's tokens, bf16/f16/f32 (``T`` may differ between ranks, ``D`` and the dtype not).
        expert_ids: ``[T, k]`` int32/int64 global expert ids in ``[0, num_experts)``.
        num_experts: E, the same on every rank, divisible by the group size n.
        group: a ``torch.distributed`` process group, a 1-D ``DeviceMesh``, or None (the default group).

    Returns:
        ``(x_local [R, D] in x's dtype, group_sizes [E/n] int32, handle)``: the ``R`` rows routed to this rank's
        experts, grouped by local expert (``group_sizes`` sums to R), and the :class:`EPHandle` for
        :func:`ep_combine`. Differentiable in x.

    Raises:
        ArgumentError: E not divisible by n; ranks disagreeing on E, D, k or dtype (on every rank); the shape,
            id-range and dtype checks of ``moe_permute``. DTypeError: x or ids of an unsupported dtype.
    """
    import torch.distributed as dist

    op = "tpukernels.ep_dispatch"
    g = process_group(group)
    n = dist.get_world_size(g)
    # every rank must agree on what shapes the collectives, before any check that could fail on one rank only (it
    # would leave the others waiting in a collective): a fixed set of numbers, gathered and compared on every rank,
    # so all raise together; the checks below then fail on every rank or on none
    e_ok = isinstance(num_experts, int) and not isinstance(num_experts, bool)
    x_ok, ids_ok = isinstance(x, torch.Tensor), isinstance(expert_ids, torch.Tensor)
    in_range = e_ok and ids_ok and bool(((expert_ids >= 0) & (expert_ids < num_experts)).all())  # True if empty
    check_ranks_agree(op, {
        "num_experts": num_experts if e_ok else -1,
        "x.dim()": x.dim() if x_ok else -1,
        "x.shape[1] (hidden size)": x.shape[1] if x_ok and x.dim() >= 2 else -1,
        "x.dtype": _DTYPE_CODES.get(x.dtype, -1) if x_ok else -2,
        "expert_ids.dim()": expert_ids.dim() if ids_ok else -1,
        "expert_ids.shape[1] (top_k)": expert_ids.shape[1] if ids_ok and expert_ids.dim() >= 2 else -1,
        "expert ids in [0, num_experts) (1: yes)": int(in_range)}, g)
    if not e_ok or num_experts < 1:
        raise ArgumentError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    if num_experts % n:
        raise ArgumentError(f"{op}: num_experts = {num_experts} must be divisible by the group size {n} "
                            f"(rank r holds experts [r E/n, (r+1) E/n))")
    if not x_ok or x.dim() != 2:
        raise ArgumentError(f"{op}: x must be a 2-D tensor [T, D], got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in _DTYPE_CODES:
        raise DTypeError(f"{op}: x dtype {x.dtype} is not supported: use bfloat16, float16 or float32")
    if not ids_ok or expert_ids.dim() != 2:
        raise ArgumentError(f"{op}: expert_ids must be a 2-D tensor [T, k], got "
                            f"{getattr(expert_ids, 'shape', type(expert_ids).__name__)}")
    xs, sizes, meta = moe_permute(x, expert_ids, num_experts)
    el = num_experts // n
    counts = sizes.reshape(n, el).to(torch.int64)  # counts[d, e]: copies bound for rank d's local expert e
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=g)  # [source rank, local expert]
    send_splits = counts.sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    recv = _all_to_all_rows(xs, recv_splits, send_splits, g)
    group_sizes = recv_counts.sum(0).to(torch.int32)
    if recv.shape[0] == 0:
        return recv, group_sizes, EPHandle(meta, None, send_splits, recv_splits, g)
    local_ids = torch.repeat_interleave(torch.arange(el, dtype=torch.int32, device=x.device).repeat(n),
                                        recv_counts.reshape(-1).to(x.device))
    x_local, _, local_meta = moe_permute(recv, local_ids[:, None], el)
    return x_local, group_sizes, EPHandle(meta, local_meta, send_splits, recv_splits, g)


def ep_combine(y_local: torch.Tensor, weights: torch.Tensor, handle: EPHandle) -> torch.Tensor:
    """Bring the expert outputs back to their tokens and weight them (module docstring).

    Args:
        y_local: ``[R, D_out]`` the experts' outputs in :func:`ep_dispatch`'s row order (``R`` its rows),
            bf16/f16/f32, the same dtype and ``D_out`` on every rank.
        weights: ``[T, k]`` float router weights of this rank's tokens, in ``expert_ids``' slot order.
        handle: the :class:`EPHandle` of the matching :func:`ep_dispatch`.

    Returns:
        ``[T, D_out]`` in y_local's dtype (float32 sums rounded once); differentiable in y_local and weights.

    Raises:
        ArgumentError: y_local without the dispatched row count; the checks of ``moe_combine``.
    """
    op = "tpukernels.ep_combine"
    if not isinstance(handle, EPHandle):
        raise ArgumentError(f"{op}: handle must be the EPHandle of ep_dispatch, got {type(handle).__name__}")
    rows = sum(handle.recv_splits)
    if not isinstance(y_local, torch.Tensor) or y_local.dim() != 2 or y_local.shape[0] != rows:
        raise ArgumentError(f"{op}: y_local must be [R, D_out] with R = {rows} (the rows ep_dispatch returned), "
                            f"got {getattr(y_local, 'shape', type(y_local).__name__)}")
    if handle.local_meta is not None:
        ones = torch.ones(rows, 1, dtype=torch.float32, device=y_local.device)
        y_recv = moe_combine(y_local, ones, handle.local_meta)  # back to (source rank, expert) order: exact
    else:
        y_recv = y_local
    y_sorted = _all_to_all_rows(y_recv, handle.send_splits, handle.recv_splits, handle.group)
    return moe_combine(y_sorted, weights, handle.meta)


# ----------------------------------------------------------------------------------------- jax
class EPHandleJax(NamedTuple):
    """What :func:`ep_combine_jax` needs from :func:`ep_dispatch_jax` (jax arrays, per device)."""

    meta: tuple
    local_meta: tuple
    input_offsets: object
    send_sizes: object
    recv_offsets: object
    recv_sizes: object
    back_offsets: object
    impl: str


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """``jax.lax.ragged_all_to_all``'s semantics from ``all_gather`` and a row gather, for backends without
    the collective (XLA:CPU). Inside ``shard_map``: device ``i`` sends ``operand[input_offsets[j] :
    input_offsets[j] + send_sizes[j]]`` to device ``j``, where it lands at ``output[output_offsets[j] : ... ]``
    (``output_offsets`` is in the receiver's buffer, as jax defines it); rows nothing lands on keep ``output``'s
    values. ``recv_sizes`` is the receivers' view of ``send_sizes`` (unused: the senders' sizes are gathered).
    Memory: every device gathers every operand (n times the rows): a test and CPU fallback, not a TPU path."""
    import jax
    import jax.numpy as jnp

    del recv_sizes
    ops = jax.lax.all_gather(operand, axis_name)  # [n, R_in, D]
    offs = jax.lax.all_gather(input_offsets, axis_name)  # [n_src, n_dst]
    sizes = jax.lax.all_gather(send_sizes, axis_name)
    outs = jax.lax.all_gather(output_offsets, axis_name)
    me = jax.lax.axis_index(axis_name)
    n = ops.shape[0]
    r = jnp.arange(output.shape[0], dtype=jnp.int32)
    src_dev = jnp.full(r.shape, -1, jnp.int32)
    src_row = jnp.zeros(r.shape, jnp.int32)
    for s in range(n):  # n is static (the axis size)
        lo, cnt = outs[s, me], sizes[s, me]
        hit = (r >= lo) & (r < lo + cnt)
        src_dev = jnp.where(hit, s, src_dev)
        src_row = jnp.where(hit, offs[s, me] + r - lo, src_row)
    got = ops[jnp.clip(src_dev, 0, n - 1), jnp.clip(src_row, 0, operand.shape[0] - 1)]
    return jnp.where((src_dev >= 0)[:, None], got, output)


def _ragged(impl: str):
    import jax

    if impl == "ragged":
        return jax.lax.ragged_all_to_all
    return ragged_all_to_all_emulated


def _exclusive_cumsum(v, axis=0):
    import jax.numpy as jnp

    return jnp.cumsum(v, axis=axis) - v


def ep_dispatch_jax(x, expert_ids, num_experts: int, axis_name: str, *, max_recv_rows: Optional[int] = None,
                    impl: Optional[str] = None, interpret=None):
    """:func:`ep_dispatch` inside ``jax.shard_map`` over ``axis_name`` (module docstring).

    Args:
        x: ``[T, D]`` this device's tokens (bf16/f32). expert_ids: ``[T, k]`` int global expert ids.
        num_experts: E, divisible by the axis size n. axis_name: the expert-parallel mesh axis.
        max_recv_rows: the static receive buffer (default ``n * T * k``, dropless in every case).
        impl: ``"ragged"`` (``lax.ragged_all_to_all``; TPU) or ``"emulated"``
            (:func:`ragged_all_to_all_emulated`); default: emulated on the cpu backend, ragged elsewhere.
        interpret: the moe_permute kernels' interpret mode (None: the process default).

    Returns:
        ``(x_local [max_recv_rows, D], group_sizes [E/n] int32, handle)``: rows grouped by local expert, the
        rows past ``sum(group_sizes)`` zero.

    Raises:
        ArgumentError: E not divisible by n, ``max_recv_rows < 1``, a bad ``impl``; moe_permute's checks.
    """
    import jax
    import jax.numpy as jnp

    op = "tpukernels.ep_dispatch_jax"
    n = jax.lax.axis_size(axis_name)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1 or num_experts % n:
        raise ArgumentError(f"{op}: num_experts must be a positive int divisible by the size {n} of axis "
                            f"{axis_name!r}, got {num_experts!r}")
    impl = impl or ("emulated" if jax.default_backend() == "cpu" else "ragged")
    if impl not in ("ragged", "emulated"):
        raise ArgumentError(f"{op}: impl must be 'ragged' or 'emulated', got {impl!r}")
    t, k = int(expert_ids.shape[0]), int(expert_ids.shape[1])
    cap = n * t * k if max_recv_rows is None else max_recv_rows
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ArgumentError(f"{op}: max_recv_rows must be a positive int, got {max_recv_rows!r}")
    el = num_experts // n
    xs, sizes, meta = moe_permute_jax(x, expert_ids, num_experts, interpret=interpret)
    counts = sizes.reshape(n, el)  # [dest rank, local expert]
    send = counts.sum(1).astype(jnp.int32)
    in_off = _exclusive_cumsum(send)
    recv_counts = jax.lax.all_to_all(counts, axis_name, 0, 0, tiled=True)  # [source rank, local expert]
    recv = recv_counts.sum(1).astype(jnp.int32)
    recv_off = _exclusive_cumsum(recv)
    all_send = jax.lax.all_gather(send, axis_name)  # [source, dest]
    me = jax.lax.axis_index(axis_name)
    out_off = _exclusive_cumsum(all_send, axis=0)[me]  # where my chunk lands in each receiver's buffer
    buf = jnp.zeros((cap, x.shape[1]), x.dtype)
    rows = _ragged(impl)(xs, buf, in_off, send, out_off, recv, axis_name=axis_name)
    # local expert of each received row (from the (source, expert) counts); rows past the received ones: el
    ends = jnp.cumsum(recv_counts.reshape(-1))
    pos = jnp.arange(cap, dtype=jnp.int32)
    slot = jnp.searchsorted(ends, pos, side="right")  # index into the flattened [source, expert] counts
    local_ids = jnp.where(slot < n * el, slot % el, el).astype(jnp.int32)
    x_local, lsizes, local_meta = moe_permute_jax(rows, local_ids[:, None], el + 1, interpret=interpret)
    back = jax.lax.all_to_all(in_off.reshape(n, 1), axis_name, 0, 0, tiled=True).reshape(n)  # senders' offsets
    handle = EPHandleJax(meta, local_meta, in_off, send, recv_off, recv, back, impl)
    return x_local, lsizes[:el], handle


def ep_combine_jax(y_local, weights, handle: EPHandleJax, axis_name: str, *, interpret=None):
    """:func:`ep_combine` inside ``jax.shard_map`` (module docstring).

    Args:
        y_local: ``[max_recv_rows, D_out]`` expert outputs in :func:`ep_dispatch_jax`'s row order (rows past
            ``sum(group_sizes)`` are ignored). weights: ``[T, k]`` float router weights.
        handle: the :class:`EPHandleJax` of the matching dispatch. axis_name: the same mesh axis.

    Returns:
        ``[T, D_out]`` in y_local's dtype.
    """
    import jax.numpy as jnp

    if not isinstance(handle, EPHandleJax):
        raise ArgumentError(f"tpukernels.ep_combine_jax: handle must be the EPHandleJax of ep_dispatch_jax, got "
                            f"{type(handle).__name__}")
    cap = int(handle.local_meta[0].shape[0])
    ones = jnp.ones((cap, 1), jnp.float32)
    y_recv = moe_combine_jax(y_local, ones, handle.local_meta, interpret=interpret)  # (source, expert) order
    t_k = int(handle.meta[0].shape[0])
    buf = jnp.zeros((t_k, y_local.shape[1]), y_local.dtype)
    y_sorted = _ragged(handle.impl)(y_recv, buf, handle.recv_offsets, handle.recv_sizes, handle.back_offsets,
                                    handle.send_sizes, axis_name=axis_name)
    return moe_combine_jax(y_sorted, weights, handle.meta, interpret=interpret)
