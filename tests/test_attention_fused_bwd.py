"""Fused flash attention backward (:data:`tpukernels.library.attention.fa_backward_fused`): gradients against
float64 autograd of the dense reference (from the same low-precision inputs) across the feature matrix, in the
NaN-poisoning "tpu" interpreter; equality with the split kernels; the mode choice and its fallback; Mosaic
compiles. Shapes are small and blocks of 128 force several blocks, tails, skipped and interior blocks.
"""

from __future__ import annotations

import pytest
import torch

import tpukernels as tk
from tpukernels.errors import ArgumentError
from tpukernels.library.attention import (attention_reference, fa_backward_dkv, fa_backward_dq, fa_backward_fused,
                                          fa_forward, flash_attention)
from tpukernels.library.attention import backward_fused as BF

from test_attention import TOL, make, segments  # noqa: E402  (tests/ is on sys.path)

B128 = dict(block_q=128, block_kv=128, block_kv_compute=128, block_h=1)
STATICS = dict(causal=False, causal_alignment="top_left", sm_scale=None, window_left=None, window_right=None,
               softcap=None)

CASES = {
    # id: (B, Hq, Hkv, Sq, Skv, D, Dv, dtype, statics, segments, config, lse_grad)
    "causal-gqa-tails": (1, 4, 2, 200, 300, 64, 64, torch.float32, dict(causal=True), 0, B128, False),
    "bottom-right-dv128-lse-grad": (1, 4, 2, 200, 300, 64, 128, torch.float32,
                                    dict(causal=True, causal_alignment="bottom_right"), 0, B128, True),
    "window-softcap-sq>skv": (2, 4, 2, 200, 150, 64, 64, torch.float32,
                              dict(window_left=40, window_right=10, softcap=3.0, sm_scale=0.2), 0, B128, False),
    "segments-causal-mqa": (2, 4, 1, 150, 130, 64, 64, torch.float32, dict(causal=True), 3, B128, False),
    "block_h-2-window-d96": (1, 4, 1, 256, 256, 96, 96, torch.float32, dict(window_left=100, window_right=0), 0,
                             dict(B128, block_h=2), False),
    "d192-dv128-bf16-causal": (1, 2, 1, 256, 256, 192, 128, torch.bfloat16, dict(causal=True), 0, B128, False),
    "compute-subblocks-bf16": (1, 2, 2, 200, 300, 80, 80, torch.bfloat16, dict(causal=True), 0,
                               dict(block_q=128, block_kv=256, block_kv_compute=128, block_h=1), False),
    "f32-block_q-64-segments-block_h-2": (1, 4, 2, 200, 230, 64, 64, torch.float32, dict(causal=True), 3,
                                          dict(block_q=64, block_kv=128, block_kv_compute=128, block_h=2), False),
    "decode-fold-sq8": (2, 8, 2, 8, 300, 64, 64, torch.float32, dict(causal=True, causal_alignment="bottom_right"),
                        0, B128, False),
}
#: 1024-blocks split into 512-sub-blocks (each skipped / mask-free / masked on its own): minutes on cpu
SLOW = {
    "subblock-split-causal": (1, 2, 1, 1100, 1100, 64, 64, torch.float32, dict(causal=True), 0,
                              dict(block_q=1024, block_kv=1024, block_kv_compute=512, block_h=1), False),
}


def _inputs(case, table):
    B, Hq, Hkv, Sq, Skv, D, Dv, dtype, st, nseg, cfg, lse_grad = table[case]
    q, k, v = make(B, Hq, Hkv, Sq, Skv, D, dtype, Dv=Dv, seed=len(case))
    q, k, v = q.detach(), k.detach(), v.detach()
    qs = ks = None
    if nseg:
        qs, ks = segments(B, Sq, nseg, 1).int().unsqueeze(1), segments(B, Skv, nseg, 2).int().unsqueeze(1)
    statics = dict(STATICS, **st)
    out, lse = fa_forward(q, k, v, qs, ks, **statics, config=cfg)
    g = torch.Generator().manual_seed(7)
    do = torch.randn(out.shape, generator=g).to(dtype)
    dl = torch.randn(lse.shape, generator=g) if lse_grad else None
    di = (do.float() * out.float()).sum(-1).unsqueeze(2)
    if dl is not None:
        di = di - dl
    return q, k, v, qs, ks, statics, cfg, lse, do, dl, di


