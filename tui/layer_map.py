"""One cell per layer, coloured by the tier that holds its weights."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widget import Widget

from llmsys.tui.snapshot import TIER_LABELS

RESIDENT, STREAMED = "█", "▚"
LEGEND_WIDTH = 32  # cells of the full legend; a narrower panel gets the short one


class LayerMap(Widget):
    """Cells wrap to the widget's width; streamed layers use a hatched cell."""

    COMPONENT_CLASSES = {"layermap--gpu", "layermap--cpu", "layermap--disk", "layermap--legend"}
    DEFAULT_CSS = "LayerMap { height: auto; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tiers: tuple[str, ...] = ()
        self.streamed: tuple[bool, ...] = ()
        self.render_s = 0.0

    def set_layers(self, tiers: tuple[str, ...], streamed: tuple[bool, ...]) -> None:
        if (tiers, streamed) != (self.tiers, self.streamed):
            self.tiers, self.streamed = tiers, streamed
            self.refresh(layout=True)

    def _gap(self, width: int) -> str:
        return " " if 2 * len(self.tiers) <= width else ""  # separate cells when they fit

    def get_content_height(self, container, viewport, width: int) -> int:
        per_line = max(width // (1 + len(self._gap(width))), 1)
        return 1 + max(1, -(-len(self.tiers) // per_line))

    def render(self) -> Text:
        t0 = time.perf_counter()
        text = Text(no_wrap=False)
        if not self.tiers:
            text.append("no layers yet", style=self.get_component_rich_style("layermap--legend"))
        gap = self._gap(self.content_size.width)
        for tier, streamed in zip(self.tiers, self.streamed):
            if gap and text:
                text.append(gap)
            cls = f"layermap--{tier}" if tier in ("gpu", "cpu", "disk") else "layermap--legend"
            text.append(STREAMED if streamed else RESIDENT, style=self.get_component_rich_style(cls))
        text.append("\n")
        wide = self.content_size.width >= LEGEND_WIDTH
        for tier in ("gpu", "cpu", "disk"):
            text.append(RESIDENT, style=self.get_component_rich_style(f"layermap--{tier}"))
            text.append(f" {TIER_LABELS[tier]}" + ("  " if wide else " "), style=self.get_component_rich_style("layermap--legend"))
        text.append(f"{STREAMED} {'streamed' if wide else 'stream'}", style=self.get_component_rich_style("layermap--legend"))
        self.render_s += time.perf_counter() - t0
        return text
