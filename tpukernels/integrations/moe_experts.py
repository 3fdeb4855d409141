"""The experts-module layer under :mod:`tpukernels.integrations.moe` (its docstring: semantics, layout): which HF
modules are experts, the ``"tpukernels"`` experts forward and its registration, and the quantized experts' buffer
layout with the swap of float parameters for it (used by ``quantize_moe_experts`` and, on ``from_pretrained``, by
:mod:`tpukernels.integrations.quantizers`, which therefore does not import :mod:`~tpukernels.integrations.moe`)."""

from __future__ import annotations

import torch

from ..errors import ArgumentError

IMPLEMENTATION = "tpukernels"

#: dtypes ``grouped_matmul`` takes for float expert weights (and biases)
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)

#: probe tolerance per compute dtype: ``max |ours - stock| <= PROBE_RTOL[dtype] * max |stock|`` (float32: a
#: different f32 summation order, ~K * 2^-24 relative per dot at the probe's sizes; bfloat16: both sides round
#: the gate/up activations and the output to bf16 (2^-8), a few such roundings apart)
PROBE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}

#: verdicts of :func:`verify_experts`, one per experts class and weight format (``None``: matches)
probe_verdicts: dict = {}


def _quantized(module) -> bool:
    return getattr(module, "gate_up_proj_q", None) is not None


def is_quantized(module) -> bool:
    """Whether ``module`` holds experts quantized by ``quantize_moe_experts`` (``gate_up_proj_q`` buffers)."""
    return _quantized(module)


def _is_experts(module) -> bool:
    """An HF experts module: 3-D ``gate_up_proj`` (a parameter, or quantized buffers) and a config."""
    w = getattr(module, "gate_up_proj_q", None) if _quantized(module) else getattr(module, "gate_up_proj", None)
    ok = isinstance(w, torch.nn.Parameter) or (_quantized(module) and isinstance(w, torch.Tensor))
    return ok and w.dim() == 3 and hasattr(module, "config")


def is_experts_candidate(module) -> bool:
    """Any module holding stacked expert weights: a 3-D ``gate_up_proj`` parameter (or quantized
    ``gate_up_proj_q`` buffer), or 3-D ``up_proj`` and ``down_proj`` parameters (ungated experts), whatever its
    forward; :func:`route_reason` says whether the ``"tpukernels"`` forward can take it."""
    if _quantized(module):
        return module.gate_up_proj_q.dim() == 3
    w = getattr(module, "gate_up_proj", None)
    if isinstance(w, torch.nn.Parameter) and w.dim() == 3:
        return True
    up, down = getattr(module, "up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(up, torch.nn.Parameter) and up.dim() == 3 and isinstance(down, torch.nn.Parameter)
            and down.dim() == 3)


def stock_forward(module):
    """The class's own (eager) forward under transformers' ``use_experts_implementation`` dispatch (the function
    that decorator wraps), or None for a class that decorator did not wrap."""
    return getattr(type(module).forward, "__wrapped__", None)


def _shapes(x) -> str:
    return "x".join(str(d) for d in x.shape)


def _unsupported(module) -> str | None:
    """Why the ``"tpukernels"`` forward cannot take ``module`` (one line), from its structure alone; None when
    it can (biased, transposed and interleaved experts included: the gate is the class's own ``_apply_gate``)."""
    if stock_forward(module) is None or not hasattr(module, "config"):
        if getattr(module, "zero_expert_num", 0):
            return ("zero-compute (identity) experts and a forward transformers does not dispatch by "
                    "config._experts_implementation")
        return ("a forward transformers does not dispatch by config._experts_implementation (no "
                "use_experts_implementation; another call convention)")
    if not getattr(module, "has_gate", True) or getattr(module, "gate_up_proj", None) is None and not _quantized(
            module):
        return "ungated experts (up_proj, no gate_up_proj)"
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallelism"
    if getattr(module, "has_post_expert_norm", False):
        return "a post-expert norm"
    if _quantized(module):
        return None
    gu, dn = module.gate_up_proj, getattr(module, "down_proj", None)
    if not isinstance(dn, torch.Tensor) or dn.dim() != 3:
        return "no 3-D down_proj parameter"
    E = getattr(module, "num_experts", gu.shape[0])
    tr = getattr(module, "is_transposed", False)
    H, N1 = (gu.shape[1], gu.shape[2]) if tr else (gu.shape[2], gu.shape[1])
    I, H2 = (dn.shape[1], dn.shape[2]) if tr else (dn.shape[2], dn.shape[1])
    if gu.shape[0] != E or dn.shape[0] != E or H2 != H or N1 != 2 * I:
        return (f"expert weights of shapes gate_up_proj {_shapes(gu)}, down_proj {_shapes(dn)} "
                f"(num_experts {E}, is_transposed={tr}) that are not one gated FFN per expert")
    tensors = [("gate_up_proj", gu, None), ("down_proj", dn, None)]
    if getattr(module, "has_bias", False):
        tensors += [("gate_up_proj_bias", getattr(module, "gate_up_proj_bias", None), (E, N1)),
                    ("down_proj_bias", getattr(module, "down_proj_bias", None), (E, H))]
    for name, t, shape in tensors:
        if not isinstance(t, torch.Tensor) or (shape is not None and tuple(t.shape) != shape):
            return f"{name} of shape {None if t is None else tuple(t.shape)}, expected {shape}"
        if t.dtype not in WEIGHT_DTYPES:
            return f"{name} of dtype {t.dtype} (grouped_matmul takes bfloat16 / float32)"
    return None


