"""Collective matmuls (tpukernels.distributed.collective_matmul): all-gather -> matmul and matmul ->
reduce-scatter on a jax CPU mesh equal the float64 product, with the documented output sharding; for a
4-chip v5e (compile-only) the ring's transfers are asynchronous collective-permutes with matmul kernels
scheduled between their start and done (the overlap)."""

import re

import numpy as np
import pytest

from cpu_mesh import run_cases  # tests/ is on sys.path (rootdir-relative import)
from tpukernels.errors import ArgumentError


def _run(cases):
    return run_cases("collective_matmul_worker.py", cases)


def _check(res, tol):
    assert "error" not in res, res
    assert res["err"] <= tol, res
    assert res["sharding_ok"], res


def test_on_a_four_device_cpu_mesh():
    """f32, both ops (nn and the nt weight layout)."""
    for res in _run([{"op": "ag", "n": 4, "M": 32, "K": 128, "N": 512},
                     {"op": "rs", "n": 4, "M": 32, "K": 512, "N": 128, "rhs_transpose": True, "seed": 1}]):
        _check(res, 1e-5)


@pytest.mark.slow
def test_two_and_eight_devices_and_bf16():
    """2 and 8 devices; bf16 (one rounding of an f32 sum) for both ops."""
    for res in _run([{"op": "ag", "n": 2, "M": 16, "K": 128, "N": 256},
                     {"op": "ag", "n": 4, "M": 64, "K": 256, "N": 512, "rhs_transpose": True, "dtype": "bf16",
                      "seed": 2},
                     {"op": "rs", "n": 8, "M": 64, "K": 1024, "N": 128, "seed": 3},
                     {"op": "rs", "n": 4, "M": 32, "K": 512, "N": 256, "dtype": "bf16", "seed": 4}]):
        _check(res, 2e-2 if res["case"].get("dtype") == "bf16" else 1e-5)


def test_fused_kernels_on_two_three_and_four_device_meshes():
    """The one-kernel all-gather matmul and matmul reduce-scatter (remote DMAs around the ring) in the TPU
    interpreter (NaN-initialised memory, DMA and semaphore semantics): several row and column blocks per ring
    step, 2, 3 and 4 devices, f32 and bf16; the output against float64 (all-gather: every device's landing buffer
    exactly x); through ``all_gather_matmul`` / ``matmul_reduce_scatter(..., impl="kernel")`` too. A regression
    this catches: one receive semaphore for all slots let a sender running ahead meet a wait with the wrong
    transfer (NaN rows at 3 devices).

    The process gets 2 more host devices than the mesh uses: when every host device runs a kernel that blocks
    in a semaphore wait, the interpreter deadlocked in its buffer-allocation callbacks (seen at 2 of 2 and 4 of 4
    devices on this 2-core machine; never with spare devices)."""
    cases = [{"op": "agk", "n": 4, "M": 64, "K": 128, "N": 1024, "config": {"block_m": 8, "block_n": 128}},
             {"op": "agk", "n": 3, "M": 48, "K": 128, "N": 768, "seed": 4, "config": {"block_m": 8, "block_n": 128}},
             {"op": "agk", "n": 2, "M": 32, "K": 256, "N": 512, "dtype": "bf16", "seed": 5,
              "config": {"block_m": 8, "block_n": 128}},
             {"op": "ag", "impl": "kernel", "n": 3, "M": 24, "K": 128, "N": 384, "seed": 6},
             {"op": "rsk", "n": 4, "M": 64, "K": 512, "N": 256, "seed": 7, "config": {"block_m": 8, "block_n": 128}},
             {"op": "rsk", "n": 3, "M": 48, "K": 384, "N": 384, "dtype": "bf16", "seed": 8,
              "config": {"block_m": 8, "block_n": 128}},
             {"op": "rs", "impl": "kernel", "n": 2, "M": 16, "K": 256, "N": 128, "seed": 9}]
    for res in run_cases("collective_matmul_worker.py", [dict(c, devices=6) for c in cases], timeout=420):
        _check(res, 2e-2 if res["case"].get("dtype") == "bf16" else 1e-5)
        assert res.get("gathered_exact", True), res


