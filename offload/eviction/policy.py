"""KV eviction policies: what to keep when a sequence's KV exceeds its budget.

A policy decides over one sequence's bookkeeping (``orig [L]`` stream positions; ``score [L]`` for H2O,
``obs [W, L]`` for SnapKV) and returns the sorted cache indices to keep; moving K/V, re-rotating keys and
freeing blocks is :mod:`llmsys.offload.eviction.compact`, one path for all. Syntax (``--kv-policy``,
``LLM(kv_policy=)``, ``SamplingParams(kv_policy=)``, the server's ``kv_policy``):

* ``full`` (no eviction: a full context finishes "length"), ``window:N``, ``sink:S,window:N`` (StreamingLLM)
* ``h2o:H,recent:R``, ``snapkv:N[,obs:W][,pool:P]`` (the prompt compressed to N at the end of prefill)
* ``quest:K`` (every page kept, attention over the top-K pages), ``recompute:N`` (``perplexity --stream`` only)
* any + ``chunk:C``: evict C at once (default the block size; 1 in stream scoring). Budgets are tokens
  or bytes (``window:64KiB``, :meth:`KVPolicy.resolve`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.kernels.common.units import parse_size

if TYPE_CHECKING:  # torch is imported where a policy evicts: EngineConfig parses --kv-policy for every CLI command
    import torch

POLICIES = ("full", "window", "sink", "h2o", "snapkv", "quest", "recompute")
_SYNTAX = "full, window:N, sink:S,window:N, h2o:H,recent:R, snapkv:N, quest:K, recompute:N"


@dataclass(frozen=True)
class Amount:
    """A budget as written: tokens, or bytes to be converted per model."""

    value: float
    is_bytes: bool

    def tokens(self, bytes_per_token: int | None) -> int:
        if not self.is_bytes:
            return int(self.value)
        if not bytes_per_token:
            raise InvalidParameterError("a KV budget in bytes needs the model's KV bytes per token; give tokens")
        return int(self.value // bytes_per_token)


def _amount(key: str, text: str, policy: str) -> Amount:
    """A bare whole number is tokens; anything with a unit is bytes, read by the one size parser."""
    number = re.match(r"\s*([0-9]*\.?[0-9]*)", text).group(1)
    if len(number) > 15:  # beyond any pool (and int()/float() of a huge digit string fails oddly)
        raise InvalidParameterError(f"kv_policy {policy!r}: {key} {text!r} is too large")
    if re.fullmatch(r"\s*[0-9]+\s*", text):
        return Amount(int(text), False)
    if re.fullmatch(r"\s*[0-9]*\.[0-9]+\s*", text):
        raise InvalidParameterError(f"kv_policy {policy!r}: {key} must be a whole number of tokens, got {text!r}")
    try:
        nbytes = parse_size(text)
    except InvalidParameterError as exc:
        raise InvalidParameterError(
            f"kv_policy {policy!r}: {key} needs a number of tokens or a size like 64KiB, got {text!r} ({exc})"
        ) from None
    return Amount(float(nbytes), True)


@dataclass(frozen=True)
class KVPolicy:
    """One parsed policy; token counts are final after :meth:`resolve`.

    ``budget`` is the most tokens a sequence keeps in its KV cache (0 = no
    limit: ``full`` and ``quest``). The fields a kind does not use stay 0.
    """

    kind: str = "full"
    text: str = "full"
    sinks: int = 0  # sink: first tokens never evicted
    window: int = 0  # window/sink: most recent tokens kept
    heavy: int = 0  # h2o: heavy hitters kept
    recent: int = 0  # h2o: most recent kept
    keep: int = 0  # snapkv: tokens kept after compression
    obs: int = 16  # snapkv: observation window (last queries whose attention scores the rest)
    pool: int = 7  # snapkv: max-pooling kernel over the scores (odd)
    top_pages: int = 0  # quest: pages attended per query
    chunk: int = 0  # tokens evicted at once (0: caller's default)
    raw: tuple[tuple[str, Amount], ...] = ()  # amounts as written, for resolve()

    # -- what the engine needs to know -------------------------------------
    @property
    def evicts(self) -> bool:
        return self.kind in ("window", "sink", "h2o", "snapkv")

    @property
    def allows_long_prompts(self) -> bool:
        """Prompts longer than the context are fine: the window slides during prefill."""
        return self.kind in ("window", "sink", "h2o")

    @property
    def needs_scores(self) -> bool:
        return self.kind in ("h2o", "snapkv")

    @property
    def budget(self) -> int:
        return {
            "window": self.window,
            "sink": self.sinks + self.window,
            "h2o": self.heavy + self.recent,
            "snapkv": self.keep,
            "recompute": self.window,
        }.get(self.kind, 0)

    @property
    def min_keep(self) -> int:
        """Tokens an eviction never goes below (the sinks; 1 otherwise)."""
        return max(self.sinks, 1)

    def resolve(self, bytes_per_token: int | None) -> "KVPolicy":
        """Byte budgets -> tokens for a model; validates the result."""
        vals = {k: a.tokens(bytes_per_token) for k, a in self.raw}
        pol = replace(self, **vals)
        pol._validate()
        return pol

    def _validate(self) -> None:
        bad = lambda msg: InvalidParameterError(f"kv_policy {self.text!r}: {msg}")  # noqa: E731
        if self.kind in ("window", "recompute") and self.window < 2:
            raise bad("the window must hold at least 2 tokens")
        if self.kind == "sink" and (self.sinks < 1 or self.window < 1):
            raise bad("sink needs S >= 1 and window N >= 1 (write sink:4,window:252)")
        if self.kind == "h2o" and (self.heavy < 1 or self.recent < 1):
            raise bad("h2o needs H >= 1 heavy hitters and R >= 1 recent tokens (write h2o:128,recent:128)")
        if self.kind == "snapkv" and (self.keep <= self.obs or self.pool < 1 or self.pool % 2 == 0):
            raise bad(f"snapkv needs N > obs ({self.obs}) and an odd pool size")
        if self.kind == "snapkv" and self.pool > self.keep:
            raise bad(f"snapkv's pool ({self.pool}) must not be wider than N ({self.keep})")
        if self.kind == "quest" and self.top_pages < 1:
            raise bad("quest needs K >= 1 pages")
        if self.chunk < 0:
            raise bad("chunk must be >= 1")

    # -- the decision -------------------------------------------------------
    def select(
        self,
        orig: torch.Tensor,  # [L] int64 original positions of the cached tokens (increasing)
        target: int,  # tokens to keep (< L)
        score: torch.Tensor | None = None,  # [L] float32 accumulated attention (h2o)
        obs: torch.Tensor | None = None,  # [W', L] float32 attention rows of the last queries (snapkv)
    ) -> torch.Tensor:  # [target] int64 sorted cache indices to keep
        import torch
        import torch.nn.functional as F

        L = orig.numel()
        target = max(0, min(target, L))
        idx = torch.arange(L)
        if self.kind == "window":
            return idx[L - target :]
        if self.kind == "sink":
            s = min(self.sinks, target)
            return torch.cat([idx[:s], idx[L - (target - s) :] if target > s else idx[:0]])
        if self.kind == "h2o":
            r = min(self.recent, target)
            older = L - r
            if score is None:
                raise ValueError("h2o eviction needs accumulated attention scores")
            heavy = _top(score[:older], target - r)
            return torch.cat([heavy, idx[older:]])
        if self.kind == "snapkv":
            w = min(self.obs, target, L)
            older = L - w
            if obs is None or obs.numel() == 0:
                agg = torch.zeros(L)
            else:
                agg = obs.sum(dim=0)
            pooled = F.max_pool1d(agg[None, None, :], self.pool, stride=1, padding=self.pool // 2)[0, 0] if L else agg
            heavy = _top(pooled[:older], target - w)
            return torch.cat([heavy, idx[older:]])
        raise ValueError(f"policy {self.kind!r} does not evict")


def _top(score: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest scores (ties: the older token wins)."""
    import torch

    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    # stable: sort descending by score, ascending index among equals
    order = torch.sort(score, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


_KEYS = {
    "full": ((), ()),
    "window": (("window",), ()),
    "sink": (("sink", "window"), ()),
    "h2o": (("h2o", "recent"), ()),
    "snapkv": (("snapkv",), ("obs", "pool")),
    "quest": (("quest",), ()),
    "recompute": (("recompute",), ()),
}
_FIELD = {"window": "window", "sink": "sinks", "h2o": "heavy", "recent": "recent", "snapkv": "keep",
          "obs": "obs", "pool": "pool", "quest": "top_pages", "recompute": "window", "chunk": "chunk"}
_BYTES_OK = {"window", "sinks", "heavy", "recent", "keep"}


def parse_kv_policy(text: str | KVPolicy | None) -> KVPolicy:
    """``'sink:4,window:252'`` -> :class:`KVPolicy` (unresolved if budgets are bytes).

    Unknown names or malformed parts raise :class:`InvalidParameterError`
    listing the valid policies.
    """
    if isinstance(text, KVPolicy):
        return text
    src = (text or "full").strip()
    parts = [p.strip() for p in src.replace(";", ",").split(",") if p.strip()]
    if not parts:
        parts = ["full"]
    kv: list[tuple[str, str | None]] = []
    for p in parts:
        k, sep, v = p.partition(":")
        kv.append((k.strip().lower(), v.strip() if sep else None))
    kind = kv[0][0]
    if kind not in POLICIES:
        raise InvalidParameterError(f"unknown KV policy {kind!r} in {src!r}; valid: {_SYNTAX}")
    required, optional = _KEYS[kind]
    names = [k for k, _ in kv]
    allowed = set(required) | set(optional) | {"chunk", kind}
    for k in names:
        if k not in allowed:
            raise InvalidParameterError(
                f"kv_policy {src!r}: {k!r} does not belong to {kind!r}; valid: {_SYNTAX}"
            )
    missing = [k for k in required if k not in names]
    if missing or len(set(names)) != len(names):
        raise InvalidParameterError(f"kv_policy {src!r}: write it as one of {_SYNTAX}")
    fields: dict = {}
    raw = []
    for k, v in kv:
        if kind == "full" and k == "full":
            continue
        if v is None:
            raise InvalidParameterError(f"kv_policy {src!r}: {k} needs a value ({k}:N); valid: {_SYNTAX}")
        name = _FIELD[k]
        amt = _amount(k, v, src)
        if amt.is_bytes and name not in _BYTES_OK:
            raise InvalidParameterError(f"kv_policy {src!r}: {k} is a count, not a size")
        if amt.is_bytes:
            raw.append((name, amt))
            fields[name] = 0
        else:
            fields[name] = int(amt.value)
    pol = KVPolicy(kind=kind, text=src, raw=tuple(raw), **fields)
    if not raw:
        pol._validate()
    return pol
