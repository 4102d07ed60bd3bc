"""Bad checkpoints and configs (issue #23): each fails at load with one line naming the file and the field or
tensor (an ``LLMSysError``), before anything big is allocated; the CLI prints it as one ``error:`` line, exit 2.

Every case is a copy of one tiny model built once per module (an HF folder, its int4 / int8 llmsys-quantized
twins, a GGUF export, a hand-written llama2.c file), patched in one way. The cases are those a fuzzing session
found dying with a traceback, allocating without bound, or running silently wrong.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np
import pytest
import torch

from llmsys.engine.loader import load_model
from llmsys.engine.loader.safetensors_io import SafetensorsFile, save_file
from llmsys.kernels.common.errors import CheckpointError, UnsupportedModelError
from tiny_models import make_hf_model

gguf = pytest.importorskip("gguf", reason="the GGUF cases need the gguf package (a dependency of llmsys)")

ST = "model.safetensors"
UP = "model.layers.0.mlp.up_proj"


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """The good checkpoints every case copies: HF float, llmsys int4:g64 and int8, GGUF f32, llama2.c."""
    from llmsys.engine.bench.gguf_export import export_float
    from llmsys.quant import Int4Linear, Int8Linear

    root = tmp_path_factory.mktemp("bad-ckpt")
    hf = make_hf_model("llama", root / "hf")
    f = SafetensorsFile(hf / ST)
    state = {n: f.read(n) for n in f.tensors}
    out = {"hf": hf, "gguf": export_float(hf, root / "m.gguf", "f32"), "c": _llama2c(root / "c" / "model.bin")}
    for fmt, make in (("int4:g64", lambda w: Int4Linear.from_float(w, group_size=64)), ("int8", Int8Linear.from_float)):
        q = root / fmt.replace(":", "_")
        shutil.copytree(hf, q)
        qstate = {}
        for name, t in state.items():
            if ".layers." in name and name.endswith("proj.weight"):
                for k, v in make(t).state_dict().items():
                    qstate[name.removesuffix("weight") + k] = v.contiguous()
            else:
                qstate[name] = t
        save_file(qstate, q / ST, metadata={"format": "pt", "llmsys_quant": fmt})
        _edit_config(q, lambda c, fmt=fmt: c.update(quantization_config={"quant_method": "llmsys", "format": fmt}))
        out[fmt] = q
    return out


def _llama2c(path: Path, dim=8, hidden=16, layers=1, heads=2, kv=2, vocab=32, seq=16) -> Path:
    """A tiny llama2.c file of random float32 weights (tied classifier), laid out as llama2c.load reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    hd = dim // heads
    n = (vocab * dim + layers * (2 * dim + 2 * dim * dim + 2 * kv * hd * dim + 3 * hidden * dim) + dim + seq * hd)
    w = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.1
    path.write_bytes(struct.pack("<7i", dim, hidden, layers, heads, kv, vocab, seq) + w.numpy().tobytes())
    return path


# ------------------------------------------------------------------ ways to patch a copy


def _edit_config(d: Path, fn: Callable[[dict], Any]) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _cfg(**kw) -> Callable[[Path], Path]:
    def patch(d: Path) -> Path:
        _edit_config(d, lambda c: c.update(kw))
        return d
    return patch


def _qcfg(**kw) -> Callable[[Path], Path]:
    def patch(d: Path) -> Path:
        _edit_config(d, lambda c: c["quantization_config"].update(kw))
        return d
    return patch


def _config_text(text: str) -> Callable[[Path], Path]:
    def patch(d: Path) -> Path:
        (d / "config.json").write_text(text)
        return d
    return patch


def _raw_header(fn: Callable[[dict], Any] | None = None, raw: bytes | None = None) -> Callable[[Path], Path]:
    """The safetensors header rewritten (``fn`` of the parsed header -> any JSON value, or ``raw`` bytes),
    the data bytes kept."""
    def patch(d: Path) -> Path:
        data = (d / ST).read_bytes()
        (hlen,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + hlen])
        new = raw if raw is not None else json.dumps(fn(header)).encode()
        (d / ST).write_bytes(struct.pack("<Q", len(new)) + new + data[8 + hlen :])
        return d
    return patch


