"""The public facade: ``LLM(model).generate / stream / chat``.

It resolves the model (path or catalog name), loads weights and tokenizer,
sizes the KV pool, and drives an :class:`EngineCore` on the calling thread.
Long-running front ends (server, TUI) own an engine thread instead and call
the core directly; this class is the simple, synchronous way in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import psutil
import torch

from llmsys.engine.config import EngineConfig
from llmsys.engine.core import EngineCore, MemoryReport
from llmsys.engine.errors import InvalidParameterError
from llmsys.engine.kv_cache import KVCacheSpec, blocks_needed
from llmsys.engine.loader import LoadedModel, load_model
from llmsys.engine.outputs import RequestOutput, StreamChunk, Timings, Usage
from llmsys.engine.sampling import SamplingParams
from llmsys.engine.tokenizer import Tokenizer

Prompt = str | list[int]


def _resolve_path(model: str) -> Path:
    p = Path(model).expanduser()
    if p.exists():
        return p
    from llmsys.engine.catalog import resolve_model

    return resolve_model(model)


def size_kv_pool(loaded: LoadedModel, config: EngineConfig) -> tuple[KVCacheSpec, int]:
    """Choose the KV pool size and the per-request context limit.

    The context limit is the model's trained context (or ``max_model_len``).
    The pool holds ``kv_cache_tokens`` tokens when given; otherwise enough for
    ``max_num_seqs`` full contexts, capped at a quarter of the memory free now
    (never less than one full context).
    """
    a = loaded.args
    max_len = min(config.max_model_len or a.max_position_embeddings, getattr(a, "max_context", 1 << 30))
    if max_len < 2:
        raise InvalidParameterError(f"max_model_len must be >= 2, got {max_len}")
    probe = KVCacheSpec(a.num_hidden_layers, 1, 1, a.num_key_value_heads, a.head_dim, loaded.dtype)
    per_tok = probe.bytes_per_token
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
        max_len = min(max_len, tokens)
    else:
        if loaded.device.type == "cuda":
            free = torch.cuda.mem_get_info(loaded.device)[0]
        else:
            free = psutil.virtual_memory().available
        cap = max(free // 4 // per_tok, 1)
        tokens = max(min(max_len * config.max_num_seqs, cap), min(max_len, cap))
        max_len = min(max_len, tokens)
    bs = config.block_size
    num_blocks = blocks_needed(tokens, bs) + 1  # + the reserved scratch block
    spec = KVCacheSpec(a.num_hidden_layers, num_blocks, bs, a.num_key_value_heads, a.head_dim, loaded.dtype)
    return spec, max_len


class LLM:
    """Load a model once; generate from many prompts, batched."""

    def __init__(self, model: str | EngineConfig, **kwargs: Any):
        config = model if isinstance(model, EngineConfig) else EngineConfig(model=str(model), **kwargs)
        if isinstance(model, EngineConfig) and kwargs:
            config = config.with_(**kwargs)
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        path = _resolve_path(config.model)
        self.loaded = load_model(path, dtype=config.dtype, device=config.device, progress=config.progress)
        self.tokenizer = Tokenizer.load(self.loaded.tokenizer_path)
        spec, max_len = size_kv_pool(self.loaded, config)
        self.core = EngineCore(self.loaded, self.tokenizer, config, spec, max_len)

    # -- properties ----------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.core.max_len

    def memory_report(self) -> MemoryReport:
        return self.core.memory_report()

    # -- prompts -------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise InvalidParameterError("a prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    # -- generation ----------------------------------------------------------
    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in input order."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        plist: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(plist)
        else:
            params_list = list(params)
            if len(params_list) != len(plist):
                raise InvalidParameterError(f"{len(plist)} prompts but {len(params_list)} SamplingParams")
        encoded = [self.encode(p) for p in plist]
        ids = []
        try:
            for toks, sp in zip(encoded, params_list):
                ids.append(self.core.add_request(toks, sp))
        except BaseException:
            for rid in ids:
                self.core.abort(rid)
            self.core.step()
            raise
        results: dict[str, dict[str, Any]] = {rid: {"text": [], "tokens": [], "lps": []} for rid in ids}
        try:
            while len([r for r in results.values() if "final" not in r]):
                for ch in self.core.step():
                    r = results.get(ch.request_id)
                    if r is None:
                        continue
                    r["text"].append(ch.text)
                    r["tokens"].extend(ch.token_ids)
                    r["lps"].extend(ch.logprobs)
                    if ch.finished:
                        r["final"] = ch
        except BaseException:
            for rid in ids:
                self.core.abort(rid)
            self.core.step()
            raise
        outs = []
        for rid, prompt, toks in zip(ids, plist, encoded):
            r = results[rid]
            fin: StreamChunk = r["final"]
            outs.append(
                RequestOutput(
                    request_id=rid,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=toks,
                    text="".join(r["text"]),
                    token_ids=r["tokens"],
                    finish_reason=fin.finish_reason or "stop",
                    usage=fin.usage or Usage(len(toks), len(r["tokens"])),
                    timings=fin.timings or Timings(),
                    logprobs=r["lps"],
                )
            )
        return outs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield chunks for one prompt as they are produced.

        Closing the iterator early (``break``, Ctrl+C) aborts the request and
        frees its KV blocks.
        """
        rid = self.core.add_request(self.encode(prompt), params or SamplingParams())
        done = False
        try:
            while not done:
                for ch in self.core.step():
                    if ch.request_id == rid:
                        done = ch.finished
                        yield ch
        finally:
            if not done:
                self.core.abort(rid)
                self.core.step()

    def chat(
        self, messages: list[dict[str, Any]], params: SamplingParams | None = None
    ) -> RequestOutput:
        """Apply the model's chat template and generate the assistant's reply."""
        ids = self.tokenizer.encode_chat(messages)
        return self.generate([ids], params)[0]

    def chat_prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode_chat(messages)


def _debug() -> bool:
    return os.environ.get("LLMSYS_DEBUG") == "1"
