"""tpukernels.library.gated_mlp: SwiGLU / GeGLU ``act(gate) * up``, forward and backward.

Ground truth: float64 ``act(gate) * up`` of the same low-precision inputs (torch's float64 activations) and its
float64 autograd gradients. Kernels run in Pallas interpret mode (both modes through the ``interpret``
fixture); the ``aot`` test builds the Mosaic kernels for v5e / v6e / tpu7x.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpukernels.errors import ArgumentError, DTypeError
from tpukernels.library import gated_mlp as G

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
U = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24}  # one rounding of the float32 result to the output dtype


def check(got, want, absolute, dtype, what=""):
    """|got - want| <= U[dtype] * |want| + absolute, elementwise (want float64).

    ``absolute`` bounds the float32 arithmetic: sigmoid / tanh / erf / exp are accurate to a few float32
    ulps of their O(1) results, and their errors are scaled by the polynomial factors in g (up to g^2 in
    gelu_tanh's derivative) and by |u| (|u * dy|): ``32 * 2**-24 * (1 + g^2) * |factor|``."""
    assert got.shape == want.shape and got.dtype == dtype, (what, got.shape, want.shape, got.dtype)
    err = (got.double() - want).abs()
    bound = U[dtype] * want.abs() + absolute
    bad = ~(err <= bound)
    worst = (err - bound)[bad].max() if bad.any() else 0
    assert not bad.any(), f"{what}: {int(bad.sum())}/{bad.numel()} out of tolerance, worst excess {worst:.3g}"


def f32_err(g, factor):
    return 32 * 2.0**-24 * (1 + g.double() ** 2) * factor.double().abs() + 1e-30


def rand(*shape, dtype=F32, scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def test_reference_matches_the_hf_modules():
    from transformers.activations import ACT2FN

    g, u = rand(7, 9, dtype=torch.float64), rand(7, 9, dtype=torch.float64, seed=1)
    torch.testing.assert_close(G.gated_activation_reference(g, u, "silu"), ACT2FN["silu"](g) * u)
    torch.testing.assert_close(G.gated_activation_reference(g, u, "gelu_tanh"), ACT2FN["gelu_pytorch_tanh"](g) * u)
    torch.testing.assert_close(G.gated_activation_reference(g, u, "gelu"), ACT2FN["gelu"](g) * u)


@pytest.mark.parametrize("activation", G.ACTIVATIONS)
def test_forward_backward_match_float64(interpret, activation):
    if interpret == "tpu" and activation != "gelu_tanh":
        pytest.skip("NaN-poisoned mode on one representative activation")
    # 3 x 50 rows x 200 cols: row bucketing (150 -> bucket) and a partial column block
    gate, up = rand(3, 50, 200).requires_grad_(), rand(3, 50, 200, seed=1).requires_grad_()
    y = G.gated_activation(gate, up, activation)
    ref = G.gated_activation_reference(gate, up, activation)
    check(y, ref, f32_err(gate, up), F32, "y")
    dy = rand(3, 50, 200, seed=2, scale=1.0)
    dg, du = torch.autograd.grad(y, (gate, up), dy)
    rdg, rdu = torch.autograd.grad(ref, (gate, up), dy.double())
    check(dg, rdg, f32_err(gate, up * dy), F32, "dgate")
    check(du, rdu, f32_err(gate, dy), F32, "dup")


@settings(max_examples=4)
@given(
    dtype=st.sampled_from([BF16, F16, F32]),
    lead=st.lists(st.integers(1, 9), min_size=0, max_size=2),
    i=st.sampled_from([1, 64, 128, 300]),
    activation=st.sampled_from(G.ACTIVATIONS),
)
def test_hypothesis_shapes_dtypes(dtype, lead, i, activation):
    gate = rand(*lead, i, dtype=dtype).requires_grad_()
    up = rand(*lead, i, dtype=dtype, seed=1).requires_grad_()
    y = G.gated_activation(gate, up, activation)
    ref = G.gated_activation_reference(gate, up, activation)
    check(y, ref, f32_err(gate, up), dtype, "y")
    dy = rand(*lead, i, dtype=dtype, seed=2, scale=1.0)
    dg, du = torch.autograd.grad(y, (gate, up), dy)
    rdg, rdu = torch.autograd.grad(ref, (gate, up), dy.double())
    check(dg, rdg, f32_err(gate, up.double() * dy.double()), dtype, "dgate")
    check(du, rdu, f32_err(gate, dy), dtype, "dup")


def test_module_matches_hf_llama_mlp_and_shares_weights():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=160, hidden_act="silu"))
    ours = G.TPUGatedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj, "silu")
    assert set(ours.state_dict()) == set(mlp.state_dict())
    assert ours.gate_proj.weight is mlp.gate_proj.weight
    x = torch.randn(2, 5, 64)
    # HF rounds act(g) then the product in float32; we round once: a few float32 ulps of the down projection
    torch.testing.assert_close(ours(x), mlp(x), rtol=1e-5, atol=1e-5)
    ours(x).sum().backward()
    g_ours = mlp.gate_proj.weight.grad.clone()
    mlp.zero_grad()
    mlp(x).sum().backward()
    torch.testing.assert_close(g_ours, mlp.gate_proj.weight.grad, rtol=1e-4, atol=1e-5)


