"""Diffusers attention backend (tpukernels.integrations.diffusers, issue 17).

Tiny models built from configs (random weights, re-drawn so no zero-initialised gate hides the attention)
give the same output with ``set_attention_backend("tpukernels")`` as with Diffusers' native SDPA backend:
WanTransformer3DModel (non-causal self-attention + text cross-attention with a different kv length) and
QwenImageTransformer2DModel (joint attention with a text key-padding mask). Tolerance: 2e-5 * max|ref|
(float32 flash attention vs SDPA, both f32 accumulation; ~1e-7 observed). Every model test also checks
that the tpukernels kernel actually ran (no fallback warning, calls counted) and that the feature under
test changes the output by far more than the tolerance.
"""

from __future__ import annotations

import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from diffusers.models import attention_dispatch as ad  # noqa: E402

from tpukernels.integrations import diffusers as tkd  # noqa: E402

BACKEND = tkd.register()


def _close(got, ref, what=""):
    tol = 2e-5 * ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"
    return err


def _redraw(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            std = 0.3 / max(1, p.shape[-1]) ** 0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


class _Count:
    """Counts (and records the kv lengths of) calls of the registered tpukernels backend function."""

    def __enter__(self):
        self.calls = []
        self._orig = ad._AttentionBackendRegistry._backends[BACKEND]
        ad._AttentionBackendRegistry._backends[BACKEND] = self
        return self

    def __call__(self, **kw):
        self.calls.append((kw["query"].shape[1], kw["key"].shape[1], kw["attn_mask"] is not None))
        return self._orig(**kw)

    def __exit__(self, *exc):
        ad._AttentionBackendRegistry._backends[BACKEND] = self._orig


def test_registered_member_is_selectable():
    assert BACKEND is ad.AttentionBackendName("tpukernels") is ad.AttentionBackendName.TPUKERNELS
    assert BACKEND in list(ad.AttentionBackendName) and "TPUKERNELS" in ad.AttentionBackendName.__members__
    assert tkd.register() is BACKEND  # idempotent
    assert ad._AttentionBackendRegistry._backends[BACKEND] is tkd.attention
    q = torch.randn(1, 5, 2, 16)
    with ad.attention_backend("tpukernels"), _Count() as c:
        out = ad.dispatch_attention_fn(q, q, q)
    assert c.calls == [(5, 5, False)]
    _close(out, ad._native_attention(q, q, q))


def test_wan_self_and_cross_attention_match_native():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = _redraw(WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32))
    x, txt, t = torch.randn(2, 4, 2, 8, 8), torch.randn(2, 7, 24), torch.tensor([10, 500])
    with torch.no_grad():
        ref = model(x, t, txt).sample
        other_text = model(x, t, torch.randn(2, 7, 24)).sample
        model.set_attention_backend("tpukernels")
        with warnings.catch_warnings(), _Count() as c:
            warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn
            got = model(x, t, txt).sample
        model.reset_attention_backend()
    assert sorted(set(c.calls)) == [(32, 7, False), (32, 32, False)]  # cross (kv 7) and self (kv 32)
    err = _close(got, ref, "wan")
    assert (other_text - ref).abs().max().item() > 1e3 * max(err, 1e-9)  # cross-attention matters


def test_qwenimage_key_padding_mask_matches_native():
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = _redraw(QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=(4, 6, 6)))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 4:] = False
    kw = dict(hidden_states=torch.randn(2, 16, 16), encoder_hidden_states=torch.randn(2, 9, 24),
              encoder_hidden_states_mask=mask, timestep=torch.tensor([0.3, 0.7]), img_shapes=[(1, 4, 4)] * 2)
    with torch.no_grad():
        ref = model(**kw).sample
        unmasked = model(**{**kw, "encoder_hidden_states_mask": None}).sample
        model.set_attention_backend("tpukernels")
        with warnings.catch_warnings(), _Count() as c:
            warnings.simplefilter("error", RuntimeWarning)
            got = model(**kw).sample
        model.reset_attention_backend()
    assert c.calls == [(25, 25, True)]
    err = _close(got, ref, "qwenimage")
    assert (unmasked - ref).abs().max().item() > 1e3 * max(err, 1e-9)  # the padding mask matters


def _qkv(B=2, sq=12, skv=12, hq=4, hkv=4, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, sq, hq, d, generator=g), torch.randn(B, skv, hkv, d, generator=g),
            torch.randn(B, skv, hkv, d, generator=g))


