"""``quantized_matmul_kernel`` (w8a16, and the two-kernel w8a8 path with ``x_scale``): the blocked launch,
the weight-streaming decode launch (:func:`stream_plan`), its jnp reference, tunables and heuristic, and
``quantized_matmul_bwd_dx`` (``d_x`` for w8a16). Package docstring: modes, error bounds, performance."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ... import dsl as _dsl
from ...dsl.validate import padded_bytes
from ..vmem import scoped_vmem_limit
from ...errors import ArgumentError, DTypeError
from .common import (INT32_MAX_K, WEIGHT_DTYPES, X_DTYPES, check_chip, clamp, dtype_name, jnp_dtype, native_fp8,
                     resolve_out_dtype)

TUNABLES = {
    "bm": _dsl.Tunable([512, 128, 256, 1024, 2048], default=512, doc="rows of the output block (tokens)"),
    "bk": _dsl.Tunable([1024, 256, 512, 2048, 4096], default=1024, doc="contraction block (K)"),
    "bn": _dsl.Tunable([1024, 256, 512, 2048, 4096], default=1024, doc="columns of the output block (N)"),
}


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


def problem(layout, x, w, ws, xs=None, where="tpukernels::quantized_matmul_kernel"):
    """``(M, N, K)`` of a kernel call after checking ranks, agreement and dtypes (``N`` = output columns).

    Raises:
        ArgumentError: ranks, contraction dims, scale shapes, int32 overflow risk (K too large).
        DTypeError: dtypes outside the supported pairs.
    """
    for t, n in ((x, "x"), (w, "w_q"), (ws, "w_scale")):
        if len(t.shape) != 2:
            raise ArgumentError(f"{where}: {n} must be 2-D, got shape {tuple(t.shape)}")
    dx, dw = dtype_name(x.dtype), dtype_name(w.dtype)
    if dw not in WEIGHT_DTYPES:
        raise DTypeError(f"{where}: w_q dtype {dw} is not one of {WEIGHT_DTYPES}")
    if dtype_name(ws.dtype) != "float32":
        raise DTypeError(f"{where}: w_scale must be float32, got {dtype_name(ws.dtype)}")
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
        if tuple(xs.shape) != (M, 1) or dtype_name(xs.dtype) != "float32":
            raise ArgumentError(f"{where}: x_scale must be float32 (M, 1) = ({M}, 1), got {tuple(xs.shape)} "
                                f"{dtype_name(xs.dtype)}")
        if dx != dw:
            raise DTypeError(f"{where}: with x_scale (w8a8) x must have w_q's dtype {dw}, got {dx}")
        if dx == "int8" and K > INT32_MAX_K:
            raise ArgumentError(f"{where}: K = {K} > {INT32_MAX_K}: an int8 x int8 sum may overflow int32")
    elif dx not in X_DTYPES:
        raise DTypeError(f"{where}: x dtype {dx} is not one of {X_DTYPES} (w8a16; pass x_scale for w8a8)")
    return M, N, K


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
    bm_, bn_, bk_ = clamp(M, bm), clamp(N, bn), clamp(K, bk)
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
    odt = resolve_out_dtype(out_dtype, x, where)
    dx, dw = dtype_name(x.dtype), dtype_name(w.dtype)
    if layout == "nt":
        check_chip("int8" if xs is not None and dw == "int8" else ("fp8" if xs is not None else None), dw,
                   where=where)
    acc_int = xs is not None and dw == "int8"
    dequant_to = None
    if xs is None and not native_fp8(dx, dw):
        dequant_to = jnp_dtype(dx)
    bm_, bn_, bk_ = clamp(M, bm), clamp(N, bn), clamp(K, bk)
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
    if dtype_name(x.dtype) == "float32":
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
    return z.astype(resolve_out_dtype(out_dtype, x, "quantized_matmul_kernel"))


def _kernel_shape(x, w_q, w_scale, x_scale=None, out_dtype=None):
    where = "tpukernels::quantized_matmul_kernel"
    M, N, K = problem("nt", x, w_q, w_scale, x_scale, where)
    return _dsl.OutSpec((M, N), resolve_out_dtype(out_dtype, x, where))


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
    return _dsl.OutSpec((M, N), resolve_out_dtype(out_dtype, g, "tpukernels::quantized_matmul_bwd_dx"))


def _dx_heuristic(g, w_q, w_scale, out_dtype=None):
    return dict(bm=512, bk=1024, bn=1024) if dtype_name(g.dtype) != "float32" else dict(bm=512, bk=512, bn=512)


@_dsl.tpu_kernel(_qmm_body, name="quantized_matmul_bwd_dx", namespace="tpukernels", tunables=TUNABLES,
                 heuristic=_dx_heuristic, out_shape=_dx_shape)
def quantized_matmul_bwd_dx(g: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: Optional[str] = None, *, bm: int, bk: int, bn: int) -> torch.Tensor:
    """``d_x = (g * w_scale) . w_q`` with ``g [M, N]`` bf16/f32, ``w_q [N, K]``, ``w_scale [1, N]`` -> ``[M, K]``."""
    return make_launch("nn", g, w_q, w_scale, None, out_dtype, bm, bk, bn)


def _backward(ctx, g):
    x, w_q, ws, xs = ctx.args["x"], ctx.args["w_q"], ctx.args["w_scale"], ctx.args["x_scale"]
    grads = {}
    if ctx.needs_input_grad.get("x"):
        if xs is not None:
            raise ArgumentError("tpukernels::quantized_matmul_kernel: no gradient for w8a8 (quantized x)")
        grads["x"] = torch.ops.tpukernels.quantized_matmul_bwd_dx.default(g.to(x.dtype), w_q, ws, dtype_name(x.dtype))
    return grads


quantized_matmul_kernel.def_backward(_backward, op="quantized_matmul")


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
