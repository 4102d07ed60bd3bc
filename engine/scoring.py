"""Log-likelihood of token sequences (the perplexity yardstick).

Scoring borrows blocks from the engine's own KV pool (so it uses the same
kernels, dtypes and placement as generation) and returns them at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmsys.engine.attention import build_metadata
from llmsys.engine.core import EngineCore
from llmsys.engine.kv_cache import blocks_needed


@dataclass
class PerplexityResult:
    nll_sum: float
    tokens_scored: int
    windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / max(self.tokens_scored, 1))


@torch.inference_mode()
def score_sequences(core: EngineCore, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, ``log p(tok[i] | tok[:i])`` for i >= 1: tensors ``[L-1]``."""
    bs = core.kv.spec.block_size
    tables = []
    try:
        for s in seqs:
            tables.append(core.allocator.allocate(blocks_needed(len(s), bs)))
        lens = [len(s) for s in seqs]
        meta = build_metadata(lens, lens, tables, bs, core.loaded.device)
        ids = torch.tensor([t for s in seqs for t in s], device=core.loaded.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(core.loaded.device)
        hidden = core.loaded.model(ids, pos, core.kv, meta)  # [T, hidden]
        out = []
        start = 0
        for s in seqs:
            n = len(s)
            logits = core.loaded.model.compute_logits(hidden[start : start + n - 1]).float()  # [n-1, V]
            lp = torch.log_softmax(logits, dim=-1)
            tgt = torch.tensor(s[1:], device=lp.device)
            out.append(lp.gather(1, tgt.unsqueeze(1)).squeeze(1).cpu())
            start += n
        return out
    finally:
        for t in tables:
            core.allocator.free(t)


def perplexity_windows(
    core: EngineCore, ids: list[int], ctx: int, bos: int | None, batch: int = 8
) -> PerplexityResult:
    """llama-perplexity style: consecutive windows of ``ctx`` tokens, each
    starting with BOS (when the model has one), every token after the first
    position scored."""
    body = ctx - 1 if bos is not None else ctx
    windows = [ids[i : i + body] for i in range(0, len(ids) - 1, body)]
    windows = [([bos] if bos is not None else []) + w for w in windows]
    windows = [w for w in windows if len(w) >= 2]
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch):
        for lp in score_sequences(core, windows[i : i + batch]):
            nll -= lp.double().sum().item()
            count += lp.numel()
    return PerplexityResult(nll, count, len(windows))