def _reference_grads(q, k, v, qs, ks, statics, do, dl):
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = attention_reference(q64, k64, v64, causal=statics["causal"],
                                   causal_alignment=statics["causal_alignment"], sm_scale=statics["sm_scale"],
                                   window=(statics["window_left"], statics["window_right"]),
                                   softcap=statics["softcap"], q_segment_ids=None if qs is None else qs[:, 0],
                                   kv_segment_ids=None if ks is None else ks[:, 0], dtype=torch.float64)
    outs, gos = [out], [do.double()]
    if dl is not None:
        outs.append(lse)
        gos.append(torch.where(torch.isfinite(lse), dl[:, :, 0].double(), 0.0))
    return torch.autograd.grad(outs, (q64, k64, v64), gos)


def _check(case, table=CASES):
    q, k, v, qs, ks, statics, cfg, lse, do, dl, di = _inputs(case, table)
    dq, dk, dv = fa_backward_fused(q, k, v, do, lse, di, qs, ks, **statics, config=cfg)
    Sq = q.shape[2]
    assert dq.dtype == torch.float32 and dq.shape == (*q.shape[:2], -(-Sq // 8) * 8, q.shape[3])
    assert dk.dtype == k.dtype and dv.dtype == v.dtype and dk.shape == k.shape and dv.shape == v.shape
    dq = dq[:, :, :Sq]
    ga, gr = TOL[q.dtype][1]
    for name, a, r in zip("qkv", (dq, dk, dv), _reference_grads(q, k, v, qs, ks, statics, do, dl)):
        assert not a.isnan().any(), f"d{name} has NaN"
        torch.testing.assert_close(a.double(), r, atol=ga, rtol=gr, msg=lambda m, n=name: f"d{n}: {m}")
    return q, k, v, qs, ks, statics, cfg, lse, do, di, (dq, dk, dv)


#: checked against float64 by test_fused_equals_split (make test), the rest here (make test: FAST)
EQUAL = ("causal-gqa-tails", "window-softcap-sq>skv", "d192-dv128-bf16-causal")
FAST = ("segments-causal-mqa", "f32-block_q-64-segments-block_h-2")


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES if c not in EQUAL])
def test_fused_gradients_match_float64_tpu_mode(case):
    with tk.interpret_mode("tpu"):
        _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW))
def test_fused_gradients_match_float64_sub_block_split(case):
    with tk.interpret_mode("tpu"):
        _check(case, SLOW)


@pytest.mark.parametrize("case", [c if c != "causal-gqa-tails" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in EQUAL])
def test_fused_equals_split(case):
    """Same config, same dS tiles: dK / dV are the split dK/dV kernel's computation (bit-equal), dQ sums the
    same per-block products (f32; bf16 rounds dS before both). The two dQ sums are f32 dots of different
    orientation (dS^T K here, dS K there), whose accumulation order XLA:CPU picks per shape and per CPU: a bf16
    dQ may then round to the neighbouring value (3 of 98,304 elements on an AMD EPYC, none on the Intel Xeon
    of earlier runs), so bf16 is held to one ulp on at most 0.1% of the elements (an indexing or masking bug
    moves far more, by far more)."""
    with tk.interpret_mode("tpu"):
        q, k, v, qs, ks, statics, cfg, lse, do, di, (dq, dk, dv) = _check(case)
        dq2 = fa_backward_dq(q, k, v, do, lse, di, qs, ks, **statics, config=cfg)
        dk2, dv2 = fa_backward_dkv(q, k, v, do, lse, di, qs, ks, **statics, config=cfg)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)
    a, b = dq.to(q.dtype).float(), dq2.float()
    if q.dtype != torch.bfloat16:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        return
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)  # bf16: 8 significant bits
    diff = (a - b).abs()
    assert (diff <= ulp).all(), f"dQ differs by more than one bf16 ulp: max {float((diff / ulp).max()):.1f} ulp"
    assert (diff > 0).float().mean() <= 1e-3, f"{int((diff > 0).sum())} of {diff.numel()} dQ elements differ"


