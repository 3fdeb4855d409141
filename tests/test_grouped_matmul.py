"""Tests of the grouped matmul (tpukernels.library.grouped_matmul, issue 15).

Accuracy criterion: against a float64 product of the *same* low-precision inputs, the kernel's RMS error must
stay within 1.2x of an ideal kernel's (float32 accumulation per group, one rounding to the output dtype) plus
one float32 unit (2^-24) times the RMS of ``|lhs| @ |rhs|`` (a reordered f32 sum; see tests/test_matmul.py);
16-bit outputs also on the elementwise maximum. Rows no local group owns must be exactly zero.

Shapes are fixed per test and hypothesis varies only the group sizes (data, not shapes), so one compiled
kernel serves all examples; every shape has M, K and N tails for 128-blocks (K % bk != 0 explicitly).
Gradients: float32, against float64 autograd of the reference, 2e-5 of the largest reference gradient.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpukernels as tk
import tpukernels.library  # noqa: F401
from tpukernels.errors import ArgumentError, DeviceError, DTypeError

gm = importlib.import_module("tpukernels.library.grouped_matmul_ops")
OPS = torch.ops.tpukernels
U32 = 2.0**-24
SMALL = dict(bm=128, bk=128, bn=128)
MODES = ["fast", "tpu"]


def rms(x):
    return x.double().pow(2).mean().sqrt().item() if x.numel() else 0.0


def ideal(lhs, rhs, sizes, transpose_rhs=False, group_offset=0, out_dtype=None):
    """f32 accumulation per group, one rounding (what an ideal kernel returns)."""
    w = rhs.float().transpose(1, 2) if transpose_rhs else rhs.float()
    out = torch.zeros(lhs.shape[0], w.shape[2])
    for g, (s, e) in enumerate(gm.ref_bounds_np(sizes.numpy(), [group_offset], lhs.shape[0], rhs.shape[0])):
        out[s:e] = lhs[s:e].float() @ w[g]
    return out.to(out_dtype or lhs.dtype)


def assert_within_bound(out, lhs, rhs, sizes, transpose_rhs=False, group_offset=0, out_dtype=None, factor=1.2):
    odt = out_dtype or lhs.dtype
    ref = gm.reference(lhs, rhs, sizes, transpose_rhs=transpose_rhs, group_offset=group_offset)
    assert out.dtype == odt and out.shape == ref.shape
    idl = ideal(lhs, rhs, sizes, transpose_rhs, group_offset, odt)
    absref = gm.reference(lhs.abs(), rhs.abs(), sizes, transpose_rhs=transpose_rhs, group_offset=group_offset)
    slack = U32 * rms(absref)
    ek, ei = rms(out.double() - ref), rms(idl.double() - ref)
    assert ek <= factor * ei + slack, f"RMS error {ek:.3e} > {factor} x {ei:.3e} (+{slack:.1e})"
    if odt != torch.float32 and out.numel():
        mk, mi = (out.double() - ref).abs().max().item(), (idl.double() - ref).abs().max().item()
        assert mk <= factor * mi + slack, f"max error {mk:.3e} > {factor} x {mi:.3e} (+{slack:.1e})"
    owned = torch.zeros(lhs.shape[0], dtype=torch.bool)
    for s, e in gm.ref_bounds_np(sizes.numpy(), [group_offset], lhs.shape[0], rhs.shape[0]):
        owned[s:e] = True
    assert (out[~owned] == 0).all(), "rows no local group owns must be zero"


def randn(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


@st.composite
def group_sizes(draw, M, G):
    """Group sizes summing to <= M: zeros, one huge group, random splits, boundaries anywhere."""
    kind = draw(st.sampled_from(["random", "huge", "zeros", "full", "tiny"]))
    if kind == "huge":
        sizes = [0] * G
        sizes[draw(st.integers(0, G - 1))] = draw(st.integers(M - 3, M))
    elif kind == "zeros":
        sizes = [0] * G
    elif kind == "tiny":
        sizes = draw(st.lists(st.integers(0, 3), min_size=G, max_size=G))
    else:
        cuts = sorted(draw(st.lists(st.integers(0, M), min_size=G, max_size=G)))
        if kind == "full":
            cuts[-1] = M
        sizes = list(np.diff([0] + cuts))
    return torch.tensor(sizes, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------- forward accuracy
@pytest.mark.parametrize("mode, transpose_rhs, dtype", [
    ("fast", False, torch.bfloat16), ("fast", True, torch.bfloat16), ("fast", True, torch.float32),
    ("tpu", True, torch.bfloat16), ("tpu", False, torch.float32),
], ids=["fast-nn-bf16", "fast-nt-bf16", "fast-nt-f32", "tpu-nt-bf16", "tpu-nn-f32"])
@settings(max_examples=4)
@given(data=st.data())
def test_group_sizes_within_bound(mode, transpose_rhs, dtype, data):
    M, K, N, G = 300, 200, 140, 5  # K % 128 = 72: the K tail is masked on the last K step
    sizes = data.draw(group_sizes(M, G))
    g = torch.Generator().manual_seed(int(sizes.sum()) + G)
    lhs = randn(M, K, dtype=dtype, gen=g)
    rhs = randn(G, N, K, dtype=dtype, gen=g) if transpose_rhs else randn(G, K, N, dtype=dtype, gen=g)
    with tk.interpret_mode(mode):
        out = gm.grouped_matmul(lhs, rhs, sizes, transpose_rhs=transpose_rhs, config=SMALL)
    assert_within_bound(out, lhs, rhs, sizes, transpose_rhs)


@pytest.mark.parametrize("mode", MODES)
def test_default_config_odd_shapes_and_out_dtype(mode):
    """Default (heuristic/clamped) blocks on a shape that fits one block per dim, f32 output of bf16 inputs."""
    g = torch.Generator().manual_seed(7)
    lhs, rhs = randn(77, 1030, dtype=torch.bfloat16, gen=g), randn(3, 1030, 90, dtype=torch.bfloat16, gen=g)
    sizes = torch.tensor([30, 0, 40], dtype=torch.int32)  # 7 tail rows
    with tk.interpret_mode(mode):
        out = gm.grouped_matmul(lhs, rhs, sizes, out_dtype=torch.float32)
    assert_within_bound(out, lhs, rhs, sizes, out_dtype=torch.float32)


@pytest.mark.parametrize("mode", MODES)
def test_group_offset_shard(mode):
    """rhs holds groups [2, 4) of 6: rows of groups 0, 1, 4, 5 are zero (megablox group_offset)."""
    g = torch.Generator().manual_seed(8)
    M, K, N = 300, 200, 260
    lhs, rhs = randn(M, K, gen=g), randn(2, K, N, gen=g)
    sizes = torch.tensor([40, 70, 0, 100, 50, 20], dtype=torch.int32)
    with tk.interpret_mode(mode):
        out = gm.grouped_matmul(lhs, rhs, sizes, group_offset=2, config=SMALL)
        out_t = gm.grouped_matmul(lhs, rhs, sizes, group_offset=torch.tensor(2, dtype=torch.int32), config=SMALL)
    assert_within_bound(out, lhs, rhs, sizes, group_offset=2)
    assert torch.equal(out, out_t)
    assert out[:110].abs().sum() == 0 and out[210:].abs().sum() == 0 and out[110:210].abs().sum() > 0


def test_matches_ragged_dot_and_megablox():
    """Same result as jax.lax.ragged_dot (and megablox gmm on the rows it defines) on the same inputs."""
    import jax
    import jax.numpy as jnp
    jgmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

    g = torch.Generator().manual_seed(9)
    lhs, rhs = randn(256, 256, gen=g), randn(4, 256, 256, gen=g)
    sizes = torch.tensor([100, 0, 56, 60], dtype=torch.int32)  # 40 tail rows
    ours = gm.grouped_matmul(lhs, rhs, sizes, config=SMALL).numpy()
    rd = np.asarray(jax.lax.ragged_dot(jnp.asarray(lhs.numpy()), jnp.asarray(rhs.numpy()), jnp.asarray(sizes.numpy()),
                                       precision=jax.lax.Precision.HIGHEST))
    mb = np.asarray(jgmm.gmm(jnp.asarray(lhs.numpy()), jnp.asarray(rhs.numpy()), jnp.asarray(sizes.numpy()),
                             tiling=(128, 128, 128), interpret=True))
    np.testing.assert_allclose(ours, rd, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ours[:216], mb[:216], rtol=1e-5, atol=1e-4)  # megablox leaves tail rows undefined
    assert (ours[216:] == 0).all()


def test_empty_problems_are_zeros():
    lhs, rhs = torch.randn(0, 64), torch.randn(2, 64, 32)
    assert gm.grouped_matmul(lhs, rhs, torch.zeros(2, dtype=torch.int32)).shape == (0, 32)
    out = gm.grouped_matmul(torch.randn(5, 0), torch.randn(2, 0, 32), torch.tensor([2, 3], dtype=torch.int32))
    assert out.shape == (5, 32) and (out == 0).all()


def test_deterministic_and_inputs_unchanged():
    g = torch.Generator().manual_seed(10)
    lhs, rhs = randn(300, 200, dtype=torch.bfloat16, gen=g), randn(3, 200, 260, dtype=torch.bfloat16, gen=g)
    sizes = torch.tensor([100, 100, 90], dtype=torch.int32)
    copies = [t.clone() for t in (lhs, rhs, sizes)]
    outs = [gm.grouped_matmul(lhs, rhs, sizes, config=SMALL) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(copies, (lhs, rhs, sizes)))


# ----------------------------------------------------------------------------------------------- rhs prefetch chain
#: one K step (bk >= K = 200) and two output-column passes (bn = 128 | N = 256): the manual rhs chain
PREFETCH = dict(bm=64, bk=256, bn=128)


def _launch(M, K, N, G, cfg, transpose_rhs=False):
    from tpukernels.dsl.spec import TensorSpec
    import jax.numpy as jnp

    specs = (TensorSpec((G,), jnp.int32), TensorSpec((1,), jnp.int32), TensorSpec((M, K), jnp.float32),
             TensorSpec((G, N, K) if transpose_rhs else (G, K, N), jnp.float32))
    kernel = gm.grouped_matmul_fwd
    return kernel.make_launch(specs, (("transpose_rhs", transpose_rhs), ("out_dtype", None)),
                              kernel.space.complete(cfg))


def test_rhs_prefetch_is_used_exactly_where_it_applies():
    """The manual chain (rhs in pl.ANY, a 2-slot buffer, 2 DMA semaphores) at one K step with bn | N; the grid
    pipeline's rhs block at a K tail (two K steps), an N tail, or rhs_prefetch=False."""
    def manual(launch):
        return "any" in str(getattr(launch.in_specs[1], "memory_space", "")).lower()

    assert manual(_launch(300, 200, 256, 5, PREFETCH))
    assert manual(_launch(300, 200, 256, 5, PREFETCH, transpose_rhs=True))
    assert not manual(_launch(300, 200, 256, 5, dict(PREFETCH, rhs_prefetch=False)))
    assert not manual(_launch(300, 200, 256, 5, dict(PREFETCH, bk=128)))  # K tail: 2 K steps
    assert not manual(_launch(300, 200, 260, 5, PREFETCH))  # N tail: 260 % 128
    l = _launch(300, 200, 256, 5, PREFETCH)
    assert len(l.scratch_shapes) == 3 and l.dimension_semantics[0] == "arbitrary"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["nn", "nt"])
