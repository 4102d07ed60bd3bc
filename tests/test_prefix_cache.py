"""Automatic prefix caching: the allocator's references and cache, and exact reuse in the engine."""

from __future__ import annotations

import pytest

from conftest import STORIES_HF, need_shared

from llmsys import LLM, SamplingParams
from llmsys.kernels.common.errors import BudgetError
from llmsys.engine.kv_cache import BlockAllocator
from llmsys.engine.prefix_cache import block_key, extend_keys

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
STORY = "Once upon a time there was a little girl who loved to play in the park with her dog and her cat. One day"


def test_keys_chain_the_whole_prefix():
    a, b = [], []
    extend_keys(a, list(range(12)), 4, 3)
    extend_keys(b, [99] + list(range(1, 12)), 4, 3)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b))  # one different token changes every later key
    assert a[1] == block_key(a[0], [4, 5, 6, 7])


def test_allocator_shares_caches_and_evicts_oldest_first():
    al = BlockAllocator(6)  # blocks 1..5 usable
    t1 = al.allocate(3)
    keys = [b"k1", b"k2", b"k3"]
    for b, k in zip(t1, keys):
        al.register(b, k)
    hit = al.lookup([b"k1", b"k2", b"zz"])
    assert hit == t1[:2] and al.num_used == 3
    al.free(t1)  # first owner done: k1, k2 still referenced by the second
    assert al.num_used == 2 and al.num_cached == 1 and al.num_free == 3
    al.free(hit)
    assert al.num_used == 0 and al.num_cached == 3 and al.num_free == 5
    # Plain free blocks go before cached ones; then the tail of the freed table first.
    fresh = al.allocate(2)
    assert set(fresh).isdisjoint(t1) and al.num_cached == 3
    al.allocate(1)
    assert al.lookup([b"k1", b"k2", b"k3"]) == t1[:2]  # k3 (the tail) was evicted, k1/k2 survive
    assert al.num_cached == 0
    with pytest.raises(BudgetError):
        al.allocate(1)


def test_register_keeps_the_first_block_for_a_key():
    al = BlockAllocator(4)
    a, b = al.allocate(2)
    al.register(a, b"k")
    al.register(b, b"k")
    al.free([a, b])
    assert al.lookup([b"k"]) == [a]


@pytest.fixture(scope="module")
def stories_pair():
    path = need_shared(STORIES_HF)
    kw = dict(dtype="float32", progress=False, block_size=4, kv_cache_tokens=2048)
    return LLM(str(path), prefix_caching=False, **kw), LLM(str(path), prefix_caching=True, **kw)


def test_cached_prefix_gives_identical_tokens_and_reports_reuse(stories_pair):
    plain, cached = stories_pair
    prompts = [STORY, STORY, STORY + " the sun", "Once upon a time there was a little boy"]
    ref = [plain.generate([p], GREEDY)[0] for p in prompts]
    got = [cached.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    n = len(cached.encode(STORY))
    assert got[0].usage.cached_tokens == 0
    assert got[1].usage.cached_tokens == (n - 1) // 4 * 4  # all full blocks but the one holding the last token
    assert got[2].usage.cached_tokens >= got[1].usage.cached_tokens
    assert 0 < got[3].usage.cached_tokens < got[1].usage.cached_tokens  # shares "Once upon a time there was a little"
    assert all(o.usage.cached_tokens == 0 for o in ref)
    assert cached.core.allocator.num_used == 0 and cached.core.allocator.num_cached > 0


def test_sharers_in_one_batch_and_later_generated_blocks(stories_pair):
    plain, cached = stories_pair
    prompts = [STORY + " a bird", STORY + " a bird", STORY + " a frog", "Tom and Sue went to"]
    ref = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert [o.token_ids for o in cached.generate(prompts, GREEDY)] == ref
    # The prompt plus its own greedy continuation: generated blocks were registered too.
    first = cached.generate([STORY + " a bird"], GREEDY)[0]
    follow = cached.encode(STORY + " a bird") + first.token_ids[:20]  # token ids: no re-tokenization
    again = cached.generate([follow], GREEDY)[0]
    assert again.usage.cached_tokens > len(cached.encode(STORY + " a bird"))
    assert again.token_ids == plain.generate([follow], GREEDY)[0].token_ids


def test_preemption_and_eviction_under_a_tiny_pool_stay_exact(stories_pair):
    plain, _ = stories_pair
    path = plain.core.config.model
    prompts = [STORY + " a bird", STORY + " a frog", STORY, "The cat sat on the mat and"]
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    small = LLM(path, dtype="float32", progress=False, block_size=4, kv_cache_tokens=200, prefix_caching=True)
    for _ in range(2):  # the second round finds some prefixes cached, others evicted
        out = small.generate(prompts, sp)
        assert [o.token_ids for o in out] == ref
        assert small.core.allocator.num_used == 0
    assert small.core.swap is None or small.core.swap.num_used == 0


def test_eviction_policies_never_share_blocks(stories_pair):
    plain, _ = stories_pair
    sink = LLM(plain.core.config.model, dtype="float32", progress=False, block_size=4, kv_cache_tokens=2048,
               kv_policy="sink:4,window:60", prefix_caching=True)
    a, b = sink.generate([STORY, STORY], GREEDY)
    assert a.usage.cached_tokens == b.usage.cached_tokens == 0
    assert a.token_ids == b.token_ids
    assert sink.core.allocator.num_cached == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_one_token_remainder_keeps_the_prefill_attention(dtype):
    """A 17-token prompt on 16-token blocks hits 16 cached tokens and computes the last one alone.
    That token still takes the prefill attention (not the decode kernel). In bfloat16 torch's
    SDPA computes each query row alike whatever the row count, so the logprobs, not just the
    tokens, equal the uncached run's bit for bit; in float32 its row blocking moves the last
    bits (~3e-7 on one attention row), so there the tokens are equal and the logprobs close."""
    from llmsys.kernels.cpu_attention import make_gather_plan

    llm = LLM(str(need_shared(STORIES_HF)), dtype=dtype, progress=False, block_size=16)
    ids = llm.tokenizer.encode(STORY)[:17]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    first, again = llm.generate([ids], sp)[0], llm.generate([ids], sp)[0]
    assert again.usage.cached_tokens == 16 and again.token_ids == first.token_ids
    if dtype == "bfloat16":
        assert [x.logprob for x in again.logprobs] == [x.logprob for x in first.logprobs]
    else:
        assert [x.logprob for x in again.logprobs] == pytest.approx([x.logprob for x in first.logprobs], rel=1e-5)
    plan = make_gather_plan([1, 1, 3], [17, 9, 3], [[1, 2], [3], [4]], 16, llm.loaded.device, prompt=[True, False, True])
    dplan, dtok, pplan, ptok = plan.split
    assert dtok.tolist() == [1] and ptok.tolist() == [0, 2, 3, 4] and not pplan.is_decode and dplan.is_decode
