"""The server's request log: one line per request at info (route, model, status, tokens, time to
first token, duration), a stream's when it ends or the client leaves, monitors' polls at debug;
and ``llmsys serve`` prints them at its default level."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import STORIES_HF, need_shared
from llmsys.engine.server.serve import wait_until_healthy

LINE = re.compile(r"(?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d{3})(?: model=(?P<model>\S+))?"
                  r"(?: prompt=(?P<prompt>\d+)(?: \(cached (?P<cached>\d+)\))? generated=(?P<generated>\d+))?"
                  r"(?: ttft=(?P<ttft>\d+) ms)? (?P<dur>[\d.]+) s(?P<stream> stream)?(?P<early> ended .*?)?"
                  r" from (?P<client>\S+)$")
BODY = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv():
    need_shared(STORIES_HF)
    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings(api_key="k"))
    state.attach(LLM(str(STORIES_HF), dtype="float32", threads=1, progress=False), "stories")
    s = start_server_thread(state)
    yield s
    s.stop()


def _lines(caplog, path: str, n: int = 1, timeout: float = 10.0) -> list[re.Match]:
    """The parsed request lines for ``path`` once ``n`` are logged (a stream's line comes after its last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        got = [LINE.match(r.getMessage()) for r in caplog.records
               if r.name == "llmsys.server" and r.levelno == logging.INFO and f" {path} " in r.getMessage()]
        if len(got) >= n or time.monotonic() > deadline:
            assert all(got), [r.getMessage() for r in caplog.records]
            return got
        time.sleep(0.02)


def test_completion_line_has_route_model_status_tokens_ttft_duration(srv, caplog):
    caplog.set_level(logging.INFO, logger="llmsys.server")
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer k"}, timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 200
    usage = r.json()["usage"]
    (m,) = _lines(caplog, "/v1/completions")
    assert (m["method"], m["status"], m["model"]) == ("POST", "200", "stories")
    assert int(m["prompt"]) == usage["prompt_tokens"] and int(m["generated"]) == usage["completion_tokens"] == 12
    assert 0 <= int(m["ttft"]) <= float(m["dur"]) * 1000 <= took * 1000 + 1
    assert m["stream"] is None and m["early"] is None and m["client"].startswith("127.0.0.1:")


def test_stream_line_when_it_ends(srv, caplog):
    caplog.set_level(logging.INFO, logger="llmsys.server")
    n = 0
    with httpx.stream("POST", srv.url + "/v1/completions", json={**BODY, "stream": True},
                      headers={"Authorization": "Bearer k"}, timeout=60) as r:
        for line in r.iter_lines():
            n += line.startswith("data: {")
    (m,) = _lines(caplog, "/v1/completions")
    assert m["status"] == "200" and m["stream"] and m["early"] is None
    assert int(m["generated"]) == 12 and int(m["prompt"]) > 0 and m["ttft"] is not None and n >= 1


def test_stream_the_client_leaves_is_said(srv, caplog):
    caplog.set_level(logging.INFO, logger="llmsys.server")
    body = {**BODY, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"},
                      timeout=60) as r:
        lines = r.iter_lines()
        next(lines)  # the first chunk, then hang up
    (m,) = _lines(caplog, "/v1/completions")
    assert m["status"] == "200" and m["stream"] and m["early"] and "client" in m["early"]
    assert int(m["generated"]) < 400


def test_errors_and_plain_routes_logged_polls_at_debug_only(srv, caplog):
    caplog.set_level(logging.INFO, logger="llmsys.server")
    assert httpx.post(srv.url + "/v1/completions", json=BODY).status_code == 401  # no key
    assert httpx.get(srv.url + "/v1/nope", headers={"Authorization": "Bearer k"}).status_code == 404
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/metrics").status_code == 200
    (denied,) = _lines(caplog, "/v1/completions")
    assert denied["status"] == "401" and denied["model"] is None and denied["prompt"] is None
    (missing,) = _lines(caplog, "/v1/nope")
    assert (missing["method"], missing["status"]) == ("GET", "404")
    assert not [r for r in caplog.records if "/health" in r.getMessage() or "/metrics" in r.getMessage()]
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="llmsys.server")
    httpx.get(srv.url + "/health")
    assert any(r.levelno == logging.DEBUG and r.getMessage().startswith("GET /health 200") for r in caplog.records)


