"""tpukernels.library.moe_routing: router top-k (softmax / softmax over the selected / sigmoid / DeepSeek-V3
grouped), the general top-k, and moe_permute / moe_combine.

Ground truth: float64 references computed from the low-precision inputs (the top-k by a stable descending sort,
the permutation by a Python bucket pass, the combine by a scatter), themselves checked against
``jax.lax.top_k`` (torch.topk on cpu does not promise a tie order) and against transformers 5.24's own router
modules (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3), instantiated alone from tiny configs. Kernels run in Pallas
interpret mode; the NaN-poisoned "tpu" mode through the ``interpret`` fixture.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError, DTypeError
from tpukernels.library import moe_routing as MR
from tpukernels.library.moe_routing import permute_ops as P
from tpukernels.library.moe_routing import router_ops as R
from tpukernels.library.moe_routing import topk_ops as TK

BF16, F32 = torch.bfloat16, torch.float32
U = {BF16: 2.0**-8, F32: 2.0**-24}  # one rounding to the output dtype


def rand(*shape, dtype=F32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def check_weights(w, ref, what=""):
    """float32 weights against float64: a few float32 roundings of exp / sigmoid / sums of E terms."""
    assert w.dtype == F32 and w.shape == ref.shape, (what, w.dtype, w.shape, ref.shape)
    err = (w.double() - ref).abs()
    bound = 64 * 2.0**-24 * (ref.abs() + 1e-3)
    assert bool((err <= bound).all()), f"{what}: worst {float(err.max()):.3g}"


# ----------------------------------------------------------------------------------------- references
def test_topk_reference_matches_jax_top_k_with_ties_and_nan():
    jax = pytest.importorskip("jax")
    x = torch.tensor([[1.0, 3.0, 3.0, -1.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                      [0.5, float("nan"), 7.0, float("-inf"), 7.0, float("nan")]])
    v, i = TK.topk_reference(x, 4)
    assert i.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3], [1, 5, 2, 4]]
    jv, ji = jax.lax.top_k(np.asarray(x[:2]), 4)  # jax's NaN order differs from torch's: rows without NaN
    assert i[:2].tolist() == np.asarray(ji).tolist()
    # torch.topk agrees on the values (its cpu tie order is not specified)
    tv, _ = torch.topk(x.double(), 4)
    assert torch.equal(v.nan_to_num(9.0), tv.nan_to_num(9.0))


def _hf_router(cls_path, **cfg):
    import importlib

    mod, cls = cls_path.rsplit(".", 1)
    config_cls = {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig", "gpt_oss": "GptOssConfig",
                  "deepseek_v3": "DeepseekV3Config"}[mod.split(".")[-2]]
    import transformers

    config = getattr(transformers, config_cls)(hidden_size=16, **cfg)
    torch.manual_seed(0)
    router = getattr(importlib.import_module(mod), cls)(config)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn_like(p))
        for b in router.buffers():
            b.copy_(torch.randn_like(b) * 0.3)
    return router.float()


@pytest.mark.parametrize("norm", [True, False])
def test_matches_transformers_mixtral_and_qwen3_moe_routers(norm):
    pytest.importorskip("transformers")
    x = rand(24, 16, seed=1)
    routers = [("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
                dict(num_experts=12, num_experts_per_tok=3, norm_topk_prob=norm))]
    if norm:  # Mixtral always renormalises
        routers.append(("transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter",
                        dict(num_local_experts=8, num_experts_per_tok=2)))
    for path, cfg in routers:
        router = _hf_router(path, **cfg)
        with torch.no_grad():
            logits, scores, ids = router(x)
        w, i = MR.softmax_topk(logits, router.top_k, renormalize=norm, num_experts=router.num_experts)
        assert torch.equal(i, ids), path
        torch.testing.assert_close(w, scores.float(), rtol=2e-6, atol=1e-7)
        rw, ri = R.router_topk_reference(logits, router.top_k, "softmax", renormalize=norm)
        assert torch.equal(ri, ids)
        check_weights(w, rw, path)


def test_matches_transformers_gpt_oss_router():
    pytest.importorskip("transformers")
    router = _hf_router("transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter", num_local_experts=16,
                        num_experts_per_tok=4)
    x = rand(19, 16, seed=2)
    with torch.no_grad():
        logits, scores, ids = router(x)
    w, i = MR.softmax_topk(logits, 4, softmax_over="selected", num_experts=16)
    assert torch.equal(i, ids)
    torch.testing.assert_close(w, scores, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("norm", [True, False])
def test_matches_transformers_deepseek_v3_router(norm):
    pytest.importorskip("transformers")
    router = _hf_router("transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
                        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=norm)
    x = rand(24, 16, seed=3)
    with torch.no_grad():
        logits, scores, ids = router(x)
    w, i = MR.grouped_topk(logits, 4, n_group=4, topk_group=2,
                           e_score_correction_bias=router.e_score_correction_bias, routed_scaling_factor=2.5,
                           norm_topk_prob=norm, num_experts=16)
    # transformers' topk(sorted=False): the same set in an unspecified order; compare sorted by expert id
    hs, ho = ids.sort(-1)
    os_, oo = i.sort(-1)
    assert torch.equal(os_, hs)
    torch.testing.assert_close(w.gather(1, oo), scores.gather(1, ho), rtol=2e-6, atol=1e-7)
    # ours is sorted by the biased score (what was selected on), descending
    chosen = (torch.sigmoid(logits) + router.e_score_correction_bias).gather(1, i)
    assert bool((chosen[:, :-1] >= chosen[:, 1:]).all())
    # the bias selects but does not weigh: weights are the unbiased sigmoid scores
    raw = torch.sigmoid(logits.double()).gather(1, i)
    want = raw / (raw.sum(-1, keepdim=True) + 1e-20) if norm else raw
    check_weights(w, want * 2.5, "deepseek weights")


# ----------------------------------------------------------------------------------------- router kernels
MODES_CASES = [("softmax", True), ("softmax", False), ("softmax_selected", False), ("sigmoid", True),
               ("sigmoid", False)]


def _ours(logits, k, mode, renorm, **grouped):
    if mode == "grouped":
        return MR.grouped_topk(logits, k, norm_topk_prob=renorm, **grouped)
    if mode == "sigmoid":
        return MR.sigmoid_topk(logits, k, renormalize=renorm)
    return MR.softmax_topk(logits, k, renormalize=renorm,
                           softmax_over="all" if mode == "softmax" else "selected")


@settings(max_examples=5)
@given(t=st.sampled_from([1, 5, 37]), e=st.sampled_from([2, 20, 130]), kf=st.floats(0, 1),
       dtype=st.sampled_from([F32, BF16]), case=st.sampled_from(MODES_CASES), seed=st.integers(0, 99))
def test_router_matches_float64(t, e, kf, dtype, case, seed):
    mode, renorm = case
    k = 1 + int(kf * (min(e, 8) - 1))
    logits = rand(t, e, dtype=dtype, seed=seed, scale=2.0)
    w, i = _ours(logits, k, mode, renorm)
    rw, ri = R.router_topk_reference(logits, k, mode, renormalize=renorm)
    assert i.dtype == torch.int64 and torch.equal(i, ri), (mode, renorm)
    check_weights(w, rw, mode)


@settings(max_examples=4)
@given(t=st.sampled_from([1, 40]), n_group=st.sampled_from([1, 2, 8]), gs=st.sampled_from([2, 3, 32]),
       dtype=st.sampled_from([F32, BF16]), norm=st.booleans(), has_bias=st.booleans(), seed=st.integers(0, 99))
def test_grouped_topk_matches_float64(t, n_group, gs, dtype, norm, has_bias, seed):
    e = n_group * gs
    topk_group = max(1, n_group // 2)
    k = min(8, topk_group * gs)
    logits = rand(t, e, dtype=dtype, seed=seed, scale=2.0)
    # a bias on a coarse grid: selection scores stay apart by much more than float32 rounding
    bias = torch.round(rand(e, seed=seed + 1) * 16) / 64 if has_bias else None
    w, i = MR.grouped_topk(logits, k, n_group=n_group, topk_group=topk_group, e_score_correction_bias=bias,
                           routed_scaling_factor=1.5, norm_topk_prob=norm)
    rw, ri = R.router_topk_reference(logits, k, "grouped", renormalize=norm, n_group=n_group, topk_group=topk_group,
                                     e_score_correction_bias=bias, routed_scaling_factor=1.5)
    assert torch.equal(i, ri)
    check_weights(w, rw, "grouped")
    for row in (i // gs).tolist():
        assert len(set(row)) <= topk_group


def test_router_ties_take_the_lowest_expert_id():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 2.0], [0.5] * 6, [3.0, -1.0, 3.0, -1.0, -1.0, 3.0]])
    for mode, renorm in MODES_CASES:
        w, i = _ours(logits, 3, mode, renorm)
        assert i.tolist() == [[1, 2, 3], [0, 1, 2], [0, 2, 5]], mode
        rw, _ = R.router_topk_reference(logits, 3, mode, renormalize=renorm)
        check_weights(w, rw, mode)
    # grouped: tied groups (both groups score 2 + 2) -> the lower group; tied experts -> the lower ids
    g = torch.tensor([[2.0, 2.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0]])
    _, i = MR.grouped_topk(torch.logit(torch.sigmoid(g)), 2, n_group=2, topk_group=1)
    assert i.tolist() == [[0, 1]]


def test_router_nan_row_stays_in_its_row():
    logits = rand(3, 6, seed=4)  # the ties test's shape and k: the same compiled kernels
    bad = logits.clone()
    bad[1, 4] = float("nan")
    for mode, renorm in MODES_CASES:
        w0, i0 = _ours(logits, 3, mode, renorm)
        w1, i1 = _ours(bad, 3, mode, renorm)
        keep = torch.arange(3) != 1
        assert torch.equal(i1[keep], i0[keep]) and torch.equal(w1[keep], w0[keep]), mode
        assert i1[1, 0] == 4 and bool(((i1 >= 0) & (i1 < 6)).all())  # NaN ranks first, as torch.topk


def test_router_and_topk_tails_in_poisoned_memory(interpret):
    """Overhanging tails: 8-row router blocks over 21 tokens; top-k over 300 columns in 128-column tiles (the
    last tile's 84 columns past the array are NaN in the "tpu" interpreter and must never be selected)."""
    logits = rand(21, 40, seed=5)
    bias = torch.round(rand(40, seed=6) * 16) / 64
    w, i = R.router_topk_fwd(logits, bias[None], 5, "grouped", True, 4, 2, 1.0, config={"block_rows": 8})
    rw, ri = R.router_topk_reference(logits, 5, "grouped", renormalize=True, n_group=4, topk_group=2,
                                     e_score_correction_bias=bias)
    assert torch.equal(i[:, :5].long(), ri)
    check_weights(w[:, :5], rw, "grouped")
    x = rand(9, 300, seed=25)
    x[2, 200] = x[2, 5] = float("nan")  # NaNs in the first and a later tile: both first, by index
    x[3] = float("-inf")
    x[3, 280] = 0.0
    x[4, 10] = x[4, 130] = x[4, 290] = 9.0  # a three-way tie across tiles
    v, i = TK.topk_fwd(x, 6, config={"block_rows": 8, "block_cols": 128})
    rv, ri = TK.topk_reference(x, 6)
    assert torch.equal(i[:, :6].long(), ri) and torch.equal(v[:, :6].double().nan_to_num(7.0), rv.nan_to_num(7.0))
    assert i[2, :2].tolist() == [5, 200] and i[3, :3].tolist() == [280, 0, 1] and i[4, :3].tolist() == [10, 130, 290]
    v, i = TK.topk_fwd(x, 150, config={"block_rows": 8, "block_cols": 128})  # k > a tile: the first fills partly
    rv, ri = TK.topk_reference(x, 150)
    assert torch.equal(i[:, :150].long(), ri) and torch.equal(v[:, :150].double().nan_to_num(7.0), rv.nan_to_num(7.0))


def test_router_jax_entries_match_torch():
    jnp = pytest.importorskip("jax.numpy")
    logits = rand(12, 32, seed=7)
    bias = torch.round(rand(32, seed=8) * 16) / 64
    for (w, i), (jw, ji) in [
        (MR.softmax_topk(logits, 3, renormalize=True), MR.softmax_topk_jax(jnp.asarray(logits.numpy()), 3,
                                                                            renormalize=True)),
        (MR.sigmoid_topk(logits, 2), MR.sigmoid_topk_jax(jnp.asarray(logits.numpy()), 2)),
        (MR.grouped_topk(logits, 4, n_group=4, topk_group=2, e_score_correction_bias=bias),
         MR.grouped_topk_jax(jnp.asarray(logits.numpy()), 4, n_group=4, topk_group=2,
                             e_score_correction_bias=jnp.asarray(bias.numpy()))),
    ]:
        assert np.asarray(ji).dtype == np.int32 and np.array_equal(np.asarray(ji), i.numpy())
        np.testing.assert_array_equal(np.asarray(jw), w.numpy())


# ----------------------------------------------------------------------------------------- general top-k
@settings(max_examples=4)
@given(r=st.sampled_from([1, 9]), c=st.sampled_from([5, 300, 1000]), kf=st.floats(0, 1),
       dtype=st.sampled_from([F32, BF16]), seed=st.integers(0, 99))
def test_topk_matches_reference_tiled(r, c, kf, dtype, seed):
    """Tiles of 128 columns (the carried list merges across tiles) and 16-row blocks."""
    k = 1 + int(kf * (min(c, 40) - 1))
    x = rand(r, c, dtype=dtype, seed=seed)
    if seed % 3 == 0:
        x = torch.round(x.float() * 2).to(dtype)  # many ties, across tiles too
    v, i = TK.topk_fwd(x, k, config={"block_rows": 16, "block_cols": 128})
    rv, ri = TK.topk_reference(x, k)
    assert torch.equal(i[:, :k].long(), ri)
    assert torch.equal(v[:, :k].double(), rv)


def test_topk_public_dims_dtypes_and_ties():
    x = torch.round(rand(3, 7, 260, seed=9) * 2).half()
    v, i = MR.topk(x, 6, dim=-1)
    rv, ri = TK.topk_reference(x.float(), 6)
    assert v.dtype == torch.float16 and i.dtype == torch.int64 and torch.equal(i, ri) and torch.equal(v.double(), rv)
    v1, i1 = MR.topk(x, 2, dim=1)  # another dim: moved last and back
    rv1, ri1 = TK.topk_reference(x.float().movedim(1, -1), 2)
    assert v1.shape == (3, 2, 260) and torch.equal(i1, ri1.movedim(-1, 1))
    y = rand(4, 300, seed=10)
    y[1, 17] = float("nan")
    y[2] = float("-inf")
    v, i = MR.topk(y, 3, sorted=False)
    assert i[1, 0] == 17 and i[2].tolist() == [0, 1, 2] and torch.isneginf(v[2]).all()
    assert torch.equal(i[[0, 3]], TK.topk_reference(y[[0, 3]], 3)[1])


def test_topk_vocab_sized_rows():
    """Qwen3's vocabulary (151,936 columns): 19 tiles of 8192 (the last one overhanging)."""
    x = rand(2, 151936, seed=11)
    x[1, 151935] = 100.0  # the winner in the overhanging last tile
    x[0, 3] = x[0, 151930] = 50.0  # a tie across the first and the last tile
    v, i = TK.topk_fwd(x, 8, config={"block_rows": 8, "block_cols": 8192})
    rv, ri = TK.topk_reference(x, 8)
    assert torch.equal(i[:, :8].long(), ri) and torch.equal(v[:, :8].double(), rv)
    assert i[0, :2].tolist() == [3, 151930] and i[1, 0] == 151935


@pytest.mark.slow
def test_topk_vocab_sized_sampling_k50():
    x = rand(8, 151936, dtype=BF16, seed=12)
    v, i = MR.topk(x, 50)
    rv, ri = TK.topk_reference(x, 50)
    assert torch.equal(i, ri) and torch.equal(v.double(), rv)


def test_topk_jax_matches_lax_top_k():
    jax = pytest.importorskip("jax")
    x = np.asarray(torch.round(rand(5, 200, seed=13) * 2).numpy())
    v, i = MR.topk_jax(jax.numpy.asarray(x), 7)
    jv, ji = jax.lax.top_k(x, 7)
    assert np.array_equal(np.asarray(i), np.asarray(ji)) and np.array_equal(np.asarray(v), np.asarray(jv))


# ----------------------------------------------------------------------------------------- permute / combine
def _routing(t, e, k, seed, dup=False):
    g = torch.Generator().manual_seed(seed)
    if dup:  # any expert, repeats allowed within a token
        return torch.randint(0, e, (t, k), generator=g)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()


def _combine_bound(y_sorted, w, order, dtype):
    mass = P.moe_combine_reference(y_sorted.abs(), w.abs(), order)
    return mass


@settings(max_examples=6)
@given(t=st.sampled_from([1, 7, 40]), d=st.sampled_from([8, 96, 1024, 2048]), e=st.sampled_from([1, 3, 8]),
       k=st.sampled_from([1, 2, 4]), dtype=st.sampled_from([F32, BF16]), dup=st.booleans(), seed=st.integers(0, 99))
def test_permute_combine_match_float64(t, d, e, k, dtype, dup, seed):
    k = min(k, e) if not dup else k
    x = rand(t, d, dtype=dtype, seed=seed)
    ids = _routing(t, e, k, seed, dup)
    xs, sizes, meta = MR.moe_permute(x, ids.int() if seed % 2 else ids, e)
    rx, rs, ro = P.moe_permute_reference(x, ids, e)
    assert xs.dtype == dtype and torch.equal(xs.double(), rx)  # copies: exact
    assert sizes.dtype == torch.int32 and torch.equal(sizes.long(), rs)
    assert torch.equal(meta.order.long(), ro) and torch.equal(meta.order.long(), torch.argsort(ids.flatten(),
                                                                                               stable=True))
    assert torch.equal(meta.positions.flatten()[meta.order.long()].long(), torch.arange(t * k))
    y = rand(t * k, d, dtype=dtype, seed=seed + 1)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(seed))
    out = MR.moe_combine(y, w, meta)
    ref = P.moe_combine_reference(y, w, meta.order)
    mass = _combine_bound(y, w, meta.order, dtype)
    err = (out.double() - ref).abs()
    assert out.dtype == dtype and bool((err <= U[dtype] * ref.abs() + 8 * 2.0**-24 * mass + 1e-30).all())


