"""Warnings once per sweep, not once per candidate.

A sweep evaluates tens of configs, and a config-dependent warning (a :class:`~tpukernels.PerformanceWarning`
for bf16 block rows that are not a multiple of 16, say) used to print for each of them, in worker processes
too. Each candidate's warnings are now recorded with its trial (``trial.details["warnings"]``, in ``--json``
and ``--report``) and the sweep emits one summary per warning category when it ends
(:func:`emit_summary`); :func:`once_per_run` does the same for a block of work such as a bench family.

The process's warning filters still apply: a category the user ignores is neither recorded nor summarised,
one turned into an error still raises.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import warnings


def category_name(category: type[Warning]) -> str:
    """``"RuntimeWarning"`` for builtins, ``"tpukernels.errors.PerformanceWarning"`` otherwise."""
    if getattr(builtins, category.__name__, None) is category:
        return category.__name__
    return f"{category.__module__}.{category.__qualname__}"


def category_of(name: str) -> type[Warning]:
    """The warning class :func:`category_name` named (``UserWarning`` if it cannot be imported here)."""
    mod, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), attr) if mod else getattr(builtins, attr)
    except (ImportError, AttributeError):
        return UserWarning
    return cls if isinstance(cls, type) and issubclass(cls, Warning) else UserWarning


def unique(caught) -> list[list[str]]:
    """``[[category name, message], ...]`` of recorded ``warnings.WarningMessage`` s, first occurrence order."""
    found: list[list[str]] = []
    for w in caught:
        item = [category_name(w.category), str(w.message)]
        if item not in found:
            found.append(item)
    return found


@contextlib.contextmanager
def recording():
    """Record the warnings raised in the block (under the current filters) instead of showing them; yields
    the list :func:`unique` fills when the block ends (also when it raises)."""
    found: list[list[str]] = []
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield found
        finally:
            found.extend(unique(caught))


def summaries(what: str, items: list[tuple[str, list]], total: int | None = None,
              noun: str = "candidates") -> list[tuple[type[Warning], str]]:
    """One ``(category, text)`` per warning category over ``items`` = ``[(label, [[category, message], ...])]``
    (a label per candidate, e.g. ``"br=8"``; ``""`` for none), naming how many of ``total`` ``noun`` raised
    it, up to four of their labels, and the first message."""
    by_cat: dict[str, tuple[list[str], list[str]]] = {}
    for label, found in items:
        for cat, msg in found or ():
            labels, msgs = by_cat.setdefault(cat, ([], []))
            if label not in labels:
                labels.append(label)
            if msg not in msgs:
                msgs.append(msg)
    summary = []
    for cat, (labels, msgs) in by_cat.items():
        cls = category_of(cat)
        labels = [lb for lb in labels if lb]
        more = f"; {len(msgs)} distinct messages" if len(msgs) > 1 else ""
        if labels:
            of = f" of {total}" if total is not None else ""
            shown = ", ".join(labels[:4]) + (f", ... ({len(labels) - 4} more)" if len(labels) > 4 else "")
            head = f"{len(labels)}{of} {noun} raised {cls.__name__} ({shown}{more}; each one's in --json)"
        else:
            head = f"{cls.__name__}, once for the run{more}"
        summary.append((cls, f"{what}: {head}; the first: {msgs[0]}"))
    return summary


def emit_summary(what: str, items: list[tuple[str, list]], total: int | None = None, stacklevel: int = 2) -> None:
    """Warn once per category with :func:`summaries`' text (through the current filters); ``stacklevel`` as
    :func:`warnings.warn`'s, counted from the caller of this function."""
    for cls, text in summaries(what, items, total):
        warnings.warn(text, cls, stacklevel=stacklevel + 1)


@contextlib.contextmanager
def once_per_run(what: str):
    """The warnings raised in the block (any thread of this process), shown as one summary per category when
    it ends instead of one line each: for a bench family's cases, whose threads share the filters."""
    found: list[list[str]] = []
    try:
        with recording() as found:
            yield
    finally:
        emit_summary(what, [("", found)], stacklevel=3)
