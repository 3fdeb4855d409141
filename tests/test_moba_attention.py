"""MoBA (tpukernels.library.moba_ops): forward and gradients against the dense float64 definition, the
routing by hand, the two limits (every chunk selected = causal attention, none = chunk-local causal), batch
isolation, typed errors, and compile-only checks of the masked kernels at MoBA's block shapes."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError, DTypeError
from tpukernels.library.moba_ops import (block_tables, moba_attention, moba_attention_reference,
                                               moba_block_indices)

#: (out, grads) absolute tolerances against the float64 reference of the same low-precision inputs.
TOL = {torch.float32: (3e-5, 1e-4), torch.bfloat16: (3e-2, 6e-2)}


def _qkv(B, T, Hq, Hkv, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, T, Hkv, Dv, generator=g).to(dtype)
    return q, k, v


def _check_against_reference(q, k, v, chunk_size, topk, scale, interpret):
    out_tol, grad_tol = TOL[q.dtype]
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = moba_attention(*leaves, chunk_size, topk, scale, interpret=interpret)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[3])
    wide = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref = moba_attention_reference(*wide, chunk_size, topk, scale)
    torch.testing.assert_close(out.double(), ref.detach(), atol=out_tol, rtol=0)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(q.dtype)
    got = torch.autograd.grad(out, leaves, do)
    want = torch.autograd.grad(ref, wide, do.double())
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == q.dtype, name
        torch.testing.assert_close(a.double(), b, atol=grad_tol, rtol=0, msg=lambda m: f"d{name}: {m}")


def test_forward_and_gradients_match_float64_reference(interpret, monkeypatch):
    """GQA 4/2, a short last chunk (T = 2 * 128 + 44), top-1, float32, with a table budget so small that the op
    runs two query chunk ranges ([0, 1) and [1, 3): the short last chunk joins the one before it) x four single
    heads (two per kv head): eight kernel calls whose gradients add up through autograd."""
    import tpukernels.library.moba_ops as M

    assert M.call_split(64, 4, 32, 4) == (8, 32)  # tokamax's defaults at T = 8192, 32 heads: 4 calls of 8 heads
    assert M.call_split(32, 8, 128, 4) == (2, 128)  # 32K tokens at chunk 256, GQA 8: part of a group per call
    assert M.call_split(32, 8, 400, 4) == (1, 64)  # 100K tokens: ranges of 64 query chunks, one head each
    assert M.call_split(4, 2, 3, 1, budget=9216) == (1, 3)
    assert M.call_split(4, 2, 3, 1, budget=6144) == (1, 1)
    with pytest.raises(ArgumentError, match="use a larger chunk_size"):
        M.call_split(8, 8, 600, 4)
    monkeypatch.setattr(M, "SMEM_TABLE_BUDGET", 6144)
    q, k, v = _qkv(1, 300, 4, 2, 32, 32, torch.float32)
    _check_against_reference(q, k, v, 128, 1, None, interpret)


@settings(max_examples=2)
@given(T=st.integers(1, 400), heads=st.sampled_from([(2, 2), (2, 1), (1, 1)]), topk=st.integers(0, 5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), dv=st.sampled_from([32, 64]), seed=st.integers(0, 99))
def test_shapes_dtypes_topk_match_reference(T, heads, topk, dtype, dv, seed):
    """Ragged T (any length, the last chunk shorter), top-k beyond the chunks there are, MHA / GQA / MQA,
    Dv != D, bf16 and f32."""
    q, k, v = _qkv(1, T, heads[0], heads[1], 32, dv, dtype, seed)
    _check_against_reference(q, k, v, 128, topk, 0.2, "tpu")


@pytest.mark.slow
@settings(max_examples=30)
@given(B=st.integers(1, 3), T=st.integers(1, 900), heads=st.sampled_from([(2, 2), (4, 1), (4, 2), (6, 3)]),
       topk=st.integers(0, 8), chunk=st.sampled_from([128, 256]), dtype=st.sampled_from([torch.float32,
                                                                                          torch.bfloat16]),
       seed=st.integers(0, 999))
def test_sweep_slow(B, T, heads, topk, chunk, dtype, seed):
    q, k, v = _qkv(B, T, heads[0], heads[1], 64, 64, dtype, seed)
    _check_against_reference(q, k, v, chunk, topk, None, "tpu")


def test_routing_by_hand():
    """Chunk means chosen so the ranking is known: query chunk 3's mean is e0; key chunk j's mean is
    (j + 1) e0 for j = 0, 1 and 0.5 e0 for j = 2, so top-2 of chunk 3 is [1, 0]; chunk 2 gets [1, 0] (both it
    has), chunk 1 gets [0, -1], chunk 0 nothing."""
    T, cs, D = 512, 128, 8
    q = torch.zeros(1, T, 1, D)
    k = torch.zeros(1, T, 1, D)
    q[..., 0] = 1.0
    for j, m in enumerate((1.0, 2.0, 0.5, 3.0)):
        k[0, j * cs:(j + 1) * cs, 0, 0] = m
    idx = moba_block_indices(q, k, chunk_size=cs, topk=2)
    assert idx.dtype == torch.int32 and idx.shape == (1, 1, 4, 2)
    assert idx[0, 0].tolist() == [[-1, -1], [0, -1], [1, 0], [1, 0]]
    # ties (all scores equal): lowest chunk first
    idx = moba_block_indices(torch.ones(1, T, 1, D), torch.ones(1, T, 1, D), chunk_size=cs, topk=2)
    assert idx[0, 0, 3].tolist() == [0, 1]


def test_tables_list_each_chunk_and_its_readers():
    """Forward lists: selected chunks ascending then the own chunk; backward lists: the query chunks reading a
    key chunk; past a list the last block repeats with kind 0; a short last chunk reads through mask block 1."""
    sel = torch.tensor([[[-1, -1], [0, -1], [0, 1]]], dtype=torch.int32)
    fwd, bwd = block_tables(sel, 3, tail=40, chunk_size=128)
    assert fwd[0, 0].tolist() == [[0, 0, 0], [0, 1, 1], [0, 1, 2]]
    assert fwd[1, 0].tolist() == [[1, 0, 0], [2, 1, 0], [1, 1, 1]]
    assert fwd[2, 0].tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert bwd.shape == (3, 1, 3, 3)  # the longest list (3 readers of chunk 0; a power of 2 but at most n)
    assert bwd[0, 0].tolist() == [[0, 1, 2], [1, 2, 2], [2, 2, 2]]
    assert bwd[1, 0].tolist() == [[1, 2, 1], [1, 1, 0], [1, 0, 0]]
    assert bwd[2, 0].tolist() == [[0, 0, 1], [0, 1, 1], [0, 0, 0]]
    _, bwd = block_tables(torch.tensor([[[-1], [0], [0], [0], [0]]], dtype=torch.int32), 5, 128, 128)
    assert bwd.shape[-1] == 5 and bwd[1, 0, 0].tolist() == [1, 2, 2, 2, 2]  # 5 readers of chunk 0
    _, bwd = block_tables(torch.tensor([[[-1], [0], [0], [1], [2]]], dtype=torch.int32), 5, 128, 128)
    assert bwd.shape[-1] == 4 and bwd[0, 0, 0].tolist() == [0, 1, 2, 2]  # 3 readers, rounded up to 4


def test_limits_causal_and_chunk_local(interpret):
    """topk >= chunks: every earlier chunk is read, i.e. plain causal attention (torch SDPA); topk = 0: each
    chunk only sees itself causally (SDPA per chunk). Independent of this module's reference."""
    q, k, v = _qkv(2, 256, 2, 1, 32, 32, torch.float32, 3)
    sd = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(moba_attention(q, k, v, 128, 5, interpret=interpret), sd(q, k, v), atol=3e-5, rtol=0)
    got = moba_attention(q, k, v, 128, 0, interpret=interpret)
    want = torch.cat([sd(q[:, s:s + 128], k[:, s:s + 128], v[:, s:s + 128]) for s in range(0, 256, 128)], 1)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=0)


