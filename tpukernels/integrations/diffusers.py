"""Diffusers integration: tpukernels flash attention as a Diffusers attention backend.

    from tpukernels.integrations.diffusers import register
    register()                                   # adds AttentionBackendName.TPUKERNELS = "tpukernels"
    transformer.set_attention_backend("tpukernels")
    # or:  with diffusers.models.attention_dispatch.attention_backend("tpukernels"): ...

How it plugs in. Diffusers' dispatcher (``diffusers/models/attention_dispatch.py``, 0.42) routes every
``dispatch_attention_fn`` call to the function registered for the active ``AttentionBackendName`` in
``_AttentionBackendRegistry`` (filled by the ``@_AttentionBackendRegistry.register(member, constraints=...)``
decorator, the one way backends are added in that file). ``set_attention_backend`` accepts only values of
that ``str`` Enum, which is closed: Diffusers documents no way for a third party to add a member. Two ways
in, both here:

* :func:`register` (default ``member="tpukernels"``) **adds a member** ``TPUKERNELS = "tpukernels"`` to the
  Enum (the member maps CPython's ``Enum`` keeps: ``_member_map_``, ``_value2member_map_``,
  ``_member_names_``, which is what ``AttentionBackendName("tpukernels")``, ``__members__`` and iteration
  read), then registers the backend for it with the decorator above. Nothing Diffusers ships is replaced.
  This is the one use of internals here, isolated in :func:`_extend_enum`: the member is checked after it is
  added the way Diffusers reads it (:func:`_enum_problem`: ``AttentionBackendName(value)``, ``__members__``,
  iteration, name lookup), and removed again with a :class:`~tpukernels.errors.BackendUnavailableError` if any
  check fails. Diffusers versions in :data:`ENUM_EXTENSION_TESTED` are the ones the test suite pins
  (``tests/test_diffusers.py::test_enum_extension_contract`` fails loudly when the installed Diffusers is
  outside it or its dispatcher changes shape); any other version gets one ``RuntimeWarning`` when the checks
  pass. ``register(member="_native_xla")`` (below) needs no internals at all.
* ``register(member="<existing value>")`` **overrides a member**: the same decorator re-registers an
  existing value (e.g. ``"_native_xla"``) with the tpukernels function; :func:`unregister` restores the
  original. No Enum internals touched, but that backend is gone while overridden.

The backend receives Diffusers' ``[B, S, H, D]`` tensors and calls
:func:`tpukernels.library.attention.flash_attention` in SDPA layout (GQA natively when ``Hq`` is a multiple of
``Hkv``). Masks are mapped with the transformers integration's verified mapping
(:func:`tpukernels.integrations.transformers.mask_to_spec`): ``None`` (full or ``is_causal``), boolean or
additive (0 / -inf) masks of shape ``[B, Skv]``, ``[B, 1, 1, Skv]`` or ``[B, 1|H, Sq, Skv]`` that are key
padding (-> segment ids), causal or both. Bidirectional padding masks ``q_valid[i] & kv_valid[j]`` (boolean or
additive, ``[B|1, 1|H, Sq, Skv]`` as Chroma and HunyuanVideo 1.5 build them; 1-3-D masks broadcast as SDPA
broadcasts them) map to segment ids too: a padded query sees no key and gives 0. Anything else (a real additive bias, per-head masks, dropout > 0,
context parallelism, ``return_lse``) runs Diffusers' native SDPA backend with a one-time warning — never
silently wrong. A query row whose keys are all masked gives 0 (as torch 2.13's SDPA does).
"""

from __future__ import annotations

import warnings

import torch

NAME = "tpukernels"
#: Diffusers versions whose ``AttentionBackendName`` :func:`_extend_enum` is tested against (a PEP 440 specifier)
ENUM_EXTENSION_TESTED = ">=0.42,<0.43"
_warned: set = set()
_overridden: dict = {}  # member -> (function, constraints, arg names) it had before register()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"tpukernels diffusers backend: {msg}; using diffusers' native SDPA backend for these calls",
                      RuntimeWarning, stacklevel=3)


