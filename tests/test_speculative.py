"""Speculative decoding (engine/speculative.py): the same greedy tokens as plain decoding for every
proposer, alone and batched, on stories260k and every parity family; sampled tokens distributed as
the target's (chi-square); seeds reproducible; rejected drafts leave no trace in the KV pool."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from llmsys import LLM, SamplingParams
from llmsys.engine.sampling import Sampler, SamplingBatch
from llmsys.engine.speculative import NgramProposer
from llmsys.kernels.common.errors import InvalidParameterError
from tiny_models import ARCH_CONFIGS, make_hf_model

PROMPTS = ["Once upon a time", "The cat sat", "Tom and Sue went to", "One day, a big dog",
           "Lily wanted", "The sun was", "A little bird", "Max had a red"]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def chisquare_p(observed: list[float], expected: list[float]) -> float:
    """Pearson's chi-square test p-value (df = bins - 1): the upper regularized incomplete gamma
    Q(df / 2, chi2 / 2), as scipy.stats.chisquare computes it, from torch alone."""
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    chi2 = ((o - e) ** 2 / e).sum()
    df = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, chi2 / 2))


def truncated_stories(src: Path, out: Path, layers: int) -> Path:
    """stories260k with only its first ``layers`` layers: a draft model with the same tokenizer."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, out / f)
    return out


def engine(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "kv_cache_tokens": 2048, "progress": False, "threads": 1, **kw}
    return LLM(str(path), **kw)


@pytest.fixture(scope="module")
def plain():
    from conftest import STORIES_HF, need_shared

    return engine(need_shared(STORIES_HF))


@pytest.fixture(scope="module")
def reference(plain):
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("spec", ["ngram", "self:int4", "draft"])
def test_greedy_identical_alone_and_batched(stories_hf, reference, spec, tmp_path):
    kw = {"spec": spec}
    if spec == "draft":
        kw["draft_model"] = str(truncated_stories(stories_hf, tmp_path / "draft", 2))
    llm = engine(stories_hf, **kw)
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    batched = llm.generate(PROMPTS, GREEDY)
    assert alone == reference
    assert [o.token_ids for o in batched] == reference
    st = llm.core.spec_stats
    assert st.proposed > 100 and 0 < st.accepted <= st.proposed  # drafts were verified, some kept
    assert sum(o.usage.accepted_draft_tokens for o in batched) <= sum(o.usage.draft_tokens for o in batched)
    assert all(o.usage.completion_tokens == 48 for o in batched)
    assert llm.core.allocator.num_used == 0
    if llm.draft is not None:
        llm.core.step()  # the draft's per-request state goes with the requests
        assert llm.draft.core.allocator.num_used == 0 or not llm.core.requests


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_parity_families_greedy_identical(arch, tmp_path):
    path = make_hf_model(arch, tmp_path / arch, seed=3)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(4, 30, (8,), generator=g)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in engine(path, kv_cache_tokens=1024).generate(prompts, sp)]
    # Prompt lookup on every family; a model draft on one of each kind of layer (the suite's time).
    for spec in ("ngram", "self:int8") if arch in ("llama", "phi3-longrope", "gemma2", "qwen3_moe") else ("ngram",):
        llm = engine(path, kv_cache_tokens=1024, spec=spec)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == ref, spec
        assert llm.generate(prompts[3], sp)[0].token_ids == ref[3], spec
        assert llm.core.spec_stats.accepted > 0, spec


def test_penalties_stops_logprobs_and_streaming_match_plain(plain, stories_hf):
    llm = engine(stories_hf, spec="self:int8")
    for sp in (SamplingParams(temperature=0, max_tokens=60, repetition_penalty=1.3, frequency_penalty=0.5),
               SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=80, stop=["park"], logprobs=2),
               SamplingParams(temperature=0, max_tokens=40, min_tokens=30, logit_bias={13: 3.0})):
        ref = plain.generate("Once upon a time", sp)[0]
        out = llm.generate("Once upon a time", sp)[0]
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        if sp.logprobs:
            assert [lp.token_id for lp in out.logprobs] == [lp.token_id for lp in ref.logprobs]
            assert max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-4
    sp = SamplingParams(temperature=0, max_tokens=50)
    chunks = list(llm.stream("Once upon a time", sp))
    full = plain.generate("Once upon a time", sp)[0]
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert any(len(c.token_ids) > 1 for c in chunks)  # a verification's tokens come out together


