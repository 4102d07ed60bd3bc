"""The memory-tier panel: tier bars, layer map, KV/context figures, speed."""

from __future__ import annotations

import time

from rich.console import RenderableType
from rich.text import Text
from textual.app import ComposeResult
from textual.renderables.sparkline import Sparkline as SparklineRenderable
from textual.containers import VerticalScroll
from textual.widgets import Sparkline, Static

from llmsys.kernels.common.units import format_bytes
from llmsys.tui.layer_map import LayerMap
from llmsys.tui.snapshot import TIER_LABELS, TIERS, TierSnapshot
from llmsys.tui.tier_bar import TierBar


def _n(v: object, fmt: str = "{}") -> str:
    return "n/a" if v is None else fmt.format(v)


LABEL = 11  # the figures' label column ("KV blocks  ")


def fit(lines: list[str], width: int) -> list[str]:
    """Break lines longer than ``width`` at their " · " separators, the rest
    under the label column, so a narrow panel keeps the columns readable."""
    out: list[str] = []
    for line in lines:
        parts = line.split(" · ")
        current = parts[0]
        for part in parts[1:]:
            if len(current) + 3 + len(part) <= width:
                current += " · " + part
            else:
                out.append(current)
                current = " " * LABEL + part
        out.append(current)
    return out


def describe(s: TierSnapshot) -> list[str]:
    """The panel's figures as text lines (also what tests compare)."""
    kv = "  ".join(f"{TIER_LABELS[t.tier]} {t.kv_blocks_used}/{t.kv_blocks_total}" for t in s.tiers if t.kv_blocks_total) or "n/a"
    lines = [f"KV blocks  {kv}"]
    for t in s.tiers:  # the pool's three sizes (MemoryReport): what holds tokens, what memory holds, the reservation
        if t.kv_reserved:
            lines.append(f"KV {TIER_LABELS[t.tier]:<7}{format_bytes(t.kv_used)} in use · {format_bytes(t.kv_resident)} "
                         f"resident · {format_bytes(t.kv_reserved)} reserved")
    if s.context_budget is not None or s.tokens_in_context is not None:
        lines.append(f"context    {_n(s.tokens_in_context)} / {_n(s.context_budget)} tokens")
    lines.append(f"evicted    {_n(s.evicted_tokens)} tokens · policy {_n(s.kv_policy)}")
    if s.source == "server":
        lines.append(f"requests   {_n(s.requests_running)} running · {_n(s.requests_waiting)} queued")
        lines.append(f"per req    {_n(s.per_request_tok_s, '{:.1f}')} tok/s")
    ex = s.experts
    if ex is not None:
        where = "on disk" if ex.tier == "disk" else f"in {TIER_LABELS.get(ex.tier, ex.tier)} RAM"
        line = f"experts    {ex.expert_bytes / 2**30:.2f} GiB {where}"
        if ex.cache_capacity:
            rate = "n/a" if ex.hit_rate is None else f"{ex.hit_rate * 100:.0f}%"
            line += (f" · cache {ex.cache_bytes / 2**20:.0f}/{ex.cache_capacity / 2**20:.0f} MiB"
                     f" · hits {rate} ({ex.hits}/{ex.hits + ex.misses})")
        lines.append(line)
    lines.append(f"speed      {_n(s.tok_s, '{:.1f}')} tok/s · TTFT {_n(None if s.ttft_s is None else s.ttft_s * 1000, '{:.0f}')} ms")
    wait = "no weight streaming" if s.transfer_wait_share is None and not any(s.layer_streamed) else _n(None if s.transfer_wait_share is None else s.transfer_wait_share * 100, "{:.0f}%")
    lines.append(f"transfers  {wait}" + (" waiting" if s.transfer_wait_share is not None else ""))
    return lines


class SpeedSparkline(Sparkline):
    """Textual's Sparkline, except that no data draws nothing.

    The stock widget draws a baseline for no data and a solid block for one
    value (its maximum), which read as a measurement before any was made. One
    value is drawn as a flat line.
    """

    def render(self) -> RenderableType:
        data = list(self.data or [])
        if not data:
            return Text("")
        drawn = super().render()
        if len(data) == 1 and isinstance(drawn, SparklineRenderable):
            drawn.data = data * 2  # two equal values: the flat line of a steady speed
        return drawn


class MemoryPanel(VerticalScroll):
    """Shows one :class:`TierSnapshot`; ``update_snapshot`` is cheap (no engine calls)."""

    can_focus = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.snapshot: TierSnapshot | None = None
        self.update_s = 0.0  # time spent in update_snapshot, for the overhead check
        self.updates = 0
        self.border_title = "memory"

    def compose(self) -> ComposeResult:
        for t in TIERS:
            yield TierBar(t, id=f"tier-{t}")
        yield Static("layers", classes="panel-heading")
        yield LayerMap(id="layer-map")
        yield Static("", id="panel-figures")
        yield Static("tokens/s", classes="panel-heading")
        yield SpeedSparkline([], id="tok-spark")

    def on_resize(self) -> None:
        if self.snapshot is not None:  # re-fit the figures to the new width
            self.update_snapshot(self.snapshot)

    def update_snapshot(self, s: TierSnapshot) -> None:
        t0 = time.perf_counter()
        self.snapshot = s
        for t in TIERS:
            self.query_one(f"#tier-{t}", TierBar).set_usage(s.tier(t))
        self.query_one(LayerMap).set_layers(s.layer_tiers, s.layer_streamed)
        figures = self.query_one("#panel-figures", Static)
        figures.update("\n".join(fit(describe(s), figures.content_size.width or 10**6)))
        spark = self.query_one(SpeedSparkline)
        data = list(s.tok_s_history)
        if list(spark.data or []) != data:
            spark.data = data
        self.update_s += time.perf_counter() - t0
        self.updates += 1

    @property
    def render_s(self) -> float:
        return sum(b.render_s for b in self.query(TierBar)) + self.query_one(LayerMap).render_s

    @property
    def figures_text(self) -> str:
        return "\n".join(describe(self.snapshot)) if self.snapshot else ""
