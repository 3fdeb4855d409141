"""Issue 36 (MoE parts): gpt-oss experts (biases, interleaved gate/up, clamped SwiGLU, transposed weights) and
Aria's transposed experts routed through grouped_matmul; Llama-4 / LongCat-Flash experts left stock with a
reason instead of raising; every replacement probed against the stock forward (a wrong forward is caught).

Tolerances: float32 logits 1e-5 of the largest |logit| against stock float32 (a different f32 summation order),
1e-4 against stock float64 run on the same weights; bias gradients 1e-4 of the largest entry.
"""

import copy
import importlib
import warnings

import pytest
import torch

T = pytest.importorskip("transformers")

from tpukernels.errors import ArgumentError  # noqa: E402
from tpukernels.integrations import moe_experts as me  # noqa: E402
from tpukernels.integrations.moe import apply_tpukernels_moe, plan_moe, quantize_moe_experts  # noqa: E402

gm = importlib.import_module("tpukernels.library.grouped_matmul_ops")
EXP = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
GPT_OSS = EXP[:1]  # one layer: the probe and the interpret-mode backward dominate this file's CPU time


def _ids(vocab=96, n=10, seed=1):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def tiny_gpt_oss(seed=0):
    cfg = T.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64, layer_types=["full_attention"],
                         swiglu_limit=0.5)
    torch.manual_seed(seed)
    m = T.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # biases are zero at init: give them (and the clamp) something to do
        for name in GPT_OSS:
            e = m.get_submodule(name)
            e.gate_up_proj.mul_(20.0)
            e.gate_up_proj_bias.normal_(0.0, 0.5)
            e.down_proj_bias.normal_(0.0, 0.5)
    return m


@pytest.fixture
def fresh_probes(monkeypatch):
    monkeypatch.setattr(me, "probe_verdicts", {})


def _count_gmm(monkeypatch):
    calls, real = [], gm.grouped_matmul
    monkeypatch.setattr(gm, "grouped_matmul", lambda *a, **k: calls.append(k.get("rhs_bias") is not None)
                        or real(*a, **k))
    return calls


def test_gpt_oss_experts_match_stock_and_float64(monkeypatch, fresh_probes):
    """The whole layer through fused_moe on gpt-oss's weights as stored ([E, H, 2I], no transpose), its interleaved
    gate/up columns and clamped SwiGLU (swigluoai with the module's alpha / limit), biases through rhs_bias:
    logits match stock f32 and a float64 run of the same weights; the clamp is active; bias gradients match
    stock."""
    fmo = importlib.import_module("tpukernels.library.fused_moe_ops")
    stock = tiny_gpt_oss()
    ours = copy.deepcopy(stock)
    assert plan_moe(ours) == [(n, "GptOssExperts", None) for n in GPT_OSS]
    assert apply_tpukernels_moe(ours) == GPT_OSS and ours.config._experts_implementation == "tpukernels"
    assert stock.config._experts_implementation != "tpukernels"
    e0 = ours.get_submodule(EXP[0])
    assert me.fused_gate(e0) == ("swigluoai", True, float(e0.alpha), float(e0.limit))
    gates, flags = [], []
    real_sw, real_fm = fmo._swigluoai, fmo.fused_moe
    monkeypatch.setattr(fmo, "_swigluoai", lambda g, u, a, l: gates.append(g.detach()) or real_sw(g, u, a, l))
    monkeypatch.setattr(fmo, "fused_moe", lambda *a, **k: flags.append(
        (k["act_fn"], k["transpose_rhs"], k["gate_up_interleaved"])) or real_fm(*a, **k))
    calls = _count_gmm(monkeypatch)
    ids = _ids()
    out = ours(ids).logits
    assert flags == [("swigluoai", False, True)]
    assert calls == [True, True]  # both projections, each with its bias
    assert max(g.abs().max().item() for g in gates) > 2 * stock.config.swiglu_limit  # the clamp bites
    monkeypatch.undo()
    ref = stock(ids).logits
    stock64 = copy.deepcopy(stock).double()
    stock64.config._experts_implementation = "eager"  # HF's loop over experts (grouped_mm takes no float64)
    ref64 = stock64(ids).logits
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (out.double() - ref64).abs().max() <= 1e-4 * ref64.abs().max()
    ref.square().mean().backward()
    out.square().mean().backward()
    for name in GPT_OSS:
        for p in ("gate_up_proj_bias", "down_proj_bias", "gate_up_proj"):
            want = getattr(stock.get_submodule(name), p).grad
            got = getattr(ours.get_submodule(name), p).grad
            assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (name, p)


def test_fused_gate_is_decided_from_what_the_gate_is(monkeypatch):
    """fused_moe takes a module only where its gate is one fused_moe has: the default gate with SiLU (Mixtral) or
    torch's tanh GELU, gpt-oss's own _apply_gate; another activation or a class's own gate keeps the composition
    with the class's gate (whether that matches stock is then the probe's verdict)."""
    cfg = T.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    e = T.MixtralForCausalLM(cfg).get_submodule(EXP[0])
    assert me.fused_gate(e) == ("silu", False, 1.702, 7.0)
    e.act_fn = T.activations.GELUTanh()
    assert me.fused_gate(e)[:2] == ("gelu", False)
    e.act_fn = T.activations.GELUTanh(use_gelu_tanh_python=True)  # tanh GELU as a python formula: not torch's
    assert me.fused_gate(e) is None
    e.act_fn = torch.nn.GELU()  # exact (erf) GELU: fused_moe's "gelu" is the tanh one
    assert me.fused_gate(e) is None
    e.act_fn = torch.nn.SiLU()
    monkeypatch.setattr(type(e), "_apply_gate", lambda self, x: x.chunk(2, -1)[0], raising=False)
    assert me.fused_gate(e) is None


