"""Integer statics never truncate (issue 36 item 4): ``quantized_matmul_blockwise(..., block_size=64.9)`` ran as 64.

Every public wrapper that takes an integer static and hands it to a kernel or an op schema checks it with
``tpukernels.dsl.check_int`` (the rule of the kernels' own static checks: an int or numpy integer, not a bool, not a
float even when integral), raising ArgumentError naming the argument before anything runs; every registered kernel's
int statics reject floats the same way.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import tpukernels.library as lib
from tpukernels.dsl import REGISTRY, check_int
from tpukernels.dsl.kernel import check_static
from tpukernels.errors import ArgumentError

qmm = importlib.import_module("tpukernels.library.quantized_matmul_ops")


def test_check_int_rule():
    assert check_int("f", "n", 64) == 64 and type(check_int("f", "n", np.int32(64))) is int
    assert check_int("f", "n", None, optional=True) is None
    for bad in (64.9, 64.0, np.float32(64), True, "64", None, torch.tensor(64)):
        with pytest.raises(ArgumentError, match=r"f: static argument 'n' must be int, got"):
            check_int("f", "n", bad)


@pytest.mark.parametrize("block_size", [64.9, 64.0, True])
def test_blockwise_block_size_float_raises(block_size):
    """The reported case: 64.9 ran as 64 (int() in the public op); now ArgumentError naming block_size, for every
    path of the op (x_quant or not) and the helpers that take a block size."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    q, s, _ = qmm.quantize_weight_blockwise(w, 64, "int8")
    x = torch.randn(4, 128)
    for x_quant in (None, "int8"):
        with pytest.raises(ArgumentError, match=r"quantized_matmul_blockwise: static argument 'block_size' must be "
                                                r"int, got"):
            qmm.quantized_matmul_blockwise(x, q, s, block_size=block_size, x_quant=x_quant)
    with pytest.raises(ArgumentError, match="TPUBlockQuantLinear: static argument 'block_size'"):
        qmm.TPUBlockQuantLinear(128, 64, block_size)
    with pytest.raises(ArgumentError, match="quantize_weight_blockwise: static argument 'block_size'"):
        qmm.quantize_weight_blockwise(w, block_size)
    with pytest.raises(ArgumentError, match="pack_int4: static argument 'block_size'"):
        qmm.pack_int4(torch.zeros(64, 128, dtype=torch.uint8), block_size)


def test_blockwise_integral_block_size_still_runs():
    """The check is not a new restriction on ints: a numpy integer block size gives the int's result exactly."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    q, s, _ = qmm.quantize_weight_blockwise(w, 64, "int8")
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    assert torch.equal(qmm.quantized_matmul_blockwise(x, q, s, block_size=np.int64(64)),
                       qmm.quantized_matmul_blockwise(x, q, s, block_size=64))


def test_other_ops_int_statics_typed():
    """Two other public ops whose int statics went to a torch op schema (torch's untyped RuntimeError for a float)."""
    h, W = torch.randn(8, 32), torch.randn(64, 32)
    labels = torch.randint(0, 64, (8,))
    with pytest.raises(ArgumentError, match="linear_cross_entropy: static argument 'ignore_index' must be int"):
        lib.linear_cross_entropy(h, W, labels, ignore_index=-100.5)
    x = torch.randn(1, 2, 16, 32)
    cos = torch.randn(16, 32)
    with pytest.raises(ArgumentError, match="rope: static argument 'seq_dim' must be int"):
        lib.apply_rope(x, cos, cos, seq_dim=2.0)


def test_every_registered_kernel_int_static_rejects_floats():
    """Every integer static of every registered kernel (the DSL's check before a kernel runs): a float raises
    ArgumentError naming the kernel and the argument, never truncates."""
    ints = [(k, p) for k in REGISTRY.values() for p in k.params if p.kind == "static" and p.static_type is int]
    assert len(ints) >= 5, ints  # the library's block_size, ignore_index, seq_dim, ... statics are registered
    for k, p in ints:
        with pytest.raises(ArgumentError, match=rf"{k.qualname}: static argument {p.name!r} must be int"):
            check_static(k.qualname, p, 64.9)
        assert check_static(k.qualname, p, np.int64(3)) == 3
