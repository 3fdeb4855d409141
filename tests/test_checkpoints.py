"""Quantized checkpoints (issue 28): save_pretrained -> from_pretrained of tpukernels-quantized models
(tpukernels.integrations.quantizers). Tiny models built offline from a config, no hub."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tpukernels.integrations.transformers as tki  # noqa: E402  (registers quant_method "tpukernels")
from tpukernels.errors import ArgumentError, DTypeError  # noqa: E402
from tpukernels.integrations import quantizers as tkq  # noqa: E402
from tpukernels.library.quantized_matmul_ops import TPUQuantLinear  # noqa: E402


def _tiny_qwen2(layers=1):
    """Qwen2: q/k/v projections carry a bias, so the round trip covers w_q, w_scale and bias."""
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so fp8 / NaN payloads compare exactly)."""
    return t.detach().contiguous().view(torch.uint8)


@pytest.mark.parametrize("qdtype", ["int8", "float8_e5m2"])
def test_save_pretrained_round_trip_is_bit_identical(tmp_path, qdtype):
    """A model quantized by apply_tpukernels, saved and reloaded with plain AutoModelForCausalLM.from_pretrained,
    has the same modules and bit-identical state (every tensor: w_q, w_scale, bias and the float ones) and the
    same logits. Before the quantizer existed the reload had random linears (w_q / w_scale were "unexpected")."""
    model = _tiny_qwen2()
    counts = tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize=qdtype)
    assert counts["quantized"] == 7
    model.save_pretrained(tmp_path)
    saved = json.load(open(os.path.join(tmp_path, "config.json")))["quantization_config"]
    assert saved["quant_method"] == "tpukernels" and saved["weight_dtype"] == qdtype
    assert "model.layers.0.mlp.down_proj" in saved["modules"] and "lm_head" not in saved["modules"]

    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(back.model.layers[0].self_attn.q_proj, TPUQuantLinear)
    assert type(back.lm_head) is torch.nn.Linear
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(_bits(want[k]), _bits(got[k])), k
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, back(input_ids=ids).logits)
    # a second save of the reloaded model writes the same config
    back.save_pretrained(tmp_path / "again")
    assert json.load(open(tmp_path / "again" / "config.json"))["quantization_config"] == saved


def test_reload_in_another_dtype_keeps_quantized_tensors(tmp_path):
    """from_pretrained(dtype=bfloat16): w_q and w_scale keep their dtypes and bits (a bf16 scale would lose
    precision); biases follow the requested dtype like every float parameter."""
    model = _tiny_qwen2()
    tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize="int8")
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, mod in model.named_modules():
        if isinstance(mod, TPUQuantLinear):
            other = back.get_submodule(name)
            assert torch.equal(other.w_q, mod.w_q) and other.w_scale.dtype == torch.float32
            assert torch.equal(other.w_scale, mod.w_scale)
            if mod.bias is not None:
                assert other.bias.dtype == torch.bfloat16 and torch.equal(other.bias, mod.bias.bfloat16())


def test_missing_quantized_tensor_raises(tmp_path):
    """A checkpoint whose config lists a quantized module but lacks one of its tensors: a typed error naming
    the tensor (transformers alone would leave the buffer uninitialised and only log it)."""
    from safetensors.torch import load_file, save_file

    model = _tiny_qwen2()
    tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize="int8")
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    sd = load_file(path)
    del sd["model.layers.0.mlp.up_proj.w_scale"]
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ArgumentError, match=r"model\.layers\.0\.mlp\.up_proj\.w_scale"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_bad_tpukernels_quantization_configs(tmp_path):
    """Unknown key, unknown weight dtype, a listed module that is no nn.Linear of the model: typed errors
    naming the key / value / module."""
    with pytest.raises(ArgumentError, match="'group_size'"):
        tkq.TpuKernelsConfig("int8", None, [], group_size=128)
    with pytest.raises(DTypeError, match="int4"):
        tkq.TpuKernelsConfig("int4")
    with pytest.raises(ArgumentError, match="format_version"):
        tkq.TpuKernelsConfig("int8", format_version=2)
    model = _tiny_qwen2()
    tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize="int8")
    model.config.quantization_config.modules.append("model.layers.0.input_layernorm")
    model.save_pretrained(tmp_path)
    with pytest.raises(ArgumentError, match="input_layernorm"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_requantizing_with_another_scheme_raises_before_patching():
    model = _tiny_qwen2()
    tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize="int8",
                         quantize_skip=("lm_head", "down_proj"))
    with pytest.raises(ArgumentError, match="already quantized"):
        tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize="float8_e5m2")
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear  # nothing patched
    tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize="int8", quantize_skip=("lm_head",))
    assert len(model.config.quantization_config.modules) == 7


