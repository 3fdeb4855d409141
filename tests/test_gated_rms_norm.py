"""tpukernels.library.norms.gated_rms_norm: the gated RMSNorm of hybrid layers (Qwen3-Next gated DeltaNet,
Mamba2 / Nemotron-H), forward and backward.

Ground truth: float64 computed from the same low-precision inputs (``gated_rms_norm_reference``), gradients by
float64 autograd of it. Exact semantics: transformers' own ``Qwen3NextRMSNormGated`` and ``MambaRMSNormGated``
modules with random weights. Kernels run in Pallas interpret mode ("fast"; "tpu" = NaN-poisoned, for the
overhanging row blocks); compile-only tests (``aot``) build the Mosaic kernels for v5e / v6e / tpu7x.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tpukernels as tk
from tpukernels.errors import ArgumentError, DeviceError, DTypeError
from tpukernels.library import norms as N

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, F16, F32]
U = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24}  # unit roundoff of the output dtype

# ---------------------------------------------------------------------------------------------- tolerances
# Check: |out - ref64| <= ATOL * scale + RTOL * |ref64| elementwise.
# Forward: y is a product of rounded factors (no cancellation): each rounding adds <= u relative error, and
#   norm_before_gate=True rounds three times (n, n * w, y), False twice (n, y), casting="gemma" once (y):
#   RTOL = k * u, plus the float32
#   statistics and sigmoid (~1e-6 relative, which is what bounds float32). ATOL 1e-6 for values near 0.
# Backward dx (and dz when the gate is before the norm): float32 with cancellation in dn - n * mean(dn * n),
#   absolute error ~ few * 2**-24 * rstd * |dn| summed over the group: ATOL 1e-5 * rstd (rstd of the element's
#   group, float64, so small-norm groups -- large rstd -- get a proportionally larger bound), then one
#   rounding to the dtype (RTOL 2u; float32: 1e-5).
# dweight: float32 row sums: ATOL 1e-6 * sum_rows |term|, then one rounding to the weight dtype (RTOL 2u).


def fwd_tol(dtype, norm_before_gate, casting="llama"):
    k = 1 if casting == "gemma" else 3 if norm_before_gate else 2  # casting="gemma": one rounding
    return 1e-6, k * U[dtype] + 2e-6


def bwd_tol(dtype):
    return 1e-5, max(2 * U[dtype], 1e-5)


def check(got, want, tol, scale=1.0, what=""):
    atol, rtol = tol
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got.double() - want).abs()
    bound = atol * scale + rtol * want.abs()
    bad = ~(err <= bound)  # NaN counts as bad
    assert not bad.any(), (
        f"{what}: {int(bad.sum())}/{bad.numel()} elements out of tolerance; worst excess "
        f"{(err - bound)[bad].max().item():.3g} (atol={atol}, rtol={rtol})"
    )


def rand(*shape, dtype=F32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def rstd64(x, z, norm_before_gate, gs, activation="silu"):
    """float64 rstd of each element's group (the backward's error scale)."""
    xd, zd = x.double(), z.double()
    v = xd if norm_before_gate else xd * torch.sigmoid(zd) * (1 if activation == "sigmoid" else zd)
    vg = v.unflatten(-1, (v.shape[-1] // gs, gs))
    return torch.rsqrt(vg.pow(2).mean(-1, keepdim=True) + 1e-6).expand_as(vg).flatten(-2)


def grads64(fn_ref, tensors, dy):
    leaves = [None if t is None else t.double().detach().requires_grad_() for t in tensors]
    fn_ref(*leaves).backward(dy.double())
    return [None if t is None else t.grad for t in leaves]


def grads_ours(fn, tensors, dy):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    fn(*leaves).backward(dy)
    return [None if t is None else t.grad for t in leaves]


# ---------------------------------------------------------------------------------------------- reference
def test_reference_matches_the_formulas_in_float64():
    x, z = rand(3, 5, 12, dtype=torch.float64), rand(3, 5, 12, dtype=torch.float64, seed=1)
    w = rand(12, seed=2).double()
    s = torch.nn.functional.silu(z)
    before = torch.nn.functional.rms_norm(x, (12,), w, 1e-6) * s
    torch.testing.assert_close(N.gated_rms_norm_reference(x, z, w), before)
    g = (x * s).unflatten(-1, (3, 4))
    after = (torch.nn.functional.rms_norm(g, (4,), None, 1e-6).flatten(-2)) * w
    torch.testing.assert_close(N.gated_rms_norm_reference(x, z, w, norm_before_gate=False, group_size=4), after)
    assert not torch.allclose(after, N.gated_rms_norm_reference(x, z, w, norm_before_gate=False))  # groups matter


# ---------------------------------------------------------------------------------------------- forward / backward
# (H, group sizes): one group; lane-aligned groups (128 | group_size); unaligned groups (masked reductions)
GROUPS = [(1, [None]), (12, [None, 4, 3]), (130, [None, 65, 10]), (256, [None, 128, 64])]
lead_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2)


@st.composite
def hidden_and_group(draw):
    h, gss = draw(st.sampled_from(GROUPS))
    return h, draw(st.sampled_from(gss))


@given(lead=lead_shapes, rows=st.integers(1, 40), hg=hidden_and_group(), dtype=st.sampled_from(DTYPES),
       norm_before_gate=st.booleans(), weight=st.sampled_from(["same", "f32", "none"]),
       scale=st.sampled_from([1e-2, 1.0, 30.0]), activation=st.sampled_from(["silu", "sigmoid"]),
       casting=st.sampled_from(["llama", "gemma"]))
def test_forward_matches_float64(lead, rows, hg, dtype, norm_before_gate, weight, scale, activation, casting):
    h, gs = hg
    x, z = rand(*lead, rows, h, dtype=dtype, scale=scale, seed=rows), rand(*lead, rows, h, dtype=dtype, seed=h)
    w = None if weight == "none" else rand(h, dtype=dtype if weight == "same" else F32, seed=3)
    y = N.gated_rms_norm(x, z, w, norm_before_gate=norm_before_gate, group_size=gs, activation=activation,
                         casting=casting)
    assert y.dtype == dtype and y.shape == x.shape
    want = N.gated_rms_norm_reference(x, z, w, norm_before_gate=norm_before_gate, group_size=gs, activation=activation)
    check(y, want, fwd_tol(dtype, norm_before_gate, casting), what=f"y nbg={norm_before_gate} gs={gs} {casting}")


@given(rows=st.integers(1, 40), hg=hidden_and_group(), dtype=st.sampled_from(DTYPES),
       norm_before_gate=st.booleans(), has_weight=st.booleans(), activation=st.sampled_from(["silu", "sigmoid"]))
def test_backward_matches_float64_autograd(rows, hg, dtype, norm_before_gate, has_weight, activation):
    h, gs = hg
    x, z = rand(2, rows, h, dtype=dtype, seed=1), rand(2, rows, h, dtype=dtype, seed=2)
    dy = rand(2, rows, h, dtype=dtype, seed=4)
    w = rand(h, dtype=dtype, seed=3) if has_weight else None

    def ours(a, b, c):
        return N.gated_rms_norm(a, b, c, norm_before_gate=norm_before_gate, group_size=gs, activation=activation)

    def ref(a, b, c):
        return N.gated_rms_norm_reference(a, b, c, norm_before_gate=norm_before_gate, group_size=gs,
                                          activation=activation)

    gx, gz, gw = grads_ours(ours, [x, z, w], dy)
    rx, rz, rw = grads64(ref, [x, z, w], dy)
    assert gx.dtype == dtype and gz.dtype == dtype
    r = rstd64(x, z, norm_before_gate, h if gs is None else gs, activation)
    wmag = 1.0 if w is None else w.double().abs().max()
    scale = r * (1 + dy.double().abs().amax(-1, keepdim=True)) * wmag  # the group's |dn| scale
    check(gx, rx, bwd_tol(dtype), scale=scale, what="dx")
    check(gz, rz, bwd_tol(dtype), scale=scale * (1 + x.double().abs()), what="dz")
    if w is not None:
        # dweight = sum_rows(dy * n * silu(z)) (gate after the norm) or sum_rows(dy * n): dy * the unweighted output
        term = dy.double() * ref(x, z, None)
        check(gw, rw, (1e-6, max(2 * U[dtype], 1e-6)), scale=term.abs().flatten(0, -2).sum(0), what="dweight")
        assert gw.dtype == w.dtype


def test_zero_rows_and_inputs_untouched():
    x, z, w = torch.zeros(0, 3, 64), torch.zeros(0, 3, 64), torch.ones(64)
    assert N.gated_rms_norm(x, z, w).shape == (0, 3, 64)
    xr = x.clone().requires_grad_()
    N.gated_rms_norm(xr, z, w, norm_before_gate=False, group_size=16).sum().backward()
    assert xr.grad.shape == x.shape
    x, z, w = rand(5, 64, dtype=BF16), rand(5, 64, dtype=BF16, seed=1), rand(64, dtype=BF16, seed=2)
    x0, z0, w0 = x.clone(), z.clone(), w.clone()
    N.gated_rms_norm(x, z, w, group_size=16)
    assert torch.equal(x, x0) and torch.equal(z, z0) and torch.equal(w, w0)


@pytest.mark.parametrize("make", [lambda b: b.transpose(0, 1), lambda b: b[:, 3:3 + 96], lambda b: b[::2]])
def test_strided_inputs_equal_contiguous(make):
    x, z = make(rand(40, 128, dtype=BF16, seed=7)), make(rand(40, 128, dtype=BF16, seed=8))
    h = x.shape[-1]
    w = rand(2 * h, dtype=BF16, seed=9)[::2]
    assert not x.is_contiguous()
    for nbg in (True, False):
        assert torch.equal(N.gated_rms_norm(x, z, w, norm_before_gate=nbg, group_size=h // 2),
                           N.gated_rms_norm(x.contiguous(), z.contiguous(), w.contiguous(), norm_before_gate=nbg,
                                            group_size=h // 2))


# ---------------------------------------------------------------------------------------------- HF semantics
def ulps(t):
    a = t.double().abs().clamp_min(torch.finfo(t.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - {BF16: 7, F16: 10, F32: 23}[t.dtype])


def assert_hf_equal(got, want):
    """Same roundings as HF; the float32 statistics / sigmoid may differ in the last float32 bit, which can
    move a rounding by one ulp: <= 1 ulp everywhere, on at most 1% of the elements (16-bit outputs)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == F32:  # no rounding to compare: float32 noise of the statistics (summation order)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    diff = (got.double() - want.double()).abs()
    assert (diff <= ulps(want)).all(), diff.max()
    assert (diff > 0).double().mean() < 0.01


