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
from tpukernels.library.quantized_matmul import TPUQuantLinear  # noqa: E402


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
