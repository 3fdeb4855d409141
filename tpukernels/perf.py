"""Performance model: chip rooflines and model time from libtpu's static estimate.

Everything here is a **model**, not a measurement: libtpu's static ``estimated_cycles`` (deterministic,
from the compile-only target) combined with the HBM and MXU rooflines of the chip::

    model_time = max(estimated_cycles / clock, hbm_bytes / hbm_bandwidth, flops / peak_flops)

libtpu's estimate sits below the HBM roofline for memory-bound kernels (it does not model HBM
contention fully), hence the max with ``bytes / bandwidth``.

Chip figures (HBM bandwidth, bf16 FLOP/s per TensorCore) come from jax's ``tpu_info``. The clock is
derived: ``clock = bf16_ops_per_second / mxu_flops_per_cycle`` with ``mxu_flops_per_cycle =
2 * 4 * mxu_column_size**2`` (4 MXUs per TensorCore). The factor 4 is calibrated, not typed from a spec
sheet: ``benchmarks/calibrate_clock.py`` compiles XLA's 4096^3 bf16 matmul for each chip and divides its
FLOPs by libtpu's estimated cycles (libtpu 0.0.52: v5e 127.6k, v6e 492.6k, tpu7x 489.0k FLOP/cycle, i.e.
94-97% of 4 MXUs; jax's ``num_mxus`` says 2 for v6e/tpu7x, which would put v6e at an implausible 3.5 GHz).
Resulting clocks: v4 1.05, v5e 1.50, v5p 1.75, v6e 1.75, tpu7x 2.20 GHz.
"""

from __future__ import annotations

import dataclasses

from .chips import Chip, get_chip

MXUS_PER_CORE = 4


def clock_hz(chip: "str | Chip") -> float:
    """TensorCore clock, Hz (derived; see module docstring)."""
    info = get_chip(chip).info
    return info.bf16_ops_per_second / (2 * MXUS_PER_CORE * info.mxu_column_size**2)


def hbm_bandwidth(chip: "str | Chip") -> float:
    """HBM bandwidth per TensorCore, bytes/s (jax tpu_info)."""
    return float(get_chip(chip).info.mem_bw_bytes_per_second)


def peak_flops(chip: "str | Chip", dtype: str = "bfloat16") -> float:
    """Peak MXU FLOP/s per TensorCore for bf16 (f32 matmuls run as multi-pass bf16: /3 is assumed).

    ``"int8"`` / ``"float8*"``: jax tpu_info's ``int8_ops_per_second`` / ``fp8_ops_per_second`` where it
    gives one, else the bf16 peak (tpu_info says "Not Available": the MXU has no faster path for it).
    """
    info = get_chip(chip).info
    peak = float(info.bf16_ops_per_second)
    if dtype == "int8":
        return float(info.int8_ops_per_second or peak)
    if str(dtype).startswith("float8"):
        return float(info.fp8_ops_per_second or peak)
    return peak / 3 if dtype in ("float32", "f32") else peak


@dataclasses.dataclass(frozen=True)
class ModelTime:
    """A model time (µs) and its parts; ``bound`` names the largest term."""

    chip: str
    cycles_us: float | None
    memory_us: float
    compute_us: float
    hbm_bytes: int
    flops: int

    @property
    def time_us(self) -> float:
        return max(self.cycles_us or 0.0, self.memory_us, self.compute_us)

    @property
    def bound(self) -> str:
        parts = {"cycles": self.cycles_us or 0.0, "hbm": self.memory_us, "mxu": self.compute_us}
        return max(parts, key=parts.get)

    @property
    def roofline_us(self) -> float:
        """The roofline lower bound: max(bytes / bandwidth, flops / peak)."""
        return max(self.memory_us, self.compute_us)

    @property
    def pct_of_roofline(self) -> float:
        """Roofline time / model time, in percent (100 = at the roofline)."""
        return 100.0 * self.roofline_us / self.time_us if self.time_us else 0.0


def model_time(chip: "str | Chip", cycles: int | None, hbm_bytes: int, flops: int = 0, dtype: str = "bfloat16") -> ModelTime:
    """Combine a static cycle estimate with the chip's rooflines (see module docstring)."""
    chip = get_chip(chip)
    return ModelTime(
        chip=chip.name,
        cycles_us=None if cycles is None else cycles / clock_hz(chip) * 1e6,
        memory_us=hbm_bytes / hbm_bandwidth(chip) * 1e6,
        compute_us=flops / peak_flops(chip, dtype) * 1e6 if flops else 0.0,
        hbm_bytes=int(hbm_bytes),
        flops=int(flops),
    )
