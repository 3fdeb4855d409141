"""The ``tpukernels`` command line.

    tpukernels list [--json] [--import MODULE_OR_FILE]
    tpukernels compile KERNEL --shape 8192x4096:bf16 [--shape ...] [--static NAME=VALUE,...]
                       [--chips v5e,v6e,tpu7x] [--config block_rows=256] [--estimate] [--json] [--mlir FILE]
    tpukernels demo [--json]

Kernels are found by ``namespace::name`` or by a unique ``name``; the shipped library is always loaded,
``--import`` loads user kernels from a module name or a ``.py`` file first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .cli_common import _import, _parse_kv, find_kernel, load_kernels, table  # noqa: F401  (also this module's API)
from .errors import TpuKernelError


def _type_name(p) -> str:
    """``Tensor``, ``Tensor?``, ``float?``, ``int`` (torch schema spelling)."""
    if p.kind == "opt_tensor":
        return "Tensor?"
    if p.kind == "tensor":
        return "Tensor"
    return f"{p.static_type.__name__}{'?' if p.optional else ''}"


def _param_text(p) -> str:
    """``name:type``, with ``=default`` for a static parameter that has one (``eps:float=1e-06``)."""
    import inspect

    text = f"{p.name}:{_type_name(p)}"
    if p.kind == "static" and p.default is not inspect.Parameter.empty:
        text += f"={p.default!r}"
    return text


def _statics(k) -> dict:
    """``{name: default}`` of a kernel's static parameters; ``None`` values in ``required`` (no default)."""
    import inspect

    return {p.name: (None if p.default is inspect.Parameter.empty else p.default)
            for p in k.params if p.kind == "static"}


def _print_wrapped(text: str) -> None:
    """``text`` wrapped to the terminal's width, as :func:`table` sizes itself (no limit when piped)."""
    import shutil
    import textwrap

    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        text = textwrap.fill(text, width=shutil.get_terminal_size((120, 24)).columns, break_on_hyphens=False)
    print(text)


def cmd_list(args) -> int:
    import inspect

    reg = load_kernels(args.imports)
    rows = []
    for q, k in sorted(reg.items()):
        params = ", ".join(_param_text(p) for p in k.params)
        tun = ", ".join(f"{n}={t.values}" for n, t in k.space.tunables.items())
        required = [p.name for p in k.params if p.kind == "static" and p.default is inspect.Parameter.empty]
        rows.append({"kernel": q, "signature": params, "tunables": tun, "backward": k._backward is not None,
                     "statics": _statics(k), "required_statics": required})
    if args.json:
        print(json.dumps(rows, indent=1, default=repr))
    else:
        print(table([[r["kernel"], r["signature"], r["tunables"], "yes" if r["backward"] else "no"] for r in rows],
                    ["kernel", "signature", "tunables", "backward"]))
        _print_wrapped("Non-tensor parameters are static: `tpukernels compile` needs --static name=value for each "
                       "one without a default (those with one are shown as name:type=default).")
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
    s.add_argument("--static", action="append",
                   help="static (non-tensor) arguments, every one without a default (`tpukernels list` shows them): "
                        "e.g. rms_norm_fwd: eps=1e-6,offset=0.0,casting=llama,round_f16=false")
    s.add_argument("--config", action="append", help="tuning config: block_rows=256")
    s.add_argument("--chips", default="v5e,v6e,tpu7x",
                   help="comma list of v4,v5e,v5p,v6e,tpu7x or 'all' (default: v5e,v6e,tpu7x)")
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
    except BrokenPipeError:  # `tpukernels list | head`: the reader left; not an error of ours
        # Python's documented recipe (library/signal.html, "Note on SIGPIPE"): point stdout at devnull so the
        # interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
