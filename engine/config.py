"""The one configuration object every front end builds.

CLI flags, ``LLM(**kwargs)`` and server options are all merged into a frozen
:class:`EngineConfig` once, so the rest of the engine never re-parses flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.kernels.common.units import parse_size

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how a model is loaded and run.

    Sizes are bytes (``None`` = choose from what the machine has free).
    """

    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's trained context
    block_size: int = 16  # tokens per KV block
    kv_cache_tokens: int | None = None  # KV pool capacity; None: sized from memory
    max_num_seqs: int = 32  # sequences decoded together at most
    max_num_batched_tokens: int = 512  # tokens per step (chunked prefill budget)
    threads: int | None = None
    quant: str = "none"
    kv_dtype: str = "auto"
    gpu_mem: int | None = None
    cpu_mem: int | None = None
    offload_dir: str | None = None
    # Swap space for preempted sequences' KV (llmsys.offload.kv_swap): bytes, 0 = off (recompute),
    # None = auto (as many blocks as the pool, at most 4 GiB; CPU RAM for a GPU pool, else disk).
    swap_space: int | None = None
    # Cold KV tier (llmsys.offload.kv_tier): room for this many tokens of KV beyond the pool
    # (--kv-cache-tokens is then the hot part), or a size such as "2GiB"; 0 = off. On disk
    # (the offload folder) for a CPU pool, in pinned CPU RAM for a GPU pool.
    kv_offload_tokens: int | str = 0
    kv_policy: str = "full"
    # Reuse the KV blocks of prompt prefixes seen before (llmsys.engine.prefix_cache). Benchmarks
    # of prefill speed turn it off: a repeated prompt would not be computed at all.
    prefix_caching: bool = True
    progress: bool = True  # loading progress bar (only drawn on a TTY)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidParameterError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise InvalidParameterError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.block_size < 1 or self.block_size > 1024:
            raise InvalidParameterError(f"block_size must be in 1..1024, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise InvalidParameterError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise InvalidParameterError("max_num_batched_tokens must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise InvalidParameterError(f"threads must be >= 1, got {self.threads}")
        for name in ("gpu_mem", "cpu_mem", "swap_space"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, int):
                object.__setattr__(self, name, parse_size(v))
        off = self.kv_offload_tokens
        if off is None or (isinstance(off, str) and off.strip().isdigit()):
            object.__setattr__(self, "kv_offload_tokens", int(off or 0))
        elif isinstance(off, str):
            parse_size(off)  # a size: checked now, turned into tokens once the KV shape is known
        if isinstance(self.kv_offload_tokens, int) and self.kv_offload_tokens < 0:
            raise InvalidParameterError(f"kv_offload_tokens must be >= 0, got {self.kv_offload_tokens}")

    def offload_tokens(self, bytes_per_token: int) -> int:
        """Tokens of KV the cold tier holds (``kv_offload_tokens`` as tokens, or its size over the KV per token)."""
        off = self.kv_offload_tokens
        return off if isinstance(off, int) else (parse_size(off) or 0) // bytes_per_token

    def with_(self, **changes: Any) -> "EngineConfig":
        return replace(self, **changes)
