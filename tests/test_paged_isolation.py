"""One sequence's K/V (or per-token scales) never reach another sequence's rows of a ragged paged batch.

A NaN at a *used* slot of sequence 1 must give NaN only in sequence 1's rows (as the float64 reference does);
sequence 0's rows and the padding rows stay exact, for every block_q that packs both sequences into one block.
"""

from __future__ import annotations

import pytest
import torch

from tpukernels.library import paged_attention as pa
from tpukernels.library import ragged_paged_attention

from test_paged_attention import make_batch

Q_LENS, KV_LENS = (1, 5), (7, 9)


def _poisoned(where: str):
    args = list(make_batch(Q_LENS, KV_LENS, S=2, T=8, Hq=2, Hkv=1, ps=4, pps=3, P=6, seed=3, D=32))
    kv, pages = args[1], args[3]
    kw = {}
    if where == "v_scale":
        kw = dict(k_scales=torch.ones(kv.shape[:2]), v_scales=torch.ones(kv.shape[:2]))
        kw["v_scales"][pages[1, 0], 1] = float("nan")  # sequence 1, token 1 (used, visible to its rows)
    else:
        kv[pages[1, 0], 1, 1 if where == "v" else 0] = float("nan")
    return args, kw


@pytest.mark.parametrize("where", ["v", "k", "v_scale"])
@pytest.mark.parametrize("block_q", [4, 8])
def test_nan_in_one_sequence_stays_in_it(where, block_q):
    args, kw = _poisoned(where)
    out = ragged_paged_attention(*args, config={"block_q": block_q, "pages_per_block": 2}, interpret="fast", **kw)
    ref = pa.paged_attention_reference(*args, **kw)
    q0 = Q_LENS[0]
    n = sum(Q_LENS)
    assert torch.isnan(ref[q0:n]).any() and not torch.isnan(ref[:q0]).any()  # the probe does poison sequence 1
    assert not torch.isnan(out[:q0]).any(), "sequence 0 read sequence 1's K/V"
    torch.testing.assert_close(out[:q0].double(), ref[:q0], atol=2e-5, rtol=2e-5)
    assert (out[n:] == 0).all(), "padding rows read a sequence's K/V"


def _int8_batch(r: int, seed: int):
    """bf16 queries over an int8 cache with per-token scales (JAX's paged-attention test: one kv head, r q heads
    per kv head, page 32, D=128): K/V dequantize to unit-scale values."""
    g = torch.Generator().manual_seed(seed)
    args = list(make_batch((3, 1), (70, 45), S=2, T=8, Hq=r, Hkv=1, ps=32, pps=3, P=6, seed=seed, D=128))
    kv = args[1].nan_to_num(0.0)
    amax = kv.abs().amax(-1).clamp_min(1e-3)  # [P, ps, 2]
    qkv = torch.round(kv / amax[..., None] * 127).clamp(-127, 127).to(torch.int8)
    scales = (amax / 127).float()
    args[0] = args[0].nan_to_num(0.0).to(torch.bfloat16)
    args[1] = qkv
    return args, dict(k_scales=scales[..., 0].contiguous(), v_scales=scales[..., 1].contiguous())


@pytest.mark.parametrize("r, soft_cap", [(4, None), (8, 20.0)])
def test_int8_cache_bf16_queries_dequantize_in_f32(r, soft_cap):
    """Dequantized K/V are not rounded to bf16 before the matmuls: int8 cache + bf16 queries match the float64
    reference within JAX's own paged-attention tolerance (0.01 + 2%), at JAX's default sm_scale = 1 (logits of
    std ~11, where a bf16-rounded K is off by ~0.05 in the logits)."""
    args, kw = _int8_batch(r, seed=r)
    out = ragged_paged_attention(*args, sm_scale=1.0, soft_cap=soft_cap, config={"block_q": 4, "pages_per_block": 2},
                                 interpret="fast", **kw)
    ref = pa.paged_attention_reference(*args, sm_scale=1.0, soft_cap=soft_cap, **kw)
    n = 4
    torch.testing.assert_close(out[:n].double(), ref[:n], atol=1e-2, rtol=2e-2)