def test_permute_then_combine_round_trip_and_backward_vs_float64(interpret):
    """x -> permute -> (an elementwise 'expert') -> combine with weights: out and the gradients of x and
    the weights against float64 autograd through the references (a gradcheck at the kernels' precision)."""
    t, d, e, k = 21, 256, 6, 3
    x = rand(t, d, seed=14).requires_grad_()
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(1)).requires_grad_()
    ids = _routing(t, e, k, 15)
    xs, _, meta = MR.moe_permute(x, ids, e)
    scale = torch.arange(t * k, dtype=F32)[:, None] / (t * k) + 0.5  # a per-row 'expert'
    out = MR.moe_combine(xs * scale, w, meta)
    # round trip: weights summing to one and the identity expert give x back
    ws = torch.full((t, k), 1.0 / k)
    back = MR.moe_combine(xs.detach(), ws, meta)
    torch.testing.assert_close(back, x.detach(), rtol=4e-7, atol=1e-7)
    g = rand(t, d, seed=16)
    (out * g).sum().backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    _, _, order = P.moe_permute_reference(x.detach(), ids, e)
    outd = P.moe_combine_reference(xd[torch.div(order, k, rounding_mode="floor")] * scale.double(), wd, order)
    (outd * g.double()).sum().backward()
    for got, want in ((out.detach(), outd.detach()), (x.grad, xd.grad), (w.grad, wd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_permute_combine_backward_bf16():
    t, d, e, k = 9, 128, 4, 2
    x = rand(t, d, dtype=BF16, seed=17).requires_grad_()
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(2)).to(BF16).requires_grad_()
    ids = _routing(t, e, k, 18, dup=True)
    xs, _, meta = MR.moe_permute(x, ids, e)
    MR.moe_combine(xs, w, meta).float().square().sum().backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    order = meta.order.long()
    P.moe_combine_reference(xd[torch.div(order, k, rounding_mode="floor")], wd, order).square().sum().backward()
    assert x.grad.dtype == BF16 and w.grad.dtype == BF16
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=4e-2, atol=4e-2 * float(wd.grad.abs().max()))


