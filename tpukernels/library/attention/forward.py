"""Flash attention forward kernel :data:`fa_forward` (``torch.ops.tpukernels.flash_attention_fwd``) -> ``(out, lse)``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...dsl import Launch, OutSpec, tpu_kernel
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .plan import (DOC_H as _DOC_H, NAMESPACE, Plan as _Plan, check_args, compute_divides as _compute_divides, cost,
                   heuristic as _heuristic, make_plan, tunables as _tunables, vmem_estimate, vmem_limit)
from .tiles import (LN2, NN as _NN, NT as _NT, and_block_mask as _and_block_mask, common_specs, dot as _dot,
                    exp_units as _exp_units, head_stack as _head_stack, kv_index_fn, lanes as _lanes,
                    logits2 as _logits2, mask_refs as _mask_refs, q_major_step as _q_major_step, read_row as _read_row,
                    row_to_col as _row_to_col, rows_of as _rows_of, run_steps as _run_steps, run_sub as _run_sub,
                    store_rows as _store_rows, tile_iotas as _tile_iotas, visible as _visible)


def _fwd_body(*refs, plan: _Plan):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    p = plan
    refs, tabs, mb_ref = _mask_refs(refs, p, 3)
    if p.has_seg:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
        qs_ref = ks_ref = None
    f32 = p.dtype == "float32"
    i, t = pl.program_id(2), pl.program_id(3)
    j, run, inner, full = _q_major_step(p, tabs, i, t)

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
        # (nr, bkvc) f32, base-2 logits; bounded_exp: the raw dot products (scaled after the max is taken)
        s = _dot(q, k, _NT, f32) if p.bounded_exp else _logits2(p, _dot(q, k, _NT, f32))
        kbase = j * p.bkv + c * p.bkvc
        if masked:
            vis = _visible(p, tiles, i * p.bq + r0, kbase, qseg, ks_ref[:, sl] if p.has_seg else None,
                           q_tail=False, kv_tail=p.kv_tail)
            vis = _and_block_mask(vis, mb_ref, pl.ds(r0, nr), sl, full)
            s = jnp.where(vis, s, -jnp.inf)
            if p.kv_tail:  # padding rows of V may be NaN: 0 * NaN = NaN, so select them away
                kcol = jax.lax.broadcasted_iota(jnp.int32, (p.bkvc, 1), 0)
                v = jnp.where(kcol < p.Skv - kbase, v, jnp.zeros_like(v))
        m_prev = m_sc[rs, :]  # (nr, 128), lanes equal
        l_prev = l_sc[rs, :]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # rows with nothing visible so far keep m = -inf; shift by 0 there so exp() gives 0, not NaN
        m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
        pr = jnp.exp2(_exp_units(p, s - _lanes(m_use, p.bkvc)))
        alpha = jnp.exp2(_exp_units(p, m_prev - m_use))
        m_sc[rs, :] = m_next
        if p.rowsum_on_mxu:  # P @ [V | 1]: P V and the row sums (lane-replicated) in one MXU pass
            pv1 = _dot(pr.astype(v.dtype), jnp.concatenate([v, jnp.ones((p.bkvc, 128), v.dtype)], axis=1), _NN, f32)
            pv, row_sum = pv1[:, :p.Dv], pv1[:, p.Dv:]
        else:
            pv, row_sum = _dot(pr.astype(v.dtype), v, _NN, f32), jnp.sum(pr, axis=1, keepdims=True)  # (nr, Dv)
        l_sc[rs, :] = alpha * l_prev + row_sum
        acc_sc[rs, :] = acc_sc[rs, :] * _lanes(alpha, p.Dv) + pv

    def step(masked: bool):
        qseg = _head_stack(_row_to_col(_read_row(qs_ref, (), p, i)), p.hb, 0) if (masked and p.has_seg) else None
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
                _run_sub(*p.sub_visibility(i, j, r * nr, nr, c * p.bkvc, p.bkvc, q_tail_matters=False),
                         lambda a=args: update(*a, False, None),
                         lambda a=args, qs_r=qs_r: update(*a, True, qs_r, tiles))

    _run_steps(p, step, run, inner)

    @pl.when(t == p.kv_steps - 1)
    def _end():
        l = l_sc[...]
        empty = l == 0.0
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
        o = acc_sc[...] * _lanes(inv, p.Dv)
        o_ref[...] = o.reshape(p.hb, p.bq, p.Dv).astype(o_ref.dtype)
        lse = jnp.where(empty, -jnp.inf, (_exp_units(p, m_sc[...]) + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
        _store_rows(lse_ref, lse, p, i)


fwd_body = _fwd_body  # public name; the def keeps its name: the tuning DB keys this kernel by its source


def fwd_out_shape(q, k, v, q_segment_ids=None, kv_segment_ids=None, **statics):
    if statics:  # fake (meta) path: same typed errors as the real one
        check_args(q, k, v, q_segment_ids, kv_segment_ids, **statics)
    B, Hq, Sq, _ = q.shape
    return (OutSpec((B, Hq, Sq, v.shape[3]), q.dtype), OutSpec((B, Hq, 1, Sq), np.dtype("float32"), fill=-np.inf))


_fwd_out_shape = fwd_out_shape  # the kernel bodies here keep this name: the tuning DB keys them by their source


def _launch_fwd(q, k, v, q_segment_ids, kv_segment_ids, statics, cfg) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    check_args(q, k, v, q_segment_ids, kv_segment_ids, **statics)
    p = make_plan(q, k, v, q_segment_ids, **statics, **cfg)
    q_spec, k_spec, v_spec, row_spec, qs_spec, ks_spec = common_specs(p, kv_index_fn(p))
    in_specs = [q_spec, k_spec, v_spec] + ([qs_spec, ks_spec] if p.has_seg else [])
    o_spec = pl.BlockSpec((None, p.hb, p.bq, p.Dv), lambda b, h, i, t: (b, h, i, 0))
    scratch = [pltpu.VMEM((p.rows, 128), np.float32), pltpu.VMEM((p.rows, 128), np.float32),
               pltpu.VMEM((p.rows, p.Dv), np.float32)]
    return Launch(
        # Skv = 0: an empty grid; nothing runs and the outputs are their fill values (out 0, lse -inf)
        grid=(p.B, p.Hq // p.hb, p.nq, p.kv_steps if p.Skv else 0),
        in_specs=in_specs,
        out_specs=[o_spec, row_spec],
        out_shape=fwd_out_shape(q, k, v),
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "arbitrary" if p.rows_whole else "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(vmem_estimate(p, n_q_side=2, n_kv_side=2, acc_rows=p.rows, work=3)),
        cost_estimate=cost(p, 1),
        body_kwargs={"plan": p},
    )

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
