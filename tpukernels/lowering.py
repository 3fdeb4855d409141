"""Lowering: kernel + config + input signature -> a validated JAX function around ``pl.pallas_call``.

``lower(kernel, specs, statics, config, mode)`` resolves the config, runs the launch function, checks the
launch (block rules, VMEM against a chip) and builds the jitted function, once per cache key
``(shapes, dtypes, static args, config, mode, chip)``; later calls with the same key reuse it.

Modes: ``"fast"`` / ``"tpu"`` (cpu interpret modes, see :mod:`tpukernels.dsl.modes`) and ``"mosaic"``
(real Mosaic lowering, for TPU devices, compile-only chips and ``jax.export``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._env import env_flag
from .chips import Chip, target_chip_from_env
from .dsl.dtypes import check_jax_dtype
from .dsl.kernel import CONFIG_RESOLVERS, Resolved, TpuKernel
from .dsl.modes import interpret_value
from .dsl.spec import Config, TensorSpec
from .dsl.validate import VmemEstimate, check_block, check_index_maps, check_vmem, estimate_vmem, grid_is_empty
from .errors import ArgumentError, KernelBodyError, LoweringError, TpuKernelError

log = logging.getLogger("tpukernels.dispatch")
if env_flag("TPUKERNELS_LOG_CONFIG") and not log.handlers:  # visible without any logging setup
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("tpukernels: %(message)s"))
    # stands down once the application configures logging (logging.basicConfig gives the root logger a
    # handler, which the record reaches by propagation): one line per choice, not two
    _handler.addFilter(lambda record: not logging.getLogger().handlers)
    log.addHandler(_handler)
    log.setLevel(logging.INFO)


@dataclasses.dataclass
class Lowered:
    """One kernel specialised to a signature, config and mode.

    Attributes:
        fn: jitted JAX function ``fn(*arrays) -> tuple[jax.Array, ...]`` (arrays: the non-None tensor
            arguments in signature order).
        arg_structs: ``jax.ShapeDtypeStruct`` per array argument.
        out_structs: ``jax.ShapeDtypeStruct`` per output.
        vmem: the VMEM estimate of the launch.
        empty_grid: True when the grid has a zero extent (outputs are zeros, nothing runs).
        multiple_outputs: the kernel returns a tuple.
        out_rows: per output, whether it carries the row axis (see ``OutSpec.rows``).
        input_output_aliases: ``{input_index: output_index}`` passed to ``pallas_call``.
    """

    kernel: TpuKernel
    resolved: Resolved
    mode: str
    fn: Any
    arg_structs: tuple
    out_structs: tuple
    vmem: VmemEstimate
    empty_grid: bool
    multiple_outputs: bool = False
    out_rows: tuple = ()
    input_output_aliases: dict = dataclasses.field(default_factory=dict)
    _compiled: Any = None

    @property
    def config(self) -> Config:
        return self.resolved.config

    def compiled(self):
        """The fn compiled for the default (cpu) backend, compiled once; errors become LoweringError."""
        if self._compiled is None:
            try:
                self._compiled = self.fn.lower(*self.arg_structs).compile()
            except TpuKernelError:
                raise
            except Exception as e:
                translate = getattr(self.kernel, "lowering_error", None)  # front-ends with their own wording
                if translate is not None:
                    raise translate(e, self.resolved.specs, self.config) from e
                raise LoweringError(f"{self.kernel.qualname}: Pallas could not lower the kernel: {e}") from e
        return self._compiled


def _struct(x) -> Any:
    import jax

    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(tuple(int(s) for s in x.shape), x.dtype)


def validate(kernel: TpuKernel, resolved: Resolved, chip: Chip | None) -> VmemEstimate:
    """Check a launch before lowering: spec counts, block rules, VMEM on ``chip`` (if given).

    Raises:
        KernelBodyError: in_specs / out_specs counts do not match the arguments / outputs.
        BlockShapeError, VmemError: see :mod:`tpukernels.dsl.validate`.
    """
    launch = resolved.launch
    present = [s for s in resolved.specs if s is not None]
    n_pref = launch.num_scalar_prefetch
    blocked = present[n_pref:]
    in_specs = list(launch.in_specs)
    if len(in_specs) != len(blocked):
        raise KernelBodyError(
            f"{kernel.qualname}: launch gave {len(in_specs)} in_specs for {len(blocked)} blocked tensor inputs "
            f"({[s.name for s in blocked]})"
        )
    outs = launch.out_shapes
    out_specs = launch.out_spec_list
    if len(out_specs) != len(outs):
        raise KernelBodyError(f"{kernel.qualname}: launch gave {len(out_specs)} out_specs for {len(outs)} outputs")
    for o in outs:
        check_jax_dtype(o.dtype, f"{kernel.qualname} output")
    if grid_is_empty(launch.grid):  # nothing runs (outputs are zeros): blocks of empty arrays are moot
        return estimate_vmem([], ())
    items = []
    n_index_args = len(launch.grid) + n_pref if launch.prefetch is None else None  # prefetch: known when traced
    for spec, s in zip(in_specs, blocked):
        where = f"{kernel.qualname} in_specs for {s.name!r}"
        _check_index_map_arity(spec, n_index_args, len(launch.grid), where)
        check_block(spec, s.shape, s.dtype, where)
        items.append((s.name, spec, s.shape, s.dtype))
    for i, (spec, o) in enumerate(zip(out_specs, outs)):
        where = f"{kernel.qualname} out_specs[{i}]"
        _check_index_map_arity(spec, n_index_args, len(launch.grid), where)
        check_block(spec, o.shape, o.dtype, where)
        items.append((f"out[{i}]", spec, o.shape, o.dtype))
    if launch.dimension_semantics is not None and len(launch.dimension_semantics) != len(launch.grid):
        raise KernelBodyError(
            f"{kernel.qualname}: dimension_semantics {tuple(launch.dimension_semantics)} has "
            f"{len(launch.dimension_semantics)} entries for a grid of rank {len(launch.grid)}"
        )
    if not n_pref and launch.prefetch is None:  # block index maps vs extents: inputs read, outputs covered
        check_index_maps(kernel.qualname, launch.grid, [(s.name, sp, s.shape) for sp, s in zip(in_specs, blocked)],
                         [(i, sp, o.shape) for i, (sp, o) in enumerate(zip(out_specs, outs))],
                         tuple(launch.input_output_aliases.values()))
    est = estimate_vmem(items, launch.scratch_shapes)
    if chip is not None:
        check_vmem(est, chip, launch.vmem_limit_bytes, kernel.qualname, resolved.config)
    return est


def _check_index_map_arity(spec, n_args: int | None, grid_rank: int, where: str) -> None:
    """A BlockSpec's index_map takes one argument per grid axis (plus one per scalar-prefetch operand).

    Raises:
        KernelBodyError: it cannot be called with ``n_args`` positional arguments (says how many it takes).
    """
    import inspect

    fn = getattr(spec, "index_map", None)
    if fn is None or n_args is None:
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    ps = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
        return
    need = sum(1 for p in ps if p.default is p.empty)
    if not need <= n_args <= len(ps):
        extra = n_args - grid_rank
        raise KernelBodyError(
            f"{where}: index_map takes {len(ps)} argument{'s' if len(ps) != 1 else ''} but the grid has rank "
            f"{grid_rank}" + (f" plus {extra} scalar-prefetch operand{'s' if extra != 1 else ''}" if extra else "")
            + f": it must take {n_args} (one block index per grid axis{', prefetch refs first' if extra else ''})")


def build_fn(kernel: TpuKernel, resolved: Resolved, mode: str):
    """The JAX function for a resolved launch (not yet jitted)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    launch = resolved.launch
    out_structs = tuple(jax.ShapeDtypeStruct(tuple(int(d) for d in o.shape), o.dtype) for o in launch.out_shapes)
    if grid_is_empty(launch.grid):

        fills = tuple(getattr(o, "fill", 0) for o in launch.out_shapes)  # OutSpec.fill, else 0

        def zeros(*arrays):
            return tuple(jnp.full(o.shape, f, o.dtype) for o, f in zip(out_structs, fills))

        return zeros, out_structs
    params = pltpu.CompilerParams(
        dimension_semantics=tuple(launch.dimension_semantics) if launch.dimension_semantics else None,
        vmem_limit_bytes=launch.vmem_limit_bytes,
        **({} if launch.collective_id is None else {"collective_id": int(launch.collective_id)}),
    )

    def make_call(num_scalar_prefetch: int):
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalar_prefetch,
            grid=tuple(int(g) for g in launch.grid),
            in_specs=list(launch.in_specs),
            out_specs=list(launch.out_spec_list) if launch.multiple_outputs else launch.out_spec_list[0],
            scratch_shapes=list(launch.scratch_shapes),
        )
        return pl.pallas_call(
            kernel.body_for(resolved.statics, resolved.config, launch),
            grid_spec=grid_spec,
            out_shape=list(out_structs) if launch.multiple_outputs else out_structs[0],
            compiler_params=params,
            input_output_aliases=dict(launch.input_output_aliases),
            interpret=interpret_value(mode),
            cost_estimate=launch.cost_estimate,
            name=kernel.name,
        )

    n_pref = launch.num_scalar_prefetch
    call = make_call(n_pref) if launch.prefetch is None else None

    def fn(*arrays):
        if launch.prefetch is None:
            out = call(*arrays)
        else:  # scalar-prefetch operands derived on device (Launch.prefetch), same jitted function
            scalars = tuple(launch.prefetch(*arrays[:n_pref]))
            out = make_call(len(scalars))(*scalars, *arrays[n_pref:])
        return tuple(out) if launch.multiple_outputs else (out,)

    return fn, out_structs


