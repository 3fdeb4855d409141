"""tpukernels.library.linear_attention.kda_ops: KDA chunked prefill, recurrent decode, backward.

Ground truth: ``kda_reference``, the float64 naive token recurrence of the same low-precision inputs, checked itself
against flash-linear-attention's own naive references (``fla/ops/kda/naive.py``, loaded by file path: ``fla``'s
``__init__`` imports triton) and against transformers' Kimi-Linear torch fallbacks. Kernels run in Pallas interpret
mode with small chunks (16 tokens) so that lengths of 1, chunk-1, chunk, chunk+1 and several chunks, and packed
sequences crossing chunk boundaries, are all exercised; the NaN-poisoned "tpu" mode runs through ``interpret``.
"""


import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fla_naive  # tests/ is on sys.path (rootdir-relative import)
from tpukernels.errors import ArgumentError, DeviceError, DTypeError
from tpukernels.library.linear_attention import kda_ops as K

BF16, F32 = torch.bfloat16, torch.float32
U = {BF16: 2.0**-8, F32: 2.0**-24}  # one rounding of the float32 output to its dtype
C = 16  # chunk_size of the tests
FNS = {"chunk": K.chunk_kda, "recurrent": K.fused_recurrent_kda}


def inputs(t, *, b=1, h=1, hv=2, kd=16, vd=8, dtype=F32, gate=1.0, seed=0):
    """q, k (unit rows, as after the l2norm the models apply), v, g (log decay in [-gate, 0)), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q, k, v = r(b, t, h, kd), torch.nn.functional.normalize(r(b, t, h, kd), dim=-1), r(b, t, hv, vd)
    g = -torch.rand(b, t, hv, kd, generator=gen, dtype=torch.float64) * gate
    beta = torch.rand(b, t, hv, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def state(n, hv=2, kd=16, vd=8, seed=1):
    return torch.randn(n, hv, kd, vd, generator=torch.Generator().manual_seed(seed))


def check(got, want, dtype, gmax, what=""):
    """``|got - want| <= U |want| + (2**-17 + 2**-24 gmax) (1 + max |want|)``: the output rounded once, float32
    sums, and one float32 ulp of the largest chunk-cumulative log decay ``gmax`` (the chunked form takes
    differences of cumulative gates, as fla's; 0 for the recurrent kernel's per-token decays)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not want.numel():
        return
    err = (got.double() - want).abs()
    bound = U[dtype] * want.abs() + (2.0**-17 + 2.0**-24 * gmax) * (1 + float(want.abs().max()))
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())}/{bad.numel()} out of tolerance, worst {float(err.max()):.3g}"


def gmax(g, fn):
    return float(g.double().abs().max()) * C if fn is K.chunk_kda and g.numel() else 0.0


# ----------------------------------------------------------------------------------------- references
def test_reference_matches_fla_naive_recurrent_and_chunk():
    pytest.importorskip("einops")
    naive = fla_naive.load("kda")
    q, k, v, g, beta = inputs(32, b=2, h=1, hv=2, dtype=torch.float64)
    h0 = state(2).double()
    ref, ref_f = K.kda_reference(q, k, v, g, beta, scale=0.3, initial_state=h0)
    # fla's naive functions compute in float32: compare at float32 accuracy
    for fn, kw in ((naive.naive_recurrent_kda, {}), (naive.naive_chunk_kda, {"chunk_size": 16})):
        o, f = fn(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True, **kw)
        torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f.double(), ref_f, rtol=1e-5, atol=1e-5)
    # the check can tell: another scale is far
    other, _ = K.kda_reference(q, k, v, g, beta, scale=0.31, initial_state=h0)
    assert not torch.allclose(other, ref, rtol=1e-3, atol=1e-3)


