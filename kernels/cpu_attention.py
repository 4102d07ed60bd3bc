"""The CPU fast path of paged attention: one gather plan per step, batched decode, per-sequence prompts.

The reference (``reference.py``) loops over sequences; on a CPU that loop costs more than the math, so a
:class:`GatherPlan` is built once per step (from the batch layout, not the layer). Decode rows run the C
decode kernel reading the pool by slot (or one grouped matmul over gathered rows); prompt tokens run the
same C arithmetic, each as a decode step at its position (``cpu_decode.rows_attention``), so a token's
bits depend only on its query and keys, not its chunk, a prefix-cache hit, the batch or a recompute (at
some prompt speed on long contexts: docs/benchmarks.md). Soft-capped logits and sinks (explicit float32
logits, ``reference.softmax_with_sinks``) and prompts without the C kernel take SDPA / logits per
sequence, unpadded; sliding windows go through :func:`windowed`. Cold blocks (``>= ColdBlocks.first``,
``llmsys.offload.kv_tier``) gather from scratch slot 0, then the tier's staged rows are copied over them
(``cold_dst`` <- ``cold_src``): exactly an all-resident pool's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from llmsys.kernels import cpu_decode
from llmsys.kernels.reference import softmax_with_sinks


@dataclass(frozen=True)
class ColdBlocks:
    """The cold blocks one step reads (see the module doc); layer-independent.

    ``ids``: the step's cold block ids, sorted; staged block ``j`` holds
    ``ids[j]``. ``reader.rows(cache)`` returns the staged rows of ``cache``'s
    layer as ``[n, Hk, D]`` where staged block ``j``'s offset ``o`` is row
    ``j * rows_per_block + o`` (the reader waits for the layer's read).
    """

    first: int  # block ids >= first are cold
    ids: torch.Tensor  # [S] int64, sorted
    reader: Any
    rows_per_block: int


@dataclass(frozen=True)
class GatherPlan:
    """Batch layout for :func:`paged_attention_gathered` (layer-independent)."""

    gather_slots: torch.Tensor  # [B, Lmax] int64 flat slots (padding -> slot 0)
    attn_mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, None when not needed
    query_pad_index: torch.Tensor | None  # [B, Qmax] int64 into packed queries (pad -> T)
    query_start: tuple[int, ...]  # B + 1 offsets of each sequence's queries
    is_decode: bool  # one query per sequence
    # Mixed steps (continuous batching: decodes beside prompt chunks) run as two
    # batches, (decode plan, their token indices [Bd], prefill plan, their token
    # indices [Tp]), so a decode row is not padded to the longest prompt chunk.
    split: tuple["GatherPlan", torch.Tensor, "GatherPlan", torch.Tensor] | None = None
    # Cold positions (see ColdBlocks): flat [B * Lmax] indices and their staged rows.
    cold: ColdBlocks | None = None
    cold_dst: torch.Tensor | None = None  # [Nc] int64
    cold_src: torch.Tensor | None = None  # [Nc] int64
    # The same as (dst start, src start, length) runs when there are few (one per sequence whose
    # cold blocks were demoted in order), with the [start, end) runs of the other positions: each
    # gathered row is then written once (pool rows by index_select, cold rows by a slice copy).
    cold_runs: tuple[tuple[int, int, int], ...] | None = None
    hot_runs: tuple[tuple[int, int], ...] | None = None
    lens: torch.Tensor | None = None  # [B] int64 context lengths, on the CPU (kernels.cpu_decode reads them)
    # Prompt plans: each new token's sequence [T] and context length [T] (its position + 1), on the CPU, for
    # the C attention by rows (kernels.cpu_decode.rows_attention); ``window``: set by :func:`windowed`.
    row_seq: torch.Tensor | None = None
    row_lens: torch.Tensor | None = None
    window: int | None = None
    # A plain decode step the C decode attention runs in one call per layer (one query per sequence, nothing
    # cold, not split, lengths known): decided once per plan, so layers do not ask again.
    one_call: bool = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "one_call", self.is_decode and self.cold is None and self.split is None
                           and self.lens is not None)


def make_gather_plan(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    cold: ColdBlocks | None = None,
    prompt: list[bool] | None = None,
) -> GatherPlan:
    """Plan for sequences whose new tokens are the last ``query_lens[b]`` of
    their ``context_lens[b]``-token context (block ids ``>= cold.first`` are cold).

    ``prompt[b]``: sequence b's new tokens are prompt tokens. Those always take the
    prefill attention, even a chunk of one token (the last prompt token after a prefix
    cache hit, or a prompt chunked at a step boundary), so a prompt token's attention
    is computed the same way whatever the cache or the chunking; the decode kernel
    computes only generated tokens.
    """
    pf = list(prompt) if prompt is not None else [False] * len(query_lens)
    B = len(query_lens)
    lmax, qmax = max(context_lens), max(query_lens)
    nblk = max(len(t) for t in block_tables)
    table = torch.zeros((B, nblk), dtype=torch.int64)
    for b, t in enumerate(block_tables):
        table[b, : len(t)] = torch.as_tensor(t, dtype=torch.int64)
    pos = torch.arange(lmax)
    lens = torch.tensor(context_lens)
    valid_k = pos.unsqueeze(0) < lens.unsqueeze(1)  # [B, Lmax]
    blk = table[:, pos // block_size]  # [B, Lmax] block id of each context position
    slots = blk * block_size + pos % block_size  # [B, Lmax]
    slots = torch.where(valid_k, slots, torch.zeros((), dtype=torch.int64))
    cold_dst = cold_src = cold_runs = hot_runs = None
    if cold is not None:
        is_cold = (blk >= cold.first) & valid_k
        if bool(is_cold.any()):
            flat = is_cold.view(-1)
            cold_dst = flat.nonzero().view(-1)
            staged = torch.searchsorted(cold.ids, blk.view(-1)[cold_dst])
            cold_src = staged * cold.rows_per_block + (pos % block_size).repeat(B)[cold_dst]
            cold_runs = _runs(cold_dst, cold_src)
            if cold_runs is not None:
                hot_runs = _gaps(cold_runs, B * lmax)
            cold_src, cold_dst = cold_src.to(device), cold_dst.to(device)
            slots = torch.where(is_cold, torch.zeros((), dtype=torch.int64), slots)
        else:
            cold = None
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    is_decode = qmax == 1 and not any(pf)
    mask = None
    pad_index = None
    if not (is_decode and min(context_lens) == lmax):
        qlens = torch.tensor(query_lens)
        q_pos = torch.arange(qmax).unsqueeze(0) + (lens - qlens).unsqueeze(1)  # [B, Qmax]
        m = (pos.view(1, 1, lmax) <= q_pos.unsqueeze(2)) & valid_k.unsqueeze(1)  # [B, Qmax, Lmax]
        # Padded query rows attend to key 0 only, so their softmax stays finite.
        qvalid = torch.arange(qmax).unsqueeze(0) < qlens.unsqueeze(1)
        m[:, :, 0] |= ~qvalid
        mask = m.unsqueeze(1).to(device)
        if not is_decode:
            T = starts[-1]
            idx = torch.arange(qmax).unsqueeze(0) + torch.tensor(starts[:-1]).unsqueeze(1)
            pad_index = torch.where(qvalid, idx, torch.full((), T)).to(device)
    split = None
    dec = [b for b, q in enumerate(query_lens) if q == 1 and not pf[b]]
    if not is_decode and dec:
        dset = set(dec)
        pre = [b for b in range(B) if b not in dset]
        sub = [
            make_gather_plan([query_lens[b] for b in rows], [context_lens[b] for b in rows],
                             [block_tables[b] for b in rows], block_size, device, cold, [pf[b] for b in rows])
            for rows in (dec, pre)
        ]
        dec_tok = torch.tensor([starts[b] for b in dec], dtype=torch.int64, device=device)
        pre_tok = torch.tensor([t for b in pre for t in range(starts[b], starts[b + 1])], dtype=torch.int64, device=device)
        split = (sub[0], dec_tok, sub[1], pre_tok)
    row_seq = row_lens = None
    if not is_decode and split is None:
        qlens_t = torch.tensor(query_lens)
        row_seq = torch.repeat_interleave(torch.arange(B), qlens_t)  # [T]
        # token i of sequence b's chunk sits at position lens[b] - qlens[b] + i: its context is that + 1
        row_lens = (lens - qlens_t)[row_seq] + 1 + torch.arange(starts[-1]) - torch.tensor(starts[:-1])[row_seq]
    return GatherPlan(slots.to(device), mask, pad_index, tuple(starts), is_decode, split, cold, cold_dst, cold_src,
                      cold_runs, hot_runs, lens, row_seq, row_lens)


MAX_COLD_RUNS = 64  # more runs than this: one index_select + index_copy_ beats a Python loop of slice copies


def _runs(dst: torch.Tensor, src: torch.Tensor) -> tuple[tuple[int, int, int], ...] | None:
    """Maximal runs where ``dst`` and ``src`` both step by one, or None when there are too many."""
    brk = ((dst[1:] - dst[:-1] != 1) | (src[1:] - src[:-1] != 1)).nonzero().view(-1) + 1
    if brk.numel() >= MAX_COLD_RUNS:
        return None
    bounds = [0, *brk.tolist(), dst.numel()]
    dl, sl = dst.tolist(), src.tolist()
    return tuple((dl[a], sl[a], b - a) for a, b in zip(bounds[:-1], bounds[1:]))


def _gaps(runs: tuple[tuple[int, int, int], ...], total: int) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` ranges of ``0..total`` that no run covers (runs are sorted by start)."""
    out, at = [], 0
    for dst, _, n in runs:
        if dst > at:
            out.append((at, dst))
        at = dst + n
    if at < total:
        out.append((at, total))
    return tuple(out)


def gather_rows(cache: torch.Tensor, plan: GatherPlan) -> torch.Tensor:  # [B * Lmax, Hk, D]
    """The plan's K or V rows of a float pool: pool slots, then the staged cold rows over their positions."""
    hk, d = cache.shape[-2], cache.shape[-1]
    flat, slots = cache.view(-1, hk, d), plan.gather_slots.view(-1)
    if plan.cold is None:
        # index_select, not cache[slots]: the same gather, ~6x cheaper on CPU (measured).
        return torch.index_select(flat, 0, slots)
    rows = plan.cold.reader.rows(cache)
    if plan.cold_runs is None:  # many runs: gather all (cold positions read scratch slot 0), then overwrite
        x = torch.index_select(flat, 0, slots)
        return x.index_copy_(0, plan.cold_dst, rows.index_select(0, plan.cold_src))
    x = flat.new_empty((slots.numel(), hk, d))
    for a, b in plan.hot_runs:
        torch.index_select(flat, 0, slots[a:b], out=x[a:b])
    for dst, src, n in plan.cold_runs:
        x[dst : dst + n].copy_(rows[src : src + n])
    return x


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, plan: GatherPlan, dtype: torch.dtype) -> torch.Tensor:
    hk, d = cache.shape[-2], cache.shape[-1]
    slots = plan.gather_slots
    flat = slots.reshape(-1)
    if plan.cold is not None and scale is not None:
        raise ValueError("cold KV blocks: quantized pools have no cold tier")
    x = gather_rows(cache, plan).view(*slots.shape, hk, d)  # [B, Lmax, Hk, D]
    if scale is not None:  # int8 cache: per (token, head) scales
        sc = torch.index_select(scale.view(-1, hk), 0, flat).view(*slots.shape, hk, 1)
        x = (x.float() * sc).to(dtype)
    return x


