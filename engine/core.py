"""The engine core: ``add_request`` / ``step`` / ``abort``.

One thread owns an :class:`EngineCore`. Each ``step`` asks the scheduler for a
batch, runs it, samples one token for every sequence that reached the end of
its known tokens, turns new tokens into text deltas (incremental
detokenization, stop strings held back until resolved) and returns one
:class:`StreamChunk` per request that has news. Front ends (LLM facade,
server, TUI, bench) are all built on these three calls.
"""

from __future__ import annotations

import functools
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llmsys.engine.config import EngineConfig
from llmsys.engine.detokenizer import IncrementalDetokenizer, StopChecker
from llmsys.engine.embedding import Pooler, Pooling
from llmsys.kernels.common.errors import ContextOverflowError, InvalidParameterError, KVReadError
from llmsys.engine.attention import make_backend
from llmsys.engine.kv_cache import BlockAllocator, KVCacheSpec, make_kv_pool
from llmsys.engine.kv_disk import KVDiskReport, open_kv_disk
from llmsys.engine.loader.common import LoadedModel
from llmsys.engine.outputs import CONSTRAINT_FAILED, REQUEST_FAILED, StreamChunk, Timings, Usage
from llmsys.engine.runner import ModelRunner
from llmsys.engine.sampling import Sampler, SamplingBatch, SamplingParams, make_generator
from llmsys.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from llmsys.engine.sequence import Sequence
from llmsys.engine.sliding_kv import RingTables, sliding_layers
from llmsys.engine.speculative import ProposalRequest, Proposer, SpecStats, predicted_continuation
from llmsys.engine.tokenizer import Tokenizer
from llmsys.offload.kv_policy import make_policy_runtime
from llmsys.offload.kv_swap import KVSwapSpace, make_swap_space
from llmsys.offload.kv_tier import KVTier, make_kv_tier
from llmsys.offload.experts import ExpertReport
from llmsys.offload.runtime import OffloadRuntime
from llmsys.quant.base import kernel_counts

log = logging.getLogger(__name__)


class TokenConstraint(Protocol):
    """A per-request token constraint (a grammar: ``llmsys.engine.grammar.GrammarConstraint``)."""

    def allowed(self, vocab: int) -> torch.Tensor:  # [vocab] bool: tokens that may come next
        ...

    def advance(self, token_id: int) -> None:  # the sampled token was appended
        ...

    def prefetch(self) -> None:  # compute the next allowed() now; called on another thread during the forward
        ...


@dataclass
class TextState:
    """Per-request text bookkeeping (detokenizer + stop-string matcher)."""

    detok: IncrementalDetokenizer
    stop: StopChecker | None
    start_time: float | None = None
    logprobs: list = field(default_factory=list)
    constraint: TokenConstraint | None = None  # None: every token allowed
    pooler: Pooler | None = None  # an embedding request (llmsys.engine.embedding): it pools, samples nothing


