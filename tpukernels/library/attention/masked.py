"""Block-sparse masked flash attention kernels (any :mod:`.masks` mask), forward and backward.

The same bodies as the dense kernels (:mod:`.forward`, :mod:`.backward`) with the mask-bound block ranges
replaced by the scalar-prefetched tables of :func:`.masks.mask_tables`: the kv (forward, dQ) or q (dK/dV)
grid axis walks only the listed (not fully masked) blocks, the data-dependent index maps repeat the last
listed block past the list (Pallas issues no DMA for an unchanged block index) and such steps do no work;
full blocks run without an element mask; partial blocks AND the element mask of their deduplicated int8
mask block (fetched by a data-dependent index map) with tails and segment ids.

Kernel-level signature (op level; :func:`flash_attention` builds the tables):
``(fwd_table [3, Hm, nq, T] i32, bwd_table [3, Hm, nk, Tq] i32, q, k, v, [do, lse, di,] mask_blocks
[n, bq, bkv] i8, mask_blocks_t [n, bkv, bq] i8, q_segment_ids?, kv_segment_ids?)``; the block shape is the
mask blocks' (fixed when the tables are built); the one tunable is ``block_kv_compute``. GQA: query heads are
not folded (``block_h = 1``); a per-head mask indexes the tables by query head.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from ...dsl import Launch, OutSpec, Tunable, tpu_kernel
from ...errors import ArgumentError, DTypeError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .backward import bwd_out_dkv, bwd_out_dq, check_bwd, dkv_body as _dkv_body, dq_body as _dq_body
from .forward import fwd_body as _fwd_body, fwd_out_shape
from .plan import NAMESPACE, BLOCKS, check_args, cost, div, dtype_name, make_plan, rem, vmem_estimate, vmem_limit

_MASK_STATICS = ("sm_scale", "softcap")


def _tunables():
    return {"block_kv_compute": Tunable(BLOCKS, default=512,
                                        doc="key positions per compute sub-block (used if it divides the key block)")}


def _check_tables(ft, bt, mb, mbt, q, k, where: str):
    for name, x in (("fwd_table", ft), ("bwd_table", bt)):
        if len(x.shape) != 4 or x.shape[0] != 3 or dtype_name(x) != "int32":
            raise ArgumentError(f"{where}: {name} must be int32 [3, Hm, n, T], got {dtype_name(x)} {tuple(x.shape)}")
    for name, x in (("mask_blocks", mb), ("mask_blocks_t", mbt)):
        if len(x.shape) != 3 or dtype_name(x) != "int8":
            raise ArgumentError(f"{where}: {name} must be int8 [n, a, b], got {dtype_name(x)} {tuple(x.shape)}")
    n, bq, bkv = (int(s) for s in mb.shape)
    if tuple(mbt.shape) != (n, bkv, bq):
        raise ArgumentError(f"{where}: mask_blocks_t must be mask_blocks transposed, got {tuple(mbt.shape)}")
    Hq, Sq, Skv = int(q.shape[1]), int(q.shape[2]), int(k.shape[2])
    nq, nk = -(-Sq // max(bq, 1)), -(-Skv // max(bkv, 1))
    Hm = int(ft.shape[1])
    if Hm not in (1, Hq) or int(bt.shape[1]) != Hm or int(ft.shape[2]) != nq or int(bt.shape[2]) != nk:
        raise ArgumentError(f"{where}: tables {tuple(ft.shape)} / {tuple(bt.shape)} do not fit Hq={Hq}, "
                            f"{nq} query blocks of {bq}, {nk} key blocks of {bkv}")
    return bq, bkv


def _plan(q, k, v, qs, ft, bt, mb, mbt, sm_scale, softcap, block_kv_compute, where):
    bq, bkv = _check_tables(ft, bt, mb, mbt, q, k, where)
    p = make_plan(q, k, v, qs, causal=False, causal_alignment="top_left", sm_scale=sm_scale, window_left=None,
                  window_right=None, softcap=softcap, block_q=bq, block_kv=bkv,
                  block_kv_compute=block_kv_compute, block_h=1)
    return dataclasses.replace(p, hb=1, has_mask=True, mask_heads=int(ft.shape[1]),
                               mask_kv_steps=int(ft.shape[3]), mask_q_steps=int(bt.shape[3]))


def _hm(p, h):
    return h if p.mask_heads > 1 else 0


def _q_major_specs(p):
    """BlockSpecs of the forward / dQ kernels: index maps read the forward table (prefetch refs ft, bt)."""
    from jax.experimental import pallas as pl

    G = p.G

    def kv(b, h, i, t, ft, bt):
        return ft[0, _hm(p, h), i, t]

    return dict(
        q=pl.BlockSpec((None, 1, p.bq, p.D), lambda b, h, i, t, ft, bt: (b, h, i, 0)),
        do=pl.BlockSpec((None, 1, p.bq, p.Dv), lambda b, h, i, t, ft, bt: (b, h, i, 0)),
        k=pl.BlockSpec((None, None, p.bkv, p.D), lambda b, h, i, t, ft, bt: (b, div(h, G), kv(b, h, i, t, ft, bt), 0)),
        v=pl.BlockSpec((None, None, p.bkv, p.Dv), lambda b, h, i, t, ft, bt: (b, div(h, G), kv(b, h, i, t, ft, bt), 0)),
        row=pl.BlockSpec((None, 1, 1, p.bq), lambda b, h, i, t, ft, bt: (b, h, 0, i)),
        mb=pl.BlockSpec((None, p.bq, p.bkv), lambda b, h, i, t, ft, bt: (ft[2, _hm(p, h), i, t], 0, 0)),
        mbt=pl.BlockSpec(memory_space=pl.ANY),
        qs=pl.BlockSpec((None, 1, p.bq), lambda b, h, i, t, ft, bt: (b, 0, i)),
        ks=pl.BlockSpec((None, 1, p.bkv), lambda b, h, i, t, ft, bt: (b, 0, kv(b, h, i, t, ft, bt))),
    )


def _launch_fwd_masked(ft, bt, q, k, v, mb, mbt, qs, ks, sm_scale, softcap, block_kv_compute) -> Launch:
    from jax.experimental.pallas import tpu as pltpu

    where = "flash_attention_masked_fwd"
    check_args(q, k, v, qs, ks, causal=False, causal_alignment="top_left", sm_scale=sm_scale, window_left=None,
               window_right=None, softcap=softcap, where=where)
    p = _plan(q, k, v, qs, ft, bt, mb, mbt, sm_scale, softcap, block_kv_compute, where)
    s = _q_major_specs(p)
    in_specs = [s["q"], s["k"], s["v"], s["mb"], s["mbt"]] + ([s["qs"], s["ks"]] if p.has_seg else [])
    from jax.experimental import pallas as pl

    o_spec = pl.BlockSpec((None, 1, p.bq, p.Dv), lambda b, h, i, t, ft, bt: (b, h, i, 0))
    return Launch(
        grid=(p.B, p.Hq, p.nq, p.kv_steps if p.Skv else 0),
        in_specs=in_specs,
        out_specs=[o_spec, s["row"]],
        out_shape=fwd_out_shape(q, k, v),
        scratch_shapes=[pltpu.VMEM((p.rows, 128), np.float32), pltpu.VMEM((p.rows, 128), np.float32),
                        pltpu.VMEM((p.rows, p.Dv), np.float32)],
        num_scalar_prefetch=2,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(vmem_estimate(p, n_q_side=2, n_kv_side=2, acc_rows=p.rows, work=3)
                                    + 2 * p.bq * p.bkv),
        cost_estimate=cost(p, 1),
        body_kwargs={"plan": p},
    )


def _masked_fwd_out(ft, bt, q, k, v, mb, mbt, q_segment_ids=None, kv_segment_ids=None, **statics):
    return fwd_out_shape(q, k, v)


@tpu_kernel(_fwd_body, name="flash_attention_masked_fwd", namespace=NAMESPACE, tunables=_tunables(),
            out_shape=_masked_fwd_out)
def fa_forward_masked(
    fwd_table: torch.Tensor,
    bwd_table: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_blocks: torch.Tensor,
    mask_blocks_t: torch.Tensor,
    q_segment_ids: Optional[torch.Tensor] = None,
    kv_segment_ids: Optional[torch.Tensor] = None,
    *,
    sm_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    block_kv_compute: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse masked forward: ``torch.ops.tpukernels.flash_attention_masked_fwd`` -> ``(out, lse)``
    (layouts as :data:`fa_forward`; tables and mask blocks from :func:`.masks.mask_tables`)."""
    return _launch_fwd_masked(fwd_table, bwd_table, q, k, v, mask_blocks, mask_blocks_t, q_segment_ids,
                              kv_segment_ids, sm_scale, softcap, block_kv_compute)


