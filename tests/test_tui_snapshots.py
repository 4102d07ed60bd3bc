"""SVG snapshots of the chat screen (fixed size, fixed state), dark and light.

The state is made deterministic: a conversation is loaded (no sampling), the
panel shows a snapshot built from the real engine's accounting with the
machine-dependent figures (CPU budget, speeds) pinned to round placeholder
values (100.0 tok/s, 10 ms): these snapshots pin the layout, not a speed. The
SVG is compared after normalizing Textual's content-hash ids.

Update after an intended UI change:
    LLMSYS_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_tui_snapshots.py

The README's screenshots in docs/img/ are not these: they come from a real run
with measured numbers, `python -m llmsys.tui.screenshot` (llmsys.tui.screenshot).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import STORIES_C, STORIES_HF, need_shared

from llmsys.engine.sampling import SamplingParams
from llmsys.tui.app import ChatApp
from llmsys.tui.commands import SlashCommand
from llmsys.tui.conversation import Conversation
from llmsys.tui.prompt_input import PromptInput

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
SIZE = (120, 34)
UPDATE = os.environ.get("LLMSYS_UPDATE_SNAPSHOTS") == "1"

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)
CODE = "Here is the loop:\n\n```python\nfor step in range(3):\n    print(f\"step {step}\")\n```\n"


@pytest.fixture(scope="module")
def llm():
    need_shared(STORIES_HF)
    from llmsys import LLM

    torch.set_num_threads(1)
    return LLM(str(STORIES_HF), dtype="float32", kv_cache_tokens=512, progress=False)


def normalize(svg: str) -> str:
    svg = re.sub(r"terminal-\d+", "terminal", svg)
    svg = re.sub(r"<title>.*?</title>", "<title/>", svg)
    return svg


def pinned(snap):
    tiers = tuple(dataclasses.replace(t, budget=64 << 20) if t.tier == "cpu" else t for t in snap.tiers)
    return dataclasses.replace(
        snap, tiers=tiers, tokens_in_context=63, tok_s=100.0, ttft_s=0.010,
        tok_s_history=(80.0, 90.0, 95.0, 85.0, 100.0, 100.0, 95.0, 100.0),  # placeholders, not measurements
    )


async def fixed_screen(llm, theme: str, tmp_path: Path) -> str:
    conv = Conversation(system=None)
    conv.add("user", "Once upon a time")
    conv.add("assistant", STORY.removeprefix("Once upon a time"))
    conv.add("user", "Show me a loop")
    conv.add("assistant", CODE)
    path = conv.save(tmp_path / f"{theme}.json")
    app = ChatApp(lambda: llm, model_name="stories260k-hf", sampling=SamplingParams(temperature=0.0), theme=theme)
    async with app.run_test(size=SIZE) as pilot:
        t = 0
        while app.info is None and t < 600:
            await pilot.pause(0.05)
            t += 1
        await app.run_command(SlashCommand("load", str(path), (str(path),)))
        app.panel.update_snapshot(pinned(app.panel.snapshot))
        app._show_status("ready")
        app.clear_notifications()
        box = app.query_one(PromptInput)
        box.cursor_blink = False
        box.text = "Tell me another story"
        await pilot.pause(0.2)
        return app.export_screenshot()


@pytest.mark.parametrize("theme", ["textual-dark", "textual-light"])
def test_main_screen_snapshot(llm, theme, tmp_path):
    svg = asyncio.run(fixed_screen(llm, theme, tmp_path))
    name = f"chat_{theme.split('-')[-1]}.svg"
    expected = SNAPSHOTS / name
    if UPDATE or not expected.exists():
        SNAPSHOTS.mkdir(exist_ok=True)
        expected.write_text(svg)
        if not UPDATE:
            pytest.skip(f"wrote the first snapshot {expected}; commit it")
    actual = tmp_path / name
    actual.write_text(svg)
    assert normalize(svg) == normalize(expected.read_text()), (
        f"the {theme} screen changed: compare {actual} with {expected}; "
        "if intended, rerun with LLMSYS_UPDATE_SNAPSHOTS=1"
    )
    # the things the snapshot is about are really on screen
    for text in ("Lily", "memory", "KV blocks", "all 5 layers resident on CPU", "float32"):
        assert text in svg.replace("&#160;", " ")


def test_readme_screenshot_numbers_are_the_measured_ones(tmp_path, monkeypatch):
    """The README's screenshot comes from a real run: the speed and TTFT in its
    caption are the ones the panel shows in the SVG (a short run here)."""
    need_shared(STORIES_C)
    from llmsys.tui import screenshot

    torch.set_num_threads(1)
    shot = asyncio.run(screenshot.capture(STORIES_C, "Once upon a time", SIZE, max_tokens=40, threads=1))
    assert shot.tok_s is not None and shot.tok_s > 0 and shot.ttft_s is not None
    dark = shot.svgs["textual-dark"].replace("&#160;", " ")
    assert f"{shot.tok_s:.1f} tok/s" in dark and f"TTFT {shot.ttft_s * 1000:.0f} ms" in dark
    assert "Lily" in dark  # the real reply is on screen
    assert f"{shot.tok_s:.1f} tok/s" in shot.caption and screenshot.cpu_model() in shot.caption
    assert "1 thread" in shot.caption
    paths = screenshot.write(shot, tmp_path)
    assert sorted(p.name for p in paths) == ["chat_caption.txt", "chat_dark.svg", "chat_light.svg"]