def quantize_unsupported(module) -> str | None:
    """Why ``quantize_moe_experts`` cannot take ``module``: :func:`_unsupported`, or a layout its buffers do not
    describe (``[E, N, K]`` ``nn.Linear`` layout, no biases)."""
    why = _unsupported(module)
    if why:
        return why
    if getattr(module, "has_bias", False):
        return "expert biases"
    if getattr(module, "is_transposed", False):
        return "transposed expert weights"
    return None


_GPT_OSS_GATE = ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts._apply_gate")


def fused_gate(module):
    """``(act_fn, gate_up_interleaved, alpha, limit)`` of :func:`~tpukernels.library.fused_moe` that is
    ``module``'s gate, or None (then the ``"tpukernels"`` forward applies the class's own gate between two grouped
    matmuls). Decided from what the gate *is*, never guessed from its name: transformers' default gate
    (``act_fn(gate) * up`` on the two halves) with ``act_fn`` an ``nn.SiLU`` / ``SiLUActivation`` (``"silu"``) or a
    ``GELUTanh`` on torch's tanh GELU (``"gelu"``); gpt-oss's own ``_apply_gate`` (``"swigluoai"`` on interleaved
    columns with the module's ``alpha`` / ``limit``). Anything else (e.g. a class with another ``_apply_gate``) is
    None. :func:`verify_experts` then proves the whole forward against the stock one on the module's weights."""
    gate = getattr(type(module), "_apply_gate", None)
    where = (getattr(gate, "__module__", None), getattr(gate, "__qualname__", None))
    if where == _GPT_OSS_GATE:
        alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
        if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)):
            return "swigluoai", True, float(alpha), float(limit)
        return None
    if gate is not None and where != ("transformers.integrations.moe", "_default_apply_gate"):
        return None
    act = getattr(module, "act_fn", None)
    name = (type(act).__module__, type(act).__qualname__)
    if name in (("torch.nn.modules.activation", "SiLU"), ("transformers.activations", "SiLUActivation")):
        return "silu", False, 1.702, 7.0
    if name == ("transformers.activations", "GELUTanh") and getattr(getattr(act, "act", None), "keywords",
                                                                    {}).get("approximate") == "tanh":
        return "gelu", False, 1.702, 7.0
    return None


