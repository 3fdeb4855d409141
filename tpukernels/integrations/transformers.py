"""Hugging Face transformers integration: ``attn_implementation="tpukernels"`` and module patching.

* :func:`register` adds ``"tpukernels"`` to transformers' ``AttentionInterface`` (our flash attention)
  and to ``AttentionMaskInterface`` (transformers' own SDPA-style mask builder, so the attention function
  receives the model's real mask: ``None`` when plain causal / full attention suffices, else a boolean
  ``[B, 1, Sq, Skv]`` mask).
* :func:`attention_forward` maps HF's arguments onto :func:`tpukernels.library.attention.flash_attention`:
  ``scaling`` -> ``sm_scale``, ``softcap`` -> ``softcap``, GQA natively (no ``repeat_kv``), and the mask
  onto causal / sliding window / key-padding segment ids; decode steps pad K/V to a bucket (invalid keys
  masked) so a growing KV cache does not recompile per length. The mask is **verified**, not guessed: the
  candidate (causal?, window, padding) is rebuilt densely and compared with the model's mask; a mask
  that is none of these (e.g. prefix-LM, chunked or custom 4-D masks), float masks with non-(0/-inf)
  biases, and training-time dropout fall back to a float32 eager attention with a one-time warning —
  never silently wrong.
* :func:`apply_tpukernels` swaps RMSNorm / LayerNorm modules (with each family's casting: Llama-style
  ``weight * x_normed.to(dtype)``, Gemma-style ``(x_normed * (1 + w)).to(dtype)``) and, opt-in, ``nn.Linear``
  layers; per-family helpers in the style of Liger-Kernel's ``apply_liger_kernel_to_*`` wrap it.

Works on cpu tensors (interpret mode) here; on a TPU host with torch_tpu the same code runs on ``tpu``
tensors.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from ..errors import ArgumentError, TpuKernelError
from . import patch_probes

try:  # registers quant_method "tpukernels": from_pretrained of a model saved after apply_tpukernels(quantize=...)
    from . import quantizers as _quantizers  # noqa: F401
except ImportError:  # transformers not installed
    _quantizers = None

NAME = "tpukernels"
_warned: set = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"tpukernels attention: {msg}; using a float32 eager fallback for these calls", RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------------------------------ mask mapping
def _dense(b: int, sq: int, skv: int, causal: bool, alignment: str, left: Optional[int], kv_valid, device):
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(skv, device=device)[None, :]
    off = skv - sq if alignment == "bottom_right" else 0
    vis = torch.ones(sq, skv, dtype=torch.bool, device=device)
    if causal:
        vis &= j <= i + off
    if left is not None:
        vis &= j >= i + off - left
    vis = vis[None].expand(b, sq, skv)
    if kv_valid is not None:
        vis = vis & kv_valid[:, None, :]
    return vis


def mask_to_spec(mask: Optional[torch.Tensor], sq: int, skv: int, *, is_causal: bool, sliding_window: Optional[int]):
    """Express an HF attention mask as flash-attention arguments, or return None if it cannot be.

    Args:
        mask: None, or ``[B, 1 | H, Sq, Skv]`` boolean (True = attend) or additive float (0 / large negative).
        is_causal: the module's ``is_causal`` (used when ``mask`` is None, as SDPA does).
        sliding_window: the layer's window in HF's convention (a query sees keys ``j > i - sliding_window``).

    Returns:
        ``dict(causal, causal_alignment, window_left, kv_valid)`` (``kv_valid``: ``[B, Skv]`` bool or None),
        or None when the mask is not causal x window x key-padding.
    """
    if mask is None:
        # SDPA semantics: causal (top-left) for multi-token queries, no mask otherwise
        return dict(causal=bool(is_causal and sq > 1), causal_alignment="top_left", window_left=None, kv_valid=None)
    if mask.dtype != torch.bool:
        if not mask.dtype.is_floating_point:
            return None
        neg = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | neg).all()):
            return None  # a real additive bias (ALiBi, relative positions): not expressible
        mask = ~neg
    if mask.dim() != 4:
        return None
    if mask.shape[1] != 1:
        if not bool((mask == mask[:, :1]).all()):
            return None  # per-head masks
        mask = mask[:, :1]
    m = mask[:, 0].expand(mask.shape[0], sq, skv)
    b = m.shape[0]
    kv_valid = m.any(dim=1)
    kvv = None if bool(kv_valid.all()) else kv_valid
    windows = [None]
    if sliding_window:
        windows = [sliding_window - 1, sliding_window, None]
    order = (True, False) if is_causal else (False, True)
    for causal in order:
        for alignment in (("bottom_right", "top_left") if causal else ("top_left",)):
            for left in windows:
                if left is not None and not causal:
                    continue
                if torch.equal(_dense(b, sq, skv, causal, alignment, left, kvv, m.device), m):
                    return dict(causal=causal, causal_alignment=alignment, window_left=left, kv_valid=kvv)
    return None


def _eager(query, key, value, mask, scaling, softcap, dropout, training, sinks=None):
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1).float()
    v = value.repeat_interleave(group, dim=1).float()
    s = query.float() @ k.transpose(-1, -2) * scaling
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if sinks is not None:  # gpt-oss: a per-head logit joins the denominator, its column is dropped after
        s = torch.cat([s, sinks.float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    p = torch.nn.functional.dropout(p, p=dropout, training=training)
    return (p @ v).to(query.dtype)


# ------------------------------------------------------------------------------------------ attention
#: keyword arguments transformers passes to an attention function that do not change its result (bookkeeping
#: of the cache, positions already applied by RoPE, output flags) or that :func:`attention_forward` reads
_KNOWN_KWARGS = frozenset({
    "s_aux", "position_ids", "cache_position", "output_attentions", "use_cache", "past_key_value",
    "past_key_values", "layer_idx", "return_dict", "output_hidden_states", "position_embeddings",
    "token_type_ids", "output_router_logits", "logits_to_keep",
})  # not here, so refused when given: head_mask, cu_seq_lens_* / max_length_* (packed sequences)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
):
    """transformers attention function (``AttentionInterface`` signature).

    Args:
        query: ``[B, Hq, Sq, D]``; key, value: ``[B, Hkv, Skv, D]`` (GQA: Hq a multiple of Hkv).
        attention_mask: None or ``[B, 1, Sq, Skv]`` (bool or additive float), from transformers' SDPA mask.
        scaling: softmax scale (default ``1/sqrt(D)``). softcap: logit soft-cap. sliding_window: HF window.
        s_aux (keyword, gpt-oss): ``[Hq]`` attention-sink logits, passed to ``flash_attention(sinks=)``.
        indices (keyword, DeepSeek-V3.2 / GLM-MoE-DSA): ``[B, Sq, topk]`` int key positions the DSA indexer
            selected per query (shared by the heads); only those keys, ANDed with the mask, are attended
            (:func:`tpukernels.library.attention.topk_sparse_attention`, what their eager path computes).

    Returns:
        ``(attn_output [B, Sq, Hq, D], None)`` (attention weights are never materialized).
    """
    if _attention_calls is not None:  # only while the whole-model probe runs (a constant for torch.compile)
        _attention_calls.append(type(module).__name__)
    indices = kwargs.pop("indices", None)
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _KNOWN_KWARGS)
    if unknown:  # an argument that may change the result (a sparse top-k ``indices``, ...): not ours to drop
        raise ArgumentError(
            f"tpukernels attention: {type(module).__name__} passes {unknown}, which this attention does not "
            f"implement; keep this model's attention stock (apply_tpukernels(attention=False))")
    sq, skv = query.shape[2], key.shape[2]
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    causal_default = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    sliding_window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    training = bool(getattr(module, "training", False))
    sinks = kwargs.get("s_aux")
    if indices is not None:
        return _index_sparse(query, key, value, attention_mask, indices, scaling, softcap, dropout, training, sinks,
                             causal_default), None
    spec = None
    if training and dropout > 0:
        _warn_once("dropout", f"attention dropout {dropout} in training mode is not supported by the kernel")
    else:
        spec = mask_to_spec(attention_mask, sq, skv, is_causal=causal_default, sliding_window=sliding_window)
        if spec is None:
            _warn_once("mask", "this attention mask is not causal / sliding-window / key-padding")
    if spec is None:
        if attention_mask is None and causal_default and sq > 1:
            attention_mask = _dense(query.shape[0], sq, skv, True, "top_left", None, None, query.device)[:, None]
        out = _eager(query, key, value, attention_mask, scaling, softcap, dropout, training, sinks)
        return out.transpose(1, 2).contiguous(), None
    from ..library.attention import flash_attention

    if sq == 1 and spec["window_left"] is None and (not spec["causal"] or spec["causal_alignment"] == "bottom_right"):
        key, value, spec = _bucket_decode_keys(key, value, spec)
    seg = {}
    if spec["kv_valid"] is not None:
        seg = dict(
            q_segment_ids=torch.ones(query.shape[0], sq, dtype=torch.int32, device=query.device),
            kv_segment_ids=spec["kv_valid"].to(torch.int32),
        )
    out = flash_attention(
        query, key, value,
        causal=spec["causal"], causal_alignment=spec["causal_alignment"], sm_scale=scaling,
        window=(spec["window_left"], None), softcap=softcap, sinks=sinks, **seg,
    )
    return out.transpose(1, 2).contiguous(), None


def _index_sparse(query, key, value, mask, indices, scaling, softcap, dropout, training, sinks, is_causal):
    """DSA attention (``indices=``): :func:`tpukernels.library.attention.topk_sparse_attention` over the
    selected keys ANDed with ``mask``; the float32 eager fallback (the index mask ANDed in, with the one-time
    warning) for what that kernel does not take: training dropout, attention sinks, per-head or biased masks.
    Returns ``[B, Sq, Hq, Dv]``."""
    from ..library.attention import topk_sparse_attention
    from ..library.attention.topk_sparse import index_visibility

    b, _, sq, _ = query.shape
    skv = key.shape[2]
    vis = None  # bool [B, 1, Sq, Skv] (True = visible) or None (nothing but the index set)
    biased = False
    if mask is None:
        if is_causal and sq > 1:  # SDPA semantics, as mask_to_spec
            vis = _dense(b, sq, skv, True, "top_left", None, None, query.device)[:, None]
    elif mask.dtype == torch.bool:
        vis = mask
    elif mask.dtype.is_floating_point:
        neg = mask <= torch.finfo(mask.dtype).min / 2
        biased = not bool(((mask == 0) | neg).all())
        vis = ~neg
    else:
        biased = True
    if vis is not None and vis.dim() == 4 and vis.shape[1] != 1:
        if bool((vis == vis[:, :1]).all()):
            vis = vis[:, :1]
        else:
            biased = True  # per-head masks
    why = None
    if training and dropout > 0:
        why = f"attention dropout {dropout} in training mode is not supported by the kernel"
    elif sinks is not None:
        why = "attention sinks with DSA indices are not supported by the sparse kernel"
    elif biased:
        why = "this attention mask (additive bias or per-head) with DSA indices is not supported by the sparse kernel"
    if why is None:
        vis = None if vis is None else vis.expand(b, 1, sq, skv)
        out = topk_sparse_attention(query, key, value, indices, attention_mask=vis, sm_scale=scaling, softcap=softcap)
        return out.transpose(1, 2).contiguous()
    _warn_once("dsa:" + why[:20], why)
    sel = index_visibility(indices, skv)[:, None]  # [B, 1, Sq, Skv]
    if mask is None or mask.dtype == torch.bool:
        full = sel if vis is None else vis & sel
    else:
        full = mask.float().masked_fill(~sel, float("-inf"))
    out = _eager(query, key, value, full, scaling, softcap, dropout, training, sinks)
    return out.transpose(1, 2).contiguous()


def _bucket_decode_keys(key, value, spec):
    """Decode step (one query that sees every valid key): pad K/V to the row bucket of Skv and mark the
    padding invalid, so a growing KV cache reuses one compiled kernel per bucket instead of one per length."""
    from ..dsl.kernel import bucket

    b, _, skv, _ = key.shape
    if skv == 0:
        return key, value, spec
    pad = bucket(skv) - skv  # segment ids even when pad == 0: one signature for the whole bucket
    valid = spec["kv_valid"] if spec["kv_valid"] is not None else torch.ones(b, skv, dtype=torch.bool, device=key.device)
    key = torch.nn.functional.pad(key, (0, 0, 0, pad))
    value = torch.nn.functional.pad(value, (0, 0, 0, pad))
    valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    return key, value, dict(spec, causal=False, causal_alignment="top_left", kv_valid=valid)


def register() -> None:
    """Register ``attn_implementation="tpukernels"`` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


