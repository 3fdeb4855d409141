"""The tpu target against torch_tpu: a fake that follows the real ``JaxCallable``, and the real one.

No TPU exists here. ``FakeJaxCallable`` has the real class's constructor, its deprecation path, tuple
returns and donation (donated inputs are poisoned with NaN, as a donated device buffer is no longer the
caller's). ``real_torch_tpu`` loads torch-tpu 0.2.0's ``pallas.py`` from the wheel unmodified, with only
its native modules stubbed (see tests/real_torch_tpu.py); ``make test`` downloads the wheel. The same file
also hosts a tokamax-style op (registered through its ``jax_op``, as tokamax's torch_tpu ops are) next to ours.
"""

import itertools
import sys
import types
import warnings

import jax
import pytest
import torch

import real_torch_tpu
import tpukernels as tk
from kernels_for_tests import accumulate, add_mul, load_example, scale


class FakeJaxCallable:
    """Follows torch_tpu 0.2.0 ``JaxCallable``: same keywords, warning, donation and return structure."""

    instances: list = []

    def __init__(self, name, jit_fn, trace_key, mesh=None, input_partition_specs=None, output_partition_specs=None,
                 static_argnums=(), donate_argnums=None, input_output_aliases=None, static_argnames=()):
        self.name, self.jit_fn, self.trace_key = name, jit_fn, trace_key
        if input_output_aliases is not None:
            warnings.warn("input_output_aliases is deprecated and will be removed soon. Please use donate_argnums "
                          "instead.", DeprecationWarning, stacklevel=2)
            donate_argnums = list(input_output_aliases)
        self.donate_argnums = list(donate_argnums or [])
        self.calls = []
        FakeJaxCallable.instances.append(self)

    def __call__(self, *tensors):
        self.calls.append(tensors)
        structs = [jax.ShapeDtypeStruct(tuple(t.shape), _jax_dtype(t.dtype)) for t in tensors]
        outs, tree = jax.tree_util.tree_flatten(jax.eval_shape(self.jit_fn, *structs))
        res = [torch.full(o.shape, 7.0, dtype=_torch_dtype(o.dtype)) for o in outs]
        for i in self.donate_argnums:
            tensors[i].fill_(float("nan"))  # a donated buffer now holds the output / garbage
        return tree.unflatten(res)


def _jax_dtype(d):
    from tpukernels.dsl.dtypes import to_jax_dtype

    return to_jax_dtype(d)


def _torch_dtype(d):
    from tpukernels.dsl.dtypes import to_torch_dtype

    return to_torch_dtype(d)


def _clear_plans(*kernels):
    for k in kernels:
        k._plans.clear()


