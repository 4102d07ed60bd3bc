"""Where llmsys keeps its files: ``$LLMSYS_HOME``, resolved in this one place.

Downloaded models, compiled C kernels, measured bandwidths and scratch offload
files all live below it; every package asks here so that setting the variable
moves all of them together.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = "~/.cache/llmsys"


def llmsys_home() -> Path:
    """``$LLMSYS_HOME``, or ``~/.cache/llmsys`` when unset or empty (read at every call, never cached)."""
    return Path(os.environ.get("LLMSYS_HOME") or DEFAULT_HOME).expanduser()
