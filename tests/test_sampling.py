"""Sampling layer: parameter validation, each logits transformation against a
plain per-row reference (and transformers' processors), seeding/batch
invariance, the empirical distribution of draws, min_tokens and logprobs."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.engine.sampling import (
    Sampler,
    SamplingBatch,
    SamplingParams,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    make_generator,
)

torch.set_num_threads(1)
V = 64
NEG = -math.inf


def _logits(b: int, v: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


def _batch(params, prompts=None, outputs=None, gens=None, eos=()):
    b = len(params)
    return SamplingBatch(
        params=list(params),
        prompt_ids=prompts if prompts is not None else [[] for _ in range(b)],
        output_ids=outputs if outputs is not None else [[] for _ in range(b)],
        generators=gens,
        eos_token_ids=eos,
    )


# --------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("max_tokens", 0),
        ("max_tokens", -4),
        ("max_tokens", 2.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("top_k", -2),
        ("top_k", 1.5),
        ("n", 0),
        ("min_tokens", -1),
        ("seed", "abc"),
        ("stop", 5),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [1, -3]),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_value_raises_naming_field(field, value):
    with pytest.raises(InvalidParameterError) as ei:
        SamplingParams(**{field: value})
    msg = str(ei.value)
    assert field in msg
    assert "\n" not in msg
    if field not in ("stop", "stop_token_ids"):  # those name the whole list
        assert repr(value) in msg
    assert isinstance(ei.value, ValueError)  # callers catching ValueError still work


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(InvalidParameterError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_valid_edges_and_normalisation():
    p = SamplingParams(
        max_tokens=None, temperature=0, top_k=-1, top_p=1, min_p=1, repetition_penalty=0.5,
        presence_penalty=-2, frequency_penalty=2, logprobs=20, stop="###", stop_token_ids=[7, 9],
    )
    assert p.stop == ("###",) and p.stop_token_ids == (7, 9)
    assert isinstance(p.temperature, float) and p.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(logprobs=0).logprobs == 0
    assert not SamplingParams(temperature=0.7).greedy
    hash(p)  # frozen and hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    # replace() re-validates
    with pytest.raises(InvalidParameterError, match="top_p"):
        dataclasses.replace(p, top_p=2.0)


# --------------------------------------------------------------------------- transformations


def _ref_top_k(row: list[float], k: int) -> list[bool]:
    if k <= 0 or k >= len(row):
        return [True] * len(row)
    kth = sorted(row, reverse=True)[k - 1]
    return [x >= kth for x in row]


def _ref_top_p(row: list[float], p: float) -> list[bool]:
    if p >= 1.0:
        return [True] * len(row)
    m = max(row)
    e = [math.exp(x - m) for x in row]
    s = sum(e)
    probs = [x / s for x in e]
    order = sorted(range(len(row)), key=lambda i: -probs[i])
    keep, cum = [False] * len(row), 0.0
    for i in order:  # smallest prefix whose mass reaches p; always >= 1 token
        keep[i] = True
        cum += probs[i]
        if cum >= p:
            break
    cut = min(row[i] for i in range(len(row)) if keep[i])
    return [x >= cut for x in row]  # tokens tied with the last survivor survive too


def _ref_min_p(row: list[float], mp: float) -> list[bool]:
    m = max(row)
    e = [math.exp(x - m) for x in row]
    s = sum(e)
    probs = [x / s for x in e]
    return [q >= mp * max(probs) for q in probs]


def test_top_k_matches_reference():
    x = _logits(7)
    ks = [0, -1, 1, 3, 10, V, V + 5]
    out = apply_top_k(x, torch.tensor(ks))
    for i, k in enumerate(ks):
        kept = (out[i] > NEG).tolist()
        assert kept == _ref_top_k(x[i].tolist(), k)
        assert sum(kept) == min(k, V) if k > 0 else sum(kept) == V
        assert torch.equal(out[i][out[i] > NEG], x[i][out[i] > NEG])  # survivors untouched


def test_top_p_matches_reference_and_transformers():
    from transformers import TopPLogitsWarper

    x = _logits(8, seed=1)
    ps = [1.0, 0.9, 0.5, 0.1, 1e-6, 0.99, 0.75, 0.3]
    out = apply_top_p(x, torch.tensor(ps))
    for i, p in enumerate(ps):
        kept = (out[i] > NEG).tolist()
        assert kept == _ref_top_p(x[i].tolist(), p), f"row {i} p={p}"
        assert sum(kept) >= 1
        hf = TopPLogitsWarper(p)(None, x[i : i + 1].clone())[0] if p < 1 else x[i]
        assert kept == (hf > NEG).tolist()
    assert torch.equal(out[0], x[0])  # p=1 is a no-op
    assert int((out[4] > NEG).sum()) == 1  # tiny p keeps just the argmax
    assert int((out[4] > NEG).float().argmax()) == int(x[4].argmax())


def test_top_p_after_top_k_uses_window_and_matches_reference():
    x = _logits(4, seed=12)
    ks, ps = torch.tensor([10, 30, 5, 1]), torch.tensor([0.8, 0.5, 0.95, 0.3])
    xk = apply_top_k(x, ks)
    windowed = apply_top_p(xk, ps, ks)  # every row has top-k: topk window instead of sort
    full = apply_top_p(xk, ps)  # full sort
    assert torch.equal(windowed, full)
    for i in range(4):
        assert (windowed[i] > NEG).tolist() == _ref_top_p(xk[i].tolist(), float(ps[i]))


def test_top_p_keeps_whole_tie_groups_independent_of_batch():
    # bf16-like logits: few distinct values, many ties
    g = torch.Generator().manual_seed(13)
    x = torch.randint(0, 6, (3, V), generator=g).float() * 0.5
    ps, ks = torch.tensor([0.6, 0.3, 0.9]), torch.tensor([40, 20, 0])
    xk = apply_top_k(x, ks)
    out = apply_top_p(xk, ps, ks)
    for i in range(3):
        kept = out[i] > NEG
        assert kept.tolist() == _ref_top_p(xk[i].tolist(), float(ps[i]))
        cut = out[i][kept].min()
        assert torch.equal(kept, xk[i] >= cut)  # a cut never splits a tie group
        alone = apply_top_p(xk[i : i + 1], ps[i : i + 1], ks[i : i + 1])
        assert torch.equal(alone[0], out[i])
    # rows 0 and 1 alone take the topk window, together with row 2 the full sort
    assert torch.equal(apply_top_p(xk[:2], ps[:2], ks[:2]), out[:2])


def test_min_p_matches_reference():
    x = _logits(5, seed=2)
    mps = [0.0, 0.05, 0.2, 0.5, 1.0]
    out = apply_min_p(x, torch.tensor(mps))
    for i, mp in enumerate(mps):
        assert (out[i] > NEG).tolist() == _ref_min_p(x[i].tolist(), mp)
    assert torch.equal(out[0], x[0])
    assert int((out[4] > NEG).sum()) == 1


def _counts(rows, v=V):
    c = torch.zeros(len(rows), v)
    for i, r in enumerate(rows):
        for t in r:
            c[i, t] += 1
    return c


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    x = _logits(4, seed=3)
    prompts = [[1, 2, 3, 3], [5, 6], [], [10, 11]]
    outputs = [[4, 4, 9], [], [7, 8], [10]]
    pens = [1.3, 0.8, 2.0, 1.0]
    zeros = torch.zeros(4)
    out = apply_penalties(x, _counts(prompts), _counts(outputs), torch.tensor(pens), zeros, zeros)
    for i, pen in enumerate(pens):
        ids = torch.tensor([prompts[i] + outputs[i]], dtype=torch.long)
        ref = RepetitionPenaltyLogitsProcessor(pen)(ids, x[i : i + 1].clone())[0] if ids.numel() else x[i]
        torch.testing.assert_close(out[i], ref, rtol=0, atol=0)
    assert torch.equal(out[3], x[3])  # penalty 1 is an exact no-op


def test_presence_frequency_match_openai_formula():
    x = _logits(3, seed=4)
    prompts = [[1, 1, 1], [2], [3]]  # prompt tokens are NOT penalised by these two
    outputs = [[5, 5, 5, 6], [2, 7, 7], []]
    pres, freq = [0.5, -1.0, 2.0], [0.3, 1.5, 2.0]
    ones = torch.ones(3)
    out = apply_penalties(
        x, _counts(prompts), _counts(outputs), ones, torch.tensor(pres), torch.tensor(freq)
    )
    for i in range(3):
        c = Counter(outputs[i])
        ref = [
            x[i, j].item() - c[j] * freq[i] - (1.0 if c[j] > 0 else 0.0) * pres[i] for j in range(V)
        ]
        torch.testing.assert_close(out[i], torch.tensor(ref), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[2], x[2])


def test_full_pipeline_matches_transformers_processors():
    """Penalty -> temperature -> top-k -> top-p -> min-p, row by row vs HF."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = _logits(5, seed=5)
    params = [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.2),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.5, top_k=5, min_p=0.1, repetition_penalty=0.9),
        SamplingParams(),
        SamplingParams(temperature=2.0, top_k=30, top_p=0.95, min_p=0.02, repetition_penalty=1.5),
    ]
    prompts = [[1, 2], [3], [4, 5, 6], [], [7]]
    outputs = [[8, 9], [10], [], [11], [12, 12]]
    _, filtered = Sampler().process_logits(x, _batch(params, prompts, outputs))
    for i, p in enumerate(params):
        procs = LogitsProcessorList()
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        procs.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(TopPLogitsWarper(p.top_p))
        if p.min_p > 0:
            procs.append(MinPLogitsWarper(p.min_p))
        ids = torch.tensor([prompts[i] + outputs[i]], dtype=torch.long)
        ref = procs(ids, x[i : i + 1].clone())[0]
        assert ((filtered[i] > NEG) == (ref > NEG)).all(), f"row {i}"
        torch.testing.assert_close(
            torch.softmax(filtered[i], -1), torch.softmax(ref, -1), rtol=1e-5, atol=1e-7
        )