def _launch_dq_masked(ft, bt, q, k, v, do, lse, di, mb, mbt, qs, ks, sm_scale, softcap, bkvc) -> Launch:
    from jax.experimental.pallas import tpu as pltpu

    where = "flash_attention_masked_bwd_dq"
    statics = dict(causal=False, causal_alignment="top_left", sm_scale=sm_scale, window_left=None, window_right=None,
                   softcap=softcap)
    check_bwd(q, k, v, do, lse, di, qs, ks, statics, where)
    p = _plan(q, k, v, qs, ft, bt, mb, mbt, sm_scale, softcap, bkvc, where)
    s = _q_major_specs(p)
    in_specs = [s["q"], s["k"], s["v"], s["do"], s["row"], s["row"], s["mb"], s["mbt"]]
    in_specs += [s["qs"], s["ks"]] if p.has_seg else []
    return Launch(
        grid=(p.B, p.Hq, p.nq, p.kv_steps if p.Skv else 0),
        in_specs=in_specs,
        out_specs=s["q"],
        out_shape=OutSpec(tuple(q.shape), q.dtype),
        scratch_shapes=[pltpu.VMEM((p.rows, p.D), np.float32), pltpu.VMEM((p.rows, 128), np.float32),
                        pltpu.VMEM((p.rows, 128), np.float32)],
        num_scalar_prefetch=2,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(vmem_estimate(p, n_q_side=3, n_kv_side=2, acc_rows=p.rows, work=4)
                                    + 2 * p.bq * p.bkv),
        cost_estimate=cost(p, 3 / 2),
        body_kwargs={"plan": p},
    )