@pytest.mark.parametrize("source", P.SOURCES)
def test_permute_combine_blocks_and_tails(interpret, source):
    """Several grid steps with overhanging tails: 128-row gather blocks over 150 rows, 64-token combine blocks
    (k = 2: 128 SMEM entries) over 75 tokens; the source rows resident in VMEM or copied from HBM."""
    t, d, e, k = 75, 256, 5, 2
    x = rand(t, d, seed=19)
    ids = _routing(t, e, k, 20)
    rx, _, order = P.moe_permute_reference(x, ids, e)
    src = torch.div(order, k, rounding_mode="floor").int()
    xs = P.moe_gather_fwd(x.reshape(t, 1, d), src, config={"block_rows": 128, "source": source}).reshape(t * k, d)
    assert torch.equal(xs.double(), rx)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(t * k)
    w = torch.rand(t * k, generator=torch.Generator().manual_seed(3))
    out = P.moe_gather_reduce_fwd(xs.reshape(t * k, 1, d), pos.int(), w, 2,
                                  config={"block_tokens": 64, "source": source})
    ref = P.moe_combine_reference(xs, w.reshape(t, k), order)
    torch.testing.assert_close(out.reshape(t, d).double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m,t,d,dtype,bm", [(300, 70, 256, F32, 128), (64, 300, 2048, BF16, 128),
                                            (1, 1, 128, F32, 1024), (700, 520, 128, BF16, 256)])
