"""Mamba2 SSD (structured state-space duality): the chunked scan for prefill and training, one-step decode.

Written with the tpukernels DSL (``@tpu_kernel``), torch namespace ``tpukernels``.

Public API (torch tensors)::

    mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, inf),
                              return_final_states=False, return_varlen_states=False, state_dtype=None)
        -> out | (out, final_states) | (out, varlen_states) | (out, final_states, varlen_states)
                                                      mamba_ssm ``ops/triton/ssd_combined.py``, same name
    selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None) -> out            decode; ``state`` updated in place
    selective_state_step(...) -> (out, new_state)                     the same step, functional
    ssd_reference / selective_state_update_reference                  float64 references

Formula (per batch row ``b`` and head ``h``; ``g = h // (H / G)`` its group; ``t`` the token)::

    dt'[t]  = clamp(softplus?(dt[t] + dt_bias), *dt_limit)        (softplus only where the sum <= 20)
    S[t]    = exp(dt'[t] A) S[t-1] + dt'[t] x[t] ⊗ B[t, g]        S: [P, N] float32 state, S[-1] = initial_states
    y[t]    = S[t] C[t, g] + D x[t]
    out[t]  = y[t] * silu(z[t])     (without z: y)

Packed sequences: ``seq_idx [B, L]`` (non-decreasing per row) starts a new sequence wherever it changes, where the
state is reset to zero: no token reads another sequence's state. As in mamba_ssm the initial state belongs to
the sequence whose ``seq_idx`` is 0 (the first one when the row starts at 0). ``cu_seqlens [N + 1]`` (B = 1)
gives the sequence offsets: with ``return_varlen_states`` the state at the end of each sequence is returned
(``varlen_states [N, H, P, N_state]``, zeros for an empty sequence). mamba_ssm uses cu_seqlens *only* for those
states and lets sequences read each other's state unless seq_idx is also passed; here cu_seqlens without
seq_idx also masks (the seq_idx it implies), and both together must agree (a typed error otherwise).

Sources: state-spaces/mamba ``mamba_ssm/ops/triton/ssd_combined.py`` (argument semantics and checks),
``ssd_chunk_state.py`` (dt processing: bias, softplus at <= 20, the clamp; ``chunk_state_varlen``),
``ssd_state_passing.py`` (the initial state is seq_idx 0's), ``selective_state_update.py`` (decode, negative
``state_batch_indices`` = padding rows); ``ssd_minimal.py`` and transformers' ``mamba2_chunk_scan`` /
``mamba2_selective_state_update`` (torch forms of the same, used as the peer references in the tests).

Design. The scan kernel works on one ``(batch row, head)`` per grid row and one chunk of ``Q = chunk_size``
tokens per step, the chunk axis sequential (``"arbitrary"``) with the ``[P, N]`` float32 state in VMEM
scratch. Per chunk (``cs`` the inclusive cumsum of ``a = dt' A`` from the chunk start, restarting where a
sequence starts (``dsl.scan.segment_cumsum``), ``seg`` the sequence (run) of each token, ``s_in`` the run of the
state entering the chunk)::

    L[i, j]  = exp(cs_i - cs_j)  where j <= i and seg_i == seg_j, else 0       (jnp.where, never a product)
    y        = ((C Bᵀ) ∘ L ∘ dt'ᵀ) x  +  where(seg == s_in, exp(cs), 0) ∘ (C Sᵀ)
    S_next   = where(seg_last == s_in, exp(cs_last), 0) S  +  xᵀ (v ∘ B),   v_j = where(seg_j == seg_last,
               exp(cs_last - cs_j), 0) dt'_j

Packed sequences inside one chunk never meet: every ``(Q, Q)`` pair product is selected to pairs of one run, the
state terms to the rows of their run, and each contraction over the chunk's tokens (``W x`` and the backward's
three) runs once per run present with its operands selected to that run (a loop whose bounds come from a
scalar-prefetched run table: one step unless a sequence starts inside the chunk; a chunk of k packed sequences
costs k such matmuls). So a NaN / inf in one sequence reaches no other through a ``0 * NaN``.

The kernel also writes the state entering each chunk (``[B, H, n_chunks, P, N]`` float32), which the
backward reads; the backward kernel walks the chunks in reverse with the state gradient in scratch and
returns dx, per-head dB / dC, d(dt'), d(a) and d(initial_states) (derivation beside its body). Outside the
kernels, in torch (elementwise on ``[B, L, H]`` / ``[B, L, H, P]``, differentiated by autograd): the dt
processing, ``a = dt' A``, the head-major transposes, the D skip and the z gate, the sum of dB / dC over the
heads of a group, and the per-sequence final states (one chunk of tokens per sequence).
The tokens are zero-padded to whole chunks, their count bucketed (:func:`chunk_count`): lengths of one bucket
share a compiled kernel. Decode (``selective_state_update``) is one kernel step per batch row and block of heads,
the state rows read by ``state_batch_indices`` (scalar prefetch), its new rows written back into ``state`` by the
wrapper.

Not covered (vs mamba_ssm): per-sequence *initial* states with cu_seqlens (vLLM's varlen form; only the row's
first sequence, seq_idx 0, starts from ``initial_states``, as in mamba_ssm); ``state_dtype`` sets only the returned
states' dtype (the states between chunks stay float32, where mamba_ssm rounds them to it); gradients through
``varlen_states`` (mamba_ssm refuses them too: a typed error here); chunk sizes below 8; seq_idx that decreases
(a typed error: mamba_ssm would let equal ids far apart in one chunk see each other). float16 is computed as
float32 (Mosaic loads no float16 vectors on v5e / v6e / tpu7x).
Performance gaps (correct first): the head-major transposes and the float32 ``y`` cost extra HBM passes, dB / dC
are per head before their group sum, and decode copies the selected state rows.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ... import dsl as tk
from ...errors import ArgumentError, DeviceError, DTypeError
from ..causal_conv1d import check_cu_seqlens

__all__ = [
    "mamba_chunk_scan_combined", "selective_state_update", "selective_state_step", "ssd_chunk_scan_fwd",
    "ssd_chunk_scan_bwd", "ssd_state_update", "ssd_reference",
    "selective_state_update_reference", "MIN_CHUNK",
]

NAMESPACE = "tpukernels"
#: Smallest chunk_size (a chunk is the sublane dim of its blocks: a multiple of 8).
MIN_CHUNK = 8
F32 = jnp.float32
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INT = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------- per-chunk values
mm = tk.scan.matmul  # float32, highest precision; trans_a / trans_b contract the stored layouts
RUN_FIELDS = 3  # per (row, chunk) in the scalar-prefetched run table: entering state's run, first run, last run


class _Chunk:
    """The per-chunk quantities the forward and backward share (module docstring, Design), from the blocks of
    chunk ``ci`` of batch row ``bi``.

    Isolation of packed sequences (runs): every (Q, Q) product of two tokens is selected (``jnp.where``) to pairs
    of one run; the decays use ``dsl.scan.segment_cumsum``, which restarts at each run (every decay pairs two
    tokens of one run, or the chunk start with a token of the entering state's run, the chunk's first, where it
    equals the chunk-local cumsum); the entering state is selected onto its run's rows, and a contraction over
    the chunk's tokens runs once per run (:func:`_per_run`) with its operands selected to that run."""

    def __init__(self, runs_ref, dt_ref, a_ref, seg_ref, x_ref, b_ref, c_ref, chunk: int, n_chunks: int, bi, ci):
        q = chunk
        self.x = x_ref[0, 0].astype(F32)  # (Q, P)   (zero-padded to whole chunks by the wrapper)
        self.B = b_ref[0, 0].astype(F32)  # (Q, N)
        self.C = c_ref[0, 0].astype(F32)
        self.dt = dt_ref[0, 0]  # (Q, 1) float32, zero-padded by the wrapper
        self.seg = seg_ref[0]  # (Q, 1) int32 run ids, padded with the last id
        base = (bi * n_chunks + ci) * RUN_FIELDS
        s_in, self.first, self.last = runs_ref[base], runs_ref[base + 1], runs_ref[base + 2]
        self.cs = tk.scan.segment_cumsum(a_ref[0, 0], self.seg)  # (Q, 1)
        self.dt_row = tk.scan.col_to_row(self.dt)
        self.mask = tk.scan.lower_mask(q, seg=self.seg)
        self.L = tk.scan.pairwise_decay(self.cs, self.mask)
        self.G = jnp.where(self.mask, mm(self.C, self.B, trans_b=True), 0.0)  # (Q, Q) C_i . B_j, one run, i >= j
        self.W = jnp.where(self.mask, self.G * self.L * self.dt_row, 0.0)
        self.entering = self.seg == s_in  # rows of the entering state's run
        self.e = jnp.where(self.entering, jnp.exp(self.cs), 0.0)  # (Q, 1) decay of the entering state
        self.kept = self.last == s_in  # the whole chunk is the entering state's run
        self.cs_last = self.cs[q - 1:q]
        self.f = jnp.where(self.kept, jnp.exp(self.cs_last), 0.0)  # (1, 1)
        self.last_run = self.seg == self.last  # rows of the run the leaving state belongs to
        self.u = jnp.where(self.last_run, jnp.exp(jnp.where(self.last_run, self.cs_last - self.cs, 0.0)), 0.0)
        self.v = jnp.where(self.last_run, self.u * self.dt, 0.0)


