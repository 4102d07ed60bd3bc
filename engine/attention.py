"""Attention over the paged KV cache, plain torch.

The model never sees a global context: every forward pass receives an
:class:`AttentionMetadata` describing the packed batch (which tokens belong to
which sequence, where their K/V go, which blocks hold each sequence's
history). Tokens of all sequences are packed into one ``[T, ...]`` tensor so
the linear layers run once for the whole batch; only attention needs to know
the sequence boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step layout of the packed batch.

    ``B`` sequences contribute ``T = sum(query_lens)`` new tokens. Sequence
    ``b`` owns packed tokens ``query_start[b]:query_start[b+1]``; after this
    step its context (cached prefix + new tokens) holds ``context_lens[b]``
    tokens. Its token ``j`` lives in KV slot ``gather_slots[b, j]``.
    """

    slot_mapping: torch.Tensor  # [T] int64: KV slot for each new token
    query_start: list[int]  # B + 1 offsets into the packed tokens
    context_lens: list[int]  # [B] tokens in context after this step
    gather_slots: torch.Tensor  # [B, Lmax] int64 slots of each context (padded with 0)
    attn_mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool (True = attend); None for pure decode w/o padding
    query_pad_index: torch.Tensor | None  # [B, Qmax] int64 indices into packed tokens (pad -> T)
    max_query_len: int
    is_decode: bool  # every sequence has exactly one new token

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    slot_lists: list[list[int]],
    device: torch.device,
) -> AttentionMetadata:
    """Build the tensors attention needs from plain Python lists.

    ``slot_lists[b]`` holds the KV slots of sequence ``b``'s whole context
    (length ``context_lens[b]``); its last ``query_lens[b]`` entries are the
    slots of the new tokens.
    """
    B = len(query_lens)
    lmax = max(context_lens)
    qmax = max(query_lens)
    T = sum(query_lens)
    gather = torch.zeros((B, lmax), dtype=torch.int64)
    new_slots: list[int] = []
    starts = [0]
    for b in range(B):
        s = slot_lists[b]
        gather[b, : len(s)] = torch.as_tensor(s, dtype=torch.int64)
        new_slots.extend(s[len(s) - query_lens[b] :])
        starts.append(starts[-1] + query_lens[b])
    is_decode = qmax == 1
    mask = None
    pad_index = None
    if not (is_decode and min(context_lens) == lmax):
        # Query i of sequence b sits at absolute position ctx - qlen + i and may
        # attend to every key at a position <= its own (causal over prefix+new).
        q_pos = torch.arange(qmax).unsqueeze(0) + torch.tensor(
            [c - q for c, q in zip(context_lens, query_lens)]
        ).unsqueeze(1)  # [B, Qmax]
        k_pos = torch.arange(lmax)  # [Lmax]
        mask = k_pos.view(1, 1, lmax) <= q_pos.unsqueeze(2)  # [B, Qmax, Lmax]
        valid_k = k_pos.view(1, lmax) < torch.tensor(context_lens).unsqueeze(1)  # [B, Lmax]
        mask &= valid_k.unsqueeze(1)
        # Padded query rows attend to key 0 only, to keep softmax finite.
        qvalid = torch.arange(qmax).unsqueeze(0) < torch.tensor(query_lens).unsqueeze(1)
        mask[:, :, 0] |= ~qvalid
        mask = mask.unsqueeze(1).to(device)
        if not is_decode:
            pad_index = torch.full((B, qmax), T, dtype=torch.int64)
            for b in range(B):
                pad_index[b, : query_lens[b]] = torch.arange(starts[b], starts[b + 1])
            pad_index = pad_index.to(device)
    return AttentionMetadata(
        slot_mapping=torch.as_tensor(new_slots, dtype=torch.int64, device=device),
        query_start=starts,
        context_lens=list(context_lens),
        gather_slots=gather.to(device),
        attn_mask=mask,
        query_pad_index=pad_index,
        max_query_len=qmax,
        is_decode=is_decode,
    )


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hk, D] (blocks flattened)
    v_cache: torch.Tensor,  # [num_slots, Hk, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Attend each new token over its sequence's cached context.

    Gathers each sequence's K/V by slot (``[B, Lmax, Hk, D]``) and runs SDPA
    with grouped-query heads; the gather costs one read of the context, the
    same bytes any attention must read.
    """
    T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    B = meta.num_seqs
    k = k_cache[meta.gather_slots].transpose(1, 2)  # [B, Hk, Lmax, D]
    v = v_cache[meta.gather_slots].transpose(1, 2)  # [B, Hk, Lmax, D]
    if meta.is_decode:
        qb = q.view(B, 1, Hq, D).transpose(1, 2)  # [B, Hq, 1, D]
    else:
        qpad = torch.cat([q, q.new_zeros(1, Hq, D)], dim=0)  # pad row at index T
        qb = qpad[meta.query_pad_index].transpose(1, 2)  # [B, Hq, Qmax, D]
    if Hq != Hk:
        rep = Hq // Hk
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=meta.attn_mask, scale=scale)
    out = out.transpose(1, 2)  # [B, Qmax, Hq, D]
    if meta.is_decode:
        return out.reshape(T, Hq, D)
    qs = meta.query_start
    return torch.cat([out[b, : qs[b + 1] - qs[b]] for b in range(B)], dim=0)
