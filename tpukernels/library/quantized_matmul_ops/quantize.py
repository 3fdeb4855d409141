"""Symmetric absmax quantization: the float reference (:func:`quantize_reference`), weights
(:func:`quantize_weight`) and the per-token activation kernel (``quantize_per_token_kernel``), with the
formula shared by every w8a8 path (package docstring, "Quantization")."""

from __future__ import annotations

import numpy as np
import torch

from ... import dsl as _dsl
from ...dsl.validate import padded_bytes
from ..vmem import MiB, scoped_vmem_limit
from ...errors import ArgumentError, DTypeError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .common import WEIGHT_DTYPES, X_DTYPES, clamp as _clamp, dtype_name as _name, jnp_dtype as _jnp, qmax

TUNABLES_Q = {
    "bm": _dsl.Tunable([256, 32, 64, 128, 512, 1024], default=256, doc="rows per block (the block holds whole rows)"),
}


def quantize_reference(v: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of each row of ``v [R, C]`` (f32 formula of the module docstring).

    Returns ``(q [R, C] dtype, scale [R] float32)`` with ``v ~= q * scale[:, None]``.
    """
    name = _name(dtype)
    qm = qmax(name)
    v32 = v.float()
    inv = torch.tensor(1.0 / qm, dtype=torch.float32)  # f32(1/qmax): the kernel multiplies by the same
    scale = v32.abs().amax(dim=-1) * inv if v32.shape[-1] else torch.zeros(v32.shape[:-1])
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    recip = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / safe)  # f32, one division per row
    q = v32 * recip.unsqueeze(-1)
    if name == "int8":
        q = torch.round(q).clamp(-qm, qm).to(torch.int8)
    else:
        q = q.clamp(-qm, qm).to(getattr(torch, name))
    return q, scale


def weight_dtype_name(dtype, where: str) -> str:
    """The 8-bit weight dtype name for ``dtype`` (a name, ``"fp8"`` = e4m3fn, or a torch dtype); DTypeError else."""
    name = dtype if isinstance(dtype, str) else (_name(dtype) if isinstance(dtype, torch.dtype) else None)
    name = {"fp8": "float8_e4m3fn"}.get(name, name)
    if name not in WEIGHT_DTYPES:
        raise DTypeError(f"{where}: dtype {dtype!r} is not one of {WEIGHT_DTYPES} (or 'fp8', or the torch dtype)")
    return name


def quantize_weight(w: torch.Tensor, dtype="int8") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an ``nn.Linear`` weight ``w [N, K]`` per output channel (symmetric absmax, torch on any device).

    Args:
        w: ``[N, K]`` floating weight (any float dtype; computed in float32).
        dtype: ``"int8"``, ``"float8_e4m3fn"`` / ``"float8_e5m2"`` (or the torch dtype; ``"fp8"`` means e4m3fn).

    Returns:
        ``(w_q [N, K] dtype, w_scale [N] float32)``, ``w ~= w_q * w_scale[:, None]``; max error per element
        ``w_scale / 2`` for int8 (half a grid step), 2^-4 relative (e4m3fn) / 2^-3 (e5m2) for fp8.

    Raises:
        ArgumentError: ``w`` not 2-D, or a row holding NaN / inf. DTypeError: ``w`` not floating, unknown
            ``dtype``.
    """
    name = weight_dtype_name(dtype, "quantize_weight")
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ArgumentError(f"quantize_weight: w must be a 2-D [N, K] tensor, got "
                            f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if not w.dtype.is_floating_point:
        raise DTypeError(f"quantize_weight: w must be floating point, got {_name(w.dtype)}")
    with torch.no_grad():
        bad = ~torch.isfinite(w).all(dim=1)
        if w.device.type != "meta" and bool(bad.any()):  # meta: shapes only  # a NaN / inf row would get a NaN / inf scale and poison its whole output channel
            r = int(bad.nonzero()[0, 0])
            raise ArgumentError(f"quantize_weight: row {r} of w (output channel {r}) holds NaN or inf; an absmax "
                                f"scale needs finite weights")
        return quantize_reference(w.detach(), name)


def _row_absmax(x):
    """``max_k |x[:, k]|`` as ``[rows, 1]`` f32 (exact: abs and max do not round, so computing them in ``x``'s
    own dtype — bf16 on chips with a bf16 VPU, half the vector work — and in any chunking gives the same)."""
    import jax.numpy as jnp

    return jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32)


def reciprocal(scale):
    """``r = f32(1 / s)`` per row, ``0`` where ``s == 0`` (module docstring): ``q = v * r``."""
    import jax.numpy as jnp

    zero = scale == 0
    return jnp.where(zero, 0.0, 1.0 / jnp.where(zero, 1.0, scale))


_reciprocal = reciprocal  # the kernel bodies here keep this name: the tuning DB keys them by their source


def quantize_values(x, recip, qm, is_int, dtype):
    """``x [rows, c]`` -> ``q`` in ``dtype`` given the rows' reciprocal scales ``[rows, 1]``
    (:func:`reciprocal`; module docstring formula).

    The one definition both w8a8 paths use (``quantize_per_token_kernel`` and the fused
    ``quantized_matmul_w8a8_kernel``), so they produce the same ``q`` for the same ``x`` and scale."""
    import jax.numpy as jnp

    q = x.astype(jnp.float32) * recip
    if is_int:
        q = jnp.clip(jnp.round(q), -qm, qm).astype(jnp.int32)
    else:
        q = jnp.clip(q, -qm, qm)
    return q.astype(dtype)


_quantize_values = quantize_values  # the kernel bodies here keep this name: the tuning DB keys them by their source


def _quantize_body(x_ref, q_ref, s_ref, *, qm, is_int):
    """Rows of ``x`` -> symmetric absmax quantization (module docstring), f32 arithmetic."""
    scale = _row_absmax(x_ref[...]) * np.float32(1.0 / qm)
    q_ref[...] = _quantize_values(x_ref[...], _reciprocal(scale), qm, is_int, q_ref.dtype)
    s_ref[...] = scale


def _q_out(x, dtype: str = "int8"):
    M, K = x.shape
    return (_dsl.OutSpec((M, K), _jnp(dtype)), _dsl.OutSpec((M, 1), _jnp("float32")))


def _q_heuristic(x, dtype="int8"):
    K = max(1, x.shape[1])
    rows = (4 * MiB) // (K * 4)  # the f32 copy of a block within ~4 MiB
    bm = max(32, min(512, 1 << max(0, rows.bit_length() - 1)))
    return dict(bm=bm)


def _q_shape(x, dtype="int8"):
    return _q_out(x, dtype)


@_dsl.tpu_kernel(_quantize_body, name="quantize_per_token_kernel", namespace="tpukernels", tunables=TUNABLES_Q,
                 heuristic=_q_heuristic, out_shape=_q_shape)
def quantize_per_token_kernel(x: torch.Tensor, dtype: str = "int8", *, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric absmax quantization of ``x [M, K]`` (bf16/f32) to ``dtype`` (int8 / fp8):
    ``(x_q [M, K], x_scale [M, 1] float32)`` (module docstring). Blocks hold whole rows."""
    from jax.experimental import pallas as pl

    where = "tpukernels::quantize_per_token_kernel"
    if len(x.shape) != 2:
        raise ArgumentError(f"{where}: x must be 2-D [M, K], got {tuple(x.shape)}")
    if _name(x.dtype) not in X_DTYPES:
        raise DTypeError(f"{where}: x dtype {_name(x.dtype)} is not one of {X_DTYPES}")
    if dtype not in WEIGHT_DTYPES:
        raise DTypeError(f"{where}: dtype {dtype!r} is not one of {WEIGHT_DTYPES}")
    M, K = x.shape
    bm_ = _clamp(M, bm)
    need = 2 * (padded_bytes((bm_, K), x.dtype) + padded_bytes((bm_, K), _jnp(dtype))
                + padded_bytes((bm_, 1), "float32")) + 3 * padded_bytes((bm_, K), "float32")
    limit = scoped_vmem_limit(need)
    return _dsl.Launch(
        grid=(_dsl.cdiv(M, bm_),),
        in_specs=[pl.BlockSpec((bm_, K), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((bm_, K), lambda i: (i, 0)), pl.BlockSpec((bm_, 1), lambda i: (i, 0))],
        out_shape=_q_out(x, dtype),
        dimension_semantics=("parallel",),
        vmem_limit_bytes=limit,
        cost_estimate=pl.CostEstimate(flops=4 * M * K, transcendentals=0,
                                      bytes_accessed=int(M * K * (np.dtype(x.dtype).itemsize + 1) + 4 * M)),
        body_kwargs=dict(qm=qmax(dtype), is_int=dtype == "int8"),
    )

def quantize_per_token(x: torch.Tensor, dtype="int8") -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q [..., K], x_scale [...] float32)``: the kernel that :func:`quantized_matmul` uses for w8a8."""
    name = weight_dtype_name(dtype, "quantize_per_token")
    K = x.shape[-1]
    q, s = quantize_per_token_kernel(x.reshape(-1, K), name)
    return q.reshape(x.shape), s.reshape(x.shape[:-1])