def test_matches_transformers_kimi_linear_fallbacks():
    """transformers' Kimi-Linear torch paths (l2norm in the kernel, K ** -0.5 scale, float32 states) against ours."""
    kl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta = inputs(37, b=2, h=2, hv=2, dtype=F32, gate=2.0)
    q, k = q * 3, k * 2  # not unit: the l2norm matters
    h0 = state(2)
    for theirs, ours, kw in ((kl.chunk_kimi_delta_attention, K.chunk_kda, {"chunk_size": 16}),
                             (kl.recurrent_kimi_delta_attention, K.fused_recurrent_kda, {})):
        want, want_f = theirs(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, **kw)
        got, got_f = ours(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                          chunk_size=C)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(got_f, want_f, rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------------------- forward
@settings(max_examples=3)  # each example compiles new shapes (~10 s on 2 busy cores)
@given(
    t=st.sampled_from([1, C - 1, C, C + 1, 3 * C + 5]), fn=st.sampled_from(sorted(FNS)),
    dtype=st.sampled_from([F32, BF16]), gate=st.sampled_from([1e-4, 1.0, 30.0, 1e3]),
    b=st.integers(1, 2), gva=st.booleans(), has_h0=st.booleans(),
)
@example(t=3 * C + 5, fn="chunk", dtype=F32, gate=1e3, b=2, gva=True, has_h0=True)  # decays that underflow
def test_forward_matches_float64(t, fn, dtype, gate, b, gva, has_h0):
    fn = FNS[fn]
    q, k, v, g, beta = inputs(t, b=b, h=1 if gva else 2, hv=2, dtype=dtype, gate=gate)
    h0 = state(b) if has_h0 else None
    h0_copy = None if h0 is None else h0.clone()
    o, f = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    ref, ref_f = K.kda_reference(q, k, v, g, beta, initial_state=h0)
    assert o.dtype == dtype and f.dtype == F32
    check(o, ref, dtype, gmax(g, fn), "o")
    check(f, ref_f, F32, gmax(g, fn), "final_state")
    if h0 is not None:
        assert torch.equal(h0, h0_copy)  # never modified


@settings(max_examples=2)
@given(lens=st.lists(st.sampled_from([0, 1, C - 1, C, C + 1, 2 * C + 3]), min_size=1, max_size=4),
       fn=st.sampled_from(sorted(FNS)), has_h0=st.booleans())
def test_packed_sequences_match_float64(lens, fn, has_h0):
    fn = FNS[fn]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    t = int(cu[-1])
    q, k, v, g, beta = inputs(t, gate=2.0)
    h0 = state(len(lens)) if has_h0 else None
    o, f = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=C)
    ref, ref_f = K.kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    check(o, ref, F32, gmax(g, fn), "o")
    check(f, ref_f, F32, gmax(g, fn), "final_state")


@pytest.mark.parametrize("fn", sorted(FNS))
def test_packed_sequences_never_read_each_other(fn, interpret):
    """A NaN in one packed sequence (inputs and initial state) reaches none of the others' outputs or final
    states, which equal the reference of each sequence alone (NaN-poisoned interpret mode included)."""
    fn = FNS[fn]
    lens = [C + 3, 5, 2 * C - 1]  # boundaries inside chunks; the middle sequence shares a chunk with both others
    cu = torch.tensor([0, lens[0], lens[0] + lens[1], sum(lens)])
    q, k, v, g, beta = inputs(sum(lens), gate=2.0)
    h0 = state(3)
    s1 = slice(lens[0], lens[0] + lens[1])
    for x in (q, k, v, g):
        x[0, s1.start + 1] = float("nan")
    h0[1, 0, 0, 0] = float("nan")
    o, f = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=C)
    for n in (0, 2):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        ref, ref_f = K.kda_reference(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=h0[n:n + 1])
        check(o[:, sl], ref, F32, gmax(g[:, sl], fn), f"seq {n}")
        check(f[n:n + 1], ref_f, F32, gmax(g[:, sl], fn), f"final {n}")
    assert o[:, s1.start + 1:s1.stop].isnan().all() and f[1].isnan().any()  # the poisoned one does see it


