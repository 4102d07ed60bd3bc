"""``llmsys serve`` against clients that hold resources (issue #48): a body trickled in is cut
off by the whole-body deadline, connections over the total and per-client caps get a 503 at
once while ``/health`` still answers, a prompt over ``--max-prompt-tokens`` is a 400 whatever
the KV policy and the endpoint, a stream whose client stops reading is aborted and its slot
freed, huge bodies are refused by their counts, and no error a client sees names a path on
the server.

Real sockets against in-process servers on loopback serving stories260k-hf (float32), with
short deadlines so each case takes seconds. Connections from 127.0.0.2 and 127.0.0.3 stand
for other client addresses (Linux routes all of 127/8 to loopback).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import STORIES_HF, need_shared
from test_server import _chat_model

COMP, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/api/generate"
SLIDING = "sink:4,window:200"  # lets a request run past the 512-token context
LIMIT = 'llmsys_limit_hits_total{{limit="{}"}}'


def _server(model: Path, **settings):
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings(**settings))
    state.attach(LLM(str(model), dtype="float32", progress=False), "stories")
    return start_server_thread(state)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    need_shared(STORIES_HF)
    return _chat_model(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def srv(chat_dir):
    """Short deadlines, small caps, a 64-token prompt limit, a 1 s send timeout."""
    s = _server(chat_dir, body_timeout_s=1.0, body_deadline_s=2.0, head_timeout_s=20.0,
                max_connections=12, max_connections_per_client=4, max_prompt_tokens=64, send_timeout_s=1.0)
    yield s
    s.stop()


def _metric(srv, name: str) -> float:
    from llmsys.engine.server.metrics import parse_metrics

    return parse_metrics(httpx.get(srv.url + "/metrics", timeout=10).text).get(name, 0)


def _connect(srv, source: str = "127.0.0.1", rcvbuf: int | None = None, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window is set then
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", srv.port))
    return s


def _read_all(s: socket.socket) -> bytes:
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


def _post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


def _health_ms(srv) -> float:
    t0 = time.monotonic()
    r = httpx.get(srv.url + "/health", timeout=5)
    assert r.status_code == 200, r.text
    return (time.monotonic() - t0) * 1000


# -- slow senders -------------------------------------------------------------------------------


def test_a_body_trickled_in_is_cut_off_by_the_whole_body_deadline(srv):
    """One byte every 0.4 s never trips the 1 s stall timeout; the 2 s body deadline closes it."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2}).encode()
    hits = _metric(srv, LIMIT.format("body_deadline"))
    s = _connect(srv)
    t0 = time.monotonic()
    s.sendall(_post_head(COMP, len(body)))
    closed_by_server = False
    try:
        for b in body:
            s.sendall(bytes([b]))
            time.sleep(0.4)
            if time.monotonic() - t0 > 8:
                break
    except (BrokenPipeError, ConnectionResetError):
        closed_by_server = True
    got = _read_all(s)
    took = time.monotonic() - t0
    s.close()
    assert closed_by_server or got, "the server never answered the trickling sender"
    assert took < 8, f"the connection stayed open {took:.1f} s"
    if got:  # the 408 arrives before the close (it may be lost to a reset while the client still writes)
        assert b" 408 " in got.split(b"\r\n")[0], got[:200]
        assert b"did not arrive within 2 s" in got and b"--body-deadline" in got, got
    assert _health_ms(srv) < 5000
    assert _metric(srv, LIMIT.format("body_deadline")) == hits + 1


# -- connection caps ----------------------------------------------------------------------------


def _ask(s: socket.socket, head: bytes) -> tuple[bytes, float]:
    t0 = time.monotonic()
    s.sendall(head)
    got = _read_all(s)
    s.close()
    return got, time.monotonic() - t0


def _over_cap(got: bytes, flag: str) -> None:
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), got[:300]
    err = json.loads(body)["error"]
    assert err["code"] == "too_many_connections" and flag in err["message"], err


