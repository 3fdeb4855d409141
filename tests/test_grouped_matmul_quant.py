"""Quantized experts in the grouped matmul (``grouped_matmul_quantized``; issue 28, item 2): int8 / fp8 with
per-channel or block scales, int4 (zero points or not) / fp4 packed two per byte along K, both rhs layouts.

Accuracy criterion (the module docstring's bounds, :mod:`tpukernels.library.grouped_matmul_ops.quant`), elementwise
against float64 products of the **dequantized** experts computed from the stored low-precision tensors:

* forward ``|y - ref| <= u |ref| + (K_w + 2) u32 (|x| @ M_g^T)`` on the rows of group ``g``
  (``M_g = (|q'| + |z'|) |s|``, ``u`` the output dtype's unit roundoff, ``u32 = 2^-24``), and exactly 0 on rows of
  no local group (the bound is 0 there);
* ``d_lhs`` ``|d - ref| <= u |ref| + (u_g + u32) (|dO| @ |W_g|) + (2 N + 2) u32 (|dO| @ M_g)``.

A wrong scale, zero point, nibble order, group row range or K block shifts elements by about a grid step of the
weight times ``|x|``, orders of magnitude above these bounds.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tpukernels.library  # noqa: F401
from tpukernels.errors import ArgumentError, ChipError, DTypeError

gq = importlib.import_module("tpukernels.library.grouped_matmul_ops.quant")
qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")
CFG = dict(bm=16, bk=128, bn=128)  # small blocks: several row tiles, K steps and N blocks at test shapes


def _case(fmt, bs, G, N, K, transpose_rhs, asym, seed):
    """Experts ``[G, N, K]`` quantized with this library's quantizers (per channel when ``bs`` is None)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(G, N, K, generator=g) * (1 + 3 * torch.rand(G, N, 1, generator=g))
    base = "int8" if fmt.startswith("float8") else fmt
    rhs, s, z = gq.quantize_experts(w, bs, base if bs is not None else fmt, asymmetric=asym,
                                    transpose_rhs=transpose_rhs)
    if fmt.startswith("float8") and bs is not None:  # block-scaled fp8: int8 grid / 4, exact in both fp8 dtypes
        rhs = (rhs.float() / 4).to(getattr(torch, fmt))
    return rhs, s, z


def _check_fwd_bwd(x, rhs, gs, s, z, tr, fmt, go=None, cfg=CFG, out_dtype=None):
    wf = "fp4" if fmt == "fp4" else None
    x = x.detach().clone().requires_grad_(True)
    kw = dict(transpose_rhs=tr, group_offset=go, weight_format=wf)
    y = gq.grouped_matmul_quantized(x, rhs, gs, s, rhs_zero_point=z, config=cfg, out_dtype=out_dtype, **kw)
    ref = gq.reference_quantized(x.detach(), rhs, gs, s, z, **kw)
    bound = gq.error_bound_quantized(x.detach(), rhs, gs, s, z, out_dtype=out_dtype, **kw)
    assert y.shape == ref.shape and y.dtype == (out_dtype or x.dtype)
    bad = (y.double() - ref).abs() > bound
    assert not bad.any(), f"forward: {int(bad.sum())} elements outside the bound"
    dO = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.dtype)
    with pytest.MonkeyPatch.context() as mp:  # the backward's d_lhs kernel at small blocks too (N tails, K blocks)
        mp.setattr(gq.grouped_matmul_quant_dx, "heuristic", lambda *a, **k: dict(CFG))
        y.backward(dO)
    K = x.shape[1]
    d_ref = gq.reference_quantized_dx(dO.to(x.dtype), rhs, gs, s, z, K=K, **kw)
    d_bound = gq.error_bound_quantized_dx(dO.to(x.dtype), rhs, gs, s, z, K=K, **kw)
    assert x.grad.shape == x.shape
    bad = (x.grad.double() - d_ref).abs() > d_bound
    assert not bad.any(), f"d_lhs: {int(bad.sum())} elements outside the bound"


@st.composite
def _sizes(draw):
    G = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, 23), min_size=G, max_size=G))
    slack = draw(st.integers(0, 9))
    return sizes, sum(sizes) + slack


@given(gm=_sizes(), N=st.integers(1, 200), nb=st.integers(1, 3),
       spec=st.sampled_from([("int8", None), ("float8_e5m2", None), ("int8", 64), ("float8_e4m3fn", 32),
                             ("int4", 64), ("fp4", 32), ("int4", None)]),
       tr=st.booleans(), asym=st.booleans(), pad=st.integers(0, 31), f32=st.booleans())
