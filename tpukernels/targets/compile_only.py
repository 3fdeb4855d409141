"""compile-only target: lower and compile a kernel for a TPU generation you do not have.

With the ``libtpu`` wheel installed (the ``aot`` extra: ``pip install -e '.[aot]'`` in a checkout), jax's
``topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu")`` yields TPU devices that can be
compiled for but not run on. :func:`compile_for` runs the real Mosaic and XLA:TPU compilers for one chip
and reports VMEM overflows and layout errors exactly as a TPU host would, translated into tpukernels
terms. Optionally it asks libtpu for its static cost model (``estimated_cycles``; a *model*, not a
measurement) in a subprocess, because the flag that enables it is read once when libtpu loads.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..chips import Chip, MiB, get_chip
from ..dsl.kernel import TpuKernel
from ..dsl.spec import TensorSpec
from .._env import install_hint
from ..errors import (BackendUnavailableError, BlockShapeError, KernelBodyError, LoweringError, TpuKernelError,
                      UnwrittenOutputError, VmemError)
from ..lowering import lower, specs_from_values

AOT_HINT = f"compile-only needs libtpu (0.0.52 matches jax 0.10.2); install the aot extra: {install_hint('aot')}"

_DTYPES = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32", "f16": "float16", "fp16": "float16",
           "i32": "int32", "i8": "int8", "u8": "uint8", "bool": "bool"}


@dataclasses.dataclass
class CompileResult:
    """What :func:`compile_for` found for one kernel on one chip.

    Attributes:
        kernel, chip: what was compiled, for which chip name.
        ok: True when Mosaic and XLA:TPU both compiled it.
        error_kind: None, or ``"vmem"``, ``"block_shape"``, ``"lowering"``, ``"compile"``, ``"body"``, ...
        error: human-readable reason (translated: e.g. VMEM used vs capacity in MiB).
        config: the tuning config compiled; config_source: where it came from.
        vmem_estimate_bytes: tpukernels' VMEM footprint estimate (blocks x buffers + scratch), bytes.
        vmem_limit_bytes: the scoped VMEM limit in force (kernel's or the chip default), bytes.
        vmem_capacity_bytes: the chip's VMEM per TensorCore (jax tpu_info), bytes.
        code_size_bytes: generated code size reported by XLA, bytes.
        mosaic_mlir: the Mosaic MLIR module text (what torch_tpu hands to the TPU runtime, deserialized).
        estimated_cycles: libtpu's static estimate for the kernel (opt-in; a model, not a measurement).
        estimate_error: why ``estimated_cycles`` is None although it was asked for (libtpu's static profiler
            aborted or timed out; the compile itself is unaffected), else None.
        compile_seconds: wall-clock seconds spent lowering + compiling here.
    """

    kernel: str
    chip: str
    ok: bool
    error_kind: str | None = None
    error: str | None = None
    config: dict | None = None
    config_source: str | None = None
    vmem_estimate_bytes: int | None = None
    vmem_limit_bytes: int | None = None
    vmem_capacity_bytes: int | None = None
    code_size_bytes: int | None = None
    mosaic_mlir: str | None = None
    estimated_cycles: int | None = None
    estimate_error: str | None = None
    compile_seconds: float = 0.0
    shapes: list = dataclasses.field(default_factory=list)
    #: multi-chip compiles (``mesh_axes=``): the topology, its device count, the mesh and each device's shapes;
    #: VMEM, code size and cycles above are then per device (the kernel runs once per device on its shard)
    topology: str | None = None
    devices: int = 1
    mesh_axes: dict | None = None
    local_shapes: list | None = None

    def to_dict(self, with_mlir: bool = False) -> dict:
        d = dataclasses.asdict(self)
        if not with_mlir:
            d.pop("mosaic_mlir")
        return d

    def summary(self) -> str:
        if not self.ok:
            return f"{self.kernel} on {self.chip}: FAILED ({self.error_kind}) {self.error}"
        scoped = "" if self.vmem_limit_bytes is None else f" of {self.vmem_limit_bytes / MiB:.0f} MiB scoped"
        if self.vmem_estimate_bytes is not None:
            vmem = f"VMEM {self.vmem_estimate_bytes / MiB:.2f} MiB (est.){scoped}"
        else:  # Helion kernels: Helion lays out the blocks; tpukernels has no footprint of its own to show
            vmem = f"VMEM not estimated (a Helion kernel lays out its own blocks){scoped}"
        text = f"{self.kernel} on {self.chip}: ok, {vmem}, code {self.code_size_bytes} B"
        if self.estimated_cycles is not None:
            from ..perf import clock_hz

            us = self.estimated_cycles / clock_hz(self.chip) * 1e6
            text += f", {self.estimated_cycles:,} cycles (~{us:,.1f} us; libtpu static estimate, a model)"
        elif self.estimate_error:
            text += f", no cycle estimate ({self.estimate_error})"
        return text


def require_libtpu() -> None:
    """Raise :class:`BackendUnavailableError` with install instructions if libtpu is missing."""
    if importlib.util.find_spec("libtpu") is None:
        raise BackendUnavailableError(AOT_HINT)


from .._env import COMPILE_ONLY_ENV  # noqa: E402  (the environment for compile-only libtpu use)


def compile_only_env(env=None) -> dict:
    """Apply :data:`COMPILE_ONLY_ENV` as defaults to ``env`` (default: ``os.environ``); returns it."""
    env = os.environ if env is None else env
    for k, v in COMPILE_ONLY_ENV.items():
        env.setdefault(k, v)
    return env


@functools.lru_cache(maxsize=None)
def tpu_device(chip_name: str):
    """A compile-only TPU device for ``chip_name`` (one chip's topology)."""
    require_libtpu()
    compile_only_env()
    from jax.experimental import topologies

    chip = get_chip(chip_name)
    topo = topologies.get_topology_desc(topology_name=chip.topology, platform="tpu")
    return topo.devices[0]


def parse_shape(text: str) -> TensorSpec:
    """``"1024x1024:bf16"`` -> TensorSpec; dims separated by x, dtype after a colon (default f32).

    Raises:
        ArgumentError: malformed text or unknown dtype.
    """
    from ..errors import ArgumentError

    shape_s, _, dt = text.strip().partition(":")
    name = _DTYPES.get(dt or "f32", dt or "float32")
    try:
        shape = tuple(int(d) for d in shape_s.lower().split("x")) if shape_s not in ("", "scalar") else ()
    except ValueError:
        raise ArgumentError(f"shape {text!r}: dims must be integers separated by 'x', e.g. 1024x1024:bf16") from None
    if name in ("float64", "f64", "fp64", "double", "int64", "i64"):
        raise ArgumentError(f"shape {text!r}: dtype {dt!r}: TPU kernels take no 64-bit dtypes; use "
                            f"{'f32' if 'f' in name or 'double' in name else 'i32'}")
    try:
        import jax.numpy as jnp

        dtype = np.dtype(getattr(jnp, name))
    except (AttributeError, TypeError):
        raise ArgumentError(f"shape {text!r}: unknown dtype {dt!r}; use one of {', '.join(_DTYPES)} or a jnp "
                            f"dtype name (bfloat16, float8_e4m3fn, ...)") from None
    return TensorSpec(shape, dtype)


def _as_spec(a):
    if isinstance(a, str):
        return parse_shape(a)
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], tuple):
        return TensorSpec(a[0], np.dtype(a[1]))
    return a


