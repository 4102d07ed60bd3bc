"""What the embedding routes share: inputs checked and tokenized, one :class:`Job` of embedding requests
(batched by the engine with everything else), the vectors back in input order.

OpenAI's ``/v1/embeddings`` and Ollama's ``/api/embed`` / ``/api/embeddings`` differ only in their
shapes: which inputs they take, whether an input longer than the context is cut (Ollama's
``truncate``, default true) or refused (OpenAI: a 400 naming both lengths), and whether vectors are
normalized (OpenAI: as the model says, ``llmsys.engine.embedding``; ``/api/embed``: always, as Ollama
does; the legacy ``/api/embeddings``: never, as Ollama does).
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from llmsys.engine.embedding import shorten
from llmsys.engine.outputs import Timings
from llmsys.engine.sampling import SamplingParams
from llmsys.engine.server.completions import Job, ending_error, new_id
from llmsys.engine.server.prepare import Preparer
from llmsys.engine.server.protocol import APIError
from llmsys.engine.server.state import ServerState
from llmsys.kernels.common.errors import LLMSysError


@dataclass(frozen=True)
class Embedded:
    """One request's vectors (``[D]`` float32 each, input order) and the tokens they were made of."""

    vectors: list[torch.Tensor]
    prompt_tokens: int
    timings: list[Timings]


def embedding_inputs(prep: Preparer, inputs: list[str | list[int]], field: str, truncate: bool,
                     num_ctx: int | None = None) -> list[list[int]]:
    """Each input as token ids within the context (or Ollama's smaller ``num_ctx``): its first tokens when
    ``truncate``, else a 400 naming the input, its length and the context. CPU work: call it through
    ``state.off_loop``."""
    state = prep.state
    max_len, limit = min(state.llm.max_model_len, num_ctx or state.llm.max_model_len), state.prompt_limit()
    vocab = state.llm.loaded.args.vocab_size
    out = []
    for i, x in enumerate(inputs):
        where = f"{field}[{i}]" if len(inputs) > 1 else field
        if isinstance(x, str):
            longest = max_len * state.max_token_chars()
            if truncate and len(x) > longest:
                x = x[:longest]  # more characters than the context could hold: never tokenized
            elif not truncate and num_ctx is None:
                prep.check_length(x, where, None)
            with prep.bad_text(where):
                ids = state.llm.tokenizer.encode(x)
        else:
            ids = list(x)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                               param=field, code="invalid_prompt")
        if not ids:
            raise APIError(400, f"{where} is empty (it encodes to no tokens)", param=field, code="invalid_prompt")
        if len(ids) > max_len:
            if not truncate:
                raise APIError(400, f"{where} has {len(ids)} tokens but this model's context holds {max_len}; "
                                    "shorten it (or restart the server with a larger --max-model-len)",
                               param=field, code="context_length_exceeded", n_prompt_tokens=len(ids), n_ctx=max_len)
            ids = ids[:max_len]
        if len(ids) > limit:
            raise prep.over_limit(len(ids), where)
        out.append(ids)
    return out


def check_dimensions(state: ServerState, dimensions: int | None) -> None:
    size = state.llm.loaded.args.hidden_size
    if dimensions is not None and not 1 <= dimensions <= size:
        raise APIError(400, f"dimensions={dimensions} is outside 1..{size}, this model's embedding size",
                       param="dimensions", code="invalid_dimensions")


async def run_embeddings(state: ServerState, prompts: list[list[int]], normalize: bool | None,
                         dimensions: int | None, is_disconnected: Callable[[], Any]) -> Embedded | None:
    """Embed ``prompts`` through the engine thread (``EngineClient.embed``: one queue place); None when the
    client left first. ``normalize``: None as the model says. ``dimensions``: keep the first that many
    values (normalized again when the vectors are)."""
    pooling = state.llm.pooling
    try:
        pooling.check()
    except LLMSysError as e:
        raise APIError(400, str(e), code="embeddings_unsupported") from None
    if normalize is not None:
        pooling = dataclasses.replace(pooling, normalize=normalize)
    job = Job(state, new_id("embd"), prompts, SamplingParams(max_tokens=1), pooling=pooling)
    vectors: list[torch.Tensor | None] = [None] * len(prompts)
    timings: list[Timings] = []
    try:
        async for idx, ch in job.items(is_disconnected):
            if not ch.finished:
                continue
            err = ending_error(job, idx, ch)
            if err is not None or ch.embedding is None:
                raise err or APIError(503, "the request ended before its embedding was computed",
                                      type="server_error", code="request_failed")
            vectors[idx] = shorten(ch.embedding, dimensions, pooling.normalize)
            if ch.timings is not None:
                timings.append(ch.timings)
    finally:
        job.abort_rest()
    if any(v is None for v in vectors):
        return None
    return Embedded(vectors, sum(len(p) for p in prompts), timings)  # type: ignore[arg-type]


def encode_vector(v: torch.Tensor, encoding_format: str) -> list[float] | str:
    """OpenAI's ``encoding_format``: a list of floats, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(v.contiguous().numpy().astype("<f4").tobytes()).decode("ascii")
    return v.tolist()
