"""Router top-k of MoE blocks: softmax or sigmoid scores, top-k experts per token, optional renormalisation, and
DeepSeek-V3's grouped top-k with its score-correction bias, fused in one kernel per row block.

Public API (``router_logits [T, E]`` bf16/f16/f32; every function returns ``(weights float32 [T, k],
expert_ids int64 [T, k])``, sorted by the selection score descending, equal scores by ascending expert id)::

    softmax_topk(router_logits, top_k, *, renormalize=False, softmax_over="all", num_experts=None)
    sigmoid_topk(router_logits, top_k, *, renormalize=False, num_experts=None)
    grouped_topk(router_logits, top_k, *, n_group, topk_group, e_score_correction_bias=None,
                 routed_scaling_factor=1.0, norm_topk_prob=True, num_experts=None)
    softmax_topk_jax / sigmoid_topk_jax / grouped_topk_jax(...)     the same on jax arrays (expert_ids int32)
    router_topk_reference(router_logits, top_k, mode, ...)           float64 reference
    torch.ops.tpukernels.router_topk_fwd(logits, bias, top_k, mode, renormalize, n_group, topk_group, scale)

Semantics (transformers 5.24; ``l`` = router_logits in float32):

* ``softmax_topk(softmax_over="all")`` (Mixtral ``MixtralTopKRouter``: ``renormalize=True``; Qwen2/3-MoE
  ``Qwen3MoeTopKRouter``: ``renormalize=config.norm_topk_prob``): ``p = softmax(l)``, the k largest p, with
  ``renormalize`` divided by their sum.
* ``softmax_topk(softmax_over="selected")`` (gpt-oss ``GptOssTopKRouter``): the k largest logits, then a softmax
  over those k only (``renormalize`` changes nothing there: the weights already sum to 1). In exact arithmetic
  this is ``softmax_over="all", renormalize=True`` (both are ``exp(l_j) / sum over the selected of exp(l)``);
  the two differ by rounding only (and gpt-oss rounds to the logits' dtype).
* ``sigmoid_topk`` (Llama-4 ``Llama4Router``: ``sigmoid(topk(l))``): the k largest logits, weights
  ``sigmoid`` of them, with ``renormalize`` divided by their sum.
* ``grouped_topk`` (DeepSeek-V3 ``DeepseekV3TopkRouter.forward``): ``s = sigmoid(l)``, selection scores
  ``c = s + e_score_correction_bias``; the E experts form ``n_group`` contiguous groups, a group's score is the
  sum of its two largest ``c``; the ``topk_group`` best groups stay (others masked to ``-inf``, as
  transformers does); the k largest ``c`` among them are the experts; their weights are the unbiased
  ``s`` (``/ (sum + 1e-20)`` with ``norm_topk_prob``), times ``routed_scaling_factor``.

Selection is on the logits for the softmax / sigmoid forms (the same order as the probabilities in exact
arithmetic; transformers selects on float32 probabilities, where two logits closer than float32's resolution
of exp may round to equal probabilities and then tie by index: a difference only at such near-ties), and on
``c`` for the grouped form. Ties: the lowest expert id first (``jax.lax.top_k``'s order and that of a stable
descending sort; ``torch.topk`` on cpu does not promise one: it was seen putting the higher index first). NaN
logits rank above every number (as ``torch.topk``); a row never reads another row. Weights are float32
(Mixtral's and DeepSeek's routers return float32; Qwen3-MoE and gpt-oss cast to the logits' dtype: do
``weights.to(logits.dtype)``; gpt-oss computes its softmax in that dtype, ours in float32). The grouped form's
transformers code uses ``topk(sorted=False)``, so its id order is unspecified there; ours is sorted.

Design. One kernel, ``tpukernels::router_topk_fwd``: grid ``cdiv(T, block_rows)``, a row block holds all E
experts on lanes (E is the whole last dim), the scoring, group scores (a masked max / first index / masked max
per group), group selection and expert selection
(:func:`~tpukernels.library.moe_routing.common.select_topk`) and the weights in float32 in VMEM; outputs are
``[T, Kp]`` float32 weights and int32 ids (``Kp`` = k rounded up to 128 lanes, sliced to k outside). One read
of the logits, ``k`` (+ ``2 * n_group + topk_group``) reductions per row.

Gaps: DeepSeek-V2's grouped softmax form (``group_limited_greedy`` with a max group score) and scoring
functions other than sigmoid in ``grouped_topk``; groups of one expert (transformers' top-2 per group
needs two: a typed error).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl

from ... import dsl as tk
from ...chips import MiB
from ...errors import ArgumentError, DTypeError
from .common import F32, NO_INDEX, check_k, check_same_device, check_scores, column_index, padded_k, select_topk

__all__ = ["softmax_topk", "sigmoid_topk", "grouped_topk", "softmax_topk_jax", "sigmoid_topk_jax",
           "grouped_topk_jax", "router_topk_fwd", "router_topk_reference", "MODES", "SOFTMAX_OVER",
           "BLOCK_ROWS", "VMEM_BUDGET_BYTES"]

NAMESPACE = "tpukernels"
#: kernel modes: softmax over all experts then top-k; top-k then softmax over the selected; sigmoid; grouped
MODES = ("softmax", "softmax_selected", "sigmoid", "grouped")
#: ``softmax_over`` values of :func:`softmax_topk`
SOFTMAX_OVER = ("all", "selected")
BLOCK_ROWS = (8, 16, 32, 64, 128, 256, 512)
VMEM_BUDGET_BYTES = 12 * MiB


# ----------------------------------------------------------------------------------------- kernel body
def _router_body(*refs, k: int, mode: str, renormalize: bool, n_group: int, topk_group: int, scale: float,
                 has_bias: bool, experts: int):
    it = iter(refs)
    l_ref = next(it)
    b_ref = next(it) if has_bias else None
    w_ref, i_ref = next(it), next(it)
    l = l_ref[...].astype(F32)  # (bt, E)
    bt, e = l.shape
    width = w_ref.shape[1]
    gidx = column_index((bt, e))
    if mode == "grouped":
        s = jax.nn.sigmoid(l)
        ch = s + b_ref[...].astype(F32) if has_bias else s
        gs = experts // n_group
        # group score: the sum of the group's two largest choice scores (the first max retired by index)
        gcol = column_index((bt, LANES_G))
        gscore = jnp.full((bt, LANES_G), -jnp.inf, F32)
        inside = []
        for g in range(n_group):
            ins = (gidx >= g * gs) & (gidx < (g + 1) * gs)
            inside.append(ins)
            m1 = jnp.max(jnp.where(ins, ch, -jnp.inf), axis=-1, keepdims=True)
            i1 = jnp.min(jnp.where(ins & (ch == m1), gidx, NO_INDEX), axis=-1, keepdims=True)
            m2 = jnp.max(jnp.where(ins & (gidx != i1), ch, -jnp.inf), axis=-1, keepdims=True)
            gscore = jnp.where(gcol == g, m1 + m2, gscore)
        _, gsel = select_topk([(gscore, jnp.where(gcol < n_group, gcol, NO_INDEX))], topk_group, LANES_G)
        gcol_sel = column_index((bt, LANES_G))
        allowed = jnp.zeros((bt, e), jnp.bool_)
        for g in range(n_group):
            picked = jnp.max(jnp.where((gsel == g) & (gcol_sel < topk_group), 1.0, 0.0), axis=-1,
                             keepdims=True) > 0.0
            allowed = allowed | (inside[g] & picked)
        _, ids = select_topk([(ch, jnp.where(allowed, gidx, NO_INDEX))], k, width)
        # weights: the unbiased sigmoid score of each chosen expert (a select per output lane)
        w = jnp.zeros((bt, width), F32)
        ocol = jax.lax.broadcasted_iota(jnp.int32, (bt, width), 1)
        for j in range(k):
            sj = jnp.sum(jnp.where(gidx == ids[:, j:j + 1], s, 0.0), axis=-1, keepdims=True)
            w = jnp.where(ocol == j, sj, w)
        if renormalize:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        w = w * scale
    else:
        vals, ids = select_topk([(l, gidx)], k, width)
        ocol = jax.lax.broadcasted_iota(jnp.int32, (bt, width), 1)
        real = ocol < k
        if mode == "sigmoid":
            w = jnp.where(real, jax.nn.sigmoid(vals), 0.0)
        else:
            m = vals[:, 0:1]  # the row max (the first selected logit)
            num = jnp.where(real, jnp.exp(vals - m), 0.0)
            if mode == "softmax":
                den = jnp.sum(jnp.exp(l - m), axis=-1, keepdims=True)
            else:  # softmax over the selected
                den = jnp.sum(num, axis=-1, keepdims=True)
            w = num / den
        if renormalize and mode != "softmax_selected":
            w = w / jnp.sum(w, axis=-1, keepdims=True)
    w_ref[...] = w
    i_ref[...] = ids.astype(jnp.int32)


LANES_G = 128  # lanes of the group-score array (n_group <= 128)


# ----------------------------------------------------------------------------------------- kernel
def _per_row_bytes(e: int, itemsize: int) -> int:
    ep = -(-e // 128) * 128
    return 2 * ep * itemsize + 10 * 4 * ep + 4 * 2 * 128 * 4


def fit_rows(block_rows: int, t: int, e: int, itemsize: int) -> int:
    br = int(block_rows)
    while br > 8 and br * _per_row_bytes(e, itemsize) > VMEM_BUDGET_BYTES:
        br //= 2
    return int(t) if 0 < t <= br else br


def _heuristic(logits, bias, k, mode, *_, **__):
    per = _per_row_bytes(int(logits.shape[1]), np.dtype(logits.dtype).itemsize)
    br = 8
    for b in BLOCK_ROWS:
        if b * per <= VMEM_BUDGET_BYTES // 2:
            br = b
    return {"block_rows": min(br, 256)}


def _check_kernel(logits, bias, k, mode, renormalize, n_group, topk_group):
    op = f"{NAMESPACE}::router_topk_fwd"
    if len(logits.shape) != 2:
        raise ArgumentError(f"{op}: logits must be [T, E], got {tuple(logits.shape)}")
    if np.dtype(logits.dtype).name not in ("bfloat16", "float32"):
        raise DTypeError(f"{op}: logits has dtype {np.dtype(logits.dtype).name}: use bfloat16 or float32")
    e = int(logits.shape[1])
    if mode not in MODES:
        raise ArgumentError(f"{op}: mode must be one of {MODES}, got {mode!r}")
    if mode == "grouped":
        _check_groups(op, e, k, n_group, topk_group)
        if bias is not None and tuple(bias.shape) != (1, e):
            raise ArgumentError(f"{op}: bias must be [1, E] = [1, {e}], got {tuple(bias.shape)}")
    elif bias is not None:
        raise ArgumentError(f"{op}: bias is only for mode 'grouped'")
    check_k(op, "top_k", k, e)


def _check_groups(op, e, k, n_group, topk_group):
    for name, v in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"{op}: {name} must be a positive int, got {v!r}")
    if n_group > LANES_G:
        raise ArgumentError(f"{op}: n_group = {n_group}; at most {LANES_G} groups are supported")
    if e % n_group:
        raise ArgumentError(f"{op}: n_group = {n_group} must divide num_experts = {e}")
    if e // n_group < 2:
        raise ArgumentError(f"{op}: each group needs at least 2 experts (its score is the sum of its top 2, as "
                            f"transformers' DeepseekV3TopkRouter), got num_experts / n_group = {e // n_group}")
    if topk_group > n_group:
        raise ArgumentError(f"{op}: topk_group = {topk_group} must be <= n_group = {n_group}")
    if not 1 <= k <= topk_group * (e // n_group):
        raise ArgumentError(f"{op}: top_k = {k} must be in [1, topk_group * experts per group = "
                            f"{topk_group * (e // n_group)}] (the experts of the kept groups)")


@tk.tpu_kernel(
    _router_body, name="router_topk_fwd", namespace=NAMESPACE, heuristic=_heuristic,
    tunables={"block_rows": tk.Tunable(BLOCK_ROWS, default=128, doc="tokens per grid step (upper bound)")},
    out_shape=lambda logits, bias, k, *_, **__: (tk.OutSpec((logits.shape[0], padded_k(k)), jnp.float32),
                                                 tk.OutSpec((logits.shape[0], padded_k(k)), jnp.int32)),
)
def router_topk_fwd(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, mode: str, renormalize: bool,
                    n_group: int = 1, topk_group: int = 1, scale: float = 1.0,
                    *, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router top-k kernel (internal op; use :func:`softmax_topk`, :func:`sigmoid_topk`, :func:`grouped_topk`):
    ``logits [T, E]`` bf16/f32, ``bias [1, E]`` (mode ``"grouped"`` only) -> float32 weights and int32 expert ids
    ``[T, Kp]`` (columns ``>= k`` are padding). ``mode`` in :data:`MODES` (module docstring)."""
    _check_kernel(logits, bias, k, mode, renormalize, n_group, topk_group)
    t, e = logits.shape
    kp = padded_k(k)
    br = fit_rows(block_rows, t, e, np.dtype(logits.dtype).itemsize)
    out = pl.BlockSpec((br, kp), lambda i: (i, 0))
    in_specs = [pl.BlockSpec((br, e), lambda i: (i, 0))]
    if bias is not None:
        in_specs.append(pl.BlockSpec((1, e), lambda i: (0, 0)))
    return tk.Launch(
        grid=(tk.cdiv(t, br),),
        in_specs=in_specs,
        out_specs=[out, out],
        out_shape=(tk.OutSpec((t, kp), jnp.float32), tk.OutSpec((t, kp), jnp.int32)),
        dimension_semantics=("parallel",),
        body_kwargs={"k": int(k), "renormalize": bool(renormalize), "has_bias": bias is not None,
                     "experts": int(e), "n_group": int(n_group), "topk_group": int(topk_group),
                     "scale": float(scale)},
        cost_estimate=pl.CostEstimate(flops=int(10 * (k + 2 * n_group) * t * e), transcendentals=int(t * e),
                                      bytes_accessed=int(t * e * np.dtype(logits.dtype).itemsize + 8 * t * kp)),
    )


