"""Render Hugging Face chat templates byte-identically to ``transformers.apply_chat_template``.

The model was fine-tuned on that exact text (a stray newline or an ASCII-escaping ``tojson`` changes
generations), so this copies transformers' environment: ``ImmutableSandboxedEnvironment``,
``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a no-op ``{% generation %}`` and the same
``tojson`` / ``raise_exception`` / ``strftime_now``. A template is untrusted code, so rendering is
bounded (:class:`RenderBudget`: steps, wall time, output size; past one is a one-line
:class:`TokenizerError`). The compiled template lives on a :class:`ChatTemplate`, not a module cache.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from llmsys.kernels.common.errors import TokenizerError


@dataclass(frozen=True)
class RenderBudget:
    """Limits of one render. A shipped template renders a long conversation in
    well under 1% of each (about ten steps per message)."""

    max_steps: int = 4_000_000
    max_seconds: float = 5.0
    max_output_chars: int = 64 * 2**20


_BUDGET_VAR = "llmsys_render_budget"  # the per-render meter, a template variable (renders may run concurrently)


class _Meter:
    """Counts one render's steps against its :class:`RenderBudget`."""

    def __init__(self, budget: RenderBudget, origin: str):
        self.budget = budget
        self.origin = origin
        self.steps = 0
        self.output = 0
        self.deadline = time.monotonic() + budget.max_seconds

    def _over(self, what: str) -> TokenizerError:
        return TokenizerError(f"the chat template in {self.origin} {what}; it was stopped (a template "
                              "should render in milliseconds: fix or replace it)")

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.budget.max_steps:
            raise self._over(f"took more than {self.budget.max_steps:,} steps")
        if self.steps % 4096 < n and time.monotonic() > self.deadline:
            raise self._over(f"ran longer than {self.budget.max_seconds:g} s")

    def emit(self, piece: str) -> None:
        self.output += len(piece)
        if self.output > self.budget.max_output_chars:
            raise self._over(f"rendered more than {self.budget.max_output_chars:,} characters")
        self.tick()

    def size(self, n: int) -> None:
        """A value about to be built with ``n`` elements or characters."""
        if n > self.budget.max_output_chars:
            raise self._over(f"tried to build a value of {n:,} elements or characters")

    def range(self, *args: int) -> _MeteredRange:
        return _MeteredRange(safe_range(*args), self)  # safe_range refuses more than 100,000 items


class _MeteredRange(Sequence):
    """``range`` for templates: the same sequence (``|length``, indexing), each item iterated a step."""

    def __init__(self, r: range, meter: _Meter):
        self._r = r
        self._meter = meter

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i: Any) -> Any:
        return self._r[i]

    def __iter__(self) -> Iterator[int]:
        for i in self._r:
            self._meter.tick()
            yield i


def _meter(context: Any) -> _Meter | None:
    m = context.get(_BUDGET_VAR)
    return m if isinstance(m, _Meter) else None


