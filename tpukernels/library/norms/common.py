"""What the normalization kernels share: defaults, VMEM-aware block sizing, BlockSpecs, argument checks
and the float32 helpers of their bodies (see the package docstring for the formulas).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl

from ... import dsl as tk
from ...chips import MiB
from ...dsl.validate import LANES, padded_bytes
from ...errors import ArgumentError, DeviceError, DTypeError


NAMESPACE = "tpukernels"
DEFAULT_RMS_EPS = 1e-6
DEFAULT_LAYER_NORM_EPS = 1e-5
#: RMSNorm casting modes: where the normalized value is rounded to the input dtype (see module docstring).
CASTINGS = ("llama", "gemma")
#: Candidate rows per grid step.
BLOCK_ROWS = (8, 16, 32, 64, 128, 256, 512, 1024)
#: VMEM for the double-buffered blocks of one launch, bytes: 12 MiB leaves 4 MiB of the smallest default
#: scoped limit (16 MiB on v4/v5e/v5p; 32 MiB on v6e/tpu7x) to Mosaic's internal scratch (the float32
#: temporaries of a block). Verified by compile-only tests on v5e/v6e/tpu7x.
VMEM_BUDGET_BYTES = 12 * MiB
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
F32 = jnp.float32


def row_bytes(h: int, row_dtypes, n_stats: int) -> int:
    """VMEM bytes per block row: each row-blocked array (and each ``(rows, 1)`` f32 statistic, padded to 128
    lanes) in two pipeline buffers."""
    lanes = tk.cdiv(h, LANES) * LANES
    return 2 * (sum(lanes * np.dtype(d).itemsize for d in row_dtypes) + n_stats * LANES * 4)


def vec_bytes(h: int, dtypes) -> int:
    """VMEM bytes of the ``(1, H)`` blocks (weight, bias, weight gradients), two buffers each."""
    return 2 * sum(padded_bytes([1, h], d) for d in dtypes)


def fit_block_rows(block_rows: int, n: int, per_row: int, fixed: int = 0) -> int:
    """Rows per block actually launched.

    ``block_rows`` halved (down to 8) until ``rows * per_row + fixed <= VMEM_BUDGET_BYTES``; then the whole
    array as one block when it has no more rows than that (a block equal to the full dim is always legal).

    Args:
        block_rows: the config value (upper bound); n: rows of the array (bucketed: a multiple of 8).
        per_row: VMEM bytes per block row (:func:`row_bytes`); fixed: bytes of row-independent blocks.
    """
    bm = int(block_rows)
    while bm > 8 and bm * per_row + fixed > VMEM_BUDGET_BYTES:
        bm //= 2
    return int(n) if 0 < n <= bm else bm


def heuristic_rows(per_row: int, fixed: int) -> dict:
    """Largest ``block_rows`` whose blocks fit the VMEM budget (memory-bound: bigger steps amortize the
    ~0.35 us per-step pipeline overhead)."""
    fits = [b for b in BLOCK_ROWS if b * per_row + fixed <= VMEM_BUDGET_BYTES]
    return {"block_rows": max(fits) if fits else BLOCK_ROWS[0]}


def tunables():
    return {"block_rows": tk.Tunable(BLOCK_ROWS, default=256,
                                     doc="rows per grid step (upper bound; lowered to fit VMEM and the row count)")}


def check_2d(name: str, x, h: int | None = None):
    if len(x.shape) != 2 or (h is not None and x.shape[1] != h):
        want = "[rows, H]" if h is None else f"[rows, {h}]"
        raise ArgumentError(f"{NAMESPACE}: {name} must be {want}, got shape {tuple(x.shape)}")


def check_vec(name: str, v, h):
    if v is not None and tuple(v.shape) != (1, h):
        raise ArgumentError(f"{NAMESPACE}: {name} must have shape [1, {h}] (internal op), got {tuple(v.shape)}")


def check_dtypes(*specs):
    for s in specs:
        if s is None:
            continue
        name = np.dtype(s.dtype).name
        if name not in ("bfloat16", "float32"):
            why = ("Mosaic cannot load float16 on TPU; widen to float32 (the public ops do)" if name == "float16"
                   else "use bfloat16 or float32")
            raise DTypeError(f"{NAMESPACE}: argument {s.name!r} has dtype {name}: {why}")


def check_casting(casting: str):
    if casting not in CASTINGS:
        raise ArgumentError(f"{NAMESPACE}: casting must be one of {CASTINGS}, got {casting!r}")


def row_spec(bm, h):
    return pl.BlockSpec((bm, h), lambda i: (i, 0))


def stat(bm):
    return pl.BlockSpec((bm, 1), lambda i: (i, 0))


def vec(h):
    return pl.BlockSpec((1, h), lambda i: (0, 0))


def stat_out(n):
    return tk.OutSpec((n, 1), F32)


def cost(flops_per_elem, n, h, nbytes):
    return pl.CostEstimate(flops=int(flops_per_elem * n * h), transcendentals=int(n), bytes_accessed=int(nbytes))


def spec_nbytes(*specs) -> int:
    return int(sum(s.size * s.itemsize for s in specs if s is not None))


def inv_rms(v, eps):
    """float32 ``1 / sqrt(mean(v**2) + eps)`` over the last axis, ``(rows, 1)``."""
    return jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)


def round_to_f16(v):
    """float32 ``v`` rounded to the nearest float16 value (ties to even, overflow to inf), as float32.

    Integer/float32 ops only: Mosaic (libtpu 0.0.52) cannot convert to float16 on v5e/v6e/tpu7x. Normal
    range: round the 23-bit mantissa to 10 bits (add ``0xFFF`` plus the lowest kept bit, clear 13 bits; a
    carry moves into the exponent, as it should). Below ``2**-14`` (float16 subnormals) the spacing is
    ``2**-24``: ``round_half_even(|v| * 2**24) * 2**-24`` with an explicit tie rule.
    """
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    sign = bits & jnp.int32(-(2**31))
    mag = bits & jnp.int32(0x7FFFFFFF)
    normal = jax.lax.bitcast_convert_type((mag + (0xFFF + ((mag >> 13) & 1))) & jnp.int32(~0x1FFF), F32)
    t = jax.lax.bitcast_convert_type(mag, F32) * 2.0**24  # exact (power-of-two scale); < 1024 where used
    fl = jnp.minimum(t, 2048.0).astype(jnp.int32)  # trunc == floor for t >= 0
    frac = t - fl.astype(F32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
    sub = (fl + up.astype(jnp.int32)).astype(F32) * 2.0**-24
    r = jnp.where(mag < 0x38800000, sub, normal)  # 0x38800000 = bits of 2**-14
    r = jnp.where((r > 65504.0) & (mag < 0x7F800000), jnp.inf, r)
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(r, jnp.int32) | sign, F32)


def round_to(v, dtype, round_f16: bool):
    """float32 ``v`` rounded to the public dtype (float16 emulated: the kernel sees it widened to float32)."""
    return round_to_f16(v) if round_f16 else v.astype(dtype).astype(F32)


def masked_row_sum(v, n_rows: int):
    """Sum of a ``(rows, H)`` f32 block over rows, dropping rows past ``n_rows`` (NaN/garbage in the last,
    overhanging block; ``jnp.where``, since ``NaN * 0`` is NaN). Static no-op when blocks tile exactly."""
    bm = v.shape[0]
    if n_rows % bm:
        v = tk.mask_tail(v, 0, pl.program_id(0) * bm, n_rows)
    return jnp.sum(v, axis=0, keepdims=True)


def weight_grad(ctx, name: str, g):
    w = ctx.args[name]
    if w is None or not ctx.needs_input_grad.get(name):
        return None
    return g.reshape(w.shape).to(w.dtype)


def check_x(op: str, x) -> int:
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"{op}: x must be a torch.Tensor [..., H], got {type(x).__name__}")
    if x.dim() < 1:
        raise ArgumentError(f"{op}: x must have at least one dim [..., H], got a 0-dim tensor")
    if x.dtype not in _SUPPORTED:
        hint = "; cast to float32 (TPUs have no float64)" if x.dtype == torch.float64 else ""
        raise DTypeError(f"{op}: x dtype {x.dtype} is not supported: use bfloat16, float16 or float32{hint}")
    h = x.shape[-1]
    if h == 0:
        raise ArgumentError(f"{op}: x has hidden size H = 0 (shape {tuple(x.shape)}); normalizing needs H >= 1")
    return h


def check_param(op: str, name: str, p, x, h):
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise ArgumentError(f"{op}: {name} must be a torch.Tensor [H] or None, got {type(p).__name__}")
    if p.dim() != 1 or p.shape[0] != h:
        raise ArgumentError(f"{op}: {name} must have shape [H] = [{h}] (H = x.shape[-1]), got {tuple(p.shape)}")
    if p.dtype not in _SUPPORTED:
        raise DTypeError(f"{op}: {name} dtype {p.dtype} is not supported: use bfloat16, float16 or float32")
    if p.device != x.device:
        raise DeviceError(f"{op}: {name} is on {p.device} but x is on {x.device}")


def check_float(op: str, name: str, v, minimum: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ArgumentError(f"{op}: {name} must be a finite float, got {v!r}")
    if minimum is not None and v < minimum:
        raise ArgumentError(f"{op}: {name} must be >= {minimum}, got {v!r}")
    return float(v)


def check_number(op: str, **values) -> None:
    """Type check of float arguments before the op's schema check (which raises an untyped RuntimeError);
    plain isinstance tests, so torch.compile traces it without a graph break. Ranges: in the op impl."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ArgumentError(f"{op}: {name} must be a finite float, got {v!r}")


def check_rms_args(op, x, weight, eps, offset, casting):
    h = check_x(op, x)
    check_param(op, "weight", weight, x, h)
    eps = check_float(op, "eps", eps, 0.0)
    offset = check_float(op, "offset", offset)
    if casting not in CASTINGS:
        raise ArgumentError(f"{op}: casting must be one of {CASTINGS}, got {casting!r}")
    if weight is None and offset != 0.0:
        raise ArgumentError(f"{op}: offset={offset} needs a weight (y = n * (offset + weight)); pass weight or offset=0")
    return h, eps, offset


def widen(t):
    """float16 -> float32 (exact). Mosaic (libtpu 0.0.52) cannot load, store or convert float16 vectors on
    v5e/v6e/tpu7x ("Invalid vector type for load"), so float16 goes through the float32 kernels, with the
    intermediate float16 roundings emulated in the kernel (``round_f16``), and the result is rounded once."""
    return None if t is None else (t.float() if t.dtype == torch.float16 else t)


def vec2d(p):
    return None if p is None else widen(p).reshape(1, -1)


#: The library fragment the public ops (rms_norm, fused_add_rms_norm, layer_norm) are defined in.
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
