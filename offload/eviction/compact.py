"""Moving K/V inside the paged pool when tokens are evicted.

Positions under an evicting policy are *indices within the cache*
(StreamingLLM): the key at cache index ``i`` carries RoPE for position ``i``.
Keys are stored already rotated (the model's attention is untouched), so when
eviction shifts a key from index ``src`` to ``dst`` it is re-rotated by
``dst - src`` (RoPE is a rotation: ``R(a) R(b) = R(a + b)``). Evicting ``C``
tokens at once costs one gather/rotate/scatter of the surviving tokens per
layer, i.e. ``O(L / C)`` per generated token amortised; rotating every key at
attention time instead would cost ``O(L)`` per token per layer (measured in
``benchmarks/bench_longctx.py``).
"""

from __future__ import annotations

import torch


def rotate_by(
    x: torch.Tensor,  # [M, H, D] keys rotated at their old positions
    delta: torch.Tensor,  # [M] int64 position change (new - old), any sign
    rope_cache: torch.Tensor,  # [max_pos, D] float32 cos | sin
) -> torch.Tensor:  # [M, H, D] keys rotated at old + delta
    return _rotate(x, *_rotation(delta, rope_cache))


def _rotation(delta: torch.Tensor, rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[M, 1, D/2]`` of the angles ``delta`` (shared by every layer's keys)."""
    half = rope_cache.shape[-1] // 2
    rows = rope_cache[delta.abs()]  # [M, D]
    return rows[:, None, :half], rows[:, None, half:] * delta.sign().to(rows.dtype)[:, None, None]  # sin(-a) = -sin(a)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def slots_of(index: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache indices [M] -> flat pool slots [M] through one block table."""
    return block_table[index // block_size] * block_size + index % block_size


def compact_kv(
    k_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, Hk, D]
    v_caches: list[torch.Tensor],
    block_table: list[int],
    block_size: int,
    keep: torch.Tensor,  # [K] int64 sorted cache indices that survive
    rope_cache: torch.Tensor | None,  # None: keys are not rotated (no RoPE re-application)
) -> int:
    """Move kept tokens to cache indices ``0..K-1``; returns tokens moved.

    Tokens already in place (the sinks, or a prefix) are not touched. The
    caller frees the blocks past ``blocks_needed(K)``.
    """
    dst = torch.arange(keep.numel())
    moved = keep != dst
    if not bool(moved.any()):
        return 0
    src, dst = keep[moved], dst[moved]
    device = k_caches[0].device
    table = torch.as_tensor(block_table, dtype=torch.int64)
    s_slots = slots_of(src, table, block_size).to(device)
    d_slots = slots_of(dst, table, block_size).to(device)
    rot = _rotation((dst - src).to(device), rope_cache) if rope_cache is not None else None  # once for all layers
    for k, v in zip(k_caches, v_caches):
        hk, d = k.shape[-2], k.shape[-1]
        kf, vf = k.view(-1, hk, d), v.view(-1, hk, d)
        ks = kf[s_slots]  # [M, Hk, D] copies (src > dst, so no aliasing)
        kf[d_slots] = _rotate(ks, *rot) if rot is not None else ks
        vf[d_slots] = vf[s_slots]
    return int(src.numel())


def ensure_rope_positions(model: torch.nn.Module, n_positions: int) -> None:
    """Grow the model's ``rope_cache`` buffer to cover ``n_positions``.

    Running past the trained context (``full`` on a long stream, Quest on a
    long prompt) needs positions the table was not built for; RoPE itself is
    defined for any position, so the table is simply extended.

    The model builds it (``DecoderModel.ensure_rope_positions``): it knows how many tables it stacks
    (LongRoPE's short and long, Gemma 3's global and local) and how many dims rotate.
    """
    model.ensure_rope_positions(n_positions)
