"""``tpukernels bench``: run benchmark families, save their results, regenerate BENCHMARKS.md."""

from __future__ import annotations

import os
import sys

from ..cli_common import RichProgress


def add_parser(subparsers) -> None:
    """Register the ``bench`` subcommand on the ``tpukernels`` parser's subparsers."""
    from . import DEFAULT_CHIPS, FAMILIES

    s = subparsers.add_parser(
        "bench", help="benchmark library kernels vs XLA and public Pallas kernels (model) + host costs (measured)",
        description="Estimate every library kernel at its standard shapes on compile-only TPU chips next to XLA "
                    "and the best public Pallas TPU kernel (libtpu static estimate + roofline: a model), measure "
                    "host-side costs on this CPU, and regenerate BENCHMARKS.md with tables and PNG plots. Each "
                    "family's figures are saved to RESULTS_DIR/<family>.json, so long runs can be split by family; "
                    "figures made with different jax/jaxlib/libtpu/torch/tpukernels versions are never mixed.")
    s.add_argument("--chips", default=",".join(DEFAULT_CHIPS), help="comma list of v4,v5e,v5p,v6e,tpu7x")
    s.add_argument("--family", default="all",
                   help=f"the families to run, comma list of {','.join(FAMILIES)} or 'all'; the report covers every "
                        "family with results in RESULTS_DIR, except with --report-only, where it covers these")
    s.add_argument("--results-dir", default=None,
                   help="where <family>.json results and plots are kept (default: $TPUKERNELS_CACHE_DIR/bench/"
                        "results, never the current directory unless asked; `make bench`: benchmarks/results)")
    s.add_argument("--out", default=None,
                   help="the markdown report to (re)write (default: BENCHMARKS.md in the results dir)")
    s.add_argument("--readme", default=None,
                   help="update the summary between the bench-summary markers of this file (default: none)")
    s.add_argument("--json", metavar="FILE", help="also write all families' results as one JSON file")
    s.add_argument("--report-only", action="store_true", help="regenerate the report from saved results; run nothing")
    s.add_argument("--jobs", type=int, default=1,
                   help="estimates in parallel (each holds a libtpu; an 8192^3 matmul needs ~14 GB)")
    s.add_argument("--no-cache", action="store_true", help="ignore and do not write the estimate cache")
    s.add_argument("--timeout", type=float, default=1800, help="per-estimate limit, seconds")
    s.add_argument("--no-progress", action="store_true",
                   help="no progress bar / ETA (there is none either when stderr is not a terminal)")
    s.add_argument("--measure", action="store_true",
                   help="on a TPU host (torch_tpu): time the library's kernels on its chip (--chips is not used) "
                        "instead of modelling them (warm-up, then the median of --repeats runs, the device "
                        "synchronized before every clock read), next to the saved model of this chip (model / "
                        "measured) and tokamax's measured times; saved to RESULTS_DIR/measured.json and a section "
                        "of the report")
    s.add_argument("--warmup", type=int, default=None,
                   help="--measure: untimed runs before timing each call (default 3; >= 0)")
    s.add_argument("--repeats", type=int, default=None,
                   help="--measure: timed runs per call, the figure is their median (default 20; >= 1)")
    s.add_argument("--write-db", action="store_true",
                   help="--measure: store each timed call's config in the user tuning DB, marked measured")
    s.set_defaults(func=cmd_bench)


class _Progress(RichProgress):
    """A rich progress bar with an ETA on stderr, one task per family (cases done / total), while log lines
    print above it; disabled (every method a no-op) with ``--no-progress`` or when stderr is not a terminal
    (logs, CI), where the per-case log lines are the progress."""

    def __init__(self, enabled: bool, stream=None):
        stream = sys.stderr if stream is None else stream
        super().__init__(enabled and getattr(stream, "isatty", lambda: False)(), stream, eta=True)

    def log(self, message: str) -> None:
        if self.bar is not None:
            self.bar.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=sys.stderr, flush=True)

    def family(self, name: str):
        """The ``progress(done, total)`` callback of one family (None when disabled)."""
        if self.bar is None:
            return None
        task = self.bar.add_task(f"bench {name}", total=None)

        def progress(done: int, total: int) -> None:
            self.bar.update(task, completed=done, total=total)

        return progress


