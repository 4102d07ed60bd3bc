"""``llmsys serve`` under bad input and failure (issue #23): every bad request is a 4xx with an
OpenAI-shaped body, no input reaches a traceback, a 5xx or a hang, one failure never takes the
other requests down, and the server is safe on a desktop (DNS rebinding, cross-origin pages).

In-process servers on loopback serve stories260k-hf (float32) with short body and head deadlines,
so the slow-client cases take a second, not the defaults' 30 s and 10 s.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import STORIES_HF, need_shared
from test_server import CHAT_TEMPLATE, _chat_model, _free_port

KEY = "hardening-key"
AUTH = {"authorization": f"Bearer {KEY}"}
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _server(model: Path | str, **settings):
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    llm_kw = settings.pop("llm", {})
    state = ServerState(ServerSettings(**settings))
    state.attach(LLM(str(model), dtype="float32", progress=False, **llm_kw), "stories")
    return start_server_thread(state)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    need_shared(STORIES_HF)
    return _chat_model(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def srv(chat_dir):
    """Keyed, 8 MiB bodies (the 4 MB prompts), 1 s body and head deadlines."""
    s = _server(chat_dir, api_key=KEY, max_body_bytes=8 * 2**20, body_timeout_s=1.0, head_timeout_s=1.0)
    yield s
    s.stop()


def _post(srv, path, body, headers=None):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(srv.url + path, content=data, timeout=30,
                      headers={"content-type": "application/json", **AUTH, **(headers or {})})


def _assert_openai_error(r, status, needle, code=None):
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and "\n" not in err["message"], err
    assert needle in err["message"], err
    if code is not None:
        assert err["code"] == code, err


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
# (path, body, extra headers, status, needle in the message, code)
BAD_REQUESTS = [
    (COMP, '{"prompt": "a\\ud800b", "max_tokens": 2}', {}, 400, "lone surrogate U+D800", "invalid_prompt"),
    (CHAT, '{"messages": [{"role": "user", "content": "x\\udfffy"}]}', {}, 400, "lone surrogate U+DFFF",
     "invalid_prompt"),
    (COMP, "", {}, 400, "the request body is empty", None),
    (COMP, {"prompt": "x", "max_tokens": "10"}, {}, 400, "'max_tokens'", None),
    (COMP, {"prompt": "x", "stream": "yes"}, {}, 400, "'stream'", None),
    (COMP, {"prompt": "x", "temperature": True}, {}, 400, "'temperature'", None),
    (COMP, {"prompt": [True, False]}, {}, 400, "'prompt'", None),
    (COMP, {"prompt": []}, {}, 400, "'prompt'", None),
    (COMP, {"prompt": [[]]}, {}, 400, "'prompt'", None),
    (COMP, {"prompt": [1, -5]}, {}, 400, "'prompt'", None),
    (COMP, {"prompt": "x", "kv_policy": "window:8; DROP TABLE--"}, {}, 400, "'kv_policy'", None),
    (COMP, {"prompt": "x", "kv_policy": "lru:3"}, {}, 400, "unknown KV policy", "invalid_kv_policy"),
    (COMP, {"prompt": "x", "stop": ""}, {}, 400, "'stop'", None),
    (COMP, {"prompt": "x", "max_tokens": 3, "min_tokens": 9}, {}, 400, "min_tokens", "conflicting_parameters"),
    (COMP, {"prompt": ["a", "b", "c", "d", "e"], "n": 16}, {}, 400, "more than 64", "too_many_choices"),
    (COMP, {"prompt": "x " * 4000}, {}, 400, "context holds", "context_length_exceeded"),
    (COMP, "[1, 2]", {}, 400, "request body", None),
    (COMP, '{"prompt": "x"', {}, 400, "not valid JSON", None),
    (COMP, {"prompt": "x"}, {"host": "attacker.example"}, 403, "DNS rebinding", "host_not_allowed"),
    (COMP, {"prompt": "x"}, {"host": "attacker.example:8000"}, 403, "--allowed-hosts attacker.example",
     "host_not_allowed"),
    (COMP, {"prompt": "x"}, {"origin": "http://evil.example"}, 403, "--cors-origin http://evil.example",
     "origin_not_allowed"),
    (COMP, {"prompt": "x"}, {"authorization": "Bearer wrong"}, 401, "incorrect API key", "invalid_api_key"),
]


@pytest.mark.parametrize("path,body,headers,status,needle,code", BAD_REQUESTS)
def test_bad_requests_get_openai_shaped_4xx(srv, path, body, headers, status, needle, code):
    _assert_openai_error(_post(srv, path, body, headers), status, needle, code)


def test_framework_answers_are_openai_shaped_too(srv):
    r = httpx.get(srv.url + COMP, headers=AUTH)
    _assert_openai_error(r, 405, "Method Not Allowed")
    assert r.headers["allow"] == "POST"
    _assert_openai_error(httpx.get(srv.url + "/v1/nope", headers=AUTH), 404, "Not Found")
    for path in ("/docs", "/openapi.json"):  # with a key, the docs need it as well
        _assert_openai_error(httpx.get(srv.url + path), 401, "missing API key")
        assert httpx.get(srv.url + path, headers=AUTH).status_code == 200
    ok = httpx.get(srv.url + "/health")  # documented as open: probes carry no key
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    # names and addresses that cannot be rebound are served
    for host in ("localhost:1234", "127.0.0.1", "[::1]:80", "192.168.1.7", "app.localhost"):
        assert httpx.get(srv.url + "/health", headers={"host": host}).status_code == 200, host
    # the server's own pages (/docs' "try it out") send their own origin
    own = httpx.get(srv.url + "/v1/models", headers={**AUTH, "origin": srv.url})
    assert own.status_code == 200


def _raw(srv, data: bytes, wait_s: float = 5.0) -> tuple[bytes, float]:
    """Send raw bytes; (everything the server answered until it closed, seconds until then)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=wait_s) as s:
        s.sendall(data)
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return got, float("inf")
            if not chunk:
                return got, time.monotonic() - t0
            got += chunk


