"""MXFP4 (OCP microscaling FP4), as gpt-oss's released checkpoints store their experts: decoded at load.

A block of 32 weights is 16 bytes of e2m1 codes (two per byte, the low nibble the earlier weight) and
one e8m0 scale byte ``s`` meaning ``2^(s - 127)``; an e2m1 code is a sign bit over the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6. Checkpoints hold ``*_blocks [..., G, 16]`` uint8 and ``*_scales [..., G]``
uint8 for rows of ``G * 32`` weights.

Why decoded, not run natively: llmsys has no FP4 matmul, and every decoded value is a 2-bit mantissa
times a power of two, so bfloat16 holds it exactly; the user's ``--quant`` then applies to the experts as
to any float projection. The decoding equals transformers' ``convert_moe_packed_tensors`` value for value
(tests/test_moe.py).
"""

from __future__ import annotations

import torch

# e2m1 code -> value: codes 0-7 the magnitudes, 8-15 the same negated (-0.0 for code 8).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # weights per scale
SCALE_BIAS = 127  # e8m0: 2^(s - 127)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8, ``scales [..., G]`` uint8 -> ``[..., G * 32]`` weights in ``dtype``.

    Computed in float32 (exact: a code times a power of two) and rounded once, which is exact for
    bfloat16 and float32 alike."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"dequantize_mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"dequantize_mxfp4: blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].reshape(*blocks.shape[:-1], BLOCK)  # [..., G, 32]
    exps = (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)  # [..., G, 1]
    out = torch.ldexp(values, exps)  # [..., G, 32]
    return out.reshape(*blocks.shape[:-2], -1).to(dtype)  # [..., G * 32]
