"""``quantized_matmul_w8a8_kernel``: the fused w8a8 path (per-token quantization inside the matmul, ``x`` read
once as bf16), its plan (:func:`fused_plan`), VMEM budget, jnp reference, tunables and heuristic."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ... import dsl as _dsl
from ...dsl.validate import padded_bytes
from ..vmem import SHIPPED_CHIPS, MiB, scoped_vmem_limit
from ...errors import ArgumentError
# ``name as _name``: the kernel bodies and launch functions here keep the names they had, so their source, which
# keys their entries in the tuning DB (tpukernels/autotune/db.py), is unchanged
from .common import (INT32_MAX_K, check_chip, clamp, dtype_name, qmax, resolve_out_dtype as _out_dtype,
                     target_chip as _target_chip)
from .quantize import quantize_values as _quantize_values, reciprocal as _reciprocal
from .w8a16 import problem

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
    from ...chips import get_chip

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
    bk_, bn_ = clamp(K, bk), clamp(N, bn)
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
    dw = dtype_name(w.dtype)
    if dw == "int8" and K > INT32_MAX_K:
        raise ArgumentError(f"{where}: K = {K} > {INT32_MAX_K}: an int8 x int8 sum may overflow int32")
    return M, N, K, dw


def _w8a8_shape(x, w_q, w_scale, out_dtype=None):
    where = "tpukernels::quantized_matmul_w8a8_kernel"
    M, N, K, _ = _w8a8_problem(x, w_q, w_scale, where)
    return _dsl.OutSpec((M, N), _out_dtype(out_dtype, x, where))


def w8a8_heuristic(x, w_q, w_scale, out_dtype=None):
    """Prefill: ``bm=1024`` (the ``w_q`` stream then carries 2 * 1024 int8 ops per byte, above v6e's
    int8-peak / HBM ratio of ~1120), ``bn=1024``, ``bk = K`` up to 4096 (one K step: no accumulator
    round trip), else 2048. libtpu estimates on v6e (a model), 2048 tokens: K=4096 -> 14336 at bk 4096 /
    2048: 161.6 / 169.5 µs (bn=2048: 163.4 / 165.7); K=14336 -> 4096 at bk 2048 / 4096 / 1024 (bn 2048):
    213.0 / 228.9 / 217.0 µs, bm=512: 226.9 µs. Decode (M <= 128): one row block, ``bk=bn=2048`` for
    fewer, larger weight DMAs."""
    if x.shape[0] <= 128:
        return dict(bm=1024, bk=2048, bn=2048)
    return dict(bm=1024, bk=4096 if x.shape[1] <= 4096 else 2048, bn=1024)


_w8a8_heuristic = w8a8_heuristic  # the kernel bodies here keep this name: the tuning DB keys them by their source


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


#: the fused w8a8 kernel at the prefill shapes (int8 on v5e / v6e; float8_e4m3fn on tpu7x, which has no int8 MXU)
STANDARD_CASES_W8A8 = [
    (quantized_matmul_w8a8_kernel, (f"8192x{K}:bf16", f"{N}x{K}:{dt}", f"1x{N}:f32"), {})
    for dt in ("i8", "float8_e4m3fn") for K, N in ((4096, 14336), (14336, 4096))
]
