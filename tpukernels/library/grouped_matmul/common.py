"""dtype helpers of the grouped matmul: supported dtypes, dtype names, ``out_dtype`` canonicalisation,
block clamping. Package docstring: semantics, kernels, performance."""

from __future__ import annotations

import numpy as np
import torch

from ...errors import DTypeError

KERNEL_DTYPES = ("bfloat16", "float32")


def _dtype_name(dt) -> str:
    if isinstance(dt, torch.dtype):
        return str(dt).replace("torch.", "")
    return np.dtype(dt).name


def _clamp(dim: int, block: int) -> int:
    return dim if 0 < dim <= block else block


def canonical_out_dtype(out_dtype, where="grouped_matmul") -> str | None:
    """``None`` / torch dtype / name -> ``"bfloat16" | "float32"`` (or None). Raises DTypeError otherwise."""
    if out_dtype is None:
        return None
    name = out_dtype if isinstance(out_dtype, str) else _dtype_name(out_dtype)
    name = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32", "float": "float32"}.get(name, name)
    if name not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: out_dtype {out_dtype!r} is not supported; use one of {KERNEL_DTYPES}")
    return name



def _out_dtype(out_dtype, x):
    import jax.numpy as jnp

    return np.dtype(getattr(jnp, canonical_out_dtype(out_dtype) or _dtype_name(x.dtype)))

