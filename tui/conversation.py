"""The conversation: messages, the system prompt, sampling settings, JSON files.

Shared by the Textual app and the plain REPL so both save and load the same
files and build the same prompts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmsys.kernels.common.errors import InvalidParameterError, LLMSysError
from llmsys.engine.sampling import SamplingParams

FORMAT = "llmsys-conversation"
VERSION = 1
ROLES = ("system", "user", "assistant")


class ConversationFileError(LLMSysError):
    """A conversation file that cannot be read or written."""


@dataclass
class Conversation:
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)  # {"role", "content"}, user/assistant

    def add(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})

    def reset(self) -> None:
        self.messages.clear()

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages for the chat template (system first when set)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]

    def completion_text(self) -> str:
        """Base models (no chat template) continue one running document:
        the system text, then every turn's text, in order."""
        text = self.system or ""
        for m in self.messages:
            c = m["content"]
            if text and c and not text[-1].isspace() and not c[0].isspace() and m["role"] == "user":
                text += " "
            text += c
        return text

    # -- files ---------------------------------------------------------------
    def to_json(self, params: SamplingParams | None = None, model: str | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"format": FORMAT, "version": VERSION, "model": model, "system": self.system, "messages": self.messages}
        if params is not None:
            d["sampling"] = sampling_to_dict(params)
        return d

    def save(self, path: str | Path, params: SamplingParams | None = None, model: str | None = None) -> Path:
        p = Path(path).expanduser()
        try:
            p.write_text(json.dumps(self.to_json(params, model), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as e:
            raise ConversationFileError(f"cannot write {p}: {e.strerror or e}; choose a writable path") from e
        return p

    @classmethod
    def load(cls, path: str | Path) -> tuple[Conversation, dict[str, Any] | None]:
        """Read a saved conversation; returns it and the saved sampling dict (if any)."""
        p = Path(path).expanduser()
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConversationFileError(f"{p} does not exist; give the path of a file written by /save") from e
        except (OSError, ValueError) as e:
            raise ConversationFileError(f"cannot read {p} as a conversation: {e}") from e
        if not isinstance(d, dict) or not isinstance(d.get("messages"), list):
            raise ConversationFileError(f"{p} has no 'messages' list; it was not written by /save")
        msgs = []
        for m in d["messages"]:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ConversationFileError(f"{p}: every message needs a role ({', '.join(ROLES)}) and a string content")
            msgs.append({"role": m["role"], "content": m["content"]})
        system = d.get("system")
        if msgs and msgs[0]["role"] == "system" and system is None:
            system = msgs.pop(0)["content"]
        return cls(system=system if isinstance(system, str) else None, messages=msgs), d.get("sampling")


def keep_kv(llm: Any, conv: Conversation, chat: bool, path: Path) -> str | None:
    """/save with the prefix cache's disk tier on (``llmsys chat``'s default): the conversation's KV blocks,
    written to disk as they were made, are pinned under the file's path (kept out of LRU eviction), so a
    later /load, even in a new process, continues without computing them again. Returns a short note;
    None without a tier (or a model still loading)."""
    disk = getattr(getattr(llm, "core", None), "kv_disk", None)
    if disk is None or not disk.enabled:
        return None
    ids = llm.tokenizer.encode_chat(conv.chat_messages()) if chat else llm.encode(conv.completion_text())
    on_disk, total = disk.pin_prompt(str(Path(path).resolve()), ids, llm.core.kv.spec.block_size)
    return f"its KV: {on_disk} of {total} blocks kept on disk" if total else None


def sampling_to_dict(p: SamplingParams) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def sampling_from_dict(base: SamplingParams, d: dict[str, Any]) -> SamplingParams:
    names = {f.name for f in dataclasses.fields(base)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
    return dataclasses.replace(base, **kw)


def _convert(name: str, raw: str, current: Any) -> Any:
    low = raw.strip().lower()
    if low in ("none", "null", "off") and name in ("max_tokens", "seed", "top_k", "logprobs"):
        return None if name != "top_k" else 0
    if isinstance(current, bool):
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise InvalidParameterError(f"{name} must be true or false, got {raw!r}")
    if name in ("stop",):
        return tuple(s for s in raw.split("|") if s)
    try:
        if isinstance(current, float) or name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            return float(raw)
        return int(raw)
    except ValueError:
        raise InvalidParameterError(f"{name} needs a number, got {raw!r}") from None


def apply_settings(params: SamplingParams, assignments: list[str]) -> SamplingParams:
    """``/set temperature=0.7 top_p=0.9`` -> new SamplingParams (validated)."""
    names = {f.name for f in dataclasses.fields(params)}
    aliases = {"temp": "temperature", "n_predict": "max_tokens", "max_new_tokens": "max_tokens"}
    changes: dict[str, Any] = {}
    if not assignments:
        raise InvalidParameterError("usage: /set name=value ... (e.g. /set temperature=0.7 top_p=0.9 max_tokens=256 seed=1)")
    for a in assignments:
        if "=" not in a:
            raise InvalidParameterError(f"cannot read {a!r}; write name=value, e.g. temperature=0.7")
        k, v = a.split("=", 1)
        k = aliases.get(k.strip(), k.strip())
        if k not in names or k == "n":
            raise InvalidParameterError(f"unknown setting {k!r}; try temperature, top_p, top_k, min_p, max_tokens, seed, repetition_penalty, stop")
        changes[k] = _convert(k, v, getattr(params, k))
    return dataclasses.replace(params, **changes)  # SamplingParams validates in __post_init__
