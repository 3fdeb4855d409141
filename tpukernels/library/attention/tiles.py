"""In-kernel helpers shared by the forward and backward bodies: dots, lane/row relayouts, element masks of a
tile (:func:`visible`), base-2 logits, and the skip / mask-free / masked dispatch of blocks and sub-blocks;
plus the BlockSpecs of the query-major kernels (forward, dQ).
"""

from __future__ import annotations

import dataclasses

from .plan import Plan, traced_all, clip, div, traced_min


NT = (((1,), (1,)), ((), ()))  # a @ b.T

NN = (((1,), (0,)), ((), ()))  # a @ b

def dot(a, b, dims, f32_inputs: bool):
    import jax
    import jax.numpy as jnp

    prec = jax.lax.Precision.HIGHEST if f32_inputs else None
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=prec)

def lanes(x, n: int):
    """A lane-replicated ``(rows, 128)`` value widened to ``(rows, n)`` (tiling whole vregs when possible)."""
    import jax.numpy as jnp

    if n % 128 == 0:
        return x if n == 128 else jnp.tile(x, (1, n // 128))
    return x[:, :n] if n < 128 else jnp.broadcast_to(x[:, :1], (x.shape[0], n))

def row_to_col(row):
    """(1, n) -> (n, 1) (a small XLU transpose)."""
    import jax.numpy as jnp

    return jnp.transpose(jnp.broadcast_to(row, (8, row.shape[1])))[:, :1]

def _col_to_row(col):
    """(n, c) with equal columns -> (1, n)."""
    import jax.numpy as jnp

    if col.shape[1] < 8:
        col = jnp.broadcast_to(col[:, :1], (col.shape[0], 8))
    return jnp.transpose(col)[:1, :]

def rows_of(ref, p: Plan, r0: int, nr: int, width: int):
    """Rows ``[r0, r0 + nr)`` of a ``(hb, bq, width)`` query-side block as ``(nr, width)``."""
    if p.hb == 1:
        return ref[0, pl_ds(r0, nr), :]
    assert r0 == 0 and nr == p.rows
    return ref[...].reshape(p.rows, width)

def pl_ds(start: int, size: int):
    from jax.experimental import pallas as pl

    return pl.ds(start, size)

def _window(p: Plan, i):
    """With :attr:`Plan.rows_whole`: the 128-aligned lane window holding query block ``i``'s lanes and
    their offset inside it (``128 % bq == 0``, so a block never straddles two windows)."""
    from jax.experimental import pallas as pl

    start = i * p.bq
    a = pl.multiple_of(div(start, 128) * 128, 128)
    return pl_ds(a, 128), start - a


def read_row(ref, lead: tuple, p: Plan, i, r0: int = 0, n: int | None = None):
    """Lanes of a position-row block (lse, di, q segment ids) for query rows ``[r0, r0 + n)`` of query
    block ``i``, as ``(1, n)``; ``lead`` indexes the block's leading dims. The block is ``(.., bq)``, or with
    :attr:`Plan.rows_whole` a whole row: Mosaic needs 128-aligned dynamic lane offsets, so the aligned
    128-lane window is read and rotated (``pltpu.roll``) to bring the block's lanes to lane 0."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    n = p.bq if n is None else n
    if not p.rows_whole:
        return ref[(*lead, slice(None), slice(None) if (r0 == 0 and n == p.bq) else pl_ds(r0, n))]
    assert r0 == 0 and n == p.bq
    win, sh = _window(p, i)
    w = ref[(*lead, slice(None), win)]
    return pltpu.roll(w, jax.lax.rem(128 - sh, 128), 1)[:, :n]


def store_rows(ref, col, p: Plan, i=None) -> None:
    """Store a per-row column ``(rows, c)`` (lanes equal) into a row-layout block ``(hb, 1, bq)``."""
    if p.rows_whole:  # read-modify-write of the aligned 128-lane window (see _read_row)
        import jax
        import jax.numpy as jnp
        from jax.experimental.pallas import tpu as pltpu

        win, sh = _window(p, i)
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, 128), 1)
        keep = jnp.logical_and(lane >= sh, lane < sh + p.bq)
        for g in range(p.hb):
            row = _col_to_row(col[g * p.bq:(g + 1) * p.bq])
            wide = pltpu.roll(jnp.concatenate([row, jnp.zeros((1, 128 - p.bq), row.dtype)], axis=1), sh, 1)
            ref[g, :, win] = jnp.where(keep, wide, ref[g, :, win])
        return
    if p.hb == 1:
        ref[0] = _col_to_row(col)
    elif p.bq % 8 == 0:  # per head: aligned sublane slices
        for g in range(p.hb):
            ref[g] = _col_to_row(col[g * p.bq:(g + 1) * p.bq])
    else:  # decode fold (bq = Sq < 8): one small relayout
        ref[...] = _col_to_row(col).reshape(p.hb, 1, p.bq)

def load_rows(ref, p: Plan, i=None):
    """Row-layout block ``(hb, 1, bq)`` -> one row ``(1, rows)``."""
    import jax.numpy as jnp

    if p.hb == 1:
        return read_row(ref, (0,), p, i)
    if p.bq % 128 == 0 or p.rows_whole:
        return jnp.concatenate([read_row(ref, (g,), p, i) for g in range(p.hb)], axis=1)
    return ref[...].reshape(1, p.rows)

def load_cols_wide(ref, p: Plan, i=None):
    """Row-layout block ``(hb, 1, bq)`` -> lane-replicated columns ``(rows, 128)``."""
    import jax.numpy as jnp

    def one(row):  # (1, n) -> (n, 128)
        return jnp.transpose(jnp.broadcast_to(row, (128, row.shape[1])))

    if p.hb == 1:
        return one(read_row(ref, (0,), p, i))
    if p.bq % 8 == 0:
        return jnp.concatenate([one(read_row(ref, (g,), p, i)) for g in range(p.hb)], axis=0)
    return one(ref[...].reshape(1, p.rows))

def head_stack(x, hb: int, axis: int):
    """Repeat a per-position vector ``hb`` times along ``axis`` (rows of the folded heads)."""
    import jax.numpy as jnp

    return x if hb == 1 else jnp.concatenate([x] * hb, axis=axis)

@dataclasses.dataclass
class _Tiles:
    """Index tiles of one (query x key) sub-block shape, computed once per grid step and shared by every
    sub-block of that step (only scalar offsets differ between sub-blocks)."""

    iq: object  # query index within the sub-block (position: ``row mod bq`` when heads are stacked)
    ik: object  # key index within the sub-block
    d: object  # ik - iq

def tile_iotas(p: Plan, shape, q_axis: int, *, q_tail: bool, kv_tail: bool) -> _Tiles:
    """The index tiles :func:`visible` needs for ``shape`` (queries along ``q_axis``), None where unused."""
    import jax
    import jax.numpy as jnp

    window = p.right is not None or p.left is not None
    iq = ik = d = None
    if window or q_tail:
        iq = jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
        if p.hb > 1:
            iq = jax.lax.rem(iq, p.bq)
    if window or kv_tail:
        ik = jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    if window:
        d = ik - iq
    return _Tiles(iq, ik, d)

def visible(p: Plan, tiles: _Tiles, qbase, kbase, qseg=None, kseg=None, *, q_tail: bool, kv_tail: bool):
    """bool tile of visible (query, key) pairs, or None if every pair is visible.

    Args:
        tiles: :func:`tile_iotas` of the tile; qbase, kbase: global position of the tile's first query
            and key (traced int32 scalars), so every comparison is a vector against one scalar.
        qseg, kseg: segment ids broadcastable to the tile (or None).
        q_tail, kv_tail: also hide query / key positions past ``Sq`` / ``Skv``.
    """
    import jax.numpy as jnp

    conds = []
    if kv_tail:
        conds.append(tiles.ik < p.Skv - kbase)
    if q_tail:
        conds.append(tiles.iq < p.Sq - qbase)
    if p.right is not None or p.left is not None:
        delta = kbase - qbase  # key position - query position = d + delta
        if p.right is not None:
            conds.append(tiles.d <= (p.off + p.right) - delta)
        if p.left is not None:
            conds.append(tiles.d >= (p.off - p.left) - delta)
    if qseg is not None:
        conds.append(qseg == kseg)
    if not conds:
        return None
    m = conds[0]
    for c in conds[1:]:
        m = jnp.logical_and(m, c)
    return m

LOG2E = 1.4426950408889634

LN2 = 0.6931471805599453

def logits2(p: Plan, qk):
    """Raw dot products -> (soft-capped) logits in base 2: ``log2(e) * softcap(sm_scale * qk)``.

    Working in base 2 lets the kernels use ``exp2`` with the ``log2(e)`` factor folded into the scale (one
    multiply per logit instead of two); ``lse`` is converted back to natural log on output.
    """
    import jax.numpy as jnp

    if p.softcap is None:
        return qk * (p.scale * LOG2E)
    return jnp.tanh(qk * (p.scale / p.softcap)) * (p.softcap * LOG2E)

def run_sub(any_vis, all_vis, plain, masked) -> None:
    """Run a sub-block: skipped if nothing is visible, without mask if everything is, else masked."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    if any_vis is False:
        return
    if all_vis is True:
        (plain() if any_vis is True else pl.when(any_vis)(plain))
        return
    if all_vis is not False:
        pl.when(all_vis if any_vis is True else jnp.logical_and(any_vis, all_vis))(plain)
    not_all = True if all_vis is False else jnp.logical_not(all_vis)
    cond = traced_all([any_vis, not_all])
    if cond is True:
        masked()
    else:
        pl.when(cond)(masked)

def run_steps(p: Plan, step, run, inner) -> None:
    """Run ``step(masked)`` under ``run``: the mask-free variant where the block is interior."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    if not p.masked or inner is True:
        pl.when(run)(lambda: step(False))
    elif inner is False:
        pl.when(run)(lambda: step(True))
    else:
        pl.when(jnp.logical_and(run, inner))(lambda: step(False))
        pl.when(jnp.logical_and(run, jnp.logical_not(inner)))(lambda: step(True))

def common_specs(p: Plan, kv_index):
    """BlockSpecs for q-side and kv-side operands of the forward / dQ kernels."""
    from jax.experimental import pallas as pl

    G_blocks = p.G // p.hb
    q_spec = pl.BlockSpec((None, p.hb, p.bq, p.D), lambda b, h, i, t: (b, h, i, 0))
    k_spec = pl.BlockSpec((None, None, p.bkv, p.D), lambda b, h, i, t: (b, div(h, G_blocks), kv_index(i, t), 0))
    v_spec = pl.BlockSpec((None, None, p.bkv, p.Dv), lambda b, h, i, t: (b, div(h, G_blocks), kv_index(i, t), 0))
    row_spec = pl.BlockSpec((None, p.hb, 1, p.row_width), lambda b, h, i, t: (b, h, 0, 0)) if p.rows_whole else \
        pl.BlockSpec((None, p.hb, 1, p.bq), lambda b, h, i, t: (b, h, 0, i))
    qs_spec = pl.BlockSpec((None, 1, p.row_width), lambda b, h, i, t: (b, 0, 0)) if p.rows_whole else \
        pl.BlockSpec((None, 1, p.bq), lambda b, h, i, t: (b, 0, i))
    ks_spec = pl.BlockSpec((None, 1, p.bkv), lambda b, h, i, t: (b, 0, kv_index(i, t)))
    return q_spec, k_spec, v_spec, row_spec, qs_spec, ks_spec

def kv_index_fn(p: Plan):
    def kv_index(i, t):
        j0, j1 = p.kv_range(i)
        return clip(traced_min(j0 + t, j1), 0, max(p.nk - 1, 0))

    return kv_index


def exp_units(p: Plan, x):
    """Forward running max / logit differences -> base-2 exponent units. With :attr:`Plan.bounded_exp` the
    forward keeps the running max of the raw dot products, so ``raw - max`` is formed at the dot products'
    magnitude (exactly 0 at the maximum, never positive) and only then scaled; else ``x`` already is."""
    return x * (p.scale * LOG2E) if p.bounded_exp else x


def exp2_le1(p: Plan, x):
    """``exp2(x)`` for ``x`` that is ``<= 0`` in exact arithmetic (see :attr:`Plan.bounded_exp`)."""
    import jax.numpy as jnp

    return jnp.exp2(jnp.minimum(x, 0.0)) if p.bounded_exp else jnp.exp2(x)


# ----------------------------------------------------------------------------------------------- block-sparse masks


def mask_refs(refs, p: Plan, n_dense_inputs: int, *, transposed: bool = False):
    """Split a body's refs of a masked kernel: (other refs, (fwd table, bwd table), element-mask block ref).

    Masked kernels take two scalar-prefetch tables first and, after their ``n_dense_inputs`` dense inputs, the
    partial blocks' element masks ``[n, bq, bkv]`` and their transposes ``[n, bkv, bq]`` (one of them blocked,
    the other left in HBM, unused). Unmasked kernels: (refs, None, None)."""
    if not p.has_mask:
        return refs, None, None
    tabs, rest = refs[:2], list(refs[2:])
    mb, mbt = rest[n_dense_inputs], rest[n_dense_inputs + 1]
    del rest[n_dense_inputs:n_dense_inputs + 2]
    return rest, tabs, (mbt if transposed else mb)


def q_major_step(p: Plan, tabs, i, t):
    """Key block ``j`` of grid step ``(i, t)`` of the forward / dQ kernels, whether it runs, whether it is
    interior (every pair visible: no element mask), and (masked kernels, else None) whether the mask table
    calls it full (then its element-mask block index is stale: segment ids alone mask it). Masked kernels
    read the forward table."""
    from jax.experimental import pallas as pl

    if p.has_mask:
        hm = pl.program_id(1) if p.mask_heads > 1 else 0
        j, kind = tabs[0][0, hm, i, t], tabs[0][1, hm, i, t]
        return j, kind != 0, (False if p.has_seg else kind == 2), kind == 2
    j0, j1 = p.kv_range(i)
    j = j0 + t
    return j, j <= j1, p.interior(i, j, q_tail_matters=False), None


def and_block_mask(vis, mb_ref, rows, cols, full):
    """``vis`` (or None: all visible) and the element mask of the current partial block (masked kernels).
    ``full``: traced bool, the table's kind is full (a masked step only because of segment ids)."""
    import jax.numpy as jnp

    if mb_ref is None:
        return vis
    m = jnp.logical_or(mb_ref[rows, cols] != 0, full)
    return m if vis is None else jnp.logical_and(vis, m)
