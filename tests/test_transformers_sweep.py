"""apply_tpukernels on transformers' own causal-LM architectures (tiny random configs, issue 36 item 1).

Per architecture: the patched model's logits on a left-padded batch equal the stock model's within float32
tolerance, and every layer the probes refused is left stock, named in the report's ``"stock"`` and in a
``RuntimeWarning``. A fixed sample of families runs in ``make test`` (hybrids with linear attention, Gemma
``(1 + w)`` norms, a weightless norm, a model that does not call the attention interface, MoE with sinks);
the whole causal-LM mapping in ``make test-slow``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import TOL, logits as _logits, probe_batch, sweep_one, tiny_causal_lm  # noqa: E402

from tpukernels.errors import ArgumentError  # noqa: E402
from tpukernels.integrations import patch_probes  # noqa: E402
from tpukernels.integrations import transformers as tki  # noqa: E402

# qwen3_next: tests/test_hybrid_models.py checks its logits and generate() in make test (the sweep runs it in test-slow)
SAMPLE = ["llama", "gemma3_text", "falcon_mamba", "cpmant", "gpt_oss"]


def check_architecture(model_type: str):
    r = sweep_one(model_type)
    if r["status"] != "built":
        pytest.skip(f"{model_type}: {r['status']} ({r['why']})")
    report = r["report"]
    assert r["err"] <= TOL, f"{model_type}: patched logits differ from stock by {r['err']:.3g} (report {report})"
    for what in report["stock"]:
        shown = "attention implementation" if what == "attention" else what
        assert any(f"{shown} left stock" in m for m in r["warnings"]), f"{model_type}: no warning for {what}"
    return report, r["model"]


@pytest.mark.parametrize("model_type", SAMPLE)
def test_sample_architecture_patched_equals_stock(model_type):
    from tpukernels.library.norms import TPURMSNorm

    report, model = check_architecture(model_type)
    patched = report["rms_norm"] + report["layer_norm"] + report["moe_experts"] + report["gated_mlp"]
    assert patched or report["stock"], f"{model_type}: nothing patched and nothing reported"
    if model_type == "cpmant":  # its attention is its own module, not transformers' attention interface
        assert report["attention"] is False and "never calls" in report["stock"]["attention"]
    if model_type == "llama":
        assert report["attention"] and report["rope"] == 1 and report["stock"] == {}
    if model_type == "falcon_mamba":  # a weightless RMSNorm (a dummy buffer its forward never reads)
        assert set(report["stock"]) == {"attention"}
        norms = [m for m in model.modules() if isinstance(m, TPURMSNorm)]
        assert len(norms) == report["rms_norm"] and any(m.weight is None for m in norms)


def _all_causal_lms():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(SAMPLE))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _all_causal_lms())
def test_every_causal_lm_patched_equals_stock(model_type):
    check_architecture(model_type)


# ------------------------------------------------------------------------------------------ the probes
def test_qwen3_next_norms_use_the_one_plus_w_form():
    """The issue's repro: rms_norm=True alone on Qwen3-Next was 0.57 off (its norm is ``n * (1 + w)``)."""
    model = tiny_causal_lm("qwen3_next")
    ids, mask = probe_batch()
    want = _logits(model, ids, mask)
    report = tki.apply_tpukernels(model, attention=False, moe=False, linear_attention=False)  # the norms alone
    norm = model.model.norm
    assert norm.casting == "gemma" and norm.offset == 1.0 and report["rms_norm"] > 0
    err = (_logits(model, ids, mask) - want)[mask.bool()].abs().max() / want.abs().max()
    assert err <= TOL


class BiasedRMSNorm(torch.nn.Module):
    """An RMSNorm with a bias: no form of ours computes it, so it must stay stock."""

    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h) + 0.1 * torch.randn(h))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(h))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * n + self.bias).to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.norm = BiasedRMSNorm(h)
        self.ln = torch.nn.LayerNorm(h)

    def forward(self, x):
        return self.ln(self.norm(x))


def test_a_norm_no_form_matches_stays_stock_with_one_warning():
    patch_probes.verdicts.clear()
    tki._stock_warned.clear()
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 3, 32)
    want = block(x)
    with pytest.warns(RuntimeWarning, match="BiasedRMSNorm left stock: no RMSNorm form matches"):
        report = tki.apply_tpukernels(block, attention=False)
    assert isinstance(block.norm, BiasedRMSNorm) and "BiasedRMSNorm" in report["stock"]
    assert report["layer_norm"] == 1 and report["rms_norm"] == 0
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)


