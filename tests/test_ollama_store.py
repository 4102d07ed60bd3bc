"""`ollama:NAME[:TAG]` models: Ollama's store read in place (engine/ollama_store.py).

Each test builds a real store in tmp_path the way Ollama lays it out:
``manifests/<host>/<namespace>/<model>/<tag>`` JSON manifests whose layers
name ``blobs/sha256-<hex>`` files by their true sha256 and size, with
$OLLAMA_MODELS pointing at it. The weights blob is a genuine GGUF written by
``gguf.GGUFWriter`` (or, for the end-to-end run, the stories260k export).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from conftest import STORIES_HF, need_shared
from llmsys.engine.catalog import resolve_model
from llmsys.engine.cli.models_cmd import models_command
from llmsys.engine.ollama_store import OllamaName, list_models, parse_name, require_chat_template, resolve, run_settings, store_dir
from llmsys.kernels.common.errors import CheckpointError, InvalidParameterError, LLMSysError, ModelNotFoundError

MEDIA = "application/vnd.ollama.image."
TEMPLATE = "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}<|im_start|>user\n{{ .Prompt }}"
PARAMS = {"stop": ["<|im_start|>", "<|im_end|>"], "temperature": 0.7, "num_ctx": 4096}
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def tiny_gguf(path: Path) -> bytes:
    """A small, valid GGUF file (one tensor, a few keys); returns its bytes."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def put_blob(store: Path, data: bytes) -> dict:
    """Store ``data`` as a content-addressed blob; return its manifest layer (sans mediaType)."""
    hexdigest = hashlib.sha256(data).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    (store / "blobs" / f"sha256-{hexdigest}").write_bytes(data)
    return {"digest": f"sha256:{hexdigest}", "size": len(data)}


def add_model(
    store: Path,
    name: str,
    weights: bytes | None = b"GGUF" + bytes(60),
    *,
    params: dict | None = None,
    template: str | None = None,
    system: str | None = None,
    extra: tuple[str, ...] = ("license",),
) -> Path:
    """Write an Ollama manifest for ``name`` (parsed as Ollama does) and its blobs; return the manifest."""
    parsed = parse_name(name)
    config = put_blob(store, json.dumps({"model_format": "gguf"}).encode())
    layers = []
    if weights is not None:
        layers.append({"mediaType": MEDIA + "model", **put_blob(store, weights)})
    for kind, text in (("template", template), ("system", system)):
        if text is not None:
            layers.append({"mediaType": MEDIA + kind, **put_blob(store, text.encode())})
    if params is not None:
        layers.append({"mediaType": MEDIA + "params", **put_blob(store, json.dumps(params).encode())})
    for kind in extra:
        layers.append({"mediaType": MEDIA + kind, **put_blob(store, f"{kind} text".encode())})
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
        "layers": layers,
    }
    path = parsed.manifest_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "ollama-models"
    (root / "manifests").mkdir(parents=True)
    (root / "blobs").mkdir()
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path / "home"))
    return root


def model_blob(store: Path, manifest: Path) -> Path:
    layer = next(x for x in json.loads(manifest.read_text())["layers"] if x["mediaType"] == MEDIA + "model")
    return store / "blobs" / layer["digest"].replace(":", "-")


# --------------------------------------------------------------------------
# Names and the store directory
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, parts, short",
    [
        ("ollama:qwen2.5", ("registry.ollama.ai", "library", "qwen2.5", "latest"), "qwen2.5"),
        ("ollama:qwen2.5:0.5b", ("registry.ollama.ai", "library", "qwen2.5", "0.5b"), "qwen2.5"),
        ("qwen2.5:0.5b", ("registry.ollama.ai", "library", "qwen2.5", "0.5b"), "qwen2.5"),
        ("ollama:me/my-model:v1", ("registry.ollama.ai", "me", "my-model", "v1"), "me/my-model"),
        ("ollama:hf.co/bartowski/Llama-3.2-1B-GGUF:Q4_K_M",
         ("hf.co", "bartowski", "Llama-3.2-1B-GGUF", "Q4_K_M"), "hf.co/bartowski/Llama-3.2-1B-GGUF"),
        ("ollama:localhost:5000/me/m:v1", ("localhost:5000", "me", "m", "v1"), "localhost:5000/me/m"),
    ],
)
def test_parse_name(text, parts, short):
    name = parse_name(text)
    assert name == OllamaName(*parts)
    assert name.short == short and name.spec == f"ollama:{short}:{parts[3]}"


