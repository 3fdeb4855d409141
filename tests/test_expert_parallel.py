"""Expert parallelism in JAX (tpukernels.distributed.expert_parallel): dispatch -> local experts -> combine on a
jax CPU mesh equals single-device top-k MoE in float64 (output and gradients), the receive buffer's unused rows
stay zero, and the TPU path (``lax.ragged_all_to_all``) compiles for a 4-chip v5e. The torch path runs on the
2-process gloo group of tests/test_distributed.py (check ``expert_parallel`` in tests/distributed_workers.py)."""

import numpy as np
import pytest

from cpu_mesh import run_cases  # tests/ is on sys.path (rootdir-relative import)
from tpukernels.errors import ArgumentError
TOL = 1e-5  # float32 end to end: the sums of a few products


def _run(cases):
    return run_cases("expert_parallel_worker.py", cases)


def _check(res):
    assert "error" not in res, res
    for name, e in res["err"].items():
        assert e <= TOL, (res["case"], name, e)
    assert res["sizes"] == res["want_sizes"], res  # each device holds the global counts of its experts
    assert res["pad_max"] == 0.0, res  # receive-buffer rows nothing landed on are zero (NaN-poisoned mode)


def test_dispatch_combine_on_cpu_mesh():
    """2 devices: random routing into a receive buffer smaller than the worst case that still holds what
    arrives, and a skew that sends every copy to device 0 (device 1 receives nothing)."""
    for res in _run([{"n": 2, "T": 6, "D": 128, "O": 128, "E": 4, "k": 2, "cap": 16},  # 12 rows land per device
                     {"n": 2, "T": 5, "D": 128, "O": 128, "E": 4, "k": 2, "skew": True, "seed": 1},
                     {"n": 3, "emulator": True}]):
        if res["case"].get("emulator"):
            assert "error" not in res and res["equal"], res
            continue
        _check(res)


@pytest.mark.slow
def test_dispatch_combine_four_devices_top4():
    for res in _run([{"n": 4, "T": 5, "D": 128, "O": 256, "E": 8, "k": 4, "seed": 3},
                     {"n": 4, "T": 3, "D": 256, "O": 128, "E": 4, "k": 2, "seed": 4, "mode": "fast"}]):
        _check(res)


def test_emulated_ragged_all_to_all_is_jax_semantics_and_bad_arguments_raise():
    """The CPU stand-in for lax.ragged_all_to_all against its documented semantics, written out in numpy (one
    device here, the output's untouched rows kept; 3 devices with gaps between chunks in the worker's
    "emulator" case); bad arguments of ep_dispatch_jax are typed."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from tpukernels.distributed.expert_parallel import ep_dispatch_jax, ragged_all_to_all_emulated

    mesh = Mesh(np.asarray(jax.devices()[:1]), ("ep",))  # the in-process mesh: one host device
    operand = np.arange(12, dtype=np.float32).reshape(6, 2)
    output = np.full((5, 2), -1.0, np.float32)

    def f(op_, out_):
        return ragged_all_to_all_emulated(op_, out_, jnp.array([2], jnp.int32), jnp.array([3], jnp.int32),
                                          jnp.array([1], jnp.int32), jnp.array([3], jnp.int32), axis_name="ep")

    got = np.asarray(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)(operand, output))
    want = output.copy()
    want[1:4] = operand[2:5]  # SEND(operand[2:5]) lands at the receiver's output[1:4]; the rest kept
    np.testing.assert_array_equal(got, want)

    x, ids = jnp.zeros((4, 128), jnp.float32), jnp.zeros((4, 2), jnp.int32)
    for kw, msg in (({"num_experts": 0}, "num_experts must be a positive int divisible"),
                    ({"num_experts": 4, "impl": "nccl"}, "impl must be 'ragged' or 'emulated'"),
                    ({"num_experts": 4, "max_recv_rows": 0}, "max_recv_rows must be a positive int")):
        with pytest.raises(ArgumentError, match=msg):
            jax.shard_map(lambda a, b: ep_dispatch_jax(a, b, axis_name="ep", **kw)[0], mesh=mesh,
                          in_specs=(P(), P()), out_specs=P(), check_vma=False)(x, ids)


@pytest.mark.aot
def test_compile_only_v5e_2x2_ragged_all_to_all():
    """Dispatch -> experts (``jax.lax.ragged_dot``) -> combine, differentiated, over the 4 chips of a compile-only
    v5e:2x2 (DeepSeek-like: 64 experts, top-8, D = 1024, 256 tokens per chip): Mosaic compiles the permute /
    combine kernels and XLA:TPU the ragged all-to-alls (a ragged-all-to-all in the compiled HLO)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpukernels.distributed.expert_parallel import ep_combine_jax, ep_dispatch_jax
    from tpukernels.targets.compile_only import _topology_devices

    devs = _topology_devices("v5e:2x2")
    mesh = Mesh(np.asarray(devs, dtype=object).reshape(4), ("ep",))
    n, T, D, E, k = 4, 256, 1024, 64, 8

    def moe(x, ids, w, W):
        xs, sizes, h = ep_dispatch_jax(x, ids, E, "ep", impl="ragged", interpret=False)
        y = jax.lax.ragged_dot(xs, W, sizes)  # rows past sum(sizes) come out zero
        return ep_combine_jax(y, w, h, "ep", interpret=False)

    f = jax.shard_map(moe, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep"), check_vma=False)

    def loss(x, ids, w, W):
        return jnp.sum(f(x, ids, w, W).astype(jnp.float32))

    sh = NamedSharding(mesh, P("ep"))
    structs = (jax.ShapeDtypeStruct((n * T, D), jnp.bfloat16, sharding=sh),
               jax.ShapeDtypeStruct((n * T, k), jnp.int32, sharding=sh),
               jax.ShapeDtypeStruct((n * T, k), jnp.float32, sharding=sh),
               jax.ShapeDtypeStruct((E, D, D), jnp.bfloat16, sharding=sh))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 2, 3))).lower(*structs).compile()
    hlo = compiled.as_text()
    assert "ragged-all-to-all" in hlo and "tpu_custom_call" in hlo
