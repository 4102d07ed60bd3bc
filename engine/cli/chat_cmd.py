"""``llmsys chat [MODEL]`` (Textual app) and ``--plain`` (line REPL).

The line REPL uses a running ``llmsys serve`` when one answers (as ``llmsys run`` does; ``--local`` or engine
flags run in this process); the full-screen app loads the model in this process, its memory panel reading the
engine it owns.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer

from llmsys.engine.cli.options import (
    ChatTemplateOption,
    HostOption,
    LocalOption,
    build_engine_config,
    build_sampling,
    changed_engine_flags,
    engine_command,
    pulling_command,
    sampling_values_command,
)
from llmsys.engine.cli.main import import_engine
from llmsys.engine.cli.options import kv_disk_on, one_conversation

DEFAULT_MODEL = "stories260k"


@pulling_command
@sampling_values_command
@engine_command
def chat_command(
    model: Annotated[str, typer.Argument(help="model folder, .gguf or llama2.c file, catalog name or alias (qwen2.5:0.5b), org/repo or Ollama NAME:TAG")] = DEFAULT_MODEL,
    plain: Annotated[bool, typer.Option("--plain", help="line-by-line REPL instead of the full-screen app")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="system prompt")] = None,
    theme: Annotated[str, typer.Option("--theme", help="Textual theme, e.g. textual-dark, textual-light")] = "textual-dark",
    refresh_hz: Annotated[float, typer.Option("--refresh-hz", help="memory panel updates per second while generating")] = 4.0,
    chat_template: ChatTemplateOption = None,
    host: HostOption = None,
    local: LocalOption = False,
    *,
    sampling_values: dict[str, Any],
    engine_flags: dict[str, Any],
    auto_pull: bool,
) -> int:
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    if (plain or not tty) and not local:
        from llmsys.engine import remote
        from llmsys.engine.cli.run_cmd import pick_server

        addr = pick_server(host, changed_engine_flags(engine_flags) + (["--chat-template"] if chat_template else []))
        if addr is not None:
            import_engine()  # the REPL's SamplingParams (/set edits it) import torch: not the model, not its load
            from llmsys.tui.repl import ServerModel, run_server_repl

            server = ServerModel.connect(addr, remote.model_name(model))
            if server is not None:
                remote.say(f"using the llmsys server at {addr.url} (--local runs in-process)")
                return run_server_repl(server, build_sampling(sampling_values), system=system)
    from llmsys.engine.cli.models_cmd import ensure_pulled

    import_engine()
    from llmsys.engine.llm import LLM

    sampling = build_sampling(sampling_values)
    ensure_pulled(model, auto_pull)  # before the full-screen app: the question and the bars need the terminal
    engine_flags = one_conversation(kv_disk_on(engine_flags))  # a later chat reads the conversation's KV back from disk
    config = build_engine_config(model, dict(engine_flags, chat_template=chat_template))

    if plain or not tty:
        from llmsys.tui.repl import run_repl

        llm = LLM(config)
        return run_repl(llm, sampling, system=system, model_name=model)

    from llmsys.tui.app import ChatApp

    config = config.with_(progress=False)  # a bar would draw under the app
    app = ChatApp(lambda: LLM(config), model_name=model, sampling=sampling, system=system, refresh_hz=refresh_hz, theme=theme)
    app.run()
    return 0