def test_geglu_and_swiglu_names():
    g, u = rand(4, 128), rand(4, 128, seed=1)
    torch.testing.assert_close(G.swiglu(g, u), G.gated_activation(g, u, "silu"), rtol=0, atol=0)
    torch.testing.assert_close(G.geglu(g, u), G.gated_activation(g, u, "gelu_tanh"), rtol=0, atol=0)
    with pytest.raises(ArgumentError, match="approximate"):
        G.geglu(g, u, approximate="erf")


def test_errors_are_typed():
    g = rand(4, 128)
    with pytest.raises(ArgumentError, match="same shape"):
        G.swiglu(g, g[:, :64])
    with pytest.raises(DTypeError, match="must be equal"):
        G.swiglu(g, g.bfloat16())
    with pytest.raises(DTypeError, match="float64"):
        G.swiglu(g.double(), g.double())
    with pytest.raises(ArgumentError, match="activation must be one of"):
        G.gated_activation(g, g, "relu")
    with pytest.raises(ArgumentError, match="activation must be one of"):
        G.TPUGatedMLP(None, None, None, "tanh")
    assert G.swiglu(g[:0], g[:0]).shape == (0, 128)



@pytest.mark.parametrize("rows,i,cols,out_dtype", [(40, 384, 256, "bfloat16"), (8, 128, 1024, None),
                                                   (24, 256, 4096, "float32")])
def test_halves_read_the_fused_output_in_place(interpret, rows, i, cols, out_dtype):
    """``halves=True`` on one ``[rows, 2I]`` array (passed as gate and up) equals the kernel on its split halves
    bit for bit, in ``out_dtype``, at a block width that does not divide I (384 at 256: 128-column blocks); its
    gradient reaches that array as ``[dgate | dup]`` (float64 autograd of the split reference)."""
    h = rand(rows, 2 * i, seed=rows)
    cfg = {"block_rows": 256, "block_cols": cols}
    y = G.gated_activation_fwd(h, h, "silu", True, out_dtype, config=cfg)
    split = G.gated_activation_fwd(h[:, :i].contiguous(), h[:, i:].contiguous(), "silu", False, out_dtype)
    assert y.dtype == (BF16 if out_dtype == "bfloat16" else F32) and y.shape == (rows, i)
    assert torch.equal(y, split)
    hg, hd = h.clone().requires_grad_(), h.double().requires_grad_()
    dy = rand(rows, i, seed=1)
    (G.gated_activation_fwd(hg, hg, "silu", True, None, config=cfg) * dy).sum().backward()
    (G.gated_activation_reference(hd[:, :i], hd[:, i:]) * dy.double()).sum().backward()
    check(hg.grad, hd.grad, f32_err(h, (1 + h.abs()) * dy.repeat(1, 2)), F32, "d[gate | up]")
    # two arrays: the gate half of the first, the up half of the second, each gradient in its own half
    a, b = hg.detach().clone().requires_grad_(), rand(rows, 2 * i, seed=rows + 1).requires_grad_()
    (G.gated_activation_fwd(a, b, "silu", True, None, config=cfg) * dy).sum().backward()
    ad, bd = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    (G.gated_activation_reference(ad[:, :i], bd[:, i:]) * dy.double()).sum().backward()
    assert not a.grad[:, i:].any() and not b.grad[:, :i].any()
    check(a.grad[:, :i], ad.grad[:, :i], f32_err(a[:, :i], (1 + b[:, i:].abs()) * dy), F32, "dgate")
    check(b.grad[:, i:], bd.grad[:, i:], f32_err(a[:, :i], dy.abs() * (1 + a[:, :i].abs())), F32, "dup")


def test_halves_and_out_dtype_errors_are_typed():
    h = rand(8, 192)
    with pytest.raises(ArgumentError, match=r"halves=True needs \[rows, 2 I\] with I a positive multiple of 128"):
        G.gated_activation_fwd(h, h, "silu", True)
    with pytest.raises(DTypeError, match="out_dtype must be"):
        G.gated_activation_fwd(h, h, "silu", False, "float16")
    with pytest.raises(ArgumentError, match=r"\[rows, 2 I\] \(halves=True\)"):
        G.gated_activation_fwd(rand(8, 256), rand(8, 512), "silu", True)

@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_compile_only(chip, tmp_cache):
    from tpukernels.targets.compile_only import compile_for

    for kernel, args, kw in G.STANDARD_CASES:
        for act in ("silu", "gelu"):
            r = compile_for(kernel, chip, *args, with_mlir=False, **dict(kw, activation=act))
            assert r.ok, r.summary()
            assert r.vmem_estimate_bytes <= G.VMEM_BUDGET_BYTES, r.summary()
    # fused_moe's form: the halves of Qwen3-30B-A3B's [T*k, 2I] float32 gate/up output read in place, h in bf16
    r = compile_for(G.gated_activation_fwd, chip, "4096x1536:f32", "4096x1536:f32", with_mlir=False,
                    activation="silu", halves=True, out_dtype="bfloat16")
    assert r.ok, r.summary()
    assert r.vmem_estimate_bytes <= G.VMEM_BUDGET_BYTES, r.summary()