def _entry(name: str, **kw) -> Callable[[dict], dict]:
    def fn(h: dict) -> dict:
        h[name].update(kw)
        return h
    return fn


def _same_bytes(a: str, b: str) -> Callable[[dict], dict]:
    def fn(h: dict) -> dict:
        h[b]["data_offsets"] = list(h[a]["data_offsets"])
        return h
    return fn


def _tensors(fn: Callable[[dict], None]) -> Callable[[Path], Path]:
    """Every tensor read, ``fn`` applied to the dict, the file written again (consistent header)."""
    def patch(d: Path) -> Path:
        f = SafetensorsFile(d / ST)
        state = {n: f.read(n) for n in f.tensors}
        fn(state)
        save_file(state, d / ST, metadata=f.metadata or None)
        return d
    return patch


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], Path]:
    def fn(state: dict) -> None:
        state[name] = value(state[name].clone()).contiguous()
    return _tensors(fn)


def _poke(index: int, v: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[index] = v
        return t
    return fn


def _shard_index(weight_map: Any) -> Callable[[Path], Path]:
    def patch(d: Path) -> Path:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return d
    return patch


# ------------------------------------------------------------------ GGUF


def _gguf_rewrite(fields: dict | None = None, tensors: Callable[[str, np.ndarray], np.ndarray] | None = None,
                  ) -> Callable[[Path], Path]:
    """The GGUF written again with metadata ``fields`` replaced (``(value, GGUFValueType)``) and each tensor
    passed through ``tensors(name, array)``."""
    def patch(src: Path) -> Path:
        r = gguf.GGUFReader(str(src))
        out = src.with_name("bad.gguf")
        w = gguf.GGUFWriter(str(out), "llama")
        for key, f in r.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture" or key in (fields or {}):
                continue
            vt = f.types[0]
            if vt == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, f.contents(), vt, sub_type=f.types[-1])
            else:
                w.add_key_value(key, f.contents(), vt)
        for key, (value, vt) in (fields or {}).items():
            w.add_key_value(key, value, vt)
        for t in r.tensors:
            arr = np.array(t.data)
            w.add_tensor(t.name, tensors(t.name, arr) if tensors else arr, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out
    return patch


def _gguf_raw(n_kv: int = 0, kvs: bytes = b"", tensors: list[tuple[str, list[int], int, int]] = (),
              n_tensors: int | None = None, data: int = 256) -> Callable[[Path], Path]:
    """A hand-written GGUF v3 header (``tensors``: name, dims, ggml type, offset) and ``data`` zero bytes:
    what a writer cannot be made to produce."""
    def patch(src: Path) -> Path:
        def s(text: str) -> bytes:
            return struct.pack("<Q", len(text)) + text.encode()
        body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors, n_kv) + kvs
        for name, dims, qtype, off in tensors:
            body += s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            body += struct.pack("<IQ", qtype, off)
        body += bytes(-len(body) % 32) + bytes(data)
        out = src.with_name("raw.gguf")
        out.write_bytes(body)
        return out
    return patch


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload


def _nested_arrays(depth: int) -> bytes:
    inner = struct.pack("<IQ", 4, 0)  # an empty uint32 array
    for _ in range(depth):
        inner = struct.pack("<IQ", 9, 1) + inner  # an array of one array
    return inner


def _ggml(vt: str) -> Any:
    return getattr(gguf.GGUFValueType, vt)


# ------------------------------------------------------------------ llama2.c


def _c_header(**kw) -> Callable[[Path], Path]:
    names = ("dim", "hidden", "layers", "heads", "kv", "vocab", "seq")

    def patch(src: Path) -> Path:
        data = bytearray(src.read_bytes())
        vals = dict(zip(names, struct.unpack("<7i", data[:28])))
        vals.update(kw)
        data[:28] = struct.pack("<7i", *(vals[n] for n in names))
        src.write_bytes(bytes(data))
        return src
    return patch