@settings(max_examples=3)
@given(data=st.data())
def test_rhs_prefetch_chain_matches_pipeline(mode, transpose_rhs, data):
    """Same bits as the grid pipeline's rhs blocks (same dots, f32 accumulation) and within the float64 bound,
    for any group sizes: empty groups, one huge group, sum < M, tiny groups (a group change on every tile)."""
    M, K, N, G = 300, 200, 256, 5
    sizes = data.draw(group_sizes(M, G))
    g = torch.Generator().manual_seed(int(sizes.sum()) + 3 * G + transpose_rhs)
    lhs = randn(M, K, dtype=torch.bfloat16, gen=g)
    rhs = randn(G, N, K, dtype=torch.bfloat16, gen=g) if transpose_rhs else randn(G, K, N, dtype=torch.bfloat16, gen=g)
    with tk.interpret_mode(mode):
        out = gm.grouped_matmul(lhs, rhs, sizes, transpose_rhs=transpose_rhs, config=PREFETCH)
        pipe = gm.grouped_matmul(lhs, rhs, sizes, transpose_rhs=transpose_rhs, config=dict(PREFETCH, rhs_prefetch=False))
    assert torch.equal(out, pipe)
    assert_within_bound(out, lhs, rhs, sizes, transpose_rhs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes, offset", [
    ([40, 40, 40, 40, 40, 40, 40], 0),  # a group change on every 64-row tile, every tile shared
    ([0, 300, 0, 0, 0, 0, 0], 0),  # one huge group: one run per pass
    ([0, 0, 0, 0, 0, 0, 0], 0),  # nothing: every tile stores zeros
    ([5, 0, 70, 1, 0, 100, 20], 0),  # empty and one-row groups, 104 tail rows
    ([30, 50, 60, 0, 80, 40, 10], 2),  # a shard: groups [2, 5) of 7
])
def test_rhs_prefetch_chain_edge_schedules(mode, sizes, offset):
    M, K, N = 300, 200, 384  # three passes: the chain crosses two pass boundaries
    G = 3 if offset else len(sizes)
    g = torch.Generator().manual_seed(13 + offset)
    lhs, rhs = randn(M, K, gen=g), randn(G, N, K, gen=g)
    sz = torch.tensor(sizes, dtype=torch.int32)
    with tk.interpret_mode(mode):
        out = gm.grouped_matmul(lhs, rhs, sz, transpose_rhs=True, group_offset=offset or None, config=PREFETCH)
    assert_within_bound(out, lhs, rhs, sz, True, group_offset=offset)


