"""One naming scheme (engine/names.py): every kind of name, "did you mean", and every command taking NAME:TAG.

The catalog is the real models.toml. Pulls run the genuine huggingface_hub code against the fake hub of
tests/test_catalog.py (a loopback HTTP server); the files it serves as ``Qwen/Qwen2.5-0.5B-Instruct`` are
the stories260k HF conversion's (exactly the five files that entry lists), so "qwen2.5:0.5b" can be pulled,
run, chatted with, served, planned and benched here without the real weights. Ollama stores are built
in tmp_path as tests/test_ollama_store.py lays them out.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from conftest import STORIES_C, STORIES_HF, need_shared
from test_catalog import _endpoint, _free_port, _start_hub
from test_ollama_store import add_model, tiny_gguf
from llmsys.engine import catalog, names
from llmsys.engine.names import NameKind
from llmsys.kernels.common.errors import LLMSysError, ModelNotFoundError

QWEN = "Qwen2.5-0.5B-Instruct"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $LLMSYS_HOME and an empty Ollama store; the hub variables cleared (as tests/test_catalog.py)."""
    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path / "home"))
    store = tmp_path / "ollama"
    (store / "manifests").mkdir(parents=True)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "home"


@pytest.fixture
def store(home) -> Path:
    return home.parent / "ollama"


def _qwen_hub():
    """A fake hub serving the stories260k HF files as the catalog's Qwen2.5-0.5B-Instruct repo."""
    src = need_shared(STORIES_HF)
    entry = catalog.load_catalog()[QWEN]
    return _start_hub({(entry.repo, name): (src / name).read_bytes() for name in entry.files})


@pytest.fixture
def pulled_qwen(home):
    """``llmsys pull qwen2.5-0.5b`` (the issue's failing command) against the fake hub."""
    server, thread = _qwen_hub()
    try:
        result = CliRunner().invoke(_models_app(), ["pull", "qwen2.5-0.5b", "--endpoint", _endpoint(server)])
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 0, result.output
    return result


def _models_app():
    import typer

    from llmsys.engine.cli.models_cmd import models_command, pull_command

    app = typer.Typer()
    app.command("models")(models_command)
    app.command("pull")(pull_command)
    return app


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    from llmsys.engine.cli.main import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


# --------------------------------------------------------------------------
# Each kind of name
# --------------------------------------------------------------------------


def test_paths_folder_gguf_and_llama2c(home, tmp_path):
    folder = names.resolve(str(need_shared(STORIES_HF)))
    assert (folder.kind, folder.name, folder.path, folder.needs_pull) == (NameKind.PATH, "stories260k-hf", STORIES_HF, False)
    assert folder.source().format.value == "hf" and folder.aliases == ()

    gguf = tmp_path / "tiny.Q8_0.gguf"
    tiny_gguf(gguf)
    found = names.resolve(str(gguf))
    assert (found.kind, found.name, found.aliases) == (NameKind.PATH, "tiny.Q8_0", ("tiny.Q8_0.gguf",))
    assert found.source().format.value == "gguf" and found.local() == gguf

    c = names.resolve(str(need_shared(STORIES_C) / "stories260K.bin"))
    assert (c.kind, c.name, c.source().format.value) == (NameKind.PATH, "stories260K", "llama2c")
    assert names.resolve(str(STORIES_C)).source().format.value == "llama2c"  # a folder holding one


@pytest.mark.parametrize("typed, shown", [
    ("Qwen2.5-0.5B-Instruct", QWEN), ("qwen2.5-0.5b-instruct", QWEN),  # the catalog name, any case
    ("qwen2.5:0.5b", "qwen2.5:0.5b"), ("QWEN2.5:0.5B", "qwen2.5:0.5b"),  # its Ollama name
    ("qwen2.5-0.5b", "qwen2.5-0.5b"),  # the same with '-': a catalog alias, not the synthetic shape
])
def test_catalog_names_and_aliases_mean_one_entry(home, typed, shown):
    found = names.resolve(typed)
    assert found.kind is NameKind.CATALOG and found.entry.name == QWEN and found.name == shown
    assert found.needs_pull and found.path == home / "models" / QWEN and found.shape == "qwen2.5-0.5b"
    assert set(found.aliases) | {found.name} == {QWEN, "qwen2.5:0.5b", "qwen2.5-0.5b"}
    d = found.download()
    assert (d.repo, d.dest, d.name) == ("Qwen/Qwen2.5-0.5B-Instruct", home / "models" / QWEN, shown)
    with pytest.raises(ModelNotFoundError, match=rf"^model {QWEN} is not downloaded yet; run `llmsys pull {shown}`"):
        found.local()


