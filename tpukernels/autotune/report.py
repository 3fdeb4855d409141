"""Sweep reports: a plain-text summary table, a markdown report and a PNG plot per sweep."""

from __future__ import annotations

import json
import os
import re

from .tuner import SweepResult

#: one line under every table / report: what the times are
LABEL_NOTES = {
    "model": "times are a MODEL (compile-only libtpu static estimate + HBM/MXU roofline + grid-step overhead), "
             "not a measurement",
}


def label_note(result: SweepResult) -> str:
    return LABEL_NOTES.get(result.label, f"times are {result.label}")


def fmt_config(config: dict | None) -> str:
    return "-" if not config else ",".join(f"{k}={v}" for k, v in sorted(config.items()))


def _fmt_us(t: float | None) -> str:
    return "-" if t is None else f"{t:,.1f}"


def _reasons(counter) -> str:
    return ", ".join(f"{n} {k}" for k, n in counter.most_common()) or "0"


def summary_rows(results: list[SweepResult]) -> tuple[list[list], list[str]]:
    """Rows + header of the final table (one row per sweep)."""
    header = ["kernel", "problem", "chip", "best config", "time us", "baseline", "baseline us", "speed-up",
              "% roofline", "evaluated", "failed", "pruned", "stopped", "s"]
    rows = []
    for r in results:
        b, d = r.best, r.default
        pct = None if b is None else b.details.get("pct_of_roofline")
        rows.append([
            r.kernel, r.problem, r.chip or "cpu", fmt_config(b and b.config),
            ("≥ " if b and not b.ranked else "") + _fmt_us(b and b.time_us)
            + (" (model)" if b and r.label == "model" else "") + (" unranked" if b and not b.ranked else ""),
            f"{fmt_config(d and d.config)} ({r.baseline_source})",
            _fmt_us(d.time_us if d and d.ok else None),
            "-" if r.speedup is None else f"{r.speedup:.2f}x",
            "-" if pct is None else f"{pct:.0f}%",
            len(r.trials), _reasons(r.failures), _reasons(r.pruned_kinds), r.stopped, f"{r.elapsed_s:.1f}",
        ])
    return rows, header


def unranked_lines(result: SweepResult) -> list[str]:
    """What the text output says when candidates have no libtpu estimate (their times are lower bounds)."""
    ok = [t for t in result.trials if t.ok]
    bounds = [t for t in ok if not t.ranked]
    if not bounds:
        return []
    head = (f"no candidate has a libtpu estimate: the best is the best lower bound, not a ranking"
            if len(bounds) == len(ok) else
            f"{len(bounds)} of {len(ok)} candidates have no libtpu estimate (lower bounds, ranked after the rest)")
    return [f"  {head}; first reason: {bounds[0].details['unranked'][:300]}"]


def failure_lines(result: SweepResult, limit: int = 5) -> list[str]:
    out = [f"  {fmt_config(t.config)}: {t.status} ({t.error_kind}) {(t.error or '')[:200]}"
           for t in result.trials if not t.ok]
    return out[:limit] + ([f"  ... {len(out) - limit} more"] if len(out) > limit else [])


