"""Tiny random causal LMs of transformers' own architectures (nothing downloaded), for the patching sweep.

``tiny_causal_lm(model_type)`` takes the architecture's default config, shrinks every size attribute it has
(hidden 64, 2 layers or one of each layer type, 4 heads / 2 KV heads, head_dim 16, 4 experts top-2, a short
sliding window so windows apply to an 8-token probe), builds ``AutoModelForCausalLM`` from it in float32,
and randomizes every norm weight and bias (``w + 0.2 * randn``) so a dropped bias or a wrong ``(1 + w)``
changes the logits.
"""

from __future__ import annotations

import torch

SIZES = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, sliding_window=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, first_k_dense_replace=1,
    decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2, n_layer=2, n_head=4, n_embd=64,
    d_model=64, n_positions=128, ffn_dim=128, encoder_ffn_dim=128, decoder_ffn_dim=128, num_layers=2,
    state_size=8, expand=2, conv_kernel=4, n_groups=1, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
    mamba_d_state=8, mamba_d_conv=4, mamba_d_ssm=128, chunk_size=8, time_step_rank=8, ssm_state_size=8,
    mamba_headdim=32,
    index_n_heads=2, index_head_dim=16, index_topk=4, rotary_dim=8, partial_rotary_factor=0.5,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0, hidden_dropout=0.0,
    use_cache=False,
)


#: a tiny model above this many parameters is not built (the generic shrinker missed a nested size)
MAX_PARAMS = 16_000_000


def tiny_config(model_type: str):
    from transformers import AutoConfig, PretrainedConfig

    cfg = AutoConfig.for_model(model_type)
    subs = {id(cfg): cfg}
    for c in list(subs.values()):  # the config and every sub-config (text, vision, audio, attention, ...)
        for name in list(vars(c)):
            sub = getattr(c, name, None)
            if isinstance(sub, PretrainedConfig):
                subs.setdefault(id(sub), sub)
    for c in subs.values():
        _shrink(c)
    return cfg


def _has(c, name: str) -> bool:
    try:  # some configs raise their own error for a per-layer attribute read globally (gemma4's head_dim)
        return hasattr(c, name)
    except Exception:  # noqa: BLE001
        return False


def _shrink(c) -> None:
    for k, v in SIZES.items():
        if _has(c, k) and _settable(c, k) and not (k == "partial_rotary_factor" and getattr(c, k) in (None, 1.0)):
            setattr(c, k, v)
    if _has(c, "qk_rope_head_dim") and _has(c, "head_dim") and _settable(c, "head_dim"):
        c.head_dim = c.qk_rope_head_dim  # MLA configs: head_dim is the rotary part (deepseek's __init__ sets it)
    if _has(c, "kv_lora_rank") and _has(c, "num_key_value_heads"):
        c.num_key_value_heads = c.num_attention_heads  # MLA: one latent, expanded to every head
    if _has(c, "num_heads") and _has(c, "expand") and _has(c, "head_dim") and _settable(c, "num_heads"):
        c.num_heads = c.expand * c.hidden_size // c.head_dim  # Mamba2: heads x head_dim = the inner size
    lt = getattr(c, "layer_types", None) if _has(c, "layer_types") else None
    if isinstance(lt, (list, tuple)) and lt and _settable(c, "layer_types"):
        kinds = list(dict.fromkeys(lt))  # one layer of each type, in first-seen order
        c.layer_types = kinds if len(kinds) > 1 else kinds * 2
        c.num_hidden_layers = len(c.layer_types)
    bt = getattr(c, "layers_block_type", None) if _has(c, "layers_block_type") else None
    if bt:
        kinds = list(dict.fromkeys(bt))
        if _settable(c, "layers_block_type"):
            c.layers_block_type = kinds if len(kinds) > 1 else kinds * 2
            c.num_hidden_layers = len(c.layers_block_type)
        else:  # derived from num_hidden_layers (jamba, bamba, falcon-h1): the fewest layers with every kind
            for n in range(2, 17):
                c.num_hidden_layers = n
                if set(c.layers_block_type) >= set(kinds):
                    break
    c._attn_implementation = "eager"