# ------------------------------------------------------------------------------------------ modules
def _rms_candidates(module: torch.nn.Module) -> list[tuple[str, float]]:
    """(casting, offset) forms to probe for an RMSNorm class, the likeliest first (the name only orders
    the probes; the probe decides): Llama ``w * n.to(dtype)``, Gemma / Qwen3-Next ``(n * (1 + w)).to(dtype)``,
    the two other combinations, and ``"none"`` (no weight: falcon-mamba's weightless norm)."""
    forms = [("llama", 0.0), ("gemma", 1.0), ("gemma", 0.0), ("llama", 1.0), ("none", 0.0)]
    if type(module).__name__.startswith("Gemma"):
        forms.insert(0, forms.pop(1))
    return forms


def _share_weight(new: torch.nn.Module, old: torch.nn.Module, name: str = "weight") -> None:
    """Give ``new`` the tensor ``old.<name>`` is: the same Parameter, or the same buffer (falcon-mamba's
    RMSNorm holds its weight as a buffer), persistent as it was."""
    t = getattr(old, name)
    if t is None or isinstance(t, torch.nn.Parameter):
        setattr(new, name, t)
        return
    new._parameters.pop(name, None)
    new.register_buffer(name, t, persistent=name not in old._non_persistent_buffers_set)


