"""Fused vs split flash attention backward (a study): libtpu static estimates (a model, not a measurement).

For each chip and case (B, S, H, causal; D=128, bf16, no GQA: tokamax's measured VJP shapes), compiles
without a TPU and asks libtpu for its static ``estimated_cycles`` of

* ``split``: :data:`~tpukernels.library.attention.fa_backward_dq` + :data:`~.fa_backward_dkv` + the
  ``rowsum(dO * O)`` XLA op;
* ``fused``: :data:`~tpukernels.library.attention.fa_backward_fused` + the rowsum + the slice / cast of its f32 dQ
  (XLA ops), what ``flash_attention``'s backward runs in each mode,

at the config a call gets (``--config`` overrides the fused kernel's), turned into a model time with
:func:`tpukernels.perf.model_time`. Estimates run at ``B=1``, 2 heads and are scaled to the case (linear in
the parallel grid axes, as ``benchmarks/attention.py --check-scaling`` shows for these kernels); with
``--est-seq N`` at ``S = N`` and scaled by ``(S / N)^2`` (the work per score is the same; used for S = 16k on
tpu7x, where libtpu 0.0.52's *profiling* compile of the fused kernel runs out of VMEM although the ordinary
compile fits). Printed next to tokamax's measured VJP time on tpu7x (its wheel's
``data/autotuning/tpu7x/pallas_mosaic_tpu_flash_attention_vjp.json``).

Run (minutes per estimate; one at a time)::

    .venv/bin/python benchmarks/attention_fused_bwd.py --chips v6e,tpu7x --cases 1x16384x16:0,1x16384x16:1,2x8192x16:0
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

from tpukernels.bench.core import Estimator, default_cache_path  # noqa: E402
from tpukernels.chips import get_chip  # noqa: E402
from tpukernels.dsl.spec import TensorSpec  # noqa: E402
from tpukernels.library.attention import fa_backward_dkv, fa_backward_dq, fa_backward_fused  # noqa: E402
from tpukernels.lowering import lower  # noqa: E402
from tpukernels.perf import model_time  # noqa: E402

D = 128
H_EST = 2  # heads per estimate (scaled to the case)


_EST = None


def _estimate(fn, structs, chip: str) -> int:
    """libtpu's static estimate (cycles) through ``tpukernels bench``'s cached estimator."""
    global _EST
    if _EST is None:
        _EST = Estimator(default_cache_path(), timeout_s=3600)
    return _EST.cycles(fn, structs, chip)


def _kernel_cycles(kernel, chip, S, causal, config):
    q = TensorSpec((1, H_EST, S, D), np.dtype(jnp.bfloat16))
    rows = TensorSpec((1, H_EST, 1, S), np.dtype("float32"))
    specs = (q, q, q, q, rows, rows, None, None)
    statics = (("causal", causal), ("causal_alignment", "top_left"), ("sm_scale", None), ("window_left", None),
               ("window_right", None), ("softcap", None))
    low = lower(kernel, [s if s is None else TensorSpec(s.shape, s.dtype, p.name)
                         for s, p in zip(specs, kernel.tensor_params)], statics, config, mode="mosaic",
                chip=get_chip(chip))
    return _estimate(low.fn, low.arg_structs, chip), dict(low.config)


def _xla_cycles(chip, S):
    o = jax.ShapeDtypeStruct((1, H_EST, S, D), jnp.bfloat16)
    rowsum = _estimate(jax.jit(lambda a, b: jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32), -1)), [o, o], chip)
    dq = jax.ShapeDtypeStruct((1, H_EST, S, D), jnp.float32)  # S % 8 == 0 here: the slice is the whole array
    cast = _estimate(jax.jit(lambda a: a[:, :, :S].astype(jnp.bfloat16)), [dq], chip)
    return rowsum, cast


def _bytes_flops(B, S, H, causal):
    it = 2
    byts = B * ((3 * H * S * D + 4 * H * S * D) * it + 2 * H * S * 4 + 2 * H * S * D * it)
    flops = int(4 * B * H * S * S * D / (2 if causal else 1) * 2.5)
    return byts, flops


def tokamax_ms(B, S, H, causal):
    from tpukernels.bench.calibration import autotuning_dir, load_rows

    best = None
    for r in load_rows(autotuning_dir(), chips=["tpu7x"], ops=["pallas_mosaic_tpu_flash_attention_vjp"]):
        if r.args.get("q") == f"bf16[{B},{S},{H},{D}]" and r.args.get("k") == f"bf16[{B},{S},{H},{D}]" \
                and bool(r.args.get("mask", {}).get("is_causal")) == causal:
            best = r.median_ms if best is None else min(best, r.median_ms)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", default="v6e,tpu7x")
    ap.add_argument("--cases", default="1x16384x16:0,1x16384x16:1,2x8192x16:0", help="BxSxH:causal, comma-separated")
    ap.add_argument("--only", choices=("both", "split", "fused"), default="both")
    ap.add_argument("--config", default=None, help="fused kernel config as JSON")
    ap.add_argument("--est-seq", type=int, default=None, help="estimate at this S and scale by (S / est_seq)^2")
    ap.add_argument("--results", default=os.path.expanduser("~/.cache/tpukernels/bench/attention_fused_bwd.jsonl"))
    args = ap.parse_args(argv)
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    cfg = json.loads(args.config) if args.config else None
    for chip in args.chips.split(","):
        for case in args.cases.split(","):
            shape, causal = case.split(":")
            B, S, H = (int(x) for x in shape.split("x"))
            causal = causal == "1"
            byts, flops = _bytes_flops(B, S, H, causal)
            Se = args.est_seq or S
            scale = B * H // H_EST * (S // Se) ** 2
            rowsum, cast = _xla_cycles(chip, Se)
            row = dict(chip=chip, B=B, S=S, H=H, causal=causal, est_seq=Se, tokamax_measured_ms=tokamax_ms(B, S, H, causal),
                       rowsum_cycles=rowsum * scale, date=time.strftime("%Y-%m-%dT%H:%M:%S"))
            if args.only in ("both", "split"):
                t0 = time.time()
                cq, cfq = _kernel_cycles(fa_backward_dq, chip, Se, causal, None)
                ckv, _ = _kernel_cycles(fa_backward_dkv, chip, Se, causal, None)
                tot = (cq + ckv + rowsum) * scale
                row.update(split_config=cfq, split_dq_cycles=cq * scale, split_dkv_cycles=ckv * scale,
                           split_ms=round(model_time(chip, tot, byts, flops).time_us / 1e3, 3),
                           split_dq_ms=round(model_time(chip, cq * scale, 0).time_us / 1e3, 3),
                           split_dkv_ms=round(model_time(chip, ckv * scale, 0).time_us / 1e3, 3),
                           split_wall_s=round(time.time() - t0))
            if args.only in ("both", "fused"):
                t0 = time.time()
                cf, cff = _kernel_cycles(fa_backward_fused, chip, Se, causal, cfg)
                tot = (cf + rowsum + cast) * scale
                row.update(fused_config=cff, fused_cycles=cf * scale,
                           fused_kernel_ms=round(model_time(chip, cf * scale, 0).time_us / 1e3, 3),
                           fused_cast_ms=round(model_time(chip, cast * scale, 0).time_us / 1e3, 3),
                           fused_ms=round(model_time(chip, tot, byts, flops).time_us / 1e3, 3),
                           fused_wall_s=round(time.time() - t0))
            print(json.dumps(row), flush=True)
            with open(args.results, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
