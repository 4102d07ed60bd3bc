"""The CPU fast decode step (engine/models/fast_decode.py) equals the module path bit for bit."""

from __future__ import annotations

import pytest
import torch

from conftest import STORIES_HF, need_shared
from tiny_models import make_hf_model


def _step_both(llm, lens: list[int], seed: int = 0):
    """One decode step of ``len(lens)`` sequences through both paths -> (hidden, K pool) pairs."""
    from llmsys.engine.attention import build_metadata

    core, model = llm.core, llm.loaded.model
    fast = model.fast_decode
    bs = core.kv.spec.block_size
    g = torch.Generator().manual_seed(seed)
    tables = [core.allocator.allocate(-(-n // bs)) for n in lens]
    try:
        for t in core.kv.k + core.kv.v:
            t.normal_(generator=g)
        meta = build_metadata([1] * len(lens), lens, tables, bs, core.loaded.device)
        ids = torch.randint(0, model.args.vocab_size, (len(lens),), generator=g)
        pos = torch.tensor([n - 1 for n in lens])
        out = []
        with torch.inference_mode():
            for f in (None, fast):
                model.fast_decode = f
                h = model(ids, pos, core.kv, meta)
                out.append((h, [k.clone() for k in core.kv.k], [v.clone() for v in core.kv.v]))
    finally:
        model.fast_decode = fast
        for t in tables:
            core.allocator.free(t)
    return out


@pytest.mark.parametrize(
    "kind,overrides,dtype,fused",
    [
        ("llama", {}, "float32", True),  # small plain weights: fused q|k|v and gate|up GEMMs
        ("qwen2", {}, "float32", False),  # q/k/v biases: the layers' own projections
        ("qwen3", {}, "float32", False),  # per-head q/k norms
        ("llama", {"hidden_size": 256, "intermediate_size": 512}, "float32", False),  # prepacked (oneDNN) weights
        ("llama", {}, "bfloat16", False),  # bf16: the layers' projections, float32 RoPE and attention
        ("qwen2", {"hidden_size": 256, "intermediate_size": 512}, "bfloat16", False),  # prepacked bf16, biases
        ("qwen3", {}, "bfloat16", False),
    ],
)
def test_fast_decode_is_bit_identical(tmp_path, kind, overrides, dtype, fused):
    from llmsys import LLM

    path = make_hf_model(kind, tmp_path / kind, **overrides)
    llm = LLM(str(path), dtype=dtype, progress=False, block_size=4, kv_cache_tokens=256)
    fast = llm.loaded.model.fast_decode
    assert fast is not None and all((layer.qkv is not None) == fused for layer in fast.layers)
    for lens in ([9], [3, 17, 8], [12, 12]):  # one sequence; unequal lengths (masked); equal lengths
        (h0, k0, v0), (h1, k1, v1) = _step_both(llm, lens)
        assert torch.equal(h0, h1)
        assert all(torch.equal(a, b) for a, b in zip(k0 + v0, k1 + v1))  # the same K/V written


def test_fast_decode_only_where_it_applies(tmp_path):
    from llmsys import LLM
    from llmsys.engine.attention import build_metadata

    path = make_hf_model("llama", tmp_path / "m")
    fp16 = LLM(str(path), dtype="float16", progress=False, kv_cache_tokens=256)
    assert fp16.loaded.model.fast_decode is None  # float32 and bfloat16 decoders only
    llm = LLM(str(path), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256)
    fast, kv = llm.loaded.model.fast_decode, llm.core.kv
    t = [[1, 2], [3]]
    assert fast.accepts(kv, build_metadata([1, 1], [5, 3], t, 4, torch.device("cpu")))
    assert not fast.accepts(kv, build_metadata([2, 1], [5, 3], t, 4, torch.device("cpu")))  # a prompt chunk
    meta = build_metadata([1], [3], [[3]], 4, torch.device("cpu"))
    meta.policy_attn = lambda *a: None  # a KV policy's attention override
    assert not fast.accepts(kv, meta)
    int8 = LLM(str(path), dtype="float32", progress=False, kv_cache_tokens=256, kv_dtype="int8")
    assert not int8.loaded.model.fast_decode.accepts(int8.core.kv, build_metadata([1], [3], [[3]], 16, torch.device("cpu")))


def test_stories260k_tokens_and_logprobs_unchanged():
    """Generation with the fast path gives the tokens and logprobs of the module path exactly."""
    from llmsys import LLM, SamplingParams

    need_shared(STORIES_HF)
    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, kv_cache_tokens=1024)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    prompts = ["Once upon a time", "The cat", "Lily and Tom went to the park"]
    fast = llm.generate(prompts, sp)
    model = llm.loaded.model
    keep, model.fast_decode = model.fast_decode, None
    try:
        plain = llm.generate(prompts, sp)
    finally:
        model.fast_decode = keep
    for a, b in zip(fast, plain):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