@settings(max_examples=1, deadline=None)  # + 2 explicit examples; each compiles two kernels (~8 s on one core)
@example(gm=([17, 0, 30], 50), N=136, nb=2, spec=("int4", 64), tr=False, asym=True, pad=10, f32=False)
@example(gm=([5, 0, 0, 40], 53), N=130, nb=3, spec=("int8", None), tr=True, asym=False, pad=0, f32=True)
def test_quantized_experts_within_bound(gm, N, nb, spec, tr, asym, pad, f32):
    """Every weight format and scale layout, both rhs layouts, ragged groups (empty ones, boundaries inside the
    16-row tiles, ``sum(group_sizes) < M``), N tails, K padded by the rule (block scales), bf16 and f32 lhs:
    forward and ``d_lhs`` (autograd) within the bounds."""
    (sizes, M), (fmt, bs) = gm, spec
    K = (bs or 128) * nb
    pad = pad % bs if bs else 0
    rhs, s, z = _case(fmt, bs, len(sizes), N, K, tr, asym and fmt == "int4" and bs is not None, seed=M + N + nb)
    x = torch.randn(M, K - pad, generator=torch.Generator().manual_seed(M))
    x = x.to(torch.float32 if f32 else torch.bfloat16)
    _check_fwd_bwd(x, rhs, torch.tensor(sizes, dtype=torch.int32), s, z, tr, fmt)


@pytest.mark.parametrize("interpret", ["tpu"], indirect=True)  # the "fast" mode is the hypothesis test's
def test_quantized_experts_nan_poisoned_interpret(interpret, monkeypatch):
    """NaN-poisoned interpret mode ("tpu": uninitialised VMEM / output memory holds NaN): a shard
    (``group_offset``) whose first and last groups' rows are zero, a group boundary inside a tile, an empty group,
    a K tail (per-channel scales, ``bk`` not dividing K) in the forward and an N tail in ``d_lhs`` (``bn=128``), with
    fp8 weights (an int8 tile's out-of-range garbage is finite and meets zeros; fp8 garbage may be NaN, so dropping
    either operand's tail mask fails here); the scale given as ``[G, N]``; the weight side requires grad, gets None.
    The target chip is tpu7x, whose MXU takes ``(bfloat16, float8_e4m3fn)`` natively (jax's tpu_info), so the fp8
    tile goes to the dots unconverted (the native feed)."""
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "tpu7x")
    from tpukernels.library.quantized_matmul_ops.common import native_fp8

    assert native_fp8("bfloat16", "float8_e4m3fn")
    G, N, K = 3, 200, 320
    rhs, s, _ = _case("float8_e4m3fn", None, G, N, K, True, False, seed=3)
    s = s.reshape(G, N).clone().requires_grad_(True)
    sizes = torch.tensor([6, 11, 0, 25, 4], dtype=torch.int32)  # global groups; the shard holds 1..3
    x = torch.randn(50, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    _check_fwd_bwd(x, rhs, sizes, s.reshape(G, N), None, True, "float8_e4m3fn", go=1,
                   cfg=dict(bm=16, bk=256, bn=128), out_dtype=torch.float32)
    assert s.grad is None


def _bad(match, exc=ArgumentError, **over):
    rhs, s, z = _case("int4", 64, 2, 128, 256, True, True, seed=0)
    args = dict(lhs=torch.zeros(8, 256, dtype=torch.bfloat16), rhs=rhs,
                group_sizes=torch.tensor([3, 5], dtype=torch.int32), rhs_scale=s, rhs_zero_point=z, transpose_rhs=True)
    args.update(over)
    with pytest.raises(exc, match=match):
        gq.grouped_matmul_quantized(args.pop("lhs"), args.pop("rhs"), args.pop("group_sizes"), args.pop("rhs_scale"),
                                    **args)


def test_bad_inputs_raise_typed_errors_naming_the_tensor(monkeypatch):
    """Each raises before any kernel runs, naming the tensor and the rule."""
    rhs, s, z = _case("int4", 64, 2, 128, 256, True, True, seed=0)
    _bad(r"rhs_scale must have shape \[G, num_blocks, 1, N\]", rhs_scale=s[:, :, :, :100])
    _bad(r"rhs_scale must have shape", rhs_scale=s[:1])
    _bad(r"rhs_scale has num_blocks = 3 .* K_w = 256", rhs_scale=torch.ones(2, 3, 1, 128), rhs_zero_point=None)
    _bad(r"block size K_w / num_blocks = 256 / 16 = 16 is not a multiple of 32", rhs_scale=torch.ones(2, 16, 1, 128),
         rhs_zero_point=None)
    _bad(r"127 bytes along K.*odd or partial packed block", rhs=rhs[:, :, :127].contiguous(),
         lhs=torch.zeros(8, 254, dtype=torch.bfloat16), rhs_scale=torch.ones(2, 2, 1, 128), rhs_zero_point=None)
    _bad(r"rhs_zero_point must have rhs_scale's shape", rhs_zero_point=z[:, :1])
    _bad(r"rhs_zero_point is for int4", rhs=torch.zeros(2, 128, 256, dtype=torch.int8))
    _bad(r"lhs has K = 190 columns but rhs holds K_w = 256", lhs=torch.zeros(8, 190, dtype=torch.bfloat16))
    _bad(r"rhs_scale must be float32", DTypeError, rhs_scale=s.to(torch.bfloat16))
    _bad(r"lhs dtype float16", DTypeError, lhs=torch.zeros(8, 256, dtype=torch.float16))
    _bad(r"rhs dtype int32 is not one of", DTypeError, rhs=torch.zeros(2, 128, 256, dtype=torch.int32),
         rhs_zero_point=None)
    _bad(r"sum\(group_sizes\) = 9 exceeds", group_sizes=torch.tensor([4, 5], dtype=torch.int32))
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v5e")  # jax's tpu_info: v5e's MXU takes no float8_e4m3fn
    f8, s8, _ = _case("float8_e4m3fn", None, 2, 128, 256, True, False, seed=1)
    _bad(r"float8_e4m3fn .* not supported on v5e", ChipError, rhs=f8, rhs_scale=s8, rhs_zero_point=None)


def test_quantize_moe_experts_refuses_what_it_cannot_do():
    """Typed errors before touching the model: 4-bit without a block size, a block size not dividing a projection's
    K, block-scaled fp8 (the blockwise quantizer has no fp8 grid), a model without experts."""
    pytest.importorskip("transformers")
    from tpukernels.integrations.moe import quantize_moe_experts
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    model = MixtralForCausalLM(cfg)
    with pytest.raises(ArgumentError, match="int4 weights need a block_size"):
        quantize_moe_experts(model, dtype="int4")
    with pytest.raises(ArgumentError, match="gate_up_proj has K = 64 in-features, not a multiple of block_size = 128"):
        quantize_moe_experts(model, dtype="int8", block_size=128)
    with pytest.raises(DTypeError, match="block scales take dtype int8, int4 or fp4"):
        quantize_moe_experts(model, dtype="float8_e4m3fn", block_size=32)
    with pytest.raises(ArgumentError, match="no 3-D experts modules"):
        quantize_moe_experts(torch.nn.Linear(4, 4))
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, torch.nn.Parameter)  # untouched


