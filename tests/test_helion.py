"""Helion front-end: parity with the Pallas front-end, torch op integration, compile-only, errors."""

import pytest
import torch

import tpukernels as tk
from kernels_for_tests import load_example

H = load_example("helion_kernels")
P = {name: getattr(load_example(name), name) for name in ("vector_add", "softmax", "matmul")}


@pytest.mark.parametrize("mode", ["fast", "tpu"])
@pytest.mark.parametrize("name, make", [
    ("vector_add", lambda g: (torch.randn(8192, generator=g), torch.randn(8192, generator=g))),
    ("softmax", lambda g: (torch.randn(64, 256, generator=g) * 3,)),
    ("softmax", lambda g: ((torch.randn(32, 512, generator=g) * 3).bfloat16(),)),
    ("matmul", lambda g: (torch.randn(256, 256, generator=g), torch.randn(256, 128, generator=g))),
])
def test_parity_between_front_ends(name, make, mode):
    args = make(torch.Generator().manual_seed(1))
    helion_out = getattr(H, name)(*args, interpret=mode)
    pallas_out = P[name](*args, interpret=mode)
    assert helion_out.dtype == pallas_out.dtype and helion_out.shape == pallas_out.shape
    if name == "matmul":  # different K-tilings: same f32 math, accumulation order may differ
        want = args[0].double() @ args[1].double()
        torch.testing.assert_close(helion_out.double(), want, rtol=1e-5, atol=2e-4)
        torch.testing.assert_close(pallas_out.double(), want, rtol=1e-5, atol=2e-4)
    else:
        assert torch.equal(helion_out, pallas_out)


def test_fused_elementwise_reduction_matches_float64():
    x, w = torch.randn(64, 1024), torch.randn(1024)
    got = H.rms_scale(x, w)  # eps left at its default: exercises default-filling in the op
    torch.testing.assert_close(got.double(), H.rms_scale_reference(x, w), rtol=1e-5, atol=1e-5)


def test_helion_tunables_are_introspectable_and_selectable():
    assert H.softmax.space.names == ("block_sizes",)
    x = torch.randn(64, 256)
    a = H.softmax(x, config={"block_sizes": (8,)})
    b = H.softmax(x, config={"block_sizes": (64,)})
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # reduction vectorization may differ per tile
    keys = {low.config["block_sizes"] for low in H.softmax._entries.values()}
    assert {(8,), (64,)} <= keys


