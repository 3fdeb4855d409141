"""Hugging Face ``save_pretrained`` / ``from_pretrained`` of tpukernels-quantized models.

A model quantized with ``apply_tpukernels(model, quantize=...)`` holds :class:`TPUQuantLinear` modules whose
state is ``w_q [out, in]`` (int8 / fp8), ``w_scale [out]`` float32 and an optional ``bias``. Stock transformers
does not know these names: a checkpoint saved without a quantization config reloads as a float model whose
``nn.Linear`` weights are missing, i.e. randomly initialised, with only a log line (silent data loss).

This module registers, on import, a transformers quantization method ``"tpukernels"`` (transformers'
``register_quantization_config`` / ``register_quantizer``, the extension points its own quantizers use):

* :class:`TpuKernelsConfig` (``quant_method="tpukernels"``): ``weight_dtype``, ``x_quant`` and ``modules`` (the
  dotted names of the quantized linears). ``apply_tpukernels(quantize=...)`` sets it as
  ``model.config.quantization_config``, so ``save_pretrained`` writes it into ``config.json`` and the tensors
  ``<module>.w_q`` / ``<module>.w_scale`` / ``<module>.bias`` into the safetensors file as they are (no cast).
* :class:`TpuKernelsHfQuantizer`: on ``from_pretrained`` of such a checkpoint, replaces exactly those
  ``nn.Linear`` modules with empty :class:`TPUQuantLinear` ones before the weights load (their buffers keep
  their int8 / fp8 / float32 dtypes: transformers loads a tensor in its module's dtype), so the reloaded
  ``w_q``, ``w_scale`` and ``bias`` are bit-identical to the saved ones whatever ``dtype=`` the load asks for;
  after loading it checks that every one of them came from the checkpoint and raises
  :class:`~tpukernels.errors.ArgumentError` naming the tensor otherwise (never a random weight).

Quantized MoE experts (:func:`tpukernels.integrations.moe.quantize_moe_experts`) ride on the same config: its
optional ``experts`` field maps each quantized experts module's dotted name to its scheme ``{"dtype", "block_size",
"asymmetric"}`` (the arguments of ``quantize_moe_experts``), from which the stored layout follows (the buffers
``gate_up_proj_q`` / ``down_proj_q`` ``[E, N, K]`` (``[E, N, K/2]`` uint8 for 4-bit), ``*_scale [E, num_blocks, 1, N]``
float32, ``*_zero_point`` (asymmetric int4), ``num_blocks = K / block_size`` or 1). On ``from_pretrained`` the
quantizer swaps exactly those modules' float ``gate_up_proj`` / ``down_proj`` parameters for empty buffers of those
shapes and dtypes before the weights load and routes the modules through ``grouped_matmul_quantized``
(``config._experts_implementation = "tpukernels"``), so they reload bit-identical whatever ``dtype=`` the load
asks for, and a missing tensor raises :class:`~tpukernels.errors.ArgumentError` naming it. A config without
``experts`` (every checkpoint written before this field existed) loads as before; a tpukernels without it rejects
the field by name (an unknown key) rather than loading float experts. One config may hold quantized linears
(``modules``) and quantized experts (``experts``) together.

Loading needs this registration: import ``tpukernels.integrations.transformers`` (which imports this module)
or this module before ``from_pretrained``. Without it transformers 5.x logs "Unknown quantization type" and
loads the float model with random linears — the behaviour this module exists to prevent, which no code of
ours can intercept. Quantizing a float checkpoint during ``from_pretrained`` (``quantization_config=
TpuKernelsConfig(...)`` on an unquantized checkpoint) is not supported: load, then ``apply_tpukernels``.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          register_quantization_config, register_quantizer)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..errors import ArgumentError
from .moe_experts import expert_buffers, prepare_quantized_experts, route_quantized_experts

QUANT_METHOD = "tpukernels"
#: the fields of a ``"tpukernels"`` quantization config (``config.json``); any other key raises
CONFIG_KEYS = ("quant_method", "weight_dtype", "x_quant", "modules", "format_version", "experts")
#: the fields of one entry of ``experts`` (the arguments of ``quantize_moe_experts``)
EXPERT_KEYS = ("dtype", "block_size", "asymmetric")
EXPERT_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2", "int4", "fp4")
FORMAT_VERSION = 1


class TpuKernelsConfig(QuantizationConfigMixin):
    """``quantization_config`` of a model whose listed linears are :class:`TPUQuantLinear` (module docstring).

    Args:
        weight_dtype: ``"int8"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"`` (``w_q``'s dtype).
        x_quant: None (w8a16), ``"int8"`` or ``"fp8"`` (w8a8), as in ``quantized_matmul``.
        modules: dotted module names (``"model.layers.0.mlp.up_proj"``) of the quantized linears.
        format_version: layout version of the saved tensors (1: ``w_q [out, in]``, ``w_scale [out]``).
        experts: ``{module name: {"dtype", "block_size", "asymmetric"}}`` of the experts modules quantized by
            :func:`~tpukernels.integrations.moe.quantize_moe_experts` (module docstring); omitted from
            ``config.json`` when empty.

    Raises:
        ArgumentError: an unknown key (named), a format version other than 1, ``modules`` not a list of
            names, an ``experts`` entry with an unknown key, a block size not a multiple of 32 in 32..512, 4-bit
            without a block size, ``asymmetric`` other than int4 with block scales.
        DTypeError: an unknown ``weight_dtype``, ``x_quant`` / weight mismatch, an unknown experts ``dtype``, fp8
            experts with block scales.
    """

    def __init__(self, weight_dtype: str = "int8", x_quant: Optional[str] = None, modules=(),
                 format_version: int = FORMAT_VERSION, experts=None, **kwargs):
        from ..library.quantized_matmul_ops import canon_x_quant, weight_dtype_name, check_pair

        kwargs.pop("quant_method", None)
        if kwargs:
            raise ArgumentError(f"quantization_config (quant_method={QUANT_METHOD!r}): unknown key "
                                f"{sorted(kwargs)[0]!r}; the keys are {CONFIG_KEYS}")
        if format_version != FORMAT_VERSION:
            raise ArgumentError(f"quantization_config (quant_method={QUANT_METHOD!r}): format_version "
                                f"{format_version!r} is not supported (this tpukernels reads {FORMAT_VERSION})")
        if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
            raise ArgumentError(f"quantization_config (quant_method={QUANT_METHOD!r}): modules must be a list of "
                                f"module names, got {modules!r}")
        self.quant_method = QUANT_METHOD
        self.weight_dtype = weight_dtype_name(weight_dtype, "quantization_config.weight_dtype")
        self.x_quant = canon_x_quant(x_quant)
        check_pair(self.x_quant, self.weight_dtype, "quantization_config")
        self.modules = list(modules)
        self.format_version = FORMAT_VERSION
        self.experts = _check_experts(experts)

    def to_dict(self) -> dict:
        d = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in self.__dict__.items()}
        if not d.get("experts"):
            d.pop("experts", None)  # a linears-only config is written exactly as before the field existed
        else:
            d["experts"] = {k: dict(v) for k, v in d["experts"].items()}
        return d


def _check_experts(experts) -> dict:
    """``experts`` of a :class:`TpuKernelsConfig`, checked and canonical (``{name: {dtype, block_size,
    asymmetric}}``)."""
    from ..errors import DTypeError
    from ..library.quantized_matmul_ops.blockwise import BLOCK_SIZES

    where = f"quantization_config (quant_method={QUANT_METHOD!r}).experts"
    if experts is None:
        return {}
    if not isinstance(experts, dict):
        raise ArgumentError(f"{where} must map experts module names to their schemes, got {experts!r}")
    out = {}
    for name, spec in experts.items():
        if not isinstance(name, str) or not isinstance(spec, dict):
            raise ArgumentError(f"{where}: entry {name!r}: {spec!r} is not a module name with a scheme dict")
        extra = sorted(set(spec) - set(EXPERT_KEYS))
        if extra:
            raise ArgumentError(f"{where}[{name!r}]: unknown key {extra[0]!r}; the keys are {EXPERT_KEYS}")
        dtype, bs, asym = spec.get("dtype"), spec.get("block_size"), spec.get("asymmetric", False)
        if dtype not in EXPERT_DTYPES:
            raise DTypeError(f"{where}[{name!r}].dtype {dtype!r} is not one of {EXPERT_DTYPES}")
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs not in BLOCK_SIZES):
            raise ArgumentError(f"{where}[{name!r}].block_size {bs!r} is not None or a multiple of 32 in 32..512")
        if bs is None and dtype in ("int4", "fp4"):
            raise ArgumentError(f"{where}[{name!r}]: {dtype} experts need a block_size (block scales along K)")
        if bs is not None and dtype.startswith("float8"):
            raise DTypeError(f"{where}[{name!r}]: {dtype} experts take per-channel scales only (block_size None)")
        if not isinstance(asym, bool) or (asym and (dtype != "int4" or bs is None)):
            raise ArgumentError(f"{where}[{name!r}].asymmetric {asym!r}: zero points are for int4 with block scales")
        out[name] = {"dtype": dtype, "block_size": bs, "asymmetric": asym}
    return out


class TpuKernelsHfQuantizer(HfQuantizer):
    """transformers quantizer for :class:`TpuKernelsConfig` checkpoints (module docstring)."""

    requires_calibration = True  # pre-quantized checkpoints only (transformers raises for pre_quantized=False)

    def validate_environment(self, *args, **kwargs):
        if not self.pre_quantized:
            raise ArgumentError(f"from_pretrained(quantization_config={QUANT_METHOD!r}): only tpukernels-quantized "
                                f"checkpoints load this way; load the float model, then apply_tpukernels(quantize=...)")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from ..library.quantized_matmul_ops import TPUQuantLinear

        cfg = self.quantization_config
        prepare_quantized_experts(model, cfg.experts)
        for name in cfg.modules:
            parent_name, _, child_name = name.rpartition(".")
            try:
                parent = model.get_submodule(parent_name) if parent_name else model
                child = getattr(parent, child_name)
            except AttributeError:
                child = None
            if type(child) is not torch.nn.Linear:
                raise ArgumentError(f"quantization_config.modules: {name!r} is not an nn.Linear of this "
                                    f"{type(model).__name__} (got {type(child).__name__}); the checkpoint does not "
                                    f"match the model's architecture")
            with torch.device(child.weight.device):
                new = TPUQuantLinear(child.in_features, child.out_features, child.bias is not None,
                                     cfg.weight_dtype, cfg.x_quant)
                if child.bias is not None:
                    new.bias = torch.zeros(child.out_features, dtype=child.bias.dtype)
            setattr(parent, child_name, new)
        self._expected = expected_buffers(model, cfg)
        check_quantized_headers(self._expected, checkpoint_files or ())
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        # every tensor transformers loaded is marked _is_hf_initialized (core_model_loading.set_param_for_module);
        # a buffer the checkpoint lacked was materialised from the meta device uninitialised: refuse it
        for name in self.quantization_config.modules:
            mod = model.get_submodule(name)
            for t in ("w_q", "w_scale", "bias"):
                buf = getattr(mod, t, None)
                if buf is not None and not getattr(buf, "_is_hf_initialized", False):
                    raise ArgumentError(f"from_pretrained: the checkpoint has no tensor {name}.{t} "
                                        f"(quantization_config lists {name!r} as quantized); refusing to leave it "
                                        f"uninitialised")
        for name in self.quantization_config.experts:
            mod = model.get_submodule(name)
            for proj in ("gate_up_proj", "down_proj"):
                for t in ("_q", "_scale", "_zero_point"):
                    buf = getattr(mod, proj + t, None)
                    if buf is not None and not getattr(buf, "_is_hf_initialized", False):
                        raise ArgumentError(f"from_pretrained: the checkpoint has no tensor {name}.{proj}{t} "
                                            f"(quantization_config.experts lists {name!r} as quantized); refusing "
                                            f"to leave it uninitialised")
        check_loaded_buffers(model, self._expected)  # recorded before loading, from the empty buffers
        route_quantized_experts(model, list(self.quantization_config.experts))
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        # w8a16 is differentiable in the activations (adapters on a frozen quantized base); w8a8 is not
        return self.quantization_config.x_quant is None


#: safetensors' header dtype names of the dtypes a tpukernels checkpoint holds
_ST_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F16": torch.float16,
              "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fits(shape, dtype, want) -> bool:
    wshape, is_bias, wdtype = want
    return tuple(shape) == wshape and (dtype in (torch.float16, torch.bfloat16, torch.float32) if is_bias
                                       else dtype == wdtype)


def _expect(want) -> str:
    return f"{'a float dtype' if want[1] else _name(want[2])} {list(want[0])}"


def expected_buffers(model, cfg: "TpuKernelsConfig") -> dict:
    """``{"<module>.<buffer>": (shape, is_bias, dtype)}`` of the quantized modules ``cfg`` lists (their empty
    buffers, as :class:`TpuKernelsHfQuantizer` built them before the weights load)."""
    want = {}
    for name in [*cfg.modules, *cfg.experts]:
        mod = model.get_submodule(name)
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is not None and bname != "in_perm":
                want[f"{name}.{bname}"] = (tuple(buf.shape), bname == "bias", buf.dtype)
    return want


def check_loaded_buffers(model, want: dict) -> None:
    """After the weights load: each quantized buffer still has its shape and dtype (transformers puts a checkpoint
    tensor of another integer dtype in the buffer's place as it is, e.g. an int32 ``w_q``).

    Raises:
        ArgumentError: naming ``<module>.<tensor>``, what it holds and what the format needs.
    """
    for key, w in want.items():
        buf = model.get_buffer(key)
        if buf is not None and not _fits(buf.shape, buf.dtype, w):
            raise ArgumentError(f"from_pretrained: the checkpoint's {key} is {_name(buf.dtype)} {list(buf.shape)}, "
                                f"expected {_expect(w)} (quantization_config quant_method={QUANT_METHOD!r})")


def check_quantized_headers(want: dict, checkpoint_files) -> None:
    """Before the weights load: every quantized tensor a ``*.safetensors`` checkpoint file holds under the name of a
    buffer in ``want`` (:func:`expected_buffers`) has exactly that shape and dtype (a bias: its shape, a float
    dtype). Reads the files' headers only (safetensors' ``safe_open``); ``.bin`` files, and keys that transformers
    renames on load (e.g. Mixtral's ``block_sparse_moe``), are left to :func:`check_loaded_buffers` after loading
    (where a size mismatch is transformers' own RuntimeError first). A tensor missing altogether is refused after
    loading.

    Raises:
        ArgumentError: naming ``<module>.<tensor>``, its shape / dtype and the expected ones, or a file whose header
            does not parse.
    """
    from safetensors import safe_open

    for f in checkpoint_files:
        if not str(f).endswith(".safetensors"):
            continue
        try:
            with safe_open(str(f), "pt") as fh:
                for key in fh.keys():
                    if key not in want:
                        continue
                    sl = fh.get_slice(key)
                    shape, got = tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())
                    if not _fits(shape, got, want[key]):
                        raise ArgumentError(f"from_pretrained: {key} in {str(f)!r} is {_name(got)} {list(shape)}, "
                                            f"expected {_expect(want[key])} (quantization_config "
                                            f"quant_method={QUANT_METHOD!r})")
        except ArgumentError:
            raise
        except Exception as e:  # safetensors' SafetensorError: a truncated / corrupt file
            raise ArgumentError(f"from_pretrained: {str(f)!r} is not a valid safetensors file "
                                f"({type(e).__name__}: {e})") from e


def register() -> None:
    """Register ``"tpukernels"`` with transformers' quantizer registry (idempotent; done on import)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not TpuKernelsConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)  # a reload of this module
        register_quantization_config(QUANT_METHOD)(TpuKernelsConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not TpuKernelsHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(TpuKernelsHfQuantizer)


def _previous(model, weight_dtype: str, x_quant: Optional[str]) -> list:
    """Module names of an earlier tpukernels quantization of ``model`` (``[]``: none); the errors of
    :func:`mark_quantized`."""
    old = getattr(getattr(model, "config", None), "quantization_config", None)
    if old is None:
        return []
    if not isinstance(old, TpuKernelsConfig):
        raise ArgumentError(f"apply_tpukernels(quantize=...): the model already has a quantization_config "
                            f"(quant_method={getattr(old, 'quant_method', old)!r}); quantizing it again is not "
                            f"supported")
    if not old.modules:  # only quantized experts so far: the linears' scheme is free
        return []
    if (old.weight_dtype, old.x_quant) != (weight_dtype, x_quant):
        raise ArgumentError(f"apply_tpukernels(quantize={weight_dtype!r}, x_quant={x_quant!r}): the model is already "
                            f"quantized with weight_dtype={old.weight_dtype!r}, x_quant={old.x_quant!r}; one "
                            f"quantization_config describes one scheme")
    return list(old.modules)


def check_can_mark(model, weight_dtype: str, x_quant: Optional[str]) -> None:
    """Raise what :func:`mark_quantized` would, before ``apply_tpukernels`` patches anything."""
    _previous(model, weight_dtype, x_quant)


def mark_quantized(model, weight_dtype: str, x_quant: Optional[str], modules) -> None:
    """Record ``model``'s quantized linears as its ``config.quantization_config`` (what ``save_pretrained``
    writes into ``config.json``). Called by ``apply_tpukernels(quantize=...)``; modules quantized by an earlier
    call are kept in the list. Nothing else of the model changes (transformers' ``is_quantized`` flag, which
    forbids ``.half()`` / ``.float()``, is set only by a quantized ``from_pretrained``, as for its own methods).
    A model without ``config`` (not a transformers model) is left as is.

    Raises:
        ArgumentError: the model already has another quantization config, or a tpukernels one of another
            ``weight_dtype`` / ``x_quant`` (one config describes one scheme).
    """
    if getattr(model, "config", None) is None:
        return
    prev = _previous(model, weight_dtype, x_quant)
    old = getattr(model.config, "quantization_config", None)
    model.config.quantization_config = TpuKernelsConfig(weight_dtype, x_quant, list(dict.fromkeys([*prev, *modules])),
                                                        experts=old.experts if old is not None else None)


def check_can_mark_experts(model) -> None:
    """Raise what :func:`mark_experts_quantized` would, before ``quantize_moe_experts`` touches anything."""
    old = getattr(getattr(model, "config", None), "quantization_config", None)
    if old is not None and not isinstance(old, TpuKernelsConfig):
        raise ArgumentError(f"quantize_moe_experts: the model already has a quantization_config "
                            f"(quant_method={getattr(old, 'quant_method', old)!r}); quantizing it again is not "
                            f"supported")


def mark_experts_quantized(model, experts: dict) -> None:
    """Record quantized experts modules (``{name: {"dtype", "block_size", "asymmetric"}}``) in ``model``'s
    ``config.quantization_config`` (created, or the tpukernels one extended: quantized linears stay listed).
    Called by ``quantize_moe_experts``; a model without ``config`` is left as is.

    Raises:
        ArgumentError: the model already has another method's quantization config.
    """
    if getattr(model, "config", None) is None:
        return
    check_can_mark_experts(model)
    old = getattr(model.config, "quantization_config", None)
    if old is None:
        model.config.quantization_config = TpuKernelsConfig(experts=experts)
    else:
        old.experts = _check_experts({**old.experts, **experts})


class _LoadedCheckpoint(HfQuantizer):
    """Attached to models that :mod:`tpukernels.integrations.checkpoints` loaded: not serializable, so
    transformers' ``save_pretrained`` raises instead of writing tensors no loader would read back."""

    def is_serializable(self, *args, **kwargs) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def refuse_saving(model, quantization_config) -> None:
    """Make ``model.save_pretrained`` raise ValueError (a model loaded from a GPTQ / AWQ / compressed-tensors /
    fp8 checkpoint into tpukernels modules: its ``config.quantization_config`` is kept for reference)."""
    from types import SimpleNamespace

    qc = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else dict(quantization_config)
    model.config.quantization_config = qc
    model.hf_quantizer = _LoadedCheckpoint(SimpleNamespace(quant_method=f"{qc.get('quant_method')} (loaded into "
                                                                        f"tpukernels modules)"), pre_quantized=True)


register()

__all__ = ["TpuKernelsConfig", "TpuKernelsHfQuantizer", "register", "mark_quantized", "mark_experts_quantized",
           "QUANT_METHOD"]