def _eps_of(module: torch.nn.Module, default: float) -> float:
    for a in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(module, a, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return default


def _plan_rms_norm(child: torch.nn.Module):
    """(replacement, None) for the first probed form equal to ``child``'s forward, else (None, reason)."""
    from ..library.norms import TPURMSNorm

    why = patch_probes.probe_blocker(child)
    if why:
        return None, why
    reasons = []
    for casting, offset in _rms_candidates(child):
        def build(m, casting=casting, offset=offset):
            if casting == "none":  # a weightless norm (its weight, if any, a dummy its forward never reads)
                return TPURMSNorm(m.weight.shape[0], eps=_eps_of(m, 1e-6), elementwise_affine=False)
            new = TPURMSNorm(m.weight.shape[0], eps=_eps_of(m, 1e-6), offset=offset, casting=casting)
            _share_weight(new, m)
            return new

        why = patch_probes.verify_replacement(child, build, f"rms:{casting}:{offset}")
        if why is None:
            return build(child), None
        reasons.append(why)
    return None, f"no RMSNorm form matches its forward (first tried: {reasons[0]})"


def _is_gated_rms_norm(module: torch.nn.Module) -> bool:
    """A candidate gated norm (the probe decides): an ``*RMSNormGated`` class with a 1-D weight whose forward
    takes ``(hidden_states, gate)``."""
    import inspect

    w = getattr(module, "weight", None)
    if not type(module).__name__.endswith("RMSNormGated") or not isinstance(w, torch.Tensor) or w.dim() != 1:
        return False
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) == 2 and params[1] in ("gate", "z")


