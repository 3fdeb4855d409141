"""cpu target: run the kernel in Pallas interpret mode on torch tensors shared with JAX through DLPack.

Inputs are shared zero-copy (``jax.dlpack.from_dlpack``) when contiguous; non-contiguous inputs are made
contiguous first (a copy, so the caller's tensor is never modified); outputs come back zero-copy with
``torch.from_dlpack``. Zero-size inputs are replaced by zero-size jax arrays (DLPack of empty storage is
not portable).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..dsl.kernel import TpuKernel
from ..dsl.modes import current_interpret_mode
from . import Plan, plan_for, signature_key


def to_jax(t):
    """torch CPU tensor -> jax array (zero-copy when contiguous and non-empty)."""
    import jax
    import jax.numpy as jnp

    if t.numel() == 0:
        from ..dsl.dtypes import to_jax_dtype

        return jnp.zeros(tuple(t.shape), to_jax_dtype(t.dtype))
    return jax.dlpack.from_dlpack(t.detach().contiguous())


def _pad_rows(t, n: int):
    import torch

    pad = t.new_zeros((n - t.shape[0], *t.shape[1:]))
    return torch.cat([t.detach(), pad], dim=0)


def run_plan_cpu(plan: Plan, values: Sequence):
    import torch

    low = plan.lowered
    if plan.runner is None:
        plan.runner = low.compiled()
    arrays = []
    for i in plan.tensor_idx:
        t = values[i]
        if i in plan.pad_idx:
            t = _pad_rows(t, plan.n_bucket)
        arrays.append(to_jax(t))
    outs = plan.runner(*arrays)
    res = [torch.from_dlpack(o) for o in outs]
    if plan.n_rows is not None:
        res = [r[: plan.n_rows].clone() for r in res]
    return res[0] if plan.single else tuple(res)


def run_torch_cpu(kernel: TpuKernel, values: Sequence, config_json: str | None):
    """Run ``kernel`` on CPU torch tensors in the current interpret mode (plans cached per signature)."""
    mode = current_interpret_mode()
    key = signature_key(values, config_json, mode)
    plan = kernel._plans.get(key)
    if plan is None:
        plan = plan_for(kernel, values, config_json, mode)
        kernel._plans[key] = plan
    return run_plan_cpu(plan, values)
