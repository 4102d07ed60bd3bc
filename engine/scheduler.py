"""Continuous batching with chunked prefill over a paged KV pool; the scheduler decides, the runner copies.

Each step: running decodes first (one token each, steady latency), then prompt chunks up to the token
budget. Out of blocks, the newest running sequence is preempted: swapped out (``offload/kv_swap.py``) or
dropped and re-prefilled, whichever is estimated cheaper (``SchedulerOutput.swap_out``/``swap_in``). With
a cold KV tier, full blocks of running sequences are demoted first (``SchedulerOutput.demote``; never the
open block, a shared one or an evicting sequence's) and new tokens always land in hot blocks. Offload
I/O failures cost speed, not requests; a request that can never fit ends with ``"error"``
(``SchedulerOutput.failed``); unreadable blocks re-queue their holders (:meth:`Scheduler.drop_unreadable`)
and a step that raises otherwise isolates its sequences (:meth:`Scheduler.isolate`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmsys.engine.kv_cache import BlockAllocator, blocks_needed
from llmsys.engine.prefix_cache import forget_blocks, match_prefix, register_full_blocks
from llmsys.engine.sequence import SeqChunk, Sequence, SeqStatus

if TYPE_CHECKING:
    import torch

    from llmsys.engine.attention import AttentionMetadata
    from llmsys.engine.kv_disk import KVDisk
    from llmsys.engine.sliding_kv import RingTables
    from llmsys.offload.eviction.policy import KVPolicy
    from llmsys.offload.kv_policy import PolicyRuntime
    from llmsys.offload.kv_swap import KVSwapSpace
    from llmsys.offload.kv_tier import KVTier


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step, as plain data (ids and counts, no live objects).

    The step feeds ``token_ids`` (the sequence's tokens from stream index
    ``start``) at cache positions ``position..``; ``block_table`` covers
    ``position + len(token_ids)`` tokens. Nothing here changes when the step
    runs: :meth:`Scheduler.update_from_output` applies its effects.
    """

    request_id: str
    token_ids: list[int]
    start: int  # stream index of the first fed token (the sequence's num_computed)
    position: int  # cache index of the first fed token (== start unless a policy evicted)
    block_table: list[int]
    is_prompt: bool  # the fed tokens start inside the prompt (the CPU plan gives them prefill attention)
    samples: bool  # the step reaches the end of the known tokens: the runner returns logits for its last
    kv_policy: KVPolicy | None = None  # the sequence's evicting policy (its attention may record scores)
    # Its context once every known token is in (a prompt chunk's: the whole prompt's); None: this step's.
    length: int | None = None
    # Speculative decoding: the last ``num_draft`` fed tokens are proposed, not known; the runner
    # returns logits for each of the last ``num_draft + 1`` rows (the verification) and the core
    # keeps the KV of the drafts it accepts (:meth:`Scheduler.accept_draft`).
    num_draft: int = 0
    # The sliding layers' table (llmsys.engine.sliding_kv: logical block i -> ring slot i % R), as long as
    # ``block_table``; None: the engine keeps every layer's KV in the block tables.
    ring_table: list[int] | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """A step as data: what to run and which KV blocks to copy first (in this order: swap-outs,
    demotions, swap-ins; a block freed by the first two may be a swap-in's target)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids sent back to waiting this step
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (pool block, swap block), copied first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap block, pool block)
    demote: list[tuple[int, int]] = field(default_factory=list)  # (pool block, cold block), copied in order
    # (request id, one-line reason) of requests finished with finish_reason "error" this step
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        """Nothing to run (requests failed this step still need their final chunks)."""
        return not self.scheduled


@dataclass(frozen=True)
class StepResult:
    """What the runner computed for a :class:`SchedulerOutput`."""

    logits: torch.Tensor  # [R, V] float32: the last fed token of each sampling sequence (+ its draft rows)
    sample_ids: list[str]  # request ids of the sampling sequences, in order
    meta: AttentionMetadata | None = None  # the step's attention metadata (a KV policy reads the scores its attention recorded)
    # Logits rows of each sampling sequence (1 + its drafts), in sample_ids order; None: one row each.
    sample_rows: list[int] | None = None
    # Embedding requests (llmsys.engine.embedding): request id -> the final norm's rows [n, hidden] (float32)
    # of the tokens the step fed it; they sample nothing.
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)


def _scheduled(seq: Sequence, n: int, draft: list[int], ring: RingTables | None) -> ScheduledSeq:
    """``n`` fed tokens, the last ``len(draft)`` of them the proposed ``draft``."""
    start = seq.num_computed
    return ScheduledSeq(
        request_id=seq.request_id,
        token_ids=seq.tokens[start : start + n - len(draft)] + draft,
        start=start,
        position=seq.kv_len,
        block_table=list(seq.block_table),
        is_prompt=start < len(seq.prompt_ids),
        samples=start + n - len(draft) == seq.num_tokens,
        kv_policy=seq.kv.policy if seq.kv is not None else None,
        length=seq.kv_len + seq.num_tokens - start + len(draft),
        num_draft=len(draft),
        ring_table=ring.table(seq, len(seq.block_table)) if ring is not None else None,
    )


class Scheduler:
    """Owns every sequence's state: what runs each step (:meth:`schedule`, data out) and what a
    step changed (:meth:`update_from_output`, :meth:`append_tokens`, :meth:`finish`).

    ``kv_policy`` caps a policy sequence's (``seq.kv`` set) chunk and evicts
    before its block table grows; ``swap`` holds preempted sequences' KV (None:
    recompute only); ``tier`` is the cold KV tier whose blocks are the
    allocator's cold ids (None: every block is in the pool); ``ring`` holds the sliding layers'
    per-sequence rings (None: every layer's KV is in the block tables), grown and freed with
    the block tables.
    """

    def __init__(
        self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
        prefix_caching: bool = False, kv_policy: PolicyRuntime | None = None, swap: KVSwapSpace | None = None,
        tier: KVTier | None = None, ring: RingTables | None = None, kv_disk: KVDisk | None = None,
    ):
        self.allocator = allocator
        self.prefix_caching = prefix_caching  # reuse registered prompt-prefix blocks (llmsys.engine.prefix_cache)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.kv_policy = kv_policy
        self.swap = swap
        self.tier = tier
        self.ring = ring
        self.kv_disk = kv_disk  # the prefix cache's disk tier (llmsys.engine.kv_disk), None: RAM only
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence by request id
        self._swapped_in: set[int] = set()  # id() of sequences whose blocks are copied in this step
        # Request ids of a batched step that raised (:meth:`isolate`): they run one per step, nothing
        # else beside them, until each has run a step alone, so a fault fails only its own request.
        self._suspects: set[str] = set()

    # -- queue management -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and return its blocks to the pool at once."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_blocks(seq)
        if seq.swapped_blocks:
            self.swap.release(seq.swapped_blocks)
            seq.swapped_blocks = []

    def _release_blocks(self, seq: Sequence) -> None:
        """Its block table and ring go back to their pools."""
        self.allocator.free(seq.block_table)
        seq.block_table = []
        if self.ring is not None:
            self.ring.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step decision ------------------------------------------------
    def _grow(self, seq: Sequence, upto_tokens: int, out: SchedulerOutput) -> bool:
        need = blocks_needed(upto_tokens, self.block_size) - len(seq.block_table)
        if need > 0 and not self.allocator.can_allocate(need) and self._tier_takes_blocks():
            self._demote(need - self.allocator.num_free, seq, out)
        if need > 0:
            if not self.allocator.can_allocate(need):
                return False
            seq.block_table.extend(self.allocator.allocate(need))
        # The ring's blocks for the positions this step writes (a full ring pool: preempt, as above).
        return self.ring is None or self.ring.grow(seq, seq.kv_len, upto_tokens)

    def _demote(self, n: int, growing: Sequence, out: SchedulerOutput) -> None:
        """Move up to ``n`` hot blocks of running sequences (and ``growing``) to the cold tier.

        Candidates: blocks full of computed KV (so never the open block new
        tokens go to), held by one reference, of sequences without an evicting
        policy (their compaction moves tokens between blocks) whose blocks are
        not being copied in this step. Oldest positions first, older sequences
        first on a tie.
        """
        alloc, bs = self.allocator, self.block_size
        seqs = self.running if growing in self.running else [*self.running, growing]
        cands = []
        for s in seqs:
            if s.kv is not None or id(s) in self._swapped_in:
                continue
            table = s.block_table
            for i in range(min(s.num_computed // bs, len(table))):
                b = table[i]
                if not alloc.is_cold(b) and alloc.refs(b) == 1:
                    cands.append((i, s.arrival, s))
        cands.sort(key=lambda c: (c[0], c[1]))
        for i, _, s in cands[:n]:
            hot = s.block_table[i]
            cold = alloc.demote(hot)
            if cold is None:
                break
            s.block_table[i] = cold
            out.demote.append((hot, cold))

    def _hot_room(self, seq: Sequence) -> int:
        """New tokens of ``seq`` the hot pool can take in one step (its open block + every other block)."""
        return (self.allocator.num_blocks - 1) * self.block_size - seq.kv_len % self.block_size

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        keep = blocks_needed(seq.num_computed, self.block_size)  # blocks holding computed tokens
        swap = self.swap
        # Policy sequences (seq.kv) carry eviction state beside the blocks, and the swap space copies
        # pool blocks only (a sequence holding cold blocks is longer than the hot pool): they recompute.
        can_swap = swap is not None and seq.kv is None and not any(self.allocator.is_cold(b) for b in seq.block_table)
        ids = swap.allocate(keep) if can_swap and swap.prefer_swap(keep, seq.num_computed) else None
        if ids is not None:
            out.swap_out.extend(zip(seq.block_table[:keep], ids))
            seq.swapped_blocks = ids
            swap.stats.swap_outs += 1
        else:
            self._forget_computed(seq)
            if swap is not None:
                swap.stats.recomputes += 1
        self._requeue(seq)
        out.preempted.append(seq.request_id)

    @staticmethod
    def _forget_computed(seq: Sequence) -> None:
        """Its KV is dropped: every token is computed again when it runs (recompute)."""
        seq.num_computed = 0
        if seq.kv is not None:
            seq.kv.reset()

    def _requeue(self, seq: Sequence) -> None:
        """Back to the head of the queue without its blocks (taken off ``running`` by the caller)."""
        self._release_blocks(seq)
        forget_blocks(seq)
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def drop_unreadable(self, blocks: tuple[int, ...]) -> list[str]:
        """KV blocks could not be read back (``KVReadError`` from a swap-in or the cold tier) and the
        step that needed them did not run. Every running sequence holding one drops its KV and is
        re-prefilled (the same tokens, as after a recompute preemption); the blocks leave the prefix
        cache. Returns those sequences' request ids; the others simply run the step again."""
        lost = set(blocks)
        self.allocator.unregister(lost)
        hit = [s for s in self.running if not lost.isdisjoint(s.block_table)]
        for seq in sorted(hit, key=lambda s: s.arrival, reverse=True):  # the oldest ends up first in line
            self.running.remove(seq)
            self._forget_computed(seq)
            self._requeue(seq)
        return [s.request_id for s in hit]

    def _recompute_unswapped(self, seq: Sequence) -> None:
        """Its swap-out could not be written (offload.kv_swap): re-prefill it instead of copying back."""
        self.swap.release(seq.swapped_blocks)
        seq.swapped_blocks = []
        seq.num_computed = 0
        self.swap.stats.lost_swap_outs += 1

    def _tier_takes_blocks(self) -> bool:
        """A cold tier that still takes demotions (``KVTier.accepts_demotions``: False once a write failed)."""
        return self.tier is not None and self.tier.accepts_demotions

    def _outgrew_hot_pool(self, seq: Sequence) -> bool:
        """The cold tier stopped taking blocks (a write failed) and ``seq`` holds more tokens than the
        hot pool: admitted, it would fill the pool, preempt itself and come back, forever."""
        if self.tier is None or self._tier_takes_blocks():
            return False
        return blocks_needed(seq.num_tokens, self.block_size) > self.allocator.num_blocks - 1

    def _fail_unfit(self, seq: Sequence, out: SchedulerOutput) -> None:
        """``seq`` cannot get its blocks, and never will (nothing runs that could free them, or see
        :meth:`_outgrew_hot_pool`). Finish it with an error, its request alone, rather than leave
        it and every request behind it waiting forever."""
        hot = (self.allocator.num_blocks - 1) * self.block_size
        why = f"its KV ({seq.num_tokens} tokens) does not fit the {hot}-token KV pool"
        tier = self.tier
        if tier is not None and not self._tier_takes_blocks():
            why += (f": the KV offload tier stopped taking blocks after {tier.failure}; "
                    "free space in (or fix) the offload folder's disk (--offload-dir), or raise --kv-cache-tokens")
        self.finish(seq, "error")
        out.failed.append((seq.request_id, why))

    def isolate(self, request_ids: list[str]) -> None:
        """A step of these sequences raised: from now on each runs alone (see ``_suspects``)."""
        self._suspects.update(request_ids)

    def _next_suspect(self) -> Sequence | None:
        """The oldest running sequence still to run a step alone (None: no step is being isolated)."""
        if not self._suspects:
            return None
        running = [s for s in self.running if s.request_id in self._suspects]
        self._suspects = {s.request_id for s in running}  # a finished or preempted one is no longer watched
        return min(running, key=lambda s: s.arrival) if running else None

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Decide the next step; the sequences' block tables and queues change here, tokens do not.

        ``drafts``: proposed tokens (speculative decoding) of running sequences that decode (one
        known token to feed, no evicting policy); each is fed after its known token as far as the
        step's budget and the hot pool allow, so the step verifies it.
        """
        out = SchedulerOutput()
        alone = self._next_suspect()
        chosen: list[tuple[Sequence, int, list[int]]] = []  # data at the end: a later demotion edits tables
        budget = self.max_tokens
        if self.swap is not None:
            self.swap.end_step()  # last step's swap-ins are copied: their swap blocks are free again
        self._swapped_in.clear()
        # 1. Running sequences (decodes, or prefills continuing in chunks), oldest first.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq not in self.running or (alone is not None and seq is not alone):
                continue  # preempted below to make room for an older one, or not the one run alone
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
            draft = drafts.get(seq.request_id, []) if drafts and n == 1 and seq.kv is None else []
            n += len(draft)
            if seq.kv is not None:
                n = self.kv_policy.before_step(seq, n)
            n = min(n, budget)
            if self.tier is not None:
                n = min(n, self._hot_room(seq))
            draft = draft[:max(0, n - 1)]
            while not self._grow(seq, seq.kv_len + n, out):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            chosen.append((seq, n, draft))
            budget -= n
        # 2. Waiting sequences, in arrival order, while budget and blocks last.
        while alone is None and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.request_id in out.preempted:
                # Preempted in this step: its swap-out is not copied yet, so it may not come back
                # before the next step (where a failed copy-out is known, swap.lost).
                break
            if seq.swapped_blocks and self.swap.lost(seq.swapped_blocks):
                self._recompute_unswapped(seq)
            if self._outgrew_hot_pool(seq):
                self._fail_unfit(seq, out)
                continue
            reused = match_prefix(seq, self.allocator, self.block_size, self.ring, self.kv_disk) if self.prefix_caching else 0
            n = min(seq.num_tokens - seq.num_computed, budget)
            if seq.kv is not None:
                n = self.kv_policy.before_step(seq, n)
            if self.tier is not None:
                n = min(n, self._hot_room(seq))
            if not self._grow(seq, seq.kv_len + n, out):
                if seq.block_table:  # not admitted: do not pin its blocks (a shared prefix's, a ring's) while it waits
                    self._release_blocks(seq)
                if reused:
                    seq.num_computed = seq.num_registered = 0
                if not self.running and not chosen:
                    self._fail_unfit(seq, out)
                    continue
                break
            if reused and not seq.num_preemptions:
                seq.num_cached_tokens = reused
            if seq.swapped_blocks:  # readmitted after a swap-out: copy its blocks back first
                out.swap_in.extend(zip(seq.swapped_blocks, seq.block_table))
                self._swapped_in.add(id(seq))
                self.swap.release(seq.swapped_blocks)
                seq.swapped_blocks = []
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chosen.append((seq, n, []))
            budget -= n
        out.scheduled = [_scheduled(seq, n, draft, self.ring) for seq, n, draft in chosen]
        return out

    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> list[Sequence]:
        """The step ran: its tokens are computed (policy bookkeeping, ``num_computed``), and its
        newly full blocks are findable by later prompts. Returns the sequences that sample, in
        ``result.sample_ids`` order (their tokens come back through :meth:`append_tokens`)."""
        # A draft's KV counts once the core accepts it (accept_draft); the known tokens' counts now.
        chunks = [SeqChunk(self.requests[s.request_id], s.num_new_tokens - s.num_draft) for s in out.scheduled]
        if self._suspects:
            self._suspects.difference_update(s.request_id for s in out.scheduled)  # ran without a fault
        if self.kv_policy is not None:
            self.kv_policy.after_forward(chunks, result.meta)  # reads num_computed before the advance
        for c in chunks:  # every chunk advances, a mid-prefill one too
            c.seq.num_computed += c.num_new_tokens
        if self.prefix_caching:
            for c in chunks:
                register_full_blocks(c.seq, self.allocator, self.block_size, self.ring, self.kv_disk)
        return [self.requests[rid] for rid in result.sample_ids]

    def append_tokens(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Sampled tokens join their sequences (the core decides afterwards whether each one finished)."""
        for seq, tok in zip(seqs, token_ids):
            seq.output_ids.append(tok)

    def accept_draft(self, seq: Sequence) -> None:
        """``seq``'s next draft token was accepted and appended: its KV, written by the verification
        step, is now part of the sequence (and its block, once full, findable by later prompts)."""
        seq.num_computed += 1
        if self.prefix_caching:
            register_full_blocks(seq, self.allocator, self.block_size, self.ring, self.kv_disk)

    def trim_drafts(self, seq: Sequence) -> None:
        """After a verification: the blocks grown for rejected drafts go back to the pool (the open
        block stays; its slots past ``kv_len`` are written again before anything reads them)."""
        keep = blocks_needed(seq.kv_len, self.block_size)
        if len(seq.block_table) > keep:
            extra = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.allocator.free(extra)

    def num_blocks_used(self) -> int:
        return self.allocator.num_used
