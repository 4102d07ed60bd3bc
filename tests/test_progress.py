"""Progress bars of the long steps: drawn on a terminal (with an ETA), silent in a pipe."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys

from conftest import STORIES_HF, need_shared
from llmsys.engine.progress import bar, track


def test_no_bar_off_a_terminal(capsys):
    with bar(10, "work") as b:
        for _ in range(10):
            b.update()
    assert list(track(range(3), "more")) == [0, 1, 2]
    assert capsys.readouterr().err == ""  # pytest's stderr is no TTY: not a byte of bar


def _stderr_through_a_pty(argv: list[str], timeout: float = 600) -> tuple[int, str]:
    """Run ``argv`` with stderr on a pseudo-terminal (as a user's shell gives it); its text and exit code."""
    master, slave = os.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], timeout)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(), b"".join(chunks).decode(errors="replace")


def test_quantize_shows_bars_with_eta(tmp_path):
    need_shared(STORIES_HF)
    rc, err = _stderr_through_a_pty([
        sys.executable, "-m", "llmsys.engine.cli.main", "quantize", str(STORIES_HF), "--quant", "int4",
        "--method", "gptq", "--calib-samples", "40", "--calib-len", "64", "--tune-steps", "30",
        "-o", str(tmp_path / "q"),
    ])
    assert rc == 0, err[-2000:]
    for stage, unit in (("calibration text", "seq"), ("gptq", "layer"), ("refine", "step")):
        # tqdm's line: "<stage>: 100%|####| N/N [elapsed<remaining, rate unit/s]"
        assert re.search(rf"{stage}: 100%\|.*\| (\d+)/\1 \[[0-9:]+<[0-9:]+, *[0-9.]+ ?{unit}s?/s", err), (stage, err[-3000:])