def test_connections_over_the_caps_get_a_503_and_health_still_answers(srv):
    """Over a cap a connection gets a 503 for anything but /health, which one of 16 spare places
    answers (then closes); with the spare places taken too, a 503 comes at once, unasked."""
    from llmsys.engine.server.serve import HEALTH_SLOTS

    post = _post_head(COMP, 2) + b"{}"
    health = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    held = [_connect(srv, "127.0.0.2") for _ in range(4)]  # the per-client cap (4), sending nothing
    try:
        time.sleep(0.2)
        got, took = _ask(_connect(srv, "127.0.0.2"), post)
        _over_cap(got, "--max-connections-per-client")
        assert took < 2, f"the over-cap connection took {took:.2f} s to be refused"
        got, took = _ask(_connect(srv, "127.0.0.2"), health)  # a spare place: /health answers, then closes
        assert got.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in got and took < 2, (got[:300], took)
        assert _health_ms(srv) < 2000  # another address gets in as usual

        held += [_connect(srv, f"127.0.0.{k}") for k in (3, 3, 3, 3, 4, 4, 4, 4)]  # 12 now: the total cap
        time.sleep(0.2)
        got, _ = _ask(_connect(srv, "127.0.0.5"), post)
        _over_cap(got, "(--max-connections)")
        spare = [_connect(srv, "127.0.0.5") for _ in range(HEALTH_SLOTS)]  # the spare places, idle
        time.sleep(0.2)
        t0 = time.monotonic()
        extra = _connect(srv, "127.0.0.6")
        got = _read_all(extra)  # nothing sent: the 503 comes unasked
        extra.close()
        _over_cap(got, "(--max-connections)")
        assert time.monotonic() - t0 < 2
        for s in spare:  # an idle spare place is closed after 1 s without a request head
            assert _read_all(s) == b""
            s.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10  # closing them gives the places back
    while True:
        try:
            _health_ms(srv)
            break
        except (AssertionError, httpx.HTTPError):
            assert time.monotonic() < deadline, "the connection places were not given back"
            time.sleep(0.1)
    assert srv.state.worker.health().running == 0
    assert _metric(srv, LIMIT.format("max_connections_per_client")) >= 2
    assert _metric(srv, LIMIT.format("max_connections")) >= 2 + HEALTH_SLOTS


def test_the_default_connection_cap_sits_below_the_open_file_limit():
    import resource

    from llmsys.engine.server.state import FD_RESERVE, ConnectionCaps, ServerSettings, default_max_connections

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = default_max_connections()
    assert cap <= 1024 and (soft == resource.RLIM_INFINITY or cap <= max(8, soft - FD_RESERVE)), (cap, soft)
    caps = ConnectionCaps.of(ServerSettings(max_connections=100))
    assert (caps.total, caps.per_client) == (100, 100)
    assert ConnectionCaps.of(ServerSettings(max_connections=2000)).per_client == 256


# -- prompt limit -------------------------------------------------------------------------------