def _settable(c, name: str) -> bool:
    name = getattr(c, "attribute_map", {}).get(name, name)  # falcon-h1: layer_types -> layers_block_type
    prop = getattr(type(c), name, None)
    return not isinstance(prop, property) or prop.fset is not None


def randomize_norms(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if ("norm" in name.lower() and p.dim() == 1) or (leaf == "bias" and p.dim() == 1):
                p.add_(0.2 * torch.randn(p.shape, generator=g).to(p.dtype))
        for name, b in model.named_buffers():
            if "norm" in name.lower() and b.dim() == 1 and b.is_floating_point():
                b.add_(0.2 * torch.randn(b.shape, generator=g).to(b.dtype))


def tiny_causal_lm(model_type: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    with torch.device("meta"):  # sizes the shrinker missed (nested sub-configs) show here, before any memory
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {n / 1e6:.1f}M parameters (> {MAX_PARAMS / 1e6:.0f}M)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    randomize_norms(model, seed)
    return model


def probe_batch(vocab: int = 96, seed: int = 1):
    """A left-padded [2, 8] batch (row 0 has 3 pad tokens)."""
    ids = torch.randint(3, vocab, (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    return ids, mask


#: float32 logits after 2 layers: one kernel's reduction order (observed <= 1e-6 relative)
TOL = 1e-4


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.double()


def sweep_one(model_type: str) -> dict:
    """Patch one tiny architecture with every option on (``rope``, ``gated_mlp``); compare with stock.

    Returns ``{"model_type", "status": "built"|"no tiny config"|"stock fails", "why", "err" (max relative
    logit difference at non-padded positions), "report" (apply_tpukernels' return), "warnings", "model"}``.
    """
    import warnings

    from tpukernels.integrations import patch_probes
    from tpukernels.integrations import transformers as tki

    row = {"model_type": model_type, "status": "built", "why": None, "err": None, "report": None,
           "warnings": [], "model": None}
    try:
        model = tiny_causal_lm(model_type)
    except Exception as e:  # noqa: BLE001 - an architecture the generic shrinker cannot build
        return dict(row, status="no tiny config", why=f"{type(e).__name__}: {str(e)[:120]}")
    ids, mask = probe_batch(model.get_input_embeddings().num_embeddings)
    try:
        want = logits(model, ids, mask)
    except Exception as e:  # noqa: BLE001
        return dict(row, status="stock fails", why=f"{type(e).__name__}: {str(e)[:120]}")
    patch_probes.verdicts.clear()
    tki._stock_warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tki.apply_tpukernels(model, rope=True, gated_mlp=True)
    got = logits(model, ids, mask)
    keep = mask.bool()
    err = float((got[keep] - want[keep]).abs().max() / want[keep].abs().max())
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return dict(row, err=err, report=report, warnings=messages, model=model)


def markdown_row(r: dict) -> str:
    if r["status"] != "built":
        return f"| `{r['model_type']}` | not built here ({r['status']}) | | |"
    rep = r["report"]
    done = [k for k in ("attention",) if rep[k]] + [f"{k} {rep[k]}" for k in
                                                    ("rms_norm", "gated_rms_norm", "linear_attention", "layer_norm",
                                                     "moe_experts", "gated_mlp", "rope")
                                                    if rep.get(k)]
    stock = ", ".join(sorted(rep["stock"])) or "-"
    status = "equal" if r["err"] <= TOL else f"DIFFERS {r['err']:.3g}"
    return f"| `{r['model_type']}` | {status} | {', '.join(done) or '-'} | {stock} |"


if __name__ == "__main__":  # python tests/hf_tiny.py [model_type ...]: ARCHITECTURES.md's table, one row a model
    import gc
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = sys.argv[1:] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    print("| model_type | logits vs stock | patched | left stock (warned) |\n|---|---|---|---|", flush=True)
    for t in types:
        try:
            print(markdown_row(sweep_one(t)), flush=True)
        except Exception as e:  # noqa: BLE001 - a patched model that raises is a finding, not a crash
            print(f"| `{t}` | RAISES {type(e).__name__}: {str(e)[:100]} | | |", flush=True)
        gc.collect()
