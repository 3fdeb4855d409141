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

Checks (all before transformers loads a tensor; each an :class:`~tpukernels.errors.ArgumentError` naming the file, or
the module and tensor): the directory (:func:`check_checkpoint_folder`: ``config.json`` parses, every
``*.safetensors`` header parses, at least one exists); the ``quantization_config`` (:func:`parse_quantization_config`);
each quantized linear's tensors (:func:`check_linear_tensors`: every tensor its format needs present with the exact
shape and dtype listed above, ``bias`` exactly when the model's linear has one, no tensor the format does not have,
``g_idx`` / ``weight_shape`` values consistent). A linear is quantized when the checkpoint holds a tensor of the
scheme for it or a ``weight`` that is not a float (an ``nn.Linear`` would hold raw int8 / fp8 values); with
compressed-tensors, every ``nn.Linear`` its ``ignore`` list does not name (``re:`` regex, name or class, as
compressed-tensors matches) must be quantized. A failing load writes nothing: the files are only read, a ``config=``
argument is copied, and :func:`convert_linears` builds every module before it swaps any into the model.

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
    zeros are one less), ``block`` (fp8 ``[bn, bk]``), ``symmetric``, ``strategy`` (compressed-tensors 8-bit:
    ``"channel"`` / ``"tensor"``), ``scale_key`` (fp8 block: ``"weight_scale_inv"`` for ``quant_method: fp8``,
    ``"weight_scale"`` for compressed-tensors), ``ignore`` (compressed-tensors: the config's ``ignore`` list; every
    other ``nn.Linear`` is quantized; None for the other methods, which name no such list)."""

    method: str
    group_size: int = -1
    x_quant: Optional[str] = None
    gptq_v1_zeros: bool = False
    block: Optional[tuple] = None
    symmetric: bool = True
    strategy: Optional[str] = None
    scale_key: str = "weight_scale"
    ignore: Optional[tuple] = None


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
    ignore = qc.get("ignore") or []
    if isinstance(ignore, str) or not all(isinstance(i, str) for i in ignore):
        raise _err("ignore", ignore, "a list of module names, 're:' regexes or class names")
    ignore = tuple(ignore)
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
                      symmetric=bool(w.get("symmetric", True)), ignore=ignore)
    if fmt in ("int-quantized", "float-quantized", "naive-quantized"):
        if bits != 8 or not w.get("symmetric", True):
            raise _err(f"config_groups.{gname}.weights", w, "8-bit symmetric weights")
        if strategy == "block":
            blk = tuple(w.get("block_structure") or ())
            if typ != "float" or len(blk) != 2 or x_quant:
                raise _err(f"config_groups.{gname}.weights.block_structure", blk, "fp8 [bn, bk] blocks, W8A16")
            return Scheme("fp8-block", block=blk, ignore=ignore)
        if strategy not in ("channel", "tensor"):
            raise _err(f"config_groups.{gname}.weights.strategy", strategy, "channel, tensor or block scales")
        return Scheme("ct-int" if typ == "int" else "ct-float", x_quant=x_quant, strategy=strategy, ignore=ignore)
    raise _err("format", fmt, "pack-quantized, int-quantized, float-quantized or naive-quantized")


def _parse(qc) -> Scheme:
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
        return Scheme("fp8-block", block=tuple(int(b) for b in blk), scale_key="weight_scale_inv")
    raise _err("quant_method", method, "tpukernels loads gptq, awq, compressed-tensors and fp8")


def parse_quantization_config(qc) -> Scheme:
    """The :class:`Scheme` of a checkpoint's ``quantization_config`` (dict or transformers config object).

    Raises:
        ArgumentError: a method or a value of a key that the loaders do not support (the message names the key:
            e.g. ``bits``, ``version``, ``format``, ``activation_scheme``, ``config_groups.group_0.weights``,
            ``group_size`` not a multiple of 32, ``weight_block_size`` with a K block outside 32..512).
    """
    scheme = _parse(qc)
    from ..library.quantized_matmul_ops import BLOCK_SIZES

    gs = scheme.group_size
    if scheme.method in ("gptq", "awq", "ct-pack") and gs not in (-1, 0) and (gs < 32 or gs % 32):
        raise _err("group_size", gs, "a multiple of 32 (the kernel's block sizes are 32..512), or -1 per channel")
    if scheme.method == "fp8-block":
        bn, bk = scheme.block
        if bk not in BLOCK_SIZES or not isinstance(bn, int) or bn < 1:
            raise _err("weight_block_size", list(scheme.block), "[bn >= 1, bk a multiple of 32 in 32..512]")
    return scheme


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
    from ..library.quantized_matmul_ops import TPUBlockQuantLinear, pad_k

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
    m.w_q.copy_(m.pack(q))  # the module's int4 layout (packed along N for an even N: the faster decode)
    m.w_scale.copy_(scale.T.reshape(G, 1, N))
    if zero is not None:
        m.w_zero_point.copy_(zero.T.reshape(G, 1, N))
    if bias is not None:
        m.bias = bias.detach().clone()
    if perm is not None:
        m.in_perm = perm
    return m


# ------------------------------------------------------------------------------------- what each format needs
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INDEX = (torch.int32, torch.int64)
#: the tensor names (besides ``weight`` / ``bias``) whose presence marks a linear as quantized, per method
_QUANT_NAMES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
                "ct-pack": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape"),
                "ct-int": ("weight_scale", "weight_zero_point", "weight_g_idx"),
                "ct-float": ("weight_scale", "weight_zero_point", "weight_g_idx"),
                "fp8-block": ("weight_zero_point",)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dtypes(ds) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in ds)


def _spec(scheme: Scheme, N: int, K: int, has_bias: bool) -> dict:
    """``{tensor name: (shape, dtypes, required)}``: every tensor of a linear with ``K`` in and ``N`` out features
    that ``scheme`` reads (module docstring: the formats), with its exact shape and allowed dtypes; ``bias``
    exactly when the model's linear has one."""
    m = scheme.method
    gs = K if scheme.group_size in (-1, 0, None) else scheme.group_size
    G = _cdiv(K, gs)
    bias = {"bias": ((N,), _FLOATS, True)} if has_bias else {}
    if m == "gptq":
        return {"qweight": ((_cdiv(K, 8), N), (torch.int32,), True), "qzeros": ((G, _cdiv(N, 8)), (torch.int32,), True),
                "scales": ((G, N), _FLOATS, True), "g_idx": ((K,), _INDEX, False), **bias}
    if m == "awq":
        return {"qweight": ((K, _cdiv(N, 8)), (torch.int32,), True), "qzeros": ((G, _cdiv(N, 8)), (torch.int32,), True),
                "scales": ((G, N), _FLOATS, True), **bias}
    if m == "ct-pack":
        out = {"weight_packed": ((N, _cdiv(K, 8)), (torch.int32,), True), "weight_scale": ((N, G), _FLOATS, True),
               "weight_shape": ((2,), _INDEX, False), **bias}
        if not scheme.symmetric:
            out["weight_zero_point"] = ((_cdiv(N, 8), G), (torch.int32,), True)
        return out
    if m in ("ct-int", "ct-float"):
        wdt = torch.int8 if m == "ct-int" else torch.float8_e4m3fn
        sshape = (N, 1) if scheme.strategy == "channel" else (1,)
        return {"weight": ((N, K), (wdt,), True), "weight_scale": (sshape, _FLOATS, True), **bias}
    if m == "fp8-block":
        bn, bk = scheme.block
        return {"weight": ((N, K), (torch.float8_e4m3fn,), True),
                scheme.scale_key: ((_cdiv(N, bn), _cdiv(K, bk)), _FLOATS, True), **bias}
    raise ArgumentError(f"checkpoint: unknown scheme method {m!r}")