def test_line_names_the_requests_model_and_embeddings_count_their_prompt(tmp_path, caplog):
    """With two models loaded, each line names the model its request used (not the first one), and the
    three embedding routes log their prompt tokens as the completions do."""
    need_shared(STORIES_HF)
    from test_server_multi import tiny_random

    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings())
    state.attach(LLM(str(STORIES_HF), dtype="float32", threads=1, progress=False), "stories")
    tiny = tiny_random(tmp_path / "tiny-a", 1)
    state.attach(LLM(str(tiny), dtype="float32", threads=1, progress=False), "tiny-a")
    s = start_server_thread(state)
    caplog.set_level(logging.INFO, logger="llmsys.server")
    try:
        r = httpx.post(s.url + "/v1/completions", json={**BODY, "model": "tiny-a"}, timeout=60)
        assert r.status_code == 200
        (m,) = _lines(caplog, "/v1/completions")
        assert m["model"] == "tiny-a" and int(m["prompt"]) == r.json()["usage"]["prompt_tokens"]
        for path, body, tokens in (
            ("/v1/embeddings", {"model": "tiny-a", "input": ["Once upon a time", "a cat"]},
             lambda j: j["usage"]["prompt_tokens"]),
            ("/api/embed", {"model": "tiny-a", "input": "Once upon a time"}, lambda j: j["prompt_eval_count"]),
            ("/api/embeddings", {"model": "stories", "prompt": "Once upon a time"}, None),
        ):
            r = httpx.post(s.url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            (m,) = _lines(caplog, path)
            assert m["model"] == body["model"], m.group(0)
            assert int(m["prompt"]) > 0 and m["generated"] == "0", m.group(0)
            if tokens is not None:
                assert int(m["prompt"]) == tokens(r.json()), (m.group(0), r.json())
        for path, body in (("/api/show", {"model": "tiny-a"}), ("/api/generate", {"model": "tiny-a", "prompt": ""})):
            assert httpx.post(s.url + path, json=body, timeout=60).status_code == 200  # no tokens: still named
            (m,) = _lines(caplog, path)
            assert m["model"] == "tiny-a" and m["prompt"] is None, m.group(0)
        r = httpx.post(s.url + "/v1/completions", json={**BODY, "model": "no-such-model"}, timeout=60)
        assert r.status_code == 404
        (_, missing) = _lines(caplog, "/v1/completions", 2)
        assert missing["status"] == "404" and missing["model"] is None  # never the first model's name
    finally:
        s.stop()


def test_cli_serve_prints_request_lines_at_its_default_level():
    """The bug: ``llmsys.server`` had no handler, so nothing below a warning reached the terminal."""
    need_shared(STORIES_HF)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llmsys.engine.cli.main", "serve", str(STORIES_HF), "--port",
                             str(port), "--dtype", "float32", "--threads", "1", "--no-pull"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_healthy(url, proc, timeout_s=60), proc.stderr.read() if proc.poll() is not None else "timeout"
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=60).status_code == 200
        proc.terminate()
        assert proc.wait(30) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    line = next((x for x in err.splitlines() if "POST /v1/completions 200" in x), None)
    assert line is not None, err
    assert line.startswith("INFO:") and re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d POST", line)
    m = LINE.search(line[line.index("POST"):])
    assert m and m["model"] and int(m["generated"]) == 12 and m["ttft"]
    assert "GET /health" not in err  # the readiness polls above: debug only
