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
* Partial tiles: Helion 1.5.1's Pallas backend reads and writes whole tiles past the array end for
  some programs (caught by the TPU-faithful interpreter as out-of-bounds DMAs), so shapes must be
  multiples of the tile sizes there; tpukernels reports this as a :class:`LoweringError` with the
  alternatives instead of a deep traceback.
* ``interpret="tpu"`` runs Helion's interpret-mode code under ``pltpu.force_tpu_interpret_mode``.
* Dtypes the Pallas backend cannot take (float64, int64, uint64) are rejected with a
  :class:`~tpukernels.errors.DTypeError` before Helion sees them; other features Helion cannot lower
  (e.g. data-dependent gathers) raise :class:`~tpukernels.errors.LoweringError` naming the kernel, the
  feature Helion reported, and the alternative (a Pallas-style ``@tpu_kernel``).
"""

from __future__ import annotations

import contextlib
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
        names = [p.name for p in self.params]
        kinds = [p.kind for p in self.params]
        static_vals = dict(statics)

        def fn(*arrays):
            it = iter(arrays)
            args = []
            for n, k, s in zip(names, kinds, _expand(specs, kinds)):
                if k == "static":
                    args.append(static_vals[n])
                else:
                    args.append(None if s is None else next(it))
            try:
                if mode == "tpu":  # TPU-faithful interpreter (NaN memory, OOB and race checks)
                    from jax.experimental.pallas import tpu as pltpu

                    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
                        out = hk.jax_fn(*args)
                else:
                    with device_ctx():
                        out = hk.jax_fn(*args)
            except TpuKernelError:
                raise
            except Exception as e:
                raise self.lowering_error(e, specs, config) from e
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        return fn

    def lowering_error(self, e: BaseException, specs, config) -> "LoweringError | ArgumentError":
        """Translate an error Helion / Pallas raised for this program into a :class:`LoweringError`, or an
        :class:`ArgumentError` when the inputs' shapes do not fit the program (a broadcast mismatch)."""
        msg = str(e)
        if "Shapes must be 1D sequences of concrete values" in msg or "Out-of-bounds" in msg:
            shapes = [tuple(s.shape) for s in specs if s is not None]
            return LoweringError(
                f"{self.qualname}: Helion 1.5.1's Pallas backend cannot run partial tiles of this program "
                f"(inputs {shapes}, config {dict(config) or 'Helion default'}): choose block_sizes that "
                f"divide the shapes, declare rows= and pad, or use the Pallas front-end, whose tails are "
                f"masked (tpukernels.mask_tail)."
            )
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
        fn = self._jax_callable(specs, statics, cfg, mode, chip)
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


def _target_device_ctx(chip):
    """A context factory naming ``chip`` as the TPU jax traces for (:meth:`Chip.trace_target`), or a no-op."""
    return contextlib.nullcontext if chip is None else chip.trace_target


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

