"""The MoE bench family (tpukernels.bench.moe): its cases, the work-item fit of the grouped matmuls, and its two
XLA programs: the peer's routing / permute / activation / combine computes the MoE layer (against the float64
reference), and the ops between our kernels are what the library's permute computes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tpukernels.bench import moe

TINY = moe.MoEModel("tiny", H=128, I=64, E=16, k=4)
TINY_OSS = dataclasses.replace(TINY, name="tiny-oss", act="swigluoai", bias=True, interleaved=True)
TINY_DSV3 = dataclasses.replace(TINY, name="tiny-dsv3", router="grouped", n_group=4, topk_group=2, logits_dtype="f32")


def test_family_cases():
    """Three models x three phases x each chip, ours + megablox with XLA routing + tpu-inference's fused MoE (a
    floor, never attempted); FLOPs count every token slot's three projections."""
    from tpukernels.bench import MODEL_FAMILIES

    assert "moe" in MODEL_FAMILIES
    cases = moe.cases(["v6e", "tpu7x"])
    assert len(cases) == len(moe.MODELS) * len(moe.PHASES) * 2
    assert {c.shape for c in cases} == {"decode T=64", "decode T=256", "prefill T=8192"}
    for c in cases:
        assert [i.name for i in c.impls] == ["tpukernels", "jax megablox + xla routing", "tpu-inference fused_moe v1"]
    qwen = next(c for c in cases if c.op.startswith("Qwen3") and c.shape == "prefill T=8192")
    assert qwen.flops == 2 * 8192 * 8 * 3 * 2048 * 768
    ti = qwen.impls[2]
    with pytest.raises(moe.EstimateError, match="not attempted"):
        ti.cycles(None, "v6e")
    assert ti.floor_us("v6e") == pytest.approx(qwen.impls[1].floor_us("v6e")) and ti.floor_us("v6e") > 0


def test_touched_experts_matches_a_simulated_router():
    """The roofline's weight bytes count the experts a uniform top-k router hits: E (1 - (1 - k/E)^T), checked
    against routing simulated with k distinct experts per token."""
    rng = np.random.default_rng(0)
    for m, T in ((moe.MODELS[0], 64), (moe.MODELS[2], 64), (TINY, 3)):
        hits = [len({e for _ in range(T) for e in rng.choice(m.E, m.k, replace=False)}) for _ in range(400)]
        assert moe.touched_experts(m, T) == pytest.approx(np.mean(hits), rel=0.02)
    hbm, _ = moe.hbm_and_flops(moe.MODELS[0], 8192)
    assert hbm == pytest.approx(2 * 8192 * 2048 * 2 + 8192 * 128 * 2 + 128 * 3 * 2048 * 768 * 2, rel=1e-6)


class Recorder:
    """Stands in for the estimator: keeps each program and answers ``cycles(structs)``."""

    def __init__(self, cycles):
        self.programs, self.fn = [], cycles

    def cycles(self, fn, structs, chip):
        self.programs.append((fn, structs))
        return self.fn(structs)


@pytest.mark.parametrize("which", ["up", "down"])
def test_item_fit_recovers_a_linear_cost(which):
    """Our grouped matmul is estimated at 8 row tiles with 8 and 16 groups and reduced columns (column_blocks), at
    the config of the full call (bm clamped to the rows), evaluated at the full problem's items times its blocks."""
    from tpukernels.library import grouped_matmul_ops as gm

    m, T = moe.MODELS[0], 64  # 512 rows: the full call's bm clamps to 512
    fit, cfg = moe.ours_grouped_matmul(m, T, which, "v6e")
    M, K, N = (T * m.k, m.H, 2 * m.I) if which == "up" else (T * m.k, m.I, m.H)
    bm, bn = gm.clamp(M, cfg["bm"]), gm.clamp(N, cfg["bn"])
    per_item, launch, meta = 37, 1000, 5

    def cost(structs):
        if len(structs) < 3:  # the schedule program
            return meta
        G, rows = structs[2].shape[0], structs[1].shape[0]  # (work-item table, lhs, rhs [G, N, K], ...)
        assert rows == moe.FIT_TILES * bm and G in moe.FIT_GROUPS
        return launch + per_item * gm.num_items(rows, G, bm)

    rec = Recorder(cost)
    got = fit.cycles(rec, "v6e")
    n_red, blocks = moe.column_blocks(N, bn)
    assert n_red * blocks == N
    assert got == launch + per_item * blocks * gm.num_items(M, m.E, bm) + meta
    kernels = [s for _, s in rec.programs if len(s) >= 3]
    assert len(kernels) == 2 and {s[2].shape[1] for s in kernels} == {n_red}


