"""Gradients of every differentiable public op: ``torch.autograd.gradcheck`` in float32, and double backward.

Issue 36 item 12. Each op's analytical backward (its ``def_backward``, Pallas kernels in interpret mode) is compared
with central finite differences of its forward by ``torch.autograd.gradcheck(fast_mode=True)``: one random
projection ``v^T J u`` per (input, output) pair instead of the full Jacobian, so a wrong, missing or mis-scaled
gradient of any input still fails while a case costs a handful of forward calls. Ops whose backward is differentiable
(declared ``double_backward=True``: matmul, grouped_matmul, apply_rope) are checked by ``gradgradcheck``; every other
op raises :class:`tpukernels.NotSupportedError` naming the op on a double backward (it used to raise
``KernelDefinitionError`` about an inner ``*_bwd`` kernel, or, for ``linear_cross_entropy``'s ``h``, drop a term).

Tolerances (float32), the same for every op. Fast mode compares the scalar ``v^T J u`` (unit vectors ``u``, ``v``;
here 2.6e-3 to 1.9 in magnitude) as ``|a - n| <= RTOL * |n| + ATOL * sum(u) * sum(v)``: ATOL is per Jacobian
element, as in slow mode, and the factor is ~ 0.75 * sqrt(inputs * outputs), up to ~1.5e3 at these sizes (so an
ATOL of 2e-2 accepted anything, a gradient 3% off included). Central differences in float32: the rounding error
~ 2**-24 * |f| / EPS shrinks with a larger EPS, the truncation error ~ EPS**2 * |f'''| grows. With EPS = 1e-2 the
scalar linear_cross_entropy loss (|f| ~ 5.5, |v^T J u| ~ 2.6e-3) was still rounding-bound (relative error 1.1e-2);
with EPS = 3e-2, measured on every case here: relative error <= 1.4e-3 (linear_cross_entropy), <= 7.5e-4 for
every other op, absolute <= 6e-5.
  EPS = 3e-2; RTOL = 5e-3 (3.5x the worst measured); ATOL = 1e-8 (<= ~1.5e-5 on the compared scalar). A gradient
  1% off (one input's) fails: checked by scaling the rms_norm and matmul backward's result by 1.01.
"""

import importlib

import pytest
import torch

import tpukernels as tk
from tpukernels import library as L

EPS, ATOL, RTOL = 3e-2, 1e-8, 5e-3
gq = importlib.import_module("tpukernels.library.grouped_matmul_ops.quant")
qb = importlib.import_module("tpukernels.library.quantized_matmul_ops.blockwise")


def _rand(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).requires_grad_()


# name -> (make(g) -> (fn, differentiable inputs), op named by its double-backward error, or None when the op's
# double backward is supported and checked by gradgradcheck)
def _norm(g):
    return (lambda x, w: L.rms_norm(x, w)), (_rand(g, 16, 128), _rand(g, 128))


def _layer_norm(g):
    return (lambda x, w, b: L.layer_norm(x, w, b)), (_rand(g, 16, 128), _rand(g, 128), _rand(g, 128))


def _fused_add(g):
    return (lambda x, r, w: L.fused_add_rms_norm(x, r, w)), (_rand(g, 16, 128), _rand(g, 16, 128), _rand(g, 128))


def _attention(g):
    return (lambda q, k, v: L.flash_attention(q, k, v, causal=True)), tuple(_rand(g, 1, 2, 16, 64) for _ in range(3))


def _attention_masked(g):
    from tpukernels.library.attention.masks import CausalMask

    mask = CausalMask((16, 16))
    return (lambda q, k, v: L.flash_attention(q, k, v, mask=mask)), tuple(_rand(g, 1, 2, 16, 64) for _ in range(3))


def _attention_rope(g):
    cos, sin = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    return ((lambda q, k, v: L.flash_attention(q, k, v, causal=True, rope_cos=cos, rope_sin=sin)),
            tuple(_rand(g, 1, 2, 16, 64) for _ in range(3)))


def _matmul(g):
    return ((lambda a, b, bias: L.matmul(a, b, bias, activation="gelu_tanh")),
            (_rand(g, 16, 128), _rand(g, 128, 128, scale=0.1), _rand(g, 128)))


def _lce(g):
    labels = torch.randint(0, 256, (16,), generator=g)
    labels[3] = -100  # an ignored row
    return (lambda h, w: L.linear_cross_entropy(h, w, labels)), (_rand(g, 16, 128), _rand(g, 256, 128, scale=0.1))


