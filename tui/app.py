"""``llmsys chat``: the Textual app.

Layout: transcript + input on the left, the memory panel on the right, a
status line at the bottom. The layout follows the terminal's width through
Textual's breakpoints (classes on the screen, rules in chat.tcss): the panel
narrows below ``WIDE_AT`` columns and hides below ``NARROW_AT``; Ctrl+B hides
or shows it at any width. All engine work happens on :class:`EngineWorker`'s
thread (the engine client the server uses too); this module only reacts to its
messages, so a slow step never freezes the screen and a failed load or a full
context becomes a notice, not a crash.
"""

from __future__ import annotations

from pathlib import Path
import dataclasses
from typing import Any, Callable

from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import Markdown

from llmsys.kernels.common.errors import LLMSysError
from llmsys.engine.sampling import SamplingParams
from llmsys.tui.chat_message import ChatMessage
from llmsys.tui.commands import TUI_KEYS, SlashCommand, help_markdown, parse_command
from llmsys.tui.info import info_markdown, info_rows
from llmsys.tui.conversation import Conversation, apply_settings, sampling_from_dict, sampling_to_dict
from llmsys.tui.conversation import keep_kv
from llmsys.tui.memory_panel import MemoryPanel
from llmsys.tui.messages import (
    EngineFailed,
    EngineReady,
    GenerationDone,
    GenerationFailed,
    ModelInfo,
    SnapshotUpdated,
    TokensReceived,
)
from llmsys.tui.prompt_input import PromptInput
from llmsys.tui.status_line import StatusLine
from llmsys.tui.transcript import Transcript
from llmsys.tui.worker import Abort, EngineWorker, Generate, Refresh, error_line


NARROW_AT = 90  # below this many columns the memory panel hides (Ctrl+B shows it)
WIDE_AT = 120  # from here on the panel has its full width
RESIZE_SETTLE_S = 0.15  # a resize burst (a window being dragged) is over when no new size came for this long


