"""GGUF files loaded by llmsys (issue #19): each against the safetensors model of the same
weights, and where llama-cpp-python is installed, against llama.cpp on the same file.

The files are written here from the tiny random models of the parity tests and from
../shared's stories260k (``engine.bench.gguf_export``: F32/F16, and Q8_0/Q4_0 matrices by the
``gguf`` package's own quantizer); llama.cpp's quantizer makes Q4_K_M where it is installed.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CORPUS, STORIES_HF, need_shared
from tiny_models import make_hf_model

gguf = pytest.importorskip("gguf", reason="reading GGUF needs the gguf package (a dependency of llmsys)")

from llmsys.engine.attention import make_backend  # noqa: E402
from llmsys.engine.bench.gguf_export import export_float  # noqa: E402
from llmsys.engine.kv_cache import KVCacheSpec, make_kv_pool  # noqa: E402
from llmsys.engine.loader import load_model  # noqa: E402
from llmsys.engine.loader.gguf_io import hf_to_interleaved, is_gguf, open_index  # noqa: E402
from llmsys.engine.models.base import TransformerArgs  # noqa: E402
from llmsys.kernels.common.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from llmsys.quant import Int4Linear  # noqa: E402

try:
    import llama_cpp
except ImportError:
    llama_cpp = None

FAMILIES = ("llama", "llama3.2", "mistral", "qwen2", "qwen3")
# a8 (x rounded to int8 per 32 columns; without the C kernels bf16 x and weights) against float x on the
# same int4 weights, relative to the position's largest |logit|: a wrong nibble or row order is O(1).
A8_RTOL = 5e-2


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-load")
    out = {}
    for kind in FAMILIES:
        (root / kind).mkdir()
        out[kind] = make_hf_model(kind, root / kind, seed=2)
    return out


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prefill through the engine's forward, ``[T, V]`` float32."""
    a = loaded.args
    bs = 16
    nb = -(-len(ids) // bs)
    spec = KVCacheSpec(a.num_hidden_layers, nb + 1, bs, a.num_key_value_heads, a.head_dim, loaded.dtype)
    attn = make_backend(make_kv_pool(spec, loaded.device), loaded.device, bs)
    with torch.inference_mode():
        meta = attn.metadata([len(ids)], [len(ids)], [list(range(1, nb + 1))])
        h = loaded.model(torch.tensor(ids), torch.arange(len(ids)), attn, meta)
        return loaded.model.compute_logits(h).float()


def _ids(n: int = 40, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _round_matrices(loaded, dtype: torch.dtype) -> None:
    """Round every 2-D parameter to ``dtype`` and back, in place (what an F16 file holds)."""
    with torch.no_grad():
        for p in loaded.model.parameters():
            if p.dim() == 2:
                p.copy_(p.to(dtype).to(p.dtype))


@pytest.mark.parametrize("kind", FAMILIES)
def test_f32_and_f16_files_give_the_safetensors_logits(families, kind, tmp_path):
    """F32: bit-identical logits (names, q/k row order, rope scaling, tying read back right). F16: identical
    to the safetensors model with its matrices rounded to f16 (1-D tensors stay F32 in the file)."""
    folder = families[kind]
    ids = _ids()
    ref = load_model(folder, dtype="float32", device="cpu")
    want = _logits(ref, ids)
    f32 = export_float(folder, tmp_path / "f32.gguf", "f32")
    got = load_model(f32, dtype="float32", device="cpu")
    assert got.family == ("llama" if kind == "mistral" else ref.family)  # llama.cpp writes Mistral as "llama"
    common = [f.name for f in fields(TransformerArgs) if f.name != "rope_scaling"]  # Mistral's sliding window: not in GGUF
    assert [getattr(got.args, f) for f in common] == [getattr(ref.args, f) for f in common]
    if kind == "llama3.2":  # llama.cpp stores Llama 3 rope scaling as per-frequency divisors (rope_freqs)
        assert got.args.rope_scaling["rope_type"] == "freq_factors" and ref.args.rope_scaling["rope_type"] == "llama3"
    else:
        assert got.args.rope_scaling == ref.args.rope_scaling
    assert torch.equal(_logits(got, ids), want)
    f16 = export_float(folder, tmp_path / "f16.gguf", "f16")
    _round_matrices(ref, torch.float16)
    assert torch.equal(_logits(load_model(f16, dtype="float32", device="cpu"), ids), _logits(ref, ids))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q6_K", "Q5_K"])
def test_int8_block_formats_keep_their_codes_with_block_scales(families, tmp_path, qtype):
    """Q8_0 is int8 with an fp16 scale per 32 columns, Q5_0 5-bit codes (minus 16) with one, Q6_K 6-bit codes
    (minus 32) with a float32 d * sc per 16: the layers (and the embedding, the tied head) are Int8BlockLinear
    (Q8_0: the file's own bytes; Q6_K, its scales as stored: 1.07 a weight; Q5_K, 5-bit codes with a float32
    scale and minimum per 32: 1.25 a weight), whose weights are gguf's own dequantization of each
    matrix (q/k rows of the llama layout put back), and whose logits are those of the float model of the
    same weights within the a8 bound."""
    from llmsys.quant import Int8BlockLinear

    folder = families["llama"]
    if qtype in ("Q6_K", "Q5_K"):  # rows of whole 256-column super-blocks
        folder = make_hf_model("llama", tmp_path / "wide", seed=3, hidden_size=256, intermediate_size=512,
                               num_attention_heads=4, num_key_value_heads=2)
    path = export_float(folder, tmp_path / "q.gguf", "f32", qtype)
    got = load_model(path, dtype="float32", device="cpu")
    ref = load_model(folder, dtype="float32", device="cpu")
    reader = gguf.GGUFReader(str(path))
    a = ref.args
    kinds = set()
    for t in reader.tensors:
        if t.tensor_type.name != qtype:
            continue
        kinds.add(t.name.split(".")[-2])
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
        hf = _hf_name(t.name)
        if ".q_proj." in hf:
            w = _from_interleaved(w, a.num_attention_heads)
        elif ".k_proj." in hf:
            w = _from_interleaved(w, a.num_key_value_heads)
        mod = got.model.get_submodule(hf.removesuffix(".weight"))
        mod = mod.table if hf == "model.embed_tokens.weight" else mod
        assert isinstance(mod, Int8BlockLinear) and torch.equal(mod.dequantize(torch.float32), w), hf
        if qtype == "Q8_0":
            assert mod.nbytes() == t.n_bytes  # the file's own bytes: 1 per weight + an fp16 per 32
        if qtype == "Q6_K":  # 1 per weight + its int8 scale per 16 and fp16 d per 256, as stored (bf16: 2)
            assert mod.nbytes() == w.numel() + w.numel() // 16 + w.numel() * 2 // 256
        if qtype == "Q5_K":  # 1 per weight + a float32 scale and offset per 32
            assert mod.nbytes() == w.numel() * 5 // 4
        ref.model.get_parameter(hf).data.copy_(w)
    assert {"attn_q", "attn_k", "ffn_down", "token_embd"} <= kinds
    ids = _ids()
    want, have = _logits(ref, ids), _logits(got, ids)
    err = ((have - want).abs().max(-1).values / want.abs().max(-1).values).max().item()
    assert err < (1.6 if qtype in ("Q6_K", "Q5_K") else 1) * A8_RTOL, err  # the wider model: see the Q4_K test
    assert {k.split(" ")[0]: v for k, v in got.stored_formats.items()} == {
        "F32": "float32", qtype: f"int8:g{16 if qtype == 'Q6_K' else 32}, codes as stored"}


def _hf_name(name: str) -> str:
    from llmsys.engine.loader.gguf_io import hf_name

    out = hf_name(name)
    assert out is not None
    return out


def _from_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    from llmsys.engine.loader.gguf_io import interleaved_to_hf

    return interleaved_to_hf(w, heads)


def _holds_the_files_weights(mod, t, heads: int | None) -> torch.Tensor:
    """``mod``'s weight ``[N, K]`` float32 equals gguf's own dequantization of the file's tensor ``t`` bit for bit
    (``heads``: q/k rows of the llama layout, compared in the file's interleaved order); returns it."""
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
    w = mod.dequantize(torch.float32)
    assert torch.equal(w if heads is None else hf_to_interleaved(w, heads), want), t.name
    return w


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_q4_0_matrices_keep_their_codes_as_int4_g32(families, kind, tmp_path):
    """Q4_0 is int4 with group 32, zero 8 and fp16 scales: the layers are Int4Linear whose weights are
    gguf's dequantization of the file exactly, and the model's logits are those of the float model
    holding those weights, within the a8 bound (the C kernels round x to int8 per 32 columns)."""
    folder = families[kind]
    path = export_float(folder, tmp_path / "q4.gguf", "f32", "Q4_0")
    got = load_model(path, dtype="float32", device="cpu")
    layer = got.model.model.layers[1]
    a = got.args
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for gname, mod, heads in [("blk.1.attn_q.weight", layer.self_attn.q_proj, a.num_attention_heads),
                              ("blk.1.attn_k.weight", layer.self_attn.k_proj, a.num_key_value_heads),
                              ("blk.1.ffn_down.weight", layer.mlp.down_proj, None)]:
        assert isinstance(mod, Int4Linear) and mod.group_size == 32 and mod.mode == "packed_cpu"
        _holds_the_files_weights(mod, reader[gname], heads if kind == "llama" else None)
    # The float model of the same weights: every Int4Linear replaced by its dequantized matrix.
    ref = load_model(folder, dtype="float32", device="cpu")
    for name, mod in got.model.named_modules():
        if isinstance(mod, Int4Linear):  # the embedding's table too (and the tied head with it)
            target = "model.embed_tokens" if name == "model.embed_tokens.table" else name
            ref.model.get_parameter(target + ".weight").data.copy_(mod.dequantize(torch.float32))
    ids = _ids()
    want, have = _logits(ref, ids), _logits(got, ids)
    err = ((have - want).abs().max(-1).values / want.abs().max(-1).values).max().item()
    assert err < A8_RTOL, err
    assert (have.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    # Lighter than the file's own dequantization: int4 codes + fp16 scales + zeros, no bf16 copy.
    assert got.stored_formats[next(k for k in got.stored_formats if k.startswith("Q4_0"))] == "int4:g32, codes as stored"


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_1"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_q4_k_and_q4_1_matrices_keep_codes_scales_and_minimums(kind, qtype, tmp_path):
    """Q4_K (super-blocks of 256, 6-bit scales and minimums) and Q4_1 (scale and minimum per 32) are int4
    g32 whose minimum is a float: the layers are Int4Linear with float32 scales and offsets whose weights
    are gguf's own dequantization of the file bit for bit, at under a byte per weight, and the logits are
    the float model's of those weights within the a8 bound."""
    folder = make_hf_model(kind, tmp_path / "m", seed=3, hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2)  # rows of whole Q4_K super-blocks
    path = export_float(folder, tmp_path / "q.gguf", "f32", qtype)
    got = load_model(path, dtype="float32", device="cpu")
    a = got.args
    layer = got.model.model.layers[1]
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert reader["blk.1.ffn_down.weight"].tensor_type.name == qtype
    for gname, mod, heads in [("blk.1.attn_q.weight", layer.self_attn.q_proj, a.num_attention_heads),
                              ("blk.1.attn_k.weight", layer.self_attn.k_proj, a.num_key_value_heads),
                              ("blk.1.ffn_down.weight", layer.mlp.down_proj, None),
                              ("blk.1.ffn_up.weight", layer.mlp.up_proj, None)]:
        assert isinstance(mod, Int4Linear) and mod.group_size == 32 and mod.mode == "packed_cpu", gname
        assert mod.kscales() is not None or (mod.offsets_gm is not None and mod.scales_orig.dtype == torch.float32)
        w = _holds_the_files_weights(mod, reader[gname], heads if kind == "llama" else None)
        # codes 1/2 a weight, rows padded to 64; Q4_1: float32 scales and offsets per 32 (0.75 a weight in all,
        # bf16: 2); Q4_K: its 6-bit scales and minimums per 32 and fp16 d, dmin per 256, as stored (0.58)
        bias = 0 if mod.bias is None else mod.bias.numel() * mod.bias.element_size()
        meta = w.numel() // 4 if qtype == "Q4_1" else w.numel() * 2 // 32 + w.numel() * 4 // 256
        assert mod.nbytes() == -(-mod.out_features // 64) * 64 * w.shape[1] // 2 + meta + bias, gname
        assert (mod.kscales() is not None) == (qtype == "Q4_K")
    ref = load_model(folder, dtype="float32", device="cpu")
    for name, mod in got.model.named_modules():
        if isinstance(mod, Int4Linear):
            target = "model.embed_tokens" if name == "model.embed_tokens.table" else name
            ref.model.get_parameter(target + ".weight").data.copy_(mod.dequantize(torch.float32))
    ids = _ids()
    want, have = _logits(ref, ids), _logits(got, ids)
    err = (have - want).abs().max(-1).values / want.abs().max(-1).values  # [T]
    # This wider model's a8 rounding alone: Q4_0 files of it measured 0.045-0.050 worst, ~0.03 mean
    # (Q4_K / Q4_1: 0.040-0.053, ~0.03); a wrong scale, minimum or nibble order is O(1).
    assert err.max() < 1.6 * A8_RTOL and err.mean() < 0.04, (err.max(), err.mean())
    assert (have.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    kept = got.stored_formats[next(k for k in got.stored_formats if k.startswith(qtype))]
    assert kept == "int4:g32, codes as stored"


def test_stories_gguf_generates_the_safetensors_text(tmp_path):
    """The real trained model: greedy text from its F32 GGUF (tokenizer rebuilt from the GGUF metadata)
    is the HF directory's, word for word."""
    from llmsys import LLM, SamplingParams

    folder = need_shared(STORIES_HF)
    path = export_float(folder, tmp_path / "stories.gguf", "f32")
    sp = SamplingParams(temperature=0, max_tokens=40)
    want = LLM(str(folder), dtype="float32", device="cpu", progress=False).generate("Once upon a time", sp)[0]
    got = LLM(str(path), dtype="float32", device="cpu", progress=False).generate("Once upon a time", sp)[0]
    assert got.text == want.text and got.token_ids == want.token_ids
    assert want.text.startswith(", there was a little girl named Lily")


def test_gguf_is_recognized_by_its_magic_not_its_name(families, tmp_path):
    blob = tmp_path / "sha256-0123abcd"  # how the Ollama store names a model blob
    export_float(families["qwen2"], blob, "f32")
    assert is_gguf(blob) and not is_gguf(families["qwen2"] / "config.json")
    assert load_model(blob, dtype="float32", device="cpu").family == "qwen2"


def test_bad_files_get_one_line_errors(families, tmp_path):
    good = export_float(families["llama"], tmp_path / "good.gguf", "f32")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(CheckpointError, match=r"cut\.gguf: .*truncated or corrupt"):
        load_model(cut, dtype="float32", device="cpu")
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:40])
    with pytest.raises(CheckpointError, match=r"header\.gguf"):
        load_model(header, dtype="float32", device="cpu")

    def write(name: str, arch: str, tensor_dtype=np.float32) -> Path:
        out = tmp_path / name
        w = gguf.GGUFWriter(str(out), arch)
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=tensor_dtype))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out

    with pytest.raises(UnsupportedModelError, match=r"mamba\.gguf: GGUF architecture 'mamba' is not supported; "
                                                    r"supported: llama, qwen2, qwen3, gemma2, gemma3, phi3, "):
        load_model(write("mamba.gguf", "mamba"), dtype="float32", device="cpu")
    with pytest.raises(CheckpointError, match=r"lacks llama\.attention\.head_count"):
        load_model(write("partial.gguf", "llama"), dtype="float32", device="cpu")


def test_an_unsupported_tensor_type_names_it(families, tmp_path):
    """A matrix in a type llmsys cannot decode (here I8) fails at load naming the tensor and the type."""
    src = export_float(families["llama"], tmp_path / "f32.gguf", "f32")
    r = gguf.GGUFReader(str(src))
    out = tmp_path / "i8.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        _copy_field(w, key, f)
    for t in r.tensors:
        arr = np.array(t.data)
        if t.name == "blk.0.ffn_up.weight":
            arr = np.zeros(arr.shape, dtype=np.int8)
        w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"i8\.gguf: tensor blk\.0\.ffn_up\.weight is stored as I8, "
                                                    r"which llmsys cannot decode; supported: F32, F16, BF16, Q8_0"):
        load_model(out, dtype="float32", device="cpu")


