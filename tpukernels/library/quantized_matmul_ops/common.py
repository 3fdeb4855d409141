"""Dtypes, chip support and shared launch helpers of the quantized matmul (package docstring: modes,
chip support from jax's ``tpu_info.is_matmul_supported``)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...errors import ChipError, DTypeError
from ..vmem import target_chip  # noqa: F401  (the chip a call is for; re-exported to this package's modules)

WEIGHT_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
X_DTYPES = ("bfloat16", "float32")
OUT_DTYPES = ("bfloat16", "float32")
X_QUANT = (None, "int8", "fp8")
#: largest K whose int8 x int8 sum cannot overflow int32: 127 * 127 * K < 2^31
INT32_MAX_K = (2**31 - 1) // (127 * 127)
U32 = 2.0**-24


# ----------------------------------------------------------------------------------------------- dtypes, chips
def dtype_name(dt) -> str:
    if isinstance(dt, torch.dtype):
        return str(dt).replace("torch.", "")
    return np.dtype(dt).name


def jnp_dtype(name: str):
    import jax.numpy as jnp

    return np.dtype(getattr(jnp, name))


def qmax(dtype) -> float:
    """Largest magnitude of the symmetric grid of ``dtype``: 127 for int8, the largest finite fp8 value."""
    name = dtype_name(dtype)
    if name == "int8":
        return 127.0
    if name in ("float8_e4m3fn", "float8_e5m2"):
        return float(torch.finfo(getattr(torch, name)).max)
    raise DTypeError(f"quantize: dtype {name} is not one of {WEIGHT_DTYPES}")


def _mxu_ok(chip, lhs: str, rhs: str) -> bool:
    """jax's ``TpuInfo.is_matmul_supported`` for one core of ``chip`` (natively, no casting)."""
    return bool(chip.info.is_matmul_supported(jnp_dtype(lhs), jnp_dtype(rhs)))


def supported_modes(chip) -> list[tuple[Optional[str], str]]:
    """``(x_quant, w dtype)`` pairs :func:`quantized_matmul` runs on ``chip`` (bf16 activations).

    Derived from jax's ``TpuInfo.is_matmul_supported`` (module docstring): w8a16 with int8 weights runs
    wherever the MXU takes bf16; fp8 weights need the chip's MXU to take that fp8 dtype (with itself or
    with bf16); w8a8 needs the quantized pair itself.
    """
    from ...chips import get_chip

    chip = get_chip(chip)
    out: list[tuple[Optional[str], str]] = []
    if _mxu_ok(chip, "bfloat16", "bfloat16"):
        out.append((None, "int8"))
    if _mxu_ok(chip, "int8", "int8"):
        out.append(("int8", "int8"))
    for f8 in ("float8_e4m3fn", "float8_e5m2"):
        native, has = _mxu_ok(chip, "bfloat16", f8), _mxu_ok(chip, f8, f8)
        if native or has:
            out.append((None, f8))
        if has:
            out.append(("fp8", f8))
    return out


def describe(modes) -> str:
    return ", ".join(f"{'w8a16' if xq is None else 'w8a8'} {w} (x_quant={xq!r})" for xq, w in modes)


def check_chip(x_quant: Optional[str], w_dtype: str, chip=None, where: str = "quantized_matmul") -> None:
    """Raise :class:`ChipError` if ``chip`` (default: the call's target, None: unchecked) lacks the mode."""
    chip = target_chip() if chip is None else chip
    if chip is None:
        return
    modes = supported_modes(chip)
    if (x_quant, w_dtype) not in modes:
        pair = {None: f"{w_dtype} at all (neither (bfloat16, {w_dtype}) nor ({w_dtype}, {w_dtype}))"
                if w_dtype != "int8" else "(bfloat16, bfloat16)",
                "int8": "(int8, int8)", "fp8": f"({w_dtype}, {w_dtype})"}[x_quant]
        raise ChipError(
            f"{where}: x_quant={x_quant!r} with {w_dtype} weights is not supported on {chip.name}: jax's "
            f"tpu_info.is_matmul_supported says its MXU does not take {pair} natively; supported on "
            f"{chip.name}: {describe(modes)}"
        )


def native_fp8(x_dtype: str, w_dtype: str) -> bool:
    """Feed a w8a16 fp8 tile to the MXU as is (the target chip takes the pair natively)?"""
    chip = target_chip()
    return chip is not None and w_dtype.startswith("float8") and _mxu_ok(chip, x_dtype, w_dtype)


def clamp(dim: int, block: int) -> int:
    return dim if 0 < dim <= block else block


def resolve_out_dtype(out_dtype, x, where):
    name = out_dtype or (dtype_name(x.dtype) if dtype_name(x.dtype) in OUT_DTYPES else "bfloat16")
    if name not in OUT_DTYPES:
        raise DTypeError(f"{where}: out_dtype {name!r} is not one of {OUT_DTYPES}")
    return jnp_dtype(name)
