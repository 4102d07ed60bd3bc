"""Log-likelihood of token sequences (the perplexity yardstick).

Scoring borrows blocks from the engine's own KV pool (so it uses the same
kernels, dtypes and placement as generation) and returns them at once.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from llmsys.engine.attention import AttentionBackend, AttentionMetadata, BackendDecorator, ScoringBackend, StepScores
from llmsys.engine.core import EngineCore
from llmsys.engine.kv_cache import blocks_needed
from llmsys.kernels import GatherPlan, make_gather_plan


@dataclass
class PerplexityResult:
    nll_sum: float
    tokens_scored: int
    windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / max(self.tokens_scored, 1))


@contextlib.contextmanager
def _prefilled(core: EngineCore, seqs: list[list[int]]) -> Iterator[torch.Tensor]:
    """The sequences prefilled together in fresh KV blocks (freed on exit): hidden states ``[T, hidden]``."""
    bs = core.kv.spec.block_size
    tables = []
    try:
        for s in seqs:
            tables.append(core.allocator.allocate(blocks_needed(len(s), bs)))
        lens = [len(s) for s in seqs]
        meta = core.attn.metadata(lens, lens, tables)
        ids = torch.tensor([t for s in seqs for t in s], device=core.loaded.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(core.loaded.device)
        yield core.loaded.model(ids, pos, core.attn, meta)  # [T, hidden]
    finally:
        for t in tables:
            core.allocator.free(t)


@torch.inference_mode()
def score_sequences(core: EngineCore, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, ``log p(tok[i] | tok[:i])`` for i >= 1: tensors ``[L-1]``."""
    with _prefilled(core, seqs) as hidden:
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


@torch.inference_mode()
def prompt_logits(core: EngineCore, ids: list[int]) -> torch.Tensor:
    """The logits at every position of one prompt, ``[L, V]`` float32 (comparisons with other engines)."""
    with _prefilled(core, [ids]) as hidden:
        return core.loaded.model.compute_logits(hidden).float().cpu()


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


# -- long-stream scoring under a KV policy ---------------------------------------


@dataclass
class StreamResult:
    """Per-token NLL of one continuous stream scored under a KV policy."""

    policy: str
    nll: torch.Tensor  # [N-1] float64: -log p(tok[i+1] | what the cache holds after tok[i])
    kv_bytes: list[int]  # KV bytes in use after each segment
    seconds: float  # wall time of the whole stream
    steady_s_per_token: float  # mean time per token once the budget is reached (token by token)
    evicted: int = 0
    segment: int = 1000

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean())) if self.nll.numel() else float("nan")

    def segments(self) -> list[tuple[int, int, float]]:
        """(first token, end, perplexity) per ``segment`` scored tokens."""
        out = []
        for a in range(0, self.nll.numel(), self.segment):
            part = self.nll[a : a + self.segment]
            out.append((a, a + part.numel(), math.exp(float(part.mean()))))
        return out


class _StepLayout:
    """Attention metadata of one CPU sequence, built incrementally (the stream's hot loop).

    The backend's builder (``engine.attention.build_metadata``) makes a few dozen
    small tensors per call; here the flat slot of every cache index is computed
    once per block table (which changes only when blocks are added or freed) and a
    step takes slices of it. The result equals the CPU backend's
    ``metadata([n], [ctx], [table])``.
    """

    def __init__(self, block_size: int, max_ctx: int):
        self.bs = block_size
        self._table: list[int] = []
        self._slots = torch.zeros(0, dtype=torch.int64)  # [blocks * bs] flat slot of each cache index
        self._bt = torch.zeros((1, 0), dtype=torch.int32)
        self._lens = torch.arange(max_ctx + 1, dtype=torch.int32)
        self._lens64 = self._lens.long()  # the gather plan's context lengths (kernels.cpu_decode reads int64)
        self._starts: dict[int, torch.Tensor] = {}

    def meta(self, table: list[int], n: int, ctx: int) -> AttentionMetadata:
        if table != self._table:
            t = torch.tensor(table, dtype=torch.int64)
            self._slots = (t[:, None] * self.bs + torch.arange(self.bs)).view(-1)
            self._bt = t.to(torch.int32)[None]
            self._table = list(table)
        start = self._starts.get(n)
        if start is None:
            start = self._starts[n] = torch.tensor([0, n], dtype=torch.int32)
        if n == 1:
            plan = GatherPlan(self._slots[:ctx].view(1, ctx), None, None, (0, 1), True, lens=self._lens64[ctx : ctx + 1])
        else:
            plan = make_gather_plan([n], [ctx], [self._table], self.bs, torch.device("cpu"))
        return AttentionMetadata(
            slot_mapping=self._slots[ctx - n : ctx], query_start=[0, n], context_lens=[ctx], block_tables=self._bt,
            context_lens_t=self._lens[ctx : ctx + 1], query_start_loc=start, is_decode=n == 1, plan=plan,
        )


