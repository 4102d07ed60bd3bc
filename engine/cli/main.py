"""The ``llmsys`` console script: a thin Typer app, one module per command.

Known failures (:class:`LLMSysError`) become ``error: <message>`` on stderr
and exit code 2; a traceback is shown only with ``LLMSYS_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys

import click
import typer

from llmsys.kernels.common.errors import LLMSysError

app = typer.Typer(
    name="llmsys",
    help="Run, chat with, benchmark and serve LLMs on constrained hardware.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Imported here, not at module level: each command module pulls in only
    # what it needs, and `llmsys --help` stays fast.
    from llmsys.engine.cli.bench_cmd import bench_command
    from llmsys.engine.cli.chat_cmd import chat_command
    from llmsys.engine.cli.models_cmd import models_command, pull_command
    from llmsys.engine.cli.monitor_cmd import monitor_command
    from llmsys.engine.cli.perplexity_cmd import perplexity_command
    from llmsys.engine.cli.plan_cmd import plan_command
    from llmsys.engine.cli.quantize_cmd import quantize_command
    from llmsys.engine.cli.run_cmd import run_command
    from llmsys.engine.cli.serve_cmd import serve_command

    app.command("run", help="Stream a completion of PROMPT to stdout.")(run_command)
    app.command("chat", help="Chat with MODEL in a terminal app (--plain: line REPL).")(chat_command)
    app.command("serve", help="Serve MODEL over an OpenAI-compatible HTTP API.")(serve_command)
    app.command("bench", help="Benchmark prefill/decode (llama-bench tests), sweeping engine settings.")(bench_command)
    app.command("plan", help="Show where each layer would live (GPU/CPU/disk) under the memory budgets.")(plan_command)
    app.command("perplexity", help="Score a text file (llama-perplexity's job).")(perplexity_command)
    app.command("quantize", help="Write a quantized checkpoint (int8/int4/nf4/fp8; --method rtn|gptq|awq).")(quantize_command)
    app.command("models", help="List the model catalog and what is downloaded.")(models_command)
    app.command("pull", help="Download a catalog model into $LLMSYS_HOME.")(pull_command)
    app.command("monitor", help="Live memory/throughput panel of a running llmsys serve.")(monitor_command)


def main(argv: list[str] | None = None) -> int:
    _register()
    debug = os.environ.get("LLMSYS_DEBUG") == "1"
    try:
        rv = app(args=argv, standalone_mode=False)
        return int(rv or 0)
    except LLMSysError as e:
        if debug:
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
