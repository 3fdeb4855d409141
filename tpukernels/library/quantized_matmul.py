"""Quantized matmul: ``y = (x @ dequant(w_q)^T)`` with int8 / fp8 weights, per-output-channel scales.

Public op::

    torch.ops.tpukernels.quantized_matmul(x, w_q, w_scale, x_quant=None, out_dtype=None) -> Tensor
    tpukernels.library.quantized_matmul(x, w_q, w_scale, *, x_quant=None, out_dtype=None, config=None)

Shapes: ``x [..., K]`` (leading dims flattened to ``M`` tokens), ``w_q [N, K]`` (an ``nn.Linear`` weight
layout), ``w_scale [N]`` float32; result ``[..., N]``. The dequantized weight is
``W[n, k] = w_q[n, k] * w_scale[n]`` (symmetric, per output channel, no zero point). Modes:

=============  ===================  =====================================================================
mode           ``x`` / ``w_q``        what runs
=============  ===================  =====================================================================
w8a16          bf16|f32 / int8|fp8  ``w_q`` tile converted to ``x.dtype`` in VMEM (exact: int8 and fp8
                                    values are representable in bf16), ``x . w^T`` accumulated in f32,
                                    then ``* w_scale[n]``. On chips whose MXU takes ``bf16 x fp8``
                                    natively (jax ``tpu_info.is_matmul_supported``) the fp8 tile is fed as is.
w8a8 int8      bf16|f32 / int8      ``x`` quantized per token, int8 x int8 accumulated exactly in int32 on
                                    the MXU, then ``* x_scale[m] * w_scale[n]`` in f32. One fused kernel
                                    (``quantized_matmul_w8a8_kernel``) where :func:`fused_plan` has a plan
                                    (``x`` read once, ``x_q`` never written to HBM), else
                                    ``quantize_per_token_kernel`` then ``quantized_matmul_kernel``; both
                                    give the same values (one quantization formula, the same epilogue).
w8a8 fp8       bf16|f32 / fp8       same with ``x`` quantized to ``w_q``'s fp8 dtype, f32 accumulation.
=============  ===================  =====================================================================

Quantization (``quantize_weight`` and the per-token activation kernel; symmetric absmax, all f32):
``s = max_k |v[k]| * f32(1 / qmax)``, ``r = f32(1 / s)`` (one division per row; ``r = 0`` where ``s = 0``),
``q = clip(round_half_even(v * r), -qmax, qmax)`` for int8 (``qmax = 127``, so -128 is never produced and
the grid is symmetric), ``q = fp8(clip(v * r, -qmax, qmax))`` (round to nearest even) for fp8 with ``qmax``
the dtype's largest finite value (448 for e4m3fn, 57344 for e5m2). The per-element work is one f32
multiply by the row's reciprocal, not a division (a TPU divides in several vector ops: with the division,
the down-projection's quantization no longer fit under the MXU, see the bench reasons); ``v * r`` is
within 2 ulps of ``v / s``. A zero row gets ``s = 0`` and ``q = 0``. In cpu interpret mode the kernel's
``(q, s)`` equal :func:`quantize_reference` bit for bit; on a TPU, the per-row f32 division is not
guaranteed correctly rounded, so a ``q`` may differ by one grid step where ``v * r`` is within an ulp of a
rounding boundary (the error bounds below are stated for the quantized values the kernel used, so they
hold either way). Source: the absmax (symmetric) scheme of LLM.int8()
(Dettmers et al., arXiv:2208.07339, section 3.1, per-row "vector-wise" scaling) and SmoothQuant's per-token
activation / per-channel weight granularity (Xiao et al., arXiv:2211.10438, section 3).

Error (what the tests check, ``u`` = unit roundoff of the output dtype, 2^-8 bf16 / 2^-24 f32, and
``u32 = 2^-24``): against a float64 product of the **dequantized** operands,

* w8a8 int8: the int32 sum is exact (``|acc| <= 127^2 K < 2^31`` for ``K <= 133143``, checked), so the only
  errors are the int32->f32 conversion and two f32 scale products (3 ``u32`` relative) and the final
  rounding: ``|y - ref| <= (u + 4 u32) |ref| + (K + 2) 2^-52 (|x'| @ |W|^T)`` elementwise (the last term
  is the float64 reference's own rounding: it matters only where the sum cancels to ~0);
* w8a16 / fp8: products are exact in f32, the f32 sum of K terms errs by at most ``(K - 1) u32 sum|x||W|``
  (any summation order; Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5), plus
  the scale product and the final rounding: ``|y - ref| <= u |ref| + (K + 2) u32 (|x| @ |W|^T)``.

Range. The scales are applied after the dot, so the f32 accumulator holds ``x · w_q`` (w8a16) and
overflows to ``inf`` once ``sum_k |x[k]| |w_q[n, k]|`` passes the f32 maximum (3.4e38): already for one
element ``|x| > 3.4e38 / qmax`` (2.7e36 for int8 weights, 7.6e35 e4m3fn, 5.9e33 e5m2) where the float64
product with the small dequantized weights is finite. w8a8 quantizes ``x`` first and has no such limit.

NaN. A NaN in a row of ``x`` gives that row a NaN absmax on a TPU (the max propagates NaN), so the w8a8 row is
NaN. In cpu interpret mode XLA:CPU's vectorized max reduction can drop NaN (jax 0.10.2; seen with >= 16
rows, cf. openxla/xla#21461), so there a NaN can vanish from the scale: interpret-mode w8a8 results for
non-finite activations are not the TPU's.

Chip support comes from jax's ``pltpu.get_tpu_info_for_chip(...).is_matmul_supported(lhs, rhs)`` (see
:func:`supported_modes`), never a table here: w8a8 int8 needs ``(int8, int8)``; w8a8 fp8 needs
``(fp8, fp8)``; fp8 weights need the chip to take that fp8 dtype on the MXU at all (``(fp8, fp8)`` or
``(bf16, fp8)``). With libtpu 0.0.52 / jax 0.10.2 that gives: v5e, v6e: int8 both modes, float8_e5m2 both
modes, no float8_e4m3fn; tpu7x: no int8 MXU (w8a16 with int8 weights still works: it runs on the bf16
MXU), float8_e4m3fn and float8_e5m2 in both modes (``bf16 x fp8`` natively). The chip checked is the
target of the call: the live TPU, the compile-only target (``tk.compile_for``), or on cpu
``TPUKERNELS_TARGET_CHIP``; a cpu interpret run with no target chip checks nothing (the interpreter has
every dtype) — set ``TPUKERNELS_TARGET_CHIP`` to get the error a TPU would give. An unsupported pair
raises :class:`~tpukernels.errors.ChipError` naming the chip and the modes it supports.

Kernels (torch ops, ``[rows, cols]`` operands):

* ``tpukernels::quantized_matmul_kernel(x [M,K], w_q [N,K], w_scale [1,N], x_scale [M,1]?, out_dtype)``:
  grid ``(M/bm, N/bn, K/bk)``, K innermost (``arbitrary``), f32 or int32 VMEM accumulator, scales in the
  epilogue. K tails are masked on both operands (``tk.mask_tail``, NaN-safe) on the last K step only.
  Decode (one row block of at most ``STREAM_MAX_M = 128`` rows, blocks that tile ``w_q`` exactly:
  :func:`stream_plan`) takes a weight-streaming launch instead: ``x`` whole in VMEM, ``w_q`` left in HBM and
  copied by the body, tile by tile over the grid ``(1, N/bn, K/bk)``, into a two-slot scratch, each tile as
  ``WEIGHT_DMAS = 2`` concurrent row-slab DMAs (the next tile's copies start before the current tile's dot);
  same dot, accumulator and epilogue, so the same values as the blocked launch at the same ``bk``.
* ``tpukernels::quantize_per_token_kernel(x [M,K], dtype) -> (x_q [M,K], x_scale [M,1])``: row blocks
  of the whole K (absmax needs the full row).
* ``tpukernels::quantized_matmul_w8a8_kernel(x [M,K] bf16|f32, w_q [N,K], w_scale [1,N], out_dtype)``: the
  fused w8a8 path. Grid ``(M/bm, N/bn, K/bk)``, all sequential; ``x`` stays in HBM (``pl.ANY``) and each
  row block at full K is DMA'd once into VMEM; row block ``i+1`` is DMA'd during row block ``i``'s first
  N sweeps and its absmax and quantization (into the second slot of a two-slot int8 / fp8 VMEM scratch)
  run during the last N sweeps, in the same branch as those steps' dots so vector and MXU work can
  overlap; only row block 0 is prepared serially. Blocks and the fallback rule: :func:`fused_plan`
  (``bm`` divides ``M``, footprint within 3/4 of the chip's VMEM from tpu_info).
* ``tpukernels::quantized_matmul_bwd_dx(g [M,N], w_q [N,K], w_scale [1,N]) -> [M,K]``: ``d_x = (g * w_scale)
  @ w_q`` (the scale is applied to the ``g`` tile in f32 and rounded once to ``g.dtype``).

Autograd: ``d_x`` for w8a16 (weights frozen: ``w_q`` and ``w_scale`` get no gradient). w8a8 has no
gradient (rounding has derivative zero almost everywhere): its forward runs with ``x.requires_grad``
(inference without ``torch.no_grad()``), and a backward that reaches it raises ArgumentError rather than
silently returning zeros.

Tunables ``bm, bk, bn`` (clamped to the problem as in :mod:`tpukernels.library.matmul`); defaults:
:func:`heuristic`, then per-chip shipped data ``tpukernels/data/autotuning/<chip>/
tpukernels.quantized_matmul_kernel.json`` / ``tpukernels.quantized_matmul_w8a8_kernel.json`` chosen by
libtpu's static estimate (a model, not a measurement): the w8a16 prefill entries from full-program
estimates at 2048 tokens (the bench family's method; each entry's evidence lists the candidates), the decode
entries from full-program estimates of every streaming ``(bk, bn)`` (``benchmarks/quantized_matmul.py
--decode-sweep``: lowest libtpu cycles), the two-kernel w8a8 entries from ``benchmarks/quantized_matmul.py
--write-defaults``; the fused kernel's from
2048-token estimates on v6e (v5e takes the same blocks, tpu7x those with ``bm`` halved for its VMEM and
compile-only evidence: libtpu cannot estimate its fp8 pack). A public call reaches them: it passes
``out_dtype=None`` to the kernel for the default output dtype, the statics the entries are keyed under.

Performance (libtpu 0.0.52 static estimates + rooflines, a MODEL, not measurements; ``tpukernels bench
--family quantized_matmul``; Llama-3-8B MLP, 8192 tokens): w8a16 runs at the bf16 matmul's speed where
the MXU is the limit — 95-98% of the bf16 roofline at the shipped blocks (bm=1024, bn=2048, bk 2048-4096);
against XLA's dequantize + dot the up-projection is 1.03x (v5e), 1.04x (v6e), 1.00x (tpu7x); on the
down-projection libtpu aborts on XLA's program, so XLA's figure is only its roofline (a floor), which ours
reaches to 95-98% — and halves the weight bytes where HBM is the limit (decode, 16-64 tokens, below).
Decode (w8a16, Llama-3-8B MLP at 16 / 64 tokens; the full programs estimated by libtpu, ``benchmarks/
quantized_matmul.py --decode-sweep``): with the blocked launch (one weight DMA in flight) libtpu counted
more cycles than the HBM time on v6e (16x4096 -> 14336: 38.9 µs of cycles, HBM roofline 36.2 µs; XLA's
fusion 34.8 µs, so 0.93x XLA) and on v5e at 64 tokens (79.3 µs vs 74.6 µs). The parts, estimated apart (v6e,
16 tokens, bk=4096, bn=1024): the weight DMAs alone 24.6 µs, the dots with the weight tile resident in VMEM
(conversion included) 29.2 µs, both together 38.5 µs — a third of the DMA time exposed; with the tile copied
as two concurrent DMAs (or three slots deep) the whole kernel is 28.6 µs (30.0 µs), the dots' time. The
int8 -> bf16 conversion is not the limit (a bf16 tile of the same shape, no conversion: 32.3 µs; the scale
epilogue: < 0.1%). The streaming launch: v5e 49.3 / 50.6 / 51.5 µs of cycles, v6e 28.1 / 28.6 / 29.4 µs
(16x4096, 64x4096, 64x14336), all below the HBM roofline, so the model time is the roofline (100%: XLA's
figure on those chips, 1.00x) — how the hardware's DMA engines behave with one or two copies in flight is
not measured here. tpu7x: 21.1 / 21.9 / 21.4 µs, 75-77% of its HBM roofline (was 72%): not the weight
stream but the MXU's intake of bf16 weights bounds it — the same dots with the weights resident in VMEM take
22.4 µs (int8 converted) / 23.8 µs (bf16), and the whole streaming kernel with fp8 weights fed natively
(bf16 x fp8) 12.3 µs (HBM-bound); every weight element passes the bf16 MXU once whatever the blocking
(~1200 per cycle in libtpu's model, 2.6e12/s, below tpu7x's 3.7e12 1-byte weights/s of HBM).
w8a8 int8 (tpu_info's int8 peak is 2x bf16 on v5e and v6e), fused kernel, before the reciprocal
quantization and the shipped entries: 1.93x / 1.78x the bf16 matmul (up / down projection; 96% / 88% of
the int8 roofline) on v5e, 1.78x / 1.42x on v6e (86% / 68%); against XLA's fused quantize + int8 dot
1.02x (v5e) / 1.05x (v6e) up, 0.97x on v6e down; the current figures are the bench family's
(``benchmarks/results/quantized_matmul.json``). Before the fusion (separate quantize pass: 3 bytes of HBM
traffic per activation) the same rows were 1.84x / 1.69x and 1.42x / 1.27x the bf16 matmul and 0.84-0.97x
XLA. What remains is the serial quantization of the first row block and the part of the later ones not
hidden under the MXU (vector work proportional to K: the down-projection's; bench reasons). tpu7x's fp8
kernels compile but libtpu's static profiler dies on the f32 -> fp8 pack (no figure).

Sources: JAX Pallas TPU matmul guide (blocked matmul, f32 scratch accumulator) and JAX's
``jax/experimental/pallas/ops/tpu/matmul.py``; tpu-inference's quantized matmul (int8 weights with
per-channel scales applied after the dot) for the layout of the epilogue.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Optional

import numpy as np
import torch

from .. import dsl as _dsl
from ..dsl.validate import padded_bytes
from ._vmem import SHIPPED_CHIPS, MiB, scoped_vmem_limit
from ..errors import ArgumentError, ChipError, DeviceError, DTypeError

WEIGHT_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
X_DTYPES = ("bfloat16", "float32")
OUT_DTYPES = ("bfloat16", "float32")
X_QUANT = (None, "int8", "fp8")
#: largest K whose int8 x int8 sum cannot overflow int32: 127 * 127 * K < 2^31
INT32_MAX_K = (2**31 - 1) // (127 * 127)
U32 = 2.0**-24

TUNABLES = {
    "bm": _dsl.Tunable([512, 128, 256, 1024, 2048], default=512, doc="rows of the output block (tokens)"),
    "bk": _dsl.Tunable([1024, 256, 512, 2048, 4096], default=1024, doc="contraction block (K)"),
    "bn": _dsl.Tunable([1024, 256, 512, 2048, 4096], default=1024, doc="columns of the output block (N)"),
}
TUNABLES_Q = {
    "bm": _dsl.Tunable([256, 32, 64, 128, 512, 1024], default=256, doc="rows per block (the block holds whole rows)"),
}


# ----------------------------------------------------------------------------------------------- dtypes, chips
def _name(dt) -> str:
    if isinstance(dt, torch.dtype):
        return str(dt).replace("torch.", "")
    return np.dtype(dt).name


def _jnp(name: str):
    import jax.numpy as jnp

    return np.dtype(getattr(jnp, name))


def qmax(dtype) -> float:
    """Largest magnitude of the symmetric grid of ``dtype``: 127 for int8, the largest finite fp8 value."""
    name = _name(dtype)
    if name == "int8":
        return 127.0
    if name in ("float8_e4m3fn", "float8_e5m2"):
        return float(torch.finfo(getattr(torch, name)).max)
    raise DTypeError(f"quantize: dtype {name} is not one of {WEIGHT_DTYPES}")


def _mxu_ok(chip, lhs: str, rhs: str) -> bool:
    """jax's ``TpuInfo.is_matmul_supported`` for one core of ``chip`` (natively, no casting)."""
    return bool(chip.info.is_matmul_supported(_jnp(lhs), _jnp(rhs)))