def _grads(q, k, v, mode, monkeypatch, **kw):
    monkeypatch.setenv(BF.ENV, mode)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = flash_attention(q, k, v, **kw)
    g = torch.Generator().manual_seed(3)
    wrt = (q, k, v) + ((kw["sinks"],) if "sinks" in kw else ())
    return out, torch.autograd.grad(out, wrt, torch.randn(out.shape, generator=g).to(out.dtype))


def test_flash_attention_backward_runs_fused_and_matches_split(monkeypatch):
    """The autograd backward takes the fused kernel when asked (a spy counts its calls), with the sinks'
    gradient through d lse, and gives the split kernels' gradients; ``split`` forces the split kernels."""
    calls = []
    real = BF.fa_backward_fused
    monkeypatch.setattr(BF, "fa_backward_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = make(1, 4, 2, 200, 200, 64, torch.float32, seed=5)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    kw = dict(causal=True, sinks=sinks, interpret="tpu")
    _, fused = _grads(q, k, v, "fused", monkeypatch, **kw)
    assert len(calls) == 1
    _, split = _grads(q, k, v, "split", monkeypatch, **kw)
    assert len(calls) == 1
    for a, b in zip(fused, split):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # and the sinks' gradient is right: float64 reference with the sinks in the softmax denominator
    q64, k64, v64, s64 = (x.detach().double().requires_grad_() for x in (q, k, v, sinks))
    ref, _ = attention_reference(q64, k64, v64, causal=True, sinks=s64, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    r = torch.autograd.grad(ref, (q64, k64, v64, s64), torch.randn(ref.shape, generator=g).double())
    for a, b in zip(fused, r):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=5e-5)


def test_mode_choice_and_fallback(monkeypatch):
    """``backward_mode``: the env var forces a mode; fused falls back to split with the reason for cases it
    refuses (empty Skv, decode fold with Sq % 8, resident dQ over DQ_VMEM_MAX); a bad value is a typed error."""
    q, k, v = make(1, 4, 2, 200, 300, 64, torch.float32)
    monkeypatch.setenv(BF.ENV, "split")
    assert BF.backward_mode(q, k, v, None, STATICS)[0] == "split"
    monkeypatch.setenv(BF.ENV, "fused")
    assert BF.backward_mode(q, k, v, None, STATICS) == ("fused", f"{BF.ENV}=fused")
    mode, why = BF.backward_mode(q, k[:, :, :0], v[:, :, :0], None, STATICS)
    assert mode == "split" and "empty" in why
    mode, why = BF.backward_mode(q[:, :, :3], k, v, None, STATICS)  # Sq = 3 <= 16: the group folds into rows
    assert mode == "split" and "decode fold" in why
    big = torch.empty(1, 8, 40000, 128)
    mode, why = BF.backward_mode(big, big[:, :1], big[:, :1], None, STATICS)
    assert mode == "split" and "DQ_VMEM_MAX" in why
    mid = torch.empty(1, 1, 8192, 128)  # 4 MiB of resident dQ: fits v6e, not a quarter of v4's 14 MiB
    for chip, want in (("v6e", "fused"), ("v4", "split")):
        monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", chip)
        assert BF.backward_mode(mid, mid, mid, None, STATICS)[0] == want, chip
    monkeypatch.delenv("TPUKERNELS_TARGET_CHIP")
    monkeypatch.setenv(BF.ENV, "sometimes")
    with pytest.raises(ArgumentError, match=BF.ENV):
        BF.backward_mode(q, k, v, None, STATICS)
    monkeypatch.delenv(BF.ENV)
    assert BF.backward_mode(q, k, v, None, STATICS) == ("split", "no target chip")
    for chip, fused in BF.FUSED_BY_CHIP.items():
        monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", chip)
        assert BF.backward_mode(q, k, v, None, STATICS)[0] == ("fused" if fused else "split")
    with pytest.raises(ArgumentError, match="decode fold"):  # the kernel itself refuses with the reason
        with tk.interpret_mode("tpu"):
            x = q[:, :, :3]
            fa_backward_fused(x, k, v, x, torch.zeros(1, 4, 1, 3), torch.zeros(1, 4, 1, 3), **STATICS)


@pytest.mark.slow
def test_refused_cases_still_get_gradients(monkeypatch):
    """A refused call (decode fold, Sq = 3) under ``fused`` runs the split kernels: right gradients, no error."""
    monkeypatch.setenv(BF.ENV, "fused")
    q, k, v = make(1, 4, 2, 3, 150, 64, torch.float32, seed=2)
    _, got = _grads(q, k, v, "fused", monkeypatch, causal=True, causal_alignment="bottom_right", interpret="tpu")
    _, want = _grads(q, k, v, "split", monkeypatch, causal=True, causal_alignment="bottom_right", interpret="tpu")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_torch_compile_fullgraph_backward_fused(monkeypatch):
    """Under ``torch.compile(fullgraph=True)`` the backward takes the fused kernel too, same gradients as eager."""
    monkeypatch.setenv(BF.ENV, "fused")
    calls = []
    real = BF.fa_backward_fused
    monkeypatch.setattr(BF, "fa_backward_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = make(1, 4, 2, 48, 80, 64, torch.float32, seed=8)

    def f(q, k, v):
        return (flash_attention(q, k, v, causal=True, causal_alignment="bottom_right") * 2).sum()

    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    assert len(calls) == 1
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v))
    assert len(calls) == 2
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