def example_specs(kernel: TpuKernel, args, kwargs) -> tuple[tuple, tuple]:
    """Bind example arguments; tensor parameters accept shape strings (``"8x128:bf16"``) and
    ``(shape, dtype)`` tuples, static parameters keep their values (strings stay strings)."""
    values = kernel.bind(list(args), dict(kwargs))
    values = [v if p.kind == "static" else _as_spec(v) for p, v in zip(kernel.params, values)]
    return specs_from_values(kernel, values)


def mosaic_module_text(lowered) -> str | None:
    """Deserialize the Mosaic module(s) inside a lowered function's ``tpu_custom_call`` ops to MLIR text."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir, passmanager

    bodies = []

    def walk(op):
        op = op.operation if hasattr(op, "operation") else op
        if op.name == "stablehlo.custom_call":
            if ir.StringAttr(op.attributes["call_target_name"]).value == "tpu_custom_call":
                bodies.append(ir.StringAttr(op.attributes["backend_config"]).value)
        for r in op.regions:
            for b in r.blocks:
                for o in b.operations:
                    walk(o)

    walk(lowered.compiler_ir("stablehlo").operation)
    texts = []
    for cfg in bodies:
        body = base64.b64decode(json.loads(cfg)["custom_call_config"]["body"])
        ctx = jmlir.make_ir_context()
        tpu.register_dialect(ctx)
        with ctx, ir.Location.unknown():
            ctx.allow_unregistered_dialects = True
            m = ir.Module.parse(body)
            passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(m.operation)
            texts.append(str(m))
    return "\n".join(texts) if texts else None


_VMEM_PATTERNS = [
    re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)"),
    re.compile(r"[Rr]an out of memory in memory space vmem.*?(?:[Uu]sed|requested)?\s*([\d.]+)([KMG])"),
]


def translate_error(e: BaseException, chip: Chip, limit: int) -> tuple[str, str]:
    """Map a Mosaic / XLA:TPU error to ``(kind, message)`` in tpukernels terms."""
    msg = str(e)
    m = _VMEM_PATTERNS[0].search(msg)
    if m:
        need, cap = int(m.group(1)), int(m.group(2))
        return "vmem", f"VMEM overflow: one allocation needs {need / MiB:.2f} MiB > {cap / MiB:.0f} MiB on {chip.name}"
    if "ScopedVmemOom" in msg or "out of memory in memory space vmem" in msg:
        return "vmem", (
            f"VMEM overflow: the kernel needs more than its scoped limit {limit / MiB:.0f} MiB on {chip.name} "
            f"(capacity {chip.vmem_capacity_bytes / MiB:.0f} MiB); raise vmem_limit_bytes or use smaller blocks"
        )
    if "divisible by 8 and 128" in msg or "rank 1 block" in msg:
        return "block_shape", msg.splitlines()[0]
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()] or [msg]
    # libtpu's own log prefixes (``F1203 12:00:00.000 ... ] Check failed``) and status codes: keep the text
    # after them, say which chip's compiler failed, and how to look closer
    cleaned = [re.sub(r"^[FEWI]\d{4} [\d:.]+\s+\d+\s+\S+\]\s*", "", ln) for ln in lines]
    detail = next((ln for ln in cleaned if "index_map" in ln or "index map" in ln), cleaned[0])
    if any(k in msg for k in ("Check failed", "INTERNAL", "libtpu", "Mosaic failed", "LLVM ERROR")):
        return "compile", (f"libtpu's compiler failed on {chip.name}: {detail} (hint: run the kernel on cpu with "
                           f"interpret='tpu' to check its blocks and indices, and `tpukernels compile ... --mlir PREFIX` "
                           f"to see the Mosaic it was given)")
    return "compile", f"{type(e).__name__}: {detail[:2000]}"


#: what a keyword argument of a public function must look like to be read as a shape (see ``kernel_calls``)
_SHAPE_TEXT = re.compile(r"^(?:scalar|\d+(?:x\d+)*)(?::\w+)?$|^:\w+$", re.IGNORECASE)


def _meta_tensor(a):
    import torch

    from ..dsl.dtypes import to_torch_dtype

    if isinstance(a, torch.Tensor):
        return a.to("meta")
    spec = _as_spec(a)
    if hasattr(spec, "shape") and hasattr(spec, "dtype"):
        return torch.empty(tuple(int(d) for d in spec.shape), dtype=to_torch_dtype(spec.dtype), device="meta")
    return a


def kernel_calls(fn, args, kwargs) -> list[tuple]:
    """The kernel calls behind a public function or torch op, found by running it on ``meta`` tensors.

    Returns ``[(kernel, args, kwargs, config), ...]`` with :class:`TensorSpec` for the tensor arguments.

    Raises:
        ArgumentError: ``fn`` is not callable, calls no tpukernels kernel, or cannot run on shapes alone
            (e.g. it reads tensor values on the host).
    """
    import torch

    from ..dsl.dtypes import to_jax_dtype
    from ..errors import ArgumentError
    from ..dsl.hooks import KERNEL_CALLS

    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if not callable(fn):
        raise ArgumentError(f"compile_for: expected a tpu_kernel, a public function or a torch op, got {fn!r}")
    targs = [_meta_tensor(a) for a in args]
    # keyword strings are shapes only when they read as one ("64x256:bf16", "scalar:i32"); others are the
    # function's own options (x_quant="int8", activation="silu", casting="gemma") and pass through
    tkw = {k: v if isinstance(v, str) and not _SHAPE_TEXT.match(v.strip()) else _meta_tensor(v)
           for k, v in kwargs.items()}
    calls: list = []
    token = KERNEL_CALLS.set(calls)
    try:
        fn(*targs, **tkw)
    except TpuKernelError:
        raise
    except Exception as e:
        raise ArgumentError(
            f"compile_for: {name} could not run on shapes alone ({type(e).__name__}: {str(e)[:200]}); pass one of "
            f"its kernels instead (see `tpukernels list`)") from e
    finally:
        KERNEL_CALLS.reset(token)
    if not calls:
        raise ArgumentError(f"compile_for: {name} called no tpukernels kernel")
    out = []
    for kernel, values, config_json in calls:
        vals = [TensorSpec(tuple(v.shape), np.dtype(to_jax_dtype(v.dtype))) if isinstance(v, torch.Tensor) else v
                for v in values]
        pos = [v for p, v in zip(kernel.params, vals) if not p.keyword_only]
        kw = {p.name: v for p, v in zip(kernel.params, vals) if p.keyword_only}
        out.append((kernel, pos, kw, json.loads(config_json) if config_json else None))
    return out


def compile_for(
    kernel: TpuKernel,
    chip: "str | Chip",
    *args: Any,
    config: dict | None = None,
    estimate_cycles: bool = False,
    with_mlir: bool = True,
    mesh_axes: "dict | Sequence | None" = None,
    in_specs: "dict | Sequence | None" = None,
    out_specs: Any = None,
    **kwargs: Any,
) -> CompileResult:
    """Lower and compile ``kernel`` for ``chip`` without a TPU.

    Args:
        kernel: a :class:`TpuKernel`, or a public function / torch op that calls kernels
            (``tpukernels.library.flash_attention``, ``torch.ops.tpukernels.matmul``): it is run on ``meta``
            tensors of the given shapes and each kernel it calls is compiled with the arguments it got.
        chip: ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"`` or ``"tpu7x"`` (or a topology name like ``"v6e:1x1"``).
        *args: example arguments: torch tensors, jax arrays, ``jax.ShapeDtypeStruct``, :class:`TensorSpec`,
            ``((shape), dtype)`` tuples or strings like ``"8192x4096:bf16"``; static args as values.
        config: explicit tuning config (partial ok); default: dispatch order (DB, heuristic, defaults).
        estimate_cycles: also run libtpu's static cost model (slow: a subprocess and a second compile).
        mesh_axes: multi-chip (a :class:`TpuKernel` only): ``{"axis": size, ...}`` (ordered) over every device
            of the topology named in ``chip`` (``"v5e:2x2"``, ``"v6e:2x2"``, ``"tpu7x:2x2x1"``: 4, 4 and 8
            devices; the sizes must multiply to that count). The kernel is compiled under ``jax.shard_map`` on
            that mesh: the example arguments are *global* shapes, each device runs the kernel on its shard,
            and the VMEM, code size and cycles reported are per device.
        in_specs: with ``mesh_axes``: a ``jax.sharding.PartitionSpec`` per tensor argument, as
            ``{name: spec}`` or a sequence in parameter order (missing / None: replicated). Every sharded
            dim must divide evenly.
        out_specs: with ``mesh_axes``: the outputs' PartitionSpecs for ``shard_map`` (default: the first
            tensor argument's spec for every output); they do not change the per-device kernel.
        **kwargs: keyword arguments of the kernel (static parameters, keyword-only tensors). For a public
            function, a string is a shape only when it reads as one (``"64x256:bf16"``, ``"scalar:i32"``);
            any other string (``x_quant="int8"``, ``activation="silu"``) is passed to the function as is.

    Returns:
        A :class:`CompileResult`; compile failures (VMEM, block rules, Mosaic errors) are reported in it.
        For a public function that calls several kernels, a list of them, in call order.

    Raises:
        ChipError: unknown chip name.
        BackendUnavailableError: libtpu is not installed (message says how to install the ``aot`` extra).
        ArgumentError, DTypeError: bad arguments (wrong count, float64, ...; with ``mesh_axes``: a mesh
            that does not cover the topology, a spec naming an unknown axis or a dim that does not divide).
    """
    import jax

    topology = chip.split(":", 1)[1] if isinstance(chip, str) and ":" in chip else None
    chip = get_chip(chip)
    require_libtpu()
    if mesh_axes is not None and not isinstance(kernel, TpuKernel):
        from ..errors import ArgumentError

        raise ArgumentError("compile_for: mesh_axes= compiles one kernel under shard_map; pass the kernel "
                            "(see `tpukernels list`), not a public function")
    if not isinstance(kernel, TpuKernel):  # a public function or torch op: compile the kernels it calls
        results = [compile_for(k, chip, *a, config=config or c, estimate_cycles=estimate_cycles, with_mlir=with_mlir,
                               **kw) for k, a, kw, c in kernel_calls(kernel, args, kwargs)]
        return results[0] if len(results) == 1 else results
    from . import bucket_specs

    specs, statics = example_specs(kernel, args, kwargs)
    shapes = [None if s is None else f"{'x'.join(map(str, s.shape))}:{np.dtype(s.dtype).name}" for s in specs]
    multi = None
    if mesh_axes is not None:
        multi = _shard_plan(kernel, chip, topology, specs, mesh_axes, in_specs)
        specs = multi["local_specs"]
    specs = bucket_specs(kernel, specs)
    res = CompileResult(kernel.qualname, chip.name, ok=False, vmem_capacity_bytes=chip.vmem_capacity_bytes)
    res.shapes = shapes if multi is not None else [
        None if s is None else f"{'x'.join(map(str, s.shape))}:{np.dtype(s.dtype).name}" for s in specs]
    if multi is not None:
        res.topology, res.devices, res.mesh_axes = multi["topology"], multi["devices"], multi["axes"]
        res.local_shapes = [None if s is None else f"{'x'.join(map(str, s.shape))}:{np.dtype(s.dtype).name}"
                            for s in specs]
    t0 = time.perf_counter()
    try:
        low = lower(kernel, specs, statics, config, mode="mosaic", chip=chip)
    except (VmemError, BlockShapeError, KernelBodyError, LoweringError) as e:
        res.error_kind = next(v for k, v in ((UnwrittenOutputError, "unwritten_output"), (VmemError, "vmem"),
                                             (BlockShapeError, "block_shape"), (KernelBodyError, "body"),
                                             (LoweringError, "lowering")) if isinstance(e, k))
        res.error = str(e)
        res.vmem_estimate_bytes, res.vmem_limit_bytes = getattr(e, "estimate_bytes", None), getattr(e, "limit_bytes", None)
        try:  # the config that failed, for sweeps that read the result
            from ..lowering import resolve

            r = resolve(kernel, specs, statics, config, chip)
            res.config, res.config_source = dict(r.config), r.source
        except Exception:  # noqa: BLE001  (the launch itself raised: no config to report beyond the error)
            pass
        res.compile_seconds = time.perf_counter() - t0
        return res
    res.config, res.config_source = dict(low.config), low.resolved.source
    # Helion kernels build their own BlockSpecs: no tpukernels estimate (the compiler still checks VMEM)
    res.vmem_estimate_bytes = low.vmem.total_bytes if low.resolved.launch is not None else None
    launch = low.resolved.launch
    limit = (launch.vmem_limit_bytes if launch is not None else None) or chip.default_scoped_vmem_bytes
    res.vmem_limit_bytes = limit
    dev = tpu_device(chip.name)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in low.arg_structs]
    fn = low.fn
    if multi is not None:  # the same per-device kernel, under shard_map on the topology's mesh
        fn, structs, dev = _under_shard_map(low, multi, out_specs)
    try:
        with jax.default_device(dev):
            lowered = fn.lower(*structs)
            if with_mlir:
                res.mosaic_mlir = mosaic_module_text(lowered)
            compiled = lowered.compile()
        res.code_size_bytes = int(compiled.memory_analysis().generated_code_size_in_bytes)
        res.ok = True
    except TpuKernelError as e:
        res.error_kind, res.error = "body", str(e)
    except Exception as e:  # Mosaic / XLA errors: reported, never raised (a sweep must go on)
        res.error_kind, res.error = translate_error(e, chip, limit)
        f16 = [i for i, a in enumerate(low.arg_structs) if np.dtype(a.dtype) == np.float16]
        if res.error_kind == "compile" and f16:
            res.error += (f" -- likely cause: float16 operands (arrays {f16}): Mosaic rejects float16 kernel "
                          "operands on some TPU generations; cast to bfloat16, or to float32 and compute there (as the "
                          "library's norms, matmul and attention do)")
    res.compile_seconds = time.perf_counter() - t0
    if res.ok and estimate_cycles:
        try:
            res.estimated_cycles = static_estimated_cycles(low, chip)
        except (LoweringError, subprocess.TimeoutExpired) as e:  # the profiler, not the kernel: keep the compile
            res.estimate_error = str(e)
        else:
            if res.estimated_cycles is None:
                res.estimate_error = "libtpu wrote no static profile"
    return res


def _shard_plan(kernel, chip: Chip, topology: str | None, specs, mesh_axes, in_specs) -> dict:
    """Check a multi-chip request and compute each device's argument shapes (see :func:`compile_for`)."""
    from jax.sharding import PartitionSpec

    from ..errors import ArgumentError

    axes = dict(mesh_axes.items() if isinstance(mesh_axes, dict) else mesh_axes)
    if not axes or not all(isinstance(n, str) and isinstance(v, int) and v >= 1 for n, v in axes.items()):
        raise ArgumentError(f"compile_for: mesh_axes must map axis names to sizes >= 1, got {mesh_axes!r}")
    topo = f"{chip.name}:{topology}" if topology else chip.topology
    devices = _topology_devices(topo)
    n_mesh = int(np.prod(list(axes.values())))
    if n_mesh != len(devices):
        hint = (f"the mesh_axes sizes must multiply to {len(devices)}" if len(devices) > 1 else
                f"name a multi-chip topology such as '{chip.name}:2x2'" if chip.name != "tpu7x" else
                "name a multi-chip topology such as 'tpu7x:2x2x1'")
        raise ArgumentError(f"compile_for: mesh_axes {axes} spans {n_mesh} devices but topology {topo} has "
                            f"{len(devices)} ({hint})")
    tensors = [p for p in kernel.params if p.kind != "static"]
    if isinstance(in_specs, dict):
        unknown = set(in_specs) - {p.name for p in tensors}
        if unknown:
            raise ArgumentError(f"compile_for: in_specs names {sorted(unknown)}, not tensor arguments of "
                                f"{kernel.qualname}")
        per = {p.name: in_specs.get(p.name) for p in tensors}
    else:
        seq = list(in_specs or ())
        if len(seq) > len(tensors):
            raise ArgumentError(f"compile_for: {len(seq)} in_specs for {len(tensors)} tensor arguments")
        per = {p.name: (seq[i] if i < len(seq) else None) for i, p in enumerate(tensors)}
    local, parts = [], {}
    for p, s in zip(kernel.params, specs):
        if p.kind == "static" or s is None:
            local.append(s)
            continue
        spec = per[p.name] if per[p.name] is not None else PartitionSpec()
        if len(spec) > len(s.shape):
            raise ArgumentError(f"compile_for: in_specs[{p.name!r}] {spec} has more entries than {p.name}'s "
                                f"rank {len(s.shape)}")
        shape = list(s.shape)
        for d, entry in enumerate(spec):
            names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            unknown = [n for n in names if n not in axes]
            if unknown:
                raise ArgumentError(f"compile_for: in_specs[{p.name!r}] names mesh axis {unknown[0]!r}; "
                                    f"mesh_axes has {list(axes)}")
            k = int(np.prod([axes[n] for n in names])) if names else 1
            if shape[d] % k:
                raise ArgumentError(f"compile_for: {p.name} dim {d} ({shape[d]}) does not divide into {k} shards "
                                    f"over mesh axes {names}")
            shape[d] //= k
        local.append(TensorSpec(tuple(shape), s.dtype, s.name))
        parts[p.name] = spec
    return {"topology": topo, "devices": len(devices), "device_list": devices, "axes": axes,
            "local_specs": tuple(local), "parts": parts}