def test_dry_run_reports_without_patching():
    model = tiny_causal_lm("llama")
    before = {n: type(m) for n, m in model.named_modules()}
    report = tki.apply_tpukernels(model, dry_run=True, gated_mlp=True)
    assert report["rms_norm"] == 5 and report["gated_mlp"] == 2 and report["attention"] is True
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert model.config._attn_implementation == "eager"


def test_attention_that_disagrees_with_stock_is_reverted(monkeypatch):
    """A mapping bug (here: a mask read as non-causal) is caught by the whole-model probe: the model keeps
    its own attention, with a warning, and its logits are unchanged."""
    model = tiny_causal_lm("llama")
    ids, mask = probe_batch()
    want = _logits(model, ids, mask)
    real = tki.mask_to_spec

    def wrong(*a, **k):
        spec = real(*a, **k)
        return None if spec is None else dict(spec, causal=False)

    monkeypatch.setattr(tki, "mask_to_spec", wrong)
    tki._stock_warned.clear()
    with pytest.warns(RuntimeWarning, match="attention implementation left stock: the model's output with it differs"):
        report = tki.apply_tpukernels(model, rms_norm=False)
    assert report["attention"] is False and model.config._attn_implementation == "eager"
    torch.testing.assert_close(_logits(model, ids, mask), want)


def test_attention_refuses_an_argument_it_does_not_implement():
    module = torch.nn.Module()
    module.is_causal = True
    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    with pytest.raises(ArgumentError, match=r"\['cu_seq_lens_q'\]"):  # packed sequences (DSA indices: test_dsa_models)
        tki.attention_forward(module, q, k, k, None, cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32))
    out, _ = tki.attention_forward(module, q, k, k, None, position_ids=torch.arange(4)[None])  # bookkeeping only
    assert out.shape == (1, 4, 2, 16)


# ------------------------------------------------------------------------------------------ gated norms
@pytest.mark.parametrize("model_type,norm_before_gate,group", [("qwen3_next", True, None), ("mamba2", False, None)])
def test_gated_norms_take_the_probed_form(model_type, norm_before_gate, group):
    """Qwen3-Next's ``norm(x) * w * silu(gate)`` and Mamba2's grouped ``norm(x * silu(gate)) * w`` each become a
    TPUGatedRMSNorm in their own form (the probe picks it), with the state dict unchanged and logits equal."""
    from tpukernels.library.norms import TPUGatedRMSNorm

    model = tiny_causal_lm(model_type)
    keys = set(model.state_dict())
    ids, mask = probe_batch(model.get_input_embeddings().num_embeddings)
    want = _logits(model, ids, mask)
    patch_probes.verdicts.clear()
    report = tki.apply_tpukernels(model, attention=False, linear_attention=False)  # the gated norms alone
    norms = [m for m in model.modules() if isinstance(m, TPUGatedRMSNorm)]
    assert report["gated_rms_norm"] == len(norms) > 0
    assert {(m.norm_before_gate, m.group_size) for m in norms} == {(norm_before_gate, group)}
    assert set(model.state_dict()) == keys
    err = ((_logits(model, ids, mask) - want)[mask.bool()].abs().max() / want.abs().max()).item()
    assert err <= TOL


class BiasedGatedNorm(torch.nn.Module):
    """A gated RMSNorm with a bias after the gate: no form of ours computes it."""

    def __init__(self, h=32):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(h))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(h))

    def forward(self, hidden_states, gate):
        x = hidden_states.float()
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (self.weight * n * torch.nn.functional.silu(gate.float()) + self.bias).to(hidden_states.dtype)


BiasedGatedNorm.__name__ = "BiasedRMSNormGated"


def test_a_gated_norm_no_form_matches_stays_stock():
    patch_probes.verdicts.clear()
    tki._stock_warned.clear()
    holder = torch.nn.Module()
    holder.norm = BiasedGatedNorm()
    x, z = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    want = holder.norm(x, z)
    with pytest.warns(RuntimeWarning, match="BiasedRMSNormGated left stock: no gated RMSNorm form matches"):
        report = tki.apply_tpukernels(holder, attention=False)
    assert isinstance(holder.norm, BiasedGatedNorm) and report["gated_rms_norm"] == 0
    torch.testing.assert_close(holder.norm(x, z), want)


def test_a_patched_model_pickles_and_reloads_equal():
    """torch.save / torch.load of a model patched with rope=True and a gated norm (no local classes or hooks
    left on it) gives the same logits."""
    import io

    model = tiny_causal_lm("qwen3_next")
    report = tki.apply_tpukernels(model, rope=True)
    assert report["rope"] == 1 and report["gated_rms_norm"] == 1
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    ids, mask = probe_batch()
    assert torch.equal(_logits(again, ids, mask), _logits(model, ids, mask))
