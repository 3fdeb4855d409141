"""Load quantized Hugging Face checkpoints into tpukernels' quantized matmuls: GPTQ and AWQ int4, compressed-tensors
(W4A16 pack-quantized, W8A8 int8 / fp8, fp8 block), and fp8 block-scaled (``weight_scale_inv``, DeepSeek-V3).

Why a loader of our own and not a ``from_pretrained`` hook: transformers (5.24) dispatches these
``quantization_config``s (``quant_method`` ``"gptq"``, ``"awq"``, ``"compressed-tensors"``, ``"fp8"``) to its own
quantizers, which on a host without their optional packages and without a GPU refuse them (GPTQ: ImportError
"requires optimum"; AWQ: ImportError for gptqmodel; compressed-tensors: ImportError for compressed-tensors) or
dequantize them to bf16 (fp8 on CPU, with accelerate) — none keeps the quantized weights; and the methods are
already registered, so a second quantizer cannot take their names. :func:`from_pretrained` therefore reads the
``quantization_config`` itself (:func:`parse_quantization_config`: a typed error naming the key it does not
support), lets transformers load the model without it (every float tensor: embeddings, norms, the unquantized
``lm_head``; the quantized linears' ``weight`` is reported missing), then replaces each quantized ``nn.Linear`` by
a tpukernels module built from the checkpoint's tensors, repacked once into the kernels' layouts:

Formats (checkpoint tensors of linear ``p`` with ``K`` in and ``N`` out features -> tpukernels module):

* GPTQ 4-bit (``checkpoint_format`` ``"gptq"``, which stores zeros minus one, or ``"gptq_v2"``): ``qweight
  [K/8, N]`` int32 (8 nibbles along K, nibble ``i`` = row ``8r + i``), ``qzeros [G, N/8]`` int32 (along N),
  ``scales [G, N]``, ``g_idx [K]`` -> :class:`TPUBlockQuantLinear` int4 with zero points; a ``g_idx`` other
  than ``k // group_size`` (act-order) permutes K so that groups are contiguous, and ``x`` is gathered by the
  module's ``in_perm``.
* AWQ 4-bit GEMM: ``qweight [K, N/8]`` int32 packed along N in AWQ's interleaved order (nibble ``i`` holds
  column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``), ``qzeros [G, N/8]`` (same order), ``scales [G, N]`` -> the same.
* compressed-tensors pack-quantized 4-bit: ``weight_packed [N, K/8]`` int32 (nibble ``i`` = column ``8c + i``,
  value + 8), ``weight_scale [N, G]``, ``weight_zero_point [N/8, G]`` (asymmetric, packed along N) -> int4
  (symmetric: zero point 8).
* compressed-tensors int- / float-quantized 8-bit: ``weight [N, K]`` int8 / float8_e4m3fn, ``weight_scale
  [N, 1]`` (channel) or ``[1]`` (tensor) -> :class:`TPUQuantLinear`, ``x_quant`` from ``input_activations``
  (dynamic per token) or None; strategy ``block``: as fp8 block below.
* fp8 block (``quant_method: fp8``, DeepSeek-V3): ``weight [N, K]`` float8_e4m3fn, ``weight_scale_inv
  [ceil(N/bn), ceil(K/bk)]`` f32 (the dequantization multiplier, despite its name), ``weight_block_size
  [bn, bk]`` -> :class:`TPUBlockQuantLinear` fp8, ``block_size = bk``, each scale repeated over its ``bn`` rows.

The dequantized weights are exactly the formats' own (``W = (q - z) * s``, GPTQ v1 ``z = stored + 1``; ``W = q * s``
for 8-bit), which the tests check bit for bit in float64 against dequantizations written from the formats'
documentation (tests/test_checkpoints.py), plus the logits against a float64 model run with those weights.
Checkpoint scales in fp16 / bf16 become float32 (exact). A group size that is not one of the kernel's block sizes
(32..512) but a multiple of one (``-1`` = per channel, or e.g. 1024) is tiled by the largest block size dividing it,
with its scale repeated. K not a multiple of the block follows the kernels' padding rule (the weight is padded).

Memory: transformers first materialises the float model (the quantized linears' float weights included, then
dropped); loading a model larger than host memory needs a meta-device path that is not implemented here.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ArgumentError

#: AWQ's packing order along N: nibble i of a packed int32 holds column 8c + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Scheme:
    """What :func:`parse_quantization_config` understood: ``method`` (gptq / awq / ct-pack / ct-int / ct-float /
    fp8-block), ``group_size`` (-1 per channel), ``x_quant`` (None / "int8" / "fp8"), ``gptq_v1_zeros`` (stored
    zeros are one less), ``block`` (fp8 ``[bn, bk]``), ``symmetric``."""

    method: str
    group_size: int = -1
    x_quant: Optional[str] = None
    gptq_v1_zeros: bool = False
    block: Optional[tuple] = None
    symmetric: bool = True


def _err(key: str, value, why: str):
    return ArgumentError(f"quantization_config: {key} = {value!r} is not supported: {why}")


def _ct_scheme(qc: dict) -> Scheme:
    fmt = qc.get("format")
    for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if qc.get(key):
            raise _err(key, qc[key], "only weight (and dynamic activation) quantization loads into tpukernels")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _err("config_groups", list(groups), "exactly one quantization group is supported")
    (gname, grp), = groups.items()
    if grp.get("targets") not in (["Linear"], ("Linear",)):
        raise _err(f"config_groups.{gname}.targets", grp.get("targets"), "only ['Linear'] is supported")
    w = grp.get("weights") or {}
    a = grp.get("input_activations")
    strategy, bits, typ = w.get("strategy"), w.get("num_bits"), w.get("type", "int")
    x_quant = None
    if a:
        if not a.get("dynamic") or a.get("strategy") != "token" or a.get("num_bits") != 8:
            raise _err(f"config_groups.{gname}.input_activations", a,
                       "only dynamic per-token 8-bit activations (tpukernels' w8a8) are supported")
        x_quant = "int8" if a.get("type", "int") == "int" else "fp8"
    if w.get("actorder") not in (None, False, "static", "weight"):
        raise _err(f"config_groups.{gname}.weights.actorder", w.get("actorder"), "group act-order needs weight_g_idx")
    if fmt == "pack-quantized":
        if bits != 4 or typ != "int":
            raise _err(f"config_groups.{gname}.weights.num_bits", bits, "pack-quantized loads 4-bit int weights")
        if strategy not in ("group", "channel") or x_quant:
            raise _err(f"config_groups.{gname}.weights.strategy", strategy, "W4A16 with group or channel scales")
        return Scheme("ct-pack", int(w.get("group_size") or -1) if strategy == "group" else -1,
                      symmetric=bool(w.get("symmetric", True)))
    if fmt in ("int-quantized", "float-quantized", "naive-quantized"):
        if bits != 8 or not w.get("symmetric", True):
            raise _err(f"config_groups.{gname}.weights", w, "8-bit symmetric weights")
        if strategy == "block":
            blk = tuple(w.get("block_structure") or ())
            if typ != "float" or len(blk) != 2 or x_quant:
                raise _err(f"config_groups.{gname}.weights.block_structure", blk, "fp8 [bn, bk] blocks, W8A16")
            return Scheme("fp8-block", block=blk)
        if strategy not in ("channel", "tensor"):
            raise _err(f"config_groups.{gname}.weights.strategy", strategy, "channel, tensor or block scales")
        return Scheme("ct-int" if typ == "int" else "ct-float", x_quant=x_quant)
    raise _err("format", fmt, "pack-quantized, int-quantized, float-quantized or naive-quantized")


def parse_quantization_config(qc) -> Scheme:
    """The :class:`Scheme` of a checkpoint's ``quantization_config`` (dict or transformers config object).

    Raises:
        ArgumentError: a method or a value of a key that the loaders do not support (the message names the key:
            e.g. ``bits``, ``version``, ``format``, ``activation_scheme``, ``config_groups.group_0.weights``).
    """
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    method = qc.get("quant_method")
    if method == "gptq":
        if qc.get("bits") != 4:
            raise _err("bits", qc.get("bits"), "GPTQ loads 4-bit weights")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _err("checkpoint_format", fmt, "'gptq' (zeros stored minus one) or 'gptq_v2'")
        return Scheme("gptq", int(qc.get("group_size", 128)), gptq_v1_zeros=fmt == "gptq",
                      symmetric=bool(qc.get("sym", True)))
    if method == "awq":
        if qc.get("bits", qc.get("w_bit")) != 4:
            raise _err("bits", qc.get("bits"), "AWQ loads 4-bit weights")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _err("version", version, "only AWQ's GEMM packing (qweight [K, N/8]) is supported")
        if not qc.get("zero_point", True):
            raise _err("zero_point", False, "AWQ checkpoints without zero points are not supported")
        return Scheme("awq", int(qc.get("group_size", qc.get("q_group_size", 128))), symmetric=False)
    if method == "compressed-tensors":
        return _ct_scheme(qc)
    if method == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise _err("activation_scheme", qc.get("activation_scheme"), "static activation scales are not supported")
        blk = qc.get("weight_block_size")
        if not blk or len(blk) != 2:
            raise _err("weight_block_size", blk, "fp8 checkpoints with [bn, bk] weight blocks")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _err("fmt", qc.get("fmt"), "float8_e4m3fn weights")
        return Scheme("fp8-block", block=tuple(int(b) for b in blk))
    raise _err("quant_method", method, "tpukernels loads gptq, awq, compressed-tensors and fp8")


# ----------------------------------------------------------------------------------------------- repacking
def _unpack_int32(p: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Nibbles of int32 words along ``dim`` (8 per word): element ``8c + order[i]`` is nibble ``i`` of word ``c``."""
    p = p.to(torch.int32)
    shifts = torch.tensor([4 * order.index(j) for j in range(8)], dtype=torch.int32)
    if dim == 0:
        v = (p[:, None, :] >> shifts[None, :, None]) & 15
        return v.reshape(-1, p.shape[1])
    v = (p[:, :, None] >> shifts[None, None, :]) & 15
    return v.reshape(p.shape[0], -1)