def _nll(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    lp = torch.log_softmax(logits[: len(targets)], dim=-1)
    tgt = torch.tensor(targets, device=lp.device)
    return -lp.gather(1, tgt[:, None])[:, 0].double().cpu()


@torch.inference_mode()
def perplexity_stream(
    core: EngineCore, ids: list[int], policy: str, segment: int = 1000, chunk: int | None = None,
    max_tokens: int | None = None,
) -> StreamResult:
    """Score ``ids`` as one stream under ``policy`` (token by token once the budget is reached).

    ``full``: chunked causal prefill over everything (positions run past the
    trained context). ``recompute:N``: every fed token is recomputed with its
    N-1 predecessors from scratch (the sliding-window oracle). Evicting
    policies: the first ``budget`` tokens as one prefill, then one token per
    step, evicting ``chunk`` tokens (default 1: exact) whenever the cache is full.

    The one-token steps are the hot loop: their metadata comes from a
    :class:`_StepLayout`, token ids and positions are slices of tensors made
    once, and a step's NLL is one row's log-softmax read as a Python float.
    """
    from llmsys.kernels.common.errors import InvalidParameterError
    from llmsys.offload.kv_policy import PolicyRuntime, ensure_rope_positions, parse_kv_policy

    pol = parse_kv_policy(policy).resolve(core.kv.spec.bytes_per_token)
    if len(ids) < 2:
        raise InvalidParameterError("the stream needs at least 2 tokens")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if pol.kind == "recompute":
        return perplexity_recompute(core, ids, pol.window, segment=segment)
    if pol.kind not in ("full", "window", "sink", "h2o", "snapkv"):
        raise InvalidParameterError(f"--stream supports full, window, sink, h2o, snapkv and recompute, not {pol.kind!r}")
    bs = core.kv.spec.block_size
    per_block = core.kv.spec.bytes_per_token * bs
    model = core.loaded.model
    if pol.kind != "full" and model.kv_policy_blocker:
        raise InvalidParameterError(f"--kv-policy {pol.text!r}: this model's attention ({model.kv_policy_blocker}) "
                                    "runs with kv_policy full only")
    from llmsys.engine.runner import StepBatch
    from llmsys.engine.sampling import SamplingParams
    from llmsys.engine.scheduler import ScheduledSeq
    from llmsys.engine.sequence import SeqChunk, Sequence

    step = core.config.max_num_batched_tokens
    first = min(step if pol.kind == "full" else pol.budget, len(ids) - 1)
    rt = None
    if pol.kind == "full":
        need = blocks_needed(len(ids), bs)
        if not core.allocator.can_allocate(need):
            raise InvalidParameterError(
                f"--kv-policy full needs {len(ids)} tokens of KV for this stream but the pool has "
                f"{core.allocator.num_free * bs}; raise --kv-cache-tokens or use --limit"
            )
        ensure_rope_positions(model, len(ids) + 1)
    else:
        rt = PolicyRuntime(pol, model, core.kv, core.allocator, bs, chunk=chunk or 1)
    seq = Sequence("stream", ids[:first], SamplingParams(max_tokens=None), 1 << 62, output_ids=ids[first:],
                   kv=rt.new_state(pol) if rt is not None else None)
    ids_t = torch.tensor(ids, dtype=torch.int64)
    pos_t = torch.arange(len(ids) + 1, dtype=torch.int64)  # positions: stream indices (full) or cache indices
    dev = core.loaded.device
    layout = _StepLayout(bs, len(ids)) if dev.type != "cuda" else None
    if rt is not None and pol.needs_scores and not isinstance(core.attn, ScoringBackend):
        raise InvalidParameterError(f"--kv-policy {pol.text!r} needs attention scores, which this engine's "
                                    "attention (Quest page selection) does not record; drop --kv-policy quest")
    nll: list[torch.Tensor] = []
    kv_bytes: list[int] = []
    steady: list[float] = []
    t0 = time.perf_counter()
    next_mark = segment
    end = len(ids) - 1
    try:
        while seq.num_computed < end:
            n = min(first if seq.num_computed == 0 else (step if rt is None else 1), end - seq.num_computed)
            ts = time.perf_counter()
            if rt is not None:
                n = rt.before_step(seq, n)
            base = seq.kv_len
            grow = blocks_needed(base + n, bs) - len(seq.block_table)
            if grow > 0:
                seq.block_table.extend(core.allocator.allocate(grow))
            s = seq.num_computed
            # One sequence's step through the engine's one forward: every fed token's logits.
            score_from = None
            if rt is not None:
                score_from = rt.score_from([ScheduledSeq("stream", ids[s : s + n], s, base, list(seq.block_table),
                                                         s < first, False, pol)])
            if layout is not None:
                meta = layout.meta(seq.block_table, n, base + n)
                if score_from is not None:  # one sequence that scores (ScoringBackend.metadata's record)
                    meta = replace(meta, scores=StepScores(score_from, [base + n], [None]))
            else:
                meta = core.attn.metadata([n], [base + n], [seq.block_table], score_from=score_from)
            logits = core.runner.forward(StepBatch(ids_t[s : s + n].to(dev), pos_t[base : base + n].to(dev), meta, None))
            if rt is not None:
                rt.after_forward([SeqChunk(seq, n)], meta)
            seq.num_computed += n
            if n == 1:  # -log p(next): the same log-softmax row, one float
                nll.append(-float(torch.log_softmax(logits[0], dim=-1)[ids[s + 1]]))
            else:
                nll.append(_nll(logits, ids[s + 1 : s + n + 1]))
            if n == 1 and rt is not None and base + 1 >= pol.budget:
                steady.append(time.perf_counter() - ts)
            while seq.num_computed >= next_mark or seq.num_computed >= end:
                kv_bytes.append(len(seq.block_table) * per_block)
                next_mark += segment
                if seq.num_computed >= end:
                    break
    finally:
        core.allocator.free(seq.block_table)
        seq.block_table = []
    return StreamResult(
        policy=pol.text, nll=_cat_nll(nll), kv_bytes=kv_bytes, seconds=time.perf_counter() - t0,
        steady_s_per_token=sum(steady) / len(steady) if steady else 0.0,
        evicted=seq.kv.evicted if seq.kv is not None else 0, segment=segment,
    )


def _cat_nll(parts: list) -> torch.Tensor:
    """Tensors (chunks) and floats (one-token steps) in stream order -> one float64 tensor."""
    out: list[torch.Tensor] = []
    run: list[float] = []
    for p in parts:
        if isinstance(p, float):
            run.append(p)
            continue
        if run:
            out.append(torch.tensor(run, dtype=torch.float64))
            run = []
        out.append(p)
    if run:
        out.append(torch.tensor(run, dtype=torch.float64))
    return torch.cat(out)


class _CausalWindows(BackendDecorator):
    """The oracle's attention for B equal, fresh windows: one causal SDPA.

    Equivalent to the paged path (every window is a whole sequence starting at
    position 0) but uses SDPA's causal kernel instead of an explicit mask.
    """

    def __init__(self, inner: AttentionBackend, window: int):
        super().__init__(inner)
        self.window = window

    def attend(self, layer, q, meta, scale, window=None, softcap=None, sinks=None):  # q [B*window, Hq, D]
        if softcap is not None or sinks is not None or (window is not None and window < self.window):
            return self.inner.attend(layer, q, meta, scale, window, softcap, sinks)  # SDPA cannot say these
        T, Hq, D = q.shape
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        Hk = k_cache.shape[-2]
        B = T // self.window
        slots = meta.slot_mapping.view(B, self.window)
        k = k_cache.view(-1, Hk, D)[slots].transpose(1, 2)  # [B, Hk, window, D]
        v = v_cache.view(-1, Hk, D)[slots].transpose(1, 2)
        qb = q.view(B, self.window, Hq, D).transpose(1, 2)  # [B, Hq, window, D]
        o = torch.nn.functional.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=Hq != Hk)
        return o.transpose(1, 2).reshape(T, Hq, D)


