"""No silent misses: unwritten output blocks, data races and inputs smaller than their blocks read are typed
errors naming the kernel, the output / argument and the block, in every interpret mode where they are
detectable (static checks before running in all modes; NaN-poison and race checks in the checked modes)."""

from __future__ import annotations

import pytest
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import tpukernels as tk
from tpukernels.errors import ArgumentError, KernelRaceError, UnwrittenOutputError


def _add_body(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


@tk.tpu_kernel(_add_body, name="sm_add", namespace="tktest_sm")
def sm_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    spec = pl.BlockSpec((128, 128), lambda i, j: (i, j))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], 128), tk.cdiv(x.shape[1], 128)), in_specs=[spec, spec],
                     out_specs=spec, out_shape=tk.like(x))


def _copy_body(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@tk.tpu_kernel(_copy_body, name="sm_half_grid", namespace="tktest_sm")
def sm_half_grid(x: torch.Tensor) -> torch.Tensor:
    """A grid that covers only half of the output's row blocks (a cdiv by twice the block)."""
    spec = pl.BlockSpec((128, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], 256),), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))


def _skip_body(x_ref, o_ref):
    @pl.when(pl.program_id(0) != 0)  # the bug: block 0 is visited but never stored
    def _():
        o_ref[...] = x_ref[...] * 2


@tk.tpu_kernel(_skip_body, name="sm_skip_store", namespace="tktest_sm")
def sm_skip_store(x: torch.Tensor) -> torch.Tensor:
    spec = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
    return tk.Launch(grid=(tk.cdiv(x.shape[0], 8),), in_specs=[spec], out_specs=spec, out_shape=tk.like(x))


def _racy_body(x_hbm, o_ref, buf, sem):
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    o_ref[...] = buf[...]  # the bug: read before copy.wait()
    copy.wait()


@tk.tpu_kernel(_racy_body, name="sm_racy", namespace="tktest_sm")
def sm_racy(x: torch.Tensor) -> torch.Tensor:
    return tk.Launch(grid=(), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                     out_specs=pl.BlockSpec(tuple(x.shape), lambda: (0, 0)), out_shape=tk.like(x),
                     scratch_shapes=[pltpu.VMEM(tuple(x.shape), x.dtype), pltpu.SemaphoreType.DMA(())])


@pytest.mark.parametrize("y_shape", [(300, 256), (512, 128), (400, 256)], ids=["fewer-rows", "fewer-cols", "tail"])
def test_input_smaller_than_its_blocks_is_a_typed_error(interpret, y_shape):
    x, y = torch.randn(512, 256), torch.randn(*y_shape)
    y0 = y.clone()
    with pytest.raises(ArgumentError, match=r"argument 'y' has shape " + str(tuple(y_shape)).replace("(", r"\(").replace(")", r"\)")):
        sm_add(x, y)
    assert torch.equal(y, y0)


def test_add_at_matching_shapes_still_right(interpret):
    x, y = torch.randn(300, 260), torch.randn(300, 260)  # legal partial tail blocks: x, y, out alike
    torch.testing.assert_close(sm_add(x, y).double(), x.double() + y.double(), rtol=0, atol=1e-6)


def test_output_blocks_no_grid_step_writes(interpret):
    with pytest.raises(UnwrittenOutputError, match=r"sm_half_grid: output 0 \(512, 128\).*block \(2, 0\)") as e:
        sm_half_grid(torch.randn(512, 128))
    assert (e.value.kernel, e.value.output, e.value.block) == ("tktest_sm::sm_half_grid", 0, (2, 0))


def test_compile_for_refuses_unwritten_output_blocks():
    res = tk.compile_for(sm_half_grid, "v6e", "512x128:f32")
    assert not res.ok and res.error_kind == "unwritten_output" and "block (2, 0)" in res.error


def test_body_that_skips_a_store_is_caught_in_tpu_mode():
    x = torch.randn(32, 128)
    with pytest.raises(UnwrittenOutputError, match=r"sm_skip_store: output 0 \(32, 128\): block \(0, 0\)"):
        sm_skip_store(x, interpret="tpu")


def test_nan_from_nan_inputs_is_not_flagged():
    """NaN inputs may rightly give NaN blocks: the poison check stands down (block 0 is still unwritten,
    but the kernel cannot be told apart from a correct one here)."""
    x = torch.full((32, 128), float("nan"))
    out = sm_skip_store(x, interpret="tpu")
    assert out.isnan().all()


def test_data_race_is_reported_in_races_mode():
    x = torch.randn(8, 128)
    with pytest.raises(KernelRaceError, match="sm_racy"):
        sm_racy(x, interpret="races")


def test_races_mode_passes_a_race_free_kernel():
    x = torch.randn(300, 260)
    torch.testing.assert_close(sm_add(x, x, interpret="races").double(), 2 * x.double(), rtol=0, atol=1e-6)



def test_fast_mode_no_longer_clamps_a_data_dependent_out_of_bounds_read():
    """Fast interpret mode used to clamp table[5] of a 4-row table to table[3] silently; the data-dependent
    index map is now evaluated on the call's scalar-prefetch values first (mode "tpu" raised already)."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import kernels_for_tests as K
    from tpukernels.errors import KernelRuntimeError

    table = torch.randn(4, 1, 128)
    ok = torch.tensor([0, 3, 1], dtype=torch.int32)
    torch.testing.assert_close(K.gather_rows(ok, table, interpret="fast"), 2 * table[[0, 3, 1]], rtol=0, atol=0)
    for mode in ("fast", "tpu"):
        with pytest.raises(KernelRuntimeError, match="gather_rows"):
            K.gather_rows(torch.tensor([0, 5, 1], dtype=torch.int32), table, interpret=mode)


def test_a_slow_interpret_call_says_so_once(monkeypatch, caplog):
    import logging

    from tpukernels.targets import cpu

    monkeypatch.setattr(cpu, "SLOW_CALL_S", 0.0)
    monkeypatch.setattr(cpu, "_SAID_SLOW", False)
    x = torch.randn(8, 128)
    with caplog.at_level(logging.WARNING, logger="tpukernels"):
        sm_add(x, x)
        sm_add(x, x)
    said = [r for r in caplog.records if "interpret mode simulates" in r.getMessage()]
    assert len(said) == 1 and "sm_add" in said[0].getMessage()


def test_checked_mode_takes_float8_inputs():
    """The NaN-poison check reads float8 inputs (torch has no isfinite for them) instead of failing."""
    from tpukernels.library import quantize_weight, quantized_matmul

    x = torch.randn(16, 256)
    w_q, w_scale = quantize_weight(torch.randn(128, 256), "float8_e4m3fn")
    want = x.double() @ (w_q.double() * w_scale.double()[:, None]).T
    got = quantized_matmul(x, w_q, w_scale)
    with tk.interpret_mode("tpu"):
        got_tpu = quantized_matmul(x, w_q, w_scale)
    torch.testing.assert_close(got_tpu, got, rtol=0, atol=0)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
