"""``llmsys bench --vs llama.cpp``: the GGUF export, llama.cpp's eval of it, the bench rows.

Three layers, each needing less than the next:

* with only ``gguf`` (in the ``test`` extra): the exported file read back with
  ``gguf.GGUFReader`` - metadata, and every tensor equal to the checkpoint's
  bit for bit once the q/k row order is undone; the cache; refusals.
* with ``llama_cpp`` (the ``llamacpp`` extra; CI skips these): llama.cpp's
  logits on the f32 GGUF against transformers float32 on the same ids, greedy
  tokens equal, llama.cpp's quantizer output loading and agreeing.
* the bench itself: ``llmsys bench stories260k --vs llama.cpp`` rows and
  ratios, and the one-line error without llama_cpp.

stories260k (a real trained tiny Llama, ../shared) carries the llama checks;
tiny random transformers checkpoints (tests/tiny_models.py) the other families.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import STORIES_HF, need_shared
from tiny_models import ARCH_CONFIGS, make_hf_model

gguf = pytest.importorskip("gguf", reason="the GGUF export needs the gguf package (pip install -e '.[test]')")

from llmsys.engine.bench import gguf_export  # noqa: E402
from llmsys.engine.bench.gguf_export import gguf_file  # noqa: E402
from llmsys.engine.loader.gguf_io import hf_name, hf_to_interleaved, interleaved_to_hf  # noqa: E402
from llmsys.kernels.common.errors import CheckpointError, InvalidParameterError, UnsupportedModelError  # noqa: E402

try:
    import llama_cpp
except ImportError:
    llama_cpp = None
needs_llama_cpp = pytest.mark.skipif(
    llama_cpp is None, reason='llama-cpp-python is not installed (pip install -e ".[llamacpp]", ~15 min build)'
)

# Relative tolerance of llama.cpp's f32 logits against transformers float32, per position, as a fraction of
# that position's largest |logit|. Both compute in float32 but sum in different orders (llama.cpp's SIMD dot
# products, its own softmax and RMSNorm), and the differences grow through the layers; observed <= 8e-4 on
# stories260k and the tiny families. A wrong RoPE layout or a misnamed tensor gives errors of order 1.
F32_RTOL = 2e-3
PROMPT = "Once upon a time, there was a little girl"


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    # GGUF files go to a test cache, shared by this module's tests (exports are reused as in real use).
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path_factory.getbasetemp() / "llmsys-home-gguf"))


@pytest.fixture(scope="module")
def stories() -> Path:
    return need_shared(STORIES_HF)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-families")
    out = {}
    for kind in ("qwen2", "llama3.2", "mistral", "qwen3"):
        (root / kind).mkdir()
        out[kind] = make_hf_model(kind, root / kind, seed=1)
    (root / "qwen3_moe").mkdir()  # every layer sparse, as llama.cpp's qwen3moe reads it
    out["qwen3_moe"] = make_hf_model("qwen3_moe", root / "qwen3_moe", seed=1, mlp_only_layers=[])
    (root / "gpt_oss").mkdir()  # YaRN's correction range rounded to whole dimensions, as llama.cpp always does
    out["gpt_oss"] = make_hf_model("gpt_oss", root / "gpt_oss", seed=1, rope_parameters=_gpt_oss_yarn(truncate=True))
    return out


def _gpt_oss_yarn(truncate: bool) -> dict:
    return dict(ARCH_CONFIGS["gpt_oss"]["rope_parameters"], truncate=truncate)


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _field(reader, key: str):
    return reader.fields[key].contents()  # a scalar, a string or a list


def _hf_name(g: str, arch: str = "llama") -> str:
    name = hf_name(g, arch)  # the GGUF reader's tables: the export writes their inverse
    assert name is not None, g
    return name


# --------------------------------------------------------------------------
# gguf only
# --------------------------------------------------------------------------


def test_interleave_reorders_each_heads_halves():
    w = torch.arange(2 * 6).reshape(12, 1).float()  # 2 heads of d=6 rows
    got = hf_to_interleaved(w, 2).flatten().tolist()
    assert got == [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]  # head rows i and i+d/2 become neighbours
    b = torch.randn(4 * 8, 5)
    assert torch.equal(interleaved_to_hf(hf_to_interleaved(b, 4), 4), b)
    assert torch.equal(interleaved_to_hf(hf_to_interleaved(b[:, 0], 4), 4), b[:, 0])  # biases too


def test_stories_f32_gguf_round_trips_metadata_and_every_tensor(stories):
    path = gguf_file(stories, "f32")
    cfg = json.loads((stories / "config.json").read_text())
    r = gguf.GGUFReader(str(path))
    meta = {k: _field(r, k) for k in r.fields}
    assert meta["general.architecture"] == "llama"
    assert meta["llama.context_length"] == cfg["max_position_embeddings"] == 512
    assert meta["llama.embedding_length"] == cfg["hidden_size"]
    assert meta["llama.block_count"] == cfg["num_hidden_layers"]
    assert meta["llama.feed_forward_length"] == cfg["intermediate_size"]
    assert meta["llama.attention.head_count"] == cfg["num_attention_heads"]
    assert meta["llama.attention.head_count_kv"] == cfg["num_key_value_heads"]
    assert meta["llama.rope.dimension_count"] == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert meta["llama.rope.freq_base"] == pytest.approx(cfg["rope_theta"])
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"])
    assert meta["llama.vocab_size"] == cfg["vocab_size"]
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and meta["tokenizer.ggml.eos_token_id"] == 2
    # The real SentencePiece vocabulary: the pieces of tokenizer.json by id.
    tj = json.loads((stories / "tokenizer.json").read_text())
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == 512 and all(tokens[i] == p for p, i in tj["model"]["vocab"].items())

    hf = _hf_tensors(stories)
    names = {t.name for t in r.tensors}
    assert "output.weight" not in names  # tied: llama.cpp reuses token_embd
    assert {_hf_name(n) for n in names} == set(hf) - {"lm_head.weight"}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for t in r.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        got = torch.from_numpy(np.array(t.data)).reshape(tuple(reversed([int(x) for x in t.shape])))  # [out, in]
        if t.name.endswith("attn_q.weight"):
            got = interleaved_to_hf(got, heads)
        elif t.name.endswith("attn_k.weight"):
            got = interleaved_to_hf(got, kv_heads)
        want = hf[_hf_name(t.name)]
        assert torch.equal(got, want), t.name
    assert not torch.equal(  # the stored q rows really are reordered
        torch.from_numpy(np.array(next(t for t in r.tensors if t.name == "blk.0.attn_q.weight").data)).reshape(64, 64),
        hf["model.layers.0.self_attn.q_proj.weight"],
    )


def test_f16_keeps_1d_tensors_f32_and_the_cache_is_reused(stories):
    path = gguf_file(stories, "f16")
    stamp = path.stat().st_mtime_ns
    r = gguf.GGUFReader(str(path))
    hf = _hf_tensors(stories)
    for t in r.tensors:
        want = hf[_hf_name(t.name)]
        if want.dim() == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16, t.name
            if "attn_q" not in t.name and "attn_k" not in t.name:
                got = torch.from_numpy(np.array(t.data)).reshape(want.shape)
                assert torch.equal(got, want.half()), t.name
    assert gguf_file(stories, "f16") == path and path.stat().st_mtime_ns == stamp  # not rewritten
    assert path.parent.parent.name == "gguf" and path.name == "f16.gguf"


def test_cache_key_follows_the_safetensors_files(tmp_path):
    (tmp_path / "m").mkdir()
    src = make_hf_model("llama", tmp_path / "m", seed=0)
    first = gguf_export.cache_path(src, "f32")
    st = src / "model.safetensors"
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 10**9))
    assert gguf_export.cache_path(src, "f32") != first  # a changed checkpoint gets a new file
    assert gguf_export.cache_path(src, "f32").parent == gguf_export.cache_path(src, "q8_0").parent


def test_qwen2_keeps_rows_and_writes_biases(families):
    src = families["qwen2"]
    r = gguf.GGUFReader(str(gguf_file(src, "f32")))
    assert _field(r, "general.architecture") == "qwen2"
    assert _field(r, "qwen2.rope.freq_base") == pytest.approx(1e6)
    hf = _hf_tensors(src)
    got = {t.name: torch.from_numpy(np.array(t.data)).reshape(hf[_hf_name(t.name)].shape) for t in r.tensors}
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= set(got)
    for name, t in got.items():  # NEOX RoPE in llama.cpp's qwen2: nothing reordered
        assert torch.equal(t, hf[_hf_name(name)]), name
    assert _field(r, "tokenizer.ggml.model") == "llama"  # byte-level BPE: placeholder pieces of the right size
    assert _field(r, "tokenizer.ggml.tokens")[:3] == ["<tok_0>", "<tok_1>", "<tok_2>"]
    assert len(_field(r, "tokenizer.ggml.tokens")) == 512


def test_llama3_rope_scaling_becomes_rope_freqs(families):
    from llmsys.kernels import rope_inv_freq

    src = families["llama3.2"]
    a = gguf_export.open_source(src).args  # the config as llmsys reads it (rope_theta / rope_parameters)
    assert a.rope_scaling["rope_type"] == "llama3" and a.rope_scaling["factor"] == 32.0
    r = gguf.GGUFReader(str(gguf_file(src, "f32")))
    (freqs,) = [torch.from_numpy(np.array(t.data)) for t in r.tensors if t.name == "rope_freqs.weight"]
    base = rope_inv_freq(a.head_dim, a.rope_theta, None)
    # llama.cpp divides each frequency by its factor: the quotient is HF's llama3-scaled frequency.
    assert torch.allclose(base / freqs, rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling), rtol=1e-6)
    assert freqs.min() == 1.0 and freqs.max() == 32.0  # high frequencies kept, the lowest divided by the factor
    assert "output.weight" not in {t.name for t in r.tensors}  # tied


def test_gpt_oss_writes_sinks_biases_stacked_experts_window_and_yarn(families):
    src = families["gpt_oss"]
    r = gguf.GGUFReader(str(gguf_file(src, "f32")))
    meta = {k: _field(r, k) for k in r.fields}
    assert meta["general.architecture"] == "gpt-oss"
    assert meta["gpt-oss.attention.sliding_window"] == 12
    assert meta["gpt-oss.attention.sliding_window_pattern"] == [True, False]  # layer 0 slides, layer 1 does not
    assert meta["gpt-oss.rope.scaling.type"] == "yarn" and meta["gpt-oss.rope.scaling.factor"] == 4.0
    assert meta["gpt-oss.rope.scaling.original_context_length"] == 64
    assert (meta["gpt-oss.rope.scaling.yarn_beta_fast"], meta["gpt-oss.rope.scaling.yarn_beta_slow"]) == (32.0, 1.0)
    assert (meta["gpt-oss.expert_count"], meta["gpt-oss.expert_used_count"]) == (4, 2)
    assert meta["gpt-oss.expert_feed_forward_length"] == 96 and meta["gpt-oss.attention.key_length"] == 24

    hf = _hf_tensors(src)  # transformers' fused layout: gate_up_proj [E, H, 2 I] (gate, up interleaved by column)
    got = {t.name: torch.from_numpy(np.array(t.data)) for t in r.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r.tensors)
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]
    gate_up_b = hf["model.layers.1.mlp.experts.gate_up_proj_bias"]
    want = {
        "blk.1.attn_sinks.weight": hf["model.layers.1.self_attn.sinks"],
        "blk.1.attn_output.bias": hf["model.layers.1.self_attn.o_proj.bias"],
        "blk.1.attn_q.bias": hf["model.layers.1.self_attn.q_proj.bias"],
        "blk.1.post_attention_norm.weight": hf["model.layers.1.post_attention_layernorm.weight"],
        "blk.1.ffn_gate_inp.weight": hf["model.layers.1.mlp.router.weight"],
        "blk.1.ffn_gate_inp.bias": hf["model.layers.1.mlp.router.bias"],
        "blk.1.ffn_gate_exps.weight": gate_up[:, :, 0::2].transpose(1, 2),  # [E, I, H]: each expert's x @ W, as rows
        "blk.1.ffn_up_exps.weight": gate_up[:, :, 1::2].transpose(1, 2),
        "blk.1.ffn_down_exps.weight": hf["model.layers.1.mlp.experts.down_proj"].transpose(1, 2),  # [E, H, I]
        "blk.1.ffn_gate_exps.bias": gate_up_b[:, 0::2],
        "blk.1.ffn_up_exps.bias": gate_up_b[:, 1::2],
        "blk.1.ffn_down_exps.bias": hf["model.layers.1.mlp.experts.down_proj_bias"],
    }
    for name, w in want.items():
        assert torch.equal(got[name].reshape(w.shape), w), name
    assert "blk.1.ffn_norm.weight" not in got  # gpt-oss's pre-MLP norm has llama.cpp's post-attention name

    f16 = {t.name: t.tensor_type for t in gguf.GGUFReader(str(gguf_file(src, "f16"))).tensors}
    assert f16["blk.0.ffn_gate_exps.weight"] == f16["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert {f16["blk.0.ffn_gate_exps.bias"], f16["blk.0.attn_sinks.weight"]} == {gguf.GGMLQuantizationType.F32}
    # Quantized matrices (the readers' test files): the [E, rows] stacks of biases are not matrices.
    q8 = gguf_export.export_float(src, src.parent / "gpt_oss-q8.gguf", "f32", matrices="Q8_0")
    q8_types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(q8)).tensors}
    assert q8_types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert q8_types["blk.0.ffn_up_exps.bias"] == q8_types["blk.0.attn_q.bias"] == gguf.GGMLQuantizationType.F32


def test_gpt_oss_llama_cpp_cannot_run_gets_one_line_errors(tmp_path):
    (tmp_path / "limit").mkdir()
    src = make_hf_model("gpt_oss", tmp_path / "limit", seed=0, swiglu_limit=5.0)  # llama.cpp's is fixed at 7
    with pytest.raises(UnsupportedModelError, match=r"clamped SwiGLU of alpha 1.702, limit 7.0; this config has "
                                                    r"attention_bias True, swiglu_alpha 1.702, swiglu_limit 5.0$"):
        gguf_file(src, "f32")
    (tmp_path / "yarn").mkdir()
    qwen = make_hf_model("qwen3", tmp_path / "yarn", seed=0, rope_scaling=dict(rope_type="yarn", factor=4.0))
    with pytest.raises(UnsupportedModelError, match="does not handle rope scaling 'yarn' for qwen3"):
        gguf_file(qwen, "f32")


def _bench_script():
    """benchmarks/bench_vs_llamacpp.py as a module (its byte counts are what its table's MB / token shows)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_llamacpp.py"
    spec = importlib.util.spec_from_file_location("bench_vs_llamacpp", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_vs_llamacpp"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kind, share", [("qwen3_moe", 2 / 8), ("gpt_oss", 2 / 4)])
def test_moe_bytes_per_token_count_k_of_e_experts_alike_in_both_engines(families, kind, share):
    """The bench's MB read per token: every float32 tensor but the embedding table (the head is its own), an
    expert's matrices and biases at k/E -- the same sum from llmsys's loaded model and from the f32 GGUF."""
    from safetensors.torch import load_file

    from llmsys import LLM

    bench = _bench_script()
    src = families[kind]
    want = sum(t.numel() * 4 * (share if ".experts." in n else 1.0)
               for n, t in load_file(str(src / "model.safetensors")).items() if "embed_tokens" not in n)
    assert bench.gguf_step_bytes(gguf_file(src, "f32")) == int(want)
    llm = LLM(str(src), dtype="float32", device="cpu", progress=False)
    assert bench.llmsys_step_bytes(llm.loaded.model) == int(want)


def test_unhandled_inputs_get_one_line_errors(families, tmp_path):
    phi = tmp_path / "phi3"
    phi.mkdir()
    (phi / "config.json").write_text('{"model_type": "phi3"}')
    (phi / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError,
                       match="handles model_type llama, mistral, qwen2, qwen3, qwen3_moe, gpt_oss, not 'phi3'"):
        gguf_file(phi, "f32")
    dense1 = make_hf_model("qwen3_moe", tmp_path / "moe", seed=0)  # layer 1 dense: llama.cpp's qwen3moe has none
    with pytest.raises(UnsupportedModelError, match="every layer sparse"):
        gguf_file(dense1, "f32")
    from safetensors.torch import load_file, save_file

    gap = make_hf_model("qwen3_moe", tmp_path / "gap", seed=0, mlp_only_layers=[])
    (st,) = gap.glob("*.safetensors")
    tensors = load_file(str(st))
    del tensors["model.layers.0.mlp.experts.1.gate_proj.weight"]
    save_file(tensors, str(st))
    with pytest.raises(CheckpointError, match=r"blk.0.ffn_gate_exps.weight needs experts 0..7, the checkpoint has 7"):
        gguf_file(gap, "f32")
    with pytest.raises(UnsupportedModelError, match="needs a Hugging Face safetensors folder"):
        gguf_file(tmp_path, "f32")
    with pytest.raises(InvalidParameterError, match="choose one of f32, f16, q8_0, q4_0, q4_K_M"):
        gguf_file(families["qwen2"], "q3_K")


def test_vs_names_and_format_pairing():
    from llmsys.engine.bench.llamacpp import paired_format, split_kind
    from llmsys.engine.bench.suite import check_baselines

    assert split_kind("llama.cpp:q4_K_M") == ("llama.cpp", "q4_K_M") and split_kind("llama.cpp") == ("llama.cpp", None)
    check_baselines(["transformers", "llama.cpp", "llama.cpp:q4_K_M"])
    with pytest.raises(InvalidParameterError, match="q4_K_M"):
        check_baselines(["llama.cpp:q9"])
    with pytest.raises(InvalidParameterError, match="choose from transformers, accelerate, llama.cpp"):
        check_baselines(["vllm"])
    assert [paired_format(torch.float32, "none"), paired_format(torch.bfloat16, "none"),
            paired_format(torch.float16, "none"), paired_format(torch.bfloat16, "int8"),
            paired_format(torch.bfloat16, "int4"), paired_format(torch.bfloat16, "int4", "q4_K_M")] == [
        "f32", "f16", "f16", "q8_0", "q4_0", "q4_K_M"]
    with pytest.raises(InvalidParameterError, match="no GGUF format pairs with --quant nf4"):
        paired_format(torch.bfloat16, "nf4")


def test_without_llama_cpp_the_row_names_the_install(stories, monkeypatch):
    from llmsys.engine.bench.machine import machine_info
    from llmsys.engine.bench.measure import TestSpec
    from llmsys.engine.bench.suite import BenchSpec, LoadConfig, run_bench
    from llmsys.offload.bandwidth import Bandwidths

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    spec = BenchSpec(model=str(stories), tests=[TestSpec(0, 2)], repetitions=1, e2e=False, warmup=False,
                     configs=[LoadConfig(dtype="float32")], vs=["llama.cpp"])
    (row,) = run_bench(spec, machine_info(bandwidths=Bandwidths(mem_gbps=10.0, disk_read_gbps=1.0))).rows
    assert row.error is None and row.tok_s > 0  # our engine's row is unaffected
    err = row.baselines["llama.cpp"].error
    assert err == 'llama-cpp-python is not installed: pip install -e ".[llamacpp]" (builds llama.cpp, ~15 min)'


# --------------------------------------------------------------------------
# llama.cpp's eval of the files
# --------------------------------------------------------------------------


def _llama(path: Path, logits_all: bool = False):
    return llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=128, n_threads=1, n_threads_batch=1,
                           n_gpu_layers=0, logits_all=logits_all, verbose=False)


