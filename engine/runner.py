"""Turns a scheduler decision (plain data) into tensors, runs the model, returns logits.

The runner is the only place where a step's lists become tensors: packed
input ids and positions, KV slots, attention metadata. It changes no
sequence: :meth:`ModelRunner.execute` is a function of the
:class:`SchedulerOutput` (plus the KV pool it writes), and the scheduler's
``update_from_output`` records what the step computed. Sampling is the
engine core's job. :meth:`ModelRunner.forward` is the one forward of a step;
every loop that runs the model over the pool (the engine, bench, stream
perplexity) goes through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Container

import torch

from llmsys.engine.attention import AttentionBackend, AttentionMetadata
from llmsys.engine.models.base import DecoderModel
from llmsys.engine.models.decode_plan import build_decode_plan
from llmsys.engine.scheduler import SchedulerOutput, StepResult

if TYPE_CHECKING:
    from llmsys.kernels.common.protocols import LayerRunner
    from llmsys.offload.kv_policy import PolicyRuntime
    from llmsys.offload.kv_swap import KVSwapSpace
    from llmsys.offload.kv_tier import KVTier


@dataclass
class StepBatch:
    """Tensors of one step, ready for the model."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_index: torch.Tensor | None  # [S] packed rows whose logits are returned; None: every row
    # Embedding requests: request id -> (first, end) packed rows whose final hidden states are returned
    pool_rows: dict[str, tuple[int, int]] = field(default_factory=dict)


