"""tpu target: hand the Mosaic-lowered kernel to TorchTPU's Pallas runtime.

TorchTPU (``torch_tpu``, PrivateUse1 renamed ``"tpu"``) runs JAX functions on its tensors through
``torch_tpu._internal.pallas.pallas.JaxCallable`` (the mechanism behind ``torch.tpu.pallas.jax_op`` and
Helion's TPU launcher): it exports the jitted function for the TPU platform, which yields the
``tpu_custom_call`` carrying the serialized Mosaic module, and runs it on the tensors' buffers.

This module is the only place that touches torch_tpu. Its contract with torch-tpu 0.2.0's ``pallas.py``
(``tests/test_tpu_adapter.py`` runs it against that file from the wheel, native modules stubbed):

* ``JaxCallable(name=str, jit_fn=jax.jit(fn, keep_unused=True), trace_key=str[, donate_argnums=[...]])``
  is built once per (kernel, signature, config) and cached on the plan. ``keep_unused`` keeps every
  tensor a parameter of the exported module (an empty-grid kernel uses none of its inputs, and torch_tpu
  passes them all). The deprecated ``input_output_aliases`` argument is never passed.
* ``Launch(input_output_aliases={i: o})``: the op is functional (``mutates_args=()``, like the cpu
  target), so the aliased input is copied and the copy donated (``donate_argnums``): the output reuses
  the copy's buffer and the caller's tensor is never written.
* it is called with the torch tensor arguments (row-padded when the kernel declares ``rows``) and
  returns the outputs as ``fn`` returns them (a tuple, one tensor per kernel output);
* ``fn`` is the real Mosaic lowering (``interpret=False``), never an interpreter.
* The chip (for VMEM checks and the chip's tuning data) is read the way torch_tpu's Pallas mesh reads it:
  the device backend's ``device_kind``, else its PCI scan (``hardware.get_tpu_device_name``), else jax.
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


def _torch_tpu_device_kind() -> str | None:
    """The TPU ``device_kind`` torch_tpu reports (what its ``get_pallas_mesh`` puts on the mesh devices)."""
    try:
        from torch_tpu._internal.device import _device_ops_backend

        kind = _device_ops_backend._get_local_device_attributes().get("device_kind")
        if kind:
            return kind
    except (ImportError, AttributeError, RuntimeError):
        pass
    try:
        from torch_tpu._internal.utils import hardware

        kind = hardware.get_tpu_device_name()
        return None if kind == "TPU" else kind  # "TPU": unrecognized PCI id
    except (ImportError, AttributeError, OSError):
        return None


def live_chip():
    """The chip this TorchTPU process runs on, or None (then VMEM is checked by the compiler only).

    Read as torch_tpu reads it (its device backend's ``device_kind``, else its PCI scan), then from jax's
    TPU devices; jax in a TorchTPU process often sees no TPU, since torch_tpu owns the device.
    """
    kind = _torch_tpu_device_kind()
    if kind is None:
        try:
            import jax

            kind = jax.devices("tpu")[0].device_kind
        except (RuntimeError, IndexError):
            return None
    try:
        return get_chip(kind)
    except ChipError:
        return None


def make_callable(plan: Plan):
    low = plan.lowered
    cls = jax_callable_class()
    shapes = "_".join("x".join(map(str, a.shape)) + a.dtype.name for a in low.arg_structs)
    kw = {"donate_argnums": sorted(low.input_output_aliases)} if low.input_output_aliases else {}
    return cls(
        name=low.kernel.name,
        jit_fn=low.fn,
        trace_key=f"tpukernels/{low.kernel.qualname}/{shapes}/{low.config.to_json()}",
        **kw,
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
    donated = plan.lowered.input_output_aliases
    for pos, i in enumerate(plan.tensor_idx):
        v = values[i]
        t = v.contiguous()
        if i in plan.pad_idx:  # one allocation: zero rows after the data
            t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, plan.n_bucket - t.shape[0]))
        elif pos in donated and t.data_ptr() == v.data_ptr():
            t = t.clone()  # donated to the kernel's output: never the caller's buffer
        tensors.append(t)
    out = plan.runner(*tensors)
    res = list(out) if isinstance(out, (list, tuple)) else [out]
    if plan.n_rows is not None:
        res = [r[: plan.n_rows].clone() if rows else r for r, rows in zip(res, plan.row_outs)]
    return res[0] if plan.single else tuple(res)
