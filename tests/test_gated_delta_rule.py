"""tpukernels.library.linear_attention (gated DeltaNet): chunked prefill, recurrent decode, backward.

Ground truth: the float64 token loop (``gated_delta_rule_reference``) of the same low-precision inputs, itself
checked against flash-linear-attention's naive recurrence and naive chunked form (``fla/ops/gated_delta_rule/
naive.py``, loaded by path: ``fla/__init__`` imports triton), transformers' Qwen3-Next torch path
(``torch_chunk_gated_delta_rule``, grouped heads) and tpu-inference 0.32.0's decode step
(``kernels/gdn/reference``). Small chunks (16 tokens) make short tests cross several chunks; packed batches put
sequence boundaries inside chunks, at chunk edges, and include empty sequences.
"""


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fla_naive  # tests/ is on sys.path (rootdir-relative import)
from tpukernels.errors import ArgumentError, DTypeError, NotSupportedError
from tpukernels.library.linear_attention import gdn_ops as G
from tpukernels.library.linear_attention.common import head_major

BF16, F32 = torch.bfloat16, torch.float32
U = {BF16: 2.0**-8, F32: 2.0**-24}  # one rounding of the float32 result to the output dtype
C = 16  # chunk size of most tests


def rand(*shape, dtype=F32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def inputs(b, t, h, hv, kd, vd, dtype=F32, seed=0, gate="mixed"):
    """q, k (unit-norm keys, as Qwen3-Next's l2-normalized ones), v, g (log decay), beta in (0, 1)."""
    q = rand(b, t, h, kd, seed=seed).to(dtype)
    k = torch.nn.functional.normalize(rand(b, t, h, kd, seed=seed + 1), dim=-1).to(dtype)
    v = rand(b, t, hv, vd, seed=seed + 2).to(dtype)
    u = torch.rand(b, t, hv, generator=torch.Generator().manual_seed(seed + 3), dtype=torch.float64)
    g = {"mixed": -3 * u, "none": -1e-4 * u, "strong": -30 - 20 * u}[gate].float()  # decay ~1, or ~0
    beta = torch.rand(b, t, hv, generator=torch.Generator().manual_seed(seed + 4)).float()
    return q, k, v, g, beta


def check(got, want, dtype, what="", rel=2.0**-17):
    """|got - want| <= U[dtype] |want| + rel * (max |want| + 1) elementwise: float32 arithmetic over chunks of
    16-64 tokens (matmuls, the triangular inverse, exp of cumulative gates), then one rounding to dtype."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not want.numel():
        return
    err = (got.double() - want).abs()
    bound = U[dtype] * want.abs() + rel * (float(want.abs().max()) + 1)
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())}/{bad.numel()} out of tolerance, worst {float(err.max()):.3g}"


# ----------------------------------------------------------------------------------------- references
def test_reference_matches_fla_naive_recurrent_and_chunk():
    naive = fla_naive.load("gated_delta_rule")
    q, k, v, g, beta = inputs(2, 37, 2, 2, 16, 8)
    h0 = rand(2, 2, 16, 8, seed=9)
    o, ht = G.gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0)
    for fn, kw in ((naive.naive_recurrent_gated_delta_rule, {}), (naive.naive_chunk_gated_delta_rule,
                                                                  {"chunk_size": 16})):
        fo, fht = fn(q.double(), k.double(), v.double(), beta.double(), g.double(), initial_state=h0.double(),
                     output_final_state=True, **kw) if fn is naive.naive_recurrent_gated_delta_rule else fn(
            q.double(), k.double(), v.double(), g.double(), beta.double(), initial_state=h0.double(),
            output_final_state=True, **kw)
        torch.testing.assert_close(fo.double(), o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fht.double(), ht, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [BF16, pytest.param(F32, marks=pytest.mark.slow)])
def test_matches_transformers_qwen3_next_torch_path_with_grouped_heads(dtype):
    """Qwen3-Next's own fallback (16 k-heads : 32 v-heads there; 2 : 4 here), l2norm in the call, vs ours."""
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = inputs(1, 40, 2, 4, 16, 8, dtype=dtype)
    q, k = rand(1, 40, 2, 16, seed=5).to(dtype), rand(1, 40, 2, 16, seed=6).to(dtype)  # unnormalized: l2norm does it
    h0 = rand(1, 4, 16, 8, seed=7)
    want, want_ht = qn.torch_chunk_gated_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta,
                                                    chunk_size=16, initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    o, ht = G.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True, chunk_size=C)
    ref, ref_ht = G.gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True)
    check(o, ref, dtype, "o vs float64")
    check(ht, ref_ht, F32, "final vs float64")
    tol = 2e-2 if dtype == BF16 else 1e-4  # transformers computes in the input dtype's float32 upcast, rounds q/k
    torch.testing.assert_close(o.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(ht, want_ht.float(), rtol=tol, atol=tol)


def test_decode_matches_tpu_inference_step():
    ref = pytest.importorskip("tpu_inference.kernels.gdn.reference.ragged_gated_delta_rule_ref")
    import jax.numpy as jnp

    q, k, v, g, beta = inputs(3, 1, 2, 2, 16, 8)
    h0 = rand(3, 2, 16, 8, seed=9)
    o, ht = G.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    tr = lambda x: jnp.asarray(x.transpose(1, 2).numpy())  # noqa: E731  [B, T, H, d] -> [B, H, T, d]
    p_o, p_s = ref._recurrent_gated_delta_rule_step(tr(q), tr(k), tr(v), jnp.asarray(g.transpose(1, 2).numpy()),
                                                    jnp.asarray(beta.transpose(1, 2).numpy()), jnp.asarray(h0.numpy()))
    torch.testing.assert_close(o, torch.from_numpy(np.array(p_o)).transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, torch.from_numpy(np.array(p_s)), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------- forward
@settings(max_examples=3)  # each example compiles new shapes (~10 s each on 2 cores)
@given(t=st.sampled_from([1, C - 1, C, C + 1, 3 * C + 5]), b=st.integers(1, 2), ratio=st.sampled_from([1, 2]),
       dtype=st.sampled_from([F32, BF16]), gate=st.sampled_from(["mixed", "none", "strong"]),
       has_h0=st.booleans())
def test_forward_matches_float64(t, b, ratio, dtype, gate, has_h0):
    q, k, v, g, beta = inputs(b, t, 1, ratio, 16, 8, dtype=dtype, gate=gate)
    h0 = rand(b, ratio, 16, 8, seed=11) if has_h0 else None
    h0_copy = None if h0 is None else h0.clone()
    o, ht = G.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    ref, ref_ht = G.gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0)
    assert o.dtype == dtype and ht.dtype == F32
    check(o, ref, dtype, "o")
    check(ht, ref_ht, F32, "final_state")
    if h0 is not None:
        assert torch.equal(h0, h0_copy)  # never modified


@pytest.mark.parametrize("lens", [[5, 0, 16, 19, 34], [40, 1, 1, 3], pytest.param([1], marks=pytest.mark.slow),
                                  pytest.param([16, 16], marks=pytest.mark.slow)])
def test_packed_sequences_with_states_in_and_out(lens):
    """cu_seqlens: boundaries inside chunks, on chunk edges, empty and one-token sequences; each sequence equals
    the reference of that sequence alone with its own initial state (the empty one returns its state)."""
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int64)
    n, t = len(lens), int(cu[-1])
    q, k, v, g, beta = inputs(1, t, 1, 2, 16, 8, seed=3)
    h0 = rand(n, 2, 16, 8, seed=12)
    o, ht = G.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                     chunk_size=C)
    for i in range(n):
        s, e = int(cu[i]), int(cu[i + 1])
        sl = lambda x: x[:, s:e]  # noqa: E731
        ref, ref_ht = G.gated_delta_rule_reference(sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=h0[i:i + 1])
        check(o[:, s:e], ref, F32, f"o seq {i}")
        check(ht[i:i + 1], ref_ht, F32, f"final seq {i}")
    whole, _ = G.gated_delta_rule_reference(q, k, v, g, beta)
    if n > 1 and t:
        assert not torch.allclose(o.double(), whole, atol=1e-3)  # the boundaries matter for this input


