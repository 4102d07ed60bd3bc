"""``llmsys run MODEL [PROMPT]``: stream one reply, then one stats line; no PROMPT opens the line REPL
at a terminal (piped in, stdin is the prompt).

As ``ollama run`` and llama.cpp's CLI do, a model with a chat template gets PROMPT as a user turn
rendered by that template (an instruct model given the bare text often answers with EOS at once);
``--raw`` sends the text as it is. The stats line says which was used.

When an ``llmsys serve`` answers (``--host``, ``$LLMSYS_HOST``, else its default address) the reply comes from
it (engine/remote.py), with the same stats line from the server's ``timings``: no torch, no load. ``--local``,
engine flags or ``--chat-template`` (the server was started with its own) run in this process instead, and so
does a model the server does not serve (404), each with one stderr line saying why.
"""

from __future__ import annotations

import enum
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from llmsys.engine import ollama_store
from llmsys.engine import remote
from llmsys.engine.cli.main import import_engine
from llmsys.engine.cli.options import (
    ChatTemplateOption,
    HostOption,
    LocalOption,
    build_engine_config,
    build_sampling,
    changed_engine_flags,
    engine_command,
    one_conversation,
    pulling_command,
    sampling_values_command,
)
from llmsys.kernels.common.errors import InvalidParameterError, LLMSysError, TokenizerError

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
@sampling_values_command
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
    host: HostOption = None,
    local: LocalOption = False,
    *,
    sampling_values: dict[str, Any],
    engine_flags: dict[str, Any],
    auto_pull: bool,
) -> int:
    mode = prompt_mode(chat, raw)
    if system is not None and mode is PromptMode.RAW:
        raise InvalidParameterError("--system goes through the chat template, which --raw turns off; "
                                    "write the system text into the prompt instead")
    addr = None if local else pick_server(host, changed_engine_flags(engine_flags)
                                          + (["--chat-template"] if chat_template else []))
    if addr is not None:
        if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
            prompt = _stdin_prompt()
        rv = _run_remote(addr, model, prompt, mode, system, sampling_values)
        if rv is not None:
            return rv
    import_engine()
    return _run_local(model, prompt, mode, system, chat_template, build_sampling(sampling_values), engine_flags,
                      auto_pull)


def pick_server(host: str | None, local_flags: list[str]) -> remote.ServerAddress | None:
    """The server to use, or None: none answers (one line when the address was asked for: ``--host`` or
    ``$LLMSYS_HOST``), or ``local_flags`` (engine flags as typed) ask for an engine of this process."""
    addr = remote.server_address(host)
    if not remote.answers(addr):
        if host is not None or os.environ.get(remote.HOST_ENV):
            remote.say(f"no llmsys server answers at {addr.url}: running in this process")
        return None
    if local_flags:
        remote.say(f"{', '.join(local_flags)} configure an engine of this process: running locally (the llmsys "
                   f"server at {addr.url} keeps the settings it was started with)")
        return None
    return addr


def _stdin_prompt() -> str:
    prompt = sys.stdin.read()
    if not prompt.strip():
        raise InvalidParameterError("no PROMPT and nothing on stdin; give the prompt as an argument, pipe it in, "
                                    "or run at a terminal for a conversation")
    return prompt


def _run_local(model: str, prompt: str | None, mode: PromptMode, system: str | None, chat_template: str | None,
               sampling: SamplingParams, engine_flags: dict[str, Any], auto_pull: bool) -> int:
    from llmsys.engine.cli.models_cmd import ensure_pulled
    from llmsys.engine.llm import LLM

    named = ensure_pulled(model, auto_pull)
    config = build_engine_config(model, dict(one_conversation(engine_flags), chat_template=chat_template))
    user_system = system
    if named.ollama is not None:  # in Ollama's store (ollama:NAME, or a NAME:TAG it holds): its stop strings and system
        sampling, system = _ollama_settings(model, sampling, system, mode is PromptMode.CHAT)
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):  # piped in: one prompt, as `ollama run` takes it
        prompt = _stdin_prompt()
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


_NO_TEMPLATE_LABEL = "raw (the model has no chat template; --chat-template FILE|NAME gives one)"


