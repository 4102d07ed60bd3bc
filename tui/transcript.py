"""The scrolling list of chat messages."""

from __future__ import annotations

from textual.containers import VerticalScroll

from llmsys.tui.chat_message import ChatMessage


class Transcript(VerticalScroll):
    """Holds ChatMessage widgets; follows the newest text unless the user scrolled up.

    Following uses Textual's anchor: an anchored view is kept at the end by the
    compositor whenever the layout changes (new text, a terminal resize that
    rewraps every message, the memory panel hiding), and scrolling up releases
    it until the user scrolls back to the end. Without it a resize left the view
    at its old offset, which after rewrapping was near the top.
    """

    can_focus = False

    def on_mount(self) -> None:
        self.anchor()

    async def add_message(self, role: str, text: str = "") -> ChatMessage:
        msg = ChatMessage(role, text)
        await self.mount(msg)
        self.follow()
        return msg

    async def clear(self) -> None:
        await self.remove_children()
        self.anchor()

    def messages(self) -> list[ChatMessage]:
        return list(self.query(ChatMessage))

    def follow(self) -> None:
        """Keep the end in view, unless the user scrolled up to read."""
        if self.max_scroll_y - self.scroll_y <= 3:
            self.scroll_end(animate=False)

    @property
    def at_end(self) -> bool:
        return self.scroll_y >= self.max_scroll_y

    @property
    def plain_text(self) -> str:
        return "\n".join(f"{m.role}: {m.raw}" for m in self.messages())