def supported_modes(chip) -> list[tuple[Optional[str], str]]:
    """``(x_quant, w dtype)`` pairs :func:`quantized_matmul` runs on ``chip`` (bf16 activations).

    Derived from jax's ``TpuInfo.is_matmul_supported`` (module docstring): w8a16 with int8 weights runs
    wherever the MXU takes bf16; fp8 weights need the chip's MXU to take that fp8 dtype (with itself or
    with bf16); w8a8 needs the quantized pair itself.
    """
    from ..chips import get_chip

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


def _describe(modes) -> str:
    return ", ".join(f"{'w8a16' if xq is None else 'w8a8'} {w} (x_quant={xq!r})" for xq, w in modes)


def _target_chip():
    """The chip this call is for: the launch target, else the dispatch chip (live TPU / env), else None."""
    from ..lowering import launch_chip

    chip = launch_chip()
    if chip is not None:
        return chip
    from ..autotune.db import dispatch_chip
    from ..chips import get_chip

    name = dispatch_chip()
    return get_chip(name) if name else None


def check_chip(x_quant: Optional[str], w_dtype: str, chip=None, where: str = "quantized_matmul") -> None:
    """Raise :class:`ChipError` if ``chip`` (default: the call's target, None: unchecked) lacks the mode."""
    chip = _target_chip() if chip is None else chip
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
            f"{chip.name}: {_describe(modes)}"
        )