def _run_remote(addr: remote.ServerAddress, model: str, prompt: str | None, mode: PromptMode, system: str | None,
                values: dict[str, Any]) -> int | None:
    """``run`` through the server; None when it does not serve ``model`` (404: the caller runs it here)."""
    name = remote.model_name(model)
    values = dict(values)
    from llmsys.engine import names

    unknown: LLMSysError | None = None
    try:
        named = names.resolve(model)
    except LLMSysError as e:
        named, unknown = None, e  # the server may know it (its catalog, its store); its 404 says so otherwise
    if named is not None and named.ollama is not None:  # Ollama's stop strings and system, as locally
        values["stop"], system = _ollama_stop_system(model, tuple(values.get("stop") or ()), system,
                                                     mode is PromptMode.CHAT)
    if prompt is None:
        return _remote_repl(addr, name, mode, system, values)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    try:
        if mode is PromptMode.RAW:
            stream = remote.RemoteStream(addr, "/v1/completions", remote.request_body(name, values, prompt=prompt))
            label = "raw"
        else:
            try:
                stream = remote.RemoteStream(addr, "/v1/chat/completions",
                                             remote.request_body(name, values, messages=messages))
                label = None  # the server's final chunk names its template
            except remote.RemoteError as e:
                if e.code != "no_chat_template":
                    raise
                if mode is PromptMode.CHAT or system is not None:
                    raise TokenizerError(f"{model} has no chat template; give one with --chat-template FILE|NAME "
                                         "(which runs locally) or drop --chat/--system for a plain completion") from None
                stream = remote.RemoteStream(addr, "/v1/completions", remote.request_body(name, values, prompt=prompt))
                label = _NO_TEMPLATE_LABEL
    except remote.RemoteError as e:
        if e.status == 404 and unknown is not None:
            raise unknown from None  # unknown here and there: the local error, one line
        if e.status == 404:
            remote.say(f"the llmsys server at {addr.url} does not serve {model} ({e}): running in this process")
            return None
        raise
    remote.say(f"using the llmsys server at {addr.url} (--local runs in-process)")
    return _stream_remote(stream, label)


def _stream_remote(stream: remote.RemoteStream, label: str | None) -> int:
    """As :func:`_stream`, from the server: the text, then the same stats line from its ``timings``."""
    t0 = time.perf_counter()
    final = None
    n_out = 0
    interrupted = False
    try:
        for ch in stream:
            if ch.text:
                n_out += 1  # a frame per sampled token (a partial UTF-8 character's text comes with the next)
                sys.stdout.write(ch.text)
                sys.stdout.flush()
            if ch.finish_reason is not None:
                final = ch
    except KeyboardInterrupt:
        interrupted = True
        stream.close()  # the server sees the client leave and frees the request's slot and KV blocks
    sys.stdout.write("\n")
    sys.stdout.flush()
    wall = time.perf_counter() - t0
    if final is not None and final.timings is not None:
        t = final.timings
        label = label or (f"chat template: {final.chat_template}" if final.chat_template else "chat template")
        sys.stderr.write(
            f"prompt {t.prompt_tokens} tok | generated {t.generated_tokens} tok | "
            f"ttft {t.ttft_s * 1000:.0f} ms | prefill {t.prompt_tok_s:.1f} tok/s | decode {t.decode_tok_s:.1f} tok/s | "
            f"finish {final.finish_reason} | {label}\n"
        )
        d = final.finish_details
        if d and d.get("type") == "context_full":
            sys.stderr.write(f"context full: {d.get('n_tokens')} of {d.get('n_ctx')} tokens; start the server with a "
                             "larger --max-model-len (up to the model's limit), or --kv-policy sink:4,window:N\n")
        if final.finish_reason == "error" or final.error:
            sys.stderr.write(f"error: {final.error or 'the engine could not continue this request'}\n")
            return 1
        return 0
    sys.stderr.write(f"interrupted after {n_out} generated tokens ({wall:.1f} s)\n")
    return 130 if interrupted else 0


def _remote_repl(addr: remote.ServerAddress, name: str, mode: PromptMode, system: str | None,
                 values: dict[str, Any]) -> int | None:
    import_engine()  # the REPL's SamplingParams (/set edits it) import torch: not the model, not its load
    from llmsys.tui.repl import ServerModel, run_server_repl

    server = ServerModel.connect(addr, name, raw=mode is PromptMode.RAW)
    if server is None:
        return None
    remote.say(f"using the llmsys server at {addr.url} (--local runs in-process)")
    return run_server_repl(server, build_sampling(values), system=system if server.chat else None)


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
    stop, system = _ollama_stop_system(model, sampling.stop, system, chat)
    return replace(sampling, stop=stop), system


def _ollama_stop_system(model: str, stop: tuple[str, ...], system: str | None, chat: bool
                        ) -> tuple[tuple[str, ...], str | None]:
    from llmsys.engine.loader.gguf_header import read_header

    found = ollama_store.resolve(model)
    settings = ollama_store.run_settings(found, stop, system)
    if chat:
        ollama_store.require_chat_template(found, read_header(found.blob).fields)
    if settings.note:
        sys.stderr.write(settings.note + "\n")
    return tuple(settings.stop), settings.system