def test_zero_rows_and_padding_rule_without_kernel():
    """``M = 0`` returns ``[0, N]`` without a kernel; ``pack_int4_experts`` is ``pack_int4`` per expert in both
    layouts (the non-transposed one is its transpose)."""
    rhs, s, z = _case("int4", 64, 2, 128, 256, True, True, seed=0)
    y = gq.grouped_matmul_quantized(torch.zeros(0, 256, dtype=torch.bfloat16), rhs,
                                    torch.zeros(2, dtype=torch.int32), s, rhs_zero_point=z, transpose_rhs=True)
    assert y.shape == (0, 128)
    q = torch.randint(0, 16, (2, 128, 256), generator=torch.Generator().manual_seed(0))
    a = gq.pack_int4_experts(q, 64, transpose_rhs=True)
    b = gq.pack_int4_experts(q.transpose(1, 2), 64, transpose_rhs=False)
    assert torch.equal(a[1], qmm.pack_int4(q[1], 64)) and torch.equal(b, a.transpose(1, 2))


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
@pytest.mark.parametrize("kernel, args", [
    # d_lhs of int4 [G, K/2, N] (nibble halves sliced along sublanes of the unpacked int32 tile), Mixtral up
    # projection's weights, 2048 rows (the forward's lane-sliced [G, N, K/2] unpack is the blockwise kernel's,
    # compile-checked there; every format / layout / direction compiled on all three chips when written)
    ("grouped_matmul_quant_dx", ("8:i32", "1:i32", "2048x14336:bf16", "8x2048x14336:u8", "8x32x1x14336:f32", None,
                                 False)),
], ids=["dx-int4"])
def test_compile_only_quantized_experts(chip, kernel, args):
    """Mosaic + XLA:TPU compile the heuristic blocks (libtpu compile-only; the scoped VMEM request covers them)."""
    import tpukernels as tk

    res = tk.compile_for(getattr(gq, kernel), chip, *args, with_mlir=False)
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 32 * 2**20)


