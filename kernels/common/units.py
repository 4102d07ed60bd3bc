"""Byte sizes as users write them: the one parser and the one formatter.

``--gpu-mem 6GiB``, ``--swap-space 512MiB``, ``kv_offload_tokens="1GiB"``,
``--max-body 64KiB`` and byte budgets in ``--kv-policy window:64KiB`` are all
read by :func:`parse_size`, so every flag accepts the same spellings: a bare
number is bytes, ``K/M/G/T`` and ``KB/MB/GB/TB`` are powers of 1000, ``KiB`` ..
``TiB`` (and ``Ki`` .. ``Ti``) powers of 1024, case-insensitive.
"""

from __future__ import annotations

import re

from llmsys.kernels.common.errors import InvalidParameterError

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KIB": 1024,
    "KI": 1024,
    "M": 1000**2,
    "MB": 1000**2,
    "MIB": 1024**2,
    "MI": 1024**2,
    "G": 1000**3,
    "GB": 1000**3,
    "GIB": 1024**3,
    "GI": 1024**3,
    "T": 1000**4,
    "TB": 1000**4,
    "TIB": 1024**4,
    "TI": 1024**4,
}


def parse_size(text: str | int | None) -> int | None:
    """Parse '6GiB', '512MiB', '1.5G', or a byte count into bytes (``None`` and ints pass through)."""
    if text is None or isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise InvalidParameterError(
            f"cannot read memory size {text!r}; write it like 6GiB, 512MiB or 1000000"
        )
    unit = (m.group(2) or "").upper()
    if unit not in _UNITS:
        raise InvalidParameterError(f"unknown size unit in {text!r}; use B, KiB, MiB, GiB or TiB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Human-readable bytes with binary units (the units the budgets use)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