def pruned_lines(result: SweepResult, show: int = 4) -> list[str]:
    """Why each pruned config was pruned: one line per distinct reason, with how many configs and examples."""
    groups: dict = {}
    for p in result.pruned:
        groups.setdefault((p.kind, p.reason), []).append(fmt_config(dict(p.config)))
    out = []
    for (kind, reason), cfgs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        more = f" and {len(cfgs) - show} more" if len(cfgs) > show else ""
        out.append(f"  {len(cfgs)} x {kind}: {reason[:300]} ({'; '.join(cfgs[:show])}{more})")
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def plot(result: SweepResult, path: str) -> str:
    """PNG: every candidate's time in evaluation order, best-so-far line, failures marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ok = [(t.index, t.time_us) for t in result.trials if t.ok]
    bad = [t.index for t in result.trials if not t.ok]
    if ok:
        ax.scatter([i for i, _ in ok], [v for _, v in ok], s=18, label="candidate", color="tab:blue")
        best, line = float("inf"), []
        for t in result.trials:
            if t.ok and t.ranked:
                best = min(best, t.time_us)
            line.append(best if best < float("inf") else None)
        xs = [i for i, v in enumerate(line) if v is not None]
        ax.step(xs, [line[i] for i in xs], where="post", color="tab:green", label="best so far")
        d = result.default
        if d is not None and d.ok:
            ax.scatter([d.index], [d.time_us], marker="s", s=50, facecolors="none", edgecolors="black",
                       label=f"baseline ({result.baseline_source})")
        ax.set_yscale("log")
    if bad:
        top = max([v for _, v in ok], default=1.0)
        ax.scatter(bad, [top * 1.3] * len(bad), marker="x", color="tab:red", label="failed")
    unit = "model µs" if result.label == "model" else "measured µs"
    ax.set_xlabel("candidate (evaluation order)")
    ax.set_ylabel(f"time ({unit})")
    ax.set_title(f"{result.kernel} {result.problem} on {result.chip or 'cpu'}: {result.strategy}, "
                 f"{len(result.trials)} evaluated", fontsize=9)
    if result.label == "model":
        fig.text(0.01, 0.01, "times are a model (libtpu static estimate + roofline), not measurements", fontsize=7)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def markdown(result: SweepResult, png_name: str | None) -> str:
    b, d = result.best, result.default
    lines = [f"## {result.kernel} — {result.problem} on {result.chip or 'cpu'}", ""]
    lines.append(f"*{label_note(result)}.*")
    lines.append("")
    lines.append(f"- evaluator: `{result.evaluator}` ({result.label}); strategy: `{result.strategy}`; budget: "
                 f"{result.budget}; stopped: {result.stopped} after {result.elapsed_s:.1f} s")
    lines.append(f"- space: {result.space_size} configs; evaluated {len(result.trials)}, ok {len(result.ok_trials)}, "
                 f"failed {sum(result.failures.values())} ({_reasons(result.failures)}), pruned before compiling "
                 f"{len(result.pruned)} ({_reasons(result.pruned_kinds)})")
    if b is not None:
        pct = b.details.get("pct_of_roofline")
        lines.append(f"- **best: `{fmt_config(b.config)}` = {_fmt_us(b.time_us)} µs**"
                     + (f", {pct:.0f}% of roofline" if pct is not None else "")
                     + (f", bound by {b.details['bound']}" if "bound" in b.details else ""))
    if d is not None and d.ok:
        lines.append(f"- default `{fmt_config(d.config)}` = {_fmt_us(d.time_us)} µs"
                     + (f" (best is {result.speedup:.2f}x faster)" if result.speedup else ""))
    if result.db_note:
        lines.append(f"- tuning DB: {result.db_note}")
    if png_name:
        lines += ["", f"![candidates]({png_name})"]
    lines += ["", "| # | config | status | time µs | detail |", "|---|---|---|---|---|"]
    for t in sorted(result.trials, key=lambda t: t.rank_key if t.ok else (2, 0.0)):
        detail = t.details.get("bound", "") if t.ok else f"{t.error_kind}: {(t.error or '')[:160]}"
        if t.ok and not t.ranked:
            detail = f"unranked ({t.details['unranked'][:160]})"
        row = f"| {t.index} | `{fmt_config(t.config)}` | {t.status} | {_fmt_us(t.time_us)} | {detail} |"
        lines.append(row.replace("\n", " "))
    if result.pruned:
        lines += ["", "Pruned before compiling:", ""]
        for p in result.pruned[:20]:
            lines.append(f"- `{fmt_config(dict(p.config))}` ({p.kind}): {p.reason[:200]}")
        if len(result.pruned) > 20:
            lines.append(f"- ... {len(result.pruned) - 20} more")
    return "\n".join(lines) + "\n"


def write_report(results: list[SweepResult], directory: str) -> list[str]:
    """Write ``report.md``, ``sweeps.json`` and one PNG per sweep into ``directory``; return the paths."""
    os.makedirs(directory, exist_ok=True)
    paths, sections = [], []
    for r in results:
        png = f"{_slug(r.kernel)}_{_slug(r.problem)}_{r.chip or 'cpu'}.png"
        try:
            paths.append(plot(r, os.path.join(directory, png)))
        except Exception as e:  # a plotting problem must not lose the report
            png = None
            sections.append(f"(plot failed: {type(e).__name__}: {e})\n")
        sections.append(markdown(r, png))
    md = os.path.join(directory, "report.md")
    with open(md, "w") as f:
        f.write("# tpukernels autotune report\n\n" + "\n".join(sections))
    js = os.path.join(directory, "sweeps.json")
    with open(js, "w") as f:
        json.dump([r.to_dict() for r in results], f, indent=1, default=str)
    return [md, js, *paths]