def _greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        out.append(int(logits.argmax()))
        llm.eval([out[-1]])
    return out


def _hf_logits_and_greedy(folder: Path, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = m(torch.tensor([ids])).logits[0].numpy()  # [T, V]
        gen = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    return logits, gen


def _rel_err(a: np.ndarray, ref: np.ndarray) -> np.ndarray:  # [T]: per position, over its largest |logit|
    return np.abs(a - ref).max(-1) / np.abs(ref).max(-1)


@needs_llama_cpp
def test_llama_cpp_f32_matches_transformers_on_stories(stories, monkeypatch):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(stories))(PROMPT)["input_ids"]
    ref, ref_gen = _hf_logits_and_greedy(stories, ids, 20)
    llm = _llama(gguf_file(stories, "f32"), logits_all=True)
    assert llm.tokenize(PROMPT.encode()) == ids  # the exported SPM vocabulary tokenizes as HF does
    llm.reset()
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)])  # [T, V], every position
    err = _rel_err(got, ref)
    assert err.max() < F32_RTOL, err
    assert _greedy(llm, ids, 20) == ref_gen
    llm.close()

    # Control: without the q/k reordering llama.cpp's RoPE pairs the wrong dimensions.
    monkeypatch.setitem(gguf_export._ARCHS, "llama", ("llama", False))
    monkeypatch.setattr(gguf_export, "_EXPORT_VERSION", -1)  # another cache key: a fresh file
    bad = _llama(gguf_file(stories, "f32"), logits_all=True)
    bad.reset()
    bad.eval(ids)
    assert _rel_err(np.array(bad.scores[: len(ids)]), ref)[1:].min() > 10 * F32_RTOL  # position 0 has no rotation
    bad.close()


