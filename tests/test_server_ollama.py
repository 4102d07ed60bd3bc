"""``llmsys serve``: Ollama's API (engine/server/ollama.py), driven by the official ``ollama`` client.

Servers run in-process on free loopback ports, serving stories260k-hf in float32 (one
with a chat template, one base model behind an API key); the reference outputs come
from a separate ``LLM`` instance on the same rendered prompts.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import STORIES_HF, need_shared

ollama = pytest.importorskip("ollama", reason="pip install ollama (test dependency)")

from test_server import KEY, PROMPT, _chat_model, _metrics, _wait_idle

MSGS = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat and a dog"}]
GREEDY = {"temperature": 0, "num_predict": 40}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Server A: chat-capable copy, open. Server B: base model (no chat template), API key. Plus a reference LLM."""
    need_shared(STORIES_HF)
    import torch
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    torch.set_num_threads(2)
    chat_dir = _chat_model(tmp_path_factory.mktemp("m"))
    a = ServerState(ServerSettings())
    a.attach(LLM(str(chat_dir), dtype="float32"), "stories-chat")
    b = ServerState(ServerSettings(api_key=KEY))
    b.attach(LLM(str(STORIES_HF), dtype="float32", max_model_len=128), "stories")
    sa, sb = start_server_thread(a), start_server_thread(b)
    ref = LLM(str(chat_dir), dtype="float32")
    yield {"a": sa, "b": sb, "ref": ref, "client": ollama.Client(host=sa.url, timeout=60)}
    sa.stop()
    sb.stop()


def _ref(env, prompt, **sp):
    from llmsys import SamplingParams

    return env["ref"].generate(prompt if isinstance(prompt, str) else [prompt], SamplingParams(**sp))[0]


def _chat_ids(env, msgs):
    return env["ref"].tokenizer.encode_chat(msgs)


def _post(srv, path, body, **headers):
    return httpx.post(srv.url + path, content=json.dumps(body), headers={"content-type": "application/json",
                                                                           **headers}, timeout=60)


# -- greedy equality: streamed == one object == LLM.generate ------------------------------


def test_chat_stream_and_not_equal_generate(env):
    c = env["client"]
    ref = _ref(env, _chat_ids(env, MSGS), temperature=0, max_tokens=40)
    r = c.chat("stories-chat", MSGS, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == ref.text
    assert r.done and r.done_reason == ref.finish_reason
    assert r.prompt_eval_count == len(ref.prompt_token_ids) and r.eval_count == len(ref.token_ids)
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration > 0 and r.load_duration == 0
    parts = list(c.chat("stories-chat:latest", MSGS, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].message.content == ""
    assert "".join(p.message.content for p in parts) == ref.text
    assert parts[-1].eval_count == len(ref.token_ids) and parts[-1].done_reason == ref.finish_reason


def test_generate_templated_raw_and_context(env):
    c = env["client"]
    tok = env["ref"].tokenizer
    ids = _chat_ids(env, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}])
    ref = _ref(env, ids, temperature=0, max_tokens=30)
    r = c.generate("stories-chat", PROMPT, system="Be brief.", options={"temperature": 0, "num_predict": 30})
    assert r.response == ref.text and r.prompt_eval_count == len(ids)
    assert list(r.context) == ids + ref.token_ids  # the conversation so far, as token ids
    streamed = list(c.generate("stories-chat", PROMPT, system="Be brief.", stream=True,
                               options={"temperature": 0, "num_predict": 30}))
    assert "".join(p.response for p in streamed) == ref.text and list(streamed[-1].context) == list(r.context)
    # context round trip: the next turn's template after the returned ids (its BOS dropped)
    nxt = _chat_ids(env, [{"role": "user", "content": "And then?"}])
    assert nxt[0] == tok.bos_token_id
    ref2 = _ref(env, list(r.context) + nxt[1:], temperature=0, max_tokens=20)
    r2 = c.generate("stories-chat", "And then?", context=r.context, options={"temperature": 0, "num_predict": 20})
    assert r2.response == ref2.text and list(r2.context) == list(r.context) + nxt[1:] + ref2.token_ids
    # raw: the prompt as it is (BOS added, no template), and no context back (as Ollama)
    raw_ref = _ref(env, PROMPT, temperature=0, max_tokens=30)
    raw = c.generate("stories-chat", PROMPT, raw=True, options={"temperature": 0, "num_predict": 30})
    assert raw.response == raw_ref.text and raw.context is None
    assert raw.prompt_eval_count == len(raw_ref.prompt_token_ids)