# ----------------------------------------------------------------------------------------------- real formats
# Tiny checkpoints in each format, written here from the formats' documented tensor names and packing (not with
# tpukernels' own repacking code), loaded with tpukernels.integrations.checkpoints.from_pretrained.
from tpukernels.integrations import checkpoints as tkc  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _tiny_llama_cfg():
    # every linear 64 -> 64: one kernel compile per format
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=96, max_position_embeddings=64)


def _pack32(v: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int32 words of 8 nibbles along ``dim``: nibble i of word c = element 8c + order[i] (two's complement)."""
    v = v.to(torch.int64)
    if dim == 0:
        v = v.T
    w = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        w |= v[:, order[i]::8] << (4 * i)
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return w.T.contiguous() if dim == 0 else w


def _write(tmp_path, qc: dict, per_linear) -> dict:
    """Save a tiny Llama checkpoint: float tensors from a seeded stock model, each linear's weight replaced by
    ``per_linear(name, g)`` -> (tensors, float64 dequantized weight). Returns {linear name: dequantized W}."""
    from safetensors.torch import save_file

    cfg = _tiny_llama_cfg()
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(cfg)
    sd = {k: v.contiguous() for k, v in stock.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    ref = {}
    for lin in LINEARS:
        name = f"model.layers.0.{lin}"
        del sd[f"{name}.weight"]
        tensors, W = per_linear(name, g)
        sd.update({f"{name}.{k}": v.contiguous() for k, v in tensors.items()})
        ref[name] = W
    cfg.quantization_config = qc
    cfg.save_pretrained(tmp_path)
    save_file(sd, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    return ref


def _dequantized(mod) -> torch.Tensor:
    """float64 [N, in_features] weight a loaded module multiplies by (in x's original column order)."""
    import importlib

    qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")
    if isinstance(mod, qmm.TPUBlockQuantLinear):
        W = qmm.dequantize_blockwise(mod.w_q, mod.w_scale, mod.block_size, mod.w_zero_point)[:, :mod.in_features]
        if mod.in_perm is not None:
            W = W[:, torch.argsort(mod.in_perm)]
        return W
    return mod.w_q.double() * mod.w_scale.double()[:, None]


def _check_loaded(tmp_path, ref, rms_tol=None):
    """Every converted weight equals the format's float64 dequantization exactly; the logits match a float64 run
    of the stock model with those weights (2e-4: f32 vs f64 through one layer), or, for w8a8 (activations
    quantized per token), within ``rms_tol`` of the logits' RMS."""
    model = tkc.from_pretrained(str(tmp_path), dtype=torch.float32)
    for name, W in ref.items():
        got = _dequantized(model.get_submodule(name))
        assert got.shape == W.shape and torch.equal(got, W), name
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(_tiny_llama_cfg()).double()
    with torch.no_grad():
        for name, W in ref.items():
            stock.get_submodule(name).weight.copy_(W)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = stock(input_ids=ids).logits
        got = model(input_ids=ids).logits.double()
    if rms_tol is None:
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    else:
        assert (got - want).pow(2).mean().sqrt() <= rms_tol * want.pow(2).mean().sqrt()
    with pytest.raises(ValueError, match="not serializable|loaded into tpukernels"):
        model.save_pretrained(tmp_path / "resave")
    return model


def _int4_groups(g, N, K, gs):
    q = torch.randint(0, 16, (N, K), generator=g)
    z = torch.randint(1, 16, (N, K // gs), generator=g)
    s = (torch.rand(N, K // gs, generator=g) * 0.02 + 0.005).half()
    return q, z, s


def test_gptq_act_order_v1(tmp_path):
    """GPTQ 4-bit, group_size 32, desc_act with a shuffled g_idx, checkpoint_format 'gptq' (zeros stored - 1):
    qweight [K/8, N] packed along K, qzeros [G, N/8] along N, scales [G, N] fp16, g_idx [K]."""
    gs = 32

    def per_linear(name, g):
        N = K = 64
        q, z, s = _int4_groups(g, N, K, gs)
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[torch.randperm(K, generator=g)] = torch.arange(K, dtype=torch.int32) // gs
        W = (q.double() - z.double()[:, g_idx.long()]) * s.double()[:, g_idx.long()]
        return dict(qweight=_pack32(q.T, 0), qzeros=_pack32((z - 1).T, 1), scales=s.T, g_idx=g_idx), W

    ref = _write(tmp_path, dict(quant_method="gptq", bits=4, group_size=gs, desc_act=True, sym=False,
                                checkpoint_format="gptq"), per_linear)
    model = _check_loaded(tmp_path, ref)
    assert model.model.layers[0].mlp.up_proj.in_perm is not None


def test_awq_gemm(tmp_path):
    """AWQ GEMM: qweight [K, N/8] packed along N in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7], qzeros
    [G, N/8] likewise, scales [G, N] fp16, W = (q - z) * s."""
    gs, order = 32, (0, 2, 4, 6, 1, 3, 5, 7)

    def per_linear(name, g):
        q, z, s = _int4_groups(g, 64, 64, gs)
        W = (q.double() - z.double().repeat_interleave(gs, 1)) * s.double().repeat_interleave(gs, 1)
        return dict(qweight=_pack32(q.T, 1, order), qzeros=_pack32(z.T, 1, order), scales=s.T), W

    ref = _write(tmp_path, dict(quant_method="awq", bits=4, group_size=gs, zero_point=True, version="gemm"),
                 per_linear)
    _check_loaded(tmp_path, ref)


def _ct(fmt, weights, acts=None):
    return dict(quant_method="compressed-tensors", format=fmt, ignore=["lm_head"],
                config_groups=dict(group_0=dict(targets=["Linear"], weights=weights, input_activations=acts)))


def test_compressed_tensors_w4a16(tmp_path):
    """pack-quantized W4A16, symmetric, group 32: weight_packed [N, K/8] int32 (nibble i = column 8c + i, value
    + 8), weight_scale [N, G] bf16, weight_shape."""
    def per_linear(name, g):
        qs = torch.randint(-8, 8, (64, 64), generator=g)
        s = (torch.rand(64, 2, generator=g) * 0.02 + 0.005).bfloat16()
        W = qs.double() * s.double().repeat_interleave(32, 1)
        return dict(weight_packed=_pack32(qs + 8, 1), weight_scale=s, weight_shape=torch.tensor([64, 64])), W

    ref = _write(tmp_path, _ct("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                                      group_size=32)), per_linear)
    _check_loaded(tmp_path, ref)


def test_compressed_tensors_w8a8_int8(tmp_path):
    """int-quantized W8A8: weight [N, K] int8, weight_scale [N, 1], dynamic per-token int8 activations -> our
    w8a8 int8 (TPUQuantLinear x_quant='int8'); the logits then carry the activations' rounding: 10% of RMS."""
    def per_linear(name, g):
        q = torch.randint(-127, 128, (64, 64), generator=g).to(torch.int8)
        s = torch.rand(64, 1, generator=g) * 0.002 + 0.0005
        return dict(weight=q, weight_scale=s), q.double() * s.double()

    ref = _write(tmp_path, _ct("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                               dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)),
                 per_linear)
    model = _check_loaded(tmp_path, ref, rms_tol=0.10)
    assert model.model.layers[0].mlp.up_proj.x_quant == "int8"


def test_fp8_block_scaled(tmp_path):
    """quant_method fp8 (DeepSeek-V3 style): weight float8_e4m3fn [N, K], weight_scale_inv [N/bn, K/bk] f32 (the
    dequantization multiplier), weight_block_size [32, 32] here (128 x 128 in DeepSeek-V3; 32 keeps K=64 in two
    blocks)."""
    def per_linear(name, g):
        w = (torch.randn(64, 64, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(2, 2, generator=g) * 0.001 + 1e-4
        W = w.double() * s.double().repeat_interleave(32, 0).repeat_interleave(32, 1)
        return dict(weight=w, weight_scale_inv=s), W

    ref = _write(tmp_path, dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3",
                                weight_block_size=[32, 32]), per_linear)
    _check_loaded(tmp_path, ref)


def test_unsupported_quantization_configs_name_the_key():
    cases = [
        (dict(quant_method="gptq", bits=3, group_size=128), "bits"),
        (dict(quant_method="gptq", bits=4, checkpoint_format="marlin"), "checkpoint_format"),
        (dict(quant_method="awq", bits=4, version="gemv"), "version"),
        (dict(quant_method="fp8", activation_scheme="static", weight_block_size=[128, 128]), "activation_scheme"),
        (dict(quant_method="fp8", activation_scheme="dynamic"), "weight_block_size"),
        (dict(quant_method="bitsandbytes"), "quant_method"),
        (dict(_ct("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=128)),
              sparsity_config={"format": "sparse-24"}), "sparsity_config"),
        (_ct("marlin-24", dict(num_bits=4)), "format"),
        (_ct("int-quantized", dict(num_bits=8, type="int", strategy="channel"),
             dict(num_bits=8, type="int", strategy="tensor", dynamic=False)), "input_activations"),
    ]
    for qc, key in cases:
        with pytest.raises(ArgumentError, match=f"quantization_config: .*{key}"):
            tkc.parse_quantization_config(qc)
