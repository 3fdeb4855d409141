"""examples/train_llama.py: a tiny HF Llama trained 50 AdamW steps with apply_tpukernels(model, linear=True)
and the LM head through linear_cross_entropy follows the stock loss curve, eager and under torch.compile.

Bound: max relative loss difference per step <= 1e-5. Every tpukernels kernel here runs in float32 with
float32 accumulation (matmuls at precision HIGHEST), so the two runs differ only by summation order:
~1e-7 per step is expected and 1.9e-7 is observed over 50 steps (the curves would separate at the 1e-3
level within a few steps if any gradient were wrong, e.g. a missing dW, and the loss would not fall).
Runtime ~35 s on 2 cores (stock 4 s, tpukernels eager 7 s, compiled 14 s + tracing).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

pytest.importorskip("transformers")

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_llama.py"
_spec = importlib.util.spec_from_file_location("train_llama", _PATH)
train_llama = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("train_llama", train_llama)  # dynamo resolves the module by name
_spec.loader.exec_module(train_llama)

RTOL = 1e-5


def test_loss_curve_matches_stock_eager_and_compiled():
    r = train_llama.run(steps=50, batch=2, seq=16, compile="aot_eager", layers=1, dim=64, vocab=256, ffn=128)
    assert r["patched"] == {"attention": True, "rms_norm": 3, "gated_rms_norm": 0, "layer_norm": 0, "linear": 8,
                            "linear_attention": 0, "moe_experts": 0,
                            "stock": {}}
    assert len(r["stock"]) == 50
    assert r["stock"][-1] < 0.7 * r["stock"][0], "the synthetic task must be learnable (loss falls)"
    for tag in ("eager", "compiled"):
        assert r[f"{tag}_max_rel_diff"] <= RTOL, (tag, r[f"{tag}_max_rel_diff"], r[tag][:5], r["stock"][:5])


def test_fused_loss_is_hf_loss_and_one_graph():
    """Same number as HF's labels= loss on the same model; the patched step traces to one graph."""
    model = train_llama.make_model(layers=1, dim=64, vocab=256, ffn=128)
    ids = train_llama.batches(1, batch=2, seq=16, vocab=256)[0]
    want = train_llama.stock_loss(model, ids)
    got = train_llama.fused_loss(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    train_llama.apply_tpukernels(model, linear=True)
    explained = torch._dynamo.explain(lambda i: train_llama.fused_loss(model, i))(ids)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.slow  # the same 50 eager steps as the curve test, through main()
def test_example_main_exit_status(capsys):
    assert train_llama.main(["--steps", "50", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "tpukernels eager" in out and "ok" in out


@pytest.mark.slow  # inductor codegen on 2 cores: ~90 s
def test_loss_curve_matches_stock_inductor():
    r = train_llama.run(steps=50, batch=2, seq=16, compile="inductor", layers=1, dim=64, vocab=256, ffn=128)
    assert r["compiled_max_rel_diff"] <= RTOL, (r["compiled_max_rel_diff"], r["compiled"][:5], r["stock"][:5])
