"""``tpukernels autotune``: sweep a kernel's tunable space (or every library kernel) and store the winners.

    tpukernels [--import FILE] autotune KERNEL --chip v6e --shape 8192x4096:bf16 [--shape ...] [--static k=v]
               [--strategy exhaustive|random|coordinate|surrogate] [--budget N] [--seconds S] [--workers 2]
               [--evaluator tpu-model|measure] [--json] [--report DIR] [--write-db [user|shipped|PATH]]
    tpukernels autotune --library --chip v5e [--budget N] ...

``tpu-model`` (default) needs no TPU: it compiles for ``--chip`` with libtpu and reports a *model* time.
``measure`` times the kernel on the device its tensors live on (cpu interpret mode here: that tests the
machinery, not TPU performance, and is never written to the tuning DB).
"""

from __future__ import annotations

import json
import sys

from ..cli_common import RichProgress
from ..errors import ArgumentError


def add_parser(subparsers) -> None:
    """Register the ``autotune`` subcommand on the ``tpukernels`` parser's subparsers."""
    s = subparsers.add_parser(
        "autotune", help="search a kernel's tunable space (tpu-model: compile-only for a chip; measure: live device)",
        description="Search a kernel's tunable space for one call signature (or every library kernel at its "
                    "standard shapes) and optionally store the best config in the tuning DB.",
    )
    s.add_argument("kernel", nargs="?", help="kernel name: namespace::name or a unique name (omit with --library)")
    s.add_argument("--library", action="store_true", help="tune every library kernel (or the KERNEL named) at its STANDARD_CASES shapes")
    s.add_argument("--chip", help="TPU generation for tpu-model: v4, v5e, v5p, v6e, tpu7x (comma list: one sweep each)")
    s.add_argument("--shape", action="append", default=[],
                   help="one per tensor argument, in order: e.g. 8192x4096:bf16")
    s.add_argument("--static", action="append", help="static arguments: eps=1e-6,offset=1.0")
    s.add_argument("--values", action="append", metavar="NAME=V1,V2",
                   help="search these values of one tunable instead of the declared ones (repeatable); the "
                        "baseline (the config a call gets today: tuning DB, else heuristic, else the declared "
                        "defaults) is always evaluated too, and can win")
    s.add_argument("--strategy", default="coordinate", choices=["exhaustive", "random", "coordinate", "surrogate"],
                   help="surrogate: optuna's TPE model learns from each result and resumes from the results "
                        "earlier --write-db sweeps stored (needs tpukernels[tune])")
    s.add_argument("--budget", type=_positive(int), default=None,
                   help="max candidates evaluated per kernel (pruned ones are free); an int >= 1")
    s.add_argument("--seconds", type=_positive(float), default=None, help="wall-clock budget per kernel, seconds (> 0)")
    s.add_argument("--workers", type=_positive(int), default=1,
                   help="parallel compile processes (tpu-model only); with --executor ray: CPUs of the local cluster")
    s.add_argument("--executor", choices=["inline", "process", "ray"], default=None,
                   help="where candidates run: this process, --workers processes (the default when --workers > 1), "
                        "or Ray tasks (needs tpukernels[ray]; sweeps of several kernels/chips share the cluster)")
    s.add_argument("--address", default=None,
                   help="--executor ray: a running cluster ('auto', 'ray://host:10001'); default: start a local one")
    s.add_argument("--evaluator", default="tpu-model", choices=["tpu-model", "measure"])
    s.add_argument("--device", default="cpu", choices=["cpu", "tpu"], help="measure: where the tensors live")
    s.add_argument("--repeats", type=_positive(int), default=10, help="measure: timed runs per candidate (median)")
    s.add_argument("--no-cycles", action="store_true",
                   help="tpu-model: skip libtpu's static estimate (roofline + overhead only)")
    s.add_argument("--estimate-steps", type=int, default=None,
                   help="tpu-model: estimate bigger grids on a reduced grid of this many steps, scaled (default 16)")
    s.add_argument("--step-overhead-us", type=float, default=None,
                   help="tpu-model: per-grid-step overhead (default 0.35)")
    s.add_argument("--timeout", type=_positive(float), default=600.0,
                   help="per-candidate timeout, seconds (worker processes only)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="print the sweeps as JSON (a list, one per kernel)")
    s.add_argument("--report", metavar="DIR", help="write DIR/report.md, DIR/sweeps.json and a PNG plot per sweep")
    s.add_argument("--write-db", nargs="?", const="user", metavar="user|shipped|PATH",
                   help="store the best configs: the user DB (default), 'shipped' (package data) or a file")
    s.add_argument("--force-db", action="store_true", help="let a model result replace a measured DB entry")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_autotune)