@settings(max_examples=4)
@given(cuts=st.lists(st.integers(0, 48), min_size=3, max_size=3))
def test_ragged_batches_match_float64(cuts):
    """4 sequences of random lengths (empty ones included) packed in 48 tokens, states in and out (one compiled
    shape)."""
    cu = torch.tensor([0] + sorted(cuts) + [48])
    q, k, v, g, beta = inputs(1, 48, 1, 1, 16, 8, seed=21)
    h0 = rand(4, 1, 16, 8, seed=22)
    o, ht = G.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                     chunk_size=C)
    ref, ref_ht = G.gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    check(o, ref, F32, "o")
    check(ht, ref_ht, F32, "final_state")
    o2, none = G.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, chunk_size=C)
    assert none is None and torch.equal(o2, o)


def test_nan_in_one_sequence_reaches_no_other(interpret):
    lens = [20, 7, 21]  # sequence 1 shares both of its chunks with its neighbours
    cu = torch.tensor(np.cumsum([0] + lens))
    q, k, v, g, beta = inputs(1, sum(lens), 1, 1, 16, 8, seed=4)
    v[0, 22, 0, 3] = float("nan")
    g[0, 24, 0] = float("nan")
    h0 = rand(3, 1, 16, 8, seed=5)
    o, ht = G.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                     chunk_size=C)
    for i in (0, 2):
        s, e = int(cu[i]), int(cu[i + 1])
        sl = lambda x: x[:, s:e]  # noqa: E731
        ref, ref_ht = G.gated_delta_rule_reference(sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=h0[i:i + 1])
        check(o[:, s:e], ref, F32, f"seq {i}")
        check(ht[i:i + 1], ref_ht, F32, f"final {i}")
    assert o[:, 20:27].isnan().any() and ht[1].isnan().any()