def _gated_candidates(m: torch.nn.Module) -> list[dict]:
    """Forms of :class:`TPUGatedRMSNorm` to probe, the likeliest first: the gate order, group size and
    activation the module states (``norm_before_gate``, ``group_size`` / ``n_groups``, ``activation``) where
    it has them, else both ways; Llama-style roundings, then float32 throughout."""
    h = m.weight.shape[0]
    group = getattr(m, "group_size", None)
    if group is None and isinstance(getattr(m, "n_groups", None), int) and m.n_groups > 0 and h % m.n_groups == 0:
        group = h // m.n_groups
    group = group if isinstance(group, int) and not isinstance(group, bool) and group != h else None
    orders = [m.norm_before_gate] if isinstance(getattr(m, "norm_before_gate", None), bool) else [True, False]
    acts = ["silu", "sigmoid"]
    if getattr(m, "activation", None) in ("sigmoid",):
        acts.reverse()
    return [dict(group_size=group, norm_before_gate=o, activation=a, casting=c)
            for o in orders for a in acts for c in ("llama", "gemma")]


def _gated_swap(original: torch.nn.Module, form: dict) -> torch.nn.Module:
    """A :class:`tpukernels.library.norms.TPUGatedRMSNorm` in ``form`` sharing ``original``'s weight (its state
    dict keeps the one key ``weight``). transformers' hybrid layers always pass the gate; a call without one
    raises (the library op takes ``z``), it never falls back silently."""
    from ..library.norms import TPUGatedRMSNorm

    new = TPUGatedRMSNorm(original.weight.shape[0], eps=_eps_of(original, 1e-6), **form)
    _share_weight(new, original)
    return new


def _plan_gated_rms_norm(child: torch.nn.Module):
    """(replacement, None) for the first probed gated form equal to ``child``'s forward, else (None, reason)."""
    why = patch_probes.probe_blocker(child, n_inputs=2)
    if why:
        return None, why
    reasons = []
    for form in _gated_candidates(child):
        def build(m, form=form):
            return _gated_swap(m, form)

        variant = "gated:" + ":".join(f"{k}={v}" for k, v in sorted(form.items()))
        why = patch_probes.verify_replacement(child, build, variant, n_inputs=2)
        if why is None:
            return build(child), None
        reasons.append(why)
    return None, f"no gated RMSNorm form matches its forward (first tried: {reasons[0]})"


def _plan_layer_norm(child: torch.nn.LayerNorm):
    from ..library.norms import TPULayerNorm

    def build(m):
        new = TPULayerNorm(m.normalized_shape[0], eps=m.eps, elementwise_affine=m.weight is not None,
                           bias=getattr(m, "bias", None) is not None)
        if m.weight is not None:
            _share_weight(new, m, "weight")
        if getattr(m, "bias", None) is not None:
            _share_weight(new, m, "bias")
        return new

    why = patch_probes.verify_replacement(child, build, "layer_norm")
    return (build(child), None) if why is None else (None, why)


def _plan_linear(child: torch.nn.Linear):
    why = patch_probes.verify_replacement(child, TPULinear, "linear", randomize=False)
    return (TPULinear(child), None) if why is None else (None, why)


