"""The decoder's one forward with its fused CPU decode ops equals the op-by-op decoder bit for bit.

What the forward fuses (engine/models/base.py, engine/attention.py): RMSNorm with the residual add
before it, RoPE + the K/V store in one C call, decode attention reading the pool by slot, for layers whose
projections run a C GEMV at decode (int8 / int4, bf16, float32 weights too small to pack) the whole layer
around attention in two C calls (DecoderLayer._forward_fused), and where every layer does, the whole
decoder in one (DecoderModel.decode_stack). The reference below is the decoder as separate ``kernels`` ops,
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
            stacked = model.decode_stack(model.embed(ids), core.attn.for_step(meta), meta) is not None
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
    if kernels.cpu_fused_available():
        h = torch.zeros(3, overrides.get("hidden_size", 64), dtype=getattr(torch, dtype))  # a decode step of 3 sequences
        with torch.inference_mode():
            assert all((layer.decode_layer(h) is not None) == fuses for layer in layers)
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
    h16 = torch.zeros(1, 64, dtype=torch.float16)
    with torch.inference_mode():  # float16 has no C GEMV: its layers run op by op
        assert all(layer.decode_layer(h16) is None for layer in fp16.loaded.model.model.layers)
    llm = LLM(str(path), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256)
    model, attn = llm.loaded.model, llm.core.attn
    t = [[1, 2], [3]]
    h = torch.zeros(2, 64)
    with torch.inference_mode():  # the whole decoder in one C call for a decode step, not for a prompt chunk
        meta = attn.metadata([1, 1], [5, 3], t)
        assert (model.decode_stack(h, attn.for_step(meta), meta) is not None) == kernels.cpu_fused_available()
        meta = attn.metadata([2, 1], [5, 3], t)
        assert model.decode_stack(torch.zeros(3, 64), attn.for_step(meta), meta) is None
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
    from llmsys import LLM, SamplingParams, kernels
    from llmsys.engine.models.base import DecoderLayer, DecoderModel

    need_shared(STORIES_HF)
    llm = LLM(str(STORIES_HF), dtype="float32", progress=False, kv_cache_tokens=1024)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    prompts = ["Once upon a time", "The cat", "Lily and Tom went to the park"]
    runs = [llm.generate(prompts, sp)]
    assert (llm.loaded.model._stack is not None) == kernels.cpu_fused_available()  # the stack ran
    monkeypatch.setattr(DecoderModel, "decode_stack", lambda self, h, attn, meta: None)
    runs.append(llm.generate(prompts, sp))  # the fused layers one by one
    monkeypatch.setattr(DecoderLayer, "decode_layer", lambda self, h: None)
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


def test_decode_stack_follows_a_rebound_weight(tmp_path):
    """The decoder-in-one-call arguments are reused from step to step while every tensor they point into is
    still bound where it was; a weight rebound in between (a loader or the offload runtime binding another
    tensor) makes the next step rebuild them and use the new weight: the op-by-op reference's bits again."""
    from llmsys import LLM, kernels

    if not kernels.cpu_fused_available():
        pytest.skip("the C decode kernels are not built on this machine")
    path = make_hf_model("llama", tmp_path / "m")
    llm = LLM(str(path), dtype="float32", progress=False, block_size=4, kv_cache_tokens=256)
    model = llm.loaded.model
    ((h0, _, _), (h1, _, _)), stacked = _step_both(llm, [9])
    assert stacked and torch.equal(h0, h1)
    first = model._stack
    ((h0, _, _), (h1, _, _)), _ = _step_both(llm, [7])
    assert model._stack is first and torch.equal(h0, h1)  # reused: nothing was rebound
    down = model.model.layers[1].mlp.down_proj
    name = "weight" if "weight" in down._parameters else next(iter(down._buffers))
    table = down._parameters if name in down._parameters else down._buffers
    old = table[name]
    new = old.detach().clone() * 2  # another tensor: the old pointer would read the old values
    table[name] = torch.nn.Parameter(new, requires_grad=False) if isinstance(old, torch.nn.Parameter) else new
    ((h0, _, _), (h1, _, _)), stacked = _step_both(llm, [9])
    assert stacked and model._stack is not first
    assert torch.equal(h0, h1)  # the reference reads the new weight, and so does the rebuilt stack
    assert not torch.equal(h0, _step_both_with(old, table, name, llm)), "the doubled weight changes the output"


def _step_both_with(old, table, name, llm) -> torch.Tensor:
    """The reference hidden state of the same step with ``old`` bound back at ``table[name]``."""
    table[name] = old
    ((h0, _, _), _), _ = _step_both(llm, [9])
    return h0
