"""Fused flash attention backward :data:`fa_backward_fused` (``torch.ops.tpukernels.flash_attention_bwd_fused``):
dQ, dK and dV from one pass over the scores, and the choice between it and the split kernels of :mod:`.backward`.

The split backward runs two kernels, :data:`~.backward.fa_backward_dq` (query-major) and
:data:`~.backward.fa_backward_dkv` (key-major), and each recomputes the logits ``K Q^T``, ``P = exp2(S - lse)`` and
``dP = V dO^T``: 7 matmul passes over the scores. This kernel walks the key-major grid of ``fa_backward_dkv`` and
also forms ``dQ += dS^T K`` from the same ``dS`` tile: 5 passes (Dao, "FlashAttention-2", arXiv:2307.08691,
Algorithm 2, whose backward is key-major with dQ accumulated across key blocks).

Where dQ lives: the key blocks ``j`` of one (batch, kv head) run in order (the kv axis is ``"arbitrary"``), and
the dQ of the whole kv group, ``[G, Sq, D]`` f32, stays in one VMEM scratch across them; it is zeroed at the
group's first step, scaled and copied to HBM by one DMA at its last step. The other way, writing per-key-block
dQ partials ``[nk, B, Hq, Sq, D]`` f32 to HBM and reducing them in XLA (JAX splash attention's fused backward),
writes and reads back ``nk`` f32 copies of dQ: at B=1, S=16k, H=16, D=128, ``block_kv`` 2048 that is 1 GiB
each way (~0.3 ms of tpu7x HBM time, ~1.3 ms on v6e, 3-4% of the backward) and 1 GiB of memory; the resident
form costs ``G * Sq * D * 4`` bytes of VMEM (8 MiB there) and nothing else. So it is used while that fits
:data:`DQ_VMEM_MAX`; longer sequences (or larger groups) take the split kernels.

Output: ``dq`` as float32 ``[B, Hq, round_up(Sq, 8), D]`` (the DMA moves whole 8-row sublane tiles; callers slice
and cast, :func:`dense_backward`), ``dk`` / ``dv`` in k's dtype. The grid, statics, tunables and every masking
feature (causal both alignments, windows, soft-cap, segment ids, tails, GQA, ``Dv != D``) are
``fa_backward_dkv``'s. Not fused (:func:`fused_refusal` names why; :func:`dense_backward` then runs the split
kernels): empty ``Sq`` or ``Skv``, the decode fold with ``Sq`` not a multiple of 8, dQ over
:data:`DQ_VMEM_MAX`. The block-sparse ``mask=`` kernels (:mod:`.masked`) keep their split backward.

Known gap (not verified on hardware): the ordinary Mosaic compile (``tk.compile_for``, the aot tests) passes at
every default shape tried, but libtpu 0.0.52's *profiling* compile (the static estimate) still runs out of tpu7x's
64 MiB of VMEM at 8 MiB of resident dQ (Hq=8, Hkv=2, S=4096: 66.7 MiB; Hq=Hkv=2, S=16k: 64.1 MiB, which fit with
a 30 MiB request, and with ``block_kv_compute=256``); if a real tpu7x compile does too, :data:`DQ_VMEM_MAX` needs
a tpu7x value.

The forward's autograd (:data:`~.forward.fa_forward`'s backward) is wired here. Which backward runs
(:func:`backward_mode`): ``TPUKERNELS_ATTENTION_BWD=fused`` / ``split`` forces one (fused
falls back to split where refused); else the per-chip default :data:`FUSED_BY_CHIP`, chosen by libtpu's static
estimate (a model, not a measurement; numbers in :data:`FUSED_BY_CHIP`'s comment); cpu runs with no target chip
(``TPUKERNELS_TARGET_CHIP``) keep the split kernels.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from ...dsl import Launch, OutSpec, cdiv, tpu_kernel
from ...dsl.dtypes import to_jax_dtype
from ...dsl.spec import TensorSpec
from ...errors import ArgumentError
from ..vmem import target_chip
from .backward import bwd_out_dkv, check_bwd, fa_backward_dkv, fa_backward_dq
from .forward import fa_forward
from .plan import (DOC_H, NAMESPACE, STATIC_NAMES, Plan, bwd_heuristic, clip, compute_divides, cost, div, make_plan, rem,
                   traced_min, tunables, vmem_estimate, vmem_limit)
from .tiles import (LOG2E, NN, NT, dot, exp2_le1, head_stack, load_rows, logits2, read_row, row_to_col, rows_of,
                    run_steps, run_sub, tile_iotas, visible)

#: ``dS^T K``: contract the key axis (dim 0) of both operands.
TN = (((0,), (0,)), ((), ()))

#: Largest resident dQ scratch (``G * round_up(nq * block_q, 8) * max(D, 128) * 4`` bytes) the fused kernel
#: takes (and at most a quarter of the chip's :func:`~tpukernels.library.vmem.vmem_cap`: v4's 14 MiB allows
#: 3.5 MiB): 16 MiB is S = 32k at G = 1, D = 128, and leaves room on tpu7x (56 MiB usable) for the key-major
#: kernel's own blocks and Mosaic's logit tiles.
DQ_VMEM_MAX = 16 << 20

#: The backward each chip gets by default (``True``: fused), from libtpu 0.0.52's static estimate (a model, not
#: a measurement) at B=1, 2 heads, S=8192, D=128 bf16, each at its dispatch config (fused 1024 x 2048 blocks,
#: split 2048 x 2048), fused vs split dQ + dK/dV, microseconds: tpu7x 333 vs 442 (non-causal), 197 vs 258
#: (causal); v6e 407 vs 554, 248 vs 330; v5e 914 vs 1259 (non-causal): 0.73-0.76x everywhere
#: (``benchmarks/attention_fused_bwd.py``). Chips not listed (v4, v5p: not modelled) and cpu runs with no target
#: chip keep the split kernels.
FUSED_BY_CHIP = {"v5e": True, "v6e": True, "tpu7x": True}

ENV = "TPUKERNELS_ATTENTION_BWD"


def ds_of(p: Plan, pr, dp, di, s2):
    """dS (w.r.t. the raw scaled logits, before the soft-cap) from P, dP, Di and the base-2 capped logits."""
    ds = pr * (dp - di)
    if p.softcap is not None:
        t = s2 * (1.0 / (p.softcap * LOG2E))  # tanh(raw / cap)
        ds = ds * (1.0 - t * t)
    return ds


def dq_rows(p: Plan) -> int:
    """Rows of the resident dQ scratch per query head: every query block's rows, whole 8-row tiles."""
    return cdiv(p.nq * p.bq, 8) * 8


