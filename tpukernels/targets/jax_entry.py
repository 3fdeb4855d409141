"""The JAX entry: run a kernel on jax arrays, eagerly or inside ``jax.jit`` / ``jax.vmap`` / ``shard_map`` /
``jax.grad`` (tracer arguments), choosing Mosaic or the interpreter from the platform being lowered for.

:func:`jax_call` is public as ``tpukernels.jax_call``; ``kernel(jax_array, ...)`` ends in :func:`run_jax` too.

How the target is chosen:

* concrete arrays (eager): Mosaic when an argument lives on a TPU device, else the current interpret mode
  (:func:`tpukernels.current_interpret_mode`);
* tracers (under a JAX transformation): ``jax.lax.platform_dependent(tpu=<Mosaic>, default=<interpret>)``,
  so the choice is made when XLA lowers the program for its platform (``jax.jit`` on a TPU host: Mosaic; on
  a CPU host, or ``jax.jit(..., device=cpu)``: the interpreter; ``jax.export(platforms=["tpu"])`` from a
  CPU host: Mosaic). Array devices are never read, so tracers are fine. The interpret mode is read when the
  call is traced.

Gradients: a kernel with a backward (:meth:`TpuKernel.def_backward`) is wrapped in ``jax.custom_vjp`` whose
backward calls that same backward function with jax arrays (``ctx.args`` / ``ctx.outputs`` are jax arrays; the
backward's kernel calls go through this entry again). A backward written with torch-only methods
(``.to(dtype)``, ``.float()``) raises :class:`~tpukernels.errors.ArgumentError` naming the kernel.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence

from ..dsl.kernel import BackwardContext, TpuKernel
from ..dsl.modes import current_interpret_mode, interpret_mode
from ..dsl.spec import config_example, parse_config_json
from ..errors import ArgumentError, ChipError, ConfigError


def _is_tracer(x) -> bool:
    import jax

    return isinstance(x, jax.core.Tracer)


def jax_call(kernel: TpuKernel, *arrays, config: Mapping | str | None = None, interpret: str | None = None,
             **statics):
    """Run ``kernel`` on jax arrays; trace-safe (``jax.jit``, ``jax.vmap``, ``shard_map``, ``jax.grad``).

    Args:
        kernel: a :class:`~tpukernels.TpuKernel` (``@tpu_kernel`` or a library kernel).
        *arrays: the kernel's arguments in signature order: ``jax.Array`` s or tracers for tensor
            parameters (numpy arrays are converted with ``jnp.asarray``); static parameters may also come
            here, as Python values.
        config: tunable values (a dict, partial is fine, or its JSON text); default: tuned / heuristic.
        interpret: ``"fast"`` or ``"tpu"``: the interpret mode for this call when it runs on the cpu
            platform (default: :func:`tpukernels.current_interpret_mode`).
        **statics: static (and tensor) parameters by name.

    Returns:
        The kernel's output (a ``jax.Array`` or tracer), or a tuple of them for multi-output kernels.

    Raises:
        ArgumentError: ``kernel`` is not a TpuKernel; a torch tensor was passed (use ``kernel(tensor)``);
            a traced value (a ``jax.core.Tracer``) reached a static parameter, which needs a concrete Python
            value at trace time (mark it static: ``jax.jit(f, static_argnames=...)``); bad argument
            count / names; anything the kernel's own shape and static checks reject.
        ConfigError: ``config`` is not a dict of JSON values or breaks the tunables' rules.
    """
    if not isinstance(kernel, TpuKernel):
        raise ArgumentError(f"jax_call: kernel must be a tpukernels TpuKernel (from @tpu_kernel), got "
                            f"{type(kernel).__name__}")
    values = kernel.bind(arrays, statics)
    values = _check_jax_values(kernel, values)
    if kernel.has_statics:
        kernel.check_statics(values)
    if isinstance(config, str):
        config = parse_config_json(config, f"{kernel.qualname}: config", kernel)
    elif config is not None and not isinstance(config, Mapping):
        raise ConfigError(f"{kernel.qualname}: config must be a dict such as {config_example(kernel, False)}, got "
                          f"{type(config).__name__} {config!r}")
    if interpret:
        with interpret_mode(interpret):
            return run_jax(kernel, values, config)
    return run_jax(kernel, values, config)


def _check_jax_values(kernel: TpuKernel, values: list) -> list:
    """Tensor parameters: jax arrays / tracers (numpy converted); statics: no tracers (typed error)."""
    import jax.numpy as jnp
    import numpy as np

    torch = sys.modules.get("torch")
    out = list(values)
    for i, (p, v) in enumerate(zip(kernel.params, values)):
        if torch is not None and isinstance(v, torch.Tensor):
            raise ArgumentError(f"{kernel.qualname}: jax_call takes jax arrays; argument {p.name!r} is a torch "
                                f"tensor (call the kernel itself, {kernel.name}(...), with torch tensors)")
        if p.kind == "static":
            if _is_tracer(v):
                raise ArgumentError(
                    f"{kernel.qualname}: static argument {p.name!r} got a traced value ({type(v).__name__}); it "
                    f"selects the compiled kernel, so it needs a concrete Python value at trace time: pass it "
                    f"through jax.jit(..., static_argnames=...) or close over it")
            continue
        if isinstance(v, np.ndarray):
            out[i] = jnp.asarray(v)
    return out


def run_jax(kernel: TpuKernel, values: Sequence, config: Mapping | None):
    """Run bound ``values`` (jax arrays or tracers; see the module docstring for the target rule)."""
    from ..lowering import specs_from_values

    specs, statics = specs_from_values(kernel, values)
    tensors = [v for p, v in zip(kernel.params, values) if p.kind != "static"]
    arrays = [v for v, s in zip(tensors, specs) if s is not None]
    if not any(_is_tracer(a) for a in arrays):
        return _run_concrete(kernel, specs, statics, config, arrays)
    fn = functools.partial(_platform_call, kernel, specs, statics, config, current_interpret_mode())
    if getattr(kernel, "_backward", None) is not None:
        fn = _with_vjp(kernel, fn, values, specs)
    outs = fn(*arrays)
    return outs if len(outs) > 1 or kernel.returns_tuple else outs[0]


def _run_concrete(kernel, specs, statics, config, arrays):
    from ..lowering import lower

    on_tpu = any(getattr(d, "platform", "") == "tpu" for a in arrays for d in getattr(a, "devices", lambda: ())())
    low = lower(kernel, specs, statics, config, mode="mosaic" if on_tpu else current_interpret_mode(),
                chip=_jax_tpu_chip() if on_tpu else None)
    outs = low.fn(*arrays)
    return outs if low.multiple_outputs else outs[0]


@functools.lru_cache(maxsize=1)
def _jax_tpu_chip():
    """The chip of jax's TPU devices (for VMEM checks and the chip's tuning data), or None."""
    import jax

    from ..chips import get_chip

    try:
        return get_chip(jax.devices("tpu")[0].device_kind)
    except (RuntimeError, IndexError, ChipError):
        return None


@functools.lru_cache(maxsize=1)
def _has_tpu_backend() -> bool:
    import jax

    try:
        return bool(jax.devices("tpu"))
    except RuntimeError:
        return False


def _platform_call(kernel, specs, statics, config, mode, *arrays) -> tuple:
    """One traced call: the Mosaic lowering for the tpu platform, ``mode``'s interpreter for any other."""
    import jax

    from ..lowering import lower

    interp = lower(kernel, specs, statics, config, mode=mode)
    try:
        mosaic = lower(kernel, specs, statics, config, mode="mosaic", chip=_jax_tpu_chip())
    except Exception:
        if _has_tpu_backend():
            raise  # the program may run on TPU: its lowering's error is the caller's to see
        mosaic = None  # no TPU here (e.g. a cpu-only host): the interpreter is the only branch
    varying = _varying_axes(arrays)
    if varying:
        raise ArgumentError(
            f"{kernel.qualname}: called inside jax.shard_map(check_vma=True) (arguments vary over mesh axes "
            f"{list(varying)}); Pallas kernels do not declare how their outputs vary, so use "
            f"jax.shard_map(..., check_vma=False) around kernel calls (as JAX's own Pallas TPU ops do)")
    return _branches(interp, mosaic, arrays)


