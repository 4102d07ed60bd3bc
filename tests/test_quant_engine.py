"""Quantization inside the engine: load-time --quant, quantized checkpoints (llmsys/AWQ/GPTQ),
quantized embeddings, int8/int4 KV pools, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmsys import LLM, SamplingParams
from llmsys.kernels.common.errors import CheckpointError, InvalidParameterError
from llmsys.engine.loader.safetensors_io import SafetensorsFile, save_file
from llmsys.quant import parse_quant, quantize_linear
from llmsys.quant.embedding import QuantEmbedding
from llmsys.quant.int4 import Int4Linear, unpack_int4
from llmsys.quant.kv_paged import Int4Side
from tiny_models import make_hf_model

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_hf_model("llama", tmp_path_factory.mktemp("q-tiny"), seed=3)


def _llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(str(path), kv_cache_tokens=1024, max_num_seqs=4, progress=False, **kw)


@pytest.mark.parametrize("name", ["int8", "int4", "int4:g32", "nf4", "nf4:dq", "fp8"])
def test_rows_match_dequantized_weight(name):
    torch.manual_seed(0)
    m = quantize_linear(torch.randn(200, 172), None, parse_quant(name))
    ids = torch.tensor([0, 3, 63, 64, 127, 199])
    ref = m.dequantize()[ids]
    # int4 rows use the run-time (bf16 scale/zero) form, like the matmul kernel
    assert (m.rows(ids) - ref).abs().max().item() <= 0.01 * ref.abs().max().item()


def test_on_the_fly_quant_swaps_every_linear_and_ties_embedding(tiny):
    llm = _llm(tiny, quant="int4")
    model = llm.loaded.model
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert model.lm_head is model.model.embed_tokens.table or not llm.loaded.args.tie_word_embeddings
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    ref = _llm(tiny)
    assert llm.loaded.weight_bytes < 0.2 * ref.loaded.weight_bytes  # vs float32
    rep = llm.memory_report()
    assert sum(rep.weights.values()) == llm.loaded.weight_bytes


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_quantized_load_leaves_no_garbage_for_the_engine(tmp_path, monkeypatch, quant):
    """When the engine core (KV pool, backends) is built, nothing the load made is left in reference cycles
    for the cyclic collector: a bf16 SmolLM2-135M loaded as int8 peaked at 820 MiB RSS that way, 471 MiB
    collected first (`llmsys run`, benchmarks/bench_run_startup.py)."""
    import gc

    import llmsys.engine.llm as llm_mod

    found = []
    real = llm_mod.EngineCore

    def core(*args, **kwargs):
        found.append(gc.collect())  # what a collection would still free here
        return real(*args, **kwargs)

    monkeypatch.setattr(llm_mod, "EngineCore", core)
    path = make_hf_model("llama", tmp_path / "m", hidden_size=128, intermediate_size=320)
    LLM(str(path), dtype="bfloat16", quant=quant, progress=False, kv_cache_tokens=64)
    assert found == [0]


def test_int8_weights_track_float_logits(tiny):
    ids = list(range(5, 40))
    out = [_llm(tiny, quant=q).generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
           for q in ("none", "int8")]
    a = {t: lp for t, lp in out[0].logprobs[0].top}
    b = {t: lp for t, lp in out[1].logprobs[0].top}
    assert out[0].token_ids == out[1].token_ids
    assert max(abs(a[t] - b[t]) for t in a if t in b) < 0.05


def test_quantize_then_run_matches_on_the_fly(tiny, tmp_path):
    from llmsys.engine.cli.main import main

    out = tmp_path / "q4"
    assert main(["quantize", str(tiny), "--quant", "int4", "-o", str(out), "--threads", "2"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "int4:g64"
    names = SafetensorsFile(out / "model.safetensors").keys()
    assert "model.layers.0.mlp.down_proj.qweight" in names and not any(n.endswith("proj.weight") for n in names)
    a = _llm(out).generate("hello world", GREEDY)[0].token_ids
    b = _llm(tiny, quant="int4").generate("hello world", GREEDY)[0].token_ids
    assert a == b
    with pytest.raises(InvalidParameterError, match="already quantized"):
        _llm(out, quant="int8")


def test_corrupt_quantized_checkpoint_names_the_tensor(tiny, tmp_path):
    from llmsys.engine.cli.main import main

    out = tmp_path / "q8"
    assert main(["quantize", str(tiny), "--quant", "int8", "-o", str(out)]) == 0
    f = SafetensorsFile(out / "model.safetensors")
    state = {n: f.read(n) for n in f.keys()}
    bad = "model.layers.1.self_attn.o_proj.qweight"
    state[bad] = state[bad][:, :-8].contiguous()
    save_file(state, out / "model.safetensors")
    with pytest.raises(CheckpointError, match=bad.replace(".", r"\.")):
        _llm(out)
    del state["model.layers.0.mlp.up_proj.scales"]
    state[bad] = f.read(bad)
    save_file(state, out / "model.safetensors")
    with pytest.raises(CheckpointError, match="up_proj"):
        _llm(out)


def _pack_seq(v: torch.Tensor, dim: int) -> torch.Tensor:
    from test_quant_awq_gptq import pack_seq

    return pack_seq(v, dim)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_awq_gptq_directory_loads_into_int4(tiny, tmp_path, fmt):
    """Re-express our RTN int4 g32 layers as an AutoGPTQ/AutoAWQ checkpoint; the engine must read them back."""
    from test_quant_awq_gptq import pack_awq_cols

    g = 32
    src = SafetensorsFile(next(tiny.glob("*.safetensors")))
    state, ref_w = {}, {}
    for name in src.keys():
        t = src.read(name)
        if ".layers." in name and name.endswith("proj.weight"):
            prefix = name[: -len(".weight")]
            q = Int4Linear.from_float(t, group_size=g).canonical_tensors()
            codes = unpack_int4(q["qweight"])  # [N, K]
            zeros = q["zeros"].to(torch.int64)  # [N, G]
            scales = q["scales"].half()  # [N, G]
            ref_w[prefix] = ((codes.float().view(t.shape[0], -1, g) - zeros[..., None]) * scales.float()[..., None]).view_as(t)
            if fmt == "gptq":
                state[prefix + ".qweight"] = _pack_seq(codes.t(), 0)  # [K/8, N]
                state[prefix + ".qzeros"] = _pack_seq((zeros - 1).t(), 1)  # [G, N/8], v1 stores zero - 1
                state[prefix + ".g_idx"] = torch.arange(t.shape[1], dtype=torch.int32) // g
            else:
                state[prefix + ".qweight"] = pack_awq_cols(codes.t())  # [K, N/8]
                state[prefix + ".qzeros"] = pack_awq_cols(zeros.t())  # [G, N/8]
            state[prefix + ".scales"] = scales.t().contiguous()  # [G, N]
        else:
            state[name] = t.half()
    out = tmp_path / fmt
    out.mkdir()
    save_file(state, out / "model.safetensors")
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": fmt, "bits": 4, "group_size": g, "version": "gemm",
                                  "desc_act": False, "sym": False, "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(cfg))
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    llm = _llm(out)
    model = llm.loaded.model
    for prefix, w in ref_w.items():
        layer = model.get_submodule(prefix)
        assert isinstance(layer, Int4Linear)
        torch.testing.assert_close(layer.dequantize(), w, atol=1e-6, rtol=0)
    assert llm.generate("hello", GREEDY)[0].token_ids  # runs end to end
    cfg["quantization_config"]["bits"] = 3
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="bits=3"):
        _llm(out)


def test_unknown_names_list_the_valid_ones(tiny):
    with pytest.raises(InvalidParameterError, match="valid: none, int8, int8:g32, int4"):
        _llm(tiny, quant="int3")
    with pytest.raises(InvalidParameterError, match="valid: auto, int8, int4"):
        _llm(tiny, kv_dtype="fp4")


def test_fp8_on_cpu_falls_back_with_one_notice(tiny, capsys):
    llm = _llm(tiny, quant="fp8")
    assert llm.generate("hi", GREEDY)[0].token_ids
    err = capsys.readouterr().err
    assert err.count("notice: fp8") == 1 and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kv,mean_err", [("int8", 0.01), ("int4", 0.1)])
def test_quantized_kv_pool_scores_like_float(tiny, kv, mean_err):
    from llmsys.engine.scoring import score_sequences

    ref = _llm(tiny)
    llm = _llm(tiny, kv_dtype=kv)
    assert llm.core.kv.spec.bytes_per_token < 0.4 * ref.core.kv.spec.bytes_per_token
    seqs = [list(range(3, 120)), list(range(200, 260))]  # 117 tokens: an open (partial) tail block
    for a, b in zip(score_sequences(ref.core, seqs), score_sequences(llm.core, seqs)):
        assert (a - b).abs().mean().item() < mean_err  # measured: int8 0.003, int4 0.04
    assert llm.generate(["hello world", "a b c"], GREEDY)[1].token_ids  # decode path runs


@pytest.mark.parametrize("kv", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_kv_prompt_is_batch_invariant(tiny, kv, dtype):
    """A prompt's log-probabilities (its logits' log-softmax) with quantized KV are bit-identical whether it is
    prefilled alone or in one step with a longer prompt: every pool runs prompt attention per sequence, unpadded."""
    from llmsys.engine.scoring import score_sequences

    llm = _llm(tiny, kv_dtype=kv, dtype=dtype)
    short, long = list(range(3, 40)), list(range(100, 190))
    alone = score_sequences(llm.core, [short])[0]
    together = score_sequences(llm.core, [short, long])[0]
    assert torch.equal(alone, together)


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_weights_prompt_is_batch_invariant(tiny, quant, dtype):
    """A short prompt's log-probabilities with int8 / int4 weights are bit-identical alone and in one step
    with a longer prompt (a 17-row call alone, 107 rows together): every row of a quantized CPU layer
    runs the same a8 arithmetic, whatever the call's size. With a8 for decode-sized calls only and
    bf16 x above, they differed by up to 0.19."""
    from llmsys.engine.scoring import score_sequences

    llm = _llm(tiny, quant=quant, dtype=dtype)
    short, long = list(range(3, 20)), list(range(100, 190))
    alone = score_sequences(llm.core, [short])[0]
    together = score_sequences(llm.core, [short, long])[0]
    assert torch.equal(alone, together)


def test_int4_side_window_and_block_quantization():
    torch.manual_seed(0)
    nb, bs, hk, d = 6, 16, 2, 8
    x = torch.randn(40, hk, d) * torch.tensor([1.0, 5, 0.1, 1, 1, 20, 1, 1])  # outlier channels
    slots = torch.arange(16, 56)  # blocks 1, 2 full; block 3 has 8 tokens (open)
    one = Int4Side("key", nb, bs, hk, d, torch.device("cpu"), torch.float32)
    for t in range(40):  # decode-style writes, one token at a time
        one.store(x[t : t + 1], slots[t : t + 1])
    bulk = Int4Side("key", nb, bs, hk, d, torch.device("cpu"), torch.float32)
    bulk.store(x, slots)  # prefill-style: whole blocks quantized directly
    g1, g2 = one.gather(slots[None], torch.float32)[0], bulk.gather(slots[None], torch.float32)[0]
    torch.testing.assert_close(g1, g2)
    assert torch.equal(g1[32:], x[32:])  # the open block is the full-precision window
    rng = x[:32].view(2, bs, hk, d).amax(1) - x[:32].view(2, bs, hk, d).amin(1)  # per block, per channel
    err = (g1[:32] - x[:32]).abs().view(2, bs, hk, d)
    assert bool((err <= rng[:, None] / 15 * 0.51 + 1e-3).all())
    bulk.store(x[:1] * 0 + 7, slots[:1])  # offset 0 rewritten: a new owner reopens block 1
    assert bulk.gather(slots[None, :1], torch.float32)[0, 0].eq(7).all()


SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def test_refinement_forward_is_the_engine_model(tiny):
    """The refinement trains through the model's own forward with every linear, the embedding and the
    norms swapped for float32 differentiable copies: with the float weights it scores like the engine,
    gradients reach every swapped weight, and the swap leaves the model as it was."""
    from torch import nn

    from llmsys.engine.quantize import EMBED, _DenseEmbedding, _DenseLinear, _Swap, model_hidden
    from llmsys.engine.scoring import score_sequences

    llm = _llm(tiny)
    model = llm.loaded.model
    seqs = [list(range(3, 60)), list(range(100, 157))]
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    w = {n: sd[n + ".weight"].requires_grad_(True) for n in names}
    norms = {k[: -len(".weight")]: nn.Parameter(v) for k, v in sd.items()
             if "norm.weight" in k and ".self_attn." not in k}
    embed = sd["model.embed_tokens.weight"].requires_grad_(True)
    before = {n: type(m) for n, m in model.named_modules()}
    swap = _Swap(model, {**{n: _DenseLinear(lambda t=w[n]: t, model.get_submodule(n).bias) for n in names},
                         EMBED: _DenseEmbedding(lambda ids: embed[ids])}, norms)
    with torch.enable_grad(), swap:
        lp = torch.log_softmax(model.compute_logits(model_hidden(model, torch.tensor(seqs))).view(2, 57, -1), -1)  # [2, 57, V]
        lp[:, :, 7].sum().backward()
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in [*w.values(), embed, *norms.values()])
    for s, ref, row in zip(seqs, score_sequences(llm.core, seqs), lp.detach()):
        got = row[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_training_forward_matches_the_engine_forward(family, tmp_path):
    """The refinement's batched attention (``train_hidden``) gives the engine forward's hidden states (GQA,
    q/k/v biases, q/k norms) to float rounding, and gradients through it match too."""
    from llmsys.engine.quantize import model_hidden, train_hidden

    model = _llm(make_hf_model(family, tmp_path / family, seed=4), prepack=False).loaded.model
    ids = torch.randint(3, 200, (3, 37), generator=torch.Generator().manual_seed(0))
    norm = model.model.layers[0].input_layernorm
    w = torch.nn.Parameter(norm.weight.detach().float().clone())
    saved, norm.weight = norm.weight, w
    try:
        outs, grads = [], []
        for fn in (model_hidden, train_hidden):
            with torch.enable_grad():
                h = fn(model, ids)
                (h * torch.arange(h.numel()).view_as(h).cos()).sum().backward()
            outs.append(h.detach())
            grads.append(w.grad.clone())
            w.grad = None
    finally:
        norm.weight = saved
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-3, rtol=1e-4)


def test_self_generated_calibration_is_seeded_batched_sampling(tiny):
    """Calibration text sampled side by side: BOS first, the requested length, the same text for the same
    seed, another for another seed; rows sampled a few at a time (a model too large for all at once)
    are sequences of the same shape."""
    from llmsys.engine.quantize import _sample_batched, self_generated_calibration

    llm = _llm(tiny, prepack=False)
    bos = llm.tokenizer.bos_token_id
    a = self_generated_calibration(llm, 6, 20, seed=3)
    assert len(a) == 6 and all(len(s) == 20 and s[0] == bos for s in a)
    assert self_generated_calibration(llm, 6, 20, seed=3) == a
    assert self_generated_calibration(llm, 6, 20, seed=4) != a
    assert len({tuple(s) for s in a}) == 6
    one = _sample_batched(llm.loaded.model, 6, 20, [bos], 3, False, batch_bytes=1)  # one row at a time
    assert len(one) == 6 and all(len(s) == 20 and s[0] == bos for s in one)


def test_calibrated_int4_beats_rtn_on_stories260k():
    """GPTQ + distillation refinement (the `--method gptq` recipe) must beat round-to-nearest."""
    from llmsys.engine.quantize import gptq_calibrate, refine_quantized, self_generated_calibration
    from llmsys.engine.scoring import perplexity_windows

    model_dir, corpus = SHARED / "models" / "stories260k-hf", SHARED / "corpus" / "tinystories-valid.txt"
    if not (model_dir / "model.safetensors").is_file() or not corpus.is_file():
        pytest.skip(f"stories260k-hf / tinystories-valid.txt not found under {SHARED}")

    def ppl(llm) -> float:
        ids = llm.tokenizer.encode(corpus.read_text(encoding="utf-8")[:20000], add_special_tokens=False)[:3000]
        return perplexity_windows(llm.core, ids, 256, llm.tokenizer.bos_token_id).perplexity

    torch.set_num_threads(1)  # many small ops: 2 threads on the shared 2-core box were ~10x slower (conftest resets)
    rtn = ppl(LLM(str(model_dir), dtype="float32", kv_cache_tokens=8192, progress=False, quant="int4"))
    llm = LLM(str(model_dir), dtype="float32", kv_cache_tokens=8192, progress=False)
    base = ppl(llm)
    model = llm.loaded.model
    seqs = self_generated_calibration(llm, 16, 128, seed=0)  # model-written: disjoint from the scored text
    teacher = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gptq_calibrate(model, seqs, parse_quant("int4"))
    plain = ppl(llm)
    rep = refine_quantized(model, teacher, seqs, steps=30)
    tuned = ppl(llm)
    assert isinstance(model.lm_head, Int4Linear) and model.model.embed_tokens.table is model.lm_head
    assert rep.kl_after < 0.8 * rep.kl_before, rep
    assert base < tuned < plain < rtn, (base, tuned, plain, rtn)
    assert tuned - base < 0.75 * (rtn - base), (base, tuned, rtn)


@pytest.mark.parametrize("quant,dtype", [("int8", "float32"), ("int8", "bfloat16"), ("int4", "bfloat16")])
def test_fused_quantized_projections_give_the_separate_layers_bits(tmp_path, quant, dtype):
    """A CPU engine fuses quantized q|k|v and gate|up too (``cat_rows``); one that does not
    (``prepack: False``, as ``llmsys quantize`` runs) computes the same logprobs, bit for bit,
    through both the decode GEMV (one row) and the prefill path (many rows)."""
    path = make_hf_model("qwen2", tmp_path / "m", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2)  # k/v: 128 rows, a multiple of int4's 64-row tiles
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [list(range(5, 45)), [7, 8, 9]]
    runs = []
    for prepack in (True, False):
        llm = LLM(str(path), dtype=dtype, quant=quant, progress=False, kv_cache_tokens=256, prepack=prepack)
        layer = llm.loaded.model.model.layers[0]
        assert (layer.self_attn.qkv_proj is not None) == prepack and (layer.mlp.gate_up_proj is not None) == prepack
        outs = llm.generate(prompts, sp)
        runs.append([(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs])
    assert runs[0] == runs[1]


_KERNELS_CHILD = """
import json, sys
from llmsys import LLM
llm = LLM(sys.argv[1], dtype="float32", quant="int4", kv_cache_tokens=256, progress=False)
print(json.dumps(llm.memory_report().kernels))
"""


def test_int4_layers_report_their_kernel(tiny):
    """Every layer picks its kernel once, at load; memory_report() counts them per kernel name,
    and with the C kernels switched off (LLMSYS_NO_CKERNELS=1, a fresh process) the torch path."""
    import os
    import subprocess
    import sys

    from llmsys.kernels import quant_matmul_support

    llm = _llm(tiny, quant="int4")
    layers = [m for m in llm.loaded.model.modules() if isinstance(m, Int4Linear)]
    c = quant_matmul_support()
    if c.available:
        want = f"C int4 a8 {c.level}"
    else:
        want = "torch int4 dequant + bf16 GEMM"
    assert layers and llm.memory_report().kernels == {want: len(layers)}
    assert all(m.kernel.name == want for m in layers)
    env = {**os.environ, "LLMSYS_NO_CKERNELS": "1"}
    res = subprocess.run([sys.executable, "-c", _KERNELS_CHILD, str(tiny)], env=env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"torch int4 dequant + bf16 GEMM": len(layers)}