def _per_run(k: _Chunk, fn, shapes):
    """``out[i] = fn(seg == r)[i]`` for the run r of row i, over the runs ``first..last`` of the chunk (one step
    unless sequences start inside it): ``fn(m)`` contracts over the chunk's tokens with its operands selected to
    the tokens of ``m``, so no run's values (NaN included) reach another run's rows through a matmul."""

    def step(r, acc):
        m = k.seg == r
        return tuple(jnp.where(m, v, a) for v, a in zip(fn(m), acc))

    return jax.lax.fori_loop(k.first, k.last + 1, step, tuple(jnp.zeros(s, F32) for s in shapes))


def _sel(m, t):
    return jnp.where(m, t, 0.0)


def _col_sums(m):
    """``(Q, Q) -> (Q, 1)``: ``sum_i m[i, j]`` as a column (a transposed matmul with ones)."""
    return mm(m, jnp.ones((m.shape[0], 1), F32), trans_a=True)


# ----------------------------------------------------------------------------------------- forward kernel
def _fwd_body(runs_ref, *refs, chunk: int, n_chunks: int, has_init: bool):
    it = iter(refs)
    dt_ref, a_ref, seg_ref, x_ref, b_ref, c_ref = (next(it) for _ in range(6))
    init_ref = next(it) if has_init else None
    y_ref, st_ref, fin_ref, s_scr = it
    bi, c = pl.program_id(0), pl.program_id(2)
    tk.scan.reset_carry(s_scr, axis=2, value=init_ref[0, 0] if has_init else None)
    k = _Chunk(runs_ref, dt_ref, a_ref, seg_ref, x_ref, b_ref, c_ref, chunk, n_chunks, bi, c)
    s = s_scr[...]  # (P, N) state entering this chunk
    st_ref[0, 0, 0] = s
    q, p = k.x.shape
    (y,) = _per_run(k, lambda m: (mm(k.W, _sel(m, k.x)),), [(q, p)])
    y = y + jnp.where(k.entering, k.e * mm(k.C, s, trans_b=True), 0.0)
    y_ref[0, 0] = y.astype(y_ref.dtype)
    s_new = (jnp.where(k.kept, k.f * s, 0.0)
             + mm(_sel(k.last_run, k.x), _sel(k.last_run, k.v * k.B), trans_a=True))
    s_scr[...] = s_new

    @pl.when(c == n_chunks - 1)
    def _():
        fin_ref[0, 0, 0] = s_new


def _check_scan_args(op, runs, dt, a, seg, x, B, C, init, chunk_size):
    if len(x.shape) != 4:
        raise ArgumentError(f"{op}: x must be [B, H, L, P] (head-major), got {tuple(x.shape)}")
    b, h, l, p = x.shape
    if len(B.shape) != 4 or B.shape[0] != b or B.shape[2] != l or B.shape[1] == 0 or h % B.shape[1]:
        raise ArgumentError(f"{op}: B must be [B, G, L, N] with G dividing H = {h}, got {tuple(B.shape)}")
    if tuple(C.shape) != tuple(B.shape):
        raise ArgumentError(f"{op}: C must be shaped like B {tuple(B.shape)}, got {tuple(C.shape)}")
    n = B.shape[3]
    if chunk_size < MIN_CHUNK or chunk_size & (chunk_size - 1):
        raise ArgumentError(f"{op}: chunk_size must be a power of two >= {MIN_CHUNK}, got {chunk_size}")
    if l % chunk_size or l == 0:
        raise ArgumentError(f"{op}: the token count L = {l} must be a positive multiple of chunk_size = {chunk_size} "
                            f"(the public op zero-pads)")
    nc = l // chunk_size
    for name, t, want in (("runs", runs, (b * nc * RUN_FIELDS,)), ("dt", dt, (b, h, l, 1)), ("a", a, (b, h, l, 1)),
                          ("seg", seg, (b, l, 1)), ("init", init, (b, h, p, n))):
        if t is not None and tuple(t.shape) != want:
            raise ArgumentError(f"{op}: {name} must be {list(want)}, got {tuple(t.shape)}")
    for name, t, want in (("runs", runs, "int32"), ("dt", dt, "float32"), ("a", a, "float32"), ("seg", seg, "int32"),
                          ("init", init, "float32")):
        if t is not None and np.dtype(t.dtype).name != want:
            raise DTypeError(f"{op}: {name} must be {want}, got {np.dtype(t.dtype).name}")
    for name, t in (("x", x), ("B", B), ("C", C)):
        if np.dtype(t.dtype).name not in ("bfloat16", "float32"):
            raise DTypeError(f"{op}: {name} must be bfloat16 or float32, got {np.dtype(t.dtype).name}")
    return b, h, l, p, B.shape[1], n, nc


def _spec(block, index_map, nc=None):
    """A BlockSpec on the ``(row, head, chunk)`` grid (chunks in reverse when ``nc`` is given: the backward)."""
    if nc is None:
        return pl.BlockSpec(block, lambda i, j, c, runs: index_map(i, j, c))
    return pl.BlockSpec(block, lambda i, j, c, runs: index_map(i, j, nc - 1 - c))


