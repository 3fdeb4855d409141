"""Tails: shapes that are not multiples of the block.

The contract (Pallas TPU semantics, which tpukernels keeps):

* A grid of ``cdiv(size, block)`` steps may end in a partial block. Its **reads** past the array end are
  undefined: garbage on a TPU, NaN in TPU-faithful interpret mode (``interpret="tpu"``).
* Its **writes** past the end are dropped, so elementwise / row-wise kernels need nothing special.
* A kernel that **reduces across** a partially filled axis (a matmul's K, a row sum over a split hidden
  dim, a softmax over a key block) must mask the tail before reducing. ``x * mask`` is not a mask when the
  padding is NaN (``NaN * 0 = NaN``); :func:`mask_tail` uses ``jnp.where``.
"""

from __future__ import annotations


def tail_valid(shape, axis: int, start, size):
    """bool array of ``shape``: True where ``start + index_along(axis) < size``.

    Args:
        shape: the block's shape (static ints).
        axis: the axis of ``shape`` that may overhang the array.
        start: global index of the block's first element along that axis (e.g. ``pl.program_id(0) * bm``).
        size: the array's extent along that axis (static int).
    """
    import jax
    import jax.numpy as jnp

    idx = jax.lax.broadcasted_iota(jnp.int32, tuple(shape), axis)
    return idx + start < size


def mask_tail(x, axis: int, start, size, fill=0):
    """``x`` with elements past ``size`` along ``axis`` replaced by ``fill`` (safe for NaN padding).

    Args:
        x: a block value loaded inside a kernel body, e.g. ``a_ref[...]``.
        axis, start, size: see :func:`tail_valid`.
        fill: value for out-of-range elements (0 for sums and matmuls, ``-inf`` for max / softmax logits).
    """
    import jax.numpy as jnp

    return jnp.where(tail_valid(x.shape, axis, start, size), x, jnp.asarray(fill, x.dtype))
