"""The public op ``quantized_matmul`` (``torch.ops.tpukernels.quantized_matmul``: input checks, routing
between the kernels, autograd guard) and the ``TPUQuantLinear`` module."""

from __future__ import annotations

import functools
import json
import math
from typing import Optional

import torch

from ...errors import ArgumentError, DeviceError, DTypeError
from .common import (INT32_MAX_K, OUT_DTYPES, WEIGHT_DTYPES, X_DTYPES, X_QUANT, check_chip, dtype_name, jnp_dtype,
                     target_chip)
from .quantize import weight_dtype_name, quantize_per_token_kernel, quantize_weight
from .w8a16 import quantized_matmul_kernel
from .w8a8 import fused_plan, quantized_matmul_w8a8_kernel


def canon_x_quant(x_quant):
    if x_quant not in X_QUANT:
        raise ArgumentError(f"quantized_matmul: x_quant {x_quant!r} is not one of {X_QUANT}")
    return x_quant


def check_pair(x_quant: Optional[str], w_dtype: str, where: str) -> None:
    """The weight dtype an ``x_quant`` mode needs: ``"int8"`` needs int8 weights, ``"fp8"`` float8 ones
    (``None``, w8a16, takes any of :data:`WEIGHT_DTYPES`).

    Raises:
        DTypeError: the pair does not match (the message names the mode that would).
    """
    if x_quant == "int8" and w_dtype != "int8":
        raise DTypeError(f"{where}: x_quant='int8' needs int8 w_q, got {w_dtype} (use x_quant='fp8')")
    if x_quant == "fp8" and not w_dtype.startswith("float8"):
        raise DTypeError(f"{where}: x_quant='fp8' needs float8 w_q, got {w_dtype} (use x_quant='int8')")


def check_public(x, w_q, w_scale, x_quant, out_dtype):
    where = "tpukernels::quantized_matmul"
    for t, n in ((x, "x"), (w_q, "w_q"), (w_scale, "w_scale")):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(t).__name__}")
    devs = {t.device for t in (x, w_q, w_scale)}
    if len(devs) > 1:
        raise DeviceError(f"{where}: x, w_q and w_scale must be on one device, got "
                          f"{x.device}, {w_q.device}, {w_scale.device}")
    canon_x_quant(x_quant)
    if x.dim() < 1:
        raise ArgumentError(f"{where}: x must have rank >= 1 ([..., K]), got a scalar")
    if w_q.dim() != 2:
        raise ArgumentError(f"{where}: w_q must be 2-D [N, K], got shape {tuple(w_q.shape)}")
    dw = dtype_name(w_q.dtype)
    if dw not in WEIGHT_DTYPES:
        raise DTypeError(f"{where}: w_q dtype {dw} is not one of {WEIGHT_DTYPES} (quantize with quantize_weight)")
    if dtype_name(x.dtype) not in X_DTYPES:
        raise DTypeError(f"{where}: x dtype {dtype_name(x.dtype)} is not one of {X_DTYPES}")
    N, K = w_q.shape
    if x.shape[-1] != K:
        raise ArgumentError(f"{where}: x {tuple(x.shape)} and w_q {tuple(w_q.shape)}: x.shape[-1] must equal K = {K}")
    if tuple(w_scale.shape) != (N,):
        raise ArgumentError(f"{where}: w_scale must have shape (N,) = ({N},), got {tuple(w_scale.shape)}")
    if w_scale.dtype != torch.float32:
        raise DTypeError(f"{where}: w_scale must be float32, got {dtype_name(w_scale.dtype)}")
    check_pair(x_quant, dw, where)
    if x_quant == "int8" and K > INT32_MAX_K:
        raise ArgumentError(f"{where}: K = {K} > {INT32_MAX_K}: an int8 x int8 sum may overflow int32")
    odt = out_dtype or dtype_name(x.dtype)
    if odt not in OUT_DTYPES:
        raise DTypeError(f"{where}: out_dtype {odt!r} is not one of {OUT_DTYPES}")
    check_chip(x_quant, dw, where=where)
    return odt