@needs_llama_cpp
@pytest.mark.parametrize("kind", ["qwen2", "llama3.2", "mistral", "qwen3_moe", "gpt_oss"])
def test_llama_cpp_f32_matches_transformers_on_other_families(families, kind):
    """qwen2: biases + NEOX RoPE, tied; llama3.2: llama3 rope scaling (rope_freqs), tied; mistral: llama arch;
    qwen3_moe: stacked experts (ffn_*_exps) and the router, as llama.cpp's qwen3moe; gpt_oss: attention sinks,
    a 12-token window on layer 0 (the 40-token prompt passes it), q/k/v/o biases, YaRN, the biased router's
    softmax over its top 2, experts' biases and the clamped SwiGLU, as llama.cpp's gpt-oss."""
    ids = list(range(20, 60))
    ref, ref_gen = _hf_logits_and_greedy(families[kind], ids, 20)
    llm = _llama(gguf_file(families[kind], "f32"), logits_all=True)
    llm.reset()
    llm.eval(ids)
    assert _rel_err(np.array(llm.scores[: len(ids)]), ref).max() < F32_RTOL
    assert _greedy(llm, ids, 20) == ref_gen
    llm.close()


@needs_llama_cpp
def test_gpt_oss_yarn_without_truncation_differs_in_llama_cpp(tmp_path):
    """The released configs' ``truncate: false`` keeps YaRN's correction range fractional; llama.cpp rounds it
    out to whole dimensions (its gpt-oss cannot be told otherwise), which moves this tiny model's second
    rotated pair (range 0..2.3 against 0..3) enough to show: the file is written all the same, and the
    tolerance above tells a RoPE difference from none."""
    (tmp_path / "m").mkdir()
    src = make_hf_model("gpt_oss", tmp_path / "m", seed=1, rope_parameters=_gpt_oss_yarn(truncate=False))
    ids = list(range(20, 60))
    ref, _ = _hf_logits_and_greedy(src, ids, 1)
    llm = _llama(gguf_file(src, "f32"), logits_all=True)
    llm.reset()
    llm.eval(ids)
    err = _rel_err(np.array(llm.scores[: len(ids)]), ref)
    assert err[0] < F32_RTOL and err[1:].max() > 10 * F32_RTOL, err  # position 0 has no rotation
    llm.close()