# --------------------------------------------------------------------------- sampling


def test_greedy_is_argmax_for_any_dtype_and_does_not_mutate_input():
    x = _logits(6, seed=6)
    params = [SamplingParams(temperature=0)] * 6
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        xi = x.to(dt)
        before = xi.clone()
        out = Sampler().sample(xi, _batch(params))
        assert out.token_ids == xi.float().argmax(-1).tolist()
        assert torch.equal(xi, before)
    # top_k=1 at any temperature is greedy too
    out = Sampler().sample(x, _batch([SamplingParams(top_k=1, temperature=1.5)] * 6))
    assert out.token_ids == x.argmax(-1).tolist()


def test_greedy_uses_penalised_logits():
    x = torch.zeros(1, V)
    x[0, 3], x[0, 4] = 5.0, 4.0
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = Sampler().sample(x, _batch([p], prompts=[[3]], outputs=[[]]))
    assert out.token_ids == [4]  # 5/2 < 4


def _run(params_rows, gens, steps, table, starts):
    """Decode `steps` tokens with a fixed random bigram "model"."""
    b = len(params_rows)
    outputs = [[] for _ in range(b)]
    prompts = [[s, (s * 7) % V] for s in starts]
    sampler = Sampler()
    for _ in range(steps):
        last = [(o[-1] if o else pr[-1]) for o, pr in zip(outputs, prompts)]
        logits = table[torch.tensor(last)]
        out = sampler.sample(logits, _batch(params_rows, prompts, [list(o) for o in outputs], gens))
        for o, t in zip(outputs, out.token_ids):
            o.append(t)
    return outputs


