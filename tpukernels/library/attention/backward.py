"""Flash attention backward kernels :data:`fa_backward_dq` and :data:`fa_backward_dkv` (the split backward; the
forward's autograd, :mod:`.backward_fused`, runs them or the fused kernel).

With P = softmax(S) (S the capped, scaled logits), dO the output gradient and Di = rowsum(dO * O) - dlse::

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - Di),   dR = dS * (1 - tanh^2(R_raw / cap))  (soft-cap only),
    dQ = sm_scale * dR K,   dK = sm_scale * dR^T Q.

P is recomputed from the saved lse: P = exp(S - lse). Rows with lse = -inf (nothing visible) get P = 0.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...dsl import Launch, OutSpec, tpu_kernel
from ...errors import ArgumentError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .plan import (DOC_H as _DOC_H, NAMESPACE, Plan as _Plan, bwd_heuristic as _bwd_heuristic, check_args,
                   clip, compute_divides as _compute_divides, cost, div, dtype_name, make_plan, rem, traced_min,
                   tunables as _tunables, vmem_estimate, vmem_limit)
from .tiles import (LOG2E, NN as _NN, NT as _NT, and_block_mask as _and_block_mask, common_specs, dot as _dot,
                    exp2_le1 as _exp2_le1, head_stack as _head_stack, kv_index_fn, lanes as _lanes,
                    load_cols_wide as _load_cols_wide, load_rows as _load_rows, logits2 as _logits2,
                    mask_refs as _mask_refs, q_major_step as _q_major_step, read_row as _read_row,
                    row_to_col as _row_to_col, rows_of as _rows_of, run_steps as _run_steps, run_sub as _run_sub,
                    tile_iotas as _tile_iotas, visible as _visible)


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
    refs, tabs, mb_ref = _mask_refs(refs, p, 6)
    if p.has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, qs_ref, ks_ref, dq_ref, acc_sc, lse_sc, di_sc = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref, acc_sc, lse_sc, di_sc = refs
        qs_ref = ks_ref = None
    f32 = p.dtype == "float32"
    i, t = pl.program_id(2), pl.program_id(3)
    j, run, inner, full = _q_major_step(p, tabs, i, t)

    @pl.when(t == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        lse2 = _load_cols_wide(lse_ref, p, i) * LOG2E  # (rows, 128), lanes equal
        lse_sc[...] = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)  # empty rows: P = exp2(s - inf) = 0
        di_sc[...] = _load_cols_wide(di_ref, p, i)

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
        pr = _exp2_le1(p, s2 - _lanes(lse2, p.bkvc))
        if masked:
            vis = _visible(p, tiles, i * p.bq + r0, kbase, qseg, ks_ref[:, sl] if p.has_seg else None,
                           q_tail=False, kv_tail=p.kv_tail)
            vis = _and_block_mask(vis, mb_ref, pl.ds(r0, nr), sl, full)
            pr = jnp.where(vis, pr, 0.0)
        dp = _dot(do, v, _NT, f32)  # (nr, bkvc)
        ds = _ds(p, pr, dp, _lanes(di, p.bkvc), s2)
        acc_sc[pl.ds(r0, nr), :] += _dot(ds.astype(k.dtype), k, _NN, f32)

    def step(masked: bool):
        qseg = _head_stack(_row_to_col(_read_row(qs_ref, (), p, i)), p.hb, 0) if (masked and p.has_seg) else None
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
                    _run_sub(*p.sub_visibility(i, j, r * nr, nr, c * p.bkvc, p.bkvc, q_tail_matters=False),
                             lambda a=args: update(*a, False, None),
                             lambda a=args, qs_r=qs_r: update(*a, True, qs_r, tiles))

    _run_steps(p, step, run, inner)

    @pl.when(t == p.kv_steps - 1)
    def _end():
        dq_ref[...] = (acc_sc[...] * p.scale).reshape(p.hb, p.bq, p.D).astype(dq_ref.dtype)


dq_body = _dq_body  # public name; the def keeps its name: the tuning DB keys this kernel by its source


def _dkv_body(*refs, plan: _Plan):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    p = plan
    refs, tabs, mb_ref = _mask_refs(refs, p, 6, transposed=True)
    if p.has_seg:
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, qs_ref, ks_ref, dk_ref, dv_ref, dk_sc, dv_sc = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref, dk_sc, dv_sc = refs
        qs_ref = ks_ref = None
    f32 = p.dtype == "float32"
    j, t = pl.program_id(2), pl.program_id(3)
    if p.has_mask:  # the q block and its kind from the key-major table of this (q head, kv block)
        tt = jax.lax.rem(t, p.q_steps)
        hm = pl.program_id(1) * p.G + jax.lax.div(t, p.q_steps) if p.mask_heads > 1 else 0
        i, kind = tabs[1][0, hm, j, tt], tabs[1][1, hm, j, tt]
        run, full = kind != 0, kind == 2
        inner = False if p.has_seg else full
    else:
        i0, i1 = p.q_range(j)
        i = i0 + jax.lax.rem(t, p.q_steps)
        run, inner, full = i <= i1, p.interior(i, j, q_tail_matters=True), None

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
            lse2, di = _read_row(lse_ref, (0,), p, i, r0, ncol), _read_row(di_ref, (0,), p, i, r0, ncol)  # (1, ncol)
        else:
            lse2, di = _load_rows(lse_ref, p, i), _load_rows(di_ref, p, i)
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
        qseg = _head_stack(_read_row(qs_ref, (), p, i), p.hb, 1) if (masked and p.has_seg) else None  # (1, rows)
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
        pr = _exp2_le1(p, s2 - lse2)
        if masked:
            kseg = _row_to_col(ks_ref[:, sl]) if p.has_seg else None  # (bkvc, 1)
            vis = _visible(p, tiles, i * p.bq + r0, j * p.bkv + c * p.bkvc, qseg, kseg,
                           q_tail=p.q_tail, kv_tail=p.kv_tail)
            vis = _and_block_mask(vis, mb_ref, sl, pl.ds(r0, ncol), full)
            pr = jnp.where(vis, pr, 0.0)
        dv_sc[sl, :] += _dot(pr.astype(do.dtype), do, _NN, f32)
        dp = _dot(v, do, _NT, f32)  # (bkvc, ncol)
        ds = _ds(p, pr, dp, di, s2)
        dk_sc[sl, :] += _dot(ds.astype(q.dtype), q, _NN, f32)

    _run_steps(p, step, run, inner)

    @pl.when(t == (p.G // p.hb) * p.q_steps - 1)
    def _end():
        dk_ref[...] = (dk_sc[...] * p.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


dkv_body = _dkv_body  # public name; the def keeps its name: the tuning DB keys this kernel by its source


def bwd_out_dq(q, k, v, do, lse, di, q_segment_ids=None, kv_segment_ids=None, **statics):
    if statics:
        check_bwd(q, k, v, do, lse, di, q_segment_ids, kv_segment_ids, statics, "flash_attention_bwd_dq")
    return OutSpec(tuple(q.shape), q.dtype)


_bwd_out_dq = bwd_out_dq  # the kernel bodies here keep this name: the tuning DB keys them by their source


def bwd_out_dkv(q, k, v, do, lse, di, q_segment_ids=None, kv_segment_ids=None, **statics):
    if statics:
        check_bwd(q, k, v, do, lse, di, q_segment_ids, kv_segment_ids, statics, "flash_attention_bwd_dkv")
    return (OutSpec(tuple(k.shape), k.dtype), OutSpec(tuple(v.shape), v.dtype))


_bwd_out_dkv = bwd_out_dkv  # the kernel bodies here keep this name: the tuning DB keys them by their source


def check_bwd(q, k, v, do, lse, di, qs, ks, statics, where):
    check_args(q, k, v, qs, ks, **statics, where=where)
    B, Hq, Sq, _ = q.shape
    if tuple(do.shape) != (B, Hq, Sq, v.shape[3]) or dtype_name(do) != dtype_name(q):
        raise ArgumentError(f"{where}: do must be {dtype_name(q)} [B, Hq, Sq, Dv] = {(B, Hq, Sq, v.shape[3])}, "
                            f"got {dtype_name(do)} {tuple(do.shape)}")
    for name, x in (("lse", lse), ("di", di)):
        if tuple(x.shape) != (B, Hq, 1, Sq) or dtype_name(x) != "float32":
            raise ArgumentError(f"{where}: {name} must be float32 [B, Hq, 1, Sq] = {(B, Hq, 1, Sq)}, "
                                f"got {dtype_name(x)} {tuple(x.shape)}")

def _launch_dq(q, k, v, do, lse, di, qs, ks, statics, cfg) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    check_bwd(q, k, v, do, lse, di, qs, ks, statics, "flash_attention_bwd_dq")
    p = make_plan(q, k, v, qs, **statics, **cfg)
    q_spec, k_spec, v_spec, row_spec, qs_spec, ks_spec = common_specs(p, kv_index_fn(p))
    do_spec = pl.BlockSpec((None, p.hb, p.bq, p.Dv), lambda b, h, i, t: (b, h, i, 0))
    in_specs = [q_spec, k_spec, v_spec, do_spec, row_spec, row_spec] + ([qs_spec, ks_spec] if p.has_seg else [])
    scratch = [pltpu.VMEM((p.rows, p.D), np.float32), pltpu.VMEM((p.rows, 128), np.float32),
               pltpu.VMEM((p.rows, 128), np.float32)]
    return Launch(
        grid=(p.B, p.Hq // p.hb, p.nq, p.kv_steps if p.Skv else 0),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=bwd_out_dq(q, k, v, do, lse, di),
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(vmem_estimate(p, n_q_side=3, n_kv_side=2, acc_rows=p.rows, work=4)),
        cost_estimate=cost(p, 3 / 2),
        body_kwargs={"plan": p},
    )

def _launch_dkv(q, k, v, do, lse, di, qs, ks, statics, cfg) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    check_bwd(q, k, v, do, lse, di, qs, ks, statics, "flash_attention_bwd_dkv")
    p = make_plan(q, k, v, qs, **statics, **cfg)
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
    scratch = [pltpu.VMEM((p.bkv, p.D), np.float32), pltpu.VMEM((p.bkv, p.Dv), np.float32)]
    return Launch(
        grid=(p.B, p.Hkv, p.nk, gb * qn if p.Sq else 0),
        in_specs=in_specs,
        out_specs=[k_spec, v_spec],
        out_shape=bwd_out_dkv(q, k, v, do, lse, di),
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(vmem_estimate(p, n_q_side=3, n_kv_side=4, acc_rows=p.bkv, work=5)),
        cost_estimate=cost(p, 2),
        body_kwargs={"plan": p},
    )

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
