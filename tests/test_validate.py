"""Checks before lowering: (8,128) block rules, packing warnings, VMEM footprint per chip."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import tpukernels as tk
from tpukernels.chips import get_chip
from tpukernels.dsl.validate import check_block, check_vmem, estimate_vmem, padded_bytes


@pytest.mark.parametrize(
    "block, array, ok",
    [
        ((8, 128), (64, 256), True),
        ((16, 256), (64, 256), True),
        ((64, 200), (64, 200), True),  # full dims are always fine
        ((12, 128), (48, 256), False),
        ((8, 100), (48, 200), False),
        ((None, 128), (16, 256), False),  # a squeezed second-minor dim counts as 1
        ((None, 8, 128), (4, 16, 256), True),
    ],
)
def test_block_rule_for_rank_2_and_more(block, array, ok):
    spec = pl.BlockSpec(block, lambda *i: i)
    if ok:
        check_block(spec, array, np.float32, "x")
    else:
        with pytest.raises(tk.BlockShapeError, match=r"violates the \(8,128\) rule for float32"):
            check_block(spec, array, np.float32, "x")


@pytest.mark.parametrize("block, n, ok", [((1024,), 4096, True), ((256,), 4096, True), ((4000,), 4000, True),
                                          ((1000,), 4000, False), ((64,), 4096, False)])
def test_block_rule_for_rank_1(block, n, ok):
    spec = pl.BlockSpec(block, lambda i: (i,))
    if ok:
        check_block(spec, (n,), np.float32, "x")
    else:
        with pytest.raises(tk.BlockShapeError, match="rank-1 block"):
            check_block(spec, (n,), np.float32, "x")


def test_bf16_block_of_8_rows_is_legal_but_warns_about_packing():
    spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    with pytest.warns(tk.PerformanceWarning, match="multiple of 16"):
        check_block(spec, (64, 256), jnp.bfloat16, "x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_block(pl.BlockSpec((16, 128), lambda i, j: (i, j)), (64, 256), jnp.bfloat16, "x")
    with pytest.warns(tk.PerformanceWarning, match="multiple of 32"):
        check_block(pl.BlockSpec((16, 128), lambda i, j: (i, j)), (64, 256), jnp.int8, "x")


def test_padded_bytes_pads_to_native_tiles():
    assert padded_bytes((8, 128), np.float32) == 8 * 128 * 4
    assert padded_bytes((1, 100), np.float32) == 8 * 128 * 4
    assert padded_bytes((8, 128), jnp.bfloat16) == 16 * 128 * 2


def test_vmem_estimate_counts_double_buffering_and_scratch():
    spec = pl.BlockSpec((512, 1024), lambda i: (i, 0))
    est = estimate_vmem([("x", spec, (4096, 1024), np.float32), ("o", spec, (4096, 1024), np.float32)],
                        [pltpu.VMEM((512, 1024), jnp.float32)])
    assert est.blocks_bytes == 2 * 2 * 512 * 1024 * 4 and est.scratch_bytes == 512 * 1024 * 4
    assert est.total_bytes == 10 * 2**20


def test_vmem_errors_name_chip_and_sizes():
    spec = pl.BlockSpec((8192, 8192), lambda i: (i, 0))
    est = estimate_vmem([("x", spec, (65536, 8192), np.float32)])
    with pytest.raises(tk.VmemError, match=r"VMEM 512.00 MiB > 128 MiB on v6e"):
        check_vmem(est, get_chip("v6e"), None, "k")
    small = estimate_vmem([("x", pl.BlockSpec((2048, 1024), lambda i: (i, 0)), (8192, 1024), np.float32)])
    with pytest.raises(tk.VmemError, match=r"16.00 MiB > scoped limit 8 MiB on v5e"):
        check_vmem(small, get_chip("v5e"), 8 << 20, "k")
    check_vmem(small, get_chip("v5e"), None, "k")  # 16 MiB fits v5e's 16 MiB default exactly
    with pytest.raises(tk.VmemError, match=r"vmem_limit_bytes 200 MiB > 64 MiB VMEM on tpu7x"):
        check_vmem(small, get_chip("tpu7x"), 200 << 20, "k")


def test_bad_block_is_reported_before_lowering_on_call():
    from kernels_for_tests import copy_rows

    with pytest.raises(tk.BlockShapeError, match=r"tktest::copy_rows in_specs for 'x': block \(12, 128\)"):
        copy_rows(torch.zeros(48, 128), config={"br": 12})


def test_vmem_checked_against_target_chip_on_cpu(monkeypatch):
    from kernels_for_tests import copy_rows

    x = torch.zeros(8192, 1024)
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v5e")
    with pytest.raises(tk.VmemError, match=r"on v5e .*use smaller blocks \(this config: br=4096\)"):
        copy_rows(x, config={"br": 4096})


def test_unknown_chip_is_a_chip_error():
    with pytest.raises(tk.ChipError, match="unknown TPU chip 'v9z'; known chips are v4, v5e, v5p, v6e, tpu7x"):
        get_chip("v9z")
    assert get_chip("v6e:1x1").name == "v6e" and get_chip("TPU v5 lite").name == "v5e"


def test_chip_facts_come_from_jax_tpu_info():
    from jax.experimental.pallas import tpu as pltpu

    for name, version in [("v5e", "TPU_V5E"), ("v6e", "TPU_V6E"), ("tpu7x", "TPU_7X")]:
        info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, version), 1)
        assert get_chip(name).vmem_capacity_bytes == info.vmem_capacity_bytes