def test_rejected_drafts_do_not_reach_the_prefix_cache(plain, stories_hf):
    """Blocks registered while speculating hold the sequence's real tokens: a later prompt that
    reuses them continues exactly as on an engine that never speculated."""
    llm = engine(stories_hf, spec="self:int4", block_size=4)
    first = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0]
    assert llm.core.spec_stats.accepted < llm.core.spec_stats.proposed  # some drafts were rejected
    prompt = first.prompt_token_ids + first.token_ids[:41]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    again = llm.generate([prompt], sp)[0]
    assert again.usage.cached_tokens >= 40
    assert again.token_ids == plain.generate([prompt], sp)[0].token_ids


def test_tiny_pool_preemption_and_context_end(stories_hf):
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    big = engine(stories_hf)
    ref = [o.token_ids for o in big.generate(PROMPTS[:4], sp)]
    small = engine(stories_hf, kv_cache_tokens=160, block_size=8, spec="ngram", spec_tokens=6)
    assert [o.token_ids for o in small.generate(PROMPTS[:4], sp)] == ref
    assert small.core.allocator.num_used == 0
    # The context's last positions: drafts never run past it, the output stops where plain decoding does.
    short = engine(stories_hf, max_model_len=40)
    spec = engine(stories_hf, max_model_len=40, spec="self:int8")
    a = short.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    b = spec.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason) and len(a.token_ids) == 40 - 5


def test_sampling_with_drafts_is_the_target_distribution():
    """Sampler-level: the acceptance rule with a point-mass draft leaves each row's distribution
    p (after temperature, top-k and penalties) unchanged: chi-square over 20,000 draws."""
    v = 12
    logits = torch.randn(v, generator=torch.Generator().manual_seed(0)) * 1.5
    n = 20000
    sp = SamplingParams(temperature=0.9, top_k=8, repetition_penalty=1.2, seed=None)
    batch = SamplingBatch([sp] * n, [[1, 2]] * n, [[3]] * n)
    sampler = Sampler()
    _, filtered = sampler.process_logits(logits[None].repeat(1, 1), SamplingBatch([sp], [[1, 2]], [[3]]))
    p = torch.softmax(filtered[0], -1)
    torch.manual_seed(1)
    for draft in (int(p.argmax()), int(p.argsort()[-4]), int(torch.nonzero(p == 0)[0])):
        out = sampler.sample(logits[None].repeat(n, 1), batch, [draft] * n)
        counts = torch.bincount(torch.tensor(out.token_ids), minlength=v).double()
        keep = p > 0
        assert counts[~keep].sum() == 0  # nothing top-k removed is ever emitted, not even the draft
        pvalue = chisquare_p(counts[keep].tolist(), (p[keep] * n).tolist())
        assert pvalue > 0.01, (draft, pvalue)
        acc = torch.tensor(out.accepted)
        assert abs(acc.double().mean().item() - p[draft].item()) < 0.02  # accepted with probability p(draft)