@pytest.mark.parametrize("fn", ["chunk", pytest.param("recurrent", marks=pytest.mark.slow)])
def test_two_halves_with_carried_state_equal_the_whole(fn):
    fn = FNS[fn]
    q, k, v, g, beta = inputs(3 * C + 2, gate=1.0)
    whole, whole_f = fn(q, k, v, g, beta, output_final_state=True, chunk_size=C)
    cut = C + 5
    a, fa = fn(*(x[:, :cut] for x in (q, k, v, g, beta)), output_final_state=True, chunk_size=C)
    fa_copy = fa.clone()
    bb, fb = fn(*(x[:, cut:] for x in (q, k, v, g, beta)), initial_state=fa, output_final_state=True, chunk_size=C)
    torch.testing.assert_close(torch.cat([a, bb], 1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fb, whole_f, rtol=1e-5, atol=1e-5)
    assert torch.equal(fa, fa_copy)


def test_decode_steps_equal_prefill():
    """Prefill then one-token fused_recurrent_kda steps (the model's cache loop) equal one chunk_kda of all tokens."""
    q, k, v, g, beta = inputs(C + 4, b=3, dtype=BF16, gate=1.0)
    whole, whole_f = K.chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=C)
    o, s = K.chunk_kda(*(x[:, :C] for x in (q, k, v, g, beta)), output_final_state=True, chunk_size=C)
    outs = [o]
    for i in range(C, C + 4):
        o, s = K.fused_recurrent_kda(*(x[:, i:i + 1] for x in (q, k, v, g, beta)), initial_state=s,
                                     output_final_state=True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=U[BF16], atol=2e-3)
    torch.testing.assert_close(s, whole_f, rtol=1e-5, atol=1e-5)


def test_gate_beta_and_l2norm_options_match_explicit_forms():
    q, k, v, g, beta = inputs(20, h=2, hv=2, gate=1.0)
    raw_g, raw_b = torch.randn(1, 20, 2, 16), torch.randn(1, 20, 2)
    a_log, dt_bias = torch.rand(2) * 2, torch.randn(2 * 16)
    got, _ = K.chunk_kda(q * 3, k * 3, v, raw_g, raw_b, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                         use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, use_qk_l2norm_in_kernel=True,
                         chunk_size=C)
    gate = -a_log.exp()[:, None] * torch.nn.functional.softplus(raw_g + dt_bias.view(2, 16))
    ln = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    ref, _ = K.kda_reference(ln(q * 3), ln(k * 3), v, gate, 2 * torch.sigmoid(raw_b))
    check(got, ref, F32, float(gate.abs().max()) * C, "options")


# ----------------------------------------------------------------------------------------- backward
#: packed sequences of the backward tests: one empty, one sharing a chunk with two others, one spanning two chunks
BWD_CU = torch.tensor([0, C + 3, C + 3, C + 8, 2 * C + 7])


@pytest.mark.parametrize("fn, dtype", [("chunk", F32), pytest.param("chunk", BF16, marks=pytest.mark.slow),
                                       pytest.param("recurrent", F32, marks=pytest.mark.slow)])
def test_backward_matches_float64_autograd(fn, dtype):
    """kda_chunk_bwd after either forward kernel (NaN-poisoned interpret mode): grouped heads, packed sequences,
    initial and final states."""
    import tpukernels.dsl as tk

    fn, cu = FNS[fn], BWD_CU
    q, k, v, g, beta = inputs(int(cu[-1]), h=1, hv=2, dtype=dtype, gate=2.0)
    h0 = state(4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    with tk.interpret_mode("tpu"):
        o, f = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, chunk_size=C)
        # do in o's dtype: autograd rounds the gradient of a bf16 output to bf16 before the kernel sees it
        do = torch.randn(o.shape, dtype=torch.float64).to(dtype).double()
        df = torch.randn(f.shape, dtype=torch.float64)
        grads = torch.autograd.grad((o.double() * do).sum() + (f.double() * df).sum(), leaves)
    d64 = [x.detach().double().requires_grad_() for x in leaves]
    ro, rf = K.kda_reference(*d64[:5], initial_state=d64[5], cu_seqlens=cu)
    want = torch.autograd.grad((ro * do).sum() + (rf * df).sum(), d64)
    for name, got, exp, leaf in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, want, leaves):
        assert got.dtype == leaf.dtype, name
        tol = U[leaf.dtype] * exp.abs() + 2.0**-16 * (1 + float(exp.abs().max()))
        err = (got.double() - exp).abs()
        assert (err <= tol).all(), (name, float(err.max()), float(exp.abs().max()))


