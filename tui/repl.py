"""``llmsys chat --plain``: a line-by-line REPL for pipes and dumb terminals.

Same conversation model and slash commands as the app, but synchronous: the
REPL owns the engine on its own thread and streams with ``llm.stream``.
Ctrl+C stops a reply (keeping the text so far); Ctrl+D or EOF quits.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from llmsys.kernels.common.errors import LLMSysError
from llmsys.engine.sampling import SamplingParams
from llmsys.tui.commands import HELP, parse_command
from llmsys.tui.conversation import Conversation, apply_settings, sampling_from_dict
from llmsys.tui.worker import error_line


def _read_entry(stdin: IO[str], out: IO[str], prompt: str) -> str | None:
    """One entry; lines ending in a backslash continue on the next line."""
    lines: list[str] = []
    while True:
        out.write(prompt if not lines else "... ")
        out.flush()
        line = stdin.readline()
        if not line:
            return "\n".join(lines) if lines else None
        line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def run_repl(llm: Any, sampling: SamplingParams, system: str | None = None, stdin: IO[str] | None = None, stdout: IO[str] | None = None, model_name: str = "model") -> int:
    stdin = stdin or sys.stdin
    out = stdout or sys.stdout
    conv = Conversation(system=system)
    is_chat = llm.tokenizer.chat_template is not None
    out.write(f"llmsys chat ({'chat' if is_chat else 'completion'} mode, context {llm.max_model_len} tokens). /help for commands, Ctrl+D to quit.\n")
    while True:
        text = _read_entry(stdin, out, "> ")
        if text is None:
            out.write("\n")
            return 0
        if not text.strip():
            continue
        added_user = False
        try:
            cmd = parse_command(text)
            if cmd is not None:
                if cmd.name == "help":
                    out.write(HELP + "\n")
                elif cmd.name == "system":
                    conv.system = cmd.arg or None
                    out.write("[system prompt set]\n" if cmd.arg else "[system prompt removed]\n")
                elif cmd.name == "reset":
                    conv.reset()
                    out.write("[conversation cleared]\n")
                elif cmd.name == "set":
                    sampling = apply_settings(sampling, list(cmd.args))
                    out.write(f"[temperature={sampling.temperature} top_p={sampling.top_p} max_tokens={sampling.max_tokens} seed={sampling.seed}]\n")
                elif cmd.name == "save":
                    p = conv.save(cmd.args[0], sampling, model_name)
                    out.write(f"[saved {len(conv.messages)} messages to {p}]\n")
                elif cmd.name == "load":
                    conv, saved = Conversation.load(cmd.args[0])
                    if saved:
                        sampling = sampling_from_dict(sampling, saved)
                    out.write(f"[loaded {len(conv.messages)} messages]\n")
                continue
            conv.add("user", text)
            added_user = True
            ids = llm.tokenizer.encode_chat(conv.chat_messages()) if is_chat else llm.encode(conv.completion_text())
            reply: list[str] = []
            it = llm.stream(ids, sampling)
            try:
                for ch in it:
                    if ch.text:
                        reply.append(ch.text)
                        out.write(ch.text)
                        out.flush()
            except KeyboardInterrupt:
                it.close()
                out.write(" [stopped]")
            out.write("\n")
            conv.add("assistant", "".join(reply))
        except LLMSysError as e:
            if added_user and conv.messages and conv.messages[-1]["role"] == "user":
                conv.messages.pop()  # the turn did not happen
            out.write(f"error: {error_line(e)}\n")