def _positive(kind):
    """An argparse ``type=``: ``kind(text)`` that must be > 0 (a zero or negative budget, time limit or
    count would evaluate nothing and end in a bare rc=1); a bad value is argparse's usage error, rc 2."""
    import argparse

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an int' if kind is int else 'a number'}, got {text!r}")
        if not v > 0:
            rule = "an int >= 1" if kind is int else "a number > 0"
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _parse_values(items) -> dict | None:
    """``["NAME=V1,V2", ...]`` -> ``{NAME: [V1, V2]}``; each value a Python literal (``256``, ``(16, 128)``,
    ``'tanh'``), a bare word staying a string. :func:`_check_values` then applies the tunable's own rules."""
    import ast

    out = {}
    for item in items or ():
        name, sep, vals = item.partition("=")
        if not sep or not vals.strip() or not name.strip():
            raise ArgumentError(f"--values: expected NAME=V1,V2,..., got {item!r}")
        try:  # the whole list at once, so tuple values ("(16,128),(8,256)") keep their commas
            parsed = list(ast.literal_eval("[" + vals + "]"))
        except (ValueError, SyntaxError):
            parsed = []
            for v in vals.split(","):
                try:
                    parsed.append(ast.literal_eval(v.strip()))
                except (ValueError, SyntaxError):
                    parsed.append(v.strip())
        if not parsed:
            raise ArgumentError(f"--values: expected NAME=V1,V2,..., got {item!r}")
        out[name.strip()] = parsed
    return out or None


def _check_values(kernel, values: dict | None) -> dict | None:
    """Check ``--values`` against ``kernel``'s tunables with the DSL's own rule (``TunableSpace.check_value``:
    the declared values' kind, positive where they all are), before any sweep starts.

    Raises:
        ArgumentError: an unknown tunable, or a value its tunable cannot take (naming flag, value and rule).
    """
    from ..errors import ConfigError

    if not values:
        return values
    space = kernel.space
    out = {}
    for name, vals in values.items():
        if name not in space.tunables:
            raise ArgumentError(f"--values {name}=...: {kernel.qualname} has no tunable {name!r} "
                                f"(it has {list(space.names)})")
        checked = []
        for v in vals:
            try:
                checked.append(space.check_value(name, v))
            except ConfigError as e:
                why = str(e).removeprefix("config: ")
                raise ArgumentError(f"--values {name}=...: {kernel.qualname}: {why}") from None
        out[name] = checked
    return out


def _check_case(kernel, case_args, case_kwargs) -> None:
    """Bind one case's shapes and statics to ``kernel`` as the sweep will (``Problem.from_args``) and check
    them against the kernel's ``shapes=`` declaration, once, up front: a mismatch is an ArgumentError here,
    not every candidate pruned as a ``launch`` error."""
    from .space import Problem

    problem = Problem.from_args(kernel, *case_args, **dict(case_kwargs))
    kernel.check_shapes(problem.specs)


def _cases(args) -> list:
    from ..cli_common import _parse_kv, find_kernel, load_kernels

    if args.library:
        if args.shape:
            raise ArgumentError("--library tunes the library's standard cases: give no --shape")
        load_kernels(args.imports)
        from .. import library

        cases = list(library.standard_cases())
        if not cases:
            raise ArgumentError("--library: no library module defines STANDARD_CASES yet")
        if args.kernel:  # one kernel's standard cases (re-tune its shipped table after changing its source)
            kernel = find_kernel(args.kernel, args.imports)
            cases = [c for c in cases if c[0] is kernel]
            if not cases:
                raise ArgumentError(f"--library {args.kernel}: {kernel.qualname} has no STANDARD_CASES")
        return cases
    if not args.kernel:
        raise ArgumentError("autotune: name a KERNEL (or use --library)")
    kernel = find_kernel(args.kernel, args.imports)
    if not args.shape:
        raise ArgumentError("autotune: give one --shape per tensor argument, e.g. --shape 8192x4096:bf16")
    return [(kernel, tuple(args.shape), _parse_kv(args.static))]


class _Progress(RichProgress):
    """A rich progress bar on stderr (one task per sweep)."""

    def callback(self, title: str, total: int | None, unit: str):
        if self.bar is None:
            return None
        task = self.bar.add_task(title, total=total)

        def cb(done, _total, trial, best):
            best_s = "" if best is None else f" best {best.time_us:,.1f} {unit}"
            failed = "" if trial.ok else f" (last: {trial.status})"
            self.bar.update(task, completed=done, description=f"{title}{best_s}{failed}")

        return cb


