"""Every GGUF family llmsys loads, run and listed from an Ollama store by name (issue #42).

One store in a temporary directory, laid out as Ollama writes it: ``manifests/registry.ollama.ai/library/NAME/TAG``
(schema-2 manifests: a config blob, then the model, template, license and params layers with Ollama's media
types) and ``blobs/sha256-<hex>`` named by each blob's true digest. Each family's weights are its converter-made
GGUF (``gguf_families.converted``), so ``llmsys run ollama:NAME`` and ``llmsys models`` read files as the world
makes them, through the real CLI in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_families import FAMILIES, converted, hf_checkpoint

MEDIA = "application/vnd.ollama.image."
# What Ollama's library puts in these layers for a ChatML model: a Go template, and params with stop strings and
# sampling defaults. llmsys applies the stop strings and names the rest.
GO_TEMPLATE = ("{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}<|im_start|>user\n"
               "{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n")
PARAMS = {"stop": ["<|im_start|>", "<|im_end|>"], "temperature": 0.7, "num_ctx": 2048}
NOTE = ("its stop strings are applied; Ollama params not applied (llmsys's flags decide): "
        "temperature=0.7 (--temperature 0.7 to match), num_ctx=2048 (--max-model-len 2048 to match)")
PROMPT = "Once upon a time"
NAMES = tuple(FAMILIES)


def put_blob(store: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def add_model(store: Path, name: str, tag: str, weights: Path, *, params: dict | None = None,
              template: str | None = GO_TEMPLATE, system: str | None = None) -> Path:
    """An Ollama manifest for ``name:tag`` and its blobs, as ``ollama pull`` leaves them."""
    model = {"mediaType": MEDIA + "model", **put_blob(store, weights.read_bytes())}
    layers = [model]
    for kind, text in (("template", template), ("system", system), ("license", "Apache License 2.0 (test)")):
        if text is not None:
            layers.append({"mediaType": MEDIA + kind, **put_blob(store, text.encode())})
    if params is not None:
        layers.append({"mediaType": MEDIA + "params", **put_blob(store, json.dumps(params).encode())})
    config = {"model_format": "gguf", "model_family": "test", "architecture": "amd64", "os": "linux",
              "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]}}
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   **put_blob(store, json.dumps(config).encode())},
        "layers": layers,
    }
    path = store / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


@pytest.fixture(scope="module")
def files() -> dict[str, Path]:
    """Each family's F16 file (made once, cached under $LLMSYS_HOME/test-gguf as test_gguf_families does)."""
    return {name: converted(name, "f16") for name in NAMES}


@pytest.fixture(scope="module")
def store(files, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ollama") / "models"
    for name, path in files.items():
        add_model(root, f"tiny-{name}", "f16", path, params=PARAMS)
    return root


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """One $LLMSYS_HOME for the module's CLI runs: a fresh one per test compiled the C kernels again in each
    subprocess (8 s a run instead of 2.5 s beside other work)."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture
def env(store, home) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", OLLAMA_MODELS=str(store), LLMSYS_HOME=str(home))


def llmsys(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def greedy(path: Path, prompt: str, n: int, stop: tuple[str, ...] = ()):
    """The text (and finish reason) llmsys gives for ``path`` itself, in process: what the store's copy must give."""
    from llmsys.engine.llm import LLM
    from llmsys.engine.sampling import SamplingParams

    out = LLM(str(path), device="cpu", dtype="float32").generate(
        prompt, SamplingParams(max_tokens=n, temperature=0.0, stop=stop))[0]
    return out.text, out.finish_reason


# --------------------------------------------------------------------------
# llmsys run ollama:NAME
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_run_each_family_from_the_store(name, files, env):
    """The manifest leads to the family's blob (ten models in one store, none mixed up): the same greedy text as
    the GGUF file run by path; the params llmsys does not apply are named in one line."""
    r = llmsys("run", f"ollama:tiny-{name}:f16", PROMPT, "-n", "8", "--temperature", "0", "--dtype", "float32",
               env=env)
    assert r.returncode == 0, r.stderr
    text, finish = greedy(files[name], PROMPT, 8, tuple(PARAMS["stop"]))
    assert r.stdout == text + "\n"
    lines = r.stderr.splitlines()
    assert lines.count(f"note: ollama:tiny-{name}:f16: {NOTE}") == 1, r.stderr
    assert f"finish {finish}" in lines[-1] and (finish != "length" or "generated 8 tok" in lines[-1]), r.stderr


def test_stop_param_applies(files, store, env):
    """A stop string from the params layer ends the text where it first appears, unprinted, as in Ollama."""
    text, _ = greedy(files["llama"], PROMPT, 16)
    k = len(text) // 2
    stop = text[k:k + 3]
    assert stop.strip(), text  # a stop string of visible text
    add_model(store, "tiny-llama", "stop", files["llama"], params={"stop": [stop]})
    r = llmsys("run", "ollama:tiny-llama:stop", PROMPT, "-n", "16", "--temperature", "0", "--dtype", "float32",
               env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == text[:text.index(stop)] + "\n"
    assert "finish stop" in r.stderr and "note:" not in r.stderr  # nothing left unapplied: no note


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of ``src`` with ``tokenizer.chat_template`` set, written by gguf-py's own metadata editor."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(
        gguf.GGUFValueType.STRING, template)}, [])
    return dst


