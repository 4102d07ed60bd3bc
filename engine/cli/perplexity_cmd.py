"""``llmsys perplexity MODEL FILE``: score a text file in windows, or as one stream.

Without ``--stream`` the file is cut into independent ``--ctx`` windows
(llama-perplexity). With ``--stream`` it is scored as one continuous stream
under ``--kv-policy`` (token by token once the policy's budget is reached),
printing the perplexity over the whole stream and per ``--segment`` tokens;
``--kv-policy recompute:N`` is the sliding-window-with-recomputation oracle.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmsys.engine.cli.options import build_engine_config, engine_command
from llmsys.engine.config import EngineConfig
from llmsys.kernels.common.errors import InvalidParameterError, ModelNotFoundError


@engine_command
def perplexity_command(
    model: Annotated[str, typer.Argument(help="model directory, .gguf file (any weight format llmsys reads, e.g. "
                                        "Q4_K_M), llama2.c .bin, catalog name or org/repo")],
    file: Annotated[Path, typer.Argument(help="UTF-8 text file to score")],
    ctx: Annotated[int, typer.Option("--ctx", help="window length in tokens (each window starts with BOS)")] = 256,
    limit: Annotated[Optional[int], typer.Option("--limit", help="score only the first N tokens of the file")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="score the file as one stream under --kv-policy")] = False,
    segment: Annotated[int, typer.Option("--segment", help="with --stream: report perplexity per this many tokens")] = 1000,
    *,
    engine_flags: dict[str, Any],
) -> int:
    from llmsys.engine.llm import LLM
    from llmsys.engine.scoring import perplexity_stream, perplexity_windows
    from llmsys.offload.kv_policy import parse_kv_policy

    if not file.is_file():
        raise ModelNotFoundError(f"no such text file: {file}")
    if ctx < 2:
        raise InvalidParameterError(f"--ctx must be >= 2, got {ctx}")
    if segment < 1:
        raise InvalidParameterError(f"--segment must be >= 1, got {segment}")
    flags = dict(engine_flags)
    policy = parse_kv_policy(flags.pop("kv_policy", None) or "full")
    if not stream:
        if policy.kind != "full":
            raise InvalidParameterError(f"--kv-policy {policy.text!r} applies to --stream scoring; add --stream")
        llm = LLM(_scoring_config(model, flags))
        if ctx > llm.max_model_len:
            raise InvalidParameterError(f"--ctx {ctx} exceeds the model's context of {llm.max_model_len} tokens")
        ids = llm.tokenizer.encode(file.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        if limit is not None:
            ids = ids[:limit]
        res = perplexity_windows(llm.core, ids, ctx, llm.tokenizer.bos_token_id)
        print(f"perplexity {res.perplexity:.4f} | tokens scored {res.tokens_scored} | windows {res.windows} of {ctx}")
        sys.stdout.flush()
        return 0
    text = file.read_text(encoding="utf-8", errors="replace")
    if flags.get("kv_cache_tokens") is None and policy.kind == "full":
        # `full` keeps the whole stream: size the pool for it (an estimate: ~4 chars per token, capped).
        flags["kv_cache_tokens"] = min(max(len(text) // 2, 4096), 1 << 20) if limit is None else limit + 64
    llm = LLM(_scoring_config(model, flags))
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    bos = llm.tokenizer.bos_token_id
    ids = ([bos] if bos is not None else []) + ids
    if limit is not None:
        ids = ids[:limit]
    res = perplexity_stream(llm.core, ids, policy, segment=segment)
    print(
        f"stream perplexity {res.perplexity:.4f} | policy {res.policy} | tokens scored {res.nll.numel()} "
        f"| evicted {res.evicted} | {res.seconds:.1f}s"
    )
    for a, b, ppl in res.segments():
        print(f"  tokens {a:>7}-{b:<7} perplexity {ppl:.4f}")
    sys.stdout.flush()
    return 0


def _scoring_config(model: str, flags: dict[str, Any]) -> EngineConfig:
    """Scoring runs its windows and streams outside the scheduler, on block tables only: sliding layers
    keep every position (``sliding_kv`` full; the scores are the same bits either way)."""
    return build_engine_config(model, flags).with_(sliding_kv="full")
