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


def torch_to_jax(t):
    """A torch tensor's values as a jax array of the same dtype (a host copy; bf16 and fp8 bit-exact:
    numpy has no torch bf16 / float8, so they travel as f32 / uint8 bits). Non-tensors are returned as is."""
    import jax
    import jax.numpy as jnp
    import torch

    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().cpu().contiguous()
    dt = to_jax_dtype(t.dtype)
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:  # float8: bit pattern via uint8
        return jax.lax.bitcast_convert_type(jnp.asarray(t.view(torch.uint8).numpy()), dt)
    if t.dtype == torch.bfloat16:  # every bf16 is exactly an f32
        return jnp.asarray(t.float().numpy()).astype(dt)
    return jnp.asarray(t.numpy())


def jax_to_torch(a):
    """A jax array's values as a cpu torch tensor of the same dtype (bit-exact, as :func:`torch_to_jax`)."""
    import jax
    import jax.numpy as jnp
    import torch

    if not isinstance(a, jax.Array):
        return a
    dt = to_torch_dtype(a.dtype)
    if dt.is_floating_point and dt.itemsize == 1:
        return torch.from_numpy(np.array(jax.lax.bitcast_convert_type(a, jnp.uint8))).view(dt)
    if dt == torch.bfloat16:
        return torch.from_numpy(np.array(a.astype(jnp.float32))).to(dt)
    return torch.from_numpy(np.array(a))


def jax_reference(fn):
    """Adapt a reference written on jax arrays (``jnp``) to the ``tpu_kernel(reference=...)`` contract:
    the autotuner calls a reference with the kernel's arguments as torch tensors and compares torch
    outputs. Tensor arguments are converted with :func:`torch_to_jax`, outputs (an array or a tuple of
    arrays) back with :func:`jax_to_torch`; static arguments pass through."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out = fn(*(torch_to_jax(a) for a in args), **{k: torch_to_jax(v) for k, v in kwargs.items()})
        if isinstance(out, (tuple, list)):
            return type(out)(jax_to_torch(o) for o in out)
        return jax_to_torch(out)

    return wrapped