def test_column_blocks():
    """One bn block where bn divides N; a ragged N whole, or in halves that still hold a full block."""
    assert moe.column_blocks(4096, 1024) == (1024, 4)
    assert moe.column_blocks(1536, 1024) == (1536, 1)  # Qwen3-30B-A3B gate/up
    assert moe.column_blocks(5760, 1024) == (2880, 2)  # gpt-oss gate/up
    assert moe.column_blocks(2880, 1024) == (2880, 1)


def test_megablox_fit_counts_its_static_grid():
    """megablox's kernel at 8 row tiles (tm clamped to the rows) and 8 / 16 groups: tiles + G - 1 grid steps per
    column block; its make_group_metadata at the full problem."""
    m, T = moe.MODELS[0], 64
    fit, cfg = moe.megablox_grouped_matmul(m, T, "down")  # [512, 768] @ [128, 2048, 768].T
    assert cfg == "tiling=512,768,1024,transpose_rhs"
    rec = Recorder(lambda s: 3 if len(s) == 1 else 100 + 10 * (moe.FIT_TILES + s[2].shape[0] - 1))
    assert fit.cycles(rec, "v6e") == 100 + 10 * 2 * (1 + 128 - 1) + 3
    lhs = [s[0].shape for _, s in rec.programs if len(s) == 3]
    assert lhs == [(8 * 512, 768)] * 2


def _mm(x, w, ids):
    """Row i of x times expert ids[i]'s weights ``w [E, N, K]`` (transposed), float32 out."""
    return torch.einsum("mk,mnk->mn", x.float(), w.float()[ids])


@pytest.mark.parametrize("m", [TINY, TINY_OSS, TINY_DSV3], ids=lambda m: m.name)
def test_xla_moe_glue_computes_the_layer(m):
    """The peer's XLA program around megablox (its gmm outputs fed back in, bf16 as megablox returns them) is the
    MoE layer: float64 reference (fused_moe_reference on the reference router's choice) within bf16 rounding; its
    router picks the reference router's experts (DeepSeek: grouped sigmoid top-k with the correction bias)."""
    import jax.numpy as jnp

    from tpukernels.library.fused_moe_ops import fused_moe_reference
    from tpukernels.library.moe_routing import router_topk_reference

    g = torch.Generator().manual_seed(1)
    T, E, H, I, k = 24, m.E, m.H, m.I, m.k
    ldt = torch.float32 if m.logits_dtype == "f32" else torch.bfloat16
    x = torch.randn(T, H, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g).to(ldt)
    corr = torch.rand(E, generator=g) * 0.2
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    b1 = (torch.randn(E, 2 * I, generator=g) * 0.1).bfloat16()
    b2 = (torch.randn(E, H, generator=g) * 0.1).bfloat16()
    mode = "grouped" if m.router == "grouped" else "softmax"
    rw, rid = router_topk_reference(logits, k, mode, renormalize=True, n_group=m.n_group, topk_group=m.topk_group,
                                    e_score_correction_bias=corr if mode == "grouped" else None,
                                    routed_scaling_factor=2.5 if mode == "grouped" else 1.0)
    ref = fused_moe_reference(x, w1, w2, topk_weights=rw, topk_ids=rid, act_fn=m.act, transpose_rhs=True,
                              gate_up_interleaved=m.interleaved, b1=b1[:, None] if m.bias else None,
                              b2=b2[:, None] if m.bias else None)

    fn, structs = moe.xla_moe_glue(m, T)

    def j(t):  # a torch tensor as a jax array of its dtype (bf16 or f32)
        return jnp.asarray(t.float().numpy(), jnp.float32 if t.dtype == torch.float32 else jnp.bfloat16)

    up0, down0 = jnp.zeros(structs[3].shape, jnp.bfloat16), jnp.zeros(structs[4].shape, jnp.bfloat16)
    xs, sizes, _, _ = fn(j(x), j(logits), j(corr), up0, down0, j(b1), j(b2))
    sorted_ids = torch.sort(rid.reshape(-1), stable=True).values  # the rows' experts in group order
    assert torch.equal(torch.from_numpy(np.array(sizes)).long(), torch.bincount(rid.reshape(-1), minlength=E))
    up = _mm(torch.from_numpy(np.array(xs.astype(jnp.float32))), w1, sorted_ids).bfloat16()
    _, _, h, _ = fn(j(x), j(logits), j(corr), j(up), down0, j(b1), j(b2))
    down = _mm(torch.from_numpy(np.array(h.astype(jnp.float32))), w2, sorted_ids).bfloat16()
    *_, out = fn(j(x), j(logits), j(corr), j(up), j(down), j(b1), j(b2))
    out = torch.from_numpy(np.array(out.astype(jnp.float32))).double()
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max() + 1e-3
    # a wrong expert choice changes the layer well beyond rounding: the check above can fail
    wrong = fused_moe_reference(x, w1, w2, topk_weights=rw, topk_ids=(rid + 1) % E, act_fn=m.act, transpose_rhs=True,
                                gate_up_interleaved=m.interleaved, b1=b1[:, None] if m.bias else None,
                                b2=b2[:, None] if m.bias else None)
    assert (wrong - ref).abs().max() > 10 * (2e-2 * ref.abs().max() + 1e-3)


