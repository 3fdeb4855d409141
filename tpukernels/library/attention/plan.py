"""Argument checks, the static plan of one attention call (blocks, mask bounds, block ranges) and the tunable
space / heuristics / VMEM budget shared by the forward and backward kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from ...dsl import Tunable, cdiv
from ...errors import ArgumentError, DTypeError


NAMESPACE = "tpukernels"

ALIGNMENTS = ("top_left", "bottom_right")

#: Query lengths up to this fold the GQA group into the query rows (see module docstring).
DECODE_FOLD_MAX_SQ = 16

#: dtypes the kernels take. float16 is not among them: Mosaic (libtpu 0.0.52) rejects float16 kernel
#: arguments ("Only arguments with float8..., bfloat16 or 32-bit element types are supported"), so
#: :func:`flash_attention` computes float16 inputs in float32 (exact upcast) and casts the output back.
_FLOAT_DTYPES = ("bfloat16", "float32")

STATIC_NAMES = ("causal", "causal_alignment", "sm_scale", "window_left", "window_right", "softcap")

CAUSAL = dict(causal=True, causal_alignment="top_left", sm_scale=None, window_left=None, window_right=None,
              softcap=None)

def dtype_name(x) -> str:
    return np.dtype(x.dtype).name

def check_args(q, k, v, q_segment_ids, kv_segment_ids, *, causal, causal_alignment, sm_scale, window_left,
               window_right, softcap, where: str = "flash_attention") -> None:
    """Validate shapes, dtypes and static arguments; raise ArgumentError / DTypeError naming the argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ArgumentError(f"{where}: {name} must have rank 4 [B, H, S, D] (torch SDPA layout), got shape {tuple(x.shape)}")
        if dtype_name(x) not in _FLOAT_DTYPES:
            why = (" (Mosaic takes no float16 kernel arguments; tpukernels.library.flash_attention upcasts float16 "
                   "to float32)") if dtype_name(x) == "float16" else ""
            raise DTypeError(f"{where}: {name} dtype {dtype_name(x)} is not supported; use bfloat16 or float32{why}")
    if not (dtype_name(q) == dtype_name(k) == dtype_name(v)):
        raise DTypeError(f"{where}: q, k, v must share one dtype, "
                         f"got {dtype_name(q)}, {dtype_name(k)}, {dtype_name(v)}")
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
            if dtype_name(ids) != "int32":
                raise DTypeError(f"{where}: {name} must be int32, got {dtype_name(ids)}")
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

def _largest_divisor_at_most(n: int, cap: int) -> int:
    for d in range(max(1, min(n, cap)), 0, -1):
        if n % d == 0:
            return d
    return 1

