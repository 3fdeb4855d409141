"""Load the real ``torch_tpu/_internal/pallas/pallas.py`` from the torch-tpu wheel with its native modules stubbed.

The wheel (``pip download --no-deps torch-tpu==0.2.0``; ``make test`` fetches it into
``.venv/torch_tpu_wheel``, or point ``TPUKERNELS_TORCH_TPU_WHEEL`` at one) ships ``pallas.py`` unmodified.
It imports native extension modules (the device backend, the kernel registry, warnings, env) that need a
TPU host. This module stubs exactly those, loads ``pallas.py``, ``_compat.py`` and ``_mock_device.py``
from the wheel as they are, and gives the stubbed kernel registry a recorder: ``call_custom_kernel``
checks that it receives one tensor per parameter of the serialized module, records the donation, and
returns the output placeholders filled by ``runner`` (default: NaN, so a test that reads an output the
"device" never wrote fails).
"""

from __future__ import annotations

import glob
import os
import sys
import types
import warnings
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODULES = ("_compat.py", "_mock_device.py", "pallas.py", "__init__.py")


def wheel_path() -> str | None:
    env = os.environ.get("TPUKERNELS_TORCH_TPU_WHEEL")
    if env:
        return env if os.path.exists(env) else None
    found = sorted(glob.glob(os.path.join(ROOT, ".venv", "torch_tpu_wheel", "torch_tpu-*.whl")))
    return found[-1] if found else None


class Registry:
    """The stub of ``torch_tpu._internal.pallas.tpu_torch_pallas`` (the native kernel registry)."""

    def __init__(self):
        self.kernels: dict = {}
        self.calls: list = []
        self.runner = None  # fn(name, inputs, output_shapes) -> list of tensors, or None: NaN outputs

    def lookup_custom_kernel(self, name, fingerprint):
        return (name, fingerprint) in self.kernels

    def register_custom_kernel(self, name, fingerprint, serialized_mlir_module):
        self.kernels[(name, fingerprint)] = serialized_mlir_module

    def call_custom_kernel(self, name, fingerprint, *, inputs, output_shapes, donate_argnums, device_assignment):
        import torch

        n_params = module_param_count(self.kernels[(name, fingerprint)])
        if n_params != len(inputs):
            raise RuntimeError(f"{name}: the TPU module takes {n_params} parameters but got {len(inputs)} tensors")
        self.calls.append(dict(name=name, inputs=list(inputs), donate_argnums=list(donate_argnums)))
        if self.runner is not None:
            return list(self.runner(name, list(inputs), output_shapes))
        return [torch.full(o.shape, float("nan"), dtype=o.dtype) if o.dtype.is_floating_point
                else torch.zeros(o.shape, dtype=o.dtype) for o in output_shapes]


def module_param_count(serialized: bytes) -> int:
    """Parameters of ``main`` in a serialized StableHLO module (what the TPU runtime will bind)."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    with jmlir.make_ir_context():
        m = ir.Module.parse(jmlir.module_to_string(_jax.mlir.deserialize_portable_artifact(serialized)))
        for op in m.body.operations:
            if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                return len(op.regions[0].blocks[0].arguments)
    raise RuntimeError("no main function in the module")


def _stub(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def install(monkeypatch, device_kind: str = "TPU v6 lite") -> tuple[types.ModuleType, Registry]:
    """Install the real pallas module (from the wheel) under ``sys.modules`` via ``monkeypatch``.

    Returns ``(pallas_module, registry)``. Raises FileNotFoundError when no wheel is available.
    """
    whl = wheel_path()
    if whl is None:
        raise FileNotFoundError("no torch-tpu wheel (run `make test`, or set TPUKERNELS_TORCH_TPU_WHEEL)")
    reg = Registry()
    ident = lambda *a, **k: (lambda f: f)  # noqa: E731  (annotations.experimental/deprecated decorators)
    stubs = {
        "torch_tpu": _stub("torch_tpu", __path__=[]),
        "torch_tpu._internal": _stub("torch_tpu._internal", __path__=[]),
        "torch_tpu._internal.device": _stub("torch_tpu._internal.device", __path__=[]),
        "torch_tpu._internal.device._device_ops_backend": _stub(
            "torch_tpu._internal.device._device_ops_backend",
            _get_local_device_attributes=lambda: {"device_kind": device_kind}),
        "torch_tpu._internal.distributed": _stub("torch_tpu._internal.distributed", __path__=[]),
        "torch_tpu._internal.distributed.device_mesh": _stub(
            "torch_tpu._internal.distributed.device_mesh", get_device_assignment=lambda pg=None: [0]),
        "torch_tpu._internal.utils": _stub("torch_tpu._internal.utils", __path__=[]),
        "torch_tpu._internal.utils.annotations": _stub(
            "torch_tpu._internal.utils.annotations", experimental=ident, deprecated=ident),
        "torch_tpu._internal.utils.tt_warnings": _stub(
            "torch_tpu._internal.utils.tt_warnings",
            warn=lambda msg, category, **kw: warnings.warn(msg, category, stacklevel=kw.get("stacklevel", 2))),
        "torch_tpu._internal.warnings": _stub("torch_tpu._internal.warnings", DEPRECATED_API=DeprecationWarning),
        "torch_tpu._internal.env": _stub("torch_tpu._internal.env", get_int_env_once=lambda n, default_value=0: default_value),
        "torch_tpu._internal.pallas.tpu_torch_pallas": _stub(
            "torch_tpu._internal.pallas.tpu_torch_pallas",
            lookup_custom_kernel=reg.lookup_custom_kernel, register_custom_kernel=reg.register_custom_kernel,
            call_custom_kernel=reg.call_custom_kernel),
    }
    for name, mod in stubs.items():
        monkeypatch.setitem(sys.modules, name, mod)
    with zipfile.ZipFile(whl) as z:
        sources = {f: z.read(f"torch_tpu/_internal/pallas/{f}").decode() for f in MODULES}
    pkg = _stub("torch_tpu._internal.pallas", __path__=[])
    exec(compile(sources["__init__.py"], f"{whl}!torch_tpu/_internal/pallas/__init__.py", "exec"), pkg.__dict__)
    monkeypatch.setitem(sys.modules, "torch_tpu._internal.pallas", pkg)
    stubs["torch_tpu._internal"].pallas = pkg
    loaded = {}
    for f in ("_compat.py", "_mock_device.py", "pallas.py"):
        name = f"torch_tpu._internal.pallas.{f[:-3]}"
        mod = types.ModuleType(name)
        mod.__file__ = f"{whl}!torch_tpu/_internal/pallas/{f}"
        monkeypatch.setitem(sys.modules, name, mod)
        exec(compile(sources[f], mod.__file__, "exec"), mod.__dict__)
        setattr(pkg, f[:-3], mod)
        loaded[f] = mod
    pallas = loaded["pallas.py"]
    # The only device-level stand-in: output placeholders are allocated on cpu (no "tpu" device exists here).
    real_placeholder = pallas.torch_placeholder
    monkeypatch.setattr(pallas, "torch_placeholder", lambda a, mesh=None, partition_spec=None, device="tpu":
                        real_placeholder(a, mesh=mesh, partition_spec=partition_spec, device="cpu"))
    return pallas, reg
