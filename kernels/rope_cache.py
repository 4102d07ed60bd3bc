"""Rotary-embedding cos/sin table, built once per model.

The kernels take a ``[max_pos, head_dim]`` float32 table (first half cos,
second half sin of ``position * inv_freq``) instead of recomputing
trigonometry per token; this module builds it with the same float32
arithmetic as transformers' rope init functions so positions match HF exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_SUPPORTED = ("default", "llama3", "linear", "freq_factors")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 for a rope config.

    ``scaling`` is the HF ``rope_scaling`` / ``rope_parameters`` dict (or None):
    ``rope_type`` (or legacy ``type``) ``default``, ``llama3`` (factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings) or
    ``linear`` (factor), or ``freq_factors`` (``factors``: ``head_dim // 2`` divisors, what
    llama.cpp stores as ``rope_freqs.weight`` in Llama 3 GGUF files instead of the llama3
    parameters). Other types raise ``ValueError``.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"build_rope_cache: head_dim must be a positive even number, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED:
        raise ValueError(
            f"build_rope_cache: rope_type {rope_type!r} is not supported (supported: {_SUPPORTED})"
        )
    if rope_type == "linear":
        # HF divides positions by the factor; dividing inv_freq is the same product.
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling.get("factors") or [], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"build_rope_cache: {factors.numel()} rope frequency factors for head_dim {head_dim}, "
                             f"expected {inv_freq.numel()}")
        return inv_freq / factors
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Line for line transformers' ``_compute_llama3_parameters``."""
    try:
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
    except KeyError as exc:
        raise ValueError(f"build_rope_cache: llama3 rope scaling is missing key {exc}") from None
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def build_rope_cache(
    head_dim: int,
    max_pos: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # [max_pos, head_dim] float32: cos | sin
    """Table for ``rope()``: row p = cat(cos(p * inv_freq), sin(p * inv_freq))."""
    if max_pos <= 0:
        raise ValueError(f"build_rope_cache: max_pos must be positive, got {max_pos}")
    inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [D/2]
    pos = torch.arange(max_pos, dtype=torch.int64).float()  # [max_pos]
    freqs = pos[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
    return cache if device is None else cache.to(device)
