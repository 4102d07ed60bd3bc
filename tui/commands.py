"""Slash commands, parsed the same way by the Textual app and the plain REPL."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from llmsys.kernels.common.errors import InvalidParameterError

HELP = """\
Commands:
  /system TEXT     set the system prompt (empty: remove it)
  /reset           forget the conversation (keeps system prompt and settings)
  /set k=v ...     sampling, e.g. /set temperature=0.7 top_p=0.9 max_tokens=256 seed=1
  /save FILE       write the conversation as JSON
  /load FILE       read a conversation written by /save
  /help            this text
Keys: Enter sends, Ctrl+J (or a line ending in \\) adds a new line, Up/Down walk the
input history, Esc stops the reply being generated, Ctrl+Q quits."""

COMMANDS = ("system", "reset", "set", "save", "load", "help")


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
    if name not in COMMANDS:
        raise InvalidParameterError(f"unknown command /{head}; type /help for the list")
    try:
        args = tuple(shlex.split(rest))
    except ValueError:
        args = tuple(rest.split())
    if name in ("save", "load") and len(args) != 1:
        raise InvalidParameterError(f"usage: /{name} FILE")
    return SlashCommand(name, rest.strip(), args)