def _tile(group_size: int, K: int) -> tuple[int, int]:
    """``(block_size, repeats)``: the kernel block that tiles the checkpoint's groups (module docstring)."""
    from ..library.quantized_matmul_ops import BLOCK_SIZES

    g = K if group_size in (-1, 0, None) else group_size
    if g in BLOCK_SIZES:
        return g, 1
    for b in sorted(BLOCK_SIZES, reverse=True):
        if g % b == 0:
            return b, g // b
    if group_size in (-1, 0, None):  # per channel, K not a multiple of 32: one block size, weight padded
        return 128, -(-K // 128)
    raise ArgumentError(f"quantization_config: group_size = {group_size} is not a multiple of 32 (the kernel's "
                        f"block sizes are 32..512)")


def _int4_module(linear, q_u, scale, zero, group_size, bias, perm=None):
    """:class:`TPUBlockQuantLinear` from unsigned nibbles ``q_u [N, K]``, ``scale [N, G]``, ``zero [N, G]`` (grid
    units, or None: 8) of contiguous groups of ``group_size`` columns."""
    from ..library.quantized_matmul_ops import TPUBlockQuantLinear, pack_int4, pad_k

    N, K = q_u.shape
    bs, rep = _tile(group_size, K)
    G = -(-K // bs)
    scale = scale.float().repeat_interleave(rep, dim=1)
    zero = None if zero is None else zero.float().repeat_interleave(rep, dim=1)
    if scale.shape != (N, G) or (zero is not None and zero.shape != (N, G)):
        raise ArgumentError(f"checkpoint: the scales / zero points of {linear} give {tuple(scale.shape)} groups, "
                            f"expected ({N}, {G // rep}) for K = {K} and group size {group_size}")
    m = TPUBlockQuantLinear(linear.in_features, linear.out_features, bs, "int4", bias is not None, zero is not None)
    q = pad_k(q_u.to(torch.uint8), bs)  # padded columns: any finite weight (they meet x's zero padding)
    m.w_q.copy_(pack_int4(q, bs))
    m.w_scale.copy_(scale.T.reshape(G, 1, N))
    if zero is not None:
        m.w_zero_point.copy_(zero.T.reshape(G, 1, N))
    if bias is not None:
        m.bias = bias.detach().clone()
    if perm is not None:
        m.in_perm = perm
    return m


def _gptq(linear, t, scheme: Scheme, awq: bool):
    N, K = linear.out_features, linear.in_features
    if awq:
        q = _unpack_int32(t["qweight"], 1, AWQ_ORDER)[:K, :N].T  # [K, N] -> [N, K]
        z = _unpack_int32(t["qzeros"], 1, AWQ_ORDER)[:, :N].T.float()  # [N, G]
    else:
        q = _unpack_int32(t["qweight"], 0)[:K, :N].T
        z = _unpack_int32(t["qzeros"], 1)[:, :N].T.float()
        if scheme.gptq_v1_zeros:
            z = z + 1  # GPTQ v1 stores zero - 1 (AutoGPTQ's convention; checkpoint_format "gptq")
    s = t["scales"].float().T  # [N, G]
    gs = K if scheme.group_size in (-1, 0) else scheme.group_size
    perm = None
    g_idx = t.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(K) // gs):
        # act-order: input channel k belongs to group g_idx[k]; sort K by group so each group is contiguous
        perm = torch.argsort(g_idx.long(), stable=True)
        counts = torch.bincount(g_idx.long(), minlength=s.shape[1])
        if bool((counts[:-1] != gs).any()):
            raise ArgumentError(f"checkpoint: g_idx of {linear} does not give groups of group_size = {gs} columns")
        q = q[:, perm]
    return _int4_module(linear, q, s, z, gs, t.get("bias"), perm)


def _ct_pack(linear, t, scheme: Scheme):
    N, K = linear.out_features, linear.in_features
    q = _unpack_int32(t["weight_packed"], 1)[:, :K]  # stored value + 8: unsigned nibbles
    s = t["weight_scale"].float()  # [N, G] or [N, 1]
    z = None
    if not scheme.symmetric:
        z = _unpack_int32(t["weight_zero_point"], 0)[:N].float()  # zero point + 8, in the unsigned grid
    if t.get("weight_g_idx") is not None:
        raise ArgumentError(f"checkpoint: weight_g_idx of {linear} (group act-order) is not supported for "
                            f"compressed-tensors")
    return _int4_module(linear, q, s, z, scheme.group_size if s.shape[1] > 1 else -1, t.get("bias"))


def _ct_8bit(linear, t, scheme: Scheme):
    from ..library.quantized_matmul_ops import TPUQuantLinear

    N = linear.out_features
    w = t["weight"]
    dt = "int8" if w.dtype == torch.int8 else str(w.dtype).replace("torch.", "")
    m = TPUQuantLinear(linear.in_features, N, t.get("bias") is not None, dt, scheme.x_quant)
    m.w_q.copy_(w)
    m.w_scale.copy_(t["weight_scale"].float().reshape(-1).expand(N))
    if t.get("bias") is not None:
        m.bias = t["bias"].detach().clone()
    return m


def _fp8_block(linear, t, scheme: Scheme, scale_key: str):
    from ..library.quantized_matmul_ops import BLOCK_SIZES, TPUBlockQuantLinear, pad_k

    bn, bk = scheme.block
    if bk not in BLOCK_SIZES:
        raise _err("weight_block_size", list(scheme.block), "the K block must be a multiple of 32 in 32..512")
    N, K = linear.out_features, linear.in_features
    w = t["weight"]
    if w.dtype != torch.float8_e4m3fn:
        raise ArgumentError(f"checkpoint: weight of {linear} is {w.dtype}, expected float8_e4m3fn")
    s = t[scale_key].float()  # [ceil(N/bn), ceil(K/bk)]
    G = -(-K // bk)
    if s.shape != (-(-N // bn), G):
        raise ArgumentError(f"checkpoint: {scale_key} of {linear} has shape {tuple(s.shape)}, expected "
                            f"({-(-N // bn)}, {G}) for weight_block_size {list(scheme.block)}")
    m = TPUBlockQuantLinear(linear.in_features, N, bk, "float8_e4m3fn", t.get("bias") is not None)
    m.w_q.copy_(pad_k(w.view(torch.uint8), bk).view(torch.float8_e4m3fn))
    m.w_scale.copy_(s.repeat_interleave(bn, dim=0)[:N].T.reshape(G, 1, N))
    if t.get("bias") is not None:
        m.bias = t["bias"].detach().clone()
    return m


#: the tensor whose presence marks a quantized linear, per method
_MARKER = {"gptq": "qweight", "awq": "qweight", "ct-pack": "weight_packed", "ct-int": "weight_scale",
           "ct-float": "weight_scale", "fp8-block": None}


def _read_tensors(path: str) -> dict:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ArgumentError(f"from_pretrained: no *.safetensors file in {path!r}")
    out = {}
    for f in files:
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def convert_linears(model: torch.nn.Module, tensors: dict, scheme: Scheme) -> list:
    """Replace each quantized linear of ``model`` (found by its checkpoint tensors) by a tpukernels module;
    returns the replaced module names. Raises ArgumentError naming the module or tensor that does not fit."""
    marker = _MARKER[scheme.method] or ("weight_scale_inv" if any(k.endswith(".weight_scale_inv") for k in tensors)
                                        else "weight_scale")
    names = sorted(k[: -len(marker) - 1] for k in tensors if k.endswith("." + marker))
    done = []
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
            child = getattr(parent, child_name)
        except AttributeError:
            child = None
        if not isinstance(child, torch.nn.Linear):
            raise ArgumentError(f"checkpoint: {name}.{marker} belongs to no nn.Linear of {type(model).__name__} "
                                f"(got {type(child).__name__})")
        n0 = len(name) + 1
        t = {k[n0:]: v for k, v in tensors.items() if k.startswith(name + ".") and "." not in k[n0:]}
        if scheme.method in ("gptq", "awq"):
            for key in ("qweight", "qzeros", "scales"):
                if key not in t:
                    raise ArgumentError(f"checkpoint: {name}.{key} is missing")
            new = _gptq(child, t, scheme, scheme.method == "awq")
        elif scheme.method == "ct-pack":
            new = _ct_pack(child, t, scheme)
        elif scheme.method == "fp8-block":
            new = _fp8_block(child, t, scheme, marker)
        else:
            new = _ct_8bit(child, t, scheme)
        new.to(child.weight.device if child.weight.device.type != "meta" else "cpu")
        setattr(parent, child_name, new)
        done.append(name)
    return done


def from_pretrained(path: str, *, model_class=None, dtype=torch.float32, **kwargs):
    """Load a quantized checkpoint directory (``config.json`` + ``*.safetensors``) into a transformers model whose
    quantized linears run tpukernels' quantized matmuls (module docstring: formats, layouts).

    Args:
        path: a local checkpoint directory.
        model_class: the transformers class (default ``AutoModelForCausalLM``).
        dtype: dtype of the unquantized parameters and activations (bfloat16 / float32).
        kwargs: passed to ``model_class.from_pretrained``.

    Returns:
        The model (eval mode). Its ``save_pretrained`` raises (transformers' ValueError for a quantizer that is not
        serializable): writing our modules under the checkpoint's config would reload as random weights.

    Raises:
        ArgumentError: an unsupported ``quantization_config`` (naming the key), a quantized tensor that belongs to no
            linear, a tensor missing from the checkpoint (named), or a linear the checkpoint leaves uninitialised.
    """
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise ArgumentError(f"from_pretrained: {path!r} has no quantization_config in config.json; use "
                            f"transformers' from_pretrained")
    scheme = parse_quantization_config(qc)
    del config.quantization_config
    model_class = model_class or transformers.AutoModelForCausalLM
    model, info = model_class.from_pretrained(path, config=config, dtype=dtype, output_loading_info=True, **kwargs)
    done = convert_linears(model, _read_tensors(path), scheme)
    left = sorted(set(info.get("missing_keys", ())) - {f"{n}.{p}" for n in done for p in ("weight", "bias")})
    if left:
        raise ArgumentError(f"from_pretrained: the checkpoint has no tensor {left[0]} (and {len(left) - 1} more); "
                            f"refusing to leave it uninitialised")
    from .quantizers import refuse_saving

    refuse_saving(model, qc)
    return model.eval()


__all__ = ["from_pretrained", "parse_quantization_config", "convert_linears", "Scheme", "AWQ_ORDER"]
