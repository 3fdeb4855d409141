"""save_pretrained -> from_pretrained of models with quantized MoE experts (issue 28; quantize_moe_experts and the
"tpukernels" HF quantizer, tpukernels.integrations.quantizers). A tiny Mixtral built offline from a config.

Before the quantizer knew experts, such a checkpoint reloaded as a float Mixtral: the ``*_q`` / ``*_scale`` /
``*_zero_point`` tensors were "UNEXPECTED", ``gate_up_proj`` / ``down_proj`` "MISSING" and drawn at random (only a
load report said so; the logits moved by ~5e-2). Here every buffer must come back bit-identical, the modules
quantized, and the logits equal.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tpukernels.integrations.transformers as tki  # noqa: E402  (registers quant_method "tpukernels")
from tpukernels.errors import ArgumentError, DTypeError  # noqa: E402
from tpukernels.integrations import quantizers as tkq  # noqa: E402
from tpukernels.integrations.moe import quantize_moe_experts  # noqa: E402
from tpukernels.library.quantized_matmul_ops import TPUQuantLinear  # noqa: E402

EXPERTS = "model.layers.0.mlp.experts"


def _tiny_mixtral(seed=0):
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg).eval()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _assert_same_state(want, got):
    assert set(want) == set(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(_bits(want[k]), _bits(got[k])), k


def _ids(seed=3):
    return torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(seed))


# (dtype, block_size, asymmetric): every expert format quantize_moe_experts takes, per channel and block scales
# make test keeps one per family (int8 per channel, fp8, int4 asymmetric blocks, fp4); test-slow runs all seven
SCHEMES = [("int8", None, False), pytest.param("float8_e5m2", None, False, marks=pytest.mark.slow),
           ("float8_e4m3fn", None, False), pytest.param("int8", 32, False, marks=pytest.mark.slow),
           ("int4", 32, True), pytest.param("int4", 64, False, marks=pytest.mark.slow), ("fp4", 32, False)]


@pytest.mark.parametrize("dtype, block_size, asym", SCHEMES, ids=lambda v: str(v))
def test_quantized_experts_round_trip_bit_identical(tmp_path, dtype, block_size, asym):
    """quantize_moe_experts -> save_pretrained -> AutoModelForCausalLM.from_pretrained: the config records the
    scheme, the experts come back quantized (no float parameters), every tensor (q, scales, zero points and the
    float ones) bit-identical with its dtype, and the logits equal exactly."""
    model = _tiny_mixtral()
    quantize_moe_experts(model, dtype=dtype, block_size=block_size, asymmetric=asym)
    model.save_pretrained(tmp_path)
    saved = json.load(open(os.path.join(tmp_path, "config.json")))["quantization_config"]
    assert saved["quant_method"] == "tpukernels" and saved["modules"] == []
    assert saved["experts"] == {EXPERTS: {"dtype": dtype, "block_size": block_size, "asymmetric": asym}}

    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    e = back.get_submodule(EXPERTS)
    assert e.gate_up_proj is None and e.down_proj is None and back.config._experts_implementation == "tpukernels"
    assert (e.gate_up_proj_zero_point is not None) == asym
    _assert_same_state(model.state_dict(), back.state_dict())
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, back(input_ids=_ids()).logits)
    back.save_pretrained(tmp_path / "again")  # the reloaded model saves the same config
    assert json.load(open(tmp_path / "again" / "config.json"))["quantization_config"] == saved


def test_reload_in_bfloat16_keeps_expert_buffers(tmp_path):
    """from_pretrained(dtype=bfloat16): the quantized buffers keep their dtypes and bits (float32 scales and zero
    points included); the float parameters follow the requested dtype."""
    model = _tiny_mixtral()
    quantize_moe_experts(model, dtype="int4", block_size=32, asymmetric=True)
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for k in want:
        if ".experts." in k:
            assert want[k].dtype == got[k].dtype and torch.equal(_bits(want[k]), _bits(got[k])), k
        else:
            assert got[k].dtype == torch.bfloat16, k
    assert got[f"{EXPERTS}.down_proj_scale"].dtype == torch.float32


@pytest.mark.parametrize("tensor", ["down_proj_zero_point", "gate_up_proj_q", "gate_up_proj_scale"])
def test_missing_expert_tensor_raises_naming_it(tmp_path, tensor):
    from safetensors.torch import load_file, save_file

    model = _tiny_mixtral()
    quantize_moe_experts(model, dtype="int4", block_size=32, asymmetric=True)
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    sd = load_file(path)
    (key,) = [k for k in sd if k.endswith(f"experts.{tensor}")]  # transformers may rename the prefix on save
    del sd[key]
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ArgumentError, match=rf"{EXPERTS}\.{tensor}\b"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_experts_and_linears_together_round_trip(tmp_path):
    """Quantized experts and quantized linears (apply_tpukernels(quantize=...)) in one model, in either order: one
    config lists both; the reload has both kinds of modules, bit-identical state and equal logits."""
    model = _tiny_mixtral(seed=1)
    quantize_moe_experts(model, dtype="int4", block_size=32)
    counts = tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize="int8")
    assert counts["quantized"] >= 4
    qc = model.config.quantization_config
    assert qc.weight_dtype == "int8" and len(qc.modules) == counts["quantized"] and list(qc.experts) == [EXPERTS]
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(back.get_submodule("model.layers.0.self_attn.q_proj"), TPUQuantLinear)
    assert back.get_submodule(EXPERTS).gate_up_proj_q.dtype == torch.uint8
    _assert_same_state(model.state_dict(), back.state_dict())
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids(4)).logits, back(input_ids=_ids(4)).logits)

    other = _tiny_mixtral(seed=2)  # the other order records both as well
    tki.apply_tpukernels(other, attention=False, rms_norm=False, quantize="float8_e5m2")
    quantize_moe_experts(other, dtype="int8")
    qc = other.config.quantization_config
    assert qc.weight_dtype == "float8_e5m2" and qc.modules and qc.experts[EXPERTS]["dtype"] == "int8"


def test_linears_only_config_unchanged_and_bad_expert_configs(tmp_path):
    """A config without quantized experts is written exactly as before the ``experts`` field (old readers load
    it); bad ``experts`` entries raise typed errors naming the key / module; a model with another method's
    quantization config is refused before anything is quantized."""
    assert "experts" not in tkq.TpuKernelsConfig("int8", None, ["a"]).to_dict()
    assert tkq.TpuKernelsConfig.from_dict({"quant_method": "tpukernels", "weight_dtype": "int8", "modules": ["a"],
                                           "format_version": 1}).experts == {}
    with pytest.raises(ArgumentError, match="'group_size'"):
        tkq.TpuKernelsConfig(experts={EXPERTS: {"dtype": "int4", "group_size": 32}})
    with pytest.raises(ArgumentError, match="int4 experts need a block_size"):
        tkq.TpuKernelsConfig(experts={EXPERTS: {"dtype": "int4", "block_size": None}})
    with pytest.raises(ArgumentError, match="block_size 48"):
        tkq.TpuKernelsConfig(experts={EXPERTS: {"dtype": "int8", "block_size": 48}})
    with pytest.raises(DTypeError, match="'int2'"):
        tkq.TpuKernelsConfig(experts={EXPERTS: {"dtype": "int2"}})
    with pytest.raises(ArgumentError, match="asymmetric"):
        tkq.TpuKernelsConfig(experts={EXPERTS: {"dtype": "fp4", "block_size": 32, "asymmetric": True}})

    model = _tiny_mixtral()
    quantize_moe_experts(model, dtype="int8")
    model.config.quantization_config.experts["model.layers.0.mlp.gate"] = {"dtype": "int8", "block_size": None,
                                                                           "asymmetric": False}
    model.save_pretrained(tmp_path)
    with pytest.raises(ArgumentError, match=r"'model\.layers\.0\.mlp\.gate' is not a float experts module"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)

    fresh = _tiny_mixtral()
    fresh.config.quantization_config = transformers.BitsAndBytesConfig(load_in_8bit=True)
    with pytest.raises(ArgumentError, match="already has a quantization_config"):
        quantize_moe_experts(fresh, dtype="int8")
    assert isinstance(fresh.get_submodule(EXPERTS).gate_up_proj, torch.nn.Parameter)  # untouched


@pytest.mark.parametrize("tensor, change, match", [
    ("gate_up_proj_q", lambda v: v.to(torch.int32), r"is int32 \[4, 256, 32\], expected uint8 \[4, 256, 32\]"),
    ("down_proj_q", lambda v: v.view(torch.int8), r"is int8 \[4, 64, 64\], expected uint8 \[4, 64, 64\]"),
])
def test_malformed_expert_tensor_raises_naming_it(tmp_path, tensor, change, match):
    """issue 36 item 3: an expert tensor of another integer dtype than its buffer raises ArgumentError naming it
    (before: loaded in the checkpoint's dtype and run as is). transformers renames these keys on load, so the
    check runs on the loaded buffers (a size mismatch is transformers' own RuntimeError before that)."""
    from safetensors.torch import load_file, save_file

    model = _tiny_mixtral()
    quantize_moe_experts(model, dtype="int4", block_size=32, asymmetric=True)
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    sd = load_file(path)
    (key,) = [k for k in sd if k.endswith(f"experts.{tensor}")]
    sd[key] = change(sd[key]).contiguous()
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ArgumentError, match=rf"checkpoint's {EXPERTS}\.{tensor} {match}"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
