"""Sliding-window layers keep only their window of KV (engine/sliding_kv.py): per-sequence rings.

The oracle is the same engine keeping every position (``sliding_kv="full"``): every run below must
give the same greedy tokens and the same log-probs, bit for bit (float32; ``==`` on the floats),
through chunked prefill, batching with arrivals, preemption, prefix-cache hits, speculative
decoding and int8 KV; transformers is the oracle once more for the greedy tokens. The model is
Gemma-3-shaped: three sliding layers (window 16) and one global, blocks of 4 tokens, so a ring is
``ceil((16 + chunk) / 4) + 1`` blocks and every generation runs several windows past it.
"""

from __future__ import annotations

import pytest
import torch

from llmsys import LLM, SamplingParams
from llmsys.engine.sliding_kv import KVCost, ring_blocks
from llmsys.kernels.common.errors import InvalidParameterError
from tiny_models import make_hf_model

WINDOW, BLOCK, CHUNK = 16, 4, 8
LAYERS = ["sliding_attention"] * 3 + ["full_attention"]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_hf_model("gemma3", tmp_path_factory.mktemp("g3") / "g3", seed=3, num_hidden_layers=4,
                         sliding_window=WINDOW, layer_types=LAYERS, max_position_embeddings=512)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path, **kw) -> LLM:
    opts = dict(dtype="float32", device="cpu", block_size=BLOCK, max_num_batched_tokens=CHUNK, kv_cache_tokens=1024,
                progress=False)
    return LLM(str(path), **{**opts, **kw})


def _outputs(llm: LLM, prompts: list[list[int]], max_tokens: int = 48) -> list[tuple]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, sp)
    return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


def _both(path, prompts, max_tokens: int = 48, **kw):
    """(ring run, full-KV run) of the same prompts; asserts the ring engine does keep rings."""
    ring = _llm(path, **kw)
    assert ring.core.kv.spec.sliding is not None and ring.core.kv.spec.sliding.layers == {0, 1, 2}
    got = _outputs(ring, prompts, max_tokens)
    ref = _outputs(_llm(path, sliding_kv="full", **kw), prompts, max_tokens)
    assert ring.core.ring.num_used == 0 and ring.core.allocator.num_used == 0  # every block returned
    return ring, got, ref


def test_ring_size_and_pool():
    assert ring_blocks(16, 8, 4) == 7  # ceil(24 / 4) + 1: a chunk's writes and its first query's window
    assert ring_blocks(512, 512, 16) == 65  # gemma-3-1b, default chunk


def test_long_generation_chunked_prefill_is_bit_identical(gemma3):
    """A 40-token prompt in 8-token chunks, then 48 tokens: six windows past the ring's first wrap."""
    ring, got, ref = _both(gemma3, [_prompt(40, 7)])
    assert got == ref
    assert ring.core.kv.spec.sliding.ring_blocks == 7 and ring.core.kv.k[0].shape[0] < ring.core.kv.k[3].shape[0]


def _stepped(llm: LLM, prompts: list[list[int]], max_tokens: int, joins: tuple[int, ...] = ()) -> tuple[list, int]:
    """``_outputs`` through the engine core's own loop, and how many preemptions it took. ``joins``: the
    steps at which the prompts after the first ``len(prompts) - len(joins)`` arrive (one each)."""
    core = llm.core
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    first = len(prompts) - len(joins)
    seqs = [core.requests[core.add_request(p, sp)] for p in prompts[:first]]
    out: dict[str, list] = {}
    steps = 0
    while core.has_unfinished() or len(seqs) < len(prompts):
        steps += 1
        if steps in joins:
            seqs.append(core.requests[core.add_request(prompts[len(seqs)], sp)])
        for ch in core.step():
            out.setdefault(ch.request_id, []).extend(ch.logprobs)
    lps = [out[s.request_id] for s in seqs]
    return [([lp.token_id for lp in o], [(lp.token_id, lp.logprob, lp.top) for lp in o]) for o in lps], \
        sum(s.num_preemptions for s in seqs)


def test_batched_prompts_of_different_lengths_and_arrivals(gemma3):
    """Several sequences (3..45 prompt tokens) batched, two joining mid-decode (continuous batching):
    each one's bits as in the same schedule keeping every position."""
    prompts = [_prompt(n, s) for n, s in ((3, 1), (45, 2), (17, 3), (30, 4), (8, 10))]
    _, got, ref = _both(gemma3, prompts[:4])
    assert got == ref
    got, _ = _stepped(_llm(gemma3), prompts, 40, joins=(6, 14))
    ref, _ = _stepped(_llm(gemma3, sliding_kv="full"), prompts, 40, joins=(6, 14))
    assert got == ref


def test_preemption_recomputes_with_the_same_bits(gemma3):
    """A pool of 96 tokens for four sequences of ~80: preempted and resumed (recompute: an engine with
    rings has no swap space), the same bits as the same pool keeping every position. No prefix cache:
    a resumed sequence finds fewer of its blocks with rings (only its last window's ring blocks were
    kept), so the two schedules would part there."""
    prompts = [_prompt(n, s) for n, s in ((20, 5), (36, 6), (9, 8), (28, 9))]
    kw = dict(kv_cache_tokens=96, prefix_caching=False, swap_space=0)
    ring = _llm(gemma3, **{**kw, "swap_space": None})
    got, preempted = _stepped(ring, prompts, 48)
    ref, _ = _stepped(_llm(gemma3, sliding_kv="full", **kw), prompts, 48)
    assert preempted > 0 and ring.core.swap is None
    assert got == ref
    assert ring.core.ring.num_used == 0 and ring.core.allocator.num_used == 0
    big = _outputs(_llm(gemma3, sliding_kv="full"), prompts, 48)
    assert [g[0] for g in got] == [b[0] for b in big]  # and the tokens of a pool that never preempts