def test_bad_arguments_raise_before_tracing():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from tpukernels.distributed.collective_matmul import all_gather_matmul, matmul_reduce_scatter

    mesh = Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    x, y = jnp.zeros((8, 128)), jnp.zeros((128, 256))
    with pytest.raises(ArgumentError, match="no axis 'dp'"):
        all_gather_matmul(x, y, mesh, "dp")
    with pytest.raises(ArgumentError, match="contraction dims differ"):
        all_gather_matmul(x, y, mesh, "tp", rhs_transpose=True)
    with pytest.raises(ArgumentError, match="must be 2-D"):
        matmul_reduce_scatter(x[None], y, mesh, "tp")
    with pytest.raises(ArgumentError, match="impl must be 'ring' or 'kernel'"):
        all_gather_matmul(x, y, mesh, "tp", impl="fused")
    with pytest.raises(ArgumentError, match="at least 2 devices"):
        all_gather_matmul(x, y, mesh, "tp", impl="kernel")
    with pytest.raises(ArgumentError, match="matmul_reduce_scatter: impl must be"):
        matmul_reduce_scatter(x, y, mesh, "tp", impl="fused")
    from tpukernels.distributed.all_gather_matmul_kernel import agmm_kernel
    from tpukernels.targets.compile_only import compile_for

    with pytest.raises(ArgumentError, match="must be traced inside shard_map over axis 'tp'"):
        compile_for(agmm_kernel, "v5e", "16x128:f32", "128x256:f32", "tp", 2)


@pytest.mark.aot
@pytest.mark.parametrize("topology, n", [("v5e:2x2", 4), pytest.param("tpu7x:2x2x1", 8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("op", ["ag", pytest.param("rs", marks=pytest.mark.slow), "ag-kernel", "rs-kernel"])
def test_compile_only_overlaps_the_ring(op, topology, n):
    """Llama-3-8B MLP shapes (M = 4096 tokens, K = 4096, N = 14336 bf16) on 4 chips (v5e:2x2) and 8 (tpu7x:2x2x1,
    slow): Mosaic compiles the matmul kernels, and XLA:TPU schedules a kernel between a collective-permute's
    start and its done."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpukernels.distributed.collective_matmul import all_gather_matmul, matmul_reduce_scatter
    from tpukernels.targets.compile_only import _topology_devices

    mesh = Mesh(np.asarray(_topology_devices(topology), dtype=object).reshape(n), ("tp",))
    if op.startswith("ag"):
        fn, xs, ys = all_gather_matmul, P("tp", None), P(None, "tp")
        shapes = ((4096, 4096), (4096, 14336))
    else:
        fn, xs, ys = matmul_reduce_scatter, P(None, "tp"), P("tp", None)
        shapes = ((4096, 14336), (14336, 4096))
    structs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, sp)) for s, sp in zip(shapes, (xs, ys))]
    if op.endswith("kernel"):  # one Mosaic kernel per chip: its remote DMAs are inside it, no collective in the HLO
        hlo = jax.jit(lambda a, b: fn(a, b, mesh, "tp", interpret="mosaic", impl="kernel")).lower(
            *structs).compile().as_text()
        assert sum("tpu_custom_call" in ln for ln in hlo.splitlines() if "custom-call(" in ln) == 1, hlo[-3000:]
        assert "collective-permute" not in hlo and "all-gather" not in hlo
        return
    hlo = jax.jit(lambda a, b: fn(a, b, mesh, "tp", interpret="mosaic")).lower(*structs).compile().as_text()
    lines = hlo.splitlines()
    start = [i for i, ln in enumerate(lines) if "collective-permute-start" in ln and "=" in ln]
    assert start, "no asynchronous collective-permute"
    overlapped = 0
    for i in start:
        name = re.search(r"(%\S+)\s*=", lines[i]).group(1)
        done = next(j for j in range(i + 1, len(lines)) if "collective-permute-done" in lines[j] and name in lines[j])
        overlapped += any("tpu_custom_call" in ln or "custom-call" in ln for ln in lines[i + 1:done])
    assert overlapped >= 1, "no kernel between a collective-permute start and done"


def test_async_tp_registration_and_checks_without_a_group():
    """torch's symm_mem fused ops on tpukernels' rings (tests/test_distributed.py runs them on a gloo group):
    only the tpu and cpu dispatch keys may be registered (torch's kernels own CUDA), and a transposed [N, K]
    weight view is read in place."""
    import torch

    from tpukernels.distributed import async_tp

    with pytest.raises(ArgumentError, match="device_types must be 'PrivateUse1' or 'CPU', got \\['CUDA'\\]"):
        async_tp.register_symm_mem_ops(("CUDA",))
    w = torch.randn(6, 8)
    ws, transposed = async_tp.as_rhs([w.T, torch.randn(5, 8).T])
    assert transposed and ws[0] is not None and ws[0].data_ptr() == w.data_ptr() and ws[0].shape == (6, 8)
    ws, transposed = async_tp.as_rhs([w.T, torch.randn(8, 5)])  # mixed: every operand as [K, N], contiguous
    assert not transposed and all(x.is_contiguous() for x in ws) and [tuple(x.shape) for x in ws] == [(8, 6), (8, 5)]
