"""The public quantized API as model code uses it: module dtype casts, w8a8 without no_grad, dtype arguments,
typed errors before any kernel runs."""

import pytest
import torch

from tpukernels.errors import ArgumentError, ConfigError, DTypeError
from tpukernels.library import quantized_matmul as qmm_fn
from tpukernels.library.quantized_matmul_ops import TPUQuantLinear, dequantize, quantize_per_token, quantize_weight


def _linear(k=64, n=48, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("cast", ["bfloat16", "half", "to"])
def test_module_dtype_casts_keep_the_quantized_buffers(dtype, cast):
    """``model.to(torch.bfloat16)`` / ``.half()`` cast every floating buffer: w_scale became bf16 (DTypeError
    at the next call) and an fp8 w_q became bf16. They keep their dtypes now; the bias follows the cast."""
    m = TPUQuantLinear.from_linear(_linear(), dtype)
    wq, ws = m.w_q.clone(), m.w_scale.clone()
    m = {"bfloat16": m.bfloat16, "half": m.half, "to": lambda: m.to(torch.bfloat16)}[cast]()
    assert m.w_q.dtype == wq.dtype and torch.equal(m.w_q.view(torch.uint8), wq.view(torch.uint8))
    assert m.w_scale.dtype == torch.float32 and torch.equal(m.w_scale, ws)
    assert m.bias.dtype == (torch.float16 if cast == "half" else torch.bfloat16)
    assert [n for n, _ in m.named_buffers()] == ["w_q", "w_scale", "bias"]  # state_dict order unchanged
    x = torch.randn(5, 64).to(m.bias.dtype)
    y = m(x)
    want = x.double() @ dequantize(wq, ws).T + m.bias.double()
    assert y.dtype == x.dtype
    assert (y.double() - want).abs().max() <= 0.02 * want.abs().max()


def test_w8a8_forward_runs_with_grad_enabled_and_backward_raises():
    """HF weights require grad, so every activation does: eval-mode inference without torch.no_grad() used to
    raise in the forward. It runs now (same values as under no_grad); a backward through it raises."""
    w_q, w_s = quantize_weight(torch.randn(32, 64), "int8")
    x = torch.randn(4, 64, requires_grad=True)
    y = qmm_fn(x, w_q, w_s, x_quant="int8")
    with torch.no_grad():
        want = qmm_fn(x, w_q, w_s, x_quant="int8")
    assert torch.equal(y, want) and y.requires_grad
    with pytest.raises(ArgumentError, match="no gradient"):
        y.sum().backward()


@pytest.mark.parametrize("dtype, want", [(torch.int8, torch.int8), ("fp8", torch.float8_e4m3fn),
                                         (torch.float8_e5m2, torch.float8_e5m2)])
def test_torch_dtypes_and_the_fp8_alias_are_accepted_everywhere(dtype, want):
    m = TPUQuantLinear.from_linear(_linear(), dtype)
    assert m.w_q.dtype == want
    q, s = quantize_per_token(torch.randn(3, 64), dtype)
    assert q.dtype == want and s.dtype == torch.float32


@pytest.mark.parametrize("bad", ["int4", "bogus", torch.float16, 8])
def test_unknown_quantization_dtypes_are_dtype_errors(bad):
    with pytest.raises(DTypeError, match="is not one of"):
        TPUQuantLinear.from_linear(_linear(), bad)
    with pytest.raises(DTypeError, match="is not one of"):
        quantize_weight(torch.randn(4, 8), bad)


@pytest.mark.parametrize("dtype, x_quant", [("int8", "fp8"), ("float8_e5m2", "int8"), ("float8_e4m3fn", "int8")])
def test_quant_linear_with_a_mismatched_x_quant_fails_at_construction(dtype, x_quant):
    with pytest.raises(DTypeError, match=f"TPUQuantLinear: x_quant='{x_quant}' needs"):
        TPUQuantLinear.from_linear(_linear(), dtype, x_quant=x_quant)
    m = TPUQuantLinear.from_linear(_linear(), dtype, x_quant="int8" if dtype == "int8" else "fp8")  # the match
    assert m.x_quant in ("int8", "fp8")


def test_apply_tpukernels_rejects_a_bad_quantize_before_patching_anything():
    from tpukernels.integrations.transformers import apply_tpukernels

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    with pytest.raises(DTypeError, match="apply_tpukernels"):
        apply_tpukernels(model, attention=False, quantize="int4")
    assert type(model[1]) is torch.nn.LayerNorm  # nothing was replaced


@pytest.mark.parametrize("quantize, x_quant, err, match", [
    ("int8", "fp8", DTypeError, "x_quant='fp8' needs float8 w_q, got int8"),
    ("fp8", "int8", DTypeError, "x_quant='int8' needs int8 w_q, got float8_e4m3fn"),
    ("float8_e5m2", "int8", DTypeError, "x_quant='int8' needs int8 w_q, got float8_e5m2"),
    (None, "int8", ArgumentError, "x_quant='int8' needs quantize="),
    (None, "fp8", ArgumentError, "x_quant='fp8' needs quantize="),
])
def test_apply_tpukernels_rejects_a_mismatched_x_quant_before_patching_anything(quantize, x_quant, err, match):
    """int8 weights with x_quant='fp8' used to patch and return normally, then the first forward raised; x_quant
    without quantize was silently ignored. Both are typed errors at apply time now, with nothing patched."""
    from tpukernels.integrations.transformers import apply_tpukernels

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    with pytest.raises(err, match=match) as e:
        apply_tpukernels(model, attention=False, quantize=quantize, x_quant=x_quant)
    assert "apply_tpukernels" in str(e.value)
    assert type(model[0]) is torch.nn.Linear and type(model[1]) is torch.nn.LayerNorm  # nothing was replaced


def test_apply_tpukernels_rejects_an_int8_k_that_overflows_int32_before_patching():
    from tpukernels.integrations.transformers import apply_tpukernels
    from tpukernels.library.quantized_matmul_ops import INT32_MAX_K

    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(INT32_MAX_K + 1, 1))
    with pytest.raises(ArgumentError, match="overflow int32"):
        apply_tpukernels(model, attention=False, quantize="int8", x_quant="int8")
    assert type(model[0]) is torch.nn.LayerNorm and type(model[1]) is torch.nn.Linear