@pytest.mark.slow
def test_chunk_sizes_agree():
    q, k, v, g, beta = inputs(1, 70, 1, 1, 16, 8, seed=6)
    ref, _ = G.gated_delta_rule_reference(q, k, v, g, beta)
    for cs in (16, 32, 64, 128):
        o, _ = G.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=cs)
        check(o, ref, F32, f"chunk {cs}")


# ----------------------------------------------------------------------------------------- decode
def test_decode_steps_equal_prefill_and_state_pool_in_place():
    b, t = 3, 4
    q, k, v, g, beta = inputs(b, t, 1, 2, 16, 8, seed=7)
    whole, whole_ht = G.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, chunk_size=C)
    pool = rand(5, 2, 16, 8, seed=8)
    idx = torch.tensor([4, 0, 2])
    pool[idx] = 0.0
    untouched = pool[[1, 3]].clone()
    outs = []
    for i in range(t):
        o, ret = G.fused_recurrent_gated_delta_rule(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1],
                                                    beta[:, i:i + 1], initial_state=pool, output_final_state=True,
                                                    ssm_state_indices=idx, inplace_final_state=True)
        assert ret is pool
        outs.append(o)
    check(torch.cat(outs, 1), whole.double(), F32, "decode vs prefill", rel=2.0**-20)
    check(pool[idx], whole_ht.double(), F32, "pool", rel=2.0**-20)
    assert torch.equal(pool[[1, 3]], untouched)


def test_fused_recurrent_forms_match_reference():
    q, k, v, g, beta = inputs(1, 12, 1, 1, 16, 8, seed=8)
    h0 = rand(3, 1, 16, 8, seed=9)
    h0_copy = h0.clone()
    for lens in ([4, 4, 4], [2, 9, 1]):  # equal lengths: the decode kernel, one row each; else the chunked one
        cu = torch.tensor(np.cumsum([0] + lens))
        o, ht = G.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   cu_seqlens=cu)
        ref, ref_ht = G.gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
        check(o, ref, F32, f"o {lens}")
        check(ht, ref_ht, F32, f"ht {lens}")
    assert torch.equal(h0, h0_copy)


@pytest.mark.parametrize("h, hv, bh", [(1, 4, 2), (2, 8, 8), (2, 4, 1)])
def test_decode_heads_per_step(monkeypatch, h, hv, bh):
    """block_h value heads per grid step, grouped heads lined up (bh a multiple of HV / H, or a divisor)."""
    monkeypatch.setattr(G.gdn_recurrent_fwd, "heuristic", lambda *a, **k: {"block_h": bh})
    G.gdn_recurrent_fwd._plans.clear()
    q, k, v, g, beta = inputs(3, 2, h, hv, 16, 8, seed=19)
    h0 = rand(3, hv, 16, 8, seed=20)
    o, ht = G.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ref, ref_ht = G.gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0)
    check(o, ref, F32, "o")
    check(ht, ref_ht, F32, "ht")
    G.gdn_recurrent_fwd._plans.clear()


