"""``llmsys chat [MODEL]`` (Textual app) and ``--plain`` (line REPL)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from llmsys.engine.cli.options import (
    ChatTemplateOption,
    build_engine_config,
    engine_command,
    pulling_command,
    sampling_command,
)
from llmsys.engine.cli.options import kv_disk_on

if TYPE_CHECKING:  # imports torch, which this module (imported for --help) must not
    from llmsys.engine.sampling import SamplingParams

DEFAULT_MODEL = "stories260k"


@pulling_command
@sampling_command
@engine_command
def chat_command(
    model: Annotated[str, typer.Argument(help="model folder, .gguf or llama2.c file, catalog name or alias (qwen2.5:0.5b), org/repo or Ollama NAME:TAG")] = DEFAULT_MODEL,
    plain: Annotated[bool, typer.Option("--plain", help="line-by-line REPL instead of the full-screen app")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="system prompt")] = None,
    theme: Annotated[str, typer.Option("--theme", help="Textual theme, e.g. textual-dark, textual-light")] = "textual-dark",
    refresh_hz: Annotated[float, typer.Option("--refresh-hz", help="memory panel updates per second while generating")] = 4.0,
    chat_template: ChatTemplateOption = None,
    *,
    sampling: SamplingParams,
    engine_flags: dict[str, Any],
    auto_pull: bool,
) -> int:
    from llmsys.engine.cli.models_cmd import ensure_pulled
    from llmsys.engine.llm import LLM

    ensure_pulled(model, auto_pull)  # before the full-screen app: the question and the bars need the terminal
    engine_flags = kv_disk_on(engine_flags)  # a later chat reads the conversation's KV back from disk
    config = build_engine_config(model, dict(engine_flags, chat_template=chat_template))

    tty = sys.stdin.isatty() and sys.stdout.isatty()
    if plain or not tty:
        from llmsys.tui.repl import run_repl

        llm = LLM(config)
        return run_repl(llm, sampling, system=system, model_name=model)

    from llmsys.tui.app import ChatApp

    config = config.with_(progress=False)  # a bar would draw under the app
    app = ChatApp(lambda: LLM(config), model_name=model, sampling=sampling, system=system, refresh_hz=refresh_hz, theme=theme)
    app.run()
    return 0
