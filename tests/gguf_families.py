"""GGUF files of every family llmsys runs, made the way the world makes them.

A tiny random transformers checkpoint per family (``tiny_models.make_hf_model``, fixed seed), with the
kind of tokenizer the family ships (SentencePiece for Gemma, Phi-3 and Mixtral, trained here with
``sentencepiece``; byte-level BPE for the rest), converted by llama.cpp's own ``convert_hf_to_gguf.py``
and quantized by llama.cpp's quantizer (``engine.bench.llamacpp_convert``). Files are cached under
``$LLMSYS_HOME/test-gguf`` keyed by family, format and :data:`VERSION`, so a second run converts nothing.

Sizes: 256-wide matrices, so llama.cpp's K-quants (256-column super-blocks) apply as they do to real
models instead of falling back to Q5_0 / Q8_0.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiny_models import make_hf_model

VERSION = 4  # bump when the checkpoints or tokenizers made here change
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
TEXT = [
    "Once upon a time there was a little girl who loved to play in the park.",
    "The quick brown fox jumps over the lazy dog. Hello, world! 12345",
    "def main():\n    print('hello')\n",
    "Lily and Ben went to the park. They saw a big red ball and ran to get it.",
    "Tom had a small dog named Spot. Spot liked to run and jump in the green grass.",
] * 20


@dataclass(frozen=True)
class Family:
    """One family as its GGUF files hold it: the tiny checkpoint kind, the config changes llama.cpp needs
    (every layer of a Qwen-MoE sparse: llama.cpp has no dense layers there), the tokenizer (``spm`` or a
    byte-level BPE pre-tokenizer name) and llama.cpp's architecture name."""

    kind: str
    arch: str
    tokenizer: str
    overrides: dict[str, Any] = field(default_factory=dict)
    moe: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "llama", "llama-bpe"),
    "qwen2": Family("qwen2", "qwen2", "qwen2"),
    "qwen3": Family("qwen3", "qwen3", "qwen2", dict(head_dim=64)),
    "gemma2": Family("gemma2", "gemma2", "spm", dict(head_dim=64, query_pre_attn_scalar=64)),
    # Gemma 3: llama.cpp's five sliding layers to one global (layer 5), as transformers derives them by default
    "gemma3": Family("gemma3", "gemma3", "spm", dict(head_dim=64, query_pre_attn_scalar=64, num_hidden_layers=6,
                                                     layer_types=None)),
    # Phi-3: the released window (Phi-3-mini-4k's 2047; llama.cpp turns Phi's sliding window off, transformers
    # applies it: the two agree only below it, as on real prompts of that model up to 2047 tokens)
    "phi3": Family("phi3", "phi3", "spm", dict(sliding_window=2047)),
    "mixtral": Family("mixtral", "llama", "spm", moe=True),
    "qwen2moe": Family("qwen2_moe", "qwen2moe", "qwen2",
                       dict(decoder_sparse_step=1, moe_intermediate_size=256, shared_expert_intermediate_size=512,
                            tie_word_embeddings=False),  # llama.cpp's qwen2moe needs output.weight (as released)
                       moe=True),
    "qwen3moe": Family("qwen3_moe", "qwen3moe", "qwen2", dict(head_dim=64, mlp_only_layers=[],
                                                             moe_intermediate_size=256), moe=True),
    # gpt-oss at its released YaRN (factor 32 over 4096 positions): llama.cpp rounds YaRN's ramp ends to whole
    # dimensions (truncate), transformers and openai's reference do not; at the released values the two differ
    # by less than llama.cpp's own f16 rounding (tiny_models' factor 4 over 64 positions: by 0.2 of 3.8)
    "gpt-oss": Family("gpt_oss", "gpt-oss", "gpt-4o", dict(
        head_dim=64, intermediate_size=256, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=4096)), moe=True),
}
FLOAT_TYPES = ("f16",)
QUANT_TYPES = ("q8_0", "q4_0", "q4_K_M")
MXFP4 = "mxfp4"  # gpt-oss as openai releases it: experts in MXFP4, which the converter keeps as stored


