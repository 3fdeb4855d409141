"""tpukernels in vLLM-TPU's linear-attention slot (tpu-inference 0.32.0 ``LinearAttentionBackend``):
``fused_conv1d_gdn`` through the registry and tpu-inference's own ``run_jax_gdn_attention`` (its shard_map),
prefill then decode then a mixed batch with the state caches carried over, vs tpu-inference's reference
(``layers/common/ragged_conv1d_jax.ragged_conv1d`` + ``kernels/gdn/reference/ragged_gated_delta_rule_ref``)
and vs a float64 reference (tpukernels' ``causal_conv1d_reference`` + ``gated_delta_rule_reference``) on
random ragged batches; NaN in padding tokens and in stale / unused cache slots.

tpu-inference's fused kernel itself (``kernels/gdn/v3/wrapper.fused_conv1d_gdn``) does not run on CPU here: its
wrapper asks ``pltpu.get_tpu_info()`` for the chip, and with a chip registered for the cpu device its kernel
fails in jax 0.10.2's TPU interpreter (``'ReshapeTransform' object has no attribute 'indices'``; tpu-inference
0.32.0 pins jax 0.11.2), so it is not a reference here.

``tpu_inference.layers.common.gdn_attention`` imports torchax (through ``tpu_inference.utils``): this module is in
conftest's TORCHAX_MODULES.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("tpu_inference", reason="tpu-inference 0.32.0 (make test installs it --no-deps)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tpukernels.errors import ArgumentError, DTypeError, NotSupportedError  # noqa: E402
from tpukernels.integrations import vllm_tpu  # noqa: E402
from tpukernels.integrations import vllm_tpu_gdn as vg  # noqa: E402
from tpukernels.library.causal_conv1d import causal_conv1d_reference  # noqa: E402
from tpukernels.library.linear_attention import gated_delta_rule_reference  # noqa: E402

#: a small GDN layer: 2 q/k heads, 4 value heads (grouped), d_k != d_v (a transposition would show)
N_KQ, N_V, D_K, D_V, W = 2, 4, 16, 32, 4
DIM = 2 * N_KQ * D_K + N_V * D_V
NB = 8  # state slots; 0 is vLLM's null block
MESH_AXES = ("data", "pcp", "attn_dp", "attn_dp_expert", "model", "expert", "dcp")


@pytest.fixture(scope="module")
def ti():
    from tpukernels.errors import BackendUnavailableError
    from tpukernels.integrations import torchax_ops

    try:
        torchax_ops.import_torchax()  # tpu_inference.utils imports torchax (shimmed for torch 2.13)
    except BackendUnavailableError as e:
        pytest.skip(f"torchax: {e}")
    env = dict(os.environ)
    from tpu_inference.kernels.gdn.reference import ragged_gated_delta_rule_ref as gdn_ref
    from tpu_inference.layers.common import attention_backend as ab
    from tpu_inference.layers.common import gdn_attention, ragged_conv1d_jax

    os.environ.clear()
    os.environ.update(env)  # vllm's env_override sets process-wide torch/inductor variables: undo them
    return SimpleNamespace(ab=ab, run=gdn_attention.run_jax_gdn_attention, conv=ragged_conv1d_jax.ragged_conv1d,
                           gdn=gdn_ref.ragged_gated_delta_rule)


def layer(seed=0, bias=True):
    rng = np.random.default_rng(seed)
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    return dict(conv_weight=f(DIM, 1, W, sc=0.5), conv_bias=f(DIM, sc=0.1) if bias else None,
                A_log=f(N_V, sc=0.5), dt_bias=f(N_V, sc=0.5))


def caches(seed=1, poison=()):
    """Random caches; slots in ``poison`` (stale slots of new prompts, unused ones) hold NaN."""
    rng = np.random.default_rng(seed)
    cs = rng.standard_normal((NB, W - 1, DIM)).astype(np.float32)
    rs = rng.standard_normal((NB, N_V, D_K, D_V)).astype(np.float32) * 0.3
    for p in poison:
        cs[p], rs[p] = np.nan, np.nan
    return jnp.asarray(cs), jnp.asarray(rs)


def step(q_lens, seq_lens, slots, *, S, T, read=None, seed=0, dtype=jnp.float32, n_dec=None):
    """tpu-inference's step inputs: decode sequences (q_len 1) first (``n_dec`` of them, default: the leading
    one-token sequences with a history); tokens past the last sequence are NaN; metadata entries past num_seqs
    point at the null block with zero lengths."""
    rng = np.random.default_rng(seed)
    n, used = len(q_lens), sum(q_lens)
    x = rng.standard_normal((T, DIM)).astype(np.float32)
    b = rng.standard_normal((T, N_V)).astype(np.float32)
    a = rng.standard_normal((T, N_V)).astype(np.float32)
    x[used:], b[used:], a[used:] = np.nan, np.nan, np.nan
    if n_dec is None:
        n_dec = 0
        while n_dec < n and q_lens[n_dec] == 1 and seq_lens[n_dec] > 1:
            n_dec += 1
    assert all(ql == 1 for ql in q_lens[:n_dec])
    pad = [0] * (S - n)
    i32 = lambda v: jnp.asarray(np.asarray(v, np.int32))  # noqa: E731
    return dict(qkv=jnp.asarray(x, dtype), b=jnp.asarray(b, dtype), a=jnp.asarray(a, dtype),
                query_start_loc=i32(np.concatenate([[0], np.cumsum(q_lens), [used] * (S - n)])),
                state_indices=i32(list(slots) + pad), distribution=i32([n_dec, n_dec, n]),
                seq_lens=i32(list(seq_lens) + pad), read_state_indices=i32(list(read or slots) + pad),
                n=n, used=used)


def ours(st_, cs, rs, lw, **kw):
    return vg.fused_conv1d_gdn(st_["qkv"], st_["b"], st_["a"], cs, rs, lw["conv_weight"], lw["conv_bias"],
                               lw["A_log"], lw["dt_bias"], st_["query_start_loc"], st_["state_indices"],
                               st_["distribution"], st_["seq_lens"], st_["read_state_indices"], n_kq=N_KQ, n_v=N_V,
                               d_k=D_K, d_v=D_V, kernel_size=W, **kw)


def theirs(ti, st_, cs, rs, lw):
    """tpu-inference's reference conv then its reference gated delta rule (read slot = write slot)."""
    cu = st_["query_start_loc"]
    has_init = (st_["seq_lens"] - (cu[1:] - cu[:-1])) > 0
    y, cs = ti.conv(st_["qkv"], jnp.array(cs), lw["conv_weight"], lw["conv_bias"], cu, st_["state_indices"],
                    st_["distribution"], has_init, kernel_size=W)
    rs, out = ti.gdn(y, st_["b"], st_["a"], jnp.array(rs), lw["A_log"], lw["dt_bias"], cu, st_["state_indices"],
                     st_["distribution"], has_init, n_kq=N_KQ, n_v=N_V, d_k=D_K, d_v=D_V)
    return cs, rs, out


