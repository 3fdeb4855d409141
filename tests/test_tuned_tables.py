"""A public call at a shipped tuning entry's shape resolves its config from the shipped table.

Parametrized over every shipped JSON file (``tpukernels/data/autotuning/<chip>/*.json``), so tables added
later are covered too. Each case calls the *public* op (``matmul``, ``rms_norm``, ``flash_attention``, ...,
forward and backward) the way a user or a patched ``nn.Module`` does, at the smallest entry's shapes, with
``TPUKERNELS_TARGET_CHIP=<chip>``, and checks that the kernel's config came from the shipped table: a wrapper
that spells a default out (``out_dtype="bfloat16"`` where the entry says ``out_dtype=None``) would miss it.

The kernels do not run: the cpu target's runner is replaced by one that returns uninitialized outputs of the
right shapes, so full-size shapes cost only the wrappers' own work (inputs are ``torch.empty``).
"""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

import tpukernels.library  # noqa: F401  (registers every library kernel)
from tpukernels.dsl.kernel import REGISTRY
from tpukernels.targets import cpu as cpu_target

DATA = os.path.join(os.path.dirname(tpukernels.library.__file__), "..", "data", "autotuning")
FILES = sorted(glob.glob(os.path.join(DATA, "*", "*.json")))


def _id(path):
    return f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)[:-5]}"


def _dt(name):
    return getattr(torch, name)


def _e(shape, dtype, requires_grad=False):
    return torch.empty(shape, dtype=_dt(dtype) if isinstance(dtype, str) else dtype).requires_grad_(requires_grad)


def _ones(shape, dtype):
    return torch.ones(shape, dtype=_dt(dtype))


def _backward(out):
    outs = out if isinstance(out, tuple) else (out,)
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])


# ---- per kernel: call the public op at an entry's key (shapes are the key's, i.e. bucketed: a weight
# ---- [N] is keyed [8, N] and a per-row [M, 1] is keyed [M, 8]).
def _matmul(key, grad=False):
    from tpukernels.library import matmul

    (a, b, _), (da, _db, _) = key["shapes"], key["dtypes"]
    x = _e(a, da)
    if key["_kernel"].endswith("matmul_nt"):
        y = _e(b, da).transpose(-1, -2)  # x @ W.T, as nn.Linear
    elif key["_kernel"].endswith("matmul_tn"):
        x, y = _e(a, da).transpose(-1, -2), _e(b, da)
    else:
        y = _e(b, da)
    return matmul(x, y, activation=key["statics"].get("activation"))


def _rms(key):
    from tpukernels.library import rms_norm

    st = key["statics"]
    (x, w, *_), (dx, dw, *_) = key["shapes"], key["dtypes"]
    bwd = key["_kernel"].endswith("_bwd")
    X = _e(x, dx, bwd)
    W = _e(w[1:], dw, bwd)
    out = rms_norm(X, W, eps=st.get("eps", 1e-6), offset=st.get("offset", 0.0),
                   **({"casting": st["casting"]} if "casting" in st else {}))
    if bwd:
        _backward(out)
    return out


def _gated(key):
    from tpukernels.library import gated_rms_norm

    st = key["statics"]
    bwd = key["_kernel"].endswith("_bwd")
    (x, z, *_), (dx, dz, *_) = (key["shapes"][1:], key["dtypes"][1:]) if bwd else (key["shapes"], key["dtypes"])
    w, dw = key["shapes"][-1], key["dtypes"][-1]
    out = gated_rms_norm(_e(x, dx, bwd), _e(z, dz, bwd), _e(w[1:], dw, bwd), eps=st.get("eps", 1e-6),
                         norm_before_gate=st["norm_before_gate"], group_size=st["group_size"],
                         activation=st["activation"], casting=st.get("casting", "llama"))
    if bwd:
        _backward(out)
    return out


def _fused_add(key):
    from tpukernels.library import fused_add_rms_norm

    st = key["statics"]
    (x, r, w), (dx, dr, dw) = key["shapes"], key["dtypes"]
    return fused_add_rms_norm(_e(x, dx), _e(r, dr), _e(w[1:], dw), eps=st["eps"], offset=st["offset"],
                              casting=st["casting"])


def _layer(key):
    from tpukernels.library import layer_norm

    bwd = key["_kernel"].endswith("_bwd")
    if bwd:
        (x, _dy, _m, _r, w), (dx, *_, dw) = key["shapes"], key["dtypes"]
        out = layer_norm(_e(x, dx, True), _e(w[1:], dw, True), _e(w[1:], dw, True))
        _backward(out)
        return out
    (x, w, b), (dx, dw, db) = key["shapes"], key["dtypes"]
    return layer_norm(_e(x, dx), _e(w[1:], dw), _e(b[1:], db), eps=key["statics"]["eps"])


