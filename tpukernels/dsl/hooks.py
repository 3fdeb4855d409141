"""Registration points the DSL owns: how the layers above plug in without the DSL importing them.

The package's imports run one way (see ARCHITECTURE.md): ``dsl -> lowering -> targets -> torch_op ->
frontends / distributed -> autotune -> library``. A :class:`~tpukernels.dsl.kernel.TpuKernel` still needs
things from above it: a torch op when it is defined, a dispatcher when it is called, the Helion front-end
for ``backend="helion"``, a DTensor rule for each new op. Those come through the points below. Each point
holds a *loader*: a zero-argument function the upper layer registers (``tpukernels/_plugins.py`` does it
when ``import tpukernels`` runs) that imports its module and returns the implementation, so nothing heavy
(jax, Helion, ``torch.distributed.tensor``) is imported before it is needed. The tuning database plugs in
the same way, through :data:`tpukernels.dsl.kernel.CONFIG_RESOLVERS`.

Points:

* ``"run_call"``: ``fn(kernel, args, kwargs, *, config, interpret)``, what ``kernel(...)`` does
  (:func:`tpukernels.targets.run_call`).
* ``"register_op"`` / ``"register_backward"``: ``fn(kernel)``, the torch custom op of a kernel and its
  autograd (:mod:`tpukernels.torch_op`).
* ``"frontend:helion"``: ``fn(**options) -> decorator``, ``@tpu_kernel(backend="helion")``
  (:func:`tpukernels.frontends.helion.helion_kernel`).
* ``"op_registered"``: ``fn(kernel, op)``, called for each new torch op (optional: the DTensor sharding rule,
  :func:`tpukernels.distributed.sharding.on_op_registered`).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable

from ..errors import TpuKernelError

#: While set (a list), the torch op's fake kernel records each kernel call ``(kernel, values, config_json)`` it
#: serves: how :func:`tpukernels.compile_for` finds the kernels behind a public function or composite op.
#: (A channel between :mod:`tpukernels.torch_op`, which writes it, and :mod:`tpukernels.targets.compile_only`,
#: which reads it; it lives here, below both.)
KERNEL_CALLS: "contextvars.ContextVar[list | None]" = contextvars.ContextVar("tpukernels_kernel_calls", default=None)

POINTS = ("run_call", "register_op", "register_backward", "frontend:helion", "op_registered")

_LOADERS: dict[str, Callable[[], Callable]] = {}
_LOADED: dict[str, Callable] = {}
_LOCK = threading.Lock()


def provide(point: str, loader: Callable[[], Callable]) -> None:
    """Register ``loader`` (``() -> implementation``, called once, on first use) for ``point``.

    Raises:
        TpuKernelError: ``point`` is not one of :data:`POINTS`.
    """
    if point not in POINTS:
        raise TpuKernelError(f"dsl.hooks.provide: unknown point {point!r}; the points are {', '.join(POINTS)}")
    with _LOCK:
        _LOADERS[point] = loader
        _LOADED.pop(point, None)


def implementation(point: str, required: bool = True) -> Callable | None:
    """The implementation registered for ``point`` (its loader runs on the first call).

    Raises:
        TpuKernelError: ``required`` and nothing is registered for ``point`` (``import tpukernels`` registers
            every point, so this means a partial import of the package).
    """
    fn = _LOADED.get(point)
    if fn is not None:
        return fn
    loader = _LOADERS.get(point)
    if loader is None:
        if required:
            raise TpuKernelError(f"tpukernels: nothing provides {point!r} (tpukernels/_plugins.py registers it when "
                                 f"`import tpukernels` runs)")
        return None
    fn = loader()
    _LOADED[point] = fn
    return fn