def test_aria_transposed_experts_match_stock(fresh_probes):
    """Aria's experts are a plain transpose ([E, K, N], grouped_matmul's transpose_rhs=False): routed, logits match
    (main raised 'transposed expert weights')."""
    cfg = T.AriaTextConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, moe_num_experts=4, moe_topk=2,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    stock = T.AriaTextForCausalLM(cfg).eval()
    ours = copy.deepcopy(stock)
    assert apply_tpukernels_moe(ours) == ["model.layers.0.mlp.experts"]
    with torch.no_grad():
        ref, out = stock(_ids()).logits, ours(_ids()).logits
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def _llama4():
    cfg = T.Llama4TextConfig(vocab_size=96, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=64)
    return T.Llama4ForCausalLM(cfg).eval(), "model.layers.0.feed_forward.experts", "Llama4TextExperts"


def _longcat():
    cfg = T.LongcatFlashConfig(vocab_size=96, hidden_size=64, ffn_hidden_size=64, expert_ffn_hidden_size=32,
                               num_layers=1, num_attention_heads=4, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
                               max_position_embeddings=64, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                               qk_nope_head_dim=8, v_head_dim=16, head_dim=8)
    return T.LongcatFlashForCausalLM(cfg).eval(), "model.layers.0.mlp.experts", "LongcatFlashExperts"


@pytest.mark.parametrize("make", [_llama4, _longcat], ids=["llama4", "longcat_flash"])
def test_undispatched_experts_left_stock_with_reason(make):
    """Experts transformers does not dispatch by config._experts_implementation: plan says stock with a reason,
    apply warns and returns [] (main raised 'no 3-D experts modules'), logits unchanged bit for bit."""
    from tpukernels.integrations.transformers import apply_tpukernels

    torch.manual_seed(0)
    stock, name, cls = make()
    ours = copy.deepcopy(stock)
    [(n, c, why)] = plan_moe(ours)
    assert (n, c) == (name, cls) and "does not dispatch" in why
    with pytest.warns(UserWarning, match=f"{cls} left stock .*{name}.*does not dispatch"):
        assert apply_tpukernels_moe(ours) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert apply_tpukernels(copy.deepcopy(stock), attention=False)["moe_experts"] == 0
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, stock(_ids()).logits)


def test_wrong_forward_is_caught_and_left_stock(monkeypatch, fresh_probes):
    """A tpukernels forward that drops the expert biases fails the probe: gpt-oss stays stock, with the warning."""
    real = gm.grouped_matmul
    monkeypatch.setattr(gm, "grouped_matmul", lambda *a, rhs_bias=None, **k: real(*a, **k))
    stock = tiny_gpt_oss()
    ours = copy.deepcopy(stock)
    [(_, _, why)] = plan_moe(ours)
    assert "probe mismatch" in why
    with pytest.warns(UserWarning, match="GptOssExperts left stock .*probe mismatch"):
        assert apply_tpukernels_moe(ours) == []
    assert ours.config._experts_implementation != "tpukernels"
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, stock(_ids()).logits)


def test_stock_module_sharing_a_routed_config_stays_stock(monkeypatch, fresh_probes):
    """One config routes every experts module to "tpukernels": a module left stock must still run its stock
    forward (only the replaced layer calls grouped_matmul) and the logits match stock."""
    cfg = T.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64)
    torch.manual_seed(0)
    stock = T.MixtralForCausalLM(cfg).eval()
    ours = copy.deepcopy(stock)
    odd = type("OddExperts", (type(ours.get_submodule(EXP[1])),), {})
    ours.get_submodule(EXP[1]).__class__ = odd
    me.probe_verdicts[(odd, torch.float32)] = "a verdict forced by the test"
    with pytest.warns(UserWarning, match="OddExperts left stock"):
        assert apply_tpukernels_moe(ours) == [EXP[0]]
    calls = _count_gmm(monkeypatch)
    with torch.no_grad():
        out, ref = ours(_ids()).logits, stock(_ids()).logits
    assert len(calls) == 2  # layer 0's two projections only
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_quantize_biased_transposed_experts_refused_untouched(fresh_probes):
    """Quantized routing takes [E, N, K] bias-free experts only: gpt-oss raises before anything changes."""
    m = tiny_gpt_oss()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ArgumentError, match="GptOssExperts.*transposed expert weights|expert biases"):
        quantize_moe_experts(m)
    after = m.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.slow  # ~5 s of interpret-mode quantized matmuls; keeps this file's make-test share near ~16 s
def test_wrong_quantized_forward_is_caught_before_the_swap(monkeypatch, fresh_probes):
    """quantize_moe_experts probes each class on a quantized stand-in (ours against the stock forward in float64
    on the dequantized weights) before any swap: a quantized forward 2% off raises, the model untouched."""
    gq = importlib.import_module("tpukernels.library.grouped_matmul_ops.quant")
    real = gq.grouped_matmul_quantized
    monkeypatch.setattr(gq, "grouped_matmul_quantized", lambda *a, **k: real(*a, **k) * 1.02)
    cfg = T.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64)
    torch.manual_seed(0)
    m = T.MixtralForCausalLM(cfg).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ArgumentError, match="MixtralExperts.*quantized int8: a probe mismatch"):
        quantize_moe_experts(m)
    after = m.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert getattr(m.config, "quantization_config", None) is None
