"""Replace a model's ``nn.Linear`` layers by quantized ones, one at a time.

Quantizing layer by layer and dropping each float weight right after its
quantized copy exists bounds peak memory at (quantized model + one float
layer), which is what lets a bf16 checkpoint be quantized at load time on a
machine that could not hold two copies of it.
"""

from __future__ import annotations

import torch
from torch import nn

from llmsys.quant.base import QuantLinear
from llmsys.quant.formats import QuantSpec
from llmsys.quant.int4 import Int4Linear
from llmsys.quant.int8_block import Int8BlockLinear
from llmsys.quant.int8_fp8 import FP8Linear, Int8Linear
from llmsys.quant.nf4 import NF4Linear

LAYER_TYPES: dict[str, type[QuantLinear]] = {
    "int8": Int8Linear,
    "int4": Int4Linear,
    "nf4": NF4Linear,
    "fp8": FP8Linear,
}


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, spec: QuantSpec) -> nn.Module:
    """Quantize one linear weight ``[N, K]`` (+ bias ``[N]``) per ``spec``.

    ``spec.method == "none"`` returns a plain ``nn.Linear`` sharing the tensors.
    """
    if spec.method == "none":
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                        device="meta", dtype=weight.dtype)
        lin.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        return lin
    with torch.no_grad():
        cls = Int8BlockLinear if spec.int8_blocks else LAYER_TYPES[spec.method]
        return cls.from_float(weight.detach(), None if bias is None else bias.detach(), spec)


def _skipped(qualified_name: str, skip: tuple[str, ...]) -> bool:
    """A layer is skipped if any skip entry equals its name or one of its dotted components."""
    parts = qualified_name.split(".")
    return any(s == qualified_name or s in parts for s in skip)


def swap_linears(module: nn.Module, spec: QuantSpec, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Quantize every ``nn.Linear`` under ``module`` in place; returns how many were swapped.

    ``skip`` names layers to keep in float (matched against the full dotted
    name or any component of it, e.g. ``"lm_head"``): the output projection
    is both the most quantization-sensitive layer and often tied to the
    embedding, which must stay float anyway.
    """
    if spec.method == "none":
        return 0
    targets = [
        (name, mod) for name, mod in module.named_modules()
        if isinstance(mod, nn.Linear) and not _skipped(name, skip)
    ]
    count = 0
    for name, lin in targets:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        q = quantize_linear(lin.weight.data, None if lin.bias is None else lin.bias.data, spec)
        setattr(parent, child, q)
        # Drop the float tensors now so the next layer's quantization does not
        # stack on top of this one's float copy (only our reference remained).
        lin.weight = None
        lin.bias = None
        del lin, q
        count += 1
    return count
