"""Linear-attention and SSM mixers of transformers' hybrid models on tpukernels kernels (``apply_tpukernels``).

transformers 5.x writes each hybrid mixer (Qwen3-Next / Qwen3.5 ``*GatedDeltaNet``, Kimi-Linear
``KimiLinearDeltaAttention``, the Mamba2 mixers of Mamba2 / Nemotron-H / Falcon-H1 / Bamba / Granite-4 / Zamba2,
LFM2's short conv) as projections and reshapes around **module-level functions** of its modeling module:
``causal_conv1d_fn`` / ``causal_conv1d_update``, ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` (GDN), ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``
(KDA), ``mamba2_chunk_scan`` / ``mamba2_selective_state_update`` (SSD), each decorated with
``use_kernel_func_from_hub_with_fallback`` (hub kernel, else fla / causal-conv1d / mamba_ssm, else the torch
reference), plus a gated RMSNorm submodule (replaced by ``apply_tpukernels``' gated-norm path).

Extension point. The forward looks these functions up as globals at call time, so the global is the one place
that sees every call. :class:`MixerDispatch` replaces it in the modeling module and runs ours **only while the
forward of a mixer instance we patched runs** (a forward pre-hook / hook pair on each patched instance, so another
model of the same family in the process, or an instance whose class failed its probe, keeps transformers'
function). Everything else stays transformers' own code: the projections, the padding mask, and the cache
protocol (``get_conv_state`` / ``update_conv_state`` / ``update_recurrent_state``, ``has_previous_state``,
``record_past``), which we would otherwise have to copy and keep in step with every transformers release.
Not chosen: transformers' ``use_kernelized_func`` / ``kernelize`` hooks need the optional ``kernels`` package (the
decorator is a no-op without it, as here) and load kernels from Hub repositories per device type (CUDA / ROCm /
...); a replacement forward per class would duplicate the cache protocol above.

Each adapter below takes the arguments transformers passes (its torch function's signature) and calls the
tpukernels op: conv ``tpukernels.library.causal_conv1d``; GDN ``linear_attention.chunk_gated_delta_rule`` /
``fused_recurrent_gated_delta_rule``; KDA ``chunk_kda`` / ``fused_recurrent_kda``; SSD
``mamba_chunk_scan_combined`` / ``selective_state_update``. A keyword transformers passes that may change the result
and that we do not implement (packed sequences: ``cu_seqlens`` / ``seq_idx`` / ``cu_seq_lens_*``) raises
:class:`tpukernels.errors.ArgumentError` naming it (transformers' own torch fallback refuses packed sequences too).

Probe (:func:`probe_mixer`): a mixer class is patched only where the mixer itself, on its **own weights**, gives
the same outputs and the same cache states with our functions as with transformers' on a left-padded prefill
(with a fresh ``DynamicCache``), two single-token decode steps (conv state + recurrent state), a 3-token
continuation from the cache and a cache-less forward, and our functions were called where transformers' were.
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable, Optional

import torch

from ..errors import ArgumentError
from . import patch_probes

#: keywords transformers passes along to these functions that do not change their result (bookkeeping, output
#: flags) or that the torch reference itself ignores (``z=None``)
_HARMLESS = frozenset({
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "position_ids", "cache_position",
    "position_embeddings", "layer_idx", "logits_to_keep", "output_router_logits", "past_key_values", "cache",
})


def _refuse(op: str, kwargs: dict, allowed: tuple = ()) -> None:
    bad = sorted(k for k, v in kwargs.items() if v is not None and k not in _HARMLESS and k not in allowed)
    if bad:
        raise ArgumentError(f"tpukernels {op} (transformers integration): got {bad}, which this integration does not "
                            f"implement (packed sequences: cu_seqlens / seq_idx / cu_seq_lens_*); keep the mixer "
                            f"stock (apply_tpukernels(linear_attention=False))")


# ------------------------------------------------------------------------------------------ adapters
def conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' ``causal_conv1d_fn(hidden_states [B, D, L], weight [D, W], bias, activation)`` (zero left
    padding; the cache's previous inputs are concatenated in front by ``cache.update_conv_state``)."""
    from ..library.causal_conv1d import causal_conv1d_fn

    _refuse("causal_conv1d_fn", kwargs)
    return causal_conv1d_fn(hidden_states, weight, bias, activation=activation)


def conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
    """transformers' ``causal_conv1d_update(hidden_states [B, D, T], conv_state [B, D, S], ...)``: the cache's
    conv state is updated in place, as transformers' reference does."""
    from ..library.causal_conv1d import causal_conv1d_update

    _refuse("causal_conv1d_update", kwargs)
    return causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)


def _state(s):
    return None if s is None else s.float()


def gdn_chunk(query, key, value, g, beta, chunk_size=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' ``torch_chunk_gated_delta_rule`` (fla's ``chunk_gated_delta_rule``): ``[B, T, H, K]`` q / k,
    ``[B, T, HV, V]`` v, ``[B, T, HV]`` g / beta, float32 states ``[B, HV, K, V]``. The chunk is a schedule, not
    semantics: a ``chunk_size`` the kernel takes is used, anything else (transformers passes none) gets the
    kernel's default (``gdn_ops.DEFAULT_CHUNK``)."""
    from ..library.linear_attention import chunk_gated_delta_rule
    from ..library.linear_attention.common import CHUNK_SIZES
    from ..library.linear_attention.gdn_ops import DEFAULT_CHUNK

    _refuse("chunk_gated_delta_rule", kwargs)
    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=_state(initial_state),
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  chunk_size=chunk_size if chunk_size in CHUNK_SIZES else DEFAULT_CHUNK)


def gdn_recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' ``torch_recurrent_gated_delta_rule`` (fla's ``fused_recurrent_gated_delta_rule``): decode."""
    from ..library.linear_attention import fused_recurrent_gated_delta_rule

    _refuse("fused_recurrent_gated_delta_rule", kwargs)
    return fused_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=_state(initial_state),
                                            output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def kda_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' ``chunk_kimi_delta_attention`` (fla's ``chunk_kda``): per-channel gate ``g [B, T, HV, K]``."""
    from ..library.linear_attention import chunk_kda
    from ..library.linear_attention.common import CHUNK_SIZES

    _refuse("chunk_kda", kwargs)
    return chunk_kda(query, key, value, g, beta, initial_state=_state(initial_state),
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     chunk_size=chunk_size if chunk_size in CHUNK_SIZES else 64)


def kda_recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' ``recurrent_kimi_delta_attention`` (fla's ``fused_recurrent_kda``): decode."""
    from ..library.linear_attention import fused_recurrent_kda

    _refuse("fused_recurrent_kda", kwargs)
    return fused_recurrent_kda(query, key, value, g, beta, initial_state=_state(initial_state),
                               output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def ssd_chunk(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
    """transformers' ``mamba2_chunk_scan`` (mamba_ssm's ``mamba_chunk_scan_combined``): x ``[B, L, H, P]``,
    dt ``[B, L, H]``, A ``[H]``, B / C ``[B, L, G, N]``; final states ``[B, H, P, N]`` float32."""
    from ..library.linear_attention import mamba_chunk_scan_combined

    _refuse("mamba_chunk_scan_combined", kwargs)
    return mamba_chunk_scan_combined(hidden_states, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                     initial_states=initial_states, dt_softplus=dt_softplus,
                                     dt_limit=tuple(dt_limit), return_final_states=return_final_states)


def ssd_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
    """transformers' ``mamba2_selective_state_update`` (mamba_ssm's ``selective_state_update``): one decode
    step, the cache's state updated in place."""
    from ..library.linear_attention import selective_state_update

    _refuse("selective_state_update", kwargs)
    return selective_state_update(state, hidden_states, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                  dt_softplus=dt_softplus)