def reference64(st_, cs, rs, lw):
    """float64 ``(conv_cache, recurrent_cache, out)`` (numpy) from the given (low-precision) values."""
    cs, rs = np.array(cs, np.float64), np.array(rs, np.float64)
    t = st_["qkv"].shape[0]
    out = np.zeros((t, N_V * D_V))
    x = torch.from_numpy(np.asarray(st_["qkv"].astype(jnp.float32), np.float64))
    bb = torch.from_numpy(np.asarray(st_["b"].astype(jnp.float32), np.float64))
    aa = torch.from_numpy(np.asarray(st_["a"].astype(jnp.float32), np.float64))
    w = torch.from_numpy(np.asarray(lw["conv_weight"], np.float64))[:, 0]
    bias = None if lw["conv_bias"] is None else torch.from_numpy(np.asarray(lw["conv_bias"], np.float64))
    A, dtb = (torch.from_numpy(np.asarray(lw[k], np.float64)) for k in ("A_log", "dt_bias"))
    cu = np.asarray(st_["query_start_loc"])
    new_c, new_r = {}, {}
    for s in range(st_["n"]):
        lo, hi = int(cu[s]), int(cu[s + 1])
        rd, wr = int(st_["read_state_indices"][s]), int(st_["state_indices"][s])
        init = int(st_["seq_lens"][s]) > hi - lo
        c0 = torch.from_numpy(cs[rd].T.copy()) if init else torch.zeros(DIM, W - 1, dtype=torch.float64)
        h0 = torch.from_numpy(rs[rd]) if init else torch.zeros(N_V, D_K, D_V, dtype=torch.float64)
        y, fin = causal_conv1d_reference(x[lo:hi].T[None], w, bias, cu_seqlens=torch.tensor([0, hi - lo]),
                                         initial_states=c0[None])
        y = y[0].T  # [L, DIM]
        kq = N_KQ * D_K
        q, k = y[:, :kq].reshape(-1, N_KQ, D_K), y[:, kq:2 * kq].reshape(-1, N_KQ, D_K)
        v = y[:, 2 * kq:].reshape(-1, N_V, D_V)
        g = -torch.exp(A) * torch.nn.functional.softplus(aa[lo:hi] + dtb)
        beta = torch.sigmoid(bb[lo:hi])
        o, ht = gated_delta_rule_reference(q[None], k[None], v[None], g[None], beta[None], initial_state=h0[None],
                                           use_qk_l2norm_in_kernel=True)
        out[lo:hi] = o[0].reshape(hi - lo, -1).numpy()
        new_c[wr], new_r[wr] = fin[0].T.numpy(), ht[0].numpy()
    for wr in new_c:
        cs[wr], rs[wr] = new_c[wr], new_r[wr]
    return cs, rs, out


