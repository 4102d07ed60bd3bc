"""Applying a :class:`KVPolicy` to running sequences.

The engine calls three hooks, and only when a policy other than ``full`` is
active (the default path does no extra per-token work):

* ``before_step(seq, n)`` from the scheduler, before it grows the block
  table: caps a prefill chunk and evicts so ``cache_len + n`` fits the budget
  (freed blocks go back to the allocator at once);
* ``annotate(meta, scheduled)`` from the runner: installs the attention
  override that records scores (H2O, SnapKV) or selects pages (Quest);
* ``after_forward(scheduled, meta)`` from the runner: appends the new tokens
  to each sequence's bookkeeping, folds in the scores, and compresses a
  SnapKV prompt at the end of its prefill.

A sequence's tokens live at cache indices ``0..cache_len-1`` (compact), and
the runner gives new tokens the positions ``cache_len..``: positions are
indices within the cache (StreamingLLM), so generation continues far past the
trained context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from llmsys import kernels
from llmsys.kernels.cpu_attention import make_gather_plan, paged_attention_gathered_scores
from llmsys.offload.eviction.compact import compact_kv
from llmsys.offload.eviction.policy import KVPolicy
from llmsys.offload.eviction.quest import QuestAttention


@dataclass
class SeqKVState:
    """One sequence's cache bookkeeping (CPU tensors, indexed by cache index)."""

    cache_len: int = 0
    orig: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [L] stream positions
    score: torch.Tensor | None = None  # [L] f32 accumulated attention mass (h2o)
    obs: torch.Tensor | None = None  # [W', L] f32 attention rows of the last queries (snapkv)
    evicted: int = 0  # tokens dropped so far (reported in Usage.evicted_tokens)
    max_cache_len: int = 0  # high-water mark (tests: budget honoured)

    def reset(self) -> None:
        """After preemption: the sequence is recomputed from scratch."""
        self.cache_len = 0
        self.orig = self.orig[:0]
        self.score = None
        self.obs = None

    def keep(self, idx: torch.Tensor) -> None:
        self.evicted += self.cache_len - idx.numel()
        self.cache_len = idx.numel()
        self.orig = self.orig[idx]
        if self.score is not None:
            self.score = self.score[idx]
        if self.obs is not None:
            self.obs = self.obs[:, idx]


class ScoreCollector:
    """Attention override that also sums attention rows over layers.

    ``score_from[b]``: first new token of sequence ``b`` whose row is kept.
    ``rows[b]``: ``[nq_b, context_len_b]`` mass summed over heads and layers.
    """

    def __init__(self, score_from: list[int], context_lens: list[int]):
        self.score_from = score_from
        self.context_lens = context_lens
        self.rows: list[torch.Tensor | None] = [None] * len(score_from)
        self._plan = None

    def __call__(self, q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        if q.is_cuda and meta.is_decode and k_cache.dtype != torch.int8:
            res = kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, scale, return_scores=True
            )
            rows = [res.token_mass[b].sum(0, keepdim=True) for b in range(q.shape[0])]  # [1, cap]
            out = res.out
        else:
            plan = meta.plan
            if plan is None:  # CUDA prefill: build the gather layout once per step
                if self._plan is None:
                    qlens = [meta.query_start[i + 1] - meta.query_start[i] for i in range(meta.num_seqs)]
                    tables = [row.tolist() for row in meta.block_tables.cpu()]
                    self._plan = make_gather_plan(qlens, meta.context_lens, tables, k_cache.shape[1], q.device)
                plan = self._plan
            out, rows = paged_attention_gathered_scores(q, k_cache, v_cache, plan, scale, self.score_from)
        for b, r in enumerate(rows):
            r = r[:, : self.context_lens[b]].float().cpu()
            self.rows[b] = r if self.rows[b] is None else self.rows[b] + r
        return out