@pytest.mark.parametrize("text", ["ollama:", "ollama:qwen:", "ollama:../x", "ollama:a/b/c/d", "ollama:a b", "ollama:/x"])
def test_bad_names_are_rejected(text):
    with pytest.raises(InvalidParameterError, match="is not an Ollama model name") as info:
        parse_name(text)
    assert text in str(info.value) and "\n" not in str(info.value)


def test_store_dir_env_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "elsewhere"))
    assert store_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("OLLAMA_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert store_dir() == tmp_path / ".ollama" / "models"


# --------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------


def test_resolve_reads_blob_params_template_system(store, tmp_path):
    weights = tiny_gguf(tmp_path / "w.gguf")
    manifest = add_model(store, "qwen2.5:0.5b", weights, params=PARAMS, template=TEMPLATE, system="Be brief.")
    m = resolve("ollama:qwen2.5:0.5b")
    assert (m.name, m.tag, m.manifest, m.size) == ("qwen2.5", "0.5b", manifest, len(weights))
    assert m.blob == model_blob(store, manifest) and m.blob.read_bytes() == weights
    assert m.digest == "sha256:" + hashlib.sha256(weights).hexdigest()
    assert dict(m.params) == PARAMS and m.template == TEMPLATE and m.system == "Be brief."
    assert m.spec == "ollama:qwen2.5:0.5b"
    with pytest.raises(TypeError):
        m.params["temperature"] = 0.0  # read-only: a frozen model's params cannot drift

    import gguf  # the blob is the GGUF file itself, readable as one

    reader = gguf.GGUFReader(str(m.blob))
    assert [t.name for t in reader.tensors] == ["token_embd.weight"]


def test_resolve_defaults_namespaces_and_case(store):
    add_model(store, "llama3.2")  # tag latest
    add_model(store, "me/custom:v2", template="{{ .Prompt }}")
    add_model(store, "hf.co/bartowski/Tiny-GGUF:Q8_0")
    assert resolve("ollama:llama3.2").tag == "latest"
    assert resolve("llama3.2:latest").name == "llama3.2"
    custom = resolve("ollama:me/custom:v2")
    assert custom.name == "me/custom" and custom.params is None and custom.system is None
    assert resolve("ollama:hf.co/bartowski/Tiny-GGUF:Q8_0").name == "hf.co/bartowski/Tiny-GGUF"
    # Ollama names are case-insensitive; the file system may not be.
    assert resolve("ollama:HF.co/Bartowski/tiny-gguf:q8_0").manifest == resolve("ollama:hf.co/bartowski/Tiny-GGUF:Q8_0").manifest


def test_list_models(store):
    add_model(store, "qwen2.5:0.5b", params=PARAMS)
    add_model(store, "llama3.2:1b")
    add_model(store, "me/custom:v2")
    assert [m.spec for m in list_models()] == ["ollama:llama3.2:1b", "ollama:me/custom:v2", "ollama:qwen2.5:0.5b"]


def test_list_models_without_store_is_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    assert list_models() == []


def test_list_models_broken_entry_raises_or_is_reported(store):
    add_model(store, "good:1")
    bad = add_model(store, "bad:1")
    bad.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        list_models()
    errors: list[LLMSysError] = []
    assert [m.spec for m in list_models(on_error=errors.append)] == ["ollama:good:1"]
    assert len(errors) == 1 and str(bad) in str(errors[0])


def test_resolve_model_ollama_spec_gives_the_blob(store):
    manifest = add_model(store, "qwen2.5:0.5b")
    assert resolve_model("ollama:qwen2.5:0.5b") == model_blob(store, manifest)
    with pytest.raises(ModelNotFoundError, match="ollama pull qwen2.5:7b"):
        resolve_model("ollama:qwen2.5:7b")


# --------------------------------------------------------------------------
# What a run takes from the manifest
# --------------------------------------------------------------------------


def test_run_settings_applies_stop_and_system_names_the_rest(store, tmp_path):
    add_model(store, "m:1", tiny_gguf(tmp_path / "w.gguf"), params=PARAMS, system="Be brief.")
    s = run_settings(resolve("ollama:m:1"), stop=("END", "<|im_end|>"))
    assert s.stop == ("END", "<|im_end|>", "<|im_start|>")  # the user's first, no repeats
    assert s.system == "Be brief."
    assert s.note == ("note: ollama:m:1: its stop strings are applied; Ollama params not applied (llmsys's flags "
                      "decide): temperature=0.7 (--temperature 0.7 to match), num_ctx=4096 (--max-model-len 4096 "
                      "to match)")
    assert run_settings(resolve("ollama:m:1"), system="Mine.").system == "Mine."


@pytest.mark.parametrize("params, stop, note", [
    (None, (), None),
    ({"stop": "###"}, ("###",), None),  # one string, as some Modelfiles write it
    ({"stop": ["a", 3]}, (), 'stop=["a", 3] (no llmsys equivalent)'),  # malformed: named, none applied
    ({"mirostat": 2, "seed": 42}, (), "mirostat=2 (no llmsys equivalent), seed=42 (--seed 42 to match)"),
])
def test_run_settings_cases(store, tmp_path, params, stop, note):
    add_model(store, "m:1", tiny_gguf(tmp_path / "w.gguf"), params=params)
    s = run_settings(resolve("ollama:m:1"))
    assert s.stop == stop and s.system is None
    if note is None:
        assert s.note is None
    else:
        assert s.note.startswith("note: ollama:m:1: ") and s.note.endswith("(llmsys's flags decide): " + note)


def test_chat_needs_the_ggufs_template(store, tmp_path):
    add_model(store, "m:1", tiny_gguf(tmp_path / "w.gguf"), template=TEMPLATE)
    add_model(store, "bare:1", tiny_gguf(tmp_path / "w.gguf"))
    m = resolve("ollama:m:1")
    require_chat_template(m, {"tokenizer.chat_template": "{{ messages }}"})  # the GGUF's own: fine
    with pytest.raises(InvalidParameterError) as info:
        require_chat_template(m, {})
    text = one_line(info)
    assert str(m.blob) in text and "Ollama template layer is a Go template" in text and "drop --chat" in text
    with pytest.raises(InvalidParameterError, match="Ollama's manifest has no template either"):
        require_chat_template(resolve("ollama:bare:1"), {})


# --------------------------------------------------------------------------
# Errors: one line, naming the path and the fix
# --------------------------------------------------------------------------


def one_line(info: pytest.ExceptionInfo) -> str:
    text = str(info.value)
    assert "\n" not in text
    return text


def test_no_store_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve("ollama:qwen2.5")
    text = one_line(info)
    assert f"no Ollama model store at {tmp_path / 'nowhere'}" in text and "OLLAMA_MODELS" in text
    monkeypatch.delenv("OLLAMA_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("ollama:qwen2.5")
    text = one_line(info)
    assert str(tmp_path / ".ollama" / "models") in text and "set OLLAMA_MODELS" in text


def test_unknown_model_lists_what_is_there(store):
    add_model(store, "llama3.2:1b")
    add_model(store, "me/custom:v2")
    with pytest.raises(ModelNotFoundError) as info:
        resolve("ollama:qwen2.5:0.5b")
    text = one_line(info)
    assert "ollama:qwen2.5:0.5b is not in the Ollama store" in text and str(store) in text
    assert "models there: llama3.2:1b, me/custom:v2" in text and "`ollama pull qwen2.5:0.5b`" in text


def test_unknown_model_did_you_mean(store):
    add_model(store, "qwen2.5:0.5b")
    add_model(store, "qwen2.5:7b")
    add_model(store, "llama3.2:1b")
    with pytest.raises(ModelNotFoundError) as info:
        resolve("ollama:qwen2.5")  # no :latest; the other tags are meant
    assert "did you mean ollama:qwen2.5:0.5b or ollama:qwen2.5:7b? else fetch it" in one_line(info)
    with pytest.raises(ModelNotFoundError) as info:
        resolve("ollama:llama3.3:1b")  # a typo
    assert "did you mean ollama:llama3.2:1b? else" in one_line(info)
    with pytest.raises(ModelNotFoundError) as info:
        resolve("ollama:mistral")
    assert "did you mean" not in one_line(info)


def test_unknown_model_in_empty_store(store):
    with pytest.raises(ModelNotFoundError, match="models there: none"):
        resolve("ollama:qwen2.5")


def test_manifest_not_json(store):
    manifest = add_model(store, "qwen2.5:0.5b")
    manifest.write_text('{"layers": [')
    with pytest.raises(CheckpointError) as info:
        resolve("ollama:qwen2.5:0.5b")
    text = one_line(info)
    assert f"manifest {manifest}" in text and "not valid JSON" in text and "ollama pull qwen2.5:0.5b" in text


def test_manifest_without_model_layer(store):
    manifest = add_model(store, "embed:1", weights=None, template="{{ .Prompt }}")
    with pytest.raises(CheckpointError) as info:
        resolve("ollama:embed:1")
    text = one_line(info)
    assert str(manifest) in text and "no application/vnd.ollama.image.model layer" in text
    assert "it has: license, template" in text


def test_missing_weights_blob(store):
    manifest = add_model(store, "qwen2.5:0.5b")
    blob = model_blob(store, manifest)
    blob.unlink()
    with pytest.raises(CheckpointError) as info:
        resolve("ollama:qwen2.5:0.5b")
    text = one_line(info)
    assert f"weights blob {blob}" in text and "is missing" in text and "ollama pull qwen2.5:0.5b" in text


def test_truncated_weights_blob(store):
    manifest = add_model(store, "qwen2.5:0.5b", b"GGUF" + bytes(60))
    blob = model_blob(store, manifest)
    blob.write_bytes(b"GGUF" + bytes(10))
    with pytest.raises(CheckpointError) as info:
        resolve("ollama:qwen2.5:0.5b")
    text = one_line(info)
    assert f"{blob} of ollama:qwen2.5:0.5b is 14 bytes but its manifest {manifest} says 64" in text
    assert "truncated" in text


def test_weights_blob_not_gguf(store):
    manifest = add_model(store, "st:1", b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointError) as info:
        resolve("ollama:st:1")
    text = one_line(info)
    assert str(model_blob(store, manifest)) in text and "GGUF magic" in text


def test_params_not_json(store):
    manifest = add_model(store, "p:1", params={})
    layer = next(x for x in json.loads(manifest.read_text())["layers"] if x["mediaType"] == MEDIA + "params")
    (store / "blobs" / layer["digest"].replace(":", "-")).write_text("{oops")
    with pytest.raises(CheckpointError, match="params blob .* is not valid JSON"):
        resolve("ollama:p:1")


# --------------------------------------------------------------------------
# `llmsys models`
# --------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("models")(models_command)
    app.command("noop")(lambda: None)  # two commands, so "models" is a subcommand as in llmsys
    return app


def llmsys(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_models_cli_lists_the_ollama_store(store, tmp_path):
    weights = tiny_gguf(tmp_path / "w.gguf")
    add_model(store, "qwen2.5:0.5b", weights + bytes(2 * 1024 * 1024 - len(weights)))  # bytes past the data: still GGUF
    add_model(store, "me/custom:v2", weights)
    r = llmsys("models", env=dict(ENV, OLLAMA_MODELS=str(store), LLMSYS_HOME=str(tmp_path / "home")))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "PARAMS", "ARCHITECTURE", "QUANT", "SIZE", "LICENCE", "DOWNLOADED"]
    row = next(line for line in lines if line.startswith("ollama:qwen2.5:0.5b "))
    assert row.split()[1:5] == ["32", "Llama", "F32", "2.0"] and row.rstrip().endswith("in the Ollama store")
    assert any(line.startswith("ollama:me/custom:v2 ") for line in lines)
    assert any(line.startswith("Qwen2.5-0.5B-Instruct ") for line in lines)  # the catalog is still there
    assert f"in the Ollama store {store}" in r.stdout and "llmsys run ollama:NAME:TAG" in r.stdout


def test_family_and_quant_names():
    from llmsys.engine.cli.models_cmd import family_name, format_count, quant_name

    assert family_name({"general.architecture": "qwen3moe"}) == "Qwen3-MoE"
    assert family_name({"general.architecture": "llama", "llama.expert_count": 8}) == "Mixtral"
    assert family_name({"general.architecture": "llama", "llama.expert_count": 0}) == "Llama"
    assert family_name({"general.architecture": "mamba"}) == "mamba (not supported)"
    assert quant_name({"general.file_type": 15}, []) == "Q4_K_M"
    assert quant_name({"general.file_type": 1024 | 7}, []) == "Q8_0"  # llama.cpp's "guessed" flag
    assert quant_name({}, [8, 8, 1, 0]) == "Q8_0"  # no file type: what most weight tensors hold
    assert quant_name({"general.file_type": 9999}, []) == "-"
    assert [format_count(n) for n in (999, 1000, 1_313_024, 494_032_768, 7_615_616_512, 30_532_122_624)] == [
        "999", "1.00K", "1.31M", "494M", "7.62B", "30.5B"]


def test_models_without_store_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(_app(), ["models"])
    assert result.exit_code == 0, result.output
    assert "ollama" not in result.output.lower()
    assert result.output.rstrip().endswith("`llmsys run /path/to/model-dir`.")


def test_models_reports_a_broken_manifest_and_lists_the_rest(store, tmp_path):
    add_model(store, "good:1", tiny_gguf(tmp_path / "w.gguf"))
    manifest = add_model(store, "bad:1", b"GGUF" + b"other weights")  # blobs are shared by content
    model_blob(store, manifest).unlink()
    result = CliRunner().invoke(_app(), ["models"])
    assert result.exit_code == 0, result.output
    assert any(line.startswith("ollama:good:1 ") for line in result.stdout.splitlines())
    assert "ollama:bad:1 " not in result.stdout
    assert f"warning: skipped: the weights blob {model_blob(store, manifest)} of ollama:bad:1" in result.stderr


def test_models_reports_an_unreadable_gguf_header(store, tmp_path):
    """A blob with the magic and the recorded size but a corrupt header: one warning naming it and the fix."""
    add_model(store, "good:1", tiny_gguf(tmp_path / "w.gguf"))
    add_model(store, "bad:1", b"GGUF" + bytes(60))  # version 0
    result = CliRunner().invoke(_app(), ["models"])
    assert result.exit_code == 0, result.output
    assert any(line.startswith("ollama:good:1 ") for line in result.stdout.splitlines())
    assert "ollama:bad:1 " not in result.stdout
    warning = [line for line in result.stderr.splitlines() if "ollama:bad:1" in line]
    assert len(warning) == 1 and "GGUF version 0 is not supported" in warning[0]
    assert warning[0].startswith("warning: skipped: the weights blob of ollama:bad:1 is not a readable GGUF")
    assert warning[0].endswith("re-download it with `ollama pull bad:1`")


def test_run_unknown_ollama_model_is_one_line_error(store, tmp_path):
    add_model(store, "llama3.2:1b")
    r = llmsys("run", "ollama:qwen2.5:0.5b", "hi", env=dict(ENV, OLLAMA_MODELS=str(store), LLMSYS_HOME=str(tmp_path)))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ollama:qwen2.5:0.5b is not in the Ollama store"), r.stderr
    assert "models there: llama3.2:1b" in lines[0]


# --------------------------------------------------------------------------
# End to end: a real GGUF in the store, run by name
# --------------------------------------------------------------------------


def _gguf_support_missing() -> list[str]:
    """The GGUF pieces an ollama: run needs that this checkout lacks (loader, tokenizer)."""
    loader = ("llmsys.engine.loader.gguf", "llmsys.engine.loader.gguf_io")
    missing = [] if any(importlib.util.find_spec(m) for m in loader) else [" or ".join(loader)]
    return missing + [m for m in ("llmsys.engine.gguf_tokenizer",) if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(bool(_gguf_support_missing()),
                    reason=f"ollama: blobs are GGUF files and {', '.join(_gguf_support_missing())} is not written yet")
def test_run_ollama_stories(store, tmp_path):
    need_shared(STORIES_HF)
    from llmsys.engine.bench.gguf_export import export_float

    exported = export_float(STORIES_HF, tmp_path / "stories.gguf", "f32")
    add_model(store, "stories", Path(exported).read_bytes(), params={"stop": ["</s>"]}, template="{{ .Prompt }}")
    blob = resolve("ollama:stories").blob
    assert blob.suffix == "" and blob.read_bytes()[:4] == b"GGUF"
    r = llmsys("run", "ollama:stories:latest", "Once upon a time", "-n", "16", "--temperature", "0",
               "--dtype", "float32", env=dict(ENV, OLLAMA_MODELS=str(store), LLMSYS_HOME=str(tmp_path / "home")))
    assert r.returncode == 0, r.stderr
    # The continuation the safetensors folder gives (tests/test_cli.py): same weights, same text.
    assert r.stdout.startswith(", there was a little girl named Lily"), r.stdout
    assert "generated 16 tok" in r.stderr

