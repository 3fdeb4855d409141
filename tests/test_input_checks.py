"""Bad input gets a typed error before any kernel runs: statics, configs, devices, declared shapes, names."""

import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import tpukernels as tk
import tpukernels.library as L
from kernels_for_tests import add_mul, load_example, scale


def _add_body(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


@tk.tpu_kernel(_add_body, namespace="tkchecks", tunables={"block_rows": tk.Tunable([256, 512, 64])},
               shapes={"x": "R C", "y": "R C"})
def add(x: torch.Tensor, y: torch.Tensor, *, block_rows: int) -> torch.Tensor:
    spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], block_rows),), in_specs=[spec, spec], out_specs=spec,
                     out_shape=tk.like(x))


@tk.tpu_kernel(_add_body, name="tkchecks_ns::add2")
def add2(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    spec = pl.BlockSpec(tuple(x.shape), lambda: (0, 0))
    return tk.Launch(grid=(), in_specs=[spec, spec], out_specs=spec, out_shape=tk.like(x))


def test_declared_shapes_reject_a_mismatched_input_before_any_read():
    x = torch.randn(1000, 256)
    with pytest.raises(tk.ArgumentError, match=r"y has shape \(1000, 128\).*C=256 from x"):
        add(x, torch.randn(1000, 128))
    with pytest.raises(tk.ArgumentError, match="rank 2"):
        add(x, torch.randn(1000))
    torch.testing.assert_close(add(x, x), x + x)  # and the matching call works


def _bias_add_body(x_ref, b_ref, o_ref):
    o_ref[...] = x_ref[...] + b_ref[...]


@tk.tpu_kernel(_bias_add_body, namespace="tkchecks", rows=("x",), shapes={"x": "R C", "bias": "1 C"})
def bias_add(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    xs = pl.BlockSpec((16, x.shape[1]), lambda i: (i, 0))
    bs = pl.BlockSpec((1, x.shape[1]), lambda i: (0, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], 16),), in_specs=[xs, bs], out_specs=xs, out_shape=tk.like(x))


def test_declared_shapes_errors_name_the_callers_shape_not_the_row_bucket():
    x = torch.randn(1000, 256)  # rows= buckets 1000 to 1024: the message must still say 1000
    with pytest.raises(tk.ArgumentError, match=r"x has shape \(1000, 3, 256\), but shapes= declares x: 'R C'"):
        bias_add(torch.randn(1000, 3, 256), torch.randn(1, 256))
    with pytest.raises(tk.ArgumentError, match=r"bias has shape \(1, 128\).*C=256 from x"):
        bias_add(x, torch.randn(1, 128))
    torch.testing.assert_close(bias_add(x, x[:1]), x + x[:1])


@tk.tpu_kernel(_add_body, namespace="tkchecks", rows=("x",), shapes={"x": "M C", "y": "M C"})
def add_rows_x(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    spec = pl.BlockSpec((16, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], 16),), in_specs=[spec, spec], out_specs=spec, out_shape=tk.like(x))


def test_row_bucketing_of_one_argument_only_is_explained():
    """rows=("x",) pads x to its bucket but not y: the declared M then disagrees (y's rows would be read past
    its end), and the message says why instead of quoting a row count the caller never passed."""
    x = torch.randn(200, 128)
    with pytest.raises(tk.ArgumentError, match=r"y has shape \(200, 128\).*x is in rows=.*add 'y' to rows="):
        add_rows_x(x, x)


def test_declared_shapes_fixed_dims_and_bad_declarations():
    with pytest.raises(tk.KernelDefinitionError, match="not a tensor parameter"):
        tk.tpu_kernel(_add_body, namespace="tkchecks", name="bad1", shapes={"z": "R"})(add2.launch_fn)
    k = tk.tpu_kernel(_add_body, namespace="tkchecks", name="fixed", shapes={"x": "R 128", "y": "R 128"})(
        add2.launch_fn)
    with pytest.raises(tk.ArgumentError, match="a dim of 128"):
        k(torch.randn(8, 256), torch.randn(8, 256))


def test_name_with_namespace_is_accepted_and_contradictions_are_errors():
    assert add2.qualname == "tkchecks_ns::add2" and hasattr(torch.ops.tkchecks_ns, "add2")
    x = torch.randn(8, 128)
    torch.testing.assert_close(torch.ops.tkchecks_ns.add2(x, x), 2 * x)
    with pytest.raises(tk.KernelDefinitionError, match="contradicts namespace"):
        tk.tpu_kernel(_add_body, name="a::b", namespace="c")(add2.launch_fn)
    with pytest.raises(tk.KernelDefinitionError, match="'namespace::op'"):
        tk.tpu_kernel(_add_body, name="a::b::c")(add2.launch_fn)
    with pytest.raises(tk.KernelDefinitionError, match="not a valid op identifier"):
        tk.tpu_kernel(_add_body, name="my-op")(add2.launch_fn)


@pytest.mark.parametrize("value, rule", [("16", "is a str"), (16.0, "is a float"), (True, "is a bool"),
                                         (0, "must be positive"), (-8, "must be positive")])
