"""Progress bars for the long steps (loading, calibration, quantization, refinement).

Why one helper: every step that can take more than a few seconds draws the same
kind of bar (tqdm: count, rate, elapsed and ETA), on stderr, and only on a
terminal, so a pipe or a log file gets no carriage-return noise; each command
still prints its one-line stage summaries itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm.auto import tqdm


def bar(total: int, desc: str, enabled: bool = True, unit: str = "it", **kwargs: Any) -> tqdm:
    """A tqdm bar of ``total`` steps; a no-op object off a TTY or when not ``enabled``.

    Use it as a context manager (``with bar(...) as b: b.update()``) so it is
    closed (its line finished) even when the step fails.
    """
    show = enabled and sys.stderr.isatty() and total > 1
    # A terminal that reports no size (a bare pty, some CI consoles) would get a zero-width bar, and tqdm
    # hides bars below a terminal's last row, which a size of 0 rows puts above the first.
    sized = show and _columns() > 0
    size = {"dynamic_ncols": True} if sized else {"ncols": 100, "nrows": 40}
    return tqdm(total=total, desc=desc, unit=unit, disable=not show, file=sys.stderr, leave=True,
                **size, **kwargs)


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


def track(items: Any, desc: str, enabled: bool = True, unit: str = "it") -> Any:
    """Iterate ``items`` (a sized iterable) under a :func:`bar`."""
    items = list(items)
    with bar(len(items), desc, enabled, unit) as b:
        for item in items:
            yield item
            b.update()
