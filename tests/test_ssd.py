"""tpukernels.library.linear_attention.ssd_ops: Mamba2's SSD chunked scan (forward, backward) and one-step decode.

Ground truth: the float64 per-token recurrence (``ssd_reference``, ``selective_state_update_reference``) of the same
low-precision inputs, itself checked against transformers' torch paths (``mamba2_chunk_scan`` and
``mamba2_selective_state_update``, the fallbacks transformers' Mamba2 mixer calls with mamba_ssm's signatures).
Kernels run in Pallas interpret mode with chunks of 8 tokens (16 once), so lengths of 1, chunk - 1, chunk,
chunk + 1 and several chunks, and sequence starts inside and at the edge of a chunk are exercised; the NaN-poisoned
"tpu" mode runs through the ``interpret`` fixture. Cost: every new kernel signature is a lowering (seconds), so the
tests share a few: [2, 29, 4, 16] x with 2 groups of dstate 8 (4 chunks), its batch-1 form [1, 30, ...], and the
hypothesis test's lengths fall in 1, 2 or 4 chunks.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError, DeviceError, DTypeError
from tpukernels.library.linear_attention import ssd_ops as S

BF16, F32 = torch.bfloat16, torch.float32
U = {BF16: 2.0**-8, F32: 2.0**-24}  # one rounding of the float32 result to the output dtype
#: float32 arithmetic, relative to the sum of |terms| (``mass``): Q-term dot products, exp of cumulative sums,
#: the chunk states; measured <= 2**-22 here, so 2**-16 leaves 64x and still fails on any wrong mask or decay.
F32_REL = 2.0**-16


def rand(*shape, dtype=F32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def inputs(b, l, h, p, g, n, dtype=F32, seed=0):
    """x, dt (raw, before softplus), A (negative), B, C, D [h], z, dt_bias, initial_states."""
    a = -(torch.rand(h, generator=torch.Generator().manual_seed(seed + 9), dtype=torch.float64) + 0.3)
    return dict(x=rand(b, l, h, p, dtype=dtype, seed=seed), dt=rand(b, l, h, dtype=dtype, seed=seed + 1, scale=0.7),
                A=a.float(), B=rand(b, l, g, n, dtype=dtype, seed=seed + 2),
                C=rand(b, l, g, n, dtype=dtype, seed=seed + 3),
                D=rand(h, seed=seed + 4), z=rand(b, l, h, p, dtype=dtype, seed=seed + 5),
                dt_bias=rand(h, seed=seed + 6, scale=0.3), initial_states=rand(b, h, p, n, seed=seed + 7))


def mass(kw, seq_idx=None, cu_seqlens=None):
    """float64 output of the same recurrence on |x|, |B|, |C|, |D|, |initial_states|, times |silu(z)|: the sum of
    the magnitudes of the terms of each output (the scale of float32 rounding errors)."""
    ab = {k: (v.abs() if k in ("x", "B", "C", "D", "initial_states") and v is not None else v)
          for k, v in kw.items() if k != "z"}
    m, _, _ = S.ssd_reference(**ab, seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_softplus=True)
    if kw.get("z") is not None:
        z = kw["z"].double()
        m = m * (z * torch.sigmoid(z)).abs()
    return m


def check(got, want, m, dtype, what=""):
    """|got - want| <= U[dtype] |want| + F32_REL (mass + |want|) elementwise."""
    assert got.shape == want.shape and got.dtype == dtype, (what, got.shape, want.shape, got.dtype)
    err = (got.double() - want).abs()
    bound = U[dtype] * want.abs() + F32_REL * (m + want.abs()) + 1e-30
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())}/{bad.numel()} out of tolerance, worst {float(err[bad].max()):.3g}"


def check_state(got, want, what="", dtype=F32):
    """A returned state (C's dtype by default, as mamba_ssm): float32 arithmetic rounded once to ``dtype``."""
    assert got.dtype == dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    err = (got.double() - want).abs()
    assert bool((err <= U[dtype] * want.abs() + F32_REL * (want.abs() + want.abs().max() + 1)).all()), (
        what, float(err.max()))


def packed(lens):
    """``(cu_seqlens, seq_idx [1, L])`` int32 of sequences of these lengths packed in one row."""
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None].to(torch.int32)
    return cu, seq_idx


