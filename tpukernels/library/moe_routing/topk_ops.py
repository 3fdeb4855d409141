"""General top-k over the last dim (``torch.topk`` semantics: values sorted descending, ties to the lowest
index, NaN above every number), for router scores and vocabulary-sized rows (sampling).

Public API::

    topk(x, k, dim=-1, largest=True, sorted=True) -> (values, indices)     torch.topk's arguments and result
    topk_jax(x, k, *, interpret=None) -> (values, indices int32)            jax arrays (jax.lax.top_k's order)
    topk_reference(x, k) -> (values float64, indices int64)                 the float64 reference (sort-based)
    torch.ops.tpukernels.topk_fwd(x, k) -> (values f32 [R, Kp], indices int32 [R, Kp])    the kernel op

Design. Grid ``(cdiv(R, block_rows), cdiv(C, block_cols))``: a row block walks the column tiles in order
(``"arbitrary"``), carrying its running top-k (values and float32 indices, ``[block_rows, Kp]``, ``Kp = k``
rounded up to 128 lanes) in VMEM scratch. The first tile is selected by
:func:`~tpukernels.library.moe_routing.common.select_topk` (k rounds of max / first index / retire); each later
tile is merged by :func:`~tpukernels.library.moe_routing.common.merge_topk`: while some row's best remaining tile
entry beats its k-th carried entry, that entry is inserted at its rank (a lane roll and two selects on the
128-lane list), so a tile costs (its worst row's entrants + 1) steps, not k. Carried entries hold lower indices
than any of the tile's, so they stay ahead of equal values: torch's order across tiles. Columns past C (the
overhanging tile) are dead candidates, never read as values (the NaN-poisoned interpreter checks it). One pass
over x; rows are independent (a NaN row never changes another row's result).

Cost (VPU-bound; a step is ~5 vector ops per tile element). Random rows, 64-row blocks, 151,936 columns in
2,048-column tiles, k = 50: ~700 steps over the 75 tiles (simulated on the data) where k rounds per tile would
be 3,750. libtpu's static estimate on v6e: 2,816 us for the k-rounds-per-tile form; it cannot see the merge's
data-dependent trip count (its figure for this form, ~97 us, assumes a short loop), so no measured figure is
claimed. A row sorted ascending is the worst case (every tile's entries enter: k + 1 steps per tile).

Tuning: ``block_rows`` (8..256) and ``block_cols`` (128..8192, a multiple of 128; all of C when C is no
larger). No per-chip tables yet: the heuristic takes all of C up to 2048 columns, else 2048-column tiles, and
the rows that fit :data:`VMEM_BUDGET_BYTES`.

Gaps vs ``torch.topk``: ``largest=False`` (a typed error); ``sorted=False`` returns the sorted order (which the
anchor allows); float16 is widened to float32 (exact); integer inputs are not supported.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ... import dsl as tk
from ...chips import MiB
from ...errors import ArgumentError, DTypeError
from .common import F32, NO_INDEX, check_k, column_index, merge_topk, padded_k, select_topk

__all__ = ["topk", "topk_jax", "topk_fwd", "topk_reference", "BLOCK_ROWS", "BLOCK_COLS", "VMEM_BUDGET_BYTES"]

NAMESPACE = "tpukernels"
BLOCK_ROWS = (8, 16, 32, 64, 128, 256)
BLOCK_COLS = (128, 256, 512, 1024, 2048, 4096, 8192)
#: VMEM for the double-buffered input tile plus ~8 float32 temporaries per element and the carried lists
VMEM_BUDGET_BYTES = 12 * MiB


# ----------------------------------------------------------------------------------------- kernel
def _topk_body(x_ref, v_ref, i_ref, cv_ref, ci_ref, *, k: int, cols: int, bc: int, n_tiles: int):
    c = pl.program_id(1)
    x = x_ref[...].astype(F32)
    gidx = column_index(x.shape, (c * bc).astype(F32))
    tile = (x, jnp.where(gidx < cols, gidx, NO_INDEX))
    width = v_ref.shape[1]
    if n_tiles == 1:
        v, i = select_topk([tile], k, width)
        v_ref[...] = v
        i_ref[...] = i.astype(jnp.int32)
        return

    @pl.when(c == 0)
    def _():
        v, i = select_topk([tile], k, width)
        cv_ref[...] = v
        ci_ref[...] = i

    @pl.when(c > 0)
    def _():
        v, i = merge_topk(cv_ref[...], ci_ref[...], tile[0], tile[1], k, width)
        cv_ref[...] = v
        ci_ref[...] = i

    @pl.when(c == n_tiles - 1)
    def _():
        v_ref[...] = cv_ref[...]
        i_ref[...] = ci_ref[...].astype(jnp.int32)


def _per_row_bytes(bc: int, kp: int, itemsize: int) -> int:
    return 2 * bc * itemsize + 8 * 4 * bc + 10 * 4 * kp


def fit(block_rows: int, block_cols: int, r: int, c: int, kp: int, itemsize: int) -> tuple[int, int]:
    """``(br, bc)`` launched: all of C when ``C <= block_cols`` (else block_cols), all rows when ``R <=
    block_rows``; rows halved until the block fits :data:`VMEM_BUDGET_BYTES`."""
    bc = int(c) if c <= block_cols else int(block_cols)
    br = int(block_rows)
    while br > 8 and br * _per_row_bytes(bc, kp, itemsize) > VMEM_BUDGET_BYTES:
        br //= 2
    return (int(r) if 0 < r <= br else br), bc


def _heuristic(x, k):
    r, c = x.shape
    bc = next((b for b in BLOCK_COLS if b >= min(c, 2048)), 2048)
    kp = padded_k(k)
    br = 8
    for b in BLOCK_ROWS:
        if b * _per_row_bytes(min(bc, max(c, 1)), kp, np.dtype(x.dtype).itemsize) <= VMEM_BUDGET_BYTES:
            br = b
    return {"block_rows": br, "block_cols": bc}


def _check_kernel(x, k):
    op = f"{NAMESPACE}::topk_fwd"
    if len(x.shape) != 2:
        raise ArgumentError(f"{op}: x must be [rows, columns], got {tuple(x.shape)}")
    if np.dtype(x.dtype).name not in ("bfloat16", "float32"):
        raise DTypeError(f"{op}: x has dtype {np.dtype(x.dtype).name}: use bfloat16 or float32")
    check_k(op, "k", k, int(x.shape[1]), "x.shape[1]")


@tk.tpu_kernel(
    _topk_body, name="topk_fwd", namespace=NAMESPACE, heuristic=_heuristic,
    tunables={"block_rows": tk.Tunable(BLOCK_ROWS, default=64, doc="rows per grid step (upper bound)"),
              "block_cols": tk.Tunable(BLOCK_COLS, default=2048, doc="columns per grid step (multiple of 128)")},
    out_shape=lambda x, k: (tk.OutSpec((x.shape[0], padded_k(k)), jnp.float32),
                            tk.OutSpec((x.shape[0], padded_k(k)), jnp.int32)),
)
def topk_fwd(x: torch.Tensor, k: int, *, block_rows: int, block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row of ``x [R, C]`` bf16/f32 (internal op; use :func:`topk`): float32 values and int32
    indices ``[R, Kp]`` (``Kp`` = k rounded up to 128; columns ``>= k`` are padding), torch.topk's order."""
    _check_kernel(x, k)
    r, c = x.shape
    kp = padded_k(k)
    br, bc = fit(block_rows, block_cols, r, c, kp, np.dtype(x.dtype).itemsize)
    nt = tk.cdiv(c, bc)
    out = pl.BlockSpec((br, kp), lambda i, j: (i, 0))
    return tk.Launch(
        grid=(tk.cdiv(r, br), nt),
        in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
        out_specs=[out, out],
        out_shape=(tk.OutSpec((r, kp), jnp.float32), tk.OutSpec((r, kp), jnp.int32)),
        scratch_shapes=[pltpu.VMEM((br, kp), jnp.float32), pltpu.VMEM((br, kp), jnp.float32)],
        dimension_semantics=("parallel", "arbitrary"),
        body_kwargs={"k": int(k), "cols": int(c), "bc": int(bc), "n_tiles": int(nt)},
        cost_estimate=pl.CostEstimate(flops=int(8 * k * r * (c + kp * nt)), transcendentals=0,
                                      bytes_accessed=int(r * c * np.dtype(x.dtype).itemsize + 8 * r * kp)),
    )


