"""Attention masks as expressive as JAX's splash attention, and their block-sparse tables.

A mask says which (query, key) pairs are visible: ``mask[h][i, j]`` is True where query ``i`` of head ``h``
may attend to key ``j``. The classes mirror ``jax.experimental.pallas.ops.tpu.splash_attention``'s mask API
(``CausalMask(shape, offset)``, ``LocalMask(shape, window_size, offset)``, ``FullMask(shape)``,
``NumpyMask(array)``, ``MultiHeadMask(masks)``, ``mask_a | mask_b``, ``mask_a & mask_b``) with the same
conventions: ``shape`` is ``(Sq, Skv)``; ``offset`` shifts the query positions (``i + offset`` is compared
with ``j``), so ``CausalMask((Sq, Skv), offset=Skv - Sq)`` is bottom-right aligned causal attention.
``ChunkedCausalMask`` (Llama 4 chunked attention) is included too.

:func:`mask_tables` compiles a mask once per block shape into block-sparse tables (cached by the mask's
value, so a training loop that builds an equal mask every step reuses them): for every (head, query block)
the key blocks to visit in order with their kind (partial: apply the element mask; full: run without it;
fully masked blocks are not listed: no DMA, no MXU work), the same per key block for the dK/dV kernel, and the
deduplicated partial blocks' element masks (int8) that a data-dependent index map feeds to the kernels.

Rows that see no key (fully masked rows) give output 0 and ``lse = -inf`` (as splash attention), with zero
gradients.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Sequence

import numpy as np

from ...errors import ArgumentError, DTypeError

__all__ = ["Mask", "CausalMask", "LocalMask", "ChunkedCausalMask", "FullMask", "NumpyMask", "MultiHeadMask",
           "LogicalOr", "LogicalAnd", "MaskTables", "mask_tables"]


def _check_shape(shape, where: str) -> tuple[int, int]:
    if (not isinstance(shape, (tuple, list)) or len(shape) != 2
            or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise ArgumentError(f"{where}: shape must be (Sq, Skv) with ints >= 0, got {shape!r}")
    return int(shape[0]), int(shape[1])


def _check_int(x, name: str, where: str, *, allow_none: bool = False, min_value: int | None = None):
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or (min_value is not None and x < min_value):
        rule = "an int" + (f" >= {min_value}" if min_value is not None else "") + (" or None" if allow_none else "")
        raise ArgumentError(f"{where}: {name} must be {rule}, got {x!r}")
    return int(x)


def block_config(config, default: int, where: str, what: str = "") -> tuple[dict, dict]:
    """The masked kernels' ``config``: ``({"block_q": .., "block_kv": ..}, the other keys)`` (only
    ``block_kv_compute`` may remain), the two block sizes positive multiples of 128, ``default`` where absent.

    Raises:
        ArgumentError: another key, or a block size that is not a positive multiple of 128.
    """
    cfg = dict(config or {})
    unknown = set(cfg) - {"block_q", "block_kv", "block_kv_compute"}
    if unknown:
        raise ArgumentError(f"{where}: config keys {sorted(unknown)} do not apply{what} (block_q, block_kv, "
                            f"block_kv_compute)")
    blocks = {}
    for name in ("block_q", "block_kv"):
        b = cfg.pop(name, default)
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % 128:
            raise ArgumentError(f"{where}: config[{name!r}] must be a positive multiple of 128, got {b!r}")
        blocks[name] = b
    return blocks, cfg


class Mask:
    """Base class: a boolean ``(Sq, Skv)`` mask (or ``(H, Sq, Skv)`` for :class:`MultiHeadMask`).

    ``mask[qs, ks]`` returns the dense numpy bool block for slices ``qs`` and ``ks``. Masks are immutable,
    compare and hash by value, and combine with ``|`` (union) and ``&`` (intersection).
    """

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def num_heads(self) -> int | None:
        """Heads of a multi-head mask; None for a mask shared by every head."""
        return None

    def _block(self, qs: slice, ks: slice) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, idx) -> np.ndarray:
        if not (isinstance(idx, tuple) and len(idx) == 2 and all(isinstance(s, slice) for s in idx)):
            raise ArgumentError(f"{type(self).__name__}: index with two slices, got {idx!r}")
        Sq, Skv = self.shape[-2:]
        qs = slice(*idx[0].indices(Sq)[:2])
        ks = slice(*idx[1].indices(Skv)[:2])
        return self._block(qs, ks)

    def _key(self) -> tuple:
        raise NotImplementedError

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __bool__(self) -> bool:  # splash: masks are not truth values (use `is None`)
        raise ArgumentError(f"{type(self).__name__}: a mask has no truth value")

    def __or__(self, other: "Mask") -> "Mask":
        return LogicalOr(self, other)

    def __and__(self, other: "Mask") -> "Mask":
        return LogicalAnd(self, other)

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self._key()!r}"


class _ComputableMask(Mask):
    def __init__(self, shape):
        self._shape = _check_shape(shape, type(self).__name__)

    @property
    def shape(self):
        return self._shape

    def _fn(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _block(self, qs, ks):
        q = np.arange(qs.start, qs.stop, dtype=np.int64)[:, None]
        k = np.arange(ks.start, ks.stop, dtype=np.int64)[None, :]
        return np.broadcast_to(self._fn(q, k), (q.shape[0], k.shape[1]))


class CausalMask(_ComputableMask):
    """Query ``i`` sees keys ``j <= i + offset`` (splash ``CausalMask``; ``offset = Skv - Sq``: bottom-right)."""

    def __init__(self, shape: tuple[int, int], offset: int = 0):
        super().__init__(shape)
        self.offset = _check_int(offset, "offset", "CausalMask")

    def _fn(self, q, k):
        return q + self.offset >= k

    def _key(self):
        return (self.shape, self.offset)


class LocalMask(_ComputableMask):
    """Query ``i`` sees keys ``i + offset - left <= j <= i + offset + right``; ``window_size = (left, right)``,
    ``None`` unbounded (splash ``LocalMask``)."""

    def __init__(self, shape: tuple[int, int], window_size: tuple[int | None, int | None], offset: int = 0):
        super().__init__(shape)
        if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
            raise ArgumentError(f"LocalMask: window_size must be a (left, right) pair, got {window_size!r}")
        self.window_size = tuple(_check_int(w, f"window_size[{n}]", "LocalMask", allow_none=True, min_value=0)
                                 for n, w in enumerate(window_size))
        self.offset = _check_int(offset, "offset", "LocalMask")

    def _fn(self, q, k):
        left, right = self.window_size
        out = np.ones(np.broadcast_shapes(q.shape, k.shape), bool)
        if left is not None:
            out &= q + self.offset - left <= k
        if right is not None:
            out &= k <= q + self.offset + right
        return out

    def _key(self):
        return (self.shape, self.window_size, self.offset)


class ChunkedCausalMask(_ComputableMask):
    """Causal within chunks of ``chunk_size`` positions: ``j <= i`` and ``i // chunk == j // chunk``."""

    def __init__(self, shape: tuple[int, int], chunk_size: int):
        super().__init__(shape)
        self.chunk_size = _check_int(chunk_size, "chunk_size", "ChunkedCausalMask", min_value=1)

    def _fn(self, q, k):
        return (q >= k) & (q // self.chunk_size == k // self.chunk_size)

    def _key(self):
        return (self.shape, self.chunk_size)


class FullMask(_ComputableMask):
    """Every key visible to every query."""

    def _fn(self, q, k):
        return np.ones(np.broadcast_shapes(q.shape, k.shape), bool)

    def _key(self):
        return (self.shape,)


class NumpyMask(Mask):
    """An arbitrary boolean ``(Sq, Skv)`` mask (numpy array or torch tensor, copied), e.g. random or document
    masks. Non-bool arrays raise :class:`DTypeError` (no silent truthiness of ints/floats)."""

    def __init__(self, array):
        try:
            import torch

            if isinstance(array, torch.Tensor):
                if array.dtype != torch.bool:
                    raise DTypeError(f"NumpyMask: array must be bool, got torch {array.dtype}")
                array = array.detach().cpu().numpy()
        except ImportError:  # pragma: no cover
            pass
        if not isinstance(array, np.ndarray):
            raise ArgumentError(f"NumpyMask: array must be a numpy array or torch tensor, got {type(array).__name__}")
        if array.dtype != np.bool_:
            raise DTypeError(f"NumpyMask: array must be bool, got {array.dtype}")
        if array.ndim != 2:
            raise ArgumentError(f"NumpyMask: array must be 2-D (Sq, Skv), got shape {array.shape}")
        self.array = np.array(array, dtype=bool, copy=True)
        self.array.flags.writeable = False
        self._digest = hashlib.sha256(self.array.tobytes() + repr(self.array.shape).encode()).hexdigest()

    @property
    def shape(self):
        return tuple(self.array.shape)

    def _block(self, qs, ks):
        return self.array[qs, ks]

    def _key(self):
        return (self.shape, self._digest)


class MultiHeadMask(Mask):
    """One mask per query head: ``masks[h]`` for head ``h`` (all of one ``(Sq, Skv)`` shape)."""

    def __init__(self, masks: Sequence[Mask]):
        masks = tuple(masks)
        if not masks or not all(isinstance(m, Mask) and m.num_heads is None for m in masks):
            raise ArgumentError("MultiHeadMask: masks must be a non-empty sequence of single-head Mask objects")
        shapes = {m.shape for m in masks}
        if len(shapes) != 1:
            raise ArgumentError(f"MultiHeadMask: every head's mask must have one shape, got {sorted(shapes)}")
        self.masks = masks

    @property
    def shape(self):
        return (len(self.masks), *self.masks[0].shape)

    @property
    def num_heads(self):
        return len(self.masks)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.masks[idx]
        if isinstance(idx, tuple) and len(idx) == 3 and isinstance(idx[0], (int, np.integer)):
            return self.masks[idx[0]][idx[1:]]
        raise ArgumentError(f"MultiHeadMask: index with (head, slice, slice) or a head, got {idx!r}")

    def _key(self):
        return self.masks


class _Logical(Mask):
    _op = None

    def __init__(self, left: Mask, right: Mask):
        name = type(self).__name__
        if not isinstance(left, Mask) or not isinstance(right, Mask):
            raise ArgumentError(f"{name}: both operands must be Mask objects, got {type(left).__name__}, "
                                f"{type(right).__name__}")
        if left.shape[-2:] != right.shape[-2:]:
            raise ArgumentError(f"{name}: mask shapes differ: {left.shape} and {right.shape}")
        if left.num_heads is not None or right.num_heads is not None:
            if left.num_heads is not None and right.num_heads is not None and left.num_heads != right.num_heads:
                raise ArgumentError(f"{name}: head counts differ: {left.num_heads} and {right.num_heads}")
        self.left, self.right = left, right

    @property
    def shape(self):
        return self.left.shape if self.left.num_heads is not None else self.right.shape

    @property
    def num_heads(self):
        return self.left.num_heads or self.right.num_heads

    def head(self, h: int) -> Mask:
        def one(m):
            return m.head(h) if isinstance(m, _Logical) else (m[h] if m.num_heads is not None else m)
        return type(self)(one(self.left), one(self.right))

    def _block(self, qs, ks):
        if self.num_heads is not None:
            raise ArgumentError(f"{type(self).__name__}: a multi-head mask is indexed per head (use .head(h))")
        return type(self)._op(self.left[qs, ks], self.right[qs, ks])

    def _key(self):
        return (self.left, self.right)


class LogicalOr(_Logical):
    """Union: a pair is visible if either mask shows it (``a | b``)."""

    _op = staticmethod(np.logical_or)


class LogicalAnd(_Logical):
    """Intersection: a pair is visible if both masks show it (``a & b``)."""

    _op = staticmethod(np.logical_and)


def head_masks(mask: Mask) -> tuple[Mask, ...]:
    """The per-head single-head masks of ``mask`` (one entry for a mask shared by every head)."""
    n = mask.num_heads
    if n is None:
        return (mask,)
    if isinstance(mask, MultiHeadMask):
        return mask.masks
    return tuple(mask.head(h) for h in range(n))


def mask_spec(mask: Mask) -> tuple[tuple, tuple[Mask, ...]]:
    """``(spec, leaves)``: ``mask`` as a nested tuple of plain constants (class name and constructor arguments
    of the computable masks, ``|`` / ``&`` and :class:`MultiHeadMask` nodes) plus the masks it holds that are
    data (:class:`NumpyMask`, a user's own :class:`Mask` subclass), which the spec names by index into
    ``leaves``. :func:`mask_from_spec` rebuilds an equal mask.

    Why: ``torch.compile`` evaluates the mask tables once at trace time by calling a constant-result function,
    and dynamo can hand it ints, tuples and objects that exist outside the traced code, but not a mask object
    constructed inside it (it passes an instance without its attributes). The spec is read from the traced
    objects' attributes, which dynamo can do; a ``NumpyMask`` is data and is passed as itself."""
    leaves: list = []

    def walk(m):
        t = type(m)
        if t in (CausalMask, LocalMask, ChunkedCausalMask, FullMask):  # their _key() is their constructor args
            return (t.__name__, m._key())
        if t in (LogicalOr, LogicalAnd):
            return (t.__name__, walk(m.left), walk(m.right))
        if t is MultiHeadMask:
            return (t.__name__, tuple(walk(h) for h in m.masks))
        leaves.append(m)
        return ("leaf", len(leaves) - 1)

    return walk(mask), tuple(leaves)


def mask_from_spec(spec: tuple, leaves: Sequence[Mask]) -> Mask:
    """The mask described by :func:`mask_spec`'s ``(spec, leaves)``."""
    name = spec[0]
    if name == "leaf":
        return leaves[spec[1]]
    if name in ("LogicalOr", "LogicalAnd"):
        return _SPEC_CLASSES[name](mask_from_spec(spec[1], leaves), mask_from_spec(spec[2], leaves))
    if name == "MultiHeadMask":
        return MultiHeadMask([mask_from_spec(h, leaves) for h in spec[1]])
    return _SPEC_CLASSES[name](*spec[1])


_SPEC_CLASSES = {c.__name__: c for c in (CausalMask, LocalMask, ChunkedCausalMask, FullMask, LogicalOr, LogicalAnd)}


# ----------------------------------------------------------------------------------------------- tables

EMPTY, PARTIAL, FULL = 0, 1, 2


class MaskTables:
    """Block-sparse tables of one mask at one block shape (numpy; :func:`mask_tables` builds and caches them).

    Attributes (``Hm`` = 1 for a shared mask, else the head count; ``T``/``Tq`` the longest lists):
        fwd: int32 ``[3, Hm, nq, T]``: per query block ``i`` the key blocks to visit (row 0: block index,
            repeating the last listed one past the list so no DMA is issued; row 1: kind, 0 = skip,
            1 = partial, 2 = full; row 2: index into ``blocks`` for partial steps, repeating likewise).
        bwd: int32 ``[3, Hm, nk, Tq]``: the same per key block ``j`` over query blocks (dK/dV kernel).
        blocks: int8 ``[n, bq, bkv]``, the distinct element masks of partial blocks (1 = visible); at least
            one block (all zeros) so the operand is never empty. ``blocks_t``: the same transposed ``[n, bkv, bq]``.
        visible_fraction: visible pairs / Sq*Skv*Hm (reporting).
    """

    def __init__(self, fwd, bwd, blocks, blocks_t, visible_fraction, counts):
        self.fwd, self.bwd, self.blocks, self.blocks_t = fwd, bwd, blocks, blocks_t
        self.visible_fraction = visible_fraction
        self.counts = counts  # {"empty": .., "partial": .., "full": ..} blocks over heads

    @property
    def heads(self) -> int:
        return int(self.fwd.shape[1])

    @property
    def kv_steps(self) -> int:
        return int(self.fwd.shape[3])

    @property
    def q_steps(self) -> int:
        return int(self.bwd.shape[3])


def _lists(kind: np.ndarray, bidx: np.ndarray, axis_major: int):
    """Compact the non-empty blocks along the minor axis into padded lists ``[3, Hm, n_major, T]``."""
    if axis_major == 1:  # by key block: transpose to (Hm, nk, nq)
        kind, bidx = kind.transpose(0, 2, 1), bidx.transpose(0, 2, 1)
    Hm, nmaj, nmin = kind.shape
    nz = kind != EMPTY
    T = max(1, int(nz.sum(-1).max(initial=0)))
    out = np.zeros((3, Hm, nmaj, T), np.int32)
    for h in range(Hm):
        for a in range(nmaj):
            cols = np.nonzero(nz[h, a])[0]
            n = len(cols)
            last_blk = int(cols[-1]) if n else 0
            mb = [int(bidx[h, a, c]) for c in cols if kind[h, a, c] == PARTIAL]
            last_mb, cur_mb = 0, 0
            for t in range(T):
                if t < n:
                    c = int(cols[t])
                    out[0, h, a, t] = c
                    out[1, h, a, t] = kind[h, a, c]
                    if kind[h, a, c] == PARTIAL:
                        cur_mb = int(bidx[h, a, c])
                    out[2, h, a, t] = cur_mb
                    last_mb = cur_mb
                else:
                    out[0, h, a, t] = last_blk
                    out[2, h, a, t] = last_mb
            del mb
    return out


def _build(heads: tuple[Mask, ...], Sq: int, Skv: int, bq: int, bkv: int) -> MaskTables:
    nq, nk = -(-Sq // bq), -(-Skv // bkv)
    Hm = len(heads)
    kind = np.zeros((Hm, nq, nk), np.int32)
    bidx = np.zeros((Hm, nq, nk), np.int32)
    uniq: dict[bytes, int] = {}
    blocks = []
    visible = 0
    for h, m in enumerate(heads):
        for i in range(nq):
            rows = m[i * bq:min((i + 1) * bq, Sq), 0:Skv]
            visible += int(rows.sum())
            for j in range(nk):
                blk = np.zeros((bq, bkv), bool)  # positions past Sq / Skv are masked
                part = rows[:, j * bkv:min((j + 1) * bkv, Skv)]
                blk[:part.shape[0], :part.shape[1]] = part
                if not blk.any():
                    continue
                if blk.all():
                    kind[h, i, j] = FULL
                    continue
                kind[h, i, j] = PARTIAL
                key = np.packbits(blk).tobytes()
                if key not in uniq:
                    uniq[key] = len(blocks)
                    blocks.append(blk)
                bidx[h, i, j] = uniq[key]
    if not blocks:
        blocks.append(np.zeros((bq, bkv), bool))
    b = np.stack(blocks).astype(np.int8)
    counts = {n: int((kind == v).sum()) for n, v in (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}
    return MaskTables(_lists(kind, bidx, 0), _lists(kind, bidx, 1), b, np.ascontiguousarray(b.transpose(0, 2, 1)),
                      visible / max(1, Hm * Sq * Skv), counts)


@functools.lru_cache(maxsize=64)
def _cached(heads: tuple[Mask, ...], Sq: int, Skv: int, bq: int, bkv: int) -> MaskTables:
    return _build(heads, Sq, Skv, bq, bkv)


def mask_tables(mask: Mask, bq: int, bkv: int) -> MaskTables:
    """Block-sparse tables of ``mask`` for ``bq`` x ``bkv`` blocks, built once per (mask value, block shape)
    and cached (an LRU of 64 entries keyed by the mask's value: equal masks built anew each step hit it).
    Identical heads of a multi-head mask are merged into one table."""
    heads = head_masks(mask)
    if len(set(heads)) == 1:
        heads = heads[:1]
    Sq, Skv = mask.shape[-2:]
    return _cached(heads, int(Sq), int(Skv), int(bq), int(bkv))


def mask_cache_info():
    """``functools`` cache statistics of :func:`mask_tables` (hits, misses, size)."""
    return _cached.cache_info()
