"""The kernels ``tpukernels::grouped_matmul_fwd`` and ``tpukernels::grouped_matmul_tgmm``: tunables, the
Pallas bodies (with the forward's rhs prefetch chain and tgmm's d_W writes), argument checks, the launch
functions, heuristics and the autograd wiring. Package docstring: semantics, schedule, performance.

Bodies and launch functions are moved verbatim only: the tuning database keys shipped entries by a hash
of their source text (``tpukernels.autotune.db.source_hash``)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ... import dsl as _dsl
from ...dsl.validate import padded_bytes
from ..vmem import MiB, scoped_vmem_limit, vmem_cap
from ...errors import ArgumentError, DTypeError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .common import (KERNEL_DTYPES, bias_grad, check_bias, clamp as _clamp, dtype_name as _dtype_name,
                     resolve_out_dtype as _out_dtype)
from .references import reference_fwd_jnp, reference_tgmm_jnp
from .schedule import (COMPUTE, FIRST, F_FLAGS, F_GROUP, F_HI, F_LO, F_NEXT_GROUP, F_RUN, F_RUNS_M1, F_SRC_TILE, F_TILE,
                       LAST, PARTIAL, RUN_START, STORE, bits as _bits, fwd_schedule as _fwd_schedule,
                       item_flags as _flags, num_items, tgmm_flags as _tgmm_flags, tgmm_schedule as _tgmm_schedule)

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


# ----------------------------------------------------------------------------------------------- kernel bodies
def rhs_prefetch_chain(tab, rhs_hbm, rhs_buf, sems, *, T, bn, n_pass, transpose_rhs):
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


_rhs_prefetch_chain = rhs_prefetch_chain  # the kernel bodies here keep this name: the tuning DB keys them by source


def _gmm_body(tab, lhs_ref, rhs_ref, *refs, T, bm, n_k, blk_k, k_size, transpose_rhs, precision, rhs_prefetch,
              bn, n_pass, has_bias=False):
    """Work item ``i`` (grid axis 1), K step ``k`` (axis 2): ``acc (+)= lhs_blk @ rhs_blk``; on the last K
    step ``out = select(rows of the group, acc [+ bias], previous visit's out | 0)``. ``refs`` = ``[bias_ref,]
    out_ref, acc_ref, *scratch`` (``bias_ref``: ``rhs_bias[g]``'s ``[1, bn]`` block, added in f32 before the
    cast, megablox gmm's epilogue). With ``rhs_prefetch`` (one K step) ``rhs_ref`` is the whole rhs in HBM and
    ``scratch`` its 2-slot VMEM buffer and DMA semaphores."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    bias_ref, (out_ref, acc_ref, *scratch) = (refs[0], refs[1:]) if has_bias else (None, refs)
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

    if bias_ref is not None:  # the group's bias, f32, on the computed rows only (a row-less visit stores zeros)
        store_rows, store_tile = store, store_all
        store = lambda z: store_rows(z + bias_ref[...].astype(jnp.float32))  # noqa: E731
        store_all = lambda z: store_tile(z + bias_ref[...].astype(jnp.float32))  # noqa: E731
        zero_rows = lambda z: store_rows(z)  # noqa: E731
    else:
        zero_rows = store

    last = k == n_k - 1
    finish = _bits(flags, STORE) & last
    partial = _bits(flags, PARTIAL)
    interior = jnp.logical_not(partial)
    # a visit without rows (a tile no group owns): the select keeps the previous visit's rows or zeros
    pl.when(finish & jnp.logical_not(compute))(lambda: zero_rows(jnp.zeros(out_ref.shape, jnp.float32)))
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


gmm_body = _gmm_body  # public name; the def keeps its name: the tuning DB keys this kernel by its source


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


tgmm_body = _tgmm_body  # public name; the def keeps its name: the tuning DB keys this kernel by its source


# ----------------------------------------------------------------------------------------------- checks
def check_meta(group_sizes, group_offset, G: int, where: str):
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
    check_meta(group_sizes, group_offset, G, where)
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
    check_meta(group_sizes, group_offset, num_groups, where)
    return x.shape[0], x.shape[1], y.shape[1], num_groups



# ----------------------------------------------------------------------------------------------- launches
@_dsl.tpu_kernel(
    _gmm_body, name="grouped_matmul_fwd", namespace="tpukernels", tunables=TUNABLES,
    heuristic=lambda *specs, **st: heuristic(*specs, **st),
    out_shape=lambda gs, go, lhs, rhs, rhs_bias=None, transpose_rhs=False, out_dtype=None: _dsl.OutSpec(
        (fwd_dims(gs, go, lhs, rhs, transpose_rhs)[0], fwd_dims(gs, go, lhs, rhs, transpose_rhs)[2]),
        _out_dtype(out_dtype, lhs)),
    reference=_dsl.jax_reference(lambda *a, **k: reference_fwd_jnp(*a, **k)),
)
def grouped_matmul_fwd(group_sizes: torch.Tensor, group_offset: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor,
                       rhs_bias: Optional[torch.Tensor] = None, transpose_rhs: bool = False,
                       out_dtype: Optional[str] = None,
                       *, bm: int, bk: int, bn: int, rhs_prefetch: bool) -> torch.Tensor:
    """Grouped matmul kernel: ``lhs [M, K]``, ``rhs [G, K, N]`` (``transpose_rhs``: ``[G, N, K]``),
    ``group_sizes int32 [G_total]``, ``group_offset int32 [1]``, optional ``rhs_bias [G, 1, N]`` bf16 / f32
    (added in f32 to the rows of its group before the cast; absent: no operand) -> ``[M, N]`` (module
    docstring)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    M, K, N, G = fwd_dims(group_sizes, group_offset, lhs, rhs, transpose_rhs)
    if rhs_bias is not None:
        check_bias(rhs_bias, G, N, "tpukernels::grouped_matmul_fwd")
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
    # the bias block of the item's group (megablox gmm's rhs_bias BlockSpec); no operand without a bias
    bias_specs = [] if rhs_bias is None else [
        pl.BlockSpec((None, 1, bn_), lambda n, i, k, t: (t[F_GROUP * T + i], 0, n))]
    isz, osz = np.dtype(lhs.dtype).itemsize, np.dtype(odt).itemsize
    acc_shape = (bm_, bn_) if gk > 1 else (8, 128)
    need = (2 * (padded_bytes((bm_, bk_), lhs.dtype) + padded_bytes(rhs_blk, lhs.dtype) + padded_bytes((bm_, bn_), odt))
            + padded_bytes(acc_shape, jnp.float32))
    if rhs_bias is not None:
        need += 2 * padded_bytes((1, bn_), rhs_bias.dtype)
    # upper bound: lhs once per N block, rhs [K, N] once per work item, out once
    cost = pl.CostEstimate(flops=2 * M * K * N, transcendentals=0,
                           bytes_accessed=int(gn * M * K * isz + T * K * N * isz + M * N * osz))
    return _dsl.Launch(
        grid=(gn, T, gk),
        in_specs=[lhs_spec, rhs_spec, *bias_specs],
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
                         precision=lax.Precision.HIGHEST if _dtype_name(lhs.dtype) == "float32" else None,
                         **({"has_bias": True} if rhs_bias is not None else {})),
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


#: below this many rows per group on average the forward heuristic takes ``bm=256`` (see :func:`heuristic`)
SMALL_GROUP_ROWS = 2048


def heuristic(group_sizes, group_offset, lhs, rhs, rhs_bias=None, transpose_rhs=False, out_dtype=None) -> dict:
    """Forward defaults before clamping: bf16 ``bn=1024``, ``bk = K`` up to 4096 (one K step: consecutive tiles
    of a group then reuse the resident rhs block, ~26 MiB of VMEM at K = 4096), else ``bk=1024`` (~10 MiB, the
    dense matmul's blocks), and ``bm=512``, or ``bm=256`` with fewer than :data:`SMALL_GROUP_ROWS` rows per group
    on average (many experts: the ``G - 1`` extra work items of ``bm`` rows each weigh more than the smaller
    item's cost per row; libtpu's static estimate on v6e at Qwen3-30B-A3B's 128 experts, 65536 rows: 17% less for
    the gate/up projection, 6% less for the down one, 45% less at 512 rows); float32 ``512, 512, 512``. Shipped
    per-chip tuning data takes precedence."""
    if _dtype_name(lhs.dtype) == "float32":
        return dict(bm=512, bk=512, bn=512)
    M, K = lhs.shape
    bm = 256 if M < SMALL_GROUP_ROWS * group_sizes.shape[0] else 512
    return dict(bm=bm, bk=4096 if K <= 4096 else 1024, bn=1024)


def heuristic_tgmm(group_sizes, group_offset, x, y, num_groups=0, out_dtype=None) -> dict:
    """tgmm defaults: bf16 ``bm=256, bk=2048, bn=2048`` (~36 MiB of VMEM, fits every chip's cap): both operands
    are streamed every step, so the d_rhs block must be large (``bk * bn / (bk + bn)`` FLOP per byte: 1024 here,
    v6e needs ~560) while ``bm`` stays small (each group boundary costs one extra ``bm``-row item; the f32
    accumulator is read and written once per ``bm`` rows). float32 ``512, 512, 512``. Shipped per-chip tuning
    data takes precedence."""
    if _dtype_name(x.dtype) == "float32":
        return dict(bm=512, bk=512, bn=512)
    return dict(bm=256, bk=2048, bn=2048)



# ----------------------------------------------------------------------------------------------- backward
# out_dtype spelled out as the operand dtype (the backward does) is keyed as the tables' out_dtype=None
grouped_matmul_fwd.canonicalize = grouped_matmul_tgmm.canonicalize = _dsl.dtype_default("out_dtype", 2)


@grouped_matmul_fwd.def_backward(op="grouped_matmul", double_backward=True)  # grouped matmuls + tgmm
def fwd_backward(ctx, g):
    gs, go, lhs, rhs = ctx.args["group_sizes"], ctx.args["group_offset"], ctx.args["lhs"], ctx.args["rhs"]
    tr = ctx.args["transpose_rhs"]
    dO = g.to(lhs.dtype)
    grads = {}
    if ctx.needs_input_grad.get("lhs"):
        grads["lhs"] = torch.ops.tpukernels.grouped_matmul_fwd(gs, go, dO, rhs, None, not tr, _dtype_name(lhs.dtype))
    if ctx.needs_input_grad.get("rhs"):
        x, y = (dO, lhs) if tr else (lhs, dO)
        grads["rhs"] = torch.ops.tpukernels.grouped_matmul_tgmm(gs, go, x, y, rhs.shape[0], _dtype_name(rhs.dtype))
    if ctx.args.get("rhs_bias") is not None and ctx.needs_input_grad.get("rhs_bias"):
        grads["rhs_bias"] = bias_grad(g, gs, go, ctx.args["rhs_bias"])  # the f32 upstream gradient, not dO
    return grads


@grouped_matmul_tgmm.def_backward(op="grouped_matmul", double_backward=True)  # two grouped matmuls
def tgmm_backward(ctx, g):
    """tgmm ``d_W[g] = x[rows of g]^T @ y[rows of g]`` is bilinear: ``d_x = grouped_matmul(y, g, transpose_rhs)``
    (``y_row @ g[grp]^T``), ``d_y = grouped_matmul(x, g)`` (``x_row @ g[grp]``); rows outside the groups get 0.
    This is what makes second derivatives of :func:`grouped_matmul` (through its ``d_rhs``) work."""
    gs, go, x, y = ctx.args["group_sizes"], ctx.args["group_offset"], ctx.args["x"], ctx.args["y"]
    dW = g.to(x.dtype)
    grads = {}
    if ctx.needs_input_grad.get("x"):
        grads["x"] = torch.ops.tpukernels.grouped_matmul_fwd(gs, go, y.to(x.dtype), dW, None, True,
                                                             _dtype_name(x.dtype))
    if ctx.needs_input_grad.get("y"):
        grads["y"] = torch.ops.tpukernels.grouped_matmul_fwd(gs, go, x.to(y.dtype), dW.to(y.dtype), None, False,
                                                             _dtype_name(y.dtype))
    return grads

