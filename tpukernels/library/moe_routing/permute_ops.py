"""MoE permute / combine: sort the ``T * k`` token copies of a top-k routing into expert order (a ragged gather)
for the grouped matmuls, and bring the expert outputs back, weighted, to their tokens (a gather-reduce).

Public API (torch; differentiable through ``torch.library`` ops with ``register_autograd``)::

    moe_permute(x, expert_ids, num_experts) -> (x_sorted, group_sizes, meta)
    moe_combine(y_sorted, weights, meta) -> out
    moe_permute_jax(x, expert_ids, num_experts) / moe_combine_jax(y_sorted, weights, meta)   jax arrays
    moe_permute_reference / moe_combine_reference                                             float64
    MoEPermutation(order, positions, group_sizes)                     the sort metadata (a NamedTuple)

Semantics (``x [T, D]``, ``expert_ids [T, k]`` ints in ``[0, E)``, ``weights [T, k]``)::

    order      = argsort(expert_ids.flatten(), stable=True)     [T*k] int32: sorted row p holds flat slot order[p]
    positions  = inverse of order, as [T, k]                    int32: slot (t, j) sits at sorted row positions[t, j]
    group_sizes[e] = #{(t, j): expert_ids[t, j] == e}           [E] int32, summing to T*k
    x_sorted[p] = x[order[p] // k]                              [T*k, D]: expert 0's rows first, tokens in order
    out[t]     = sum_j weights[t, j] * y_sorted[positions[t, j]]        [T, D], float32 sums rounded once

The rows of expert ``e`` are ``x_sorted[sum(group_sizes[:e]) : sum(group_sizes[:e+1])]`` (``grouped_matmul``'s
contiguous groups, ``jax.lax.ragged_dot``'s layout); within an expert, token order (the stable sort), as
transformers' ``torch.argsort(..., stable=True)`` in its grouped-mm experts path and this project's experts
forward. **Dropless**: every copy is kept, whatever the load (no capacity factor; capacity / token dropping is
not supported). A token routed twice to one expert gets two rows.

Backward: ``dx[t] = sum_j dx_sorted[positions[t, j]]`` (the gather-reduce with unit weights);
``dy_sorted[p] = weights[slot] * dout[order[p] // k]`` (the gather, scaled in float32); ``dweights[t, j] =
<dout[t], y_sorted[positions[t, j]]>`` (float32 row dots over a gather of y_sorted back into slot order).
Ids, group sizes and the metadata get no gradient.

Design. Two DSL kernels move whole rows with DMAs, rows viewed as ``[S, D/S]`` slabs (``S`` = 8 sublanes for
32-bit, 16 for 16-bit data when it divides D with at least 128 lanes left, else 1; 16-bit rows whose ``D/16`` is
not a multiple of 128 but ``D/8`` is take ``S = 8``: libtpu 0.0.52's profiler aborts on the ``[16, 448]`` slabs of
DeepSeek-V3's D = 7168 and estimates ``[8, 896]``), so a row is one index of a leading dim and every copy is
tile-aligned:

* ``tpukernels::moe_gather_fwd(x [N, S, L], idx [M] int32) -> [M, S, L]``: grid ``cdiv(M, block_rows)``; the
  block's indices come into SMEM (a blocked SMEM operand), ``x`` stays in HBM (``pl.ANY``), and the body starts
  one row DMA per output row straight into the output block, then waits for them.
* ``tpukernels::moe_gather_reduce_fwd(y [M, S, L], pos [T*k] int32, w [T*k] f32, top_k) -> [T, S, L]``: grid
  ``cdiv(T, block_tokens)``; ``block_tokens * k`` row DMAs into a VMEM buffer, then per token the float32 sum of
  its k rows times their weights (SMEM scalars), rounded once to y's dtype.

Both are bound by the work per row DMA, so a full block's start loop is unrolled (:data:`UNROLL`) and its copies
are waited for by one wait on a block-sized descriptor (the row copies' bytes add up to it); a partial last block
goes row by row; at most :data:`MAX_ROWS_IN_FLIGHT` rows per step. libtpu's static estimate of the gather, 8192
rows of 4 KiB in 256-row blocks: v6e 205 µs with a wait per row, 117 µs with one wait and the unrolled loop
(copies HBM -> HBM instead of into the output block: 98 µs, but libtpu aborts on them on tpu7x,
``fifo_tracker.cc:436``); tpu7x 242 -> 75 µs. XLA's own gather of the same rows estimates 14 µs on v6e, under the
41 µs its bytes need at HBM bandwidth (the model does not cost its traffic). The MoE bench family
(``tpukernels.bench.moe``) shows what these kernels cost a whole layer.

The sort itself is ``torch.argsort(stable=True)`` / ``jnp.argsort(stable=True)`` (an XLA sort of T*k int keys):
a Pallas sort gains nothing over XLA's on TPU (a sorting network over a few thousand keys, memory-light), and
the counting form (a [T*k, E] one-hot cumsum) moves more data than the sort; group sizes are a fixed-length
``scatter_add`` (no data-dependent shape, so no graph break under ``torch.compile``).

Checked before any kernel runs (typed errors): ranks, shapes, dtypes, ``num_experts``; id values in
``[0, E)`` and the metadata's ``group_sizes`` summing to ``T*k`` when the tensors are on the cpu (device tensors
would need a sync: out-of-range ids are clamped in the kernels, never read out of bounds).

Tuning: ``block_rows`` (gather) and ``block_tokens`` (gather-reduce); no tables shipped (the heuristic keeps at
most ~8 MiB and :data:`MAX_ROWS_IN_FLIGHT` rows in flight).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ... import dsl as tk
from ...chips import MiB
from ...errors import ArgumentError, DTypeError
from .common import F32, INTS, check_same_device, shape_of

__all__ = ["moe_permute", "moe_combine", "moe_permute_jax", "moe_combine_jax", "MoEPermutation",
           "moe_permute_reference", "moe_combine_reference", "moe_gather_fwd", "moe_gather_reduce_fwd",
           "row_view", "BLOCK_ROWS", "BLOCK_TOKENS", "ROWS_IN_FLIGHT_BYTES", "MAX_ROWS_IN_FLIGHT", "UNROLL"]

NAMESPACE = "tpukernels"
BLOCK_ROWS = (128, 256, 512, 1024)
BLOCK_TOKENS = (16, 32, 64, 128, 256)
#: VMEM bytes of gathered rows per grid step (the output block, double-buffered, or the gather-reduce buffer)
ROWS_IN_FLIGHT_BYTES = 8 * MiB
#: at most this many row copies in flight per grid step (one semaphore, one wait): libtpu 0.0.52's static profiler
#: of tpu7x costs the gather-reduce of 8,192 rows of 8 KiB at 150 ms with 512 rows per step, 86 µs with 256
MAX_ROWS_IN_FLIGHT = 256
_FLOATS = (torch.bfloat16, torch.float32)


class MoEPermutation(NamedTuple):
    """The sort metadata of :func:`moe_permute`: ``order [T*k]`` int32 (sorted row -> flat slot ``t*k + j``),
    ``positions [T, k]`` int32 (slot -> sorted row), ``group_sizes [E]`` int32 (rows per expert)."""

    order: torch.Tensor
    positions: torch.Tensor
    group_sizes: torch.Tensor


def row_view(d: int, itemsize: int) -> int:
    """``S``: rows of D elements are moved as ``[S, D/S]`` slabs (module docstring)."""
    s = 8 * (4 // itemsize)
    for c in (s, 8):  # the dtype's sublane tile, else 8 rows, with whole 128-lane columns
        if d % c == 0 and (d // c) % 128 == 0:
            return c
    return s if d % s == 0 and d // s >= 128 else 1


# ----------------------------------------------------------------------------------------- kernels
#: row DMAs started per loop iteration (the scalar loop's overhead per row is what bounds these kernels)
UNROLL = 8


def _start_rows(count, start, static: bool):
    """``start(r)`` for ``r < count``: unrolled when ``count`` is the static block size."""
    def body(r, c):
        start(r)
        return c

    jax.lax.fori_loop(0, count, body, 0, unroll=UNROLL if static else 1)


def _wait_rows(full: bool, rows, whole, one):
    """Wait for ``rows`` row copies signalled on one semaphore: a full block by one wait on a descriptor of the
    whole block (``whole()``: its byte count is the rows' sum), a partial block row by row (``one()``)."""
    if full:
        whole().wait()
        return

    def body(r, c):
        one().wait()
        return c

    jax.lax.fori_loop(0, rows, body, 0)


def _gather_body(x_hbm, idx_ref, o_ref, sem, *, bm: int, m: int, n_src: int):
    base = pl.program_id(0) * bm
    rows = jnp.minimum(bm, m - base)

    def start(r):
        src = jnp.minimum(jnp.maximum(idx_ref[r], 0), n_src - 1)
        pltpu.make_async_copy(x_hbm.at[pl.ds(src, 1)], o_ref.at[pl.ds(r, 1)], sem.at[0]).start()

    def run(full: bool):
        _start_rows(bm if full else rows, start, full)
        _wait_rows(full, rows, lambda: pltpu.make_async_copy(x_hbm.at[pl.ds(0, bm)], o_ref, sem.at[0]),
                   lambda: pltpu.make_async_copy(x_hbm.at[pl.ds(0, 1)], o_ref.at[pl.ds(0, 1)], sem.at[0]))

    if m % bm == 0:
        run(True)
    else:
        jax.lax.cond(rows == bm, lambda: run(True), lambda: run(False))


def _check_rows(op, x, idx, idx_name):
    if len(x.shape) != 3:
        raise ArgumentError(f"{op}: rows must be [N, S, D/S], got {tuple(x.shape)}")
    if np.dtype(x.dtype).name not in ("bfloat16", "float32"):
        raise DTypeError(f"{op}: rows have dtype {np.dtype(x.dtype).name}: use bfloat16 or float32")
    if len(idx.shape) != 1 or np.dtype(idx.dtype).name != "int32":
        raise ArgumentError(f"{op}: {idx_name} must be int32 [rows], got {tuple(idx.shape)} {np.dtype(idx.dtype).name}")


def _gather_heuristic(x, idx):
    row = int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize
    best = BLOCK_ROWS[0]
    for b in BLOCK_ROWS:
        if 2 * b * row <= ROWS_IN_FLIGHT_BYTES and b <= MAX_ROWS_IN_FLIGHT:
            best = b
    return {"block_rows": best}


@tk.tpu_kernel(
    _gather_body, name="moe_gather_fwd", namespace=NAMESPACE, heuristic=_gather_heuristic,
    tunables={"block_rows": tk.Tunable(BLOCK_ROWS, default=256, doc="output rows per grid step")},
    out_shape=lambda x, idx: tk.OutSpec((idx.shape[0], *x.shape[1:]), x.dtype),
)
def moe_gather_fwd(x: torch.Tensor, idx: torch.Tensor, *, block_rows: int) -> torch.Tensor:
    """``out[p] = x[idx[p]]`` on ``[N, S, L]`` row slabs, bf16/f32; idx int32 ``[M]`` (clamped to ``[0, N)``)
    (internal op; use :func:`moe_permute`)."""
    op = f"{NAMESPACE}::moe_gather_fwd"
    _check_rows(op, x, idx, "idx")
    n = int(x.shape[0])
    m = int(idx.shape[0])
    if n == 0:
        raise ArgumentError(f"{op}: x has no rows to gather from")
    bm = m if m <= block_rows else int(block_rows)
    row = int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize
    return tk.Launch(
        grid=(tk.cdiv(m, bm),),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((bm,), lambda i: (i,), memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((bm, *x.shape[1:]), lambda i: (i, 0, 0)),
        out_shape=tk.OutSpec((m, *x.shape[1:]), x.dtype),
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        dimension_semantics=("parallel",),
        vmem_limit_bytes=max(32 * MiB, 3 * bm * row),
        body_kwargs={"bm": int(bm), "m": m, "n_src": n},
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=int(2 * m * row + 4 * m)),
    )


def _gather_reduce_body(y_hbm, pos_ref, w_ref, o_ref, buf, sem, *, bt: int, k: int, t_total: int, n_src: int):
    base = pl.program_id(0) * bt
    toks = jnp.minimum(bt, t_total - base)

    def start(r):
        src = jnp.minimum(jnp.maximum(pos_ref[r], 0), n_src - 1)
        pltpu.make_async_copy(y_hbm.at[pl.ds(src, 1)], buf.at[pl.ds(r, 1)], sem.at[0]).start()

    def fetch(full: bool):
        _start_rows(bt * k if full else toks * k, start, full)
        _wait_rows(full, toks * k, lambda: pltpu.make_async_copy(y_hbm.at[pl.ds(0, bt * k)], buf, sem.at[0]),
                   lambda: pltpu.make_async_copy(y_hbm.at[pl.ds(0, 1)], buf.at[pl.ds(0, 1)], sem.at[0]))

    if t_total % bt == 0:
        fetch(True)
    else:
        jax.lax.cond(toks == bt, lambda: fetch(True), lambda: fetch(False))

    def reduce(t, c):
        acc = buf[t * k].astype(F32) * w_ref[t * k]
        for j in range(1, k):
            acc = acc + buf[t * k + j].astype(F32) * w_ref[t * k + j]
        o_ref[t] = acc.astype(o_ref.dtype)
        return c

    jax.lax.fori_loop(0, toks, reduce, 0)


def fit_tokens(block_tokens: int, t: int, k: int, row_bytes: int) -> int:
    """Tokens per gather-reduce step: all T when ``T <= block_tokens``; else a multiple of ``128 / gcd(k, 128)``
    (the SMEM index block of ``tokens * k`` entries spans whole 128-lanes) no larger than block_tokens, halved
    while its rows exceed :data:`ROWS_IN_FLIGHT_BYTES`."""
    unit = 128 // math.gcd(k, 128)
    bt = max(unit, (int(block_tokens) // unit) * unit)
    while bt > unit and (bt * k * row_bytes > ROWS_IN_FLIGHT_BYTES or bt * k > MAX_ROWS_IN_FLIGHT):
        bt = max(unit, (bt // 2 // unit) * unit)
    return int(t) if t <= bt else bt


def _reduce_heuristic(y, pos, w, top_k):
    row = int(np.prod(y.shape[1:])) * np.dtype(y.dtype).itemsize
    best = BLOCK_TOKENS[0]
    for b in BLOCK_TOKENS:
        if b * top_k * row <= ROWS_IN_FLIGHT_BYTES and b * top_k <= MAX_ROWS_IN_FLIGHT:
            best = b
    return {"block_tokens": best}


@tk.tpu_kernel(
    _gather_reduce_body, name="moe_gather_reduce_fwd", namespace=NAMESPACE, heuristic=_reduce_heuristic,
    tunables={"block_tokens": tk.Tunable(BLOCK_TOKENS, default=64, doc="tokens per grid step (upper bound)")},
    out_shape=lambda y, pos, w, top_k: tk.OutSpec((pos.shape[0] // top_k, *y.shape[1:]), y.dtype),
)
def moe_gather_reduce_fwd(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, top_k: int, *,
                          block_tokens: int) -> torch.Tensor:
    """``out[t] = sum_j w[t*k + j] * y[pos[t*k + j]]`` (float32 sum, rounded to y's dtype) on ``[M, S, L]`` row
    slabs; pos int32 / w float32 ``[T*k]`` (internal op; use :func:`moe_combine`)."""
    op = f"{NAMESPACE}::moe_gather_reduce_fwd"
    _check_rows(op, y, pos, "pos")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1 or pos.shape[0] % top_k:
        raise ArgumentError(f"{op}: top_k = {top_k!r} must be a positive int dividing len(pos) = {pos.shape[0]}")
    if tuple(w.shape) != tuple(pos.shape) or np.dtype(w.dtype).name != "float32":
        raise ArgumentError(f"{op}: w must be float32 {list(pos.shape)} (like pos), got {tuple(w.shape)} "
                            f"{np.dtype(w.dtype).name}")
    n = int(y.shape[0])
    if n == 0:
        raise ArgumentError(f"{op}: y has no rows to gather from")
    t = int(pos.shape[0]) // top_k
    row = int(np.prod(y.shape[1:])) * np.dtype(y.dtype).itemsize
    bt = fit_tokens(block_tokens, t, top_k, row)
    blk = pl.BlockSpec((bt * top_k,), lambda i: (i,), memory_space=pltpu.SMEM)
    return tk.Launch(
        grid=(tk.cdiv(t, bt),),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), blk, blk],
        out_specs=pl.BlockSpec((bt, *y.shape[1:]), lambda i: (i, 0, 0)),
        out_shape=tk.OutSpec((t, *y.shape[1:]), y.dtype),
        scratch_shapes=[pltpu.VMEM((bt * top_k, *y.shape[1:]), y.dtype), pltpu.SemaphoreType.DMA((1,))],
        dimension_semantics=("parallel",),
        vmem_limit_bytes=max(32 * MiB, 2 * (bt * top_k + 2 * bt) * row),
        body_kwargs={"bt": int(bt), "k": int(top_k), "t_total": t, "n_src": n},
        cost_estimate=pl.CostEstimate(flops=int(2 * t * top_k * row // np.dtype(y.dtype).itemsize),
                                      transcendentals=0, bytes_accessed=int((t * top_k + t) * row + 8 * t * top_k)),
    )


# ----------------------------------------------------------------------------------------- torch glue
def _rows3(x2):
    """``[N, D]`` -> the ``[N, S, D/S]`` view the kernels move."""
    n, d = x2.shape
    s = row_view(d, x2.element_size())
    return x2.reshape(n, s, d // s)


def gather_rows(x2: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x2[idx]`` (``[N, D]`` bf16/f32, idx int ``[M]``) through :func:`moe_gather_fwd`."""
    m, d = idx.shape[0], x2.shape[1]
    if m == 0 or x2.shape[0] == 0 or d == 0:
        return x2.new_zeros(m, d)
    out = torch.ops.tpukernels.moe_gather_fwd(_rows3(x2.contiguous()), idx.to(torch.int32).contiguous())
    return out.reshape(m, d)


def gather_reduce_rows(y2: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """``sum_j w[t, j] * y2[pos[t, j]]`` (``pos`` / ``w`` ``[T, k]``) through :func:`moe_gather_reduce_fwd`."""
    t, d = pos.shape[0], y2.shape[1]
    if t == 0 or y2.shape[0] == 0 or d == 0:
        return y2.new_zeros(t, d)
    out = torch.ops.tpukernels.moe_gather_reduce_fwd(_rows3(y2.contiguous()), pos.reshape(-1).to(torch.int32).contiguous(),
                                                     w.reshape(-1).float().contiguous(), k)
    return out.reshape(t, d)


def _widen(t):
    return t.float() if t.dtype == torch.float16 else t


@torch.library.custom_op("tpukernels::moe_permute", mutates_args=())
def _permute_op(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), device=order.device)
    sizes = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat.clamp(0, max(num_experts - 1, 0)), torch.ones_like(flat, dtype=torch.int32))
    xs = gather_rows(_widen(x), torch.div(order, k, rounding_mode="floor")).to(x.dtype)
    return xs, sizes, order.to(torch.int32), positions.to(torch.int32).reshape(t, k)


@_permute_op.register_fake
def _(x, expert_ids, num_experts):
    t, k = expert_ids.shape
    return (x.new_empty(t * k, x.shape[1]), x.new_empty(num_experts, dtype=torch.int32),
            x.new_empty(t * k, dtype=torch.int32), x.new_empty(t, k, dtype=torch.int32))


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(output[3])
    ctx.x_dtype = inputs[0].dtype


def _permute_backward(ctx, d_xs, d_sizes, d_order, d_pos):
    (positions,) = ctx.saved_tensors
    if d_xs is None:
        return None, None, None
    t, k = positions.shape
    g = _widen(d_xs)
    dx = gather_reduce_rows(g, positions, torch.ones(t, k, dtype=torch.float32, device=g.device), k)
    return dx.to(ctx.x_dtype), None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("tpukernels::moe_combine", mutates_args=())
def _combine_op(y_sorted: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    k = positions.shape[1]
    out = gather_reduce_rows(_widen(y_sorted), positions, weights.float(), k)
    return out.to(y_sorted.dtype)


@_combine_op.register_fake
def _(y_sorted, weights, order, positions):
    return y_sorted.new_empty(positions.shape[0], y_sorted.shape[1])


def _combine_setup(ctx, inputs, output):
    y_sorted, weights, order, positions = inputs
    ctx.save_for_backward(y_sorted, weights, order, positions)


def _combine_backward(ctx, dout):
    y_sorted, weights, order, positions = ctx.saved_tensors
    t, k = positions.shape
    d_y = d_w = None
    g = _widen(dout.contiguous())
    if ctx.needs_input_grad[0]:
        olong = order.long()
        rows = gather_rows(g, torch.div(olong, k, rounding_mode="floor"))
        d_y = (rows.float() * weights.reshape(-1).float()[olong, None]).to(y_sorted.dtype)
    if ctx.needs_input_grad[1]:
        ys = gather_rows(_widen(y_sorted), positions.reshape(-1)).reshape(t, k, -1)
        d_w = (ys.float() * g.float()[:, None, :]).sum(-1).to(weights.dtype)
    return d_y, d_w, None, None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


# ----------------------------------------------------------------------------------------- public ops
def _check_x(op, name, x):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ArgumentError(f"{op}: {name} must be a 2-D tensor [rows, hidden], got {shape_of(x)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"{op}: {name} dtype {x.dtype} is not supported: use bfloat16, float16 or float32")


def _host_values(t: torch.Tensor) -> bool:
    """Whether the values of ``t`` are checked here: a cpu tensor outside torch.compile tracing."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def moe_permute(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """Sort the token copies of a top-k routing into expert order (module docstring: semantics, dropless).

    Args:
        x: ``[T, D]`` hidden states, bf16/f16/f32.
        expert_ids: ``[T, k]`` int32/int64 expert of each copy (a router's ids), values in ``[0, num_experts)``.
        num_experts: E, the length of ``group_sizes``.

    Returns:
        ``(x_sorted [T*k, D] in x's dtype, group_sizes int32 [E], meta)``: ``meta`` a :class:`MoEPermutation`
        for :func:`moe_combine`. Differentiable in x.

    Raises:
        ArgumentError: ranks / shapes, ``num_experts < 1``, ids out of ``[0, num_experts)`` (cpu tensors;
            under ``torch.compile`` the compiled graph asserts the range instead: a RuntimeError when it runs).
        DTypeError: x not bf16/f16/f32, ids not int32/int64. DeviceError: ids on another device.
    """
    op = "tpukernels.moe_permute"
    _check_x(op, "x", x)
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ArgumentError(f"{op}: expert_ids must be [T, k] with T = x.shape[0] = {x.shape[0]}, got "
                            f"{shape_of(expert_ids)}")
    if expert_ids.dtype not in INTS:
        raise DTypeError(f"{op}: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ArgumentError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    check_same_device(op, "x", x, expert_ids=expert_ids)
    if expert_ids.numel() and _host_values(expert_ids):
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ArgumentError(f"{op}: expert_ids must be in [0, num_experts = {num_experts}), got values in "
                                f"[{lo}, {hi}]")
    elif expert_ids.numel() and expert_ids.device.type == "cpu":  # traced by torch.compile: values unknown here
        # an id out of range would otherwise be counted into a wrong group (silently); the graph asserts it
        torch._assert_async(((expert_ids >= 0) & (expert_ids < num_experts)).all(),
                            f"{op}: expert_ids must be in [0, num_experts = {num_experts})")
    xs, sizes, order, positions = torch.ops.tpukernels.moe_permute(x, expert_ids, num_experts)
    return xs, sizes, MoEPermutation(order, positions, sizes)


def moe_combine(y_sorted: torch.Tensor, weights: torch.Tensor, meta: MoEPermutation) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y_sorted[meta.positions[t, j]]`` (module docstring): the expert outputs
    back to their tokens, weighted (float32 sums rounded once to y_sorted's dtype).

    Args:
        y_sorted: ``[T*k, D]`` expert outputs in :func:`moe_permute`'s row order, bf16/f16/f32.
        weights: ``[T, k]`` float (the router's weights, in expert_ids' slot order).
        meta: the :class:`MoEPermutation` of the matching :func:`moe_permute` call.

    Returns:
        ``[T, D]`` in y_sorted's dtype; differentiable in y_sorted and weights.

    Raises:
        ArgumentError: shapes (y_sorted rows != T*k, weights not [T, k], meta's tensors not ``[T*k]`` /
            ``[T, k]`` / ``[E]``), ``group_sizes`` not summing to T*k (cpu tensors). DTypeError: bad dtypes.
        DeviceError: arguments on different devices.
    """
    op = "tpukernels.moe_combine"
    _check_x(op, "y_sorted", y_sorted)
    if not isinstance(meta, tuple) or len(meta) != 3:
        raise ArgumentError(f"{op}: meta must be the MoEPermutation (order, positions, group_sizes) of moe_permute, "
                            f"got {type(meta).__name__}")
    order, positions, sizes = meta
    for name, v in (("meta.order", order), ("meta.positions", positions), ("meta.group_sizes", sizes)):
        if not isinstance(v, torch.Tensor) or v.dtype not in INTS:
            raise DTypeError(f"{op}: {name} must be an int32/int64 tensor, got {getattr(v, 'dtype', type(v).__name__)}")
    if positions.dim() != 2:
        raise ArgumentError(f"{op}: meta.positions must be [T, k], got {tuple(positions.shape)}")
    t, k = positions.shape
    if tuple(order.shape) != (t * k,):
        raise ArgumentError(f"{op}: meta.order must be [T*k] = [{t * k}], got {tuple(order.shape)}")
    if sizes.dim() != 1:
        raise ArgumentError(f"{op}: meta.group_sizes must be [num_experts], got {tuple(sizes.shape)}")
    if y_sorted.shape[0] != t * k:
        raise ArgumentError(f"{op}: y_sorted must have T*k = {t * k} rows (meta.positions is [{t}, {k}]), got "
                            f"{y_sorted.shape[0]}")
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (t, k):
        raise ArgumentError(f"{op}: weights must be [T, k] = [{t}, {k}], got {shape_of(weights)}")
    if not weights.is_floating_point():
        raise DTypeError(f"{op}: weights must be a float tensor, got {weights.dtype}")
    check_same_device(op, "y_sorted", y_sorted, weights=weights, order=order, positions=positions,
                      group_sizes=sizes)
    if _host_values(sizes):
        total = int(sizes.sum())
        if total != t * k or (sizes.numel() and int(sizes.min()) < 0):
            raise ArgumentError(f"{op}: meta.group_sizes must be non-negative and sum to T*k = {t * k}, got sum "
                                f"{total}")
    if _host_values(positions) and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= t * k:
            raise ArgumentError(f"{op}: meta.positions must be in [0, T*k = {t * k}), got [{lo}, {hi}]")
    return torch.ops.tpukernels.moe_combine(y_sorted, weights, order.to(torch.int32), positions.to(torch.int32))


# ----------------------------------------------------------------------------------------- JAX entries
def _jax_rows3(x2):
    n, d = x2.shape
    s = row_view(d, np.dtype(x2.dtype).itemsize)
    return x2.reshape(n, s, d // s)


def _jax_gather(x2, idx, interpret):
    from ...targets.jax_entry import jax_call

    m, d = int(idx.shape[0]), int(x2.shape[1])
    if m == 0 or x2.shape[0] == 0:
        return jnp.zeros((m, d), x2.dtype)
    return jax_call(moe_gather_fwd, _jax_rows3(x2), idx.astype(jnp.int32), interpret=interpret).reshape(m, d)


def _jax_gather_reduce(y2, pos, w, k, interpret):
    from ...targets.jax_entry import jax_call

    t, d = int(pos.shape[0]), int(y2.shape[1])
    if t == 0 or y2.shape[0] == 0:
        return jnp.zeros((t, d), y2.dtype)
    return jax_call(moe_gather_reduce_fwd, _jax_rows3(y2), pos.reshape(-1).astype(jnp.int32),
                    w.reshape(-1).astype(jnp.float32), k, interpret=interpret).reshape(t, d)


def _jax_check(op, x, name):
    if len(x.shape) != 2:
        raise ArgumentError(f"{op}: {name} must be [rows, hidden], got {tuple(x.shape)}")
    if np.dtype(x.dtype).name not in ("bfloat16", "float32"):
        raise DTypeError(f"{op}: {name} dtype {np.dtype(x.dtype).name} is not supported: use bfloat16 or float32")


def moe_permute_jax(x, expert_ids, num_experts: int, *, interpret=None):
    """:func:`moe_permute` on jax arrays (trace-safe; ``x`` bf16/f32): ``(x_sorted, group_sizes int32,
    (order, positions, group_sizes))``; differentiable in x (``jax.custom_vjp``). Id values are checked when
    concrete (not tracers)."""
    op = "tpukernels.moe_permute_jax"
    _jax_check(op, x, "x")
    if len(expert_ids.shape) != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ArgumentError(f"{op}: expert_ids must be [T, k] with T = {x.shape[0]}, got {tuple(expert_ids.shape)}")
    if not np.issubdtype(np.dtype(expert_ids.dtype), np.integer):
        raise DTypeError(f"{op}: expert_ids must be integers, got {np.dtype(expert_ids.dtype).name}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ArgumentError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(expert_ids, jax.core.Tracer) and expert_ids.size:
        lo, hi = int(jnp.min(expert_ids)), int(jnp.max(expert_ids))
        if lo < 0 or hi >= num_experts:
            raise ArgumentError(f"{op}: expert_ids must be in [0, num_experts = {num_experts}), got [{lo}, {hi}]")
    t, k = int(expert_ids.shape[0]), int(expert_ids.shape[1])
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    positions = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=jnp.int32)).reshape(t, k)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")
    # the index arrays are arguments of the custom_vjp functions, not closures: a custom_vjp that closes over a
    # tracer of an enclosing trace (e.g. ids traced by shard_map, then differentiated) leaks it
    @jax.custom_vjp
    def gather(xv, order_, positions_):
        return _jax_gather(xv, order_ // k, interpret)

    def fwd(xv, order_, positions_):
        return gather(xv, order_, positions_), positions_

    def bwd(positions_, g):
        return _jax_gather_reduce(g, positions_, jnp.ones((t, k), jnp.float32), k, interpret), None, None

    gather.defvjp(fwd, bwd)
    return gather(x, order, positions), sizes, (order, positions, sizes)


def moe_combine_jax(y_sorted, weights, meta, *, interpret=None):
    """:func:`moe_combine` on jax arrays (trace-safe; ``y_sorted`` bf16/f32): ``[T, D]``; differentiable in
    y_sorted and weights (``jax.custom_vjp``)."""
    op = "tpukernels.moe_combine_jax"
    _jax_check(op, y_sorted, "y_sorted")
    order, positions, sizes = meta
    t, k = int(positions.shape[0]), int(positions.shape[1])
    if y_sorted.shape[0] != t * k or tuple(weights.shape) != (t, k) or tuple(order.shape) != (t * k,):
        raise ArgumentError(f"{op}: y_sorted must be [T*k, D], weights [T, k], meta.order [T*k] with [T, k] = "
                            f"[{t}, {k}] (meta.positions), got {tuple(y_sorted.shape)}, {tuple(weights.shape)}, "
                            f"{tuple(order.shape)}")
    if not isinstance(sizes, jax.core.Tracer) and int(jnp.sum(sizes)) != t * k:
        raise ArgumentError(f"{op}: meta.group_sizes must sum to T*k = {t * k}, got {int(jnp.sum(sizes))}")

    @jax.custom_vjp  # index arrays as arguments, not closures (see moe_permute_jax)
    def combine(y, w, order_, positions_):
        return _jax_gather_reduce(y, positions_, w, k, interpret)

    def fwd(y, w, order_, positions_):
        return combine(y, w, order_, positions_), (y, w, order_, positions_)

    def bwd(res, g):
        y, w, order_, positions_ = res
        rows = _jax_gather(g, order_ // k, interpret)
        dy = (rows.astype(jnp.float32) * w.reshape(-1).astype(jnp.float32)[order_][:, None]).astype(y.dtype)
        ys = _jax_gather(y, positions_.reshape(-1), interpret).reshape(t, k, -1)
        dw = jnp.sum(ys.astype(jnp.float32) * g.astype(jnp.float32)[:, None, :], -1).astype(w.dtype)
        return dy, dw, None, None

    combine.defvjp(fwd, bwd)
    return combine(y_sorted, weights, order.astype(jnp.int32), positions.astype(jnp.int32))


# ----------------------------------------------------------------------------------------- float64 references
def moe_permute_reference(x, expert_ids, num_experts):
    """float64 ``(x_sorted, group_sizes int64, order int64)`` by a Python bucket pass (expert by expert, tokens
    in order): independent of argsort."""
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1).tolist()
    order = [s for e in range(num_experts) for s, v in enumerate(flat) if v == e]
    order_t = torch.tensor(order, dtype=torch.int64)
    sizes = torch.tensor([flat.count(e) for e in range(num_experts)], dtype=torch.int64)
    return x.double()[torch.div(order_t, k, rounding_mode="floor")], sizes, order_t


def moe_combine_reference(y_sorted, weights, order):
    """float64 ``out[t] = sum_j weights[t, j] * y_sorted[row of slot (t, j)]`` by scattering each sorted row to
    its slot."""
    t, k = weights.shape
    slots = torch.zeros(t * k, y_sorted.shape[1], dtype=torch.float64)
    slots[order.long()] = y_sorted.double()
    return (slots.reshape(t, k, -1) * weights.double()[..., None]).sum(1)


#: ``(args, kwargs)`` compiled by the aot tests: Mixtral-8x7B (D = 4096, top-2) and DeepSeek-V3 (D = 7168,
#: top-8) at 4096 tokens, bf16.
STANDARD_SHAPES = [
    (moe_gather_fwd, ("4096x16x256:bf16", "8192:i32"), {}),
    (moe_gather_reduce_fwd, ("8192x16x256:bf16", "8192:i32", "8192:f32"), {"top_k": 2}),
    (moe_gather_fwd, ("4096x16x448:bf16", "32768:i32"), {}),
    (moe_gather_reduce_fwd, ("32768x16x448:bf16", "32768:i32", "32768:f32"), {"top_k": 8}),
]
