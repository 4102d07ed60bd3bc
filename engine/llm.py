"""The public facade: ``LLM(model).generate / stream / chat``.

It builds the engine (``llmsys.engine.builder``: resolve the model, plan
placement, load, prepare, size the KV pool) and drives an
:class:`EngineCore` on the calling thread.
Long-running front ends (server, TUI) own an engine thread instead and call
the core directly; this class is the simple, synchronous way in.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from dataclasses import replace
from typing import Any, Iterator, Sequence

import torch

from llmsys.engine.builder import Placement, place, prepare, resolve, size_kv_pool
from llmsys.engine.config import EngineConfig
from llmsys.engine.core import EngineCore, MemoryReport
from llmsys.engine.embedding import EmbeddingOutput, Pooling, fit_context, read_pooling
from llmsys.kernels.common.errors import InvalidParameterError, LLMSysError
from llmsys.kernels.common.memory import release_free_heap
from llmsys.engine.loader.common import materialize_checkpoint, open_checkpoint
from llmsys.engine.loader.detect import ModelFormat, detect_model
from llmsys.engine.loader.llama2c import load as llama2c_load
from llmsys.engine.outputs import RequestOutput, StreamChunk, Timings, Usage
from llmsys.engine.quantize import loader_quantizer
from llmsys.engine.kv_cache import KVCacheSpec
from llmsys.engine.sampling import SamplingParams
from llmsys.engine.speculative import DraftProposer, NgramProposer, Proposer, check_same_vocabulary
from llmsys.engine.tokenizer import Tokenizer
from llmsys.kernels import cpu_kernels
from llmsys.kernels.common.cpus import choose_threads

Prompt = str | list[int]
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class LLM:
    """Load a model once; generate from many prompts, batched."""

    def __init__(self, model: str | EngineConfig, **kwargs: Any):
        config = model if isinstance(model, EngineConfig) else EngineConfig(model=str(model), **kwargs)
        if isinstance(model, EngineConfig) and kwargs:
            config = config.with_(**kwargs)
        # Before the load, so quantizing at load uses them too, and while this process is idle, so the
        # busy-core sample sees only other programs (kernels.common.cpus says why not torch's default).
        self.threads = choose_threads(config.threads)
        torch.set_num_threads(self.threads.threads)
        if os.environ.get("LLMSYS_DEBUG") == "1":
            print(f"debug: threads {self.threads.threads} ({self.threads.reason})", file=sys.stderr)
        # The steps of llmsys.engine.builder, in order (each a value the next one takes).
        r = resolve(config)
        make_linear = loader_quantizer(config)
        src = detect_model(r.path)  # the format, once; a GGUF's header parsed once for the model and the tokenizer
        if src.format is ModelFormat.LLAMA2C:
            self.loaded = llama2c_load(r.path, r.dtype, r.device, make_linear, config.progress)
            placement = Placement(None, None, None)
        else:
            ck = open_checkpoint(src, r.dtype, r.device)
            # Offloading (llmsys.offload): budgets -> plan -> runtime, on the meta model before any
            # weight is read. Stored-quantized checkpoints are always resident (no plan).
            placement = Placement(None, None, None) if ck.prequantized else place(r, ck)
            self.loaded = materialize_checkpoint(ck, make_linear, config.progress, placement.runtime)
        self.plan = placement.plan  # data the TUI and bench show
        self.offload = placement.runtime
        if self.offload is not None:
            weakref.finalize(self, self.offload.close)
        if self.loaded.device.type == "cpu":
            _report_cpu_kernels()
        if config.progress:
            for line in self.loaded.notices:  # what the load left out (a multimodal checkpoint's image part)
                print(f"notice: {r.path.name}: {line}", file=sys.stderr)
        formats = self.loaded.stored_formats
        if config.progress and any(v.startswith("dequantized to") for v in formats.values()):
            # Block formats without an exact llmsys layout take more memory than on disk: say so once, and how
            # to halve it (int8:g32 re-quantizes only those matrices; the kept codes stay as they are).
            said = "; ".join(f"{k} -> {v}" for k, v in formats.items())
            print(f"notice: {r.path.name}: {said} (--quant int8:g32 stores the dequantized matrices in half "
                  "the memory)", file=sys.stderr)
        release_free_heap()  # the load's temporaries, before prepare's fused copies add to the peak
        prepare(self.loaded, config, self.offload)
        # Loading (quantizing at load most of all: every float weight is replaced) leaves tensors the model no
        # longer holds in reference cycles, alive until the cyclic collector next runs: a bf16 SmolLM2-135M
        # quantized to int8 kept ~450 MiB of them (RSS 870 -> 418 MiB once collected). Collect once, before
        # the KV pool is sized from what is free.
        gc.collect()
        release_free_heap()  # and what the load freed goes back to the system, not kept by the C heap
        if placement.kv_cache_tokens is not None:  # the pool size the explicit budget allows
            config = config.with_(kv_cache_tokens=placement.kv_cache_tokens)
        self.config = config
        self.tokenizer = Tokenizer.load(self.loaded.tokenizer_path, gguf_header=src.gguf_header,
                                        chat_template=config.chat_template)
        # How an embedding pools the final hidden states, as the model's files say (llmsys.engine.embedding).
        self.pooling: Pooling = read_pooling(self.loaded.path, src.gguf_header.fields if src.gguf_header else None)
        spec, max_len = size_kv_pool(self.loaded, config)
        # The draft model of speculative decoding: an engine of its own, resident (None: no draft model).
        self.draft: LLM | None = self._draft(config, spec, max_len)
        self.core = EngineCore(self.loaded, self.tokenizer, config, spec, max_len, offload=self.offload,
                               proposer=self._proposer(config))
        if self.offload is not None:
            self.offload.place_kv(self.core.kv)

    def _draft(self, config: EngineConfig, spec: KVCacheSpec, max_len: int) -> LLM | None:
        """Load the draft model ``--spec self:QUANT`` / ``--draft MODEL`` asks for: on the target's device
        and dtype, resident (no budgets: the target's offloading is what it is there to speed up), a
        KV pool as large as the target's plus the drafts, no prefix cache or swap space. Its context
        is its own: a sequence longer than the draft's positions decodes without drafts."""
        sp = config.spec
        if sp is None or not sp.needs_model:
            return None
        model = config.model if sp.kind == "self" else config.draft_model
        draft = LLM(EngineConfig(
            model=model, device=str(self.loaded.device), dtype=_DTYPE_NAMES[self.loaded.dtype],
            quant=sp.quant or "none", block_size=spec.block_size,
            kv_cache_tokens=(spec.num_blocks - 1) * spec.block_size + config.max_num_seqs * config.spec_tokens,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            threads=self.threads.threads, offload_dir=config.offload_dir, swap_space=0, prefix_caching=False,
            sliding_kv="full", progress=config.progress))  # DraftProposer feeds its runner block tables only
        probe = "Once upon a time, 12 + 30 = 42.\n<|im_start|> def f(x): return x"
        check_same_vocabulary(self.loaded.args.vocab_size, draft.loaded.args.vocab_size,
                              self.tokenizer.encode(probe), draft.tokenizer.encode(probe), model)
        return draft

    def _proposer(self, config: EngineConfig) -> Proposer | None:
        sp = config.spec
        if sp is None:
            return None
        if sp.kind == "ngram":
            return NgramProposer()
        name = f"self:{sp.quant}" if sp.kind == "self" else f"draft {config.draft_model}"
        return DraftProposer(self.draft.core, name)

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
        """Run every prompt to completion, batched together; outputs in input order.

        A prompt whose params ask for ``n`` completions gives ``n`` outputs in a
        row (``RequestOutput.index`` 0..n-1), all batched with the rest.
        """
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        plist: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(plist)
        else:
            params_list = list(params)
            if len(params_list) != len(plist):
                raise InvalidParameterError(f"{len(plist)} prompts but {len(params_list)} SamplingParams")
        encoded = [self.encode(p) for p in plist]
        ids: list[str] = []
        jobs: list[tuple[str, Prompt, list[int], int]] = []  # (request id, prompt, its ids, completion index)
        try:
            for prompt, toks, sp in zip(plist, encoded, params_list):
                for i in range(sp.n):
                    ids.append(self.core.add_request(toks, sp, sample_index=i))
                    jobs.append((ids[-1], prompt, toks, i))
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
        for rid, prompt, toks, index in jobs:
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
                    error=fin.error,
                    logprobs=r["lps"],
                    index=index,
                )
            )
        return outs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield chunks for one prompt as they are produced.

        Closing the iterator early (``break``, Ctrl+C) aborts the request and
        frees its KV blocks. One completion only: ``n`` > 1 is refused (use
        :meth:`generate`, or the server, whose chunks carry a choice index).
        """
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidParameterError(f"stream() yields one completion; n={params.n} needs generate()")
        rid = self.core.add_request(self.encode(prompt), params)
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
        """Apply the model's chat template and generate the assistant's reply (one: ``n`` > 1 is refused)."""
        if params is not None and params.n != 1:
            raise InvalidParameterError(f"chat() returns one reply; n={params.n} needs generate() on chat_prompt_ids()")
        ids = self.tokenizer.encode_chat(messages)
        return self.generate([ids], params)[0]

    def chat_prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    # -- embeddings ----------------------------------------------------------
    def embed(self, inputs: Prompt | Sequence[Prompt], truncate: bool = False,
              normalize: bool | None = None) -> list[EmbeddingOutput]:
        """One embedding per input (a text or token ids), in input order, all batched through the engine.

        Each input is prefilled without the LM head and its final hidden states pooled as the model says
        (:attr:`pooling`: last token for Qwen3-Embedding-style models, mean otherwise). ``normalize``: L2
        unit vectors (None: as the model says). An input longer than the context is refused (one
        line naming both lengths) unless ``truncate``, which keeps its first tokens.
        """
        single = isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int))
        items: list[Prompt] = [inputs] if single else list(inputs)  # type: ignore[list-item]
        if not items:
            raise InvalidParameterError("embed() needs at least one input")
        pooling = self.pooling if normalize is None else replace(self.pooling, normalize=normalize)
        pooling.check()
        encoded = [self.encode(x) for x in items]
        fitted = [fit_context(ids, self.max_model_len, truncate) for ids in encoded]
        ids: list[str] = []
        done: dict[str, StreamChunk] = {}
        try:
            for toks in fitted:
                ids.append(self.core.add_request(toks, SamplingParams(max_tokens=1), pooling=pooling))
            while len(done) < len(ids):
                for ch in self.core.step():
                    if ch.finished:
                        done[ch.request_id] = ch
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.core.abort(rid)
            self.core.step()
            raise
        outs = []
        for rid, toks, full in zip(ids, fitted, encoded):
            ch = done[rid]
            if ch.embedding is None:
                raise LLMSysError(f"embedding input {len(outs)} failed: {ch.error or ch.finish_reason}")
            outs.append(EmbeddingOutput(ch.embedding, len(toks), truncated=len(toks) < len(full)))
        return outs


def _report_cpu_kernels() -> None:
    """Load the CPU C kernels now (an editable install compiles them here, not in the first
    request); say so in one line when some are missing (the torch paths run, slower), and with
    ``LLMSYS_DEBUG=1`` print the ISA level and every kernel's status."""
    report = cpu_kernels()
    missing = [f"{name}: {status}" for name, status in report.kernels.items() if not status.startswith("ok:")]
    if os.environ.get("LLMSYS_DEBUG") == "1":
        print(f"debug: {report.summary()}", file=sys.stderr)
    elif missing:
        print(f"notice: C kernels unavailable ({missing[0]}); the torch paths run instead (same answers, "
              "slower; `pip install .` builds them, or install gcc)", file=sys.stderr)
