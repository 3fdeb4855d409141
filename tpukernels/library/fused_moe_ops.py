"""Fused MoE layer: route, permute, gate/up grouped matmul, gated activation, down grouped matmul, combine.

Public API (torch; differentiable through the composed ops' backwards)::

    fused_moe(tokens, w1, w2, gating_output=None, top_k=2, *, renormalize_topk_logits=False, act_fn="silu",
              scoring_fn="softmax", w1_scale=None, w2_scale=None, b1=None, b2=None, subc_quant_w1_sz=None,
              subc_quant_w2_sz=None, w3=None, topk_weights=None, topk_ids=None, swigluoai_alpha=1.702,
              swigluoai_limit=7.0) -> [T, H]
    torch.ops.tpukernels.fused_moe(...)                  the same, as a composite torch.library op
    fused_moe_jax(...)                                   jax arrays: forward, float weights
    fused_moe_reference(...)                             float64, per token over its selected experts

Semantics: tpu-inference 0.32.0 ``kernels/fused_moe/v1/kernel.py`` (``fused_ep_moe`` and its pure-JAX ``ref_moe``;
the argument names are its names), with tokamax's ``fused_moe`` (``tokamax/_src/ops/experimental/fused_moe``)
layout of a fused ``w1 [E, H, 2I]`` accepted too. ``T`` tokens, ``H`` hidden, ``E`` experts, ``I`` expert
intermediate size, ``k = top_k``::

    scores   = softmax(gating_output) (scoring_fn="softmax") or sigmoid(gating_output) ("sigmoid")     [T, E]
    ids, w   = the top_k scores per token (ties: the lower expert id), w / sum(w) if renormalize_topk_logits
    for each token t and its slot j, e = ids[t, j]:
        gate = tokens[t] @ W_gate[e] + b_gate[e],  up = tokens[t] @ W_up[e] + b_up[e]                   [I]
        h    = act(gate, up)                                                                            [I]
        out[t] += w[t, j] * (h @ w2[e] + b2[e])                                                         [H]

``act_fn``: ``"silu"`` ``silu(gate) * up``; ``"gelu"`` ``gelu(gate) * up`` with the **tanh** approximation
(tpu-inference's ``jax.nn.gelu`` default); ``"swigluoai"`` (gpt-oss) ``(clip(up, -limit, limit) + 1) *
g * sigmoid(alpha * g)``, ``g = min(gate, limit)`` (``swigluoai_alpha`` 1.702, ``swigluoai_limit`` 7.0 as
tpu-inference and transformers' gpt-oss).

Expert weight layouts (``w2 [E, I, H]`` always, as both anchors; weights are stored ``[in, out]``):

* ``w1 [E, 2, H, I]`` (tpu-inference): gate ``w1[:, 0]``, up ``w1[:, 1]``; ``b1 [E, 2, 1, I]``.
* ``w1 [E, H, 2I]`` (tokamax's fused gate-up): gate the first ``I`` columns, up the last ``I``; ``b1 [E, 1, 2I]``.
* ``w1 [E, H, I]`` and ``w3 [E, H, I]`` (vLLM's names: gate ``w1``, up ``w3``); ``b1 [E, 1, 2I]`` (gate, up).
* ``transpose_rhs=True``: each of the above stored ``[..., out, in]`` instead (``nn.Linear`` and HF transformers'
  experts: ``w1 [E, 2I, H]``, ``w2 [E, H, I]``); the grouped matmuls read them as stored (``transpose_rhs``).
* ``gate_up_interleaved=True`` with a fused ``w1``: gate in the even columns, up in the odd ones (HF gpt-oss's
  ``gate_up_proj [E, H, 2I]`` and its bias); split after the matmul, no copy of the weights.

``apply_tpukernels`` runs HF MoE experts (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss, ...) through this op with
these two flags (``tpukernels.integrations.moe_experts``).

``b2 [E, 1, H]``. Biases bfloat16 / float32 (added in float32 in the grouped matmul's epilogue).

Routing input: ``gating_output [T, E]`` (router logits), or precomputed ``topk_weights [T, k]`` float and
``topk_ids [T, k]`` int (then ``gating_output`` is None and ``top_k`` is read from ``topk_ids``).

Quantized experts: ``w1`` / ``w3`` / ``w2`` int8 / float8_e4m3fn / float8_e5m2 with float32 scales go through
``grouped_matmul_quantized`` (weights dequantized in VMEM). Scale layouts: tpu-inference's ``w1_scale [E, 2,
H // subc_quant_w1_sz, 1, I]`` (with ``w1 [E, 2, H, I]``) and ``w2_scale [E, I // subc_quant_w2_sz, 1, H]``;
with a fused ``w1 [E, H, 2I]`` tokamax's ``[E, 2I]`` / ``[E, blocks, 2I]`` (and ``[E, blocks, 1, 2I]``), with
``w2`` ``[E, H]`` / ``[E, blocks, H]``. ``subc_quant_w*_sz`` (optional) must equal the block size the scale
implies. Quantized weights get no gradient (frozen), as ``grouped_matmul_quantized``.

What runs (every step one of this library's ops, so the backward is theirs):

1. ``softmax_topk`` / ``sigmoid_topk`` (router kernel): ids and float32 weights. When ``gating_output``
   requires grad the weights are recomputed from the kernel's ids with differentiable torch ops (softmax /
   sigmoid, gather, renormalize; the router kernel has no backward), so the logits get their gradient.
2. ``moe_permute``: token copies in expert order (stable), int32 group sizes.
3. ``grouped_matmul`` (or ``grouped_matmul_quantized``) for gate and up, float32 accumulation, **out in tokens'
   dtype** (one matmul over ``[E, H, 2I]``, two over the split layouts; ``w1 [E, 2, H, I]``'s halves are strided
   views, copied by the kernel call).
4. the activation in float32: the ``gated_activation_fwd`` kernel (``"silu"``, ``"gelu_tanh"``), which writes
   ``h`` rounded once to the down projection's operand dtype (w2's dtype; tokens' for quantized w2). From one
   ``[T*k, 2I]`` output (``[E, H, 2I]`` weights, ``I`` a multiple of 128) it reads the gate and up halves in place
   (``halves=True``: two BlockSpecs on the same array, no split copies; :func:`reads_halves`); otherwise from the
   two outputs or their split. ``"swigluoai"`` in float32 torch elementwise ops (no kernel of its own yet: the
   clamps and the ``+ 1`` are not in ``gated_activation``), then rounded the same way.
5. ``grouped_matmul`` (down), float32 accumulation, out in tokens' dtype. 6. ``moe_combine``: float32 weighted
   sums of the expert outputs, rounded once to ``tokens.dtype``.

Rounding: the matmuls accumulate in float32 and write gate / up and the expert outputs in tokens' dtype (float32
tokens: float32 throughout; bfloat16 tokens: one bf16 rounding of each, as stock transformers' bf16 linears, which
halves their HBM traffic and the combine's row copies), the activation runs in float32 and ``h`` is rounded once
(the MXU operand of the down projection), and the output once, after the float32 weighted sum (stock rounds each
expert's weighted output and each partial sum in bf16). tpu-inference's fused kernel keeps
its accumulators in float32 in VMEM too but rounds at other places (per block, through its all-to-all buffers);
the tests hold both this op and that kernel's pure-JAX ``ref_moe`` to the float64 definition, not to each other
bit for bit.

Performance: not measured (no TPU here). This is a composition, not one fused kernel: five kernel launches plus
the permute / combine gathers, with ``gate``/``up`` (``[T*k, 2I]``) and the expert outputs (``[T*k, H]``) in
HBM between them; tpu-inference's ``fused_ep_moe`` keeps those in VMEM. Each kernel uses its own
tuned / heuristic config (no tuning of the composition). The MoE bench family (:mod:`tpukernels.bench.moe`,
BENCHMARKS.md; libtpu's static model) puts this layer ahead of JAX megablox with XLA routing at decode (its grouped
matmuls) and at Qwen3-30B-A3B prefill on v6e (2,237 vs 3,064 µs), where the permute reads the tokens resident in
VMEM and the combine sums the expert outputs into a VMEM accumulator (``moe_routing.permute_ops``); at shapes whose
tokens or accumulator do not fit VMEM (DeepSeek-V3's D = 7168, tpu7x's smaller VMEM) they move rows by DMA.

``torch.compile(fullgraph=True)`` takes the op as one graph (fixed-length group sizes; the ids' range is then
asserted inside the graph by ``moe_permute``, a RuntimeError when it runs, not the eager ArgumentError; tested
bit-equal to eager).

JAX: :func:`fused_moe_jax` runs the forward on jax arrays through the same kernels (float weights; no
``jax.grad``). Tests: ``tests/test_fused_moe.py``.

Gaps (against the anchors): no expert parallelism (tpu-inference's ``mesh`` / ``ep_axis_name``: a single device
here), its tuning arguments (``bt``, ``bf``, ...) are not taken; 4-bit packed experts and zero points (which
``grouped_matmul_quantized`` has) are not wired here; quantized weights with a separate ``w3``; float16 tokens.
tokamax names the logits ``gating``, ``topk`` and the biases ``w1_bias`` / ``w2_bias`` and defaults
``renormalize=True``; here they are tpu-inference's names and default (False). (Expert parallelism is
:mod:`tpukernels.distributed.expert_parallel`: dispatch and combine around the grouped matmuls.)

Errors (typed, before any kernel runs): ``ArgumentError`` naming the argument for router logits whose expert
count is not ``E``, ``top_k`` outside ``[1, E]``, ids outside ``[0, E)`` (cpu tensors), weight / bias / scale
shapes that do not match, both or neither of ``gating_output`` and ``topk_ids``; ``DTypeError`` for dtypes.

Sources: tpu-inference 0.32.0 ``fused_moe/v1`` (``ref_moe``, ``fused_ep_moe``: names, layouts, activations);
tokamax ``fused_moe`` reference (fused ``[E, H, 2I]``); vLLM ``fused_experts`` (``w1`` / ``w3``, precomputed
``topk_weights`` / ``topk_ids``). Read, not copied.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import ArgumentError, DTypeError

__all__ = ["fused_moe", "fused_moe_jax", "fused_moe_reference", "ACT_FNS", "SCORING_FNS", "QUANT_DTYPES"]

#: ``act_fn`` values (tpu-inference's names; ``"gelu"`` is the tanh approximation)
ACT_FNS = ("silu", "gelu", "swigluoai")
#: ``scoring_fn`` values
SCORING_FNS = ("softmax", "sigmoid")
#: expert weight dtypes that go through ``grouped_matmul_quantized``
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_FLOATS = (torch.bfloat16, torch.float32)
_OP = "tpukernels.fused_moe"


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ArgumentError(f"{_OP}: {msg}")


def _weight_dtype(name, w, floats):
    if w.dtype not in floats + QUANT_DTYPES:
        raise DTypeError(f"{_OP}: {name} dtype {w.dtype} is not supported: bfloat16 / float32, or int8 / float8 "
                         f"with a scale")


def _canon_scale(name, s, E, N, K, sz, sz_name):
    """A scale as ``[E, nb, 1, N]`` float32 (from ``[E, N]``, ``[E, nb, N]``, ``[E, nb, 1, N]``), nb dividing K."""
    if s is None:
        raise ArgumentError(f"{_OP}: {name} is required with quantized weights")
    if not isinstance(s, torch.Tensor) or s.dim() not in (2, 3, 4):
        raise ArgumentError(f"{_OP}: {name} must be [E, N], [E, blocks, N] or [E, blocks, 1, N], got {_shape(s)}")
    if s.dtype != torch.float32:
        raise DTypeError(f"{_OP}: {name} must be float32, got {s.dtype}")
    if s.dim() == 2:
        s = s[:, None, None, :]
    elif s.dim() == 3:
        s = s[:, :, None, :]
    nb = s.shape[1]
    _need(s.shape[0] == E and s.shape[2] == 1 and s.shape[3] == N and nb >= 1 and K % nb == 0,
          f"{name} must be [E, blocks, 1, N] = [{E}, blocks, 1, {N}] with blocks dividing K = {K}, got {_shape(s)}")
    _need(sz is None or sz == K // nb, f"{sz_name} = {sz} but {name} has {nb} blocks over K = {K} (block size "
          f"{K // nb})")
    return s


def _prepare(tokens, w1, w2, gating_output, top_k, renormalize_topk_logits, act_fn, scoring_fn, w1_scale,
             w2_scale, b1, b2, subc_quant_w1_sz, subc_quant_w2_sz, w3, topk_weights, topk_ids, floats=_FLOATS,
             transpose_rhs=False, gate_up_interleaved=False):
    """All argument checks; returns ``(E, H, I, k, gate_up_specs, down_spec)``, each spec ``(w, scale, bias)``
    of one grouped matmul ``[E, K, N]`` (with ``transpose_rhs`` each ``w`` is a transposed view of the given
    ``[E, N, K]`` weight). ``floats``: the float dtypes taken (the reference adds float64)."""
    for name, flag in (("transpose_rhs", transpose_rhs), ("gate_up_interleaved", gate_up_interleaved)):
        if not isinstance(flag, bool):
            raise ArgumentError(f"{_OP}: {name} must be a bool, got {flag!r}")
    if not transpose_rhs:
        return _prepare_kn(tokens, w1, w2, gating_output, top_k, renormalize_topk_logits, act_fn, scoring_fn,
                           w1_scale, w2_scale, b1, b2, subc_quant_w1_sz, subc_quant_w2_sz, w3, topk_weights,
                           topk_ids, floats, gate_up_interleaved)
    for name, w in (("w1", w1), ("w2", w2)) + ((("w3", w3),) if w3 is not None else ()):
        if not isinstance(w, torch.Tensor) or w.dim() < 3:
            raise ArgumentError(f"{_OP}: {name} must be a 3-D or 4-D tensor (transpose_rhs=True: [..., N, K]), got "
                                f"{_shape(w)}")
    t = (lambda w: None if w is None else w.transpose(-1, -2))
    try:
        return _prepare_kn(tokens, t(w1), t(w2), gating_output, top_k, renormalize_topk_logits, act_fn, scoring_fn,
                           w1_scale, w2_scale, b1, b2, subc_quant_w1_sz, subc_quant_w2_sz, t(w3), topk_weights,
                           topk_ids, floats, gate_up_interleaved)
    except ArgumentError as e:
        raise ArgumentError(f"{e} [transpose_rhs=True: w1 / w3 / w2 are taken as [..., N, K] and checked as their "
                            f"transposes [..., K, N]; the weight shapes above are those transposes]") from None


def _prepare_kn(tokens, w1, w2, gating_output, top_k, renormalize_topk_logits, act_fn, scoring_fn, w1_scale,
                w2_scale, b1, b2, subc_quant_w1_sz, subc_quant_w2_sz, w3, topk_weights, topk_ids, floats,
                gate_up_interleaved):
    """:func:`_prepare` on weights in the ``[.., K, N]`` layout."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ArgumentError(f"{_OP}: tokens must be a 2-D tensor [T, H], got {_shape(tokens)}")
    if tokens.dtype not in floats:
        raise DTypeError(f"{_OP}: tokens dtype {tokens.dtype} is not supported: use bfloat16 or float32")
    T, H = tokens.shape
    for name, w in (("w1", w1), ("w2", w2)) + ((("w3", w3),) if w3 is not None else ()):
        if not isinstance(w, torch.Tensor):
            raise ArgumentError(f"{_OP}: {name} must be a torch.Tensor, got {type(w).__name__}")
        _weight_dtype(name, w, floats)
    _need(w2.dim() == 3, f"w2 must be [E, I, H], got {_shape(w2)}")
    E, I, H2 = w2.shape
    _need(H2 == H, f"w2 must be [E, I, H] with H = tokens.shape[1] = {H}, got {_shape(w2)}")
    if act_fn not in ACT_FNS:
        raise ArgumentError(f"{_OP}: act_fn must be one of {ACT_FNS}, got {act_fn!r}")
    if scoring_fn not in SCORING_FNS:
        raise ArgumentError(f"{_OP}: scoring_fn must be one of {SCORING_FNS}, got {scoring_fn!r}")
    if not isinstance(renormalize_topk_logits, bool):
        raise ArgumentError(f"{_OP}: renormalize_topk_logits must be a bool, got {renormalize_topk_logits!r}")

    # routing input
    if gating_output is not None:
        _need(topk_ids is None and topk_weights is None,
              "pass gating_output (router logits) or topk_weights and topk_ids, not both")
        if not isinstance(gating_output, torch.Tensor) or gating_output.dim() != 2:
            raise ArgumentError(f"{_OP}: gating_output must be [T, E], got {_shape(gating_output)}")
        _need(tuple(gating_output.shape) == (T, E), f"gating_output must be [T, E] = [{T}, {E}] (E from w2), got "
              f"{_shape(gating_output)}")
        if gating_output.dtype not in floats + (torch.float16,):
            raise DTypeError(f"{_OP}: gating_output dtype {gating_output.dtype} is not bf16/f16/f32")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
            raise ArgumentError(f"{_OP}: top_k = {top_k!r} must be an int in [1, num_experts = {E}]")
        k = top_k
    else:
        _need(topk_ids is not None and topk_weights is not None,
              "pass gating_output (router logits), or both topk_weights and topk_ids")
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
            raise ArgumentError(f"{_OP}: topk_ids must be [T, k] with T = {T}, got {_shape(topk_ids)}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise DTypeError(f"{_OP}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
        k = int(topk_ids.shape[1])
        _need(1 <= k <= E, f"topk_ids has k = {k} columns; top_k must be in [1, num_experts = {E}]")
        _need(isinstance(topk_weights, torch.Tensor) and tuple(topk_weights.shape) == (T, k),
              f"topk_weights must be [T, k] = [{T}, {k}] like topk_ids, got {_shape(topk_weights)}")
        if not topk_weights.is_floating_point():
            raise DTypeError(f"{_OP}: topk_weights must be a float tensor, got {topk_weights.dtype}")
        if topk_ids.numel() and topk_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            _need(lo >= 0 and hi < E, f"topk_ids must be in [0, num_experts = {E}), got values in [{lo}, {hi}]")

    # gate / up weights -> grouped matmul specs [E, H, N]
    quant1 = w1.dtype in QUANT_DTYPES
    if w1.dim() == 4:
        _need(w3 is None, "w3 is only taken with a 3-D w1 [E, H, I] (w1 [E, 2, H, I] holds gate and up)")
        _need(tuple(w1.shape) == (E, 2, H, I), f"w1 must be [E, 2, H, I] = [{E}, 2, {H}, {I}] (E, I from w2), got "
              f"{_shape(w1)}")
        if b1 is not None:
            _need(isinstance(b1, torch.Tensor) and tuple(b1.shape) == (E, 2, 1, I),
                  f"b1 must be [E, 2, 1, I] = [{E}, 2, 1, {I}] with w1 [E, 2, H, I], got {_shape(b1)}")
        if quant1:
            s = w1_scale
            _need(isinstance(s, torch.Tensor) and s.dim() == 5 and s.shape[1] == 2,
                  f"w1_scale must be [E, 2, H // subc_quant_w1_sz, 1, I] with w1 [E, 2, H, I], got {_shape(s)}")
            scales = [_canon_scale("w1_scale", s[:, h], E, I, H, subc_quant_w1_sz, "subc_quant_w1_sz")
                      for h in range(2)]
        else:
            scales = [None, None]
        specs = [(w1[:, h], scales[h], None if b1 is None else b1[:, h]) for h in range(2)]
    elif w1.dim() == 3 and w3 is None:
        _need(tuple(w1.shape) == (E, H, 2 * I), f"w1 must be [E, H, 2I] = [{E}, {H}, {2 * I}] (fused gate-up; E, I "
              f"from w2) or [E, 2, H, I], got {_shape(w1)}")
        if b1 is not None:
            _need(isinstance(b1, torch.Tensor) and tuple(b1.shape) == (E, 1, 2 * I),
                  f"b1 must be [E, 1, 2I] = [{E}, 1, {2 * I}], got {_shape(b1)}")
        s = _canon_scale("w1_scale", w1_scale, E, 2 * I, H, subc_quant_w1_sz, "subc_quant_w1_sz") if quant1 else None
        specs = [(w1, s, b1)]
    elif w1.dim() == 3:
        _need(tuple(w1.shape) == (E, H, I), f"w1 must be [E, H, I] = [{E}, {H}, {I}] with w3 (E, I from w2), got "
              f"{_shape(w1)}")
        _need(tuple(w3.shape) == (E, H, I), f"w3 must be [E, H, I] = [{E}, {H}, {I}] like w1, got {_shape(w3)}")
        _need(w3.dtype == w1.dtype, f"w3 dtype {w3.dtype} must equal w1's {w1.dtype}")
        if quant1:
            raise ArgumentError(f"{_OP}: quantized w1 with a separate w3 is not supported: fuse them into w1 [E, H, "
                                f"2I] (or [E, 2, H, I]) with one w1_scale")
        if b1 is not None:
            _need(isinstance(b1, torch.Tensor) and tuple(b1.shape) == (E, 1, 2 * I),
                  f"b1 must be [E, 1, 2I] = [{E}, 1, {2 * I}] (gate bias, then up bias), got {_shape(b1)}")
        specs = [(w1, None, None if b1 is None else b1[..., :I]), (w3, None, None if b1 is None else b1[..., I:])]
    else:
        raise ArgumentError(f"{_OP}: w1 must be [E, 2, H, I], [E, H, 2I] or [E, H, I] (with w3), got {_shape(w1)}")
    _need(not gate_up_interleaved or len(specs) == 1, "gate_up_interleaved=True needs a fused gate-up w1 [E, H, "
          "2I] (gate in the even columns, up in the odd ones; gpt-oss), not a split w1 or a w3")
    if not quant1 and w1_scale is not None:
        raise ArgumentError(f"{_OP}: w1_scale given but w1 is {w1.dtype} (scales go with int8 / float8 weights)")
    if b2 is not None:
        _need(isinstance(b2, torch.Tensor) and tuple(b2.shape) == (E, 1, H),
              f"b2 must be [E, 1, H] = [{E}, 1, {H}], got {_shape(b2)}")
    for name, b in (("b1", b1), ("b2", b2)):
        if b is not None and b.dtype not in floats:
            raise DTypeError(f"{_OP}: {name} must be bfloat16 or float32, got {b.dtype}")
    quant2 = w2.dtype in QUANT_DTYPES
    s2 = _canon_scale("w2_scale", w2_scale, E, H, I, subc_quant_w2_sz, "subc_quant_w2_sz") if quant2 else None
    if not quant2 and w2_scale is not None:
        raise ArgumentError(f"{_OP}: w2_scale given but w2 is {w2.dtype} (scales go with int8 / float8 weights)")
    devs = {t.device for t in (tokens, w1, w2, w3, gating_output, topk_ids, topk_weights, w1_scale, w2_scale, b1, b2)
            if isinstance(t, torch.Tensor)}
    if len(devs) > 1:
        from ..errors import DeviceError

        raise DeviceError(f"{_OP}: all tensors must be on one device, got {sorted(str(d) for d in devs)}")
    return E, H, I, k, specs, (w2, s2, b2)


def _route(gating_output, top_k, renormalize, scoring_fn):
    from .moe_routing import sigmoid_topk, softmax_topk

    if scoring_fn == "softmax":
        w, ids = softmax_topk(gating_output, top_k, renormalize=renormalize)
    else:
        w, ids = sigmoid_topk(gating_output, top_k, renormalize=renormalize)
    if gating_output.requires_grad and torch.is_grad_enabled():
        # the router kernel has no backward: the same weights from its ids, differentiable in the logits
        lg = gating_output.float()
        w = (torch.softmax(lg, -1).gather(1, ids) if scoring_fn == "softmax"
             else torch.sigmoid(lg.gather(1, ids)))
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
    return w, ids


def _mm(a, spec, sizes, transpose_rhs, out_dtype):
    """One grouped matmul ``a @ w[g] (+ bias[g])`` in ``out_dtype`` (float32 accumulation; ``w`` a ``[E, K, N]``
    view; with ``transpose_rhs`` the kernel reads the ``[E, N, K]`` weight it views, no copy)."""
    from .grouped_matmul_ops import grouped_matmul
    from .grouped_matmul_ops.quant import grouped_matmul_quantized

    w, scale, bias = spec
    if transpose_rhs:
        w = w.transpose(-1, -2)
    if scale is not None:
        return grouped_matmul_quantized(a, w, sizes, scale, out_dtype=out_dtype, rhs_bias=bias,
                                        transpose_rhs=transpose_rhs)
    return grouped_matmul(a, w, sizes, out_dtype=out_dtype, rhs_bias=bias, transpose_rhs=transpose_rhs)


#: fused_moe's act_fn -> the gated_activation kernel's activation name
_ACT = {"silu": "silu", "gelu": "gelu_tanh"}


def reads_halves(n_outputs: int, I, interleaved) -> bool:
    """The activation can read one fused ``[M, 2 I]`` gate/up output in place (``gated_activation_fwd``
    ``halves=True``: no split copies): ``n_outputs`` gate/up matmul outputs, one, gate then up (not interleaved),
    ``I`` a multiple of 128."""
    return n_outputs == 1 and not interleaved and I % 128 == 0


def split_gate_up(outs, I, interleaved):
    """(gate, up) from the gate / up matmuls' outputs: two outputs, or one ``[.., 2I]`` split in halves or, with
    ``interleaved``, into its even (gate) and odd (up) columns."""
    if len(outs) == 2:
        return outs
    if interleaved:
        return outs[0][..., 0::2], outs[0][..., 1::2]
    return outs[0][..., :I], outs[0][..., I:]


def _swigluoai(gate, up, alpha, limit):
    g = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1.0) * (g * torch.sigmoid(alpha * g))


