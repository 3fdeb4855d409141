"""Running cases on a jax CPU mesh of N host devices from a test: jax needs
``--xla_force_host_platform_device_count`` before it starts, so each case list runs in a subprocess worker.

Test side: ``run_cases("some_worker.py", cases)`` -> one result dict per case (asserts the worker exited 0 and
answered every case). Worker side: ``serve(run)`` reads the cases from argv, sets the device count to the
largest ``"n"`` (or ``"devices"``, a case's request for more host devices than its mesh uses), runs ``run(case)`` for each (under the case's ``"mode"``, the interpret mode, default
``"tpu"``) and prints one JSON line per case (``{"case": ..., "error": "<type>: <message>"}`` when it raised).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cases(worker: str, cases: list, timeout: float = 900) -> list:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", worker), json.dumps(cases)],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0 and len(lines) == len(cases), (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    return lines


def serve(run) -> None:
    cases = json.loads(sys.argv[1])
    n = max(max(c["n"], c.get("devices", 0)) for c in cases)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    import tpukernels as tk

    for c in cases:
        try:
            with tk.interpret_mode(c.get("mode", "tpu")):
                res = run(c)
        except Exception as e:  # noqa: BLE001 - reported to the test process, which asserts on it
            res = {"case": c, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res), flush=True)
