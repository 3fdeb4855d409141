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
    assert names == ["tpukernels::ragged_paged_attention"]
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