def cache_root() -> Path:
    from llmsys.kernels.common.paths import llmsys_home

    return llmsys_home() / "test-gguf" / f"v{VERSION}"


def need_converter() -> None:
    """Skip the calling test, saying why, where llama.cpp's converter or quantizer cannot be had."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.skip('llama-cpp-python is not installed (pip install -e ".[llamacpp]", ~15 min build): its '
                    "converter and quantizer make these files")
    from llmsys.engine.bench.llamacpp_convert import converter_source
    from llmsys.kernels.common.errors import LLMSysError

    try:
        converter_source()
    except LLMSysError as exc:
        pytest.skip(str(exc))


def write_spm_tokenizer(out: Path, vocab_size: int) -> None:
    """A SentencePiece BPE model with byte fallback (as Llama 2, Gemma, Phi-3 and Mixtral ship) trained on a
    few sentences: ``tokenizer.model`` and the ``tokenizer_config.json`` the converter reads."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_writer=model, vocab_size=min(vocab_size, 400), model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, minloglevel=2)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    (out / "tokenizer.json").unlink(missing_ok=True)  # the converter reads tokenizer.model
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
           "tokenizer_class": "LlamaTokenizer"}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))


def hf_checkpoint(name: str, root: Path | None = None) -> Path:
    """The tiny checkpoint of family ``name`` (cached), its tokenizer of the family's kind."""
    fam = FAMILIES[name]
    out = (root or cache_root()) / name / "hf"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    make_hf_model(fam.kind, out, seed=7, **{**SIZES, **fam.overrides})
    if fam.tokenizer == "spm":
        write_spm_tokenizer(out, SIZES["vocab_size"])
    return out


def converted(name: str, fmt: str) -> Path:
    """Family ``name``'s GGUF at ``fmt`` (f16: the converter's; q8_0 / q4_0 / q4_K_M: llama.cpp's quantizer
    of the f16 file), made once and cached."""
    from llmsys.engine.bench.gguf_export import quantize
    from llmsys.engine.bench.llamacpp_convert import convert

    need_converter()
    fam = FAMILIES[name]
    path = cache_root() / name / f"{name}.{fmt}.gguf"
    if path.exists():
        return path
    folder = hf_checkpoint(name)
    if fmt == MXFP4:
        return convert(mxfp4_checkpoint(name), path, "f16", pre=fam.tokenizer)
    if fmt in FLOAT_TYPES:
        pre = None if fam.tokenizer == "spm" else fam.tokenizer
        return convert(folder, path, fmt, pre=pre)
    return quantize(converted(name, "f16"), path, fmt, threads=min(2, os.cpu_count() or 1))


def mxfp4_checkpoint(name: str) -> Path:
    """Family ``name``'s (gpt-oss's) checkpoint with its experts as MXFP4 blocks and scales, as openai releases it."""
    from tiny_models import write_mxfp4_checkpoint

    out = hf_checkpoint(name).parent / "hf-mxfp4"
    return out if (out / "config.json").exists() else write_mxfp4_checkpoint(hf_checkpoint(name), out)


# -- llmsys against llama.cpp on one file --------------------------------------------------------------
PROMPTS = ([5, 17, 42, 99, 7, 3, 250, 11], [300, 12, 12, 64, 8], [9, 140, 77, 31, 200, 45, 6, 90, 13, 2])
STEPS = 32
PPL_TOKENS = 160


def random_ids(n: int, seed: int, vocab: int = 300) -> list[int]:
    """Token ids every tiny tokenizer has (3 .. vocab - 1)."""
    return [int(v) for v in np.random.RandomState(seed).randint(3, vocab, n)]


@dataclass(frozen=True)
class Divergence:
    """Where llmsys's greedy pick first differs from llama.cpp's for one prompt: llama.cpp's logit gap between
    the two picks, and the largest difference between the engines' logits at that step (and its scale)."""

    prompt: int
    step: int
    gap: float
    noise: float
    scale: float