def _attention(key):
    from tpukernels.library import flash_attention

    st = key["statics"]
    (q, k, v, *_), (dq, dk, dv, *_) = key["shapes"], key["dtypes"]
    bwd = "_bwd" in key["_kernel"]
    out = flash_attention(_e(q, dq, bwd), _e(k, dk, bwd), _e(v, dv, bwd), causal=st["causal"],
                          causal_alignment=st["causal_alignment"], sm_scale=st["sm_scale"],
                          window=(st["window_left"], st["window_right"]), softcap=st["softcap"])
    if bwd:  # the backward mode whose kernel the table belongs to (the fused one is the default on some chips)
        from unittest import mock

        from tpukernels.library.attention.backward_fused import ENV

        with mock.patch.dict(os.environ, {ENV: "fused" if key["_kernel"].endswith("_bwd_fused") else "split"}):
            _backward(out)
    return out


def _lce(key):
    from tpukernels.library import linear_cross_entropy

    st = key["statics"]
    (h, w, *_), (dh, dw, *_) = key["shapes"], key["dtypes"]
    bwd = "_bwd" in key["_kernel"] or key["_kernel"].endswith("_fwd_dh")  # fwd_dh: the forward when h needs grad
    labels = torch.zeros(h[0], dtype=torch.long)
    out = linear_cross_entropy(_e(h, dh, bwd), _e(w, dw, bwd), labels, ignore_index=st["ignore_index"],
                               softcap=st["softcap"])
    if bwd:
        _backward(out)
    return out


def _lce_kernel_op(key):
    """``bwd_dh`` serves the kernel op ``torch.ops.tpukernels.linear_cross_entropy_fwd`` differentiated for ``h``
    (the public op computes ``dh`` in its forward: ``fwd_dh``)."""
    st = key["statics"]
    (h, w, *_), (dh, dw, *_) = key["shapes"], key["dtypes"]
    labels = torch.zeros(h[0], 1, dtype=torch.int32)
    out = torch.ops.tpukernels.linear_cross_entropy_fwd(_e(h, dh, True), _e(w, dw), labels, st["ignore_index"],
                                                         st["softcap"])
    _backward(out[0])
    return out


