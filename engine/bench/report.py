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
        cells += [str(r.threads), str(r.batch), r.test]
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

_X_AXES = (("batch", "batch size"), ("gpu_mem", "GPU budget"), ("cpu_mem", "CPU budget"), ("depth", "context depth (tokens)"),
           ("n_prompt", "prompt tokens"), ("threads", "threads"))
_LINE_AXES = ("dtype", "quant", "kv_dtype", "kv_policy", "gpu_mem", "cpu_mem", "threads", "batch")


def _x_axis(rows: list[BenchRow]) -> tuple[str, str]:
    for name, label in _X_AXES:
        if len({getattr(r, name) for r in rows}) > 1:
            return name, label
    return "batch", "batch size"


def _xval(row: BenchRow, name: str) -> float:
    v = getattr(row, name)
    if name in ("gpu_mem", "cpu_mem"):
        from llmsys.kernels.common.units import parse_size

        return (parse_size(v) or 0) / 1024**3
    return float(v)


def plot(result: BenchResult, path: str | Path) -> list[str]:
    """Throughput vs the swept axis (batch, budget or context), one line per configuration.

    Returns the line labels, in drawing order. The x axis is the first of
    batch / GPU budget / CPU budget / depth / prompt length / threads that
    takes more than one value; every other varying axis splits lines, as does
    the test (pp / tg / pg) and each ``--vs`` baseline (dashed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if r.tok_s]
    xname, xlabel = _x_axis(rows or result.rows)
    split = [a for a in _LINE_AXES if a != xname and len({getattr(r, a) for r in rows}) > 1]

    def base_test(r: BenchRow) -> str:
        t = r.test.split(" @ ")[0]
        if xname == "n_prompt" and r.n_prompt:
            return "pg" if r.n_gen else "pp"
        return t

    lines: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        label = " ".join([base_test(r)] + [f"{a}={getattr(r, a)}" for a in split])
        lines.setdefault(label, []).append((_xval(r, xname), r.tok_s))
        for b, f in r.baselines.items():
            if f.tok_s:
                lines.setdefault(f"{label} [{b}]", []).append((_xval(r, xname), f.tok_s))
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if label.endswith("]") else "-", marker="o", label=label)
    if xname in ("batch",) and rows and max(r.batch for r in rows) >= 8:
        ax.set_xscale("log", base=2)
    model = rows[0].model if rows else (result.rows[0].model if result.rows else "")
    ax.set_xlabel(xlabel + (" (GiB)" if xname.endswith("_mem") else ""))
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{model} - {result.machine.cpu_model}" + (f" / {result.machine.gpu_name}" if result.machine.gpu_name else ""))
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
    return list(lines)
