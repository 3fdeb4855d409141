"""Flash attention block sweeps (a study): libtpu static estimates (a model, not a measurement) that chose the
shipped attention configs and the JAX kernel blocks the benchmark compares against.

For each chip and sequence length, at ``B=1, Hq=32, Hkv=8, D=128``, causal, bf16 (the shape of the
compile-only tests), compiles without a TPU and asks libtpu for its static ``estimated_cycles``, turned
into a model time with :func:`tpukernels.perf.model_time` (max of cycles / clock and the HBM and MXU
rooflines), for every config of a small sweep of

* ``tpukernels``: :data:`tpukernels.library.attention.fa_forward` (``--sweep ours``);
* ``jax-pallas``: ``jax.experimental.pallas.ops.tpu.flash_attention`` (``--sweep jax``). It has no GQA, so it
  gets K/V repeated to 32 heads (what a user would pass).

``--backward`` adds the backward (our dQ + dK/dV kernels + the ``rowsum(dO * O)`` XLA op vs JAX's
backward kernels at the same blocks); with ``--fused-backward`` the backward swept and recorded is the fused
kernel :data:`~tpukernels.library.attention.backward_fused.fa_backward_fused` (+ the rowsum; pass ``bwd_fused``).
``--mask full`` sweeps and records the non-causal entries. Sweeps run at a quarter of the heads (B=1, Hq=8, Hkv=2; the
estimate is linear in the head count, ``--check-scaling`` verifies it) to save time. ``--write-defaults`` records the best swept config per (chip, length) in the shipped
tuning DB (``tpukernels/data/autotuning/<chip>/tpukernels.flash_attention*.json``).

Run (several minutes per chip and length; S=8192 estimates take up to minutes each)::

    B=benchmarks/attention.py
    .venv/bin/python $B --chips v5e,v6e,tpu7x --seqs 4096,8192 --backward --sweep both   # trials -> results
    .venv/bin/python $B --chips v5e,v6e,tpu7x --seqs 4096,8192 --backward --write-defaults

The comparison with XLA and JAX's kernels (published in BENCHMARKS.md) is ``tpukernels bench --family attention``
(:mod:`tpukernels.bench.attention`), which uses the JAX blocks this study's ``--sweep jax`` found best.

Trials are appended to ``--results`` (JSON lines, default ``~/.cache/tpukernels/bench/attention_sweep.jsonl``),
so defaults can be re-recorded after an edit elsewhere without re-estimating; trials of older kernel source
(the DB keys on the kernel's source hash) are ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tpukernels.autotune import db  # noqa: E402
from tpukernels.autotune.estimator import client  # noqa: E402
from tpukernels.bench.attention import attention_flops, attention_io_bytes  # noqa: E402  (shared with `tpukernels bench`)
from tpukernels.library.attention import fa_backward_dkv, fa_backward_dq, fa_forward  # noqa: E402
from tpukernels.library.attention.backward_fused import fa_backward_fused  # noqa: E402
from tpukernels.lowering import lower  # noqa: E402
from tpukernels.perf import model_time  # noqa: E402
from tpukernels.chips import get_chip  # noqa: E402
from tpukernels.dsl.spec import TensorSpec  # noqa: E402

B, HQ, HKV, D = 1, 32, 8, 128
DT = jnp.bfloat16
STATICS = dict(causal=True, causal_alignment="top_left", sm_scale=None, window_left=None, window_right=None,
               softcap=None)
STATIC_T = tuple(STATICS.items())
#: ``--mask full``: the same statics without the causal mask (non-causal entries: encoders, diffusion, the
#: non-causal rows of the calibration against tokamax's measured times)
STATIC_FULL = tuple(dict(STATICS, causal=False).items())

#: Sweep spaces (pruned by earlier, wider sweeps at S=2048/4096/8192 on v6e: 512-query forward blocks and
#: 256-key DMA blocks never won, and neither did JAX's block_k=256).
OURS_FWD_SWEEP = [dict(block_q=bq, block_kv=bkv, block_kv_compute=c, block_h=1)
                  for bq, bkv, c in ((1024, 1024, 512), (1024, 2048, 512), (2048, 1024, 512), (2048, 2048, 512),
                                     (2048, 2048, 256), (1024, 1024, 256))]
#: without the mask every step is a full block, so 256-key compute sub-blocks are tried at every block size (the
#: first non-causal sweep on tpu7x, S=4096: 2048 / 2048 / 256 estimated 5% faster than / 512)
OURS_FWD_SWEEP_FULL = OURS_FWD_SWEEP + [dict(block_q=bq, block_kv=bkv, block_kv_compute=c, block_h=1)
                                        for bq, bkv, c in ((1024, 2048, 256), (2048, 1024, 256), (2048, 2048, 128),
                                                           (2048, 4096, 256), (4096, 4096, 256))]
OURS_BWD_SWEEP = [dict(block_q=bq, block_kv=bkv, block_kv_compute=c, block_h=1)
                  for bq, bkv, c in ((1024, 1024, 512), (2048, 1024, 512), (1024, 2048, 512), (2048, 2048, 512),
                                     (1024, 1024, 256))]
#: the fused backward (key-major, resident f32 dQ): its live f32 tiles are block_kv_compute x block_q, so 1024
#: queries by default (:func:`~tpukernels.library.attention.backward_fused.fused_heuristic`); smaller compute
#: sub-blocks and 512-query steps are the levers tried
OURS_BWD_FUSED_SWEEP = [dict(block_q=bq, block_kv=bkv, block_kv_compute=c, block_h=1)
                        for bq, bkv, c in ((1024, 2048, 512), (1024, 2048, 256), (512, 2048, 512), (1024, 1024, 512),
                                           (512, 1024, 512), (2048, 2048, 512), (2048, 2048, 256), (1024, 4096, 512),
                                           (512, 4096, 512))]
JAX_FWD_SWEEP = [(512, 512, 512), (1024, 1024, 512), (2048, 1024, 512), (1024, 2048, 512), (2048, 2048, 512)]
JAX_BWD_SWEEP = [(512, 512, 512), (1024, 1024, 512)]  # (2048, 2048, 512): VMEM OOM on v5e, slower on v6e
#: Sweeps run at 1/SWEEP_DIV of the heads (group size kept); estimates are linear in the head count.
SWEEP_DIV = 8


def _estimate(fn, structs, chip: str, timeout_s: float = 1800) -> int:
    plain = [jax.ShapeDtypeStruct(tuple(s.shape), s.dtype) for s in structs]
    blob = jax.export.export(fn, platforms=["tpu"])(*plain).serialize()
    cyc = client().estimate(bytes(blob), get_chip(chip).name, timeout_s)
    if cyc is None:
        raise RuntimeError("libtpu wrote no static profile")
    return int(cyc)


def _specs(S, hq, hkv, backward):
    q = TensorSpec((B, hq, S, D), np.dtype(DT))
    kv = TensorSpec((B, hkv, S, D), np.dtype(DT))
    if not backward:
        return (q, kv, kv, None, None)
    rows = TensorSpec((B, hq, 1, S), np.dtype("float32"))
    return (q, kv, kv, q, rows, rows, None, None)


def _kernels(backward: bool, fused: bool = False) -> tuple:
    if not backward:
        return (fa_forward,)
    return (fa_backward_fused,) if fused else (fa_backward_dq, fa_backward_dkv)


def ours(chip: str, S: int, config: dict | None, *, hq=HQ, hkv=HKV, backward=False, causal=True,
         fused=False) -> dict:
    """Cycles of our forward (or dQ + dK/dV, or fused backward) kernels at ``config`` (None: dispatch config)."""
    kernels = _kernels(backward, fused)
    total, used = 0, []
    for kernel in kernels:
        specs = _specs(S, hq, hkv, backward)
        low = lower(kernel, [s if s is None else TensorSpec(s.shape, s.dtype, p.name)
                             for s, p in zip(specs, kernel.tensor_params)], _statics(causal), config, mode="mosaic",
                    chip=get_chip(chip))
        total += _estimate(low.fn, low.arg_structs, chip)
        used.append(dict(low.config))
    if backward:  # Di = rowsum(dO * O): one XLA fusion
        o = jax.ShapeDtypeStruct((B, hq, S, D), DT)
        total += _estimate(jax.jit(lambda a, b: jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32), -1)), [o, o], chip)
    return {"cycles": total, "config": used[0] if len(used) == 1 else used}


def jax_pallas(chip: str, S: int, blocks: tuple | None, *, hq=HQ, backward=False, causal=True) -> int:
    from jax.experimental.pallas.ops.tpu import flash_attention as jfa

    bs = None
    if blocks is not None:
        bq, bkm, bk = blocks
        bs = jfa.BlockSizes(block_q=bq, block_k_major=bkm, block_k=bk, block_b=1, block_q_major_dkv=bq,
                            block_k_major_dkv=bkm, block_k_dkv=bk, block_q_dkv=bq, block_k_major_dq=bkm,
                            block_k_dq=bk, block_q_dq=bq)
    x = jax.ShapeDtypeStruct((B, hq, S, D), DT)

    def fwd(q, k, v):
        return jfa.flash_attention(q, k, v, causal=causal, sm_scale=D ** -0.5, block_sizes=bs)

    if not backward:
        return _estimate(jax.jit(fwd), [x, x, x], chip)

    def bwd(q, k, v, do):  # the residuals (o, l, m) come from a forward inside the vjp; subtract it
        return jax.vjp(fwd, q, k, v)[1](do)

    return _estimate(jax.jit(bwd), [x, x, x, x], chip) - _estimate(jax.jit(fwd), [x, x, x], chip)


def us(chip, cycles, S, backward=False, hq=HQ, hkv=HKV, causal=True):
    flops = attention_flops(S, hq, backward, causal)
    return model_time(chip, cycles, attention_io_bytes(S, hq, hkv, backward), flops).time_us


def _statics(causal: bool) -> tuple:
    return STATIC_T if causal else STATIC_FULL


def _mask(row: dict) -> str:
    """A trial's mask (trials written before ``--mask`` existed are causal)."""
    return row.get("mask", "causal")


