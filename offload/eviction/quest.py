"""Quest: keep every KV page, attend per query over the top-K pages only.

Each page (KV block) keeps the element-wise min and max of its keys per KV
head (``[num_blocks, Hk, D]`` per layer, updated as tokens are stored). For a
query ``q`` the largest possible score of any key in the page is bounded by
``sum_d max(q_d * min_d, q_d * max_d)``; the K pages with the largest bound
(the page being written is always among them) are gathered and attended
exactly. With K covering every page the result is exact attention.

With a cold KV tier (``llmsys.offload.kv_tier``) pages past the pool keep
their summaries (moved with the page when it is demoted), and a decode step
reads from the tier only the cold pages it selected, per layer
(``QuestStats.cold_*``); prefill attends over every page as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from llmsys.offload.kv_tier import KVTier


@dataclass
class QuestStats:
    """Tokens attention read vs tokens it would read with full attention."""

    tokens_read: int = 0
    tokens_total: int = 0
    # Read from the cold KV tier by decode steps (every layer counted): pages, tokens, K+V bytes.
    cold_pages_read: int = 0
    cold_tokens_read: int = 0
    cold_bytes_read: int = 0

    @property
    def fraction(self) -> float:
        return self.tokens_read / self.tokens_total if self.tokens_total else 1.0


@dataclass
class QuestAttention:
    """Quest's page summaries and decode (all layers share one).

    The engine's attention backend wraps its base backend in
    ``engine.attention.QuestBackend`` with this object: it calls :meth:`update`
    after every K store and :meth:`decode` for decode steps. Per-layer summaries
    are found by the identity of the layer's key cache tensor.
    """

    top_pages: int
    block_size: int
    stats: QuestStats = field(default_factory=QuestStats)
    _summ: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tier: KVTier | None = None  # the engine's cold tier when pages may be cold (given at construction)

    def summaries(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = k_cache.data_ptr()
        if key not in self._summ:
            nb, _, hk, d = k_cache.shape
            nb += self.tier.num_cold if self.tier is not None else 0  # cold page ids follow the pool's
            lo = torch.full((nb, hk, d), float("inf"), device=k_cache.device)
            self._summ[key] = (lo, -lo.clone())
        return self._summ[key]

    def move_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Pages demoted to the cold tier (pool id, cold id): their summaries follow them."""
        last = {c: h for h, c in pairs}  # a cold id reused within the step keeps its last page
        for lo, hi in self._summ.values():
            src = torch.tensor(list(last.values()), dtype=torch.long, device=lo.device)
            dst = torch.tensor(list(last), dtype=torch.long, device=lo.device)
            lo[dst] = lo[src]
            hi[dst] = hi[src]

    def update(self, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Fold the keys just stored at ``slot_mapping`` into their pages' min/max."""
        kmin, kmax = self.summaries(k_cache)
        hk, d = k_cache.shape[-2], k_cache.shape[-1]
        blocks = slot_mapping // self.block_size  # [T]
        fresh = blocks[(slot_mapping % self.block_size) == 0]  # pages started this step: forget old contents
        kmin[fresh] = float("inf")
        kmax[fresh] = float("-inf")
        knew = k_cache.view(-1, hk, d)[slot_mapping].float().view(-1, hk * d)  # [T, Hk*D]
        idx = blocks[:, None].expand(-1, hk * d)
        kmin.view(kmin.shape[0], -1).scatter_reduce_(0, idx, knew, "amin")
        kmax.view(kmax.shape[0], -1).scatter_reduce_(0, idx, knew, "amax")

    def decode(
        self,
        q: torch.Tensor,  # [B, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, nb] int32
        context_lens: torch.Tensor,  # [B] int32
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, D]
        B, Hq, D = q.shape
        Hk, bs = k_cache.shape[2], self.block_size
        G = Hq // Hk
        kmin, kmax = self.summaries(k_cache)
        table = block_tables.long()
        lens = context_lens.long()
        nb = table.shape[1]
        nblk = (lens + bs - 1) // bs  # [B]
        qg = q.float().view(B, 1, Hk, G, D)
        lo, hi = kmin[table].unsqueeze(3), kmax[table].unsqueeze(3)  # [B, nb, Hk, 1, D]
        bound = torch.maximum(qg * lo, qg * hi).sum(-1).sum(-1).transpose(1, 2)  # [B, Hk, nb]
        bidx = torch.arange(nb, device=q.device)
        live = bidx[None, :] < nblk[:, None]  # [B, nb]
        bound = bound.masked_fill(~live[:, None, :], float("-inf"))
        bound = bound.masked_fill((bidx[None, :] == (nblk - 1)[:, None])[:, None, :], float("inf"))
        k = min(self.top_pages, nb)
        top = bound.topk(k, dim=-1).indices  # [B, Hk, k] page index within the sequence
        blk = table.gather(1, top.reshape(B, -1)).view(B, Hk, k)
        offs = torch.arange(bs, device=q.device)
        slots = (blk[..., None] * bs + offs).reshape(B, Hk, k * bs)
        pos = (top[..., None] * bs + offs).reshape(B, Hk, k * bs)
        valid = (pos < lens[:, None, None]) & (top < nblk[:, None, None]).repeat_interleave(bs, dim=2)
        hidx = torch.arange(Hk, device=q.device).view(1, Hk, 1)
        cold = blk >= k_cache.shape[0] if self.tier is not None else None
        if cold is not None and bool(cold.any()):
            keys, vals = self._gather_cold(k_cache, v_cache, blk, cold, slots, hidx)
        else:
            keys = k_cache.view(-1, Hk, D)[slots, hidx]  # [B, Hk, k*bs, D]
            vals = v_cache.view(-1, Hk, D)[slots, hidx]
        mask = valid.repeat_interleave(G, dim=1).unsqueeze(2)  # [B, Hq, 1, k*bs]
        out = F.scaled_dot_product_attention(
            q.view(B, Hq, 1, D), keys, vals, attn_mask=mask, scale=scale, enable_gqa=G > 1
        )
        self.stats.tokens_read += int(valid.sum())
        self.stats.tokens_total += int(lens.sum()) * Hk
        return out.view(B, Hq, D)

    def _gather_cold(self, k_cache, v_cache, blk, cold, slots, hidx) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected pages' K/V when some are cold: pool rows, with the cold pages read from the tier (only those)."""
        Hk, D, bs = k_cache.shape[2], k_cache.shape[3], self.block_size
        ids = torch.unique(blk[cold])  # sorted cold pages selected in this layer
        krows, vrows = self.tier.read(k_cache, ids.tolist())  # page j's offset o: row j * bs + o
        staged = torch.searchsorted(ids.to(blk.device), blk).clamp_max(ids.numel() - 1)
        offs = torch.arange(bs, device=blk.device)
        src = (staged[..., None] * bs + offs).reshape(slots.shape)
        cslot = cold.repeat_interleave(bs, dim=2)  # [B, Hk, k*bs]
        slots = torch.where(cslot, torch.zeros((), dtype=slots.dtype, device=slots.device), slots)
        m = cslot[..., None]
        keys = torch.where(m, krows[src, hidx], k_cache.view(-1, Hk, D)[slots, hidx])
        vals = torch.where(m, vrows[src, hidx], v_cache.view(-1, Hk, D)[slots, hidx])
        st, n = self.stats, ids.numel()
        st.cold_pages_read += n
        st.cold_tokens_read += n * bs
        st.cold_bytes_read += n * self.tier.layer_block_bytes
        return keys, vals