#: modeling-module global -> our adapter (the name only says which adapter to try; the probe decides)
ADAPTERS: dict[str, Callable] = {
    "causal_conv1d_fn": conv1d_fn,
    "causal_conv1d_update": conv1d_update,
    "torch_chunk_gated_delta_rule": gdn_chunk,
    "torch_recurrent_gated_delta_rule": gdn_recurrent,
    "chunk_kimi_delta_attention": kda_chunk,
    "recurrent_kimi_delta_attention": kda_recurrent,
    "mamba2_chunk_scan": ssd_chunk,
    "mamba2_selective_state_update": ssd_update,
}


# ------------------------------------------------------------------------------------------ dispatch
_active: dict = {}  # modeling module name -> depth of patched (or probed) mixer forwards now running
_calls: Optional[list] = None  # the probe's record of (name, ours?) calls


class MixerDispatch:
    """A modeling module's global ``name`` after patching: our adapter (``ADAPTERS[name]``) while the forward of a
    patched mixer of that module runs, ``original`` (transformers' function) otherwise."""

    def __init__(self, module_name: str, name: str, original: Callable):
        self.module_name, self.name, self.original = module_name, name, original
        self.__wrapped__ = original

    def __call__(self, *args, **kwargs):
        mine = _active.get(self.module_name, 0) > 0
        if _calls is not None:
            _calls.append((self.name, mine))
        return (ADAPTERS[self.name] if mine else self.original)(*args, **kwargs)


def _enter(mod, args, kwargs=None):
    _active[mod._tpukernels_mixer] = _active.get(mod._tpukernels_mixer, 0) + 1


def _leave(mod, args, output):
    _active[mod._tpukernels_mixer] = _active.get(mod._tpukernels_mixer, 1) - 1


def mixer_functions(module: torch.nn.Module) -> list[str]:
    """The :data:`ADAPTERS` names ``module``'s forward calls as globals of its modeling module (empty: not a
    candidate). Read from the forward's code object (its global names), not from the class name."""
    fwd = inspect.unwrap(type(module).forward)
    code = getattr(fwd, "__code__", None)
    mod = sys.modules.get(type(module).__module__)
    if code is None or mod is None:
        return []
    return [n for n in code.co_names if n in ADAPTERS and callable(getattr(mod, n, None))]


def _install(module_name: str, names: list[str]) -> None:
    mod = sys.modules[module_name]
    for n in names:
        fn = getattr(mod, n)
        if not isinstance(fn, MixerDispatch):
            setattr(mod, n, MixerDispatch(module_name, n, fn))


class _Activate:
    def __init__(self, module_name: str, on: bool):
        self.name, self.on = module_name, on

    def __enter__(self):
        if self.on:
            _active[self.name] = _active.get(self.name, 0) + 1

    def __exit__(self, *exc):
        if self.on:
            _active[self.name] -= 1