def sweep(chip: str, S: int, backward: bool, log, results: str, what: str = "both", causal: bool = True,
          fused: bool = False) -> None:
    """Estimate every config of the sweep spaces at 1/SWEEP_DIV of the heads (scaled back); one JSON line
    per trial is appended to ``results``."""
    mask = "causal" if causal else "full"
    hq, hkv = HQ // SWEEP_DIV, HKV // SWEEP_DIV
    pas = ("bwd_fused" if fused else "bwd") if backward else "fwd"
    trials = []
    if what in ("both", "ours"):
        fwd_space = OURS_FWD_SWEEP if causal else OURS_FWD_SWEEP_FULL
        bwd_space = OURS_BWD_FUSED_SWEEP if fused else OURS_BWD_SWEEP
        trials += [("tpukernels", cfg) for cfg in (bwd_space if backward else fwd_space)
                   if max(cfg["block_q"], cfg["block_kv"]) <= S]  # 4096-blocks: explicit configs beyond BLOCKS
    if what in ("both", "jax") and not fused:
        trials += [("jax-pallas", b) for b in (JAX_BWD_SWEEP if backward else JAX_FWD_SWEEP) if max(b) <= S]
    done = set()
    if os.path.exists(results):  # resume: skip trials already estimated (ours: for the current source)
        with open(results) as f:
            for line in f:
                r = json.loads(line)
                ours_stale = r.get("source") != _source(r["pass"] != "fwd", r["pass"] == "bwd_fused")
                if r["impl"] == "tpukernels" and ours_stale:
                    continue
                done.add((r["chip"], r["S"], r["pass"], _mask(r), r["impl"], json.dumps(r["config"], sort_keys=True)))
    for impl, cfg in trials:
        key = (chip, S, pas, mask, impl, json.dumps(list(cfg) if isinstance(cfg, tuple) else cfg, sort_keys=True))
        if key in done:
            continue
        t0 = time.time()
        row = {"chip": chip, "S": S, "pass": pas, "mask": mask, "impl": impl, "config": cfg, "heads_div": SWEEP_DIV}
        if impl == "tpukernels":
            row["source"] = _source(backward, fused)
        try:
            if impl == "tpukernels":
                cyc = ours(chip, S, cfg, hq=hq, hkv=hkv, backward=backward, causal=causal, fused=fused)["cycles"]
                cyc *= SWEEP_DIV
            else:
                cyc = jax_pallas(chip, S, cfg, hq=hq, backward=backward, causal=causal) * SWEEP_DIV
            row["time_us"] = round(us(chip, cyc, S, backward, causal=causal), 1)
        except Exception as e:  # VMEM / compile failure of a candidate: recorded, skipped
            row["error"] = str(e)[:200]
        row["seconds"] = round(time.time() - t0, 1)
        log(f"  {json.dumps(row)}")
        os.makedirs(os.path.dirname(results) or ".", exist_ok=True)
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")


