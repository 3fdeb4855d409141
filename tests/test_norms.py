"""tpukernels.library.norms: RMSNorm, LayerNorm, fused add + RMSNorm (forward, backward, modules).

Ground truth is float64 computed from the same low-precision inputs (``*_reference``); exact-semantics tests
compare with the HF formulas evaluated by torch in the same dtype. Kernels run in Pallas interpret mode
("fast"; "tpu" = NaN-poisoned, on a representative subset); compile-only tests (``aot``) build the real
Mosaic kernels for v5e / v6e / tpu7x.
"""

import inspect
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tpukernels as tk
from tpukernels.autotune import db
from tpukernels.errors import ArgumentError, DeviceError, DTypeError
from tpukernels.library import norms as N

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, F16, F32]

# ---------------------------------------------------------------------------------------------- tolerances
# Check: |out - ref64| <= ATOL * scale + RTOL * |ref64| elementwise (scale = 1 unless stated).
# u = unit roundoff of the output dtype: bf16 2**-8, fp16 2**-11, f32 2**-24.
# Forward RTOL = 2u: outputs are rounded at most twice (casting="llama": n to the dtype, then the product),
#   each within u of its argument. f32: the float32 sums of <= 7168 squares dominate (relative error
#   ~ sqrt(H) * 2**-24 ~ 5e-6 for random data), hence 1e-5.
# Forward ATOL: values near 0 after LayerNorm's bias cancellation carry float32 error
#   ~ 2**-24 * (|xhat * w| + |b|) <~ 1e-6 for O(1) data; fp16 subnormal spacing is 6e-8.
FWD_TOL = {BF16: (1e-5, 2**-7), F16: (1e-5, 2**-10), F32: (1e-6, 1e-5)}
# Backward dx: computed in float32 (cancellation in g - n * mean(g * n): absolute error ~ 2**-24 * |g| * rstd,
#   i.e. ~1e-6 for unit-scale data, ATOL 1e-5) and rounded once to the dtype (u, doubled as RTOL: 2u).
BWD_TOL = {BF16: (1e-5, 2**-7), F16: (1e-5, 2**-10), F32: (1e-5, 1e-5)}
# dweight/dbias: float32 sums over the rows (blocked: within a block, then across blocks) -> absolute error
#   <~ 16 * 2**-24 * sum_rows |term| (ATOL 1e-6, scale = that sum), then one rounding to the weight dtype (2u).
DW_TOL = {BF16: (1e-6, 2**-7), F16: (1e-6, 2**-10), F32: (1e-6, 1e-6)}


def check(got, want, tol, scale=1.0, what=""):
    """Elementwise |got - want| <= atol * scale + rtol * |want| (want: float64)."""
    atol, rtol = tol
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got.double() - want).abs()
    bound = atol * scale + rtol * want.abs()
    bad = ~(err <= bound)  # NaN counts as bad
    assert not bad.any(), (
        f"{what}: {int(bad.sum())}/{bad.numel()} elements out of tolerance; worst excess "
        f"{(err - bound)[bad].max().item():.3g} (atol={atol}, rtol={rtol})"
    )


