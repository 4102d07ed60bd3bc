"""One turn of the transcript, rendered as Markdown (code blocks highlighted)."""

from __future__ import annotations

from textual.widgets import Markdown

TITLES = {"user": "you", "assistant": "assistant", "system": "system", "notice": "notice", "error": "error"}


class ChatMessage(Markdown):
    """A Markdown block with its role as a CSS class and as the border title."""

    def __init__(self, role: str, text: str = "", **kwargs) -> None:
        super().__init__(text, classes=f"msg-{role}", **kwargs)
        self.role = role
        self.border_title = TITLES.get(role, role)
        self.raw = text  # the raw text (Markdown source) of this turn

    def add_text(self, fragment: str) -> None:
        self.raw += fragment
