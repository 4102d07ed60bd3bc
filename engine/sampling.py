"""Sampling: :class:`SamplingParams` (one request's validated, immutable knobs, built by every front end)
and :class:`Sampler` (the batched kernel the engine calls once per step).

Every transform is a batched tensor op on per-row parameter tensors, so 32 settings cost about one. A
row's result never depends on its batch: "off" knobs are exact no-ops and a seeded row draws only from
its own ``torch.Generator``, ``V`` uniforms per sampled step, by the exponential race (``argmax(p / E)``,
``E ~ Exp(1)``: exact, no CDF search). Order, as HF ``generate``: ``min_tokens`` masks EOS/stop ids;
repetition penalty (prompt + output), then presence/frequency (output); greedy rows take the argmax;
temperature, top-k, top-p, min-p, the draw. Reported logprobs are the raw ``log_softmax`` (vLLM's
default): they describe the model, not the settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

import torch

from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.offload.eviction.policy import KVPolicy, parse_kv_policy

# Temperatures below this are treated as greedy: dividing by ~0 overflows and
# the distribution is a point mass on the argmax anyway.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20

TokenHistory = Sequence[int] | torch.Tensor  # 1-D token ids


def _bad(name: str, value: object, valid: str) -> InvalidParameterError:
    return InvalidParameterError(f"sampling parameter {name}={value!r} is invalid: {valid}")


@dataclass(frozen=True)
class Limit:
    """The valid range of one numeric sampling knob, and the words that say it."""

    lo: float
    hi: float
    lo_open: bool  # lo itself is refused
    what: str
    integer: bool = False


# The one table of sampling limits: SamplingParams checks them, and the servers' request models call
# check_sampling with the same names, so the CLI, the HTTP APIs and LLM.generate refuse alike.
SAMPLING_LIMITS: Mapping[str, Limit] = MappingProxyType({
    "temperature": Limit(0.0, math.inf, False, "must be a number >= 0 (0 = greedy)"),
    "top_p": Limit(0.0, 1.0, True, "must be in (0, 1] (1 = off)"),
    "min_p": Limit(0.0, 1.0, False, "must be in [0, 1] (0 = off)"),
    "repetition_penalty": Limit(0.0, math.inf, True, "must be a number > 0 (1 = off)"),
    "presence_penalty": Limit(-2.0, 2.0, False, "must be in [-2, 2] (0 = off)"),
    "frequency_penalty": Limit(-2.0, 2.0, False, "must be in [-2, 2] (0 = off)"),
    "top_k": Limit(-1, math.inf, False, "must be an integer >= 1, or 0 / -1 for off", integer=True),
})


def check_sampling(name: str, value: object) -> float | int:
    """``value`` of the knob ``name`` (a key of :data:`SAMPLING_LIMITS`), as a float (an int for
    ``top_k``), or :class:`InvalidParameterError` with the one-line message every front end shows."""
    lim = SAMPLING_LIMITS[name]
    if lim.integer:
        if not _is_int(value) or value < lim.lo or value > lim.hi:
            raise _bad(name, value, lim.what)
        return int(value)
    if not _is_number(value) or math.isnan(value) or math.isinf(value):
        raise _bad(name, value, lim.what)
    if value < lim.lo or value > lim.hi or (lim.lo_open and value == lim.lo):
        raise _bad(name, value, lim.what)
    return float(value)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Validated on construction.

    ``max_tokens=None``: up to the context limit; ``temperature=0``: greedy; ``top_k`` 0 or -1: off;
    ``logprobs=k``: the chosen token's logprob plus the top-k alternatives (``None``: off). ``kv_policy``:
    this request's KV eviction policy (``--kv-policy`` syntax; ``None``: the engine's), carried here because
    every front end builds one of these; the engine checks it (``PolicyRuntime.resolve``). ``n``: completions,
    each its own request (``EngineCore.add_request(..., sample_index=i)``, generator ``make_generator(seed,
    index=i)``): seeded completions differ yet repeat run to run, and completion 0 equals ``n=1``.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    n: int = 1
    kv_policy: KVPolicy | None = None  # a str is parsed into a KVPolicy
    # Added to the logits before penalties and sampling, as OpenAI's logit_bias: ((token id, bias), ...);
    # a {id: bias} mapping is normalised to that sorted tuple (hashable, frozen). -100 bans, 100 forces.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Speculative decoding (llmsys.engine.speculative), like kv_policy not a sampling knob: drafts per
    # step at most for this request (None: the engine's --spec-tokens; 0: none), and the token ids of a
    # predicted output (OpenAI's ``prediction``) that drafts are copied from. Neither changes the output.
    spec_tokens: int | None = None
    prediction: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise through the back door once

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", self.max_tokens, "must be an integer >= 1, or None for up to the context")

        for name in SAMPLING_LIMITS:
            set_(self, name, check_sampling(name, getattr(self, name)))
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, "must be an integer or None")

        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise _bad("stop", stop, "must be a string or a list of strings")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", self.stop, "every stop sequence must be a non-empty string")
        set_(self, "stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif _is_int(ids):
            ids = (ids,)
        elif isinstance(ids, (list, tuple)):
            ids = tuple(ids)
        else:
            raise _bad("stop_token_ids", ids, "must be a list of token ids (integers >= 0)")
        if any(not _is_int(t) or t < 0 for t in ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids (integers >= 0)")
        set_(self, "stop_token_ids", ids)

        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "must be true or false")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise _bad("logprobs", self.logprobs, f"must be an integer in 0..{MAX_LOGPROBS}, or None for off")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "must be an integer >= 1")
        bias = self.logit_bias
        pairs = sorted(bias.items()) if isinstance(bias, dict) else list(bias or ())
        try:
            pairs = [(int(t), float(b)) for t, b in pairs]
        except (TypeError, ValueError):
            raise _bad("logit_bias", bias, "must map token ids (integers >= 0) to numbers in [-100, 100]") from None
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in pairs):
            raise _bad("logit_bias", bias, "must map token ids (integers >= 0) to numbers in [-100, 100]")
        set_(self, "logit_bias", tuple(pairs))
        if self.spec_tokens is not None and (not _is_int(self.spec_tokens) or not 0 <= self.spec_tokens <= 16):
            raise _bad("spec_tokens", self.spec_tokens, "must be an integer in 0..16 (0 = no drafts), or None")
        pred = self.prediction
        if not isinstance(pred, (list, tuple)) or any(not _is_int(t) or t < 0 for t in pred):
            raise _bad("prediction", pred, "must be a list of token ids (integers >= 0)")
        set_(self, "prediction", tuple(pred))
        if isinstance(self.kv_policy, str):
            set_(self, "kv_policy", parse_kv_policy(self.kv_policy))
        elif self.kv_policy is not None and not isinstance(self.kv_policy, KVPolicy):
            raise _bad("kv_policy", self.kv_policy, "must be a policy like 'sink:4,window:252', or None for the engine's")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0); no random draw is made."""
        return self.temperature < _GREEDY_EPS