def _scan_specs(h, g, p, n, q, nc=None):
    """BlockSpecs of dt, a, seg, x, B, C (``nc``: reversed, for the backward)."""
    rep = h // g
    col = _spec((1, 1, q, 1), lambda i, j, c: (i, j, c, 0), nc)
    return [col, col, _spec((1, q, 1), lambda i, j, c: (i, c, 0), nc),
            _spec((1, 1, q, p), lambda i, j, c: (i, j, c, 0), nc),
            _spec((1, 1, q, n), lambda i, j, c: (i, j // rep, c, 0), nc),
            _spec((1, 1, q, n), lambda i, j, c: (i, j // rep, c, 0), nc)]


def _fwd_out(runs, dt, a, seg, x, B, C, init, chunk_size):
    b, h, l, p = x.shape
    n = B.shape[3]
    nc = max(l // chunk_size, 1)
    return (tk.OutSpec((b, h, l, p), F32), tk.OutSpec((b, h, nc, p, n), F32), tk.OutSpec((b, h, 1, p, n), F32))


@tk.tpu_kernel(_fwd_body, name="ssd_chunk_scan_fwd", namespace=NAMESPACE, out_shape=_fwd_out)
def ssd_chunk_scan_fwd(
    runs: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, seg: torch.Tensor, x: torch.Tensor, B: torch.Tensor,
    C: torch.Tensor, init: Optional[torch.Tensor], chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SSD chunked scan, head-major (internal op ``tpukernels::ssd_chunk_scan_fwd``; use
    :func:`mamba_chunk_scan_combined`).

    Args:
        runs: ``[B * n_chunks * 3]`` int32 (scalar prefetch): per row and chunk, the run id of the state entering
            the chunk (chunk 0: the initial state's, -1 when it belongs to no run), of its first and last token.
        dt: ``[B, H, L, 1]`` float32 processed step (dt'); ``L = n_chunks * chunk_size`` (the public op pads the
            tokens with zeros: dt' = 0 and x = B = C = 0 there, which leaves the state as it was).
        a: ``[B, H, L, 1]`` float32 ``dt' * A``.
        seg: ``[B, L, 1]`` int32 run id of each token (0, 1, ... consecutive per row; the padding: the last id).
        x: ``[B, H, L, P]`` bf16/f32. B, C: ``[B, G, L, N]`` bf16/f32, G dividing H.
        init: ``[B, H, P, N]`` float32 initial state or None (zeros).
        chunk_size: Q, a power of two >= 8.

    Returns:
        ``(y [B, H, L, P], states [B, H, n_chunks, P, N], final [B, H, 1, P, N])`` float32: y without D / z,
        the state entering each chunk, the state after the last token (5-D, like states).
    """
    b, h, l, p, g, n, nc = _check_scan_args("tpukernels::ssd_chunk_scan_fwd", runs, dt, a, seg, x, B, C, init,
                                            chunk_size)
    q = chunk_size
    in_specs = _scan_specs(h, g, p, n, q)
    if init is not None:
        in_specs.append(_spec((1, 1, p, n), lambda i, j, c: (i, j, 0, 0)))
    flops = 2 * b * h * nc * (q * q * n + q * q * p + 2 * q * p * n)
    return tk.Launch(
        grid=(b, h, nc),
        in_specs=in_specs,
        out_specs=[_spec((1, 1, q, p), lambda i, j, c: (i, j, c, 0)),
                   _spec((1, 1, 1, p, n), lambda i, j, c: (i, j, c, 0, 0)),
                   _spec((1, 1, 1, p, n), lambda i, j, c: (i, j, 0, 0, 0))],
        out_shape=_fwd_out(runs, dt, a, seg, x, B, C, init, chunk_size),
        scratch_shapes=[pltpu.VMEM((p, n), F32)],
        num_scalar_prefetch=1,
        dimension_semantics=("parallel", "parallel", "arbitrary"),  # the state is carried along the chunks
        cost_estimate=pl.CostEstimate(
            flops=int(flops), transcendentals=int(b * h * nc * q * (q + 3)),
            bytes_accessed=int(x.size * x.itemsize + 2 * B.size * B.itemsize * h // g + 4 * b * h * l * p
                               + 4 * b * h * nc * p * n)),
        body_kwargs={"chunk": q, "n_chunks": int(nc), "has_init": init is not None},
    )


# ----------------------------------------------------------------------------------------- backward kernel
def _bwd_body(runs_ref, *refs, chunk: int, n_chunks: int, has_dfinal: bool):
    """One chunk of the backward, chunks in reverse; ``dS`` (scratch) is the gradient of the state leaving it.

    With W = (C Bᵀ) ∘ L ∘ dt'ᵀ and y = W x + e ∘ (C Sᵀ), S_next = f S + xᵀ (v ∘ B)::

        dx = Wᵀ dy + v ∘ (B dSᵀ)                     dW = dy xᵀ,  d(C Bᵀ) = dW ∘ L ∘ dt'ᵀ
        dC = d(C Bᵀ) B + e ∘ (dy S)                  dB = d(C Bᵀ)ᵀ C + v ∘ (x dS)
        d dt'_j = Σ_i (dW ∘ C Bᵀ ∘ L)_ij + u_j Σ_n (B ∘ x dS)_jn
        d cs_i += Σ_j P_ij − Σ_j P_ji (P = dW ∘ W) + e_i Σ_p (dy ∘ C Sᵀ)_ip − v_i Σ_n (B ∘ x dS)_in,
        d cs_last += f Σ (dS ∘ S) + Σ_j v_j Σ_n (B ∘ x dS)_jn
        dS_entering = (e ∘ dy)ᵀ C + f dS,            d a = reverse segment cumsum of d cs (cs is one)

    The same isolation as the forward (:class:`_Chunk`): pair products selected to one run, contractions over
    tokens per run, the state terms selected onto their run's rows.
    """
    it = iter(refs)
    dt_ref, a_ref, seg_ref, x_ref, b_ref, c_ref, st_ref, dy_ref = (next(it) for _ in range(8))
    dfin_ref = next(it) if has_dfinal else None
    dx_ref, db_ref, dc_ref, ddt_ref, da_ref, dinit_ref, ds_scr = it
    bi, c = pl.program_id(0), pl.program_id(2)
    ci = n_chunks - 1 - c
    q = chunk
    tk.scan.reset_carry(ds_scr, axis=2, value=dfin_ref[0, 0] if has_dfinal else None)
    k = _Chunk(runs_ref, dt_ref, a_ref, seg_ref, x_ref, b_ref, c_ref, q, n_chunks, bi, ci)
    ds_next = ds_scr[...]
    s = st_ref[0, 0, 0]
    dy = dy_ref[0, 0]
    p, n = s.shape
    dw = jnp.where(k.mask, mm(dy, k.x, trans_b=True), 0.0)  # (Q, Q) dy_i . x_j, one run, i >= j
    dg = jnp.where(k.mask, dw * k.L * k.dt_row, 0.0)
    dx, dC, dB = _per_run(k, lambda m: (mm(k.W, _sel(m, dy), trans_a=True), mm(dg, _sel(m, k.B)),
                                        mm(dg, _sel(m, k.C), trans_a=True)), [(q, p), (q, n), (q, n)])
    ddt = _col_sums(dw * k.G * k.L)
    pm = dw * k.W
    dcs = jnp.sum(pm, axis=1, keepdims=True) - _col_sums(pm)
    # the entering state (its run's rows only)
    cs_s = mm(k.C, s, trans_b=True)  # (Q, P)
    dC = dC + jnp.where(k.entering, k.e * mm(dy, s), 0.0)
    dcs = dcs + jnp.where(k.entering, k.e * jnp.sum(dy * cs_s, axis=1, keepdims=True), 0.0)
    ds = (mm(_sel(k.entering, k.e * dy), _sel(k.entering, k.C), trans_a=True)
          + jnp.where(k.kept, k.f * ds_next, 0.0))
    # the leaving state (the last run's rows only)
    xds = mm(k.x, ds_next)  # (Q, N)
    dx = dx + jnp.where(k.last_run, k.v * mm(k.B, ds_next, trans_b=True), 0.0)
    dB = dB + jnp.where(k.last_run, k.v * xds, 0.0)
    dv = jnp.where(k.last_run, jnp.sum(k.B * xds, axis=1, keepdims=True), 0.0)
    ddt = ddt + dv * k.u
    # cs_last enters f (state kept across the chunk) and v (tokens of the last run): add its gradient to the
    # last token's dcs, whose reverse segment cumsum spreads it over the last run (the whole chunk when f != 0)
    last = (jnp.where(k.kept, k.f * jnp.sum(ds_next * s, keepdims=True).reshape(1, 1), 0.0)
            + jnp.sum(dv * k.v, keepdims=True).reshape(1, 1))
    dcs = dcs - dv * k.v
    row = jax.lax.broadcasted_iota(jnp.int32, (q, 1), 0)
    dcs = jnp.where(row == q - 1, dcs + last, dcs)
    da = tk.scan.segment_cumsum(dcs, k.seg, reverse=True)  # da_j = sum_{i >= j, same run} dcs_i
    dx_ref[0, 0] = dx
    db_ref[0, 0] = dB
    dc_ref[0, 0] = dC
    ddt_ref[0, 0] = ddt
    da_ref[0, 0] = da
    ds_scr[...] = ds

    @pl.when(c == n_chunks - 1)
    def _():
        dinit_ref[0, 0, 0] = ds


def _bwd_out(runs, dt, a, seg, x, B, C, states, dy, dfinal, chunk_size):
    b, h, l, p = x.shape
    n = B.shape[3]
    return (tk.OutSpec((b, h, l, p), F32), tk.OutSpec((b, h, l, n), F32), tk.OutSpec((b, h, l, n), F32),
            tk.OutSpec((b, h, l, 1), F32), tk.OutSpec((b, h, l, 1), F32), tk.OutSpec((b, h, 1, p, n), F32))


@tk.tpu_kernel(_bwd_body, name="ssd_chunk_scan_bwd", namespace=NAMESPACE, out_shape=_bwd_out)
def ssd_chunk_scan_bwd(
    runs: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, seg: torch.Tensor, x: torch.Tensor, B: torch.Tensor,
    C: torch.Tensor, states: torch.Tensor, dy: torch.Tensor, dfinal: Optional[torch.Tensor], chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`ssd_chunk_scan_fwd` (internal op ``tpukernels::ssd_chunk_scan_bwd``).

    Args:
        runs, dt, a, seg, x, B, C, chunk_size: as the forward's. states: the forward's ``[B, H, n_chunks, P, N]``.
        dy: ``[B, H, L, P]`` float32 gradient of y. dfinal: ``[B, H, P, N]`` float32 gradient of the final
            state, or None.

    Returns:
        float32 ``(dx [B, H, L, P], dB [B, H, L, N], dC [B, H, L, N], ddt [B, H, L, 1], da [B, H, L, 1],
        dinit [B, H, 1, P, N])``: dB / dC per head (the caller sums the heads of a group).
    """
    b, h, l, p, g, n, nc = _check_scan_args("tpukernels::ssd_chunk_scan_bwd", runs, dt, a, seg, x, B, C, None,
                                            chunk_size)
    for name, t, want in (("states", states, (b, h, nc, p, n)), ("dy", dy, (b, h, l, p)),
                          ("dfinal", dfinal, (b, h, p, n))):
        if t is not None and tuple(t.shape) != want:
            raise ArgumentError(f"tpukernels::ssd_chunk_scan_bwd: {name} must be {list(want)}, got {tuple(t.shape)}")
    q = chunk_size
    in_specs = _scan_specs(h, g, p, n, q, nc)
    in_specs += [_spec((1, 1, 1, p, n), lambda i, j, c: (i, j, c, 0, 0), nc),
                 _spec((1, 1, q, p), lambda i, j, c: (i, j, c, 0), nc)]
    if dfinal is not None:
        in_specs.append(_spec((1, 1, p, n), lambda i, j, c: (i, j, 0, 0)))
    col = _spec((1, 1, q, 1), lambda i, j, c: (i, j, c, 0), nc)
    flops = 2 * b * h * nc * (3 * q * q * n + 3 * q * q * p + 6 * q * p * n)
    return tk.Launch(
        grid=(b, h, nc),
        in_specs=in_specs,
        out_specs=[_spec((1, 1, q, p), lambda i, j, c: (i, j, c, 0), nc),
                   _spec((1, 1, q, n), lambda i, j, c: (i, j, c, 0), nc),
                   _spec((1, 1, q, n), lambda i, j, c: (i, j, c, 0), nc),
                   col, col,
                   _spec((1, 1, 1, p, n), lambda i, j, c: (i, j, 0, 0, 0))],
        out_shape=_bwd_out(runs, dt, a, seg, x, B, C, states, dy, dfinal, chunk_size),
        scratch_shapes=[pltpu.VMEM((p, n), F32)],
        num_scalar_prefetch=1,
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        cost_estimate=pl.CostEstimate(
            flops=int(flops), transcendentals=int(b * h * nc * q * (q + 3)),
            bytes_accessed=int(2 * x.size * x.itemsize + 4 * B.size * B.itemsize * h // g + 8 * b * h * l * p
                               + 4 * b * h * nc * p * n)),
        body_kwargs={"chunk": q, "n_chunks": int(nc), "has_dfinal": dfinal is not None},
    )


@ssd_chunk_scan_fwd.def_backward(op="mamba_chunk_scan_combined")
def _scan_backward(ctx, dy, _dstates, dfinal):
    y, states, _final = ctx.outputs
    dy = torch.zeros_like(y) if dy is None else dy.float().contiguous()
    dfinal = None if dfinal is None else dfinal[:, :, 0].float().contiguous()
    dx, dB, dC, ddt, da, dinit = ssd_chunk_scan_bwd(ctx.runs, ctx.dt, ctx.a, ctx.seg, ctx.x, ctx.B, ctx.C, states,
                                                    dy, dfinal, ctx.chunk_size)
    b, g, l, n = ctx.B.shape
    h = ctx.x.shape[1]

    def group_sum(t):  # per head -> per group
        return t.reshape(b, g, h // g, l, n).sum(2)

    out = {"x": dx.to(ctx.x.dtype), "B": group_sum(dB).to(ctx.B.dtype), "C": group_sum(dC).to(ctx.C.dtype),
           "dt": ddt, "a": da}
    if ctx.init is not None:
        out["init"] = dinit[:, :, 0]
    return out


# ----------------------------------------------------------------------------------------- decode kernel
def _update_body(idx_ref, *refs, block_h: int, has_d: bool, has_z: bool, has_bias: bool, softplus: bool):
    it = iter(refs)
    st_ref, x_ref, dt_ref, a_ref, b_ref, c_ref = (next(it) for _ in range(6))
    d_ref = next(it) if has_d else None
    z_ref = next(it) if has_z else None
    bias_ref = next(it) if has_bias else None
    out_ref, new_ref = it
    live = idx_ref[pl.program_id(0)] >= 0
    for k in range(block_h):  # heads of this block, each a (P, N) state
        x = x_ref[0, k].astype(F32)  # (P, 1)
        dt = dt_ref[0, k].astype(F32)
        if has_bias:
            dt = dt + bias_ref[k].astype(F32)
        if softplus:
            dt = jnp.where(dt <= 20.0, jnp.log1p(jnp.exp(jnp.minimum(dt, 20.0))), dt)
        s = st_ref[0, k].astype(F32)  # (P, N)
        s = s * jnp.exp(a_ref[k].astype(F32) * dt) + (dt * x) * b_ref[0, k].astype(F32)
        y = jnp.sum(s * c_ref[0, k].astype(F32), axis=1, keepdims=True)  # (P, 1)
        if has_d:
            y = y + d_ref[k].astype(F32) * x
        if has_z:
            zz = z_ref[0, k].astype(F32)
            y = y * (zz * jax.nn.sigmoid(zz))
        out_ref[0, k] = jnp.where(live, y, 0.0).astype(out_ref.dtype)
        new_ref[0, k] = s.astype(new_ref.dtype)


def _update_heuristic(idx, state, x, dt, A, B, C, D, z, dt_bias, softplus):
    h = x.shape[1]
    return {"block_h": 8 if h % 8 == 0 else h}


@tk.tpu_kernel(
    _update_body, name="ssd_state_update", namespace=NAMESPACE, heuristic=_update_heuristic,
    tunables={"block_h": tk.Tunable((8, 16, 32, 64), default=8, doc="heads per grid step (all heads when H is not "
                                                                    "a multiple)")},
)
def ssd_state_update(
    idx: torch.Tensor, state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
    C: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    softplus: bool, *, block_h: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the selective state space (internal op ``tpukernels::ssd_state_update``; use
    :func:`selective_state_update`).

    Args:
        idx: ``[Bt]`` int32 state row of each batch row (negative: a padding row, its output 0).
        state: ``[S, H, P, N]`` (bf16/f32) the state pool. x, z: ``[Bt, H, P, 1]``. dt: ``[Bt, H, P, 1]`` or
        ``[Bt, H, 1, 1]`` (one per head). A: ``[H, P, N]`` or ``[H, 1, 1]``. B, C: ``[Bt, H, 1, N]`` (each head's
        group). D, dt_bias: ``[H, P, 1]``, ``[H, 1, 1]`` or None.
        softplus: apply softplus (where ``dt + dt_bias <= 20``).

    Returns:
        ``(out [Bt, H, P, 1] x.dtype, new_state [Bt, H, P, N] state.dtype)``: the new state of each batch row
        (the caller writes it back; rows with a negative index hold garbage).
    """
    op = "tpukernels::ssd_state_update"
    if len(state.shape) != 4 or len(x.shape) != 4:
        raise ArgumentError(f"{op}: state must be [S, H, P, N] and x [Bt, H, P, 1], got {tuple(state.shape)}, "
                            f"{tuple(x.shape)}")
    bt, h, p, _ = x.shape
    n = state.shape[3]
    bh = block_h if h % block_h == 0 else h
    hd = lambda i, j, ix: (i, j, 0, 0)  # noqa: E731
    vec = lambda i, j, ix: (j, 0, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((1, bh, p, n), lambda i, j, ix: (jnp.maximum(ix[i], 0), j, 0, 0)),
                pl.BlockSpec((1, bh, p, 1), hd), pl.BlockSpec((1, bh, dt.shape[2], 1), hd),
                pl.BlockSpec((bh, *A.shape[1:]), vec),
                pl.BlockSpec((1, bh, 1, n), hd), pl.BlockSpec((1, bh, 1, n), hd)]
    if D is not None:
        in_specs.append(pl.BlockSpec((bh, D.shape[1], 1), vec))
    if z is not None:
        in_specs.append(pl.BlockSpec((1, bh, p, 1), hd))
    if dt_bias is not None:
        in_specs.append(pl.BlockSpec((bh, dt_bias.shape[1], 1), vec))
    return tk.Launch(
        grid=(bt, h // bh),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((1, bh, p, 1), hd), pl.BlockSpec((1, bh, p, n), hd)],
        out_shape=(tk.like(x), tk.OutSpec((bt, h, p, n), state.dtype)),
        num_scalar_prefetch=1,
        dimension_semantics=("parallel", "parallel"),
        cost_estimate=pl.CostEstimate(flops=int(6 * bt * h * p * n), transcendentals=int(bt * h * p * (n + 2)),
                                      bytes_accessed=int(2 * bt * h * p * n * state.itemsize + A.size * A.itemsize)),
        body_kwargs={"block_h": bh, "has_d": D is not None, "has_z": z is not None, "has_bias": dt_bias is not None},
    )


# ----------------------------------------------------------------------------------------- argument checks
def _is_t(v):
    return isinstance(v, torch.Tensor)


def _shape(v):
    return tuple(v.shape) if _is_t(v) else type(v).__name__


def _check_float(op, name, t, device, dims=None):
    if t is None:
        return
    if not _is_t(t):
        raise ArgumentError(f"{op}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ArgumentError(f"{op}: {name} must be a {dims}-D tensor, got {_shape(t)}")
    if t.dtype not in _FLOATS:
        raise DTypeError(f"{op}: {name} dtype {t.dtype} is not supported: use bfloat16, float16 or float32")
    if t.device != device:
        raise DeviceError(f"{op}: {name} is on {t.device} but x is on {device}")


def _check_shape(op, name, t, want, what):
    if t is not None and tuple(t.shape) != tuple(want):
        raise ArgumentError(f"{op}: {name} must be {what} = {list(want)}, got {list(t.shape)}")


def _check_bool(op, name, v):
    if not isinstance(v, bool):
        raise ArgumentError(f"{op}: {name} must be a bool, got {v!r}")


def _check_seq_idx(op, seq_idx, b, l, device):
    if not _is_t(seq_idx) or seq_idx.dtype not in _INT or tuple(seq_idx.shape) != (b, l):
        raise ArgumentError(f"{op}: seq_idx must be an int32/int64 tensor [B, L] = [{b}, {l}], got "
                            f"{_shape(seq_idx)} {getattr(seq_idx, 'dtype', '')}")
    if seq_idx.device != device:
        raise DeviceError(f"{op}: seq_idx is on {seq_idx.device} but x is on {device}")
    if l > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        raise ArgumentError(f"{op}: seq_idx must be non-decreasing along each row (packed sequences, one run each)")


def _seq_idx_of(cu, l, device):
    lens = torch.tensor([e - s for s, e in zip(cu, cu[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), lens, output_size=l)[None]


def _check_scan_public(op, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                       dt_softplus, dt_limit, return_final_states, return_varlen_states):
    if not _is_t(x) or x.dim() != 4:
        raise ArgumentError(f"{op}: x must be a 4-D tensor [batch, seqlen, nheads, headdim], got {_shape(x)}")
    _check_float(op, "x", x, x.device)
    b, l, h, p = x.shape
    _check_float(op, "dt", dt, x.device, 3)
    _check_shape(op, "dt", dt, (b, l, h), "[batch, seqlen, nheads]")
    _check_float(op, "A", A, x.device, 1)
    _check_shape(op, "A", A, (h,), "[nheads]")
    _check_float(op, "B", B, x.device, 4)
    if B.shape[0] != b or B.shape[1] != l or B.shape[2] == 0 or h % B.shape[2]:
        raise ArgumentError(f"{op}: B must be [batch, seqlen, ngroups, dstate] = [{b}, {l}, G, N] with ngroups G "
                            f"dividing nheads H = {h}, got {list(B.shape)}")
    g, n = B.shape[2], B.shape[3]
    _check_float(op, "C", C, x.device, 4)
    _check_shape(op, "C", C, B.shape, "B's shape [batch, seqlen, ngroups, dstate]")
    q = tk.check_int(op, "chunk_size", chunk_size)
    if q < MIN_CHUNK or q & (q - 1):
        raise ArgumentError(f"{op}: chunk_size must be a power of two >= {MIN_CHUNK}, got {q}")
    _check_float(op, "D", D, x.device)
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        raise ArgumentError(f"{op}: D must be [nheads] = [{h}] or [nheads, headdim] = [{h}, {p}], got {list(D.shape)}")
    _check_float(op, "z", z, x.device)
    _check_shape(op, "z", z, x.shape, "x's shape [batch, seqlen, nheads, headdim]")
    _check_float(op, "dt_bias", dt_bias, x.device)
    _check_shape(op, "dt_bias", dt_bias, (h,), "[nheads]")
    _check_float(op, "initial_states", initial_states, x.device)
    _check_shape(op, "initial_states", initial_states, (b, h, p, n), "[batch, nheads, headdim, dstate]")
    for name in ("dt_softplus", "return_final_states", "return_varlen_states"):
        _check_bool(op, name, {"dt_softplus": dt_softplus, "return_final_states": return_final_states,
                               "return_varlen_states": return_varlen_states}[name])
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ArgumentError(f"{op}: dt_limit must be a pair of floats (min, max), got {dt_limit!r}") from None
    if not lo <= hi:
        raise ArgumentError(f"{op}: dt_limit must have min <= max, got {dt_limit!r}")
    if l >= 2**24:
        raise ArgumentError(f"{op}: seqlen must be < 2**24 (sequence ids are exact float32 in the kernel), got {l}")
    if seq_idx is not None:
        _check_seq_idx(op, seq_idx, b, l, x.device)
    cu = None
    if cu_seqlens is not None:
        if b != 1:
            raise ArgumentError(f"{op}: with cu_seqlens, x holds the packed sequences in one row: batch must be 1, "
                                f"got {b}")
        cu = check_cu_seqlens(op, cu_seqlens, l, x.device)
        if seq_idx is not None:
            runs = seq_idx[0]
            starts = [s for s, e in zip(cu, cu[1:]) if e > s]
            inside = torch.ones(l, dtype=torch.bool, device=x.device)
            inside[starts] = False
            change = torch.ones(l, dtype=torch.bool, device=x.device)
            if l > 1:
                change[1:] = runs[1:] != runs[:-1]
            if bool((change[1:] & inside[1:]).any()) or any(not bool(change[s]) for s in starts if s > 0):
                raise ArgumentError(f"{op}: seq_idx and cu_seqlens disagree: seq_idx must change exactly at the "
                                    f"starts of the non-empty sequences of cu_seqlens")
    if return_varlen_states and cu_seqlens is None:
        raise ArgumentError(f"{op}: return_varlen_states needs cu_seqlens (the sequence ends)")
    return b, l, h, p, g, n, q, (lo, hi), cu


# ----------------------------------------------------------------------------------------- public op: scan
def _widen(t):
    return t.float() if t is not None and t.dtype == torch.float16 else t


def _head_major(t, pad: int):
    """``[B, L, H, K] -> [B, H, L + pad, K]`` contiguous, zeros in the pad (one copy, none when already laid out)."""
    t = t.transpose(1, 2)
    return (F.pad(t, (0, 0, 0, pad)) if pad else t).contiguous()


def chunk_count(l: int, chunk_size: int) -> int:
    """Chunks the scan kernel runs for ``l`` tokens: ``cdiv(l, chunk_size)``, then past 8 rounded up to
    :func:`tpukernels.dsl.bucket` (4 buckets per power of two, at most 25% of zero chunks), so prefills of
    nearby lengths share one compiled kernel."""
    nc = tk.cdiv(l, chunk_size)
    return nc if nc <= 8 else tk.bucket(nc)


def _process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """``clamp(softplus?(dt + dt_bias), *dt_limit)`` in float32 (mamba_ssm's ``_chunk_cumsum_fwd``)."""
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = F.softplus(d)  # threshold 20: the identity above, as mamba_ssm's tl.where(dt <= 20, ...)
    return d.clamp(dt_limit[0], dt_limit[1])


def _segments(seq_idx, b, l, nc, q, device):
    """int32 run id of each token ``[B, Lp, 1]`` (consecutive from 0 per row, padded with the last) and the run
    table ``[B * nc * 3]``: per chunk the run of the entering state (chunk 0: 0 when the row's first sequence is
    seq_idx 0, which owns the initial state, else -1), of its first and of its last token."""
    if seq_idx is None:
        run = torch.zeros(b, l, dtype=torch.int32, device=device)
        init_run = torch.zeros(b, dtype=torch.int32, device=device)
    else:
        s = seq_idx.long()
        change = (s[:, 1:] != s[:, :-1]).int()
        run = torch.cat([torch.zeros(b, 1, dtype=torch.int32, device=device), change.cumsum(1).int()], 1)
        init_run = torch.where(s[:, 0] == 0, 0, -1).int()
    run_p = torch.cat([run, run[:, -1:].expand(b, nc * q - l)], 1)
    last = run_p[:, q - 1::q]
    sin = torch.cat([init_run[:, None], last[:, :nc - 1]], 1)
    runs = torch.stack([sin, run_p[:, ::q], last], -1).int()
    return run_p[..., None].contiguous(), runs.reshape(-1).contiguous()


def _varlen_states(xk, Bk, dt_k, a_k, states, seg, runs, cu, q):
    """``[N, H, P, N_state]`` float32: the state after each sequence's last token, from the state entering its
    last chunk and that chunk's tokens of the sequence (mamba_ssm's ``chunk_state_varlen``); zeros when empty."""
    _, h, l, p = xk.shape
    g = Bk.shape[1]
    dev = xk.device
    nseq = len(cu) - 1
    start = torch.tensor(cu[:-1], device=dev)
    end = torch.tensor(cu[1:], device=dev) - 1  # last token (start - 1 when empty)
    nonempty = end >= start
    last = end.clamp(min=0)
    k = last // q
    j = k[:, None] * q + torch.arange(q, device=dev)  # [Nseq, Q] tokens of the last chunk
    mine = (j >= torch.maximum(start, k * q)[:, None]) & (j <= end[:, None])
    a = torch.where(j <= end[:, None], a_k[0, :, :, 0][:, j], 0.0)  # [H, Nseq, Q]
    cs = a.cumsum(-1)
    cs_end = cs.gather(-1, (last - k * q)[None, :, None].expand(h, nseq, 1))  # [H, Nseq, 1]
    w = torch.where(mine, torch.exp(cs_end - cs) * dt_k[0, :, :, 0][:, j], 0.0)
    jx = j.clamp(max=l - 1)
    xs = torch.where(mine[None, :, :, None], xk[0][:, jx].float(), 0.0)  # [H, Nseq, Q, P]
    bs = torch.where(mine[None, :, :, None], Bk[0][:, jx].float(), 0.0).repeat_interleave(h // g, 0)
    contrib = torch.einsum("hsq,hsqp,hsqn->hspn", w, xs, bs)
    sin = runs.reshape(-1, RUN_FIELDS)[:, 0]  # batch 1: per chunk
    carried = (sin[k] == seg[0, :, 0][last])[None, :, None]  # the entering state is this sequence's
    decay = torch.where(carried, torch.exp(cs_end), 0.0)[..., None]
    s_in = states[0][:, k]  # [H, Nseq, P, N]
    fs = torch.where(decay != 0, decay * s_in, 0.0) + contrib
    fs = torch.where(nonempty[None, :, None, None], fs, 0.0)
    return fs.permute(1, 0, 2, 3).contiguous()


def mamba_chunk_scan_combined(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
    D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None, seq_idx: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, dt_softplus: bool = False,
    dt_limit: tuple = (0.0, float("inf")), return_final_states: bool = False, return_varlen_states: bool = False,
    state_dtype: Optional[torch.dtype] = None,
):
    """Mamba2's chunked SSD scan with mamba_ssm's ``mamba_chunk_scan_combined`` semantics (module docstring).

    Args:
        x: ``[batch, seqlen, nheads, headdim]`` bf16/f16/f32.
        dt: ``[batch, seqlen, nheads]`` step sizes (before dt_bias / softplus / dt_limit).
        A: ``[nheads]`` (negative for a decaying state; Mamba2's ``-exp(A_log)``).
        B, C: ``[batch, seqlen, ngroups, dstate]``, ngroups dividing nheads (head h reads group
            ``h // (nheads / ngroups)``).
        chunk_size: tokens per chunk, a power of two >= 8 (the result does not depend on it beyond rounding).
        D: ``[nheads]`` or ``[nheads, headdim]`` skip, or None. z: like x, the gate ``out = y * silu(z)``, or None.
        dt_bias: ``[nheads]`` added to dt, or None. dt_softplus: apply softplus to ``dt + dt_bias`` (where <= 20).
        dt_limit: ``(min, max)`` clamp of the processed dt (always applied; the default clamps negatives to 0).
        initial_states: ``[batch, nheads, headdim, dstate]`` the state before each row's first token (the sequence
            with seq_idx 0 when seq_idx is given), or None (zeros). Never modified.
        seq_idx: int ``[batch, seqlen]``, non-decreasing per row: packed sequences (the state resets where it
            changes).
        cu_seqlens: int ``[N + 1]`` offsets of N packed sequences (batch 1): masks like the seq_idx it implies
            (with seq_idx, both must agree), and gives the sequence ends for ``return_varlen_states``.
        return_final_states: also return ``final_states [batch, nheads, headdim, dstate]``, the state after the
            last token.
        return_varlen_states: also return ``varlen_states [N, nheads, headdim, dstate]``, the state after each
            sequence's last token (needs cu_seqlens; not differentiable, as mamba_ssm's).
        state_dtype: dtype of the returned states (default C's dtype, as mamba_ssm). mamba_ssm also stores the
            states passed between chunks in it; here they stay float32 whatever it is (rounded only on return).

    Returns:
        ``out [batch, seqlen, nheads, headdim]`` in x's dtype (float32 arithmetic, rounded once), then
        ``final_states`` and / or ``varlen_states`` when asked, in mamba_ssm's order ``(out, final, varlen)``.
        Differentiable in x, dt, A, B, C, D, z, dt_bias and initial_states.

    Raises:
        ArgumentError: wrong ranks / shapes (named, with the shape required), ngroups not dividing nheads,
            chunk_size not a power of two >= 8, seq_idx decreasing or disagreeing with cu_seqlens, cu_seqlens not
            starting at 0 / decreasing / not ending at seqlen, batch != 1 with cu_seqlens, return_varlen_states
            without cu_seqlens or with a gradient required, a bad dt_limit. DTypeError: float arguments that are
            not bf16/f16/f32, non-integer seq_idx / cu_seqlens. DeviceError: arguments on different devices.
    """
    op = "tpukernels.mamba_chunk_scan_combined"
    b, l, h, p, g, n, q, limit, cu = _check_scan_public(
        op, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
        return_final_states, return_varlen_states)
    if state_dtype is not None and state_dtype not in _FLOATS:
        raise DTypeError(f"{op}: state_dtype must be torch.bfloat16, torch.float16 or torch.float32 (or None: C's "
                         f"dtype), got {state_dtype!r}")
    sd = C.dtype if state_dtype is None else state_dtype
    if return_varlen_states and torch.is_grad_enabled() and any(
            _is_t(t) and t.requires_grad for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)):
        raise ArgumentError(f"{op}: return_varlen_states is not differentiable (as mamba_ssm's): run it under "
                            f"torch.no_grad() or on tensors that do not require grad")
    if seq_idx is None and cu is not None:
        seq_idx = _seq_idx_of(cu, l, x.device)
    nc = chunk_count(l, q)
    d = _process_dt(dt, dt_bias, dt_softplus, limit)
    if l == 0:
        out = torch.empty_like(x)
        final = (initial_states.float() if initial_states is not None
                 else torch.zeros(b, h, p, n, device=x.device))
        varlen = torch.zeros(len(cu) - 1, h, p, n, device=x.device) if return_varlen_states else None
    else:
        a = d * A.float()
        pad = nc * q - l  # whole chunks of zero tokens (dt' = 0, x = B = C = 0: the state passes unchanged)
        dt_k, a_k = (_head_major(t[..., None], pad) for t in (d, a))  # [B, H, Lp, 1]
        xk = _head_major(_widen(x), pad)  # [B, H, Lp, P]
        bk, ck = (_head_major(_widen(t), pad) for t in (B, C))  # [B, G, Lp, N] (a view when G = 1 and no padding)
        seg, runs = _segments(seq_idx, b, l, nc, q, x.device)
        init = None if initial_states is None else initial_states.float().contiguous()
        y, states, final = ssd_chunk_scan_fwd(runs, dt_k, a_k, seg, xk, bk, ck, init, q)
        final = final[:, :, 0]
        y = y[:, :, :l].transpose(1, 2)  # [B, L, H, P] float32
        if D is not None:
            y = y + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
        if z is not None:
            y = y * F.silu(z.float())
        out = y.to(x.dtype).contiguous()  # contiguous [B, L, H, P], as mamba_ssm's (callers .view() it)
        varlen = (_varlen_states(xk, bk, dt_k, a_k, states, seg, runs, cu, q) if return_varlen_states else None)
    res = ((out,) + ((final.to(sd),) if return_final_states else ())
           + ((varlen.to(sd),) if return_varlen_states else ()))
    return res[0] if len(res) == 1 else res


# ----------------------------------------------------------------------------------------- public op: decode
def _step(op, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
    """Checks, then the kernel: ``(out, new_rows [Bt, H, P, N], rows [Bt] long, live [Bt] bool, squeeze)``."""
    if not _is_t(state) or state.dim() not in (3, 4):
        raise ArgumentError(f"{op}: state must be [batch, dim, dstate] or [batch, nheads, dim, dstate], got "
                            f"{_shape(state)}")
    heads = state.dim() == 4
    want = 3 if heads else 2
    if not _is_t(x) or x.dim() != want:
        raise ArgumentError(f"{op}: x must be [batch, nheads, dim] (or [batch, dim] with a 3-D state), got "
                            f"{_shape(x)} for state {list(state.shape)}")
    dev = x.device
    for name, t in (("state", state), ("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                    ("dt_bias", dt_bias)):
        _check_float(op, name, t, dev)
    up = (lambda t, d: None if t is None else (t if heads or t.dim() != d else t.unsqueeze(1 if d >= 2 else 0)))
    s4 = state if heads else state.unsqueeze(1)
    x3, dt3 = up(x, 2), up(dt, 2)
    a3 = A if heads or A.dim() != 2 else A.unsqueeze(0)
    b3, c3, z3 = up(B, 2), up(C, 2), up(z, 2)
    d2 = D if heads or D is None or D.dim() != 1 else D.unsqueeze(0)
    bias2 = dt_bias if heads or dt_bias is None or dt_bias.dim() != 1 else dt_bias.unsqueeze(0)
    pool, h, p, n = s4.shape
    bt = x3.shape[0]
    _check_shape(op, "x", x3, (bt, h, p), "[batch, nheads, dim]")
    _check_shape(op, "dt", dt3, (bt, h, p), "x's shape [batch, nheads, dim]")
    _check_shape(op, "A", a3, (h, p, n), "[nheads, dim, dstate]")
    if b3.dim() != 3 or b3.shape[0] != bt or b3.shape[2] != n or b3.shape[1] == 0 or h % b3.shape[1]:
        raise ArgumentError(f"{op}: B must be [batch, ngroups, dstate] = [{bt}, G, {n}] with ngroups G dividing "
                            f"nheads H = {h}, got {list(B.shape)}")
    _check_shape(op, "C", c3, b3.shape, "B's shape [batch, ngroups, dstate]")
    _check_shape(op, "D", d2, (h, p), "[nheads, dim]")
    _check_shape(op, "z", z3, (bt, h, p), "x's shape [batch, nheads, dim]")
    _check_shape(op, "dt_bias", bias2, (h, p), "[nheads, dim]")
    _check_bool(op, "dt_softplus", dt_softplus)
    if state_batch_indices is None:
        if pool != bt:
            raise ArgumentError(f"{op}: state must have batch = {bt} rows (x.shape[0]) without state_batch_indices, "
                                f"got {pool}")
        idx = torch.arange(bt, device=dev)
    else:
        idx = state_batch_indices
        if not _is_t(idx) or idx.dtype not in _INT or tuple(idx.shape) != (bt,):
            raise ArgumentError(f"{op}: state_batch_indices must be an int32/int64 tensor [batch] = [{bt}], got "
                                f"{_shape(idx)} {getattr(idx, 'dtype', '')}")
        if idx.device != dev:
            raise DeviceError(f"{op}: state_batch_indices is on {idx.device} but x is on {dev}")
        idx = idx.long()
        live = idx[idx >= 0]
        if live.numel() and int(live.max()) >= pool:
            raise ArgumentError(f"{op}: state_batch_indices must be < {pool} (state.shape[0]; negative = padding "
                                f"row), got max {int(live.max())}")
        if live.unique().numel() != live.numel():
            raise ArgumentError(f"{op}: state_batch_indices must be distinct (two rows cannot update one state)")
    rep = h // b3.shape[1]
    # Mamba2 passes A, dt, dt_bias and D expanded over dim (and dstate) with stride 0: the kernel reads them once
    # per head then ([H, 1, 1], [Bt, H, 1, 1]) instead of a materialized copy (mamba_ssm's TIE_HDIM)
    tied = lambda t: t is not None and t.shape[-1] > 0 and t.stride(-1) == 0  # noqa: E731
    if tied(a3) and a3.stride(-2) == 0:
        a3 = a3[:, :1, :1]
    dt3, d2, bias2 = (t[..., :1] if tied(t) else t for t in (dt3, d2, bias2))
    col = lambda t: None if t is None else _widen(t).reshape(*t.shape, 1).contiguous()  # noqa: E731
    out, new = ssd_state_update(
        idx.to(torch.int32), _widen(s4).contiguous(), col(x3), col(dt3), _widen(a3).contiguous(),
        _widen(b3).repeat_interleave(rep, 1)[:, :, None].contiguous(),
        _widen(c3).repeat_interleave(rep, 1)[:, :, None].contiguous(), col(d2), col(z3), col(bias2), dt_softplus)
    out = out[..., 0].to(x.dtype)
    return (out if heads else out[:, 0]), new.to(state.dtype), idx, idx >= 0, heads


def selective_state_update(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False, state_batch_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decode step, mamba_ssm's ``selective_state_update``: ``state`` is updated **in place** (after every
    check and the kernel have run: a failing call leaves it unchanged)::

        dt' = softplus?(dt + dt_bias);  state = state * exp(A dt') + (dt' x) ⊗ B;  out = state C + D x;
        out *= silu(z)

    Args:
        state: ``[pool, nheads, dim, dstate]`` (or ``[pool, dim, dstate]`` without heads), bf16/f16/f32; float32
            arithmetic, the new state rounded once to its dtype.
        x, dt, z: ``[batch, nheads, dim]`` (``[batch, dim]``). A: ``[nheads, dim, dstate]`` (``[dim, dstate]``;
            Mamba2 passes its ``[nheads]`` A expanded). B, C: ``[batch, ngroups, dstate]`` (``[batch, dstate]``),
            ngroups dividing nheads. D, dt_bias: ``[nheads, dim]`` (``[dim]``) or None.
        dt_softplus: apply softplus where ``dt + dt_bias <= 20``.
        state_batch_indices: int ``[batch]``: batch row b updates ``state[state_batch_indices[b]]`` (distinct,
            ``< pool``); a negative index is a padding row (output 0, no state touched). None: row b is state b.

    Returns:
        ``out`` shaped like x, in x's dtype. Not differentiable (inference).

    Raises:
        ArgumentError: shapes (named, with the shape required), ngroups not dividing nheads, indices out of range
            or repeated, state rows != batch without indices. DTypeError: dtypes other than bf16/f16/f32, non-integer
            indices. DeviceError: arguments on different devices.
    """
    out, new, idx, live, heads = _step("tpukernels.selective_state_update", state, x, dt, A, B, C, D, z, dt_bias,
                                       dt_softplus, state_batch_indices)
    with torch.no_grad():
        rows = new[live] if heads else new[live][:, 0]
        state[idx[live]] = rows
    return out


def selective_state_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                         state_batch_indices=None):
    """:func:`selective_state_update` without the in-place write: ``(out, new_state)``, ``new_state`` a new
    tensor shaped like ``state`` (rows not selected by ``state_batch_indices`` copied unchanged). Same arguments,
    dtypes and errors."""
    out, new, idx, live, heads = _step("tpukernels.selective_state_step", state, x, dt, A, B, C, D, z, dt_bias,
                                       dt_softplus, state_batch_indices)
    result = state.clone()
    result[idx[live]] = new[live] if heads else new[live][:, 0]
    return out, result


# ----------------------------------------------------------------------------------------- float64 references
def ssd_reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None, cu_seqlens=None,
                  dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """float64 ``(out, final_states, varlen_states)`` of the given values by the per-token recurrence (module
    docstring: Formula), the state reset where seq_idx (or the seq_idx cu_seqlens implies) changes;
    ``varlen_states`` (None without cu_seqlens): the state after each sequence's last token (zeros if empty)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    d = dt.double() + (0 if dt_bias is None else dt_bias.double())
    if dt_softplus:
        d = torch.where(d <= 20, torch.log1p(torch.exp(d.clamp(max=20))), d)
    d = d.clamp(float(dt_limit[0]), float(dt_limit[1]))
    xd, ad = x.double(), A.double()
    bd = B.double().repeat_interleave(h // g, 2)
    cd = C.double().repeat_interleave(h // g, 2)
    if seq_idx is None and cu_seqlens is not None:
        seq_idx = _seq_idx_of(cu_seqlens.tolist(), l, x.device)
    s = torch.zeros(b, h, p, n, dtype=torch.float64)
    if initial_states is not None:
        first = torch.ones(b, dtype=torch.bool) if seq_idx is None else seq_idx[:, 0] == 0
        s = torch.where(first[:, None, None, None], initial_states.double(), s)
    ys, after = [], []
    for t in range(l):
        if seq_idx is not None and t > 0:
            s = torch.where((seq_idx[:, t] != seq_idx[:, t - 1])[:, None, None, None], 0.0, s)
        s = s * torch.exp(d[:, t] * ad)[..., None, None] + (d[:, t, :, None] * xd[:, t])[..., None] * bd[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", s, cd[:, t]))
        after.append(s)
    y = torch.stack(ys, 1) if l else xd.new_zeros(b, 0, h, p)
    if D is not None:
        y = y + xd * (D.double()[:, None] if D.dim() == 1 else D.double())
    if z is not None:
        zd = z.double()
        y = y * zd * torch.sigmoid(zd)
    varlen = None
    if cu_seqlens is not None:
        c = [int(v) for v in cu_seqlens]
        varlen = torch.stack([after[e - 1][0] if e > st else torch.zeros(h, p, n, dtype=torch.float64)
                              for st, e in zip(c, c[1:])])
    return y, s, varlen


def selective_state_update_reference(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """float64 ``(out, new_state)`` of one step on the rows given (``state [batch, nheads, dim, dstate]``, the
    other arguments in their heads form; not in place)."""
    h = state.shape[1]
    d = dt.double() + (0 if dt_bias is None else dt_bias.double())
    if dt_softplus:
        d = torch.where(d <= 20, torch.log1p(torch.exp(d.clamp(max=20))), d)
    bd = B.double().repeat_interleave(h // B.shape[1], 1)
    cd = C.double().repeat_interleave(h // C.shape[1], 1)
    s = state.double() * torch.exp(d[..., None] * A.double()) + (d * x.double())[..., None] * bd[:, :, None]
    out = torch.einsum("bhpn,bhn->bhp", s, cd)
    if D is not None:
        out = out + D.double() * x.double()
    if z is not None:
        out = out * z.double() * torch.sigmoid(z.double())
    return out, s


def _scan_shapes(b, h, l, p, g, n, q, dtype="bf16", init=True):
    nc = tk.cdiv(l, q)
    col = f"{b}x{h}x{nc * q}x1:f32"
    common = (f"{b * nc * RUN_FIELDS}:i32", col, col, f"{b}x{nc * q}x1:i32", f"{b}x{h}x{l}x{p}:{dtype}",
              f"{b}x{g}x{l}x{n}:{dtype}", f"{b}x{g}x{l}x{n}:{dtype}")
    fwd = (common + (f"{b}x{h}x{p}x{n}:f32" if init else None,), {"chunk_size": q})
    bwd = (common + (f"{b}x{h}x{nc}x{p}x{n}:f32", f"{b}x{h}x{l}x{p}:f32", f"{b}x{h}x{p}x{n}:f32"), {"chunk_size": q})
    return fwd, bwd


#: ``(kernel, args, kwargs)`` at Mamba2 / Nemotron-H mixer shapes (headdim 64, dstate 128; 8 of the heads: the
#: grid is per head): prefill 4096 tokens with chunk 256 (Mamba2) and 128 (Nemotron-H, 8 groups), and decode of
#: 64 rows from a pool of 256 states. Compiled by the aot tests; no tuning tables are shipped for these kernels.
STANDARD_SHAPES = [
    (ssd_chunk_scan_fwd, *_scan_shapes(1, 8, 4096, 64, 1, 128, 256)[0]),
    (ssd_chunk_scan_bwd, *_scan_shapes(1, 8, 4096, 64, 1, 128, 256)[1]),
    (ssd_chunk_scan_fwd, *_scan_shapes(1, 8, 4096, 64, 8, 128, 128, init=False)[0]),
    (ssd_chunk_scan_bwd, *_scan_shapes(1, 8, 4096, 64, 8, 128, 128)[1]),
    (ssd_state_update, ("64:i32", "256x8x64x128:f32", "64x8x64x1:bf16", "64x8x64x1:bf16", "8x64x128:f32",
                        "64x8x1x128:bf16", "64x8x1x128:bf16", "8x64x1:f32", "64x8x64x1:bf16", "8x64x1:f32"),
     {"softplus": True}),
]
