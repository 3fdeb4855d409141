"""HF MoE integration (tpukernels.integrations.moe): a tiny Mixtral built from a config, experts routed
through grouped_matmul; logits and gradients match stock transformers (float32, same weights).

Tolerance: float32 with a different summation order (grouped f32 accumulation vs torch's per-expert
linear): 1e-5 of the largest |logit| (measured on cpu: 0, the interpret-mode dots happen to sum in the same
order), gradients 1e-4 of the largest entry. A counting wrapper proves the patched model calls grouped_matmul.
"""

import copy
import importlib

import pytest
import torch

pytest.importorskip("transformers")

from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

from tpukernels.errors import ArgumentError  # noqa: E402
from tpukernels.integrations.moe import apply_tpukernels_moe  # noqa: E402


def tiny_mixtral(seed=0):
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)
    torch.manual_seed(seed)
    return MixtralForCausalLM(cfg).eval()


def test_mixtral_logits_and_grads_match_stock(monkeypatch):
    stock = tiny_mixtral()
    ours = copy.deepcopy(stock)
    ours.config = copy.deepcopy(stock.config)
    for m in ours.modules():
        if hasattr(m, "config"):
            m.config = ours.config
    stock.config._experts_implementation = "eager"  # the reference: HF's loop over experts
    patched = apply_tpukernels_moe(ours)
    assert patched == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert stock.config._experts_implementation != "tpukernels"
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = stock(ids).logits
    gm = importlib.import_module("tpukernels.library.grouped_matmul_ops")
    calls = []
    real = gm.grouped_matmul
    monkeypatch.setattr(gm, "grouped_matmul", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    fmo = importlib.import_module("tpukernels.library.fused_moe_ops")
    flags, real_fm = [], fmo.fused_moe
    monkeypatch.setattr(fmo, "fused_moe", lambda *a, **k: flags.append((k["act_fn"], k["transpose_rhs"])) or
                        real_fm(*a, **k))
    out = ours(ids).logits
    assert flags == [("silu", True)] * 2  # each layer is one fused_moe call on HF's [E, 2I, H] weights as stored
    assert calls == [(48, 64), (48, 96)] * 2  # 2 sequences x 12 tokens x top-2 rows; per layer: up, down
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    stock(ids).logits.square().mean().backward()
    ours(ids).logits.square().mean().backward()
    for (n, p), (_, q) in zip(stock.named_parameters(), ours.named_parameters()):
        if "experts" in n:
            assert (q.grad - p.grad).abs().max() <= 1e-4 * p.grad.abs().max(), n


def test_model_without_experts_raises():
    with pytest.raises(ArgumentError, match="no 3-D experts modules"):
        apply_tpukernels_moe(torch.nn.Linear(4, 4))


def test_patched_mixtral_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) of the patched model: group sizes are a fixed-length count (bincount's
    data-dependent length broke the graph at every layer and failed fullgraph) and logits match eager."""
    model = tiny_mixtral(seed=2)
    apply_tpukernels_moe(model)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        eager = model(ids).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    assert (compiled - eager).abs().max() <= 1e-5 * eager.abs().max()


def test_apply_tpukernels_patches_the_experts_too():
    """The one-call integration routes MoE experts as well (it used to leave them on HF's loop silently)."""
    from tpukernels.integrations.transformers import apply_tpukernels

    stock = tiny_mixtral(seed=4)
    ours = copy.deepcopy(stock)
    counts = apply_tpukernels(ours, attention=False)
    assert counts["moe_experts"] == 2 and ours.config._experts_implementation == "tpukernels"
    assert stock.config._experts_implementation != "tpukernels"
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref, out = stock(ids).logits, ours(ids).logits
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert apply_tpukernels(torch.nn.Sequential(torch.nn.Linear(4, 4)), attention=False)["moe_experts"] == 0


def _tiny(family, seed):
    import transformers as T

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2 if family == "qwen3_moe" else 4, max_position_embeddings=64)
    if family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                               norm_topk_prob=True, head_dim=16, decoder_sparse_step=1, mlp_only_layers=[],
                               **common)
        model = T.Qwen3MoeForCausalLM(cfg)
    else:  # DeepSeek-V3: grouped top-k router with its correction bias, shared experts, MLA attention
        cfg = T.DeepseekV3Config(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                 num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                 first_k_dense_replace=0, routed_scaling_factor=2.5, kv_lora_rank=16,
                                 q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, **common)
        model = T.DeepseekV3ForCausalLM(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():  # random (not init-zero) router biases: the correction bias changes the selection
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(torch.randn_like(b) * 0.5)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_qwen3_moe_and_deepseek_v3_blocks_run_through_fused_moe_and_match_stock(monkeypatch, family):
    """Issue 39's other two families (Mixtral and gpt-oss: the tests above and tests/test_moe_experts_routing.py):
    with the experts (``apply_tpukernels_moe``) and the routers (``apply_tpukernels_routers``: Qwen3-MoE's
    softmax top-k, DeepSeek-V3's grouped top-k with its correction bias) on our kernels, every MoE layer is one
    ``fused_moe`` call on HF's weights as stored; DeepSeek-V3's shared experts stay its own MLP. Logits and the
    expert weights' and the routers' gradients match stock float32 (the router kernels have no backward: in
    training the router weights are recomputed from the kernel's ids, differentiably)."""
    from tpukernels.integrations.moe_routers import apply_tpukernels_routers

    stock = _tiny(family, 0)
    ours = copy.deepcopy(stock)
    ours.config = copy.deepcopy(stock.config)
    for m in ours.modules():
        if hasattr(m, "config"):
            m.config = ours.config
    assert apply_tpukernels_moe(ours) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    routed = apply_tpukernels_routers(ours)
    assert [f for _, f in routed] == (["softmax_renorm"] * 2 if family == "qwen3_moe" else ["grouped"] * 2)
    fmo = importlib.import_module("tpukernels.library.fused_moe_ops")
    flags, real_fm = [], fmo.fused_moe
    monkeypatch.setattr(fmo, "fused_moe", lambda *a, **k: flags.append((k["act_fn"], k["transpose_rhs"])) or
                        real_fm(*a, **k))
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))
    out = ours(ids).logits
    assert flags == [("silu", True)] * 2
    ref = stock(ids).logits
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    ref.square().mean().backward()
    out.square().mean().backward()
    for (n, p), (_, q) in zip(stock.named_parameters(), ours.named_parameters()):
        if "experts" in n or n.endswith("mlp.gate.weight"):
            assert (q.grad - p.grad).abs().max() <= 1e-4 * p.grad.abs().max(), n
    assert ours.model.layers[0].mlp.gate.weight.grad.abs().max() > 0