def _impl(x, w_q, w_scale, x_quant=None, out_dtype=None, config=None):
    odt = check_public(x, w_q, w_scale, x_quant, out_dtype)
    N, K = w_q.shape
    lead = x.shape[:-1]
    if K == 0 or N == 0 or math.prod(lead) == 0:
        return torch.zeros(*lead, N, dtype=getattr(torch, odt), device=x.device)
    # w8a8 rounds x: no gradient. The forward runs (inference without torch.no_grad() is common: HF weights
    # require grad); a backward that reaches it raises (QuantizedInputHasNoGradient)
    guard = x_quant is not None and x.requires_grad and torch.is_grad_enabled()
    x2 = (x.detach() if guard else x).reshape(-1, K)
    ws = w_scale.reshape(1, N)
    kw = {} if config is None else dict(config=config)
    # the kernels' out_dtype=None means x's dtype (bf16 for 8-bit x): pass None for that default, so a
    # call's tuning-DB key is the one the shipped entries were tuned under (statics are part of the key)
    kout = None if odt == dtype_name(x.dtype) else odt
    if x_quant is None:
        y = quantized_matmul_kernel(x2, w_q, ws, None, kout, **kw)
    elif _fused(x2, w_q, ws, kout, config):
        y = quantized_matmul_w8a8_kernel(x2, w_q, ws, kout, **kw)
    else:
        xq, xs = quantize_per_token_kernel(x2, dtype_name(w_q.dtype))
        y = quantized_matmul_kernel(xq, w_q, ws, xs, None if odt == "bfloat16" else odt, **kw)
    y = y.reshape(*lead, N)
    return QuantizedInputHasNoGradient.apply(x, y, x_quant) if guard else y


class QuantizedInputHasNoGradient(torch.autograd.Function):
    """Identity on a w8a8 result computed from ``x.detach()``; its backward raises: rounding ``x`` to 8 bits
    has derivative zero almost everywhere, and a silent zero gradient would be a wrong answer."""

    @staticmethod
    def forward(ctx, x, y, x_quant):
        ctx.x_quant = x_quant
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        raise ArgumentError(f"tpukernels::quantized_matmul: x_quant={ctx.x_quant!r} has no gradient (x is rounded "
                            f"to 8 bits); use x_quant=None (w8a16) to differentiate with respect to x")


def _fused(x2, w_q, ws, odt, config) -> bool:
    """w8a8 path: the fused kernel iff :func:`fused_plan` has a plan at the config that kernel would get
    (explicit ``config``, else its shipped per-chip entry or heuristic) on the call's target chip. Decided
    once per signature (:func:`_fused_for`), not on every call."""
    from ...targets import config_to_json

    chip = target_chip()
    return _fused_for(int(x2.shape[0]), int(x2.shape[1]), int(w_q.shape[0]), dtype_name(x2.dtype),
                      dtype_name(w_q.dtype), odt,
                      None if config is None else config_to_json(quantized_matmul_w8a8_kernel, config),
                      None if chip is None else chip.name)


@functools.lru_cache(maxsize=1024)
def _fused_for(M, K, N, x_name, q_name, odt, config_json, chip_name) -> bool:
    from ...chips import get_chip
    from ...dsl import TensorSpec

    chip = None if chip_name is None else get_chip(chip_name)
    config = None if config_json is None else json.loads(config_json)
    specs = (TensorSpec((M, K), jnp_dtype(x_name), "x"), TensorSpec((N, K), jnp_dtype(q_name), "w_q"),
             TensorSpec((1, N), jnp_dtype("float32"), "w_scale"))
    cfg, _ = quantized_matmul_w8a8_kernel.resolve_config(specs, (("out_dtype", odt),), config, chip)
    return fused_plan(M, K, N, specs[0].dtype, specs[1].dtype, jnp_dtype(odt or x_name), int(cfg["bm"]), int(cfg["bk"]),
                      int(cfg["bn"]), chip) is not None


_LIB = torch.library.Library("tpukernels", "FRAGMENT")
_LIB.define("quantized_matmul(Tensor x, Tensor w_q, Tensor w_scale, str? x_quant=None, str? out_dtype=None) -> Tensor")
_LIB.impl("quantized_matmul", lambda x, w_q, w_scale, x_quant=None, out_dtype=None:
          _impl(x, w_q, w_scale, x_quant, out_dtype), "CompositeImplicitAutograd")


def canon_out(out_dtype):
    if out_dtype is None:
        return None
    name = out_dtype if isinstance(out_dtype, str) else dtype_name(out_dtype)
    name = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32"}.get(name, name)
    if name not in OUT_DTYPES:
        raise DTypeError(f"quantized_matmul: out_dtype {out_dtype!r} is not one of {OUT_DTYPES}")
    return name