@pytest.mark.parametrize("case", ["2d_bool", "4d_bool", "4d_dense", "additive", "batch_bcast", "causal", "gqa_cross",
                                  "scale"])
def test_backend_function_masks(case):
    """Masks and arguments the backend maps onto the kernel, vs the native SDPA backend (no fallback)."""
    q, k, v = _qkv(skv=20 if case == "gqa_cross" else 12, hkv=2 if case == "gqa_cross" else 4)
    B, skv = q.shape[0], k.shape[1]
    valid = torch.ones(B, skv, dtype=torch.bool)
    valid[1, skv // 2:] = False
    kw = {}
    if case == "2d_bool":
        kw["attn_mask"] = valid
    elif case == "4d_bool":
        kw["attn_mask"] = valid[:, None, None, :]
    elif case == "4d_dense":  # [B, 1, Sq, Skv]: verified densely before it is mapped
        kw["attn_mask"] = valid[:, None, None, :].expand(B, 1, q.shape[1], skv)
    elif case == "batch_bcast":
        kw["attn_mask"] = valid[1:, None, None, :]
    elif case == "additive":
        kw["attn_mask"] = torch.where(valid, 0.0, float("-inf"))[:, None, None, :]
    elif case == "causal":
        kw["is_causal"] = True
    elif case == "gqa_cross":
        kw.update(attn_mask=valid, enable_gqa=True)
    else:
        kw["scale"] = 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = tkd.attention(q, k, v, **kw)
    ref = ad._native_attention(q, k, v, **kw)
    assert got.shape == ref.shape
    _close(got, ref, case)
    if kw.get("attn_mask") is not None or kw.get("is_causal"):
        plain = ad._native_attention(q, k, v, enable_gqa=kw.get("enable_gqa", False))
        assert (plain - ref).abs().max().item() > 1e-2  # the mask is really exercised


@pytest.mark.parametrize("case", ["bidir_bool", "bidir_additive", "bidir_heads_repeated", "bidir_cross_3d",
                                  "key_padding_1d"])
def test_bidirectional_padding_masks_match_native(case):
    """Query-and-key padding masks as Diffusers models build them (Chroma: ``m[:, None, None, :] * m[:, None, :,
    None]``; HunyuanVideo 1.5: the same repeated over ``Sq`` and AND-ed with its transpose) and the 1-D / 3-D
    forms SDPA broadcasts (1-D: Diffusers' varlen backends' key padding), vs the native backend (padded query
    rows: 0 in both)."""
    sq, skv = 12, 20 if case == "bidir_cross_3d" else 12
    q, k, v = _qkv(sq=sq, skv=skv)
    B = q.shape[0]
    valid = torch.ones(B, sq, dtype=torch.bool)
    valid[0, 9:] = False
    valid[1, 5:] = False
    if case == "bidir_bool":
        mask = valid[:, None, None, :] * valid[:, None, :, None]
    elif case == "bidir_additive":
        mask = torch.where(valid[:, None, None, :] & valid[:, None, :, None], 0.0, float("-inf"))
    elif case == "bidir_heads_repeated":
        m1 = valid.view(B, 1, 1, sq).repeat(1, 4, sq, 1)
        mask = m1 & m1.transpose(2, 3)
    elif case == "bidir_cross_3d":  # [1, Sq, Skv]: SDPA lines the first dim up with the heads
        kv = torch.arange(skv) < 15
        mask = (valid[1, :, None] & kv[None, :])[None]
    else:
        mask = torch.arange(skv) < 7
    tkd._warned.discard("mask")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        got = tkd.attention(q, k, v, attn_mask=mask)
    # SDPA takes no 1-D mask (Diffusers' varlen backends read it as [Skv] key padding): compare with [1, 1, 1, Skv]
    ref = ad._native_attention(q, k, v, attn_mask=mask.view(1, 1, 1, -1) if mask.dim() == 1 else mask)
    assert got.shape == ref.shape and not got.isnan().any()
    _close(got, ref, case)
    plain = ad._native_attention(q, k, v)
    assert (plain - ref).abs().max().item() > 1e-2  # the mask is really exercised


@pytest.mark.parametrize("kind", ["random_bool", "additive_bias"])
def test_unexpressible_mask_falls_back_with_warning(kind):
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(3)
    if kind == "random_bool":
        mask = torch.rand(2, 1, 12, 12, generator=g) > 0.3
        mask[..., 0] = True
    else:  # an ALiBi-like additive bias over keys: not a mask
        mask = torch.randn(2, 1, 1, 12, generator=g)
    tkd._warned.discard("mask")
    with pytest.warns(RuntimeWarning, match="native SDPA"):
        got = tkd.attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, ad._native_attention(q, k, v, attn_mask=mask), rtol=0, atol=0)


