"""MoE expert layers of HF transformers through :func:`tpukernels.library.grouped_matmul`.

transformers (>= 5) stores the experts of Mixtral, Qwen-MoE and friends as 3-D parameters
(``gate_up_proj [E, 2*I, H]``, ``down_proj [E, H, I]``, i.e. ``nn.Linear`` layout per expert) and dispatches
their forward through ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` by
``config._experts_implementation``. This module registers one more implementation, ``"tpukernels"``::

    from tpukernels.integrations.moe import apply_tpukernels_moe
    apply_tpukernels_moe(model)          # every supported experts module now routes through grouped_matmul

Forward of one experts module (``S = tokens * top_k`` token-expert pairs)::

    order = stable sort of the S expert ids          group_sizes = per-expert counts (int32 [E])
    x_g = hidden[order // top_k]                     [S, H]   rows grouped by expert
    h = act(gate) * up, (gate, up) = grouped_matmul(x_g, gate_up_proj, group_sizes, transpose_rhs=True)
    y = grouped_matmul(h, down_proj, group_sizes, transpose_rhs=True) * weights[order]
    out = zeros.index_add(0, order // top_k, y)

The same computation as HF's eager loop over experts (each token's top-k expert outputs, weighted and
summed), in one grouped matmul per projection; differentiable (the kernel's backward). Supported:
gated, concatenated, non-transposed, bias-free experts without expert parallelism (Mixtral, Qwen2/3-MoE
experts); others raise :class:`tpukernels.errors.ArgumentError` naming the unsupported feature.
"""

from __future__ import annotations

import torch

from ..errors import ArgumentError

IMPLEMENTATION = "tpukernels"


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
    gate_up = grouped_matmul(x, self.gate_up_proj, sizes, transpose_rhs=True)
    h = self._apply_gate(gate_up) if hasattr(self, "_apply_gate") else (
        self.act_fn(gate_up.chunk(2, dim=-1)[0]) * gate_up.chunk(2, dim=-1)[1])
    y = grouped_matmul(h.to(self.down_proj.dtype), self.down_proj, sizes, transpose_rhs=True)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))


def register() -> None:
    """Register ``"tpukernels"`` in transformers' ``ALL_EXPERTS_FUNCTIONS`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, tpukernels_experts_forward)


def apply_tpukernels_moe(model: torch.nn.Module) -> list[str]:
    """Route every supported experts module of ``model`` through grouped_matmul (in place).

    Sets ``config._experts_implementation = "tpukernels"`` on each experts module's config (the model
    config, usually). Returns the names of the patched modules.

    Raises:
        ArgumentError: the model has no experts modules, or one has an unsupported feature.
    """
    register()
    patched = []
    for name, module in model.named_modules():
        if not (isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter)
                and getattr(module, "gate_up_proj").dim() == 3 and hasattr(module, "config")):
            continue
        why = _unsupported(module)
        if why:
            raise ArgumentError(f"apply_tpukernels_moe: {name} ({type(module).__name__}) has {why}, not supported")
        module.config._experts_implementation = IMPLEMENTATION
        patched.append(name)
    if not patched:
        raise ArgumentError("apply_tpukernels_moe: the model has no 3-D experts modules (gate_up_proj [E, 2I, H])")
    return patched


__all__ = ["apply_tpukernels_moe", "tpukernels_experts_forward", "register", "IMPLEMENTATION"]