def test_scatter_add_matches_float64(interpret, m, t, d, dtype, bm):
    """out[t] = sum of w[p] * y[p] over the rows p of token t (float64 index_add): partial last y blocks, more
    tokens than rows, tokens no row adds to (zero) and rows whose token is out of range (they add nothing,
    anywhere)."""
    g = torch.Generator().manual_seed(m + t)
    s = P.row_view(d, torch.empty(0, dtype=dtype).element_size())
    y = rand(m, d, dtype=dtype, seed=m)
    tok = torch.randint(-2, t + 2, (m,), generator=g).int()
    w = torch.rand(m, generator=g)
    out = P.moe_scatter_add_fwd(y.reshape(m, s, d // s), tok, w, t, config={"block_rows": bm}).reshape(t, d)
    ok = (tok >= 0) & (tok < t)
    ref = torch.zeros(t, d, dtype=torch.float64).index_add_(0, tok[ok].long(), y[ok].double() * w[ok, None].double())
    mass = torch.zeros(t, d, dtype=torch.float64).index_add_(0, tok[ok].long(), (y[ok].double() * w[ok, None]).abs())
    n = int(torch.bincount(tok[ok].long(), minlength=t).max()) if ok.any() else 0
    assert out.dtype == dtype
    assert bool(((out.double() - ref).abs() <= U[dtype] * ref.abs() + n * 2.0**-24 * mass + 1e-30).all())
    untouched = torch.bincount(tok[ok].long(), minlength=t) == 0
    assert bool((out[untouched] == 0).all())


def test_combine_takes_the_scatter_add_where_it_fits_and_both_agree(monkeypatch):
    """moe_combine (and the permute's backward) sums each token's rows with moe_scatter_add_fwd where its float32
    accumulator fits the chip's VMEM cap (v6e: Qwen3-30B-A3B's 8,192 prefill tokens; tpu7x: not), else with
    moe_gather_reduce_fwd: both give the float64 reference's result within one rounding."""
    from tpukernels.chips import get_chip

    assert P.scatter_add_fits(8192, 2048, 2, get_chip("v6e")) and not P.scatter_add_fits(8192, 2048, 2, "tpu7x")
    assert P.scatter_add_fits(3754, 2048, 2, "tpu7x") and not P.scatter_add_fits(3755, 2048, 2, "tpu7x")
    assert not P.scatter_add_fits(64, 2880, 2, "v6e")  # gpt-oss's [16, 180] rows: partial lane columns
    t, d, e, k = 40, 256, 6, 3
    x = rand(t, d, seed=30).requires_grad_()
    ids = _routing(t, e, k, 31)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(6))
    calls = []
    for fits in (True, False):
        monkeypatch.setattr(P, "scatter_add_fits", lambda *a, fits=fits, **kw: calls.append(fits) or fits)
        xs, _, meta = MR.moe_permute(x, ids, e)
        out = MR.moe_combine(xs * 2.0, w, meta)
        (gx,) = torch.autograd.grad(out.sum(), x)
        ref = P.moe_combine_reference(xs.detach().double() * 2.0, w.double(), meta.order.long())
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gx.double(), 2.0 * w.sum(1, keepdim=True).double().expand(t, d), rtol=1e-6,
                                   atol=1e-6)
    assert True in calls and False in calls


