"""tpukernels.jax_call: kernels on jax arrays and tracers (jit, vmap, grad, shard_map), Mosaic vs interpreter
chosen from the platform being lowered for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from kernels_for_tests import scale

import tpukernels as tk
from tpukernels.errors import ArgumentError, ConfigError


def _x(seed=0, shape=(24, 128), dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def test_eager_jit_and_kernel_call_agree(interpret):
    x = _x()
    want = 3.0 * np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(tk.jax_call(scale, x, alpha=3.0)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a: tk.jax_call(scale, a, 3.0))(x)), want, rtol=1e-6)
    # kernel(tracer) goes through the same entry
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a: scale(a, 3.0))(x)), want, rtol=1e-6)


def test_platform_is_chosen_at_lowering():
    """cpu lowering holds no Mosaic call; a TPU export of the same function holds it (no TPU needed)."""
    f = jax.jit(lambda a: tk.jax_call(scale, a, alpha=2.0))
    x = jax.ShapeDtypeStruct((24, 128), jnp.float32)
    assert "tpu_custom_call" not in f.lower(x).as_text()
    exp = jax.export.export(f, platforms=["tpu"])(x)
    assert "tpu_custom_call" in exp.mlir_module()


def test_vmap_adds_a_batch_axis():
    xs = jnp.stack([_x(1), _x(2), _x(3)])
    out = jax.vmap(lambda a: tk.jax_call(scale, a, alpha=-1.5))(xs)
    np.testing.assert_allclose(np.asarray(out), -1.5 * np.asarray(xs, np.float64), rtol=1e-6)


def test_grad_through_the_kernels_backward(interpret):
    """jax.grad uses the kernel's def_backward (itself a kernel call), not JAX autodiff of the Pallas body."""
    x = _x(4)
    w = _x(5)
    g = jax.grad(lambda a: jnp.sum(tk.jax_call(scale, a, alpha=2.5) * w))(x)
    np.testing.assert_allclose(np.asarray(g), 2.5 * np.asarray(w, np.float64), rtol=1e-6)


def test_grad_through_library_rms_norm():
    """A library kernel with a backward: d/dx sum(rms_norm(x) * c) vs the float64 formula."""
    from tpukernels.library.norms import rms_norm_fwd

    x = _x(6, (16, 256))
    c = _x(7, (16, 256))
    eps = 1e-6

    def loss(a):
        y, _ = tk.jax_call(rms_norm_fwd, a, None, eps, 0.0, "llama", False)
        return jnp.sum(y * c)

    g = np.asarray(jax.jit(jax.grad(loss))(x), np.float64)
    xd, cd = np.asarray(x, np.float64), np.asarray(c, np.float64)
    r = 1.0 / np.sqrt((xd * xd).mean(-1, keepdims=True) + eps)
    want = r * cd - xd * r ** 3 * (cd * xd).mean(-1, keepdims=True)
    np.testing.assert_allclose(g, want, rtol=2e-4, atol=2e-5)


def test_shard_map_on_a_cpu_mesh():
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    body = lambda a: tk.jax_call(scale, a, alpha=4.0)  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    x = _x(8)
    np.testing.assert_allclose(np.asarray(f(x)), 4.0 * np.asarray(x, np.float64), rtol=1e-6)
    g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(ArgumentError, match="check_vma=False"):
        g(x)


def test_numpy_inputs_are_converted():
    x = np.asarray(_x(9))
    np.testing.assert_allclose(np.asarray(tk.jax_call(scale, x, alpha=2.0)), 2.0 * x.astype(np.float64), rtol=1e-6)


def test_tracer_for_a_static_is_a_typed_error():
    with pytest.raises(ArgumentError, match="static argument 'alpha' got a traced value"):
        jax.jit(lambda a, s: tk.jax_call(scale, a, alpha=s))(_x(), 2.0)


@pytest.mark.parametrize("bad, err, words", [
    (lambda: tk.jax_call(lambda x: x, _x()), ArgumentError, "must be a tpukernels TpuKernel"),
    (lambda: tk.jax_call(scale, torch.ones(8, 128)), ArgumentError, "is a torch tensor"),
    (lambda: tk.jax_call(scale, _x(), config=[("block_rows", 8)]), ConfigError, "config must be a dict"),
    (lambda: tk.jax_call(scale, _x(), alpha="2"), ArgumentError, "alpha"),
])
def test_bad_calls(bad, err, words):
    with pytest.raises(err, match=words):
        bad()