def _is_rms_norm(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("RMSNorm") and hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 1


class TPULinear(torch.nn.Module):
    """``nn.Linear`` on the tpukernels matmul (weight ``[out, in]`` used as ``W.t()`` without a copy)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..library.matmul_ops import matmul

        return matmul(x, self.weight.t(), bias=self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def check_quant_pair(w_dtype: str, x_quant: Optional[str], in_features: int, where: str) -> None:
    """Raise the typed error a ``quantized_matmul`` call of ``w_dtype`` weights with ``x_quant`` activations and
    ``in_features`` = K would raise (int8 weights with ``x_quant='fp8'``, fp8 weights with ``'int8'``, K too large
    for an int8 x int8 sum, a target chip lacking the mode), before any module is built: the call's own check
    (``quantized_matmul.check_public``) run on data-free meta tensors of the call's dtypes and K."""
    from ..library.quantized_matmul_ops import check_public

    x = torch.empty(1, in_features, device="meta")
    w_q = torch.empty(1, in_features, dtype=getattr(torch, w_dtype), device="meta")
    try:
        check_public(x, w_q, torch.empty(1, device="meta"), x_quant, None)
    except TpuKernelError as e:
        msg = str(e).removeprefix("tpukernels::quantized_matmul: ")
        raise type(e)(f"{where}: {msg}") from None


def apply_tpukernels(
    model: torch.nn.Module,
    *,
    attention: bool = True,
    rms_norm: bool = True,
    layer_norm: bool = True,
    linear: bool = False,
    quantize: Optional[str] = None,
    x_quant: Optional[str] = None,
    quantize_skip: tuple = ("lm_head", "gate", "shared_expert_gate"),
    moe: bool = True,
    rope: bool = False,
    gated_mlp: bool = False,
    linear_attention: bool = True,
    dry_run: bool = False,
    probe_inputs: Optional[dict] = None,
) -> dict:
    """Patch a transformers model in place to run on tpukernels ops.

    Nothing is replaced on a module's name alone: every replacement is **probed** against what it replaces
    the first time its class is seen (:mod:`tpukernels.integrations.patch_probes`): norms, linears and gated
    MLPs on ``[3, 5, H]`` inputs with the module's own weights (norms also with random weights, so a
    ``(1 + w)`` formula cannot pass by accident), RoPE on random tables, and attention on the whole model (its
    logits on a left-padded ``[2, 8]`` batch, or ``probe_inputs``, with its own attention implementation and
    with ours). A class whose probe differs beyond the tolerance for its dtype stays stock, with one
    ``RuntimeWarning`` naming it and why, and is listed in the report's ``"stock"``. Every replacement is
    planned (and probed) before any is made: an error leaves the model as it was.

    Args:
        attention: set ``attn_implementation="tpukernels"`` (models using the standard attention interface)
            where the whole-model probe agrees; a model that passes an attention argument this implementation
            does not implement (packed ``cu_seq_lens_*``, ``head_mask``) fails that probe and keeps its own
            attention. DeepSeek-V3.2 / GLM-MoE-DSA's DSA ``indices`` run on
            :func:`tpukernels.library.attention.topk_sparse_attention` (the probe runs with each indexer's
            ``index_topk`` narrowed to :data:`patch_probes.PROBE_TOPK`, below the probe's length, so that the
            selection is what it compares).
        rms_norm: replace RMSNorm modules with :class:`tpukernels.library.norms.TPURMSNorm` in the form the
            probe finds: Llama ``w * n.to(dtype)``, Gemma / Qwen3-Next ``(n * (1 + w)).to(dtype)``, the two
            other casting/offset combinations, or weightless (falcon-mamba); a norm with a bias matches none
            and stays stock. Gated ``*RMSNormGated`` modules (``forward(hidden_states, gate)``: Qwen3-Next,
            Mamba2, Nemotron-H, Kimi-Linear, ...) become :class:`tpukernels.library.norms.TPUGatedRMSNorm` in the
            gate order, group size, activation and roundings their probe finds (counted as ``gated_rms_norm``).
        layer_norm: replace ``nn.LayerNorm`` (BERT-family encoders).
        linear: replace ``nn.Linear`` with the tpukernels matmul (opt-in: slow in cpu interpret mode).
        quantize: ``"int8"`` / ``"float8_e4m3fn"`` / ``"float8_e5m2"`` (``"fp8"`` = e4m3fn): replace each
            ``nn.Linear`` with a :class:`tpukernels.library.quantized_matmul_ops.TPUQuantLinear` holding its
            weight quantized per output channel (a new buffer: the float weight is dropped from the module,
            so the state dict changes to ``w_q`` / ``w_scale``); takes precedence over ``linear``. A transformers
            model also gets ``config.quantization_config`` (quant_method ``"tpukernels"``, the quantized module
            names): ``save_pretrained`` then ``from_pretrained`` gives back bit-identical ``w_q`` / ``w_scale`` /
            ``bias`` (:mod:`tpukernels.integrations.quantizers`; loading needs this module imported). Quantized
            linears are an approximation by request and are not probed for equality.
        x_quant: with ``quantize``: None (w8a16) or ``"int8"`` / ``"fp8"`` (w8a8, per-token activations);
            ``"int8"`` goes with ``quantize="int8"``, ``"fp8"`` with the float8 ones. A mismatched pair, or
            ``x_quant`` without ``quantize``, raises (DTypeError / ArgumentError) before anything is patched.
        quantize_skip: child names never quantized. Default: the LM head (kept in full precision as is usual)
            and MoE routers (Mixtral / Qwen-MoE ``gate``, Qwen-MoE ``shared_expert_gate``): a router's logits
            pick the top-k experts, and a quantization error there can change which experts run.

        moe: route MoE experts modules (3-D ``gate_up_proj [E, 2I, H]`` parameters: Mixtral, Qwen-MoE,
            gpt-oss, Aria) through ``grouped_matmul`` (:func:`tpukernels.integrations.moe.apply_tpukernels_moe`,
            probed per class); experts it cannot route stay stock with the warning; models without experts are
            unaffected. Expert weights are not quantized by ``quantize`` (they are not ``nn.Linear``).
        rope: route the model's ``apply_rotary_pos_emb`` through :func:`tpukernels.library.rope.apply_rotary_pos_emb`
            (opt-in) where a probe on random tables agrees. HF calls it as a module global: the modeling
            module's function becomes a :class:`RopeDispatch` that runs ours only inside the forward of a model
            patched with ``rope=True`` (another model of the same family in the process keeps HF's function).
            Only functions with the llama signature ``(q, k, cos, sin, unsqueeze_dim=1)`` are tried (cos/sin
            still come from HF's rotary module: every ``rope_type`` works).
        gated_mlp: replace ``*MLP`` modules with ``gate_proj`` / ``up_proj`` / ``down_proj`` and a SiLU / GELU
            ``act_fn`` by :class:`tpukernels.library.gated_mlp.TPUGatedMLP` (the fused ``act(gate) * up``;
            the same linear modules, so state dicts are unchanged). Opt-in; the activation is identified
            by evaluating ``act_fn`` in float64, never by its name; the module is probed as a whole.
        linear_attention: run the linear-attention / SSM mixers of hybrid models on our kernels
            (:mod:`tpukernels.integrations.linear_mixers`): Qwen3-Next / Qwen3.5 gated DeltaNet (causal conv1d
            prefill + decode, chunked + recurrent gated delta rule), Kimi-Linear KDA, and the Mamba2 mixers of
            Mamba2 / Nemotron-H / Falcon-H1 / Bamba / Granite-4 (conv, SSD chunked scan, ``selective_state_update``);
            their gated norms go through ``rms_norm``. A mixer class is patched where a probe of the mixer on its
            own weights (prefill, decode steps with the model's cache, cache states) agrees with transformers'
            functions; a mixer is a candidate because its forward calls those functions, not by its name.
        dry_run: plan and probe only: return the report, change nothing (the model keeps its modules and its
            attention implementation).
        probe_inputs: keyword arguments of ``model(**probe_inputs)`` for the attention probe (default: a
            left-padded ``[2, 8]`` batch of token ids and its attention mask); give them for a model that
            takes other inputs.

    Returns:
        ``{"attention": bool, "rms_norm": n, "gated_rms_norm": n, "layer_norm": n, "linear": n, "moe_experts": n,
        "linear_attention": n, "stock": {...}}``
        (plus ``"quantized": n`` with ``quantize``; ``"rope"``: patched modeling modules, ``"gated_mlp"``: n
        with those options) — what was patched (with ``dry_run``: what would be). ``"stock"`` maps each class
        (``"attention"`` for the attention implementation, ``"<module>.apply_rotary_pos_emb"`` for RoPE) left
        stock to why. Parameters of norms and ``linear=True`` layers are shared with the original modules,
        so their state dicts and weight tying are unchanged.

    Raises:
        ArgumentError / DTypeError: bad ``quantize`` / ``x_quant`` (before anything is patched). A module
        that cannot be replaced is not an error: it stays stock and is reported.
    """

    def quantizable(name, child) -> bool:
        return bool(quantize) and type(child) is torch.nn.Linear and name not in quantize_skip

    # typed errors before anything is patched (a bad value must not leave a half-patched model)
    if x_quant is not None and not quantize:
        from ..errors import ArgumentError

        raise ArgumentError(f"apply_tpukernels: x_quant={x_quant!r} needs quantize= (x_quant picks how the "
                            f"activations of quantized linears are quantized: give quantize='int8' or 'fp8', "
                            f"or drop x_quant)")
    if quantize:
        from ..library.quantized_matmul_ops import canon_x_quant, weight_dtype_name

        quantize = weight_dtype_name(quantize, "apply_tpukernels(quantize=...)")
        x_quant = canon_x_quant(x_quant)
        ks = {c.in_features for p in model.modules() for n, c in p.named_children() if quantizable(n, c)}
        for k in sorted(ks):
            check_quant_pair(quantize, x_quant, k, f"apply_tpukernels(quantize={quantize!r}, x_quant={x_quant!r})")
        from .quantizers import check_can_mark

        check_can_mark(model, quantize, x_quant)
    counts = {"attention": False, "rms_norm": 0, "gated_rms_norm": 0, "layer_norm": 0, "linear": 0,
              "linear_attention": 0}
    if quantize:
        counts["quantized"] = 0
    stock: dict = {}  # class (or "attention" / a modeling module) -> why it stays stock
    if attention:
        why = _verify_attention(model, probe_inputs)
        if why is None:
            counts["attention"] = True
        else:
            stock["attention"] = why

    # plan every module replacement (probed, nothing changed yet), then apply them all
    plan = []  # (parent, child name, replacement, count key)
    quantized = []  # dotted names of the linears replaced by TPUQuantLinear (the saved quantization_config)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            new, key, why = None, None, None
            if rms_norm and _is_gated_rms_norm(child):
                (new, why), key = _plan_gated_rms_norm(child), "gated_rms_norm"
            elif rms_norm and _is_rms_norm(child):
                (new, why), key = _plan_rms_norm(child), "rms_norm"
            elif layer_norm and isinstance(child, torch.nn.LayerNorm) and len(child.normalized_shape) == 1:
                (new, why), key = _plan_layer_norm(child), "layer_norm"
            elif quantizable(child_name, child):
                from ..library.quantized_matmul_ops import TPUQuantLinear

                new, key = TPUQuantLinear.from_linear(child, quantize, x_quant), "quantized"
                quantized.append(f"{parent_name}.{child_name}" if parent_name else child_name)
            elif linear and type(child) is torch.nn.Linear:
                (new, why), key = _plan_linear(child), "linear"
            if why is not None:
                stock.setdefault(type(child).__name__, why)
            elif new is not None:
                plan.append((parent, child_name, new, key))
    mixer_plan = []
    if linear_attention:
        from .linear_mixers import plan_mixers

        mixer_plan = plan_mixers(model, stock)
    rope_plan = _plan_rope(model, stock) if rope else []
    mlp_plan = _plan_gated_mlp(model, stock) if gated_mlp else []
    moe_candidates = moe and any(isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter) for m in model.modules())
    if moe_candidates:
        from .moe import plan_moe

        for _, cls, why in plan_moe(model):
            if why:
                stock.setdefault(cls, why)
    for cls, why in stock.items():
        if cls not in _stock_warned:
            _stock_warned.add(cls)
            what = "attention implementation" if cls == "attention" else cls
            warnings.warn(f"apply_tpukernels: {what} left stock: {why}", RuntimeWarning, stacklevel=2)
    counts["stock"] = stock
    if dry_run:
        counts["rms_norm"] = sum(k == "rms_norm" for *_, k in plan)
        counts["layer_norm"] = sum(k == "layer_norm" for *_, k in plan)
        counts["linear"] = sum(k == "linear" for *_, k in plan)
        counts["gated_rms_norm"] = sum(k == "gated_rms_norm" for *_, k in plan)
        counts["linear_attention"] = len(mixer_plan)
        if quantize:
            counts["quantized"] = len(quantized)
        if rope:
            counts["rope"] = len(rope_plan)
        if gated_mlp:
            counts["gated_mlp"] = len(mlp_plan)
        from .moe import plan_moe

        counts["moe_experts"] = sum(why is None for *_, why in plan_moe(model)) if moe_candidates else 0
        return counts

    # apply
    if counts["attention"]:
        _set_attn(model, NAME)
    for parent, child_name, new, key in plan:
        setattr(parent, child_name, new)
        counts[key] += 1
    if linear_attention:
        from .linear_mixers import apply_mixers

        counts["linear_attention"] = apply_mixers(mixer_plan)
    if quantize:  # what save_pretrained writes as config.json's quantization_config (from_pretrained reads it)
        from .quantizers import mark_quantized

        mark_quantized(model, quantize, x_quant, quantized)
    if rope:
        counts["rope"] = _apply_rope(model, rope_plan)
    if gated_mlp:
        for parent, child_name, new in mlp_plan:
            setattr(parent, child_name, new)
        counts["gated_mlp"] = len(mlp_plan)
    counts["moe_experts"] = 0
    if moe_candidates:
        from .moe import apply_tpukernels_moe

        with warnings.catch_warnings():  # its stock warnings were given above, as this call's "stock"
            warnings.simplefilter("ignore")
            counts["moe_experts"] = len(apply_tpukernels_moe(model))
    return counts