def _c_poke(index: int, v: float) -> Callable[[Path], Path]:
    def patch(src: Path) -> Path:
        data = bytearray(src.read_bytes())
        data[28 + 4 * index : 32 + 4 * index] = struct.pack("<f", v)
        src.write_bytes(bytes(data))
        return src
    return patch


# ------------------------------------------------------------------ the cases

CE, UE = CheckpointError, UnsupportedModelError
E = r"model\.layers\.0\.mlp\.up_proj"
# (id, base, patch, error class, regex the message must contain after the file name)
CASES: list[tuple[str, str, Callable[[Path], Path], type, str]] = [
    # config.json values
    ("hidden-0", "hf", _cfg(hidden_size=0), CE, r"hidden_size is 0; it must be between 1 and 65536"),
    ("hidden-str", "hf", _cfg(hidden_size="64"), CE, r"hidden_size is '64'; it must be a whole number"),
    ("hidden-float", "hf", _cfg(hidden_size=64.5), CE, r"hidden_size is 64\.5; it must be a whole number"),
    ("hidden-float-int", "hf", _cfg(hidden_size=64.0), CE, r"hidden_size is 64\.0; it must be a whole number"),
    ("hidden-not-heads-multiple", "hf", _cfg(hidden_size=66, head_dim=None), CE,
     r"hidden_size is 66; without head_dim it must be a multiple of num_attention_heads \(4\)"),
    ("hidden-vs-tensors", "hf", _cfg(hidden_size=32), CE, (r"tensor model\.embed_tokens\.weight has shape \[512, 64\], "
     r"expected \[512, 32\]")),
    ("kv-heads-0", "hf", _cfg(num_key_value_heads=0), CE, r"num_key_value_heads is 0; it must be between 1"),
    ("kv-heads-not-dividing", "hf", _cfg(num_key_value_heads=3), CE,
     r"num_key_value_heads is 3; it must divide num_attention_heads \(4\)"),
    ("attn-heads-0", "hf", _cfg(num_attention_heads=0), CE, r"num_attention_heads is 0"),
    ("layers-0", "hf", _cfg(num_hidden_layers=0), CE, r"num_hidden_layers is 0; it must be between 1 and 4096"),
    ("layers-neg", "hf", _cfg(num_hidden_layers=-1), CE, r"num_hidden_layers is -1; it must be between 1"),
    ("layers-1e6", "hf", _cfg(num_hidden_layers=1000000), CE, r"num_hidden_layers is 1000000; it must be between"),
    ("layers-vs-tensors", "hf", _cfg(num_hidden_layers=3), CE,
     r"num_hidden_layers is 3; the checkpoint holds no tensor of layer 2 \(model\.layers\.2\.\*; it holds 2 layers, "
     r"0-1\)"),
    ("layers-missing", "hf", _cfg(num_hidden_layers=None), CE, r"num_hidden_layers is missing"),
    ("config-list", "hf", _config_text("[1, 2]"), CE, r"config\.json: holds a JSON list, not an object"),
    ("config-string", "hf", _config_text('"llama"'), CE, r"config\.json: holds a JSON str, not an object"),
    ("config-garbage", "hf", _config_text("{nope"), CE, r"config\.json: cannot parse JSON"),
    ("max-pos-1e12", "hf", _cfg(max_position_embeddings=10**12), CE,
     r"max_position_embeddings is 1000000000000; it must be between 1 and 16777216"),
    ("eps-neg", "hf", _cfg(rms_norm_eps=-1), CE, r"rms_norm_eps is -1; it must be a number above 0"),
    ("eps-str", "hf", _cfg(rms_norm_eps="1e-5"), CE, r"rms_norm_eps is '1e-05'|rms_norm_eps is '1e-5'"),
    ("theta-0", "hf", _cfg(rope_parameters={"rope_theta": 0, "rope_type": "default"}), CE,
     r"rope_theta is 0; it must be a finite number above 1"),
    ("theta-0-legacy", "hf", _cfg(rope_parameters=None, rope_theta=0), CE, r"rope_theta is 0"),
    ("theta-neg", "hf", _cfg(rope_parameters=None, rope_theta=-10000.0), CE, r"rope_theta is -10000\.0"),
    ("theta-str", "hf", _cfg(rope_parameters=None, rope_theta="1e4"), CE, r"rope_theta is '1e4'; it must be a number"),
    ("act-bogus", "hf", _cfg(hidden_act="bogus"), UE, (r"hidden_act is 'bogus'; llmsys implements the gated MLP "
     r"with silu \(SwiGLU\) or gelu_pytorch_tanh \(GeGLU\) only")),
    ("act-gelu", "hf", _cfg(hidden_act="gelu"), UE, r"hidden_act is 'gelu'"),
    ("vocab-0", "hf", _cfg(vocab_size=0), CE, r"vocab_size is 0; it must be between 1"),
    ("vocab-neg", "hf", _cfg(vocab_size=-512), CE, r"vocab_size is -512"),
    ("head-dim-odd", "hf", _cfg(head_dim=15), CE, r"head_dim is 15; RoPE rotates pairs of dimensions"),
    ("head-dim-0", "hf", _cfg(head_dim=0), CE, r"head_dim is 0; it must be between 1"),
    ("intermediate-0", "hf", _cfg(intermediate_size=0), CE, r"intermediate_size is 0"),
    ("tie-str", "hf", _cfg(tie_word_embeddings="false"), CE, (r"tie_word_embeddings is 'false'; it must be true or "
     r"false")),
    ("rope-scaling-factor-0", "hf", _cfg(rope_scaling={"rope_type": "linear", "factor": 0}), CE,
     r"rope_scaling\.factor is 0; it must be a finite number above 0"),
    ("rope-scaling-list", "hf", _cfg(rope_scaling=[1]), CE, r"rope_scaling is \[1\]; it must be an object"),
    ("rope-scaling-yarn", "hf", _cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0}), UE, r"yarn"),
    ("bos-outside-vocab", "hf", _cfg(bos_token_id=9999), CE, (r"bos_token_id is 9999; it must be an id below "
     r"vocab_size \(512\)")),
    ("eos-str", "hf", _cfg(eos_token_id="</s>"), CE, r"eos_token_id is '</s>'; it must be a token id"),
    # safetensors headers
    ("st-header-list", "hf", _raw_header(lambda h: [1, 2]), CE, r"its header is a JSON list, not an object"),
    ("st-header-string", "hf", _raw_header(lambda h: "x"), CE, r"its header is a JSON str, not an object"),
    ("st-header-nested", "hf", _raw_header(raw=b"[" * 100_000 + b"]" * 100_000), CE, r"nested too deep"),
    ("st-offsets-str", "hf", _raw_header(_entry(UP + ".weight", data_offsets=["0", "24576"])), CE,
     r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has data_offsets \['0', '24576'\]"),
    ("st-offsets-neg", "hf", _raw_header(_entry(UP + ".weight", data_offsets=[-24576, 0])), CE,
     r"has data_offsets \[-24576, 0\]"),
    ("st-offsets-reversed", "hf", _raw_header(_entry(UP + ".weight", data_offsets=[24576, 0])), CE,
     r"start is after end"),
    ("st-offsets-overlap", "hf", _raw_header(_same_bytes("model.layers.0.mlp.gate_proj.weight", UP + ".weight")),
     CE, r"tensors 'model\.layers\.0\.mlp\.(gate|up)_proj\.weight' and .* overlap"),
    ("st-offsets-outside", "hf", _raw_header(_entry(UP + ".weight", data_offsets=[10**9, 10**9 + 24576])), CE,
     r"truncated: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' ends at byte"),
    ("st-shape-float", "hf", _raw_header(_entry("model.embed_tokens.weight", shape=[512.0, 64.5])), CE,
     r"has shape \[512\.0, 64\.5\]; a shape is a list of whole numbers"),
    ("st-shape-neg", "hf", _raw_header(_entry("model.embed_tokens.weight", shape=[-512, -64])), CE,
     r"has shape \[-512, -64\]"),
    ("st-shape-overflow", "hf", _raw_header(_entry("model.embed_tokens.weight", shape=[2**62, 2**62])), CE,
     r"size does not match its shape"),
    ("st-shape-span", "hf", _raw_header(_entry("model.embed_tokens.weight", shape=[512, 32])), CE,
     r"tensor 'model\.embed_tokens\.weight' size does not match its shape \(512, 32\): 16384 x 4 bytes"),
    ("st-dtype-unknown", "hf", _raw_header(_entry("model.norm.weight", dtype="Q9")), CE,
     r"tensor 'model\.norm\.weight' has dtype 'Q9'; known: F64"),
    ("st-entry-not-object", "hf", _raw_header(lambda h: dict(h, **{"model.norm.weight": 3})), CE,
     r"tensor 'model\.norm\.weight' is not an object"),
    ("st-metadata-list", "hf", _raw_header(lambda h: dict(h, __metadata__=[1])), CE, r"__metadata__ is a JSON list"),
    ("tensor-shape-vs-model", "hf", _set(UP + ".weight", lambda t: t[:, :32]), CE,
     rf"tensor {E}\.weight has shape \[96, 32\], expected \[96, 64\] from the config"),
    ("tensor-u8", "hf", _set("model.norm.weight", lambda t: t.to(torch.uint8)), CE,
     r"tensor model\.norm\.weight is stored as U8, expected a float type"),
    ("tensor-i32", "hf", _set(UP + ".weight", lambda t: t.to(torch.int32)), CE, (rf"tensor {E}\.weight is stored as "
     r"I32")),
    ("tensor-nan", "hf", _set("model.layers.1.self_attn.o_proj.weight", _poke(7, float("nan"))), CE,
     r"tensor model\.layers\.1\.self_attn\.o_proj\.weight holds 1 NaN or infinite values \(of 4096\)"),
    ("tensor-inf", "hf", _set("model.embed_tokens.weight", _poke(0, float("inf"))), CE,
     r"tensor model\.embed_tokens\.weight holds 1 NaN or infinite"),
    ("shard-index-list", "hf", _shard_index([ST]), CE, r"corrupt shard index \(weight_map is not an object"),
    ("shard-index-outside", "hf", _shard_index({"x": "../" + ST}), CE, (r"shard '\.\./model\.safetensors' is not a "
     r"file name")),
    # pre-quantized (llmsys int4 / int8)
    ("q-float-qweight", "int4:g64", _set(UP + ".qweight", lambda t: t.float()), CE,
     rf"tensor {E}\.qweight is torch\.float32, expected torch\.uint8 codes"),
    ("q-bits-8", "int4:g64", _qcfg(bits=8), CE, r"quantization_config\.bits is 8 but format 'int4:g64' stores 4-bit"),
    ("q-bits-str", "int4:g64", _qcfg(bits="four"), CE, r"quantization_config\.bits is 'four'; it must be an integer"),
    ("q-group-0", "int4:g64", _qcfg(format="int4:g0"), CE, (r"quantization_config\.format 'int4:g0' is not a llmsys "
     r"format")),
    ("q-group-other", "int4:g64", _qcfg(format="int4:g128"), CE, (r"written as 'int4:g64' but .*config\.json says "
     r"quantization_config format 'int4:g128'")),
    ("q-format-garbage", "int4:g64", _qcfg(format=42), CE, r"quantization_config\.format is 42"),
    ("q-format-none", "int4:g64", _qcfg(format="none"), CE, r"quantization_config\.format is 'none'"),
    ("q-format-contradicts-file", "int8", _qcfg(format="int4:g64"), CE, r"written as 'int8' but"),
    ("q-nan-scales", "int4:g64", _set(UP + ".scales", _poke(3, float("nan"))), CE,
     rf"tensor {E}\.scales holds 1 NaN or infinite"),
    ("q-zero-scales", "int8", _set(UP + ".scales", _poke(0, 0.0)), CE, rf"tensor {E}\.scales holds 1 zero scales"),
    ("q-nan-norm", "int8", _set("model.norm.weight", _poke(0, float("nan"))), CE,
     r"tensor model\.norm\.weight holds 1 NaN"),
    ("awq-group-str", "hf", _cfg(quantization_config={"quant_method": "awq", "bits": 4, "group_size": "128"}), CE,
     r"quantization_config\.group_size is '128'; it must be an integer"),
    ("awq-over-float-tensors", "hf", _cfg(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128}),
     CE, r"quantization_config says awq but the checkpoint holds no quantized tensors"),
    ("awq-bits-8", "hf", _cfg(quantization_config={"quant_method": "awq", "bits": 8, "group_size": 32}), CE,
     r"awq with bits=8 is not supported"),
    # GGUF
    ("gguf-hidden-str", "gguf", _gguf_rewrite({"llama.embedding_length": ("64", _ggml("STRING"))}), CE,
     r"hidden_size \(llama\.embedding_length\) is '64'; it must be a whole number"),
    ("gguf-hidden-float", "gguf", _gguf_rewrite({"llama.embedding_length": (64.5, _ggml("FLOAT32"))}), CE,
     r"hidden_size \(llama\.embedding_length\) is 64\.5"),
    ("gguf-heads-0", "gguf", _gguf_rewrite({"llama.attention.head_count": (0, _ggml("UINT32"))}), CE,
     r"num_attention_heads \(llama\.attention\.head_count\) is 0"),
    ("gguf-layers-vs-tensors", "gguf", _gguf_rewrite({"llama.block_count": (3, _ggml("UINT32"))}), CE,
     r"num_hidden_layers \(llama\.block_count\) is 3; the checkpoint holds no tensor of layer 2 \(blk\.2\.\*; "
     r"it holds 2 layers, 0-1\)"),
    ("gguf-context-1e12", "gguf", _gguf_rewrite({"llama.context_length": (10**12, _ggml("UINT64"))}), CE,
     r"max_position_embeddings \(llama\.context_length\) is 1000000000000"),
    ("gguf-theta-0", "gguf", _gguf_rewrite({"llama.rope.freq_base": (0.0, _ggml("FLOAT32"))}), CE,
     r"rope_theta \(llama\.rope\.freq_base\) is 0\.0"),
    ("gguf-eps-neg", "gguf", _gguf_rewrite({"llama.attention.layer_norm_rms_epsilon": (-1.0, _ggml("FLOAT32"))}), CE,
     r"rms_norm_eps \(llama\.attention\.layer_norm_rms_epsilon\) is -1\.0"),
    ("gguf-alignment", "gguf", _gguf_rewrite({"general.alignment": (3, _ggml("UINT32"))}), CE,
     r"general\.alignment is 3; it must be a power of two"),
    ("gguf-tensor-shape", "gguf", _gguf_rewrite(tensors=lambda n, a: a[:, :32] if n == "blk.0.ffn_up.weight" else a),
     CE, rf"tensor blk\.0\.ffn_up\.weight \({E}\.weight\) has shape \[96, 32\], expected \[96, 64\]"),
    ("gguf-nan", "gguf", _gguf_rewrite(tensors=lambda n, a: np.where(np.arange(a.size).reshape(a.shape) == 5, np.nan, a)
                                       .astype(a.dtype) if n == "blk.0.ffn_up.weight" else a),
     CE, rf"tensor {E}\.weight holds 1 NaN"),
    ("gguf-count-kv", "gguf", _gguf_raw(n_kv=2**60), CE, r"the header claims 1152921504606846976 metadata keys"),
    ("gguf-count-tensors", "gguf", _gguf_raw(n_tensors=2**40), CE, r"the header claims 1099511627776 tensors"),
    ("gguf-array-count", "gguf", _gguf_raw(1, _kv("a", 9, struct.pack("<IQ", 8, 2**50))), CE, (r"the header claims "
     r"1125899906842624 array elements")),
    ("gguf-nested", "gguf", _gguf_raw(1, _kv("a", 9, _nested_arrays(100_000))), CE,
     r"metadata arrays nested deeper than 4 levels"),
    ("gguf-dims", "gguf", _gguf_raw(tensors=[("x", [1] * 9, 0, 0)]), CE, (r"tensor x has 9 dimensions; GGUF tensors "
     r"have 1 to 4")),
    ("gguf-dim-0", "gguf", _gguf_raw(tensors=[("x", [0, 4], 0, 0)]), CE, r"tensor x has dimensions \[0, 4\]"),
    ("gguf-blocks", "gguf", _gguf_raw(tensors=[("x", [16], 8, 0)]), CE, (r"the first a multiple of the type's block "
     r"of 32")),
    ("gguf-misaligned", "gguf", _gguf_raw(tensors=[("x", [4], 0, 4)]), CE, (r"tensor x starts at byte \d+, not a "
     r"multiple of the alignment 32")),
    ("gguf-outside", "gguf", _gguf_raw(tensors=[("x", [4096], 0, 0)]), CE, (r"tensor x ends at byte \d+ but the "
     r"file has")),
    ("gguf-overlap", "gguf", _gguf_raw(tensors=[("x", [16], 0, 0), ("y", [16], 0, 32)]), CE,
     r"tensors x and y overlap"),
    # llama2.c
    ("c-kv-not-dividing", "c", _c_header(kv=3), CE, r"num_key_value_heads \(n_kv_heads\) is 3; it must divide"),
    ("c-head-dim-odd", "c", _c_header(dim=6), CE, r"head_dim is 3; RoPE rotates pairs"),
    ("c-vocab-0", "c", _c_header(vocab=0), CE, r"vocab_size is 0"),
    ("c-seq-huge", "c", _c_header(seq=2**30), CE, r"max_position_embeddings \(max_seq_len\) is 1073741824"),
    ("c-layers-huge", "c", _c_header(layers=4000), CE, r"truncated: expected \d+ bytes"),
    ("c-nan", "c", _c_poke(40, float("nan")), CE, r"tensor model\.embed_tokens\.weight holds 1 NaN"),
]