def test_prefix_cache_hit_reuses_the_window_of_ring_blocks(gemma3):
    """A chat's next turn: the first turn's prompt + answer + more. Its prefix comes from the cache (full
    layers' blocks and the ring blocks of the prefix's last window), as long a hit as with every
    position kept, and the bits of that run."""
    first = _prompt(30, 11)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    def chat(llm: LLM):
        answer = llm.generate([first], sp)[0].token_ids
        o = llm.generate([first + answer + _prompt(10, 12)], sp)[0]
        return o.usage.cached_tokens, o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]

    llm = _llm(gemma3)
    got = chat(llm)
    assert got[0] == 52  # the 54-token prefix in whole 4-token blocks
    assert got == chat(_llm(gemma3, sliding_kv="full"))
    assert llm.core.ring.num_used == 0


def test_prefix_hit_is_shortened_to_what_the_ring_pool_still_holds(gemma3):
    """The prefix's full blocks are cached but its ring blocks were taken for new data: the hit stops at
    the last block whose window is still there (here: none), and the output is still exact."""
    first = _prompt(40, 13)
    llm = _llm(gemma3)
    _outputs(llm, [first], 4)
    ring = llm.core.ring.allocator
    taken = ring.allocate(ring.num_free)  # every cached ring block reused for other data
    ring.free(taken)
    o = llm.generate([first + [5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert o.usage.cached_tokens == 0
    assert o.token_ids == _outputs(_llm(gemma3, sliding_kv="full"), [first + [5, 6, 7]], 20)[0][0]


def test_speculative_ngram_is_bit_identical(gemma3):
    """Prompt lookup drafts (a repeating prompt so they are accepted and rejected): a ring covers a
    verification's rows, and rejected drafts' ring slots are written again."""
    base = _prompt(12, 14)
    prompts = [base * 4, _prompt(23, 15)]
    ring, got, ref = _both(gemma3, prompts, 40, spec="ngram", spec_tokens=4)
    assert got == ref
    assert ring.core.spec_stats.proposed > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_pools_are_bit_identical(gemma3, kv_dtype):
    _, got, ref = _both(gemma3, [_prompt(37, 16), _prompt(11, 17)], 40, kv_dtype=kv_dtype)
    assert got == ref


def test_greedy_tokens_match_transformers(gemma3):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()
    prompt = _prompt(21, 18)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=48, min_new_tokens=48, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert _outputs(_llm(gemma3), [prompt])[0][0] == ref


def test_rings_fall_back_or_refuse_in_one_line(gemma3, tmp_path):
    """A cold tier (or an explicit swap space) moves one block id across every layer: ``auto`` keeps
    every position, ``ring`` refuses naming it; a window the context never passes needs no ring."""
    cold = dict(kv_cache_tokens=64, kv_offload_tokens=256, offload_dir=str(tmp_path))
    assert _llm(gemma3, **cold).core.kv.spec.sliding is None
    with pytest.raises(InvalidParameterError, match="--sliding-kv ring: .*--kv-offload-tokens"):
        _llm(gemma3, sliding_kv="ring", **cold)
    with pytest.raises(InvalidParameterError, match="--swap-space"):
        _llm(gemma3, sliding_kv="ring", swap_space="1MiB")
    assert _llm(gemma3, max_model_len=16).core.kv.spec.sliding is None  # window >= context
    assert _llm(gemma3, max_num_batched_tokens=512).core.kv.spec.sliding is None  # a ring would hold it all
    with pytest.raises(InvalidParameterError, match="--sliding-kv"):
        _llm(gemma3, sliding_kv="some")


def test_a_budget_buys_more_context_with_rings():
    """Sizing from memory counts ring layers at their rings' positions (KVCost): past the rings' total,
    each more token costs only the full layers."""
    cost = KVCost(full=100.0, sliding=300.0, ring_tokens=1000)
    assert cost.nbytes(500) == 500 * 400 and cost.nbytes(5000) == 5000 * 100 + 1000 * 300
    assert cost.tokens_within(200_000) == 500  # within the rings: every layer per token
    assert cost.tokens_within(1_300_000) == 10_000  # 400 kB for the rings' 1000, then 100 B a token
    assert KVCost(full=400.0).tokens_within(1_300_000) == 3250


def test_memory_report_8k_context_holds_rings_for_sliding_layers(tmp_path):
    """An 8k-token context on a Gemma-3-shaped model (5 sliding layers to 1 global, window 512, small
    widths): while it decodes, memory_report() shows the global layer holding all 8k positions and the
    sliding layers R * block_size positions (R = ceil((512 + 512) / 16) + 1 = 65), not 8k."""
    path = make_hf_model("gemma3", tmp_path / "g3", num_hidden_layers=6, sliding_window=512,
                         layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=9000,
                         hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    ctx = 8192
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=ctx + 64, max_num_seqs=2, progress=False)
    spec, core = llm.core.kv.spec, llm.core
    per = spec.layer_bytes_per_token  # K+V bytes of one position in one layer
    core.add_request(_prompt(ctx - 2, 19), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while core.requests and next(iter(core.requests.values())).num_computed < ctx - 1:
        core.step()
    rep = llm.memory_report().kv_layers
    held = -(-(ctx - 1) // 16) * 16
    assert rep["global"].layers == 1 and rep["global"].bytes_used == held * per
    assert rep["sliding"].ring and rep["sliding"].layers == 5
    assert rep["sliding"].bytes_used == 65 * 16 * 5 * per  # R blocks per sequence, however long it is
    assert rep["sliding"].bytes_used < rep["global"].bytes_used  # 5 layers' rings < 1 layer's 8k
    while core.has_unfinished():
        core.step()
