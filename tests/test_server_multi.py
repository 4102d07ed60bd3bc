"""One server, several models on demand (engine/server/models.py): load on first use, keep_alive,
LRU eviction within a memory budget, /api/ps and /api/tags, concurrent streams to two models.

A real ``llmsys serve`` process started with no model serves three small ones that requests name by
path: the SmolLM2 GGUF (chat), stories260k-hf (base) and a tiny random Llama made here; the official
``ollama`` and ``openai`` clients talk to it. The budget cases run an in-process server whose budget is
set from the loaded models' true sizes, so "two fit, three do not" holds on any machine.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest

from conftest import SHARED, STORIES_HF, need_shared

ollama = pytest.importorskip("ollama", reason="pip install ollama (test dependency)")
openai = pytest.importorskip("openai", reason="pip install openai (test dependency)")

SMOL = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_random(dest: Path, seed: int = 0, hidden: int = 64) -> Path:
    """A random 2-layer Llama with stories260k's tokenizer: a third small model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = need_shared(STORIES_HF)
    cfg = LlamaConfig.from_pretrained(src)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = hidden, 172, 2
    cfg.num_attention_heads = cfg.num_key_value_heads = 4
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(dest, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(f, dest / f.name)
    return dest


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """``llmsys serve`` with no model, keep_alive 10m; its log in a file."""
    need_shared(STORIES_HF)
    need_shared(SMOL)
    from test_ollama_store import add_model, tiny_gguf

    from llmsys.engine.server.serve import wait_until_healthy

    tmp = tmp_path_factory.mktemp("multi")
    tiny = tiny_random(tmp / "tiny-random")
    store = tmp / "ollama"
    (store / "manifests").mkdir(parents=True)
    add_model(store, "storelisted:q4", weights=tiny_gguf(tmp / "w.gguf"))
    env = dict(os.environ, LLMSYS_HOME=str(tmp / "home"), OLLAMA_MODELS=str(store), LLMSYS_KEEP_ALIVE="10m")
    port = _free_port()
    log_path = tmp / "serve.log"
    with open(log_path, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "llmsys.engine.cli.main", "serve", "--port", str(port),
                                 "--no-pull", "--dtype", "float32", "--kv-disk", "0"],
                                stdout=logf, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_healthy(url, proc, timeout_s=120), log_path.read_text()
        yield {"url": url, "log": log_path, "tiny": tiny, "proc": proc,
               "ollama": ollama.Client(host=url, timeout=120),
               "openai": openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)}
    finally:
        proc.terminate()
        proc.wait(30)


def _ps(live) -> dict[str, dict]:
    return {m["model"]: m for m in httpx.get(live["url"] + "/api/ps", timeout=30).json()["models"]}


def _log(live) -> str:
    return live["log"].read_text()


def test_list_chat_a_b_a_keep_alive_0(live):
    client, oai = live["ollama"], live["openai"]
    tags = [m.model for m in client.list().models]
    assert "storelisted:q4" in tags  # the Ollama store's models are listed before any load
    assert _ps(live) == {}

    a = client.chat(model=str(SMOL), messages=[{"role": "user", "content": "Say hi."}],
                    options={"num_predict": 8, "temperature": 0})
    assert a.message.content and a.done
    b = oai.completions.create(model=str(STORIES_HF), prompt="Once upon a time", max_tokens=8, temperature=0)
    assert b.choices[0].text and b.model == "stories260k-hf"
    a2 = client.chat(model=str(SMOL), messages=[{"role": "user", "content": "Say hi."}],
                     options={"num_predict": 8, "temperature": 0})
    assert a2.message.content == a.message.content
    assert a.load_duration > 0 and a2.load_duration == 0  # Ollama's field: the first request waited for the load

    ps = _ps(live)
    assert set(ps) == {"SmolLM2-135M-Instruct.Q4_1:latest", "stories260k-hf:latest"}, ps
    smol = ps["SmolLM2-135M-Instruct.Q4_1:latest"]
    assert smol["loads"] == 1  # A was not loaded again
    assert smol["size"] > SMOL.stat().st_size * 0.8 and smol["size_vram"] == 0
    assert smol["expires_at"] > time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() + 9 * 60))  # ~10 minutes
    assert _log(live).count("loaded SmolLM2-135M-Instruct.Q4_1 in") == 1
    listed = {m.id for m in oai.models.list().data}
    assert {"SmolLM2-135M-Instruct.Q4_1", "stories260k-hf", "storelisted:q4"} <= listed

    # keep_alive 0 on an empty request unloads (Ollama's `ollama stop`), the log says why
    r = client.generate(model=str(STORIES_HF), prompt="", keep_alive=0)
    assert r.done_reason == "unload"
    deadline = time.monotonic() + 10
    while "stories260k-hf:latest" in _ps(live) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(_ps(live)) == {"SmolLM2-135M-Instruct.Q4_1:latest"}
    assert "unloading stories260k-hf" in _log(live)

    # keep_alive 0 on a real request: answered, then unloaded; an empty request with keep_alive loads
    r = client.generate(model=str(live["tiny"]), prompt="", keep_alive="1m")
    assert r.done_reason == "load" and "tiny-random:latest" in _ps(live) and r.load_duration > 0
    out = client.generate(model=str(live["tiny"]), prompt="Once", options={"num_predict": 4}, keep_alive=0)
    assert out.done
    deadline = time.monotonic() + 10
    while "tiny-random:latest" in _ps(live) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "tiny-random:latest" not in _ps(live)