@dataclasses.dataclass(frozen=True)
class Plan:
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
    # block-sparse mask tables (masked kernels, see .masks): heads of the tables (1: shared) and list lengths
    has_mask: bool = False
    mask_heads: int = 1
    mask_kv_steps: int = 0
    mask_q_steps: int = 0
    # MXU columns of the launch chip (:func:`mxu_columns`): where a PV product leaves 128 of them idle, the
    # forward's row sums ride on it (:attr:`rowsum_on_mxu`)
    mxu_cols: int = 128

    @property
    def bounded_exp(self) -> bool:
        """Huge-scale safe softmax (``sm_scale > 1`` without a soft-cap). With a huge ``sm_scale`` the logits
        reach magnitudes (1e31 at ``sm_scale=1e30``) where one ulp is ~1e24: a logit rounded differently from
        the running max (a multiply recomputed in another fusion on the cpu interpreter, the saved lse round-
        tripped through ln 2) makes ``s - m`` a huge number of either sign: exp2 gives inf (NaN output) or 0 for
        every key (a row wrongly empty), where torch SDPA stays finite. The forward then keeps its running max
        in raw dot-product units and scales ``raw - max`` (exactly 0 at the maximum); the backward clamps its
        exponents at 0 (``P <= 1``; at such scales its recomputed P keeps f32's relative precision of the lse,
        so the gradient is finite but approximate). Skipped elsewhere: ``|s| <= softcap * log2(e)`` with a
        soft-cap, and with ``sm_scale <= 1`` trouble takes ``|q.k| >= 2^24``."""
        return self.softcap is None and self.scale > 1.0

    @property
    def rowsum_on_mxu(self) -> bool:
        """The forward sums each row of ``P`` on the MXU, in the PV product: V gets 128 columns of ones, so
        ``P @ [V | 1]`` gives ``P V`` and the row sums, already lane-replicated as the ``l`` scratch holds them,
        instead of a VPU add and an XLU lane reduction per score tile. Where the chip's MXU is at least
        ``Dv + 128`` columns wide per pass (v6e, tpu7x: 256 with ``Dv = 128``), the extra columns ride in the pass
        the PV product makes anyway. libtpu 0.0.52's static estimate (a model; ``benchmarks/attention.py``,
        B=1 Hq=Hkv=2 S=8192 D=128 non-causal, 4096 / 4096 / 256): tpu7x 322,919 -> 281,239 cycles (-12.9%), v6e
        316,963 -> 290,419 (-8.4%). Only without any mask: on masked plans libtpu's static profiler aborts
        (``fifo_tracker.cc``) even when only the mask-free steps use it, so nothing could show it pays there.
        The row sum is then of the bf16-rounded ``P`` the PV product uses (numerator and denominator of the
        output see the same weights), accumulated in f32 by the MXU."""
        return not self.masked and self.Dv % 128 == 0 and self.mxu_cols >= self.Dv + 128

    @property
    def rows_whole(self) -> bool:
        """Position-row operands (lse, di, q segment ids: ``[.., 1, Sq]``) move as one whole-``Sq`` block
        when ``bq`` divides 128 and is less than ``Sq`` (a ``(1, bq)`` block would break the (8, 128) rule,
        e.g. float32 ``block_q=64``); the kernels then read / write lanes ``[i * bq, (i + 1) * bq)`` of it
        through aligned 128-lane windows, and the forward runs its query-block axis in order (the lse block
        is revisited)."""
        return self.bq % 128 != 0 and self.bq < self.Sq and 128 % self.bq == 0

    @property
    def row_width(self) -> int:
        """Lanes of the whole-row block (:attr:`rows_whole`): ``nq * bq`` rounded up to 128 (one block,
        overhanging ``Sq``: the last query block's lanes stay inside it)."""
        return cdiv(self.nq * self.bq, 128) * 128

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
        return self.has_mask or self.has_seg or self.left is not None or self.right is not None or self.kv_tail

    # -- block ranges; ``i``/``j`` are Python ints (launch) or traced int32 scalars (index maps, bodies)
    def kv_range(self, i):
        """First and last kv block that query block ``i`` can see (last < first: none)."""
        qa = i * self.bq
        qb = traced_min(qa + self.bq, self.Sq) - 1
        j0 = 0 if self.left is None else div(_max(qa + (self.off - self.left), 0), self.bkv)
        if self.right is None:
            j1 = self.nk - 1
        else:
            j1 = traced_min(div(_max(qb + (self.off + self.right), -1) + self.bkv, self.bkv) - 1, self.nk - 1)
        return j0, j1

    def q_range(self, j):
        """First and last query block that can see kv block ``j`` (last < first: none)."""
        ka = j * self.bkv
        kb = traced_min(ka + self.bkv, self.Skv) - 1
        i0 = 0 if self.right is None else div(_max(ka - (self.off + self.right), 0), self.bq)
        if self.left is None:
            i1 = self.nq - 1
        else:
            i1 = traced_min(div(_max(kb + (self.left - self.off), -1) + self.bq, self.bq) - 1, self.nq - 1)
        return i0, i1

    @functools.cached_property
    def kv_steps(self) -> int:
        """Length of the kv grid axis of the forward and dQ kernels (>= 1 so every q block is written)."""
        if self.has_mask:
            return max(1, self.mask_kv_steps)
        return max([1] + [j1 - j0 + 1 for j0, j1 in (self.kv_range(i) for i in range(self.nq))])

    @functools.cached_property
    def q_steps(self) -> int:
        """Query blocks per kv block in the dK/dV kernel (>= 1)."""
        if self.has_mask:
            return max(1, self.mask_q_steps)
        return max([1] + [i1 - i0 + 1 for i0, i1 in (self.q_range(j) for j in range(self.nk))])

    def interior(self, i, j, *, q_tail_matters: bool):
        """True where every (query, key) pair of blocks (i, j) is visible: the mask can be skipped."""
        return self.all_visible(i * self.bq, self.bq, j * self.bkv, self.bkv, q_tail_matters=q_tail_matters)

    def all_visible(self, qa, nq, ka, nk, *, q_tail_matters: bool):
        """Every pair of queries ``[qa, qa + nq)`` x keys ``[ka, ka + nk)`` is visible (no mask needed)."""
        if self.has_seg:
            return False
        conds = []
        qb = traced_min(qa + nq, self.Sq) - 1
        kb = ka + nk - 1
        if self.kv_tail:
            conds.append(kb < self.Skv)
        if q_tail_matters and self.q_tail:
            conds.append(qa + nq <= self.Sq)
        if self.right is not None:
            conds.append(kb <= qa + (self.off + self.right))
        if self.left is not None:
            conds.append(ka >= qb + (self.off - self.left))
        return traced_all(conds)

    def any_visible(self, qa, nq, ka, nk):
        """Some pair of valid queries ``[qa, qa + nq)`` x keys ``[ka, ka + nk)`` may be visible (segments
        are not looked at); False means the pairs can be skipped."""
        conds = []
        qb = traced_min(qa + nq, self.Sq) - 1
        kb = traced_min(ka + nk, self.Skv) - 1
        if self.q_tail:
            conds.append(qa < self.Sq)
        if self.kv_tail:
            conds.append(ka < self.Skv)
        if self.right is not None:
            conds.append(ka <= qb + (self.off + self.right))
        if self.left is not None:
            conds.append(kb >= qa + (self.off - self.left))
        return traced_all(conds)

    #: Smallest (rows x keys) sub-block a boundary block is split into. libtpu's estimates (v6e, S=4096,
    #: causal): splitting into 512 x 512 sub-blocks saves 3-13% of the forward; 256-wide sub-blocks cost
    #: 25-40% more than not splitting (per-region overhead dominates).
    MIN_SUB = 512

    def _split(self, n: int) -> int:
        if self.has_mask or self.hb != 1 or self.bkvc < self.MIN_SUB or n % self.MIN_SUB:
            return 1
        return max(1, min(4, n // self.MIN_SUB, 16 // (self.bkv // self.bkvc)))

    @property
    def row_split(self) -> int:
        """Row sub-blocks of a masked forward / dQ step (1: none). Each (row sub-block, key sub-block)
        pair of a boundary block is then skipped, run without mask or run masked on its own, so a causal
        diagonal block skips its upper triangle of sub-blocks."""
        return self._split(self.rows)

    @property
    def diagonal_only(self) -> bool:
        """A boundary (masked) block is always a diagonal block ``j == i`` whose visibility is the same for
        every ``i``: plain causal, top-left aligned (``off = 0``), ``block_q == block_kv``, no window, tails,
        segments, mask tables or head stacking. The kernels then decide each sub-block of a boundary block
        statically (skipped / unmasked / masked, no runtime ``pl.when`` per sub-block; libtpu's static estimate
        charges every region a sub-block's runtime checks emit). Used by the forward and dQ kernels; dK/dV
        keeps its runtime checks: there the static form modelled at -12% on v6e but +23% on tpu7x (libtpu
        0.0.52 static estimate, S=4096 causal, block_q = block_kv = 2048, block_kv_compute = 512)."""
        return (self.right == 0 and self.left is None and self.off == 0 and self.bq == self.bkv
                and not (self.has_mask or self.has_seg or self.q_tail or self.kv_tail) and self.hb == 1)

    def sub_visibility(self, i, j, r0: int, nr: int, c0: int, nc: int, *, q_tail_matters: bool):
        """``(any_visible, all_visible)`` of query rows ``[r0, r0 + nr)`` x keys ``[c0, c0 + nc)`` (offsets
        inside query block ``i`` / key block ``j``) of a boundary block. Python bools under
        :attr:`diagonal_only` (the block is ``j == i``: only the offsets matter), else traced."""
        if self.diagonal_only:
            return c0 <= r0 + nr - 1, c0 + nc - 1 <= r0
        qa, ka = i * self.bq + r0, j * self.bkv + c0
        return self.any_visible(qa, nr, ka, nc), self.all_visible(qa, nr, ka, nc, q_tail_matters=q_tail_matters)

    @property
    def col_split(self) -> int:
        """Query sub-blocks (lane slices) of a masked dK/dV step (1: none); see :attr:`row_split`."""
        return self._split(self.rows)

def _is_py(*xs) -> bool:
    return all(isinstance(x, (int, np.integer)) for x in xs)

def traced_min(a, b):
    if _is_py(a, b):
        return min(a, b)
    import jax.numpy as jnp

    return jnp.minimum(a, b)

def _max(a, b):
    if _is_py(a, b):
        return max(a, b)
    import jax.numpy as jnp

    return jnp.maximum(a, b)

def div(a, b: int):
    """``a // b`` for ``a >= 0`` (traced: truncating lax.div, which lowers without jnp's sign fix-ups)."""
    if _is_py(a):
        return a // b
    import jax

    return jax.lax.div(a, jax.numpy.int32(b))

def rem(a, b: int):
    """``a % b`` for ``a >= 0`` (traced: lax.rem)."""
    if _is_py(a):
        return a % b
    import jax

    return jax.lax.rem(a, jax.numpy.int32(b))

def traced_all(conds):
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

def clip(x, lo, hi):
    return traced_min(_max(x, lo), hi)

def make_plan(q, k, v, q_segment_ids, *, causal, causal_alignment, sm_scale, window_left, window_right, softcap,
              block_q, block_kv, block_kv_compute, block_h) -> Plan:
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
    if bq % 128 and 0 < bq < Sq and 128 % bq:
        raise ArgumentError(f"flash_attention: block_q={bq} must be a multiple of 128, a divisor of 128 (8, 16, 32, "
                            f"64) or >= Sq ({Sq}) (the lse / di rows are laid out in 128-lane windows)")
    bkv = Skv if 0 < Skv <= block_kv else block_kv
    bkvc = block_kv_compute if (block_kv_compute < bkv and bkv % block_kv_compute == 0) else bkv
    return Plan(
        B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D, Dv=Dv, dtype=dtype_name(q), hb=hb, bq=max(bq, 1), bkv=max(bkv, 1),
        bkvc=max(bkvc, 1), scale=float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale),
        softcap=None if softcap is None else float(softcap),
        off=(Skv - Sq) if causal_alignment == "bottom_right" else 0, left=left, right=right,
        has_seg=q_segment_ids is not None, mxu_cols=mxu_columns(),
    )


def mxu_columns() -> int:
    """MXU columns of the chip being launched for (jax's ``tpu_info.mxu_column_size``: 128 on v4 / v5e / v5p,
    256 on v6e / tpu7x). With no target chip (a cpu interpret run with none set) the widest of the shipped
    chips, so interpret runs take the path v6e and tpu7x take."""
    from ..vmem import SHIPPED_CHIPS, target_chip

    chip = target_chip()
    if chip is None:
        from ...chips import get_chip

        return max(int(get_chip(n).info.mxu_column_size) for n in SHIPPED_CHIPS)
    return int(chip.info.mxu_column_size)

BLOCKS = (128, 256, 512, 1024, 2048)

def compute_divides(cfg):
    if cfg["block_kv_compute"] > cfg["block_kv"] or cfg["block_kv"] % cfg["block_kv_compute"]:
        return "block_kv_compute must divide block_kv"
    return True

def tunables(doc_h: str):
    return {
        "block_q": Tunable(BLOCKS, default=1024, doc="query positions per grid step (multiple of 128; Sq if smaller)"),
        "block_kv": Tunable(BLOCKS, default=1024, doc="key positions per K/V DMA block (multiple of 128; Skv if smaller)"),
        "block_kv_compute": Tunable(BLOCKS, default=512, doc="key positions per compute sub-block (divides block_kv)"),
        "block_h": Tunable((1, 2, 4, 8), default=1, doc=doc_h),
    }

DOC_H = ("query heads of one kv group per grid step (largest divisor of the group <= this; no effect without GQA, "
         "where the group is 1 head); decode folds the whole group")

def heuristic(q, k, v, *rest, **statics):
    """Shape-dependent defaults (used when no tuning-DB entry applies), from libtpu static estimates on
    v5e / v6e / tpu7x (``benchmarks/attention.py``, causal GQA D=128 bf16): big query and key blocks amortise
    the per-step cost and keep the MXU busy per K/V byte; 512-key compute sub-blocks (256 was 2-17% slower on
    v6e, and a boundary block is only split into sub-blocks of >= 512, see ``Plan.MIN_SUB``)."""
    if len(q.shape) != 4 or len(k.shape) != 4:  # malformed: the launch function raises the typed error
        return {}
    Sq, Skv = int(q.shape[2]), int(k.shape[2])
    if Sq <= DECODE_FOLD_MAX_SQ:  # decode: memory bound; long K/V blocks amortise per-step overhead
        return {"block_q": 128, "block_kv": 1024, "block_kv_compute": 512, "block_h": 1}
    big = 2048 if min(Sq, Skv) >= 4096 else 1024
    return {"block_q": big, "block_kv": big, "block_kv_compute": 512, "block_h": 1}

def bwd_heuristic(q, k, v, *rest, **statics):
    """Backward defaults (no DB entry): as the forward, 2048 blocks for long sequences, else 1024, with
    512-key compute sub-blocks (libtpu estimates on v6e / tpu7x, ``benchmarks/attention.py``)."""
    if len(q.shape) != 4 or len(k.shape) != 4:
        return {}
    Sq, Skv = int(q.shape[2]), int(k.shape[2])
    if Sq <= DECODE_FOLD_MAX_SQ:
        return {"block_q": 128, "block_kv": 1024, "block_kv_compute": 512, "block_h": 1}
    big = 2048 if min(Sq, Skv) >= 4096 else 1024
    return {"block_q": big, "block_kv": big, "block_kv_compute": 512, "block_h": 1}

def vmem_limit(est_bytes: int) -> int | None:
    """Scoped VMEM to request: None (chip default) for small footprints, else room for Mosaic's temporaries
    (logit / probability tiles). Capped at 40 MiB: tpu7x has 64 MiB per core and XLA needs some of it
    around the kernel (48 MiB overflowed there, libtpu 0.0.52); and at
    :func:`~tpukernels.library.vmem.vmem_cap` of the launch chip (v4 has 16 MiB of VMEM: 14 MiB)."""
    from ..vmem import DEFAULT_SCOPED_VMEM, vmem_cap

    if est_bytes <= 6 << 20:
        return None
    limit = int(min(40 << 20, vmem_cap(), 2 * est_bytes + (16 << 20)))
    return None if limit <= DEFAULT_SCOPED_VMEM else limit  # v4: its 16 MiB default is all there is

def vmem_estimate(p: Plan, n_q_side: int, n_kv_side: int, acc_rows: int, work: int) -> int:
    it = np.dtype(p.dtype).itemsize
    q_side = 2 * n_q_side * p.rows * max(p.D, p.Dv, 128) * it
    kv_side = 2 * n_kv_side * p.bkv * max(p.D, p.Dv, 128) * it
    acc = acc_rows * (2 * 128 + max(p.Dv, 128)) * 4
    tmp = work * p.rows * p.bkvc * 4
    return q_side + kv_side + acc + tmp

def cost(p: Plan, passes: int, extra_bytes: int = 0):
    from jax.experimental import pallas as pl

    frac = 0.5 if p.right is not None and p.left is None and p.off == 0 and p.Sq == p.Skv else 1.0
    mm = 2 * p.B * p.Hq * p.Sq * p.Skv * (p.D + p.Dv) * frac
    it = np.dtype(p.dtype).itemsize
    byts = p.B * (p.Hq * p.Sq * (p.D + p.Dv) + p.Hkv * p.Skv * (p.D + p.Dv)) * it + extra_bytes
    return pl.CostEstimate(flops=int(mm * passes), transcendentals=int(p.B * p.Hq * p.Sq * p.Skv * frac),
                           bytes_accessed=int(byts))