def _copy_field(w, key: str, f) -> None:
    """One metadata field of a reader onto a writer (the types this exporter writes)."""
    vt = f.types[0]
    if vt == gguf.GGUFValueType.ARRAY:
        w.add_array(key, f.contents())
    elif vt == gguf.GGUFValueType.STRING:
        w.add_string(key, f.contents())
    else:
        w.add_key_value(key, f.contents(), vt)


# -- against llama.cpp on the same file ------------------------------------------------------

needs_llama_cpp = pytest.mark.skipif(
    llama_cpp is None, reason='llama-cpp-python is not installed (pip install -e ".[llamacpp]", ~15 min build)'
)


@needs_llama_cpp
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_K_M"])
def test_llama_cpp_quantized_files_agree_with_llama_cpp(fmt, tmp_path_factory, monkeypatch):
    """stories260k quantized by llama.cpp's own quantizer: llmsys's logits on that file against
    llama.cpp's (``logits_all``) over a 256-token text, top-1 agreement, and perplexity within 0.5%.
    float32 activations, as llama.cpp's: with bf16 ones (the default where the CPU lacks AVX-512 BF16,
    e.g. Zen 3) q8_0 measured +0.53% over these 256 tokens against +0.04% in float32."""
    from llmsys import LLM
    from llmsys.engine.bench.gguf_export import gguf_file
    from llmsys.engine.scoring import prompt_logits

    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path_factory.getbasetemp() / "llmsys-home-gguf"))
    folder = need_shared(STORIES_HF)
    path = gguf_file(folder, fmt)
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False, max_model_len=256)
    text = need_shared(CORPUS / "tinystories-valid.txt").read_text(encoding="utf-8")[:4000]
    ids = [llm.tokenizer.bos_token_id] + llm.tokenizer.encode(text, add_special_tokens=False)[:255]
    mine = prompt_logits(llm.core, ids).numpy()
    cpp = llama_cpp.Llama(str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False, n_threads=2)
    cpp.eval(ids)
    theirs = np.array(cpp.scores[: len(ids)], dtype=np.float32)
    cpp.close()
    assert (mine.argmax(-1) == theirs.argmax(-1)).mean() >= 0.95

    def ppl(logits: np.ndarray) -> float:
        x = logits[:-1].astype(np.float64)
        lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
        return float(np.exp((lse - x[np.arange(len(ids) - 1), ids[1:]]).mean()))

    assert abs(ppl(mine) / ppl(theirs) - 1) < 0.005, (ppl(mine), ppl(theirs))


