"""DeepSeek Sparse Attention's training / prefill path: ``topk_sparse_attention`` and the DSA models through
``apply_tpukernels`` (DeepSeek-V3.2, GLM-MoE-DSA), plus Kimi-K2.5 (a VLM whose text model is DeepSeek-V3).

Ground truth for the kernel: attention by definition in float64 from the same low-precision inputs, over the mask
transformers' eager DSA path builds (the index set scattered into a bool mask, ANDed with the attention mask),
written out here independently of the library's ``index_visibility``. Model tests compare with stock transformers
(eager) on tiny random configs (``tests/hf_tiny.py``): logits at non-padded positions, and greedy ``generate()``
with the model's own cache.
"""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError, DTypeError
from tpukernels.library.attention import topk_sparse as TS
from tpukernels.library.attention import topk_sparse_attention

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
#: relative to max |reference|: f32 reduction order; bf16 inputs to the MXU + output; f16 computed in f32, the
#: output rounded to f16 once
TOL = {F32: 2e-5, BF16: 2e-2, F16: 2e-3}


def rand(*shape, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def visible_by_definition(indices, Skv, mask=None, causal=False, alignment="top_left"):
    """float64-reference's mask, element by element: j visible to (b, i) iff j in indices[b, i] (ignoring -1),
    mask[b, i, j], and the causal bound."""
    B, Sq, _ = indices.shape
    vis = np.zeros((B, Sq, Skv), bool)
    for b in range(B):
        for i in range(Sq):
            for j in indices[b, i].tolist():
                if j >= 0:
                    vis[b, i, j] = True
    vis = torch.from_numpy(vis)
    if mask is not None:
        vis &= mask
    if causal:
        off = Skv - Sq if alignment == "bottom_right" else 0
        vis &= torch.arange(Skv)[None, :] <= torch.arange(Sq)[:, None] + off
    return vis


def reference(q, k, v, vis, sm_scale, softcap=None):
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ kk.transpose(-1, -2) * sm_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis[:, None], float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ vv


def close(got, want, dtype, what):
    """max |got - want| <= TOL[dtype] * max(max |want|, 1): relative to the result's scale, and to the unit scale
    of the inputs where the result cancels (a gradient that is 0 by definition, e.g. dq over a single key)."""
    want = want.detach()
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got.detach().double() - want).abs().max()) if want.numel() else 0.0
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert err <= TOL[dtype] * max(scale, 1.0), f"{what}: max error {err:.3g} (scale {scale:.3g})"


def run_case(B, Hkv, G, Sq, Skv, topk, D, Dv, dtype, causal, alignment, kv_pad, seed, softcap=None, config=None):
    q = rand(B, Hkv * G, Sq, D, dtype=dtype, seed=seed).requires_grad_()
    k = rand(B, Hkv, Skv, D, dtype=dtype, seed=seed + 1).requires_grad_()
    v = rand(B, Hkv, Skv, Dv, dtype=dtype, seed=seed + 2).requires_grad_()
    g = torch.Generator().manual_seed(seed + 3)
    idx = torch.randint(-1, Skv, (B, Sq, topk), generator=g, dtype=torch.int32)  # duplicates, -1 slots, topk > Skv
    mask = torch.ones(B, 1, Sq, Skv, dtype=torch.bool)
    for b, p in enumerate(kv_pad):  # ragged left padding of the keys
        mask[b, ..., :p] = False
    vis = visible_by_definition(idx, Skv, mask[:, 0], causal, alignment)
    sm = 0.7 / D**0.5
    out = topk_sparse_attention(q, k, v, idx, attention_mask=mask, causal=causal, causal_alignment=alignment,
                                sm_scale=sm, softcap=softcap, config=config)
    want = reference(q, k, v, vis, sm, softcap)
    close(out, want, dtype, "out")
    empty = ~vis.any(-1)  # [B, Sq]: rows that see nothing give exactly 0
    assert torch.equal(out.detach()[empty[:, None].expand_as(out[..., 0])], torch.zeros_like(out.detach()[
        empty[:, None].expand_as(out[..., 0])]))
    do = rand(*out.shape, dtype=dtype, seed=seed + 4)
    grads = torch.autograd.grad(out, (q, k, v), do)
    wants = torch.autograd.grad(want, (q, k, v), do.double())
    for name, a, w in zip("qkv", grads, wants):
        assert torch.isfinite(a).all(), name
        close(a, w, dtype, f"d{name}")
    return empty