def test_opcheck_and_fullgraph_compile():
    x = torch.randn(64, 256)
    torch.library.opcheck(torch.ops.examples_helion.softmax, (x,))
    fn = torch.compile(lambda t: H.softmax(t) * 2, fullgraph=True)
    torch.testing.assert_close(fn(x), 2 * torch.softmax(x, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
@pytest.mark.parametrize("name, shapes", [("vector_add", ("1048576:f32", "1048576:f32")), ("softmax", ("8192x4096:bf16",)),
                                          ("matmul", ("1024x1024:bf16", "1024x1024:bf16"))])
def test_both_front_ends_compile_for_each_chip(chip, name, shapes):
    for kernel in (getattr(H, name), P[name]):
        r = tk.compile_for(kernel, chip, *shapes)
        assert r.ok, r.error
        assert "tpu.memory_space" in r.mosaic_mlir


def test_unsupported_dtypes_name_the_feature():
    with pytest.raises(tk.DTypeError, match="float64 is not supported"):
        H.softmax(torch.randn(64, 256, dtype=torch.float64))
    with pytest.raises(tk.DTypeError, match="int64"):
        H.vector_add(torch.arange(8192), torch.arange(8192))


def test_partial_tiles_are_padded_and_sliced():
    """A row count (100) that is not a multiple of the row block (32) used to be refused; it now runs on
    zero-padded rows and the result is sliced back."""
    x = torch.randn(100, 256)
    got = H.softmax(x, config={"block_sizes": (32,)})
    assert got.shape == (100, 256)
    torch.testing.assert_close(got.double(), torch.softmax(x.double(), -1), rtol=0, atol=1e-6)


import helion.language as hl  # noqa: E402


@tk.tpu_kernel(backend="helion", namespace="tktest_helion", tunables={"block_sizes": tk.Tunable([(16, 128)])})
def add_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, n = x.size()
    out = torch.empty_like(x)
    for tm, tn in hl.tile([m, n]):
        out[tm, tn] = x[tm, tn] + b[tn]
    return out


@tk.tpu_kernel(backend="helion", namespace="tktest_helion", tunables={"block_sizes": tk.Tunable([(16, 128)])})
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    m, n = x.size()
    out = torch.empty_like(x)
    for tm, tn in hl.tile([m, n]):
        out[tm, tn] = torch.nn.functional.gelu(x[tm, tn], approximate="tanh")
    return out


@pytest.mark.parametrize("mode", ["fast", "tpu"])
def test_a_tile_indexed_dim_smaller_than_its_tile_extent_is_an_argument_error(mode):
    """b[tn] with b [128] and tn over x's 256 columns used to return x + b wrapped around (b[0..127] twice),
    even in the TPU-faithful interpreter; no shapes= was declared."""
    x = torch.randn(64, 256)
    with pytest.raises(tk.ArgumentError, match=r"b has shape \(128,\), but the program indexes its dim 0 with tile "
                                               r"'tn', which runs over 256 elements.*Declare shapes="):
        add_bias(x, torch.randn(128), interpret=mode)
    b = torch.randn(256)
    torch.testing.assert_close(add_bias(x, b, interpret=mode).double(), x.double() + b.double(), rtol=0, atol=1e-6)
    long_b = torch.randn(512)  # larger than the extent: the tile reads its first 256 (in bounds), as Helion means
    torch.testing.assert_close(add_bias(x, long_b, interpret=mode).double(), x.double() + long_b[:256].double(),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["fast", "tpu"])
def test_partial_tiles_work_in_every_mode(mode):
    """interpret="tpu" used to raise a raw JaxRuntimeError (an out-of-bounds DMA in the interpreter) where fast
    mode gave a LoweringError; partial tiles are now padded to the block and the outputs sliced back, in
    every mode, and the inputs are untouched."""
    x, b = torch.randn(100, 300), torch.randn(300)
    x0, b0 = x.clone(), b.clone()
    got = add_bias(x, b, interpret=mode)
    assert got.shape == (100, 300)
    torch.testing.assert_close(got.double(), x.double() + b.double(), rtol=0, atol=1e-6)
    assert torch.equal(x, x0) and torch.equal(b, b0)
    # one block covering a whole dim is not a partial tile; K padded by Helion (_ds_pad_dims) is not either
    got = add_bias(x, b, interpret=mode, config={"block_sizes": (128, 512)})
    torch.testing.assert_close(got.double(), x.double() + b.double(), rtol=0, atol=1e-6)
    a, w = torch.randn(256, 300), torch.randn(300, 128)
    got = H.matmul(a, w, interpret=mode, config={"block_sizes": (128, 128, 128)})
    torch.testing.assert_close(got.double(), a.double() @ w.double(), rtol=1e-5, atol=2e-4)


def test_an_unsupported_feature_raises_without_helions_log_traceback(capfd, caplog):
    """Helion logged "Helion compiler triton codegen error" with a full traceback on stderr at every call,
    before tpukernels' LoweringError."""
    import logging

    caplog.set_level(logging.WARNING)
    for mode in ("fast", "tpu", "fast"):
        with pytest.raises(tk.LoweringError, match=r"approximate='tanh'.*Pallas-style"):
            gelu_tanh(torch.randn(64, 256), interpret=mode)
    err = capfd.readouterr().err
    assert "codegen error" not in err and "Traceback" not in err
    assert not [r for r in caplog.records if "codegen error" in r.getMessage()]
    logger = logging.getLogger("helion.runtime.kernel")
    assert not logger.filters  # the filter is only there during the attempt


def test_a_shape_mismatch_inside_the_program_is_an_argument_error():
    x, w = torch.randn(64, 256), torch.randn(128)  # rms_scale broadcasts w over x's 256 columns
    with pytest.raises(tk.ArgumentError, match=r"input shapes .* do not fit this program.*declare shapes="):
        H.rms_scale(x, w)


def test_helion_decorator_misuse():
    def body(x_ref, o_ref): ...

    with pytest.raises(tk.KernelDefinitionError, match="pass no body"):
        tk.tpu_kernel(body, backend="helion")
    with pytest.raises(tk.KernelDefinitionError, match="backend must be"):
        tk.tpu_kernel(body, backend="triton")


@tk.tpu_kernel(backend="helion", namespace="tktest_helion")
def add_twice(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for tile in hl.tile(x.size()):
        out[tile] = x[tile] + 2 * y[tile]
    return out


@pytest.mark.parametrize("mode", ["fast", "tpu"])
def test_helion_tile_program_on_a_300x260_input(mode):
    """The issue's example: Helion's default blocks do not divide 300x260; the tails now work in every mode."""
    x, y = torch.randn(300, 260), torch.randn(300, 260)
    got = add_twice(x, y, interpret=mode)
    torch.testing.assert_close(got.double(), x.double() + 2 * y.double(), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------ output tails (issue 36 item 10)
@pytest.mark.parametrize("mode, m, k, n", [
    ("fast", 200, 256, 128),  # M tail: the output's rows (torch.empty([m, n]) in the body) cover 2 blocks in part
    ("fast", 256, 256, 130),  # N tail
    ("fast", 200, 200, 256),  # square a: only its rows pad (K stays 200); out's N (256) equals padded M, not cut
    ("tpu", 200, 300, 130),   # both tails and a K tail, in the NaN-poisoning TPU interpreter
    ("races", 200, 256, 128),
])
def test_output_tails_of_a_matmul_match_float64(mode, m, k, n):
    """A matmul whose output the body allocates used to raise "tensor operand 2 dim 0 (200) is not a multiple of
    its block": Helion pads a's and b's reads itself, so only the output was partial and nothing padded it."""
    g = torch.Generator().manual_seed(m + n)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    a0, b0 = a.clone(), b.clone()
    got = H.matmul(a, b, interpret=mode, config={"block_sizes": (128, 128, 128)})
    assert got.shape == (m, n)
    torch.testing.assert_close(got.double(), a.double() @ b.double(), rtol=1e-5, atol=2e-4)
    assert torch.equal(a, a0) and torch.equal(b, b0)


@tk.tpu_kernel(backend="helion", namespace="tktest_helion", config={"block_sizes": [128, 128]})
def shifted_rows(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out[i, j] = x[i, j] + b[j] for the first m - 56 rows: an output dim no input dim has the size of."""
    m, n = x.size()
    out = torch.empty([m - 56, n], dtype=x.dtype, device=x.device)
    for tm, tn in hl.tile([m - 56, n]):
        out[tm, tn] = x[tm, tn] + b[tn]
    return out


@pytest.mark.parametrize("mode", ["fast", "tpu"])
def test_an_output_tail_padding_cannot_reach_names_the_output_and_the_callers_shapes(mode):
    """The message listed the padded shapes ((384,) for a (300,) bias) and called the output "tensor operand 2"."""
    x, b = torch.randn(256, 300), torch.randn(300)
    with pytest.raises(tk.LoweringError, match=r"inputs \[\(256, 300\), \(300,\)\].*output 0 dim 0 \(200\) is not a "
                                               r"multiple of its block 128") as e:
        shifted_rows(x, b, interpret=mode)
    assert "384" not in str(e.value) and "operand" not in str(e.value)
    # rows 440 pad to 512, which makes the output 456 rows long: said so, with the caller's shapes
    with pytest.raises(tk.LoweringError, match=r"inputs \[\(440, 300\), \(300,\)\].*padding the inputs to whole "
                                               r"blocks \(b dim 0 300 -> 384, x dim 0 440 -> 512, x dim 1 300 -> "
                                               r"384\) makes output 0 dim 0 456 long"):
        shifted_rows(torch.randn(440, 300), b, interpret=mode)
    x = torch.randn(120, 300)  # 64 output rows, one block: only the input tails (300 columns) pad
    got = shifted_rows(x, b, interpret=mode)
    torch.testing.assert_close(got.double(), x[:64].double() + b.double(), rtol=0, atol=1e-6)


@pytest.mark.aot
def test_compile_for_pads_output_tails_and_reports_what_cannot_compile():
    """compile_for raised the LoweringError; a tail shape now compiles, and what still cannot is a failed result."""
    r = tk.compile_for(H.matmul, "v5e", "200x256:bf16", "256x130:bf16", config={"block_sizes": (128, 128, 128)})
    assert r.ok, r.error
    r = tk.compile_for(shifted_rows, "v5e", "256x300:f32", "300:f32")
    assert not r.ok and r.error_kind == "lowering"
    assert "output 0 dim 0 (200)" in r.error and "(300,)" in r.error and "384" not in r.error
    r = tk.compile_for(gelu_tanh, "v5e", "64x256:f32")  # a feature Helion cannot lower: reported, not raised
    assert not r.ok and r.error_kind == "lowering" and "approximate='tanh'" in r.error


# ----------------------------------------------------------------------------- static ints as sizes (value-keyed)
@tk.tpu_kernel(backend="helion", namespace="tktest_helion", config={"block_sizes": [64, 128]})
def first_rows_doubled(x: torch.Tensor, m: int) -> torch.Tensor:
    """2 * x[:m]: the static int m sizes the output and the tiled range."""
    n = x.size(1)
    out = torch.empty([m, n], dtype=x.dtype, device=x.device)
    for tm, tn in hl.tile([m, n]):
        out[tm, tn] = x[tm, tn] * 2
    return out


@tk.tpu_kernel(backend="helion", namespace="tktest_helion", config={"block_sizes": [64, 128]})
def scaled_shifted(x: torch.Tensor, k: int, c: float) -> torch.Tensor:
    """x * k + c: static values used only in arithmetic."""
    out = torch.empty_like(x)
    for tile in hl.tile(x.size()):
        out[tile] = x[tile] * k + c
    return out


@pytest.mark.parametrize("mode", ["fast", "tpu"])
def test_a_static_int_used_as_a_size_gets_its_own_program_per_value(mode):
    """Helion keys a plain int argument by its type: after a call with m=128, a call with m=64 returned 128 rows
    (the first call's program), silently; each value now gets its own program."""
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(3))
    for m in (128, 64, 192, 128):
        got = first_rows_doubled(x, m, interpret=mode)
        assert got.shape == (m, 128)
        torch.testing.assert_close(got.double(), 2 * x[:m].double(), rtol=0, atol=0)


def test_static_scalars_used_in_arithmetic_give_each_calls_value():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    for k, c in ((2, 0.5), (3, 0.5), (-1, 0.5), (3, -2.25)):
        got = scaled_shifted(x, k, c)
        torch.testing.assert_close(got.double(), x.double() * k + c, rtol=1e-6, atol=1e-6)
