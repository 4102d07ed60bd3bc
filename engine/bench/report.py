"""Bench output: Markdown table, JSON / JSONL / CSV, and a throughput plot.

Markdown is for people (columns that never change across rows stay out of
the table and go in the header); the machine formats carry every field of
every row plus the machine record, so results from different machines can be
pooled and compared later.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmsys.engine.bench.suite import DEFAULTS, BenchResult, BenchRow
from llmsys.kernels.common.units import format_bytes

FORMATS = ("md", "json", "jsonl", "csv")


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _params(n: int | None) -> str:
    if not n:
        return "-"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


def to_markdown(result: BenchResult) -> str:
    rows = result.rows
    m = result.machine
    out = [f"machine: {m.summary()}", ""]
    if not rows:
        return "\n".join(out + ["(no rows)"])
    varying = {
        name: len({getattr(r, name) for r in rows}) > 1 or getattr(rows[0], name) != DEFAULTS.get(name, getattr(rows[0], name))
        for name in ("quant", "kv_dtype", "kv_policy", "gpu_mem", "cpu_mem")
    }
    baselines = list(rows[0].baselines)
    head = ["model", "size", "params", "device", "dtype"]
    head += [n.replace("_", "-") for n, v in varying.items() if v]
    head += ["threads", "batch", "test", "t/s", "ttft ms", "itl p50/p99 ms", "e2e t/s", "%roof", "peak RSS"]
    if any(r.peak_gpu_bytes for r in rows):
        head.append("peak GPU")
    spec = any(r.spec for r in rows)
    if spec:
        head += ["spec", "verify / decode step", "tokens / step", "spec e2e t/s", "plain e2e t/s"]
    for b in baselines:
        head += [f"{b} t/s", f"x {b}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [
            r.model + (" (synthetic)" if r.synthetic and "synthetic" not in r.model else ""),
            format_bytes(r.weight_bytes) if r.weight_bytes else "-",
            _params(r.params),
            r.device,
            r.dtype,
        ]
        cells += [str(getattr(r, n) or "-") for n, v in varying.items() if v]
        cells += [f"{r.threads} (auto)" if r.threads_auto else str(r.threads), str(r.batch), r.test]
        if r.error:
            cells += [f"error: {r.error}", "", "", "", "", ""]
        else:
            itl = "-" if r.itl_p50_ms is None else f"{r.itl_p50_ms:.1f} / {r.itl_p99_ms:.1f}"
            cells += [
                f"{_f(r.tok_s)} ± {_f(r.tok_s_std)}",
                _f(r.ttft_ms, 1),
                itl,
                _f(r.e2e_tok_s),
                _f(r.roof_pct, 1),
                format_bytes(r.peak_cpu_bytes) if r.peak_cpu_bytes else "-",
            ]
        if "peak GPU" in head:
            cells.append(format_bytes(r.peak_gpu_bytes) if r.peak_gpu_bytes else "-")
        if spec:
            cells += [r.spec or "-", f"{_f(r.spec_verify_x)}x" if r.spec_verify_x else "-", _f(r.spec_tokens_per_step),
                      _f(r.spec_tok_s), _f(r.spec_plain_tok_s)]
        for b in baselines:
            f = r.baselines[b]
            if f.error:
                cells += [f"error: {f.error}", "-"]
            else:
                cells += [f"{_f(f.tok_s)} ± {_f(f.tok_s_std)}", f"{_f(f.ratio)}x" if f.ratio else "-"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    note = (
        f"\n{len(rows)} rows, -r {result.spec.repetitions} (mean ± stddev, warm-up excluded; t/s times model steps only, "
        f"e2e t/s is LLM.generate on text) in {result.wall_s:.1f} s"
    )
    return "\n".join(out + lines) + "\n" + note


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def row_dicts(result: BenchResult) -> list[dict[str, Any]]:
    return [r.to_dict(result.machine) for r in result.rows]


def to_json(result: BenchResult) -> str:
    return json.dumps(
        {"machine": result.machine.to_dict(), "wall_s": result.wall_s, "rows": row_dicts(result)}, indent=2
    )


def to_jsonl(result: BenchResult) -> str:
    return "".join(json.dumps(d) + "\n" for d in row_dicts(result))


def to_csv(result: BenchResult) -> str:
    flat = [_flat(d) for d in row_dicts(result)]
    keys: list[str] = []
    for d in flat:
        keys += [k for k in d if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    for d in flat:
        w.writerow({k: ("" if d.get(k) is None else d.get(k)) for k in keys})
    return buf.getvalue()


def render(result: BenchResult, fmt: str) -> str:
    return {"md": to_markdown, "json": to_json, "jsonl": to_jsonl, "csv": to_csv}[fmt](result)


# --------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------

_PANELS = {"pp": "pp: prompt processing", "tg": "tg: text generation", "pg": "pg: prompt + generation"}
_X_AXES = (("batch", "batch size (sequences)"), ("gpu_mem", "GPU budget (GiB)"), ("cpu_mem", "CPU budget (GiB)"),
           ("depth", "context depth (tokens)"), ("n_prompt", "prompt length (tokens)"), ("threads", "CPU threads"))
_INTEGER_AXES = ("batch", "depth", "n_prompt", "threads")  # swept in whole numbers: no 1.5 ticks
_LINE_AXES = ("dtype", "quant", "kv_dtype", "kv_policy", "gpu_mem", "cpu_mem", "threads", "batch")
_MAX_FIXED_TICKS = 12  # up to this many swept values get a tick each; more get MaxNLocator's integers


@dataclass
class Series:
    """One line of the plot: a configuration's (or a baseline's) tok/s over the swept axis."""

    label: str  # legend text: test + the configuration's varying values (+ [baseline])
    panel: str  # pp, tg or pg: tests with different scales never share an axis
    config: str  # the varying values (+ baseline) alone: one colour per configuration across panels
    baseline: bool
    points: list[tuple[float, float, float]] = field(default_factory=list)  # (x, mean tok/s, stddev)


def _x_axis(rows: list[BenchRow]) -> tuple[str, str]:
    for name, label in _X_AXES:
        if len({getattr(r, name) for r in rows}) > 1:
            return name, label
    return "batch", _X_AXES[0][1]


def _xval(row: BenchRow, name: str) -> float:
    v = getattr(row, name)
    if name in ("gpu_mem", "cpu_mem"):
        from llmsys.kernels.common.units import parse_size

        return (parse_size(v) or 0) / 1024**3
    return float(v)


def _panel_of(row: BenchRow) -> str:
    return "pg" if row.n_prompt and row.n_gen else ("pp" if row.n_prompt else "tg")


def plot_series(result: BenchResult) -> tuple[str, str, list[Series]]:
    """(x field, x label, lines) of the plot: the data, apart from drawing it.

    The x axis is the first of batch / GPU budget / CPU budget / depth /
    prompt length / threads that takes more than one value; every other
    varying axis splits lines, as does the test and each ``--vs`` baseline.
    Rows with an error have no figure and draw nothing.
    """
    rows = [r for r in result.rows if r.tok_s]
    xname, xlabel = _x_axis(rows or result.rows)
    split = [a for a in _LINE_AXES if a != xname and len({getattr(r, a) for r in rows}) > 1]
    series: dict[str, Series] = {}

    def add(label: str, panel: str, config: str, baseline: bool, point: tuple[float, float, float]) -> None:
        series.setdefault(label, Series(label, panel, config, baseline)).points.append(point)

    for r in rows:
        test = r.test.split(" @ ")[0]
        if xname == "n_prompt":
            test = _panel_of(r)  # the prompt length is the x axis, not part of the name
        config = " ".join(f"{a}={getattr(r, a)}" for a in split)
        x = _xval(r, xname)
        add(" ".join(filter(None, [test, config])), _panel_of(r), config, False, (x, r.tok_s, r.tok_s_std or 0.0))
        for b, f in r.baselines.items():
            if f.tok_s:
                add(" ".join(filter(None, [test, config, f"[{b}]"])), _panel_of(r), f"{config} [{b}]", True,
                    (x, f.tok_s, f.tok_s_std or 0.0))
    for s in series.values():
        s.points.sort()
    return xname, xlabel, list(series.values())


def _set_x_ticks(ax, xname: str, xs: list[float]) -> None:
    """Whole-number sweeps get whole-number ticks; a wide batch sweep a log2 axis with its values marked."""
    from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator, ScalarFormatter

    values = sorted(set(xs))
    if xname == "batch" and values and max(values) >= 8:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
    if xname not in _INTEGER_AXES:
        return
    if len(values) <= _MAX_FIXED_TICKS:
        ax.xaxis.set_major_locator(FixedLocator(values))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _title(result: BenchResult, rows: list[BenchRow]) -> str:
    m = result.machine
    model = rows[0].model if rows else "(no rows)"
    hw = m.cpu_model + (f" + {m.gpu_name}" if m.gpu_name else "")
    return f"{model} on {hw}: mean ± stddev of {result.spec.repetitions} repetitions"


def draw(result: BenchResult):
    """The plot as a :class:`matplotlib.figure.Figure`: one panel per test kind (pp / tg / pg),
    one line per configuration, throughput over the swept axis.

    Why panels: prefill runs at tens of times decode's rate, so on one shared
    axis tg is flattened at zero. Error bars are the repetitions' stddev; the
    legend sits outside the panels so it never hides data. A bare ``Figure``
    (no pyplot): nothing is registered globally, nothing needs closing.
    """
    from matplotlib.figure import Figure

    xname, xlabel, series = plot_series(result)
    panels = [k for k in _PANELS if any(s.panel == k for s in series)] or ["tg"]
    fig = Figure(figsize=(4.6 * len(panels) + 3.0, 4.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colors = {c: f"C{i % 10}" for i, c in enumerate(dict.fromkeys(s.config for s in series))}
    for ax, kind in zip(axes, panels):
        mine = [s for s in series if s.panel == kind]
        for s in mine:
            xs, ys, es = zip(*s.points)
            ax.errorbar(xs, ys, yerr=es, fmt="o--" if s.baseline else "o-", color=colors[s.config], capsize=3,
                        markersize=4, label=s.label)
        _set_x_ticks(ax, xname, [x for s in mine for x, _, _ in s.points])
        ax.set_title(_PANELS[kind], fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("throughput (tokens/s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if not mine:
            ax.text(0.5, 0.5, "no successful rows", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(_title(result, result.rows))
    if series:
        fig.legend(loc="outside right upper", fontsize=8)
    return fig


def plot(result: BenchResult, path: str | Path) -> list[str]:
    """Write :func:`draw`'s figure as a PNG; returns the line labels in drawing order."""
    fig = draw(result)
    fig.savefig(str(path), dpi=110)
    return [label for ax in fig.axes for label in ax.get_legend_handles_labels()[1]]
