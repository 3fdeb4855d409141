"""How kernels run on the cpu target: Pallas interpret modes, chosen globally, per context or per call.

* ``"fast"``: ``pallas_call(interpret=True)`` — the generic interpreter; quick, but memory outside the
  array reads as whatever XLA's slicing gives (clamped), so it can hide tail bugs.
* ``"tpu"``: ``pallas_call(interpret=pltpu.InterpretParams())`` — the TPU-faithful interpreter:
  uninitialized VMEM and out-of-bounds block rows are NaN, DMA/semaphore semantics and races are modelled.
  Slower; use it in tests (tpukernels' own suite does). After each run, an output block that is still
  all NaN although every input is finite raises :class:`~tpukernels.errors.UnwrittenOutputError`.
* ``"races"``: ``"tpu"`` with the interpreter's data-race detector on
  (``pltpu.InterpretParams(detect_races=True)``); a race raises :class:`~tpukernels.errors.KernelRaceError`.
  Slower still; the test suite uses it for its ``"tpu"`` runs under ``TPUKERNELS_DETECT_RACES=1``.

Precedence: per call (``kernel(..., interpret="tpu")`` or ``with interpret_mode("tpu")``) >
``set_interpret_mode`` > ``TPUKERNELS_INTERPRET`` env var > ``"fast"``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

from ..errors import ArgumentError

MODES = ("fast", "tpu", "races")
_global_mode: str | None = None
_ctx_mode: contextvars.ContextVar[str | None] = contextvars.ContextVar("tpukernels_interpret", default=None)


def _check(mode: str) -> str:
    if mode not in MODES:
        raise ArgumentError(f"interpret mode: {mode!r} is not one of {MODES}")
    return mode


def set_interpret_mode(mode: str) -> None:
    """Set the process-wide interpret mode (``"fast"`` or ``"tpu"``)."""
    global _global_mode
    _global_mode = _check(mode)


@contextlib.contextmanager
def interpret_mode(mode: str):
    """Context manager: run cpu kernels inside the block in ``mode``."""
    token = _ctx_mode.set(_check(mode))
    try:
        yield
    finally:
        _ctx_mode.reset(token)


def current_interpret_mode() -> str:
    """The interpret mode in force here (see module docstring for precedence)."""
    m = _ctx_mode.get()
    if m is not None:
        return m
    if _global_mode is not None:
        return _global_mode
    env = os.environ.get("TPUKERNELS_INTERPRET")
    if env and env not in MODES:
        raise ArgumentError(f"TPUKERNELS_INTERPRET={env!r} is not one of {MODES}")
    return env or "fast"


def interpret_value(mode: str):
    """The ``interpret=`` argument ``pallas_call`` takes for a tpukernels mode (or ``"mosaic"``)."""
    if mode == "mosaic":
        return False
    if mode == "fast":
        return True
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(detect_races=mode == "races")