def test_one_sequence_never_reads_another():
    """NaN in batch row 1's keys and values leaves row 0's output unchanged (the folded heads of one row read
    only that row's kv heads)."""
    q, k, v = _qkv(2, 256, 2, 1, 32, 32, torch.float32, 5)
    base = moba_attention(q, k, v, 128, 5, interpret="tpu")
    k2, v2 = k.clone(), v.clone()
    k2[1], v2[1] = math.nan, math.nan
    out = moba_attention(q, k2, v2, 128, 5, interpret="tpu")
    assert torch.equal(out[0], base[0])
    assert out[1].isnan().all()


def test_empty_inputs():
    q, k, v = _qkv(2, 0, 2, 1, 32, 16, torch.float32)
    out = moba_attention(q, k, v, 128, 2)
    assert out.shape == (2, 0, 2, 16)


@pytest.mark.parametrize("mutate, err, words", [
    (lambda a: dict(a, q=a["q"][0]), ArgumentError, "q must have rank 4"),
    (lambda a: dict(a, k=a["k"].to(torch.bfloat16)), DTypeError, "share one dtype"),
    (lambda a: {n: x.half() if isinstance(x, torch.Tensor) else x for n, x in a.items()}, DTypeError, "float16"),
    (lambda a: dict(a, k=a["k"][:, :, :1].expand(2, 256, 3, 32), v=a["v"][:, :, :1].expand(2, 256, 3, 32)),
     ArgumentError, "multiple of the kv heads"),
    (lambda a: dict(a, v=a["v"][:, :, :1]), ArgumentError, "same number of heads"),
    (lambda a: dict(a, v=a["v"][:, :128]), ArgumentError, "k and v must have q's [B, T]"),
    (lambda a: dict(a, k=a["k"][..., :16]), ArgumentError, "k head dim"),
    (lambda a: dict(a, chunk_size=64), ArgumentError, "chunk_size must be a positive multiple of 128"),
    (lambda a: dict(a, chunk_size=True), ArgumentError, "chunk_size"),
    (lambda a: dict(a, topk=-1), ArgumentError, "topk must be an int >= 0"),
    (lambda a: dict(a, topk=2.0), ArgumentError, "topk"),
    (lambda a: dict(a, scale=math.inf), ArgumentError, "scale must be a finite float"),
    (lambda a: dict(a, q=a["q"].numpy()), ArgumentError, "q must be a torch.Tensor"),
])
def test_bad_input_raises_typed_errors(mutate, err, words):
    q, k, v = _qkv(2, 256, 4, 2, 32, 32, torch.float32)
    args = mutate(dict(q=q, k=k, v=v, chunk_size=128, topk=2, scale=None))
    with pytest.raises(err, match="moba_attention: .*" + re.escape(words)):
        moba_attention(**args)


