"""The work-item table both kernels read from SMEM (scalar prefetch): its fields and flag bits, the
clamped group bounds, and the forward / tgmm schedules computed on device from ``group_sizes``
(``tk.Launch.prefetch``). Package docstring: why the flags are stored complemented."""

from __future__ import annotations

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


def bits(flags, bit):
    return (flags & bit) != 0


def item_flags(tab, T: int, i):
    """Flag bits of work item ``i`` (stored complemented, see ``ALL``)."""
    return tab[F_FLAGS * T + i] ^ ALL


def tgmm_flags(tab, T: int, i):
    """Flag bits of tgmm work item ``i`` (COMPUTE stored complemented, see ``TGMM_COMPLEMENT``)."""
    return tab[F_FLAGS * T + i] ^ TGMM_COMPLEMENT


def group_bounds(sizes, offset, M: int, G: int):
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
    return take(starts, idx), take(ends, idx)


def take(values, idx):
    """``values[idx]`` for a small int32 vector ``values`` as a one-hot select-and-sum, not a gather.

    The schedules are tiny (``T x tiles`` or ``T x G`` elements); dense compares keep them free of XLA
    gathers, on which libtpu 0.0.52's static profiler aborted on v5e (``llo_execution_graph.cc:149``), so
    the whole launch gets a static estimate there too."""
    import jax.numpy as jnp

    hit = idx[:, None] == jnp.arange(values.shape[0], dtype=jnp.int32)[None, :]
    return jnp.sum(jnp.where(hit, values[None, :], 0), axis=1).astype(jnp.int32)


def count_le(sorted_values, x):
    """``searchsorted(sorted_values, x, side="right")``: how many entries are ``<= x`` (dense compare)."""
    import jax.numpy as jnp

    return jnp.sum(sorted_values[None, :] <= x[:, None], axis=1).astype(jnp.int32)


def forward_fill(values, valid):
    """``values[last j <= i with valid[j]]`` per i (0 where none yet)."""
    import jax.numpy as jnp
    from jax import lax

    T = values.shape[0]
    src = lax.cummax(jnp.where(valid, jnp.arange(T, dtype=jnp.int32), -1), axis=0)
    return jnp.where(src >= 0, take(values, jnp.maximum(src, 0)), 0)


def fwd_schedule(sizes, offset, *, M: int, G: int, bm: int, T: int):
    """The forward's work items as a flat int32 table (fields ``F_*``), ordered by output tile.

    Tile ``j`` is visited once per local nonempty group intersecting it (in group order), or once with no
    group (stores zeros) when none does: ``sum_j max(1, n_j) <= tiles + G - 1`` items since consecutive
    groups share at most one tile. Items past the count repeat the last tile with no flags.
    """
    import jax.numpy as jnp

    from jax import lax

    tiles = -(-M // bm)
    s, e = group_bounds(sizes, offset, M, G)
    ne = e > s
    j = jnp.arange(tiles, dtype=jnp.int32)[:, None]
    inter = ne[None, :] & (s[None, :] < (j + 1) * bm) & (e[None, :] > j * bm)  # [tiles, G]
    n = inter.sum(1).astype(jnp.int32)
    v = jnp.maximum(n, 1)
    V = jnp.cumsum(v)
    i = jnp.arange(T, dtype=jnp.int32)
    real = i < V[-1]
    tile = jnp.minimum(count_le(V, i), tiles - 1)
    l = i - (take(V, tile) - take(v, tile))
    tt = tile[:, None]  # the groups intersecting each item's tile, [T, G] (no gather of inter's rows)
    inter_t = ne[None, :] & (s[None, :] < (tt + 1) * bm) & (e[None, :] > tt * bm)
    rank = jnp.cumsum(inter_t.astype(jnp.int32), axis=1)  # [T, G]
    g = jnp.minimum((rank <= l[:, None]).sum(1), G - 1).astype(jnp.int32)
    compute = real & (inter_t.sum(1) > 0)
    lo, hi = jnp.where(compute, take(s, g), 0), jnp.where(compute, take(e, g), 0)
    flags = (compute * COMPUTE) | (real * STORE) | ((real & (l == 0)) * FIRST)
    flags = (flags ^ ALL) | ((compute & ((tile * bm < lo) | ((tile + 1) * bm > hi))) * PARTIAL)
    src_tile = forward_fill(tile, compute)
    group = forward_fill(g, compute)
    # rhs runs: items that do not compute keep the previous group (forward fill), so runs change only at
    # computing items of a new group
    run_start = jnp.concatenate([jnp.ones((1,), bool), group[1:] != group[:-1]])
    run = (jnp.cumsum(run_start.astype(jnp.int32)) - 1).astype(jnp.int32)
    nxt = jnp.where(run_start, i, T)  # the next run start strictly after item i: a reverse running minimum
    nxt = jnp.concatenate([lax.cummin(nxt, axis=0, reverse=True)[1:], jnp.full((1,), T, jnp.int32)])
    next_group = jnp.where(nxt < T, take(group, jnp.minimum(nxt, T - 1)), group[0])
    flags = flags | ((run_start & (i > 0)) * RUN_START)
    runs_m1 = jnp.broadcast_to(run[-1], (T,))
    return (jnp.stack([tile, src_tile, group, lo, hi, flags.astype(jnp.int32), run, runs_m1,
                       next_group.astype(jnp.int32)]).reshape(-1),)


def tgmm_schedule(sizes, offset, *, M: int, G: int, bm: int, T: int):
    """tgmm work items, ordered by group: the tiles of each local group (one empty visit for an empty one)."""
    import jax.numpy as jnp

    s, e = group_bounds(sizes, offset, M, G)
    ne = e > s
    t0 = s // bm
    c = jnp.where(ne, (e - 1) // bm - t0 + 1, 0)
    w = jnp.maximum(c, 1)
    W = jnp.cumsum(w)
    i = jnp.arange(T, dtype=jnp.int32)
    real = i < W[-1]
    g = jnp.minimum(count_le(W, i), G - 1)
    wg = take(w, g)
    l = i - (take(W, g) - wg)
    compute = real & (take(ne.astype(jnp.int32), g) > 0)
    tile = jnp.where(compute, take(t0, g) + l, 0).astype(jnp.int32)
    lo, hi = jnp.where(compute, take(s, g), 0), jnp.where(compute, take(e, g), 0)
    flags = ((compute * COMPUTE) | (real * STORE) | ((real & (l == 0)) * FIRST)
             | ((real & (l == wg - 1)) * LAST))
    flags = (flags ^ TGMM_COMPLEMENT) | ((compute & ((tile * bm < lo) | ((tile + 1) * bm > hi))) * PARTIAL)
    src_tile = forward_fill(tile, compute)
    return (jnp.stack([tile, src_tile, g, lo, hi, flags.astype(jnp.int32)]).reshape(-1),)



def num_items(M: int, G: int, bm: int) -> int:
    """Static work-item bound ``ceil(M / bm) + G - 1`` of both kernels (0 when there is nothing to do)."""
    tiles = -(-M // bm) if M > 0 else 0
    return 0 if tiles == 0 or G == 0 else tiles + G - 1