def make_generator(seed: int | None, device: str | torch.device = "cpu", index: int = 0) -> torch.Generator | None:
    """The per-request RNG, created once when the request arrives.

    ``None`` for unseeded requests (they share torch's default RNG). ``index``
    separates the ``n`` parallel samples of one seeded request: index 0 is the
    plain seed, so ``n=1`` and the first of ``n`` samples agree.
    """
    if seed is None:
        return None
    s = seed if index == 0 else seed + index * 0x9E3779B97F4A7C15  # golden-ratio stride
    g = torch.Generator(device=device)
    g.manual_seed(s % (1 << 64))
    return g


@dataclass
class SamplingBatch:
    """Per-row inputs of one sampling step; row ``i`` matches logits row ``i``.

    The histories feed the penalties (repetition: prompt + output; presence /
    frequency: output only) and ``min_tokens`` (length of the output).
    ``eos_token_ids`` are the model's end tokens, masked while a row has fewer
    than ``min_tokens`` outputs (unless ``ignore_eos``).
    """

    params: list[SamplingParams]
    prompt_ids: list[TokenHistory]
    output_ids: list[TokenHistory]
    generators: list[torch.Generator | None] | None = None  # None: all unseeded
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        b = len(self.params)
        if self.generators is None:
            self.generators = [None] * b
        if not (len(self.prompt_ids) == len(self.output_ids) == len(self.generators) == b):
            raise ValueError(
                f"SamplingBatch rows disagree: {b} params, {len(self.prompt_ids)} prompts, "
                f"{len(self.output_ids)} outputs, {len(self.generators)} generators"
            )
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)


