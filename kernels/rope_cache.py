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

_SUPPORTED = ("default", "llama3", "linear", "freq_factors", "longrope", "yarn")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The RoPE type a ``rope_scaling`` / ``rope_parameters`` dict names (``default`` for None)."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                  long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 for a rope config.

    ``head_dim``: the rotated dimensions (``head_dim * partial_rotary_factor`` where only part of
    each head rotates). ``scaling`` is the HF ``rope_scaling`` / ``rope_parameters`` dict (or None):
    ``rope_type`` (or legacy ``type``) ``default``, ``llama3`` (factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings) or
    ``linear`` (factor), or ``freq_factors`` (``factors``: ``head_dim // 2`` divisors, what
    llama.cpp stores as ``rope_freqs.weight`` in Llama 3 GGUF files instead of the llama3
    parameters), or ``longrope`` (Phi-3: ``short_factor`` / ``long_factor``, ``head_dim // 2``
    divisors each; ``long`` picks the long set), or ``yarn`` (gpt-oss: factor,
    original_max_position_embeddings, optional beta_fast / beta_slow / truncate; its attention factor
    is :func:`rope_attention_factor`'s). Other types raise ``ValueError``.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"build_rope_cache: head_dim must be a positive even number, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind not in _SUPPORTED:
        raise ValueError(
            f"build_rope_cache: rope_type {kind!r} is not supported (supported: {_SUPPORTED})"
        )
    if kind == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling, long)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if kind == "linear":
        # HF divides positions by the factor; dividing inv_freq is the same product.
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":
        factors = torch.tensor(scaling.get("factors") or [], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"build_rope_cache: {factors.numel()} rope frequency factors for head_dim {head_dim}, "
                             f"expected {inv_freq.numel()}")
        return inv_freq / factors
    return inv_freq


def _longrope_inv_freq(dim: int, theta: float, scaling: dict[str, Any], long: bool) -> torch.Tensor:
    """Line for line transformers' ``_compute_longrope_parameters`` (its inverse frequencies)."""
    key = "long_factor" if long else "short_factor"
    ext = scaling.get(key)
    if not isinstance(ext, (list, tuple)) or len(ext) != dim // 2:
        n = len(ext) if isinstance(ext, (list, tuple)) else ext
        raise ValueError(f"build_rope_cache: longrope {key} has {n} entries, expected {dim // 2} (rotary dim {dim} / 2)")
    ext_factors = torch.tensor(ext, dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * theta**inv_freq_shape)


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Line for line transformers' ``_compute_yarn_parameters`` (its inverse frequencies): each pair's
    frequency blends the interpolated ``1 / (factor * theta^(2i/dim))`` and the original one by a ramp
    over the pairs between the correction dims of ``beta_fast`` and ``beta_slow`` rotations in the original
    context (floored / ceiled unless ``truncate`` is false, as gpt-oss's config says)."""
    try:
        factor = float(scaling["factor"])
        orig = scaling["original_max_position_embeddings"]
    except KeyError as exc:
        raise ValueError(f"build_rope_cache: yarn rope scaling is missing key {exc}") from None
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` turns in orig
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim / 2]
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each pair's original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """What transformers multiplies cos and sin by (1 for most types).

    LongRoPE: its ``attention_factor``, by default ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``
    with ``factor`` the configured one or ``max_position_embeddings / original_max_position_embeddings``.
    YaRN: its ``attention_factor``, by default ``0.1 ln(factor) + 1`` (or the ratio of that with ``mscale`` to
    that with ``mscale_all_dim`` when both are given), as ``_compute_yarn_parameters``."""
    kind = rope_type(scaling)
    if kind == "yarn":
        given = scaling.get("attention_factor")
        if given is not None:
            return float(given)
        factor = scaling.get("factor") or max_position_embeddings / scaling["original_max_position_embeddings"]
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
        return _yarn_mscale(factor)
    if kind != "longrope":
        return 1.0
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


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
    long: bool = False,
    attention_factor: float = 1.0,
) -> torch.Tensor:  # [max_pos, head_dim] float32: cos | sin
    """Table for ``rope()``: row p = cat(cos(p * inv_freq), sin(p * inv_freq)), times ``attention_factor``
    (:func:`rope_attention_factor`; transformers scales cos and sin in float32 the same way).

    ``long``: a LongRoPE table's long factors (the model picks the table per sequence, see
    ``engine.models.base.rope_cache``)."""
    if max_pos <= 0:
        raise ValueError(f"build_rope_cache: max_pos must be positive, got {max_pos}")
    inv_freq = rope_inv_freq(head_dim, theta, scaling, long)  # [D/2]
    pos = torch.arange(max_pos, dtype=torch.int64).float()  # [max_pos]
    freqs = pos[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cache = torch.cat([cos, sin], dim=-1).contiguous()
    return cache if device is None else cache.to(device)