@dataclass(frozen=True)
class KVLayerReport:
    """The KV of one kind of layer (:attr:`MemoryReport.kv_layers`): its blocks and their bytes."""

    layers: int
    ring: bool  # the blocks are per-sequence rings of the ring pool (engine/sliding_kv.py), not the block tables
    blocks_used: int
    blocks_total: int  # usable blocks (the scratch block not counted)
    bytes_used: int
    bytes_total: int  # the pool tensors of these layers (scratch block included)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per tier and kind: the engine's own accounting, the one source every view shows (the
    chat panel and ``/info``, ``/metrics``, ``/api/ps``, ``llmsys bench``).

    Three sizes of KV, each per tier, because a pool costs what is written into it, not what it
    could hold (CPU pool pages are backed when first written: ``kernels.common.memory``):

    * ``kv_total`` (:attr:`kv_reserved`): the pool's bytes, every block, written or not. Address
      space, not memory, for a CPU pool; what ``cudaMalloc`` took for a GPU pool.
    * ``kv_resident``: the pool's bytes backed by memory: every page up to the highest block ever
      handed out (the allocator gives low ids first and reuses freed ones first, and pages are never
      given back). This, not the reservation, is what the process's RSS holds; a GPU pool (and a small
      plainly allocated one) is resident whole.
    * ``kv_used``: bytes of the blocks live requests hold now; ``kv_cached``: free blocks still holding
      a reusable prompt prefix. :attr:`kv_in_use` is both: ``kv_in_use <= kv_resident <= kv_total``.

    ``weights``: weight bytes per tier as loaded (``disk``: read from the checkpoint or offload file
    through the page cache, not held by the process). :attr:`resident` adds up what llmsys's own
    buffers hold per tier; a process's RSS is that (its ``cpu`` entry) plus the runtime (Python, torch,
    kernels, the tokenizer).
    """

    weights: dict[str, int]  # tier -> bytes
    kv_total: dict[str, int]  # tier -> bytes reserved for the KV pool (and the cold tier)
    kv_used: dict[str, int]  # tier -> bytes of blocks live requests hold
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    staging: dict[str, int] = field(default_factory=dict)  # tier -> offload ring/staging buffer bytes
    kv_swap_total: dict[str, int] = field(default_factory=dict)  # tier -> swap space for preempted KV
    kv_swap_used: dict[str, int] = field(default_factory=dict)  # tier -> bytes of swapped-out blocks
    # Cold KV tier (llmsys.offload.kv_tier); its bytes are also in kv_total / kv_used under its tier.
    kv_cold_blocks_total: int = 0
    kv_cold_blocks_used: int = 0
    kv_blocks_by_tier: dict[str, tuple[int, int]] | None = None  # tier -> (used, total) blocks, with a cold tier
    # Quantized layers per matmul kernel, e.g. {"C int4 a8 x86-64-v3": 168} (llmsys.quant.base.MatmulKernel)
    kernels: dict[str, int] = field(default_factory=dict)
    # What each stored tensor type became at load (a GGUF), e.g. {"Q6_K (1)": "dequantized to bfloat16"}
    stored_formats: dict[str, str] = field(default_factory=dict)
    # Experts kept apart from their layers (MoE on disk with a RAM cache, or --cpu-moe); None: none are.
    experts: ExpertReport | None = None
    kv_disk: KVDiskReport | None = None  # the prefix cache's disk tier (--kv-disk), None: off
    # KV per kind of layer: "global" (every position kept) and, for a model with sliding-window layers,
    # "sliding" (in rings where the engine keeps only their window: engine/sliding_kv.py). Pool blocks only.
    kv_layers: dict[str, KVLayerReport] = field(default_factory=dict)
    kv_resident: dict[str, int] = field(default_factory=dict)  # tier -> pool bytes backed by memory (see above)
    kv_cached: dict[str, int] = field(default_factory=dict)  # tier -> bytes of free blocks holding a prefix
    kv_blocks_cached: int = 0

    @property
    def kv_reserved(self) -> dict[str, int]:
        """The pool's reservation per tier (``kv_total``'s meaning, by its name)."""
        return self.kv_total

    @property
    def kv_in_use(self) -> dict[str, int]:
        """KV bytes holding something: live requests' blocks and cached prefixes."""
        tiers = self.kv_used.keys() | self.kv_cached.keys()
        return {t: self.kv_used.get(t, 0) + self.kv_cached.get(t, 0) for t in sorted(tiers)}

    @property
    def resident(self) -> dict[str, int]:
        """Bytes llmsys's own buffers hold per memory tier (not ``disk``): weights, the KV pool's
        resident pages, staging buffers and a swap space kept in memory."""
        out: dict[str, int] = {}
        for part in (self.weights, self.kv_resident, self.staging, self.kv_swap_total):
            for t, n in part.items():
                if t != "disk":
                    out[t] = out.get(t, 0) + n
        return out


def _apply_constraints(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, dict[str, str]]:
    """Mask tokens a request's constraint forbids (logits [B, V] -> -inf).

    Per request, not per batch: a constrained row must not change what an
    unconstrained neighbour samples, so only its own row is touched. A
    constraint that raises fails its own request only: returns those request
    ids with a one-line reason (their rows are sampled and dropped).
    """
    rows = [i for i, s in enumerate(seqs) if s.state.constraint is not None]
    if not rows:
        return logits, {}
    logits, broken = logits.clone(), {}
    for i in rows:
        try:
            allowed = seqs[i].state.constraint.allowed(logits.shape[-1]).to(logits.device)  # [V] bool
        except Exception as e:
            broken[seqs[i].request_id] = _constraint_failure(e)
            continue
        logits[i].masked_fill_(~allowed, float("-inf"))
    return logits, broken


