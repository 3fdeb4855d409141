"""Matmul with fused bias and activation: ``act(a @ b + bias)``, f32 accumulation, any shape.

Public op::

    torch.ops.tpukernels.matmul(a, b, bias=None, activation=None, out_dtype=None) -> Tensor
    tpukernels.library.matmul(a, b, bias=None, activation=None, out_dtype=None)   # same, functional

(``tpukernels.library.matmul`` is that function; this module is ``tpukernels.library.matmul_ops``: no module
shares its name with a function the package exports, so ``import tpukernels.library.matmul_ops as M`` works.)

Shapes: ``a [..., M, K]``, ``b [K, N]`` or ``[..., K, N]`` (batch dims broadcast as in ``torch.matmul``),
``bias [N]``; result ``[*broadcast(batch), M, N]``. Any ``M, N, K >= 0`` (``K = 0`` gives ``act(bias)``,
zeros without bias). Dtypes: bfloat16, float16, float32 (``a`` and ``b`` alike; bias any of them).
The product is accumulated in float32 (``preferred_element_type=float32`` into an f32 VMEM scratch
accumulator); bias and activation are applied in float32 and the result is rounded **once** to
``out_dtype`` (default: the dtype of ``a``). No unit: values are whatever the operands carry.

Formulas (all in f32):

* ``gelu_tanh(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))`` — Hendrycks & Gimpel, "Gaussian Error
  Linear Units" (arXiv:1606.08415), eq. for the tanh approximation; same as ``torch.nn.functional.gelu(z,
  approximate="tanh")``.
* ``silu(z) = z * sigmoid(z)`` — Elfwing et al., arXiv:1702.03118; ``torch.nn.functional.silu``.
* ``relu(z) = max(z, 0)``; derivative taken as 0 at 0 (torch's convention).

Kernels. Three Pallas TPU kernels (BLAS naming, ``T`` = operand stored transposed), each a torch op with
3-D operands ``[batch, rows, cols]`` (batch 1 broadcasts):

==========================  ===========================  ====================================
op                           operands (as stored)          computes (per batch)
==========================  ===========================  ====================================
``tpukernels::matmul_nn``   ``a [B,M,K]``, ``b [B,K,N]``  ``a @ b``
``tpukernels::matmul_nt``   ``a [B,M,K]``, ``bt [B,N,K]`` ``a @ bt^T`` (``nn.Linear`` weights)
``tpukernels::matmul_tn``   ``at [B,K,M]``, ``b [B,K,N]`` ``at^T @ b`` (weight gradients)
==========================  ===========================  ====================================

The transposed variants contract with ``lax.dot_general`` on the stored layout (no transposed copy).
The public op reads the strides of ``a`` and ``b``: a ``b`` that is ``W.t()`` of a contiguous ``[N, K]``
weight (``nn.Linear``) goes to ``matmul_nt`` with ``W`` itself; a column-major ``a`` goes to ``matmul_tn``;
stride-0 (``expand``-ed) batch dims are read once; anything else (sliced, partially broadcast, both
operands column-major) is copied to a contiguous layout first. Inputs are never modified.

Grid ``(batch, M/bm, N/bn, K/bk)``, K innermost and ``"arbitrary"``. Tails: partial blocks along M and N
read undefined rows/columns that only reach output elements Pallas drops; partial blocks along K are
masked on **both** operands with ``jnp.where`` (``tk.mask_tail``) on the last K step only, because a 0/1
multiply keeps NaN padding. Results are deterministic: one fixed summation order per config.

Backward (``dC`` the incoming gradient, ``dZ = dC * act'(Z)`` in f32 with the pre-activation ``Z``
recomputed by a forward call without activation, rounded to the operand dtype)::

    dA = dZ @ B^T      dB = A^T @ dZ      dbias = sum over batch and rows of dZ (f32)

with the same three kernels (nn -> nt + tn, nt -> nn + tn, tn -> nt + nn); gradients of broadcast batch
dims are summed inside the kernel (``reduce_batch=True``: the batch becomes a reduction grid axis).

float16: Mosaic (libtpu 0.0.52) cannot load or store float16 vectors on v5e/v6e/tpu7x ("Invalid vector
type for load", "failed to legalize 'xir.pack_subelements'"), so the public op widens float16 operands
to float32 (exact), runs the float32 kernel and rounds the f32 result once to float16. float32 operands
use ``precision=HIGHEST`` (Mosaic contract precision fp32): Mosaic's default f32 contraction is cheaper
(libtpu estimate 1024^3 on v5e: 72.8k vs 121.3k cycles) but not an f32-exact product.

Tunables: ``bm, bk, bn`` (requested block sizes, clamped to the problem: a dim no larger than the block is
taken whole, which satisfies the (8, 128) rule and bf16's 16-row packing; larger dims use the block, a
multiple of 128) and, for ``matmul_nt``, ``rhs`` ("mxu": contract the ``[bn, bk]`` block directly,
"xlu": transpose it in VMEM first). Defaults: :func:`heuristic`, then per-chip shipped tuning data in
``tpukernels/data/autotuning/<chip>/tpukernels.matmul_*.json`` written by ``benchmarks/matmul.py
--write-defaults`` from libtpu's static estimates (a model, not measurements).

Performance (libtpu 0.0.52 static estimates, a model: ``benchmarks/matmul.py``): bf16 8192^3 on v5e at
98.9% of peak vs XLA's 96.2%; at or above XLA on every benchmarked shape and chip except v6e 4096^3
(2.4% slower: with Pallas' uniform blocks the first blocks' load and the last block's write-back,
~10 us of DMA at v6e's 1.64 TB/s, are not overlapped, which XLA's matmul avoids).

Sources: JAX Pallas TPU matmul guide (https://docs.jax.dev/en/latest/pallas/tpu/matmul.html; blocked
matmul with an f32 scratch accumulator, fused transposed RHS via ``dot_general``, fused activation) and
``jax/experimental/pallas/ops/tpu/matmul.py``.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .. import dsl as _dsl
from ..dsl.validate import padded_bytes
from ..errors import ArgumentError, DTypeError

ACTIVATIONS = (None, "gelu_tanh", "silu", "relu")
#: dtypes the kernels take (float16 goes through the public op, which widens it; see module docstring)
KERNEL_DTYPES = ("bfloat16", "float32")
PUBLIC_DTYPES = ("bfloat16", "float16", "float32")
MiB = 1 << 20
#: Mosaic's smallest default scoped VMEM limit (v4/v5e/v5p); launches above it raise the limit.
DEFAULT_SCOPED_VMEM = 16 * MiB
GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715

_DOT_DIMS = {  # lax.dot_general dimension numbers on the stored 2-D blocks
    "nn": (((1,), (0,)), ((), ())),  # a [bm, bk] . b [bk, bn]
    "nt": (((1,), (1,)), ((), ())),  # a [bm, bk] . bt [bn, bk]
    "tn": (((0,), (0,)), ((), ())),  # at [bk, bm] . b [bk, bn]
}
_K_AXIS = {"nn": (1, 0), "nt": (1, 1), "tn": (0, 0)}  # K axis of the (a, b) blocks

TUNABLES = {
    "bm": _dsl.Tunable([512, 128, 256, 1024, 2048], default=512, doc="rows of the output block (M)"),
    "bk": _dsl.Tunable([1024, 128, 256, 512, 2048, 4096], default=1024, doc="contraction block (K)"),
    "bn": _dsl.Tunable([1024, 128, 256, 512, 2048, 4096], default=1024, doc="columns of the output block (N)"),
}
TUNABLES_NT = {
    **TUNABLES,
    "rhs": _dsl.Tunable(["mxu", "xlu"], default="mxu",
                        doc="transposed RHS: contract the [bn, bk] block directly, or transpose it in VMEM first"),
}


# ----------------------------------------------------------------------------------------------- helpers
def _dtype_name(dt) -> str:
    if isinstance(dt, torch.dtype):
        return str(dt).replace("torch.", "")
    return np.dtype(dt).name


_DTYPE_ALIASES = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32", "float": "float32",
                  "f16": "float16", "fp16": "float16", "half": "float16"}


def canonical_out_dtype(out_dtype) -> str | None:
    """``None`` / torch dtype / numpy dtype / name -> ``"bfloat16" | "float16" | "float32"`` (or None).

    Raises:
        DTypeError: any other dtype (the message lists the allowed ones).
    """
    if out_dtype is None:
        return None
    try:
        name = out_dtype if isinstance(out_dtype, str) else _dtype_name(out_dtype)
    except TypeError:
        name = repr(out_dtype)
    name = _DTYPE_ALIASES.get(name, name)
    if name not in PUBLIC_DTYPES:
        raise DTypeError(f"matmul: out_dtype {out_dtype!r} is not supported; use one of {PUBLIC_DTYPES}")
    return name


def _check_activation(activation, where: str = "matmul") -> None:
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"{where}: activation {activation!r} is not one of {ACTIVATIONS}")


def _clamp(dim: int, block: int) -> int:
    """Block extent for ``dim``: the whole dim when it fits in ``block`` (always legal), else ``block``."""
    return dim if 0 < dim <= block else block


def activation_jnp(z, activation):
    """``activation`` applied to an f32 jax array (the kernel epilogue; formulas in the module docstring)."""
    import jax
    import jax.numpy as jnp

    if activation is None:
        return z
    if activation == "relu":
        return jnp.maximum(z, 0.0)
    if activation == "silu":
        return z * jax.nn.sigmoid(z)
    if activation == "gelu_tanh":
        return 0.5 * z * (1.0 + jnp.tanh(GELU_C * (z + GELU_A * z * z * z)))
    raise ArgumentError(f"matmul: activation {activation!r} is not one of {ACTIVATIONS}")


def activation_torch(z: torch.Tensor, activation) -> torch.Tensor:
    """``activation`` on a torch tensor (same formulas, any float dtype; used for K = 0 and references)."""
    if activation is None:
        return z
    if activation == "relu":
        return torch.clamp_min(z, 0.0)
    if activation == "silu":
        return z * torch.sigmoid(z)
    if activation == "gelu_tanh":
        return 0.5 * z * (1.0 + torch.tanh(GELU_C * (z + GELU_A * z * z * z)))
    raise ArgumentError(f"matmul: activation {activation!r} is not one of {ACTIVATIONS}")


def activation_grad_torch(z: torch.Tensor, activation) -> torch.Tensor:
    """``d activation(z) / dz`` (elementwise, dtype of ``z``).

    relu: ``z > 0``; silu: ``s (1 + z (1 - s))`` with ``s = sigmoid(z)``; gelu_tanh:
    ``0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 z^2)`` with ``t = tanh(sqrt(2/pi)(z + 0.044715 z^3))``.
    """
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    if activation == "gelu_tanh":
        t = torch.tanh(GELU_C * (z + GELU_A * z * z * z))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * z * z)
    raise ArgumentError(f"matmul: activation {activation!r} has no derivative here")


# ----------------------------------------------------------------------------------------------- kernel body
def _matmul_body(a_ref, b_ref, *refs, layout, k_size, blk_k, n_k, has_bias, activation, k_axis, r_axis, n_r,
                 precision, rhs_xlu):
    """One (bm, bn) output block, one K step: ``d = a_blk . b_blk`` (f32), then ``acc = d`` on the first
    step, ``acc += d`` in between and ``out = act(acc + d + bias)`` on the last (a single-step grid skips
    the accumulator).

    ``refs`` = ``[bias_ref,] o_ref, acc_ref``. With ``r_axis`` (reduce_batch) the batch is a second
    reduction axis: the accumulator starts at (batch 0, k 0) and is written at (last batch, last k).
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    if has_bias:
        bias_ref, o_ref, acc_ref = refs
    else:
        bias_ref, (o_ref, acc_ref) = None, refs
    k = pl.program_id(k_axis)
    first, last = k == 0, k == n_k - 1
    if r_axis is not None:
        r = pl.program_id(r_axis)
        first = jnp.logical_and(first, r == 0)
        last = jnp.logical_and(last, r == n_r - 1)
    a_kax, b_kax = _K_AXIS[layout]
    dims = _DOT_DIMS[layout]

    def contribution(masked: bool):
        a = a_ref[...]
        b = b_ref[...]
        if masked:  # K tail: both operands, jnp.where (NaN-safe); see tpukernels.dsl.tails
            a = _dsl.mask_tail(a, a_kax, k * blk_k, k_size)
            b = _dsl.mask_tail(b, b_kax, k * blk_k, k_size)
        d = dims
        if rhs_xlu:  # transposed RHS via an explicit VMEM transpose, then a plain contraction
            b, d = b.T, _DOT_DIMS["nn"]
        return jax.lax.dot_general(a, b, d, precision=precision, preferred_element_type=jnp.float32)

    def epilogue(z):
        if bias_ref is not None:
            z = z + bias_ref[...].astype(jnp.float32)
        o_ref[...] = activation_jnp(z, activation).astype(o_ref.dtype)

    tail = k_size % blk_k != 0

    def accumulate(fn, phase: str):
        """Run ``fn(d)`` with this step's contribution; only a last K step pays for the tail mask.

        ``phase``: "first" (k = 0), "middle" or "last" (k = n_k - 1) step of the reduction, which
        decides statically whether the step can be the K tail.
        """
        if not tail or (phase == "first" and n_k > 1) or (phase == "middle" and r_axis is None):
            fn(contribution(False))
        elif phase == "last" or n_k == 1:
            fn(contribution(True))
        else:  # a middle step of reduce_batch: any k
            pl.when(k < n_k - 1)(lambda: fn(contribution(False)))
            pl.when(k == n_k - 1)(lambda: fn(contribution(True)))

    if n_k * n_r == 1:  # one step: no accumulator round trip
        accumulate(epilogue, "last")
        return

    def store(d):
        acc_ref[...] = d.astype(acc_ref.dtype)

    def add(d):
        acc_ref[...] = (acc_ref[...] + d).astype(acc_ref.dtype)

    def finish(d):
        epilogue(acc_ref[...].astype(jnp.float32) + d)

    # Each phase issues its own dot: Mosaic then fuses the accumulation into the matmul (libtpu estimate,
    # v5e 1024^3, 512/512/512 blocks: 22.4k cycles vs 23.9k for one shared dot + acc += d).
    pl.when(first)(lambda: accumulate(store, "first"))
    pl.when(jnp.logical_and(jnp.logical_not(first), jnp.logical_not(last)))(lambda: accumulate(add, "middle"))
    pl.when(last)(lambda: accumulate(finish, "last"))