@pytest.mark.parametrize("dtype, wdtype", [(BF16, BF16), (BF16, F32), (F16, F16), (F32, F32)])
def test_equals_transformers_qwen3_next_rms_norm_gated(dtype, wdtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    h = 128
    hf = Qwen3NextRMSNormGated(h, eps=1e-6).to(wdtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.5 * rand(h, seed=5))
    ours = N.TPUGatedRMSNorm(h, eps=1e-6, dtype=wdtype)
    ours.load_state_dict(hf.state_dict())
    x, z = rand(4, 16, h, dtype=dtype, seed=1), rand(4, 16, h, dtype=dtype, seed=2)
    want = hf(x, z)
    assert_hf_equal(ours(x, z), want)
    if dtype == BF16:  # the test can fail: rounding once (mamba_ssm's casting) is a different answer
        once = N.gated_rms_norm_reference(x, z, hf.weight.detach()).to(dtype)
        assert (once != want).double().mean() > 0.01
    # gradients (float32: HF's autograd has no intermediate roundings then)
    if dtype == F32:
        xs, zs = x.clone().requires_grad_(), z.clone().requires_grad_()
        hf(xs, zs).square().sum().backward()
        xo, zo = x.clone().requires_grad_(), z.clone().requires_grad_()
        ours(xo, zo).square().sum().backward()
        for a, b in ((xo.grad, xs.grad), (zo.grad, zs.grad), (ours.weight.grad, hf.weight.grad)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("group_size", [32, 128])
def test_equals_transformers_mamba_rms_norm_gated(dtype, group_size):
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    h = 256
    hf = MambaRMSNormGated(h, group_size=group_size, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.5 * rand(h, seed=6))
    ours = N.TPUGatedRMSNorm(h, eps=1e-5, group_size=group_size, norm_before_gate=False, dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    x, z = rand(3, 11, h, dtype=dtype, seed=1), rand(3, 11, h, dtype=dtype, seed=2)
    want = hf(x, z)
    assert_hf_equal(ours(x, z), want)
    # gate order matters: the other order is a different answer
    assert not torch.allclose(N.gated_rms_norm(x, z, ours.weight, eps=1e-5, group_size=group_size).double(),
                              want.double(), rtol=0.05, atol=0.05)
    if dtype == F32:
        xs, zs = x.clone().requires_grad_(), z.clone().requires_grad_()
        hf(xs, zs).square().sum().backward()
        xo, zo = x.clone().requires_grad_(), z.clone().requires_grad_()
        ours(xo, zo).square().sum().backward()
        for a, b in ((xo.grad, xs.grad), (zo.grad, zs.grad), (ours.weight.grad, hf.weight.grad)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_mamba_float32_weight_with_bfloat16_x_returns_x_dtype():
    # HF promotes to float32 here (w * n.to(bf16)); this op returns x.dtype: the same product, rounded once
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    hf = MambaRMSNormGated(64, group_size=16)
    with torch.no_grad():
        hf.weight.copy_(rand(64, seed=3))
    x, z = rand(8, 64, dtype=BF16, seed=1), rand(8, 64, dtype=BF16, seed=2)
    want = hf(x, z)
    assert want.dtype == F32
    got = N.gated_rms_norm(x, z, hf.weight, norm_before_gate=False, group_size=16)
    assert got.dtype == BF16
    assert_hf_equal(got, want.to(BF16))


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_equals_transformers_falcon_h1_rms_norm_gated(dtype, norm_before_gate):
    # float32 throughout (weight * n in float32, one rounding at the end): casting="gemma"
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    h, groups = 256, 4
    hf = FalconH1RMSNormGated(h, eps=1e-6, n_groups=groups, norm_before_gate=norm_before_gate).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.5 * rand(h, seed=7))
    ours = N.TPUGatedRMSNorm(h, group_size=h // groups, norm_before_gate=norm_before_gate, casting="gemma", dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    x, z = rand(2, 9, h, dtype=dtype, seed=1), rand(2, 9, h, dtype=dtype, seed=2)
    want = hf(x, z)
    assert_hf_equal(ours(x, z), want)
    if dtype == BF16:  # HF's Mamba casting (round n first) is a different answer here
        llama = N.gated_rms_norm(x, z, ours.weight, norm_before_gate=norm_before_gate, group_size=h // groups)
        assert (llama != want).double().mean() > 0.01


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_equals_transformers_kimi_linear_rms_norm_gated(dtype):
    # Kimi-Linear's KDA output norm: sigmoid gate, float32 throughout
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated

    h = 128
    hf = KimiLinearRMSNormGated(h, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.5 * rand(h, seed=8))
    ours = N.TPUGatedRMSNorm(h, eps=1e-5, activation="sigmoid", casting="gemma", dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    x, z = rand(3, 5, 4, h, dtype=dtype, seed=1), rand(3, 5, 4, h, dtype=dtype, seed=2)
    assert_hf_equal(ours(x, z), hf(x, z))
    if dtype == F32:
        xs, zs = x.clone().requires_grad_(), z.clone().requires_grad_()
        hf(xs, zs).square().sum().backward()
        xo, zo = x.clone().requires_grad_(), z.clone().requires_grad_()
        ours(xo, zo).square().sum().backward()
        for a, b in ((xo.grad, xs.grad), (zo.grad, zs.grad), (ours.weight.grad, hf.weight.grad)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- tails, NaN poison
@pytest.mark.parametrize("norm_before_gate, gs", [(True, 200), (False, 40)])
def test_overhanging_row_block_is_masked_in_tpu_interpret_mode(norm_before_gate, gs):
    # 37 rows -> bucket 40 -> blocks of 16: rows 40..47 of the last block are past the array (NaN in "tpu" mode)
    rows, h, dtype = 37, 200, BF16
    x, z = rand(rows, h, dtype=dtype, seed=1), rand(rows, h, dtype=dtype, seed=2)
    dy = rand(rows, h, dtype=dtype, seed=3)
    w = rand(1, h, dtype=dtype, seed=4)
    cfg = {"block_rows": 16}
    with tk.interpret_mode("tpu"):
        y, rstd = N.gated_rms_norm_fwd(x, z, w, 1e-6, norm_before_gate, gs, "silu", "llama", True, False, config=cfg)
        dx, dz, dw = N.gated_rms_norm_bwd(dy, x, z, rstd, w, norm_before_gate, gs, "silu", config=cfg)
    for t in (y, rstd, dx, dz, dw):
        assert torch.isfinite(t).all()
    assert rstd.shape == (rows, h // gs)
    check(y, N.gated_rms_norm_reference(x, z, w[0], 1e-6, norm_before_gate, gs), fwd_tol(dtype, norm_before_gate))
    rx, rz, rw = grads64(lambda a, b, c: N.gated_rms_norm_reference(a, b, c, 1e-6, norm_before_gate, gs),
                         [x, z, w[0]], dy)
    scale = rstd64(x, z, norm_before_gate, gs) * (1 + dy.double().abs().amax(-1, keepdim=True)) * w.double().abs().max()
    check(dx, rx, bwd_tol(dtype), scale=scale, what="dx")
    check(dz, rz, bwd_tol(dtype), scale=scale * (1 + x.double().abs()), what="dz")
    n = N.gated_rms_norm_reference(x, z, None, 1e-6, norm_before_gate, gs)
    check(dw, rw[None], (1e-6, 1e-6), scale=(dy.double() * n).abs().sum(0), what="dweight")


def test_end_to_end_autograd_in_both_interpret_modes(interpret):
    x, z, w = rand(3, 7, 96, dtype=BF16, seed=1), rand(3, 7, 96, dtype=BF16, seed=2), rand(96, dtype=BF16, seed=3)
    dy = rand(3, 7, 96, dtype=BF16, seed=4)
    for nbg in (True, False):
        def ours(a, b, c):
            return N.gated_rms_norm(a, b, c, norm_before_gate=nbg, group_size=32)

        def ref(a, b, c):
            return N.gated_rms_norm_reference(a, b, c, norm_before_gate=nbg, group_size=32)

        gx, gz, gw = grads_ours(ours, [x, z, w], dy)
        rx, rz, rw = grads64(ref, [x, z, w], dy)
        scale = rstd64(x, z, nbg, 32) * (1 + dy.double().abs().amax(-1, keepdim=True)) * w.double().abs().max()
        check(gx, rx, bwd_tol(BF16), scale=scale, what="dx")
        check(gz, rz, bwd_tol(BF16), scale=scale * (1 + x.double().abs()), what="dz")
        n = N.gated_rms_norm_reference(x, z, None, norm_before_gate=nbg, group_size=32)
        check(gw, rw, (1e-6, 2 * U[BF16]), scale=(dy.double() * n).abs().flatten(0, 1).sum(0), what="dweight")


# ---------------------------------------------------------------------------------------------- torch integration
@pytest.mark.parametrize("case", ["public", "public_groups_bf16", "fwd", "bwd"])
def test_opcheck(case):
    if case == "public":
        op, args = torch.ops.tpukernels.gated_rms_norm, (rand(3, 5, 130, seed=1).requires_grad_(),
                                                         rand(3, 5, 130, seed=2).requires_grad_(),
                                                         rand(130, seed=3).requires_grad_(), 1e-6, True, None)
    elif case == "public_groups_bf16":
        op, args = torch.ops.tpukernels.gated_rms_norm, (rand(9, 64, dtype=BF16).requires_grad_(),
                                                         rand(9, 64, dtype=BF16, seed=1).requires_grad_(), None,
                                                         1e-5, False, 16)
    elif case == "fwd":
        op, args = torch.ops.tpukernels.gated_rms_norm_fwd, (rand(9, 130).requires_grad_(), rand(9, 130, seed=1),
                                                             rand(1, 130, seed=2).requires_grad_(), 1e-6, False, 13,
                                                             "sigmoid", "gemma", True, False)
    else:
        op, args = torch.ops.tpukernels.gated_rms_norm_bwd, (rand(9, 130), rand(9, 130, seed=1), rand(9, 130, seed=2),
                                                             rand(9, 2, seed=3).abs(), rand(1, 130, seed=4), True, 65,
                                                             "silu")
    torch.library.opcheck(op, args)


def test_torch_compile_fullgraph_dynamic_with_backward():
    import torch._dynamo.testing as dt

    cnt = dt.CompileCounterWithBackend("aot_eager")
    mod = N.TPUGatedRMSNorm(64, group_size=16, norm_before_gate=False)

    def loss(x, z):
        return mod(x, z).sum() + N.gated_rms_norm(x, z, None, activation="sigmoid", casting="gemma").sum()

    f = torch.compile(loss, backend=cnt, fullgraph=True, dynamic=True)
    frames = []
    for n in (17, 40):
        x, z = rand(n, 64, seed=n).requires_grad_(), rand(n, 64, seed=n + 1)
        f(x, z).backward()
        frames.append(cnt.frame_count)
        gx = x.grad.clone()
        x.grad = None
        loss(x, z).backward()
        torch.testing.assert_close(gx, x.grad)
    assert frames[0] >= 1 and frames[-1] == frames[0]  # one graph for both row counts


# ---------------------------------------------------------------------------------------------- bad input
X, Z = torch.randn(4, 8), torch.randn(4, 8)


@pytest.mark.parametrize("call, err, words", [
    (lambda: N.gated_rms_norm(X, torch.randn(4, 9), None), ArgumentError, ["z", "(4, 8)"]),
    (lambda: N.gated_rms_norm(X, None, None), ArgumentError, ["z", "torch.Tensor"]),
    (lambda: N.gated_rms_norm(X, Z.int(), None), DTypeError, ["z", "int32"]),
    (lambda: N.gated_rms_norm(X, Z.to("meta"), None), DeviceError, ["z", "meta"]),
    (lambda: N.gated_rms_norm(X.double(), Z, None), DTypeError, ["x", "float64"]),
    (lambda: N.gated_rms_norm(torch.tensor(1.0), torch.tensor(1.0), None), ArgumentError, ["x", "[..., H]"]),
    (lambda: N.gated_rms_norm(X, Z, torch.ones(7)), ArgumentError, ["weight", "[8]"]),
    (lambda: N.gated_rms_norm(X, Z, torch.ones(8, dtype=torch.float64)), DTypeError, ["weight", "float64"]),
    (lambda: N.gated_rms_norm(X, Z, None, group_size=3), ArgumentError, ["group_size", "dividing", "8"]),
    (lambda: N.gated_rms_norm(X, Z, None, group_size=0), ArgumentError, ["group_size", ">= 1"]),
    (lambda: N.gated_rms_norm(X, Z, None, group_size=4.0), ArgumentError, ["group_size", "int"]),
    (lambda: N.gated_rms_norm(X, Z, None, group_size=True), ArgumentError, ["group_size", "int"]),
    (lambda: N.gated_rms_norm(X, Z, None, eps=-1.0), ArgumentError, ["eps", ">= 0"]),
    (lambda: N.gated_rms_norm(X, Z, None, eps=math.nan), ArgumentError, ["eps", "finite"]),
    (lambda: N.gated_rms_norm(X, Z, None, norm_before_gate=1), ArgumentError, ["norm_before_gate", "bool"]),
    (lambda: N.gated_rms_norm(X, Z, None, activation="gelu"), ArgumentError, ["activation", "silu", "sigmoid"]),
    (lambda: N.gated_rms_norm(X, Z, None, casting="fp32"), ArgumentError, ["casting", "llama", "gemma"]),
    (lambda: N.gated_rms_norm_fwd(X, Z, None, 1e-6, True, 3, "silu", "llama", False, False), ArgumentError,
     ["group_size"]),
    (lambda: N.gated_rms_norm_fwd(X.half(), Z, None, 1e-6, True, 8, "silu", "llama", False, True), DTypeError,
     ["x", "float16"]),
    (lambda: N.gated_rms_norm_bwd(X, X, Z, torch.ones(4, 1), None, True, 4, "silu"), ArgumentError,
     ["rstd", ", 2] float32"]),
    (lambda: N.TPUGatedRMSNorm(8, activation="relu"), ArgumentError, ["activation"]),
    (lambda: N.TPUGatedRMSNorm(8, group_size=3), ArgumentError, ["group_size", "dividing"]),
    (lambda: N.TPUGatedRMSNorm(0), ArgumentError, ["hidden_size"]),
])
def test_bad_input_raises_typed_errors(call, err, words):
    with pytest.raises(err) as e:
        call()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_module_defaults_and_repr():
    m = N.TPUGatedRMSNorm(64, group_size=16, norm_before_gate=False)
    assert torch.equal(m.weight, torch.ones(64)) and m.variance_epsilon == 1e-6
    assert "group_size=16" in repr(m) and "norm_before_gate=False" in repr(m) and "casting='llama'" in repr(m)
    assert N.TPUGatedRMSNorm(8, activation="swish").activation == "silu"  # fla's name for silu
    m(rand(2, 64), rand(2, 64, seed=1)).sum().backward()
    assert m.weight.grad is not None and m.weight.grad.shape == (64,)


# ---------------------------------------------------------------------------------------------- compile-only
@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v4", "v5e", "v6e", "tpu7x"])
def test_compile_only_standard_cases_and_unaligned_groups(chip, tmp_cache):
    from tpukernels.lowering import specs_from_values
    from tpukernels.targets import bucket_specs
    from tpukernels.targets.compile_only import _as_spec, compile_for

    cases = list(N.gated_rms_norm_ops.STANDARD_CASES) + [
        (N.gated_rms_norm_fwd, ("1024x1000:f32", "1024x1000:f32", "1x1000:f32"),
         dict(eps=1e-6, norm_before_gate=False, group_size=200, activation="sigmoid", casting="gemma",
              round_scaled=True, round_f16=True)),
        (N.gated_rms_norm_bwd, ("37x1000:bf16", "37x1000:bf16", "37x1000:bf16", "37x5:f32", "1x1000:f32"),
         dict(norm_before_gate=True, group_size=200, activation="sigmoid")),
    ]
    for i, (kernel, args, statics) in enumerate(cases):
        r = compile_for(kernel, chip, *args, with_mlir=False, **statics)
        assert r.ok, r.summary()
        assert r.vmem_estimate_bytes <= N.VMEM_BUDGET_BYTES, r.summary()
        if i < len(N.gated_rms_norm_ops.STANDARD_CASES):
            assert r.config_source == f"shipped-db:{chip}", (kernel.qualname, r.config_source)
            # the VMEM-aware heuristic (what other shapes get) compiles too: it counts the body's float32
            # temporaries (without them the backward's heuristic block overflowed v5e's 16 MiB at H = 8192)
            specs, st_ = specs_from_values(kernel, kernel.bind([_as_spec(a) for a in args], statics))
            heuristic = kernel.heuristic(*bucket_specs(kernel, specs), **dict(st_))
            rh = compile_for(kernel, chip, *args, config=heuristic, with_mlir=False, **statics)
            assert rh.ok, rh.summary()
