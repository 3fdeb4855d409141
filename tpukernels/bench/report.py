"""``BENCHMARKS.md`` (markdown tables + one PNG per model family) and the combined JSON from result files."""

from __future__ import annotations

import io
import json
import os
import re

from .core import CALIBRATION_FAMILIES, check_versions

#: a model time ratio inside this band is a tie (the estimates are deterministic, but not that exact)
TIE = 0.005
README_BEGIN, README_END = "<!-- bench-summary:begin -->", "<!-- bench-summary:end -->"


def _us(x) -> str:
    return "n/a" if x is None else f"{x:,.1f}"


def _num(x) -> str:
    return "-" if x is None else f"{x:,}" if isinstance(x, (int, float)) else str(x)


def _cell(row: dict | None) -> str:
    """A time cell: estimate, floor (a lower bound), not-credible estimate, or n/a."""
    if row is None:
        return "-"
    if row["model_us"] is None:
        return "n/a ‡"
    if row["figure"] == "floor":
        return f"≥ {_us(row['model_us'])} (floor)"
    mark = " †" if row["credible"] is False else ""
    ratio = "" if row.get("ours_speedup") is None else f" ({row['ours_speedup']:.2f}×)"
    return f"{_us(row['model_us'])}{ratio}{mark}"


def _cases(rows: list[dict]) -> list[tuple[tuple, dict]]:
    """``[((op, shape, chip), {impl: row})]`` in first-seen order."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["op"], r["shape"], r["chip"]), {})[r["impl"]] = r
    return list(out.items())


def _impls(rows: list[dict]) -> list[str]:
    seen = []
    for r in rows:
        if r["impl"] not in seen:
            seen.append(r["impl"])
    return sorted(seen, key=lambda i: i != "tpukernels")


def _ours_estimated(by: dict) -> bool:
    """tpukernels has an estimate in this case (not only a floor, not n/a): the only figure ratios use."""
    ours = by.get("tpukernels")
    return bool(ours and ours["model_us"] and ours.get("figure") == "estimate")


def slower(rows: list[dict]) -> list[dict]:
    """Cases where another implementation's credible estimate beats tpukernels' by more than ``TIE``."""
    out = []
    for (op, shape, chip), by in _cases(rows):
        ours = by.get("tpukernels")
        if not _ours_estimated(by):
            continue
        for name, r in by.items():
            if r is ours or r["figure"] != "estimate" or r["credible"] is False or r["ours_speedup"] is None:
                continue
            if r["ours_speedup"] < 1 - TIE:
                out.append({"op": op, "shape": shape, "chip": chip, "vs": name, "ratio": r["ours_speedup"],
                            "ours": ours, "other": r})
    return out


def above_floor(rows: list[dict]) -> list[dict]:
    """Cases where tpukernels' estimate is above a floor (a lower bound) of another implementation."""
    out = []
    for (op, shape, chip), by in _cases(rows):
        ours = by.get("tpukernels")
        for name, r in by.items():
            if _ours_estimated(by) and r["figure"] == "floor" and r["model_us"] < ours["model_us"]:
                out.append({"op": op, "shape": shape, "chip": chip, "vs": name, "ratio": r["model_us"] / ours["model_us"],
                            "ours": ours, "other": r})
    return out


def _short(error: str, limit: int = 160) -> str:
    """An estimate error cut to its cause: the libtpu source location of an abort, else its first line cut at a
    word boundary before ``limit`` characters (marked ``…``)."""
    m = re.search(r"([\w/]+\.cc:\d+)", error)
    head = error.split(":", 1)[0]
    if m:
        return f"{head}: libtpu aborted ({m.group(1).rsplit('/', 1)[-1]})"
    first = error.strip().splitlines()[0] if error.strip() else error
    if len(first) <= limit and first == error.strip():
        return first
    cut = first[:limit].rsplit(" ", 1)[0] if " " in first[:limit] else first[:limit]
    return cut.rstrip(" ,;:") + " …"


def uncompared(rows: list[dict]) -> list[tuple]:
    """``(op, shape, chip)`` of cases with a tpukernels figure but no credible estimate of another implementation."""
    return [case for case, by in _cases(rows) if _ours_estimated(by)
            and not any(x["figure"] == "estimate" and x["credible"] is not False and x is not by["tpukernels"]
                        for x in by.values())]


