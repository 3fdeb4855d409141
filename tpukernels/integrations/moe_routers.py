"""HF MoE routers through the fused router kernels of :mod:`tpukernels.library.moe_routing`.

transformers' MoE blocks call a router module (``self.gate`` / ``self.router``) that returns ``(router_logits,
weights, expert_ids)``; :func:`apply_tpukernels_routers` replaces the forward of every router whose computation
one of the library's forms reproduces, checked numerically on the module's own weights::

    softmax then top-k, renormalised                 Mixtral MixtralTopKRouter (and routers written like it)
    softmax then top-k, norm_topk_prob               Qwen2/3-MoE Qwen3MoeTopKRouter (weights in the logits' dtype)
    top-k then softmax over the selected             gpt-oss GptOssTopKRouter (weights in the logits' dtype)
    DeepSeek-V3 grouped top-k with the bias          DeepseekV3TopkRouter (float32 logits)

A module is a candidate when it has a 2-D ``weight [E, H]``, an int ``top_k`` and ``num_experts``; the candidate
forms (grouped only where it has ``e_score_correction_bias``, ``num_group`` / ``n_group`` and ``topk_group``) are
probed in order against the class's own forward (:func:`router_reason`): same logits, same expert ids (as sets
for DeepSeek, whose ``topk(sorted=False)`` order is unspecified), weights within ``PROBE_RTOL``. The first form
that matches replaces the instance's ``forward``; a router no form matches stays stock, with its reason.
gpt-oss's softmax over the selected equals the renormalised softmax over all experts in exact arithmetic, so a
float32 gpt-oss router takes the first form (its bfloat16 weights, rounded to the logits' dtype, the second).
Opt-in: :func:`~tpukernels.integrations.moe.apply_tpukernels_moe` does not call it.

Training: the router kernels have no backward. While the logits need a gradient, the patched forward recomputes
the weights of the kernel's chosen ids with differentiable float32 torch ops (HF's formula of the matched form),
so the router weight gets stock's gradient; the kernel still chooses the experts (ids carry no gradient).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

#: probe tolerance on the weights, relative to their largest magnitude (float32: exp / sums in another order;
#: bfloat16 routers round the weights to bf16)
PROBE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: the forms tried, in order (module docstring)
FORMS = ("softmax_renorm", "softmax", "softmax_selected", "grouped")


def _is_candidate(m) -> bool:
    w = getattr(m, "weight", None)
    return (isinstance(w, torch.nn.Parameter) and w.dim() == 2 and isinstance(getattr(m, "top_k", None), int)
            and getattr(m, "num_experts", None) == w.shape[0] and not isinstance(m, torch.nn.Linear))


def _groups(m):
    ng = getattr(m, "num_group", getattr(m, "n_group", None))
    return ng, getattr(m, "topk_group", None)


def _with_grad(self, form: str, logits: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The router kernels have no backward: while the logits need a gradient (training), the same weights are
    recomputed from the kernel's ``ids`` with differentiable torch ops in float32 (HF's formulas); the kernel
    still chooses the experts. Otherwise ``w`` as it is."""
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return w
    lg = logits.float()
    if form == "grouped":  # DeepSeek-V3: sigmoid scores of the chosen experts (unbiased), normalised, scaled
        s = torch.sigmoid(lg).gather(1, ids)
        if bool(self.norm_topk_prob):
            s = s / (s.sum(-1, keepdim=True) + 1e-20)
        return (s * float(self.routed_scaling_factor)).to(w.dtype)
    if form == "softmax_selected":  # gpt-oss: softmax over the k selected logits
        return torch.softmax(lg.gather(1, ids), -1).to(w.dtype)
    s = torch.softmax(lg, -1).gather(1, ids)
    return (s / s.sum(-1, keepdim=True) if form == "softmax_renorm" else s).to(w.dtype)