_stock_warned: set = set()


# ------------------------------------------------------------------------------------------ attention probe
_attention_calls: Optional[list] = None  # the whole-model probe's record of attention_forward calls


def _set_attn(model: torch.nn.Module, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def _default_probe_inputs(model: torch.nn.Module) -> Optional[dict]:
    """A left-padded ``[2, 8]`` batch of token ids for a model with input embeddings (None otherwise)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    if not isinstance(n, int) or n < 2:
        return None
    device = emb.weight.device
    ids = torch.randint(0, n, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones(2, 8, dtype=torch.long, device=device)
    mask[0, :3] = 0  # left padding: the key-padding path of the mask mapping is exercised
    return {"input_ids": ids, "attention_mask": mask}


def _main_output(out):
    for name in ("logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out if isinstance(out, torch.Tensor) else None


def _run(model, inputs):
    with torch.no_grad():
        try:
            return _main_output(model(**inputs, use_cache=False))
        except TypeError:
            return _main_output(model(**inputs))


def _verify_attention(model: torch.nn.Module, probe_inputs: Optional[dict]) -> Optional[str]:
    """Whole-model probe of ``attn_implementation="tpukernels"``: the model's main output (logits / last
    hidden state) on ``probe_inputs`` (default: :func:`_default_probe_inputs`) with its own attention
    implementation and with ours; None when they agree within :data:`patch_probes.MODEL_TOLERANCE` at the
    non-padded positions and ours was called. The model keeps its own implementation here."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return "the model has no transformers config (no attention interface to set)"
    register()
    inputs = probe_inputs if probe_inputs is not None else _default_probe_inputs(model)
    if inputs is None:
        return "no probe input (the model has no input embeddings): pass probe_inputs= to verify it"
    original = getattr(cfg, "_attn_implementation", None) or "eager"
    w = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = w.dtype if w is not None else torch.float32
    was_training = model.training
    model.eval()
    try:
        with patch_probes.narrowed_index_topk(model):
            return _compare_attention(model, inputs, original, dtype)
    finally:
        model.train(was_training)