_LAUNCH_CHIP: "contextvars.ContextVar[Chip | None]" = contextvars.ContextVar("tpukernels_launch_chip", default=None)


def launch_chip() -> Chip | None:
    """The chip a launch function is being run for: the compile-only / Mosaic target, or (cpu interpret)
    ``TPUKERNELS_TARGET_CHIP``; None when unknown (e.g. a cpu run with no target chip set).

    Launch functions call this to make chip-dependent choices or raise a typed error for a feature the
    chip lacks (e.g. an MXU dtype pair); it is set only while :func:`lower` runs the launch function.
    """
    return _LAUNCH_CHIP.get()


@contextlib.contextmanager
def launching_for(chip: Chip | None):
    """Run launch functions inside the block for ``chip`` (:func:`launch_chip` returns it there): used by
    :func:`lower` and by the tuner's static checks, so a launch's chip-dependent choices (e.g. a scoped-VMEM
    request capped per chip) are the ones the chip will get."""
    token = _LAUNCH_CHIP.set(chip)
    try:
        yield
    finally:
        _LAUNCH_CHIP.reset(token)


#: config sources that are not tuning-database entries (a DB entry that fails is a warning, these raise)
_NOT_DB = ("explicit", "heuristic", "default", "pinned")


def resolve(kernel: TpuKernel, specs: tuple, statics: tuple, config: Mapping | None, chip: Chip | None = None,
            resolvers: bool = True) -> Resolved:
    """Resolve the config (tuning data of ``chip`` if given) and run the launch function for one signature."""
    for s in specs:
        if s is not None:
            check_jax_dtype(s.dtype, f"{kernel.qualname} argument {s.name!r}")
    kernel.check_shapes(specs)
    cfg, source = kernel.resolve_config(specs, statics, config, chip, resolvers)
    launch = kernel.make_launch(specs, statics, cfg)
    log.log(
        logging.INFO if env_flag("TPUKERNELS_LOG_CONFIG") else logging.DEBUG,
        "%s: config %s from %s for %s",
        kernel.qualname, dict(cfg), source, [None if s is None else tuple(s.shape) for s in specs],
    )
    return Resolved(specs, statics, cfg, source, launch)


