"""Tiny random checkpoints made with transformers (the correctness oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False, rope_theta=10000.0),
    "llama3.2": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=32, rope_theta=1000000.0),
    # Phi-3: fused qkv_proj / gate_up_proj; a sliding window the 64 tested positions pass.
    "phi3": dict(model_type="phi3", tie_word_embeddings=False, sliding_window=24, pad_token_id=0, eos_token_id=2),
    # Phi-4-mini-like: partial rotary and LongRoPE whose original context (8) every tested prompt passes, so
    # transformers' generate (which recomputes the cache when a sequence first passes it) and a step-by-step
    # forward agree; test_phi3_longrope_switches_tables covers the switch itself.
    "phi3-longrope": dict(
        model_type="phi3", tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, partial_rotary_factor=0.5,
        original_max_position_embeddings=8,
        rope_scaling=dict(rope_type="longrope"),  # factors: make_hf_model, one per rotated pair
    ),
    # Gemma 2: sliding layer 0 (window 12 < the prompt), global layer 1; caps small enough to bend the logits.
    "gemma2": dict(model_type="gemma2", tie_word_embeddings=True, head_dim=16, sliding_window=12,
                   query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    # Gemma 3: local layer 0 (window 12, its own RoPE base), global layer 1 (linear-scaled RoPE), q/k norms.
    "gemma3": dict(model_type="gemma3_text", tie_word_embeddings=True, head_dim=16, sliding_window=12,
                   query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"], rope_theta=1000000.0,
                   rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=2.0)),
    # Mixtures of experts (engine/models/moe.py). Qwen3-MoE: 8 experts, top-2 renormalised, layer 1 dense
    # (mlp_only_layers); Qwen2-MoE: layer 0 dense (decoder_sparse_step 2), a gated shared expert, top-2 not
    # renormalised; Mixtral: every layer 4 experts, top-2, float32 routing weights.
    "qwen3_moe": dict(model_type="qwen3_moe", tie_word_embeddings=False, head_dim=32, rope_theta=1000000.0,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen2_moe": dict(model_type="qwen2_moe", tie_word_embeddings=True, rope_theta=1000000.0, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                      norm_topk_prob=False, decoder_sparse_step=2),
    "mixtral": dict(model_type="mixtral", tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None),
    # gpt-oss: head_dim 24 apart from hidden 64, sliding layer 0 (window 12) and full layer 1, attention sinks,
    # YaRN RoPE (factor 4 over an original 64 positions, truncate false as released), 4 experts top-2 with
    # biases and the clamped SwiGLU (make_hf_model widens its gate|up weights so the clamps bite).
    "gpt_oss": dict(model_type="gpt_oss", tie_word_embeddings=False, head_dim=24, sliding_window=12,
                    num_local_experts=4, num_experts_per_tok=2,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=64)),
}


def spread_weights(model: torch.nn.Module) -> None:
    """Random init has a tiny std: scaled up so logits are not all ~0 and greedy is decisive."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.8, 1.2)
            elif n.endswith("sinks"):  # gpt-oss: sinks that take a visible share of each softmax
                p.normal_(0, 1.0)
            elif n.endswith("experts.gate_up_proj"):  # gpt-oss: gate|up values past swiglu_limit (7) now and then
                p.normal_(0, 0.4)
            else:
                p.normal_(0, 0.05)


def make_hf_model(kind: str, out: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random transformers model of family ``kind`` to ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**TINY, **ARCH_CONFIGS[kind], **overrides}
    mt = spec.pop("model_type")
    scaling = spec.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "longrope" and "short_factor" not in scaling:
        # one factor per rotated pair of this head size: short 1..2, long 1..8
        n = int(spec["hidden_size"] // spec["num_attention_heads"] * spec.get("partial_rotary_factor", 1.0)) // 2
        steps = torch.linspace(0, 1, n).tolist()
        spec["rope_scaling"] = dict(scaling, short_factor=[2.0**s for s in steps], long_factor=[8.0**s for s in steps])
    cfg = AutoConfig.for_model(mt, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    spread_weights(model)
    model.save_pretrained(out, safe_serialization=True)
    write_tiny_tokenizer(out, spec["vocab_size"])
    return out


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` (K a multiple of 32) -> MXFP4 ``blocks [..., K / 32, 16]`` uint8 (two e2m1 codes a byte,
    low nibble first) and ``scales [..., K / 32]`` uint8 (e8m0, ``2^(s - 127)``): each block of 32 scaled by
    the power of two that brings its largest magnitude to at most 6, each value rounded to the nearest e2m1
    magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6). A test packer: any valid packing serves the loader's tests."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)  # [..., G, 32]
    amax = g.abs().amax(dim=-1)  # [..., G]
    exp = torch.ceil(torch.log2(amax.clamp(min=2.0**-100) / 6.0))  # amax / 2^exp <= 6
    x = g / torch.exp2(exp).unsqueeze(-1)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = (x.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1) | ((x < 0).long() << 3)  # [..., G, 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def write_mxfp4_checkpoint(src: Path, out: Path) -> Path:
    """The gpt-oss checkpoint at ``src`` as openai releases it: every expert matrix as MXFP4 blocks and scales
    (``mlp.experts.gate_up_proj_blocks [E, 2 I, H / 32, 16]``, one row per output; ``down_proj_blocks [E, H,
    I / 32, 16]``) and ``quantization_config`` ``{"quant_method": "mxfp4"}``; everything else as stored."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            blocks, scales = pack_mxfp4(t.transpose(1, 2))  # [E, out, in]: packed along the inputs
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    return out


def write_tiny_tokenizer(out: Path, vocab_size: int = 512, chat_template: str | None = None) -> None:
    """Train a byte-level BPE tokenizer (``vocab_size`` ids) and save HF files.

    The random models need a real tokenizer with a matching vocabulary; a
    BPE trained in-process on a few sentences is one, and keeps these tests
    independent of ../shared.
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [
        "Once upon a time there was a little girl who loved to play in the park.",
        "The quick brown fox jumps over the lazy dog. Hello, world! 12345",
        "def main():\n    print('hello')\n",
    ] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}
    if chat_template:
        cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))


def random_kv_pool(num_blocks: int = 6, layers: int = 3):
    """A small float32 KV pool (block size 4, 2 KV heads of 8) filled with seeded random values."""
    from llmsys.engine.kv_cache import KVCacheSpec, PlainKVPool

    spec = KVCacheSpec(num_layers=layers, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype=torch.float32)
    kv = PlainKVPool(spec, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return kv