def test_rhs_prefetch_chain_has_no_races(monkeypatch):
    """The TPU interpreter's happens-before race detector (DMAs vs loads of the 2-slot buffer), NaN-initialised
    memory: no race on a schedule with a group change on almost every tile, empty groups and three passes."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax.experimental.pallas import tpu as pltpu

    import tpukernels.lowering as lowering

    monkeypatch.setattr(lowering, "interpret_value",
                        lambda mode: pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                                                                    dma_execution_mode="eager"))
    M, K, N = 296, 192, 384  # a shape no other test lowers (a fresh lowering with the patched interpreter)
    g = torch.Generator().manual_seed(14)
    lhs, rhs = randn(M, K, gen=g), randn(4, K, N, gen=g)
    sizes = torch.tensor([50, 0, 70, 90], dtype=torch.int32)
    with tk.interpret_mode("tpu"):
        out = gm.grouped_matmul(lhs, rhs, sizes, config=PREFETCH)
    assert ipc.races is not None and not ipc.races.races_found
    assert_within_bound(out, lhs, rhs, sizes)


def test_fwd_schedule_rhs_runs_and_the_all_zero_table():
    """The chain's fields: a run per group change of the rhs block (non-computing items keep the previous
    group), each run start names the next run's group (a pass's last run: the first run's group), and an
    all-zero table (libtpu's static model) reads as one run of group 0 per pass: a consistent chain."""
    import jax.numpy as jnp

    M, G, bm = 1000, 6, 128
    sizes = [300, 0, 128, 1, 400, 0]  # empty groups, a one-row group, 171 rows of no group
    T = gm.num_items(M, G, bm)
    (tab,) = gm.fwd_schedule(jnp.asarray(sizes, jnp.int32), jnp.zeros(1, jnp.int32), M=M, G=G, bm=bm, T=T)
    tab = np.asarray(tab).reshape(gm.N_FIELDS_FWD, T)
    group, run = tab[gm.F_GROUP], tab[gm.F_RUN]
    start = np.r_[True, group[1:] != group[:-1]]
    assert ((tab[gm.F_FLAGS] & gm.RUN_START) != 0).tolist() == [False] + start[1:].tolist()
    assert run.tolist() == (np.cumsum(start) - 1).tolist()
    run_groups = group[start].tolist()
    assert run_groups == [0, 2, 3, 4]  # the nonempty groups in order; the tail tiles keep group 4
    assert (tab[gm.F_RUNS_M1] == len(run_groups) - 1).all()
    assert tab[gm.F_NEXT_GROUP][start].tolist() == run_groups[1:] + run_groups[:1]
    zero = np.zeros(gm.N_FIELDS_FWD, np.int32)
    assert zero[gm.F_RUNS_M1] + 1 == 1 and not zero[gm.F_FLAGS] & gm.RUN_START


# ----------------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["nn", "nt"])
def test_gradients_match_float64_autograd(mode, transpose_rhs):
    g = torch.Generator().manual_seed(11 + transpose_rhs)
    M, K, N, G = 300, 200, 260, 4
    sizes = torch.tensor([90, 0, 150, 40], dtype=torch.int32)  # an empty group, 20 tail rows
    lhs = randn(M, K, gen=g).requires_grad_()
    rhs = (randn(G, N, K, gen=g) if transpose_rhs else randn(G, K, N, gen=g)).requires_grad_()
    dO = randn(M, N, gen=g)
    with tk.interpret_mode(mode):
        out = gm.grouped_matmul(lhs, rhs, sizes, transpose_rhs=transpose_rhs, config=SMALL)
        dl, dr = torch.autograd.grad(out, (lhs, rhs), dO)
    l64, r64 = lhs.detach().double().requires_grad_(), rhs.detach().double().requires_grad_()
    rl, rr = torch.autograd.grad(gm.reference(l64, r64, sizes, transpose_rhs=transpose_rhs), (l64, r64), dO.double())
    for got, want in ((dl, rl), (dr, rr)):
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()
    assert (dr[1] == 0).all() and (dl[280:] == 0).all()


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=4)
@given(data=st.data())
def test_tgmm_kernel_group_sizes(mode, data):
    M, K, N, G = 300, 200, 140, 4
    sizes = data.draw(group_sizes(M, G))
    g = torch.Generator().manual_seed(int(sizes.sum()))
    x, y = randn(M, K, dtype=torch.bfloat16, gen=g), randn(M, N, dtype=torch.bfloat16, gen=g)
    with tk.interpret_mode(mode):
        out = OPS.grouped_matmul_tgmm(sizes, torch.zeros(1, dtype=torch.int32), x, y, G, "float32",
                                      config=json.dumps(SMALL))
    ref = gm.reference_tgmm(x, y, sizes, G)
    scale = gm.reference_tgmm(x.abs(), y.abs(), sizes, G)
    # f32 output: only accumulation-order error, <= ~M * 2^-24 relative to |x|^T |y|
    assert ((out.double() - ref).abs() <= 4e-6 * scale + 1e-30).all()
    empty = sizes == 0
    assert (out[empty] == 0).all()



