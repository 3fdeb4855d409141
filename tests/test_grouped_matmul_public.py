"""The public grouped_matmul op: argument checks before any kernel, devices, second derivatives."""

import numpy as np
import pytest
import torch

from tpukernels.errors import ArgumentError, ConfigError
from tpukernels.library import grouped_matmul


def _inputs(M=48, K=32, N=40, sizes=(13, 0, 20), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lhs = torch.randn(M, K, generator=g).to(dtype)
    rhs = torch.randn(len(sizes), K, N, generator=g).to(dtype)
    return lhs, rhs, torch.tensor(sizes, dtype=torch.int32)


def _ref64(lhs, rhs, sizes, transpose_rhs=False):
    """Differentiable float64 grouped matmul (torch ops): rows past sum(sizes) are zero."""
    w = rhs.transpose(1, 2) if transpose_rhs else rhs
    parts, start = [], 0
    for g, s in enumerate(sizes):
        parts.append(lhs[start:start + s] @ w[g])
        start += s
    parts.append(torch.zeros(lhs.shape[0] - start, w.shape[2], dtype=lhs.dtype))
    return torch.cat(parts)


def test_default_group_offset_is_on_the_inputs_device():
    """Without group_offset the default offset was made on cpu: every non-cpu call (meta here, tpu on a TPU
    host, so the MoE integration) raised DeviceError."""
    lhs, rhs, gs = (t.to("meta") for t in _inputs())
    out = grouped_matmul(lhs, rhs, gs)
    assert out.device.type == "meta" and tuple(out.shape) == (48, 40)


@pytest.mark.parametrize("config", ["bm=128", '{"bm": 128}', 42, [("bm", 128)]])
def test_config_that_is_not_a_dict_is_a_config_error(config):
    lhs, rhs, gs = _inputs()
    with pytest.raises(ConfigError, match="config must be a dict"):
        grouped_matmul(lhs, rhs, gs, config=config)


def test_config_with_a_non_json_value_is_a_config_error():
    lhs, rhs, gs = _inputs()
    with pytest.raises(ConfigError, match="not JSON-serializable"):
        grouped_matmul(lhs, rhs, gs, config={"bm": torch.tensor(128)})


@pytest.mark.parametrize("offset", [1.7, "1", True, 2.0])
def test_group_offset_must_be_an_int_or_tensor(offset):
    lhs, rhs, gs = _inputs()
    with pytest.raises(ArgumentError, match="group_offset must be an int"):
        grouped_matmul(lhs, rhs, gs, group_offset=offset)


def test_group_offset_numpy_int_is_accepted():
    lhs, rhs, _ = _inputs(sizes=(13, 0, 20))
    gs = torch.tensor([5, 13, 0, 20], dtype=torch.int32)  # 4 groups in all, rhs holds groups 1..3
    got = grouped_matmul(lhs, rhs, gs, group_offset=np.int64(1))
    want = _ref64(lhs.double()[5:], rhs.double(), [13, 0, 20])
    assert torch.allclose(got[5:].double(), want, rtol=1e-5, atol=1e-4) and not got[:5].any()


@pytest.mark.parametrize("bad", ["lhs", "rhs", "group_sizes"])
def test_non_tensor_operands_name_the_argument(bad):
    args = dict(zip(("lhs", "rhs", "group_sizes"), _inputs()))
    args[bad] = args[bad].tolist() if bad == "group_sizes" else args[bad].numpy()
    with pytest.raises(ArgumentError, match=f"{bad} must be a torch.Tensor"):
        grouped_matmul(args["lhs"], args["rhs"], args["group_sizes"])


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_second_derivatives_match_float64(transpose_rhs):
    """Double backward through d_lhs (grouped_matmul_fwd) and d_rhs (tgmm, whose own backward is two grouped
    matmuls) vs float64 autograd of the same math; an empty group and tail rows (sum < M) included."""
    sizes = (13, 0, 20)
    lhs, rhs, gs = _inputs(sizes=sizes)
    if transpose_rhs:
        rhs = rhs.transpose(1, 2).contiguous()  # [G, N, K]
    gen = torch.Generator().manual_seed(1)
    probe_l, probe_r = torch.randn(lhs.shape, generator=gen), torch.randn(rhs.shape, generator=gen)

    def second(lhs, rhs, fn):
        lhs, rhs = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
        y = fn(lhs, rhs)
        gl, gr = torch.autograd.grad((y * y).sum(), (lhs, rhs), create_graph=True)
        z = (gl * probe_l.to(gl.dtype)).sum() + (gr * probe_r.to(gr.dtype)).sum()
        return torch.autograd.grad(z, (lhs, rhs))

    got = second(lhs, rhs, lambda a, b: grouped_matmul(a, b, gs, transpose_rhs=transpose_rhs))
    want = second(lhs.double(), rhs.double(), lambda a, b: _ref64(a, b, sizes, transpose_rhs))
    for g, w in zip(got, want):
        err = (g.double() - w).abs().max() / w.abs().max()
        assert err < 1e-5, float(err)
    assert not got[0][33:].any()  # rows past sum(group_sizes) get no gradient


def test_group_bounds_of_garbage_sizes_do_not_wrap_around():
    """Unchecked sizes (device tensors, torch.compile) are clamped as the module docstring says: negative
    sizes count as 0 and ends are capped at M, also when the int32 running sum would pass 2**31."""
    import jax.numpy as jnp

    from tpukernels.library.grouped_matmul_ops import group_bounds

    M = 100
    sizes = np.array([M - 1, 2**30, 2**30, 2**30, -5, 7], np.int32)
    s, e = group_bounds(jnp.asarray(sizes), jnp.zeros((), jnp.int32), M, len(sizes))
    ends = np.minimum(np.cumsum(np.maximum(sizes.astype(np.int64), 0)), M)
    starts = np.concatenate([[0], ends[:-1]])
    np.testing.assert_array_equal(np.asarray(e), ends)
    np.testing.assert_array_equal(np.asarray(s), starts)