def check_step(got, want, st_, written, cs_in, rs_in, tol):
    """Outputs of real tokens, 0 for padding; written slots vs the reference; every other slot bit-unchanged."""
    (cs, rs), out = got
    wc, wr, wo = want
    used = st_["used"]
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(out[:used], np.asarray(wo, np.float64)[:used], rtol=tol, atol=tol)
    assert np.array_equal(out[used:], np.zeros_like(out[used:])), "padding tokens' output must be 0"
    for slot in range(NB):
        if slot in written:
            np.testing.assert_allclose(np.asarray(cs[slot], np.float64), np.asarray(wc[slot], np.float64),
                                       rtol=tol, atol=tol)
            np.testing.assert_allclose(np.asarray(rs[slot], np.float64), np.asarray(wr[slot], np.float64),
                                       rtol=tol, atol=tol)
        else:
            assert np.array_equal(np.asarray(cs[slot]), np.asarray(cs_in[slot]), equal_nan=True), slot
            assert np.array_equal(np.asarray(rs[slot]), np.asarray(rs_in[slot]), equal_nan=True), slot


# (q_lens, seq_lens, slots) per step; S = 5 sequence entries, T = 40 tokens
STEPS = [
    # prefill: two new prompts (7, 20 tokens) and a chunked-prefill continuation (5 new of 9)
    ([7, 20, 5], [7, 20, 9], [3, 5, 1]),
    # decode: one token each, the caches carried over
    ([1, 1, 1], [8, 21, 10], [3, 5, 1]),
    # mixed: two decodes, a continuation (6 more), a new prompt (4)
    ([1, 1, 6, 4], [9, 22, 16, 4], [3, 5, 1, 6]),
]


def test_registry_and_their_shard_map_prefill_decode_mixed_vs_their_reference(ti):
    """register() -> create_linear_attention_backend("tpukernels") -> conv1d_gdn_kernel() run by tpu-inference's
    own run_jax_gdn_attention (shard_map over a one-device mesh with their axis names); three steps with the
    caches carried, each vs their reference on their own carried caches."""
    from jax.sharding import Mesh

    vllm_tpu.register()
    vllm_tpu.register()  # idempotent
    backend = ti.ab.create_linear_attention_backend("tpukernels")
    assert isinstance(backend, vg.linear_backend_class()) and isinstance(backend, ti.ab.LinearAttentionBackend)
    kernel = backend.conv1d_gdn_kernel()
    assert kernel is vg.fused_conv1d_gdn
    mesh = Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    lw = layer()
    cs0, rs0 = caches(poison=(0, 2, 3, 4, 5, 6, 7))  # slot 1 holds the continuation's history; the rest stale
    c_ours, r_ours, c_ref, r_ref = cs0, rs0, cs0, rs0
    # one jitted step (as vLLM-TPU's model step), compiled once for the three steps' shapes
    run = jax.jit(lambda x, b, a, cs, rs, cu, si, dist, sl, rd: ti.run(
        x, b, a, cs, rs, lw["conv_weight"], lw["conv_bias"], lw["A_log"], lw["dt_bias"], si, cu, dist, sl, N_KQ, N_V,
        D_K, D_V, W, mesh, read_state_indices=rd, conv1d_gdn_kernel=kernel))
    ref = jax.jit(lambda st_, cs, rs: theirs(ti, st_, cs, rs, lw))
    written = set()
    for i, (ql, sl, slots) in enumerate(STEPS):
        st_ = step(ql, sl, slots, S=5, T=40, seed=10 + i)
        c_in, r_in = np.asarray(c_ours), np.asarray(r_ours)
        got = run(*(st_[k] for k in ("qkv", "b", "a")), c_ours, r_ours, *(st_[k] for k in (
            "query_start_loc", "state_indices", "distribution", "seq_lens", "read_state_indices")))
        want = ref({k: v for k, v in st_.items() if k not in ("n", "used")}, c_ref, r_ref)
        written |= set(slots)
        check_step(got, want, st_, set(slots), c_in, r_in, 2e-5)
        if i == 1:  # the decode step: their reference's decode-only branch (distribution[0] == num_seqs)
            assert int(st_["distribution"][0]) == st_["n"]
        (c_ours, r_ours), _ = got
        c_ref, r_ref = want[0], want[1]
    assert not np.isnan(np.asarray(r_ours)[sorted(written)]).any()


