"""What the MoE routing kernels share: the in-kernel top-k selection (torch.topk's order) and argument checks.

Selection (:func:`select_topk`): ``k`` rounds, each taking the largest live candidate of every row (NaN
counts as larger than any number, as in ``torch.topk``; among equal values the lowest index wins), then
retiring it. Candidates are ``(values, indices)`` pairs of float32 arrays; an index of :data:`NO_INDEX` marks a
dead candidate (a column past the array, a masked expert, an entry already taken), so a real ``-inf`` is still
selectable. Indices are carried as float32 (exact below 2**24, checked by the public ops): Mosaic reduces
float32 vectors along lanes on every chip, which keeps the body to max / min / select.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ...errors import ArgumentError, DeviceError, DTypeError

F32 = jnp.float32
#: the dead-candidate index (float32, exact; above any valid index, which is checked to be < 2**24)
NO_INDEX = float(2 ** 30)
#: largest column count the float32 indices address exactly
MAX_COLUMNS = 2 ** 24
#: output lanes: the k results are written into a 128-lane block (sliced to k outside the kernel)
LANES = 128


def padded_k(k: int) -> int:
    """Lanes of the kernels' ``[rows, padded_k(k)]`` outputs: k rounded up to a multiple of 128."""
    return -(-int(k) // LANES) * LANES


def select_topk(cands, k: int, width: int):
    """``(values [r, width], indices [r, width])`` float32: the k best live candidates of each row in
    torch.topk's order (module docstring), columns ``>= k`` ``-inf`` / :data:`NO_INDEX`. ``cands``: a list of
    ``(values, indices)`` float32 arrays ``[r, c_i]`` (indices unique across the list within a row)."""
    rows = cands[0][0].shape[0]
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)

    def one(j, carry):
        idxs, out_v, out_i = carry
        return select_round(cands, idxs, col, j, out_v, out_i)

    init = (tuple(i for _, i in cands), jnp.full((rows, width), -jnp.inf, F32), jnp.full((rows, width), NO_INDEX, F32))
    if k <= 8:  # unrolled (the routing case)
        carry = init
        for j in range(k):
            carry = one(j, carry)
    else:
        carry = jax.lax.fori_loop(0, k, one, init)
    return carry[1], carry[2]


def column_index(shape, offset=0):
    """float32 ``offset + column`` of a ``shape`` block (the global index of each lane)."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1).astype(F32) + offset


# ----------------------------------------------------------------------------------------- torch-side checks
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
INTS = (torch.int32, torch.int64)


def shape_of(v):
    return tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__


def check_scores(op: str, name: str, t, num_experts=None, dtypes=FLOATS) -> tuple[int, int]:
    """``(rows, columns)`` of a ``[rows, columns]`` float tensor ``name``; with ``num_experts``, columns must
    equal it.

    Raises:
        ArgumentError: not a 2-D tensor, columns != num_experts, more than 2**24 columns.
        DTypeError: dtype not in ``dtypes``.
    """
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ArgumentError(f"{op}: {name} must be a 2-D tensor [num_tokens, num_experts], got {shape_of(t)}")
    if t.dtype not in dtypes:
        raise DTypeError(f"{op}: {name} dtype {t.dtype} is not supported: use "
                         f"{', '.join(str(d).replace('torch.', '') for d in dtypes)}")
    r, c = t.shape
    if num_experts is not None and c != num_experts:
        raise ArgumentError(f"{op}: {name} has {c} columns but num_experts = {num_experts}: {name} must be "
                            f"[num_tokens, num_experts] = [{r}, {num_experts}]")
    if c >= MAX_COLUMNS:
        raise ArgumentError(f"{op}: {name} has {c} columns; at most {MAX_COLUMNS - 1} are supported")
    return r, c


def check_k(op: str, name: str, k, columns: int, what: str = "num_experts") -> int:
    """``k`` as an int after the rule ``1 <= k <= columns``.

    Raises:
        ArgumentError: k not an int, < 1, or > columns (naming ``what`` the columns are).
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise ArgumentError(f"{op}: {name} must be an int, got {type(k).__name__}")
    if not 1 <= k <= columns:
        raise ArgumentError(f"{op}: {name} = {k} must be in [1, {what} = {columns}]")
    return int(k)


