"""DTensor sharding rules for tpukernels' torch ops: DTensor inputs run the kernel on their local shards.

Every kernel-level op (``torch.ops.tpukernels.*``: the library's forward and backward kernels, and user
kernels) gets a rule through ``torch.distributed.tensor.experimental.register_sharding``. A rule is a list of
:class:`Split` s, each one acceptable way to run the op on shards; DTensor picks the one that moves the least
data for the inputs' placements and redistributes only what that split needs. A replicate-everything split
is always appended (the fallback: inputs are gathered, every rank computes the whole result).

* norms (every kernel declaring ``rows=``): the row inputs sharded on dim 0, the other tensors (weights)
  replicated; outputs with the row axis sharded on dim 0, outputs reduced over rows
  (``OutSpec(..., rows=False)``: weight gradients) are per-shard partial sums (``Partial("sum")``).
* flash attention fwd / bwd: over batch (every tensor on dim 0, segment ids too) or over heads (q, k, v,
  do, lse, di on dim 1; segment ids replicated). GQA needs ``Hkv`` divisible by the mesh size, else
  DTensor drops that split (uneven shards are never chosen) and falls back to batch or replicate.
* matmul nn / nt / tn (``[batch, rows, cols]`` operands): over M (the lhs rows), over N (column-parallel
  weights; a bias ``[1, N]`` sharded with them), over the batch; over K (row-parallel weights: a partial
  sum) only without bias and activation and for a float32 output, so the result is still rounded once.
* grouped matmul (fwd over N, or K as a partial sum; tgmm over K or N: rows stay whole, the group sizes
  index them), quantized matmul (over M or N; its dx over M, K, or N as a partial sum), per-token
  quantization (rows); block-scaled quantized matmul (over M or N, never K; its dx over M, over K
  when the mesh divides the scale groups, or N as a partial sum); masked (block-sparse) flash
  attention (batch; heads for a one-head mask); RoPE (heads, positions, batch); linear cross-entropy derives
  its rule from ``rows=``; ragged paged attention over
  heads (when ``Hkv`` divides by the mesh: each shard keeps whole K/V pairs) and its cache update; MLA
  attention over a latent cache over heads (the cache replicated).
* user kernels: ``@tpu_kernel(..., sharding=[Split(...), ...])`` or ``sharding=fn`` (called with the op's
  arguments by name, tensors as ``.shape``/``.dtype`` metadata, returning Splits); else derived from
  ``rows=``; else replicate only.

When: ``torch.distributed.tensor`` costs ~1 s to import, so ``import tpukernels`` does not load it. A kernel's
rule is registered when its op is created if DTensor is already loaded, else the moment
``torch.distributed.tensor`` is imported (a one-shot import hook installed by :func:`on_op_registered`), so
the rules are in place before any DTensor can reach an op. :func:`register_all` does it explicitly.

Op names live in one table, :data:`LIBRARY_RULES` (kernel name -> rule).
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib.abc
import importlib.util
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: an output placement: a per-shard partial sum (the ranks' results add up to the full result)
PARTIAL = "partial"


@dataclasses.dataclass(frozen=True)
class Split:
    """One way to run a kernel on shards.

    Args:
        inputs: ``{tensor parameter name: the dim it is sharded on}``; tensors not named are replicated.
        outputs: per op output: the dim it comes out sharded on, ``None`` (replicated: every shard computes
            all of it) or :data:`PARTIAL` (each shard's output is a partial sum).
    """

    inputs: Mapping[str, int]
    outputs: Sequence[int | str | None]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What a rule sees of a tensor argument: its global shape and dtype."""

    shape: tuple
    dtype: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)


def process_group(group):
    """The ``torch.distributed`` process group of ``group``: a ProcessGroup as is, a 1-D ``DeviceMesh``'s group, or
    the default group for None (the group argument of the torch-side distributed ops)."""
    import torch.distributed as dist

    if group is None:
        return dist.group.WORLD
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh
        return group.get_group()
    return group


