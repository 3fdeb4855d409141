"""In-kernel building blocks of chunked linear recurrences (gated DeltaNet, KDA, Mamba2 SSD).

A chunked linear-attention kernel walks the sequence in chunks of ``C`` tokens along a sequential
(``"arbitrary"``) grid axis, carries a small state (``[K, V]`` float32) from chunk to chunk in VMEM scratch,
and inside a chunk needs cumulative sums of log-decays, pairwise decays ``exp(G_i - G_j)`` and the inverse
of a unit lower-triangular ``C x C`` matrix (the UT / WY transform of the delta rule). These helpers say
each of those once, on values already loaded into the kernel (jax arrays inside a Pallas body), with MXU
matmuls and ``jnp.where`` masks only, so they lower with Mosaic on every chip and NaN-poisoned padding
(interpret mode ``"tpu"``) never leaks through a ``0 * NaN``.

Conventions: the token axis of a chunk is axis 0 (sublanes), ``n`` tokens. A *segment* column ``seg``
is an ``(n, 1)`` int32 array of segment ids (packed sequences: the sequence index of each token); tokens
of different segments never see each other in a mask, a cumulative sum or a decay. Segment ids must be
exact in float32 (``|id| < 2**24``) for :func:`lower_mask`.

API (stable; used by ``tpukernels.library.linear_attention``):

* carried state: :func:`reset_carry` (write zeros / a value into a scratch ref at the first step of a grid
  axis, or whenever a condition holds, e.g. a sequence starts), :func:`is_first_step`.
* layout: :func:`col_to_row` (``(n, 1) -> (1, n)``, exact), :func:`row_to_col` (its inverse).
* masks: :func:`lower_mask` (``i >= j``, or ``i > j`` strict, optionally same segment).
* sums and decays: :func:`segment_cumsum` (inclusive / exclusive, forward / reverse, segment-aware log-step
  scan),
  :func:`pairwise_decay` (``exp(G_i - G_j)`` where a mask holds, else 0).
* solve: :func:`unit_lower_inverse` (``(I + A)^-1`` for strictly lower ``A``, block substitution by
  doubling: ``2 * ceil(log2 n)`` matmuls, forward-stable), :func:`matmul` (float32, highest precision).

Each is tested on its own against numpy float64 in ``tests/test_dsl_scan.py``.

Packed sequences, two ways. (1) Segment-aware helpers: pass ``seg`` to :func:`segment_cumsum` /
:func:`lower_mask` and mask every pairwise term, when all segments of a chunk share one initial state (zeros).
(2) One pass per sequence touching the chunk (``tpukernels.library.linear_attention.gdn_ops``): select that
sequence's rows with ``jnp.where`` (other rows exactly 0, their gates 0), run the plain chunk step from that
sequence's own initial state, keep its rows of the result; needed when sequences carry their own states.
"""

from __future__ import annotations

import math


def _jax():
    import jax
    import jax.numpy as jnp

    return jax, jnp