def test_same_seed_same_tokens_alone_and_in_mixed_batch():
    table = _logits(V, seed=7, scale=3.0)
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, repetition_penalty=1.1, seed=1234)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, seed=99),
        SamplingParams(top_k=3),
        SamplingParams(min_p=0.2, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(top_p=0.5, seed=1234),  # same seed, other params, own generator
        SamplingParams(temperature=0.3, min_p=0.1, seed=5),
    ]
    steps = 24
    alone = _run([target], [make_generator(1234)], steps, table, [5])[0]
    for pos in (0, 4, 7):
        rows = others[:pos] + [target] + others[pos:]
        gens = [make_generator(p.seed) for p in rows]
        starts = [(11 * i) % V for i in range(8)]
        starts[pos] = 5
        got = _run(rows, gens, steps, table, starts)
        assert got[pos] == alone, f"target at row {pos}"
        # the greedy row equals its own solo greedy decode as well
        g_idx = 0 if pos != 0 else 1
        solo = _run([rows[g_idx]], [None], steps, table, [starts[g_idx]])[0]
        assert got[g_idx] == solo


def test_different_seeds_differ_and_same_seed_repeats():
    x = _logits(1, v=512, seed=8, scale=0.5)
    p = SamplingParams(temperature=1.0)

    def draw(seed):
        g = make_generator(seed)
        return [Sampler().sample(x, _batch([p], gens=[g])).token_ids[0] for _ in range(16)]

    a, b, c = draw(1), draw(2), draw(1)
    assert a == c
    assert a != b
    assert make_generator(None) is None
    g0, g1 = make_generator(7, index=0), make_generator(7, index=1)
    assert torch.equal(torch.rand(4, generator=g0), torch.rand(4, generator=make_generator(7)))
    assert not torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=make_generator(7)))


