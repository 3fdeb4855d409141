"""``rhs_bias [G, 1, N]`` in ``grouped_matmul`` and ``grouped_matmul_quantized`` (megablox gmm's ``rhs_bias``; issue
28): added in float32 to the rows of each local group in the forward kernel's epilogue, before the cast; rows of no
local group stay 0; ``d_rhs_bias[g]`` = the sum of the output gradient over the rows of group ``g``.

Accuracy criterion, elementwise against float64 from the low-precision inputs (``u`` the output dtype's unit
roundoff, ``u32 = 2^-24``, ``ref = lhs_g @ W_g + bias_g`` on the rows of group ``g``, 0 elsewhere):

* forward (plain): ``|y - ref| <= (K + 2) u32 (|lhs| @ |W_g|) (1 + 2^-7) + (u + 2 u32) |ref|`` — the float32
  accumulation of K products (Higham's gamma_K), one f32 addition of the bias, one cast (Higham, "Accuracy and
  Stability of Numerical Algorithms", 2nd ed., eq. 3.5); exactly 0 on rows of no local group;
* forward (quantized): :func:`~tpukernels.library.grouped_matmul_ops.quant.error_bound_quantized` with ``rhs_bias``;
* ``d_rhs_bias``: ``|d - ref| <= u_b |ref| + n_g u32 sum_rows |dO|`` (float32 accumulation of ``n_g`` rows, one
  cast to the bias dtype, unit roundoff ``u_b``);
* ``d_lhs`` / ``d_rhs``: bit-identical to the same call without a bias (the bias has no path into them).

A bias added to the wrong group's rows, to rows of no group, twice (two K steps or visits) or in the wrong dtype
moves elements by about ``|bias|`` (O(1) here), far above these bounds.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpukernels as tk
import tpukernels.library  # noqa: F401
from tpukernels.errors import ArgumentError, DeviceError, DTypeError

gm = importlib.import_module("tpukernels.library.grouped_matmul_ops")
gq = importlib.import_module("tpukernels.library.grouped_matmul_ops.quant")
U32 = 2.0 ** -24
U = {torch.bfloat16: 2.0 ** -8, torch.float32: U32}
SMALL = dict(bm=16, bk=128, bn=128)  # several row tiles, K steps (K tail) and N blocks (N tail) at test shapes


@st.composite
def _sizes(draw, M, G):
    """Group sizes summing to <= M with empty groups and tile-crossing boundaries; ``G_total >= G`` with an offset."""
    sizes = draw(st.lists(st.integers(0, 24), min_size=G, max_size=G))
    while sum(sizes) > M:
        sizes[int(np.argmax(sizes))] //= 2
    return sizes


def _owned(sizes, offset, M, G):
    rows = torch.zeros(M, dtype=torch.bool)
    for s, e in gm.ref_bounds_np(np.array(sizes), [offset], M, G):
        rows[s:e] = True
    return rows


def _check_bias_grad(grad, dO, sizes, offset, G, bias_dtype):
    """``grad [G, 1, N]`` against float64 per-group sums of ``dO`` (module docstring's bound)."""
    assert grad.dtype == bias_dtype and grad.shape[:2] == (G, 1)
    for g, (s, e) in enumerate(gm.ref_bounds_np(np.array(sizes), [offset], dO.shape[0], G)):
        ref = dO[s:e].double().sum(0)
        bound = U[bias_dtype] * ref.abs() + (e - s) * U32 * dO[s:e].double().abs().sum(0)
        assert ((grad[g, 0].double() - ref).abs() <= bound).all(), f"d_rhs_bias[{g}]"


@pytest.mark.parametrize("dtype, bias_dtype, tr, offset", [
    (torch.bfloat16, torch.float32, True, 0), (torch.float32, torch.bfloat16, False, 1),
], ids=["bf16-nt-f32bias", "f32-nn-bf16bias-shard"])
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_grouped_matmul_bias_within_bound(dtype, bias_dtype, tr, offset, data):
    """Forward within the bound (rows of no local group exactly 0), ``d_rhs_bias`` within its bound, ``d_lhs`` /
    ``d_rhs`` bit-identical to the bias-free call; ragged groups incl. empty ones, a shard (``group_offset``:
    the rows of the groups outside it get no bias), K and N tails."""
    M, K, N, G = 60, 200, 140, 3
    local = data.draw(_sizes(M - 9, G))
    sizes = [5] * offset + local + [4] * offset  # groups outside the shard own rows too
    gen = torch.Generator().manual_seed(sum(sizes) + offset)
    lhs = torch.randn(M, K, generator=gen).to(dtype)
    rhs = (torch.randn(G, N, K, generator=gen) if tr else torch.randn(G, K, N, generator=gen)).to(dtype)
    bias = (4 * torch.randn(G, 1, N, generator=gen)).to(bias_dtype)
    gs = torch.tensor(sizes, dtype=torch.int32)
    kw = dict(transpose_rhs=tr, group_offset=offset if offset else None, config=SMALL)
    x, w, b = (t.clone().requires_grad_(True) for t in (lhs, rhs, bias))
    y = gm.grouped_matmul(x, w, gs, rhs_bias=b, **kw)

    ref = gm.reference(lhs, rhs, gs, transpose_rhs=tr, group_offset=offset, rhs_bias=bias)
    mag = gm.reference(lhs.abs(), rhs.abs(), gs, transpose_rhs=tr, group_offset=offset)
    bound = (K + 2) * U32 * mag * (1 + 2.0 ** -7) + (U[dtype] + 2 * U32) * ref.abs()
    assert y.dtype == dtype and y.shape == (M, N)
    bad = (y.double() - ref).abs() > bound
    assert not bad.any(), f"forward: {int(bad.sum())} elements outside the bound"
    assert (y[~_owned(sizes, offset, M, G)] == 0).all()

    dO = torch.randn(M, N, generator=gen).to(dtype)
    y.backward(dO)
    _check_bias_grad(b.grad, dO, sizes, offset, G, bias_dtype)
    # the bias-free backward: d_lhs = dO @ W^T per group (grouped_matmul_fwd), d_rhs per group (tgmm)
    go = torch.tensor([offset], dtype=torch.int32)
    ops = torch.ops.tpukernels
    want_x = ops.grouped_matmul_fwd(gs, go, dO, rhs, None, not tr, str(dtype)[6:])
    want_w = ops.grouped_matmul_tgmm(gs, go, dO if tr else lhs, lhs if tr else dO, G, str(dtype)[6:])
    assert torch.equal(x.grad, want_x) and torch.equal(w.grad, want_w)


@pytest.mark.parametrize("interpret", ["tpu"], indirect=True)
def test_bias_nan_poisoned_interpret(interpret):
    """NaN-poisoned interpret mode (uninitialised VMEM / output memory is NaN): the bias block of an N tail, a
    group boundary inside a tile, an empty group, rows past ``sum(group_sizes)``, the manual rhs prefetch chain
    (one K step, ``bn`` dividing N) and the pipelined path (K steps), plain and quantized (int8 per channel,
    ``[G, K, N]``)."""
    M, K, N, G = 40, 256, 200, 3
    gen = torch.Generator().manual_seed(5)
    sizes = torch.tensor([7, 0, 25], dtype=torch.int32)
    lhs = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    rhs = torch.randn(G, N, K, generator=gen).to(torch.bfloat16)
    bias = 4 * torch.randn(G, 1, N, generator=gen)
    ref = gm.reference(lhs, rhs, sizes, transpose_rhs=True, rhs_bias=bias)
    mag = gm.reference(lhs.abs(), rhs.abs(), sizes, transpose_rhs=True)
    bound = (K + 2) * U32 * mag * (1 + 2.0 ** -7) + (U[torch.bfloat16] + 2 * U32) * ref.abs()
    for cfg in (dict(bm=16, bk=256, bn=200), dict(bm=16, bk=128, bn=128)):  # prefetch chain; K steps + N tail
        y = gm.grouped_matmul(lhs, rhs, sizes, transpose_rhs=True, rhs_bias=bias, config=cfg)
        assert not ((y.double() - ref).abs() > bound).any(), cfg
        assert (y[32:] == 0).all()
    q, s, _ = gq.quantize_experts(torch.randn(G, 200, K, generator=gen), None, "int8", transpose_rhs=False)
    qb = torch.randn(G, 1, 200, generator=gen).to(torch.bfloat16)
    y = gq.grouped_matmul_quantized(lhs, q, sizes, s, rhs_bias=qb, config=dict(bm=16, bk=128, bn=128))
    want = gq.reference_quantized(lhs, q, sizes, s, rhs_bias=qb)
    assert not ((y.double() - want).abs() > gq.error_bound_quantized(lhs, q, sizes, s, rhs_bias=qb)).any()
    assert (y[32:] == 0).all()


@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_quantized_bias_within_bound(data):
    """grouped_matmul_quantized with ``rhs_bias`` (int4 with zero points, 64-column blocks, ``[G, N, K/2]``):
    forward within ``error_bound_quantized`` (bias included), rows of no local group 0, ``d_rhs_bias`` within its
    bound, ``d_lhs`` within ``error_bound_quantized_dx`` (the bias-free bound: it has no path there). The
    epilogue's bias does not depend on the weight format (fp8 / int8 per channel: the NaN-poisoned test)."""
    fmt, bs, tr = "int4", 64, True
    M, K, N, G = 56, 256, 136, 3
    sizes = data.draw(_sizes(M - 5, G))
    gen = torch.Generator().manual_seed(sum(sizes) + 1)
    w = torch.randn(G, N, K, generator=gen)
    rhs, s, z = gq.quantize_experts(w, bs, fmt, asymmetric=fmt == "int4", transpose_rhs=tr)
    lhs = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    bias = (4 * torch.randn(G, 1, N, generator=gen)).to(torch.bfloat16)
    gs = torch.tensor(sizes, dtype=torch.int32)
    wf = "fp4" if fmt == "fp4" else None
    kw = dict(rhs_zero_point=z, transpose_rhs=tr, weight_format=wf)
    x, b = lhs.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    y = gq.grouped_matmul_quantized(x, rhs, gs, s, rhs_bias=b, config=SMALL, **kw)
    ref = gq.reference_quantized(lhs, rhs, gs, s, z, transpose_rhs=tr, weight_format=wf, rhs_bias=bias)
    bound = gq.error_bound_quantized(lhs, rhs, gs, s, z, transpose_rhs=tr, weight_format=wf, rhs_bias=bias)
    bad = (y.double() - ref).abs() > bound
    assert not bad.any(), f"forward: {int(bad.sum())} elements outside the bound"
    assert (y[~_owned(sizes, 0, M, G)] == 0).all()
    dO = torch.randn(M, N, generator=gen).to(torch.bfloat16)
    y.backward(dO)
    _check_bias_grad(b.grad, dO, sizes, 0, G, torch.bfloat16)
    d_ref = gq.reference_quantized_dx(dO, rhs, gs, s, z, transpose_rhs=tr, weight_format=wf)
    d_bound = gq.error_bound_quantized_dx(dO, rhs, gs, s, z, transpose_rhs=tr, weight_format=wf)
    assert not ((x.grad.double() - d_ref).abs() > d_bound).any()


def test_bias_absent_adds_no_operand():
    """Without ``rhs_bias`` the forward launch has exactly the operands it had before the argument existed (lhs,
    rhs; the quantized kernel lhs, rhs, rhs_scale) and no ``has_bias`` body argument: the same program."""
    import jax.numpy as jnp

    specs = [tk.TensorSpec((2,), jnp.int32), tk.TensorSpec((1,), jnp.int32), tk.TensorSpec((64, 256), jnp.bfloat16),
             tk.TensorSpec((2, 128, 256), jnp.bfloat16)]
    cfg = dict(bm=16, bk=256, bn=128, rhs_prefetch=False)
    plain = gm.grouped_matmul_fwd.make_launch(specs + [None], dict(transpose_rhs=True), cfg)
    with_bias = gm.grouped_matmul_fwd.make_launch(specs + [tk.TensorSpec((2, 1, 128), jnp.float32)],
                                                  dict(transpose_rhs=True), cfg)
    assert len(plain.in_specs) == 2 and "has_bias" not in plain.body_kwargs
    assert len(with_bias.in_specs) == 3 and with_bias.body_kwargs["has_bias"]


def test_bad_rhs_bias_raises_typed_errors():
    """Shape, dtype, device, type: typed errors naming ``rhs_bias``, before any kernel runs (both ops)."""
    lhs = torch.zeros(8, 64)
    rhs = torch.zeros(2, 64, 32)
    gs = torch.tensor([3, 5], dtype=torch.int32)
    q, s, _ = gq.quantize_experts(torch.randn(2, 32, 64), None, "int8", transpose_rhs=False)
    calls = [lambda b: gm.grouped_matmul(lhs, rhs, gs, rhs_bias=b),
             lambda b: gq.grouped_matmul_quantized(lhs, q, gs, s, rhs_bias=b)]
    for call in calls:
        with pytest.raises(ArgumentError, match=r"rhs_bias must have shape \[G, 1, N\] = \[2, 1, 32\]"):
            call(torch.zeros(2, 32))
        with pytest.raises(ArgumentError, match=r"rhs_bias must have shape"):
            call(torch.zeros(3, 1, 32))
        with pytest.raises(DTypeError, match="rhs_bias dtype float16"):
            call(torch.zeros(2, 1, 32, dtype=torch.float16))
        with pytest.raises(DTypeError, match="rhs_bias dtype int32"):
            call(torch.zeros(2, 1, 32, dtype=torch.int32))
        with pytest.raises(DeviceError, match="rhs_bias"):
            call(torch.zeros(2, 1, 32, device="meta"))
        with pytest.raises(ArgumentError, match="rhs_bias must be a torch.Tensor"):
            call(np.zeros((2, 1, 32), np.float32))


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only_with_bias(chip):
    """Mosaic + XLA:TPU compile both forward kernels with ``rhs_bias`` at the heuristic blocks (libtpu
    compile-only): the plain one on its manual rhs prefetch chain (``bk = K``, ``bn`` dividing N), the quantized one
    with int4 experts, zero points and 128-column blocks; the scoped VMEM request covers the bias blocks."""
    plain = tk.compile_for(gm.grouped_matmul_fwd, chip, "4:i32", "1:i32", "512x1024:bf16", "4x2048x1024:bf16",
                           "4x1x2048:f32", transpose_rhs=True, with_mlir=False)
    quant = tk.compile_for(gq.grouped_matmul_quant_fwd, chip, "4:i32", "1:i32", "512x1024:bf16", "4x2048x512:u8",
                           "4x8x1x2048:f32", "4x8x1x2048:f32", "4x1x2048:bf16", transpose_rhs=True, with_mlir=False)
    for res in (plain, quant):
        assert res.ok, res.summary()
        assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 32 * 2**20)


