"""Speculative decoding: proposers of draft tokens that the target model verifies in one step.

A target step reads every weight once however many tokens it carries, so ``k`` drafts cost little
more than one token; verification (``Sampler.sample`` with drafts) keeps greedy output identical to
plain decoding and sampled tokens distributed exactly as the target's. The step: ``Scheduler.schedule``
feeds the drafts, ``EngineCore.step`` accepts a prefix and rolls the rest back
(``Scheduler.accept_draft`` / ``trim_drafts``: rejected KV is never kept). Proposers are deterministic
(:class:`Proposer`): :class:`NgramProposer` (``--spec ngram``), :class:`DraftProposer` (``--draft MODEL``;
``--spec self:int4``: the target's own checkpoint quantized, no second download) and
:func:`predicted_continuation` (OpenAI ``prediction``). Written here because vLLM's and transformers'
versions are welded to their own scheduler and KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from llmsys.engine.kv_cache import blocks_needed
from llmsys.engine.scheduler import ScheduledSeq, SchedulerOutput
from llmsys.kernels.common.errors import InvalidParameterError

if TYPE_CHECKING:
    from llmsys.engine.core import EngineCore


@dataclass(frozen=True)
class ProposalRequest:
    """One decoding sequence asking for drafts."""

    request_id: str
    tokens: list[int]  # prompt + output so far; the drafts continue it
    k: int  # at most this many drafts


def _suffix_matches(source: np.ndarray, pattern: np.ndarray, max_n: int) -> tuple[np.ndarray, int]:
    """Positions ``i`` of ``source`` where its tokens ``..i`` equal the last ``n`` tokens of ``pattern``,
    for the longest ``n <= max_n`` that has any (``[], 0`` when even the last token never occurs).

    One pass back from the last token: the candidates are the positions holding it, narrowed each
    round to those whose preceding token matches one more token of the pattern."""
    ends = np.flatnonzero(source == pattern[-1])
    found, n = ends, 0
    while ends.size and n < min(max_n, len(pattern)):
        n, found = n + 1, ends
        ends = ends[ends >= n]  # room for one more token before the match
        if n < len(pattern):
            ends = ends[source[ends - n] == pattern[-1 - n]]
        else:
            ends = ends[:0]
    return found, n


def predicted_continuation(prediction: tuple[int, ...], output: list[int], k: int, max_n: int = 4) -> list[int]:
    """Drafts from a request's predicted output (OpenAI's ``prediction``: the text the answer is
    expected to be close to, e.g. a file being edited): its first ``k`` tokens before any output,
    then what follows the place in the prediction that matches the output's last tokens (the
    longest match up to ``max_n``; among equal ones the nearest to the output's own position, as an
    edited text keeps its order)."""
    if not prediction or k < 1:
        return []
    p = np.asarray(prediction, dtype=np.int64)  # [P]
    if not output:
        return p[:k].tolist()
    found, n = _suffix_matches(p, np.asarray(output, dtype=np.int64), max_n)
    if not found.size:
        return []
    best = int(found[np.argmin(np.abs(found - (len(output) - 1)))])
    return p[best + 1: best + 1 + k].tolist()


class Proposer(Protocol):
    """Guesses the next tokens of decoding sequences (deterministically: each draft a point mass)."""

    name: str

    def propose(self, reqs: list[ProposalRequest], live: set[str]) -> list[list[int]]:
        """Drafts per request (any length up to its ``k``, possibly none). ``live``: every
        unfinished request id; a proposer drops the state it kept for any other."""
        ...


@dataclass
class SpecStats:
    """Counters over the engine's life (benchmarks/bench_speculative.py and the tests read them; requests
    report their own in ``Usage``)."""

    verify_seqs: int = 0  # sequence-steps that verified at least one draft
    proposed: int = 0  # drafts fed to the target
    accepted: int = 0  # drafts the target kept


class NgramProposer:
    """Prompt lookup: copy what followed the latest earlier occurrence of the sequence's suffix."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise InvalidParameterError(f"n-gram lookup needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, reqs: list[ProposalRequest], live: set[str]) -> list[list[int]]:
        return [self.lookup(r.tokens, r.k) for r in reqs]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        t = np.asarray(tokens, dtype=np.int64)  # [L]
        L = len(t)
        if L < 2:
            return []
        found, n = _suffix_matches(t[: L - 1], t, self.max_n)
        if not found.size or n < self.min_n:
            return []
        # The latest match with k tokens after it (in a repeating run the very latest has fewer).
        full = found[found + k < L]
        best = int(full[-1] if full.size else found[-1])
        return t[best + 1: best + 1 + k].tolist()