def _source(backward: bool, fused: bool = False) -> str:
    """Source hash of the kernels a trial measured (trials of older kernel code are ignored)."""
    kernels = _kernels(backward, fused)
    return "+".join(db.source_hash(k) for k in kernels)


def best_from(results: str, chip: str, S: int, pas: str, impl: str, mask: str = "causal"):
    """(config, time_us) of the fastest trial in a results file (ours: of the current kernel source), or
    (None, inf)."""
    best = (None, float("inf"))
    if not os.path.exists(results):
        return best
    with open(results) as f:
        for line in f:
            r = json.loads(line)
            stale = impl == "tpukernels" and r.get("source") != _source(pas != "fwd", pas == "bwd_fused")
            if "time_us" not in r or stale:
                continue
            here = (r["chip"], r["S"], r["pass"], _mask(r), r["impl"]) == (chip, S, pas, mask, impl)
            if here and r["time_us"] < best[1]:
                cfg = r["config"]
                best = (tuple(cfg) if isinstance(cfg, list) else cfg, r["time_us"])
    return best


def write_default(chip: str, S: int, cfg: dict, time_us: float, backward: bool, causal: bool = True,
                  fused: bool = False) -> list[str]:
    paths = []
    kernels = _kernels(backward, fused)
    for kernel in kernels:
        specs = [s if s is None else TensorSpec(s.shape, s.dtype, p.name)
                 for s, p in zip(_specs(S, HQ, HKV, backward), kernel.tensor_params)]
        evidence = {"evaluator": "tpu-model", "time_us": round(time_us, 1),
                    "note": "libtpu static estimate (model), benchmarks/attention.py --sweep"}
        paths.append(db.record(kernel, chip, specs, _statics(causal), cfg, evidence,
                               path=db.shipped_db_path(kernel.qualname, chip)))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chips", default="v6e")
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--sweep", choices=["none", "both", "ours", "jax"], default="none",
                    help="estimate the sweep spaces (1/8 of the heads) and append trials to --results")
    ap.add_argument("--results", default=os.path.join(db.user_cache_dir(), "bench", "attention_sweep.jsonl"),
                    help="JSON lines of sweep trials (default: $TPUKERNELS_CACHE_DIR/bench/attention_sweep.jsonl)")
    ap.add_argument("--backward", action="store_true", help="also the backward pass")
    ap.add_argument("--fused-backward", action="store_true",
                    help="with --backward: sweep / record the fused backward kernel instead of dQ + dK/dV")
    ap.add_argument("--mask", choices=["causal", "full"], default="causal",
                    help="causal (top-left) or no mask (full): its own trials and shipped entries")
    ap.add_argument("--write-defaults", action="store_true",
                    help="record the best tpukernels config per (chip, S, pass) of --results in the shipped DB")
    ap.add_argument("--check-scaling", action="store_true", help="verify: estimate(32 heads) ~= 8 x estimate(4)")
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    for chip in (c for c in args.chips.split(",") if c):
        for S in (int(s) for s in args.seqs.split(",") if s):
            for backward in ((False, True) if args.backward else (False,)):
                fused = backward and args.fused_backward
                pas = ("bwd_fused" if fused else "bwd") if backward else "fwd"
                causal = args.mask == "causal"
                log(f"== {chip} S={S} {pas} {args.mask}")
                if args.check_scaling:
                    small = ours(chip, S, None, hq=HQ // SWEEP_DIV, hkv=HKV // SWEEP_DIV, backward=backward,
                                 causal=causal, fused=fused)["cycles"]
                    full = ours(chip, S, None, backward=backward, causal=causal, fused=fused)["cycles"]
                    log(f"  scaling: full / ({SWEEP_DIV} x reduced) = {full / (SWEEP_DIV * small):.4f}")
                if args.sweep != "none":
                    sweep(chip, S, backward, log, args.results, args.sweep, causal, fused)
                if args.write_defaults:
                    cfg, t = best_from(args.results, chip, S, pas, "tpukernels", args.mask)
                    if cfg is not None:
                        for path in write_default(chip, S, cfg, t, backward, causal, fused):
                            log(f"  wrote {cfg} ({t} us) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
