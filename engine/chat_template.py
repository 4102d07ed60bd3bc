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

    ``origin`` names the file it came from so render errors point the user at it.
    """

    def __init__(self, source: str, origin: str = "chat template", budget: RenderBudget = RenderBudget()):
        self.source = source
        self.origin = origin
        self.budget = budget
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
