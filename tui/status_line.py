"""The bottom line: model, dtype, the weights as stored, device and the plan in one phrase.

It holds a few renderings of the same facts, longest first, and draws the
longest one that fits the terminal's width, so the key hints at its end stay
visible when the terminal is narrowed (a single long line was cut off there).
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.widget import Widget

from llmsys.tui.messages import ModelInfo

KEYS = "  ·  Esc stop · /help · Ctrl+Q quit"
SHORT_KEYS = " · /help · Ctrl+Q quit"


# GGUF tensor types in words: the integer width and whether blocks carry an offset (a minimum)
# besides the scale; k-quants group blocks in super-blocks with quantized scales.
GGUF_TYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
    "Q4_0": "int4", "Q4_1": "int4 + offset", "Q5_0": "int5", "Q5_1": "int5 + offset",
    "Q8_0": "int8", "Q8_1": "int8 + offset",
    "Q2_K": "int2 + offset, k-quant", "Q3_K": "int3, k-quant", "Q4_K": "int4 + offset, k-quant",
    "Q5_K": "int5 + offset, k-quant", "Q6_K": "int6, k-quant", "Q8_K": "int8, k-quant",
    "TQ1_0": "ternary", "TQ2_0": "ternary", "MXFP4": "fp4",
}
_FLOATS = ("F32", "F16", "BF16", "F64")


def stored_weights(stored_formats: dict[str, str] | None, quant: str, dtype: str) -> str:
    """What the weights are kept as, in a few words.

    A GGUF's main tensor type (the most matrices, norms' float types only when nothing else)
    with what it is, e.g. ``Q4_1 (int4 + offset)``, or ``Q5_K (dequantized to bfloat16)`` where
    the loader had no exact layout for it (``stored_formats`` says what each type became); else
    ``--quant``'s format, quantized at load; else the dtype the weights were read as.
    """
    if stored_formats:
        def count(key: str) -> int:
            tail = key.rsplit("(", 1)[-1].rstrip(")")
            return int(tail) if tail.isdigit() else 0

        quantized = [k for k in stored_formats if k.split(" (")[0] not in _FLOATS]
        key = max(quantized or list(stored_formats), key=count)
        name, became = key.split(" (")[0], stored_formats[key]
        if became.startswith("dequantized"):
            return f"{name} ({became})"
        what = GGUF_TYPES.get(name) or ("i-quant" if name.startswith("IQ") else "")
        return f"{name} ({what})" if what else name
    if quant not in ("", "none"):
        return f"{quant} (quantized at load)"
    return dtype


def info_variants(info: ModelInfo, plan: str, state: str) -> tuple[str, ...]:
    """The status in decreasing detail; the key hints are in every one."""
    mode = "chat" if info.is_chat else "completion"
    weights = info.stored_as or (info.quant if info.quant not in ("", "none") else info.dtype)
    return (
        f"{info.name} | {info.dtype} | weights {weights} | {info.device} | {plan} | {mode} | {state}{KEYS}",
        f"{info.name} | weights {weights} | {plan} | {mode} | {state}{KEYS}",
        f"{info.name} | {info.dtype} | {plan} | {mode} | {state}{KEYS}",
        f"{info.name} | {info.dtype} | {mode} | {state}{KEYS}",
        f"{info.name} | {state}{KEYS}",
        f"{state}{SHORT_KEYS}",
    )


class StatusLine(Widget):
    DEFAULT_CSS = "StatusLine { height: 1; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.variants: tuple[str, ...] = ("",)

    def _set(self, *variants: str) -> None:
        self.variants = variants
        self.refresh()

    def show_loading(self, model: str) -> None:
        self._set(f"loading {model} …")

    def show_info(self, info: ModelInfo, plan: str, state: str = "ready") -> None:
        self._set(*info_variants(info, plan, state))

    def show_text(self, text: str) -> None:
        self._set(text)

    @property
    def text(self) -> str:
        """What is drawn at the current width."""
        width = self.content_size.width or cell_len(self.variants[0])
        return next((v for v in self.variants if cell_len(v) <= width), self.variants[-1])

    def render(self) -> Text:
        return Text(self.text, no_wrap=True, overflow="ellipsis")