# ----------------------------------------------------------------------------------------------- tgmm d_W writes
#: bk | K = 256 and bn | N = 384: 2 x 3 d_W blocks written by the body's own copies, whose chain crosses them
TGMM_WRITES = dict(bm=64, bk=128, bn=128)


def _tgmm_launch(M, K, N, G, cfg):
    from tpukernels.dsl.spec import TensorSpec
    import jax.numpy as jnp

    specs = (TensorSpec((G,), jnp.int32), TensorSpec((1,), jnp.int32), TensorSpec((M, K), jnp.bfloat16),
             TensorSpec((M, N), jnp.bfloat16))
    kernel = gm.grouped_matmul_tgmm
    return kernel.make_launch(specs, (("num_groups", G), ("out_dtype", None)), kernel.space.complete(cfg))


def test_tgmm_writes_are_used_exactly_where_they_apply(monkeypatch):
    """The body's own d_W copies (out in pl.ANY, an n_slots staging buffer, DMA semaphores, the grid in
    order) where bk | K and bn | N; the pipeline's output blocks at a K or N tail; one slot where two do not fit."""
    def slots(launch):
        manual = "any" in str(getattr(launch.out_specs, "memory_space", "")).lower()
        assert manual == (launch.body_kwargs["n_slots"] > 0)
        return launch.body_kwargs["n_slots"]

    l = _tgmm_launch(300, 256, 384, 4, TGMM_WRITES)
    assert slots(l) == 2 and len(l.scratch_shapes) == 4 and set(l.dimension_semantics) == {"arbitrary"}
    assert slots(_tgmm_launch(300, 200, 384, 4, TGMM_WRITES)) == 0  # K tail: 200 % 128
    assert slots(_tgmm_launch(300, 256, 140, 4, TGMM_WRITES)) == 0  # N tail
    assert slots(_tgmm_launch(300, 100, 120, 4, TGMM_WRITES)) == 2  # one block: bk = K, bn = N
    monkeypatch.setattr(gm.kernels, "vmem_cap", lambda chip=None: 1 << 20)
    assert slots(_tgmm_launch(300, 256, 384, 4, TGMM_WRITES)) == 1


def _check_tgmm(out, x, y, sizes, G, offset=0):
    ref = gm.reference_tgmm(x, y, sizes, G, group_offset=offset)
    scale = gm.reference_tgmm(x.abs(), y.abs(), sizes, G, group_offset=offset)
    assert out.shape == ref.shape
    # f32 output: only accumulation-order error, <= ~M * 2^-24 relative to |x|^T |y|
    assert ((out.double() - ref).abs() <= 4e-6 * scale + 1e-30).all()
    local = sizes[offset:offset + G]
    assert (out[local == 0] == 0).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("slots", [2, 1])