def _compare_attention(model, inputs, original, dtype) -> Optional[str]:
    """:func:`_verify_attention`'s comparison (the model in eval mode; a DSA indexer's ``index_topk`` narrowed
    to :data:`patch_probes.PROBE_TOPK`, so the probe compares the sparse selection)."""
    try:
        want = _run(model, inputs)
    except Exception as e:  # noqa: BLE001 - the probe input does not fit this model
        return f"the stock model fails on the probe input ({type(e).__name__}: {e}); pass probe_inputs="
    global _attention_calls
    _attention_calls = []
    _set_attn(model, NAME)
    try:
        got = _run(model, inputs)
    except Exception as e:  # noqa: BLE001
        return f"the model fails with it ({type(e).__name__}: {e})"
    finally:
        calls, _attention_calls = len(_attention_calls), None
        _set_attn(model, original)
    if calls == 0:
        return "the model never calls transformers' attention interface"
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and isinstance(want, torch.Tensor) \
            and want.shape[:2] == mask.shape and isinstance(got, torch.Tensor) and got.shape == want.shape:
        keep = mask.bool()
        want, got = want[keep], got[keep]  # padded positions are undefined in both
    err = patch_probes.relative_error(got, want)
    tol = patch_probes.MODEL_TOLERANCE.get(dtype, 8e-2)
    if not err <= tol:
        return (f"the model's output with it differs from {original!r} by {err:.3g} (relative; "
                f"tolerance {tol:g} for {dtype})")
    return None


# ------------------------------------------------------------------------------------------ RoPE
_rope_active: dict = {}  # modeling module name -> depth of patched-model forwards now running


