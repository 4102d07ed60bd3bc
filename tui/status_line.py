"""The bottom line: model, dtype, quantization, device and the plan in one phrase."""

from __future__ import annotations

from textual.widgets import Static

from llmsys.tui.messages import ModelInfo


class StatusLine(Static):
    def show_loading(self, model: str) -> None:
        self.update(f"loading {model} …")

    def show_info(self, info: ModelInfo, plan: str, state: str = "ready") -> None:
        mode = "chat" if info.is_chat else "completion"
        self.update(
            f"{info.name} | {info.dtype} | quant {info.quant} | {info.device} | {plan} | {mode} | {state}"
            "  ·  Esc stop · /help · Ctrl+Q quit"
        )

    def show_text(self, text: str) -> None:
        self.update(text)
