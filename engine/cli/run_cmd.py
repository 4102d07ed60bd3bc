"""``llmsys run MODEL [PROMPT]``: stream one reply, then one stats line; no PROMPT opens the line REPL
at a terminal (piped in, stdin is the prompt).

As ``ollama run`` and llama.cpp's CLI do, a model with a chat template gets PROMPT as a user turn
rendered by that template (an instruct model given the bare text often answers with EOS at once);
``--raw`` sends the text as it is. The stats line says which was used.
"""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from llmsys.engine import ollama_store
from llmsys.engine.cli.options import (
    ChatTemplateOption,
    build_engine_config,
    engine_command,
    pulling_command,
    sampling_command,
)
from llmsys.kernels.common.errors import InvalidParameterError, TokenizerError

if TYPE_CHECKING:  # imports torch, which this module (imported for --help) must not
    from llmsys.engine.sampling import SamplingParams


class PromptMode(enum.Enum):
    """How PROMPT reaches the model: ``AUTO`` the chat template where the model has one, else raw;
    ``CHAT`` the template or an error (``--chat``); ``RAW`` the text as it is (``--raw``)."""

    AUTO = "auto"
    CHAT = "chat"
    RAW = "raw"


def prompt_mode(chat: bool, raw: bool) -> PromptMode:
    if chat and raw:
        raise InvalidParameterError("--chat and --raw exclude each other: --raw sends the prompt as it is, "
                                    "--chat renders it with the chat template (the default when the model has one)")
    return PromptMode.RAW if raw else PromptMode.CHAT if chat else PromptMode.AUTO


@dataclass(frozen=True)
class PromptChoice:
    """What one run sends: through the chat template or not, and the stats line's words for it."""

    chat: bool
    label: str  # "chat template: chatml", "raw", "raw (the model has no chat template)"


def choose_prompt(tokenizer: Any, mode: PromptMode, model: str) -> PromptChoice:
    """The mode against what the model has; ``--chat`` on a model without a template is a one-line error."""
    template = tokenizer.default_chat_template if mode is not PromptMode.RAW else None
    if template is not None:
        return PromptChoice(True, f"chat template: {template.label}")
    if mode is PromptMode.RAW:
        return PromptChoice(False, "raw")
    if mode is PromptMode.CHAT:
        from llmsys.engine.chat_template import family_names

        raise TokenizerError(f"{model} has no chat template; give one with --chat-template FILE|NAME "
                             f"(known: {family_names()}) or drop --chat for a plain completion")
    return PromptChoice(False, "raw (the model has no chat template; --chat-template FILE|NAME gives one)")


@pulling_command
@sampling_command
@engine_command
def run_command(
    model: Annotated[str, typer.Argument(help="model folder, .gguf or llama2.c file, catalog name or alias (qwen2.5:0.5b), org/repo or Ollama NAME:TAG")],
    prompt: Annotated[Optional[str], typer.Argument(
        help="the prompt text ('-' or piped in: stdin); none at a terminal: a conversation (as llmsys chat --plain)")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="send PROMPT as it is, without the chat template")] = False,
    chat: Annotated[bool, typer.Option(
        "--chat", help="the chat template, or an error if the model has none (the default uses it when there is one)")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="system message (chat template only)")] = None,
    chat_template: ChatTemplateOption = None,
    *,
    sampling: SamplingParams,
    engine_flags: dict[str, Any],
    auto_pull: bool,
) -> int:
    from llmsys.engine.cli.models_cmd import ensure_pulled
    from llmsys.engine.llm import LLM

    mode = prompt_mode(chat, raw)
    if system is not None and mode is PromptMode.RAW:
        raise InvalidParameterError("--system goes through the chat template, which --raw turns off; "
                                    "write the system text into the prompt instead")
    named = ensure_pulled(model, auto_pull)
    config = build_engine_config(model, dict(engine_flags, chat_template=chat_template))
    user_system = system
    if named.ollama is not None:  # in Ollama's store (ollama:NAME, or a NAME:TAG it holds): its stop strings and system
        sampling, system = _ollama_settings(model, sampling, system, mode is PromptMode.CHAT)
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):  # piped in: one prompt, as `ollama run` takes it
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise InvalidParameterError("no PROMPT and nothing on stdin; give the prompt as an argument, pipe it in, "
                                        "or run at a terminal for a conversation")
    llm = LLM(config)
    choice = choose_prompt(llm.tokenizer, mode, model)
    if prompt is None:
        from llmsys.tui.repl import run_repl

        return run_repl(llm, sampling, system=system if choice.chat else None, model_name=model, chat=choice.chat)
    if choice.chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = llm.tokenizer.encode_chat(messages)
    else:
        if user_system is not None:
            raise TokenizerError(f"--system needs a chat template and {model} has none; give one with "
                                 "--chat-template FILE|NAME or write the system text into the prompt")
        ids = llm.encode(prompt)
    return _stream(llm, ids, sampling, choice)


def _stream(llm: Any, ids: list[int], sampling: SamplingParams, choice: PromptChoice) -> int:
    """Print the reply as it comes, then the stats line (stderr); Ctrl-C stops it and keeps the text."""
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
            f"finish {final.finish_reason} | {choice.label}\n"
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