def _native_fp8(x_dtype: str, w_dtype: str) -> bool:
    """Feed a w8a16 fp8 tile to the MXU as is (the target chip takes the pair natively)?"""
    chip = _target_chip()
    return chip is not None and w_dtype.startswith("float8") and _mxu_ok(chip, x_dtype, w_dtype)


# ----------------------------------------------------------------------------------------------- reference
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


def _weight_dtype(dtype, where: str) -> str:
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
    name = _weight_dtype(dtype, "quantize_weight")
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ArgumentError(f"quantize_weight: w must be a 2-D [N, K] tensor, got "
                            f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if not w.dtype.is_floating_point:
        raise DTypeError(f"quantize_weight: w must be floating point, got {_name(w.dtype)}")
    with torch.no_grad():
        bad = ~torch.isfinite(w).all(dim=1)
        if w.device.type != "meta" and bool(bad.any()):  # meta: shapes only (compile_for, fake tensors)  # a NaN / inf row would get a NaN / inf scale and poison its whole output channel
            r = int(bad.nonzero()[0, 0])
            raise ArgumentError(f"quantize_weight: row {r} of w (output channel {r}) holds NaN or inf; an absmax "
                                f"scale needs finite weights")
        return quantize_reference(w.detach(), name)


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


# ----------------------------------------------------------------------------------------------- kernel bodies
def _qmm_body(x_ref, w_ref, ws_ref, *refs, layout, k_size, blk_k, n_k, has_xs, acc_int, dequant_to, precision,
              stream=None):
    """One output block, one K step (``layout="nt"``: forward ``x . w_q^T``; ``"nn"``: ``d_x = (g*s) . w_q``).

    ``refs`` = ``[xs_ref,] o_ref, acc_ref``. First K step stores the partial product, middle steps add,
    the last applies the scales and writes the output (a single K step skips the accumulator).
    ``stream``: the weight-streaming launch of :func:`stream_plan` (``dict(n_j, blk_n, ndma)``), see
    :func:`_stream_body`.
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    if stream is not None:
        return _stream_body(x_ref, w_ref, ws_ref, *refs, k_size=k_size, blk_k=blk_k, n_k=n_k, has_xs=has_xs,
                            acc_int=acc_int, dequant_to=dequant_to, precision=precision, **stream)
    if has_xs:
        xs_ref, o_ref, acc_ref = refs
    else:
        xs_ref, (o_ref, acc_ref) = None, refs
    k = pl.program_id(2)
    dims = (((1,), (1,)), ((), ())) if layout == "nt" else (((1,), (0,)), ((), ()))
    w_kax = 1 if layout == "nt" else 0
    acc_t = jnp.int32 if acc_int else jnp.float32

    def contribution(masked: bool):
        x = x_ref[...]
        w = w_ref[...]
        if layout == "nn":  # the contraction runs over N: scale g's columns by w_scale (f32, one rounding)
            x = (x.astype(jnp.float32) * ws_ref[...]).astype(x_ref.dtype)
        if masked:  # K tail: both operands (NaN-safe jnp.where)
            x = _dsl.mask_tail(x, 1, k * blk_k, k_size)
            w = _dsl.mask_tail(w, w_kax, k * blk_k, k_size)
        if dequant_to is not None:  # int8 / fp8 -> bf16 / f32 is exact
            w = w.astype(dequant_to)
        return jax.lax.dot_general(x, w, dims, precision=precision, preferred_element_type=acc_t)

    def epilogue(acc):
        z = acc.astype(jnp.float32)
        if layout == "nt":
            z = z * ws_ref[...]
        if xs_ref is not None:
            z = z * xs_ref[...]
        o_ref[...] = z.astype(o_ref.dtype)

    tail = k_size % blk_k != 0

    def step(fn, last: bool):
        fn(contribution(tail and last))

    if n_k == 1:
        step(epilogue, True)
        return

    def store(d):
        acc_ref[...] = d

    def add(d):
        acc_ref[...] += d

    def finish(d):
        epilogue(acc_ref[...] + d)

    pl.when(k == 0)(lambda: step(store, False))
    pl.when(jnp.logical_and(k > 0, k < n_k - 1))(lambda: step(add, False))
    pl.when(k == n_k - 1)(lambda: step(finish, True))


def _stream_body(x_ref, w_hbm, ws_ref, *refs, k_size, blk_k, n_k, has_xs, acc_int, dequant_to, precision, n_j, blk_n,
                 ndma):
    """Weight-streaming forward (one row block: decode): ``x [M, K]`` resident in VMEM, ``w_q`` in HBM.

    Grid ``(1, n_j, n_k)``, sequential. Step ``t = j * n_k + k`` uses weight tile ``(j, k)`` from slot ``t % 2``
    of ``wbuf [2, blk_n, blk_k]``; it starts tile ``t + 1``'s copies into the other slot before waiting for its
    own. Each tile is copied as ``ndma`` row slabs of ``blk_n / ndma`` rows, so ``ndma`` DMAs are in flight
    during every step's dot (module docstring, "Performance": with one, libtpu's model leaves a third of the
    weight stream exposed). Then ``acc (+)= x[:, chunk k] . w^T`` and the epilogue of :func:`_qmm_body`.
    ``refs`` = ``[xs_ref,] o_ref, wbuf, sem, acc_ref``; ``K % blk_k == 0`` and ``N % blk_n == 0``
    (:func:`stream_plan`), so no tile is partial.
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    if has_xs:
        xs_ref, o_ref, wbuf, sem, acc_ref = refs
    else:
        xs_ref, (o_ref, wbuf, sem, acc_ref) = None, refs
    j, k = pl.program_id(1), pl.program_id(2)
    t = j * n_k + k
    rows = blk_n // ndma

    def copies(step, slot):
        r0, c0 = (step // n_k) * blk_n, (step % n_k) * blk_k
        return [pltpu.make_async_copy(
            w_hbm.at[pl.ds(pl.multiple_of(r0 + p * rows, rows), rows), pl.ds(pl.multiple_of(c0, blk_k), blk_k)],
            wbuf.at[slot, pl.ds(p * rows, rows)], sem.at[slot, p]) for p in range(ndma)]

    @pl.when(t == 0)
    def _():
        for c in copies(0, 0):
            c.start()

    @pl.when(t + 1 < n_j * n_k)
    def _():
        for c in copies(t + 1, (t + 1) % 2):
            c.start()

    slot = t % 2
    for c in copies(t, slot):
        c.wait()
    x = x_ref[...] if n_k == 1 else x_ref[:, pl.ds(pl.multiple_of(k * blk_k, 128), blk_k)]
    w = wbuf[slot]
    if dequant_to is not None:  # int8 / fp8 -> bf16 / f32 is exact
        w = w.astype(dequant_to)
    d = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.int32 if acc_int else jnp.float32)

    def epilogue(acc):
        z = acc.astype(jnp.float32) * ws_ref[...]
        if xs_ref is not None:
            z = z * xs_ref[...]
        o_ref[...] = z.astype(o_ref.dtype)

    if n_k == 1:
        epilogue(d)
        return

    @pl.when(k == 0)
    def _():
        acc_ref[...] = d

    @pl.when(jnp.logical_and(k > 0, k < n_k - 1))
    def _():
        acc_ref[...] += d

    @pl.when(k == n_k - 1)
    def _():
        epilogue(acc_ref[...] + d)


def _row_absmax(x):
    """``max_k |x[:, k]|`` as ``[rows, 1]`` f32 (exact: abs and max do not round, so computing them in ``x``'s
    own dtype — bf16 on chips with a bf16 VPU, half the vector work — and in any chunking gives the same)."""
    import jax.numpy as jnp

    return jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32)


def _reciprocal(scale):
    """``r = f32(1 / s)`` per row, ``0`` where ``s == 0`` (module docstring): ``q = v * r``."""
    import jax.numpy as jnp

    zero = scale == 0
    return jnp.where(zero, 0.0, 1.0 / jnp.where(zero, 1.0, scale))


def _quantize_values(x, recip, qm, is_int, dtype):
    """``x [rows, c]`` -> ``q`` in ``dtype`` given the rows' reciprocal scales ``[rows, 1]``
    (:func:`_reciprocal`; module docstring formula).

    The one definition both w8a8 paths use (``quantize_per_token_kernel`` and the fused
    ``quantized_matmul_w8a8_kernel``), so they produce the same ``q`` for the same ``x`` and scale."""
    import jax.numpy as jnp

    q = x.astype(jnp.float32) * recip
    if is_int:
        q = jnp.clip(jnp.round(q), -qm, qm).astype(jnp.int32)
    else:
        q = jnp.clip(q, -qm, qm)
    return q.astype(dtype)