# ----------------------------------------------------------------------------------------- public ops
def _widen(t):
    return t.float() if t is not None and t.dtype == torch.float16 else t


def _run(logits, bias, k, mode, renormalize, n_group=1, topk_group=1, scale=1.0):
    t = logits.shape[0]
    if t == 0:
        return (torch.empty(0, k, dtype=torch.float32, device=logits.device),
                torch.empty(0, k, dtype=torch.int64, device=logits.device))
    b = None if bias is None else bias.float().reshape(1, -1).contiguous()
    w, i = torch.ops.tpukernels.router_topk_fwd(_widen(logits).contiguous(), b, k, mode, renormalize, n_group,
                                                topk_group, scale)
    return w[:, :k], i[:, :k].long()


def _check_common(op, logits, top_k, num_experts, renormalize):
    _, e = check_scores(op, "router_logits", logits, num_experts)
    if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, int)):
        raise ArgumentError(f"{op}: num_experts must be an int or None, got {num_experts!r}")
    if not isinstance(renormalize, bool):
        raise ArgumentError(f"{op}: renormalize must be a bool, got {renormalize!r}")
    return check_k(op, "top_k", top_k, e)


def _softmax_impl(router_logits, top_k, renormalize=False, softmax_over="all", num_experts=None):
    op = "tpukernels.softmax_topk"
    k = _check_common(op, router_logits, top_k, num_experts, renormalize)
    if softmax_over not in SOFTMAX_OVER:
        raise ArgumentError(f"{op}: softmax_over must be 'all' (softmax, then top-k: Mixtral, Qwen-MoE) or "
                            f"'selected' (top-k, then softmax over the k: gpt-oss), got {softmax_over!r}")
    return _run(router_logits, None, k, "softmax" if softmax_over == "all" else "softmax_selected", renormalize)


