"""Timing one test (pp / tg / pg, optionally after a depth) on a loaded engine.

Like llama-bench, the throughput figures time only the engine's model steps:
the scheduler decision, tensor preparation and the forward pass (up to the
logits). Tokenization, sampling and detokenization are left out - the next
token is the logits' argmax, taken outside the timer. What a user sees end to
end (``LLM.generate`` on a text prompt: tokenize, sample, detokenize) is
measured separately by :func:`measure_e2e`.

The sequences go through the real scheduler and runner of the engine's
:class:`~llmsys.engine.core.EngineCore`, so paged KV allocation, chunked
prefill and batching are the ones serving uses.
"""

from __future__ import annotations

import dataclasses

import statistics
import time
from dataclasses import dataclass, field

import torch

from llmsys.engine.sampling import SamplingParams
from llmsys.engine.sequence import Sequence


@dataclass(frozen=True)
class TestSpec:
    """One llama-bench test: ``pp512``, ``tg128``, ``pg512,128`` (``@ d4096``)."""

    __test__ = False  # not a pytest class, despite the name

    n_prompt: int
    n_gen: int
    depth: int = 0

    @property
    def kind(self) -> str:
        if self.n_prompt and self.n_gen:
            return "pg"
        return "pp" if self.n_prompt else "tg"

    @property
    def name(self) -> str:
        base = {"pp": f"pp{self.n_prompt}", "tg": f"tg{self.n_gen}", "pg": f"pg{self.n_prompt},{self.n_gen}"}[self.kind]
        return f"{base} @ d{self.depth}" if self.depth else base

    @property
    def context(self) -> int:
        """Tokens a sequence holds at the end (KV and context limit)."""
        return self.depth + max(self.n_prompt, 1) + self.n_gen

    @property
    def tokens_needed(self) -> int:
        """Context one run of this test fills, at most: the depth, the prompt (at least the one token
        tg starts from), the generated tokens (at least the one sampled after a prompt) and the BOS
        token the end-to-end text prompt gets. A context below this cannot run the test."""
        return self.depth + max(self.n_prompt, 1) + max(self.n_gen, 1) + 1

    @property
    def sized_by(self) -> str:
        """The flags that set this test's length (for a fix hint)."""
        flags = {"pp": "-p", "tg": "-n", "pg": "--pg"}[self.kind]
        return f"{flags}/-d" if self.depth else flags


@dataclass
class RunTimes:
    """Step times of one repetition (seconds)."""

    prefill_s: float = 0.0  # timed prompt steps (pp / pg); 0 for tg
    decode_steps: list[float] = field(default_factory=list)  # one per generated token per sequence

    @property
    def total_s(self) -> float:
        return self.prefill_s + sum(self.decode_steps)