def check_linear_tensors(name: str, linear: torch.nn.Linear, t: dict, scheme: Scheme) -> None:
    """Check the checkpoint tensors ``t`` (``{tensor name: tensor}``) of the quantized linear ``name``: every
    tensor the scheme needs is present with its exact shape and dtype (:func:`_spec`), index tensors hold valid
    values, and no tensor is left that the scheme would not read.

    Raises:
        ArgumentError: naming ``<module>.<tensor>`` and what is missing, its shape or dtype against the expected
            one, an out-of-range ``g_idx`` / a ``weight_shape`` other than ``[N, K]``, a nonzero zero point in a
            symmetric scheme, or a tensor the format does not have.
    """
    N, K = linear.out_features, linear.in_features
    where = f"{scheme.method} linear {name} ({K} in, {N} out features)"
    spec = _spec(scheme, N, K, linear.bias is not None)
    for key, (shape, dtypes, required) in spec.items():
        v = t.get(key)
        if v is None:
            if required:
                raise ArgumentError(f"checkpoint: {name}.{key} is missing: {where} needs {key} of shape {shape}, "
                                    f"dtype {_dtypes(dtypes)}")
            continue
        if v.dtype not in dtypes:
            raise ArgumentError(f"checkpoint: {name}.{key} has dtype {_dtypes([v.dtype])}, expected "
                                f"{_dtypes(dtypes)} ({where})")
        if tuple(v.shape) != shape:
            raise ArgumentError(f"checkpoint: {name}.{key} has shape {tuple(v.shape)}, expected {shape} ({where})")
    extra = sorted(set(t) - set(spec))
    for key in extra:
        v = t[key]
        if key == "weight_zero_point" and scheme.symmetric and not v.dtype.is_floating_point \
                and not bool(v.to(torch.int64).any()):
            continue  # older compressed-tensors wrote all-zero zero points for symmetric schemes: nothing to apply
        if key in ("weight_g_idx",) and scheme.method.startswith("ct"):
            raise ArgumentError(f"checkpoint: {name}.weight_g_idx (group act-order) is not supported for "
                                f"compressed-tensors")
        why = ("a symmetric scheme has no zero points" if key == "weight_zero_point" and scheme.symmetric
               else "the model's linear has no bias" if key == "bias"
               else f"the format's tensors are {sorted(spec)}")
        raise ArgumentError(f"checkpoint: {name}.{key} ({_dtypes([v.dtype])} {tuple(v.shape)}) is not a tensor "
                            f"{where} reads: {why}")
    if t.get("g_idx") is not None:
        g = t["g_idx"].long()
        G = spec["scales"][0][0]
        if bool(((g < 0) | (g >= G)).any()):
            raise ArgumentError(f"checkpoint: {name}.g_idx holds group indices outside [0, {G}) ({where})")
        gs = K if scheme.group_size in (-1, 0) else scheme.group_size
        if bool((torch.bincount(g, minlength=G)[:-1] != gs).any()):
            raise ArgumentError(f"checkpoint: {name}.g_idx does not put group_size = {gs} columns in each group but "
                                f"the last ({where})")
    if t.get("weight_shape") is not None and t["weight_shape"].tolist() != [N, K]:
        raise ArgumentError(f"checkpoint: {name}.weight_shape is {t['weight_shape'].tolist()}, expected "
                            f"[{N}, {K}] ({where})")


