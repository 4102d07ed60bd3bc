"""Slash commands, parsed the same way by the Textual app and the plain REPL.

The command list is shared; the keys are not: the app and the REPL read input
differently (Esc/Ctrl+Q in the app, Ctrl+C/Ctrl+D on a line terminal), so each
front end passes its own :data:`TUI_KEYS` or :data:`PLAIN_KEYS` to the help
builders, and ``/help`` never lists a key the front end does not have.
"""

from __future__ import annotations

import base64
import shlex
from dataclasses import dataclass

from llmsys.kernels.common.errors import InvalidParameterError


@dataclass(frozen=True)
class CommandHelp:
    usage: str  # "/save FILE"
    what: str  # one short phrase


@dataclass(frozen=True)
class KeyHelp:
    keys: str  # "Ctrl+J"
    what: str


COMMAND_HELP = (
    CommandHelp("/retry", "regenerate the last reply"),
    CommandHelp("/copy", "copy the last reply to the clipboard"),
    CommandHelp("/info", "model, weights, placement, context used"),
    CommandHelp("/system TEXT", "set the system prompt (empty: remove it)"),
    CommandHelp("/reset", "forget the conversation (keeps system prompt, settings)"),
    CommandHelp("/set k=v ...", "sampling, e.g. /set temperature=0.7 top_p=0.9 max_tokens=256 seed=1"),
    CommandHelp("/save FILE", "write the conversation as JSON"),
    CommandHelp("/load FILE", "read a conversation written by /save"),
    CommandHelp("/help", "this text"),
    CommandHelp("/bye", "quit (also /exit, /quit)"),
)

TUI_KEYS = (
    KeyHelp("Enter", "send"),
    KeyHelp("Ctrl+J", "new line (or end a line with \\)"),
    KeyHelp("Up/Down", "walk the input history"),
    KeyHelp("Esc", "stop the reply being generated"),
    KeyHelp("Ctrl+B", "hide/show the memory panel"),
    KeyHelp("Ctrl+Q", "quit"),
)

PLAIN_KEYS = (
    KeyHelp("Enter", "send (end a line with \\ to continue on the next)"),
    KeyHelp("Ctrl+C", "stop the reply being generated"),
    KeyHelp("Ctrl+D", "quit"),
)

COMMANDS = ("retry", "copy", "info", "system", "reset", "set", "save", "load", "help", "quit")
NO_ARGS = ("retry", "copy", "info", "reset", "help", "quit")
# Other spellings of a command: ``/bye`` is Ollama's, ``/exit`` most REPLs'.
ALIASES = {"bye": "quit", "exit": "quit"}


def help_text(keys: tuple[KeyHelp, ...]) -> str:
    """Plain text for a line terminal: aligned columns, one entry a line."""
    width = max(len(c.usage) for c in COMMAND_HELP)
    lines = ["Commands:"] + [f"  {c.usage:<{width}}  {c.what}" for c in COMMAND_HELP]
    kw = max(len(k.keys) for k in keys)
    lines += ["Keys:"] + [f"  {k.keys:<{kw}}  {k.what}" for k in keys]
    return "\n".join(lines)


def help_markdown(keys: tuple[KeyHelp, ...]) -> str:
    """Markdown lists for the app: they wrap to the transcript's width, where a
    fixed-width block would be cut off in a narrow terminal."""
    def esc(s: str) -> str:
        return s.replace("\\", "\\\\")

    lines = ["**Commands**", ""] + [f"- `{c.usage}` {c.what}" for c in COMMAND_HELP]
    lines += ["", "**Keys**", ""] + [f"- **{k.keys}** {esc(k.what)}" for k in keys]
    return "\n".join(lines)


def osc52(text: str) -> str:
    """The OSC 52 escape that asks the terminal to put ``text`` on the clipboard
    (the same bytes Textual's ``App.copy_to_clipboard`` writes)."""
    return "\x1b]52;c;" + base64.b64encode(text.encode("utf-8")).decode("ascii") + "\a"


@dataclass(frozen=True)
class SlashCommand:
    name: str  # one of COMMANDS
    arg: str  # the raw text after the name
    args: tuple[str, ...]  # shell-split arguments


def parse_command(line: str) -> SlashCommand | None:
    """``None`` for ordinary text; raises InvalidParameterError for a bad command."""
    text = line.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    head, _, rest = text[1:].partition(" ")
    name = head.lower()
    name = ALIASES.get(name, name)
    if name not in COMMANDS:
        raise InvalidParameterError(f"unknown command /{head}; type /help for the list")
    try:
        args = tuple(shlex.split(rest))
    except ValueError:
        args = tuple(rest.split())
    if name in ("save", "load") and len(args) != 1:
        raise InvalidParameterError(f"usage: /{name} FILE")
    if name in NO_ARGS and args:
        raise InvalidParameterError(f"/{name} takes no arguments; type /{name} alone")
    return SlashCommand(name, rest.strip(), args)