def check_same_device(op: str, ref_name: str, ref, **others) -> None:
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.device != ref.device:
            raise DeviceError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def merge_topk(cv, ci, tv, ti, k: int, width: int):
    """The top-k of a carried, sorted top-k list ``(cv, ci)`` ``[r, width]`` (``k`` live entries, dead columns
    past them) and a tile ``(tv, ti)``, equal to :func:`select_topk` of both but by insertion: each step takes
    every row's best live tile entry and, where it beats the row's k-th carried entry, inserts it at its rank
    (lanes past it move right by one; the k-th drops out). Steps run while some row still has such an
    entrant, so a tile costs (entrants of its worst row + 1) steps instead of k rounds: on random rows most
    tiles past the first few need a handful. Ranks follow torch.topk's order (NaN first, then value, then
    index: a carried entry has a lower index than any tile entry, so it stays ahead of an equal one)."""
    from jax.experimental.pallas import tpu as pltpu

    rows = cv.shape[0]
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)

    def best(ti_w):
        tl = ti_w < NO_INDEX
        tn = (tv != tv) & tl
        t_nan = jnp.max(jnp.where(tn, 1.0, 0.0), axis=-1, keepdims=True) > 0.0
        t_m = jnp.max(jnp.where(tl & ~tn, tv, -jnp.inf), axis=-1, keepdims=True)
        eq = jnp.where(t_nan, tn, tl & (tv == t_m))
        t_i = jnp.min(jnp.where(eq, ti_w, NO_INDEX), axis=-1, keepdims=True)  # NO_INDEX: no live entry
        return jnp.where(t_nan, jnp.nan, t_m), t_i

    def entering(cv_w, ci_w, t_v, t_i):
        last_v = jnp.sum(jnp.where(col == k - 1, cv_w, 0.0), axis=-1, keepdims=True)
        last_live = jnp.sum(jnp.where(col == k - 1, ci_w, 0.0), axis=-1, keepdims=True) < NO_INDEX
        t_nan, l_nan = t_v != t_v, last_v != last_v
        beats = (t_nan & ~l_nan) | (~t_nan & ~l_nan & (t_v > last_v))
        return (t_i < NO_INDEX) & (~last_live | beats)

    def cond(state):
        return state[3]

    def body(state):
        cv_w, ci_w, ti_w, _ = state
        t_v, t_i = best(ti_w)
        enter = entering(cv_w, ci_w, t_v, t_i)
        live = ci_w < NO_INDEX
        c_nan = cv_w != cv_w
        above = live & jnp.where(t_v != t_v, c_nan, c_nan | (cv_w >= t_v))
        pos = jnp.sum(jnp.where(above, 1.0, 0.0), axis=-1, keepdims=True).astype(jnp.int32)
        rv, ri = pltpu.roll(cv_w, 1, 1), pltpu.roll(ci_w, 1, 1)
        nv = jnp.where(col < pos, cv_w, jnp.where(col == pos, t_v, rv))
        ni = jnp.where(col < pos, ci_w, jnp.where(col == pos, t_i, ri))
        nv = jnp.where(col < k, nv, -jnp.inf)
        ni = jnp.where(col < k, ni, NO_INDEX)
        cv_w = jnp.where(enter, nv, cv_w)
        ci_w = jnp.where(enter, ni, ci_w)
        ti_w = jnp.where(enter & (ti_w == t_i), NO_INDEX, ti_w)
        t_v, t_i = best(ti_w)
        more = jnp.max(jnp.where(entering(cv_w, ci_w, t_v, t_i), 1.0, 0.0)) > 0.0
        return cv_w, ci_w, ti_w, more

    t_v, t_i = best(ti)
    start = jnp.max(jnp.where(entering(cv, ci, t_v, t_i), 1.0, 0.0)) > 0.0
    cv, ci, _, _ = jax.lax.while_loop(cond, body, (cv, ci, ti, start))
    return cv, ci


def select_round(cands, idxs, col, j, out_v, out_i):
    """One selection round over ``cands`` (``(values, _)``) with live indices ``idxs``: the best live candidate
    of each row (NaN first, then the largest value, then the lowest index) written at column ``j`` of
    ``(out_v, out_i)`` and retired. Returns ``(idxs, out_v, out_i)``."""
    live = [i < NO_INDEX for i in idxs]
    nan = [(v != v) & a for (v, _), a in zip(cands, live)]
    has_nan = None
    m = None
    for (v, _), a, n in zip(cands, live, nan):
        hn = jnp.max(jnp.where(n, 1.0, 0.0), axis=-1, keepdims=True) > 0.0
        mv = jnp.max(jnp.where(a & ~n, v, -jnp.inf), axis=-1, keepdims=True)
        has_nan = hn if has_nan is None else (has_nan | hn)
        m = mv if m is None else jnp.maximum(m, mv)
    sel = None
    for (v, _), i, a, n in zip(cands, idxs, live, nan):
        eq = jnp.where(has_nan, n, a & (v == m))
        s = jnp.min(jnp.where(eq, i, NO_INDEX), axis=-1, keepdims=True)
        sel = s if sel is None else jnp.minimum(sel, s)
    val = jnp.where(has_nan, jnp.nan, m)
    idxs = tuple(jnp.where(i == sel, NO_INDEX, i) for i in idxs)
    return idxs, jnp.where(col == j, val, out_v), jnp.where(col == j, sel, out_i)