# ----------------------------------------------------------------------------------------------- launch
def problem_dims(layout: str, a, b, bias=None, reduce_batch: bool = False, where: str = "matmul"):
    """``(Ba, Bb, B, M, N, K)`` of a kernel call, after checking ranks, agreement and dtypes.

    Raises:
        ArgumentError: rank != 3, contraction dims differ, batch sizes neither equal nor 1, bias not [1, N].
        DTypeError: operand dtypes differ or are not bfloat16/float32.
    """
    names = {"nn": ("a", "b"), "nt": ("a", "bt"), "tn": ("at", "b")}[layout]
    for x, n in ((a, names[0]), (b, names[1])):
        if len(x.shape) != 3:
            raise ArgumentError(f"{where}: {n} must be 3-D [batch, rows, cols], got shape {tuple(x.shape)}")
    Ba, Bb = a.shape[0], b.shape[0]
    if layout == "nn":
        (M, K), (K2, N) = a.shape[1:], b.shape[1:]
    elif layout == "nt":
        (M, K), (N, K2) = a.shape[1:], b.shape[1:]
    else:
        (K, M), (K2, N) = a.shape[1:], b.shape[1:]
    if K != K2:
        raise ArgumentError(
            f"{where}: contraction dims differ: {names[0]} {tuple(a.shape)} and {names[1]} {tuple(b.shape)} "
            f"(K = {K} vs {K2})"
        )
    if not (Ba == Bb or Ba == 1 or Bb == 1):
        raise ArgumentError(f"{where}: batch sizes {Ba} ({names[0]}) and {Bb} ({names[1]}) must be equal or 1")
    B = Ba if Bb == 1 else Bb
    da, db = _dtype_name(a.dtype), _dtype_name(b.dtype)
    if da != db:
        raise DTypeError(f"{where}: {names[0]} is {da} but {names[1]} is {db}; operands must have one dtype")
    if da not in KERNEL_DTYPES:
        hint = (" (Mosaic cannot load float16 vectors; tpukernels::matmul widens float16 to float32)"
                if da == "float16" else "")
        raise DTypeError(f"{where}: {names[0]} dtype {da} is not supported by the kernel; use {KERNEL_DTYPES}{hint}")
    if bias is not None:
        if tuple(bias.shape) != (1, N):
            raise ArgumentError(f"{where}: bias must have shape (1, {N}) here, got {tuple(bias.shape)}")
        if _dtype_name(bias.dtype) not in KERNEL_DTYPES:
            raise DTypeError(f"{where}: bias dtype {_dtype_name(bias.dtype)} is not supported; use {KERNEL_DTYPES}")
    return Ba, Bb, B, M, N, K