def test_backward_of_one_sequence_never_reads_another():
    """A NaN in one packed sequence leaves the other sequences' gradients finite and equal to their gradients
    without it (the backward kernel in NaN-poisoned interpret mode; the shapes of the test above)."""
    import tpukernels.dsl as tk

    cu = BWD_CU
    clean = inputs(int(cu[-1]), h=1, hv=2, gate=2.0)
    dirty = [x.clone() for x in clean]
    for x in dirty[:4]:
        x[0, C + 5] = float("nan")  # in sequence 2 (tokens C + 3 .. C + 7)
    h0 = state(4)
    others = torch.ones(int(cu[-1]), dtype=torch.bool)
    others[C + 3:C + 8] = False
    gen = torch.Generator().manual_seed(3)
    do, df = torch.randn(1, int(cu[-1]), 2, 8, generator=gen), torch.randn(4, 2, 16, 8, generator=gen)
    grads = []
    with tk.interpret_mode("tpu"):
        for xs in (clean, dirty):
            leaves = [x.clone().requires_grad_() for x in (*xs, h0)]
            o, f = K.chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
                               chunk_size=C)
            # the loss reads the other sequences only (torch.where: no NaN * 0 in the loss itself)
            loss = torch.where(others[None, :, None, None], o * do, 0.0).sum() + (f * df)[[0, 1, 3]].sum()
            grads.append(torch.autograd.grad(loss, leaves))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), *grads):
        assert torch.equal(a[0, others], b[0, others]), name
        assert b[0, C + 3:C + 8].isnan().any(), name  # the poisoned sequence's own gradients do see it
    assert torch.equal(grads[0][5][[0, 1, 3]], grads[1][5][[0, 1, 3]])


# ----------------------------------------------------------------------------------------- bad input
def test_bad_input_is_typed_names_the_argument_and_leaves_the_state_unchanged():
    q, k, v, g, beta = inputs(10, b=2, h=2, hv=2)
    h0 = state(2)
    before = h0.clone()
    cu = torch.tensor([0, 4, 10])
    q1, k1, v1, g1, b1 = (x[:1] for x in (q, k, v, g, beta))
    cases = [
        (lambda: K.chunk_kda(q[0], k, v, g, beta), ArgumentError, r"q must be a 4-D tensor"),
        (lambda: K.chunk_kda(q, k[:, :, :1], v, g, beta), ArgumentError, "k must have q's shape"),
        (lambda: K.chunk_kda(q, k, v[:, :, :1], g, beta), ArgumentError, "mismatched head counts"),
        (lambda: K.chunk_kda(q, k, v, g[..., 0], beta), ArgumentError, r"g must be a 4-D tensor \[B, T, HV, K\]"),
        (lambda: K.chunk_kda(q, k, v, g, beta[..., None]), ArgumentError, r"beta must be a 3-D tensor \[B, T, HV\]"),
        (lambda: K.chunk_kda(q.int(), k, v, g, beta), DTypeError, "q dtype"),
        (lambda: K.chunk_kda(q, k, v, g, beta, initial_state=h0[:1]), ArgumentError,
         r"initial_state must be \[N, HV, K, V\] = \[2, 2, 16, 8\]"),
        (lambda: K.chunk_kda(q, k, v, g, beta, initial_state=h0.to(BF16)), DTypeError, "initial_state must be float32"),
        (lambda: K.chunk_kda(q, k, v, g, beta, initial_state=h0.to("meta")), DeviceError, "initial_state is on meta"),
        (lambda: K.chunk_kda(q, k, v, g, beta, cu_seqlens=cu), ArgumentError, "B must be 1"),
        (lambda: K.chunk_kda(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([1, 10])), ArgumentError,
         "cu_seqlens must start at 0, got 1"),
        (lambda: K.chunk_kda(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0, 6, 4, 10])), ArgumentError,
         "cu_seqlens must be non-decreasing"),
        (lambda: K.chunk_kda(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0, 9])), ArgumentError,
         "end at the token count"),
        (lambda: K.chunk_kda(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0.0, 10.0])), ArgumentError,
         "cu_seqlens must be a 1-D int"),
        (lambda: K.chunk_kda(q1, k1, v1, g1, b1, cu_seqlens=cu, initial_state=h0[:1]), ArgumentError,
         r"initial_state must be \[N, HV, K, V\] = \[2, 2, 16, 8\], got \(1,"),
        (lambda: K.chunk_kda(q, k, v, g, beta, chunk_size=48), ArgumentError, "chunk_size must be a power of two"),
        (lambda: K.chunk_kda(q, k, v, g, beta, scale=float("nan")), ArgumentError, "scale must be a positive float"),
        (lambda: K.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True), ArgumentError, "needs A_log"),
        (lambda: K.chunk_kda(q, k, v, g, beta, A_log=torch.zeros(2)), ArgumentError, "only with use_gate_in_kernel"),
        (lambda: K.chunk_kda(q, k, v, g, beta, safe_gate=True), ArgumentError, "safe_gate=True is not supported"),
        (lambda: K.chunk_kda(q, k, v, g, beta, typo=1), ArgumentError, "unknown argument 'typo'"),
        (lambda: K.fused_recurrent_kda(q, k, v, g, beta, allow_neg_eigval=True), ArgumentError,
         "requires use_beta_sigmoid_in_kernel"),
    ]
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()
        assert torch.equal(h0, before)


