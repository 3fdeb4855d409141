"""Probe (a study, libtpu static estimates: a MODEL, not measurements): is RoPE cheaper fused into the flash
attention forward's Q/K loads than run as the separate :mod:`tpukernels.library.rope` kernel?

Shape: the attention benchmark's forward, causal, B=1, Hq=32, Hkv=8, S=4096, D=128, bf16, cos/sin bf16
``[S, 128]`` (llama rotate-half, full rotary). Compared, per chip:

* ``separate``: ``rope_fwd`` on q (``[1, 32, S, D]``) and on k (``[1, 8, S, D]``) + today's ``fa_forward``;
* ``prototype: fused q+k``: a forward kernel taking un-rotated q and k plus cos/sin; it rotates the q block once
  per query block (first kv step, into a VMEM scratch) and each K block at every kv step (into a scratch);
* ``prototype: fused q (scratch) + rope k``: the same rotating only q; k goes through ``rope_fwd`` (K is 4x
  smaller under GQA 32/8);
* ``library fa_forward_rope + rope k``: the shipped form (:mod:`tpukernels.library.attention.rope_fused`): q
  rotated into the resident ``q_rot`` output block (written back: the backward's rotated q), k via ``rope_fwd``.

The fused kernels wrap today's forward body unchanged (:func:`tpukernels.library.attention.forward.fwd_body`
reads q / k through the scratch refs). Attention kernels are estimated at 1/8 of the heads (Hq=4, Hkv=1) at the
config a full-size call gets and scaled x8, as ``tpukernels bench --family attention`` does; ``rope_fwd`` is
estimated at full size. Every part's model time is ``max(cycles / clock, HBM bytes / bandwidth, MXU FLOPs /
peak)`` (:func:`tpukernels.perf.model_time`): the rope kernel is HBM-bound.

Result (libtpu 0.0.52, 2026-12-03; a model): forward, µs

=====  ========  =====================  ===================  ==========================  =================
chip   separate  separate, rope at its  prototype fused q+k  prototype fused q + rope k  library fused q
                 HBM floor                                                              (saves q_rot)
                                                                                        + rope k
=====  ========  =====================  ===================  ==========================  =================
v6e    645.8     617.8                  643.0                623.1                       621.8 (1.039x)
tpu7x  492.5     464.5                  VMEM overflow        473.7                       472.2 (1.043x)
v5e    1135.8    1107.8                 1098.0               1082.6                      1084.0 (1.048x)
=====  ========  =====================  ===================  ==========================  =================

(attention forward alone: v6e 564.0, tpu7x 440.7, v5e 1000.3; rope q / k: v6e 64.6 / 17.1, tpu7x 41.1 / 10.7, v5e
106.8 / 28.6, each roofline + grid steps: libtpu's profiler aborts on rope_fwd.) Rotating K inside the kernel
costs +14% of the forward's cycles on v6e (each K block is rotated again for every query head of its group and
every query block) and overflows tpu7x's VMEM at the v6e blocks; rotating q once per query block costs +7%
(v6e), which is about the separate kernel's HBM time for q: against the rope kernels' bare HBM floor fusion
is a tie on v6e (1.003x) and tpu7x (0.996x) and wins on v5e (1.027x). Folding the logit scale into the
rotated q (a variant tried, not shipped) gained a further 0.2% (v6e) / 1.3% (tpu7x).

Run (one libtpu estimate at a time, ~1-2 min each; cached in the bench estimate cache)::

    JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost ALLOW_MULTIPLE_LIBTPU_LOAD=1 \\
        nice -n 10 .venv/bin/python benchmarks/rope_fusion_probe.py --chips v6e,tpu7x,v5e [--check]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tpukernels.dsl import Launch, tpu_kernel  # noqa: E402
from tpukernels.library.attention import plan as _pl  # noqa: E402
from tpukernels.library.attention.forward import fwd_body, fwd_out_shape  # noqa: E402
from tpukernels.library.attention.rope_fused import fa_forward_rope  # noqa: E402
from tpukernels.library.attention.tiles import common_specs, kv_index_fn, q_major_step  # noqa: E402

S, HQ, HKV, D, DIV = 4096, 32, 8, 128, 8
CFG = dict(block_q=2048, block_kv=2048, block_kv_compute=512, block_h=1)  # the shipped v6e / tpu7x config


def _rotate(x, cos, sin, rotary_dim: int):
    """Rotate-half RoPE of ``x`` ``(..., n, D)`` with ``(n, D)`` cos/sin blocks, in float32 (rope.py's formula)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    from tpukernels.library.rope import lane_tables

    f32 = jnp.float32
    d = x.shape[-1]
    cos, sin = cos.astype(f32), sin.astype(f32)
    x = x.astype(f32)
    ax = x.ndim - 1
    if rotary_dim == d and d % 2 == 0:  # full rotary: one lane roll by D/2 serves both halves
        lane = jax.lax.broadcasted_iota(jnp.int32, cos.shape, 1)
        return x * cos + pltpu.roll(x, d // 2, ax) * jnp.where(lane < d // 2, -sin, sin)
    c, a, b, s = lane_tables(cos, sin, rotary_dim, False)
    return x * c + pltpu.roll(x, d - s, ax) * a + pltpu.roll(x, s, ax) * b


def _rotate_into(dst, src, cos_ref, sin_ref, rotary_dim: int, chunk: int = 256):
    """``dst[..., r, :] = rope(src[..., r, :])`` in row chunks (bounded float32 temporaries)."""
    from jax.experimental import pallas as pl

    n = src.shape[-2]
    for r0 in range(0, n, chunk):
        rows = pl.ds(r0, min(chunk, n - r0))
        y = _rotate(src[..., rows, :], cos_ref[rows, :], sin_ref[rows, :], rotary_dim)
        dst[..., rows, :] = y.astype(dst.dtype)


def _rope_fwd_body(*refs, plan, rotary_dim: int, fuse_k: bool):
    from jax.experimental import pallas as pl

    p = plan
    if fuse_k:
        q_ref, k_ref, v_ref, cq, sq, ck, sk, o_ref, lse_ref, m_sc, l_sc, acc_sc, q_sc, k_sc = refs
    else:
        q_ref, k_ref, v_ref, cq, sq, o_ref, lse_ref, m_sc, l_sc, acc_sc, q_sc = refs
        k_sc = k_ref
    i, t = pl.program_id(2), pl.program_id(3)
    _, run, _, _ = q_major_step(p, None, i, t)

    @pl.when(t == 0)
    def _rot_q():
        _rotate_into(q_sc, q_ref, cq, sq, rotary_dim)

    if fuse_k:
        @pl.when(run)
        def _rot_k():
            _rotate_into(k_sc, k_ref, ck, sk, rotary_dim)

    fwd_body(q_sc, k_sc, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, plan=p)


def _launch(q, k, v, cos, sin, statics, cfg, fuse_k: bool) -> Launch:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    p = _pl.make_plan(q, k, v, None, **statics, **cfg)
    kv_index = kv_index_fn(p)
    q_spec, k_spec, v_spec, row_spec, _, _ = common_specs(p, kv_index)
    tq = pl.BlockSpec((p.bq, p.D), lambda b, h, i, t: (i, 0))
    tk = pl.BlockSpec((p.bkv, p.D), lambda b, h, i, t: (kv_index(i, t), 0))
    in_specs = [q_spec, k_spec, v_spec, tq, tq] + ([tk, tk] if fuse_k else [])
    o_spec = pl.BlockSpec((None, p.hb, p.bq, p.Dv), lambda b, h, i, t: (b, h, i, 0))
    scratch = [pltpu.VMEM((p.rows, 128), np.float32), pltpu.VMEM((p.rows, 128), np.float32),
               pltpu.VMEM((p.rows, p.Dv), np.float32), pltpu.VMEM((p.hb, p.bq, p.D), q.dtype)]
    if fuse_k:
        scratch.append(pltpu.VMEM((p.bkv, p.D), k.dtype))
    est = _pl.vmem_estimate(p, n_q_side=2, n_kv_side=2, acc_rows=p.rows, work=3)
    est += p.rows * p.D * 2 + 2 * p.bq * p.D * 2 * 2 + (3 * p.bkv * p.D * 2 if fuse_k else 0)
    return Launch(
        grid=(p.B, p.Hq // p.hb, p.nq, p.kv_steps),
        in_specs=in_specs, out_specs=[o_spec, row_spec], out_shape=fwd_out_shape(q, k, v),
        scratch_shapes=scratch,
        dimension_semantics=("parallel", "parallel", "arbitrary" if p.rows_whole else "parallel", "arbitrary"),
        vmem_limit_bytes=_pl.vmem_limit(est), cost_estimate=_pl.cost(p, 1),
        body_kwargs={"plan": p, "rotary_dim": int(cos.shape[-1]), "fuse_k": fuse_k},
    )


_T = _pl.tunables(_pl.DOC_H)


@tpu_kernel(_rope_fwd_body, name="probe_flash_rope_qk_fwd", namespace="tpukernels_probe", tunables=_T,
            constraints=[_pl.compute_divides], heuristic=_pl.heuristic,
            out_shape=lambda q, k, v, *a, **s: fwd_out_shape(q, k, v))
def fa_rope_qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor,
               cos_k: torch.Tensor, sin_k: torch.Tensor, *, causal: bool = True, causal_alignment: str = "top_left",
               sm_scale: Optional[float] = None, window_left: Optional[int] = None, window_right: Optional[int] = None, softcap: Optional[float] = None,
               block_q: int, block_kv: int, block_kv_compute: int, block_h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prototype: flash forward rotating q (once per query block) and K (every kv step) in VMEM."""
    statics = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale, window_left=window_left,
                   window_right=window_right, softcap=softcap)
    return _launch(q, k, v, cos_q, sin_q, statics, dict(block_q=block_q, block_kv=block_kv,
                   block_kv_compute=block_kv_compute, block_h=block_h), True)


@tpu_kernel(_rope_fwd_body, name="probe_flash_rope_q_fwd", namespace="tpukernels_probe", tunables=_T,
            constraints=[_pl.compute_divides], heuristic=_pl.heuristic,
            out_shape=lambda q, k, v, *a, **s: fwd_out_shape(q, k, v))
def fa_rope_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, *,
              causal: bool = True, causal_alignment: str = "top_left", sm_scale: Optional[float] = None,
              window_left: Optional[int] = None, window_right: Optional[int] = None, softcap: Optional[float] = None,
              block_q: int, block_kv: int, block_kv_compute: int, block_h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prototype: flash forward rotating q once per query block in VMEM (k already rotated)."""
    statics = dict(causal=causal, causal_alignment=causal_alignment, sm_scale=sm_scale, window_left=window_left,
                   window_right=window_right, softcap=softcap)
    return _launch(q, k, v, cos_q, sin_q, statics, dict(block_q=block_q, block_kv=block_kv,
                   block_kv_compute=block_kv_compute, block_h=block_h), False)


def check_numerics(seed: int = 0) -> float:
    """Interpret-mode check of both prototypes against rope (float64) then dense causal attention; returns the
    worst max-abs error (a small bf16 shape)."""
    from tpukernels.library.attention.reference import attention_reference
    from tpukernels.library.rope import rope_reference

    g = torch.Generator().manual_seed(seed)
    B, hq, hkv, s, d = 1, 4, 2, 256, 128
    q, k, v = (torch.randn(B, h, s, d, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.arange(s).double()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    qr, kr = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    ref, _ = attention_reference(qr, kr, v.double(), causal=True, dtype=torch.float64)
    cfg = dict(block_q=128, block_kv=128, block_kv_compute=128, block_h=1)
    from tpukernels.library.rope import apply_rope
    worst = 0.0
    out_qk, _ = fa_rope_qk(q, k, v, cos, sin, cos, sin, config=cfg)
    out_q, _ = fa_rope_q(q, apply_rope(k, cos, sin), v, cos, sin, config=cfg)
    out_l, _, q_rot = fa_forward_rope(q, apply_rope(k, cos, sin), v, cos, sin, rotary_dim=d, causal=True, config=cfg)
    worst = max(worst, float((q_rot.double() - qr).abs().max()) / 0.05)  # q_rot within bf16 rounding of |q| <~ 6
    for o in (out_qk, out_q, out_l):
        worst = max(worst, float((o.double() - ref).abs().max()))
    return worst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chips", default="v6e,tpu7x")
    ap.add_argument("--no-cache", action="store_true", help="do not use the bench estimate cache")
    ap.add_argument("--first", type=int, default=0, help="skip the first N fused variants")
    ap.add_argument("--check", action="store_true", help="first check the prototypes' numerics (interpret mode)")
    args = ap.parse_args(argv)

    from tpukernels.bench.core import Estimator, default_cache_path, kernel_program
    from tpukernels.bench.attention import attention_flops, attention_io_bytes
    from tpukernels.library.attention import CAUSAL, fa_forward
    from tpukernels.library.rope import rope_fwd
    from tpukernels.perf import model_time
    from tpukernels.autotune.evaluators import TpuModelEvaluator
    from tpukernels.autotune.space import Problem

    if args.check:
        print(f"prototype numerics (interpret, bf16, vs float64 rope + causal attention): max |err| = "
              f"{check_numerics():.3g}", flush=True)
    est = Estimator(cache_path=None if args.no_cache else default_cache_path())
    q_full, kv_full = f"1x{HQ}x{S}x{D}:bf16", f"1x{HKV}x{S}x{D}:bf16"
    q_sm, kv_sm = f"1x{HQ // DIV}x{S}x{D}:bf16", f"1x{HKV // DIV}x{S}x{D}:bf16"
    tab = f"{S}x{D}:bf16"
    flops = attention_flops(S, HQ, False)
    io = attention_io_bytes(S, HQ, HKV, False)
    rope_kw = dict(rotary_dim=D, interleaved=False, seq_dim=2, transpose=False)

    def cyc(kernel, args_, kwargs, cfg=None):
        fn, st, c, _ = kernel_program(kernel, chip, args_, kwargs, cfg)
        t0 = time.time()
        n = est.cycles(fn, st, chip)
        print(f"  {chip} {kernel.name}: {n} cycles ({time.time() - t0:.0f}s) cfg={c}", flush=True)
        return n

    def rope_us(shape):
        """rope_fwd through the autotuner's tpu-model evaluator (what chose its shipped config), best block_s:
        libtpu's static estimate when it gives one (on a reduced grid, scaled), else -- libtpu 0.0.52 aborts
        on this kernel (llo_execution_graph.cc:46) -- max(HBM roofline, MXU) + 0.35 us per grid step."""
        args_ = (shape, f"1x{S}x{D}:bf16", f"1x{S}x{D}:bf16")
        best = None
        for bs in (64, 128, 256, 512, 1024):
            tr = TpuModelEvaluator(chip=chip).evaluate(Problem.from_args(rope_fwd, *args_, **rope_kw), {"block_s": bs})
            if tr.status != "ok":
                continue
            d = tr.details
            if best is None or tr.time_us < best[0]:
                best = (tr.time_us, bs, d)
        t, bs, d = best
        print(f"  {chip} rope_fwd {shape}: {t:.1f} us at block_s={bs} ({d['bound']}-bound; "
              f"{d['cycles_note'].split(';')[-1].strip() if d['cycles_note'] else ''}; {d['grid_steps']} steps, "
              f"{d['hbm_bytes']} B; HBM floor {d['memory_us']:.1f} us)", flush=True)
        return t, d["memory_us"]

    tabs2, tabs4 = (tab, tab), (tab, tab, tab, tab)
    for chip in args.chips.split(","):
        attn = model_time(chip, DIV * cyc(fa_forward, (q_sm, kv_sm, kv_sm), dict(CAUSAL), CFG), io, flops).time_us
        (rq, rq_floor), (rk, rk_floor) = rope_us(q_full), rope_us(kv_full)
        sep = attn + rq + rk
        print(f"{chip} (libtpu static estimate, a model): attention fwd {attn:.1f} us, rope q {rq:.1f} us, "
              f"rope k {rk:.1f} us; separate (rope q + rope k + fwd) = {sep:.1f} us; with both rope kernels at "
              f"their HBM floor (no grid-step cost) {attn + rq_floor + rk_floor:.1f} us", flush=True)
        variants = (("prototype: fused q+k", fa_rope_qk, tabs4, {}, 0.0),
                    ("prototype: fused q (scratch) + rope k", fa_rope_q, tabs2, {}, rk),
                    ("library fa_forward_rope + rope k", fa_forward_rope, tabs2, {"rotary_dim": D}, rk))
        for label, kern, tabs, kw, extra_k in variants[args.first:]:
            try:
                n = DIV * cyc(kern, (q_sm, kv_sm, kv_sm) + tabs, dict(CAUSAL, **kw) if kw else {}, CFG)
            except Exception as e:  # noqa: BLE001  (e.g. VMEM overflow on a chip: reported, the rest goes on)
                print(f"{chip}   {label:38}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            extra_io = len(tabs) * S * D * 2 + (HQ * S * D * 2 if kern is fa_forward_rope else 0)
            t = model_time(chip, n, io + extra_io, flops).time_us + extra_k
            t_floor = t - extra_k + (rk_floor if extra_k else 0.0)
            print(f"{chip}   {label:38} = {t:8.1f} us  (separate / fused = {sep / t:.3f}x; both with the rope "
                  f"kernels at their HBM floor: {(attn + rq_floor + rk_floor) / t_floor:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
