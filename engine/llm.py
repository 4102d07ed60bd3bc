"""The public facade: ``LLM(model).generate / stream / chat``.

It resolves the model (path or catalog name), loads weights and tokenizer,
sizes the KV pool, and drives an :class:`EngineCore` on the calling thread.
Long-running front ends (server, TUI) own an engine thread instead and call
the core directly; this class is the simple, synchronous way in.
"""

from __future__ import annotations

import os
import sys
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
from llmsys.kernels.cpu_report import cpu_kernels

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
    (never less than one full context). A cold tier (``kv_offload_tokens``)
    adds to what one request may hold: the context limit is then at most hot
    plus cold tokens.
    """
    a = loaded.args
    max_len = min(config.max_model_len or a.max_position_embeddings, getattr(a, "max_context", 1 << 30))
    if max_len < 2:
        raise InvalidParameterError(f"max_model_len must be >= 2, got {max_len}")
    from llmsys.engine.quantize import parse_kv_dtype

    kv_dtype = parse_kv_dtype(config.kv_dtype, a.head_dim)
    probe = KVCacheSpec(a.num_hidden_layers, 1, config.block_size, a.num_key_value_heads, a.head_dim, loaded.dtype,
                        kv_dtype)
    per_tok = probe.bytes_per_token
    cold = config.offload_tokens(per_tok)
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
        max_len = min(max_len, tokens + cold)
    else:
        if loaded.device.type == "cuda":
            free = torch.cuda.mem_get_info(loaded.device)[0]
        else:
            free = psutil.virtual_memory().available
        cap = max(free // 4 // per_tok, 1)
        tokens = max(min(max_len * config.max_num_seqs, cap), min(max_len, cap))
        max_len = min(max_len, tokens + cold)
    bs = config.block_size
    num_blocks = blocks_needed(tokens, bs) + 1  # + the reserved scratch block
    spec = KVCacheSpec(a.num_hidden_layers, num_blocks, bs, a.num_key_value_heads, a.head_dim, loaded.dtype, kv_dtype)
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
        # Offloading (llmsys.offload): budgets -> plan -> place. The plan is made
        # on the meta model before any weight is read; `self.plan` is data the
        # TUI and bench show. `_plan_offload` may set a KV size that fits the budget.
        self.plan = None
        self.offload = None
        self._kv_tokens = config.kv_cache_tokens
        from llmsys.engine.quantize import loader_quantizer

        self.loaded = load_model(path, dtype=config.dtype, device=config.device, progress=config.progress,
                                 offload=self._plan_offload, make_linear=loader_quantizer(config))
        if self.offload is not None:
            import weakref

            self.offload.install(self.loaded.model)
            self.loaded.model.offload_runtime = self.offload
            weakref.finalize(self, self.offload.close)
        if self.loaded.device.type == "cpu":
            _report_cpu_kernels()
            if (config.extra or {}).get("prepack", True):
                # Resident CPU weights in oneDNN's blocked layout: faster GEMV, same bits as
                # streamed layers (kernels.cpu_linear). Streamed layers hold no real weight
                # here (the offload runtime binds one per step), so they are skipped.
                self.loaded.model.prepack_linears()
                if self.offload is None:
                    # Decode steps of small float32 layers in fewer ops, same bits (DecoderModel.fold_rope).
                    self.loaded.model.fold_rope()
            else:
                # Tools that read or rewrite .weight (`llmsys quantize`): nothing is packed,
                # and no layer packs on the fly either.
                self.loaded.model.never_pack()
        if self._kv_tokens != config.kv_cache_tokens:
            config = self.config = config.with_(kv_cache_tokens=self._kv_tokens)
        self.tokenizer = Tokenizer.load(self.loaded.tokenizer_path)
        spec, max_len = size_kv_pool(self.loaded, config)
        self.core = EngineCore(self.loaded, self.tokenizer, config, spec, max_len)
        if self.offload is not None:
            self.offload.place_kv(self.core.kv)

    def _plan_offload(self, meta_model: Any, locate: Any) -> Any:
        """Plan placement for the meta model; return the runtime the loader needs (or None)."""
        from llmsys.engine.loader.common import resolve_device, resolve_dtype
        from llmsys.offload.budgets import resolve_budgets
        from llmsys.offload.plan import Workload
        from llmsys.offload.prepare import kv_bytes_per_token_layer, kv_tokens_within, make_runtime, plan_for, runtime_needed

        c = self.config
        a = meta_model.args
        dev = resolve_device(c.device)
        dt = resolve_dtype(c.dtype, dev)
        budgets = resolve_budgets(c.gpu_mem, c.cpu_mem, c.offload_dir, dev)
        per_tok = kv_bytes_per_token_layer(a, dt) * a.num_hidden_layers
        max_len = min(c.max_model_len or a.max_position_embeddings, getattr(a, "max_context", 1 << 30))
        tokens = c.kv_cache_tokens
        if tokens is None and (budgets.cpu_explicit or budgets.gpu_explicit):
            budget = budgets.gpu if budgets.gpu_explicit else budgets.cpu
            tokens = self._kv_tokens = kv_tokens_within(budget, per_tok, max_len * c.max_num_seqs, min(max_len, 512))
        if tokens is None:
            free = budgets.gpu if budgets.gpu is not None else budgets.cpu
            tokens = max(min(max_len * c.max_num_seqs, free // 4 // per_tok), min(max_len, 1))
        extra = c.extra or {}
        work = Workload(batch=int(extra.get("plan_batch", 1)), kv_tokens=tokens + c.block_size,
                        max_batched_tokens=c.max_num_batched_tokens, kv_cold_tokens=c.offload_tokens(per_tok))
        self.plan, _ = plan_for(meta_model, dt, budgets, work, c.quant, max_seqs=c.max_num_seqs,
                                force=extra.get("placement"))
        if not runtime_needed(self.plan, dev):
            return None
        # extra["keep_page_cache"]: let streamed pages stay in the page cache (benchmarks that
        # compare with Accelerate's memmaps, which keep them); the default drops them.
        self.offload = make_runtime(meta_model, locate, dt, dev, self.plan, c.quant,
                                    drop_cache=not extra.get("keep_page_cache", False))
        return self.offload

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
