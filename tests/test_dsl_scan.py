"""tpukernels.dsl.scan: the in-kernel helpers of chunked linear recurrences, each against numpy float64.

Every helper runs inside a small ``@tpu_kernel`` in Pallas interpret mode (both modes of the ``interpret``
fixture: "tpu" poisons uninitialised memory with NaN), on random values, ragged segment layouts (one token,
segments crossing the middle, a lone last token) and a NaN planted in one segment.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import tpukernels.dsl as tk
from tpukernels.dsl import scan


def _helpers_body(x_ref, seg_ref, a_ref, cum_ref, cumx_ref, rcum_ref, rcumx_ref, inv_ref, dec_ref, row_ref, mask_ref,
                  col_ref):
    x, seg, a = x_ref[...], seg_ref[...], a_ref[...]
    cum_ref[...] = scan.segment_cumsum(x, seg)
    cumx_ref[...] = scan.segment_cumsum(x, seg, exclusive=True)
    rcum_ref[...] = scan.segment_cumsum(x, seg, reverse=True)
    rcumx_ref[...] = scan.segment_cumsum(x, seg, reverse=True, exclusive=True)
    inv_ref[...] = scan.unit_lower_inverse(a)
    g = scan.segment_cumsum(x[:, :1], seg)
    dec_ref[...] = scan.pairwise_decay(g, scan.lower_mask(x.shape[0], seg=seg))
    row_ref[...] = scan.col_to_row(x[:, :1])
    col_ref[...] = scan.row_to_col(row_ref[...])
    mask_ref[...] = scan.lower_mask(x.shape[0], strict=True, seg=seg).astype(jnp.float32)


@tk.tpu_kernel(_helpers_body, name="scan_helpers", namespace="tktest_scan")
def helpers(x: torch.Tensor, seg: torch.Tensor, a: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        torch.Tensor]:
    """Every helper of tpukernels.dsl.scan on one block: x [n, m] f32, seg [n, 1] i32, a [n, n] f32."""
    n, m = x.shape
    full = lambda *s: pl.BlockSpec(s, lambda i: (0,) * len(s))  # noqa: E731
    outs = (tk.OutSpec((n, m), jnp.float32),) * 4 + (tk.OutSpec((n, n), jnp.float32),) * 2 + (
        tk.OutSpec((1, n), jnp.float32), tk.OutSpec((n, n), jnp.float32), tk.OutSpec((n, 1), jnp.float32))
    return tk.Launch(grid=(1,), in_specs=[full(n, m), full(n, 1), full(n, n)],
                     out_specs=[full(n, m)] * 4 + [full(n, n)] * 2 + [full(1, n), full(n, n), full(n, 1)],
                     out_shape=outs)


def _carry_body(start_ref, x_ref, o_ref, acc_ref):
    from jax.experimental import pallas as pl

    i, j = pl.program_id(0), pl.program_id(1)
    scan.reset_carry(acc_ref, axis=1, when=start_ref[i, j] > 0)
    acc_ref[...] += x_ref[0, 0]
    o_ref[0, 0] = acc_ref[...]


@tk.tpu_kernel(_carry_body, name="scan_carry", namespace="tktest_scan")
def carry(start: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Running sum over axis 1 of x [R, S, 8, 128], restarting at each row and where start [R, S] (int32,
    scalar-prefetched) > 0."""
    r, s = x.shape[:2]
    blk = pl.BlockSpec((1, 1, 8, 128), lambda i, j, st: (i, j, 0, 0))
    return tk.Launch(grid=(r, s), in_specs=[blk], out_specs=blk, out_shape=tk.like(x), num_scalar_prefetch=1,
                     scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)], dimension_semantics=("parallel", "arbitrary"))


# ----------------------------------------------------------------------------------------- numpy float64
def seg_cumsum64(x, seg, reverse, exclusive):
    n = x.shape[0]
    out = np.zeros_like(x)
    for i in range(n):
        js = range(i, n) if reverse else range(i + 1)
        for j in js:
            if seg[j] == seg[i] and not (exclusive and j == i):
                out[i] += x[j]
    return out


def segments(n, lens):
    ids = np.repeat(np.arange(len(lens)), lens)[:n]
    return ids


LAYOUTS = {8: [[8], [1, 7], [3, 4, 1]], 64: [[64], [10, 40, 14], [1] * 4 + [60], [63, 1]]}