def _copy(bases: dict[str, Path], kind: str, tmp_path: Path) -> Path:
    src = bases[kind]
    if src.is_dir():
        return Path(shutil.copytree(src, tmp_path / src.name))
    (tmp_path / src.parent.name).mkdir()
    return Path(shutil.copy(src, tmp_path / src.parent.name / src.name))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_checkpoint_is_one_line_naming_the_file(bases, tmp_path, case):
    _, kind, patch, exc, needle = case
    path = patch(_copy(bases, kind, tmp_path))
    with pytest.raises(exc) as e:
        load_model(path, dtype="float32", device="cpu", progress=False)
    msg = str(e.value)
    assert type(e.value) is exc, msg
    assert "\n" not in msg, msg
    assert msg.startswith(str(path)), msg  # names the file (or the folder's file: .../config.json, .../model...)
    assert re.search(needle, msg), msg


def test_the_good_bases_load(bases):
    """Each base loads as it is: every failure above is the patch's."""
    for path in bases.values():
        load_model(path, dtype="float32", device="cpu", progress=False)


def test_the_finiteness_check_can_be_skipped(bases, tmp_path):
    path = _set("model.layers.1.self_attn.o_proj.weight", _poke(7, float("nan")))(_copy(bases, "hf", tmp_path))
    m = load_model(path, dtype="float32", device="cpu", progress=False, check_finite=False)
    assert m.model.model.layers[1].self_attn.o_proj.weight.isnan().sum() == 1


def test_the_finiteness_check_tolerates_sums_that_overflow():
    from llmsys.engine.loader.validate import check_finite

    check_finite("x", torch.full((4,), 60000.0, dtype=torch.float16), "f")  # finite values, an inf sum
    check_finite("x", torch.full((4,), 3e38), "f")
    check_finite("x", torch.randn(8).to(torch.float8_e4m3fn), "f")


CLI_CASES = ["hidden-0", "st-header-nested", "tensor-nan", "layers-1e6", "gguf-alignment", "q-float-qweight"]


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_run_prints_one_error_line_and_exits_2(bases, tmp_path, capsys, name):
    from llmsys.engine.cli.main import main

    _, kind, patch, _, needle = next(c for c in CASES if c[0] == name)
    path = patch(_copy(bases, kind, tmp_path))
    rc = main(["run", str(path), "hello", "--device", "cpu", "--dtype", "float32", "--no-pull", "--max-tokens", "1"])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "Traceback" not in out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}"), err
    assert re.search(needle, lines[0]), err