@settings(max_examples=3)
@given(data=st.data())
def test_tgmm_writes_group_sizes(mode, slots, data):
    """The d_W writes' chain for any group sizes (empty groups, one huge group, sum < M, tiny groups: a write on
    almost every item), two slots and one, against the float64 reference."""
    M, K, N, G = 300, 256, 384 if slots == 2 else 256, 5  # a shape per slot count: one lowering each
    sizes = data.draw(group_sizes(M, G))
    g = torch.Generator().manual_seed(int(sizes.sum()) + slots)
    x, y = randn(M, K, dtype=torch.bfloat16, gen=g), randn(M, N, dtype=torch.bfloat16, gen=g)
    with pytest.MonkeyPatch.context() as mp:
        if slots == 1:
            mp.setattr(gm.kernels, "vmem_cap", lambda chip=None: 1 << 20)
        with tk.interpret_mode(mode):
            out = OPS.grouped_matmul_tgmm(sizes, torch.zeros(1, dtype=torch.int32), x, y, G, "float32",
                                          config=json.dumps(TGMM_WRITES))
    _check_tgmm(out, x, y, sizes, G)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes, offset", [
    ([40, 40, 40, 40, 40, 40, 40], 0),  # groups of one or two 64-row items: first and last in one, shared tiles
    pytest.param([64, 64, 0, 128, 44], 0, marks=pytest.mark.slow),  # tile-aligned: interior first-and-last items
    pytest.param([0, 300, 0, 0, 0, 0, 0], 0, marks=pytest.mark.slow),  # one huge group
    ([0, 0, 0, 0, 0, 0, 0], 0),  # nothing: every write is zeros
    ([5, 0, 70, 1, 0, 100, 20], 0),  # empty and one-row groups, 104 tail rows
    ([30, 50, 60, 0, 80, 40, 10], 2),  # a shard: groups [2, 5) of 7
])
def test_tgmm_writes_edge_schedules(mode, sizes, offset):
    M, K, N = 300, 256, 384
    G = 3 if offset else len(sizes)
    g = torch.Generator().manual_seed(15 + offset)
    x, y = randn(M, K, dtype=torch.bfloat16, gen=g), randn(M, N, dtype=torch.bfloat16, gen=g)
    sz = torch.tensor(sizes, dtype=torch.int32)
    with tk.interpret_mode(mode):
        out = OPS.grouped_matmul_tgmm(sz, torch.tensor([offset], dtype=torch.int32), x, y, G, "float32",
                                      config=json.dumps(TGMM_WRITES))
        bf = OPS.grouped_matmul_tgmm(sz, torch.tensor([offset], dtype=torch.int32), x, y, G, None,
                                     config=json.dumps(TGMM_WRITES))
    _check_tgmm(out, x, y, sz, G, offset)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, out.bfloat16())  # one rounding of the same f32 sums