def swigluoai_jnp(gate, up, alpha, limit):
    """gpt-oss's clamped SwiGLU on jax arrays (:func:`fused_moe_jax`; the MoE bench family's XLA programs)."""
    import jax
    import jax.numpy as jnp

    g = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1.0) * (g * jax.nn.sigmoid(alpha * g))


def _fused_moe_impl(tokens, w1, w2, gating_output=None, top_k=2, renormalize_topk_logits=False, act_fn="silu",
                    scoring_fn="softmax", w1_scale=None, w2_scale=None, b1=None, b2=None, subc_quant_w1_sz=None,
                    subc_quant_w2_sz=None, w3=None, topk_weights=None, topk_ids=None, swigluoai_alpha=1.702,
                    swigluoai_limit=7.0, transpose_rhs=False, gate_up_interleaved=False):
    from .gated_mlp import gated_activation
    from .moe_routing import moe_combine, moe_permute

    E, H, I, k, specs, down = _prepare(tokens, w1, w2, gating_output, top_k, renormalize_topk_logits, act_fn,
                                       scoring_fn, w1_scale, w2_scale, b1, b2, subc_quant_w1_sz, subc_quant_w2_sz,
                                       w3, topk_weights, topk_ids, transpose_rhs=transpose_rhs,
                                       gate_up_interleaved=gate_up_interleaved)
    T = tokens.shape[0]
    if gating_output is not None:
        weights, ids = _route(gating_output, k, renormalize_topk_logits, scoring_fn)
    else:
        weights, ids = topk_weights, topk_ids
    if T == 0:  # no tokens: no kernel launches (an empty [0, H] result, still on tokens' autograd graph)
        return tokens[:0].clone()
    xs, sizes, meta = moe_permute(tokens, ids, E)
    outs = [_mm(xs, s, sizes, transpose_rhs, tokens.dtype) for s in specs]  # intermediates in tokens' dtype
    w2_, s2, _ = down
    h_dtype = tokens.dtype if s2 is not None else w2_.dtype
    if act_fn == "swigluoai":
        gate, up = split_gate_up(outs, I, gate_up_interleaved)
        h = _swigluoai(gate.float(), up.float(), float(swigluoai_alpha), float(swigluoai_limit)).to(h_dtype)
    elif reads_halves(len(outs), I, gate_up_interleaved):  # the activation reads the fused output's halves in place
        h = torch.ops.tpukernels.gated_activation_fwd(outs[0], outs[0], _ACT[act_fn], True,
                                                      str(h_dtype).removeprefix("torch."))
    else:
        gate, up = split_gate_up(outs, I, gate_up_interleaved)
        h = gated_activation(gate.contiguous(), up.contiguous(), _ACT[act_fn]).to(h_dtype)
    y = _mm(h, down, sizes, transpose_rhs, tokens.dtype)
    return moe_combine(y, weights, meta)