def test_plain_name_is_its_latest_tag(home):
    found = names.resolve("qwen2.5")  # Ollama's qwen2.5 is qwen2.5:latest, the 7B
    assert found.entry.name == "Qwen2.5-7B-Instruct" and "qwen2.5:latest" in found.aliases


def test_shape_resolves_and_loading_it_is_refused(home):
    found = names.resolve("llama-8b")
    assert (found.kind, found.name, found.path, found.needs_pull) == (NameKind.SHAPE, "llama-8b", None, False)
    with pytest.raises(ModelNotFoundError) as info:
        found.local()
    message = str(info.value)
    assert "synthetic benchmark shape" in message and "`llmsys bench --synthetic llama-8b`" in message
    assert "the model itself is Llama-3.1-8B-Instruct" in message and "\n" not in message


def test_hub_repo(home):
    found = names.resolve("some-org/some-model@v2")
    assert (found.kind, found.name, found.needs_pull) == (NameKind.HUB, "some-org/some-model@v2", True)
    assert found.path == home / "models" / "hub" / "some-org" / "some-model@v2"
    assert found.download().revision == "v2"


def test_ollama_names_prefixed_and_bare(home, store):
    add_model(store, "mymodel:q4")
    add_model(store, "other")  # tag latest
    explicit = names.resolve("ollama:mymodel:q4")
    bare = names.resolve("mymodel:q4")  # no catalog entry: the store has it
    for found in (explicit, bare):
        assert (found.kind, found.name, found.aliases) == (NameKind.OLLAMA, "mymodel:q4", ("ollama:mymodel:q4",))
        assert found.path == found.ollama.blob and not found.needs_pull
    latest = names.resolve("other")
    assert latest.name == "other:latest" and set(latest.aliases) == {"ollama:other:latest", "other"}


def test_ollama_name_of_a_catalog_model_prefers_a_copy_on_disk(home, store):
    """qwen2.5:0.5b: Ollama's copy when the catalog's is not downloaded (no second download); the
    catalog's once it is; the catalog's own name never goes to the store."""
    add_model(store, "qwen2.5:0.5b")
    found = names.resolve("qwen2.5:0.5b")
    assert found.kind is NameKind.OLLAMA and found.name == "qwen2.5:0.5b"
    assert {QWEN, "qwen2.5-0.5b", "ollama:qwen2.5:0.5b"} <= set(found.aliases)
    assert names.resolve(QWEN).kind is NameKind.CATALOG
    assert names.resolve("qwen2.5-0.5b").kind is NameKind.CATALOG
    entry = catalog.load_catalog()[QWEN]
    dest = catalog.local_path(entry)
    dest.mkdir(parents=True)
    for name in entry.files:  # placed by hand: complete without a pull manifest
        (dest / name).write_bytes((need_shared(STORIES_HF) / name).read_bytes())
    found = names.resolve("qwen2.5:0.5b")
    assert found.kind is NameKind.CATALOG and found.local() == dest


# --------------------------------------------------------------------------
# Did you mean
# --------------------------------------------------------------------------


def test_near_misses_get_one_line_with_what_was_tried(home, store, tmp_path):
    add_model(store, "mymodel:q4")
    with pytest.raises(ModelNotFoundError) as info:
        names.resolve("qwen2.5:0.6b")
    message = str(info.value)
    assert message.startswith("no model named qwen2.5:0.6b: not a file or directory, a models.toml name or alias")
    assert f"not in the Ollama store {store}" in message and "\n" not in message
    # One suggestion per model: never qwen2.5:0.5b and qwen2.5-0.5b (the same entry) side by side.
    assert message.endswith("; did you mean qwen2.5:0.5b or qwen2.5:1.5b or qwen3:0.6b?"), message
    with pytest.raises(ModelNotFoundError, match=r"did you mean mymodel:q4\?$"):
        names.resolve("mymodle:q4")
    with pytest.raises(ModelNotFoundError, match=r"did you mean llama-8b"):
        names.resolve("lama-8b")
    (tmp_path / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match=rf"^no such file or directory: {tmp_path}/SmolLM2.Q4_0.gguf; "
                                                 rf"did you mean SmolLM2.Q4_1.gguf \(in {tmp_path}\)\?$"):
        names.resolve(str(tmp_path / "SmolLM2.Q4_0.gguf"))
    with pytest.raises(ModelNotFoundError) as info:
        names.resolve("zzzz-nothing-like-it")
    assert "did you mean" not in str(info.value)