# ----------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("dtype, packed, ratio", [(F32, True, 2), pytest.param(F32, False, 1, marks=pytest.mark.slow),
                                                  pytest.param(BF16, False, 2, marks=pytest.mark.slow)])
def test_backward_matches_float64_autograd(dtype, packed, ratio):
    b, t = (1, 45) if packed else (2, 21)
    cu = torch.tensor([0, 3, 3, 20, 45]) if packed else None
    n = 4 if packed else b
    xs = [x.requires_grad_() for x in inputs(b, t, 1, ratio, 16, 8, dtype=dtype, seed=10)]
    h0 = rand(n, ratio, 16, 8, seed=13).requires_grad_()
    o, ht = G.chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=C)
    do, dht = rand(*o.shape, seed=14).to(dtype), rand(*ht.shape, seed=15)
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), xs + [h0])
    x64 = [x.detach().double().requires_grad_() for x in xs + [h0]]
    ref, ref_ht = G.gated_delta_rule_reference(*x64[:5], initial_state=x64[5], cu_seqlens=cu)
    want = torch.autograd.grad((ref * do.double()).sum() + (ref_ht * dht.double()).sum(), x64)
    for name, got, exp, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, want, xs + [h0]):
        assert got.dtype == x.dtype, name
        check(got, exp, x.dtype, name, rel=2.0**-16)


@pytest.mark.slow
def test_backward_nan_in_one_sequence_reaches_no_other_gradient(interpret):
    """A NaN in sequence 1's values: sequences 0 and 2 get the float64 gradients of their own, in both interpret
    modes (the backward's DMA buffers and carried dS start NaN-poisoned in "tpu" mode)."""
    lens = [20, 7, 21]
    cu = torch.tensor(np.cumsum([0] + lens))
    xs = list(inputs(1, sum(lens), 1, 1, 16, 8, seed=17))
    xs[2][0, 22, 0, 3] = float("nan")
    xs = [x.requires_grad_() for x in xs]
    h0 = rand(3, 1, 16, 8, seed=18).requires_grad_()
    o, ht = G.chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=C)
    grads = torch.autograd.grad(o.nansum() + ht.nansum(), xs + [h0])
    for i in (0, 2):
        s, e = int(cu[i]), int(cu[i + 1])
        x64 = [x.detach()[:, s:e].double().requires_grad_() for x in xs]
        x64.append(h0.detach()[i:i + 1].double().requires_grad_())
        ref, ref_ht = G.gated_delta_rule_reference(*x64[:5], initial_state=x64[5])
        want = torch.autograd.grad(ref.sum() + ref_ht.sum(), x64)
        for name, got, exp in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, want):
            check(got[:, s:e], exp, F32, f"{name} seq {i}", rel=2.0**-16)
        check(grads[5][i:i + 1], want[5], F32, f"dh0 seq {i}", rel=2.0**-16)
    assert grads[0][:, 20:27].isnan().any()