def diagnosis(item: dict) -> str:
    """Why tpukernels is slower in a :func:`slower` / :func:`above_floor` item: the family's reason for the row (one
    note shared by every row with the same reason), or ``cause not analysed yet``."""
    return item["ours"].get("reason") or "cause not analysed yet"


def _model_cell(row: dict) -> str:
    """A model time with what bounds it: ``1,099.4 (cycles, 95%)``."""
    return f"{_us(row['model_us'])} ({row['bound']}, {row['pct_roofline']:.0f}%)"


class Notes:
    """Numbered notes: long reasons go below a table as ``[n]`` lines instead of into its cells."""

    def __init__(self):
        self.texts: list[str] = []

    def ref(self, text: str | None) -> str:
        """``[n]`` for ``text`` (the same text gets the same number); ``-`` for none."""
        if not text:
            return "-"
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        return [f"{i}. {t}" for i, t in enumerate(self.texts, 1)]


def _best_other(by: dict) -> dict | None:
    """The fastest credible estimate among the other implementations of one case, or None."""
    others = [r for n, r in by.items() if n != "tpukernels" and r["figure"] == "estimate" and r["credible"] is not False
              and r["model_us"]]
    return min(others, key=lambda r: r["model_us"], default=None)


def implied_vs_measured(calibration: dict | None, family: str, chip: str) -> str:
    """The summary cell "implied real vs tokamax measured" of ``family`` on ``chip``: the geometric mean of
    tokamax's measured time / tpukernels' implied real time over the calibration rows where the model is
    credible (above 1: tpukernels would be faster), with the row counts; ``-`` without calibration rows."""
    import math

    rows = [r for r in (calibration or {}).get("rows", []) if r["family"] == family and r["chip"] == chip]
    if not rows:
        return "-"
    ok = [r["measured_over_implied"] for r in rows if r.get("measured_over_implied")]
    if not ok:
        return f"model not credible ({len(rows)} rows)"
    return f"{math.exp(sum(map(math.log, ok)) / len(ok)):.2f}× ({len(ok)} of {len(rows)} rows implied)"


