"""Applying :class:`KVPolicy` objects to running sequences.

Each sequence carries its own policy (``SeqKVState.policy``; ``--kv-policy`` is only the default), so
``full``, ``sink`` and ``h2o`` sequences share a batch. :class:`PolicyRuntime` is the engine-wide part
(pool, RoPE table, Quest's page summaries; :meth:`PolicyRuntime.resolve` checks a request's policy).
Hooks: ``before_step(seq, n)`` (scheduler: caps a chunk, evicts so ``cache_len + n`` fits),
``score_from(scheduled)`` (runner: whose attention rows the ``ScoringBackend`` returns) and
``after_forward(chunks, meta)`` (bookkeeping, scores, SnapKV compression); ``full`` costs nothing per
token. Tokens sit at compact cache indices ``0..cache_len-1`` and positions are those indices
(StreamingLLM), so generation runs past the trained context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol

import torch

from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.kernels.common.protocols import KVPool
from llmsys.offload.eviction.compact import compact_kv, ensure_rope_positions
from llmsys.offload.eviction.policy import KVPolicy, parse_kv_policy
from llmsys.offload.eviction.quest import QuestAttention

if TYPE_CHECKING:
    from llmsys.offload.kv_tier import KVTier


# What the runtime reads of the engine's objects (offload does not import the engine;
# engine.sequence.Sequence, engine.scheduler.ScheduledSeq / SeqChunk, engine.block_allocator
# and engine.attention.AttentionMetadata fit these).


class PolicySeq(Protocol):
    """A running sequence: the runtime evicts its tokens and trims its block table."""

    kv: SeqKVState | None  # its policy's bookkeeping (None: ``full``)
    num_computed: int  # stream tokens whose KV was computed
    prompt_ids: list[int]
    block_table: list[int]  # mutated by :meth:`PolicyRuntime.evict` (spare blocks freed)


class PolicyChunk(Protocol):
    """One sequence's part of a step that ran (``engine.sequence.SeqChunk``)."""

    seq: PolicySeq
    num_new_tokens: int


class ScheduledRow(Protocol):
    """One sequence's part of a step about to run (``engine.scheduler.ScheduledSeq``)."""

    @property
    def kv_policy(self) -> KVPolicy | None: ...
    @property
    def num_new_tokens(self) -> int: ...


class BlockFreeList(Protocol):
    def free(self, blocks: list[int]) -> None: ...


class StepScoresLike(Protocol):
    rows: list[torch.Tensor | None]  # per scheduled sequence: [nq_b, context_len_b] attention mass


class ScoredMeta(Protocol):
    @property
    def scores(self) -> StepScoresLike | None: ...


class RopeModel(Protocol):
    """The decoder whose RoPE table the runtime grows and reads (``DecoderModel``)."""

    rope_cache: torch.Tensor  # [positions, head_dim]
    args: object  # .head_dim .rope_theta .rope_scaling

    def ensure_rope_positions(self, n_positions: int) -> None: ...

    @property
    def kv_policy_blocker(self) -> str | None: ...


class SeqKVState:
    """One sequence's policy and cache bookkeeping (CPU tensors, indexed by cache index).

    ``orig`` (the stream position of every cached token) grows by one range
    per step; the ranges are kept as two ints and turned into a tensor only
    when something reads ``orig`` (an eviction), not with a ``torch.cat``
    every token.
    """

    def __init__(self, policy: KVPolicy, chunk: int = 1):
        self.policy = policy  # resolved, evicting
        self.chunk = chunk  # tokens evicted at once
        self.cache_len = 0
        self._orig = torch.zeros(0, dtype=torch.int64)  # [L'] materialised prefix of orig
        self._tail = (0, 0)  # (first stream position, count) appended after _orig
        self.score: torch.Tensor | None = None  # [L] f32 accumulated attention mass (h2o)
        self.obs: torch.Tensor | None = None  # [W', L] f32 attention rows of the last queries (snapkv)
        self.evicted = 0  # tokens dropped so far (reported in Usage.evicted_tokens)
        self.max_cache_len = 0  # high-water mark (tests: budget honoured)

    @property
    def orig(self) -> torch.Tensor:  # [L] int64 stream positions of the cached tokens
        start, count = self._tail
        if count:
            self._orig = torch.cat([self._orig, torch.arange(start, start + count)])
            self._tail = (0, 0)
        return self._orig

    def append(self, start: int, n: int) -> None:
        """``n`` new tokens at stream positions ``start..`` joined the cache."""
        s, c = self._tail
        if c and s + c != start:
            self.orig  # noqa: B018 -- not contiguous with the pending range: materialise it first
            s, c = 0, 0
        self._tail = (start if not c else s, c + n)
        self.cache_len += n
        self.max_cache_len = max(self.max_cache_len, self.cache_len)

    def reset(self) -> None:
        """After preemption: the sequence is recomputed from scratch."""
        self.cache_len = 0
        self._orig = self._orig[:0]
        self._tail = (0, 0)
        self.score = None
        self.obs = None

    def keep(self, idx: torch.Tensor) -> None:
        self._orig = self.orig[idx]
        self.evicted += self.cache_len - idx.numel()
        self.cache_len = idx.numel()
        if self.score is not None:
            self.score = self.score[idx]
        if self.obs is not None:
            self.obs = self.obs[:, idx]


