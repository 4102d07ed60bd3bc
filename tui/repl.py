"""``llmsys chat --plain`` and ``llmsys run MODEL``: a line-by-line REPL for pipes and plain terminals.

Same conversation model and slash commands as the app, but synchronous: the
REPL owns the engine on its own thread and streams with ``llm.stream``.
Ctrl+C stops a reply (keeping the text so far); /bye, /exit, Ctrl+D or EOF quits.
With a running ``llmsys serve`` (:func:`run_server_repl`) the replies stream from the server instead,
whose model stays loaded between sessions; /info then shows the server's loaded models.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import IO, Any

from llmsys.engine import remote

from llmsys.kernels.common.errors import LLMSysError
from llmsys.engine.sampling import SamplingParams
from llmsys.tui.commands import PLAIN_KEYS, SlashCommand, help_text, osc52, parse_command
from llmsys.tui.conversation import Conversation, apply_settings, sampling_from_dict
from llmsys.tui.conversation import keep_kv
from llmsys.tui.info import info_rows, info_text
from llmsys.tui.snapshot import PerfStats, default_budgets, snapshot_from_engine
from llmsys.tui.worker import error_line, model_info


@dataclass(frozen=True)
class ServerModel:
    """A model as a running llmsys server serves it: where, the name to send, and whether turns go through
    its chat template (``/v1/chat/completions``) or as one completion text (``/v1/completions``)."""

    addr: remote.ServerAddress
    name: str
    chat: bool
    template: str | None = None  # the server's chat template label, once a reply named it

    @classmethod
    def connect(cls, addr: remote.ServerAddress, name: str, raw: bool = False) -> ServerModel | None:
        """Ask the server about ``name`` (``/api/show``); None when it does not serve it (404), with one line."""
        try:
            show = remote.get_json(addr, "POST", "/api/show", {"model": name})
        except remote.RemoteError as e:
            if e.status == 404:
                remote.say(f"the llmsys server at {addr.url} does not serve {name} ({e}): running in this process")
                return None
            raise
        return cls(addr, name, chat=not raw and bool(show.get("template")))


@dataclass
class ReplSession:
    """What one REPL run changes as it goes: the engine is fixed, the rest is not."""

    llm: Any
    conv: Conversation
    sampling: SamplingParams
    out: IO[str]
    model_name: str
    is_chat: bool  # turns rendered with the chat template (else the transcript as one completion text)
    context_tokens: int = 0  # prompt + reply tokens of the last request
    done: bool = False  # /bye, /exit or /quit was typed
    server: ServerModel | None = None  # replies come from a running server (``llm`` is None)

    def say(self, text: str) -> None:
        self.out.write(text + "\n")

    def last_reply(self) -> str | None:
        return next((m["content"] for m in reversed(self.conv.messages) if m["role"] == "assistant"), None)


def _read_line(stdin: IO[str], out: IO[str], prompt: str) -> str:
    """One line with its newline, "" at EOF. At a terminal through ``input()`` with readline loaded, so the
    arrow keys edit the line and Up/Down walk this session's entries, as in ``ollama run``."""
    if stdin is sys.stdin and out is sys.stdout and stdin.isatty():
        try:
            import readline  # noqa: F401  (input() uses it once imported; absent on some platforms)
        except ImportError:
            pass
        try:
            return input(prompt) + "\n"
        except EOFError:
            return ""
    out.write(prompt)
    out.flush()
    return stdin.readline()


def _read_entry(stdin: IO[str], out: IO[str], prompt: str) -> str | None:
    """One entry; lines ending in a backslash continue on the next line."""
    lines: list[str] = []
    while True:
        line = _read_line(stdin, out, prompt if not lines else "... ")
        if not line:
            return "\n".join(lines) if lines else None
        line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def _reply(s: ReplSession) -> None:
    """Stream the reply to the conversation as it stands and add it as a turn (Ctrl-C, from Enter on: the
    text so far)."""
    reply: list[str] = []
    ids: list[int] = []
    n_out = 0
    it = None
    if s.server is not None:
        _server_reply(s)
        return
    try:
        ids = s.llm.tokenizer.encode_chat(s.conv.chat_messages()) if s.is_chat else s.llm.encode(s.conv.completion_text())
        it = s.llm.stream(ids, s.sampling)
        for ch in it:
            n_out += len(ch.token_ids)
            if ch.text:
                reply.append(ch.text)
                s.out.write(ch.text)
                s.out.flush()
    except KeyboardInterrupt:
        if it is not None:
            it.close()
        s.out.write(" [stopped]")
    s.out.write("\n")
    s.conv.add("assistant", "".join(reply))
    s.context_tokens = len(ids) + n_out


def _server_reply(s: ReplSession) -> None:
    """:func:`_reply` through the server: the conversation as messages (chat) or as one text."""
    assert s.server is not None
    values = {f.name: getattr(s.sampling, f.name) for f in fields(s.sampling)}
    if s.server.chat:
        body = remote.request_body(s.server.name, values, messages=s.conv.chat_messages())
        path = "/v1/chat/completions"
    else:
        body = remote.request_body(s.server.name, values, prompt=s.conv.completion_text())
        path = "/v1/completions"
    reply: list[str] = []
    stream = None
    try:
        stream = remote.RemoteStream(s.server.addr, path, body)
        for ch in stream:
            if ch.text:
                reply.append(ch.text)
                s.out.write(ch.text)
                s.out.flush()
            if ch.timings is not None:
                s.context_tokens = ch.timings.prompt_tokens + ch.timings.generated_tokens
            if ch.error:
                raise remote.RemoteError(ch.error)
    except KeyboardInterrupt:
        if stream is not None:
            stream.close()  # the server frees the request's slot when the connection goes
        s.out.write(" [stopped]")
    s.out.write("\n")
    s.conv.add("assistant", "".join(reply))


