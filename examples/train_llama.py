"""Train a tiny Llama with tpukernels (attention, RMSNorm, every nn.Linear, fused LM head + cross-entropy)
and compare its loss curve with the stock model trained from the same initial weights on the same data.

    python examples/train_llama.py                       # 50 AdamW steps, eager and torch.compile
    python examples/train_llama.py --steps 200 --layers 2 --dim 128 --no-compile

What runs where: ``apply_tpukernels(model, linear=True)`` routes attention (flash attention fwd+bwd), the
RMSNorms (fwd+bwd) and every ``nn.Linear`` (tpukernels matmul fwd+bwd) through tpukernels ops; the LM head
and its loss are one :func:`tpukernels.library.linear_cross_entropy` call on the final hidden states and
``lm_head.weight``, so the ``[tokens, vocab]`` logits are never formed. The stock run uses HF's own
``LlamaForCausalLM(..., labels=...)`` loss (logits in the model dtype, ``float32`` cross-entropy, mean
over the shifted, non-ignored labels) — the same quantity.

Model: ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (random init, seeded, float32).
TorchTitan 0.3.0 was tried first and not used: ``import torchtitan.models.llama3`` imports ``triton``
(through ``torchtitan.distributed``), which a CPU install does not have, its README asks for a PyTorch
nightly, and ``pip install torchtitan`` adds ~45 packages (wandb, tensorboard, datasets, pyarrow, ...).

Data: synthetic sequences from a fixed random bigram table (each token has 2 likely successors), so the
loss has something to learn. Exit status 1 when the curves differ by more than ``--rtol`` (relative, per
step) or when the loss did not decrease.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from tpukernels.integrations.transformers import apply_tpukernels
from tpukernels.library import linear_cross_entropy


def make_model(*, vocab: int = 256, dim: int = 64, layers: int = 1, heads: int = 4, kv_heads: int = 2,
               ffn: int = 128, seed: int = 0):
    """A random tiny ``LlamaForCausalLM`` (float32, GQA, untied LM head) from a config."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float()
    model.config._attn_implementation = "sdpa"
    return model


def batches(steps: int, *, batch: int, seq: int, vocab: int, seed: int = 1):
    """``steps`` batches ``[batch, seq]`` of int64 token ids from a fixed random bigram chain."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 2), generator=g)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, vocab, (batch,), generator=g)
        seqs = [tok]
        for _ in range(seq - 1):
            pick = torch.randint(0, 2, (batch,), generator=g)
            tok = succ[tok, pick]
            seqs.append(tok)
        out.append(torch.stack(seqs, 1))
    return out


def stock_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (``labels=ids``: shifted inside, mean over the predicted tokens)."""
    return model(input_ids=ids, labels=ids).loss


def fused_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The same loss through ``linear_cross_entropy`` on the final hidden states (no logits tensor).

    HF shifts labels by padding with -100; here the last position's label is ``ignore_index`` likewise.
    """
    hidden = model.model(input_ids=ids).last_hidden_state  # [B, S, H]
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, labels.reshape(-1))


def train(model, data, *, loss_fn, lr: float = 3e-3, compile: bool = False, backend: str = "inductor"):
    """AdamW over ``data``; returns the loss per step (floats)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    step = (lambda ids: loss_fn(model, ids))
    if compile:
        step = torch.compile(step, backend=backend)
    losses = []
    for ids in data:
        opt.zero_grad(set_to_none=True)
        loss = step(ids)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def run(*, steps: int = 50, batch: int = 2, seq: int = 16, compile: str | None = None, **model_kw) -> dict:
    """Stock (eager) vs tpukernels (eager, and compiled with backend ``compile`` if given) from one initial
    state on the same batches; returns the curves, max relative differences to stock and timings (s)."""
    base = make_model(**model_kw)
    data = batches(steps, batch=batch, seq=seq, vocab=base.config.vocab_size)
    out = {}
    for tag, fn, patch, backend in (("stock", stock_loss, False, None), ("eager", fused_loss, True, None),
                                    ("compiled", fused_loss, True, compile)):
        if tag == "compiled" and compile is None:
            continue
        model = copy.deepcopy(base)
        if patch:
            out["patched"] = apply_tpukernels(model, linear=True)
        t = time.perf_counter()
        out[tag] = train(model, data, loss_fn=fn, compile=backend is not None, backend=backend or "inductor")
        out[f"{tag}_s"] = time.perf_counter() - t
        if tag != "stock":
            out[f"{tag}_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(out[tag], out["stock"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--rtol", type=float, default=1e-3, help="allowed max relative loss difference per step")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile run")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    args = ap.parse_args(argv)
    r = run(steps=args.steps, batch=args.batch, seq=args.seq, compile=None if args.no_compile else args.backend,
            layers=args.layers, dim=args.dim, vocab=args.vocab, ffn=2 * args.dim)
    print(f"patched: {r['patched']}; stock (eager) loss {r['stock'][0]:.5f} -> {r['stock'][-1]:.5f} in "
          f"{r['stock_s']:.1f} s")
    failures = 0
    for tag in ("eager", "compiled"):
        if tag not in r:
            continue
        same = r[f"{tag}_max_rel_diff"] <= args.rtol
        learned = r[tag][-1] < 0.8 * r[tag][0]
        verdict = "ok" if same and learned else ", ".join(
            ([] if same else ["MISMATCH with stock"]) +
            ([] if learned else ["loss did not fall below 0.8x its start (train longer: --steps 50)"]))
        name = f"torch.compile({args.backend})" if tag == "compiled" else "eager"
        print(f"tpukernels {name}: loss {r[tag][0]:.5f} -> {r[tag][-1]:.5f} in {r[f'{tag}_s']:.1f} s (cpu interpret); "
              f"max relative difference to stock over {args.steps} steps {r[f'{tag}_max_rel_diff']:.2e} "
              f"(bound {args.rtol:g}) {verdict}")
        failures += not (same and learned)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
