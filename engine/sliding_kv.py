"""Sliding-window layers keep only their window of KV: a per-sequence ring of blocks.

A sliding layer (Gemma 2/3 local, Phi-3 windowed, gpt-oss banded) never reads KV more than ``window``
positions back, so its K/V live in a ring pool of their own (a :class:`~llmsys.engine.kv_cache.KVPool`
of :attr:`SlidingKVSpec.num_blocks` blocks) and a sequence holds at most ``R`` (:func:`ring_blocks`).
Logical block ``i`` maps to ring slot ``i % R``, so the virtual table has the full table's shape and
every gather plan, kernel and window mask runs unchanged (``engine/attention.py`` picks the table).
Older positions alias newer data, but every window read masks by position (probability exactly 0), so
outputs are the bits of the full-KV run. Ring blocks join prefix caching under the full blocks' keys
(:class:`RingTables`); :func:`plan_sliding_kv` decides at engine build which layers ring.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmsys.engine.kv_cache import BlockAllocator, blocks_needed
from llmsys.kernels.common.errors import InvalidParameterError

if TYPE_CHECKING:
    from llmsys.engine.config import EngineConfig
    from llmsys.engine.sequence import Sequence

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SlidingKVSpec:
    """The ring pool of the sliding layers (see the module doc)."""

    layers: frozenset[int]  # the sliding layers: their K/V live in the ring pool
    window: int  # keys fewer than this many positions behind a query
    ring_blocks: int  # R: blocks one sequence holds at most
    num_blocks: int = 0  # the ring pool's blocks, the scratch block 0 included (size_kv_pool sets it)


@dataclass(frozen=True)
class KVCost:
    """K+V bytes of ``tokens`` tokens of context: the full layers' per token, the ring layers' per
    token up to the ``ring_tokens`` positions all the rings hold together."""

    full: float  # bytes per token of the layers that keep every position
    sliding: float = 0.0  # bytes per token of the ring layers (0: no ring)
    ring_tokens: int = 0

    def nbytes(self, tokens: int) -> int:
        return int(tokens * self.full + min(tokens, self.ring_tokens) * self.sliding)

    def tokens_within(self, budget: int) -> int:
        """The most tokens whose :meth:`nbytes` fit ``budget``; a budget buys more context with a ring."""
        both = self.full + self.sliding
        if self.ring_tokens * both >= budget:
            return int(budget // both)
        if self.full <= 0:
            return 1 << 62  # every layer in rings: the block tables cost no bytes
        return int((budget - self.ring_tokens * self.sliding) // self.full)


def kv_cost(per_layer: float, num_layers: int, sliding: SlidingKVSpec | None, block_size: int,
            max_num_seqs: int) -> KVCost:
    """The :class:`KVCost` of ``num_layers`` layers of ``per_layer`` bytes per token, ``sliding``'s in
    rings (``max_num_seqs`` rings at most); None: every layer per token."""
    if sliding is None:
        return KVCost(per_layer * num_layers)
    n = len(sliding.layers)
    return KVCost(per_layer * (num_layers - n), per_layer * n, sliding.ring_blocks * block_size * max_num_seqs)


def sliding_layers(args: Any) -> frozenset[int]:
    """The layers that attend through a sliding window (``ModelArgs.sliding``)."""
    return frozenset(i for i in range(args.num_hidden_layers) if args.sliding(i))


def ring_blocks(window: int, max_chunk: int, block_size: int) -> int:
    """R = ceil((window + max chunk) / block_size) + 1: the blocks a step's writes of a sequence (drafts
    included) plus the ``window - 1`` positions its first query reads span at most, so no position a
    step reads is overwritten by that step.
    """
    return blocks_needed(window + max_chunk, block_size) + 1


def plan_sliding_kv(args: Any, config: EngineConfig, max_len: int, say: bool = False) -> SlidingKVSpec | None:
    """The sliding layers' ring (``num_blocks`` still 0), or None: every layer keeps full KV.

    ``config.sliding_kv``: ``full`` never rings; ``auto`` rings unless something below stands in
    the way, then says why in one log line (``say``: the engine build's call; the estimates before
    it stay quiet); ``ring`` raises that line instead. A cold KV tier or an explicit swap space
    keeps full KV (both copy one block id across every layer); with a ring and the default swap
    space a preempted sequence recomputes. Engines that run outside the scheduler (the draft model,
    perplexity) pass ``sliding_kv="full"``.
    """
    if config.sliding_kv == "full":
        return None
    layers = sliding_layers(args)
    window = args.sliding_window
    if not layers or window is None or window >= max_len:
        return None  # no layer ever reads less than its whole context
    r = ring_blocks(window, config.max_num_batched_tokens, config.block_size)
    if r * config.block_size >= max_len:
        return None  # a ring would hold the whole context anyway
    why = None
    if config.kv_offload_tokens or config.kv_offload_bytes:
        why = "--kv-offload-tokens (the cold tier moves one block id across every layer)"
    elif config.swap_space:
        why = f"--swap-space {config.swap_space} (the swap space copies one block id across every layer)"
    if why is not None:
        line = f"sliding-window layers keep every position's KV with {why}"
        if config.sliding_kv == "ring":
            raise InvalidParameterError(f"--sliding-kv ring: {line}; drop it or use --sliding-kv auto")
        if say:
            log.info("%s; without it they would keep only their window", line)
        return None
    return SlidingKVSpec(layers, window, r)


class RingTables:
    """The ring pool's allocator and every sequence's ring (``Sequence.ring_blocks`` / ``ring_logical``).

    Plain Python like the block allocator: the scheduler grows, frees and reads rings; the
    runner gets each step's virtual tables (:meth:`table`)."""

    def __init__(self, spec: SlidingKVSpec, block_size: int):
        self.spec = spec
        self.block_size = block_size
        self.allocator = BlockAllocator(spec.num_blocks)

    def table(self, seq: Sequence, n: int) -> list[int]:
        """``seq``'s sliding-layer block table of ``n`` logical blocks: block ``i`` -> ring slot ``i % R``
        (block 0, the scratch block, where the slot holds nothing)."""
        ring = seq.ring_blocks
        if not ring:
            return [0] * n
        r = len(ring)
        return (ring * (n // r + 1))[:n]

    def grow(self, seq: Sequence, start: int, end: int) -> bool:
        """Ring blocks for the positions ``start..end - 1`` a step writes; False: the ring pool is full
        (the sequence keeps what it had). A slot's block is written again in place only when the
        sequence alone holds it and no prefix key names it; else the slot gets a fresh block."""
        if end <= start:
            return True
        bs, r, alloc = self.block_size, self.spec.ring_blocks, self.allocator
        if not seq.ring_blocks:
            seq.ring_blocks = [0] * r
            seq.ring_logical = [-1] * r
        ring, logical = seq.ring_blocks, seq.ring_logical
        need = []
        for j in range(start // bs, (end - 1) // bs + 1):
            s = j % r
            if logical[s] == j:
                continue
            b = ring[s]
            if b and alloc.refs(b) == 1 and not alloc.is_registered(b):
                logical[s] = j  # its older block left the window: overwrite it
                continue
            if b:
                alloc.free([b])  # shared, or a cached prefix's: keep it intact
                ring[s], logical[s] = 0, -1
            need.append((s, j))
        if not alloc.can_allocate(len(need)):
            return False
        for (s, j), b in zip(need, alloc.allocate(len(need))):
            ring[s], logical[s] = b, j
        return True

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s ring (finished or preempted); the newest blocks stay findable longest."""
        held = sorted((i, b) for i, b in zip(seq.ring_logical, seq.ring_blocks) if b)
        self.allocator.free([b for _, b in reversed(held)])
        seq.ring_blocks = []
        seq.ring_logical = []

    def register(self, seq: Sequence, first: int, end: int) -> None:
        """Full blocks ``first..end - 1`` of ``seq`` were just registered under ``seq.block_keys``: their
        ring blocks (each still in its slot: the step that filled it wrote less than a ring) too."""
        ring, logical = seq.ring_blocks, seq.ring_logical
        if not ring:
            return
        r = len(ring)
        for i in range(first, end):
            if logical[i % r] == i:
                self.allocator.register(ring[i % r], seq.block_keys[i])

    def reuse(self, seq: Sequence, hit: int) -> int:
        """A prefix hit of ``hit`` full blocks: give ``seq`` the ring blocks its next queries read (the
        hit's last window) with one reference each; returns the blocks of the hit usable, fewer
        when some of those ring blocks are gone (0: none)."""
        bs, window, alloc = self.block_size, self.spec.window, self.allocator
        n = hit
        while n > 0:
            lo = max(0, n * bs - window + 1) // bs  # the block of the first key position n * bs reads
            got = alloc.lookup(seq.block_keys[lo:n])
            if len(got) == n - lo:
                r = self.spec.ring_blocks
                seq.ring_blocks = [0] * r
                seq.ring_logical = [-1] * r
                for i, b in enumerate(got, start=lo):
                    seq.ring_blocks[i % r], seq.ring_logical[i % r] = b, i
                return n
            alloc.free(got)
            n = lo + len(got)  # the first missing block: a shorter hit does not read it
        return 0

    @property
    def num_used(self) -> int:
        return self.allocator.num_used
