"""Sliding-window layers keep only their window of KV: a per-sequence ring of blocks.

A sliding layer (Gemma 2/3's local layers, Phi-3 with a window, gpt-oss's banded layers) attends
only to keys less than ``window`` positions behind each query, so once a sequence is longer than
the window, the rest of its KV in those layers is never read again. Here those layers' K/V live
in a pool of their own (the same :class:`~llmsys.engine.kv_cache.KVPool`, whose ring layers'
tensors have :attr:`SlidingKVSpec.num_blocks` blocks instead of the block tables' count), and a
sequence holds at most ``R`` (:attr:`SlidingKVSpec.ring_blocks`) of its blocks, a ring.

Why a ring addressed by a *virtual* block table: logical block ``i`` of a sequence maps to ring
slot ``i % R``, so the sliding layers' table has the full table's shape and every existing gather
plan, kernel and window mask runs on it unchanged (``engine/attention.py`` picks that table's
metadata for a ring layer, in one place). Positions older than the window alias newer data (or
the scratch block 0), but every path that reads a window masks by position: the windowed gather
plans (``kernels.windowed``: decode rows gather only the last ``window`` positions; prompt chunks
AND the band into their mask), and the CUDA reference attention's ``window``. A masked key gets
probability exactly 0, so the outputs are the bits of the full-KV run.

``R = ceil((window + max chunk) / block_size) + 1``: a step writes up to ``max_num_batched_tokens``
positions of a sequence (speculative drafts included: they count against the same budget) while
its first query reads ``window - 1`` positions before them; those span at most ``R`` blocks, so
no position a step reads is overwritten by the same step. A rejected draft's slot is simply
written again later.

Blocks come from a second :class:`~llmsys.engine.kv_cache.BlockAllocator` (:class:`RingTables`),
lazily (a short sequence holds as many ring blocks as full ones, a long one ``R``), freed with
the sequence. Prefix caching: a ring block that holds a full block's KV is registered under that
block's prefix key, as the full block is; a registered block is never written again (the ring
slot gets a fresh block when it wraps, the old one waits in the allocator's cached list), so a
later prompt that shares the prefix (a chat's next turn) finds both the full layers' blocks and
the ring blocks of the prefix's last window, which is all its queries read. A hit whose window
is no longer in the ring pool is shortened to the longest one whose window is.

What keeps full KV per layer (:func:`plan_sliding_kv`, decided once at engine build; ``auto``
falls back with one log line, ``ring`` refuses with that line): a cold KV tier or an explicit
swap space (both copy one block id across every layer), a window no context reaches past (the
ring would save nothing), and engines whose sequences run outside the scheduler (the speculative
draft model's, perplexity scoring). KV policies other than ``full`` are refused for sliding
models anyway (``DecoderModel.kv_policy_blocker``). With a ring and the default swap space,
a preempted sequence recomputes.
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
    """R: the blocks a step's reads and writes of one sequence span at most (module doc)."""
    return blocks_needed(window + max_chunk, block_size) + 1


def plan_sliding_kv(args: Any, config: EngineConfig, max_len: int, say: bool = False) -> SlidingKVSpec | None:
    """The sliding layers' ring (``num_blocks`` still 0), or None: every layer keeps full KV.

    ``config.sliding_kv``: ``full`` never rings; ``auto`` rings unless something below stands in
    the way, then says why in one log line (``say``: the engine build's call; the estimates before
    it stay quiet); ``ring`` raises that line instead."""
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
