"""Model files whose header lies about their tensors (issue #48): each is refused at load with one line naming the
file, the tensor and the numbers, before any weight is read, as llama.cpp refuses them.

What a fuzzing run found loaded: a GGUF whose ``block_count`` was one short of the layers it holds (the last layer
silently skipped), a ``config.json`` one layer short of its safetensors checkpoint (the same), and an F32 tensor
whose GGUF type field said F16 (read as half its bytes: noise, '--------' as output). Each case below is a copy of
a tiny model (an HF folder and its F32 / F16 GGUF exports) patched in one way -- a header byte or value, a tensor
dropped or added -- together with its kin (a truncated tensor, an offset past the file's end or off the alignment,
a size that disagrees with a tensor's shape).
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SHARED, need_shared
from llmsys.engine.loader import load_model
from llmsys.engine.loader.safetensors_io import SafetensorsFile, save_file
from llmsys.kernels.common.errors import CheckpointError
from tiny_models import make_hf_model

gguf = pytest.importorskip("gguf", reason="the GGUF cases need the gguf package (a dependency of llmsys)")

from llmsys.engine.bench.gguf_export import export_float  # noqa: E402
from llmsys.engine.loader.gguf_header import read_header  # noqa: E402

ST = "model.safetensors"
SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
F32, F16 = 0, 1  # ggml type numbers


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """The good files every case copies: a 2-layer llama HF folder, its F32 GGUF and its F16 GGUF (matrices F16,
    norms F32)."""
    root = tmp_path_factory.mktemp("lying")
    hf = make_hf_model("llama", root / "hf")
    for kind in ("f32", "f16"):
        (root / kind).mkdir()
    return {"hf": hf, "f32": export_float(hf, root / "f32" / "m.gguf", "f32"),
            "f16": export_float(hf, root / "f16" / "m.gguf", "f16")}


# ------------------------------------------------------------------ GGUF patches


def _entry_at(data: bytes, name: str) -> int:
    """Where tensor ``name``'s ggml type field is in the tensor table (its relative offset follows, a u64)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    assert data.count(key) == 1, name
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    return at + 4 + 8 * n_dims


def _patch(fn: Callable[[bytearray], None]) -> Callable[[Path], Path]:
    def patch(path: Path) -> Path:
        data = bytearray(path.read_bytes())
        fn(data)
        path.write_bytes(bytes(data))
        return path
    return patch


def _retype(name: str | Callable[[Path], str], qtype: int) -> Callable[[Path], Path]:
    """Tensor ``name``'s type field set to ``qtype``, nothing else changed (the relabel the issue found)."""
    def patch(path: Path) -> Path:
        n = name(path) if callable(name) else name
        return _patch(lambda d: struct.pack_into("<I", d, _entry_at(d, n), qtype))(path)
    return patch


def _move(name: str, by: int | None = None, to: int | None = None) -> Callable[[Path], Path]:
    """Tensor ``name``'s relative data offset moved ``by`` bytes or set ``to`` a value."""
    def fn(d: bytearray) -> None:
        at = _entry_at(d, name) + 4
        (off,) = struct.unpack_from("<Q", d, at)
        struct.pack_into("<Q", d, at, off + by if to is None else to)
    return _patch(fn)


def _swap_offsets(a: str, b: str) -> Callable[[Path], Path]:
    """Two same-sized tensors' offsets exchanged: each reads the other's bytes."""
    def fn(d: bytearray) -> None:
        pa, pb = _entry_at(d, a) + 4, _entry_at(d, b) + 4
        oa, ob = struct.unpack_from("<Q", d, pa)[0], struct.unpack_from("<Q", d, pb)[0]
        struct.pack_into("<Q", d, pa, ob)
        struct.pack_into("<Q", d, pb, oa)
    return _patch(fn)


def _set_u32(key: str, value: int) -> Callable[[Path], Path]:
    """Metadata key ``key`` (a UINT32 value) set to ``value`` in place."""
    def fn(d: bytearray) -> None:
        raw = struct.pack("<Q", len(key)) + key.encode()
        assert d.count(raw) == 1, key
        at = d.index(raw) + len(raw)
        assert struct.unpack_from("<I", d, at)[0] == gguf.GGUFValueType.UINT32, key
        struct.pack_into("<I", d, at + 4, value)
    return _patch(fn)