@pytest.fixture
def fake_torch_tpu(monkeypatch):
    FakeJaxCallable.instances = []
    pallas = types.ModuleType("torch_tpu._internal.pallas.pallas")
    pallas.JaxCallable = FakeJaxCallable
    for name in ("torch_tpu", "torch_tpu._internal", "torch_tpu._internal.pallas"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torch_tpu._internal.pallas.pallas", pallas)
    yield FakeJaxCallable
    _clear_plans(scale, add_mul, accumulate)


@pytest.fixture
def real_torch_tpu_pallas(monkeypatch):
    """torch-tpu's own pallas.py; the registry stub checks tensor counts against the exported module."""
    try:
        pallas, registry = real_torch_tpu.install(monkeypatch)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    yield pallas, registry
    _clear_plans(scale, add_mul, accumulate)


def test_tpu_target_hands_a_mosaic_jit_fn_to_jaxcallable(fake_torch_tpu):
    from tpukernels.targets.tpu import run_torch_tpu

    softmax = load_example("softmax").softmax
    softmax._plans.clear()
    x = torch.randn(64, 256).t()  # non-contiguous: the adapter must pass a contiguous tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated torch_tpu path
        out = run_torch_tpu(softmax, [x], None)
    (inst,) = fake_torch_tpu.instances
    assert inst.name == "softmax" and inst.trace_key.startswith("tpukernels/examples::softmax/")
    assert inst.donate_argnums == []
    (passed,) = inst.calls[0]
    assert passed.is_contiguous() and passed.shape == (256, 64)
    assert out.shape == (256, 64) and out.dtype == torch.float32
    # the payload is the real Mosaic kernel, not an interpreter
    exported = jax.export.export(inst.jit_fn, platforms=["tpu"])(jax.ShapeDtypeStruct((256, 64), jax.numpy.float32))
    assert "tpu_custom_call" in exported.mlir_module()
    # a second call with the same signature reuses the callable (compiled once per signature)
    run_torch_tpu(softmax, [x], None)
    assert len(fake_torch_tpu.instances) == 1 and len(inst.calls) == 2


def test_tpu_target_pads_rows_to_the_bucket_and_slices_outputs(fake_torch_tpu):
    from tpukernels.targets.tpu import run_torch_tpu

    out = run_torch_tpu(scale, [torch.randn(1030, 128), 2.0], None)
    (inst,) = fake_torch_tpu.instances
    assert inst.calls[0][0].shape == (1280, 128)  # bucket(1030)
    assert out.shape == (1030, 128)


def test_tpu_target_multiple_outputs_and_optional_inputs(fake_torch_tpu):
    from tpukernels.targets.tpu import run_torch_tpu

    x = torch.randn(8, 128)
    s, p = run_torch_tpu(add_mul, [x, x, None], None)
    assert s.shape == p.shape == (8, 128)
    assert len(fake_torch_tpu.instances[0].calls[0]) == 2  # the absent optional tensor is not passed


def test_aliased_input_is_copied_then_donated_never_the_callers(fake_torch_tpu):
    from tpukernels.targets.tpu import run_torch_tpu

    acc, x = torch.randn(8, 128), torch.randn(8, 128)
    before = acc.clone()
    run_torch_tpu(accumulate, [acc, x], None)
    (inst,) = fake_torch_tpu.instances
    assert inst.donate_argnums == [0]
    assert inst.calls[0][0].data_ptr() != acc.data_ptr()
    assert torch.equal(acc, before)  # the op schema says mutates_args=(): the caller's tensor is untouched
    # cpu agrees: functional, input unchanged
    out = accumulate(acc, x)
    torch.testing.assert_close(out, before + x)
    assert torch.equal(acc, before)


def test_missing_torch_tpu_gives_install_hint(monkeypatch):
    from tpukernels.targets.tpu import run_torch_tpu

    monkeypatch.setitem(sys.modules, "torch_tpu", None)
    scale._plans.clear()
    with pytest.raises(tk.BackendUnavailableError, match="torch_tpu"):
        run_torch_tpu(scale, [torch.randn(8, 128), 2.0], None)


# --- the real torch_tpu pallas.py --------------------------------------------------------------------
def test_real_jaxcallable_runs_without_deprecation_and_with_mosaic(real_torch_tpu_pallas):
    from tpukernels.targets.tpu import run_torch_tpu

    _, registry = real_torch_tpu_pallas
    registry.runner = lambda name, inputs, outs: [torch.full(o.shape, 3.0, dtype=o.dtype) for o in outs]
    x = torch.randn(1030, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run_torch_tpu(scale, [x, 2.0], None)
        s, p = run_torch_tpu(add_mul, [x[:8].contiguous(), x[:8].contiguous(), None], None)
    assert out.shape == (1030, 128) and torch.all(out == 3.0)
    assert s.shape == p.shape == (8, 128) and torch.all(s == 3.0) and torch.all(p == 3.0)
    assert registry.calls[0]["inputs"][0].shape == (1280, 128) and registry.calls[0]["donate_argnums"] == []
    (mod,) = [m for (n, _), m in registry.kernels.items() if n == "scale"]
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import _jax

    with jmlir.make_ir_context():
        text = jmlir.module_to_string(_jax.mlir.deserialize_portable_artifact(mod))
    assert "tpu_custom_call" in text


def test_real_jaxcallable_empty_grid_keeps_every_parameter(real_torch_tpu_pallas):
    """matmul with K = 0: nothing runs, yet the exported module must take both tensors."""
    from tpukernels.targets.tpu import run_torch_tpu

    _, registry = real_torch_tpu_pallas
    registry.runner = lambda name, inputs, outs: [torch.zeros(o.shape, dtype=o.dtype) for o in outs]
    mm = load_example("matmul").matmul
    mm._plans.clear()
    out = run_torch_tpu(mm, [torch.randn(128, 0), torch.randn(0, 128)], None)
    assert out.shape == (128, 128) and len(registry.calls[0]["inputs"]) == 2


def test_real_jaxcallable_donation_leaves_the_callers_tensor(real_torch_tpu_pallas):
    from tpukernels.targets.tpu import run_torch_tpu

    _, registry = real_torch_tpu_pallas

    def run(name, inputs, outs):  # a donating runtime: the donated input buffer becomes the output
        res = inputs[0] + inputs[1]
        inputs[0].fill_(float("nan"))
        return [res]

    registry.runner = run
    acc, x = torch.randn(8, 128), torch.randn(8, 128)
    before = acc.clone()
    out = run_torch_tpu(accumulate, [acc, x], None)
    assert registry.calls[0]["donate_argnums"] == [0]
    assert torch.equal(acc, before)
    torch.testing.assert_close(out, before + x)


@pytest.mark.parametrize("name", ["softmax", "rms_scale"])
def test_real_jaxcallable_helion_kernels_without_a_jax_tpu(real_torch_tpu_pallas, name):
    """jax sees only cpu devices here (as in a TorchTPU process); Helion must still lower for the TPU."""
    from tpukernels.targets.tpu import run_torch_tpu

    assert jax.devices()[0].platform == "cpu"
    hk = getattr(load_example("helion_kernels"), name)
    hk._plans.clear()
    args = [torch.randn(128, 256)] + ([torch.randn(256), 1e-6] if name == "rms_scale" else [])
    out = run_torch_tpu(hk, args, None)
    assert out.shape == (128, 256)
    hk._plans.clear()


def test_live_chip_is_read_like_torch_tpu(real_torch_tpu_pallas, monkeypatch):
    from tpukernels.targets.tpu import live_chip

    assert live_chip().name == "v6e"  # the stubbed device backend says "TPU v6 lite"
    monkeypatch.setattr(sys.modules["torch_tpu._internal.device._device_ops_backend"],
                        "_get_local_device_attributes", lambda: {"device_kind": "TPU7x"})
    assert live_chip().name == "tpu7x"


def test_real_jaxcallable_spmd_launch_over_a_mesh(real_torch_tpu_pallas):
    """partitioned(mesh, in_specs): each rank's local shard, shard_map over torch_tpu's mock-device mesh."""
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    from tpukernels.targets.tpu import partitioned, run_torch_tpu

    pallas, registry = real_torch_tpu_pallas
    dev_cls = sys.modules["torch_tpu._internal.pallas._mock_device"]._PallasDevice
    mesh = Mesh(np.array([dev_cls(id=i, device_kind="TPU v6 lite") for i in range(4)]), ("x",))
    registry.runner = lambda name, inputs, outs: [torch.full(o.shape, 1.0, dtype=o.dtype) for o in outs]
    x = torch.randn(64, 128)  # this rank's shard of a [256, 128] array
    with partitioned(mesh, [("x", None), ("x", None)]):
        s, p = run_torch_tpu(add_mul, [x, x, None], None)
    assert s.shape == p.shape == (64, 128)  # local outputs
    (mod,) = [m for (n, _), m in registry.kernels.items() if n == "add_mul"]
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import _jax

    with jmlir.make_ir_context():
        text = jmlir.module_to_string(_jax.mlir.deserialize_portable_artifact(mod))
    assert "tensor<256x128xf32>" in text and "tensor<64x128xf32>" in text  # global args, per-device kernel
    assert "tpu_custom_call" in text and "mhlo.num_partitions = 4" in text
    with pytest.raises(tk.ArgumentError, match="one PartitionSpec per tensor argument"):
        with partitioned(mesh, PartitionSpec("x")):
            pass


# --- a tokamax-style jax_op op and ours in one process (issue 36 item 15) ------------------------------------
_OP_IDS = itertools.count()


class _TokamaxStyleOp:
    """The way tokamax's torch_tpu ops plug in (``tokamax/experimental/torch_tpu/ops/torch_op.py``, openxla/
    tokamax): an object whose annotated ``op_impl_call`` (``jax.Array`` in, ``jax.Array`` out, non-tensor
    arguments static) runs a Pallas kernel; it is handed to ``torch_tpu._internal.pallas.pallas.jax_op(
    "<ns>::<name>", op_impl_call)``, which makes a ``torch.library`` custom op, and ``__call__`` calls that op
    with torch tensors. A minimal stand-in written for this test: ``out = x * alpha + y``."""

    def __init__(self, pallas, qualname: str):
        self.torch_op = pallas.jax_op(qualname, self.op_impl_call)

    def op_impl_call(self, x: jax.Array, y: jax.Array, alpha: float = 2.0) -> jax.Array:
        from jax.experimental import pallas as pl

        def body(x_ref, y_ref, o_ref):
            o_ref[...] = x_ref[...] * alpha + y_ref[...]

        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0) -> torch.Tensor:
        return self.torch_op(x, y, alpha=alpha)


def test_real_jax_op_tokamax_style_and_ours_share_one_process(real_torch_tpu_pallas):
    """One process, one torch_tpu runtime: a tokamax-style op registered through the wheel's real ``jax_op``
    and our ``scale`` (the tpu target's ``JaxCallable``) are called in turn (theirs, ours, theirs again with
    another static, ours again). Each reaches the (stubbed) runtime under its own name with its own Mosaic
    module, with its own tensors in order, and gets back what the runtime computed for it; repeated calls reuse
    the registered modules; the op is a real ``torch.ops`` custom op."""
    from tpukernels.targets.tpu import run_torch_tpu

    pallas, registry = real_torch_tpu_pallas
    ns = f"tkx_tokamax_style{next(_OP_IDS)}"  # torch.library registrations are for the life of the process

    alpha = {"now": 2.0}  # the static the test passes; the runtime sees only tensors and a module

    def device(name, inputs, outs):  # the stubbed runtime computes what each kernel means
        if name == f"{ns}::scaled_add":
            return [inputs[0] * alpha["now"] + inputs[1]]
        assert name == "scale", name
        return [inputs[0] * 2.0]

    registry.runner = device
    op = _TokamaxStyleOp(pallas, f"{ns}::scaled_add")
    assert getattr(torch.ops, ns).scaled_add.default is not None
    x, y, z = torch.randn(8, 128), torch.randn(8, 128), torch.randn(16, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # jax_op is the non-deprecated path; ours passes no deprecated argument
        theirs = op(x, y)
        ours = run_torch_tpu(scale, [z, 2.0], None)
        alpha["now"] = 3.0
        theirs3 = op(x, y, alpha=3.0)
        ours2 = run_torch_tpu(scale, [z, 2.0], None)
    torch.testing.assert_close(theirs, x * 2.0 + y, rtol=0, atol=0)
    torch.testing.assert_close(theirs3, x * 3.0 + y, rtol=0, atol=0)
    torch.testing.assert_close(ours, z * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(ours2, z * 2.0, rtol=0, atol=0)
    assert [c["name"] for c in registry.calls] == [f"{ns}::scaled_add", "scale", f"{ns}::scaled_add", "scale"]
    assert [len(c["inputs"]) for c in registry.calls] == [2, 1, 2, 1]
    assert registry.calls[0]["inputs"][0] is x and registry.calls[0]["inputs"][1] is y
    names = sorted(n for n, _ in registry.kernels)
    assert names == ["scale", f"{ns}::scaled_add", f"{ns}::scaled_add"]  # one module per alpha, ours once
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import _jax

    with jmlir.make_ir_context():
        for mod in registry.kernels.values():
            assert "tpu_custom_call" in jmlir.module_to_string(_jax.mlir.deserialize_portable_artifact(mod))