# ----------------------------------------------------------------------------------------- peer references
def test_reference_and_kernels_match_transformers_mamba2_torch_paths():
    """transformers' Mamba2 fallbacks (the chunked torch path its mixer runs without mamba_ssm, and its one-step
    update) on the same float32 values: our float64 reference and our kernels agree with them."""
    m2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    scan = getattr(m2.mamba2_chunk_scan, "__wrapped__", m2.mamba2_chunk_scan)
    kw = inputs(2, 29, 4, 16, 2, 8)
    args = (kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"])
    opts = dict(D=kw["D"], dt_bias=kw["dt_bias"], initial_states=kw["initial_states"], dt_softplus=True,
                dt_limit=(0.05, 1.5), return_final_states=True)
    p_out, p_final = scan(*args, 8, **opts)
    ref, ref_final, _ = S.ssd_reference(*args, D=kw["D"], dt_bias=kw["dt_bias"],
                                        initial_states=kw["initial_states"], dt_softplus=True, dt_limit=(0.05, 1.5))
    torch.testing.assert_close(p_out.double(), ref, rtol=1e-4, atol=1e-4)  # the two references agree
    torch.testing.assert_close(p_final.double(), ref_final, rtol=1e-4, atol=1e-4)
    out, final = S.mamba_chunk_scan_combined(*args, 8, **opts)
    torch.testing.assert_close(out, p_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, p_final, rtol=1e-4, atol=1e-4)

    upd = getattr(m2.mamba2_selective_state_update, "__wrapped__", m2.mamba2_selective_state_update)
    h, p, n = 4, 16, 8
    x, dt, z = rand(3, h, p, seed=1), rand(3, h, seed=2)[..., None].expand(3, h, p), rand(3, h, p, seed=3)
    A = kw["A"][:, None, None].expand(h, p, n)  # Mamba2's tied A / dt / dt_bias, as its mixer passes them
    bias = kw["dt_bias"][:, None].expand(h, p)
    D = kw["D"][:, None].expand(h, p)
    B, C = rand(3, 2, n, seed=4), rand(3, 2, n, seed=5)
    s_ours, s_peer = rand(3, h, p, n, seed=6), rand(3, h, p, n, seed=6)
    o_peer = upd(s_peer, x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True, z=z)
    o_ours = S.selective_state_update(s_ours, x, dt, A, B, C, D, z, bias, True)
    torch.testing.assert_close(o_ours, o_peer, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_ours, s_peer, rtol=1e-5, atol=1e-5)


def test_drop_in_for_transformers_mamba2_mixer(monkeypatch):
    """A tiny random transformers Mamba2 LM (tests/hf_tiny.py: 4 heads, chunk 8) with our two functions in place of
    the torch paths its mixers call by these names: the logits of a 13-token prefill match stock, and
    greedy generate() with the model's own cache (prefill, then one-step decodes with its tied A / dt / D
    expanded over head_dim) gives the same tokens."""
    m2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    from hf_tiny import tiny_causal_lm  # tests/ is on sys.path (pytest's rootdir-relative import), as the sweep's

    model = tiny_causal_lm("mamba2").eval()
    ids = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, ref_tokens = model(ids).logits, model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=True)
    monkeypatch.setattr(m2, "mamba2_chunk_scan", S.mamba_chunk_scan_combined)
    monkeypatch.setattr(m2, "mamba2_selective_state_update", S.selective_state_update)
    with torch.no_grad():
        got, tokens = model(ids).logits, model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, ref_tokens)


