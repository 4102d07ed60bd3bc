"""The ``llmsys`` console script: a thin Typer app, one module per command.

Known failures (:class:`LLMSysError`) become ``error: <message>`` on stderr
and exit code 2; so do usage errors (a typo'd flag, a bad value, a missing
argument, an unknown command), followed by one ``Try 'llmsys CMD --help'``
hint line. A traceback is shown only with ``LLMSYS_DEBUG=1``.

Ctrl-C is one ``interrupted`` line and exit 130 whenever it comes: this module
imports only the standard library at its top (typer, torch and the engine are
imported inside :func:`main`'s handler), and the console script leaves with
SIGINT mapped to a quiet exit, so one during interpreter shutdown (joining
threads, atexit) prints nothing either.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

if TYPE_CHECKING:
    import typer

PROG = "llmsys"
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as shells report it

# typer >= 0.16 bundles its own copy of click as ``typer._click``; older
# typer uses the standalone ``click`` package. Either (or both) may be
# installed, so the exception classes are collected from each that imports.
_CLICK_EXCEPTION_MODULES = ("typer._click.exceptions", "click.exceptions")


@dataclass(frozen=True)
class ClickErrors:
    """The click exception classes to catch, from every click that is importable.

    Why a tuple per kind: an ``except`` naming one click's class misses the
    other's (``typer._click.exceptions.UsageError`` is not a subclass of
    ``click.UsageError``), which is how a typo'd flag became a traceback.
    """

    no_args_help: tuple[type[BaseException], ...]
    usage: tuple[type[BaseException], ...]
    click: tuple[type[BaseException], ...]
    exit: tuple[type[BaseException], ...]
    abort: tuple[type[BaseException], ...]


def _importable(names: tuple[str, ...]) -> list[Any]:
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            continue
    return modules


def _classes(modules: list[Any], name: str, *extra: type[BaseException]) -> tuple[type[BaseException], ...]:
    found = [getattr(m, name) for m in modules if isinstance(getattr(m, name, None), type)]
    return tuple(dict.fromkeys([*found, *extra]))  # de-duplicated, order kept


def click_errors() -> ClickErrors:
    """The exception classes of the click(s) typer may raise from."""
    import typer

    modules = _importable(_CLICK_EXCEPTION_MODULES)
    return ClickErrors(
        no_args_help=_classes(modules, "NoArgsIsHelpError"),
        usage=_classes(modules, "UsageError"),
        click=_classes(modules, "ClickException"),
        exit=_classes(modules, "Exit", typer.Exit),
        abort=_classes(modules, "Abort", typer.Abort),
    )


def package_version() -> str:
    """The installed distribution's version; the checkout's ``pyproject.toml`` when run uninstalled.

    Not ``llmsys.__version__``: the root package is the public face above every layer and no
    package imports it (tests/test_layering.py).
    """
    import importlib.metadata

    try:
        return importlib.metadata.version("llmsys")
    except importlib.metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def _show_version(value: bool) -> None:
    if value:
        import typer

        print(f"{PROG} {package_version()}")
        raise typer.Exit()


def _root_callback() -> Any:
    """The app's callback (``--version``); built here, where typer is imported, not at module level."""
    import typer

    def _root(
        version: Optional[bool] = typer.Option(None, "--version", "-V", is_eager=True, callback=_show_version,
                                               help="Print the llmsys version and exit."),
    ) -> None:
        """Run, chat with, benchmark and serve LLMs on constrained hardware."""

    return _root


MODEL_COMMANDS = frozenset({"run", "chat", "serve", "bench", "perplexity", "quantize"})  # they import the engine
# They answer through a running llmsys server when one is up, without the engine: they call import_engine()
# themselves once they know they run the model in this process.
SERVER_CLIENTS = frozenset({"run", "chat"})


def _command(argv: list[str] | None) -> str | None:
    """The command's name: the first argument that is not an option (None: none given, or ``--help`` asked,
    which shows the command's options without importing the engine)."""
    args = sys.argv[1:] if argv is None else argv
    return None if "--help" in args else next((a for a in args if not a.startswith("-")), None)