def test_sharding_rules_split_the_bias_with_the_columns():
    """Tensor-parallel rules (tpukernels.distributed): ``rhs_bias [G, 1, N]`` is split over N with the weight's
    columns; the float32 K split (partial sums) is withdrawn with a bias (each partial sum would add it once)."""
    from tpukernels.distributed import PARTIAL, Split, TensorMeta, splits_for

    def meta(*shape, dtype=torch.float32):
        return TensorMeta(shape, dtype)

    base = {"group_sizes": meta(4, dtype=torch.int32), "group_offset": meta(dtype=torch.int32),
            "lhs": meta(256, 128), "rhs": meta(4, 128, 256), "transpose_rhs": False, "out_dtype": None}
    assert splits_for(gm.grouped_matmul_fwd, {**base, "rhs_bias": None}) == [
        Split({"rhs": 2}, (1,)), Split({"lhs": 1, "rhs": 1}, (PARTIAL,))]
    assert splits_for(gm.grouped_matmul_fwd, {**base, "rhs_bias": meta(4, 1, 256)}) == [
        Split({"rhs": 2, "rhs_bias": 2}, (1,))]
    q = {"group_sizes": meta(4, dtype=torch.int32), "group_offset": meta(dtype=torch.int32),
         "lhs": meta(256, 256, dtype=torch.bfloat16), "rhs": meta(4, 512, 128, dtype=torch.uint8),
         "rhs_scale": meta(4, 2, 1, 512), "rhs_zero_point": None, "rhs_bias": meta(4, 1, 512),
         "transpose_rhs": True, "out_dtype": None, "weight_format": "int4"}
    assert splits_for(gq.grouped_matmul_quant_fwd, q) == [Split({"rhs": 1, "rhs_scale": 3, "rhs_bias": 2}, (1,))]
