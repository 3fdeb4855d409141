"""Plugs the upper layers into the registration points of the lower ones (run once, by ``import tpukernels``).

The lower layers never import the upper ones (ARCHITECTURE.md); they own registration points instead:
:mod:`tpukernels.dsl.hooks` (dispatch, torch ops, the Helion front-end, DTensor rules),
:data:`tpukernels.dsl.kernel.CONFIG_RESOLVERS` (the tuning database: :mod:`tpukernels.autotune` registers
itself on import) and :func:`tpukernels._env.install_lazy_library_ops` (``torch.ops.tpukernels.*``). Each
loader here imports its module on first use, so ``import tpukernels`` loads neither jax nor Helion nor
``torch.distributed.tensor``.
"""

from __future__ import annotations

from .dsl import hooks


def _run_call():
    from .targets import run_call

    return run_call


def _register_op():
    from .torch_op import register_op

    return register_op


def _register_backward():
    from .torch_op import register_backward

    return register_backward


def _helion_kernel():
    from .frontends.helion import helion_kernel

    return helion_kernel


def _on_op_registered():
    from .distributed.sharding import on_op_registered

    return on_op_registered


def load_library() -> None:
    """Import :mod:`tpukernels.library` (registers every library op); the lazy ``torch.ops.tpukernels``."""
    import tpukernels.library  # noqa: F401


def install() -> None:
    hooks.provide("run_call", _run_call)
    hooks.provide("register_op", _register_op)
    hooks.provide("register_backward", _register_backward)
    hooks.provide("frontend:helion", _helion_kernel)
    hooks.provide("op_registered", _on_op_registered)
