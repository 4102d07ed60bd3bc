"""Loading: formats, dtype conversion, peak memory, and every bad-input error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from llmsys.kernels.common.errors import CheckpointError, ModelNotFoundError, TokenizerError, UnsupportedModelError
from llmsys.engine.loader import load_model
from llmsys.engine.loader.safetensors_io import SafetensorsFile, save_file
from tiny_models import make_hf_model


@pytest.fixture
def tiny(tmp_path):
    return make_hf_model("llama", tmp_path / "tiny")


def test_sharded_checkpoint_loads_like_single(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, sharded / f)
    assert (sharded / "model.safetensors.index.json").exists()
    a = load_model(tiny, dtype="float32").model.state_dict()
    b = load_model(sharded, dtype="float32").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_conversion_one_tensor_at_a_time(tiny):
    m = load_model(tiny, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in m.model.parameters())
    assert m.weight_bytes == sum(p.numel() * 2 for p in m.model.parameters())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# float32 values that conversion rounds at its edges: bf16 ties (to even, down and up),
# an fp32 subnormal, fp16 subnormal / largest / overflow, negative zero.
EDGES = [1 + 2**-8, 1 + 3 * 2**-8, 1e-40, 2**-20, 65519.0, 65520.0, 7e4, -0.0, -(1 + 2**-8)]


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_embedding_rows_read_from_the_checkpoint_equal_the_loaded_table(tmp_path, stored, dtype):
    """A tied head is packed with its embedding served from the file: the rows must be the loaded bits."""
    path = make_hf_model("qwen2", tmp_path / "m")  # tied
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {n: f.read(n) for n in f.keys()}
    tensors["model.embed_tokens.weight"][7, : len(EDGES)] = torch.tensor(EDGES)
    save_file({n: t.to(getattr(torch, stored)) for n, t in tensors.items()}, path / "model.safetensors")
    model = load_model(path, dtype=dtype, device="cpu").model
    table = model.model.embed_tokens.weight
    emb = model.file_embedding()
    ids = torch.tensor([7, 0, table.shape[0] - 1, 7, 3, *range(table.shape[0])])
    got = emb(ids)
    assert got.dtype == table.dtype and torch.equal(_bits(got), _bits(table[ids]))
    with pytest.raises(IndexError, match="outside the embedding table"):
        emb(torch.tensor([table.shape[0]]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_llama2c_embedding_rows_read_from_the_checkpoint_equal_the_loaded_table(stories_c, dtype):
    model = load_model(stories_c, dtype=dtype, device="cpu").model
    table = model.model.embed_tokens.weight
    got = model.file_embedding()(torch.arange(table.shape[0]))
    assert torch.equal(_bits(got), _bits(table))


def test_an_untied_or_in_memory_model_has_no_file_embedding(tiny):
    from llmsys.engine.models.llama import Model, ModelArgs

    assert load_model(tiny, dtype="float32").model.file_embedding() is None  # untied: the head has its own matrix
    cfg = dict(json.loads((tiny / "config.json").read_text()), tie_word_embeddings=True, hidden_size=128)
    args = ModelArgs.from_hf_config(cfg)  # 512 x 128: a head big enough to pack
    model = Model(args)
    model.tie_weights()
    model.prepack_linears()
    assert model.file_embedding() is None and type(model.model.embed_tokens) is torch.nn.Embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight  # no file: the head stays the plain table


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        load_model(tmp_path / "nope")


def test_no_config(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path / "x")


def test_truncated_safetensors_names_the_file(tiny):
    f = tiny / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_model(tiny)
    assert "model.safetensors" in str(e.value) and "truncated" in str(e.value)


def test_garbage_safetensors_header(tiny):
    (tiny / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tiny)


def test_missing_tensor_is_named(tiny):
    sf = SafetensorsFile(tiny / "model.safetensors")
    tensors = {n: sf.read(n) for n in sf.keys() if n != "model.layers.1.mlp.up_proj.weight"}
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tiny)


def test_unknown_config_keys_are_ignored(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["some_future_option"] = {"x": 1}
    (tiny / "config.json").write_text(json.dumps(cfg))
    load_model(tiny, dtype="float32")


def test_unsupported_rope_scaling(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(tiny)


def test_missing_tokenizer(tiny):
    from llmsys import LLM

    (tiny / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer"):
        LLM(str(tiny), dtype="float32", progress=False, kv_cache_tokens=64)


def test_truncated_llama2c(tmp_path, stories_c):
    data = (stories_c / "stories260K.bin").read_bytes()
    d = tmp_path / "c"
    d.mkdir()
    (d / "model.bin").write_bytes(data[:1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(d / "model.bin")


def test_peak_rss_while_loading_stays_under_1_3x(tmp_path, tiny):
    """Load a ~135 MiB float32 checkpoint in a fresh process and compare peak
    RSS growth with the model's size. Baseline: RSS after loading a tiny model
    once, so one-time code imports are not counted as weight memory."""
    path = tmp_path / "big"
    path.mkdir()
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512, intermediate_size=1536,
               num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, vocab_size=8000,
               max_position_embeddings=256, tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    h, i, v = 512, 1536, 8000
    tensors["model.embed_tokens.weight"] = torch.randn(v, h, generator=g)
    tensors["lm_head.weight"] = torch.randn(v, h, generator=g)
    tensors["model.norm.weight"] = torch.ones(h)
    for L in range(8):
        p = f"model.layers.{L}."
        for n, shape in [("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)), ("self_attn.v_proj", (h, h)),
                         ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                         ("mlp.down_proj", (h, i))]:
            tensors[p + n + ".weight"] = torch.randn(*shape, generator=g)
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
    save_file(tensors, path / "model.safetensors")
    size = sum(t.numel() * 4 for t in tensors.values())
    del tensors
    code = textwrap.dedent(f"""
        import resource, torch
        from llmsys.engine.loader import load_model
        def rss():
            return int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize()
        load_model({str(tiny)!r}, dtype='float32', device='cpu', progress=False)
        base = rss()
        m = load_model({str(path)!r}, dtype='float32', device='cpu', progress=False)
        # VmHWM, not ru_maxrss: ru_maxrss survives exec and would report the
        # forking pytest parent's size.
        hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]
        peak = int(hwm.split()[1]) * 1024
        print(peak - base, m.weight_bytes, base)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    grew, weights, base = map(int, out.stdout.split())
    assert weights == size
    assert grew < 1.3 * size, f"peak RSS grew by {grew / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model (base {base >> 20} MiB)"