# ----------------------------------------------------------------------------------------- public op
def _widen(t):
    return t.float() if t.dtype == torch.float16 else t


def _topk_impl(x, k, dim=-1):
    op = "tpukernels.topk"
    _check_public(op, x, k, dim)
    xm = x.movedim(dim, -1)
    lead, c = xm.shape[:-1], xm.shape[-1]
    x2 = _widen(xm).reshape(-1, c).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*lead, k)).movedim(-1, dim), torch.empty((*lead, k), dtype=torch.int64,
                                                                     device=x.device).movedim(-1, dim)
    v, i = torch.ops.tpukernels.topk_fwd(x2, k)
    v = v[:, :k].to(x.dtype).reshape(*lead, k).movedim(-1, dim)
    i = i[:, :k].long().reshape(*lead, k).movedim(-1, dim)
    return v, i


def _check_public(op, x, k, dim):
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ArgumentError(f"{op}: input must be a tensor with at least one dim, got {getattr(x, 'shape', x)!r}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"{op}: input dtype {x.dtype} is not supported: use bfloat16, float16 or float32")
    if not -x.dim() <= dim < x.dim():
        raise ArgumentError(f"{op}: dim = {dim} is out of range for a {x.dim()}-D input")
    check_k(op, "k", k, x.shape[dim], f"input.shape[{dim}]")
    if x.shape[dim] >= 2 ** 24:
        raise ArgumentError(f"{op}: input.shape[{dim}] = {x.shape[dim]}; at most 2**24 - 1 columns are supported")


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("topk(Tensor x, int k, int dim=-1) -> (Tensor, Tensor)")
_LIB.impl("topk", _topk_impl, "CompositeImplicitAutograd")


def topk(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``torch.topk(input, k, dim)``: the k largest entries along ``dim`` and their indices.

    Args:
        input: any shape, bfloat16 / float16 / float32 (float16 widened exactly), ``input.shape[dim] < 2**24``.
        k: ``1 <= k <= input.shape[dim]``.
        dim: the dim to select along (default -1; another dim is moved last, a copy).
        largest: only True (``largest=False`` is a gap: a typed error).
        sorted: accepted; the result is always sorted (descending), which ``sorted=False`` allows.

    Returns:
        ``(values, indices)``: values in input's dtype (copies of input entries, exact), indices int64, both
        shaped like input with ``dim`` of size k; sorted descending, equal values by ascending index, NaN
        first (as ``torch.topk``). Not differentiable (indices; use ``input.gather(dim, indices)`` for
        gradients through the values).

    Raises:
        ArgumentError: k outside ``[1, input.shape[dim]]``, dim out of range, ``largest=False``, 2**24 or more
            columns. DTypeError: integer or float64 input.
    """
    if largest is not True:
        raise ArgumentError("tpukernels.topk: largest=False is not supported (negate the input)")
    return torch.ops.tpukernels.topk(input, k, dim)


def topk_jax(x, k: int, *, interpret=None):
    """:func:`topk` on a jax array ``x [..., C]`` (last dim; trace-safe): ``(values in x's dtype, indices
    int32)``, ``jax.lax.top_k``'s result and order.

    Raises:
        ArgumentError / DTypeError: as :func:`topk`.
    """
    from ...targets.jax_entry import jax_call

    op = "tpukernels.topk_jax"
    dt = np.dtype(x.dtype).name
    if dt not in ("bfloat16", "float16", "float32"):
        raise DTypeError(f"{op}: x dtype {dt} is not supported: use bfloat16, float16 or float32")
    if len(x.shape) < 1:
        raise ArgumentError(f"{op}: x must have at least one dim")
    c = int(x.shape[-1])
    check_k(op, "k", k, c, "x.shape[-1]")
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, c)
    if dt == "float16":
        x2 = x2.astype(jnp.float32)
    if x2.shape[0] == 0:
        return jnp.zeros((*lead, k), x.dtype), jnp.zeros((*lead, k), jnp.int32)
    v, i = jax_call(topk_fwd, x2, k, interpret=interpret)
    return v[:, :k].astype(x.dtype).reshape(*lead, k), i[:, :k].reshape(*lead, k)


# ----------------------------------------------------------------------------------------- reference
def topk_reference(x: torch.Tensor, k: int):
    """float64 ``(values, indices int64)`` along the last dim by a stable descending sort (NaN first, ties by
    ascending index): torch.topk's documented order, computed independently of it."""
    xd = x.double()
    nan = torch.isnan(xd)
    key = torch.where(nan, torch.full_like(xd, float("inf")), xd)
    # sort by (-nan, -value, index): a stable sort on value descending after putting NaN ahead
    order = torch.argsort(-key, dim=-1, stable=True)
    nan_sorted = nan.gather(-1, order)
    order = order.gather(-1, torch.argsort((~nan_sorted).to(torch.int8), dim=-1, stable=True))
    idx = order[..., :k]
    return xd.gather(-1, idx), idx


#: ``(args, kwargs)`` of :func:`topk_fwd` compiled by the aot tests: a sampling batch over Qwen3's vocabulary
#: (151,936 columns, tiled) and router scores (DeepSeek-V3: 256 experts, k = 8).
STANDARD_SHAPES = [
    (("64x151936:f32",), {"k": 50}),
    (("4096x256:bf16",), {"k": 8}),
]