@pytest.mark.parametrize("quantize, x_quant", [("int8", "int8"), ("fp8", "fp8"), ("int8", None)])
def test_apply_tpukernels_matching_pairs_still_patch_and_match_float64(quantize, x_quant):
    from tpukernels.integrations.transformers import apply_tpukernels

    lin = _linear()
    model = torch.nn.Sequential(lin)
    x = torch.randn(5, 64)
    want = x.double() @ lin.weight.detach().double().T + lin.bias.detach().double()
    counts = apply_tpukernels(model, attention=False, quantize=quantize, x_quant=x_quant)
    assert counts["quantized"] == 1 and isinstance(model[0], TPUQuantLinear) and model[0].x_quant == x_quant
    with torch.no_grad():
        y = model(x)
    tol = 0.02 if quantize == "int8" else 0.1  # fp8 e4m3 keeps 3 mantissa bits (x and w both rounded)
    assert (y.double() - want).abs().max() <= tol * want.abs().max()


def test_apply_tpukernels_leaves_moe_routers_in_full_precision():
    from tpukernels.integrations.transformers import apply_tpukernels

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(16, 4)  # Mixtral / Qwen-MoE router
            self.shared_expert_gate = torch.nn.Linear(16, 1)
            self.up_proj = torch.nn.Linear(16, 32)

    b = Block()
    counts = apply_tpukernels(b, attention=False, quantize="int8")
    assert counts["quantized"] == 1 and type(b.gate) is torch.nn.Linear
    assert type(b.shared_expert_gate) is torch.nn.Linear and isinstance(b.up_proj, TPUQuantLinear)


def test_quantize_weight_refuses_non_finite_rows():
    w = torch.randn(6, 8)
    w[3, 5] = float("nan")
    with pytest.raises(ArgumentError, match="row 3"):
        quantize_weight(w)
    w[3, 5] = float("inf")
    with pytest.raises(ArgumentError, match="row 3"):
        quantize_weight(w)


@pytest.mark.parametrize("config", ["bm=128", 7])
def test_non_dict_config_is_a_config_error(config):
    w_q, w_s = quantize_weight(torch.randn(32, 64), "int8")
    with pytest.raises(ConfigError, match="config must be a dict"):
        qmm_fn(torch.randn(4, 64), w_q, w_s, config=config)


@pytest.mark.parametrize("bad", ["x", "w_q", "w_scale"])
def test_non_tensor_operands_name_the_argument(bad):
    w_q, w_s = quantize_weight(torch.randn(32, 64), "int8")
    args = {"x": torch.randn(4, 64), "w_q": w_q, "w_scale": w_s}
    args[bad] = args[bad].numpy() if bad != "w_q" else args[bad].tolist()
    with pytest.raises(ArgumentError, match=f"{bad} must be a torch.Tensor"):
        qmm_fn(args["x"], args["w_q"], args["w_scale"])
