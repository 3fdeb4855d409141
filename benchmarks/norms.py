"""Normalization kernels' ``block_rows`` sweep (a study): the model time of every distinct ``block_rows`` per
chip and shape (libtpu static estimate + HBM roofline: a model, not a measurement), and the shipped default.

For each kernel of :mod:`tpukernels.library.norms` (forward and backward), each chip and each shape of the
bench family's cases (:func:`tpukernels.bench.norms.norm_cases`): ``compile_for(kernel, chip, ...,
estimate_cycles=True)`` -> libtpu's static ``estimated_cycles``, combined by :func:`tpukernels.perf.model_time`
with the HBM roofline of the chip's bandwidth and the minimum bytes the op must move (inputs read once, outputs
written once). The comparison with XLA (published in BENCHMARKS.md) is ``tpukernels bench --family norms``.

Usage::

    .venv/bin/python benchmarks/norms.py                       # every distinct block_rows, best marked
    .venv/bin/python benchmarks/norms.py --write-defaults      # + write tpukernels/data/autotuning/...
    .venv/bin/python benchmarks/norms.py --chips v6e --shapes 8192x4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from tpukernels.autotune import db  # noqa: E402
from tpukernels.bench.norms import norm_cases  # noqa: E402
from tpukernels.library import norms as N  # noqa: E402
from tpukernels.lowering import specs_from_values  # noqa: E402
from tpukernels.perf import model_time  # noqa: E402
from tpukernels.targets import bucket_specs  # noqa: E402
from tpukernels.targets.compile_only import _as_spec, compile_for  # noqa: E402

# the tuning DB keys entries by a hash of the kernel source, read lazily with inspect.getsource: hash now,
# while the file on disk is the one imported (an edit during a long sweep would otherwise be hashed)
for _k in (N.rms_norm_fwd, N.rms_norm_bwd, N.fused_add_rms_norm_fwd, N.layer_norm_fwd, N.layer_norm_bwd):
    db.source_hash(_k)

SWEEP = (32, 64, 128, 256, 512, 1024)


def cases(n: int, h: int, dt: str):
    """(label, kernel, tensor args, statics, outputs) at one shape (the bench family's); args as compile_for strings."""
    return norm_cases(n, h, dt)


def _bytes(specs) -> int:
    return int(sum(s.size * s.itemsize for s in specs if s is not None))


def effective_rows(kernel, args, statics, block_rows) -> int:
    """The block rows the launch actually uses for ``block_rows`` (after the VMEM / row-count clamp)."""
    values = kernel.bind([_as_spec(a) for a in args], statics)
    specs, st = specs_from_values(kernel, values)
    launch = kernel.make_launch(bucket_specs(kernel, specs), st, kernel.space.complete({"block_rows": block_rows}))
    return int(launch.in_specs[0].block_shape[0])


def measure(kernel, chip, args, statics, hbm_bytes, block_rows=None):
    cfg = None if block_rows is None else {"block_rows": block_rows}
    r = compile_for(kernel, chip, *args, config=cfg, estimate_cycles=True, with_mlir=False, **statics)
    if not r.ok:
        return r, None
    return r, model_time(chip, r.estimated_cycles, hbm_bytes)


def run(chips, shapes, dtype, write: bool, out_json: str | None, ops=None):
    rows, records = [], []
    for n, h in shapes:
        for label, kernel, args, statics, outs in cases(n, h, dtype):
            if ops and not any(o in label for o in ops):
                continue
            in_specs = [_as_spec(a) for a in args if a is not None]
            hbm = _bytes(in_specs) + _bytes([_as_spec(o) for o in outs])
            for chip in chips:
                t0 = time.perf_counter()
                seen, cands = set(), []
                for b in SWEEP:
                    e = effective_rows(kernel, args, statics, b)
                    if e not in seen:
                        seen.add(e)
                        cands.append(b)
                results = []
                for b in cands:
                    r, mt = measure(kernel, chip, args, statics, hbm, b)
                    if mt is None:
                        print(f"  {label} {chip} block_rows={b}: {r.error_kind}: {r.error}", file=sys.stderr)
                        continue
                    results.append((b, r, mt))
                # best: lowest model time; ties (both at the roofline) -> lowest libtpu cycles (more headroom)
                best = min(results, key=lambda t: (round(t[2].time_us, 2), t[2].cycles_us or 0))
                for b, r, mt in results:
                    rows.append({
                        "op": label, "chip": chip, "shape": f"{n}x{h}:{dtype}", "block_rows": b,
                        "best": b == best[0],
                        "model_us": mt.time_us, "cycles_us": mt.cycles_us, "roofline_us": mt.roofline_us,
                        "pct_roofline": mt.pct_of_roofline, "hbm_bytes": hbm, "vmem_mib": r.vmem_estimate_bytes / 2**20,
                    })
                if write:
                    b, r, mt = best
                    values = kernel.bind([_as_spec(a) for a in args], statics)
                    specs, st = specs_from_values(kernel, values)
                    path = db.record(
                        kernel, chip, bucket_specs(kernel, specs), st, {"block_rows": b},
                        {
                            "evaluator": "model: libtpu static estimate (compile-only) + HBM roofline, tpukernels.perf.model_time",
                            "time_us": round(mt.time_us, 3), "cycles_us": round(mt.cycles_us, 3),
                            "roofline_us": round(mt.roofline_us, 3),
                            "candidates_us": {str(c): round(m.time_us, 3) for c, _, m in results},
                            "candidates_cycles_us": {str(c): round(m.cycles_us, 3) for c, _, m in results},
                            "hbm_bytes": hbm,
                        },
                        path=db.shipped_db_path(kernel.qualname, chip),
                    )
                    records.append(path)
                print(f"  [{time.perf_counter() - t0:5.1f}s] {label} {chip} {n}x{h}", file=sys.stderr, flush=True)
    print_table(rows)
    if write:
        print("\nwrote:\n  " + "\n  ".join(sorted(set(records))))
    if out_json:
        with open(out_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def print_table(rows):
    print("\nAll times are MODEL ESTIMATES in us (libtpu 0.0.52 static cost model combined with the HBM roofline, "
          "tpukernels.perf.model_time), not measurements.\n* = model time max(libtpu cycles / clock, HBM bytes / "
          "bandwidth); cycles* = the libtpu term alone; a + after block_rows marks the best of the sweep (the shipped default).")
    hdr = f"{'op':24} {'chip':6} {'shape':16} {'rows':>5} {'model*':>9} {'roofline':>9} {'%roof':>6} {'cycles*':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        mark = "+" if r["best"] else " "
        print(f"{r['op']:24} {r['chip']:6} {r['shape']:16} {r['block_rows']:>4}{mark} {r['model_us']:9.1f} "
              f"{r['roofline_us']:9.1f} {r['pct_roofline']:5.1f}% {r['cycles_us']:8.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chips", default="v5e,v6e,tpu7x")
    p.add_argument("--shapes", default="8192x4096,8192x8192", help="rows x H, comma separated")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--sweep", action="store_true", help="(the study always sweeps; kept for older command lines)")
    p.add_argument("--write-defaults", action="store_true",
                   help="record the best block_rows in tpukernels/data/autotuning/<chip>/ (shipped DB)")
    p.add_argument("--json", help="also write the rows as JSON")
    p.add_argument("--ops", help="only ops whose label contains one of these (comma separated), e.g. 'rms_norm bwd'")
    a = p.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    run(a.chips.split(","), shapes, a.dtype, a.write_defaults, a.json, a.ops.split(",") if a.ops else None)


if __name__ == "__main__":
    main()