def test_sort_metadata_helpers():
    """moe_permute_jax's positions are the inverse permutation by a sort (no scatter), its group sizes a count
    of the ids in [0, E) (others are not counted, as a dropping scatter-add would)."""
    import jax.numpy as jnp

    perm = np.random.default_rng(7).permutation(1000).astype(np.int32)
    inv = np.asarray(P.inverse_permutation(jnp.asarray(perm)))
    assert inv.dtype == np.int32 and np.array_equal(inv[perm], np.arange(1000))
    got = np.asarray(P.count_ids(jnp.asarray([0, 3, 5, -1, 3], jnp.int32), 4))
    assert got.dtype == np.int32 and got.tolist() == [1, 0, 0, 2]


def test_scatter_add_rejects_bad_arguments():
    y, tok, w = rand(4, 1, 128), torch.zeros(4, dtype=torch.int32), torch.zeros(4)
    with pytest.raises(ArgumentError, match="num_tokens"):
        P.moe_scatter_add_fwd(y, tok, w, 0)
    with pytest.raises(ArgumentError, match="w must be float32"):
        P.moe_scatter_add_fwd(y, tok, w[:3], 2)
    with pytest.raises(ArgumentError, match="128-lane"):
        P.moe_scatter_add_fwd(rand(4, 1, 96), tok, w, 2)