def _quantize_body(x_ref, q_ref, s_ref, *, qm, is_int):
    """Rows of ``x`` -> symmetric absmax quantization (module docstring), f32 arithmetic."""
    scale = _row_absmax(x_ref[...]) * np.float32(1.0 / qm)
    q_ref[...] = _quantize_values(x_ref[...], _reciprocal(scale), qm, is_int, q_ref.dtype)
    s_ref[...] = scale


def _w8a8_body(x_hbm, w_ref, ws_ref, o_ref, xbuf, sem, xq_ref, xs_ref, xr_ref, acc_ref, *, k_size, blk_k, n_k, n_j, bm,
               parts, qm, is_int, acc_int, qchunk):
    """Fused w8a8: one output block ``(i, j)``, one K step ``k`` (grid order i, j, k; all sequential).

    ``xq_ref [2, bm, K']`` holds two quantized row blocks (slot ``i % 2`` is row block ``i``, the other is
    being filled), ``xs_ref [2, bm, 1]`` their scales, ``xr_ref`` the scales' reciprocals (:func:`_reciprocal`),
    ``xbuf [bm, K]`` the raw ``x`` rows of the next block.
    Schedule of row block ``i`` (software-pipelined one row block ahead, so the vector work of the
    quantization runs beside the MXU work of the current block instead of before it):

    * ``(i, 0, 0)``: row block 0 only: DMA it, absmax, quantize (the one serial prologue). Then start the
      DMA of row block ``i + 1`` into ``xbuf``.
    * the last ``parts`` N sweeps ``j = n_j - parts + p``: at ``k == 0`` (``p == 0``: wait for the DMA) the
      absmax of rows ``[p*bm/parts, (p+1)*bm/parts)`` of row block ``i + 1``; at every ``k`` the quantization
      of K chunk ``k`` of those rows into the other slot. Each of these steps also does its own dot, in the
      same branch (one basic block, so the scheduler can interleave vector and MXU work).
    * every step: ``acc (+)= xq[i % 2][:, chunk k] . w_q_tile^T``; epilogue as :func:`_qmm_body`:
      ``acc * w_scale[n] * x_scale[m]``.
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    i, j, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    gi = pl.num_programs(0)
    slot, nxt = i % 2, 1 - i % 2
    acc_t = jnp.int32 if acc_int else jnp.float32
    inv = np.float32(1.0 / qm)
    rows = bm // parts
    tail = k_size % blk_k
    last_w = tail or blk_k  # width of the last K chunk

    def copy(row_block):
        return pltpu.make_async_copy(x_hbm.at[pl.ds(row_block * bm, bm)], xbuf, sem.at[0])

    def absmax(r0, nr):
        """``[nr, 1]`` f32 absmax of rows ``r0..`` of ``xbuf`` over all K (static column chunks; in ``x``'s
        dtype until the end, exact as :func:`_row_absmax`)."""
        m, rest = None, None
        for c0 in range(0, k_size, qchunk):
            w_ = min(qchunk, k_size - c0)
            a = jnp.abs(xbuf[pl.ds(r0, nr), pl.ds(c0, w_)])
            if w_ == qchunk:
                m = a if m is None else jnp.maximum(m, a)
            else:
                rest = jnp.max(a, axis=1, keepdims=True)
        out = [jnp.max(m, axis=1, keepdims=True)] if m is not None else []
        out += [rest] if rest is not None else []
        return (out[0] if len(out) == 1 else jnp.maximum(out[0], out[1])).astype(jnp.float32)

    def set_scale(dst, r0, nr):
        s = absmax(r0, nr) * inv
        xs_ref[dst, pl.ds(r0, nr), :] = s
        xr_ref[dst, pl.ds(r0, nr), :] = _reciprocal(s)

    def quantize(dst, r0, nr, c0, width):
        """Quantize ``xbuf[r0:r0+nr, c0:c0+width]`` into ``xq_ref[dst]`` (``c0`` static or 128-aligned)."""
        recip = xr_ref[dst, pl.ds(r0, nr), :]
        for off in range(0, width, qchunk):
            w_ = min(qchunk, width - off)
            start = c0 + off if isinstance(c0, int) else pl.multiple_of(c0 + off, 128)
            v = xbuf[pl.ds(r0, nr), pl.ds(start, w_)]
            xq_ref[dst, pl.ds(r0, nr), pl.ds(start, w_)] = _quantize_values(v, recip, qm, is_int, xq_ref.dtype)

    @pl.when(jnp.logical_and(i == 0, jnp.logical_and(j == 0, k == 0)))
    def _():  # prologue: row block 0, serial
        copy(0).start()
        copy(0).wait()
        set_scale(0, 0, bm)
        quantize(0, 0, bm, 0, k_size)

    @pl.when(jnp.logical_and(i + 1 < gi, jnp.logical_and(j == 0, k == 0)))
    def _():
        copy(i + 1).start()

    dims = (((1,), (1,)), ((), ()))
    p = j - (n_j - parts)  # row part of the next block quantized in this sweep (valid when >= 0)
    r0 = 0 if parts == 1 else pl.multiple_of(jnp.maximum(p, 0) * rows, 32)

    def next_block_work(phase):
        if phase in ("first", "only"):
            if parts == 1:
                copy(i + 1).wait()
            else:
                pl.when(p == 0)(lambda: copy(i + 1).wait())
            set_scale(nxt, r0, rows)
        if phase == "only":
            quantize(nxt, r0, rows, 0, k_size)
        elif phase == "first":
            quantize(nxt, r0, rows, 0, blk_k)
        elif phase == "mid":
            quantize(nxt, r0, rows, k * blk_k, blk_k)
        else:
            quantize(nxt, r0, rows, (n_k - 1) * blk_k, last_w)

    def contribution(masked: bool):
        if n_k == 1:
            x = xq_ref[slot]
        else:
            x = xq_ref[slot, :, pl.ds(pl.multiple_of(k * blk_k, 128), blk_k)]
        w = w_ref[...]
        if masked:  # K tail: xq's columns past K were never written, w_q's tile is padding
            x = _dsl.mask_tail(x, 1, k * blk_k, k_size)
            w = _dsl.mask_tail(w, 1, k * blk_k, k_size)
        return jax.lax.dot_general(x, w, dims, preferred_element_type=acc_t)

    def epilogue(acc):
        z = acc.astype(jnp.float32)
        z = z * ws_ref[...]
        z = z * xs_ref[slot]
        o_ref[...] = z.astype(o_ref.dtype)

    def acc_work(phase):
        if phase == "only":
            epilogue(contribution(False))
        elif phase == "first":
            acc_ref[...] = contribution(False)
        elif phase == "mid":
            acc_ref[...] += contribution(False)
        else:
            epilogue(acc_ref[...] + contribution(tail != 0))

    quant_now = jnp.logical_and(i + 1 < gi, p >= 0)
    phases = {"only": k == 0} if n_k == 1 else {
        "first": k == 0, "mid": jnp.logical_and(k > 0, k < n_k - 1), "last": k == n_k - 1}
    for phase, cond in phases.items():
        if phase == "mid" and n_k < 3:
            continue

        @pl.when(jnp.logical_and(cond, quant_now))
        def _(phase=phase):
            next_block_work(phase)
            acc_work(phase)

        @pl.when(jnp.logical_and(cond, jnp.logical_not(quant_now)))
        def _(phase=phase):
            acc_work(phase)


# ----------------------------------------------------------------------------------------------- launch
def _clamp(dim: int, block: int) -> int:
    return dim if 0 < dim <= block else block


def problem(layout, x, w, ws, xs=None, where="tpukernels::quantized_matmul_kernel"):
    """``(M, N, K)`` of a kernel call after checking ranks, agreement and dtypes (``N`` = output columns).

    Raises:
        ArgumentError: ranks, contraction dims, scale shapes, int32 overflow risk (K too large).
        DTypeError: dtypes outside the supported pairs.
    """
    for t, n in ((x, "x"), (w, "w_q"), (ws, "w_scale")):
        if len(t.shape) != 2:
            raise ArgumentError(f"{where}: {n} must be 2-D, got shape {tuple(t.shape)}")
    dx, dw = _name(x.dtype), _name(w.dtype)
    if dw not in WEIGHT_DTYPES:
        raise DTypeError(f"{where}: w_q dtype {dw} is not one of {WEIGHT_DTYPES}")
    if _name(ws.dtype) != "float32":
        raise DTypeError(f"{where}: w_scale must be float32, got {_name(ws.dtype)}")
    Nw, Kw = w.shape
    if layout == "nt":
        M, K = x.shape
        N = Nw
        if K != Kw:
            raise ArgumentError(f"{where}: x {tuple(x.shape)} and w_q {tuple(w.shape)}: K = {K} vs {Kw}")
    else:  # g [M, Nw] . w_q [Nw, Kw] -> [M, Kw]
        M, K = x.shape
        N = Kw
        if K != Nw:
            raise ArgumentError(f"{where}: g {tuple(x.shape)} and w_q {tuple(w.shape)}: N = {K} vs {Nw}")
    if tuple(ws.shape) != (1, Nw):
        raise ArgumentError(f"{where}: w_scale must have shape (1, {Nw}) here, got {tuple(ws.shape)}")
    if xs is not None:
        if tuple(xs.shape) != (M, 1) or _name(xs.dtype) != "float32":
            raise ArgumentError(f"{where}: x_scale must be float32 (M, 1) = ({M}, 1), got {tuple(xs.shape)} "
                                f"{_name(xs.dtype)}")
        if dx != dw:
            raise DTypeError(f"{where}: with x_scale (w8a8) x must have w_q's dtype {dw}, got {dx}")
        if dx == "int8" and K > INT32_MAX_K:
            raise ArgumentError(f"{where}: K = {K} > {INT32_MAX_K}: an int8 x int8 sum may overflow int32")
    elif dx not in X_DTYPES:
        raise DTypeError(f"{where}: x dtype {dx} is not one of {X_DTYPES} (w8a16; pass x_scale for w8a8)")
    return M, N, K


def _out_dtype(out_dtype, x, where):
    name = out_dtype or (_name(x.dtype) if _name(x.dtype) in OUT_DTYPES else "bfloat16")
    if name not in OUT_DTYPES:
        raise DTypeError(f"{where}: out_dtype {name!r} is not one of {OUT_DTYPES}")
    return _jnp(name)


def vmem_bytes(bm, bk, bn, x_dtype, w_dtype, out_dtype, has_xs, acc_shape, dequant_to=None) -> int:
    """Double-buffered blocks + accumulator + the dequantized weight tile (Mosaic's temporary), bytes."""
    total = 2 * (padded_bytes((bm, bk), x_dtype) + padded_bytes((bn, bk), w_dtype) + padded_bytes((bm, bn), out_dtype)
                 + padded_bytes((1, bn), "float32"))
    if has_xs:
        total += 2 * padded_bytes((bm, 1), "float32")
    if dequant_to is not None:
        total += padded_bytes((bn, bk), dequant_to)
    return total + padded_bytes(acc_shape, "float32")


#: largest token count (rows of x) the forward kernel streams the weights for (:func:`stream_plan`)
STREAM_MAX_M = 128
#: concurrent DMAs per weight tile on the streaming path (row slabs of ``bn / WEIGHT_DMAS`` rows)
WEIGHT_DMAS = 2


def stream_plan(M, N, K, bm, bk, bn) -> Optional[dict]:
    """The forward kernel's weight-streaming launch (decode) for blocks ``bm, bk, bn`` (before clamping), or None.

    The rule: one row block (``M <= bm``) of at most :data:`STREAM_MAX_M` rows, and clamped blocks that tile
    the weight exactly (``N % bn == 0``, ``K % bk == 0``), with ``bk`` a multiple of 128 unless it is all of
    ``K`` and ``bn / WEIGHT_DMAS`` a multiple of 32 (the 8-bit sublane tile). Everything else takes the
    blocked launch (grid ``(M/bm, N/bn, K/bk)``, masked tails). Returns ``dict(n_j, blk_n, ndma)``.
    """
    bm_, bn_, bk_ = _clamp(M, bm), _clamp(N, bn), _clamp(K, bk)
    if not 0 < M <= min(bm_, STREAM_MAX_M) or N % bn_ or K % bk_:
        return None
    if (bk_ != K and bk_ % 128) or bn_ % (32 * WEIGHT_DMAS):
        return None
    return dict(n_j=N // bn_, blk_n=bn_, ndma=WEIGHT_DMAS)


def make_launch(layout, x, w, ws, xs, out_dtype, bm, bk, bn) -> "_dsl.Launch":
    """The :class:`tpukernels.Launch` of a forward (``"nt"``) or ``d_x`` (``"nn"``) kernel call."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::" + ("quantized_matmul_kernel" if layout == "nt" else "quantized_matmul_bwd_dx")
    M, N, K = problem(layout, x, w, ws, xs, where)
    odt = _out_dtype(out_dtype, x, where)
    dx, dw = _name(x.dtype), _name(w.dtype)
    if layout == "nt":
        check_chip("int8" if xs is not None and dw == "int8" else ("fp8" if xs is not None else None), dw,
                   where=where)
    acc_int = xs is not None and dw == "int8"
    dequant_to = None
    if xs is None and not _native_fp8(dx, dw):
        dequant_to = _jnp(dx)
    bm_, bn_, bk_ = _clamp(M, bm), _clamp(N, bn), _clamp(K, bk)
    gi, gj, gk = _dsl.cdiv(M, bm_), _dsl.cdiv(N, bn_), _dsl.cdiv(K, bk_)
    stream = stream_plan(M, N, K, bm, bk, bn) if layout == "nt" else None
    if stream is not None:
        return _stream_launch(x, w, xs, odt, M, N, K, bk_, bn_, stream, acc_int, dequant_to)
    x_spec = pl.BlockSpec((bm_, bk_), lambda i, j, k: (i, k))
    if layout == "nt":
        w_spec = pl.BlockSpec((bn_, bk_), lambda i, j, k: (j, k))
        s_spec = pl.BlockSpec((1, bn_), lambda i, j, k: (0, j))
    else:
        w_spec = pl.BlockSpec((bk_, bn_), lambda i, j, k: (k, j))
        s_spec = pl.BlockSpec((1, bk_), lambda i, j, k: (0, k))
    in_specs = [x_spec, w_spec, s_spec]
    if xs is not None:
        in_specs.append(pl.BlockSpec((bm_, 1), lambda i, j, k: (i, 0)))
    acc_shape = (8, 128) if gk == 1 else (bm_, bn_)
    need = vmem_bytes(bm_, bk_, bn_, x.dtype, w.dtype, odt, xs is not None, acc_shape, dequant_to)
    limit = scoped_vmem_limit(need)
    xi, wi = np.dtype(x.dtype).itemsize, np.dtype(w.dtype).itemsize
    reads_x, reads_w = (gj if gk > 1 else 1), (gi if (gk > 1 or gj > 1) else 1)
    cost = pl.CostEstimate(
        flops=2 * M * N * K, transcendentals=0,
        bytes_accessed=int(reads_x * M * K * xi + reads_w * N * K * wi + M * N * np.dtype(odt).itemsize),
    )
    f32 = dequant_to is not None and np.dtype(dequant_to) == np.dtype("float32")
    return _dsl.Launch(
        grid=(gi, gj, gk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm_, bn_), lambda i, j, k: (i, j)),
        out_shape=_dsl.OutSpec((M, N), odt),
        scratch_shapes=[pltpu.VMEM(acc_shape, jnp.int32 if acc_int else jnp.float32)],
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=limit,
        cost_estimate=cost,
        body_kwargs=dict(layout=layout, k_size=int(K), blk_k=int(bk_), n_k=int(gk), has_xs=xs is not None,
                         acc_int=acc_int, dequant_to=dequant_to,
                         precision=lax.Precision.HIGHEST if f32 else None),
    )


def _stream_launch(x, w, xs, odt, M, N, K, bk_, bn_, stream, acc_int, dequant_to) -> "_dsl.Launch":
    """The weight-streaming launch of :func:`stream_plan` (body :func:`_stream_body`): ``x`` and the scales
    as VMEM blocks, ``w_q`` left in HBM and copied by the body into a two-slot scratch."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    gj, gk = N // bn_, K // bk_
    in_specs = [pl.BlockSpec((M, K), lambda i, j, k: (0, 0)), pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec((1, bn_), lambda i, j, k: (0, j))]
    if xs is not None:
        in_specs.append(pl.BlockSpec((M, 1), lambda i, j, k: (0, 0)))
    acc_shape = (8, 128) if gk == 1 else (M, bn_)
    need = (2 * (padded_bytes((M, K), x.dtype) + padded_bytes((bn_, bk_), w.dtype) + padded_bytes((M, bn_), odt)
                 + padded_bytes((1, bn_), "float32") + (padded_bytes((M, 1), "float32") if xs is not None else 0))
            + (padded_bytes((bn_, bk_), dequant_to) if dequant_to is not None else 0)
            + padded_bytes(acc_shape, "float32"))
    xi, wi = np.dtype(x.dtype).itemsize, np.dtype(w.dtype).itemsize
    f32 = dequant_to is not None and np.dtype(dequant_to) == np.dtype("float32")
    return _dsl.Launch(
        grid=(1, gj, gk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((M, bn_), lambda i, j, k: (0, j)),
        out_shape=_dsl.OutSpec((M, N), odt),
        scratch_shapes=[pltpu.VMEM((2, bn_, bk_), w.dtype), pltpu.SemaphoreType.DMA((2, stream["ndma"])),
                        pltpu.VMEM(acc_shape, jnp.int32 if acc_int else jnp.float32)],
        # sequential: each step starts the next step's weight copies (one TensorCore per device)
        dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
        vmem_limit_bytes=scoped_vmem_limit(need),
        cost_estimate=pl.CostEstimate(flops=2 * M * N * K, transcendentals=0,
                                      bytes_accessed=int(M * K * xi + N * K * wi + M * N * np.dtype(odt).itemsize)),
        body_kwargs=dict(layout="nt", k_size=int(K), blk_k=int(bk_), n_k=int(gk), has_xs=xs is not None,
                         acc_int=acc_int, dequant_to=dequant_to, precision=lax.Precision.HIGHEST if f32 else None,
                         stream=dict(stream)),
    )


def heuristic(x, w, ws, xs=None, out_dtype=None, *, layout="nt") -> dict:
    """Default blocks before clamping (per-chip shipped entries take precedence).

    Prefill-size M (> 128, MXU-bound): ``bm=1024, bk=1024, bn=2048`` (bf16 x: the dequantized tile adds
    ``bn*bk`` bf16 of VMEM, ~28 MiB in all, under every chip's VMEM with a raised scoped limit) — between
    the bf16 matmul's tuned v5e (1024/2048/1024) and v6e (2048/1024/2048) blocks: large output blocks keep
    the MXU fed at int8 rate, where 1 MiB blocks leave v6e HBM-bound (libtpu estimate). Decode-size M
    (<= :data:`STREAM_MAX_M`, weight-bandwidth bound): the largest ``bk`` of 4096, 2048, ... 128 and ``bn`` of
    2048, 1024, ... 128 that divide K and N (or cover them), so that :func:`stream_plan` takes the
    weight-streaming launch; 2-8 MiB weight tiles were within 4% of the best in the decode sweep (libtpu
    estimates, benchmarks/quantized_matmul.py --decode-sweep). float32 x: ``512`` cubed (4-byte operands)."""
    M, K = x.shape
    N = w.shape[0] if layout == "nt" else w.shape[1]
    if _name(x.dtype) == "float32":
        return dict(bm=512, bk=512, bn=512)
    if M <= STREAM_MAX_M:
        return dict(bm=512, bk=_dividing(K, (4096, 2048, 1024, 512, 256, 128)),
                    bn=_dividing(N, (2048, 1024, 512, 256, 128)))
    return dict(bm=1024, bk=1024, bn=2048)


def _dividing(dim: int, choices) -> int:
    """The first of ``choices`` that covers ``dim`` or divides it (else the last)."""
    return next((c for c in choices if dim <= c or dim % c == 0), choices[-1])


def _ref_kernel(x, w, ws, xs=None, out_dtype=None):
    """jnp version of the forward kernel (autotuner correctness check)."""
    import jax.numpy as jnp
    from jax import lax

    z = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32).T, precision=lax.Precision.HIGHEST)
    z = z * ws
    if xs is not None:
        z = z * xs
    return z.astype(_out_dtype(out_dtype, x, "quantized_matmul_kernel"))


def _q_out(x, dtype: str = "int8"):
    M, K = x.shape
    return (_dsl.OutSpec((M, K), _jnp(dtype)), _dsl.OutSpec((M, 1), _jnp("float32")))


def _kernel_shape(x, w_q, w_scale, x_scale=None, out_dtype=None):
    where = "tpukernels::quantized_matmul_kernel"
    M, N, K = problem("nt", x, w_q, w_scale, x_scale, where)
    return _dsl.OutSpec((M, N), _out_dtype(out_dtype, x, where))


@_dsl.tpu_kernel(_qmm_body, name="quantized_matmul_kernel", namespace="tpukernels", tunables=TUNABLES,
                 heuristic=heuristic, out_shape=_kernel_shape, reference=_dsl.jax_reference(_ref_kernel))
def quantized_matmul_kernel(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                            x_scale: Optional[torch.Tensor] = None, out_dtype: Optional[str] = None,
                            *, bm: int, bk: int, bn: int) -> torch.Tensor:
    """``(x . w_q^T) * w_scale [* x_scale]`` with ``x [M, K]``, ``w_q [N, K]``, ``w_scale [1, N]`` f32,
    ``x_scale [M, 1]`` f32 (w8a8: ``x`` has ``w_q``'s dtype) -> ``[M, N]`` in ``out_dtype``.

    Raises:
        ArgumentError: ranks, K mismatch, scale shapes, K > 133143 for int8 x int8.
        DTypeError: unsupported dtypes. ChipError: the target chip lacks the MXU pair.
    """
    return make_launch("nt", x, w_q, w_scale, x_scale, out_dtype, bm, bk, bn)


def _dx_shape(g, w_q, w_scale, out_dtype=None):
    M, N, K = problem("nn", g, w_q, w_scale, None, "tpukernels::quantized_matmul_bwd_dx")
    return _dsl.OutSpec((M, N), _out_dtype(out_dtype, g, "tpukernels::quantized_matmul_bwd_dx"))


def _dx_heuristic(g, w_q, w_scale, out_dtype=None):
    return dict(bm=512, bk=1024, bn=1024) if _name(g.dtype) != "float32" else dict(bm=512, bk=512, bn=512)


@_dsl.tpu_kernel(_qmm_body, name="quantized_matmul_bwd_dx", namespace="tpukernels", tunables=TUNABLES,
                 heuristic=_dx_heuristic, out_shape=_dx_shape)
def quantized_matmul_bwd_dx(g: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: Optional[str] = None, *, bm: int, bk: int, bn: int) -> torch.Tensor:
    """``d_x = (g * w_scale) . w_q`` with ``g [M, N]`` bf16/f32, ``w_q [N, K]``, ``w_scale [1, N]`` -> ``[M, K]``."""
    return make_launch("nn", g, w_q, w_scale, None, out_dtype, bm, bk, bn)


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


# ----------------------------------------------------------------------------------------------- fused w8a8
#: columns quantized (and absmax-reduced) per vector pass inside the fused kernel: bounds its f32 temporaries
QCHUNK = 512
TUNABLES_W8A8 = {
    "bm": _dsl.Tunable([1024, 256, 512, 2048], default=1024,
                       doc="rows (tokens) per block; the row block of x at full K stays in VMEM (upper bound: "
                           "halved until it divides M and fits, see fused_plan)"),
    "bk": _dsl.Tunable([2048, 512, 1024, 4096], default=2048, doc="contraction block (K) of the w_q tile"),
    "bn": _dsl.Tunable([1024, 512, 2048, 4096], default=1024, doc="columns of the output block (N)"),
}


def vmem_budget(chip=None) -> int:
    """VMEM bytes the fused w8a8 kernel may plan for on ``chip``: 3/4 of its ``vmem_capacity_bytes`` (jax's
    tpu_info; the rest is headroom for Mosaic's internal scratch and XLA around the kernel). ``chip=None``
    (no target: a cpu interpret run) uses the smallest capacity among v5e, v6e and tpu7x."""
    from ..chips import get_chip

    if chip is None:
        return min(get_chip(c).vmem_capacity_bytes for c in SHIPPED_CHIPS) * 3 // 4
    return get_chip(chip).vmem_capacity_bytes * 3 // 4


def fused_vmem_bytes(bm, bk, bn, K, x_dtype, q_dtype, out_dtype, n_k) -> int:
    """Footprint of the fused w8a8 kernel (bytes): the raw next row block of ``x`` at full K, two quantized
    row blocks with their scales and reciprocals, double-buffered ``w_q`` / scale / output blocks, the
    accumulator and the f32 temporaries of the quantization passes (a row block's absmax over ``QCHUNK``
    columns, one chunk's products) and of the dot result."""
    acc = (8, 128) if n_k == 1 else (bm, bn)
    qc = min(QCHUNK, K)
    return (padded_bytes((bm, K), x_dtype) + 2 * padded_bytes((bm, n_k * bk), q_dtype)
            + 4 * padded_bytes((bm, 1), "float32")
            + 2 * (padded_bytes((bn, bk), q_dtype) + padded_bytes((1, bn), "float32") + padded_bytes((bm, bn), out_dtype))
            + padded_bytes(acc, "float32") + 3 * padded_bytes((bm, qc), "float32") + padded_bytes((bm, bn), "float32"))


def _parts(bm: int, n_j: int) -> int:
    """Row parts the next row block's quantization is spread over: the largest power of two ``<= n_j / 2``
    (the first half of the N sweeps leave time for the row DMA) with ``bm / parts`` a multiple of 32."""
    p = 1
    while 2 * p <= n_j // 2 and bm % (64 * p) == 0:
        p *= 2
    return p


def fused_plan(M, K, N, x_dtype, q_dtype, out_dtype, bm, bk, bn, chip=None) -> Optional[dict]:
    """Blocks of the fused w8a8 kernel for one problem, or None where it does not apply.

    The rule (the public op takes the fused path iff this returns a plan, else the two-kernel path):
    ``bm`` is the largest of ``bm, bm/2, bm/4, ...`` (a multiple of 32) that divides ``M`` (or ``M`` itself
    when ``M <= bm``: one row block), such that :func:`fused_vmem_bytes` fits :func:`vmem_budget` of
    ``chip``; the row DMA copies whole row blocks, hence the divisibility. ``bk, bn`` are clamped to the
    problem. Returns ``dict(bm, bk, bn, parts, need)`` (``parts``: :func:`_parts`).
    """
    bk_, bn_ = _clamp(K, bk), _clamp(N, bn)
    n_k, n_j = _dsl.cdiv(K, bk_), _dsl.cdiv(N, bn_)
    budget = vmem_budget(chip)
    cands = ([M] if M <= bm else []) + [bm >> s for s in range(bm.bit_length()) if (bm >> s) >= 32]
    for b in cands:
        if b > M or (b != M and (b % 32 or M % b)):
            continue
        need = fused_vmem_bytes(b, bk_, bn_, K, x_dtype, q_dtype, out_dtype, n_k)
        if need <= budget:
            return dict(bm=b, bk=bk_, bn=bn_, parts=_parts(b, n_j), need=need)
    return None


def _w8a8_problem(x, w, ws, where):
    M, N, K = problem("nt", x, w, ws, None, where)
    dw = _name(w.dtype)
    if dw == "int8" and K > INT32_MAX_K:
        raise ArgumentError(f"{where}: K = {K} > {INT32_MAX_K}: an int8 x int8 sum may overflow int32")
    return M, N, K, dw


def _w8a8_shape(x, w_q, w_scale, out_dtype=None):
    where = "tpukernels::quantized_matmul_w8a8_kernel"
    M, N, K, _ = _w8a8_problem(x, w_q, w_scale, where)
    return _dsl.OutSpec((M, N), _out_dtype(out_dtype, x, where))


def _w8a8_heuristic(x, w_q, w_scale, out_dtype=None):
    """Prefill: ``bm=1024`` (the ``w_q`` stream then carries 2 * 1024 int8 ops per byte, above v6e's
    int8-peak / HBM ratio of ~1120), ``bn=1024``, ``bk = K`` up to 4096 (one K step: no accumulator
    round trip), else 2048. libtpu estimates on v6e (a model), 2048 tokens: K=4096 -> 14336 at bk 4096 /
    2048: 161.6 / 169.5 µs (bn=2048: 163.4 / 165.7); K=14336 -> 4096 at bk 2048 / 4096 / 1024 (bn 2048):
    213.0 / 228.9 / 217.0 µs, bm=512: 226.9 µs. Decode (M <= 128): one row block, ``bk=bn=2048`` for
    fewer, larger weight DMAs."""
    if x.shape[0] <= 128:
        return dict(bm=1024, bk=2048, bn=2048)
    return dict(bm=1024, bk=4096 if x.shape[1] <= 4096 else 2048, bn=1024)


def _ref_w8a8(x, w, ws, out_dtype=None):
    """jnp version of the fused w8a8 kernel (autotuner correctness check)."""
    import jax.numpy as jnp
    from jax import lax

    dw = np.dtype(w.dtype).name
    qm = qmax(dw)
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True) * np.float32(1.0 / qm)
    q = _quantize_values(x, _reciprocal(scale), qm, dw == "int8", w.dtype)
    acc = jnp.int32 if dw == "int8" else jnp.float32
    z = lax.dot_general(q, w, (((1,), (1,)), ((), ())), preferred_element_type=acc).astype(jnp.float32)
    return (z * ws * scale).astype(_out_dtype(out_dtype, x, "quantized_matmul_w8a8_kernel"))


