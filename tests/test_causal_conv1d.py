"""tpukernels.library.causal_conv1d: the short causal depthwise conv of hybrid layers, prefill, decode, backward.

Ground truth: the float64 naive tap loop (``causal_conv1d_reference``) of the same low-precision inputs, checked
itself against ``torch.nn.functional.conv1d`` (the formula Dao's ``causal_conv1d_ref`` uses) and against
tpu-inference 0.32.0's ragged JAX implementation (``ragged_conv1d_mixed_prefill`` / ``_decode_only``). Kernels
run in Pallas interpret mode, with small blocks (8 channels x 128 tokens) so that the 128-token halo between
blocks and the channel tail are exercised; the NaN-poisoned "tpu" mode runs through the ``interpret`` fixture.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError, DeviceError, DTypeError
from tpukernels.library import causal_conv1d as C

BF16, F32 = torch.bfloat16, torch.float32
U = {BF16: 2.0**-8, F32: 2.0**-24}  # one rounding of the float32 result to the output dtype


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """8 channels x 128 tokens per grid step (the heuristic would take all of a test's L in one block)."""
    monkeypatch.setattr(C.causal_conv1d_fwd, "heuristic", lambda *a, **k: {"block_d": 8, "block_l": 128})
    C.causal_conv1d_fwd._plans.clear()
    yield
    C.causal_conv1d_fwd._plans.clear()


def rand(*shape, dtype=F32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def tap_mass(x, weight, bias, init):
    """float64 ``sum_k |w_k x_{t-k}| + |b|`` per output: the scale of the float32 rounding errors."""
    ref, _ = C.causal_conv1d_reference(x.abs(), weight.abs(), None if bias is None else bias.abs(), None,
                                       initial_states=None if init is None else init.abs())
    return ref


def check(got, want, mass, dtype, what=""):
    """|got - want| <= U[dtype] |want| + 16 * 2**-24 * (mass + |want|) elementwise (want float64): the once-
    rounded output plus float32 sums of W products and a float32 sigmoid."""
    assert got.shape == want.shape and got.dtype == dtype, (what, got.shape, want.shape, got.dtype)
    err = (got.double() - want).abs()
    bound = U[dtype] * want.abs() + 16 * 2.0**-24 * (mass + want.abs()) + 1e-30
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())}/{bad.numel()} out of tolerance, worst {float(err[bad].max()):.3g}"


# ----------------------------------------------------------------------------------------- references
def test_reference_matches_torch_conv1d_and_dao_formula():
    x, w, b, init = rand(2, 5, 9), rand(5, 4, seed=1), rand(5, seed=2), rand(2, 5, 3, seed=3)
    out, final = C.causal_conv1d_reference(x, w, b, None, initial_states=init)
    want = torch.nn.functional.conv1d(torch.cat([init, x], -1).double(), w.double()[:, None], b.double(), groups=5)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(final, torch.cat([init, x], -1).double()[..., -3:])
    silu, _ = C.causal_conv1d_reference(x, w, b, "silu", initial_states=init)
    torch.testing.assert_close(silu, torch.nn.functional.silu(want))