def test_tgmm_writes_have_no_races(monkeypatch):
    """The TPU interpreter's race detector (the d_W copies vs stores of the staging slots), NaN-initialised
    memory, on a schedule with a write on almost every item, empty groups and six d_W blocks."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax.experimental.pallas import tpu as pltpu

    import tpukernels.lowering as lowering

    monkeypatch.setattr(lowering, "interpret_value",
                        lambda mode: pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                                                                    dma_execution_mode="eager"))
    M, K, N, G = 296, 256, 384, 6  # a shape no other test lowers (a fresh lowering with the patched interpreter)
    g = torch.Generator().manual_seed(16)
    x, y = randn(M, K, dtype=torch.bfloat16, gen=g), randn(M, N, dtype=torch.bfloat16, gen=g)
    sizes = torch.tensor([50, 0, 70, 10, 90, 0], dtype=torch.int32)
    with tk.interpret_mode("tpu"):
        out = OPS.grouped_matmul_tgmm(sizes, torch.zeros(1, dtype=torch.int32), x, y, G, "float32",
                                      config=json.dumps(TGMM_WRITES))
    assert ipc.races is not None and not ipc.races.races_found
    _check_tgmm(out, x, y, sizes, G)

def test_bf16_gradients_are_rounded_once():
    """bf16: d_rhs within 1.2x of an f32-accumulated, once-rounded per-group lhs^T @ dO."""
    g = torch.Generator().manual_seed(12)
    lhs = randn(300, 200, dtype=torch.bfloat16, gen=g).requires_grad_()
    rhs = randn(3, 200, 260, dtype=torch.bfloat16, gen=g).requires_grad_()
    sizes = torch.tensor([120, 130, 10], dtype=torch.int32)
    dO = randn(300, 260, dtype=torch.bfloat16, gen=g)
    out = gm.grouped_matmul(lhs, rhs, sizes, config=SMALL)
    (dr,) = torch.autograd.grad(out, (rhs,), dO)
    ref = gm.reference_tgmm(lhs.detach(), dO, sizes, 3)
    idl = torch.stack([lhs.detach()[s:e].float().T @ dO[s:e].float() for s, e in ((0, 120), (120, 250), (250, 260))])
    assert rms(dr.double() - ref) <= 1.2 * rms(idl.bfloat16().double() - ref) + U32 * rms(ref)


def test_tgmm_schedule_flags_and_the_all_zero_table():
    """tgmm's table: one FIRST and one LAST item per local group, COMPUTE on exactly the tiles of nonempty
    groups, PARTIAL only on tiles not wholly inside the group; an all-zero table (what libtpu's static model
    reads from SMEM) decodes as an interior item that accumulates, neither first nor last of its group."""
    import jax.numpy as jnp

    M, G, bm = 1000, 5, 128
    sizes = [300, 0, 128, 1, 500]  # an empty group, a tile-aligned one, a one-row group, an M tail
    T = gm.num_items(M, G, bm)
    (tab,) = gm.tgmm_schedule(jnp.asarray(sizes, jnp.int32), jnp.zeros(1, jnp.int32), M=M, G=G, bm=bm, T=T)
    tab = np.asarray(tab).reshape(gm.N_FIELDS, T)
    flags = np.asarray(gm.tgmm_flags(tab.reshape(-1), T, np.arange(T)))
    group, tile = tab[gm.F_GROUP], tab[gm.F_TILE]
    bit = {n: (flags & b) != 0 for n, b in (("c", gm.COMPUTE), ("f", gm.FIRST), ("l", gm.LAST), ("p", gm.PARTIAL))}
    assert [int((bit["f"] & (group == g)).sum()) for g in range(G)] == [1] * G
    assert [int((bit["l"] & (group == g)).sum()) for g in range(G)] == [1] * G
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for g in range(G):
        want = sorted(range(starts[g] // bm, (starts[g] + sizes[g] - 1) // bm + 1)) if sizes[g] else []
        assert sorted(tile[bit["c"] & (group == g)].tolist()) == want, g
        inside = [(t * bm >= starts[g]) and ((t + 1) * bm <= starts[g] + sizes[g]) for t in want]
        assert bit["p"][bit["c"] & (group == g)].tolist() == [not x for x in inside], g
    zero = int(gm.tgmm_flags(np.zeros(gm.N_FIELDS, np.int32), 1, 0))
    assert zero & gm.COMPUTE and not zero & (gm.FIRST | gm.LAST | gm.PARTIAL)


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("make, exc, match", [
    (lambda: (torch.randn(4, 8, 2), torch.randn(2, 8, 3), torch.tensor([2, 2], dtype=torch.int32)), ArgumentError,
     "lhs must be 2-D"),
    (lambda: (torch.randn(4, 8), torch.randn(8, 3), torch.tensor([2, 2], dtype=torch.int32)), ArgumentError,
     "rhs must be 3-D"),
    (lambda: (torch.randn(4, 8), torch.randn(2, 7, 3), torch.tensor([2, 2], dtype=torch.int32)), ArgumentError,
     "contraction dims differ"),
    (lambda: (torch.randn(4, 8), torch.randn(2, 8, 3).half(), torch.tensor([2, 2], dtype=torch.int32)),
     DTypeError, "lhs is float32 but rhs is float16"),
    (lambda: (torch.randn(4, 8).double(), torch.randn(2, 8, 3).double(), torch.tensor([2, 2], dtype=torch.int32)),
     DTypeError, "float64 is not supported"),
    (lambda: (torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([2, 2])), DTypeError, "group_sizes must be int32"),
    (lambda: (torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([4], dtype=torch.int32)), ArgumentError,
     "group_sizes has 1 groups but rhs has 2"),
    (lambda: (torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([1, 1, 2], dtype=torch.int32)), ArgumentError,
     "pass group_offset"),
    (lambda: (torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([3, -1], dtype=torch.int32)), ArgumentError,
     r"group_sizes\[1\] = -1 is negative"),
    (lambda: (torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([3, 2], dtype=torch.int32)), ArgumentError,
     r"sum\(group_sizes\) = 5 exceeds lhs rows M = 4"),
])
def test_bad_inputs_raise_typed_errors(make, exc, match):
    lhs, rhs, sizes = make()
    with pytest.raises(exc, match=match):
        gm.grouped_matmul(lhs, rhs, sizes)


@pytest.mark.parametrize("wide", ("lhs", "rhs"))
def test_mixed_bf16_f32_operands_compute_the_f32_product_with_gradients_in_each_dtype(wide):
    """megablox takes f32 x bf16: the bf16 operand is widened exactly, so the result is the f32 kernel's product
    of the same values (float64 reference of the given values), and each gradient comes back in its own dtype
    and equals the f32 kernel's gradient rounded to it."""
    g = torch.Generator().manual_seed(7)
    lhs, rhs = randn(60, 40, gen=g), randn(3, 40, 24, gen=g)
    if wide == "lhs":
        rhs = rhs.bfloat16()
    else:
        lhs = lhs.bfloat16()
    sizes = torch.tensor([25, 0, 30], dtype=torch.int32)
    lhs.requires_grad_(True)
    rhs.requires_grad_(True)
    out = gm.grouped_matmul(lhs, rhs, sizes, config=SMALL)
    assert out.dtype == torch.float32
    assert_within_bound(out.detach(), lhs.detach().float(), rhs.detach().float(), sizes, out_dtype=torch.float32)
    dO = randn(60, 24, gen=g)
    out.backward(dO)
    assert lhs.grad.dtype == lhs.dtype and rhs.grad.dtype == rhs.dtype
    lf, rf = lhs.detach().float().requires_grad_(True), rhs.detach().float().requires_grad_(True)
    gm.grouped_matmul(lf, rf, sizes, config=SMALL).backward(dO)
    assert torch.equal(lhs.grad, lf.grad.to(lhs.dtype)) and torch.equal(rhs.grad, rf.grad.to(rhs.dtype))


