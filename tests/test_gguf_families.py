"""GGUF files of every family llmsys runs, as llama.cpp's own converter and quantizer write them (issue #42).

Each family's tiny random checkpoint is converted by ``convert_hf_to_gguf.py`` and quantized by llama.cpp
(``gguf_families``): the F16 file must give the checkpoint's logits (its matrices rounded to f16 as the file
holds them) through llmsys's safetensors path bit for bit and transformers' within float32 noise; every file
type must agree with llama.cpp on the same file: greedy tokens (a difference only at llama.cpp's own near
tie) and perplexity. Skipped, saying why, where llama-cpp-python (converter, quantizer, reference) is absent.
"""

from __future__ import annotations

import pytest
import torch

from gguf_families import (FAMILIES, MXFP4, QUANT_TYPES, compare_with_llama_cpp, converted, hf_checkpoint,
                           mxfp4_checkpoint, need_converter, random_ids)

gguf = pytest.importorskip("gguf", reason="reading GGUF needs the gguf package (a dependency of llmsys)")

from llmsys.engine.loader import load_model  # noqa: E402
from llmsys.engine.loader.gguf_io import open_index  # noqa: E402
from test_gguf_loading import _logits  # noqa: E402

NAMES = tuple(FAMILIES)
# A different greedy pick is no disagreement where llama.cpp's logits of the two tokens are within NEAR_TIE, or
# within the largest difference between the two engines' logits at that step, itself bounded relative to the
# logits' scale per file type (llama.cpp rounds activations to f16 for F16 weights and to 8 bits per 32 or 256
# for the block formats; llmsys keeps float32 for F16 and rounds per 32 for the block formats).
NEAR_TIE = 1e-3
NOISE_RTOL = {"f16": 2e-3, "q8_0": 1e-2, "q4_0": 2e-2, "q4_K_M": 2e-2, MXFP4: 2e-2}
# Perplexity against llama.cpp's on the same file: 8-bit and F16 within 0.5%, 4-bit within 1% (issue #42)
PPL_RTOL = {"f16": 0.005, "q8_0": 0.005, "q4_0": 0.01, "q4_K_M": 0.01, MXFP4: 0.01}
FILES = [(n, f) for n in NAMES for f in ("f16", *QUANT_TYPES)] + [("gpt-oss", MXFP4)]


def _rounded_reference(name: str, path) -> torch.nn.Module:
    """llmsys's model of the checkpoint from safetensors with every tensor the GGUF stores as F16 rounded to f16
    (norms, routers, sinks and biases stay float32 in the file, as here)."""
    ref = load_model(hf_checkpoint(name), dtype="float32", device="cpu")
    index = open_index(path)
    with torch.no_grad():
        for pname, p in ref.model.named_parameters():
            if pname in index and index.info(pname).qtype == "F16":
                p.copy_(p.half().float())
    return ref


@pytest.mark.parametrize("name", NAMES)
def test_f16_file_gives_the_checkpoints_logits(name):
    """Names, q/k row order, Gemma's 1 + w norms, Phi-3's fused projections, stacked experts, RoPE and
    soft-cap settings from the metadata: all read back right, so the logits are the checkpoint's."""
    from transformers import AutoModelForCausalLM

    path = converted(name, "f16")
    got = load_model(path, dtype="float32", device="cpu")
    ref = _rounded_reference(name, path)
    ids = random_ids(40, 0)
    mine = _logits(got, ids)
    assert torch.equal(mine, _logits(ref, ids))
    hf = AutoModelForCausalLM.from_pretrained(hf_checkpoint(name), dtype=torch.float32)
    index = open_index(path)
    assert all(index.info(n).qtype == "F16" for n in index.names() if ".experts." in n and n.endswith(".weight"))
    with torch.no_grad():
        for pname, p in hf.named_parameters():  # transformers holds each projection's experts in one 3-D tensor
            stacked_expert = ".experts." in pname and p.dim() == 3
            if stacked_expert or (pname in index and index.info(pname).qtype == "F16"):
                p.copy_(p.half().float())
        theirs = hf(torch.tensor([ids])).logits[0]
    assert ((mine - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


def test_mxfp4_gpt_oss_file_gives_the_released_checkpoints_logits():
    """openai's MXFP4 experts, kept by the converter as stored: llmsys decodes them as it decodes the released
    safetensors (bit for bit, the other matrices rounded to f16 as the file holds them)."""
    path = converted("gpt-oss", MXFP4)
    kinds = {open_index(path).info(n).qtype for n in open_index(path).names() if ".experts." in n and "weight" in n}
    assert kinds == {"MXFP4"}
    ref = load_model(mxfp4_checkpoint("gpt-oss"), dtype="float32", device="cpu")
    index = open_index(path)
    with torch.no_grad():
        for pname, p in ref.model.named_parameters():
            if pname in index and index.info(pname).qtype == "F16":
                p.copy_(p.half().float())
    ids = random_ids(40, 0)
    assert torch.equal(_logits(load_model(path, dtype="float32", device="cpu"), ids), _logits(ref, ids))


@pytest.mark.parametrize(("name", "fmt"), FILES)
def test_agrees_with_llama_cpp_on_the_same_file(name, fmt):
    """Greedy tokens for 32 steps from 3 prompts equal llama.cpp's, a difference only at a near tie (NEAR_TIE,
    or within the engines' own logit disagreement, itself bounded per type), and perplexity within PPL_RTOL."""
    need_converter()
    a = compare_with_llama_cpp(name, fmt)
    for d in a.divergences:
        assert d.noise / d.scale < NOISE_RTOL[fmt], (name, fmt, d)
        assert d.gap < max(NEAR_TIE, d.noise), (name, fmt, d, a.equal_steps)
    assert abs(a.ppl_llmsys / a.ppl_llama_cpp - 1) < PPL_RTOL[fmt], a
