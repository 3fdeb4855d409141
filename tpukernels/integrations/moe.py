"""MoE expert layers of HF transformers through :func:`tpukernels.library.grouped_matmul`.

transformers (>= 5) stores the experts of Mixtral, Qwen-MoE and friends as 3-D parameters
(``gate_up_proj [E, 2*I, H]``, ``down_proj [E, H, I]``, i.e. ``nn.Linear`` layout per expert) and dispatches
their forward through ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` by
``config._experts_implementation``. This module registers one more implementation, ``"tpukernels"``::

    from tpukernels.integrations.moe import apply_tpukernels_moe
    apply_tpukernels_moe(model)          # every supported experts module now routes through grouped_matmul

Forward of one experts module (``S = tokens * top_k`` token-expert pairs): where its gate is one
:func:`~tpukernels.library.fused_moe` has (:func:`tpukernels.integrations.moe_experts.fused_gate`: transformers'
default ``act(gate) * up`` with SiLU or tanh-GELU, gpt-oss's clamped SwiGLU on interleaved columns), the whole layer
is one ``fused_moe`` call on HF's weights as stored::

    fused_moe(hidden, gate_up_proj, down_proj, topk_weights=top_k_weights, topk_ids=top_k_index, act_fn=...,
              b1=gate_up_proj_bias[:, None], b2=down_proj_bias[:, None],
              transpose_rhs=not is_transposed, gate_up_interleaved=<gpt-oss>)

i.e. ``moe_permute`` (rows grouped by expert, stable), ``grouped_matmul`` gate / up (float32 out), the gate in
float32 (``gated_activation``; gpt-oss's in torch), ``h`` rounded once, ``grouped_matmul`` down, ``moe_combine``
(``out[t] = sum_j w[t, j] * y[row of (t, j)]``, float32 sums). Another gate (a class's own ``_apply_gate``, another
activation) keeps the same permute, grouped matmuls and combine with the class's own gate in between, in the
weights' dtype. Quantized experts take that path too (``grouped_matmul_quantized``; 4-bit packing and zero
points are not wired into ``fused_moe``).

The same computation as HF's eager loop over experts (each token's top-k expert outputs, weighted and
summed), in one grouped matmul per projection; ``moe_permute`` / ``moe_combine``
(:mod:`tpukernels.library.moe_routing`) move the token rows by DMA kernels; differentiable (the kernels' backward). Supported: gated
experts dispatched by ``config._experts_implementation`` without expert parallelism or a post-expert norm
(Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss; Aria's transposed ``[E, K, N]`` weights, ``transpose_rhs=False``;
gpt-oss's expert biases through the grouped matmuls' ``rhs_bias [E, 1, N]``). :func:`plan_moe` lists every experts module with the reason
it stays stock (Llama-4's and LongCat-Flash's experts are not dispatched by transformers' experts interface);
:func:`apply_tpukernels_moe` replaces only modules whose class passed a numerical probe against its stock forward
(:func:`tpukernels.integrations.moe_experts.verify_experts`) and warns for the rest. The routers in front of the
experts (Mixtral, Qwen-MoE, gpt-oss, DeepSeek-V3) go through the fused router kernels with
:func:`tpukernels.integrations.moe_routers.apply_tpukernels_routers` (opt-in, probed the same way).

Quantized experts (:func:`quantize_moe_experts`): each experts module's ``gate_up_proj`` / ``down_proj`` is
quantized once with this library's quantizers
(:func:`tpukernels.library.grouped_matmul_ops.quant.quantize_experts`: int8 / fp8 per output channel, or int8 / int4
(optionally asymmetric) / fp4 with block scales along K), stored as buffers ``<name>_q`` (``[E, N, K]``, or
``[E, N, K/2]`` uint8 for 4-bit), ``<name>_scale`` (``[E, num_blocks, 1, N]`` float32) and ``<name>_zero_point``,
and the float parameters are dropped (set to ``None``). The forward then runs both projections through
:func:`~tpukernels.library.grouped_matmul_ops.quant.grouped_matmul_quantized` (dequantized in VMEM), in the
activations' dtype (bf16 / f32; other dtypes go through f32); differentiable with respect to the activations, the
experts frozen (their buffers get no gradient).

Saving and loading: ``quantize_moe_experts`` records each quantized module's scheme in
``model.config.quantization_config`` (a :class:`tpukernels.integrations.quantizers.TpuKernelsConfig`, field
``experts``), so ``save_pretrained`` writes it with the buffers as they are, and ``from_pretrained`` (with
:mod:`tpukernels.integrations.quantizers` imported) rebuilds the quantized modules before the weights load
(:func:`prepare_quantized_experts`): every buffer reloads bit-identical, a missing one raises ArgumentError.
"""