@needs_llama_cpp
def test_llama_cpp_quantizer_files_load_and_agree(stories):
    ids = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421]
    f32 = _greedy(_llama(gguf_file(stories, "f32")), ids, 20)
    q8 = gguf_file(stories, "q8_0")
    kinds = {t.tensor_type for t in gguf.GGUFReader(str(q8)).tensors}
    assert gguf.GGMLQuantizationType.Q8_0 in kinds  # llama.cpp's format (ffn_down, 172 columns, stays f16)
    got = _greedy(_llama(q8), ids, 20)
    # 8-bit weights move logits by ~1%: greedy may flip late on a near tie, so the bound is the first 10
    # tokens equal and 16 of 20 overall (observed: all 20 equal).
    assert got[:10] == f32[:10] and sum(a == b for a, b in zip(got, f32)) >= 16, (got, f32)
    for fmt, qtype in (("q4_0", gguf.GGMLQuantizationType.Q4_0), ("q4_K_M", None)):
        path = gguf_file(stories, fmt)
        kinds = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
        assert qtype is None or qtype in kinds
        assert path.stat().st_size < gguf_file(stories, "f16").stat().st_size
        assert len(_greedy(_llama(path), ids, 4)) == 4  # loads and runs


@needs_llama_cpp
def test_a_failed_quantization_says_why(tmp_path, capfd):
    from llmsys.kernels.common.errors import CheckpointError

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(CheckpointError, match="could not quantize it to q8_0 .*failed to load model"):
        gguf_export.quantize(junk, tmp_path / "out.gguf", "q8_0")
    assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob("out.gguf.tmp*"))
    assert "failed" not in capfd.readouterr().err  # llama.cpp's own lines were captured, not printed


