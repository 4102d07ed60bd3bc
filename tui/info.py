"""``/info``: what is loaded and where it lives, as text lines for both front ends.

Built from :class:`ModelInfo` (read once at load) and a :class:`TierSnapshot`
(the engine's own memory accounting), so the app can answer from what it
already has without touching the engine core from the UI thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmsys.kernels.common.units import format_bytes
from llmsys.tui.messages import ModelInfo
from llmsys.tui.snapshot import TIER_LABELS, TierSnapshot


def weight_format(path: Any, stored_formats: dict[str, str] | None = None) -> str:
    """Name the checkpoint format from the path the loader read."""
    p = Path(str(path))
    if p.suffix == ".gguf":
        kinds = ", ".join(sorted(stored_formats or {}))
        return f"GGUF ({kinds})" if kinds else "GGUF"
    if p.suffix == ".bin":
        return "llama2.c"
    if p.is_dir():
        return "Hugging Face safetensors" if any(p.glob("*.safetensors")) else "Hugging Face"
    return p.suffix.lstrip(".") or "unknown"


def _per_tier(values: dict[str, int]) -> str:
    return ", ".join(f"{TIER_LABELS.get(t, t)} {format_bytes(n)}" for t, n in values.items() if n) or "none"


def info_rows(info: ModelInfo, snap: TierSnapshot | None) -> list[tuple[str, str]]:
    """(label, value): model, weight format and dtype, placement, context used / max."""
    quant = "" if info.quant in ("none", "") else f", quantized {info.quant}"
    rows = [
        ("model", f"{info.name} ({'chat' if info.is_chat else 'completion'} mode)"),
        ("weights", f"{info.weight_format}, {info.dtype}{quant}, {info.n_layers} layers, on {info.device}"),
    ]
    if snap is None:
        return rows + [("context", f"n/a / {info.max_len} tokens")]
    weights = {t.tier: t.weights for t in snap.tiers}
    kv = ", ".join(f"{TIER_LABELS.get(t.tier, t.tier)} {format_bytes(t.kv_used)} in use, {format_bytes(t.kv_resident)} "
                   f"resident, {format_bytes(t.kv_reserved)} reserved" for t in snap.tiers if t.kv_reserved) or "none"
    rows += [
        ("placement", snap.plan_phrase),
        ("memory", f"{_per_tier({t.tier: t.used for t in snap.tiers})} held · weights {_per_tier(weights)} · "
                   f"KV cache {kv}"),
        ("context", f"{snap.tokens_in_context or 0} / {snap.context_budget or info.max_len} tokens used"),
    ]
    return rows


def info_text(rows: list[tuple[str, str]]) -> str:
    """Aligned columns for a line terminal."""
    return "\n".join(f"{label:<10} {value}" for label, value in rows)


def info_markdown(rows: list[tuple[str, str]]) -> str:
    """A list that wraps to the transcript's width (a code block would be cut off)."""
    return "\n".join(f"- **{label}:** {value}" for label, value in rows)
