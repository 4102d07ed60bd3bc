"""The paged KV cache: a pool of fixed-size blocks plus a block allocator.

The pool is one tensor per layer for keys and one for values, laid out as
``[num_blocks, block_size, n_kv_heads, head_dim]`` (the layout the kernels
take); a token's *slot* is ``block * block_size + offset``. Sequences own lists of
block ids (their block table); the allocator is plain Python and never touches
tensors, so the scheduler can reason about memory without the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmsys.engine.errors import BudgetError


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the pool, decided once when the engine starts."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's float dtype (the pool's dtype when kv_dtype is "auto")
    kv_dtype: str = "auto"  # "auto" (= dtype), "int8" (kernels' layout) or "int4" (KIVI, llmsys.quant.kv_paged)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """K+V bytes per token over all layers (quantized pools: codes + scales)."""
        n = self.num_layers * self.num_kv_heads
        if self.kv_dtype == "int8":
            return 2 * n * (self.head_dim + 4)  # int8 codes + one f32 scale per (token, head)
        if self.kv_dtype == "int4":
            from llmsys.quant.kv_paged import int4_bytes_per_token

            per = int4_bytes_per_token(self.num_kv_heads, self.head_dim, self.block_size)
            return int(-(-per * self.num_layers // 1))
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * n * self.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.num_slots


class KVCache:
    """Per-layer K/V tensors of the pool (the only tensors the cache owns)."""

    def __init__(self, spec: KVCacheSpec, device: torch.device):
        self.spec = spec
        shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        if spec.kv_dtype in ("int8", "int4"):
            # Quantized pools: per layer a K and a V "side" object (store/gather/nbytes),
            # see llmsys.quant.kv_paged; engine.attention dispatches on them.
            from llmsys.quant.kv_paged import kv_sides

            sides = [kv_sides(spec.kv_dtype, *shape, device, spec.dtype) for _ in range(spec.num_layers)]
            self.k = [kv for kv, _ in sides]
            self.v = [vv for _, vv in sides]
            return
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    @property
    def quantized(self) -> bool:
        return self.spec.kv_dtype in ("int8", "int4")

    def nbytes(self) -> int:
        """Bytes the pool holds now (int4 includes its full-precision open-block window)."""
        if not self.quantized:
            return sum(t.numel() * t.element_size() for t in self.k + self.v)
        return sum(s.nbytes() for s in self.k + self.v)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


class BlockAllocator:
    """Hands out block ids from a free list; returns them when sequences end.

    Block 0 is reserved as a scratch block: padded gather indices point at it,
    so it must never hold a live token.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise BudgetError(f"KV pool needs at least 2 blocks, got {num_blocks}; raise the KV budget")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() yields 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise BudgetError(f"KV pool exhausted: need {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