def tpukernels_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF experts forward (``hidden_states [T, H]``, ``top_k_index [T, k]``, ``top_k_weights [T, k]``) ->
    ``[T, H]`` through two grouped matmuls (module docstring). A module ``apply_tpukernels_moe`` left stock (it
    carries ``tpukernels_stock``, the implementation its config named before) runs that stock forward, since
    the config that routes here can be shared with modules that were replaced."""
    from ..library.grouped_matmul_ops import grouped_matmul
    from ..library.grouped_matmul_ops.quant import grouped_matmul_quantized
    from ..library.moe_routing import moe_combine, moe_permute

    stock = getattr(self, "tpukernels_stock", None)
    if stock is not None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        fwd = ALL_EXPERTS_FUNCTIONS.get_interface(stock, stock_forward(self)) if stock != "eager" else None
        return (fwd or stock_forward(self))(self, hidden_states, top_k_index, top_k_weights)
    why = _unsupported(self)
    if why:
        raise ArgumentError(f"tpukernels experts: {type(self).__name__} has {why}, which is not supported")
    gate = fused_gate(self)
    if gate is not None and not _quantized(self) and hidden_states.dtype in WEIGHT_DTYPES:
        # the whole layer through fused_moe, on HF's weights as stored: [E, 2I, H] / [E, H, I] (nn.Linear layout,
        # transpose_rhs) or, is_transposed, [E, H, 2I] / [E, I, H]; gpt-oss's interleaved gate / up columns
        from ..library.fused_moe_ops import fused_moe

        act, interleaved, alpha, limit = gate
        bias = getattr(self, "has_bias", False)
        return fused_moe(hidden_states, self.gate_up_proj, self.down_proj, topk_weights=top_k_weights,
                         topk_ids=top_k_index, act_fn=act, swigluoai_alpha=alpha, swigluoai_limit=limit,
                         b1=self.gate_up_proj_bias.unsqueeze(1) if bias else None,
                         b2=self.down_proj_bias.unsqueeze(1) if bias else None,
                         transpose_rhs=not getattr(self, "is_transposed", False), gate_up_interleaved=interleaved)
    # token copies sorted into expert order (stable: token order within an expert), int32 group sizes of a fixed
    # length (no data-dependent shape: no graph break under torch.compile); moe_combine brings them back
    x, sizes, meta = moe_permute(hidden_states, top_k_index, self.num_experts)
    if _quantized(self):
        cdt = hidden_states.dtype if hidden_states.dtype in (torch.bfloat16, torch.float32) else torch.float32
        x = x.to(cdt)

        def mm(a, name):
            return grouped_matmul_quantized(
                a.to(cdt), getattr(self, f"{name}_q"), sizes, getattr(self, f"{name}_scale"),
                rhs_zero_point=getattr(self, f"{name}_zero_point", None), transpose_rhs=True,
                weight_format=getattr(self, "tpukernels_weight_format", None))
    else:
        # HF layout: [E, N, K] (nn.Linear, grouped_matmul's transpose_rhs) or, is_transposed, [E, K, N]
        transpose_rhs = not getattr(self, "is_transposed", False)
        has_bias = getattr(self, "has_bias", False)

        def mm(a, name):
            w = getattr(self, name)
            b = getattr(self, f"{name}_bias") if has_bias else None
            return grouped_matmul(a.to(w.dtype), w, sizes, transpose_rhs=transpose_rhs,
                                  rhs_bias=None if b is None else b.to(w.dtype).unsqueeze(1))
    gate_up = mm(x, "gate_up_proj")
    # the class's own gate (gpt-oss: interleaved columns, clamped SwiGLU with alpha and limit; default: act * up)
    h = self._apply_gate(gate_up) if hasattr(self, "_apply_gate") else (
        self.act_fn(gate_up.chunk(2, dim=-1)[0]) * gate_up.chunk(2, dim=-1)[1])
    y = mm(h, "down_proj")
    # out[t] = sum_j w[t, j] * y[row of (t, j)], float32 sums rounded once (stock: y * w in y's dtype, index_add_)
    return moe_combine(y, top_k_weights, meta).to(hidden_states.dtype)


def _probe_key(module):
    if _quantized(module):
        z = getattr(module, "gate_up_proj_zero_point", None)
        return (type(module), "quantized", module.gate_up_proj_q.dtype, module.gate_up_proj_scale.shape[1] > 1,
                z is not None, getattr(module, "tpukernels_weight_format", None))
    return (type(module), module.gate_up_proj.dtype)


def probe_routing(num_experts: int, hidden: int, dtype, device, seed: int = 0):
    """A probe for one experts module: ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``,
    ``k = min(2, E)`` distinct experts per token, every expert hit when ``T * k >= E`` (``T = clamp(E / k, 4,
    64)``), weights a softmax of normal draws; deterministic (``seed``)."""
    g = torch.Generator().manual_seed(seed)
    k = min(2, num_experts)
    T = min(64, max(4, -(-num_experts // k)))
    slots = torch.arange(T * k).reshape(T, k) % num_experts  # consecutive slots: distinct experts per token
    ids = torch.randperm(num_experts, generator=g)[slots]
    w = torch.softmax(torch.randn(T, k, generator=g, dtype=torch.float64), -1)
    x = torch.randn(T, hidden, generator=g, dtype=torch.float64)
    return x.to(dtype).to(device), ids.to(device), w.to(dtype).to(device)


def _dequantized_copy(module):
    """A shallow copy of a quantized experts module whose ``gate_up_proj`` / ``down_proj`` are the float64
    dequantized weights (the buffers unchanged), for the stock forward to run on."""
    import copy

    from ..library.grouped_matmul_ops.quant import dequantize_experts

    ref = copy.copy(module)
    ref._parameters = dict(module._parameters)
    for proj in ("gate_up_proj", "down_proj"):
        ref._parameters[proj] = torch.nn.Parameter(dequantize_experts(
            getattr(module, f"{proj}_q"), getattr(module, f"{proj}_scale"), getattr(module, f"{proj}_zero_point"),
            transpose_rhs=True, weight_format=getattr(module, "tpukernels_weight_format", None)), requires_grad=False)
    ref.__dict__.pop("tpukernels_stock", None)
    return ref


def verify_experts(module) -> str | None:
    """Check numerically, on ``module``'s own weights, that :func:`tpukernels_experts_forward` computes what the
    class's stock (eager) forward computes: a :func:`probe_routing` probe in the weights' dtype (quantized
    experts: float32 activations against the stock forward in float64 on the dequantized weights), pass when
    ``max |ours - stock| <= PROBE_RTOL[dtype] * max |stock|``. One verdict per class and weight format
    (:data:`probe_verdicts`, the first module seen decides). Returns None (match) or a one-line reason (the
    mismatch, or what our forward raised). Changes nothing in the module (no_grad, no mutation)."""
    key = _probe_key(module)
    if key in probe_verdicts:
        return probe_verdicts[key]
    quant = _quantized(module)
    w = module.gate_up_proj_q if quant else module.gate_up_proj
    dtype = torch.float32 if quant else w.dtype
    H = module.down_proj_q.shape[1] if quant else (
        module.down_proj.shape[2] if getattr(module, "is_transposed", False) else module.down_proj.shape[1])
    x, ids, wts = probe_routing(module.num_experts, H, dtype, w.device)
    with torch.no_grad():
        if quant:
            want = stock_forward(module)(_dequantized_copy(module), x.double(), ids, wts.double())
        else:
            want = stock_forward(module)(module, x, ids, wts)
        try:
            got = tpukernels_experts_forward(_without_stock_mark(module), x, ids, wts)
        except Exception as e:  # noqa: BLE001  (any failure of ours leaves the class stock, with the reason)
            verdict = f"the tpukernels forward raised on a probe: {type(e).__name__}: {str(e).splitlines()[0]}"
        else:
            err = (got.double() - want.double()).abs().max().item()
            tol = PROBE_RTOL[dtype] * want.double().abs().max().item()
            verdict = None if err <= tol and got.shape == want.shape else (
                f"a probe mismatch against the stock forward: max |ours - stock| = {err:.3g} > {tol:.3g} "
                f"({dtype}, {x.shape[0]} tokens, top-{ids.shape[1]})")
    probe_verdicts[key] = verdict
    return verdict


def _without_stock_mark(module):
    if getattr(module, "tpukernels_stock", None) is None:
        return module
    import copy

    ours = copy.copy(module)
    ours.__dict__.pop("tpukernels_stock", None)
    return ours


def route_reason(module) -> str | None:
    """Why ``module`` (an :func:`is_experts_candidate`) stays stock, or None when ``"tpukernels"`` replaces it:
    :func:`_unsupported`, weights on the meta device, then :func:`verify_experts`."""
    why = _unsupported(module)
    if why:
        return why
    w = module.gate_up_proj_q if _quantized(module) else module.gate_up_proj
    if w.device.type == "meta":
        return "weights on the meta device (nothing to verify against)"
    return verify_experts(module)


def register() -> None:
    """Register ``"tpukernels"`` in transformers' ``ALL_EXPERTS_FUNCTIONS`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, tpukernels_experts_forward)


