"""The decoder's one forward with its fused CPU decode ops equals the op-by-op decoder bit for bit.

What the forward fuses (engine/models/base.py, engine/attention.py): RMSNorm with the residual add
before it, RoPE + the K/V store in one C call, decode attention reading the pool by slot, for layers whose
projections run a C GEMV at decode (int8 / int4, bf16, float32 weights too small to pack) the whole layer
around attention in two C calls (DecoderLayer._forward_fused), and where every layer does, the whole
decoder in one (the decode plan's stack, engine/models/decode_plan.py). The reference below is the decoder as separate ``kernels`` ops,
the way the module path ran them.
"""

from __future__ import annotations

import pytest
import torch

from conftest import STORIES_HF, need_shared
from tiny_models import make_hf_model


def _reference(model, kv, meta, ids, pos) -> torch.Tensor:  # [T, hidden] float32
    """One step as separate ops: norm, projections, RoPE, store, paged attention, o, norm + residual, MLP, add."""
    from llmsys import kernels
    from llmsys.kernels.cpu_attention import paged_attention_gathered

    T = ids.shape[0]
    h = model.model.embed_tokens(ids)
    for i, layer in enumerate(model.model.layers):
        at, n1, n2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
        x = kernels.rms_norm(h, n1.weight, n1.eps)
        q, k, v = at.project(x)
        q, k = kernels.rope(q, k, pos, model.rope_cache)
        kernels.kv_store(k, v, kv.k[i], kv.v[i], meta.slot_mapping)
        o = paged_attention_gathered(q, kv.k[i], kv.v[i], meta.plan, at.scale)
        a = at.o_proj(o.reshape(T, at.n_heads * at.head_dim))
        x, h = kernels.rms_norm(a, n2.weight, n2.eps, h)
        h = h + layer.mlp.down_proj(layer.mlp.act(x))
    return model.model.norm.forward_f32(h)  # the final norm: float32 out, the LM head's input (exact logits)