@pytest.mark.slow  # ~45 s; make test keeps the f32 registry steps and the hypothesis batches
def test_bf16_and_prefix_cache_read_slots_vs_float64():
    """bf16 activations, no conv bias, read_state_indices != state_indices (Mamba prefix caching: resume from one
    slot, write another; the read slot is left as it was) vs float64, in the NaN-poisoned ("tpu") interpret mode
    (the other tests run the default one)."""
    import tpukernels as tk

    lw = layer(seed=3, bias=False)
    cs, rs = caches(seed=4, poison=(0, 5, 7))
    # two decode rows (the second a new one-token prompt whose slot 7 holds NaN), a continuation resumed from
    # slot 1 into slot 4, a new prompt (read slot 3 unused)
    st_ = step([1, 1, 9, 17], [30, 1, 12, 17], [2, 7, 4, 6], read=[2, 7, 1, 3], S=4, T=32, seed=5,
               dtype=jnp.bfloat16, n_dec=2)
    want = reference64(st_, cs, rs, lw)
    with tk.interpret_mode("tpu"):
        got = ours(st_, jnp.array(cs), jnp.array(rs), lw)
    check_step(got, want, st_, {2, 7, 4, 6}, cs, rs, 3e-2)


@settings(deadline=None)
@given(data=st.data())
def test_random_ragged_batches_vs_float64(data):
    """Random decode / continuation / new-prompt mixes with lengths around the chunk (chunk_size 16: 1, 15, 16,
    17, 33 tokens), decode rows with and without a state, random distinct slots, some resumed from another
    slot; every slot whose state is not read holds NaN; fixed T / S (one compile)."""
    S, T, chunk = 4, 48, 16
    n = data.draw(st.integers(1, S))
    n_dec = data.draw(st.integers(0, n))
    room = T - n
    q_lens, seq_lens = [], []
    for i in range(n):
        if i < n_dec:  # a decode row; history 0: a new one-token prompt (its slot's stale state unused)
            ql, hist = 1, data.draw(st.sampled_from([0, 1, 7, 40]))
        else:
            ql = min(data.draw(st.sampled_from([1, 2, 15, 16, 17, 33])), room + 1)
            hist = data.draw(st.sampled_from([0, 0, 5]))
        room -= ql - 1
        q_lens.append(ql)
        seq_lens.append(ql + hist)
    slots = data.draw(st.permutations(range(1, NB)))[:n]
    free = [x for x in range(1, NB) if x not in slots]  # a slot written this step is read by no other sequence
    read = [s if not free or data.draw(st.booleans()) else data.draw(st.sampled_from(free)) for s in slots]
    st_ = step(q_lens, seq_lens, slots, read=read, S=S, T=T, seed=data.draw(st.integers(0, 99)), n_dec=n_dec)
    lw = layer(seed=7)
    needed = {rd for rd, ql, sl in zip(read, q_lens, seq_lens) if sl > ql}
    cs, rs = caches(seed=8, poison=tuple(x for x in range(NB) if x not in needed))  # every other slot NaN
    want = reference64(st_, cs, rs, lw)
    got = ours(st_, jnp.array(cs), jnp.array(rs), lw, chunk_size=chunk)
    check_step(got, want, st_, set(slots), cs, rs, 1e-4)


def test_caches_are_donated_and_written_in_place():
    """The jitted function donates both caches (as tpu-inference's): XLA aliases them to the outputs, so the
    state write needs no second cache in memory."""
    lw = layer()
    cs, rs = caches()
    st_ = step([3], [3], [2], S=2, T=8)
    args = (st_["qkv"], st_["b"], st_["a"], cs, rs, lw["conv_weight"], lw["conv_bias"], lw["A_log"], lw["dt_bias"],
            st_["query_start_loc"], st_["state_indices"], st_["distribution"], st_["seq_lens"],
            st_["read_state_indices"])
    jitted = vg._jitted()
    text = jitted.lower(*args, n_kq=N_KQ, n_v=N_V, d_k=D_K, d_v=D_V, kernel_size=W, interpret="fast").as_text()
    assert text.count("tf.aliasing_output") == 2, "conv_state and recurrent_state must be aliased to outputs"