def _quantized_mixtral():
    """A tiny HF Mixtral with int4 experts (zero points, 32-column blocks) and its twin running stock
    transformers' eager experts whose weights are the (float64-exact, float32-representable) dequantized ones."""
    import copy

    pytest.importorskip("transformers")
    from tpukernels.integrations.moe import quantize_moe_experts
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)
    torch.manual_seed(0)
    float_model = MixtralForCausalLM(cfg).eval()
    ours = copy.deepcopy(float_model)
    assert quantize_moe_experts(ours, dtype="int4", block_size=32, asymmetric=True) == [
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    stock = copy.deepcopy(float_model)
    stock.config._experts_implementation = "eager"
    for (_, e), (_, q) in zip(((n, m) for n, m in stock.named_modules() if n.endswith("experts")),
                              ((n, m) for n, m in ours.named_modules() if n.endswith("experts"))):
        assert e.gate_up_proj is not None and q.gate_up_proj is None and q.gate_up_proj_q.dtype == torch.uint8
        for proj in ("gate_up_proj", "down_proj"):
            W = gq.dequantize_experts(getattr(q, f"{proj}_q"), getattr(q, f"{proj}_scale"),
                                      getattr(q, f"{proj}_zero_point"), transpose_rhs=True)
            getattr(e, proj).data.copy_(W.float())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return float_model, stock, ours, ids


def test_moe_quantized_experts_match_dequantized_mixtral():
    """``quantize_moe_experts`` on a tiny HF Mixtral (:func:`_quantized_mixtral`): logits match the stock twin.
    Tolerance: both float32 with different summation orders (and the zero-point row-sum split): 1e-4 of the
    largest |logit|; rounding the weights to the int4 grid moves the logits by far more (the float model)."""
    float_model, stock, ours, ids = _quantized_mixtral()
    with torch.no_grad():
        ref, out = stock(ids).logits, ours(ids).logits
        tol = 1e-4 * ref.abs().max()
        assert (out - ref).abs().max() <= tol
        assert (float_model(ids).logits - ref).abs().max() > 10 * tol  # the quantization itself is visible
    with pytest.raises(ArgumentError, match="already quantized"):
        from tpukernels.integrations.moe import quantize_moe_experts

        quantize_moe_experts(ours, dtype="int8")


@pytest.mark.slow  # ~40 s on one core (two more kernel compiles and HF's eager backward)
def test_moe_quantized_experts_gradients_match_dequantized_mixtral():
    """Gradients of the non-expert parameters (through ``d_lhs`` of both projections) match the stock twin
    within 1e-3 of the largest entry; the quantized experts hold no parameters (frozen buffers)."""
    _, stock, ours, ids = _quantized_mixtral()
    stock(ids).logits.square().mean().backward()
    ours(ids).logits.square().mean().backward()
    theirs = {n: p for n, p in stock.named_parameters() if "experts" not in n}
    assert not [n for n, _ in ours.named_parameters() if "experts" in n]
    for n, p in ours.named_parameters():
        if theirs[n].grad is not None:
            assert (p.grad - theirs[n].grad).abs().max() <= 1e-3 * theirs[n].grad.abs().max(), n


@pytest.mark.slow  # importing tpu-inference takes ~13 s
@pytest.mark.parametrize("nb", [1, 2], ids=["per-channel", "block-64"])
def test_same_layout_and_values_as_tpu_inference_gmm(nb):
    """The public anchor: tpu-inference 0.32.0's megablox ``gmm`` (interpret mode) takes the same ``rhs [G, K, N]``
    int8 experts and ``rhs_scale [G, num_blocks, 1, N]`` unchanged, and both results lie within this module's
    forward bound of the float64 reference (float32 outputs, so the bound is sharp)."""
    pytest.importorskip("tpu_inference")
    import jax.numpy as jnp
    import numpy as np
    from tpu_inference.kernels.megablox.gmm import gmm

    G, N, K = 3, 256, 128
    rhs, s, _ = _case("int8", None if nb == 1 else K // nb, G, N, K, False, False, seed=11)
    assert tuple(s.shape) == (G, nb, 1, N)
    x = torch.randn(48, K, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    gs = torch.tensor([13, 0, 30], dtype=torch.int32)
    ours = gq.grouped_matmul_quantized(x, rhs, gs, s, config=CFG, out_dtype=torch.float32)
    theirs = gmm(jnp.asarray(x.float().numpy()).astype(jnp.bfloat16), jnp.asarray(rhs.numpy()),
                 jnp.asarray(gs.numpy()), preferred_element_type=jnp.float32, rhs_scale=jnp.asarray(s.numpy()),
                 tiling=(16, 128, 128), interpret=True)
    theirs = torch.from_numpy(np.array(theirs)[:43]).double()  # rows past sum(group_sizes): not written there
    ref = gq.reference_quantized(x, rhs, gs, s)
    bound = gq.error_bound_quantized(x, rhs, gs, s, out_dtype=torch.float32)
    assert ((ours.double() - ref).abs() <= bound).all()
    assert ((theirs - ref[:43]).abs() <= bound[:43]).all()