def test_kernel_op_rejects_inconsistent_internal_args():
    items = torch.from_numpy(K.work_items([0, 8], 8, C))
    q, v = torch.zeros(1, 8, 16), torch.zeros(2, 8, 8)
    with pytest.raises(ArgumentError, match="h0 must be float32"):
        K.kda_chunk_fwd(items, q, q, v, torch.zeros(2, 8, 16), torch.zeros(2, 8, 1), torch.zeros(1, 2, 16, 8,
                        dtype=BF16), 1, 0.25, C, False)
    with pytest.raises(ArgumentError, match="items must be the int32"):
        K.kda_recurrent_fwd(items[:5], q, q, v, torch.zeros(2, 8, 16), torch.zeros(2, 8, 1), None, 1, 0.25, C, False)


def test_work_items_cover_every_token_once():
    cu = [0, 3, 3, 40, 41, 64]
    it = K.work_items(cu, 64, C)
    seq, blk, lo, hi, first, last = it
    covered = sorted(int(b) * C + t for b, a, e in zip(blk, lo, hi) for t in range(a, e))
    assert covered == list(range(64))
    assert list(seq) == sorted(seq) and set(seq) == set(range(5))
    assert [int(s) for s, a, e in zip(seq, lo, hi) if a == e] == [1]  # the empty sequence: one empty item
    assert first.sum() == 5 and last.sum() == 5


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only(chip, tmp_cache):
    """The forward kernels at Kimi-Linear's layer shapes (prefill ``STANDARD_SHAPES``, decode ``DECODE_SHAPES``) and
    the backward (4 heads, two packed sequences, K = V = 128, chunk 64) compile for the chip within the VMEM limit."""
    from tpukernels.targets.compile_only import compile_for

    cases = [(K.kda_chunk_fwd, args, kw) for args, kw in K.STANDARD_SHAPES]
    cases += [(K.kda_recurrent_fwd, args, kw) for args, kw in K.DECODE_SHAPES]
    t, hv, d = 2048, 4, 128
    n = K.work_items([0, 1000, t], t, 64).shape[1]
    x = f"{hv}x{t}x{d}:bf16"
    cases.append((K.kda_chunk_bwd, (f"6x{n}:i32", x, x, x, x, f"{hv}x{t}x1:bf16", f"{n}x{hv}x{d}x{d}:f32", x,
                                    f"2x{hv}x{d}x{d}:f32"), {"n_seq": 2, "scale": d ** -0.5, "chunk": 64}))
    for kern, args, kw in cases:
        r = compile_for(kern, chip, *args, with_mlir=False, **kw)
        assert r.ok, r.summary()
        assert r.vmem_estimate_bytes <= K.VMEM_LIMIT_BYTES, r.summary()


def test_kernel_op_passes_opcheck():
    items = torch.from_numpy(K.work_items([0, 3, 8], 8, C))
    q, k, v, g, beta = (x[0].transpose(0, 1).contiguous() for x in inputs(8))
    args = (items, q, k, v, g, beta[..., None], state(2), 2, 0.25, C, True)
    torch.library.opcheck(torch.ops.tpukernels.kda_recurrent_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