def ulps(t):
    """Spacing of t's dtype at |t| (float64; normal range)."""
    a = t.double().abs().clamp_min(torch.finfo(t.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - {BF16: 7, F16: 10, F32: 23}[t.dtype])


def rand(*shape, dtype=F32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------- references
def test_references_match_torch_in_float64():
    x, w, b = rand(5, 7, 33, dtype=torch.float64), rand(33, dtype=torch.float64, seed=1), rand(33, dtype=torch.float64, seed=2)
    torch.testing.assert_close(N.rms_norm_reference(x, w, 1e-5), torch.nn.functional.rms_norm(x, (33,), w, 1e-5))
    torch.testing.assert_close(N.layer_norm_reference(x, w, b, 1e-5), torch.nn.functional.layer_norm(x, (33,), w, b, 1e-5))
    y, h = N.fused_add_rms_norm_reference(x, x * 2, w)
    torch.testing.assert_close(h, 3 * x)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(3 * x, (33,), w, 1e-6))


# ---------------------------------------------------------------------------------------------- forward
HIDDEN = [1, 3, 128, 130, 1000]
lead_shapes = st.lists(st.integers(1, 4), min_size=0, max_size=2)


@given(lead=lead_shapes, rows=st.integers(1, 40), h=st.sampled_from(HIDDEN), dtype=st.sampled_from(DTYPES),
       eps=st.sampled_from([1e-6, 1e-2]), variant=st.sampled_from(["llama", "gemma", "gemma+1", "noweight"]),
       scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_rms_norm_matches_float64(lead, rows, h, dtype, eps, variant, scale):
    x = rand(*lead, rows, h, dtype=dtype, scale=scale, seed=rows)
    w = None if variant == "noweight" else rand(h, dtype=dtype, seed=h)
    casting = "gemma" if variant.startswith("gemma") else "llama"
    offset = 1.0 if variant == "gemma+1" else 0.0
    y = N.rms_norm(x, w, eps, offset, casting)
    assert y.dtype == dtype and y.shape == x.shape
    check(y, N.rms_norm_reference(x, w, eps, offset), FWD_TOL[dtype], what=f"rms_norm {variant}")


@given(lead=lead_shapes, rows=st.integers(1, 40), h=st.sampled_from(HIDDEN), dtype=st.sampled_from(DTYPES),
       affine=st.sampled_from(["wb", "w", "none"]), shift=st.sampled_from([0.0, 100.0]))
def test_layer_norm_matches_float64(lead, rows, h, dtype, affine, shift):
    # shift: a large common mean (catastrophic cancellation for E[x^2] - E[x]^2; the kernel is two-pass)
    x = (rand(*lead, rows, h, dtype=F32, seed=rows) + shift).to(dtype)
    w = rand(h, dtype=dtype, seed=1) if affine != "none" else None
    b = rand(h, dtype=dtype, seed=2) if affine == "wb" else None
    y = N.layer_norm(x, w, b)
    assert y.dtype == dtype and y.shape == x.shape
    # float32 x - mean is exact to ~2**-24 |x|, not |x - mean|: the absolute error of y scales with
    # |mean| * rstd * |w| (the problem's condition number), hence that factor on ATOL
    x64 = x.double()
    cond = 1 + x64.mean(-1, keepdim=True).abs() / x64.std(-1, correction=0, keepdim=True).clamp_min(1e-3)
    scale = cond * (1 if w is None else w.double().abs())
    check(y, N.layer_norm_reference(x, w, b, N.DEFAULT_LAYER_NORM_EPS), FWD_TOL[dtype], scale=scale, what="layer_norm")


@given(rows=st.integers(1, 40), h=st.sampled_from(HIDDEN), dtype=st.sampled_from(DTYPES),
       casting=st.sampled_from(N.CASTINGS))
def test_fused_add_rms_norm_is_add_then_rms_norm(rows, h, dtype, casting):
    x, r, w = rand(2, rows, h, dtype=dtype, seed=1), rand(2, rows, h, dtype=dtype, seed=2), rand(h, dtype=dtype, seed=3)
    x0, r0 = x.clone(), r.clone()
    y, new_res = N.fused_add_rms_norm(x, r, w, casting=casting)
    # new_residual: the sum rounded once to the dtype, exactly what torch's x + r gives
    assert torch.equal(new_res, x + r)
    # y is rms_norm of that rounded residual (same kernel arithmetic -> same bits) ...
    assert torch.equal(y, N.rms_norm(new_res, w, casting=casting))
    # ... and within tolerance of float64
    check(y, N.rms_norm_reference(new_res, w), FWD_TOL[dtype], what="fused y")
    assert torch.equal(x, x0) and torch.equal(r, r0)  # functional: inputs untouched


# each H with a different row regime: 1 row, an odd count, several blocks (bf16 heuristic: 1024 rows at
# H=1000 -> 1100 rows pad to 1280 = 2 blocks; 128 rows at H=7168 -> 257 rows pad to 320 = 3 blocks)
@pytest.mark.parametrize("rows, h", [(1, 5120), (3, 1), (1100, 1000), (257, 7168)])
def test_any_hidden_size_and_row_count(rows, h):
    x, w = rand(rows, h, dtype=BF16, seed=rows), rand(h, dtype=BF16, seed=h)
    check(N.rms_norm(x, w), N.rms_norm_reference(x, w), FWD_TOL[BF16], what=f"rms {rows}x{h}")
    check(N.layer_norm(x, w, w), N.layer_norm_reference(x, w, w), FWD_TOL[BF16], what=f"ln {rows}x{h}")


def test_zero_rows():
    x, w = torch.zeros(0, 3, 64), torch.ones(64)
    assert N.rms_norm(x, w).shape == (0, 3, 64)
    assert N.layer_norm(x, w, w).shape == (0, 3, 64)
    y, h = N.fused_add_rms_norm(x, x, w)
    assert y.shape == h.shape == (0, 3, 64)
    xr = x.clone().requires_grad_()
    N.rms_norm(xr, w).sum().backward()
    assert xr.grad.shape == x.shape


def test_float16_sum_of_squares_does_not_overflow():
    # |x| = 1000: x^2 = 1e6 > 65504 (float16 max); statistics are float32
    x = torch.full((4, 256), 1000.0, dtype=F16)
    x[:, ::2] = -1000.0
    y = N.rms_norm(x, torch.ones(256, dtype=F16))
    assert torch.isfinite(y).all()
    check(y, N.rms_norm_reference(x, torch.ones(256, dtype=F16)), FWD_TOL[F16])
    check(N.layer_norm(x * 60), N.layer_norm_reference(x * 60), FWD_TOL[F16])  # 60000^2 = 3.6e9


@pytest.mark.parametrize("make", [
    lambda b: b.transpose(0, 1),                 # transposed
    lambda b: b[:, 3:3 + 96],                    # sliced columns (row stride > H)
    lambda b: b[::2],                            # every other row
    lambda b: b.reshape(4, 10, 128)[:, ::3, :96],  # 3-d, strided leading dim
])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_strided_inputs_equal_contiguous(make, dtype):
    x = make(rand(40, 128, dtype=dtype, seed=7))
    h = x.shape[-1]
    w = rand(2 * h, dtype=dtype, seed=8)[::2]  # strided weight too
    assert not x.is_contiguous()
    assert torch.equal(N.rms_norm(x, w), N.rms_norm(x.contiguous(), w.contiguous()))
    assert torch.equal(N.layer_norm(x, w, w), N.layer_norm(x.contiguous(), w.contiguous(), w.contiguous()))
    ys = N.fused_add_rms_norm(x, x, w)
    yc = N.fused_add_rms_norm(x.contiguous(), x.contiguous(), w.contiguous())
    assert torch.equal(ys[0], yc[0]) and torch.equal(ys[1], yc[1])


# ---------------------------------------------------------------------------------------------- casting semantics
def hf_llama(x, w, eps):  # transformers LlamaRMSNorm.forward
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def hf_gemma(x, w, eps):  # transformers GemmaRMSNorm.forward
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_casting_modes_match_hf_formulas(dtype):
    x, w = rand(64, 1000, dtype=dtype, seed=1), rand(1000, dtype=dtype, seed=2)
    llama = N.rms_norm(x, w)  # default casting = "llama"
    gemma = N.rms_norm(x, w, offset=1.0, casting="gemma")
    # Same roundings as HF; the float32 statistics may differ in the last bit (summation order), which can
    # move a rounding by one ulp: allow <= 1 ulp on at most 0.5% of the elements.
    for got, want in ((llama, hf_llama(x, w, 1e-6)), (gemma, hf_gemma(x, w, 1e-6))):
        diff = (got.double() - want.double()).abs()
        assert (diff <= ulps(want)).all()
        assert (diff > 0).double().mean() < 0.005
    # the two modes are different roundings: they must disagree somewhere for 16-bit data
    assert not torch.equal(N.rms_norm(x, w, casting="gemma"), llama)


def test_bf16_product_path_equals_float32_path():
    # casting="llama", bf16 x and weight: blocks of 16k rows multiply in bf16, other blocks in float32 after
    # rounding n; both must give the same bits (the bf16 x bf16 product is exact in float32)
    x, w = rand(40, 384, dtype=BF16, seed=5), rand(1, 384, dtype=BF16, seed=6)
    whole, _ = N.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", False, config={"block_rows": 64})  # one 40-row block
    split, _ = N.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", False, config={"block_rows": 16})  # 16-row blocks
    assert torch.equal(whole, split)


def test_offset_is_added_in_float32():
    # bf16(1 + 0.003) == 1.0: an offset added in bf16 would drop the weight entirely
    x = (1 + torch.rand(32, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)).to(BF16)
    w = torch.full((256,), 0.003, dtype=BF16)
    assert (1.0 + w).eq(1.0).all()
    got = N.rms_norm(x, w, offset=1.0, casting="gemma")
    want = N.rms_norm_reference(x, w, offset=1.0)
    bad = N.rms_norm_reference(x, (1.0 + w) - 1.0, offset=1.0)  # offset added in bf16
    # gemma rounds once from float32: within 0.5 ulp (+ float32 noise) of float64 ...
    assert ((got.double() - want).abs() <= 0.51 * ulps(got)).all()
    # ... which the bf16-offset result is not
    assert not ((bad.to(BF16).double() - want).abs() <= 0.51 * ulps(got)).all()


def test_default_eps_does_not_come_from_the_dtype():
    assert inspect.signature(N.rms_norm).parameters["eps"].default == 1e-6
    assert inspect.signature(N.layer_norm).parameters["eps"].default == 1e-5
    for op, want in ((torch.ops.tpukernels.rms_norm, 1e-6), (torch.ops.tpukernels.layer_norm, 1e-5),
                     (torch.ops.tpukernels.fused_add_rms_norm, 1e-6)):
        eps_arg = next(a for a in op.default._schema.arguments if a.name == "eps")
        assert eps_arg.default_value == pytest.approx(want, rel=1e-12)
    x = rand(8, 256, dtype=BF16, scale=1e-2)  # mean square 1e-4: finfo(bf16).eps = 0.0078 would dominate
    y = N.rms_norm(x)
    check(y, N.rms_norm_reference(x, eps=1e-6), FWD_TOL[BF16])
    assert not torch.allclose(y.double(), N.rms_norm_reference(x, eps=torch.finfo(BF16).eps), rtol=0.1)


def test_round_to_f16_matches_torch_half():
    g = torch.Generator().manual_seed(0)
    mags = torch.exp2(torch.empty(20000, dtype=torch.float64).uniform_(-30, 17, generator=g))
    v = (mags * torch.sign(torch.randn(20000, generator=g, dtype=torch.float64))).float()
    halves = torch.arange(-65504, 65504, 997, dtype=F32).half().float()
    ties = (halves + ulps(halves.half()).float() / 2)  # exact midpoints between float16 neighbours
    sub_ties = (torch.arange(0, 2000, dtype=F32) + 0.5) * 2.0**-24  # subnormal midpoints
    special = torch.tensor([0.0, -0.0, 65504, 65519.99, 65520, 1e6, -1e6, float("inf"), -float("inf"),
                            2.0**-14, 2.0**-14 * (1 - 2**-12), 2.0**-25, 2.0**-25 * 1.0001, 1e-30])
    v = torch.cat([v, ties, -ties, sub_ties, -sub_ties, special])
    got = torch.from_numpy(np.array(N.round_to_f16(jnp.asarray(v.numpy()))))
    want = v.half().float()
    assert torch.equal(got, want) or bool(((got == want) | (got.isnan() & want.isnan())).all())
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    nan = np.asarray(N.round_to_f16(jnp.asarray([float("nan")], jnp.float32)))
    assert np.isnan(nan).all()


# ---------------------------------------------------------------------------------------------- backward
def grads64(fn_ref, tensors, dys):
    leaves = [None if t is None else t.double().detach().requires_grad_() for t in tensors]
    outs = fn_ref(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward([o for o in outs], [d.double() for d in dys])
    return [None if t is None else t.grad for t in leaves]


def grads_ours(fn, tensors, dys):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(list(outs), list(dys))
    return [None if t is None else t.grad for t in leaves]


@given(rows=st.integers(1, 40), h=st.sampled_from([1, 130, 1000]), dtype=st.sampled_from(DTYPES),
       variant=st.sampled_from(["llama", "gemma+1", "noweight"]))
def test_rms_norm_backward_matches_float64_autograd(rows, h, dtype, variant):
    x, w, dy = rand(2, rows, h, dtype=dtype, seed=1), rand(h, dtype=dtype, seed=2), rand(2, rows, h, dtype=dtype, seed=3)
    if variant == "noweight":
        w = None
    casting, offset = ("gemma", 1.0) if variant == "gemma+1" else ("llama", 0.0)
    gx, gw = grads_ours(lambda a, b: N.rms_norm(a, b, offset=offset, casting=casting), [x, w], [dy])
    rx, rw = grads64(lambda a, b: N.rms_norm_reference(a, b, offset=offset), [x, w], [dy])
    assert gx.dtype == dtype
    check(gx, rx, BWD_TOL[dtype], what="dx")
    if w is not None:
        n = N.rms_norm_reference(x)
        check(gw, rw, DW_TOL[dtype], scale=(dy.double() * n).abs().flatten(0, -2).sum(0), what="dweight")
        assert gw.dtype == w.dtype


@given(rows=st.integers(1, 40), h=st.sampled_from([1, 130, 1000]), dtype=st.sampled_from(DTYPES),
       affine=st.sampled_from(["wb", "w", "b", "none"]))
def test_layer_norm_backward_matches_float64_autograd(rows, h, dtype, affine):
    x, dy = rand(rows, h, dtype=dtype, seed=1) + 3, rand(rows, h, dtype=dtype, seed=3)
    x = x.to(dtype)
    w = rand(h, dtype=dtype, seed=2) if "w" in affine else None
    b = rand(h, dtype=dtype, seed=4) if "b" in affine else None
    gx, gw, gb = grads_ours(N.layer_norm, [x, w, b], [dy])
    rx, rw, rb = grads64(lambda a, c, d: N.layer_norm_reference(a, c, d), [x, w, b], [dy])
    check(gx, rx, BWD_TOL[dtype], what="dx")
    xhat = N.layer_norm_reference(x)
    if w is not None:
        check(gw, rw, DW_TOL[dtype], scale=(dy.double() * xhat).abs().sum(0), what="dweight")
    if b is not None:
        check(gb, rb, DW_TOL[dtype], scale=dy.double().abs().sum(0), what="dbias")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_residual_out", [True, False])
def test_fused_add_rms_norm_backward(dtype, use_residual_out):
    x, r, w = rand(37, 130, dtype=dtype, seed=1), rand(37, 130, dtype=dtype, seed=2), rand(130, dtype=dtype, seed=3)
    dy, dh = rand(37, 130, dtype=dtype, seed=4), rand(37, 130, dtype=dtype, seed=5)
    dys = [dy, dh] if use_residual_out else [dy, torch.zeros_like(dh)]
    gx, gr, gw = grads_ours(lambda a, b, c: N.fused_add_rms_norm(a, b, c), [x, r, w], dys)
    # reference: the rounded residual feeds the norm; its gradient flows to both inputs unchanged
    h = (x + r)
    rh, rw = grads64(lambda a, c: N.rms_norm_reference(a, c), [h, w], [dy])
    want = rh + dys[1].double()
    check(gx, want, BWD_TOL[dtype], what="dx")
    check(gr, want, BWD_TOL[dtype], what="dresidual")
    check(gw, rw, DW_TOL[dtype], scale=(dy.double() * N.rms_norm_reference(h)).abs().sum(0), what="dweight")


def test_mixed_dtypes_weight_float32_x_bfloat16():
    x, w, dy = rand(20, 256, dtype=BF16), rand(256, dtype=F32, seed=1), rand(20, 256, dtype=BF16, seed=2)
    gx, gw = grads_ours(N.rms_norm, [x, w], [dy])
    rx, rw = grads64(N.rms_norm_reference, [x, w], [dy])
    assert N.rms_norm(x, w).dtype == BF16 and gw.dtype == F32
    check(N.rms_norm(x, w), N.rms_norm_reference(x, w), FWD_TOL[BF16])
    check(gx, rx, BWD_TOL[BF16])
    check(gw, rw, DW_TOL[F32], scale=(dy.double() * N.rms_norm_reference(x)).abs().sum(0))


# ---------------------------------------------------------------------------------------------- tails, NaN poison
def test_tpu_interpret_mode_poisons_overhanging_rows():
    """Sanity check that makes the masking tests below meaningful: an unmasked row sum over an overhanging
    block reads NaN in "tpu" interpret mode."""
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.sum(x_ref[...], axis=0, keepdims=True)

    @tk.tpu_kernel(body, name="unmasked_colsum", namespace="tktest_norms")
    def colsum(x: torch.Tensor) -> torch.Tensor:
        return tk.Launch(grid=(tk.cdiv(x.shape[0], 16),), in_specs=[pl.BlockSpec((16, 128), lambda i: (i, 0))],
                         out_specs=pl.BlockSpec((1, 128), lambda i: (0, 0)), out_shape=tk.OutSpec((1, 128), jnp.float32))

    with tk.interpret_mode("tpu"), pytest.raises(tk.errors.UnwrittenOutputError, match="unmasked_colsum: output 0"):
        colsum(torch.ones(40, 128))  # the poison reached every output element (a typed error since issue 31)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_backward_kernels_mask_the_overhanging_block_tpu_mode(dtype):
    # 37 rows -> bucket 40 -> blocks of 16: the last block covers rows 32..47, 40..47 are past the array (NaN)
    rows, h = 37, 200
    x, dy, w = rand(rows, h, dtype=dtype, seed=1), rand(rows, h, dtype=dtype, seed=2), rand(1, h, dtype=dtype, seed=3)
    cfg = {"block_rows": 16}
    with tk.interpret_mode("tpu"):
        y, rstd = N.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", False, config=cfg)
        dx, dw = N.rms_norm_bwd(dy, x, rstd, w, dy, 0.0, config=cfg)
        y2, mean, rstd2 = N.layer_norm_fwd(x, w, w, 1e-5, config=cfg)
        dx2, dw2, db2 = N.layer_norm_bwd(dy, x, mean, rstd2, w, config=cfg)
    for t in (y, rstd, dx, dw, y2, mean, rstd2, dx2, dw2, db2):
        assert torch.isfinite(t).all()
    x64, dy64, w64 = x.double(), dy.double(), w.double()
    n = N.rms_norm_reference(x64)
    check(y, N.rms_norm_reference(x, w[0]), FWD_TOL[dtype])
    check(rstd, torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6), (0, 1e-6))
    rx, rw = grads64(N.rms_norm_reference, [x, w[0]], [dy])
    check(dx, rx + dy64, BWD_TOL[dtype])
    check(dw, rw[None], DW_TOL[F32], scale=(dy64 * n).abs().sum(0))
    rx2, rw2, rb2 = grads64(N.layer_norm_reference, [x, w[0], w[0]], [dy])
    check(dx2, rx2, BWD_TOL[dtype])
    check(dw2, rw2[None], DW_TOL[F32], scale=(dy64 * N.layer_norm_reference(x64)).abs().sum(0))
    check(db2, rb2[None], DW_TOL[F32], scale=dy64.abs().sum(0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_end_to_end_autograd_in_tpu_interpret_mode(dtype, interpret):
    x, r, w = rand(3, 7, 130, dtype=dtype, seed=1), rand(3, 7, 130, dtype=dtype, seed=2), rand(130, dtype=dtype, seed=3)
    dy = rand(3, 7, 130, dtype=dtype, seed=4)
    gx, gw = grads_ours(lambda a, b: N.rms_norm(a, b, offset=1.0, casting="gemma"), [x, w], [dy])
    rx, rw = grads64(lambda a, b: N.rms_norm_reference(a, b, offset=1.0), [x, w], [dy])
    check(gx, rx, BWD_TOL[dtype])
    check(gw, rw, DW_TOL[dtype], scale=(dy.double() * N.rms_norm_reference(x)).abs().flatten(0, 1).sum(0))
    gx, gw, gb = grads_ours(N.layer_norm, [x, w, w], [dy])
    rx, rw, rb = grads64(N.layer_norm_reference, [x, w, w], [dy])
    check(gx, rx, BWD_TOL[dtype])
    check(gb, rb, DW_TOL[dtype], scale=dy.double().abs().flatten(0, 1).sum(0))
    y, h = N.fused_add_rms_norm(x, r, w)
    assert torch.equal(h, x + r)
    check(y, N.rms_norm_reference(h, w), FWD_TOL[dtype])


# ---------------------------------------------------------------------------------------------- torch integration
OPCHECK_CASES = {
    "rms_norm": lambda: (torch.ops.tpukernels.rms_norm, (rand(3, 5, 130, seed=1).requires_grad_(),
                                                         rand(130, seed=2).requires_grad_(), 1e-6, 1.0, "gemma")),
    "rms_norm_bf16_noweight": lambda: (torch.ops.tpukernels.rms_norm, (rand(9, 64, dtype=BF16).requires_grad_(),
                                                                       None, 1e-5, 0.0, "llama")),
    "fused_add_rms_norm": lambda: (torch.ops.tpukernels.fused_add_rms_norm, (
        rand(9, 130, seed=1).requires_grad_(), rand(9, 130, seed=2).requires_grad_(), rand(130, seed=3).requires_grad_(),
        1e-6, 0.0, "llama")),
    "layer_norm": lambda: (torch.ops.tpukernels.layer_norm, (rand(2, 9, 130).requires_grad_(),
                                                             rand(130, seed=1).requires_grad_(), rand(130, seed=2).requires_grad_(), 1e-5)),
    "rms_norm_fwd": lambda: (torch.ops.tpukernels.rms_norm_fwd, (rand(9, 130).requires_grad_(),
                                                                 rand(1, 130, seed=1).requires_grad_(), 1e-6, 0.0, "llama", False)),
    "layer_norm_fwd": lambda: (torch.ops.tpukernels.layer_norm_fwd, (rand(9, 130).requires_grad_(), None,
                                                                     rand(1, 130, seed=1).requires_grad_(), 1e-5)),
    "rms_norm_bwd": lambda: (torch.ops.tpukernels.rms_norm_bwd, (rand(9, 130), rand(9, 130, seed=1), rand(9, 1, seed=2).abs(),
                                                                 rand(1, 130, seed=3), rand(9, 130, seed=4), 0.0)),
    "layer_norm_bwd": lambda: (torch.ops.tpukernels.layer_norm_bwd, (rand(9, 130), rand(9, 130, seed=1), rand(9, 1, seed=2),
                                                                     rand(9, 1, seed=3).abs(), rand(1, 130, seed=4))),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck(case):
    op, args = OPCHECK_CASES[case]()
    torch.library.opcheck(op, args)


def test_row_bucketing_reuses_compiled_kernels():
    w = rand(256, dtype=BF16)
    fwd_before, bwd_before = len(N.rms_norm_fwd._entries), len(N.rms_norm_bwd._entries)
    for n in range(1025, 1033):  # one bucket (1025..1280)
        x = rand(n, 256, dtype=BF16, seed=n).requires_grad_()
        N.rms_norm(x, w).sum().backward()
    assert len(N.rms_norm_fwd._entries) - fwd_before <= 1
    assert len(N.rms_norm_bwd._entries) - bwd_before <= 1


def test_torch_compile_dynamic_one_graph_with_backward():
    import torch._dynamo.testing as dt

    cnt = dt.CompileCounterWithBackend("aot_eager")
    mod = N.TPURMSNorm(128)
    def loss(x, r):
        return mod(x, r)[0].sum() + mod(x).sum() + N.layer_norm(x).sum()

    f = torch.compile(loss, backend=cnt, fullgraph=True, dynamic=True)
    frames = []
    for n in (17, 33, 70):
        x, r = rand(n, 128, seed=n).requires_grad_(), rand(n, 128, seed=n + 1)
        f(x, r).backward()
        frames.append(cnt.frame_count)
        gx = x.grad.clone()
        x.grad = None
        loss(x, r).backward()
        torch.testing.assert_close(gx, x.grad)
    # one graph for every row count (dynamo may restart analysis once inside the first compile)
    assert frames[0] >= 1 and frames[-1] == frames[0]


# ---------------------------------------------------------------------------------------------- modules
def test_rms_norm_module_is_a_drop_in():
    x = rand(2, 9, 192, dtype=BF16)
    m = N.TPURMSNorm(192, eps=1e-5, dtype=BF16)
    assert torch.equal(m.weight, torch.ones(192, dtype=BF16))
    m.load_state_dict({"weight": rand(192, dtype=BF16, seed=3)})
    assert m.variance_epsilon == 1e-5
    got = m(x)
    diff = (got.double() - hf_llama(x, m.weight, 1e-5).double()).abs()
    assert (diff <= ulps(got)).all()
    y, h = m(x, x)
    assert torch.equal(h, x + x) and torch.equal(y, m(h))
    g = N.TPURMSNorm(192, offset=1.0, casting="gemma")
    assert torch.equal(g.weight, torch.zeros(192))  # Gemma init: scale (1 + 0) = 1
    check(g(x.float()), N.rms_norm_reference(x.float(), torch.ones(192)), FWD_TOL[F32])
    g(x.float()).sum().backward()
    assert g.weight.grad is not None and g.weight.grad.shape == (192,)
    assert "casting='gemma'" in repr(g)


def test_layer_norm_module_is_a_drop_in_for_nn_layernorm():
    ref = torch.nn.LayerNorm(96)
    with torch.no_grad():
        ref.weight.copy_(rand(96, seed=1))
        ref.bias.copy_(rand(96, seed=2))
    m = N.TPULayerNorm(96)
    m.load_state_dict(ref.state_dict())
    x = rand(4, 5, 96, seed=3)
    torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-5)
    m(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(m.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)
    assert N.TPULayerNorm(96, elementwise_affine=False).weight is None
    assert N.TPULayerNorm(96, bias=False).bias is None


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call, err, words", [
    (lambda: N.rms_norm(torch.randn(4, 8, dtype=torch.float64)), DTypeError, ["x", "float64"]),
    (lambda: N.rms_norm(torch.ones(4, 8, dtype=torch.int32)), DTypeError, ["x", "int32"]),
    (lambda: N.rms_norm(torch.tensor(1.0)), ArgumentError, ["x", "[..., H]"]),
    (lambda: N.rms_norm(torch.randn(4, 0)), ArgumentError, ["H", ">= 1"]),
    (lambda: N.rms_norm(torch.randn(4, 8), torch.ones(7)), ArgumentError, ["weight", "[8]"]),
    (lambda: N.rms_norm(torch.randn(4, 8), torch.ones(8, dtype=torch.float64)), DTypeError, ["weight", "float64"]),
    (lambda: N.rms_norm(torch.randn(4, 8), eps=-1e-6), ArgumentError, ["eps", ">= 0"]),
    (lambda: N.rms_norm(torch.randn(4, 8), eps=float("nan")), ArgumentError, ["eps", "finite"]),
    (lambda: N.rms_norm(torch.randn(4, 8), torch.ones(8), casting="mistral"), ArgumentError, ["casting", "llama"]),
    (lambda: N.rms_norm(torch.randn(4, 8), None, offset=1.0), ArgumentError, ["offset", "weight"]),
    (lambda: N.rms_norm(torch.randn(4, 8), torch.ones(8, device="meta")), DeviceError, ["weight", "meta"]),
    (lambda: N.fused_add_rms_norm(torch.randn(4, 8), torch.randn(4, 9)), ArgumentError, ["residual", "shape"]),
    (lambda: N.fused_add_rms_norm(torch.randn(4, 8), torch.randn(4, 8, dtype=BF16)), DTypeError, ["residual", "dtype"]),
    (lambda: N.layer_norm(torch.randn(4, 8), None, torch.ones(3)), ArgumentError, ["bias", "[8]"]),
    (lambda: N.rms_norm_fwd(torch.randn(4, 8, dtype=F16), None, 1e-6, 0.0, "llama", True), DTypeError, ["x", "float16"]),
    (lambda: N.rms_norm_fwd(torch.randn(4, 8), torch.ones(8), 1e-6, 0.0, "llama", False), ArgumentError, ["weight", "[1, 8]"]),
    (lambda: N.TPURMSNorm(0), ArgumentError, ["hidden_size"]),
    (lambda: N.TPURMSNorm(8, offset=1.0, elementwise_affine=False), ArgumentError, ["offset"]),
    (lambda: N.TPULayerNorm((4, 8)), ArgumentError, ["normalized_shape", "last dim"]),
])
def test_bad_input_raises_typed_errors(call, err, words):
    with pytest.raises(err) as e:
        call()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# ---------------------------------------------------------------------------------------------- block sizing
def test_block_rows_fit_vmem_budget_and_row_count():
    per_row = N.row_bytes(8192, [jnp.bfloat16, jnp.bfloat16], 1)
    bm = N.fit_block_rows(1024, 8192, per_row)
    assert bm * per_row <= N.VMEM_BUDGET_BYTES < 2 * bm * per_row
    assert N.fit_block_rows(1024, 24, per_row) == 24  # small arrays: one full block
    assert N.fit_block_rows(64, 0, per_row) == 64  # empty: any legal block (the grid is empty)
    assert N.heuristic_rows(per_row, 0)["block_rows"] == bm
    assert N.heuristic_rows(N.row_bytes(1, [jnp.float32] * 2, 1), 0)["block_rows"] == 1024


# ---------------------------------------------------------------------------------------------- compile-only
CHIPS = ["v5e", "v6e", "tpu7x"]
SHAPES = [(8192, 4096), (8192, 8192)]


def aot_cases(n, h):
    X, V, S = f"{n}x{h}:bf16", f"1x{h}:bf16", f"{n}x1:f32"
    rms = dict(eps=1e-6, offset=0.0, casting="llama", round_f16=False)
    return [
        (N.rms_norm_fwd, (X, V), rms),
        (N.fused_add_rms_norm_fwd, (X, X, V), rms),
        (N.rms_norm_bwd, (X, X, S, V, None), dict(offset=0.0)),
        (N.layer_norm_fwd, (X, V, V), dict(eps=1e-5)),
        (N.layer_norm_bwd, (X, X, S, S, V), {}),
    ]


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_compile_only_forward_and_backward(chip, shape, tmp_cache):
    from tpukernels.lowering import specs_from_values
    from tpukernels.targets import bucket_specs
    from tpukernels.targets.compile_only import _as_spec, compile_for

    for kernel, args, statics in aot_cases(*shape):
        # no config: dispatch picks the shipped default of this chip (package data)
        r = compile_for(kernel, chip, *args, with_mlir=False, **statics)
        assert r.ok, r.summary()
        assert r.config_source == f"shipped-db:{chip}", (kernel.qualname, r.config_source)
        assert r.vmem_estimate_bytes <= N.VMEM_BUDGET_BYTES, r.summary()
        # the VMEM-aware heuristic (what other shapes / statics get) compiles too
        specs, st_ = specs_from_values(kernel, kernel.bind([_as_spec(a) for a in args], statics))
        heuristic = kernel.heuristic(*bucket_specs(kernel, specs), **dict(st_))
        if heuristic != r.config:
            rh = compile_for(kernel, chip, *args, config=heuristic, with_mlir=False, **statics)
            assert rh.ok and rh.vmem_estimate_bytes <= N.VMEM_BUDGET_BYTES, rh.summary()


def test_shipped_defaults_are_package_data():
    import fnmatch
    import pathlib
    import tomllib

    root = pathlib.Path(N.__file__).resolve().parents[3]  # tpukernels/library/norms/__init__.py
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tpukernels"]
    for chip in CHIPS:
        for kernel in (N.rms_norm_fwd, N.rms_norm_bwd, N.fused_add_rms_norm_fwd, N.layer_norm_fwd, N.layer_norm_bwd):
            path = pathlib.Path(db.shipped_db_path(kernel.qualname, chip))
            assert path.is_file(), path
            rel = path.relative_to(root / "tpukernels")
            assert any(fnmatch.fnmatch(rel.as_posix(), g) for g in globs), (rel, globs)  # setuptools glob
            entries = db.load(str(path))
            assert len(entries) == 2 and all(e["key"]["source_hash"] == db.source_hash(kernel) for e in entries)
            assert all("libtpu static estimate" in e["evidence"]["evaluator"] for e in entries)


@pytest.mark.aot
def test_compile_only_odd_hidden_sizes_and_small_rows():
    from tpukernels.targets.compile_only import compile_for

    for n, h in [(1, 1000), (37, 5120), (300, 7168), (16, 1)]:
        for kernel, args, statics in aot_cases(n, h):
            r = compile_for(kernel, "v6e", *args, with_mlir=False, **statics)
            assert r.ok, r.summary()
    # float16 inputs run as float32 kernels with the float16 roundings emulated (round_f16=True)
    f16 = dict(eps=1e-6, offset=0.0, casting="llama", round_f16=True)
    for chip in CHIPS:
        for kernel, args in ((N.rms_norm_fwd, ("1024x1000:f32", "1x1000:f32")),
                             (N.fused_add_rms_norm_fwd, ("1024x1000:f32", "1024x1000:f32", "1x1000:f32"))):
            r = compile_for(kernel, chip, *args, with_mlir=False, **f16)
            assert r.ok, r.summary()
