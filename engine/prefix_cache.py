"""Automatic prefix caching: reuse the KV blocks of a prompt prefix seen before.

Chat clients resend the whole conversation every turn, agents resend the same
system prompt, a benchmark repeats its prompts: their KV is already in the
pool, block for block. Each *full* block of a sequence gets a key chained
from the key of the block before it and the block's token ids (so a key names
the whole prefix up to that block, as in vLLM's automatic prefix caching).
After the forward pass that completed a block, the block is registered under
its key (:meth:`BlockAllocator.register`); a new request looks its prompt's
keys up and starts with the longest hit: those blocks join its block table
with one more reference and their tokens count as computed.

Why this is exact: a shared block is never written again. Hits are only full
blocks, at most ``(prompt_len - 1) // block_size`` of them, so every request
still computes at least its last prompt token (the logits it samples from),
and writes only land in blocks it allocated itself. The KV a hit reuses is the
KV the same tokens at the same positions produce, computed by the same model
in the same pool format.

Sequences under an evicting KV policy (``seq.kv`` set) neither look up nor
register: eviction moves tokens between their blocks.

Sliding layers kept in rings (``llmsys.engine.sliding_kv``): their ring blocks
are registered and found under the same keys, and a hit is only as long as the
ring blocks of its last window are still there (``RingTables.reuse``).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING

from llmsys.engine.kv_cache import BlockAllocator
from llmsys.engine.sequence import Sequence

if TYPE_CHECKING:
    from llmsys.engine.sliding_kv import RingTables


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """Key of one full block: the parent block's key + these token ids (16-byte BLAKE2b)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_keys(keys: list[bytes], tokens: list[int], block_size: int, num_blocks: int) -> None:
    """Append the keys of blocks ``len(keys)..num_blocks-1`` of ``tokens`` to ``keys``."""
    for i in range(len(keys), num_blocks):
        keys.append(block_key(keys[-1] if keys else b"", tokens[i * block_size : (i + 1) * block_size]))


def match_prefix(seq: Sequence, allocator: BlockAllocator, block_size: int, ring: RingTables | None = None) -> int:
    """Give a fresh sequence the cached blocks of its longest known prefix; returns tokens reused.

    Leaves at least one token to compute. The caller releases the blocks
    (``allocator.free(seq.block_table)``, and its ring's) if it cannot schedule the sequence.
    """
    if seq.kv is not None or seq.num_computed or seq.block_table:
        return 0
    usable = (seq.num_tokens - 1) // block_size
    if usable == 0:
        return 0
    tokens = seq.tokens
    extend_keys(seq.block_keys, tokens, block_size, usable)
    hit = allocator.lookup(seq.block_keys[:usable])
    if ring is not None and hit:
        n = ring.reuse(seq, len(hit))
        allocator.free(hit[n:])
        hit = hit[:n]
    seq.block_table = hit
    seq.num_registered = len(hit)
    seq.num_computed = len(hit) * block_size
    return seq.num_computed


def register_full_blocks(seq: Sequence, allocator: BlockAllocator, block_size: int,
                         ring: RingTables | None = None) -> None:
    """After a forward pass: register the blocks of ``seq`` that are now full of computed KV (and
    their ring blocks)."""
    if seq.kv is not None:
        return
    full = min(seq.num_computed // block_size, len(seq.block_table))
    if full <= seq.num_registered:
        return
    extend_keys(seq.block_keys, seq.tokens, block_size, full)
    for i in range(seq.num_registered, full):
        allocator.register(seq.block_table[i], seq.block_keys[i])
    if ring is not None:
        ring.register(seq, seq.num_registered, full)
    seq.num_registered = full


def forget_blocks(seq: Sequence) -> None:
    """The sequence's block ids changed (preempted, swapped back in): register again later."""
    seq.num_registered = 0
