"""Cost probe (model: libtpu static estimate, NOT a measurement; values not checked) of the MoE permutation's XLA
glue at ``M = T * k`` expert ids: the stable argsort with positions by a scatter and group sizes by a scatter-add
(what fused_moe_jax ran before), the same argsort with positions by a second sort and group sizes by a fused count
(what it runs now), against a sort-free counting form (a one-hot cumsum gives each id's rank within its expert) and a
blocked counting form (per-chunk one-hot cumsums plus a prefix over chunks). All four give the same
order / positions / sizes (checked on the host first).

    .venv/bin/python benchmarks/probes/moe_permutation_probe.py v6e 128 65536

2026-12-07, v6e, E = 128, M = 65,536 (Qwen3-30B-A3B prefill): argsort 283.5 us, counting 713.5 us, blocked:
libtpu aborts (llo_execution_graph.cc:146). The sort stays. Second round: the same argsort with the positions by a
second sort (``argsort(order)``) and the sizes by a fused compare-and-sum instead of the two scatters
(sort_inverse_form, what ``moe_permute_jax`` now runs): v6e 55.3 us; tpu7x 228.6 -> 44.0; v5e (where libtpu aborts
on the scatters, llo_execution_graph.cc:149) 93.0.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout
for _k, _v in (("JAX_PLATFORMS", "cpu"), ("TPU_ACCELERATOR_TYPE", "v5litepod-1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
               ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(_k, _v)
import jax
import jax.numpy as jnp
import numpy as np
from tpukernels.bench.core import Estimator, default_cache_path
from tpukernels.perf import clock_hz

chip, E, M = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
i32 = jnp.int32


def argsort_form(flat):
    order = jnp.argsort(flat, stable=True).astype(i32)
    positions = jnp.zeros_like(order).at[order].set(jnp.arange(M, dtype=i32))
    return order, positions, jnp.zeros((E,), i32).at[flat].add(1, mode="drop")


def sort_inverse_form(flat):  # what moe_permute_jax runs: positions by a second sort, sizes by a fused count
    from tpukernels.library.moe_routing.permute_ops import count_ids, inverse_permutation

    order = jnp.argsort(flat, stable=True).astype(i32)
    return order, inverse_permutation(order), count_ids(flat, E)


def counting_form(flat):
    csum = jnp.cumsum((flat[:, None] == jnp.arange(E, dtype=i32)[None, :]).astype(i32), axis=0)
    sizes = csum[-1]
    rank = jnp.take_along_axis(csum, flat[:, None], axis=1)[:, 0] - 1
    positions = (jnp.cumsum(sizes) - sizes)[flat] + rank
    return jnp.zeros_like(positions).at[positions].set(jnp.arange(M, dtype=i32)), positions, sizes


def blocked_form(flat, rows=512):
    f2 = flat.reshape(M // rows, rows)
    within = jnp.cumsum((f2[:, :, None] == jnp.arange(E, dtype=i32)).astype(i32), axis=1)
    per = within[:, -1, :]
    sizes = per.sum(0)
    rank = jnp.take_along_axis(within + (jnp.cumsum(per, axis=0) - per)[:, None, :], f2[:, :, None],
                               axis=2)[..., 0].reshape(M) - 1
    positions = (jnp.cumsum(sizes) - sizes)[flat] + rank
    return jnp.zeros_like(positions).at[positions].set(jnp.arange(M, dtype=i32)), positions, sizes


ids = jnp.asarray(np.random.default_rng(0).integers(0, E, M), i32)
want = jax.jit(argsort_form)(ids)
for f in (sort_inverse_form, counting_form, blocked_form):
    assert all(bool((a == b).all()) for a, b in zip(want, jax.jit(f)(ids))), f.__name__
est = Estimator(default_cache_path())
for f in (argsort_form, sort_inverse_form, counting_form, blocked_form):
    try:
        print(f.__name__, round(est.cycles(jax.jit(f), [jax.ShapeDtypeStruct((M,), i32)], chip) / clock_hz(chip) * 1e6, 1),
              "us (model)")
    except Exception as e:  # noqa: BLE001  (a profiler abort is a result here)
        print(f.__name__, "no estimate:", str(e)[:160])