@needs_llama_cpp
def test_baseline_batch_above_one_is_a_row_error(stories):
    from llmsys.engine.bench.llamacpp import LlamaCppBaseline
    from llmsys.engine.bench.measure import TestSpec

    base = LlamaCppBaseline(gguf_file(stories, "f32"), "f32", n_ctx=64, n_batch=512)
    res = base.measure(TestSpec(8, 4), batch=1, reps=2)
    assert res.reps == 2 and res.tok_s_mean > 0 and res.ttft_ms > 0 and res.itl_p50_ms > 0
    with pytest.raises(InvalidParameterError, match="runs one sequence; this row has batch 2"):
        base.measure(TestSpec(8, 4), batch=2, reps=1)
    base.close()


@needs_llama_cpp
@pytest.mark.parametrize("kind", ["stories", "gpt_oss"])
def test_batched_decode_gives_each_sequence_its_own_greedy_tokens(stories, families, kind):
    """run_batched's sequences share each llama_decode call: each must continue from its own prompt at its own
    positions, as one sequence alone does (gpt-oss: a 12-token window the 30 positions pass)."""
    from llmsys.engine.bench.llamacpp import LlamaCppBaseline
    from llmsys.engine.bench.measure import TestSpec

    path = gguf_file(stories if kind == "stories" else families[kind], "f32")
    base = LlamaCppBaseline(path, "f32", n_ctx=64, n_batch=512)
    prompts = [[1, 403, 407, 261, 378, 432, 383, 286, 261, 376], [1, 383, 286, 261, 376, 298, 315, 421, 300, 301],
               [1, 315, 421, 300, 301, 302, 261, 378, 432, 383]]
    times, got = base.decode_batched(prompts, 20)
    assert got == [_greedy(base.model, ids, 20) for ids in prompts]
    assert len({tuple(g) for g in got}) == 3  # three different continuations
    assert times.prefill_s > 0 and len(times.decode_steps) == 20
    res = base.run_batched(TestSpec(8, 4), 4, torch.Generator().manual_seed(0))
    assert res.prefill_s > 0 and len(res.decode_steps) == 4 and all(t > 0 for t in res.decode_steps)
    base.close()