def test_engine_sampling_distribution_and_seed(stories_hf):
    """End to end: the second sampled token, judged against a self:int4 draft, follows the target's
    next-token distribution given the first (chi-square, p > 0.01); a fixed seed gives one answer."""
    llm = engine(stories_hf, spec="self:int4", spec_tokens=2, max_num_seqs=64)
    plain = engine(stories_hf)
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=2500, seed=7)
    outs = llm.generate("Once upon a time, there was a", sp)
    assert llm.core.spec_stats.proposed >= 2500 and llm.core.spec_stats.accepted < llm.core.spec_stats.proposed
    firsts = torch.tensor([o.token_ids[0] for o in outs])
    top = int(torch.mode(firsts).values)
    seconds = torch.tensor([o.token_ids[1] for o in outs if o.token_ids[0] == top])
    ctx = plain.encode("Once upon a time, there was a") + [top]
    lp = plain.generate([ctx], SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].logprobs[0]
    probs = {t: float(torch.tensor(x).exp()) for t, x in lp.top}
    counts = torch.bincount(seconds, minlength=512).double()
    m = len(seconds)
    bins = [t for t, q in probs.items() if q * m >= 5]
    obs = [counts[t].item() for t in bins] + [m - sum(counts[t].item() for t in bins)]
    exp = [probs[t] * m for t in bins] + [m - sum(probs[t] * m for t in bins)]
    assert m > 500 and len(bins) >= 2
    assert chisquare_p(obs, exp) > 0.01
    one = SamplingParams(temperature=0.8, max_tokens=40, seed=123)
    a = llm.generate("The cat sat", one)[0].token_ids
    assert llm.generate("The cat sat", one)[0].token_ids == a


