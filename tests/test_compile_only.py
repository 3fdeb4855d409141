"""Compile-only targets: real Mosaic + XLA:TPU compiles for chips we do not have (needs libtpu)."""

import importlib.metadata
import importlib.util
import os
import re

import jax
import pytest
import torch

import tpukernels as tk
from kernels_for_tests import EXAMPLES, copy_rows, load_example

pytestmark = pytest.mark.aot
CHIPS = ["v5e", "v6e", "tpu7x"]


def test_aot_extra_libtpu_matches_the_pinned_jax():
    """The `aot` extra's libtpu compiles with the pinned jax (0.0.52 with 0.10.2)."""
    assert importlib.metadata.version("libtpu") == "0.0.52" and jax.__version__ == "0.10.2"
    r = tk.compile_for(load_example("vector_add").vector_add, "v5e", "4096:f32", "4096:f32")
    assert r.ok, r.error


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("example, shapes", [
    ("vector_add", ("1000000:bf16", "1000000:bf16")),
    ("softmax", ("8192x4096:bf16",)),
    ("matmul", ("1024x1024:bf16", "1024x1024:bf16")),
    ("matmul", ("1000x999:f32", "999x1001:f32")),
])
def test_examples_compile_for_each_chip(chip, example, shapes):
    kernel = getattr(load_example(example), example)
    r = tk.compile_for(kernel, chip, *shapes)
    assert r.ok, r.error
    assert r.chip == chip and r.code_size_bytes > 0
    assert r.vmem_estimate_bytes <= r.vmem_limit_bytes
    assert "tpu.memory_space<vmem>" in r.mosaic_mlir and "func.func" in r.mosaic_mlir


def test_vmem_overflow_from_the_compiler_is_translated():
    # Our estimate (16 MiB) fits v5e's scoped 16 MiB, but Mosaic needs internal scratch on top: only the
    # real compiler knows, and its error comes back translated, not raised.
    matmul = load_example("matmul").matmul
    r = tk.compile_for(matmul, "v5e", "1024x4096:bf16", "4096x2048:bf16", config={"bm": 1024, "bn": 1024, "bk": 1024})
    assert not r.ok and r.error_kind == "vmem"
    assert "scoped limit 16 MiB on v5e" in r.error


def test_vmem_overflow_caught_before_compiling():
    r = tk.compile_for(copy_rows, "v5e", "65536x8192:f32", config={"br": 4096})
    assert not r.ok and r.error_kind == "vmem" and "> 128 MiB on v5e" in r.error
    # the result still carries the figures a sweep reads: 2 x 2 buffers of 4096 x 8192 f32 = 512 MiB
    assert r.vmem_estimate_bytes == 4 * 4096 * 8192 * 4 and r.vmem_limit_bytes == 128 * 2**20
    assert r.config == {"br": 4096} and r.config_source == "explicit"


def test_block_rule_violation_is_reported():
    r = tk.compile_for(copy_rows, "v6e", "48x256:bf16", config={"br": 12})
    assert not r.ok and r.error_kind == "block_shape" and "(8,128) rule" in r.error


def test_export_payload_is_a_tpu_custom_call():
    """What torch_tpu's jax_op hands to the TPU runtime: a tpu_custom_call with the Mosaic module."""
    low = tk.lower(load_example("softmax").softmax, "64x256:bf16", mode="mosaic")
    exported = jax.export.export(low.fn, platforms=["tpu"])(*low.arg_structs)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "interpret" not in text


def test_static_estimate_is_opt_in_and_positive():
    kernel = load_example("softmax").softmax
    assert tk.compile_for(kernel, "v6e", "256x512:f32").estimated_cycles is None
    r = tk.compile_for(kernel, "v6e", "256x512:f32", estimate_cycles=True)
    assert r.ok and r.estimated_cycles and r.estimated_cycles > 0


def test_static_estimate_of_a_rank1_block_kernel():
    """Pallas asks jax for the TPU generation while tracing rank-1 blocks; on a cpu host the export for the
    estimate raised "Unsupported TPU device kind: cpu" (a new user's vector_add --estimate)."""
    from tpukernels.targets.compile_only import export_for_chip

    kernel = load_example("vector_add").vector_add
    r = tk.compile_for(kernel, "v5e", "65536:f32", "65536:f32", estimate_cycles=True)
    assert r.ok and r.estimated_cycles and r.estimated_cycles > 0
    low = tk.lower(kernel, "65536:f32", "65536:f32", mode="mosaic")
    assert "tpu_custom_call" in export_for_chip(low.fn, "v5e", low.arg_structs).mlir_module()


