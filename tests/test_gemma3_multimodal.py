"""Gemma 3 4B/12B/27B (``Gemma3ForConditionalGeneration``): the text model loaded out of the multimodal
checkpoint (config ``text_config``, weights under ``language_model.model.`` or ``model.language_model.``),
against transformers' own conditional-generation model on text-only input ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmsys.engine.loader import load_model
from llmsys.kernels.common.errors import CheckpointError
from test_models import worst_logit_diff
from tiny_models import ARCH_CONFIGS, TINY, write_tiny_tokenizer

# The Hub's google/gemma-3-4b-it config.json, its text part as written (the rest left to Gemma3TextConfig).
HUB_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def make_multimodal(out: Path, seed: int = 0, **outer) -> Path:
    """Save a random tiny ``Gemma3ForConditionalGeneration`` (the tiny Gemma 3 text model of
    ``tiny_models`` plus a one-layer SigLIP tower) to ``out`` as transformers writes it, float32."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    spec = {**TINY, **ARCH_CONFIGS["gemma3"]}
    spec.pop("model_type")
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=Gemma3TextConfig(**spec), vision_config=vision, mm_tokens_per_image=4, **outer)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).float()
    with torch.no_grad():  # as tiny_models.make_hf_model: logits far from 0, greedy decisive
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    write_tiny_tokenizer(out, spec["vocab_size"])
    return out


def respell(src: Path, out: Path) -> Path:
    """``src`` with its tensors under transformers' in-memory names (``model.language_model.``,
    ``model.vision_tower.``, ``lm_head``): the other spelling multimodal checkpoints are met in."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    renamed = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        else:
            name = "model." + name
        renamed[name] = t
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def hf_model(path: Path):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def test_saved_names_are_the_language_model_prefix(tmp_path):
    """What transformers 5 writes (its conversion mapping back to the Hub's names), so the first test below
    covers the Hub's spelling."""
    from safetensors import safe_open

    path = make_multimodal(tmp_path / "mm")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in names
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("multi_modal_projector.")
                                                                     for n in names)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]


def test_logits_match_transformers(tmp_path):
    path = make_multimodal(tmp_path / "mm")
    worst = worst_logit_diff(path, hf_model(path))
    assert worst < 1e-4, f"max |logit diff| {worst:.2e} over prefill + 32 decode steps"


@pytest.mark.parametrize("spelling", ["hub", "in-memory"])
def test_untied_head_in_both_spellings(spelling, tmp_path):
    """An untied head, ``language_model.lm_head.weight`` (the Hub's spelling) or ``lm_head.weight`` beside
    ``model.language_model.*`` (transformers' in-memory one): the outer config's tie_word_embeddings false
    wins over the text_config's true, as in transformers."""
    path = make_multimodal(tmp_path / "mm", seed=2, tie_word_embeddings=False)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["text_config"]["tie_word_embeddings"] is True
    hf = hf_model(path)
    if spelling == "in-memory":
        path = respell(path, tmp_path / "respelled")
    loaded = load_model(path, dtype="float32", device="cpu")
    assert not loaded.args.tie_word_embeddings
    assert not torch.equal(loaded.model.lm_head.weight, loaded.model.model.embed_tokens.weight)
    worst = worst_logit_diff(path, hf)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e} over prefill + 32 decode steps"


def test_in_memory_spelling_tied(tmp_path):
    path = make_multimodal(tmp_path / "mm")
    worst = worst_logit_diff(respell(path, tmp_path / "respelled"), hf_model(path))
    assert worst < 1e-4, f"max |logit diff| {worst:.2e} over prefill + 32 decode steps"


def test_greedy_tokens_match_transformers(tmp_path, capsys):
    from llmsys import LLM, SamplingParams

    path = make_multimodal(tmp_path / "mm", seed=3)
    hf = hf_model(path)
    prompt = torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=512, progress=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == ref
    notices = [line for line in capsys.readouterr().err.splitlines() if "image part" in line]
    assert len(notices) == 1 and "not loaded" in notices[0], notices


def test_hub_4b_config_reads_as_transformers_text_config():
    """The Hub's sparse text_config filled as transformers fills it (Gemma3TextConfig defaults), with the
    outer end tokens and dtype."""
    from transformers import Gemma3Config

    from llmsys.engine.models import family_for, text_config

    cfg = text_config(HUB_4B)
    family = family_for(cfg)
    assert family.__name__.endswith(".gemma3") and family_for(HUB_4B) is family
    a = family.ModelArgs.from_hf_config(cfg)
    ref = Gemma3Config(**HUB_4B).text_config
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_hidden_layers) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers) == (262208, 2560, 10240, 34)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (
        ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert a.max_position_embeddings == ref.max_position_embeddings == 131072
    assert a.sliding_window == ref.sliding_window == 1024
    assert list(a.layer_types) == list(ref.layer_types)
    assert a.query_pre_attn_scalar == ref.query_pre_attn_scalar and a.rms_norm_eps == ref.rms_norm_eps
    assert a.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
    assert a.local_rope_theta == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert a.rope_scaling["factor"] == 8.0 and a.rope_scaling["rope_type"] == "linear"
    assert a.tie_word_embeddings and list(a.eos_token_id) == [1, 106] and a.bos_token_id == 2
    assert cfg["torch_dtype"] == "bfloat16" and "vision_config" not in cfg
    assert text_config(cfg) == cfg  # a text config is its own


def test_plan_counts_the_text_model():
    """``llmsys plan`` builds the text model of the Hub's 4B config: 3.9B of its 4.3B parameters (the
    SigLIP tower and projector, ~0.42B, are not loaded)."""
    from llmsys.engine.cli.plan_cmd import meta_model

    model = meta_model(dict(HUB_4B))
    n = sum(p.numel() for name, p in model.named_parameters() if name != "lm_head.weight")
    assert 3.8e9 < n < 3.95e9, n


def test_missing_text_config_is_one_line(tmp_path):
    path = make_multimodal(tmp_path / "mm")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["text_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: a Gemma3ForConditionalGeneration config needs a "
                                              r"text_config object.*fix config\.json") as e:
        load_model(path, dtype="float32", device="cpu")
    assert "\n" not in str(e.value)


def test_bad_nested_field_is_named_where_written(tmp_path):
    path = make_multimodal(tmp_path / "mm")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = 3  # the checkpoint holds 2
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"text_config\.num_hidden_layers.*holds 2 layers"):
        load_model(path, dtype="float32", device="cpu")


def test_streamed_layer_reads_the_views(tmp_path):
    """A layer the offload plan leaves on disk streams from the stored ``language_model.model.*`` bytes
    (the views locate in the file like stored tensors): the same greedy tokens as resident."""
    from llmsys import LLM, SamplingParams

    path = make_multimodal(tmp_path / "mm", seed=4)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    resident = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=256)
    streamed = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=256, placement={"cpu": 1, "disk": 1})
    assert [p.kind for p in streamed.plan.layers] == ["cpu", "disk"]
    assert streamed.generate([[5, 6, 7]], sp)[0].token_ids == resident.generate([[5, 6, 7]], sp)[0].token_ids
