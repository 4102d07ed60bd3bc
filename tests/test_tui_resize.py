"""A clean screen after resizing, in a real terminal (tmux) and in Textual's Pilot.

tmux keeps its own copy of every cell the app wrote, so ``capture-pane`` shows what a user
sees, stray glyphs included: after a burst of resizes while a reply streams, every box must
be whole at its new place, no line wider than the terminal, the status line last. In Pilot
the screen after a burst must equal a fresh app's at the final size, and one full repaint
follows the burst.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time

import pytest
from conftest import STORIES_HF, need_shared
from test_tui_tmux import _send, _start_chat, _tmux, _wait, needs_tmux

from llmsys.engine.sampling import SamplingParams
from llmsys.tui.app import ChatApp
from llmsys.tui.conversation import Conversation
from llmsys.tui.commands import SlashCommand


def _boxes_whole(screen: str, width: int, height: int) -> None:
    lines = screen.rstrip("\n").split("\n")
    assert len(lines) <= height and all(len(x) <= width for x in lines), screen
    status = next(x for x in reversed(lines) if x.strip())
    assert status.rstrip().endswith("Ctrl+Q quit"), f"the status line is not last: {status!r}\n{screen}"
    # every box: its top corner's columns hold a side on each row down to its bottom corners
    for top, line in enumerate(lines):
        col = 0
        while (left := line.find("╭", col)) >= 0:
            right = line.index("╮", left)
            row = top + 1
            while row < len(lines) and lines[row][left:left + 1] != "╰":
                got = lines[row][left:left + 1], lines[row][right:right + 1]
                assert got == ("│", "│"), f"box at row {top} col {left}-{right} broken on row {row}: {lines[row]!r}\n{screen}"
                row += 1
            assert row < len(lines) and lines[row][right:right + 1] == "╯", f"box at row {top} col {left} not closed\n{screen}"
            col = right + 1


@needs_tmux
def test_resize_burst_while_streaming_leaves_a_clean_screen():
    rng = random.Random(46)
    session = _start_chat(160, 48)
    try:
        _wait(session, lambda s: "| ready" in s, 60, "the model to load")
        _send(session, "Once upon a time")
        for _ in range(12):  # a window being dragged, while the reply streams
            _tmux("resize-window", "-t", session, "-x", str(rng.randint(60, 170)), "-y", str(rng.randint(18, 50)))
            time.sleep(rng.uniform(0.0, 0.08))
        for width, height in ((120, 40), (100, 30)):
            _tmux("resize-window", "-t", session, "-x", str(width), "-y", str(height))
            _wait(session, lambda s: "| ready" in s, 60, "the reply to end")
            time.sleep(0.6)  # the burst's settle time and the last frame
            screen = _tmux("capture-pane", "-p", "-t", session)
            _boxes_whole(screen, width, height)
            assert "╭─ memory" in screen and "╭─ assistant" in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


@pytest.fixture(scope="module")
def llm():
    need_shared(STORIES_HF)
    from llmsys import LLM

    return LLM(str(STORIES_HF), dtype="float32", kv_cache_tokens=512, threads=1, progress=False)


def test_pilot_screen_after_resizes_equals_a_fresh_one(llm, tmp_path):
    conv = Conversation(system=None)
    conv.add("user", "Once upon a time")
    conv.add("assistant", "there was a little girl named Lily. She loved to play outside in the park. " * 4)
    conv.add("user", "Show me a loop")
    conv.add("assistant", "Here:\n\n```python\nfor i in range(3):\n    print(i)\n```\n")
    path = str(conv.save(tmp_path / "c.json"))

    async def screen(sizes: list[tuple[int, int]]) -> tuple[list[str], int]:
        app = ChatApp(lambda: llm, model_name="stories260k-hf", sampling=SamplingParams(temperature=0.0))
        async with app.run_test(size=sizes[0]) as pilot:
            for _ in range(600):
                if app.info is not None:
                    break
                await pilot.pause(0.05)
            await app.run_command(SlashCommand("load", path, (path,)))
            app.clear_notifications()
            await pilot.pause(0.3)
            before = app.full_redraws
            for s in sizes[1:]:
                await pilot.resize_terminal(*s)
            await pilot.pause(0.5)
            text = [strip.text for strip in app.screen._compositor.render_strips()]
            return [line for line in text if "tok/s" not in line and "TTFT" not in line], app.full_redraws - before

    resized, redraws = asyncio.run(screen([(160, 48), (70, 25), (200, 50), (100, 30), (120, 34)]))
    fresh, _ = asyncio.run(screen([(120, 34)]))
    assert resized == fresh
    assert redraws >= 1, "a full repaint follows the resizes"
    _boxes_whole("\n".join(resized), 120, 34)