def _retry(s: ReplSession) -> None:
    msgs = s.conv.messages
    if not msgs or msgs[-1]["role"] != "assistant":
        s.say("[nothing to retry: there is no reply yet]")
        return
    old = msgs.pop()
    try:
        _reply(s)
    except LLMSysError:
        msgs.append(old)  # the retry did not happen: keep the reply it was to replace
        raise


def _copy(s: ReplSession) -> None:
    """OSC 52 asks the terminal itself to set the clipboard (works over ssh too)."""
    text = s.last_reply()
    if not text:
        s.say("[nothing to copy: there is no reply yet]")
        return
    s.out.write(osc52(text))
    s.say(f"[copied the last reply ({len(text)} characters) to the clipboard]")


def _info(s: ReplSession) -> None:
    if s.server is not None:
        ps = remote.get_json(s.server.addr, "GET", "/api/ps")
        rows = [f"server {s.server.addr.url}, model {s.server.name}, last request {s.context_tokens} tokens"]
        for m in ps.get("models", []):
            rows.append(f"  loaded: {m.get('name')}  resident {m.get('size', 0) / 2**20:.0f} MiB  "
                        f"context {m.get('context_length')}  until {m.get('expires_at')}")
        s.say("\n".join(rows))
        return
    budgets = default_budgets(s.llm.config, s.llm.loaded.device)
    snap = snapshot_from_engine(s.llm, budgets, PerfStats(tokens_in_context=s.context_tokens))
    s.say(info_text(info_rows(model_info(s.llm), snap)))


def _run_command(s: ReplSession, cmd: SlashCommand) -> None:
    if cmd.name == "quit":
        s.done = True
    elif cmd.name == "help":
        s.say(help_text(PLAIN_KEYS))
    elif cmd.name == "retry":
        _retry(s)
    elif cmd.name == "copy":
        _copy(s)
    elif cmd.name == "info":
        _info(s)
    elif cmd.name == "system":
        s.conv.system = cmd.arg or None
        s.say("[system prompt set]" if cmd.arg else "[system prompt removed]")
    elif cmd.name == "reset":
        s.conv.reset()
        s.context_tokens = 0
        s.say("[conversation cleared]")
    elif cmd.name == "set":
        p = s.sampling = apply_settings(s.sampling, list(cmd.args))
        s.say(f"[temperature={p.temperature} top_p={p.top_p} max_tokens={p.max_tokens} seed={p.seed}]")
    elif cmd.name == "save":
        path = s.conv.save(cmd.args[0], s.sampling, s.model_name)
        s.say(f"[saved {len(s.conv.messages)} messages to {path}]")
        if s.server is None and (note := keep_kv(s.llm, s.conv, s.is_chat, path)):
            s.say(f"[{note}]")
    elif cmd.name == "load":
        conv, saved = Conversation.load(cmd.args[0])
        if saved:
            s.sampling = sampling_from_dict(s.sampling, saved)
        s.conv = conv
        s.say(f"[loaded {len(conv.messages)} messages]")


def _handle(s: ReplSession, text: str) -> None:
    """One entry: a command, or a user turn and its reply. Errors become one line."""
    added_user = False
    try:
        cmd = parse_command(text)
        if cmd is not None:
            _run_command(s, cmd)
            return
        s.conv.add("user", text)
        added_user = True
        _reply(s)
    except LLMSysError as e:  # remote.RemoteError is one too: the server's message, one line
        if added_user and s.conv.messages and s.conv.messages[-1]["role"] == "user":
            s.conv.messages.pop()  # the turn did not happen
        s.say(f"error: {error_line(e)}")


def run_repl(llm: Any, sampling: SamplingParams, system: str | None = None, stdin: IO[str] | None = None,
             stdout: IO[str] | None = None, model_name: str = "model", chat: bool | None = None) -> int:
    """Read entries until EOF or /bye; ``chat``: render turns with the chat template (None: when the model has one).

    Ctrl-C while a reply streams stops that reply; elsewhere it is the caller's (KeyboardInterrupt)."""
    stdin = stdin or sys.stdin
    is_chat = llm.tokenizer.chat_template is not None if chat is None else chat
    s = ReplSession(llm, Conversation(system=system), sampling, stdout or sys.stdout, model_name, is_chat)
    mode = "completion mode"
    if is_chat:
        template = llm.tokenizer.default_chat_template
        mode = f"chat template {template.label}" if template is not None else "chat mode"
    s.say(f"llmsys chat ({mode}, context {llm.max_model_len} tokens). /help for commands, /bye or Ctrl+D to quit.")
    return _loop(s, stdin)


def _loop(s: ReplSession, stdin: IO[str]) -> int:
    while not s.done:
        text = _read_entry(stdin, s.out, "> ")  # Ctrl-C here goes up: `llmsys` says "interrupted", exit 130
        if text is None:
            s.out.write("\n")
            return 0
        if text.strip():
            _handle(s, text)
    return 0


def run_server_repl(server: ServerModel, sampling: SamplingParams, system: str | None = None,
                    stdin: IO[str] | None = None, stdout: IO[str] | None = None) -> int:
    """:func:`run_repl` with the replies from a running llmsys server (``server``)."""
    s = ReplSession(None, Conversation(system=system), sampling, stdout or sys.stdout, server.name, server.chat,
                    server=server)
    mode = "chat template" if server.chat else "completion mode"
    s.say(f"llmsys chat ({mode}, served by {server.addr.url}). /help for commands, /bye or Ctrl+D to quit.")
    return _loop(s, stdin or sys.stdin)