def _chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    n = len(tokens)
    c = Counter(tokens)
    stat = 0.0
    for j, p in enumerate(probs.tolist()):
        if p == 0:
            assert c[j] == 0, f"token {j} has zero probability but was drawn {c[j]} times"
            continue
        stat += (c[j] - n * p) ** 2 / (n * p)
    return stat


# chi-square critical values at alpha = 1e-3
_CHI2_999 = {4: 18.47, 9: 27.88}


def test_empirical_distribution_matches_softmax():
    n, v = 20_000, 10
    x = torch.linspace(-1.5, 1.5, v)[None, :] + 0.3 * _logits(1, v=v, seed=9)
    g = make_generator(2024)
    out = Sampler().sample(x.expand(n, v), _batch([SamplingParams()] * n, gens=[g] * n))
    assert _chi_square(out.token_ids, torch.softmax(x[0], -1)) < _CHI2_999[9]


def test_empirical_distribution_with_filters_and_unseeded_rng():
    n, v = 20_000, 10
    x = torch.linspace(-1.0, 1.0, v)[None, :]
    p = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    _, filtered = Sampler().process_logits(x, _batch([p]))
    expected = torch.softmax(filtered[0], -1)
    assert int((expected > 0).sum()) == 5  # top-k 6, then top-p trims one more
    with torch.random.fork_rng():  # the unseeded path uses torch's default RNG
        torch.manual_seed(0)
        out = Sampler().sample(x.expand(n, v), _batch([p] * n))
    assert _chi_square(out.token_ids, expected) < _CHI2_999[4]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop_id = 2, 9
    x = torch.zeros(1, V)
    x[0, eos], x[0, stop_id], x[0, 20] = 10.0, 9.0, 1.0
    sampler = Sampler()

    def pick(p, n_out):
        return sampler.sample(x, _batch([p], outputs=[[20] * n_out], eos=(eos,))).token_ids[0]

    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop_id])
    assert [pick(p, k) for k in range(5)] == [20, 20, 20, eos, eos]
    # ignore_eos: EOS is not an end, so it is not held back; stop ids still are
    q = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True)
    assert pick(q, 0) == eos
    x[0, eos] = -5.0
    assert pick(q, 0) == 20 and pick(q, 3) == stop_id
    # random rows never draw a masked token
    r = SamplingParams(min_tokens=2, seed=3)
    x[0, eos] = 10.0
    g = make_generator(3)
    draws = [sampler.sample(x, _batch([r], outputs=[[20]], gens=[g], eos=(eos,))).token_ids[0] for _ in range(200)]
    assert eos not in draws