# --------------------------------------------------------------------------------- building the modules
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
        perm = torch.argsort(g_idx.long(), stable=True)  # group sizes checked by check_linear_tensors
        q = q[:, perm]
    return _int4_module(linear, q, s, z, gs, t.get("bias"), perm)


def _ct_pack(linear, t, scheme: Scheme):
    N, K = linear.out_features, linear.in_features
    q = _unpack_int32(t["weight_packed"], 1)[:, :K]  # stored value + 8: unsigned nibbles
    s = t["weight_scale"].float()  # [N, G] or [N, 1]
    z = None
    if not scheme.symmetric:
        z = _unpack_int32(t["weight_zero_point"], 0)[:N].float()  # zero point + 8, in the unsigned grid
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


def _fp8_block(linear, t, scheme: Scheme):
    from ..library.quantized_matmul_ops import TPUBlockQuantLinear, pad_k

    bn, bk = scheme.block  # bk in BLOCK_SIZES: parse_quantization_config
    N, K = linear.out_features, linear.in_features
    w = t["weight"]
    s = t[scheme.scale_key].float()  # [ceil(N/bn), ceil(K/bk)]: shape checked by check_linear_tensors
    G = _cdiv(K, bk)
    m = TPUBlockQuantLinear(linear.in_features, N, bk, "float8_e4m3fn", t.get("bias") is not None)
    m.w_q.copy_(pad_k(w.view(torch.uint8), bk).view(torch.float8_e4m3fn))
    m.w_scale.copy_(s.repeat_interleave(bn, dim=0)[:N].T.reshape(G, 1, N))
    if t.get("bias") is not None:
        m.bias = t["bias"].detach().clone()
    return m


