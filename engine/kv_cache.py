"""The paged KV cache: a pool of fixed-size blocks plus a block allocator.

A plain pool is one tensor per layer for keys and one for values, laid out as
``[num_blocks, block_size, n_kv_heads, head_dim]`` (the layout the kernels
take); quantized pools (int8, int4) follow the same slots with their own
layouts (:class:`KVPool`, ``llmsys.quant.kv_paged``); a token's *slot* is
``block * block_size + offset``. Sequences own lists of
block ids (their block table); the allocator is plain Python and never touches
tensors, so the scheduler can reason about memory without the model.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmsys import kernels
from llmsys.kernels.common.errors import BudgetError
from llmsys.kernels.common.memory import ON_DEMAND_MIN_BYTES, zeros_on_demand
from llmsys.kernels.common.protocols import KVPool

if TYPE_CHECKING:
    from llmsys.engine.sliding_kv import SlidingKVSpec


PAGE = 4096  # bytes the OS backs at a time (the pool's CPU tensors are backed page by page)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the pool, decided once when the engine starts.

    ``sliding``: the sliding-window layers keep only their window, in per-sequence rings of a
    smaller pool (``engine/sliding_kv.py``): those layers' tensors have ``sliding.num_blocks``
    blocks, every other layer ``num_blocks`` (None: every layer has ``num_blocks``)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's float dtype (the pool's dtype when kv_dtype is "auto")
    kv_dtype: str = "auto"  # "auto" (= dtype), "int8" (kernels' layout) or "int4" (KIVI, llmsys.quant.kv_paged)
    sliding: SlidingKVSpec | None = None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def ring_layers(self) -> frozenset[int]:
        """The layers whose K/V live in the sliding layers' ring pool (empty: none)."""
        return self.sliding.layers if self.sliding is not None else frozenset()

    def layer_blocks(self, layer: int) -> int:
        """Blocks of ``layer``'s tensors: the ring pool's for a ring layer, else ``num_blocks``."""
        return self.sliding.num_blocks if layer in self.ring_layers else self.num_blocks

    @property
    def layer_bytes_per_token(self) -> float:
        """K+V bytes per token of one layer (quantized pools: codes + scales; int4's stats make it fractional)."""
        from llmsys.quant.kv_paged import kv_layer_bytes_per_token

        return kv_layer_bytes_per_token(self.num_kv_heads, self.head_dim, self.dtype, self.kv_dtype, self.block_size)

    @property
    def bytes_per_token(self) -> int:
        """K+V bytes per token of the block tables' pool: every layer but the ring layers."""
        return int(-(-self.layer_bytes_per_token * (self.num_layers - len(self.ring_layers)) // 1))

    @property
    def ring_bytes_per_token(self) -> int:
        """K+V bytes per ring position over the ring layers (0: no ring)."""
        return int(-(-self.layer_bytes_per_token * len(self.ring_layers) // 1))

    @property
    def ring_slots(self) -> int:
        return self.sliding.num_blocks * self.block_size if self.sliding is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes reserved: every block of every layer, written or not."""
        return self.bytes_per_token * self.num_slots + self.ring_bytes_per_token * self.ring_slots

    def resident_nbytes(self, blocks: int, ring_blocks: int = 0, on_demand: bool = True) -> int:
        """Bytes of the pool backed by memory once blocks ``0 .. blocks - 1`` (and ring blocks
        ``0 .. ring_blocks - 1``) may have been written: each layer's K and V tensor up to the last page
        those blocks reach. A tensor allocated plainly (under ``ON_DEMAND_MIN_BYTES``, or
        ``on_demand`` False: a GPU pool) is resident whole. The allocator hands out low ids first
        and reuses freed ones first, so its high-water mark bounds the pages ever touched."""
        per_layer = self.layer_bytes_per_token * self.block_size / 2  # one block of one layer's K (or V)
        out = 0.0
        for layers, n, touched in ((self.num_layers - len(self.ring_layers), self.num_blocks, blocks),
                                   (len(self.ring_layers), self.sliding.num_blocks if self.sliding else 0, ring_blocks)):
            tensor = per_layer * n
            if not on_demand or tensor < ON_DEMAND_MIN_BYTES:
                out += 2 * layers * tensor
            else:
                out += 2 * layers * min(tensor, -(-per_layer * min(touched, n) // PAGE) * PAGE)
        return int(out)


class PlainKVPool:
    """Per-layer K/V tensors ``[num_blocks, block_size, Hk, D]`` in the model's dtype."""

    kind = "plain"
    quantized = False

    def __init__(self, spec: KVCacheSpec, device: torch.device, one_scratch: bool = False):
        """``one_scratch``: every layer index shares one K/V pair (calibration runs the layers one at a
        time over the same batch, so each layer may overwrite the previous one's K/V)."""
        self.spec = spec
        if one_scratch and spec.sliding is not None:
            raise ValueError("one_scratch: every layer shares one K/V pair, so no layer may have a ring pool")
        shapes = [(spec.layer_blocks(i), spec.block_size, spec.num_kv_heads, spec.head_dim)
                  for i in range(1 if one_scratch else spec.num_layers)]
        n = len(shapes)
        # Pages are backed as blocks are first written (kernels.common.memory): RSS follows use.
        self.k = [zeros_on_demand(shape, spec.dtype, device) for shape in shapes] * (spec.num_layers // n)
        self.v = [zeros_on_demand(shape, spec.dtype, device) for shape in shapes] * (spec.num_layers // n)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kernels.kv_store(k, v, self.k[layer], self.v[layer], slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def block_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.k, self.v


def make_kv_pool(spec: KVCacheSpec, device: torch.device) -> KVPool:
    """The pool ``spec.kv_dtype`` asks for: plain tensors, or an int8 / int4 pool (``llmsys.quant.kv_paged``)."""
    if spec.kv_dtype == "auto":
        return PlainKVPool(spec, device)
    from llmsys.quant.kv_paged import Int4KVPool, Int8KVPool

    blocks = [spec.layer_blocks(i) for i in range(spec.num_layers)]  # per layer (ring layers: the ring pool's)
    if spec.kv_dtype == "int8":
        return Int8KVPool(spec.num_layers, blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, device, spec)
    if spec.kv_dtype == "int4":
        return Int4KVPool(spec.num_layers, blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, device,
                          spec.dtype, spec)
    raise ValueError(f"no KV pool for kv_dtype {spec.kv_dtype!r}")


class BlockAllocator:
    """Hands out block ids; counts references; keeps freed prefix blocks findable.

    Block 0 is scratch (padded gathers point at it; it never holds a live token). Shared blocks (prefix
    caching): ``lookup`` adds a reference, ``free`` drops one, the block is free at zero; a registered full
    block then waits, least-recently-freed, findable until ``allocate`` needs it (plain free blocks go first),
    and counts as free. Cold ids ``num_blocks .. num_blocks + num_cold - 1`` (:mod:`llmsys.offload.kv_tier`)
    are never handed out: :meth:`demote` moves a pool block's reference and registration to one and frees the
    pool block; freed registered cold blocks wait in their own list. ``num_free`` / ``num_used``: pool blocks.
    """

    def __init__(self, num_blocks: int, num_cold: int = 0):
        if num_blocks < 2:
            raise BudgetError(f"KV pool needs at least 2 blocks, got {num_blocks}; raise the KV budget")
        self.num_blocks = num_blocks
        self.num_cold = num_cold
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() yields 1, 2, ...
        self._refs = [0] * (num_blocks + num_cold)
        self._hash_of: dict[int, bytes] = {}  # block -> prefix hash of its contents
        self._block_of: dict[bytes, int] = {}  # prefix hash -> block
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, oldest first
        self._cold_free = list(range(num_blocks + num_cold - 1, num_blocks - 1, -1))
        self._cold_cached: OrderedDict[int, None] = OrderedDict()
        self.high_water = 0  # the highest pool block id ever handed out (0: none): its pages and those below it

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks some request references now."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a registered prefix."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    @property
    def num_cold_free(self) -> int:
        return len(self._cold_free) + len(self._cold_cached)

    @property
    def num_cold_used(self) -> int:
        """Cold blocks some request references now."""
        return self.num_cold - self.num_cold_free

    @property
    def num_cold_cached(self) -> int:
        """Free cold blocks that still hold a registered prefix."""
        return len(self._cold_cached)

    def is_cold(self, block: int) -> bool:
        return block >= self.num_blocks

    def refs(self, block: int) -> int:
        return self._refs[block]

    def is_registered(self, block: int) -> bool:
        """Does a prefix key name ``block`` (its contents must stay as they are)?"""
        return block in self._hash_of

    def demote(self, block: int) -> int | None:
        """Move a pool block held by one reference to a cold id (None: the cold tier is full).

        The caller swaps the id in its block table and copies the data; a
        prefix registration follows the data to the cold id.
        """
        if self._refs[block] != 1 or block >= self.num_blocks:
            raise ValueError(f"block {block} cannot be demoted (refs {self._refs[block]})")
        if not self._cold_free and not self._cold_cached:
            return None
        c = self._take(self._cold_free, self._cold_cached)
        self._refs[block] = 0
        key = self._hash_of.pop(block, None)
        if key is not None:
            self._hash_of[c] = key
            self._block_of[key] = c
        self._free.append(block)
        return c

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for new data: never-registered ones first, then the oldest cached."""
        if n > self.num_free:
            raise BudgetError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        return [self._take(self._free, self._cached) for _ in range(n)]

    def _take(self, free: list[int], cached: OrderedDict[int, None]) -> int:
        """One block for new data, with one reference: a plain free one, else the oldest cached (unregistered)."""
        if free:
            b = free.pop()
        else:
            b, _ = cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(b)]
        self._refs[b] = 1
        if self.high_water < b < self.num_blocks:
            self.high_water = b
        return b

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a sequence's table, oldest first)."""
        plain = []
        for b in reversed(blocks):  # the tail of a sequence is the least likely prefix: evicted first
            self._refs[b] -= 1
            if self._refs[b] > 0:
                continue
            if b >= self.num_blocks:
                if b in self._hash_of:
                    self._cold_cached[b] = None
                else:
                    self._cold_free.append(b)
            elif b in self._hash_of:
                self._cached[b] = None
            else:
                plain.append(b)
        self._free.extend(plain)

    # -- prefix caching --------------------------------------------------------
    def register(self, block: int, key: bytes) -> None:
        """Record that ``block`` (full, referenced) holds the prefix ``key``; first writer wins."""
        if key not in self._block_of and block not in self._hash_of:
            self._block_of[key] = block
            self._hash_of[block] = key

    def unregister(self, blocks: set[int]) -> None:
        """These blocks' contents are lost (an offload read failed): no later prompt may find them.
        One already free and waiting in a cached list becomes a plain free block."""
        for b in blocks:
            key = self._hash_of.pop(b, None)
            if key is None:
                continue
            del self._block_of[key]
            cached = self._cold_cached if b >= self.num_blocks else self._cached
            if b in cached:
                del cached[b]
                (self._cold_free if b >= self.num_blocks else self._free).append(b)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Blocks for the longest registered prefix of ``keys``, each with one more reference."""
        out = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            if self._refs[b] == 0:
                del (self._cold_cached if b >= self.num_blocks else self._cached)[b]
            self._refs[b] += 1
            out.append(b)
        return out


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
