"""Every architecture against Hugging Face transformers on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmsys.engine.attention import make_backend
from llmsys.engine.kv_cache import KVCacheSpec, make_kv_pool
from llmsys.engine.loader import load_model
from tiny_models import ARCH_CONFIGS, make_hf_model

ARCHS = list(ARCH_CONFIGS)


def llmsys_logits(loaded, prompt: list[int], cont: list[int], backend=None) -> list[torch.Tensor]:
    """Prefill ``prompt`` then decode ``cont`` one token at a time; logits [V] per step.

    ``backend``: an attention backend class to use instead of the device's (``make_backend``)."""
    a = loaded.args
    bs = 16
    spec = KVCacheSpec(a.num_hidden_layers, 16, bs, a.num_key_value_heads, a.head_dim, loaded.dtype)
    pool = make_kv_pool(spec, loaded.device)
    attn = make_backend(pool, loaded.device, bs) if backend is None else backend(pool, bs, loaded.device)
    table = list(range(1, 9))
    out = []
    tokens = list(prompt)
    with torch.inference_mode():
        n = len(prompt)
        meta = attn.metadata([n], [n], [table])
        h = loaded.model(torch.tensor(prompt), torch.arange(n), attn, meta)
        out.append(loaded.model.compute_logits(h[-1:])[0])
        for t in cont:
            tokens.append(t)
            L = len(tokens)
            meta = attn.metadata([1], [L], [table])
            h = loaded.model(torch.tensor([t]), torch.tensor([L - 1]), attn, meta)
            out.append(loaded.model.compute_logits(h)[0])
    return out


def worst_logit_diff(path: Path, hf) -> float:
    """Max |logit difference| of llmsys (float32, CPU) against transformers' ``hf`` over a 32-token prefill
    and 32 decode steps (``hf`` fed the ids only)."""
    loaded = load_model(path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (32,), generator=g).tolist()
    cont = torch.randint(3, 512, (32,), generator=g).tolist()
    ours = llmsys_logits(loaded, prompt, cont)
    with torch.no_grad():
        full = hf(input_ids=torch.tensor([prompt + cont])).logits[0]  # [64, V]
    ref = [full[31]] + [full[32 + i] for i in range(32)]
    return max((o - r).abs().max().item() for o, r in zip(ours, ref))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_hf_model(arch, tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    worst = worst_logit_diff(path, hf)
    assert worst < 1e-4, f"{arch}: max |logit diff| {worst:.2e} over prefill + 32 decode steps"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from llmsys import LLM, SamplingParams

    path = make_hf_model(arch, tmp_path / arch, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompt = torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0,
            min_new_tokens=64,
        )[0, len(prompt):].tolist()
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=512)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    assert out.token_ids == ref


def test_unsupported_architecture_is_one_line(tmp_path):
    import json

    from llmsys.kernels.common.errors import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError) as e:
        load_model(tmp_path, dtype="float32")
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "\n" not in msg


