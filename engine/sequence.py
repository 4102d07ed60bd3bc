"""One request's state as the scheduler and runner see it.

Plain Python: token ids and block ids, no tensors. ``num_computed`` counts the
tokens whose K/V are already in the cache; a step feeds
``tokens[num_computed : num_computed + n]`` and, when that reaches the end of
the known tokens, samples the next one.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmsys.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from llmsys.engine.core import TextState
    from llmsys.offload.kv_policy import SeqKVState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + output may not exceed this many tokens
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    prefill_done_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # seeded once per request; None: torch's default RNG
    state: TextState | None = None  # the engine core's text state (detokenizer, stop checker, constraint)
    kv: SeqKVState | None = None  # KV policy bookkeeping; None under `full`
    swapped_blocks: list[int] = field(default_factory=list)  # swap-space blocks holding its KV while preempted
    # The sliding layers' ring (llmsys.engine.sliding_kv): R ring-pool block ids (0: none yet) and the
    # logical block each holds (-1: none); empty while it holds no ring.
    ring_blocks: list[int] = field(default_factory=list)
    ring_logical: list[int] = field(default_factory=list)
    # Prefix caching (llmsys.engine.prefix_cache): keys of its full blocks, how many of its
    # blocks are registered under them, and prompt tokens served from the cache at admission.
    block_keys: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    num_cached_tokens: int = 0
    # Speculative decoding: drafts the target verified for it, and how many it kept.
    num_drafted: int = 0
    num_draft_accepted: int = 0
    spec_k: int | None = None  # drafts to ask for next (EngineCore adapts it; None: --spec-tokens)
    # False: its prompt never starts from cached prefix blocks (an embedding that pools every prompt row
    # must compute each one: llmsys.engine.embedding).
    prefix_reuse: bool = True

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_len(self) -> int:
        """Tokens in the KV cache (fewer than ``num_computed`` once a policy evicted)."""
        return self.num_computed if self.kv is None else self.kv.cache_len

    @property
    def is_prefill(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(frozen=True)
class SeqChunk:
    """A live sequence and how many tokens a step fed it (from its ``num_computed``): what
    the scheduler hands the KV policy's bookkeeping once the step ran."""

    seq: Sequence
    num_new_tokens: int
