"""Quantized checkpoints (issue 28): save_pretrained -> from_pretrained of tpukernels-quantized models
(tpukernels.integrations.quantizers). Tiny models built offline from a config, no hub."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

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


@pytest.mark.parametrize("key, change, match", [
    ("w_q", lambda v: v.int(), r"is int32 \[128, 64\], expected int8 \[128, 64\]"),
    ("w_q", lambda v: v[:-2], r"is int8 \[126, 64\], expected int8 \[128, 64\]"),
    ("w_scale", lambda v: v.bfloat16(), r"is bfloat16 \[128\], expected float32 \[128\]"),
    ("w_scale", lambda v: v[None], r"is float32 \[1, 128\], expected float32 \[128\]"),
], ids=["w_q-int32", "w_q-short", "w_scale-bf16", "w_scale-2d"])
def test_malformed_quantized_tensor_raises(tmp_path, key, change, match):
    """issue 36 item 3 for the "tpukernels" format: a quantized tensor of another dtype or shape than its buffer
    raises ArgumentError naming it before the weights load (before: an int32 w_q loaded as int32 in place of the
    int8 buffer, a bf16 scale was cast, a short w_q gave transformers' RuntimeError)."""
    from safetensors.torch import load_file, save_file

    model = _tiny_qwen2()
    tki.apply_tpukernels(model, attention=False, rms_norm=False, quantize="int8")
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    sd = load_file(path)
    name = f"model.layers.0.mlp.up_proj.{key}"
    sd[name] = change(sd[name]).contiguous()
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ArgumentError, match=re.escape(name) + " in .*model.safetensors' " + match):
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
        fmt = mod.fmt if mod.fmt in ("fp4", "int4n") else None  # int4 loads packed along N (even N)
        W = qmm.dequantize_blockwise(mod.w_q, mod.w_scale, mod.block_size, mod.w_zero_point, fmt)
        W = W[:, :mod.in_features]
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
        (dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[128, 100]), "weight_block_size"),
        (dict(quant_method="gptq", bits=4, group_size=48), "group_size"),
        (_ct("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=16)), "group_size"),
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


# ------------------------------------------------------------------------ incomplete or malformed checkpoints
# issue 36 item 3: every tensor a format needs must be present with its exact shape and dtype, or the load raises
# ArgumentError naming the module and the tensor (before: a compressed-tensors int8 linear without weight_scale
# loaded as an nn.Linear of raw int8 values, an fp8 one without weight_scale_inv as unscaled fp8 values, a GPTQ
# qweight two rows short along K built its last 16 input columns from padding nibbles).
import hashlib  # noqa: E402

BAD = "model.layers.0.self_attn.v_proj"  # the last quantized linear in load order: the others convert before it


def _rep(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.double().repeat_interleave(n, 1)


def _gptq_v2(name, g):
    q, z, s = _int4_groups(g, 64, 64, 32)
    return (dict(qweight=_pack32(q.T, 0), qzeros=_pack32(z.T, 1), scales=s.T,
                 g_idx=torch.arange(64, dtype=torch.int32) // 32), (q.double() - _rep(z, 32)) * _rep(s, 32))


def _awq(name, g):
    q, z, s = _int4_groups(g, 64, 64, 32)
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return (dict(qweight=_pack32(q.T, 1, order), qzeros=_pack32(z.T, 1, order), scales=s.T),
            (q.double() - _rep(z, 32)) * _rep(s, 32))


def _ct_pack_asym(name, g):
    qs = torch.randint(-8, 8, (64, 64), generator=g)
    zp = torch.randint(-8, 8, (64, 2), generator=g)
    s = (torch.rand(64, 2, generator=g) * 0.02 + 0.005).bfloat16()
    return (dict(weight_packed=_pack32(qs + 8, 1), weight_scale=s, weight_zero_point=_pack32(zp + 8, 0),
                 weight_shape=torch.tensor([64, 64])), (qs.double() - _rep(zp, 32)) * _rep(s, 32))


def _ct_int8(name, g):
    q = torch.randint(-127, 128, (64, 64), generator=g).to(torch.int8)
    s = torch.rand(64, 1, generator=g) * 0.002 + 0.0005
    return dict(weight=q, weight_scale=s), q.double() * s.double()


def _ct_fp8(name, g):
    w = (torch.randn(64, 64, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = (torch.rand(64, 1, generator=g) * 0.001 + 1e-4).bfloat16()
    return dict(weight=w, weight_scale=s), w.double() * s.double()


def _fp8_block(name, g):
    w = (torch.randn(64, 64, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, generator=g) * 0.001 + 1e-4
    return dict(weight=w, weight_scale_inv=s), w.double() * s.double().repeat_interleave(32, 0).repeat_interleave(32, 1)


_W4 = dict(num_bits=4, type="int", strategy="group", group_size=32)
_A8 = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
#: format -> (quantization_config, per-linear tensors, the tensors it needs (g_idx: optional), logits rms_tol)
FORMATS = {
    "gptq": (dict(quant_method="gptq", bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2"), _gptq_v2,
             ("qweight", "qzeros", "scales", "g_idx"), None),
    "awq": (dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm"), _awq,
            ("qweight", "qzeros", "scales"), None),
    "ct-pack": (_ct("pack-quantized", dict(_W4, symmetric=False)), _ct_pack_asym,
                ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"), None),
    "ct-int8": (_ct("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"), _A8), _ct_int8,
                ("weight", "weight_scale"), 0.10),
    "ct-fp8": (_ct("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel")), _ct_fp8,
               ("weight", "weight_scale"), None),
    "fp8-block": (dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[32, 32]),
                  _fp8_block, ("weight", "weight_scale_inv"), None),
}


def _wrong_dtype(v: torch.Tensor) -> torch.Tensor:
    """A plausible wrong dtype: packed words as int64, int8 as uint8, fp8 weights dequantized to bf16, float
    scales as float64, index tensors as float."""
    if v.dtype == torch.int32:
        return v.long() if v.dim() == 2 else v.float()
    return {torch.int8: lambda: v.view(torch.uint8), torch.float8_e4m3fn: lambda: v.to(torch.bfloat16),
            torch.int64: lambda: v.float()}.get(v.dtype, lambda: v.double())()


MUTATIONS = {
    "missing": lambda t, k: t.pop(k),
    "shape": lambda t, k: t.__setitem__(k, t[k][:max(1, t[k].shape[0] - 2)]),  # e.g. qweight two rows short
    "dtype": lambda t, k: t.__setitem__(k, _wrong_dtype(t[k])),
}
CASES = [(f, k, m) for f, (_, _, keys, _) in FORMATS.items() for k in keys for m in MUTATIONS
         if not (m == "missing" and k in ("g_idx", "weight_shape"))]  # optional tensors


def _write_bad(tmp_path, fmt, mutate=None):
    qc, gen, _, _ = FORMATS[fmt]

    def per_linear(name, g):
        t, W = gen(name, g)
        if name == BAD and mutate is not None:
            mutate(t)
        return t, W

    return _write(tmp_path, qc, per_linear)


def _digest(path) -> dict:
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest() for f in sorted(os.listdir(path))}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_loads_exactly(tmp_path, fmt):
    """The valid checkpoints the malformed cases below start from load exactly (float64 dequantization bit for bit,
    logits against a float64 run): so each error below comes from the one changed tensor. Covers the asymmetric
    pack-quantized zero points and compressed-tensors fp8 channel scales too."""
    ref = _write_bad(tmp_path, fmt)
    _check_loaded(tmp_path, ref, rms_tol=FORMATS[fmt][3])


@pytest.mark.parametrize("fmt, key, how", CASES, ids=lambda v: str(v))
def test_missing_or_malformed_tensor_raises(tmp_path, fmt, key, how):
    """One linear's tensor missing, two rows short (or one, for a 2-row scale) or of a wrong dtype: ArgumentError
    naming ``<module>.<tensor>`` and the rule; the checkpoint files are unchanged."""
    _write_bad(tmp_path, fmt, lambda t: MUTATIONS[how](t, key))
    before = _digest(tmp_path)
    word = {"missing": "is missing", "shape": "has shape", "dtype": "has dtype"}[how]
    with pytest.raises(ArgumentError, match=re.escape(f"{BAD}.{key}") + f" {word}"):
        tkc.from_pretrained(str(tmp_path))
    assert _digest(tmp_path) == before


def test_convert_linears_is_all_or_nothing(tmp_path):
    """convert_linears on the caller's model: a bad tensor in the last linear leaves every linear of the model as it
    was (before: the linears converted before it stayed swapped)."""
    from safetensors.torch import load_file

    scheme = tkc.parse_quantization_config(FORMATS["ct-int8"][0])
    _write_bad(tmp_path, "ct-int8", lambda t: t.pop("weight_scale"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_llama_cfg())
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ArgumentError, match=re.escape(f"{BAD}.weight_scale")):
        tkc.convert_linears(model, load_file(os.path.join(tmp_path, "model.safetensors")), scheme)
    assert all(type(model.get_submodule(f"model.layers.0.{n}")) is torch.nn.Linear for n in LINEARS)
    got = model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("fmt, mutate, match", [
    ("fp8-block", lambda t: t.__setitem__("input_scale", torch.ones(1)), r"\.input_scale .*is not a tensor"),
    ("gptq", lambda t: t.__setitem__("g_idx", torch.full((64,), 2, dtype=torch.int32)), r"\.g_idx holds group"),
    ("gptq", lambda t: t.__setitem__("g_idx", (torch.arange(64, dtype=torch.int32) >= 40).int()),
     r"\.g_idx does not put group_size = 32 columns in each group"),
    ("ct-pack", lambda t: t.__setitem__("weight_shape", torch.tensor([64, 56])), r"\.weight_shape is \[64, 56\]"),
    ("ct-int8", lambda t: t.__setitem__("weight_zero_point", torch.ones(64, 1, dtype=torch.int8)),
     r"\.weight_zero_point .*symmetric scheme has no zero points"),
    ("ct-int8", lambda t: t.__setitem__("weight", t["weight"].float()), r"\.weight has dtype float32"),
], ids=["unknown-tensor", "g_idx-range", "g_idx-groups", "weight_shape", "symmetric-nonzero-zp",
        "float-weight-with-scale"])
def test_inconsistent_tensor_values_raise(tmp_path, fmt, mutate, match):
    """Tensors the scheme does not read, index tensors out of range, a weight_shape other than the linear's, a
    nonzero zero point in a symmetric scheme: named, never ignored."""
    _write_bad(tmp_path, fmt, mutate)
    with pytest.raises(ArgumentError, match=re.escape(BAD) + match):
        tkc.from_pretrained(str(tmp_path))


def test_symmetric_all_zero_zero_points_load(tmp_path):
    """Older compressed-tensors wrote all-zero zero points for symmetric schemes: nothing to apply, they load."""
    ref = _write_bad(tmp_path, "ct-int8", lambda t: t.__setitem__("weight_zero_point",
                                                                   torch.zeros(64, 1, dtype=torch.int8)))
    _check_loaded(tmp_path, ref, rms_tol=0.10)


# ----------------------------------------------------------------------------------- broken checkpoint folders
# issue 36 item 8: a truncated / 0-byte / corrupt-header safetensors file, a corrupt config.json and a folder
# without weights surfaced as transformers' (or safetensors') own errors before our loader ran; now ArgumentError
# naming the file, raised before transformers reads anything.
def _valid_dir(tmp_path):
    _write_bad(tmp_path, "fp8-block")
    return tmp_path


def _rewrite(path, f):
    data = open(path, "rb").read()
    open(path, "wb").write(f(data))


def _corrupt_header(data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")  # safetensors: 8-byte header length, then the JSON header
    return data[:8] + b"[" + data[9:8 + n] + data[8 + n:]


@pytest.mark.parametrize("how, corrupt, match", [
    ("zero-bytes", lambda d: b"", "header too small"),
    ("truncated", lambda d: d[:-100], "not fully covered"),
    ("corrupt-header", _corrupt_header, "invalid JSON"),
])
def test_broken_safetensors_file_is_named(tmp_path, how, corrupt, match):
    d = _valid_dir(tmp_path)
    f = os.path.join(d, "model.safetensors")
    _rewrite(f, corrupt)
    with pytest.raises(ArgumentError, match=re.escape(repr(f)) + f" is not a valid safetensors file .*{match}"):
        tkc.from_pretrained(str(d))


@pytest.mark.parametrize("how, text, match", [
    ("truncated-json", lambda s: s[: len(s) // 2], "is not a readable JSON file"),
    ("not-an-object", lambda s: "[1, 2]", "holds a JSON list, expected an object"),
    ("not-utf8", lambda s: "\udcff", "is not a readable JSON file"),
    ("unknown-model-type", lambda s: s.replace('"llama"', '"no-such-model"'), "transformers cannot read"),
])
def test_broken_config_json_is_named(tmp_path, how, text, match):
    d = _valid_dir(tmp_path)
    f = os.path.join(d, "config.json")
    s = open(f).read()
    open(f, "wb").write(text(s).encode("utf-8", "surrogateescape"))
    named = re.escape(repr(f))
    with pytest.raises(ArgumentError, match=f"{match} {named}" if how == "unknown-model-type" else f"{named} {match}"):
        tkc.from_pretrained(str(d))


def test_folder_without_config_or_weights_is_named(tmp_path):
    d = _valid_dir(tmp_path)
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "pytorch_model.bin"))
    with pytest.raises(ArgumentError, match=r"no \*\.safetensors file in .*pytorch_model\.bin"):
        tkc.from_pretrained(str(d))
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ArgumentError, match=re.escape(repr(os.path.join(d, "config.json"))) + " does not exist"):
        tkc.from_pretrained(str(d))
    with pytest.raises(ArgumentError, match="is not a directory"):
        tkc.from_pretrained(str(d / "nothing-here"))


def test_shards_index_and_duplicates_are_checked(tmp_path):
    """An index naming a shard that is not there, and one tensor in two files (which one would win?)."""
    from safetensors.torch import load_file, save_file

    d = _valid_dir(tmp_path)
    sd = load_file(os.path.join(d, "model.safetensors"))
    idx = os.path.join(d, "model.safetensors.index.json")
    json.dump({"metadata": {}, "weight_map": {k: "model-00002-of-00002.safetensors" for k in sd}}, open(idx, "w"))
    with pytest.raises(ArgumentError, match=re.escape(repr(idx)) + " names the shard 'model-00002-of-00002"):
        tkc.from_pretrained(str(d))
    os.remove(idx)
    extra = os.path.join(d, "extra.safetensors")
    save_file({"model.norm.weight": sd["model.norm.weight"] * 2}, extra, metadata={"format": "pt"})
    with pytest.raises(ArgumentError, match=r"tensor 'model\.norm\.weight' is in both .*extra\.safetensors.* and "
                                            r".*model\.safetensors"):
        tkc.from_pretrained(str(d))


def test_config_argument_is_copied_not_changed(tmp_path):
    """from_pretrained(path, config=cfg): the loader drops quantization_config from its own copy; the caller's
    config keeps it (before: TypeError, config passed twice)."""
    ref = _write_bad(tmp_path, "fp8-block")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    want = cfg.to_dict()
    model = tkc.from_pretrained(str(tmp_path), config=cfg)
    assert cfg.to_dict() == want and cfg.quantization_config["quant_method"] == "fp8"
    assert torch.equal(_dequantized(model.get_submodule(BAD)), ref[BAD])


def _edit_config(path, **changes):
    f = os.path.join(path, "config.json")
    cfg = json.load(open(f))
    cfg.update(changes)
    json.dump(cfg, open(f, "w"))


def test_bias_present_exactly_when_the_model_has_one(tmp_path):
    """A linear with a bias whose checkpoint has none (before: built without it, silently), and a checkpoint bias
    for a linear that has none: both named."""
    _write_bad(tmp_path / "a", "fp8-block")
    _edit_config(tmp_path / "a", attention_bias=True)
    with pytest.raises(ArgumentError, match=r"self_attn\.k_proj\.bias is missing"):
        tkc.from_pretrained(str(tmp_path / "a"))
    _write_bad(tmp_path / "b", "fp8-block", lambda t: t.__setitem__("bias", torch.ones(64)))
    with pytest.raises(ArgumentError, match=re.escape(f"{BAD}.bias") + r" .*the model's linear has no bias"):
        tkc.from_pretrained(str(tmp_path / "b"))


def test_compressed_tensors_target_left_float_raises_unless_ignored(tmp_path):
    """compressed-tensors quantizes every Linear its ignore list does not name: a target stored as a plain float
    weight is a half-quantized checkpoint (before: loaded as float without a word); named in ``ignore`` (here by a
    're:' regex, compressed-tensors' re.match) it loads as the float nn.Linear it is."""
    def float_v(t):
        t.clear()
        t["weight"] = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))

    _write_bad(tmp_path, "ct-int8", float_v)
    with pytest.raises(ArgumentError, match=re.escape(f"{BAD}.weight") + r" is a float32 weight without "
                                            r"\['weight_scale'\].*half quantized"):
        tkc.from_pretrained(str(tmp_path))
    qc = json.load(open(tmp_path / "config.json"))["quantization_config"]
    _edit_config(tmp_path, quantization_config=dict(qc, ignore=["lm_head", r"re:.*self_attn\.v_proj$"]))
    model = tkc.from_pretrained(str(tmp_path))
    v = model.get_submodule(BAD)
    assert type(v) is torch.nn.Linear
    assert torch.equal(v.weight.detach(), torch.randn(64, 64, generator=torch.Generator().manual_seed(5)))
    assert isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), TPUQuantLinear)


# the formats' layouts as their documentation states them (module docstring of checkpoints.py; GPTQ / AWQ /
# compressed-tensors / DeepSeek-V3), per linear of K in and N out features: {tensor: (shape, dtype)}
def _layout(fmt, N, K, gs, blk):
    G = K // gs
    return {
        "gptq": {"qweight": ((K // 8, N), torch.int32), "qzeros": ((G, N // 8), torch.int32),
                 "scales": ((G, N), torch.float16)},
        "awq": {"qweight": ((K, N // 8), torch.int32), "qzeros": ((G, N // 8), torch.int32),
                "scales": ((G, N), torch.float16)},
        "ct-pack": {"weight_packed": ((N, K // 8), torch.int32), "weight_scale": ((N, G), torch.bfloat16),
                    "weight_zero_point": ((N // 8, G), torch.int32)},
        "ct-int8": {"weight": ((N, K), torch.int8), "weight_scale": ((N, 1), torch.float32)},
        "fp8-block": {"weight": ((N, K), torch.float8_e4m3fn),
                      "weight_scale_inv": ((-(-N // blk[0]), -(-K // blk[1])), torch.float32)},
    }[fmt]


_SCHEME_CFG = {
    "gptq": lambda gs, blk: dict(quant_method="gptq", bits=4, group_size=gs, checkpoint_format="gptq_v2"),
    "awq": lambda gs, blk: dict(quant_method="awq", bits=4, group_size=gs, version="gemm"),
    "ct-pack": lambda gs, blk: _ct("pack-quantized", dict(_W4, symmetric=False, group_size=gs)),
    "ct-int8": lambda gs, blk: FORMATS["ct-int8"][0],
    "fp8-block": lambda gs, blk: dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=list(blk)),
}
_OTHER_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
                 torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


@given(fmt=st.sampled_from(sorted(_SCHEME_CFG)), n8=st.integers(1, 16), kg=st.integers(1, 4),
       gs=st.sampled_from([32, 64, 128]), bn=st.sampled_from([16, 32, 128]), data=st.data())
def test_check_linear_tensors_property(fmt, n8, kg, gs, bn, data):
    """Over shapes and group / block sizes: the documented layout passes; any one tensor with one dimension off,
    a dimension more, or another dtype raises ArgumentError naming <module>.<tensor>."""
    N, K = 8 * n8, gs * kg
    blk = (bn, gs)
    scheme = tkc.parse_quantization_config(_SCHEME_CFG[fmt](gs, blk))
    lin = torch.nn.Linear(K, N, bias=False, device="meta")
    lay = _layout(fmt, N, K, gs, blk)
    t = {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in lay.items()}
    tkc.check_linear_tensors("m.p", lin, t, scheme)
    key = data.draw(st.sampled_from(sorted(lay)))
    shape, dt = lay[key]
    kind = data.draw(st.sampled_from(["dim", "rank", "dtype"]))
    if kind == "dim":
        d = data.draw(st.integers(0, len(shape) - 1))
        new = list(shape)
        new[d] = data.draw(st.integers(1, shape[d] + 8).filter(lambda v: v != shape[d]))
        t[key] = torch.zeros(new, dtype=dt)
    elif kind == "rank":
        t[key] = torch.zeros((*shape, 1), dtype=dt)
    else:
        floats = (torch.float16, torch.bfloat16, torch.float32)  # the scales may be any of these
        wrong = [d for d in _OTHER_DTYPES if d != dt and not (d in floats and dt in floats)]
        t[key] = torch.zeros(shape, dtype=data.draw(st.sampled_from(wrong)))
    with pytest.raises(ArgumentError, match=re.escape(f"m.p.{key} has")):
        tkc.check_linear_tensors("m.p", lin, t, scheme)