def dq_bytes(p: Plan) -> int:
    return p.G * dq_rows(p) * max(p.D, 128) * 4


def fused_refusal(p: Plan) -> str | None:
    """Why the fused kernel does not take this plan (None: it does)."""
    if p.Sq == 0 or p.Skv == 0:
        return "an empty Sq or Skv (the key-major grid has no step to write dQ from)"
    if p.hb > 1 and p.bq % 8:
        return f"query heads folded with block_q={p.bq} not a multiple of 8 (decode fold): dQ rows are not tiles"
    from ..vmem import vmem_cap

    most = min(DQ_VMEM_MAX, vmem_cap() // 4)
    if dq_bytes(p) > most:
        return (f"the resident dQ of a kv group (G={p.G} x {dq_rows(p)} rows x D={p.D} f32 = "
                f"{dq_bytes(p) / 2**20:.1f} MiB) exceeds DQ_VMEM_MAX ({DQ_VMEM_MAX >> 20} MiB) or a quarter of "
                f"the chip's VMEM cap ({most / 2**20:.1f} MiB)")
    return None


def _fused_body(*refs, plan: Plan):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    p = plan
    if p.has_seg:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, qs_ref, ks_ref, dq_hbm, dk_ref, dv_ref,
         dk_sc, dv_sc, dq_sc, sem) = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_hbm, dk_ref, dv_ref, dk_sc, dv_sc, dq_sc, sem = refs
        qs_ref = ks_ref = None
    f32 = p.dtype == "float32"
    b, h, j, t = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    qn = p.q_steps
    i0, i1 = p.q_range(j)
    i = i0 + jax.lax.rem(t, qn)
    run, inner = i <= i1, p.interior(i, j, q_tail_matters=True)
    g0 = jax.lax.div(t, qn) * p.hb  # first query head (within the kv group) of this step
    last_t = (p.G // p.hb) * qn - 1

    def over_dq(fn):
        """``fn(rows)`` over the resident dQ in 8..512-row slices (a loop, not one whole-scratch value: the
        scratch is up to DQ_VMEM_MAX, and an unrolled op over it would be thousands of vector ops of code)."""
        n = dq_sc.shape[1]
        chunk = next(c for c in (512, 256, 128, 64, 32, 16, 8) if n % c == 0)

        def body(r, carry):
            fn(pl.ds(pl.multiple_of(r * chunk, chunk), chunk))
            return carry

        jax.lax.fori_loop(0, n // chunk, body, 0)

    @pl.when(jnp.logical_and(j == 0, t == 0))
    def _init_dq():
        def zero(rs):
            dq_sc[:, rs, :] = jnp.zeros((p.G, rs.size, p.D), jnp.float32)

        over_dq(zero)

    @pl.when(t == 0)
    def _init_dkv():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def load(r0: int, ncol: int, zero_tail: bool):
        """Q, dO rows and base-2 lse, Di of query columns [r0, r0 + ncol) of the current query block; with
        ``zero_tail`` the NaN padding past Sq is selected away (Q, dO -> 0, lse -> +inf, Di -> 0)."""
        q = rows_of(q_ref, p, r0, ncol, p.D)
        do = rows_of(do_ref, p, r0, ncol, p.Dv)
        if p.hb == 1:
            lse2, di = read_row(lse_ref, (0,), p, i, r0, ncol), read_row(di_ref, (0,), p, i, r0, ncol)  # (1, ncol)
        else:
            lse2, di = load_rows(lse_ref, p, i), load_rows(di_ref, p, i)
        lse2 = lse2 * LOG2E
        lse2 = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)  # empty rows: P = exp2(s - inf) = 0
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

    def add_dq(r0: int, ncol: int, part):
        """dQ rows [r0, r0 + ncol) of the current query block (and head block) += part (ncol, D)."""
        if p.hb == 1:
            start = r0 if p.nq == 1 else i * p.bq + r0
            if p.nq > 1 and p.bq % 8 == 0:
                start = pl.multiple_of(start, 8)
            rs = pl.ds(start, ncol)
            dq_sc[g0, rs, :] += part
            return
        start = 0 if p.nq == 1 else pl.multiple_of(i * p.bq, 8)
        for g in range(p.hb):
            dq_sc[g0 + g, pl.ds(start, p.bq), :] += part[g * p.bq:(g + 1) * p.bq]

    def update(r0: int, ncol: int, c: int, masked: bool, qseg, tiles=None):
        """dK, dV of key sub-block c and dQ of query columns [r0, r0 + ncol) of the current blocks."""
        q, do, lse2, di = load(r0, ncol, masked and p.q_tail)
        sl = pl.ds(c * p.bkvc, p.bkvc)
        k = k_ref[sl, :]
        v = v_ref[sl, :]
        kbase = j * p.bkv + c * p.bkvc
        if masked and p.kv_tail:  # NaN padding keys would reach every dQ row through dS^T K: select them away
            kcol = jax.lax.broadcasted_iota(jnp.int32, (p.bkvc, 1), 0)
            k = jnp.where(kcol < p.Skv - kbase, k, jnp.zeros_like(k))
            v = jnp.where(kcol < p.Skv - kbase, v, jnp.zeros_like(v))
        s2 = logits2(p, dot(k, q, NT, f32))  # (bkvc, ncol): keys in sublanes
        pr = exp2_le1(p, s2 - lse2)
        if masked:
            kseg = row_to_col(ks_ref[:, sl]) if p.has_seg else None  # (bkvc, 1)
            vis = visible(p, tiles, i * p.bq + r0, kbase, qseg, kseg, q_tail=p.q_tail, kv_tail=p.kv_tail)
            if vis is not None:
                pr = jnp.where(vis, pr, 0.0)
        dv_sc[sl, :] += dot(pr.astype(do.dtype), do, NN, f32)
        dp = dot(v, do, NT, f32)  # (bkvc, ncol)
        ds = ds_of(p, pr, dp, di, s2).astype(q.dtype)
        dk_sc[sl, :] += dot(ds, q, NN, f32)
        add_dq(r0, ncol, dot(ds, k, TN, f32))  # (ncol, D)

    def step(masked: bool):
        qseg = head_stack(read_row(qs_ref, (), p, i), p.hb, 1) if (masked and p.has_seg) else None  # (1, rows)
        R = p.col_split if masked else 1
        ncol = p.rows // R
        C = p.bkv // p.bkvc
        tiles = tile_iotas(p, (p.bkvc, ncol), 1, q_tail=p.q_tail, kv_tail=p.kv_tail) if masked else None
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
                    run_sub(p.any_visible(qa, ncol, ka, p.bkvc), p.all_visible(qa, ncol, ka, p.bkvc, q_tail_matters=True),
                            lambda a=args: update(*a, False, None),
                            lambda a=args, qs_r=qs_r: update(*a, True, qs_r, tiles))

    run_steps(p, step, run, inner)

    @pl.when(t == last_t)
    def _end_dkv():
        dk_ref[...] = (dk_sc[...] * p.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)

    @pl.when(jnp.logical_and(j == p.nk - 1, t == last_t))
    def _end_dq():  # the kv group's dQ is complete: scale it and copy it out (one DMA)
        rows = dq_hbm.shape[2]

        def scale(rs):
            dq_sc[:, rs, :] = dq_sc[:, rs, :] * p.scale

        over_dq(scale)
        src = dq_sc if rows == dq_sc.shape[1] else dq_sc.at[:, pl.ds(0, rows), :]
        cp = pltpu.make_async_copy(src, dq_hbm.at[b, pl.ds(h * p.G, p.G)], sem.at[0])
        cp.start()
        cp.wait()


def fused_vmem_limit(p: Plan, est: int) -> int | None:
    """The scoped-VMEM request: :func:`.plan.vmem_limit` less the resident dQ, but at least the blocks, the
    scratch and two f32 logit tiles. libtpu 0.0.52 (tpu7x, the profiling compile of S = 16k, 2 heads, 1024 x
    2048 blocks, 8 MiB of dQ) overflowed the 64 MiB with a 40 MiB request and fit with 30 MiB: the resident
    scratch weighs on XLA's VMEM budget on top of the request, so it is taken out of it."""
    lim = vmem_limit(est)
    if lim is None:
        return None
    floor = vmem_estimate(p, n_q_side=3, n_kv_side=4, acc_rows=p.bkv, work=2) + dq_bytes(p)
    return max(lim - dq_bytes(p), min(lim, floor))


def fused_out(q, k, v, do, lse, di, q_segment_ids=None, kv_segment_ids=None, **statics):
    if statics:
        check_bwd(q, k, v, do, lse, di, q_segment_ids, kv_segment_ids, statics, "flash_attention_bwd_fused")
    B, Hq, Sq, D = (int(s) for s in q.shape)
    return (OutSpec((B, Hq, cdiv(Sq, 8) * 8, D), np.dtype("float32")),) + tuple(bwd_out_dkv(q, k, v, do, lse, di))


def _launch_fused(q, k, v, do, lse, di, qs, ks, statics, cfg) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "flash_attention_bwd_fused"
    check_bwd(q, k, v, do, lse, di, qs, ks, statics, where)
    p = make_plan(q, k, v, qs, **statics, **cfg)
    why = fused_refusal(p)
    if why is not None:
        raise ArgumentError(f"{where}: not fused for {why}; use fa_backward_dq / fa_backward_dkv "
                            f"(flash_attention's backward does)")
    gb, qn = p.G // p.hb, p.q_steps

    def q_index(j, t):
        i0, i1 = p.q_range(j)
        return clip(traced_min(i0 + rem(t, qn), i1), 0, max(p.nq - 1, 0))

    def head(h, t):  # q-head block of group-local head block t // q_steps
        return h * gb + div(t, qn)

    q_spec = pl.BlockSpec((None, p.hb, p.bq, p.D), lambda b, h, j, t: (b, head(h, t), q_index(j, t), 0))
    do_spec = pl.BlockSpec((None, p.hb, p.bq, p.Dv), lambda b, h, j, t: (b, head(h, t), q_index(j, t), 0))
    row_spec = pl.BlockSpec((None, p.hb, 1, p.row_width), lambda b, h, j, t: (b, head(h, t), 0, 0)) if p.rows_whole else \
        pl.BlockSpec((None, p.hb, 1, p.bq), lambda b, h, j, t: (b, head(h, t), 0, q_index(j, t)))
    k_spec = pl.BlockSpec((None, None, p.bkv, p.D), lambda b, h, j, t: (b, h, j, 0))
    v_spec = pl.BlockSpec((None, None, p.bkv, p.Dv), lambda b, h, j, t: (b, h, j, 0))
    qs_spec = pl.BlockSpec((None, 1, p.row_width), lambda b, h, j, t: (b, 0, 0)) if p.rows_whole else \
        pl.BlockSpec((None, 1, p.bq), lambda b, h, j, t: (b, 0, q_index(j, t)))
    ks_spec = pl.BlockSpec((None, 1, p.bkv), lambda b, h, j, t: (b, 0, j))
    in_specs = [q_spec, k_spec, v_spec, do_spec, row_spec, row_spec] + ([qs_spec, ks_spec] if p.has_seg else [])
    scratch = [pltpu.VMEM((p.bkv, p.D), np.float32), pltpu.VMEM((p.bkv, p.Dv), np.float32),
               pltpu.VMEM((p.G, dq_rows(p), p.D), np.float32), pltpu.SemaphoreType.DMA((1,))]
    est = vmem_estimate(p, n_q_side=3, n_kv_side=4, acc_rows=p.bkv, work=7) + dq_bytes(p)
    return Launch(
        grid=(p.B, p.Hkv, p.nk, gb * qn),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec(memory_space=pltpu.HBM), k_spec, v_spec],  # HBM: XLA would put an ANY output in VMEM
        out_shape=fused_out(q, k, v, do, lse, di),
        scratch_shapes=scratch,
        # the kv axis carries the resident dQ from one key block to the next: it runs in order
        dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary"),
        vmem_limit_bytes=fused_vmem_limit(p, est),
        cost_estimate=cost(p, 5 / 2),
        body_kwargs={"plan": p},
    )


