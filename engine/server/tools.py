"""Tool calling: each chat-template family's tool-call format, as a grammar and a parser.

The format is detected from the template source (the markers it renders), not the model's name:
``hermes`` (``<tool_call>\\n{"name", "arguments"}\\n</tool_call>`` per call; Qwen2.5/3, Hermes),
``llama3`` (``{"name", "parameters"}``, after ``<|python_tag|>`` if used, ``;``-separated) and
``mistral`` (``[TOOL_CALLS] [{"name", "arguments"}, ...]``). ``tool_choice: auto`` parses calls out of
free text; ``required`` or a named function compiles the format, with each tool's schema, into an
llguidance Lark grammar, so the output always parses. Streaming holds text back from the first
character a call could start with and emits each complete call as one ``delta.tool_calls`` entry.

A template with none of those (most small and community models) gets the ``generic`` format, as
llama.cpp has one: the tools are described in the system message (:func:`chat_messages`), a call is
the whole output, ``{"name", "arguments"}`` (a list of them for parallel calls), and the grammar binds
the output under every choice; under ``auto`` it may instead be a plain answer, decided by its first
token (:class:`~llmsys.engine.grammar.GrammarOrText`). Past calls and tool results are rewritten into
that text (results as a user turn), so a template with no tool roles renders a whole round trip.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence

from llmsys.engine.grammar import JSON_OPTIONS, GrammarSpec
from llmsys.kernels.common.errors import TokenizerError

if TYPE_CHECKING:
    from llmsys.engine.tokenizer import Tokenizer

FormatName = Literal["hermes", "llama3", "mistral", "generic"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def detect_format(template: str | None) -> FormatName | None:
    """Which family's tool-call format a chat template speaks, or None (none llmsys knows: the
    generic format serves it)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        return "llama3"
    return None


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call text (see the module docstring)."""

    name: FormatName
    # Special-token ids of the markers when the vocabulary has them as single special tokens
    # (a grammar names those ``<[id]>``; as text they would be spelled out character by character).
    marker_ids: dict[str, int]

    @property
    def opener(self) -> str:
        """Where a call's text begins (streaming holds text back from here)."""
        return {"hermes": "<tool_call>", "llama3": "{", "mistral": "[TOOL_CALLS]", "generic": "{"}[self.name]

    def _lit(self, text: str) -> str:
        tid = self.marker_ids.get(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    def grammar(self, tools: Sequence[dict[str, Any]], forced: str | None, parallel: bool,
                free_text: Literal["never", "or", "only"] = "never") -> GrammarSpec:
        """A Lark grammar whose sentences are calls of ``tools`` (only ``forced`` when given),
        one call, or one or more when ``parallel``; ``free_text``: a plain answer beside them
        (``GrammarSpec.free_text``)."""
        chosen = [t for t in tools if forced is None or t["name"] == forced]
        args_key = "parameters" if self.name == "llama3" else "arguments"
        rules = []
        for i, t in enumerate(chosen):
            schema = {
                "type": "object",
                "properties": {"name": {"const": t["name"]},
                               args_key: closed(t.get("parameters") or {"type": "object"})},
                "required": ["name", args_key],
                "additionalProperties": False,
                "x-guidance": JSON_OPTIONS,  # %json in Lark takes its options from the schema
            }
            rules.append(f"call{i}: %json {json.dumps(schema)}")
        call = "call: " + " | ".join(f"call{i}" for i in range(len(chosen)))
        sep = {"hermes": '"\\n"', "llama3": '"; "', "mistral": '", "', "generic": '", "'}[self.name]
        many = f"call ({sep} call)*"
        body = many if parallel else "call"
        if self.name == "hermes":
            start = f'start: block{"+" if parallel else ""}\nblock: {self._lit("<tool_call>")} "\\n" call "\\n" {self._lit("</tool_call>")} "\\n"?'
        elif self.name == "llama3":
            start = f"start: {body}"
        elif self.name == "generic":  # one call as an object; several (when parallel) as a list
            start = "start: call" + (f' | "[" {many} "]"' if parallel else "")
        else:
            start = f'start: {self._lit("[TOOL_CALLS]")} " "? "[" {body} "]"'
        return GrammarSpec("lark", "\n".join([start, call, *rules]), free_text=free_text)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content outside the calls, calls) of a finished output; text that does not parse as
        calls stays content."""
        if self.name == "hermes":
            calls, content, pos = [], [], 0
            for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
                call = _call(m.group(1), "arguments")
                if call is None:
                    continue
                content.append(text[pos:m.start()])
                pos = m.end()
                calls.append(call)
            content.append(text[pos:])
            return "".join(content).strip() if calls else text, calls
        if self.name == "generic":  # the whole output is the call(s), or it is content
            body = text.strip()
            if body[:1] not in ("{", "["):
                return text, []
            try:
                obj = json.loads(body)
            except ValueError:
                return text, []
            items = obj if isinstance(obj, list) else [obj]
            calls = [c for c in (_call(json.dumps(x), "arguments") for x in items) if c is not None]
            return ("", calls) if items and len(calls) == len(items) else (text, [])
        if self.name == "mistral":
            body = text.split("[TOOL_CALLS]", 1)[1] if "[TOOL_CALLS]" in text else text
            try:
                items = json.loads(body.strip())
            except ValueError:
                return text, []
            items = items if isinstance(items, list) else [items]
            calls = [c for c in (_call(json.dumps(x), "arguments") for x in items) if c is not None]
            return ("" if calls and len(calls) == len(items) else text), calls if len(calls) == len(items) else []
        body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
        parts = [p for p in _split_json_objects(body.strip()) if p]
        calls = [c for c in (_call(p, "parameters") for p in parts) if c is not None]
        if parts and len(calls) == len(parts):
            return "", calls
        return text, []


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf (its parts would exclude each other's keys)
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object that lists its properties and
    says nothing of others (as llama.cpp's grammars and OpenAI's strict mode read a tool's schema):
    a small model left free to add keys fills its arguments with them. Every object this allows
    the original allows too."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(v) for v in out[key]]
    for key in ("items", "additionalProperties", "then", "else"):  # not under "not" or "if": that would widen it
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                          "unevaluatedProperties", "allOf"} & set(out):
        out["additionalProperties"] = False
    return out


def _call(text: str, args_key: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _split_json_objects(text: str) -> list[str]:
    """``{...}; {...}`` (Llama 3's parallel calls) into the objects' texts; [] when it is not that."""
    out, depth, start, in_str, esc = [], 0, None, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str, esc = True, False
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                return []
            if depth == 0 and start is not None:
                out.append(text[start:i + 1])
                start = None
        elif depth == 0 and ch not in " \n\t;":
            return []
    return out if depth == 0 else []


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them (transformers' convention): an assistant
    turn's ``tool_calls`` with ``function.arguments`` as an object (templates ``tojson`` it), a
    tool result with its ``tool_call_id``; ``developer`` is ``system``."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args: Any = json.loads(c.function.arguments)
                except ValueError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        out.append(d)
    return out


class ToolStream:
    """Splits a streamed output into content deltas and completed tool calls.

    Text is passed through until the output could be starting a call (the
    format's opener, or a prefix of it at the end of what came so far); from
    there it is held, and :meth:`finish` parses it. For ``hermes`` each
    ``</tool_call>`` completes a call as soon as it arrives. A Llama 3 or
    generic call is the whole output, so the first non-blank character decides.
    """

    _TAG = "<|python_tag|>"

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.held = ""
        self.mode: Literal["scan", "call", "text"] = "scan"
        self.called = False  # a call was completed: the newline after its block is not content

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed by this delta)."""
        self.held += delta
        if self.mode == "text":
            out, self.held = self.held, ""
            return out, []
        if self.fmt.name in ("llama3", "generic"):
            if self.mode == "scan":
                s = self.held.lstrip()
                tag = self._TAG if self.fmt.name == "llama3" else "["
                if s.startswith("{") or s.startswith(tag):
                    self.mode = "call"
                elif s and not tag.startswith(s):
                    self.mode = "text"
                    out, self.held = self.held, ""
                    return out, []
            return "", []
        out, calls = "", []
        opener = self.fmt.opener
        while True:
            if self.mode == "scan":
                if self.called:
                    self.held = self.held.lstrip("\n")
                at = self.held.find(opener)
                if at < 0:
                    cut = len(self.held) - _partial_suffix(self.held, opener)
                    out, self.held = out + self.held[:cut], self.held[cut:]
                    return out, calls
                out, self.held, self.mode = out + self.held[:at], self.held[at:], "call"
            if self.fmt.name != "hermes" or "</tool_call>" not in self.held:
                return out, calls
            block, self.held = self.held.split("</tool_call>", 1)
            block += "</tool_call>"
            found = self.fmt.parse(block)[1]
            if found:
                calls += found
                self.called = True
            else:
                out += block  # not a call after all: it is content
            self.mode = "scan"

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: (held text that is content after all, calls it holds)."""
        held, self.held = self.held, ""
        if not held:
            return "", []
        if self.mode != "call":
            return held, []
        return self.fmt.parse(held)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ToolPlan:
    """How one request treats tools: the format to parse calls with (None: calls are not
    parsed, ``tool_choice: none``), the grammar that forces calls (``required`` / named) or, in
    the generic format under ``auto`` checks a call the output opens, or under ``none`` keeps it
    from opening one (``grammar.free_text``), and whether more than one call may come back."""

    fmt: ToolFormat | None
    grammar: GrammarSpec | None
    parallel: bool


class ToolChoiceError(ValueError):
    """A tools request this model or server cannot serve (the message says why and what to do);
    ``param``: the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def plan_tools(template: str | None, tools: Sequence[dict[str, Any]], choice: str, parallel: bool,
               special_token: Any) -> ToolPlan:
    """``tools``: ``{"name", "description", "parameters"}`` each; ``choice``: ``none``, ``auto``,
    ``required`` or a function name; ``special_token``: text -> its id when the vocabulary has it
    as one special token (``GrammarVocab.special_token``), else None."""
    generic = detect_format(template) is None
    if choice == "none":  # a generic call would be JSON text: the output may not begin like one
        return ToolPlan(None, ToolFormat("generic", {}).grammar(tools, None, parallel, "only") if generic else None,
                        parallel)
    forced = None if choice in ("auto", "required") else choice
    if forced is not None and forced not in {t["name"] for t in tools}:
        raise ToolChoiceError(f"tool_choice names the function '{forced}' but tools has no function of that name",
                              "tool_choice")
    name = detect_format(template) or "generic"
    markers = {"hermes": ("<tool_call>", "</tool_call>"), "llama3": ("<|python_tag|>",),
               "mistral": ("[TOOL_CALLS]",), "generic": ()}[name]
    fmt = ToolFormat(name, {m: t for m in markers if (t := special_token(m)) is not None})
    if choice == "auto":
        # A marker-less call is the whole output: checked by the grammar once the output opens one.
        return ToolPlan(fmt, fmt.grammar(tools, None, parallel, "or") if generic else None, parallel)
    return ToolPlan(fmt, fmt.grammar(tools, forced, parallel and forced is None), parallel)


# -- the generic format's prompt ---------------------------------------------------------------

_PROBE = "llmsys-system-probe-7f3a"


def _takes_system(tok: Tokenizer) -> bool:
    """Whether the chat template renders a system message (some reject one, some drop it)."""
    try:
        text = tok.apply_chat_template([{"role": "system", "content": _PROBE}, {"role": "user", "content": "x"}])
    except TokenizerError:
        return False
    return _PROBE in text


def generic_instructions(tools: Sequence[dict[str, Any]], parallel: bool) -> str:
    """The system text that describes ``tools`` (OpenAI's ``{"type": "function", "function"}``
    shape) and the generic call format. The same whatever the ``tool_choice`` (the grammar
    enforces it), so a conversation's prefix stays cached from one request to the next."""
    lines = ["You can call these tools (one per line: its name, what it does and the JSON schema of its "
             "arguments):"]
    for t in tools:
        f = t.get("function", t)
        lines.append(json.dumps({k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None},
                                ensure_ascii=False))
    several = " (or a JSON list of such objects to call several tools at once)" if parallel else ""
    lines += ["", f'To call a tool, answer with only a JSON object {{"name": <tool name>, "arguments": <its '
                  f'arguments>}}{several}. To answer without a tool, write plain text.',
              'A call\'s result comes back as {"tool_response": {"name": <tool name>, "content": <result>}}.']
    return "\n".join(lines)


def _call_text(calls: Sequence[dict[str, Any]]) -> str:
    """Past calls as the generic format writes them (what the model is asked to write)."""
    items = []
    for c in calls:
        f = c.get("function", c)
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        items.append({"name": f.get("name"), "arguments": args if args is not None else {}})
    return json.dumps(items[0] if len(items) == 1 else items, ensure_ascii=False)


def _result_text(name: str | None, content: Any) -> str:
    """A tool result as the generic format writes it (the content as JSON when it is JSON text)."""
    if isinstance(content, str):
        try:
            content = json.loads(content)
        except ValueError:
            pass
    body = {"name": name, "content": content} if name else {"content": content}
    return json.dumps({"tool_response": body}, ensure_ascii=False)


def chat_messages(tok: Tokenizer, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                  parallel: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the tools to hand the chat template (``messages`` in
    :func:`template_messages`' shape, ``tools`` in OpenAI's). A template with a tool format of its
    own gets both as they are. Any other gets the generic format: the tools described in the system
    message (merged with the conversation's own, or put in the first user turn when the template
    takes no system message), each past call written as the JSON the model writes, and the tool
    results (``role: tool``) as one user turn of ``{"tool_response"}`` lines (with a user message
    that follows them), so templates that know only user and assistant turns render it."""
    template = tok.chat_template_source(tools=True)
    if template is None or detect_format(template) is not None:
        return messages, (list(tools) if tools else None)
    if not tools and not any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        return messages, None
    names: dict[str, str] = {}  # call id -> the function's name, for results that give only the id
    out: list[dict[str, Any]] = []
    results: list[str] = []
    for m in messages:
        if m.get("role") == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "")
            results.append(_result_text(name, m.get("content")))
            continue
        d = dict(m)
        if results:
            if d.get("role") == "user":  # results and the user's next words: one turn
                d["content"] = "\n".join(results) + ("\n\n" + d["content"] if d.get("content") else "")
            else:
                out.append({"role": "user", "content": "\n".join(results)})
            results = []
        if d.get("tool_calls"):
            calls = d.pop("tool_calls")
            for c in calls:
                if c.get("id"):
                    names[c["id"]] = c.get("function", c).get("name")
            d["content"] = ((d.get("content") or "").strip() + "\n" if d.get("content") else "") + _call_text(calls)
        out.append(d)
    if results:
        out.append({"role": "user", "content": "\n".join(results)})
    if tools:
        text = generic_instructions(tools, parallel)
        if out and out[0].get("role") in ("system", "developer"):
            own = out.pop(0).get("content")
            text = f"{own}\n\n{text}" if own else text
        if _takes_system(tok):
            out.insert(0, {"role": "system", "content": text})
        else:  # first in the first user turn
            i = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
            if i is None:
                out.insert(0, {"role": "user", "content": text})
            else:
                out[i] = {**out[i], "content": f"{text}\n\n{out[i].get('content') or ''}".rstrip()}
    return out, None