# ----------------------------------------------------------------------------------------- forward
@settings(max_examples=6)  # derandomized ("ci" profile): every length class, both packings, bf16 among them
@given(
    where=st.sampled_from(["1", "q-1", "q", "q+1", "several"]), g=st.sampled_from([1, 2]),
    dtype=st.sampled_from([F32, BF16]), d_kind=st.sampled_from([None, "h", "hp"]), has_z=st.booleans(),
    has_init=st.booleans(), packing=st.sampled_from([None, "seq_idx", "cu_seqlens"]),
)
def test_forward_matches_float64(where, g, dtype, d_kind, has_z, has_init, packing):
    q = 8
    l = {"1": 1, "q-1": q - 1, "q": q, "q+1": q + 1, "several": 3 * q + 5}[where]
    h, p, n = 4, 16, 8
    b = 1
    kw = inputs(b, l, h, p, g, n, dtype)
    kw["D"] = None if d_kind is None else (kw["D"] if d_kind == "h" else rand(h, p, seed=11))
    kw["z"] = kw["z"] if has_z else None
    kw["initial_states"] = kw["initial_states"] if has_init else None
    seq_idx = cu = None
    if packing is not None and l > 2:
        cu, seq_idx = packed([l // 3, 1, l - l // 3 - 1])
        seq_idx = seq_idx.expand(b, l) if packing == "seq_idx" else None
        cu = cu if packing == "cu_seqlens" else None
    before = None if kw["initial_states"] is None else kw["initial_states"].clone()
    res = S.mamba_chunk_scan_combined(**kw, chunk_size=q, seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True,
                                      return_final_states=True, return_varlen_states=cu is not None)
    out, final = res[0], res[1]
    assert out.is_contiguous(), "callers .view() the output (transformers' FalconH1Mixer), as mamba_ssm's allows"
    ref, ref_final, ref_varlen = S.ssd_reference(**kw, seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True)
    check(out, ref, mass(kw, seq_idx, cu), dtype, "out")
    check_state(final, ref_final, "final_states", dtype)
    if cu is not None:
        check_state(res[2], ref_varlen, "varlen_states", dtype)
    if before is not None:
        assert torch.equal(kw["initial_states"], before)


def test_chunk_size_and_split_with_carried_state_do_not_change_the_result():
    """The scan is the recurrence whatever the chunking: chunk 8 vs 32, and two calls with the first one's final
    state passed as the second's initial state, agree with one call (float32 rounding only)."""
    kw = inputs(1, 30, 4, 16, 2, 8)
    kw.pop("z")
    one, fin = S.mamba_chunk_scan_combined(**kw, chunk_size=8, dt_softplus=True, return_final_states=True)
    other = S.mamba_chunk_scan_combined(**kw, chunk_size=16, dt_softplus=True)
    torch.testing.assert_close(other, one, rtol=1e-5, atol=1e-5)
    first = {k: (v[:, :16] if k in ("x", "dt", "B", "C") else v) for k, v in kw.items()}
    second = {k: (v[:, 16:] if k in ("x", "dt", "B", "C") else v) for k, v in kw.items()}
    a, fa = S.mamba_chunk_scan_combined(**first, chunk_size=8, dt_softplus=True, return_final_states=True)
    second["initial_states"] = fa
    b_, fb = S.mamba_chunk_scan_combined(**second, chunk_size=8, dt_softplus=True, return_final_states=True)
    torch.testing.assert_close(torch.cat([a, b_], 1), one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fb, fin, rtol=1e-5, atol=1e-5)
    _, fin16 = S.mamba_chunk_scan_combined(**kw, chunk_size=8, dt_softplus=True, return_final_states=True,
                                           state_dtype=BF16)
    assert fin16.dtype == BF16 and torch.equal(fin16, fin.to(BF16))  # state_dtype: the returned states' dtype
    ref, _, _ = S.ssd_reference(**kw, dt_softplus=True)
    fresh, _, _ = S.ssd_reference(**{**second, "initial_states": None}, dt_softplus=True)
    assert (one.double() - ref).abs().max() < 1e-4 < (ref[:, 16:] - fresh).abs().max()  # the carried state matters


# ----------------------------------------------------------------------------------------- packed sequences
def test_packed_sequences_never_see_each_other(interpret):
    """A NaN in one packed sequence (seq_idx or cu_seqlens) reaches no other sequence's outputs, final / varlen
    states or gradients; the others equal the reference of their sequence alone (NaN-poisoned memory included:
    scratch and the blocks of every step start as NaN in "tpu" mode)."""
    lens = [13, 3, 14]  # starts inside a chunk (13) and at a chunk edge (16); 30 tokens = 3 chunks + a tail
    cu, seq_idx = packed(lens)
    starts = [0, 13, 16, 30]
    kw = inputs(1, 30, 4, 16, 2, 8)
    kw["x"][0, 14, 1, 3] = float("nan")  # in sequence 1
    leaves = {k: kw[k].clone().requires_grad_() for k in ("x", "B", "C", "z")}
    for how in ("seq_idx", "cu_seqlens"):
        args = {**kw, **leaves}
        out, final = S.mamba_chunk_scan_combined(**args, chunk_size=8, dt_softplus=True, return_final_states=True,
                                                 **({"seq_idx": seq_idx} if how == "seq_idx" else {"cu_seqlens": cu}))
        gx, gb, gc, gz = torch.autograd.grad(out.nansum(), [leaves[k] for k in ("x", "B", "C", "z")])
        for s in (0, 2):
            sl = slice(starts[s], starts[s + 1])
            alone = {k: (v[:, sl] if k in ("x", "dt", "B", "C", "z") else v) for k, v in kw.items()}
            if s:
                alone["initial_states"] = None  # the initial state is sequence 0's (seq_idx 0)
            ref, ref_final, _ = S.ssd_reference(**alone, dt_softplus=True)
            check(out[:, sl], ref, mass(alone), F32, f"{how}: sequence {s}")
            for name, gr in (("dx", gx), ("dB", gb), ("dC", gc), ("dz", gz)):
                assert torch.isfinite(gr[:, sl]).all(), (how, name, s)
        check_state(final, ref_final, f"{how}: final state (sequence 2's)")
        assert out[:, starts[1]:starts[2]].isnan().any()  # the poisoned sequence itself does see it
    with torch.no_grad():
        _, varlen = S.mamba_chunk_scan_combined(**kw, chunk_size=8, cu_seqlens=cu, dt_softplus=True,
                                                return_varlen_states=True)
    _, _, ref_varlen = S.ssd_reference(**kw, cu_seqlens=cu, dt_softplus=True)
    for s in (0, 2):
        check_state(varlen[s], ref_varlen[s], f"varlen state {s}")
    assert varlen[1].isnan().any()


def test_initial_state_belongs_to_seq_idx_zero_and_empty_sequences_have_zero_state():
    kw = inputs(2, 29, 4, 16, 2, 8)
    kw.pop("z")
    seq_idx = torch.tensor([[0] * 7 + [1] * 22, [1] * 7 + [2] * 22])  # row 1 has no sequence 0: no initial state
    out = S.mamba_chunk_scan_combined(**kw, chunk_size=8, seq_idx=seq_idx, dt_softplus=True)
    ref, _, _ = S.ssd_reference(**kw, seq_idx=seq_idx, dt_softplus=True)
    check(out, ref, mass(kw, seq_idx), F32, "out")
    without = S.ssd_reference(**{**kw, "initial_states": None}, seq_idx=seq_idx, dt_softplus=True)[0]
    assert torch.equal(ref[1], without[1]) and not torch.allclose(ref[0, :7], without[0, :7])
    cu = torch.tensor([0, 0, 9, 9, 29])
    kw1 = {k: (v[:1] if k not in ("A", "D", "dt_bias") else v) for k, v in kw.items()}
    with torch.no_grad():
        _, varlen = S.mamba_chunk_scan_combined(**kw1, chunk_size=8, cu_seqlens=cu, dt_softplus=True,
                                                return_varlen_states=True)
    _, _, ref_varlen = S.ssd_reference(**kw1, cu_seqlens=cu, dt_softplus=True)
    assert torch.equal(varlen[0], torch.zeros_like(varlen[0])) and torch.equal(varlen[2], torch.zeros_like(varlen[2]))
    check_state(varlen, ref_varlen, "varlen with empty sequences")


# ----------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("dtype, g, packing", [(F32, 2, "seq_idx"), (BF16, 4, None)])
def test_backward_matches_float64(dtype, g, packing):
    """Gradients of out and final_states for x, dt, A, B, C, D, z, dt_bias and initial_states against float64
    autograd through the per-token recurrence."""
    b, l, h, p, n = 2, 29, 4, 16, 8
    kw = inputs(b, l, h, p, g, n, dtype)
    if g == 4:
        kw["D"] = rand(h, p, seed=12)
    seq_idx = packed([10, 19])[1].expand(b, l) if packing else None
    leaves = {k: v.clone().requires_grad_() for k, v in kw.items()}
    out, final = S.mamba_chunk_scan_combined(**leaves, chunk_size=8, seq_idx=seq_idx, dt_softplus=True,
                                             dt_limit=(0.0, 1.2), return_final_states=True)
    # gradients exact in out's / final's dtype (autograd rounds them to it)
    go, gf = rand(*out.shape, dtype=dtype, seed=20).float(), rand(*final.shape, dtype=dtype, seed=21).float()
    grads = torch.autograd.grad((out.float() * go).sum() + (final * gf).sum(), list(leaves.values()))
    d64 = {k: v.detach().double().requires_grad_() for k, v in kw.items()}
    ref, ref_final, _ = S.ssd_reference(**d64, seq_idx=seq_idx, dt_softplus=True, dt_limit=(0.0, 1.2))
    want = torch.autograd.grad((ref * go.double()).sum() + (ref_final * gf.double()).sum(), list(d64.values()))
    for name, got, exp in zip(leaves, grads, want):
        assert got.dtype == kw[name].dtype and got.shape == exp.shape, name
        scale = float(exp.abs().max()) + 1
        # float32 sums over the sequence, rounded once to the input's dtype; a bf16 input's gradient is the sum of
        # two bf16-rounded terms (the scan's and the D skip's / the group sum's), each up to ~scale
        tol = U[got.dtype] * exp.abs() + (2.0**-7 if got.dtype == BF16 else 2.0**-16) * scale
        err = (got.double() - exp).abs()
        assert bool((err <= tol).all()), (name, float(err.max()), scale)


def test_gradcheck_float32():
    """torch.autograd.gradcheck (fast mode, float32, test_gradcheck.py's EPS / tolerances) of the whole op."""
    kw = inputs(1, 30, 4, 16, 2, 8)
    names = list(kw)
    leaves = tuple(kw[k].clone().requires_grad_() for k in names)

    def fn(*ts):
        out, final = S.mamba_chunk_scan_combined(**dict(zip(names, ts)), chunk_size=8, dt_softplus=True,
                                                 return_final_states=True)
        return out, final

    assert torch.autograd.gradcheck(fn, leaves, eps=3e-2, atol=1e-8, rtol=5e-3, fast_mode=True)


def test_varlen_states_refuse_gradients():
    kw = inputs(1, 10, 2, 8, 1, 8)
    x = kw.pop("x").requires_grad_()
    with pytest.raises(ArgumentError, match="return_varlen_states is not differentiable"):
        S.mamba_chunk_scan_combined(x, **kw, chunk_size=8, cu_seqlens=torch.tensor([0, 4, 10]),
                                    return_varlen_states=True)


# ----------------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("heads, indexed, dtype", [(True, True, F32), (False, False, F32), (True, False, BF16)])
def test_selective_state_update_matches_reference(heads, indexed, dtype):
    bt, h, p, n, g = 3, 4 if heads else 1, 16, 8, 2 if heads else 1
    pool = rand(5 if indexed else bt, h, p, n, dtype=dtype, seed=1)
    x, dt, z = rand(bt, h, p, dtype=dtype, seed=2), rand(bt, h, p, dtype=dtype, seed=3), rand(bt, h, p, seed=4)
    A = -rand(h, p, n, seed=5).abs()
    B, C = rand(bt, g, n, dtype=dtype, seed=6), rand(bt, g, n, dtype=dtype, seed=7)
    D, bias = rand(h, p, seed=8), rand(h, p, seed=9)
    idx = torch.tensor([4, -1, 0], dtype=torch.int32) if indexed else None
    before = pool.clone()
    per_row = (lambda t: t) if heads else (lambda t: t[:, 0])  # noqa: E731  [batch, 1, ...] -> [batch, ...]
    per_head = (lambda t: t) if heads else (lambda t: t[0])  # noqa: E731  [1, ...] -> [...]
    state = pool if heads else pool[:, 0].contiguous()
    out = S.selective_state_update(state, per_row(x), per_row(dt), per_head(A), per_row(B), per_row(C), per_head(D),
                                   per_row(z), per_head(bias), True, idx)
    rows = torch.tensor([4, 0, 0]) if indexed else torch.arange(bt)
    ref_out, ref_state = S.selective_state_update_reference(before[rows], x, dt, A, B, C, D, z, bias, True)
    live = torch.tensor([True, not indexed, True])
    got = out if heads else out[:, None]
    err = (got[live].double() - ref_out[live]).abs()
    bound = U[dtype] * ref_out[live].abs() + 1e-5 * (ref_out[live].abs().max() + 1)
    assert bool((err <= bound).all()), float(err.max())
    if indexed:
        assert torch.equal(got[1], torch.zeros_like(got[1]))  # padding row
    new = state if heads else state[:, None]
    upd = rows[live]
    # float32 arithmetic rounded once to the state's dtype vs float64 rounded once: one ulp apart at most
    torch.testing.assert_close(new[upd].double(), ref_state[live].to(dtype).double(), rtol=2 * U[dtype], atol=1e-6)
    untouched = torch.ones(new.shape[0], dtype=torch.bool)
    untouched[upd] = False
    assert torch.equal(new[untouched], before[untouched])


def test_decode_steps_equal_the_scan_and_the_functional_step():
    """Token-by-token decode from a state equals the chunked scan of the same tokens (out and final state);
    selective_state_step returns the same without touching its input."""
    kw = inputs(2, 29, 4, 16, 2, 8)
    out, final = S.mamba_chunk_scan_combined(**kw, chunk_size=8, dt_softplus=True, return_final_states=True)
    h, p, n = 4, 16, 8
    A = kw["A"][:, None, None].expand(h, p, n)
    D, bias = kw["D"][:, None].expand(h, p), kw["dt_bias"][:, None].expand(h, p)
    state = kw["initial_states"].clone()
    steps = []
    for t in range(29):
        dt = kw["dt"][:, t, :, None].expand(2, h, p)
        if t == 3:
            kept = state.clone()
            o, new = S.selective_state_step(state, kw["x"][:, t], dt, A, kw["B"][:, t], kw["C"][:, t], D,
                                            kw["z"][:, t], bias, True)
            assert torch.equal(state, kept)
        o2 = S.selective_state_update(state, kw["x"][:, t], dt, A, kw["B"][:, t], kw["C"][:, t], D, kw["z"][:, t],
                                      bias, True)
        if t == 3:
            assert torch.equal(o, o2) and torch.equal(new, state)
        steps.append(o2)
    torch.testing.assert_close(torch.stack(steps, 1), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------- bad input
def test_bad_input_is_typed_and_names_the_argument():
    kw = inputs(2, 10, 4, 8, 2, 8)
    f = S.mamba_chunk_scan_combined

    def call(**over):
        args = {**kw, "chunk_size": 8, **over}
        return f(**args)

    i32 = torch.int32
    cases = [
        (dict(x=kw["x"][0]), ArgumentError, "x must be a 4-D tensor"),
        (dict(x=kw["x"].to(i32)), DTypeError, "x dtype"),
        (dict(dt=kw["dt"][:, :9]), ArgumentError, r"dt must be \[batch, seqlen, nheads\]"),
        (dict(A=kw["A"][:3]), ArgumentError, r"A must be \[nheads\] = \[4\]"),
        (dict(B=rand(2, 10, 3, 8), C=rand(2, 10, 3, 8)), ArgumentError, "ngroups G dividing nheads H = 4"),
        (dict(C=rand(2, 10, 2, 4)), ArgumentError, "C must be B's shape"),
        (dict(chunk_size=12), ArgumentError, "chunk_size must be a power of two"),
        (dict(chunk_size=4), ArgumentError, "chunk_size must be a power of two >= 8"),
        (dict(chunk_size=8.0), ArgumentError, "chunk_size"),
        (dict(D=rand(3)), ArgumentError, "D must be"),
        (dict(z=kw["z"][:, :5]), ArgumentError, "z must be x's shape"),
        (dict(dt_bias=rand(4, 1)), ArgumentError, "dt_bias must be"),
        (dict(initial_states=rand(2, 4, 8, 4)), ArgumentError, r"initial_states must be \[batch, nheads, headdim"),
        (dict(initial_states=kw["initial_states"].to(i32)), DTypeError, "initial_states dtype"),
        (dict(seq_idx=torch.zeros(2, 9, dtype=i32)), ArgumentError, "seq_idx must be an int32/int64 tensor"),
        (dict(seq_idx=torch.tensor([[0] * 5 + [1] * 5, [1] * 5 + [0] * 5])), ArgumentError, "non-decreasing"),
        (dict(cu_seqlens=torch.tensor([0, 10])), ArgumentError, "batch must be 1"),
        (dict(return_varlen_states=True), ArgumentError, "return_varlen_states needs cu_seqlens"),
        (dict(dt_limit=(1.0, 0.5)), ArgumentError, "dt_limit must have min <= max"),
        (dict(dt_limit=3), ArgumentError, "dt_limit must be a pair"),
        (dict(dt_softplus="yes"), ArgumentError, "dt_softplus must be a bool"),
        (dict(D=torch.zeros(4, device="meta")), DeviceError, "D is on meta"),
        (dict(state_dtype=torch.int32), DTypeError, "state_dtype must be"),
    ]
    one = {k: (v[:1] if k not in ("A", "D", "dt_bias") else v) for k, v in kw.items()}
    cases1 = [
        (dict(cu_seqlens=torch.tensor([1, 10])), "cu_seqlens must start at 0"),
        (dict(cu_seqlens=torch.tensor([0, 6, 4, 10])), "never decrease"),
        (dict(cu_seqlens=torch.tensor([0, 9])), "end at the token count"),
        (dict(cu_seqlens=torch.tensor([0.0, 10.0])), "cu_seqlens must be a 1-D int32/int64"),
        (dict(cu_seqlens=torch.tensor([0, 4, 10]), seq_idx=torch.tensor([[0] * 5 + [1] * 5])), "disagree"),
    ]
    for over, err, msg in cases:
        with pytest.raises(err, match=msg):
            call(**over)
    for over, msg in cases1:
        with pytest.raises(ArgumentError, match=msg):
            f(**one, chunk_size=8, **over)


def test_update_bad_input_leaves_the_state_unchanged():
    h, p, n = 4, 8, 8
    state = rand(3, h, p, n)
    x, dt, A, B = rand(2, h, p), rand(2, h, p), -rand(h, p, n).abs(), rand(2, 2, n)
    before = state.clone()
    idx = torch.tensor([0, 1])
    cases = [
        (lambda: S.selective_state_update(state, x, dt, A, B, B), ArgumentError, "state must have batch = 2 rows"),
        (lambda: S.selective_state_update(state[..., :4], x, dt, A, B, B, state_batch_indices=idx), ArgumentError,
         r"A must be \[nheads, dim, dstate\]"),
        (lambda: S.selective_state_update(state, x, dt, A, rand(2, 3, n), rand(2, 3, n), state_batch_indices=idx),
         ArgumentError, "ngroups G dividing nheads"),
        (lambda: S.selective_state_update(state, x, dt[:, :2], A, B, B, state_batch_indices=idx), ArgumentError,
         "dt must be x's shape"),
        (lambda: S.selective_state_update(state, x, dt, A, B, B, state_batch_indices=torch.tensor([0, 3])),
         ArgumentError, "state_batch_indices must be < 3"),
        (lambda: S.selective_state_update(state, x, dt, A, B, B, state_batch_indices=torch.tensor([1, 1])),
         ArgumentError, "distinct"),
        (lambda: S.selective_state_update(state, x, dt, A, B, B, state_batch_indices=torch.tensor([0.0, 1.0])),
         ArgumentError, "state_batch_indices must be an int32/int64"),
        (lambda: S.selective_state_update(state.to(torch.int32), x, dt, A, B, B, state_batch_indices=idx), DTypeError,
         "state dtype"),
        (lambda: S.selective_state_update(state, x[0], dt, A, B, B), ArgumentError,
         r"x must be \[batch, nheads, dim\]"),
        (lambda: S.selective_state_update(state, x, dt, A, B, B, D=rand(h), state_batch_indices=idx), ArgumentError,
         r"D must be \[nheads, dim\]"),
    ]
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()
        assert torch.equal(state, before)


def test_kernel_op_rejects_inconsistent_internal_args():
    dt = torch.zeros(1, 2, 8, 1)
    seg, runs = torch.zeros(1, 8, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    x, B = rand(1, 2, 8, 16), rand(1, 2, 8, 8)
    with pytest.raises(ArgumentError, match="chunk_size must be a power of two"):
        S.ssd_chunk_scan_fwd(runs, dt, dt, seg, x, B, B, None, 6)
    with pytest.raises(ArgumentError, match="init must be"):
        S.ssd_chunk_scan_fwd(runs, dt, dt, seg, x, B, B, rand(1, 2, 16, 4), 8)
    with pytest.raises(ArgumentError, match=r"runs must be \[3\]"):
        S.ssd_chunk_scan_fwd(runs[:2], dt, dt, seg, x, B, B, None, 8)
    with pytest.raises(DTypeError, match="seg"):
        S.ssd_chunk_scan_fwd(runs, dt, dt, seg.float(), x, B, B, None, 8)


def test_kernel_op_passes_opcheck():
    dt, a = rand(1, 2, 8, 1).abs(), -rand(1, 2, 8, 1, seed=1).abs()
    seg, runs = torch.zeros(1, 8, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    args = (runs, dt, a, seg, rand(1, 2, 8, 16, seed=2), rand(1, 1, 8, 8, seed=3), rand(1, 1, 8, 8, seed=4),
            rand(1, 2, 16, 8, seed=5), 8)
    torch.library.opcheck(torch.ops.tpukernels.ssd_chunk_scan_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only(chip, tmp_cache):
    from tpukernels.targets.compile_only import compile_for

    for kernel, args, kw in S.STANDARD_SHAPES:
        r = compile_for(kernel, chip, *args, with_mlir=False, **kw)
        assert r.ok, r.summary()