class ModelRunner:
    """``kv_policy`` installs the attention that records scores or selects pages; ``swap`` and
    ``tier`` copy the step's KV blocks (None: no swap space / no cold tier); ``layers`` runs
    streamed layers (the offload runtime; None: every layer resident)."""

    def __init__(self, model: DecoderModel, attn: AttentionBackend, device: torch.device, block_size: int,
                 kv_policy: PolicyRuntime | None = None, swap: KVSwapSpace | None = None, tier: KVTier | None = None,
                 layers: LayerRunner | None = None):
        self.model = model
        self.layers = layers
        self.attn = attn  # the engine's attention backend (make_backend), owner of the KV pool
        self.kv = attn.pool
        self.device = device
        self.block_size = block_size
        self.kv_policy = kv_policy  # llmsys.offload.kv_policy.PolicyRuntime, or None
        self.swap = swap  # llmsys.offload.kv_swap.KVSwapSpace, or None (no swap space)
        self.tier = tier  # llmsys.offload.kv_tier.KVTier, or None (every block in the pool)
        # The CPU decode kernels, decided once here for the engine's life (engine/models/decode_plan.py).
        self.decode_plan = build_decode_plan(model, attn, layers)

    def prepare(self, sched: SchedulerOutput, pooled: Container[str] = ()) -> tuple[StepBatch, list[str], list[int] | None]:
        """The step's tensors, the request ids of the sequences that sample (in order) and, when the
        step verifies drafts, each one's number of logits rows (None: one row each). The sequences of
        ``pooled`` (embedding requests) sample nothing: the step returns their rows' hidden states.

        A sequence's verification (its known token then ``num_draft`` drafts, speculative
        decoding) is laid out as that many decode rows of one token each, row ``j`` seeing the
        context up to its own position: the same attention a plain decode step computes for that
        token (the decode kernel, not the prompt path), so verified logits are the ones plain
        decoding would give. All rows' K/V are written before any row attends (the layer stores
        the step's K/V first), so row ``j`` reads the drafts before it."""
        ids: list[int] = []
        pos: list[int] = []
        qlens: list[int] = []
        clens: list[int] = []
        slens: list[int] = []  # each sequence's context once its known tokens are in (LongRoPE's table)
        tables: list[list[int]] = []
        rings: list[list[int]] = []  # the sliding layers' ring tables (engine/sliding_kv.py), when the engine has them
        sample_index: list[int] = []
        sample_ids: list[str] = []
        sample_rows: list[int] = []
        prompt: list[bool] = []  # the step feeds sequence b prompt tokens
        pool_rows: dict[str, tuple[int, int]] = {}
        for s in sched.scheduled:
            n, base = s.num_new_tokens, s.position  # positions = cache indices
            ids.extend(s.token_ids)
            pos.extend(range(base, base + n))
            if s.num_draft:  # one decode row per fed token (see the docstring)
                qlens.extend([1] * n)
                clens.extend(range(base + 1, base + n + 1))
                slens.extend(range(base + 1, base + n + 1))
                prompt.extend([False] * n)
                tables.extend([s.block_table] * n)
                rings.extend([s.ring_table] * n)
            else:
                qlens.append(n)
                clens.append(base + n)
                slens.append(s.length or base + n)
                prompt.append(s.is_prompt)
                tables.append(s.block_table)
                rings.append(s.ring_table)
            if s.request_id in pooled:
                pool_rows[s.request_id] = (len(ids) - n, len(ids))
            elif s.samples:
                rows = 1 + s.num_draft
                sample_index.extend(range(len(ids) - rows, len(ids)))
                sample_ids.append(s.request_id)
                sample_rows.append(rows)
        cold = None
        if self.tier is not None:
            first = self.tier.first
            cold_ids = sorted({b for t in tables for b in t if b >= first})
            cold = self.tier.cold_blocks(cold_ids) if cold_ids else None
        score_from = self.kv_policy.score_from(sched.scheduled) if self.kv_policy is not None else None
        meta = self.attn.metadata(qlens, clens, tables, cold, prompt, score_from)
        if slens != clens:  # a prompt chunk short of its prompt's end
            meta = replace(meta, seq_lens=slens)
        if rings and rings[0] is not None:  # the same step over the ring tables (never cold)
            meta = replace(meta, ring=self.attn.metadata(qlens, clens, rings, None, prompt))
        if cold is not None:
            # Quest decode reads only the pages it selects (synchronously, per layer): no prefetch.
            self.tier.begin_step(prefetch=not (meta.is_decode and self.attn.selects_pages))
        batch = StepBatch(
            input_ids=torch.as_tensor(ids, dtype=torch.int64, device=self.device),
            positions=torch.as_tensor(pos, dtype=torch.int64, device=self.device),
            meta=meta,
            logits_index=torch.as_tensor(sample_index, dtype=torch.int64, device=self.device),
            pool_rows=pool_rows,
        )
        return batch, sample_ids, sample_rows if len(sample_rows) != len(sample_index) else None

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The model over the pool: logits ``[S, V]`` (float32) of ``batch.logits_index``'s rows."""
        return self.forward_pooled(batch)[0]

    @torch.inference_mode()
    def forward_pooled(self, batch: StepBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`forward`'s logits, and the final norm's rows of ``batch.pool_rows`` (embedding requests)."""
        try:
            hidden = self.model(batch.input_ids, batch.positions, self.attn, batch.meta, self.layers)  # [T, hidden]
        finally:
            if batch.meta.cold is not None:
                self.tier.end_step()
        pooled = {rid: hidden[a:b] for rid, (a, b) in batch.pool_rows.items()}
        if batch.logits_index is not None:
            if not batch.logits_index.numel():
                return hidden.new_empty((0, self.model.args.vocab_size), dtype=torch.float32), pooled
            hidden = hidden.index_select(0, batch.logits_index)  # [S, hidden]
        return self.model.compute_logits(hidden).float(), pooled

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, pooled: Container[str] = ()) -> StepResult:
        """Copy the step's KV blocks, then run it; no sequence changes here. ``pooled``: the request ids of
        embedding requests (their hidden states come back instead of logits)."""
        # Outs first: a block freed by a swap-out or a demotion may be the target of a swap-in this step.
        if sched.swap_out:
            self.swap.copy_out(sched.swap_out)
        if sched.demote:
            self.tier.demote(sched.demote)
            self.attn.on_demote(sched.demote)
        if sched.swap_in:
            self.swap.copy_in(sched.swap_in)
        batch, sample_ids, sample_rows = self.prepare(sched, pooled)
        logits, hidden = self.forward_pooled(batch)
        return StepResult(logits, sample_ids, batch.meta, sample_rows, hidden)