def test_ndjson_one_object_per_line(env):
    body = {"model": "stories-chat", "prompt": PROMPT, "options": {"temperature": 0, "num_predict": 12}}
    with httpx.stream("POST", env["a"].url + "/api/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [ln for ln in r.iter_lines()]
    objs = [json.loads(ln) for ln in lines]  # each line alone is one JSON object
    assert len(objs) >= 2 and all(isinstance(o, dict) for o in objs)
    assert [o["done"] for o in objs] == [False] * (len(objs) - 1) + [True]
    last = objs[-1]
    for k in ("done_reason", "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
              "eval_count", "eval_duration", "context", "created_at", "model"):
        assert k in last, k
    assert last["eval_count"] == 12 and last["done_reason"] == "length"
    one = _post(env["a"], "/api/generate", {**body, "stream": False})
    assert one.headers["content-type"].startswith("application/json") and one.json()["done"] is True
    assert one.json()["response"] == "".join(o["response"] for o in objs)
    # curl -d (Ollama's own docs) sends a form content type: the body is JSON all the same
    form = httpx.post(env["a"].url + "/api/generate", content=json.dumps({**body, "stream": False}), timeout=60,
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 200 and form.json()["response"] == one.json()["response"]


# -- options ----------------------------------------------------------------------------


def test_options_mapping(env):
    c = env["client"]
    ids = _chat_ids(env, MSGS)
    # num_predict is max_tokens
    r = c.chat("stories-chat", MSGS, options={"temperature": 0, "num_predict": 7})
    assert r.eval_count == 7 and r.done_reason == "length"
    # seed: reproducible at temperature 1, with Ollama's default top_k 40 / top_p 0.9 when not given
    opts = {"temperature": 1.0, "seed": 1234, "num_predict": 24}
    a, b = (c.chat("stories-chat", MSGS, options=opts).message.content for _ in range(2))
    ref = _ref(env, ids, temperature=1.0, seed=1234, top_k=40, top_p=0.9, max_tokens=24)
    assert a == b == ref.text
    other = c.chat("stories-chat", MSGS, options={**opts, "seed": 99}).message.content
    assert other == _ref(env, ids, temperature=1.0, seed=99, top_k=40, top_p=0.9, max_tokens=24).text
    # the rest of the sampling options, one request
    full = {"temperature": 0.7, "seed": 5, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "repeat_penalty": 1.3,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "num_predict": 30, "stop": ["."],
            "repeat_last_n": -1, "mirostat": 0, "typical_p": 1.0, "num_ctx": 512, "num_thread": 0, "num_gpu": 0}
    ref = _ref(env, ids, temperature=0.7, seed=5, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.3,
               presence_penalty=0.5, frequency_penalty=0.25, max_tokens=30, stop=(".",))
    r = c.chat("stories-chat", MSGS, options=full)
    assert r.message.content == ref.text and r.done_reason == ref.finish_reason
    # top_p 0 is llama.cpp's "the most likely token": greedy
    assert (c.chat("stories-chat", MSGS, options={"top_p": 0, "num_predict": 20, "seed": 3}).message.content
            == _ref(env, ids, temperature=0, max_tokens=20).text)
    # num_ctx below the server's context bounds this request: the prompt must fit, generation stops at it
    n = len(ids)
    r = c.chat("stories-chat", MSGS, options={"temperature": 0, "num_ctx": n + 5})
    assert r.eval_count == 5 and r.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as e:
        c.chat("stories-chat", MSGS, options={"num_ctx": n - 1})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error


@pytest.mark.parametrize("kw,needle", [
    ({"options": {"mirostat": 2}}, "options.mirostat"),
    ({"options": {"num_ctx": 100000}}, "options.num_ctx"),
    ({"options": {"num_gpu": 8}}, "options.num_gpu"),
    ({"options": {"num_thread": 999}}, "options.num_thread"),
    ({"options": {"typical_p": 0.5}}, "options.typical_p"),
    ({"options": {"tfs_z": 0.9}}, "options.tfs_z"),
    ({"options": {"use_mlock": True}}, "options.use_mlock"),
    ({"options": {"repeat_last_n": 64, "repeat_penalty": 1.2}}, "options.repeat_last_n"),
    ({"options": {"penalize_newline": False, "repeat_penalty": 1.2}}, "options.penalize_newline"),
    ({"options": {"no_such_option": 1}}, "no_such_option"),
    ({"options": {"temperature": -1}}, "options.temperature"),
    ({"think": True}, "think"),
    ({"suffix": "the end"}, "suffix"),
    ({"template": "{{ .Prompt }}"}, "template"),
    ({"images": ["aGVsbG8="]}, "images"),
    ({"raw": True, "system": "x"}, "system"),
])
def test_what_cannot_be_honoured_is_400(env, kw, needle):
    with pytest.raises(ollama.ResponseError) as e:
        env["client"].generate("stories-chat", PROMPT, **kw)
    assert e.value.status_code == 400 and needle in e.value.error


def test_format_json_and_schema(env):
    """``format`` goes through the same grammar machinery as /v1's response_format."""
    c = env["client"]
    r = c.generate("stories-chat", PROMPT, format="json", options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(r.response), dict), r.response
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
              "required": ["name", "legs"], "additionalProperties": False}
    parts = [p.message.content for p in c.chat("stories-chat", MSGS, format=schema, stream=True,
                                                options={"temperature": 1.0, "seed": 4, "num_predict": 60})]
    obj = json.loads("".join(parts))
    assert set(obj) == {"name", "legs"} and 0 <= obj["legs"] <= 4 and len(obj["name"]) <= 8
    with pytest.raises(ollama.ResponseError) as e:
        c.generate("stories-chat", PROMPT, format={"type": "nonsense"})
    assert e.value.status_code == 400 and "schema" in e.value.error


def test_errors_in_ollama_shape(env):
    c = env["client"]
    with pytest.raises(ollama.ResponseError) as e:
        c.chat("llama3.2", MSGS)
    assert e.value.status_code == 404 and e.value.error.startswith("model 'llama3.2' not found")
    with pytest.raises(ollama.ResponseError) as e:
        c.show("nope:7b")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        c.chat("stories-chat", [{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {
            "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}}],
            options={"tool_choice": "g"})  # llmsys's extension: a function that is not in tools
    assert e.value.status_code == 400 and "'g'" in e.value.error
    bad = _post(env["a"], "/api/chat", {"model": "stories-chat", "messages": [{"role": "wizard", "content": "x"}]})
    assert bad.status_code == 400 and isinstance(bad.json()["error"], str) and "role" in bad.json()["error"]
    ctx = _post(env["a"], "/api/generate", {"model": "stories-chat", "prompt": "x", "context": [1, 99999]})
    assert ctx.status_code == 400 and ctx.json()["code"] == "invalid_prompt"
    emb = _post(env["a"], "/api/embed", {"model": "stories-chat", "input": "x", "dimensions": 100000})
    assert emb.status_code == 400 and emb.json()["error"].startswith("dimensions=100000 is outside 1..")
    with pytest.raises(ollama.ResponseError) as e:
        c.copy("stories-chat", "other")
    assert e.value.status_code == 501 and "not pushed, created or copied" in e.value.error


def test_load_ping_answers_at_once(env):
    c = env["client"]
    g = c.generate("stories-chat", "")
    assert g.done and g.done_reason == "load" and g.response == ""
    r = c.chat("stories-chat", [], keep_alive=0)  # Ollama's unload; the next request loads it again
    assert r.done and r.done_reason == "unload" and r.message.role == "assistant"
    assert c.generate("stories-chat", "", keep_alive=-1).done_reason == "load"


def test_logprobs(env):
    r = env["client"].chat("stories-chat", MSGS, options={"temperature": 0, "num_predict": 8}, logprobs=True,
                           top_logprobs=3)
    assert len(r.logprobs) == r.eval_count == 8
    assert "".join(lp.token for lp in r.logprobs) == r.message.content
    assert all(len(lp.top_logprobs) == 3 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-6 for lp in r.logprobs)


# -- the model, as Ollama lists it -------------------------------------------------------------


def test_tags_show_ps_version(env):
    c = env["client"]
    (m,) = c.list().models
    assert m.model == "stories-chat:latest" and m.size > 0 and len(m.digest) == 64
    assert m.details.family == "llama" and m.details.format == "safetensors"
    assert m.details.parameter_size == "260K" and m.details.quantization_level == "F32"
    s = c.show("stories-chat")
    assert s.template == env["ref"].tokenizer.chat_template and "num_ctx" in s.parameters
    assert s.modelinfo["llama.context_length"] == 512 and s.modelinfo["general.parameter_count"] == 260032
    assert s.capabilities == ["completion", "tools"] and s.details.family == "llama"  # tools: the generic format
    assert c.generate("stories-chat", "", keep_alive=-1).done_reason == "load"
    (p,) = c.ps().models
    assert p.model == "stories-chat:latest" and p.size_vram == 0 and p.size >= m.size
    assert p.expires_at.year > 2100 and p.context_length == 512
    # Ollama's rule: a request without keep_alive puts the model back on the default (5 minutes here)
    assert c.generate("stories-chat", "").done_reason == "load"
    (p,) = c.ps().models
    left = p.expires_at.timestamp() - time.time()
    assert 250 < left <= 301, left
    c.generate("stories-chat", "", keep_alive=-1)  # the tests after this one keep it loaded
    v = httpx.get(env["a"].url + "/api/version").json()["version"]
    assert v.count(".") == 2
    root = httpx.get(env["a"].url + "/")
    assert root.status_code == 200 and root.text == "Ollama is running"
    assert httpx.head(env["a"].url + "/").status_code == 200


def test_base_model_and_api_key(env):
    srv = env["b"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=srv.url).list()
    assert e.value.status_code == 401
    assert httpx.get(srv.url + "/").status_code == 200  # the probe stays open, like /health
    c = ollama.Client(host=srv.url, headers={"Authorization": f"Bearer {KEY}"})
    assert c.list().models[0].model == "stories:latest"
    # no chat template: generate's prompt goes in as it is, and system has nowhere to go
    from llmsys import SamplingParams

    r = c.generate("stories", PROMPT, options={"temperature": 0, "num_predict": 16})
    assert r.prompt_eval_count == len(env["ref"].tokenizer.encode(PROMPT))
    ref = env["ref"].generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0]
    assert r.response == ref.text  # same weights as the chat copy
    with pytest.raises(ollama.ResponseError) as e:
        c.generate("stories", PROMPT, system="x")
    assert e.value.status_code == 400 and "chat template" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.chat("stories", MSGS)
    assert e.value.status_code == 400 and "chat template" in e.value.error


def test_client_disconnect_mid_stream_frees_kv(env):
    srv = env["a"]
    before = _metrics(srv).get('llmsys_request_finished_total{reason="abort"}', 0)
    body = {"model": "stories-chat", "prompt": PROMPT, "raw": True, "options": {"temperature": 0, "num_predict": 400}}
    with httpx.stream("POST", srv.url + "/api/generate", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [json.loads(next(lines)) for _ in range(5)]
        assert all(not g["done"] for g in got)
        assert _metrics(srv)['llmsys_kv_blocks_used{tier="cpu"}'] > 0
    m = _wait_idle(srv, timeout=5)
    assert m['llmsys_kv_blocks_used{tier="cpu"}'] == 0 and m["llmsys_requests_running"] == 0
    assert m['llmsys_request_finished_total{reason="abort"}'] == before + 1
    assert m['llmsys_requests_total{endpoint="/api/generate",status="200"}'] >= 1


def test_503_while_loading_in_ollama_shape():
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    srv = start_server_thread(ServerState(ServerSettings()))
    try:
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=srv.url).chat("model", MSGS, keep_alive="5m")
        assert e.value.status_code == 503 and "loading" in e.value.error
        r = httpx.get(srv.url + "/api/tags")
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and isinstance(r.json()["error"], str)
        assert httpx.get(srv.url + "/api/version").status_code == 200  # no model needed
        assert httpx.get(srv.url + "/").text == "Ollama is running"
    finally:
        srv.stop()
