"""The model catalog, resolve_model rules, and real pulls from a local fake hub.

The fake hub is a real HTTP server on a loopback port that answers the
Hub's file-resolve route (`/{repo_id}/resolve/{revision}/{filename}`) with the
headers huggingface_hub's `hf_hub_download` reads (X-Repo-Commit, ETag,
Content-Length; X-Error-Code on errors), and the two API routes a pull lists
the repo with (model info at a revision, the file tree), so `pull` runs the
genuine huggingface_hub code (`snapshot_download`) end to end.
"""

from __future__ import annotations

import hashlib
import dataclasses
import json
import shutil
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import typer
from safetensors.numpy import save as save_safetensors
from typer.testing import CliRunner

from llmsys.engine.catalog import (
    CatalogEntry,
    is_downloaded,
    load_catalog,
    local_path,
    pull,
    resolve_model,
    synthetic_configs,
)
from llmsys.engine.hub import PULL_MANIFEST
from llmsys.engine.cli.models_cmd import models_command, pull_command
from llmsys.kernels.common.errors import HubError, LLMSysError, ModelNotFoundError
from llmsys.kernels.common.paths import llmsys_home
from llmsys.kernels.common.units import format_bytes

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FAKE_REPO = "llmsys-test/tiny-model"


# --------------------------------------------------------------------------
# Fake hub
# --------------------------------------------------------------------------


class _Hub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, files: dict[tuple[str, str], bytes]):
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.files = files  # (repo_id, path in repo) -> content
        self.revisions: tuple[str, ...] = ("v1.0",)  # branch/tag names besides main
        self.requests: list[str] = []