def check_ranks_agree(op: str, fields: Mapping[str, int], group, device=None) -> None:
    """Raise on every rank of ``group`` when the ranks disagree on any of ``fields`` (name -> int), before a
    collective they shape: one all-gather of ``len(fields)`` int64 on ``device`` (default cpu: the device the
    group's backend communicates, e.g. the tensors' own), after which every rank sees the same table, so all raise
    together and none is left waiting in the collective.

    Raises:
        ArgumentError: naming the fields and both ranks' values.
    """
    import torch
    import torch.distributed as dist

    from ..errors import ArgumentError

    names = list(fields)
    mine = torch.tensor([int(fields[k]) for k in names], dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    rank = dist.get_rank(group)
    for r, theirs in enumerate(table):
        bad = [(k, a, b) for k, a, b in zip(names, mine.tolist(), theirs.tolist()) if a != b]
        if bad:
            raise ArgumentError(f"{op}: rank {rank} and rank {r} disagree on {', '.join(k for k, _, _ in bad)} ("
                                + "; ".join(f"{k}: {a} on rank {rank}, {b} on rank {r}" for k, a, b in bad) + ")")


# ---------------------------------------------------------------------------------------------- library rules
def _present(args: Mapping, names: Sequence[str]) -> list[str]:
    return [n for n in names if isinstance(args.get(n), TensorMeta)]


def _attention(n_out: int):
    def rule(args: Mapping) -> list[Split]:
        tensors = _present(args, ("q", "k", "v", "do", "lse", "di", "q_segment_ids", "kv_segment_ids"))
        heads = [n for n in tensors if not n.endswith("segment_ids")]
        return [Split({n: 0 for n in tensors}, (0,) * n_out), Split({n: 1 for n in heads}, (1,) * n_out)]

    return rule


def _is_f32(dtype) -> bool:
    return "float32" in str(dtype)


def _matmul(layout: str):
    """Kernel operands are 3-D ``[batch, rows, cols]``: nn ``a [B, M, K] @ b [B, K, N]``, nt ``a @ bt [B, N, K]``,
    tn ``at [B, K, M] @ b``; out ``[B or 1, M, N]``; bias ``[1, N]``."""
    x, y = {"nn": ("a", "b"), "nt": ("a", "bt"), "tn": ("at", "b")}[layout]
    x_m, x_k = (2, 1) if layout == "tn" else (1, 2)
    y_n, y_k = (1, 2) if layout == "nt" else (2, 1)

    def rule(args: Mapping) -> list[Split]:
        a, b, bias = args.get(x), args.get(y), args.get("bias")
        if not isinstance(a, TensorMeta) or not isinstance(b, TensorMeta):
            return []
        has_bias = isinstance(bias, TensorMeta)
        out_f32 = _is_f32(args.get("out_dtype") or a.dtype)
        splits = [Split({x: x_m}, (1,)),  # over M: lhs rows
                  Split({y: y_n, **({"bias": 1} if has_bias else {})}, (2,))]  # over N: column-parallel weight
        if not args.get("reduce_batch"):
            batch = {n: 0 for n, t in ((x, a), (y, b)) if t.shape[0] != 1}
            if batch:
                splits.append(Split(batch, (0,)))
        elif out_f32 and not has_bias and args.get("activation") is None:  # batch summed inside: partial sums
            splits.append(Split({n: 0 for n, t in ((x, a), (y, b)) if t.shape[0] != 1}, (PARTIAL,)))
        if out_f32 and not has_bias and args.get("activation") is None:  # over K: row-parallel weight
            splits.append(Split({x: x_k, y: y_k}, (PARTIAL,)))
        return splits

    return rule


def _grouped_fwd(args: Mapping) -> list[Split]:
    """``lhs [M, K]`` x ``rhs [G, K, N]`` (``[G, N, K]`` transposed) -> ``[M, N]``: over N (each shard all
    groups, its columns); over K a partial sum (float32 output only). Rows are not split: ``group_sizes``
    index the global rows."""
    t = bool(args.get("transpose_rhs"))
    bias = isinstance(args.get("rhs_bias"), TensorMeta)  # [G, 1, N]: split with the columns; no K partial sums
    splits = [Split({"rhs": 1 if t else 2, **({"rhs_bias": 2} if bias else {})}, (1,))]
    lhs = args.get("lhs")
    if not bias and isinstance(lhs, TensorMeta) and _is_f32(args.get("out_dtype") or lhs.dtype):
        splits.append(Split({"lhs": 1, "rhs": 2 if t else 1}, (PARTIAL,)))
    return splits


def _grouped_tgmm(args: Mapping) -> list[Split]:
    """``x [M, K]``, ``y [M, N]`` -> per-group ``x_g^T y_g`` ``[G, K, N]``: over K (x's columns) or N (y's)."""
    return [Split({"x": 1}, (1,)), Split({"y": 1}, (2,))]


def _grouped_quant_fwd(args: Mapping) -> list[Split]:
    """Quantized experts ``lhs [M, K]`` x ``rhs`` (``[G, K_w, N]``, ``[G, N, K_w]`` transposed) with ``rhs_scale``
    / ``rhs_zero_point [G, num_blocks, 1, N]`` -> ``[M, N]``: over N only (the weight's N dim with its scales').
    Rows: ``group_sizes`` index the global rows; K: packed two per byte and cut into scale blocks."""
    split = {"rhs": 1 if bool(args.get("transpose_rhs")) else 2, "rhs_scale": 3}
    if isinstance(args.get("rhs_zero_point"), TensorMeta):
        split["rhs_zero_point"] = 3
    if isinstance(args.get("rhs_bias"), TensorMeta):  # [G, 1, N]: its columns with the weight's
        split["rhs_bias"] = 2
    return [Split(split, (1,))]


def _quantized_matmul(args: Mapping) -> list[Split]:
    """``x [M, K]`` . ``w_q [N, K]``^T * ``w_scale [1, N]`` [* ``x_scale [M, 1]``] -> ``[M, N]``: over M or N."""
    return [Split({"x": 0, "x_scale": 0} if isinstance(args.get("x_scale"), TensorMeta) else {"x": 0}, (0,)),
            Split({"w_q": 0, "w_scale": 1}, (1,))]


def _quantized_dx(args: Mapping) -> list[Split]:
    """``(g [M, N] * w_scale [1, N]) . w_q [N, K]`` -> ``[M, K]``: over M, over K, over N a partial sum (f32)."""
    splits = [Split({"g": 0}, (0,)), Split({"w_q": 1}, (1,))]
    g = args.get("g")
    if isinstance(g, TensorMeta) and _is_f32(args.get("out_dtype") or g.dtype):
        splits.append(Split({"g": 1, "w_q": 0, "w_scale": 1}, (PARTIAL,)))
    return splits


def _quantized_blockwise(args: Mapping) -> list[Split]:
    """``x [M, K]`` . ``w_q [N, K_w]``^T with ``w_scale`` / ``w_zero_point [K/bs, 1, N]`` -> ``[M, N]``: over M
    (x's rows) or N (the weight's rows with their scales' last dim). K is never split: a shard boundary inside a
    scale block (or an int4 byte) would change which scale a column uses."""
    zero_point = isinstance(args.get("w_zero_point"), TensorMeta)
    over_n = {"w_q": 0, "w_scale": 2, **({"w_zero_point": 2} if zero_point else {})}
    return [Split({"x": 0}, (0,)), Split(over_n, (1,))]


def _quantized_blockwise_dx(args: Mapping) -> list[Split]:
    """``g [M, N]`` . ``W [N, K_w]`` (block-quantized: ``w_q``, ``w_scale`` / ``w_zero_point [G, 1, N]``) ->
    ``d_x [M, K_w]``: over M (g's rows); over K (the output's columns: ``w_q``'s columns with the scales' groups)
    only when every shard gets whole groups (``G`` divisible by the mesh: a scale block or an int4 byte never
    straddles shards); over N a partial sum (float32 output only, so the result is still rounded once)."""
    g, ws = args.get("g"), args.get("w_scale")
    zp = isinstance(args.get("w_zero_point"), TensorMeta)
    splits = [Split({"g": 0}, (0,))]
    n = int(math.prod(current_mesh_shape()) or 1)
    if isinstance(ws, TensorMeta) and ws.shape[0] % n == 0:
        splits.append(Split({"w_q": 1, "w_scale": 0, **({"w_zero_point": 0} if zp else {})}, (1,)))
    if isinstance(g, TensorMeta) and _is_f32(args.get("out_dtype") or g.dtype):
        splits.append(Split({"g": 1, "w_q": 0, "w_scale": 2, **({"w_zero_point": 2} if zp else {})}, (PARTIAL,)))
    return splits


def _masked_attention(n_out: int):
    """Block-sparse masked attention (``fwd_table [3, Hm, nq, T]``, ``bwd_table [3, Hm, nk, Tq]``,
    ``mask_blocks`` / ``mask_blocks_t`` shared partial blocks): over batch with the tables replicated; over heads
    only for a one-head mask (``Hm == 1``: every shard's heads read the same tables; a multi-head mask's table
    rows are indexed by the global head)."""

    def rule(args: Mapping) -> list[Split]:
        tensors = _present(args, ("q", "k", "v", "do", "lse", "di", "q_segment_ids", "kv_segment_ids"))
        heads = [n for n in tensors if not n.endswith("segment_ids")]
        splits = [Split({n: 0 for n in tensors}, (0,) * n_out)]
        ft = args.get("fwd_table")
        if isinstance(ft, TensorMeta) and ft.shape[1] == 1:
            splits.append(Split({n: 1 for n in heads}, (1,) * n_out))
        return splits

    return rule


def _rope(args: Mapping) -> list[Split]:
    """``x [B, H, S, D]`` (``seq_dim=2``) or ``[B, S, H, D]`` (``seq_dim=1``) with ``cos`` / ``sin [Bc, S, D]``
    (``Bc`` 1 or B): over heads (tables replicated), over positions (tables split with them), over batch (tables
    split when ``Bc == B > 1``, else replicated)."""
    x, cos = args.get("x"), args.get("cos")
    if not isinstance(x, TensorMeta) or not isinstance(cos, TensorMeta):
        return []
    seq = int(args.get("seq_dim", 2))
    head = 1 if seq == 2 else 2
    per_batch = cos.shape[0] != 1
    return [Split({"x": head}, (head,)),
            Split({"x": seq, "cos": 1, "sin": 1}, (seq,)),
            Split({"x": 0, **({"cos": 0, "sin": 0} if per_batch else {})}, (0,))]


_MESH_SHAPE: contextvars.ContextVar = contextvars.ContextVar("tpukernels_mesh_shape", default=())


def current_mesh_shape() -> tuple:
    """The device mesh shape of the call a rule is computing splits for (library rules that need it)."""
    return _MESH_SHAPE.get()


def _ragged_paged(args: Mapping) -> list[Split]:
    """``q [T, Hq, D]``, ``kv_cache [P, page, 2*Hkv, D]`` (K of kv head h at 2h, V at 2h+1) -> ``[T, Hq, D]``:
    over heads, only when every shard gets whole (K, V) pairs (``Hkv`` divisible by the mesh); metadata
    replicated, per-head ``sinks [Hq]`` split with q's heads, per-token scales replicated. Tokens are not split:
    ``cu_q_lens`` index the global rows."""
    q, kv = args.get("q"), args.get("kv_cache")
    n = int(math.prod(current_mesh_shape()) or 1)
    if not isinstance(kv, TensorMeta) or (kv.shape[2] // 2) % n:
        return []
    split = {"q": 1, "kv_cache": 2, **({"sinks": 0} if isinstance(args.get("sinks"), TensorMeta) else {})}
    return [Split(split, (1,))] if isinstance(q, TensorMeta) else []


def _mla_paged(args: Mapping) -> list[Split]:
    """``ql_nope [T, H, L]``, ``q_pe [T, H, R]`` over the latent cache ``[P, page, L + R]`` -> ``[T, H, L]``: over
    heads (when the mesh divides ``H``); the cache (one latent shared by every head) and the metadata replicated.
    Tokens are not split: ``cu_q_lens`` index the global rows."""
    ql, qpe = args.get("ql_nope"), args.get("q_pe")
    n = int(math.prod(current_mesh_shape()) or 1)
    if not (isinstance(ql, TensorMeta) and isinstance(qpe, TensorMeta)) or ql.shape[1] % n:
        return []
    return [Split({"ql_nope": 1, "q_pe": 1}, (1,))]


def _sparse_mla(args: Mapping) -> list[Split]:
    """``ql_nope [T, H, L]``, ``q_pe [T, H, R]``, the gathered rows ``kv_sel [T, Kp, L + R]`` and ``sel [T, 1, Kp]``
    -> ``[T, H, L]``: every token row is independent (the metadata was resolved by the gather), so over tokens
    when the mesh divides ``T`` (each shard gets its own gathered rows), else over heads (``kv_sel`` replicated)."""
    ql, qpe, kv, sel = (args.get(k) for k in ("ql_nope", "q_pe", "kv_sel", "sel"))
    n = int(math.prod(current_mesh_shape()) or 1)
    if not all(isinstance(x, TensorMeta) for x in (ql, qpe, kv, sel)):
        return []
    if ql.shape[0] % n == 0:
        return [Split({"ql_nope": 0, "q_pe": 0, "kv_sel": 0, "sel": 0}, (0,))]
    return [Split({"ql_nope": 1, "q_pe": 1}, (1,))] if ql.shape[1] % n == 0 else []


#: Kernel op name (in the ``tpukernels`` namespace) -> rule ``fn(args by name) -> [Split]``. Norms need no
#: entry: their ``rows=`` declaration derives the rule. The one place op names appear.
LIBRARY_RULES: dict[str, Callable[[Mapping], list[Split]]] = {
    "flash_attention_fwd": _attention(2),
    "flash_attention_bwd_dq": _attention(1),
    "flash_attention_bwd_dkv": _attention(2),
    "flash_attention_bwd_fused": _attention(3),  # (dq [B, Hq, ..], dk, dv [B, Hkv, ..]): batch or heads
    "matmul_nn": _matmul("nn"),
    "matmul_nt": _matmul("nt"),
    "matmul_tn": _matmul("tn"),
    "grouped_matmul_fwd": _grouped_fwd,
    "grouped_matmul_tgmm": _grouped_tgmm,
    "grouped_matmul_quant_fwd": _grouped_quant_fwd,
    # d_lhs [M, K]: rows index the global groups, K is packed / blocked, N is the contraction: replicated
    "grouped_matmul_quant_dx": lambda args: [],
    "quantized_matmul_kernel": _quantized_matmul,
    # fused w8a8: per-token absmax over all of K inside the kernel, so over M or N only (never K)
    "quantized_matmul_w8a8_kernel": _quantized_matmul,
    "quantized_matmul_bwd_dx": _quantized_dx,
    "quantized_matmul_blockwise_kernel": _quantized_blockwise,
    "quantized_matmul_blockwise_bwd_dx": _quantized_blockwise_dx,
    # block-quantized activations: x_q and its x_scale [M, K/bs] split by rows together; N as the weight-only kernel
    "quantized_matmul_blockwise_a8_kernel": lambda args: [Split({"x_q": 0, "x_scale": 0}, (0,)),
                                                          *_quantized_blockwise(args)[1:]],
    # fp8 prefill: x' [M, K_w] bf16 (already dequantized) . block-scaled fp8 weights, as the weight-only kernel
    "quantized_matmul_blockwise_a8_prefill_kernel": _quantized_blockwise,
    "quantize_per_block_kernel": lambda args: [Split({"x": 0}, (0, 0))],  # rows -> (x_q or x', x_scale [M, K/bs])
    "flash_attention_masked_fwd": _masked_attention(2),
    "flash_attention_masked_bwd_dq": _masked_attention(1),
    "flash_attention_masked_bwd_dkv": _masked_attention(2),
    "rope_fwd": _rope,
    "quantize_per_token_kernel": lambda args: [Split({"x": 0}, (0, 0))],  # rows -> (x_q, x_scale [M, 1])
    # linear_cross_entropy_* declare rows= (h, labels, ...): derived, dW [V, D] as a partial sum
    "ragged_paged_attention_kernel": _ragged_paged,
    # kv_new [T, 2*Hkv, D] into kv_cache [P, page, 2*Hkv, D]: any even split of the combined heads is a copy
    "update_kv_cache_kernel": lambda args: [Split({"kv_new": 1, "kv_cache": 2}, (2,))],
    "mla_ragged_paged_attention_kernel": _mla_paged,
    # DSA indexer: the score sums over index heads (a head split would need a partial-sum reduction of the
    # [T, 1, max_kv] scores) and cu_q_lens index the global token rows: replicated
    "lightning_indexer_kernel": lambda args: [],
    "sparse_mla_attention_kernel": _sparse_mla,
    # linear attention / SSD (issue 37): replicate only for now. Their heads are independent, but the packed
    # per-sequence tables, grouped value heads (HV a multiple of H) and the state pools' head axes differ per op,
    # so a head split needs its own rule and test per op; until then DTensor gathers and each shard computes all.
    **{name: (lambda args: []) for name in (
        "gdn_chunk_fwd", "gdn_chunk_bwd", "gdn_recurrent_fwd", "kda_chunk_fwd", "kda_chunk_bwd", "kda_recurrent_fwd",
        "ssd_chunk_scan_fwd", "ssd_chunk_scan_bwd", "ssd_state_update")},
    # MoE routing (library/moe_routing): top-k rows are independent (values, indices over rows)
    "topk_fwd": lambda args: [Split({"x": 0}, (0, 0))],
    "router_topk_fwd": lambda args: [Split({"logits": 0}, (0, 0))],
    # out[p] = x[idx[p]]: the output rows follow idx's rows; x (indexed globally) stays replicated
    "moe_gather_fwd": lambda args: [Split({"idx": 0}, (0,))],
    # pos / w [T*k] hold k entries per output row: an even split of T*k need not fall on token boundaries
    "moe_gather_reduce_fwd": lambda args: [],
    # out[t] sums rows of y from anywhere in y: a split of y's rows would leave partial sums to reduce
    "moe_scatter_add_fwd": lambda args: [],
}


# ---------------------------------------------------------------------------------------------- derivation
def _rows_rule(kernel) -> Callable[[Mapping], list[Split]]:
    def rule(args: Mapping) -> list[Split]:
        import torch

        from ..lowering import specs_from_values

        values = []
        for p in kernel.params:
            v = args.get(p.name, p.default)
            values.append(torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, TensorMeta) else v)
        specs, statics = specs_from_values(kernel, values)
        outs = kernel.out_specs_for(specs, statics, None)
        rows = _present(args, kernel.rows)
        return [Split({n: 0 for n in rows}, tuple(0 if getattr(o, "rows", True) else PARTIAL for o in outs))]

    return rule


def rule_for(kernel) -> Callable[[Mapping], list[Split]] | None:
    """The kernel's rule: its ``sharding=``, the library table, or derived from ``rows=`` (None: replicate only)."""
    declared = getattr(kernel, "sharding", None)
    if declared is not None:
        if callable(declared):
            return lambda args: list(declared(**args))
        splits = list(declared)
        return lambda args: splits
    if kernel.namespace == "tpukernels" and kernel.name in LIBRARY_RULES:
        return LIBRARY_RULES[kernel.name]
    if kernel.rows:
        return _rows_rule(kernel)
    return None


def splits_for(kernel, args: Mapping) -> list[Split]:
    """The splits ``kernel`` accepts for one call (``args`` by name; tensors as :class:`TensorMeta`)."""
    rule = rule_for(kernel)
    return [] if rule is None else list(rule(args))


# ---------------------------------------------------------------------------------------------- registration
def _placement(code):
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code is None:
        return Replicate()
    if code == PARTIAL:
        return Partial("sum")
    return Shard(int(code))


def register(kernel, op=None) -> None:
    """Register ``kernel``'s rule for its op (``op``: default ``kernel.op``) with DTensor."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.experimental import register_sharding

    from ..errors import KernelDefinitionError

    op = kernel.op if op is None else op
    op = getattr(op, "_opoverload", None) or getattr(op, "default", op)  # torch.library.CustomOpDef -> OpOverload
    n_out = len(op._schema.returns)
    positional = [p.name for p in kernel.params if not p.keyword_only]

    def strategies(*args, **kwargs):
        mesh = next((v.mesh for v in (*args, *kwargs.values()) if isinstance(v, DTensorSpec)), None)
        token = _MESH_SHAPE.set(tuple(mesh.shape) if mesh is not None else ())
        try:
            return _strategies(args, kwargs)
        finally:
            _MESH_SHAPE.reset(token)

    def _strategies(args, kwargs):
        named = dict(zip(positional, args))
        named.update((k, v) for k, v in kwargs.items() if k != "config")
        view = {n: TensorMeta(tuple(v.shape), v.tensor_meta.dtype) if isinstance(v, DTensorSpec) else v
                for n, v in named.items()}
        out = []
        for s in [*splits_for(kernel, view), Split({}, (None,) * n_out)]:
            if len(s.outputs) != n_out:
                raise KernelDefinitionError(f"{kernel.qualname}: a sharding Split has {len(s.outputs)} outputs, "
                                            f"the op returns {n_out}")
            unknown = set(s.inputs) - {p.name for p in kernel.params if p.kind != "static"}
            if unknown:
                raise KernelDefinitionError(f"{kernel.qualname}: sharding Split names {sorted(unknown)}, which "
                                            f"are not tensor parameters")
            ins, ok = [], True
            for n, v in zip(positional, args):
                if not isinstance(v, DTensorSpec):
                    ins.append(None)
                    continue
                d = s.inputs.get(n)
                if d is not None and not 0 <= d < v.ndim:
                    ok = False  # e.g. a 1-D tensor where the split shards dim 1
                ins.append(_placement(d))
            ins += [_placement(None) for k, v in kwargs.items() if isinstance(v, DTensorSpec)]
            if ok:
                out.append(([_placement(o) for o in s.outputs], ins))
        return out

    register_sharding(op)(strategies)


_PENDING: list = []
_LOCK = threading.Lock()
_HOOK = None
_DT = "torch.distributed.tensor"


def _dtensor_loaded() -> bool:
    mod = sys.modules.get(_DT)
    return mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False) is False


def _flush() -> None:
    with _LOCK:
        todo = list(_PENDING)
        _PENDING.clear()
    for k, op in todo:
        try:
            register(k, op)
        except Exception as e:  # never break `import torch.distributed.tensor` (this runs inside it)
            import warnings

            warnings.warn(f"tpukernels: no DTensor sharding rule for {k.qualname}: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)


class _WhenDTensorLoads(importlib.abc.MetaPathFinder):
    """Registers the pending rules right after ``torch.distributed.tensor`` finishes importing (then leaves)."""

    def find_spec(self, name, path, target=None):
        if name != _DT:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _flush()

        spec.loader.exec_module = exec_module
        return spec


def on_op_registered(kernel, op) -> None:
    """Called when a kernel's torch op is created: register its rule now if DTensor is loaded, else when it is."""
    global _HOOK
    if _dtensor_loaded():
        register(kernel, op)
        return
    with _LOCK:
        _PENDING.append((kernel, op))
        if _HOOK is None or _HOOK not in sys.meta_path:
            _HOOK = _WhenDTensorLoads()
            sys.meta_path.insert(0, _HOOK)


def register_all() -> None:
    """Register every pending rule now (loads ``torch.distributed.tensor``)."""
    import torch.distributed.tensor  # noqa: F401  (the import hook, if still installed, flushes)

    _flush()
