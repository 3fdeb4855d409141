"""transformers integration: mask mapping (each mask kind), module patching per family, fallback warning."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tpukernels.integrations import transformers as tki  # noqa: E402


# ------------------------------------------------------------------------------------------ mask mapping
def _causal(b, sq, skv, off=0):
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    return (j <= i + off)[None, None].expand(b, 1, sq, skv)


def test_none_mask_means_sdpa_semantics():
    assert tki.mask_to_spec(None, 8, 8, is_causal=True, sliding_window=None)["causal"] is True
    assert tki.mask_to_spec(None, 1, 8, is_causal=True, sliding_window=None)["causal"] is False
    assert tki.mask_to_spec(None, 8, 8, is_causal=False, sliding_window=None)["causal"] is False


def test_causal_with_kv_cache_is_bottom_right():
    spec = tki.mask_to_spec(_causal(2, 4, 10, off=6), 4, 10, is_causal=True, sliding_window=None)
    assert spec["causal"] and spec["causal_alignment"] == "bottom_right" and spec["kv_valid"] is None


def test_padding_mask_becomes_kv_segments():
    valid = torch.tensor([[True] * 6 + [False] * 2, [True] * 8])
    mask = valid[:, None, None, :].expand(2, 1, 8, 8)
    spec = tki.mask_to_spec(mask, 8, 8, is_causal=False, sliding_window=None)
    assert not spec["causal"] and torch.equal(spec["kv_valid"], valid)


def test_causal_plus_left_padding():
    valid = torch.tensor([[False, False] + [True] * 6, [True] * 8])
    mask = _causal(2, 8, 8) & valid[:, None, None, :]
    spec = tki.mask_to_spec(mask, 8, 8, is_causal=True, sliding_window=None)
    assert spec["causal"] and torch.equal(spec["kv_valid"], valid)


def test_sliding_window_hf_convention():
    sq = 12
    i, j = torch.arange(sq)[:, None], torch.arange(sq)[None, :]
    mask = ((j <= i) & (j > i - 4))[None, None]  # HF: kv_idx > q_idx - sliding_window, window 4
    spec = tki.mask_to_spec(mask, sq, sq, is_causal=True, sliding_window=4)
    assert spec["causal"] and spec["window_left"] == 3


def test_float_additive_mask_and_unexpressible_masks():
    m = torch.zeros(1, 1, 4, 4)
    m[..., 3] = torch.finfo(torch.float32).min
    spec = tki.mask_to_spec(m, 4, 4, is_causal=False, sliding_window=None)
    assert spec is not None and spec["kv_valid"][0].tolist() == [True, True, True, False]
    bias = torch.randn(1, 1, 4, 4)  # ALiBi-like additive bias: not a mask
    assert tki.mask_to_spec(bias, 4, 4, is_causal=False, sliding_window=None) is None
    prefix_lm = _causal(1, 6, 6).clone()
    prefix_lm[..., :3, :3] = True  # bidirectional prefix + causal suffix
    assert tki.mask_to_spec(prefix_lm, 6, 6, is_causal=True, sliding_window=None) is None


def test_unexpressible_mask_falls_back_with_one_warning():
    tki._warned.clear()
    q, k, v = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    mask = _causal(1, 6, 6).clone()
    mask[..., :3, :3] = True
    module = torch.nn.Module()
    with pytest.warns(RuntimeWarning, match="not causal / sliding-window / key-padding"):
        out, _ = tki.attention_forward(module, q, k, v, mask, scaling=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tki.attention_forward(module, q, k, v, mask, scaling=0.25)  # once only
    s = (q.double() @ k.double().transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
    want = (torch.softmax(s, -1) @ v.double()).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ models
def _llama_like(cls_cfg, cls_model, **extra):
    cfg = cls_cfg(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return cls_model(cfg).eval()


FAMILIES = {
    "llama": lambda: _llama_like(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": lambda: _llama_like(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": lambda: _llama_like(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, head_dim=16),
    "mistral": lambda: _llama_like(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=5),
    "gemma": lambda: _llama_like(transformers.GemmaConfig, transformers.GemmaForCausalLM, head_dim=16),
}


def _logits(model, ids, mask):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a mask fallback would be a silent slow path
        return model(input_ids=ids, attention_mask=mask).logits.double()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_decoder_logits_match_stock(family):
    model = FAMILIES[family]()
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding in the first row
    want = _logits(model, ids, mask)
    counts = tki.apply_tpukernels(model)
    per_layer = 4 if family == "qwen3" else 2  # Qwen3 adds q_norm / k_norm over the head dim
    assert counts["attention"] and counts["rms_norm"] == 2 * per_layer + 1
    got = _logits(model, ids, mask)
    valid = mask.bool()  # padded positions' logits are undefined in both
    torch.testing.assert_close(got[valid], want[valid], rtol=2e-4, atol=2e-4)


def test_patched_bert_encoder_with_padding_matches_stock():
    cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
    counts = tki.apply_tpukernels_to_bert(model)
    assert counts["layer_norm"] == 1 + 2 * 2 and counts["rms_norm"] == 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=2e-4, atol=2e-4)


def test_linear_patching_is_opt_in_and_shares_parameters():
    model = FAMILIES["llama"]()
    w = model.model.layers[0].mlp.up_proj.weight
    counts = tki.apply_tpukernels(model, attention=False, linear=True)
    assert counts["linear"] > 0
    assert isinstance(model.model.layers[0].mlp.up_proj, tki.TPULinear)
    assert model.model.layers[0].mlp.up_proj.weight is w


def test_decode_steps_reuse_one_kernel_per_kv_bucket():
    from tpukernels.library.attention import fa_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal = True
    before = len(fa_forward._entries)
    for skv in range(17, 25):  # 8 decode steps, all in bucket 24
        q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, skv, 16), torch.randn(1, 2, skv, 16)
        out, _ = tki.attention_forward(module, q, k, v, None, scaling=0.25)
        kk, vv = k.repeat_interleave(2, 1).double(), v.repeat_interleave(2, 1).double()
        want = (torch.softmax(q.double() @ kk.transpose(-1, -2) * 0.25, -1) @ vv).transpose(1, 2)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert len(fa_forward._entries) - before == 1
