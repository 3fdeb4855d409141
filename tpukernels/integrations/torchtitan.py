"""TorchTitan integration: tpukernels attention, RMSNorm, RoPE, SwiGLU and the fused LM-head loss in
torchtitan's own ``Trainer`` (torchtitan 0.3.0).

torchtitan 0.3.0 builds every component from a config tree (``Configurable.Config``); this module swaps config
nodes for subclasses whose modules call tpukernels ops. Parameters, their names, initialization and sharding
configs are inherited unchanged (state dicts and checkpoints stay interchangeable with stock torchtitan).

=============================  ================================  =================================================
torchtitan node                replaced by                       tpukernels op
=============================  ================================  =================================================
``FlexAttention.Config`` /     :class:`TPUKernelsAttention`      ``flash_attention`` (GQA natively; document masks
``VarlenAttention.Config``     (a ``VarlenAttention.Config``:    from ``VarlenMetadata`` as segment ids; causal /
(inner attention)              the trainer hands it documents)   sliding ``window_size``)
``ScaledDotProductAttention``  :class:`TPUKernelsCausalAttention`  ``flash_attention`` (causal / full); under
``.Config`` (inner attention)                                    context parallelism ``ring_attention_torch``
                                                                 over the cp group (torchtitan's "headtail"
                                                                 shards are its zigzag order)
``RMSNorm.Config``             :class:`TPUKernelsRMSNorm`        ``rms_norm`` (same ``weight``)
``FeedForward.Config``         :class:`TPUKernelsFeedForward`    ``swiglu``: ``w2(silu(w1 x) * w3 x)``
``ComplexRoPE.Config`` /       :class:`TPUKernelsComplexRoPE` /  ``rope`` (interleaved pairs / rotate-half, from
``CosSinRoPE.Config``          :class:`TPUKernelsCosSinRoPE`     torchtitan's own cos/sin cache)
``ChunkedLossWrapper.Config``  :class:`TPUKernelsLinearCrossEntropy`  ``linear_cross_entropy`` of the hidden states
                               (still a ``ChunkedLossWrapper``:  and ``lm_head.weight``: the ``[N, V]`` logits never
                               the trainer hands it ``lm_head``) exist
``SelectiveAC.Config``         :class:`TPUKernelsSelectiveAC`    saves ``tpukernels::flash_attention_fwd``'s outputs
                                                                 (else selective AC runs the attention forward twice)
=============================  ================================  =================================================

Two ways in:

* ``--override.imports`` (no code): each swap is an ``@override`` factory here, e.g.
  ``--override.imports tpukernels.integrations.torchtitan.attention,tpukernels.integrations.torchtitan.rms_norm,...``
  (:data:`OVERRIDES` lists all nine).
* :class:`TPUKernelsConverter` (a ``ModelConfigConverter``): ``llama3.model_registry("8B", converters=
  [TPUKernelsConverter.Config()])`` swaps the model's nodes and returns a report; on a model class it does not
  know (:data:`KNOWN_MODELS`) it raises, listing what it swapped and what it left, unless ``strict=False``.
  :func:`apply_to_trainer_config` also swaps the loss and the AC policy of a ``Trainer.Config``.

Config registry functions (``--module tpukernels.integrations.torchtitan --config <name>``):
``llama3_debugmodel_tpukernels`` (torchtitan's ``llama3_debugmodel`` with every swap; needs its tokenizer and
``c4_test`` assets). On hosts without them (and without an accelerator), the CPU harness in
:mod:`tpukernels.integrations.torchtitan_compat` adds synthetic assets (docs/guides/training.md, "TorchTitan").

Interpret mode: on a host without a TPU the kernels run in Pallas interpret mode (``tpukernels.interpret_mode``,
``TPUKERNELS_INTERPRET``); nothing here changes that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ArgumentError

try:  # torchtitan is an optional dependency (``pip install 'tpukernels[torchtitan]'``, ``make torchtitan``)
    from . import torchtitan_compat as _compat

    _compat.install()
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper
    from torchtitan.config import derive, override
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import (
        FlexAttention, ScaledDotProductAttention, VarlenAttention, VarlenMetadata)
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE
    from torchtitan.protocols.model import ModelConfigConverter
    from torchtitan.protocols.module import Module
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(f"tpukernels.integrations.torchtitan needs torchtitan 0.3.0 (make torchtitan): {e}") from e

__all__ = [
    "TPUKernelsAttention", "TPUKernelsCausalAttention", "TPUKernelsRMSNorm", "TPUKernelsFeedForward",
    "TPUKernelsComplexRoPE",
    "TPUKernelsCosSinRoPE", "TPUKernelsLinearCrossEntropy", "TPUKernelsSelectiveAC", "TPUKernelsConverter",
    "apply_to_trainer_config", "segment_ids_from_varlen", "OVERRIDES", "KNOWN_MODELS",
    "attention", "sdpa_attention", "rms_norm", "feed_forward", "complex_rope", "cos_sin_rope", "loss", "selective_ac",
    "llama3_debugmodel_tpukernels",
    "llama3_debugmodel_cpu_sdpa_tpukernels",
]


# ------------------------------------------------------------------------------------------ modules
def segment_ids_from_varlen(meta: VarlenMetadata, batch: int, seq_len: int) -> torch.Tensor:
    """int32 ``[B, L]`` document ids from torchtitan's packed ``cu_seq_q`` (``B * L`` tokens, one entry per
    document start plus the total): token ``t`` belongs to document ``searchsorted(cu, t, right) - 1``."""
    cu = meta.cu_seq_q.to(torch.int64)
    t = torch.arange(batch * seq_len, device=cu.device)
    return (torch.searchsorted(cu, t, right=True) - 1).to(torch.int32).reshape(batch, seq_len)


class TPUKernelsAttention(Module):
    """Inner attention on :func:`tpukernels.library.attention.flash_attention` (torchtitan's inner-attention
    contract: ``forward(q, k, v, *, attention_masks, scale=None, enable_gqa=False, out_transform=None)`` on
    ``[B, L, N, H]`` tensors, returning ``[B, L, N, H]``).

    Its config is a ``VarlenAttention.Config``, so the trainer builds ``VarlenMetadata`` (document boundaries)
    when the data carries ``positions``; those become ``q_segment_ids`` / ``kv_segment_ids``. Without masks
    it is plain causal. ``window_size = (left, right)`` keeps torchtitan's meaning (-1 = unbounded; right 0 =
    causal).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def __init__(self, config: Config):
        super().__init__()
        self.window_size = tuple(config.window_size)

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                out_transform=None, **kwargs):
        from ..library.attention import flash_attention

        b, seq, _, _ = q_BLNH.shape
        left, right = self.window_size
        seg = {}
        if attention_masks is not None:
            if not isinstance(attention_masks, VarlenMetadata):
                raise ArgumentError(f"TPUKernelsAttention: attention_masks must be VarlenMetadata or None, "
                                    f"got {type(attention_masks).__name__}")
            ids = segment_ids_from_varlen(attention_masks, b, seq)
            seg = dict(q_segment_ids=ids, kv_segment_ids=ids)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        res = flash_attention(
            q, k, v, causal=right == 0, sm_scale=scale,
            window=(None if left < 0 else left, None if right <= 0 else right),
            return_lse=out_transform is not None, **seg,
        )
        if out_transform is None:
            return res.transpose(1, 2)
        out, lse = res
        return out_transform(out.transpose(1, 2), lse.transpose(1, 2))