def lower(
    kernel: TpuKernel,
    specs: Sequence[TensorSpec | None],
    statics: Sequence[tuple[str, Any]] = (),
    config: Mapping | None = None,
    mode: str = "fast",
    chip: Chip | None = None,
) -> Lowered:
    """Lower ``kernel`` for one signature; cached per (specs, statics, config, mode, chip).

    Args:
        specs: one :class:`TensorSpec` (or None for an absent optional tensor) per tensor parameter.
        statics: ``(name, value)`` per static parameter, in signature order.
        config: explicit (possibly partial) config, or None to let dispatch pick.
        mode: ``"fast"``, ``"tpu"`` (cpu interpret) or ``"mosaic"``.
        chip: check VMEM against this chip (default: ``TPUKERNELS_TARGET_CHIP`` for cpu modes).

    Raises:
        DTypeError, ConfigError, BlockShapeError, VmemError, KernelBodyError: before any lowering.
    """
    import jax

    specs = tuple(specs)
    statics = tuple(statics)
    cfg_key = None if not config else Config(config)
    if chip is None and mode != "mosaic":
        chip = target_chip_from_env()
    key = (
        tuple(None if s is None else (tuple(int(d) for d in s.shape), np.dtype(s.dtype).name) for s in specs),
        statics,
        cfg_key,
        mode,
        None if chip is None else chip.name,
    )
    hit = kernel._entries.get(key)
    if hit is not None:
        return hit
    build = getattr(kernel, "build_lowered", None)
    if build is not None:  # another front-end (e.g. Helion) lowers itself
        low = build(specs, statics, config, mode, chip)
        with kernel._lock:
            kernel._entries[key] = low
        return low
    with launching_for(chip):
        resolved, vmem = _resolve_and_validate(kernel, specs, statics, config, chip, mode)
    fn, out_structs = build_fn(kernel, resolved, mode)
    arg_structs = tuple(jax.ShapeDtypeStruct(tuple(int(d) for d in s.shape), s.dtype) for s in specs if s is not None)
    launch = resolved.launch
    low = Lowered(
        # keep_unused: every tensor stays a parameter (torch_tpu passes them all, even to an empty grid)
        kernel, resolved, mode, jax.jit(fn, keep_unused=True), arg_structs, out_structs, vmem, grid_is_empty(launch.grid),
        multiple_outputs=launch.multiple_outputs,
        out_rows=tuple(getattr(o, "rows", True) for o in launch.out_shapes),
        input_output_aliases=dict(launch.input_output_aliases),
    )
    with kernel._lock:
        kernel._entries[key] = low
    return low


