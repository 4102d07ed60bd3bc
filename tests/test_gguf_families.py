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

from gguf_families import (FAMILIES, MXFP4, compare_with_llama_cpp, converted, hf_checkpoint,
                           mxfp4_checkpoint, need_converter, random_ids)

gguf = pytest.importorskip("gguf", reason="reading GGUF needs the gguf package (a dependency of llmsys)")

from llmsys.engine.loader import load_model  # noqa: E402
from llmsys.engine.loader.gguf_io import open_index  # noqa: E402
from test_gguf_loading import _logits  # noqa: E402

NAMES = tuple(FAMILIES)
# F16 files: greedy picks may differ from llama.cpp's only at a near tie: where llama.cpp's logits of the two
# tokens are within NEAR_TIE, or within twice the engines' largest logit difference at that step (the most a
# difference can move a gap), that difference being llama.cpp's f16 rounding of activations (llmsys keeps float32)
# and bounded by F16_NOISE relative to the logits; perplexity within F16_PPL of llama.cpp's. Block formats: both
# engines round activations to 8 bits (llmsys per 32 columns, llama.cpp per 32 or, for K-quants, per 256), which a
# random 2-layer model amplifies (2-6% of the logits' scale; an MoE router flips an expert now and then, moving
# logits by their whole scale): greedy agreement is reported (docs/benchmarks.md), and what is checked is that
# llmsys's mean error against the exact model of the file's weights is within EXACT_RATIO of llama.cpp's and its
# perplexity within QUANT_PPL of that exact model's (measured: at most 2.1% for either engine).
NEAR_TIE = 1e-3
F16_NOISE, F16_PPL = 2e-3, 0.005
EXACT_RATIO, QUANT_PPL = 1.3, 0.025
# Every family at F16 and Q4_K_M (the common download); Q8_0 and Q4_0 for one family of each kind (a Llama, Gemma's
# norms and caps, a routed MoE, gpt-oss); gpt-oss's MXFP4. benchmarks/gguf_families_vs_llamacpp.py runs them all.
FILES = ([(n, f) for n in NAMES for f in ("f16", "q4_K_M")]
         + [(n, f) for n in ("llama", "gemma3", "qwen3moe", "gpt-oss") for f in ("q8_0", "q4_0")] + [("gpt-oss", MXFP4)])


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
    """F16: greedy tokens for 32 steps from 3 prompts equal llama.cpp's but at near ties, perplexity as
    llama.cpp's, logits the exact model's; block formats: as close to the exact model as llama.cpp (above)."""
    need_converter()
    # One thread each: llama.cpp's threads spin-wait for each other, and on a machine whose cores are busy
    # with other work two of them took 0.37 s per tiny-model token (40 s a test; 2.4 s on one thread).
    a = compare_with_llama_cpp(name, fmt, threads=1)
    if fmt == "f16":
        for d in a.divergences:
            assert d.noise / d.scale < F16_NOISE and d.gap < max(NEAR_TIE, 2 * d.noise), (name, fmt, d, a.equal_steps)
        assert abs(a.ppl_llmsys / a.ppl_llama_cpp - 1) < F16_PPL, a
        assert a.err_llmsys < 1e-5, a  # float32 throughout: the exact model itself
    else:
        assert a.err_llmsys <= EXACT_RATIO * a.err_llama_cpp, a
        assert abs(a.ppl_llmsys / a.ppl_exact - 1) < QUANT_PPL, a


def test_an_expert_count_the_stacked_tensors_do_not_hold_is_one_line(tmp_path):
    """A file whose metadata states more experts than its stacked tensors hold fails at load, naming the file,
    the tensor and the count, never reading experts at wrong offsets."""
    from llmsys.kernels.common.errors import CheckpointError
    from test_gguf_loading import _rewrite

    need_converter()
    bad = _rewrite(converted("qwen3moe", "f16"), tmp_path / "bad.gguf", arch="qwen3moe",
                   fields={"qwen3moe.expert_count": (3, gguf.GGUFValueType.UINT32)})
    with pytest.raises(CheckpointError, match=r"bad\.gguf: tensor blk\.0\.ffn_\w+_exps\.weight has shape .* the 3 "
                                              r"experts the metadata states"):
        load_model(bad, dtype="float32", device="cpu")


def test_converter_errors_are_one_line(tmp_path, monkeypatch):
    """A converter folder without the script, and a folder the converter cannot read, are one line naming them."""
    from llmsys.engine.bench import llamacpp_convert
    from llmsys.engine.loader.gguf_io import _tensor_list
    from llmsys.kernels.common.errors import CheckpointError, LLMSysError

    monkeypatch.setenv(llamacpp_convert.SOURCE_ENV, str(tmp_path))
    with pytest.raises(LLMSysError, match=rf"LLMSYS_LLAMA_CPP_SRC={tmp_path}: no convert_hf_to_gguf.py there"):
        llamacpp_convert.converter_source()
    monkeypatch.delenv(llamacpp_convert.SOURCE_ENV)
    need_converter()
    (tmp_path / "empty").mkdir()
    with pytest.raises(LLMSysError, match=r"empty: llama\.cpp's converter failed: "):
        llamacpp_convert.convert(tmp_path / "empty", tmp_path / "out.gguf")
    assert not list(tmp_path.glob("out.gguf*"))  # nothing half-written left behind
    with pytest.raises(CheckpointError, match=r"x\.gguf: LongRoPE needs both rope_factors_long and "
                                              r"rope_factors_short; rope_factors_short\.weight is absent"):
        _tensor_list(tmp_path / "x.gguf", {}, "rope_factors_short.weight")
