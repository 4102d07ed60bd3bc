"""``llmsys serve``: the OpenAI wire format, driven by the real ``openai`` client.

Servers run in-process on free loopback ports (one per module), serving
stories260k-hf in float32; the reference outputs come from a separate
``LLM`` instance (the served one belongs to its engine thread).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import STORIES_HF, need_shared
from llmsys.engine.server.metrics import parse_metrics
from llmsys.engine.server.serve import wait_until_healthy

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "Once upon a time"
KEY = "sekrit"


def _chat_model(tmp: Path, template: str = CHAT_TEMPLATE, name: str = "stories-chat",
                positions: int | None = None) -> Path:
    """stories260k-hf plus a chat template (the base model has none); ``positions``: a longer
    context than its 512 (RoPE extends; the words are nonsense either way)."""
    out = tmp / name
    out.mkdir()
    for f in STORIES_HF.iterdir():
        if f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg["chat_template"] = template
            (out / f.name).write_text(json.dumps(cfg))
        elif f.name == "config.json" and positions is not None:
            cfg = json.loads(f.read_text())
            cfg["max_position_embeddings"] = positions
            (out / f.name).write_text(json.dumps(cfg))
        elif f.name.endswith(".safetensors"):
            os.symlink(f, out / f.name)
        elif f.is_file():
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Server A: chat-capable copy, open. Server B: base model, API key,
    1 running + 1 queued at most, 2 KiB bodies. Plus a reference LLM."""
    need_shared(STORIES_HF)
    import torch

    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    torch.set_num_threads(2)
    chat_dir = _chat_model(tmp_path_factory.mktemp("m"))
    a = ServerState(ServerSettings(model_aliases=("x",), max_prompt_tokens=2048))  # > context: sliding windows
    a.attach(LLM(str(chat_dir), dtype="float32"), "stories-chat")
    b = ServerState(ServerSettings(model_aliases=("x",), api_key=KEY, max_concurrency=1, max_queue=1, max_body_bytes=2048))
    b.attach(LLM(str(STORIES_HF), dtype="float32"), "stories")
    sa, sb = start_server_thread(a), start_server_thread(b)
    ref = LLM(str(chat_dir), dtype="float32")
    yield {"a": sa, "b": sb, "ref": ref}
    sa.stop()
    sb.stop()


def _client(srv, key="unused", cls=openai.OpenAI):
    return cls(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _metrics(srv) -> dict[str, float]:
    return parse_metrics(httpx.get(srv.url + "/metrics").text)


def _wait_idle(srv, timeout=10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(srv)
        if m['llmsys_kv_blocks_used{tier="cpu"}'] == 0 and m["llmsys_requests_running"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.02)


# -- greedy equality: streamed == non-streamed == LLM.generate ------------------------


def test_completions_stream_equals_nonstream_equals_generate(env):
    from llmsys import SamplingParams

    ref = env["ref"].generate(PROMPT, SamplingParams(max_tokens=48, temperature=0))[0]
    c = _client(env["a"])
    r = c.completions.create(model="x", prompt=PROMPT, max_tokens=48, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == len(ref.token_ids)
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == len(ref.token_ids) and timings["ttft_ms"] > 0
    parts, usage = [], None
    for ch in c.completions.create(model="x", prompt=PROMPT, max_tokens=48, temperature=0, stream=True,
                                   stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].text)
        else:
            usage = ch.usage
    assert "".join(parts) == ref.text
    assert usage.completion_tokens == len(ref.token_ids) and usage.total_tokens == usage.prompt_tokens + len(ref.token_ids)


def test_chat_sync_stream_async_equal_generate(env):
    from llmsys import SamplingParams

    ref_llm = env["ref"]
    msgs = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat and a dog"}]
    ref = ref_llm.generate([ref_llm.tokenizer.encode_chat(msgs)], SamplingParams(max_tokens=40, temperature=0))[0]
    c = _client(env["a"])
    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=40, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(model="x", messages=msgs, max_completion_tokens=40, temperature=0,
                                                 stream=True) if ch.choices)
    assert streamed == ref.text

    async def many():
        ac = _client(env["a"], cls=openai.AsyncOpenAI)
        async with ac:
            rs = await asyncio.gather(*[
                ac.chat.completions.create(model="x", messages=msgs, max_tokens=40, temperature=0) for _ in range(6)
            ])
            stream = await ac.chat.completions.create(model="x", messages=msgs, max_tokens=40, temperature=0,
                                                      stream=True)
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        return [x.choices[0].message.content for x in rs], text

    texts, text = asyncio.run(many())
    assert texts == [ref.text] * 6 and text == ref.text


def test_chat_n_equals_generate_n(env):
    """n on /v1/chat/completions: the choices are LLM.generate's n completions (same derived seeds), usage
    counts the prompt once and sums the completions; streamed, each delta names its choice."""
    from llmsys import SamplingParams

    ref_llm = env["ref"]
    msgs = [{"role": "user", "content": "A cat and a dog"}]
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=11, n=3)
    refs = ref_llm.generate([ref_llm.tokenizer.encode_chat(msgs)], sp)
    c = _client(env["a"])
    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=12, temperature=1.0, seed=11, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.message.content for ch in r.choices] == [o.text for o in refs]
    assert r.usage.prompt_tokens == len(refs[0].prompt_token_ids)
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in refs)
    texts = ["", "", ""]
    for ch in c.chat.completions.create(model="x", messages=msgs, max_tokens=12, temperature=1.0, seed=11, n=3,
                                        stream=True):
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [o.text for o in refs]