@_dsl.tpu_kernel(_w8a8_body, name="quantized_matmul_w8a8_kernel", namespace="tpukernels", tunables=TUNABLES_W8A8,
                 heuristic=_w8a8_heuristic, out_shape=_w8a8_shape, reference=_dsl.jax_reference(_ref_w8a8))
def quantized_matmul_w8a8_kernel(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                                 out_dtype: Optional[str] = None, *, bm: int, bk: int, bn: int) -> torch.Tensor:
    """Fused w8a8: per-token absmax quantization of ``x [M, K]`` (bf16/f32) to ``w_q``'s dtype and
    ``(x_q . w_q^T) * w_scale * x_scale`` -> ``[M, N]`` in ``out_dtype``; ``w_q [N, K]`` int8 / fp8,
    ``w_scale [1, N]`` f32. Same values as ``quantize_per_token_kernel`` then ``quantized_matmul_kernel``
    (one shared quantization formula, the same epilogue), without writing ``x_q`` to HBM.

    Grid ``(M/bm, N/bn, K/bk)``, all sequential: row block ``i`` of ``x`` at full K is DMA'd to VMEM once
    (a row ahead), quantized chunk by chunk during the first N sweep into a VMEM scratch, and reused for
    every N block. Blocks from :func:`fused_plan`.

    Raises:
        ArgumentError: ranks, K mismatch, scale shape, K > 133143 for int8, no fused plan (the row block
            at full K does not fit the chip's VMEM for any allowed ``bm``: use the two-kernel path).
        DTypeError: unsupported dtypes. ChipError: the target chip lacks the MXU pair.
    """
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = "tpukernels::quantized_matmul_w8a8_kernel"
    M, N, K, dw = _w8a8_problem(x, w_q, w_scale, where)
    check_chip("int8" if dw == "int8" else "fp8", dw, where=where)
    odt = _out_dtype(out_dtype, x, where)
    chip = _target_chip()
    plan = fused_plan(M, K, N, x.dtype, w_q.dtype, odt, bm, bk, bn, chip)
    if plan is None:
        raise ArgumentError(
            f"{where}: no fused plan for M={M}, K={K} (bm={bm}): the x row block at full K must divide M and "
            f"fit {vmem_budget(chip) // MiB} MiB of VMEM; use quantize_per_token_kernel + quantized_matmul_kernel")
    bm_, bk_, bn_ = plan["bm"], plan["bk"], plan["bn"]
    gi, gj, gk = M // bm_, _dsl.cdiv(N, bn_), _dsl.cdiv(K, bk_)
    acc_int = dw == "int8"
    acc_shape = (8, 128) if gk == 1 else (bm_, bn_)
    need = plan["need"]
    limit = scoped_vmem_limit(need, chip)
    xi = np.dtype(x.dtype).itemsize
    cost = pl.CostEstimate(flops=2 * M * N * K, transcendentals=0,
                           bytes_accessed=int(M * K * xi + gi * N * K + M * N * np.dtype(odt).itemsize))
    return _dsl.Launch(
        grid=(gi, gj, gk),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((bn_, bk_), lambda i, j, k: (j, k)),
                  pl.BlockSpec((1, bn_), lambda i, j, k: (0, j))],
        out_specs=pl.BlockSpec((bm_, bn_), lambda i, j, k: (i, j)),
        out_shape=_dsl.OutSpec((M, N), odt),
        scratch_shapes=[pltpu.VMEM((bm_, K), x.dtype), pltpu.SemaphoreType.DMA((1,)),
                        pltpu.VMEM((2, bm_, gk * bk_), w_q.dtype), pltpu.VMEM((2, bm_, 1), jnp.float32),
                        pltpu.VMEM((2, bm_, 1), jnp.float32),
                        pltpu.VMEM(acc_shape, jnp.int32 if acc_int else jnp.float32)],
        # sequential: the x row block, its quantization and the prefetch carry across grid steps (one
        # TensorCore; jax's tpu_info gives num_cores=1 for v5e, v6e and tpu7x)
        dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
        vmem_limit_bytes=limit,
        cost_estimate=cost,
        body_kwargs=dict(k_size=int(K), blk_k=int(bk_), n_k=int(gk), n_j=int(gj), bm=int(bm_), parts=plan["parts"],
                         qm=qmax(dw),
                         is_int=dw == "int8", acc_int=acc_int, qchunk=QCHUNK),
    )


