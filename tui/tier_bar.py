"""One memory tier as a bar: weights / KV cache (in use, resident but idle) / workspace vs budget.

The bar draws what the tier holds (``TierUsage.used``): the KV pool's resident pages, not its
reservation, whose untouched pages hold nothing (``MemoryReport``); the words name all three."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widget import Widget

from llmsys.kernels.common.units import format_bytes
from llmsys.tui.snapshot import TIER_LABELS, TierUsage


def _cells(parts: list[int], budget: int, width: int) -> list[int]:
    """Cells per segment; a non-empty segment always gets one cell so it is seen."""
    cells = [0 if p <= 0 else max(1, round(p / budget * width)) for p in parts]
    while sum(cells) > width and max(cells) > 1:
        cells[cells.index(max(cells))] -= 1
    return cells


def _indent(lines: tuple[str, ...], label: int, width: int) -> int:
    """Indent the detail lines under the bar, less when the panel is narrow, so
    that they fit on their line (each line is one row: the widget is 3 high)."""
    longest = max(len(x) for x in lines)
    return max(0, min(label, width - longest))


class TierBar(Widget):
    """Two lines: the bar with 'used / budget', then the split in words."""

    COMPONENT_CLASSES = {"tierbar--weights", "tierbar--kv", "tierbar--kvfree", "tierbar--workspace", "tierbar--free", "tierbar--label"}
    DEFAULT_CSS = "TierBar { height: 3; }"

    def __init__(self, tier: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tier = tier
        self.usage = TierUsage(tier, None)
        self.render_s = 0.0  # time spent rendering, for the overhead check

    def set_usage(self, usage: TierUsage) -> None:
        if usage != self.usage:
            self.usage = usage
            self.refresh()

    def render(self) -> Text:
        t0 = time.perf_counter()
        u = self.usage
        label = f"{TIER_LABELS.get(self.tier, self.tier):<5}"
        style = self.get_component_rich_style
        text = Text(label, style=style("tierbar--label"))
        width = max(self.content_size.width - len(label), 10)
        if u.budget is None and u.used == 0:
            text.append("n/a", style=style("tierbar--free"))
            text.append("\n     " + ("no GPU" if self.tier == "gpu" else "not used") + "\n")
            self.render_s += time.perf_counter() - t0
            return text
        budget = u.budget or max(u.used, 1)
        kv_idle = max(u.kv_resident - u.kv_used, 0)  # pages written once, holding nothing now
        cells = _cells([u.weights, min(u.kv_used, u.kv_resident), kv_idle, u.workspace], budget, width)
        for n, ch, cls in zip(cells, "█▆▒▓", ("weights", "kv", "kvfree", "workspace")):
            text.append(ch * n, style=style(f"tierbar--{cls}"))
        text.append("░" * max(width - sum(cells), 0), style=style("tierbar--free"))
        budget_s = format_bytes(u.budget) if u.budget is not None else "n/a"
        details = (
            f"{format_bytes(u.used)} / {budget_s} · WS {format_bytes(u.workspace)}",
            f"W {format_bytes(u.weights)} · KV {format_bytes(u.kv_resident)} of {format_bytes(u.kv_reserved)}",
        )
        indent = " " * _indent(details, len(label), self.content_size.width)
        for line in details:
            text.append(f"\n{indent}{line}")
        text.no_wrap = True
        text.overflow = "ellipsis"
        self.render_s += time.perf_counter() - t0
        return text