@pytest.mark.parametrize("arch", [a for a in ARCHS if ARCH_CONFIGS[a].get("tie_word_embeddings")])
def test_packed_tied_head_matches_transformers(arch, tmp_path):
    """A tied head big enough to pack is packed, its embedding rows read from the checkpoint."""
    from transformers import AutoModelForCausalLM

    from llmsys import LLM, SamplingParams
    from llmsys.offload.runtime import DiskEmbedding

    path = make_hf_model(arch, tmp_path / arch, seed=3, hidden_size=128)  # 512 x 128 head: packable
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    loaded = load_model(path, dtype="float32", device="cpu")
    loaded.model.prepack_linears()
    assert isinstance(loaded.model.model.embed_tokens, DiskEmbedding) and loaded.model.lm_head.weight.is_mkldnn
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (32,), generator=g).tolist()
    cont = torch.randint(3, 512, (32,), generator=g).tolist()
    ours = llmsys_logits(loaded, prompt, cont)
    with torch.no_grad():
        full = hf(torch.tensor([prompt + cont])).logits[0]
        ref_toks = hf.generate(torch.tensor([prompt[:12]]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    worst = max((o - r).abs().max().item() for o, r in zip(ours, [full[31]] + [full[32 + i] for i in range(32)]))
    assert worst < 1e-4, f"{arch}: max |logit diff| {worst:.2e} over prefill + 32 decode steps"
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=512, progress=False)
    assert isinstance(llm.loaded.model.model.embed_tokens, DiskEmbedding)
    out = llm.generate([prompt[:12]], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    assert out.token_ids == ref_toks


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_engine_is_as_close_to_float32_as_transformers_bfloat16(arch, tmp_path):
    """The inference engine in bf16 (fused q|k|v and gate|up GEMMs, the C RMSNorm / RoPE /
    decode attention, the fast decode step) errs from the float32 logits no more than
    transformers' own bf16 run does (x1.5), over a prefill and 16 decode steps."""
    from transformers import AutoModelForCausalLM

    from llmsys import LLM

    path = make_hf_model(arch, tmp_path / arch, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=4)  # parts big enough to be packed and fused
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 512, (24,), generator=g).tolist()
    cont = torch.randint(3, 512, (16,), generator=g).tolist()
    rows = [23] + [24 + i for i in range(16)]
    with torch.no_grad():
        fp = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        ref = fp(torch.tensor([prompt + cont])).logits[0, rows]
        hfb = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).eval()
        hf_err = (hfb(torch.tensor([prompt + cont])).logits[0, rows].float() - ref).abs().max().item()
    llm = LLM(str(path), dtype="bfloat16", device="cpu", progress=False, kv_cache_tokens=256)
    model = llm.loaded.model
    from llmsys.engine.attention import CpuBackend
    from llmsys.engine.models.base import MLP

    # The CPU backend (C RoPE+store and decode attention) and fused projections (an MoE block's: each expert's).
    mlps = [m for m in model.model.layers[0].mlp.modules() if type(m) is MLP]
    assert type(llm.core.attn.inner) is CpuBackend and mlps and all(m.gate_up_proj is not None for m in mlps)
    ours = torch.stack(llmsys_logits(llm.loaded, prompt, cont)).float()
    err = (ours - ref).abs().max().item()
    assert err <= 1.5 * hf_err + 1e-3, f"{arch}: bf16 max |logit err| {err:.3g} vs transformers bf16 {hf_err:.3g}"


def test_phi3_longrope_switches_tables(tmp_path):
    """LongRoPE: a sequence's tokens rotate with the short factors while its context is within
    ``original_max_position_embeddings`` (40 here) and with the long ones past it, the keys cached
    before the switch kept, as transformers' forward over a cache computes them step by step."""
    from transformers import AutoModelForCausalLM, DynamicCache

    path = make_hf_model("phi3-longrope", tmp_path / "phi3", original_max_position_embeddings=40)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    loaded = load_model(path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (32,), generator=g).tolist()
    cont = torch.randint(3, 512, (32,), generator=g).tolist()
    ours = llmsys_logits(loaded, prompt, cont)
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        ref = [hf(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]]
        for t in cont:
            ref.append(hf(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1])
    worst = max((o - r).abs().max().item() for o, r in zip(ours, ref))
    assert worst < 1e-4, f"max |logit diff| {worst:.2e} over prefill + 32 decode steps across the switch"