def test_concurrent_requests_are_batched(env):
    """Many clients at once: the engine runs them in the same steps."""
    from llmsys import SamplingParams

    prompts = [f"{PROMPT} there was a {w}" for w in ("cat", "dog", "bird", "frog", "king", "boat")]
    refs = env["ref"].generate(prompts, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    worker = env["a"].state.worker
    seen_running: list[int] = []

    async def go():
        ac = _client(env["a"], cls=openai.AsyncOpenAI)
        async with ac:
            async def probe():
                while True:
                    seen_running.append(len(worker.core.scheduler.running))
                    await asyncio.sleep(0.002)

            t = asyncio.create_task(probe())
            rs = await asyncio.gather(*[ac.completions.create(model="x", prompt=p, max_tokens=60, temperature=0,
                                                              extra_body={"ignore_eos": True}) for p in prompts])
            t.cancel()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(go()) == [r.text for r in refs]
    assert max(seen_running) >= 3


def test_n_seed_stop_penalties(env):
    c = _client(env["a"])
    one = c.completions.create(model="x", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7)
    two = c.completions.create(model="x", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, n=3,
                               presence_penalty=0.5, frequency_penalty=0.0)
    again = c.completions.create(model="x", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, n=3,
                                 presence_penalty=0.5)
    assert [ch.index for ch in two.choices] == [0, 1, 2]
    assert [ch.text for ch in two.choices] == [ch.text for ch in again.choices]  # seeded: reproducible
    assert len({ch.text for ch in two.choices}) > 1  # distinct generators per sample
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    plain = c.completions.create(model="x", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, n=3)
    assert plain.choices[0].text == one.choices[0].text  # sample 0 of n == the n=1 request
    texts = ["", "", ""]  # streaming n=3: every chunk names its choice; the texts equal the non-streamed ones
    for ch in c.completions.create(model="x", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, n=3,
                                   stream=True, stream_options={"include_usage": True}):
        for choice in ch.choices:
            texts[choice.index] += choice.text
        if ch.usage is not None:
            assert ch.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
            assert ch.usage.completion_tokens == plain.usage.completion_tokens  # summed over the choices
    assert texts == [ch.text for ch in plain.choices]
    fixed = c.completions.create(model="x", prompt=PROMPT, max_tokens=5, n=3, extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == 15 and fixed.usage.prompt_tokens == one.usage.prompt_tokens
    greedy = c.completions.create(model="x", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    cut = c.completions.create(model="x", prompt=PROMPT, max_tokens=40, temperature=0, stop=["Lily", "zzz"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == greedy[: greedy.index("Lily")]
    batch = c.completions.create(model="x", prompt=[PROMPT, "The dog"], max_tokens=8, temperature=0, user="u1")
    alone = c.completions.create(model="x", prompt="The dog", max_tokens=8, temperature=0).choices[0].text
    assert batch.choices[0].text == greedy[: len(batch.choices[0].text)] and batch.choices[1].text == alone
    assert len(batch.choices) == 2 and batch.choices[1].index == 1


def test_logprobs(env):
    c = _client(env["a"])
    r = c.completions.create(model="x", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and val <= 0 and max(top.values()) == pytest.approx(val)  # greedy: chosen = top
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    msgs = [{"role": "user", "content": "hello"}]
    ch = c.chat.completions.create(model="x", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = ch.choices[0].logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 2 for e in content)
    assert content[0].bytes == list(content[0].token.encode())
    streamed = [x.choices[0].logprobs for x in c.chat.completions.create(
        model="x", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True)
        if x.choices and x.choices[0].logprobs]
    # The second request's prompt comes partly from the prefix cache, so its remaining rows run through
    # a float32 GEMM of another shape, which may round differently (1.2e-7 on a Sapphire Rapids Xeon).
    assert [e.logprob for s in streamed for e in s.content] == pytest.approx([e.logprob for e in content], abs=1e-5)


@pytest.mark.parametrize("max_tokens,temperature", [(6, 0.0), (40, 0.0), (60, 1.0), (None, 0.7)])
def test_json_mode_output_parses(env, max_tokens, temperature):
    c = _client(env["a"])
    r = c.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        max_tokens=max_tokens, temperature=temperature, seed=3, response_format={"type": "json_object"},
    )
    text = r.choices[0].message.content
    assert isinstance(json.loads(text), dict), text
    s = c.completions.create(model="x", prompt=PROMPT, max_tokens=max_tokens or 30, temperature=temperature, seed=1,
                             stream=True, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads("".join(ch.choices[0].text for ch in s if ch.choices)), dict)


def test_models_health_metrics(env):
    models = _client(env["a"]).models.list()
    assert [m.id for m in models.data] == ["stories-chat"]
    assert httpx.get(env["a"].url + "/health").status_code == 200
    m = _wait_idle(env["a"])
    for name in ("llmsys_generation_tokens_total", "llmsys_prompt_tokens_total", "llmsys_queue_depth",
                 "llmsys_time_to_first_token_seconds_count", "llmsys_inter_token_latency_seconds_count",
                 "llmsys_kv_blocks_total", "llmsys_kv_evicted_tokens_total"):
        assert name in m
    assert m["llmsys_generation_tokens_total"] > 0 and m["llmsys_time_to_first_token_seconds_count"] > 0
    assert m['llmsys_requests_total{endpoint="/v1/completions",status="200"}'] > 0
    # Swap space for preempted requests is on by default (a CPU pool swaps to disk).
    assert m['llmsys_kv_swap_blocks_used{tier="disk"}'] == 0
    assert 'llmsys_kv_preemptions_total{kind="swap"}' in m and 'llmsys_kv_preemptions_total{kind="recompute"}' in m
    spec = httpx.get(env["a"].url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])


def test_repeated_prompt_reuses_cached_prefix(env):
    """Prefix caching is on by default: the second identical prompt computes only its last block."""
    from llmsys import SamplingParams

    prompt = "Once upon a time there was a little girl named Lily who loved to play outside in the sun with her dog"
    cl = _client(env["a"])
    before = _metrics(env["a"]).get("llmsys_prefix_cache_hit_tokens_total", 0)
    first = cl.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0)
    parts, usage = [], None
    for ch in cl.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                   stream_options={"include_usage": True}):
        parts.extend(c.text for c in ch.choices)
        usage = ch.usage or usage
    n = first.usage.prompt_tokens
    assert n > 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16  # default block size 16
    ref = env["ref"].generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert first.choices[0].text == "".join(parts) == ref.text
    m = _wait_idle(env["a"])
    assert m["llmsys_prefix_cache_hit_tokens_total"] - before == usage.prompt_tokens_details.cached_tokens
    assert m["llmsys_kv_blocks_cached"] > 0 and m['llmsys_kv_blocks_used{tier="cpu"}'] == 0


def test_client_disconnect_aborts_and_frees_kv(env):
    srv = env["a"]
    before = _metrics(srv).get('llmsys_request_finished_total{reason="abort"}', 0)
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert got[0].startswith("data: ")
        assert _metrics(srv)['llmsys_kv_blocks_used{tier="cpu"}'] > 0
    m = _wait_idle(srv, timeout=5)
    assert m['llmsys_kv_blocks_used{tier="cpu"}'] == 0 and m["llmsys_requests_running"] == 0
    assert m['llmsys_request_finished_total{reason="abort"}'] == before + 1


# -- error cases ----------------------------------------------------------------------


def _post(srv, path, body, **kw):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(srv.url + path, content=data, headers={"content-type": "application/json", **kw}, timeout=30)


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/completions", "{not json", None, "not valid JSON"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "x", "n": "two"}, "n", "valid integer"),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "missing required field"),
    ("/v1/chat/completions", {"max_tokens": 3}, "messages", "missing required field"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]},
     "stop", "at most 4"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 9}, None, "min_tokens"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
])
def test_bad_requests_are_400(env, path, body, param, needle):
    r = _post(env["a"], path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_context_overflow_400(env):
    r = _post(env["a"], "/v1/completions", {"prompt": "a " * 600})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["n_ctx"] == 512 and err["n_prompt_tokens"] > 512
    with pytest.raises(openai.BadRequestError) as e:
        _client(env["a"]).chat.completions.create(model="x", messages=[{"role": "user", "content": "b " * 700}])
    assert e.value.body["n_ctx"] == 512


def test_no_chat_template_400(env):
    r = _post(env["b"], "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
              authorization=f"Bearer {KEY}")
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    assert "/v1/completions" in r.json()["error"]["message"]


def test_api_key_401(env):
    srv = env["b"]
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        r = _post(srv, "/v1/completions", {"prompt": "x"}, **headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(srv, "wrong").completions.create(model="x", prompt="x", max_tokens=2)
    assert _client(srv, KEY).completions.create(model="x", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    assert httpx.get(srv.url + "/health").status_code == 200  # health stays open


def test_body_too_large_413(env):
    r = _post(env["b"], "/v1/completions", {"prompt": "x" * 4000}, authorization=f"Bearer {KEY}")
    assert r.status_code == 413 and "limit of 2048 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(8):
            yield b" " * 1024

    r = httpx.post(env["b"].url + "/v1/completions", content=chunks(),
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 413


def test_queue_full_429(env):
    """Server B runs 1 request and queues 1: an n=2 request fills both places
    (sample 1 waits for sample 0's 500 tokens), so the next request gets 429."""
    srv = env["b"]
    body = {"prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True, "ignore_eos": True, "n": 2}
    hdr = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30) as h1:
        with h1.stream("POST", srv.url + "/v1/completions", json=body, headers=hdr) as busy:
            assert busy.status_code == 200
            r = _post(srv, "/v1/completions", {"prompt": "x"}, **hdr)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                _client(srv, KEY).completions.create(model="x", prompt="x", max_tokens=2)
            assert _metrics(srv)["llmsys_queue_depth"] == 1
            assert sum(1 for line in busy.iter_lines() if line.startswith("data: {")) > 0
    m = _wait_idle(srv)
    assert m['llmsys_kv_blocks_used{tier="cpu"}'] == 0 and m["llmsys_queue_depth"] == 0
    assert _client(srv, KEY).completions.create(model="x", prompt="x", max_tokens=2).choices[0].text is not None


def test_unknown_route_404(env):
    r = httpx.get(env["a"].url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_health_503_while_loading():
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    srv = start_server_thread(ServerState(ServerSettings()))
    try:
        assert httpx.get(srv.url + "/health").status_code == 503
        r = _post(srv, "/v1/completions", {"prompt": "x"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    finally:
        srv.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_cli_serve_graceful_shutdown(sig):
    need_shared(STORIES_HF)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmsys.engine.cli.main", "serve", str(STORIES_HF), "--port", str(port),
         "--dtype", "float32", "--threads", "1", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_healthy(url, proc, timeout_s=60), proc.stdout.read() if proc.poll() is not None else "timeout"
        body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(sig)
            rest = list(lines)  # the in-flight stream still completes
        assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert "ready" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_context_full_is_said_not_silent(env):
    """finish_reason is `length` for max_tokens and for a full context alike; only
    the second carries finish_details naming the limit (streamed and not)."""
    c = _client(env["a"])
    long = c.completions.create(model="x", prompt="Once upon a time", max_tokens=2000, temperature=0,
                                extra_body={"ignore_eos": True})
    ch = long.choices[0]
    assert ch.finish_reason == "length"
    det = ch.model_extra["finish_details"]
    assert det["type"] == "context_full" and det["n_ctx"] == 512 and det["n_tokens"] == 512
    assert "--max-model-len" in det["message"]
    short = c.completions.create(model="x", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert short.choices[0].finish_reason == "length" and "finish_details" not in short.choices[0].model_extra
    last = None
    for part in c.completions.create(model="x", prompt="Once upon a time", max_tokens=2000, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True}):
        if part.choices and part.choices[0].finish_reason:
            last = part.choices[0]
    assert last.finish_reason == "length" and last.model_extra["finish_details"]["n_ctx"] == 512


# -- per-request KV policy (llmsys extension field `kv_policy`) -------------------------


def test_per_request_sink_continues_past_the_context(env):
    """A request with kv_policy sink slides past the 512-token context (evictions in usage);
    a default request on the same server stops there with finish_details context_full."""
    c = _client(env["a"])
    body = {"ignore_eos": True, "kv_policy": "sink:4,window:60"}
    sink = c.completions.create(model="x", prompt="Once upon a time", max_tokens=600, temperature=0, extra_body=body)
    ch = sink.choices[0]
    assert ch.finish_reason == "length" and "finish_details" not in ch.model_extra
    n_prompt = sink.usage.prompt_tokens
    assert sink.usage.completion_tokens == 600 and n_prompt + 600 > 512
    assert sink.usage.model_extra["evicted_tokens"] >= n_prompt + 600 - 64 - 16  # kept <= budget + one chunk
    default = c.completions.create(model="x", prompt="Once upon a time", max_tokens=600, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert default.choices[0].model_extra["finish_details"]["type"] == "context_full"
    assert default.usage.completion_tokens == 512 - n_prompt and default.usage.model_extra["evicted_tokens"] == 0
    # streamed chat, same policy: also past the context, no context_full
    last, usage = None, None
    for part in c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Tell a story"}],
                                          max_tokens=600, temperature=0, stream=True, extra_body=body,
                                          stream_options={"include_usage": True}):
        if part.choices and part.choices[0].finish_reason:
            last = part.choices[0]
        usage = part.usage or usage
    assert last.finish_reason == "length" and "finish_details" not in last.model_extra
    assert usage.completion_tokens == 600 and usage.model_extra["evicted_tokens"] > 0


def test_per_request_window_takes_a_prompt_longer_than_the_context(env):
    # over the 512-token context: 400 by default (test_context_overflow_400); a window takes it when the
    # server's --max-prompt-tokens (2048 on server A; default: the context) allows it (test_server_limits)
    prompt = "a " * 600
    r = _client(env["a"]).completions.create(model="x", prompt=prompt, max_tokens=4, temperature=0,
                                             extra_body={"kv_policy": "window:128"})
    assert r.usage.prompt_tokens > 512 and r.usage.completion_tokens == 4
    assert r.usage.model_extra["evicted_tokens"] >= r.usage.prompt_tokens - 128
    r = _post(env["a"], "/v1/completions", {"prompt": prompt, "kv_policy": "snapkv:64"})  # compresses a whole prompt
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("policy,needle", [
    ("lru:3", "unknown KV policy 'lru'"),
    ("sink:4", "write it as one of"),
    ("window:1", "at least 2 tokens"),
    ("window:" + "9" * 30, "too large"),
    ("x" * 300, "at most 200 characters"),
    ("window:1000000", "does not fit the KV pool"),
    ("recompute:64", "scoring oracle"),
    ("quest:4", "engine-wide"),
    (17, "valid string"),
])
def test_bad_kv_policy_is_400(env, policy, needle):
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})):
        r = _post(env["a"], path, {**body, "kv_policy": policy})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["param"] == "kv_policy", err


def test_kv_policy_is_in_the_openapi_schema(env):
    schema = httpx.get(env["a"].url + "/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        field = schema[name]["properties"]["kv_policy"]
        assert "sink:S,window:N" in field["description"]


def test_tools_on_a_template_without_a_call_format_use_the_generic_one(env):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
    r = _client(env["a"]).chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                                  tools=[tool], tool_choice="required", max_tokens=40)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "f"
    assert set(json.loads(call.function.arguments)) == {"n"} and 0 <= json.loads(call.function.arguments)["n"] <= 9
