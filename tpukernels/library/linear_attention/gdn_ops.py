"""Gated DeltaNet (GDN): chunked prefill and recurrent decode, forward and backward.

Written with the tpukernels DSL (``@tpu_kernel``; the in-kernel helpers of :mod:`tpukernels.dsl.scan`), torch
namespace ``tpukernels``.

Public API (torch tensors; flash-linear-attention's signatures, the functions transformers' Qwen3-Next calls)::

    chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=128)
        -> (o, final_state or None)                      fla ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
    fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                                     ssm_state_indices=None, inplace_final_state=False)
        -> (o, final_state or None)                      fla ``fused_recurrent_gated_delta_rule`` (+ vLLM's indices)
    gated_delta_rule_reference(...)                      float64 naive recurrence (the executable specification)

Formula (per sequence, per value head ``h``; ``q, k`` of query/key head ``h // (HV / H)``; state ``S [K, V]``)::

    S_t = exp(g_t) S_{t-1}                                 (g: log-space decay, <= 0)
    u_t = beta_t (v_t - S_t^T k_t)                         (the delta rule: v minus what S recalls for k)
    S_t = S_t + k_t u_t^T
    o_t = scale * S_t^T q_t                                (scale default K ** -0.5)

Shapes: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]`` with ``HV`` a multiple of ``H`` (fla's
grouped value heads: Qwen3-Next has 16 key heads and 32 value heads; fla maps value head ``i`` to key head
``i // (HV / H)``, which is what ``repeat_interleave`` of q / k in transformers' torch path does, so no repeat
is needed here). States ``[N, HV, K, V]`` float32, ``N = B`` or the number of packed sequences. ``o`` is
``[B, T, HV, V]`` in v's dtype. bf16 / f32 inputs; float32 arithmetic and state.

Chunked form (the UT / WY transform; fla's ``chunk.py`` and ``naive.py``). For a chunk of ``C`` tokens of one
sequence with state ``S0`` at its start, ``G = cumsum(g)``, ``D[i, j] = exp(G_i - G_j)`` (``i >= j``)::

    A = strict_lower(diag(beta) (K K^T o D));  T = (I + A)^-1
    U = T diag(beta) (V - diag(exp G) K S0)                (U = the u_t of the chunk, "v_new" in fla)
    O = scale * (diag(exp G) Q S0 + (Q K^T o D) U)
    S_C = exp(G_C) S0 + K^T diag(exp(G_C - G)) U

Design. Tokens are packed head-major (``[H, B*T, K]``: a transpose on the host; B rows without cu_seqlens are
N = B packed sequences of length T). One kernel per direction, grid ``(HV, cdiv(B*T, C))``, the chunk axis
sequential (``"arbitrary"``) with the running state in VMEM scratch (``dsl.scan.reset_carry`` semantics).
``cu_seqlens`` is scalar-prefetched; the launch derives per chunk the range of sequences that touch it. A
chunk is processed once per sequence touching it (usually one; two at a boundary): the chunk step above runs
on the rows of that sequence only, every other row selected to zero with ``jnp.where`` (so another
sequence's NaN never reaches it), its initial state the carried one (sequence continues from the previous
chunk) or its own ``initial_state`` (read by DMA from HBM), its end state carried on or written (DMA) as
that sequence's final state. Packed sequences are never padded: a sequence starting mid-chunk costs one
more pass over that chunk. The triangular inverse is ``dsl.scan.unit_lower_inverse`` (block substitution
by doubling, MXU matmuls); the decays ``dsl.scan.segment_cumsum`` / ``pairwise_decay``.

Backward (``dq, dk, dv, dg, dbeta, dinitial_state``): the forward is re-run saving the state at every chunk
start, then one kernel walks the chunks in reverse (grid over ``NC - 1 - c``), recomputes each chunk step
and applies its exact transpose (hand-derived, written out in ``_chunk_bwd``), carrying ``dS`` backward
in scratch. Grouped heads: dq / dk are per value head in float32, summed over the group on the host.

Decode (``fused_recurrent_gated_delta_rule``): the token loop itself on the VPU (grid ``(B, HV / block_h)``, all
parallel; q / k passed transposed so a token's key is a column for the outer product ``k u^T``; no MXU, whose
``M = 1`` matmuls would reload the whole state per token), ``block_h`` value heads per step (tunable; the
heuristic takes the most whose state blocks fit :data:`DECODE_VMEM_BUDGET_BYTES`), state in and out. With
``ssm_state_indices`` (vLLM) row ``b`` reads ``initial_state[ssm_state_indices[b]]`` through the index map (no
gather copy) and, with ``inplace_final_state=True``, the new states are scattered back there after the kernel
(``index_copy_`` of the B updated states, never a whole-pool copy; the kernel output is not aliased to the
pool); otherwise nothing passed in is modified. Gradients through it run the chunked kernels.

Performance notes (compile-only: every kernel lowers for v5e, v6e and tpu7x at Qwen3-Next-80B-A3B's layer,
16 q/k heads, 32 v heads, K = V = 128; not yet timed on a chip). libtpu's static estimate (``tpukernels bench
--family linear_attention``, a model): prefill at T = 4096 4.0 ms on v6e and 3.4 ms on tpu7x at the default
chunk 128, about 3.3x faster than XLA's chunked form but ~60x the roofline, 63% of it the triangular inverse's
small dependent matmuls (the family's reasons have the breakdown and the levers); decode at the HBM roofline
on v5e / v6e, 76.5% of it on tpu7x (VPU-bound). At chunk 64: per grid step blocks q, k ``(64, 128)`` bf16,
v / o ``(64, 128)``,
g / beta ``(64, 1)`` f32, state scratch 64 KiB; 0.5 MiB of VMEM (backward 0.9 MiB). Per chunk and head ~17
MFLOP of matmuls (``KK^T``, ``QK^T``, ``K S``, ``Q S``, ``T R``, ``P U``, ``K^T W U``: 10.5 M; the inverse's 12
dependent ``64^3`` products: 6.3 M), all at ``Precision.HIGHEST`` (6 bf16 passes), i.e. ~200 GFLOP-equivalent
for 4096 tokens x 32 heads against ~135 MB of HBM traffic: MXU-bound (>= 0.2 ms on v6e, >= 1 ms on v5e) before
any overhead (``QK^T`` and ``KK^T`` of bf16 inputs already run as exact single bf16 passes). Levers, in order:
``HIGH`` (3 passes) for the state products (fla runs these in tf32 on GPUs); a 16-row block substitution
for the inverse (fewer, smaller levels); split heads' V across a grid axis for megacore when HV is small;
head-major BlockSpecs over fla's ``[B, T, H, K]`` layout to drop the host transposes (one extra HBM pass of
q / k / v / o each); a lane-dense layout for g / beta. Packed batches: a chunk holding the boundary of m
sequences is processed m times (fine for long prompts; many very short sequences belong on the decode
kernel). Decode, 64 rows x 32 heads from a pool: 268 MB of state read + written per step (HBM roofline
0.17 ms on v6e, 0.33 ms on v5e); ``block_h = 32`` moves 8 MiB per grid step (11 MiB of VMEM with
double-buffering).

Not covered (vs fla): ``use_qk_l2norm_in_kernel`` normalizes q and k in torch before the kernel (eps 1e-6, as
fla's l2norm and tpu-inference's reference), not inside it; fla's ``gk`` / ``gv`` (per-channel gates: KDA),
``use_gate_in_kernel`` / ``A_log`` / ``dt_bias``, ``state_v_first``, context parallelism, and ``head_first``
layouts are not offered; fla's ``chunk_indices`` is derived here. Gradients with ``ssm_state_indices`` are
not supported (a typed error).
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
from ...chips import MiB
from ...dsl import scan
from ...errors import ArgumentError, DTypeError, NotSupportedError
from .common import CHUNK_SIZES, INT_DTYPES, check_delta_rule_args, head_major

__all__ = [
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "gated_delta_rule_reference",
    "gdn_chunk_fwd", "gdn_chunk_bwd", "gdn_recurrent_fwd", "CHUNK_SIZES", "STANDARD_SHAPES",
]

NAMESPACE = "tpukernels"
#: the prefill chunk: 128, not fla's 64, since the chunk step's cost is dominated by the count of small dependent
#: matmuls (the inverse's), which a longer chunk amortizes: libtpu's estimate at Qwen3-Next's layer, v6e, T =
#: 4096, is 5,668 us at 64 and 4,048 us at 128 (``tpukernels bench --family linear_attention``); the float64
#: error of o and of the state is the same at both (``tests/test_gated_delta_rule.py::test_chunk_sizes_agree``)
DEFAULT_CHUNK = 128
F32 = jnp.float32
_INT = INT_DTYPES
VMEM_LIMIT_BYTES = 48 * MiB


# ----------------------------------------------------------------------------------------- chunk step
def _chunk_step(q, k, v, g, beta, s0, scale, bf16_qk=False):
    """One chunk of one sequence (rows of other sequences already zero): ``(o, S_end)``, float32.

    q, k ``(C, K)``; v ``(C, V)``; g, beta ``(C, 1)``; s0 ``(K, V)``. bf16_qk: q and k hold bf16 values, so
    ``K K^T`` and ``Q K^T`` run as exact single-pass bf16 matmuls.
    """
    c = q.shape[0]
    G = scan.segment_cumsum(g)
    eG = jnp.exp(G)
    dq = scan.pairwise_decay(G, scan.lower_mask(c))
    dm = scan.pairwise_decay(G, scan.lower_mask(c, strict=True))
    kk = scan.matmul(k, k, trans_b=True, exact_bf16=bf16_qk)
    tinv = scan.unit_lower_inverse(beta * kk * dm)
    ks = scan.matmul(k, s0)
    u = scan.matmul(tinv, beta * (v - eG * ks))
    p = scan.matmul(q, k, trans_b=True, exact_bf16=bf16_qk) * dq
    o = scale * (eG * scan.matmul(q, s0) + scan.matmul(p, u))
    gl = G[c - 1:c, :]
    s_end = jnp.exp(gl) * s0 + scan.matmul(k, jnp.exp(gl - G) * u, trans_a=True)
    return o, s_end


def _chunk_bwd(q, k, v, g, beta, s0, do, dsf, scale, bf16_qk=False):
    """The transpose of :func:`_chunk_step`: ``(dq, dk, dv, dg, dbeta, ds0)`` given ``do (C, V)`` and the
    gradient ``dsf (K, V)`` of the end state. Recomputes the forward (float32 throughout)."""
    c = q.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    G = scan.segment_cumsum(g)
    eG = jnp.exp(G)
    lo, st = scan.lower_mask(c), scan.lower_mask(c, strict=True)
    Dq = scan.pairwise_decay(G, lo)
    Dm = scan.pairwise_decay(G, st)
    KK = scan.matmul(k, k, trans_b=True, exact_bf16=bf16_qk)
    tinv = scan.unit_lower_inverse(beta * KK * Dm)
    KS = scan.matmul(k, s0)
    X = v - eG * KS
    U = scan.matmul(tinv, beta * X)
    QK = scan.matmul(q, k, trans_b=True, exact_bf16=bf16_qk)
    P = QK * Dq
    QS = scan.matmul(q, s0)
    gl = G[c - 1:c, :]
    egl = jnp.exp(gl)
    wdec = jnp.exp(gl - G)

    def total(x):  # (1, 1)
        return jnp.sum(jnp.sum(x, axis=1, keepdims=True), axis=0, keepdims=True)

    dos = scale * do
    # o = eG * QS + P U
    dQS = eG * dos
    deG = jnp.sum(dos * QS, axis=1, keepdims=True)
    dP = scan.matmul(dos, U, trans_b=True)
    dU = scan.matmul(P, dos, trans_a=True)
    ds0 = scan.matmul(q, dQS, trans_a=True)
    dq = scan.matmul(dQS, s0, trans_b=True)
    dQK = dP * Dq
    dDq = dP * QK
    dq = dq + scan.matmul(dQK, k)
    dk = scan.matmul(dQK, q, trans_a=True)
    # S_end = egl * s0 + K^T (wdec * U)
    ds0 = ds0 + egl * dsf
    dgl = total(dsf * s0) * egl
    WU = wdec * U
    dWU = scan.matmul(k, dsf)
    dk = dk + scan.matmul(WU, dsf, trans_b=True)
    dU = dU + wdec * dWU
    t = jnp.sum(dWU * U, axis=1, keepdims=True) * wdec
    dgl = dgl + total(t)
    dG = -t
    # U = tinv (beta * X)
    dR = scan.matmul(tinv, dU, trans_a=True)
    dA = jnp.where(st, -scan.matmul(dR, U, trans_b=True), 0.0)
    dbeta = jnp.sum(dR * X, axis=1, keepdims=True)
    dX = beta * dR
    dv = dX
    deG = deG - jnp.sum(dX * KS, axis=1, keepdims=True)
    dKS = -eG * dX
    dk = dk + scan.matmul(dKS, s0, trans_b=True)
    ds0 = ds0 + scan.matmul(k, dKS, trans_a=True)
    # A = beta * KK * Dm
    dbeta = dbeta + jnp.sum(dA * KK * Dm, axis=1, keepdims=True)
    dKKD = beta * dA
    dKK = dKKD * Dm
    dDm = dKKD * KK
    dk = dk + scan.matmul(dKK, k) + scan.matmul(dKK, k, trans_a=True)
    # D = exp(G_i - G_j): dG_i += sum_j dE_ij, dG_j -= sum_i dE_ij
    dE = dDq * Dq + dDm * Dm
    ones = jnp.ones((c, 1), F32)
    dG = dG + jnp.sum(dE, axis=1, keepdims=True) - scan.matmul(dE, ones, trans_a=True)
    dG = dG + deG * eG
    dG = dG + jnp.where(row == c - 1, dgl, 0.0)
    dg = scan.segment_cumsum(dG, reverse=True)
    return dq, dk, dv, dg, dbeta, ds0


# ----------------------------------------------------------------------------------------- chunk tables
def _chunk_tables(cu, ntok: int, chunk: int):
    """``(lo, hi, starts, ends)`` int32 from ``cu [N + 1]``: chunk ``c`` is touched by sequences
    ``lo[c] .. hi[c]`` (an empty sequence belongs to the chunk holding its start, the last chunk at the end)."""
    nc = max(-(-ntok // chunk), 1)
    cu = cu.astype(jnp.int32)
    st, en = cu[:-1], cu[1:]
    fc = jnp.minimum(st // chunk, nc - 1)
    lc = jnp.maximum(fc, (en - 1) // chunk)
    c = jnp.arange(nc, dtype=jnp.int32)
    lo = jnp.searchsorted(lc, c, side="left").astype(jnp.int32)
    hi = (jnp.searchsorted(fc, c, side="right") - 1).astype(jnp.int32)
    return lo, hi, st, en


def _seq_mask(c, chunk, start, end):
    pos = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    return jnp.logical_and(pos >= start, pos < end)


def _dma(src, dst, sem):
    cp = pltpu.make_async_copy(src, dst, sem)
    cp.start()
    cp.wait()


def _start_state(continuing, carry, has_h0, h0_src, buf_ref, sem):
    """The state a sequence's chunk starts from: the carried one, else its ``initial_state`` row (DMA from HBM)
    or zeros."""
    @pl.when(jnp.logical_not(continuing))
    def _():
        if has_h0:
            _dma(h0_src, buf_ref, sem)
        else:
            buf_ref[...] = jnp.zeros(buf_ref.shape, F32)

    return jnp.where(continuing, carry, buf_ref[...])


# ----------------------------------------------------------------------------------------- forward kernel
def _fwd_body(lo_ref, hi_ref, st_ref, en_ref, q_ref, k_ref, v_ref, g_ref, b_ref, *rest, chunk, scale, has_h0,
              save_states):
    it = iter(rest)
    h0_hbm = next(it) if has_h0 else None
    o_ref, ht_hbm, hc_ref = next(it), next(it), next(it)
    carry_ref, buf_ref, sem = next(it), next(it), next(it)
    h, c = pl.program_id(0), pl.program_id(1)
    bf16_qk = q_ref.dtype == jnp.bfloat16
    scan.reset_carry(carry_ref, axis=1)
    if save_states:
        hc_ref[...] = carry_ref[...]
    q, k, v = q_ref[...].astype(F32), k_ref[...].astype(F32), v_ref[...].astype(F32)
    g, beta = g_ref[...].astype(F32), b_ref[...].astype(F32)

    def one(s, o_acc):
        start, end = st_ref[s], en_ref[s]
        m = _seq_mask(c, chunk, start, end)
        continuing = start < c * chunk
        s0 = _start_state(continuing, carry_ref[...], has_h0, h0_hbm.at[s, h] if has_h0 else None, buf_ref, sem)
        z = lambda x: jnp.where(m, x, 0.0)  # noqa: E731
        o, s_end = _chunk_step(z(q), z(k), z(v), z(g), z(beta), s0, scale, bf16_qk)
        ends_here = end <= (c + 1) * chunk

        @pl.when(ends_here)
        def _():
            buf_ref[...] = s_end
            _dma(buf_ref, ht_hbm.at[s, h], sem)

        @pl.when(jnp.logical_not(ends_here))
        def _():
            carry_ref[...] = s_end

        return jnp.where(m, o, o_acc)

    o_acc = jax.lax.fori_loop(lo_ref[c], hi_ref[c] + 1, one, jnp.zeros(o_ref.shape, F32))
    o_ref[...] = o_acc.astype(o_ref.dtype)


def _check_kernel_args(where, cu, q, k, v, g, beta, h0, chunk):
    if len(q.shape) != 3 or tuple(k.shape) != tuple(q.shape):
        raise ArgumentError(f"{where}: q and k must be [H, T, K] alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    hq, t, kd = q.shape
    if len(v.shape) != 3 or v.shape[1] != t or v.shape[0] % hq:
        raise ArgumentError(f"{where}: v must be [HV, T={t}, V] with HV a multiple of H={hq}, got {tuple(v.shape)}")
    hv = v.shape[0]
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (hv, t, 1):
            raise ArgumentError(f"{where}: {name} must be [HV, T, 1] = [{hv}, {t}, 1], got {tuple(x.shape)}")
        if np.dtype(x.dtype) != np.float32:
            raise DTypeError(f"{where}: {name} must be float32, got {np.dtype(x.dtype).name}")
    if len(cu.shape) != 1 or np.dtype(cu.dtype) != np.int32:
        raise ArgumentError(f"{where}: cu_seqlens must be int32 [N + 1], got {tuple(cu.shape)} {np.dtype(cu.dtype)}")
    n = cu.shape[0] - 1
    if h0 is not None and (tuple(h0.shape) != (n, hv, kd, v.shape[2]) or np.dtype(h0.dtype) != np.float32):
        raise ArgumentError(f"{where}: h0 must be float32 [N, HV, K, V] = [{n}, {hv}, {kd}, {v.shape[2]}], got "
                            f"{tuple(h0.shape)} {np.dtype(h0.dtype).name}")
    if chunk not in CHUNK_SIZES:
        raise ArgumentError(f"{where}: chunk must be one of {CHUNK_SIZES}, got {chunk}")
    return hq, hv, t, kd, v.shape[2], n


def _fwd_out(cu, q, k, v, g, beta, h0, scale, save_states, chunk):
    hq, t, kd = q.shape
    hv, vd = v.shape[0], v.shape[2]
    n = cu.shape[0] - 1
    nc = max(-(-int(t) // int(chunk)), 1)
    hc = (hv, nc, kd, vd) if save_states else (1, 1, kd, vd)
    return (tk.OutSpec((hv, t, vd), v.dtype), tk.OutSpec((n, hv, kd, vd), F32), tk.OutSpec(hc, F32))


@tk.tpu_kernel(_fwd_body, name="gdn_chunk_fwd", namespace=NAMESPACE, out_shape=_fwd_out)
def gdn_chunk_fwd(
    cu: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: Optional[torch.Tensor], scale: float, save_states: bool, chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked GDN forward on head-major packed tokens (internal op; use :func:`chunk_gated_delta_rule`).

    Args:
        cu: int32 ``[N + 1]`` sequence offsets (0, non-decreasing, T; scalar-prefetched).
        q, k: ``[H, T, K]`` bf16/f32. v: ``[HV, T, V]`` (HV a multiple of H). g, beta: float32 ``[HV, T, 1]``
            (log decay, write strength). h0: float32 ``[N, HV, K, V]`` or None (zeros).
        scale: the query scale. save_states: also return the state at every chunk start (for the backward).
        chunk: tokens per chunk (a power of two in :data:`CHUNK_SIZES`).

    Returns:
        ``(o [HV, T, V] in v's dtype, final states [N, HV, K, V] f32, chunk-start states [HV, NC, K, V] f32
        (``[1, 1, K, V]``, unwritten, without save_states))``.
    """
    hq, hv, t, kd, vd, n = _check_kernel_args("tpukernels::gdn_chunk_fwd", cu, q, k, v, g, beta, h0, chunk)
    r = hv // hq
    nc = max(tk.cdiv(t, chunk), 1)
    qk_spec = lambda d: pl.BlockSpec((None, chunk, d), lambda h, c, *_: (h // r, c, 0))  # noqa: E731
    v_spec = lambda d: pl.BlockSpec((None, chunk, d), lambda h, c, *_: (h, c, 0))  # noqa: E731
    in_specs = [qk_spec(kd), qk_spec(kd), v_spec(vd), v_spec(1), v_spec(1)]
    if h0 is not None:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    hc_spec = (pl.BlockSpec((None, None, kd, vd), lambda h, c, *_: (h, c, 0, 0)) if save_states
               else pl.BlockSpec((None, None, kd, vd), lambda h, c, *_: (0, 0, 0, 0)))
    flops = hv * t * (4 * chunk * kd + 2 * chunk * vd + 6 * kd * vd)
    return tk.Launch(
        grid=(hv, nc if t else 0),
        in_specs=in_specs,
        out_specs=[v_spec(vd), pl.BlockSpec(memory_space=pl.ANY), hc_spec],
        out_shape=_fwd_out(cu, q, k, v, g, beta, h0, scale, save_states, chunk),
        scratch_shapes=[pltpu.VMEM((kd, vd), F32), pltpu.VMEM((kd, vd), F32), pltpu.SemaphoreType.DMA],
        num_scalar_prefetch=1,
        prefetch=lambda cu_: _chunk_tables(cu_, int(t), int(chunk)),
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=VMEM_LIMIT_BYTES,
        cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=int(hv * t * chunk),
                                      bytes_accessed=int(q.size * q.itemsize * 2 + v.size * v.itemsize * 2)),
        body_kwargs={"chunk": int(chunk), "scale": float(scale), "has_h0": h0 is not None,
                     "save_states": bool(save_states)},
    )


# ----------------------------------------------------------------------------------------- backward kernel
def _bwd_body(lo_ref, hi_ref, st_ref, en_ref, q_ref, k_ref, v_ref, g_ref, b_ref, *rest, chunk, scale, has_h0,
              has_dht, nc):
    it = iter(rest)
    h0_hbm = next(it) if has_h0 else None
    hc_ref, do_ref = next(it), next(it)
    dht_hbm = next(it) if has_dht else None
    dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_hbm = (next(it) for _ in range(6))
    dcarry_ref, buf_ref, dbuf_ref, sem = next(it), next(it), next(it), next(it)
    h, cr = pl.program_id(0), pl.program_id(1)
    c = nc - 1 - cr
    bf16_qk = q_ref.dtype == jnp.bfloat16
    scan.reset_carry(dcarry_ref, axis=1)
    q, k, v = q_ref[...].astype(F32), k_ref[...].astype(F32), v_ref[...].astype(F32)
    g, beta, do = g_ref[...].astype(F32), b_ref[...].astype(F32), do_ref[...].astype(F32)
    lo, hi = lo_ref[c], hi_ref[c]
    kd, vd = q.shape[1], v.shape[1]

    def one(i, acc):
        s = hi - i
        start, end = st_ref[s], en_ref[s]
        m = _seq_mask(c, chunk, start, end)
        continuing = start < c * chunk
        ends_here = end <= (c + 1) * chunk
        s0 = _start_state(continuing, hc_ref[...], has_h0, h0_hbm.at[s, h] if has_h0 else None, buf_ref, sem)
        if has_dht:
            @pl.when(ends_here)
            def _():
                _dma(dht_hbm.at[s, h], dbuf_ref, sem)
        else:
            @pl.when(ends_here)
            def _():
                dbuf_ref[...] = jnp.zeros(dbuf_ref.shape, F32)
        dsf = jnp.where(ends_here, dbuf_ref[...], dcarry_ref[...])
        z = lambda x: jnp.where(m, x, 0.0)  # noqa: E731
        grads = _chunk_bwd(z(q), z(k), z(v), z(g), z(beta), s0, z(do), dsf, scale, bf16_qk)
        ds0 = grads[-1]

        @pl.when(continuing)
        def _():
            dcarry_ref[...] = ds0

        @pl.when(jnp.logical_not(continuing))
        def _():
            dbuf_ref[...] = ds0
            _dma(dbuf_ref, dh0_hbm.at[s, h], sem)

        return tuple(jnp.where(m, new, old) for new, old in zip(grads[:-1], acc))

    zeros = (jnp.zeros((chunk, kd), F32), jnp.zeros((chunk, kd), F32), jnp.zeros((chunk, vd), F32),
             jnp.zeros((chunk, 1), F32), jnp.zeros((chunk, 1), F32))
    acc = jax.lax.fori_loop(0, hi - lo + 1, one, zeros)
    for ref, val in zip((dq_ref, dk_ref, dv_ref, dg_ref, db_ref), acc):
        ref[...] = val.astype(ref.dtype)


def _bwd_out(cu, q, k, v, g, beta, h0, hc, do, dht, scale, chunk):
    hq, t, kd = q.shape
    hv, vd = v.shape[0], v.shape[2]
    n = cu.shape[0] - 1
    return (tk.OutSpec((hv, t, kd), F32), tk.OutSpec((hv, t, kd), F32), tk.OutSpec((hv, t, vd), F32),
            tk.OutSpec((hv, t, 1), F32), tk.OutSpec((hv, t, 1), F32), tk.OutSpec((n, hv, kd, vd), F32))


@tk.tpu_kernel(_bwd_body, name="gdn_chunk_bwd", namespace=NAMESPACE, out_shape=_bwd_out)
def gdn_chunk_bwd(
    cu: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: Optional[torch.Tensor], hc: torch.Tensor, do: torch.Tensor, dht: Optional[torch.Tensor], scale: float,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked GDN backward (internal op): the arguments of :func:`gdn_chunk_fwd`, its chunk-start states
    ``hc [HV, NC, K, V]``, ``do [HV, T, V]`` and ``dht [N, HV, K, V]`` (or None).

    Returns:
        float32 ``(dq [HV, T, K], dk [HV, T, K], dv [HV, T, V], dg [HV, T, 1], dbeta [HV, T, 1], dh0 [N, HV, K, V])``
        (dq / dk per value head: the caller sums each group of HV / H).
    """
    hq, hv, t, kd, vd, n = _check_kernel_args("tpukernels::gdn_chunk_bwd", cu, q, k, v, g, beta, h0, chunk)
    r = hv // hq
    nc = max(tk.cdiv(t, chunk), 1)
    if tuple(hc.shape) != (hv, nc, kd, vd) or tuple(do.shape) != (hv, t, vd):
        raise ArgumentError(f"tpukernels::gdn_chunk_bwd: hc must be [{hv}, {nc}, {kd}, {vd}] and do [{hv}, {t}, {vd}], "
                            f"got {tuple(hc.shape)} and {tuple(do.shape)}")
    if dht is not None and tuple(dht.shape) != (n, hv, kd, vd):
        raise ArgumentError(f"tpukernels::gdn_chunk_bwd: dht must be [{n}, {hv}, {kd}, {vd}], got {tuple(dht.shape)}")
    rev = lambda c: nc - 1 - c  # noqa: E731
    qk_spec = pl.BlockSpec((None, chunk, kd), lambda h, c, *_: (h // r, rev(c), 0))
    row_spec = lambda d: pl.BlockSpec((None, chunk, d), lambda h, c, *_: (h, rev(c), 0))  # noqa: E731
    in_specs = [qk_spec, qk_spec, row_spec(vd), row_spec(1), row_spec(1)]
    if h0 is not None:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    in_specs += [pl.BlockSpec((None, None, kd, vd), lambda h, c, *_: (h, rev(c), 0, 0)), row_spec(vd)]
    if dht is not None:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    return tk.Launch(
        grid=(hv, nc if t else 0),
        in_specs=in_specs,
        out_specs=[row_spec(kd), row_spec(kd), row_spec(vd), row_spec(1), row_spec(1),
                   pl.BlockSpec(memory_space=pl.ANY)],
        out_shape=_bwd_out(cu, q, k, v, g, beta, h0, hc, do, dht, scale, chunk),
        scratch_shapes=[pltpu.VMEM((kd, vd), F32), pltpu.VMEM((kd, vd), F32), pltpu.VMEM((kd, vd), F32),
                        pltpu.SemaphoreType.DMA],
        num_scalar_prefetch=1,
        prefetch=lambda cu_: _chunk_tables(cu_, int(t), int(chunk)),
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=VMEM_LIMIT_BYTES,
        body_kwargs={"chunk": int(chunk), "scale": float(scale), "has_h0": h0 is not None,
                     "has_dht": dht is not None, "nc": int(nc)},
    )


@gdn_chunk_fwd.def_backward(op="chunk_gated_delta_rule")
def _fwd_backward(ctx, do, dht, dhc):
    """Re-run the forward saving the chunk-start states, then the reverse chunk kernel."""
    cu, q, k, v, g, beta, h0 = ctx.cu, ctx.q, ctx.k, ctx.v, ctx.g, ctx.beta, ctx.h0
    _, _, hc = gdn_chunk_fwd(cu, q, k, v, g, beta, h0, ctx.scale, True, ctx.chunk)
    do = torch.zeros_like(ctx.outputs[0]) if do is None else do
    dq, dk, dv, dg, db, dh0 = gdn_chunk_bwd(cu, q, k, v, g, beta, h0, hc, do.contiguous(),
                                             None if dht is None else dht.float().contiguous(), ctx.scale, ctx.chunk)
    hq, hv = q.shape[0], v.shape[0]
    r = hv // hq
    out = {"q": dq.view(hq, r, *dq.shape[1:]).sum(1).to(q.dtype), "k": dk.view(hq, r, *dk.shape[1:]).sum(1).to(k.dtype),
           "v": dv.to(v.dtype), "g": dg, "beta": db}
    if h0 is not None:
        out["h0"] = dh0
    return out


# ----------------------------------------------------------------------------------------- decode kernel
def _token_steps(q, k, v, g, beta, s0, scale):
    """The token loop of the module docstring on the VPU (no MXU: a ``(1, K) x (K, V)`` matmul would load the
    whole state into the MXU per token), for the few tokens of a decode step: ``(o (T, V), S_end)``.

    q, k: ``(K, T)`` (tokens as columns: the host passes them transposed); v: ``(T, V)``; g, beta: ``(T, 1)``.
    """
    s = s0
    outs = []
    for t in range(q.shape[1]):
        kc, qc = k[:, t:t + 1], q[:, t:t + 1]  # (K, 1)
        s = jnp.exp(g[t:t + 1, :]) * s
        kv = jnp.sum(s * kc, axis=0, keepdims=True)  # S^T k, (1, V)
        u = beta[t:t + 1, :] * (v[t:t + 1] - kv)
        s = s + kc * u
        outs.append(scale * jnp.sum(s * qc, axis=0, keepdims=True))
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)), s


def _rec_body(idx_ref, q_ref, k_ref, v_ref, g_ref, b_ref, *rest, scale, has_h0, bh, per_q):
    """``bh`` value heads per step; value head j of the block reads q/k head ``j // per_q`` of its q/k block."""
    it = iter(rest)
    h0_ref = next(it) if has_h0 else None
    o_ref, ht_ref = next(it), next(it)
    for j in range(bh):
        qj = j // per_q
        q, k = q_ref[qj].astype(F32), k_ref[qj].astype(F32)
        v, g, beta = v_ref[j].astype(F32), g_ref[j].astype(F32), b_ref[j].astype(F32)
        s0 = h0_ref[j] if has_h0 else jnp.zeros(ht_ref.shape[1:], F32)
        o, s_end = _token_steps(q, k, v, g, beta, s0, scale)
        o_ref[j] = o.astype(o_ref.dtype)
        ht_ref[j] = s_end


def _rec_out(idx, q, k, v, g, beta, h0, scale):
    b, hv, t, vd = v.shape
    return (tk.OutSpec((b, hv, t, vd), v.dtype), tk.OutSpec((b, hv, q.shape[2], vd), F32))


#: value heads per decode grid step (the state blocks of bh heads move together).
BLOCK_H = (1, 2, 4, 8, 16, 32)
#: VMEM for the decode kernel's double-buffered state blocks (in and out).
DECODE_VMEM_BUDGET_BYTES = 8 * MiB


def _rec_block_h(block_h, hq, hv):
    """The launched heads per step: the largest divisor of HV <= block_h that lines up with the q/k groups
    (a multiple of HV / H, or a divisor of it)."""
    r = hv // hq
    for bh in range(min(int(block_h), hv), 0, -1):
        if hv % bh == 0 and (bh % r == 0 or r % bh == 0):
            return bh
    return 1


def _rec_heuristic(idx, q, k, v, g, beta, h0, scale):
    """The most heads per step whose state blocks (in and out, double-buffered) fit
    :data:`DECODE_VMEM_BUDGET_BYTES`: a decode step moves ``2 * K * V * 4`` bytes per head, so few heads per
    step leave the per-step overhead (~0.35 us) larger than the HBM time. Not measured on a chip yet."""
    kd, vd = q.shape[2], v.shape[3]
    best = 1
    for bh in BLOCK_H:
        if 4 * bh * kd * vd * 4 <= DECODE_VMEM_BUDGET_BYTES:
            best = bh
    return {"block_h": best}


@tk.tpu_kernel(_rec_body, name="gdn_recurrent_fwd", namespace=NAMESPACE, out_shape=_rec_out,
               heuristic=_rec_heuristic,
               tunables={"block_h": tk.Tunable(BLOCK_H, default=8, doc="value heads per grid step (upper bound)")})
def gdn_recurrent_fwd(
    idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: Optional[torch.Tensor], scale: float, *, block_h: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN over the few new tokens of each row (internal op; use :func:`fused_recurrent_gated_delta_rule`).

    Args:
        idx: int32 ``[B]``: row b reads state ``h0[idx[b]]`` (scalar-prefetched; ``arange(B)`` for plain rows).
        q, k: ``[B, H, K, T]`` (transposed: tokens as columns); v: ``[B, HV, T, V]``; g, beta: float32
            ``[B, HV, T, 1]``. h0: float32 ``[S, HV, K, V]`` state pool or None (zeros). scale: the query scale.
        block_h: value heads per grid step (tunable; see :func:`_rec_block_h`).

    Returns:
        ``(o [B, HV, T, V] in v's dtype, new states [B, HV, K, V] float32)``.
    """
    where = "tpukernels::gdn_recurrent_fwd"
    if len(q.shape) != 4 or tuple(k.shape) != tuple(q.shape) or len(v.shape) != 4 or v.shape[0] != q.shape[0] \
            or v.shape[2] != q.shape[3] or v.shape[1] % q.shape[1]:
        raise ArgumentError(f"{where}: q, k must be [B, H, K, T] and v [B, HV, T, V] (HV a multiple of H), got "
                            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, kd, t = q.shape
    hv, vd = v.shape[1], v.shape[3]
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (b, hv, t, 1) or np.dtype(x.dtype) != np.float32:
            raise ArgumentError(f"{where}: {name} must be float32 [B, HV, T, 1] = [{b}, {hv}, {t}, 1], got "
                                f"{tuple(x.shape)} {np.dtype(x.dtype).name}")
    if tuple(idx.shape) != (b,) or np.dtype(idx.dtype) != np.int32:
        raise ArgumentError(f"{where}: idx must be int32 [B] = [{b}], got {tuple(idx.shape)}")
    if h0 is not None and (tuple(h0.shape[1:]) != (hv, kd, vd) or np.dtype(h0.dtype) != np.float32):
        raise ArgumentError(f"{where}: h0 must be float32 [S, HV, K, V] with (HV, K, V) = ({hv}, {kd}, {vd}), got "
                            f"{tuple(h0.shape)} {np.dtype(h0.dtype).name}")
    r = hv // hq
    bh = _rec_block_h(block_h, hq, hv)
    if bh >= r:  # a q/k block of bh / r heads, at block index h
        qb, per_q = bh // r, r
        qk_spec = pl.BlockSpec((None, qb, kd, t), lambda i, h, *_: (i, h, 0, 0))
    else:  # bh divides r: one q/k head, at head index h * bh // r
        per_q = bh
        qk_spec = pl.BlockSpec((None, 1, kd, t), lambda i, h, *_: (i, (h * bh) // r, 0, 0))
    row = lambda d: pl.BlockSpec((None, bh, t, d), lambda i, h, *_: (i, h, 0, 0))  # noqa: E731
    in_specs = [qk_spec, qk_spec, row(vd), row(1), row(1)]
    if h0 is not None:
        in_specs.append(pl.BlockSpec((None, bh, kd, vd), lambda i, h, ix: (ix[i], h, 0, 0)))
    return tk.Launch(
        grid=(b, hv // bh),
        in_specs=in_specs,
        out_specs=[row(vd), pl.BlockSpec((None, bh, kd, vd), lambda i, h, *_: (i, h, 0, 0))],
        out_shape=_rec_out(idx, q, k, v, g, beta, h0, scale),
        num_scalar_prefetch=1,
        dimension_semantics=("parallel", "parallel"),
        cost_estimate=pl.CostEstimate(flops=int(b * hv * t * 6 * kd * vd), transcendentals=int(b * hv * t),
                                      bytes_accessed=int(b * hv * kd * vd * 8)),
        body_kwargs={"scale": float(scale), "has_h0": h0 is not None, "bh": int(bh), "per_q": int(per_q)},
    )


# ----------------------------------------------------------------------------------------- public checks
def _is_t(x):
    return isinstance(x, torch.Tensor)


def _shape(x):
    return tuple(x.shape) if _is_t(x) else type(x).__name__


def _check_public(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_pool=False):
    """Every rule of the public functions (module docstring), before any kernel runs; returns N. ``state_pool``:
    initial_state may have any number of rows (indexed by ssm_state_indices)."""
    return check_delta_rule_args(op, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 cu_seqlens=cu_seqlens, chunk_size=chunk_size, per_channel_gate=False,
                                 state_rows=None if state_pool else "N")


def _l2norm(x, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


# ----------------------------------------------------------------------------------------- public ops
def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False, chunk_size: int = DEFAULT_CHUNK,
):
    """Gated DeltaNet, chunked (prefill and training), with fla's ``chunk_gated_delta_rule`` semantics.

    Args:
        q, k: ``[B, T, H, K]`` bf16/f32 queries and keys. v: ``[B, T, HV, V]``, HV a multiple of H (value head
            i reads q/k head ``i // (HV / H)``, as fla).
        g: ``[B, T, HV]`` log-space decay per token (``S <- exp(g) S``; <= 0 in practice). beta: ``[B, T, HV]``
            write strength (sigmoid outputs in Qwen3-Next). Any float dtype (read as float32).
        scale: query scale, default ``K ** -0.5``.
        initial_state: float32 ``[N, HV, K, V]`` (N = B, or the number of sequences with cu_seqlens) or None
            (zeros). Never modified.
        output_final_state: also return the final states ``[N, HV, K, V]`` float32.
        cu_seqlens: int ``[N + 1]`` offsets of N sequences packed in ``B = 1`` rows (0, non-decreasing, T).
        use_qk_l2norm_in_kernel: l2-normalize q and k over K first (eps 1e-6; done in torch, differentiable).
        chunk_size: tokens per chunk, a power of two in :data:`CHUNK_SIZES` (64, fla's).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state or None)``. Differentiable in q, k, v, g, beta and
        initial_state (Pallas backward kernels).

    Raises:
        ArgumentError: wrong ranks / shapes (mismatched head counts, gates not [B, T, HV], state shape), bad
            cu_seqlens (not starting at 0, decreasing, not ending at T, B != 1), chunk_size not a power of two
            in CHUNK_SIZES, bad scale. DTypeError: q/k/v not bf16/f32, state not float32. DeviceError.
    """
    op = "tpukernels.chunk_gated_delta_rule"
    n = _check_public(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    scale = float(kd ** -0.5 if scale is None else scale)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if b * t == 0:
        o = v.new_zeros(b, t, hv, vd)
        ht = initial_state.clone() if initial_state is not None else v.new_zeros(n, hv, kd, vd, dtype=torch.float32)
        return o, (ht if output_final_state else None)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int32)
    else:
        cu = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t
    gh = g.float().reshape(b * t, hv).transpose(0, 1).reshape(hv, b * t, 1).contiguous()
    bh = beta.float().reshape(b * t, hv).transpose(0, 1).reshape(hv, b * t, 1).contiguous()
    h0 = None if initial_state is None else initial_state.contiguous()
    o, ht, _ = gdn_chunk_fwd(cu, head_major(q), head_major(k), head_major(v), gh, bh, h0, scale, False,
                             int(chunk_size))
    o = o.transpose(0, 1).reshape(b, t, hv, vd)
    return o, (ht if output_final_state else None)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
    ssm_state_indices: Optional[torch.Tensor] = None, inplace_final_state: bool = False,
):
    """Gated DeltaNet for decode (one or a few new tokens per sequence), fla's ``fused_recurrent_gated_delta_rule``.

    Args:
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel: as :func:`chunk_gated_delta_rule`.
        initial_state: float32 ``[N, HV, K, V]``, or with ``ssm_state_indices`` a state pool ``[S, HV, K, V]``.
        output_final_state: return the new states.
        cu_seqlens: int ``[N + 1]`` packed sequences in B = 1 (equal lengths run the decode kernel, one row per
            sequence; unequal lengths run the chunked kernel, same results).
        ssm_state_indices: int ``[N]`` (vLLM): sequence i reads ``initial_state[ssm_state_indices[i]]``;
            values in ``[0, S)``, distinct.
        inplace_final_state: with ssm_state_indices, write the new states back into ``initial_state`` at those
            indices (in place; the returned final_state is ``initial_state``). Otherwise nothing passed in is
            modified.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 (or the pool when in place) or None)``.
        Differentiable (through the chunked kernels) without ssm_state_indices.

    Raises:
        ArgumentError / DTypeError / DeviceError: as :func:`chunk_gated_delta_rule`; indices out of range or
            repeated, inplace_final_state without ssm_state_indices. NotSupportedError: gradients with
            ssm_state_indices.
    """
    op = "tpukernels.fused_recurrent_gated_delta_rule"
    if ssm_state_indices is not None and initial_state is None:
        raise ArgumentError(f"{op}: ssm_state_indices index initial_state (the state pool): pass initial_state")
    if inplace_final_state and ssm_state_indices is None:
        raise ArgumentError(f"{op}: inplace_final_state needs ssm_state_indices (the slots to write)")
    n = _check_public(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, DEFAULT_CHUNK,
                      state_pool=ssm_state_indices is not None)
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    if ssm_state_indices is not None:
        sidx = ssm_state_indices
        if not _is_t(sidx) or sidx.dtype not in _INT or tuple(sidx.shape) != (n,):
            raise ArgumentError(f"{op}: ssm_state_indices must be an int tensor [N] = [{n}], got "
                                f"{_shape(ssm_state_indices)}")
        idx = ssm_state_indices.long()
        if n and (int(idx.min()) < 0 or int(idx.max()) >= initial_state.shape[0]):
            raise ArgumentError(f"{op}: ssm_state_indices must be in [0, {initial_state.shape[0]}) "
                                f"(initial_state.shape[0])")
        if idx.unique().numel() != n:
            raise ArgumentError(f"{op}: ssm_state_indices must be distinct (two sequences cannot share a state)")
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, initial_state)):
            raise NotSupportedError(f"{op}: gradients with ssm_state_indices are not supported (inference path)")
    lens = None
    if cu_seqlens is not None:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    uniform = lens is None or (len(set(lens)) == 1 and lens[0] > 0)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta) + (
        (initial_state,) if initial_state is not None else ()))
    if needs_grad or not uniform or b * t == 0:
        if ssm_state_indices is not None:
            state = initial_state[ssm_state_indices.long()]
            o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                                           cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        else:
            o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                           output_final_state=True, cu_seqlens=cu_seqlens,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    else:
        scale_f = float(kd ** -0.5 if scale is None else scale)
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        rows, tl = (b, t) if cu_seqlens is None else (n, lens[0])

        def rowwise(x, cols=False):  # [B, T, heads, d] -> [rows, heads, tl, d] (cols: [rows, heads, d, tl])
            y = x.reshape(rows, tl, x.shape[2], x.shape[3])
            return (y.permute(0, 2, 3, 1) if cols else y.transpose(1, 2)).contiguous()

        gate = lambda x: x.float().reshape(rows, tl, hv).transpose(1, 2)[..., None].contiguous()  # noqa: E731
        idx32 = (ssm_state_indices.to(torch.int32) if ssm_state_indices is not None
                 else torch.arange(rows, dtype=torch.int32, device=q.device))
        h0 = None if initial_state is None else initial_state.contiguous()
        o, ht = gdn_recurrent_fwd(idx32, rowwise(q, True), rowwise(k, True), rowwise(v), gate(g), gate(beta), h0, scale_f)
        o = o.transpose(1, 2).reshape(b, t, hv, vd)
    if inplace_final_state:
        with torch.no_grad():
            initial_state.index_copy_(0, ssm_state_indices.long(), ht)
        ht = initial_state
    return o, (ht if output_final_state else None)


# ----------------------------------------------------------------------------------------- float64 reference
def gated_delta_rule_reference(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False):
    """float64 ``(o [B, T, HV, V], final_state [N, HV, K, V])`` by the token loop of the module docstring (per
    row, or per packed sequence of cu_seqlens with its own state); differentiable (torch autograd). With
    ``use_qk_l2norm_in_kernel`` the normalized q / k are rounded to their dtype first, as the public ops do."""
    qd, kd_, vd_, gd, bd = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:  # normalized, then rounded to the input dtype (as fla's l2norm and ours)
        qd = (qd * torch.rsqrt((qd * qd).sum(-1, keepdim=True) + 1e-6)).to(q.dtype).double()
        kd_ = (kd_ * torch.rsqrt((kd_ * kd_).sum(-1, keepdim=True) + 1e-6)).to(k.dtype).double()
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // h
    qd, kd_ = qd.repeat_interleave(r, 2), kd_.repeat_interleave(r, 2)
    scale = dk ** -0.5 if scale is None else scale
    if cu_seqlens is not None:
        c = [int(x) for x in cu_seqlens]
        spans = [(0, c[i], c[i + 1]) for i in range(len(c) - 1)]
    else:
        spans = [(i, 0, t) for i in range(b)]
    outs = [[None] * t for _ in range(b)]
    finals = []
    for n, (row, s, e) in enumerate(spans):
        S = (initial_state[n].double() if initial_state is not None
             else torch.zeros(hv, dk, dv, dtype=torch.float64, device=q.device))
        for i in range(s, e):
            S = S * torch.exp(gd[row, i])[:, None, None]
            kv = torch.einsum("hk,hkv->hv", kd_[row, i], S)
            u = bd[row, i][:, None] * (vd_[row, i] - kv)
            S = S + kd_[row, i][:, :, None] * u[:, None, :]
            outs[row][i] = scale * torch.einsum("hk,hkv->hv", qd[row, i], S)
        finals.append(S)
    zero = torch.zeros(hv, dv, dtype=torch.float64, device=q.device)
    o = torch.stack([torch.stack([x if x is not None else zero for x in rw]) if t else
                     torch.zeros(0, hv, dv, dtype=torch.float64) for rw in outs])
    return o, torch.stack(finals)


#: ``(args, kwargs)`` of the kernels at Qwen3-Next-80B-A3B's GDN layer (16 q/k heads, 32 v heads, K = V = 128):
#: prefill of 4096 tokens in chunks of 64 (one sequence, and 8 packed sequences with their states; the backward
#: too) and decode of 64 rows from a 256-slot state pool. Compiled by the aot tests; not ``STANDARD_CASES`` (no
#: tuning tables yet).
STANDARD_SHAPES = [
    (gdn_chunk_fwd, ("2:i32", "16x4096x128:bf16", "16x4096x128:bf16", "32x4096x128:bf16", "32x4096x1:f32",
                     "32x4096x1:f32", "1x32x128x128:f32"), {"scale": 128 ** -0.5, "save_states": False, "chunk": 64}),
    (gdn_chunk_fwd, ("9:i32", "16x4096x128:bf16", "16x4096x128:bf16", "32x4096x128:bf16", "32x4096x1:f32",
                     "32x4096x1:f32", "8x32x128x128:f32"), {"scale": 128 ** -0.5, "save_states": True, "chunk": 64}),
    (gdn_chunk_bwd, ("2:i32", "16x4096x128:bf16", "16x4096x128:bf16", "32x4096x128:bf16", "32x4096x1:f32",
                     "32x4096x1:f32", "1x32x128x128:f32", "32x64x128x128:f32", "32x4096x128:bf16",
                     "1x32x128x128:f32"), {"scale": 128 ** -0.5, "chunk": 64}),
    (gdn_recurrent_fwd, ("64:i32", "64x16x128x1:bf16", "64x16x128x1:bf16", "64x32x1x128:bf16", "64x32x1x1:f32",
                         "64x32x1x1:f32", "256x32x128x128:f32"), {"scale": 128 ** -0.5}),
]
