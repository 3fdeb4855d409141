"""Tests of the fused linear + cross-entropy (tpukernels.library.linear_cross_entropy, issue 17).

Every numeric test compares with a float64 reference computed from the *same* low-precision inputs
(``reference``: float64 logits, ``F.cross_entropy``, float64 autograd). Tolerances:

* loss / lse: the kernels compute logits from the stored operands with float32 accumulation and a float32
  logsumexp, so the error is float32-sized whatever the input dtype: ``3e-5 * (1 + |ref|)``
  (H <= 160 terms, V <= 700: ~1e-6 expected; a missed tail or target column is O(1)).
* float32 gradients: ``2e-5 * max|ref|`` (f32 accumulation over <= 700 terms).
* bfloat16 gradients: the output is rounded to bfloat16 (2^-9 relative) and ``ds`` is rounded to bfloat16
  before the gradient matmuls (module docstring): ``2^-8 * |ref| + 8e-3 * max|ref|`` elementwise
  (observed <= 4.5e-3 * max|ref|; an unmasked NaN tail or a wrong ignore mask is O(max|ref|) or NaN).
"""

from __future__ import annotations

import importlib
import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpukernels as tk
import tpukernels.library  # noqa: F401  (registers torch.ops.tpukernels.linear_cross_entropy*)
from tpukernels.errors import ArgumentError, DeviceError, DTypeError

lce = importlib.import_module("tpukernels.library.linear_cross_entropy_ops")
OPS = torch.ops.tpukernels
CHIPS = ("v5e", "v6e", "tpu7x")


def _data(N, V, H, dtype, seed=0, ignore_every=4):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    W = (torch.randn(V, H, generator=g) * (2.0 / max(H, 1) ** 0.5)).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        y[::ignore_every] = -100
    return h, W, y


def _ref_grads(h, W, y, g_rows, softcap):
    hd, Wd = h.double().requires_grad_(), W.double().requires_grad_()
    loss = lce.reference(hd, Wd, y, reduction="none", softcap=softcap)
    (loss * g_rows.double()).sum().backward()
    return loss.detach(), hd.grad, Wd.grad


def _assert_loss(got, ref):
    err = (got.double() - ref).abs()
    bound = 3e-5 * (1 + ref.abs())
    assert bool((err <= bound).all()), f"loss error {err.max().item():.3g} > bound {bound.min().item():.3g}"


def _assert_grad(got, ref, dtype, what):
    assert got.dtype == dtype, (what, got.dtype)
    err = (got.double() - ref).abs()
    scale = ref.abs().max().item()
    if dtype == torch.float32:
        bound = 2e-5 * scale + torch.zeros_like(ref)
    else:
        bound = 2.0**-8 * ref.abs() + 8e-3 * scale
    assert bool((err <= bound + 1e-30).all()), f"{what}: error {err.max().item():.3g} (max |ref| {scale:.3g})"


# ----------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("mode", ("fast", "tpu"))
@settings(max_examples=4)
@given(N=st.integers(1, 70), V=st.integers(1, 700), H=st.integers(1, 160),
       dtype=st.sampled_from((torch.float32, torch.bfloat16)), softcap=st.sampled_from((None, 12.0)),
       bn=st.sampled_from((16, 32)), bv=st.sampled_from((128, 256)), seed=st.integers(0, 99))
def test_kernels_match_reference(mode, N, V, H, dtype, softcap, bn, bv, seed):
    """fwd, bwd_dh, bwd_dw with small blocks: tails in N and V (H is one block: any H), ignored rows,
    soft-cap, per-row incoming gradients; both interpret modes (NaN-poisoned padding in "tpu")."""
    with tk.interpret_mode(mode):
        _check_kernels(N, V, H, dtype, softcap, bn, bv, seed)


def _check_kernels(N, V, H, dtype, softcap, bn, bv, seed):
    h, W, y = _data(N, V, H, dtype, seed)
    y2 = y.to(torch.int32).reshape(-1, 1)
    cfg = dict(bn=bn, bv=bv)
    loss, lse = OPS.linear_cross_entropy_fwd(h, W, y2, -100, softcap, config=json.dumps(cfg))
    g = torch.rand(N, 1, generator=torch.Generator().manual_seed(seed)) + 0.5
    dh = OPS.linear_cross_entropy_bwd_dh(h, W, y2, lse, g, -100, softcap, config=json.dumps(cfg))
    dW = OPS.linear_cross_entropy_bwd_dw(h, W, y2, lse, g, -100, softcap, config=json.dumps(cfg))
    ref, rdh, rdW = _ref_grads(h, W, y, g[:, 0], softcap)
    _assert_loss(loss[:, 0], ref)
    assert bool((loss[y == -100] == 0).all())
    z = h.double() @ W.double().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    _assert_loss(lse[:, 0].double() + lse[:, 1].double(), torch.logsumexp(z, 1))
    _assert_grad(dh, rdh, dtype, "dh")
    _assert_grad(dW, rdW, dtype, "dW")