def test_slow_and_malformed_clients_do_not_hold_connections(srv):
    # Content-Length larger than the body: 408 once it stalls for the body deadline (1 s here), not a hang
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {KEY}\r\ncontent-length: 100\r\n\r\n").encode()
    got, took = _raw(srv, head + b'{"prompt": "x"}')
    assert b" 408 " in got.split(b"\r\n")[0] and b'"request_timeout"' in got and took < 4, (got, took)
    # half a request head: the connection is closed at the head deadline
    got, took = _raw(srv, b"POST /v1/completions HTTP/1.1\r\nhost: 127.0")
    assert got == b"" and took < 4, (got, took)
    # nothing at all
    got, took = _raw(srv, b"")
    assert took < 4
    # a malformed request line: uvicorn's own 400, as JSON
    got, took = _raw(srv, b"GARBAGE\r\n\r\n")
    status, _, body = got.partition(b"\r\n\r\n")
    assert b" 400 " in status.split(b"\r\n")[0] and b"application/json" in status, got
    assert json.loads(body)["error"]["code"] == "bad_http"


def test_the_server_still_answers_after_the_bad_inputs(srv):
    r = _post(srv, COMP, {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


# -- chat templates are code from a download: bounded -------------------------------------------


@pytest.mark.parametrize("source,needle", [
    (BOMB, "steps"),
    ("{{ 'x' * 10**10 }}", "10,000,000,000"),
    ("{{ range(10**9)|list }}", "Range too big"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{% for i in range(100000) %}{% for j in range(1000) %}{{ 'abcdefgh' * 100 }}{% endfor %}{% endfor %}",
     "characters"),
])
def test_a_runaway_chat_template_is_stopped_with_one_line(source, needle):
    from llmsys.engine.chat_template import ChatTemplate
    from llmsys.kernels.common.errors import TokenizerError

    t0 = time.monotonic()
    with pytest.raises(TokenizerError) as e:
        ChatTemplate(source, "tokenizer_config.json").render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 6  # RenderBudget.max_seconds is 5
    msg = str(e.value)
    assert needle in msg and "tokenizer_config.json" in msg and "\n" not in msg, msg


def test_the_render_budget_counts_steps_not_shipped_templates():
    """A normal template over a long conversation uses a sliver of the budget, with range()
    still a sequence (|length, indexing)."""
    from llmsys.engine.chat_template import ChatTemplate

    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(5000)]
    out = ChatTemplate(CHAT_TEMPLATE + "{{ range(3)|length }}{{ range(5)[2] }}").render(
        messages, special_tokens={"bos_token": "<s>"})
    assert out.startswith("<s>user: m0\n") and out.endswith("assistant:32")


def test_a_bomb_template_is_a_400_and_the_server_goes_on(tmp_path):
    need_shared(STORIES_HF)
    model = _chat_model(tmp_path)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = BOMB
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    s = _server(model)
    try:
        r = httpx.post(s.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        _assert_openai_error(r, 400, "steps", "chat_template_error")
        r = httpx.post(s.url + COMP, json={"prompt": "Once", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200
    finally:
        s.stop()


# -- the event loop stays free ------------------------------------------------------------------


def test_four_4mb_prompts_do_not_freeze_a_stream_or_health(srv):
    """Four ~4 MB prompts while a stream runs past the context under a sliding window: they are
    refused by their length alone (no tokenizing: seconds of CPU to learn what the length says), the
    stream's worst inter-token gap and /health's worst latency stay under 100 ms (or 3x a quiet
    second's, on a loaded machine). (Prompts that may
    fit are tokenized off the event loop: the next test.)"""
    words = (Path(need_shared(STORIES_HF)).parent.parent / "corpus").glob("*.txt")
    text = next(iter(sorted(words))).read_text()
    big = (text * (4_000_000 // len(text) + 1))[:4_000_000]
    results, gaps, health = [], [], []
    started, done = threading.Event(), threading.Event()

    def stream():
        body = {"prompt": "Once upon a time", "max_tokens": 100000, "ignore_eos": True, "temperature": 0,
                "stream": True, "kv_policy": "sink:4,window:200"}
        with httpx.stream("POST", srv.url + COMP, json=body, headers=AUTH, timeout=60) as r:
            last = None
            for line in r.iter_lines():
                now = time.monotonic()
                if not line.startswith("data: {"):
                    continue
                if last is not None and started.is_set() and not done.is_set():
                    gaps.append((now, now - last))
                last = now
                started.set()
                if done.is_set():
                    break

    def poll_health():
        with httpx.Client(timeout=10) as c:  # one connection: time the server, not the client's set-up
            while not done.is_set():
                t0 = time.monotonic()
                assert c.get(srv.url + "/health").status_code == 200
                health.append((t0, time.monotonic() - t0))
                time.sleep(0.05)

    payload = json.dumps({"prompt": big, "max_tokens": 2}).encode()  # encoded once, before timing
    t_parse = time.perf_counter()
    json.loads(payload)  # what this CPU takes to decode one body (FastAPI does it on the event loop)
    t_parse = time.perf_counter() - t_parse

    async def big_prompts():
        async with httpx.AsyncClient(timeout=120, headers={**AUTH, "content-type": "application/json"}) as c:
            rs = await asyncio.gather(*[c.post(srv.url + COMP, content=payload) for _ in range(4)])
        results.extend(rs)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    h = threading.Thread(target=poll_health)
    h.start()
    time.sleep(1.0)  # a quiet second first: the machine's own noise, to compare with
    t0 = time.monotonic()
    asyncio.run(big_prompts())
    took = time.monotonic() - t0
    time.sleep(1.0)  # and a second after them
    done.set()
    t.join(30)
    h.join(30)
    for r in results:
        _assert_openai_error(r, 400, "context holds", "context_length_exceeded")
    # The 100 ms target is met on a quiet machine (benchmarks/bench_server_hardening.py: 34-59 ms);
    # here each worst case must stay under 100 ms or 3x what the quiet second saw, whichever is
    # more, so a loaded CI machine cannot fail it while a freeze (seconds before the fix) still does.
    # Plus what no server can avoid on the loop: receiving and decoding the four 4 MB bodies (twice
    # this CPU's json.loads of one body, each; 2 x 4 x 14 ms on a Zen 3 core, where the worst gap
    # measured 114-149 ms at the session's start code too).
    for name, samples in (("inter-token gap", gaps), ("/health latency", health)):
        quiet = [v for at, v in samples if at < t0]
        busy = [v for at, v in samples if at >= t0]
        assert len(quiet) >= 3 and len(busy) >= 3, (name, len(quiet), len(busy), took)
        bound = max(0.1, 3 * max(quiet)) + 2 * 4 * t_parse
        assert max(busy) < bound, f"worst {name} {max(busy) * 1000:.0f} ms (quiet: {max(quiet) * 1000:.0f} ms)"


def test_long_text_is_tokenized_without_holding_the_event_loop(srv):
    """A 4 MB text with a sliding KV policy must be tokenized (it may fit): that runs on the
    preparation thread, and `tokenizers` releases the GIL for it (its plain encode holds it for
    seconds), so the event loop keeps ticking. Same tokens as the plain encode."""
    from llmsys.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(STORIES_HF)
    text = (Path(need_shared(STORIES_HF)).parent.parent / "corpus" / "tinyshakespeare.txt").read_text()[:300_000]
    assert tok.encode(text) == tok._backend._tok.encode(text).ids

    async def main():
        loop = asyncio.get_running_loop()
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        t = asyncio.create_task(ticker())
        await loop.run_in_executor(None, tok.encode, text * 4)
        stop.set()
        await t
        return gaps

    gaps = asyncio.run(main())
    assert len(gaps) > 20 and max(gaps) < 0.2, (len(gaps), max(gaps))


# -- failures stay with their request -------------------------------------------------------------


def test_a_non_streaming_request_stops_when_its_client_leaves(srv):
    from llmsys.engine.server.metrics import parse_metrics

    def metrics():
        return parse_metrics(httpx.get(srv.url + "/metrics").text)

    before = metrics().get('llmsys_request_finished_total{reason="abort"}', 0)
    body = {"prompt": "Once", "max_tokens": 100000, "ignore_eos": True, "kv_policy": "sink:4,window:200"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + COMP, json=body, headers=AUTH, timeout=0.5)
    deadline = time.monotonic() + 5
    while metrics().get('llmsys_request_finished_total{reason="abort"}', 0) == before:
        assert time.monotonic() < deadline, "the request kept generating after its client left"
        time.sleep(0.05)
    m = metrics()
    assert m["llmsys_requests_running"] == 0 and m['llmsys_kv_blocks_used{tier="cpu"}'] == 0


def test_a_failing_step_ends_its_requests_with_a_reason_and_the_engine_goes_on(chat_dir, monkeypatch):
    s = _server(chat_dir)
    core = s.state.worker.core
    real, calls = core.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("simulated kernel failure")
        return real()

    monkeypatch.setattr(core, "step", step)
    try:
        body = {"prompt": "Once", "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + COMP, json=body, timeout=30) as r:
            frames = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        last = frames[-1]
        assert last["choices"][0]["finish_reason"] == "abort"
        assert "simulated kernel failure" in last["error"]["message"] and last["error"]["code"] == "engine_error"
        r = httpx.post(s.url + COMP, json={"prompt": "Once", "max_tokens": 5}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
    finally:
        s.stop()


def test_a_dead_engine_thread_is_a_503_and_health_says_so(chat_dir, monkeypatch):
    s = _server(chat_dir)
    worker = s.state.worker

    def broken() -> None:
        raise RuntimeError("simulated worker bug")

    try:
        monkeypatch.setattr(worker, "_end_overdue", broken)  # outside the guarded step: escapes the loop
        r = httpx.post(s.url + COMP, json={"prompt": "Once", "max_tokens": 5}, timeout=30)
        _assert_openai_error(r, 503, "engine thread stopped")
        worker.join(5)
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and "simulated worker bug" in h.json()["reason"]
        r = httpx.post(s.url + COMP, json={"prompt": "Once", "max_tokens": 5, "stream": True}, timeout=30)
        _assert_openai_error(r, 503, "engine thread stopped", "engine_stopped")
    finally:
        s.stop()


def test_a_full_swap_disk_costs_speed_not_requests(tmp_path, monkeypatch):
    """16 concurrent requests on a KV pool too small for them, with the swap file's writes failing
    after 3 blocks: every request finishes 200 with a plain run's greedy tokens (the swapped ones by
    recompute), and the server serves a new request after."""
    from llmsys import LLM, SamplingParams
    from llmsys.offload import kv_swap

    need_shared(STORIES_HF)
    prompts = [f"Once upon a time, {w}" for w in ("Lily", "Tom", "a cat", "a dog", "Sue", "Ben", "a bird",
                                                   "a girl", "a boy", "Max", "Mia", "a fox", "Sam", "Ann",
                                                   "a frog", "an owl")]
    plain = LLM(str(STORIES_HF), dtype="float32", progress=False, kv_cache_tokens=4096, swap_space=0)
    want = [o.text for o in plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))]
    real, calls = kv_swap.write_block, [0]

    def write(*args):
        calls[0] += 1
        if calls[0] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(kv_swap, "write_block", write)
    s = _server(STORIES_HF, llm={"kv_cache_tokens": 256, "block_size": 8, "offload_dir": str(tmp_path)})
    try:
        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*[c.post(s.url + COMP, json={
                    "prompt": p, "max_tokens": 40, "ignore_eos": True, "temperature": 0}) for p in prompts])

        rs = asyncio.run(run())
        assert [r.status_code for r in rs] == [200] * len(prompts)
        assert [r.json()["choices"][0]["text"] for r in rs] == want
        assert calls[0] > 3, "the swap space was never written: the test did not exercise the failure"
        assert s.state.worker.core.swap.stats.lost_swap_outs > 0
        r = httpx.post(s.url + COMP, json={"prompt": prompts[0], "max_tokens": 40, "ignore_eos": True,
                                          "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0]
    finally:
        s.stop()


# -- desktop: CORS only when asked ----------------------------------------------------------------


def test_cors_origin_allows_that_page_only(chat_dir):
    page = "http://localhost:3000"
    s = _server(chat_dir, cors_origins=(page,))
    try:
        pre = httpx.options(s.url + COMP, headers={"origin": page, "access-control-request-method": "POST",
                                                   "access-control-request-headers": "content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == page
        r = httpx.post(s.url + COMP, json={"prompt": "Once", "max_tokens": 2}, headers={"origin": page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        other = httpx.post(s.url + COMP, json={"prompt": "Once", "max_tokens": 2},
                           headers={"origin": "http://evil.example"})
        _assert_openai_error(other, 403, "--cors-origin", "origin_not_allowed")
    finally:
        s.stop()


# -- SIGTERM with 40 streams ------------------------------------------------------------------------


def test_sigterm_with_40_streams_ends_each_with_a_reason(tmp_path):
    """32 streams run and 8 wait when SIGTERM comes: the 8 get 503 at once, the 32 a final chunk with
    finish_reason and an error object at the 2 s grace period; the process exits 0 within it (plus
    the engine's last step), with no traceback in its log."""
    need_shared(STORIES_HF)
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmsys.engine.cli.main", "serve", str(STORIES_HF), "--port", str(port),
             "--dtype", "float32", "--threads", "1", "--log-level", "info", "--max-num-seqs", "32",
             "--shutdown-timeout", "2", "--kv-policy", "sink:4,window:120"],
            stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    from llmsys.engine.server.serve import wait_until_healthy

    try:
        assert wait_until_healthy(url, proc, timeout_s=60), log.read_text()[-2000:]
        body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
        first = asyncio.Queue()

        async def one(c, i):
            async with c.stream("POST", url + COMP, json=body) as r:
                if r.status_code != 200:
                    await first.put(i)
                    return r.status_code, json.loads(await r.aread())
                frames = []
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        if not frames:
                            await first.put(i)
                        frames.append(json.loads(line[6:]))
                    elif line == "data: [DONE]":
                        frames.append("[DONE]")
                return 200, frames

        async def run():
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
                tasks = [asyncio.create_task(one(c, i)) for i in range(32)]
                for _ in range(32):
                    await asyncio.wait_for(first.get(), 60)  # every running stream has its first token
                tasks += [asyncio.create_task(one(c, i)) for i in range(32, 40)]
                while httpx.get(url + "/health").json()["queued"] < 8:
                    await asyncio.sleep(0.02)
                t0 = time.monotonic()
                proc.send_signal(15)
                res = await asyncio.gather(*tasks)
                return res, time.monotonic() - t0

        res, took = asyncio.run(run())
        rc = proc.wait(20)
        streamed, queued = res[:32], res[32:]
        for status, frames in streamed:
            assert status == 200 and frames[-1] == "[DONE]", frames[-3:]
            last = frames[-2]
            assert last["choices"][0]["finish_reason"] == "abort", last
            assert last["error"]["code"] == "server_shutdown", last
        for status, body in queued:
            assert status == 503 and body["error"]["code"] == "server_shutdown", body
        assert rc == 0 and took < 2 + 3, (rc, took)
        text = log.read_text()
        assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_api_key_can_come_from_a_file_not_the_command_line(tmp_path):
    from llmsys.engine.cli.serve_cmd import _api_key
    from llmsys.kernels.common.errors import InvalidParameterError

    f = tmp_path / "key"
    f.write_text("s3cret\n")
    assert _api_key(None, f) == "s3cret"
    f.write_text("\n")
    with pytest.raises(InvalidParameterError, match="is empty"):
        _api_key(None, f)
    with pytest.raises(InvalidParameterError, match="not both"):
        _api_key("x", f)


# -- the remaining error paths, each triggered -----------------------------------------------------


def test_health_says_stuck_then_shutting_down_and_new_requests_get_503(chat_dir, monkeypatch):
    s = _server(chat_dir, stall_timeout_s=0.3)
    core = s.state.worker.core
    real, slow = core.step, [True]

    def step():
        if slow[0]:
            slow[0] = False
            time.sleep(1.5)  # one step that runs past the stall limit
        return real()

    monkeypatch.setattr(core, "step", step)
    try:
        t = threading.Thread(target=lambda: httpx.post(s.url + COMP, json={"prompt": "Once", "max_tokens": 3},
                                                       timeout=30))
        t.start()
        deadline, seen = time.monotonic() + 5, None
        while time.monotonic() < deadline:
            h = httpx.get(s.url + "/health")
            if h.status_code == 503:
                seen = h.json()
                break
            time.sleep(0.05)
        t.join(30)
        assert seen is not None and seen["status"] == "stuck" and "0.3 s" in seen["reason"], seen
        assert httpx.get(s.url + "/health").json()["status"] == "ok"  # the step ended: healthy again
        s.state.begin_shutdown()
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "shutting_down"
        r = httpx.post(s.url + COMP, json={"prompt": "Once", "max_tokens": 3}, timeout=30)
        _assert_openai_error(r, 503, "shutting down", "server_shutdown")
    finally:
        s.stop()


def test_a_request_the_engine_ends_with_an_error_says_so(chat_dir, monkeypatch):
    """finish_reason "error" (the engine could not go on with that request alone): the stream's last
    chunk carries the message, a non-streaming request is a 503 naming it."""
    import dataclasses

    s = _server(chat_dir)
    core = s.state.worker.core
    real = core.step

    def step():
        return [dataclasses.replace(ch, finish_reason="error", error="simulated: its KV does not fit")
                if ch.finished else ch for ch in real()]

    monkeypatch.setattr(core, "step", step)
    try:
        body = {"prompt": "Once", "max_tokens": 4, "ignore_eos": True}
        with httpx.stream("POST", s.url + COMP, json={**body, "stream": True}, timeout=30) as r:
            frames = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        last = frames[-1]
        assert last["choices"][0]["finish_reason"] == "error"
        assert last["error"]["code"] == "request_failed" and "its KV does not fit" in last["error"]["message"]
        _assert_openai_error(httpx.post(s.url + COMP, json=body, timeout=30), 503, "its KV does not fit",
                             "request_failed")
    finally:
        s.stop()


def test_llmsys_run_says_why_the_engine_ended_a_request(monkeypatch, capsys):
    import dataclasses

    from llmsys.engine.cli.main import main
    from llmsys.engine.llm import LLM

    real = LLM.stream

    def stream(self, prompt, params=None):
        for ch in real(self, prompt, params):
            yield dataclasses.replace(ch, finish_reason="error", error="simulated: no room") if ch.finished else ch

    monkeypatch.setattr(LLM, "stream", stream)
    rc = main(["run", str(need_shared(STORIES_HF)), "Once", "-n", "3", "--no-pull"])
    err = capsys.readouterr().err
    assert rc == 1 and "error: simulated: no room" in err and "Traceback" not in err, err


def test_a_key_on_the_command_line_warns_and_binding_beyond_loopback_is_known(capsys):
    from llmsys.engine.cli.serve_cmd import _api_key
    from llmsys.engine.server.serve import _is_loopback

    assert _api_key("k", None) == "k"
    assert "visible to other users" in capsys.readouterr().err
    assert [_is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "192.168.1.2", "")] == \
        [True, True, True, False, False, False]
