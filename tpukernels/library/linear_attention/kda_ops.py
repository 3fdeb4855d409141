"""KDA (Kimi Delta Attention): the gated delta rule with a per-channel decay, chunked prefill and recurrent decode.

Written with the tpukernels DSL (``@tpu_kernel``), torch namespace ``tpukernels``.

Public API (torch tensors)::

    chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, chunk_size=64) -> (o, final_state or None)
    fused_recurrent_kda(q, k, v, g, beta, *, ...same...) -> (o, final_state or None)        decode (few tokens)
    kda_reference(...)                                                          float64 naive recurrence
    torch.ops.tpukernels.kda_chunk_fwd / kda_recurrent_fwd / kda_chunk_bwd     the kernels (internal layouts)

Formula (fla ``naive_recurrent_kda``), per sequence and value head, state ``S [K, V]`` (float32), tokens t::

    S   <- diag(exp(g_t)) S                         (g: log-space decay per key channel, g <= 0)
    S   <- S + beta_t k_t (v_t - k_t^T S)^T        (the delta rule)
    o_t  = scale * q_t^T S                          (scale = K ** -0.5 by default)

Shapes (fla's): ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``beta [B, T, HV]`` with
``HV % H == 0`` (grouped value heads: value head ``h`` reads q/k head ``h // (HV / H)``); states
``[N, HV, K, V]`` float32 with N = B, or N = the number of packed sequences with ``cu_seqlens [N + 1]`` and B = 1.

Sources: flash-linear-attention (fla-core 0.6.0) ``fla/ops/kda/{chunk,fused_recurrent,naive,gate}.py`` (the
signature, the chunked UT form, the gate ``-exp(A_log) * softplus(g + dt_bias)``); transformers 5.24
``models/kimi_linear/modeling_kimi_linear.py`` (calls ``chunk_kda`` / ``fused_recurrent_kda`` with a
precomputed g, ``beta = sigmoid(b_proj(x))``, ``use_qk_l2norm_in_kernel=True``, float32 states).

Design. Tokens stay packed, never padded per sequence: the inputs are made head-major (``q [H, T, K]``,
``v [HV, T, V]``, ``beta [HV, T, 1]``, one transpose each) and cut into aligned blocks of ``chunk_size`` tokens of
the packed stream. A *work item* is one (sequence, block) pair: the tokens ``[lo, hi)`` of the block that belong to
the sequence (:func:`work_items`, scalar-prefetched). A block holding a sequence boundary is visited once per
sequence in it, consecutively, so its output block stays in VMEM and each visit writes only its own rows
(``jnp.where``: another sequence's rows, even NaN, never enter). Grid ``(HV, items)``: heads parallel, items
sequential, the state ``[K, V]`` float32 carried in VMEM scratch across the items of a sequence; a sequence's first
item loads its ``initial_state`` block (zeros without), every item writes the running state to the sequence's
``final_state`` block (the last write wins). A zero-length sequence has one empty item (final = initial).

* ``kda_chunk_fwd`` (prefill): per item the chunked UT form (fla ``naive_chunk_kda``): G = chunk cumsum of g
  (``dsl.scan.segment_cumsum``), ``A_kk[j, i] = sum_c k_jc k_ic exp(G_jc - G_ic)`` (i < j) and ``A_qk`` (i <= j),
  ``T = (I + diag(beta) A_kk)^-1`` (``dsl.scan.unit_lower_inverse``),
  ``u = T beta v``, ``w = T beta (k * exp(G))``, ``delta = u - w S``, ``o = scale ((q * exp(G)) S + A_qk delta)``,
  ``S <- exp(G_last) * S + (k * exp(G_last - G))^T delta``. Numerics: no ``exp`` of a positive number is formed
  (for g <= 0): the chunk is cut into sub-chunks of 16 rows; the part of ``A`` left of a row sub-chunk J factors
  through the cumulative decay at J's start (both factors <= 1), the 16 x 16 diagonal blocks use the direct
  ``[16, 16, K]`` decays. The decays are differences of chunk-cumulative gates, exact to one float32 ulp of the
  cumulative gate (as fla's): with gates of -1000 per token the outputs carry ~1e-4 relative errors the token
  recurrence does not have.
* ``kda_recurrent_fwd`` (decode): the token recurrence above, one token per step, for one or a few tokens per
  sequence, on the VPU (q, k, g transposed in VMEM so each token is a column; the state scaled, reduced over K and
  updated by broadcasts, no M = 1 matmuls); the steps are unrolled over the item's block (``chunk_size``, 16 by
  default), each run only for the item's rows.
* ``kda_chunk_bwd`` (the backward of both): items in reverse order; each re-runs its chunk's forward from the state
  saved at its start (the forward's ``item_states``) and applies the transpose of every step (``dT -> dL = -T^T dT
  T^T``; the decay products' transposes by the same sub-chunk factoring, :func:`_decay_transposes`; ``dg`` the
  reverse cumulative sum of ``dG``), carrying ``dS`` back across items: seeded by the final state's gradient, its
  value at a sequence's start is ``d initial_state``.

Gate and beta pre-processing (``use_gate_in_kernel``: ``g = -exp(A_log) * softplus(g + dt_bias)``;
``use_beta_sigmoid_in_kernel``: ``beta = sigmoid(beta)``, times 2 with ``allow_neg_eigval``) and
``use_qk_l2norm_in_kernel`` (``x / sqrt(sum x^2 + 1e-6)``, fla's l2norm) run in torch in float32 before the kernels
(autograd differentiates them): a gap against fla, which fuses them. Not supported (typed errors): fla's
``safe_gate`` / ``lower_bound`` gate, ``state_v_first``, ``return_intermediate_states``, ``cp_context``,
``use_graph``; ``K > 256`` (fla's bound too).

Tuning: ``chunk_size`` (16, 32, 64 or 128 tokens per item: the public argument, fla's default 64). No per-chip
tables are shipped yet.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ... import dsl as tk
from ...errors import ArgumentError
from .common import check_delta_rule_args, head_major, shape_of

__all__ = [
    "chunk_kda", "fused_recurrent_kda", "kda_reference", "kda_gate_reference", "work_items", "kda_chunk_fwd",
    "kda_recurrent_fwd", "kda_chunk_bwd", "SUB_CHUNK", "MAX_HEAD_DIM", "VMEM_LIMIT_BYTES",
    "STANDARD_SHAPES", "DECODE_SHAPES",
]

NAMESPACE = "tpukernels"
#: rows of the diagonal blocks whose decays are formed directly (``[16, 16, K]``).
SUB_CHUNK = 16
#: largest K (fla: 256).
MAX_HEAD_DIM = 256
#: Mosaic scoped-VMEM limit of the three kernels (they use ~1 MiB at K = V = 128, chunk 64; every chip has at least
#: 64 MiB of VMEM).
VMEM_LIMIT_BYTES = 32 * 1024 * 1024
F32 = jnp.float32
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------- in-kernel algebra
_mm = tk.scan.matmul  # float32, highest precision; trans_a= / trans_b= for a^T b and a b^T


def _decay_products(G, k, q, sub):
    """``(A_kk, A_qk)`` ``(C, C)``: ``sum_c x_jc k_ic exp(G_jc - G_ic)`` for i < j (kk, x = k) and i <= j (qk, x = q),
    zero elsewhere, never forming exp of a positive exponent when G is non-increasing (module docstring)."""
    c, kd = k.shape
    col = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (sub, sub, kd), 0)  # 3-D iotas: Mosaic reshapes no bool arrays
    ii = jax.lax.broadcasted_iota(jnp.int32, (sub, sub, kd), 1)
    rows_kk, rows_qk = [], []
    for j in range(c // sub):
        s0 = j * sub
        gj, kj, qj = G[s0:s0 + sub], k[s0:s0 + sub], q[s0:s0 + sub]
        # diagonal block, direct decays [sub, sub, K] (exponent masked to -inf above the diagonal)
        diff = gj[:, None, :] - gj[None, :, :]
        dkk = jnp.exp(jnp.where(jj > ii, diff, -jnp.inf))
        dqk = jnp.exp(jnp.where(jj >= ii, diff, -jnp.inf))
        kk_d = jnp.sum(kj[:, None, :] * dkk * kj[None, :, :], axis=-1)  # (sub, sub)
        qk_d = jnp.sum(qj[:, None, :] * dqk * kj[None, :, :], axis=-1)
        # place the diagonal block at columns [s0, s0 + sub) of the (sub, C) row block (an exact 0/1 matmul)
        place = (jax.lax.broadcasted_iota(jnp.int32, (sub, c), 1)
                 == jax.lax.broadcasted_iota(jnp.int32, (sub, c), 0) + s0).astype(F32)
        kk, qk = _mm(kk_d, place), _mm(qk_d, place)
        if j:
            r = G[s0 - 1:s0]  # cumulative decay just before this row block
            left = col < s0  # columns left of the block: factor exp(r - G_i) <= 1, exp(G_j - r) <= 1
            kl = k * jnp.exp(jnp.where(left, r - G, -jnp.inf))
            fj = jnp.exp(gj - r)
            kk = kk + _mm(kj * fj, kl, trans_b=True)
            qk = qk + _mm(qj * fj, kl, trans_b=True)
        rows_kk.append(kk)
        rows_qk.append(qk)
    return jnp.concatenate(rows_kk, axis=0), jnp.concatenate(rows_qk, axis=0)


def _decay_transposes(G, da, x, sub, want_x=True, want_y=True):
    """The transposes of :func:`_decay_products` (its backward): ``(X, Y)`` ``(C, K)`` with
    ``X_j = sum_{i <= j} da[j, i] x_i exp(G_j - G_i)`` and ``Y_i = sum_{j >= i} da[j, i] x_j exp(G_j - G_i)`` (``da``
    zero above the diagonal), by the same sub-chunk factoring (no exp of a positive exponent for non-increasing G)."""
    c, kd = x.shape
    col = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (sub, sub, kd), 0)
    ii = jax.lax.broadcasted_iota(jnp.int32, (sub, sub, kd), 1)
    xs, ys = [], []
    for b in range(c // sub):
        s0, s1 = b * sub, (b + 1) * sub
        gb, xb = G[s0:s1], x[s0:s1]
        place = (jax.lax.broadcasted_iota(jnp.int32, (sub, c), 1)
                 == jax.lax.broadcasted_iota(jnp.int32, (sub, c), 0) + s0).astype(F32)
        da_rows = da[s0:s1]                         # da[s0 + j', :]
        da_cols = _mm(place, da, trans_b=True)      # da[:, s0 + i'] as rows
        d_bb = _mm(da_rows, place, trans_b=True)    # da[s0 + j', s0 + i']
        dt_bb = _mm(da_cols, place, trans_b=True)   # da[s0 + j', s0 + i'] at [i', j']
        diff = gb[:, None, :] - gb[None, :, :]  # [j, i, :] = G_j - G_i
        xo = yo = jnp.zeros((sub, kd), F32)
        if want_x:  # the diagonal block, direct decays [sub, sub, K]
            xo = jnp.sum(d_bb[:, :, None] * xb[None, :, :] * jnp.exp(jnp.where(jj >= ii, diff, -jnp.inf)), axis=1)
        if want_y:  # [i, j, :]: da[j, i] x_j exp(G_j - G_i), j >= i
            yo = jnp.sum(dt_bb[:, :, None] * xb[None, :, :] * jnp.exp(jnp.where(ii >= jj, -diff, -jnp.inf)), axis=1)
        if b and want_x:  # columns left of the block, through the cumulative decay just before it
            r = G[s0 - 1:s0]
            xo = xo + jnp.exp(gb - r) * _mm(da_rows, x * jnp.exp(jnp.where(col < s0, r - G, -jnp.inf)))
        if s1 < c and want_y:  # rows below the block, through the cumulative decay at its end
            r = G[s1 - 1:s1]
            yo = yo + jnp.exp(r - gb) * _mm(da_cols, x * jnp.exp(jnp.where(col >= s1, G - r, -jnp.inf)))
        xs.append(xo)
        ys.append(yo)
    return jnp.concatenate(xs, axis=0), jnp.concatenate(ys, axis=0)


def _rows(lo, hi, c):
    """(c, 1) bool: rows lo <= r < hi of a block."""
    r = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    return (r >= lo) & (r < hi)


# ----------------------------------------------------------------------------------------- work items
def work_items(cu: list, t: int, chunk: int) -> np.ndarray:
    """int32 ``[6, n_items]`` table: per item its sequence, block (of ``chunk`` tokens, the block size the kernels
    use: ``min(chunk, T)``), first and last row ``[lo, hi)`` in the block, and whether it is the sequence's first
    and last item. Items are in token order; a zero-length sequence has one empty item (lo = hi)."""
    blk = _block_t(t, chunk)
    seq, block, lo, hi, first, last = [], [], [], [], [], []
    for n in range(len(cu) - 1):
        a, b = int(cu[n]), int(cu[n + 1])
        if a == b:
            bb = min(a, max(t - 1, 0)) // blk
            seq.append(n), block.append(bb), lo.append(0), hi.append(0), first.append(1), last.append(1)
            continue
        for bb in range(a // blk, (b - 1) // blk + 1):
            s, e = max(a, bb * blk), min(b, (bb + 1) * blk)
            seq.append(n), block.append(bb), lo.append(s - bb * blk), hi.append(e - bb * blk)
            first.append(int(s == a)), last.append(int(e == b))
    return np.asarray([seq, block, lo, hi, first, last], dtype=np.int32)


def _block_t(t: int, chunk: int) -> int:
    """Tokens per block: ``chunk``, or all of T when T is no larger (a block equal to the array's dim)."""
    return chunk if t > chunk else max(t, 1)


# ----------------------------------------------------------------------------------------- chunk forward
def _item(items_ref, refs):
    """This grid step's work item: ``(lo, hi, first, last, valid, arrays)``, the float32 rows of ``refs`` with every
    row outside ``[lo, hi)`` (another sequence's, or past the end) selected to 0."""
    i = pl.program_id(1)
    lo, hi, first, last = items_ref[2, i], items_ref[3, i], items_ref[4, i], items_ref[5, i]
    valid = _rows(lo, hi, refs[0].shape[0])
    return lo, hi, first, last, valid, [jnp.where(valid, r[...].astype(F32), 0.0) for r in refs]


def _chunk_step(q, k, v, g, beta, s0, sub):
    """The chunked form of one item from its starting state ``s0`` (module docstring): the intermediates, which the
    backward needs too; ``o = scale * (qe s0 + aqk delta)``, ``S1 = exp(glast) * s0 + kl^T delta``."""
    c = q.shape[0]
    if c % sub or c < sub:
        sub = c
    G = tk.scan.segment_cumsum(g)  # chunk-local cumulative log decay (rows outside [lo, hi) add 0)
    akk, aqk = _decay_products(G, k, q, sub)
    tinv = tk.scan.unit_lower_inverse(beta * akk)  # (I + diag(beta) A_kk)^-1
    eg = jnp.exp(G)
    bv, bk = beta * v, beta * k * eg
    w = _mm(tinv, bk)
    glast = G[c - 1:c]
    el = jnp.exp(glast - G)
    return dict(sub=sub, G=G, akk=akk, aqk=aqk, tinv=tinv, eg=eg, bv=bv, bk=bk, w=w, delta=_mm(tinv, bv) - _mm(w, s0),
                glast=glast, el=el, kl=k * el, qe=q * eg)


def _chunk_fwd_body(items_ref, q_ref, k_ref, v_ref, g_ref, b_ref, *rest, scale: float, has_h0: bool,
                    save_states: bool, sub: int):
    it = iter(rest)
    h0_ref = next(it) if has_h0 else None
    o_ref, ht_ref, hs_ref = next(it), next(it), next(it)  # hs_ref: an unused ANY ref without save_states
    s_ref = next(it)
    _, _, first, _, valid, (q, k, v, g, beta) = _item(items_ref, (q_ref, k_ref, v_ref, g_ref, b_ref))
    tk.scan.reset_carry(s_ref, when=first == 1, value=h0_ref[...] if has_h0 else None)
    s0 = s_ref[...]
    if save_states:
        hs_ref[...] = s0
    f = _chunk_step(q, k, v, g, beta, s0, sub)
    o = scale * (_mm(f["qe"], s0) + _mm(f["aqk"], f["delta"]))
    o_ref[...] = jnp.where(valid, o, o_ref[...].astype(F32)).astype(o_ref.dtype)
    s1 = tk.scan.row_to_col(jnp.exp(f["glast"])) * s0 + _mm(f["kl"], f["delta"], trans_a=True)
    s_ref[...] = s1
    ht_ref[...] = s1


def _common_specs(items, q, v, g, h0, chunk):
    """Grid, q/k/v/g/beta/h0 BlockSpecs and the block size of the item kernels."""
    hq, t, kd = q.shape
    hv, _, vd = v.shape
    grp = hv // hq
    bt = _block_t(t, chunk)

    def qmap(h, i, it):
        return (h // grp, it[1, i], 0)

    def vmap(h, i, it):
        return (h, it[1, i], 0)

    def smap(h, i, it):
        return (it[0, i], h, 0, 0)

    specs = [pl.BlockSpec((None, bt, kd), qmap), pl.BlockSpec((None, bt, kd), qmap),
             pl.BlockSpec((None, bt, vd), vmap), pl.BlockSpec((None, bt, kd), vmap),
             pl.BlockSpec((None, bt, 1), vmap)]
    if h0 is not None:
        specs.append(pl.BlockSpec((None, None, kd, vd), smap))
    return (hv, items.shape[1]), specs, bt, vmap, smap


def _check_kernel_args(op, items, q, k, v, g, beta, h0, n_seq):
    if len(q.shape) != 3 or tuple(k.shape) != tuple(q.shape):
        raise ArgumentError(f"{op}: q and k must be [H, T, K] alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    hq, t, kd = q.shape
    if len(v.shape) != 3 or v.shape[1] != t or v.shape[0] % max(hq, 1):
        raise ArgumentError(f"{op}: v must be [HV, T={t}, V] with HV a multiple of H={hq}, got {tuple(v.shape)}")
    hv, _, vd = v.shape
    if tuple(g.shape) != (hv, t, kd) or tuple(beta.shape) != (hv, t, 1):
        raise ArgumentError(f"{op}: g must be [HV, T, K] = {[hv, t, kd]} and beta [HV, T, 1], got {tuple(g.shape)}, "
                            f"{tuple(beta.shape)}")
    if len(items.shape) != 2 or items.shape[0] != 6 or np.dtype(items.dtype).name != "int32":
        raise ArgumentError(f"{op}: items must be the int32 [6, n_items] table of work_items(), got "
                            f"{tuple(items.shape)} {np.dtype(items.dtype).name}")
    if h0 is not None and (tuple(h0.shape) != (n_seq, hv, kd, vd) or np.dtype(h0.dtype).name != "float32"):
        raise ArgumentError(f"{op}: h0 must be float32 [N, HV, K, V] = {[n_seq, hv, kd, vd]}, got {tuple(h0.shape)} "
                            f"{np.dtype(h0.dtype).name}")


def _fwd_out_shapes(q, v, items, n_seq, save_states):
    hv, t, vd = v.shape
    kd = q.shape[2]
    outs = [tk.OutSpec((hv, t, vd), v.dtype), tk.OutSpec((n_seq, hv, kd, vd), np.float32)]
    outs.append(tk.OutSpec((items.shape[1] if save_states else 1, hv, kd, vd), np.float32))  # 1: never written
    return tuple(outs)


def _launch_fwd(body, items, q, k, v, g, beta, h0, n_seq, scale, chunk, save_states, op, extra_kw, scratch):
    _check_kernel_args(op, items, q, k, v, g, beta, h0, n_seq)
    grid, specs, bt, vmap, smap = _common_specs(items, q, v, g, h0, chunk)
    hv, t, vd = v.shape
    kd = q.shape[2]
    out_specs = [pl.BlockSpec((None, bt, vd), vmap), pl.BlockSpec((None, None, kd, vd), smap)]
    out_specs.append(pl.BlockSpec((None, None, kd, vd), lambda h, i, it: (i, h, 0, 0)) if save_states
                     else pl.BlockSpec(memory_space=pl.ANY))
    n_items = items.shape[1]
    flops = 2 * hv * n_items * bt * (bt * (kd + vd) + 3 * kd * vd)
    return tk.Launch(
        grid=grid, in_specs=specs, out_specs=out_specs,
        out_shape=_fwd_out_shapes(q, v, items, n_seq, save_states),
        scratch_shapes=[pltpu.VMEM((kd, vd), np.float32), *scratch(bt, kd, vd)],
        num_scalar_prefetch=1,
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=VMEM_LIMIT_BYTES,
        cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=int(hv * n_items * bt * kd * 3),
                                      bytes_accessed=int(4 * hv * t * (2 * kd + vd + 1) + 8 * n_seq * hv * kd * vd)),
        body_kwargs={"scale": float(scale), "has_h0": h0 is not None, "save_states": save_states, **extra_kw},
    )


def _fwd_out(items, q, k, v, g, beta, h0, n_seq, scale, chunk, save_states):
    return _fwd_out_shapes(q, v, items, n_seq, save_states)


@tk.tpu_kernel(_chunk_fwd_body, name="kda_chunk_fwd", namespace=NAMESPACE, out_shape=_fwd_out)
def kda_chunk_fwd(
    items: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: Optional[torch.Tensor], n_seq: int, scale: float, chunk: int, save_states: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked KDA forward over work items (internal op ``tpukernels::kda_chunk_fwd``; use :func:`chunk_kda`).

    Args:
        items: int32 ``[6, n_items]`` from :func:`work_items` (scalar-prefetched).
        q, k: ``[H, T, K]`` bf16/f32 (head-major packed tokens); v: ``[HV, T, V]``; g: ``[HV, T, K]`` log decay;
            beta: ``[HV, T, 1]``; h0: float32 ``[N, HV, K, V]`` or None (zeros).
        n_seq: N. scale: the query scale. chunk: tokens per block (a power of two, 16..128).
        save_states: also return every item's starting state (for the backward).

    Returns:
        ``(o [HV, T, V] in v's dtype, final states float32 [N, HV, K, V], item states float32
        [n_items, HV, K, V]`` (``[1, HV, K, V]``, unwritten, without save_states)``.
    """
    return _launch_fwd(_chunk_fwd_body, items, q, k, v, g, beta, h0, n_seq, scale, chunk, save_states,
                       "tpukernels::kda_chunk_fwd", {"sub": SUB_CHUNK}, lambda bt, kd, vd: [])


# ----------------------------------------------------------------------------------------- recurrent forward
def _rec_fwd_body(items_ref, q_ref, k_ref, v_ref, g_ref, b_ref, *rest, scale: float, has_h0: bool,
                  save_states: bool):
    it = iter(rest)
    h0_ref = next(it) if has_h0 else None
    o_ref, ht_ref, hs_ref = next(it), next(it), next(it)  # hs_ref: an unused ANY ref without save_states
    s_ref, of_ref = next(it), next(it)
    i = pl.program_id(1)
    lo, hi, first = items_ref[2, i], items_ref[3, i], items_ref[4, i]
    tk.scan.reset_carry(s_ref, when=first == 1, value=h0_ref[...] if has_h0 else None)
    if save_states:
        hs_ref[...] = s_ref[...]
    bt = q_ref.shape[0]
    # on the VPU (a (1, K) x (K, V) matmul would load the whole state into the MXU per token): q, k, g with the
    # tokens as columns, the state scaled, reduced over K and updated by broadcasts
    qt, kt, gt = (r[...].astype(F32).T for r in (q_ref, k_ref, g_ref))  # (K, bt)
    v, beta = v_ref[...].astype(F32), b_ref[...].astype(F32)
    for t in range(bt):
        @pl.when((lo <= t) & (t < hi))
        def _():
            kc = kt[:, t:t + 1]
            s = jnp.exp(gt[:, t:t + 1]) * s_ref[...]
            s = s + kc * (beta[t:t + 1] * (v[t:t + 1] - jnp.sum(s * kc, axis=0, keepdims=True)))
            s_ref[...] = s
            of_ref[t:t + 1, :] = scale * jnp.sum(s * qt[:, t:t + 1], axis=0, keepdims=True)

    o_ref[...] = jnp.where(_rows(lo, hi, bt), of_ref[...], o_ref[...].astype(F32)).astype(o_ref.dtype)
    ht_ref[...] = s_ref[...]


@tk.tpu_kernel(_rec_fwd_body, name="kda_recurrent_fwd", namespace=NAMESPACE, out_shape=_fwd_out)
def kda_recurrent_fwd(
    items: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: Optional[torch.Tensor], n_seq: int, scale: float, chunk: int, save_states: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-by-token KDA forward over work items (internal op ``tpukernels::kda_recurrent_fwd``; use
    :func:`fused_recurrent_kda`). Arguments and results as :func:`kda_chunk_fwd`."""
    return _launch_fwd(_rec_fwd_body, items, q, k, v, g, beta, h0, n_seq, scale, chunk, save_states,
                       "tpukernels::kda_recurrent_fwd", {},
                       lambda bt, kd, vd: [pltpu.VMEM((bt, vd), np.float32)])


# ----------------------------------------------------------------------------------------- backward
def _bwd_out(items, q, k, v, g, beta, hs, do, dht, n_seq, scale, chunk):
    hv, t, vd = v.shape
    kd = q.shape[2]
    f = np.float32
    return (tk.OutSpec((hv, t, kd), f), tk.OutSpec((hv, t, kd), f), tk.OutSpec((hv, t, vd), f),
            tk.OutSpec((hv, t, kd), f), tk.OutSpec((hv, t, 1), f), tk.OutSpec((n_seq, hv, kd, vd), f))


def _chunk_bwd_body(items_ref, q_ref, k_ref, v_ref, g_ref, b_ref, hs_ref, do_ref, *rest, scale: float,
                    has_dht: bool, sub: int):
    it = iter(rest)
    dht_ref = next(it) if has_dht else None
    dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref = (next(it) for _ in range(6))
    ds_ref = next(it)
    _, _, _, last, valid, (q, k, v, g, beta, do) = _item(items_ref, (q_ref, k_ref, v_ref, g_ref, b_ref, do_ref))
    tk.scan.reset_carry(ds_ref, when=last == 1, value=dht_ref[...] if has_dht else None)
    s0 = hs_ref[...]
    f = _chunk_step(q, k, v, g, beta, s0, sub)  # the forward of the chunk, again
    sub, G, akk, aqk, tinv, eg, bv, bk, w, delta, glast, el, kl, qe = (
        f[n] for n in ("sub", "G", "akk", "aqk", "tinv", "eg", "bv", "bk", "w", "delta", "glast", "el", "kl", "qe"))
    c = q.shape[0]
    ds1 = ds_ref[...]
    # o = scale (qe S0 + A_qk delta);  S1 = exp(G_last) S0 + kl^T delta
    dd = scale * _mm(aqk, do, trans_a=True) + _mm(kl, ds1)
    daqk = jnp.where(tk.scan.lower_mask(c), scale * _mm(do, delta, trans_b=True), 0.0)
    dqe = scale * _mm(do, s0, trans_b=True)
    dkl = _mm(delta, ds1, trans_b=True)
    ds0 = scale * _mm(qe, do, trans_a=True) + tk.scan.row_to_col(jnp.exp(glast)) * ds1 - _mm(w, dd, trans_a=True)
    dq = dqe * eg
    dk = dkl * el
    dG = dqe * qe - dkl * kl
    dglast = (jnp.sum(dkl * kl, axis=0, keepdims=True)
              + _mm(jnp.ones((1, ds1.shape[1]), F32), ds1 * s0, trans_b=True) * jnp.exp(glast))
    # delta = T bv - T bk S0
    dw = -_mm(dd, s0, trans_b=True)
    dT = _mm(dd, bv, trans_b=True) + _mm(dw, bk, trans_b=True)
    dbv = _mm(tinv, dd, trans_a=True)
    dbk = _mm(tinv, dw, trans_a=True)
    dv = beta * dbv
    dbeta = jnp.sum(v * dbv, axis=1, keepdims=True) + jnp.sum(k * eg * dbk, axis=1, keepdims=True)
    dk = dk + beta * eg * dbk
    dG = dG + bk * dbk
    # T = (I + diag(beta) A_kk)^-1
    dl = jnp.where(tk.scan.lower_mask(c, strict=True), -_mm(_mm(tinv, dT, trans_a=True), tinv, trans_b=True), 0.0)
    dbeta = dbeta + jnp.sum(dl * akk, axis=1, keepdims=True)
    xk, yk = _decay_transposes(G, beta * dl, k, sub)   # A_kk[j, i] = sum k_j k_i exp(G_j - G_i)
    xq, _ = _decay_transposes(G, daqk, k, sub, want_y=False)  # A_qk[j, i] = sum q_j k_i exp(G_j - G_i): X for dq,
    _, yqq = _decay_transposes(G, daqk, q, sub, want_x=False)  # Y (of q) for dk
    dk = dk + xk + yk + yqq
    dq = dq + xq
    dG = dG + k * xk - k * yk + q * xq - k * yqq
    last_row = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
    dG = dG + jnp.where(last_row, dglast, 0.0)
    dg = tk.scan.segment_cumsum(dG, reverse=True)
    for ref, val in ((dq_ref, dq), (dk_ref, dk), (dv_ref, dv), (dg_ref, dg), (db_ref, dbeta)):
        ref[...] = jnp.where(valid, val, ref[...])
    ds_ref[...] = ds0
    dh0_ref[...] = ds0


@tk.tpu_kernel(_chunk_bwd_body, name="kda_chunk_bwd", namespace=NAMESPACE, out_shape=_bwd_out)
def kda_chunk_bwd(
    items: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    hs: torch.Tensor, do: torch.Tensor, dht: Optional[torch.Tensor], n_seq: int, scale: float, chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KDA backward chunk by chunk (internal op ``tpukernels::kda_chunk_bwd``): the transpose of the chunked form,
    items in reverse order, dS carried back; the backward of both forward kernels.

    Args:
        items: the forward's work items, **in reverse order** (``work_items(...)[:, ::-1]``).
        q, k, v, g, beta: as the forward; hs: float32 ``[n_items, HV, K, V]`` the forward's item starting states
            (reversed like items); do: ``[HV, T, V]`` the output's gradient; dht: float32 ``[N, HV, K, V]`` the final
            state's gradient or None.

    Returns:
        float32 ``(dq [HV, T, K], dk [HV, T, K], dv [HV, T, V], dg [HV, T, K], dbeta [HV, T, 1],
        dh0 [N, HV, K, V])`` (dq / dk per value head: the caller sums each group of HV / H heads).
    """
    op = "tpukernels::kda_chunk_bwd"
    _check_kernel_args(op, items, q, k, v, g, beta, None, n_seq)
    hv, t, vd = v.shape
    kd = q.shape[2]
    n_items = items.shape[1]
    for name, x, want in (("hs", hs, (n_items, hv, kd, vd)), ("do", do, (hv, t, vd)),
                          ("dht", dht, (n_seq, hv, kd, vd))):
        if x is not None and tuple(x.shape) != want:
            raise ArgumentError(f"{op}: {name} must be {list(want)}, got {tuple(x.shape)}")
    grid, specs, bt, vmap, smap = _common_specs(items, q, v, g, None, chunk)
    specs += [pl.BlockSpec((None, None, kd, vd), lambda h, i, it: (i, h, 0, 0)),
              pl.BlockSpec((None, bt, vd), vmap)]
    if dht is not None:
        specs.append(pl.BlockSpec((None, None, kd, vd), smap))
    kspec, vspec = pl.BlockSpec((None, bt, kd), vmap), pl.BlockSpec((None, bt, vd), vmap)
    return tk.Launch(
        grid=grid, in_specs=specs,
        out_specs=[kspec, kspec, vspec, kspec, pl.BlockSpec((None, bt, 1), vmap),
                   pl.BlockSpec((None, None, kd, vd), smap)],
        out_shape=_bwd_out(items, q, k, v, g, beta, hs, do, dht, n_seq, scale, chunk),
        scratch_shapes=[pltpu.VMEM((kd, vd), np.float32)],
        num_scalar_prefetch=1,
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=VMEM_LIMIT_BYTES,
        cost_estimate=pl.CostEstimate(flops=int(6 * hv * n_items * bt * (bt * (kd + vd) + 3 * kd * vd)),
                                      transcendentals=int(hv * n_items * bt * kd * 6),
                                      bytes_accessed=int(4 * hv * t * 2 * (3 * kd + 2 * vd + 1))),
        body_kwargs={"scale": float(scale), "has_dht": dht is not None, "sub": SUB_CHUNK},
    )


def _gradients(ctx, do, dht, _dhs):
    """Gradients of either forward kernel by :func:`kda_chunk_bwd` (items reversed, from the saved item states)."""
    items, n_seq = ctx.items, ctx.n_seq
    if not ctx.save_states:
        raise ArgumentError("tpukernels::kda_chunk_fwd / kda_recurrent_fwd: gradients need save_states=True (the "
                            "backward restarts from the item states; chunk_kda / fused_recurrent_kda set it)")
    hs = ctx.outputs[2]
    if do is None:
        do = torch.zeros_like(ctx.outputs[0])
    rev = torch.flip(items, dims=(1,)).contiguous()
    hsr = torch.flip(hs, dims=(0,)).contiguous()
    dq, dk, dv, dg, db, dh0 = kda_chunk_bwd(rev, ctx.q, ctx.k, ctx.v, ctx.g, ctx.beta, hsr,
                                            do.contiguous(), None if dht is None else dht.float().contiguous(),
                                            n_seq, ctx.scale, ctx.chunk)
    hq, hv = ctx.q.shape[0], ctx.v.shape[0]
    grp = hv // hq
    out = {}
    for name, grad in (("q", dq), ("k", dk)):
        if ctx.needs_input_grad.get(name):
            grad = grad.reshape(hq, grp, *grad.shape[1:]).sum(1)
            out[name] = grad.to(getattr(ctx, name).dtype)
    for name, grad in (("v", dv), ("g", dg), ("beta", db), ("h0", dh0)):
        if ctx.needs_input_grad.get(name):
            out[name] = grad.to(getattr(ctx, name).dtype)
    return out


kda_chunk_fwd.def_backward(_gradients, op="chunk_kda")
kda_recurrent_fwd.def_backward(_gradients, op="fused_recurrent_kda")


# ----------------------------------------------------------------------------------------- public API
def _check_public(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
                  chunk_size):
    """Every argument rule of the public ops (module docstring), before anything runs; returns N."""
    n = check_delta_rule_args(op, q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                              chunk_size=chunk_size, per_channel_gate=True, dtypes=_SUPPORTED)
    kd, hv = q.shape[3], v.shape[2]
    if kd > MAX_HEAD_DIM:
        raise ArgumentError(f"{op}: the key head dim K = {kd} must be at most {MAX_HEAD_DIM} (fla's bound)")
    if use_gate_in_kernel:
        if not isinstance(A_log, torch.Tensor) or A_log.numel() != hv:
            raise ArgumentError(f"{op}: use_gate_in_kernel needs A_log with HV = {hv} elements, got {shape_of(A_log)}")
        if dt_bias is not None and (not isinstance(dt_bias, torch.Tensor) or dt_bias.numel() != hv * kd):
            raise ArgumentError(f"{op}: dt_bias must have HV * K = {hv * kd} elements, got {shape_of(dt_bias)}")
    elif A_log is not None or dt_bias is not None:
        raise ArgumentError(f"{op}: A_log / dt_bias are used only with use_gate_in_kernel=True")
    return n


def kda_gate_reference(g, A_log, dt_bias=None):
    """fla's KDA gate ``-exp(A_log) * softplus(g + dt_bias)`` in float32, ``g [..., HV, K]`` (fla
    ``naive_kda_gate``)."""
    hv, kd = g.shape[-2:]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(hv, kd)
    return -A_log.float().reshape(hv, 1).exp() * torch.nn.functional.softplus(x)


def _l2norm(x):
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _widen(x):
    return x.float() if x.dtype == torch.float16 else x


_UNSUPPORTED = ("safe_gate", "lower_bound", "state_v_first", "return_intermediate_states", "cp_context", "use_graph",
                "cu_seqlens_cpu", "disable_recompute", "max_num_seqs", "ssm_state_indices", "num_accepted_tokens",
                "inplace_final_state", "out")


def _run(op, kernel, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
         use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
         chunk_size, kwargs):
    for name, val in kwargs.items():
        if name in _UNSUPPORTED:
            if val in (None, False):
                continue
            raise ArgumentError(f"{op}: {name}={val!r} is not supported (fla's option; see the module docstring)")
        raise ArgumentError(f"{op}: unknown argument {name!r}")
    n = _check_public(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
                      chunk_size)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ArgumentError(f"{op}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as fla)")
    b, t, h, kd = q.shape
    hv = v.shape[2]
    scale = kd ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate_reference(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    cu = list(range(0, b * t + 1, t)) if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    if b * t == 0:  # nothing to run: the final states are the initial ones
        o = v.new_zeros(v.shape)
        fin = (initial_state.clone() if initial_state is not None
               else q.new_zeros((n, hv, kd, v.shape[3]), dtype=torch.float32)) if output_final_state else None
        return o, fin
    items = torch.from_numpy(work_items(cu, b * t, chunk_size)).to(q.device)

    qh, kh, vh, gh = (head_major(_widen(x)) for x in (q, k, v, g))
    bh = _widen(beta).reshape(b * t, hv).transpose(0, 1).unsqueeze(-1).contiguous()
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                           for x in (qh, kh, vh, gh, bh, initial_state))
    o, fin, _ = kernel(items, qh, kh, vh, gh, bh, initial_state, n, scale, chunk_size, bool(save))
    o = o.transpose(0, 1).reshape(b, t, hv, v.shape[3]).to(v.dtype)
    return o, (fin if output_final_state else None)


def chunk_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, chunk_size: int = 64, **kwargs,
):
    """Chunked KDA (prefill) with flash-linear-attention's ``chunk_kda`` semantics (module docstring).

    Args:
        q, k: ``[B, T, H, K]`` bf16/f16/f32, ``K <= 256``. v: ``[B, T, HV, V]``, ``HV`` a multiple of H.
        g: ``[B, T, HV, K]`` per-channel log decay (<= 0; with ``use_gate_in_kernel`` the raw gate input).
        beta: ``[B, T, HV]`` (post-sigmoid; raw logits with ``use_beta_sigmoid_in_kernel``).
        scale: query scale, default ``K ** -0.5``.
        initial_state: float32 ``[N, HV, K, V]`` (N = B, or the number of sequences with cu_seqlens). Never
            modified.
        output_final_state: also return the float32 final states ``[N, HV, K, V]``.
        cu_seqlens: int ``[N + 1]``: N sequences packed in ``T`` tokens (B = 1), 0, non-decreasing, ending at T.
        use_qk_l2norm_in_kernel: l2-normalize q and k over K first (fla's ``x / sqrt(sum x^2 + 1e-6)``).
        use_gate_in_kernel, A_log ``[HV]``, dt_bias ``[HV * K]``: g becomes ``-exp(A_log) * softplus(g + dt_bias)``.
        use_beta_sigmoid_in_kernel, allow_neg_eigval: beta becomes ``sigmoid(beta)`` (times 2).
        chunk_size: tokens per chunk, a power of two in ``common.CHUNK_SIZES`` (16..128, default 64).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state float32 [N, HV, K, V] or None)``. Differentiable in q, k, v,
        g, beta and initial_state (A_log, dt_bias through torch).

    Raises:
        ArgumentError: shapes (each argument named with the shape it must have), mismatched heads, bad
            cu_seqlens, B != 1 with cu_seqlens, chunk_size not a power of two in range, unsupported fla options.
        DTypeError: dtypes other than bf16/f16/f32, a state not float32. DeviceError: arguments on other devices.
    """
    return _run("tpukernels.chunk_kda", kda_chunk_fwd, q, k, v, g, beta, scale, initial_state, output_final_state,
                cu_seqlens, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                allow_neg_eigval, chunk_size, kwargs)


def fused_recurrent_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, chunk_size: int = 16, **kwargs,
):
    """Recurrent KDA (decode: one or a few tokens per sequence, state in and out), fla's ``fused_recurrent_kda``.

    Arguments, results and errors as :func:`chunk_kda` (``chunk_size``: tokens per work item, default 16). The
    state is returned, never updated in place (fla's ``inplace_final_state`` / ``ssm_state_indices`` are typed
    errors).
    """
    return _run("tpukernels.fused_recurrent_kda", kda_recurrent_fwd, q, k, v, g, beta, scale, initial_state,
                output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                use_beta_sigmoid_in_kernel, allow_neg_eigval, chunk_size, kwargs)


# ----------------------------------------------------------------------------------------- float64 reference
def kda_reference(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None):
    """float64 ``(o [B, T, HV, V], final_state [N, HV, K, V])`` of the given values: the naive token recurrence
    (module docstring), per row or per packed sequence."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    grp = hv // h
    scale = kd ** -0.5 if scale is None else scale
    qd = q.double().repeat_interleave(grp, dim=2).reshape(b * t, hv, kd) * scale
    kk = k.double().repeat_interleave(grp, dim=2).reshape(b * t, hv, kd)
    vv, gg, bb = v.double().reshape(b * t, hv, vd), g.double().reshape(b * t, hv, kd), beta.double().reshape(b * t, hv)
    cu = list(range(0, b * t + 1, t)) if cu_seqlens is None else [int(x) for x in cu_seqlens]
    o = torch.zeros(b * t, hv, vd, dtype=torch.float64)
    finals = []
    for n in range(len(cu) - 1):
        s = (initial_state[n].double().clone() if initial_state is not None
             else torch.zeros(hv, kd, vd, dtype=torch.float64))
        for i in range(cu[n], cu[n + 1]):
            s = s * gg[i].exp()[..., None]
            delta = bb[i][:, None] * (vv[i] - torch.einsum("hk,hkv->hv", kk[i], s))
            s = s + kk[i][..., None] * delta[:, None, :]
            o[i] = torch.einsum("hk,hkv->hv", qd[i], s)
        finals.append(s)
    return o.reshape(b, t, hv, vd), torch.stack(finals)


def _shapes(cu, chunk, state):
    """``(args, kwargs)`` of a forward kernel on 32 heads, K = V = 128, bf16, sequences packed by ``cu``."""
    t, n = cu[-1], len(cu) - 1
    x = f"32x{t}x128:bf16"
    return ((f"6x{work_items(cu, t, chunk).shape[1]}:i32", x, x, x, x, f"32x{t}x1:bf16", state),
            {"n_seq": n, "scale": 128 ** -0.5, "chunk": chunk, "save_states": False})


#: ``(args, kwargs)`` of :func:`kda_chunk_fwd` at Kimi-Linear-48B-A3B's KDA layer (32 heads, K = V = 128, bf16, chunk
#: 64): prefill of 4096 tokens as one sequence and as two packed ones (1000 + 3096) with initial states. Compiled by
#: the aot tests; no tuning tables are shipped for these kernels.
STANDARD_SHAPES = [_shapes([0, 4096], 64, None), _shapes([0, 1000, 4096], 64, "2x32x128x128:f32")]
#: ``(args, kwargs)`` of :func:`kda_recurrent_fwd` at the same layer: decode of 256 and of 4 sequences, one token
#: each, with their states (chunk 16, the default of fused_recurrent_kda).
DECODE_SHAPES = [_shapes(list(range(n + 1)), 16, f"{n}x32x128x128:f32") for n in (256, 4)]
