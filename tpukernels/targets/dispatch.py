"""The torch op's device kernel: :func:`run_torch` routes a call to the target of its tensors' device.

Above :mod:`tpukernels.targets` (the shared plans) and its :mod:`.cpu` and :mod:`.tpu` targets, so the
package ``__init__`` never imports its own targets back.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..dsl.kernel import TpuKernel
from ..errors import DeviceError
from . import cpu, tpu


def run_torch(kernel: TpuKernel, values: Sequence, config_json: str | None):
    """The torch op's device kernel: route cpu tensors to interpret mode, tpu tensors to torch_tpu."""
    torch = sys.modules["torch"]
    dev = None
    for v in values:
        if isinstance(v, torch.Tensor):
            dev = v.device.type
            break
    if dev is None or dev == "cpu":  # cpu first: it is the hot path here
        return cpu.run_torch_cpu(kernel, values, config_json)
    if dev in ("tpu", "privateuseone", "privateuse1"):
        return tpu.run_torch_tpu(kernel, values, config_json)
    raise DeviceError(f"{kernel.qualname}: tensors on {dev!r} are not supported; use cpu (interpret) or tpu tensors")
