"""The bottom line: model, dtype, quantization, device and the plan in one phrase.

It holds a few renderings of the same facts, longest first, and draws the
longest one that fits the terminal's width, so the key hints at its end stay
visible when the terminal is narrowed (a single long line was cut off there).
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.widget import Widget

from llmsys.tui.messages import ModelInfo

KEYS = "  ·  Esc stop · /help · Ctrl+Q quit"
SHORT_KEYS = " · /help · Ctrl+Q quit"


def info_variants(info: ModelInfo, plan: str, state: str) -> tuple[str, ...]:
    """The status in decreasing detail; the key hints are in every one."""
    mode = "chat" if info.is_chat else "completion"
    return (
        f"{info.name} | {info.dtype} | quant {info.quant} | {info.device} | {plan} | {mode} | {state}{KEYS}",
        f"{info.name} | {info.dtype} | {plan} | {mode} | {state}{KEYS}",
        f"{info.name} | {info.dtype} | {mode} | {state}{KEYS}",
        f"{info.name} | {state}{KEYS}",
        f"{state}{SHORT_KEYS}",
    )


class StatusLine(Widget):
    DEFAULT_CSS = "StatusLine { height: 1; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.variants: tuple[str, ...] = ("",)

    def _set(self, *variants: str) -> None:
        self.variants = variants
        self.refresh()

    def show_loading(self, model: str) -> None:
        self._set(f"loading {model} …")

    def show_info(self, info: ModelInfo, plan: str, state: str = "ready") -> None:
        self._set(*info_variants(info, plan, state))

    def show_text(self, text: str) -> None:
        self._set(text)

    @property
    def text(self) -> str:
        """What is drawn at the current width."""
        width = self.content_size.width or cell_len(self.variants[0])
        return next((v for v in self.variants if cell_len(v) <= width), self.variants[-1])

    def render(self) -> Text:
        return Text(self.text, no_wrap=True, overflow="ellipsis")