def _families(text: str) -> list[str]:
    from ..errors import ArgumentError
    from . import FAMILIES

    names = list(FAMILIES) if text == "all" else [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in names if f not in FAMILIES]
    if bad:
        raise ArgumentError(f"--family: {', '.join(bad)} not among {', '.join(FAMILIES)} (or 'all')")
    return names


def _measure_options(args) -> tuple[int, int] | None:
    """``(warmup, repeats)`` with ``--measure``, None without; checked before anything runs.

    Raises:
        ArgumentError: a measuring option without ``--measure``, ``--measure`` with ``--report-only``, or a count
            out of range (``--warmup >= 0``, ``--repeats >= 1``).
    """
    from ..errors import ArgumentError
    from .measure import DEFAULT_REPEATS, DEFAULT_WARMUP, check_counts

    given = [name for name, v in (("--warmup", getattr(args, "warmup", None)),
                                  ("--repeats", getattr(args, "repeats", None)),
                                  ("--write-db", getattr(args, "write_db", False) or None)) if v is not None]
    if not getattr(args, "measure", False):
        if given:
            raise ArgumentError(f"{', '.join(given)}: only with --measure (timing on a TPU)")
        return None
    if args.report_only:
        raise ArgumentError("--measure runs kernels on the TPU; --report-only runs nothing: choose one")
    warmup = DEFAULT_WARMUP if args.warmup is None else args.warmup
    repeats = DEFAULT_REPEATS if args.repeats is None else args.repeats
    check_counts(warmup, repeats)
    return warmup, repeats


def cmd_bench(args) -> int:
    from ..autotune.db import user_cache_dir
    from ..chips import get_chip

    counts = _measure_options(args)
    if args.results_dir is None:
        args.results_dir = os.path.join(user_cache_dir(), "bench", "results")
    if args.out is None:
        args.out = os.path.join(args.results_dir, "BENCHMARKS.md")
    os.makedirs(args.results_dir, exist_ok=True)
    from . import FAMILIES, attach_reasons, run_family
    from .core import check_versions, load_results, versions
    from .report import combined_json, render, summary, update_readme

    fams = _families(args.family)
    chips = [get_chip(c).name for c in args.chips.split(",") if c.strip()]
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if counts is not None:
        from . import measure

        if args.family == "all":
            fams = [f for f in fams if f != "host"]
        res = measure.run(fams, args.results_dir, warmup=counts[0], repeats=counts[1], write_db=args.write_db,
                          log=log)
        for path in res["db_files"]:
            log(f"stored measured configs in {path}")
    elif not args.report_only:
        # refuse before hours of estimates if the kept families would not mix with the new ones
        kept = load_results(args.results_dir, [f for f in FAMILIES if f not in fams])
        check_versions({**{f"{f}.json": r["versions"] for f, r in kept.items()}, "this run": versions()})
        from .._imports import import_keeping_env

        import_keeping_env("tpu_inference")  # peers' kernels: its import would change libtpu's flags mid-run
        with _Progress(not getattr(args, "no_progress", False)) as bar:
            for fam in fams:
                run_family(fam, chips, args.results_dir, jobs=args.jobs, timeout_s=args.timeout,
                           cache_path="" if args.no_cache else None, log=bar.log, progress=bar.family(fam))
    from .measure import load_measured

    results = load_results(args.results_dir, fams if args.report_only else FAMILIES)
    measured = load_measured(args.results_dir)
    if not results and measured is None:
        from ..errors import ArgumentError

        raise ArgumentError(f"--results-dir {args.results_dir}: no results of {', '.join(fams)} to report (run "
                            "without --report-only)")
    for fam, res in results.items():  # reasons come from the current code (a --report-only after an edit)
        if fam != "host":
            attach_reasons(fam, res["rows"])
    used = list(dict.fromkeys(c for r in results.values() for c in r.get("chips", []))) or chips
    command = "tpukernels bench --chips " + ",".join(used)
    render(results, args.out, command, figures_dir=args.results_dir, measured=measured)
    text = summary(results, command, measured)
    if args.readme and update_readme(args.readme, text):
        log(f"updated the benchmark summary in {args.readme}")
    if args.json:
        combined_json({**results, **({"measured": measured} if measured else {})}, args.json)
    log(f"wrote {args.out} ({', '.join(results)})")
    print(text)
    return 0
