"""What to tune: one call signature of a kernel (:class:`Problem`) and its tunable space (:class:`Space`).

The space is the Cartesian product of the kernel's declared tunables (``kernel.space``). Before any
compile time is spent, :meth:`Space.check` rejects a config, with the reason recorded, when

* it violates one of the kernel's constraints (``"constraint"``),
* a value is one its tunable cannot take: 0, negative, a str for an int (``"config"``),
* the launch function raises for it (``"launch"``),
* a BlockSpec breaks the Pallas TPU block rules (``"block_shape"``),
* its VMEM footprint exceeds the chip's scoped limit or capacity (``"vmem"``),
* it produces exactly the launch of a config already checked (``"duplicate"``: e.g. a block size the
  launch function clamps to the array size), so compiling it again would measure nothing new.

The checks are :func:`tpukernels.lowering.resolve` + :func:`tpukernels.lowering.validate`, the ones every
call runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Iterator

import numpy as np

from ..chips import Chip
from ..dsl.kernel import TpuKernel
from ..dsl.spec import Config, TensorSpec
from ..errors import ArgumentError, BlockShapeError, ConfigError, KernelBodyError, PerformanceWarning, VmemError

_SHORT = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int32": "i32", "int8": "i8", "uint8": "u8"}


@dataclasses.dataclass
class Problem:
    """One call signature to tune.

    Attributes:
        kernel: the :class:`TpuKernel`.
        specs: a :class:`TensorSpec` (or None) per tensor parameter, at the shapes the caller uses.
        statics: ``(name, value)`` per static parameter.
    """

    kernel: TpuKernel
    specs: tuple
    statics: tuple

    @classmethod
    def from_args(cls, kernel: TpuKernel, *args, **kwargs) -> "Problem":
        """Like :func:`tpukernels.compile_for`'s arguments: tensors, specs or ``"8192x4096:bf16"`` strings."""
        from ..targets.compile_only import example_specs

        return cls(kernel, *example_specs(kernel, args, kwargs))

    @property
    def lowered_specs(self) -> tuple:
        """The specs the kernel is compiled for (row-bucketed for kernels that declare ``rows``)."""
        from ..targets import bucket_specs

        return bucket_specs(self.kernel, self.specs)

    def call_args(self) -> tuple[list, dict]:
        """``(args, kwargs)`` reproducing this signature (TensorSpecs for tensors)."""
        args, kwargs = [], {}
        spec_iter = iter(self.specs)
        statics = dict(self.statics)
        for p in self.kernel.params:
            v = statics[p.name] if p.kind == "static" else next(spec_iter)
            (kwargs.__setitem__(p.name, v) if p.keyword_only else args.append(v))
        return args, kwargs

    def shape_strings(self, short: bool = True) -> list:
        out = []
        for s in self.specs:
            if s is None:
                out.append(None)
                continue
            name = np.dtype(s.dtype).name
            out.append("x".join(str(int(d)) for d in s.shape) + ":" + (_SHORT.get(name, name) if short else name))
        return out

    def describe(self) -> str:
        """Shapes of the tensors given, then the static arguments that differ from their defaults."""
        defaults = {p.name: p.default for p in self.kernel.params if p.kind == "static"}
        parts = [s for s in self.shape_strings() if s is not None]
        parts += [f"{k}={v!r}" for k, v in self.statics if defaults.get(k, object()) != v]
        return " ".join(parts)

    def payload(self) -> dict:
        """A picklable description (for worker processes): full dtype names, static values."""
        return {"shapes": self.shape_strings(short=False), "statics": [list(kv) for kv in self.statics]}

    @classmethod
    def from_payload(cls, kernel: TpuKernel, payload: dict) -> "Problem":
        from ..targets.compile_only import parse_shape

        specs = []
        tensor_params = [p for p in kernel.params if p.kind != "static"]
        for p, text in zip(tensor_params, payload["shapes"]):
            parsed = None if text is None else parse_shape(text)
            specs.append(None if parsed is None else TensorSpec(parsed.shape, parsed.dtype, p.name))
        return cls(kernel, tuple(specs), tuple((k, v) for k, v in payload["statics"]))


@dataclasses.dataclass(frozen=True)
class Pruned:
    """A config rejected before compiling: ``kind`` (see module docstring) and the reason."""

    config: Config
    kind: str
    reason: str

    def to_dict(self) -> dict:
        return {"config": dict(self.config), "kind": self.kind, "reason": self.reason}


def _launch_fingerprint(kernel: TpuKernel, resolved) -> str | None:
    """A string equal for two configs exactly when they lower to the same kernel (None: can't tell)."""
    from .model import _block_index

    launch = resolved.launch
    if launch.num_scalar_prefetch:
        return None
    grid = tuple(int(g) for g in launch.grid)
    points = [(0,) * len(grid), tuple(max(0, g - 1) for g in grid)]
    for a, g in enumerate(grid):
        if g > 1:
            points.append(tuple(1 if i == a else 0 for i in range(len(grid))))
    specs = []
    for spec in list(launch.in_specs) + list(launch.out_spec_list):
        idx = [_block_index(spec, p) for p in points] if getattr(spec, "index_map", None) is not None else []
        if any(i is None for i in idx):
            return None
        specs.append((repr(getattr(spec, "block_shape", None)), repr(getattr(spec, "memory_space", None)),
                      repr(getattr(spec, "pipeline_mode", None)), tuple(idx)))
    cfg = resolved.config
    body_cfg = {k: cfg[k] for k in cfg if kernel._body_var_kw or k in kernel._body_kw}
    body_kwargs = sorted((k, repr(v)) for k, v in launch.body_kwargs.items())
    return repr((grid, specs, repr(list(launch.scratch_shapes)), body_kwargs,
                 tuple(launch.dimension_semantics or ()), launch.vmem_limit_bytes,
                 sorted(dict(launch.input_output_aliases).items()), sorted((k, repr(v)) for k, v in body_cfg.items())))


