"""The one scoped-VMEM rule of the grouped and quantized matmul kernels (tpukernels.library.vmem)."""

import pytest

from tpukernels.chips import get_chip
from tpukernels.library import vmem

MiB = 1 << 20


@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_cap_is_seven_eighths_of_the_chips_vmem(chip):
    cap = vmem.vmem_cap(chip)
    assert cap == get_chip(chip).vmem_capacity_bytes * 7 // 8
    assert vmem.vmem_cap(get_chip(chip)) == cap  # a Chip or its name


def test_no_chip_plans_for_the_smallest_shipped_chip(monkeypatch):
    monkeypatch.delenv("TPUKERNELS_TARGET_CHIP", raising=False)
    assert vmem.vmem_cap(None) == min(get_chip(c).vmem_capacity_bytes for c in vmem.SHIPPED_CHIPS) * 7 // 8


@pytest.mark.parametrize("need_mib, chip, want_mib", [
    (12, "v6e", None),      # 12 + 4 MiB fits the smallest default (16 MiB): no request
    (13, "v6e", 32),        # just over: at least 32 MiB
    (40, "v6e", 54),        # 1.25 * 40 + 4
    (60, "v6e", 79),        # 79 MiB: over the old typed 64 MiB cap, under v6e's 112
    (60, "tpu7x", 56),      # capped at 7/8 of tpu7x's 64 MiB
    (100, "v5e", 112),
])
def test_request(need_mib, chip, want_mib):
    got = vmem.scoped_vmem_limit(need_mib * MiB, chip)
    assert got == (None if want_mib is None else want_mib * MiB)


def test_request_rounds_up_to_a_mib():
    got = vmem.scoped_vmem_limit(40 * MiB + 1, "v6e")
    assert got == 55 * MiB and got >= (40 * MiB + 1) * 5 // 4 + 4 * MiB
