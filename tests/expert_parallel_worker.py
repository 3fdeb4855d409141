"""Subprocess worker for tests/test_expert_parallel.py: expert-parallel dispatch -> experts -> combine on a jax
CPU mesh of N host devices (``--xla_force_host_platform_device_count`` must be set before jax starts).

Usage: python tests/expert_parallel_worker.py CASES_JSON -> one JSON line per case: the relative errors of the
output and of d(out)/dx, dweights against a float64 numpy reference of single-device top-k MoE, the group
sizes each device got, the largest |value| of its receive-buffer padding rows; or ``{"case": .., "error": ..}``.
"""

from __future__ import annotations


import numpy as np


def reference(x, ids, w, W):
    """float64 ``out[t] = sum_j w[t, j] * x[t] @ W[ids[t, j]]`` and its gradients for cotangent ``g``."""
    x, w, W = (np.asarray(a, np.float64) for a in (x, w, W))
    per = np.einsum("td,tjdo->tjo", x, W[ids])  # [T, k, O]
    return (per * w[..., None]).sum(1), per


def emulator(c):
    """ragged_all_to_all_emulated vs the docstring's SEND loop in numpy: n devices, random chunk sizes, chunks
    placed with gaps in the receivers' buffers (untouched rows keep the output's -1)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from tpukernels.distributed.expert_parallel import ragged_all_to_all_emulated

    n, R, cap = c["n"], 9, 16
    rng = np.random.default_rng(5)
    send = rng.integers(0, 3, (n, n))  # send[i, j]: rows device i sends to j
    in_off = np.zeros((n, n), np.int64)
    out_off = np.zeros((n, n), np.int64)
    for i in range(n):
        in_off[i] = np.cumsum(send[i]) - send[i] + i % 2  # a gap of i % 2 rows at the start of i's operand
    for j in range(n):
        at = 1
        for i in range(n):
            out_off[i, j] = at
            at += send[i, j] + 1  # one untouched row between chunks
    operand = rng.standard_normal((n, R, 2)).astype(np.float32)
    want = np.full((n, cap, 2), -1.0, np.float32)
    for i in range(n):
        for j in range(n):
            want[j, out_off[i, j]:out_off[i, j] + send[i, j]] = operand[i, in_off[i, j]:in_off[i, j] + send[i, j]]
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("ep",))

    def f(op, io, ss, oo, rs):
        return ragged_all_to_all_emulated(op[0], jnp.full((cap, 2), -1.0, jnp.float32), io[0], ss[0], oo[0], rs[0],
                                          axis_name="ep")[None]

    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    got = jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"), check_vma=False)(
        jnp.asarray(operand), i32(in_off), i32(send), i32(out_off), i32(send.T))
    return {"case": c, "equal": bool(np.array_equal(np.asarray(got), want))}


def run(c):
    if c.get("emulator"):
        return emulator(c)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpukernels.distributed.expert_parallel import ep_combine_jax, ep_dispatch_jax

    n, T, D, O, E, k = c["n"], c["T"], c["D"], c["O"], c["E"], c["k"]
    rng = np.random.default_rng(c.get("seed", 0))
    x = rng.standard_normal((n * T, D)).astype(np.float32)
    if c.get("skew"):  # every copy to the experts of device 0 (the others receive nothing)
        ids = rng.integers(0, E // n, (n * T, k))
    else:
        ids = rng.integers(0, E, (n * T, k))
    w = rng.random((n * T, k)).astype(np.float32)
    W = (rng.standard_normal((E, D, O)) / np.sqrt(D)).astype(np.float32)
    g = rng.standard_normal((n * T, O)).astype(np.float32)
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("ep",))
    el = E // n

    def moe(xl, idl, wl, Wl):
        xs, sizes, h = ep_dispatch_jax(xl, idl, E, "ep", max_recv_rows=c.get("cap"))
        # the local experts: row r of xs belongs to local expert searchsorted(cumsum(sizes), r, "right")
        e = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(xs.shape[0]), side="right")
        y = jnp.einsum("rd,rdo->ro", xs, Wl[jnp.clip(e, 0, el - 1)])
        out = ep_combine_jax(y, wl, h, "ep")
        pad = jnp.max(jnp.where((jnp.arange(xs.shape[0]) >= jnp.sum(sizes))[:, None], jnp.abs(xs), 0.0))
        return out, sizes[None], pad[None]

    f = jax.shard_map(moe, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P("ep")),
                      out_specs=(P("ep"), P("ep"), P("ep")), check_vma=False)
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids.astype(np.int32), w, W)]
    out, sizes, pad = jax.jit(f)(*args)

    def loss(xv, wv):
        return jnp.sum(f(xv, args[1], wv, args[3])[0] * g)

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(args[0], args[2])
    ref, per = reference(x, ids, w, W)
    ref_dw = np.einsum("tjo,to->tj", per, g)
    ref_dx = np.einsum("tj,tjdo,to->td", w.astype(np.float64), W.astype(np.float64)[ids], g)

    def rel(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(1.0, float(np.max(np.abs(b)))))

    want_sizes = np.bincount(ids.reshape(-1), minlength=E).reshape(n, el)
    return {"case": c, "err": {"out": rel(out, ref), "dx": rel(dx, ref_dx), "dw": rel(dw, ref_dw)},
            "sizes": np.asarray(sizes).tolist(), "want_sizes": want_sizes.tolist(), "pad_max": float(np.max(pad))}


if __name__ == "__main__":
    from cpu_mesh import serve  # the script's folder (tests/) is on sys.path

    serve(run)