def _resolve_and_validate(kernel, specs, statics, config, chip, mode):
    """resolve + validate; a tuning-DB config the launch or the checks reject is skipped with a warning."""
    db_chip = chip if mode == "mosaic" else None
    resolved = None
    try:
        resolved = resolve(kernel, specs, statics, config, db_chip)
        return resolved, validate(kernel, resolved, chip)
    except TpuKernelError as e:
        if config or not CONFIG_RESOLVERS or (resolved is not None and resolved.source in _NOT_DB):
            raise  # not a tuning-DB config: the error is the user's to see, without a DB detour
        # Only a DB-sourced config gets a second chance; re-resolve without the DB to find out.
        fallback = resolve(kernel, specs, statics, None, db_chip, resolvers=False)
        shapes = [None if s is None else tuple(s.shape) for s in specs]
        warnings.warn(f"tpukernels: {kernel.qualname}: ignoring the tuning-DB config for {shapes} ({e}); "
                      f"using the {fallback.source} config {dict(fallback.config)}", RuntimeWarning, stacklevel=3)
        return fallback, validate(kernel, fallback, chip)


def specs_from_values(kernel: TpuKernel, values: Sequence) -> tuple[tuple, tuple]:
    """Split bound op arguments into (TensorSpec-or-None per tensor param, (name, value) statics).

    Accepts torch tensors, jax arrays, ``jax.ShapeDtypeStruct`` and :class:`TensorSpec` for tensors.

    Raises:
        ArgumentError: a tensor parameter got a non-tensor, or a static parameter a tensor.
    """
    from .dsl.dtypes import to_jax_dtype
    from .dsl.kernel import check_static

    specs, statics = [], []
    for p, v in zip(kernel.params, values):
        if p.kind == "static":
            if hasattr(v, "shape") and hasattr(v, "dtype"):
                raise ArgumentError(f"{kernel.qualname}: argument {p.name!r} is static ({p.annotation}), got a tensor")
            statics.append((p.name, check_static(kernel.qualname, p, v)))
            continue
        if v is None:
            if p.kind == "tensor":
                raise ArgumentError(f"{kernel.qualname}: argument {p.name!r} is a required tensor, got None")
            specs.append(None)
            continue
        if isinstance(v, TensorSpec):
            specs.append(TensorSpec(tuple(v.shape), v.dtype, p.name))
            continue
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise ArgumentError(f"{kernel.qualname}: argument {p.name!r} must be a tensor, got {type(v).__name__}")
        dt = v.dtype
        if type(dt).__module__.startswith("torch"):
            dt = to_jax_dtype(dt, f"{kernel.qualname} argument {p.name!r}")
        specs.append(TensorSpec(tuple(v.shape), np.dtype(dt), p.name))
    return tuple(specs), tuple(statics)