from __future__ import annotations

import copy

import torch

from ..errors import ArgumentError
from .moe_experts import (IMPLEMENTATION, _is_experts, _quantized, _swap_in_buffers, _unsupported,  # noqa: F401
                          is_experts_candidate, prepare_quantized_experts, quantize_unsupported, register,
                          route_quantized_experts, route_reason, tpukernels_experts_forward, verify_experts)


def plan_moe(model: torch.nn.Module) -> list[tuple[str, str, str | None]]:
    """What :func:`apply_tpukernels_moe` would do to ``model``, without doing it.

    Returns one ``(qualified module name, class name, reason)`` per experts module (any module holding 3-D
    stacked expert weights, :func:`~tpukernels.integrations.moe_experts.is_experts_candidate`), in
    ``named_modules`` order: ``reason`` None when the module will be routed through ``grouped_matmul``, else a
    one-line reason it stays stock. A reason comes from the module's structure (a forward transformers does not
    dispatch by ``config._experts_implementation``, e.g. Llama-4's and LongCat-Flash's; ungated experts; expert
    parallelism; a post-expert norm; inconsistent shapes; weights not bfloat16 / float32 or on the meta device)
    or from the numerical probe (:func:`~tpukernels.integrations.moe_experts.verify_experts`: our forward
    against the class's stock forward on the module's own weights, once per class and weight format).

    Never raises for an unsupported module and does not modify ``model`` (the probe runs under no_grad on
    fresh inputs; its verdict is cached in ``moe_experts.probe_verdicts``).
    """
    return [(name, type(m).__name__, route_reason(m)) for name, m in model.named_modules() if is_experts_candidate(m)]


def apply_tpukernels_moe(model: torch.nn.Module) -> list[str]:
    """Route every experts module of ``model`` that :func:`plan_moe` accepts through grouped_matmul (in place).

    Supported (and probed against the stock forward): HF experts dispatched by ``config._experts_implementation``
    with gated ``gate_up_proj`` / ``down_proj`` weights, concatenated (Mixtral, Qwen-MoE) or interleaved
    gate/up columns through the class's own ``_apply_gate`` (gpt-oss's clamped SwiGLU), ``nn.Linear`` layout or
    transposed ``[E, K, N]`` (Aria, gpt-oss), with or without expert biases (gpt-oss: ``rhs_bias`` of
    ``grouped_matmul``), and the quantized experts of :func:`quantize_moe_experts`. Each replaced module's config
    gets ``_experts_implementation = "tpukernels"``. A module left stock gets one ``warnings.warn`` per class and
    reason (naming both) and keeps computing its stock forward even where it shares that config with a
    replaced one (it is marked ``tpukernels_stock = <the implementation its config named before>``).

    Returns:
        The names of the modules actually replaced (possibly empty).

    Raises:
        ArgumentError: the model has no experts modules at all; or a quantized experts module (which has no
            float weights to fall back on) fails its probe (raised before anything is changed).
    """
    import warnings

    register()
    plan = plan_moe(model)
    if not plan:
        raise ArgumentError("apply_tpukernels_moe: the model has no 3-D experts modules (gate_up_proj [E, 2I, H])")
    modules = {name: model.get_submodule(name) for name, _, _ in plan}
    for name, cls, why in plan:
        if why and _quantized(modules[name]):
            raise ArgumentError(f"apply_tpukernels_moe: {name} ({cls}) holds quantized experts (no float weights "
                                f"to leave stock) and {why}")
    stock: dict = {}
    for name, cls, why in plan:
        if why:
            stock.setdefault((cls, why), []).append(name)
            m = modules[name]
            cfg = getattr(m, "config", None)
            if cfg is not None and getattr(m, "tpukernels_stock", None) is None:
                impl = getattr(cfg, "_experts_implementation", None)
                m.tpukernels_stock = "eager" if impl in (None, IMPLEMENTATION) else impl
    for (cls, why), names in stock.items():
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} modules)" if len(names) > 3 else "")
        warnings.warn(f"apply_tpukernels_moe: {cls} left stock ({shown}): {why}", stacklevel=2)
    patched = [name for name, _, why in plan if why is None]
    for name in patched:
        m = modules[name]
        m.__dict__.pop("tpukernels_stock", None)
        m.config._experts_implementation = IMPLEMENTATION
    return patched