@needs_llama_cpp
def test_a_llama_cpp_q4_k_m_file_keeps_its_k_quants_and_agrees_with_llama_cpp(tmp_path, monkeypatch):
    """llama.cpp's own Q4_K_M of a model whose rows are whole super-blocks (its Q4_K and Q6_K matrices:
    the common case, unlike stories260k's 64 columns): llmsys keeps both as stored, and runs the file at
    least as close to the float model of its weights as llama.cpp does (both engines round activations to
    8 bits: llmsys per 32 columns, llama.cpp's K-quant dots per 256), with the same top-1 tokens."""
    from llmsys import LLM
    from llmsys.engine.bench.gguf_export import gguf_file
    from llmsys.engine.scoring import prompt_logits

    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path / "home"))
    folder = make_hf_model("llama", tmp_path / "m", seed=5, hidden_size=256, intermediate_size=768,
                           num_attention_heads=4, num_key_value_heads=2)
    path = gguf_file(folder, "q4_K_M")
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"Q4_K", "Q6_K"} <= kinds, kinds
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False, max_model_len=128)
    formats = {k.split(" ")[0]: v for k, v in llm.loaded.stored_formats.items()}
    assert formats["Q4_K"] == "int4:g32, codes as stored" and formats["Q6_K"] == "int8:g16, codes as stored"
    ids = _ids(96, seed=1)
    mine = prompt_logits(llm.core, ids).numpy()
    cpp = llama_cpp.Llama(str(path), n_ctx=128, n_batch=128, logits_all=True, verbose=False, n_threads=2)
    cpp.eval(ids)
    theirs = np.array(cpp.scores[: len(ids)], dtype=np.float32)
    cpp.close()
    exact = load_model(folder, dtype="float32", device="cpu")  # the file's weights, dequantized, in float32
    index = open_index(path)
    with torch.no_grad():
        for name, p in exact.model.named_parameters():
            p.copy_(index.read(name, torch.float32))
    ref = _logits(exact, ids).numpy()

    def rel(a: np.ndarray) -> np.ndarray:  # per position, relative to its largest |logit|
        return np.abs(a - ref).max(-1) / np.abs(ref).max(-1)

    # measured here: llmsys 0.047 worst / 0.030 mean, llama.cpp 0.063 / 0.041
    assert rel(mine).max() <= rel(theirs).max() and rel(mine).mean() <= rel(theirs).mean()
    assert (mine.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


def test_quant_flag_requantizes_or_keeps_the_codes(families, tmp_path):
    """``--quant int4:g32`` is what Q4_0 already is (the codes kept, the same layers as no flag);
    another format re-quantizes the dequantized matrices, and the reports say which."""
    from llmsys import LLM, SamplingParams
    from llmsys.quant import Int8Linear

    path = export_float(families["qwen2"], tmp_path / "q4.gguf", "f32", "Q4_0")
    plain = LLM(str(path), device="cpu", progress=False, kv_cache_tokens=64)
    same = LLM(str(path), device="cpu", progress=False, kv_cache_tokens=64, quant="int4:g32")
    other = LLM(str(path), device="cpu", progress=False, kv_cache_tokens=64, quant="int8")
    ids = _ids(12)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert plain.generate(ids, sp)[0].token_ids == same.generate(ids, sp)[0].token_ids
    down = other.loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Int8Linear)
    q4 = next(k for k in other.memory_report().stored_formats if k.startswith("Q4_0"))
    assert other.memory_report().stored_formats[q4] == "dequantized, matrices re-quantized to int8 (--quant)"
    assert plain.memory_report().stored_formats[q4] == "int4:g32, codes as stored"


