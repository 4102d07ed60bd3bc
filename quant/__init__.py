"""Weight and KV-cache quantization formats (int8, int4, NF4, FP8, AWQ/GPTQ import).

Sits below ``llmsys.engine`` and never imports it (errors, units and paths come
from ``llmsys.kernels.common``). See ``quant/README.md`` for the stored layouts.
"""

from llmsys.quant.base import QuantLinear
from llmsys.quant.formats import QuantSpec, parse_quant
from llmsys.quant.int4 import Int4Linear
from llmsys.quant.int8_block import Int8BlockLinear
from llmsys.quant.int8_fp8 import FP8Linear, Int8Linear
from llmsys.quant.nf4 import NF4Linear
from llmsys.quant.swap import quantize_linear, swap_linears

__all__ = [
    "FP8Linear", "Int4Linear", "Int8BlockLinear", "Int8Linear", "NF4Linear", "QuantLinear", "QuantSpec",
    "parse_quant", "quantize_linear", "swap_linears",
]