def _lce_h(g):
    """Only ``h`` requires grad: its gradient is the ``dh`` output the forward kernel computed, so a double backward
    used to flow into that output's ignored gradient and return a second derivative of 0 (float64: ~8e-4)."""
    labels = torch.randint(0, 256, (16,), generator=g)
    w = torch.randn(256, 128, generator=g) * 0.1
    return (lambda h: L.linear_cross_entropy(h, w, labels)), (_rand(g, 16, 128),)


def _grouped(g):
    sizes = torch.tensor([5, 0, 9], dtype=torch.int32)  # an empty group and 2 rows of no group
    return ((lambda x, w, bias: L.grouped_matmul(x, w, sizes, rhs_bias=bias)),
            (_rand(g, 16, 128), _rand(g, 3, 128, 128, scale=0.1), _rand(g, 3, 1, 128)))


def _rope(g):
    cos, sin = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    return (lambda x: L.apply_rope(x, cos, sin)), (_rand(g, 1, 2, 16, 64),)


def _gated(activation):
    def make(g):
        return (lambda a, b: L.gated_activation(a, b, activation)), (_rand(g, 16, 128), _rand(g, 16, 128))

    return make


def _quantized(g):
    w_q, w_s = L.quantize_weight(torch.randn(128, 128, generator=g))
    return (lambda x: L.quantized_matmul(x, w_q, w_s)), (_rand(g, 16, 128),)


def _quantized_blockwise(g):
    w_q, w_s, _ = qb.quantize_weight_blockwise(torch.randn(128, 256, generator=g), 128, "int8")
    return (lambda x: L.quantized_matmul_blockwise(x, w_q, w_s, block_size=128)), (_rand(g, 16, 256),)


def _grouped_quantized(g):
    rhs, s, z = gq.quantize_experts(torch.randn(2, 128, 128, generator=g), None, "int8")
    sizes = torch.tensor([7, 9], dtype=torch.int32)
    return (lambda x: L.grouped_matmul_quantized(x, rhs, sizes, s, rhs_zero_point=z, transpose_rhs=True)), \
        (_rand(g, 16, 128),)


CASES = [
    ("rms_norm", _norm, "rms_norm"),
    ("layer_norm", _layer_norm, "layer_norm"),
    ("fused_add_rms_norm", _fused_add, "fused_add_rms_norm"),
    ("flash_attention", _attention, "flash_attention"),
    ("flash_attention_mask", _attention_masked, "flash_attention"),
    ("flash_attention_rope", _attention_rope, "flash_attention"),
    ("matmul", _matmul, None),
    ("linear_cross_entropy", _lce, "linear_cross_entropy"),
    ("linear_cross_entropy_h", _lce_h, "linear_cross_entropy"),
    ("grouped_matmul", _grouped, None),  # second derivatives: test_grouped_matmul_public
    ("apply_rope", _rope, None),
    ("swiglu", _gated("silu"), "gated_activation"),
    ("geglu", _gated("gelu_tanh"), "gated_activation"),
    ("gated_gelu", _gated("gelu"), "gated_activation"),
    ("quantized_matmul", _quantized, "quantized_matmul"),
    ("quantized_matmul_blockwise", _quantized_blockwise, "quantized_matmul_blockwise"),
    ("grouped_matmul_quantized", _grouped_quantized, "grouped_matmul_quantized"),
]


@pytest.mark.parametrize("name, make, _op", CASES)
def test_gradcheck_float32(name, make, _op):
    fn, inputs = make(torch.Generator().manual_seed(0))
    assert torch.autograd.gradcheck(fn, inputs, eps=EPS, atol=ATOL, rtol=RTOL, fast_mode=True)


@pytest.mark.parametrize("name, make, op", CASES)
def test_double_backward_is_checked_or_a_typed_error_naming_the_op(name, make, op):
    fn, inputs = make(torch.Generator().manual_seed(0))
    if op is None:  # the backward is differentiable (declared double_backward=True): its derivative must be right
        assert torch.autograd.gradgradcheck(fn, inputs, eps=EPS, atol=ATOL, rtol=RTOL, fast_mode=True)
        return
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o * torch.randn(o.shape, generator=torch.Generator().manual_seed(1))).sum() for o in outs)
    grads = torch.autograd.grad(loss, inputs, create_graph=True)
    assert all(gr.requires_grad for gr in grads)  # differentiating them is what must fail, not a silent zero
    with pytest.raises(tk.NotSupportedError, match=rf"^{op}\b.*double backward is not supported") as e:
        sum((gr * gr).sum() for gr in grads).backward()
    assert e.value.op.startswith(op)
    assert all(x.grad is None for x in inputs)  # nothing accumulated into the leaves before the error
