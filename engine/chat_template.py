"""Render Hugging Face chat templates exactly like ``transformers`` does.

A chat template is untrusted Jinja shipped with the model (``tokenizer_config.json``
``chat_template`` or ``chat_template.jinja``). The prompt the model sees must be
byte-identical to what ``transformers.apply_chat_template`` renders, because the
model was fine-tuned on that exact text; a stray newline or a ``tojson`` that
escapes non-ASCII measurably changes generations. So this module copies the
transformers environment: an ``ImmutableSandboxedEnvironment`` (templates cannot
mutate inputs or reach Python internals) with ``trim_blocks``/``lstrip_blocks``,
the ``loopcontrols`` extension, a no-op ``{% generation %}`` block, and the same
``tojson`` / ``raise_exception`` / ``strftime_now`` helpers.

The compiled template lives on a :class:`ChatTemplate` instance (no module-level
cache), which the tokenizer holds for its lifetime.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmsys.kernels.common.errors import TokenizerError


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

    def __init__(self, source: str, origin: str = "chat template"):
        self.source = source
        self.origin = origin
        env = ImmutableSandboxedEnvironment(
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
        try:
            return self._template.render(**variables)
        except TokenizerError:
            raise
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template in {self.origin} failed to render: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TokenizerError(
                f"the chat template in {self.origin} failed on these messages ({type(e).__name__}: {e})"
            ) from e
