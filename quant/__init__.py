"""Weight and KV-cache quantization formats (int8, int4, NF4, FP8, AWQ/GPTQ import).

Sits below ``llmsys.engine`` and never imports it (errors, units and paths come
from ``llmsys.kernels.common``). See ``quant/README.md`` for the stored layouts.

The names below are imported on first use (PEP 562 ``__getattr__``): ``llmsys.quant.formats`` (the
``--quant`` syntax every CLI command parses) must not bring torch and every layer class with it.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmsys.quant.base import QuantLinear
    from llmsys.quant.formats import QuantSpec, parse_quant
    from llmsys.quant.int4 import Int4Linear
    from llmsys.quant.int8_block import Int8BlockLinear
    from llmsys.quant.int8_fp8 import FP8Linear, Int8Linear
    from llmsys.quant.nf4 import NF4Linear
    from llmsys.quant.swap import quantize_linear, swap_linears

# name -> the module of this package that defines it
_EXPORTS = MappingProxyType({
    "QuantLinear": "base", "QuantSpec": "formats", "parse_quant": "formats", "Int4Linear": "int4",
    "Int8BlockLinear": "int8_block", "FP8Linear": "int8_fp8", "Int8Linear": "int8_fp8", "NF4Linear": "nf4",
    "quantize_linear": "swap", "swap_linears": "swap",
})

__all__ = [
    "FP8Linear", "Int4Linear", "Int8BlockLinear", "Int8Linear", "NF4Linear", "QuantLinear", "QuantSpec",
    "parse_quant", "quantize_linear", "swap_linears",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