def _gather_heads_first(
    cache: torch.Tensor, scale: torch.Tensor | None, plan: GatherPlan, dtype: torch.dtype
) -> torch.Tensor:  # [Hk, B, Lmax, D] contiguous
    """Gather K or V by slot straight into head-major order.

    Why: the decode matmuls batch over (head, sequence). Gathered as
    ``[B, L, Hk, D]`` those two batch dims cannot be merged, so ``matmul``
    first copies K^T and V into ``[B, Hk, ...]`` -- strided copies that cost
    more than the attention math (docs/benchmarks.md). One contiguous permute
    of the small gathered tensor into ``[Hk, B, L, D]`` (whose batch dims merge
    for free) costs half of what gathering from a head-major view does, and a
    quarter of the copies matmul makes.
    """
    return _gather(cache, scale, plan, dtype).permute(2, 0, 1, 3).contiguous()  # [Hk, B, Lmax, D]


def _decode_grouped(
    q: torch.Tensor,  # [B, Hq, D]: one query per sequence
    k: torch.Tensor,  # [Hk, B, L, D] (head-major, see _gather_heads_first)
    v: torch.Tensor,  # [Hk, B, L, D]
    mask: torch.Tensor | None,  # [B, 1, 1, L] bool or None
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention as two grouped matmuls, all in float32 (output in q's dtype); ``softcap``:
    logits ``cap * tanh(logits / cap)`` before the mask (Gemma 2); ``sinks``: one more logit per
    query head in the softmax's denominator (gpt-oss).

    float32 even for bf16 pools: the bf16 batched matmul picks its blocking by batch shape, so a
    sequence decoded alone or beside others rounded differently, and float32 is no slower. Not SDPA:
    torch's CPU bf16 SDPA costs several times this for one query row; the query heads sharing a KV
    head are stacked as rows of one matmul instead of repeating K/V. Figures: docs/benchmarks.md.
    """
    B, Hq, D = q.shape
    Hk = k.shape[0]
    dtype = q.dtype
    qg = q.view(B, Hk, Hq // Hk, D).transpose(0, 1).float()  # [Hk, B, G, D]
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [Hk, B, G, L]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask.transpose(0, 1), float("-inf"))  # mask [1, B, 1, L] broadcasts over heads
    p = softmax_with_sinks(s, None if sinks is None else sinks.view(Hk, 1, Hq // Hk, 1))  # head h = hk * G + g
    return torch.matmul(p, v.float()).to(dtype).transpose(0, 1).reshape(B, Hq, D)  # [Hk, B, G, D] -> [B, Hq, D]


def paged_attention_gathered(
    q: torch.Tensor,  # [T, Hq, D] packed new tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D] float or int8
    v_cache: torch.Tensor,
    plan: GatherPlan,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hk] f32 for int8 caches
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,  # tanh soft-capping of the logits (Gemma 2)
    sinks: torch.Tensor | None = None,  # [Hq] attention sinks (gpt-oss): explicit float32 logits, never the C path
) -> torch.Tensor:  # [T, Hq, D]
    """Each new token over its sequence's context, by the plan (a sliding window: :func:`windowed` first)."""
    T, Hq, D = q.shape
    if plan.split is not None:  # decodes and prompt chunks as two batches (see GatherPlan.split)
        dplan, dtok, pplan, ptok = plan.split
        out = q.new_empty(T, Hq, D)
        for sub, tok in ((dplan, dtok), (pplan, ptok)):
            res = paged_attention_gathered(q.index_select(0, tok), k_cache, v_cache, sub, scale, k_scale, v_scale,
                                           softcap, sinks)
            out.index_copy_(0, tok, res)
        return out
    same_dtype = k_scale is not None or k_cache.dtype == q.dtype  # int8 pools dequantize to q's dtype
    if (plan.is_decode and same_dtype and plan.lens is not None and softcap is None and sinks is None
            and cpu_decode.applies(q) and cpu_decode.available()):
        # The C decode attention (kernels/cpu_decode.c), reading a plain pool by slot (the same
        # rows a gather would copy), else the gathered (dequantized / staged) rows. No gather,
        # permute or padded matmul: at batch 16 those cost a third of a float32 step.
        if k_scale is None and plan.cold is None:
            hk, d = k_cache.shape[-2], k_cache.shape[-1]
            return cpu_decode.decode_attention(q.contiguous(), k_cache.view(-1, hk, d), v_cache.view(-1, hk, d),
                                               plan.lens, scale, plan.gather_slots)
        k = _gather(k_cache, k_scale, plan, q.dtype)  # [B, Lmax, Hk, D]
        v = _gather(v_cache, v_scale, plan, q.dtype)
        return cpu_decode.decode_attention(q.contiguous(), k, v, plan.lens, scale)
    if plan.is_decode:
        k = _gather_heads_first(k_cache, k_scale, plan, q.dtype)  # [Hk, B, Lmax, D]
        v = _gather_heads_first(v_cache, v_scale, plan, q.dtype)
        return _decode_grouped(q, k, v, plan.attn_mask, scale, softcap, sinks)
    if (same_dtype and plan.row_seq is not None and softcap is None and sinks is None and cpu_decode.applies(q)
            and cpu_decode.available()):
        # Prompt tokens by rows, each the decode kernel's arithmetic at its position (kernels.cpu_decode.rows_attention):
        # a token's bits do not depend on its chunk, a prefix-cache hit or the batch.
        first = None if plan.window is None else (plan.row_lens - plan.window).clamp(min=0)
        if k_scale is None and plan.cold is None:
            hk, d = k_cache.shape[-2], k_cache.shape[-1]
            return cpu_decode.rows_attention(q.contiguous(), k_cache.view(-1, hk, d), v_cache.view(-1, hk, d),
                                             plan.row_seq, plan.row_lens, scale, first, plan.gather_slots)
        k = _gather(k_cache, k_scale, plan, q.dtype)  # [B, Lmax, Hk, D]
        v = _gather(v_cache, v_scale, plan, q.dtype)
        return cpu_decode.rows_attention(q.contiguous(), k.contiguous(), v.contiguous(), plan.row_seq, plan.row_lens,
                                         scale, first)
    k = _gather(k_cache, k_scale, plan, q.dtype).transpose(1, 2)  # [B, Hk, Lmax, D]
    v = _gather(v_cache, v_scale, plan, q.dtype).transpose(1, 2)
    return _prefill_each(q, k, v, plan, scale, softcap, sinks)


def attend_gathered(
    q: torch.Tensor,  # [T, Hq, D] packed new tokens
    k: torch.Tensor,  # [B, Lmax, Hk, D] gathered (dequantized) keys of the plan's rows
    v: torch.Tensor,
    plan: GatherPlan,  # not split (callers run a split plan's parts one by one)
    scale: float,
    softcap: float | None = None,  # tanh soft-capping of the logits (Gemma 2)
    sinks: torch.Tensor | None = None,  # [Hq] attention sinks (gpt-oss)
) -> torch.Tensor:  # [T, Hq, D]
    """Attention over K/V a pool gathered itself (the int4 pool dequantizes in its gather).

    Decode rows: one SDPA over the batch (the grouped float32 matmuls with ``softcap`` or ``sinks``). Prompt
    chunks: :func:`_prefill_each`, one unpadded SDPA per sequence, as the plain and int8 pools run
    them, so a prompt's bits do not depend on the rest of the step.
    """
    if plan.split is not None:
        raise ValueError("attend_gathered: run a split plan's parts one at a time")
    if not plan.is_decode:
        return _prefill_each(q, k.transpose(1, 2), v.transpose(1, 2), plan, scale, softcap, sinks)
    if softcap is not None or sinks is not None:
        kh, vh = (x.permute(2, 0, 1, 3) for x in (k, v))  # [Hk, B, Lmax, D]
        return _decode_grouped(q, kh, vh, plan.attn_mask, scale, softcap, sinks)
    T, Hq, D = q.shape
    qb = q.view(T, 1, Hq, D).transpose(1, 2)  # [B, Hq, 1, D]
    out = F.scaled_dot_product_attention(qb, k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.attn_mask,
                                         scale=scale, enable_gqa=Hq != k.shape[2])
    return out.transpose(1, 2).reshape(T, Hq, D)


def _prefill_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: GatherPlan, scale: float,
                  softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:  # q [T, Hq, D], k/v [B, Hk, Lmax, D] -> [T, Hq, D]
    """Prompt attention one sequence at a time, unpadded: each sequence's SDPA call has the
    shapes and mask it would have alone, so its bits do not depend on what else is in the step.

    Why: one padded SDPA over the batch gave a sequence other bits when a longer sequence
    widened the padding (SDPA's blocking follows the padded sizes). Through layers that
    round activations to bf16 (the int4/int8 matmuls) such last-bit differences flipped
    greedy tokens: served int4 outputs equalled the sequential ones 165/180 times, 180/180
    with this (benchmarks/bench_server.py)."""
    if plan.lens is None:
        raise ValueError("paged_attention_gathered: a prompt plan needs its context lengths (make_gather_plan sets them)")
    Hq, Hk = q.shape[1], k.shape[1]
    qs = plan.query_start
    outs = []
    for b in range(len(qs) - 1):
        n, L = qs[b + 1] - qs[b], int(plan.lens[b])
        qb = q[qs[b] : qs[b + 1]].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        mask = plan.attn_mask[b : b + 1, :, :n, :L].contiguous()  # [1, 1, n, L]; its strides would follow Lmax
        # k/v [1, Hk, L, D] views: their strides (Hk * D per position) do not depend on the padding
        kb, vb = k[b : b + 1, :, :L], v[b : b + 1, :, :L]
        if softcap is None and sinks is None:
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=Hq != Hk)
        else:
            out = _explicit_attention(qb, kb, vb, mask, scale, softcap, sinks)
        outs.append(out[0].transpose(0, 1))  # [n, Hq, D]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                        softcap: float | None, sinks: torch.Tensor | None,
                        q_chunk: int = 256) -> torch.Tensor:  # q [1, Hq, n, D], k/v [1, Hk, L, D]
    """Attention over explicit float32 logits, as transformers' eager attention computes it (output in q's
    dtype) -> ``[1, Hq, n, D]``: soft-capped, ``cap * tanh(logits / cap)`` before the mask and softmax
    (``softcap``: Gemma 2), and with attention sinks in the softmax (``sinks [Hq]``: gpt-oss).

    Why not SDPA: it has neither. ``q_chunk`` queries at a time, so at most ``[Hq, q_chunk, L]``
    logits exist at once (never the whole ``[n, L]`` matrix of a long prompt).
    """
    hq, hk, n = q.shape[1], k.shape[1], q.shape[2]
    kf, vf = k.float(), v.float()
    if hq != hk:
        kf, vf = kf.repeat_interleave(hq // hk, dim=1), vf.repeat_interleave(hq // hk, dim=1)  # [1, Hq, L, D]
    kt = kf.transpose(-1, -2)
    out = q.new_empty(q.shape)
    for c0 in range(0, n, q_chunk):
        c1 = min(n, c0 + q_chunk)
        s = torch.matmul(q[:, :, c0:c1].float(), kt) * scale  # [1, Hq, c, L]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask[:, :, c0:c1], float("-inf"))
        p = softmax_with_sinks(s, None if sinks is None else sinks.view(1, hq, 1, 1))
        out[:, :, c0:c1] = torch.matmul(p, vf).to(q.dtype)
    return out


def windowed(plan: GatherPlan, window: int | None) -> GatherPlan:
    """``plan`` for a sliding-window layer: each query sees only the keys less than ``window`` positions
    behind it (``query - window < key <= query``, transformers' ``sliding_window_overlay``); ``plan``
    itself when no query of the step reaches that far back (every context fits the window).

    Decode rows gather only each sequence's last ``window`` positions (lengths capped to the window,
    staged cold rows moved with their positions): exactly the keys the windowed mask leaves, in the
    same order, so the C decode attention still runs them, with the bits of an all-hot pool. Prompt
    chunks and mixed steps keep their gather and get the band ANDed into their mask.
    """
    L = plan.gather_slots.shape[1]
    if window is None or L <= window:
        return plan
    split = plan.split
    if split is not None:
        split = (windowed(split[0], window), split[1], windowed(split[2], window), split[3])
    dev = plan.gather_slots.device
    if plan.is_decode and plan.lens is not None:
        lens = plan.lens
        start = (lens - window).clamp(min=0)  # [B] first position each row attends
        n = lens.clamp(max=window)  # [B] keys each row attends
        idx = (start[:, None] + torch.arange(window)).clamp(max=L - 1)  # [B, W]
        valid = torch.arange(window)[None, :] < n[:, None]  # [B, W]
        slots = torch.where(valid.to(dev), torch.gather(plan.gather_slots, 1, idx.to(dev)),
                            torch.zeros((), dtype=torch.int64, device=dev))
        mask = None if bool(valid.all()) else valid[:, None, None, :].to(dev)
        cold = _windowed_cold(plan, start, window)
        return GatherPlan(slots.contiguous(), mask, None, plan.query_start, True, split, *cold, lens=n)
    qs = torch.tensor(plan.query_start)
    qlens = qs[1:] - qs[:-1]  # [B]
    lens = plan.lens
    if lens is None:
        raise ValueError("windowed: the plan has no context lengths (make_gather_plan sets them)")
    qmax = int(qlens.max())
    q_pos = torch.arange(qmax)[None, :] + (lens - qlens)[:, None]  # [B, Qmax] absolute position of each query
    pos = torch.arange(L)
    m = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] > q_pos[:, :, None] - window)
    m &= (pos[None, :] < lens[:, None])[:, None, :]  # [B, Qmax, L]
    m[:, :, 0] |= ~(torch.arange(qmax)[None, :] < qlens[:, None])  # padded query rows: key 0, a finite softmax
    return replace(plan, attn_mask=m[:, None].to(dev), split=split, window=window)