@dataclass
class TokenLogprobs:
    """The chosen token's raw logprob and the ``k`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask
    # With drafts (speculative verification): row i's draft token was accepted (its token_ids[i] is the
    # draft); a rejected row's token is the target's own pick (greedy) or its residual draw. None: no drafts.
    accepted: list[bool] | None = None


# ---------------------------------------------------------------------------
# Batched transformations. Each takes float32 logits [B, V] and per-row
# parameters, and returns new logits; masked tokens become -inf.
# ---------------------------------------------------------------------------


def _counts(histories: list[TokenHistory], rows: list[int], b: int, v: int, device: torch.device) -> torch.Tensor:
    """Token occurrence counts [B, V] float32 for the given rows (others 0)."""
    counts = torch.zeros(b, v, dtype=torch.float32, device=device)
    row_idx, tok_idx = [], []
    for i in rows:
        t = torch.as_tensor(histories[i], dtype=torch.long).reshape(-1).to(device)
        if t.numel():
            tok_idx.append(t)
            row_idx.append(torch.full_like(t, i))
    if tok_idx:
        r, t = torch.cat(row_idx), torch.cat(tok_idx)
        counts.index_put_((r, t), torch.ones(r.numel(), dtype=torch.float32, device=device), accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float32
    prompt_counts: torch.Tensor,  # [B, V] occurrences in the prompt
    output_counts: torch.Tensor,  # [B, V] occurrences in the output
    repetition: torch.Tensor,  # [B] (1 = off)
    presence: torch.Tensor,  # [B] (0 = off)
    frequency: torch.Tensor,  # [B] (0 = off)
) -> torch.Tensor:
    """HF/CTRL repetition penalty on every seen token, then OpenAI penalties.

    Repetition: a seen token's logit is divided by the penalty when positive
    and multiplied when negative (so > 1 always discourages). OpenAI:
    ``logit -= count * frequency + (count > 0) * presence``, output only.
    """
    # A penalty below float32's range (the API allows any value > 0) would round to 0, and a masked
    # token's -inf * 0 is NaN, which argmax picks: keep it the smallest positive float32.
    rep = repetition[:, None].clamp(min=torch.finfo(torch.float32).tiny)
    seen = (prompt_counts + output_counts) > 0
    x = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return x - output_counts * frequency[:, None] - (output_counts > 0).float() * presence[:, None]


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose logit >= the k-th largest (ties at the edge kept).

    ``top_k`` [B] long; values <= 0 or >= V leave the row untouched. Keeping
    every tie (a value threshold, not k indices) matters for bf16 logits, where
    ties are common, and makes the result independent of topk's tie order.
    """
    v = logits.shape[-1]
    on = (top_k > 0) & (top_k < v)
    if not bool(on.any()):
        return logits
    rows = on.nonzero()[:, 0]  # only rows that asked pay for the topk
    x, k = logits[rows], top_k[rows]  # [R, V], [R]
    kth = torch.topk(x, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [R, 1]
    out = logits.clone()
    out[rows] = x.masked_fill(x < kth, -math.inf)
    return out


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the smallest most-likely set whose probability reaches ``p``.

    A token survives when the mass strictly above it is still < p, so the top
    token always survives; the cut is then made by value (every token tied with
    the last survivor survives too), so the order a sort gives ties cannot
    matter. Rows with ``p >= 1`` are skipped outright: float rounding in the
    prefix sum must not trim an "off" row's tail.

    ``top_k`` [B] (optional): when every top-p row also has an active top-k,
    only the top-``max k`` window needs ordering (everything below is already
    -inf), which replaces a full-vocabulary sort by a small topk.
    """
    v = logits.shape[-1]
    on = top_p < 1.0
    if not bool(on.any()):
        return logits
    rows = on.nonzero()[:, 0]
    x, p = logits[rows], top_p[rows]  # [R, V], [R]
    probs = torch.softmax(x, dim=-1)  # over the full vocabulary: same sums whatever the window
    k = top_k[rows] if top_k is not None else None
    if k is not None and bool(((k > 0) & (k < v)).all()):
        sorted_logits, order = torch.topk(x, int(k.max()), dim=-1)  # [R, W], descending
    else:
        sorted_logits, order = torch.sort(x, dim=-1, descending=True)  # [R, V]
    cum = torch.cumsum(probs.gather(1, order), dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass above each token
    # >= 1: before[:, 0] == 0 < p, except when a tiny p (e.g. 5e-324) underflows
    # to 0 in float32; the clamp keeps the top token then (found by fuzzing the server).
    n_keep = (before < p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
    cutoff = sorted_logits.gather(1, n_keep - 1)  # [R, 1] smallest surviving logit
    out = logits.clone()
    out[rows] = x.masked_fill(x < cutoff, -math.inf)
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability < min_p * (probability of the top token)."""
    if not bool((min_p > 0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, -math.inf)


def _exp1(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) draws as ``-log(U)``, faster than ``exponential_`` on CPU (docs/benchmarks.md).

    ``U`` is in [0, 1), so a draw is never 0; ``U == 0`` gives ``inf``, which
    just makes that token lose the race (probability 2**-24 per draw).
    """
    return torch.rand(shape, device=device, generator=generator).log_().neg_()


def _per_row(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One value per batch row as a tensor [B] on ``device``."""
    return torch.tensor(values, dtype=dtype, device=device)


class Sampler:
    """Stateless batched sampler; all per-request state lives in the batch."""

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(penalized, filtered)`` float32 logits, both [B, V].

        ``penalized`` (min_tokens mask + penalties) is what greedy rows take
        the argmax of; ``filtered`` (plus temperature, top-k, top-p, min-p) is
        the distribution random rows draw from. Exposed for tests and tools.
        """
        penalized = self._penalize(logits, batch)
        return penalized, self._filter(penalized, batch.params)

    @staticmethod
    def _penalize(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """min_tokens mask + logit_bias + penalties -> float32 [B, V] (the caller's logits are never modified)."""
        b, v = logits.shape
        if len(batch.params) != b:
            raise ValueError(f"logits have {b} rows but the batch has {len(batch.params)} params")
        device = logits.device
        x = logits.float()  # [B, V]; may alias the caller's tensor, so never written in place below
        params = batch.params

        # min_tokens: forbid ending before the floor is reached.
        mask_rows, mask_cols = [], []
        for i, p in enumerate(params):
            if p.min_tokens and len(batch.output_ids[i]) < p.min_tokens:
                ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(batch.eos_token_ids))
                ends = [t for t in ends if t < v]
                mask_rows += [i] * len(ends)
                mask_cols += ends
        if mask_rows:
            x = x.clone()
            x[torch.tensor(mask_rows, device=device), torch.tensor(mask_cols, device=device)] = -math.inf

        # logit_bias: added to the raw logits (OpenAI's order: before penalties and temperature).
        bias_rows = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < v]
        if bias_rows:
            rows, cols, vals = zip(*bias_rows)
            x = x.clone() if not mask_rows else x
            x.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                         torch.tensor(vals, device=device, dtype=x.dtype), accumulate=True)

        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        out_rows = [
            i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        ]
        if out_rows:
            x = apply_penalties(
                x,
                _counts(batch.prompt_ids, rep_rows, b, v, device),
                _counts(batch.output_ids, out_rows, b, v, device),
                _per_row([p.repetition_penalty for p in params], device),
                _per_row([p.presence_penalty for p in params], device),
                _per_row([p.frequency_penalty for p in params], device),
            )
        return x

    @staticmethod
    def _filter(penalized: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p over penalized logits [B, V] -> the draw distribution's logits."""
        device = penalized.device

        temps = _per_row([1.0 if p.greedy else p.temperature for p in params], device)
        x = penalized / temps[:, None]
        # top_k >= V is off; clamped so a huge value (the server does not bound it) fits a long tensor
        top_k = _per_row([min(p.top_k, penalized.shape[-1]) for p in params], device, torch.long)
        x = apply_top_k(x, top_k)
        x = apply_top_p(x, _per_row([p.top_p for p in params], device), top_k)
        return apply_min_p(x, _per_row([p.min_p for p in params], device))

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[int | None] | None = None) -> SampleOutput:
        """Pick one token per row of ``logits`` [B, V] (any float dtype).

        ``drafts[i]`` (speculative verification): a token proposed for row i, accepted or not by
        the standard rejection rule for a draft that is a point mass (every llmsys proposer picks
        its tokens deterministically): a greedy row accepts it when it is the row's argmax; a
        random row draws ``u ~ U[0, 1)`` and accepts when ``u < p(draft)``, else takes a draw from
        ``p`` with the draft's probability removed and renormalised. So a token's distribution is
        exactly ``p`` (``P(d) = p(d)``; ``P(x) = (1 - p(d)) p(x) / (1 - p(d))`` otherwise), the
        sampling settings included. A seeded row with a draft consumes one uniform and then its
        ``V`` race draws, whatever the outcome: a fixed seed gives one fixed answer; rows without
        a draft draw exactly as before.
        """
        b, v = logits.shape
        device = logits.device
        params = batch.params
        greedy = [p.greedy for p in params]
        draft_rows = [i for i in range(b) if drafts is not None and drafts[i] is not None]
        penalized = self._penalize(logits, batch)
        # All-greedy batches (the server's common case) skip the filters: they
        # only shape the draw distribution, which no greedy row reads.
        filtered = penalized if all(greedy) else self._filter(penalized, params)

        chosen = torch.empty(b, dtype=torch.long, device=device)
        if any(greedy):
            chosen = penalized.argmax(dim=-1)
        accepted = [False] * b
        if not all(greedy):
            probs = torch.softmax(filtered, dim=-1)  # [B, V]
            race = torch.ones_like(probs)  # [B, V] Exp(1) draws; 1 for greedy rows (unused)
            u = torch.ones(b, device=device)  # [B] acceptance draws of random draft rows (1: never accepts)
            random_drafts = [i for i in draft_rows if not greedy[i]]
            judged = set(random_drafts)
            unseeded = [i for i in range(b) if not greedy[i] and batch.generators[i] is None]
            if unseeded:
                idx = torch.tensor(unseeded, device=device)
                und = [i for i in unseeded if i in judged]
                if und:
                    u[torch.tensor(und, device=device)] = torch.rand(len(und), device=device)
                race[idx] = _exp1((len(unseeded), v), device, None)
            for i in range(b):
                g = batch.generators[i]
                if greedy[i] or g is None:
                    continue
                # Drawn on the generator's own device, so a CPU generator gives
                # the same stream whatever device the logits live on.
                if i in judged:
                    u[i] = torch.rand((1,), device=g.device, generator=g).to(device)[0]
                race[i] = _exp1((v,), g.device, g).to(device)
            # Guard: a 0 draw would make 0/0 = nan for masked tokens, and nan wins argmax.
            race.clamp_(min=torch.finfo(torch.float32).tiny)
            if random_drafts:
                rows = torch.tensor(random_drafts, device=device)
                cols = torch.tensor([drafts[i] for i in random_drafts], device=device)
                p_draft = probs[rows, cols]  # [R]
                ok = (u[rows] < p_draft).tolist()
                probs = probs.clone()
                probs[rows, cols] = 0.0  # the residual: p without the draft (the draw on rejection)
                for i, a in zip(random_drafts, ok):
                    accepted[i] = a
            drawn = (probs / race).argmax(dim=-1)
            is_greedy = torch.tensor(greedy, device=device)
            chosen = torch.where(is_greedy, chosen, drawn) if any(greedy) else drawn
        token_ids = chosen.tolist()
        for i in draft_rows:
            if greedy[i]:
                accepted[i] = token_ids[i] == drafts[i]
            elif accepted[i]:
                token_ids[i] = drafts[i]
        if draft_rows:
            chosen = torch.tensor(token_ids, device=device)
        return SampleOutput(token_ids=token_ids, logprobs=self._logprobs(logits, params, chosen, token_ids),
                            accepted=accepted if drafts is not None else None)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], chosen: torch.Tensor, token_ids: list[int]
    ) -> list[TokenLogprobs | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(params)
        if not rows:
            return out
        idx = torch.tensor(rows, device=logits.device)
        raw = torch.log_softmax(logits[idx].float(), dim=-1)  # [R, V] model's own distribution
        picked = raw.gather(1, chosen[idx][:, None])[:, 0].tolist()
        kmax = min(max(params[i].logprobs for i in rows), logits.shape[-1])
        top_vals, top_ids = (raw.topk(kmax, dim=-1) if kmax else (raw[:, :0], raw[:, :0].long()))
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            k = params[i].logprobs
            out[i] = TokenLogprobs(
                token_id=token_ids[i],
                logprob=picked[j],
                top=list(zip(top_ids[j][:k], top_vals[j][:k])),
            )
        return out
