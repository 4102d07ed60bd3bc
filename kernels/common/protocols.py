"""Structural types handed across package boundaries.

Why Protocols: the engine builds the paged KV pool (``engine/kv_cache.py``) and
hands it to offload's swap space and KV tier, which must not import the engine.
They name here exactly what they read, and any pool with those attributes fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class PagedKVShape(Protocol):
    """The geometry of a paged KV pool (``engine.kv_cache.KVCacheSpec`` is one)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...  # tokens per block
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...  # the float dtype of a non-quantized pool
    @property
    def kv_dtype(self) -> str: ...  # "auto" (= dtype), "int8" or "int4"


class PagedKVPool(Protocol):
    """What offload reads of the paged KV pool (``engine.kv_cache.KVCache`` is one).

    ``k[i]`` / ``v[i]``: layer ``i``'s keys / values, one float tensor
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer when the pool
    is not quantized (the only pools the swap space and the KV tier accept).
    """

    @property
    def spec(self) -> PagedKVShape: ...
    @property
    def k(self) -> Sequence[torch.Tensor]: ...
    @property
    def v(self) -> Sequence[torch.Tensor]: ...
    @property
    def quantized(self) -> bool: ...
