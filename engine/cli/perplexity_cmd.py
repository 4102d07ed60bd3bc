"""``llmsys perplexity MODEL FILE``: score a text file in windows."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmsys.engine.cli.options import build_engine_config, engine_command
from llmsys.engine.errors import InvalidParameterError, ModelNotFoundError


@engine_command
def perplexity_command(
    model: Annotated[str, typer.Argument(help="model directory, llama2.c .bin, or catalog name")],
    file: Annotated[Path, typer.Argument(help="UTF-8 text file to score")],
    ctx: Annotated[int, typer.Option("--ctx", help="window length in tokens (each window starts with BOS)")] = 256,
    limit: Annotated[Optional[int], typer.Option("--limit", help="score only the first N tokens of the file")] = None,
    *,
    engine_flags: dict[str, Any],
) -> int:
    from llmsys.engine.llm import LLM
    from llmsys.engine.scoring import perplexity_windows

    if not file.is_file():
        raise ModelNotFoundError(f"no such text file: {file}")
    if ctx < 2:
        raise InvalidParameterError(f"--ctx must be >= 2, got {ctx}")
    llm = LLM(build_engine_config(model, engine_flags))
    if ctx > llm.max_model_len:
        raise InvalidParameterError(f"--ctx {ctx} exceeds the model's context of {llm.max_model_len} tokens")
    ids = llm.tokenizer.encode(file.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
    if limit is not None:
        ids = ids[:limit]
    res = perplexity_windows(llm.core, ids, ctx, llm.tokenizer.bos_token_id)
    print(f"perplexity {res.perplexity:.4f} | tokens scored {res.tokens_scored} | windows {res.windows} of {ctx}")
    sys.stdout.flush()
    return 0