def test_phi3_longrope_chunked_prompts_take_the_long_table(tmp_path):
    """A prompt longer than LongRoPE's original context rotates with the long factors from its first
    chunk on, as transformers' one forward over it does, however the steps chunk it (4 tokens here)."""
    from transformers import AutoModelForCausalLM

    from llmsys import LLM, SamplingParams

    path = make_hf_model("phi3-longrope", tmp_path / "phi3", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    base = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    prompts = [base[:12], base[:30]]
    with torch.no_grad():
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=512, max_num_batched_tokens=4, progress=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3", "gpt_oss"])
def test_sliding_window_batched_chunked_shared_prefix_greedy_match_transformers(arch, tmp_path):
    """Sliding-window layers in the serving paths: prompts of different lengths batched with decodes,
    a prompt chunked past its window (16-token steps), a prefix shared through the prefix cache; each
    sequence's greedy tokens equal transformers' for it alone."""
    from transformers import AutoModelForCausalLM

    from llmsys import LLM, SamplingParams

    path = make_hf_model(arch, tmp_path / arch, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    base = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    prompts = [base[:5], base[:40], base[:33] + [9, 8, 7]]
    refs = []
    with torch.no_grad():
        for p in prompts:
            refs.append(hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=1024, max_num_batched_tokens=16,
              progress=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs


@pytest.mark.parametrize("arch", ["phi3", "phi3-longrope", "gemma2", "gemma3", "gpt_oss"])
def test_kv_policies_that_move_or_select_keys_are_refused(arch, tmp_path):
    """Evicting policies re-rotate kept keys with one whole-head table and Quest / the scores know no
    window, soft-cap or attention sink: for these families they are refused up front, naming why; full runs."""
    from llmsys import LLM
    from llmsys.kernels.common.errors import InvalidParameterError

    path = make_hf_model(arch, tmp_path / arch)
    with pytest.raises(InvalidParameterError, match="runs with kv_policy full only"):
        LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=512, kv_policy="h2o:32,recent:32", progress=False)
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=512, progress=False)
    with pytest.raises(InvalidParameterError, match="runs with kv_policy full only"):
        llm.core.kv_policy.resolve("window:64")


@pytest.mark.parametrize("arch", ["phi3", "gemma2"])
def test_awq_needs_llama_shaped_layers(arch, tmp_path):
    from llmsys.engine.quantize import awq_calibrate
    from llmsys.kernels.common.errors import InvalidParameterError
    from llmsys.quant import QuantSpec

    loaded = load_model(make_hf_model(arch, tmp_path / arch), dtype="float32", device="cpu")
    with pytest.raises(InvalidParameterError, match="Llama-shaped layers"):
        awq_calibrate(loaded.model, [[5, 6, 7, 8]], QuantSpec("int4"))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_calibrated_quantization_refuses_experts(arch, tmp_path):
    """AWQ and refinement fold into / tune a dense MLP, and GPTQ would leave experts no token reached in
    float: each says so in one line and names --method rtn."""
    from llmsys.engine.quantize import awq_calibrate, gptq_calibrate, refine_quantized
    from llmsys.kernels.common.errors import InvalidParameterError
    from llmsys.quant import QuantSpec

    loaded = load_model(make_hf_model(arch, tmp_path / arch), dtype="float32", device="cpu")
    with pytest.raises(InvalidParameterError, match=r"mixtures of \d+ experts"):
        gptq_calibrate(loaded.model, [[5, 6, 7, 8]], QuantSpec("int4"))
    with pytest.raises(InvalidParameterError, match="mixture-of-experts"):
        awq_calibrate(loaded.model, [[5, 6, 7, 8]], QuantSpec("int4"))
    with pytest.raises(InvalidParameterError, match="mixture-of-experts"):
        refine_quantized(loaded.model, {}, [[5, 6, 7, 8]], steps=1)


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3", "gpt_oss"])
def test_cuda_backend_window_and_softcap_paths_match_transformers(arch, tmp_path):
    """The CUDA backend's own logic for sliding and soft-capped layers and attention sinks (the steps the
    Triton decode kernel cannot take go to the reference attention with the window, cap and sinks), run on
    CPU tensors: the same logits as transformers."""
    from transformers import AutoModelForCausalLM

    from llmsys.engine.attention import CudaBackend

    path = make_hf_model(arch, tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    loaded = load_model(path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (32,), generator=g).tolist()
    cont = torch.randint(3, 512, (8,), generator=g).tolist()
    ours = llmsys_logits(loaded, prompt, cont, backend=CudaBackend)
    with torch.no_grad():
        full = hf(torch.tensor([prompt + cont])).logits[0]
    worst = max((o - r).abs().max().item() for o, r in zip(ours, [full[31]] + [full[32 + i] for i in range(8)]))
    assert worst < 1e-4, f"{arch}: max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_window_with_cold_kv_tier_is_bit_identical(arch, tmp_path):
    """A sequence longer than the hot KV blocks (the rest in the cold tier: gathered with staged rows,
    so a windowed step masks instead of picking slots) gives the all-hot run's tokens and log-probs."""
    from llmsys import LLM, SamplingParams

    path = make_hf_model(arch, tmp_path / arch, seed=3)
    prompt = torch.randint(3, 512, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=2)

    def run(**kw):
        llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=32, progress=False, **kw)
        o = llm.generate([prompt], sp)[0]
        return llm, (o.token_ids, [(lp.token_id, lp.logprob) for lp in o.logprobs])

    _, ref = run(kv_cache_tokens=1024)
    llm, got = run(kv_cache_tokens=64, kv_offload_tokens=2048, offload_dir=str(tmp_path / "cold"))
    assert llm.core.tier is not None and llm.core.tier.stats.blocks_read > 0
    assert got == ref