def _quantized_names(tensors: dict, scheme: Scheme, skip=()) -> list:
    """Module names the checkpoint quantizes: those holding a tensor of the scheme (:data:`_QUANT_NAMES`, the
    fp8 scale) or a ``weight`` that is not a float (int8 / fp8 / packed ints: a float ``nn.Linear`` would hold the
    raw quantized values). ``skip``: regexes of keys the model ignores (``_keys_to_ignore_on_load_unexpected``)."""
    import re

    names = set(_QUANT_NAMES[scheme.method])
    if scheme.method == "fp8-block":
        names.add(scheme.scale_key)
    out = set()
    for k, v in tensors.items():
        prefix, _, leaf = k.rpartition(".")
        if any(re.search(p, k) for p in skip):
            continue
        if leaf in names or (leaf == "weight" and v.dtype not in (*_FLOATS, torch.float64)):
            out.add(prefix)
    return sorted(out)


def _ignored(name: str, module: torch.nn.Module, ignore) -> bool:
    """compressed-tensors' matching of an ``ignore`` entry: ``re:<regex>`` (``re.match`` on the module name), the
    exact module name, or a class name in the module's MRO."""
    import re

    return any(re.match(i[3:], name) is not None if i.startswith("re:")
               else i == name or any(c.__name__ == i for c in type(module).__mro__) for i in ignore)


def _check_targets(model, tensors: dict, scheme: Scheme, quantized: set) -> None:
    """A compressed-tensors config targets every ``nn.Linear`` its ``ignore`` list does not name: one stored as a
    float ``weight`` without the scheme's tensors is a half-quantized checkpoint."""
    for name, mod in model.named_modules():
        if (isinstance(mod, torch.nn.Linear) and name not in quantized and f"{name}.weight" in tensors
                and not _ignored(name, mod, scheme.ignore)):
            w = tensors[f"{name}.weight"]
            need = sorted(n for n, (_, _, req) in _spec(scheme, mod.out_features, mod.in_features, False).items()
                          if req and n != "weight")
            raise ArgumentError(f"checkpoint: {name}.weight is a {_dtypes([w.dtype])} weight without {need}, but "
                                f"quantization_config ({scheme.method}) quantizes every Linear that its ignore list "
                                f"{list(scheme.ignore)} does not name; the checkpoint is half quantized")


def _quantized_linears(model: torch.nn.Module, tensors: dict, scheme: Scheme) -> list:
    """``[(name, parent, child name, nn.Linear, {tensor name: tensor})]`` of the quantized linears of ``model``, each
    checked by :func:`check_linear_tensors` (errors: :func:`convert_linears`). Reads ``model`` only (a meta-device
    model works: only the linears' features are used)."""
    skip = tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    names = _quantized_names(tensors, scheme, skip)
    if scheme.ignore is not None:  # compressed-tensors: every nn.Linear not ignored is quantized
        _check_targets(model, tensors, scheme, set(names))
    out = []
    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
            child = getattr(parent, child_name)
        except AttributeError:
            parent, child = None, None
        n0 = len(name) + 1
        t = {k[n0:]: v for k, v in tensors.items() if k.startswith(name + ".") and "." not in k[n0:]}
        if not isinstance(child, torch.nn.Linear):
            raise ArgumentError(f"checkpoint: {name}.{sorted(t)[0]} belongs to no nn.Linear of "
                                f"{type(model).__name__} (got {type(child).__name__})")
        check_linear_tensors(name, child, t, scheme)
        out.append((name, parent, child_name, child, t))
    return out