@functools.lru_cache(maxsize=None)
def _topology_devices(topology_name: str) -> tuple:
    """Every compile-only device of a (multi-chip) topology such as ``"v5e:2x2"``."""
    compile_only_env()
    from jax.experimental import topologies

    return tuple(topologies.get_topology_desc(topology_name=topology_name, platform="tpu").devices)


def _under_shard_map(low, multi: dict, out_specs):
    """``low.fn`` (one device's kernel) under ``jax.shard_map`` on the topology's mesh, with global structs."""
    import jax
    from jax.sharding import Mesh, NamedSharding

    from . import shard_mapped

    axes = multi["axes"]
    mesh = Mesh(np.asarray(multi["device_list"], dtype=object).reshape(tuple(axes.values())), tuple(axes))
    specs_in = list(multi["parts"].values())  # the present tensor arguments, in parameter order
    structs = []
    for a, spec in zip(low.arg_structs, specs_in):
        shape = list(a.shape)
        for d, entry in enumerate(spec):
            group = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            shape[d] *= int(np.prod([axes[n] for n in group])) if group else 1
        structs.append(jax.ShapeDtypeStruct(tuple(shape), a.dtype, sharding=NamedSharding(mesh, spec)))
    fn, _ = shard_mapped(low, mesh, specs_in, out_specs)
    return fn, structs, multi["device_list"][0]