class Space:
    """The tunable space of ``problem.kernel`` for one problem and chip, with cached static checks.

    Args:
        problem: the call signature.
        chip: VMEM and block checks target this chip (None: block rules only).
        values: ``{tunable: values}`` to search instead of the declared values (the baseline's value is always
            kept: the baseline is every sweep's first point). Values need not be among the declared ones.

    The *baseline* (:meth:`default`) is the config a call of this problem gets today on ``chip``: its tuning
    DB entry (user, then shipped), else the kernel's heuristic, else the declared defaults
    (``TpuKernel.resolve_config``; :attr:`baseline_source` says which). A sweep is thus compared with what
    users already run, and ``--write-db`` never stores a config that was not measured against it.
    """

    def __init__(self, problem: Problem, chip: Chip | None, values: dict | None = None):
        self.problem = problem
        self.kernel = problem.kernel
        self.chip = chip
        self.names = self.kernel.space.names
        self._lowered_specs = problem.lowered_specs
        self.baseline, self.baseline_source = self._resolve_baseline()
        self.values = {n: tuple(t.values) for n, t in self.kernel.space.tunables.items()}
        for n in self.names:  # a heuristic / DB value outside the declared ones is searched too
            if self.baseline[n] not in self.values[n]:
                self.values[n] = (self.baseline[n], *self.values[n])
        for n, vals in (values or {}).items():
            if n not in self.values:
                raise ArgumentError(f"{self.kernel.qualname}: no tunable {n!r} (it has {list(self.names)})")
            base = self.baseline[n]
            vals = tuple(dict.fromkeys(vals))
            self.values[n] = vals if base in vals else (base, *vals)
        self._checked: dict[Config, Pruned | None] = {}
        self._fingerprints: dict[str, Config] = {}
        self.notes: dict[Config, list[str]] = {}

    def _resolve_baseline(self) -> tuple[Config, str]:
        """``(config, source)`` a call of the problem resolves to on :attr:`chip` (class docstring). A
        resolution that fails (e.g. a heuristic raising for this shape) falls back to the declared defaults."""
        if not self.names:
            return Config(), "default"
        try:
            cfg, source = self.kernel.resolve_config(self._lowered_specs, self.problem.statics, None, self.chip)
            return Config(cfg), source
        except Exception:  # noqa: BLE001 - the baseline is advisory; the sweep itself reports bad configs
            return self.kernel.space.default(), "default"

    def size(self) -> int:
        """Points in the Cartesian product (before any pruning)."""
        return int(np.prod([len(v) for v in self.values.values()], dtype=np.int64)) if self.names else 1

    def default(self) -> Config:
        """The baseline: the config a call gets today (class docstring), evaluated first by every strategy."""
        return self.baseline

    def config_at(self, index: int) -> Config:
        """The ``index``-th point of the product (mixed radix, last tunable fastest)."""
        out = {}
        for n in reversed(self.names):
            vals = self.values[n]
            index, r = divmod(index, len(vals))
            out[n] = vals[r]
        return Config(out)

    def all_configs(self) -> Iterator[Config]:
        """Every point of the product, the default first, then in declaration order."""
        d = self.default()
        yield d
        for values in itertools.product(*(self.values[n] for n in self.names)):
            c = Config(dict(zip(self.names, values)))
            if c != d:
                yield c

    def check(self, config: Config) -> Pruned | None:
        """None if ``config`` may be compiled; else why not (cached, recorded in :attr:`pruned`)."""
        config = Config(config)
        if config in self._checked:
            return self._checked[config]
        got = self._check(config)
        self._checked[config] = got
        return got

    def _check(self, config: Config) -> Pruned | None:
        from ..lowering import launching_for, resolve, validate

        why = self.kernel.space.violation(config)
        if why:
            return Pruned(config, "constraint", why)
        try:
            with launching_for(self.chip):  # the launch's per-chip choices (scoped VMEM cap) for self.chip
                resolved = resolve(self.kernel, self._lowered_specs, self.problem.statics, config)
        except ConfigError as e:  # a value the tunable cannot take (0, negative, wrong type)
            return Pruned(config, "config", str(e))
        except (KernelBodyError, ArgumentError) as e:
            return Pruned(config, "launch", str(e))
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", PerformanceWarning)
                validate(self.kernel, resolved, self.chip)
        except BlockShapeError as e:
            return Pruned(config, "block_shape", str(e))
        except VmemError as e:
            return Pruned(config, "vmem", str(e))
        except KernelBodyError as e:
            return Pruned(config, "launch", str(e))
        notes = [str(w.message) for w in caught if issubclass(w.category, PerformanceWarning)]
        if notes:
            self.notes[config] = notes
        fp = _launch_fingerprint(self.kernel, resolved)
        if fp is not None:
            first = self._fingerprints.setdefault(fp, config)
            if first != config:
                return Pruned(config, "duplicate", f"lowers to the same kernel as {dict(first)}")
        return None

    @property
    def pruned(self) -> list[Pruned]:
        return [p for p in self._checked.values() if p is not None]

    @property
    def checked(self) -> int:
        return len(self._checked)