def test_ours_xla_glue_is_the_library_permute():
    """The XLA ops between our kernels give the same source rows, positions and group sizes as moe_permute_jax,
    and the router output's first k columns."""
    import jax.numpy as jnp

    from tpukernels.library.moe_routing import moe_permute_jax
    from tpukernels.library.moe_routing.common import padded_k

    m, T = TINY, 24
    rng = np.random.default_rng(2)
    ids = np.stack([rng.choice(m.E, m.k, replace=False) for _ in range(T)]).astype(np.int32)
    kp = padded_k(m.k)
    ip = np.zeros((T, kp), np.int32)
    ip[:, :m.k] = ids
    wp = rng.random((T, kp)).astype(np.float32)
    fn, structs = moe.ours_xla_glue(m, T)
    args = [jnp.asarray(wp), jnp.asarray(ip)] + [jnp.asarray(rng.random(s.shape), s.dtype) for s in structs[2:]]
    w, src, positions, sizes, gate, up = fn(*args)  # I = 64: not the in-place halves form, so split
    x = jnp.asarray(rng.standard_normal((T, m.H)), jnp.float32)
    xs, want_sizes, (order, want_pos, _) = moe_permute_jax(x, jnp.asarray(ids), m.E, interpret="fast")
    assert np.array_equal(np.asarray(src), np.asarray(order) // m.k)
    assert np.array_equal(np.asarray(positions).reshape(T, m.k), np.asarray(want_pos))
    assert np.array_equal(np.asarray(sizes), np.asarray(want_sizes))
    assert np.array_equal(np.asarray(x)[np.asarray(src)], np.asarray(xs))
    assert np.array_equal(np.asarray(w), wp[:, :m.k])
    assert np.array_equal(np.asarray(gate), np.asarray(args[2])[:, :m.I]) and gate.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(up), np.asarray(args[2])[:, m.I:])
    # I = 128: the activation kernel reads the fused output's halves, so no split (and no split copies) in XLA
    wide = dataclasses.replace(m, I=128)
    fn, structs = moe.ours_xla_glue(wide, T)
    assert len(fn(*args[:2], *[jnp.zeros(s.shape, s.dtype) for s in structs[2:]])) == 4
    act = [kw for kernel, _, kw, _ in moe.layer_kernels(wide, T) if kernel.name == "gated_activation_fwd"]
    assert act == [{"activation": "silu", "halves": True, "out_dtype": "bfloat16"}]


def test_ours_programs_export_for_tpu():
    """Every program of our layer (router, permute gather, activation, combine, the XLA ops, both grouped matmuls'
    reduced kernels and schedules) lowers for a TPU target at a tiny config; a failing part is named in the error."""
    from tpukernels.chips import get_chip
    from tpukernels.targets.compile_only import export_for_chip

    m, T = TINY, 16
    exported = []

    class Exporter:  # what the estimator sends libtpu
        def cycles(self, fn, structs, chip):
            exported.append(export_for_chip(fn, get_chip(chip), structs))
            return 1

    roof = lambda chip: 1.0  # noqa: E731
    impl = moe._ours(m, T, roof)
    cyc, cfg = impl.cycles(Exporter(), "v6e")
    # 4 kernels + the XLA ops + 2 x (two reduced kernels + a schedule)
    # each fit answers 1 at both reduced problems (no cost per item) plus 1 for its schedule
    assert len(exported) == 4 + 1 + 2 * 3 and cyc == 4 + 1 + 2 * 2
    assert cfg.startswith("up: bm=") and "; down: bm=" in cfg

    class FailsTheGlue:  # libtpu aborts on one program: the others still count, as a floor
        def cycles(self, fn, structs, chip):
            if len(structs) == 3 and structs[0].shape == (T, 128):  # the XLA ops (router outputs padded to 128)
                raise moe.EstimateError("boom")
            return 1000

    with pytest.raises(moe.EstimateError, match="the XLA ops between the kernels: boom"):
        impl.cycles(FailsTheGlue(), "v6e")
    from tpukernels.perf import clock_hz

    assert impl.floor_us("v6e") == pytest.approx(max(1.0, (4 + 2 * 2) * 1000 / clock_hz("v6e") * 1e6))

    class MisCostsTheGlue(FailsTheGlue):  # a profiler fault: far over the whole layer's roofline
        def cycles(self, fn, structs, chip):
            if len(structs) == 3 and structs[0].shape == (T, 128):
                return int(moe.NOT_CREDIBLE_ROOFLINES * 2e-6 * clock_hz(chip))  # 2x the limit at a 1 µs roofline
            return 1000

    with pytest.raises(moe.EstimateError, match="the XLA ops between the kernels: libtpu's estimate .* not credible"):
        impl.cycles(MisCostsTheGlue(), "v6e")
    assert impl.floor_us("v6e") == pytest.approx(max(1.0, (4 + 2 * 2) * 1000 / clock_hz("v6e") * 1e6))


