"""Fused linear + cross-entropy (the LM head and its loss) without materialising the ``[N, V]`` logits.

Public op::

    torch.ops.tpukernels.linear_cross_entropy(h, W, labels, ignore_index=-100, reduction="mean", softcap=None)
    tpukernels.library.linear_cross_entropy(...)                        # same, functional (differentiable)

Shapes: ``h [N, H]`` (hidden states, one row per token), ``W [V, H]`` (the ``nn.Linear`` weight of the LM
head, ``logits = h @ W^T``), ``labels [N]`` int64 or int32 in ``[0, V)`` or equal to ``ignore_index``.
``h`` and ``W`` share one dtype: bfloat16, float16 or float32. Result: float32, ``[]`` for ``"mean"`` /
``"sum"``, ``[N]`` for ``"none"`` (0 at ignored rows). No unit (nats).

What it computes (all in float32, from the stored operands)::

    s[i, v]  = h[i] . W[v]                               (MXU, f32 accumulation)
    z[i, v]  = softcap * tanh(s[i, v] / softcap)          (only with softcap, Gemma-2 style)
    lse[i]   = log sum_v exp(z[i, v])                      (natural log)
    loss[i]  = lse[i] - z[i, labels[i]]   if labels[i] != ignore_index   else 0
    "mean": sum_i loss[i] / #{i : labels[i] != ignore_index}   (NaN when every row is ignored, as torch)
    "sum":  sum_i loss[i]

i.e. ``torch.nn.functional.cross_entropy(softcap(h.float() @ W.float().T), labels, ignore_index=...,
reduction=...)``. Gradients, with ``p = softmax(z)``, ``g[i]`` the incoming gradient of ``loss[i]``
(zero at ignored rows; ``1/n_valid`` times the upstream scalar for "mean")::

    dz = g[:, None] * (p - onehot(labels))      ds = dz * (1 - (z / softcap)^2)   (softcap only)
    dh = ds @ W            dW = ds^T @ h

Algorithm. Four Pallas TPU kernel ops, all with the full hidden size ``H`` in one block (so ``H`` needs no
tail handling and the ``h`` block stays in VMEM while the vocabulary streams past it):

==========================================================  ================  ====================================
op                                                          grid (inner last)  does
==========================================================  ================  ====================================
``tpukernels::linear_cross_entropy_fwd(h, w, labels)``      ``(N/bn, V/bv)``  online logsumexp over V blocks (f32
                                                                              running max / sum / target logit in
                                                                              VMEM scratch) -> ``loss``, ``lse [N,2]``
                                                                              (the pair below)
``tpukernels::linear_cross_entropy_fwd_dh(h, w, labels,``   ``(N/bn, V/bv)``  the same, plus ``dh``: an f32 ``(bn,
``wy, g)``                                                                    H)`` accumulator ``sum_j exp(z_j - m)
                                                                              c_j W_j`` rescaled by ``exp(m_old -
                                                                              m_new)`` (flash attention's output
                                                                              with ``Q = h``, ``K = V = W``); last
                                                                              step: ``dh = g (acc / l - c_y W[y])``
``tpukernels::linear_cross_entropy_bwd_dw(...)``            ``(V/bv, N/bn)``  recompute ``s`` per block, ``dW +=
                                                                              ds^T @ h_blk`` (f32 (bv, H) in VMEM)
``tpukernels::linear_cross_entropy_bwd_dh(...)``            ``(N/bn, V/bv)``  recompute ``s``, ``dh += ds @ W_blk``
                                                                              (kept for the kernel op's own backward)
==========================================================  ================  ====================================

The public op, when ``h`` requires grad (and grad mode is on), runs ``fwd_dh`` (gradient in the forward, as
Liger-Kernel's ``fused_linear_cross_entropy`` does) with the reduction's per-row weight ``g`` (``1/n_valid``
for "mean", else 1; 0 at ignored rows), so ``dh`` is final for an upstream gradient of 1 and the backward
only scales it; ``dW`` is ``bwd_dw`` with ``g * upstream``. ``W[labels]`` (``wy``, gathered by the caller)
stays in HBM (``pl.ANY``) and is copied by DMA into the ``dh`` output block during the last V step. Work:
``fwd_dh`` 4 ``N V H`` + ``bwd_dw`` 4 = 8 ``N V H`` FLOPs (one recompute of the logits) against 6 for the
unfused version and 10 for ``fwd`` + ``bwd_dh`` + ``bwd_dw`` (the previous backward). Why not one fused
backward kernel making ``dh`` and ``dW`` from one tile: one of the two would accumulate across the outer grid
axis, i.e. in HBM (read-modify-write of f32 blocks, ``N/bn * V * H * 8`` bytes = 34 GB at the Llama-3-8B head
with ``bn = 1024``); ``fwd_dh`` keeps both accumulations in VMEM. Without grad (or when only ``W`` needs it)
the plain ``fwd`` runs (``dW`` then by ``bwd_dw``).

Memory: the largest intermediate is one ``(bn, bv)`` f32 tile and the ``(bn, H)`` f32 accumulator in VMEM;
in HBM ``O(N)`` (``lse``, the per-row loss) plus, while ``fwd_dh`` runs, ``wy [N, H]`` and the ``dh`` output,
instead of the ``O(N V)`` logits (2 GiB of bf16 logits + 4 GiB of f32 log-probs at Llama-3-8B ``N = 8192,
V = 128256`` in the unfused ``F.cross_entropy(h @ W.T)``). Liger-Kernel (``src/liger_kernel/ops/
fused_linear_cross_entropy.py``) instead chunks over tokens and materialises ``[chunk, V]``; this file follows
the vocabulary-chunked online-softmax scheme of FlashAttention-2 (Dao, arXiv:2307.08691) applied to the LM
head (as in Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", arXiv:2411.09009).

Strategies (``chunk_rows``). The default (``chunk_rows=None``) is the fused scheme above. ``chunk_rows=c``
selects the chunked scheme of Liger-Kernel (there the chunk is ``~N H / V`` rows, not a public argument) and
tokamax's ``chunked_xla``: per chunk of ``c`` rows

* ``tpukernels::linear_cross_entropy_fwd_s(h_c, w, labels_c)``, grid ``(c/bn, V/bv)``: the forward
  (:func:`linear_cross_entropy_fwd`) that also writes the raw f32 logits ``s [c, V]`` to HBM;
* ``tpukernels::linear_cross_entropy_dh_s(s, w, ...)``, grid ``(c/bn, V/bv)``: ``dh_c = ds @ W``, ``ds`` from the
  stored ``s`` (no recompute);
* ``tpukernels::linear_cross_entropy_dw_s(s, h_c, ...)`` (first chunk) / ``..._dw_s_acc(s, h_c, ..., dw)``, grid
  ``(V/bv, c/bn)``: ``dW (+)= ds^T @ h_c`` into an f32 ``[V, H]`` accumulator (aliased: in place under Mosaic);

i.e. ``6 N V H`` FLOPs in all (no recompute), all in the forward when the reduction sums the rows ("mean",
"sum"; the backward scales ``dh`` and ``dW``); with ``reduction="none"`` the per-row upstream gradients cannot
scale a summed ``dW``, so the backward recomputes the logits for it (8 N V H). The softmax, lse, loss and
``ds`` are computed inside the Pallas kernels (no separate row pass over ``s``): ``fwd_s`` makes the lse pair
while ``s`` is in VMEM, and ``dh_s`` / ``dw_s`` form ``ds`` from each ``s`` tile they load, so ``s`` is written
once and read twice (12 bytes per logit) and never rewritten as ``ds``. Price: temporary HBM ``c * V * 4``
bytes (``s``) plus the f32 ``dW`` accumulator (``V * H * 4``: 2 GiB at the Llama-3-8B head, a third of the
unfused version's 6 GiB of temporaries) and ``N / c`` read-modify-write passes over it (``8 V H`` bytes
each), and the saved ``dW`` (``W``'s dtype) lives from the forward to the backward. Values agree with the
fused strategy to float32 rounding (``ds`` from the same f32 logits and the same ``(hi, lo)`` lse pair);
without gradients both run ``fwd``. Model (libtpu 0.0.52 static estimates, Llama-3-8B head, forward +
backward; module :mod:`tpukernels.bench.linear_cross_entropy`): the chunked strategy is **slower** than the
fused one on v6e and tpu7x at every chunk size estimated, so the default stays fused (figures in the bench
family's reasons): its kernels reach only 60-75% of the MXU, and libtpu charges the ``dW`` read-modify-write
in full on top of the ``dW`` matmul (v6e, ``c = 1024``: ``dw_s_acc`` 4.40 ms per chunk against 1.57 ms for
``dw_s`` without the accumulator). v6e forward + backward: chunked ``c = 1024`` 60.7 ms, ``c = 2048`` 58.7 ms,
fused 42.8 ms, XLA unfused 34.2 ms; temporary HBM (XLA's memory analysis of the chunk loop) 2513 MiB at
``c = 1024``, 3022 MiB at ``c = 2048``, fused 128 MiB, XLA unfused 6012 MiB. It stays as the user's
alternative (and to measure on a device, where the model's two weak points above may not hold); the issue's
target (>= 0.95x XLA at >= 40x less temporary
memory) is out of reach for any row-chunked scheme with an f32 ``dW`` (its accumulator alone is a third of
XLA's temporaries). ``softmax``/``ds`` inside the kernels rather than a row kernel or XLA pass between them:
such a pass would read ``s`` once more and write ``ds`` (6 more bytes per logit, 6.3 GB = 3.8 ms on v6e at
this head) for nothing the matmul kernels cannot do on their loaded tile.

Tails. A partial last V block reads undefined ``W`` rows (NaN in ``interpret="tpu"``): the forward sets
those logit columns to ``-inf`` with ``jnp.where`` before the logsumexp (``fwd_dh`` also zeroes those ``W``
rows, only in its last V step), ``bwd_dh`` zeroes them (``ds``
and the ``W`` rows, both with ``jnp.where``) before contracting over V; ``bwd_dw``'s rows past V are
dropped (``fwd_s`` drops its ``s`` columns past V on write; ``dh_s`` / ``dw_s`` mask ``ds`` there and
``dh_s`` the ``W`` rows, as ``bwd_dh``). A partial last N block: forward / ``bwd_dh`` rows past N are dropped on
write; ``bwd_dw`` (which
reduces over N) zeroes ``ds`` and ``h`` there. ``H`` is whole, so never a tail.

Large logits. ``lse`` leaves the forward as an unevaluated f32 pair ``[N, 2] = (hi, lo)``, ``hi = fl(m + log
l)`` and ``lo`` its rounding error (TwoSum), and the backward forms ``p = exp((z - hi) - lo)`` from logits it
recomputes bit for bit (same dot over the whole ``H``). With one f32 ``lse`` at logits ~6e3 (ulp 4.9e-4),
``p`` of a row's top logit (~1) was off by up to 2.4e-4, so ``ds = p - 1`` and ``dW = ds^T h`` carried
``2.4e-4 |h|`` per row: dW 0.87 off where torch's f32 unfused softmax is 0.0034 (issue 36 item 5). Now ``z -
hi`` is exact near the top (Sterbenz) and dW is as accurate as the unfused f32 path (tested against float64 at
logits ~6e3, within 3x of its error); the loss is ``(hi - z_y) + lo`` the same way. What remains is the f32
rounding of the logits themselves, which the unfused path has too.

float16: Mosaic (libtpu 0.0.52) rejects float16 kernel operands on v5e/v6e/tpu7x, so the public op widens
float16 ``h``/``W`` to float32 (exact) and rounds the gradients back. float32 operands contract with
``precision=HIGHEST``; bfloat16 ``ds`` is rounded to bfloat16 before the gradient matmuls (as flash
attention's backward does with ``dP``).

Tunables: ``bn`` (rows per block) and ``bv`` (vocabulary per block), per kernel; clamped to the problem (a
dim no larger than the block is taken whole). The chunked strategy's kernels (``fwd_s``, ``dh_s``, ``dw_s``,
``dw_s_acc``) have no shipped entries: their heuristic takes the first of ``_S_CANDIDATES`` (ranked by libtpu
estimates for one 1024-row chunk on v6e; smaller blocks on 64 MiB-VMEM chips) that fits the VMEM target. The
chunk size itself is the caller's ``chunk_rows`` (no per-chip default: the fused strategy is the default on
every chip, see "Strategies"). Defaults of the fused kernels: :func:`heuristic` (the largest blocks whose VMEM
estimate fits 40 MiB), then per-chip tuning data in ``tpukernels/data/autotuning/<chip>/`` chosen by the
autotuner's tpu-model evaluator (libtpu static estimates: a model, not measurements) at the Llama-3-8B LM
head (``H = 4096, V = 128256, N = 8192``, :data:`STANDARD_CASES`), written by::

    tpukernels autotune linear_cross_entropy_fwd --chip v5e,v6e,tpu7x --shape 8192x4096:bf16 \\
        --shape 128256x4096:bf16 --shape 8192x1:i32 --static ignore_index=-100 --strategy exhaustive \\
        --values bn=512,1024,2048 --values bv=256,512,1024 --workers 2 --write-db shipped
    # bwd_dh / bwd_dw: the same with two more shapes (lse pair, g), --shape 8192x2:f32 --shape 8192x1:f32
    # fwd_dh: --shape 8192x4096:bf16 --shape 8192x1:f32 after the first three (wy, g)

Model results of the sweeps (libtpu 0.0.52 static estimate on a 16-step reduced grid + roofline, not
measurements; re-swept with only candidates that libtpu could estimate ranked, since a candidate without an
estimate gets the roofline-only model time and would win by default): forward ``bn=bv=1024`` on every chip:
v5e 47.1 ms (93% of the MXU roofline), v6e 12.4 ms (76%); ``bwd_dh`` ``bn=512, bv=1024``: v6e 23.2 ms (81%),
tpu7x 18.4 ms (81%); ``bwd_dw`` ``bn=1024, bv=512``: v5e 93.6 ms (93%), v6e 22.8 ms (82%), tpu7x 18.1 ms
(83%); ``fwd_dh`` ``bn=512, bv=1024`` (of ``512 x {512, 1024}`` and ``1024 x 512``, the last over tpu7x's
VMEM): v5e 92.9 ms (94%), v6e 22.8 ms (82%), tpu7x 17.9 ms (83%) for its ``4 N V H``. tpu7x forward:
libtpu's static-profile compile runs out of the 64 MiB VMEM (101 MiB asked at ``bn=bv=1024``) for every
``bn * bv >= 1024 * 256``, so it ships ``bn=bv=512`` (12.5 ms, 60%; ``bn=1024, bv=128``: 32.2 ms), the
fastest config it can estimate. v5e ``bwd_dh`` is taken from v6e's sweep (libtpu's profiler aborts for
``bv >= 512``; ``bv=256`` reads 108.8 ms, 80%, while on v6e ``bv=1024`` beats ``bv=256`` 81% to 57%).
Benchmarks against XLA's unfused version: ``tpukernels bench --family
linear_cross_entropy`` (:mod:`tpukernels.bench.linear_cross_entropy`).

Validation (typed errors before any kernel runs): ranks and shapes, dtypes (float64 / integer operands,
mixed ``h``/``W`` dtypes, non-integer labels), devices (``h``, ``W``, ``labels`` on one device), reduction,
softcap (positive, finite), and the label range (``0 <= label < V`` or ``== ignore_index``), the last
checked on cpu tensors outside tracing (on device tensors it would force a host sync; under
``torch.compile`` values are unknown) — an out-of-range label there gives ``loss = lse`` for that row.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .. import dsl as _dsl
from ..dsl.validate import padded_bytes
from ..errors import ArgumentError, DeviceError, DTypeError

NAMESPACE = "tpukernels"
REDUCTIONS = ("mean", "sum", "none")
KERNEL_DTYPES = ("bfloat16", "float32")
PUBLIC_DTYPES = ("bfloat16", "float16", "float32")
LABEL_DTYPES = (torch.int64, torch.int32)
MiB = 1 << 20
#: VMEM the heuristic aims for on chips with >= 64 MiB (launches raise the scoped limit); smaller chips (v4:
#: 16 MiB) get what fits under :func:`tpukernels.library.vmem.vmem_cap` (see :func:`_heuristic`).
VMEM_TARGET = 40 * MiB

TUNABLES = {
    "bn": _dsl.Tunable([512, 128, 256, 1024, 2048], default=512, doc="token rows per block (N)"),
    "bv": _dsl.Tunable([512, 128, 256, 1024, 2048], default=512, doc="vocabulary entries per block (V)"),
}


def _dt(x) -> str:
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    return np.dtype(x.dtype).name


def _clamp(dim: int, block: int) -> int:
    return dim if 0 < dim <= block else block


# ----------------------------------------------------------------------------------------------- kernel bodies
def _logits(h, w, precision):
    """``h [bn, H] . w [bv, H]^T`` in f32 (contract the stored layouts; no transpose)."""
    import jax
    import jax.numpy as jnp

    return jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _capped(s, softcap):
    """``(z, t)``: soft-capped logits and ``t = tanh(s / softcap)`` (None without softcap)."""
    import jax.numpy as jnp

    if softcap is None:
        return s, None
    t = jnp.tanh(s / softcap)
    return softcap * t, t


def _lse_pair(m, l):
    """``lse = m + log(l)`` as an unevaluated f32 pair ``(hi, lo)`` (Knuth's TwoSum: ``hi = fl(m + log l)``,
    ``lo`` its exact rounding error), both ``(bn, 1)``. At logits ~6e3 one f32 ``lse`` is off by up to half an
    ulp (2.4e-4), and the backward's ``p = exp(z - lse)`` of the top logit, ~1, by as much: ``dW`` gains
    ``2.4e-4 |h|`` per row. ``(z - hi) - lo`` is exact to f32 rounding of the small difference instead."""
    import jax.numpy as jnp

    r = jnp.log(l)
    hi = m + r
    b = hi - m
    lo = (m - (hi - b)) + (r - b)
    return hi, lo


def _store_pair(ref, hi, lo):
    """Write ``(hi, lo)`` ``(bn, 1)`` columns into a ``(bn, 2)`` block (a select on a lane iota)."""
    import jax
    import jax.numpy as jnp

    col = jax.lax.broadcasted_iota(jnp.int32, ref.shape, 1)
    ref[...] = jnp.where(col == 0, hi, lo)


def _load_pair(ref):
    """``(hi, lo)`` ``(bn, 1)`` columns of a ``(bn, 2)`` block (see :func:`_store_pair`)."""
    import jax
    import jax.numpy as jnp

    x = ref[...]
    col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return (jnp.sum(jnp.where(col == 0, x, 0.0), axis=1, keepdims=True),
            jnp.sum(jnp.where(col == 1, x, 0.0), axis=1, keepdims=True))


def _fwd_body(h_ref, w_ref, y_ref, loss_ref, lse_ref, m_sc, l_sc, t_sc, *, n_v, v_size, bv, softcap, ignore_index,
              precision):
    """One (bn rows, bv vocab) step of the online logsumexp; the running max ``m``, sum ``l`` and target
    logit ``t`` live in (bn, 1) f32 scratch across the V axis (grid axis 1, innermost)."""
    _fwd_step(h_ref, w_ref, y_ref, loss_ref, lse_ref, None, m_sc, l_sc, t_sc, n_v=n_v, v_size=v_size, bv=bv,
              softcap=softcap, ignore_index=ignore_index, precision=precision)


def _fwd_s_body(h_ref, w_ref, y_ref, loss_ref, lse_ref, s_ref, m_sc, l_sc, t_sc, *, n_v, v_size, bv, softcap,
                ignore_index, precision):
    """:func:`_fwd_body` that also stores the raw f32 logits tile ``s = h W^T`` (before the soft-cap) into the
    ``[N, V]`` output ``s`` (the chunked strategy's logits in HBM; columns past V are dropped on write)."""
    _fwd_step(h_ref, w_ref, y_ref, loss_ref, lse_ref, s_ref, m_sc, l_sc, t_sc, n_v=n_v, v_size=v_size, bv=bv,
              softcap=softcap, ignore_index=ignore_index, precision=precision)


def _fwd_step(h_ref, w_ref, y_ref, loss_ref, lse_ref, s_ref, m_sc, l_sc, t_sc, *, n_v, v_size, bv, softcap,
              ignore_index, precision):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        t_sc[...] = jnp.zeros(t_sc.shape, jnp.float32)

    raw = _logits(h_ref[...], w_ref[...], precision)
    if s_ref is not None:
        s_ref[...] = raw
    z, _ = _capped(raw, softcap)
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    if v_size % bv:  # V tail: undefined W rows -> -inf logits (jnp.where: the padding may be NaN)
        z = jnp.where(col < v_size, z, -jnp.inf)
    y = y_ref[...]  # (bn, 1) int32
    t_sc[...] += jnp.sum(jnp.where(col == y, z, 0.0), axis=1, keepdims=True)
    m_old = m_sc[...]
    m_new = jnp.maximum(m_old, jnp.max(z, axis=1, keepdims=True))
    l_sc[...] = l_sc[...] * jnp.exp(m_old - m_new) + jnp.sum(jnp.exp(z - m_new), axis=1, keepdims=True)
    m_sc[...] = m_new

    @pl.when(j == n_v - 1)
    def _end():
        hi, lo = _lse_pair(m_sc[...], l_sc[...])
        loss_ref[...] = jnp.where(y != ignore_index, (hi - t_sc[...]) + lo, 0.0)
        _store_pair(lse_ref, hi, lo)


def _fwd_dh_body(h_ref, w_ref, y_ref, wy_hbm, g_ref, loss_ref, lse_ref, dh_ref, m_sc, l_sc, t_sc, acc_sc, sem, *,
                 n_v, v_size, bv, n_size, bn, softcap, ignore_index, precision):
    """Forward with ``dh`` (gradient in the forward): the online logsumexp of :func:`_fwd_body` plus, as flash
    attention's output, ``acc = sum_j exp(z_j - m) c_j W_j`` rescaled by ``exp(m_old - m_new)`` whenever the
    running max moves (``c = 1 - tanh^2`` with softcap, else 1). Last V step: ``dh = g * (acc / l - c_y W[y])``
    with ``W[y]`` (gathered rows, ``wy`` in HBM) copied by DMA into the ``dh`` output block, and
    ``loss = g * (lse - z_y)``; both 0 at ignored rows. Grid ``(N/bn, V/bv)``, V innermost."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    i, j = pl.program_id(0), pl.program_id(1)
    def _wy_copy(rows):
        return pltpu.make_async_copy(wy_hbm.at[pl.ds(i * bn, rows)], dh_ref.at[pl.ds(0, rows)], sem.at[0])

    n_last = n_size - (-(-n_size // bn) - 1) * bn  # rows of the last N block (static)
    last_i = -(-n_size // bn) - 1

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        t_sc[...] = jnp.zeros(t_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    # W[y] rows for the epilogue: fetched during the last V step (the dh block is free until then)
    @pl.when(jnp.logical_and(j == n_v - 1, i != last_i))
    def _fetch():
        _wy_copy(bn).start()

    @pl.when(jnp.logical_and(j == n_v - 1, i == last_i))
    def _fetch_tail():
        _wy_copy(n_last).start()

    y = y_ref[...]  # (bn, 1) int32

    def step(tail: bool):
        w = w_ref[...]
        z, tt = _capped(_logits(h_ref[...], w, precision), softcap)
        col = j * bv + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
        if tail:  # V tail: undefined W rows -> -inf logits, and zero rows for the p @ W contraction
            z = jnp.where(col < v_size, z, -jnp.inf)
            w = _dsl.mask_tail(w, 0, j * bv, v_size)
        t_sc[...] += jnp.sum(jnp.where(col == y, z, 0.0), axis=1, keepdims=True)
        m_old = m_sc[...]
        m_new = jnp.maximum(m_old, jnp.max(z, axis=1, keepdims=True))
        alpha = jnp.exp(m_old - m_new)
        p = jnp.exp(z - m_new)
        l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        if tt is not None:
            p = p * (1.0 - tt * tt)
            if tail:  # tanh of an undefined logit may be NaN, and 0 * NaN is NaN
                p = jnp.where(col < v_size, p, 0.0)
        acc_sc[...] = acc_sc[...] * alpha + jax.lax.dot_general(
            p.astype(w.dtype), w, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)

    if v_size % bv:  # the masks only in the last V step (a select over the (bv, H) W block costs ~10%)
        pl.when(j < n_v - 1)(lambda: step(False))
        pl.when(j == n_v - 1)(lambda: step(True))
    else:
        step(False)

    @pl.when(j == n_v - 1)
    def _end():
        @pl.when(i != last_i)
        def _wait():
            _wy_copy(bn).wait()

        @pl.when(i == last_i)
        def _wait_tail():
            _wy_copy(n_last).wait()

        hi, lo = _lse_pair(m_sc[...], l_sc[...])
        t = t_sc[...]
        valid = y != ignore_index
        g = g_ref[...]
        loss_ref[...] = jnp.where(valid, g * ((hi - t) + lo), 0.0)
        _store_pair(lse_ref, hi, lo)
        cy = 1.0 if softcap is None else 1.0 - (t / softcap) ** 2
        wy = dh_ref[...].astype(jnp.float32)  # rows past N (last block) are undefined and dropped on write
        d = acc_sc[...] * (1.0 / l_sc[...]) - cy * wy
        dh_ref[...] = jnp.where(valid, g * d, 0.0).astype(dh_ref.dtype)


def _dz(h, w, y, lse, g, j, *, precision, **kw):
    """``ds [bn, bv]`` f32 of one block from recomputed logits (:func:`_ds`)."""
    return _ds(_logits(h, w, precision), y, lse, g, j, **kw)


def _ds(s, y, lse, g, j, *, bv, v_size, softcap, ignore_index):
    """``ds [bn, bv]`` f32 of one block of raw logits ``s`` (module docstring), 0 at ignored rows and at
    columns past V. ``lse`` is the ``(hi, lo)`` pair of :func:`_lse_pair`: ``z - hi`` is exact where ``z`` is
    near ``lse`` (Sterbenz), so ``p`` of the top logits is as accurate as the unfused softmax's (the logits
    recomputed bit for bit, or stored by :func:`_fwd_s_body`)."""
    import jax
    import jax.numpy as jnp

    z, t = _capped(s, softcap)
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    hi, lo = lse
    p = jnp.exp((z - hi) - lo)
    gz = jnp.where(y != ignore_index, g, 0.0)  # (bn, 1)
    ds = gz * (p - jnp.where(col == y, 1.0, 0.0))
    if t is not None:
        ds = ds * (1.0 - t * t)
    if v_size % bv:
        ds = jnp.where(col < v_size, ds, 0.0)
    return ds


def _dh_body(h_ref, w_ref, y_ref, lse_ref, g_ref, dh_ref, acc_ref, *, n_v, v_size, bv, softcap, ignore_index,
             precision):
    """``dh[i] = sum_j ds[i, j] @ W[j]``; grid ``(N/bn, V/bv)``, V innermost, f32 accumulator (bn, H)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    j = pl.program_id(1)
    w = w_ref[...]
    ds = _dz(h_ref[...], w, y_ref[...], _load_pair(lse_ref), g_ref[...], j, bv=bv, v_size=v_size, softcap=softcap,
             ignore_index=ignore_index, precision=precision)
    if v_size % bv:  # undefined W rows: ds is 0 there, but 0 * NaN is NaN
        w = _dsl.mask_tail(w, 0, j * bv, v_size)
    d = jax.lax.dot_general(ds.astype(w.dtype), w, (((1,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    if n_v == 1:
        dh_ref[...] = d.astype(dh_ref.dtype)
        return

    @pl.when(j == 0)
    def _first():
        acc_ref[...] = d

    @pl.when(jnp.logical_and(j > 0, j < n_v - 1))
    def _mid():
        acc_ref[...] += d

    @pl.when(j == n_v - 1)
    def _last():
        dh_ref[...] = (acc_ref[...] + d).astype(dh_ref.dtype)


def _dw_body(h_ref, w_ref, y_ref, lse_ref, g_ref, dw_ref, acc_ref, *, n_n, n_size, bn, v_size, bv, softcap,
             ignore_index, precision):
    """``dW[j] = sum_i ds[i, j]^T @ h[i]``; grid ``(V/bv, N/bn)``, N innermost, f32 accumulator (bv, H)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    j, i = pl.program_id(0), pl.program_id(1)
    h = h_ref[...]
    ds = _dz(h, w_ref[...], y_ref[...], _load_pair(lse_ref), g_ref[...], j, bv=bv, v_size=v_size, softcap=softcap,
             ignore_index=ignore_index, precision=precision)
    if n_size % bn:  # N tail: this kernel reduces over rows, so undefined rows must be zeros in ds and h
        ds = _dsl.mask_tail(ds, 0, i * bn, n_size)
        h = _dsl.mask_tail(h, 0, i * bn, n_size)
    d = jax.lax.dot_general(ds.astype(h.dtype), h, (((0,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    if n_n == 1:
        dw_ref[...] = d.astype(dw_ref.dtype)
        return

    @pl.when(i == 0)
    def _first():
        acc_ref[...] = d

    @pl.when(jnp.logical_and(i > 0, i < n_n - 1))
    def _mid():
        acc_ref[...] += d

    @pl.when(i == n_n - 1)
    def _last():
        dw_ref[...] = (acc_ref[...] + d).astype(dw_ref.dtype)


def _dh_s_body(s_ref, w_ref, y_ref, lse_ref, g_ref, dh_ref, acc_ref, *, n_v, v_size, bv, softcap, ignore_index,
               precision):
    """Chunked strategy: ``dh[i] = sum_j ds[i, j] @ W[j]`` with ``ds`` from the stored logits ``s`` (no
    recompute); grid ``(N/bn, V/bv)``, V innermost, f32 accumulator (bn, H)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    j = pl.program_id(1)
    w = w_ref[...]
    ds = _ds(s_ref[...], y_ref[...], _load_pair(lse_ref), g_ref[...], j, bv=bv, v_size=v_size, softcap=softcap,
             ignore_index=ignore_index)
    if v_size % bv:  # undefined W rows: ds is 0 there, but 0 * NaN is NaN
        w = _dsl.mask_tail(w, 0, j * bv, v_size)
    d = jax.lax.dot_general(ds.astype(w.dtype), w, (((1,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    if n_v == 1:
        dh_ref[...] = d.astype(dh_ref.dtype)
        return

    @pl.when(j == 0)
    def _first():
        acc_ref[...] = d

    @pl.when(jnp.logical_and(j > 0, j < n_v - 1))
    def _mid():
        acc_ref[...] += d

    @pl.when(j == n_v - 1)
    def _last():
        dh_ref[...] = (acc_ref[...] + d).astype(dh_ref.dtype)


def _dw_s_body(s_ref, h_ref, y_ref, lse_ref, g_ref, *refs, n_size, bn, v_size, bv, softcap, ignore_index,
               precision):
    """Chunked strategy: ``dW[j] (+)= sum_i ds[i, j]^T @ h[i]`` with ``ds`` from the stored logits ``s``;
    grid ``(V/bv, N/bn)``, N innermost, summed in the f32 output block (resident across the N axis). With
    an accumulator input (``refs = (dw_in, dw)``, aliased) the first N step adds this chunk's sum to it."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    dwin_ref, dw_ref = refs if len(refs) == 2 else (None, refs[0])
    j, i = pl.program_id(0), pl.program_id(1)
    h = h_ref[...]
    ds = _ds(s_ref[...], y_ref[...], _load_pair(lse_ref), g_ref[...], j, bv=bv, v_size=v_size, softcap=softcap,
             ignore_index=ignore_index)
    if n_size % bn:  # N tail: this kernel reduces over rows, so undefined rows must be zeros in ds and h
        ds = _dsl.mask_tail(ds, 0, i * bn, n_size)
        h = _dsl.mask_tail(h, 0, i * bn, n_size)
    d = jax.lax.dot_general(ds.astype(h.dtype), h, (((0,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)

    @pl.when(i == 0)
    def _first():
        dw_ref[...] = d if dwin_ref is None else dwin_ref[...] + d

    @pl.when(i > 0)
    def _rest():
        dw_ref[...] += d


# ----------------------------------------------------------------------------------------------- checks + launch
def _check_kernel_args(h, w, labels, lse=None, g=None, *, where: str, wy=None):
    """Shapes/dtypes of a kernel call. Returns ``(N, V, H)``.

    Raises:
        ArgumentError: ranks, ``H`` mismatch, per-row tensors not ``[N, 1]``, ``V == 0``, ``H == 0``.
        DTypeError: ``h``/``w`` not one of bfloat16/float32 or different; labels not int32; lse/g not float32.
        (Shapes: ``labels``, ``g`` ``[N, 1]``; ``lse`` ``[N, 2]``.)
    """
    for x, n in ((h, "h"), (w, "w")):
        if len(x.shape) != 2:
            raise ArgumentError(f"{where}: {n} must be 2-D, got shape {tuple(x.shape)}")
    N, H = h.shape
    V = w.shape[0]
    if w.shape[1] != H:
        raise ArgumentError(f"{where}: w {tuple(w.shape)} must be [V, H] with H = h.shape[1] = {H}")
    if V == 0 or H == 0:
        raise ArgumentError(f"{where}: V and H must be positive, got V = {V}, H = {H}")
    if _dt(h) != _dt(w):
        raise DTypeError(f"{where}: h is {_dt(h)} but w is {_dt(w)}; use one dtype")
    if _dt(h) not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: h dtype {_dt(h)} is not supported by the kernel; use {KERNEL_DTYPES} "
                         f"(tpukernels::linear_cross_entropy widens float16)")
    if wy is not None and (tuple(wy.shape) != (N, H) or _dt(wy) != _dt(h)):
        raise ArgumentError(f"{where}: wy must be [N, H] = ({N}, {H}) {_dt(h)} (the rows W[labels]), got "
                            f"{tuple(wy.shape)} {_dt(wy)}")
    for x, n, dt, c in ((labels, "labels", "int32", 1), (lse, "lse", "float32", 2), (g, "g", "float32", 1)):
        if x is None:
            continue
        if tuple(x.shape) != (N, c):
            raise ArgumentError(f"{where}: {n} must have shape [N, {c}] = ({N}, {c}), got {tuple(x.shape)}"
                                + (" (the (hi, lo) pair the forward returns)" if n == "lse" else ""))
        if _dt(x) != dt:
            raise DTypeError(f"{where}: {n} must be {dt}, got {_dt(x)}")
    return int(N), int(V), int(H)


def vmem_bytes(kind: str, bn: int, bv: int, H: int, dtype, out_dtype=None) -> int:
    """tpukernels' VMEM estimate of one launch (double-buffered blocks, scratch, ~4 f32 (bn, bv) temporaries)."""
    rows = 4 * padded_bytes((bn, 2), "float32")  # labels / lse / g / loss columns (lane-padded)
    tiles = 4 * bn * bv * 4
    if kind == "fwd":
        return 2 * (padded_bytes((bn, H), dtype) + padded_bytes((bv, H), dtype)) + 2 * rows + tiles
    if kind == "fwd_dh":  # + the dh output block (double-buffered), the f32 acc and the f32 (bn, H) p @ W result
        return (2 * (2 * padded_bytes((bn, H), dtype) + padded_bytes((bv, H), dtype)) + 2 * rows + tiles
                + 2 * padded_bytes((bn, H), "float32"))
    out = padded_bytes((bn if kind == "dh" else bv, H), out_dtype or dtype)
    acc = padded_bytes((bn if kind == "dh" else bv, H), "float32")
    return 2 * (padded_bytes((bn, H), dtype) + padded_bytes((bv, H), dtype) + out) + 2 * rows + acc + tiles


def _limit(need: int) -> int | None:
    """Scoped VMEM to request: above the smallest default (16 MiB) ask for need * 1.25 + 4 MiB, at least 32 MiB,
    at most 64 MiB and :func:`~tpukernels.library.vmem.vmem_cap` of the launch chip (v4: 14 MiB)."""
    from .vmem import DEFAULT_SCOPED_VMEM, vmem_cap

    if need + 4 * MiB <= 16 * MiB:
        return None
    limit = min(64 * MiB, vmem_cap(), max(32 * MiB, -(-(need * 5 // 4 + 4 * MiB) // MiB) * MiB))
    return None if limit <= DEFAULT_SCOPED_VMEM else limit  # v4: its 16 MiB default is all there is


def _cost(N, V, H, itemsize, matmuls: int, passes_w: int, passes_h: int):
    import jax.experimental.pallas as pl

    return pl.CostEstimate(flops=2 * matmuls * N * V * H, transcendentals=N * V,
                           bytes_accessed=int(itemsize * (passes_w * V * H + passes_h * N * H)))


def _statics(h, softcap):
    from jax import lax

    return dict(softcap=None if softcap is None else float(softcap),
                precision=lax.Precision.HIGHEST if _dt(h) == "float32" else None)


def _heuristic(kind: str):
    def heur(h, w, labels, *rest, **statics):
        from .vmem import vmem_cap

        N, V, H = _check_kernel_args(h, w, labels, where=f"tpukernels::linear_cross_entropy_{kind}")
        target = min(VMEM_TARGET, (vmem_cap() - 4 * MiB) * 4 // 5)  # so that _limit(need) covers need
        for bn, bv in ((1024, 1024), (1024, 512), (512, 512), (512, 256), (256, 256), (256, 128), (128, 128)):
            if vmem_bytes(kind, _clamp(N, bn), _clamp(V, bv), H, h.dtype) <= target:
                return dict(bn=bn, bv=bv)
        return dict(bn=128, bv=128)

    return heur


def _row_specs(bn, index, *widths):
    """``(bn, w)`` blocks of per-row columns: labels, g, loss ``w = 1``; the lse pair ``w = 2``."""
    from jax.experimental import pallas as pl

    return [pl.BlockSpec((bn, w), index) for w in widths]


def _fwd_out(h, w, labels, ignore_index=-100, softcap=None):
    N, V, H = _check_kernel_args(h, w, labels, where="tpukernels::linear_cross_entropy_fwd")
    return (_dsl.OutSpec((N, 1), np.float32), _dsl.OutSpec((N, 2), np.float32))


def _fwd_dh_out(h, w, labels, wy, g, ignore_index=-100, softcap=None):
    _check_kernel_args(h, w, labels, g=g, wy=wy, where="tpukernels::linear_cross_entropy_fwd_dh")
    return (_dsl.OutSpec((h.shape[0], 1), np.float32), _dsl.OutSpec((h.shape[0], 2), np.float32),
            _dsl.OutSpec(tuple(h.shape), h.dtype))


def _dh_out(h, w, labels, lse, g, ignore_index=-100, softcap=None):
    _check_kernel_args(h, w, labels, lse, g, where="tpukernels::linear_cross_entropy_bwd_dh")
    return _dsl.OutSpec(tuple(h.shape), h.dtype)


def _dw_out(h, w, labels, lse, g, ignore_index=-100, softcap=None):
    _check_kernel_args(h, w, labels, lse, g, where="tpukernels::linear_cross_entropy_bwd_dw")
    return _dsl.OutSpec(tuple(w.shape), w.dtype, rows=False)


@_dsl.tpu_kernel(_fwd_body, name="linear_cross_entropy_fwd", namespace=NAMESPACE, tunables=TUNABLES,
                 heuristic=_heuristic("fwd"), rows=("h", "labels"), out_shape=_fwd_out)
def linear_cross_entropy_fwd(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                             softcap: Optional[float] = None, *, bn: int, bv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and logsumexp: ``h [N, H]``, ``w [V, H]`` (bf16 | f32, one dtype), ``labels [N, 1]`` int32
    -> ``(loss [N, 1] f32 (0 at ignore_index rows), lse [N, 2] f32)``; the logits stay in VMEM. ``lse`` is the
    pair ``(hi, lo)``, ``logsumexp = hi + lo`` unevaluated (module docstring, "Large logits").

    Raises:
        ArgumentError / DTypeError: see :func:`_check_kernel_args`.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    N, V, H = _check_kernel_args(h, w, labels, where="tpukernels::linear_cross_entropy_fwd")
    bn_, bv_ = _clamp(N, bn), _clamp(V, bv)
    gi, gj = _dsl.cdiv(N, bn_), _dsl.cdiv(V, bv_)
    row = lambda i, j: (i, 0)  # noqa: E731
    return _dsl.Launch(
        grid=(gi, gj),
        in_specs=[pl.BlockSpec((bn_, H), row), pl.BlockSpec((bv_, H), lambda i, j: (j, 0)), *_row_specs(bn_, row, 1)],
        out_specs=tuple(_row_specs(bn_, row, 1, 2)),
        out_shape=(_dsl.OutSpec((N, 1), np.float32), _dsl.OutSpec((N, 2), np.float32)),
        scratch_shapes=[pltpu.VMEM((bn_, 1), np.float32) for _ in range(3)],
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=_limit(vmem_bytes("fwd", bn_, bv_, H, h.dtype)),
        cost_estimate=_cost(N, V, H, np.dtype(h.dtype).itemsize, 1, gi, 1),
        body_kwargs=dict(n_v=int(gj), v_size=V, bv=int(bv_), ignore_index=int(ignore_index), **_statics(h, softcap)),
    )


@_dsl.tpu_kernel(_fwd_dh_body, name="linear_cross_entropy_fwd_dh", namespace=NAMESPACE, tunables=TUNABLES,
                 heuristic=_heuristic("fwd_dh"), rows=("h", "labels", "wy", "g"), out_shape=_fwd_dh_out)
def linear_cross_entropy_fwd_dh(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, wy: torch.Tensor,
                                g: torch.Tensor, ignore_index: int = -100, softcap: Optional[float] = None, *,
                                bn: int, bv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward that also returns ``dh`` (the gradient in the forward, one pass over the logits).

    ``h [N, H]``, ``w [V, H]`` (bf16 | f32, one dtype), ``labels [N, 1]`` int32, ``wy [N, H]`` = ``w[labels]``
    (h's dtype; any row where the label is ignore_index or out of range), ``g [N, 1]`` f32 per-row weights ->
    ``(loss [N, 1] f32 = g * (lse - z_y), lse [N, 2] f32 (the (hi, lo) pair), dh [N, H] h's dtype = d loss /
    d h)``; loss and dh are 0 at ``ignore_index`` rows. ``g`` is the reduction's weight (``1 / n_valid`` for
    "mean", 1 for "sum" and "none"), so ``dh`` is the final gradient when the upstream gradient of ``loss`` is
    1. Its backward (``dh * upstream``, and ``dW`` by :func:`linear_cross_entropy_bwd_dw` with ``g *
    upstream``) recomputes the logits once.

    Raises:
        ArgumentError / DTypeError: see :func:`_check_kernel_args`.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    N, V, H = _check_kernel_args(h, w, labels, g=g, wy=wy, where="tpukernels::linear_cross_entropy_fwd_dh")
    bn_, bv_ = _clamp(N, bn), _clamp(V, bv)
    gi, gj = _dsl.cdiv(N, bn_), _dsl.cdiv(V, bv_)
    row = lambda i, j: (i, 0)  # noqa: E731
    return _dsl.Launch(
        grid=(gi, gj),
        in_specs=[pl.BlockSpec((bn_, H), row), pl.BlockSpec((bv_, H), lambda i, j: (j, 0)), *_row_specs(bn_, row, 1),
                  pl.BlockSpec(memory_space=pl.ANY), *_row_specs(bn_, row, 1)],
        out_specs=(*_row_specs(bn_, row, 1, 2), pl.BlockSpec((bn_, H), row)),
        out_shape=(_dsl.OutSpec((N, 1), np.float32), _dsl.OutSpec((N, 2), np.float32), _dsl.OutSpec((N, H), h.dtype)),
        scratch_shapes=[*(pltpu.VMEM((bn_, 1), np.float32) for _ in range(3)), pltpu.VMEM((bn_, H), np.float32),
                        pltpu.SemaphoreType.DMA((1,))],
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=_limit(vmem_bytes("fwd_dh", bn_, bv_, H, h.dtype)),
        cost_estimate=_cost(N, V, H, np.dtype(h.dtype).itemsize, 2, gi, 3),
        body_kwargs=dict(n_v=int(gj), v_size=V, bv=int(bv_), n_size=N, bn=int(bn_), ignore_index=int(ignore_index),
                         **_statics(h, softcap)),
    )


@_dsl.tpu_kernel(_dh_body, name="linear_cross_entropy_bwd_dh", namespace=NAMESPACE, tunables=TUNABLES,
                 heuristic=_heuristic("dh"), rows=("h", "labels", "lse", "g"), out_shape=_dh_out)
def linear_cross_entropy_bwd_dh(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                                g: torch.Tensor, ignore_index: int = -100, softcap: Optional[float] = None, *,
                                bn: int, bv: int) -> torch.Tensor:
    """``dh = ds @ w`` ``[N, H]`` (h's dtype) from the forward's ``lse [N, 2]`` f32 ``(hi, lo)`` pair and the per-row
    loss gradient ``g [N, 1]`` f32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    N, V, H = _check_kernel_args(h, w, labels, lse, g, where="tpukernels::linear_cross_entropy_bwd_dh")
    bn_, bv_ = _clamp(N, bn), _clamp(V, bv)
    gi, gj = _dsl.cdiv(N, bn_), _dsl.cdiv(V, bv_)
    row = lambda i, j: (i, 0)  # noqa: E731
    return _dsl.Launch(
        grid=(gi, gj),
        in_specs=[pl.BlockSpec((bn_, H), row), pl.BlockSpec((bv_, H), lambda i, j: (j, 0)),
                  *_row_specs(bn_, row, 1, 2, 1)],  # labels, the lse pair, g
        out_specs=pl.BlockSpec((bn_, H), row),
        out_shape=_dsl.OutSpec((N, H), h.dtype),
        scratch_shapes=[pltpu.VMEM((bn_, H) if gj > 1 else (8, 128), np.float32)],
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=_limit(vmem_bytes("dh", bn_, bv_, H, h.dtype)),
        cost_estimate=_cost(N, V, H, np.dtype(h.dtype).itemsize, 2, gi, 2),
        body_kwargs=dict(n_v=int(gj), v_size=V, bv=int(bv_), ignore_index=int(ignore_index), **_statics(h, softcap)),
    )


@_dsl.tpu_kernel(_dw_body, name="linear_cross_entropy_bwd_dw", namespace=NAMESPACE, tunables=TUNABLES,
                 heuristic=_heuristic("dw"), rows=("h", "labels", "lse", "g"), out_shape=_dw_out)
def linear_cross_entropy_bwd_dw(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                                g: torch.Tensor, ignore_index: int = -100, softcap: Optional[float] = None, *,
                                bn: int, bv: int) -> torch.Tensor:
    """``dW = ds^T @ h`` ``[V, H]`` (w's dtype), summed over all rows in f32 inside the kernel."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    N, V, H = _check_kernel_args(h, w, labels, lse, g, where="tpukernels::linear_cross_entropy_bwd_dw")
    bn_, bv_ = _clamp(N, bn), _clamp(V, bv)
    gi, gj = _dsl.cdiv(N, bn_), _dsl.cdiv(V, bv_)
    row = lambda j, i: (i, 0)  # noqa: E731
    return _dsl.Launch(
        grid=(gj, gi),
        in_specs=[pl.BlockSpec((bn_, H), row), pl.BlockSpec((bv_, H), lambda j, i: (j, 0)),
                  *_row_specs(bn_, row, 1, 2, 1)],  # labels, the lse pair, g
        out_specs=pl.BlockSpec((bv_, H), lambda j, i: (j, 0)),
        out_shape=_dsl.OutSpec((V, H), w.dtype, rows=False),
        scratch_shapes=[pltpu.VMEM((bv_, H) if gi > 1 else (8, 128), np.float32)],
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=_limit(vmem_bytes("dw", bn_, bv_, H, h.dtype)),
        cost_estimate=_cost(N, V, H, np.dtype(h.dtype).itemsize, 2, 2, gj),
        body_kwargs=dict(n_n=int(gi), n_size=N, bn=int(bn_), v_size=V, bv=int(bv_), ignore_index=int(ignore_index),
                         **_statics(h, softcap)),
    )


# --------------------------------------------------------------------------- chunked strategy: logits in HBM
def _check_s_args(s, x, labels, lse, g, *, where: str, x_name: str, dw=None):
    """Shapes/dtypes of a chunked-strategy gradient kernel: ``s [N, V]`` f32 stored logits, ``x`` = ``w [V, H]``
    (``dh_s``) or ``h [N, H]`` (``dw_s``), per-row ``labels [N, 1]`` int32, ``lse [N, 2]``, ``g [N, 1]`` f32,
    optional ``dw [V, H]`` f32 accumulator. Returns ``(N, V, H)``.

    Raises:
        ArgumentError: ranks and shapes. DTypeError: ``s`` / ``lse`` / ``g`` / ``dw`` not float32, ``x`` not
            bfloat16 / float32, labels not int32.
    """
    for t, n in ((s, "s"), (x, x_name)):
        if len(t.shape) != 2:
            raise ArgumentError(f"{where}: {n} must be 2-D, got shape {tuple(t.shape)}")
    N, V = (int(d) for d in s.shape)
    H = int(x.shape[1])
    want = (V, H) if x_name == "w" else (N, H)
    if tuple(x.shape) != want or V == 0 or H == 0:
        raise ArgumentError(f"{where}: {x_name} must be {list(want)} for s of shape {(N, V)} (V, H > 0), got "
                            f"{tuple(x.shape)}")
    if _dt(s) != "float32":
        raise DTypeError(f"{where}: s (the stored logits) must be float32, got {_dt(s)}")
    if _dt(x) not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: {x_name} dtype {_dt(x)} is not supported by the kernel; use {KERNEL_DTYPES}")
    for t, n, dt, c in ((labels, "labels", "int32", 1), (lse, "lse", "float32", 2), (g, "g", "float32", 1)):
        if tuple(t.shape) != (N, c):
            raise ArgumentError(f"{where}: {n} must have shape [N, {c}] = ({N}, {c}), got {tuple(t.shape)}")
        if _dt(t) != dt:
            raise DTypeError(f"{where}: {n} must be {dt}, got {_dt(t)}")
    if dw is not None and (tuple(dw.shape) != (V, H) or _dt(dw) != "float32"):
        raise ArgumentError(f"{where}: dw (the f32 accumulator) must be [V, H] = ({V}, {H}) float32, got "
                            f"{tuple(dw.shape)} {_dt(dw)}")
    return N, V, H


def vmem_bytes_s(kind: str, bn: int, bv: int, H: int, dtype) -> int:
    """VMEM estimate of a chunked-strategy launch (double-buffered blocks, scratch, ~4 f32 (bn, bv) tiles)."""
    rows = 4 * padded_bytes((bn, 2), "float32")
    tiles = 4 * bn * bv * 4
    s_blk = padded_bytes((bn, bv), "float32")
    if kind == "fwd_s":
        return vmem_bytes("fwd", bn, bv, H, dtype) + 2 * s_blk
    if kind == "dh_s":  # s tile, W block, dh block, f32 accumulator
        return (2 * (s_blk + padded_bytes((bv, H), dtype) + padded_bytes((bn, H), dtype)) + 2 * rows
                + padded_bytes((bn, H), "float32") + tiles)
    acc = padded_bytes((bv, H), "float32")  # dw_s / dw_s_acc: s tile, h block, f32 dW block (+ the input block)
    return (2 * (s_blk + padded_bytes((bn, H), dtype) + acc) + (2 * acc if kind == "dw_s_acc" else 0) + 2 * rows
            + tiles)


#: heuristic candidates ``(bn, bv)`` of the chunked-strategy kernels, best first, on chips with more than 64 MiB
#: of VMEM (v5e, v6e) and on the others (tpu7x: libtpu 0.0.52's static-profile compile asks 2-3x tpukernels'
#: VMEM estimate there, so larger blocks cannot be estimated). Ranked by libtpu static estimates for one
#: 1024-row chunk of the Llama-3-8B head on v6e (ms): fwd_s (512, 1024) 1.59, (1024, 512) 1.80; dh_s
#: (512, 1024) 1.95, (1024, 256) 3.95; dw_s_acc (1024, 512) 4.40, (1024, 256) 7.31 (dw_s (1024, 256) 1.75).
#: ``dw_s`` streams ``h`` once per V block, so it wants the chunk's rows in one block.
_S_CANDIDATES = {
    "fwd_s": (((512, 1024), (1024, 512), (512, 512)), ((512, 512), (512, 256), (256, 256))),
    "dh_s": (((512, 1024), (512, 512), (512, 256)), ((512, 512), (512, 256), (256, 256))),
    "dw_s": (((1024, 512), (1024, 256), (512, 512)), ((512, 256), (256, 256))),
}


def _heuristic_s(kind: str):
    def heur(*args, **statics):
        from .vmem import vmem_cap

        N, V = (int(d) for d in args[0].shape)  # fwd_s: h [N, H] -> use h, w; others: s [N, V]
        if kind == "fwd_s":
            V, H, dtype = int(args[1].shape[0]), int(args[0].shape[1]), args[0].dtype
        else:
            H, dtype = int(args[1].shape[1]), args[1].dtype
        small = vmem_cap() <= 64 * MiB
        # up to 64 MiB on the large-VMEM chips (the scoped limit _limit asks at most): dw_s_acc at (1024, 512) holds
        # four f32 (512, H) blocks (its accumulator in and out, double-buffered)
        target = min(VMEM_TARGET if small else 64 * MiB, (vmem_cap() - 4 * MiB) * 4 // 5)
        cands = _S_CANDIDATES[kind.replace("_acc", "")][small]
        for bn, bv in (*cands, (256, 256), (256, 128), (128, 128)):
            if vmem_bytes_s(kind, _clamp(N, bn), _clamp(V, bv), H, dtype) <= target:
                return dict(bn=bn, bv=bv)
        return dict(bn=128, bv=128)

    return heur


def _fwd_s_out(h, w, labels, ignore_index=-100, softcap=None):
    N, V, H = _check_kernel_args(h, w, labels, where="tpukernels::linear_cross_entropy_fwd_s")
    return (_dsl.OutSpec((N, 1), np.float32), _dsl.OutSpec((N, 2), np.float32), _dsl.OutSpec((N, V), np.float32))


def _dh_s_out(s, w, labels, lse, g, ignore_index=-100, softcap=None):
    N, V, H = _check_s_args(s, w, labels, lse, g, where="tpukernels::linear_cross_entropy_dh_s", x_name="w")
    return _dsl.OutSpec((N, H), w.dtype)


def _dw_s_out(s, h, labels, lse, g, ignore_index=-100, softcap=None):
    N, V, H = _check_s_args(s, h, labels, lse, g, where="tpukernels::linear_cross_entropy_dw_s", x_name="h")
    return _dsl.OutSpec((V, H), np.float32, rows=False)


def _dw_s_acc_out(s, h, labels, lse, g, dw, ignore_index=-100, softcap=None):
    N, V, H = _check_s_args(s, h, labels, lse, g, dw=dw, where="tpukernels::linear_cross_entropy_dw_s_acc",
                            x_name="h")
    return _dsl.OutSpec((V, H), np.float32, rows=False)


@_dsl.tpu_kernel(_fwd_s_body, name="linear_cross_entropy_fwd_s", namespace=NAMESPACE, tunables=TUNABLES,
                 heuristic=_heuristic_s("fwd_s"), rows=("h", "labels"), out_shape=_fwd_s_out)
def linear_cross_entropy_fwd_s(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                               softcap: Optional[float] = None, *, bn: int,
                               bv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`linear_cross_entropy_fwd` that also returns the raw logits ``s = h w^T`` ``[N, V]`` float32
    (before the soft-cap): ``(loss [N, 1], lse [N, 2], s [N, V])``, the chunked strategy's first step (the
    public op runs it on ``chunk_rows`` rows at a time).

    Raises:
        ArgumentError / DTypeError: see :func:`_check_kernel_args`.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    N, V, H = _check_kernel_args(h, w, labels, where="tpukernels::linear_cross_entropy_fwd_s")
    bn_, bv_ = _clamp(N, bn), _clamp(V, bv)
    gi, gj = _dsl.cdiv(N, bn_), _dsl.cdiv(V, bv_)
    row = lambda i, j: (i, 0)  # noqa: E731
    return _dsl.Launch(
        grid=(gi, gj),
        in_specs=[pl.BlockSpec((bn_, H), row), pl.BlockSpec((bv_, H), lambda i, j: (j, 0)), *_row_specs(bn_, row, 1)],
        out_specs=(*_row_specs(bn_, row, 1, 2), pl.BlockSpec((bn_, bv_), lambda i, j: (i, j))),
        out_shape=(_dsl.OutSpec((N, 1), np.float32), _dsl.OutSpec((N, 2), np.float32),
                   _dsl.OutSpec((N, V), np.float32)),
        scratch_shapes=[pltpu.VMEM((bn_, 1), np.float32) for _ in range(3)],
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=_limit(vmem_bytes_s("fwd_s", bn_, bv_, H, h.dtype)),
        cost_estimate=pl.CostEstimate(flops=2 * N * V * H, transcendentals=N * V, bytes_accessed=int(
            np.dtype(h.dtype).itemsize * (gi * V * H + N * H) + 4 * N * V)),
        body_kwargs=dict(n_v=int(gj), v_size=V, bv=int(bv_), ignore_index=int(ignore_index), **_statics(h, softcap)),
    )


@_dsl.tpu_kernel(_dh_s_body, name="linear_cross_entropy_dh_s", namespace=NAMESPACE, tunables=TUNABLES,
                 heuristic=_heuristic_s("dh_s"), rows=("s", "labels", "lse", "g"), out_shape=_dh_s_out)
def linear_cross_entropy_dh_s(s: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                              g: torch.Tensor, ignore_index: int = -100, softcap: Optional[float] = None, *,
                              bn: int, bv: int) -> torch.Tensor:
    """``dh = ds @ w`` ``[N, H]`` (w's dtype) from the stored logits ``s [N, V]`` f32 of
    :func:`linear_cross_entropy_fwd_s` (no recompute), its ``lse [N, 2]`` pair and per-row weights ``g [N, 1]``.

    Raises:
        ArgumentError / DTypeError: see :func:`_check_s_args`.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    N, V, H = _check_s_args(s, w, labels, lse, g, where="tpukernels::linear_cross_entropy_dh_s", x_name="w")
    bn_, bv_ = _clamp(N, bn), _clamp(V, bv)
    gi, gj = _dsl.cdiv(N, bn_), _dsl.cdiv(V, bv_)
    row = lambda i, j: (i, 0)  # noqa: E731
    return _dsl.Launch(
        grid=(gi, gj),
        in_specs=[pl.BlockSpec((bn_, bv_), lambda i, j: (i, j)), pl.BlockSpec((bv_, H), lambda i, j: (j, 0)),
                  *_row_specs(bn_, row, 1, 2, 1)],  # labels, the lse pair, g
        out_specs=pl.BlockSpec((bn_, H), row),
        out_shape=_dsl.OutSpec((N, H), w.dtype),
        scratch_shapes=[pltpu.VMEM((bn_, H) if gj > 1 else (8, 128), np.float32)],
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=_limit(vmem_bytes_s("dh_s", bn_, bv_, H, w.dtype)),
        cost_estimate=pl.CostEstimate(flops=2 * N * V * H, transcendentals=N * V, bytes_accessed=int(
            np.dtype(w.dtype).itemsize * (gi * V * H + N * H) + 4 * N * V)),
        body_kwargs=dict(n_v=int(gj), v_size=V, bv=int(bv_), ignore_index=int(ignore_index), **_statics(w, softcap)),
    )


def _dw_s_launch(s, h, labels, lse, g, dw, ignore_index, softcap, bn, bv, where):
    from jax.experimental import pallas as pl

    N, V, H = _check_s_args(s, h, labels, lse, g, dw=dw, where=where, x_name="h")
    bn_, bv_ = _clamp(N, bn), _clamp(V, bv)
    gi, gj = _dsl.cdiv(N, bn_), _dsl.cdiv(V, bv_)
    row = lambda j, i: (i, 0)  # noqa: E731
    vblk = pl.BlockSpec((bv_, H), lambda j, i: (j, 0))
    acc = dw is not None
    return _dsl.Launch(
        grid=(gj, gi),
        in_specs=[pl.BlockSpec((bn_, bv_), lambda j, i: (i, j)), pl.BlockSpec((bn_, H), row),
                  *_row_specs(bn_, row, 1, 2, 1), *((vblk,) if acc else ())],  # labels, lse pair, g (, dw)
        out_specs=vblk,
        out_shape=_dsl.OutSpec((V, H), np.float32, rows=False),
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=_limit(vmem_bytes_s("dw_s_acc" if acc else "dw_s", bn_, bv_, H, h.dtype)),
        # dw updated in place (Mosaic); not under the TPU interpreter, which returns the aliased operand padded
        # to whole blocks (jax 0.10.2: a verifier error when V % bv != 0). No effect on the values.
        input_output_aliases={5: 0} if acc and _dsl.current_interpret_mode() not in ("tpu", "races") else {},
        cost_estimate=pl.CostEstimate(flops=2 * N * V * H, transcendentals=N * V, bytes_accessed=int(
            np.dtype(h.dtype).itemsize * gj * N * H + 4 * N * V + (8 if acc else 4) * V * H)),
        body_kwargs=dict(n_size=N, bn=int(bn_), v_size=V, bv=int(bv_), ignore_index=int(ignore_index),
                         **_statics(h, softcap)),
    )


@_dsl.tpu_kernel(_dw_s_body, name="linear_cross_entropy_dw_s", namespace=NAMESPACE, tunables=TUNABLES,
                 heuristic=_heuristic_s("dw_s"), rows=("s", "h", "labels", "lse", "g"), out_shape=_dw_s_out)
def linear_cross_entropy_dw_s(s: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                              g: torch.Tensor, ignore_index: int = -100, softcap: Optional[float] = None, *,
                              bn: int, bv: int) -> torch.Tensor:
    """``dW = ds^T @ h`` ``[V, H]`` **float32** from the stored logits ``s [N, V]`` f32 (the first chunk's
    weight gradient; later chunks add theirs with :func:`linear_cross_entropy_dw_s_acc`).

    Raises:
        ArgumentError / DTypeError: see :func:`_check_s_args`.
    """
    return _dw_s_launch(s, h, labels, lse, g, None, ignore_index, softcap, bn, bv,
                        "tpukernels::linear_cross_entropy_dw_s")


@_dsl.tpu_kernel(_dw_s_body, name="linear_cross_entropy_dw_s_acc", namespace=NAMESPACE, tunables=TUNABLES,
                 heuristic=_heuristic_s("dw_s_acc"), rows=("s", "h", "labels", "lse", "g"), out_shape=_dw_s_acc_out)
def linear_cross_entropy_dw_s_acc(s: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                                  g: torch.Tensor, dw: torch.Tensor, ignore_index: int = -100,
                                  softcap: Optional[float] = None, *, bn: int, bv: int) -> torch.Tensor:
    """``dw + ds^T @ h`` ``[V, H]`` float32: :func:`linear_cross_entropy_dw_s` added to the accumulator ``dw``
    (f32, aliased to the output in the Pallas call: XLA updates it in place where ``dw`` is not used
    afterwards; the torch op returns a new tensor and leaves ``dw`` unchanged).

    Raises:
        ArgumentError / DTypeError: see :func:`_check_s_args`.
    """
    return _dw_s_launch(s, h, labels, lse, g, dw, ignore_index, softcap, bn, bv,
                        "tpukernels::linear_cross_entropy_dw_s_acc")


KERNELS = {"fwd": linear_cross_entropy_fwd, "fwd_dh": linear_cross_entropy_fwd_dh, "bwd_dh": linear_cross_entropy_bwd_dh,
           "bwd_dw": linear_cross_entropy_bwd_dw, "fwd_s": linear_cross_entropy_fwd_s,
           "dh_s": linear_cross_entropy_dh_s, "dw_s": linear_cross_entropy_dw_s,
           "dw_s_acc": linear_cross_entropy_dw_s_acc}


@linear_cross_entropy_fwd.def_backward(op="linear_cross_entropy")
def _fwd_backward(ctx, g_loss, g_lse=None):
    """Gradients of the per-row loss (the lse output carries no gradient: it is internal)."""
    h, w, labels = ctx.args["h"], ctx.args["w"], ctx.args["labels"]
    lse = ctx.outputs[1]
    if g_loss is None:
        return {}
    g = g_loss.float().contiguous()
    ii, cap = ctx.args["ignore_index"], ctx.args["softcap"]
    grads = {}
    if ctx.needs_input_grad.get("h"):
        grads["h"] = torch.ops.tpukernels.linear_cross_entropy_bwd_dh(h, w, labels, lse, g, ii, cap)
    if ctx.needs_input_grad.get("w"):
        grads["w"] = torch.ops.tpukernels.linear_cross_entropy_bwd_dw(h, w, labels, lse, g, ii, cap)
    return grads


@linear_cross_entropy_fwd_dh.def_backward(op="linear_cross_entropy")
def _fwd_dh_backward(ctx, g_loss, g_lse=None, g_dh=None):
    """``dh`` was computed in the forward for an upstream gradient of 1: scale it by the upstream gradient of
    ``loss``; ``dW`` recomputes the logits once (:func:`linear_cross_entropy_bwd_dw`, per-row weight
    ``g * upstream``). ``lse`` and ``dh`` carry no gradient (no double backward); ``wy``, ``g`` get none."""
    h, w, labels, g = ctx.args["h"], ctx.args["w"], ctx.args["labels"], ctx.args["g"]
    lse, dh = ctx.outputs[1], ctx.outputs[2]
    if g_loss is None:
        return {}
    up = g_loss.float()
    ii, cap = ctx.args["ignore_index"], ctx.args["softcap"]
    grads = {}
    if ctx.needs_input_grad.get("h"):
        grads["h"] = (dh.float() * up).to(dh.dtype)
    if ctx.needs_input_grad.get("w"):
        grads["w"] = torch.ops.tpukernels.linear_cross_entropy_bwd_dw(h, w, labels, lse, (g * up).contiguous(), ii,
                                                                      cap)
    return grads


# ----------------------------------------------------------------------------------------------- public op
def _values_readable(x: torch.Tensor) -> bool:
    """True for a plain cpu tensor outside any tracing (torch.compile, fake / functional / proxy modes), where
    reading its values is cheap and meaningful."""
    if type(x) is not torch.Tensor or x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if torch._is_functional_tensor(x) or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return not _get_current_dispatch_mode_stack()


def check_args(h, W, labels, ignore_index, reduction, softcap, chunk_rows=None) -> None:
    """Validate the public op's arguments (module docstring) before any kernel runs.

    Raises:
        ArgumentError: not tensors, ranks, shapes, V == 0 or H == 0, reduction, softcap, chunk_rows (None or
            a positive int), labels out of range.
        DTypeError: float64 / integer / mixed operand dtypes, labels not int64/int32.
        DeviceError: h, W and labels on different devices.
    """
    where = "tpukernels::linear_cross_entropy"
    for x, n in ((h, "h"), (W, "W"), (labels, "labels")):
        if not isinstance(x, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(x).__name__}")
    if h.dim() != 2:
        raise ArgumentError(f"{where}: h must be 2-D [N, H] (flatten batch and sequence), got shape {tuple(h.shape)}")
    if W.dim() != 2:
        raise ArgumentError(f"{where}: W must be 2-D [V, H] (an nn.Linear weight), got shape {tuple(W.shape)}")
    if W.shape[1] != h.shape[1]:
        raise ArgumentError(f"{where}: W {tuple(W.shape)} must be [V, H] with H = h.shape[1] = {h.shape[1]}")
    if W.shape[0] == 0 or h.shape[1] == 0:
        raise ArgumentError(f"{where}: V and H must be positive, got W shape {tuple(W.shape)}")
    if labels.dim() != 1 or labels.shape[0] != h.shape[0]:
        raise ArgumentError(f"{where}: labels must be 1-D [N] with N = h.shape[0] = {h.shape[0]}, "
                            f"got shape {tuple(labels.shape)}")
    for x, n in ((h, "h"), (W, "W")):
        if _dt(x.dtype) not in PUBLIC_DTYPES:
            raise DTypeError(f"{where}: {n} dtype {_dt(x.dtype)} is not supported; use {PUBLIC_DTYPES}"
                             + (" (TPUs have no float64; cast with .float())" if x.dtype == torch.float64 else ""))
    if h.dtype != W.dtype:
        raise DTypeError(f"{where}: h is {_dt(h.dtype)} but W is {_dt(W.dtype)}; use one dtype")
    if labels.dtype not in LABEL_DTYPES:
        raise DTypeError(f"{where}: labels must be int64 or int32 class indices, got {_dt(labels.dtype)}")
    if not (h.device == W.device == labels.device):
        raise DeviceError(f"{where}: h ({h.device}), W ({W.device}) and labels ({labels.device}) must be on one device")
    if reduction not in REDUCTIONS:
        raise ArgumentError(f"{where}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ArgumentError(f"{where}: ignore_index must be an int, got {ignore_index!r}")
    if not -(2**31) <= ignore_index < 2**31:
        raise ArgumentError(f"{where}: ignore_index {ignore_index} does not fit int32")
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                    and math.isfinite(softcap) and softcap > 0):
        raise ArgumentError(f"{where}: softcap must be None or a positive finite number, got {softcap!r}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ArgumentError(f"{where}: chunk_rows must be None (the fused kernels) or a positive int (rows per "
                            f"chunk of the chunked strategy), got {chunk_rows!r}")
    V = W.shape[0]
    if labels.numel() and _values_readable(labels):
        bad = ((labels < 0) | (labels >= V)) & (labels != ignore_index)
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            raise ArgumentError(f"{where}: labels[{k}] = {int(labels[k])} is outside [0, V = {V}) and is not "
                                f"ignore_index ({ignore_index})")


def _chunks(n: int, rows: int):
    return [(a, min(a + rows, n)) for a in range(0, n, rows)]


def _chunked_dw(h, w, y, g, ignore_index, softcap, rows):
    """``dW`` [V, H] f32 of the g-weighted per-row losses, one chunk of rows at a time (logits recomputed)."""
    ops = torch.ops.tpukernels
    dw = None
    for a, b in _chunks(h.shape[0], rows):
        hc, yc, gc = h[a:b], y[a:b], g[a:b]
        _, lse, s = ops.linear_cross_entropy_fwd_s(hc, w, yc, ignore_index, softcap)
        dw = (ops.linear_cross_entropy_dw_s(s, hc, yc, lse, gc, ignore_index, softcap) if dw is None else
              ops.linear_cross_entropy_dw_s_acc(s, hc, yc, lse, gc, dw, ignore_index, softcap))
    return dw


class _ChunkedLCE(torch.autograd.Function):
    """The chunked strategy (module docstring): per chunk of ``rows`` rows the f32 logits ``[rows, V]`` are
    stored in HBM (:func:`linear_cross_entropy_fwd_s`), ``dh`` of the chunk (:func:`linear_cross_entropy_dh_s`)
    and ``dW += ds^T h`` (:func:`linear_cross_entropy_dw_s_acc`, f32) are made from them: no recompute. Returns the
    ``g``-weighted per-row loss ``[N]``. ``uniform``: the upstream gradient is the same for every row (the
    reduction sums the weighted losses), so ``dW`` is computed in the forward and only scaled in the backward;
    else ("none") the backward recomputes the logits once for ``dW`` with the per-row upstream weights."""

    @staticmethod
    def forward(ctx, h, w, y, g, ignore_index, softcap, rows, uniform):
        ops = torch.ops.tpukernels
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and uniform
        losses, dhs, dw = [], [], None
        for a, b in _chunks(h.shape[0], rows):
            hc, yc, gc = h[a:b], y[a:b], g[a:b]
            loss, lse, s = ops.linear_cross_entropy_fwd_s(hc, w, yc, ignore_index, softcap)
            losses.append(loss * gc)
            if need_h:
                dhs.append(ops.linear_cross_entropy_dh_s(s, w, yc, lse, gc, ignore_index, softcap))
            if need_w:
                dw = (ops.linear_cross_entropy_dw_s(s, hc, yc, lse, gc, ignore_index, softcap) if dw is None else
                      ops.linear_cross_entropy_dw_s_acc(s, hc, yc, lse, gc, dw, ignore_index, softcap))
            del s
        ctx.save_for_backward(torch.cat(dhs) if need_h else None, dw.to(w.dtype) if need_w else None,
                              *((h, w, y, g) if ctx.needs_input_grad[1] and not uniform else ()))
        ctx.args = (ignore_index, softcap, rows, uniform)
        return torch.cat(losses).reshape(-1)

    @staticmethod
    def backward(ctx, up):
        ignore_index, softcap, rows, uniform = ctx.args
        dh, dw, *rest = ctx.saved_tensors
        up = up.float().reshape(-1, 1)
        gh = gw = None
        if ctx.needs_input_grad[0]:
            gh = (dh.float() * up).to(dh.dtype)
        if ctx.needs_input_grad[1]:
            if uniform:  # the weighted losses are summed: every row's upstream gradient is up[0]
                gw = (dw.float() * up[0]).to(dw.dtype)
            else:
                h, w, y, g = rest
                gw = _chunked_dw(h, w, y, (g * up).contiguous(), ignore_index, softcap, rows).to(w.dtype)
        return gh, gw, None, None, None, None, None, None


def _lce_impl(h, W, labels, ignore_index=-100, reduction="mean", softcap=None, chunk_rows=None):
    """The public op (CompositeImplicitAutograd: autograd and torch.compile see the kernel ops)."""
    check_args(h, W, labels, ignore_index, reduction, softcap, chunk_rows)
    valid = labels != ignore_index
    if h.shape[0] == 0:
        loss = (h.float() @ W.float().t()).sum(1)  # empty, but connected to h and W for autograd
    else:
        hk, wk = (h.float(), W.float()) if h.dtype == torch.float16 else (h, W)
        hk, wk = hk.contiguous(), wk.contiguous()
        y = labels.to(torch.int32).reshape(-1, 1)
        if chunk_rows is not None and torch.is_grad_enabled() and (h.requires_grad or W.requires_grad):
            n_valid = valid.sum()
            g = (valid.float() / n_valid.clamp_min(1)) if reduction == "mean" else valid.float()
            loss = _ChunkedLCE.apply(hk, wk, y, g.reshape(-1, 1), ignore_index, softcap, chunk_rows,
                                     reduction != "none")
            if reduction == "none":
                return loss
            total = loss.sum()
            if reduction == "mean":  # the weights already divide by n_valid; no valid row: NaN, as torch
                total = torch.where(n_valid > 0, total, torch.full_like(total, float("nan")))
            return total
        if torch.is_grad_enabled() and h.requires_grad:
            # gradient in the forward: dh from the same pass as the loss, dW in the backward (one recompute)
            n_valid = valid.sum()
            if reduction == "mean":
                g = valid.float() / n_valid.clamp_min(1)
            else:
                g = valid.float()
            wy = wk.detach().index_select(0, labels.clamp(0, W.shape[0] - 1))
            loss = torch.ops.tpukernels.linear_cross_entropy_fwd_dh(hk, wk, y, wy, g.reshape(-1, 1), ignore_index,
                                                                    softcap)[0].reshape(-1)
            if reduction == "none":
                return loss
            total = loss.sum()
            if reduction == "mean":  # the weights already divide by n_valid; no valid row: NaN, as torch
                total = torch.where(n_valid > 0, total, torch.full_like(total, float("nan")))
            return total
        loss = torch.ops.tpukernels.linear_cross_entropy_fwd(hk, wk, y, ignore_index, softcap)[0].reshape(-1)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("linear_cross_entropy(Tensor h, Tensor W, Tensor labels, int ignore_index=-100, str reduction='mean', "
            "float? softcap=None, int? chunk_rows=None) -> Tensor")
_LIB.impl("linear_cross_entropy", _lce_impl, "CompositeImplicitAutograd")


def linear_cross_entropy(h: torch.Tensor, W: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", softcap: float | None = None,
                         chunk_rows: int | None = None) -> torch.Tensor:
    """Cross-entropy of ``softcap(h @ W^T)`` against ``labels`` without the ``[N, V]`` logits (differentiable).

    ``torch.ops.tpukernels.linear_cross_entropy``; formulas, algorithm and sources in the module docstring.

    Args:
        h: ``[N, H]`` hidden states, bfloat16 / float16 / float32 (cpu: Pallas interpret; tpu: TorchTPU).
        W: ``[V, H]`` LM-head weight (``nn.Linear(H, V).weight``), same dtype as ``h``.
        labels: ``[N]`` int64 or int32 class indices in ``[0, V)``, or ``ignore_index``.
        ignore_index: label value whose rows contribute no loss and no gradient (default -100, as torch).
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"``.
        softcap: optional logit soft-cap ``c``: logits become ``c * tanh(logits / c)`` (Gemma-2).
        chunk_rows: how the gradients are made (module docstring, "Strategies"). None (default): the fused
            kernels, logits only in VMEM (8 N V H FLOPs: one recompute; ``O(N)`` temporary HBM). An int:
            the chunked strategy, ``chunk_rows`` rows at a time with their f32 logits stored in HBM (6 N V H
            FLOPs; temporary ``chunk_rows * V * 4`` bytes plus an f32 ``[V, H]`` weight-gradient
            accumulator). Same values either way (to float32 rounding); no effect without gradients.

    Returns:
        float32 loss in nats: ``[]`` ("mean", "sum") or ``[N]`` ("none").

    Raises:
        ArgumentError, DTypeError, DeviceError: see :func:`check_args` (raised before any kernel runs);
            ArgumentError for an ``ignore_index`` that is not an int (a float included).
    """
    ignore_index = _dsl.check_int("tpukernels::linear_cross_entropy", "ignore_index", ignore_index)  # not the schema's
    chunk_rows = _dsl.check_int("tpukernels::linear_cross_entropy", "chunk_rows", chunk_rows, optional=True)
    return torch.ops.tpukernels.linear_cross_entropy(h, W, labels, ignore_index, reduction,
                                                     None if softcap is None else float(softcap), chunk_rows)


def reference(h, W, labels, ignore_index=-100, reduction="mean", softcap=None) -> torch.Tensor:
    """float64 reference computed from the given (low-precision) inputs, **not** rounded (materialises logits)."""
    z = h.double() @ W.double().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.nn.functional.cross_entropy(z, labels.long(), ignore_index=ignore_index, reduction=reduction)


def unfused(h, W, labels, ignore_index=-100, reduction="mean", softcap=None) -> torch.Tensor:
    """The unfused torch/HF formulation (logits in h's dtype, loss in float32), for comparisons."""
    z = (h @ W.t()).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.nn.functional.cross_entropy(z, labels.long(), ignore_index=ignore_index, reduction=reduction)


#: the Llama-3-8B LM head (H 4096, V 128256) at 8192 tokens: what the shipped defaults are tuned for
_LLAMA3 = ("8192x4096:bf16", "128256x4096:bf16", "8192x1:i32")
STANDARD_CASES = [
    (linear_cross_entropy_fwd, _LLAMA3, {"ignore_index": -100, "softcap": None}),
    (linear_cross_entropy_fwd_dh, (*_LLAMA3, "8192x4096:bf16", "8192x1:f32"), {"ignore_index": -100, "softcap": None}),
    (linear_cross_entropy_bwd_dh, (*_LLAMA3, "8192x2:f32", "8192x1:f32"), {"ignore_index": -100, "softcap": None}),
    (linear_cross_entropy_bwd_dw, (*_LLAMA3, "8192x2:f32", "8192x1:f32"), {"ignore_index": -100, "softcap": None}),
]

__all__ = ["linear_cross_entropy", "reference", "unfused", "check_args", "linear_cross_entropy_fwd",
           "linear_cross_entropy_fwd_dh", "linear_cross_entropy_fwd_s", "linear_cross_entropy_dh_s",
           "linear_cross_entropy_dw_s", "linear_cross_entropy_dw_s_acc",
           "linear_cross_entropy_bwd_dh", "linear_cross_entropy_bwd_dw", "KERNELS", "STANDARD_CASES"]