def quantize_moe_experts(model: torch.nn.Module, *, dtype: str = "int8", block_size: int | None = None,
                         asymmetric: bool = False) -> list[str]:
    """Quantize every supported experts module's weights in place and route it through
    ``grouped_matmul_quantized`` (module docstring); returns the patched module names.

    Args:
        model: an HF MoE model (experts with ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``).
        dtype: ``"int8"``, ``"float8_e4m3fn"`` / ``"float8_e5m2"`` (per channel only), ``"int4"`` or ``"fp4"``
            (block scales only).
        block_size: None: one scale per (expert, output channel); else block scales along K (a multiple of 32 in
            32..512 dividing both ``H`` and ``I``).
        asymmetric: int4 with zero points (GPTQ / AWQ style min-max).

    Raises:
        ArgumentError: no experts modules, an unsupported feature (as :func:`apply_tpukernels_moe`), a block
            size that does not divide a projection's K, a 4-bit dtype without ``block_size``, already quantized,
            a model whose ``config.quantization_config`` is another method's.
        DTypeError: an unknown ``dtype`` (from the quantizers).

    The scheme is recorded in ``model.config.quantization_config`` (``experts``; module docstring), so
    ``save_pretrained`` / ``from_pretrained`` round-trip the quantized buffers bit-identically.
    """
    from ..library.grouped_matmul_ops.quant import quantize_experts

    if getattr(model, "config", None) is not None:
        from .quantizers import check_can_mark_experts

        check_can_mark_experts(model)
    if dtype in ("int4", "fp4") and block_size is None:
        raise ArgumentError(f"quantize_moe_experts: {dtype} weights need a block_size (block scales along K)")
    found = []
    for name, module in model.named_modules():
        if not _is_experts(module):
            continue
        if _quantized(module):
            raise ArgumentError(f"quantize_moe_experts: {name} is already quantized")
        why = quantize_unsupported(module)
        if why:
            raise ArgumentError(f"quantize_moe_experts: {name} ({type(module).__name__}) has {why}, not supported")
        for proj in ("gate_up_proj", "down_proj"):
            K = getattr(module, proj).shape[2]
            if block_size is not None and K % block_size:
                raise ArgumentError(f"quantize_moe_experts: {name}.{proj} has K = {K} in-features, not a multiple "
                                    f"of block_size = {block_size}")
        found.append((name, module))
    # quantize everything first, then swap: an error (e.g. from the quantizers) leaves the model unchanged
    done = []
    for name, module in found:
        qs = {}
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(module, proj).detach()
            qs[proj] = [t if t is None else t.to(w.device) for t in
                        quantize_experts(w.float(), block_size, dtype, asymmetric=asymmetric, transpose_rhs=True)]
        done.append((module, qs))
    names = [n for n, _ in found]
    if not names:
        raise ArgumentError("quantize_moe_experts: the model has no 3-D experts modules (gate_up_proj [E, 2I, H])")
    for (name, module), (_, qs) in zip(found, done):  # probe each class on a quantized stand-in, before any swap
        probe = copy.copy(module)
        probe._parameters, probe._buffers = dict(module._parameters), dict(module._buffers)
        _swap_in_buffers(probe, qs, "fp4" if dtype == "fp4" else None)
        why = verify_experts(probe)
        if why:
            raise ArgumentError(f"quantize_moe_experts: {name} ({type(module).__name__}) quantized {dtype}: {why}")
    for module, qs in done:
        _swap_in_buffers(module, qs, "fp4" if dtype == "fp4" else None)
    if getattr(model, "config", None) is not None:
        from .quantizers import mark_experts_quantized

        spec = {"dtype": dtype, "block_size": block_size,
                "asymmetric": bool(asymmetric and dtype == "int4" and block_size is not None)}
        mark_experts_quantized(model, {n: dict(spec) for n in names})
    apply_tpukernels_moe(model)
    return names


__all__ = ["plan_moe", "apply_tpukernels_moe", "quantize_moe_experts", "tpukernels_experts_forward", "register",
           "IMPLEMENTATION", "prepare_quantized_experts", "route_quantized_experts"]