@dataclass(frozen=True)
class TestResult:
    tok_s_mean: float
    tok_s_std: float
    ttft_ms: float | None  # prompt phase to first logits (pp / pg)
    itl_p50_ms: float | None  # decode step time percentiles (tg / pg)
    itl_p99_ms: float | None
    reps: int
    samples: list[float]  # tok/s of each timed repetition


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_ids(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    # Skip the first ids (specials in most vocabularies).
    lo = min(16, vocab - 1)
    return torch.randint(lo, vocab, (n,), generator=gen).tolist()


class StepDriver:
    """Runs batches of sequences through a core's scheduler + runner, greedily.

    ``verify``: every decode step also feeds that many random drafts per sequence (the cost of a
    speculative verification step; each sequence keeps only its own next token, the drafts' blocks
    are trimmed), so decode step times compare with ``verify=0``'s on the same context."""

    def __init__(self, core, verify: int = 0):
        self.core = core
        self.verify = verify
        self.device = core.loaded.device
        self.vocab = core.loaded.args.vocab_size
        self._params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
        self._n = 0

    def _step(self) -> tuple[float, int]:
        """One engine step; returns (seconds, sequences that sampled)."""
        sched = self.core.scheduler
        _sync(self.device)
        drafts = None
        if self.verify:  # drafted before the clock starts: the proposer is not the model's cost
            g = torch.Generator().manual_seed(len(sched.running))
            drafts = {s.request_id: _random_ids(self.verify, self.vocab, g) for s in sched.running
                      if s.num_computed == s.num_tokens - 1}
        t0 = time.perf_counter()
        out = sched.schedule(drafts)
        if out.empty:
            raise RuntimeError("bench: the scheduler had nothing to run (KV pool too small?)")
        res = self.core.forward(out)
        _sync(self.device)
        dt = time.perf_counter() - t0
        if res.sample_ids:
            rows = res.sample_rows or [1] * len(res.sample_ids)
            first = [sum(rows[:i]) for i in range(len(rows))]  # each sequence's own next-token row
            toks = res.logits[first].argmax(dim=-1).tolist()  # untimed: sampling is not the model's cost
            seqs = [sched.requests[rid] for rid in res.sample_ids]
            sched.append_tokens(seqs, toks)
            for s, n in zip(seqs, rows):
                if n > 1:
                    sched.trim_drafts(s)
        return dt, len(res.sample_ids)

    def _run_until_sampled(self, seqs: list[Sequence]) -> float:
        """Steps until every sequence has sampled once; returns the time."""
        total = 0.0
        want = {id(s): len(s.output_ids) + 1 for s in seqs}
        while any(len(s.output_ids) < want[id(s)] for s in seqs):
            dt, _ = self._step()
            total += dt
        return total

    def run(self, test: TestSpec, batch: int, gen: torch.Generator) -> RunTimes:
        """One repetition of ``test`` for ``batch`` sequences."""
        sched = self.core.scheduler
        policy = self.core.kv_policy  # KV eviction runtime (every core has one)
        # As EngineCore.add_request: evicting policies slide past the context limit.
        evicts = policy.policy.evicts
        max_len = self.core.max_len + (test.context if evicts else 0)
        seqs = []
        for _ in range(batch):
            self._n += 1
            seqs.append(Sequence(f"bench-{self._n}", [], self._params, max_len, kv=policy.new_state()))
        times = RunTimes()
        try:
            if test.depth:  # untimed context; its last step samples the token tg continues from
                for s in seqs:
                    s.prompt_ids = _random_ids(test.depth, self.vocab, gen)
                    sched.add(s)
                self._run_until_sampled(seqs)
                for s in seqs:  # pp continues with exactly n_prompt new tokens; tg from the sampled one
                    s.prompt_ids, s.output_ids = s.prompt_ids + ([] if test.n_prompt else s.output_ids), []
            if test.n_prompt:
                for s in seqs:
                    s.prompt_ids = s.prompt_ids + _random_ids(test.n_prompt, self.vocab, gen)
                    if not test.depth:
                        sched.add(s)
                times.prefill_s = self._run_until_sampled(seqs)
            elif not test.depth:
                for s in seqs:  # tg from an empty context: feed one token, as llama-bench does
                    s.prompt_ids = _random_ids(1, self.vocab, gen)
                    sched.add(s)
            # n_gen decode steps, one token per sequence each (pg: after the prompt).
            for _ in range(test.n_gen):
                dt, _ = self._step()
                times.decode_steps.append(dt)
        finally:
            for s in seqs:
                if not s.finished:
                    sched.finish(s, "length")
        return times


def tokens_processed(test: TestSpec, batch: int) -> int:
    return batch * (test.n_prompt + test.n_gen)


def summarize(test: TestSpec, batch: int, runs: list[RunTimes]) -> TestResult:
    n_tok = tokens_processed(test, batch)
    samples = [n_tok / r.total_s for r in runs if r.total_s > 0]
    steps = sorted(dt for r in runs for dt in r.decode_steps)
    ttft = statistics.fmean(r.prefill_s for r in runs) * 1000 if test.n_prompt else None
    return TestResult(
        tok_s_mean=statistics.fmean(samples) if samples else 0.0,
        tok_s_std=statistics.stdev(samples) if len(samples) > 1 else 0.0,
        ttft_ms=ttft,
        itl_p50_ms=_pct(steps, 50) * 1000 if steps else None,
        itl_p99_ms=_pct(steps, 99) * 1000 if steps else None,
        reps=len(samples),
        samples=samples,
    )


def _pct(sorted_vals: list[float], p: float) -> float:
    """Linear-interpolated percentile of an already sorted list."""
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    k = (len(sorted_vals) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def measure_test(core, test: TestSpec, batch: int, reps: int, seed: int = 0, warmup: bool = True) -> TestResult:
    """``reps`` timed repetitions (+ one untimed warm-up) of ``test``."""
    driver = StepDriver(core)
    gen = torch.Generator().manual_seed(seed)
    if warmup:
        driver.run(test, batch, gen)
    runs = [driver.run(test, batch, gen) for _ in range(reps)]
    return summarize(test, batch, runs)


@dataclass(frozen=True)
class E2EResult:
    tok_s: float  # generated tokens (or prompt tokens for pp) per wall second
    ttft_ms: float


def _text_of(tokenizer, ids: list[int], n: int) -> str | list[int]:
    """Text that encodes to at most ``n`` tokens, from random ids: decoded ids re-encode to more
    tokens where pieces merge differently (stories260k's 512-piece vocabulary: 512 ids -> 881), which
    would overflow the context a pp test was sized for. The ids themselves where their text encodes to
    nothing (a benchmark GGUF's placeholder pieces ``<tok_N>``)."""
    text = tokenizer.decode(ids)
    for _ in range(4):
        again = tokenizer.encode(text, add_special_tokens=False)
        if not again:
            return ids
        if len(again) <= n:
            return text
        text = tokenizer.decode(again[: max(1, 2 * n - len(again))])
    return text if len(tokenizer.encode(text, add_special_tokens=False)) <= n else ids


@dataclass(frozen=True)
class SpecFigures:
    """Speculative decoding on a tg test (``llmsys bench --spec``)."""

    verify_x: float  # median verification step (K drafts + 1 per sequence) over the median decode step
    tokens_per_step: float  # generated tokens per decode step and sequence (kept drafts + the model's own)
    tok_s: float  # LLM.generate with speculation, generated tokens per wall second
    plain_tok_s: float  # the same prompts without (spec_tokens=0)


SPEC_TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
             "friends. One day, she saw a big red ball under a tree. She ran to the ball and picked it up.")


def measure_spec(llm, test: TestSpec, batch: int, seed: int = 0) -> SpecFigures:
    """The engine's speculative decoding (its ``--spec`` / ``--draft``) on ``test`` (tg): the verify
    step's cost against a decode step at the same context (random drafts, ``StepDriver(verify=K)``),
    and end to end on a text the model is asked to repeat (a plain English story and its first
    words again: what a proposer can find depends on the text, and random tokens give none), with
    and without speculation, greedy."""
    k = llm.config.spec_tokens
    gen = torch.Generator().manual_seed(seed)
    steps = {}
    for v in (0, k):
        runs = [StepDriver(llm.core, verify=v).run(test, batch, gen) for _ in range(2)]
        steps[v] = _pct(sorted(dt for r in runs[1:] for dt in r.decode_steps), 50)
    n_gen = max(test.n_gen, 1)
    words = SPEC_TEXT.split()
    for n in range(len(words), 5, -1):  # as much of the story as the test's context leaves room for
        prompt = " ".join(words[:n]) + "\n\n" + " ".join(words[:6])
        if len(llm.tokenizer.encode(prompt)) + n_gen <= llm.max_model_len:
            break
    params = SamplingParams(max_tokens=n_gen, temperature=0.0, ignore_eos=True)
    figures = {}
    for spec_tokens in (0, None):
        p = dataclasses.replace(params, spec_tokens=spec_tokens)
        t0 = time.perf_counter()
        outs = llm.generate([prompt] * batch, p)
        figures[spec_tokens] = (sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0), outs)
    outs = figures[None][1]
    kept = sum(o.usage.accepted_draft_tokens for o in outs)
    # Decode steps per sequence: every token but the prefill's first and the kept drafts came from one.
    decode_steps = max(1, sum(len(o.token_ids) for o in outs) - kept - batch)
    return SpecFigures(verify_x=steps[k] / steps[0], tokens_per_step=(kept + decode_steps) / decode_steps,
                       tok_s=figures[None][0], plain_tok_s=figures[0][0])


def measure_e2e(llm, test: TestSpec, batch: int, seed: int = 0) -> E2EResult:
    """``LLM.generate`` on text prompts: tokenization, sampling, detokenization included.

    The prompt is random ids decoded to text (depth + prompt tokens); the
    figure is generated tokens per second of wall time (prompt tokens for a
    pp test, which generates one token), as a user of the API would see it.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = llm.loaded.args.vocab_size
    n_in = test.depth + max(test.n_prompt, 1)
    texts = [_text_of(llm.tokenizer, _random_ids(n_in, vocab, gen), n_in) for _ in range(batch)]
    params = SamplingParams(max_tokens=max(test.n_gen, 1), temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(texts, params)
    wall = time.perf_counter() - t0
    if test.n_gen:
        n = sum(len(o.token_ids) for o in outs)
    else:
        n = sum(len(o.prompt_token_ids) for o in outs)
    ttft = statistics.fmean(o.timings.ttft_s for o in outs) * 1000
    return E2EResult(tok_s=n / wall if wall > 0 else 0.0, ttft_ms=ttft)