def cmd_autotune(args) -> int:
    from ..cli_common import table
    from ..targets.compile_only import compile_only_env, require_libtpu
    from .report import failure_lines, label_note, pruned_lines, summary_rows, unranked_lines, write_report
    from .tuner import make_evaluator, tune

    compile_only_env()
    if args.evaluator == "tpu-model":
        if not args.chip:
            raise ArgumentError("autotune: --chip is required for the tpu-model evaluator (v4, v5e, v5p, v6e, tpu7x)")
        require_libtpu()
        options = {"cycles": not args.no_cycles, "step_overhead_us": args.step_overhead_us,
                   "estimate_steps": args.estimate_steps}
    else:
        options = {"device": args.device, "repeats": args.repeats, "seed": args.seed}
    if args.address and args.executor != "ray":
        raise ArgumentError("--address names a Ray cluster: use it with --executor ray")
    if args.executor == "ray" and args.evaluator == "measure":
        raise ArgumentError("--executor ray runs candidates concurrently; the measure evaluator times them one "
                            "at a time (concurrent timings interfere): use --executor inline")
    chips = [c.strip() for c in args.chip.split(",") if c.strip()] if args.chip else [None]
    cases = _cases(args)
    values = _parse_values(args.values)
    checked_values = {}
    for kernel, case_args, case_kwargs in cases:  # every argument error before the first sweep starts
        _check_case(kernel, case_args, case_kwargs)
        checked_values[kernel.qualname] = _check_values(kernel, values)
    sweeps = [(case, chip) for case in cases for chip in chips]  # kernels x shapes x chips
    ray_ex = None
    if args.executor == "ray":
        from .evaluators import KernelRef
        from .executors import RayExecutor

        mods = [*args.imports, *(s for s in (KernelRef.of(k).source for (k, _, _), _ in sweeps) if s)]
        ray_ex = RayExecutor(args.workers if args.workers > 1 else None, imports=mods, address=args.address)

    def one(sweep, prog, shared: bool):
        (kernel, case_args, case_kwargs), chip = sweep
        executor = ray_ex.share() if shared else None  # this sweep's share of the cluster, while it runs
        ev = make_evaluator(args.evaluator, chip, **options)
        unit = "us (model)" if ev.label == "model" else "us"
        cb = prog.callback(f"{kernel.name} on {ev.chip_name() or args.device}", args.budget, unit)
        try:
            return tune(
                kernel, *case_args, evaluator=ev, strategy=args.strategy, budget=args.budget, seconds=args.seconds,
                workers=args.workers, executor=executor or args.executor, seed=args.seed, write_db=args.write_db,
                force_db=args.force_db, candidate_timeout_s=args.timeout, imports=args.imports, progress=cb,
                values=checked_values[kernel.qualname], **dict(case_kwargs),
            )
        finally:
            if executor is not None:
                executor.shutdown()

    with _Progress(not args.no_progress) as prog:
        if ray_ex is None:
            results = [one(s, prog, False) for s in sweeps]
        else:  # up to one sweep per CPU at once: candidates of all kernels x shapes x chips share the cluster
            import concurrent.futures as cf

            try:
                ray_ex.start()
                with cf.ThreadPoolExecutor(max_workers=min(len(sweeps), ray_ex.capacity)) as pool:
                    results = list(pool.map(lambda s: one(s, prog, True), sweeps))
            finally:
                ray_ex.shutdown()
    if args.report:
        paths = write_report(results, args.report)
        print(f"report: {', '.join(paths)}", file=sys.stderr)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1, default=str))
    else:
        rows, header = summary_rows(results)
        print(table(rows, header))
        for r in results:
            print(f"{r.kernel}: {label_note(r)}.")
            lines = unranked_lines(r)
            if lines:
                print(f"{r.kernel}: unranked candidates:")
                print("\n".join(lines))
            lines = failure_lines(r)
            if lines:
                print(f"{r.kernel}: failed candidates:")
                print("\n".join(lines))
            lines = pruned_lines(r)
            if lines:
                print(f"{r.kernel}: pruned before compiling ({len(r.pruned)}):")
                print("\n".join(lines))
            if r.db_note:
                print(f"{r.kernel}: {r.db_note}")
    return 0 if all(r.best is not None for r in results) else 1
