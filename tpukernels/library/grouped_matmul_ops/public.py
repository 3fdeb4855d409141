"""The public op ``grouped_matmul`` (``torch.ops.tpukernels.grouped_matmul``: input checks, value checks on
host tensors, its ``torch.library`` registration), ``skewed_group_sizes`` and the Mixtral
``STANDARD_CASES`` the shipped tables are tuned at."""

from __future__ import annotations

import numpy as np
import torch

from ...errors import ArgumentError, DeviceError
from .common import canonical_out_dtype, check_bias
from .kernels import fwd_dims, grouped_matmul_fwd, grouped_matmul_tgmm


def is_tracing(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or torch.compiler.is_compiling()


def check_public(lhs, rhs, group_sizes, transpose_rhs, group_offset, out_dtype, rhs_bias=None):
    where = "tpukernels::grouped_matmul"
    for t, n in ((lhs, "lhs"), (rhs, "rhs"), (group_sizes, "group_sizes")):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(t).__name__}")
    go = group_offset if group_offset is not None else torch.zeros((), dtype=torch.int32, device=lhs.device)
    M, K, N, G = fwd_dims(group_sizes, go, lhs, rhs, transpose_rhs, where)
    if rhs_bias is not None:
        check_bias(rhs_bias, G, N, where)
    opt = tuple(t for t in (group_offset, rhs_bias) if t is not None)
    devs = {t.device for t in (lhs, rhs, group_sizes) + opt}
    if len(devs) > 1:
        raise DeviceError(f"{where}: lhs, rhs, group_sizes (and group_offset, rhs_bias) must be on one device, got "
                          f"{sorted(str(d) for d in devs)}")
    Gt = group_sizes.shape[0]
    if group_offset is None and Gt != G:
        raise ArgumentError(f"{where}: rhs has {G} groups but group_sizes has {Gt}; pass group_offset for a shard")
    canonical_out_dtype(out_dtype, where)
    check_values(group_sizes, go, M, G, where)
    return go.reshape(1)


def check_values(group_sizes, go, M: int, G: int, where: str) -> None:
    """Value checks of the group metadata, only where the values are on the host and concrete (package
    docstring): no negative size, ``sum(group_sizes) <= M``, ``0 <= group_offset <= G_total - G``."""
    Gt = group_sizes.shape[0]
    if group_sizes.device.type == "cpu" and not is_tracing(group_sizes):
        sizes = group_sizes.numpy()
        if (sizes < 0).any():
            g = int(np.argmax(sizes < 0))
            raise ArgumentError(f"{where}: group_sizes[{g}] = {int(sizes[g])} is negative")
        total = int(sizes.astype(np.int64).sum())
        if total > M:
            raise ArgumentError(f"{where}: sum(group_sizes) = {total} exceeds lhs rows M = {M}")
    if go.device.type == "cpu" and not is_tracing(go):
        off = int(go.reshape(-1)[0])
        if not 0 <= off <= Gt - G:
            raise ArgumentError(f"{where}: group_offset {off} must be in [0, len(group_sizes) - rhs.shape[0]] = "
                                f"[0, {Gt - G}]")


def _widen_mixed(lhs, rhs):
    """Mixed bfloat16 / float32 operands (megablox ``gmm`` accepts them): the bfloat16 one is widened to float32
    (exact), so the product is the float32 one (``precision=HIGHEST``). Costs a float32 copy of that operand in
    HBM; the kernels then see one dtype. Anything else is left for the dtype checks."""
    names = {lhs.dtype, rhs.dtype}
    if names == {torch.bfloat16, torch.float32}:
        return lhs.float(), rhs.float()
    return lhs, rhs


def grouped_matmul_impl(lhs, rhs, group_sizes, transpose_rhs=False, group_offset=None, out_dtype=None, config=None,
                        rhs_bias=None):
    if isinstance(lhs, torch.Tensor) and isinstance(rhs, torch.Tensor):
        lhs, rhs = _widen_mixed(lhs, rhs)
    go = check_public(lhs, rhs, group_sizes, transpose_rhs, group_offset, out_dtype, rhs_bias)
    return torch.ops.tpukernels.grouped_matmul_fwd(group_sizes, go, lhs, rhs, rhs_bias, transpose_rhs,
                                                   canonical_out_dtype(out_dtype), config=config)


_LIB = torch.library.Library("tpukernels", "FRAGMENT")
_LIB.define("grouped_matmul(Tensor lhs, Tensor rhs, Tensor group_sizes, bool transpose_rhs=False, "
            "Tensor? group_offset=None, str? out_dtype=None, str? config=None, Tensor? rhs_bias=None) -> Tensor")
_LIB.impl("grouped_matmul", grouped_matmul_impl, "CompositeImplicitAutograd")