class PolicyRuntime:
    """Engine-wide policy state: the default policy, the pool, the model's RoPE table.

    ``policy`` is the engine's default (``--kv-policy``); a sequence's own
    policy is in its :class:`SeqKVState`. ``chunk``: tokens evicted at once
    when a policy does not say (the block size in the engine, 1 in stream
    scoring).
    """

    def __init__(self, policy: KVPolicy, model: RopeModel, kv: KVPool, allocator: BlockFreeList, block_size: int,
                 chunk: int | None = None, tier: KVTier | None = None):
        self.policy = policy
        self.model = model
        self.kv = kv
        self.allocator = allocator
        self.block_size = block_size
        self.chunk = max(1, chunk or block_size)
        # Quest's summaries (the engine's attention backend wraps its base in QuestBackend with them);
        # with a cold tier, decode reads only the cold pages it selects.
        self.quest = QuestAttention(policy.top_pages, block_size, tier=tier) if policy.kind == "quest" else None
        self.evicted_total = 0

    def resolve(self, text: str | KVPolicy | None) -> KVPolicy:
        """A request's policy (None: the engine's), resolved and checked against this engine.

        No side effects, so the server can call it from a handler thread.
        Raises :class:`InvalidParameterError` naming the problem.
        """
        if text is None:
            return self.policy
        pol = parse_kv_policy(text).resolve(self.kv.spec.bytes_per_token)
        if pol.kind == self.policy.kind and pol.text == self.policy.text:
            return self.policy
        check_policy(pol, self.kv, self.block_size, self.model)
        if pol.kind == "quest":
            raise InvalidParameterError(
                f"kv_policy {pol.text!r}: quest is engine-wide (it selects KV pages for every sequence of a batch); "
                "start the engine with --kv-policy quest:K instead of asking for it per request"
            )
        if self.quest is not None:
            raise InvalidParameterError(
                f"kv_policy {pol.text!r}: this engine runs {self.policy.text} for every request (quest is "
                "engine-wide); restart it without --kv-policy quest to choose a policy per request"
            )
        return pol

    def new_state(self, policy: KVPolicy | None = None) -> SeqKVState | None:
        """Bookkeeping for a new sequence under ``policy`` (default: the engine's); None unless it evicts.

        Grows the model's RoPE table to the budget first (positions are cache indices).
        """
        pol = policy or self.policy
        if not pol.evicts:
            return None
        ensure_rope_positions(self.model, pol.budget + self.block_size)
        return SeqKVState(pol, max(1, pol.chunk or self.chunk))

    # -- scheduler hook ------------------------------------------------------
    def before_step(self, seq: PolicySeq, n: int) -> int:
        """Cap ``n`` and evict so the step fits the budget; returns the new ``n``."""
        st: SeqKVState = seq.kv
        pol = st.policy
        budget = pol.budget
        if st.cache_len + n <= budget:
            return n
        if pol.kind == "snapkv" and seq.num_computed < len(seq.prompt_ids):
            return n  # the whole prompt is compressed at the end of prefill
        # Every new token of a chunk should see at least half the budget of history.
        n = min(n, max(1, budget - max(pol.min_keep, budget // 2)))
        if st.cache_len + n > budget:
            target = max(min(budget - n - (st.chunk - 1), st.cache_len), min(pol.min_keep, budget - n))
            self.evict(seq, min(target, budget - n))
        return n

    def evict(self, seq: PolicySeq, target: int) -> None:
        """Keep ``target`` tokens of ``seq`` (its policy picks which), free spare blocks."""
        st: SeqKVState = seq.kv
        if target >= st.cache_len:
            return
        keep = st.policy.select(st.orig, target, st.score, st.obs)
        compact_kv(self.kv.k, self.kv.v, seq.block_table, self.block_size, keep, self.model.rope_cache)
        before = st.cache_len
        st.keep(keep)
        self.evicted_total += before - st.cache_len
        need = -(-st.cache_len // self.block_size)
        if need < len(seq.block_table):
            self.allocator.free(seq.block_table[need:])
            del seq.block_table[need:]

    # -- runner hooks --------------------------------------------------------
    def score_from(self, scheduled: Iterable[ScheduledRow]) -> list[int | None] | None:
        """Per scheduled sequence, the first new token whose attention row its policy needs (None: none).

        None for the whole step when no sequence scores (the backend's metadata is then the plain one).
        """
        frm: list[int | None] = []
        for s in scheduled:
            pol = s.kv_policy  # the scheduled row's evicting policy, or None
            if pol is None or not pol.needs_scores:
                frm.append(None)
            else:
                frm.append(0 if pol.kind == "h2o" else max(0, s.num_new_tokens - pol.obs))
        return frm if any(f is not None for f in frm) else None

    def after_forward(self, scheduled: Iterable[PolicyChunk], meta: ScoredMeta) -> None:
        rows = meta.scores.rows if meta.scores is not None else None
        for b, s in enumerate(scheduled):
            seq, n = s.seq, s.num_new_tokens
            st: SeqKVState | None = seq.kv
            if st is None:
                continue
            st.append(seq.num_computed, n)
            pol = st.policy
            if not pol.needs_scores:
                continue
            L = st.cache_len
            r = rows[b] if rows is not None else None
            if pol.kind == "h2o":
                add = r.sum(0) if r is not None else torch.zeros(L)
                prev = st.score if st.score is not None else torch.zeros(0)
                st.score = torch.cat([prev, torch.zeros(n)]) + add
            elif pol.kind == "snapkv" and r is not None:
                prev = st.obs if st.obs is not None else torch.zeros(0, L - n)
                prev = torch.cat([prev, torch.zeros(prev.shape[0], n)], dim=1)
                st.obs = torch.cat([prev, r], dim=0)[-pol.obs :]
                if seq.num_computed + n == len(seq.prompt_ids) and L > pol.budget:
                    # End of prefill: compress the prompt (room left for the chunk of decodes).
                    self.evict(seq, max(pol.obs + 1, pol.budget - st.chunk))


def check_policy(pol: KVPolicy, kv: KVPool, block_size: int, model: RopeModel | None = None) -> None:
    """Can this engine run ``pol`` for generation? Raises :class:`InvalidParameterError` naming why not."""
    blocker = model.kv_policy_blocker if model is not None and pol.kind != "full" else None
    if blocker:
        raise InvalidParameterError(
            f"kv_policy {pol.text!r}: this model's attention ({blocker}) runs with kv_policy full only"
        )
    spec = kv.spec
    if pol.kind == "recompute":
        raise InvalidParameterError(
            f"kv_policy {pol.text!r}: recompute:N is a scoring oracle; use it with `llmsys perplexity --stream`, "
            "not for generation"
        )
    if pol.kind != "full" and kv.quantized:
        raise InvalidParameterError(
            f"kv_policy {pol.text!r} needs a float KV pool; drop --kv-dtype {spec.kv_dtype} or use full"
        )
    pool = (spec.num_blocks - 1) * block_size
    if pol.evicts and pol.budget + block_size > pool:
        raise InvalidParameterError(
            f"kv_policy {pol.text!r}: budget {pol.budget} tokens does not fit the KV pool ({pool} tokens, "
            f"less one block of headroom); lower the budget or raise --kv-cache-tokens"
        )


def make_policy_runtime(text: str | KVPolicy | None, model: RopeModel, kv: KVPool, allocator: BlockFreeList,
                        block_size: int, max_len: int, tier: KVTier | None = None) -> PolicyRuntime:
    """Parse + resolve + check the engine's default policy; the runtime every engine has.

    Also extends the model's RoPE table when the engine's context (or the
    policy's budget) reaches past the trained positions.
    """
    pol = parse_kv_policy(text).resolve(kv.spec.bytes_per_token)
    check_policy(pol, kv, block_size, model)
    ensure_rope_positions(model, max(max_len, pol.budget) + block_size)
    return PolicyRuntime(pol, model, kv, allocator, block_size, tier=tier)
