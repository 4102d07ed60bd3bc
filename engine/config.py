"""The one configuration object every front end builds.

CLI flags, ``LLM(**kwargs)`` and server options are all merged into a frozen
:class:`EngineConfig` once, so the rest of the engine never re-parses flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.kernels.common.units import parse_size
from llmsys.offload.eviction.policy import KVPolicy, parse_kv_policy
from llmsys.quant.formats import QuantSpec, parse_quant

if TYPE_CHECKING:
    from llmsys.engine.chat_template import ChatTemplate

DTYPES = ("auto", "float32", "bfloat16", "float16")
SLIDING_KV_MODES = ("auto", "ring", "full")  # EngineConfig.sliding_kv (llmsys.engine.sliding_kv)
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_KV_DISK = 4 << 30  # --kv-disk of `serve` and `chat` when unset (llmsys.engine.kv_disk); elsewhere 0 (off)


QUANT_NAMES = ("none", "int8", "int8:g32", "int4", "int4:g32", "int4:g64", "int4:g128", "nf4", "nf4:dq", "fp8")
KV_DTYPE_NAMES = ("auto", "int8", "int4")
# Distillation steps after GPTQ / AWQ calibration and the calibration sequences' length
# (`llmsys quantize --tune-steps`, `--calib-len`; why these: engine.quantize.refine_quantized).
DEFAULT_TUNE_STEPS = 500
DEFAULT_CALIB_LEN = 128


def parse_quant_flag(text: str | QuantSpec | None) -> QuantSpec:
    """``--quant`` -> QuantSpec; unknown names list the valid ones."""
    if isinstance(text, QuantSpec):
        return text
    try:
        return parse_quant(text)
    except InvalidParameterError:
        raise InvalidParameterError(f"unknown --quant {text!r}; valid: {', '.join(QUANT_NAMES)}") from None


def parse_kv_dtype(text: str | None) -> str:
    """``--kv-dtype`` -> "auto" | "int8" | "int4"; unknown names list the valid ones."""
    raw = "auto" if text is None else str(text).strip().lower()
    if raw in ("", "none", "float", "model"):
        raw = "auto"
    if raw not in KV_DTYPE_NAMES:
        raise InvalidParameterError(f"unknown --kv-dtype {text!r}; valid: {', '.join(KV_DTYPE_NAMES)}")
    return raw


def check_kv_dtype(kv_dtype: str, head_dim: int) -> None:
    """Can a model with ``head_dim`` keep its KV as ``kv_dtype`` (int4 packs pairs of channels)?"""
    if kv_dtype == "int4" and head_dim % 2:
        raise InvalidParameterError(f"--kv-dtype int4 needs an even head_dim (this model has {head_dim}); use int8")


SPEC_KINDS = ("ngram", "self", "draft")
MAX_SPEC_TOKENS = 16  # --spec-tokens at most


@dataclass(frozen=True)
class SpecSpec:
    """``--spec`` parsed: ``kind`` ngram | self | draft, ``quant`` for a model draft (None: as stored)."""

    kind: str
    quant: str | None = None

    @property
    def needs_model(self) -> bool:
        return self.kind != "ngram"


def parse_spec(text: str | SpecSpec | None, draft_model: str | None) -> SpecSpec | None:
    """``--spec`` (``ngram``, ``self[:QUANT]``, ``draft[:QUANT]``) with ``--draft MODEL``; None: off.

    ``--draft`` alone means ``draft``; ``self`` alone means ``self:int4``.
    """
    if isinstance(text, SpecSpec):
        text = text.kind + (f":{text.quant}" if text.quant else "")
    raw = (text or "").strip().lower()
    if raw in ("", "none", "off"):
        return SpecSpec("draft") if draft_model else None
    kind, _, quant = raw.partition(":")
    if kind not in SPEC_KINDS:
        raise InvalidParameterError(f"unknown --spec {text!r}; valid: ngram, self[:QUANT] (e.g. self:int4), "
                                    "draft[:QUANT] with --draft MODEL")
    if kind == "ngram" and quant:
        raise InvalidParameterError(f"--spec ngram takes no quantization, got {text!r}")
    if kind == "draft" and not draft_model:
        raise InvalidParameterError("--spec draft needs --draft MODEL (a model with the target's tokenizer)")
    if kind != "draft" and draft_model:
        raise InvalidParameterError(f"--draft {draft_model} goes with --spec draft (or no --spec), not {text!r}")
    if kind == "self":
        quant = quant or "int4"
    if quant:
        try:
            parse_quant(quant)
        except InvalidParameterError:
            raise InvalidParameterError(f"--spec {text}: unknown quantization {quant!r}; valid: "
                                        f"{', '.join(QUANT_NAMES)}") from None
    return SpecSpec(kind, quant or None)


def spec_tokens_ok(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_TOKENS:
        raise InvalidParameterError(f"--spec-tokens must be in 1..{MAX_SPEC_TOKENS}, got {k!r}")
    return k


def flag_name(field_name: str) -> str:
    """The CLI flag of an EngineConfig field (``swap_space`` -> ``--swap-space``), for error messages."""
    return "--" + field_name.replace("_", "-")


def _size_flag(name: str, value: int | str | None) -> int | None:
    """A size field in bytes; a bad spelling or a negative count names its flag."""
    try:
        n = parse_size(value)
    except InvalidParameterError as e:
        raise InvalidParameterError(f"{flag_name(name)}: {e}") from None
    if n is not None and n < 0:
        raise InvalidParameterError(f"{flag_name(name)} must be >= 0 bytes, got {n}")
    return n


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how a model is loaded and run.

    Every flag is parsed here, once, into its typed value: ``quant`` becomes a
    :class:`QuantSpec`, ``kv_policy`` a :class:`KVPolicy` (its byte budgets
    are resolved against the KV shape by the policy runtime), ``kv_dtype`` its
    canonical name, sizes bytes (``None`` = choose from what the machine has
    free), ``kv_offload_tokens`` a token count or, for a size, bytes in
    ``kv_offload_bytes``. Strings are accepted for all of them (CLI,
    ``LLM(**kwargs)``); nothing downstream parses them again.
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
    quant: QuantSpec = QuantSpec("none")  # --quant (a str is parsed)
    # Module names --quant leaves in float (e.g. "lm_head", "model.embed_tokens").
    quant_keep_float: tuple[str, ...] = ()
    # CPU: resident linear weights in oneDNN's blocked layout (faster GEMV, same bits). False for
    # tools that read or rewrite .weight (`llmsys quantize`): nothing is packed, not even on the fly.
    prepack: bool = True
    kv_dtype: str = "auto"  # "auto" (the model dtype) | "int8" | "int4"
    gpu_mem: int | None = None
    cpu_mem: int | None = None
    offload_dir: str | None = None
    # Weight placement forced per tier instead of planned, e.g. {"cpu": 2, "disk": 4, "head": "disk"}.
    placement: dict[str, Any] | None = field(default=None, hash=False)
    plan_batch: int = 1  # the batch the offload plan is made for (its compute/transfer overlap)
    # Let streamed weight pages stay in the page cache (benchmarks comparing with Accelerate's
    # memmaps, which keep them); the default drops them.
    keep_page_cache: bool = False
    # --cpu-moe / --n-cpu-moe N (llama.cpp's flags): the experts of the first N sparse layers (-1: all) stay in
    # CPU RAM and are computed by the CPU on a CUDA engine (llmsys.offload.experts); 0: planned as any weight.
    cpu_moe: int = 0
    # Swap space for preempted sequences' KV (llmsys.offload.kv_swap): bytes, 0 = off (recompute),
    # None = auto (as many blocks as the pool, at most 4 GiB; CPU RAM for a GPU pool, else disk).
    swap_space: int | None = None
    # Cold KV tier (llmsys.offload.kv_tier): room for this many tokens of KV beyond the pool
    # (--kv-cache-tokens is then the hot part), or a size such as "2GiB"; 0 = off. On disk
    # (the offload folder) for a CPU pool, in pinned CPU RAM for a GPU pool.
    kv_offload_tokens: int | str = 0  # a size (str) is kept as written; its bytes are kv_offload_bytes
    kv_offload_tier: str | None = None  # the cold tier's medium ("disk" | "cpu"); None: by the pool's device
    kv_offload_drop_cache: bool = False  # drop the cold tier's file pages after each read (benchmarks)
    kv_policy: KVPolicy = KVPolicy()  # --kv-policy (a str is parsed)
    # Reuse the KV blocks of prompt prefixes seen before (llmsys.engine.prefix_cache). Benchmarks
    # of prefill speed turn it off: a repeated prompt would not be computed at all.
    prefix_caching: bool = True
    # Sliding-window layers' KV (llmsys.engine.sliding_kv): "auto" keeps only their window, in per-sequence
    # rings, unless a cold tier or an explicit swap space needs every position (then full, said in the log);
    # "ring" refuses those instead; "full" keeps every position, as global layers do.
    sliding_kv: str = "auto"
    progress: bool = True  # loading progress bar (only drawn on a TTY)
    # Speculative decoding (llmsys.engine.speculative): --spec ngram | self[:QUANT] | draft[:QUANT],
    # --draft MODEL (implies draft), --spec-tokens drafts verified per step at most.
    spec: SpecSpec | None = None  # a str is parsed
    draft_model: str | None = None
    spec_tokens: int = 4
    # --chat-template FILE|NAME: a Jinja file or a known family (llmsys.engine.chat_template), rendered instead of
    # the model's own by every front end (a str is compiled here, once); None: the model's own template.
    chat_template: ChatTemplate | None = field(default=None, hash=False)
    # The prefix cache's disk tier (llmsys.engine.kv_disk): at most this many bytes of full KV blocks kept
    # in files under kv_disk_dir (None: $LLMSYS_HOME/kv) and read back by a later process; 0 = off
    # (`serve` and `chat` default to DEFAULT_KV_DISK). A size such as "4GiB" is parsed.
    kv_disk: int | str | None = 0
    kv_disk_dir: str | None = None
    kv_offload_bytes: int | None = field(default=None, init=False)  # --kv-offload-tokens given as a size

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise through the back door once
        if self.dtype not in DTYPES:
            raise InvalidParameterError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise InvalidParameterError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.block_size < 1 or self.block_size > 1024:
            raise InvalidParameterError(f"--block-size must be in 1..1024, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise InvalidParameterError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.sliding_kv not in SLIDING_KV_MODES:
            raise InvalidParameterError(f"unknown --sliding-kv {self.sliding_kv!r}; valid: "
                                        f"{', '.join(SLIDING_KV_MODES)}")
        if self.max_num_batched_tokens < 1:
            raise InvalidParameterError(f"--max-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.threads is not None and self.threads < 1:
            raise InvalidParameterError(f"--threads must be >= 1, got {self.threads} (unset: the idle physical cores)")
        if self.plan_batch < 1:
            raise InvalidParameterError(f"plan_batch must be >= 1, got {self.plan_batch}")
        if self.max_model_len is not None and self.max_model_len < 2:
            # 0 would read as "unset" downstream (the model's context): refuse it here instead.
            raise InvalidParameterError(f"--max-model-len must be >= 2, got {self.max_model_len}; "
                                        "leave it unset for the model's context")
        if self.cpu_moe < -1:
            raise InvalidParameterError(f"--n-cpu-moe must be >= 0 (or -1: every sparse layer), got {self.cpu_moe}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise InvalidParameterError(f"--kv-cache-tokens must be >= 1, got {self.kv_cache_tokens}; "
                                        "leave it unset to size the pool from free memory")
        for name in ("gpu_mem", "cpu_mem", "swap_space"):
            set_(self, name, _size_flag(name, getattr(self, name)))
        set_(self, "kv_disk", _size_flag("kv_disk", self.kv_disk) or 0)
        set_(self, "quant", parse_quant_flag(self.quant))
        set_(self, "quant_keep_float", tuple(self.quant_keep_float))
        set_(self, "kv_dtype", parse_kv_dtype(self.kv_dtype))
        set_(self, "kv_policy", parse_kv_policy(self.kv_policy))
        set_(self, "spec", parse_spec(self.spec, self.draft_model))
        spec_tokens_ok(self.spec_tokens)
        if self.chat_template is not None:
            from llmsys.engine.chat_template import resolve_chat_template  # jinja2: only when a template is given

            set_(self, "chat_template", resolve_chat_template(self.chat_template))
        if self.spec is not None and self.kv_policy.kind == "quest":
            raise InvalidParameterError("--spec cannot run with --kv-policy quest (its page selection is per "
                                        "decode step); use another policy or no --spec")
        off = self.kv_offload_tokens
        if off is None or (isinstance(off, str) and off.strip().isdigit()):
            set_(self, "kv_offload_tokens", int(off or 0))
        elif isinstance(off, str):
            # Turned into tokens once the KV shape is known.
            set_(self, "kv_offload_bytes", _size_flag("kv_offload_tokens", off))
        if isinstance(self.kv_offload_tokens, int) and self.kv_offload_tokens < 0:
            raise InvalidParameterError(f"kv_offload_tokens must be >= 0, got {self.kv_offload_tokens}")

    def offload_tokens(self, bytes_per_token: int) -> int:
        """Tokens of KV the cold tier holds (``kv_offload_tokens``, or ``kv_offload_bytes`` over the KV per token)."""
        if self.kv_offload_bytes is not None:
            return self.kv_offload_bytes // bytes_per_token
        return self.kv_offload_tokens

    def with_(self, **changes: Any) -> "EngineConfig":
        return replace(self, **changes)
