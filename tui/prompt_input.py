"""The input box: multi-line entry with a history (Up/Down), Enter to send."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    """Enter sends; Ctrl+J (or a trailing backslash) inserts a new line.

    Up on the first line / Down on the last line walk the history, so moving
    the cursor inside a multi-line draft still works.
    """

    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.input_history: list[str] = []
        self._pos: int | None = None  # index into history while browsing
        self._draft = ""

    def _set(self, text: str) -> None:
        self.text = text
        last = self.document.line_count - 1
        self.move_cursor((last, len(self.document.get_line(last))))

    def _history_step(self, delta: int) -> bool:
        if not self.input_history:
            return False
        if self._pos is None:
            if delta > 0:
                return False
            self._draft = self.text
            self._pos = len(self.input_history)
        pos = self._pos + delta
        if pos < 0:
            return True
        if pos >= len(self.input_history):
            self._pos = None
            self._set(self._draft)
            return True
        self._pos = pos
        self._set(self.input_history[pos])
        return True

    async def _on_key(self, event: events.Key) -> None:
        key = event.key
        row = self.cursor_location[0]
        handled = False
        if key == "enter":
            text = self.text
            if text.endswith("\\"):
                self._set(text[:-1] + "\n")
            else:
                self.submit()
            handled = True
        elif key in ("ctrl+j", "shift+enter", "alt+enter"):
            self.insert("\n")
            handled = True
        elif key == "up" and row == 0:
            handled = self._history_step(-1)
        elif key == "down" and row == self.document.line_count - 1:
            handled = self._history_step(+1)
        if handled:
            event.stop()
            event.prevent_default()
            return
        await super()._on_key(event)

    def submit(self) -> None:
        text = self.text
        if not text.strip():
            return
        if not self.input_history or self.input_history[-1] != text:
            self.input_history.append(text)
        self._pos = None
        self._draft = ""
        self.text = ""
        self.post_message(self.Submitted(text))
