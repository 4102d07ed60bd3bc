"""Quantization specs: which weight format a model is loaded in.

A :class:`QuantSpec` is the typed hand-off between the CLI/config layer (which
sees a user string like ``int4:g128``) and the layer factories in
:mod:`llmsys.quant.linear` (which only see the spec). Parsing lives here so
every entry point rejects bad names with the same one-line message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmsys.kernels.common.errors import InvalidParameterError

QuantMethod = Literal["none", "int8", "int4", "nf4", "fp8"]

METHODS: tuple[str, ...] = ("none", "int8", "int4", "nf4", "fp8")
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
VALID_NAMES: tuple[str, ...] = (
    "none", "int8", "int8:g32", "int4", "int4:g32", "int4:g64", "int4:g128", "nf4", "nf4:dq", "fp8",
)
INT8_BLOCK = 32  # int8:g32: a scale per 32 input columns (GGUF Q8_0's layout); plain int8: one per row


@dataclass(frozen=True)
class QuantSpec:
    """How to store linear weights.

    ``group_size`` is the int4 group along K (and the NF4 absmax block size); for int8 only
    32 means anything (``int8:g32``: a scale per 32 columns), any other value one scale per row;
    ``double_quant`` quantizes the NF4 absmax values to 8 bits (QLoRA's
    "double quantization"), saving ~0.37 bits/weight.
    """

    method: QuantMethod = "none"
    group_size: int = 64
    double_quant: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidParameterError(
                f"unknown quantization method {self.method!r}; valid: {', '.join(VALID_NAMES)}"
            )
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise InvalidParameterError(
                f"int4 group size {self.group_size} not supported; use one of "
                f"{', '.join(f'int4:g{g}' for g in INT4_GROUP_SIZES)}"
            )
        if self.double_quant and self.method != "nf4":
            raise InvalidParameterError("double quantization (':dq') only applies to nf4; use 'nf4:dq'")

    @property
    def int8_blocks(self) -> bool:
        """``int8:g32``: int8 with a scale per 32 columns (``quant.Int8BlockLinear``)."""
        return self.method == "int8" and self.group_size == INT8_BLOCK

    @property
    def name(self) -> str:
        """The canonical string form, accepted back by :func:`parse_quant`."""
        if self.int8_blocks:
            return "int8:g32"
        if self.method == "int4":
            return f"int4:g{self.group_size}"
        if self.method == "nf4" and self.double_quant:
            return "nf4:dq"
        return self.method


def parse_quant(text: str | None) -> QuantSpec:
    """Parse ``none``/``int8``/``int4[:gN]``/``nf4[:dq]``/``fp8`` (case-insensitive)."""
    raw = "none" if text is None else str(text).strip().lower()
    if raw in ("", "none", "bf16", "fp16", "fp32", "float"):
        return QuantSpec("none")
    head, _, opt = raw.partition(":")
    bad = InvalidParameterError(
        f"unknown quantization {text!r}; valid: {', '.join(VALID_NAMES)}"
    )
    if head == "int4":
        if not opt:
            return QuantSpec("int4", group_size=64)
        if not (opt.startswith("g") and opt[1:].isdigit()):
            raise bad
        return QuantSpec("int4", group_size=int(opt[1:]))
    if head == "nf4":
        if opt in ("", "dq"):
            return QuantSpec("nf4", group_size=64, double_quant=opt == "dq")
        raise bad
    if head == "int8" and opt == f"g{INT8_BLOCK}":
        return QuantSpec("int8", group_size=INT8_BLOCK)
    if head in ("int8", "fp8") and not opt:
        return QuantSpec(head)  # type: ignore[arg-type]
    raise bad