def _kernel_out_dtype(out_dtype, a, where):
    name = canonical_out_dtype(out_dtype) or _dtype_name(a.dtype)
    if name not in KERNEL_DTYPES:
        raise DTypeError(f"{where}: out_dtype {name} cannot be stored by the kernel (Mosaic has no float16 "
                         f"stores); use {KERNEL_DTYPES} (tpukernels::matmul handles float16)")
    return np.dtype(getattr(__import__("jax.numpy", fromlist=["x"]), name))


def out_spec(layout: str, a, b, bias=None, activation=None, out_dtype=None, reduce_batch=False):
    """Output shape/dtype (shape arithmetic only, so it works on SymInts for the fake kernel)."""
    where = f"tpukernels::matmul_{layout}"
    _check_activation(activation, where)
    Ba, Bb, B, M, N, K = problem_dims(layout, a, b, bias, reduce_batch, where)
    return _dsl.OutSpec((1 if reduce_batch else B, M, N), _kernel_out_dtype(out_dtype, a, where))


def vmem_bytes(layout, bm, bk, bn, in_dtype, out_dtype, has_bias, acc_dtype="float32", acc_shape=None) -> int:
    """tpukernels' VMEM estimate of one launch: double-buffered blocks + the f32 accumulator, bytes.

    ``acc_shape`` defaults to ``(bm, bn)``; a single-step launch allocates an (8, 128) placeholder.
    """
    a_blk = (bk, bm) if layout == "tn" else (bm, bk)
    b_blk = (bn, bk) if layout == "nt" else (bk, bn)
    total = 2 * (padded_bytes(a_blk, in_dtype) + padded_bytes(b_blk, in_dtype) + padded_bytes((bm, bn), out_dtype))
    if has_bias:
        total += 2 * padded_bytes((1, bn), "float32")
    return total + padded_bytes(acc_shape or (bm, bn), acc_dtype)


