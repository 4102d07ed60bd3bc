"""The README's screenshot, taken from a real run of ``llmsys chat``.

``tests/test_tui_snapshots.py`` pins the layout with fixed, made-up speeds (a
layout test must not depend on the machine); a picture in the README must not
show made-up numbers. This runs the real :class:`ChatApp` on a real model
through Textual's Pilot, sends one prompt, waits for the reply and saves what
the screen then shows, with the speed and TTFT it measured, plus a caption that
names the machine. Run it once after a UI change:

    python -m llmsys.tui.screenshot            # writes docs/img/chat_{dark,light}.svg
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from llmsys.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260k"
THEMES = ("textual-dark", "textual-light")


@dataclass(frozen=True)
class Screenshot:
    svgs: dict[str, str]  # theme -> SVG
    tok_s: float | None  # what the panel showed: the reply's decode speed
    ttft_s: float | None
    caption: str


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def caption(model: str, tok_s: float | None, ttft_s: float | None, threads: int) -> str:
    speed = f"{tok_s:.1f} tok/s" if tok_s is not None else "n/a tok/s"
    ttft = f"{ttft_s * 1000:.0f} ms" if ttft_s is not None else "n/a"
    unit = "thread" if threads == 1 else "threads"
    return (f"Screenshot of a real `llmsys chat {model}` run on {cpu_model()} ({threads} {unit}): "
            f"the {speed} and {ttft} TTFT on screen were measured in that run.")


async def capture(model: Path, prompt: str, size: tuple[int, int], max_tokens: int, threads: int, timeout_s: float = 120.0) -> Screenshot:
    from llmsys.engine.llm import LLM
    from llmsys.tui.app import ChatApp
    from llmsys.tui.prompt_input import PromptInput

    def load():
        return LLM(str(model), threads=threads, progress=False)

    app = ChatApp(load, model_name=model.name, sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens), refresh_hz=8, theme=THEMES[0])
    async with app.run_test(size=size) as pilot:
        t0 = time.monotonic()
        while app.info is None:
            if app.load_error or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the model did not load: {app.load_error or 'timed out'}")
            await pilot.pause(0.05)
        box = app.query_one(PromptInput)
        box.text = prompt
        await pilot.press("enter")
        await pilot.pause(0.05)
        while app.generating is not None:
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError("the reply did not finish in time")
            await pilot.pause(0.05)
        await pilot.pause(0.5)  # the final snapshot and the reply's last rendering
        app.clear_notifications()
        box.cursor_blink = False
        svgs = {}
        for theme in THEMES:
            app.theme = theme
            await pilot.pause(0.2)
            svgs[theme] = app.export_screenshot(title=f"llmsys chat {model.name}")
        snap = app.panel.snapshot
        tok_s, ttft_s = (snap.tok_s, snap.ttft_s) if snap is not None else (None, None)
    return Screenshot(svgs, tok_s, ttft_s, caption(model.name, tok_s, ttft_s, threads))


def write(shot: Screenshot, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for theme, svg in shot.svgs.items():
        p = out_dir / f"chat_{theme.split('-')[-1]}.svg"
        p.write_text(svg)
        paths.append(p)
    p = out_dir / "chat_caption.txt"
    p.write_text(shot.caption + "\n")
    return paths + [p]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model to run (default: the shared stories260k)")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", default="120x34", help="terminal COLSxROWS")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    a = ap.parse_args(argv)
    try:
        cols, rows = (int(x) for x in a.size.lower().split("x"))
    except ValueError:
        ap.error(f"--size needs COLSxROWS, e.g. 120x34, got {a.size!r}")
    if not a.model.exists():
        ap.error(f"no model at {a.model}; pass --model PATH")
    try:
        shot = asyncio.run(capture(a.model, a.prompt, (cols, rows), a.max_tokens, a.threads))
    except RuntimeError as e:
        print(f"error: {e}")
        return 1
    for p in write(shot, a.out):
        print(f"wrote {p}")
    print(shot.caption)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
