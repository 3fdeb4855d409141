"""All-gather matmul as one Pallas kernel per device: the x shards travel around the ring by remote DMA while
the MXU multiplies the shard that has arrived (the collective matmul of Wang et al.; tpu-inference 0.32.0's
``kernels/collectives/all_gather_matmul.py`` and JAX's ``pallas/ops/tpu/all_gather.py`` are the anchors).

Public API (jax, inside ``jax.shard_map`` over a one-dimensional ring axis)::

    agmm_kernel(x, y, axis_name, n, *, block_m, block_n) -> (out, gathered)       the DSL kernel
    all_gather_matmul(x, y, mesh, axis_name, impl="kernel")                       the user-facing entry
                                                            (tpukernels.distributed.collective_matmul)

Shapes on device ``i`` of ``n`` (per-device shards; ``m = M / n``)::

    x         [m, K]        this device's rows of the global x (bf16 / f32)
    y         [K, Nl]       this device's columns of the global y (x's dtype)
    out       [n * m, Nl]   all_gather(x) @ y: every device's rows, this device's columns, x's dtype
    gathered  [n, m, K]     the gathered x (a by-product: the ring's landing buffer), x's dtype

Schedule: grid ``(n, Nl / block_n, m / block_m)``, sequential. Step ``s`` works on the shard of device
``o = (i - s) mod n`` (its own at ``s = 0``)::

    s = 0, first step: signal the left neighbour "ready", wait for the right one's signal (the barrier semaphore,
                       Launch.collective_id), copy x into gathered[i]
    first step of s:   start the remote DMA gathered[o] -> right neighbour's gathered[o]   (s < n - 1)
    every step:        out[o*m + rows, cols] = gathered[o][rows] @ y[:, cols]       (f32 accumulate, one DMA out)
    last step of s:    wait until that send has left and the left neighbour's shard (o - 1) has landed

The transfer feeding step ``s + 1`` runs during all of step ``s``'s matmuls: the all-gather's bytes are never
waited on whole (only the last tile's worth when the link is slower than the MXU). Each landing slot
``gathered[o]`` is written once, by one sender, and read only after its ``wait_recv``: no slot is reused, so no
more synchronisation than the start barrier is needed. Each slot has its own receive semaphore: with one for
all, a sender running a step ahead could complete its next transfer first and meet the wait meant for this one
(the interpreter showed it: NaN rows at 3 devices).

Limits (typed ``ArgumentError`` before lowering): ``K`` whole in VMEM per step (``block_m x K`` and ``K x block_n``
tiles, double-buffered y); ``m`` and ``Nl`` divisible by their blocks; the kernel must be traced inside
``shard_map`` with ``axis_name`` bound to a ring of ``n`` devices (``jax.lax.axis_size``). Not built: the reduce-
scatter twin (partial sums passed on by remote DMA); a prefetched x tile (each tile is copied in and waited for
before its matmul; y's tiles are pipelined by Pallas).

Tested (``tests/test_collective_matmul.py``) in the TPU interpreter (``pltpu.InterpretParams``: DMA and semaphore
semantics, NaN-initialised memory) on 2-, 3- and 4-device CPU meshes against float64 (the gathered x exactly),
and compiled by Mosaic inside XLA:TPU's program for compile-only ``v5e:2x2`` (one custom call, no collective).

Performance: no TPU here, and no model: libtpu 0.0.52's static profiler aborts on this kernel
(``llo_execution_graph.cc:46``, v5e:2x2) and writes no estimate for the ring version's collective-permutes,
though it does estimate XLA's all-gather (v5e:2x2, a 4096 x 4096 bf16 x gathered: 102k cycles beside the dot's
926k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import torch
from jax.experimental.pallas import tpu as pltpu

from .. import dsl as tk
from ..errors import ArgumentError, DTypeError

__all__ = ["agmm_kernel", "agmm_reference", "check_operands", "fit_block", "ring_axis_size", "ring_tunables",
           "COLLECTIVE_ID", "BLOCK_M", "BLOCK_N", "VMEM_BUDGET"]

NAMESPACE = "tpukernels"
#: the barrier semaphore's id (Mosaic ``collective_id``)
COLLECTIVE_ID = 0
BLOCK_M = (128, 256, 512, 1024)
BLOCK_N = (128, 256, 512, 1024, 2048)
#: VMEM the tiles and their temporaries may take (bytes; the kernels' own counts)
VMEM_BUDGET = 40 << 20


def _body(x_hbm, y_ref, out_hbm, g_hbm, xv, ov, local_sem, send_sem, recv_sems, out_sem, *, axis_name: str, n: int,
          m: int, block_m: int, block_n: int):
    s, j, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nj, nr = pl.num_programs(1), pl.num_programs(2)
    me = jax.lax.axis_index(axis_name)
    right, left = jax.lax.rem(me + 1, n), jax.lax.rem(me + n - 1, n)
    o = jax.lax.rem(me - s + n, n)  # whose shard this step multiplies
    first_of_s = jnp.logical_and(j == 0, r == 0)
    last_of_s = jnp.logical_and(j == nj - 1, r == nr - 1)

    @pl.when(jnp.logical_and(s == 0, first_of_s))
    def _start():
        barrier = pltpu.get_barrier_semaphore()
        pltpu.semaphore_signal(barrier, 1, device_id=(left,), device_id_type=pltpu.DeviceIdType.MESH)
        pltpu.semaphore_wait(barrier, 1)  # the right neighbour (our destination) is in the kernel
        own = pltpu.make_async_copy(x_hbm, g_hbm.at[me], local_sem)
        own.start()
        own.wait()

    def ring_copy():  # this step's shard to the right neighbour's landing slot of the same index, signalling
        # that slot's own receive semaphore there (one DMA per slot: a wait can only be met by its own transfer,
        # never by a later one that a sender running ahead completes first)
        return pltpu.make_async_remote_copy(g_hbm.at[o], g_hbm.at[o], send_sem, recv_sems.at[o], device_id=(right,),
                                            device_id_type=pltpu.DeviceIdType.MESH)

    @pl.when(jnp.logical_and(first_of_s, s < n - 1))
    def _send():
        ring_copy().start()

    tile = pltpu.make_async_copy(g_hbm.at[o, pl.ds(r * block_m, block_m)], xv, local_sem)
    tile.start()
    tile.wait()
    ov[...] = jnp.dot(xv[...], y_ref[...], preferred_element_type=jnp.float32).astype(ov.dtype)
    put = pltpu.make_async_copy(ov, out_hbm.at[pl.ds(o * m + r * block_m, block_m), pl.ds(j * block_n, block_n)],
                                out_sem)
    put.start()
    put.wait()

    @pl.when(jnp.logical_and(last_of_s, s < n - 1))
    def _arrived():
        ring_copy().wait_send()
        nxt = jax.lax.rem(o + n - 1, n)  # shard (o - 1) from the left neighbour, for step s + 1
        pltpu.make_async_remote_copy(g_hbm.at[nxt], g_hbm.at[nxt], send_sem, recv_sems.at[nxt], device_id=(left,),
                                     device_id_type=pltpu.DeviceIdType.MESH).wait_recv()


def fit_block(dim: int, want: int, quantum: int) -> int:
    """The largest block <= ``want`` dividing ``dim`` and a multiple of ``quantum`` (or ``dim`` itself) (the
    collective kernels' shared helper, with :func:`ring_axis_size`)."""
    b = min(want, dim)
    while b >= quantum:
        if dim % b == 0 and b % quantum == 0:
            return b
        b -= quantum
    return dim


def _blocks(x, y, block_m: int, block_n: int):
    (m, K), Nl = x.shape, y.shape[1]
    bm, bn = fit_block(m, block_m, 8), fit_block(Nl, block_n, 128)
    item = jnp.dtype(x.dtype).itemsize
    # x tile, two y tiles, the output tile, and Mosaic's temporaries: the loaded x and y tiles (the dot's values)
    # and its f32 result (as the reduce-scatter kernel's count, which v5e:2x2 showed was needed there)
    need = 2 * bm * K * item + 3 * K * bn * item + bm * bn * (4 + item)
    return bm, bn, need


def check_operands(op: str, x, y, axis_name: str, n, layout: str) -> None:
    """The collective kernels' operand checks: ``x`` and ``y`` 2-D with ``x``'s columns equal to ``y``'s rows
    (``layout`` names them in the error, e.g. ``"x [m, K] and y [K, Nl]"``), both bfloat16 or both float32, and the
    ring (:func:`ring_axis_size`). Raises ArgumentError / DTypeError naming ``op``."""
    if len(x.shape) != 2 or len(y.shape) != 2 or x.shape[1] != y.shape[0]:
        raise ArgumentError(f"{op}: {layout} expected, got x {tuple(x.shape)} and y {tuple(y.shape)}")
    if x.dtype not in (jnp.bfloat16, jnp.float32) or y.dtype != x.dtype:
        raise DTypeError(f"{op}: x and y must both be bfloat16 or float32, got {x.dtype} and {y.dtype}")
    ring_axis_size(op, axis_name, n)


def ring_tunables(rows: str, default_n: int) -> dict:
    """``block_m`` / ``block_n`` of a collective kernel (``rows``: what a block of rows is a block of)."""
    return {"block_m": tk.Tunable(BLOCK_M, default=512, doc=f"rows of {rows} per matmul step (upper bound)"),
            "block_n": tk.Tunable(BLOCK_N, default=default_n, doc="columns of y per matmul step (upper bound)")}


def ring_axis_size(op: str, axis_name: str, n) -> int:
    """``n``, checked: an int >= 2 equal to the size of ``axis_name``, which must be bound (the kernel is being
    traced inside ``shard_map``). Raises ArgumentError naming ``op``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ArgumentError(f"{op}: n must be an int >= 2 (the ring's size), got {n!r}")
    try:
        size = jax.lax.axis_size(axis_name)
    except NameError:
        raise ArgumentError(f"{op}: must be traced inside shard_map over axis {axis_name!r} (it is not bound "
                            f"here)") from None
    if size != n:
        raise ArgumentError(f"{op}: n = {n} but axis {axis_name!r} has {size} devices")
    return n


def _heuristic(x, y, *rest, **statics):
    return {"block_m": 512, "block_n": 1024}


def _out_shape(x, y, axis_name, n):
    m, K = x.shape
    return (tk.OutSpec((n * m, y.shape[1]), x.dtype), tk.OutSpec((n, m, K), x.dtype))


@tk.tpu_kernel(
    _body, name="all_gather_matmul_ring", namespace=NAMESPACE, heuristic=_heuristic, out_shape=_out_shape,
    sharding=[],  # no DTensor split: the kernel is the collective (it runs per device inside shard_map)
    tunables=ring_tunables("x", 1024),
)
def agmm_kernel(x: torch.Tensor, y: torch.Tensor, axis_name: str, n: int, *, block_m: int,
                block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(all_gather(x) @ y, all_gather(x))`` on one device of an ``n``-device ring (module docstring); call it
    inside ``shard_map``. Raises ArgumentError / DTypeError for shapes, dtypes, blocks over the VMEM budget, or
    a trace outside ``shard_map`` over ``axis_name``."""
    op = "tpukernels.all_gather_matmul_ring"
    check_operands(op, x, y, axis_name, n, "x [m, K] and y [K, Nl]")
    bm, bn, need = _blocks(x, y, block_m, block_n)
    (m, K), Nl = x.shape, y.shape[1]
    if m % bm or Nl % bn:
        raise ArgumentError(f"{op}: m = {m} and Nl = {Nl} need blocks dividing them (got block_m = {bm}, "
                            f"block_n = {bn}); m a multiple of 8, Nl of 128")
    if need > VMEM_BUDGET:
        raise ArgumentError(f"{op}: tiles of {need / 2**20:.1f} MiB (block_m = {bm}, block_n = {bn}, K = {K} whole) "
                            f"exceed the {VMEM_BUDGET >> 20} MiB budget: K is not tiled by this kernel")
    dt = x.dtype
    return tk.Launch(
        grid=(n, Nl // bn, m // bm),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((K, bn), lambda s, j, r: (0, j))],
        out_specs=[pl.BlockSpec(memory_space=pltpu.HBM), pl.BlockSpec(memory_space=pltpu.HBM)],
        out_shape=_out_shape(x, y, axis_name, n),
        scratch_shapes=[pltpu.VMEM((bm, K), dt), pltpu.VMEM((bm, bn), dt), pltpu.SemaphoreType.DMA,
                        pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((n,)), pltpu.SemaphoreType.DMA],
        dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
        vmem_limit_bytes=max(32 << 20, int(need * 1.25) + (4 << 20)),
        collective_id=COLLECTIVE_ID,
        cost_estimate=pl.CostEstimate(flops=2 * n * m * K * Nl, transcendentals=0, bytes_accessed=int(
            (2 * n * m * K + K * Nl + n * m * Nl) * jnp.dtype(dt).itemsize)),
        body_kwargs=dict(axis_name=axis_name, n=n, m=m, block_m=bm, block_n=bn),
    )


def agmm_reference(x_global, y_global):
    """float64 ``x @ y`` of the global (unsharded) operands, numpy."""
    import numpy as np

    return np.asarray(x_global, np.float64) @ np.asarray(y_global, np.float64)