@needs_llama_cpp
def test_cli_bench_vs_llama_cpp_rows_and_ratio(stories, capsys):
    from llmsys.engine.cli.main import main

    rc = main(["bench", str(stories), "--vs", "llama.cpp", "-p", "8", "-n", "4", "-r", "1", "--dtype", "float32"])
    assert rc == 0
    md = capsys.readouterr().out
    assert "llama.cpp t/s" in md and "x llama.cpp" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| stories260k-hf")]
    assert len(rows) == 2 and "| pp8 |" in rows[0] and "| tg4 |" in rows[1]
    assert all("error" not in ln and ln.rstrip(" |").endswith("x") for ln in rows), rows

    rc = main(["bench", str(stories), "--vs", "llama.cpp", "-p", "0", "-n", "2", "-r", "1", "--dtype", "float32",
               "--quant", "none,int8", "--no-e2e", "--no-warmup", "-o", "jsonl"])
    assert rc == 0
    got = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["quant"], r["baselines"]["llama.cpp"]["weights"]) for r in got] == [("none", "f32"), ("int8", "q8_0")]
    for r in got:
        b = r["baselines"]["llama.cpp"]
        assert b["error"] is None and b["tok_s"] > 0 and b["ratio"] == pytest.approx(r["tok_s"] / b["tok_s"])
        assert b["peak_cpu_bytes"] > 0
