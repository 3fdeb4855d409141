"""``tpukernels demo``: the end-to-end tour (what ``make demo`` runs).

1. The authoring examples (``examples/*.py`` in a source checkout): each checks itself against torch on
   cpu in both interpret modes and compiles for v5e, v6e and tpu7x.
2. A compile-only table for the library kernels at their standard shapes on v5e / v6e / tpu7x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

EXAMPLES = ("vector_add.py", "softmax.py", "matmul.py", "helion_kernels.py")


def _examples_dir() -> str | None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = os.path.join(here, "examples")
    return d if os.path.isdir(d) else None


def run_examples(report: dict, say) -> bool:
    d = _examples_dir()
    if d is None:
        say("examples/: not in this installation (run the demo from a source checkout)")
        return True
    ok = True
    for name in EXAMPLES:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.join(d, name)], capture_output=True, text=True, cwd=d)
        secs = time.perf_counter() - t0
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        status = "PASS" if proc.returncode == 0 else "FAIL"
        say(f"  {name:14} {status}  ({len(lines) - 1} checks, {secs:.1f} s)")
        if proc.returncode != 0:
            say("\n".join("    " + ln for ln in (lines + proc.stderr.splitlines())[-15:]))
        report.setdefault("examples", {})[name] = {"ok": proc.returncode == 0, "seconds": round(secs, 2), "output": lines}
        ok &= proc.returncode == 0
    return ok


def run_demo(as_json: bool = False) -> int:
    """Run every demo part; returns the process exit code (0 when everything passed)."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    report: dict = {}

    def say(msg: str) -> None:
        if not as_json:
            print(msg, flush=True)

    say("[1/2] authoring examples: cpu (both interpret modes) vs torch, compile-only for v5e/v6e/tpu7x")
    ok = run_examples(report, say)
    say("[2/2] library kernels: compile-only table")
    from .library import standard_cases
    from .targets.compile_only import compile_for

    rows = []
    for kernel, args, kwargs in standard_cases():
        for chip in ("v5e", "v6e", "tpu7x"):
            r = compile_for(kernel, chip, *args, with_mlir=False, **kwargs)
            rows.append(r.to_dict())
            say(f"  {r.summary()}  config={r.config} ({r.config_source})")
            ok &= r.ok
    report["compile"] = rows
    if as_json:
        print(json.dumps(report, indent=1, default=str))
    say("demo: " + ("all checks passed" if ok else "SOME CHECKS FAILED"))
    return 0 if ok else 1