def test_offloaded_gguf_layers_give_the_resident_answers(families, tmp_path):
    """Layers forced to disk (written to the offload file once dequantized or kept as codes, then
    streamed per step) change no token: the same greedy text as every layer resident."""
    from llmsys import LLM, SamplingParams

    path = export_float(families["llama"], tmp_path / "q4.gguf", "f16", "Q4_0")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = _ids(10)
    resident = LLM(str(path), device="cpu", progress=False, kv_cache_tokens=64).generate(ids, sp)[0].token_ids
    llm = LLM(str(path), device="cpu", progress=False, kv_cache_tokens=64, cpu_mem="64MiB",
              offload_dir=str(tmp_path / "off"), placement={"disk": 2})
    assert llm.memory_report().weights.get("disk", 0) > 0
    assert llm.generate(ids, sp)[0].token_ids == resident


def test_a_quantized_embedding_and_head_on_disk_give_the_resident_answers(families, tmp_path):
    """A GGUF's embedding and head kept as codes (Q4_0: an Int4 table, no row layout to read rows from) placed
    on disk are streamed whole around each lookup / logits call: the resident tokens."""
    from llmsys import LLM, SamplingParams

    path = export_float(families["llama"], tmp_path / "q4.gguf", "f16", "Q4_0")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = _ids(10)
    resident = LLM(str(path), device="cpu", progress=False, kv_cache_tokens=64).generate(ids, sp)[0].token_ids
    llm = LLM(str(path), device="cpu", progress=False, kv_cache_tokens=64, cpu_mem="64MiB",
              offload_dir=str(tmp_path / "off"), placement={"embed": "disk", "head": "disk"})
    assert type(llm.loaded.model.model.embed_tokens).__name__ == "Whole_embed"
    assert llm.generate(ids, sp)[0].token_ids == resident
    # the planner costs such a table as a whole read per step, not a row per token
    bw = llm.plan.bandwidths.disk_read_gbps * 1e9
    assert llm.plan.embed.ms == pytest.approx(llm.plan.embed.nbytes / bw * 1e3, rel=1e-6)


