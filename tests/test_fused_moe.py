"""tpukernels.library.fused_moe_ops: the fused MoE layer (router top-k -> permute -> grouped matmuls -> gated
activation -> grouped matmul -> combine).

Ground truth: ``fused_moe_reference``, float64 by definition (per token, a loop over its selected experts) from
the low-precision inputs, with an elementwise error bound (:func:`bound`); the float64 reference is itself checked
against tpu-inference 0.32.0's pure-JAX ``ref_moe`` (``kernels/fused_moe/v1/kernel.py``; its Pallas kernel
``fused_ep_moe`` is a shard_map'd expert-parallel kernel with remote DMAs over a TPU mesh, not run here). Gradients
against float64 autograd through the reference. Kernels run in Pallas interpret mode; the NaN-poisoned "tpu" mode
through the ``interpret`` fixture.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpukernels.library as L
from tpukernels.errors import ArgumentError, DTypeError
from tpukernels.library.fused_moe_ops import fused_moe, fused_moe_jax, fused_moe_reference

BF16, F32 = torch.bfloat16, torch.float32
U = {BF16: 2.0**-8, F32: 2.0**-24}
U32 = 2.0**-24


def rand(*shape, dtype=F32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def experts(E, H, I, layout, dtype, seed, bias=False):
    """``(w1, w3, w2, b1, b2)`` in one of the three layouts, weights ~ N(0, 1/H) and N(0, 1/I)."""
    wg, wu = rand(E, H, I, seed=seed, scale=H**-0.5), rand(E, H, I, seed=seed + 1, scale=H**-0.5)
    w2 = rand(E, I, H, dtype=dtype, seed=seed + 2, scale=I**-0.5)
    bg, bu = rand(E, 1, I, seed=seed + 3, scale=0.1), rand(E, 1, I, seed=seed + 4, scale=0.1)
    b2 = rand(E, 1, H, seed=seed + 5, scale=0.1) if bias else None
    w3 = None
    if layout == "e2hi":
        w1, b1 = torch.stack([wg, wu], 1), torch.stack([bg, bu], 1)
    elif layout == "eh2i":
        w1, b1 = torch.cat([wg, wu], -1), torch.cat([bg, bu], -1)
    else:
        w1, w3, b1 = wg, wu.to(dtype), torch.cat([bg, bu], -1)
    return w1.to(dtype), w3, w2, (b1 if bias else None), b2


def gate_up_mats(w1, w3, b1, I):
    """float64 ``(Wg, Wu [E, H, I], bg, bu [E, I])`` of any layout (zeros for no bias)."""
    if w1.dim() == 4:
        wg, wu = w1[:, 0].double(), w1[:, 1].double()
        bg, bu = (b1[:, 0, 0].double(), b1[:, 1, 0].double()) if b1 is not None else (0, 0)
    elif w3 is None:
        wg, wu = w1[..., :I].double(), w1[..., I:].double()
        bg, bu = (b1[:, 0, :I].double(), b1[:, 0, I:].double()) if b1 is not None else (0, 0)
    else:
        wg, wu = w1.double(), w3.double()
        bg, bu = (b1[:, 0, :I].double(), b1[:, 0, I:].double()) if b1 is not None else (0, 0)
    z = torch.zeros(w1.shape[0], I, dtype=torch.float64)
    return wg, wu, z + bg, z + bu


def bound(x, w1, w3, w2, b1, b2, ids, wts, u_h, u_o, ref, u_i=0.0):
    """Elementwise bound on ``|fused_moe - reference|``: ``u_h`` (h rounded to w2's operand dtype), ``u_i`` (the
    expert outputs rounded to tokens' dtype: ``U[bf16]`` for bfloat16 tokens) and router weights (float32, ~64 u32)
    on ``S = sum_j |w| (|h| @ |W2| + |b2|)``; float32 gate/up sums ((H + 2) u32 of ``|x| @ |W| + |b|``) and their
    rounding to tokens' dtype (``u_i``) carried to the output through ``|d act| <= 1.5 (1 + |g|)(1 + |u|)``; the
    down sums ((I + 2) u32 of S); the output rounding ``u_o |ref|``; all times 4."""
    I = w2.shape[1]
    wg, wu, bg, bu = gate_up_mats(w1, w3, b1, I)
    W2 = w2.double()
    x = x.double()
    S = torch.zeros_like(ref)
    D = torch.zeros_like(ref)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = x[t] @ wg[e] + bg[e], x[t] @ wu[e] + bu[e]
            ga, ua = x[t].abs() @ wg[e].abs() + bg[e].abs(), x[t].abs() @ wu[e].abs() + bu[e].abs()
            h = (g.abs() + 1) * (u.abs() + 1)  # >= |act(g, u)| of all three activations
            w = float(abs(wts[t, j]))
            S[t] += w * (h @ W2[e].abs() + (0 if b2 is None else b2[e, 0].double().abs()))
            D[t] += w * ((1.5 * (1 + g.abs()) * (1 + u.abs()) * (ga + ua)) @ W2[e].abs())
    H = x.shape[1]
    return 4 * ((u_h + u_i + 64 * U32 + (I + 2) * U32) * S + ((H + 2) * U32 + u_i) * D + u_o * ref.abs()) + 1e-30


def router64(logits, k, scoring_fn, renorm):
    order = torch.sort(-logits.double(), dim=-1, stable=True).indices[:, :k]
    p = torch.softmax(logits.double(), -1) if scoring_fn == "softmax" else torch.sigmoid(logits.double())
    w = p.gather(1, order)
    return order, (w / w.sum(-1, keepdim=True) if renorm else w)


# ----------------------------------------------------------------------------------------- forward vs float64
@settings(max_examples=4)
@given(t=st.integers(0, 9), e=st.integers(1, 5), kf=st.floats(0, 1), h=st.sampled_from([8, 16]),
       i=st.sampled_from([8, 24]), dtype=st.sampled_from([BF16, F32]),
       act=st.sampled_from(["silu", "gelu", "swigluoai"]), scoring=st.sampled_from(["softmax", "sigmoid"]),
       layout=st.sampled_from(["e2hi", "eh2i", "w3"]), renorm=st.booleans(), bias=st.booleans(),
       seed=st.integers(0, 50))
def test_matches_float64(t, e, kf, h, i, dtype, act, scoring, layout, renorm, bias, seed):
    k = 1 + int(kf * (e - 1))
    x = rand(t, h, dtype=dtype, seed=seed, scale=2.0)
    lg = rand(t, e, seed=seed + 7)
    w1, w3, w2, b1, b2 = experts(e, h, i, layout, dtype, seed + 11, bias)
    kw = dict(renormalize_topk_logits=renorm, act_fn=act, scoring_fn=scoring, w3=w3, b1=b1, b2=b2)
    out = fused_moe(x, w1, w2, lg, k, **kw)
    ref = fused_moe_reference(x, w1, w2, lg, k, **kw)
    assert out.dtype == dtype and out.shape == (t, h)
    ids, wts = router64(lg, k, scoring, renorm)
    tol = bound(x, w1, w3, w2, b1, b2, ids, wts, U[dtype], U[dtype], ref, u_i=U[dtype] if dtype == BF16 else 0.0)
    err = (out.double() - ref).abs()
    assert bool((err <= tol).all()), f"worst {float((err / tol).max()):.3g} of the bound"


def test_float64_reference_matches_tpu_inference_ref_moe():
    """Our float64 reference against tpu-inference 0.32.0's ``ref_moe`` (float32, jax on cpu) on its own layout
    ``w1 [E, 2, H, I]``, for each activation and scoring function, with biases; and int8 experts with its
    sub-channel scales ``w1_scale [E, 2, H/sz, 1, I]``, ``w2_scale [E, I/sz, 1, H]`` (ours run too)."""
    kern = pytest.importorskip("tpu_inference.kernels.fused_moe.v1.kernel")
    T, E, H, I, k = 5, 4, 64, 64, 2
    x = rand(T, H, seed=1)
    lg = rand(T, E, seed=2)
    w1, _, w2, b1, b2 = experts(E, H, I, "e2hi", F32, 3, bias=True)
    for act, scoring, renorm in (("silu", "softmax", True), ("gelu", "sigmoid", False),
                                 ("swigluoai", "softmax", False)):
        want = np.asarray(kern.ref_moe(x.numpy(), w1.numpy(), w2.numpy(), lg.numpy(), k, renormalize_topk_logits=renorm,
                                       act_fn=act, scoring_fn=scoring, b1=b1.numpy(), b2=b2.numpy()))
        ref = fused_moe_reference(x, w1, w2, lg, k, renormalize_topk_logits=renorm, act_fn=act, scoring_fn=scoring,
                                  b1=b1, b2=b2)
        err = np.abs(ref.numpy() - want).max()
        assert err <= 1e-5 * np.abs(want).max(), (act, scoring, err)
    # int8 experts, block scales of 32 along H (w1) and I (w2)
    sz = 32
    q1 = torch.randint(-127, 128, (E, 2, H, I), generator=torch.Generator().manual_seed(4), dtype=torch.int8)
    q2 = torch.randint(-127, 128, (E, I, H), generator=torch.Generator().manual_seed(5), dtype=torch.int8)
    s1 = (torch.rand(E, 2, H // sz, 1, I, generator=torch.Generator().manual_seed(6)) + 0.5) / (127 * H**0.5)
    s2 = (torch.rand(E, I // sz, 1, H, generator=torch.Generator().manual_seed(7)) + 0.5) / (127 * I**0.5)
    kw = dict(w1_scale=s1, w2_scale=s2, subc_quant_w1_sz=sz, subc_quant_w2_sz=sz)
    want = np.asarray(kern.ref_moe(x.numpy(), q1.numpy(), q2.numpy(), lg.numpy(), k, **{n: (v.numpy() if
                                   isinstance(v, torch.Tensor) else v) for n, v in kw.items()}))
    ref = fused_moe_reference(x, q1, q2, lg, k, **kw)
    out = fused_moe(x, q1, q2, lg, k, **kw)
    scale = np.abs(want).max()
    assert np.abs(ref.numpy() - want).max() <= 1e-5 * scale
    assert np.abs(out.double().numpy() - ref.numpy()).max() <= 1e-5 * scale


def test_quantized_per_channel_tokamax_layout_and_tokens_gradient():
    """int8 experts in tokamax's layout (fused ``w1 [E, H, 2I]``, per-channel scales ``[E, 2I]`` / ``[E, H]``, the
    same as ``[E, 1, 2I]`` and ``[E, 1, 1, 2I]``): forward and the tokens' gradient against float64 on the
    dequantized weights; the int8 weights get no gradient."""
    T, E, H, I, k = 6, 4, 16, 24, 2
    g = torch.Generator().manual_seed(8)
    q1 = torch.randint(-127, 128, (E, H, 2 * I), generator=g, dtype=torch.int8)
    q2 = torch.randint(-127, 128, (E, I, H), generator=g, dtype=torch.int8)
    s1 = (torch.rand(E, 2 * I, generator=g) + 0.5) / (127 * H**0.5)
    s2 = (torch.rand(E, H, generator=g) + 0.5) / (127 * I**0.5)
    x, lg = rand(T, H, seed=1).requires_grad_(), rand(T, E, seed=2)
    ref = fused_moe_reference(x.detach(), q1, q2, lg, k, w1_scale=s1, w2_scale=s2)
    for a, b in ((s1[:, None], s2[:, None]), (s1[:, None, None], s2[:, None, None])):
        same = fused_moe_reference(x.detach(), q1, q2, lg, k, w1_scale=a, w2_scale=b)
        assert torch.equal(same, ref)
    out = fused_moe(x, q1, q2, lg, k, w1_scale=s1, w2_scale=s2)
    scale = float(ref.abs().max())
    assert float((out.detach().double() - ref).abs().max()) <= 1e-5 * scale
    x64 = x.detach().double().requires_grad_()
    ref = fused_moe_reference(x64, q1, q2, lg, k, w1_scale=s1, w2_scale=s2)
    dout = rand(T, H, seed=3)
    out.backward(dout)
    ref.backward(dout.double())
    assert float((x.grad.double() - x64.grad).abs().max()) <= 1e-5 * float(x64.grad.abs().max())
    assert not q1.requires_grad and q1.grad is None


def test_zero_token_experts_zero_weight_tokens_and_precomputed_routing(interpret):
    """Experts no token picks (ids avoid 1 and 3), a token whose weights are all zero (its output is exactly
    zero, whatever its neighbours), a token sent twice to one expert, precomputed ids / weights; in both
    interpret modes (NaN-poisoned memory in "tpu"), forward and backward against float64. (Shapes as the
    float32 case of the router backward test: the kernels compile once for both.)"""
    T, E, H, I, k = 6, 4, 16, 24, 2
    x = rand(T, H, seed=3).requires_grad_()
    w1, _, w2, b1, b2 = experts(E, H, I, "e2hi", F32, 4, bias=True)
    w1.requires_grad_()
    w2.requires_grad_()
    ids = torch.tensor([[0, 2], [2, 2], [2, 0], [0, 2], [2, 2], [0, 0]])
    wts = torch.tensor([[0.7, 0.3], [0.0, 0.0], [0.5, 0.25], [1.0, -0.5], [0.2, 0.9], [0.6, 0.4]]).requires_grad_()
    out = fused_moe(x, w1, w2, topk_weights=wts, topk_ids=ids, b1=b1, b2=b2)
    assert torch.equal(out[1], torch.zeros(H))
    leaves = [v.detach().double().requires_grad_() for v in (x, w1, w2, wts)]
    ref = fused_moe_reference(leaves[0], leaves[1], leaves[2], topk_weights=leaves[3], topk_ids=ids, b1=b1.double(),
                              b2=b2.double())
    tol = bound(x.detach(), w1.detach(), None, w2.detach(), b1, b2, ids, wts.detach(), U32, U32, ref.detach())
    assert bool(((out.double() - ref).abs() <= tol).all())
    dout = rand(T, H, seed=9)
    out.backward(dout)
    ref.backward(dout.double())
    for name, a, b in zip(("x", "w1", "w2", "topk_weights"), (x, w1, w2, wts), leaves):
        ga, gb = a.grad.double(), b.grad
        assert float((ga - gb).abs().max()) <= 1e-5 * float(gb.abs().max()), name
    # the two unused experts' weights get exactly zero gradient
    assert torch.equal(w1.grad[[1, 3]], torch.zeros(2, 2, H, I)) and torch.equal(w2.grad[[1, 3]],
                                                                                 torch.zeros(2, I, H))


@pytest.mark.parametrize("dtype,act,layout", [(F32, "swigluoai", "e2hi"),
                                              pytest.param(BF16, "silu", "w3", marks=pytest.mark.slow)])
def test_backward_vs_float64_through_the_router(dtype, act, layout):
    """Gradients of tokens, w1 (and w3), w2, biases and the router logits against float64 autograd of the
    reference (float32: 1e-4 of each gradient's largest entry; bfloat16: 4e-2)."""
    T, E, H, I, k = 6, 4, 16, 24, 2
    x = rand(T, H, dtype=dtype, seed=5)
    lg = rand(T, E, seed=6)
    w1, w3, w2, b1, b2 = experts(E, H, I, layout, dtype, 7, bias=True)
    named = {"tokens": x, "w1": w1, "w2": w2, "gating_output": lg, "b1": b1, "b2": b2}
    if w3 is not None:
        named["w3"] = w3
    ours = {n: v.clone().requires_grad_() for n, v in named.items()}
    f64 = {n: v.detach().double().requires_grad_() for n, v in named.items()}
    out = fused_moe(top_k=k, renormalize_topk_logits=True, act_fn=act, **ours)
    ref = fused_moe_reference(top_k=k, renormalize_topk_logits=True, act_fn=act, **f64)
    dout = rand(T, H, seed=8)
    out.backward(dout.to(dtype))
    ref.backward(dout.double())
    rtol = 1e-4 if dtype == F32 else 4e-2
    for n in named:
        g, want = ours[n].grad, f64[n].grad
        assert g is not None and g.dtype == named[n].dtype, n
        err = float((g.double() - want).abs().max())
        assert err <= rtol * float(want.abs().max()), (n, err, float(want.abs().max()))


@pytest.mark.parametrize("act,dtype", [("silu", F32), ("gelu", BF16)])
def test_fused_gate_up_output_is_read_in_place(act, dtype, monkeypatch):
    """``[E, H, 2I]`` weights with I a multiple of 128: the activation kernel reads the gate and up halves of the
    one ``[T*k, 2I]`` matmul output in place (no split; ``split_gate_up`` is never called) and writes h in w2's
    dtype. Forward within the float64 bound, bit for bit the split path's result, the jax entry's too; gradients of
    tokens, w1 and w2 against float64 autograd (of each gradient's largest entry: float32 1e-4, bfloat16 4e-2)."""
    import jax.numpy as jnp

    from tpukernels.library import fused_moe_ops as F

    T, E, H, I, k = 10, 3, 16, 128, 2
    x, lg = rand(T, H, dtype=dtype, seed=21, scale=2.0), rand(T, E, seed=22)
    w1, _, w2, _, _ = experts(E, H, I, "eh2i", dtype, 23)
    split = F.split_gate_up
    with monkeypatch.context() as m:
        m.setattr(F, "split_gate_up", lambda *a: pytest.fail("the gate / up output was split"))
        out = fused_moe(x, w1, w2, lg, k, act_fn=act)
        got_jax = fused_moe_jax(*(jnp.asarray(v.float().numpy()).astype(jnp.bfloat16 if v.dtype == BF16 else
                                                                       jnp.float32) for v in (x, w1, w2, lg)),
                                k, act_fn=act)
    ref = fused_moe_reference(x, w1, w2, lg, k, act_fn=act)
    ids, wts = router64(lg, k, "softmax", False)
    u_i = U[dtype] if dtype == BF16 else 0.0
    err = (out.double() - ref).abs()
    tol = bound(x, w1, None, w2, None, None, ids, wts, U[dtype], U[dtype], ref, u_i=u_i)
    assert out.dtype == dtype and bool((err <= tol).all()), f"worst {float((err / tol).max()):.3g} of the bound"
    np.testing.assert_array_equal(np.asarray(got_jax.astype(jnp.float32)), out.float().numpy())
    with monkeypatch.context() as m:
        m.setattr(F, "reads_halves", lambda *a: False)
        m.setattr(F, "split_gate_up", split)
        assert torch.equal(fused_moe(x, w1, w2, lg, k, act_fn=act), out)
    named = {"tokens": x, "w1": w1, "w2": w2}
    ours = {n: v.clone().requires_grad_() for n, v in named.items()}
    f64 = {n: v.double().requires_grad_() for n, v in named.items()}
    dout = rand(T, H, seed=24)
    fused_moe(gating_output=lg, top_k=k, act_fn=act, **ours).backward(dout.to(dtype))
    fused_moe_reference(gating_output=lg, top_k=k, act_fn=act, **f64).backward(dout.double())
    rtol = 1e-4 if dtype == F32 else 4e-2
    for n in named:
        g, want = ours[n].grad, f64[n].grad
        assert g is not None and float((g.double() - want).abs().max()) <= rtol * float(want.abs().max()), n


@pytest.mark.parametrize("layout,act,interleave", [("e2hi", "silu", False), ("eh2i", "swigluoai", True),
                                                    ("w3", "gelu", False)])
def test_transposed_and_interleaved_weights_compute_the_plain_layouts_layer(layout, act, interleave):
    """``transpose_rhs=True`` (weights stored ``[..., out, in]``, HF / ``nn.Linear``) and ``gate_up_interleaved``
    (gpt-oss: gate in even, up in odd columns of a fused ``w1`` and ``b1``): the same layer as the plain
    ``[in, out]`` layout, against float64 (the reference of the plain weights); forward and the gradients of the
    stored weights (which are the transposes / column permutation of the plain ones' gradients)."""
    T, E, H, I, k = 6, 4, 16, 24, 2
    x, lg = rand(T, H, seed=21), rand(T, E, seed=22)
    w1, w3, w2, b1, b2 = experts(E, H, I, layout, F32, 23, bias=True)
    if interleave:  # [gate | up] columns -> gate even, up odd (b1 the same way)
        perm = torch.stack([torch.arange(I), torch.arange(I) + I], 1).reshape(-1)
        w1i, b1i = w1[..., perm], b1[..., perm]
    else:
        w1i, b1i = w1, b1
    t = (lambda w: None if w is None else w.transpose(-1, -2).contiguous())
    stored = dict(w1=t(w1i), w2=t(w2), w3=t(w3))
    leaves = {n: v.clone().requires_grad_() for n, v in stored.items() if v is not None}
    kw = dict(act_fn=act, b1=b1i, b2=b2, transpose_rhs=True, gate_up_interleaved=interleave)
    out = fused_moe(x, leaves["w1"], leaves["w2"], lg, k, w3=leaves.get("w3"), **kw)
    plain = {n: v.detach().double().requires_grad_() for n, v in dict(w1=w1, w2=w2, w3=w3).items() if v is not None}
    ref = fused_moe_reference(x, plain["w1"], plain["w2"], lg, k, w3=plain.get("w3"), act_fn=act, b1=b1, b2=b2)
    ids, wts = router64(lg, k, "softmax", False)
    tol = bound(x, w1, w3, w2, b1, b2, ids, wts, U32, U32, ref.detach())
    assert bool(((out.double() - ref).abs() <= tol).all())
    # the reference takes the stored layout too (same checks, same flags)
    ref_stored = fused_moe_reference(x, stored["w1"], stored["w2"], lg, k, w3=stored["w3"], **kw)
    assert float((ref_stored - ref.detach()).abs().max()) <= 1e-12 * float(ref.detach().abs().max())
    dout = rand(T, H, seed=24)
    out.backward(dout)
    ref.backward(dout.double())
    want = {"w2": t(plain["w2"].grad), "w3": t(plain["w3"].grad) if "w3" in plain else None,
            "w1": t(plain["w1"].grad[..., perm] if interleave else plain["w1"].grad)}
    for n, leaf in leaves.items():
        g = want[n]
        assert leaf.grad.shape == leaf.shape, n
        assert float((leaf.grad.double() - g).abs().max()) <= 1e-4 * float(g.abs().max()), n


def test_library_export_and_torch_op():
    assert L.fused_moe is fused_moe
    T, E, H, I = 3, 2, 8, 8
    x, lg = rand(T, H), rand(T, E, seed=1)
    w1, _, w2, _, _ = experts(E, H, I, "eh2i", F32, 2)
    a = torch.ops.tpukernels.fused_moe(x, w1, w2, lg, 1)
    ref = fused_moe_reference(x, w1, w2, lg, 1)
    assert float((a.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    # no tokens: an empty result that still differentiates (to an empty gradient)
    x0 = x[:0].clone().requires_grad_()
    out = fused_moe(x0, w1, w2, lg[:0], 1)
    assert out.shape == (0, H) and out.dtype == F32
    out.sum().backward()
    assert x0.grad.shape == (0, H)


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager():
    """``torch.compile(fullgraph=True)`` over fused_moe: one graph (no data-dependent shapes, id checks skipped
    while compiling), bit-equal to eager."""
    T, E, H, I, k = 6, 4, 16, 24, 2
    x, lg = rand(T, H, seed=3), rand(T, E, seed=4)
    w1, _, w2, b1, b2 = experts(E, H, I, "e2hi", F32, 5, bias=True)
    want = fused_moe(x, w1, w2, lg, k, b1=b1, b2=b2)
    f = torch.compile(lambda x, w1, w2, lg: fused_moe(x, w1, w2, lg, k, b1=b1, b2=b2), fullgraph=True)
    assert torch.equal(f(x, w1, w2, lg), want)


def test_jax_entry_matches_torch_under_jit():
    """``fused_moe_jax`` (forward, float weights) under ``jax.jit`` gives the torch op's result bit for bit (the
    same kernels), with biases and the tpu-inference layout; precomputed routing too; typed errors."""
    import jax
    import jax.numpy as jnp

    T, E, H, I, k = 6, 4, 16, 24, 2
    x, lg = rand(T, H, seed=3), rand(T, E, seed=4)
    w1, _, w2, b1, b2 = experts(E, H, I, "e2hi", F32, 5, bias=True)
    want = fused_moe(x, w1, w2, lg, k, act_fn="gelu", scoring_fn="sigmoid", b1=b1, b2=b2)
    j = {n: jnp.asarray(v.numpy()) for n, v in dict(x=x, w1=w1, w2=w2, lg=lg, b1=b1, b2=b2).items()}
    f = jax.jit(lambda x, w1, w2, lg, b1, b2: fused_moe_jax(x, w1, w2, lg, k, act_fn="gelu", scoring_fn="sigmoid",
                                                            b1=b1, b2=b2))
    got = f(**j)
    np.testing.assert_array_equal(np.asarray(got), want.numpy())
    ids = torch.tensor([[0, 2], [2, 2], [2, 0], [0, 2], [2, 2], [0, 0]])
    wts = rand(T, k, seed=6)
    want = fused_moe(x, w1, w2, topk_weights=wts, topk_ids=ids)
    got = fused_moe_jax(j["x"], j["w1"], j["w2"], topk_weights=jnp.asarray(wts.numpy()),
                        topk_ids=jnp.asarray(ids.numpy()))
    np.testing.assert_array_equal(np.asarray(got), want.numpy())
    # HF's stored layouts: [E, 2I, H] / [E, H, I] read as stored, gpt-oss's interleaved gate / up columns
    w13, _, _, b13, _ = experts(E, H, I, "eh2i", F32, 7, bias=True)
    w13t, w2t = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    kw = dict(act_fn="swigluoai", b1=b13, transpose_rhs=True, gate_up_interleaved=True)
    want = fused_moe(x, w13t, w2t, topk_weights=wts, topk_ids=ids, **kw)
    got = fused_moe_jax(j["x"], jnp.asarray(w13t.numpy()), jnp.asarray(w2t.numpy()), topk_weights=jnp.asarray(
        wts.numpy()), topk_ids=jnp.asarray(ids.numpy()), **dict(kw, b1=jnp.asarray(b13.numpy())))
    np.testing.assert_array_equal(np.asarray(got), want.numpy())
    with pytest.raises(ArgumentError, match=r"gating_output must be \[T, E\] = \[6, 4\]"):
        fused_moe_jax(j["x"], j["w1"], j["w2"], j["lg"][:, :3], k)
    with pytest.raises(ArgumentError, match=r"topk_ids must be in \[0, num_experts = 4\)"):
        fused_moe_jax(j["x"], j["w1"], j["w2"], topk_weights=jnp.asarray(wts.numpy()),
                      topk_ids=jnp.asarray(ids.numpy()) + 4)
    with pytest.raises(DTypeError, match="quantized experts are not supported by the jax entry"):
        fused_moe_jax(j["x"], j["w1"].astype(jnp.int8), j["w2"], j["lg"], k)


#: Qwen3-30B-A3B's experts (128 experts, top-8, H 2048, I 768) at 512 tokens in tpu-inference's layout: bfloat16
#: experts, and int8 experts with sub-channel scales of 128 along K (make test: the int8 case, one chip)
AOT_CASES = {
    "bf16": (("512x2048:bf16", "128x2x2048x768:bf16", "128x768x2048:bf16", "512x128:f32", 8),
             {"renormalize_topk_logits": True}),
    "int8": (("512x2048:bf16", "128x2x2048x768:i8", "128x768x2048:i8", "512x128:f32", 8),
             {"w1_scale": "128x2x16x1x768:f32", "w2_scale": "128x6x1x2048:f32", "subc_quant_w1_sz": 128,
              "subc_quant_w2_sz": 128}),
}


@pytest.mark.aot
@pytest.mark.parametrize("case", [pytest.param("bf16", marks=pytest.mark.slow), "int8"])
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only(chip, case, tmp_cache):
    """Every kernel ``fused_moe`` launches directly (router, gate / up and down grouped matmuls, activation)
    compiles for the chip at the shapes it passes them (``moe_permute`` / ``moe_combine`` are custom ops whose
    kernels their own compile-only tests cover)."""
    from tpukernels.targets.compile_only import compile_for

    args, kw = AOT_CASES[case]
    rs = compile_for(fused_moe, chip, *args, with_mlir=False, **kw)
    names = [r.summary().split(" on ")[0] for r in rs]
    gmm = "tpukernels::grouped_matmul_quant_fwd" if case == "int8" else "tpukernels::grouped_matmul_fwd"
    assert names == ["tpukernels::router_topk_fwd", gmm, gmm, "tpukernels::gated_activation_fwd", gmm], names
    assert all(r.ok for r in rs), [r.summary() for r in rs if not r.ok]


# ----------------------------------------------------------------------------------------- bad input
def test_bad_input_raises_typed_errors_before_any_kernel(monkeypatch):
    import tpukernels.library.moe_routing as MR

    def boom(*a, **k):
        raise AssertionError("a kernel ran before the argument checks")

    for name in ("softmax_topk", "sigmoid_topk", "moe_permute"):
        monkeypatch.setattr(MR, name, boom)
    T, E, H, I = 4, 4, 8, 8
    x, lg = rand(T, H), rand(T, E)
    w1, _, w2, b1, b2 = experts(E, H, I, "e2hi", F32, 0, bias=True)
    w13 = w1.transpose(1, 2).reshape(E, H, 2 * I)
    ids = torch.zeros(T, 2, dtype=torch.long)
    q1, q2 = w1.to(torch.int8), w2.to(torch.int8)
    cases = [
        (lambda: fused_moe(x, w1, w2, rand(T, E + 1), 2), ArgumentError, r"gating_output must be \[T, E\] = \[4, 4\]"),
        (lambda: fused_moe(x, w1, w2, lg, 5), ArgumentError, r"top_k = 5 must be an int in \[1, num_experts = 4\]"),
        (lambda: fused_moe(x, w1, w2, lg, 0), ArgumentError, "top_k = 0"),
        (lambda: fused_moe(x, w1, w2, topk_ids=ids + 4, topk_weights=torch.ones(T, 2)), ArgumentError,
         r"topk_ids must be in \[0, num_experts = 4\), got values in \[4, 4\]"),
        (lambda: fused_moe(x, w1, w2, topk_ids=ids - 1, topk_weights=torch.ones(T, 2)), ArgumentError, "topk_ids"),
        (lambda: fused_moe(x, w1, w2, topk_ids=ids, topk_weights=torch.ones(T, 3)), ArgumentError,
         r"topk_weights must be \[T, k\] = \[4, 2\]"),
        (lambda: fused_moe(x, w1, w2, topk_ids=torch.zeros(T, 5, dtype=torch.long), topk_weights=torch.ones(T, 5)),
         ArgumentError, "top_k must be in"),
        (lambda: fused_moe(x, w1, w2), ArgumentError, "pass gating_output"),
        (lambda: fused_moe(x, w1, w2, lg, 2, topk_ids=ids, topk_weights=torch.ones(T, 2)), ArgumentError, "not both"),
        (lambda: fused_moe(x, w1[:, :, :4], w2, lg, 2), ArgumentError, r"w1 must be \[E, 2, H, I\] = \[4, 2, 8, 8\]"),
        (lambda: fused_moe(x, w13[:, :, :10], w2, lg, 2), ArgumentError, r"w1 must be \[E, H, 2I\]"),
        (lambda: fused_moe(x, w1[:3], w2, lg, 2), ArgumentError, "w1 must be"),
        (lambda: fused_moe(x, w1, w2[:, :, :4], lg, 2), ArgumentError, r"w2 must be \[E, I, H\] with H"),
        (lambda: fused_moe(x, w1[:, 0], w2, lg, 2, w3=w1[:, 1, :4]), ArgumentError, "w3 must be"),
        (lambda: fused_moe(x, w1, w2, lg, 2, w3=w1[:, 1]), ArgumentError, "w3 is only taken with a 3-D w1"),
        (lambda: fused_moe(x, w1, w2, lg, 2, b1=b1[:, :, :, :4]), ArgumentError, r"b1 must be \[E, 2, 1, I\]"),
        (lambda: fused_moe(x, w13, w2, lg, 2, b1=b1), ArgumentError, r"b1 must be \[E, 1, 2I\]"),
        (lambda: fused_moe(x, w1, w2, lg, 2, b2=b2[:, :, :4]), ArgumentError, r"b2 must be \[E, 1, H\]"),
        (lambda: fused_moe(x, w1, w2, lg, 2, act_fn="relu"), ArgumentError, "act_fn must be one of"),
        (lambda: fused_moe(x, w1, w2, lg, 2, scoring_fn="tanh"), ArgumentError, "scoring_fn must be one of"),
        (lambda: fused_moe(x, q1, w2, lg, 2), ArgumentError, "w1_scale must be"),
        (lambda: fused_moe(x, q1, q2, lg, 2, w1_scale=torch.ones(E, 2, 3, 1, I), w2_scale=torch.ones(E, H)),
         ArgumentError, "blocks dividing K = 8"),
        (lambda: fused_moe(x, q1, q2, lg, 2, w1_scale=torch.ones(E, 2, 1, 1, I), w2_scale=torch.ones(E, H),
                           subc_quant_w1_sz=4), ArgumentError, "subc_quant_w1_sz = 4"),
        (lambda: fused_moe(x, w1, w2, lg, 2, w2_scale=torch.ones(E, H)), ArgumentError, "w2_scale given"),
        (lambda: fused_moe(x.half(), w1, w2, lg, 2), DTypeError, "tokens dtype"),
        (lambda: fused_moe(x, w1.double(), w2, lg, 2), DTypeError, "w1 dtype"),
        (lambda: fused_moe(x, w1, w2, topk_ids=ids.float(), topk_weights=torch.ones(T, 2)), DTypeError, "int32"),
        (lambda: fused_moe(x, w13, w2, lg, 2, transpose_rhs=True), ArgumentError,
         r"w1 must be \[E, H, 2I\].*transpose_rhs=True: w1 / w3 / w2 are taken as"),
        (lambda: fused_moe_reference(x, w1, w2, lg, 2, transpose_rhs=1), ArgumentError,
         "transpose_rhs must be a bool"),
        (lambda: fused_moe(x, w1, w2, lg, 2, gate_up_interleaved=True), ArgumentError,
         "gate_up_interleaved=True needs a fused gate-up w1"),
    ]
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()