def test_logprobs_are_raw_and_top_n_sorted():
    x = _logits(4, seed=10)
    params = [
        SamplingParams(temperature=0.2, top_k=3, repetition_penalty=2.0, logprobs=5, seed=1),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0),
        SamplingParams(logprobs=20, presence_penalty=2.0),
    ]
    out = Sampler().sample(
        x, _batch(params, prompts=[[1, 2]] * 4, outputs=[[3]] * 4, gens=[make_generator(1), None, None, None])
    )
    raw = torch.log_softmax(x, -1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-6)
        k = params[i].logprobs
        assert len(lp.top) == k
        vals, ids = raw[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert out.logprobs[1].top == []
    # bf16 logits: logprobs computed in float32 from the same values
    xb = x.to(torch.bfloat16)
    lb = Sampler().sample(xb, _batch([SamplingParams(temperature=0, logprobs=1)] * 4)).logprobs[0]
    assert lb.logprob == pytest.approx(torch.log_softmax(xb.float(), -1)[0, lb.token_id].item(), abs=1e-6)


def test_batch_shape_mismatch_is_a_programming_error():
    with pytest.raises(ValueError):
        SamplingBatch(params=[SamplingParams()], prompt_ids=[[], []], output_ids=[[]])
    with pytest.raises(ValueError):
        Sampler().sample(_logits(2), _batch([SamplingParams()]))


def test_history_may_be_tensors():
    x = _logits(2, seed=11)
    p = SamplingParams(temperature=0, repetition_penalty=3.0, frequency_penalty=1.0)
    as_lists = Sampler().sample(x, _batch([p, p], [[1, 2], [3]], [[4], []]))
    as_tensors = Sampler().sample(
        x, _batch([p, p], [torch.tensor([1, 2]), torch.tensor([3])], [torch.tensor([4]), torch.tensor([], dtype=torch.long)])
    )
    assert as_lists.token_ids == as_tensors.token_ids


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
])
def test_every_front_end_refuses_a_sampling_limit_with_the_same_line(field, value):
    """One table of limits (``SAMPLING_LIMITS``): ``LLM.generate``'s SamplingParams, the CLI's flags and the
    OpenAI and Ollama request bodies refuse the same value with the same one-line message."""
    from pydantic import ValidationError

    from llmsys.engine.cli.options import build_sampling
    from llmsys.engine.server.ollama import OllamaOptions
    from llmsys.engine.server.protocol import CompletionRequest, validation_message

    with pytest.raises(InvalidParameterError) as api:
        SamplingParams(**{field: value})
    line = str(api.value)
    assert line.startswith(f"sampling parameter {field}={value!r} is invalid: must be") and "\n" not in line
    with pytest.raises(InvalidParameterError) as cli:
        build_sampling({field: value})
    assert str(cli.value) == line
    with pytest.raises(ValidationError) as openai:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert validation_message(openai.value.errors()) == (f"invalid value for '{field}': {line}", field)
    ollama_name = {"repetition_penalty": "repeat_penalty"}.get(field, field)
    if (field, value) != ("top_p", 0.0):  # Ollama's top_p 0 is llama.cpp's "the most likely token"
        with pytest.raises(ValidationError) as ollama:
            OllamaOptions.model_validate({ollama_name: value})
        assert validation_message(ollama.value.errors()) == (f"invalid value for '{ollama_name}': {line}", ollama_name)