def test_plan_reads_a_gguf_and_sizes_its_int4_layers(families, tmp_path):
    """``llmsys plan`` on GGUF files: the Q4_0 file's layers planned at int4 size, the F16 one's at bf16."""
    import re
    import subprocess
    import sys

    q4 = export_float(families["llama"], tmp_path / "q4.gguf", "f16", "Q4_0")
    f16 = export_float(families["llama"], tmp_path / "f16.gguf", "f16")

    def layer_kib(path: Path) -> float:
        out = subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", "plan", str(path), "--dtype", "bfloat16"],
                             capture_output=True, text=True, check=True).stdout
        assert f"{path}:" in out
        m = re.search(r"layers 0-1 .*?([\d.]+) KiB", out)
        assert m, out
        return float(m.group(1))

    ratio = layer_kib(q4) / layer_kib(f16)
    assert 0.25 < ratio < 0.40, ratio  # int4:g32 with fp16 scales: 0.625 of a byte per weight vs 2


@pytest.mark.parametrize("matrices", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_K"])
def test_fused_decode_layers_take_kept_gguf_layers_bit_for_bit(tmp_path, matrices):
    """Q8_0 (block-scaled int8), Q4_0 (int4) and Q4_K (int4 with float offsets) layers run the fused decode
    layers (two C calls around attention) with the bits of the same layers op by op."""
    from llmsys import LLM, kernels
    from test_fused_decode import _step_both

    d, inter = (256, 512) if matrices.endswith("_K") else (128, 320)  # K-quants: whole 256-column super-blocks
    folder = make_hf_model("qwen2", tmp_path / "m", hidden_size=d, intermediate_size=inter)  # biases too
    path = export_float(folder, tmp_path / "m.gguf", "f16", matrices)
    llm = LLM(str(path), dtype="bfloat16", progress=False, block_size=4, kv_cache_tokens=256)
    if matrices == "Q4_K":  # its 6-bit scales and minimums kept as stored, also through the fused q|k|v
        layer = llm.loaded.model.model.layers[0]
        assert layer.mlp.down_proj.kscales() is not None and layer.self_attn.qkv_proj.kscales() is not None
    if kernels.cpu_fused_available():  # every layer's fused decode kernels planned once, with the engine
        assert all(layer.decode is not None for layer in llm.loaded.model.model.layers)
    for lens in ([9], [3, 17, 8]):
        ((h0, k0, v0), (h1, k1, v1)), stacked = _step_both(llm, lens)
        assert stacked == kernels.cpu_fused_available()  # the whole decoder in one C call
        assert torch.equal(h0, h1)
        assert all(torch.equal(a, b) for a, b in zip(k0 + v0, k1 + v1))


def test_quant_int8_g32_keeps_every_block_format_it_can(families, tmp_path):
    """``--quant int8:g32`` on a GGUF: Q8_0 codes as stored, Q4_0's as int8 (``q - 8``, the same weights),
    everything else re-quantized to it; the spec also quantizes a safetensors model (a real llmsys format)."""
    from llmsys import LLM
    from llmsys.quant import Int4Linear, Int8BlockLinear

    path = export_float(families["llama"], tmp_path / "q4.gguf", "f32", "Q4_0")
    as4 = load_model(path, dtype="float32", device="cpu")
    llm = LLM(str(path), device="cpu", progress=False, kv_cache_tokens=64, quant="int8:g32", prepack=False)
    a, b = as4.model.model.layers[0].mlp.up_proj, llm.loaded.model.model.layers[0].mlp.up_proj
    assert isinstance(a, Int4Linear) and isinstance(b, Int8BlockLinear)
    assert torch.equal(a.dequantize(), b.dequantize())
    assert set(llm.memory_report().stored_formats.values()) == {"bfloat16", "int8:g32, codes as stored"}  # F32: norms
    hf = LLM(str(families["llama"]), device="cpu", progress=False, kv_cache_tokens=64, quant="int8:g32")
    assert any(isinstance(m, Int8BlockLinear) for m in hf.loaded.model.modules())


def test_the_header_parser_reads_what_the_gguf_package_reads(tmp_path):
    """engine.loader.gguf_header (struct over the header, no tensor map) against gguf.GGUFReader on a file
    with every value type, string and numeric arrays, and tensors of several types: the same fields,
    tensor table, offsets and bytes."""
    from llmsys.engine.loader.gguf_header import read_bytes, read_header

    out = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint32("t.u32", 1 << 31)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "日本", "<0x0A>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((2, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = gguf.GGUFReader(str(out))
    h = read_header(out)
    for key, f in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want, got = f.contents(), h.fields[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert [t.name for t in h.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(h.tensors, ref.tensors):
        assert (t.shape, t.qtype, t.offset, t.nbytes) == (tuple(int(s) for s in r.shape), int(r.tensor_type),
                                                          int(r.data_offset), int(r.n_bytes))
        assert read_bytes(out, t).tobytes() == np.asarray(r.data).tobytes()


def _rewrite(src: Path, out: Path, fields: dict | None = None, drop: tuple[str, ...] = (),
             rename: dict[str, str] | None = None, arch: str = "llama") -> Path:
    """``src`` written again with metadata ``fields`` set (``(value, GGUFValueType)``), keys in ``drop`` left
    out and tensors renamed per ``rename``: the bad files of the tests below, made from a good one."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop or key in (fields or {}):
            continue
        _copy_field(w, key, f)
    for key, (value, vt) in (fields or {}).items():
        w.add_key_value(key, value, vt)
    for t in r.tensors:
        w.add_tensor((rename or {}).get(t.name, t.name), np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_unsupported_gguf_contents_get_one_line_errors(families, tmp_path):
    """Each way a GGUF can hold what llmsys does not run fails at load, naming the file and the reason."""
    good = export_float(families["llama"], tmp_path / "good.gguf", "f32")
    U32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING
    cases = [
        (dict(fields={"llama.rope.dimension_count": (8, U32)}), UnsupportedModelError, r"partial RoPE \(8 of 16 dims\)"),
        (dict(fields={"llama.rope.scaling.type": ("yarn", STR)}), UnsupportedModelError, r"rope scaling 'yarn'"),
        (dict(rename={"blk.0.ffn_up.weight": "blk.0.ffn_up_exps.weight"}), UnsupportedModelError,
         r"tensor blk\.0\.ffn_up_exps\.weight has no llmsys counterpart"),
        (dict(drop=("llama.vocab_size", "tokenizer.ggml.tokens"), rename={"token_embd.weight": "token_embd2.weight"}),
         CheckpointError, r"cannot tell the vocabulary size"),
    ]
    for i, (how, exc, msg) in enumerate(cases):
        bad = _rewrite(good, tmp_path / f"bad{i}.gguf", **how)
        with pytest.raises(exc, match=rf"bad{i}\.gguf: .*{msg}"):
            load_model(bad, dtype="float32", device="cpu")


def test_bad_gguf_headers_get_one_line_errors(tmp_path):
    """The header parser's own errors: a version it does not read, a tensor type it does not know."""
    from llmsys.engine.loader.gguf_header import read_header

    v1 = tmp_path / "v1.gguf"
    v1.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(CheckpointError, match=r"v1\.gguf: GGUF version 1 is not supported"):
        read_header(v1)
    t = tmp_path / "type.gguf"  # one kv-less header with a tensor of type 250
    name = b"x"
    body = (b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (0).to_bytes(8, "little")
            + len(name).to_bytes(8, "little") + name + (1).to_bytes(4, "little") + (32).to_bytes(8, "little")
            + (250).to_bytes(4, "little") + (0).to_bytes(8, "little"))
    t.write_bytes(body + bytes(64))
    with pytest.raises(CheckpointError, match=r"type\.gguf: tensor x has unknown ggml type 250"):
        read_header(t)
    other = tmp_path / "model.txt"
    other.write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match=r"model\.txt: expected a model directory \(with config.json\), a GGUF file"):
        load_model(other, dtype="float32", device="cpu")


def test_freq_factors_of_the_wrong_length_and_block_tensors_that_disagree():
    from llmsys.kernels import rope_inv_freq
    from llmsys.quant import Int8BlockLinear

    with pytest.raises(ValueError, match="3 rope frequency factors for head_dim 16, expected 8"):
        rope_inv_freq(16, 10000.0, {"rope_type": "freq_factors", "factors": [1.0, 2.0, 3.0]})
    with pytest.raises(CheckpointError, match=r"int8 block tensors disagree: .*expected int8 \[N, K\] and \[2, 4\]"):
        Int8BlockLinear(torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.float16), None)


@needs_llama_cpp
def test_bench_vs_llama_cpp_on_a_gguf_runs_that_file(families, tmp_path):
    """``--vs llama.cpp`` on a GGUF model is that very file; asking for another format of it is an error."""
    from llmsys.engine.bench import llamacpp
    from llmsys.kernels.common.errors import InvalidParameterError

    path = export_float(families["llama"], tmp_path / "m.gguf", "f16")
    assert llamacpp.prepare(path, torch.bfloat16, "none") == (path, "gguf")
    with pytest.raises(InvalidParameterError, match=r"m\.gguf is a GGUF file, run as it is; use --vs llama\.cpp"):
        llamacpp.prepare(path, torch.bfloat16, "none", "llama.cpp:q4_0")


def test_int8_g32_checkpoints_round_trip_and_a_wrong_shape_is_named(families, tmp_path):
    """``llmsys quantize --quant int8:g32`` writes a directory that loads back as Int8BlockLinear with the
    same tokens as quantizing at load; a block_scales tensor of the wrong shape fails naming it."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from llmsys import LLM, SamplingParams
    from llmsys.quant import Int8BlockLinear

    out = tmp_path / "q"
    subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", "quantize", str(families["llama"]), "--quant",
                    "int8:g32", "-o", str(out)], check=True, capture_output=True)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = _ids(10)
    stored = LLM(str(out), device="cpu", progress=False, kv_cache_tokens=64)
    at_load = LLM(str(families["llama"]), device="cpu", progress=False, kv_cache_tokens=64, quant="int8:g32")
    assert any(isinstance(m, Int8BlockLinear) for m in stored.loaded.model.modules())
    assert stored.generate(ids, sp)[0].token_ids == at_load.generate(ids, sp)[0].token_ids
    t = load_file(str(out / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.block_scales"
    t[key] = t[key][:1].contiguous()
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {key} has shape \(1, 64\), expected \(3, 64\)"):
        LLM(str(out), device="cpu", progress=False, kv_cache_tokens=64)


@pytest.mark.parametrize("qtype, at", [("Q4_K", 0), ("Q6_K", 208)])  # the byte offset of d in the first block
def test_a_nan_super_block_scale_is_named_at_load(tmp_path, qtype, at):
    """A K-quant's fp16 d kept as stored is checked like every other factor: a NaN one is a one-line error
    naming the tensor and the file, not garbage text later."""
    folder = make_hf_model("llama", tmp_path / "m", seed=3, hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2)
    path = export_float(folder, tmp_path / "q.gguf", "f32", qtype)
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
    data = bytearray(path.read_bytes())
    data[int(t.data_offset) + at : int(t.data_offset) + at + 2] = np.array([np.nan], np.float16).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        load_model(path, dtype="float32", device="cpu")
    msg = str(e.value)
    assert "\n" not in msg and "q.gguf" in msg and "blk.0.ffn_down.weight (super-block scales)" in msg, msg
