"""Tests of the chunked strategy of tpukernels.library.linear_cross_entropy (``chunk_rows=``, issue 40).

The public op's values and gradients for both strategies are tested in test_linear_cross_entropy.py (its
public-op tests are parametrized over ``chunk_rows``); this file tests the chunked kernels themselves
(``fwd_s``, ``dh_s``, ``dw_s``, ``dw_s_acc``) against the float64 reference, which kernels the strategy runs
(each logit computed once when the reduction sums), and its edge cases. Tolerances as in
test_linear_cross_entropy.py (float32-sized loss; bfloat16 gradients ``2^-8 |ref| + 8e-3 max|ref|``).
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpukernels as tk
import tpukernels.library  # noqa: F401  (registers torch.ops.tpukernels.linear_cross_entropy*)
from tpukernels.errors import ArgumentError, DTypeError

from test_linear_cross_entropy import _data, _ref_grads  # noqa: E402  (tests/ is on sys.path, as hf_tiny)

lce = importlib.import_module("tpukernels.library.linear_cross_entropy_ops")
OPS = torch.ops.tpukernels


def _assert_close(got, ref, dtype, what):
    err = (got.double() - ref).abs()
    scale = ref.abs().max().item()
    bound = 2e-5 * scale if dtype == torch.float32 else 2.0**-8 * ref.abs() + 8e-3 * scale
    assert bool((err <= bound + 1e-30).all()), f"{what}: error {err.max().item():.3g} (max |ref| {scale:.3g})"


@pytest.mark.parametrize("mode", ("fast", "tpu"))
@settings(max_examples=2)
@given(N=st.integers(1, 70), V=st.integers(1, 700), H=st.integers(1, 160),
       dtype=st.sampled_from((torch.float32, torch.bfloat16)), softcap=st.sampled_from((None, 12.0)),
       bn=st.sampled_from((16, 32)), bv=st.sampled_from((128, 256)), seed=st.integers(0, 99))
def test_chunked_kernels_match_reference(mode, N, V, H, dtype, softcap, bn, bv, seed):
    """fwd_s (loss, lse pair and the stored raw logits), dh_s, dw_s and dw_s_acc from them, with small blocks:
    tails in N and V, ignored rows, soft-cap, per-row weights; both interpret modes (NaN-poisoned padding in
    "tpu": the undefined tail columns of s must not reach dh or dW)."""
    h, W, y = _data(N, V, H, dtype, seed)
    y2 = y.int().reshape(-1, 1)
    g = torch.rand(N, 1, generator=torch.Generator().manual_seed(seed)) + 0.5
    cfg = json.dumps(dict(bn=bn, bv=bv))
    acc0 = torch.randn(V, H, generator=torch.Generator().manual_seed(seed + 1))
    acc = acc0.clone()
    with tk.interpret_mode(mode):
        loss, lse, s = OPS.linear_cross_entropy_fwd_s(h, W, y2, -100, softcap, config=cfg)
        dh = OPS.linear_cross_entropy_dh_s(s, W, y2, lse, g, -100, softcap, config=cfg)
        dw = OPS.linear_cross_entropy_dw_s(s, h, y2, lse, g, -100, softcap, config=cfg)
        dw_acc = OPS.linear_cross_entropy_dw_s_acc(s, h, y2, lse, g, acc, -100, softcap, config=cfg)
    ref, rdh, rdW = _ref_grads(h, W, y, g[:, 0], softcap)
    assert s.dtype == torch.float32 and s.shape == (N, V) and dw.dtype == torch.float32 and dh.dtype == dtype
    torch.testing.assert_close(s.double(), h.double() @ W.double().t(), rtol=1e-5, atol=1e-5 * max(1, H) ** 0.5)
    err = (loss[:, 0].double() - ref).abs()
    assert bool((err <= 3e-5 * (1 + ref.abs())).all()) and bool((loss[y == -100] == 0).all())
    _assert_close(dh, rdh, dtype, "dh")
    _assert_close(dw, rdW, dtype, "dW")
    _assert_close(dw_acc - acc0, rdW, dtype, "dW accumulated")
    assert torch.equal(acc, acc0)  # the accumulator argument is not modified (a functional op)


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if "tpukernels" in name:
            self.ops.append(name.split(".")[-1].replace("linear_cross_entropy_", ""))
        return func(*args, **(kwargs or {}))


_FLOPS = {"fwd": 2, "fwd_s": 2, "dh_s": 2, "dw_s": 2, "dw_s_acc": 2}  # x N V H for the rows they run on


@pytest.mark.parametrize("reduction, needs, want", [
    ("mean", "both", ["fwd_s", "dh_s", "dw_s"] + ["fwd_s", "dh_s", "dw_s_acc"] * 2),
    ("sum", "h", ["fwd_s", "dh_s"] * 3),
    ("sum", "W", ["fwd_s", "dw_s"] + ["fwd_s", "dw_s_acc"] * 2),
    # "none": per-row upstream gradients cannot scale a summed dW, so the backward recomputes the logits once
    ("none", "both", ["fwd_s", "dh_s"] * 3 + ["fwd_s", "dw_s"] + ["fwd_s", "dw_s_acc"] * 2),
])
def test_chunked_runs_each_logit_once(reduction, needs, want):
    """30 rows in chunks of 12 (12, 12, 6): for "mean" / "sum" each chunk's logits are computed once and dh,
    dW made from the stored ones (6 N V H FLOPs with both gradients); gradients match float64 autograd."""
    h, W, y = _data(30, 260, 40, torch.float32, seed=7)
    h.requires_grad_(needs in ("h", "both"))
    W.requires_grad_(needs in ("W", "both"))
    log = _OpLog()
    up = torch.linspace(0.5, 1.5, 30) if reduction == "none" else torch.tensor(1.3)
    with log:
        out = tk.library.linear_cross_entropy(h, W, y, reduction=reduction, chunk_rows=12)
        (out * up).sum().backward()
    assert log.ops == want
    if reduction != "none":
        grads = (needs in ("h", "both")) + (needs in ("W", "both"))
        assert sum(_FLOPS[o] for o in log.ops) == 2 * (1 + grads) * 3  # x (N/3) V H: 3 chunks, no recompute
    hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    ref = lce.reference(hd, Wd, y, reduction=reduction)
    (ref * up.double()).sum().backward()
    err = (out.detach().double() - ref.detach()).abs()
    assert bool((err <= 3e-5 * (1 + ref.detach().abs())).all())
    for t, r, n in ((h, hd, "dh"), (W, Wd, "dW")):
        if t.requires_grad:
            _assert_close(t.grad, r.grad, torch.float32, n)
        else:
            assert t.grad is None


def test_chunked_edge_cases():
    """Every row ignored ("mean": NaN as torch, zero gradients; "sum": 0); one chunk larger than N; under
    no_grad the fused forward runs (the logits are not stored)."""
    h, W, _ = _data(9, 150, 30, torch.float32)
    allign = torch.full((9,), -100)
    hm, Wm = h.clone().requires_grad_(), W.clone().requires_grad_()
    out = tk.library.linear_cross_entropy(hm, Wm, allign, chunk_rows=4)
    assert torch.isnan(out)
    hs, Ws = h.clone().requires_grad_(), W.clone().requires_grad_()
    out = tk.library.linear_cross_entropy(hs, Ws, allign, reduction="sum", chunk_rows=4)
    out.backward()
    assert out.item() == 0.0 and bool((hs.grad == 0).all()) and bool((Ws.grad == 0).all())
    _, _, y = _data(9, 150, 30, torch.float32)
    hb = h.clone().requires_grad_()
    got = tk.library.linear_cross_entropy(hb, W, y, chunk_rows=1000)
    got.backward()
    hf = h.clone().requires_grad_()
    tk.library.linear_cross_entropy(hf, W, y).backward()
    assert abs(got.item() - lce.reference(h, W, y).item()) <= 3e-5 * (1 + got.abs().item())
    _assert_close(hb.grad, hf.grad.double(), torch.float32, "dh (one chunk vs fused)")
    log = _OpLog()
    with log, torch.no_grad():
        tk.library.linear_cross_entropy(hb, W, y, chunk_rows=4)
    assert log.ops == ["fwd"]


def test_chunked_kernel_errors():
    h, W, y = _data(4, 10, 8, torch.float32)
    y2, g = y.int().reshape(-1, 1), torch.ones(4, 1)
    _, lse, s = OPS.linear_cross_entropy_fwd_s(h, W, y2)
    with pytest.raises(DTypeError, match="s .*must be float32"):
        OPS.linear_cross_entropy_dh_s(s.bfloat16(), W, y2, lse, g)
    with pytest.raises(ArgumentError, match=r"w must be \[10, 8\]"):
        OPS.linear_cross_entropy_dh_s(s, W[:9], y2, lse, g)
    with pytest.raises(ArgumentError, match=r"row tensors .* disagree on dim 0"):
        OPS.linear_cross_entropy_dw_s(s, h[:3].contiguous(), y2, lse, g)
    with pytest.raises(ArgumentError, match="dw .*accumulator.* must be"):
        OPS.linear_cross_entropy_dw_s_acc(s, h, y2, lse, g, torch.zeros(10, 8, dtype=torch.bfloat16))


@pytest.mark.aot
@pytest.mark.parametrize("chip", ("v5e", "v6e", "tpu7x"))
@pytest.mark.parametrize("kind", ("fwd_s", "dh_s", "dw_s_acc"))
def test_compile_only_llama_chunk(chip, kind):
    """Mosaic + XLA:TPU compile the chunked kernels for one 1024-row chunk of the Llama-3-8B LM head at the
    configs a call gets (the heuristic: no shipped tuning entries for them)."""
    from tpukernels.bench import linear_cross_entropy as fam

    res = tk.compile_for(lce.KERNELS[kind], chip, *fam._chunk_args(kind, 1024), **fam._KW, with_mlir=False)
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 0)


def test_opcheck_chunked_kernels():
    """torch.library.opcheck (schema, fake kernel, autograd registration, aot) of the chunked kernel ops."""
    h, W, y = _data(12, 150, 24, torch.float32)
    y2, g = y.int().reshape(-1, 1), torch.rand(12, 1)
    _, lse, s = OPS.linear_cross_entropy_fwd_s(h, W, y2)
    torch.library.opcheck(OPS.linear_cross_entropy_fwd_s, (h, W, y2, -100, 7.0))
    torch.library.opcheck(OPS.linear_cross_entropy_dh_s, (s, W, y2, lse, g))
    torch.library.opcheck(OPS.linear_cross_entropy_dw_s_acc, (s, h, y2, lse, g, torch.randn(150, 24)))