def test_chat_uses_the_ggufs_template_and_the_system_layer(files, store, env, tmp_path):
    """--chat renders the GGUF's own Jinja template (Ollama's Go template is not run) with the manifest's system
    message when --system is not given; --system overrides it."""
    from llmsys.engine.llm import LLM

    jinja = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}[assistant] {% endif %}")
    path = with_chat_template(files["qwen2"], tmp_path / "chat.gguf", jinja)
    add_model(store, "tiny-qwen2", "chat", path, params=PARAMS, system="Answer in one word.")
    tok = LLM(str(path), device="cpu", dtype="float32").tokenizer
    user = {"role": "user", "content": PROMPT}
    expected = {
        None: len(tok.encode_chat([{"role": "system", "content": "Answer in one word."}, user])),
        "Be terse.": len(tok.encode_chat([{"role": "system", "content": "Be terse."}, user])),
    }
    go_rendered = len(tok.encode(GO_TEMPLATE.replace("{{ .Prompt }}", PROMPT)))  # what Ollama's template gives
    assert len(set(expected.values()) | {go_rendered, len(tok.encode_chat([user]))}) == 4  # the counts tell them apart
    for system, n in expected.items():
        flags = ["--system", system] if system else []
        r = llmsys("run", "ollama:tiny-qwen2:chat", PROMPT, "--chat", *flags, "-n", "2", "--temperature", "0",
                   env=env)
        assert r.returncode == 0, r.stderr
        assert f"prompt {n} tok" in r.stderr, (system, n, r.stderr)


def test_chat_without_a_gguf_template_is_one_line(files, env, store):
    r = llmsys("run", "ollama:tiny-qwen3:f16", PROMPT, "--chat", "-n", "2", env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ollama:tiny-qwen3:f16 cannot take --chat: its GGUF ")
    assert "no tokenizer.chat_template and its Ollama template layer is a Go template" in lines[0]
    assert "drop --chat" in lines[0]


def test_near_miss_name_suggests(env, store):
    r = llmsys("run", "ollama:tiny-qwen3moe", PROMPT, env=env)  # tag left out: :latest is not there
    assert r.returncode == 2
    assert "did you mean ollama:tiny-qwen3moe:f16?" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = llmsys("run", "ollama:tiny-qwen3-moe:f16", PROMPT, env=env)  # a typo: the closest spelling first
    assert "did you mean ollama:tiny-qwen3moe:f16 or " in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------
# llmsys models
# --------------------------------------------------------------------------

FAMILY_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma-2", "gemma3": "Gemma-3",
                "phi3": "Phi-3", "mixtral": "Mixtral", "qwen2moe": "Qwen2-MoE", "qwen3moe": "Qwen3-MoE",
                "gpt-oss": "GPT-OSS"}


def checkpoint_counts(name: str) -> tuple[int, int | None]:
    """(parameters, active parameters for MoE) of the family's HF checkpoint, counted from its safetensors and
    config.json: an account independent of the GGUF header the listing reads."""
    from safetensors import safe_open

    folder = hf_checkpoint(name)
    total = routed = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
                routed += n if ".experts." in key else 0
    if not FAMILIES[name].moe:
        return total, None
    cfg = json.loads((folder / "config.json").read_text())
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    return total, total - routed + routed * cfg["num_experts_per_tok"] // experts


def test_models_lists_each_family(store, env, files):
    from llmsys.engine.cli.models_cmd import format_count
    from llmsys.kernels.common.units import format_bytes

    r = llmsys("models", env=env)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "PARAMS", "ARCHITECTURE", "QUANT", "SIZE", "LICENCE", "DOWNLOADED"]
    for name in NAMES:
        row = next(line for line in lines if line.startswith(f"ollama:tiny-{name}:f16 ")).split()
        total, active = checkpoint_counts(name)
        params = [format_count(total)] + ([f"({format_count(active)}", "active)"] if active else [])
        size = format_bytes(files[name].stat().st_size).split()
        assert row == [f"ollama:tiny-{name}:f16", *params, FAMILY_NAMES[name], "F16", *size, "-",
                       "in", "the", "Ollama", "store"], (name, row)


def test_models_family_names_cover_the_loader():
    """Every architecture the GGUF loader takes has a family name (a new one shows up here, not as raw text)."""
    from llmsys.engine.cli.models_cmd import FAMILIES as SHOWN, MOE_FAMILIES
    from llmsys.engine.loader.gguf_io import ARCHS, MOE_ARCHS

    assert set(SHOWN) == set(ARCHS) and set(MOE_FAMILIES) == set(MOE_ARCHS)


@pytest.mark.parametrize("name, fmt, shown", [("qwen3moe", "q4_K_M", "Q4_K_M"), ("llama", "q8_0", "Q8_0"),
                                              ("gpt-oss", "mxfp4", "MXFP4_MOE")])  # as Ollama ships gpt-oss
def test_models_shows_the_stored_quant_type(name, fmt, shown, env, tmp_path):
    """A file llama.cpp quantized shows its file type as stored (the K-quant mix by its name, not a tensor's)."""
    path = converted(name, fmt)  # skips, saying why, where llama.cpp's quantizer is absent
    store = tmp_path / "quantized"
    add_model(store, f"tiny-{name}", fmt, path, params=PARAMS)
    env = dict(env, OLLAMA_MODELS=str(store))
    r = llmsys("models", env=env)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"ollama:tiny-{name}:{fmt} ")).split()
    assert FAMILY_NAMES[name] in row and row[row.index(FAMILY_NAMES[name]) + 1] == shown, row
    r = llmsys("run", f"ollama:tiny-{name}:{fmt}", PROMPT, "-n", "4", "--temperature", "0", env=env)
    assert r.returncode == 0, r.stderr
    assert "generated 4 tok" in r.stderr or "finish stop" in r.stderr, r.stderr
