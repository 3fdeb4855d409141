"""Context-parallel (ring) attention, tpukernels.distributed.ring_attention (issue 29 item 4).

The mesh tests run tests/ring_attention_worker.py (and, slow, tests/ring_attention_gloo_worker.py in two
processes joined by jax.distributed over gloo) in a subprocess (a jax CPU mesh of N host devices needs
``--xla_force_host_platform_device_count`` before jax starts) and compare the ring's output and its
gradients with a float64 numpy reference of the whole-sequence attention, and its output with single-device
``fa_forward`` on the whole sequence. Tolerance: float32 inputs, f32 kernels and f32 logsumexp merges over
<= 4 shards: ``2e-5`` of the largest reference value (observed <= ~1e-6; a wrong mask, a missed step or a
gradient sent to the wrong device is O(1)).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cpu_mesh import run_cases  # tests/ is on sys.path (rootdir-relative import)
from tpukernels.distributed import ring_attention as R
from tpukernels.errors import ArgumentError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 2e-5


def _run(cases, timeout=600):
    return run_cases("ring_attention_worker.py", cases, timeout)


def _assert_close(res):
    assert "error" not in res, res
    for name, e in res["err"].items():
        assert e <= TOL, (res["case"], name, e)
    assert res["flash_err"] <= TOL, res


def test_zigzag_order_roundtrip():
    """Device i of n gets chunks i and 2n-1-i; unpermute inverts; lengths not divisible by 2n are errors."""
    x = np.arange(2 * 3 * 12).reshape(2, 3, 12)
    z = np.asarray(R.zigzag_permute(x, 3, axis=2))
    assert z[0, 0].tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert np.array_equal(np.asarray(R.zigzag_unpermute(z, 3, axis=2)), x)
    with pytest.raises(ArgumentError, match="divisible by 2 \\* n = 6"):
        R.zigzag_permute(np.zeros((1, 1, 9)), 3)


def test_bad_arguments_typed_errors():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    x = jnp.zeros((1, 1, 8, 8), jnp.float32)
    with pytest.raises(ArgumentError, match="axis_name 'sp' is not an axis of the mesh"):
        R.ring_attention(x, x, x, mesh, "sp")
    with pytest.raises(ArgumentError, match="q must be 4-D"):
        R.ring_attention(x[0], x, x, mesh, "cp")
    with pytest.raises(ArgumentError, match="share the sequence length"):
        R.ring_attention(x, x[:, :, :4], x[:, :, :4], mesh, "cp")


def test_ring_matches_single_device_on_cpu_mesh():
    """2-device CPU mesh, causal with the zigzag load balance (GQA 2:1): forward and dq/dk/dv match the
    whole-sequence float64 reference and single-device flash attention; S not divisible by 2n is a typed error."""
    res = _run([{"n": 2, "S": 64, "causal": True},
                {"n": 2, "S": 70, "causal": True, "expect_error": True}])
    _assert_close(res[0])
    assert res[1].get("error", "").startswith("ArgumentError") and "divisible by 4" in res[1]["error"], res[1]


@pytest.mark.slow
def test_ring_variants_four_devices():
    """4 devices: zigzag causal, contiguous causal (skipped steps via lax.cond), non-causal, and the
    NaN-poisoned "tpu" interpret mode."""
    for res in _run([{"n": 4, "S": 128, "causal": True},
                     {"n": 4, "S": 64, "causal": True, "load_balance": False},
                     {"n": 4, "S": 64, "causal": False, "Hq": 2, "Hkv": 2},
                     {"n": 2, "S": 64, "causal": True, "mode": "tpu"}], timeout=1200):
        _assert_close(res)


@pytest.mark.slow
@pytest.mark.aot
def test_compile_only_v5e_2x2_forward_backward():
    """jax.grad of ring attention over the 4 chips of a compile-only v5e:2x2 (S = 8192, GQA 8:2, causal,
    zigzag) compiles with Mosaic, and XLA schedules kernels between the collective-permute start and done of
    the K/V transfers (the overlap the module docstring models)."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpukernels.targets.compile_only import _topology_devices

    devs = _topology_devices("v5e:2x2")
    mesh = Mesh(np.asarray(devs, dtype=object).reshape(4), ("cp",))
    sh = NamedSharding(mesh, P(None, None, "cp", None))
    st = [jax.ShapeDtypeStruct((1, h, 8192, 128), jnp.bfloat16, sharding=sh) for h in (8, 2, 2)]

    def loss(q, k, v):
        return R.ring_attention(q, k, v, mesh, "cp", causal=True, chip="v5e").astype(jnp.float32).sum()

    with jax.default_device(devs[0]):
        txt = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*st).compile().as_text()
    assert "tpu_custom_call" in txt
    overlapped = 0
    for comp in txt.split("\n\n"):
        lines = comp.splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*(%?[\w.-]+) = .*collective-permute-start\(", line)
            if not m:
                continue
            name = m.group(1)
            for j in range(i + 1, len(lines)):
                if "collective-permute-done(" in lines[j] and name in lines[j]:
                    between = lines[i + 1:j]
                    overlapped += any("custom-call" in b or "conditional(" in b for b in between)
                    break
    assert overlapped >= 1, "no kernel scheduled inside a K/V transfer"


@pytest.mark.slow
def test_two_process_gloo_group():
    """Two processes (one CPU device each) joined by jax.distributed with gloo collectives: the ring's
    ppermutes cross processes; each checks its own shards of out, dq, dk, dv against the float64 reference.
    Bounded: 300 s per process, both killed on timeout."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    worker = os.path.join(ROOT, "tests", "ring_attention_gloo_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(i), "2", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env) for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, out, err in outs:
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        assert rc == 0 and len(lines) == 1 and "error" not in lines[0], (rc, out[-2000:], err[-3000:])
        assert lines[0]["devices"] == 2
        for name, e in lines[0]["err"].items():
            assert e <= TOL, (lines[0]["process"], name, e)
