"""compile_for on multi-chip compile-only topologies (v5e 2x2, v6e 2x2, tpu7x 2x2x1) under shard_map:
each device compiles the kernel on its shard, figures are per device, bad meshes and specs are typed errors."""

import pytest
from jax.sharding import PartitionSpec as P

import tpukernels as tk
import tpukernels.library  # noqa: F401  (registers the library kernels)
from tpukernels.dsl.kernel import REGISTRY

pytestmark = pytest.mark.aot



def _rms(chip, x, **kw):
    return tk.compile_for(REGISTRY["tpukernels::rms_norm_fwd"], chip, x, None, 1e-6, 0.0, "llama", False,
                          with_mlir=False, **kw)


def test_v5e_2x2_rows_over_four_chips_match_one_chip_on_the_shard():
    multi = _rms("v5e:2x2", "4096x1024:bf16", mesh_axes={"x": 4}, in_specs={"x": P("x")})
    one = _rms("v5e", "1024x1024:bf16")
    assert multi.ok and one.ok, (multi.error, one.error)
    assert multi.topology == "v5e:2x2" and multi.devices == 4 and multi.mesh_axes == {"x": 4}
    assert multi.shapes[0] == "4096x1024:bfloat16" and multi.local_shapes[0] == "1024x1024:bfloat16"
    # per device: the same kernel (config, VMEM) as one chip compiling the shard
    assert multi.config == one.config and multi.vmem_estimate_bytes == one.vmem_estimate_bytes
    assert multi.code_size_bytes > 0


def test_v6e_2x2_matmul_column_parallel_and_tpu7x_attention_over_batch_and_heads():
    mm = tk.compile_for(REGISTRY["tpukernels::matmul_nn"], "v6e:2x2", "1x2048x1024:bf16", "1x1024x4096:bf16",
                        None, None, None, False, mesh_axes={"tp": 4}, in_specs={"b": P(None, None, "tp")},
                        out_specs=P(None, None, "tp"), with_mlir=False)
    assert mm.ok, mm.error
    assert mm.local_shapes[:2] == ["1x2048x1024:bfloat16", "1x1024x1024:bfloat16"] and mm.devices == 4
    fa = tk.compile_for(REGISTRY["tpukernels::flash_attention_fwd"], "tpu7x:2x2x1", "4x8x512x128:bf16",
                        "4x4x512x128:bf16", "4x4x512x128:bf16", causal=True, mesh_axes={"dp": 2, "tp": 4},
                        in_specs={"q": P("dp", "tp"), "k": P("dp", "tp"), "v": P("dp", "tp")}, with_mlir=False)
    assert fa.ok, fa.error
    assert fa.devices == 8 and fa.local_shapes[:3] == ["2x2x512x128:bfloat16", "2x1x512x128:bfloat16",
                                                       "2x1x512x128:bfloat16"]


def test_bad_meshes_and_specs_are_typed_errors():
    with pytest.raises(tk.ArgumentError, match=r"spans 2 devices but topology v5e:2x2 has 4 \(the mesh_axes sizes "
                                               r"must multiply to 4\)"):
        _rms("v5e:2x2", "4096x1024:bf16", mesh_axes={"x": 2}, in_specs={"x": P("x")})
    with pytest.raises(tk.ArgumentError, match="spans 4 devices but topology v5e:1x1 has 1 .*'v5e:2x2'"):
        _rms("v5e", "4096x1024:bf16", mesh_axes={"x": 4})
    with pytest.raises(tk.ArgumentError, match=r"x dim 0 \(4098\) does not divide into 4 shards"):
        _rms("v5e:2x2", "4098x1024:bf16", mesh_axes={"x": 4}, in_specs={"x": P("x")})
    with pytest.raises(tk.ArgumentError, match="names mesh axis 'y'"):
        _rms("v5e:2x2", "4096x1024:bf16", mesh_axes={"x": 4}, in_specs={"x": P("y")})
    with pytest.raises(tk.ArgumentError, match="not tensor arguments"):
        _rms("v5e:2x2", "4096x1024:bf16", mesh_axes={"x": 4}, in_specs={"eps": P("x")})


def test_declared_shapes_are_checked_on_each_device_s_shard():
    """shapes= holds per device: sharding x's columns but not bias's gives mismatched local shapes."""
    from test_input_checks import bias_add

    ok = tk.compile_for(bias_add, "v5e:2x2", "1024x512:bf16", "1x512:bf16", mesh_axes={"x": 4},
                        in_specs={"x": P("x")}, with_mlir=False)
    assert ok.ok, ok.error
    with pytest.raises(tk.ArgumentError, match=r"bias has shape \(1, 512\).*C=128 from x"):
        tk.compile_for(bias_add, "v5e:2x2", "1024x512:bf16", "1x512:bf16", mesh_axes={"x": 4},
                       in_specs={"x": P(None, "x")}, with_mlir=False)