@torch.inference_mode()
def perplexity_recompute(
    core: EngineCore, ids: list[int], window: int, segment: int = 1000, batch: int = 16, fast: bool = True
) -> StreamResult:
    """Sliding window with recomputation: fed token j is processed with its
    ``window - 1`` predecessors from scratch (positions 0..window-1), and its
    logits score token j+1. ``batch`` windows run per forward; with ``batch=1,
    fast=False`` the per-token time is that of a generator recomputing its
    window through the engine each step."""
    bs = core.kv.spec.block_size
    dev = core.loaded.device
    model = core.loaded.model
    t0 = time.perf_counter()
    first = min(window, len(ids) - 1)
    nll = [score_sequences(core, [ids[: first + 1]])[0].double().neg()]  # fed tokens 0..first-1
    ends = list(range(first, len(ids) - 1))  # fed token j = end, window ids[j-window+1 .. j]
    per_tok: list[float] = []
    nb = blocks_needed(window, bs)
    batch = max(1, min(batch, core.allocator.num_free // nb))
    # batched oracle: same math, causal kernel (fast=False: the engine's own prefill path)
    attn = _CausalWindows(core.attn, window) if fast else core.attn
    for i in range(0, len(ends), batch):
        grp = ends[i : i + batch]
        ts = time.perf_counter()
        tables = [core.allocator.allocate(nb) for _ in grp]
        try:
            wins = [ids[j - window + 1 : j + 1] for j in grp]
            lens = [window] * len(grp)
            meta = attn.metadata(lens, lens, tables)
            x = torch.tensor([t for w in wins for t in w], device=dev)
            pos = torch.arange(window, device=dev).repeat(len(grp))
            hidden = model(x, pos, attn, meta)  # [B*window, hidden]
            last = hidden[window - 1 :: window]  # [B, hidden]
            logits = model.compute_logits(last).float()
            nll.append(_nll(logits, [ids[j + 1] for j in grp]))
        finally:
            for t in tables:
                core.allocator.free(t)
        per_tok.append((time.perf_counter() - ts) / len(grp))
    return StreamResult(
        policy=f"recompute:{window}", nll=torch.cat(nll), kv_bytes=[nb * bs * core.kv.spec.bytes_per_token * batch],
        seconds=time.perf_counter() - t0, steady_s_per_token=sum(per_tok) / len(per_tok) if per_tok else 0.0,
        segment=segment,
    )