def _branches(interp, mosaic, arrays) -> tuple:
    import jax

    if mosaic is None:
        return tuple(interp.fn(*arrays))
    return tuple(jax.lax.platform_dependent(*arrays, tpu=lambda *a: tuple(mosaic.fn(*a)),
                                            default=lambda *a: tuple(interp.fn(*a))))


def _varying_axes(arrays) -> tuple:
    """Mesh axes (shard_map manual axes) any of ``arrays`` varies over; () outside shard_map."""
    import jax

    axes = set()
    for a in arrays:
        mat = getattr(jax.typeof(a), "mat", None)
        axes |= set(getattr(mat, "varying", ()) or ())
    return tuple(sorted(axes))


def _with_vjp(kernel: TpuKernel, fn, values: Sequence, specs: Sequence):
    """``fn`` (arrays -> outputs tuple) under ``jax.custom_vjp`` with the kernel's own backward."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    names = [s.name for s in specs if s is not None]
    bound = {p.name: v for p, v in zip(kernel.params, values)}

    def is_float(dt) -> bool:
        return jnp.issubdtype(dt, jnp.inexact)

    @jax.custom_vjp
    def f(*arrays):
        return fn(*arrays)

    def f_fwd(*arrays):
        outs = fn(*arrays)
        return outs, (arrays, outs)

    def f_bwd(res, grads):
        arrays, outs = res
        args = dict(bound)
        args.update(zip(names, arrays))
        needs = {n: is_float(a.dtype) for n, a in zip(names, arrays)}
        grads = tuple(None if g is None or g.dtype == jax.dtypes.float0 else g for g in grads)
        try:
            res_g = kernel._backward(BackwardContext(args, tuple(outs), needs), *grads)
        except (AttributeError, TypeError) as e:
            raise ArgumentError(f"{kernel.qualname}: its backward does not run on jax arrays ({type(e).__name__}: "
                                f"{e}); differentiate the torch op instead, or write the backward with operations "
                                f"both array types have") from e
        if not isinstance(res_g, dict):
            raise ArgumentError(f"{kernel.qualname}: backward must return {{arg_name: grad}}, got "
                                f"{type(res_g).__name__}")
        cts = []
        for n, a in zip(names, arrays):
            g = res_g.get(n)
            if not is_float(a.dtype):
                cts.append(np.zeros(a.shape, jax.dtypes.float0))
            elif g is None:
                cts.append(jnp.zeros(a.shape, a.dtype))
            else:
                if tuple(g.shape) != tuple(a.shape):
                    raise ArgumentError(f"{kernel.qualname}: backward returned a gradient of shape "
                                        f"{tuple(g.shape)} for {n!r} of shape {tuple(a.shape)}")
                cts.append(jnp.asarray(g).astype(a.dtype))
        return tuple(cts)

    f.defvjp(f_fwd, f_bwd)
    return f