def _windowed_cold(plan: GatherPlan, start: torch.Tensor, window: int) -> tuple:
    """A decode plan's cold fields (``cold, cold_dst, cold_src, cold_runs, hot_runs``) for its rows'
    last ``window`` positions from ``start [B]``: each staged row moves with its position into the
    ``[B, window]`` layout, those before the window are dropped."""
    if plan.cold is None:
        return None, None, None, None, None
    L = plan.gather_slots.shape[1]
    b, p = plan.cold_dst // L, plan.cold_dst % L
    first = start.to(b.device)[b]
    keep = p >= first
    if not bool(keep.any()):
        return None, None, None, None, None
    dst = b[keep] * window + (p[keep] - first[keep])
    src = plan.cold_src[keep]
    runs = _runs(dst.cpu(), src.cpu())
    return plan.cold, dst, src, runs, _gaps(runs, len(start) * window) if runs is not None else None


def paged_attention_gathered_scores(
    q: torch.Tensor,  # [T, Hq, D] packed new tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    plan: GatherPlan,
    scale: float,
    score_from: list[int],  # per sequence: first new-token index whose attention row is returned
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_chunk: int = 128,
    softcap: float | None = None,  # tanh soft-capping of the logits (Gemma 2)
    sinks: torch.Tensor | None = None,  # [Hq] attention sinks (gpt-oss)
) -> tuple[torch.Tensor, list[torch.Tensor]]:  # out [T, Hq, D], rows[b] [nq_b, Lmax] f32
    """Like :func:`paged_attention_gathered`, also returning attention rows.

    Eviction policies (H2O, SnapKV) need how much each cached token was
    attended. Softmax(QK^T) is computed explicitly, ``q_chunk`` queries at a
    time, so at most ``[B, Hq, q_chunk, Lmax]`` probabilities exist at once
    (never the full ``[Lq, L]`` matrix of a long prefill). Row ``i`` of
    ``rows[b]`` is the probability mass of query ``score_from[b] + i`` summed
    over all query heads (each row sums to Hq; less with ``sinks``, whose mass no key holds).
    """
    T, Hq, D = q.shape
    Hk = k_cache.shape[-2]
    B = len(plan.query_start) - 1
    k = _gather(k_cache, k_scale, plan, q.dtype).transpose(1, 2)  # [B, Hk, Lmax, D]
    v = _gather(v_cache, v_scale, plan, q.dtype).transpose(1, 2)
    if Hq != Hk:
        k = k.repeat_interleave(Hq // Hk, dim=1)  # [B, Hq, Lmax, D]
        v = v.repeat_interleave(Hq // Hk, dim=1)
    if plan.is_decode:
        qb = q.view(B, 1, Hq, D).transpose(1, 2)  # [B, Hq, 1, D]
    else:
        qpad = torch.cat([q, q.new_zeros(1, Hq, D)], dim=0)
        qb = qpad[plan.query_pad_index].transpose(1, 2)  # [B, Hq, Qmax, D]
    qmax = qb.shape[2]
    qs = plan.query_start
    out = torch.empty_like(qb)
    rows: list[list[torch.Tensor]] = [[] for _ in range(B)]
    kt = k.transpose(-1, -2).float()
    for c0 in range(0, qmax, q_chunk):
        c1 = min(qmax, c0 + q_chunk)
        logits = torch.matmul(qb[:, :, c0:c1].float(), kt) * scale  # [B, Hq, c, Lmax]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if plan.attn_mask is not None:
            logits = logits.masked_fill(~plan.attn_mask[:, :, c0:c1], float("-inf"))
        p = softmax_with_sinks(logits, None if sinks is None else sinks.view(1, Hq, 1, 1))
        out[:, :, c0:c1] = torch.matmul(p, v.float()).to(q.dtype)
        mass = p.sum(dim=1)  # [B, c, Lmax]
        for b in range(B):
            lo, hi = max(score_from[b], c0), min(qs[b + 1] - qs[b], c1)
            if lo < hi:
                rows[b].append(mass[b, lo - c0 : hi - c0])
    res = [torch.cat(r, dim=0) if r else q.new_zeros((0, k.shape[2]), dtype=torch.float32) for r in rows]
    out = out.transpose(1, 2)  # [B, Qmax, Hq, D]
    if plan.is_decode:
        return out.reshape(T, Hq, D), res
    return torch.cat([out[b, : qs[b + 1] - qs[b]] for b in range(B)], dim=0), res
