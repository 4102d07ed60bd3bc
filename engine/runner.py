"""Turns a scheduler decision into tensors, runs the model, returns logits.

The runner is the only place where scheduler state (Python lists) becomes
tensors: packed input ids and positions, KV slots, attention metadata. It
returns the logits of the sequences that sample this step; sampling itself is
the engine core's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmsys.engine.attention import AttentionBackend, AttentionMetadata
from llmsys.engine.models.base import DecoderModel
from llmsys.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from llmsys.offload.kv_policy import PolicyRuntime
    from llmsys.offload.kv_swap import KVSwapSpace
    from llmsys.offload.kv_tier import KVTier


@dataclass
class StepBatch:
    """Tensors of one step, ready for the model."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_index: torch.Tensor  # [S] packed index of the last token of each sampling seq
    sample_rows: list[int]  # which scheduled entries sample (in order)


class ModelRunner:
    def __init__(self, model: DecoderModel, attn: AttentionBackend, device: torch.device, block_size: int,
                 kv_policy: PolicyRuntime | None = None, swap: KVSwapSpace | None = None, tier: KVTier | None = None):
        self.model = model
        self.attn = attn  # the engine's attention backend (make_backend), owner of the KV pool
        self.kv = attn.pool
        self.device = device
        self.block_size = block_size
        self.kv_policy = kv_policy  # llmsys.offload.kv_policy.PolicyRuntime, or None
        self.swap = swap  # llmsys.offload.kv_swap.KVSwapSpace, or None (no swap space)
        self.tier = tier  # llmsys.offload.kv_tier.KVTier, or None (every block in the pool)

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        ids: list[int] = []
        pos: list[int] = []
        qlens: list[int] = []
        clens: list[int] = []
        tables: list[list[int]] = []
        sample_index: list[int] = []
        sample_rows: list[int] = []
        prompt: list[bool] = []  # the step feeds sequence b prompt tokens
        for row, s in enumerate(sched.scheduled):
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed
            base = seq.kv_len  # == start unless a policy evicted (positions = cache indices)
            toks = seq.tokens
            ids.extend(toks[start : start + n])
            pos.extend(range(base, base + n))
            qlens.append(n)
            clens.append(base + n)
            prompt.append(start < len(seq.prompt_ids))
            tables.append(seq.block_table)
            if s.samples:
                sample_index.append(len(ids) - 1)
                sample_rows.append(row)
        cold = None
        if self.tier is not None:
            first = self.tier.first
            cold_ids = sorted({b for t in tables for b in t if b >= first})
            cold = self.tier.cold_blocks(cold_ids) if cold_ids else None
        score_from = self.kv_policy.score_from(sched.scheduled) if self.kv_policy is not None else None
        meta = self.attn.metadata(qlens, clens, tables, cold, prompt, score_from)
        if cold is not None:
            # Quest decode reads only the pages it selects (synchronously, per layer): no prefetch.
            self.tier.begin_step(prefetch=not (meta.is_decode and self.attn.selects_pages))
        return StepBatch(
            input_ids=torch.as_tensor(ids, dtype=torch.int64, device=self.device),
            positions=torch.as_tensor(pos, dtype=torch.int64, device=self.device),
            meta=meta,
            sample_index=torch.as_tensor(sample_index, dtype=torch.int64, device=self.device),
            sample_rows=sample_rows,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run one step; returns logits ``[S, V]`` (float32) and the sampling rows."""
        # Outs first: a block freed by a swap-out or a demotion may be the target of a swap-in this step.
        if sched.swap_out:
            self.swap.copy_out(sched.swap_out)
        if sched.demote:
            self.tier.demote(sched.demote)
            self.attn.on_demote(sched.demote)
        if sched.swap_in:
            self.swap.copy_in(sched.swap_in)
        batch = self.prepare(sched)
        try:
            hidden = self.model(batch.input_ids, batch.positions, self.attn, batch.meta)  # [T, hidden]
        finally:
            if batch.meta.cold is not None:
                self.tier.end_step()
        if self.kv_policy is not None:
            self.kv_policy.after_forward(sched.scheduled, batch.meta)
        for s in sched.scheduled:  # before any return: a step of mid-prefill chunks must advance too
            s.seq.num_computed += s.num_new_tokens
        if not batch.sample_rows:
            return hidden.new_empty((0, self.model.args.vocab_size), dtype=torch.float32), []
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_index)).float()
        return logits, batch.sample_rows