def _cut(n: int) -> Callable[[Path], Path]:
    def patch(path: Path) -> Path:
        path.write_bytes(path.read_bytes()[:-n])
        return path
    return patch


def _last(path: Path) -> str:
    return read_header(path).tensors[-1].name


def _rewrite(drop: tuple[str, ...] = (), tokens: Callable[[list[str]], list[str]] | None = None,
             ) -> Callable[[Path], Path]:
    """The GGUF written again by the ``gguf`` package (a consistent file) without the tensors ``drop``, and with
    its token list passed through ``tokens``."""
    def patch(src: Path) -> Path:
        r = gguf.GGUFReader(str(src))
        out = src.with_name("rewritten.gguf")
        w = gguf.GGUFWriter(str(out), "llama")
        for key, f in r.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value, vt = f.contents(), f.types[0]
            if key == "tokenizer.ggml.tokens" and tokens is not None:
                value = tokens(value)
            if vt == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, value, vt, sub_type=f.types[-1])
            else:
                w.add_key_value(key, value, vt)
        for t in r.tensors:
            if t.name not in drop:
                w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out
    return patch


# ------------------------------------------------------------------ safetensors / config patches


def _cfg(**kw) -> Callable[[Path], Path]:
    def patch(d: Path) -> Path:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(kw)
        (d / "config.json").write_text(json.dumps(cfg))
        return d
    return patch


def _state(fn: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], Path]:
    """Every tensor read, ``fn`` applied to the dict, the file written again (a consistent header)."""
    def patch(d: Path) -> Path:
        f = SafetensorsFile(d / ST)
        state = {n: f.read(n) for n in f.tensors}
        fn(state)
        save_file(state, d / ST, metadata=f.metadata or None)
        return d
    return patch


def _extra_layer(state: dict[str, torch.Tensor]) -> None:
    """Layer 2, a copy of layer 1, added to a 2-layer checkpoint."""
    for n in [n for n in state if n.startswith("model.layers.1.")]:
        state[n.replace("model.layers.1.", "model.layers.2.")] = state[n].clone()


def _st_header(fn: Callable[[dict], None], tail: bytes = b"") -> Callable[[Path], Path]:
    """The safetensors header edited by ``fn`` (the data bytes kept, ``tail`` appended)."""
    def patch(d: Path) -> Path:
        data = (d / ST).read_bytes()
        (hlen,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + hlen])
        fn(header)
        new = json.dumps(header).encode()
        (d / ST).write_bytes(struct.pack("<Q", len(new)) + new + data[8 + hlen :] + tail)
        return d
    return patch


def _in_folder(patch: Callable[[Path], Path]) -> Callable[[Path], Path]:
    """A file patch applied to the folder's safetensors file."""
    def fn(d: Path) -> Path:
        patch(d / ST)
        return d
    return fn


