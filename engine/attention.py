"""Attention metadata and dispatch over the paged KV cache.

The model never sees a global context: every forward pass receives an
:class:`AttentionMetadata` describing the packed batch (which tokens belong to
which sequence, where their K/V go, which blocks hold each sequence's
history). Tokens of all sequences are packed into one ``[T, ...]`` tensor so
the linear layers run once for the whole batch; only attention needs to know
the sequence boundaries. The math itself lives in ``llmsys.kernels``: Triton
paged attention on CUDA, the gather + SDPA fast path on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmsys import kernels
from llmsys.kernels.cpu_attention import GatherPlan, make_gather_plan, paged_attention_gathered


@dataclass
class AttentionMetadata:
    """Per-step layout of the packed batch (``B`` sequences, ``T`` new tokens).

    Sequence ``b`` owns packed tokens ``query_start[b]:query_start[b+1]``;
    after this step its context (cached prefix + new tokens) holds
    ``context_lens[b]`` tokens, stored in the blocks ``block_tables[b]``.
    """

    slot_mapping: torch.Tensor  # [T] int64: KV slot (block * block_size + offset) of each new token
    query_start: list[int]  # B + 1 offsets into the packed tokens
    context_lens: list[int]  # [B]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens_t: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    is_decode: bool  # every sequence has exactly one new token
    plan: GatherPlan | None  # CPU fast path layout (None on CUDA)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Tensors attention needs, from plain Python lists.

    Sequence ``b``'s new tokens are positions ``context_lens[b] -
    query_lens[b] .. context_lens[b] - 1`` of its context; ``block_tables[b]``
    must cover ``context_lens[b]`` tokens.
    """
    B = len(query_lens)
    nblk = max(len(t) for t in block_tables)
    table = torch.zeros((B, nblk), dtype=torch.int32)
    slots: list[torch.Tensor] = []
    starts = [0]
    for b, t in enumerate(block_tables):
        tt = torch.as_tensor(t, dtype=torch.int64)
        table[b, : len(t)] = tt.to(torch.int32)
        pos = torch.arange(context_lens[b] - query_lens[b], context_lens[b])
        slots.append(tt[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + query_lens[b])
    plan = None
    if device.type != "cuda":
        plan = make_gather_plan(query_lens, context_lens, block_tables, block_size, device)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start=starts,
        context_lens=list(context_lens),
        block_tables=table.to(device),
        context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        is_decode=max(query_lens) == 1,
        plan=plan,
    )


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Attend each new token over its sequence's cached context."""
    if meta.plan is not None:
        return paged_attention_gathered(q, k_cache, v_cache, meta.plan, scale)
    if meta.is_decode:
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, scale)
    return kernels.paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, meta.query_start_loc, scale
    )
