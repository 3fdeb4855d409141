"""The scoped-VMEM request of the grouped and quantized matmul kernels: one rule, per chip.

Mosaic gives a kernel a default scoped-VMEM budget (``Chip.default_scoped_vmem_bytes``: 16 MiB on v5e, 32 MiB
on v6e / tpu7x) unless the launch sets ``vmem_limit_bytes``. A kernel whose blocks and scratch need ``need``
bytes asks for :func:`scoped_vmem_limit`:

* nothing (``None``) when ``need + 4 MiB`` fits the smallest default (16 MiB): Mosaic keeps a few MiB of
  internal scratch (the dot result before it is added to the accumulator, relayout copies);
* else ``1.25 * need + 4 MiB`` rounded up to a MiB, at least 32 MiB, at most :func:`vmem_cap` of the chip.

:func:`vmem_cap` is 7/8 of the chip's ``vmem_capacity_bytes`` (jax's ``tpu_info`` via
:mod:`tpukernels.chips`: 112 MiB on v5e / v6e, 56 MiB on tpu7x); the last eighth is headroom for XLA around
the kernel. Both factors are this project's choices, checked by compiling the shipped configs for each chip
(``tests/test_grouped_matmul.py``, ``tests/test_quantized_matmul.py``, aot), not published numbers.
"""

from __future__ import annotations

import functools

MiB = 1 << 20
#: Mosaic's smallest default scoped VMEM limit (v5e; ``tpukernels.chips`` module docstring), bytes.
DEFAULT_SCOPED_VMEM = 16 * MiB
#: The chips with shipped tuning data; ``chip=None`` with no target resolves to the smallest of their caps.
SHIPPED_CHIPS = ("v5e", "v6e", "tpu7x")


def target_chip():
    """The :class:`tpukernels.chips.Chip` a launch is planned for: the launch target, else the dispatch chip, else
    None (see :func:`_chip`)."""
    return _chip(None)


def _chip(chip):
    """A :class:`tpukernels.chips.Chip` for ``chip`` (a Chip, a name or None); None: the launch target
    (:func:`tpukernels.lowering.launch_chip`), else the dispatch chip (live TPU / ``TPUKERNELS_TARGET_CHIP``),
    else None (a cpu interpret run with no target)."""
    from ..chips import get_chip

    if chip is None:
        from ..lowering import launch_chip

        chip = launch_chip()
        if chip is None:
            from ..autotune.db import dispatch_chip

            chip = dispatch_chip()
    if chip is None:
        return None
    return get_chip(chip) if isinstance(chip, str) else chip


def vmem_cap(chip=None) -> int:
    """Largest scoped-VMEM request (bytes) on ``chip`` (a Chip, a name, or None: see :func:`_chip`): 7/8 of
    its ``vmem_capacity_bytes``; with no chip at all, the smallest of :data:`SHIPPED_CHIPS` (56 MiB, tpu7x),
    so a cpu run never plans what no shipped chip could compile. Raises ``ChipError`` for an unknown name."""
    c = _chip(chip)
    if c is None:
        return _smallest_cap()
    return c.vmem_capacity_bytes * 7 // 8


@functools.lru_cache(maxsize=None)
def _smallest_cap() -> int:
    from ..chips import get_chip

    return min(get_chip(n).vmem_capacity_bytes for n in SHIPPED_CHIPS) * 7 // 8


def scoped_vmem_limit(need: int, chip=None) -> int | None:
    """``vmem_limit_bytes`` for a launch whose blocks and scratch take ``need`` bytes (module docstring):
    None under the smallest default, else ``max(32 MiB, ceil_MiB(1.25 * need + 4 MiB))`` capped at
    :func:`vmem_cap` of ``chip``. A request above the cap is not an error here: ``tpukernels.dsl.validate``
    raises ``VmemError`` (naming the chip and the figures) when the blocks do not fit the limit."""
    if need + 4 * MiB <= DEFAULT_SCOPED_VMEM:
        return None
    return min(vmem_cap(chip), max(32 * MiB, -(-(need * 5 // 4 + 4 * MiB) // MiB) * MiB))