def _launch_dkv_masked(ft, bt, q, k, v, do, lse, di, mb, mbt, qs, ks, sm_scale, softcap, bkvc) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "flash_attention_masked_bwd_dkv"
    statics = dict(causal=False, causal_alignment="top_left", sm_scale=sm_scale, window_left=None, window_right=None,
                   softcap=softcap)
    check_bwd(q, k, v, do, lse, di, qs, ks, statics, where)
    p = _plan(q, k, v, qs, ft, bt, mb, mbt, sm_scale, softcap, bkvc, where)
    G, qn = p.G, p.q_steps

    def head(h, t):
        return h * G + div(t, qn)

    def qi(h, j, t, bt):
        return bt[0, head(h, t) if p.mask_heads > 1 else 0, j, rem(t, qn)]

    q_spec = pl.BlockSpec((None, 1, p.bq, p.D), lambda b, h, j, t, ft, bt: (b, head(h, t), qi(h, j, t, bt), 0))
    do_spec = pl.BlockSpec((None, 1, p.bq, p.Dv), lambda b, h, j, t, ft, bt: (b, head(h, t), qi(h, j, t, bt), 0))
    row_spec = pl.BlockSpec((None, 1, 1, p.bq), lambda b, h, j, t, ft, bt: (b, head(h, t), 0, qi(h, j, t, bt)))
    k_spec = pl.BlockSpec((None, None, p.bkv, p.D), lambda b, h, j, t, ft, bt: (b, h, j, 0))
    v_spec = pl.BlockSpec((None, None, p.bkv, p.Dv), lambda b, h, j, t, ft, bt: (b, h, j, 0))
    mbt_spec = pl.BlockSpec((None, p.bkv, p.bq), lambda b, h, j, t, ft, bt: (
        bt[2, head(h, t) if p.mask_heads > 1 else 0, j, rem(t, qn)], 0, 0))
    qs_spec = pl.BlockSpec((None, 1, p.bq), lambda b, h, j, t, ft, bt: (b, 0, qi(h, j, t, bt)))
    ks_spec = pl.BlockSpec((None, 1, p.bkv), lambda b, h, j, t, ft, bt: (b, 0, j))
    in_specs = [q_spec, k_spec, v_spec, do_spec, row_spec, row_spec, pl.BlockSpec(memory_space=pl.ANY), mbt_spec]
    in_specs += [qs_spec, ks_spec] if p.has_seg else []
    return Launch(
        grid=(p.B, p.Hkv, p.nk, G * qn if p.Sq else 0),
        in_specs=in_specs,
        out_specs=[k_spec, v_spec],
        out_shape=(OutSpec(tuple(k.shape), k.dtype), OutSpec(tuple(v.shape), v.dtype)),
        scratch_shapes=[pltpu.VMEM((p.bkv, p.D), np.float32), pltpu.VMEM((p.bkv, p.Dv), np.float32)],
        num_scalar_prefetch=2,
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(vmem_estimate(p, n_q_side=3, n_kv_side=4, acc_rows=p.bkv, work=5)
                                    + 2 * p.bq * p.bkv),
        cost_estimate=cost(p, 2),
        body_kwargs={"plan": p},
    )


def _masked_dq_out(ft, bt, q, k, v, do, lse, di, mb, mbt, q_segment_ids=None, kv_segment_ids=None, **statics):
    return bwd_out_dq(q, k, v, do, lse, di)


def _masked_dkv_out(ft, bt, q, k, v, do, lse, di, mb, mbt, q_segment_ids=None, kv_segment_ids=None, **statics):
    return bwd_out_dkv(q, k, v, do, lse, di)