def _sigmoid_impl(router_logits, top_k, renormalize=False, num_experts=None):
    op = "tpukernels.sigmoid_topk"
    k = _check_common(op, router_logits, top_k, num_experts, renormalize)
    return _run(router_logits, None, k, "sigmoid", renormalize)


def _grouped_impl(router_logits, top_k, n_group, topk_group, e_score_correction_bias=None,
                  routed_scaling_factor=1.0, norm_topk_prob=True, num_experts=None):
    op = "tpukernels.grouped_topk"
    _, e = check_scores(op, "router_logits", router_logits, num_experts)
    if not isinstance(norm_topk_prob, bool):
        raise ArgumentError(f"{op}: norm_topk_prob must be a bool, got {norm_topk_prob!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1 or top_k > e:
        raise ArgumentError(f"{op}: top_k = {top_k!r} must be an int in [1, num_experts = {e}]")
    _check_groups(op, e, top_k, n_group, topk_group)
    b = e_score_correction_bias
    if b is not None:
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (e,):
            raise ArgumentError(f"{op}: e_score_correction_bias must be a tensor [num_experts] = [{e}], got "
                                f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
        if not b.is_floating_point():
            raise DTypeError(f"{op}: e_score_correction_bias must be a float tensor, got {b.dtype}")
        check_same_device(op, "router_logits", router_logits, e_score_correction_bias=b)
    return _run(router_logits, b, top_k, "grouped", norm_topk_prob, n_group, topk_group,
                float(routed_scaling_factor))


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("softmax_topk(Tensor router_logits, int top_k, bool renormalize=False, str softmax_over='all', "
            "int? num_experts=None) -> (Tensor, Tensor)")
_LIB.impl("softmax_topk", _softmax_impl, "CompositeImplicitAutograd")
_LIB.define("sigmoid_topk(Tensor router_logits, int top_k, bool renormalize=False, int? num_experts=None) "
            "-> (Tensor, Tensor)")
_LIB.impl("sigmoid_topk", _sigmoid_impl, "CompositeImplicitAutograd")
_LIB.define("grouped_topk(Tensor router_logits, int top_k, int n_group, int topk_group, "
            "Tensor? e_score_correction_bias=None, float routed_scaling_factor=1.0, bool norm_topk_prob=True, "
            "int? num_experts=None) -> (Tensor, Tensor)")
_LIB.impl("grouped_topk", _grouped_impl, "CompositeImplicitAutograd")


def softmax_topk(router_logits: torch.Tensor, top_k: int, *, renormalize: bool = False, softmax_over: str = "all",
                 num_experts: Optional[int] = None):
    """Softmax router top-k (module docstring: Mixtral, Qwen-MoE with ``softmax_over="all"``; gpt-oss with
    ``softmax_over="selected"``).

    Args:
        router_logits: ``[T, E]`` bf16/f16/f32 (the gate's ``F.linear`` output).
        top_k: experts per token, ``1 <= top_k <= E`` (``config.num_experts_per_tok``).
        renormalize: divide the k weights by their sum (Mixtral: True; Qwen3-MoE: ``config.norm_topk_prob``).
        softmax_over: ``"all"``: softmax over the E experts, then the top k; ``"selected"``: the top k logits,
            then a softmax over those k (gpt-oss).
        num_experts: optional check that ``E`` equals it.

    Returns:
        ``(weights float32 [T, k], expert_ids int64 [T, k])``, sorted by logit descending (ties: lower id first).

    Raises:
        ArgumentError: not 2-D, E != num_experts, top_k outside [1, E], unknown softmax_over.
        DTypeError: logits not bf16/f16/f32.
    """
    return torch.ops.tpukernels.softmax_topk(router_logits, top_k, renormalize, softmax_over, num_experts)


def sigmoid_topk(router_logits: torch.Tensor, top_k: int, *, renormalize: bool = False,
                 num_experts: Optional[int] = None):
    """Sigmoid router top-k (Llama-4's router: ``sigmoid`` of the k largest logits; module docstring).

    Args / Returns / Raises: as :func:`softmax_topk` (weights ``sigmoid(logit)``, with ``renormalize``
    divided by their sum).
    """
    return torch.ops.tpukernels.sigmoid_topk(router_logits, top_k, renormalize, num_experts)


def grouped_topk(router_logits: torch.Tensor, top_k: int, *, n_group: int, topk_group: int,
                 e_score_correction_bias: Optional[torch.Tensor] = None, routed_scaling_factor: float = 1.0,
                 norm_topk_prob: bool = True, num_experts: Optional[int] = None):
    """DeepSeek-V3's grouped top-k (transformers ``DeepseekV3TopkRouter.forward`` after its ``F.linear``;
    module docstring): experts chosen by the biased sigmoid scores within the ``topk_group`` best of
    ``n_group`` groups, weighted by the unbiased scores.

    Args:
        router_logits: ``[T, E]`` bf16/f16/f32 (DeepSeek computes them in float32).
        top_k: experts per token, ``1 <= top_k <= topk_group * E / n_group``.
        n_group: expert groups (dividing E, at least 2 experts each). topk_group: groups kept, ``<= n_group``.
        e_score_correction_bias: ``[E]`` float (the router's buffer), or None (zeros). Selection only.
        routed_scaling_factor: multiplies the weights. norm_topk_prob: divide the weights by ``sum + 1e-20``.
        num_experts: optional check that ``E`` equals it.

    Returns:
        ``(weights float32 [T, k], expert_ids int64 [T, k])`` sorted by biased score descending (ties: lower id
        first); transformers returns the same set in an unspecified order (``topk(sorted=False)``).

    Raises:
        ArgumentError: E != num_experts, top_k / topk_group / n_group out of their ranges, n_group not dividing
            E, groups of one expert, a bias not ``[E]``. DTypeError: bad dtypes. DeviceError: bias elsewhere.
    """
    return torch.ops.tpukernels.grouped_topk(router_logits, top_k, n_group, topk_group, e_score_correction_bias,
                                             float(routed_scaling_factor), norm_topk_prob, num_experts)


# ----------------------------------------------------------------------------------------- JAX entries
def _jax_run(op, logits, bias, k, mode, renormalize, n_group=1, topk_group=1, scale=1.0, interpret=None):
    from ...targets.jax_entry import jax_call

    dt = np.dtype(logits.dtype).name
    if len(logits.shape) != 2:
        raise ArgumentError(f"{op}: router_logits must be [num_tokens, num_experts], got {tuple(logits.shape)}")
    if dt not in ("bfloat16", "float16", "float32"):
        raise DTypeError(f"{op}: router_logits dtype {dt} is not supported: use bfloat16, float16 or float32")
    if dt == "float16":
        logits = logits.astype(jnp.float32)
    if logits.shape[0] == 0:
        return jnp.zeros((0, k), jnp.float32), jnp.zeros((0, k), jnp.int32)
    if bias is not None:
        bias = jnp.asarray(bias, jnp.float32).reshape(1, -1)
    w, i = jax_call(router_topk_fwd, logits, bias, k, mode, renormalize, n_group, topk_group, float(scale),
                    interpret=interpret)
    return w[:, :k], i[:, :k]


def _jax_common(op, logits, top_k, num_experts):
    if len(logits.shape) != 2:
        raise ArgumentError(f"{op}: router_logits must be [num_tokens, num_experts], got {tuple(logits.shape)}")
    e = int(logits.shape[1])
    if num_experts is not None and e != num_experts:
        raise ArgumentError(f"{op}: router_logits has {e} columns but num_experts = {num_experts}")
    return check_k(op, "top_k", top_k, e)


def softmax_topk_jax(router_logits, top_k: int, *, renormalize: bool = False, softmax_over: str = "all",
                     num_experts: Optional[int] = None, interpret=None):
    """:func:`softmax_topk` on jax arrays (trace-safe): ``(weights float32, expert_ids int32)``."""
    op = "tpukernels.softmax_topk_jax"
    k = _jax_common(op, router_logits, top_k, num_experts)
    if softmax_over not in SOFTMAX_OVER:
        raise ArgumentError(f"{op}: softmax_over must be 'all' or 'selected', got {softmax_over!r}")
    return _jax_run(op, router_logits, None, k, "softmax" if softmax_over == "all" else "softmax_selected",
                    bool(renormalize), interpret=interpret)


def sigmoid_topk_jax(router_logits, top_k: int, *, renormalize: bool = False, num_experts: Optional[int] = None,
                     interpret=None):
    """:func:`sigmoid_topk` on jax arrays (trace-safe): ``(weights float32, expert_ids int32)``."""
    op = "tpukernels.sigmoid_topk_jax"
    k = _jax_common(op, router_logits, top_k, num_experts)
    return _jax_run(op, router_logits, None, k, "sigmoid", bool(renormalize), interpret=interpret)


def grouped_topk_jax(router_logits, top_k: int, *, n_group: int, topk_group: int, e_score_correction_bias=None,
                     routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True,
                     num_experts: Optional[int] = None, interpret=None):
    """:func:`grouped_topk` on jax arrays (trace-safe): ``(weights float32, expert_ids int32)``."""
    op = "tpukernels.grouped_topk_jax"
    e = int(router_logits.shape[1]) if len(router_logits.shape) == 2 else 0
    _jax_common(op, router_logits, 1, num_experts)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ArgumentError(f"{op}: top_k must be an int, got {top_k!r}")
    _check_groups(op, e, top_k, n_group, topk_group)
    b = e_score_correction_bias
    if b is not None and tuple(b.shape) != (e,):
        raise ArgumentError(f"{op}: e_score_correction_bias must be [num_experts] = [{e}], got {tuple(b.shape)}")
    return _jax_run(op, router_logits, b, top_k, "grouped", bool(norm_topk_prob), n_group, topk_group,
                    routed_scaling_factor, interpret=interpret)


# ----------------------------------------------------------------------------------------- float64 reference
def router_topk_reference(router_logits, top_k, mode, *, renormalize=False, n_group=1, topk_group=1,
                          e_score_correction_bias=None, routed_scaling_factor=1.0):
    """float64 ``(weights, expert_ids int64)`` of :data:`MODES` ``mode`` (module docstring), ties by ascending
    id (a stable descending sort, independent of the kernel's selection)."""
    from .topk_ops import topk_reference

    l = router_logits.double()
    if mode == "grouped":
        s = torch.sigmoid(l)
        b = torch.zeros(l.shape[-1], dtype=torch.float64) if e_score_correction_bias is None else \
            e_score_correction_bias.double()
        ch = s + b
        t, e = l.shape
        grp = ch.view(t, n_group, e // n_group)
        gscore = topk_reference(grp, 2)[0].sum(-1)
        _, gidx = topk_reference(gscore, topk_group)
        keep = torch.zeros(t, n_group, dtype=torch.bool).scatter_(1, gidx, True)
        keep = keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)
        _, ids = topk_reference(ch.masked_fill(~keep, float("-inf")), top_k)
        w = s.gather(1, ids)
        if renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * routed_scaling_factor, ids
    vals, ids = topk_reference(l, top_k)
    if mode == "softmax":
        w = torch.softmax(l, -1).gather(1, ids)
    elif mode == "softmax_selected":
        w = torch.softmax(vals, -1)
    elif mode == "sigmoid":
        w = torch.sigmoid(vals)
    else:
        raise ArgumentError(f"router_topk_reference: unknown mode {mode!r}")
    if renormalize and mode != "softmax_selected":
        w = w / w.sum(-1, keepdim=True)
    return w, ids


#: ``(args, kwargs)`` of :func:`router_topk_fwd` compiled by the aot tests: Mixtral (8 experts, top-2, softmax),
#: Qwen3-MoE-30B (128, top-8), gpt-oss (32, top-4, softmax over the selected), DeepSeek-V3 (256 experts, 8
#: groups, 4 kept, top-8, bias).
STANDARD_SHAPES = [
    (("4096x8:bf16", None), {"k": 2, "mode": "softmax", "renormalize": True}),
    (("4096x128:bf16", None), {"k": 8, "mode": "softmax", "renormalize": True}),
    (("4096x32:bf16", None), {"k": 4, "mode": "softmax_selected", "renormalize": False}),
    (("4096x256:f32", "1x256:f32"), {"k": 8, "mode": "grouped", "renormalize": True, "n_group": 8,
                                     "topk_group": 4, "scale": 2.5}),
]
