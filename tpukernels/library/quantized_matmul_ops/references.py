"""float64 references and error bounds of the quantized matmul (package docstring, "Error")."""

from __future__ import annotations

import torch

from .common import U32


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale[:, None]`` in float64 (exact: every int8/fp8 value times an f32 fits in float64)."""
    return q.double() * scale.double().unsqueeze(-1)


def reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, x_scale=None) -> torch.Tensor:
    """float64 ``x' @ W^T`` of the dequantized operands, **not** rounded: ``W = w_q * w_scale[:, None]``;
    ``x' = x`` (w8a16) or, with ``x_scale [...]``, ``x' = x * x_scale[..., None]`` (w8a8: pass the quantized
    activations, e.g. from :func:`quantize_per_token` or :func:`quantize_reference`)."""
    K = x.shape[-1]
    xd = x.reshape(-1, K).double()
    if x_scale is not None:
        xd = xd * x_scale.reshape(-1, 1).double()
    y = xd @ dequantize(w_q, w_scale).T
    return y.reshape(*x.shape[:-1], w_q.shape[0])


def error_bound(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, x_scale=None, out_dtype=None):
    """Elementwise bound on ``|y - reference(x, w_q, w_scale, x_scale)|`` (module docstring), float64."""
    odt = out_dtype or (torch.bfloat16 if x_scale is not None else x.dtype)
    u = 2.0**-8 if odt == torch.bfloat16 else U32
    ref = reference(x, w_q, w_scale, x_scale)
    xd = x.reshape(-1, x.shape[-1]).double().abs()
    if x_scale is not None:
        xd = xd * x_scale.reshape(-1, 1).double().abs()
    mag = (xd @ dequantize(w_q, w_scale).abs().T).reshape(ref.shape)
    if x_scale is not None and x.dtype == torch.int8:
        # + the float64 reference's own rounding (products of two f32-scaled 8-bit values need up to 64 bits)
        return (u + 4 * U32) * ref.abs() + (x.shape[-1] + 2) * 2.0**-52 * mag
    return u * ref.abs() + (x.shape[-1] + 2) * U32 * mag