def quantized_matmul(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *, x_quant: Optional[str] = None,
                     out_dtype=None, config: Optional[dict] = None) -> torch.Tensor:
    """``x @ (w_q * w_scale[:, None])^T`` with quantized weights; ``torch.ops.tpukernels.quantized_matmul``.

    Args:
        x: ``[..., K]`` bfloat16 or float32 activations (leading dims are tokens).
        w_q: ``[N, K]`` int8, float8_e4m3fn or float8_e5m2 weight (see :func:`quantize_weight`).
        w_scale: ``[N]`` float32 per-output-channel scales (unitless: ``W = w_q * w_scale``).
        x_quant: None (w8a16: weights dequantized in-kernel), ``"int8"`` (w8a8, int32 accumulation) or
            ``"fp8"`` (w8a8 in ``w_q``'s fp8 dtype): activations quantized per token with absmax.
        out_dtype: ``"bfloat16"`` / ``"float32"`` (or torch dtype); default ``x.dtype``.
        config: explicit ``{"bm", "bk", "bn"}`` for the matmul kernel (default: shipped per-chip data,
            then :func:`heuristic`).

    Returns:
        ``[..., N]`` in ``out_dtype``; error bound in the module docstring. Differentiable in ``x`` for
        ``x_quant=None``.

    Raises:
        ArgumentError: shapes (``x.shape[-1] != K``, ``w_scale`` not ``[N]``), unknown ``x_quant``,
            K > 133143 for int8 w8a8; a backward that reaches a w8a8 result (the forward runs with
            ``x.requires_grad``).
        ConfigError: ``config`` is not a dict of JSON values, or names unknown tunables / breaks their rules.
        DTypeError: ``w_q`` not int8/fp8, ``w_scale`` not float32, ``x`` not bf16/f32, x_quant vs w_q dtype.
        DeviceError: operands on different devices.
        ChipError: the target chip's MXU lacks the pair (message lists what it supports).
    """
    from ...targets import config_to_json

    for t, n in ((x, "x"), (w_q, "w_q"), (w_scale, "w_scale")):  # before the op schema's untyped RuntimeError
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"tpukernels::quantized_matmul: {n} must be a torch.Tensor, got {type(t).__name__}")
    if config is not None:
        config_to_json(quantized_matmul_kernel, config)  # the one config rule (a dict of JSON values), typed
    odt = canon_out(out_dtype)
    if config is None:
        return torch.ops.tpukernels.quantized_matmul(x, w_q, w_scale, x_quant, odt)
    return _impl(x, w_q, w_scale, x_quant, odt, config)


class TPUQuantLinear(torch.nn.Module):
    """``nn.Linear`` with a quantized, frozen weight: ``y = quantized_matmul(x, w_q, w_scale) + bias``.

    Buffers: ``w_q [out, in]`` (int8 / fp8), ``w_scale [out]`` float32, optional ``bias [out]`` (kept in the
    linear's dtype, added after the matmul in the output dtype). ``x_quant`` as in :func:`quantized_matmul`.
    Differentiable in the input for ``x_quant=None`` (weights are buffers, never trained).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype="int8", x_quant=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.qdtype = weight_dtype_name(dtype, "TPUQuantLinear")
        self.x_quant = canon_x_quant(x_quant)
        check_pair(self.x_quant, self.qdtype, "TPUQuantLinear")  # at construction, not at the first forward
        self.register_buffer("w_q", torch.zeros(out_features, in_features, dtype=getattr(torch, self.qdtype)))
        self.register_buffer("w_scale", torch.zeros(out_features, dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dtype="int8", x_quant=None) -> "TPUQuantLinear":
        """Quantize ``linear.weight`` per output channel (:func:`quantize_weight`); the linear is not modified."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, x_quant)
        q, s = quantize_weight(linear.weight, m.qdtype)
        m.w_q.copy_(q)
        m.w_scale.copy_(s)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m.to(linear.weight.device)

    def _apply(self, fn, recurse=True):
        """``Module.to(dtype)`` / ``.half()`` / ``.bfloat16()`` cast every floating buffer; ``w_q`` (fp8 is a
        floating dtype) and the float32 ``w_scale`` keep their dtypes (a bf16 scale would lose precision,
        then fail the kernel's float32 check) and follow device moves only. ``bias`` follows the cast."""
        keep = {n: self._buffers[n] for n in ("w_q", "w_scale")}
        self._buffers.update(dict.fromkeys(keep))  # None buffers are skipped by Module._apply; order is kept
        try:
            super()._apply(fn, recurse)
        finally:
            for n, t in keep.items():
                dev = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
                self._buffers[n] = t if dev == t.device else t.to(dev)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cast = x.dtype not in (torch.bfloat16, torch.float32)
        y = quantized_matmul(x.float() if cast else x, self.w_q, self.w_scale, x_quant=self.x_quant)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype) if cast else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.qdtype}, x_quant={self.x_quant}")
