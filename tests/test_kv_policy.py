"""KV eviction policies: parser, decisions vs a plain reference, K/V compaction,
exact attention over the kept set (stream scoring and engine generation), Quest,
budgets under batching, explicit context overflow."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import CORPUS, STORIES_HF, need_shared
from kv_policy_ref import RefDecoder, keep_ref

from llmsys import kernels
from llmsys.kernels.common.errors import ContextOverflowError, InvalidParameterError
from llmsys.offload.kv_policy import (
    QuestAttention,
    compact_kv,
    parse_kv_policy,
    rotate_by,
)

# -- parser ---------------------------------------------------------------------


def test_parse_forms_and_budgets():
    assert parse_kv_policy("full").kind == "full" and not parse_kv_policy(None).evicts
    assert parse_kv_policy("window:256").budget == 256
    p = parse_kv_policy("sink:4,window:252")
    assert (p.kind, p.sinks, p.window, p.budget) == ("sink", 4, 252, 256)
    p = parse_kv_policy("h2o:128,recent:64")
    assert (p.heavy, p.recent, p.budget, p.needs_scores) == (128, 64, 192, True)
    p = parse_kv_policy("snapkv:256,obs:8,pool:5")
    assert (p.keep, p.obs, p.pool) == (256, 8, 5)
    assert parse_kv_policy("quest:63").top_pages == 63
    assert parse_kv_policy("sink:4,window:60,chunk:16").chunk == 16
    # byte budgets become tokens for a given model
    p = parse_kv_policy("window:64KiB")
    assert p.resolve(1280).budget == 65536 // 1280


@pytest.mark.parametrize(
    "text", ["lru:3", "window", "sink:4", "window:1.5", "h2o:3,window:4", "quest:1KiB", "window:1", "snapkv:8"]
)
def test_parse_errors_list_valid_policies(text):
    with pytest.raises(InvalidParameterError) as e:
        parse_kv_policy(text)
    msg = str(e.value)
    assert text.split(",")[0].split(":")[0] in msg or "window" in msg
    if text.startswith("lru"):
        assert "valid:" in msg and "sink:S,window:N" in msg and "quest:K" in msg


# -- decisions vs plain Python --------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_select_matches_reference(seed):
    g = random.Random(seed)
    for kind, text, kw in [
        ("window", "window:40", {}),
        ("sink", "sink:3,window:37", {"sinks": 3}),
        ("h2o", "h2o:20,recent:20", {"recent": 20}),
        ("snapkv", "snapkv:40,obs:6,pool:5", {"obs_w": 6, "pool": 5}),
    ]:
        pol = parse_kv_policy(text)
        L = g.randint(5, 60)
        target = g.randint(1, L - 1) if L > 1 else 1
        score = [g.random() for _ in range(L)]
        obs = [[g.random() for _ in range(L)] for _ in range(g.randint(0, 6))]
        got = pol.select(
            torch.arange(L), target, torch.tensor(score), torch.tensor(obs) if obs else torch.zeros(0, L)
        ).tolist()
        want = keep_ref(kind, L, target, score=score, obs=obs, **kw)
        assert got == want, (kind, L, target)
        assert len(got) == target and got == sorted(set(got))


# -- K/V mechanics ----------------------------------------------------------------


def test_rotate_by_composes_with_rope():
    torch.manual_seed(0)
    D, H = 16, 3
    table = kernels.build_rope_cache(D, 512, 10000.0)
    k = torch.randn(20, H, D)
    p = torch.randint(0, 250, (20,))
    d = torch.randint(-200, 200, (20,)).clamp(min=-p)
    _, at_p = kernels.rope(k[:, :1].clone(), k, p, table)
    _, at_pd = kernels.rope(k[:, :1].clone(), k, p + d, table)
    torch.testing.assert_close(rotate_by(at_p, d, table), at_pd, atol=1e-5, rtol=1e-5)


def test_compact_kv_moves_and_rerotates():
    torch.manual_seed(1)
    nb, bs, H, D, layers = 12, 4, 2, 8, 2
    table_rope = kernels.build_rope_cache(D, 64, 10000.0)
    ks = [torch.randn(nb, bs, H, D) for _ in range(layers)]
    vs = [torch.randn(nb, bs, H, D) for _ in range(layers)]
    k0, v0 = [k.clone() for k in ks], [v.clone() for v in vs]
    block_table = [7, 3, 9, 1, 5]  # 20 slots, scattered blocks
    keep = torch.tensor([0, 1, 5, 6, 11, 17, 18, 19])
    moved = compact_kv(ks, vs, block_table, bs, keep, table_rope)
    assert moved == 6  # indices 0 and 1 stay
    slot = lambda i: block_table[i // bs] * bs + i % bs  # noqa: E731
    for layer in range(layers):
        kf0, kf = k0[layer].view(-1, H, D), ks[layer].view(-1, H, D)
        vf0, vf = v0[layer].view(-1, H, D), vs[layer].view(-1, H, D)
        for new, old in enumerate(keep.tolist()):
            want = rotate_by(kf0[slot(old)][None], torch.tensor([new - old]), table_rope)[0]
            torch.testing.assert_close(kf[slot(new)], want)
            torch.testing.assert_close(vf[slot(new)], vf0[slot(old)])


def test_quest_decode_matches_reference_and_is_exact_with_all_pages():
    torch.manual_seed(2)
    nb, bs, Hk, G, D = 16, 4, 2, 2, 8
    Hq = Hk * G
    kc, vc = torch.randn(nb, bs, Hk, D), torch.randn(nb, bs, Hk, D)
    tables = [[3, 8, 1, 12, 5], [6, 2, 14, 0][:3]]
    lens = [18, 10]
    bt = torch.zeros(2, 5, dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, : len(t)] = torch.tensor(t)
    cl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, Hq, D)
    for k_pages in (2, 5):
        qa = QuestAttention(k_pages, bs)
        for b, t in enumerate(tables):  # summaries of every stored token
            slots = torch.tensor([t[i // bs] * bs + i % bs for i in range(lens[b])])
            qa.update(kc, slots)
        out = qa.decode(q, kc, vc, bt, cl, 0.3)
        for b, t in enumerate(tables):
            n_pages = -(-lens[b] // bs)
            for h in range(Hk):
                kf, vf = kc.view(-1, Hk, D)[:, h], vc.view(-1, Hk, D)[:, h]
                toks = [[t[p] * bs + o for o in range(bs) if p * bs + o < lens[b]] for p in range(n_pages)]
                bound = []
                for p in range(n_pages):
                    lo, hi = kf[toks[p]].min(0).values, kf[toks[p]].max(0).values
                    s = sum(torch.maximum(q[b, h * G + g] * lo, q[b, h * G + g] * hi).sum() for g in range(G))
                    bound.append(math.inf if p == n_pages - 1 else float(s))
                chosen = sorted(range(n_pages), key=lambda p: -bound[p])[:k_pages]
                sl = [s for p in sorted(chosen) for s in toks[p]]
                for g in range(G):
                    qq = q[b, h * G + g]
                    p_ = torch.softmax(kf[sl] @ qq * 0.3, 0)
                    torch.testing.assert_close(out[b, h * G + g], p_ @ vf[sl], atol=1e-5, rtol=1e-5)
        if k_pages == 5:  # covers everything: equals full paged attention
            full = kernels.paged_decode_attention(q, kc, vc, bt, cl, 0.3)
            torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
            assert qa.stats.fraction == 1.0


# -- against the plain decoder on stories260k -------------------------------------


@pytest.fixture(scope="module")
def llm4():
    need_shared(STORIES_HF)
    torch.set_num_threads(2)
    from llmsys import LLM

    return LLM(str(STORIES_HF), dtype="float32", progress=False, block_size=4, kv_cache_tokens=1024, max_num_seqs=4)


@pytest.fixture(scope="module")
def stream_ids(llm4):
    text = need_shared(CORPUS / "tinystories-valid.txt").read_text()[:2000]
    return [1] + llm4.tokenizer.encode(text, add_special_tokens=False)


CASES = [
    ("window:16", "window", 16, {}),
    ("sink:2,window:14", "sink", 16, {"sinks": 2}),
    ("h2o:8,recent:8", "h2o", 16, {"recent": 8}),
    ("snapkv:20", "snapkv", 20, {"obs_w": 16, "pool": 7}),
]


@pytest.mark.parametrize("text,kind,budget,kw,chunk", [c + (1,) for c in CASES] + [CASES[1] + (4,), CASES[2] + (4,)])
def test_stream_scoring_matches_plain_reference(llm4, stream_ids, text, kind, budget, kw, chunk):
    from llmsys.engine.scoring import perplexity_stream

    ids = stream_ids[:36]
    r = perplexity_stream(llm4.core, ids, text, chunk=chunk)
    ref = RefDecoder(llm4.loaded.model, kind, budget, chunk, **kw)
    nll = [-torch.log_softmax(ref.step(ids[j]), -1)[ids[j + 1]].item() for j in range(len(ids) - 1)]
    torch.testing.assert_close(r.nll, torch.tensor(nll, dtype=torch.float64), atol=2e-4, rtol=1e-4)
    assert r.evicted == ref.evicted > 0
    assert llm4.core.allocator.num_used == 0  # blocks went back


def test_full_and_recompute_streams(llm4, stream_ids):
    from llmsys.engine.scoring import perplexity_recompute, perplexity_stream, score_sequences

    ids = stream_ids[:40]
    full = perplexity_stream(llm4.core, ids, "full", segment=15)
    want = -score_sequences(llm4.core, [ids])[0].double()
    torch.testing.assert_close(full.nll, want, atol=1e-4, rtol=1e-4)
    assert len(full.segments()) == 3 and full.kv_bytes == sorted(full.kv_bytes)
    rec = perplexity_recompute(llm4.core, ids, 16, batch=8)
    for j in (3, 16, 37):  # fed token j sees ids[j-15..j] recomputed from position 0
        win = ids[max(0, j - 15) : j + 2]
        torch.testing.assert_close(rec.nll[j], -score_sequences(llm4.core, [win])[0][-1].double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("text,kind,budget,kw", [CASES[1], CASES[2]])
def test_engine_generation_matches_plain_reference(llm4, text, kind, budget, kw):
    """Engine decode (default chunk = block size) == the plain decoder over the kept set."""
    from llmsys import LLM, SamplingParams

    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256, kv_policy=text)
    prompt = [1] + llm.tokenizer.encode("Once upon a time", add_special_tokens=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0))[0]
    ref = RefDecoder(llm.loaded.model, kind, budget, 4, **kw)
    for t in prompt[:-1]:
        ref.step(t)
    fed = prompt[-1]
    for tok, lp in zip(out.token_ids, out.logprobs):
        logits = torch.log_softmax(ref.step(fed), -1)
        assert int(logits.argmax()) == tok
        assert abs(float(logits[tok]) - lp.logprob) < 1e-4
        fed = tok
    assert out.usage.evicted_tokens == ref.evicted > 0


def test_budget_honoured_under_batching(llm4):
    from llmsys import LLM, SamplingParams

    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256,
              kv_policy="sink:2,window:14", max_num_seqs=3, max_num_batched_tokens=24)
    core = llm.core
    prompts = [[1] + llm.tokenizer.encode(t, add_special_tokens=False)
               for t in ("Once upon a time", "The dog ran to the big red ball and", "Tom")]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    solo = [llm.generate([p], sp)[0].token_ids for p in prompts]
    ids = [core.add_request(p, sp) for p in prompts]
    done, used, toks = {}, [], {r: [] for r in ids}
    while core.has_unfinished():
        for ch in core.step():
            toks[ch.request_id] += ch.token_ids
            if ch.finished:
                done[ch.request_id] = ch.usage
        for seq in core.scheduler.running:
            assert seq.kv.max_cache_len <= 16 and len(seq.block_table) <= 4
        used.append(core.allocator.num_used)
    assert max(used) <= 3 * 4
    assert [toks[r] for r in ids] == solo  # batching does not change what is kept
    for p, rid in zip(prompts, ids):
        fed = len(p) + 16 - 1
        assert 0 < done[rid].evicted_tokens <= fed - 16 + 4


def test_quest_engine_exact_when_k_covers_all_pages(llm4):
    from llmsys import LLM, SamplingParams

    prompt = [1] + llm4.tokenizer.encode("Once upon a time, there was a big dog", add_special_tokens=False)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
    full = llm4.generate([prompt], sp)[0]
    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256, kv_policy="quest:64")
    q = llm.generate([prompt], sp)[0]
    assert q.token_ids == full.token_ids
    for a, b in zip(q.logprobs, full.logprobs):
        assert abs(a.logprob - b.logprob) < 1e-4
    assert q.usage.evicted_tokens == 0
    assert llm.core.kv_policy.quest.stats.fraction == 1.0


def test_stream_scoring_needs_scores_a_quest_engine_does_not_record(stream_ids):
    """A Quest engine's attention selects pages and records no scores: scoring a stream under
    H2O on it is refused with a one-line error naming the fix, and no KV block is left in use."""
    from llmsys import LLM
    from llmsys.engine.scoring import perplexity_stream
    from llmsys.kernels.common.errors import InvalidParameterError

    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256, kv_policy="quest:64")
    with pytest.raises(InvalidParameterError, match="needs attention scores.*drop --kv-policy quest"):
        perplexity_stream(llm.core, stream_ids[:36], "h2o:8,recent:8")
    assert llm.core.allocator.num_used == 0


def test_context_overflow_is_explicit_and_policies_slide_past_it():
    from llmsys import LLM, SamplingParams

    need_shared(STORIES_HF)
    full = LLM(str(STORIES_HF), dtype="float32", progress=False, block_size=4, kv_cache_tokens=64, max_model_len=24)
    n_ctx = full.core.max_len
    with pytest.raises(ContextOverflowError) as e:
        full.core.add_request([1] * (n_ctx + 5), SamplingParams())
    assert (e.value.n_prompt_tokens, e.value.n_ctx) == (n_ctx + 5, n_ctx)
    out = full.generate([[1, 5, 6]], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) + 3 == n_ctx  # stops, never truncates
    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, block_size=4, kv_cache_tokens=64,
              kv_policy="window:16", max_model_len=24)
    long_prompt = [1] + [int(t) for t in torch.randint(3, 500, (40,))]
    out = llm.generate([long_prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    # an evicting policy slides past the context: up to max_len new tokens after any prompt
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    assert out.usage.evicted_tokens >= 41 + 23 - 16


def test_policy_errors():
    from llmsys import LLM

    need_shared(STORIES_HF)
    with pytest.raises(InvalidParameterError, match="perplexity"):
        LLM(str(STORIES_HF), progress=False, kv_cache_tokens=256, kv_policy="recompute:64")
    with pytest.raises(InvalidParameterError, match="KV pool"):
        LLM(str(STORIES_HF), progress=False, kv_cache_tokens=128, kv_policy="window:256")


def test_cli_stream_perplexity(capsys):
    need_shared(STORIES_HF)
    from llmsys.engine.cli.main import main

    f = need_shared(CORPUS / "tinystories-valid.txt")
    rc = main(["perplexity", str(STORIES_HF), str(f), "--stream", "--kv-policy", "sink:4,window:28",
               "--limit", "70", "--segment", "30", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0 and "stream perplexity" in out and out.count("  tokens ") == 3 and "evicted" in out
    rc = main(["perplexity", str(STORIES_HF), str(f), "--stream", "--kv-policy", "lru:3"])
    assert rc == 2 and "valid:" in capsys.readouterr().err


# -- per-request policies (SamplingParams.kv_policy) -------------------------------


def test_mixed_policies_batch_like_each_alone():
    """sink + full + h2o + snapkv sequences in one engine, batched (prefill chunks beside
    decodes): each gives the greedy tokens of an engine running its policy engine-wide."""
    from llmsys import LLM, SamplingParams

    need_shared(STORIES_HF)
    kw = dict(dtype="float32", progress=False, block_size=4, kv_cache_tokens=256, max_model_len=40,
              max_num_batched_tokens=12)
    llm = LLM(str(STORIES_HF), **kw)
    prompts = [[1] + llm.tokenizer.encode(t, add_special_tokens=False)
               for t in ("Once upon a time", "The dog ran to the big red ball and", "Tom", "Lily saw a bird")]
    policies = ["sink:2,window:14", None, "h2o:8,recent:8", "snapkv:12,obs:4,pool:3"]

    def sp(p):
        return SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, kv_policy=p)

    mixed = llm.generate(prompts, [sp(p) for p in policies])
    for prompt, policy, out in zip(prompts, policies, mixed):
        alone = LLM(str(STORIES_HF), kv_policy=policy or "full", **kw).generate([prompt], sp(None))[0]
        assert out.token_ids == alone.token_ids, policy
        assert out.usage.evicted_tokens == alone.usage.evicted_tokens
        if policy is None:  # full: stops at the context, as always
            assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 40
            assert out.usage.evicted_tokens == 0
        else:  # evicting: slides past it, max_tokens honoured
            assert len(out.token_ids) == 48 and out.usage.evicted_tokens > 0
    assert llm.core.allocator.num_used == 0


def test_per_request_policy_checks():
    from llmsys import LLM, SamplingParams

    need_shared(STORIES_HF)
    with pytest.raises(InvalidParameterError, match="unknown KV policy"):
        SamplingParams(kv_policy="lru:3")
    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, block_size=4, kv_cache_tokens=128, max_model_len=24)
    rt = llm.core.kv_policy
    assert rt.resolve(None).kind == "full" and rt.resolve("sink:2,window:14").budget == 16
    for text, needle in (("window:200", "KV pool"), ("recompute:16", "perplexity"), ("quest:2", "engine-wide")):
        with pytest.raises(InvalidParameterError, match=needle):
            llm.core.add_request([1, 5, 6], SamplingParams(kv_policy=text))
    # a long prompt is fine for a sliding policy, an overflow for the default
    long_prompt = [1] + [7] * 30
    with pytest.raises(ContextOverflowError):
        llm.core.add_request(long_prompt, SamplingParams())
    out = llm.generate([long_prompt], SamplingParams(max_tokens=5, temperature=0, kv_policy="window:16"))[0]
    assert len(out.token_ids) == 5 and out.usage.evicted_tokens > 0
    int8 = LLM(str(STORIES_HF), dtype="float32", progress=False, kv_cache_tokens=128, kv_dtype="int8")
    with pytest.raises(InvalidParameterError, match="float KV pool"):
        int8.core.kv_policy.resolve("sink:4,window:28")
    quest = LLM(str(STORIES_HF), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256, kv_policy="quest:8")
    assert quest.core.kv_policy.resolve("quest:8") is quest.core.kv_policy.policy  # the engine's own: fine
    for text in ("full", "sink:2,window:14", "quest:4"):
        with pytest.raises(InvalidParameterError, match="engine-wide"):
            quest.core.kv_policy.resolve(text)