def test_config_values_are_checked_against_the_tunable(value, rule):
    x = torch.randn(64, 128)
    with pytest.raises(tk.ConfigError, match=rf"tktest::scale: config: block_rows=.* {rule}"):
        scale(x, 2.0, config={"block_rows": value})
    with pytest.raises(tk.ConfigError, match="tktest::scale"):
        torch.ops.tktest.scale(x, 2.0, config=f'{{"block_rows": {value!r}}}'.replace("'", '"').replace("True", "true"))


def test_a_value_outside_the_declared_list_is_allowed():
    x = torch.randn(64, 128)
    torch.testing.assert_close(scale(x, 3.0, config={"block_rows": 64}), 3 * x)  # 64 is not declared


def test_config_strings_must_be_json_objects():
    x = torch.randn(64, 128)
    with pytest.raises(tk.ConfigError, match="expected a JSON object"):
        torch.ops.tktest.scale(x, 2.0, config="block_rows=16")
    with pytest.raises(tk.ConfigError, match="expected a JSON object"):
        torch.ops.tktest.scale(x, 2.0, config="[16]")
    with pytest.raises(tk.ConfigError, match="must be a dict"):
        scale(x, 2.0, config=[("block_rows", 16)])


@pytest.mark.parametrize("value", ["2.0", None, [2.0]])
def test_static_arguments_are_checked_against_annotations(value):
    with pytest.raises(tk.ArgumentError, match=r"tktest::scale: static argument 'alpha' must be float"):
        scale(torch.randn(8, 128), value)


def test_static_ints_widen_to_float_and_bool_strings_are_rejected():
    x = torch.randn(8, 128)
    torch.testing.assert_close(scale(x, 3), 3 * x)  # int for a float parameter: fine
    mm = load_example("matmul")  # noqa: F841  (registers examples)
    with pytest.raises(tk.ArgumentError, match="must be a finite float"):
        L.rms_norm(x, None, eps="abc")
    with pytest.raises(tk.ArgumentError, match="sm_scale must be a float"):
        L.flash_attention(torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64), sm_scale="1")


@pytest.mark.parametrize("which", ["user", "matmul", "attention", "norm"])
def test_cpu_tensor_beside_a_meta_tensor_is_a_device_error(which):
    cpu, meta = torch.randn(16, 128), torch.randn(16, 128, device="meta")
    with pytest.raises(tk.DeviceError, match="meta"):
        if which == "user":
            add_mul(cpu, meta)
        elif which == "matmul":
            L.matmul(cpu, torch.randn(128, 128, device="meta"))
        elif which == "attention":
            q = torch.randn(1, 2, 8, 64)
            L.flash_attention(q, q.to("meta"), q)
        else:
            L.rms_norm(cpu, torch.randn(128, device="meta"))
    with pytest.raises(tk.DeviceError, match="meta"):
        torch.ops.tktest.add_mul(cpu, meta)  # the op itself, not only the Python entry point


def test_missing_arguments_are_listed_at_once():
    with pytest.raises(tk.ArgumentError, match=r"missing required argument\(s\) 'x', 'y'"):
        add2.bind([], {})


def test_outspec_takes_torch_dtypes_and_rejects_non_dtypes():
    assert tk.OutSpec((8, 128), torch.bfloat16).dtype == jnp.bfloat16
    assert tk.OutSpec((8, 128), jnp.float32).dtype == jnp.float32
    with pytest.raises(tk.DTypeError, match="OutSpec dtype: 'f32x' is not a dtype"):
        tk.OutSpec((8, 128), "f32x")
    with pytest.raises(tk.DTypeError, match="OutSpec dtype: dtype float64 is not supported"):
        tk.OutSpec((8, 128), torch.float64)


@pytest.mark.parametrize("text, words", [("64x256:f64", "no 64-bit dtypes; use f32"),
                                         ("64x256:i64", "no 64-bit dtypes; use i32"),
                                         ("64x256:float", "unknown dtype 'float'; use one of bf16"),
                                         ("64xa:bf16", "dims must be integers")])
def test_shape_strings_name_the_problem(text, words):
    from tpukernels.targets.compile_only import parse_shape

    with pytest.raises(tk.ArgumentError, match=words):
        parse_shape(text)


def test_bad_environment_variables_are_named(monkeypatch):
    from tpukernels.chips import target_chip_from_env
    from tpukernels.dsl.modes import current_interpret_mode

    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v5x")
    with pytest.raises(tk.ChipError, match="TPUKERNELS_TARGET_CHIP='v5x': .*known chips are"):
        target_chip_from_env()
    monkeypatch.setenv("TPUKERNELS_INTERPRET", "tpuu")
    with pytest.raises(tk.ArgumentError, match="TPUKERNELS_INTERPRET='tpuu' is not one of"):
        current_interpret_mode()


def test_index_map_arity_is_checked_against_the_grid():
    @tk.tpu_kernel(_add_body, namespace="tkchecks", name="wrong_grid")
    def wrong_grid(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        spec = pl.BlockSpec((8, x.shape[1]), lambda i, j: (i, 0))  # 2 args, 1-D grid
        return tk.Launch(grid=(tk.cdiv(x.shape[0], 8),), in_specs=[spec, spec], out_specs=spec, out_shape=tk.like(x))

    x = torch.randn(64, 128)
    with pytest.raises(tk.KernelBodyError, match=r"in_specs for 'x': index_map takes 2 arguments but the grid has "
                                                 r"rank 1: it must take 1"):
        wrong_grid(x, x)