_LIB = torch.library.Library("tpukernels", "FRAGMENT")
_LIB.define("fused_moe(Tensor tokens, Tensor w1, Tensor w2, Tensor? gating_output=None, int top_k=2, "
            "bool renormalize_topk_logits=False, str act_fn='silu', str scoring_fn='softmax', "
            "Tensor? w1_scale=None, Tensor? w2_scale=None, Tensor? b1=None, Tensor? b2=None, "
            "int? subc_quant_w1_sz=None, int? subc_quant_w2_sz=None, Tensor? w3=None, Tensor? topk_weights=None, "
            "Tensor? topk_ids=None, float swigluoai_alpha=1.702, float swigluoai_limit=7.0, bool transpose_rhs=False, "
            "bool gate_up_interleaved=False) -> Tensor")
_LIB.impl("fused_moe", _fused_moe_impl, "CompositeImplicitAutograd")


def fused_moe(tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gating_output: Optional[torch.Tensor] = None,
              top_k: int = 2, *, renormalize_topk_logits: bool = False, act_fn: str = "silu",
              scoring_fn: str = "softmax", w1_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None, b1: Optional[torch.Tensor] = None,
              b2: Optional[torch.Tensor] = None, subc_quant_w1_sz: Optional[int] = None,
              subc_quant_w2_sz: Optional[int] = None, w3: Optional[torch.Tensor] = None,
              topk_weights: Optional[torch.Tensor] = None, topk_ids: Optional[torch.Tensor] = None,
              swigluoai_alpha: float = 1.702, swigluoai_limit: float = 7.0, transpose_rhs: bool = False,
              gate_up_interleaved: bool = False) -> torch.Tensor:
    """A whole MoE expert layer, dropless (module docstring: semantics, layouts, what runs, gaps).

    Args:
        tokens: ``[T, H]`` bfloat16 / float32 hidden states.
        w1: gate and up weights: ``[E, 2, H, I]`` (tpu-inference), ``[E, H, 2I]`` (tokamax, fused gate-up), or
            ``[E, H, I]`` gate with ``w3 [E, H, I]`` up. bfloat16 / float32, or int8 / float8 with ``w1_scale``.
        w2: ``[E, I, H]`` down weights (same dtypes; quantized with ``w2_scale``).
        gating_output: ``[T, E]`` router logits (bf16/f16/f32), or None with ``topk_weights`` / ``topk_ids``.
        top_k: experts per token, ``1 <= top_k <= E`` (ignored with ``topk_ids``: its column count).
        renormalize_topk_logits: divide the k weights by their sum.
        act_fn: ``"silu"``, ``"gelu"`` (tanh approximation) or ``"swigluoai"`` (gpt-oss clamped SwiGLU).
        scoring_fn: ``"softmax"`` or ``"sigmoid"`` over the logits (selection is on the scores' order).
        w1_scale, w2_scale: float32 scales of quantized weights (module docstring for the layouts).
        b1: gate/up biases, ``[E, 2, 1, I]`` with a 4-D ``w1``, else ``[E, 1, 2I]`` (gate, then up). b2: ``[E, 1, H]``.
        subc_quant_w1_sz, subc_quant_w2_sz: optional block sizes of the scales (checked against them).
        w3: ``[E, H, I]`` up weights with a 3-D ``[E, H, I]`` ``w1`` (float only).
        topk_weights: ``[T, k]`` float routing weights; topk_ids: ``[T, k]`` int32/int64 in ``[0, E)``.
        swigluoai_alpha, swigluoai_limit: ``"swigluoai"``'s constants.
        transpose_rhs: the expert weights are stored ``[..., out, in]`` (``nn.Linear`` / HF experts): ``w1 [E, 2I,
            H]`` / ``[E, 2, I, H]`` / ``[E, I, H]`` with ``w3 [E, I, H]``, ``w2 [E, H, I]``; scales and biases keep
            their layouts. The grouped matmuls read them as stored (no transposed copy).
        gate_up_interleaved: a fused gate-up ``w1`` (and ``b1``) holds gate in its even columns and up in its odd
            ones (HF gpt-oss) instead of gate, then up.

    Returns:
        ``[T, H]`` in ``tokens.dtype``. Differentiable in tokens, float weights, biases, ``gating_output`` (or
        ``topk_weights``); quantized weights and their scales get no gradient.

    Raises:
        ArgumentError: shapes (logits not ``[T, E]``, weights / biases / scales not matching ``E, H, I``), top_k
            outside ``[1, E]``, ids outside ``[0, E)`` (cpu tensors), unknown ``act_fn`` / ``scoring_fn``, both or
            neither routing inputs, a scale with float weights or none with quantized ones.
        DTypeError: unsupported dtypes. DeviceError: tensors on several devices.
    """
    return torch.ops.tpukernels.fused_moe(tokens, w1, w2, gating_output, top_k, renormalize_topk_logits, act_fn,
                                          scoring_fn, w1_scale, w2_scale, b1, b2, subc_quant_w1_sz, subc_quant_w2_sz,
                                          w3, topk_weights, topk_ids, float(swigluoai_alpha), float(swigluoai_limit),
                                          transpose_rhs, gate_up_interleaved)