STD = ("1x32x4096x128:bf16", "1x8x4096x128:bf16", "1x8x4096x128:bf16", "1x32x4096x128:bf16", "1x32x1x4096:f32",
       "1x32x1x4096:f32")


@pytest.mark.aot
@pytest.mark.parametrize("chip", [pytest.param("v5e", marks=pytest.mark.slow), "v6e",
                                  pytest.param("tpu7x", marks=pytest.mark.slow)])
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_compiles_for_chip(chip, causal):
    """B=1, Hq=32, Hkv=8, S=4096, D=128 bf16 (the standard shape): the fused kernel compiles with Mosaic at its
    dispatch config within its scoped-VMEM request."""
    res = tk.compile_for(fa_backward_fused, chip, *STD, with_mlir=False, **dict(STATICS, causal=causal))
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= res.vmem_limit_bytes


@pytest.mark.aot
@pytest.mark.slow
def test_compiles_features():
    """Segments + window + soft-cap + bottom-right (GQA folded heads), D=192 / Dv=128, float32 block_q=64."""
    st = dict(STATICS, causal=True, causal_alignment="bottom_right", window_left=512, softcap=30.0)
    r = tk.compile_for(fa_backward_fused, "v6e", "2x16x1000x128:bf16", "2x4x1000x128:bf16", "2x4x1000x128:bf16",
                       "2x16x1000x128:bf16", "2x16x1x1000:f32", "2x16x1x1000:f32", "2x1x1000:i32", "2x1x1000:i32",
                       with_mlir=False, config=dict(block_q=256, block_kv=512, block_kv_compute=256, block_h=2), **st)
    assert r.ok, r.summary()
    r = tk.compile_for(fa_backward_fused, "tpu7x", "1x8x2048x192:bf16", "1x2x2048x192:bf16", "1x2x2048x128:bf16",
                       "1x8x2048x128:bf16", "1x8x1x2048:f32", "1x8x1x2048:f32", with_mlir=False,
                       **dict(STATICS, causal=True))
    assert r.ok, r.summary()
    r = tk.compile_for(fa_backward_fused, "v6e", "1x4x1000x128:f32", "1x2x1000x128:f32", "1x2x1000x128:f32",
                       "1x4x1000x128:f32", "1x4x1x1000:f32", "1x4x1x1000:f32", with_mlir=False,
                       config=dict(block_q=64, block_kv=256, block_kv_compute=256, block_h=2), **dict(STATICS, causal=True))
    assert r.ok, r.summary()