def test_bad_input_is_a_typed_error():
    lw = layer()
    cs, rs = caches()
    st_ = step([3], [3], [2], S=2, T=8)
    base = dict(qkv=st_["qkv"], b=st_["b"], a=st_["a"], conv_state=cs, recurrent_state=rs, **lw,
                query_start_loc=st_["query_start_loc"], state_indices=st_["state_indices"],
                distribution=st_["distribution"], seq_lens=st_["seq_lens"],
                read_state_indices=st_["read_state_indices"])
    statics = dict(n_kq=N_KQ, n_v=N_V, d_k=D_K, d_v=D_V, kernel_size=W)

    def call(**change):
        kw = dict(statics, **{k: v for k, v in change.items() if k in statics or k in ("num_spec_tokens",
                                                                                         "compute_precision")})
        args = dict(base, **{k: v for k, v in change.items() if k in base})
        return vg.fused_conv1d_gdn(*args.values(), **kw)

    cases = [
        (ArgumentError, "mixed_qkv must be", dict(qkv=st_["qkv"][:, :-1])),
        (ArgumentError, "b must be", dict(b=st_["b"][:-1])),
        (ArgumentError, "recurrent_state must be", dict(recurrent_state=rs[:, :, :, :-1])),
        (ArgumentError, "conv_state must be", dict(conv_state=cs[:, :-1])),
        (ArgumentError, "conv_weight must be", dict(conv_weight=lw["conv_weight"][:, :, :-1])),
        (ArgumentError, "A_log must be", dict(A_log=lw["A_log"][:-1])),
        (ArgumentError, "query_start_loc must be", dict(query_start_loc=st_["query_start_loc"][:-1])),
        (DTypeError, "seq_lens must be an int", dict(seq_lens=st_["seq_lens"].astype(jnp.float32))),
        (DTypeError, "mixed_qkv must be bfloat16 or float32", dict(qkv=st_["qkv"].astype(jnp.float16))),
        (NotSupportedError, "speculative decoding", dict(num_spec_tokens=2)),
        (ArgumentError, "compute_precision", dict(compute_precision=jnp.bfloat16)),
        (ArgumentError, "multiple of n_kq", dict(n_kq=3)),
        (ArgumentError, "kernel_size must be", dict(kernel_size=9)),
    ]
    for err, msg, change in cases:
        with pytest.raises(err, match=msg):
            call(**change)
    # nothing was consumed by the failed calls: the caches are still readable
    assert np.isfinite(np.asarray(cs)).all() and np.isfinite(np.asarray(rs)).all()


