"""Automatic prefix caching: a request reuses the KV blocks of a prompt prefix already in the pool.

Each full block gets a key chained from the previous block's key and its token ids (so a key names the
whole prefix, as in vLLM), registered after the pass that filled it (:meth:`BlockAllocator.register`);
a request starts from its longest run of hits. Exact because a shared block is never written again:
at most ``(prompt_len - 1) // block_size`` full blocks hit, so every request computes its last prompt
token and writes only blocks it allocated. Sequences under an evicting KV policy (``seq.kv``) neither
look up nor register; sliding layers' ring blocks hit only while their last window remains
(``RingTables.reuse``). With a disk tier (``engine/kv_disk.py``) every registered block is also written to
a file under its key, and a prompt continues its run of hits from disk past the last block in the pool.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING

from llmsys.engine.kv_cache import BlockAllocator
from llmsys.engine.sequence import Sequence

if TYPE_CHECKING:
    from llmsys.engine.kv_disk import KVDisk
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


def match_prefix(seq: Sequence, allocator: BlockAllocator, block_size: int, ring: RingTables | None = None,
                 disk: KVDisk | None = None) -> int:
    """Give a fresh sequence the cached blocks of its longest known prefix; returns tokens reused.

    Leaves at least one token to compute. Past the pool's hits, ``disk`` reads the next blocks back into
    fresh pool blocks (as many as are free; none with a ring). The caller releases the blocks
    (``allocator.free(seq.block_table)``, and its ring's) if it cannot schedule the sequence.
    """
    if seq.kv is not None or not seq.prefix_reuse or seq.num_computed or seq.block_table:
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
    if disk is not None and ring is None and len(hit) < usable:
        hit += disk.restore(seq.block_keys[len(hit):usable], allocator, allocator.num_free - 2)  # room to go on
    seq.block_table = hit
    seq.num_registered = len(hit)
    seq.num_computed = len(hit) * block_size
    return seq.num_computed


def register_full_blocks(seq: Sequence, allocator: BlockAllocator, block_size: int,
                         ring: RingTables | None = None, disk: KVDisk | None = None) -> None:
    """After a forward pass: register the blocks of ``seq`` that are now full of computed KV (and
    their ring blocks), and hand the pool's ones to ``disk`` to write."""
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
    if disk is not None:
        new = [(b, k) for b, k in zip(seq.block_table[seq.num_registered:full], seq.block_keys[seq.num_registered:full])
               if not allocator.is_cold(b)]
        disk.submit([b for b, _ in new], [k for _, k in new])
    seq.num_registered = full


def forget_blocks(seq: Sequence) -> None:
    """The sequence's block ids changed (preempted, swapped back in): register again later."""
    seq.num_registered = 0
