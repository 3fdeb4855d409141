"""The ``tpukernels`` command line.

    tpukernels list [--json] [--import MODULE_OR_FILE]
    tpukernels compile KERNEL --shape 8192x4096:bf16 [--shape ...] [--static eps=1e-6]
                       [--chips v5e,v6e,tpu7x] [--config block_rows=256] [--estimate] [--json] [--mlir FILE]
    tpukernels demo [--json]

Kernels are found by ``namespace::name`` or by a unique ``name``; the shipped library is always loaded,
``--import`` loads user kernels from a module name or a ``.py`` file first.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import sys

from .errors import ArgumentError, TpuKernelError


def _import(spec: str) -> None:
    if spec.endswith(".py") or os.path.sep in spec:
        path = os.path.abspath(spec)
        sys.path.insert(0, os.path.dirname(path))
        name = os.path.splitext(os.path.basename(path))[0]
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
            return  # already imported (its kernels are registered)
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise ArgumentError(f"--import: cannot load {spec!r}")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)


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
    no limit otherwise: piped or redirected output (``| grep``, ``> file``) always gets one line per row."""
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
                lines.append(textwrap.fill(v, width=max(40, width), initial_indent=f"{h:<{name_w}}  ",
                                           subsequent_indent=" " * (name_w + 2), break_on_hyphens=False) or h)
            blocks.append("\n".join(lines))
        return "\n".join(blocks)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*r).rstrip() for r in cols[1:]]
    return "\n".join(lines)


def _type_name(p) -> str:
    """``Tensor``, ``Tensor?``, ``float?``, ``int`` (torch schema spelling)."""
    if p.kind == "opt_tensor":
        return "Tensor?"
    if p.kind == "tensor":
        return "Tensor"
    return f"{p.static_type.__name__}{'?' if p.optional else ''}"


def cmd_list(args) -> int:
    reg = load_kernels(args.imports)
    rows = []
    for q, k in sorted(reg.items()):
        params = ", ".join(f"{p.name}:{_type_name(p)}" for p in k.params)
        tun = ", ".join(f"{n}={t.values}" for n, t in k.space.tunables.items())
        rows.append({"kernel": q, "signature": params, "tunables": tun, "backward": k._backward is not None})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(table([[r["kernel"], r["signature"], r["tunables"], "yes" if r["backward"] else "no"] for r in rows],
                    ["kernel", "signature", "tunables", "backward"]))
    return 0


def cmd_compile(args) -> int:
    from .chips import parse_chips
    from .targets.compile_only import compile_for, compile_only_env

    compile_only_env()
    kernel = find_kernel(args.kernel, args.imports, public=True)
    statics = _parse_kv(args.static, kernel)
    config = _parse_kv(args.config) or None
    results = []
    for chip in parse_chips(args.chips):
        r = compile_for(kernel, chip, *args.shape, config=config, estimate_cycles=args.estimate, **statics)
        results.extend(r if isinstance(r, list) else [r])
        if args.mlir and r.mosaic_mlir:
            with open(f"{args.mlir}.{chip.name}.mlir", "w") as f:
                f.write(r.mosaic_mlir)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        rows = []
        for r in results:
            mib = (lambda b: "" if b is None else f"{b / 2**20:.2f}")
            rows.append([r.chip, "ok" if r.ok else f"FAIL ({r.error_kind})", mib(r.vmem_estimate_bytes),
                         mib(r.vmem_limit_bytes), mib(r.vmem_capacity_bytes), r.code_size_bytes,
                         (r.estimated_cycles if r.estimate_error is None else "n/a") if args.estimate else "-",
                         json.dumps(r.config), f"{r.compile_seconds:.2f}"])
        names = list(dict.fromkeys(r.kernel for r in results))
        print(f"{', '.join(names)} {' '.join(args.shape)}")
        print(table(rows, ["chip", "status", "VMEM est MiB", "scoped MiB", "capacity MiB", "code B",
                           "est. cycles (model)", "config", "compile s"]))
        for r in results:
            if not r.ok:
                print(f"  {r.chip}: {r.error}")
            elif r.estimate_error:
                print(f"  {r.chip}: no static estimate (the compile is fine): {r.estimate_error}")
    return 0 if all(r.ok for r in results) else 1


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(as_json=args.json, estimate=not args.no_estimate)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpukernels", description="Pallas TPU kernels as torch ops: list, compile-check, demo.")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE_OR_FILE",
                   help="import user kernels from a module or .py file (repeatable)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("list", help="list registered kernels")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("compile", help="compile-only check of a kernel for TPU chips (needs libtpu)")
    s.add_argument("kernel", help="kernel name: namespace::name or a unique name")
    s.add_argument("--shape", action="append", default=[], required=True,
                   help="one per tensor argument, in order: e.g. 8192x4096:bf16 (dtypes bf16 f32 f16 i32 i8)")
    s.add_argument("--static", action="append", help="static arguments: eps=1e-6,offset=1.0")
    s.add_argument("--config", action="append", help="tuning config: block_rows=256")
    s.add_argument("--chips", default="v5e,v6e,tpu7x", help="comma list of v4,v5e,v5p,v6e,tpu7x or 'all'")
    s.add_argument("--estimate", action="store_true", help="add libtpu's static estimated_cycles (slow; a model)")
    s.add_argument("--mlir", metavar="PREFIX", help="write the Mosaic MLIR per chip to PREFIX.<chip>.mlir")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_compile)

    s = sub.add_parser("demo", help="run the end-to-end demo (embeddings, generation, per-chip table)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--no-estimate", action="store_true", help="skip libtpu static estimates in the chip table")
    s.set_defaults(func=cmd_demo)

    from .autotune.cli import add_parser as _add_autotune

    _add_autotune(sub)
    from .bench.cli import add_parser as _add_bench

    _add_bench(sub)
    return p


def hoist_imports(argv) -> list:
    """``argv`` with every ``--import X`` / ``--import=X`` moved before the subcommand, so it works on either
    side of it (``tpukernels --import k.py list`` and ``tpukernels list --import k.py``)."""
    argv, front, rest, i = list(argv), [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            rest.extend(argv[i:])
            break
        if a == "--import" and i + 1 < len(argv):
            front += [a, argv[i + 1]]
            i += 2
            continue
        if a.startswith("--import="):
            front.append(a)
        else:
            rest.append(a)
        i += 1
    return front + rest


def main(argv=None) -> int:
    args = build_parser().parse_args(hoist_imports(sys.argv[1:] if argv is None else argv))
    try:
        return args.func(args)
    except TpuKernelError as e:
        print(f"tpukernels: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