class TPUKernelsCausalAttention(ScaledDotProductAttention):
    """torchtitan's ``ScaledDotProductAttention`` (causal or full attention, no masks) on
    :func:`tpukernels.library.attention.flash_attention`, with context parallelism on
    :func:`tpukernels.distributed.ring_attention.ring_attention_torch`.

    Same contract as the module it replaces (``[B, L, N, H]`` in and out; ``is_causal``, ``scale``; GQA natively,
    ``enable_gqa`` is implied by the head counts). It is a ``ScaledDotProductAttention``, so torchtitan's
    ``apply_cp_to_forward`` (``--parallelism.context_parallel_degree > 1``) wraps it as it wraps SDPA: q / k / v
    arrive as DTensors ``Shard(1)`` (sequence) over the 1-D cp mesh. This module then runs the ring over that
    mesh's process group on the local shards and returns its rows as a DTensor of the same placement (torch's
    SDPA ring dispatcher, which that wrapper enables, is never reached: no SDPA op runs).

    Load balance: torchtitan's default ``context_parallel_load_balancer = "headtail"`` gives cp rank ``r`` the
    sequence chunks ``r`` and ``2 n - 1 - r`` (of ``2 n``), in that order: exactly the zigzag order
    ``ring_attention_torch(load_balance=True)`` expects (``Config.load_balance``, default True). With the load
    balancer off (``context_parallel_load_balancer = None``: contiguous shards) set ``load_balance=False``: the
    module cannot see the trainer's parallelism config, so the two must agree (gap). ``"ptrr"`` (FlexAttention
    block masks) is not supported.

    Raises:
        ArgumentError: ``attention_masks`` given; q / k / v DTensors not all ``Shard(1)`` on the same 1-D mesh.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        load_balance: bool = True
        """Under context parallelism: shards are in torchtitan's "headtail" order (True) or contiguous (False)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.load_balance = bool(config.load_balance)

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                is_causal=True, **kwargs):
        from torch.distributed.tensor import DTensor, Shard

        from ..library.attention import flash_attention

        if attention_masks is not None:
            raise ArgumentError("TPUKernelsCausalAttention: attention_masks are not supported (causal / full "
                                "attention via is_causal only, as ScaledDotProductAttention)")
        dts = [isinstance(t, DTensor) for t in (q_BLNH, k_BLNH, v_BLNH)]
        if not any(dts):
            q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
            return flash_attention(q, k, v, causal=bool(is_causal), sm_scale=scale).transpose(1, 2)
        mesh = q_BLNH.device_mesh if dts[0] else None
        if not all(dts) or mesh.ndim != 1 or any(
                t.device_mesh != mesh or tuple(t.placements) != (Shard(1),) for t in (q_BLNH, k_BLNH, v_BLNH)):
            raise ArgumentError(
                "TPUKernelsCausalAttention: under context parallelism q, k, v must all be DTensors sharded on the "
                "sequence (placements (Shard(1),)) over one 1-D cp mesh, got " + ", ".join(
                    f"{nm}: {tuple(t.placements) if isinstance(t, DTensor) else 'plain tensor'}"
                    for nm, t in (("q", q_BLNH), ("k", k_BLNH), ("v", v_BLNH))))
        from ..distributed.ring_attention import ring_attention_torch

        q, k, v = (t.to_local().transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = ring_attention_torch(q, k, v, mesh, causal=bool(is_causal), sm_scale=scale,
                                   load_balance=self.load_balance)
        return DTensor.from_local(out.transpose(1, 2), mesh, (Shard(1),), run_check=False)


class TPUKernelsRMSNorm(RMSNorm):
    """torchtitan ``RMSNorm`` (``nn.RMSNorm``) on :func:`tpukernels.library.rms_norm` (same ``weight``,
    ``eps``; torch's ``eps=None`` means ``finfo(x.dtype).eps``, as ``nn.RMSNorm``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def forward(self, x):
        from ..library.norms import rms_norm

        if len(self.normalized_shape) != 1:
            raise ArgumentError(f"TPUKernelsRMSNorm: normalizes over the last dim only, got normalized_shape="
                                f"{tuple(self.normalized_shape)}")
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps)


class TPUKernelsFeedForward(FeedForward):
    """torchtitan ``FeedForward`` (SwiGLU, ``w2(silu(w1 x) * w3 x)``) with the fused ``silu(gate) * up``."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def forward(self, x):
        from ..library.gated_mlp import swiglu

        return self.w2(swiglu(self.w1(x), self.w3(x)))


def _rope_tables(self, query, positions):
    """``(cos, sin)`` ``[1 or B, L, D]`` per lane from the module's cache, gathered at ``positions``."""
    seq = query.shape[1]
    rows = self.cache.shape[0]
    if positions is None:
        if seq > rows:
            raise ArgumentError(f"{type(self).__name__}: sequence length {seq} is beyond the RoPE cache "
                                f"(max_seq_len = {rows})")
        idx = torch.arange(seq, device=self.cache.device)[None]
    else:
        idx = positions.reshape(-1, seq).long()
        if not torch.compiler.is_compiling() and idx.numel() and (int(idx.max()) >= rows or int(idx.min()) < 0):
            raise ArgumentError(f"{type(self).__name__}: positions beyond the RoPE cache: span "
                                f"[{int(idx.min())}, {int(idx.max())}], cache has max_seq_len = {rows}")
    return self._tables(self.cache[idx])


class TPUKernelsComplexRoPE(ComplexRoPE):
    """torchtitan ``ComplexRoPE`` (adjacent-lane pairs rotated by ``cis`` values: the GPT-J / interleaved
    layout) on :func:`tpukernels.library.rope.apply_rope` with ``interleaved=True``; same cache buffer."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass

    @staticmethod
    def _tables(cis):
        return cis.real.repeat_interleave(2, -1), cis.imag.repeat_interleave(2, -1)

    def forward(self, query, key, positions=None):
        from ..library.rope import apply_rope

        cos, sin = _rope_tables(self, query, positions)
        return (apply_rope(query, cos, sin, interleaved=True, seq_dim=1),
                apply_rope(key, cos, sin, interleaved=True, seq_dim=1))


class TPUKernelsCosSinRoPE(CosSinRoPE):
    """torchtitan ``CosSinRoPE`` (rotate-half, ``cat(cos, sin)`` cache) on ``apply_rope(interleaved=False)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    @staticmethod
    def _tables(cache):
        d = cache.shape[-1] // 2
        return cache[..., :d], cache[..., d:]

    def forward(self, query, key, positions=None):
        from ..library.rope import apply_rope

        cos, sin = _rope_tables(self, query, positions)
        return apply_rope(query, cos, sin, seq_dim=1), apply_rope(key, cos, sin, seq_dim=1)


class TPUKernelsLinearCrossEntropy(ChunkedLossWrapper):
    """The LM head and its cross-entropy in one op, :func:`tpukernels.library.linear_cross_entropy`.

    A ``ChunkedLossWrapper`` subclass, so the trainer hands it ``lm_head`` and makes the model return the
    final hidden states. The loss is ``sum`` over non-ignored tokens divided by ``global_valid_tokens``
    (torchtitan's convention, ``IGNORE_INDEX`` = -100). The call goes through ``lm_head``'s own ``__call__``
    (its forward swapped for the fused loss for that call), so FSDP2's hooks unshard the weight and
    reduce-scatter its gradient as they do for the stock head.

    Raises:
        ArgumentError: an ``lm_head`` with a bias, or a tensor-parallel (DTensor) ``lm_head.weight`` (the fused
            loss needs the full vocabulary on each rank; use the stock loss with loss parallelism).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        pass

    def __init__(self, config: Config, *, compile_config=None):
        super().__init__(config, compile_config=compile_config)

    def set_lm_head(self, lm_head) -> None:
        if getattr(lm_head, "bias", None) is not None:
            raise ArgumentError("TPUKernelsLinearCrossEntropy: lm_head has a bias; linear_cross_entropy takes "
                                "h @ W.T only")
        super().set_lm_head(lm_head)

    def __call__(self, pred, labels, global_valid_tokens=None, **loss_inputs):
        from torch.distributed.tensor import DTensor

        from ..library.linear_cross_entropy_ops import linear_cross_entropy

        head = self.lm_head
        assert head is not None, "the trainer sets lm_head before the first call"
        if isinstance(pred, DTensor):
            raise ArgumentError("TPUKernelsLinearCrossEntropy: hidden states are a DTensor (tensor / context "
                                "parallel); the fused loss takes local tensors")

        def fused(h, y):
            w = head.weight
            if isinstance(w, DTensor) and any(not p.is_replicate() for p in w.placements):
                raise ArgumentError(
                    f"TPUKernelsLinearCrossEntropy: lm_head.weight is sharded ({w.placements}) across the vocabulary "
                    f"(tensor parallelism); the fused loss needs the whole [V, H] weight on each rank")
            if isinstance(w, DTensor):
                w = w.to_local()
            return linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, y.reshape(-1),
                                        ignore_index=IGNORE_INDEX, reduction="sum")

        head.forward = fused  # instance attribute: this call only (FSDP2 hooks run around it)
        try:
            loss = head(pred, labels)
        finally:
            del head.forward
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}


class TPUKernelsSelectiveAC(SelectiveAC):
    """Selective activation checkpointing that also saves the tpukernels attention forward (``(out, lse)`` of
    ``tpukernels::flash_attention_fwd``): without it the recompute pass runs the attention kernel again."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        import tpukernels.library.attention  # noqa: F401  (registers the op)

        return SelectiveAC.get_save_ops(self) | {torch.ops.tpukernels.flash_attention_fwd.default}


# ------------------------------------------------------------------------------------------ overrides
def _attention_config(cfg):
    window = tuple(getattr(cfg, "window_size", (-1, 0)))
    return TPUKernelsAttention.Config(window_size=window)


@override(target=FlexAttention.Config, description="tpukernels flash attention (document masks as segment ids)")
def attention(cfg):
    """Flex inner attention -> :class:`TPUKernelsAttention` (causal + documents, as llama3's flex masks)."""
    return _attention_config(cfg)


@override(target=VarlenAttention.Config, description="tpukernels flash attention (varlen documents)")
def varlen_attention(cfg):
    """Varlen inner attention -> :class:`TPUKernelsAttention` (same ``window_size``)."""
    return cfg if isinstance(cfg, TPUKernelsAttention.Config) else _attention_config(cfg)


@override(target=ScaledDotProductAttention.Config, exact=True,
          description="tpukernels flash attention (ring attention under context parallelism)")
def sdpa_attention(cfg):
    """SDPA inner attention -> :class:`TPUKernelsCausalAttention`."""
    return derive(cfg, TPUKernelsCausalAttention.Config)


@override(target=RMSNorm.Config, exact=True, description="tpukernels rms_norm")
def rms_norm(cfg):
    return derive(cfg, TPUKernelsRMSNorm.Config)


@override(target=FeedForward.Config, exact=True, description="tpukernels fused SwiGLU")
def feed_forward(cfg):
    return derive(cfg, TPUKernelsFeedForward.Config)


@override(target=ComplexRoPE.Config, exact=True, description="tpukernels rope (interleaved)")
def complex_rope(cfg):
    return derive(cfg, TPUKernelsComplexRoPE.Config)


@override(target=CosSinRoPE.Config, exact=True, description="tpukernels rope (rotate-half)")
def cos_sin_rope(cfg):
    return derive(cfg, TPUKernelsCosSinRoPE.Config)


@override(target=ChunkedLossWrapper.Config, exact=True, description="tpukernels linear_cross_entropy")
def loss(cfg):
    return derive(cfg, TPUKernelsLinearCrossEntropy.Config)


@override(target=SelectiveAC.Config, exact=True, description="selective AC saving the tpukernels attention")
def selective_ac(cfg):
    return derive(cfg, TPUKernelsSelectiveAC.Config)


#: ``--override.imports`` value enabling every swap.
OVERRIDES = ",".join(f"{__name__}.{f}" for f in (
    "attention", "varlen_attention", "sdpa_attention", "rms_norm", "feed_forward", "complex_rope", "cos_sin_rope",
    "loss",
    "selective_ac"))


# ------------------------------------------------------------------------------------------ converter
#: Model config classes whose every attention / norm / MLP / RoPE node the converter knows how to swap.
KNOWN_MODELS: tuple[str, ...] = ("torchtitan.models.llama3.model.Llama3Model.Config",)

_MODEL_SWAPS = [  # (config class, exact type only?, factory)
    (FlexAttention.Config, False, _attention_config),
    (VarlenAttention.Config, False, lambda c: c if isinstance(c, TPUKernelsAttention.Config) else _attention_config(c)),
    (ScaledDotProductAttention.Config, True, lambda c: derive(c, TPUKernelsCausalAttention.Config)),
    (RMSNorm.Config, True, lambda c: derive(c, TPUKernelsRMSNorm.Config)),
    (FeedForward.Config, True, lambda c: derive(c, TPUKernelsFeedForward.Config)),
    (ComplexRoPE.Config, True, lambda c: derive(c, TPUKernelsComplexRoPE.Config)),
    (CosSinRoPE.Config, True, lambda c: derive(c, TPUKernelsCosSinRoPE.Config)),
]


def _qualname(obj) -> str:
    t = obj if isinstance(obj, type) else type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _leaf_kinds():
    """Config classes that carry compute a tpukernels op could replace but this converter does not (reported
    as "left"): other norms, other MLPs / MoE, other attentions and RoPEs."""
    from torchtitan.models.common import attention as A
    from torchtitan.models.common import nn_modules as NM
    from torchtitan.models.common import rope as R

    kinds = [NM.LayerNorm.Config, NM.RMSNorm.Config, FeedForward.Config, R.RoPE.Config, A.BaseAttention.Config,
             A.ScaledDotProductAttention.Config, FlexAttention.Config, VarlenAttention.Config]
    try:
        from torchtitan.models.common.moe import MoE

        kinds.append(MoE.Config)
    except ImportError:  # pragma: no cover
        pass
    return tuple(kinds)


class TPUKernelsConverter(ModelConfigConverter):
    """``ModelConfigConverter`` swapping a torchtitan model config's attention, RMSNorm, SwiGLU feed-forward and
    RoPE nodes for the tpukernels modules (table in the module docstring).

    ``convert`` records ``self.report = {"swapped": [fqn: old -> new], "left": [fqn: class]}``. On a model whose
    config class is not in :data:`KNOWN_MODELS` (or any model, when something is left), it raises
    :class:`tpukernels.errors.ArgumentError` listing both, before anything is built, unless ``strict=False``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        attention: bool = True
        rms_norm: bool = True
        feed_forward: bool = True
        rope: bool = True
        strict: bool = True
        """Raise on a model class not in KNOWN_MODELS, or when a swappable kind of node was left."""

    def __init__(self, config: Config):
        self.config = config
        self.report: dict[str, list[str]] = {"swapped": [], "left": []}

    def convert(self, model_config):
        cfg = self.config
        enabled = {FlexAttention.Config: cfg.attention, VarlenAttention.Config: cfg.attention,
                   ScaledDotProductAttention.Config: cfg.attention,
                   RMSNorm.Config: cfg.rms_norm, FeedForward.Config: cfg.feed_forward,
                   ComplexRoPE.Config: cfg.rope, CosSinRoPE.Config: cfg.rope}
        plan, swapped_ids = [], set()
        for cls, exact, factory in _MODEL_SWAPS:
            if not enabled[cls]:
                continue
            for fqn, node, parent, attr in model_config.traverse(cls, recurse=True):
                if (exact and type(node) is not cls) or parent is None or isinstance(node, (
                        TPUKernelsAttention.Config, TPUKernelsCausalAttention.Config, TPUKernelsRMSNorm.Config,
                        TPUKernelsFeedForward.Config,
                        TPUKernelsComplexRoPE.Config, TPUKernelsCosSinRoPE.Config)):
                    continue
                plan.append((fqn, node, parent, attr, factory))
                swapped_ids.add(id(node))
        left = []
        for fqn, node, _, _ in model_config.traverse(_leaf_kinds(), recurse=True):
            kernel_cls = (TPUKernelsAttention.Config, TPUKernelsCausalAttention.Config, TPUKernelsRMSNorm.Config,
                          TPUKernelsFeedForward.Config,
                          TPUKernelsComplexRoPE.Config, TPUKernelsCosSinRoPE.Config)
            from torchtitan.models.common.attention import BaseAttention

            if id(node) in swapped_ids or isinstance(node, kernel_cls) or isinstance(node, BaseAttention.Config):
                continue  # containers (GQAttention) hold the swapped parts
            left.append(f"{fqn}: {type(node).__qualname__}")
        swapped = [f"{fqn}: {type(node).__qualname__} -> {type(factory(node)).__qualname__}"
                   for fqn, node, _, _, factory in plan]
        self.report = {"swapped": swapped, "left": left}
        known = _qualname(model_config) in KNOWN_MODELS
        if cfg.strict and (not known or left):
            why = (f"model config {_qualname(model_config)} is not one it knows ({', '.join(KNOWN_MODELS)})"
                   if not known else "some kernel-relevant nodes have no tpukernels replacement")
            raise ArgumentError(
                f"TPUKernelsConverter: {why}; nothing was changed. It would swap {len(swapped)} node(s): "
                f"{_short(swapped)}; and leave {len(left)}: {_short(left)}. Pass strict=False to convert anyway.")
        for fqn, node, parent, attr, factory in plan:
            new = factory(node)
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config


def _short(items: list[str], n: int = 12) -> str:
    if not items:
        return "(none)"
    return "; ".join(items[:n]) + (f"; ... ({len(items) - n} more)" if len(items) > n else "")


def apply_to_trainer_config(config, *, loss: bool = True, selective_ac: bool = True, **converter_options):
    """Swap a ``Trainer.Config`` in place: the model (:class:`TPUKernelsConverter`), the loss (a stock
    ``ChunkedLossWrapper`` -> :class:`TPUKernelsLinearCrossEntropy`) and selective AC
    (:class:`TPUKernelsSelectiveAC`). Returns the converter's report (plus ``"loss"`` / ``"activation_checkpoint"``)."""
    conv = TPUKernelsConverter.Config(**converter_options).build()
    spec = config.model_spec
    spec.model = conv.convert(spec.model)
    report = dict(conv.report)
    if loss and type(config.loss) is ChunkedLossWrapper.Config:
        config.loss = derive(config.loss, TPUKernelsLinearCrossEntropy.Config)
        report["loss"] = "ChunkedLossWrapper -> TPUKernelsLinearCrossEntropy"
    if selective_ac and type(config.activation_checkpoint) is SelectiveAC.Config:
        config.activation_checkpoint = derive(config.activation_checkpoint, TPUKernelsSelectiveAC.Config)
        report["activation_checkpoint"] = "SelectiveAC -> TPUKernelsSelectiveAC"
    return report


# ------------------------------------------------------------------------------------------ config registry
def llama3_debugmodel_cpu_tpukernels():
    """:func:`torchtitan_compat.llama3_debugmodel_cpu` (CPU, synthetic assets) with every tpukernels swap
    (attention, RMSNorm, SwiGLU, RoPE, fused loss, selective-AC save list), through :func:`apply_to_trainer_config`
    (``--module tpukernels.integrations.torchtitan --config llama3_debugmodel_cpu_tpukernels``)."""
    config = _compat.llama3_debugmodel_cpu()
    apply_to_trainer_config(config)
    return config


def llama3_debugmodel_cpu_sdpa_tpukernels():
    """:func:`torchtitan_compat.llama3_debugmodel_cpu_sdpa` (plain causal SDPA; the reference for context
    parallelism) with every tpukernels swap: its inner attention becomes :class:`TPUKernelsCausalAttention`."""
    config = _compat.llama3_debugmodel_cpu_sdpa()
    apply_to_trainer_config(config)
    return config


def llama3_debugmodel_tpukernels():
    """torchtitan's ``llama3_debugmodel`` Trainer config with every tpukernels swap
    (``--module tpukernels.integrations.torchtitan --config llama3_debugmodel_tpukernels``)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    apply_to_trainer_config(config)
    return config