def _probe_run(model, mixer, ours: bool, h: int, dtype, device) -> tuple[list, list]:
    """Outputs and cache states of ``mixer`` over prefill / 2 decode steps / a 3-token continuation / no cache."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    # the shapes of apply_tpukernels' default [2, 8] probe batch and of decode (kernels compiled once serve both)
    xs = [torch.randn(2, t, h, generator=g).to(dtype=dtype, device=device) for t in (8, 1, 1, 3)]
    mask = torch.ones(2, 8, dtype=torch.long, device=device)
    mask[0, :3] = 0  # left padding: the padded tokens must not reach the states
    cache = DynamicCache(config=model.config)
    global _calls
    _calls = []
    outs = []
    try:
        with torch.no_grad(), _Activate(type(mixer).__module__, ours):
            outs.append(mixer(xs[0], cache=cache, attention_mask=mask))
            for x in xs[1:]:
                outs.append(mixer(x, cache=cache, attention_mask=None))
            outs.append(mixer(xs[0], cache=None, attention_mask=mask))
        calls = _calls
    finally:
        _calls = None
    i = mixer.layer_idx
    states = [cache.get_conv_state(i), cache.get_recurrent_state(i)]
    outs[0] = outs[0][mask.bool()]  # padded positions are undefined in both
    outs[-1] = outs[-1][mask.bool()]
    return outs + states, calls


def probe_mixer(model: torch.nn.Module, mixer: torch.nn.Module) -> Optional[str]:
    """None where ``mixer`` computes the same with our functions as with transformers' (see the module docstring),
    else why not. Cached per (class, dtype)."""
    w = next((p for p in mixer.parameters() if p.is_floating_point()), None)
    dtype = w.dtype if w is not None and w.is_floating_point() else torch.float32
    key = (type(mixer), dtype, "linear_attention")
    if key in patch_probes.verdicts:
        return patch_probes.verdicts[key]
    why = _probe(model, mixer, dtype, w)
    patch_probes.verdicts[key] = why
    return why


#: mixer probe tolerance (relative to the largest output): float32 chunked recurrences in another summation order
#: over 13 tokens and a gated norm; 16-bit: one rounding of the output
LAYER_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 8e-3}


def _probe(model, mixer, dtype, w) -> Optional[str]:
    if w is None or w.device.type == "meta":
        return "its weights are on the meta device (nothing to probe)"
    if not isinstance(getattr(mixer, "layer_idx", None), int) or getattr(model, "config", None) is None:
        return "no layer_idx / model config to build a cache for the probe"
    h = getattr(mixer, "hidden_size", None) or getattr(model.config, "hidden_size", None)
    if not isinstance(h, int):
        return "no hidden_size to size the probe input"
    try:
        params = list(inspect.signature(mixer.forward).parameters)
    except (TypeError, ValueError):
        params = []
    if "cache" not in params or "attention_mask" not in params:
        return f"its forward does not take (hidden_states, cache, attention_mask): {params}"
    was_training = mixer.training
    mixer.eval()
    try:
        try:
            want, stock_calls = _probe_run(model, mixer, False, h, dtype, w.device)
        except Exception as e:  # noqa: BLE001 - the probe does not fit this mixer
            return f"its forward fails on the probe input ({type(e).__name__}: {e})"
        try:
            got, our_calls = _probe_run(model, mixer, True, h, dtype, w.device)
        except Exception as e:  # noqa: BLE001
            return f"it fails with our kernels ({type(e).__name__}: {e})"
    finally:
        mixer.train(was_training)
    if not our_calls or not all(mine for _, mine in our_calls) or [n for n, _ in our_calls] != [
            n for n, _ in stock_calls]:
        return f"our functions were not called where transformers' were ({stock_calls} vs {our_calls})"
    tol = LAYER_TOLERANCE.get(dtype, 3e-2)
    what = ["prefill", "decode 1", "decode 2", "continuation", "no-cache forward", "conv state", "recurrent state"]
    for name, a, b in zip(what, got, want):
        if a is None and b is None:  # a mixer without that state (LFM2's short conv: no recurrent state)
            continue
        err = patch_probes.relative_error(a, b)
        if not err <= tol:
            return f"its {name} differs with our kernels by {err:.3g} (relative; tolerance {tol:g} for {dtype})"
    return None


def plan_mixers(model: torch.nn.Module, stock: dict) -> list:
    """``(mixer, names)`` for every mixer module of ``model`` whose class the probe accepts; the classes that fail
    go to ``stock`` (class name -> why). The probe needs the dispatch in place, so planning (``dry_run`` too)
    installs :class:`MixerDispatch` in the modeling module; until a mixer is patched it runs transformers'
    function, so nothing computes differently."""
    plan = []
    for m in model.modules():
        names = mixer_functions(m)
        if not names:
            continue
        if getattr(m, "_tpukernels_mixer", None) is not None:  # patched by an earlier call
            plan.append((m, names))
            continue
        _install(type(m).__module__, names)
        why = probe_mixer(model, m)
        if why:
            stock.setdefault(type(m).__name__, why)
            continue
        plan.append((m, names))
    return plan


def apply_mixers(plan: list) -> int:
    """Route each planned mixer instance's functions to ours (idempotent); returns how many mixers."""
    for m, names in plan:
        _install(type(m).__module__, names)
        if getattr(m, "_tpukernels_mixer", None) is None:
            m._tpukernels_mixer = type(m).__module__
            m.register_forward_pre_hook(_enter)  # module-level hooks: the model stays picklable
            m.register_forward_hook(_leave, always_call=True)
    return len(plan)