def test_permute_ops_pass_opcheck():
    x, ids = rand(6, 128, seed=21), _routing(6, 4, 2, 22)
    torch.library.opcheck(torch.ops.tpukernels.moe_permute.default, (x, ids, 4),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    xs, _, meta = MR.moe_permute(x, ids, 4)
    torch.library.opcheck(torch.ops.tpukernels.moe_combine.default,
                          (xs, torch.rand(6, 2, requires_grad=True), meta.order, meta.positions),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_permute_combine_jax_entries_match_torch_and_differentiate():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    t, d, e, k = 10, 256, 4, 2
    x, ids = rand(t, d, seed=23), _routing(t, e, k, 24)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(4))
    xs, sizes, meta = MR.moe_permute(x, ids, e)
    out = MR.moe_combine(xs, w, meta)
    jx, jids, jw = jnp.asarray(x.numpy()), jnp.asarray(ids.numpy()), jnp.asarray(w.numpy())
    jxs, jsizes, jmeta = MR.moe_permute_jax(jx, jids, e)
    assert np.array_equal(np.asarray(jxs), xs.numpy()) and np.array_equal(np.asarray(jsizes), sizes.numpy())
    np.testing.assert_allclose(np.asarray(MR.moe_combine_jax(jxs, jw, jmeta)), out.numpy(), rtol=1e-6, atol=1e-6)

    def loss(xv, wv):
        a, _, m = MR.moe_permute_jax(xv, jids, e)
        return jnp.sum(MR.moe_combine_jax(a * 2.0, wv, m) ** 2)

    gx, gw = jax.grad(loss, argnums=(0, 1))(jx, jw)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    a, _, m = MR.moe_permute(xt, ids, e)
    MR.moe_combine(a * 2.0, wt, m).square().sum().backward()
    np.testing.assert_allclose(np.asarray(gx), xt.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), wt.grad.numpy(), rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------- errors
def test_bad_input_raises_typed_errors_before_any_kernel():
    l8 = rand(4, 8)
    x, ids = rand(4, 128), _routing(4, 8, 2, 0)
    xs, _, meta = MR.moe_permute(x, ids, 8)
    cases = [
        (lambda: MR.softmax_topk(l8, 2, num_experts=16), ArgumentError, r"8 columns but num_experts = 16"),
        (lambda: MR.sigmoid_topk(l8, 9), ArgumentError, r"top_k = 9 must be in \[1, num_experts = 8\]"),
        (lambda: MR.softmax_topk(l8, 0), ArgumentError, "top_k = 0"),
        (lambda: MR.softmax_topk(l8, 2, softmax_over="some"), ArgumentError, "softmax_over must be"),
        (lambda: MR.softmax_topk(l8.long(), 2), DTypeError, "not supported"),
        (lambda: MR.softmax_topk(l8[0], 2), ArgumentError, "router_logits must be a 2-D tensor"),
        (lambda: MR.grouped_topk(l8, 2, n_group=2, topk_group=3), ArgumentError, "topk_group = 3 must be <= n_group"),
        (lambda: MR.grouped_topk(l8, 2, n_group=3, topk_group=1), ArgumentError, "n_group = 3 must divide"),
        (lambda: MR.grouped_topk(l8, 2, n_group=8, topk_group=1), ArgumentError, "at least 2 experts"),
        (lambda: MR.grouped_topk(l8, 5, n_group=2, topk_group=1), ArgumentError, r"top_k = 5 must be in \[1, "),
        (lambda: MR.grouped_topk(l8, 2, n_group=2, topk_group=1, e_score_correction_bias=torch.zeros(7)),
         ArgumentError, r"e_score_correction_bias must be a tensor \[num_experts\] = \[8\]"),
        (lambda: MR.grouped_topk(l8, 2, n_group=2, topk_group=1, num_experts=4), ArgumentError, "num_experts = 4"),
        (lambda: MR.topk(l8, 9), ArgumentError, r"k = 9 must be in \[1, input.shape\[-1\] = 8\]"),
        (lambda: MR.topk(l8, 2, largest=False), ArgumentError, "largest=False"),
        (lambda: MR.moe_permute(x, ids + 7, 8), ArgumentError, r"expert_ids must be in \[0, num_experts = 8\)"),
        (lambda: MR.moe_permute(x, ids - 1, 8), ArgumentError, r"got values in \[-1,"),
        (lambda: MR.moe_permute(x, ids[:3], 8), ArgumentError, r"expert_ids must be \[T, k\]"),
        (lambda: MR.moe_permute(x, ids.float(), 8), DTypeError, "int32 or int64"),
        (lambda: MR.moe_combine(xs, torch.rand(4, 2), meta._replace(group_sizes=meta.group_sizes * 2)),
         ArgumentError, r"group_sizes must be non-negative and sum to T\*k = 8, got sum 16"),
        (lambda: MR.moe_combine(xs[:7], torch.rand(4, 2), meta), ArgumentError, "y_sorted must have T\\*k = 8 rows"),
        (lambda: MR.moe_combine(xs, torch.rand(4, 3), meta), ArgumentError, r"weights must be \[T, k\] = \[4, 2\]"),
        (lambda: MR.moe_combine(xs, torch.rand(4, 2), meta._replace(positions=meta.positions + 8)), ArgumentError,
         "positions must be in"),
    ]
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()


def test_ids_out_of_range_raise_under_torch_compile():
    """Compiled (fullgraph), the ids' values are unknown while tracing: the graph asserts their range, so an id
    >= num_experts raises when it runs (it used to be counted into the last group: a silent wrong routing)."""
    x = torch.randn(4, 128)
    ok = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])

    def f(x, ids):
        xs, sizes, _ = MR.moe_permute(x, ids, 4)
        return xs, sizes

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    xs, sizes = cf(x, ok)
    assert sizes.tolist() == [2, 2, 2, 2]
    torch.testing.assert_close(xs, f(x, ok)[0])
    for bad in (ok.clone().index_put_((torch.tensor(3), torch.tensor(1)), torch.tensor(5)), ok - 1):
        with pytest.raises(RuntimeError, match=r"expert_ids must be in \[0, num_experts = 4\)"):
            cf(x, bad)


def test_kernel_ops_reject_inconsistent_internal_args():
    with pytest.raises(ArgumentError, match="bias is only for mode 'grouped'"):
        R.router_topk_fwd(rand(4, 8), rand(1, 8), 2, "softmax", False)
    with pytest.raises(ArgumentError, match="mode must be one of"):
        R.router_topk_fwd(rand(4, 8), None, 2, "relu", False)
    with pytest.raises(ArgumentError, match="w must be float32"):
        P.moe_gather_reduce_fwd(rand(4, 1, 128), torch.zeros(4, dtype=torch.int32), torch.zeros(3), 2)


def test_sharding_rules():
    from tpukernels.distributed.sharding import Split, TensorMeta, splits_for

    m = lambda *s, dt=torch.float32: TensorMeta(s, dt)  # noqa: E731
    assert splits_for(R.router_topk_fwd, {"logits": m(64, 8), "bias": None, "k": 2, "mode": "softmax",
                                          "renormalize": True}) == [Split({"logits": 0}, (0, 0))]
    assert splits_for(TK.topk_fwd, {"x": m(8, 1000), "k": 4}) == [Split({"x": 0}, (0, 0))]
    assert splits_for(P.moe_gather_fwd, {"x": m(8, 1, 128), "idx": m(16, dt=torch.int32)}) == [
        Split({"idx": 0}, (0,))]
    assert splits_for(P.moe_gather_reduce_fwd, {"y": m(16, 1, 128), "pos": m(16, dt=torch.int32),
                                                "w": m(16), "top_k": 2}) == []
    assert splits_for(P.moe_scatter_add_fwd, {"y": m(16, 1, 128), "tok": m(16, dt=torch.int32), "w": m(16),
                                              "num_tokens": 8}) == []


