"""Contract test of the tpu target against a fake of the torch_tpu entry point it uses.

No TPU exists here. The fake ``torch_tpu._internal.pallas.pallas.JaxCallable`` records what tpukernels
hands it and returns tensors shaped by ``jax.eval_shape`` of the function (what the real one returns).
"""

import sys
import types

import jax
import pytest
import torch

import tpukernels as tk
from kernels_for_tests import add_mul, load_example, scale


class FakeJaxCallable:
    instances: list = []

    def __init__(self, *, name, jit_fn, trace_key, input_output_aliases=None, mesh=None, input_partition_specs=None):
        self.name, self.jit_fn, self.trace_key = name, jit_fn, trace_key
        self.input_output_aliases = input_output_aliases
        self.calls = []
        FakeJaxCallable.instances.append(self)

    def __call__(self, *tensors):
        self.calls.append(tensors)
        structs = [jax.ShapeDtypeStruct(tuple(t.shape), _jax_dtype(t.dtype)) for t in tensors]
        outs = jax.eval_shape(self.jit_fn, *structs)
        res = [torch.full(o.shape, 7.0, dtype=_torch_dtype(o.dtype)) for o in outs]
        return res if len(res) > 1 else res[0]


def _jax_dtype(d):
    from tpukernels.dsl.dtypes import to_jax_dtype

    return to_jax_dtype(d)


def _torch_dtype(d):
    from tpukernels.dsl.dtypes import to_torch_dtype

    return to_torch_dtype(d)


@pytest.fixture
def fake_torch_tpu(monkeypatch):
    FakeJaxCallable.instances = []
    pallas = types.ModuleType("torch_tpu._internal.pallas.pallas")
    pallas.JaxCallable = FakeJaxCallable
    for name in ("torch_tpu", "torch_tpu._internal", "torch_tpu._internal.pallas"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torch_tpu._internal.pallas.pallas", pallas)
    return FakeJaxCallable


def test_tpu_target_hands_a_mosaic_jit_fn_to_jaxcallable(fake_torch_tpu):
    from tpukernels.targets.tpu import run_torch_tpu

    softmax = load_example("softmax").softmax
    x = torch.randn(64, 256).t()  # non-contiguous: the adapter must pass a contiguous tensor
    out = run_torch_tpu(softmax, [x], None)
    (inst,) = fake_torch_tpu.instances
    assert inst.name == "softmax" and inst.trace_key.startswith("tpukernels/examples::softmax/")
    assert inst.input_output_aliases == {}
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


def test_missing_torch_tpu_gives_install_hint(monkeypatch):
    from tpukernels.targets.tpu import run_torch_tpu

    monkeypatch.setitem(sys.modules, "torch_tpu", None)
    scale._plans.clear()
    with pytest.raises(tk.BackendUnavailableError, match="torch_tpu"):
        run_torch_tpu(scale, [torch.randn(8, 128), 2.0], None)
