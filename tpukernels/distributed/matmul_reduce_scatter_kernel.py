"""Matmul -> reduce-scatter as one Pallas kernel per device: each device multiplies one row chunk of its K-shard
while the running float32 sums travel around the ring by remote DMA, tile by tile (the reduce-scatter collective
matmul of Wang et al.; the twin of :mod:`.all_gather_matmul_kernel`; tpu-inference 0.32.0's
``kernels/collectives`` is the anchor).

Public API (jax, inside ``jax.shard_map`` over a one-dimensional ring axis)::

    rsmm_kernel(x, y, axis_name, n, *, block_m, block_n) -> (out, landing)       the DSL kernel
    matmul_reduce_scatter(x, y, mesh, axis_name, impl="kernel")                  the user-facing entry
                                                             (tpukernels.distributed.collective_matmul)

Shapes on device ``i`` of ``n`` (``m = M / n``)::

    x         [M, Kl]          this device's K-shard of every row (bf16 / f32)
    y         [Kl, N]          this device's K-shard of y (x's dtype)
    out       [m, N]           rows [i m, (i + 1) m) of sum over devices of x_d @ y_d, x's dtype (one rounding)
    landing   [n - 1, m, N]    float32 partial sums received from the left neighbour, one slot per step (workspace)

Schedule: grid ``(n, N / block_n, m / block_m)``, sequential. Step ``s`` works on row chunk
``c = (i - 1 - s) mod n``; per output tile::

    p = x[c rows of the tile] @ y[:, tile cols]                          float32
    s > 0:       p += landing[s - 1][tile]       (the left neighbour's sum of chunk c so far; the whole slot is
                                                  waited for once, at the step's first tile)
    s < n - 1:   send p to the right neighbour's landing[s][tile]    (remote DMA from one of two VMEM buffers,
                                                  started as soon as the tile is done: the sums of step s travel
                                                  while step s's later tiles compute; the receiver waits for the
                                                  whole slot before its next step's first tile, so only the last
                                                  tile's transfer is exposed)
    s = n - 1:   c = i: out[tile] = p (rounded to x's dtype)

Synchronisation: a start barrier (``Launch.collective_id``), one receive semaphore per landing slot (a wait is
met only by its own step's transfers), one send semaphore per VMEM send buffer (a buffer is reused only after its
previous send left), and the last two sends waited for before the final step.

Limits (typed ``ArgumentError`` before lowering): ``Kl`` whole in VMEM per step; ``m`` and ``N`` divisible by
their blocks; traced inside ``shard_map`` with ``axis_name`` bound to ``n`` devices. Performance: no TPU here and
no model (libtpu 0.0.52's static profiler aborts on the all-gather twin, :mod:`.all_gather_matmul_kernel`; this
kernel was not tried).

Tested (``tests/test_collective_matmul.py``) in the TPU interpreter on 2-, 3- and 4-device CPU meshes against
float64, and compiled by Mosaic for compile-only ``v5e:2x2``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import dsl as tk
from ..errors import ArgumentError
from .all_gather_matmul_kernel import COLLECTIVE_ID, VMEM_BUDGET, check_operands, fit_block, ring_tunables

__all__ = ["rsmm_kernel", "rsmm_reference"]

NAMESPACE = "tpukernels"
F32 = jnp.float32


def _body(x_hbm, y_ref, out_hbm, land_hbm, xv, sv, av, ov, local_sem, send_sems, recv_sems, out_sem, *,
          axis_name: str, n: int, m: int, block_m: int, block_n: int):
    s, j, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nr = pl.num_programs(2)
    T = pl.num_programs(1) * nr  # tiles per step
    t = j * nr + r
    g = s * T + t  # tile index over the whole kernel: picks the send buffer
    buf = jax.lax.rem(g, 2)
    me = jax.lax.axis_index(axis_name)
    right, left = jax.lax.rem(me + 1, n), jax.lax.rem(me + n - 1, n)
    c = jax.lax.rem(me + 2 * n - 1 - s, n)  # the row chunk this step sums
    rows, cols = pl.ds(r * block_m, block_m), pl.ds(j * block_n, block_n)

    def send(slot, b):  # a tile's sum to the right neighbour's landing slot (descriptor also used to wait)
        return pltpu.make_async_remote_copy(sv.at[b], land_hbm.at[slot, rows, cols], send_sems.at[b],
                                            recv_sems.at[slot], device_id=(right,),
                                            device_id_type=pltpu.DeviceIdType.MESH)

    @pl.when(g == 0)
    def _start():
        barrier = pltpu.get_barrier_semaphore()
        pltpu.semaphore_signal(barrier, 1, device_id=(left,), device_id_type=pltpu.DeviceIdType.MESH)
        pltpu.semaphore_wait(barrier, 1)  # the right neighbour (our destination) is in the kernel

    @pl.when(jnp.logical_and(s > 0, t == 0))
    def _incoming():  # the left neighbour's whole step-(s - 1) slot has landed
        pltpu.make_async_remote_copy(land_hbm.at[s - 1], land_hbm.at[s - 1], send_sems.at[0], recv_sems.at[s - 1],
                                     device_id=(left,), device_id_type=pltpu.DeviceIdType.MESH).wait_recv()

    tile = pltpu.make_async_copy(x_hbm.at[pl.ds(c * m + r * block_m, block_m)], xv, local_sem)
    tile.start()
    tile.wait()
    p = jnp.dot(xv[...], y_ref[...], preferred_element_type=F32)

    @pl.when(s == 0)
    def _nothing_yet():
        av[...] = jnp.zeros_like(av)

    @pl.when(s > 0)
    def _running_sum():
        cp = pltpu.make_async_copy(land_hbm.at[s - 1, rows, cols], av, local_sem)
        cp.start()
        cp.wait()

    p = p + av[...]

    @pl.when(s < n - 1)
    def _pass_on():
        @pl.when(g >= 2)
        def _free():  # the send that used this buffer two tiles ago has left
            send(0, buf).wait_send()

        sv[buf] = p
        send(s, buf).start()

    @pl.when(jnp.logical_and(s == n - 1, t == 0))
    def _drain():  # the last two sends (the final step sends nothing)
        last = (n - 1) * T - 1
        send(0, jax.lax.rem(last, 2)).wait_send()

        @pl.when(last >= 1)
        def _():
            send(0, jax.lax.rem(last + 1, 2)).wait_send()

    @pl.when(s == n - 1)
    def _store():
        ov[...] = p.astype(ov.dtype)
        put = pltpu.make_async_copy(ov, out_hbm.at[rows, cols], out_sem)
        put.start()
        put.wait()


def _heuristic(x, y, *rest, **statics):
    return {"block_m": 512, "block_n": 512}


def _out_shape(x, y, axis_name, n):
    M, N = x.shape[0], y.shape[1]
    return (tk.OutSpec((M // n, N), x.dtype), tk.OutSpec((n - 1, M // n, N), F32))


@tk.tpu_kernel(
    _body, name="matmul_reduce_scatter_ring", namespace=NAMESPACE, heuristic=_heuristic, out_shape=_out_shape,
    sharding=[],  # no DTensor split: the kernel is the collective (it runs per device inside shard_map)
    tunables=ring_tunables("a row chunk", 512),
)
def rsmm_kernel(x: torch.Tensor, y: torch.Tensor, axis_name: str, n: int, *, block_m: int,
                block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reduce_scatter(x @ y, rows), landing)`` on one device of an ``n``-device ring (module docstring); call it
    inside ``shard_map``. Raises ArgumentError / DTypeError for shapes, dtypes, blocks over the VMEM budget, or a
    trace outside ``shard_map`` over ``axis_name``."""
    op = "tpukernels.matmul_reduce_scatter_ring"
    check_operands(op, x, y, axis_name, n, "x [M, Kl] and y [Kl, N]")
    (M, K), N = x.shape, y.shape[1]
    if M % n:
        raise ArgumentError(f"{op}: M = {M} rows must be divisible by the ring's n = {n}")
    m = M // n
    bm, bn = fit_block(m, block_m, 8), fit_block(N, block_n, 128)
    if m % bm or N % bn:
        raise ArgumentError(f"{op}: m = {m} and N = {N} need blocks dividing them (got block_m = {bm}, "
                            f"block_n = {bn}); m a multiple of 8, N of 128")
    item = jnp.dtype(x.dtype).itemsize
    # x tile, two y tiles, the f32 buffers (2 send, 1 incoming), the output tile, and Mosaic's temporaries: the
    # loaded x and y tiles (values of the dot) and three f32 tiles (the dot, the sum, its store). Without the
    # temporaries v5e:2x2 overflowed its request (44.3 MiB used at bm=512, bn=1024, Kl=3584)
    need = 2 * bm * K * item + 3 * K * bn * item + bm * bn * (3 * 4 + item + 3 * 4)
    if need > VMEM_BUDGET:
        raise ArgumentError(f"{op}: tiles of {need / 2**20:.1f} MiB (block_m = {bm}, block_n = {bn}, Kl = {K} whole) "
                            f"exceed the {VMEM_BUDGET >> 20} MiB budget: Kl is not tiled by this kernel")
    return tk.Launch(
        grid=(n, N // bn, m // bm),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((K, bn), lambda s, j, r: (0, j))],
        out_specs=[pl.BlockSpec(memory_space=pltpu.HBM), pl.BlockSpec(memory_space=pltpu.HBM)],
        out_shape=_out_shape(x, y, axis_name, n),
        scratch_shapes=[pltpu.VMEM((bm, K), x.dtype), pltpu.VMEM((2, bm, bn), F32), pltpu.VMEM((bm, bn), F32),
                        pltpu.VMEM((bm, bn), x.dtype), pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((2,)),
                        pltpu.SemaphoreType.DMA((n - 1,)), pltpu.SemaphoreType.DMA],
        dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
        vmem_limit_bytes=max(32 << 20, int(need * 1.25) + (4 << 20)),
        collective_id=COLLECTIVE_ID,
        cost_estimate=pl.CostEstimate(flops=2 * M * K * N, transcendentals=0,
                                      bytes_accessed=int((M * K + K * N) * item + m * N * (item + 8 * (n - 1)))),
        body_kwargs=dict(axis_name=axis_name, n=n, m=m, block_m=bm, block_n=bn),
    )


def rsmm_reference(x_global, y_global):
    """float64 ``x @ y`` of the global (unsharded) operands, numpy (device ``i`` holds rows ``[i m, (i+1) m)``)."""
    import numpy as np

    return np.asarray(x_global, np.float64) @ np.asarray(y_global, np.float64)
