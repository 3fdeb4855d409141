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

import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence
from typing import Any

from .._env import install_hint
from ..chips import get_chip
from ..dsl.kernel import TpuKernel
from ..errors import BackendUnavailableError, ChipError
from . import Plan, plan_for, signature_key
from .cpu import row_major

INSTALL_HINT = f"install TorchTPU on a TPU host, the tpu extra: {install_hint('tpu')}"


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


@dataclasses.dataclass(frozen=True)
class Partition:
    """A TorchTPU SPMD launch: the kernel runs per device under ``jax.shard_map`` over ``mesh``.

    Attributes:
        mesh: a ``jax.sharding.Mesh`` of the job's TPU devices (``torch.tpu.pallas.get_pallas_mesh(...)``).
        in_specs: one ``PartitionSpec`` (or tuple of axis names / None) per tensor argument passed, in order.
        out_specs: a list with one spec per output, or one spec for all; default: the first input's spec.
    """

    mesh: Any
    in_specs: tuple
    out_specs: Any = None


_PARTITION: "contextvars.ContextVar[Partition | None]" = contextvars.ContextVar("tpukernels_tpu_partition",
                                                                                default=None)


@contextlib.contextmanager
def partitioned(mesh, in_specs, out_specs=None):
    """Within this context, tpukernels ops on ``tpu`` tensors launch as one SPMD program over ``mesh``.

    Each rank passes its local shard (a plain TorchTPU tensor); the kernel is lowered for the local shapes
    and wrapped in ``jax.shard_map(..., in_specs, out_specs)``, and torch_tpu's ``JaxCallable`` receives
    ``mesh=``, ``input_partition_specs=`` and ``output_partition_specs=`` (its distributed-kernel API).
    Compile-only: ``compile_for(kernel, "v5e:2x2", ..., mesh_axes=..., in_specs=...)`` checks the same
    program without a TPU.

    Raises:
        ArgumentError: ``in_specs`` is not a sequence.
    """
    from jax.sharding import PartitionSpec

    from ..errors import ArgumentError

    if isinstance(in_specs, (str, PartitionSpec)) or not isinstance(in_specs, (list, tuple)):
        raise ArgumentError(f"partitioned: in_specs must be one PartitionSpec per tensor argument, got {in_specs!r}")
    as_spec = lambda s: s if isinstance(s, PartitionSpec) else PartitionSpec(*(s or ()))  # noqa: E731
    if out_specs is None or isinstance(out_specs, list):
        outs = None if out_specs is None else tuple(as_spec(o) for o in out_specs)
    else:
        outs = as_spec(out_specs)  # one spec for every output
    token = _PARTITION.set(Partition(mesh, tuple(as_spec(s) for s in in_specs), outs))
    try:
        yield
    finally:
        _PARTITION.reset(token)


def make_callable(plan: Plan, part: Partition | None = None):
    low = plan.lowered
    cls = jax_callable_class()
    shapes = "_".join("x".join(map(str, a.shape)) + a.dtype.name for a in low.arg_structs)
    kw = {"donate_argnums": sorted(low.input_output_aliases)} if low.input_output_aliases else {}
    fn, key = low.fn, f"tpukernels/{low.kernel.qualname}/{shapes}/{low.config.to_json()}"
    if part is not None:
        from . import shard_mapped

        fn, outs = shard_mapped(low, part.mesh, part.in_specs, part.out_specs)
        kw.update(mesh=part.mesh, input_partition_specs=part.in_specs, output_partition_specs=outs)
        key += f"/mesh{dict(part.mesh.shape)}/{part.in_specs}/{outs}"
    return cls(name=low.kernel.name, jit_fn=fn, trace_key=key, **kw)


def run_torch_tpu(kernel: TpuKernel, values: Sequence, config_json: str | None, donate_inputs: bool = False):
    """Run ``kernel`` on TorchTPU tensors (Mosaic lowering, VMEM checked against the live chip).

    ``donate_inputs``: the caller's own tensors are donated to the aliased outputs (an op that declares the
    mutation, e.g. ``update_kv_cache_``); by default they are cloned first (functional ops)."""
    import torch

    part = _PARTITION.get()
    key = signature_key(values, config_json, "mosaic")
    if part is not None:
        key = (*key, "spmd", id(part.mesh), part.in_specs, part.out_specs)
    plan = kernel._plans.get(key)
    if plan is None:
        plan = plan_for(kernel, values, config_json, "mosaic", chip=live_chip())
        plan.runner = make_callable(plan, part)
        kernel._plans[key] = plan
    tensors = []
    donated = plan.lowered.input_output_aliases
    for pos, i in enumerate(plan.tensor_idx):
        v = values[i]
        t = row_major(v, copy_only=True)  # torch-"contiguous" is not enough: size-1 dims' strides too
        if i in plan.pad_idx:  # one allocation: zero rows after the data
            t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, plan.n_bucket - t.shape[0]))
        elif pos in donated and t.data_ptr() == v.data_ptr() and not donate_inputs:
            t = t.clone()  # donated to the kernel's output: never the caller's buffer
        tensors.append(t)
    out = plan.runner(*tensors)
    res = list(out) if isinstance(out, (list, tuple)) else [out]
    if plan.n_rows is not None:
        res = [r[: plan.n_rows].clone() if rows else r for r, rows in zip(res, plan.row_outs)]
    return res[0] if plan.single else tuple(res)
