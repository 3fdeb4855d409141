"""Flash attention (forward + backward) for TPU: causal / sliding-window / segment masks, GQA, soft-cap.

Public API: :func:`flash_attention` (torch tensors, torch SDPA layout) and the op of the same meaning,
``torch.ops.tpukernels.flash_attention(q, k, v, *, causal, causal_alignment, sm_scale, window_left,
window_right, softcap, q_segment_ids, kv_segment_ids) -> out`` (CompositeImplicitAutograd: autograd and
``torch.compile`` see the kernel ops). The kernel-level ops, named as such:

* ``torch.ops.tpukernels.flash_attention_fwd`` (kernel :data:`fa_forward`) -> ``(out, lse)``;
* ``torch.ops.tpukernels.flash_attention_bwd_dq`` / ``flash_attention_bwd_dkv`` (backward kernels, wired
  into autograd with :meth:`TpuKernel.def_backward`).

What it computes, per batch ``b`` and query head ``h`` (kv head ``h // (Hq // Hkv)``)::

    s[i, j]   = sm_scale * q[i] . k[j]                         (f32 accumulation on the MXU)
    s[i, j]   = softcap * tanh(s[i, j] / softcap)              (only if softcap is given; before masking)
    visible   = j < Skv  and  i + off - left <= j <= i + off + right  and  qseg[i] == kvseg[j]
    out[i]    = sum_j softmax_j(s[i, :] over visible j) * v[j]
    lse[i]    = log sum_{visible j} exp(s[i, j])               (natural log, f32; -inf if nothing is visible)

with ``off = 0`` for top-left alignment and ``off = Skv - Sq`` for bottom-right alignment. ``causal=True``
is the window ``right = 0``; ``left``/``right`` of ``None`` are unbounded. A query row that sees no key
outputs exactly 0, has ``lse = -inf`` and gets zero gradients (never NaN, never mean(V)).

Algorithm: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) online softmax over key blocks, statistics
(running max ``m``, running sum ``l``) and the output accumulator in f32 VMEM scratch. Ideas taken from
JAX's Pallas TPU kernels (``jax/experimental/pallas/ops/tpu/flash_attention.py`` and
``splash_attention/``): block skipping with clamped index maps (a skipped step maps to the block already
resident, so no DMA is issued), a compute sub-block ``block_kv_compute`` inside the DMA block, and a
transposed (keys-in-sublanes) dK/dV kernel that needs no in-kernel transposes of big tiles. Differences:
``sm_scale`` defaults to ``1/sqrt(D)`` (JAX: 1.0); empty rows give 0 (JAX: mean of V); ``lse`` is one f32
per row (JAX keeps 128 lanes per row); GQA is native (no K/V repeat) with dK/dV summed over each group
inside the kernel; the kv grid axis only spans the blocks a window can reach.

Layouts (op level; :func:`flash_attention` converts):

* ``q``: ``[B, Hq, Sq, D]``; ``k``: ``[B, Hkv, Skv, D]``; ``v``: ``[B, Hkv, Skv, Dv]``; bf16 or f32, all the
  same dtype (float16: see ``_FLOAT_DTYPES``; :func:`flash_attention` accepts it). ``Hq`` a multiple of ``Hkv``.
* ``q_segment_ids``: ``[B, 1, Sq]`` int32, ``kv_segment_ids``: ``[B, 1, Skv]`` int32 (both or neither).
* outputs: ``out`` ``[B, Hq, Sq, Dv]`` (q's dtype), ``lse`` ``[B, Hq, 1, Sq]`` f32 (per-position vectors
  are stored as rows, the layout the kernels read without transposes).

Performance (libtpu 0.0.52 static estimates, a model, not measurements; ``benchmarks/attention.py``):
B=1, Hq=32, Hkv=8, D=128, causal bf16, at the shipped defaults vs JAX's Pallas flash attention at its best
swept blocks (K/V repeated to 32 heads): forward 0.81x / 0.77x (v6e, S=4096 / 8192) and 0.78x / 0.78x
(v5e); backward (dQ + dK/dV + rowsum) 0.73x / 0.71x (v6e). Boundary blocks (the causal diagonal, window
edges) are split into 512 x 512 sub-blocks, each skipped, run without mask, or masked on its own.

Decode (``Sq <= 16`` with ``Hq > Hkv``): the query heads of one kv group are processed together, so one
grid step multiplies ``(Hq/Hkv) * Sq`` query rows against each K/V block (the K/V tile is read once per
group and the MXU sees ``group * Sq`` rows, not 1). The same mechanism (tunable ``block_h``) is available
for longer queries.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import numpy as np
import torch

from ..dsl import Launch, OutSpec, Tunable, cdiv, tpu_kernel
from ..errors import ArgumentError, DTypeError

NAMESPACE = "tpukernels"
ALIGNMENTS = ("top_left", "bottom_right")
#: Query lengths up to this fold the GQA group into the query rows (see module docstring).
DECODE_FOLD_MAX_SQ = 16
#: dtypes the kernels take. float16 is not among them: Mosaic (libtpu 0.0.52) rejects float16 kernel
#: arguments ("Only arguments with float8..., bfloat16 or 32-bit element types are supported"), so
#: :func:`flash_attention` computes float16 inputs in float32 (exact upcast) and casts the output back.
_FLOAT_DTYPES = ("bfloat16", "float32")

# ----------------------------------------------------------------------------------------------- checks


def _dt(x) -> str:
    return np.dtype(x.dtype).name


def _check_args(q, k, v, q_segment_ids, kv_segment_ids, *, causal, causal_alignment, sm_scale, window_left,
                window_right, softcap, where: str = "flash_attention") -> None:
    """Validate shapes, dtypes and static arguments; raise ArgumentError / DTypeError naming the argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ArgumentError(f"{where}: {name} must have rank 4 [B, H, S, D] (torch SDPA layout), got shape {tuple(x.shape)}")
        if _dt(x) not in _FLOAT_DTYPES:
            why = (" (Mosaic takes no float16 kernel arguments; tpukernels.library.flash_attention upcasts float16 "
                   "to float32)") if _dt(x) == "float16" else ""
            raise DTypeError(f"{where}: {name} dtype {_dt(x)} is not supported; use bfloat16 or float32{why}")
    if not (_dt(q) == _dt(k) == _dt(v)):
        raise DTypeError(f"{where}: q, k, v must share one dtype, got {_dt(q)}, {_dt(k)}, {_dt(v)}")
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ArgumentError(f"{where}: batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ArgumentError(f"{where}: k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ArgumentError(f"{where}: k and v must have the same length, got {k.shape[2]} and {v.shape[2]}")
    if k.shape[3] != D:
        raise ArgumentError(f"{where}: k head dim {k.shape[3]} must equal q head dim {D}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ArgumentError(
            f"{where}: q heads ({Hq}) must be a positive multiple of k/v heads ({Hkv}) (GQA: query head h uses kv head "
            f"h // (Hq // Hkv))"
        )
    if D == 0 or v.shape[3] == 0:
        raise ArgumentError(f"{where}: head dims must be positive, got q/k {D}, v {v.shape[3]}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ArgumentError(f"{where}: q_segment_ids and kv_segment_ids must be given together (packed sequences)")
    if q_segment_ids is not None:
        for name, ids, S in (("q_segment_ids", q_segment_ids, Sq), ("kv_segment_ids", kv_segment_ids, k.shape[2])):
            if tuple(ids.shape) != (B, 1, S):
                raise ArgumentError(f"{where}: {name} must have shape [B, 1, S] = {(B, 1, S)}, got {tuple(ids.shape)}")
            if _dt(ids) != "int32":
                raise DTypeError(f"{where}: {name} must be int32, got {_dt(ids)}")
    if not isinstance(causal, bool):
        raise ArgumentError(f"{where}: causal must be a bool, got {causal!r}")
    if causal_alignment not in ALIGNMENTS:
        raise ArgumentError(f"{where}: causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    if sm_scale is not None and not math.isfinite(sm_scale):
        raise ArgumentError(f"{where}: sm_scale must be finite (or None for 1/sqrt(D)), got {sm_scale!r}")
    for name, w in (("window left", window_left), ("window right", window_right)):
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0):
            raise ArgumentError(f"{where}: {name} must be None (unbounded) or an int >= 0, got {w!r}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ArgumentError(f"{where}: softcap must be None or a finite float > 0, got {softcap!r}")


# ----------------------------------------------------------------------------------------------- planning


def _largest_divisor_at_most(n: int, cap: int) -> int:
    for d in range(max(1, min(n, cap)), 0, -1):
        if n % d == 0:
            return d
    return 1


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one attention call (shapes, blocks, mask bounds), shared by the three kernels."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    Skv: int
    D: int
    Dv: int
    dtype: str
    hb: int  # query heads per grid step (all from one kv group)
    bq: int  # query positions per grid step
    bkv: int  # key positions per DMA block
    bkvc: int  # key positions per compute sub-block
    scale: float
    softcap: float | None
    off: int  # diagonal offset: 0 (top-left) or Skv - Sq (bottom-right)
    left: int | None  # visible iff i + off - left <= j <= i + off + right (None: unbounded)
    right: int | None
    has_seg: bool

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv

    @property
    def rows(self) -> int:
        return self.hb * self.bq

    @property
    def nq(self) -> int:
        return cdiv(self.Sq, self.bq)

    @property
    def nk(self) -> int:
        return cdiv(self.Skv, self.bkv)

    @property
    def q_tail(self) -> bool:
        return self.Sq % self.bq != 0

    @property
    def kv_tail(self) -> bool:
        return self.Skv % self.bkv != 0

    @property
    def masked(self) -> bool:
        """Whether any block can need a mask at all."""
        return self.has_seg or self.left is not None or self.right is not None or self.kv_tail

    # -- block ranges; ``i``/``j`` are Python ints (launch) or traced int32 scalars (index maps, bodies)
    def kv_range(self, i):
        """First and last kv block that query block ``i`` can see (last < first: none)."""
        qa = i * self.bq
        qb = _min(qa + self.bq, self.Sq) - 1
        j0 = 0 if self.left is None else _div(_max(qa + (self.off - self.left), 0), self.bkv)
        if self.right is None:
            j1 = self.nk - 1
        else:
            j1 = _min(_div(_max(qb + (self.off + self.right), -1) + self.bkv, self.bkv) - 1, self.nk - 1)
        return j0, j1

    def q_range(self, j):
        """First and last query block that can see kv block ``j`` (last < first: none)."""
        ka = j * self.bkv
        kb = _min(ka + self.bkv, self.Skv) - 1
        i0 = 0 if self.right is None else _div(_max(ka - (self.off + self.right), 0), self.bq)
        if self.left is None:
            i1 = self.nq - 1
        else:
            i1 = _min(_div(_max(kb + (self.left - self.off), -1) + self.bq, self.bq) - 1, self.nq - 1)
        return i0, i1

    @functools.cached_property
    def kv_steps(self) -> int:
        """Length of the kv grid axis of the forward and dQ kernels (>= 1 so every q block is written)."""
        return max([1] + [j1 - j0 + 1 for j0, j1 in (self.kv_range(i) for i in range(self.nq))])

    @functools.cached_property
    def q_steps(self) -> int:
        """Query blocks per kv block in the dK/dV kernel (>= 1)."""
        return max([1] + [i1 - i0 + 1 for i0, i1 in (self.q_range(j) for j in range(self.nk))])

    def interior(self, i, j, *, q_tail_matters: bool):
        """True where every (query, key) pair of blocks (i, j) is visible: the mask can be skipped."""
        return self.all_visible(i * self.bq, self.bq, j * self.bkv, self.bkv, q_tail_matters=q_tail_matters)

    def all_visible(self, qa, nq, ka, nk, *, q_tail_matters: bool):
        """Every pair of queries ``[qa, qa + nq)`` x keys ``[ka, ka + nk)`` is visible (no mask needed)."""
        if self.has_seg:
            return False
        conds = []
        qb = _min(qa + nq, self.Sq) - 1
        kb = ka + nk - 1
        if self.kv_tail:
            conds.append(kb < self.Skv)
        if q_tail_matters and self.q_tail:
            conds.append(qa + nq <= self.Sq)
        if self.right is not None:
            conds.append(kb <= qa + (self.off + self.right))
        if self.left is not None:
            conds.append(ka >= qb + (self.off - self.left))
        return _all(conds)

    def any_visible(self, qa, nq, ka, nk):
        """Some pair of valid queries ``[qa, qa + nq)`` x keys ``[ka, ka + nk)`` may be visible (segments
        are not looked at); False means the pairs can be skipped."""
        conds = []
        qb = _min(qa + nq, self.Sq) - 1
        kb = _min(ka + nk, self.Skv) - 1
        if self.q_tail:
            conds.append(qa < self.Sq)
        if self.kv_tail:
            conds.append(ka < self.Skv)
        if self.right is not None:
            conds.append(ka <= qb + (self.off + self.right))
        if self.left is not None:
            conds.append(kb >= qa + (self.off - self.left))
        return _all(conds)

    #: Smallest (rows x keys) sub-block a boundary block is split into. libtpu's estimates (v6e, S=4096,
    #: causal): splitting into 512 x 512 sub-blocks saves 3-13% of the forward; 256-wide sub-blocks cost
    #: 25-40% more than not splitting (per-region overhead dominates).
    MIN_SUB = 512

    def _split(self, n: int) -> int:
        if self.hb != 1 or self.bkvc < self.MIN_SUB or n % self.MIN_SUB:
            return 1
        return max(1, min(4, n // self.MIN_SUB, 16 // (self.bkv // self.bkvc)))

    @property
    def row_split(self) -> int:
        """Row sub-blocks of a masked forward / dQ step (1: none). Each (row sub-block, key sub-block)
        pair of a boundary block is then skipped, run without mask or run masked on its own, so a causal
        diagonal block skips its upper triangle of sub-blocks."""
        return self._split(self.rows)

    @property
    def col_split(self) -> int:
        """Query sub-blocks (lane slices) of a masked dK/dV step (1: none); see :attr:`row_split`."""
        return self._split(self.rows)


def _is_py(*xs) -> bool:
    return all(isinstance(x, (int, np.integer)) for x in xs)


def _min(a, b):
    if _is_py(a, b):
        return min(a, b)
    import jax.numpy as jnp

    return jnp.minimum(a, b)


def _max(a, b):
    if _is_py(a, b):
        return max(a, b)
    import jax.numpy as jnp

    return jnp.maximum(a, b)


def _div(a, b: int):
    """``a // b`` for ``a >= 0`` (traced: truncating lax.div, which lowers without jnp's sign fix-ups)."""
    if _is_py(a):
        return a // b
    import jax

    return jax.lax.div(a, jax.numpy.int32(b))


def _all(conds):
    """Conjunction of Python bools and traced bool scalars (Python True if nothing is traced)."""
    out = True
    for c in conds:
        if isinstance(c, (bool, np.bool_)):
            if not c:
                return False
            continue
        out = c if out is True else _land(out, c)
    return out


def _land(a, b):
    import jax.numpy as jnp

    return jnp.logical_and(a, b)


def _clip(x, lo, hi):
    return _min(_max(x, lo), hi)


def _make_plan(q, k, v, q_segment_ids, *, causal, causal_alignment, sm_scale, window_left, window_right, softcap,
               block_q, block_kv, block_kv_compute, block_h) -> _Plan:
    B, Hq, Sq, D = (int(s) for s in q.shape)
    Hkv, Skv, Dv = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    G = Hq // Hkv
    # a bound at least Sq + Skv away from every diagonal never masks anything: drop it (no mask work, and
    # no int32 overflow of huge windows inside the kernel)
    span = Sq + Skv
    left = None if window_left is not None and window_left >= span else window_left
    right = None if window_right is not None and window_right >= span else window_right
    if causal:
        right = 0 if right is None else min(right, 0)
    if G > 1 and 0 < Sq <= DECODE_FOLD_MAX_SQ:
        hb = G  # decode: fold the whole group into the query rows
    else:
        hb = _largest_divisor_at_most(G, block_h)
    bq = Sq if 0 < Sq <= block_q else block_q
    bkv = Skv if 0 < Skv <= block_kv else block_kv
    bkvc = block_kv_compute if (block_kv_compute < bkv and bkv % block_kv_compute == 0) else bkv
    return _Plan(
        B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D, Dv=Dv, dtype=_dt(q), hb=hb, bq=max(bq, 1), bkv=max(bkv, 1),
        bkvc=max(bkvc, 1), scale=float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale),
        softcap=None if softcap is None else float(softcap),
        off=(Skv - Sq) if causal_alignment == "bottom_right" else 0, left=left, right=right,
        has_seg=q_segment_ids is not None,
    )


# ----------------------------------------------------------------------------------------------- tunables

_BLOCKS = (128, 256, 512, 1024, 2048)


def _compute_divides(cfg):
    if cfg["block_kv_compute"] > cfg["block_kv"] or cfg["block_kv"] % cfg["block_kv_compute"]:
        return "block_kv_compute must divide block_kv"
    return True


def _tunables(doc_h: str):
    return {
        "block_q": Tunable(_BLOCKS, default=1024, doc="query positions per grid step (multiple of 128; Sq if smaller)"),
        "block_kv": Tunable(_BLOCKS, default=1024, doc="key positions per K/V DMA block (multiple of 128; Skv if smaller)"),
        "block_kv_compute": Tunable(_BLOCKS, default=512, doc="key positions per compute sub-block (divides block_kv)"),
        "block_h": Tunable((1, 2, 4, 8), default=1, doc=doc_h),
    }


_DOC_H = ("query heads of one kv group per grid step (largest divisor of the group <= this; no effect without GQA, "
          "where the group is 1 head); decode folds the whole group")


def _heuristic(q, k, v, *rest, **statics):
    """Shape-dependent defaults (used when no tuning-DB entry applies), from libtpu static estimates on
    v5e / v6e / tpu7x (``benchmarks/attention.py``, causal GQA D=128 bf16): big query and key blocks amortise
    the per-step cost and keep the MXU busy per K/V byte; 512-key compute sub-blocks (256 was 2-17% slower on
    v6e, and a boundary block is only split into sub-blocks of >= 512, see ``_Plan.MIN_SUB``)."""
    if len(q.shape) != 4 or len(k.shape) != 4:  # malformed: the launch function raises the typed error
        return {}
    Sq, Skv = int(q.shape[2]), int(k.shape[2])
    if Sq <= DECODE_FOLD_MAX_SQ:  # decode: memory bound; long K/V blocks amortise per-step overhead
        return {"block_q": 128, "block_kv": 1024, "block_kv_compute": 512, "block_h": 1}
    big = 2048 if min(Sq, Skv) >= 4096 else 1024
    return {"block_q": big, "block_kv": big, "block_kv_compute": 512, "block_h": 1}


def _vmem_limit(est_bytes: int) -> int | None:
    """Scoped VMEM to request: None (chip default) for small footprints, else room for Mosaic's temporaries
    (logit / probability tiles). Capped at 40 MiB: tpu7x has 64 MiB per core and XLA needs some of it
    around the kernel (48 MiB overflowed there, libtpu 0.0.52)."""
    if est_bytes <= 6 << 20:
        return None
    return int(min(40 << 20, 2 * est_bytes + (16 << 20)))


# ----------------------------------------------------------------------------------------------- in-kernel helpers

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _dot(a, b, dims, f32_inputs: bool):
    import jax
    import jax.numpy as jnp

    prec = jax.lax.Precision.HIGHEST if f32_inputs else None
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=prec)


def _lanes(x, n: int):
    """A lane-replicated ``(rows, 128)`` value widened to ``(rows, n)`` (tiling whole vregs when possible)."""
    import jax.numpy as jnp

    if n % 128 == 0:
        return x if n == 128 else jnp.tile(x, (1, n // 128))
    return x[:, :n] if n < 128 else jnp.broadcast_to(x[:, :1], (x.shape[0], n))


def _row_to_col(row):
    """(1, n) -> (n, 1) (a small XLU transpose)."""
    import jax.numpy as jnp

    return jnp.transpose(jnp.broadcast_to(row, (8, row.shape[1])))[:, :1]


def _col_to_row(col):
    """(n, c) with equal columns -> (1, n)."""
    import jax.numpy as jnp

    if col.shape[1] < 8:
        col = jnp.broadcast_to(col[:, :1], (col.shape[0], 8))
    return jnp.transpose(col)[:1, :]


def _rows_of(ref, p: _Plan, r0: int, nr: int, width: int):
    """Rows ``[r0, r0 + nr)`` of a ``(hb, bq, width)`` query-side block as ``(nr, width)``."""
    if p.hb == 1:
        return ref[0, pl_ds(r0, nr), :]
    assert r0 == 0 and nr == p.rows
    return ref[...].reshape(p.rows, width)


def pl_ds(start: int, size: int):
    from jax.experimental import pallas as pl

    return pl.ds(start, size)


def _store_rows(ref, col, p: _Plan) -> None:
    """Store a per-row column ``(rows, c)`` (lanes equal) into a row-layout block ``(hb, 1, bq)``."""
    if p.hb == 1:
        ref[0] = _col_to_row(col)
    elif p.bq % 8 == 0:  # per head: aligned sublane slices
        for g in range(p.hb):
            ref[g] = _col_to_row(col[g * p.bq:(g + 1) * p.bq])
    else:  # decode fold (bq = Sq < 8): one small relayout
        ref[...] = _col_to_row(col).reshape(p.hb, 1, p.bq)


def _load_rows(ref, p: _Plan):
    """Row-layout block ``(hb, 1, bq)`` -> one row ``(1, rows)``."""
    import jax.numpy as jnp

    if p.hb == 1:
        return ref[0]
    if p.bq % 128 == 0:
        return jnp.concatenate([ref[g] for g in range(p.hb)], axis=1)
    return ref[...].reshape(1, p.rows)


def _head_stack(x, hb: int, axis: int):
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


def _tile_iotas(p: _Plan, shape, q_axis: int, *, q_tail: bool, kv_tail: bool) -> _Tiles:
    """The index tiles :func:`_visible` needs for ``shape`` (queries along ``q_axis``), None where unused."""
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


def _visible(p: _Plan, tiles: _Tiles, qbase, kbase, qseg=None, kseg=None, *, q_tail: bool, kv_tail: bool):
    """bool tile of visible (query, key) pairs, or None if every pair is visible.

    Args:
        tiles: :func:`_tile_iotas` of the tile; qbase, kbase: global position of the tile's first query
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


def _logits2(p: _Plan, qk):
    """Raw dot products -> (soft-capped) logits in base 2: ``log2(e) * softcap(sm_scale * qk)``.

    Working in base 2 lets the kernels use ``exp2`` with the ``log2(e)`` factor folded into the scale (one
    multiply per logit instead of two); ``lse`` is converted back to natural log on output.
    """
    import jax.numpy as jnp

    if p.softcap is None:
        return qk * (p.scale * LOG2E)
    return jnp.tanh(qk * (p.scale / p.softcap)) * (p.softcap * LOG2E)


# ----------------------------------------------------------------------------------------------- forward


def _fwd_body(*refs, plan: _Plan):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    p = plan
    if p.has_seg:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
        qs_ref = ks_ref = None
    f32 = p.dtype == "float32"
    i, t = pl.program_id(2), pl.program_id(3)

    j0, j1 = p.kv_range(i)
    j = j0 + t

    @pl.when(t == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def update(r0: int, nr: int, c: int, masked: bool, qseg, tiles=None):
        """Online-softmax update of rows [r0, r0 + nr) with key sub-block c of the current K/V block."""
        q = _rows_of(q_ref, p, r0, nr, p.D)
        sl = pl.ds(c * p.bkvc, p.bkvc)
        rs = pl.ds(r0, nr)
        k = k_ref[sl, :]
        v = v_ref[sl, :]
        s = _logits2(p, _dot(q, k, _NT, f32))  # (nr, bkvc) f32, base-2 logits
        kbase = j * p.bkv + c * p.bkvc
        if masked:
            vis = _visible(p, tiles, i * p.bq + r0, kbase, qseg, ks_ref[:, sl] if p.has_seg else None,
                           q_tail=False, kv_tail=p.kv_tail)
            s = jnp.where(vis, s, -jnp.inf)
            if p.kv_tail:  # padding rows of V may be NaN: 0 * NaN = NaN, so select them away
                kcol = jax.lax.broadcasted_iota(jnp.int32, (p.bkvc, 1), 0)
                v = jnp.where(kcol < p.Skv - kbase, v, jnp.zeros_like(v))
        m_prev = m_sc[rs, :]  # (nr, 128), lanes equal
        l_prev = l_sc[rs, :]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # rows with nothing visible so far keep m = -inf; shift by 0 there so exp() gives 0, not NaN
        m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
        pr = jnp.exp2(s - _lanes(m_use, p.bkvc))
        alpha = jnp.exp2(m_prev - m_use)
        l_sc[rs, :] = alpha * l_prev + jnp.sum(pr, axis=1, keepdims=True)
        m_sc[rs, :] = m_next
        pv = _dot(pr.astype(v.dtype), v, _NN, f32)  # (nr, Dv)
        acc_sc[rs, :] = acc_sc[rs, :] * _lanes(alpha, p.Dv) + pv

    def step(masked: bool):
        qseg = _head_stack(_row_to_col(qs_ref[...]), p.hb, 0) if (masked and p.has_seg) else None  # (rows, 1)
        R = p.row_split if masked else 1
        nr = p.rows // R
        tiles = _tile_iotas(p, (nr, p.bkvc), 0, q_tail=False, kv_tail=p.kv_tail) if masked else None
        for r in range(R):
            for c in range(p.bkv // p.bkvc):
                args = (r * nr, nr, c)
                qs_r = None if qseg is None else qseg[r * nr:(r + 1) * nr]
                if not masked:
                    update(*args, False, None)
                    continue
                if R == 1:  # the block-level checks decided: one masked region for the whole block
                    update(*args, True, qs_r, tiles)
                    continue
                qa, ka = i * p.bq + r * nr, j * p.bkv + c * p.bkvc
                _run_sub(p.any_visible(qa, nr, ka, p.bkvc), p.all_visible(qa, nr, ka, p.bkvc, q_tail_matters=False),
                         lambda a=args: update(*a, False, None),
                         lambda a=args, qs_r=qs_r: update(*a, True, qs_r, tiles))

    _run_steps(p, step, j <= j1, p.interior(i, j, q_tail_matters=False))

    @pl.when(t == p.kv_steps - 1)
    def _end():
        l = l_sc[...]
        empty = l == 0.0
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
        o = acc_sc[...] * _lanes(inv, p.Dv)
        o_ref[...] = o.reshape(p.hb, p.bq, p.Dv).astype(o_ref.dtype)
        lse = jnp.where(empty, -jnp.inf, (m_sc[...] + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
        _store_rows(lse_ref, lse, p)


def _fwd_out_shape(q, k, v, q_segment_ids=None, kv_segment_ids=None, **statics):
    if statics:  # fake (meta) path: same typed errors as the real one
        _check_args(q, k, v, q_segment_ids, kv_segment_ids, **statics)
    B, Hq, Sq, _ = q.shape
    return (OutSpec((B, Hq, Sq, v.shape[3]), q.dtype), OutSpec((B, Hq, 1, Sq), np.dtype("float32"), fill=-np.inf))


def _cost(p: _Plan, passes: int, extra_bytes: int = 0):
    from jax.experimental import pallas as pl

    frac = 0.5 if p.right is not None and p.left is None and p.off == 0 and p.Sq == p.Skv else 1.0
    mm = 2 * p.B * p.Hq * p.Sq * p.Skv * (p.D + p.Dv) * frac
    it = np.dtype(p.dtype).itemsize
    byts = p.B * (p.Hq * p.Sq * (p.D + p.Dv) + p.Hkv * p.Skv * (p.D + p.Dv)) * it + extra_bytes
    return pl.CostEstimate(flops=int(mm * passes), transcendentals=int(p.B * p.Hq * p.Sq * p.Skv * frac),
                           bytes_accessed=int(byts))


def _common_specs(p: _Plan, kv_index):
    """BlockSpecs for q-side and kv-side operands of the forward / dQ kernels."""
    from jax.experimental import pallas as pl

    G_blocks = p.G // p.hb
    q_spec = pl.BlockSpec((None, p.hb, p.bq, p.D), lambda b, h, i, t: (b, h, i, 0))
    k_spec = pl.BlockSpec((None, None, p.bkv, p.D), lambda b, h, i, t: (b, _div(h, G_blocks), kv_index(i, t), 0))
    v_spec = pl.BlockSpec((None, None, p.bkv, p.Dv), lambda b, h, i, t: (b, _div(h, G_blocks), kv_index(i, t), 0))
    row_spec = pl.BlockSpec((None, p.hb, 1, p.bq), lambda b, h, i, t: (b, h, 0, i))
    qs_spec = pl.BlockSpec((None, 1, p.bq), lambda b, h, i, t: (b, 0, i))
    ks_spec = pl.BlockSpec((None, 1, p.bkv), lambda b, h, i, t: (b, 0, kv_index(i, t)))
    return q_spec, k_spec, v_spec, row_spec, qs_spec, ks_spec


def _kv_index_fn(p: _Plan):
    def kv_index(i, t):
        j0, j1 = p.kv_range(i)
        return _clip(_min(j0 + t, j1), 0, max(p.nk - 1, 0))

    return kv_index


def _launch_fwd(q, k, v, q_segment_ids, kv_segment_ids, statics, cfg) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    _check_args(q, k, v, q_segment_ids, kv_segment_ids, **statics)
    p = _make_plan(q, k, v, q_segment_ids, **statics, **cfg)
    q_spec, k_spec, v_spec, row_spec, qs_spec, ks_spec = _common_specs(p, _kv_index_fn(p))
    in_specs = [q_spec, k_spec, v_spec] + ([qs_spec, ks_spec] if p.has_seg else [])
    o_spec = pl.BlockSpec((None, p.hb, p.bq, p.Dv), lambda b, h, i, t: (b, h, i, 0))
    scratch = [pltpu.VMEM((p.rows, 128), np.float32), pltpu.VMEM((p.rows, 128), np.float32),
               pltpu.VMEM((p.rows, p.Dv), np.float32)]
    return Launch(
        # Skv = 0: an empty grid; nothing runs and the outputs are their fill values (out 0, lse -inf)
        grid=(p.B, p.Hq // p.hb, p.nq, p.kv_steps if p.Skv else 0),
        in_specs=in_specs,
        out_specs=[o_spec, row_spec],
        out_shape=_fwd_out_shape(q, k, v),
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=_vmem_limit(_vmem_estimate(p, n_q_side=2, n_kv_side=2, acc_rows=p.rows, work=3)),
        cost_estimate=_cost(p, 1),
        body_kwargs={"plan": p},
    )


def _vmem_estimate(p: _Plan, n_q_side: int, n_kv_side: int, acc_rows: int, work: int) -> int:
    it = np.dtype(p.dtype).itemsize
    q_side = 2 * n_q_side * p.rows * max(p.D, p.Dv, 128) * it
    kv_side = 2 * n_kv_side * p.bkv * max(p.D, p.Dv, 128) * it
    acc = acc_rows * (2 * 128 + max(p.Dv, 128)) * 4
    tmp = work * p.rows * p.bkvc * 4
    return q_side + kv_side + acc + tmp


@tpu_kernel(_fwd_body, name="flash_attention_fwd", namespace=NAMESPACE, tunables=_tunables(_DOC_H),
            constraints=[_compute_divides], heuristic=_heuristic, out_shape=_fwd_out_shape)
def fa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_segment_ids: Optional[torch.Tensor] = None,
    kv_segment_ids: Optional[torch.Tensor] = None,
    *,
    causal: bool = False,
    causal_alignment: str = "top_left",
    sm_scale: Optional[float] = None,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    softcap: Optional[float] = None,
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    block_h: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention forward kernel: ``torch.ops.tpukernels.flash_attention_fwd`` -> ``(out, lse)``.

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Skv, D]``; v: ``[B, Hkv, Skv, Dv]``; bf16 or f32, one dtype.
        q_segment_ids: ``[B, 1, Sq]`` int32; kv_segment_ids: ``[B, 1, Skv]`` int32 (both or neither).
        causal, causal_alignment, sm_scale, window_left, window_right, softcap: see :func:`flash_attention`.

    Returns:
        ``out`` ``[B, Hq, Sq, Dv]`` in q's dtype and ``lse`` ``[B, Hq, 1, Sq]`` f32 (natural log; -inf for rows
        that see no key).

    Raises:
        ArgumentError, DTypeError: see :func:`flash_attention`.
    """
    statics = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale, window_left=window_left,
                   window_right=window_right, softcap=softcap)
    cfg = dict(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv_compute, block_h=block_h)
    return _launch_fwd(q, k, v, q_segment_ids, kv_segment_ids, statics, cfg)


# ----------------------------------------------------------------------------------------------- backward
#
# With P = softmax(S) (S the capped, scaled logits), dO the output gradient and Di = rowsum(dO * O) - dlse:
#   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - Di),   dR = dS * (1 - tanh^2(R_raw / cap))  (soft-cap only),
#   dQ = sm_scale * dR K,   dK = sm_scale * dR^T Q.
# P is recomputed from the saved lse: P = exp(S - lse). Rows with lse = -inf (nothing visible) get P = 0.

_STATIC_NAMES = ("causal", "causal_alignment", "sm_scale", "window_left", "window_right", "softcap")


def _bwd_heuristic(q, k, v, *rest, **statics):
    """Backward defaults (no DB entry): as the forward, 2048 blocks for long sequences, else 1024, with
    512-key compute sub-blocks (libtpu estimates on v6e / tpu7x, ``benchmarks/attention.py``)."""
    if len(q.shape) != 4 or len(k.shape) != 4:
        return {}
    Sq, Skv = int(q.shape[2]), int(k.shape[2])
    if Sq <= DECODE_FOLD_MAX_SQ:
        return {"block_q": 128, "block_kv": 1024, "block_kv_compute": 512, "block_h": 1}
    big = 2048 if min(Sq, Skv) >= 4096 else 1024
    return {"block_q": big, "block_kv": big, "block_kv_compute": 512, "block_h": 1}


def _ds(p: _Plan, pr, dp, di, s2):
    """dS (w.r.t. the raw scaled logits, before the soft-cap) from P, dP, Di and the base-2 capped logits."""
    ds = pr * (dp - di)
    if p.softcap is not None:
        t = s2 * (1.0 / (p.softcap * LOG2E))  # tanh(raw / cap)
        ds = ds * (1.0 - t * t)
    return ds


def _dq_body(*refs, plan: _Plan):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    p = plan
    if p.has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, qs_ref, ks_ref, dq_ref, acc_sc, lse_sc, di_sc = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref, acc_sc, lse_sc, di_sc = refs
        qs_ref = ks_ref = None
    f32 = p.dtype == "float32"
    i, t = pl.program_id(2), pl.program_id(3)
    j0, j1 = p.kv_range(i)
    j = j0 + t

    @pl.when(t == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        lse2 = _load_cols_wide(lse_ref, p) * LOG2E  # (rows, 128), lanes equal
        lse_sc[...] = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)  # empty rows: P = exp2(s - inf) = 0
        di_sc[...] = _load_cols_wide(di_ref, p)

    def update(r0: int, nr: int, c: int, masked: bool, qseg, tiles=None):
        """Accumulate dQ of rows [r0, r0 + nr) from key sub-block c of the current K/V block."""
        q = _rows_of(q_ref, p, r0, nr, p.D)
        do = _rows_of(do_ref, p, r0, nr, p.Dv)
        lse2 = lse_sc[pl.ds(r0, nr), :]
        di = di_sc[pl.ds(r0, nr), :]
        sl = pl.ds(c * p.bkvc, p.bkvc)
        k = k_ref[sl, :]
        v = v_ref[sl, :]
        kbase = j * p.bkv + c * p.bkvc
        if masked and p.kv_tail:  # NaN padding rows: 0 * NaN = NaN, select them away
            kcol = jax.lax.broadcasted_iota(jnp.int32, (p.bkvc, 1), 0)
            k = jnp.where(kcol < p.Skv - kbase, k, jnp.zeros_like(k))
            v = jnp.where(kcol < p.Skv - kbase, v, jnp.zeros_like(v))
        s2 = _logits2(p, _dot(q, k, _NT, f32))  # (nr, bkvc)
        pr = jnp.exp2(s2 - _lanes(lse2, p.bkvc))
        if masked:
            vis = _visible(p, tiles, i * p.bq + r0, kbase, qseg, ks_ref[:, sl] if p.has_seg else None,
                           q_tail=False, kv_tail=p.kv_tail)
            pr = jnp.where(vis, pr, 0.0)
        dp = _dot(do, v, _NT, f32)  # (nr, bkvc)
        ds = _ds(p, pr, dp, _lanes(di, p.bkvc), s2)
        acc_sc[pl.ds(r0, nr), :] += _dot(ds.astype(k.dtype), k, _NN, f32)

    def step(masked: bool):
        qseg = _head_stack(_row_to_col(qs_ref[...]), p.hb, 0) if (masked and p.has_seg) else None
        R = p.row_split if masked else 1
        nr = p.rows // R
        C = p.bkv // p.bkvc
        tiles = _tile_iotas(p, (nr, p.bkvc), 0, q_tail=False, kv_tail=p.kv_tail) if masked else None
        for r in range(R):
            rows = slice(r * nr, (r + 1) * nr)
            for c in range(C):
                args = (r * nr, nr, c)
                qs_r = None if qseg is None else qseg[rows]
                if not masked:
                    update(*args, False, None)
                elif R == 1:  # the block-level checks decided: one masked region for the whole block
                    update(*args, True, qs_r, tiles)
                else:
                    qa, ka = i * p.bq + r * nr, j * p.bkv + c * p.bkvc
                    _run_sub(p.any_visible(qa, nr, ka, p.bkvc), p.all_visible(qa, nr, ka, p.bkvc, q_tail_matters=False),
                             lambda a=args: update(*a, False, None),
                             lambda a=args, qs_r=qs_r: update(*a, True, qs_r, tiles))

    _run_steps(p, step, j <= j1, p.interior(i, j, q_tail_matters=False))

    @pl.when(t == p.kv_steps - 1)
    def _end():
        dq_ref[...] = (acc_sc[...] * p.scale).reshape(p.hb, p.bq, p.D).astype(dq_ref.dtype)


def _dkv_body(*refs, plan: _Plan):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    p = plan
    if p.has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, qs_ref, ks_ref, dk_ref, dv_ref, dk_sc, dv_sc = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref, dk_sc, dv_sc = refs
        qs_ref = ks_ref = None
    f32 = p.dtype == "float32"
    j, t = pl.program_id(2), pl.program_id(3)
    i0, i1 = p.q_range(j)
    i = i0 + jax.lax.rem(t, p.q_steps)

    @pl.when(t == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def load(r0: int, ncol: int, zero_tail: bool):
        """Q, dO rows and base-2 lse, Di columns [r0, r0 + ncol) of the current query block; with
        ``zero_tail`` the NaN padding past Sq is selected away (Q, dO -> 0, lse -> +inf, Di -> 0)."""
        q = _rows_of(q_ref, p, r0, ncol, p.D)
        do = _rows_of(do_ref, p, r0, ncol, p.Dv)
        if p.hb == 1:
            lse2, di = lse_ref[0, :, pl.ds(r0, ncol)], di_ref[0, :, pl.ds(r0, ncol)]  # (1, ncol)
        else:
            lse2, di = _load_rows(lse_ref, p), _load_rows(di_ref, p)
        lse2 = lse2 * LOG2E
        lse2 = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)
        if zero_tail:
            rcol = jax.lax.broadcasted_iota(jnp.int32, (ncol, 1), 0)
            rrow = jax.lax.broadcasted_iota(jnp.int32, (1, ncol), 1)
            if p.hb > 1:
                rcol, rrow = jax.lax.rem(rcol, p.bq), jax.lax.rem(rrow, p.bq)
            lim = p.Sq - i * p.bq - r0
            q = jnp.where(rcol < lim, q, jnp.zeros_like(q))
            do = jnp.where(rcol < lim, do, jnp.zeros_like(do))
            lse2 = jnp.where(rrow < lim, lse2, jnp.inf)
            di = jnp.where(rrow < lim, di, 0.0)
        return q, do, lse2, di

    def step(masked: bool):
        qseg = _head_stack(qs_ref[...], p.hb, 1) if (masked and p.has_seg) else None  # (1, rows)
        R = p.col_split if masked else 1
        ncol = p.rows // R
        C = p.bkv // p.bkvc
        tiles = _tile_iotas(p, (p.bkvc, ncol), 1, q_tail=p.q_tail, kv_tail=p.kv_tail) if masked else None
        for c in range(C):
            for r in range(R):
                args = (r * ncol, ncol, c)
                qs_r = None if qseg is None else qseg[:, r * ncol:(r + 1) * ncol]
                if not masked:
                    update(*args, False, None)
                elif R == 1:  # the block-level checks decided: one masked region for the whole block
                    update(*args, True, qs_r, tiles)
                else:
                    qa, ka = i * p.bq + r * ncol, j * p.bkv + c * p.bkvc
                    _run_sub(p.any_visible(qa, ncol, ka, p.bkvc), p.all_visible(qa, ncol, ka, p.bkvc, q_tail_matters=True),
                             lambda a=args: update(*a, False, None),
                             lambda a=args, qs_r=qs_r: update(*a, True, qs_r, tiles))

    def update(r0: int, ncol: int, c: int, masked: bool, qseg, tiles=None):
        """Accumulate dK, dV of key sub-block c from query columns [r0, r0 + ncol) of the current Q block."""
        q, do, lse2, di = load(r0, ncol, masked and p.q_tail)
        sl = pl.ds(c * p.bkvc, p.bkvc)
        k = k_ref[sl, :]
        v = v_ref[sl, :]
        s2 = _logits2(p, _dot(k, q, _NT, f32))  # (bkvc, ncol): keys in sublanes
        pr = jnp.exp2(s2 - lse2)
        if masked:
            kseg = _row_to_col(ks_ref[:, sl]) if p.has_seg else None  # (bkvc, 1)
            vis = _visible(p, tiles, i * p.bq + r0, j * p.bkv + c * p.bkvc, qseg, kseg,
                           q_tail=p.q_tail, kv_tail=p.kv_tail)
            pr = jnp.where(vis, pr, 0.0)
        dv_sc[sl, :] += _dot(pr.astype(do.dtype), do, _NN, f32)
        dp = _dot(v, do, _NT, f32)  # (bkvc, ncol)
        ds = _ds(p, pr, dp, di, s2)
        dk_sc[sl, :] += _dot(ds.astype(q.dtype), q, _NN, f32)

    _run_steps(p, step, i <= i1, p.interior(i, j, q_tail_matters=True))

    @pl.when(t == (p.G // p.hb) * p.q_steps - 1)
    def _end():
        dk_ref[...] = (dk_sc[...] * p.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _run_sub(any_vis, all_vis, plain, masked) -> None:
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
    cond = _all([any_vis, not_all])
    if cond is True:
        masked()
    else:
        pl.when(cond)(masked)


def _run_steps(p: _Plan, step, run, inner) -> None:
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


def _load_cols_wide(ref, p: _Plan):
    """Row-layout block ``(hb, 1, bq)`` -> lane-replicated columns ``(rows, 128)``."""
    import jax.numpy as jnp

    def one(row):  # (1, n) -> (n, 128)
        return jnp.transpose(jnp.broadcast_to(row, (128, row.shape[1])))

    if p.hb == 1:
        return one(ref[0])
    if p.bq % 8 == 0:
        return jnp.concatenate([one(ref[g]) for g in range(p.hb)], axis=0)
    return one(ref[...].reshape(1, p.rows))


def _bwd_out_dq(q, k, v, do, lse, di, q_segment_ids=None, kv_segment_ids=None, **statics):
    if statics:
        _check_bwd(q, k, v, do, lse, di, q_segment_ids, kv_segment_ids, statics, "flash_attention_bwd_dq")
    return OutSpec(tuple(q.shape), q.dtype)


def _bwd_out_dkv(q, k, v, do, lse, di, q_segment_ids=None, kv_segment_ids=None, **statics):
    if statics:
        _check_bwd(q, k, v, do, lse, di, q_segment_ids, kv_segment_ids, statics, "flash_attention_bwd_dkv")
    return (OutSpec(tuple(k.shape), k.dtype), OutSpec(tuple(v.shape), v.dtype))


def _check_bwd(q, k, v, do, lse, di, qs, ks, statics, where):
    _check_args(q, k, v, qs, ks, **statics, where=where)
    B, Hq, Sq, _ = q.shape
    if tuple(do.shape) != (B, Hq, Sq, v.shape[3]) or _dt(do) != _dt(q):
        raise ArgumentError(f"{where}: do must be {_dt(q)} [B, Hq, Sq, Dv] = {(B, Hq, Sq, v.shape[3])}, got {_dt(do)} {tuple(do.shape)}")
    for name, x in (("lse", lse), ("di", di)):
        if tuple(x.shape) != (B, Hq, 1, Sq) or _dt(x) != "float32":
            raise ArgumentError(f"{where}: {name} must be float32 [B, Hq, 1, Sq] = {(B, Hq, 1, Sq)}, got {_dt(x)} {tuple(x.shape)}")


def _launch_dq(q, k, v, do, lse, di, qs, ks, statics, cfg) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    _check_bwd(q, k, v, do, lse, di, qs, ks, statics, "flash_attention_bwd_dq")
    p = _make_plan(q, k, v, qs, **statics, **cfg)
    q_spec, k_spec, v_spec, row_spec, qs_spec, ks_spec = _common_specs(p, _kv_index_fn(p))
    do_spec = pl.BlockSpec((None, p.hb, p.bq, p.Dv), lambda b, h, i, t: (b, h, i, 0))
    in_specs = [q_spec, k_spec, v_spec, do_spec, row_spec, row_spec] + ([qs_spec, ks_spec] if p.has_seg else [])
    scratch = [pltpu.VMEM((p.rows, p.D), np.float32), pltpu.VMEM((p.rows, 128), np.float32),
               pltpu.VMEM((p.rows, 128), np.float32)]
    return Launch(
        grid=(p.B, p.Hq // p.hb, p.nq, p.kv_steps if p.Skv else 0),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=_bwd_out_dq(q, k, v, do, lse, di),
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=_vmem_limit(_vmem_estimate(p, n_q_side=3, n_kv_side=2, acc_rows=p.rows, work=4)),
        cost_estimate=_cost(p, 3 / 2),
        body_kwargs={"plan": p},
    )


def _launch_dkv(q, k, v, do, lse, di, qs, ks, statics, cfg) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    _check_bwd(q, k, v, do, lse, di, qs, ks, statics, "flash_attention_bwd_dkv")
    p = _make_plan(q, k, v, qs, **statics, **cfg)
    gb, qn = p.G // p.hb, p.q_steps

    def q_index(j, t):
        i0, i1 = p.q_range(j)
        return _clip(_min(i0 + _rem(t, qn), i1), 0, max(p.nq - 1, 0))

    def head(h, t):  # q-head block of group-local head block t // q_steps
        return h * gb + _div(t, qn)

    q_spec = pl.BlockSpec((None, p.hb, p.bq, p.D), lambda b, h, j, t: (b, head(h, t), q_index(j, t), 0))
    do_spec = pl.BlockSpec((None, p.hb, p.bq, p.Dv), lambda b, h, j, t: (b, head(h, t), q_index(j, t), 0))
    row_spec = pl.BlockSpec((None, p.hb, 1, p.bq), lambda b, h, j, t: (b, head(h, t), 0, q_index(j, t)))
    k_spec = pl.BlockSpec((None, None, p.bkv, p.D), lambda b, h, j, t: (b, h, j, 0))
    v_spec = pl.BlockSpec((None, None, p.bkv, p.Dv), lambda b, h, j, t: (b, h, j, 0))
    qs_spec = pl.BlockSpec((None, 1, p.bq), lambda b, h, j, t: (b, 0, q_index(j, t)))
    ks_spec = pl.BlockSpec((None, 1, p.bkv), lambda b, h, j, t: (b, 0, j))
    in_specs = [q_spec, k_spec, v_spec, do_spec, row_spec, row_spec] + ([qs_spec, ks_spec] if p.has_seg else [])
    scratch = [pltpu.VMEM((p.bkv, p.D), np.float32), pltpu.VMEM((p.bkv, p.Dv), np.float32)]
    return Launch(
        grid=(p.B, p.Hkv, p.nk, gb * qn if p.Sq else 0),
        in_specs=in_specs,
        out_specs=[k_spec, v_spec],
        out_shape=_bwd_out_dkv(q, k, v, do, lse, di),
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=_vmem_limit(_vmem_estimate(p, n_q_side=3, n_kv_side=4, acc_rows=p.bkv, work=5)),
        cost_estimate=_cost(p, 2),
        body_kwargs={"plan": p},
    )


def _rem(a, b: int):
    """``a % b`` for ``a >= 0`` (traced: lax.rem)."""
    if _is_py(a):
        return a % b
    import jax

    return jax.lax.rem(a, jax.numpy.int32(b))


@tpu_kernel(_dq_body, name="flash_attention_bwd_dq", namespace=NAMESPACE, tunables=_tunables(_DOC_H),
            constraints=[_compute_divides], heuristic=_bwd_heuristic, out_shape=_bwd_out_dq)
def fa_backward_dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    di: torch.Tensor,
    q_segment_ids: Optional[torch.Tensor] = None,
    kv_segment_ids: Optional[torch.Tensor] = None,
    *,
    causal: bool = False,
    causal_alignment: str = "top_left",
    sm_scale: Optional[float] = None,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    softcap: Optional[float] = None,
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    block_h: int,
) -> torch.Tensor:
    """dQ of flash attention: ``torch.ops.tpukernels.flash_attention_bwd_dq`` -> ``dq [B, Hq, Sq, D]``.

    Args:
        q, k, v, q_segment_ids, kv_segment_ids and the statics: as for :data:`fa_forward`.
        do: output gradient ``[B, Hq, Sq, Dv]`` (q's dtype).
        lse: the forward's ``lse`` ``[B, Hq, 1, Sq]`` f32.
        di: ``rowsum(do * out) - dlse`` ``[B, Hq, 1, Sq]`` f32.
    """
    statics = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale, window_left=window_left,
                   window_right=window_right, softcap=softcap)
    cfg = dict(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv_compute, block_h=block_h)
    return _launch_dq(q, k, v, do, lse, di, q_segment_ids, kv_segment_ids, statics, cfg)


@tpu_kernel(_dkv_body, name="flash_attention_bwd_dkv", namespace=NAMESPACE, tunables=_tunables(_DOC_H),
            constraints=[_compute_divides], heuristic=_bwd_heuristic, out_shape=_bwd_out_dkv)
def fa_backward_dkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    di: torch.Tensor,
    q_segment_ids: Optional[torch.Tensor] = None,
    kv_segment_ids: Optional[torch.Tensor] = None,
    *,
    causal: bool = False,
    causal_alignment: str = "top_left",
    sm_scale: Optional[float] = None,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    softcap: Optional[float] = None,
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    block_h: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV of flash attention (summed over each GQA group inside the kernel):
    ``torch.ops.tpukernels.flash_attention_bwd_dkv`` -> ``(dk [B, Hkv, Skv, D], dv [B, Hkv, Skv, Dv])``.

    Arguments as for :data:`fa_backward_dq`. The grid walks, per kv block, every query head of its group and
    every query block that can see it, accumulating dK/dV in f32 VMEM scratch.
    """
    statics = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale, window_left=window_left,
                   window_right=window_right, softcap=softcap)
    cfg = dict(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv_compute, block_h=block_h)
    return _launch_dkv(q, k, v, do, lse, di, q_segment_ids, kv_segment_ids, statics, cfg)


@fa_forward.def_backward
def _fa_backward(ctx, d_out, d_lse):
    q, k, v = ctx.q, ctx.k, ctx.v
    qs, ks = ctx.q_segment_ids, ctx.kv_segment_ids
    out, lse = ctx.outputs
    statics = {n: ctx.args[n] for n in _STATIC_NAMES}
    need_q = ctx.needs_input_grad.get("q", True)
    need_kv = ctx.needs_input_grad.get("k", True) or ctx.needs_input_grad.get("v", True)
    if d_out is None:
        d_out = torch.zeros_like(out)
    di = (d_out.float() * out.float()).sum(-1).unsqueeze(2)  # [B, Hq, 1, Sq]
    if d_lse is not None:
        di = di - d_lse  # d lse_i / d s_ij = P_ij, so dlse enters dS = P * (dP - (Di - dlse))
    grads = {}
    if need_q:
        grads["q"] = fa_backward_dq(q, k, v, d_out, lse, di, qs, ks, **statics)
    if need_kv:
        grads["k"], grads["v"] = fa_backward_dkv(q, k, v, d_out, lse, di, qs, ks, **statics)
    return grads


# ----------------------------------------------------------------------------------------------- public API


def _to_int32_ids(ids, name: str):
    if ids is None:
        return None
    if ids.dtype in (torch.int64, torch.int16, torch.int8, torch.uint8):
        return ids.to(torch.int32)
    if ids.dtype != torch.int32:
        raise DTypeError(f"flash_attention: {name} must be an integer tensor (int32), got {ids.dtype}")
    return ids


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    causal_alignment: str = "top_left",
    sm_scale: float | None = None,
    window: tuple[int | None, int | None] = (None, None),
    softcap: float | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    return_lse: bool = False,
    config: dict | None = None,
    interpret: str | None = None,
):
    """Flash attention on TPU (and cpu via Pallas interpret mode), differentiable, torch SDPA layout.

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Skv, D]``; v: ``[B, Hkv, Skv, Dv]``; one dtype of bfloat16,
            float16 or float32. ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA: query head ``h`` uses kv head
            ``h // (Hq // Hkv)``; dK/dV are summed over each group). Any ``Sq, Skv >= 0`` (tails are masked);
            tested head dims 64, 80, 96, 128, 256.
        causal: mask keys after the query's diagonal (``window`` right bound 0).
        causal_alignment: where the diagonal sits when ``Sq != Skv``; also anchors ``window``.
            ``"top_left"`` (default, torch SDPA ``is_causal``): query ``i`` sees keys ``j <= i``.
            ``"bottom_right"`` (FlashAttention >= 2.1; KV-cache prefill/decode): query ``i`` sees keys
            ``j <= i + Skv - Sq``, so the last query sees every key.
        sm_scale: logit scale; ``None`` means ``1 / sqrt(D)`` (JAX's Pallas kernel defaults to 1.0).
        window: ``(left, right)`` sliding window, inclusive, ``None`` = unbounded: query ``i`` sees keys
            ``i + off - left <= j <= i + off + right`` (``off`` from ``causal_alignment``). ``(None, 0)`` is
            exactly ``causal=True``; ``(w, 0)`` is causal local attention over ``w + 1`` keys.
        softcap: logit soft-cap ``softcap * tanh(s / softcap)`` on the scaled logits, before masking (Gemma 2).
        q_segment_ids: ``[B, Sq]``, kv_segment_ids: ``[B, Skv]`` integer ids (packed sequences): a query sees
            only keys of its own segment. Both or neither; converted to int32.
        return_lse: also return ``lse`` ``[B, Hq, Sq]`` float32, the natural-log log-sum-exp of each row's
            visible logits (``-inf`` where nothing is visible); differentiable.
        config: tuning config for the forward kernel (keys ``block_q``, ``block_kv``, ``block_kv_compute``,
            ``block_h``); default: tuning DB, then a shape heuristic.
        interpret: ``"fast"`` / ``"tpu"`` for cpu runs (see :mod:`tpukernels.dsl.modes`).

    Returns:
        ``out`` ``[B, Hq, Sq, Dv]`` in q's dtype, or ``(out, lse)``. A query row that sees no key (segments,
        window, causal with ``Sq > Skv`` bottom-right, ``Skv = 0``) gives exactly 0 and zero gradients.

    Numerics: ``Q K^T`` and ``P V`` accumulate in float32 on the MXU (bf16 inputs are multiplied as bf16;
    float32 inputs at ``Precision.HIGHEST``); softmax statistics and the output accumulator are float32.
    float16 inputs are computed in float32 (exact upcast; Mosaic takes no float16 kernel arguments) and the
    output is cast back to float16.

    Raises:
        ArgumentError: ranks, batch / head / length / head-dim mismatches, ``Hq % Hkv != 0``, only one of
            the segment ids, bad window / softcap / sm_scale / causal_alignment values.
        DTypeError: q, k, v dtypes differ or are not bf16 / fp16 / f32; non-integer segment ids.

    Sources: Dao, "FlashAttention-2" (arXiv:2307.08691); JAX ``pallas/ops/tpu/flash_attention.py`` and
    ``splash_attention`` (block skipping, compute sub-blocks, key-major dK/dV); FlashAttention 2.1 release
    notes (bottom-right causal alignment).
    """
    for name, val in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(val, bool):  # bool("false") is True: never coerce a flag
            raise ArgumentError(f"flash_attention: {name} must be a bool, got {val!r}")
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ArgumentError(f"flash_attention: window must be a (left, right) pair, got {window!r}")
    for name, val in (("sm_scale", sm_scale), ("softcap", softcap)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, (int, float))):
            raise ArgumentError(f"flash_attention: {name} must be a float or None, got {val!r}")
    for name, val in (("window[0]", window[0]), ("window[1]", window[1])):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int)):
            raise ArgumentError(f"flash_attention: {name} must be an int >= 0 or None, got {val!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ArgumentError(f"flash_attention: {name} must be a torch.Tensor, got {type(x).__name__}")
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1:
        raise DTypeError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    half = q.dtype == torch.float16
    if half:
        q, k, v = q.float(), k.float(), v.float()
    qs = _to_int32_ids(q_segment_ids, "q_segment_ids")
    ks = _to_int32_ids(kv_segment_ids, "kv_segment_ids")
    if (qs is None) != (ks is None):
        raise ArgumentError("flash_attention: q_segment_ids and kv_segment_ids must be given together (packed sequences)")
    if qs is not None:
        for name, ids, x in (("q_segment_ids", qs, q), ("kv_segment_ids", ks, k)):
            if ids.dim() != 2 or q.dim() != 4 or tuple(ids.shape) != (x.shape[0], x.shape[2]):
                want = (x.shape[0], x.shape[2]) if x.dim() == 4 else "[B, S]"
                raise ArgumentError(f"flash_attention: {name} must have shape [B, S] = {want}, got {tuple(ids.shape)}")
        qs, ks = qs.unsqueeze(1), ks.unsqueeze(1)
    out, lse = fa_forward(
        q, k, v, qs, ks, causal=causal, causal_alignment=causal_alignment,
        sm_scale=None if sm_scale is None else float(sm_scale), window_left=window[0], window_right=window[1],
        softcap=None if softcap is None else float(softcap), config=config, interpret=interpret,
    )
    if half:
        out = out.to(torch.float16)
    return (out, lse.squeeze(2)) if return_lse else out


def attention_reference(q, k, v, *, causal=False, causal_alignment="top_left", sm_scale=None, window=(None, None),
                        softcap=None, q_segment_ids=None, kv_segment_ids=None, dtype=torch.float32):
    """Plain torch attention with the same semantics as :func:`flash_attention` (dense masks, O(S^2) memory).

    Computes in ``dtype`` (float32 default; float64 for tests). Returns ``(out, lse)`` with ``lse`` ``[B, Hq, Sq]``.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hkv, 1)
    v = v.repeat_interleave(Hq // Hkv, 1)
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Skv)[None, :]
    off = Skv - Sq if causal_alignment == "bottom_right" else 0
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    vis = torch.ones(Sq, Skv, dtype=torch.bool)
    if right is not None:
        vis = vis & (j <= i + off + right)
    if left is not None:
        vis = vis & (j >= i + off - left)
    vis = vis.expand(B, Hq, Sq, Skv)
    if q_segment_ids is not None:
        vis = vis & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None]).masked_fill(~vis, 0)
    return p @ v, lse


_CAUSAL = dict(causal=True, causal_alignment="top_left", sm_scale=None, window_left=None, window_right=None,
               softcap=None)
#: The shapes the shipped defaults are tuned for (``benchmarks/attention.py``, ``tpukernels autotune
#: --library``): Llama-3-8B-like attention (32 query heads, 8 kv heads, D=128), causal, bf16.
STANDARD_CASES = [
    (fa_forward, (f"1x32x{S}x128:bf16", f"1x8x{S}x128:bf16", f"1x8x{S}x128:bf16"), dict(_CAUSAL)) for S in (4096, 8192)
] + [
    (kernel, (f"1x32x{S}x128:bf16", f"1x8x{S}x128:bf16", f"1x8x{S}x128:bf16", f"1x32x{S}x128:bf16",
              f"1x32x1x{S}:f32", f"1x32x1x{S}:f32"), dict(_CAUSAL))
    for kernel in (fa_backward_dq, fa_backward_dkv) for S in (4096, 8192)
]

def _flash_attention_op(q, k, v, *, causal=False, causal_alignment="top_left", sm_scale=None, window_left=None,
                        window_right=None, softcap=None, q_segment_ids=None, kv_segment_ids=None):
    return flash_attention(q, k, v, causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale,
                           window=(window_left, window_right), softcap=softcap, q_segment_ids=q_segment_ids,
                           kv_segment_ids=kv_segment_ids)


# The public op means the public function (out only); the kernel op returning (out, lse) is flash_attention_fwd.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("flash_attention(Tensor q, Tensor k, Tensor v, *, bool causal=False, str causal_alignment=\"top_left\", "
            "float? sm_scale=None, int? window_left=None, int? window_right=None, float? softcap=None, "
            "Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None) -> Tensor")
_LIB.impl("flash_attention", _flash_attention_op, "CompositeImplicitAutograd")

__all__ = ["flash_attention", "attention_reference", "fa_forward", "fa_backward_dq", "fa_backward_dkv",
           "STANDARD_CASES", "DECODE_FOLD_MAX_SQ"]
