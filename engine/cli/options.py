"""Shared CLI options, parsed once into an :class:`EngineConfig`.

Every command that loads a model takes the same engine flags. Instead of
repeating a dozen parameters per command, :func:`engine_command` appends them
to the command's signature (Typer reads ``__signature__``) and hands the
command one ``EngineConfig``; :func:`sampling_command` does the same for
sampling flags -> :class:`SamplingParams`.
"""

from __future__ import annotations

import functools
import inspect
import typing
import types
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from llmsys.kernels.common.errors import InvalidParameterError

if TYPE_CHECKING:  # both import torch: a command's module is imported for --help, its config only when it runs
    from llmsys.engine.config import EngineConfig
    from llmsys.engine.sampling import SamplingParams

P = inspect.Parameter


def _opt(name: str, annotation: Any, default: Any, *flags: str, help: str) -> inspect.Parameter:
    return P(name, P.KEYWORD_ONLY, default=default, annotation=Annotated[annotation, typer.Option(*flags, help=help, rich_help_panel="Engine" if name in _ENGINE_NAMES else "Sampling")])


_ENGINE_NAMES = {
    "device", "dtype", "max_model_len", "block_size", "kv_cache_tokens", "max_num_seqs",
    "max_num_batched_tokens", "threads", "quant", "kv_dtype", "gpu_mem", "cpu_mem", "offload_dir", "kv_policy",
    "swap_space", "prefix_caching", "kv_offload_tokens", "spec", "draft_model", "spec_tokens", "cpu_moe", "n_cpu_moe",
    "sliding_kv", "kv_disk",
}

ENGINE_PARAMS = [
    _opt("device", str, "auto", "--device", help="auto, cpu, cuda or cuda:N"),
    _opt("dtype", str, "auto", "--dtype", help="auto, float32, bfloat16, float16"),
    _opt("max_model_len", Optional[int], None, "--max-model-len", help="context limit in tokens (default and most: the model's positions)"),
    _opt("block_size", int, 16, "--block-size", help="tokens per KV block"),
    _opt("kv_cache_tokens", Optional[int], None, "--kv-cache-tokens", help="KV pool capacity in tokens (default: from free memory)"),
    _opt("max_num_seqs", Optional[int], None, "--max-num-seqs",
         help="sequences decoded together at most (default: 1 for run and chat, 32 otherwise)"),
    _opt("max_num_batched_tokens", int, 512, "--max-batched-tokens", help="tokens per step (chunked prefill)"),
    _opt("threads", Optional[int], None, "--threads", "-t", help="CPU threads (default: the idle physical cores; more than the CPUs present are clamped)"),
    _opt("quant", str, "none", "--quant", help="weight format: none, int8, int8:g32, int4[:g32|:g64|:g128], nf4, fp8"),
    _opt("kv_dtype", str, "auto", "--kv-dtype", help="KV cache format: auto, int8, int4"),
    _opt("gpu_mem", Optional[str], None, "--gpu-mem", help="GPU budget, e.g. 6GiB"),
    _opt("cpu_mem", Optional[str], None, "--cpu-mem", help="CPU RAM budget, e.g. 512MiB"),
    _opt("offload_dir", Optional[str], None, "--offload-dir", help="folder for disk-offloaded weights/KV"),
    _opt("kv_policy", str, "full", "--kv-policy", help="KV eviction: full, window:N, sink:S,window:N, ..."),
    _opt("swap_space", Optional[str], None, "--swap-space",
         help="swap space for preempted requests' KV, e.g. 2GiB; 0 = recompute instead (default: pool size, <= 4GiB)"),
    _opt("kv_offload_tokens", str, "0", "--kv-offload-tokens",
         help="KV beyond --kv-cache-tokens, kept cold (disk for a CPU pool, RAM for a GPU pool) and read per layer: "
              "tokens or a size, e.g. 32768 or 2GiB; 0 = off"),
    _opt("kv_disk", Optional[str], None, "--kv-disk",
         help="keep full prompt KV blocks on disk (in $LLMSYS_HOME/kv) so a restarted process reads them back, at "
              "most this size, e.g. 4GiB; 0 = off (default: 4GiB for serve and chat, off otherwise)"),
    _opt("prefix_caching", bool, True, "--prefix-caching/--no-prefix-caching",
         help="reuse the KV of prompt prefixes seen before (off: every prompt is computed in full)"),
    _opt("sliding_kv", str, "auto", "--sliding-kv",
         help="sliding-window layers' KV: auto (only their window, unless a cold tier or --swap-space needs every "
              "position), ring (only their window, or refuse), full (every position)"),
    _opt("spec", Optional[str], None, "--spec",
         help="speculative decoding (same answers, fewer target steps): ngram (prompt lookup), self[:QUANT] (the "
              "model's own weights at int4 as the draft), draft[:QUANT] (with --draft)"),
    _opt("draft_model", Optional[str], None, "--draft",
         help="draft model for speculative decoding (same tokenizer, resident; implies --spec draft)"),
    _opt("spec_tokens", int, 4, "--spec-tokens", help="drafts verified per step at most (1..16)"),
    _opt("cpu_moe", bool, False, "--cpu-moe",
         help="MoE models: keep every sparse layer's experts in CPU RAM, computed by the CPU (a CUDA engine sends "
              "the hidden states there and back; llama.cpp's flag)"),
    _opt("n_cpu_moe", int, 0, "--n-cpu-moe", help="as --cpu-moe for the first N sparse layers only"),
]