def grouped_matmul(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, transpose_rhs: bool = False,
                   group_offset=None, out_dtype=None, config=None, rhs_bias=None) -> torch.Tensor:
    """Grouped (ragged) matmul: ``out[rows of g] = lhs[rows of g] @ rhs[g - group_offset] (+ rhs_bias[g -
    group_offset])``; differentiable (in ``lhs``, ``rhs`` and ``rhs_bias``).

    ``torch.ops.tpukernels.grouped_matmul`` (semantics of ``jax.lax.ragged_dot`` / megablox ``gmm``).

    Args:
        lhs: ``[M, K]`` bfloat16 or float32 (cpu: Pallas interpret; tpu: TorchTPU).
        rhs: ``[G, K, N]``, or ``[G, N, K]`` with ``transpose_rhs=True``; bfloat16 or float32. With one
            operand bfloat16 and the other float32 (as megablox ``gmm`` accepts), the bfloat16 one is widened
            to float32 (exact; a float32 copy of it in HBM) and the product is the float32 one; the gradient
            of each operand comes back in its own dtype.
        group_sizes: int32 ``[G_total]``: rows per group, contiguous in group order; ``sum <= M`` (the rest
            of the rows are zero in the result). Zeros allowed.
        transpose_rhs: ``rhs`` is stored ``[G, N, K]`` (contracted on its last dim, no copy).
        group_offset: int or int32 scalar tensor: ``rhs`` holds groups ``[group_offset, group_offset + G)``
            of ``G_total`` (a shard); rows of other groups are zero. Default 0 (``G == G_total``).
        out_dtype: result dtype (torch dtype or name, bfloat16 / float32); default ``lhs.dtype`` (float32
            for mixed operands).
        config: tuning config of the forward kernel (``{"bm": 256, ...}``); default: tuned/heuristic.
        rhs_bias: ``[G, 1, N]`` bfloat16 / float32 (megablox ``gmm``'s ``rhs_bias``), optional: ``rhs_bias[g]``
            is added in float32 to the accumulator of the rows of local group ``g`` in the kernel's epilogue,
            before the rounding to ``out_dtype``; rows of no local group stay 0. Gradient: ``d_rhs_bias[g]`` =
            the sum of the output gradient over the rows of group ``g`` (float32 accumulation, in
            ``rhs_bias.dtype``).

    Returns:
        ``[M, N]`` in ``out_dtype`` (products, and the bias, accumulated in float32, rounded once).

    Raises:
        ArgumentError: operands that are not tensors, ranks, K mismatch, ``len(group_sizes)`` vs ``G``,
            ``rhs_bias`` not a tensor or not ``[G, 1, N]``,
            ``group_offset`` not an int / int32 scalar tensor, its shape or range,
            negative sizes or ``sum(group_sizes) > M`` (value checks on host cpu tensors only; see the
            module docstring for what is clamped on device instead).
        DTypeError: operands (or ``rhs_bias``) of unsupported dtypes (float16, float64, ints), ``group_sizes``
            / ``group_offset`` not int32, bad ``out_dtype``.
        DeviceError: tensors (``rhs_bias`` included) on different devices.
        ConfigError: ``config`` is not a dict, or names unknown tunables / breaks their rules.
    """
    from collections.abc import Mapping

    from ...targets import config_to_json

    where = "tpukernels::grouped_matmul"
    for t, n in ((lhs, "lhs"), (rhs, "rhs"), (group_sizes, "group_sizes")):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(t).__name__}")
    if rhs_bias is not None and not isinstance(rhs_bias, torch.Tensor):
        raise ArgumentError(f"{where}: rhs_bias must be a torch.Tensor or None, got {type(rhs_bias).__name__}")
    if group_offset is not None and not isinstance(group_offset, torch.Tensor):
        if isinstance(group_offset, bool) or not isinstance(group_offset, (int, np.integer)):
            raise ArgumentError(f"{where}: group_offset must be an int or an int32 scalar tensor, got "
                                f"{type(group_offset).__name__} {group_offset!r}")
        group_offset = torch.tensor(int(group_offset), dtype=torch.int32, device=lhs.device)
    cfg = None if config is None or (isinstance(config, Mapping) and not config) else \
        config_to_json(grouped_matmul_fwd, config)
    return torch.ops.tpukernels.grouped_matmul(lhs, rhs, group_sizes, transpose_rhs, group_offset,
                                               canonical_out_dtype(out_dtype), cfg, rhs_bias)


def skewed_group_sizes(tokens: int, top_k: int, num_experts: int, skew: float = 1.2, seed: int = 0) -> list[int]:
    """Realistic skewed MoE group sizes: ``tokens * top_k`` rows split over ``num_experts`` by a Zipf-like
    load (expert ``e`` gets weight ``1 / (e + 1) ** skew``, shuffled), summing exactly to ``tokens * top_k``."""
    rng = np.random.default_rng(seed)
    w = 1.0 / (np.arange(num_experts) + 1.0) ** skew
    rng.shuffle(w)
    rows = tokens * top_k
    sizes = np.floor(w / w.sum() * rows).astype(np.int64)
    sizes[np.argmax(w)] += rows - sizes.sum()
    return [int(s) for s in sizes]


#: Mixtral-8x7B expert shapes (hidden 4096, ffn 14336, 8 experts), 8192 tokens top-2 = 16384 rows:
#: gate/up projection (x @ W1^T, weights [E, ffn, hidden]) and down projection (h @ W2^T).
MIXTRAL = dict(tokens=8192, top_k=2, experts=8, hidden=4096, ffn=14336)
_R = MIXTRAL["tokens"] * MIXTRAL["top_k"]
STANDARD_CASES = [
    (grouped_matmul_fwd, ("8:i32", "1:i32", f"{_R}x4096:bf16", "8x14336x4096:bf16"), {"transpose_rhs": True}),
    (grouped_matmul_fwd, ("8:i32", "1:i32", f"{_R}x14336:bf16", "8x4096x14336:bf16"), {"transpose_rhs": True}),
    (grouped_matmul_fwd, ("8:i32", "1:i32", f"{_R}x4096:bf16", "8x4096x14336:bf16"), {}),
    (grouped_matmul_tgmm, ("8:i32", "1:i32", f"{_R}x4096:bf16", f"{_R}x14336:bf16"), {"num_groups": 8}),
]
