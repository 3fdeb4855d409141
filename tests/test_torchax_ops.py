"""torchax lowerings of tpukernels' torch ops (tpukernels.integrations.torchax_ops): torchax 0.0.13 imported
with the named-tensor-overload shim on torch 2.13; ops inside torchax's environment run the kernels."""

from __future__ import annotations

import pytest
import torch


from test_paged_attention import TOL, check, make_batch  # noqa: E402

from tpukernels.errors import BackendUnavailableError  # noqa: E402
from tpukernels.integrations import torchax_ops  # noqa: E402


@pytest.fixture(scope="module")
def env():
    try:
        _, env = torchax_ops.import_torchax()
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    names = torchax_ops.register(env)
    assert "tpukernels::ragged_paged_attention" in names
    return env


def test_ragged_paged_attention_under_torchax(env):
    """The public composite op on torchax tensors: lowered to the JAX entry, same answer as the reference."""
    args = make_batch([1, 3], [4, 6], S=2, T=8, Hq=4, Hkv=2, ps=4, pps=2, P=6)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    with env:
        out = torch.ops.tpukernels.ragged_paged_attention(*[a.to("jax") for a in args], sinks=sinks.to("jax"))
        assert type(out).__module__.startswith("torchax")
        out = out.to("cpu")
    check(args, out, TOL[torch.float32], sinks=sinks)


def test_mla_ragged_paged_attention_under_torchax(env):
    """The MLA op on torchax tensors: lowered to its JAX entry; the output and the written cache those of cpu."""
    from test_mla_attention import make_batch as mla_batch

    args = mla_batch([1, 3], [4, 6], S=2, T=6, H=4, ps=4, pps=2, P=6, poison=False)
    want, want_cache = torch.ops.tpukernels.mla_ragged_paged_attention(*args, 0.1)
    with env:
        out, cache = torch.ops.tpukernels.mla_ragged_paged_attention(*[a.to("jax") for a in args], 0.1)
        assert type(out).__module__.startswith("torchax")
        out, cache = out.to("cpu"), cache.to("cpu")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache, want_cache)


def _kernel_calls(monkeypatch):
    """Names of the kernels :func:`tpukernels.jax_call` runs (the torchax lowerings of kernel ops end there)."""
    from tpukernels.targets import jax_entry

    calls, orig = [], jax_entry.run_jax

    def spy(kernel, values, config):
        calls.append(kernel.name)
        return orig(kernel, values, config)

    monkeypatch.setattr(jax_entry, "run_jax", spy)
    return calls


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape) + shape[-1])
    return torch.randn(*shape, generator=g).to(dtype)


# (public op, its arguments, keyword arguments, the kernels its composite body must reach)
_W8 = torch.randint(-127, 128, (64, 128), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
PUBLIC_OPS = {
    "rms_norm": (lambda: (_rand(4, 256), _rand(256)), {}, {"rms_norm_fwd"}),
    "fused_add_rms_norm": (lambda: (_rand(4, 256), _rand(4, 256, seed=1), _rand(256)), {}, {"fused_add_rms_norm_fwd"}),
    "layer_norm": (lambda: (_rand(4, 256), _rand(256), _rand(256, seed=2)), {}, {"layer_norm_fwd"}),
    "matmul": (lambda: (_rand(64, 128), _rand(128, 128, seed=1)), {}, {"matmul_nn"}),
    "quantized_matmul": (lambda: (_rand(16, 128), _W8, torch.rand(64) / 64 + 1e-3), {}, {"quantized_matmul_kernel"}),
    "rope": (lambda: (_rand(1, 2, 16, 128), _rand(16, 128, seed=1).cos(), _rand(16, 128, seed=1).sin()), {},
             {"rope_fwd"}),
    "gated_activation": (lambda: (_rand(8, 256), _rand(8, 256, seed=1)), {"activation": "silu"},
                         {"gated_activation_fwd"}),
    "flash_attention": (lambda: (_rand(1, 4, 128, 128), _rand(1, 2, 128, 128, seed=1), _rand(1, 2, 128, 128, seed=2)),
                        {"causal": True}, {"flash_attention_fwd"}),
}


@pytest.mark.parametrize("name", sorted(PUBLIC_OPS))
def test_public_op_under_torchax_reaches_its_kernel(env, name, monkeypatch):
    """Each public op on torchax tensors runs its own composite body, whose kernel-op calls are lowered to
    tpukernels.jax_call (the kernels named run), and returns what the op returns on cpu tensors."""
    make, kwargs, kernels = PUBLIC_OPS[name]
    args = make()
    op = getattr(torch.ops.tpukernels, name)
    ref = op(*args, **kwargs)
    calls = _kernel_calls(monkeypatch)
    with env:
        out = op(*[a.to("jax") for a in args], **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        assert all(type(o).__module__.startswith("torchax") for o in outs)
        outs = [o.to("cpu") for o in outs]
    assert kernels <= set(calls), (name, calls)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def test_every_kernel_op_and_composite_is_registered(env):
    """register() covers every library kernel op (-> jax_call) and every CompositeImplicitAutograd public op."""
    from tpukernels.dsl.kernel import REGISTRY

    names = set(torchax_ops.register(env))
    assert {q for q, k in REGISTRY.items() if q.startswith("tpukernels::") and k.op is not None} <= names
    assert {f"tpukernels::{n}" for n in PUBLIC_OPS} <= names