SAMPLING_PARAMS = [
    _opt("max_tokens", int, 256, "--max-tokens", "-n", help="tokens to generate at most; -1: until EOS or the context is full"),
    _opt("temperature", float, 0.8, "--temperature", "--temp", help="0 = greedy"),
    _opt("top_k", int, 0, "--top-k", help="0 = off"),
    _opt("top_p", float, 1.0, "--top-p", help="nucleus sampling mass, (0, 1]"),
    _opt("min_p", float, 0.0, "--min-p", help="drop tokens below min_p x the top probability"),
    _opt("repetition_penalty", float, 1.0, "--repeat-penalty", "--repetition-penalty", help="HF-style, 1 = off"),
    _opt("presence_penalty", float, 0.0, "--presence-penalty", help="OpenAI-style, [-2, 2]"),
    _opt("frequency_penalty", float, 0.0, "--frequency-penalty", help="OpenAI-style, [-2, 2]"),
    _opt("seed", Optional[int], None, "--seed", help="same seed + params -> same text"),
    _opt("stop", Optional[list[str]], None, "--stop", help="stop string (repeatable; not printed)"),
    _opt("ignore_eos", bool, False, "--ignore-eos", help="keep generating past EOS"),
]


def build_engine_config(model: str, values: dict[str, Any]) -> EngineConfig:
    """The engine flags as one config (EngineConfig parses sizes, --quant, --kv-dtype and --kv-policy)."""
    from llmsys.engine.config import EngineConfig

    # --max-num-seqs not given: the config's default (one_conversation set it for run and chat)
    return EngineConfig(model=model, **{k: v for k, v in values.items() if not (k == "max_num_seqs" and v is None)})


def one_conversation(values: dict[str, Any]) -> dict[str, Any]:
    """``run`` and ``chat`` (in-process) decode one conversation: unless ``--max-num-seqs`` says otherwise,
    one sequence, so the default KV pool is one context (builder.kv_pool_tokens), not the four a server
    keeps for parallel requests, and every view's "reserved" is what such a front end can use."""
    return values if values.get("max_num_seqs") is not None else dict(values, max_num_seqs=1)


def kv_disk_on(values: dict[str, Any]) -> dict[str, Any]:
    """``serve`` and ``chat`` keep prompts' KV on disk across restarts unless ``--kv-disk`` says otherwise."""
    from llmsys.engine.config import DEFAULT_KV_DISK

    return values if values.get("kv_disk") is not None else dict(values, kv_disk=DEFAULT_KV_DISK)


def cli_max_tokens(n: int | None) -> int | None:
    """``-n``: a count >= 1, or -1 (llama.cpp's spelling) for no limit but EOS and the context (None)."""
    if n is None or n == -1:
        return None
    if n < 1:
        raise InvalidParameterError(f"--max-tokens/-n must be >= 1, or -1 for until EOS or the context is full; got {n}")
    return n


def build_sampling(values: dict[str, Any]) -> SamplingParams:
    kw = dict(values)
    kw["stop"] = tuple(kw.get("stop") or ())
    if "max_tokens" in kw:
        kw["max_tokens"] = cli_max_tokens(kw["max_tokens"])
    from llmsys.engine.sampling import SamplingParams

    return SamplingParams(**kw)


# `--chat-template` on the commands that render conversations (run, chat, serve): it goes into EngineConfig.
ChatTemplateOption = Annotated[Optional[str], typer.Option(
    "--chat-template", metavar="FILE|NAME",
    help="render conversations with this Jinja file or known template (chatml, llama3, gemma, phi3, zephyr, llama2, "
         "mistral, vicuna, alpaca) instead of the model's own",
)]