@settings(max_examples=6)
@given(nm=st.sampled_from([(8, 1), (64, 128)]), which=st.integers(0, 3), seed=st.integers(0, 9))
def test_helpers_match_float64(nm, which, seed):
    """Two block shapes (compiled once each), every segment layout, random values."""
    n, m = nm
    lens = LAYOUTS[n][which % len(LAYOUTS[n])]
    seg = segments(n, lens)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, m)).astype(np.float32)
    x[:, 0] = -np.abs(x[:, 0])  # log-decays (<= 0)
    a = (rng.standard_normal((n, n)) * 0.5).astype(np.float32)
    outs = helpers(torch.from_numpy(x), torch.from_numpy(seg[:, None].astype(np.int32)), torch.from_numpy(a))
    cum, cumx, rcum, rcumx, inv, dec, row, mask, col = (o.double().numpy() for o in outs)
    x64 = x.astype(np.float64)
    for got, rev, exc in ((cum, False, False), (cumx, False, True), (rcum, True, False), (rcumx, True, True)):
        want = seg_cumsum64(x64, seg, rev, exc)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(x64).sum(0).max())
    a64 = np.tril(a.astype(np.float64), -1)
    want_inv = np.linalg.inv(np.eye(n) + a64)
    scale = np.abs(want_inv).max()
    np.testing.assert_allclose(inv, want_inv, rtol=0, atol=1e-5 * scale)
    assert np.all(np.triu(inv, 1) == 0) and np.all(np.diag(inv) == 1)
    g = seg_cumsum64(x64[:, :1], seg, False, False)[:, 0]
    same = seg[:, None] == seg[None, :]
    low = np.tril(np.ones((n, n), bool))
    want_dec = np.where(low & same, np.exp(np.where(low & same, g[:, None] - g[None, :], 0)), 0)
    np.testing.assert_allclose(dec, want_dec, rtol=1e-5, atol=1e-6)
    assert np.all(dec[~(low & same)] == 0)
    assert np.array_equal(row[0], x[:, 0].astype(np.float64))
    assert np.array_equal(col[:, 0], x[:, 0].astype(np.float64))
    assert np.array_equal(mask, (np.tril(np.ones((n, n)), -1).astype(bool) & same).astype(np.float64))


def test_inverse_is_stable_where_a_neumann_series_is_not():
    """A = all ones below the diagonal (keys repeated, beta = 1, no decay): the powers of A reach C(63, 31) ~ 1e18
    and cancel in a Neumann series; block substitution stays exact (the inverse is I - (the first subdiagonal))."""
    n = 64
    a = np.tril(np.ones((n, n), np.float32), -1)
    outs = helpers(torch.zeros(n, 1), torch.zeros(n, 1, dtype=torch.int32), torch.from_numpy(a))
    want = np.linalg.inv(np.eye(n) + a)
    np.testing.assert_allclose(outs[4].double().numpy(), want, rtol=0, atol=1e-6)


def test_nan_in_one_segment_stays_there(interpret):
    n, lens = 32, [10, 12, 10]
    seg = segments(n, lens)
    x = np.random.default_rng(0).standard_normal((n, 1)).astype(np.float32)
    x[14, 0] = np.nan  # segment 1
    outs = helpers(torch.from_numpy(x), torch.from_numpy(seg[:, None].astype(np.int32)), torch.zeros(n, n))
    cum, cumx, rcum, rcumx, _, dec, row, _, col = (o.double().numpy() for o in outs)
    other = seg != 1
    for o in (cum, cumx, rcum, rcumx):
        assert np.isfinite(o[other]).all()
        assert np.isnan(o[seg == 1]).any()
    both = other[:, None] & other[None, :]
    assert np.isfinite(dec[both]).all() and np.isnan(dec).any()
    assert np.isnan(row[0, 14]) and np.isfinite(np.delete(row[0], 14)).all()
    assert np.isnan(col[14, 0]) and np.isfinite(np.delete(col[:, 0], 14)).all()


def test_reset_carry_restarts_at_rows_and_flags(interpret):
    r, s = 2, 5
    x = torch.randn(r, s, 8, 128, generator=torch.Generator().manual_seed(0))
    start = torch.zeros(r, s, dtype=torch.int32)
    start[0, 3] = 1
    start[1, 1] = 1
    out = carry(start, x)
    want = torch.zeros_like(x, dtype=torch.float64)
    for i in range(r):
        acc = torch.zeros(8, 128, dtype=torch.float64)
        for j in range(s):
            if j == 0 or start[i, j] > 0:
                acc = torch.zeros_like(acc)
            acc = acc + x[i, j].double()
            want[i, j] = acc
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


def test_reset_carry_needs_a_condition():
    with pytest.raises(ValueError, match="give axis"):
        scan.reset_carry(None)


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only(chip, tmp_cache):
    """The helpers lower with Mosaic (64-token chunk, a column and a 128-lane block; the carried scratch)."""
    from tpukernels.targets.compile_only import compile_for

    for m in (1, 128):
        r = compile_for(helpers, chip, f"64x{m}:f32", "64x1:i32", "64x64:f32", with_mlir=False)
        assert r.ok, r.summary()
    r = compile_for(carry, chip, "2x5:i32", "2x5x8x128:f32", with_mlir=False)
    assert r.ok, r.summary()


def test_matmul_forms_match_float64():
    """matmul's transposed forms, and exact_bf16 (one bf16 pass) on operands holding bf16 values."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 32)).astype(np.float32)
    b = rng.standard_normal((16, 32)).astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_allclose(np.asarray(scan.matmul(a, b, trans_b=True)), a64 @ b64.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(scan.matmul(a, b, trans_a=True)), a64.T @ b64, rtol=1e-5, atol=1e-5)
    ab = np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))  # bf16 values held in float32
    bb = np.asarray(jnp.asarray(b).astype(jnp.bfloat16).astype(jnp.float32))
    got = np.asarray(scan.matmul(ab, bb, trans_b=True, exact_bf16=True))
    np.testing.assert_allclose(got, ab.astype(np.float64) @ bb.astype(np.float64).T, rtol=1e-6, atol=1e-5)
