"""torch tensors whose strides are not the standard row-major ones reach the kernels with the right values.

torch calls a tensor contiguous whatever the strides of its size-1 dimensions are: ``torch.randn(2, 1, 4, 32)
.transpose(1, 2)`` (HF's decode-step q, ``[B, S=1, H, D] -> [B, H, 1, D]``) has strides ``(128, 32, 128, 1)``
and ``is_contiguous()`` True, and ``.contiguous()`` returns it unchanged. DLPack hands those strides to XLA,
which read them as a transposed layout and rejected the array ("Computation was compiled for input layouts
that disagree ..."). The cpu target now gives every input the standard strides (a view when only size-1
dimensions differ, a copy for non-contiguous tensors); the tpu target a row-major copy.
Ground truth: float64 references from the same inputs.
"""

import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import tpukernels as tk
from tpukernels.library import attention_reference, flash_attention, rms_norm
from tpukernels.library.norms.rms_norm_ops import rms_norm_reference
from tpukernels.library.rope import apply_rotary_pos_emb, rope_reference
from tpukernels.targets.cpu import row_major, row_major_strides


def _double_body(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + 1


@tk.tpu_kernel(_double_body, namespace="tkstrides")
def double_plus_one(x: torch.Tensor) -> torch.Tensor:
    """2 x + 1 over a whole array of any rank (one block)."""
    spec = pl.BlockSpec(tuple(x.shape), lambda: (0,) * x.ndim)
    return tk.Launch(grid=(), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))


def odd_strides(x: torch.Tensor, how: str) -> torch.Tensor:
    """The values of ``x`` in a view whose size-1 dimensions carry non-standard strides (torch: contiguous)."""
    base = x.contiguous().clone()
    std = row_major_strides(base.shape)
    if how == "zero":
        strides = tuple(0 if n == 1 else s for n, s in zip(base.shape, std))
    elif how == "huge":
        strides = tuple(10**6 + 7 if n == 1 else s for n, s in zip(base.shape, std))
    else:
        raise ValueError(how)
    out = base.as_strided(base.shape, strides)
    assert out.is_contiguous() and out.stride() != std and torch.equal(out, x)
    return out


# How users' tensors get such strides: a transpose that moves a size-1 dimension (HF decode), as_strided.
MAKERS = {
    "transpose_mid": lambda x: x.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2),
    "transpose_lead": lambda x: x.transpose(0, 1).clone(memory_format=torch.contiguous_format).transpose(0, 1),
    "zero": lambda x: odd_strides(x, "zero"),
    "huge": lambda x: odd_strides(x, "huge"),
}


def _nonstandard(t):
    return t.is_contiguous() and t.stride() != row_major_strides(t.shape)


def test_row_major_gives_standard_strides_without_touching_the_input():
    x = torch.randn(2, 1, 4, 32).transpose(1, 2)  # the issue's repro: (128, 32, 128, 1)
    assert x.is_contiguous() and x.stride() == (128, 32, 128, 1) and x.contiguous().stride() == x.stride()
    y = row_major(x)
    assert y.stride() == (128, 32, 32, 1) and torch.equal(y, x)
    assert y.data_ptr() == x.data_ptr() and x.stride() == (128, 32, 128, 1)  # a view; the caller's tensor kept
    c = row_major(x, copy_only=True)
    assert c.stride() == (128, 32, 32, 1) and torch.equal(c, x) and c.data_ptr() != x.data_ptr()
    std = torch.randn(3, 1, 5)
    assert row_major(std) is std and row_major(std, copy_only=True) is std
    nc = torch.randn(5, 1, 3).transpose(0, 2)  # not contiguous at all: a copy
    assert row_major(nc).stride() == (5, 5, 1) and torch.equal(row_major(nc), nc)


@pytest.mark.parametrize("shape,how", [(s, h) for s in [(8, 1, 128), (1, 8, 128), (2, 1, 1, 128)] for h in MAKERS
                                        if (s, h) != ((2, 1, 1, 128), "transpose_mid")])  # that one: standard strides
def test_user_kernel_takes_size1_dims_with_any_stride(how, shape, interpret):
    x = torch.randn(*shape)
    y = MAKERS[how](x)  # torch-contiguous with odd size-1 strides, or (transposes of some shapes) not contiguous
    assert _nonstandard(y) or not y.is_contiguous()
    before = y.clone()
    out = double_plus_one(y)
    assert torch.equal(out, (2 * x.double() + 1).float())  # 2x exact, one rounding
    assert torch.equal(y, before)


