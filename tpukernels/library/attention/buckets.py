"""Sequence-length buckets for :func:`flash_attention`: pad ``Sq`` / ``Skv`` to a bucket and mask the padding
with runtime data, so every length in a bucket runs one lowered program.

The bucket of a length ``n > 16`` is :func:`tpukernels.dsl.kernel.bucket` (``rows=`` kernels' rule: a multiple
of ``max(8, 2**(bit_length(n - 1) - 3))``, four buckets per power of two, at most 25% padding); lengths
``<= 16`` (decode steps, tiny prompts) are kept. Under ``torch.compile(dynamic=True)`` the dense path is the
op ``tpukernels::flash_attention_bucketed`` (CompositeImplicitAutograd), which AOT traces with symbolic lengths:
:func:`tpukernels.dsl.kernel.bucket` then builds a symbolic bucket (``torch.sym_ite``), so one graph serves
every length and each bucket's program is lowered once at run time.

How the padding is hidden (the kernel bodies are unchanged; the lowered program depends on the padded
lengths only):

* dense kernels (no ``mask=``): the padding gets a segment id that no real query has (runtime data through the
  existing ``segment_ids`` path). Without user segment ids: 0 for real positions, 1 for padding; with them:
  the padding takes :func:`absent_id` of the query ids (the smallest ``m >= 0`` no query uses, computed on
  device). Top-left alignment pads at the end; bottom-right alignment pads both sequences at the **front**, so
  ``j <= i + Skv - Sq`` (and any window anchored there) holds exactly for the true lengths.
* masked kernels (``mask=``): the mask (with ``causal`` / ``window`` folded in at the true lengths) is
  compiled into tables at the true lengths, where blocks past ``Sq`` / ``Skv`` are already masked; the tables
  are then padded to the bucket's block counts (extra blocks are skipped) and their list lengths / partial-
  block counts are bucketed too (:func:`pad_tables`), so a new length usually reuses the program.

Padded query rows see only padding (or nothing): their outputs are sliced away and their incoming gradient
is 0, so they add exactly 0 to dK / dV; dQ / dK / dV of padded positions are sliced away.
"""

from __future__ import annotations

import numpy as np
import torch

#: Lengths up to this are not bucketed (decode steps: padding Sq = 1 would multiply the query rows).
MIN_BUCKETED = 16


def bucket_len(n):
    """The bucket of a sequence length ``n`` (an int or a torch SymInt): ``n`` itself if ``n <= 16``, else
    :func:`tpukernels.dsl.kernel.bucket` (``n`` rounded up to a multiple of ``max(8, 2**(bit_length(n - 1) - 3))``)."""
    from ...dsl.kernel import bucket

    return n if n <= MIN_BUCKETED else bucket(n)


def absent_id(ids: torch.Tensor) -> torch.Tensor:
    """The smallest int ``m >= 0`` that ``ids`` does not contain (int32 0-d tensor, computed on ids' device
    without a host sync): a segment id for padding that no real query shares."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    idx = torch.where((flat >= 0) & (flat <= n), flat, torch.full_like(flat, n + 1))
    present = torch.zeros(n + 2, dtype=torch.int32, device=ids.device).scatter(0, idx, 1)
    return torch.argmin(present[: n + 1]).to(torch.int32)  # first 0: at most n values, so one of 0..n is absent


def pad_len(x: torch.Tensor, dim: int, n_pad, front: bool) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to length ``n_pad`` (at the front or the end)."""
    extra = n_pad - x.shape[dim]
    pads = [0, 0] * (x.dim() - 1 - dim) + ([extra, 0] if front else [0, extra])
    return torch.nn.functional.pad(x, pads)


def slice_len(x: torch.Tensor, dim: int, n, front: bool) -> torch.Tensor:
    """The true ``n`` positions of a padded ``x`` along ``dim``."""
    total = x.shape[dim]
    return x.narrow(dim, total - n if front else 0, n)


def pad_ids(ids: torch.Tensor, n_pad, front: bool, fill) -> torch.Tensor:
    """Segment ids ``[B, 1, S]`` padded to ``n_pad`` with ``fill`` (int or int32 0-d tensor): int32
    ``[B, 1, n_pad]``."""
    n = ids.shape[-1]
    pos = torch.arange(n_pad, device=ids.device)
    real = (pos >= n_pad - n) if front else (pos < n)
    padded = pad_len(ids, 2, n_pad, front)
    return torch.where(real, padded, torch.as_tensor(fill, dtype=torch.int32, device=ids.device)).to(torch.int32)


def _step_bucket(n: int) -> int:
    """Bucket of a table list length / partial-block count: powers of two up to 8, then the 25% rule."""
    if n <= 8:
        return 1 << max(0, (n - 1).bit_length())
    from ...dsl.kernel import bucket

    return bucket(n)


def _pad_lists(t: np.ndarray, n_major: int, T: int) -> np.ndarray:
    """``[3, Hm, a, t]`` table lists padded to ``a = n_major`` (empty lists: kind 0, block 0) and ``t = T``
    (repeating each list's last block index and mask-block index with kind 0: no DMA, no work)."""
    _, Hm, a, t0 = t.shape
    out = np.zeros((3, Hm, n_major, T), np.int32)
    out[:, :, :a, :t0] = t
    if T > t0:
        out[0, :, :a, t0:] = t[0, :, :, -1:]
        out[2, :, :a, t0:] = t[2, :, :, -1:]
    return out


def pad_tables(tables, nq_pad: int, nk_pad: int):
    """A :class:`.masks.MaskTables`' arrays for padded sequences: ``(fwd, bwd, blocks, blocks_t)`` numpy, with
    the query / key block counts ``nq_pad`` / ``nk_pad``, list lengths bucketed (capped at the block counts)
    and the partial blocks padded with all-masked blocks to a bucketed count. Exact: the added entries are
    skipped, and positions past the true lengths are masked in the true tables already."""
    T = min(_step_bucket(tables.kv_steps), max(nk_pad, tables.kv_steps))
    Tq = min(_step_bucket(tables.q_steps), max(nq_pad, tables.q_steps))
    fwd = _pad_lists(tables.fwd, nq_pad, T)
    bwd = _pad_lists(tables.bwd, nk_pad, Tq)
    n = tables.blocks.shape[0]
    nb = _step_bucket(n)
    blocks = np.zeros((nb, *tables.blocks.shape[1:]), np.int8)
    blocks[:n] = tables.blocks
    return fwd, bwd, blocks, np.ascontiguousarray(blocks.transpose(0, 2, 1))
