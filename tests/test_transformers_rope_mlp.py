"""apply_tpukernels(rope=True, gated_mlp=True): HF llama's apply_rotary_pos_emb and LlamaMLP on tpukernels ops.

A tiny offline Llama (random weights from a LlamaConfig, nothing downloaded) with a YaRN-scaled rotary
embedding, patched vs the unpatched model from the same weights: logits and parameter gradients.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.llama import modeling_llama as ml  # noqa: E402

from tpukernels.integrations import transformers as tki  # noqa: E402
from tpukernels.library.gated_mlp import TPUGatedMLP  # noqa: E402
from tpukernels.library.rope import apply_rotary_pos_emb  # noqa: E402


def _tiny_llama():
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=64, hidden_act="silu",
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def test_llama_rope_and_mlp_patched_logits_and_grads_match_unpatched(monkeypatch):
    import tpukernels.library.rope as rope_lib

    monkeypatch.setattr(ml, "apply_rotary_pos_emb", ml.apply_rotary_pos_emb)  # restored after the test
    calls = []
    monkeypatch.setattr(rope_lib, "apply_rotary_pos_emb",
                        lambda *a, **k: calls.append(1) or apply_rotary_pos_emb(*a, **k))
    stock, ours = _tiny_llama(), _tiny_llama()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    counts = tki.apply_tpukernels(ours, attention=False, rms_norm=False, rope=True, gated_mlp=True)
    assert counts["rope"] == 1 and counts["gated_mlp"] == 2
    assert isinstance(ml.apply_rotary_pos_emb, tki.RopeDispatch)
    mlp = ours.model.layers[0].mlp
    assert isinstance(mlp, TPUGatedMLP) and mlp.activation == "silu"
    assert set(ours.state_dict()) == set(stock.state_dict())

    calls.clear()
    out_ours = ours(input_ids=ids, labels=ids)
    assert len(calls) == 2  # one RoPE call per layer of the patched model, on ours
    # per model, not per process: the unpatched llama in the same process runs HF's own function
    out_stock = stock(input_ids=ids, labels=ids)
    assert len(calls) == 2
    # float32 everywhere; ours rounds each RoPE / SwiGLU output once where HF rounds 2-3 times: float32
    # rounding differences, amplified by two layers and the LM head (observed ~1e-6)
    torch.testing.assert_close(out_ours.logits, out_stock.logits, rtol=1e-4, atol=1e-5)
    out_ours.loss.backward()
    out_stock.loss.backward()
    for name, p in stock.named_parameters():
        q = dict(ours.named_parameters())[name]
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)
    assert len(calls) == 2  # backward differentiates the forward's ops; it calls neither function again


def test_gated_mlp_identifies_the_activation_by_value(monkeypatch):
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=32, head_dim=16)
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(**cfg))  # gelu_pytorch_tanh
    assert tki.apply_tpukernels(gemma, attention=False, rms_norm=False, gated_mlp=True)["gated_mlp"] == 1
    assert gemma.model.layers[0].mlp.activation == "gelu_tanh"
    relu = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_act="relu", **cfg))  # no fused kernel
    assert tki.apply_tpukernels(relu, attention=False, rms_norm=False, gated_mlp=True)["gated_mlp"] == 0
    assert not isinstance(relu.model.layers[0].mlp, TPUGatedMLP)
    # rope off by default: this model's forward keeps HF's RoPE (a dispatcher another test installed
    # serves only the models patched with rope=True)
    assert "rope" not in tki.apply_tpukernels(relu, attention=False, rms_norm=False)
    calls = []
    import tpukernels.library.rope as rope_lib

    ours = rope_lib.apply_rotary_pos_emb
    monkeypatch.setattr(rope_lib, "apply_rotary_pos_emb", lambda *a, **k: calls.append(1) or ours(*a, **k))
    with torch.no_grad():
        relu(input_ids=torch.arange(8)[None] % 32)
    assert calls == []
