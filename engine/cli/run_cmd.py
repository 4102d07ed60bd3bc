"""``llmsys run MODEL PROMPT``: stream a completion, then one stats line."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Annotated, Any, Optional

import typer

from llmsys.engine import ollama_store
from llmsys.engine.cli.options import build_engine_config, engine_command, pulling_command, sampling_command
from llmsys.engine.sampling import SamplingParams


@pulling_command
@sampling_command
@engine_command
def run_command(
    model: Annotated[str, typer.Argument(help="model directory, .gguf or llama2.c file, catalog name, org/repo or ollama:NAME")],
    prompt: Annotated[str, typer.Argument(help="the prompt text ('-' reads stdin)")],
    chat: Annotated[bool, typer.Option("--chat", help="apply the model's chat template")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="system message (with --chat)")] = None,
    *,
    sampling: SamplingParams,
    engine_flags: dict[str, Any],
    auto_pull: bool,
) -> int:
    from llmsys.engine.cli.models_cmd import ensure_pulled
    from llmsys.engine.llm import LLM

    named = ensure_pulled(model, auto_pull)
    if named.ollama is not None:  # in Ollama's store (ollama:NAME, or a NAME:TAG it holds): its stop strings and system
        sampling, system = _ollama_settings(model, sampling, system, chat)
    if prompt == "-":
        prompt = sys.stdin.read()
    llm = LLM(build_engine_config(model, engine_flags))
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = llm.tokenizer.encode_chat(messages)
    else:
        ids = llm.encode(prompt)
    t0 = time.perf_counter()
    final = None
    n_out = 0
    interrupted = False
    it = llm.stream(ids, sampling)
    try:
        for ch in it:
            n_out += len(ch.token_ids)
            if ch.text:
                sys.stdout.write(ch.text)
                sys.stdout.flush()
            if ch.finished:
                final = ch
    except KeyboardInterrupt:
        interrupted = True
        it.close()  # aborts the request, frees its KV blocks
    sys.stdout.write("\n")
    sys.stdout.flush()
    wall = time.perf_counter() - t0
    if final is not None and final.timings is not None:
        t = final.timings
        sys.stderr.write(
            f"prompt {t.prompt_tokens} tok | generated {t.generated_tokens} tok | "
            f"ttft {t.ttft_s * 1000:.0f} ms | prefill {t.prompt_tok_s:.1f} tok/s | decode {t.decode_tok_s:.1f} tok/s | "
            f"finish {final.finish_reason}\n"
        )
        u = final.usage
        if u is not None and u.draft_tokens:
            sys.stderr.write(f"speculative: {u.accepted_draft_tokens} of {u.draft_tokens} drafts kept "
                             f"({u.accepted_draft_tokens / u.draft_tokens:.0%})\n")
        if final.finish_reason == "length" and t.prompt_tokens + t.generated_tokens >= llm.max_model_len:
            # Never a silent truncation: say the context, not max_tokens, ended it.
            sys.stderr.write(
                f"context full: {t.prompt_tokens + t.generated_tokens} of {llm.max_model_len} tokens; "
                "raise --max-model-len (up to the model's limit) or use --kv-policy sink:4,window:N to continue past it\n"
            )
        if final.finish_reason == "error":  # the engine could not go on with this request: say why, fail
            sys.stderr.write(f"error: {final.error or 'the engine could not continue this request'}\n")
            return 1
        return 0
    sys.stderr.write(f"interrupted after {n_out} generated tokens ({wall:.1f} s)\n")
    return 130 if interrupted else 0


def _ollama_settings(
    model: str, sampling: SamplingParams, system: str | None, chat: bool
) -> tuple[SamplingParams, str | None]:
    """``ollama:NAME``'s params and system layers folded into the run (engine/ollama_store.run_settings)."""
    from llmsys.engine.loader.gguf_header import read_header

    found = ollama_store.resolve(model)
    settings = ollama_store.run_settings(found, sampling.stop, system)
    if chat:
        ollama_store.require_chat_template(found, read_header(found.blob).fields)
    if settings.note:
        sys.stderr.write(settings.note + "\n")
    return replace(sampling, stop=settings.stop), settings.system