class ChatApp(App):
    CSS_PATH = str(Path(__file__).with_name("chat.tcss"))  # absolute: subclasses live elsewhere
    TITLE = "llmsys chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True, show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True, show=False),
        Binding("ctrl+b", "toggle_panel", "Memory panel", priority=True, show=False),
    ]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (NARROW_AT, "-medium"), (WIDE_AT, "-wide")]

    def __init__(
        self,
        load: Callable[[], Any],
        *,
        model_name: str = "model",
        sampling: SamplingParams | None = None,
        system: str | None = None,
        refresh_hz: float = 4.0,
        theme: str | None = None,
    ):
        """``load`` builds the LLM; it runs on the engine thread (so loading shows
        progress and a failure becomes a notice). Pass ``lambda: llm`` to reuse one."""
        super().__init__()
        self._load = load
        self.model_name = model_name
        self.sampling = sampling or SamplingParams(max_tokens=256)
        self.conversation = Conversation(system=system)
        self.refresh_hz = refresh_hz
        self.worker: EngineWorker | None = None
        self.info: ModelInfo | None = None
        self.load_error: str | None = None
        self.generating: int | None = None  # gen id in flight
        self._gen_ids = 0
        self._reply: ChatMessage | None = None
        self._stream: Any = None
        self._replaced: str | None = None  # the reply a /retry in flight replaces (restored if it fails)
        self.last_finish: str | None = None
        self.notices: list[tuple[str, str]] = []  # (severity, text) of every notice shown
        self._settle: Any = None  # the timer of the redraw after a resize burst
        self.full_redraws = 0  # those done (tests)
        if theme:
            self.theme = theme

    def notify(self, message: str, *, title: str = "", severity: str = "information", **kwargs: Any) -> None:  # type: ignore[override]
        self.notices.append((severity, f"{title}: {message}" if title else message))
        super().notify(message, title=title, severity=severity, **kwargs)

    # -- layout --------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                yield PromptInput(id="prompt")
            yield MemoryPanel(id="memory")
        yield StatusLine(id="status")

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def panel(self) -> MemoryPanel:
        return self.query_one(MemoryPanel)

    @property
    def status(self) -> StatusLine:
        return self.query_one(StatusLine)

    def on_mount(self) -> None:
        self.status.show_loading(self.model_name)
        self.query_one(PromptInput).focus()
        self.worker = EngineWorker(self._load, self.post_message, refresh_hz=self.refresh_hz)
        self.worker.start()

    def on_resize(self, event: events.Resize) -> None:
        """Once a resize burst settles, draw the whole screen again.

        Textual redraws on each new size, but while a window is dragged the terminal changes
        size again under frames drawn for the one before (more so while decoding holds the
        UI thread back), and a terminal that rewraps its own contents on resize moves cells
        the app did not write: both leave stray glyphs that a repaint of only what changed
        keeps. One full repaint at the final size, after the last size event, clears them.
        """
        if self._settle is not None:
            self._settle.stop()
        self._settle = self.set_timer(RESIZE_SETTLE_S, self._redraw_all)

    def _redraw_all(self) -> None:
        self._settle = None
        self.full_redraws += 1
        self.refresh(repaint=True, layout=True)

    def on_unmount(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def _show_status(self, state: str) -> None:
        if self.info is not None:
            plan = self.panel.snapshot.plan_phrase if self.panel.snapshot else ""
            self.status.show_info(self.info, plan, state)

    # -- engine messages -----------------------------------------------------
    def on_engine_ready(self, msg: EngineReady) -> None:
        self.info = msg.info
        self.panel.update_snapshot(msg.snapshot)
        self._show_status("ready")

    async def on_engine_failed(self, msg: EngineFailed) -> None:
        self.load_error = msg.error
        self.status.show_text(f"{self.model_name}: not loaded ({msg.error})  ·  /help · Ctrl+Q quit")
        self.notify(msg.error, title="model failed to load", severity="error", timeout=15)
        await self.transcript.add_message("error", f"**Could not load the model:** {msg.error}")

    def on_snapshot_updated(self, msg: SnapshotUpdated) -> None:
        try:
            self.panel.update_snapshot(msg.snapshot)
        except NoMatches:  # posted by the engine thread while the app was closing
            pass

    async def on_tokens_received(self, msg: TokensReceived) -> None:
        if msg.gen_id != self.generating or self._reply is None or not msg.text:
            return
        self._reply.add_text(msg.text)
        await self._stream.write(msg.text)
        self.transcript.follow()

    async def _end_reply(self) -> str:
        text = self._reply.raw if self._reply is not None else ""
        if self._stream is not None:
            await self._stream.stop()
        self._stream = None
        self.generating = None
        return text

    async def on_generation_done(self, msg: GenerationDone) -> None:
        if msg.gen_id != self.generating:
            return
        text = await self._end_reply()
        self.conversation.add("assistant", text)
        self._reply = None
        self._replaced = None
        self.last_finish = msg.finish_reason
        if msg.finish_reason == "abort":
            self.notify(f"stopped after {msg.completion_tokens} tokens; the text so far is kept", timeout=4)
        elif msg.finish_reason == "length" and self.info and msg.prompt_tokens + msg.completion_tokens >= self.info.max_len:
            self.notify(f"the context is full ({self.info.max_len} tokens); /reset to start over", severity="warning", timeout=8)
        self._show_status("ready")
        self.transcript.follow()

    async def on_generation_failed(self, msg: GenerationFailed) -> None:
        if msg.gen_id == self.generating:
            await self._end_reply()
            if self._reply is not None and (not self._reply.raw or self._replaced is not None):
                await self._reply.remove()
            self._reply = None
            if self._replaced is not None:  # a failed /retry: the reply it was to replace stays
                self.conversation.add("assistant", self._replaced)
                await self.transcript.add_message("assistant", self._replaced)
                self._replaced = None
            elif self.conversation.messages and self.conversation.messages[-1]["role"] == "user":
                self.conversation.messages.pop()  # the turn did not happen
        self.notify(msg.error, title="generation failed", severity="error", timeout=10)
        self._show_status("ready")

    # -- input ---------------------------------------------------------------
    async def on_prompt_input_submitted(self, msg: PromptInput.Submitted) -> None:
        try:
            cmd = parse_command(msg.text)
            if cmd is not None:
                await self.run_command(cmd)
            else:
                await self.send(msg.text)
        except LLMSysError as e:
            self.notify(error_line(e), severity="error", timeout=8)

    def _can_generate(self) -> bool:
        if self.info is None:
            why = f"the model did not load: {self.load_error}" if self.load_error else "the model is still loading"
            self.notify(f"cannot generate: {why}", severity="warning")
            return False
        if self.generating is not None:
            self.notify("a reply is still being generated; press Esc to stop it", severity="warning")
            return False
        return True

    async def send(self, text: str) -> None:
        if not self._can_generate():
            return
        self.conversation.add("user", text)
        await self.transcript.add_message("user", text)
        await self._start_reply()

    async def retry(self) -> None:
        """Drop the last reply (turn and widget) and generate again from the same user turn."""
        msgs = self.conversation.messages
        if not msgs or msgs[-1]["role"] != "assistant":
            self.notify("nothing to retry: there is no reply yet", severity="warning")
            return
        if not self._can_generate():
            return
        self._replaced = msgs.pop()["content"]
        old = [m for m in self.transcript.messages() if m.role == "assistant"]
        if old:
            await old[-1].remove()
        await self._start_reply()

    def last_reply(self) -> str | None:
        return next((m["content"] for m in reversed(self.conversation.messages) if m["role"] == "assistant"), None)

    async def _start_reply(self) -> None:
        """Mount an empty assistant message and ask the engine for the reply to the conversation."""
        self._reply = await self.transcript.add_message("assistant", "")
        self._stream = Markdown.get_stream(self._reply)
        self._gen_ids += 1
        self.generating = self._gen_ids
        if self.info.is_chat:
            job = Generate(self.generating, self.sampling, messages=self.conversation.chat_messages())
        else:
            job = Generate(self.generating, self.sampling, text=self.conversation.completion_text())
        self._show_status("generating")
        self.worker.ask(job)

    async def run_command(self, cmd: SlashCommand) -> None:
        busy = self.generating is not None
        if cmd.name == "quit":  # /bye, /exit, /quit: as Ctrl+Q
            await self.action_quit()
        elif cmd.name == "help":
            await self.transcript.add_message("notice", help_markdown(TUI_KEYS))
        elif cmd.name == "info":
            await self.show_info()
        elif cmd.name == "copy":
            self.copy_reply()
        elif cmd.name == "system":
            self.conversation.system = cmd.arg or None
            self.notify("system prompt set" if cmd.arg else "system prompt removed")
        elif cmd.name == "set":
            self.sampling = apply_settings(self.sampling, list(cmd.args))
            shown = {k: v for k, v in sampling_to_dict(self.sampling).items() if k in ("temperature", "top_p", "top_k", "max_tokens", "seed")}
            self.notify("sampling: " + " ".join(f"{k}={v}" for k, v in shown.items()))
        elif busy:
            self.notify(f"/{cmd.name} waits until the reply is done; press Esc to stop it", severity="warning")
        elif cmd.name == "retry":
            await self.retry()
        elif cmd.name == "reset":
            self.conversation.reset()
            await self.transcript.clear()
            if self.worker is not None and self.info is not None:
                self.worker.ask(Refresh(forget_context=True))
            self.notify("conversation cleared")
        elif cmd.name == "save":
            p = self.conversation.save(cmd.args[0], self.sampling, self.model_name)
            self.notify(f"saved {len(self.conversation.messages)} messages to {p}")
            if self.worker is not None and self.info is not None and (
                    note := keep_kv(self.worker.llm, self.conversation, self.info.is_chat, p)):
                self.notify(note)
        elif cmd.name == "load":
            conv, sampling = Conversation.load(cmd.args[0])
            if sampling:
                try:
                    self.sampling = sampling_from_dict(self.sampling, sampling)
                except (LLMSysError, TypeError) as e:
                    self.notify(f"kept the current sampling settings: {e}", severity="warning")
            self.conversation = conv
            await self.transcript.clear()
            for m in conv.messages:
                await self.transcript.add_message(m["role"], m["content"])
            self.notify(f"loaded {len(conv.messages)} messages from {cmd.args[0]}")

    async def show_info(self) -> None:
        if self.info is None:
            why = self.load_error or "the model is still loading"
            self.notify(f"no model information: {why}", severity="warning")
            return
        await self.transcript.add_message("notice", info_markdown(info_rows(self.info, self.panel.snapshot)))

    def copy_reply(self) -> None:
        """Put the last reply on the clipboard: Textual writes the OSC 52 escape."""
        text = self.last_reply()
        if not text:
            self.notify("nothing to copy: there is no reply yet", severity="warning")
            return
        self.copy_to_clipboard(text)
        self.notify(f"copied the last reply ({len(text)} characters) to the clipboard")

    # -- actions -------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating is not None and self.worker is not None:
            self.worker.ask(Abort(self.generating))

    def action_toggle_panel(self) -> None:
        """Hide or show the memory panel; the choice holds across resizes.

        The width rules decide by default; the key sets ``-hidden`` (hide a panel
        the width would show) or ``-shown`` (show one it would hide), and going
        back to what the width gives clears both, so later resizes decide again.
        """
        panel = self.panel
        show = not panel.display
        by_width = not self.screen.has_class("-narrow")
        panel.set_class(not show and by_width, "-hidden")
        panel.set_class(show and not by_width, "-shown")
        self.transcript.follow()

    @property
    def panel_visible(self) -> bool:
        return bool(self.panel.display)

    def replace_sampling(self, **changes: Any) -> None:
        self.sampling = dataclasses.replace(self.sampling, **changes)