def test_ngram_lookup():
    p = NgramProposer()
    assert p.lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]  # the longest suffix that occurred before
    assert p.lookup([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 2) == [9, 2]  # [1, 2, 3] beats the later [2, 3]
    assert p.lookup([1, 2, 1, 3, 1], 2) == [3, 1]  # the latest occurrence of [1]
    assert p.lookup([5, 6, 7], 2) == [] and p.lookup([4], 2) == []


def test_bad_flags_are_one_line(stories_hf, tmp_path):
    from llmsys.engine.config import EngineConfig

    for kw, needle in ((dict(spec="beam"), "unknown --spec"), (dict(spec="draft"), "needs --draft"),
                       (dict(spec="self:int3"), "unknown quantization"), (dict(spec_tokens=0), "1..16"),
                       (dict(spec="ngram", kv_policy="quest:64"), "quest")):
        with pytest.raises(InvalidParameterError, match=needle):
            EngineConfig(model=str(stories_hf), **kw)
    other = make_hf_model("llama", tmp_path / "other", vocab_size=640)
    with pytest.raises(InvalidParameterError, match="vocabulary has 640 tokens"):
        engine(stories_hf, draft_model=str(other))


def test_server_reports_drafts_and_answers_as_plain(plain, stories_hf):
    """The OpenAI server on a speculating engine: the same greedy text as plain decoding, streamed or
    not; usage says how many drafts were kept (OpenAI's prediction-token fields); /metrics counts them."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings())
    state.attach(engine(stories_hf, spec="ngram"), "stories")
    srv = start_server_thread(state)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        ref = plain.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=64))[0]
        r = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=64, temperature=0)
        assert r.choices[0].text == ref.text
        d = r.usage.completion_tokens_details
        assert d.accepted_prediction_tokens > 0 and d.rejected_prediction_tokens >= 0
        streamed = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=64,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
        drafted = fams["llmsys_spec_draft_tokens"].samples[0].value
        kept = fams["llmsys_spec_accepted_tokens"].samples[0].value
        assert drafted >= kept >= 2 * d.accepted_prediction_tokens > 0
    finally:
        srv.stop()


def test_plan_predicts_the_verification_step(capsys, monkeypatch, tmp_path):
    from llmsys.engine.cli.main import main

    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path))  # the machine probe's record, not the user's

    rc = main(["plan", "qwen2.5-0.5b", "--cpu-mem", "256MiB", "--dtype", "bfloat16", "--spec", "self", "--accept", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "a verification step of 1 x 5 tokens" in out and "at mean accepted length 3:" in out
    assert main(["plan", "qwen2.5-0.5b", "--spec", "ngram", "--accept", "7"]) == 2
    assert "--accept 7.0 must be in 1..5" in capsys.readouterr().err


def test_a_predicted_output_is_a_draft_source_on_any_engine(plain, stories_hf, tmp_path):
    """SamplingParams(prediction=ids) (OpenAI's ``prediction`` on the chat route): an engine without
    --spec copies drafts from it; the answer is unchanged, a close prediction is mostly accepted, and
    a wrong one costs nothing but rejected drafts."""
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ref = plain.generate("Once upon a time", sp)[0]
    llm = engine(stories_hf)
    edited = list(ref.token_ids)
    edited[20:23] = [400, 401]  # a prediction that differs in the middle
    for pred, least in ((ref.token_ids, 50), (edited, 35), ([7] * 30, 0)):
        before = llm.core.spec_stats.accepted
        out = llm.generate("Once upon a time", dataclasses.replace(sp, prediction=tuple(pred)))[0]
        assert out.token_ids == ref.token_ids
        assert out.usage.accepted_draft_tokens == llm.core.spec_stats.accepted - before >= least
    none = llm.generate("Once upon a time", dataclasses.replace(sp, prediction=tuple(ref.token_ids), spec_tokens=0))[0]
    assert none.token_ids == ref.token_ids and none.usage.draft_tokens == 0

    import openai

    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState
    from test_server import _chat_model

    chat = _chat_model(tmp_path)
    state = ServerState(ServerSettings())
    state.attach(engine(chat), "chat")
    srv = start_server_thread(state)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "Tell me a story."}]
        first = c.chat.completions.create(model="chat", messages=ask, max_tokens=40, temperature=0)
        text = first.choices[0].message.content
        again = c.chat.completions.create(model="chat", messages=ask, max_tokens=40, temperature=0,
                                          prediction={"type": "content", "content": [{"type": "text", "text": text}]})
        assert again.choices[0].message.content == text
        assert again.usage.completion_tokens_details.accepted_prediction_tokens >= 30
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="chat", messages=ask, max_tokens=4, prediction={"type": "image"})
        with pytest.raises(openai.BadRequestError) as e:  # more text than the context could ever use
            c.chat.completions.create(model="chat", messages=ask, max_tokens=4,
                                      prediction={"type": "content", "content": "Once upon a time. " * 20000})
        assert e.value.body["param"] == "prediction" and "longer than the model's context" in e.value.body["message"]
    finally:
        srv.stop()


def test_per_request_spec_tokens(plain, stories_hf):
    llm = engine(stories_hf, spec="ngram")
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ref = plain.generate("Once upon a time", sp)[0].token_ids
    off = llm.generate("Once upon a time", dataclasses.replace(sp, spec_tokens=0))[0]
    assert off.token_ids == ref and off.usage.draft_tokens == 0
    one = llm.generate("Once upon a time", dataclasses.replace(sp, spec_tokens=1))[0]
    assert one.token_ids == ref and 0 < one.usage.draft_tokens <= 59
    with pytest.raises(InvalidParameterError, match="spec_tokens"):
        SamplingParams(spec_tokens=17)


def test_bench_spec_reports_acceptance_and_the_verify_step(stories_hf, capsys):
    from llmsys.engine.cli.main import main

    rc = main(["bench", str(stories_hf), "-p", "0", "-n", "16", "-r", "1", "--dtype", "float32", "--no-e2e",
               "--spec", "self:int8", "--output", "json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rc == 0 and len(rows) == 1
    r = rows[0]
    assert r["spec"] == "self:int8 K=4" and r["spec_verify_x"] > 0.5
    assert 1.5 < r["spec_tokens_per_step"] <= 5.0  # the int8 self-draft is almost always kept
    assert r["spec_tok_s"] > 0 and r["spec_plain_tok_s"] > 0


def test_cold_kv_tier_offloaded_layers_and_evicting_policies_keep_the_answers(stories_hf, tmp_path):
    """Speculation beside the other memory machinery: a cold KV tier (hot pool of 64 tokens), layers
    streamed from disk, and a per-request evicting policy (that request gets no drafts; its
    neighbours' steps then verify none either) all give plain decoding's tokens."""
    sp = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    long = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun."
    ref = engine(stories_hf).generate([long, "The cat sat"], sp)
    tiered = engine(stories_hf, kv_cache_tokens=64, kv_offload_tokens=2048, offload_dir=str(tmp_path),
                    spec="self:int8", max_num_batched_tokens=32)
    out = tiered.generate([long, "The cat sat"], sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert tiered.core.tier.stats.demoted_blocks > 0 and tiered.core.spec_stats.accepted > 0
    assert tiered.core.allocator.num_used == 0

    path = make_hf_model("llama", tmp_path / "m", num_hidden_layers=4, hidden_size=256, intermediate_size=512)
    prompts = [[5, 17, 99, 200, 31, 7, 8], [300, 12, 4]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = [o.token_ids for o in engine(path, threads=2).generate(prompts, sp)]
    streamed = engine(path, threads=2, cpu_mem="64MiB", placement={"disk": 4}, spec="self:int8")
    assert [o.token_ids for o in streamed.generate(prompts, sp)] == base
    assert streamed.plan.layer_kinds().count("disk") == 4 and streamed.core.spec_stats.accepted > 0

    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    win = dataclasses.replace(sp, kv_policy="sink:4,window:28")
    plain = engine(stories_hf)
    refs = [plain.generate("Once upon a time", win)[0].token_ids, plain.generate("The cat sat", sp)[0].token_ids]
    llm = engine(stories_hf, spec="ngram")
    outs = llm.generate(["Once upon a time", "The cat sat"], [win, sp])
    assert [o.token_ids for o in outs] == refs
    assert outs[0].usage.draft_tokens == 0 and outs[0].usage.evicted_tokens > 0


@pytest.mark.parametrize("backend", ["CpuBackend", "CudaBackend"])
def test_verification_rows_are_decode_rows(stories_hf, backend):
    """The runner's layout of a verification: each of the K + 1 rows gets the logits a decode step at
    its position gives (the CUDA backend's logic too, on CPU tensors: its decode dispatch per row)."""
    from llmsys.engine import attention
    from llmsys.engine.loader import load_model
    from llmsys.engine.kv_cache import KVCacheSpec, make_kv_pool
    from llmsys.engine.runner import ModelRunner
    from llmsys.engine.scheduler import ScheduledSeq, SchedulerOutput

    loaded = load_model(str(stories_hf), dtype="float32", device="cpu")
    a = loaded.args
    pool = make_kv_pool(KVCacheSpec(a.num_hidden_layers, 8, 16, a.num_key_value_heads, a.head_dim, torch.float32),
                        loaded.device)
    runner = ModelRunner(loaded.model, getattr(attention, backend)(pool, 16, loaded.device), loaded.device, 16)
    table = [1, 2, 3, 4]
    prompt = [1, 403, 407, 261, 378, 432, 383, 286, 261]
    cont = [376, 298, 265, 317, 289]

    def run(ids, start, samples=True, draft=0):
        step = ScheduledSeq("r", ids, start, start, table, start == 0, samples, num_draft=draft)
        return runner.execute(SchedulerOutput([step])).logits

    run(prompt, 0)
    one_by_one = [run([t], len(prompt) + i) for i, t in enumerate(cont)]  # [1, V] each
    verified = run(cont, len(prompt), draft=len(cont) - 1)  # the same tokens as one verification
    assert verified.shape == (len(cont), a.vocab_size)
    for i, ref in enumerate(one_by_one):
        assert torch.allclose(verified[i], ref[0], atol=1e-4, rtol=0), i  # float rounding of M-row GEMMs
        assert int(verified[i].argmax()) == int(ref[0].argmax())


def test_a_failing_proposer_costs_its_drafts_only(plain, stories_hf, caplog):
    llm = engine(stories_hf, spec="ngram")

    def boom(reqs, live):
        raise RuntimeError("draft model fell over")

    llm.core.proposer.propose = boom  # a fault inside the proposer, whatever its kind
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert llm.generate("Once upon a time", sp)[0].token_ids == plain.generate("Once upon a time", sp)[0].token_ids
    assert "proposer ngram failed" in caplog.text
    with pytest.raises(InvalidParameterError, match="prediction token id 600"):
        llm.generate("Once upon a time", dataclasses.replace(sp, prediction=(5, 600)))
