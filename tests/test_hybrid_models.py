"""Hybrid models (gated DeltaNet, KDA, Mamba2 mixers) patched by ``apply_tpukernels``: logits and greedy
``generate()`` with the model's own cache equal stock transformers, and our kernels are the ones that ran.

Tiny random configs of transformers' own architectures (tests/hf_tiny.py: every layer type, random norm weights and
biases), a left-padded batch. make test runs Qwen3-Next (the first priority); the other families are
``@pytest.mark.slow`` (each compiles its kernels in interpret mode: ~1 min on one core).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from tpukernels.errors import ArgumentError  # noqa: E402
from tpukernels.integrations import linear_mixers, patch_probes  # noqa: E402
from tpukernels.integrations import transformers as tki  # noqa: E402

#: library ops an adapter calls (looked up at call time, so a spy sees every call)
OPS = {
    "tpukernels.library.causal_conv1d": ("causal_conv1d_fn", "causal_conv1d_update"),
    "tpukernels.library.linear_attention": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
                                            "fused_recurrent_kda", "mamba_chunk_scan_combined",
                                            "selective_state_update"),
}

#: model_type -> (mixer class, ops a prefill + decode must run)
FAMILIES = {
    "qwen3_next": ("Qwen3NextGatedDeltaNet", {"causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule",
                                              "fused_recurrent_gated_delta_rule"}),
    "qwen3_5": ("Qwen3_5GatedDeltaNet", {"causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule",
                                         "fused_recurrent_gated_delta_rule"}),
    "kimi_linear": ("KimiLinearDeltaAttention", {"causal_conv1d_fn", "causal_conv1d_update", "chunk_kda",
                                                 "fused_recurrent_kda"}),
    "mamba2": ("Mamba2Mixer", {"causal_conv1d_fn", "causal_conv1d_update", "mamba_chunk_scan_combined",
                               "selective_state_update"}),
    "nemotron_h": ("NemotronHMamba2Mixer", {"causal_conv1d_fn", "causal_conv1d_update", "mamba_chunk_scan_combined",
                                            "selective_state_update"}),
    "falcon_h1": ("FalconH1Mixer", {"causal_conv1d_fn", "causal_conv1d_update", "mamba_chunk_scan_combined",
                                    "selective_state_update"}),
}


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of the library ops (by name) while a test runs."""
    import importlib

    calls: dict = {}
    for modname, names in OPS.items():
        mod = importlib.import_module(modname)
        for n in names:
            orig = getattr(mod, n)

            def wrapped(*a, _n=n, _orig=orig, **k):
                calls[_n] = calls.get(_n, 0) + 1
                return _orig(*a, **k)

            monkeypatch.setattr(mod, n, wrapped)
    return calls


def _fresh():
    patch_probes.verdicts.clear()
    tki._stock_warned.clear()


def _generate(model, ids, mask, n=3):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, use_cache=True,
                              pad_token_id=0)


def _check_family(model_type, spy):
    cls, needed = FAMILIES[model_type]
    model = hf_tiny.tiny_causal_lm(model_type)
    n_mixers = sum(type(m).__name__ == cls for m in model.modules())
    n_gated = sum(type(m).__name__.endswith("RMSNormGated") for m in model.modules())
    assert n_mixers >= 1, f"the tiny {model_type} must have a {cls} layer"
    ids, mask = hf_tiny.probe_batch(model.get_input_embeddings().num_embeddings)
    want = hf_tiny.logits(model, ids, mask)
    want_tokens = _generate(model, ids, mask)
    _fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tki.apply_tpukernels(model)
    assert report["linear_attention"] == n_mixers, (report, [str(w.message) for w in caught])
    assert cls not in report["stock"], report["stock"]
    assert report["gated_rms_norm"] == n_gated, report  # the mixers' gated norms are ours too
    spy.clear()
    got = hf_tiny.logits(model, ids, mask)
    keep = mask.bool()
    err = float((got[keep] - want[keep]).abs().max() / want[keep].abs().max())
    assert err <= hf_tiny.TOL, err
    got_tokens = _generate(model, ids, mask)
    assert torch.equal(got_tokens, want_tokens), (got_tokens, want_tokens)
    assert needed <= set(spy), f"prefill + decode must run our {sorted(needed)}, ran {spy}"
    return model


