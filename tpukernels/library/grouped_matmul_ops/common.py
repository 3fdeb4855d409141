"""dtype helpers of the grouped matmul: supported dtypes, dtype names, ``out_dtype`` canonicalisation,
block clamping. Package docstring: semantics, kernels, performance."""

from __future__ import annotations

import numpy as np
import torch

from ...errors import DTypeError

KERNEL_DTYPES = ("bfloat16", "float32")


def dtype_name(dt) -> str:
    if isinstance(dt, torch.dtype):
        return str(dt).replace("torch.", "")
    return np.dtype(dt).name


def clamp(dim: int, block: int) -> int:
    return dim if 0 < dim <= block else block


def canonical_out_dtype(out_dtype, where="grouped_matmul") -> str | None:
    """``None`` / torch dtype / name -> ``"bfloat16" | "float32"`` (or None). Raises DTypeError otherwise."""
    if out_dtype is None:
        return None
    name = out_dtype if isinstance(out_dtype, str) else dtype_name(out_dtype)
    name = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32", "float": "float32"}.get(name, name)
    if name not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: out_dtype {out_dtype!r} is not supported; use one of {KERNEL_DTYPES}")
    return name



def resolve_out_dtype(out_dtype, x):
    import jax.numpy as jnp

    return np.dtype(getattr(jnp, canonical_out_dtype(out_dtype) or dtype_name(x.dtype)))



def check_bias(rhs_bias, G: int, N: int, where: str) -> None:
    """``rhs_bias`` must be a ``[G, 1, N]`` bfloat16 / float32 tensor (megablox gmm's ``rhs_bias: [num_groups, 1,
    n]``). Raises ArgumentError (shape) / DTypeError (dtype), naming ``rhs_bias``."""
    from ...errors import ArgumentError

    if not isinstance(rhs_bias, torch.Tensor) and not hasattr(rhs_bias, "shape"):
        raise ArgumentError(f"{where}: rhs_bias must be a torch.Tensor or None, got {type(rhs_bias).__name__}")
    if tuple(rhs_bias.shape) != (G, 1, N):
        raise ArgumentError(f"{where}: rhs_bias must have shape [G, 1, N] = [{G}, 1, {N}] (megablox gmm's layout: "
                            f"one bias row per local group), got {tuple(rhs_bias.shape)}")
    if dtype_name(rhs_bias.dtype) not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: rhs_bias dtype {dtype_name(rhs_bias.dtype)} is not one of {KERNEL_DTYPES}")


def bias_grad(dout: torch.Tensor, group_sizes: torch.Tensor, group_offset: torch.Tensor,
              rhs_bias: torch.Tensor) -> torch.Tensor:
    """``d_rhs_bias [G, 1, N]``: ``d_rhs_bias[g] = sum of dout [M, N] over the rows of local group g`` (the rows
    the forward added ``rhs_bias[g]`` to; rows of no local group contribute nothing), accumulated in float32 and
    returned in ``rhs_bias.dtype``. Group bounds as the kernels': sizes clamped at 0, ends at ``M``, the offset to
    ``[0, G_total - G]``. Plain torch ops (a segment sum, no data-dependent shapes)."""
    G, N = rhs_bias.shape[0], rhs_bias.shape[2]
    M, Gt = dout.shape[0], group_sizes.shape[0]
    ends = torch.cumsum(group_sizes.to(torch.int64).clamp_min(0), 0).clamp_max(M)
    off = group_offset.reshape(-1)[0].to(torch.int64).clamp(0, max(Gt - G, 0))
    gid = torch.searchsorted(ends, torch.arange(M, device=dout.device, dtype=torch.int64), right=True) - off
    gid = torch.where((gid >= 0) & (gid < G), gid, G)  # rows of no local group: a discarded extra row
    acc = torch.zeros(G + 1, N, dtype=torch.float32, device=dout.device).index_add_(0, gid, dout.float())
    return acc[:G].reshape(G, 1, N).to(rhs_bias.dtype)