def test_estimator_abort_keeps_the_compile_result(monkeypatch, capsys):
    """libtpu's static profiler aborting (signal 6 on some programs) is not a compile failure: the result
    keeps ok=True, its VMEM / code size, and says why there is no estimate; the CLI prints the table."""
    from tpukernels.cli import main
    from tpukernels.errors import LoweringError
    from tpukernels.targets import compile_only

    def abort(low, chip, timeout_s=600):
        raise LoweringError("static estimate on v5e failed: RAW: Raising signal 6")

    monkeypatch.setattr(compile_only, "static_estimated_cycles", abort)
    kernel = load_example("softmax").softmax
    r = tk.compile_for(kernel, "v5e", "256x512:f32", estimate_cycles=True)
    assert r.ok and r.code_size_bytes and r.estimated_cycles is None and "signal 6" in r.estimate_error
    assert tk.compile_for(kernel, "v5e", "256x512:f32").estimate_error is None
    assert main(["--import", os.path.join(EXAMPLES, "softmax.py"), "compile", "examples::softmax", "--shape", "256x512:f32",
                 "--chips", "v5e", "--estimate"]) == 0
    out = capsys.readouterr().out
    # the table's layout depends on the terminal width (rows or column-value blocks): check the cells' words
    assert re.search(r"\bok\b", out) and "FAIL" not in out and "n/a" in out
    assert "v5e: no static estimate (the compile is fine): static estimate on v5e failed" in out


def test_float16_compile_failure_names_the_likely_cause():
    kernel = load_example("softmax").softmax
    r = tk.compile_for(kernel, "v6e", "256x512:f16")
    assert not r.ok and r.error_kind == "compile" and "float16 operands (arrays [0])" in r.error


def test_unknown_chip_and_missing_libtpu(monkeypatch):
    kernel = load_example("softmax").softmax
    with pytest.raises(tk.ChipError, match="unknown TPU chip 'v3000'"):
        tk.compile_for(kernel, "v3000", "8x128:f32")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(tk.BackendUnavailableError, match=r"libtpu .*install the aot extra.*pip install -e '\.\[aot\]'"):
        tk.compile_for(kernel, "v5e", "8x128:f32")


def test_float64_example_args_are_rejected():
    with pytest.raises(tk.DTypeError, match="float64"):
        tk.compile_for(load_example("softmax").softmax, "v5e", torch.zeros(8, 128, dtype=torch.float64))


def _copy_big_limit_body(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@tk.tpu_kernel(_copy_big_limit_body, namespace="tktest", name="copy_big_limit",
               tunables={"br": tk.Tunable([256, 512])})
def copy_big_limit(x: torch.Tensor, *, br: int) -> torch.Tensor:
    from jax.experimental import pallas as pl

    spec = pl.BlockSpec((br, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], br),), in_specs=[spec], out_specs=spec, out_shape=tk.like(x),
                     vmem_limit_bytes=100 << 20)


def test_a_default_config_that_fails_is_reported_without_a_tuning_db_detour():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "ignoring the tuning-DB config" (there is none)
        r = tk.compile_for(copy_big_limit, "tpu7x", "4096x1024:f32")
    assert not r.ok and r.error_kind == "vmem"
    assert "vmem_limit_bytes 100 MiB > 64 MiB VMEM on tpu7x" in r.error
    assert r.config_source == "default" and r.vmem_limit_bytes == 64 * 2**20


def test_summary_gives_the_cycle_estimate_it_holds():
    """CompileResult.summary() shows the libtpu estimate it holds (cycles and a model time), why it is
    missing when asked for but absent, and no 'VMEM n/a' for a kernel without a tpukernels footprint."""
    from tpukernels.perf import clock_hz
    from tpukernels.targets.compile_only import CompileResult

    r = CompileResult("k", "v6e", True, vmem_estimate_bytes=3 << 20, vmem_limit_bytes=32 << 20, code_size_bytes=100,
                      estimated_cycles=1_750_000)
    us = 1_750_000 / clock_hz("v6e") * 1e6
    assert f"1,750,000 cycles (~{us:,.1f} us; libtpu static estimate, a model)" in r.summary()
    assert "VMEM 3.00 MiB (est.) of 32 MiB scoped" in r.summary()
    r = CompileResult("k", "v6e", True, vmem_limit_bytes=32 << 20, code_size_bytes=100, estimate_error="aborted")
    assert "no cycle estimate (aborted)" in r.summary() and "n/a" not in r.summary()
    assert "VMEM not estimated" in r.summary()
