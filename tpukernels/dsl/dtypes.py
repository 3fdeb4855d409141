"""torch <-> jax dtype mapping and the dtypes a TPU kernel may take."""

from __future__ import annotations

import numpy as np

from ..errors import DTypeError


def _table():
    import jax.numpy as jnp
    import torch

    return {
        torch.float32: jnp.float32,
        torch.bfloat16: jnp.bfloat16,
        torch.float16: jnp.float16,
        torch.int32: jnp.int32,
        torch.int16: jnp.int16,
        torch.int8: jnp.int8,
        torch.uint8: jnp.uint8,
        torch.bool: jnp.bool_,
        torch.float8_e4m3fn: jnp.float8_e4m3fn,
        torch.float8_e5m2: jnp.float8_e5m2,
    }


_T2J: dict | None = None
_J2T: dict | None = None

def _tables():
    global _T2J, _J2T
    if _T2J is None:
        _T2J = _table()
        _J2T = {np.dtype(v): k for k, v in _T2J.items()}
    return _T2J, _J2T


_WHY = {
    "float64": "TPUs have no float64; cast to float32 (x.float())",
    "int64": "TPU kernels have no int64 (jax runs with 32-bit ints); cast to int32",
    "complex64": "TPU kernels have no complex dtypes; split into real and imaginary parts",
    "complex128": "TPU kernels have no complex dtypes; split into real and imaginary parts",
}


def to_jax_dtype(torch_dtype, name: str = "tensor"):
    """jax dtype for a torch dtype.

    Raises:
        DTypeError: for dtypes no TPU kernel can take (float64, int64, complex), naming ``name``.
    """
    try:
        return _tables()[0][torch_dtype]
    except KeyError:
        short = str(torch_dtype).replace("torch.", "")
        raise DTypeError(f"{name}: dtype {short} is not supported: {_WHY.get(short, 'unsupported on TPU')}") from None


def to_torch_dtype(jax_dtype):
    return _tables()[1][np.dtype(jax_dtype)]


def check_jax_dtype(dtype, name: str = "array") -> None:
    """Raise :class:`DTypeError` for jax/numpy dtypes a TPU kernel cannot take."""
    short = np.dtype(dtype).name
    if short in _WHY:
        raise DTypeError(f"{name}: dtype {short} is not supported: {_WHY[short]}")