def test_bad_group_offset_and_out_dtype():
    lhs, rhs, sizes = torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([1, 1, 2], dtype=torch.int32)
    with pytest.raises(ArgumentError, match=r"group_offset 2 must be in \[0, len\(group_sizes\) - rhs.shape\[0\]\]"):
        gm.grouped_matmul(lhs, rhs, sizes, group_offset=2)
    with pytest.raises(DTypeError, match="group_offset must be int32"):
        gm.grouped_matmul(lhs, rhs, sizes, group_offset=torch.tensor(0))
    with pytest.raises(DTypeError, match="out_dtype"):
        gm.grouped_matmul(lhs, rhs, sizes, group_offset=1, out_dtype=torch.int8)


def test_mixed_devices_raise():
    lhs, rhs = torch.randn(4, 8), torch.randn(2, 8, 3)
    sizes = torch.tensor([2, 2], dtype=torch.int32, device="meta")
    with pytest.raises(DeviceError, match="one device"):
        gm.grouped_matmul(lhs, rhs, sizes)


def test_unchecked_values_are_clamped_on_device():
    """The kernel op itself (no host value checks): negative sizes count as 0, ends cap at M."""
    lhs, rhs = torch.randn(300, 200), torch.randn(2, 200, 130)
    bad = torch.tensor([-5, 400], dtype=torch.int32)  # clamped: [0, 300)
    out = OPS.grouped_matmul_fwd(bad, torch.zeros(1, dtype=torch.int32), lhs, rhs, None, False, None,
                                 config=json.dumps(SMALL))
    want = gm.reference(lhs, rhs, torch.tensor([0, 300], dtype=torch.int32))
    assert (out.double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_op_schema_and_opcheck():
    lhs, rhs = torch.randn(40, 16), torch.randn(2, 16, 24)
    sizes = torch.tensor([10, 20], dtype=torch.int32)
    go = torch.zeros(1, dtype=torch.int32)
    for bias in (None, torch.randn(2, 1, 24)):  # rhs_bias absent and present
        torch.library.opcheck(OPS.grouped_matmul_fwd.default, (sizes, go, lhs, rhs, bias, False, None),
                              test_utils=("test_schema", "test_faketensor"))
    assert torch.equal(OPS.grouped_matmul(lhs, rhs, sizes), gm.grouped_matmul(lhs, rhs, sizes))


# ----------------------------------------------------------------------------------------------- compile-only
@pytest.mark.aot
@pytest.mark.parametrize("chip", [pytest.param("v5e", marks=pytest.mark.slow), "v6e", "tpu7x"])  # v5e: ~90 s
@pytest.mark.parametrize("case", range(len(gm.STANDARD_CASES)))
def test_compile_only_standard_cases(chip, case):
    """Mosaic + XLA:TPU compile the config dispatch picks (shipped default) for each chip at Mixtral shapes."""
    kernel, args, kwargs = gm.STANDARD_CASES[case]
    res = tk.compile_for(kernel, chip, *args, **kwargs, with_mlir=False)
    assert res.ok, res.summary()
    assert res.vmem_estimate_bytes <= (res.vmem_limit_bytes or 0)



@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
@pytest.mark.parametrize("x, y, cfg", [
    ("300x200:bf16", "300x140:bf16", None),  # the d_W writes, one block of odd full dims (bk = K, bn = N)
    ("1000x256:bf16", "1000x384:bf16", TGMM_WRITES),  # the d_W writes over 2 x 3 blocks
    ("1000x200:bf16", "1000x384:bf16", TGMM_WRITES),  # a K tail: the pipeline's output blocks
], ids=["writes-one-block", "writes-blocks", "k-tail"])
def test_compile_only_tgmm_write_paths(chip, x, y, cfg):
    res = tk.compile_for(gm.grouped_matmul_tgmm, chip, "4:i32", "1:i32", x, y, 4, config=cfg, with_mlir=False)
    assert res.ok, res.summary()

# ----------------------------------------------------------------------------------------------- DSL: Launch.prefetch
def _rev_body(order_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]


@tk.tpu_kernel(_rev_body, name="prefetch_reverse_rows", namespace="tpukernels_test")
def prefetch_reverse_rows(n: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Row blocks of ``x`` in the order ``prefetch`` derives on device from the int32 scalar ``n``."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    nb = x.shape[0] // 8
    return tk.Launch(
        grid=(nb,),
        in_specs=[pl.BlockSpec((8, x.shape[1]), lambda i, order: (order[i], 0))],
        out_specs=pl.BlockSpec((8, x.shape[1]), lambda i, order: (i, 0)),
        out_shape=tk.OutSpec(tuple(x.shape), x.dtype),
        num_scalar_prefetch=1,
        prefetch=lambda n: ((n[0] - 1 - jnp.arange(nb, dtype=jnp.int32)) % nb,),
    )


@pytest.mark.parametrize("mode", MODES)
def test_launch_prefetch_derives_scalar_operands(mode):
    """tk.Launch.prefetch: scalar-prefetch operands computed from kernel inputs inside the jitted function."""
    x = torch.arange(32 * 128, dtype=torch.float32).reshape(32, 128)
    with tk.interpret_mode(mode):
        out = prefetch_reverse_rows(torch.tensor([4], dtype=torch.int32), x)
        shifted = prefetch_reverse_rows(torch.tensor([2], dtype=torch.int32), x)
    assert torch.equal(out, x.reshape(4, 8, 128).flip(0).reshape(32, 128))
    assert torch.equal(shifted, x.reshape(4, 8, 128)[[1, 0, 3, 2]].reshape(32, 128))


# ----------------------------------------------------------------------------------------------- bench family
def test_bench_family_cases():
    """The bench family builds ours + ragged_dot + megablox per standard case and chip (registered in FAMILIES)."""
    from tpukernels.bench import FAMILIES
    from tpukernels.bench import grouped_matmul as bgm

    assert "grouped_matmul" in FAMILIES
    cases = bgm.cases(["v6e"])
    assert len(cases) == len(gm.STANDARD_CASES) + len(bgm.QUANT_CASES)  # + the quantized-expert rows (ours only)
    for c in cases[:len(gm.STANDARD_CASES)]:  # tpu-inference's megablox fork: a forward column (it has no tgmm)
        tgmm = c.op.startswith("tgmm")
        assert [i.name for i in c.impls][1:] == (["xla ragged_dot", "jax megablox tgmm"] if tgmm else
                                                 ["xla ragged_dot", "jax megablox gmm", "tpu-inference megablox gmm"])
        assert c.flops > 0 and c.hbm_bytes > 0
    up = cases[0]
    assert up.flops == 2 * 16384 * 4096 * 14336


def test_bench_tpu_inference_megablox_program():
    """The tpu-inference column is its megablox fork's own gmm at its default tiling for the full problem, on the
    weights pre-transposed to [G, K, N] (it has no transpose_rhs), its grid at the static bound with its
    GroupMetadata zeroed like JAX megablox's, and its metadata program exportable (a tuple of arrays)."""
    import jax

    pytest.importorskip("tpu_inference.kernels.megablox.gmm")
    from tpu_inference.kernels.megablox import tuned_block_sizes as T

    from tpukernels.bench import grouped_matmul as bgm

    assert bgm.tpu_inference_tiling(16384, 4096, 14336, 8) == T.get_default_gmm_block_sizes(16384, 4096, 14336, 8)
    up = bgm.cases(["v6e"])[0]  # x[16384, 4096] @ W[g].T, W [8, 14336, 4096]
    impl = next(i for i in up.impls if i.name == "tpu-inference megablox gmm")
    programs, metas = [], []

    class Recorder:  # stands in for the estimator: keeps the programs, answers 1000 + blocks x (50 + rows) cycles
        def cycles(self, fn, structs, chip):
            if len(structs) != 3:
                metas.append((fn, structs))
                return 10
            programs.append((fn, structs))
            return 1000 + structs[1].shape[2] // 2048 * (50 + structs[0].shape[0])

    cyc, cfg = impl.cycles(Recorder(), "v6e")
    assert cfg == "tiling=512,2048,2048,rhs pre-transposed to [G, K, N] (not counted)"
    (fn, structs), = [p for p in programs if p[1][0].shape[0] == 2048 and p[1][1].shape[2] == 2048]
    assert [s.shape for s in structs] == [(2048, 4096), (8, 4096, 2048), (8,)]
    assert jax.eval_shape(fn, *structs).shape == (2048, 2048)
    meta_fn, meta_structs = metas[0]
    out = jax.eval_shape(meta_fn, *meta_structs)
    assert isinstance(out, tuple) and all(isinstance(o, jax.ShapeDtypeStruct) for o in out)
    assert jax.export.export(meta_fn, platforms=["tpu"])(*meta_structs) is not None
    # three reduced problems (2048 / 4096 rows, 1 / 2 blocks of 2048 columns) fitted to 16384 rows x 7 blocks
    assert len(programs) == 3 and cyc == 1000 + 7 * (50 + 16384) + 10


def test_fwd_vmem_limit_follows_the_chip():
    """The scoped-VMEM cap comes from the chip's capacity (jax tpu_info): a 71 MiB forward config gets a
    93 MiB limit on v6e (128 MiB of VMEM) and is a VmemError naming tpu7x (64 MiB) there."""
    from tpukernels.bench.grouped_matmul import _lowered
    from tpukernels.chips import get_chip
    from tpukernels.errors import VmemError

    kernel, _, kwargs = gm.STANDARD_CASES[1]  # down projection: rhs [G, 4096, 14336], transpose_rhs
    args = ("8:i32", "1:i32", "512x14336:bf16", "8x4096x14336:bf16")
    cfg = dict(bm=256, bk=16384, bn=1024)  # bk = K: 2 x (256 x 14336 + 1024 x 14336) bf16 blocks, 71 MiB
    low = _lowered(kernel, "v6e", args, kwargs, cfg)
    limit = low.resolved.launch.vmem_limit_bytes
    assert 71 * 2**20 < limit <= get_chip("v6e").vmem_capacity_bytes * 7 // 8
    with pytest.raises(VmemError, match="tpu7x"):
        _lowered(kernel, "tpu7x", args, kwargs, cfg)


# ----------------------------------------------------------------------------------------------- shipped defaults
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_shipped_defaults_cover_the_standard_cases(chip, tmp_cache):
    """Every standard case has a shipped entry for the current kernel source (else: rerun the autotune)."""
    from tpukernels.autotune import db
    from tpukernels.autotune.space import Problem

    for kernel, args, kwargs in gm.STANDARD_CASES:
        p = Problem.from_args(kernel, *args, **kwargs)
        got = db.lookup(kernel, chip, p.specs, p.statics)
        assert got is not None and got[1] == "shipped-db", f"{chip} {kernel.name} {args}: {got}"
        want = {"bm", "bk", "bn"} if kernel.name.endswith("tgmm") else {"bm", "bk", "bn", "rhs_prefetch"}
        assert set(got[0]) == want
