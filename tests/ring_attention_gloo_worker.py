"""One process of a 2-process jax CPU group (gloo collectives) running ring attention over both processes'
devices; used by tests/test_ring_attention.py::test_two_process_gloo_group.

Usage: python tests/ring_attention_gloo_worker.py PROCESS_ID NUM_PROCESSES PORT
Prints one JSON line: ``{"process": i, "err": {"out": e, "dq": e, "dk": e, "dv": e}}`` (max abs error of this
process's shards over the max abs float64 reference), or ``{"process": i, "error": "..."}``.
"""

from __future__ import annotations

import json
import os
import sys

pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=120)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tpukernels as tk  # noqa: E402
from tpukernels.distributed import ring_attention as R  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ring_attention_worker import reference  # noqa: E402  (float64 numpy reference; no jax work at import)

try:
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("cp",))
    sh = NamedSharding(mesh, P(None, None, "cp", None))
    B, Hq, Hkv, S, D = 1, 2, 1, 32 * n, 32
    rng = np.random.default_rng(0)  # every process draws the same global arrays
    host = [rng.standard_normal(s).astype(np.float32) for s in ((B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, D),
                                                               (B, Hq, S, D))]
    zz = [np.asarray(R.zigzag_permute(x, n)) for x in host]  # the load-balanced order, as a data loader would
    glob = [jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx]) for x in zz]
    with tk.interpret_mode("fast"):
        out, vjp = jax.vjp(lambda q, k, v: R.ring_attention(q, k, v, mesh, "cp", causal=True), *glob[:3])
        grads = vjp(glob[3])
    ref = [np.asarray(R.zigzag_permute(r, n)) for r in reference(*host, causal=True)]
    err = {}
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
        e = 0.0
        for shard in a.addressable_shards:
            e = max(e, float(np.max(np.abs(np.asarray(shard.data, np.float64) - r[shard.index]))))
        err[name] = e / float(np.max(np.abs(r)))
    print(json.dumps({"process": pid, "err": err, "devices": n}), flush=True)
except Exception as e:  # noqa: BLE001  (reported to the test)
    print(json.dumps({"process": pid, "error": f"{type(e).__name__}: {e}"}), flush=True)
finally:
    jax.distributed.shutdown()