@dataclass
class _DraftSeq:
    """A target sequence's state in the draft's pool: the tokens whose draft KV is written, and its blocks."""

    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftProposer:
    """A small model's greedy continuation, ``k`` tokens per step, batched over the sequences.

    ``core``: the draft's own engine (loaded like any model, resident); only its runner, KV pool
    and block allocator are used, the scheduler never. Each target sequence keeps the draft KV of
    the tokens it has already fed; after a verification the draft keeps the prefix the target
    confirmed (the longest common prefix of what it computed and the target's tokens) and feeds
    only the rest, so a step costs the draft ``k`` short forwards. A sequence the draft's pool or
    context cannot take gets no drafts (plain decoding) rather than an error.
    """

    def __init__(self, core: EngineCore, name: str, prefill_chunk: int = 512):
        self.core = core
        self.name = name
        self.runner = core.runner
        self.allocator = core.allocator
        self.block_size = core.kv.spec.block_size
        self.max_len = core.max_len
        self.prefill_chunk = prefill_chunk
        self.seqs: dict[str, _DraftSeq] = {}

    def _drop(self, rid: str) -> None:
        st = self.seqs.pop(rid, None)
        if st is not None:
            self.allocator.free(st.block_table)

    def _run(self, rows: list[tuple[str, _DraftSeq, list[int], bool]]) -> dict[str, int]:
        """One draft forward: each row feeds its tokens after its written ones; returns the greedy
        next token of the rows that sample. ``rows``: (request id, state, tokens, samples)."""
        sched = SchedulerOutput([
            ScheduledSeq(rid, toks, len(st.tokens), len(st.tokens), list(st.block_table), len(toks) > 1, samples)
            for rid, st, toks, samples in rows
        ])
        result = self.runner.execute(sched)
        for rid, st, toks, _ in rows:
            st.tokens.extend(toks)
        return dict(zip(result.sample_ids, result.logits.argmax(dim=-1).tolist()))

    def propose(self, reqs: list[ProposalRequest], live: set[str]) -> list[list[int]]:
        for rid in [r for r in self.seqs if r not in live]:
            self._drop(rid)
        out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        feeds: dict[str, list[int]] = {}
        for r in reqs:
            st = self.seqs.setdefault(r.request_id, _DraftSeq())
            # The last draft is never fed: the pool holds len(tokens) + k - 1 positions.
            upto = len(r.tokens) + r.k - 1
            if r.k < 1 or upto > self.max_len:
                self._drop(r.request_id)
                continue
            keep = min(_common_prefix(st.tokens, r.tokens), len(r.tokens) - 1)  # at least one token to feed
            del st.tokens[keep:]
            need = blocks_needed(upto, self.block_size) - len(st.block_table)
            if need > 0:
                if not self.allocator.can_allocate(need):
                    self._drop(r.request_id)
                    continue
                st.block_table.extend(self.allocator.allocate(need))
            feeds[r.request_id] = r.tokens[keep:]
        if not feeds:
            return [out[r.request_id] for r in reqs]
        k = {r.request_id: r.k for r in reqs}
        # Catch up: each sequence's unwritten tokens, in chunks, the last chunk sampling the first draft.
        last: dict[str, int] = {}
        while feeds:
            rows = []
            for rid, toks in list(feeds.items()):
                part, rest = toks[: self.prefill_chunk], toks[self.prefill_chunk:]
                rows.append((rid, self.seqs[rid], part, not rest))
                if rest:
                    feeds[rid] = rest
                else:
                    del feeds[rid]
            last.update(self._run(rows))
        for rid, tok in last.items():
            out[rid].append(tok)
        # Then one token per forward while a sequence wants more.
        while True:
            rows = [(rid, self.seqs[rid], [d[-1]], True) for rid, d in out.items() if d and len(d) < k[rid]]
            if not rows:
                break
            for rid, tok in self._run(rows).items():
                out[rid].append(tok)
        return [out[r.request_id] for r in reqs]


def check_same_vocabulary(target_vocab: int, draft_vocab: int, target_ids: list[int], draft_ids: list[int],
                          draft_name: str) -> None:
    """A draft must speak the target's tokens: the same vocabulary size and the same ids for a probe text."""
    if target_vocab != draft_vocab or target_ids != draft_ids:
        why = (f"its vocabulary has {draft_vocab} tokens, the target's {target_vocab}" if target_vocab != draft_vocab
               else "it tokenizes text differently")
        raise InvalidParameterError(f"--draft {draft_name}: {why}; a draft model needs the target's tokenizer "
                                    "(e.g. a smaller model of the same family), or use --spec ngram / self:int4")


__all__ = ["DraftProposer", "NgramProposer", "ProposalRequest", "Proposer", "SpecStats", "check_same_vocabulary"]