def expert_buffers(spec: dict, shape, name: str) -> dict:
    """``{buffer suffix: (shape, torch dtype) or None}`` of one projection (float ``[E, N, K]``) quantized with
    ``spec`` (``_q``, ``_scale``, ``_zero_point``; :mod:`tpukernels.integrations.moe`'s layout). ``name`` (the
    projection's dotted name) is for the error of a block size not dividing K."""
    E, N, K = shape
    dtype, bs = spec["dtype"], spec["block_size"]
    if bs is not None and K % bs:
        raise ArgumentError(f"quantization_config.experts: {name} has K = {K} in-features, not a multiple of its "
                            f"block_size = {bs}; the checkpoint does not match the model's architecture")
    packed = dtype in ("int4", "fp4")
    qdt = torch.uint8 if packed else getattr(torch, dtype)
    nb = K // bs if bs is not None else 1
    sshape = (E, nb, 1, N)
    return {"_q": ((E, N, K // 2 if packed else K), qdt), "_scale": (sshape, torch.float32),
            "_zero_point": (sshape, torch.float32) if spec["asymmetric"] else None}


def _swap_in_buffers(module, bufs: dict, weight_format) -> None:
    """Replace ``module``'s float ``gate_up_proj`` / ``down_proj`` by quantized buffers ``{proj: (q, scale,
    zero_point)}`` (the parameters become None)."""
    for proj, (rhs, s, z) in bufs.items():
        del module._parameters[proj]
        module.register_parameter(proj, None)
        module.register_buffer(f"{proj}_q", rhs)
        module.register_buffer(f"{proj}_scale", s)
        module.register_buffer(f"{proj}_zero_point", z)
    module.tpukernels_weight_format = weight_format


def prepare_quantized_experts(model: torch.nn.Module, experts: dict) -> None:
    """``from_pretrained`` of a checkpoint with quantized experts (called by the tpukernels HF quantizer before the
    weights load): each listed experts module (``{name: {"dtype", "block_size", "asymmetric"}}``) gets empty
    quantized buffers of the saved shapes and dtypes in place of its float parameters
    (:func:`expert_buffers`), on the parameters' device (meta while loading).

    Raises:
        ArgumentError: a listed name that is no supported float experts module of ``model``, a block size not
            dividing a projection's K (the checkpoint does not match the architecture).
    """
    plan = []
    for name, spec in experts.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        if module is None or not _is_experts(module) or _quantized(module):
            raise ArgumentError(f"quantization_config.experts: {name!r} is not a float experts module "
                                f"(gate_up_proj [E, 2I, H]) of this {type(model).__name__} (got "
                                f"{type(module).__name__}); the checkpoint does not match the model's architecture")
        why = quantize_unsupported(module)
        if why:
            raise ArgumentError(f"quantization_config.experts: {name} ({type(module).__name__}) has {why}, not "
                                f"supported")
        bufs = {}
        for proj in ("gate_up_proj", "down_proj"):
            p = getattr(module, proj)
            lay = expert_buffers(spec, tuple(p.shape), f"{name}.{proj}")
            bufs[proj] = [None if v is None else torch.empty(v[0], dtype=v[1], device=p.device)
                          for v in (lay["_q"], lay["_scale"], lay["_zero_point"])]
        plan.append((module, bufs, spec))
    for module, bufs, spec in plan:
        _swap_in_buffers(module, bufs, "fp4" if spec["dtype"] == "fp4" else None)
        # transformers' weight init of missing keys would draw into the (now None) float parameters; the buffers
        # come from the checkpoint or the quantizer raises after loading (never initialised at random)
        module._is_hf_initialized = True


def route_quantized_experts(model: torch.nn.Module, names) -> None:
    """Route the (loaded) quantized experts modules ``names`` through ``grouped_matmul_quantized``
    (``config._experts_implementation = "tpukernels"``), each class and format first probed (:func:`route_reason`).

    Raises:
        ArgumentError: a module fails its probe (a quantized module has no float weights to stay stock on);
            raised before any module is routed.
    """
    if not names:
        return
    register()
    for name in names:
        module = model.get_submodule(name)
        why = route_reason(module)
        if why:
            raise ArgumentError(f"from_pretrained: quantized experts {name} ({type(module).__name__}): {why}")
    for name in names:
        model.get_submodule(name).config._experts_implementation = IMPLEMENTATION


__all__ = ["IMPLEMENTATION", "PROBE_RTOL", "WEIGHT_DTYPES", "tpukernels_experts_forward", "register", "expert_buffers",
           "prepare_quantized_experts", "route_quantized_experts", "is_experts_candidate", "is_quantized",
           "stock_forward", "quantize_unsupported", "probe_routing", "verify_experts", "route_reason",
           "probe_verdicts"]