def router_forward(self, hidden_states: torch.Tensor):
    """``(router_logits, weights, expert_ids)`` of the form in ``self.tpukernels_router_form`` (module docstring)."""
    from ..library.moe_routing import grouped_topk, softmax_topk

    form = self.tpukernels_router_form
    h = hidden_states.reshape(-1, self.weight.shape[1])
    if form == "grouped":
        logits = F.linear(h.float(), self.weight.float())
        ng, tg = _groups(self)
        w, ids = grouped_topk(logits, self.top_k, n_group=ng, topk_group=tg,
                              e_score_correction_bias=self.e_score_correction_bias,
                              routed_scaling_factor=float(self.routed_scaling_factor),
                              norm_topk_prob=bool(self.norm_topk_prob))
        return logits, _with_grad(self, form, logits, ids, w), ids
    logits = F.linear(h, self.weight, getattr(self, "bias", None))
    if form == "softmax_selected":
        w, ids = softmax_topk(logits, self.top_k, softmax_over="selected")
        w = _with_grad(self, form, logits, ids, w)
        return logits, w.to(logits.dtype), ids
    renorm = form == "softmax_renorm"
    w, ids = softmax_topk(logits, self.top_k, renormalize=renorm)
    w = _with_grad(self, form, logits, ids, w)
    # Mixtral's router returns float32 weights; Qwen-MoE's (norm_topk_prob) casts them to the logits' dtype
    return logits, (w if renorm and not hasattr(self, "norm_topk_prob") else w.to(logits.dtype)), ids


def _forms(m):
    out = []
    if hasattr(m, "norm_topk_prob") and not hasattr(m, "e_score_correction_bias"):
        out.append("softmax_renorm" if m.norm_topk_prob else "softmax")
    elif not hasattr(m, "e_score_correction_bias"):
        out += ["softmax_renorm", "softmax_selected"]
    ng, tg = _groups(m)
    if hasattr(m, "e_score_correction_bias") and isinstance(ng, int) and isinstance(tg, int):
        out.append("grouped")
    return out


def router_reason(m, seed: int = 0):
    """``(form, None)`` for the first form that reproduces router ``m``'s stock forward on a probe, else ``(None,
    reason)``. Changes nothing in ``m`` (no_grad; the form is tried on a shallow copy)."""
    import copy

    if not _is_candidate(m):
        return None, "not a router (weight [E, H], top_k, num_experts)"
    w = m.weight
    if w.device.type == "meta":
        return None, "weights on the meta device"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, w.shape[1], generator=g).to(w.dtype).to(w.device)
    with torch.no_grad():
        want = type(m).forward(m, x)
        if not (isinstance(want, tuple) and len(want) == 3):
            return None, "its forward does not return (router_logits, weights, expert_ids)"
        tried = []
        for form in _forms(m):
            ours = copy.copy(m)
            ours.tpukernels_router_form = form
            try:
                got = router_forward(ours, x)
            except Exception as e:  # noqa: BLE001  (a form that cannot run is a form that does not match)
                tried.append(f"{form}: {type(e).__name__}")
                continue
            if _same(got, want, form):
                return form, None
            tried.append(f"{form}: mismatch")
    return None, "no fused router form matches its forward (" + ("; ".join(tried) or "no candidate form") + ")"


def _same(got, want, form) -> bool:
    gl, gw, gi = got
    wl, ww, wi = want
    if gl.shape != wl.shape or not torch.equal(gl, wl) or gi.shape != wi.shape or gw.dtype != ww.dtype:
        return False
    if form == "grouped":  # unsorted topk there: compare sorted by expert id
        gi, go = gi.sort(-1)
        wi, wo = wi.sort(-1)
        gw, ww = gw.gather(1, go), ww.gather(1, wo)
    if not torch.equal(gi, wi.long()):
        return False
    tol = PROBE_RTOL.get(ww.dtype, 2e-2) * float(ww.double().abs().max())
    return float((gw.double() - ww.double()).abs().max()) <= tol


def apply_tpukernels_routers(model: torch.nn.Module) -> list[tuple[str, str]]:
    """Replace the forward of every router of ``model`` that a fused form reproduces (module docstring), in
    place. Returns ``[(module name, form)]`` of the routers replaced (routers no form matches stay stock)."""
    done = []
    for name, m in model.named_modules():
        if not _is_candidate(m) or getattr(m, "tpukernels_router_form", None):
            continue
        form, _ = router_reason(m)
        if form is not None:
            m.tpukernels_router_form = form
            m.forward = types.MethodType(router_forward, m)
            done.append((name, form))
    return done


__all__ = ["apply_tpukernels_routers", "router_forward", "router_reason", "FORMS", "PROBE_RTOL"]