def test_matches_tpu_inference_ragged_reference():
    jnp = pytest.importorskip("jax.numpy")
    rc = pytest.importorskip("tpu_inference.layers.common.ragged_conv1d_jax")
    d, w, lens = 24, 4, [5, 1, 0, 140, 2]  # a 1-token and an empty sequence, one spanning two blocks
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
    n, t = len(lens), int(cu[-1])
    x, weight, bias = rand(1, d, t), rand(d, w, seed=1), rand(d, seed=2)
    state = rand(n, d, w - 1, seed=3)
    has_init = torch.tensor([True, False, True, True, False])
    init = torch.where(has_init[:, None, None], state, 0.0)
    out, final = C.causal_conv1d_fn(x, weight, bias, activation=None, cu_seqlens=cu, initial_states=init,
                                    return_final_states=True)
    import jax

    prefill = jax.jit(rc.ragged_conv1d_mixed_prefill, static_argnames="kernel_size")  # one compile, not per op
    p_out, p_state = prefill(
        jnp.asarray(x[0].T.numpy()), jnp.asarray(state.transpose(1, 2).numpy()),
        jnp.asarray(weight[:, None, :].numpy()), jnp.asarray(bias.numpy()), jnp.asarray(cu.numpy()),
        jnp.arange(n, dtype=jnp.int32), jnp.asarray([0, 0, n], dtype=jnp.int32), jnp.asarray(has_init.numpy()),
        kernel_size=w)
    p_out = torch.from_numpy(np.asarray(p_out)).T[None]
    p_state = torch.from_numpy(np.asarray(p_state)).transpose(1, 2)
    ref, ref_final = C.causal_conv1d_reference(x, weight, bias, None, cu_seqlens=cu, initial_states=init)
    torch.testing.assert_close(p_out.double(), ref, rtol=1e-5, atol=1e-5)  # the two references agree
    check(out, ref, tap_mass(x, weight, bias, None) + 10, F32, "out vs float64")
    torch.testing.assert_close(out, p_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, p_state, rtol=0, atol=0)
    torch.testing.assert_close(final.double(), ref_final, rtol=0, atol=0)


