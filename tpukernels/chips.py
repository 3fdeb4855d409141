"""TPU generations tpukernels targets, and their facts.

Hardware figures (VMEM capacity, lanes, sublanes, MXU width, HBM bandwidth, bf16 FLOP/s) come from jax's
``pltpu.get_tpu_info_for_chip`` (``jax/_src/pallas/mosaic/tpu_info.py``); this module only adds what jax
does not know:

* ``topology``: the name ``jax.experimental.topologies.get_topology_desc`` takes for a single-chip
  compile-only target.
* ``default_scoped_vmem_bytes``: the VMEM budget Mosaic gives a kernel when ``vmem_limit_bytes`` is not
  set. Source: JAX Pallas TPU docs ("16MiB on v4/v5, 32MiB on v6e"), and measured for every chip here with
  libtpu 0.0.52 by ``benchmarks/probe_scoped_vmem.py`` (largest double-buffered copy kernel that compiles):
  v4 16 MiB, v5e 16 MiB, v5p 16 MiB, v6e 32 MiB, tpu7x 32 MiB.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from .errors import ChipError

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation as a compile target.

    Attributes:
        name: tpukernels' short name (``"v5e"``, ``"v6e"``, ``"tpu7x"``, ...).
        topology: topology name for ``get_topology_desc`` (``"v5e:1x1"``).
        chip_version: the ``jax.experimental.pallas.tpu.ChipVersion`` member name.
        default_scoped_vmem_bytes: Mosaic's default VMEM limit per kernel, bytes (see module docstring).
    """

    name: str
    topology: str
    chip_version: str
    default_scoped_vmem_bytes: int

    @functools.cached_property
    def info(self):
        """jax's ``TpuInfo`` for one TensorCore of this chip (per-core VMEM, lanes, bandwidth, FLOP/s)."""
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, self.chip_version), 1)

    @property
    def vmem_capacity_bytes(self) -> int:
        """Physical VMEM per TensorCore, bytes (from jax's tpu_info)."""
        return int(self.info.vmem_capacity_bytes)

    @property
    def generation(self) -> int:
        return int(self.info.generation)

    @property
    def device_kind(self) -> str:
        """A jax ``device_kind`` string of this chip (what ``pltpu.get_tpu_info`` recognizes)."""
        from jax._src.pallas.mosaic import tpu_info

        for kind, name in _DEVICE_KINDS.items():
            if name == self.name and getattr(tpu_info.chip_version_from_device_kind(kind), "name", None) == self.chip_version:
                return kind
        raise ChipError(f"chip {self.name}: jax {__import__('jax').__version__} knows no device_kind for {self.chip_version}")

    def trace_target(self):
        """A context in which jax traces for this chip: ``pltpu.get_tpu_info()`` (which Pallas kernels and
        Helion call while tracing) answers for it even where jax's default device is a cpu (a TorchTPU
        process, a compile-only export). An abstract mesh of one device of this ``device_kind``, which jax
        consults before the default device."""
        import jax

        mesh = jax.sharding.AbstractMesh((1,), ("_tpukernels",), abstract_device=jax.sharding.AbstractDevice(
            device_kind=self.device_kind, num_cores=1, platform="tpu"))
        return jax.sharding.use_abstract_mesh(mesh)

    @property
    def has_float64(self) -> bool:
        """No TPU generation has float64 arithmetic in Mosaic kernels."""
        return False

    def __str__(self) -> str:
        return self.name


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v4", "v4:1x1x1", "TPU_V4", 16 * MiB),
        Chip("v5e", "v5e:1x1", "TPU_V5E", 16 * MiB),
        Chip("v5p", "v5p:1x1x1", "TPU_V5P", 16 * MiB),
        Chip("v6e", "v6e:1x1", "TPU_V6E", 32 * MiB),
        Chip("tpu7x", "tpu7x:1x1x1", "TPU_7X", 32 * MiB),
    )
}

_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v7x": "tpu7x", "7x": "tpu7x", "tpu-v7x": "tpu7x"}

#: jax ``device_kind`` strings -> tpukernels chip names (for live TPU devices).
_DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "tpu7x",
    "TPU v7": "tpu7x",  # torch_tpu's PCI-scan name (torch_tpu._internal.utils.hardware.TpuVersion)
}


def get_chip(name: "str | Chip") -> Chip:
    """Return the :class:`Chip` for ``name`` (``"v5e"``, ``"v5e:1x1"``, ``"TPU v5 lite"``...).

    Raises:
        ChipError: unknown name; the message lists the known chips.
    """
    if isinstance(name, Chip):
        return name
    key = str(name).strip()
    if key in _DEVICE_KINDS:
        return CHIPS[_DEVICE_KINDS[key]]
    key = key.lower().split(":")[0]
    key = _ALIASES.get(key, key)
    if key not in CHIPS:
        raise ChipError(f"chip: unknown TPU chip {name!r}; known chips are {', '.join(CHIPS)}")
    return CHIPS[key]


def parse_chips(spec: "str | list[str] | tuple[str, ...]") -> list[Chip]:
    """Parse ``"v5e,v6e"`` (or a list) into chips; ``"all"`` means every known chip."""
    if isinstance(spec, str):
        if spec.strip() == "all":
            return list(CHIPS.values())
        spec = [s for s in spec.split(",") if s.strip()]
    return [get_chip(s) for s in spec]


def target_chip_from_env() -> "Chip | None":
    """The chip named by ``TPUKERNELS_TARGET_CHIP`` (used to VMEM-check cpu runs), or None."""
    name = os.environ.get("TPUKERNELS_TARGET_CHIP")
    if not name:
        return None
    try:
        return get_chip(name)
    except ChipError as e:
        raise ChipError(f"TPUKERNELS_TARGET_CHIP={name!r}: {e}") from None
