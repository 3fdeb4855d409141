"""tpu target: hand the Mosaic-lowered kernel to TorchTPU's Pallas runtime.

TorchTPU (``torch_tpu``, PrivateUse1 renamed ``"tpu"``) runs JAX functions on its tensors through
``torch_tpu._internal.pallas.pallas.JaxCallable`` (the mechanism behind ``torch.tpu.pallas.jax_op`` and
Helion's TPU launcher): it exports the jitted function for the TPU platform, which yields the
``tpu_custom_call`` carrying the serialized Mosaic module, and runs it on the tensors' buffers.

This module is the only place that touches torch_tpu. Its contract (what tests fake):

* ``JaxCallable(name=str, jit_fn=jax.jit(fn), trace_key=str, input_output_aliases=dict)`` is built once
  per (kernel, signature, config) and cached on the plan;
* it is called with the torch tensor arguments (row-padded when the kernel declares ``rows``) and
  returns a tensor or a list/tuple of tensors, one per kernel output;
* ``fn`` is the real Mosaic lowering (``interpret=False``), never an interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..chips import get_chip
from ..dsl.kernel import TpuKernel
from ..errors import BackendUnavailableError, ChipError
from . import Plan, plan_for, signature_key

INSTALL_HINT = "install TorchTPU on a TPU host: pip install 'tpukernels[tpu]'"


def jax_callable_class():
    """torch_tpu's ``JaxCallable`` class.

    Raises:
        BackendUnavailableError: torch_tpu is not installed.
    """
    try:
        from torch_tpu._internal.pallas.pallas import JaxCallable
    except ImportError as e:
        raise BackendUnavailableError(f"tpu tensors need torch_tpu ({e}); {INSTALL_HINT}") from e
    return JaxCallable


def live_chip():
    """The chip of the first TPU device jax sees, or None (then VMEM is checked by the compiler only)."""
    try:
        import jax

        return get_chip(jax.devices("tpu")[0].device_kind)
    except (RuntimeError, ChipError, IndexError):
        return None


def make_callable(plan: Plan):
    low = plan.lowered
    cls = jax_callable_class()
    shapes = "_".join("x".join(map(str, a.shape)) + a.dtype.name for a in low.arg_structs)
    return cls(
        name=low.kernel.name,
        jit_fn=low.fn,
        trace_key=f"tpukernels/{low.kernel.qualname}/{shapes}/{low.config.to_json()}",
        input_output_aliases=dict(low.input_output_aliases),
    )


def run_torch_tpu(kernel: TpuKernel, values: Sequence, config_json: str | None):
    """Run ``kernel`` on TorchTPU tensors (Mosaic lowering, VMEM checked against the live chip)."""
    import torch

    key = signature_key(values, config_json, "mosaic")
    plan = kernel._plans.get(key)
    if plan is None:
        plan = plan_for(kernel, values, config_json, "mosaic", chip=live_chip())
        plan.runner = make_callable(plan)
        kernel._plans[key] = plan
    tensors = []
    for i in plan.tensor_idx:
        t = values[i].contiguous()
        if i in plan.pad_idx:
            t = torch.cat([t, t.new_zeros((plan.n_bucket - t.shape[0], *t.shape[1:]))])
        tensors.append(t)
    out = plan.runner(*tensors)
    res = list(out) if isinstance(out, (list, tuple)) else [out]
    if plan.n_rows is not None:
        res = [r[: plan.n_rows].clone() if rows else r for r, rows in zip(res, plan.row_outs)]
    return res[0] if plan.single else tuple(res)
