"""Normalization kernels vs XLA: model time per chip (libtpu static estimate + HBM roofline; a model, not a
measurement), % of the HBM roofline, and the per-chip default ``block_rows``.

For each kernel of :mod:`tpukernels.library.norms` (forward and backward), each chip and each shape:

* ours: ``compile_for(kernel, chip, ..., estimate_cycles=True)`` -> libtpu's static ``estimated_cycles``,
  combined by :func:`tpukernels.perf.model_time` with the HBM roofline of the chip's bandwidth and the
  minimum bytes the op must move (inputs read once, outputs written once);
* XLA: the same formula as a jitted ``jnp`` function (XLA fuses it itself), estimated with
  :func:`tpukernels.targets.compile_only.estimate_cycles_of`, same bytes, same model.

Every figure printed is a **model estimate** (libtpu 0.0.52 static cost model + roofline), not a TPU
measurement.

Usage::

    .venv/bin/python benchmarks/norms.py                       # table at the shipped/heuristic configs
    .venv/bin/python benchmarks/norms.py --sweep               # every distinct block_rows, best marked
    .venv/bin/python benchmarks/norms.py --write-defaults      # sweep + write tpukernels/data/autotuning/...
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

import jax  # noqa: E402

from tpukernels.autotune import db  # noqa: E402
from tpukernels.bench.norms import norm_cases, xla_fns  # noqa: E402
from tpukernels.library import norms as N  # noqa: E402
from tpukernels.lowering import specs_from_values  # noqa: E402
from tpukernels.perf import model_time  # noqa: E402
from tpukernels.targets import bucket_specs  # noqa: E402
from tpukernels.targets.compile_only import _as_spec, compile_for, estimate_cycles_of  # noqa: E402

# the tuning DB keys entries by a hash of the kernel source, read lazily with inspect.getsource: hash now,
# while the file on disk is the one imported (an edit during a long sweep would otherwise be hashed)
for _k in (N.rms_norm_fwd, N.rms_norm_bwd, N.fused_add_rms_norm_fwd, N.layer_norm_fwd, N.layer_norm_bwd):
    db.source_hash(_k)

SWEEP = (32, 64, 128, 256, 512, 1024)
EPS_RMS, EPS_LN = N.DEFAULT_RMS_EPS, N.DEFAULT_LAYER_NORM_EPS


# XLA's version of each kernel (same outputs) and the cases: shared with `tpukernels bench`
_XLA = xla_fns(EPS_RMS, EPS_LN)


def cases(n: int, h: int, dt: str):
    """(label, kernel, tensor args, statics, xla fn, outputs) at one shape; args as compile_for strings."""
    return [(op, kernel, args, statics, _XLA[op], outs) for op, kernel, args, statics, outs in norm_cases(n, h, dt)]


def _bytes(specs) -> int:
    return int(sum(s.size * s.itemsize for s in specs if s is not None))


def _struct(s):
    return jax.ShapeDtypeStruct(tuple(s.shape), s.dtype)


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


def run(chips, shapes, dtype, sweep: bool, write: bool, out_json: str | None, ops=None):
    rows, records = [], []
    for n, h in shapes:
        for label, kernel, args, statics, xla_fn, outs in cases(n, h, dtype):
            if ops and not any(o in label for o in ops):
                continue
            in_specs = [_as_spec(a) for a in args if a is not None]
            hbm = _bytes(in_specs) + _bytes([_as_spec(o) for o in outs])
            for chip in chips:
                t0 = time.perf_counter()
                xla_cycles = estimate_cycles_of(jax.jit(xla_fn), chip, [_struct(s) for s in in_specs])
                xla = model_time(chip, xla_cycles, hbm)
                if sweep or write:
                    seen, cands = set(), []
                    for b in SWEEP:
                        e = effective_rows(kernel, args, statics, b)
                        if e not in seen:
                            seen.add(e)
                            cands.append(b)
                else:
                    cands = [None]
                results = []
                for b in cands:
                    r, mt = measure(kernel, chip, args, statics, hbm, b)
                    if mt is None:
                        print(f"  {label} {chip} block_rows={b}: {r.error_kind}: {r.error}", file=sys.stderr)
                        continue
                    results.append((b if b is not None else r.config["block_rows"], r, mt))
                # best: lowest model time; ties (both at the roofline) -> lowest libtpu cycles (more headroom)
                best = min(results, key=lambda t: (round(t[2].time_us, 2), t[2].cycles_us or 0))
                for b, r, mt in results:
                    rows.append({
                        "op": label, "chip": chip, "shape": f"{n}x{h}:{dtype}", "block_rows": b,
                        "config_source": "sweep" if (sweep or write) else r.config_source,
                        "best": b == best[0] and (sweep or write),
                        "model_us": mt.time_us, "cycles_us": mt.cycles_us, "roofline_us": mt.roofline_us,
                        "pct_roofline": mt.pct_of_roofline, "xla_model_us": xla.time_us, "xla_cycles_us": xla.cycles_us,
                        "xla_pct_roofline": xla.pct_of_roofline, "speedup_vs_xla": xla.time_us / mt.time_us,
                        "hbm_bytes": hbm, "vmem_mib": r.vmem_estimate_bytes / 2**20,
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
                            "roofline_us": round(mt.roofline_us, 3), "xla_model_us": round(xla.time_us, 3),
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
    hdr = (f"{'op':24} {'chip':6} {'shape':16} {'rows':>5} {'ours*':>9} {'XLA*':>9} {'roofline':>9} "
           f"{'ours %roof':>10} {'XLA %roof':>9} {'vs XLA':>7} {'cycles*':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        mark = "+" if r["best"] else " "
        print(f"{r['op']:24} {r['chip']:6} {r['shape']:16} {r['block_rows']:>4}{mark} {r['model_us']:9.1f} "
              f"{r['xla_model_us']:9.1f} {r['roofline_us']:9.1f} {r['pct_roofline']:9.1f}% {r['xla_pct_roofline']:8.1f}% "
              f"{r['speedup_vs_xla']:6.2f}x {r['cycles_us']:8.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chips", default="v5e,v6e,tpu7x")
    p.add_argument("--shapes", default="8192x4096,8192x8192", help="rows x H, comma separated")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--sweep", action="store_true", help="estimate every distinct block_rows")
    p.add_argument("--write-defaults", action="store_true",
                   help="sweep and record the best block_rows in tpukernels/data/autotuning/<chip>/ (shipped DB)")
    p.add_argument("--json", help="also write the rows as JSON")
    p.add_argument("--ops", help="only ops whose label contains one of these (comma separated), e.g. 'rms_norm bwd'")
    a = p.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    run(a.chips.split(","), shapes, a.dtype, a.sweep, a.write_defaults, a.json, a.ops.split(",") if a.ops else None)


if __name__ == "__main__":
    main()