def test_no_store_is_named_in_the_error(home, monkeypatch, tmp_path):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match=rf"and no Ollama store at {tmp_path}/nowhere; did you mean mistral:7b"):
        names.resolve("mistral:7bb")


# --------------------------------------------------------------------------
# The catalog's names
# --------------------------------------------------------------------------


def test_every_alias_and_shape_is_sound():
    entries = catalog.load_catalog()
    shapes = catalog.synthetic_configs()
    seen: dict[str, str] = {}
    for entry in entries.values():
        for name in catalog.names_of(entry):
            assert seen.setdefault(name.lower(), entry.name) == entry.name, name
        if entry.shape is not None:  # the shape plans the model: the same architecture
            assert shapes[entry.shape]["architectures"][0] == entry.architecture, entry.name
    for name in ("qwen2.5:0.5b", "qwen2.5-0.5b", "smollm2:135m", "llama3.2:1b", "qwen3:0.6b", "gpt-oss:20b"):
        assert name in seen, name


def test_bad_aliases_and_shapes_are_refused(tmp_path):
    base = ('["{name}"]\nrepo = "a/b"\narchitecture = "LlamaForCausalLM"\nparams = "1M"\nsize_bytes = 1\n'
            'licence = "mit"\ndefault_dtype = "float32"\nchat = true\ndescription = "x"\n')
    bad = tmp_path / "models.toml"
    bad.write_text(base.format(name="one") + 'aliases = ["m:1b"]\n' + base.format(name="two") + 'aliases = ["m-1b"]\n')
    with pytest.raises(LLMSysError, match=r"the name 'm-1b' means both \[one\] and \[two\]"):
        catalog.load_catalog(bad)
    bad.write_text(base.format(name="one") + 'shape = "nope"\n')
    with pytest.raises(LLMSysError, match=r"entry \[one\]: shape 'nope' is not a \[synthetic.\*\] table"):
        catalog.load_catalog(bad)
    bad.write_text(base.format(name="one") + 'aliases = ["a b"]\n')
    with pytest.raises(LLMSysError, match=r"'aliases' must be names like qwen2.5:0.5b"):
        catalog.load_catalog(bad)


# --------------------------------------------------------------------------
# Every command
# --------------------------------------------------------------------------


def test_pull_a_catalog_alias_from_a_local_hub(home, pulled_qwen):
    dest = home / "models" / QWEN
    assert "qwen2.5-0.5b downloaded to " + str(dest) in pulled_qwen.stdout
    for name in catalog.load_catalog()[QWEN].files:
        assert (dest / name).read_bytes() == (STORIES_HF / name).read_bytes(), name
    # Every spelling now finds the one copy, offline.
    for typed in ("qwen2.5:0.5b", QWEN, "qwen2.5-0.5b"):
        result = CliRunner().invoke(_models_app(), ["pull", typed, "--endpoint", f"http://127.0.0.1:{_free_port()}"])
        assert result.exit_code == 0 and f"is already downloaded: {dest}" in result.stdout, result.output
        assert names.resolve(typed).local() == dest
    result = CliRunner().invoke(_models_app(), ["models", "qwen2.5:0.5b"])
    assert result.stdout.startswith(f"qwen2.5:0.5b: catalog model {QWEN} (also qwen2.5-0.5b)")
    assert f"on disk at {dest}" in result.stdout


def test_pull_of_what_needs_no_download(home, store):
    add_model(store, "mymodel:q4")
    result = CliRunner().invoke(_models_app(), ["pull", "mymodel:q4"])
    assert result.exit_code == 0 and result.stdout.startswith("nothing to pull: mymodel:q4: in the Ollama store")
    result = CliRunner().invoke(_models_app(), ["pull", "llama-8b"])
    assert isinstance(result.exception, ModelNotFoundError) and "synthetic benchmark shape" in str(result.exception)
    result = CliRunner().invoke(_models_app(), ["pull", "qwen2.5:0.6b"])
    assert "did you mean qwen2.5:0.5b" in str(result.exception)