def test_user_kernel_issue_repro():
    x = torch.randn(1, 8, 128).transpose(0, 1)  # [8, 1, 128], strides (128, 1024, 1)
    assert _nonstandard(x)
    assert torch.equal(double_plus_one(x), (2 * x.double() + 1).float())


@pytest.mark.parametrize("how", ["transpose_mid", "zero"])
def test_rms_norm_with_size1_strides(how):
    x = MAKERS[how](torch.randn(4, 1, 3, 256))
    assert _nonstandard(x)
    w = torch.randn(256)
    got = rms_norm(x, w, eps=1e-6)
    want = rms_norm_reference(x, w, eps=1e-6)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)


def test_rope_hf_decode_step_strides():
    # HF Llama decode: q/k are [B, 1, H, D] projections viewed as [B, H, 1, D]
    B, H, Hkv, D = 2, 4, 2, 32
    q = torch.randn(B, 1, H, D).transpose(1, 2)
    k = torch.randn(B, 1, Hkv, D).transpose(1, 2)
    assert _nonstandard(q) and _nonstandard(k)
    pos = torch.tensor([[5], [9]])
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = pos[..., None].double() * inv
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos().float(), emb.sin().float()  # [B, 1, D]
    qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
    want_q = rope_reference(q, cos, sin)  # cos/sin [B, S, D]
    want_k = rope_reference(k, cos, sin)
    torch.testing.assert_close(qo.double(), want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ko.double(), want_k, rtol=1e-6, atol=1e-6)


def test_flash_attention_decode_shape_strides():
    B, Hq, Hkv, S, D = 2, 4, 2, 40, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, Hq, D, generator=g).transpose(1, 2)  # [B, Hq, 1, D], torch-contiguous
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g).transpose(1, 2)  # not contiguous: copied
    assert _nonstandard(q)
    for causal in (False, True):
        got = flash_attention(q, k, v, causal=causal, causal_alignment="bottom_right")
        want, _ = attention_reference(q, k, v, causal=causal, causal_alignment="bottom_right", dtype=torch.float64)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_torch_to_jax_helper_with_size1_strides():
    from tpukernels.dsl.dtypes import torch_to_jax

    x = torch.randn(2, 1, 4, 32).transpose(1, 2)
    a = torch_to_jax(x)
    assert jnp.array_equal(a, jnp.asarray(x.contiguous().numpy().copy()))


# ---------------------------------------------------------------------------------- tpu target adapter
def test_tpu_target_passes_row_major_tensors(monkeypatch):
    import sys
    import types

    import jax

    seen = []

    class FakeJaxCallable:  # torch_tpu's JaxCallable constructor; records what the device would receive
        def __init__(self, name, jit_fn, trace_key, **kw):
            self.jit_fn = jit_fn

        def __call__(self, *tensors):
            seen.extend(tensors)
            structs = [jax.ShapeDtypeStruct(tuple(t.shape), jnp.float32) for t in tensors]
            (o,) = jax.tree_util.tree_leaves(jax.eval_shape(self.jit_fn, *structs))
            return torch.zeros(o.shape)

    pallas = types.ModuleType("torch_tpu._internal.pallas.pallas")
    pallas.JaxCallable = FakeJaxCallable
    for name in ("torch_tpu", "torch_tpu._internal", "torch_tpu._internal.pallas"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torch_tpu._internal.pallas.pallas", pallas)
    from tpukernels.targets.tpu import run_torch_tpu

    x = torch.randn(1, 8, 128).transpose(0, 1)
    try:
        run_torch_tpu(double_plus_one, [x], None)
    finally:
        double_plus_one._plans.clear()
    (t,) = seen
    assert t.stride() == (128, 128, 1) and torch.equal(t, x) and x.stride() == (128, 1024, 1)


# ---------------------------------------------------------------------------------- HF generate
def test_hf_llama_generate_batch2_with_rope_patched(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as ml

    from tpukernels.integrations import transformers as tki

    monkeypatch.setattr(ml, "apply_rotary_pos_emb", ml.apply_rotary_pos_emb)  # restored after the test
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)

    def model():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg).float().eval()

    stock, ours = model(), model()
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = stock.generate(ids, **kw)
        assert tki.apply_tpukernels(ours, attention=False, rms_norm=False, rope=True)["rope"] == 1
        got = ours.generate(ids, **kw)  # decode steps pass [B, H, 1, D] q/k with size-1 strides
    assert got.shape == (2, 10)
    assert torch.equal(got, want)