def _grouped(key):
    from tpukernels.library import grouped_matmul

    st = key["statics"]
    _, _, x, y, *_ = key["shapes"]  # grouped_matmul_fwd's keys end with rhs_bias (None)
    _, _, dx, dy, *_ = key["dtypes"]
    if key["_kernel"].endswith("_tgmm"):  # the rhs gradient of a forward: lhs [M, K], rhs [G, K, N]
        G = st["num_groups"]
        M, K, N = x[0], x[1], y[1]
        sizes = torch.full((G,), M // G, dtype=torch.int32)
        lhs, rhs = _e((M, K), dx), _e((G, K, N), dy, True)
        out = grouped_matmul(lhs, rhs, sizes)
        _backward(out)
        return out
    M = x[0]
    G = y[0]
    sizes = torch.full((G,), M // G, dtype=torch.int32)
    return grouped_matmul(_e(x, dx), _e(y, dy), sizes, transpose_rhs=st["transpose_rhs"])


def _quantized(key):
    from tpukernels.library import quantized_matmul

    (x, w, ws, *rest), (dx, dw, *_) = key["shapes"], key["dtypes"]
    x_dtype = "bfloat16" if dx.startswith("int") else dx
    x_quant = None
    if key["_kernel"].endswith("w8a8_kernel") or dx.startswith("int") or (rest and rest[0] is not None):
        x_quant = "fp8" if dw.startswith("float8") else "int8"
    return quantized_matmul(_e(x, x_dtype), _e(w, dw), _ones(ws[1:], "float32"), x_quant=x_quant)


def _paged(key):
    from tpukernels.library import ragged_paged_attention

    st = key["statics"]
    (lens, pages, _cu, _n, q, kv, *_), dts = key["shapes"], key["dtypes"]  # + sinks, k_scales, v_scales (None)
    S, T = lens[0], q[0]
    per = T // S
    page_size = kv[1]
    kv_len = max(per, page_size)
    kv_lens = torch.full((S,), kv_len, dtype=torch.int32)
    page_indices = (torch.arange(S * pages[1], dtype=torch.int32) % kv[0]).reshape(S, pages[1])
    cu = torch.arange(S + 1, dtype=torch.int32) * per
    num_seqs = torch.tensor([S], dtype=torch.int32)
    return ragged_paged_attention(_e(q, dts[4]).zero_(), _e(kv, dts[5]), kv_lens, page_indices, cu, num_seqs,
                                  sm_scale=st["sm_scale"], sliding_window=st["sliding_window"],
                                  soft_cap=st["soft_cap"], k_scale=st["k_scale"], v_scale=st["v_scale"])


PUBLIC = {
    "tpukernels::matmul_nn": _matmul, "tpukernels::matmul_nt": _matmul, "tpukernels::matmul_tn": _matmul,
    "tpukernels::rms_norm_fwd": _rms, "tpukernels::rms_norm_bwd": _rms,
    "tpukernels::fused_add_rms_norm_fwd": _fused_add,
    "tpukernels::gated_rms_norm_fwd": _gated, "tpukernels::gated_rms_norm_bwd": _gated,
    "tpukernels::layer_norm_fwd": _layer, "tpukernels::layer_norm_bwd": _layer,
    "tpukernels::flash_attention_fwd": _attention, "tpukernels::flash_attention_bwd_dq": _attention,
    "tpukernels::flash_attention_bwd_dkv": _attention, "tpukernels::flash_attention_bwd_fused": _attention,
    "tpukernels::linear_cross_entropy_fwd": _lce, "tpukernels::linear_cross_entropy_fwd_dh": _lce,
    "tpukernels::linear_cross_entropy_bwd_dh": _lce_kernel_op,
    "tpukernels::linear_cross_entropy_bwd_dw": _lce,
    "tpukernels::grouped_matmul_fwd": _grouped, "tpukernels::grouped_matmul_tgmm": _grouped,
    "tpukernels::quantized_matmul_kernel": _quantized, "tpukernels::quantized_matmul_w8a8_kernel": _quantized,
    "tpukernels::ragged_paged_attention_kernel": _paged,
}


def _kernel_call(key):
    """Fallback for a table of a kernel without a public caller above: the kernel op itself, with the
    entry's statics (checks the keying layer: buckets, canonical statics, source hash)."""
    k = REGISTRY[key["_kernel"]]
    args = []
    for p, shape, dt in zip(k.tensor_params, key["shapes"], key["dtypes"]):
        args.append(None if shape is None else _e(shape, dt))
    return k(*args, **key["statics"])


@pytest.fixture
def recording(monkeypatch):
    """Replace the cpu runner by one that returns uninitialized outputs and records each config source."""
    seen: dict[str, list] = {}

    def fake_run(plan, values):
        low = plan.lowered
        seen.setdefault(low.kernel.qualname, []).append(low.resolved.source)
        outs = []
        for o, rows in zip(low.out_structs, plan.row_outs or [False] * len(low.out_structs)):
            shape = tuple(o.shape)
            if plan.n_rows is not None and rows:
                shape = (plan.n_rows, *shape[1:])
            outs.append(torch.zeros(shape, dtype=_dt(str(o.dtype))) if math.prod(shape) < 2**24
                        else torch.empty(shape, dtype=_dt(str(o.dtype))))
        return outs[0] if plan.single else tuple(outs)

    monkeypatch.setattr(cpu_target, "run_plan_cpu", fake_run)
    return seen


def _smallest(entries):
    return min(entries, key=lambda e: sum(math.prod(s) for s in e["key"]["shapes"] if s))


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_public_call_resolves_from_shipped_table(path, recording, monkeypatch):
    chip = os.path.basename(os.path.dirname(path))
    data = json.load(open(path))
    qualname = os.path.basename(path)[:-5].replace(".", "::", 1)
    if qualname not in REGISTRY:
        pytest.skip(f"{qualname} is not defined by tpukernels.library in this checkout")
    key = dict(_smallest(data["entries"])["key"], _kernel=qualname)
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", chip)
    for k in REGISTRY.values():  # fresh plans/lowerings: the chip is part of their keys, not of the plans'
        k._plans.clear()
    with torch.no_grad() if not any(s in qualname for s in ("_bwd", "_tgmm", "_fwd_dh")) else torch.enable_grad():
        PUBLIC.get(qualname, _kernel_call)(key)
    sources = recording.get(qualname)
    assert sources, f"the public call did not reach {qualname} (kernels reached: {sorted(recording)})"
    assert all(s == f"shipped-db:{chip}" for s in sources), (
        f"{qualname} at its shipped entry's shapes resolved its config from {sources}, not the shipped {chip} table "
        f"(key {key})")


def test_default_and_explicit_value_are_one_key():
    """``out_dtype=None`` and ``out_dtype=<the operand dtype>`` are one tuning key; another dtype is not."""
    from tpukernels.autotune import db
    from tpukernels.dsl import TensorSpec
    from tpukernels.library import matmul_nn

    specs = (TensorSpec((8, 256, 256), "bfloat16", "a"), TensorSpec((8, 256, 256), "bfloat16", "b"), None)

    def key(out_dtype):
        return db.entry_key(matmul_nn, specs, (("activation", None), ("out_dtype", out_dtype), ("reduce_batch", False)))

    assert key("bfloat16") == key(None)
    assert key("float32") != key(None)
    assert key("float32")["statics"]["out_dtype"] == "float32"