def _hints(fn: Callable) -> dict[str, Any]:
    """``fn``'s parameter annotations evaluated one by one; one naming a class imported only under TYPE_CHECKING
    (EngineConfig, SamplingParams: they import torch, which registering a command for --help must not) is left
    out: it is the parameter a decorator fills (``build``'s result), never an option."""
    hints: dict[str, Any] = {}
    for name, annotation in fn.__annotations__.items():
        one = types.SimpleNamespace(__annotations__={name: annotation}, __globals__=fn.__globals__)
        try:
            hints.update(typing.get_type_hints(one, include_extras=True))
        except NameError:
            continue
    return hints


def _extend(fn: Callable, extra: list[inspect.Parameter], build: Callable[[dict[str, Any]], Any], arg: str) -> Callable:
    sig = inspect.signature(fn)
    names = {p.name for p in extra}
    # Resolve string annotations (``from __future__ import annotations``) in
    # the command's own module: Typer evaluates hints in the wrapper's.
    hints = _hints(fn)
    base = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values() if p.name != arg]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        picked = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        return fn(*args, **kwargs, **{arg: build(picked)})

    # The engine flags' panel goes last: a command's own options and sampling come first in --help.
    params = sorted(base + extra, key=lambda p: p.name in _ENGINE_NAMES and p.kind == P.KEYWORD_ONLY)
    wrapper.__signature__ = sig.replace(parameters=params, return_annotation=inspect.Signature.empty)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__
    return wrapper


PULL_PARAM = P(
    "pull", P.KEYWORD_ONLY, default=True,
    annotation=Annotated[bool, typer.Option(
        "--pull/--no-pull",
        help="download MODEL first when it is a catalog name or org/repo not yet here (asks on a terminal)",
    )],
)


def pulling_command(fn: Callable) -> Callable:
    """Give ``fn(model, ..., auto_pull: bool)`` the ``--pull/--no-pull`` flag."""
    return _extend(fn, [PULL_PARAM], lambda v: v["pull"], "auto_pull")


def fold_moe_flags(values: dict[str, Any]) -> dict[str, Any]:
    """``--cpu-moe`` / ``--n-cpu-moe N`` (llama.cpp's two spellings) as ``EngineConfig.cpu_moe`` (-1: all)."""
    v = dict(values)
    every, n = v.pop("cpu_moe", False), v.pop("n_cpu_moe", 0)
    if every or n:
        v["cpu_moe"] = -1 if every else n
    return v


def engine_command(fn: Callable) -> Callable:
    """Give ``fn(model, ..., engine_flags: dict)`` every engine flag."""
    return _extend(fn, ENGINE_PARAMS, fold_moe_flags, "engine_flags")


def sampling_command(fn: Callable) -> Callable:
    """Give ``fn(..., sampling: SamplingParams)`` every sampling flag."""
    return _extend(fn, SAMPLING_PARAMS, build_sampling, "sampling")


def sampling_values_command(fn: Callable) -> Callable:
    """Give ``fn(..., sampling_values: dict)`` every sampling flag unparsed: a command that may send them to a
    server (``run``, ``chat``) builds :class:`SamplingParams`, which imports torch, only when it runs locally."""
    return _extend(fn, SAMPLING_PARAMS, dict, "sampling_values")


# `--host` / `--local` on the commands that use a running server when one answers (run, chat).
HostOption = Annotated[Optional[str], typer.Option(
    "--host", metavar="HOST:PORT", help="the llmsys server to use when it answers (default: $LLMSYS_HOST, else "
                                        "127.0.0.1:8000, where llmsys serve listens)")]
LocalOption = Annotated[bool, typer.Option("--local", help="load the model in this process even when a server answers")]


def changed_engine_flags(values: dict[str, Any]) -> list[str]:
    """The engine flags given other than their defaults, as typed (``--quant``): a running server was started
    with its own, so these ask for an engine of this process."""
    defaults = fold_moe_flags({p.name: p.default for p in ENGINE_PARAMS})
    # _opt passes the flags positionally, so typer's OptionInfo holds the first as its "default"
    flags = {p.name: typing.get_args(p.annotation)[1].default for p in ENGINE_PARAMS}
    flags["cpu_moe"] = "--cpu-moe/--n-cpu-moe"
    return [flags[k] for k, v in values.items() if k in flags and v != defaults.get(k)]