def test_row_copy_kernels_are_fitted_in_tokens_above_the_byte_limit():
    """A kernel that copies rows one DMA each (the combine at prefill): above FIT_BYTES of copies it is estimated
    at two reduced token counts (each within the limit) at the full call's config and extrapolated linearly. A
    kernel whose source is resident in VMEM (the permute gather of Qwen3's 32 MiB of tokens) is estimated whole."""
    from tpukernels.library.moe_routing import permute_ops

    m = moe.MODELS[0]
    parts = {p[0]: p[1:] for p in moe.layer_kernels(m, 8192)}
    args, kwargs, row_bytes = parts[permute_ops.moe_gather_reduce_fwd]
    assert row_bytes == 2 * m.H
    seen = []

    def cost(structs):
        rows = structs[1].shape[0]  # pos / idx: one row read each
        seen.append(rows)
        return 100 + 3 * rows

    got = moe.row_copy_cycles(Recorder(cost), "v6e", permute_ops.moe_gather_reduce_fwd, args, kwargs, 8192, m.k,
                              row_bytes)
    assert got == 100 + 3 * 8192 * m.k
    assert len(seen) == 2 and max(seen) * row_bytes <= moe.FIT_BYTES and seen[1] == 2 * seen[0]
    seen.clear()  # decode: within the limit, estimated as it is
    assert moe.row_copy_cycles(Recorder(cost), "v6e", permute_ops.moe_gather_reduce_fwd, args, kwargs, 64, m.k,
                               row_bytes) == 100 + 3 * 512
    assert seen == [512]
    seen.clear()
    args, kwargs, row_bytes = parts[permute_ops.moe_gather_fwd]
    assert moe.row_copy_cycles(Recorder(cost), "v6e", permute_ops.moe_gather_fwd, args, kwargs, 8192, m.k,
                               row_bytes) == 100 + 3 * 8192 * m.k
    assert seen == [8192 * m.k]
    # the combine as fused_moe_jax picks it per chip: the scatter-add (no row copies) where its accumulator fits
    v6e = {p[0]: p[1:] for p in moe.layer_kernels(m, 8192, "v6e")}
    assert moe.scatter_combine(m, 8192, "v6e") and not moe.scatter_combine(m, 8192, "tpu7x")
    assert permute_ops.moe_gather_reduce_fwd not in v6e and v6e[permute_ops.moe_scatter_add_fwd][2] == 0
    assert permute_ops.moe_gather_reduce_fwd in {p[0] for p in moe.layer_kernels(m, 8192, "tpu7x")}


def test_reasons_name_the_profiler_faults_and_the_losing_case():
    """Our rows say why: v5e (libtpu aborts on both layers' XLA programs), tpu7x Qwen3 (our down matmul aborts the
    profiler), the v6e Qwen3 prefill breakdown against megablox (the resident permute gather, the scatter-add
    combine), elsewhere the share of the roofline against tpu-inference's floor; peers' rows have none here."""
    row = {"kind": "ours", "chip": "v5e", "op": moe.MODELS[1].label, "shape": "decode T=64"}
    assert "v5e" in moe.reason(row) and "floors" in moe.reason(row)
    v5e_estimate = moe.reason(dict(row, figure="estimate", pct_roofline=57.0))
    assert v5e_estimate.startswith("v5e: 57% of the layer's roofline") and "not a comparison" in v5e_estimate
    assert "fifo_tracker" in moe.reason(dict(row, chip="tpu7x", op=moe.MODELS[0].label))
    dsv3 = dict(row, chip="tpu7x", op=moe.MODELS[2].label, figure="floor")
    assert moe.MODELS[2].name == "DeepSeek-V3" and "gate/up grouped matmul at the config bf16 out gets" in moe.reason(dsv3)
    assert moe.reason(dict(dsv3, figure="estimate", pct_roofline=50.0)).startswith("50% of the layer's roofline")
    v6e_prefill = moe.reason(dict(row, chip="v6e", op=moe.MODELS[0].label, shape="prefill T=8192"))
    assert "permute gather" in v6e_prefill and "scatter-add" in v6e_prefill
    estimated = dict(row, chip="v6e", figure="estimate", pct_roofline=87.4)
    assert moe.reason(estimated).startswith("87% of the layer's roofline") and "a bound" in moe.reason(estimated)
    assert moe.reason(dict(row, chip="v6e", figure="floor")) is None
    assert moe.reason(dict(row, kind="public")) is None
