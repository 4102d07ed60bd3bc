"""A request's tokens and logprobs are the bits it gets alone, whatever runs beside it (the README's promise).

At the default dtype (bfloat16 where the CPU has it) and float32, on a dense model (stories260k, whose
small float32 weights take the C GEMV) and a quantized GGUF (SmolLM2-135M-Instruct Q4_1): batched with
other prompts, with and without prefix caching, after prefix-cache hits, with prefill chunked at 24 tokens,
and under a pool small enough to preempt and recompute. Before prompt attention ran by rows and bf16 /
small float32 weights took one GEMV for every row count, 5 of 16 bf16 stories260k requests differed
batched and all 16 chunked (float32: logprobs of all 16).
"""

from __future__ import annotations

import random

import pytest

from llmsys import LLM, SamplingParams

SMOLLM2 = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def _prompts(vocab: int, n_shared: int, n_other: int) -> list[list[int]]:
    """Prompts sharing a 40-token prefix (prefix-cache hits) and unrelated ones of 5-90 tokens."""
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = [shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n_shared)]
    return out + [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))] for _ in range(n_other)]


def _sig(o) -> tuple[list[int], list[float]]:
    return o.token_ids, [lp.logprob for lp in o.logprobs]


def _check(path: str, dtype: str, n_shared: int, n_other: int, max_tokens: int) -> None:
    def llm(**kw) -> LLM:
        return LLM(path, dtype=dtype, progress=False, **{"kv_cache_tokens": 4096, **kw})

    base = llm(prefix_caching=False)
    prompts = _prompts(min(base.tokenizer.vocab_size, 30000), n_shared, n_other)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    alone = [_sig(base.generate([p], sp)[0]) for p in prompts]
    cached = llm()
    runs = {
        "batched": [_sig(o) for o in base.generate(prompts, sp)],
        "batched, prefix cache": [_sig(o) for o in llm().generate(prompts, sp)],
        "one by one, prefix hits": [_sig(cached.generate([p], sp)[0]) for p in prompts],
        "prefill chunks of 24": [_sig(o) for o in llm(prefix_caching=False, max_num_batched_tokens=24)
                                 .generate(prompts, sp)],
        "preempted": [_sig(o) for o in llm(kv_cache_tokens=192, block_size=8).generate(prompts, sp)],
    }
    for name, outs in runs.items():
        differ = [i for i, (a, b) in enumerate(zip(alone, outs)) if a != b]
        assert not differ, f"{name}: requests {differ} differ from the same request alone"


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_dense_model_answers_do_not_depend_on_the_batch_or_the_cache(dtype):
    from conftest import STORIES_HF, need_shared

    need_shared(STORIES_HF)
    _check(str(STORIES_HF), dtype, 6, 10, 20)


def test_quantized_gguf_answers_do_not_depend_on_the_batch_or_the_cache():
    from conftest import SHARED, need_shared

    path = need_shared(SHARED / "models" / SMOLLM2)
    _check(str(path), "auto", 3, 4, 8)


def test_a_prefix_cache_hit_gives_the_fresh_servers_chat_answer():
    """The sequence the issue found on a server: after a chat whose system prompt a second one shares (a
    16-token prefix-cache hit), the second chat's answer, twice, equals a fresh engine's."""
    from conftest import SHARED, need_shared

    path = str(need_shared(SHARED / "models" / SMOLLM2))
    sp = SamplingParams(temperature=0, max_tokens=25)
    warm = LLM(path, progress=False)
    warm.chat([{"role": "user", "content": "Lily and Ben went to the park"}], sp)
    msgs = [{"role": "user", "content": "Sam liked to eat"}]
    second, third = warm.chat(msgs, sp), warm.chat(msgs, sp)
    assert second.usage.cached_tokens >= 16 and third.usage.cached_tokens >= 16
    fresh = LLM(path, progress=False, prefix_caching=False).chat(msgs, sp)
    assert second.token_ids == third.token_ids == fresh.token_ids
