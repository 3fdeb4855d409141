"""Grouped matmul over ragged row groups (MoE expert layers): ``out[rows of g] = lhs[rows of g] @ rhs[g]``.

Public op::

    torch.ops.tpukernels.grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=False, group_offset=None,
                                        out_dtype=None) -> Tensor
    tpukernels.library.grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False, group_offset=None,
                                      out_dtype=None, config=None)            # same, functional

Semantics are those of ``jax.lax.ragged_dot`` and JAX's megablox ``gmm``
(``jax/experimental/pallas/ops/tpu/megablox/gmm.py``), so either can be swapped for this one:

* ``lhs [M, K]``, ``rhs [G, K, N]`` (``transpose_rhs=True``: ``[G, N, K]``, the layout of ``nn.Linear``
  weights and of HF's fused expert weights), ``group_sizes int32 [G_total]``; result ``[M, N]``.
* Rows are grouped contiguously in group order: group ``g`` owns rows ``[sum(sizes[:g]), sum(sizes[:g+1]))``
  and multiplies them by ``rhs[g - group_offset]``. Groups may be empty; their boundaries need not align
  with any tile. Rows no local group owns (``sum(group_sizes) < M``, or rows of groups outside the shard)
  are **zero**.
* ``group_offset`` (megablox): ``rhs`` holds only the groups ``[group_offset, group_offset + G)`` of the
  ``G_total = len(group_sizes)`` groups (an expert-parallel shard); rows of the other groups are zero.
  Default 0 (then ``G`` must equal ``G_total``).
* dtypes: ``lhs`` and ``rhs`` bfloat16 or float32 (one dtype); products accumulate in float32 (an f32 VMEM
  scratch); the result is rounded once to ``out_dtype`` (default: the operand dtype, as ``ragged_dot``;
  megablox defaults to float32). float32 operands use ``precision=HIGHEST``.

Backward (autograd, ``dO`` the incoming gradient cast to the operand dtype)::

    d_lhs = grouped_matmul(dO, rhs, transpose_rhs=not transpose_rhs)          (grouped_matmul_fwd)
    d_rhs[g] = lhs[rows of g]^T @ dO[rows of g]   [G, K, N]                    (grouped_matmul_tgmm)
             (transpose_rhs: dO[rows of g]^T @ lhs[rows of g], [G, N, K])

Empty groups get a zero ``d_rhs[g]``. ``group_sizes`` / ``group_offset`` get no gradient. The backward
is itself made of differentiable grouped matmuls (``grouped_matmul`` and ``tgmm`` ops with their own
backward, :func:`_tgmm_backward`), so second derivatives run through the same kernels.

Kernels (both Pallas TPU kernels with scalar prefetch and data-dependent index maps):

* ``tpukernels::grouped_matmul_fwd``: grid ``(N/bn, T, K/bk)`` with ``T = ceil(M/bm) + G - 1`` work items,
  a static bound. Work item ``i`` is one visit of one ``bm``-row output tile by one group (a tile shared by
  two groups is visited twice, consecutively, each storing only its rows with a select; rows of no group get
  one visit that stores zeros). Items past the real count repeat the last block indices, so they move no
  data and the body skips them. The visit list (``_fwd_schedule``) is computed on device from
  ``group_sizes`` inside the same jitted function (``tk.Launch.prefetch``) and lives in SMEM.
  **rhs prefetch chain** (tunable ``rhs_prefetch``, default on; used at one K step, ``bk >= K``, with ``bn``
  dividing ``N``): the grid pipeline fetches a block one step ahead, so at ``bk = K``, where a group's
  ``[K, bn]`` rhs block stays resident while its tiles pass, every group change exposes the next block's copy
  (~2x one item's compute at Mixtral shapes on v6e). Instead ``rhs`` stays in HBM (``pl.ANY``) and the body
  copies it by hand (``pltpu.make_async_copy``) into a 2-slot VMEM buffer with one DMA semaphore per slot: a
  *run* is a stretch of consecutive items with one rhs block (one group, in one output-column pass); at the
  first item of run ``q`` the body waits for q's copy and starts run ``q + 1``'s (the next group, or the next
  pass's first group) into the other slot, so each copy has a whole group's tiles to hide behind. The chain
  crosses passes, so the N axis is ``"arbitrary"`` on this path (megacore chips, not shipped targets, lose the
  N split). Same VMEM as the pipeline's two rhs buffers. Tested against the pipeline path bit for bit, with
  the TPU interpreter's race detector, NaN-initialised memory, and schedules with a group change on every
  tile, empty groups, one huge group, ``sum(group_sizes) < M`` and ``group_offset``.
* ``tpukernels::grouped_matmul_tgmm``: grid ``(K/bk, N/bn, T)`` with the work items innermost, so one
  ``(g, K-block, N-block)`` output block accumulates over the tiles of group ``g``; every local group is
  visited at least once (empty ones store zeros). A group's first item writes the f32 accumulator with its dot
  (no zero fill), its last writes ``acc + dot`` as the output block (no accumulator store and reload).
  **d_W writes** (``bk`` dividing ``K`` and ``bn`` dividing ``N``; else the grid pipeline's partial output
  blocks): the grid pipeline copies an output block out when its index changes, a d_W block per group
  change, and libtpu's model charges each such copy ~14k cycles on v6e at ``bk, bn = 4096, 2048`` (exposed,
  not overlapped; the tgmm figures below). Instead the output stays in HBM (``pl.ANY``) and
  a group's last item writes its block into one of ``n_slots`` VMEM staging slots (2 where they fit the
  chip's VMEM cap, else 1) and starts its copy; the copy is waited for only before its slot is written again
  (``n_slots`` writes later, in grid order) and at the grid's last step, so it overlaps the next groups'
  items. The chain crosses d_W blocks, so every grid axis is ``"arbitrary"`` (the shipped chips have one
  TensorCore). Waits are guarded by an SMEM flag per slot set at each start, so an all-zero table (libtpu's
  static model, no item last) starts and waits for nothing. Tested with the TPU interpreter's race
  detector, NaN-initialised memory, one and two slots, and schedules with a write on almost every item,
  empty groups, one huge group, tile-aligned one-item groups, ``sum(group_sizes) < M`` and ``group_offset``.

Only items whose tile is not wholly inside their group's rows (a tile shared at a group boundary, or the M
tail; flag ``PARTIAL``) select rows (forward) or mask operands (tgmm); interior tiles, the common case,
store or accumulate their blocks as they are. The schedules are built from dense compares on tiny arrays,
without XLA gathers (libtpu 0.0.52's static profiler aborted on the earlier gather-based schedule on v5e).

Tails. K tails are masked on both operands with ``jnp.where`` (``tk.mask_tail``) on the last K step (NaN
padding survives a 0/1 multiply; issue 15 cites a public report of wrong results exactly here). N tails
only reach output columns Pallas drops; M tails and rows of neighbouring groups are excluded by the row
select (forward) or masked on both operands (tgmm).

What is checked where (before any kernel runs, typed errors from :mod:`tpukernels.errors`): ranks, shapes,
dtypes, ``group_sizes`` dtype (int32) and length, ``group_offset`` range, devices, always. The *values* of
``group_sizes`` (no negative size, ``sum <= M``) and of a tensor ``group_offset`` are checked on the host
only when they are cpu tensors outside ``torch.compile`` tracing (device tensors would need a sync; fake
tensors have no values). Unchecked values are clamped on device (negative sizes count as 0, group ends
are capped at ``M``, the offset at ``[0, G_total - G]``), so bad values give a defined result, never an
out-of-bounds access.

Tunables ``bm, bk, bn`` (row tile, contraction block, output columns; clamped to the problem like
``tpukernels.library.matmul``) and the forward's ``rhs_prefetch`` (the chain above; off: the grid pipeline's rhs
blocks). Smaller ``bm`` wastes less on tiles shared by two groups (each visit computes the whole tile); larger
``bm`` re-reads ``rhs`` less; ``bk >= K`` (one K step) keeps a group's ``rhs`` block resident while its tiles
pass. Defaults: per-chip shipped tuning data
``tpukernels/data/autotuning/<chip>/tpukernels.grouped_matmul_*.json`` at the Mixtral shapes of
:data:`STANDARD_CASES`, else :func:`heuristic`. The scoped-VMEM request is capped per chip at 7/8 of jax's
``vmem_capacity_bytes`` (:func:`tpukernels.library._vmem.vmem_cap`: 112 MiB on v5e / v6e, 56 MiB on tpu7x), so
``bk = K`` with a wide ``bn`` is used where the chip has the VMEM. The shipped forward entries were chosen with
``benchmarks/grouped_matmul_configs.py`` (evidence ``"libtpu-static-estimate+analytic-schedule-model"``:
libtpu's fitted static estimate, the analytic schedule model below and a pipelined walk of the real schedule; on
tpu7x, where libtpu cannot estimate them, and on v5e, where its estimate of the rhs prefetch chain takes too
long, by the analytic model and the walk alone); the tgmm entries with
``benchmarks/grouped_matmul_tgmm_configs.py`` (the same evidence; tpu7x analytic only). All of them compile for
their chip (``tests/test_grouped_matmul.py``, aot).

Performance (models, not measurements; no TPU was used). libtpu's static estimator has no data: it reads the
SMEM table as zeros, so its figure for these kernels is the MXU work of all ``T`` items with every block index
constant (flags are stored complemented so that zeros mean "compute"; without that it counted no work at all,
356 µs for a 2,091 µs roofline). For the rhs prefetch chain a zero table reads as one run of group 0 per
output-column pass (``F_RUNS_M1`` stores the run count minus one), a consistent chain: the static model sees one
``[K, bn]`` rhs copy per pass, started a pass ahead, and waited for at the pass change. It sees none of the ``G
- 1`` group changes per pass, in this kernel or with the grid pipeline's rhs blocks (there too the block index
is constant); what the chain gains there only the walk below shows. What the static model cannot see is computed
exactly by ``tpukernels.bench.grouped_matmul.data_cost`` from the real schedule at skewed Mixtral group sizes
``[1879, 1017, 1330, 679, 817, 7027, 3056, 579]`` (16384 rows): the block copies and the MXU work of the items
that compute. With ``max(MXU, HBM) + 0.35 µs/step`` the shipped forward configs reach 93 / 86 / 82% of the MXU
roofline (v5e / v6e / tpu7x) on the up projection ``x @ W1[g]^T`` (K 4096, N 14336) and on ``x @ W[g]``, 93 / 86
/ 78% on the down projection (K 14336, N 4096). The forward is short of 100% because a tile shared by two groups
is computed once per group (7 boundaries: 1.055x the ideal MXU work at ``bm=128``, 1.11x at 256, 1.22x at 512)
and ``lhs`` is re-read once per N block. Neither model sees *when* copies happen; a step-by-step walk of the
real schedule does (``benchmarks/grouped_matmul_configs.py``, ``pipelined``: each step waits for its blocks,
copies in flight share the HBM bandwidth). With the grid pipeline's rhs blocks (``rhs_prefetch=False``) a group
change exposes the next group's block (17.9 µs of copy against one 8.2 µs item on v6e at the up projection): v6e
76.4 / 76.1 / 76.4% (up / down / ``x @ W[g]``), v5e 88.5 / 88.4 / 88.5%. With the chain each copy has a whole
run of items to hide behind: v6e 85.8 / 82.3 / 85.8%, v5e 92.8% on all three (on v6e the down projection's
``lhs`` block, ``[256, 14336]``, takes half of each item's HBM time, so a short group's run cannot hide the next
copy). In ``tpukernels bench --family grouped_matmul`` (libtpu static estimates of reduced problems, fitted and
scaled: :mod:`tpukernels.bench.grouped_matmul`) our forward with the chain reaches 85.5 / 85.4 / 85.8% of the
MXU roofline on v6e (up / down / ``x @ W[g]``; the grid pipeline's rhs blocks: 84.3% at the up projection,
84.4-84.8% before the chain existed: the chain's gain there is the copy at each pass change, which the static
model does see). On v5e libtpu's estimate of the chain takes more than 280 s per reduced problem, so its row is
the roofline floor; the same blocks with the grid pipeline's rhs blocks estimated 92.5-92.7%. The static model's
ceiling at v6e's ``bm=256`` is 64 tiles per 71 items over the 1.036x per-row cost of a 256-row item, 87%, less
each pass's pipeline fill; ``bm=128`` halves the boundary waste but a 128-row item costs ~1.5x its MXU time on
the 256-wide MXU (62.5% estimated). ``jax.lax.ragged_dot`` aborts libtpu's profiler on every chip (roofline
floor). On tpu7x libtpu's *profiling* compile of our forward needs the scoped limit plus the kernel's blocks and
scratch (92 = 52 + 38 MiB of 64 at the up projection's ``bm=256, bk=4096, bn=2048``, with the chain as without;
the ordinary compile fits), so only configs under ~26 MiB of blocks could be estimated there; the best of those
ranks 6 points below the shipped configs in the walk (up: ``bm=256, bk = K, bn=1024`` 75.8 vs 82.2%), so the
shipped ones stay and their row is the roofline floor. tgmm: next paragraph.

tgmm (models, not measurements). Both operands are streamed every step, so the ``[bk, bn]`` d_rhs block must
be large (``bk * bn / (bk + bn)`` FLOP per byte; the former ``512, 512, 1024`` default was HBM-bound at 341
on v6e, ~40% of the roofline) while ``bm`` stays small: a tile a group boundary splits is one extra item. The
transposed-LHS dot costs nothing extra in libtpu's model (a dense kernel fed ``lhs^T`` estimates within 4%),
so the kernel contracts ``lhs`` blocks on their row dimension in place. libtpu's estimate used to time out
(> 300 s) because the all-zero table read as every item being its group's first and last (a d_rhs-block
zero-fill and store per step); tgmm now stores only ``COMPUTE`` complemented (``TGMM_COMPLEMENT``), so the
model charges neither the first / last items' work nor (with the body's own d_W copies, which only a last
item starts) any d_W writeback; it does not see the per-item operand copies either (the all-zero table
repeats one tile). Fitted static estimates on v6e at ``256, 4096, 2048``: a 256-row item costs its MXU time
plus a fixed ~490 cycles per grid step (8,676 vs 8,192 cycles; the same ~490 at ``bk = bn = 2048`` and at
``bn = 3584``), and the grid pipeline's output blocks cost ~14k cycles per d_rhs block (gone with the body's
copies: 82.7% -> 84.4%). Shipped configs (``benchmarks/grouped_matmul_tgmm_configs.py``, chosen from those
estimates): v5e ``128, 4096, 3584`` 93.1% of the MXU roofline (``128, 2048, 2048``: 89.4%, 88.8% before the
body's copies); v6e ``256, 4096, 3584`` 86.7%, one staging slot (two do not fit the 112 MiB cap), under a
ceiling of 90.1% (71 items for 64 row tiles) over 1.035x MXU time per 256-row item; ``bm=128`` costs ~2.1x its
MXU time per item on the 256-deep MXU, ``bm=512`` counts 39 items for 32 tiles. tpu7x ``256, 2048, 2048``: not
estimable (profiling compile out of VMEM, as the forward), analytic model 76%. megablox's ``tgmm`` has no
credible estimate to compare with (v5e aborts; v6e / tpu7x fall below the roofline).

Sources: megablox ``gmm`` / ``tgmm`` (metadata via scalar prefetch, masked stores of shared tiles); the
JAX Pallas TPU matmul guide (f32 scratch accumulator); ``jax.lax.ragged_dot`` for the API.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .. import dsl as _dsl
from ..dsl.validate import padded_bytes
from ._vmem import MiB, scoped_vmem_limit, vmem_cap
from ..errors import ArgumentError, DeviceError, DTypeError

KERNEL_DTYPES = ("bfloat16", "float32")

TUNABLES = {
    "bm": _dsl.Tunable([512, 128, 256, 1024, 2048], default=512, doc="rows per output tile (M)"),
    "bk": _dsl.Tunable([1024, 256, 512, 2048, 4096, 8192, 16384], default=1024,
                       doc="contraction block (K); bk >= K keeps a group's rhs block resident across its tiles"),
    "bn": _dsl.Tunable([1024, 256, 512, 2048, 3584, 4096], default=1024,
                       doc="output columns per block (N); 3584 divides Mixtral's ffn 14336"),
    "rhs_prefetch": _dsl.Tunable([True, False], default=True,
                                 doc="at bk >= K with bn dividing N: copy each group's rhs block by hand into a "
                                     "2-slot buffer, started a whole group ahead (else the grid pipeline's copy, "
                                     "one step ahead, is exposed at every group change)"),
}
TUNABLES_TGMM = {
    "bm": _dsl.Tunable([512, 128, 256, 1024, 2048], default=512, doc="rows per step (the reduction, M)"),
    "bk": _dsl.Tunable([512, 256, 1024, 2048, 4096], default=512, doc="rows of the [bk, bn] d_rhs block (K)"),
    "bn": _dsl.Tunable([1024, 256, 512, 2048, 3584], default=1024, doc="columns of the d_rhs block (N)"),
}

# fields of the flat int32 work-item table in SMEM: table[f * T + i]
F_TILE, F_SRC_TILE, F_GROUP, F_LO, F_HI, F_FLAGS = range(6)
N_FIELDS = 6
#: extra forward fields of the rhs prefetch chain (``rhs_prefetch``): the item's rhs run (a run: consecutive
#: items with one rhs block index) within an output-column pass, the pass's run count minus one, and the
#: group of the next run (for a pass's last run: its first run's group, the next pass's first block). Stored
#: so that an all-zero table reads as one run per pass of group 0, a consistent chain (module docstring)
F_RUN, F_RUNS_M1, F_NEXT_GROUP = 6, 7, 8
N_FIELDS_FWD = 9
COMPUTE, STORE, FIRST, LAST = 1, 2, 4, 8  # flag bits
#: flag bit of a computing item whose tile is not wholly inside its group's rows (a tile shared by two groups,
#: or the M tail): only these select or mask rows; interior tiles store / accumulate their blocks as they
#: are. Not complemented: an all-zero table (libtpu's static estimator) reads as interior tiles, the
#: common case (boundary items are at most G - 1 per pass)
PARTIAL = 16
#: the table stores flags complemented (``flags ^ ALL``): an all-zero table, which is what libtpu's static
#: estimator reads from SMEM (it has no data), then means "every item computes and stores", so the model
#: counts the MXU work of all T items instead of none (an upper bound: real runs skip padding items)
ALL = COMPUTE | STORE | FIRST | LAST
#: tgmm stores only COMPUTE complemented: an all-zero table then reads as interior tiles that accumulate,
#: neither the first nor the last of their group, the common case (a group's first / last items, which write
#: the accumulator / the d_rhs block, are G per d_rhs block out of T). With FIRST and LAST complemented too, libtpu's
#: model charged every item a d_rhs-block f32 zero-fill and a store (~1.3x the estimate at bm=512, bk = bn = 1024
#: on v6e, and estimates past 300 s at bk = bn = 2048)
TGMM_COMPLEMENT = COMPUTE
#: forward flag bit (not complemented): the item starts an rhs run other than a pass's first (item 0 of each
#: pass starts one by position, whatever the table says)
RUN_START = 32


# ----------------------------------------------------------------------------------------------- helpers
def _dtype_name(dt) -> str:
    if isinstance(dt, torch.dtype):
        return str(dt).replace("torch.", "")
    return np.dtype(dt).name


def _clamp(dim: int, block: int) -> int:
    return dim if 0 < dim <= block else block


def canonical_out_dtype(out_dtype, where="grouped_matmul") -> str | None:
    """``None`` / torch dtype / name -> ``"bfloat16" | "float32"`` (or None). Raises DTypeError otherwise."""
    if out_dtype is None:
        return None
    name = out_dtype if isinstance(out_dtype, str) else _dtype_name(out_dtype)
    name = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32", "float": "float32"}.get(name, name)
    if name not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: out_dtype {out_dtype!r} is not supported; use one of {KERNEL_DTYPES}")
    return name


def _bits(flags, bit):
    return (flags & bit) != 0


def _flags(tab, T: int, i):
    """Flag bits of work item ``i`` (stored complemented, see ``ALL``)."""
    return tab[F_FLAGS * T + i] ^ ALL


def _tgmm_flags(tab, T: int, i):
    """Flag bits of tgmm work item ``i`` (COMPUTE stored complemented, see ``TGMM_COMPLEMENT``)."""
    return tab[F_FLAGS * T + i] ^ TGMM_COMPLEMENT


def _group_bounds(sizes, offset, M: int, G: int):
    """(start, end) rows of the G local groups, clamped on device (module docstring), int32 [G] each."""
    import jax.numpy as jnp

    from jax import lax

    sizes = jnp.clip(sizes.astype(jnp.int32), 0, M)
    # int32 running sums of garbage sizes wrap around; the first sum >= M is < 2 * M (every size <= M), so
    # it is seen before any wrap: from there on every end is M (exact for M < 2**30)
    raw = jnp.cumsum(sizes)
    ends = jnp.where(lax.cummax((raw >= M).astype(jnp.int32), axis=0) > 0, M, raw).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    off = jnp.clip(offset.reshape(-1)[0], 0, sizes.shape[0] - G)
    idx = off + jnp.arange(G, dtype=jnp.int32)
    return _take(starts, idx), _take(ends, idx)


def _take(values, idx):
    """``values[idx]`` for a small int32 vector ``values`` as a one-hot select-and-sum, not a gather.

    The schedules are tiny (``T x tiles`` or ``T x G`` elements); dense compares keep them free of XLA
    gathers, on which libtpu 0.0.52's static profiler aborted on v5e (``llo_execution_graph.cc:149``), so
    the whole launch gets a static estimate there too."""
    import jax.numpy as jnp

    hit = idx[:, None] == jnp.arange(values.shape[0], dtype=jnp.int32)[None, :]
    return jnp.sum(jnp.where(hit, values[None, :], 0), axis=1).astype(jnp.int32)


def _count_le(sorted_values, x):
    """``searchsorted(sorted_values, x, side="right")``: how many entries are ``<= x`` (dense compare)."""
    import jax.numpy as jnp

    return jnp.sum(sorted_values[None, :] <= x[:, None], axis=1).astype(jnp.int32)


def _forward_fill(values, valid):
    """``values[last j <= i with valid[j]]`` per i (0 where none yet)."""
    import jax.numpy as jnp
    from jax import lax

    T = values.shape[0]
    src = lax.cummax(jnp.where(valid, jnp.arange(T, dtype=jnp.int32), -1), axis=0)
    return jnp.where(src >= 0, _take(values, jnp.maximum(src, 0)), 0)


def _fwd_schedule(sizes, offset, *, M: int, G: int, bm: int, T: int):
    """The forward's work items as a flat int32 table (fields ``F_*``), ordered by output tile.

    Tile ``j`` is visited once per local nonempty group intersecting it (in group order), or once with no
    group (stores zeros) when none does: ``sum_j max(1, n_j) <= tiles + G - 1`` items since consecutive
    groups share at most one tile. Items past the count repeat the last tile with no flags.
    """
    import jax.numpy as jnp

    from jax import lax

    tiles = -(-M // bm)
    s, e = _group_bounds(sizes, offset, M, G)
    ne = e > s
    j = jnp.arange(tiles, dtype=jnp.int32)[:, None]
    inter = ne[None, :] & (s[None, :] < (j + 1) * bm) & (e[None, :] > j * bm)  # [tiles, G]
    n = inter.sum(1).astype(jnp.int32)
    v = jnp.maximum(n, 1)
    V = jnp.cumsum(v)
    i = jnp.arange(T, dtype=jnp.int32)
    real = i < V[-1]
    tile = jnp.minimum(_count_le(V, i), tiles - 1)
    l = i - (_take(V, tile) - _take(v, tile))
    tt = tile[:, None]  # the groups intersecting each item's tile, [T, G] (no gather of inter's rows)
    inter_t = ne[None, :] & (s[None, :] < (tt + 1) * bm) & (e[None, :] > tt * bm)
    rank = jnp.cumsum(inter_t.astype(jnp.int32), axis=1)  # [T, G]
    g = jnp.minimum((rank <= l[:, None]).sum(1), G - 1).astype(jnp.int32)
    compute = real & (inter_t.sum(1) > 0)
    lo, hi = jnp.where(compute, _take(s, g), 0), jnp.where(compute, _take(e, g), 0)
    flags = (compute * COMPUTE) | (real * STORE) | ((real & (l == 0)) * FIRST)
    flags = (flags ^ ALL) | ((compute & ((tile * bm < lo) | ((tile + 1) * bm > hi))) * PARTIAL)
    src_tile = _forward_fill(tile, compute)
    group = _forward_fill(g, compute)
    # rhs runs: items that do not compute keep the previous group (forward fill), so runs change only at
    # computing items of a new group
    run_start = jnp.concatenate([jnp.ones((1,), bool), group[1:] != group[:-1]])
    run = (jnp.cumsum(run_start.astype(jnp.int32)) - 1).astype(jnp.int32)
    nxt = jnp.where(run_start, i, T)  # the next run start strictly after item i: a reverse running minimum
    nxt = jnp.concatenate([lax.cummin(nxt, axis=0, reverse=True)[1:], jnp.full((1,), T, jnp.int32)])
    next_group = jnp.where(nxt < T, _take(group, jnp.minimum(nxt, T - 1)), group[0])
    flags = flags | ((run_start & (i > 0)) * RUN_START)
    runs_m1 = jnp.broadcast_to(run[-1], (T,))
    return (jnp.stack([tile, src_tile, group, lo, hi, flags.astype(jnp.int32), run, runs_m1,
                       next_group.astype(jnp.int32)]).reshape(-1),)


def _tgmm_schedule(sizes, offset, *, M: int, G: int, bm: int, T: int):
    """tgmm work items, ordered by group: the tiles of each local group (one empty visit for an empty one)."""
    import jax.numpy as jnp

    s, e = _group_bounds(sizes, offset, M, G)
    ne = e > s
    t0 = s // bm
    c = jnp.where(ne, (e - 1) // bm - t0 + 1, 0)
    w = jnp.maximum(c, 1)
    W = jnp.cumsum(w)
    i = jnp.arange(T, dtype=jnp.int32)
    real = i < W[-1]
    g = jnp.minimum(_count_le(W, i), G - 1)
    wg = _take(w, g)
    l = i - (_take(W, g) - wg)
    compute = real & (_take(ne.astype(jnp.int32), g) > 0)
    tile = jnp.where(compute, _take(t0, g) + l, 0).astype(jnp.int32)
    lo, hi = jnp.where(compute, _take(s, g), 0), jnp.where(compute, _take(e, g), 0)
    flags = ((compute * COMPUTE) | (real * STORE) | ((real & (l == 0)) * FIRST)
             | ((real & (l == wg - 1)) * LAST))
    flags = (flags ^ TGMM_COMPLEMENT) | ((compute & ((tile * bm < lo) | ((tile + 1) * bm > hi))) * PARTIAL)
    src_tile = _forward_fill(tile, compute)
    return (jnp.stack([tile, src_tile, g, lo, hi, flags.astype(jnp.int32)]).reshape(-1),)


# ----------------------------------------------------------------------------------------------- kernel bodies
def _rhs_prefetch_chain(tab, rhs_hbm, rhs_buf, sems, *, T, bn, n_pass, transpose_rhs):
    """The manual rhs copies of item ``i`` in pass ``n`` (``rhs_prefetch``); returns the buffer slot holding
    its rhs block. Run ``q = n * R + r`` (R runs per pass, r the item's run) lives in slot ``q % 2``; at the
    first item of run q the kernel waits for q's copy, then starts run q + 1's (the next group of this pass,
    or the next pass's first group) into the other slot, whose run q - 1 ended with the previous item. So each
    copy has a whole run (a group's tiles) to complete instead of one step. Item 0 of pass 0 starts run 0."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    n, i = pl.program_id(0), pl.program_id(1)
    R = tab[F_RUNS_M1 * T + i] + 1
    r = tab[F_RUN * T + i]
    slot = (n * R + r) % 2

    def copy(g, col, s):
        cols = pl.ds(pl.multiple_of(col * bn, bn), bn)
        src = rhs_hbm.at[g, cols, :] if transpose_rhs else rhs_hbm.at[g, :, cols]
        return pltpu.make_async_copy(src, rhs_buf.at[s], sems.at[s])

    @pl.when((n == 0) & (i == 0))
    def _():
        copy(tab[F_GROUP * T], 0, 0).start()

    @pl.when((i == 0) | ((tab[F_FLAGS * T + i] & RUN_START) != 0))
    def _():
        copy(tab[F_GROUP * T + i], n, slot).wait()
        last_run = r + 1 >= R

        @pl.when(jnp.logical_not(last_run) | (n + 1 < n_pass))
        def _():
            copy(tab[F_NEXT_GROUP * T + i], jnp.where(last_run, n + 1, n), 1 - slot).start()

    return slot


def _gmm_body(tab, lhs_ref, rhs_ref, out_ref, acc_ref, *scratch, T, bm, n_k, blk_k, k_size, transpose_rhs,
              precision, rhs_prefetch, bn, n_pass):
    """Work item ``i`` (grid axis 1), K step ``k`` (axis 2): ``acc (+)= lhs_blk @ rhs_blk``; on the last K
    step ``out = select(rows of the group, acc, previous visit's out | 0)``. With ``rhs_prefetch`` (one K
    step) ``rhs_ref`` is the whole rhs in HBM and ``scratch`` its 2-slot VMEM buffer and DMA semaphores."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    i, k = pl.program_id(1), pl.program_id(2)
    flags = _flags(tab, T, i)
    compute = _bits(flags, COMPUTE)
    tail = k_size % blk_k != 0
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    if rhs_prefetch:
        rhs_buf, sems = scratch
        slot = _rhs_prefetch_chain(tab, rhs_ref, rhs_buf, sems, T=T, bn=bn, n_pass=n_pass,
                                   transpose_rhs=transpose_rhs)
        rhs_block = lambda: rhs_buf[slot]
    else:
        rhs_block = lambda: rhs_ref[...]

    def dot(masked: bool):
        a, b = lhs_ref[...], rhs_block()
        if masked:  # K tail: both operands, NaN-safe jnp.where
            a = _dsl.mask_tail(a, 1, k * blk_k, k_size)
            b = _dsl.mask_tail(b, 1 if transpose_rhs else 0, k * blk_k, k_size)
        return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)

    def store(z):
        tile = tab[F_TILE * T + i]
        rows = tile * bm + jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
        mask = (rows >= tab[F_LO * T + i]) & (rows < tab[F_HI * T + i])
        prev = jnp.where(_bits(flags, FIRST), 0.0, out_ref[...].astype(jnp.float32))
        out_ref[...] = jnp.where(mask, z, prev).astype(out_ref.dtype)

    def store_all(z):  # an interior tile: its only visit, every row is the group's
        out_ref[...] = z.astype(out_ref.dtype)

    last = k == n_k - 1
    finish = _bits(flags, STORE) & last
    partial = _bits(flags, PARTIAL)
    interior = jnp.logical_not(partial)
    # a visit without rows (a tile no group owns): the select keeps the previous visit's rows or zeros
    pl.when(finish & jnp.logical_not(compute))(lambda: store(jnp.zeros(out_ref.shape, jnp.float32)))
    if n_k == 1:
        pl.when(finish & compute & partial)(lambda: store(dot(tail)))
        pl.when(finish & compute & interior)(lambda: store_all(dot(tail)))
        return

    @pl.when(compute & (k == 0))
    def _():
        acc_ref[...] = dot(False)

    @pl.when(compute & (k > 0) & jnp.logical_not(last))
    def _():
        acc_ref[...] += dot(False)

    pl.when(finish & compute & partial)(lambda: store(acc_ref[...] + dot(tail)))
    pl.when(finish & compute & interior)(lambda: store_all(acc_ref[...] + dot(tail)))


def _tgmm_body(tab, x_ref, y_ref, out_ref, acc_ref, *scratch, T, bm, precision, G, gn, bk, bn, n_slots):
    """Work item ``i`` (grid axis 2) of group ``g``: ``acc (+)= x_blk[rows of g]^T @ y_blk[rows of g]``; the
    group's first item writes ``acc = dot`` (no zero fill), its last ``out[g] = acc + dot`` without storing the
    accumulator, an empty group's visit ``out[g] = 0``.

    ``n_slots > 0`` (``K % bk == 0`` and ``N % bn == 0``): ``out_ref`` is the whole output in HBM and
    ``scratch`` an ``[n_slots, bk, bn]`` staging buffer with its DMA semaphores. A group's last item writes the
    d_W block into slot ``e % n_slots`` (``e``: the write's number in grid order, one per block and local
    group) and starts its copy, waited for only before that slot is written again (write ``e + n_slots``) and
    at the grid's last step, so writebacks overlap later items. ``n_slots == 0`` (a K or N tail): the
    pipeline's output block (partial at the edges)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    i = pl.program_id(2)
    flags = _tgmm_flags(tab, T, i)
    compute, partial = _bits(flags, COMPUTE), _bits(flags, PARTIAL)
    first, last = _bits(flags, FIRST), _bits(flags, LAST)
    not_ = jnp.logical_not

    def dot(masked: bool):
        x, y = x_ref[...], y_ref[...]
        if masked:  # a tile shared with another group, or the M tail: mask both operands (NaN-safe select)
            tile = tab[F_TILE * T + i]
            rows = tile * bm + jax.lax.broadcasted_iota(jnp.int32, (x_ref.shape[0], 1), 0)
            valid = (rows >= tab[F_LO * T + i]) & (rows < tab[F_HI * T + i])
            x, y = jnp.where(valid, x, jnp.zeros((), x.dtype)), jnp.where(valid, y, jnp.zeros((), y.dtype))
        return jax.lax.dot_general(x, y, (((0,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    if n_slots:
        stage, sems, pending = scratch
        kk, n = pl.program_id(0), pl.program_id(1)
        e = (kk * gn + n) * G + tab[F_GROUP * T + i]

        @pl.when((kk == 0) & (n == 0) & (i == 0))
        def _():
            for s_ in range(n_slots):
                pending[s_] = 0

        def copy(ev):  # write ``ev``: its slot to out[group, K block, N block]
            b, s = ev // G, ev % n_slots
            rows = pl.ds(pl.multiple_of((b // gn) * bk, bk), bk)
            cols = pl.ds(pl.multiple_of((b % gn) * bn, bn), bn)
            return pltpu.make_async_copy(stage.at[s], out_ref.at[ev % G, rows, cols], sems.at[s])

        def wait(ev):  # write ``ev``'s copy, if it was started (``pending``: an all-zero table starts none)
            @pl.when((ev >= 0) & (pending[ev % n_slots] != 0))
            def _():
                copy(ev).wait()
                pending[ev % n_slots] = 0

        def write(value):
            wait(e - n_slots)  # the slot's previous write
            stage[e % n_slots] = value().astype(stage.dtype)
            copy(e).start()
            pending[e % n_slots] = 1

    else:
        def write(value):
            out_ref[...] = value().astype(out_ref.dtype)

    # a group of one item: zero the accumulator so that its last item's ``acc + dot`` reads zeros (rare)
    pl.when(compute & first & last)(lambda: acc_ref.__setitem__(Ellipsis, jnp.zeros(acc_ref.shape, jnp.float32)))
    pl.when(not_(compute) & last)(lambda: write(lambda: jnp.zeros(acc_ref.shape, jnp.float32)))  # empty group
    for masked, cond in ((True, compute & partial), (False, compute & not_(partial))):
        @pl.when(cond & first & not_(last))
        def _(masked=masked):
            acc_ref[...] = dot(masked)

        @pl.when(cond & not_(first) & not_(last))
        def _(masked=masked):
            acc_ref[...] += dot(masked)

        pl.when(cond & last)(lambda masked=masked: write(lambda: acc_ref[...] + dot(masked)))

    if n_slots:
        @pl.when((kk == pl.num_programs(0) - 1) & (n == gn - 1) & (i == T - 1))
        def _():  # the grid's last step, after its own write: wait for the last n_slots writes
            for d in range(1, n_slots + 1):
                wait((kk * gn + n) * G + G - d)


# ----------------------------------------------------------------------------------------------- checks
def _check_meta(group_sizes, group_offset, G: int, where: str):
    if len(group_sizes.shape) != 1:
        raise ArgumentError(f"{where}: group_sizes must be 1-D [G_total], got shape {tuple(group_sizes.shape)}")
    if _dtype_name(group_sizes.dtype) != "int32":
        raise DTypeError(f"{where}: group_sizes must be int32 (as jax.lax.ragged_dot / megablox gmm), got "
                         f"{_dtype_name(group_sizes.dtype)}; cast with .to(torch.int32)")
    Gt = group_sizes.shape[0]
    if Gt < G:
        raise ArgumentError(f"{where}: group_sizes has {Gt} groups but rhs has {G}; len(group_sizes) must be "
                            f">= rhs.shape[0] (== unless group_offset selects a shard)")
    if tuple(group_offset.shape) not in ((), (1,)):
        raise ArgumentError(f"{where}: group_offset must be a scalar (shape () or (1,)), got {tuple(group_offset.shape)}")
    if _dtype_name(group_offset.dtype) != "int32":
        raise DTypeError(f"{where}: group_offset must be int32, got {_dtype_name(group_offset.dtype)}")


def fwd_dims(group_sizes, group_offset, lhs, rhs, transpose_rhs, where="tpukernels::grouped_matmul_fwd"):
    """``(M, K, N, G)`` of a forward call after checking ranks, shapes and dtypes (shape arithmetic only).

    Raises:
        ArgumentError: ranks, K mismatch, group_sizes length, group_offset shape.
        DTypeError: operand dtypes differ or are not bfloat16/float32; group metadata not int32.
    """
    if len(lhs.shape) != 2:
        raise ArgumentError(f"{where}: lhs must be 2-D [M, K], got shape {tuple(lhs.shape)}")
    if len(rhs.shape) != 3:
        raise ArgumentError(f"{where}: rhs must be 3-D [G, {'N, K' if transpose_rhs else 'K, N'}], got shape "
                            f"{tuple(rhs.shape)}")
    M, K = lhs.shape
    G, d1, d2 = rhs.shape
    Kr, N = (d2, d1) if transpose_rhs else (d1, d2)
    if K != Kr:
        raise ArgumentError(f"{where}: contraction dims differ: lhs {tuple(lhs.shape)} has K = {K}, rhs "
                            f"{tuple(rhs.shape)} (transpose_rhs={transpose_rhs}) has K = {Kr}")
    dl, dr = _dtype_name(lhs.dtype), _dtype_name(rhs.dtype)
    if dl != dr:
        raise DTypeError(f"{where}: lhs is {dl} but rhs is {dr}; use one dtype")
    if dl not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: dtype {dl} is not supported; use one of {KERNEL_DTYPES}")
    _check_meta(group_sizes, group_offset, G, where)
    return M, K, N, G


def tgmm_dims(group_sizes, group_offset, x, y, num_groups, where="tpukernels::grouped_matmul_tgmm"):
    """``(M, K, N, G)`` of a tgmm call (``x [M, K]``, ``y [M, N]``) after the same checks as :func:`fwd_dims`."""
    for t, n in ((x, "x"), (y, "y")):
        if len(t.shape) != 2:
            raise ArgumentError(f"{where}: {n} must be 2-D [M, cols], got shape {tuple(t.shape)}")
    if x.shape[0] != y.shape[0]:
        raise ArgumentError(f"{where}: x {tuple(x.shape)} and y {tuple(y.shape)} must have the same rows")
    dx, dy = _dtype_name(x.dtype), _dtype_name(y.dtype)
    if dx != dy or dx not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: x and y must share one dtype of {KERNEL_DTYPES}, got {dx} and {dy}")
    if num_groups < 0:
        raise ArgumentError(f"{where}: num_groups must be >= 0, got {num_groups}")
    _check_meta(group_sizes, group_offset, num_groups, where)
    return x.shape[0], x.shape[1], y.shape[1], num_groups


def _out_dtype(out_dtype, x):
    import jax.numpy as jnp

    return np.dtype(getattr(jnp, canonical_out_dtype(out_dtype) or _dtype_name(x.dtype)))


def num_items(M: int, G: int, bm: int) -> int:
    """Static work-item bound ``ceil(M / bm) + G - 1`` of both kernels (0 when there is nothing to do)."""
    tiles = -(-M // bm) if M > 0 else 0
    return 0 if tiles == 0 or G == 0 else tiles + G - 1


# ----------------------------------------------------------------------------------------------- launches
@_dsl.tpu_kernel(
    _gmm_body, name="grouped_matmul_fwd", namespace="tpukernels", tunables=TUNABLES,
    heuristic=lambda *specs, **st: heuristic(*specs, **st),
    out_shape=lambda gs, go, lhs, rhs, transpose_rhs=False, out_dtype=None: _dsl.OutSpec(
        (fwd_dims(gs, go, lhs, rhs, transpose_rhs)[0], fwd_dims(gs, go, lhs, rhs, transpose_rhs)[2]),
        _out_dtype(out_dtype, lhs)),
    reference=_dsl.jax_reference(lambda *a, **k: reference_fwd_jnp(*a, **k)),
)
def grouped_matmul_fwd(group_sizes: torch.Tensor, group_offset: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor,
                       transpose_rhs: bool = False, out_dtype: Optional[str] = None,
                       *, bm: int, bk: int, bn: int, rhs_prefetch: bool) -> torch.Tensor:
    """Grouped matmul kernel: ``lhs [M, K]``, ``rhs [G, K, N]`` (``transpose_rhs``: ``[G, N, K]``),
    ``group_sizes int32 [G_total]``, ``group_offset int32 [1]`` -> ``[M, N]`` (module docstring)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    M, K, N, G = fwd_dims(group_sizes, group_offset, lhs, rhs, transpose_rhs)
    odt = _out_dtype(out_dtype, lhs)
    bm_, bk_, bn_ = _clamp(M, bm), _clamp(K, bk), _clamp(N, bn)
    T = num_items(M, G, bm_)
    gn, gk = _dsl.cdiv(N, bn_), _dsl.cdiv(K, bk_)

    def k_eff(t, k, i):  # items that do not compute stay on the previous item's last K block (no DMA)
        return jnp.where(_bits(_flags(t, T, i), COMPUTE), k, gk - 1)

    lhs_spec = pl.BlockSpec((bm_, bk_), lambda n, i, k, t: (t[F_SRC_TILE * T + i], k_eff(t, k, i)))
    rhs_blk = (bn_, bk_) if transpose_rhs else (bk_, bn_)
    # the manual rhs chain (module docstring) needs one K step and whole column blocks (no N tail to clip)
    manual = bool(rhs_prefetch) and gk == 1 and N % bn_ == 0 and T > 0
    scratch = []
    if manual:
        rhs_spec = pl.BlockSpec(memory_space=pl.ANY)
        scratch = [pltpu.VMEM((2, *rhs_blk), lhs.dtype), pltpu.SemaphoreType.DMA((2,))]
    elif transpose_rhs:
        rhs_spec = pl.BlockSpec((None, bn_, bk_), lambda n, i, k, t: (t[F_GROUP * T + i], n, k_eff(t, k, i)))
    else:
        rhs_spec = pl.BlockSpec((None, bk_, bn_), lambda n, i, k, t: (t[F_GROUP * T + i], k_eff(t, k, i), n))
    out_spec = pl.BlockSpec((bm_, bn_), lambda n, i, k, t: (t[F_TILE * T + i], n))
    isz, osz = np.dtype(lhs.dtype).itemsize, np.dtype(odt).itemsize
    acc_shape = (bm_, bn_) if gk > 1 else (8, 128)
    need = (2 * (padded_bytes((bm_, bk_), lhs.dtype) + padded_bytes(rhs_blk, lhs.dtype) + padded_bytes((bm_, bn_), odt))
            + padded_bytes(acc_shape, jnp.float32))
    # upper bound: lhs once per N block, rhs [K, N] once per work item, out once
    cost = pl.CostEstimate(flops=2 * M * K * N, transcendentals=0,
                           bytes_accessed=int(gn * M * K * isz + T * K * N * isz + M * N * osz))
    return _dsl.Launch(
        grid=(gn, T, gk),
        in_specs=[lhs_spec, rhs_spec],
        out_specs=out_spec,
        out_shape=_dsl.OutSpec((M, N), odt),
        scratch_shapes=[pltpu.VMEM(acc_shape, jnp.float32), *scratch],
        num_scalar_prefetch=2,
        prefetch=lambda gs, go: _fwd_schedule(gs, go, M=int(M), G=int(G), bm=int(bm_), T=int(T)),
        # the manual chain crosses output-column passes (a pass's last run fetches the next pass's first
        # block), so the passes run in order on one core (megacore chips lose the N split; v5e / v6e have one
        # TensorCore per device, tpu7x shows each as a device)
        dimension_semantics=(("arbitrary" if manual else "parallel"), "arbitrary", "arbitrary"),
        vmem_limit_bytes=scoped_vmem_limit(need),
        cost_estimate=cost,
        body_kwargs=dict(T=int(T), bm=int(bm_), n_k=int(gk), blk_k=int(bk_), k_size=int(K),
                         transpose_rhs=bool(transpose_rhs), rhs_prefetch=manual, bn=int(bn_), n_pass=int(gn),
                         precision=lax.Precision.HIGHEST if _dtype_name(lhs.dtype) == "float32" else None),
    )


@_dsl.tpu_kernel(
    _tgmm_body, name="grouped_matmul_tgmm", namespace="tpukernels", tunables=TUNABLES_TGMM,
    heuristic=lambda *specs, **st: heuristic_tgmm(*specs, **st),
    out_shape=lambda gs, go, x, y, num_groups, out_dtype=None: _dsl.OutSpec(
        (num_groups, x.shape[1], y.shape[1]), _out_dtype(out_dtype, x)),
    reference=_dsl.jax_reference(lambda *a, **k: reference_tgmm_jnp(*a, **k)),
)
def grouped_matmul_tgmm(group_sizes: torch.Tensor, group_offset: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                        num_groups: int, out_dtype: Optional[str] = None,
                        *, bm: int, bk: int, bn: int) -> torch.Tensor:
    """Transposed grouped matmul (weight gradient): ``x [M, K]``, ``y [M, N]`` -> ``[num_groups, K, N]`` with
    ``out[g] = x[rows of g]^T @ y[rows of g]`` (zero for an empty group)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    M, K, N, G = tgmm_dims(group_sizes, group_offset, x, y, num_groups)
    odt = _out_dtype(out_dtype, x)
    bm_, bk_, bn_ = _clamp(M, bm), _clamp(K, bk), _clamp(N, bn)
    T = num_items(M, G, bm_)
    gk, gn = _dsl.cdiv(K, bk_), _dsl.cdiv(N, bn_)
    x_spec = pl.BlockSpec((bm_, bk_), lambda kk, n, i, t: (t[F_SRC_TILE * T + i], kk))
    y_spec = pl.BlockSpec((bm_, bn_), lambda kk, n, i, t: (t[F_SRC_TILE * T + i], n))
    isz, osz = np.dtype(x.dtype).itemsize, np.dtype(odt).itemsize
    base = 2 * (padded_bytes((bm_, bk_), x.dtype) + padded_bytes((bm_, bn_), x.dtype)) + padded_bytes((bk_, bn_), jnp.float32)
    blk_out = padded_bytes((bk_, bn_), odt)
    if K % bk_ == 0 and N % bn_ == 0:  # d_W blocks written by the body's own copies (_tgmm_body)
        n_slots = 2 if base + 2 * blk_out + 4 * MiB <= vmem_cap() else 1
        out_spec = pl.BlockSpec(memory_space=pl.ANY)
        scratch = [pltpu.VMEM((n_slots, bk_, bn_), odt), pltpu.SemaphoreType.DMA((n_slots,)),
                   pltpu.SMEM((n_slots,), jnp.int32)]
        # the writes' copy chain crosses d_W blocks: one core runs them in order (v5e / v6e / tpu7x have one)
        semantics = ("arbitrary", "arbitrary", "arbitrary")
        need = base + n_slots * blk_out
    else:  # a K or N tail: the pipeline's (partial) output blocks
        n_slots = 0
        out_spec = pl.BlockSpec((None, bk_, bn_), lambda kk, n, i, t: (t[F_GROUP * T + i], kk, n))
        scratch, semantics, need = [], ("parallel", "parallel", "arbitrary"), base + 2 * blk_out
    cost = pl.CostEstimate(flops=2 * M * K * N, transcendentals=0,
                           bytes_accessed=int(gn * M * K * isz + gk * M * N * isz + G * K * N * osz))
    return _dsl.Launch(
        grid=(gk, gn, T),
        in_specs=[x_spec, y_spec],
        out_specs=out_spec,
        out_shape=_dsl.OutSpec((G, K, N), odt),
        scratch_shapes=[pltpu.VMEM((bk_, bn_), jnp.float32), *scratch],
        num_scalar_prefetch=2,
        prefetch=lambda gs, go: _tgmm_schedule(gs, go, M=int(M), G=int(G), bm=int(bm_), T=int(T)),
        dimension_semantics=semantics,
        vmem_limit_bytes=scoped_vmem_limit(need),
        cost_estimate=cost,
        body_kwargs=dict(T=int(T), bm=int(bm_), G=int(G), gn=int(gn), bk=int(bk_), bn=int(bn_), n_slots=n_slots,
                         precision=lax.Precision.HIGHEST if _dtype_name(x.dtype) == "float32" else None),
    )


def heuristic(group_sizes, group_offset, lhs, rhs, transpose_rhs=False, out_dtype=None) -> dict:
    """Forward defaults before clamping: bf16 ``bm=512, bn=1024`` and ``bk = K`` up to 4096 (one K step:
    consecutive tiles of a group then reuse the resident rhs block, ~26 MiB of VMEM at K = 4096), else
    ``bk=1024`` (~10 MiB, the dense matmul's blocks); float32 ``512, 512, 512``. Shipped per-chip tuning
    data takes precedence."""
    if _dtype_name(lhs.dtype) == "float32":
        return dict(bm=512, bk=512, bn=512)
    K = lhs.shape[1]
    return dict(bm=512, bk=4096 if K <= 4096 else 1024, bn=1024)


def heuristic_tgmm(group_sizes, group_offset, x, y, num_groups=0, out_dtype=None) -> dict:
    """tgmm defaults: bf16 ``bm=256, bk=2048, bn=2048`` (~36 MiB of VMEM, fits every chip's cap): both operands
    are streamed every step, so the d_rhs block must be large (``bk * bn / (bk + bn)`` FLOP per byte: 1024 here,
    v6e needs ~560) while ``bm`` stays small (each group boundary costs one extra ``bm``-row item; the f32
    accumulator is read and written once per ``bm`` rows). float32 ``512, 512, 512``. Shipped per-chip tuning
    data takes precedence."""
    if _dtype_name(x.dtype) == "float32":
        return dict(bm=512, bk=512, bn=512)
    return dict(bm=256, bk=2048, bn=2048)


# ----------------------------------------------------------------------------------------------- references
def _ref_bounds_np(group_sizes, group_offset, M, G):
    sizes = np.maximum(np.asarray(group_sizes, dtype=np.int64), 0)
    ends = np.minimum(np.cumsum(sizes), M)
    starts = np.concatenate([[0], ends[:-1]])
    off = int(np.clip(int(np.asarray(group_offset).reshape(-1)[0]), 0, len(sizes) - G))
    return [(int(starts[off + g]), int(ends[off + g])) for g in range(G)]


def reference(lhs, rhs, group_sizes, *, transpose_rhs=False, group_offset=None) -> torch.Tensor:
    """float64 reference of :func:`grouped_matmul` from the given (low-precision) inputs, **not** rounded."""
    M, G = lhs.shape[0], rhs.shape[0]
    w = rhs.double().transpose(1, 2) if transpose_rhs else rhs.double()
    out = torch.zeros(M, w.shape[2], dtype=torch.float64)
    off = 0 if group_offset is None else int(group_offset)
    for g, (s, e) in enumerate(_ref_bounds_np(group_sizes.cpu().numpy(), [off], M, G)):
        out[s:e] = lhs[s:e].double() @ w[g]
    return out


def reference_tgmm(x, y, group_sizes, num_groups, group_offset=None) -> torch.Tensor:
    """float64 reference of the tgmm kernel: ``[G, K, N]``."""
    off = 0 if group_offset is None else int(group_offset)
    out = torch.zeros(num_groups, x.shape[1], y.shape[1], dtype=torch.float64)
    for g, (s, e) in enumerate(_ref_bounds_np(group_sizes.cpu().numpy(), [off], x.shape[0], num_groups)):
        out[g] = x[s:e].double().T @ y[s:e].double()
    return out


def reference_fwd_jnp(group_sizes, group_offset, lhs, rhs, transpose_rhs=False, out_dtype=None):
    """jax reference of the forward kernel (``jax.lax.ragged_dot`` on the shard; autotuner check)."""
    import jax
    import jax.numpy as jnp

    M, G = lhs.shape[0], rhs.shape[0]
    s, e = _group_bounds(group_sizes, group_offset, M, G)
    w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    rows = jnp.arange(M)[:, None]
    member = (rows >= s[None, :]) & (rows < e[None, :])  # [M, G]
    z = jnp.einsum("mk,gkn,mg->mn", lhs.astype(jnp.float32), w.astype(jnp.float32), member.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return z.astype(_out_dtype(out_dtype, lhs))


def reference_tgmm_jnp(group_sizes, group_offset, x, y, num_groups, out_dtype=None):
    import jax
    import jax.numpy as jnp

    s, e = _group_bounds(group_sizes, group_offset, x.shape[0], num_groups)
    rows = jnp.arange(x.shape[0])[:, None]
    member = ((rows >= s[None, :]) & (rows < e[None, :])).astype(jnp.float32)
    z = jnp.einsum("mk,mn,mg->gkn", x.astype(jnp.float32), y.astype(jnp.float32), member,
                   precision=jax.lax.Precision.HIGHEST)
    return z.astype(_out_dtype(out_dtype, x))


# ----------------------------------------------------------------------------------------------- backward
# out_dtype spelled out as the operand dtype (the backward does) is keyed as the tables' out_dtype=None
grouped_matmul_fwd.canonicalize = grouped_matmul_tgmm.canonicalize = _dsl.dtype_default("out_dtype", 2)


@grouped_matmul_fwd.def_backward
def _fwd_backward(ctx, g):
    gs, go, lhs, rhs = ctx.args["group_sizes"], ctx.args["group_offset"], ctx.args["lhs"], ctx.args["rhs"]
    tr = ctx.args["transpose_rhs"]
    dO = g.to(lhs.dtype)
    grads = {}
    if ctx.needs_input_grad.get("lhs"):
        grads["lhs"] = torch.ops.tpukernels.grouped_matmul_fwd(gs, go, dO, rhs, not tr, _dtype_name(lhs.dtype))
    if ctx.needs_input_grad.get("rhs"):
        x, y = (dO, lhs) if tr else (lhs, dO)
        grads["rhs"] = torch.ops.tpukernels.grouped_matmul_tgmm(gs, go, x, y, rhs.shape[0], _dtype_name(rhs.dtype))
    return grads


@grouped_matmul_tgmm.def_backward
def _tgmm_backward(ctx, g):
    """tgmm ``d_W[g] = x[rows of g]^T @ y[rows of g]`` is bilinear: ``d_x = grouped_matmul(y, g, transpose_rhs)``
    (``y_row @ g[grp]^T``), ``d_y = grouped_matmul(x, g)`` (``x_row @ g[grp]``); rows outside the groups get 0.
    This is what makes second derivatives of :func:`grouped_matmul` (through its ``d_rhs``) work."""
    gs, go, x, y = ctx.args["group_sizes"], ctx.args["group_offset"], ctx.args["x"], ctx.args["y"]
    dW = g.to(x.dtype)
    grads = {}
    if ctx.needs_input_grad.get("x"):
        grads["x"] = torch.ops.tpukernels.grouped_matmul_fwd(gs, go, y.to(x.dtype), dW, True, _dtype_name(x.dtype))
    if ctx.needs_input_grad.get("y"):
        grads["y"] = torch.ops.tpukernels.grouped_matmul_fwd(gs, go, x.to(y.dtype), dW.to(y.dtype), False,
                                                             _dtype_name(y.dtype))
    return grads


# ----------------------------------------------------------------------------------------------- public op
def _is_tracing(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or torch.compiler.is_compiling()


def _check_public(lhs, rhs, group_sizes, transpose_rhs, group_offset, out_dtype):
    where = "tpukernels::grouped_matmul"
    for t, n in ((lhs, "lhs"), (rhs, "rhs"), (group_sizes, "group_sizes")):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(t).__name__}")
    go = group_offset if group_offset is not None else torch.zeros((), dtype=torch.int32, device=lhs.device)
    M, K, N, G = fwd_dims(group_sizes, go, lhs, rhs, transpose_rhs, where)
    devs = {t.device for t in (lhs, rhs, group_sizes) + ((group_offset,) if group_offset is not None else ())}
    if len(devs) > 1:
        raise DeviceError(f"{where}: lhs, rhs, group_sizes (and group_offset) must be on one device, got "
                          f"{sorted(str(d) for d in devs)}")
    Gt = group_sizes.shape[0]
    if group_offset is None and Gt != G:
        raise ArgumentError(f"{where}: rhs has {G} groups but group_sizes has {Gt}; pass group_offset for a shard")
    canonical_out_dtype(out_dtype, where)
    # value checks: only where the values are on the host and concrete (module docstring)
    if group_sizes.device.type == "cpu" and not _is_tracing(group_sizes):
        sizes = group_sizes.numpy()
        if (sizes < 0).any():
            g = int(np.argmax(sizes < 0))
            raise ArgumentError(f"{where}: group_sizes[{g}] = {int(sizes[g])} is negative")
        total = int(sizes.astype(np.int64).sum())
        if total > M:
            raise ArgumentError(f"{where}: sum(group_sizes) = {total} exceeds lhs rows M = {M}")
    if go.device.type == "cpu" and not _is_tracing(go):
        off = int(go.reshape(-1)[0])
        if not 0 <= off <= Gt - G:
            raise ArgumentError(f"{where}: group_offset {off} must be in [0, len(group_sizes) - rhs.shape[0]] = "
                                f"[0, {Gt - G}]")
    return go.reshape(1)


def _grouped_matmul_impl(lhs, rhs, group_sizes, transpose_rhs=False, group_offset=None, out_dtype=None, config=None):
    go = _check_public(lhs, rhs, group_sizes, transpose_rhs, group_offset, out_dtype)
    return torch.ops.tpukernels.grouped_matmul_fwd(group_sizes, go, lhs, rhs, transpose_rhs,
                                                   canonical_out_dtype(out_dtype), config=config)


_LIB = torch.library.Library("tpukernels", "FRAGMENT")
_LIB.define("grouped_matmul(Tensor lhs, Tensor rhs, Tensor group_sizes, bool transpose_rhs=False, "
            "Tensor? group_offset=None, str? out_dtype=None, str? config=None) -> Tensor")
_LIB.impl("grouped_matmul", _grouped_matmul_impl, "CompositeImplicitAutograd")


def grouped_matmul(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, transpose_rhs: bool = False,
                   group_offset=None, out_dtype=None, config=None) -> torch.Tensor:
    """Grouped (ragged) matmul: ``out[rows of g] = lhs[rows of g] @ rhs[g - group_offset]``; differentiable.

    ``torch.ops.tpukernels.grouped_matmul`` (semantics of ``jax.lax.ragged_dot`` / megablox ``gmm``).

    Args:
        lhs: ``[M, K]`` bfloat16 or float32 (cpu: Pallas interpret; tpu: TorchTPU).
        rhs: ``[G, K, N]``, or ``[G, N, K]`` with ``transpose_rhs=True``; same dtype as ``lhs``.
        group_sizes: int32 ``[G_total]``: rows per group, contiguous in group order; ``sum <= M`` (the rest
            of the rows are zero in the result). Zeros allowed.
        transpose_rhs: ``rhs`` is stored ``[G, N, K]`` (contracted on its last dim, no copy).
        group_offset: int or int32 scalar tensor: ``rhs`` holds groups ``[group_offset, group_offset + G)``
            of ``G_total`` (a shard); rows of other groups are zero. Default 0 (``G == G_total``).
        out_dtype: result dtype (torch dtype or name, bfloat16 / float32); default ``lhs.dtype``.
        config: tuning config of the forward kernel (``{"bm": 256, ...}``); default: tuned/heuristic.

    Returns:
        ``[M, N]`` in ``out_dtype`` (products accumulated in float32, rounded once).

    Raises:
        ArgumentError: operands that are not tensors, ranks, K mismatch, ``len(group_sizes)`` vs ``G``,
            ``group_offset`` not an int / int32 scalar tensor, its shape or range,
            negative sizes or ``sum(group_sizes) > M`` (value checks on host cpu tensors only; see the
            module docstring for what is clamped on device instead).
        DTypeError: operands of different or unsupported dtypes (float16, float64, ints), ``group_sizes``
            / ``group_offset`` not int32, bad ``out_dtype``.
        DeviceError: tensors on different devices.
        ConfigError: ``config`` is not a dict, or names unknown tunables / breaks their rules.
    """
    from collections.abc import Mapping

    from ..targets import config_to_json

    where = "tpukernels::grouped_matmul"
    for t, n in ((lhs, "lhs"), (rhs, "rhs"), (group_sizes, "group_sizes")):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(t).__name__}")
    if group_offset is not None and not isinstance(group_offset, torch.Tensor):
        if isinstance(group_offset, bool) or not isinstance(group_offset, (int, np.integer)):
            raise ArgumentError(f"{where}: group_offset must be an int or an int32 scalar tensor, got "
                                f"{type(group_offset).__name__} {group_offset!r}")
        group_offset = torch.tensor(int(group_offset), dtype=torch.int32, device=lhs.device)
    cfg = None if config is None or (isinstance(config, Mapping) and not config) else \
        config_to_json(grouped_matmul_fwd, config)
    return torch.ops.tpukernels.grouped_matmul(lhs, rhs, group_sizes, transpose_rhs, group_offset,
                                               canonical_out_dtype(out_dtype), cfg)


def skewed_group_sizes(tokens: int, top_k: int, num_experts: int, skew: float = 1.2, seed: int = 0) -> list[int]:
    """Realistic skewed MoE group sizes: ``tokens * top_k`` rows split over ``num_experts`` by a Zipf-like
    load (expert ``e`` gets weight ``1 / (e + 1) ** skew``, shuffled), summing exactly to ``tokens * top_k``."""
    rng = np.random.default_rng(seed)
    w = 1.0 / (np.arange(num_experts) + 1.0) ** skew
    rng.shuffle(w)
    rows = tokens * top_k
    sizes = np.floor(w / w.sum() * rows).astype(np.int64)
    sizes[np.argmax(w)] += rows - sizes.sum()
    return [int(s) for s in sizes]


#: Mixtral-8x7B expert shapes (hidden 4096, ffn 14336, 8 experts), 8192 tokens top-2 = 16384 rows:
#: gate/up projection (x @ W1^T, weights [E, ffn, hidden]) and down projection (h @ W2^T).
MIXTRAL = dict(tokens=8192, top_k=2, experts=8, hidden=4096, ffn=14336)
_R = MIXTRAL["tokens"] * MIXTRAL["top_k"]
STANDARD_CASES = [
    (grouped_matmul_fwd, ("8:i32", "1:i32", f"{_R}x4096:bf16", "8x14336x4096:bf16"), {"transpose_rhs": True}),
    (grouped_matmul_fwd, ("8:i32", "1:i32", f"{_R}x14336:bf16", "8x4096x14336:bf16"), {"transpose_rhs": True}),
    (grouped_matmul_fwd, ("8:i32", "1:i32", f"{_R}x4096:bf16", "8x4096x14336:bf16"), {}),
    (grouped_matmul_tgmm, ("8:i32", "1:i32", f"{_R}x4096:bf16", f"{_R}x14336:bf16"), {"num_groups": 8}),
]

__all__ = ["grouped_matmul", "grouped_matmul_fwd", "grouped_matmul_tgmm", "reference", "reference_tgmm",
           "heuristic", "heuristic_tgmm", "skewed_group_sizes", "STANDARD_CASES", "MIXTRAL"]
