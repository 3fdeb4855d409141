"""References of the grouped matmul: float64 ones from the (low-precision) inputs for the tests, and jax
ones of both kernels (the autotuner's check)."""

from __future__ import annotations

import numpy as np
import torch

from .common import resolve_out_dtype
from .schedule import group_bounds


def ref_bounds_np(group_sizes, group_offset, M, G):
    sizes = np.maximum(np.asarray(group_sizes, dtype=np.int64), 0)
    ends = np.minimum(np.cumsum(sizes), M)
    starts = np.concatenate([[0], ends[:-1]])
    off = int(np.clip(int(np.asarray(group_offset).reshape(-1)[0]), 0, len(sizes) - G))
    return [(int(starts[off + g]), int(ends[off + g])) for g in range(G)]


def reference(lhs, rhs, group_sizes, *, transpose_rhs=False, group_offset=None, rhs_bias=None) -> torch.Tensor:
    """float64 reference of :func:`grouped_matmul` from the given (low-precision) inputs, **not** rounded
    (``rhs_bias [G, 1, N]``: ``+ rhs_bias[g]`` on the rows of group ``g``)."""
    M, G = lhs.shape[0], rhs.shape[0]
    w = rhs.double().transpose(1, 2) if transpose_rhs else rhs.double()
    out = torch.zeros(M, w.shape[2], dtype=torch.float64)
    off = 0 if group_offset is None else int(group_offset)
    for g, (s, e) in enumerate(ref_bounds_np(group_sizes.cpu().numpy(), [off], M, G)):
        out[s:e] = lhs[s:e].double() @ w[g] + (0 if rhs_bias is None else rhs_bias[g].double())
    return out


def reference_tgmm(x, y, group_sizes, num_groups, group_offset=None) -> torch.Tensor:
    """float64 reference of the tgmm kernel: ``[G, K, N]``."""
    off = 0 if group_offset is None else int(group_offset)
    out = torch.zeros(num_groups, x.shape[1], y.shape[1], dtype=torch.float64)
    for g, (s, e) in enumerate(ref_bounds_np(group_sizes.cpu().numpy(), [off], x.shape[0], num_groups)):
        out[g] = x[s:e].double().T @ y[s:e].double()
    return out


def reference_fwd_jnp(group_sizes, group_offset, lhs, rhs, rhs_bias=None, transpose_rhs=False, out_dtype=None):
    """jax reference of the forward kernel (``jax.lax.ragged_dot`` on the shard; autotuner check)."""
    import jax
    import jax.numpy as jnp

    M, G = lhs.shape[0], rhs.shape[0]
    s, e = group_bounds(group_sizes, group_offset, M, G)
    w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    rows = jnp.arange(M)[:, None]
    member = (rows >= s[None, :]) & (rows < e[None, :])  # [M, G]
    z = jnp.einsum("mk,gkn,mg->mn", lhs.astype(jnp.float32), w.astype(jnp.float32), member.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    if rhs_bias is not None:
        z = z + jnp.einsum("mg,gn->mn", member.astype(jnp.float32), rhs_bias[:, 0, :].astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
    return z.astype(resolve_out_dtype(out_dtype, lhs))


def reference_tgmm_jnp(group_sizes, group_offset, x, y, num_groups, out_dtype=None):
    import jax
    import jax.numpy as jnp

    s, e = group_bounds(group_sizes, group_offset, x.shape[0], num_groups)
    rows = jnp.arange(x.shape[0])[:, None]
    member = ((rows >= s[None, :]) & (rows < e[None, :])).astype(jnp.float32)
    z = jnp.einsum("mk,mn,mg->gkn", x.astype(jnp.float32), y.astype(jnp.float32), member,
                   precision=jax.lax.Precision.HIGHEST)
    return z.astype(resolve_out_dtype(out_dtype, x))