class _HubHandler(BaseHTTPRequestHandler):
    server: _Hub

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_HEAD(self):
        self._serve(send_body=False)

    def do_GET(self):
        self._serve(send_body=True)

    def _reply(self, status: int, headers: dict[str, str], body: bytes, send_body: bool):
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _serve(self, send_body: bool):
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        self.server.requests.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            self._api(parts[2:], send_body)
            return
        if len(parts) < 5 or parts[2] != "resolve":
            self._reply(404, {}, b"not found", send_body)
            return
        repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
        if not any(r == repo for r, _ in self.server.files):
            # What the Hub answers for a missing (or private) repo.
            self._reply(401, {"X-Error-Code": "RepoNotFound"}, b"Repository not found", send_body)
            return
        data = self.server.files.get((repo, filename))
        if data is None:
            headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}
            self._reply(404, headers, b"Entry not found", send_body)
            return
        headers = {
            "X-Repo-Commit": COMMIT,
            "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
        }
        self._reply(200, headers, data, send_body)


    def _api(self, parts: list[str], send_body: bool):
        """The two Hub API calls a pull makes: the model's info at a revision
        (``/api/models/ORG/NAME/revision/REV``) and its file tree
        (``/api/models/ORG/NAME/tree/REV``), as the Hub shapes them."""
        repo, kind, revision = "/".join(parts[:2]), parts[2], parts[3]
        files = {name: data for (r, name), data in self.server.files.items() if r == repo}
        if not files:
            self._reply(401, {"X-Error-Code": "RepoNotFound"}, b"Repository not found", send_body)
            return
        if revision not in ("main", COMMIT, *self.server.revisions):
            self._reply(404, {"X-Error-Code": "RevisionNotFound"}, b"Invalid rev id", send_body)
            return
        if kind == "revision":
            body = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]}
        else:
            body = [
                {"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                for n, d in sorted(files.items())
            ]
        self._reply(200, {"Content-Type": "application/json"}, json.dumps(body).encode(), send_body)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path / "home"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    # huggingface_hub reads HF_HUB_OFFLINE once at import: undo it for these tests.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "home"


def _start_hub(files: dict[tuple[str, str], bytes]):
    hub = _Hub(files)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    return hub, thread


@pytest.fixture
def tiny_files() -> dict[str, bytes]:
    """A small but genuine HF-style model dir: safetensors + json files."""
    weights = {
        "model.embed_tokens.weight": np.arange(64 * 16, dtype=np.float32).reshape(64, 16),
        "model.norm.weight": np.ones(16, dtype=np.float32),
    }
    config = {"model_type": "llama", "hidden_size": 16, "vocab_size": 64}
    return {
        "config.json": json.dumps(config).encode(),
        "tokenizer_config.json": b'{"bos_token": "<s>"}',
        "model.safetensors": save_safetensors(weights),
    }


@pytest.fixture
def hub(tiny_files):
    files = {(FAKE_REPO, name): data for name, data in tiny_files.items()}
    server, thread = _start_hub(files)
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _endpoint(server: _Hub) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


def _entry(files, name="tiny-test", repo=FAKE_REPO, **kw) -> CatalogEntry:
    return CatalogEntry(
        name=name,
        repo=repo,
        files=tuple(files),
        architecture="LlamaForCausalLM",
        params="1K",
        size_bytes=4096,
        licence="mit",
        default_dtype="float32",
        chat=False,
        description="test model",
        **kw,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _leftovers(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


# --------------------------------------------------------------------------
# Catalog contents
# --------------------------------------------------------------------------


def test_every_entry_is_complete():
    from llmsys.engine.models import ARCHITECTURES, MULTIMODAL

    catalog = load_catalog()
    required_models = {
        "stories260k", "SmolLM2-135M-Instruct", "SmolLM2-360M-Instruct",
        "SmolLM2-1.7B-Instruct", "Qwen2.5-0.5B-Instruct", "Qwen2.5-1.5B-Instruct",
        "Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct", "Qwen3-0.6B",
        "Llama-3.2-1B-Instruct", "Llama-3.2-3B-Instruct", "Llama-3.1-8B-Instruct",
        "Mistral-7B-Instruct-v0.3",
    }  # fmt: skip
    assert required_models <= set(catalog)
    assert sum(entry.chat for entry in catalog.values()) >= 9
    for name, entry in catalog.items():
        assert entry.name == name
        assert entry.repo.count("/") == 1, name
        assert entry.size_bytes > 0 and entry.params and entry.licence, name
        assert entry.default_dtype in ("float32", "bfloat16", "float16"), name
        if entry.format == "llama2c":
            continue
        # a causal LM, or a multimodal one whose text model llmsys loads (models.MULTIMODAL: gemma-3-4b-it)
        assert entry.architecture.endswith("ForCausalLM") or entry.architecture in MULTIMODAL, name
        assert entry.architecture in ARCHITECTURES, name  # every catalog model runs
        if entry.files is None:  # chosen at pull time from the repo's listing (hub.choose_files)
            continue
        assert len(set(entry.files)) == len(entry.files), name
        for needed in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            assert needed in entry.files, (name, needed)
        shards = [f for f in entry.files if f.endswith(".safetensors")]
        assert shards, name
        if len(shards) > 1:
            # Sharded checkpoints: model-0000i-of-0000N plus the index.
            assert "model.safetensors.index.json" in entry.files, name
            n = len(shards)
            expected = {f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
            assert set(shards) == expected, name
        else:
            assert shards == ["model.safetensors"], name
    stories = catalog["stories260k"]
    assert stories.format == "llama2c" and not stories.chat
    # The families people ask for now (#18), their files read from the Hub when pulled.
    for name in ("Qwen3-30B-A3B-Instruct-2507", "Qwen3-Coder-30B-A3B-Instruct", "Mixtral-8x7B-Instruct-v0.1",
                 "gemma-3-1b-it", "gemma-3-4b-it", "Phi-4-mini-instruct", "gpt-oss-20b"):
        assert catalog[name].files is None and catalog[name].chat, name


def test_synthetic_shapes_are_valid_transformers_configs():
    from transformers import AutoConfig

    shapes = synthetic_configs()
    assert {"llama-1b", "llama-8b", "qwen2.5-0.5b", "smollm2-135m"} <= set(shapes)
    for name, raw in shapes.items():
        cfg = AutoConfig.for_model(**raw)
        assert cfg.model_type == raw["model_type"], name
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0, name
        if "head_dim" not in raw:  # Qwen3 (and its MoE) state head_dim, wider than hidden / heads
            assert cfg.hidden_size % cfg.num_attention_heads == 0, name
    qwen = AutoConfig.for_model(**shapes["qwen2.5-0.5b"])
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.intermediate_size) == (896, 24, 4864)
    assert (qwen.num_attention_heads, qwen.num_key_value_heads, qwen.vocab_size) == (14, 2, 151936)
    assert qwen.tie_word_embeddings
    smol = AutoConfig.for_model(**shapes["smollm2-135m"])
    assert (smol.hidden_size, smol.num_hidden_layers, smol.intermediate_size) == (576, 30, 1536)
    assert (smol.num_attention_heads, smol.num_key_value_heads, smol.vocab_size) == (9, 3, 49152)
    assert smol.tie_word_embeddings and smol.max_position_embeddings == 2048
    assert shapes["smollm2-135m"]["rope_theta"] == 100000.0
    llama8 = AutoConfig.for_model(**shapes["llama-8b"])
    assert (llama8.hidden_size, llama8.num_hidden_layers, llama8.vocab_size) == (4096, 32, 128256)
    assert not llama8.tie_word_embeddings


def test_synthetic_configs_are_fresh_copies():
    first = synthetic_configs()
    first["llama-1b"]["hidden_size"] = 1
    assert synthetic_configs()["llama-1b"]["hidden_size"] == 2048


def test_bad_catalog_is_reported(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text('["x"]\nrepo = "a/b"\nfiles = ["config.json"]\n')
    with pytest.raises(LLMSysError, match=r"\[x\] lacks the 'architecture' field"):
        load_catalog(bad)


# --------------------------------------------------------------------------
# resolve_model
# --------------------------------------------------------------------------


def test_resolve_existing_paths(home, tmp_path):
    directory = tmp_path / "some-model"
    directory.mkdir()
    single = tmp_path / "weights.bin"
    single.write_bytes(b"x")
    assert resolve_model(str(directory)) == directory
    assert resolve_model(str(single)) == single


def test_resolve_catalog_name_not_downloaded(home):
    with pytest.raises(ModelNotFoundError, match=r"run `llmsys pull Qwen3-0.6B`") as info:
        resolve_model("Qwen3-0.6B")
    assert "\n" not in str(info.value)
    # Case-insensitive names reach the same entry.
    with pytest.raises(ModelNotFoundError, match=r"llmsys pull Qwen3-0.6B"):
        resolve_model("qwen3-0.6b")


def test_resolve_unknown(home, tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(missing)
    assert str(info.value) == f"no such file or directory: {missing}"  # a path: no catalog name was meant
    (tmp_path / "nape").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"did you mean nape \(in .*\)\?$"):
        resolve_model(missing)
    with pytest.raises(ModelNotFoundError, match=r"^no model named nope: not a file or directory, a models.toml name"):
        resolve_model("nope")


def test_is_downloaded_catches_truncation(home, tiny_files):
    entry = _entry(tiny_files)
    root = local_path(entry)
    assert root == home / "models" / "tiny-test" and llmsys_home() == home
    root.mkdir(parents=True)
    for name, data in tiny_files.items():
        (root / name).write_bytes(data)
    assert is_downloaded(entry)  # no manifest (copied by hand): still complete
    (root / "model.safetensors").write_bytes(tiny_files["model.safetensors"][:-10])
    assert not is_downloaded(entry)
    (root / "model.safetensors").unlink()
    assert not is_downloaded(entry)


# --------------------------------------------------------------------------
# pull against the fake hub
# --------------------------------------------------------------------------


def test_pull_downloads_byte_identical_files(home, hub, tiny_files):
    entry = _entry(tiny_files)
    path = pull(entry, endpoint=_endpoint(hub), progress=False)
    assert path == home / "models" / "tiny-test"
    for name, data in tiny_files.items():
        assert (path / name).read_bytes() == data, name
    # Only the model files (and our manifest) remain: no hf bookkeeping.
    assert sorted(p.name for p in path.iterdir()) == sorted([*tiny_files, PULL_MANIFEST])
    assert _leftovers(home) == ["tiny-test"]
    assert is_downloaded(entry)
    # "main" is resolved once to a commit, and every file comes from that one commit.
    assert "GET /api/models/llmsys-test/tiny-model/revision/main" in hub.requests
    resolves = [r for r in hub.requests if "/resolve/" in r]
    assert resolves and all(f"/resolve/{COMMIT}/" in r for r in resolves)

    # A second pull is a no-op: it succeeds even with the hub gone.
    hub.requests.clear()
    assert pull(entry, endpoint=f"http://127.0.0.1:{_free_port()}", progress=False) == path
    assert hub.requests == []


def test_pull_uses_hf_endpoint_env(home, hub, tiny_files, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", _endpoint(hub))
    path = pull(_entry(tiny_files), progress=False)
    assert (path / "config.json").read_bytes() == tiny_files["config.json"]


def test_pull_flattens_subfolder(home, tiny_files):
    files = {(FAKE_REPO, f"sub/{name}"): data for name, data in tiny_files.items()}
    server, thread = _start_hub(files)
    try:
        entry = _entry(tiny_files, subfolder="sub")
        path = pull(entry, endpoint=_endpoint(server), progress=False)
    finally:
        server.shutdown()
        server.server_close()
    assert sorted(p.name for p in path.iterdir()) == sorted([*tiny_files, PULL_MANIFEST])
    assert (path / "model.safetensors").read_bytes() == tiny_files["model.safetensors"]


def test_pull_missing_file_names_it_and_leaves_nothing(home, hub, tiny_files):
    # The missing file comes last, so earlier files were already downloaded.
    entry = _entry([*tiny_files, "generation_config.json"])
    with pytest.raises(HubError) as info:
        pull(entry, endpoint=_endpoint(hub), progress=False)
    message = str(info.value)
    assert "generation_config.json" in message and FAKE_REPO in message
    assert "\n" not in message
    assert _leftovers(home) == []
    assert not is_downloaded(entry)


def test_pull_missing_repo(home, hub, tiny_files):
    entry = _entry(tiny_files, repo="llmsys-test/no-such-repo")
    with pytest.raises(HubError, match=r"repository llmsys-test/no-such-repo not found"):
        pull(entry, endpoint=_endpoint(hub), progress=False)
    assert _leftovers(home) == []


def test_pull_with_hub_down(home, tiny_files):
    endpoint = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(HubError) as info:
        pull(_entry(tiny_files), endpoint=endpoint, progress=False)
    message = str(info.value)
    assert message.startswith(f"cannot reach the hub at {endpoint}")
    assert "llmsys run /path/to/model-dir" in message and "\n" not in message
    assert _leftovers(home) == []


def test_pull_offline_mode(home, hub, tiny_files, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match=r"cannot reach the hub at .*HF_HUB_OFFLINE"):
        pull(_entry(tiny_files), endpoint=_endpoint(hub), progress=False)
    assert hub.requests == [] and _leftovers(home) == []


def test_pull_unknown_name(home):
    with pytest.raises(ModelNotFoundError, match=r"llmsys models"):
        pull("no-such-model", progress=False)


def test_pull_real_stories260k_entry_then_resolve(home):
    """The real catalog entry (repo, subfolder, file names) pulled end to end."""
    src = SHARED / "models" / "stories260k"
    if not src.is_dir():
        pytest.skip(f"shared test data not found at {src}")
    entry = load_catalog()["stories260k"]
    files = {
        (entry.repo, f"{entry.subfolder}/{name}"): (src / name).read_bytes()
        for name in entry.files
    }
    server, thread = _start_hub(files)
    try:
        path = pull("stories260k", endpoint=_endpoint(server), progress=False)
    finally:
        server.shutdown()
        server.server_close()
    for name in entry.files:
        assert (path / name).read_bytes() == (src / name).read_bytes()
    assert resolve_model("stories260k") == path == home / "models" / "stories260k"


# --------------------------------------------------------------------------
# CLI commands
# --------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("models")(models_command)
    app.command("pull")(pull_command)
    return app


def test_models_command_lists_catalog(home):
    result = CliRunner().invoke(_app(), ["models"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["NAME", "PARAMS", "ARCHITECTURE", "QUANT", "SIZE", "LICENCE", "DOWNLOADED"]
    row = next(line for line in lines if line.startswith("Llama-3.2-1B-Instruct "))
    assert "1.24B" in row and "LlamaForCausalLM" in row and row.rstrip().endswith("no")
    assert str(home / "models") in result.output


def test_models_command_shows_downloaded_path(home):
    src = SHARED / "models" / "stories260k"
    if not src.is_dir():
        pytest.skip(f"shared test data not found at {src}")
    dest = home / "models" / "stories260k"
    shutil.copytree(src, dest)
    result = CliRunner().invoke(_app(), ["models"])
    row = next(line for line in result.output.splitlines() if line.startswith("stories260k "))
    assert row.rstrip().endswith(f"yes  {dest}")


def test_pull_command(home, hub, tiny_files):
    result = CliRunner().invoke(_app(), ["pull", "no-such-model"])
    assert isinstance(result.exception, ModelNotFoundError)
    result = CliRunner().invoke(
        _app(), ["pull", "Qwen3-0.6B", "--endpoint", f"http://127.0.0.1:{_free_port()}"]
    )
    assert isinstance(result.exception, HubError)
    assert "cannot reach the hub" in str(result.exception)


# --------------------------------------------------------------------------
# Any Hugging Face repo (org/name[@revision]) and pulling on run/serve/chat
# --------------------------------------------------------------------------

ANY_REPO = "some-org/stories-hf"


def _serve_repo(repo: str, files: dict[str, bytes]):
    server, thread = _start_hub({(repo, name): data for name, data in files.items()})
    return server


def _stories_repo_files() -> dict[str, bytes]:
    src = SHARED / "models" / "stories260k-hf"
    if not src.is_dir():
        pytest.skip(f"shared test data not found at {src}")
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    # What real repos also hold, which a pull must leave on the hub.
    files["README.md"] = b"# a model card"
    files["pytorch_model.bin"] = b"duplicate weights in another format"
    files["original/consolidated.00.pth"] = b"more duplicates"
    return files


def test_pull_any_repo_picks_the_model_files(home):
    files = _stories_repo_files()
    server = _serve_repo(ANY_REPO, files)
    try:
        path = pull(ANY_REPO, endpoint=_endpoint(server), progress=False)
    finally:
        server.shutdown()
        server.server_close()
    assert path == home / "models" / "hub" / "some-org" / "stories-hf"
    wanted = sorted(n for n in files if n.endswith((".json", ".safetensors")))
    assert sorted(p.name for p in path.iterdir()) == sorted([*wanted, PULL_MANIFEST])
    for name in wanted:
        assert (path / name).read_bytes() == files[name]
    assert not any("pytorch_model.bin" in r or "original/" in r or "README" in r for r in server.requests)
    assert resolve_model(ANY_REPO) == path
    # `llmsys models` lists it, with the architecture its config.json names.
    result = CliRunner().invoke(_app(), ["models"])
    row = next(line for line in result.output.splitlines() if line.startswith(ANY_REPO + " "))
    assert "LlamaForCausalLM" in row and row.rstrip().endswith(f"yes  {path}")


def test_pull_any_repo_at_a_revision(home, hub, tiny_files):
    config = json.loads(tiny_files["config.json"]) | {"architectures": ["LlamaForCausalLM"]}
    hub.files[(FAKE_REPO, "config.json")] = json.dumps(config).encode()
    path = pull(f"{FAKE_REPO}@v1.0", endpoint=_endpoint(hub), progress=False)
    assert path == home / "models" / "hub" / "llmsys-test" / "tiny-model@v1.0"
    assert "GET /api/models/llmsys-test/tiny-model/revision/v1.0" in hub.requests
    with pytest.raises(HubError, match=r"revision nope of llmsys-test/tiny-model not found.*@REVISION"):
        pull(f"{FAKE_REPO}@nope", endpoint=_endpoint(hub), progress=False)


def test_pull_any_repo_refuses_unsupported_architecture(home, hub, tiny_files):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    hub.files[(FAKE_REPO, "config.json")] = json.dumps(config).encode()
    with pytest.raises(LLMSysError, match=r"llmsys-test/tiny-model is a GPT2LMHeadModel model; llmsys runs .*LlamaForCausalLM") as info:
        pull(FAKE_REPO, endpoint=_endpoint(hub), progress=False)
    assert "\n" not in str(info.value)
    # Only config.json was fetched: the weights never came, and no staging folder is left.
    assert not any("model.safetensors" in r and r.startswith("GET") for r in hub.requests)
    assert list((home / "models" / "hub" / "llmsys-test").iterdir()) == []


def test_pull_any_repo_without_safetensors_names_the_gguf_way(home):
    server = _serve_repo("some-org/model-GGUF", {"model-Q4_K_M.gguf": b"GGUF", "README.md": b"hi"})
    try:
        with pytest.raises(HubError, match=r"no config.json.*model-Q4_K_M.gguf.*llmsys run FILE.gguf"):
            pull("some-org/model-GGUF", endpoint=_endpoint(server), progress=False)
        with pytest.raises(HubError, match=r"repository some-org/nothing-here not found"):
            pull("some-org/nothing-here", endpoint=_endpoint(server), progress=False)
    finally:
        server.shutdown()
        server.server_close()


def test_pull_any_repo_resumes_an_interrupted_pull(home, hub, tiny_files):
    """A pull cut off mid-way keeps its staging folder; the rerun fetches only what is missing."""
    config = json.loads(tiny_files["config.json"]) | {"architectures": ["LlamaForCausalLM"]}
    hub.files[(FAKE_REPO, "config.json")] = json.dumps(config).encode()
    weights = hub.files[(FAKE_REPO, "model.safetensors")]
    real_get = _HubHandler.do_GET
    calls = {"n": 0}

    def failing_once(handler):  # the weights' first GET dies as a dropped connection would
        if handler.path.endswith("/model.safetensors") and calls["n"] == 0:
            calls["n"] += 1
            handler.send_response(500)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        real_get(handler)

    _HubHandler.do_GET = failing_once
    try:
        with pytest.raises(HubError):
            pull(FAKE_REPO, endpoint=_endpoint(hub), progress=False)
    finally:
        _HubHandler.do_GET = real_get
    staged = home / "models" / "hub" / "llmsys-test" / ".pull-tiny-model"
    assert (staged / "config.json").is_file() and not (home / "models" / "hub" / "llmsys-test" / "tiny-model").exists()
    with pytest.raises(ModelNotFoundError, match="not downloaded yet"):
        resolve_model(FAKE_REPO)  # a staged pull is never taken for a model
    hub.requests.clear()
    path = pull(FAKE_REPO, endpoint=_endpoint(hub), progress=False)
    assert (path / "model.safetensors").read_bytes() == weights and not staged.exists()
    got = [r for r in hub.requests if r.startswith("GET") and "/resolve/" in r]
    assert not any(r.endswith("/config.json") for r in got), got  # already complete: not fetched again


def _run_cli(argv, capsys):
    from llmsys.engine.cli.main import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_run_pulls_a_missing_repo_then_generates(home, capsys, monkeypatch):
    server = _serve_repo(ANY_REPO, _stories_repo_files())
    monkeypatch.setenv("HF_ENDPOINT", _endpoint(server))
    try:
        rc, out, err = _run_cli(["run", ANY_REPO, "--no-pull", "Once upon a time"], capsys)
        assert rc == 2 and "--no-pull was given; run `llmsys pull some-org/stories-hf` first" in err
        for cmd in (["chat", ANY_REPO, "--plain"], ["serve", ANY_REPO]):  # the same flag on every loading command
            rc, _, err = _run_cli([*cmd, "--no-pull"], capsys)
            assert rc == 2 and "--no-pull was given" in err, (cmd, err)
        assert not (home / "models" / "hub" / "some-org").exists()
        rc, out, err = _run_cli(["run", ANY_REPO, "Once upon a time", "-n", "8", "--temperature", "0"], capsys)
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 0, err
    assert "some-org/stories-hf is not downloaded: pulling it" in err
    assert len(out.strip()) > 0 and "Traceback" not in err
    # Offline now: the second run uses the pulled copy.
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_free_port()}")
    rc, out2, err = _run_cli(["run", ANY_REPO, "Once upon a time", "-n", "8", "--temperature", "0"], capsys)
    assert rc == 0 and out2 == out and "pulling" not in err


def test_run_pulls_a_missing_catalog_model(home, capsys, monkeypatch):
    src = SHARED / "models" / "stories260k"
    if not src.is_dir():
        pytest.skip(f"shared test data not found at {src}")
    entry = load_catalog()["stories260k"]
    server, _ = _start_hub({
        (entry.repo, f"{entry.subfolder}/{name}"): (src / name).read_bytes() for name in entry.files
    })
    monkeypatch.setenv("HF_ENDPOINT", _endpoint(server))
    try:
        rc, out, err = _run_cli(["run", "stories260k", "Once upon a time", "-n", "8", "--temperature", "0"], capsys)
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 0, err
    assert "stories260k is not downloaded: pulling it from karpathy/tinyllamas" in err
    assert is_downloaded(entry) and out.strip()


def test_pull_asks_first_on_a_terminal(home, hub, tiny_files, monkeypatch):
    from llmsys.engine.cli import models_cmd

    config = json.loads(tiny_files["config.json"]) | {"architectures": ["LlamaForCausalLM"]}
    hub.files[(FAKE_REPO, "config.json")] = json.dumps(config).encode()
    monkeypatch.setattr(models_cmd.sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(models_cmd.sys.stderr, "isatty", lambda: True)
    asked = []
    monkeypatch.setattr(models_cmd.typer, "confirm", lambda text, **kw: asked.append(text) or False)
    with pytest.raises(ModelNotFoundError, match=r"run `llmsys pull llmsys-test/tiny-model` when you want it"):
        models_cmd.ensure_pulled(FAKE_REPO, True, endpoint=_endpoint(hub))
    size = format_bytes(sum(len(d) for (r, _), d in hub.files.items() if r == FAKE_REPO))
    assert asked == [f"{FAKE_REPO} is not downloaded: pull {size} from {FAKE_REPO} into "
                     f"{home / 'models' / 'hub' / 'llmsys-test' / 'tiny-model'}?"]
    assert not any(r.startswith("GET") and "/resolve/" in r for r in hub.requests)  # nothing fetched


def test_catalog_entry_without_files_takes_them_from_the_listing(home):
    """A catalog entry that leaves `files` out (the large sharded repos) pulls what an org/repo pull
    would: config, tokenizer and top-level safetensors, never README, .bin or original/."""
    files = _stories_repo_files()
    server = _serve_repo(ANY_REPO, files)
    entry = dataclasses.replace(_entry([], name="listed", repo=ANY_REPO), files=None)
    try:
        path = pull(entry, endpoint=_endpoint(server), progress=False)
    finally:
        server.shutdown()
        server.server_close()
    wanted = sorted(n for n in files if n.endswith((".json", ".safetensors")))
    assert path == home / "models" / "listed"
    assert sorted(p.name for p in path.iterdir()) == sorted([*wanted, PULL_MANIFEST])
    assert is_downloaded(entry)
    assert not any("pytorch_model.bin" in r or "original/" in r for r in server.requests)