def static_estimated_cycles(low, chip: Chip, timeout_s: float = 600) -> int | None:
    """libtpu's static ``estimated_cycles`` for a lowered kernel on ``chip`` (a model, not a measurement)."""
    return estimate_cycles_of(low.fn, chip, low.arg_structs, timeout_s)


def export_for_chip(fn, chip: "str | Chip", structs):
    """``jax.export.export(fn, platforms=["tpu"])(*structs)`` for ``chip``, from any host.

    A kernel that asks jax for the TPU generation while tracing (``pltpu.get_tpu_info()``: Pallas does for
    rank-1 blocks, Helion for its tiling) fails with "Unsupported TPU device kind: cpu" where jax's default
    device is a cpu; such kernels are traced again inside :meth:`Chip.trace_target`. Every other program
    is exported as it is (so its text, and the estimate cache's key, do not depend on this function).

    Args:
        fn: a jitted function; chip: a :class:`Chip` or its name; structs: ``jax.ShapeDtypeStruct`` (or
            arrays) per argument; shardings are dropped.
    Returns:
        ``jax.export.Exported``.
    """
    import jax

    target = get_chip(chip)
    plain = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in structs]
    try:
        return jax.export.export(fn, platforms=["tpu"])(*plain)
    except ValueError as e:
        if "Unsupported TPU device kind" not in str(e):
            raise
    with target.trace_target():
        return jax.export.export(fn, platforms=["tpu"])(*plain)


