"""Per-(kv head, token) dequantization scales for int8 / fp8 paged KV caches (issue 36).

JAX's paged attention quantizes K/V with one scale per kv head and token (``QuantizedTensor``: int8 values,
scales ``[Hkv, P, page_size, 1]``, ``x = int8 * h / 127.5``). ``ragged_paged_attention`` takes those scales as
``k_scales`` / ``v_scales`` ``[num_pages, page_size, Hkv]`` (beside the per-slot ``[num_pages, page_size]``
layout): kv head ``g`` reads column ``g``. Checked against the float64 reference at bf16 queries (the case where a
dequantized tile rounded to bf16 fails JAX's tolerance), with heads of very different magnitudes so a kernel that
used another head's scale (or one scale per slot) is far off; and one sequence's NaN scale stays in its own rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError
from tpukernels.library import paged_attention as pa
from tpukernels.library import ragged_paged_attention

from test_paged_attention import TOL, batches, check, make_batch

MAX_INT8 = 127.5  # jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils
Q_LENS, KV_LENS = (3, 1, 5), (70, 45, 40)
CFG = {"block_q": 4, "pages_per_block": 2}


def _batch(Hq: int, Hkv: int, seed: int):
    """bf16 queries and a float K/V cache with kv head g scaled by 8**g (per-head scales then differ 8x)."""
    args = list(make_batch(Q_LENS, KV_LENS, S=3, T=12, Hq=Hq, Hkv=Hkv, ps=32, pps=3, P=10, seed=seed, D=128))
    mag = (8.0 ** torch.arange(Hkv, dtype=torch.float32)).repeat_interleave(2)  # combined heads 2g, 2g + 1
    args[1] = args[1] * mag[None, None, :, None]
    args[0] = args[0].nan_to_num(0.0).to(torch.bfloat16)
    return args


def _quantize(kv: torch.Tensor, per_head: bool):
    """JAX's ``quantize_to_int8`` per (slot, kv head) (or per slot, over all heads): int8 cache and float32 scales
    ``[P, ps, Hkv]`` for K and for V (or ``[P, ps]``). Unused slots (NaN) get NaN scales."""
    x = kv.nan_to_num(0.0)
    P, ps, H2, _ = x.shape
    kv4 = x.reshape(P, ps, H2 // 2, 2, -1)  # [P, ps, Hkv, K|V, D]
    h = kv4.abs().amax(-1) if per_head else kv4.abs().amax((-1, 2))[:, :, None, :].expand(P, ps, H2 // 2, 2)
    h = h.clamp_min(1e-6)
    q = torch.round(kv4 * (MAX_INT8 / h[..., None])).clamp(-128, 127).to(torch.int8)
    scales = (h / MAX_INT8).float()
    scales = torch.where(torch.isnan(kv[:, :, 0, 0])[:, :, None, None], float("nan"), scales)
    ks, vs = scales[..., 0], scales[..., 1]
    if not per_head:
        ks, vs = ks[..., 0].contiguous(), vs[..., 0].contiguous()
    return q.reshape(P, ps, H2, -1), ks.contiguous(), vs.contiguous()


@pytest.mark.parametrize("layout, r, soft_cap", [("head", 4, None), ("head", 8, 20.0), ("slot", 8, 20.0),
                                                  ("k_head_v_slot", 4, None)])
def test_int8_scales_per_head_or_slot_vs_float64(layout, r, soft_cap):
    """int8 cache + bf16 queries, scales per (slot, kv head) or per slot, vs the float64 reference within JAX's
    paged-attention tolerance (0.01 + 2%) at its sm_scale = 1."""
    Hkv = 2
    args = _batch(r * Hkv, Hkv, seed=r)
    float_cache = args[1]
    qh, ksh, vsh = _quantize(float_cache, per_head=True)
    qs, kss, vss = _quantize(float_cache, per_head=False)
    if layout == "head":
        args[1], kw = qh, dict(k_scales=ksh, v_scales=vsh)
    elif layout == "slot":
        args[1], kw = qs, dict(k_scales=kss, v_scales=vss)
    else:  # K per (slot, head), V per slot: each tensor's layout is its own
        kv = qh.clone()
        kv[:, :, 1::2] = qs[:, :, 1::2]
        args[1], kw = kv, dict(k_scales=ksh, v_scales=vss)
    out = ragged_paged_attention(*args, sm_scale=1.0, soft_cap=soft_cap, config=CFG, interpret="fast", **kw)
    ref = pa.paged_attention_reference(*args, sm_scale=1.0, soft_cap=soft_cap, **kw)
    n = sum(Q_LENS)
    torch.testing.assert_close(out[:n].double(), ref[:n], atol=1e-2, rtol=2e-2)
    assert (out[n:] == 0).all()
    # the reference reads the layout as the quantizer meant it: dequantized cache ~ the float cache (int8 rounding
    # only), so kernel and reference cannot share a misreading (at a small sm_scale: at sm_scale = 1 the logits of
    # the 8x head are ~100 wide and int8 rounding alone moves the softmax's argmax)
    deq = pa.paged_attention_reference(*args, sm_scale=0.02, **kw)
    ref_float = pa.paged_attention_reference(args[0], float_cache, *args[2:], sm_scale=0.02)
    assert (deq[:n] - ref_float[:n]).abs().max() < 0.02 * ref_float[:n].abs().max()
    if layout == "head":  # the probe discriminates: kv head 0's scale for every head is far off
        wrong = pa.paged_attention_reference(*args, sm_scale=1.0, soft_cap=soft_cap, k_scales=ksh[..., 0],
                                             v_scales=vsh[..., 0])
        assert (wrong[:n] - ref[:n]).abs().max() > 1.0


def test_per_head_scales_interpret_tpu_with_static_scales_and_sinks():
    """The "tpu" interpreter (uninitialized VMEM poisoned), static scales on top, sinks, a window."""
    Hkv, r = 2, 4
    args = _batch(r * Hkv, Hkv, seed=5)
    args[1], ks, vs = _quantize(args[1], per_head=True)
    kw = dict(k_scales=ks * 2, v_scales=vs / 4, k_scale=0.5, v_scale=4.0, sliding_window=33,
              sinks=torch.linspace(-1.0, 1.0, r * Hkv))
    out = ragged_paged_attention(*args, config=CFG, interpret="tpu", **kw)
    ref = pa.paged_attention_reference(*args, **kw)
    n = sum(Q_LENS)
    torch.testing.assert_close(out[:n].double(), ref[:n], atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("which", ["k_scales", "v_scales"])
def test_nan_head_scale_of_one_sequence_stays_in_its_rows(which):
    """A NaN per-(slot, head) scale at a used slot of sequence 1, kv head 1: NaN exactly where the float64
    reference has it (sequence 1's rows of the query heads of kv head 1); every other row matches it. block_q 4
    packs sequence 0 (3 rows) and sequence 1 (1 row) into one block."""
    Hkv, r = 2, 2
    args = _batch(r * Hkv, Hkv, seed=7)
    args[1], ks, vs = _quantize(args[1], per_head=True)
    kw = dict(k_scales=ks, v_scales=vs)
    kw[which][args[3][1, 0], 1, 1] = float("nan")  # sequence 1, its token 1 (visible to its only row), kv head 1
    out = ragged_paged_attention(*args, config=CFG, interpret="fast", **kw)
    ref = pa.paged_attention_reference(*args, **kw)
    n = sum(Q_LENS)
    nan_ref = torch.isnan(ref)
    assert nan_ref[3, 2:].all() and nan_ref.sum() == r * 128  # the probe poisons sequence 1's kv-head-1 rows only
    assert torch.equal(torch.isnan(out), nan_ref), "a NaN scale reached another sequence's (or head's) rows"
    torch.testing.assert_close(out[:n].double().nan_to_num(7.0), ref[:n].nan_to_num(7.0), atol=1e-2, rtol=2e-2)
    assert (out[n:] == 0).all()


@settings(max_examples=8)
@given(batch=batches(), k_layout=st.sampled_from(["head", "slot"]), v_layout=st.sampled_from(["head", "slot"]))
def test_ragged_batches_head_or_slot_scales_match_reference(batch, k_layout, v_layout):
    """Random ragged batches (decode, chunked prefill, prefill, empty sequences, num_seqs < S) with random
    positive scales per (slot, kv head) or per slot (NaN in unused slots) on an f32 cache: the scale semantics
    alone, at f32 tolerance (one compile per layout pair)."""
    q_lens, kv_lens, seed = batch
    args = make_batch(q_lens, kv_lens, S=4, T=16, Hq=4, Hkv=2, ps=4, pps=6, P=26, seed=seed)
    g = torch.Generator().manual_seed(seed)
    used = ~torch.isnan(args[1][:, :, 0, 0])
    kw = {}
    for name, layout in (("k_scales", k_layout), ("v_scales", v_layout)):
        t = torch.rand(26, 4, 2, generator=g) * 4 + 0.25
        t = t if layout == "head" else t[..., 0]
        kw[name] = torch.where(used if layout == "slot" else used[..., None], t, float("nan"))
    out = ragged_paged_attention(*args, config={"block_q": 8, "pages_per_block": 2}, interpret="fast", **kw)
    check(args, out, TOL[torch.float32], **kw)


def test_jax_entry_per_head_scales():
    import jax.numpy as jnp
    import numpy as np

    Hkv, r = 2, 2
    args = _batch(r * Hkv, Hkv, seed=9)
    args[1], ks, vs = _quantize(args[1], per_head=True)
    ja = [jnp.asarray(a.float().numpy()).astype(jnp.bfloat16) if i == 0 else jnp.asarray(a.numpy())
          for i, a in enumerate(args)]
    out = pa.ragged_paged_attention_jax(*ja, k_scales=jnp.asarray(ks.numpy()), v_scales=jnp.asarray(vs.numpy()),
                                        config=CFG, interpret="fast")
    ref = pa.paged_attention_reference(*args, k_scales=ks, v_scales=vs)
    n = sum(Q_LENS)
    torch.testing.assert_close(torch.from_numpy(np.array(out.astype(jnp.float32)))[:n].double(), ref[:n],
                               atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("kw, words", [
    (dict(k_scales=torch.ones(6, 4, 3), v_scales=torch.ones(6, 4, 2)), "k_scales must have shape .*\\(6, 4, 2\\)"),
    (dict(k_scales=torch.ones(6, 4, 2), v_scales=torch.ones(6, 4, 2, 1)), "v_scales must have shape"),
    (dict(k_scales=torch.ones(2, 6, 4), v_scales=torch.ones(2, 6, 4)), "k_scales must have shape"),  # JAX's head-major
    (dict(k_scales=torch.ones(6, 4, 2), v_scales=torch.ones(6, 8)), "v_scales must have shape"),
])
def test_bad_scale_shape_names_the_argument(kw, words):
    from test_paged_attention import _good

    with pytest.raises(ArgumentError, match=words):
        ragged_paged_attention(*_good(), **kw)


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only_per_head_scales(chip):
    """Mosaic (libtpu compile-only) compiles the per-(slot, kv head) scale pages: int8 on v6e, fp8 on tpu7x, with
    K per head and V per slot on v5e."""
    import tpukernels as tk

    S, pps, ps, P, T, Hkv = 8, 8, 16, 64, 8, 4
    kv = {"v5e": "i8", "v6e": "i8", "tpu7x": "float8_e4m3fn"}[chip]
    vs = f"{P}x{ps}x1:f32" if chip == "v5e" else f"{P}x{ps}x{Hkv}:f32"
    args = [f"{S}:i32", f"{S}x{pps}:i32", f"{S + 1}:i32", "1:i32", f"{T}x16x128:bf16", f"{P}x{ps}x{2 * Hkv}x128:{kv}",
            None, f"{P}x{ps}x{Hkv}:f32", vs]
    r = tk.compile_for(pa.rpa_kernel, chip, *args, with_mlir=False, sm_scale=None, sliding_window=None,
                       soft_cap=None, k_scale=None, v_scale=None)
    assert r.ok, r.error