@pytest.mark.parametrize("mode", ("fast", "tpu"))
@settings(max_examples=3)
@given(N=st.integers(1, 70), V=st.integers(1, 700), H=st.integers(1, 160),
       dtype=st.sampled_from((torch.float32, torch.bfloat16)), softcap=st.sampled_from((None, 12.0)),
       bn=st.sampled_from((16, 32)), bv=st.sampled_from((128, 256)), seed=st.integers(0, 99))
def test_fwd_dh_matches_reference(mode, N, V, H, dtype, softcap, bn, bv, seed):
    """The gradient-in-forward kernel: weighted loss, lse and dh = g * dloss/dh in one pass (online rescaled
    accumulator, W[y] rows by DMA), tails in N and V, ignored rows, soft-cap, per-row weights g; both
    interpret modes (NaN-poisoned padding and uncopied DMA rows in "tpu")."""
    h, W, y = _data(N, V, H, dtype, seed)
    g = torch.rand(N, 1, generator=torch.Generator().manual_seed(seed)) + 0.5
    wy = W.index_select(0, y.clamp(0, V - 1))
    with tk.interpret_mode(mode):
        loss, lse, dh = OPS.linear_cross_entropy_fwd_dh(h, W, y.int().reshape(-1, 1), wy, g, -100, softcap,
                                                        config=json.dumps(dict(bn=bn, bv=bv)))
    ref, rdh, _ = _ref_grads(h, W, y, g[:, 0], softcap)
    _assert_loss(loss[:, 0], ref * g[:, 0].double())
    z = h.double() @ W.double().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    _assert_loss(lse[:, 0].double() + lse[:, 1].double(), torch.logsumexp(z, 1))
    assert bool((loss[y == -100] == 0).all()) and bool((dh[y == -100] == 0).all())
    _assert_grad(dh, rdh, dtype, "dh")


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if "tpukernels" in name:
            self.ops.append(name.split(".")[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("needs", ("h", "W", "both"))
def test_backward_recomputes_logits_once(needs):
    """With h requiring grad the public op runs the gradient-in-forward kernel and, for W, one dW kernel: the
    logits are computed twice in all (8 N V H FLOPs), never the three times of fwd + bwd_dh + bwd_dw.
    Gradients still match float64 autograd."""
    h, W, y = _data(30, 260, 40, torch.float32, seed=7)
    h.requires_grad_(needs in ("h", "both"))
    W.requires_grad_(needs in ("W", "both"))
    log = _OpLog()
    with log:
        out = tk.library.linear_cross_entropy(h, W, y)
        out.backward()
    want = {"h": ["linear_cross_entropy_fwd_dh"],
            "W": ["linear_cross_entropy_fwd", "linear_cross_entropy_bwd_dw"],
            "both": ["linear_cross_entropy_fwd_dh", "linear_cross_entropy_bwd_dw"]}[needs]
    assert [o for o in log.ops if o.startswith("linear_cross_entropy_")] == want, log.ops
    flops = {"linear_cross_entropy_fwd": 2, "linear_cross_entropy_fwd_dh": 4, "linear_cross_entropy_bwd_dw": 4}
    assert sum(flops[o] for o in want) <= 8
    hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    lce.reference(hd, Wd, y).backward()
    _assert_loss(out.detach().reshape(1), lce.reference(h.detach(), W.detach(), y).reshape(1))
    for t, r, n in ((h, hd, "dh"), (W, Wd, "dW")):
        if t.requires_grad:
            _assert_grad(t.grad, r.grad, torch.float32, n)
        else:
            assert t.grad is None


def test_grad_path_all_ignored_and_no_grad_mode():
    """The gradient-in-forward path keeps torch's edge results: every row ignored gives NaN ("mean", as
    F.cross_entropy) or 0 ("sum") and zero gradients; under no_grad the plain forward runs (no dh)."""
    h, W, _ = _data(9, 150, 30, torch.float32)
    allign = torch.full((9,), -100)
    hm = h.clone().requires_grad_()
    assert torch.isnan(tk.library.linear_cross_entropy(hm, W, allign))
    hs = h.clone().requires_grad_()
    out = tk.library.linear_cross_entropy(hs, W, allign, reduction="sum")
    out.backward()
    assert out.item() == 0.0 and bool((hs.grad == 0).all())
    log = _OpLog()
    with log, torch.no_grad():
        tk.library.linear_cross_entropy(hs, W, allign)
    assert "linear_cross_entropy_fwd_dh" not in log.ops and "linear_cross_entropy_fwd" in log.ops


def test_ignored_rows_get_no_gradient(interpret):
    """Rows with label == ignore_index (here 11, a valid class id) contribute nothing: loss and dh are exactly
    0 there and dW equals the reference gradient of the other rows alone."""
    h, W, y = _data(24, 300, 40, torch.float32, ignore_every=0)
    y[::3] = 11
    keep = y != 11
    cfg = json.dumps(dict(bn=8, bv=128))
    y2 = y.int().reshape(-1, 1)
    loss, lse = OPS.linear_cross_entropy_fwd(h, W, y2, 11, None, config=cfg)
    g = torch.ones(24, 1)
    dh = OPS.linear_cross_entropy_bwd_dh(h, W, y2, lse, g, 11, None, config=cfg)
    dW = OPS.linear_cross_entropy_bwd_dw(h, W, y2, lse, g, 11, None, config=cfg)
    assert bool((loss[~keep] == 0).all()) and bool((dh[~keep] == 0).all())
    _, rdh, rdW = _ref_grads(h[keep], W, y[keep], g[keep, 0], None)
    _assert_grad(dh[keep], rdh, torch.float32, "dh")
    _assert_grad(dW, rdW, torch.float32, "dW")


# ----------------------------------------------------------------------------------------------- large logits
def _large_logit_data(seed):
    """h x 1e3 (issue 36 item 5): logits ~6e3 with gaps of hundreds, so each row's softmax is ~one-hot and one
    f32 ulp of the logsumexp (4.9e-4 at 6e3) is the whole of ``p - 1`` at the top logit."""
    g = torch.Generator().manual_seed(seed)
    N, V, H = 48, 300, 64
    h = torch.randn(N, H, generator=g) * 1e3
    W = torch.randn(V, H, generator=g) * 0.1
    y = torch.randint(0, V, (N,), generator=g)
    y[::5] = (h @ W.t()).argmax(1)[::5]  # some rows right (p_y ~ 1, ds_y = p_y - 1 ~ 0), most wrong
    return h, W, y


@pytest.mark.parametrize("seed", (0, 2, 5))
def test_large_logits_dw_as_accurate_as_unfused(seed):
    """Issue 36 item 5: at logits ~6e3 (h x 1e3) the public op's dW is within 3x the error of torch's float32
    unfused path (``F.cross_entropy(h @ W.T)``, its own softmax backward), both measured against float64
    autograd from the same inputs (loss and dh: 3x that or the file's float32 tolerance). These seeds have
    top-2 logit gaps >= 5, so the error is the top logit's ``p - 1`` (the unfused softmax's is ~eps); with
    closer gaps both paths are dominated by their own f32 logit rounding (different summation orders; ratio
    0.25-2.5 over 8 seeds). Measured: ratio 1.0 / 0.41 / 1.0 here; before the (hi, lo) lse pair, with ``p =
    exp(z - lse)`` and one f32 ``lse``, 35 / 101 / 172."""
    h, W, y = _large_logit_data(seed)
    z = h.double() @ W.double().t()
    top = z.topk(2, 1).values
    assert 3e3 < z.abs().max() < 2e4 and (top[:, 0] - top[:, 1]).min() > 5
    errs = {}
    chunked = lambda h, W, y: tk.library.linear_cross_entropy(h, W, y, chunk_rows=16)  # noqa: E731
    for name, fn, dt in (("ref", lce.reference, torch.float64), ("unfused", lce.unfused, torch.float32),
                         ("ours", tk.library.linear_cross_entropy, torch.float32), ("chunked", chunked, torch.float32)):
        hh, WW = h.to(dt, copy=True).requires_grad_(), W.to(dt, copy=True).requires_grad_()
        loss = fn(hh, WW, y)
        loss.backward()
        errs[name] = (loss.detach().double(), hh.grad.double(), WW.grad.double())
    ref = errs.pop("ref")
    e = {k: [(a - b).abs().max().item() for a, b in zip(v, ref)] for k, v in errs.items()}
    assert e["unfused"][2] > 0  # the bar is a real error, not 0
    for i, what in enumerate(("loss", "dh", "dW")):
        # loss and dh: also the file's float32 tolerances (their errors are f32 rounding, ~1e-7, on both paths)
        floor = {"loss": 3e-5 * (1 + ref[i].abs().max().item()), "dh": 2e-5 * ref[i].abs().max().item(),
                 "dW": 1e-6 * ref[i].abs().max().item()}[what]
        for ours in ("ours", "chunked"):  # the fused kernels and the chunked strategy (stored f32 logits)
            assert e[ours][i] <= 3 * e["unfused"][i] + floor, \
                f"{ours} {what}: error {e[ours][i]:.3g} > 3 x unfused f32 {e['unfused'][i]:.3g}"


def test_large_logits_kernels_other_blocks():
    """The same at the kernel ops with different blocks for the forward and the backward (the recompute in
    bwd_dw / bwd_dh must give the forward's logits bit for bit for ``z - hi`` to be exact), in the "tpu"
    interpret mode: dW and dh (from ``fwd``'s lse pair) within 3x the unfused f32 error."""
    h, W, y = _large_logit_data(5)
    y2 = y.int().reshape(-1, 1)
    g = torch.full((h.shape[0], 1), 1.0 / h.shape[0])
    with tk.interpret_mode("tpu"):
        _, lse = OPS.linear_cross_entropy_fwd(h, W, y2, -100, None, config=json.dumps(dict(bn=16, bv=128)))
        cfg = json.dumps(dict(bn=32, bv=256))
        dW = OPS.linear_cross_entropy_bwd_dw(h, W, y2, lse, g, -100, None, config=cfg)
        dh = OPS.linear_cross_entropy_bwd_dh(h, W, y2, lse, g, -100, None, config=cfg)
    _, rdh, rdW = _ref_grads(h, W, y, g[:, 0], None)
    hu, Wu = h.clone().requires_grad_(), W.clone().requires_grad_()
    lce.unfused(hu, Wu, y).backward()
    for got, un, ref, what in ((dW, Wu.grad, rdW, "dW"), (dh, hu.grad, rdh, "dh")):
        err, bar = (got.double() - ref).abs().max().item(), (un.double() - ref).abs().max().item()
        floor = (1e-6 if what == "dW" else 2e-5) * ref.abs().max().item()
        assert err <= 3 * bar + floor, f"{what}: {err:.3g} > 3 x unfused {bar:.3g}"


# ----------------------------------------------------------------------------------------------- public op
@pytest.mark.parametrize("chunk_rows", (None, 16), ids=("fused", "chunked"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_public_op_and_autograd(dtype, reduction, chunk_rows):
    """linear_cross_entropy(h, W, labels) and its gradients vs float64 autograd, int64 and int32 labels, both
    strategies (chunked: 40 rows in chunks of 16, a partial last chunk)."""
    h, W, y = _data(40, 333, 72, dtype, seed=3)
    if dtype == torch.float16:
        y = y.int()
    h.requires_grad_()
    W.requires_grad_()
    out = tk.library.linear_cross_entropy(h, W, y, reduction=reduction, chunk_rows=chunk_rows)
    assert out.dtype == torch.float32 and out.shape == ((40,) if reduction == "none" else ())
    up = torch.linspace(0.5, 1.5, 40) if reduction == "none" else torch.tensor(1.7)
    (out * up).sum().backward()
    hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    ref = lce.reference(hd, Wd, y, reduction=reduction)
    (ref * up.double()).sum().backward()
    _assert_loss(out.detach().reshape(-1), ref.detach().reshape(-1))
    for got, want, what in ((h.grad, hd.grad, "dh"), (W.grad, Wd.grad, "dW")):
        if dtype == torch.float16:  # f32 kernels on the widened operands, one rounding to float16 at the end
            assert got.dtype == torch.float16
            torch.testing.assert_close(got.double(), want, rtol=2.0**-10, atol=2e-5 * want.abs().max().item())
        else:
            _assert_grad(got, want, dtype, what)


def test_public_softcap_and_edge_rows():
    """softcap through the public op; every row ignored (mean = NaN like torch, sum = 0); N = 0."""
    h, W, y = _data(9, 150, 30, torch.float32)
    got = tk.library.linear_cross_entropy(h, W, y, softcap=5.0)
    ref = lce.reference(h, W, y, softcap=5.0)
    _assert_loss(got.reshape(1), ref.reshape(1))
    assert abs(got.item() - lce.reference(h, W, y).item()) > 1e-3  # the cap changes the answer
    allign = torch.full((9,), -100)
    assert torch.isnan(tk.library.linear_cross_entropy(h, W, allign))
    assert torch.isnan(torch.nn.functional.cross_entropy(h @ W.t(), allign))
    assert tk.library.linear_cross_entropy(h, W, allign, reduction="sum").item() == 0.0
    e = torch.zeros(0, 30, requires_grad=True)
    out = tk.library.linear_cross_entropy(e, W, torch.zeros(0, dtype=torch.long), reduction="sum")
    out.backward()
    assert out.item() == 0.0 and e.grad.shape == (0, 30)


@pytest.mark.parametrize("chunk_rows", (None, 16), ids=("fused", "chunked"))
def test_torch_compile_fullgraph_backward(chunk_rows):
    """One graph with the kernel ops (no graph break), backward through aot_eager, same numbers as eager."""
    import torch._dynamo.testing as dt

    h, W, y = _data(33, 260, 48, torch.float32, seed=5)
    lce_ = lambda h, W, y: tk.library.linear_cross_entropy(h, W, y, chunk_rows=chunk_rows)  # noqa: E731
    cnt = dt.CompileCounter()
    f = torch.compile(lce_, fullgraph=True, backend=cnt)
    torch.testing.assert_close(f(h, W, y), lce_(h, W, y), rtol=0, atol=0)
    assert cnt.frame_count == 1
    hc, Wc = h.clone().requires_grad_(), W.clone().requires_grad_()
    g = torch.compile(lce_, fullgraph=chunk_rows is not None, backend="aot_eager")
    g(hc, Wc, y).backward()
    he, We = h.clone().requires_grad_(), W.clone().requires_grad_()
    lce_(he, We, y).backward()
    torch.testing.assert_close(hc.grad, he.grad, rtol=0, atol=0)
    torch.testing.assert_close(Wc.grad, We.grad, rtol=0, atol=0)


def test_opcheck():
    """torch.library.opcheck of the public op and the forward kernel op (schema, fake, autograd, aot)."""
    h, W, y = _data(12, 150, 24, torch.float32)
    h.requires_grad_()
    W.requires_grad_()
    torch.library.opcheck(OPS.linear_cross_entropy, (h, W, y, -100, "sum", None))
    torch.library.opcheck(OPS.linear_cross_entropy, (h, W, y, -100, "mean", None, 5))  # chunked strategy
    torch.library.opcheck(OPS.linear_cross_entropy_fwd, (h, W, y.int().reshape(-1, 1), -100, 7.0))


@pytest.mark.parametrize("chunk_rows", (None, 8), ids=("fused", "chunked"))
def test_inputs_not_modified(chunk_rows):
    h, W, y = _data(17, 200, 40, torch.bfloat16)
    h0, W0, y0 = h.clone(), W.clone(), y.clone()
    h.requires_grad_()
    W.requires_grad_(chunk_rows is not None)
    tk.library.linear_cross_entropy(h, W, y, chunk_rows=chunk_rows).backward()
    assert torch.equal(h.detach(), h0) and torch.equal(W.detach(), W0) and torch.equal(y, y0)


# ----------------------------------------------------------------------------------------------- errors
_h, _W, _y = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, -100])


@pytest.mark.parametrize("args, kw, err, match", [
    ((_h[0], _W, _y), {}, ArgumentError, r"h must be 2-D \[N, H\]"),
    ((_h, _W[0], _y), {}, ArgumentError, r"W must be 2-D \[V, H\]"),
    ((_h, torch.randn(10, 9), _y), {}, ArgumentError, r"H = h.shape\[1\] = 8"),
    ((_h, torch.randn(0, 8), _y), {}, ArgumentError, "V and H must be positive"),
    ((_h, _W, _y[:3]), {}, ArgumentError, r"labels must be 1-D \[N\] with N = h.shape\[0\] = 4"),
    ((_h.double(), _W.double(), _y), {}, DTypeError, "h dtype float64 .* no float64"),
    ((_h, _W.bfloat16(), _y), {}, DTypeError, "h is float32 but W is bfloat16"),
    ((_h, _W, _y.float()), {}, DTypeError, "labels must be int64 or int32"),
    ((_h, _W, _y.to(torch.int16)), {}, DTypeError, "labels must be int64 or int32"),
    ((_h, _W, _y), {"reduction": "avg"}, ArgumentError, "reduction must be one of"),
    ((_h, _W, _y), {"softcap": -1.0}, ArgumentError, "softcap must be None or a positive finite"),
    ((_h, _W, _y), {"softcap": float("inf")}, ArgumentError, "softcap must be None or a positive finite"),
    ((_h, _W, torch.tensor([1, 2, 10, -100])), {}, ArgumentError, r"labels\[2\] = 10 is outside \[0, V = 10\)"),
    ((_h, _W, torch.tensor([1, -1, 3, 4])), {}, ArgumentError, r"labels\[1\] = -1 is outside"),
    ((_h, _W, torch.tensor([1, 2, 3, -100])), {"ignore_index": 0}, ArgumentError, r"labels\[3\] = -100"),
    ((_h, _W.to("meta"), _y), {}, DeviceError, "must be on one device"),
    ((_h, _W, _y), {"chunk_rows": 0}, ArgumentError, "chunk_rows must be None .* or a positive int"),
    ((_h, _W, _y), {"chunk_rows": 2.0}, ArgumentError, "'chunk_rows' must be int"),
    ((_h, _W, _y), {"chunk_rows": True}, ArgumentError, "'chunk_rows' must be int"),
])
def test_bad_input_typed_errors(args, kw, err, match):
    calls = []
    orig = lce.linear_cross_entropy_fwd.launch_fn
    lce.linear_cross_entropy_fwd.launch_fn = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        with pytest.raises(err, match=match):
            tk.library.linear_cross_entropy(*args, **kw)
    finally:
        lce.linear_cross_entropy_fwd.launch_fn = orig
    assert not calls, "the error must come before any kernel is launched"


def test_kernel_level_errors():
    y2 = _y.int().reshape(-1, 1)
    with pytest.raises(DTypeError, match="labels.*int64 is not supported"):
        OPS.linear_cross_entropy_fwd(_h, _W, y2.long())
    with pytest.raises(DTypeError, match="float16"):
        OPS.linear_cross_entropy_fwd(_h.half(), _W.half(), y2)
    with pytest.raises(ArgumentError, match=r"lse must have shape \[N, 2\]"):
        OPS.linear_cross_entropy_bwd_dh(_h, _W, y2, torch.zeros(4), torch.zeros(4, 1))


# ----------------------------------------------------------------------------------------------- shipped defaults
def test_shipped_defaults_exist(tmp_cache):
    """Every chip has an exact shipped entry for each standard case (current kernel source), chosen by the
    autotuner's tpu-model evaluator (a libtpu static-estimate model)."""
    from tpukernels.autotune import db

    for chip in CHIPS:
        for kernel, args, kw in lce.STANDARD_CASES:
            got = db.lookup(kernel, chip, *_specs_statics(kernel, args, kw))
            assert got is not None and got[1] == "shipped-db", (
                f"{chip} {kernel.name}: no exact shipped entry ({got}); rerun the `tpukernels autotune` "
                f"commands in the module docstring")
            assert set(got[0]) == {"bn", "bv"}, (chip, kernel.name, got)


def _specs_statics(kernel, args, kw):
    from tpukernels.targets.compile_only import parse_shape

    specs = []
    names = [p.name for p in kernel.tensor_params]
    for a, n in zip(args, names):
        s = parse_shape(a)
        specs.append(tk.TensorSpec(s.shape, s.dtype, n))
    statics = tuple((p.name, kw.get(p.name, p.default)) for p in kernel.params if p.kind == "static")
    return tuple(specs), statics


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("case", range(len(lce.STANDARD_CASES)), ids=lambda i: lce.STANDARD_CASES[i][0].name)
def test_compile_only(chip, case):
    """Mosaic + XLA:TPU compile the Llama-3-8B LM head kernels at their resolved (shipped) configs."""
    kernel, args, kw = lce.STANDARD_CASES[case]
    t = time.time()
    res = tk.compile_for(kernel, chip, *args, **kw, with_mlir=False)
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 0)
    assert time.time() - t < 120


# ----------------------------------------------------------------------------------------------- bench family
def test_bench_family_cases():
    from tpukernels import bench
    from tpukernels.bench import linear_cross_entropy as fam

    assert "linear_cross_entropy" in bench.MODEL_FAMILIES and bench.family_module("linear_cross_entropy") is fam
    cases = fam.cases(["v5e", "v6e"])
    assert [(c.chip, c.op) for c in cases] == [("v5e", "lce fwd"), ("v5e", "lce fwd+bwd"), ("v6e", "lce fwd"),
                                               ("v6e", "lce fwd+bwd")]
    assert [[i.name for i in c.impls] for c in cases[:2]] == [
        ["tpukernels", "xla unfused"],
        ["tpukernels", *(f"tpukernels chunked {r}" for r in fam.CHUNK_ROWS), "xla unfused"]]
    assert all(i.kind == ("xla" if i.name.startswith("xla") else "ours") for c in cases for i in c.impls)
    assert cases[1].flops == 3 * cases[0].flops == 6 * fam.N * fam.V * fam.H


def test_bench_unfused_matches_reference():
    """The XLA baseline computes the same loss (small shapes, jax on cpu vs the float64 reference)."""
    import jax.numpy as jnp
    import numpy as np

    from tpukernels.bench import linear_cross_entropy as fam

    h, W, y = _data(16, 50, 24, torch.float32, ignore_every=0)
    got = float(fam.unfused(jnp.asarray(h.numpy()), jnp.asarray(W.numpy()), jnp.asarray(y.int().numpy()[:, None])))
    assert np.isfinite(got) and abs(got - lce.reference(h, W, y).item()) < 1e-4


@pytest.mark.aot
def test_peak_activation_memory_model():
    """Compile-only for v6e at the Llama-3-8B LM head: XLA's temporary HBM for the fused forward stays under
    64 MiB; the unfused forward holds the [N, V] logits (> 2 GiB). (The bench family reports forward +
    backward too: 0-12 MiB vs 6012 MiB on v5e, v6e, tpu7x; the forward alone keeps this test at ~6 s.)"""
    import jax
    import jax.numpy as jnp

    from tpukernels.bench import linear_cross_entropy as fam

    fn, structs = fam._ours_program("v6e", False)
    ours = fam._peak_temp_bytes(fn, structs, "v6e")
    s = [jax.ShapeDtypeStruct((fam.N, fam.H), jnp.bfloat16), jax.ShapeDtypeStruct((fam.V, fam.H), jnp.bfloat16),
         jax.ShapeDtypeStruct((fam.N, 1), jnp.int32)]
    xla = fam._peak_temp_bytes(fam.unfused, s, "v6e")
    assert ours < 64 * 2**20 and xla > fam.N * fam.V * 2, (ours, xla)


def test_bench_memory_figures_reach_rows_and_report():
    """Impl.memory (the peak-memory figures) lands in the row even when the estimate fails, a failing memory
    analysis is a flag (the time stands), and the report table shows one column per memory key."""
    from tpukernels.bench import core, report
    from tpukernels.bench.core import Case, EstimateError, Impl

    def boom(chip):
        raise RuntimeError("compile failed")

    def aborts(est, chip):
        raise EstimateError("profiler aborted")

    case = Case("f", "op", "s", "v6e", hbm_bytes=10**6, flops=10**9, impls=[
        Impl("tpukernels", "ours", lambda e, c: (10**6, None), memory=lambda c: {"peak_temp_MiB": 4.0}),
        Impl("xla", "xla", aborts, memory=lambda c: {"peak_temp_MiB": 6012.5}),
        Impl("other", "public", lambda e, c: (10**6, None), memory=boom),
    ])
    rows = {r["impl"]: r for r in core.run_case(case, est=None)}
    assert rows["tpukernels"]["memory"] == {"peak_temp_MiB": 4.0}
    assert rows["xla"]["memory"] == {"peak_temp_MiB": 6012.5} and rows["xla"]["model_us"] is None
    assert "memory" not in rows["other"] and "compile failed" in rows["other"]["flags"][0]
    assert rows["other"]["model_us"] is not None
    table = "\n".join(report._table(list(rows.values())))
    assert "peak_temp_MiB (tpukernels / xla / other)" in table and "| 4.0 / 6,012.5 / - |" in table
