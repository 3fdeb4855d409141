"""The experts-module layer under :mod:`tpukernels.integrations.moe` (its docstring: semantics, layout): which HF
modules are experts, the ``"tpukernels"`` experts forward and its registration, and the quantized experts' buffer
layout with the swap of float parameters for it (used by ``quantize_moe_experts`` and, on ``from_pretrained``, by
:mod:`tpukernels.integrations.quantizers`, which therefore does not import :mod:`~tpukernels.integrations.moe`)."""

from __future__ import annotations

import torch

from ..errors import ArgumentError

IMPLEMENTATION = "tpukernels"


def _quantized(module) -> bool:
    return getattr(module, "gate_up_proj_q", None) is not None


def _is_experts(module) -> bool:
    """An HF experts module: 3-D ``gate_up_proj`` (a parameter, or quantized buffers) and a config."""
    w = getattr(module, "gate_up_proj_q", None) if _quantized(module) else getattr(module, "gate_up_proj", None)
    ok = isinstance(w, torch.nn.Parameter) or (_quantized(module) and isinstance(w, torch.Tensor))
    return ok and w.dim() == 3 and hasattr(module, "config")


def _unsupported(module) -> str | None:
    if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")):
        return "no gate_up_proj / down_proj parameters (ungated experts)"
    if getattr(module, "has_bias", False):
        return "expert biases"
    if getattr(module, "is_transposed", False):
        return "transposed expert weights"
    if not getattr(module, "is_concatenated", True):
        return "interleaved gate/up weights"
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallelism"
    if getattr(module, "has_post_expert_norm", False):
        return "a post-expert norm"
    return None


def tpukernels_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF experts forward (``hidden_states [T, H]``, ``top_k_index [T, k]``, ``top_k_weights [T, k]``) ->
    ``[T, H]`` through two grouped matmuls (module docstring)."""
    from ..library.grouped_matmul import grouped_matmul
    from ..library.grouped_matmul.quant import grouped_matmul_quantized

    why = _unsupported(self)
    if why:
        raise ArgumentError(f"tpukernels experts: {type(self).__name__} has {why}, which is not supported")
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    token = order // top_k
    # a fixed-length count (bincount's output length depends on the data: a graph break under torch.compile)
    sizes = torch.zeros(self.num_experts, dtype=torch.int32, device=expert_ids.device).scatter_add_(
        0, expert_ids, torch.ones_like(expert_ids, dtype=torch.int32))
    x = hidden_states[token]
    if _quantized(self):
        cdt = hidden_states.dtype if hidden_states.dtype in (torch.bfloat16, torch.float32) else torch.float32
        x = x.to(cdt)

        def mm(a, name):
            return grouped_matmul_quantized(
                a.to(cdt), getattr(self, f"{name}_q"), sizes, getattr(self, f"{name}_scale"),
                rhs_zero_point=getattr(self, f"{name}_zero_point", None), transpose_rhs=True,
                weight_format=getattr(self, "tpukernels_weight_format", None))
    else:
        def mm(a, name):
            w = getattr(self, name)
            return grouped_matmul(a.to(w.dtype), w, sizes, transpose_rhs=True)
    gate_up = mm(x, "gate_up_proj")
    h = self._apply_gate(gate_up) if hasattr(self, "_apply_gate") else (
        self.act_fn(gate_up.chunk(2, dim=-1)[0]) * gate_up.chunk(2, dim=-1)[1])
    y = mm(h, "down_proj")
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))


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
        why = _unsupported(module)
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
    (``config._experts_implementation = "tpukernels"``)."""
    if not names:
        return
    register()
    for name in names:
        model.get_submodule(name).config._experts_implementation = IMPLEMENTATION


__all__ = ["IMPLEMENTATION", "tpukernels_experts_forward", "register", "expert_buffers", "prepare_quantized_experts",
           "route_quantized_experts"]