def _native(**kw):
    from diffusers.models import attention_dispatch as ad

    return ad._native_attention(**kw)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
) -> torch.Tensor:
    """Diffusers backend function (the native backend's signature).

    Args:
        query: ``[B, Sq, Hq, D]``; key: ``[B, Skv, Hkv, D]``; value: ``[B, Skv, Hkv, Dv]`` (one float dtype).
        attn_mask: None, ``[B, Skv]`` (key padding), or a mask SDPA broadcasts to ``[B, H, Sq, Skv]`` (1-D to
            4-D), boolean (True = attend) or additive (0 / -inf); mapped when it is key padding, query-and-key
            padding (``q_valid[i] & kv_valid[j]``), causal or causal with key padding.
        is_causal: top-left causal mask (torch SDPA semantics). scale: softmax scale (default ``1/sqrt(D)``).

    Returns:
        ``[B, Sq, Hq, Dv]`` in the query's dtype.
    """
    from .transformers import mask_to_spec

    kw = dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
              scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, _parallel_config=_parallel_config)
    if return_lse or _parallel_config is not None or dropout_p > 0:
        _warn_once("args", "return_lse / context parallelism / dropout are not supported")
        return _native(**kw)
    B, sq, hq, _ = query.shape
    skv, hkv = key.shape[1], key.shape[2]
    if hkv == 0 or hq % hkv:
        return _native(**kw)  # SDPA raises the error the user expects
    mask = _as_4d(attn_mask, B, skv)
    key_padding = _key_padding(mask, B, skv) if not is_causal else None
    if key_padding is not None:  # [B|1, 1, 1, Skv]: a key-padding mask by construction, no dense check needed
        return _flash(query, key, value, scale, dict(causal=False, causal_alignment="top_left", window_left=None,
                                                     kv_valid=key_padding))
    padding = _bidirectional_padding(mask, B, sq, skv) if not is_causal else None
    if padding is not None:  # query and key padding (Chroma, HunyuanVideo 1.5: valid[i] & valid[j])
        q_valid, kv_valid = padding
        return _flash(query, key, value, scale, dict(causal=False, causal_alignment="top_left", window_left=None,
                                                     kv_valid=kv_valid, q_valid=q_valid))
    if mask is not None and mask.dim() == 4 and mask.shape[2] == 1 and sq != 1:
        mask = mask.expand(mask.shape[0], mask.shape[1], sq, skv)
    if mask is not None and mask.dim() == 4 and mask.shape[0] != B:
        mask = mask.expand(B, *mask.shape[1:])
    spec = None
    if mask is None or mask.dim() == 4:
        spec = mask_to_spec(mask, sq, skv, is_causal=is_causal, sliding_window=None)
        if spec is not None and mask is not None and is_causal:
            spec = None  # SDPA raises for mask + is_causal; let it
    if spec is None:
        _warn_once("mask", f"attention mask of shape {tuple(attn_mask.shape)} is not key-padding / causal")
        return _native(**kw)
    return _flash(query, key, value, scale, spec)