def matmul(a, b, *, trans_a: bool = False, trans_b: bool = False, exact_bf16: bool = False):
    """``a @ b`` (or with ``a`` / ``b`` transposed), float32 result, highest precision (6-pass bf16 on the MXU).

    Args:
        a, b: 2-D float arrays. trans_a: contract ``a``'s axis 0 (``a.T @ b``). trans_b: contract ``b``'s axis 1
            (``a @ b.T``).
        exact_bf16: the caller guarantees both operands hold bfloat16 values (e.g. bf16 inputs, selected with
            ``jnp.where``): one bf16 pass with float32 accumulation is then exact, and is what runs.
    """
    jax, jnp = _jax()
    ca = 0 if trans_a else 1
    cb = 1 if trans_b else 0
    if exact_bf16:
        return jax.lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (((ca,), (cb,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), (((ca,), (cb,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def is_first_step(axis: int):
    """True at the first step of grid axis ``axis`` (``pl.program_id(axis) == 0``)."""
    from jax.experimental import pallas as pl

    return pl.program_id(axis) == 0


def reset_carry(ref, *, axis: int | None = None, when=None, value=None):
    """Write ``value`` (zeros if None) into the scratch ``ref`` carried along a sequential grid axis.

    The carried state of a chunked recurrence lives in a VMEM scratch ref (``Launch.scratch_shapes``), which
    persists across the steps of the grid; the axis it is carried along must be ``"arbitrary"`` (sequential)
    and the innermost axis that changes the sequence. Call this at the top of the body.

    Args:
        ref: the scratch ref (e.g. ``pltpu.VMEM((K, V), jnp.float32)``).
        axis: reset at the first step of this grid axis (a new row / head starts its sequence).
        when: a scalar bool (traced) instead of / in addition to ``axis`` (or-ed): reset whenever it holds,
            e.g. a packed sequence starts at this chunk.
        value: an array of ``ref``'s shape (cast to its dtype), e.g. an initial state block; None: zeros.
    """
    jax, jnp = _jax()
    from jax.experimental import pallas as pl

    if axis is None and when is None:
        raise ValueError("reset_carry: give axis= (reset at its first step) and / or when= (a condition)")
    cond = None
    if axis is not None:
        cond = is_first_step(axis)
    if when is not None:
        cond = when if cond is None else jnp.logical_or(cond, when)

    @pl.when(cond)
    def _():
        if value is None:
            ref[...] = jnp.zeros(ref.shape, ref.dtype)
        else:
            ref[...] = jnp.broadcast_to(value, ref.shape).astype(ref.dtype)


def col_to_row(col):
    """``(n, 1) -> (1, n)`` float32, exactly, entry by entry (a masked sublane reduction, no matmul: a NaN in one
    entry stays in its own column)."""
    jax, jnp = _jax()
    n = col.shape[0]
    eye = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    full = jnp.broadcast_to(col.astype(jnp.float32), (n, n))
    return jnp.sum(jnp.where(eye, full, 0.0), axis=0, keepdims=True)


def row_to_col(row):
    """``(1, n) -> (n, 1)`` float32, exactly, entry by entry (a masked lane reduction; the inverse of
    :func:`col_to_row`), e.g. a key loaded as a row, needed as a column for an outer product ``k u^T``."""
    jax, jnp = _jax()
    n = row.shape[1]
    eye = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    full = jnp.broadcast_to(row.astype(jnp.float32), (n, n))
    return jnp.sum(jnp.where(eye, full, 0.0), axis=1, keepdims=True)


def lower_mask(n: int, *, strict: bool = False, seg=None):
    """bool ``(n, n)``: ``i >= j`` (``i > j`` if strict), and ``seg[i] == seg[j]`` when ``seg`` (an ``(n, 1)``
    int32 column) is given."""
    jax, jnp = _jax()
    i = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    m = i > j if strict else i >= j
    if seg is not None:
        s = seg.astype(jnp.float32)
        m = jnp.logical_and(m, s == col_to_row(s))
    return m


def segment_cumsum(x, seg=None, *, reverse: bool = False, exclusive: bool = False):
    """Cumulative sum of ``x`` (``(n, m)``) along axis 0, restarting at every segment change.

    ``out[i] = sum_{j <= i, seg[j] == seg[i]} x[j]`` (``j < i`` if exclusive; ``j >= i`` / ``j > i`` if
    reverse), float32. A log-step (Hillis-Steele) scan: ``ceil(log2 n)`` sublane rotations (``pltpu.roll``),
    each added where the token ``d`` places away is in the same segment (``jnp.where``): a chunk's
    log-decays ``G = segment_cumsum(g, seg)`` never add a previous sequence's gates, and a NaN in one
    segment never reaches another (no ``0 * NaN``).

    Args:
        x: ``(n, m)`` float (m = 1 for a column of per-token gates).
        seg: ``(n, 1)`` int32 segment ids, each segment contiguous (packed sequences), or None (one segment).
    """
    jax, jnp = _jax()
    from jax.experimental.pallas import tpu as pltpu

    n = x.shape[0]
    out = x.astype(jnp.float32)
    row = jax.lax.broadcasted_iota(jnp.int32, out.shape, 0)
    sg = None if seg is None else jnp.broadcast_to(seg.astype(jnp.int32), out.shape)

    def step(val, d):  # val[i] + val[i -+ d] where that token exists and is in i's segment
        shift = d if not reverse else n - d  # rotate down by d (forward) or up by d (reverse)
        ok = row >= d if not reverse else row < n - d
        if sg is not None:
            ok = jnp.logical_and(ok, pltpu.roll(sg, shift, 0) == sg)
        return ok, pltpu.roll(val, shift, 0)

    if exclusive:  # shift by one within the segment first, then an inclusive scan
        ok, moved = step(out, 1) if n > 1 else (row < 0, out)
        out = jnp.where(ok, moved, 0.0)
    d = 1
    while d < n:
        ok, moved = step(out, d)
        out = jnp.where(ok, out + moved, out)
        d *= 2
    return out


def pairwise_decay(gcum, mask):
    """``D[i, j] = exp(gcum[i] - gcum[j])`` where ``mask[i, j]``, else exactly 0 (float32, ``(n, n)``).

    Args:
        gcum: ``(n, 1)`` cumulative log-decays (e.g. :func:`segment_cumsum` of the gates).
        mask: bool ``(n, n)`` (e.g. :func:`lower_mask`): the exponent of an unmasked pair is never formed
            (``exp(-inf) = 0``), so a decay that would overflow above the diagonal is not an inf or NaN.
    """
    jax, jnp = _jax()
    g = gcum.astype(jnp.float32)
    diff = g - col_to_row(g)
    return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def unit_lower_inverse(a):
    """``(I + A)^-1`` for a strictly lower-triangular ``A`` (``(n, n)`` float32; entries on and above the
    diagonal are ignored).

    Block forward substitution by doubling: ``X`` starts as ``I`` (the inverse of the 1 x 1 diagonal
    blocks); at block size ``b = 1, 2, 4, ...`` each ``2b`` diagonal block ``[[I + A11, 0], [A21, I + A22]]``
    has the inverse ``[[X11, 0], [-X22 A21 X11, X22]]``, i.e. ``X <- X - X (A o M_b) X`` with ``M_b`` the mask
    of the ``A21`` quadrants (``X`` is block diagonal, so the product picks ``X22 A21 X11``). Two matmuls per
    level, ``ceil(log2 n)`` levels (the first, with ``X = I``, needs none); the same operations as forward
    substitution, so as stable (no Neumann series with cancelling powers). Highest-precision float32 matmuls.
    """
    jax, jnp = _jax()
    n = a.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    af = jnp.where(i > j, a.astype(jnp.float32), 0.0)
    levels = max(int(math.ceil(math.log2(n))), 0) if n > 1 else 0
    # level 0 (b = 1) has X = I, so its update X (A o M_1) X is A o M_1 itself: no matmul
    x = (i == j).astype(jnp.float32) - jnp.where((i // 2 == j // 2) & (i % 2 == 1) & (j % 2 == 0), af, 0.0)
    for lv in range(1, levels):
        b = 1 << lv
        quad = ((i // (2 * b)) == (j // (2 * b))) & ((i // b) % 2 == 1) & ((j // b) % 2 == 0)
        x = x - matmul(x, matmul(jnp.where(quad, af, 0.0), x))
    return x


__all__ = ["matmul", "is_first_step", "reset_carry", "col_to_row", "row_to_col", "lower_mask", "segment_cumsum",
           "pairwise_decay", "unit_lower_inverse"]