# ----------------------------------------------------------------------------------------------- backward
def _backward(ctx, g):
    x, w_q, ws, xs = ctx.args["x"], ctx.args["w_q"], ctx.args["w_scale"], ctx.args["x_scale"]
    grads = {}
    if ctx.needs_input_grad.get("x"):
        if xs is not None:
            raise ArgumentError("tpukernels::quantized_matmul_kernel: no gradient for w8a8 (quantized x)")
        grads["x"] = torch.ops.tpukernels.quantized_matmul_bwd_dx.default(g.to(x.dtype), w_q, ws, _name(x.dtype))
    return grads


quantized_matmul_kernel.def_backward(_backward)


# ----------------------------------------------------------------------------------------------- public op
def _canon_x_quant(x_quant):
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


def _check_public(x, w_q, w_scale, x_quant, out_dtype):
    where = "tpukernels::quantized_matmul"
    for t, n in ((x, "x"), (w_q, "w_q"), (w_scale, "w_scale")):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(t).__name__}")
    devs = {t.device for t in (x, w_q, w_scale)}
    if len(devs) > 1:
        raise DeviceError(f"{where}: x, w_q and w_scale must be on one device, got "
                          f"{x.device}, {w_q.device}, {w_scale.device}")
    _canon_x_quant(x_quant)
    if x.dim() < 1:
        raise ArgumentError(f"{where}: x must have rank >= 1 ([..., K]), got a scalar")
    if w_q.dim() != 2:
        raise ArgumentError(f"{where}: w_q must be 2-D [N, K], got shape {tuple(w_q.shape)}")
    dw = _name(w_q.dtype)
    if dw not in WEIGHT_DTYPES:
        raise DTypeError(f"{where}: w_q dtype {dw} is not one of {WEIGHT_DTYPES} (quantize with quantize_weight)")
    if _name(x.dtype) not in X_DTYPES:
        raise DTypeError(f"{where}: x dtype {_name(x.dtype)} is not one of {X_DTYPES}")
    N, K = w_q.shape
    if x.shape[-1] != K:
        raise ArgumentError(f"{where}: x {tuple(x.shape)} and w_q {tuple(w_q.shape)}: x.shape[-1] must equal K = {K}")
    if tuple(w_scale.shape) != (N,):
        raise ArgumentError(f"{where}: w_scale must have shape (N,) = ({N},), got {tuple(w_scale.shape)}")
    if w_scale.dtype != torch.float32:
        raise DTypeError(f"{where}: w_scale must be float32, got {_name(w_scale.dtype)}")
    check_pair(x_quant, dw, where)
    if x_quant == "int8" and K > INT32_MAX_K:
        raise ArgumentError(f"{where}: K = {K} > {INT32_MAX_K}: an int8 x int8 sum may overflow int32")
    odt = out_dtype or _name(x.dtype)
    if odt not in OUT_DTYPES:
        raise DTypeError(f"{where}: out_dtype {odt!r} is not one of {OUT_DTYPES}")
    check_chip(x_quant, dw, where=where)
    return odt