#: run in a fresh process with two cpu devices (XLA_FLAGS must be set before jax starts)
_TP2_SCRIPT = r'''
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, jax, jax.numpy as jnp
from tpukernels.integrations import torchax_ops
torchax_ops.import_torchax()
from tpu_inference.layers.common.gdn_attention import run_jax_gdn_attention
from jax.sharding import Mesh
from tpukernels.integrations import vllm_tpu_gdn as vg
n_kq, n_v, d_k, d_v, W, tp = 2, 4, 16, 32, 4, 2
lk, lv = n_kq // tp, n_v // tp
ldim = 2 * lk * d_k + lv * d_v
T, S, NB = 24, 3, 6
rng = np.random.default_rng(0)
f = lambda *s: rng.standard_normal(s).astype(np.float32)
shards = [dict(x=f(T, ldim), b=f(T, lv), a=f(T, lv), cs=f(NB, W-1, ldim), rs=f(NB, lv, d_k, d_v)*0.3,
               cw=f(ldim, 1, W)*0.5, cb=f(ldim)*0.1, A=f(lv)*0.5, dt=f(lv)*0.5) for _ in range(tp)]
for sh in shards:
    for k in ("x", "b", "a"): sh[k][20:] = np.nan
cu = jnp.asarray([0, 1, 8, 20], jnp.int32); si = jnp.asarray([2, 4, 1], jnp.int32)
dist = jnp.asarray([1, 1, 3], jnp.int32); sl = jnp.asarray([5, 7, 15], jnp.int32)
cat = lambda k, ax: jnp.asarray(np.concatenate([sh[k] for sh in shards], axis=ax))
axes = ("data", "pcp", "attn_dp", "attn_dp_expert", "model", "expert", "dcp")
mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 1, 1, 1, 2, 1, 1), axes)
glob = [cat(k, ax) for k, ax in (("x", 1), ("b", 1), ("a", 1), ("cs", 2), ("rs", 1), ("cw", 0), ("cb", 0),
                                  ("A", 0), ("dt", 0))]
(gc, gr), go = run_jax_gdn_attention(*glob, si, cu, dist, sl, n_kq, n_v, d_k, d_v, W, mesh,
                                     read_state_indices=si, conv1d_gdn_kernel=vg.fused_conv1d_gdn)
errs = []
for h, sh in enumerate(shards):
    arrs = [jnp.asarray(sh[k]) for k in ("x", "b", "a", "cs", "rs", "cw", "cb", "A", "dt")]
    (c, r), o = vg.fused_conv1d_gdn(*arrs, cu, si, dist, sl, si, n_kq=lk, n_v=lv, d_k=d_k, d_v=d_v, kernel_size=W)
    errs += [float(jnp.max(jnp.abs(go[:, h * lv * d_v:(h + 1) * lv * d_v] - o))),
             float(jnp.max(jnp.abs(gc[:, :, h * ldim:(h + 1) * ldim] - c))),
             float(jnp.max(jnp.abs(gr[:, h * lv:(h + 1) * lv] - r)))]
assert errs == [0.0] * len(errs), errs
print("TP2 OK")
'''


@pytest.mark.slow
def test_tensor_parallel_two_shards_through_their_shard_map():
    """tpu-inference's run_jax_gdn_attention over a mesh with model = 2 (two cpu devices, heads split over
    them: each shard's q | k | v block, caches and weights by head) is bit-identical to our function on each
    shard's slice alone (the per-shard n_kq / n_v statics are theirs)."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               TPU_ACCELERATOR_TYPE="v5litepod-1", TPU_WORKER_HOSTNAMES="localhost")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", _TP2_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "TP2 OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only_qwen3_next_shard_in_place(chip):
    """Compiled for a TPU chip (libtpu compile-only, from this CPU host) at a Qwen3-Next-80B GDN layer's
    tensor-parallel shard (TP 4: 4 q/k heads, 8 value heads, d 128, conv width 4; bf16 activations, f32
    recurrent cache), 256 tokens, 8 sequences, 65 slots: the three kernels are Mosaic calls, and XLA's memory
    analysis of the compiled step shows both donated caches aliased to the outputs (written in place) with
    less temporary memory than one recurrent cache (no copy of a cache; the gathered initial states of the 8
    sequences remain)."""
    from tpukernels.chips import get_chip
    from tpukernels.targets.compile_only import tpu_device

    n_kq, n_v, d, w, t, s, nb = 4, 8, 128, 4, 256, 8, 65
    dim = 2 * n_kq * d + n_v * d
    sh = jax.sharding.SingleDeviceSharding(tpu_device(chip))
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    f = jax.jit(lambda *a: vg._fused_conv1d_gdn(*a, n_kq=n_kq, n_v=n_v, d_k=d, d_v=d, kernel_size=w),
                donate_argnums=(3, 4))
    conv, rec = sds((nb, w - 1, dim), jnp.bfloat16), sds((nb, n_v, d, d), jnp.float32)
    args = (sds((t, dim), jnp.bfloat16), sds((t, n_v), jnp.bfloat16), sds((t, n_v), jnp.bfloat16), conv, rec,
            sds((dim, 1, w), jnp.bfloat16), sds((dim,), jnp.bfloat16), sds((n_v,), jnp.float32),
            sds((n_v,), jnp.float32), sds((s + 1,), jnp.int32), sds((s,), jnp.int32), sds((3,), jnp.int32),
            sds((s,), jnp.int32), sds((s,), jnp.int32))
    with get_chip(chip).trace_target():
        low = f.lower(*args)
    # the conv kernel, the recurrent GDN kernel (decode rows) and the chunked one (prefill rows), nothing else
    assert low.as_text().count("tpu_custom_call") == 3
    mem = low.compile().memory_analysis()
    rec_bytes = nb * n_v * d * d * 4
    assert mem.alias_size_in_bytes >= rec_bytes + nb * (w - 1) * dim * 2
    assert mem.temp_size_in_bytes < rec_bytes, (mem.temp_size_in_bytes, rec_bytes)
