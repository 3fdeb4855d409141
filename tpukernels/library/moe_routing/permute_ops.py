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

Backward: ``dx[t] = sum_j dx_sorted[positions[t, j]]`` (the combine with unit weights);
``dy_sorted[p] = weights[slot] * dout[order[p] // k]`` (the gather, scaled in float32); ``dweights[t, j] =
<dout[t], y_sorted[positions[t, j]]>`` (float32 row dots over a gather of y_sorted back into slot order).
Ids, group sizes and the metadata get no gradient.

Design. Three DSL kernels move whole rows, viewed as ``[S, D/S]`` slabs (``S`` = 8 sublanes for 32-bit, 16 for
16-bit data when it divides D with at least 128 lanes left, else 1; 16-bit rows whose ``D/16`` is not a multiple
of 128 but ``D/8`` is take ``S = 8``: libtpu 0.0.52's profiler aborts on the ``[16, 448]`` slabs of DeepSeek-V3's
D = 7168 and estimates ``[8, 896]``), so a row is one index of a leading dim and every copy is tile-aligned. The
two gathers read their source rows one of two ways (the ``source`` tunable):

* ``"vmem"`` (resident): the whole source array is one VMEM block (``pl.Buffered(1)``: its index never changes,
  so it is copied in once), and a row is one dynamic-index load and store. Chosen by :func:`resident_fits`: the
  source, the blocks and :data:`RESIDENT_HEADROOM` fit the chip's VMEM cap and the source has at most
  :data:`RESIDENT_ROWS_PER_READ` rows per row read (the permute reads x's T rows k times each).
* ``"hbm"``: the source stays in HBM (``pl.ANY``) and each row is one DMA.

* ``tpukernels::moe_gather_fwd(x [N, S, L], idx [M] int32) -> [M, S, L]``: grid ``cdiv(M, block_rows)``; the
  block's indices come into SMEM (a blocked SMEM operand), and each output row is loaded from the resident x, or
  copied by a row DMA straight into the output block (the DMAs are then waited for).
* ``tpukernels::moe_gather_reduce_fwd(y [M, S, L], pos [T*k] int32, w [T*k] f32, top_k) -> [T, S, L]``: grid
  ``cdiv(T, block_tokens)``; per token the float32 sum of its k rows times their weights (SMEM scalars), rounded
  once to y's dtype; the rows are read from the resident y, or first copied into a VMEM buffer by
  ``block_tokens * k`` row DMAs.
* ``tpukernels::moe_scatter_add_fwd(y [M, S, L], tok [M] int32, w [M] f32, num_tokens) -> [T, S, L]``: the
  combine the other way round, where its accumulator fits (:func:`scatter_add_fits`): y is read once, in order,
  in pipelined ``block_rows`` blocks, and each row times its weight is added to its token's row of a float32
  ``[T, S, L]`` VMEM accumulator (a dynamic-row load, add and store; a sequential grid); the last step rounds the
  accumulator once into the output, one whole VMEM block written back after it. A row whose token is out of
  range adds nothing. :func:`combine_rows` (moe_combine, the permute's backward) takes it with ``tok = order //
  k`` and the weights in expert order, else the gather-reduce. Each token's k terms are summed in expert order
  rather than j order (both in float32, rounded once). (A first version wrote the output in chunks by DMA from
  two VMEM staging buffers, slightly faster in the model, but it hung jax's TPU interpreter under a 4-device CPU
  mesh: tests/test_expert_parallel.py.)

Both are bound by the scalar work per row, so a full block's row loop is unrolled (:data:`UNROLL`); row DMAs are
waited for by one wait on a block-sized descriptor (the row copies' bytes add up to it); a partial last block
goes row by row; at most :data:`MAX_ROWS_IN_FLIGHT` copied rows per step. libtpu 0.0.52's static estimate (a
model; ``benchmarks/probes/moe_row_source_probe.py``): a row DMA costs ~23-28 cycles to issue, a resident row load
~5-6. The permute gather of Qwen3-30B-A3B
prefill (65,536 rows of 4 KiB from 8,192 tokens) is 1,030 µs by row DMAs and 229 µs resident on v6e; its combine
1,174 µs by the gather-reduce's row DMAs and 455 µs by the scatter-add (12.2 cycles per row). By DMAs, 8192
rows of 4 KiB in 256-row blocks: v6e 205 µs with a wait per row, 117 µs with one wait and the unrolled loop
(copies HBM -> HBM instead of into the output block: 98 µs, but libtpu aborts on them on tpu7x,
``fifo_tracker.cc:436``); tpu7x 242 -> 75 µs. XLA's own gather of the same rows estimates 14 µs on v6e, under the
41 µs its bytes need at HBM bandwidth (the model does not cost its traffic). The MoE bench family
(``tpukernels.bench.moe``) shows what these kernels cost a whole layer.

The sort itself is ``torch.argsort(stable=True)`` / ``jnp.argsort(stable=True)`` (an XLA sort of T*k int keys):
a Pallas sort gains nothing over XLA's on TPU (a sorting network over a few thousand keys, memory-light), and
the counting form (a [T*k, E] one-hot cumsum) moves more data than the sort. ``positions``, the inverse
permutation, is a second sort (``argsort(order)``), not a scatter: libtpu's model costs XLA's scatter of 65,536
positions at ~230 µs on v6e and the sort at ~25 (the stable argsort plus positions plus group sizes: 283.5 µs with
scatters, 55.3 with the sort and a one-hot count; tpu7x 228.6 -> 44.0; v5e aborts on the scatters and estimates
93.0; ``benchmarks/probes/moe_permutation_probe.py``). Group sizes (fixed length, so no graph break under
``torch.compile``): in jax a compare-and-sum over ``[E, T*k]`` that XLA fuses (:func:`count_ids`), in torch a
``scatter_add_`` (eager torch would materialise the compare).

Checked before any kernel runs (typed errors): ranks, shapes, dtypes, ``num_experts``; id values in
``[0, E)`` and the metadata's ``group_sizes`` summing to ``T*k`` when the tensors are on the cpu (device tensors
would need a sync: out-of-range ids are clamped in the kernels, never read out of bounds).

Tuning: ``block_rows`` (gather), ``block_tokens`` (gather-reduce) and ``source`` (both); no tables shipped (the
heuristics keep at most ~8 MiB of block rows and :data:`MAX_ROWS_IN_FLIGHT` copied rows per step, and pick the
source as above).
"""

from __future__ import annotations

import functools
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
from ...dsl.validate import padded_bytes
from ..vmem import vmem_cap
from ...errors import ArgumentError, DTypeError
from .common import F32, INTS, check_same_device, shape_of

__all__ = ["moe_permute", "moe_combine", "moe_permute_jax", "moe_combine_jax", "MoEPermutation",
           "moe_permute_reference", "moe_combine_reference", "moe_gather_fwd", "moe_gather_reduce_fwd",
           "moe_scatter_add_fwd", "row_view", "largest_block", "resident_fits", "scatter_add_fits", "combine_rows",
           "inverse_permutation", "count_ids", "BLOCK_ROWS", "BLOCK_TOKENS", "SOURCES", "RESIDENT_HEADROOM",
           "RESIDENT_ROWS_PER_READ", "ROWS_IN_FLIGHT_BYTES", "MAX_ROWS_IN_FLIGHT", "UNROLL"]

NAMESPACE = "tpukernels"
BLOCK_ROWS = (128, 256, 512, 1024)
BLOCK_TOKENS = (16, 32, 64, 128, 256)
#: VMEM bytes of gathered rows per grid step (the output block, double-buffered, or the gather-reduce buffer)
ROWS_IN_FLIGHT_BYTES = 8 * MiB
#: at most this many row copies in flight per grid step (one semaphore, one wait): libtpu 0.0.52's static profiler
#: of tpu7x costs the gather-reduce of 8,192 rows of 8 KiB at 150 ms with 512 rows per step, 86 µs with 256
MAX_ROWS_IN_FLIGHT = 256
_FLOATS = (torch.bfloat16, torch.float32)
#: where the kernels read the source rows: ``"vmem"`` keeps the whole source array in VMEM (one copy in, then a
#: dynamic-row load per row), ``"hbm"`` leaves it in HBM and copies each row with a DMA
SOURCES = ("vmem", "hbm")
#: VMEM left free beside a resident source and the blocks (Mosaic's internal scratch), bytes
RESIDENT_HEADROOM = 4 * MiB
#: a source is kept resident only when it has at most this many rows per row read (reading it whole must pay)
RESIDENT_ROWS_PER_READ = 4


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


def largest_block(row_bytes: int, max_rows: int = BLOCK_ROWS[-1]) -> int:
    """The largest of :data:`BLOCK_ROWS` (at most ``max_rows``) whose double-buffered rows of ``row_bytes`` fit
    :data:`ROWS_IN_FLIGHT_BYTES`; the smallest when none does."""
    return max([b for b in BLOCK_ROWS if 2 * b * row_bytes <= ROWS_IN_FLIGHT_BYTES and b <= max_rows],
               default=BLOCK_ROWS[0])


def resident_fits(shape, dtype, reads: int, block_bytes: int, chip=None) -> bool:
    """Whether a source of ``shape`` / ``dtype`` (rows ``[N, S, L]``) read ``reads`` times is kept in VMEM
    (``source="vmem"``): ``L`` is whole 128-lane columns, ``N <= RESIDENT_ROWS_PER_READ * reads``, and its padded
    bytes plus ``block_bytes`` plus :data:`RESIDENT_HEADROOM` fit :func:`tpukernels.library.vmem.vmem_cap` of
    ``chip`` (None: the launch target, else the smallest shipped chip's cap). Rows of partial lane columns are
    copied: their loads and stores are masked and relaid (v6e, gpt-oss's ``[16, 180]`` rows: 25.9 cycles per
    resident row against 6.1 for ``[16, 128]`` and 27.6 per row DMA; model,
    ``benchmarks/probes/moe_row_source_probe.py``)."""
    if int(shape[-1]) % 128 or int(shape[0]) > RESIDENT_ROWS_PER_READ * max(int(reads), 1):
        return False
    return padded_bytes(shape, dtype) + block_bytes + RESIDENT_HEADROOM <= vmem_cap(chip)


def _source_spec(shape, source: str):
    """The source operand's BlockSpec: the whole array once in VMEM (one buffer: its block never changes), or
    left in HBM for the row DMAs."""
    if source == "vmem":
        return pl.BlockSpec(tuple(shape), lambda i: (0,) * len(shape), pipeline_mode=pl.Buffered(1))
    return pl.BlockSpec(memory_space=pl.ANY)


# ----------------------------------------------------------------------------------------- kernels
#: row DMAs started per loop iteration (the scalar loop's overhead per row is what bounds these kernels)
UNROLL = 8


def _each_row(count, fn, static: bool):
    """``fn(r)`` for ``r < count``: unrolled when ``count`` is the static block size."""
    def body(r, c):
        fn(r)
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


def _gather_body(x_src, idx_ref, o_ref, *sem, bm: int, m: int, n_src: int, resident: bool):
    base = pl.program_id(0) * bm
    rows = jnp.minimum(bm, m - base)

    def source(r):
        return jnp.minimum(jnp.maximum(idx_ref[r], 0), n_src - 1)

    def load(r):  # resident source: one dynamic-row VMEM load and store per row
        o_ref[r] = x_src[source(r)]

    def start(r):
        pltpu.make_async_copy(x_src.at[pl.ds(source(r), 1)], o_ref.at[pl.ds(r, 1)], sem[0].at[0]).start()

    def run(full: bool):
        if resident:
            _each_row(bm if full else rows, load, full)
            return
        _each_row(bm if full else rows, start, full)
        _wait_rows(full, rows, lambda: pltpu.make_async_copy(x_src.at[pl.ds(0, bm)], o_ref, sem[0].at[0]),
                   lambda: pltpu.make_async_copy(x_src.at[pl.ds(0, 1)], o_ref.at[pl.ds(0, 1)], sem[0].at[0]))

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
    """The largest block of at most ROWS_IN_FLIGHT_BYTES (double-buffered); copied rows also at most
    MAX_ROWS_IN_FLIGHT. Resident when :func:`resident_fits` (v6e, 65,536 rows of 4 KiB from 8,192: 256 µs in
    256-row blocks, 229 in 1024-row blocks, against 1,030 by row DMAs; model)."""
    row = int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize
    bm = largest_block(row)
    if resident_fits(x.shape, x.dtype, idx.shape[0], 2 * padded_bytes((bm, *x.shape[1:]), x.dtype)):
        return {"block_rows": bm, "source": "vmem"}
    return {"block_rows": largest_block(row, MAX_ROWS_IN_FLIGHT), "source": "hbm"}


@tk.tpu_kernel(
    _gather_body, name="moe_gather_fwd", namespace=NAMESPACE, heuristic=_gather_heuristic,
    tunables={"block_rows": tk.Tunable(BLOCK_ROWS, default=256, doc="output rows per grid step"),
              "source": tk.Tunable(SOURCES, default="hbm", doc="x whole in VMEM (row loads) or in HBM (row DMAs)")},
    out_shape=lambda x, idx: tk.OutSpec((idx.shape[0], *x.shape[1:]), x.dtype),
)
def moe_gather_fwd(x: torch.Tensor, idx: torch.Tensor, *, block_rows: int, source: str) -> torch.Tensor:
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
    resident = source == "vmem"
    return tk.Launch(
        grid=(tk.cdiv(m, bm),),
        in_specs=[_source_spec(x.shape, source), pl.BlockSpec((bm,), lambda i: (i,), memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((bm, *x.shape[1:]), lambda i: (i, 0, 0)),
        out_shape=tk.OutSpec((m, *x.shape[1:]), x.dtype),
        scratch_shapes=[] if resident else [pltpu.SemaphoreType.DMA((1,))],
        dimension_semantics=("parallel",),
        # a resident source asks for the chip's cap: below it, libtpu 0.0.52 places ~40 MiB more beside the
        # kernel's scoped VMEM on tpu7x and runs out (a 32 MiB source fails at 52 MiB, compiles at 56; the probe)
        vmem_limit_bytes=vmem_cap() if resident else max(32 * MiB, 3 * bm * row),
        body_kwargs={"bm": int(bm), "m": m, "n_src": n, "resident": resident},
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=int(((n if resident else m) + m) * row + 4 * m)),
    )


def _gather_reduce_body(y_src, pos_ref, w_ref, o_ref, *scratch, bt: int, k: int, t_total: int, n_src: int,
                        resident: bool):
    base = pl.program_id(0) * bt
    toks = jnp.minimum(bt, t_total - base)

    def source(r):
        return jnp.minimum(jnp.maximum(pos_ref[r], 0), n_src - 1)

    if resident:  # the rows are read where they are
        def row(r):
            return y_src[source(r)]
    else:  # the block's rows are copied into a VMEM buffer first, one DMA each
        buf, sem = scratch

        def row(r):
            return buf[r]

        def start(r):
            pltpu.make_async_copy(y_src.at[pl.ds(source(r), 1)], buf.at[pl.ds(r, 1)], sem.at[0]).start()

        def fetch(full: bool):
            _each_row(bt * k if full else toks * k, start, full)
            _wait_rows(full, toks * k, lambda: pltpu.make_async_copy(y_src.at[pl.ds(0, bt * k)], buf, sem.at[0]),
                       lambda: pltpu.make_async_copy(y_src.at[pl.ds(0, 1)], buf.at[pl.ds(0, 1)], sem.at[0]))

        if t_total % bt == 0:
            fetch(True)
        else:
            jax.lax.cond(toks == bt, lambda: fetch(True), lambda: fetch(False))

    def reduce(t, c):
        acc = row(t * k).astype(F32) * w_ref[t * k]
        for j in range(1, k):
            acc = acc + row(t * k + j).astype(F32) * w_ref[t * k + j]
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
    blocks = 2 * padded_bytes((best, *y.shape[1:]), y.dtype)
    return {"block_tokens": best,
            "source": "vmem" if resident_fits(y.shape, y.dtype, pos.shape[0], blocks) else "hbm"}


@tk.tpu_kernel(
    _gather_reduce_body, name="moe_gather_reduce_fwd", namespace=NAMESPACE, heuristic=_reduce_heuristic,
    tunables={"block_tokens": tk.Tunable(BLOCK_TOKENS, default=64, doc="tokens per grid step (upper bound)"),
              "source": tk.Tunable(SOURCES, default="hbm", doc="y whole in VMEM (row loads) or in HBM (row DMAs)")},
    out_shape=lambda y, pos, w, top_k: tk.OutSpec((pos.shape[0] // top_k, *y.shape[1:]), y.dtype),
)
def moe_gather_reduce_fwd(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, top_k: int, *,
                          block_tokens: int, source: str) -> torch.Tensor:
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
    resident = source == "vmem"
    return tk.Launch(
        grid=(tk.cdiv(t, bt),),
        in_specs=[_source_spec(y.shape, source), blk, blk],
        out_specs=pl.BlockSpec((bt, *y.shape[1:]), lambda i: (i, 0, 0)),
        out_shape=tk.OutSpec((t, *y.shape[1:]), y.dtype),
        scratch_shapes=[] if resident else [pltpu.VMEM((bt * top_k, *y.shape[1:]), y.dtype),
                                            pltpu.SemaphoreType.DMA((1,))],
        dimension_semantics=("parallel",),
        vmem_limit_bytes=vmem_cap() if resident else max(32 * MiB, 2 * (bt * top_k + 2 * bt) * row),  # as the gather
        body_kwargs={"bt": int(bt), "k": int(top_k), "t_total": t, "n_src": n, "resident": resident},
        cost_estimate=pl.CostEstimate(flops=int(2 * t * top_k * row // np.dtype(y.dtype).itemsize),
                                      transcendentals=0,
                                      bytes_accessed=int(((n if resident else t * top_k) + t) * row + 8 * t * top_k)),
    )


def scatter_add_fits(t: int, d: int, itemsize: int, chip=None) -> bool:
    """Whether :func:`moe_scatter_add_fwd` can hold the float32 accumulator of ``t`` rows of ``d`` elements of
    ``itemsize`` bytes (bf16 / f32 rows, ``[S, D/S]`` slabs of whole 128-lane columns) in VMEM with its output
    block (one buffer), its y blocks (the heuristic's) and :data:`RESIDENT_HEADROOM` within
    :func:`tpukernels.library.vmem.vmem_cap` of ``chip`` (None: the launch target, else the smallest shipped chip's
    cap). bf16 rows of D = 2048 (Qwen3-30B-A3B): up to 8,533 tokens on v5e / v6e (112 MiB), 3,754 on tpu7x (56).
    Asked on every combine call: the bytes are cached per shape."""
    need = _scatter_need(int(t), int(d), int(itemsize))
    return need is not None and need <= vmem_cap(chip)


@functools.lru_cache(maxsize=256)
def _scatter_need(t: int, d: int, itemsize: int) -> int | None:
    """VMEM bytes :func:`moe_scatter_add_fwd` needs (headroom included), None for rows it cannot take."""
    s = row_view(d, itemsize)
    if t < 1 or d % s or (d // s) % 128:
        return None
    dtype, shape = (np.float32 if itemsize == 4 else jnp.bfloat16), (s, d // s)
    bm = largest_block(int(np.prod(shape)) * itemsize)
    acc, out = padded_bytes((t, *shape), np.float32), padded_bytes((t, *shape), dtype)
    return acc + out + 2 * padded_bytes((bm, *shape), dtype) + RESIDENT_HEADROOM


def _scatter_add_body(y_ref, tok_ref, w_ref, o_ref, acc, *, bm: int, m: int, t_total: int):
    i = pl.program_id(0)
    rows = jnp.minimum(bm, m - i * bm)

    @pl.when(i == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, acc.dtype)

    def add(r):  # a row whose token is out of range adds nothing (never written elsewhere)
        t = tok_ref[r]
        row = jnp.minimum(jnp.maximum(t, 0), t_total - 1)
        part = y_ref[r].astype(F32) * w_ref[r]
        acc[row] = acc[row] + jnp.where((t >= 0) & (t < t_total), part, 0.0)

    if m % bm == 0:
        _each_row(bm, add, True)
    else:
        jax.lax.cond(rows == bm, lambda: _each_row(bm, add, True), lambda: _each_row(rows, add, False))

    @pl.when(i == pl.num_programs(0) - 1)
    def _():  # the accumulator, rounded once, into the output block (written back after the last step)
        o_ref[...] = acc[...].astype(o_ref.dtype)


def _scatter_heuristic(y, tok, w, num_tokens):
    return {"block_rows": largest_block(int(np.prod(y.shape[1:])) * np.dtype(y.dtype).itemsize)}


@tk.tpu_kernel(
    _scatter_add_body, name="moe_scatter_add_fwd", namespace=NAMESPACE, heuristic=_scatter_heuristic,
    tunables={"block_rows": tk.Tunable(BLOCK_ROWS, default=1024, doc="rows of y per grid step")},
    out_shape=lambda y, tok, w, num_tokens: tk.OutSpec((num_tokens, *y.shape[1:]), y.dtype),
)
def moe_scatter_add_fwd(y: torch.Tensor, tok: torch.Tensor, w: torch.Tensor, num_tokens: int, *,
                        block_rows: int) -> torch.Tensor:
    """``out[t] = sum over p with tok[p] == t of w[p] * y[p]`` (float32 sums, rounded once to y's dtype; a row
    whose token is outside ``[0, num_tokens)`` adds nothing) on ``[M, S, L]`` row slabs (L whole 128-lane columns);
    tok int32 / w float32 ``[M]`` (internal op; :func:`moe_combine` uses it where :func:`scatter_add_fits`)."""
    op = f"{NAMESPACE}::moe_scatter_add_fwd"
    _check_rows(op, y, tok, "tok")
    if tuple(w.shape) != tuple(tok.shape) or np.dtype(w.dtype).name != "float32":
        raise ArgumentError(f"{op}: w must be float32 {list(tok.shape)} (like tok), got {tuple(w.shape)} "
                            f"{np.dtype(w.dtype).name}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ArgumentError(f"{op}: num_tokens must be a positive int, got {num_tokens!r}")
    if int(y.shape[-1]) % 128:
        raise ArgumentError(f"{op}: rows must be slabs of whole 128-lane columns, got {tuple(y.shape[1:])}")
    m = int(y.shape[0])
    if m == 0 or tok.shape[0] != m:
        raise ArgumentError(f"{op}: y has {m} rows and tok {tok.shape[0]}: both must be the same, at least 1")
    bm = m if m <= block_rows else int(block_rows)
    row = int(np.prod(y.shape[1:])) * np.dtype(y.dtype).itemsize
    blk = pl.BlockSpec((bm,), lambda i: (i,), memory_space=pltpu.SMEM)
    return tk.Launch(
        grid=(tk.cdiv(m, bm),),
        in_specs=[pl.BlockSpec((bm, *y.shape[1:]), lambda i: (i, 0, 0)), blk, blk],
        # the whole output, one buffer: its block never changes, so it is written back once, after the last step
        out_specs=pl.BlockSpec((num_tokens, *y.shape[1:]), lambda i: (0, 0, 0), pipeline_mode=pl.Buffered(1)),
        out_shape=tk.OutSpec((num_tokens, *y.shape[1:]), y.dtype),
        scratch_shapes=[pltpu.VMEM((num_tokens, *y.shape[1:]), jnp.float32)],
        dimension_semantics=("arbitrary",),  # one accumulator across the steps
        vmem_limit_bytes=vmem_cap(),  # as the resident gathers
        body_kwargs={"bm": int(bm), "m": m, "t_total": int(num_tokens)},
        cost_estimate=pl.CostEstimate(flops=int(2 * m * row // np.dtype(y.dtype).itemsize), transcendentals=0,
                                      bytes_accessed=int((m + num_tokens) * row + 8 * m)),
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


def combine_rows(y2: torch.Tensor, w: torch.Tensor, order: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * y2[positions[t, j]]`` (``[T*k, D]`` rows in expert order, ``w`` / ``positions``
    ``[T, k]``, ``order`` their inverse ``[T*k]``): :func:`moe_scatter_add_fwd` over the rows in order (token
    ``order // k``, weight ``w.flatten()[order]``) where :func:`scatter_add_fits` (y2 read once, in order), else
    :func:`moe_gather_reduce_fwd` (a gather of each token's k rows)."""
    t, k = positions.shape
    d = y2.shape[1]
    if t == 0 or y2.shape[0] == 0 or d == 0:
        return y2.new_zeros(t, d)
    if scatter_add_fits(t, d, y2.element_size()):
        olong = order.long()
        out = torch.ops.tpukernels.moe_scatter_add_fwd(
            _rows3(y2.contiguous()), torch.div(olong, k, rounding_mode="floor").to(torch.int32),
            w.reshape(-1).float()[olong].contiguous(), t)
        return out.reshape(t, d)
    return gather_reduce_rows(y2, positions, w, k)


def _widen(t):
    return t.float() if t.dtype == torch.float16 else t


@torch.library.custom_op("tpukernels::moe_permute", mutates_args=())
def _permute_op(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    positions = torch.argsort(order)  # the inverse permutation (module docstring: a sort, not a scatter)
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
    ctx.save_for_backward(output[2], output[3])
    ctx.x_dtype = inputs[0].dtype


def _permute_backward(ctx, d_xs, d_sizes, d_order, d_pos):
    order, positions = ctx.saved_tensors
    if d_xs is None:
        return None, None, None
    t, k = positions.shape
    g = _widen(d_xs)
    dx = combine_rows(g, torch.ones(t, k, dtype=torch.float32, device=g.device), order, positions)
    return dx.to(ctx.x_dtype), None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("tpukernels::moe_combine", mutates_args=())
def _combine_op(y_sorted: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    out = combine_rows(_widen(y_sorted), weights.float(), order, positions)
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


def _jax_combine(y2, w, order, positions, interpret):
    """:func:`combine_rows` on jax arrays."""
    from ...targets.jax_entry import jax_call

    t, k = int(positions.shape[0]), int(positions.shape[1])
    d = int(y2.shape[1])
    if t == 0 or y2.shape[0] == 0:
        return jnp.zeros((t, d), y2.dtype)
    if scatter_add_fits(t, d, np.dtype(y2.dtype).itemsize):
        tok = (order // k).astype(jnp.int32)
        ws = w.reshape(-1).astype(jnp.float32)[order]
        return jax_call(moe_scatter_add_fwd, _jax_rows3(y2), tok, ws, t, interpret=interpret).reshape(t, d)
    return _jax_gather_reduce(y2, positions, w, k, interpret)


def inverse_permutation(order):
    """``positions`` with ``positions[order[p]] = p`` (jax, int32): a sort of the permutation, not a scatter
    (module docstring)."""
    return jnp.argsort(order).astype(jnp.int32)


def count_ids(flat, num_experts: int):
    """``[E]`` int32 counts of ``flat``'s values in ``[0, E)`` (others are not counted): a compare-and-sum over
    ``[E, len(flat)]`` that XLA fuses (no scatter; module docstring)."""
    return jnp.sum(flat[None, :] == jnp.arange(num_experts, dtype=flat.dtype)[:, None], axis=1, dtype=jnp.int32)


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
    positions = inverse_permutation(order).reshape(t, k)
    sizes = count_ids(flat, num_experts)
    # the index arrays are arguments of the custom_vjp functions, not closures: a custom_vjp that closes over a
    # tracer of an enclosing trace (e.g. ids traced by shard_map, then differentiated) leaks it
    @jax.custom_vjp
    def gather(xv, order_, positions_):
        return _jax_gather(xv, order_ // k, interpret)

    def fwd(xv, order_, positions_):
        return gather(xv, order_, positions_), (order_, positions_)

    def bwd(res, g):
        order_, positions_ = res
        return _jax_combine(g, jnp.ones((t, k), jnp.float32), order_, positions_, interpret), None, None

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
        return _jax_combine(y, w, order_, positions_, interpret)

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
    (moe_scatter_add_fwd, ("16384x16x128:bf16", "16384:i32", "16384:f32"), {"num_tokens": 2048}),
]