def _impl(x, w_q, w_scale, x_quant=None, out_dtype=None, config=None):
    odt = _check_public(x, w_q, w_scale, x_quant, out_dtype)
    N, K = w_q.shape
    lead = x.shape[:-1]
    if K == 0 or N == 0 or math.prod(lead) == 0:
        return torch.zeros(*lead, N, dtype=getattr(torch, odt), device=x.device)
    # w8a8 rounds x: no gradient. The forward runs (inference without torch.no_grad() is common: HF weights
    # require grad); a backward that reaches it raises (_QuantizedInputHasNoGradient)
    guard = x_quant is not None and x.requires_grad and torch.is_grad_enabled()
    x2 = (x.detach() if guard else x).reshape(-1, K)
    ws = w_scale.reshape(1, N)
    kw = {} if config is None else dict(config=config)
    # the kernels' out_dtype=None means x's dtype (bf16 for 8-bit x): pass None for that default, so a
    # call's tuning-DB key is the one the shipped entries were tuned under (statics are part of the key)
    kout = None if odt == _name(x.dtype) else odt
    if x_quant is None:
        y = quantized_matmul_kernel(x2, w_q, ws, None, kout, **kw)
    elif _fused(x2, w_q, ws, kout, config):
        y = quantized_matmul_w8a8_kernel(x2, w_q, ws, kout, **kw)
    else:
        xq, xs = quantize_per_token_kernel(x2, _name(w_q.dtype))
        y = quantized_matmul_kernel(xq, w_q, ws, xs, None if odt == "bfloat16" else odt, **kw)
    y = y.reshape(*lead, N)
    return _QuantizedInputHasNoGradient.apply(x, y, x_quant) if guard else y