@tpu_kernel(_dq_body, name="flash_attention_masked_bwd_dq", namespace=NAMESPACE, tunables=_tunables(),
            out_shape=_masked_dq_out)
def fa_backward_dq_masked(
    fwd_table: torch.Tensor,
    bwd_table: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    di: torch.Tensor,
    mask_blocks: torch.Tensor,
    mask_blocks_t: torch.Tensor,
    q_segment_ids: Optional[torch.Tensor] = None,
    kv_segment_ids: Optional[torch.Tensor] = None,
    *,
    sm_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    block_kv_compute: int,
) -> torch.Tensor:
    """dQ of the block-sparse masked kernel (``torch.ops.tpukernels.flash_attention_masked_bwd_dq``)."""
    return _launch_dq_masked(fwd_table, bwd_table, q, k, v, do, lse, di, mask_blocks, mask_blocks_t, q_segment_ids,
                             kv_segment_ids, sm_scale, softcap, block_kv_compute)


@tpu_kernel(_dkv_body, name="flash_attention_masked_bwd_dkv", namespace=NAMESPACE, tunables=_tunables(),
            out_shape=_masked_dkv_out)
def fa_backward_dkv_masked(
    fwd_table: torch.Tensor,
    bwd_table: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    di: torch.Tensor,
    mask_blocks: torch.Tensor,
    mask_blocks_t: torch.Tensor,
    q_segment_ids: Optional[torch.Tensor] = None,
    kv_segment_ids: Optional[torch.Tensor] = None,
    *,
    sm_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    block_kv_compute: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV of the block-sparse masked kernel (``torch.ops.tpukernels.flash_attention_masked_bwd_dkv``),
    summed over each GQA group; per kv block the grid walks each query head's listed query blocks."""
    return _launch_dkv_masked(fwd_table, bwd_table, q, k, v, do, lse, di, mask_blocks, mask_blocks_t,
                              q_segment_ids, kv_segment_ids, sm_scale, softcap, block_kv_compute)


@fa_forward_masked.def_backward(op="flash_attention")
def _fa_masked_backward(ctx, d_out, d_lse):
    out, lse = ctx.outputs
    if d_out is None:
        d_out = torch.zeros_like(out)
    di = (d_out.float() * out.float()).sum(-1).unsqueeze(2)
    if d_lse is not None:
        di = di - d_lse
    tabs = (ctx.fwd_table, ctx.bwd_table)
    rest = (ctx.q, ctx.k, ctx.v, d_out, lse, di, ctx.mask_blocks, ctx.mask_blocks_t, ctx.q_segment_ids,
            ctx.kv_segment_ids)
    st = {n: ctx.args[n] for n in _MASK_STATICS}
    grads = {}
    if ctx.needs_input_grad.get("q", True):
        grads["q"] = fa_backward_dq_masked(*tabs, *rest, **st)
    if ctx.needs_input_grad.get("k", True) or ctx.needs_input_grad.get("v", True):
        grads["k"], grads["v"] = fa_backward_dkv_masked(*tabs, *rest, **st)
    return grads


def tensors(tables):
    """Torch tensors of a :class:`.masks.MaskTables` (made once per tables object)."""
    t = getattr(tables, "_torch", None)
    if t is None:
        t = tuple(torch.from_numpy(np.array(a)) for a in (tables.fwd, tables.bwd, tables.blocks, tables.blocks_t))
        tables._torch = t
    return t


def check_mask(mask, Hq: int, Sq: int, Skv: int, where: str = "flash_attention"):
    """Typed errors for a ``mask=`` argument that does not fit ``q`` / ``k``."""
    from .masks import Mask

    if isinstance(mask, (np.ndarray, torch.Tensor)):
        dt = mask.dtype
        if dt not in (np.bool_, torch.bool):
            raise DTypeError(f"{where}: mask must be bool (True = visible), got {dt}")
        raise ArgumentError(f"{where}: mask arrays are wrapped first: mask=NumpyMask(array) (2-D) or "
                            f"MultiHeadMask([...]); got an array of shape {tuple(mask.shape)}")
    if not isinstance(mask, Mask):
        raise ArgumentError(f"{where}: mask must be a tpukernels.library.attention Mask, got {type(mask).__name__}")
    if tuple(mask.shape[-2:]) != (Sq, Skv):
        raise ArgumentError(f"{where}: mask shape {tuple(mask.shape[-2:])} must be (Sq, Skv) = {(Sq, Skv)}")
    if mask.num_heads is not None and mask.num_heads != Hq:
        raise ArgumentError(f"{where}: mask has {mask.num_heads} heads; a multi-head mask needs one per query head "
                            f"(Hq = {Hq})")
