"""`llmsys chat` in a real terminal: tmux runs it, send-keys types, capture-pane reads.

Needs the `tmux` binary (CI: `apt-get install -y tmux`); skipped without it.
Set LLMSYS_TMUX_CAPTURE_DIR to keep the resize test's screens
(tui_capture_160.txt, tui_capture_100.txt) in that folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import STORIES_C, need_shared

ROOT = Path(__file__).resolve().parents[1]


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True, timeout=20).stdout


def _wait(session: str, cond, timeout: float, what: str) -> str:
    t0 = time.monotonic()
    screen = ""
    while time.monotonic() - t0 < timeout:
        screen = _tmux("capture-pane", "-p", "-t", session)
        if cond(screen):
            return screen
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; the screen was:\n{screen}")


def _start_chat(cols: int, rows: int) -> str:
    """A detached tmux session running `llmsys chat` on stories260k; its name."""
    need_shared(STORIES_C)
    session = f"llmsys-test-{uuid.uuid4().hex[:8]}"
    model = os.path.relpath(STORIES_C, ROOT)  # ../shared/models/stories260k, as a user would type it
    cmd = f"{sys.executable} -m llmsys.engine.cli.main chat {model} --temperature 0 -n 60 --threads 1"
    env = dict(os.environ, TERM=os.environ.get("TERM") or "xterm-256color")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", str(cols), "-y", str(rows), "-c", str(ROOT), cmd],
                   check=True, env=env, timeout=20)
    return session


def _send(session: str, text: str) -> None:
    _tmux("send-keys", "-t", session, "-l", text)
    _tmux("send-keys", "-t", session, "Enter")


def _panel_box(screen: str) -> tuple[int, int]:
    """(first column, width) of the memory panel's top border."""
    top = next(line for line in screen.splitlines() if "╭─ memory" in line)
    start = top.index("╭─ memory")
    end = top.index("╮", start)
    return start, end - start + 1


def _keep(name: str, screen: str) -> None:
    folder = os.environ.get("LLMSYS_TMUX_CAPTURE_DIR")
    if folder:
        Path(folder, name).write_text(screen)


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)")


@needs_tmux
def test_chat_in_a_real_terminal():
    session = _start_chat(120, 36)
    try:
        _wait(session, lambda s: "| ready" in s, 60, "the model to load")
        _tmux("send-keys", "-t", session, "-l", "Once upon a time")
        _tmux("send-keys", "-t", session, "Enter")
        screen = _wait(session, lambda s: "Lily" in s and "| ready" in s, 60, "the streamed story")
        assert "there was a little girl named Lily" in screen
        cpu = next(line for line in screen.splitlines() if "CPU  " in line and "│" in line)
        assert "█" in cpu or "▆" in cpu, f"no CPU tier bar drawn: {cpu!r}"
        assert "layers" in screen and "KV blocks  CPU" in screen
        assert "all 5 layers resident on CPU" in screen
        _tmux("send-keys", "-t", session, "C-q")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            if subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode != 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("Ctrl+Q did not quit the app")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


@needs_tmux
def test_chat_reflows_when_the_terminal_shrinks():
    session = _start_chat(160, 48)
    try:
        _wait(session, lambda s: "| ready" in s, 60, "the model to load")
        _send(session, "Once upon a time")
        _wait(session, lambda s: "Lily" in s and "| ready" in s, 60, "the first story")
        _send(session, "Once upon a time")
        _wait(session, lambda s: s.count("╭─ assistant") == 2 and "| ready" in s, 60, "the second story")
        _send(session, "/info")
        wide = _wait(session, lambda s: "tokens used" in s, 20, "the /info notice")
        _keep("tui_capture_160.txt", wide)
        start, width = _panel_box(wide)
        assert (start + width, width) == (160, 46)

        _tmux("resize-window", "-t", session, "-x", "100", "-y", "30")
        narrow = _wait(session, lambda s: len(s.splitlines()) <= 30 and "╭─ memory" in s and _panel_box(s)[1] < 46, 20, "the reflow")
        time.sleep(0.5)  # let the last frame land
        narrow = _tmux("capture-pane", "-p", "-t", session)
        _keep("tui_capture_100.txt", narrow)
        lines = narrow.splitlines()
        assert all(len(line) <= 100 for line in lines)
        start, width = _panel_box(narrow)
        assert (start + width, width) == (100, 34), "the panel narrows and its right border is on screen"
        bottom = next(line for line in reversed(lines) if line.strip() and not line.strip().startswith(("╰", "│")))
        assert bottom.rstrip().endswith("/help · Ctrl+Q quit"), f"the status line is cut: {bottom!r}"
        assert "tokens used" in narrow, "the transcript stays at its end (the /info notice)"
        assert "context    " in narrow and "speed      " in narrow  # the panel's figures still show
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