# ----------------------------------------------------------------------------------------- compile-only
def _standard():
    return ([(TK.topk_fwd, a, kw) for a, kw in TK.STANDARD_SHAPES]
            + [(R.router_topk_fwd, a, kw) for a, kw in R.STANDARD_SHAPES] + list(P.STANDARD_SHAPES))


#: make test compiles the largest case of each kernel (one chip each); make test-slow all of them on every chip
MAKE_TEST_CASES = (0, 5, 8, 9, 10)


@pytest.mark.aot
@pytest.mark.parametrize("case", [c if c in MAKE_TEST_CASES else pytest.param(c, marks=pytest.mark.slow)
                                  for c in range(11)])
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only(chip, case, tmp_cache):
    from tpukernels.targets.compile_only import compile_for

    kernel, args, kw = _standard()[case]
    r = compile_for(kernel, chip, *args, with_mlir=False, **kw)
    assert r.ok, r.summary()


# ----------------------------------------------------------------------------------------- HF routers swapped
def test_apply_tpukernels_routers_swaps_matching_routers_only():
    pytest.importorskip("transformers")
    import torch.nn.functional as F

    from tpukernels.integrations.moe_routers import apply_tpukernels_routers, router_reason

    routers = {
        "mixtral": _hf_router("transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter",
                              num_local_experts=8, num_experts_per_tok=2),
        "qwen": _hf_router("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=False),
        "gpt_oss": _hf_router("transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter", num_local_experts=8,
                              num_experts_per_tok=2),
        "deepseek": _hf_router("transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
                               n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                               routed_scaling_factor=2.5),
    }
    model = torch.nn.ModuleDict(routers)

    class Odd(torch.nn.Module):  # a router-shaped module no fused form computes (top-k of the raw logits)
        def __init__(self):
            super().__init__()
            self.weight, self.top_k, self.num_experts = torch.nn.Parameter(torch.randn(8, 16)), 2, 8

        def forward(self, h):
            logits = F.linear(h, self.weight)
            v, i = torch.topk(logits, 2)
            return logits, v, i

    model["odd"] = Odd()
    x = rand(24, 16, seed=30)  # the probe's token count: the probe's compiled kernels serve these calls
    with torch.no_grad():
        before = {n: m(x) for n, m in model.items()}
    done = apply_tpukernels_routers(model)
    # gpt-oss's softmax over the selected k equals a renormalised softmax over all experts (the same exp(l_j)
    # over the same sum), and its float32 weights keep their dtype: the first form tried matches
    assert done == [("mixtral", "softmax_renorm"), ("qwen", "softmax"), ("gpt_oss", "softmax_renorm"),
                    ("deepseek", "grouped")]
    assert router_reason(model["odd"])[0] is None and "no fused router form" in router_reason(model["odd"])[1]
    with torch.no_grad():
        for n, m in model.items():
            logits, w, i = m(x)
            bl, bw, bi = before[n]
            assert torch.equal(logits, bl) and w.dtype == bw.dtype, n
            if n == "deepseek":
                (i, oi), (bi, obi) = i.sort(-1), bi.sort(-1)
                w, bw = w.gather(1, oi), bw.gather(1, obi)
            assert torch.equal(i, bi), n
            torch.testing.assert_close(w, bw, rtol=1e-5, atol=1e-6)
    assert model["mixtral"].forward.__func__.__name__ == "router_forward"
    # a bfloat16 gpt-oss router returns bf16 weights (its softmax in the logits' dtype): the selected form
    bf = _hf_router("transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter", num_local_experts=8,
                    num_experts_per_tok=2).to(BF16)
    assert router_reason(bf) == ("softmax_selected", None)
    assert "forward" not in vars(model["odd"])


def test_patched_routers_train_like_stock():
    """The router kernels have no backward: a patched router recomputes its weights from the kernel's ids with
    differentiable ops while the logits need a gradient, so every form (softmax, renormalised, gpt-oss's softmax
    over the selected, DeepSeek's grouped) gives stock's weights and the router weight's gradient (it raised
    KernelDefinitionError)."""
    pytest.importorskip("transformers")
    import copy

    from tpukernels.integrations.moe_routers import apply_tpukernels_routers

    routers = torch.nn.ModuleDict({
        "qwen": _hf_router("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=False),
        "mixtral": _hf_router("transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter",
                              num_local_experts=8, num_experts_per_tok=2),
        "gpt_oss": _hf_router("transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter", num_local_experts=8,
                              num_experts_per_tok=2),
        "deepseek": _hf_router("transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
                               n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                               routed_scaling_factor=2.5)})
    stock = copy.deepcopy(routers)
    forms = dict(apply_tpukernels_routers(routers))
    assert set(forms) == set(routers)
    x = rand(24, 16, seed=31)
    dw = rand(24, 16, seed=32)  # a gradient on every expert slot's weight (16 >= k)
    for n in routers:
        _, w, i = routers[n](x)
        _, sw, si = stock[n](x)
        oi, soi = i.sort(-1).indices, si.sort(-1).indices
        assert torch.equal(i.gather(1, oi), si.gather(1, soi)), n
        w, sw = w.gather(1, oi), sw.gather(1, soi)
        torch.testing.assert_close(w, sw, rtol=1e-5, atol=1e-6)
        (w * dw[:, :w.shape[1]]).sum().backward()
        (sw * dw[:, :w.shape[1]]).sum().backward()
        g, sg = routers[n].weight.grad, stock[n].weight.grad
        assert sg.abs().max() > 0
        assert (g - sg).abs().max() <= 1e-5 * sg.abs().max(), (n, forms[n])


def test_row_copies_in_flight_are_capped():
    """The heuristics keep at most MAX_ROWS_IN_FLIGHT row copies per grid step (one wait covers them; libtpu's
    tpu7x profiler mis-costs 512) and at most ~8 MiB of rows (a resident source: the bytes only); fit_tokens
    applies the cap to any block_tokens."""
    import jax
    import jax.numpy as jnp

    S = jax.ShapeDtypeStruct
    cap = P.MAX_ROWS_IN_FLIGHT
    x = S((16384, 16, 128), jnp.bfloat16)  # 4 KiB rows: 1024 of them would fit the bytes; 64 MiB, not resident
    assert P.moe_gather_fwd.heuristic(x, S((65536,), jnp.int32)) == {"block_rows": cap, "source": "hbm"}
    x = S((8192, 16, 128), jnp.bfloat16)  # resident: no row copies, so the bytes alone bound the block
    assert P.moe_gather_fwd.heuristic(x, S((65536,), jnp.int32)) == {"block_rows": 1024, "source": "vmem"}
    y = S((65536, 8, 256), jnp.float32)  # 8 KiB rows, k = 8
    cfg = P.moe_gather_reduce_fwd.heuristic(y, S((65536,), jnp.int32), S((65536,), jnp.float32), 8)
    assert cfg["block_tokens"] * 8 <= cap
    assert P.fit_tokens(256, 8192, 8, 8192) * 8 == cap  # the index block stays a multiple of 128 entries
    assert P.fit_tokens(256, 8192, 1, 64) == cap
    assert P.fit_tokens(256, 8192, 3, 64) == 128  # k = 3: 128 tokens (384 rows) is the smallest whole index block
    assert P.fit_tokens(256, 40, 8, 8192) == 32  # 40 tokens x 8 rows would exceed the cap in one step


@pytest.mark.parametrize("source", P.SOURCES)
def test_gather_kernels_clamp_out_of_range_indices(source):
    """An index outside the source (a device tensor's ids are not checked on the host) reads the nearest row,
    never out of bounds, whether the rows are loaded from VMEM or copied by DMA."""
    x = rand(5, 256, seed=40)
    idx = torch.tensor([4, -3, 9, 0, 2, 7, -1, 1], dtype=torch.int32)
    want = x[idx.clamp(0, 4).long()]
    got = P.moe_gather_fwd(x.reshape(5, 1, 256), idx, config={"block_rows": 128, "source": source})
    assert torch.equal(got.reshape(8, 256), want)
    w = torch.rand(8, generator=torch.Generator().manual_seed(5))
    out = P.moe_gather_reduce_fwd(x.reshape(5, 1, 256), idx, w, 2, config={"block_tokens": 16, "source": source})
    ref = (want.double().reshape(4, 2, 256) * w.double().reshape(4, 2, 1)).sum(1)
    torch.testing.assert_close(out.reshape(4, 256).double(), ref, rtol=1e-6, atol=1e-6)


def test_resident_source_is_chosen_where_it_fits_and_pays(monkeypatch):
    """The heuristics keep the source rows in VMEM when the source, the blocks and the headroom fit the chip's
    cap (7/8 of its VMEM: 112 MiB v6e, 56 MiB tpu7x) and the source has at most RESIDENT_ROWS_PER_READ rows per
    row read; else the rows are copied from HBM. A forced resident source that does not fit is a VmemError
    naming the config."""
    import jax
    import jax.numpy as jnp
    from tpukernels.chips import get_chip
    from tpukernels.errors import VmemError
    from tpukernels.lowering import launching_for

    S = jax.ShapeDtypeStruct

    def sources(chip, rows, reads):
        x = S((rows, 16, 128), jnp.bfloat16)  # 4 KiB rows
        with launching_for(get_chip(chip)):
            g = P.moe_gather_fwd.heuristic(x, S((reads,), jnp.int32))["source"]
            r = P.moe_gather_reduce_fwd.heuristic(x, S((reads,), jnp.int32), S((reads,), jnp.float32), 8)["source"]
        return g, r

    assert sources("tpu7x", 8192, 65536) == ("vmem", "vmem")  # Qwen3-30B-A3B prefill's tokens: 32 MiB
    assert sources("tpu7x", 16384, 65536) == ("hbm", "hbm")  # 64 MiB: over tpu7x's 56 MiB cap
    assert sources("v6e", 16384, 65536) == ("vmem", "vmem")  # under v6e's 112 MiB
    assert sources("v6e", 8192, 1024) == ("hbm", "hbm")  # 8 source rows per row read: the DMAs are cheaper
    assert sources("v6e", 4096, 1024) == ("vmem", "vmem")
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "tpu7x")
    big = torch.empty(16384, 16, 128, dtype=torch.bfloat16)
    with pytest.raises(VmemError, match="source=vmem"):
        P.moe_gather_fwd(big, torch.zeros(65536, dtype=torch.int32), config={"block_rows": 256, "source": "vmem"})


def test_row_view_prefers_whole_lane_columns():
    """Rows move as [S, D/S] slabs: the dtype's sublane tile when D/S has >= 128 lanes, 8 rows for 16-bit data
    when only that gives whole 128-lane columns (DeepSeek-V3's D = 7168), 1 when nothing divides."""
    assert P.row_view(2048, 2) == 16 and P.row_view(2048, 4) == 8
    assert P.row_view(7168, 2) == 8 and P.row_view(7168, 4) == 8
    assert P.row_view(2880, 2) == 16  # gpt-oss: no whole-column view, the sublane tile with 180 lanes
    assert P.row_view(100, 2) == 1