def estimate_cycles_of(fn, chip: "str | Chip", structs, timeout_s: float = 600) -> int | None:
    """libtpu's static ``estimated_cycles`` of any jitted JAX function (a kernel or XLA's own ops).

    Exports ``fn`` for the TPU platform with ``jax.export`` and compiles it again in a subprocess started
    with ``LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR`` (libtpu reads the flag once, when it
    loads); sums ``estimated_cycles`` over the dumped per-op profiles. Deterministic for a given
    libtpu; slow on big grids. Returns None if libtpu wrote no profile.

    Args:
        fn: a jitted function; structs: ``jax.ShapeDtypeStruct`` per argument (no sharding needed).
    """
    import jax

    chip = get_chip(chip)
    require_libtpu()
    exported = export_for_chip(fn, chip, structs)
    with tempfile.TemporaryDirectory(prefix="tpk_llo_") as d:
        blob = os.path.join(d, "fn.bin")
        with open(blob, "wb") as f:
            f.write(exported.serialize())
        env = compile_only_env(dict(os.environ))
        env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + f" --xla_jf_dump_static_llo_profile_to={d}/llo").strip()
        env["JAX_PLATFORMS"] = "cpu"
        proc = subprocess.run(
            [sys.executable, "-m", "tpukernels.targets.compile_only", blob, chip.name],
            env=env, timeout=timeout_s, capture_output=True, text=True,
        )
        if proc.returncode != 0:
            from ..errors import LoweringError

            tail = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()][-3:]
            raise LoweringError(f"libtpu's static estimate on {chip.name} failed (exit {proc.returncode}): "
                                f"{' | '.join(tail) or 'no output'} (hint: the compile itself may be fine; run "
                                f"compile_for without estimate_cycles to check it)")
        return parse_llo_profiles(os.path.join(d, "llo"))


