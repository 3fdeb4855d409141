"""Grouped matmul over ragged row groups (MoE expert layers): ``out[rows of g] = lhs[rows of g] @ rhs[g]``.

Public op::

    torch.ops.tpukernels.grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=False, group_offset=None,
                                        out_dtype=None, config=None, rhs_bias=None) -> Tensor
    tpukernels.library.grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False, group_offset=None,
                                      out_dtype=None, config=None, rhs_bias=None)   # same, functional

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
* dtypes: ``lhs`` and ``rhs`` bfloat16 or float32 (the public op widens a bfloat16 operand beside a float32 one
  to float32, exactly; the kernels take one dtype); products accumulate in float32 (an f32 VMEM
  scratch); the result is rounded once to ``out_dtype`` (default: the operand dtype, as ``ragged_dot``;
  megablox defaults to float32). float32 operands use ``precision=HIGHEST``.
* ``rhs_bias`` (megablox / tpu-inference ``gmm``): optional ``[G, 1, N]`` bfloat16 / float32; the forward kernel
  adds ``rhs_bias[g]`` (in float32) to the accumulator of the rows of local group ``g`` in its epilogue, before
  the rounding to ``out_dtype``, through a BlockSpec indexed by the work item's group. Rows no local group owns
  stay zero (megablox leaves them unwritten). Without a bias the kernel has no extra operand and the same
  program (Mosaic module) as before the argument existed.

Backward (autograd, ``dO`` the incoming gradient cast to the operand dtype)::

    d_lhs = grouped_matmul(dO, rhs, transpose_rhs=not transpose_rhs)          (grouped_matmul_fwd)
    d_rhs[g] = lhs[rows of g]^T @ dO[rows of g]   [G, K, N]                    (grouped_matmul_tgmm)
             (transpose_rhs: dO[rows of g]^T @ lhs[rows of g], [G, N, K])

    d_rhs_bias[g] = sum of the incoming gradient over the rows of g  [G, 1, N]  (float32 sum, bias dtype)

Empty groups get a zero ``d_rhs[g]`` (and ``d_rhs_bias[g]``). ``group_sizes`` / ``group_offset`` get no
gradient. The backward is itself made of differentiable grouped matmuls (``grouped_matmul`` and ``tgmm`` ops with
their own backward, :func:`tgmm_backward`), so second derivatives run through the same kernels (``d_rhs_bias``
is a plain torch segment sum).

Kernels (both Pallas TPU kernels with scalar prefetch and data-dependent index maps):

* ``tpukernels::grouped_matmul_fwd``: grid ``(N/bn, T, K/bk)`` with ``T = ceil(M/bm) + G - 1`` work items,
  a static bound. Work item ``i`` is one visit of one ``bm``-row output tile by one group (a tile shared by
  two groups is visited twice, consecutively, each storing only its rows with a select; rows of no group get
  one visit that stores zeros). Items past the real count repeat the last block indices, so they move no
  data and the body skips them. The visit list (``fwd_schedule``) is computed on device from
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
``tpukernels.library.matmul_ops``) and the forward's ``rhs_prefetch`` (the chain above; off: the grid pipeline's rhs
blocks). Smaller ``bm`` wastes less on tiles shared by two groups (each visit computes the whole tile); larger
``bm`` re-reads ``rhs`` less; ``bk >= K`` (one K step) keeps a group's ``rhs`` block resident while its tiles
pass. Defaults: per-chip shipped tuning data
``tpukernels/data/autotuning/<chip>/tpukernels.grouped_matmul_*.json`` at the Mixtral shapes of
:data:`STANDARD_CASES`, else :func:`heuristic`. The scoped-VMEM request is capped per chip at 7/8 of jax's
``vmem_capacity_bytes`` (:func:`tpukernels.library.vmem.vmem_cap`: 112 MiB on v5e / v6e, 56 MiB on tpu7x), so
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

Package layout (every name above, and the schedule constants the tests and studies read, is importable from
``tpukernels.library.grouped_matmul_ops``): :mod:`.common` (dtypes, ``out_dtype``), :mod:`.schedule` (the
work-item table: fields, flag bits, group bounds, the forward and tgmm schedules), :mod:`.kernels` (tunables,
the kernel bodies and their argument checks, the launches ``grouped_matmul_fwd`` / ``grouped_matmul_tgmm``,
heuristics, the autograd wiring), :mod:`.references` (float64 and jax references), :mod:`.public` (the op
``grouped_matmul``, its ``torch.library`` registration, ``STANDARD_CASES``, ``skewed_group_sizes``), :mod:`.quant`
(quantized experts: ``grouped_matmul_quantized`` with int8 / fp8 / int4 / fp4 weights and per-channel or block
scales in tpu-inference's ``rhs_scale [G, num_blocks, 1, N]`` layout, dequantized in VMEM by its own kernels
``grouped_matmul_quant_fwd`` / ``grouped_matmul_quant_dx``; layout, error bounds and gradients in its docstring). Kernel
bodies and launch functions are kept verbatim across moves: the tuning database keys entries by a hash of
their source text.
"""

from .common import KERNEL_DTYPES, clamp, dtype_name, resolve_out_dtype, canonical_out_dtype  # noqa: F401
from .schedule import (ALL, COMPUTE, FIRST, F_FLAGS, F_GROUP, F_HI, F_LO, F_NEXT_GROUP, F_RUN, F_RUNS_M1,  # noqa: F401
                       F_SRC_TILE, F_TILE, LAST, N_FIELDS, N_FIELDS_FWD, PARTIAL, RUN_START, STORE, TGMM_COMPLEMENT,
                       bits, count_le, forward_fill, fwd_schedule, group_bounds, item_flags, num_items, take,
                       tgmm_flags, tgmm_schedule)
from .references import ref_bounds_np, reference, reference_fwd_jnp, reference_tgmm, reference_tgmm_jnp  # noqa: F401
from .kernels import (TUNABLES, TUNABLES_TGMM, check_meta, fwd_backward, fwd_dims, gmm_body,  # noqa: F401
                      grouped_matmul_fwd, grouped_matmul_tgmm, heuristic, heuristic_tgmm, rhs_prefetch_chain,
                      tgmm_backward, tgmm_body, tgmm_dims)
from .public import (MIXTRAL, STANDARD_CASES, check_public, grouped_matmul, grouped_matmul_impl,  # noqa: F401
                     is_tracing, skewed_group_sizes)
from .quant import (TUNABLES_QUANT, TUNABLES_QUANT_DX, dequantize_experts, error_bound_quantized,  # noqa: F401
                    error_bound_quantized_dx, grouped_matmul_quant_dx, grouped_matmul_quant_fwd,
                    grouped_matmul_quantized, heuristic_quant, heuristic_quant_dx, pack_int4_experts, quant_dims,
                    quantize_experts, reference_quantized, reference_quantized_dx)

__all__ = ["grouped_matmul", "grouped_matmul_fwd", "grouped_matmul_tgmm", "reference", "reference_tgmm",
           "heuristic", "heuristic_tgmm", "skewed_group_sizes", "STANDARD_CASES", "MIXTRAL",
           "grouped_matmul_quantized", "grouped_matmul_quant_fwd", "grouped_matmul_quant_dx", "quantize_experts",
           "pack_int4_experts", "dequantize_experts", "reference_quantized", "error_bound_quantized",
           "reference_quantized_dx", "error_bound_quantized_dx"]