def test_qwen3_next_logits_and_generate_match_stock(spy):
    model = _check_family("qwen3_next", spy)
    # another (unpatched) model of the same family in the process keeps transformers' functions
    other = hf_tiny.tiny_causal_lm("qwen3_next", seed=1)
    spy.clear()
    ids, mask = hf_tiny.probe_batch(96)
    hf_tiny.logits(other, ids, mask)
    assert not spy, spy
    # and re-applying is idempotent (already-patched mixers are counted, not re-probed or hooked twice)
    hooks = [len(m._forward_pre_hooks) for m in model.modules() if getattr(m, "_tpukernels_mixer", None)]
    assert tki.apply_tpukernels(model, attention=False, rms_norm=False, moe=False)["linear_attention"] == len(hooks)
    assert [len(m._forward_pre_hooks) for m in model.modules() if getattr(m, "_tpukernels_mixer", None)] == hooks


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_5", "kimi_linear", "mamba2", "nemotron_h", "falcon_h1"])
def test_hybrid_logits_and_generate_match_stock(model_type, spy):
    _check_family(model_type, spy)


@pytest.mark.slow
def test_qwen3_next_bfloat16_mixer_is_patched_and_close(spy):
    """A bf16 model (how Qwen3-Next is served): the probe accepts the mixer at the bf16 tolerance, logits stay
    within the whole-model bf16 tolerance."""
    model = hf_tiny.tiny_causal_lm("qwen3_next").to(torch.bfloat16)
    ids, mask = hf_tiny.probe_batch(96)
    want = hf_tiny.logits(model, ids, mask)
    _fresh()
    report = tki.apply_tpukernels(model, attention=False, rms_norm=False, moe=False)
    assert report["linear_attention"] == 1, report
    spy.clear()
    got = hf_tiny.logits(model, ids, mask)
    keep = mask.bool()
    err = float((got[keep] - want[keep]).abs().max() / want[keep].abs().max())
    assert err <= patch_probes.MODEL_TOLERANCE[torch.bfloat16], err
    assert {"causal_conv1d_fn", "chunk_gated_delta_rule"} <= set(spy), spy


def test_a_mixer_whose_probe_fails_stays_stock_with_one_warning(monkeypatch, spy):
    def broken(*a, **k):
        raise RuntimeError("broken adapter")

    monkeypatch.setitem(linear_mixers.ADAPTERS, "causal_conv1d_fn", broken)
    model = hf_tiny.tiny_causal_lm("qwen3_next")
    ids, mask = hf_tiny.probe_batch(96)
    want = hf_tiny.logits(model, ids, mask)
    _fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tki.apply_tpukernels(model, attention=False, rms_norm=False, moe=False)
    msgs = [str(w.message) for w in caught if "Qwen3NextGatedDeltaNet" in str(w.message)]
    assert report["linear_attention"] == 0 and "Qwen3NextGatedDeltaNet" in report["stock"], report
    assert len(msgs) == 1 and "broken adapter" in msgs[0], msgs
    spy.clear()
    assert torch.equal(hf_tiny.logits(model, ids, mask), want)  # stock, bit for bit
    assert not spy, spy
    _fresh()


def test_dry_run_reports_without_patching(spy):
    model = hf_tiny.tiny_causal_lm("qwen3_next")
    _fresh()
    report = tki.apply_tpukernels(model, attention=False, rms_norm=False, moe=False, dry_run=True)
    assert report["linear_attention"] == 1, report
    assert not any(getattr(m, "_tpukernels_mixer", None) for m in model.modules())
    spy.clear()
    ids, mask = hf_tiny.probe_batch(96)
    hf_tiny.logits(model, ids, mask)
    assert not spy, spy


@pytest.mark.parametrize("adapter, kw", [
    (linear_mixers.gdn_chunk, {"cu_seqlens": torch.tensor([0, 4])}),
    (linear_mixers.gdn_recurrent, {"cu_seq_lens_q": torch.tensor([0, 4])}),
    (linear_mixers.kda_chunk, {"cu_seqlens": torch.tensor([0, 4])}),
])
def test_packed_sequence_arguments_are_refused_by_name(adapter, kw):
    q = torch.randn(1, 4, 2, 16)
    v = torch.randn(1, 4, 2, 16)
    g = -torch.rand(1, 4, 2, 16) if adapter is linear_mixers.kda_chunk else -torch.rand(1, 4, 2)
    with pytest.raises(ArgumentError, match=next(iter(kw))):
        adapter(q, q, v, g, torch.rand(1, 4, 2), **kw)


def test_conv_seq_idx_is_refused_by_name():
    with pytest.raises(ArgumentError, match="seq_idx"):
        linear_mixers.conv1d_fn(torch.randn(1, 8, 5), torch.randn(8, 4), None, "silu",
                                seq_idx=torch.zeros(1, 5, dtype=torch.int32))