def hbm_bytes(Ba, Bb, M, N, K, bm, bk, bn, in_itemsize, out_itemsize, reduce_batch=False) -> int:
    """HBM bytes one launch moves with clamped blocks ``bm, bk, bn`` (Pallas pipeline traffic).

    The Pallas pipeline re-fetches an input block whenever its block index changes between consecutive
    grid steps. K is innermost: with more than one K block every step fetches both operand blocks, so
    each operand is re-read once per output block column (``a``: ``N / bn`` times) or row (``b``:
    ``M / bm`` times); with one K block an operand block stays put while the other index moves. The
    output is written once per block (``reduce_batch``: once in all). Batch 1 broadcasts (read once
    per use).
    """
    B = Ba if Bb == 1 else Bb
    gi, gj, gk = -(-M // bm), -(-N // bn), -(-K // bk)
    a1, b1 = M * K * in_itemsize, K * N * in_itemsize
    if gk > 1:
        a_bytes, b_bytes = B * gj * a1, B * gi * b1
    elif reduce_batch:  # grid (i, j, batch, k=1): a block moves with the batch unless a is broadcast
        a_bytes = B * gj * a1 if Ba > 1 else a1
        b_bytes = B * gi * b1 if Bb > 1 else (b1 if gj == 1 else gi * b1)
    else:  # grid (batch, i, j, k=1): a block stays for the whole j sweep; b only if gj == 1
        a_bytes = B * a1 if (Ba > 1 or gi > 1) else a1
        b_bytes = B * gi * b1 if gj > 1 else (B * b1 if Bb > 1 else b1)
    return int(a_bytes + b_bytes + (1 if reduce_batch else B) * M * N * out_itemsize)


def make_launch(layout, a, b, bias, activation, out_dtype, reduce_batch, bm, bk, bn, rhs="mxu",
                acc_dtype=None) -> "_dsl.Launch":
    """The :class:`tpukernels.Launch` of one matmul kernel call (see module docstring).

    ``acc_dtype`` exists only for the test that shows a bf16 accumulator would break the error bound.
    """
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    where = f"tpukernels::matmul_{layout}"
    _check_activation(activation, where)
    Ba, Bb, B, M, N, K = problem_dims(layout, a, b, bias, reduce_batch, where)
    odt = _kernel_out_dtype(out_dtype, a, where)
    bm_, bn_, bk_ = _clamp(M, bm), _clamp(N, bn), _clamp(K, bk)
    gi, gj, gk = _dsl.cdiv(M, bm_), _dsl.cdiv(N, bn_), _dsl.cdiv(K, bk_)
    if K == 0 and bias is not None:
        raise ArgumentError(f"{where}: K = 0 with a bias gives act(bias), which this kernel does not compute "
                            f"(no grid steps run); call tpukernels::matmul")

    def ab(bb):  # batch index of a / b blocks (batch 1 broadcasts)
        return (bb if Ba != 1 else 0), (bb if Bb != 1 else 0)

    if reduce_batch:
        grid = (gi, gj, B, gk)
        sem = ("parallel", "parallel", "arbitrary", "arbitrary")

        def ids(f):
            return lambda i, j, bb, k: f(bb, i, j, k)

        out_b = lambda bb: 0  # noqa: E731
    else:
        grid = (B, gi, gj, gk)
        sem = ("parallel", "parallel", "parallel", "arbitrary")

        def ids(f):
            return f

        out_b = lambda bb: bb  # noqa: E731
    if layout == "tn":
        a_spec = pl.BlockSpec((None, bk_, bm_), ids(lambda bb, i, j, k: (ab(bb)[0], k, i)))
    else:
        a_spec = pl.BlockSpec((None, bm_, bk_), ids(lambda bb, i, j, k: (ab(bb)[0], i, k)))
    if layout == "nt":
        b_spec = pl.BlockSpec((None, bn_, bk_), ids(lambda bb, i, j, k: (ab(bb)[1], j, k)))
    else:
        b_spec = pl.BlockSpec((None, bk_, bn_), ids(lambda bb, i, j, k: (ab(bb)[1], k, j)))
    in_specs = [a_spec, b_spec]
    if bias is not None:
        in_specs.append(pl.BlockSpec((1, bn_), ids(lambda bb, i, j, k: (0, j))))
    o_spec = pl.BlockSpec((None, bm_, bn_), ids(lambda bb, i, j, k: (out_b(bb), i, j)))
    acc = jnp.float32 if acc_dtype is None else acc_dtype
    single = gk * (B if reduce_batch else 1) == 1  # one reduction step: the body never touches acc
    acc_shape = (8, 128) if single else (bm_, bn_)
    need = vmem_bytes(layout, bm_, bk_, bn_, a.dtype, odt, bias is not None, acc, acc_shape)
    # Mosaic keeps a few MiB of internal scratch (the dot result before it is added to acc); launches
    # that need more than the smallest default limit ask for more (capped at 64 MiB, tpu7x's VMEM).
    limit = None
    if need + 4 * MiB > DEFAULT_SCOPED_VMEM:
        limit = min(64 * MiB, max(32 * MiB, -(-(need * 5 // 4 + 4 * MiB) // MiB) * MiB))
    itemsize = np.dtype(a.dtype).itemsize
    Bo = 1 if reduce_batch else B
    cost = pl.CostEstimate(
        flops=2 * B * M * N * K,
        transcendentals=B * M * N if activation in ("gelu_tanh", "silu") else 0,
        bytes_accessed=hbm_bytes(Ba, Bb, M, N, K, bm_, bk_, bn_, itemsize, np.dtype(odt).itemsize, reduce_batch),
    )
    f32 = _dtype_name(a.dtype) == "float32"
    return _dsl.Launch(
        grid=grid,
        in_specs=in_specs,
        out_specs=o_spec,
        out_shape=_dsl.OutSpec((Bo, M, N), odt),
        scratch_shapes=[pltpu.VMEM(acc_shape, acc)],
        dimension_semantics=sem,
        vmem_limit_bytes=limit,
        cost_estimate=cost,
        body_kwargs=dict(
            layout=layout, k_size=int(K), blk_k=int(bk_), n_k=int(gk), has_bias=bias is not None,
            activation=activation, k_axis=3, r_axis=2 if reduce_batch else None, n_r=int(B) if reduce_batch else 1,
            precision=lax.Precision.HIGHEST if f32 else None, rhs_xlu=(layout == "nt" and rhs == "xlu"),
        ),
    )


def heuristic(a, b, bias=None, activation=None, out_dtype=None, reduce_batch=False, *, layout="nn") -> dict:
    """Shape-dependent default blocks (before clamping to the problem).

    bf16: ``bm=512, bk=1024, bn=1024`` (JAX Pallas matmul guide's best v5e blocks: ~10-12 MiB of VMEM,
    under every chip's default scoped limit); float32 (4-byte operands): ``512, 512, 512``. Skinny
    problems (M <= 128, memory-bound on ``b``) use ``bk=2048, bn=1024``: half the grid steps for the same
    VMEM. Per-chip tuned entries (shipped DB) take precedence where the dispatch chip is known.
    """
    Ba, Bb, B, M, N, K = problem_dims(layout, a, b, bias, reduce_batch, f"tpukernels::matmul_{layout}")
    if _dtype_name(a.dtype) == "float32":
        cfg = dict(bm=512, bk=512, bn=512)
    elif M <= 128 and not reduce_batch:
        cfg = dict(bm=512, bk=2048, bn=1024)
    else:
        cfg = dict(bm=512, bk=1024, bn=1024)
    return cfg


def reference_jnp(layout, a, b, bias=None, activation=None, out_dtype=None, reduce_batch=False):
    """Plain jax implementation of a kernel call (f32 accumulation; the autotuner's correctness check)."""
    import jax.numpy as jnp
    from jax import lax

    odt = _kernel_out_dtype(out_dtype, a, f"tpukernels::matmul_{layout}")
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    if layout == "nt":
        b32 = jnp.swapaxes(b32, 1, 2)
    if layout == "tn":
        a32 = jnp.swapaxes(a32, 1, 2)
    z = jnp.matmul(a32, b32, precision=lax.Precision.HIGHEST)
    if reduce_batch:
        z = z.sum(0, keepdims=True)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    return activation_jnp(z, activation).astype(odt)


# ----------------------------------------------------------------------------------------------- the three ops
def _define(layout: str):
    body = _matmul_body
    tunables = TUNABLES_NT if layout == "nt" else TUNABLES

    def heur(a, b, bias=None, **statics):
        return heuristic(a, b, bias, **statics, layout=layout)

    def shape_fn(a, b, bias=None, **statics):
        return out_spec(layout, a, b, bias, **statics)

    def ref(a, b, bias=None, activation=None, out_dtype=None, reduce_batch=False):
        return reference_jnp(layout, a, b, bias, activation, out_dtype, reduce_batch)

    if layout == "nt":

        def launch(a: torch.Tensor, bt: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   activation: Optional[str] = None, out_dtype: Optional[str] = None, reduce_batch: bool = False,
                   *, bm: int, bk: int, bn: int, rhs: str) -> torch.Tensor:
            return make_launch("nt", a, bt, bias, activation, out_dtype, reduce_batch, bm, bk, bn, rhs)

    elif layout == "tn":

        def launch(at: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   activation: Optional[str] = None, out_dtype: Optional[str] = None, reduce_batch: bool = False,
                   *, bm: int, bk: int, bn: int) -> torch.Tensor:
            return make_launch("tn", at, b, bias, activation, out_dtype, reduce_batch, bm, bk, bn)

    else:

        def launch(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   activation: Optional[str] = None, out_dtype: Optional[str] = None, reduce_batch: bool = False,
                   *, bm: int, bk: int, bn: int) -> torch.Tensor:
            return make_launch("nn", a, b, bias, activation, out_dtype, reduce_batch, bm, bk, bn)

    launch.__name__ = f"matmul_{layout}"
    launch.__doc__ = _OP_DOCS[layout]
    return _dsl.tpu_kernel(body, name=f"matmul_{layout}", namespace="tpukernels", tunables=tunables,
                           heuristic=heur, out_shape=shape_fn, reference=_dsl.jax_reference(ref),
                           canonicalize=_dsl.dtype_default("out_dtype", 0))(launch)


_OP_DOC_COMMON = """

    bias: optional ``[1, N]`` (any kernel dtype), added in f32. activation: None | "gelu_tanh" | "silu" |
    "relu" (f32). out_dtype: "bfloat16" | "float32" | None (= operand dtype). reduce_batch: sum the
    per-batch products into one ``[1, M, N]`` result (gradients of broadcast operands). Operands:
    bfloat16 or float32, one dtype; a batch of 1 broadcasts against the other operand's batch.

    Raises:
        ArgumentError: ranks, contraction dims, batch sizes, bias shape, activation name, K = 0 with bias.
        DTypeError: mixed or unsupported dtypes (float16: use ``tpukernels::matmul``).
    """
_OP_DOCS = {
    "nn": "``act(a @ b + bias)`` with ``a [B|1, M, K]``, ``b [B|1, K, N]`` -> ``[B, M, N]``." + _OP_DOC_COMMON,
    "nt": "``act(a @ bt^T + bias)`` with ``a [B|1, M, K]``, ``bt [B|1, N, K]`` (e.g. an nn.Linear weight) -> "
          "``[B, M, N]``." + _OP_DOC_COMMON,
    "tn": "``act(at^T @ b + bias)`` with ``at [B|1, K, M]``, ``b [B|1, K, N]`` -> ``[B, M, N]``." + _OP_DOC_COMMON,
}

matmul_nn = _define("nn")
matmul_nt = _define("nt")
matmul_tn = _define("tn")
KERNELS = {"nn": matmul_nn, "nt": matmul_nt, "tn": matmul_tn}
_OPS = {"nn": "matmul_nn", "nt": "matmul_nt", "tn": "matmul_tn"}


def _op(layout):
    return getattr(torch.ops.tpukernels, _OPS[layout]).default


# ----------------------------------------------------------------------------------------------- backward
#: per layout: (op, x, y) for the gradient of the first operand, then of the second; names: "g" = dZ,
#: "a" / "b" = the forward's first / second operand.
_GRAD_PLAN = {
    "nn": (("nt", "g", "b"), ("tn", "a", "g")),  # dA = dZ B^T ; dB = A^T dZ
    "nt": (("nn", "g", "b"), ("tn", "g", "a")),  # dA = dZ Bt ; dBt = dZ^T A
    "tn": (("nt", "b", "g"), ("nn", "a", "g")),  # dAt = B dZ^T ; dB = At dZ
}


def _grad_call(layout, x, y, target_batch: int, dtype: str):
    Bx, By = x.shape[0], y.shape[0]
    b_out = Bx if By == 1 else By
    reduce = target_batch == 1 and b_out != 1
    out = _op(layout)(x, y, None, None, dtype, reduce)
    if not reduce and b_out != target_batch:  # gradient of a reduce_batch forward: same for every batch
        out = out.expand(target_batch, *out.shape[1:])
    return out


def _make_backward(layout: str):
    first, second = {"nn": ("a", "b"), "nt": ("a", "bt"), "tn": ("at", "b")}[layout]

    def backward(ctx, g):
        x, y, bias = ctx.args[first], ctx.args[second], ctx.args["bias"]
        act, red = ctx.args["activation"], ctx.args["reduce_batch"]
        need_x, need_y = ctx.needs_input_grad.get(first), ctx.needs_input_grad.get(second)
        need_bias = bias is not None and ctx.needs_input_grad.get("bias")
        if act is not None:
            z = _op(layout)(x, y, bias, None, "float32", red)  # pre-activation, recomputed in f32
            dz32 = g.float() * activation_grad_torch(z, act)
        else:
            dz32 = g
        dz = dz32.to(x.dtype)
        ops = {"a": x, "b": y, "g": dz}
        grads = {}
        (op1, p1, q1), (op2, p2, q2) = _GRAD_PLAN[layout]
        if need_x:
            grads[first] = _grad_call(op1, ops[p1], ops[q1], x.shape[0], _dtype_name(x.dtype))
        if need_y:
            grads[second] = _grad_call(op2, ops[p2], ops[q2], y.shape[0], _dtype_name(y.dtype))
        if need_bias:
            grads["bias"] = dz32.float().sum(dim=(0, 1)).reshape(1, -1).to(bias.dtype)
        return grads

    return backward


for _layout, _k in KERNELS.items():
    _k.def_backward(_make_backward(_layout), op="matmul", double_backward=True)  # made of matmul kernels + torch


# ----------------------------------------------------------------------------------------------- public op
def _batched(x: torch.Tensor, batch_shape, batch: int) -> torch.Tensor:
    """``x [..., R, C]`` as ``[1 | batch, R, C]``: batch dims that are all size 1 or stride 0 are read once."""
    lead = x.shape[:-2]
    if all(s == 1 or st == 0 for s, st in zip(lead, x.stride()[:-2])):
        return x[(0,) * len(lead)].unsqueeze(0) if lead else x.unsqueeze(0)
    return x.expand(*batch_shape, *x.shape[-2:]).reshape(batch, *x.shape[-2:])


def _is_rowmajor(x: torch.Tensor) -> bool:
    return x.is_contiguous()


def _is_colmajor(x: torch.Tensor) -> bool:
    return x.transpose(-1, -2).is_contiguous()


def plan(a: torch.Tensor, b: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor, bool]:
    """Pick the kernel for ``a @ b`` from strides: ``(layout, x, y, folded)`` with 3-D kernel operands.

    ``folded``: ``a``'s batch was folded into its rows (``b`` has no batch), so the output is
    ``[1, batch*M, N]``. Copies happen only for layouts no kernel reads directly (see module docstring).
    """
    batch_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    nbatch = math.prod(batch_shape)
    a3, b3 = _batched(a, batch_shape, nbatch), _batched(b, batch_shape, nbatch)
    a_row, a_col = _is_rowmajor(a3), _is_colmajor(a3)
    b_row, b_col = _is_rowmajor(b3), _is_colmajor(b3)
    if not (a_row or a_col) or (a_col and not a_row and b_col and not b_row):
        a3, a_row, a_col = a3.contiguous(), True, False
    if not (b_row or b_col):
        b3, b_row = b3.contiguous(), True
    folded = False
    if a_row and b3.shape[0] == 1 and a3.shape[0] != 1:
        a3, folded = a3.reshape(1, a3.shape[0] * a3.shape[1], a3.shape[2]), True
    if a_row:
        return ("nn", a3, b3, folded) if b_row else ("nt", a3, b3.transpose(-1, -2), folded)
    return "tn", a3.transpose(-1, -2), b3, folded


def _check_public(a, b, bias, activation, out_dtype):
    where = "tpukernels::matmul"
    for x, n in ((a, "a"), (b, "b")):
        if not isinstance(x, torch.Tensor):
            raise ArgumentError(f"{where}: {n} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ArgumentError(f"{where}: {n} must have rank >= 2 ([..., rows, cols]), got shape {tuple(x.shape)}")
        if _dtype_name(x.dtype) not in PUBLIC_DTYPES:
            raise DTypeError(f"{where}: {n} dtype {_dtype_name(x.dtype)} is not supported; use {PUBLIC_DTYPES}"
                             + (" (TPUs have no float64; cast with .float())" if x.dtype == torch.float64 else ""))
    if a.dtype != b.dtype:
        raise DTypeError(f"{where}: a is {_dtype_name(a.dtype)} but b is {_dtype_name(b.dtype)}; use one dtype")
    if a.shape[-1] != b.shape[-2]:
        raise ArgumentError(f"{where}: a {tuple(a.shape)} and b {tuple(b.shape)}: a.shape[-1] (K = {a.shape[-1]}) "
                            f"must equal b.shape[-2] ({b.shape[-2]})")
    try:
        torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise ArgumentError(f"{where}: batch dims {tuple(a.shape[:-2])} (a) and {tuple(b.shape[:-2])} (b) do not "
                            f"broadcast") from None
    if bias is not None:
        if tuple(bias.shape) != (b.shape[-1],):
            raise ArgumentError(f"{where}: bias must have shape (N,) = ({b.shape[-1]},), got {tuple(bias.shape)}")
        if _dtype_name(bias.dtype) not in PUBLIC_DTYPES:
            raise DTypeError(f"{where}: bias dtype {_dtype_name(bias.dtype)} is not supported; use {PUBLIC_DTYPES}")
    _check_activation(activation, where)
    return canonical_out_dtype(out_dtype) or _dtype_name(a.dtype)


def _matmul_impl(a, b, bias=None, activation=None, out_dtype=None, *, bucket=True):
    """The public op (CompositeImplicitAutograd: autograd and torch.compile see the kernel ops)."""
    odt = _check_public(a, b, bias, activation, out_dtype)
    batch_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, N, K = a.shape[-2], b.shape[-1], a.shape[-1]
    if a.dtype == torch.float16:  # Mosaic has no float16 loads/stores: widen (exact), round once at the end
        a, b = a.float(), b.float()
    if bias is not None and bias.dtype == torch.float16:
        bias = bias.float()
    kdt = "float32" if odt == "float16" else odt
    if not isinstance(bucket, bool):
        raise ArgumentError(f"tpukernels::matmul: bucket must be a bool, got {bucket!r}")
    if K == 0 and bias is not None:  # no K steps run: z = 0 + bias, epilogue here (f32)
        z = plan_and_run(a, b, None, None, "float32", batch_shape, M, N, bucket=bucket)
        return activation_torch(z + bias.float(), activation).to(getattr(torch, odt))
    out = plan_and_run(a, b, None if bias is None else bias.reshape(1, N), activation, kdt, batch_shape, M, N,
                       bucket=bucket)
    return out if odt == kdt else out.to(getattr(torch, odt))


def plan_and_run(a, b, bias2, activation, kdt, batch_shape, M, N, bucket=False):
    """Run the kernel :func:`plan` picks; with ``bucket``, its rows (``M``, or ``batch * M`` when folded) padded
    with zeros to :func:`tpukernels.dsl.kernel.bucket` and the output rows sliced back (rows are independent:
    exact; padded rows get zero gradients and add nothing to ``dB`` / ``dbias``)."""
    layout, x, y, folded = plan(a, b)
    rdim = 2 if layout == "tn" else 1  # tn stores a transposed: its rows are the last dim
    rows = x.shape[rdim]
    rows_b = _dsl.bucket(rows) if bucket and rows > 0 else rows
    # symbolic rows (torch.compile(dynamic=True)): always pad and slice (padding by 0 is exact) and return
    # standard strides, so that no guard "rows == bucket" makes a bucket's own length trace a second graph
    symbolic = bucket and isinstance(rows, torch.SymInt)
    if symbolic or rows_b != rows:
        x = torch.nn.functional.pad(x, [0, 0, 0, rows_b - rows] if rdim == 1 else [0, rows_b - rows])
    out = _op(layout)(x, y, bias2, activation, kdt, False)
    if symbolic or rows_b != rows:
        out = out.narrow(1, 0, rows)
    if symbolic:
        out = out.clone(memory_format=torch.contiguous_format)
    if not folded and out.shape[0] == 1 and math.prod(batch_shape) != 1:  # both operands batch-broadcast
        return out.expand(math.prod(batch_shape), M, N).contiguous().reshape(*batch_shape, M, N)
    return out.reshape(*batch_shape, M, N)


_LIB = torch.library.Library("tpukernels", "FRAGMENT")
_LIB.define("matmul(Tensor a, Tensor b, Tensor? bias=None, str? activation=None, str? out_dtype=None, *, "
            "bool bucket=True) -> Tensor")
_LIB.impl("matmul", _matmul_impl, "CompositeImplicitAutograd")


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
           out_dtype=None, *, bucket: bool = True) -> torch.Tensor:
    """``act(a @ b + bias)`` rounded once to ``out_dtype``; ``torch.ops.tpukernels.matmul`` (differentiable).

    Args:
        a: ``[..., M, K]`` bfloat16 / float16 / float32 (cpu: Pallas interpret; tpu: TorchTPU).
        b: ``[K, N]`` or ``[..., K, N]``, same dtype; ``W.t()`` of an ``[N, K]`` weight is read in place.
        bias: optional ``[N]`` (any of the three dtypes), added in f32.
        activation: None, ``"gelu_tanh"``, ``"silu"`` or ``"relu"``, applied in f32 (module docstring).
        out_dtype: result dtype (torch dtype or name); default ``a.dtype``.
        bucket: pad the kernel's rows (``M``; ``batch * M`` when ``b`` has no batch) with zeros to their shape
            bucket, so every row count in a bucket runs one lowered program (default True; ``False``: one
            program per exact ``M``). Bucket: a multiple of ``max(8, 2**(bit_length(M - 1) - 3))``, four per
            power of two, at most 25% padding (:func:`tpukernels.bucket`, the ``rows=`` kernels' rule;
            1025..1280 -> 1280). Exact (rows are independent); costs a zero-padded copy of ``a``.

    Returns:
        ``[*broadcast(a.shape[:-2], b.shape[:-2]), M, N]`` in ``out_dtype``.

    Raises:
        ArgumentError: rank < 2, ``a.shape[-1] != b.shape[-2]``, batch dims that do not broadcast, bias not
            ``[N]``, unknown activation, a non-bool ``bucket``.
        DTypeError: float64 / integer operands, ``a`` and ``b`` of different dtypes, bad ``out_dtype``.
    """
    if not isinstance(bucket, bool):  # the op's schema would reject it with an untyped cast error
        raise ArgumentError(f"tpukernels::matmul: bucket must be a bool, got {bucket!r}")
    return torch.ops.tpukernels.matmul(a, b, bias, activation, canonical_out_dtype(out_dtype), bucket=bucket)


def reference(a, b, bias=None, activation=None) -> torch.Tensor:
    """float64 reference of :func:`matmul` computed from the given (low-precision) inputs, **not** rounded."""
    z = torch.matmul(a.double(), b.double())
    if bias is not None:
        z = z + bias.double()
    return activation_torch(z, activation)


#: the shapes the shipped defaults are tuned for (``tpukernels autotune --library``, benchmarks/matmul.py)
STANDARD_CASES = [
    (matmul_nn, ("1x1024x1024:bf16", "1x1024x1024:bf16"), {}),
    (matmul_nn, ("1x4096x4096:bf16", "1x4096x4096:bf16"), {}),
    (matmul_nn, ("1x8192x8192:bf16", "1x8192x8192:bf16"), {}),
    (matmul_nt, ("1x8192x4096:bf16", "1x14336x4096:bf16"), {}),  # x @ W.T, an MLP up-projection
]

__all__ = ["matmul", "reference", "matmul_nn", "matmul_nt", "matmul_tn", "KERNELS", "ACTIVATIONS", "heuristic",
           "make_launch", "plan", "canonical_out_dtype"]