class RopeDispatch:
    """A modeling module's ``apply_rotary_pos_emb`` after ``apply_tpukernels(rope=True)``: ours while the
    forward of a model patched with ``rope=True`` runs, the original otherwise (another model of the same
    family in the process keeps HF's function). ``original``: the function it replaced."""

    def __init__(self, module_name: str, original):
        self.module_name, self.original = module_name, original
        self.__wrapped__ = original

    def __call__(self, *args, **kwargs):
        if _rope_active.get(self.module_name, 0) > 0:
            from ..library.rope import apply_rotary_pos_emb

            return apply_rotary_pos_emb(*args, **kwargs)
        return self.original(*args, **kwargs)


def _rope_probe_args():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    ang = torch.randn(2, 5, 8, generator=g)
    ang = torch.cat([ang, ang], -1)
    return q, k, ang.cos(), ang.sin()


def _plan_rope(model: torch.nn.Module, stock: dict) -> list[str]:
    """Names of the modeling modules of ``model`` whose ``apply_rotary_pos_emb`` ours equals (probed)."""
    import inspect
    import sys

    from ..library.rope import apply_rotary_pos_emb

    names = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        mod = sys.modules.get(name)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None:
            continue
        original = fn.original if isinstance(fn, RopeDispatch) else fn
        try:
            params = list(inspect.signature(original).parameters)
        except (TypeError, ValueError):
            params = []
        if params[:4] != ["q", "k", "cos", "sin"] or "unsqueeze_dim" not in params:
            stock[f"{name}.apply_rotary_pos_emb"] = f"not the llama signature (q, k, cos, sin, unsqueeze_dim): {params}"
            continue
        why = patch_probes.verify_function(original, apply_rotary_pos_emb, _rope_probe_args, ("rope", original))
        if why:
            stock[f"{name}.apply_rotary_pos_emb"] = why
            continue
        names.append(name)
    return names


def _rope_enter(mod, args):
    for n in mod._tpukernels_rope:
        _rope_active[n] = _rope_active.get(n, 0) + 1


def _rope_leave(mod, args, output):
    for n in mod._tpukernels_rope:
        _rope_active[n] = _rope_active.get(n, 1) - 1


def _apply_rope(model: torch.nn.Module, names: list[str]) -> int:
    import sys

    for name in names:
        mod = sys.modules[name]
        if not isinstance(mod.apply_rotary_pos_emb, RopeDispatch):
            mod.apply_rotary_pos_emb = RopeDispatch(name, mod.apply_rotary_pos_emb)
    new = [n for n in names if n not in getattr(model, "_tpukernels_rope", ())]
    if new:
        if not hasattr(model, "_tpukernels_rope"):
            model._tpukernels_rope = []
            model.register_forward_pre_hook(_rope_enter)  # module-level hooks: the model stays picklable
            model.register_forward_hook(_rope_leave, always_call=True)
        model._tpukernels_rope.extend(new)
    return len(names)


# ------------------------------------------------------------------------------------------ gated MLP
def _gated_activation_of(act_fn) -> Optional[str]:
    """Which :data:`tpukernels.library.gated_mlp.ACTIVATIONS` ``act_fn`` computes (float64 probe), or None."""
    t = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = act_fn(t)
    except Exception:  # an activation that cannot run on a float64 cpu tensor: not one we know
        return None
    fns = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
           "gelu": torch.nn.functional.gelu}
    for name, f in fns.items():
        if isinstance(got, torch.Tensor) and got.shape == t.shape and torch.allclose(got, f(t), rtol=1e-12, atol=1e-12):
            return name
    return None


def _plan_gated_mlp(model: torch.nn.Module, stock: dict) -> list:
    """``(parent, name, TPUGatedMLP)`` for each ``down(act(gate(x)) * up(x))`` MLP module whose class the
    probe accepts (same linear children, so state dicts are unchanged)."""
    from ..library.gated_mlp import TPUGatedMLP

    plan = []
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not type(child).__name__.endswith("MLP") or isinstance(child, TPUGatedMLP):
                continue
            parts = [getattr(child, a, None) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")]
            if any(p is None for p in parts) or not isinstance(parts[0], torch.nn.Linear):
                continue
            act = _gated_activation_of(parts[3])
            if act is None:
                continue

            def build(m, act=act):
                return TPUGatedMLP(m.gate_proj, m.up_proj, m.down_proj, activation=act)

            why = patch_probes.verify_replacement(child, build, f"gated_mlp:{act}", randomize=False,
                                                  hidden=parts[0].in_features)
            if why:
                stock.setdefault(type(child).__name__, why)
                continue
            plan.append((parent, child_name, build(child)))
    return plan


def apply_tpukernels_to_llama(model, **kw) -> dict:
    """Llama / Llama-2/3: attention + RMSNorm (Llama casting). Also fits Mistral, Qwen2, Qwen3."""
    return apply_tpukernels(model, **kw)


apply_tpukernels_to_mistral = apply_tpukernels_to_llama
apply_tpukernels_to_qwen2 = apply_tpukernels_to_llama
apply_tpukernels_to_qwen3 = apply_tpukernels_to_llama


def apply_tpukernels_to_gemma(model, **kw) -> dict:
    """Gemma: attention (soft-cap, sliding window when configured) + RMSNorm with ``(1 + w)`` in f32."""
    return apply_tpukernels(model, **kw)


def apply_tpukernels_to_bert(model, **kw) -> dict:
    """BERT-family encoders: bidirectional attention with padding masks + LayerNorm."""
    kw.setdefault("rms_norm", False)
    return apply_tpukernels(model, **kw)
