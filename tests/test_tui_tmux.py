"""`llmsys chat` in a real terminal: tmux runs it, send-keys types, capture-pane reads.

Needs the `tmux` binary (CI: `apt-get install -y tmux`); skipped without it.
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


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)")
def test_chat_in_a_real_terminal():
    need_shared(STORIES_C)
    session = f"llmsys-test-{uuid.uuid4().hex[:8]}"
    model = os.path.relpath(STORIES_C, ROOT)  # ../shared/models/stories260k, as a user would type it
    cmd = f"{sys.executable} -m llmsys.engine.cli.main chat {model} --temperature 0 -n 60 --threads 1"
    env = dict(os.environ, TERM=os.environ.get("TERM") or "xterm-256color")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "36", "-c", str(ROOT), cmd],
                   check=True, env=env, timeout=20)
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