@st.composite
def cases(draw):
    Skv = draw(st.integers(1, 20))
    return dict(B=draw(st.integers(1, 2)), Hkv=draw(st.sampled_from([1, 2])), G=draw(st.sampled_from([1, 2])),
                Sq=draw(st.integers(1, 20)), Skv=Skv, topk=draw(st.integers(1, Skv + 3)),
                D=draw(st.sampled_from([16, 24])), Dv=draw(st.sampled_from([8, 16])),
                dtype=draw(st.sampled_from([F32, BF16, F16])), causal=draw(st.booleans()),
                alignment=draw(st.sampled_from(["top_left", "bottom_right"])),
                kv_pad=draw(st.lists(st.integers(0, Skv), min_size=2, max_size=2)), seed=draw(st.integers(0, 99)))


@settings(max_examples=3)  # ~10 s an example here (three kernels lowered per shape); 40 in make test-slow
@given(c=cases())
def test_matches_float64_reference_fwd_and_grads(c):
    """Shapes with GQA, D != Dv, topk >= Skv, duplicate and -1 indices, ragged key padding, causal both ways;
    in the NaN-poisoned interpreter ("tpu" mode; a fixture would not be reset between hypothesis examples)."""
    import tpukernels as tk

    with tk.interpret_mode("tpu"):
        run_case(**dict(c, kv_pad=c["kv_pad"][:c["B"]]))


@pytest.mark.slow
@settings(max_examples=40)
@given(c=cases())
def test_matches_float64_reference_thorough(c):
    test_matches_float64_reference_fwd_and_grads.hypothesis.inner_test(c)


def test_edge_case_all_at_once():
    """bf16, GQA, topk > Skv, a fully padded sequence row (no visible key for any of its queries), ragged
    padding, bottom-right causal with Sq < Skv (a KV-cache chunk)."""
    import tpukernels as tk

    with tk.interpret_mode("tpu"):
        empty = run_case(B=2, Hkv=2, G=2, Sq=6, Skv=11, topk=14, D=16, Dv=8, dtype=BF16, causal=True,
                         alignment="bottom_right", kv_pad=[11, 3], seed=7)
    assert empty[0].all() and not empty[1].all()


def test_many_blocks_with_empty_full_and_partial_blocks(interpret):
    """128 x 128 blocks over 200 x 330 (tails in both axes): a selection that leaves key blocks empty (skipped),
    fully visible ones (no element mask) and partial ones, plus a query row that sees nothing; softcap."""
    B, H, Sq, Skv, D = 1, 2, 200, 330, 16
    q = rand(B, H, Sq, D, seed=5).requires_grad_()
    k = rand(B, 1, Skv, D, seed=6).requires_grad_()
    v = rand(B, 1, Skv, D, seed=7).requires_grad_()
    idx = torch.full((B, Sq, 140), -1, dtype=torch.int32)
    idx[0, :128, :128] = torch.arange(128, dtype=torch.int32)  # query block 0: key block 0 full, 1-2 empty
    gen = torch.Generator().manual_seed(8)
    idx[0, 128:, :12] = torch.randint(128, Skv, (Sq - 128, 12), generator=gen, dtype=torch.int32)  # partial
    idx[0, 150] = -1  # sees nothing
    vis = visible_by_definition(idx, Skv)
    kinds = TS.block_tables(torch.nn.functional.pad(vis, (0, 384 - Skv, 0, 256 - Sq)), 128, 128, H)[0][1, 0]
    assert kinds[0].tolist() == [2, 0, 0] and 1 in kinds[1].tolist()  # full, skipped, partial all occur
    out = topk_sparse_attention(q, k, v, idx, softcap=5.0, config={"block_q": 128, "block_kv": 128})
    want = reference(q, k, v, vis, D**-0.5, 5.0)
    close(out, want, F32, "out")
    assert torch.equal(out[0, :, 150], torch.zeros_like(out[0, :, 150]))
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    wants = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    for name, a, w in zip("qkv", grads, wants):
        close(a, w, F32, f"d{name}")
    assert torch.equal(grads[0][0, :, 150], torch.zeros_like(grads[0][0, :, 150]))