def _relabel_f16(name: str, fit: bool) -> Callable[[dict], None]:
    """Tensor ``name``'s dtype F32 -> F16; ``fit``: its end offset moved in to the F16 size (the header then
    agrees with itself, and half of the tensor's bytes belong to no tensor)."""
    def fn(h: dict) -> None:
        e = h[name]
        e["dtype"] = "F16"
        if fit:
            start, end = e["data_offsets"]
            e["data_offsets"] = [start, start + (end - start) // 2]
    return fn


def _last_in_data(d: Path) -> str:
    f = SafetensorsFile(d / ST)
    return max(f.tensors.values(), key=lambda t: t.offset).name


def _first_in_data(d: Path) -> str:
    f = SafetensorsFile(d / ST)
    return min(f.tensors.values(), key=lambda t: t.offset).name


def _relabel_st(which: Callable[[Path], str], fit: bool) -> Callable[[Path], Path]:
    def patch(d: Path) -> Path:
        return _st_header(_relabel_f16(which(d), fit))(d)
    return patch


# ------------------------------------------------------------------ the cases

# (id, base, patch, regex the one-line message must match after the file name)
CASES: list[tuple[str, str, Callable[[Path], Path], str]] = [
    # A GGUF's layer count against its tensors (the issue: block_count 29 over 30 layers' tensors)
    ("gguf-block-count-short", "f32", _set_u32("llama.block_count", 1),
     r"num_hidden_layers \(llama\.block_count\) is 1; the checkpoint holds tensor blk\.1\.\w+\.weight of layer 1 "
     r"\(2 layers, 0-1\), past the last layer 0"),
    ("gguf-block-count-long", "f32", _set_u32("llama.block_count", 3),
     r"llama\.block_count\) is 3; the checkpoint holds no tensor of layer 2 \(blk\.2\.\*; it holds 2 layers, 0-1\)"),
    ("gguf-layer-lacks-a-tensor", "f32", _rewrite(drop=("blk.1.ffn_up.weight",)),
     r"missing tensor blk\.1\.ffn_up\.weight \(model\.layers\.1\.mlp\.up_proj\.weight\), which llama with 2 layers "
     r"needs"),
    ("gguf-no-embedding", "f32", _rewrite(drop=("token_embd.weight",)),
     r"missing tensor token_embd\.weight \(model\.embed_tokens\.weight\)"),
    # A tensor's type against its bytes (the issue: an F32 tensor relabelled F16)
    ("gguf-relabel-norm", "f32", _retype("blk.0.attn_norm.weight", F16),
     r"tensor \S+ starts at byte \d+, but the one before it in the table, blk\.0\.attn_norm\.weight \(F16 \[64\], "
     r"128 bytes\), ends at byte \d+, so it should start at byte \d+ \(alignment 32\)"),
    ("gguf-relabel-embedding", "f32", _retype("token_embd.weight", F16),
     r"the one before it in the table, token_embd\.weight \(F16 \[64, 512\], 65536 bytes\)"),
    ("gguf-relabel-last", "f32", _retype(_last, F16),
     r"the file has 128 bytes after its last tensor, output_norm\.weight \(F16 \[64\], 128 bytes\), which ends at "
     r"byte \d+ \(at most 0 of padding"),
    ("gguf-relabel-q8", "f32", _retype("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.Q8_0),
     r"the one before it in the table, blk\.0\.ffn_up\.weight \(Q8_0 \[64, 96\], 6528 bytes\)"),
    ("gguf-relabel-f16-as-f32", "f16", _retype("blk.0.ffn_up.weight", F32),
     r"tensors blk\.0\.ffn_up\.weight and \S+ overlap"),
    # offsets and sizes
    ("gguf-truncated", "f32", _cut(100), r"tensor \S+ ends at byte \d+ but the file has \d+"),
    ("gguf-offset-past-eof", "f32", _move("blk.0.attn_norm.weight", to=1 << 30),
     r"tensor blk\.0\.attn_norm\.weight ends at byte \d+ but the file has \d+"),
    ("gguf-offset-misaligned", "f32", _move("blk.0.attn_norm.weight", by=4),
     r"tensor blk\.0\.attn_norm\.weight starts at byte \d+, not a multiple of the alignment 32"),
    ("gguf-offsets-swapped", "f32", _swap_offsets("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"),
     r"tensor blk\.0\.(attn|ffn)_norm\.weight starts at byte \d+, but .* should start at byte \d+"),
    # header values against the tensors that embody them
    ("gguf-embedding-length", "f32", _set_u32("llama.embedding_length", 128),
     r"llama\.embedding_length is 128 but tensor token_embd\.weight has shape \[64, 512\] \(ggml order\), 64 wide"),
    ("gguf-vocab-size", "f32", _set_u32("llama.vocab_size", 500),
     r"llama\.vocab_size is 500 but tensor token_embd\.weight has shape \[64, 512\] \(ggml order\), 512 rows"),
    ("gguf-token-list", "f32", _rewrite(tokens=lambda t: [*t, "<extra>"]),
     r"the token count of tokenizer\.ggml\.tokens is 513 but tensor token_embd\.weight has shape \[64, 512\] "
     r"\(ggml order\), 512 rows, one per token"),
    ("gguf-head-count", "f32", _set_u32("llama.attention.head_count", 8),
     r"llama\.attention\.head_count \(8\) x llama\.attention\.key_length \(16\) is 128 but tensor "
     r"blk\.0\.attn_q\.weight has shape \[64, 64\] \(ggml order\), 64 rows"),
    ("gguf-head-count-kv", "f32", _set_u32("llama.attention.head_count_kv", 4),
     r"llama\.attention\.head_count_kv \(4\) x llama\.attention\.key_length \(16\) is 64 but tensor "
     r"blk\.0\.attn_k\.weight has shape \[64, 32\]"),
    ("gguf-ffn-length", "f32", _set_u32("llama.feed_forward_length", 128),
     r"tensor blk\.0\.ffn_gate\.weight \(model\.layers\.0\.mlp\.gate_proj\.weight\) has shape \[96, 64\], "
     r"expected \[128, 64\]"),
    # config.json's layer count against the safetensors checkpoint (the issue: 4 layers over 5)
    ("hf-config-short", "hf", _cfg(num_hidden_layers=1),
     r"config\.json: num_hidden_layers is 1; the checkpoint holds tensor model\.layers\.1\.\S+ of layer 1 "
     r"\(2 layers, 0-1\), past the last layer 0"),
    ("hf-extra-layer", "hf", _state(_extra_layer),
     r"config\.json: num_hidden_layers is 2; the checkpoint holds tensor model\.layers\.2\.\S+ of layer 2 "
     r"\(3 layers, 0-2\), past the last layer 1"),
    ("hf-layer-gap", "hf", _state(lambda s: [s.__setitem__(n.replace(".1.", ".2."), s.pop(n))
                                             for n in list(s) if n.startswith("model.layers.1.")]),
     r"num_hidden_layers is 2; the checkpoint holds no tensor of layer 1 \(model\.layers\.1\.\*; it holds 2 layers: "
     r"0, 2\)"),
    ("hf-layer-lacks-a-tensor", "hf", _state(lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
     r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight; the checkpoint does not match its config"),
    ("hf-vocab", "hf", _cfg(vocab_size=500),
     r"tensor model\.embed_tokens\.weight has shape \[512, 64\], expected \[500, 64\] from the config"),
    ("hf-hidden", "hf", _cfg(hidden_size=128, head_dim=16),
     r"tensor model\.embed_tokens\.weight has shape \[512, 64\], expected \[512, 128\] from the config"),
    # each safetensors tensor's bytes against its dtype and shape
    ("st-relabel", "hf", _relabel_st(_first_in_data, fit=False),
     r"size does not match its shape \(\d+(, \d+)*\): \d+ x 2 bytes of F16 but data_offsets span \d+"),
    ("st-relabel-fitted", "hf", _relabel_st(_first_in_data, fit=True),
     r"corrupt safetensors header: tensor '\S+' starts at byte \d+, \d+ bytes after the end of tensor '\S+' "
     r"\(byte \d+\); those bytes belong to no tensor"),
    ("st-relabel-fitted-last", "hf", _relabel_st(_last_in_data, fit=True),
     r"corrupt safetensors header: the file has \d+ bytes after its last tensor '\S+' \(which ends at byte \d+\)"),
    ("st-trailing-bytes", "hf", _st_header(lambda h: None, tail=bytes(64)),
     r"the file has 64 bytes after its last tensor"),
    ("st-truncated", "hf", _in_folder(_cut(100)), r"truncated: tensor '\S+' ends at byte \d+ but the file has \d+ "
     r"bytes"),
]


def _copy(bases: dict[str, Path], kind: str, tmp_path: Path) -> Path:
    src = bases[kind]
    if src.is_dir():
        return Path(shutil.copytree(src, tmp_path / src.name))
    (tmp_path / kind).mkdir(parents=True)
    return Path(shutil.copy(src, tmp_path / kind / src.name))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_lying_file_is_refused_in_one_line(bases, tmp_path, case, monkeypatch):
    name, kind, patch, needle = case
    path = patch(_copy(bases, kind, tmp_path))
    read: list[str] = []  # no tensor's bytes are read before the refusal: the checks read headers only
    from llmsys.engine.loader import gguf_io, safetensors_io

    real_bytes, real_info = gguf_io.read_bytes, safetensors_io.SafetensorsFile.read_info
    monkeypatch.setattr(gguf_io, "read_bytes", lambda path, t, *a: read.append(t.name) or real_bytes(path, t, *a))
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "read_info",
                        lambda self, info, out=None: read.append(info.name) or real_info(self, info, out))
    with pytest.raises(CheckpointError) as e:
        load_model(path, dtype="float32", device="cpu", progress=False)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(str(path)), msg
    assert re.search(needle, msg), msg
    assert read == [], (read, msg)


@pytest.mark.parametrize("name", ["st-relabel", "st-relabel-fitted", "st-relabel-fitted-last", "st-trailing-bytes"])
def test_the_safetensors_library_refuses_them_too(bases, tmp_path, name):
    """The safetensors rules are the library's own: each file refused above is refused by ``safetensors`` too (and
    the good one loads there)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    _, kind, patch, _ = next(c for c in CASES if c[0] == name)
    load_file(_copy(bases, kind, tmp_path / "good") / ST)
    with pytest.raises(SafetensorError):
        load_file(patch(_copy(bases, kind, tmp_path)) / ST)


# The GGUF cases llama.cpp loads: it reads no ``vocab_size`` key (its vocabulary is the token list, which here
# still matches the table; llmsys sizes the model by the key, so a key that lies is refused), and it checks
# nothing after the last tensor (llmsys does: the relabelled last tensor would be read as half its bytes).
LLAMA_CPP_LOADS = {"gguf-vocab-size", "gguf-relabel-last"}


@pytest.mark.parametrize("name", [c[0] for c in CASES if c[1] != "hf" and c[0] not in LLAMA_CPP_LOADS])
def test_llama_cpp_refuses_them_too(bases, tmp_path, name):
    """Each GGUF refused above is refused by llama.cpp (through llama-cpp-python, where installed), and the good
    file loads there: the rules are llama.cpp's, not stricter ones that would refuse files it runs."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the comparison needs llama-cpp-python")

    def load(path: Path) -> None:
        llama_cpp.Llama(str(path), n_ctx=32, n_threads=1, verbose=False)

    _, kind, patch, _ = next(c for c in CASES if c[0] == name)
    load(_copy(bases, kind, tmp_path / "good"))
    with pytest.raises(ValueError, match="Failed to load model"):
        load(patch(_copy(bases, kind, tmp_path)))


def test_the_good_bases_load(bases):
    """Every failure above is its patch's: the unpatched files load, all their layers."""
    for path in bases.values():
        m = load_model(path, dtype="float32", device="cpu", progress=False)
        assert m.family == "llama" and len(m.model.model.layers) == 2


@pytest.mark.parametrize("name", ["gguf-block-count-short", "gguf-relabel-norm", "hf-config-short", "hf-extra-layer"])
def test_cli_prints_one_error_line_and_exits_2(bases, tmp_path, capsys, name):
    from llmsys.engine.cli.main import main

    _, kind, patch, needle = next(c for c in CASES if c[0] == name)
    path = patch(_copy(bases, kind, tmp_path))
    rc = main(["run", str(path), "hello", "--device", "cpu", "--dtype", "float32", "--no-pull", "--max-tokens", "1"])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "Traceback" not in out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}"), err
    assert re.search(needle, lines[0]), err


def test_the_real_smollm2_q4_1_file_passes_every_check():
    """A file made by llama.cpp's converter and quantizer (Q4_1, 30 layers, 49152 tokens) is not refused, and the
    header checks cost little beside the header parse itself."""
    from llmsys.engine.loader import gguf_io
    from llmsys.engine.loader.common import open_checkpoint
    from llmsys.engine.loader.gguf_header import _check_layout, check_end

    need_shared(SMOLLM2)
    t0 = time.perf_counter()
    h = read_header(SMOLLM2)
    parse = time.perf_counter() - t0
    ck = open_checkpoint(SMOLLM2, torch.float32, torch.device("cpu"))
    assert ck.model.args.num_hidden_layers == 30 and ck.model.args.vocab_size == 49152
    t0 = time.perf_counter()
    for _ in range(10):
        _check_layout(SMOLLM2, list(h.tensors), h.tensors[0].offset, h.alignment)
        check_end(h)
        gguf_io._check_sizes(SMOLLM2, "llama", h.fields, ck.config, h.tensors)
    checks = (time.perf_counter() - t0) / 10
    assert checks < max(0.05, parse), (checks, parse)