def test_update_matches_tpu_inference_decode_reference():
    """tpu-inference's decode path (token-major ``x [T, D]``, ``conv_state [S, W-1, D]`` gathered by
    ``state_indices``) against ``causal_conv1d_update`` on the same values in Dao's layout."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    rc = pytest.importorskip("tpu_inference.layers.common.ragged_conv1d_jax")
    t, d, w, slots = 3, 16, 4, 5
    x, weight, bias = rand(t, d), rand(d, w, seed=1), rand(d, seed=2)
    pool = rand(slots, d, w - 1, seed=3)  # ours: [slots, D, W-1]
    idx = torch.tensor([3, 0, 4], dtype=torch.int32)
    decode = jax.jit(rc.ragged_conv1d_decode_only, static_argnames="kernel_size")
    p_out, p_state = decode(
        jnp.asarray(x.numpy()), jnp.asarray(pool.transpose(1, 2).numpy()), jnp.asarray(weight[:, None, :].numpy()),
        jnp.asarray(bias.numpy()), jnp.arange(t + 1, dtype=jnp.int32), jnp.asarray(idx.numpy()),
        jnp.asarray([t, t, t], dtype=jnp.int32), jnp.ones(t, dtype=bool), kernel_size=w)
    out = C.causal_conv1d_update(x, pool, weight, bias, None, conv_state_indices=idx)
    torch.testing.assert_close(out, torch.from_numpy(np.array(p_out)), rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, torch.from_numpy(np.array(p_state)).transpose(1, 2))


# ----------------------------------------------------------------------------------------- forward
@settings(max_examples=8)
@given(
    b=st.integers(1, 2), d=st.sampled_from([3, 8, 20]), l=st.sampled_from([1, 7, 128, 129, 300]),
    w=st.integers(2, 4), dtype=st.sampled_from([F32, BF16]), has_bias=st.booleans(),
    activation=st.sampled_from([None, "silu", "swish"]), has_init=st.booleans(),
)
def test_forward_matches_float64(b, d, l, w, dtype, has_bias, activation, has_init):
    x, weight = rand(b, d, l, dtype=dtype, scale=2), rand(d, w, dtype=dtype, seed=1)
    bias = rand(d, dtype=dtype, seed=2) if has_bias else None
    init = rand(b, d, w - 1, dtype=dtype, seed=3) if has_init else None
    init_copy = None if init is None else init.clone()
    out, final = C.causal_conv1d_fn(x, weight, bias, activation=activation, initial_states=init,
                                    return_final_states=True)
    ref, ref_final = C.causal_conv1d_reference(x, weight, bias, activation, initial_states=init)
    check(out, ref, tap_mass(x, weight, bias, init), dtype, "out")
    assert final.dtype == dtype and torch.equal(final.double(), ref_final)  # copies of inputs: exact
    if init is not None:
        assert torch.equal(init, init_copy)


def test_float32_state_and_weight_with_bfloat16_x_are_not_rounded():
    """Mixed dtypes (Mamba2 keeps f32 weights; a cache may hold f32 states): the kernel reads them as they are,
    so the output matches the float64 reference of the unrounded values (rounding them to bf16 would not)."""
    x, weight, bias = rand(1, 16, 20, dtype=BF16), rand(16, 4, seed=1) * 3, rand(16, seed=2)
    init = rand(1, 16, 3, seed=3) * 3
    out = C.causal_conv1d_fn(x, weight, bias, activation=None, initial_states=init)
    ref, _ = C.causal_conv1d_reference(x, weight, bias, None, initial_states=init)
    check(out, ref, tap_mass(x, weight, bias, init), BF16, "mixed")
    rounded, _ = C.causal_conv1d_reference(x, weight, bias, None, initial_states=init.to(BF16))
    assert not torch.allclose(rounded[..., :3], ref[..., :3], rtol=2.0**-9, atol=0)  # the check can tell


def test_forward_default_heuristic_blocks_and_float16(monkeypatch):
    monkeypatch.setattr(C.causal_conv1d_fwd, "heuristic", C._heuristic)
    x, weight, bias = rand(2, 40, 700, dtype=torch.float16), rand(40, 4, dtype=torch.float16, seed=1), None
    out = C.causal_conv1d_fn(x, weight)
    ref, _ = C.causal_conv1d_reference(x, weight, bias, "silu")
    assert out.dtype == torch.float16
    err = (out.double() - ref).abs()
    assert (err <= 2.0**-11 * ref.abs() + 1e-5).all(), float(err.max())


# ----------------------------------------------------------------------------------------- packed sequences
def test_packed_sequences_never_read_each_other(interpret):
    """A NaN in one packed sequence (seq_idx or cu_seqlens) reaches none of the others' outputs or final states;
    the others equal the reference of their sequence alone (NaN-poisoned interpret mode included)."""
    d, w, lens = 12, 4, [130, 3, 167]  # sequence boundaries inside and at the edge of 128-token blocks
    starts = np.cumsum([0] + lens)
    t = int(starts[-1])
    x, weight, bias = rand(1, d, t), rand(d, w, seed=1), rand(d, seed=2)
    x[0, 5, starts[1] + 1] = float("nan")  # in sequence 1
    cu = torch.tensor(starts, dtype=torch.int64)
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))[None].to(torch.int32)
    init = rand(3, d, w - 1, seed=4)
    outs = {
        "seq_idx": C.causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx),
        "cu_seqlens": C.causal_conv1d_fn(x, weight, bias, cu_seqlens=cu),
    }
    with_state, final = C.causal_conv1d_fn(x, weight, bias, cu_seqlens=cu, initial_states=init,
                                           return_final_states=True)
    for n in (0, 2):
        sl = slice(int(starts[n]), int(starts[n + 1]))
        xs = x[:, :, sl]
        ref, _ = C.causal_conv1d_reference(xs, weight, bias, "silu")
        for how, out in outs.items():
            check(out[:, :, sl], ref, tap_mass(xs, weight, bias, None), F32, f"{how} seq {n}")
        ref_s, ref_f = C.causal_conv1d_reference(xs, weight, bias, "silu", initial_states=init[n:n + 1])
        check(with_state[:, :, sl], ref_s, tap_mass(xs, weight, bias, init[n:n + 1]), F32, f"state seq {n}")
        assert torch.equal(final[n:n + 1].double(), ref_f)
    for out in (*outs.values(), with_state):
        assert out[:, :, starts[1]:starts[2]].isnan().any()  # the poisoned sequence itself does see it


def test_seq_idx_rows_differ_and_match_reference():
    x, weight = rand(2, 8, 200), rand(8, 3, seed=1)
    seq_idx = torch.sort(torch.randint(0, 5, (2, 200), generator=torch.Generator().manual_seed(0)), -1).values
    out = C.causal_conv1d_fn(x, weight, None, activation=None, seq_idx=seq_idx)
    ref, _ = C.causal_conv1d_reference(x, weight, None, None, seq_idx=seq_idx)
    check(out, ref, tap_mass(x, weight, None, None), F32, "seq_idx")
    whole, _ = C.causal_conv1d_reference(x, weight, None, None)
    assert not torch.allclose(ref, whole)  # the segments matter for this input


# ----------------------------------------------------------------------------------------- states
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_two_halves_with_carried_state_equal_the_whole(dtype):
    x, weight, bias = rand(2, 16, 260, dtype=dtype), rand(16, 4, dtype=dtype, seed=1), rand(16, dtype=dtype, seed=2)
    whole, whole_final = C.causal_conv1d_fn(x, weight, bias, return_final_states=True)
    a, fa = C.causal_conv1d_fn(x[..., :130], weight, bias, return_final_states=True)
    b, fb = C.causal_conv1d_fn(x[..., 130:], weight, bias, initial_states=fa, return_final_states=True)
    assert torch.equal(torch.cat([a, b], -1), whole) and torch.equal(fb, whole_final)
    # a half shorter than W - 1: the state is shifted, partly kept
    c, fc = C.causal_conv1d_fn(x[..., :2], weight, bias, return_final_states=True)
    d, fd = C.causal_conv1d_fn(x[..., 2:], weight, bias, initial_states=fc, return_final_states=True)
    # (a 2-token block sums its taps in another fused order: one float32 ulp, maybe one of the output dtype)
    torch.testing.assert_close(torch.cat([c, d], -1), whole, rtol=U[dtype], atol=1e-6)
    assert torch.equal(fd, whole_final)
    buf = torch.full_like(fd, 7.0)
    _, got = C.causal_conv1d_fn(x[..., 2:], weight, bias, initial_states=fc, return_final_states=True,
                                final_states_out=buf)
    assert got is buf and torch.equal(buf, whole_final)


# ----------------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("t, state_len, circular, indexed", [(1, 3, False, False), (3, 5, False, True),
                                                            (1, 6, True, False), (2, 4, True, True)])
def test_update_matches_reference_step(t, state_len, circular, indexed):
    b, d, w = 3, 20, 4
    x = rand(b, d, t, seed=1)
    x_in = x[..., 0] if t == 1 else x
    weight, bias = rand(d, w, seed=2), rand(d, seed=3)
    pool = rand(5 if indexed else b, d, state_len, seed=4)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32) if indexed else None
    seqlens = torch.tensor([0, 5, 11], dtype=torch.int32) if circular else None
    before = pool.clone()
    out = C.causal_conv1d_update(x_in, pool, weight, bias, "silu", cache_seqlens=seqlens, conv_state_indices=idx)
    rows = idx.long() if indexed else torch.arange(b)
    ref, ref_state = C.causal_conv1d_update_reference(x_in, before[rows], weight, bias, "silu", seqlens)
    mass = tap_mass(x, weight, bias, before[rows][..., -3:]) + 10  # + 10: the window need not be the last 3
    check(out, ref, mass[..., 0] if t == 1 else mass, F32, "out")
    assert torch.equal(pool[rows].double(), ref_state)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_steps_equal_prefill():
    b, d, w, l = 2, 8, 3, 6
    x, weight = rand(b, d, l, dtype=BF16), rand(d, w, dtype=BF16, seed=1)
    whole = C.causal_conv1d_fn(x, weight, activation=None)
    state = torch.zeros(b, d, w - 1, dtype=BF16)
    steps = [C.causal_conv1d_update(x[..., i], state, weight) for i in range(l)]
    assert torch.equal(torch.stack(steps, -1), whole)
    assert torch.equal(state, x[..., -(w - 1):])


# ----------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("dtype, packed", [(F32, False), (F32, True), (BF16, False)])
def test_backward_matches_float64(dtype, packed):
    b, d, l, w = (1, 12, 200, 4) if packed else (2, 12, 150, 3)
    x = rand(b, d, l, dtype=dtype).requires_grad_()
    weight, bias = rand(d, w, dtype=dtype, seed=1).requires_grad_(), rand(d, dtype=dtype, seed=2).requires_grad_()
    init = None if packed else rand(b, d, w - 1, dtype=dtype, seed=3).requires_grad_()
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor([60, 1, 139]))[None] if packed else None
    if packed:
        out, final = C.causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx), None
    else:
        out, final = C.causal_conv1d_fn(x, weight, bias, initial_states=init, return_final_states=True)
    g = rand(*out.shape, dtype=dtype, seed=5)
    inputs = [x, weight, bias] + ([init] if init is not None else [])
    loss = (out.float() * g.float()).sum() + (0 if final is None else final.float().sum())
    grads = torch.autograd.grad(loss, inputs)
    d64 = [t.detach().double().requires_grad_() for t in inputs]
    ref, ref_final = C.causal_conv1d_reference(d64[0], d64[1], d64[2], "silu", seq_idx=seq_idx,
                                               initial_states=d64[3] if init is not None else None)
    ref_loss = (ref * g.double()).sum() + (0 if final is None else ref_final.sum())
    want = torch.autograd.grad(ref_loss, d64)
    for name, got, exp in zip(("dx", "dweight", "dbias", "dinit"), grads, want):
        assert got.dtype == dtype, name
        scale = float(exp.abs().max()) + 1
        tol = U[dtype] * exp.abs() + (2.0**-8 if dtype == BF16 else 2.0**-18) * scale  # bf16: dpre rounded once
        assert ((got.double() - exp).abs() <= tol).all(), (name, float((got.double() - exp).abs().max()))


def test_backward_unsupported_path_raises_typed():
    x = rand(1, 8, 10).requires_grad_()
    with pytest.raises(ArgumentError, match="causal_conv1d: backward is not supported with cu_seqlens"):
        C.causal_conv1d_fn(x, rand(8, 4), cu_seqlens=torch.tensor([0, 4, 10]), initial_states=rand(2, 8, 3))


# ----------------------------------------------------------------------------------------- bad input
def test_bad_input_is_typed_and_names_the_argument():
    x, w = rand(2, 8, 10), rand(8, 4)
    cases = [
        (lambda: C.causal_conv1d_fn(x[0], w), ArgumentError, "x must be a 3-D tensor"),
        (lambda: C.causal_conv1d_fn(x.to(torch.int32), w), DTypeError, "x dtype"),
        (lambda: C.causal_conv1d_fn(x, rand(7, 4)), ArgumentError, r"weight must be \[D, W\] = \[8, W\]"),
        (lambda: C.causal_conv1d_fn(x, rand(8, 1)), ArgumentError, "weight width W = 1"),
        (lambda: C.causal_conv1d_fn(x, w, rand(7)), ArgumentError, r"bias must be \[D\] = \[8\]"),
        (lambda: C.causal_conv1d_fn(x, w, activation="gelu"), ArgumentError, "activation must be"),
        (lambda: C.causal_conv1d_fn(x, w, initial_states=rand(2, 8, 2)), ArgumentError, "initial_states must be"),
        (lambda: C.causal_conv1d_fn(x, w, initial_states=rand(2, 8, 3).long()), DTypeError, "initial_states dtype"),
        (lambda: C.causal_conv1d_fn(x, w, seq_idx=torch.zeros(2, 9, dtype=torch.int32)), ArgumentError, "seq_idx must"),
        (lambda: C.causal_conv1d_fn(x, w, seq_idx=torch.zeros(2, 10, dtype=torch.int32), return_final_states=True),
         ArgumentError, "with seq_idx are not defined"),
        (lambda: C.causal_conv1d_fn(x, w, cu_seqlens=torch.tensor([0, 10])), ArgumentError, "B must be 1"),
        (lambda: C.causal_conv1d_fn(x[:1], w, cu_seqlens=torch.tensor([1, 10])), ArgumentError,
         "cu_seqlens must start"),
        (lambda: C.causal_conv1d_fn(x[:1], w, cu_seqlens=torch.tensor([0, 6, 4, 10])), ArgumentError, "never decrease"),
        (lambda: C.causal_conv1d_fn(x[:1], w, cu_seqlens=torch.tensor([0, 9])), ArgumentError,
         "end at the token count"),
        (lambda: C.causal_conv1d_fn(x[:1], w, cu_seqlens=torch.tensor([0.0, 10.0])), ArgumentError,
         "cu_seqlens must be"),
        (lambda: C.causal_conv1d_fn(x[:1], w, cu_seqlens=torch.tensor([0, 4, 10]), initial_states=rand(1, 8, 3)),
         ArgumentError, r"initial_states must be \[N sequences, D, W-1\] = \[2, 8, 3\]"),
        (lambda: C.causal_conv1d_fn(x, w, final_states_out=rand(2, 8, 3)), ArgumentError, "only with return_final"),
        (lambda: C.causal_conv1d_fn(x, w, torch.zeros(8, device="meta")), DeviceError, "bias is on meta"),
    ]
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()


def test_update_bad_input_leaves_the_state_unchanged():
    x, w, state = rand(2, 8), rand(8, 4), rand(3, 8, 3)
    before = state.clone()
    cases = [
        (lambda: C.causal_conv1d_update(x, state[:2, :, :2], w), ArgumentError, "conv_state must be"),
        (lambda: C.causal_conv1d_update(x, state, w), ArgumentError, "conv_state must have B = 2 rows"),
        (lambda: C.causal_conv1d_update(x, state.to(BF16), w, conv_state_indices=torch.tensor([0, 1])), DTypeError,
         "conv_state dtype"),
        (lambda: C.causal_conv1d_update(x, state, w, conv_state_indices=torch.tensor([0, 3])), ArgumentError,
         r"conv_state_indices must be in \[0, 3\)"),
        (lambda: C.causal_conv1d_update(x, state, w, conv_state_indices=torch.tensor([1, 1])), ArgumentError,
         "distinct"),
        (lambda: C.causal_conv1d_update(x, state, w, conv_state_indices=torch.tensor([0, 1]),
                                        cache_seqlens=torch.tensor([-1, 0])), ArgumentError,
         "cache_seqlens must be >= 0"),
        (lambda: C.causal_conv1d_update(x, state, w, conv_state_indices=torch.tensor([0, 1]), activation="relu"),
         ArgumentError, "activation must be"),
        (lambda: C.causal_conv1d_update(x[0], state, w), ArgumentError, r"x must be \[B, D\] or \[B, D, T\]"),
    ]
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()
        assert torch.equal(state, before)


def test_kernel_op_rejects_inconsistent_internal_args():
    x, w = rand(1, 8, 10), rand(8, 3)
    with pytest.raises(ArgumentError, match="init must be"):
        C.causal_conv1d_fwd(x, None, w, None, None, None, rand(1, 8, 3), False)
    with pytest.raises(ArgumentError, match="x_halo is for L > 128"):
        C.causal_conv1d_fwd(x, x, w, None, None, None, None, False)


def test_sharding_rule_is_over_channels_or_batch():
    from tpukernels.distributed.sharding import Split, TensorMeta, splits_for

    m = lambda *s: TensorMeta(s, torch.float32)  # noqa: E731
    got = splits_for(C.causal_conv1d_fwd, {"x": m(2, 64, 512), "x_halo": m(2, 64, 512), "weight": m(64, 4),
                                           "bias": m(64, 1), "seg": None, "seg_halo": None, "init": m(2, 64, 3),
                                           "silu": True})
    assert got == [Split({"x": 1, "weight": 0, "x_halo": 1, "bias": 0, "init": 1}, (1,)),
                   Split({"x": 0, "x_halo": 0, "init": 0}, (0,))]


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only(chip, tmp_cache):
    from tpukernels.targets.compile_only import compile_for

    for args, kw in C.STANDARD_SHAPES:
        r = compile_for(C.causal_conv1d_fwd, chip, *args, with_mlir=False, **kw)
        assert r.ok, r.summary()
        assert r.vmem_estimate_bytes <= C.VMEM_BUDGET_BYTES, r.summary()


def test_kernel_op_passes_opcheck():
    x, w, b, init = rand(2, 8, 20), rand(8, 4, seed=1), rand(8, 1, seed=2), rand(2, 8, 3, seed=3)
    torch.library.opcheck(torch.ops.tpukernels.causal_conv1d_fwd.default, (x, None, w, b, None, None, init, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