def convert_linears(model: torch.nn.Module, tensors: dict, scheme: Scheme) -> list:
    """Replace each quantized linear of ``model`` by a tpukernels module built from its checkpoint tensors
    (``tensors``: ``{checkpoint key: tensor}``); returns the replaced module names.

    A linear is quantized when the checkpoint holds a tensor of the scheme for it or a ``weight`` that is not a
    float; each such linear's tensors are checked by :func:`check_linear_tensors` and every new module is built
    before the first is swapped in, so a failing call leaves ``model`` unchanged.

    Raises:
        ArgumentError: a quantized tensor that belongs to no ``nn.Linear`` of the model, or one that is missing,
            of the wrong shape or dtype, or unknown to the scheme (naming ``<module>.<tensor>``).
    """
    plan = []
    for name, parent, child_name, child, t in _quantized_linears(model, tensors, scheme):
        if scheme.method in ("gptq", "awq"):
            new = _gptq(child, t, scheme, scheme.method == "awq")
        elif scheme.method == "ct-pack":
            new = _ct_pack(child, t, scheme)
        elif scheme.method == "fp8-block":
            new = _fp8_block(child, t, scheme)
        else:
            new = _ct_8bit(child, t, scheme)
        new.to(child.weight.device if child.weight.device.type != "meta" else "cpu")
        plan.append((name, parent, child_name, new))
    for _, parent, child_name, new in plan:  # all built: swap them in
        setattr(parent, child_name, new)
    return [name for name, *_ in plan]


# ------------------------------------------------------------------------------------------ the folder
def check_checkpoint_folder(path: str) -> list:
    """Check a checkpoint directory before anything loads it; returns its ``*.safetensors`` files (sorted).

    Checked: ``path`` is a directory; ``config.json`` exists and parses as a JSON object; at least one
    ``*.safetensors`` file exists; each one's header parses (safetensors' ``safe_open``, which also rejects a
    file shorter than its header says: a truncated or 0-byte file); no tensor name is in two files; a
    ``model.safetensors.index.json`` parses and names only files that exist.

    Raises:
        ArgumentError: naming the file (or directory) and what is wrong with it.
    """
    import json

    from safetensors import safe_open

    if not os.path.isdir(path):
        raise ArgumentError(f"from_pretrained: {path!r} is not a directory (a local checkpoint directory with "
                            f"config.json and *.safetensors; download a hub checkpoint first)")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise ArgumentError(f"from_pretrained: {cfg!r} does not exist")
    for f in (cfg, os.path.join(path, "model.safetensors.index.json")):
        if f != cfg and not os.path.exists(f):
            continue
        try:
            with open(f, encoding="utf-8") as fh:
                obj = json.load(fh)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ArgumentError(f"from_pretrained: {f!r} is not a readable JSON file: {e}") from e
        if not isinstance(obj, dict):
            raise ArgumentError(f"from_pretrained: {f!r} holds a JSON {type(obj).__name__}, expected an object")
        if f != cfg:
            wmap = obj.get("weight_map")
            if not isinstance(wmap, dict):
                raise ArgumentError(f"from_pretrained: {f!r} has no weight_map object")
            for shard in sorted(set(map(str, wmap.values()))):
                if not os.path.isfile(os.path.join(path, shard)):
                    raise ArgumentError(f"from_pretrained: {f!r} names the shard {shard!r}, which does not exist")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        present = sorted(os.listdir(path))
        raise ArgumentError(f"from_pretrained: no *.safetensors file in {path!r} (it holds {present}); tpukernels "
                            f"loads safetensors weights only")
    seen = {}
    for f in files:
        try:
            with safe_open(f, "pt") as fh:
                keys = list(fh.keys())
        except Exception as e:  # safetensors' SafetensorError (header too small, invalid JSON, not fully covered)
            raise ArgumentError(f"from_pretrained: {f!r} is not a valid safetensors file "
                                f"({type(e).__name__}: {e})") from e
        for k in keys:
            if k in seen:
                raise ArgumentError(f"from_pretrained: tensor {k!r} is in both {seen[k]!r} and {f!r}")
            seen[k] = f
    return files


