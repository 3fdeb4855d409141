"""Data objects of the DSL: abstract tensors, tunables, configs and the launch description.

A kernel's *launch function* receives :class:`TensorSpec` objects (shape + dtype, no data) and the chosen
config, and returns a :class:`Launch`: everything ``pl.pallas_call`` needs besides the kernel body.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError, KernelDefinitionError


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """An abstract tensor seen by a launch function.

    Attributes:
        shape: tuple of ints (SymInts while torch traces with dynamic shapes; launch functions should
            only do arithmetic on them).
        dtype: a numpy/jax dtype (``jnp.bfloat16``...), comparable with ``jnp`` dtypes.
        name: the argument name in the kernel signature (for error messages).
    """

    shape: tuple
    dtype: Any
    name: str = ""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod([int(s) for s in self.shape], dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class OutSpec:
    """Shape and dtype of one kernel output (what ``jax.ShapeDtypeStruct`` is to ``pallas_call``).

    Attributes:
        rows: only for kernels declaring ``rows=``: ``False`` marks an output without the row axis, e.g. a
            weight gradient reduced over all rows. Row bucketing then neither checks nor slices it; the
            padded rows are zeros and must contribute nothing to it, and its shape must not depend on the
            row count.
        fill: the output's value when the launch grid is empty (nothing runs); default 0. E.g. ``-inf``
            for a log-sum-exp over an empty key axis.
    """

    shape: tuple
    dtype: Any
    rows: bool = True
    fill: float = 0

    def __post_init__(self):
        # torch users pass torch dtypes: accept them (the kernel sees jax dtypes); anything else that is
        # not a dtype is a typed error here, not a TypeError deep in pallas_call
        from .dtypes import check_jax_dtype, to_jax_dtype
        from ..errors import DTypeError

        d = self.dtype
        if type(d).__module__ == "torch":
            d = np.dtype(to_jax_dtype(d, "OutSpec dtype"))
        else:
            try:
                d = np.dtype(d)
            except TypeError:
                raise DTypeError(f"OutSpec dtype: {self.dtype!r} is not a dtype (use jnp.float32, jnp.bfloat16, "
                                 f"... or a torch dtype)") from None
            check_jax_dtype(d, "OutSpec dtype")
        object.__setattr__(self, "dtype", d)


def like(x: TensorSpec, dtype: Any = None, shape: Sequence | None = None) -> OutSpec:
    """An output shaped like ``x`` (optionally with another ``dtype`` or ``shape``)."""
    return OutSpec(tuple(x.shape if shape is None else shape), x.dtype if dtype is None else dtype)


@dataclasses.dataclass(frozen=True)
class Tunable:
    """A tunable kernel parameter (e.g. a block size) with its candidate values.

    Args:
        values: candidate values the autotuner may search, in preference order.
        default: value used when nothing else decides; must be one of ``values``.
        doc: one line for ``tpukernels list`` and the docs.
    """

    values: tuple
    default: Any = None
    doc: str = ""

    def __init__(self, values: Iterable, default: Any = None, doc: str = ""):
        values = tuple(values)
        if not values:
            raise KernelDefinitionError("Tunable: values must not be empty")
        if default is None:
            default = values[0]
        if default not in values:
            raise KernelDefinitionError(f"Tunable: default {default!r} is not one of the values {values}")
        kinds = {"number" if k in ("int", "float") else k for k in map(_kind, values)}
        if len(kinds) > 1:  # a config value is checked against its tunable's kind; a mixed list has none
            raise KernelDefinitionError(f"Tunable: values {values} mix kinds ({', '.join(sorted(kinds))}); use one "
                                        "kind (ints and floats may mix)")
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "doc", doc)


class Config(Mapping):
    """An immutable, hashable assignment of values to a kernel's tunables.

    Printable and JSON-serialisable (``Config.from_json(c.to_json()) == c``), so it can be pinned in
    code, stored in a tuning database or passed on the command line.
    """

    __slots__ = ("_items",)

    def __init__(self, mapping: Mapping | None = None, /, **kwargs: Any):
        items = dict(mapping or {})
        items.update(kwargs)
        # list-valued knobs (Helion's block_sizes, values read back from JSON) are stored as tuples
        self._items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in items.items()))

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__") or key == "_items":  # not tunables: no lookup through _items (Dynamo, copy, pickle)
            raise AttributeError(key)
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __iter__(self):
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Config):
            return self._items == other._items
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self._items) + ")"

    def replace(self, **kwargs: Any) -> "Config":
        return Config(dict(self._items), **kwargs)

    def to_json(self) -> str:
        return json.dumps(dict(self._items), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        """Parse a JSON object (``'{"block_rows": 256}'``).

        Raises:
            ConfigError: not JSON, or not a JSON object.
        """
        return cls({k: tuple(v) if isinstance(v, list) else v for k, v in parse_config_json(text).items()})


def config_example(kernel=None, as_json: bool = True) -> str:
    """An example ``config=`` for error messages, with one of ``kernel``'s own tunables and its first candidate
    (``'{"block_q": 128}'``); ``'{"block_rows": 256}'`` without a kernel, ``'{}'`` for a kernel with no tunables."""
    tunables = getattr(getattr(kernel, "space", None), "tunables", None)
    if kernel is None or tunables is None:
        example = {"block_rows": 256}
    else:
        name = next(iter(tunables), None)
        example = {} if name is None else {name: tunables[name].values[0]}
    return json.dumps(example) if as_json else repr(example)


def parse_config_json(text: str, where: str = "config", kernel=None) -> dict:
    """``config=`` as the torch ops take it: a JSON object string -> dict.

    Raises:
        ConfigError: ``text`` is not JSON or not an object (the message shows the expected form, with one of
            ``kernel``'s own tunables when given).
    """
    example = config_example(kernel)
    try:
        data = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: expected a JSON object such as '{example}', got {text!r} ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object such as '{example}', got {text!r}")
    return data


def _kind(v: Any) -> str:
    """The value class a tunable value belongs to: bool, int, float, str, tuple or other."""
    if isinstance(v, (bool, np.bool_)):
        return "bool"
    if isinstance(v, (int, np.integer)):
        return "int"
    if isinstance(v, (float, np.floating)):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, (tuple, list)):
        return "tuple"
    return type(v).__name__


class TunableSpace:
    """The tunables of one kernel and the constraints tying them together.

    Args:
        tunables: name -> :class:`Tunable`.
        constraints: callables ``fn(config) -> bool | str``; ``False`` or a string (the reason) rejects a
            config. They see only the config (shape-dependent rules belong in the launch function).
    """

    def __init__(self, tunables: Mapping[str, Tunable], constraints: Sequence[Callable] = ()):
        for k, t in tunables.items():
            if not isinstance(t, Tunable):
                raise KernelDefinitionError(f"tunables[{k!r}] must be a tpukernels.Tunable, got {type(t).__name__}")
        self.tunables = dict(tunables)
        if callable(constraints):  # one constraint given bare: as good as a list of one
            constraints = (constraints,)
        try:
            constraints = tuple(constraints or ())
        except TypeError:
            raise KernelDefinitionError(f"constraints= must be a list of callables fn(config) -> bool | str, got "
                                        f"{constraints!r}") from None
        for c in constraints:
            if not callable(c):
                raise KernelDefinitionError(f"constraints= entries must be callables fn(config) -> bool | str, got "
                                            f"{c!r}")
        self.constraints = constraints

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.tunables)

    def default(self) -> Config:
        return Config({k: t.default for k, t in self.tunables.items()})

    def violation(self, config: Config) -> str | None:
        """The reason ``config`` is invalid, or None."""
        unknown = set(config) - set(self.tunables)
        if unknown:
            return f"unknown tunable(s) {sorted(unknown)}; this kernel has {list(self.tunables)}"
        missing = set(self.tunables) - set(config)
        if missing:
            return f"missing tunable(s) {sorted(missing)}"
        for fn in self.constraints:
            ok = fn(config)
            if ok is False or isinstance(ok, str):
                return ok if isinstance(ok, str) else f"violates constraint {getattr(fn, '__name__', fn)}"
        return None

    def complete(self, partial: Mapping | None) -> Config:
        """Fill the tunables ``partial`` leaves out with their defaults and check the result.

        Raises:
            ConfigError: unknown tunable name or a violated constraint.
        """
        cfg = dict(self.default())
        for k, v in (partial or {}).items():
            if k not in self.tunables:
                raise ConfigError(f"config: unknown tunable {k!r}; this kernel has {list(self.tunables)}")
            cfg[k] = self.check_value(k, v)
        config = Config(cfg)
        why = self.violation(config)
        if why:
            raise ConfigError(f"config {config}: {why}")
        return config

    def check_value(self, name: str, value: Any) -> Any:
        """Check one config value against its tunable's declared values; returns it (lists become tuples).

        The value must be of the declared values' kind (``128``, not ``"128"``, ``128.0`` or ``True``), and a
        numeric tunable whose declared values are all positive takes only positive values (a zero or
        negative block would make an empty grid, hence a silent all-zero result). Values outside the
        declared list are allowed (the list is what the autotuner searches, not a whitelist).

        Raises:
            ConfigError: naming the tunable, the value and the rule.
        """
        t = self.tunables[name]
        kinds = {_kind(x) for x in t.values}
        kind = _kind(value)
        if isinstance(value, list):
            value = tuple(value)
        if kind not in kinds:
            want = " or ".join(sorted(kinds))
            raise ConfigError(f"config: {name}={value!r} is a {kind}; {name} takes {want} values such as {t.values[:4]}")
        if kind in ("int", "float") and all(x > 0 for x in t.values) and not value > 0:
            raise ConfigError(f"config: {name}={value!r} must be positive (declared values {t.values[:4]}...)")
        if kind == "tuple" and all(_kind(x) == "tuple" for x in t.values):
            flat = [y for x in t.values for y in x]
            if flat and all(isinstance(y, (int, np.integer)) and not isinstance(y, bool) and y > 0 for y in flat):
                if not all(isinstance(y, (int, np.integer)) and not isinstance(y, bool) and y > 0 for y in value):
                    raise ConfigError(f"config: {name}={value!r} must hold positive ints, like {t.values[0]}")
        return value

    def __iter__(self):
        """Every config of the Cartesian product that satisfies the constraints."""
        names = self.names
        for values in itertools.product(*(self.tunables[n].values for n in names)):
            cfg = Config(dict(zip(names, values)))
            if self.violation(cfg) is None:
                yield cfg

    def size(self) -> int:
        return int(np.prod([len(t.values) for t in self.tunables.values()], dtype=np.int64))

    def __repr__(self) -> str:
        return f"TunableSpace({ {k: t.values for k, t in self.tunables.items()} })"


@dataclasses.dataclass
class Launch:
    """How to launch a Pallas kernel body: the arguments of ``pl.pallas_call`` minus the body.

    Attributes:
        grid: tuple of grid extents (a zero extent means the kernel does not run; outputs are zeros).
        in_specs: one ``pl.BlockSpec`` per kernel input (tensor arguments, in signature order; scalar
            prefetch operands first and excluded here, as in ``PrefetchScalarGridSpec``).
        out_specs: one BlockSpec, or a sequence matching ``out_shape``.
        out_shape: an :class:`OutSpec` / ``jax.ShapeDtypeStruct``, or a tuple of them.
        scratch_shapes: ``pltpu.VMEM((..), dtype)`` / ``pltpu.SMEM`` / semaphores, as in Pallas.
        num_scalar_prefetch: leading tensor arguments passed to SMEM and to every index_map.
        prefetch: optional jax function of those ``num_scalar_prefetch`` leading arguments returning the
            scalar-prefetch operands ``pallas_call`` actually receives (a tuple of int32 arrays, any count),
            traced into the same jitted function, e.g. tile metadata derived on device from group sizes.
            The body and every index_map then see its outputs instead. ``input_output_aliases`` count
            ``pallas_call`` operands (the prefetch outputs first).
        dimension_semantics: per grid axis ``"parallel"`` / ``"arbitrary"``; defaults to all
            ``"arbitrary"`` (Mosaic's own default).
        vmem_limit_bytes: Mosaic scoped-VMEM limit for this kernel, bytes (None: chip default).
        input_output_aliases: ``{input_index: output_index}`` as in ``pallas_call``.
        cost_estimate: optional ``pl.CostEstimate`` (flops, transcendentals, bytes_accessed) for XLA.
        body_kwargs: extra static keyword arguments for the body.
        collective_id: for a kernel that talks to other devices (remote DMAs, remote semaphore signals): the id
            of its barrier semaphore (``pltpu.get_barrier_semaphore``), as Mosaic's ``CompilerParams``; None
            for single-device kernels. Such a kernel runs inside ``shard_map``.
    """

    grid: tuple
    in_specs: Sequence
    out_specs: Any
    out_shape: Any
    scratch_shapes: Sequence = ()
    num_scalar_prefetch: int = 0
    prefetch: Any = None
    dimension_semantics: Sequence[str] | None = None
    vmem_limit_bytes: int | None = None
    input_output_aliases: Mapping[int, int] = dataclasses.field(default_factory=dict)
    cost_estimate: Any = None
    body_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    collective_id: int | None = None

    @property
    def out_shapes(self) -> tuple:
        return tuple(self.out_shape) if isinstance(self.out_shape, (tuple, list)) else (self.out_shape,)

    @property
    def out_spec_list(self) -> tuple:
        return tuple(self.out_specs) if isinstance(self.out_specs, (tuple, list)) else (self.out_specs,)

    @property
    def multiple_outputs(self) -> bool:
        return isinstance(self.out_shape, (tuple, list))