class _MeteredEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every call and the growing operators counted by the render's meter."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        m = _meter(__context)
        if m is not None:
            m.tick()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        m = _meter(context)
        if m is not None:
            m.tick()
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                m.size(int(right * max(1, abs(left)).bit_length() / 3.3))  # the result's decimal digits
            elif operator == "*":
                for seq, k in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(k, int):
                        m.size(len(seq) * k)
        return super().call_binop(context, operator, left, right)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    transformers uses this tag to build assistant-token masks for training;
    some shipped templates contain it, so it must parse, but for inference the
    body is simply emitted.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    """Templates call ``raise_exception('...')`` to reject a conversation
    (e.g. roles not alternating user/assistant); surface it as a user error."""
    raise TokenizerError(f"the model's chat template rejected the conversation: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Jinja's built-in ``tojson`` HTML-escapes ``<>&'``; transformers replaces it
    with plain ``json.dumps`` (non-ASCII kept), and templates depend on that."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """Llama-3.x templates stamp today's date into the system prompt."""
    return datetime.now().strftime(fmt)


def _plain(value: Any) -> Any:
    """Deep-copy into plain JSON types so the template sees no foreign objects
    (pydantic models from the OpenAI SDK become dicts)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts with ``None`` values dropped.

    OpenAI clients send ``content=None`` / ``tool_calls=None``; many templates
    render a literal ``None`` or crash on them but handle a missing key, which
    is why transformers drops them too.
    """
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        message = _plain(message)
        if not isinstance(message, dict):
            raise TokenizerError(
                f"chat message {i} is {type(message).__name__}, expected a dict with 'role' and 'content'"
            )
        out.append({k: v for k, v in message.items() if v is not None})
    return out


class ChatTemplate:
    """One compiled chat template.

    ``origin`` names the file it came from so render errors point the user at it; ``name`` is what
    the CLI's stats line calls it (a family such as ``chatml``, a file name, or None: named by its
    text, :attr:`label`); ``end_of_turn`` the text closing an assistant turn where it is known.
    """

    def __init__(self, source: str, origin: str = "chat template", budget: RenderBudget = RenderBudget(),
                 name: str | None = None, end_of_turn: str | None = None):
        self.source = source
        self.origin = origin
        self.budget = budget
        self.name = name
        self.end_of_turn = end_of_turn
        env = _MeteredEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(
                f"the chat template in {origin} is not valid Jinja (line {e.lineno}: {e.message}); "
                "fix or remove it"
            ) from e

    def __eq__(self, other: object) -> bool:
        """By what renders (two configs naming one template are equal configs), not by compiled object."""
        if not isinstance(other, ChatTemplate):
            return NotImplemented
        return (self.source, self.name, self.end_of_turn) == (other.source, other.name, other.end_of_turn)

    def __hash__(self) -> int:
        return hash((self.source, self.name, self.end_of_turn))

    @property
    def label(self) -> str:
        """``chatml`` (a family, given or recognised), ``my.jinja`` (a file given), else ``the model's own``."""
        return self.name or template_family(self.source) or "the model's own"

    def render(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt string.

        ``special_tokens`` (``bos_token``, ``eos_token``, ...) are passed as
        template variables the way transformers passes ``special_tokens_map``;
        ``template_kwargs`` (e.g. ``enable_thinking``) override them.
        """
        if not messages:
            raise TokenizerError("cannot apply the chat template to an empty conversation; send at least one message")
        variables: dict[str, Any] = dict(special_tokens or {})
        variables.update(_plain(template_kwargs))
        variables["messages"] = normalize_messages(messages)
        variables["tools"] = None if tools is None else _plain(list(tools))
        variables["documents"] = variables.get("documents")
        variables["add_generation_prompt"] = add_generation_prompt
        meter = _Meter(self.budget, self.origin)
        variables[_BUDGET_VAR] = meter
        variables["range"] = meter.range
        try:
            pieces = []
            for piece in self._template.generate(**variables):
                meter.emit(piece)
                pieces.append(piece)
            return "".join(pieces)
        except TokenizerError:
            raise
        except (OverflowError, MemoryError, RecursionError) as e:
            raise TokenizerError(f"the chat template in {self.origin} exhausted a limit "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'})") from None
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template in {self.origin} failed to render: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TokenizerError(
                f"the chat template in {self.origin} failed on these messages ({type(e).__name__}: {e})"
            ) from e


# --------------------------------------------------------------------------
# Known template families (``--chat-template NAME``)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplateFamily:
    """A chat format by name, for models whose file carries no template (or the wrong one).

    ``end_of_turn`` is the text that closes an assistant turn: where the vocabulary has it as one
    token, the tokenizer stops on it (a base model's EOS is not the family's end of turn).
    ``marker`` is a string only this family's templates contain, to name a model's own template.
    """

    name: str
    source: str
    end_of_turn: str
    marker: str


_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
           "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Llama 2 and Mistral fold the system message into the first user turn; both refuse other orders as their own do.
_LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
           "{% set messages = messages[1:] %}{% else %}{% set system = none %}{% endif %}"
           "{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('roles must alternate user/assistant after an optional system message') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' }}"
           "{% if loop.first and system %}{{ '<<SYS>>\n' + system + '\n<</SYS>>\n\n' }}{% endif %}"
           "{{ message['content'] | trim + ' [/INST]' }}"
           "{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}")
_MISTRAL = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
            "{% set messages = messages[1:] %}{% else %}{% set system = none %}{% endif %}{{ bos_token }}"
            "{% for message in messages %}"
            "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('roles must alternate user/assistant after an optional system message') }}{% endif %}"
            "{% if message['role'] == 'user' %}{{ '[INST] ' }}{% if loop.first and system %}{{ system + '\n\n' }}"
            "{% endif %}{{ message['content'] + '[/INST]' }}"
            "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
_GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
          "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
          "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
          "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim + "
          "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
_PHI3 = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
_ZEPHYR = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
_VICUNA = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
           "{% elif message['role'] == 'user' %}{{ 'USER: ' + message['content'] + '\n' }}"
           "{% else %}{{ 'ASSISTANT: ' + message['content'] + eos_token + '\n' }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
_ALPACA = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
           "{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n' }}"
           "{% else %}{{ '### Response:\n' + message['content'] + eos_token + '\n\n' }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}")

# Ordered: a model's own template is named by the first family whose marker it contains.
TEMPLATE_FAMILIES: tuple[TemplateFamily, ...] = (
    TemplateFamily("chatml", _CHATML, "<|im_end|>", "<|im_start|>"),
    TemplateFamily("llama3", _LLAMA3, "<|eot_id|>", "<|start_header_id|>"),
    TemplateFamily("gemma", _GEMMA, "<end_of_turn>", "<start_of_turn>"),
    TemplateFamily("phi3", _PHI3, "<|end|>", "<|end|>"),
    TemplateFamily("zephyr", _ZEPHYR, "</s>", "<|assistant|>"),
    TemplateFamily("llama2", _LLAMA2, "</s>", "<<SYS>>"),
    TemplateFamily("mistral", _MISTRAL, "</s>", "[INST]"),
    TemplateFamily("vicuna", _VICUNA, "</s>", "ASSISTANT:"),
    TemplateFamily("alpaca", _ALPACA, "</s>", "### Instruction:"),
)


def template_family(source: str | None) -> str | None:
    """The family a template's text belongs to (``chatml`` for SmolLM2's and Qwen's), None if none matches."""
    if not source:
        return None
    return next((f.name for f in TEMPLATE_FAMILIES if f.marker in source), None)


def family_names() -> str:
    return ", ".join(f.name for f in TEMPLATE_FAMILIES)


def resolve_chat_template(spec: str | ChatTemplate) -> ChatTemplate:
    """``--chat-template FILE|NAME`` as a compiled template: a Jinja file, or a known family's name.

    A path that exists wins over a family of the same name; anything else is a one-line error that
    lists the known names.
    """
    if isinstance(spec, ChatTemplate):
        return spec
    from pathlib import Path

    text = str(spec).strip()
    path = Path(text).expanduser()
    if text and path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"--chat-template {text}: cannot read it ({type(e).__name__}: {e})") from None
        if not source.strip():
            raise TokenizerError(f"--chat-template {text}: the file is empty; write a Jinja chat template in it")
        return ChatTemplate(source, str(path), name=path.name)
    family = next((f for f in TEMPLATE_FAMILIES if f.name == text.lower()), None)
    if family is not None:
        return ChatTemplate(family.source, f"the {family.name} family template", name=family.name,
                            end_of_turn=family.end_of_turn)
    if path.suffix in (".jinja", ".j2", ".txt", ".tmpl") or "/" in text or path.is_dir():
        why = "is a folder" if path.is_dir() else "does not exist"
        raise TokenizerError(f"--chat-template {text}: {why}; give a Jinja file or a known name ({family_names()})")
    raise TokenizerError(f"--chat-template {text!r} is neither a file nor a known template name; known: "
                         f"{family_names()}")