def _read_tensors(files: list) -> dict:
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def from_pretrained(path: str, *, model_class=None, dtype=torch.float32, **kwargs):
    """Load a quantized checkpoint directory (``config.json`` + ``*.safetensors``) into a transformers model whose
    quantized linears run tpukernels' quantized matmuls (module docstring: formats, layouts).

    The directory is checked first (:func:`check_checkpoint_folder`), then each quantized linear's tensors
    (:func:`check_linear_tensors`: every tensor its format needs, exact shapes and dtypes); nothing on disk is
    written, and a ``config=`` passed in is copied, not changed.

    Args:
        path: a local checkpoint directory.
        model_class: the transformers class (default ``AutoModelForCausalLM``).
        dtype: dtype of the unquantized parameters and activations (bfloat16 / float32).
        kwargs: passed to ``model_class.from_pretrained``.

    Returns:
        The model (eval mode). Its ``save_pretrained`` raises (transformers' ValueError for a quantizer that is not
        serializable): writing our modules under the checkpoint's config would reload as random weights.

    Raises:
        ArgumentError: a directory that is not a checkpoint (no directory, a missing or corrupt ``config.json``,
            no ``*.safetensors`` file, a truncated / 0-byte / corrupt-header safetensors file: the message names
            the file), an unsupported ``quantization_config`` (naming the key), a quantized tensor that belongs to
            no linear, a quantized linear's tensor that is missing, of the wrong shape or dtype (naming the module
            and tensor), or a linear the checkpoint leaves uninitialised.
    """
    import copy

    import transformers

    files = check_checkpoint_folder(path)
    if kwargs.get("config") is not None:
        config = copy.deepcopy(kwargs.pop("config"))
    else:
        kwargs.pop("config", None)
        try:
            config = transformers.AutoConfig.from_pretrained(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ArgumentError(f"from_pretrained: transformers cannot read "
                                f"{os.path.join(path, 'config.json')!r}: {type(e).__name__}: {e}") from e
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise ArgumentError(f"from_pretrained: {path!r} has no quantization_config in config.json; use "
                            f"transformers' from_pretrained")
    scheme = parse_quantization_config(qc)
    del config.quantization_config
    model_class = model_class or transformers.AutoModelForCausalLM
    tensors = _read_tensors(files)
    # every quantized linear's tensors checked on a meta-device skeleton first: transformers' own load would
    # otherwise refuse a malformed quantized `weight` (a size mismatch) before naming what is wrong with it
    with torch.device("meta"):
        cfg = copy.deepcopy(config)  # the skeleton's construction may annotate its config
        skeleton = (model_class.from_config(cfg, trust_remote_code=kwargs.get("trust_remote_code", False))
                    if hasattr(model_class, "from_config") else model_class._from_config(cfg))
    _quantized_linears(skeleton, tensors, scheme)
    del skeleton
    model, info = model_class.from_pretrained(path, config=config, dtype=dtype, output_loading_info=True, **kwargs)
    done = convert_linears(model, tensors, scheme)
    left = sorted(set(info.get("missing_keys", ())) - {f"{n}.weight" for n in done})
    if left:
        raise ArgumentError(f"from_pretrained: the checkpoint has no tensor {left[0]} (and {len(left) - 1} more); "
                            f"refusing to leave it uninitialised")
    from .quantizers import refuse_saving

    refuse_saving(model, qc)
    return model.eval()


__all__ = ["from_pretrained", "parse_quantization_config", "convert_linears", "check_linear_tensors",
           "check_checkpoint_folder", "Scheme", "AWQ_ORDER"]
