"""Helion front-end: ``@tpu_kernel(backend="helion")`` on a Helion tile program.

The decorated function is an ordinary Helion kernel body (``for tile in hl.tile(...)``) with annotated
arguments. tpukernels compiles it with Helion's Pallas backend (``helion.kernel(fn, backend="pallas")``)
and uses Helion's pure-JAX view (``Kernel.jax_fn``) as the lowered function, so a Helion kernel gets
what a Pallas-style one gets: the same torch op (cpu interpret, tpu via torch_tpu, fake, autograd hook),
``compile_for(...)`` per chip, and a tunable space the tpukernels autotuner searches.

Tunables are Helion config knobs: ``tunables={"block_sizes": tk.Tunable([(64,), (128,), (256,)])}``
(list-valued knobs are given as tuples). A pinned ``config=`` or, without tunables, Helion's heuristic
default config (``autotune_effort="none"``) is used: Helion's own autotuner never runs implicitly.

Differences from the Pallas front-end (documented, not hidden):

* Helion builds its own BlockSpecs, so tpukernels' pre-lowering block/VMEM checks do not apply; the
  compile-only target still reports real Mosaic errors and VMEM overflows.
* Partial tiles: Helion 1.5.1's Pallas backend reads and writes whole tiles past the array end
  (out-of-bounds DMAs in the TPU-faithful interpreter, a trace error in fast interpret mode). Before
  anything runs, in every mode and for ``compile_for``, tpukernels reads Helion's launch plan for the call
  (its generated host code run with a recording launcher) and pads: a grid-tiled input dim that is not a
  multiple of its block is zero-padded up to one, and so are the input dims that an output allocated in the
  body (``torch.empty([m, n])``, a matmul's output, whose inputs Helion reads with its own padded DMAs) is
  sized from; each output is sliced back to its true shape (as ``rows=`` does for the Pallas front-end). So
  ``out[tile] = x[tile] + 2 * y[tile]`` works on a 300x260 input and a matmul on M=200, N=130 with blocks of
  128. Each tile computes its own elements, so the padding reaches only output elements that are sliced
  away; a program that reduces *across* grid tiles of a padded dim (atomics into one element) would see the
  zeros. What padding cannot make whole (an output sized by something other than an input dim) is a
  :class:`LoweringError` naming the output (``output k``) or argument, the dim and the block, with the
  caller's shapes; ``compile_for`` returns it as a failed result.
* Input sizes: Helion does not check that a tensor indexed by a tile (``b[tn]``) is as long as the
  range the tile runs over; its Pallas backend then reads past the end and returns wrapped-around
  values silently. tpukernels checks every tile-indexed dim of the program's loads and stores against
  its tile's extent (Helion's device IR) and raises :class:`ArgumentError` when it is smaller. Other
  relations between input dims (equal sizes, fixed dims) are checked when the kernel declares
  ``shapes=``, as for the Pallas front-end.
* Helion's own "triton codegen error" log record (a traceback on stderr at every call of a program
  it cannot lower) is dropped while tpukernels compiles; the :class:`LoweringError` is chained to
  Helion's exception instead.
* Static arguments: numeric ones (int, float, bool) reach Helion as ``hl.constexpr(value)``, so each value
  gets its own Helion program, as it gets its own lowering. Helion 1.5.1 keys a plain int by its type only,
  so an int used as a size (``torch.empty([m, n])``, ``hl.tile(m)``) used to keep the first call's value.
* ``interpret="tpu"`` runs Helion's interpret-mode code under ``pltpu.force_tpu_interpret_mode``.
* Dtypes the Pallas backend cannot take (float64, int64, uint64) are rejected with a
  :class:`~tpukernels.errors.DTypeError` before Helion sees them; other features Helion cannot lower
  (e.g. data-dependent gathers) raise :class:`~tpukernels.errors.LoweringError` naming the kernel, the
  feature Helion reported, and the alternative (a Pallas-style ``@tpu_kernel``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping

import numpy as np

from ..dsl.kernel import Resolved, TpuKernel
from ..dsl.spec import Config, OutSpec, Tunable
from ..dsl.validate import VmemEstimate
from ..errors import ArgumentError, KernelBodyError, LoweringError, TpuKernelError


def _helion_config(config: Config):
    import helion

    return helion.Config(**{k: list(v) if isinstance(v, tuple) else v for k, v in config.items()})


class HelionKernel(TpuKernel):
    """A :class:`TpuKernel` whose body is a Helion tile program (see module docstring)."""

    backend = "helion"
    tunables_are_params = False

    def __init__(self, fn: Callable, *, pinned: Mapping | None = None, **kw):
        self._pinned = dict(pinned or {})
        self._helion_kernels: dict = {}
        super().__init__(fn, fn, **kw)

    # Helion programs have no launch function: output shapes come from jax.eval_shape of the program.
    def make_launch(self, specs, statics, config):  # pragma: no cover - not used for Helion
        raise TpuKernelError(f"{self.qualname}: Helion kernels have no launch description")

    def body_for(self, statics, config, launch):  # pragma: no cover - not used for Helion
        raise TpuKernelError(f"{self.qualname}: Helion kernels have no Pallas body")

    def resolve_config(self, specs, statics, config, chip=None, resolvers=True):
        cfg, source = super().resolve_config(specs, statics, config, chip, resolvers)
        if source == "default" and self._pinned:
            return Config({**self._pinned, **dict(cfg)}), "pinned"
        return cfg, source

    def helion_kernel(self, config: Config, interpret: bool):
        """The ``helion.Kernel`` for one config and interpret flag (cached)."""
        import helion

        key = (config, interpret)
        hk = self._helion_kernels.get(key)
        if hk is None:
            settings = {"backend": "pallas", "pallas_interpret": interpret}
            cfg = {**self._pinned, **dict(config)}
            if cfg:
                hk = helion.kernel(self.body, config=_helion_config(Config(cfg)), **settings)
            else:
                hk = helion.kernel(self.body, autotune_effort="none", **settings)
            self._helion_kernels[key] = hk
        return hk

    def _jax_callable(self, specs, statics, config: Config, mode: str, chip=None):
        hk = self.helion_kernel(config, interpret=mode != "mosaic")
        # Helion's Pallas backend asks jax for the TPU generation while tracing (``pltpu.get_tpu_info``). A
        # TorchTPU host's JAX sees no TPU (torch_tpu owns it) and compile-only targets are not the default
        # device, so name the target chip through an abstract mesh, which jax consults first.
        device_ctx = _target_device_ctx(chip) if mode == "mosaic" else contextlib.nullcontext
        def fn(*arrays):
            args = self._program_args(specs, statics, arrays)
            try:
                if mode in ("tpu", "races"):  # TPU-faithful interpreter (NaN memory, OOB and race checks)
                    from jax.experimental.pallas import tpu as pltpu

                    from ..dsl.modes import interpret_value

                    with pltpu.force_tpu_interpret_mode(interpret_value(mode)), _quiet_codegen_log():
                        out = hk.jax_fn(*args)
                else:
                    with device_ctx(), _quiet_codegen_log():
                        out = hk.jax_fn(*args)
            except TpuKernelError:
                raise
            except Exception as e:
                raise self.lowering_error(e, specs, config) from e
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        return fn

    def _program_args(self, specs, statics, arrays) -> list:
        """The program's positional arguments: ``arrays`` (one per present tensor) with the static values and
        None for absent optional tensors at their positions.

        Numeric static values (int, float, bool) are passed as ``hl.constexpr(value)``, Helion's documented
        way to specialize a program on an argument's value: Helion 1.5.1 keys a plain int / float / bool
        argument by its type only (``_number_key``), so one bound program served every value, and an int used
        as a size (``torch.empty([m, n])``, ``hl.tile(m)``) kept the first call's value (a call with m=200
        after one with m=128 returned 128 rows). tpukernels lowers once per static value anyway (the lowering
        cache is keyed on them), so this costs no extra compiles."""
        import helion.language as hl

        it = iter(arrays)
        static_vals = dict(statics)
        kinds = [p.kind for p in self.params]
        return [_constexpr(hl, static_vals[p.name]) if p.kind == "static" else (None if s is None else next(it))
                for p, s in zip(self.params, _expand(specs, kinds))]

    def _plan(self, specs, statics, config: Config, mode: str, chip=None):
        """Helion's launch plan for ``specs``: ``(bound, launches, names, outputs)`` from :func:`_dry_run` (no
        kernel runs); errors Helion raises become :meth:`lowering_error`'s."""
        import jax

        hk = self.helion_kernel(config, interpret=mode != "mosaic")
        device_ctx = _target_device_ctx(chip) if mode == "mosaic" else contextlib.nullcontext
        try:
            with device_ctx(), _quiet_codegen_log():
                return _dry_run(hk, self._program_args(
                    specs, statics, [jax.ShapeDtypeStruct(tuple(int(d) for d in s.shape), s.dtype)
                                     for s in specs if s is not None]))
        except TpuKernelError:
            raise
        except Exception as e:
            raise self.lowering_error(e, specs, config) from e

    def _checked_plan(self, specs, statics, config: Config, mode: str, chip=None):
        """``(partial tiles, output placeholders)`` of Helion's plan for ``specs``, after the tile-read check
        (see :meth:`check_program`)."""
        bound, launches, names, outs = self._plan(specs, statics, config, mode, chip)
        for arg, shape, d, tile, extent in _tile_reads(bound):
            if shape[d] is not None and extent is not None and 1 < shape[d] < extent:
                shapes = {s.name: tuple(s.shape) for s in specs if s is not None}
                raise ArgumentError(
                    f"{self.qualname}: {arg} has shape {shape}, but the program indexes its dim {d} with tile "
                    f"{tile!r}, which runs over {extent} elements, so {arg} would be read past its end (inputs "
                    f"{shapes}): its dim {d} must be at least {extent}. Declare shapes= on the kernel to check "
                    f"how its inputs' dims relate before anything is traced")
        return list(_partial_tiles(launches, names)), outs

    def check_program(self, specs, statics, config: Config, mode: str, chip=None, collect: bool = False) -> list:
        """Check the inputs against what Helion compiled for them, before anything runs (every mode alike).

        Binds the program (Helion's type propagation and device IR, the same ``BoundKernel`` that
        ``Kernel.jax_fn`` then reuses), generates its code for ``config`` and runs the generated host wrapper
        with a launcher that only records its arguments (no kernel runs). Then:

        * a tensor dim indexed by a tile (``b[tn]``) must be at least the extent the tile runs over: a
          smaller one is read past its end (Helion 1.5.1 does not check this; its Pallas backend gave
          wrapped-around values silently) -> :class:`ArgumentError` naming the tensor, dim and tile;
        * a grid-tiled dim of an input or an output must be a multiple of its block (or fit in one block),
          unless Helion pads it (``_ds_pad_dims``): partial tiles fail in fast interpret mode, read out of
          bounds in the TPU-faithful interpreter and on a TPU -> :class:`LoweringError` (``collect=True``:
          returned as ``(name, shape, dim, block)`` tuples instead, ``name`` an input's parameter name or
          ``"output k"``, for :meth:`padded_for_tiles`).
        """
        partial, _outs = self._checked_plan(specs, statics, config, mode, chip)
        if collect:
            return partial
        for arg, shape, d, block in partial:
            raise self._partial_tile_error(specs, config, f"{arg} dim {d} ({shape[d]}) is not a multiple of its "
                                                          f"block {block}")
        return []

    def padded_for_tiles(self, specs, statics, config: Config, mode: str, chip=None):
        """Partial tiles made whole: ``(specs, out_shapes)`` where ``specs`` has input dims padded up to a
        multiple of their block and ``out_shapes`` are the outputs' true shapes, to slice the padded
        program's outputs back to (None when nothing is partial: ``specs`` is returned unchanged).

        Which input dims are padded:

        * an input dim that a grid tile covers in part: padded to a multiple of its block;
        * an output dim that a grid tile covers in part (an output the body allocates, ``torch.empty([m, n])``,
          while the inputs it is computed from are read by Helion's own padded DMAs, as a matmul's are): the
          input dims it is sized from. They are found by asking Helion: the input dims of the output dim's
          size are padded together, then each is left unpadded in turn and stays so if the output dim still
          pads (a matmul ``[200, 200] @ [200, 128]`` pads ``a``'s rows, not its 200 columns).

        The program then runs on zero-padded inputs, exactly as ``rows=`` does for the Pallas front-end:
        each tile computes its own elements, so the padding only produces output elements that are sliced
        away.

        Raises:
            LoweringError: the program has partial tiles that padding its inputs does not make whole (an
                output sized by a static argument, a program that rejects the padded shapes); the message
                gives the caller's shapes, not the padded ones.
        """
        from ..dsl.spec import TensorSpec

        partial, outs = self._checked_plan(specs, statics, config, mode, chip)
        if not partial:
            return specs, None
        true_out = [tuple(int(d) for d in o.shape) for o in outs]
        shapes = {s.name: tuple(int(d) for d in s.shape) for s in specs if s is not None}

        def padded(grow: dict):
            res = []
            for s in specs:
                if s is None or not any(n == s.name for n, _ in grow):
                    res.append(s)
                    continue
                res.append(TensorSpec(tuple(grow.get((s.name, d), int(n)) for d, n in enumerate(s.shape)),
                                      s.dtype, s.name))
            return tuple(res)

        def attempt(grow: dict):
            """The partial tiles left with ``grow`` applied; None if the program rejects those shapes."""
            try:
                return self.check_program(padded(grow), statics, config, mode, chip, collect=True)
            except Exception:  # noqa: BLE001  (a shape the program cannot take: not a usable padding)
                return None

        def whole(size: int, block: int) -> int:
            return -(-size // block) * block

        grow: dict = {}
        for arg, shape, d, block in partial:
            if arg in shapes:
                grow[(arg, d)] = max(grow.get((arg, d), 0), whole(shape[d], block))
        rest = attempt(grow) if grow else partial
        for _ in range(8):  # one output dim resolved per round
            if not rest or any(arg in shapes for arg, *_ in rest):
                break
            arg, shape, d, block = rest[0]
            size, target = shape[d], whole(shape[d], block)
            cands = [(n, i) for n, sh in shapes.items() for i, v in enumerate(sh) if v == size and (n, i) not in grow]

            def resolves(keys, arg=arg, d=d, target=target):
                r = attempt({**grow, **{k: target for k in keys}})
                return r is not None and not any(a == arg and dd == d for a, _s, dd, _b in r)

            if not cands or not resolves(cands):
                break
            keep = list(cands)
            for c in cands:
                if len(keep) > 1 and resolves([k for k in keep if k != c]):
                    keep.remove(c)
            grow.update({k: target for k in keep})
            rest = attempt(grow)
        if rest is None:
            raise self._partial_tile_error(specs, config, "the program rejects its inputs padded to whole blocks "
                                                          f"({_grown(grow, shapes)})")
        if rest:
            arg, shape, d, block = rest[0]
            first = next((p for p in partial if p[0] == arg and p[2] == d), None)
            if first is None:  # whole on the caller's shapes: the padding of other dims made it partial
                detail = (f"padding the inputs to whole blocks ({_grown(grow, shapes)}) makes {arg} dim {d} "
                          f"{shape[d]} long, not a multiple of its block {block}")
            else:
                detail = (f"{arg} dim {d} ({first[1][d]}) is not a multiple of its block {block}, and padding the "
                          f"inputs does not make it one")
            raise self._partial_tile_error(specs, config, detail)
        return padded(grow), true_out

    def _partial_tile_error(self, specs, config, detail: str = "") -> LoweringError:
        shapes = [tuple(s.shape) for s in specs if s is not None]
        detail = f"; {detail}" if detail else ""
        return LoweringError(
            f"{self.qualname}: Helion 1.5.1's Pallas backend cannot run partial tiles of this program "
            f"(inputs {shapes}, config {dict(config) or 'Helion default'}{detail}): choose block_sizes that "
            f"divide the shapes, declare rows= and pad, or use the Pallas front-end, whose tails are "
            f"masked (tpukernels.mask_tail)."
        )

    def lowering_error(self, e: BaseException, specs, config) -> "LoweringError | ArgumentError":
        """Translate an error Helion / Pallas raised for this program into a :class:`LoweringError`, or an
        :class:`ArgumentError` when the inputs' shapes do not fit the program (a broadcast mismatch)."""
        msg = str(e)
        if "Shapes must be 1D sequences of concrete values" in msg or "Out-of-bounds" in msg:
            return self._partial_tile_error(specs, config)
        first = msg.splitlines()[0] if msg else repr(e)
        if "must match the size of tensor" in msg or "shapes are incompatible" in msg.lower():
            shapes = {s.name: tuple(s.shape) for s in specs if s is not None}
            return ArgumentError(
                f"{self.qualname}: the input shapes {shapes} do not fit this program ({first}); declare "
                f"shapes= on the kernel to have such calls rejected before tracing")
        return LoweringError(
            f"{self.qualname}: Helion's Pallas backend could not lower this program: {type(e).__name__}: {first}. "
            f"Alternative: write it as a Pallas-style @tpu_kernel(body) with explicit BlockSpecs."
        )

    def build_lowered(self, specs, statics, config, mode, chip):
        """Lower through Helion (called by :func:`tpukernels.lowering.lower`, which caches)."""
        import jax

        from ..dsl.dtypes import check_jax_dtype
        from ..lowering import Lowered

        for s in specs:
            if s is not None:
                check_jax_dtype(s.dtype, f"{self.qualname} argument {s.name!r}")
        self.check_shapes(specs)
        cfg, source = self.resolve_config(specs, statics, config, chip)
        padded, out_shapes = self.padded_for_tiles(specs, statics, cfg, mode, chip)
        fn = self._jax_callable(padded, statics, cfg, mode, chip)
        if out_shapes is not None:
            fn = _pad_and_slice(fn, [s for s in specs if s is not None], [s for s in padded if s is not None],
                                out_shapes)
        arg_structs = tuple(jax.ShapeDtypeStruct(tuple(int(d) for d in s.shape), s.dtype) for s in specs if s is not None)
        try:
            out_structs = tuple(jax.eval_shape(fn, *arg_structs))
        except TpuKernelError:
            raise
        except Exception as e:
            raise KernelBodyError(f"{self.qualname}: Helion program raised {type(e).__name__}: {e}") from e
        multiple = self.returns_tuple
        resolved = Resolved(tuple(specs), tuple(statics), cfg, source, None)
        return Lowered(
            self, resolved, mode, jax.jit(fn, keep_unused=True), arg_structs, out_structs, VmemEstimate(0, 0, ()), False,
            multiple_outputs=multiple, out_rows=tuple(True for _ in out_structs),
        )

    def out_specs_for(self, specs, statics, config=None):
        """Output shapes for the fake kernel: the program's outputs at the hint sizes, each dim mapped
        back to the (possibly symbolic) input dim of equal hint, so dynamic shapes add no guards."""
        from torch.fx.experimental.symbolic_shapes import optimization_hint as hint_int

        if self.out_shape_fn is not None:
            return super().out_specs_for(specs, statics, config)
        hinted, by_hint = [], {}
        from ..dsl.spec import TensorSpec

        for s in specs:
            if s is None:
                hinted.append(None)
                continue
            dims = []
            for d in s.shape:
                h = hint_int(d) if not isinstance(d, int) else d
                by_hint.setdefault(h, d)
                dims.append(h)
            hinted.append(TensorSpec(tuple(dims), s.dtype, s.name))
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from ..lowering import lower

        with unset_fake_temporarily():  # Helion traces with real (non-fake) torch tensor wrappers
            low = lower(self, tuple(hinted), statics, config, "fast")
        return tuple(OutSpec(tuple(by_hint.get(d, d) for d in o.shape), np.dtype(o.dtype)) for o in low.out_structs)


class _DropCodegenErrorLog:
    """A logging filter dropping Helion's "triton codegen error" warning (see :func:`_quiet_codegen_log`)."""

    @staticmethod
    def filter(record) -> bool:
        return not str(record.msg).startswith("Helion compiler triton codegen error")


@contextlib.contextmanager
def _quiet_codegen_log():
    """While tpukernels compiles a Helion program: Helion logs a warning with the full traceback ("Helion
    compiler triton codegen error for ...") on stderr, then re-raises; tpukernels turns that exception into
    a :class:`LoweringError` chained to it, so the log record is dropped (only that record, only on Helion's
    ``helion.runtime.kernel`` logger, only for the attempt)."""
    import logging

    logger = logging.getLogger("helion.runtime.kernel")
    logger.addFilter(_DropCodegenErrorLog)
    try:
        yield
    finally:
        logger.removeFilter(_DropCodegenErrorLog)


def _grown(grow: dict, shapes: dict) -> str:
    """``grow`` (``(input, dim) -> padded size``) as ``"x dim 0 300 -> 384, ..."``, for messages."""
    return ", ".join(f"{n} dim {d} {shapes[n][d]} -> {p}" for (n, d), p in sorted(grow.items())) or "none"


def _pad_and_slice(fn, specs, padded, out_shapes):
    """``fn`` (the program on ``padded`` shapes) as a function of arrays of the true ``specs`` shapes: inputs
    zero-padded, each output sliced back to its true shape (``out_shapes``, from Helion's plan for the true
    shapes), so an output dim that happens to equal a padded size is not cut."""
    import jax.numpy as jnp

    widths = [tuple((0, int(p) - int(d)) for d, p in zip(s.shape, ps.shape)) for s, ps in zip(specs, padded)]

    def run(*arrays):
        grown = [a if not any(w for _, w in wd) else jnp.pad(a, wd) for a, wd in zip(arrays, widths)]
        outs = fn(*grown)
        if len(outs) != len(out_shapes):
            raise LoweringError(f"Helion program returned {len(outs)} outputs on padded inputs, {len(out_shapes)} "
                                f"on the caller's shapes")
        return tuple(o[tuple(slice(0, n) for n in shape)] for o, shape in zip(outs, out_shapes))

    return run


def _dry_run(hk, args: list):
    """Bind Helion kernel ``hk`` to ``args`` (``jax.ShapeDtypeStruct`` for tensors, as ``Kernel.jax_fn`` wraps
    arrays), generate its code and run the generated host wrapper with a launcher that records
    ``(grid, launch args, launch kwargs)`` and returns the output placeholders: no kernel runs.

    Returns ``(bound_kernel, launches, names, outputs)``: ``names`` maps ``id(adapter)`` to the parameter name
    of each input and to ``"output k"`` for the program's k-th returned tensor; ``outputs`` are those returned
    tensors (placeholders with the outputs' shapes), flattened as ``Kernel.jax_fn`` returns them.
    """
    from helion.runtime.pallas.jax_export import _device_for_jax_export, _JaxExportTensor

    device = _device_for_jax_export()
    adapters = [_JaxExportTensor.from_jax(a, device=device) if hasattr(a, "shape") and hasattr(a, "dtype") else a
                for a in args]
    bound = hk.bind(tuple(adapters))
    bound.ensure_config_exists(adapters)
    launches = []

    def launcher(_kernel, grid, *launch_args, **launch_kwargs):
        launches.append((tuple(grid), launch_args, launch_kwargs))
        outs = [launch_args[i] for i in launch_kwargs.get("_output_indices") or []]
        inplace = set(launch_kwargs.get("_inplace_indices") or [])
        ret = [o for o, i in zip(outs, launch_kwargs.get("_output_indices") or []) if i not in inplace] or outs
        return ret[0] if len(ret) == 1 else tuple(ret)

    result = bound._run(*adapters, _launcher=launcher)
    outputs = list(result) if isinstance(result, (tuple, list)) else [] if result is None else [result]
    params = inspect.signature(hk.fn).parameters
    names = {id(o): f"output {k}" for k, o in enumerate(outputs)}
    names.update({id(a): n for a, n in zip(adapters, params) if hasattr(a, "shape")})
    return bound, launches, names, outputs


def _expr(v):
    return v._sympy_() if hasattr(v, "_sympy_") else v


def _int(v):
    """``v`` as an int if it is a concrete integer (int, numpy or sympy), else None."""
    import sympy

    if isinstance(v, bool):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    v = _expr(v)
    return int(v) if isinstance(v, sympy.Integer) else None


def _tile_reads(bound):
    """``(tensor name, shape, dim, tile name, tile extent)`` for every dim of a load/store in the bound
    program's device IR that is indexed by a tile itself (``x[tm, tn]``; slices, scalars and expressions
    of a tile are skipped)."""
    import torch
    from helion.language import _tracing_ops, memory_ops

    blocks = {_expr(b.var): b for b in bound.env.block_sizes}
    for g in bound.host_function.device_ir.graphs:
        for n in g.graph.nodes:
            if n.op != "call_function" or n.target not in (memory_ops.load, memory_ops.store) or len(n.args) < 2:
                continue
            t, index = n.args[0], n.args[1]
            if not isinstance(t, torch.fx.Node) or not isinstance(index, (list, tuple)):
                continue
            val = t.meta.get("val")
            if not isinstance(val, torch.Tensor) or len(index) != val.dim():
                continue  # None (new axis) entries or a partial index: no dim-by-dim correspondence
            name = t.args[0] if t.target is _tracing_ops._host_tensor and t.args else t.name
            shape = tuple(_int(d) for d in val.shape)
            for i, idx in enumerate(index):
                sym = idx.meta.get("val") if isinstance(idx, torch.fx.Node) else None
                if not isinstance(sym, torch.SymInt):
                    continue
                b = blocks.get(_expr(sym))
                if b is None:
                    continue
                tile = "/".join(sorted(b.debug_names)) or f"block {b.block_id}"
                yield str(name), shape, i, tile, _int(b.size)


def _partial_tiles(launches, names: dict):
    """``(tensor, shape, dim, block)`` for each grid-tiled dim of a launch's BlockSpecs that is neither a
    multiple of its block nor within one block, and that Helion does not pad (``_ds_pad_dims``). Also when the
    grid stops before the partial block (2 blocks of 128 over 312 rows): Helion's pipeline fails on the
    array's partial tail all the same."""
    import torch

    for _grid, largs, kw in launches:
        info = kw.get("_block_spec_info") or []
        padded = {(int(a), int(d)) for a, d, *_ in kw.get("_ds_pad_dims") or []}
        tensors = [i for i, a in enumerate(largs) if isinstance(a, torch.Tensor)]
        for pos, i in enumerate(tensors):
            entry = info[pos] if pos < len(info) else None
            if entry is None:
                continue
            shape = tuple(int(d) for d in largs[i].shape)
            for d, (block, g) in enumerate(zip(*entry)):
                if block is None or g is None or (i, d) in padded or d >= len(shape):
                    continue
                if shape[d] > block and shape[d] % block:
                    yield names.get(id(largs[i]), f"tensor operand {pos}"), shape, d, block


def _target_device_ctx(chip):
    """A context factory naming ``chip`` as the TPU jax traces for (:meth:`Chip.trace_target`), or a no-op."""
    return contextlib.nullcontext if chip is None else chip.trace_target


def _constexpr(hl, v):
    """``v`` as ``hl.constexpr(v)`` when it is a number (int, float, bool), so Helion specializes on its value;
    other static values (str, None, ...) unchanged (Helion already keys a str by value)."""
    return hl.constexpr(v) if isinstance(v, (int, float, bool, np.integer, np.floating, np.bool_)) else v


def _expand(specs, kinds):
    """specs (one per tensor param) spread over all params (None at static positions)."""
    it = iter(specs)
    return [None if k == "static" else next(it) for k in kinds]


def helion_kernel(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    namespace: str = "tpukernels_user",
    tunables: Mapping[str, Tunable] | None = None,
    config: Mapping | None = None,
    constraints=(),
    heuristic: Callable | None = None,
    rows=(),
    shapes=None,
    out_shape: Callable | None = None,
    reference: Callable | None = None,
):
    """Make a :class:`HelionKernel`; what ``tpu_kernel(backend="helion", ...)`` calls.

    Args:
        config: a pinned Helion config (``{"block_sizes": [64, 128]}``), used when no tunable overrides it.
        Others: as :func:`tpukernels.tpu_kernel`.
    """

    def deco(f: Callable) -> HelionKernel:
        return HelionKernel(
            f, pinned={k: tuple(v) if isinstance(v, list) else v for k, v in (config or {}).items()},
            name=name, namespace=namespace, tunables=tunables, constraints=constraints, heuristic=heuristic,
            rows=rows, shapes=shapes, out_shape=out_shape, reference=reference,
        )

    return deco(fn) if fn is not None else deco