@dataclass(frozen=True)
class Agreement:
    """llmsys vs llama.cpp on one file: greedy tokens equal before any divergence per prompt, the divergences,
    and perplexity over PPL_TOKENS random ids by each engine."""

    name: str
    fmt: str
    equal_steps: tuple[int, ...]
    divergences: tuple[Divergence, ...]
    ppl_llmsys: float
    ppl_llama_cpp: float
    ppl_exact: float  # the file's weights dequantized, float32 activations throughout (what both approximate)
    err_llmsys: float  # mean over the perplexity tokens of max |logit - exact|, relative to the largest |exact logit|
    err_llama_cpp: float


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """``exp`` of the mean next-token negative log-likelihood of ``ids`` under ``logits [T, V]``."""
    x = logits[:-1].astype(np.float64)
    lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    return float(np.exp((lse - x[np.arange(len(ids) - 1), ids[1:]]).mean()))


def compare_with_llama_cpp(name: str, fmt: str, threads: int = 2) -> Agreement:
    """Greedy decoding (llmsys's engine, float32 activations as llama.cpp's) for STEPS steps from each of PROMPTS
    and perplexity, both engines on family ``name``'s file of type ``fmt``."""
    import llama_cpp

    from llmsys import LLM, SamplingParams
    from llmsys.engine.scoring import prompt_logits

    path = converted(name, fmt)
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False, max_model_len=256, threads=threads)
    cpp = llama_cpp.Llama(str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False, n_threads=threads,
                          n_threads_batch=threads)
    try:
        outs = llm.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))
        equal, divergences = [], []
        for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
            cpp.reset()
            cpp.eval(list(prompt))
            mine, theirs = list(out.token_ids), []
            for step in range(STEPS):
                lc = np.array(cpp.scores[cpp.n_tokens - 1], dtype=np.float32)  # [V]
                theirs.append(int(lc.argmax()))
                if step >= len(mine) or mine[step] != theirs[-1]:
                    lm = prompt_logits(llm.core, list(prompt) + mine[:step]).numpy()[-1]
                    pick = mine[step] if step < len(mine) else theirs[-1]
                    divergences.append(Divergence(i, step, float(lc[theirs[-1]] - lc[pick]),
                                                  float(np.abs(lm - lc).max()), float(np.abs(lc).max())))
                    break
                cpp.eval([theirs[-1]])
            equal.append(step if divergences and divergences[-1].prompt == i else STEPS)
        ids = random_ids(PPL_TOKENS, 1)
        mine_l = prompt_logits(llm.core, ids).numpy()
        cpp.reset()
        cpp.eval(ids)
        theirs_l = np.array(cpp.scores[: len(ids)], dtype=np.float32)
    finally:
        cpp.close()
    exact = exact_logits(name, path, ids)
    scale = float(np.abs(exact).max())
    # mean, not max, over positions: in an MoE model a rounding can flip one token's expert choice (either engine)
    return Agreement(name, fmt, tuple(equal), tuple(divergences), perplexity(mine_l, ids), perplexity(theirs_l, ids),
                     perplexity(exact, ids), float(np.abs(mine_l - exact).max(-1).mean()) / scale,
                     float(np.abs(theirs_l - exact).max(-1).mean()) / scale)


def exact_logits(name: str, path: Path, ids: list[int]) -> np.ndarray:
    """``[T, V]`` logits of the GGUF's own weights, each dequantized exactly (as llama.cpp's dequantization
    computes them), through the float32 forward of the family's checkpoint: the model both engines approximate
    when they round activations (to f16, or to 8 bits per block)."""
    import torch

    from llmsys.engine.loader import load_model
    from llmsys.engine.loader.gguf_io import open_index
    from test_gguf_loading import _logits

    ref = load_model(mxfp4_checkpoint(name) if path.name.endswith(f".{MXFP4}.gguf") else hf_checkpoint(name),
                     dtype="float32", device="cpu")
    index = open_index(path)
    with torch.no_grad():
        for pname, p in ref.model.named_parameters():
            if pname in index:
                p.copy_(index.read(pname, torch.float32))
    return _logits(ref, ids).numpy()