def _interruptible(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A command whose Ctrl-C is the one ``interrupted`` line and 130; typer would turn it into a silent
    ``Exit(130)``. Signature and hints are ``fn``'s (functools.wraps), which typer reads."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            return _interrupted()

    return command


@dataclass(frozen=True)
class CommandEntry:
    """A command's name, where it lives (imported only when registered) and its one-line help."""

    name: str
    module: str
    function: str
    help: str


COMMAND_TABLE = (
    CommandEntry("run", "run_cmd", "run_command",
                 "Answer PROMPT (through the chat template when the model has one); no PROMPT: chat at the terminal."),
    CommandEntry("chat", "chat_cmd", "chat_command", "Chat with MODEL in a terminal app (--plain: line REPL)."),
    CommandEntry("serve", "serve_cmd", "serve_command", "Serve MODEL over an OpenAI-compatible HTTP API."),
    CommandEntry("bench", "bench_cmd", "bench_command",
                 "Benchmark prefill/decode (llama-bench tests), sweeping engine settings."),
    CommandEntry("plan", "plan_cmd", "plan_command",
                 "Show where each layer would live (GPU/CPU/disk) under the memory budgets."),
    CommandEntry("perplexity", "perplexity_cmd", "perplexity_command",
                 "Score a text file with a model directory or GGUF file (llama-perplexity's job)."),
    CommandEntry("quantize", "quantize_cmd", "quantize_command",
                 "Write a quantized checkpoint (int8/int4/nf4/fp8; --method rtn|gptq|awq)."),
    CommandEntry("models", "models_cmd", "models_command", "List the model catalog and what is downloaded."),
    CommandEntry("pull", "models_cmd", "pull_command", "Download a catalog model into $LLMSYS_HOME."),
    CommandEntry("monitor", "monitor_cmd", "monitor_command", "Live memory/throughput panel of a running llmsys serve."),
)


def _register(app: Any, only: str | None = None) -> None:
    """Register the commands, each module imported here (not at module level) so each pulls in only what it
    needs. ``only``: the command this process runs, the one module imported (a warm ``run`` through a
    server starts in less time); None or an unknown name (``--help``, a typo to suggest from): all."""
    entries = [e for e in COMMAND_TABLE if e.name == only] or list(COMMAND_TABLE)
    for e in entries:
        fn = getattr(importlib.import_module(f"llmsys.engine.cli.{e.module}"), e.function)
        app.command(e.name, help=e.help)(_interruptible(fn))


def build_app(only: str | None = None) -> typer.Typer:
    """A fresh app with every command registered, or only ``only`` when it names one (fresh per call, so
    repeated ``main()`` calls in one process never register a command twice)."""
    import typer

    app = typer.Typer(
        name=PROG,
        help="Run, chat with, benchmark and serve LLMs on constrained hardware.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root_callback())
    _register(app, only)
    return app


def usage_error_lines(e: Any) -> tuple[str, str]:
    """click's usage error as two lines: ``error: <message>`` and the --help hint.

    click's own ``show()`` prints the whole usage block first; one line that
    names the problem (with click's suggestion, if any) is easier to read.
    """
    message = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    command = ctx.command_path if ctx is not None else PROG
    help_option = ctx.help_option_names[0] if ctx is not None and ctx.help_option_names else "--help"
    return f"error: {message}", f"Try '{command} {help_option}' for help."


def main(argv: list[str] | None = None) -> int:
    """Run one command; ``argv`` None: the console script's own arguments (and its process to leave)."""
    try:
        return _run(argv)
    except KeyboardInterrupt:  # before click runs (importing typer, the engine) or in a handler below
        return _interrupted()
    finally:
        if argv is None:
            _quiet_sigint()


def _interrupted_line() -> str:
    """The one line a Ctrl-C gets. On a terminal it starts a line of its own (after the echoed ``^C``)."""
    return "\ninterrupted\n" if sys.stderr.isatty() else "interrupted\n"


def _interrupted() -> int:
    sys.stderr.write(_interrupted_line())
    sys.stderr.flush()
    return INTERRUPTED_EXIT


def _exit_interrupted(signum: int, frame: Any) -> None:
    os.write(2, _interrupted_line().encode())
    os._exit(INTERRUPTED_EXIT)


@contextlib.contextmanager
def _exit_on_interrupt() -> Iterator[None]:
    """Ctrl-C ends the process at once (one line, 130) while the commands' modules and the engine's import:
    torch's C start-up swallows a KeyboardInterrupt raised inside its import of numpy and goes on with numpy
    half made, to a hang or an AttributeError later. Nothing is open yet that an exit would lose."""
    try:
        previous = signal.signal(signal.SIGINT, _exit_interrupted)
    except ValueError:  # not the main thread: the caller's process, its handler
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def import_engine() -> None:
    """The engine's imports, a Ctrl-C during them ending the process at once (:func:`_exit_on_interrupt`): for
    the commands that import the engine only once they know they run the model in this process."""
    with _exit_on_interrupt():
        importlib.import_module("llmsys.engine.llm")


def _quiet_sigint() -> None:
    """From here on a Ctrl-C ends the process at once, quietly: what is left is the interpreter's shutdown
    (joining the engine's threads, atexit), where a KeyboardInterrupt would print "Exception ignored" and a
    traceback. Only for the console script: a caller's process keeps its own handler."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        signal.signal(signal.SIGINT, _exit_interrupted)
    except ValueError:  # not the main thread: nothing to replace
        pass


def _run(argv: list[str] | None) -> int:
    debug = os.environ.get("LLMSYS_DEBUG") == "1"
    with _exit_on_interrupt():
        from llmsys.kernels.common.errors import LLMSysError  # no torch: commands import it when they run

        errors = click_errors()
        app = build_app(_command(argv))
        if _command(argv) in MODEL_COMMANDS - SERVER_CLIENTS:  # the engine's imports too (numpy's, torch's submodules)
            importlib.import_module("llmsys.engine.llm")
    try:
        rv = app(args=argv, prog_name=PROG, standalone_mode=False)
        return int(rv or 0)
    except LLMSysError as e:
        if debug:
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return e.exit_code
    except errors.no_args_help as e:
        # `llmsys` alone asks for the command list: help on stdout, success.
        print(e.format_message().rstrip())
        return 0
    except errors.usage as e:
        if debug:
            raise
        for line in usage_error_lines(e):
            print(line, file=sys.stderr)
        return 2
    except errors.click as e:
        e.show()
        return e.exit_code
    except errors.exit as e:
        if isinstance(e.__context__, KeyboardInterrupt):  # typer turns a Ctrl-C inside a command into Exit(130)
            return _interrupted()
        return e.exit_code
    except errors.abort as e:
        # click turns a Ctrl-C inside a command into Abort (after a newline on stderr); a prompt answered
        # with Ctrl-D is an Abort too, and says so
        if isinstance(e.__context__, KeyboardInterrupt):
            print("interrupted", file=sys.stderr)
            return INTERRUPTED_EXIT
        print("aborted", file=sys.stderr)
        return INTERRUPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
