"""What every generating route does before the engine sees a request: readiness,
the KV policy, prompts checked against the loaded model, sampling parameters.

One place for both wire formats (OpenAI's ``/v1`` and Ollama's ``/api``), so a
prompt too long for the context, a token id outside the vocabulary or a
conflicting pair of fields is the same 400 whichever API a client speaks. The
methods that tokenize or render a template are CPU work: handlers call them
through ``state.off_loop``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

from llmsys.engine.sampling import SamplingParams
from llmsys.engine.server.protocol import APIError, prompt_over_limit
from llmsys.engine.server.state import ServerState
from llmsys.kernels.common.errors import InvalidParameterError, LLMSysError
from llmsys.offload.kv_policy import KVPolicy


class Preparer:
    """Request checks against one server's loaded model (see the module docstring)."""

    def __init__(self, state: ServerState):
        self.state = state

    def need_ready(self) -> None:
        state = self.state
        if state.load_error:
            raise APIError(503, f"model failed to load: {state.load_error}", type="server_error")
        if not state.ready:
            raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                           code="model_loading", headers={"Retry-After": "1"})

    def kv_policy(self, spec: str | None) -> KVPolicy | None:
        """A request's ``kv_policy`` checked against this engine (400 naming the problem), or None."""
        if spec is None:
            return None
        try:
            return self.state.llm.core.kv_policy.resolve(spec)
        except LLMSysError as e:
            raise APIError(400, str(e), param="kv_policy", code="invalid_kv_policy") from None

    def too_long(self, n: int, field: str, at_least: bool = False) -> APIError:
        max_len = self.state.llm.max_model_len
        return APIError(
            400,
            f"this model's context holds {max_len} tokens but the prompt has {'at least ' if at_least else ''}{n}; "
            "shorten the prompt (or restart the server with a larger --max-model-len)",
            param=field, code="context_length_exceeded", n_prompt_tokens=n, n_ctx=max_len,
        )

    def _slides(self, policy: KVPolicy | None) -> bool:
        return (policy or self.state.llm.core.kv_policy.policy).allows_long_prompts  # the window slides in prefill

    def check_length(self, text: str, field: str, policy: KVPolicy | None) -> None:
        """Refuse, without tokenizing it, a text too long to fit whatever its tokens (seconds of CPU
        for megabytes of text, to learn what its length already says)."""
        max_len, limit = self.state.llm.max_model_len, self.state.prompt_limit()
        if len(text) < min(max_len, limit):
            return
        fewest = len(text) // self.state.max_token_chars()
        if fewest >= max_len and not self._slides(policy):
            raise self.too_long(fewest, field, at_least=True)
        if fewest > limit:
            raise self.over_limit(fewest, field, at_least=True)

    def over_limit(self, n: int, field: str, at_least: bool = False) -> APIError:
        """--max-prompt-tokens holds whatever the KV policy (a sliding window would take any length)."""
        return prompt_over_limit(n, self.state.prompt_limit(), field, at_least)

    def check_prompt(self, ids: list[int], field: str, policy: KVPolicy | None) -> None:
        if len(ids) >= self.state.llm.max_model_len and not self._slides(policy):
            raise self.too_long(len(ids), field)
        if len(ids) > self.state.prompt_limit():
            raise self.over_limit(len(ids), field)
        if not ids:
            raise APIError(400, "the prompt is empty (it encodes to no tokens)", param=field, code="invalid_prompt")
        vocab = self.state.llm.loaded.args.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", param=field,
                           code="invalid_prompt")

    @contextmanager
    def bad_text(self, field: str) -> Iterator[None]:
        """Text the tokenizer refuses (not valid Unicode) is the client's error, naming the field."""
        try:
            yield
        except InvalidParameterError as e:
            raise APIError(400, str(e), param=field, code="invalid_prompt") from None

    def encode(self, text: str, field: str, policy: KVPolicy | None, add_special_tokens: bool = True) -> list[int]:
        """``text`` to token ids, checked (length first, then the ids)."""
        self.check_length(text, field, policy)
        with self.bad_text(field):
            ids = self.state.llm.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        self.check_prompt(ids, field, policy)
        return ids

    def encode_text(self, text: str, field: str) -> list[int]:
        """Text that is not a prompt (a predicted output) as token ids, without special tokens;
        at most the context's length of it is kept (more could never be used)."""
        if len(text) > self.state.llm.max_model_len * self.state.max_token_chars():
            raise APIError(400, f"{field} is longer than the model's context could ever use "
                                f"({self.state.llm.max_model_len} tokens)", param=field, code="invalid_prompt")
        with self.bad_text(field):
            ids = self.state.llm.tokenizer.encode(text, add_special_tokens=False)
        return ids[: self.state.llm.max_model_len]

    def chat_ids(self, messages: list[dict[str, Any]], field: str, policy: KVPolicy | None,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """A conversation rendered with the model's chat template (``tools`` passed in as
        transformers does) and encoded; the template writes BOS itself."""
        tok = self.state.llm.tokenizer
        if tok.chat_template is None:
            raise APIError(400, f"model '{self.state.model_name}' has no chat template (it is a base model); "
                                "send a plain prompt instead (/v1/completions, /api/generate)",
                           param=field, code="no_chat_template")
        text = tok.apply_chat_template(messages, tools=tools)
        return self.encode(text, field, policy, add_special_tokens=False)

    def sampling(self, **fields: Any) -> SamplingParams:
        """SamplingParams from already schema-checked fields; what is left to refuse is two
        fields together (``min_tokens`` over ``max_tokens``), a 400 with its own code."""
        try:
            return SamplingParams(**fields)
        except LLMSysError as e:
            raise APIError(400, str(e), code="conflicting_parameters") from None
