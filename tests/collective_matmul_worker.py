"""Subprocess worker for tests/test_collective_matmul.py: the collective matmuls on a jax CPU mesh of N host
devices (``--xla_force_host_platform_device_count`` must be set before jax starts).

Usage: python tests/collective_matmul_worker.py CASES_JSON -> one JSON line per case: the error of the result
against the float64 numpy product (max abs error / max abs reference), whether its sharding is the documented
one (op "agk", the all-gather matmul kernel at an explicit config: also whether every device's gathered x is
exactly x), or ``{"case": ..., "error": "<type>: <message>"}``.
"""

from __future__ import annotations


import numpy as np


def run(c):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpukernels.distributed.collective_matmul import all_gather_matmul, matmul_reduce_scatter

    n, M, K, N, t = c["n"], c["M"], c["K"], c["N"], c.get("rhs_transpose", False)
    dtype = jnp.bfloat16 if c.get("dtype") == "bf16" else jnp.float32
    rng = np.random.default_rng(c.get("seed", 0))
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    y = jnp.asarray(rng.standard_normal((N, K) if t else (K, N)) / np.sqrt(K), dtype)
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("tp",))
    extra = {}
    if c["op"] == "agk":  # the all-gather matmul kernel itself, at an explicit config: out and the gathered x
        from tpukernels.distributed.all_gather_matmul_kernel import agmm_kernel
        from tpukernels.distributed.ring_attention import call_kernel

        def local(a, b):
            o, g = call_kernel(agmm_kernel, c.get("mode", "tpu"), None, a, b, "tp", n, config=c["config"])
            return o, g[None]

        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                                  out_specs=(P(None, "tp"), P("tp")), check_vma=False))
        out, gathered = f(x, y)
        g = np.asarray(gathered, np.float64)  # [n devices, n shards, m, K]: every device holds all of x
        extra["gathered_exact"] = bool(all(np.array_equal(g[d].reshape(M, K), np.asarray(x, np.float64))
                                           for d in range(n)))
        want_spec = P(None, "tp")
    elif c["op"] == "rsk":  # the matmul reduce-scatter kernel itself, at an explicit config
        from tpukernels.distributed.matmul_reduce_scatter_kernel import rsmm_kernel
        from tpukernels.distributed.ring_attention import call_kernel

        f = jax.jit(jax.shard_map(
            lambda a, b: call_kernel(rsmm_kernel, c.get("mode", "tpu"), None, a, b, "tp", n, config=c["config"])[0],
            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None), check_vma=False))
        out = f(x, y)
        want_spec = P("tp", None)
    elif c["op"] == "ag":
        xs = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
        ys = jax.device_put(y, NamedSharding(mesh, P("tp", None) if t else P(None, "tp")))
        out = all_gather_matmul(xs, ys, mesh, "tp", rhs_transpose=t, impl=c.get("impl", "ring"))
        want_spec = P(None, "tp")
    else:
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
        ys = jax.device_put(y, NamedSharding(mesh, P(None, "tp") if t else P("tp", None)))
        out = matmul_reduce_scatter(xs, ys, mesh, "tp", rhs_transpose=t, impl=c.get("impl", "ring"))
        want_spec = P("tp", None)
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if c["op"] in ("agk", "rsk"):
        from tpukernels.distributed.all_gather_matmul_kernel import agmm_reference
        from tpukernels.distributed.matmul_reduce_scatter_kernel import rsmm_reference

        ref = (agmm_reference if c["op"] == "agk" else rsmm_reference)(x, y)
    else:
        ref = x64 @ (y64.T if t else y64)
    got = np.asarray(out, np.float64)
    return {"case": c, "err": float(np.abs(got - ref).max() / np.abs(ref).max()), "dtype": str(out.dtype),
            "sharding_ok": out.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), 2), **extra}


if __name__ == "__main__":
    from cpu_mesh import serve  # the script's folder (tests/) is on sys.path

    serve(run)
