"""Subprocess worker for tests/test_ring_attention.py: ring attention on a jax CPU mesh of N host devices
(``--xla_force_host_platform_device_count`` must be set before jax starts, hence a subprocess).

Usage: python tests/ring_attention_worker.py CASES_JSON  -> prints one JSON line per case:
``{"case": ..., "err": {"out": e, "dq": e, "dk": e, "dv": e}, "flash_err": e}`` where ``e`` is the max abs
error divided by the max abs reference, against a float64 numpy reference of the global attention (and
``flash_err``: the ring output vs single-device ``fa_forward`` on the whole sequence), or
``{"case": ..., "error": "<type>: <message>"}``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def reference(q, k, v, do, causal):
    """float64 attention and its gradients (numpy), GQA by repeating K/V heads."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    g = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, g, 1), np.repeat(v, g, 1)
    S, D = q.shape[2], q.shape[3]
    s = np.einsum("bhqd,bhkd->bhqk", q, kk) / np.sqrt(D)
    if causal:
        s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ vv
    dp = do @ np.swapaxes(vv, -1, -2)
    ds = p * (dp - (do * out).sum(-1, keepdims=True))
    dq = ds @ kk / np.sqrt(D)
    dk = (np.swapaxes(ds, -1, -2) @ q / np.sqrt(D)).reshape(k.shape[0], k.shape[1], g, S, D).sum(2)
    dv = (np.swapaxes(p, -1, -2) @ do).reshape(v.shape[0], v.shape[1], g, S, v.shape[3]).sum(2)
    return out, dq, dk, dv


def run(c):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import tpukernels as tk
    from tpukernels.distributed import ring_attention as R
    from tpukernels.library.attention import fa_forward

    n, S, causal, lb, mode = c["n"], c["S"], c["causal"], c.get("load_balance", True), c.get("mode", "fast")
    B, Hq, Hkv, D = c.get("B", 1), c.get("Hq", 2), c.get("Hkv", 1), c.get("D", 32)
    mesh = Mesh(np.array(jax.devices()[:n]), ("cp",))
    rng = np.random.default_rng(c.get("seed", 0))
    shapes = ((B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, Hq, S, D))
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
    bal = causal and lb
    perm = (lambda x: R.zigzag_permute(x, n)) if bal else (lambda x: x)
    unperm = (lambda x: R.zigzag_unpermute(x, n)) if bal else (lambda x: x)

    def f(q, k, v):
        return unperm(R.ring_attention(perm(q), perm(k), perm(v), mesh, "cp", causal=causal, load_balance=lb))

    with tk.interpret_mode(mode):
        out, vjp = jax.vjp(f, q, k, v)
        grads = vjp(do)
        flash, _ = fa_forward(q, k, v, causal=causal)
    ref = reference(q, k, v, do, causal)
    got = (out, *grads)
    err = {nm: float(np.max(np.abs(np.asarray(a, np.float64) - r)) / np.max(np.abs(r)))
           for nm, a, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    flash_err = float(np.max(np.abs(np.asarray(out) - np.asarray(flash))) / np.max(np.abs(np.asarray(flash))))
    return {"err": err, "flash_err": flash_err}


def main():
    cases = json.loads(sys.argv[1])
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                               + str(max(c["n"] for c in cases)))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from tpukernels.distributed import ring_attention as R

    for case in cases:
        try:
            if case.get("expect_error"):
                mesh = Mesh(np.array(jax.devices()[:case["n"]]), ("cp",))
                x = jnp.zeros((1, 1, case["S"], 8), jnp.float32)
                R.ring_attention(x, x, x, mesh, "cp", causal=case["causal"])
                res = {"no_error": True}
            else:
                res = run(case)
        except Exception as e:  # noqa: BLE001  (reported to the test, which asserts on it)
            res = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({"case": case, **res}), flush=True)


if __name__ == "__main__":
    main()