def _step_both(llm, lens: list[int], seed: int = 0):
    """One decode step of ``len(lens)`` sequences, op by op and through the engine -> (hidden, K, V) pairs."""
    core, model = llm.core, llm.loaded.model
    bs = core.kv.spec.block_size
    g = torch.Generator().manual_seed(seed)
    tables = [core.allocator.allocate(-(-n // bs)) for n in lens]
    try:
        for t in core.kv.k + core.kv.v:
            t.normal_(generator=g)
        meta = core.attn.metadata([1] * len(lens), lens, tables)
        ids = torch.randint(0, model.args.vocab_size, (len(lens),), generator=g)
        pos = torch.tensor([n - 1 for n in lens])
        out = []
        with torch.inference_mode():
            for run in (lambda: _reference(model, core.kv, meta, ids, pos), lambda: model(ids, pos, core.attn, meta)):
                h = run()
                out.append((h, [k.clone() for k in core.kv.k], [v.clone() for v in core.kv.v]))
            dp = model.decode_plan  # the whole decoder in one C call: a plan with a stack, on a plain decode step
            stacked = dp is not None and dp.stack is not None and meta.plan.one_call
    finally:
        for t in tables:
            core.allocator.free(t)
    return out, stacked


@pytest.mark.parametrize(
    "kind,overrides,dtype,fuses,quant",
    [
        ("llama", {}, "float32", True, None),  # small plain float32 weights: the C float32 GEMV, fused layers
        ("qwen2", {}, "float32", True, None),  # q/k/v biases
        ("qwen3", {}, "float32", True, None),  # per-head q/k norms (fused layers, attention per layer)
        ("llama", {"hidden_size": 256, "intermediate_size": 512}, "float32", False, None),  # prepacked (oneDNN)
        ("llama", {}, "bfloat16", True, None),  # bf16: the C bf16 GEMV, fused layers
        ("qwen2", {"hidden_size": 256, "intermediate_size": 512}, "bfloat16", True, None),  # biases
        ("qwen3", {}, "bfloat16", True, None),
        # int8 / int4: the fused a8 layers (two C calls around attention), biases and q/k norms included
        ("llama", {"hidden_size": 128, "intermediate_size": 320}, "bfloat16", True, "int4"),
        ("qwen2", {"hidden_size": 128, "intermediate_size": 320}, "bfloat16", True, "int8"),
        ("qwen3", {"hidden_size": 128, "intermediate_size": 320}, "bfloat16", True, "int4"),
    ],
)
def test_fused_decode_is_bit_identical(tmp_path, kind, overrides, dtype, fuses, quant):
    from llmsys import LLM, kernels

    path = make_hf_model(kind, tmp_path / kind, **overrides)
    llm = LLM(str(path), dtype=dtype, progress=False, block_size=4, kv_cache_tokens=256, quant=quant)
    layers = llm.loaded.model.model.layers
    # The fused decode layers take decode-sized steps whose projections all run a C GEMV (int8 / int4
    # layers, bf16 ones, float32 ones too small to pack); the reference below runs the same layers op by op.
    fuses = fuses and kernels.cpu_fused_available()
    assert all((layer.decode is not None) == fuses for layer in layers)  # decided once, when the engine was built
    for lens in ([9], [3, 17, 8], [12, 12]):  # one sequence; unequal lengths (masked); equal lengths
        ((h0, k0, v0), (h1, k1, v1)), stacked = _step_both(llm, lens)
        # the whole decoder in one C call (kernels.decode_stack) where every layer fuses and has no q/k norms
        assert stacked == (fuses and kind != "qwen3")
        assert torch.equal(h0, h1)
        assert all(torch.equal(a, b) for a, b in zip(k0 + v0, k1 + v1))  # the same K/V written


def test_fused_decode_only_where_it_applies(tmp_path):
    from llmsys import LLM, kernels
    from llmsys.engine.attention import CpuInt8Backend

    path = make_hf_model("llama", tmp_path / "m")
    fp16 = LLM(str(path), dtype="float16", progress=False, kv_cache_tokens=256)
    # float16 has no C GEMV: its layers run op by op
    assert all(layer.decode is None for layer in fp16.loaded.model.model.layers)
    llm = LLM(str(path), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256)
    model, attn = llm.loaded.model, llm.core.attn
    t = [[1, 2], [3]]
    assert (model.decode_plan is not None and model.decode_plan.stack is not None) == kernels.cpu_fused_available()
    # the whole decoder in one C call for a plain decode step, not for a prompt chunk
    assert attn.metadata([1, 1], [5, 3], t).plan.one_call
    assert not attn.metadata([2, 1], [5, 3], t).plan.one_call
    # A KV policy's attention is not bypassed by the fused decode: a scoring step collects its rows.
    blocks = llm.core.allocator.allocate(1)
    try:
        meta = attn.metadata([1], [3], [blocks], score_from=[0])
        with torch.inference_mode():
            model(torch.tensor([5]), torch.tensor([2]), attn, meta)
        assert meta.scores.rows[0] is not None and meta.scores.rows[0].shape == (1, 3)
    finally:
        llm.core.allocator.free(blocks)
    int8 = LLM(str(path), dtype="float32", progress=False, kv_cache_tokens=256, kv_dtype="int8")
    assert type(int8.core.attn) is CpuInt8Backend  # the int8 pool's own attention, dequantizing in the gather


def test_stories260k_tokens_and_logprobs_unchanged(monkeypatch):
    """Generation through the one-call decode stack gives the tokens and logprobs of the fused layers one by
    one and of the op-by-op decoder, exactly (stories260k, float32: small plain weights, the C float32 GEMV)."""
    from dataclasses import replace

    from llmsys import LLM, SamplingParams, kernels
    from llmsys.engine.models.decode_plan import clear_decode_plan

    need_shared(STORIES_HF)
    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, kv_cache_tokens=1024)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    prompts = ["Once upon a time", "The cat", "Lily and Tom went to the park"]
    model = llm.loaded.model
    calls = []
    stack = kernels.decode_stack
    monkeypatch.setattr(kernels, "decode_stack", lambda *a: calls.append(1) or stack(*a))
    runs = [llm.generate(prompts, sp)]
    assert bool(calls) == kernels.cpu_fused_available()  # the stack ran
    if model.decode_plan is not None:
        model.decode_plan = replace(model.decode_plan, stack=None)
    runs.append(llm.generate(prompts, sp))  # the fused layers one by one
    clear_decode_plan(model)
    runs.append(llm.generate(prompts, sp))  # op by op
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.token_ids == b.token_ids
            assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_scoring_policy_decodes_through_the_fused_layers(tmp_path, dtype):
    """H2O scores every decode step (the scoring decorator's attention) while the layers run fused: the
    decorator takes the fused layer's attention call with its sinks argument (it raised TypeError for bf16
    before), and the eviction runs on the scores."""
    from llmsys import LLM, SamplingParams

    path = make_hf_model("llama", tmp_path / "m")
    llm = LLM(str(path), dtype=dtype, progress=False, kv_cache_tokens=256, kv_policy="h2o:24,recent:8")
    out = llm.generate(["hello world"] * 2, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 60 for o in out)


def test_decode_plan_is_decided_once_and_rebuilt_on_request(tmp_path):
    """The decode plan is built once with the engine and kept from step to step (no per-step check of what
    its pointers point into). A weight rebound afterwards is not seen by the old plan, which still holds the
    old tensor (it reads the old weight, never freed memory); building the plan again takes the new weight and
    gives the op-by-op reference's bits."""
    from llmsys import LLM, kernels
    from llmsys.engine.models.decode_plan import build_decode_plan

    if not kernels.cpu_fused_available():
        pytest.skip("the C decode kernels are not built on this machine")
    path = make_hf_model("llama", tmp_path / "m")
    llm = LLM(str(path), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256)
    model = llm.loaded.model
    first = model.decode_plan
    ((h0, _, _), (h1, _, _)), stacked = _step_both(llm, [9])
    assert stacked and torch.equal(h0, h1)
    ((h0, _, _), (h1, _, _)), _ = _step_both(llm, [7])
    assert model.decode_plan is first and torch.equal(h0, h1)  # the same plan: nothing asked again
    down = model.model.layers[1].mlp.down_proj
    name = "weight" if "weight" in down._parameters else next(iter(down._buffers))
    table = down._parameters if name in down._parameters else down._buffers
    old = table[name]
    new = old.detach().clone() * 2  # another tensor: the old pointer would read the old values
    table[name] = torch.nn.Parameter(new, requires_grad=False) if isinstance(old, torch.nn.Parameter) else new
    del old
    ((h0, _, _), (h1, _, _)), _ = _step_both(llm, [9])
    assert not torch.equal(h0, h1)  # the reference reads the new weight; the old plan the old one, still alive
    build_decode_plan(model, llm.core.attn)
    ((h0, _, _), (h1, _, _)), stacked = _step_both(llm, [9])
    assert stacked and model.decode_plan is not first and torch.equal(h0, h1)