# ----------------------------------------------------------------------------------------- JAX entry
def _meta_like(a):
    """A torch meta tensor of jax array ``a``'s shape and dtype (for :func:`_prepare`'s checks), or None."""
    if a is None:
        return None
    import numpy as np

    return torch.empty(tuple(a.shape), dtype=getattr(torch, np.dtype(a.dtype).name), device="meta")


def fused_moe_jax(tokens, w1, w2, gating_output=None, top_k: int = 2, *, renormalize_topk_logits: bool = False,
                  act_fn: str = "silu", scoring_fn: str = "softmax", b1=None, b2=None, w3=None, topk_weights=None,
                  topk_ids=None, swigluoai_alpha: float = 1.702, swigluoai_limit: float = 7.0,
                  transpose_rhs: bool = False, gate_up_interleaved: bool = False, interpret=None):
    """:func:`fused_moe` on jax arrays (trace-safe), **forward only** and **float weights only** (bf16 / f32):
    ``softmax_topk_jax`` / ``sigmoid_topk_jax``, ``moe_permute_jax``, the ``grouped_matmul_fwd`` kernel (float32
    out) through ``jax_call``, the activation (``gated_activation_fwd`` kernel; ``"swigluoai"`` in jnp), the down
    ``grouped_matmul_fwd``, ``moe_combine_jax``; ``[T, H]`` in tokens' dtype. Same arguments, layouts and checks
    as :func:`fused_moe` (ids checked when concrete). Gaps: ``jax.grad`` (the grouped matmul has no jax backward
    here), quantized experts (the torch entry has them)."""
    import jax
    import jax.numpy as jnp

    from ..targets.jax_entry import jax_call
    from .gated_mlp import gated_activation_fwd
    from .grouped_matmul_ops import grouped_matmul_fwd
    from .moe_routing import moe_combine_jax, moe_permute_jax, sigmoid_topk_jax, softmax_topk_jax

    m = {n: _meta_like(a) for n, a in dict(tokens=tokens, w1=w1, w2=w2, gating_output=gating_output, b1=b1, b2=b2,
                                             w3=w3, topk_weights=topk_weights, topk_ids=topk_ids).items()}
    for n in ("w1", "w2", "w3"):
        if m[n] is not None and m[n].dtype in QUANT_DTYPES:
            raise DTypeError(f"{_OP}_jax: {n} dtype {m[n].dtype}: quantized experts are not supported by the jax entry "
                             f"(use fused_moe on torch tensors)")
    E, H, I, k, _, _ = _prepare(m["tokens"], m["w1"], m["w2"], m["gating_output"], top_k, renormalize_topk_logits,
                                act_fn, scoring_fn, None, None, m["b1"], m["b2"], None, None, m["w3"],
                                m["topk_weights"], m["topk_ids"], transpose_rhs=transpose_rhs,
                                gate_up_interleaved=gate_up_interleaved)
    if topk_ids is not None and not isinstance(topk_ids, jax.core.Tracer) and topk_ids.size:
        lo, hi = int(jnp.min(topk_ids)), int(jnp.max(topk_ids))
        _need(lo >= 0 and hi < E, f"topk_ids must be in [0, num_experts = {E}), got values in [{lo}, {hi}]")
    T = tokens.shape[0]
    if T == 0:
        return jnp.zeros((0, H), tokens.dtype)
    if gating_output is not None:
        route = softmax_topk_jax if scoring_fn == "softmax" else sigmoid_topk_jax
        weights, ids = route(gating_output, k, renormalize=renormalize_topk_logits, interpret=interpret)
    else:
        weights, ids = topk_weights, topk_ids
    if w1.ndim == 4:  # [E, 2, H, I] (transpose_rhs: [E, 2, I, H])
        specs = [(w1[:, h], None if b1 is None else b1[:, h]) for h in range(2)]
    elif w3 is None:
        specs = [(w1, b1)]
    else:
        specs = [(w1, None if b1 is None else b1[..., :I]), (w3, None if b1 is None else b1[..., I:])]
    xs, sizes, meta = moe_permute_jax(tokens, ids, E, interpret=interpret)
    go = jnp.zeros((1,), jnp.int32)
    inter = jnp.dtype(tokens.dtype).name  # the matmuls' outputs (float32 accumulation) in tokens' dtype

    def mm(a, w, b):
        if a.dtype != w.dtype:  # the torch op's rule: a bfloat16 operand beside a float32 one is widened
            a, w = a.astype(jnp.float32), w.astype(jnp.float32)
        if b is not None and b.dtype != w.dtype:
            b = b.astype(w.dtype)
        return jax_call(grouped_matmul_fwd, sizes, go, a, w, b, transpose_rhs, inter, interpret=interpret)

    outs = [mm(xs, w, b) for w, b in specs]
    h_dtype = jnp.dtype(w2.dtype).name
    if act_fn == "swigluoai":
        gate, up = split_gate_up(outs, I, gate_up_interleaved)
        h = swigluoai_jnp(gate.astype(jnp.float32), up.astype(jnp.float32), swigluoai_alpha,
                          swigluoai_limit).astype(w2.dtype)
    elif reads_halves(len(outs), I, gate_up_interleaved):  # the activation reads the fused output's halves in place
        h = jax_call(gated_activation_fwd, outs[0], outs[0], _ACT[act_fn], True, h_dtype, interpret=interpret)
    else:
        gate, up = split_gate_up(outs, I, gate_up_interleaved)
        h = jax_call(gated_activation_fwd, gate, up, _ACT[act_fn], False, h_dtype, interpret=interpret)
    y = mm(h, w2, b2)
    return moe_combine_jax(y, weights, meta, interpret=interpret)