CHIPS = ("v5e", "v6e", "tpu7x")


@pytest.mark.aot
@pytest.mark.parametrize("chip", CHIPS)
def test_compile_only_moba_block_shapes(chip):
    """The masked forward, dQ and dK/dV kernels at tokamax's defaults (chunk 256, top-4) for T = 8192, 32 query
    heads / 8 kv heads, D = 128, bf16: one call of the split (tables of 8 heads: 5 forward steps, up to 32
    backward steps) fits the chip's scalar memory."""
    import tpukernels as tk
    from tpukernels.library.attention import fa_backward_dkv_masked, fa_backward_dq_masked, fa_forward_masked

    from tpukernels.library.moba_ops import call_split

    T, n = 8192, 32
    H, r = call_split(32, 4, n, 4)  # one call's heads (of 32 query / 8 kv heads, folded)
    assert r == n
    Hkv = H // 4
    tabs = (f"3x{H}x{n}x5:i32", f"3x{H}x{n}x{n}:i32")  # the backward lists at their longest
    qkv = (f"1x{H}x{T}x128:bf16", f"1x{Hkv}x{T}x128:bf16", f"1x{Hkv}x{T}x128:bf16")
    mbs = ("2x256x256:i8", "2x256x256:i8")
    r = tk.compile_for(fa_forward_masked, chip, *tabs, *qkv, *mbs, with_mlir=False, sm_scale=0.088, softcap=None)
    assert r.ok, r.error
    bwd = (f"1x{H}x{T}x128:bf16", f"1x{H}x1x{T}:f32", f"1x{H}x1x{T}:f32")
    for kern in (fa_backward_dq_masked, fa_backward_dkv_masked):
        r = tk.compile_for(kern, chip, *tabs, *qkv, *bwd, *mbs, with_mlir=False, sm_scale=0.088, softcap=None)
        assert r.ok, (kern, r.error)