def test_run_and_chat_take_name_tag(home, pulled_qwen, capsys, monkeypatch):
    gen = ["-n", "8", "--temperature", "0", "--dtype", "float32", "--threads", "1"]
    rc, by_path, err = _main(["run", str(STORIES_HF), "Once upon a time", *gen], capsys)
    assert rc == 0 and by_path.strip(), err
    for typed in ("qwen2.5:0.5b", "qwen2.5-0.5b", QWEN):
        rc, out, err = _main(["run", typed, "Once upon a time", *gen], capsys)
        assert rc == 0 and out == by_path and "pulling" not in err, (typed, err)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time\n"))
    rc, out, err = _main(["chat", "qwen2.5:0.5b", "--plain", *gen], capsys)
    assert rc == 0 and by_path.strip() in out, (out, err)


def test_loading_commands_refuse_unknown_and_unpulled_names_in_one_line(home, capsys):
    for cmd in (["run", "qwen2.5:0.6b", "hi"], ["chat", "qwen2.5:0.6b", "--plain"], ["serve", "qwen2.5:0.6b"],
                ["plan", "qwen2.5:0.6b"], ["bench", "qwen2.5:0.6b"], ["pull", "qwen2.5:0.6b"]):
        rc, _, err = _main(cmd, capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: no model named qwen2.5:0.6b"), (cmd, err)
        assert lines[0].endswith("did you mean qwen2.5:0.5b or qwen2.5:1.5b or qwen3:0.6b?"), (cmd, err)
    for cmd in (["run", "qwen2.5:0.5b", "hi"], ["chat", "qwen2.5:0.5b", "--plain"], ["serve", "qwen2.5:0.5b"],
                ["bench", "qwen2.5:0.5b"]):
        rc, _, err = _main([*cmd, "--no-pull"], capsys)
        assert rc == 2 and "qwen2.5:0.5b is not downloaded and --no-pull was given; run `llmsys pull qwen2.5:0.5b`" in err
    for cmd in (["run", "llama-8b", "hi"], ["chat", "llama-8b", "--plain"], ["serve", "llama-8b"], ["pull", "llama-8b"]):
        rc, out, err = _main(cmd, capsys)  # refused before anything starts (serve: no HTTP server)
        assert rc == 2 and not out and len(err.strip().splitlines()) == 1, (cmd, out, err)
        assert err.startswith("error: llama-8b is a synthetic benchmark shape"), (cmd, err)


def test_plan_takes_name_tag_before_and_after_the_pull(home, capsys):
    rc, before, err = _main(["plan", "qwen2.5:0.5b", "--dtype", "bfloat16"], capsys)
    assert rc == 0, err
    assert before.startswith("qwen2.5:0.5b (not downloaded: its shape, models.toml [synthetic.qwen2.5-0.5b]): 24 layers")
    rc, shape, _ = _main(["plan", "llama-1b", "--dtype", "bfloat16"], capsys)
    assert rc == 0 and shape.startswith("synthetic:llama-1b: 16 layers")
    rc, _, err = _main(["plan", "qwen3:0.6b"], capsys)  # no shape in models.toml: the pull hint
    assert rc == 2 and "model Qwen3-0.6B is not downloaded yet; run `llmsys pull qwen3:0.6b`" in err


def test_plan_reads_the_pulled_config(home, pulled_qwen, capsys):
    rc, out, err = _main(["plan", "qwen2.5:0.5b", "--dtype", "float32"], capsys)
    stories = json.loads((STORIES_HF / "config.json").read_text())["num_hidden_layers"]
    assert rc == 0 and out.startswith(f"qwen2.5:0.5b ({home / 'models' / QWEN}): {stories} layers"), (out, err)


def test_bench_takes_name_tag_and_shape_names(home, pulled_qwen, monkeypatch, capsys):
    from llmsys.engine.bench import suite, synthetic
    from llmsys.engine.bench.report import BenchResult

    seen = []
    monkeypatch.setattr(suite, "run_bench", lambda spec, machine, progress=None, log=None:
                        seen.append(spec) or BenchResult(machine=machine, rows=[], spec=spec))
    monkeypatch.setattr(synthetic, "make_synthetic", lambda name, seed=0, **kw: STORIES_HF)  # no 1B weights
    from llmsys.offload import bandwidth
    from test_bench_checks import TINY_PROBE

    monkeypatch.setattr(bandwidth, "DEFAULT_PROBE", TINY_PROBE)
    rc, _, err = _main(["bench", "qwen2.5:0.5b", "-p", "8", "-n", "4", "-r", "1", "-o", "json"], capsys)
    assert rc == 0 and seen[-1].model == "qwen2.5:0.5b" and seen[-1].synthetic is None, err
    rc, _, err = _main(["bench", "llama-1b", "-p", "8", "-n", "4", "-r", "1", "-o", "json"], capsys)
    assert rc == 0 and seen[-1].synthetic == "llama-1b", err  # a shape's name is --synthetic NAME


def test_bench_measures_a_name_tag(home, pulled_qwen, monkeypatch, capsys):
    from llmsys.offload import bandwidth
    from test_bench_checks import TINY_PROBE

    monkeypatch.setattr(bandwidth, "DEFAULT_PROBE", TINY_PROBE)
    rc, out, err = _main(["bench", "qwen2.5:0.5b", "-p", "8", "-n", "4", "-r", "1", "--dtype", "float32", "--no-e2e",
                          "--no-warmup", "-o", "jsonl"], capsys)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rc == 0 and rows and all(not r.get("error") for r in rows), (out, err)


def test_server_id_is_the_given_name_and_aliases_are_accepted(home, pulled_qwen):
    from llmsys.engine.config import EngineConfig
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings())
    state.load(EngineConfig(model="qwen2.5:0.5b", dtype="float32", threads=1, max_model_len=256))
    srv = start_server_thread(state)
    try:
        ids = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
        assert ids == ["qwen2.5:0.5b"]
        assert [m["name"] for m in httpx.get(srv.url + "/api/tags").json()["models"]] == ["qwen2.5:0.5b"]
        for name in ("qwen2.5:0.5b", QWEN, "qwen2.5-0.5b", None):
            body = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0} | ({"model": name} if name else {})
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == "qwen2.5:0.5b", (name, r.text)
        r = httpx.post(srv.url + "/api/generate", json={"model": QWEN, "prompt": "Once", "stream": False,
                                                         "options": {"num_predict": 2}}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/v1/completions", json={"model": "qwen2.5:1.5b", "prompt": "x"}, timeout=60)
        assert r.status_code == 404 and "qwen2.5:0.5b" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_server_id_of_a_path_is_its_stem(home, tmp_path):
    from llmsys.engine.config import EngineConfig
    from llmsys.engine.server.state import ServerSettings, ServerState

    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tiny_gguf(gguf)
    assert names.served_names(str(gguf)) == ("SmolLM2-135M-Instruct.Q4_1", ("SmolLM2-135M-Instruct.Q4_1.gguf",))
    config = EngineConfig(model=str(need_shared(STORIES_HF)), dtype="float32", threads=1, max_model_len=256)
    state = ServerState(ServerSettings())
    state.load(config)
    state.close()
    assert state.model_name == "stories260k-hf" and str(STORIES_HF) not in state.model_names()  # no local path shown
    state = ServerState(ServerSettings(model_name="mine", model_aliases=("gpt-4o-mini",)))  # --served-model-name
    state.load(config)
    state.close()
    assert state.model_names() == {"mine", "mine:latest", "stories260k-hf", "gpt-4o-mini"}


def test_bare_name_tag_runs_from_the_ollama_store_as_ollama_prefix_does(home, store, tmp_path, capsys):
    """A NAME:TAG only Ollama has runs in place, with its manifest's stop strings, exactly as ollama:NAME:TAG."""
    from llmsys.engine.bench.gguf_export import export_float

    exported = export_float(need_shared(STORIES_HF), tmp_path / "stories.gguf", "f32")
    add_model(store, "stories:260k", Path(exported).read_bytes(), params={"stop": [" girl"]})
    gen = ["Once upon a time", "-n", "16", "--temperature", "0", "--dtype", "float32", "--threads", "1"]
    rc, prefixed, err = _main(["run", "ollama:stories:260k", *gen], capsys)
    assert rc == 0, err
    rc, bare, err = _main(["run", "stories:260k", *gen], capsys)
    assert rc == 0 and bare == prefixed, err
    assert bare.startswith(", there was a little") and "girl" not in bare  # the params layer's stop string applied