LONG_TEXT = " ".join(["Once upon a time there was a little girl named Lily."] * 30)  # ~400 tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [
    (COMP, {"prompt": LONG_TEXT}),
    (COMP, {"prompt": list(range(1, 101))}),  # 100 token ids
    (CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}),
    (GEN, {"model": "stories", "prompt": LONG_TEXT}),
], ids=["completions-text", "completions-ids", "chat", "ollama-generate"])
def test_a_prompt_over_max_prompt_tokens_is_a_400_even_with_a_sliding_window(srv, path, body, stream):
    r = httpx.post(srv.url + path, json={**body, "stream": stream, "max_tokens": 4, "kv_policy": SLIDING}
                   if path != GEN else {**body, "stream": stream}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    msg = err if isinstance(err, str) else err["message"]
    assert "limit of 64" in msg and "--max-prompt-tokens" in msg, msg
    n = int(re.search(r"prompt has (?:at least )?(\d+) tokens", msg).group(1))
    assert n > 64, msg
    if path == COMP and isinstance(body["prompt"], list):
        assert n == 100, msg
    if not isinstance(err, str):
        assert err["code"] == "prompt_too_long" and err["max_prompt_tokens"] == 64


def test_a_prompt_within_the_limit_still_runs(srv):
    r = httpx.post(srv.url + COMP, json={"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_huge_bodies_are_refused_by_their_counts(srv):
    """1.3M token ids or 108k messages: a 413 from the count of JSON values, taken from the raw
    bytes before any parsing. Under that count, token ids over the prompt limit and messages over
    MAX_MESSAGES are 400s naming the count and the limit, found before pydantic walks them."""
    from llmsys.engine.server.protocol import MAX_JSON_VALUES, MAX_MESSAGES

    for path, body in ((COMP, {"prompt": [7] * 1_300_000, "max_tokens": 2}),
                       (CHAT, {"messages": [{"role": "user", "content": "hi"}] * 108_000})):
        r = httpx.post(srv.url + path, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413, r.text[:300]
        err = r.json()["error"]
        assert f"more than {MAX_JSON_VALUES} JSON values" in err["message"], err
        assert err["code"] == "request_too_large", err
    r = httpx.post(srv.url + COMP, json={"prompt": [7] * 200_000, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "200000 tokens" in r.text and "limit of 64" in r.text, r.text[:300]
    r = httpx.post(srv.url + GEN, json={"model": "stories", "prompt": "x", "context": [7] * 100_000}, timeout=60)
    assert r.status_code == 400 and "100000 tokens" in r.text, r.text[:300]
    r = httpx.post(srv.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}] * 20_000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
    assert str(MAX_MESSAGES) in r.json()["error"]["message"], r.text[:300]
    bad = b'{"prompt": "' + b"x" * 200_000 + b'", oops}'  # invalid JSON in a large body: the usual 400
    r = httpx.post(srv.url + COMP, content=bad, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text[:300]
    assert "JSON" in r.json()["error"]["message"], r.text[:300]


def test_health_answers_while_large_bodies_are_parsed(srv):
    """Four ~4 MB bodies of 1.3M token ids each: counted on the preparation thread, never parsed;
    /health's worst latency stays under 150 ms (or 3x what a quiet second saw, on a loaded machine)."""
    payload = json.dumps({"prompt": [7] * 1_300_000, "max_tokens": 2}).encode()
    samples, done = [], threading.Event()

    def poll():
        # one connection, from its own address (the four senders fill 127.0.0.1's cap of 4)
        with httpx.Client(timeout=10, transport=httpx.HTTPTransport(local_address="127.0.0.7")) as c:
            while not done.is_set():
                t0 = time.monotonic()
                assert c.get(srv.url + "/health").status_code == 200
                samples.append((t0, time.monotonic() - t0))
                time.sleep(0.02)

    h = threading.Thread(target=poll)
    h.start()
    time.sleep(1.0)
    t_busy = time.monotonic()
    rs: list[httpx.Response] = []

    def send():
        rs.append(httpx.post(srv.url + COMP, content=payload, headers={"content-type": "application/json"},
                             timeout=60))

    senders = [threading.Thread(target=send) for _ in range(4)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(60)
    time.sleep(0.3)
    done.set()
    h.join(30)
    assert len(rs) == 4 and all(r.status_code == 413 for r in rs), [r.status_code for r in rs]
    quiet = [v for at, v in samples if at < t_busy]
    busy = [v for at, v in samples if at >= t_busy]
    assert len(quiet) >= 3 and len(busy) >= 3, (len(quiet), len(busy))
    assert max(busy) < max(0.15, 3 * max(quiet)), f"/health worst {max(busy) * 1000:.0f} ms " \
                                                  f"(quiet {max(quiet) * 1000:.0f} ms)"


# -- backpressure -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMP, CHAT])
def test_a_stream_whose_client_stops_reading_is_aborted_and_its_slot_freed(srv, path, caplog):
    """A raw socket with a small receive buffer that never reads: once the (bounded) socket
    buffers fill, the next send waits 1 s (--send-timeout here) and the stream is aborted, its
    slot freed and one line logged, thousands of tokens before max_tokens. (Ollama's NDJSON
    streams go out through the same BoundedStream.)"""
    body = {"stream": True, "max_tokens": 100000, "ignore_eos": True, "kv_policy": SLIDING}
    if path == COMP:
        body["prompt"] = "Once upon a time"
    else:
        body["messages"] = [{"role": "user", "content": "Once upon a time"}]
    data = json.dumps(body).encode()
    before = _metric(srv, "llmsys_generation_tokens_total")
    s = _connect(srv, rcvbuf=4096)
    with caplog.at_level(logging.WARNING, logger="llmsys.server"):
        s.sendall(_post_head(path, len(data)) + data)  # and never read
        t0 = time.monotonic()
        time.sleep(0.5)
        assert srv.state.worker.health().running == 1, "the stream did not start"
        while srv.state.worker.health().running:
            assert time.monotonic() - t0 < 90, "the stream kept its slot for a client that reads nothing"
            time.sleep(0.1)
    generated = _metric(srv, "llmsys_generation_tokens_total") - before
    s.close()
    assert 0 < generated < 20000, generated  # well before max_tokens (100000)
    lines = [r.getMessage() for r in caplog.records if "aborted" in r.getMessage()]
    assert len(lines) == 1 and "--send-timeout 1 s" in lines[0], lines
    assert _metric(srv, LIMIT.format("send_timeout")) >= 1
    assert _health_ms(srv) < 5000


def test_a_stalled_stream_is_aborted_by_its_backlog_before_the_send_timeout(chat_dir, caplog):
    """With a long --send-timeout the bound on chunks waiting behind the blocked send ends it:
    the engine decodes at most about MAX_UNSENT_CHUNKS tokens past the full socket buffers."""
    from llmsys.engine.server.completions import MAX_UNSENT_CHUNKS

    srv = _server(chat_dir, send_timeout_s=300.0)
    try:
        data = json.dumps({"prompt": "Once upon a time", "stream": True, "max_tokens": 100000, "ignore_eos": True,
                           "kv_policy": SLIDING}).encode()
        before = _metric(srv, "llmsys_generation_tokens_total")
        s = _connect(srv, rcvbuf=4096)
        with caplog.at_level(logging.WARNING, logger="llmsys.server"):
            s.sendall(_post_head(COMP, len(data)) + data)
            t0 = time.monotonic()
            time.sleep(0.5)
            while srv.state.worker.health().running:
                assert time.monotonic() - t0 < 120, "the stream kept its slot for a client that reads nothing"
                time.sleep(0.1)
        generated = _metric(srv, "llmsys_generation_tokens_total") - before
        s.close()
        lines = [r.getMessage() for r in caplog.records if "aborted" in r.getMessage()]
        assert len(lines) == 1 and f"at most {MAX_UNSENT_CHUNKS} chunks" in lines[0], lines
        waited = int(re.search(r"while (\d+) chunks waited", lines[0]).group(1))
        assert waited > MAX_UNSENT_CHUNKS and generated < 20000, (waited, generated)
        assert _metric(srv, LIMIT.format("unsent_backlog")) == 1
    finally:
        srv.stop()


# -- no server paths in client-facing errors ----------------------------------------------------


@pytest.mark.parametrize("path,body", [
    (COMP, {"prompt": "Once", "max_tokens": 2}),
    (CHAT, {"messages": [{"role": "user", "content": "Once"}], "max_tokens": 2}),
    (GEN, {"model": "stories", "prompt": "Once", "stream": False}),
])
@pytest.mark.parametrize("kind", ["missing", "invalid"])
def test_errors_name_the_file_not_the_servers_path(srv, chat_dir, monkeypatch, path, body, kind):
    """A file the tokenizer cannot find (500) or finds invalid (400): the message names the
    file, never the directory the server keeps the model in."""
    from llmsys.kernels.common.errors import TokenizerError

    where = f"{chat_dir.resolve()}/tokenizer_config.json"

    def fail(*args, **kwargs):
        if kind == "missing":
            raise FileNotFoundError(2, "No such file or directory", where)
        raise TokenizerError(f"invalid chat template in {where}: unexpected end of template")

    tok = srv.state.llm.tokenizer
    monkeypatch.setattr(tok, "encode", fail)
    monkeypatch.setattr(tok, "apply_chat_template", fail)
    r = httpx.post(srv.url + path, json=body, timeout=30)
    assert r.status_code == (500 if kind == "missing" else 400), r.text
    assert "tokenizer_config.json" in r.text, r.text
    assert str(chat_dir.resolve()) not in r.text and str(chat_dir) not in r.text, r.text


def test_redact_paths_keeps_routes_and_urls():
    from llmsys.engine.server.protocol import redact_paths

    assert redact_paths("cannot open /srv/models/llama/model.gguf: denied") == "cannot open model.gguf: denied"
    assert redact_paths("model '/home/u/m/' failed") == "model 'm' failed"
    kept = "GET /v1/models lists it; see https://example.com/a/b/c and ./rel/path"
    assert redact_paths(kept) == kept


@pytest.mark.parametrize("flag,value,needle", [
    ("--max-connections", "0", "--max-connections must be >= 1, got 0"),
    ("--max-connections-per-client", "-3", "--max-connections-per-client must be >= 1, got -3"),
    ("--max-prompt-tokens", "0", "--max-prompt-tokens must be >= 1, got 0"),
    ("--body-deadline", "0", "--body-deadline must be > 0 seconds, got 0"),
    ("--send-timeout", "-1", "--send-timeout must be > 0 seconds, got -1"),
])
def test_bad_limit_flags_are_one_error_line(flag, value, needle, capsys):
    from llmsys.engine.cli.main import main

    rc = main(["serve", str(need_shared(STORIES_HF)), flag, value, "--no-pull"])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if not ln.startswith("notice:")]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1 and needle in lines[0], (rc, out, err)


def test_300_idle_connections_under_ulimit_256_leave_health_answering_and_the_log_quiet(tmp_path):
    """The issue's accept storm: `llmsys serve` under an open-file limit of 256 with 300 connections
    that send nothing. The default cap (256 - 64 = 192) refuses the rest itself, /health from
    another address is answered by a spare place, and the log holds a line or two, no traceback."""
    import resource
    import subprocess
    import sys

    from llmsys.engine.server.serve import wait_until_healthy
    from test_server import _free_port

    model = need_shared(STORIES_HF)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024 and (hard == resource.RLIM_INFINITY or hard >= 1024):
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # this process's 300 client sockets
    elif soft < 1024:
        pytest.skip(f"the open-file limit here ({hard}) leaves no room for 300 client sockets")
    port = _free_port()
    log = tmp_path / "serve.log"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llmsys.engine.cli.main", "serve", str(model), "--port", str(port),
                                 "--dtype", "float32", "--threads", "1", "--no-pull"],
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit)
    url = f"http://127.0.0.1:{port}"
    socks = []
    try:
        assert wait_until_healthy(url, proc, timeout_s=60), log.read_text()[-2000:]
        for _ in range(300):
            s = socket.socket()
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            socks.append(s)
        time.sleep(2.0)
        worst = 0.0
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=5,
                          limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for _ in range(10):
                t0 = time.monotonic()
                assert c.get(url + "/health").status_code == 200
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.05)
        assert worst < 1.0, f"/health took {worst * 1000:.0f} ms"
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        assert fds < 256, fds  # the cap holds the server under its limit
        refused = 0
        for s in socks:  # those over the cap were answered 503 unasked; the rest wait (or sit in the backlog)
            s.setblocking(False)
            try:
                refused += s.recv(4096).startswith(b"HTTP/1.1 503")
            except (BlockingIOError, ConnectionResetError):
                pass
        assert refused >= 1, "no connection was refused over the cap"
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "Traceback" not in text and len(text) < 4000, text[-3000:]
    assert text.count("accept() failed") <= 2 and text.count("connections over the cap") <= 2, text


def test_accept_failures_are_one_log_line_per_interval(caplog):
    """asyncio reports each failed accept() (EMFILE) to the loop's exception handler, with a
    traceback by default: 155,525 of them in 11 s in the issue. Here: counted, one line per 10 s;
    anything else still reaches the handler that was there before."""
    import asyncio
    import errno

    from llmsys.engine.server.serve import AcceptErrorLog

    seen = []
    handler = AcceptErrorLog(lambda loop, ctx: seen.append(ctx["message"]))
    loop = asyncio.new_event_loop()
    try:
        ctx = {"message": "socket.accept() out of system resource",
               "exception": OSError(errno.EMFILE, "Too many open files")}
        with caplog.at_level(logging.ERROR, logger="llmsys.server"):
            for _ in range(5000):
                handler(loop, ctx)
            handler(loop, {"message": "something else"})
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "Too many open files" in lines[0] and "ulimit -n" in lines[0], lines
    assert handler.count == 4999 and seen == ["something else"]