def test_unknown_model_is_404_and_health_stays_up(live):
    with pytest.raises(ollama.ResponseError) as e:
        live["ollama"].chat(model="no-such-model:7b", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and "not found" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        live["openai"].completions.create(model="/no/such/dir", prompt="x", max_tokens=1)
    assert httpx.get(live["url"] + "/health", timeout=10).status_code == 200


def test_two_models_stream_concurrently(live):
    """Streams to two models interleave: each model has its own engine thread."""
    client = live["ollama"]
    for m in (str(STORIES_HF), str(live["tiny"])):  # loaded first, so the streams time decoding only
        client.generate(model=m, prompt="", keep_alive="5m")
    times: dict[str, list[float]] = {}

    def stream(model: str) -> None:
        got = times.setdefault(model, [])
        for _ in client.generate(model=model, prompt="Once upon a time", stream=True,
                                 options={"num_predict": 48, "temperature": 0}):
            got.append(time.monotonic())

    threads = [threading.Thread(target=stream, args=(m,)) for m in (str(STORIES_HF), str(live["tiny"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    a, b = times.values()
    assert len(a) > 10 and len(b) > 10
    # interleaved: each stream had chunks before the other's last and after the other's first
    assert a[0] < b[-1] and b[0] < a[-1]
    mid_a = [t for t in a if b[0] < t < b[-1]]
    mid_b = [t for t in b if a[0] < t < a[-1]]
    assert mid_a or mid_b


def test_pull_and_delete(live, tmp_path):
    """/api/pull of what is on disk already succeeds at once; /api/delete refuses what it did not pull."""
    url = live["url"]
    lines = [json.loads(x) for x in httpx.post(url + "/api/pull", json={"model": "storelisted:q4"},
                                               timeout=30).text.splitlines()]
    assert lines[0]["status"] == "pulling manifest" and lines[-1] == {"status": "success"}
    r = httpx.post(url + "/api/pull", json={"model": "no-such-model-xyz"}, timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.request("DELETE", url + "/api/delete", json={"model": str(STORIES_HF)}, timeout=30)
    assert r.status_code == 400 and "not_deletable" in r.text
    assert STORIES_HF.exists()


# -- the budget: in-process, sized from the models' true resident bytes ------------------------------


@pytest.fixture
def budget_server(tmp_path):
    need_shared(STORIES_HF)
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    models = [str(STORIES_HF), str(tiny_random(tmp_path / "tiny-a", 1)), str(tiny_random(tmp_path / "tiny-b", 2, 96))]
    state = ServerState(ServerSettings(), budget=None, keep_alive_s=None)
    state.mark_started()
    srv = start_server_thread(state)
    yield state, srv, models
    srv.stop()


def _complete(srv, model: str) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "Once", "max_tokens": 2},
                      timeout=120)


def test_lru_idle_model_unloaded_to_fit(budget_server, caplog):
    state, srv, (a, b, c) = budget_server
    from llmsys.engine.server.models import estimate_bytes

    assert _complete(srv, a).status_code == 200
    assert _complete(srv, b).status_code == 200
    time.sleep(0.6)  # a tick: the workers' memory reports are in
    slots = {s.name: s for s in state.models.loaded()}
    held = sum(s.resident() for s in slots.values())
    from llmsys.engine import names

    found = names.resolve(c)
    need = estimate_bytes(state._model_config(c), found)
    state.models.budget = held + need - 1  # a and b fit; c does not beside both
    assert _complete(srv, a).status_code == 200  # a used last: b is the least recently used
    b_slot = state.models.find(b)
    b_llm = weakref.ref(b_slot.llm)
    with caplog.at_level(logging.INFO, logger="llmsys.server"):
        assert _complete(srv, c).status_code == 200
    names_loaded = {s.name for s in state.models.loaded()}
    assert names_loaded == {"stories260k-hf", "tiny-b"}, names_loaded
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("unloading tiny-a"))
    assert " MiB, idle " in line and "to fit tiny-b (" in line
    gc.collect()
    assert b_llm() is None  # the unloaded engine is gone, not merely forgotten


def test_busy_models_make_a_503_naming_sizes(budget_server):
    state, srv, (a, b, c) = budget_server
    assert _complete(srv, a).status_code == 200
    assert _complete(srv, b).status_code == 200
    time.sleep(0.6)
    state.models.budget = sum(s.resident() for s in state.models.loaded()) + 1024
    held = [state.models.acquire(a), state.models.acquire(b)]  # both busy (a request in flight each)
    try:
        r = _complete(srv, c)
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "tiny-b needs ~" in msg and "budget" in msg and "stories260k-hf (" in msg and "busy" in msg
    finally:
        for s in held:
            state.models.release(s)
    assert _complete(srv, c).status_code == 200  # idle again: the LRU one makes room


def test_concurrent_first_requests_share_one_load(budget_server):
    state, srv, (a, _, _) = budget_server
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(_complete(srv, a).status_code)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [200, 200, 200]
    assert state.models.load_count(a) == 1


def test_keep_alive_parsing():
    from llmsys.engine.server.models import parse_keep_alive
    from llmsys.kernels.common.errors import InvalidParameterError

    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive(30) == 30
    assert parse_keep_alive("300") == 300 and parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None
    with pytest.raises(InvalidParameterError, match="not a duration"):
        parse_keep_alive("5 minutes")


def test_pull_load_and_delete_through_a_local_hub(tmp_path, monkeypatch):
    """/api/pull of a catalog alias from a fake hub streams Ollama's progress, the model is then listed and
    loads on first use; /api/delete unloads it and removes its folder from $LLMSYS_HOME."""
    from test_catalog import _endpoint
    from test_names import QWEN, _qwen_hub

    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    monkeypatch.setenv("LLMSYS_HOME", str(tmp_path / "home"))
    (tmp_path / "ollama" / "manifests").mkdir(parents=True)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub, _ = _qwen_hub()
    monkeypatch.setenv("HF_ENDPOINT", _endpoint(hub))
    state = ServerState(ServerSettings(), keep_alive_s=None)
    state.mark_started()
    srv = start_server_thread(state)
    try:
        client = ollama.Client(host=srv.url, timeout=60)
        progress = list(client.pull("qwen2.5:0.5b", stream=True))
        assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
        sized = [p for p in progress if p.total]
        assert sized and sized[-1].completed == sized[-1].total > 0 and sized[-1].digest.startswith("sha256:")
        dest = tmp_path / "home" / "models" / QWEN
        assert dest.is_dir()
        assert QWEN in {m.model.removesuffix(":latest") for m in client.list().models}
        out = client.generate(model="qwen2.5:0.5b", prompt="Once", raw=True, options={"num_predict": 2})
        assert out.done and "qwen2.5:0.5b" in {m.model for m in client.ps().models}
        client.delete("qwen2.5:0.5b")
        assert not dest.exists() and client.ps().models == []
    finally:
        srv.stop()
        hub.shutdown()
        hub.server_close()


def test_request_without_keep_alive_resets_to_the_default():
    """Ollama's rule: a request that gives no keep_alive puts the model back on the server's default, so an
    earlier ``-1`` or ``1h`` does not outlive its request; a model given at start stays until one sets it."""
    from types import SimpleNamespace

    from llmsys.engine.server.models import ModelRegistry, RegistryHooks

    reg = ModelRegistry(RegistryHooks(None, None), budget=None, keep_alive_s=300.0)  # type: ignore[arg-type]
    slot = reg.adopt(SimpleNamespace(), None, "m")  # given at start: kept for ever
    reg.release(reg.acquire("m"))
    assert slot.keep_alive_s is None  # no request set one yet
    reg.release(reg.acquire("m", None))  # keep_alive -1
    assert slot.keep_alive_s is None
    reg.release(reg.acquire("m"))  # none given: the default again, not the -1
    assert slot.keep_alive_s == 300.0
    reg.release(reg.acquire("m", 3600.0))
    assert slot.keep_alive_s == 3600.0 and slot.expires_at() > time.time() + 3000
    reg.release(reg.acquire("m"))
    assert slot.keep_alive_s == 300.0 and slot.expires_at() < time.time() + 301