class _QuantizedInputHasNoGradient(torch.autograd.Function):
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
    from ..targets import config_to_json

    chip = _target_chip()
    return _fused_for(int(x2.shape[0]), int(x2.shape[1]), int(w_q.shape[0]), _name(x2.dtype), _name(w_q.dtype), odt,
                      None if config is None else config_to_json(quantized_matmul_w8a8_kernel, config),
                      None if chip is None else chip.name)


@functools.lru_cache(maxsize=1024)
def _fused_for(M, K, N, x_name, q_name, odt, config_json, chip_name) -> bool:
    from ..chips import get_chip
    from ..dsl import TensorSpec

    chip = None if chip_name is None else get_chip(chip_name)
    config = None if config_json is None else json.loads(config_json)
    specs = (TensorSpec((M, K), _jnp(x_name), "x"), TensorSpec((N, K), _jnp(q_name), "w_q"),
             TensorSpec((1, N), _jnp("float32"), "w_scale"))
    cfg, _ = quantized_matmul_w8a8_kernel.resolve_config(specs, (("out_dtype", odt),), config, chip)
    return fused_plan(M, K, N, specs[0].dtype, specs[1].dtype, _jnp(odt or x_name), int(cfg["bm"]), int(cfg["bk"]),
                      int(cfg["bn"]), chip) is not None


_LIB = torch.library.Library("tpukernels", "FRAGMENT")
_LIB.define("quantized_matmul(Tensor x, Tensor w_q, Tensor w_scale, str? x_quant=None, str? out_dtype=None) -> Tensor")
_LIB.impl("quantized_matmul", lambda x, w_q, w_scale, x_quant=None, out_dtype=None:
          _impl(x, w_q, w_scale, x_quant, out_dtype), "CompositeImplicitAutograd")


def _canon_out(out_dtype):
    if out_dtype is None:
        return None
    name = out_dtype if isinstance(out_dtype, str) else _name(out_dtype)
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
    from ..targets import config_to_json

    for t, n in ((x, "x"), (w_q, "w_q"), (w_scale, "w_scale")):  # before the op schema's untyped RuntimeError
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"tpukernels::quantized_matmul: {n} must be a torch.Tensor, got {type(t).__name__}")
    if config is not None:
        config_to_json(quantized_matmul_kernel, config)  # the one config rule (a dict of JSON values), typed
    odt = _canon_out(out_dtype)
    if config is None:
        return torch.ops.tpukernels.quantized_matmul(x, w_q, w_scale, x_quant, odt)
    return _impl(x, w_q, w_scale, x_quant, odt, config)


def quantize_per_token(x: torch.Tensor, dtype="int8") -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q [..., K], x_scale [...] float32)``: the kernel that :func:`quantized_matmul` uses for w8a8."""
    name = _weight_dtype(dtype, "quantize_per_token")
    K = x.shape[-1]
    q, s = quantize_per_token_kernel(x.reshape(-1, K), name)
    return q.reshape(x.shape), s.reshape(x.shape[:-1])


# ----------------------------------------------------------------------------------------------- module
class TPUQuantLinear(torch.nn.Module):
    """``nn.Linear`` with a quantized, frozen weight: ``y = quantized_matmul(x, w_q, w_scale) + bias``.

    Buffers: ``w_q [out, in]`` (int8 / fp8), ``w_scale [out]`` float32, optional ``bias [out]`` (kept in the
    linear's dtype, added after the matmul in the output dtype). ``x_quant`` as in :func:`quantized_matmul`.
    Differentiable in the input for ``x_quant=None`` (weights are buffers, never trained).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype="int8", x_quant=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.qdtype = _weight_dtype(dtype, "TPUQuantLinear")
        self.x_quant = _canon_x_quant(x_quant)
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


#: the shapes the shipped defaults are tuned for (Llama-3-8B MLP: prefill 8192 tokens, decode 16 / 64)
STANDARD_CASES = [
    (quantized_matmul_kernel, ("8192x4096:bf16", "14336x4096:i8", "1x14336:f32"), {}),
    (quantized_matmul_kernel, ("8192x14336:bf16", "4096x14336:i8", "1x4096:f32"), {}),
    (quantized_matmul_kernel, ("8192x4096:i8", "14336x4096:i8", "1x14336:f32", "8192x1:f32"), {}),
    (quantized_matmul_kernel, ("8192x14336:i8", "4096x14336:i8", "1x4096:f32", "8192x1:f32"), {}),
    (quantized_matmul_kernel, ("16x4096:bf16", "14336x4096:i8", "1x14336:f32"), {}),
    (quantized_matmul_kernel, ("64x4096:bf16", "14336x4096:i8", "1x14336:f32"), {}),
    (quantized_matmul_kernel, ("64x14336:bf16", "4096x14336:i8", "1x4096:f32"), {}),
]
#: the fused w8a8 kernel at the prefill shapes (int8 on v5e / v6e; float8_e4m3fn on tpu7x, which has no int8 MXU)
STANDARD_CASES_W8A8 = [
    (quantized_matmul_w8a8_kernel, (f"8192x{K}:bf16", f"{N}x{K}:{dt}", f"1x{N}:f32"), {})
    for dt in ("i8", "float8_e4m3fn") for K, N in ((4096, 14336), (14336, 4096))
]

__all__ = ["quantized_matmul", "quantize_weight", "quantize_per_token", "TPUQuantLinear", "reference",
           "quantize_reference", "error_bound", "supported_modes", "check_chip", "quantized_matmul_kernel",
           "quantize_per_token_kernel", "quantized_matmul_bwd_dx", "quantized_matmul_w8a8_kernel", "fused_plan",
           "vmem_budget", "heuristic", "STANDARD_CASES", "STANDARD_CASES_W8A8"]
