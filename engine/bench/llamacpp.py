"""The llama.cpp baseline (``--vs llama.cpp``): llama.cpp's CPU eval of the same weights.

The row's checkpoint is exported to GGUF (:mod:`llmsys.engine.bench.gguf_export`, cached) at the row's
bit width (float32 -> f32, bf16/f16 -> f16, int8 -> q8_0, int4 -> q4_0) or as ``--vs llama.cpp:FORMAT``.
llama-cpp-python's ``Llama`` then runs what :class:`~llmsys.engine.bench.baseline.HFBaseline` runs: KV
cleared, a timed prompt eval of the same random ids, ``n_gen`` timed one-token evals (argmax outside the
timer), the row's threads, ``n_gpu_layers=0``; its thin per-call Python layer is timed, as our scheduler
step is. One sequence only in ``llmsys bench`` rows (a row with ``-b`` > 1 errors); :meth:`LlamaCppBaseline.run_batched`
decodes several together through llama.cpp's batch API, for benchmarks/bench_vs_llamacpp.py's aggregate rows.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from llmsys.engine.bench.gguf_export import GGUF_FORMATS, gguf_file, import_llama_cpp
from llmsys.engine.bench.measure import RunTimes, TestResult, TestSpec, _random_ids, summarize
from llmsys.kernels.common.errors import InvalidParameterError

NAME = "llama.cpp"
_BY_QUANT = {"int8": "q8_0", "int4": "q4_0"}
_BY_DTYPE = {torch.float32: "f32", torch.bfloat16: "f16", torch.float16: "f16"}


def split_kind(kind: str) -> tuple[str, str | None]:
    """``"llama.cpp:q4_K_M"`` -> ``("llama.cpp", "q4_K_M")``; ``"llama.cpp"`` -> ``("llama.cpp", None)``."""
    name, _, fmt = kind.partition(":")
    if name != NAME:
        raise InvalidParameterError(f"--vs {kind!r} is not a llama.cpp baseline")
    if fmt and fmt not in GGUF_FORMATS:
        raise InvalidParameterError(f"--vs {kind!r}: the llama.cpp format is one of {', '.join(GGUF_FORMATS)}")
    return name, fmt or None


def paired_format(dtype: torch.dtype, quant: str, asked: str | None = None) -> str:
    """The GGUF format of the same bit width as our row's weights (or the one asked for)."""
    if asked:
        return asked
    if quant in ("none", "auto"):
        if dtype not in _BY_DTYPE:
            raise InvalidParameterError(f"--vs llama.cpp: no GGUF format pairs with dtype {dtype}")
        return _BY_DTYPE[dtype]
    if quant not in _BY_QUANT:
        raise InvalidParameterError(
            f"--vs llama.cpp: no GGUF format pairs with --quant {quant}; name one as --vs llama.cpp:q4_K_M "
            f"(formats: {', '.join(GGUF_FORMATS)})"
        )
    return _BY_QUANT[quant]


def prepare(folder: str | Path, dtype: torch.dtype, quant: str, kind: str = NAME) -> tuple[Path, str]:
    """(the cached GGUF to run, its format) for a row of ``dtype`` / ``quant``; writes it if missing.

    A model that is itself a GGUF file (or an Ollama blob) is the baseline's file as it is: both engines
    run the same bytes (``llama.cpp:FORMAT`` cannot ask for another format of it)."""
    from llmsys.engine.loader.gguf_io import is_gguf

    import_llama_cpp()  # fail with the install hint before spending time on an export
    if is_gguf(Path(folder)):
        asked = split_kind(kind)[1]
        if asked:
            raise InvalidParameterError(f"--vs {kind}: {folder} is a GGUF file, run as it is; use --vs {NAME}")
        return Path(folder), "gguf"
    fmt = paired_format(dtype, quant, split_kind(kind)[1])
    return gguf_file(folder, fmt), fmt


