"""KIVI-style KV-cache quantization (int8 / int4), one cache block at a time (Liu et al., 2024).

Keys have fixed outlier channels, so they are quantized per channel over a block's tokens; values per
token (optionally in groups along head_dim); both asymmetric, ``x = q * scale + minimum``. Per-channel
stats need a full block, so quantize a block once full and keep the tail in float. For ``x [..., T, H, D]``:
``data`` uint8 ``[..., T, H, D]`` (bits=8) or ``[..., T, H, D/2]`` (bits=4, d = 2j low nibble, 2j+1 high);
key ``scale``/``minimum`` fp16 ``[..., 1, H, D]``; value ones fp16 ``[..., T, H, D/group_size]`` (default
one per token and head). Every element is within ``0.5 * scale`` (``scale = (max - min) / (2**bits - 1)``)
plus fp16 rounding of the stats (< 0.1% of the group range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llmsys.kernels.common.errors import InvalidParameterError

KVKind = Literal["key", "value"]


@dataclass(frozen=True)
class QuantizedKVBlock:
    """A quantized K or V block; see the module docstring for the layouts."""

    data: torch.Tensor  # uint8 [..., T, H, D] (8-bit) or [..., T, H, D/2] (4-bit)
    scale: torch.Tensor  # fp16, keys [..., 1, H, D], values [..., T, H, D/group]
    minimum: torch.Tensor  # fp16, same shape as scale
    bits: int
    kind: KVKind
    head_dim: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.minimum))


def _check(bits: int, kind: str, head_dim: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise InvalidParameterError(f"KV-cache bits must be 4 or 8, got {bits}")
    if kind not in ("key", "value"):
        raise InvalidParameterError(f"KV kind must be 'key' or 'value', got {kind!r}")
    if head_dim % group_size or (bits == 4 and head_dim % 2):
        raise InvalidParameterError(
            f"head_dim {head_dim} must be a multiple of the value group size {group_size} (and even for 4-bit)"
        )


def quantize_kv_block(x: torch.Tensor, kind: KVKind, bits: int = 8,
                      group_size: int | None = None) -> QuantizedKVBlock:
    """Quantize ``x [..., T, H, D]``: keys per channel over T, values per token."""
    d = x.shape[-1]
    g = group_size or d
    _check(bits, kind, d, g)
    levels = 2**bits - 1
    xf = x.float()
    if kind == "key":
        lo = xf.amin(dim=-3, keepdim=True)  # [..., 1, H, D]
        hi = xf.amax(dim=-3, keepdim=True)
        grouped = xf
    else:
        grouped = xf.unflatten(-1, (d // g, g))  # [..., T, H, D/g, g]
        lo = grouped.amin(dim=-1)  # [..., T, H, D/g]
        hi = grouped.amax(dim=-1)
    scale = ((hi - lo) / levels).clamp_min(1e-6).to(torch.float16)
    minimum = lo.to(torch.float16)
    s, m = scale.float(), minimum.float()
    if kind == "value":
        s, m = s[..., None], m[..., None]
    q = torch.round((grouped - m) / s).clamp_(0, levels).to(torch.uint8)
    q = q.reshape(x.shape)  # [..., T, H, D]
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)  # [..., T, H, D/2]
    return QuantizedKVBlock(q.contiguous(), scale, minimum, bits, kind, d)


def dequantize_kv_block(block: QuantizedKVBlock, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_block` -> ``[..., T, H, D]`` in ``dtype``."""
    q = block.data
    if block.bits == 4:
        q = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)  # [..., T, H, D]
    qf = q.float()
    s, m = block.scale.float(), block.minimum.float()
    if block.kind == "key":
        return (qf * s + m).to(dtype)
    n_groups = s.shape[-1]
    out = qf.unflatten(-1, (n_groups, block.head_dim // n_groups)) * s[..., None] + m[..., None]
    return out.flatten(-2).to(dtype)


def kv_bytes_per_token(n_kv_heads: int, head_dim: int, bits: int, block_size: int,
                       value_group_size: int | None = None) -> float:
    """Average bytes per token per layer for K+V (for memory budgeting)."""
    g = value_group_size or head_dim
    data = 2 * n_kv_heads * head_dim * bits / 8
    key_stats = 2 * 2 * n_kv_heads * head_dim / block_size  # fp16 scale+min per channel per block
    value_stats = 2 * 2 * n_kv_heads * (head_dim // g)  # fp16 scale+min per token group
    return data + key_stats + value_stats