# ----------------------------------------------------------------------------------------- float64 reference
def _act64(act_fn, gate, up, alpha, limit):
    if act_fn == "silu":
        return torch.nn.functional.silu(gate) * up
    if act_fn == "gelu":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    return _swigluoai(gate, up, alpha, limit)


def _deq(w, s):
    """float64 ``[E, K, N]`` of a (possibly quantized) ``[E, K, N]`` weight with a ``[E, nb, 1, N]`` scale."""
    w = w.double()
    if s is None:
        return w
    E, K, N = w.shape
    return w * s.double()[:, :, 0, :].repeat_interleave(K // s.shape[1], dim=1)


def fused_moe_reference(tokens, w1, w2, gating_output=None, top_k=2, *, renormalize_topk_logits=False, act_fn="silu",
                        scoring_fn="softmax", w1_scale=None, w2_scale=None, b1=None, b2=None, subc_quant_w1_sz=None,
                        subc_quant_w2_sz=None, w3=None, topk_weights=None, topk_ids=None, swigluoai_alpha=1.702,
                        swigluoai_limit=7.0, transpose_rhs=False, gate_up_interleaved=False):
    """float64 :func:`fused_moe` by its definition: the router in float64 (top-k of the logits, ties to the
    lower id), then per token a loop over its selected experts (dequantized weights). Differentiable in float64
    (torch ops). Same arguments and checks as :func:`fused_moe`; returns float64 ``[T, H]``."""
    E, H, I, k, specs, down = _prepare(tokens, w1, w2, gating_output, top_k, renormalize_topk_logits, act_fn,
                                       scoring_fn, w1_scale, w2_scale, b1, b2, subc_quant_w1_sz, subc_quant_w2_sz,
                                       w3, topk_weights, topk_ids, floats=_FLOATS + (torch.float64,),
                                       transpose_rhs=transpose_rhs, gate_up_interleaved=gate_up_interleaved)
    if gating_output is not None:
        lg = gating_output.double()
        order = torch.sort(-lg, dim=-1, stable=True).indices[:, :k]
        p = torch.softmax(lg, -1) if scoring_fn == "softmax" else torch.sigmoid(lg)
        wts = p.gather(1, order)
        if renormalize_topk_logits:
            wts = wts / wts.sum(-1, keepdim=True)
        ids = order
    else:
        wts, ids = topk_weights.double(), topk_ids.long()
    mats = [(_deq(w, s), None if b is None else b.double()) for w, s, b in specs]
    W2, B2 = _deq(down[0], down[1]), None if down[2] is None else down[2].double()
    x = tokens.double()
    rows = []
    for t in range(x.shape[0]):
        acc = x.new_zeros(H)
        for j in range(k):
            e = int(ids[t, j])
            outs = [x[t] @ W[e] + (0 if b is None else b[e, 0]) for W, b in mats]
            gate, up = split_gate_up(outs, I, gate_up_interleaved)
            h = _act64(act_fn, gate, up, float(swigluoai_alpha), float(swigluoai_limit))
            acc = acc + wts[t, j] * (h @ W2[e] + (0 if B2 is None else B2[e, 0]))
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, H)