def test_kernel_ops_pass_opcheck():
    q, k, v, g, beta = inputs(1, 20, 1, 2, 16, 8)
    hm = head_major
    gate = lambda x: x.reshape(20, 2).T.reshape(2, 20, 1).contiguous()  # noqa: E731
    args = (torch.tensor([0, 7, 20], dtype=torch.int32), hm(q), hm(k), hm(v), gate(g), gate(beta), rand(2, 2, 16, 8),
            0.25, False, 16)
    torch.library.opcheck(torch.ops.tpukernels.gdn_chunk_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.slow
def test_backward_through_fused_recurrent_and_l2norm():
    xs = [x.requires_grad_() for x in inputs(2, 3, 1, 1, 16, 8, seed=16)]
    o, _ = G.fused_recurrent_gated_delta_rule(*xs, use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad(o.sum(), xs)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    ref, _ = G.gated_delta_rule_reference(*x64, use_qk_l2norm_in_kernel=True)
    want = torch.autograd.grad(ref.sum(), x64)
    for name, got, exp in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, want):
        check(got, exp, F32, name, rel=2.0**-16)


# ----------------------------------------------------------------------------------------- bad input
def test_bad_input_is_typed_and_names_the_argument():
    q, k, v, g, beta = inputs(2, 8, 2, 4, 16, 8)
    f = G.chunk_gated_delta_rule
    one = lambda x: x.reshape(1, 16, *x.shape[2:])  # noqa: E731
    q1, k1, v1, g1, b1 = map(one, (q, k, v, g, beta))
    cases = [
        (lambda: f(q, k, v[:, :, :3], g[..., :3], beta[..., :3]), ArgumentError, "mismatched head counts"),
        (lambda: f(q, k[..., :8], v, g, beta), ArgumentError, "k must have q's shape"),
        (lambda: f(q, k, v, g[..., None], beta), ArgumentError, r"g must be a 3-D tensor \[B, T, HV\]"),
        (lambda: f(q, k, v, g, beta[..., :2]), ArgumentError, r"beta must be \[B, T, HV\] = \[2, 8, 4\]"),
        (lambda: f(q.half(), k.half(), v, g, beta), DTypeError, "q dtype"),
        (lambda: f(q, k, v, g, beta, initial_state=rand(2, 4, 16, 7)), ArgumentError, "initial_state must be"),
        (lambda: f(q, k, v, g, beta, initial_state=rand(3, 4, 16, 8)), ArgumentError, "initial_state must be"),
        (lambda: f(q, k, v, g, beta, initial_state=rand(2, 4, 16, 8, dtype=BF16)), DTypeError, "initial_state must be"),
        (lambda: f(q, k, v, g, beta, chunk_size=48), ArgumentError, "chunk_size must be a power of two"),
        (lambda: f(q, k, v, g, beta, scale=-1.0), ArgumentError, "scale must be"),
        (lambda: f(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8])), ArgumentError, "B must be 1"),
        (lambda: f(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([1, 16])), ArgumentError, "cu_seqlens must start at 0"),
        (lambda: f(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0, 9, 4, 16])), ArgumentError, "non-decreasing"),
        (lambda: f(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0, 15])), ArgumentError, "end at the token count"),
        (lambda: f(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0.0, 16.0])), ArgumentError, "cu_seqlens must be"),
        (lambda: f(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0, 4, 16]), initial_state=rand(1, 4, 16, 8)),
         ArgumentError, r"initial_state must be \[N, HV, K, V\] = \[2, 4, 16, 8\]"),
    ]
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()


def test_decode_bad_input_leaves_the_pool_unchanged():
    q, k, v, g, beta = inputs(2, 1, 1, 1, 16, 8)
    pool = rand(4, 1, 16, 8)
    before = pool.clone()
    f = G.fused_recurrent_gated_delta_rule
    cases = [
        (lambda: f(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([0, 4])), ArgumentError,
         r"ssm_state_indices must be in \[0, 4\)"),
        (lambda: f(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([1, 1]),
                   inplace_final_state=True), ArgumentError, "distinct"),
        (lambda: f(q, k, v, g, beta, initial_state=pool), ArgumentError, "initial_state must be"),
        (lambda: f(q, k, v, g, beta, inplace_final_state=True), ArgumentError, "needs ssm_state_indices"),
        (lambda: f(q, k, v, g, beta, ssm_state_indices=torch.tensor([0, 1])), ArgumentError, "pass initial_state"),
        (lambda: f(q.requires_grad_(), k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([0, 1])),
         NotSupportedError, "gradients with ssm_state_indices"),
    ]
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()
        assert torch.equal(pool, before)


# ----------------------------------------------------------------------------------------- TPU lowering
@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
@pytest.mark.parametrize("case", range(len(G.STANDARD_SHAPES)))
def test_compile_only(chip, case, tmp_cache):
    """Qwen3-Next-80B-A3B's layer (16 q/k heads, 32 v heads, K = V = 128): prefill 4096 tokens (forward and
    backward, chunk 64) and decode of 64 rows from a 256-slot pool lower with Mosaic."""
    from tpukernels.targets.compile_only import compile_for

    kernel, args, kw = G.STANDARD_SHAPES[case]
    r = compile_for(kernel, chip, *args, with_mlir=False, **kw)
    assert r.ok, r.summary()
    assert r.vmem_estimate_bytes <= G.VMEM_LIMIT_BYTES, r.summary()
