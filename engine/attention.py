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
from typing import Any

import torch

from llmsys import kernels
from llmsys.kernels.cpu_attention import ColdBlocks, GatherPlan, make_gather_plan, paged_attention_gathered


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
    # KV policy override (llmsys.offload.kv_policy): called as f(q, k_cache, v_cache, meta, scale)
    # instead of the kernels when a policy needs scores (H2O/SnapKV) or page selection (Quest).
    policy_attn: Any = None
    # The step's cold KV blocks (llmsys.offload.kv_tier): block-table ids >= cold.first live outside
    # the pool; the gather plan reads them from the tier's staging (None: every block is in the pool).
    cold: ColdBlocks | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    cold: ColdBlocks | None = None,
    prompt: list[bool] | None = None,
) -> AttentionMetadata:
    """Tensors attention needs, from plain Python lists.

    Sequence ``b``'s new tokens are positions ``context_lens[b] -
    query_lens[b] .. context_lens[b] - 1`` of its context; ``block_tables[b]``
    must cover ``context_lens[b]`` tokens. With ``cold``, table entries
    ``>= cold.first`` are cold blocks: the step gets a gather plan on any
    device (the plan reads them from the tier's staging), and new tokens must
    land in pool blocks. ``prompt[b]``: sequence b's new tokens are prompt tokens
    (the CPU plan gives them the prefill attention even one at a time, see
    ``make_gather_plan``).
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
    if device.type != "cuda" or cold is not None:
        plan = make_gather_plan(query_lens, context_lens, block_tables, block_size, device, cold, prompt)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start=starts,
        context_lens=list(context_lens),
        block_tables=table.to(device),
        context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        is_decode=max(query_lens) == 1,
        plan=plan,
        cold=cold,
    )


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    """Write new K/V ``[T, Hk, D]`` into the pool; quantized pools quantize on write."""
    if isinstance(k_cache, torch.Tensor):
        kernels.kv_store(k, v, k_cache, v_cache, slot_mapping)
    elif k_cache.bits == 8:  # kernels' int8 layout: codes + per (slot, head) scales
        kernels.kv_store(k, v, k_cache.codes, v_cache.codes, slot_mapping, k_cache.scale, v_cache.scale)
    else:  # int4 KIVI (torch)
        k_cache.store(k, slot_mapping)
        v_cache.store(v, slot_mapping)


def _quantized_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Quantized pools: int8 -> the kernels (dequantize inside); int4 -> gather, dequantize, SDPA."""
    if k_cache.bits == 8:
        kc, vc, ks, vs = k_cache.codes, v_cache.codes, k_cache.scale, v_cache.scale
        if meta.plan is not None:
            return paged_attention_gathered(q, kc, vc, meta.plan, scale, ks, vs)
        if meta.is_decode:
            return kernels.paged_decode_attention(q, kc, vc, meta.block_tables, meta.context_lens_t, scale, ks, vs)
        return kernels.paged_prefill_attention(
            q, kc, vc, meta.block_tables, meta.context_lens_t, meta.query_start_loc, scale, ks, vs
        )
    from llmsys.quant.kv_paged import attention_gathered

    plan = meta.plan
    if plan is None:  # CUDA metadata has no gather plan; int4 KV runs the torch path there too
        qlens = [meta.query_start[b + 1] - meta.query_start[b] for b in range(meta.num_seqs)]
        tables = [row[: -(-n // k_cache.bs)] for row, n in zip(meta.block_tables.tolist(), meta.context_lens)]
        plan = make_gather_plan(qlens, meta.context_lens, tables, k_cache.bs, q.device)
    k = k_cache.gather(plan.gather_slots, q.dtype)  # [B, Lmax, Hk, D]
    v = v_cache.gather(plan.gather_slots, q.dtype)
    return attention_gathered(q, k, v, plan, scale)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D] (or a quantized side, llmsys.quant.kv_paged)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Attend each new token over its sequence's cached context."""
    if meta.policy_attn is not None:
        return meta.policy_attn(q, k_cache, v_cache, meta, scale)
    if not isinstance(k_cache, torch.Tensor):
        return _quantized_attention(q, k_cache, v_cache, meta, scale)
    if meta.plan is not None:
        return paged_attention_gathered(q, k_cache, v_cache, meta.plan, scale)
    if meta.is_decode:
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, scale)
    return kernels.paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, meta.query_start_loc, scale
    )