def fused_heuristic(q, k, v, *rest, **statics):
    """Defaults (no DB entry): the split backward's blocks (:func:`.plan.bwd_heuristic`), but at most 1024
    queries per step. 1024 x 2048 blocks model as fast per score as 2048 x 2048 (tpu7x, S = 4096 / 8192, 2
    heads) and keep the live (512 x block_q) f32 tiles (logits, P, dP, dS) half as big: with 2048, libtpu
    0.0.52's profiling compile ran out of tpu7x's 64 MiB of VMEM at S = 8192 (the ordinary compile fits)."""
    cfg = bwd_heuristic(q, k, v, *rest, **statics)
    if cfg and cfg["block_q"] > 1024:
        cfg = dict(cfg, block_q=1024)
    return cfg


@tpu_kernel(_fused_body, name="flash_attention_bwd_fused", namespace=NAMESPACE, tunables=tunables(DOC_H),
            constraints=[compute_divides], heuristic=fused_heuristic, out_shape=fused_out)
def fa_backward_fused(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of flash attention in one kernel: ``torch.ops.tpukernels.flash_attention_bwd_fused`` ->
    ``(dq [B, Hq, round_up(Sq, 8), D] f32, dk [B, Hkv, Skv, D], dv [B, Hkv, Skv, Dv])``.

    Args:
        q, k, v, do, lse, di, q_segment_ids, kv_segment_ids and the statics: as for
            :data:`~.backward.fa_backward_dkv`.

    Returns:
        ``dq`` float32 with ``Sq`` rounded up to a multiple of 8 (rows past ``Sq`` are unspecified: slice
        them away), ``dk`` / ``dv`` in k's dtype (summed over each GQA group).

    Raises:
        ArgumentError: as ``fa_backward_dkv``; and for a call the fused kernel refuses (:func:`fused_refusal`:
            empty ``Sq`` / ``Skv``, decode fold with ``Sq % 8 != 0``, resident dQ over :data:`DQ_VMEM_MAX`).
    """
    statics = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale, window_left=window_left,
                   window_right=window_right, softcap=softcap)
    cfg = dict(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv_compute, block_h=block_h)
    return _launch_fused(q, k, v, do, lse, di, q_segment_ids, kv_segment_ids, statics, cfg)


# ------------------------------------------------------------------------------------------ dispatch


def backward_mode(q, k, v, qs, statics: dict, config: dict | None = None) -> tuple[str, str]:
    """``("fused" | "split", why)``: the backward a dense flash attention call runs.

    ``$TPUKERNELS_ATTENTION_BWD`` (``fused`` / ``split``) forces a mode, else :data:`FUSED_BY_CHIP` of the
    target chip decides (split where unlisted or no chip is known); fused then needs :func:`fused_refusal` to pass at the fused
    kernel's config (``config``, default its heuristic).

    Raises:
        ArgumentError: ``$TPUKERNELS_ATTENTION_BWD`` is set to something else.
    """
    forced = os.environ.get(ENV, "").strip().lower()
    if forced not in ("", "fused", "split", "auto"):
        raise ArgumentError(f"{ENV} must be 'fused', 'split' or 'auto' (or unset), got {forced!r}")
    if forced == "split":
        return "split", f"{ENV}=split"
    target = target_chip()
    chip = None if target is None else target.name
    if forced in ("", "auto") and not FUSED_BY_CHIP.get(chip, False):
        return "split", ("no target chip" if chip is None else f"the split backward is {chip}'s default")
    cfg = dict(fused_heuristic(q, k, v), **(config or {}))
    if not cfg:  # malformed arguments: the split kernels raise the typed error
        return "split", "malformed arguments"
    specs = [None if x is None else TensorSpec(tuple(x.shape), to_jax_dtype(x.dtype) if isinstance(x, torch.Tensor)
                                               else x.dtype) for x in (q, k, v, qs)]
    why = fused_refusal(make_plan(*specs, **statics, **cfg))
    if why is not None:
        return "split", f"not fused for {why}"
    return "fused", f"{ENV}=fused" if forced == "fused" else f"the fused backward models faster on {chip}"


def dense_backward(q, k, v, d_out, lse, di, qs, ks, statics: dict, need_q: bool = True, need_kv: bool = True):
    """``{"q": dq, "k": dk, "v": dv}`` (those asked for) of the dense kernels, by :func:`backward_mode`: the
    fused kernel when both dQ and dK/dV are needed, else the split kernel(s) that are."""
    grads = {}
    if need_q and need_kv and backward_mode(q, k, v, qs, statics)[0] == "fused":
        dq, grads["k"], grads["v"] = fa_backward_fused(q, k, v, d_out, lse, di, qs, ks, **statics)
        grads["q"] = dq[:, :, :q.shape[2]].to(q.dtype)
        return grads
    if need_q:
        grads["q"] = fa_backward_dq(q, k, v, d_out, lse, di, qs, ks, **statics)
    if need_kv:
        grads["k"], grads["v"] = fa_backward_dkv(q, k, v, d_out, lse, di, qs, ks, **statics)
    return grads


@fa_forward.def_backward(op="flash_attention")
def _fa_backward(ctx, d_out, d_lse):
    """The forward's autograd: ``Di = rowsum(dO * O) - dlse``, then :func:`dense_backward`."""
    q, k, v = ctx.q, ctx.k, ctx.v
    qs, ks = ctx.q_segment_ids, ctx.kv_segment_ids
    out, lse = ctx.outputs
    statics = {n: ctx.args[n] for n in STATIC_NAMES}
    need_q = ctx.needs_input_grad.get("q", True)
    need_kv = ctx.needs_input_grad.get("k", True) or ctx.needs_input_grad.get("v", True)
    if d_out is None:
        d_out = torch.zeros_like(out)
    di = (d_out.float() * out.float()).sum(-1).unsqueeze(2)  # [B, Hq, 1, Sq]
    if d_lse is not None:
        di = di - d_lse  # d lse_i / d s_ij = P_ij, so dlse enters dS = P * (dP - (Di - dlse))
    return dense_backward(q, k, v, d_out, lse, di, qs, ks, statics, need_q, need_kv)
