"""The scrolling list of chat messages."""

from __future__ import annotations

from textual.containers import VerticalScroll

from llmsys.tui.chat_message import ChatMessage


class Transcript(VerticalScroll):
    """Holds ChatMessage widgets; follows the newest text unless the user scrolled up."""

    can_focus = False

    async def add_message(self, role: str, text: str = "") -> ChatMessage:
        msg = ChatMessage(role, text)
        await self.mount(msg)
        self.scroll_end(animate=False)
        return msg

    async def clear(self) -> None:
        await self.remove_children()

    def messages(self) -> list[ChatMessage]:
        return list(self.query(ChatMessage))

    def follow(self) -> None:
        if self.max_scroll_y - self.scroll_y <= 3:
            self.scroll_end(animate=False)

    @property
    def plain_text(self) -> str:
        return "\n".join(f"{m.role}: {m.raw}" for m in self.messages())