class LlamaCppBaseline:
    """A llama.cpp context on one GGUF file plus the same timing loop as HFBaseline."""

    def __init__(self, gguf_path: Path, fmt: str, n_ctx: int, n_batch: int):
        llama_cpp = import_llama_cpp()
        self.kind = NAME
        self.format = fmt
        self._lib = llama_cpp
        threads = torch.get_num_threads()
        self.model = llama_cpp.Llama(
            model_path=str(gguf_path),
            n_ctx=n_ctx,
            n_batch=max(n_batch, 1),
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=0,
            logits_all=False,
            verbose=False,
        )
        self.vocab = self.model.n_vocab()
        self._batched: tuple[tuple[int, int], object] | None = None  # ((sequences, length), context): run_batched

    def close(self) -> None:
        if self._batched is not None:
            self._lib.llama_free(self._batched[1])
            self._batched = None
        if self.model is not None:
            self.model.close()
        self.model = None

    def _argmax(self) -> int:
        """Greedy token from the last evaluated position's logits (untimed)."""
        ptr = self._lib.llama_get_logits_ith(self.model.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax())

    def run(self, test: TestSpec, batch: int, gen: torch.Generator) -> RunTimes:
        if batch != 1:
            raise InvalidParameterError(f"--vs llama.cpp runs one sequence; this row has batch {batch}")
        times = RunTimes()
        self.model.reset()  # n_tokens = 0: the next eval drops every cached position first
        nxt = None
        if test.depth:
            self.model.eval(_random_ids(test.depth, self.vocab, gen))
            nxt = self._argmax()
        if test.n_prompt:
            x = _random_ids(test.n_prompt, self.vocab, gen)
            t0 = time.perf_counter()
            self.model.eval(x)
            times.prefill_s = time.perf_counter() - t0
            nxt = self._argmax()
        elif nxt is None:
            nxt = _random_ids(1, self.vocab, gen)[0]
        for _ in range(test.n_gen):
            t0 = time.perf_counter()
            self.model.eval([nxt])
            times.decode_steps.append(time.perf_counter() - t0)
            nxt = self._argmax()
        return times

    def _batched_ctx(self, batch: int, per_seq: int):
        """A second llama.cpp context on the same weights with room for ``batch`` sequences of ``per_seq`` positions
        each (``Llama`` makes its own for one sequence); made once per (batch, length)."""
        if self._batched is not None and self._batched[0] == (batch, per_seq):
            return self._batched[1]
        if self._batched is not None:
            self._lib.llama_free(self._batched[1])
            self._batched = None
        params = self._lib.llama_context_default_params()
        params.n_ctx = batch * -(-per_seq // 256) * 256  # llama.cpp pads a context to 256 and splits it evenly
        params.n_batch = params.n_ubatch = max(512, batch)
        params.n_seq_max = batch
        params.n_threads = params.n_threads_batch = torch.get_num_threads()
        ctx = self._lib.llama_init_from_model(self.model._model.model, params)
        if not ctx:
            raise InvalidParameterError(f"llama.cpp could not make a context for {batch} sequences of {per_seq} tokens")
        self._batched = ((batch, per_seq), ctx)
        return ctx

    def run_batched(self, test: TestSpec, batch: int, gen: torch.Generator) -> RunTimes:
        """``batch`` sequences decoding together, as our scheduler runs them: random prompts of ``n_prompt`` ids
        evaluated (timed together as the prefill), then ``n_gen`` steps each evaluating one new token of every
        sequence in one ``llama_decode`` call (argmax of each outside the timer). No ``depth``."""
        prompts = [_random_ids(test.n_prompt, self.vocab, gen) for _ in range(batch)]
        return self.decode_batched(prompts, test.n_gen)[0]

    def decode_batched(self, prompts: list[list[int]], n_gen: int) -> tuple[RunTimes, list[list[int]]]:
        """(times, each sequence's ``n_gen`` greedy tokens) of the prompts (all of one length) decoding together:
        as :meth:`run`, ``n_gen`` timed steps, each evaluating the token the one before picked."""
        lib = self._lib
        batch, n_prompt = len(prompts), len(prompts[0])
        if any(len(ids) != n_prompt for ids in prompts) or not n_prompt:
            raise InvalidParameterError("decode_batched: the prompts must be of one length, at least 1")
        ctx = self._batched_ctx(batch, n_prompt + n_gen + 16)
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        cap = max(512, batch)
        tokens = lib.llama_batch_init(cap, 0, 1)
        times = RunTimes()
        out: list[list[int]] = [[] for _ in range(batch)]

        def decode(items: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
            for i, (tok, pos, seq, want) in enumerate(items):
                tokens.token[i], tokens.pos[i], tokens.n_seq_id[i] = tok, pos, 1
                tokens.seq_id[i][0], tokens.logits[i] = seq, want
            tokens.n_tokens = len(items)
            rc = lib.llama_decode(ctx, tokens)
            if rc != 0:
                raise InvalidParameterError(f"llama.cpp's llama_decode returned {rc} for {len(items)} tokens")

        def argmax(i: int) -> int:
            return int(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(self.vocab,)).argmax())

        try:
            items = [(tok, p, s, p == n_prompt - 1) for s, ids in enumerate(prompts) for p, tok in enumerate(ids)]
            nxt: list[int] = []
            t0 = time.perf_counter()
            for start in range(0, len(items), cap):
                chunk = items[start:start + cap]
                decode(chunk)
                lib.llama_synchronize(ctx)
                times.prefill_s += time.perf_counter() - t0
                nxt += [argmax(i) for i, it in enumerate(chunk) if it[3]]  # untimed
                t0 = time.perf_counter()
            for step in range(n_gen):
                for s, tok in enumerate(nxt):
                    out[s].append(tok)
                t0 = time.perf_counter()
                decode([(tok, n_prompt + step, s, True) for s, tok in enumerate(nxt)])
                lib.llama_synchronize(ctx)
                times.decode_steps.append(time.perf_counter() - t0)
                nxt = [argmax(i) for i in range(batch)]
        finally:
            lib.llama_batch_free(tokens)
        return times, out

    def measure(self, test: TestSpec, batch: int, reps: int, seed: int = 0, warmup: bool = True) -> TestResult:
        if batch != 1:
            raise InvalidParameterError(f"--vs llama.cpp runs one sequence; this row has batch {batch}")
        threads = torch.get_num_threads()  # the row's threads (the suite sets them per row)
        self._lib.llama_set_n_threads(self.model.ctx, threads, threads)
        gen = torch.Generator().manual_seed(seed)
        if warmup:
            self.run(test, batch, gen)
        return summarize(test, batch, [self.run(test, batch, gen) for _ in range(reps)])
