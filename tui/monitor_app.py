"""``llmsys monitor URL``: the memory panel for a running ``llmsys serve``.

A poller thread scrapes ``URL/metrics`` (twice a second by default) and posts
snapshots; a server that is down or not exporting a metric shows as n/a and a
notice, and the app keeps polling so it recovers when the server comes back.
"""

from __future__ import annotations

from pathlib import Path
import threading
import time
from dataclasses import dataclass

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.message import Message

from llmsys.tui.memory_panel import MemoryPanel
from llmsys.tui.messages import SnapshotUpdated
from llmsys.tui.metrics import MetricsTracker, fetch_metrics
from llmsys.tui.status_line import StatusLine


@dataclass
class MetricsUnavailable(Message):
    error: str


class MonitorApp(App):
    CSS_PATH = str(Path(__file__).with_name("chat.tcss"))  # absolute: subclasses live elsewhere
    TITLE = "llmsys monitor"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True, show=False), Binding("q", "quit", "Quit", show=False)]

    def __init__(self, url: str = "http://127.0.0.1:8000", interval: float = 0.5, theme: str | None = None):
        super().__init__()
        self.url = url
        self.interval = interval
        self.scrapes = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="llmsys-monitor", daemon=True)
        if theme:
            self.theme = theme

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield MemoryPanel(id="memory", classes="wide")
        yield StatusLine(id="status")

    @property
    def panel(self) -> MemoryPanel:
        return self.query_one(MemoryPanel)

    def on_mount(self) -> None:
        self.query_one(StatusLine).show_text(f"connecting to {self.url} …")
        self._thread.start()

    def on_unmount(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _poll(self) -> None:
        tracker = MetricsTracker()
        while not self._stop.is_set():
            try:
                samples = fetch_metrics(self.url, timeout=min(2.0, max(self.interval * 4, 0.5)))
                self.post_message(SnapshotUpdated(tracker.update(samples, time.monotonic())))
            except Exception as e:  # noqa: BLE001 - connection refused, HTTP error, timeout
                self.post_message(MetricsUnavailable(f"{type(e).__name__}: {e}"))
            self._stop.wait(self.interval)

    def on_snapshot_updated(self, msg: SnapshotUpdated) -> None:
        try:
            self._show(msg)
        except NoMatches:  # a scrape that lands while the app is closing
            pass

    def on_metrics_unavailable(self, msg: MetricsUnavailable) -> None:
        try:
            self._show_error(msg)
        except NoMatches:
            pass

    def _show(self, msg: SnapshotUpdated) -> None:
        self.scrapes += 1
        if self.last_error is not None:
            self.notify("connected again")
        self.last_error = None
        self.panel.update_snapshot(msg.snapshot)
        s = msg.snapshot
        plan = f" | {s.plan_phrase}" if s.layer_tiers else ""  # the server exports each layer's tier
        self.query_one(StatusLine).show_text(
            f"{self.url}{plan} | {s.requests_running if s.requests_running is not None else 'n/a'} running"
            f" · {s.requests_waiting if s.requests_waiting is not None else 'n/a'} queued  ·  Ctrl+Q quit"
        )

    def _show_error(self, msg: MetricsUnavailable) -> None:
        if self.last_error is None:
            self.notify(f"cannot read {self.url}/metrics: {msg.error}", severity="error", timeout=8)
        self.last_error = msg.error
        self.query_one(StatusLine).show_text(f"{self.url}: unreachable ({msg.error}); retrying  ·  Ctrl+Q quit")