def _prefetch(constraints: list[TokenConstraint]) -> None:
    """The mask thread's job (EngineCore.step): each constraint's next mask; one that fails is
    logged here and asked again (and fails its request) in _apply_constraints."""
    for c in constraints:
        try:
            c.prefetch()
        except Exception:
            log.exception("computing a token constraint's mask ahead failed")


PREDICTION_TOKENS = 8  # drafts per step at most from a request's predicted output, unless it says


def _merge(chunks: list[StreamChunk]) -> StreamChunk:
    """One request's chunks of one step (the tokens a verification kept) as one chunk."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return StreamChunk(last.request_id, "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                       [lp for c in chunks for lp in c.logprobs], last.finish_reason, last.usage, last.timings,
                       last.error)


def _constraint_failure(e: Exception) -> str:
    log.exception("a request's token constraint failed")
    return f"the request's output constraint failed: {type(e).__name__}: {e}".splitlines()[0]


class EngineCore:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, config: EngineConfig, kv_spec: KVCacheSpec, max_len: int,
                 offload: OffloadRuntime | None = None, proposer: Proposer | None = None):
        self.loaded = loaded
        # Speculative decoding (llmsys.engine.speculative): drafts for decoding sequences, verified
        # in the step itself; None: one token per sequence per step.
        self.proposer = proposer
        self.spec_stats = SpecStats()
        self.offload = offload  # llmsys.offload weight runtime (streamed / off-device layers), None: all resident
        self.tokenizer = tokenizer
        self.config = config
        self.max_len = max_len  # prompt + output tokens per request, at most
        # Computes grammar masks while a step's forward runs (step()); its thread starts on first use.
        self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmsys-masks")
        self.kv = make_kv_pool(kv_spec, loaded.device)
        # Cold KV tier (None unless --kv-offload-tokens): block ids past the pool, demoted to disk / RAM.
        self.tier = make_kv_tier(self.kv, config.offload_tokens(kv_spec.bytes_per_token), config.offload_dir,
                                 config.kv_offload_tier, config.kv_offload_drop_cache)
        self.allocator = BlockAllocator(kv_spec.num_blocks, self.tier.num_cold if self.tier is not None else 0)
        # KV eviction / page selection. config.kv_policy is the default; a request may choose its own
        # (SamplingParams.kv_policy). Sequences under `full` carry no policy state: no per-token work.
        # Quest's summaries know the cold tier: it reads only the cold pages it selects.
        self.kv_policy = make_policy_runtime(config.kv_policy, loaded.model, self.kv, self.allocator,
                                             kv_spec.block_size, max_len, tier=self.tier)
        # The attention backend, chosen once for this device and pool (engine/attention.py).
        self.attn = make_backend(self.kv, loaded.device, kv_spec.block_size, self.kv_policy.quest)
        # The sliding layers' rings (engine/sliding_kv.py; None: every layer's KV in the block tables).
        self.ring = RingTables(kv_spec.sliding, kv_spec.block_size) if kv_spec.sliding is not None else None
        # Swap space for preempted sequences (None: recompute only). It copies one block id across every
        # layer, so an engine with rings recomputes (an explicit --swap-space kept every layer full instead).
        self.swap = make_swap_space(self.kv, 0 if self.ring is not None else config.swap_space, config.offload_dir)
        # The prefix cache's disk tier (--kv-disk; llmsys.engine.kv_disk): full blocks written as they are
        # made and read back by a later process; None: off.
        self.kv_disk = open_kv_disk(config, loaded, self.kv, type(self.attn).__name__, self.quant_kernels,
                                    self.ring is not None)
        self.scheduler = Scheduler(
            self.allocator, kv_spec.block_size, config.max_num_seqs, config.max_num_batched_tokens,
            prefix_caching=config.prefix_caching, kv_policy=self.kv_policy, swap=self.swap, tier=self.tier,
            ring=self.ring, kv_disk=self.kv_disk,
        )
        self.runner = ModelRunner(loaded.model, self.attn, loaded.device, kv_spec.block_size,
                                  kv_policy=self.kv_policy, swap=self.swap, tier=self.tier,
                                  layers=offload if offload is not None and offload.runs_layers else None)
        self.sampler = Sampler()
        eos = set(loaded.args.eos_token_id) | set(tokenizer.eos_token_ids)
        gen_eos = loaded.generation_config.get("eos_token_id")
        if gen_eos is not None:
            eos |= {gen_eos} if isinstance(gen_eos, int) else set(gen_eos)
        self.eos_token_ids = tuple(sorted(eos))
        self.requests: dict[str, Sequence] = {}
        self._pending: list[StreamChunk] = []  # chunks produced outside step() (aborts)
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, constraint: TokenConstraint | None = None,
        sample_index: int = 0, pooling: Pooling | None = None,
    ) -> str:
        """Queue one completion; ``sample_index`` (0..params.n-1) says which of the prompt's ``n``.

        The front end adds all ``n`` (each gets its own id, KV and chunks); the
        index only chooses the generator, derived from the seed by
        :func:`make_generator`, the one place the derivation lives.

        With ``pooling`` it is an embedding request instead: the prompt is prefilled like any other
        (batched, chunked, under the full KV policy) and its final chunk carries the pooled vector
        (``StreamChunk.embedding``); it samples nothing and its KV is freed at once.
        """
        if not 0 <= sample_index < params.n:
            raise InvalidParameterError(f"sample_index {sample_index} is outside 0..{params.n - 1} (n={params.n})")
        if not prompt_ids:
            raise InvalidParameterError("the prompt is empty; give at least one token")
        vocab = self.loaded.args.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameterError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        bad = next((t for t in params.prediction if t >= vocab), None)
        if bad is not None:
            raise InvalidParameterError(f"prediction token id {bad} is outside the vocabulary (0..{vocab - 1})")
        policy = self.kv_policy.resolve(params.kv_policy)  # the request's, else the engine's
        if pooling is not None and policy.evicts:  # an embedding sees every token of its input
            policy = self.kv_policy.resolve("full")
        if pooling is not None:
            pooling.check()
            if len(prompt_ids) > self.max_len:  # nothing is generated: the whole context may be prompt
                raise ContextOverflowError(len(prompt_ids), self.max_len)
        elif len(prompt_ids) >= self.max_len and not policy.allows_long_prompts:
            raise ContextOverflowError(len(prompt_ids), self.max_len)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidParameterError(f"request id {rid!r} is already in use")
        # Evicting policies slide past the context (their KV stays within the budget): max_tokens
        # new tokens after the prompt, or max_len of them when the request sets no max_tokens.
        limit = self.max_len
        if policy.evicts:
            limit = len(prompt_ids) + (params.max_tokens if params.max_tokens is not None else self.max_len)
        ids = list(prompt_ids)
        state = TextState(
            IncrementalDetokenizer(self.tokenizer, ids), StopChecker(params.stop) if params.stop else None,
            constraint=constraint, pooler=Pooler(pooling, len(ids)) if pooling is not None else None,
        )
        seq = Sequence(rid, ids, params, limit, generator=make_generator(params.seed, self.loaded.device, sample_index),
                       state=state, kv=self.kv_policy.new_state(policy))
        if pooling is not None:
            seq.prefix_reuse = state.pooler.reuses_prefix
        self.requests[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (e.g. client went away)."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.finished:
            return
        self.scheduler.finish(seq, "abort")
        seq.finish_time = time.perf_counter()
        self._pending.append(self._final_chunk(seq, "", []))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # -- one step ------------------------------------------------------------
    def forward(self, sched: SchedulerOutput) -> StepResult:
        """Run one scheduled step (KV copies, the model, logits of the sampling rows) and record
        what it computed in the scheduler. The one way a step runs: :meth:`step` and the
        benchmarks call it; sampling and text are the caller's."""
        pooled = {s.request_id for s in sched.scheduled
                  if (q := self.requests.get(s.request_id)) is not None and q.state.pooler is not None}
        result = self.runner.execute(sched, pooled)
        self.scheduler.update_from_output(sched, result)  # before sampling: a request that stops now frees its blocks
        return result

    def _propose(self) -> dict[str, list[int]] | None:
        """Drafts for the running sequences that decode (speculative decoding), by request id.

        Not for a sequence with a token constraint (its drafts would need the grammar's
        look-ahead) or under an evicting KV policy (its per-token bookkeeping); none at all in a
        step where any running sequence carries policy state, whose attention scores are laid
        out per sequence. A draft never runs past ``max_tokens`` or the context: with ``k``
        drafts a verification yields at most ``k + 1`` tokens. ``k`` adapts per sequence
        (:meth:`_adapt_k`) up to the request's ``spec_tokens`` (default ``--spec-tokens``; 0:
        none). A request with a ``prediction`` takes its drafts from it first (any engine, with
        or without a proposer), the engine's proposer where the prediction has no match.
        """
        running = self.scheduler.running
        if any(s.kv is not None for s in running):
            return None
        drafts: dict[str, list[int]] = {}
        reqs = []
        for s in running:
            p = s.params
            if (s.num_computed != s.num_tokens - 1 or s.state.constraint is not None or p.spec_tokens == 0
                    or s.state.pooler is not None):
                continue
            if self.proposer is None and not p.prediction:
                continue
            cap = self._spec_cap(p)
            k = min(s.spec_k or cap, cap, s.max_len - s.num_tokens - 1)
            if p.max_tokens is not None:
                k = min(k, p.max_tokens - len(s.output_ids) - 1)
            if k < 1:
                continue
            d = predicted_continuation(p.prediction, s.output_ids, k)
            if d:
                drafts[s.request_id] = d
            elif self.proposer is not None:
                reqs.append(ProposalRequest(s.request_id, s.tokens, k))
        if reqs:
            try:
                proposed = self.proposer.propose(reqs, set(self.requests))
            except Exception:  # a draft model's fault must not stop the engine: this step goes without
                log.exception("the speculative proposer %s failed; this step decodes without its drafts",
                              self.proposer.name)
                proposed = []
            for r, d in zip(reqs, proposed):
                if d:
                    drafts[r.request_id] = d[: r.k]
        return drafts or None

    def offload_parts(self) -> list[KVTier | KVSwapSpace]:
        """The offload parts that can fail and come back (``llmsys.offload.recovery``): cold tier, swap."""
        return [p for p in (self.tier, self.swap) if p is not None]

    def degraded(self) -> list[str]:
        """One line per offload part that is off after an I/O failure (what ``/health`` lists); empty when
        everything works. Safe from another thread: each part's state is one frozen object."""
        return [line for p in self.offload_parts() if (line := p.recovery.describe()) is not None]

    def step(self) -> list[StreamChunk]:
        chunks, self._pending = self._pending, []
        for part in self.offload_parts():  # an offload part off after a failure retries once its backoff ran out
            if part.recovery.due():
                part.retry()
        sched = self.scheduler.schedule(self._propose())
        chunks.extend(self._failed(sched.failed))
        if sched.empty:
            return chunks
        now = time.perf_counter()
        for s in sched.scheduled:
            st = self.requests[s.request_id].state
            if st.start_time is None:
                st.start_time = now
        # Constrained rows' masks depend only on tokens already sampled: computed on the mask
        # thread while the forward runs (llguidance releases the GIL), not after it, in series.
        constraints = [c for s in sched.scheduled if (c := self.requests[s.request_id].state.constraint) is not None]
        ahead = self._mask_thread.submit(_prefetch, constraints) if constraints else None
        try:
            result = self.forward(sched)
        except KVReadError as e:
            # Offload blocks that could not be read back: their sequences re-prefill, every other
            # sequence runs this step again next time (it changed nothing they hold: module doc of
            # offload/kv_tier.py). A loss nobody holds would fail again each step: raise it.
            if not self.scheduler.drop_unreadable(e.blocks):
                raise
            return chunks
        except Exception as e:
            return chunks + self._isolate(sched, e)
        finally:
            if ahead is not None:
                ahead.result()  # the masks are ready before anything reads or advances a constraint
        if self.swap is not None and sched.num_tokens > len(sched.scheduled):
            # A step with prefill chunks: what recomputing a token costs here (swap vs recompute).
            self.swap.observe_prefill(time.perf_counter() - now, sched.num_tokens)
        if result.hidden:
            chunks.extend(self._pool(sched, result))
        if not result.sample_ids:
            return chunks
        seqs = [self.requests[rid] for rid in result.sample_ids]
        return chunks + self._sample(sched, result, seqs)

    def _sample(self, sched: SchedulerOutput, result: StepResult, seqs: list[Sequence]) -> list[StreamChunk]:
        """Sample the step's rows and append what each sequence keeps (its news as one chunk each).

        A sequence without drafts has one row and keeps its token. With drafts ``d`` (a
        verification), row ``j`` sees the output so far plus ``d[:j]`` (penalties, min_tokens) and
        judges ``d[j]``; the sequence keeps the accepted prefix and the first token the target chose
        itself (the correction, or after every draft the bonus token), stopping early where a token
        ends the request. A sequence with constraints never has drafts (:meth:`_propose`), so every
        constrained row is a one-row sequence."""
        counts = result.sample_rows or [1] * len(seqs)
        fed = {s.request_id: s for s in sched.scheduled}
        rows: list[Sequence] = []
        outs: list[list[int]] = []
        drafts: list[int | None] = []
        for seq, n in zip(seqs, counts):
            d = fed[seq.request_id].token_ids[len(fed[seq.request_id].token_ids) - (n - 1):] if n > 1 else []
            for j in range(n):
                rows.append(seq)
                outs.append(seq.output_ids + d[:j] if j else seq.output_ids)
                drafts.append(d[j] if j < len(d) else None)
        batch = SamplingBatch(params=[s.params for s in rows], prompt_ids=[s.prompt_ids for s in rows],
                              output_ids=outs, generators=[s.generator for s in rows],
                              eos_token_ids=self.eos_token_ids)
        logits, broken = _apply_constraints(result.logits, rows)
        sampled = self.sampler.sample(logits, batch, drafts if result.sample_rows is not None else None)
        now = time.perf_counter()
        chunks: list[StreamChunk] = []
        i = 0
        for seq, n in zip(seqs, counts):
            first, i = i, i + n
            if n > 1:
                self.spec_stats.verify_seqs += 1
                self.spec_stats.proposed += n - 1
                seq.num_drafted += n - 1
            if seq.state.constraint is not None and seq.request_id not in broken:
                try:
                    seq.state.constraint.advance(sampled.token_ids[first])
                except Exception as e:
                    broken[seq.request_id] = _constraint_failure(e)
            if seq.request_id in broken:
                chunks.append(self._end_with_error(seq, broken[seq.request_id], CONSTRAINT_FAILED))
                continue
            news: list[StreamChunk] = []
            kept = 0
            for r in range(first, i):
                tok, took_draft = sampled.token_ids[r], r < i - 1 and sampled.accepted[r]
                self.scheduler.append_tokens([seq], [tok])
                if took_draft:  # its KV was written by this step
                    self.scheduler.accept_draft(seq)
                    self.spec_stats.accepted += 1
                    seq.num_draft_accepted += 1
                    kept += 1
                chunk = self._append(seq, tok, sampled.logprobs[r], now)
                if chunk is not None:
                    news.append(chunk)
                if seq.finished or not took_draft:
                    break
            if not seq.finished and n > 1:
                self.scheduler.trim_drafts(seq)
                self._adapt_k(seq, n - 1, kept)
            if news:
                chunks.append(_merge(news))
        return chunks

    def _pool(self, sched: SchedulerOutput, result: StepResult) -> list[StreamChunk]:
        """Embedding requests: each fed chunk's hidden states go into its pooler; a request whose whole
        prompt is in ends here, its vector on its final chunk (finish_reason "stop")."""
        now = time.perf_counter()
        out = []
        for s in sched.scheduled:
            rows = result.hidden.get(s.request_id)
            if rows is None:
                continue
            seq = self.requests[s.request_id]
            pooler = seq.state.pooler
            pooler.add(s.start, rows)
            if s.start + s.num_new_tokens < seq.num_tokens:
                continue
            self.scheduler.finish(seq, "stop")
            seq.first_token_time = seq.finish_time = now
            self.requests.pop(seq.request_id, None)
            chunk = self._final_chunk(seq, "", [])
            chunk.embedding = pooler.result()
            out.append(chunk)
        return out

    def _spec_cap(self, p: SamplingParams) -> int:
        """Drafts per step at most for a request: its ``spec_tokens``, else ``--spec-tokens``, else for a
        prediction :data:`PREDICTION_TOKENS` (a prediction is usually right for long stretches)."""
        if p.spec_tokens:
            return p.spec_tokens
        return max(self.config.spec_tokens, PREDICTION_TOKENS) if p.prediction else self.config.spec_tokens

    def _adapt_k(self, seq: Sequence, drafted: int, kept: int) -> None:
        """Next step's draft count for ``seq``: two more after a verification that kept every draft,
        one fewer (at least one) otherwise, at most ``--spec-tokens`` (transformers' assisted
        generation schedule). A rejected draft costs a row of the verification; a sequence whose
        drafts keep failing asks for one at a time."""
        cap = self._spec_cap(seq.params)
        k = seq.spec_k or cap
        k = k + 2 if kept == drafted else k - 1
        seq.spec_k = max(1, min(cap, k))

    def _append(self, seq: Sequence, tok: int, lp, now: float) -> StreamChunk | None:
        st: TextState = seq.state
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        reason = None
        if tok in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
            delta = ""
        else:
            delta = st.detok.add(tok)
            if tok in p.stop_token_ids:
                reason = "stop"
        if st.stop is not None:
            upd = st.stop.add(delta)
            delta = upd.text
            if upd.stopped:
                reason = "stop"
        if reason is None:
            if p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens:
                reason = "length"
            elif seq.num_tokens >= seq.max_len:
                reason = "length"
        lps = [lp] if lp is not None else []
        if reason is None:
            return StreamChunk(seq.request_id, delta, [tok], lps)
        if reason != "stop" or not (st.stop and st.stop.stopped):
            tail = st.detok.flush()
            if st.stop is not None:
                tail = st.stop.add(tail).text + st.stop.flush()
            delta += tail
        self.scheduler.finish(seq, reason)
        seq.finish_time = now
        self.requests.pop(seq.request_id, None)
        return self._final_chunk(seq, delta, [tok], lps)

    def _isolate(self, sched: SchedulerOutput, e: Exception) -> list[StreamChunk]:
        """The step raised (a kernel fault, a bug). One sequence's fault must not fail its neighbours:
        a batch's sequences are run one per step from now on (``Scheduler.isolate``), and only a
        sequence whose step fails alone ends, with finish_reason "error" and the exception's line.
        Nothing the failed step computed was recorded, so each runs that step again."""
        ids = [s.request_id for s in sched.scheduled]
        if len(ids) > 1:
            log.warning("an engine step of %d requests failed (%s: %s); running them one at a time",
                        len(ids), type(e).__name__, e)
            self.scheduler.isolate(ids)
            return []
        log.exception("an engine step failed for request %s alone; ending it", ids[0])
        why = f"the engine failed on this request: {type(e).__name__}: {e}".splitlines()[0]
        return [self._end_with_error(self.requests[ids[0]], why)]

    def _end_with_error(self, seq: Sequence, why: str, code: str = REQUEST_FAILED) -> StreamChunk:
        """Finish ``seq`` alone with finish_reason "error", the one-line ``why`` and its ``code``: its final chunk."""
        self.scheduler.finish(seq, "error")
        return self._failed([(seq.request_id, why)], code)[0]

    def _failed(self, failed: list[tuple[str, str]], code: str = REQUEST_FAILED) -> list[StreamChunk]:
        """Final chunks (finish_reason "error", ``error`` = the scheduler's one line) of the requests
        the scheduler could not go on with; every other request carries on."""
        now = time.perf_counter()
        out = []
        for rid, why in failed:
            seq = self.requests.pop(rid)
            seq.finish_time = now
            out.append(self._final_chunk(seq, "", [], error=why, error_code=code))
        return out

    def _final_chunk(self, seq: Sequence, delta: str, toks: list[int], lps=None, error: str | None = None,
                     error_code: str | None = None) -> StreamChunk:
        st: TextState = seq.state
        start = st.start_time or seq.arrival
        first = seq.first_token_time
        end = seq.finish_time or time.perf_counter()
        timings = Timings(
            ttft_s=(first - seq.arrival) if first else 0.0,
            prefill_s=(first - start) if first else 0.0,
            decode_s=(end - first) if first else 0.0,
            total_s=end - seq.arrival,
            prompt_tokens=len(seq.prompt_ids),
            generated_tokens=len(seq.output_ids),
        )
        usage = Usage(
            len(seq.prompt_ids), len(seq.output_ids), seq.kv.evicted if seq.kv is not None else 0, seq.num_cached_tokens,
            seq.num_drafted, seq.num_draft_accepted,
        )
        return StreamChunk(seq.request_id, delta, toks, lps or [], seq.finish_reason, usage, timings, error, error_code)

    # -- accounting ----------------------------------------------------------
    @functools.cached_property
    def quant_kernels(self) -> dict[str, int]:
        """Quantized layers per matmul kernel: each layer chose its kernel when it was built, so this
        is counted once, not per report (the server reports every step)."""
        return kernel_counts(self.loaded.model)

    def memory_report(self) -> MemoryReport:
        """What :class:`MemoryReport` says, from the allocators' counts (cheap: no tensor is read)."""
        tier = self.loaded.device.type
        tier = "gpu" if tier == "cuda" else "cpu"
        spec = self.kv.spec
        per_block = spec.bytes_per_token * spec.block_size
        ring_block = spec.ring_bytes_per_token * spec.block_size
        al, ring = self.allocator, self.ring
        used = al.num_used
        rt = self.offload  # weights per tier
        weights = rt.weight_bytes(self.loaded.model) if rt is not None else {tier: self.loaded.weight_bytes}
        on_file = self.loaded.model.embed_file_bytes  # a tied embedding served from the checkpoint
        if on_file:
            weights["disk"] = weights.get("disk", 0) + on_file
        sw = self.swap
        ring_used = ring.allocator.num_used if ring is not None else 0  # sliding layers' ring blocks (sliding_kv)
        kv_total = {tier: spec.nbytes}
        kv_used = {tier: used * per_block + ring_used * ring_block}
        kv_cached = {tier: al.num_cached * per_block + (ring.allocator.num_cached * ring_block if ring else 0)}
        touched = al.high_water + 1  # blocks 0 (scratch) .. the highest handed out
        ring_touched = ring.allocator.high_water + 1 if ring is not None else 0
        kv_resident = {tier: spec.resident_nbytes(touched, ring_touched, on_demand=tier == "cpu")}
        staging = rt.staging_bytes() if rt is not None else {}
        tr, by_tier = self.tier, None
        if tr is not None:  # cold blocks under their own tier ('disk' for a CPU pool, 'cpu' for a GPU pool)
            cold = al.num_cold_used
            kv_total[tr.tier] = kv_total.get(tr.tier, 0) + tr.nbytes()
            kv_used[tr.tier] = kv_used.get(tr.tier, 0) + cold * tr.block_bytes
            kv_cached[tr.tier] = kv_cached.get(tr.tier, 0) + al.num_cold_cached * tr.block_bytes
            # pinned RAM is allocated whole; a file holds the blocks written to it (at most every one)
            kv_resident[tr.tier] = kv_resident.get(tr.tier, 0) + (
                tr.nbytes() if tr.tier != "disk" else (cold + al.num_cold_cached) * tr.block_bytes)
            staging[tier] = staging.get(tier, 0) + tr.staging_bytes()
            by_tier = {tier: (used, spec.num_blocks - 1)}
            u, t = by_tier.get(tr.tier, (0, 0))
            by_tier[tr.tier] = (u + cold, t + tr.num_cold)
        return MemoryReport(
            weights=weights,
            staging=staging,
            kv_total=kv_total,
            kv_used=kv_used,
            kv_resident=kv_resident,
            kv_cached=kv_cached,
            kv_blocks_total=spec.num_blocks - 1,
            kv_blocks_used=used,
            kv_blocks_cached=al.num_cached,
            block_size=spec.block_size,
            kv_swap_total={sw.tier: sw.nbytes()} if sw is not None else {},
            kv_swap_used={sw.tier: sw.used_bytes()} if sw is not None else {},
            kv_cold_blocks_total=tr.num_cold if tr is not None else 0,
            kv_cold_blocks_used=al.num_cold_used if tr is not None else 0,
            kv_blocks_by_tier=by_tier,
            kv_disk=self.kv_disk.report() if self.kv_disk is not None else None,
            kernels=dict(self.quant_kernels),
            stored_formats=dict(self.loaded.stored_formats),
            experts=rt.expert_report() if rt is not None else None,
            kv_layers=self._kv_layers(),
        )

    def _kv_layers(self) -> dict[str, KVLayerReport]:
        """:attr:`MemoryReport.kv_layers`: global layers on the block tables' blocks; sliding ones on the
        rings' (engine/sliding_kv.py) or, keeping every position, on the block tables' too."""
        spec, bs = self.kv.spec, self.kv.spec.block_size
        per = spec.layer_bytes_per_token
        sliding = len(sliding_layers(self.loaded.args))

        def group(layers: int, ring: bool, used: int, blocks: int) -> KVLayerReport:  # blocks: scratch included
            return KVLayerReport(layers, ring, used, blocks - 1, int(used * bs * per * layers),
                                 int(blocks * bs * per * layers))

        out = {"global": group(spec.num_layers - sliding, False, self.allocator.num_used, spec.num_blocks)}
        if self.ring is not None:
            out["sliding"] = group(sliding, True, self.ring.num_used, spec.sliding.num_blocks)
        elif sliding:
            out["sliding"] = group(sliding, False, self.allocator.num_used, spec.num_blocks)
        return out