def calibration_table(res: dict) -> list[str]:
    """The calibration rows (``bench/calibration.py``) as a markdown table plus numbered notes."""
    notes = Notes()

    def ms(x):
        return "n/a" if x is None else f"{x:,.3f}"

    out = ["| family | op | shape | chip | tokamax measured ms | tokamax model ms | model / measured | credible | "
           "tpukernels model ms | tpukernels implied real ms | measured / implied | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        ratio = "n/a" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        cred = {True: "yes", False: "**no**", None: "-"}[r.get("credible")]
        moi = "-" if r.get("measured_over_implied") is None else f"{r['measured_over_implied']:.2f}×"
        note = r.get("note") or (r["error"] if r.get("error") else None)
        shorter = [f for f in r.get("flags", []) if " estimated at S=" in f]  # bench.calibration.at_shorter_seq
        if shorter:
            note = "; ".join(([note] if note else []) + shorter)
        out.append(f"| {r['family']} | {r['op']} | {r['shape']} | {r['chip']} | {ms(r['measured_ms'])} | "
                   f"{ms(r['model_ms'])} | {ratio} | {cred} | {ms(r['ours_model_ms'])} | "
                   f"{ms(r.get('implied_ours_ms'))} | {moi} | {notes.ref(note)} |")
    if notes.texts:
        out += ["", "Notes:", "", *notes.lines()]
    return out


def measured_table(res: dict) -> list[str]:
    """The rows of ``tpukernels bench --measure`` (``bench/measure.py``) as a markdown table plus numbered notes:
    tpukernels measured (median, min, spread) next to its model (``model / measured``) and, on calibration rows,
    tokamax's measured time (``tokamax / ours``: above 1, tpukernels is faster on the chip)."""
    notes = Notes()
    out = ["| family | op | shape | chip | tpukernels measured µs | min µs | spread µs | tpukernels model µs | "
           "model / measured | tokamax measured µs | tokamax / ours | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratio = lambda x, suffix="": "-" if x is None else f"{x:.2f}{suffix}"  # noqa: E731
    for r in res["rows"]:
        cfg = "; ".join(f"{p['kernel'].split('::')[-1]} {p['config_source']}" for p in r.get("parts", []))
        note = r.get("error") or r.get("note") or (f"configs: {cfg}" if cfg else None)
        out.append(f"| {r['family']} | {r['op']} | {r['shape']} | {r['chip']} | {_us(r['measured_us'])} | "
                   f"{_us(r['min_us'])} | {_us(r['spread_us'])} | {_us(r['model_us'])} | "
                   f"{ratio(r['model_over_measured'])} | {_us(r['tokamax_measured_us']) if r['tokamax_measured_us'] else '-'} | "
                   f"{ratio(r['tokamax_over_ours'], '×')} | {notes.ref(note)} |")
    if notes.texts:
        out += ["", "Notes:", "", *notes.lines()]
    return out


def _measured_section(res: dict) -> list[str]:
    lines = ["## Measured on a TPU (`tpukernels bench --measure`)", "",
             f"_{res['kind']}. Made {res['created']} in {res.get('seconds', '?')} s._", "",
             "`model / measured`: tpukernels' model time on this chip (its family's section; n/a until that family "
             "has been modelled for this chip) over the measured median: below 1 the model is optimistic. "
             "`tokamax / ours`: tokamax's measured time (its shipped autotuning cache) over ours measured: above 1, "
             "tpukernels is faster on the chip. A case of several kernel calls sums their medians.", ""]
    return lines + measured_table(res) + [""]


def _calibration_section(res: dict) -> list[str]:
    lines = ["## Calibration against tokamax's measured TPU times", "",
             f"_{res['kind']}; measured times: tokamax {res.get('tokamax')}'s shipped autotuning caches. Made "
             f"{res['created']} in {res.get('seconds', '?')} s (estimate cache: "
             f"{res.get('cache', {}).get('hits', '?')} hits, {res.get('cache', {}).get('misses', '?')} new)._", ""]
    doc = res.get("doc", "").strip()
    if doc:
        lines += [re.sub(r":\w+:`(?:~)?", "`", doc), ""]
    return lines + calibration_table(res) + [""]


def summary_table(model: dict[str, dict], calibration: dict | None = None) -> list[str]:
    """Per family and chip: tpukernels' and the best other implementation's model time summed over the cases
    both have a credible estimate for, their ratio, wins / losses, tpukernels' median % of roofline, and
    (:func:`implied_vs_measured`) tpukernels' implied real time against tokamax's measured time."""
    import statistics

    out = ["| family | chip | cases | tpukernels µs | best other µs | other / ours | faster / slower | "
           "median % roofline | implied real vs tokamax measured |", "|---|---|---|---|---|---|---|---|---|"]
    for fam, res in model.items():
        chips: dict = {}
        for (op, shape, chip), by in _cases(res["rows"]):
            chips.setdefault(chip, []).append(by)
        for chip, cases in chips.items():
            ours_t = other_t = 0.0
            n_cmp = wins = losses = 0
            pcts = []
            for by in cases:
                ours = by.get("tpukernels")
                if not _ours_estimated(by):
                    continue
                if ours.get("pct_roofline") is not None:
                    pcts.append(ours["pct_roofline"])
                best = _best_other(by)
                if best is None:
                    continue
                n_cmp += 1
                ours_t, other_t = ours_t + ours["model_us"], other_t + best["model_us"]
                ratio = best["model_us"] / ours["model_us"]
                wins += ratio > 1 + TIE
                losses += ratio < 1 - TIE
            pct = f"{statistics.median(pcts):.0f}%" if pcts else "-"
            cal = implied_vs_measured(calibration, fam, chip)
            if n_cmp:
                out.append(f"| {fam} | {chip} | {len(cases)} ({n_cmp} compared) | {_us(ours_t)} | {_us(other_t)} | "
                           f"{other_t / ours_t:.2f}× | {wins} / {losses} | {pct} | {cal} |")
            else:
                out.append(f"| {fam} | {chip} | {len(cases)} (none compared) | - | - | - | - | {pct} | {cal} |")
    return out


def _table(rows: list[dict]) -> list[str]:
    impls = _impls(rows)
    # compile-only memory figures (Impl.memory), one column per key: "ours / other / ..." in impl order
    mem_keys = list(dict.fromkeys(k for r in rows for k in (r.get("memory") or {})))
    head = ["op", "shape", "chip", "tpukernels µs", "% roofline"] + [f"{i} µs (×)" for i in impls[1:]] + \
        [f"{k} ({' / '.join(impls)})" for k in mem_keys] + ["tpukernels config"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (op, shape, chip), by in _cases(rows):
        ours = by.get("tpukernels")
        pct = "-" if not ours or ours.get("pct_roofline") is None else f"{ours['pct_roofline']:.0f}%"
        mem = [" / ".join(_num((by[i].get("memory") or {}).get(k)) if i in by else "-" for i in impls)
               for k in mem_keys]
        cells = [op, shape, chip, _cell(ours), pct] + [_cell(by.get(i)) for i in impls[1:]] + mem + \
            [f"`{ours['config']}`" if ours else "-"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def peer_configs(rows: list[dict]) -> list[str]:
    """Markdown bullets: each other implementation's configuration (blocks, tiling, what its program includes), one
    line per distinct configuration with the cases it ran at when there are several."""
    out = []
    for impl in _impls(rows)[1:]:
        by_cfg: dict = {}
        for r in rows:
            if r["impl"] == impl and r.get("config") not in (None, "", "-"):
                by_cfg.setdefault(str(r["config"]), []).append(f"{r['op']} {r['shape']} {r['chip']}")
        if len(by_cfg) == 1:
            out.append(f"* {impl}: `{next(iter(by_cfg))}`")
        elif by_cfg:
            out.append(f"* {impl}:")
            out += [f"  * `{cfg}`: {'; '.join(cases)}" for cfg, cases in by_cfg.items()]
    return out


def plot(family: str, rows: list[dict], path: str) -> str | None:
    """Bar chart of (other time / tpukernels time) per case, credible estimates and floors; None if empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _cases(rows)
    others = [i for i in _impls(rows) if i != "tpukernels"]
    labels = [f"{op} | {shape} | {chip}" for (op, shape, chip), _ in cases]
    if not cases or not others:
        return None
    fig, ax = plt.subplots(figsize=(max(8.0, min(18.0, 0.45 * len(cases))), 7))
    width = 0.8 / len(others)
    for j, name in enumerate(others):
        xs, ys, hatch = [], [], []
        for i, (_, by) in enumerate(cases):
            r, ours = by.get(name), by.get("tpukernels")
            if not r or not _ours_estimated(by) or not r["model_us"] or r["credible"] is False:
                continue
            xs.append(i + (j - (len(others) - 1) / 2) * width)
            ys.append(r["model_us"] / ours["model_us"])
            hatch.append(r["figure"] == "floor")
        bars = ax.bar(xs, ys, width, label=name if ys else f"{name} (no credible estimate: not shown)")
        for b, h in zip(bars, hatch):
            if h:
                b.set_hatch("//")
                b.set_alpha(0.6)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_yscale("log")
    heights = [b.get_height() for b in ax.patches] or [1.0]
    lo, hi = min(min(heights), 1.0) * 0.9, max(max(heights), 1.0) * 1.1
    ticks = [t for t in (0.5, 0.75, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50) if lo <= t <= hi]
    ax.set_ylim(lo, hi)
    ax.set_yticks(ticks, [f"{t:g}×" for t in ticks])
    ax.minorticks_off()
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(labels, fontsize=7, rotation=90)
    ax.set_ylabel("their model time / tpukernels' (> 1: tpukernels faster)")
    ax.set_title(f"{family}: model estimates (libtpu static estimate + roofline); hatched = floor (lower bound)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    _write_if_changed(path, buf.getvalue())
    return path


def _write_if_changed(path: str, data: bytes) -> bool:
    """Write ``data`` to ``path`` unless the file already holds exactly these bytes (a ``--report-only`` run
    leaves unchanged plots untouched, mtime included); True when written."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return False
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return True


def _host_section(res: dict) -> list[str]:
    rows = res["rows"]
    out = ["## Host-side costs (measured)", "", f"_{res['kind']}; {res['versions'].get('host')}; "
           f"made {res['created']}._", ""]
    d = [r for r in rows if r["what"] == "dispatch"]
    if d:
        out += ["Dispatch overhead per call (best of 7 means). *torch op*: the kernel's `TpuKernel` call (binding, "
                "torch dispatcher, cached plan, DLPack in and out; the public wrappers in `tpukernels.library` add "
                "their argument checks on top); *jitted JAX*: the same lowered function called on JAX arrays; "
                "*compiled JAX*: its compiled executable (the floor; jit's C++ fast path can be as fast):", "",
                "| kernel | shapes | torch op µs | jitted JAX µs | compiled JAX µs | overhead vs jit µs |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['kernel']} | {', '.join('x'.join(map(str, s)) for s in r['shapes'])} | "
                f"{r['torch_op_us']:.1f} | {r['jax_jit_us']:.1f} | {r['jax_compiled_us']:.1f} | {r['overhead_us']:.1f} |"
                for r in d]
        out.append("")
    t = [r for r in rows if r["what"] == "tpu_dispatch"]
    if t:
        out += ["What tpukernels itself adds on the **tpu** path per call (binding, plan lookup, row padding and "
                "output slicing), measured with a no-op runner in place of torch_tpu's `JaxCallable`, against an "
                "empty `torch.library.custom_op` with the same tensor and scalar arguments (the torch dispatcher "
                f"alone). Target: ≤ {t[0]['target_us']:.0f} µs added. Padding and slicing are two tensor copies "
                "(on a TPU, two device ops):", "",
                "| case | torch op µs | empty custom op µs | added µs |", "|---|---|---|---|"]
        out += [f"| {r['case']} | {r['torch_op_us']:.1f} | {r['empty_custom_op_us']:.1f} | {r['added_us']:.1f} |"
                for r in t]
        out.append("")
    c = [r for r in rows if r["what"] == "compile"]
    if c:
        out += ["First-call latency in a fresh process, seconds, for the cpu target (tracing + the XLA:CPU compile "
                "of the interpret-mode kernel, not a TPU compile). Cold: empty JAX persistent cache; warm: a new "
                "process with the cache the cold run wrote (entries counted); tracing still happens warm:", "",
                "| kernel | import | first call, cold | first call, warm | cache entries | second call |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['kernel']} | {r['import_s']:.2f} | {r['first_call_cold_s']:.2f} | {r['first_call_warm_s']:.2f} | "
                f"{r.get('cache_entries', '?')} | {r['second_call_s']:.4f} |" for r in c]
        out.append("")
    rc = [r for r in rows if r["what"] == "recompiles"]
    if rc:
        out += [f"`torch.compile(dynamic=True)` over {len(rc[0]['lengths'])} lengths {rc[0]['lengths']}: dynamo "
                "frames (1 = one graph for all lengths, no recompiles) and tpukernels lowerings (one per distinct "
                "kernel signature: `rms_norm` buckets rows and `flash_attention` buckets Sq / Skv, 4 buckets per power of "
                "two, so one per bucket):", "",
                "| kernel | varying | dynamo frames | tpukernels lowerings |", "|---|---|---|---|"]
        out += [f"| {r['kernel']} | {r['varying']} | {r['dynamo_frames']} | {r['kernel_lowerings']} |" for r in rc]
        out.append("")
    ex = [r for r in rows if r["what"] == "executors"]
    if ex:  # tpukernels.bench.executors
        out += ["Autotune executors, candidates per second of `tpukernels::matmul_nn` sweeps (exhaustive order; "
                "worker start-up excluded and listed apart). *overhead*: an evaluator that does no work (what the "
                "executor itself dispatches); *tpu-model*: the real evaluator without libtpu's cycle estimate (one "
                "Mosaic + XLA:TPU compile for v5e per candidate):", "",
                "| executor | workers | sweep | candidates | seconds | candidates/s | start-up s |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['executor']} | {r['workers']} | {r['sweep']} | {r['candidates']} | {r['seconds']:.2f} | "
                f"{r['candidates_per_s']:.1f} | {r['startup_s']:.1f} |" for r in ex]
        out.append("")
    return out


def _source_lines(results: dict[str, dict]) -> list[str]:
    """Which tpukernels source each family's figures come from (families may be run separately)."""
    from .core import SOURCE_KEY, source_digest

    parts = []
    for fam, r in results.items():
        digest = r["versions"].get(SOURCE_KEY)
        now = source_digest(fam)
        stale = "" if digest == now else f" (an earlier source than this checkout's `{now}`)"
        parts.append(f"{fam} `{digest}` {r.get('created', '')[:16]}{stale}")
    return ["Source digest per family (`tpukernels.bench.core.source_digest`: the sources the family's figures "
            "depend on, with the run date): " + "; ".join(parts) + ". A family marked earlier is re-run with "
            "`tpukernels bench --family NAME`."]


STRATEGIES = ("exhaustive", "random", "coordinate", "surrogate")


def strategy_table(data: dict) -> list[str]:
    """Markdown lines of :mod:`tpukernels.bench.strategy_study`'s results (``strategy_study.json``): evaluations each
    tuner strategy needs to come within ``data["within"]`` of the exhaustive best, median / worst over seeds."""
    import statistics

    strategies = [s for s in STRATEGIES if all(s in r for r in data["rows"])]
    lines = [f"Evaluations until the best so far is within {data['within']:.0%} of the exhaustive best (median / "
             f"worst of {data['seeds']} seeds; % of the valid configs). Objective: {data['objective']}.", "",
             "| kernel | chip | valid configs | " + " | ".join(strategies) + " |",
             "|---|---|---:|" + "---:|" * len(strategies)]
    for r in data["rows"]:
        cells = []
        for s in strategies:
            m, w = r[s]["median"], r[s]["worst"]
            cells.append(f"{m:g} / {w} ({100 * m / r['valid']:.0f}% / {100 * w / r['valid']:.0f}%)")
        lines.append(f"| {r['kernel'].split('::')[-1]} | {r['chip']} | {r['valid']} | " + " | ".join(cells) + " |")
    if data["rows"]:
        med = {s: statistics.median(100 * r[s]["median"] / r["valid"] for r in data["rows"]) for s in strategies}
        worst = {s: max(100 * r[s]["worst"] / r["valid"] for r in data["rows"]) for s in strategies}
        lines.append("| **median / worst over the rows** | | | " + " | ".join(
            f"{med[s]:.0f}% / {worst[s]:.0f}%" for s in strategies) + " |")
    return lines


def _strategy_section(results_dir: str) -> list[str]:
    path = os.path.join(results_dir, "strategy_study.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    return ["## Tuner strategies (model)", "",
            f"_`python -m tpukernels.bench.strategy_study`, made {data.get('created', '?')}; one exhaustive table per kernel x "
            "chip, then each strategy replayed over it (baseline: the declared defaults)._", "",
            *strategy_table(data), ""]


def render(results: dict[str, dict], out_path: str, command: str, figures_dir: str | None = None,
           measured: dict | None = None) -> str:
    """Write ``out_path`` (markdown) and ``<figures_dir>/<family>.png`` (default: ``benchmarks/results``
    beside ``out_path``); returns the markdown. ``measured``: the result of ``tpukernels bench --measure``
    (its own section).

    Raises:
        VersionMismatch: the result files were made with different versions.
    """
    headers = {f"{f}.json": r["versions"] for f, r in results.items()}
    if measured is not None:
        headers["measured.json"] = measured["versions"]
    common = check_versions(headers)
    base = os.path.dirname(os.path.abspath(out_path))
    lines = ["# tpukernels benchmarks", "",
             f"Generated by `{command}`; do not edit by hand (re-run the command). Versions: "
             + ", ".join(f"{k} {v}" for k, v in common.items()) + ".", "",
             *_source_lines(results), ""]
    model = {f: r for f, r in results.items() if f != "host" and f not in CALIBRATION_FAMILIES}
    calibration = results.get("calibration")
    if model:
        lines += ["## Summary", "",
                  "Model estimates (libtpu static cycles with the chip's rooflines; not measurements), summed over the "
                  "cases where tpukernels and another implementation both have a credible estimate. `other / ours` "
                  "above 1: tpukernels is faster. Details per family below. `implied real vs tokamax measured`: "
                  "where tokamax ships a measured TPU time at (or near) the family's shapes and the model of "
                  "tokamax's kernel is within 0.7-1.3 of it, tokamax measured / tpukernels' implied real time "
                  "(our model / that ratio), geometric mean; above 1: tpukernels would be faster (see the "
                  "calibration section).", "",
                  *summary_table(model, calibration), ""]
    lines += ["## What the figures are", "",
             "* **Model estimates** (norms, matmul, attention): libtpu's static `estimated_cycles` of the program "
             "compiled for a compile-only TPU target (no TPU was used), combined with the chip's rooflines: "
             "`max(cycles / clock, bytes / HBM bandwidth, FLOPs / MXU peak)` (`tpukernels.perf.model_time`; chip "
             "figures from jax's `tpu_info`, clock calibrated in `benchmarks/calibrate_clock.py`). Every "
             "implementation of a case gets the same bytes and FLOPs (what the op must move and compute), so "
             "they differ only in their cycle estimate. A model, not a measurement: libtpu's estimate does not "
             "model HBM contention, and it can miss work (see †).",
             "* `(N×)` = that implementation's model time / tpukernels': above 1, tpukernels is faster.",
             "* `% roofline` = roofline time / tpukernels' model time. Chip figures are per TensorCore (jax's "
             "`tpu_info`); every kernel here runs on one core.",
             "* `≥ x (floor)`: libtpu could not estimate the program (its static profiler aborted, its profiling compile "
             "ran out of VMEM, or the estimate was not attempted: the row's error in the JSON and its note say which); "
             "x is a lower bound on that implementation's time, not an estimate. Where tpukernels' own figure is a "
             "floor, a ratio against it is a bound too, not a comparison (the summary leaves such cases out).",
             "* `†`: not credible: the estimate falls below the MXU roofline of work the kernel must do "
             "(checked on a variant without the causal mask); excluded from comparisons and plots.",
             "* `n/a ‡`: no figure (error in the JSON).",
             "* **Measurements** (host): wall clock on the CPU named in that section.", ""]
    if model:
        notes = Notes()
        lines += ["## Where tpukernels is slower", ""]
        items = [(f, s) for f, r in model.items() for s in slower(r["rows"])]
        if items:
            lines += ["`tpukernels` and `theirs`: model µs (bound, % of roofline).", "",
                      "| family | op | shape | chip | slower than | tpukernels | theirs | their time / ours | reason |",
                      "|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {f} | {s['op']} | {s['shape']} | {s['chip']} | {s['vs']} | {_model_cell(s['ours'])} | "
                      f"{_model_cell(s['other'])} | {s['ratio']:.3f} | {notes.ref(diagnosis(s))} |" for f, s in items]
        else:
            lines.append("No credible estimate of another implementation beats tpukernels.")
        missing = [(f, r_) for f, r in model.items() for r_ in r["rows"] if r_["kind"] == "ours" and r_["model_us"] is None]
        if missing:
            lines += ["", "No tpukernels figure (so no comparison) for:", ""]
            lines += [f"* {f}: {r_['op']} {r_['shape']} {r_['chip']}: {_short(r_['error'])}"
                      + (f" {notes.ref(r_['reason'])}" if r_.get("reason") else "") for f, r_ in missing]
        alone = [(f, op, shape, chip) for f, r in model.items() for op, shape, chip in uncompared(r["rows"])]
        if alone:
            lines += ["", "No credible estimate of another implementation to compare with (only floors, n/a or †):", ""]
            lines += [f"* {f}: {op} {shape} {chip}" for f, op, shape, chip in alone]
        floors = [(f, s) for f, r in model.items() for s in above_floor(r["rows"])]
        if floors:
            lines += ["", "Above another implementation's **floor** (a lower bound, so not evidence that it is faster):", "",
                      "| family | op | shape | chip | floor of | tpukernels | floor µs | floor / ours | note |",
                      "|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {f} | {s['op']} | {s['shape']} | {s['chip']} | {s['vs']} | {_model_cell(s['ours'])} | "
                      f"{_us(s['other']['model_us'])} | {s['ratio']:.3f} | {notes.ref(diagnosis(s))} |"
                      for f, s in floors]
        if notes.texts:
            lines += ["", "Notes:", "", *notes.lines()]
        lines.append("")
    for fam, res in model.items():
        lines += [f"## {fam} (model)", "", f"_{res['kind']}. Made {res['created']} in {res.get('seconds', '?')} s "
                  f"(estimate cache: {res.get('cache', {}).get('hits', '?')} hits, "
                  f"{res.get('cache', {}).get('misses', '?')} new)._", ""]
        doc = res.get("doc", "").strip()
        if doc:
            lines += [re.sub(r":\w+:`", "`", doc), ""]
        lines += _table(res["rows"]) + [""]
        configs = peer_configs(res["rows"])
        if configs:
            lines += ["Configurations of the other implementations:", "", *configs, ""]
        png = plot(fam, res["rows"], os.path.join(figures_dir or os.path.join(base, "benchmarks", "results"),
                                                  f"{fam}.png"))
        if png:
            lines += [f"![{fam}]({os.path.relpath(png, base)})", ""]
        flagged = [r for r in res["rows"] if r["flags"] or r["error"]]
        if flagged:
            lines += ["Flags and errors:", ""]
            lines += [f"* {r['op']} {r['shape']} {r['chip']} {r['impl']}: "
                      + "; ".join(r["flags"] + ([_short(r["error"])] if r["error"] else [])) for r in flagged]
            lines.append("")
    if calibration is not None:
        lines += _calibration_section(calibration)
    if measured is not None:
        lines += _measured_section(measured)
    lines += _strategy_section(figures_dir or os.path.join(base, "benchmarks", "results"))
    if "host" in results:
        lines += _host_section(results["host"])
    text = "\n".join(lines) + "\n"
    with open(out_path, "w") as f:
        f.write(text)
    return text


def measured_summary(res: dict) -> str:
    """The README line of ``tpukernels bench --measure``'s rows: the range of model / measured and of tokamax /
    ours over the rows that have them."""
    rows = res["rows"]
    timed = [r for r in rows if r["measured_us"] is not None]
    ratios = [r["model_over_measured"] for r in timed if r["model_over_measured"] is not None]
    tok = [r["tokamax_over_ours"] for r in timed if r["tokamax_over_ours"] is not None]
    parts = [f"{len(timed)} of {len(rows)} cases timed"]
    if ratios:
        parts.append(f"model / measured {min(ratios):.2f}–{max(ratios):.2f} ({len(ratios)} cases with a model)")
    if tok:
        parts.append(f"tokamax measured / ours {min(tok):.2f}–{max(tok):.2f}× ({sum(x >= 1 for x in tok)}/{len(tok)} "
                     "rows at least as fast)")
    return f"* measured on a TPU {res.get('chip')} (`tpukernels bench --measure`): " + "; ".join(parts) + "."


def summary(results: dict[str, dict], command: str, measured: dict | None = None) -> str:
    """A few markdown lines for the README: per family, how tpukernels compares (model / measured)."""
    out = [f"Produced by `{command}` (full tables, plots and caveats: [BENCHMARKS.md](BENCHMARKS.md)). "
           "Device figures are libtpu static-estimate **models** for compile-only chips, not TPU measurements.", ""]
    for fam, res in results.items():
        if fam == "host":
            d = [r for r in res["rows"] if r["what"] == "dispatch"]
            if d:
                out.append(f"* host (measured on this CPU): torch-op dispatch overhead "
                           f"{min(r['overhead_us'] for r in d):.0f}–{max(r['overhead_us'] for r in d):.0f} µs per call "
                           "over the jitted JAX function.")
            t = [r for r in res["rows"] if r["what"] == "tpu_dispatch"]
            if t:
                out.append(f"* host (measured): tpukernels' own cost on the tpu path (no-op runner vs an empty custom "
                           f"op) {min(r['added_us'] for r in t):.0f}–{max(r['added_us'] for r in t):.0f} µs per call "
                           f"(target {t[0]['target_us']:.0f} µs; the high end pads and slices rows).")
            continue
        if fam in CALIBRATION_FAMILIES:
            ok = [r for r in res["rows"] if r.get("credible")]
            out.append(f"* {fam} (model vs tokamax's measured TPU times): the model is within 0.7-1.3 of the "
                       f"measured time at {len(ok)} of {len(res['rows'])} rows.")
            continue
        by_impl: dict = {}
        for (_, _, _), by in _cases(res["rows"]):
            if not _ours_estimated(by):  # tpukernels' own floor is no figure to compare
                continue
            for name, r in by.items():
                if name != "tpukernels" and r["ours_speedup"] is not None and r["credible"] is not False:
                    by_impl.setdefault((name, r["figure"]), []).append(r["ours_speedup"])
        parts = []
        for (name, figure), v in by_impl.items():
            kind = "vs its floor" if figure == "floor" else "vs"
            parts.append(f"{kind} {name} {min(v):.2f}–{max(v):.2f}× ({sum(x >= 1 - TIE for x in v)}/{len(v)} cases "
                         "at least as fast)")
        lonely = len(uncompared(res["rows"]))
        missing = sum(1 for r in res["rows"] if r["kind"] == "ours" and (r["model_us"] is None or r["figure"] != "estimate"))
        gaps = ([f"{lonely} cases with no credible estimate of another implementation"] if lonely else []) + \
            ([f"{missing} cases with no tpukernels estimate (a floor or no figure)"] if missing else [])
        out.append(f"* {fam} (model): " + "; ".join(parts) + (f" ({'; '.join(gaps)})" if gaps else "") + ".")
    if measured is not None:
        out.append(measured_summary(measured))
    return "\n".join(out)


def update_readme(path: str, text: str) -> bool:
    """Replace the text between the bench-summary markers of ``path``; False if the markers are missing."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        src = f.read()
    if README_BEGIN not in src or README_END not in src:
        return False
    head, rest = src.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    with open(path, "w") as f:
        f.write(head + README_BEGIN + "\n" + text + "\n" + README_END + tail)
    return True


def combined_json(results: dict[str, dict], path: str) -> None:
    common = check_versions({f"{f}.json": r["versions"] for f, r in results.items()})
    with open(path, "w") as f:
        json.dump({"versions": common, "families": results}, f, indent=1)