def test_device_tables_match_the_numpy_builder():
    """The on-device lists (rows 0 and 1: block index, kind) equal :mod:`.masks`' numpy builder's for one mask."""
    from tpukernels.library.attention.masks import NumpyMask, mask_tables

    vis = torch.rand(256, 384, generator=torch.Generator().manual_seed(0)) < 0.002
    vis[:128, 256:] = True
    vis[128:, :128] = False
    ft, bt, mb, mbt = TS.block_tables(vis[None], 128, 128, 1)
    ref = mask_tables(NumpyMask(vis.numpy()), 128, 128)
    for got, want in ((ft, ref.fwd), (bt, ref.bwd)):
        T = want.shape[-1]
        assert torch.equal(got[:2, :, :, :T], torch.from_numpy(np.array(want[:2])))
        assert not got[1, :, :, T:].any()  # past the longest list: skip steps
    assert torch.equal(mb.bool(), vis.view(2, 128, 3, 128).permute(0, 2, 1, 3).reshape(6, 128, 128))
    assert torch.equal(mbt, mb.transpose(1, 2))


def test_torch_compile_fullgraph_matches_eager():
    """Under torch.compile (fullgraph, aot_eager) the tables are built in the graph from the runtime indices (no
    host sync, no recompile per selection): same output and gradients as eager, for two selections."""
    def f(q, k, v, idx):
        return topk_sparse_attention(q, k, v, idx, causal=True)

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    q, k, v = (rand(2, h, 12, d, seed=s).requires_grad_() for h, d, s in ((4, 16, 1), (2, 16, 2), (2, 8, 3)))
    for seed in (0, 1):
        idx = torch.randint(-1, 12, (2, 12, 5), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        out, ref = cf(q, k, v, idx), f(q, k, v, idx)
        assert torch.equal(out, ref)
        for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
            assert torch.equal(a, b)
    bad = torch.full((2, 12, 5), 12, dtype=torch.int32)  # = Skv: eager raises ArgumentError, the graph asserts
    with pytest.raises(RuntimeError, match="indices must lie in"):
        cf(q, k, v, bad)


@pytest.mark.aot
@pytest.mark.parametrize("chip", ("v5e", "v6e", "tpu7x"))
def test_compile_only_deepseek_v32_prefill_shapes(chip):
    """The three masked kernels as topk_sparse_attention calls them for DeepSeek-V3.2's expanded MLA heads
    (D 192 / Dv 128, bf16): B=2 x 16 heads folded into 32, S=2048, 512 x 512 blocks (every element block kept)."""
    import tpukernels as tk
    from tpukernels.library.attention import fa_backward_dkv_masked, fa_backward_dq_masked, fa_forward_masked

    q, k, v, rows = "1x32x2048x192:bf16", "1x32x2048x192:bf16", "1x32x2048x128:bf16", "1x32x1x2048:f32"
    do = "1x32x2048x128:bf16"
    tabs, mbs = ("3x32x4x4:i32", "3x32x4x4:i32"), ("32x512x512:i8", "32x512x512:i8")
    for kernel, args in ((fa_forward_masked, (*tabs, q, k, v, *mbs)),
                         (fa_backward_dq_masked, (*tabs, q, k, v, do, rows, rows, *mbs)),
                         (fa_backward_dkv_masked, (*tabs, q, k, v, do, rows, rows, *mbs))):
        r = tk.compile_for(kernel, chip, *args, with_mlir=False, sm_scale=0.1352, softcap=None)
        assert r.ok, (kernel.name, r.summary())


def test_bad_arguments_raise_typed_errors():
    q, k, v = rand(1, 2, 4, 16), rand(1, 2, 6, 16), rand(1, 2, 6, 16)
    idx = torch.zeros(1, 4, 3, dtype=torch.int32)
    with pytest.raises(ArgumentError, match=r"indices must lie in \[0, Skv\)"):
        topk_sparse_attention(q, k, v, idx + 6)
    with pytest.raises(ArgumentError, match="indices must lie"):
        topk_sparse_attention(q, k, v, idx - 2)
    with pytest.raises(ArgumentError, match=r"indices must be \[B, Sq, topk\]"):
        topk_sparse_attention(q, k, v, idx[:, :3])
    with pytest.raises(DTypeError, match="indices must be int32 or int64"):
        topk_sparse_attention(q, k, v, idx.float())
    with pytest.raises(DTypeError, match="attention_mask must be a bool"):
        topk_sparse_attention(q, k, v, idx, attention_mask=torch.zeros(1, 4, 6))
    with pytest.raises(ArgumentError, match="attention_mask must be"):
        topk_sparse_attention(q, k, v, idx, attention_mask=torch.ones(1, 4, 5, dtype=torch.bool))
    with pytest.raises(ArgumentError, match="multiple of Hkv"):
        topk_sparse_attention(rand(1, 3, 4, 16), k, v, idx)
    with pytest.raises(ArgumentError, match="multiple of 128"):
        topk_sparse_attention(q, k, v, idx, config={"block_q": 100})
    with pytest.raises(ArgumentError, match="causal must be a bool"):
        topk_sparse_attention(q, k, v, idx, causal=1)
    # unchecked (device tensors: no host sync), a value outside [0, Skv) is ignored like -1
    vis = TS.index_visibility(torch.tensor([[[7, -5, 1, 6]]]), 6)
    assert vis.tolist() == [[[False, True, False, False, False, False]]]


# ------------------------------------------------------------------------------------------ the integration
transformers = pytest.importorskip("transformers")

from tpukernels.integrations import patch_probes  # noqa: E402
from tpukernels.integrations import transformers as tki  # noqa: E402


def test_attention_forward_with_indices_matches_transformers_eager_formula():
    """``indices=`` with a float (additive 0 / min) and a bool mask: transformers' eager DSA computation."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import eager_attention_forward

    B, H, Sq, Skv, D = 2, 4, 7, 10, 16
    q, k, v = rand(B, H, Sq, D, seed=1), rand(B, H, Skv, D, seed=2), rand(B, H, Skv, 8, seed=3)
    idx = torch.randint(0, Skv, (B, Sq, 3), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    bool_mask = (torch.arange(Skv)[None] <= torch.arange(Sq)[:, None] + 3)[None, None].expand(B, 1, Sq, Skv).clone()
    bool_mask[1, ..., :2] = False
    idx[:, :, 0] = torch.arange(Sq, dtype=torch.int32) + 3  # every row sees one key (eager's empty rows differ)
    idx[1, :, 0] = torch.maximum(idx[1, :, 0], torch.tensor(2, dtype=torch.int32))
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.is_causal = 1, False, True
    index_mask = torch.ones(B, Sq, Skv, dtype=torch.bool).scatter(-1, idx.long(), False)[:, None]
    float_mask = torch.zeros(B, 1, Sq, Skv).masked_fill(~bool_mask, torch.finfo(F32).min)
    want, _ = eager_attention_forward(module, q.double(), k.double(), v.double(),
                                      float_mask.double().masked_fill(index_mask, torch.finfo(F32).min), 0.3)
    for mask in (bool_mask, float_mask):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback
            got, _ = tki.attention_forward(module, q, k, v, mask, scaling=0.3, indices=idx)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    tki._warned.clear()
    module.training = True  # dropout in training: the eager fallback, index mask ANDed in, one warning
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="dropout"):
        got, _ = tki.attention_forward(module, q, k, v, bool_mask, dropout=1e-9, scaling=0.3, indices=idx)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _tiny(model_type, **cfg):
    from hf_tiny import randomize_norms, tiny_config

    c = tiny_config(model_type)
    for key, val in cfg.items():
        setattr(c, key, val)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(c, attn_implementation="eager").float().eval()
    randomize_norms(model)
    return model


def _ids():
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    return ids, mask


class SparseCalls:
    """Records the ``indices`` widths of ``topk_sparse_attention`` calls (the integration imports it per call)."""

    def __init__(self, monkeypatch):
        import tpukernels.library.attention as A

        self.widths, real = [], A.topk_sparse_attention

        def spy(q, k, v, indices, **kw):
            self.widths.append(int(indices.shape[-1]))
            return real(q, k, v, indices, **kw)

        monkeypatch.setattr(A, "topk_sparse_attention", spy)


DSA_MODELS = {
    "deepseek_v32": {},
    "glm_moe_dsa": {"indexer_types": ["full", "shared"]},  # the second layer reuses the first's selection
}


@pytest.mark.parametrize("model_type", sorted(DSA_MODELS))
def test_dsa_model_logits_and_greedy_generate_match_stock(model_type, monkeypatch):
    model = _tiny(model_type, **DSA_MODELS[model_type])
    ids, mask = _ids()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits.double()
        want_gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True)
    patch_probes.verdicts.clear()
    calls = SparseCalls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing left stock, no eager fallback
        report = tki.apply_tpukernels(model)
        assert report["attention"] and not report["stock"]
        calls.widths.clear()
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask).logits.double()
        assert calls.widths == [4, 4]  # both layers went through the sparse path with index_topk = 4 of 9 keys
        with torch.no_grad():
            got_gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4 * float(want[keep].abs().max()))
    assert torch.equal(got_gen, want_gen)
    assert len(calls.widths) > 2  # the decode steps too


def test_dsa_model_training_step_gradients_match_stock(monkeypatch):
    """The training path: a causal-LM loss's backward through the patched DeepSeek-V3.2 (the sparse attention's
    dQ / dK / dV kernels, the norms' backward) gives the stock model's parameter gradients. The indexer runs
    under no_grad in transformers (its selection carries no gradient) in both."""
    model = _tiny("deepseek_v32")
    model.train()
    ids, mask = _ids()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)  # logits at padding predict nothing (the
    # shifted loss would read position 1's, a padded row: garbage in stock eager, 0 in ours)

    def grads():
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}

    want = grads()
    patch_probes.verdicts.clear()
    calls = SparseCalls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert tki.apply_tpukernels(model)["attention"]
        assert model.training  # the probe ran in eval mode and gave the mode back
        calls.widths.clear()
        got = grads()
    assert calls.widths == [4, 4]
    assert set(got) == set(want) and any("self_attn.q_b_proj" in n for n in got)
    for name, w in want.items():
        scale = max(float(w.abs().max()), 1e-6)
        assert float((got[name] - w).abs().max()) <= 1e-4 * scale, name


def test_probe_narrows_a_wide_index_topk_and_restores_it(monkeypatch):
    """index_topk 64 >= every probe length (the selection would be all keys): the probe runs with 4, so the
    sparse selection is what it compares; the model keeps 64."""
    model = _tiny("deepseek_v32", index_topk=64)
    calls = SparseCalls(monkeypatch)
    patch_probes.verdicts.clear()
    report = tki.apply_tpukernels(model, rms_norm=False, layer_norm=False, dry_run=True)
    assert report["attention"] and set(calls.widths) == {patch_probes.PROBE_TOPK}
    assert all(m.index_topk == 64 for m in model.modules() if hasattr(m, "index_topk"))


def test_probe_rejects_a_sparse_path_that_ignores_the_selection(monkeypatch):
    import tpukernels.library.attention as A

    real = A.topk_sparse_attention
    monkeypatch.setattr(A, "topk_sparse_attention", lambda q, k, v, indices, **kw: real(
        q, k, v, torch.arange(k.shape[2], dtype=torch.int32).expand(*indices.shape[:2], -1), **kw))
    model = _tiny("deepseek_v32")
    tki._stock_warned.discard("attention")
    with pytest.warns(RuntimeWarning, match="attention implementation left stock: the model's output with it differs"):
        report = tki.apply_tpukernels(model, rms_norm=False, layer_norm=False)
    assert not report["attention"] and model.config._attn_implementation == "eager"


def test_kimi_k25_logits_generate_and_vision_tower_match_stock():
    """Kimi-K2.5 (``Kimi_K25ForConditionalGeneration``) is a VLM whose ``text_config`` is DeepSeek-V3 (MLA,
    dense: no DSA indexer): text-only inputs through the whole model. The whole-model probe runs text only, so
    the vision tower (its attention, per image chunk, now ours too) is compared here on two images of 4x4 and 2x4
    patches (the tiny config's multimodal projector keeps its full 1152 width, so image features end to end are
    not built)."""
    from hf_tiny import randomize_norms, tiny_config

    cfg = tiny_config("kimi_k25")
    assert cfg.text_config.model_type == "deepseek_v3"
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager").float().eval()
    randomize_norms(model)
    ids, mask = _ids()
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
    pixels = rand(int(grid.prod(-1).sum()), 3, 14, 14, seed=9)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits.double()
        want_gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        want_vision = model.model.vision_tower(pixels, grid_thw=grid).last_hidden_state.double()
    patch_probes.verdicts.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        report = tki.apply_tpukernels(model, moe=False)  # the MoE path is not what this test is about
        assert report["attention"] and not report["stock"]
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask).logits.double()
            got_gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            got_vision = model.model.vision_tower(pixels, grid_thw=grid).last_hidden_state.double()
    assert model.model.vision_tower.config._attn_implementation == "tpukernels"
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4 * float(want[keep].abs().max()))
    assert torch.equal(got_gen, want_gen)
    torch.testing.assert_close(got_vision, want_vision, rtol=1e-4, atol=1e-4 * float(want_vision.abs().max()))