def test_override_existing_member_and_restore():
    member = ad.AttentionBackendName("_native_xla")
    before = ad._AttentionBackendRegistry._backends.get(member)
    try:
        assert tkd.register("_native_xla") is member
        assert ad._AttentionBackendRegistry._backends[member] is tkd.attention
        q, k, v = _qkv()
        _close(ad.dispatch_attention_fn(q, k, v, backend=member), ad._native_attention(q, k, v))
    finally:
        tkd.unregister("_native_xla")
    assert ad._AttentionBackendRegistry._backends.get(member) is before


# ---------------------------------------------------------------------------- the Enum extension (issue 36 item 14)
def test_enum_extension_contract():
    """Fails loudly when Diffusers changes under the one use of internals (``_extend_enum``): the installed
    version must be one it is tested against, the dispatcher pieces it plugs into must have the shape it
    assumes, and the added member must read as a member everywhere Diffusers reads backend names. On a new
    Diffusers: re-read its ``attention_dispatch.py`` (a public way to add a backend?), then widen
    ``ENUM_EXTENSION_TESTED``."""
    import enum
    import inspect

    from packaging.specifiers import SpecifierSet

    version = diffusers.__version__
    assert SpecifierSet(tkd.ENUM_EXTENSION_TESTED).contains(version, prereleases=True), (
        f"diffusers {version} is outside tkd.ENUM_EXTENSION_TESTED = {tkd.ENUM_EXTENSION_TESTED}: check "
        "tpukernels/integrations/diffusers.py's _extend_enum against this Diffusers, then widen the range")
    names = ad.AttentionBackendName
    assert issubclass(names, str) and issubclass(names, enum.Enum) and names.__mro__[1] is str
    params = inspect.signature(ad._AttentionBackendRegistry.register).parameters
    assert {"backend", "constraints"} <= set(params)
    for table in ("_backends", "_constraints", "_supported_arg_names"):
        assert isinstance(getattr(ad._AttentionBackendRegistry, table), dict), table
    # how Diffusers validates a name before using it (ModelMixin / AttentionModuleMixin.set_attention_backend)
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.modeling_utils import ModelMixin

    for fn in (ModelMixin.set_attention_backend, AttentionModuleMixin.set_attention_backend):
        src = inspect.getsource(fn)
        assert "AttentionBackendName.__members__" in src and "AttentionBackendName(backend" in src, fn.__qualname__
    assert tkd._enum_problem(names, "TPUKERNELS", "tpukernels", BACKEND) is None
    with ad.attention_backend("tpukernels"):
        assert ad._AttentionBackendRegistry.get_active_backend() == (BACKEND, tkd.attention)


def test_enum_extension_checks_rolls_back_and_warns_outside_tested(monkeypatch):
    """``_extend_enum`` on a throwaway str Enum: a tested version adds silently; an untested one warns once the
    checks pass; a member that does not read back as one (simulated: the value map not updated) is removed
    again and raises BackendUnavailableError naming the alternative."""
    import enum

    from tpukernels.errors import BackendUnavailableError

    class Names(str, enum.Enum):
        A = "a"

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = tkd._extend_enum(Names, "X", "x")
    assert Names("x") is x is Names.X and x in list(Names) and x == "x"
    monkeypatch.setattr(tkd, "_diffusers_version", lambda: "0.99.0")
    with pytest.warns(RuntimeWarning, match=r"diffusers 0\.99\.0 is outside the versions"):
        assert tkd._extend_enum(Names, "Y", "y") is Names("y")
    real = tkd._add_member

    def broken(enum_cls, name, value):
        member = real(enum_cls, name, value)
        del enum_cls._value2member_map_[value]  # as if a new CPython kept values elsewhere
        return member

    monkeypatch.setattr(tkd, "_add_member", broken)
    with pytest.raises(BackendUnavailableError, match=r"cannot add Z = 'z'.*register\(member='_native_xla'\)"):
        tkd._extend_enum(Names, "Z", "z")
    assert "Z" not in Names.__members__ and "Z" not in Names.__dict__ and [m.value for m in Names] == ["a", "x", "y"]
    with pytest.raises(ValueError):
        Names("z")
