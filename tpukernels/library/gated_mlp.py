"""Gated MLP activations: SwiGLU ``silu(gate) * up`` and GeGLU ``gelu(gate) * up``, forward and backward.

Written with the tpukernels DSL (``@tpu_kernel``), torch namespace ``tpukernels``.

Public API (torch tensors; ``gate``, ``up``: ``[..., I]``, same shape and dtype)::

    torch.ops.tpukernels.gated_activation(gate, up, activation="silu") -> y      act(gate) * up
    tpukernels.library.gated_mlp.swiglu(gate, up)          silu(gate) * up             (Llama, Mistral, Qwen)
    tpukernels.library.gated_mlp.geglu(gate, up, approximate="tanh")  gelu(gate) * up  (Gemma: "tanh"; "none": erf)
    tpukernels.library.gated_mlp.TPUGatedMLP               down(act(gate(x)) * up(x)) module over 3 linears

Formulas (float32, whatever the input dtype; ``sig = sigmoid(g)``, ``t = tanh(c (g + 0.044715 g^3))``,
``c = sqrt(2 / pi)``, ``Phi`` the normal CDF)::

    silu        act = g * sig                          act' = sig * (1 + g * (1 - sig))
    gelu_tanh   act = 0.5 g (1 + t)                    act' = 0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 * 0.044715 g^2)
    gelu        act = g * Phi(g) = 0.5 g (1 + erf(g / sqrt 2))      act' = Phi(g) + g * exp(-g^2 / 2) / sqrt(2 pi)
    forward     y = cast(act(g) * u)
    backward    dgate = cast(dy * u * act'(g)),  dup = cast(dy * act(g))   (act recomputed from gate: nothing saved
                                                                             but the inputs, as Liger-Kernel does)

Sources: Shazeer 2020 "GLU Variants Improve Transformer"; Hendrycks & Gimpel 2016 (GELU and its tanh
approximation, ``torch.nn.functional.gelu(approximate="tanh")``); HF ``LlamaMLP`` / ``GemmaMLP``;
Liger-Kernel ``LigerSiLUMulFunction`` / ``LigerGELUMulFunction``. HF rounds ``act(g)`` to the dtype before
multiplying (two roundings in bf16); these kernels round once (within one unit of the dtype of HF's).

Design. Two internal kernel ops on ``[rows, I]`` (leading dims flattened; rows bucketed, ``rows=``)::

    tpukernels::gated_activation_fwd(gate, up, activation)           -> y
    tpukernels::gated_activation_bwd(dy, gate, up, activation)       -> (dgate, dup)

with a 2-D grid of ``(block_rows, block_cols)`` blocks (elementwise: an overhanging tail block's garbage
lanes/rows are never stored). float16 is widened to float32 (Mosaic, libtpu 0.0.52, cannot load float16 on
v5e/v6e/tpu7x), as in :mod:`tpukernels.library.norms`.

Tuning: ``block_rows`` and ``block_cols`` (upper bounds, lowered to fit :data:`VMEM_BUDGET_BYTES` and the
array). No per-chip tables shipped yet: the heuristic takes the largest block that fits (HBM-bound: 3 / 5
arrays moved per element in forward / backward).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl

from .. import dsl as tk
from ..chips import MiB
from ..dsl.validate import LANES
from ..errors import ArgumentError, DeviceError, DTypeError

__all__ = [
    "gated_activation", "swiglu", "geglu", "TPUGatedMLP", "gated_activation_fwd", "gated_activation_bwd",
    "gated_activation_reference", "ACTIVATIONS", "BLOCK_ROWS", "BLOCK_COLS", "VMEM_BUDGET_BYTES",
]

NAMESPACE = "tpukernels"
#: ``activation`` names: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (GeGLU, tanh approximation), ``"gelu"`` (erf).
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
BLOCK_ROWS = (8, 16, 32, 64, 128, 256, 512, 1024)
BLOCK_COLS = (128, 256, 512, 1024, 2048, 4096)
#: VMEM for the double-buffered blocks plus ~4 float32 temporaries per element (as the norms' budget).
VMEM_BUDGET_BYTES = 12 * MiB
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
F32 = jnp.float32
_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


# ----------------------------------------------------------------------------------------- kernel bodies
def _act_and_grad(g, activation: str, need_grad: bool):
    """float32 ``(act(g), act'(g) or None)`` (module docstring)."""
    if activation == "silu":
        sig = jax.nn.sigmoid(g)
        a = g * sig
        return a, (sig * (1.0 + g * (1.0 - sig)) if need_grad else None)
    if activation == "gelu_tanh":
        t = jnp.tanh(_C * (g + _K * g * g * g))
        a = 0.5 * g * (1.0 + t)
        return a, (0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _C * (1.0 + 3.0 * _K * g * g) if need_grad else None)
    cdf = 0.5 * (1.0 + jax.lax.erf(g * (1.0 / math.sqrt(2.0))))
    a = g * cdf
    return a, (cdf + g * jnp.exp(-0.5 * g * g) * (1.0 / math.sqrt(2.0 * math.pi)) if need_grad else None)


def _fwd_body(g_ref, u_ref, y_ref, *, activation: str):
    a, _ = _act_and_grad(g_ref[...].astype(F32), activation, False)
    y_ref[...] = (a * u_ref[...].astype(F32)).astype(y_ref.dtype)


def _bwd_body(dy_ref, g_ref, u_ref, dg_ref, du_ref, *, activation: str):
    dy = dy_ref[...].astype(F32)
    a, da = _act_and_grad(g_ref[...].astype(F32), activation, True)
    dg_ref[...] = (dy * u_ref[...].astype(F32) * da).astype(dg_ref.dtype)
    du_ref[...] = (dy * a).astype(du_ref.dtype)


# ----------------------------------------------------------------------------------------- kernels
def _elem_bytes(dtypes) -> int:
    """VMEM bytes per element of a block: each array double-buffered, plus ~4 float32 temporaries."""
    return 2 * sum(np.dtype(d).itemsize for d in dtypes) + 4 * 4


def fit_block(block_rows: int, block_cols: int, n: int, i: int, per_elem: int) -> tuple[int, int]:
    """``(rows, cols)`` of the launched block: ``block_cols`` clipped to I (all of I when I < 128 or fits in
    one block), then rows then cols halved until the block fits :data:`VMEM_BUDGET_BYTES`; all rows when
    the array has no more (a block equal to the full dim is always legal)."""
    bm, bn = int(block_rows), int(block_cols)
    padded_i = tk.cdiv(i, LANES) * LANES
    if padded_i <= bn:
        bn = i
    while bm > 8 and bm * max(bn, LANES) * per_elem > VMEM_BUDGET_BYTES:
        bm //= 2
    while bn > LANES and bn != i and bm * bn * per_elem > VMEM_BUDGET_BYTES:
        bn //= 2
    return (int(n) if 0 < n <= bm else bm), bn


def _heuristic(per_elem: int, n: int, i: int) -> dict:
    best = None
    for bn in BLOCK_COLS:
        for bm in BLOCK_ROWS:
            if bm * bn * per_elem <= VMEM_BUDGET_BYTES:
                key = (min(bm, max(n, 8)) * min(bn, max(i, LANES)), bn)
                if best is None or key > best[0]:
                    best = (key, {"block_rows": bm, "block_cols": bn})
    return best[1]


def _tunables():
    return {
        "block_rows": tk.Tunable(BLOCK_ROWS, default=256, doc="rows per grid step (upper bound)"),
        "block_cols": tk.Tunable(BLOCK_COLS, default=1024, doc="columns (of I) per grid step (upper bound)"),
    }


def _check(op, activation, *specs, halves: bool = False, out_dtype=None):
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"{NAMESPACE}::{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if out_dtype is not None and out_dtype not in ("bfloat16", "float32"):
        raise DTypeError(f"{NAMESPACE}::{op}: out_dtype must be 'bfloat16', 'float32' or None, got {out_dtype!r}")
    shape = tuple(specs[0].shape)
    for s in specs:
        name = np.dtype(s.dtype).name
        if name not in ("bfloat16", "float32"):
            raise DTypeError(f"{NAMESPACE}::{op}: {s.name!r} has dtype {name}: use bfloat16 or float32 "
                             f"(the public op widens float16)")
        if len(s.shape) != 2 or tuple(s.shape) != shape:
            what = "[rows, 2 I] (halves=True)" if halves else "[rows, I]"
            raise ArgumentError(f"{NAMESPACE}::{op}: {s.name} must be {what} = {list(shape)}, got {tuple(s.shape)}")
    if halves and (shape[1] % (2 * LANES) or shape[1] == 0):
        raise ArgumentError(f"{NAMESPACE}::{op}: halves=True needs [rows, 2 I] with I a positive multiple of {LANES} "
                            f"(the up half starts at a whole column block), got {shape[1]} columns")


def _halves_cols(bn: int, i: int) -> int:
    """The largest multiple of :data:`LANES` that divides ``i`` and is at most ``bn`` (halves: the up half's
    column blocks start at block index ``i / bn``)."""
    bn = min(bn, i) // LANES * LANES
    while i % bn:
        bn -= LANES
    return bn


def _launch(n, i, bm, bn, n_in, n_out, out_shape, flops, nbytes, up_offset: int | None = None):
    """``up_offset``: halves (forward only): the second input's column blocks start ``up_offset`` blocks in."""
    spec = pl.BlockSpec((bm, bn), lambda r, c: (r, c))
    in_specs = [spec] * n_in
    if up_offset is not None:
        in_specs = [spec, pl.BlockSpec((bm, bn), lambda r, c: (r, c + up_offset))]
    return tk.Launch(
        grid=(tk.cdiv(n, bm), tk.cdiv(i, bn)),
        in_specs=in_specs,
        out_specs=spec if n_out == 1 else [spec] * n_out,
        out_shape=out_shape,
        dimension_semantics=("parallel", "parallel"),
        cost_estimate=pl.CostEstimate(flops=int(flops * n * i), transcendentals=int(n * i), bytes_accessed=int(nbytes)),
    )


def _jdtype(name):
    return None if name is None else jnp.dtype(name)


def _fwd_elem(gate, up, out_dtype=None):
    return _elem_bytes([gate.dtype, up.dtype, gate.dtype if out_dtype is None else _jdtype(out_dtype)])


def _fwd_cols(gate, halves):
    return gate.shape[1] // 2 if halves else gate.shape[1]


@tk.tpu_kernel(
    _fwd_body, name="gated_activation_fwd", namespace=NAMESPACE, tunables=_tunables(), rows=("gate", "up"),
    heuristic=lambda gate, up, activation, halves=False, out_dtype=None, **_: _heuristic(
        _fwd_elem(gate, up, out_dtype), gate.shape[0], _fwd_cols(gate, halves)),
    out_shape=lambda gate, up, activation, halves=False, out_dtype=None: tk.like(
        gate, dtype=_jdtype(out_dtype), shape=(gate.shape[0], _fwd_cols(gate, halves))),
    canonicalize=tk.dtype_default("out_dtype"),
)
def gated_activation_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str, halves: bool = False,
                         out_dtype: Optional[str] = None, *, block_rows: int, block_cols: int) -> torch.Tensor:
    """``act(gate) * up`` on ``[rows, I]`` bf16/f32 (internal op; use :func:`gated_activation`), in ``out_dtype``
    (``"bfloat16"`` / ``"float32"``; None: gate's dtype).

    ``halves=True``: ``gate`` and ``up`` are ``[rows, 2 I]``, in practice both the output of a fused gate/up matmul
    (pass it twice): the gate is ``gate[:, :I]``, up is ``up[:, I:]``, read in place by two BlockSpecs (no split
    copies); ``I`` a multiple of 128. Gradients: ``[dgate | dup]`` to that one array (zeros in the unread halves
    when two arrays are passed)."""
    _check("gated_activation_fwd", activation, gate, up, halves=halves, out_dtype=out_dtype)
    n, i = gate.shape[0], _fwd_cols(gate, halves)
    bm, bn = fit_block(block_rows, block_cols, n, i, _fwd_elem(gate, up, out_dtype))
    if halves:
        bn = _halves_cols(bn, i)
    out_item = jnp.dtype(gate.dtype if out_dtype is None else out_dtype).itemsize
    return _launch(n, i, bm, bn, 2, 1, tk.like(gate, dtype=_jdtype(out_dtype), shape=(n, i)), 8,
                   n * i * (gate.itemsize + up.itemsize + out_item), up_offset=i // bn if halves else None)


def _bwd_elem(dy, gate, up):
    return _elem_bytes([dy.dtype, gate.dtype, up.dtype, gate.dtype, up.dtype]) + 8


@tk.tpu_kernel(
    _bwd_body, name="gated_activation_bwd", namespace=NAMESPACE, tunables=_tunables(), rows=("dy", "gate", "up"),
    heuristic=lambda dy, gate, up, **_: _heuristic(_bwd_elem(dy, gate, up), gate.shape[0], gate.shape[1]),
    out_shape=lambda dy, gate, up, activation: (tk.like(gate), tk.like(up)),
)
def gated_activation_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, *,
                         block_rows: int, block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` of ``y = act(gate) * up`` on ``[rows, I]`` (internal op; act recomputed from gate)."""
    _check("gated_activation_bwd", activation, dy, gate, up)
    n, i = gate.shape
    bm, bn = fit_block(block_rows, block_cols, n, i, _bwd_elem(dy, gate, up))
    return _launch(n, i, bm, bn, 3, 2, (tk.like(gate), tk.like(up)), 14, 5 * gate.size * gate.itemsize)


@gated_activation_fwd.def_backward(op="gated_activation (swiglu, geglu)")
def _fwd_backward(ctx, dy):
    if ctx.halves:  # the gate is gate[:, :I], up is up[:, I:]
        i = ctx.gate.shape[1] // 2
        dg, du = gated_activation_bwd(dy, ctx.gate[:, :i].contiguous(), ctx.up[:, i:].contiguous(), ctx.activation)
        if ctx.gate.data_ptr() == ctx.up.data_ptr():  # one fused output passed twice: [dgate | dup], given once
            return {"gate": torch.cat([dg, du], dim=1)}
        zero = torch.zeros_like(dg)
        return {"gate": torch.cat([dg, zero], dim=1), "up": torch.cat([zero, du], dim=1)}
    dg, du = gated_activation_bwd(dy, ctx.gate, ctx.up, ctx.activation)
    return {"gate": dg, "up": du}


# ----------------------------------------------------------------------------------------- public op
def _check_public(op, gate, up, activation):
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ArgumentError(f"{op}: {name} must be a torch.Tensor [..., I], got "
                                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in _SUPPORTED:
            raise DTypeError(f"{op}: {name} dtype {t.dtype} is not supported: use bfloat16, float16 or float32")
    if gate.shape != up.shape:
        raise ArgumentError(f"{op}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.dtype != up.dtype:
        raise DTypeError(f"{op}: gate dtype {gate.dtype} and up dtype {up.dtype} must be equal")
    if gate.device != up.device:
        raise DeviceError(f"{op}: gate is on {gate.device} but up is on {up.device}")
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def _widen(t):
    return t.float() if t.dtype == torch.float16 else t


def _gated_activation_impl(gate, up, activation="silu"):
    _check_public("tpukernels.gated_activation", gate, up, activation)
    i = gate.shape[-1]
    if gate.numel() == 0:
        return torch.empty_like(gate)
    y = torch.ops.tpukernels.gated_activation_fwd(_widen(gate).reshape(-1, i), _widen(up).reshape(-1, i), activation)
    return y.reshape(gate.shape).to(gate.dtype)


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define("gated_activation(Tensor gate, Tensor up, str activation='silu') -> Tensor")
_LIB.impl("gated_activation", _gated_activation_impl, "CompositeImplicitAutograd")


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` in one pass (formulas: module docstring).

    Args:
        gate, up: ``[..., I]``, same shape and dtype (bf16/f16/f32), any layout.
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (GeGLU as Gemma / ``gelu_pytorch_tanh``) or
            ``"gelu"`` (exact, erf).

    Returns:
        ``y`` shaped and typed like gate; differentiable in gate and up (Pallas backward kernel).

    Raises:
        ArgumentError: shapes differ, unknown activation, not a tensor. DTypeError: dtype not bf16/f16/f32,
            or gate/up dtypes differ. DeviceError: gate and up on different devices.
    """
    return torch.ops.tpukernels.gated_activation(gate, up, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` (:func:`gated_activation` with ``activation="silu"``)."""
    return gated_activation(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU: ``gelu(gate) * up``; ``approximate="tanh"`` (default, Gemma) or ``"none"`` (erf), as
    ``torch.nn.functional.gelu``."""
    if approximate not in ("tanh", "none"):
        raise ArgumentError(f"tpukernels.geglu: approximate must be 'tanh' or 'none', got {approximate!r}")
    return gated_activation(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu")


class TPUGatedMLP(torch.nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the fused activation (HF ``LlamaMLP`` / ``GemmaMLP``,
    TorchTitan ``FeedForward`` = ``w2(silu(w1(x)) * w3(x))``).

    Args:
        gate_proj, up_proj, down_proj: the existing linear modules (shared, not copied: state dicts, weight
            tying and FSDP wrapping are unchanged). activation: one of :data:`ACTIVATIONS`.
    """

    def __init__(self, gate_proj: torch.nn.Module, up_proj: torch.nn.Module, down_proj: torch.nn.Module,
                 activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ArgumentError(f"TPUGatedMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


# ----------------------------------------------------------------------------------------- float64 reference
def gated_activation_reference(gate, up, activation: str = "silu"):
    """float64 ``act(gate) * up`` of the given values (torch's own float64 activations)."""
    g, u = gate.double(), up.double()
    if activation == "silu":
        a = torch.nn.functional.silu(g)
    elif activation == "gelu_tanh":
        a = torch.nn.functional.gelu(g, approximate="tanh")
    elif activation == "gelu":
        a = torch.nn.functional.gelu(g)
    else:
        raise ArgumentError(f"gated_activation_reference: unknown activation {activation!r}")
    return a * u


#: Llama-3-8B MLP (8192 tokens x intermediate 14336), bf16.
STANDARD_CASES = [
    (gated_activation_fwd, ("8192x14336:bf16", "8192x14336:bf16"), {"activation": "silu"}),
    (gated_activation_bwd, ("8192x14336:bf16", "8192x14336:bf16", "8192x14336:bf16"), {"activation": "silu"}),
]