class PolicyRuntime:
    """Engine-wide policy state: the policy, the pool, the model's RoPE table."""

    def __init__(self, policy: KVPolicy, model: Any, kv: Any, allocator: Any, block_size: int, chunk: int | None = None):
        self.policy = policy
        self.model = model
        self.kv = kv
        self.allocator = allocator
        self.block_size = block_size
        self.chunk = max(1, policy.chunk or chunk or block_size)  # tokens evicted at once
        self.quest = QuestAttention(policy.top_pages, block_size) if policy.kind == "quest" else None
        self.evicted_total = 0

    @classmethod
    def create(cls, policy: KVPolicy, model: Any, kv: Any, allocator: Any, block_size: int) -> "PolicyRuntime | None":
        """None for ``full`` (the engine then runs its plain path)."""
        if policy.kind == "full":
            return None
        return cls(policy, model, kv, allocator, block_size)

    @property
    def allows_long_prompts(self) -> bool:
        """Prompts longer than the context are fine when the window slides during prefill."""
        return self.policy.kind in ("window", "sink", "h2o")

    def new_state(self) -> SeqKVState | None:
        return SeqKVState() if self.policy.evicts else None

    # -- scheduler hook ------------------------------------------------------
    def before_step(self, seq: Any, n: int) -> int:
        """Cap ``n`` and evict so the step fits the budget; returns the new ``n``."""
        st: SeqKVState = seq.kv
        pol = self.policy
        budget = pol.budget
        if st.cache_len + n <= budget:
            return n
        if pol.kind == "snapkv" and seq.num_computed < len(seq.prompt_ids):
            return n  # the whole prompt is compressed at the end of prefill
        # Every new token of a chunk should see at least half the budget of history.
        n = min(n, max(1, budget - max(pol.min_keep, budget // 2)))
        if st.cache_len + n > budget:
            target = max(min(budget - n - (self.chunk - 1), st.cache_len), min(pol.min_keep, budget - n))
            self.evict(seq, min(target, budget - n))
        return n

    def evict(self, seq: Any, target: int) -> None:
        """Keep ``target`` tokens of ``seq`` (the policy picks which), free spare blocks."""
        st: SeqKVState = seq.kv
        if target >= st.cache_len:
            return
        keep = self.policy.select(st.orig, target, st.score, st.obs)
        compact_kv(self.kv.k, self.kv.v, seq.block_table, self.block_size, keep, self.model.rope_cache)
        before = st.cache_len
        st.keep(keep)
        self.evicted_total += before - st.cache_len
        need = -(-st.cache_len // self.block_size)
        if need < len(seq.block_table):
            self.allocator.free(seq.block_table[need:])
            del seq.block_table[need:]

    # -- runner hooks --------------------------------------------------------
    def annotate(self, meta: Any, scheduled: Iterable[Any]) -> None:
        if self.quest is not None:
            meta.policy_attn = self.quest
            return
        if not self.policy.needs_scores:
            return
        frm = []
        for s in scheduled:
            n = s.num_new_tokens
            frm.append(0 if self.policy.kind == "h2o" else max(0, n - self.policy.obs))
        meta.policy_attn = ScoreCollector(frm, list(meta.context_lens))

    def after_forward(self, scheduled: Iterable[Any], meta: Any) -> None:
        coll = getattr(meta, "policy_attn", None)
        rows = coll.rows if isinstance(coll, ScoreCollector) else None
        for b, s in enumerate(scheduled):
            seq, n = s.seq, s.num_new_tokens
            st: SeqKVState | None = seq.kv
            if st is None:
                continue
            L = st.cache_len + n
            st.orig = torch.cat([st.orig, torch.arange(seq.num_computed, seq.num_computed + n)])
            st.cache_len = L
            st.max_cache_len = max(st.max_cache_len, L)
            r = rows[b] if rows is not None else None
            if self.policy.kind == "h2o":
                add = r.sum(0) if r is not None else torch.zeros(L)
                prev = st.score if st.score is not None else torch.zeros(0)
                st.score = torch.cat([prev, torch.zeros(n)]) + add
            elif self.policy.kind == "snapkv" and r is not None:
                prev = st.obs if st.obs is not None else torch.zeros(0, L - n)
                prev = torch.cat([prev, torch.zeros(prev.shape[0], n)], dim=1)
                st.obs = torch.cat([prev, r], dim=0)[-self.policy.obs :]
                if seq.num_computed + n == len(seq.prompt_ids) and L > self.policy.budget:
                    # End of prefill: compress the prompt (room left for the chunk of decodes).
                    self.evict(seq, max(self.policy.obs + 1, self.policy.budget - self.chunk))


def make_policy_runtime(text: Any, model: Any, kv: Any, allocator: Any, block_size: int, max_len: int) -> PolicyRuntime | None:
    """Parse + resolve + check a policy for an engine; None for ``full``.

    Also extends the model's RoPE table when the engine's context (or the
    policy's budget) reaches past the trained positions.
    """
    from llmsys.engine.errors import InvalidParameterError
    from llmsys.offload.eviction.compact import ensure_rope_positions
    from llmsys.offload.eviction.policy import parse_kv_policy

    spec = kv.spec
    pol = parse_kv_policy(text).resolve(spec.bytes_per_token)
    ensure_rope_positions(model, max(max_len, pol.budget) + block_size)
    if pol.kind == "full":
        return None
    if pol.kind == "recompute":
        raise InvalidParameterError(
            "--kv-policy recompute:N is a scoring oracle; use it with `llmsys perplexity --stream`, not for generation"
        )
    if getattr(kv, "quantized", False):
        raise InvalidParameterError(
            f"--kv-policy {pol.text!r} needs a float KV pool; drop --kv-dtype {spec.kv_dtype} or use --kv-policy full"
        )
    pool = (spec.num_blocks - 1) * block_size
    if pol.evicts and pol.budget + block_size > pool:
        raise InvalidParameterError(
            f"--kv-policy {pol.text!r}: budget {pol.budget} tokens does not fit the KV pool ({pool} tokens); "
            "lower the budget or raise --kv-cache-tokens"
        )
    return PolicyRuntime(pol, model, kv, allocator, block_size)
