"""Matmul block sweep (a study): libtpu static estimates (a MODEL, not measurements) of tpukernels' matmul
at the configs of a small sweep per chip and bf16 problem; ``--write-defaults`` ships the best.

For each candidate: ``tk.compile_for(kernel, chip, ..., config=cfg, estimate_cycles=True)`` -> libtpu's static
``estimated_cycles``, made a model time with ``tpukernels.perf.model_time``: ``max(cycles / clock, bytes / HBM
bandwidth, flops / peak)``, with the kernel's block traffic as bytes (``a`` re-read ``N / bn`` times and ``b``
``M / bm`` times when K takes more than one block; see :func:`kernel_hbm_bytes`). "% of peak" = flops / (model
time x bf16 peak FLOP/s). The comparison with XLA and JAX's Pallas matmul (published in BENCHMARKS.md) is
``tpukernels bench --family matmul``.

Usage::

    .venv/bin/python benchmarks/matmul.py --write-defaults      # the small sweep, ship the best
    .venv/bin/python benchmarks/matmul.py --chips v5e --shapes 8192

Estimates are cached (``--cache``, keyed by chip, shape, config, kernel source hash and libtpu version),
so an interrupted sweep resumes. 8192^3 estimates take one to several minutes each on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


import tpukernels as tk  # noqa: E402
from tpukernels import perf  # noqa: E402
from tpukernels.autotune import db  # noqa: E402
import tpukernels.library  # noqa: E402,F401  (registers the ops)

mm = sys.modules["tpukernels.library.matmul_ops"]

#: name -> (layout, M, K, N); "linear" is x[8192, 4096] @ W[14336, 4096].T (an MLP up-projection)
SHAPES = {
    "1024": ("nn", 1024, 1024, 1024),
    "4096": ("nn", 4096, 4096, 4096),
    "8192": ("nn", 8192, 8192, 8192),
    "linear": ("nt", 8192, 4096, 14336),
}
CHIPS = ("v5e", "v6e", "tpu7x")


def cfg(bm, bk, bn, **kw):
    return dict(bm=bm, bk=bk, bn=bn, **kw)


#: the small sweep (bf16): per shape, a handful of block configs chosen from the VMEM / intensity
#: reasoning in the module docstring of tpukernels.library.matmul (large bk: fewer accumulator round
#: trips; large bm, bn: fewer HBM re-reads). v6e's ridge point is ~560 FLOP/byte (920 TFLOP/s over
#: 1.64 TB/s), so its large shapes get larger output blocks (2048 x 2048: ~48 MiB of VMEM, fine on its
#: 128 MiB); tpu7x (64 MiB VMEM, ridge ~310 FLOP/byte) uses the v5e list. The transposed-RHS variants
#: ("mxu" vs "xlu") compile to the same code on libtpu 0.0.52 (equal estimates at 1024^3), so the
#: large Linear shape is only estimated with "mxu".
SWEEP = {
    "1024": [cfg(512, 512, 512), cfg(512, 1024, 1024), cfg(256, 1024, 1024), cfg(128, 1024, 1024),
             cfg(1024, 512, 1024)],
    "4096": [cfg(512, 1024, 1024), cfg(1024, 2048, 1024), cfg(1024, 1024, 2048), cfg(2048, 1024, 2048)],
    # 8192^3-sized estimates take ~7 min and ~14 GB of host memory each (libtpu 0.0.52): one config per chip,
    # the 4096^3 winner's shape class.
    "8192": [cfg(1024, 2048, 1024)],
    "linear": [cfg(1024, 2048, 1024, rhs="mxu")],
}
SWEEP_CHIP = {
    "v6e": {
        "1024": [cfg(512, 1024, 1024), cfg(1024, 256, 1024), cfg(1024, 512, 1024), cfg(256, 1024, 1024)],
        "4096": [cfg(1024, 2048, 1024), cfg(2048, 1024, 2048), cfg(2048, 2048, 1024), cfg(1024, 1024, 4096),
                 cfg(1024, 1024, 2048), cfg(2048, 512, 2048), cfg(1024, 2048, 2048), cfg(2048, 1024, 1024)],
        "8192": [cfg(2048, 1024, 2048)],
        "linear": [cfg(2048, 1024, 2048, rhs="mxu")],
    },
}


def sweep_configs(chip: str, shape: str) -> list:
    return SWEEP_CHIP.get(chip, {}).get(shape, SWEEP[shape])


def specs_for(shape: str):
    layout, M, K, N = SHAPES[shape]
    a = f"1x{M}x{K}:bf16"
    b = f"1x{N}x{K}:bf16" if layout == "nt" else f"1x{K}x{N}:bf16"
    return layout, a, b


def kernel_hbm_bytes(layout, M, K, N, config, itemsize=2, out_itemsize=2) -> int:
    """HBM bytes the kernel moves with ``config`` (``tpukernels.library.matmul_ops.hbm_bytes``, batch 1).

    K innermost: with more than one K block both operand blocks change every step, so ``a`` is read once
    per column block (``N / bn`` times) and ``b`` once per row block (``M / bm``); Pallas skips a fetch
    when a block index repeats, so with one K block ``a`` is read once. Output: once.
    """
    clamp = lambda d, blk: d if d <= blk else blk  # noqa: E731  (as the launch does)
    return mm.hbm_bytes(1, 1, M, N, K, clamp(M, config["bm"]), clamp(K, config["bk"]), clamp(N, config["bn"]),
                        itemsize, out_itemsize)


_CACHE_LOCK = threading.Lock()


def load_cache(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save_cache(path, cache):
    with _CACHE_LOCK:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def kernel_estimate(chip, shape, config, cache, cache_path):
    layout, a, b = specs_for(shape)
    kernel = mm.KERNELS[layout]
    key = "|".join([kernel.qualname, db.source_hash(kernel), chip, shape, json.dumps(config, sort_keys=True),
                    str(db.versions().get("libtpu"))])
    if key not in cache:
        try:
            res = tk.compile_for(kernel, chip, a, b, config=config, estimate_cycles=True, with_mlir=False)
        except tk.LoweringError as e:  # the estimate subprocess failed (killed, out of memory): not cached
            return {"ok": False, "error": str(e), "cycles": None}
        cache[key] = {"ok": res.ok, "error": res.error, "cycles": res.estimated_cycles,
                      "vmem_estimate_bytes": res.vmem_estimate_bytes, "vmem_limit_bytes": res.vmem_limit_bytes,
                      "config": res.config, "seconds": round(res.compile_seconds, 1)}
        save_cache(cache_path, cache)
    return cache[key]


def model(chip, shape, cycles, hbm_bytes):
    layout, M, K, N = SHAPES[shape]
    return perf.model_time(chip, cycles, hbm_bytes, 2 * M * N * K)


def pct_peak(chip, shape, mt) -> float:
    layout, M, K, N = SHAPES[shape]
    return 100.0 * 2 * M * N * K / (mt.time_us * 1e-6) / perf.peak_flops(chip)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chips", default=",".join(CHIPS))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--sweep", action="store_true", help="(the study always sweeps; kept for older command lines)")
    p.add_argument("--write-defaults", action="store_true", help="record the best swept config as shipped default")
    p.add_argument("--jobs", type=int, default=1, help="estimates run in parallel (each is a subprocess)")
    p.add_argument("--cache", default=os.path.join(db.user_cache_dir(), "bench", "matmul_estimates.json"))
    p.add_argument("--csv", default=None, help="also write the table as CSV here")
    args = p.parse_args(argv)
    chips, shapes = args.chips.split(","), args.shapes.split(",")
    cache = load_cache(args.cache)

    jobs = []  # (chip, shape, config, source)
    for chip in chips:
        for shape in shapes:
            layout = SHAPES[shape][0]
            for c in sweep_configs(chip, shape):
                c = dict(c)
                if layout != "nt":
                    c.pop("rhs", None)
                jobs.append((chip, shape, c, "sweep"))

    def run(job):
        chip, shape, c, source = job
        t0 = time.perf_counter()
        est = kernel_estimate(chip, shape, c, cache, args.cache)
        what = est["cycles"] if est["ok"] else est["error"]
        print(f"  [{time.perf_counter() - t0:6.1f}s] {chip} {shape} {c}: {what}", file=sys.stderr, flush=True)
        return job, est

    with cf.ThreadPoolExecutor(max(1, args.jobs)) as ex:
        results = list(ex.map(run, jobs))

    best = {}
    for (chip, shape, c, source), est in results:
        if not est["ok"] or est["cycles"] is None:
            continue
        layout, M, K, N = SHAPES[shape]
        mt = model(chip, shape, est["cycles"], kernel_hbm_bytes(layout, M, K, N, c))
        cur = best.get((chip, shape))
        if cur is None or mt.time_us < cur[2].time_us:
            best[chip, shape] = (c, source, mt, est)

    rows = []
    head = (f"{'chip':6} {'shape':>7} {'best of sweep (bm,bk,bn)':>24} {'cycles':>10} {'model us':>9} {'% peak':>7} "
            f"{'candidates':>10}")
    print("All figures are MODEL ESTIMATES (libtpu static estimated_cycles + rooflines), not measurements.")
    print(head)
    order = sorted(best.items(), key=lambda kv: (kv[0][0], list(SHAPES).index(kv[0][1])))
    for (chip, shape), (c, source, mt, est) in order:
        layout, M, K, N = SHAPES[shape]
        row = dict(chip=chip, shape=shape, layout=layout, M=M, K=K, N=N, config=c, source=source,
                   cycles=est["cycles"], model_us=round(mt.time_us, 2), bound=mt.bound,
                   pct_peak=round(pct_peak(chip, shape, mt), 1), vmem_bytes=est["vmem_estimate_bytes"],
                   candidates=sum(1 for (ch, sh, _, _), e in results if (ch, sh) == (chip, shape) and e["ok"]))
        rows.append(row)
        blk = f"{c['bm']},{c['bk']},{c['bn']}" + (f",{c['rhs']}" if "rhs" in c else "")
        print(f"{chip:6} {shape:>7} {blk:>24} {est['cycles']:10d} {mt.time_us:9.1f} {row['pct_peak']:7.1f} "
              f"{row['candidates']:10d}")
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            for r in rows:
                w.writerow({**r, "config": json.dumps(r["config"], sort_keys=True)})

    if args.write_defaults:
        from tpukernels.targets.compile_only import parse_shape

        for r in rows:
            layout, a, b = specs_for(r["shape"])
            kernel = mm.KERNELS[layout]
            sa, sb = parse_shape(a), parse_shape(b)
            specs = (tk.TensorSpec(sa.shape, sa.dtype, "a"), tk.TensorSpec(sb.shape, sb.dtype, "b"), None)
            statics = (("activation", None), ("out_dtype", None), ("reduce_batch", False))
            evidence = {"evaluator": "libtpu-static-estimate", "estimated_cycles": r["cycles"],
                        "model_time_us": r["model_us"], "pct_of_peak": r["pct_peak"],
                        "candidates": r["candidates"],
                        "note": "model estimate (libtpu static cost model + rooflines), not a measurement"}
            path = db.record(kernel, r["chip"], specs, statics, r["config"], evidence,
                             path=db.shipped_db_path(kernel.qualname, r["chip"]))
            print(f"wrote {r['chip']} {r['shape']} {r['config']} -> {os.path.relpath(path)}")
    return rows


if __name__ == "__main__":
    main()
