"""Targets a lowered kernel runs on: ``cpu`` (Pallas interpret), ``tpu`` (torch_tpu) and compile-only chips.

:func:`run_call` is what ``kernel(...)`` does: torch tensors go through the registered torch op (whose
cpu / PrivateUse1 kernels call :func:`tpukernels.targets.dispatch.run_torch`), jax arrays run the jitted JAX
function directly. The cpu and tpu targets (:mod:`.cpu`, :mod:`.tpu`) build on this module; it does not import them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..dsl.kernel import TpuKernel, bucket
from ..dsl.modes import current_interpret_mode, interpret_mode
from ..dsl.spec import TensorSpec, config_example, parse_config_json
from ..errors import ArgumentError, ConfigError, DeviceError
from ..lowering import Lowered, lower, specs_from_values


def run_call(kernel: TpuKernel, args: Sequence, kwargs: Mapping, *, config=None, interpret=None):
    """``kernel(*args, **kwargs)``: dispatch to the torch op or to the JAX path (the per-call hot path)."""
    values = kernel.bind(args, kwargs)
    if kernel.has_statics:
        kernel.check_statics(values)
    if interpret:
        torch = sys.modules.get("torch")
        if torch is not None and torch.compiler.is_compiling():
            raise ArgumentError(
                f"{kernel.qualname}: interpret={interpret!r} cannot be traced by torch.compile (it sets a "
                f"context variable); call the compiled function inside `with tpukernels.interpret_mode("
                f"{interpret!r}):` instead (the op reads the mode when it runs)")
        with interpret_mode(interpret):
            return _dispatch(kernel, values, config)
    return _dispatch(kernel, values, config)


def _dispatch(kernel: TpuKernel, values: list, config):
    if isinstance(config, str):
        config = parse_config_json(config, f"{kernel.qualname}: config", kernel)
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(v, torch.Tensor) for v in values):
        cfg = None if not config else config_to_json(kernel, config)
        if not kernel.has_keyword_only:
            return kernel.op(*values, config=cfg)
        pos = [v for p, v in zip(kernel.params, values) if not p.keyword_only]
        kw = {p.name: v for p, v in zip(kernel.params, values) if p.keyword_only}
        return kernel.op(*pos, **kw, config=cfg)
    return run_jax(kernel, values, config)


def config_to_json(kernel: TpuKernel, config: Mapping) -> str:
    """A config mapping (a dict or a :class:`~tpukernels.dsl.spec.Config`) as the ops' ``config=`` JSON string,
    keys sorted: the text ``json.dumps(dict(config), sort_keys=True)`` gives.

    Written out here rather than by ``json.dumps`` because this runs inside ``torch.compile`` traces of kernel
    calls, and Dynamo cannot trace the ``json`` module's C encoder (a ``config=`` dict broke
    ``fullgraph=True``); plain string operations trace.

    Raises:
        ConfigError: the config is not a mapping with str keys and JSON values (bool, int, float, str, None,
            tuples / lists of them); numpy scalars count as their Python values.
    """
    from ..dsl.spec import Config

    if isinstance(config, Config):
        items = config._items  # sorted; Dynamo traces a tuple more readily than the Mapping protocol
    elif isinstance(config, Mapping):
        items = sorted(config.items(), key=lambda kv: str(kv[0]))
    else:
        raise ConfigError(f"{kernel.qualname}: config must be a dict such as {config_example(kernel, False)}, got "
                          f"{type(config).__name__} {config!r}")
    parts = []
    for k, v in items:
        if not isinstance(k, str):
            raise ConfigError(f"{kernel.qualname}: config keys must be tunable names (str), got {k!r}")
        parts.append(_json_text(k) + ": " + _json_value(kernel, k, v))
    return "{" + ", ".join(parts) + "}"


def _json_text(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


def _json_value(kernel: TpuKernel, key: str, v) -> str:
    """One config value as JSON text (see :func:`config_to_json`)."""
    import numpy as np

    if isinstance(v, np.generic):
        v = v.item()
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            raise ConfigError(f"{kernel.qualname}: config[{key!r}] = {v!r} is not a finite number")
        return repr(v)
    if isinstance(v, str):
        if any(ord(c) < 32 and c not in "\n\t" for c in v):
            raise ConfigError(f"{kernel.qualname}: config[{key!r}] = {v!r} holds control characters")
        return _json_text(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_json_value(kernel, key, x) for x in v) + "]"
    raise ConfigError(f"{kernel.qualname}: config[{key!r}] = {v!r} ({type(v).__name__}) is not JSON-serializable: "
                      "use int, float, bool, str or a tuple of them")


def run_jax(kernel: TpuKernel, values: Sequence, config: Mapping | None):
    """Run on jax arrays or tracers (trace-safe): see :mod:`tpukernels.targets.jax_entry`."""
    from .jax_entry import run_jax as _run_jax

    return _run_jax(kernel, values, config)


def _tensor_values(kernel: TpuKernel, values: Sequence) -> list:
    return [v for p, v in zip(kernel.params, values) if p.kind != "static"]


class Plan:
    """A cached call plan for one (signature, config, mode): which args to pad, how to slice outputs."""

    __slots__ = ("lowered", "tensor_idx", "pad_idx", "n_rows", "n_bucket", "runner", "single", "row_outs")

    def __init__(self, lowered: Lowered, tensor_idx, pad_idx, n_rows, n_bucket, runner):
        self.lowered = lowered
        self.tensor_idx = tensor_idx
        self.pad_idx = pad_idx
        self.n_rows = n_rows
        self.n_bucket = n_bucket
        self.runner = runner
        self.single = not lowered.multiple_outputs
        # per output: does it carry the (bucketed) row axis? (OutSpec(rows=False): a reduction over rows)
        self.row_outs = lowered.out_rows


def plan_for(kernel: TpuKernel, values: Sequence, config_json: str | None, mode: str, chip=None) -> Plan:
    """Build the call plan for concrete torch ``values`` (bound op arguments)."""
    import torch

    config = None if not config_json else parse_config_json(config_json, f"{kernel.qualname}: config", kernel)
    tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    check_devices(kernel, tensors)
    specs, statics = specs_from_values(kernel, values)
    kernel.check_shapes(specs)  # on the caller's shapes (errors name them), before rows are bucketed
    pad_idx, n_rows, n_bucket = (), None, None
    bucketed = bucket_specs(kernel, specs)
    if bucketed != specs:
        n_rows = next(int(s.shape[0]) for s in specs if s is not None and s.name in kernel.rows and s.shape)
        n_bucket = bucket(n_rows)
        names = [p.name for p in kernel.params]
        pad_idx = tuple(names.index(s.name) for s in specs if s is not None and s.name in kernel.rows and s.shape)
        specs = bucketed
    low = lower(kernel, specs, statics, config, mode=mode, chip=chip)
    if n_rows is not None:
        for o, has_rows in zip(low.out_structs, low.out_rows):
            if not has_rows:
                continue
            if not o.shape or o.shape[0] != n_bucket:
                raise ArgumentError(
                    f"{kernel.qualname}: rows= declares a row axis but output shape {o.shape} does not start with the "
                    f"(bucketed) row count {n_bucket}"
                )
    tensor_idx = tuple(i for i, _ in tensors)
    return Plan(low, tensor_idx, pad_idx, n_rows, n_bucket, None)


def shard_mapped(low: Lowered, mesh, in_specs: Sequence, out_specs=None):
    """``(jitted fn, out_specs)``: ``low.fn`` (one device's kernel on its local shapes) under
    ``jax.shard_map`` over ``mesh`` — one SPMD program, used by the tpu target's ``partitioned()`` and by
    multi-chip ``compile_for``.

    Args:
        low: the per-device lowering (its ``arg_structs`` are the local shard shapes).
        mesh: a ``jax.sharding.Mesh``.
        in_specs: one ``PartitionSpec`` per tensor argument, in parameter order.
        out_specs: one ``PartitionSpec`` per output, one for all outputs, or None (every output partitioned
            like the first input).

    Raises:
        ArgumentError: the number of ``in_specs`` differs from the kernel's tensor arguments.
    """
    import jax

    if len(in_specs) != len(low.arg_structs):
        raise ArgumentError(f"{low.kernel.qualname}: {len(in_specs)} partition specs for "
                            f"{len(low.arg_structs)} tensor arguments")
    if out_specs is None:
        first = in_specs[0] if in_specs else jax.sharding.PartitionSpec()
        out_specs = tuple(first for _ in low.out_structs)
    elif isinstance(out_specs, jax.sharding.PartitionSpec):
        out_specs = tuple(out_specs for _ in low.out_structs)
    out_specs = tuple(out_specs)  # low.fn returns a tuple of outputs
    fn = jax.shard_map(low.fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)
    return jax.jit(fn, keep_unused=True), out_specs


def check_devices(kernel: TpuKernel, tensors) -> None:
    """All tensor arguments on one device (type and index).

    Raises:
        DeviceError: naming each argument's device, e.g. a cpu tensor beside a ``meta`` one (torch would
            dispatch that call to the fake kernel and hand back uninitialized memory).
    """
    devs = {(t.device.type, t.device.index) for _, t in tensors}
    if len(devs) > 1:
        names = [p.name for p in kernel.params]
        where = ", ".join(f"{names[i]} on {t.device}" for i, t in tensors)
        raise DeviceError(f"{kernel.qualname}: tensor arguments must share one device, got {where}")


def bucket_specs(kernel: TpuKernel, specs: tuple) -> tuple:
    """Pad the row axis of the kernel's ``rows`` tensors to :func:`bucket` size (specs only).

    Raises:
        ArgumentError: the row tensors disagree on their dim-0 size.
    """
    if not kernel.rows:
        return specs
    rows = [s for s in specs if s is not None and s.name in kernel.rows and len(s.shape) > 0]
    counts = {int(s.shape[0]) for s in rows}
    if len(counts) > 1:
        raise ArgumentError(f"{kernel.qualname}: row tensors {list(kernel.rows)} disagree on dim 0: {sorted(counts)}")
    if not counts or (n := counts.pop()) == 0 or bucket(n) == n:
        return specs
    nb = bucket(n)
    return tuple(s if s not in rows else TensorSpec((nb, *s.shape[1:]), s.dtype, s.name) for s in specs)


def signature_key(values: Sequence, config_json, mode) -> tuple:
    """Hashable per-call key: shapes/dtypes of tensors, static values, config, mode."""
    return (mode, config_json, *[(v.shape, v.dtype) if hasattr(v, "dtype") else v for v in values])


def _install_entry_point() -> None:
    """``TpuKernel.__call__`` calls :func:`run_call` through a module global set once here, at import (a
    global that changed on the first call would be a torch.compile guard failure, i.e. a recompile)."""
    from ..dsl import kernel as _kernel

    _kernel._RUN_CALL = run_call


_install_entry_point()