def _as_4d(mask, B: int, skv: int):
    """A Diffusers mask as the 4-D ``[B|1, H|1, Sq|1, Skv]`` mask SDPA sees: ``[B, Skv]`` is key padding (the
    native backend reshapes exactly this form); other 1-3-D masks broadcast as SDPA broadcasts them (leading
    dims of 1; a 3-D mask's first dim lines up with the heads)."""
    if mask is None or mask.dim() >= 4:
        return mask
    if mask.dim() == 2 and tuple(mask.shape) == (B, skv):
        return mask[:, None, None, :]
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _as_bool(mask):
    """A boolean view of a boolean or 0 / -inf additive mask (True = attend), else None (a real bias)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        return None
    neg = mask <= torch.finfo(mask.dtype).min / 2
    return ~neg if bool(((mask == 0) | neg).all()) else None


def _bidirectional_padding(mask, B: int, sq: int, skv: int):
    """``(q_valid [B, Sq], kv_valid [B, Skv])`` bool when a 4-D mask is exactly ``q_valid[i] & kv_valid[j]`` for
    every head (padding of queries and keys, a bidirectional mask as Chroma / HunyuanVideo 1.5 build it), else
    None. Checked densely (one host sync)."""
    if mask is None or mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[-1] != skv:
        return None
    m = _as_bool(mask)
    if m is None:
        return None
    if m.shape[1] != 1:
        if not bool((m == m[:, :1]).all()):
            return None  # per-head masks
        m = m[:, :1]
    m = m[:, 0].expand(B, sq, skv)
    q_valid, kv_valid = m.any(-1), m.any(-2)
    if not torch.equal(m, q_valid[:, :, None] & kv_valid[:, None, :]):
        return None
    return q_valid, kv_valid


def _key_padding(mask, B: int, skv: int):
    """``[B, Skv]`` bool (True = attend) for a ``[B|1, 1, 1, Skv]`` boolean or 0/-inf additive mask, else None."""
    if mask is None or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[0] not in (1, B):
        return None
    m = mask[:, 0, 0, :]
    if m.dtype != torch.bool:
        if not m.dtype.is_floating_point:
            return None
        neg = m <= torch.finfo(m.dtype).min / 2
        if not bool(((m == 0) | neg).all()):
            return None  # a real additive bias
        m = ~neg
    return m.expand(B, skv)


def _flash(query, key, value, scale, spec):
    from ..library.attention import flash_attention

    B, sq = query.shape[:2]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    seg = {}
    q_valid = spec.get("q_valid")
    if q_valid is not None:  # valid queries (1) see valid keys (1); padded queries (0) see nothing (keys -1)
        seg = dict(q_segment_ids=q_valid.to(torch.int32),
                   kv_segment_ids=torch.where(spec["kv_valid"], 1, -1).to(torch.int32))
    elif spec["kv_valid"] is not None:
        seg = dict(q_segment_ids=torch.ones(B, sq, dtype=torch.int32, device=query.device),
                   kv_segment_ids=spec["kv_valid"].to(torch.int32))
    out = flash_attention(q, k, v, causal=spec["causal"], causal_alignment=spec["causal_alignment"], sm_scale=scale,
                          window=(spec["window_left"], None), **seg)
    return out.transpose(1, 2)


def _diffusers_version() -> str:
    from importlib.metadata import version

    return version("diffusers")


def _extend_enum(enum_cls, name: str, value: str):
    """Add ``name = value`` to Diffusers' closed ``str`` Enum ``enum_cls`` and check it (module docstring).

    Returns:
        The new member.

    Raises:
        BackendUnavailableError: the member does not behave as a member where Diffusers reads it (CPython's or
            Diffusers' Enum changed); the Enum is left as it was.
    """
    from packaging.specifiers import SpecifierSet

    from ..errors import BackendUnavailableError

    version = _diffusers_version()
    member = _add_member(enum_cls, name, value)
    problem = _enum_problem(enum_cls, name, value, member)
    if problem is not None:
        _remove_member(enum_cls, name, value)
        raise BackendUnavailableError(
            f"tpukernels diffusers backend: cannot add {name} = {value!r} to diffusers {version}'s "
            f"{enum_cls.__name__} ({problem}; tested with diffusers {ENUM_EXTENSION_TESTED}). Use "
            f"register(member='_native_xla') to serve an existing backend name through Diffusers' registry instead")
    if not SpecifierSet(ENUM_EXTENSION_TESTED).contains(version, prereleases=True):
        warnings.warn(f"tpukernels diffusers backend: diffusers {version} is outside the versions whose "
                      f"{enum_cls.__name__} register() is tested against ({ENUM_EXTENSION_TESTED}); the added member "
                      f"{value!r} passed its checks", RuntimeWarning, stacklevel=3)
    return member


def _enum_problem(enum_cls, name: str, value: str, member) -> str | None:
    """What is wrong with ``member`` as ``enum_cls``'s member ``name = value``, read the ways Diffusers reads
    backend names (``AttentionBackendName(value)``, ``{x.value for x in __members__.values()}``, iteration,
    ``AttentionBackendName[name]``, registry dict keys compared with the plain string), or None."""
    try:
        if enum_cls(value) is not member:
            return f"{enum_cls.__name__}({value!r}) is not the new member"
        if enum_cls[name] is not member or getattr(enum_cls, name) is not member:
            return f"{enum_cls.__name__}[{name!r}] is not the new member"
    except (ValueError, KeyError, AttributeError) as e:
        return f"lookup failed: {type(e).__name__}: {e}"
    if value not in {x.value for x in enum_cls.__members__.values()}:
        return "the value is missing from __members__"
    if member not in list(enum_cls):
        return "iteration does not yield the member"
    if not (isinstance(member, enum_cls) and isinstance(member, str) and member == value
            and hash(member) == hash(value) and member.name == name and member.value == value):
        return "the member does not compare and hash as its string value"
    return None


def _remove_member(enum_cls, name: str, value: str) -> None:
    """Undo :func:`_add_member` (whatever part of it took effect)."""
    enum_cls._member_map_.pop(name, None)
    enum_cls._value2member_map_.pop(value, None)
    if name in enum_cls._member_names_:
        enum_cls._member_names_.remove(name)
    if name in enum_cls.__dict__:
        type.__delattr__(enum_cls, name)


def _add_member(enum_cls, name: str, value: str):
    """Add ``name = value`` to a closed ``str`` Enum (CPython ``Enum`` internals; only :func:`_extend_enum`
    calls this); returns the member."""
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member.__init__(value)
    if hasattr(enum_cls, "_sort_order_"):
        member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def register(member: str = NAME):
    """Register the tpukernels backend with Diffusers (idempotent); returns its ``AttentionBackendName``.

    Args:
        member: ``"tpukernels"`` (default) adds a new Enum member; the value of an existing member (e.g.
            ``"_native_xla"``) overrides that backend instead (undo with :func:`unregister`).

    Raises:
        BackendUnavailableError: a new member cannot be added to this Diffusers' Enum (:func:`_extend_enum`).
    """
    from diffusers.models import attention_dispatch as ad

    enum_cls, registry = ad.AttentionBackendName, ad._AttentionBackendRegistry
    if member in enum_cls._value2member_map_:
        backend = enum_cls(member)
        if registry._backends.get(backend) is attention:
            return backend
        if backend in registry._backends and member != NAME:
            _overridden[backend] = (registry._backends[backend], registry._constraints[backend],
                                    registry._supported_arg_names[backend])
    else:
        backend = _extend_enum(enum_cls, member.upper(), member)
    registry.register(backend, constraints=[ad._check_device, ad._check_shape])(attention)
    return backend


def unregister(member: str) -> None:
    """Restore the backend an override replaced (no-op for members that were not overridden)."""
    from diffusers.models import attention_dispatch as ad

    backend = ad.AttentionBackendName(member)
    if backend in _overridden:
        reg = ad._AttentionBackendRegistry
        reg._backends[backend], reg._constraints[backend], reg._supported_arg_names[backend] = _overridden.pop(backend)
