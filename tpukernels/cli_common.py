"""What the command lines share (``tpukernels`` in :mod:`tpukernels.cli`, ``tpukernels autotune`` in
:mod:`tpukernels.autotune.cli`): finding kernels by name, ``key=value`` options, plain-text tables.

Above the library (it loads it to find kernels), below both command lines, which import it and not each other.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys

from ._imports import import_source as _import
from .errors import ArgumentError, TpuKernelError


def load_kernels(imports=()) -> dict:
    """Import the shipped library and ``imports``; return the kernel registry.

    Raises:
        ArgumentError: an ``--import`` failed (one line: the module and the error it raised).
    """
    from .dsl.kernel import REGISTRY

    importlib.import_module("tpukernels.library")
    for spec in imports or ():
        try:
            _import(spec)
        except TpuKernelError as e:
            raise ArgumentError(f"--import {spec}: {e}") from None
        except (Exception, SystemExit) as e:  # the user's module: report it in one line, not a traceback
            where = ""
            tb = e.__traceback__
            while tb is not None:
                if os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(os.path.abspath(os.path.dirname(spec) or ".")):
                    where = f" ({os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})"
                tb = tb.tb_next
            raise ArgumentError(f"--import {spec}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                                f"{where}") from None
    return REGISTRY


def find_kernel(name: str, imports=(), public: bool = False):
    """The kernel called ``name`` (``ns::name`` or a unique short name).

    With ``public``, a public library function (``matmul``, ``flash_attention``, ``tpukernels::rms_norm``)
    is returned when no kernel has that name (``compile_for`` compiles the kernels it calls).

    Raises:
        ArgumentError: unknown or ambiguous name (the message lists the known kernels).
    """
    reg = load_kernels(imports)
    if name in reg:
        return reg[name]
    matches = [k for q, k in reg.items() if q.split("::")[1] == name]
    fn = None
    if public:
        import tpukernels.library as lib

        short = name.split("::", 1)[1] if name.startswith("tpukernels::") else name
        fn = getattr(lib, short, None)
        if not callable(fn) or isinstance(fn, type) or short.startswith("_") or "::" in name.replace("tpukernels::", ""):
            fn = None
    if fn is not None and any(k is fn for k in matches):
        fn = None  # the library exports the kernel itself (tpukernels.library.matmul_nn): one match, not two
    if fn is not None and not matches:
        return fn
    if len(matches) == 1 and fn is None:
        return matches[0]
    if fn is not None:
        matches.append(fn)
    known = ", ".join(sorted(reg)) or "none"
    why = "is ambiguous (e.g. tpukernels::NAME for the library function)" if matches else "is not a registered kernel"
    raise ArgumentError(f"kernel {name!r} {why}; known kernels: {known} (use --import to load yours)")


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _literal(v: str):
    try:
        return ast.literal_eval(v)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False, "none": None, "null": None}.get(v.lower(), v)


def _typed(kernel, name: str, text: str):
    """``text`` as the kernel's static parameter ``name`` wants it (by its annotation)."""
    p = next((p for p in kernel.params if p.name == name and p.kind == "static"), None)
    if p is None:
        statics = [q.name for q in kernel.params if q.kind == "static"]
        raise ArgumentError(f"--static {name}: {kernel.qualname} has no static argument {name!r}; its statics are "
                            f"{', '.join(statics) or 'none'}")
    t = p.static_type
    if text.lower() in ("none", "null") and (p.optional or p.default is None):
        return None
    try:
        if t is bool:
            low = text.lower()
            if low not in _TRUE | _FALSE:
                raise ValueError(f"expected true/false, got {text!r}")
            return low in _TRUE
        if t is int:
            return int(text)
        if t is float:
            return float(text)
    except ValueError as e:
        raise ArgumentError(f"--static {name}={text}: {kernel.qualname} takes {t.__name__} ({e})") from None
    return text


def _parse_kv(items, kernel=None) -> dict:
    """``key=value[,key=value]`` items -> dict; with a kernel, statics are typed by its annotations."""
    from .dsl.kernel import TpuKernel

    out = {}
    for item in items or ():
        for part in item.split(","):
            if not part.strip():
                continue
            k, sep, v = part.partition("=")
            if not sep:
                raise ArgumentError(f"expected key=value, got {part!r}")
            k, v = k.strip(), v.strip()
            out[k] = _typed(kernel, k, v) if isinstance(kernel, TpuKernel) else _literal(v)
    return out


def table(rows: list[list], header: list[str], width: int | None = None) -> str:
    """Plain fixed-width text table; wider than ``width`` columns, each row is printed as a block of
    ``column: value`` lines instead (like psql's expanded mode), so nothing is cut.

    ``width`` defaults to the terminal's width when stdout is a terminal (or ``$COLUMNS`` when set), and to
    no limit otherwise: piped or redirected output (``| grep``, ``> file``) always gets one line per row.
    Expanded blocks keep within ``width`` down to a 16-character value column (``tpukernels list`` in an
    80-column terminal: no line over 80)."""
    import shutil
    import textwrap

    cols = [header] + [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    if width is None:
        if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
            width = shutil.get_terminal_size((120, 24)).columns
        else:
            width = 1 << 30
    if sum(widths) + 2 * (len(widths) - 1) > width and rows:
        name_w = max(len(h) for h in header)
        blocks = []
        for n, r in enumerate(cols[1:], 1):
            lines = [f"-[ {n} ]" + "-" * max(0, min(width, 40) - 6 - len(str(n)))]
            for h, v in zip(header, r):
                lines.append(textwrap.fill(v, width=max(name_w + 2 + 16, width), initial_indent=f"{h:<{name_w}}  ",
                                           subsequent_indent=" " * (name_w + 2), break_on_hyphens=False) or h)
            blocks.append("\n".join(lines))
        return "\n".join(blocks)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*r).rstrip() for r in cols[1:]]
    return "\n".join(lines)


class RichProgress:
    """A rich progress bar as a context manager (``self.bar`` is None when disabled): description, bar,
    done / total, elapsed, and with ``eta=True`` the time remaining. ``stream`` None: stderr, looked up at each
    write (pytest's capture swaps it)."""

    def __init__(self, enabled: bool, stream=None, eta: bool = False):
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
            if eta:
                columns += [TextColumn("ETA"), TimeRemainingColumn()]
            console = Console(stderr=True) if stream is None else Console(file=stream)
            self.bar = Progress(*columns, console=console, transient=False)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
