"""Flash attention forward with RoPE fused into the query load: kernel :data:`fa_forward_rope`
(``torch.ops.tpukernels.flash_attention_rope_fwd``) -> ``(out, lse, q_rot)``; reached through
:func:`tpukernels.library.flash_attention`'s ``rope_cos`` / ``rope_sin`` arguments.

What is fused and why (libtpu 0.0.52 static estimates, a MODEL, not measurements; ``benchmarks/rope_fusion_probe.py``,
forward, causal, B=1, Hq=32, Hkv=8, S=4096, D=128, bf16, at the shipped attention config):

* q is rotated in VMEM once per query block (at the first kv step, in row chunks, in float32, rounded once to
  q's dtype) into the ``q_rot`` output block, which stays resident for the whole kv loop and which the unchanged
  forward body (:func:`.forward.fwd_body`) reads as its q. Writing ``q_rot`` back to HBM costs ~0.3% in the
  model (the kernel is compute-bound) and hands the backward the rotated q, so the backward runs today's
  dQ / dK/dV kernels unchanged: ``dq = rope^T(dq_rot)`` by the separate RoPE kernel's transposed form.
* k is rotated by the separate :mod:`tpukernels.library.rope` kernel: under GQA K is ``Hq / Hkv`` times smaller
  than Q, and rotating each K block inside the kernel repeats the work for every query head and query block
  that reads it: +14% of the forward's cycles on v6e against ~3% for the separate kernel (and the v6e-sized
  blocks then overflow tpu7x's 64 MiB VMEM).

Model result (probe): separate RoPE on q and k + forward vs this kernel + RoPE on k: v6e 645.8 vs 621.8 µs
(1.039x), tpu7x 492.5 vs 472.2 µs (1.043x), v5e 1135.8 vs 1084.0 µs (1.048x). libtpu's static profiler aborts
on the separate RoPE kernel, so it is modelled as the autotuner models it: HBM roofline + 0.35 µs per grid step
(64 steps for q at its shipped ``block_s=64``). With both RoPE kernels at their bare HBM floor instead (no step
cost) the comparison is a tie on v6e (1.003x) and tpu7x (0.996x) and a gain on v5e (1.027x): what fusion saves
is a pass over q, and on v6e / tpu7x the in-kernel rotation costs about what that pass's HBM time does.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...dsl import Launch, OutSpec, tpu_kernel
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .forward import fwd_body as _fwd_body, fwd_out_shape
from .plan import (DOC_H as _DOC_H, NAMESPACE, STATIC_NAMES, check_args, compute_divides as _compute_divides, cost,
                   heuristic as _heuristic, make_plan, tunables as _tunables, vmem_estimate, vmem_limit)
from .tiles import common_specs, kv_index_fn

#: Query rows rotated per chunk (bounds the float32 temporaries of the rotation).
ROTATE_CHUNK = 256


def _rotate(x, cos, sin, rotary_dim: int, interleaved: bool):
    """RoPE of ``x`` ``(..., n, D)`` with ``(n, D)`` cos/sin (lanes ``>= rotary_dim`` unused), float32; the
    lane-roll formula of :mod:`tpukernels.library.rope`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    from ..rope import lane_tables

    f32 = jnp.float32
    d = x.shape[-1]
    cos, sin, x = cos.astype(f32), sin.astype(f32), x.astype(f32)
    ax = x.ndim - 1
    if rotary_dim == d and not interleaved:  # full rotate-half: one roll by D/2 brings each lane's partner
        lane = jax.lax.broadcasted_iota(jnp.int32, cos.shape, 1)
        return x * cos + pltpu.roll(x, d // 2, ax) * jnp.where(lane < d // 2, -sin, sin)
    c, a, b, s = lane_tables(cos, sin, rotary_dim, interleaved)
    return x * c + pltpu.roll(x, d - s, ax) * a + pltpu.roll(x, s, ax) * b


def _rope_fwd_body(*refs, plan, rotary_dim: int, interleaved: bool):
    from jax.experimental import pallas as pl

    p = plan
    if p.has_seg:
        q_ref, k_ref, v_ref, cos_ref, sin_ref, qs_ref, ks_ref, o_ref, lse_ref, qr_ref, *scratch = refs
    else:
        q_ref, k_ref, v_ref, cos_ref, sin_ref, o_ref, lse_ref, qr_ref, *scratch = refs

    @pl.when(pl.program_id(3) == 0)
    def _rotate_q():  # into the resident q_rot output block, once per query block
        n = p.bq
        for r0 in range(0, n, ROTATE_CHUNK):
            rows = pl.ds(r0, min(ROTATE_CHUNK, n - r0))
            y = _rotate(q_ref[:, rows, :], cos_ref[rows, :], sin_ref[rows, :], rotary_dim, interleaved)
            qr_ref[:, rows, :] = y.astype(qr_ref.dtype)

    seg = (qs_ref, ks_ref) if p.has_seg else ()
    _fwd_body(qr_ref, k_ref, v_ref, *seg, o_ref, lse_ref, *scratch, plan=p)


def _rope_out_shape(q, k, v, cos, sin, q_segment_ids=None, kv_segment_ids=None, **statics):
    if statics:  # fake (meta) path: same typed errors as the real one
        _check_rope_kernel_args(q, k, v, cos, sin, q_segment_ids, kv_segment_ids, **statics)
    return tuple(fwd_out_shape(q, k, v)) + (OutSpec(tuple(q.shape), q.dtype),)


def _check_rope_kernel_args(q, k, v, cos, sin, q_segment_ids, kv_segment_ids, *, rotary_dim, interleaved, **statics):
    from ...errors import ArgumentError, DTypeError

    where = "flash_attention_rope_fwd"
    check_args(q, k, v, q_segment_ids, kv_segment_ids, **statics, where=where)
    Sq, D = int(q.shape[2]), int(q.shape[3])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (Sq, D):
            raise ArgumentError(f"{where}: {name} must be [Sq, D] = [{Sq}, {D}] (the query positions' table, lanes "
                                f"padded to D), got {tuple(t.shape)}")
        if np.dtype(t.dtype).name not in ("bfloat16", "float32"):
            raise DTypeError(f"{where}: {name} dtype {np.dtype(t.dtype).name} is not supported: bfloat16 or float32")
    if not (isinstance(rotary_dim, int) and 2 <= rotary_dim <= D and rotary_dim % 2 == 0):
        raise ArgumentError(f"{where}: rotary_dim must be even and in [2, D={D}], got {rotary_dim!r}")


def _launch_rope_fwd(q, k, v, cos, sin, q_segment_ids, kv_segment_ids, statics, cfg, rotary_dim, interleaved) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    _check_rope_kernel_args(q, k, v, cos, sin, q_segment_ids, kv_segment_ids, rotary_dim=rotary_dim,
                            interleaved=interleaved, **statics)
    p = make_plan(q, k, v, q_segment_ids, **statics, **cfg)
    q_spec, k_spec, v_spec, row_spec, qs_spec, ks_spec = common_specs(p, kv_index_fn(p))
    t_spec = pl.BlockSpec((p.bq, p.D), lambda b, h, i, t: (i, 0))
    in_specs = [q_spec, k_spec, v_spec, t_spec, t_spec] + ([qs_spec, ks_spec] if p.has_seg else [])
    o_spec = pl.BlockSpec((None, p.hb, p.bq, p.Dv), lambda b, h, i, t: (b, h, i, 0))
    scratch = [pltpu.VMEM((p.rows, 128), np.float32), pltpu.VMEM((p.rows, 128), np.float32),
               pltpu.VMEM((p.rows, p.Dv), np.float32)]
    it = np.dtype(q.dtype).itemsize
    extra = 2 * p.rows * p.D * it + 2 * 2 * p.bq * p.D * np.dtype(cos.dtype).itemsize + 4 * ROTATE_CHUNK * p.D * 4 * p.hb
    return Launch(
        grid=(p.B, p.Hq // p.hb, p.nq, p.kv_steps if p.Skv else 0),
        in_specs=in_specs,
        out_specs=[o_spec, row_spec, q_spec],
        out_shape=_rope_out_shape(q, k, v, cos, sin),
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "arbitrary" if p.rows_whole else "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(vmem_estimate(p, n_q_side=2, n_kv_side=2, acc_rows=p.rows, work=3) + extra),
        cost_estimate=cost(p, 1,
                           extra_bytes=p.B * p.Hq * p.Sq * p.D * it + 2 * p.Sq * p.D * np.dtype(cos.dtype).itemsize),
        body_kwargs={"plan": p, "rotary_dim": int(rotary_dim), "interleaved": bool(interleaved)},
    )


def _rope_sharding(**args):
    """DTensor rule: over the batch or the heads as the plain forward (GQA: kv heads split with their query
    heads); the ``[Sq, D]`` tables are replicated."""
    from ...distributed.sharding import Split, TensorMeta

    tensors = [n for n in ("q", "k", "v", "q_segment_ids", "kv_segment_ids") if isinstance(args.get(n), TensorMeta)]
    heads = [n for n in ("q", "k", "v") if n in tensors]
    return [Split({n: 0 for n in tensors}, (0, 0, 0)), Split({n: 1 for n in heads}, (1, 1, 1))]


@tpu_kernel(_rope_fwd_body, name="flash_attention_rope_fwd", namespace=NAMESPACE, tunables=_tunables(_DOC_H),
            constraints=[_compute_divides], heuristic=_heuristic, out_shape=_rope_out_shape, sharding=_rope_sharding)
def fa_forward_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_segment_ids: Optional[torch.Tensor] = None,
    kv_segment_ids: Optional[torch.Tensor] = None,
    *,
    rotary_dim: int,
    interleaved: bool = False,
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
    """Flash attention forward rotating q (RoPE) in VMEM: ``torch.ops.tpukernels.flash_attention_rope_fwd``.

    Args:
        q: ``[B, Hq, Sq, D]`` un-rotated queries; k: ``[B, Hkv, Skv, D]`` keys **already rotated**;
            v: ``[B, Hkv, Skv, Dv]``; bf16 or f32, one dtype.
        cos, sin: ``[Sq, D]`` bf16/f32, the RoPE table rows of the query positions (HF convention, lanes
            ``>= rotary_dim`` unused: pad them); formula in :mod:`tpukernels.library.rope`.
        rotary_dim: rotated lanes ``R`` (even, ``2 <= R <= D``); interleaved: GPT-J pairs instead of rotate-half.
        q_segment_ids, kv_segment_ids, causal, causal_alignment, sm_scale, window_left, window_right, softcap:
            as :data:`tpukernels.library.attention.fa_forward`.

    Returns:
        ``out`` ``[B, Hq, Sq, Dv]`` (q's dtype), ``lse`` ``[B, Hq, 1, Sq]`` f32 (natural log) and ``q_rot``
        ``[B, Hq, Sq, D]`` (q's dtype): the rotated q the logits used (what the backward needs).

    Raises:
        ArgumentError, DTypeError: as ``fa_forward``; cos/sin not ``[Sq, D]`` or not bf16/f32; bad rotary_dim.
    """
    statics = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale, window_left=window_left,
                   window_right=window_right, softcap=softcap)
    cfg = dict(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv_compute, block_h=block_h)
    return _launch_rope_fwd(q, k, v, cos, sin, q_segment_ids, kv_segment_ids, statics, cfg, rotary_dim, interleaved)


@fa_forward_rope.def_backward(op="flash_attention")
def _fa_rope_backward(ctx, d_out, d_lse, d_qrot):
    """The dense backward (:func:`.backward_fused.dense_backward`: fused or split kernels) on the saved rotated q; ``dq = rope^T(dq_rot)`` (the RoPE kernel's transposed
    map, :data:`tpukernels.library.rope.rope_fwd` with ``transpose=True``); cos/sin gradients (when asked for)
    from :func:`tpukernels.library.rope.table_grads`."""
    from ..rope import table_grads, rope_fwd
    from .backward_fused import dense_backward

    q, k, v, cos, sin = ctx.q, ctx.k, ctx.v, ctx.cos, ctx.sin
    qs, ks = ctx.q_segment_ids, ctx.kv_segment_ids
    out, lse, q_rot = ctx.outputs
    statics = {n: ctx.args[n] for n in STATIC_NAMES}
    r, inter = ctx.args["rotary_dim"], ctx.args["interleaved"]
    need = ctx.needs_input_grad
    need_qrot = need.get("q", True) or need.get("cos") or need.get("sin")
    if d_out is None:
        d_out = torch.zeros_like(out)
    di = (d_out.float() * out.float()).sum(-1).unsqueeze(2)  # [B, Hq, 1, Sq]
    if d_lse is not None:
        di = di - d_lse
    need_kv = need.get("k", True) or need.get("v", True)
    grads = dense_backward(q_rot, k, v, d_out, lse, di, qs, ks, statics, need_qrot, need_kv)  # fused or split
    if need_qrot:
        dq_rot = grads.pop("q")
        if d_qrot is not None:
            dq_rot = dq_rot + d_qrot
        if need.get("q", True):
            grads["q"] = rope_fwd(dq_rot, cos[None], sin[None], r, inter, 2, True)
        if need.get("cos") or need.get("sin"):
            dcos, dsin = table_grads(dq_rot, q, cos[None], r, inter, 2, False)
            grads["cos"] = dcos[0].to(cos.dtype) if need.get("cos") else None
            grads["sin"] = dsin[0].to(sin.dtype) if need.get("sin") else None
    return grads