def parse_llo_profiles(directory: str) -> int | None:
    """Sum ``estimated_cycles`` over libtpu's ``*static_llo_profile.textproto`` files in ``directory``."""
    total, found = 0, False
    for path in glob.glob(os.path.join(directory, "*static_llo_profile*")):
        with open(path) as f:
            for m in re.finditer(r"estimated_cycles:\s*(\d+)", f.read()):
                total += int(m.group(1))
                found = True
    return total if found else None


def _compile_exported_main(blob_path: str, chip_name: str) -> None:
    import jax

    with open(blob_path, "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    dev = tpu_device(chip_name)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in exp.in_avals]
    with jax.default_device(dev):
        jax.jit(exp.call, donate_argnums=donated_args(exp)).lower(*structs).compile()


def donated_args(exported) -> tuple[int, ...]:
    """The arguments an exported program was jitted to donate (``tf.aliasing_output`` / ``jax.buffer_donor`` on
    its ``main``), so that its compile here donates them too: without it, a kernel that updates an argument in
    place (``input_output_aliases``) gets a whole-buffer copy of it first (a DMA libtpu's static profiler
    cannot model: "Unsupported DMA direction ... dma-general")."""
    line = next((ln for ln in exported.mlir_module().splitlines() if "func.func public @main(" in ln), "")
    args = line.split(") -> (", 1)[0].split("%arg")[1:]
    return tuple(i for i, a in enumerate(args) if "tf.aliasing_output" in a or "jax.buffer_donor" in a)


if __name__ == "__main__":
    _compile_exported_main(sys.argv[1], sys.argv[2])
