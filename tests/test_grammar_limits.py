"""Output constraints that cannot be honoured are refused before they run.

A regex, grammar or JSON schema whose language is empty, whose shortest output does not fit the
token budget, or which llguidance cannot run within its lexer/Earley limits is a one-line 400
(``invalid_grammar``) on /v1/completions, /v1/chat/completions (``response_format``) and Ollama's
/api/generate and /api/chat (``format``), streamed or not, before any 200 header; the ``openai``
client does not retry it. A constraint that reaches a dead end mid-generation ends its request
with finish_reason "error", never a normal stop. Unit tests drive GrammarConstraint directly on
stories260k's vocabulary; the server tests share one in-process server (stories260k-hf with a
chat template).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import STORIES_HF, need_shared
from llmsys.kernels.common.errors import InvalidParameterError
from test_server import _chat_model

NAME = "stories-chat"
MSGS = [{"role": "user", "content": "Tell a story."}]
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
HUGE_ARRAY = {"type": "array", "items": {"type": "number"}, "minItems": 1000000000}
# (kind, source, what the one-line refusal says): the list of constraints the server used to
# answer with '' and "stop", a truncated document with "length", or a retried 503.
IMPOSSIBLE = [
    ("regex", "a{99999999}", "the regex needs at least"),
    ("regex", r"[^\x00-\x{10FFFF}]", "the regex matches no string"),
    ("lark", "start: start", "rule 'start' never terminates"),
    ("gbnf", "root ::= root", "rule 'root' never terminates"),
    ("json_schema", json.dumps({"$ref": "#"}), "the JSON schema matches no value"),
    ("json_schema", json.dumps(HUGE_ARRAY), "no output of this JSON schema that fits in"),
    ("json_schema", json.dumps(RECURSIVE), "the JSON schema needs at least"),
    ("regex", "(a|b)*c{1000}(d{1000}){1000}", "the regex needs at least"),
    ("lark", 'start: "a"{1000000}', "the grammar needs at least"),
]
IDS = ["huge-repeat", "empty-class", "lark-self", "gbnf-self", "ref-self", "min-items", "ref-required", "lexer-blowup",
       "lark-repeat"]


# -- GrammarSpec / GrammarConstraint directly --------------------------------------------------


@pytest.fixture(scope="module")
def vocab():
    need_shared(STORIES_HF)
    from llmsys.engine.grammar import GrammarVocab
    from llmsys.engine.tokenizer import Tokenizer

    return GrammarVocab(Tokenizer.load(STORIES_HF), 512, [2])


@pytest.mark.parametrize("kind,source,says", IMPOSSIBLE, ids=IDS)
def test_impossible_constraint_is_refused_in_one_line(vocab, kind, source, says):
    from llmsys.engine.grammar import GrammarConstraint, GrammarSpec

    with pytest.raises(InvalidParameterError) as e:
        GrammarConstraint(vocab, GrammarSpec(kind, source), budget=200)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_engine_limits_are_named_when_the_budget_is_large(vocab):
    """With room for the forced run, the constraint gets as far as llguidance's own limits; the
    refusal names the limit it hit rather than failing mid-generation."""
    from llmsys.engine.grammar import GrammarConstraint, GrammarSpec

    for spec in (GrammarSpec("regex", "(a|b)*c{1000}(d{1000}){1000}"), GrammarSpec("lark", 'start: "a"{1000000}'),
                 GrammarSpec("json_schema", json.dumps(RECURSIVE))):
        with pytest.raises(InvalidParameterError) as e:
            GrammarConstraint(vocab, spec, budget=131072)
        msg = str(e.value)
        assert "beyond the grammar engine's limits" in msg and ("lexer" in msg or "parser" in msg), msg


def test_the_budget_boundary_is_the_shortest_output(vocab):
    """The refusal's token count is the real minimum: that many tokens is accepted, one fewer is not."""
    import re

    from llmsys.engine.grammar import GrammarConstraint, GrammarSpec

    spec = GrammarSpec("regex", "[0-9]{6}-[a-z]{3}")
    with pytest.raises(InvalidParameterError) as e:
        GrammarConstraint(vocab, spec, budget=1)
    need = int(re.search(r"allows is (\d+) tokens", str(e.value)).group(1))
    assert need > 1 and "raise max_tokens" in str(e.value)
    GrammarConstraint(vocab, spec, budget=need)
    with pytest.raises(InvalidParameterError):
        GrammarConstraint(vocab, spec, budget=need - 1)


@pytest.mark.parametrize("kind,source,pattern", [
    ("regex", "x+yz", r"x+yz"),
    ("regex", "[a-z]*z", r"[a-z]*z"),  # the plain closer order would write 'a' forever
    ("lark", 'start: "a" start | "bc"', r"a*bc"),
    ("lark", 'start: "q" start | "zz" "y"', r"q*zzy"),
    ("gbnf", 'root ::= "yes" | "no"', r"yes|no"),
])
def test_formats_the_plain_closer_would_loop_on_still_run(vocab, kind, source, pattern):
    """The up-front search explores when its usual order loops, so these are not refused; and
    sampling under them, with the budget they were given, ends in a complete output."""
    import re

    import torch

    from llmsys.engine.grammar import GrammarConstraint, GrammarSpec

    for seed in range(3):
        con = GrammarConstraint(vocab, GrammarSpec(kind, source), budget=40)
        g, out = torch.Generator().manual_seed(seed), []
        for _ in range(40):
            allowed = con.allowed(512)
            w = torch.rand(512, generator=g)
            w[~allowed] = -1
            t = int(w.argmax())
            con.advance(t)
            if t == 2:
                break
            out.append(t)
        text = vocab.lltok.decode_str(out)
        assert re.fullmatch(pattern, text), (source, text)


def _dead_end(vocab):
    """A constraint that can still end ('bc') but has just taken the branch that cannot ('a', then x: x)."""
    import numpy as np

    from llmsys.engine.grammar import GrammarConstraint, GrammarSpec

    con = GrammarConstraint(vocab, GrammarSpec("lark", 'start: "a" x | "bc"\nx: x'), budget=50)
    first = np.flatnonzero(con.allowed(512).numpy())
    a = next(int(t) for t in first if vocab.lltok.decode_bytes([int(t)]) == b"a")
    return con, a


def test_a_dead_end_mid_generation_raises_instead_of_allowing_only_eos(vocab):
    con, a = _dead_end(vocab)
    con.advance(a)
    with pytest.raises(ValueError, match="dead end"):
        con.allowed(512)
    con, a = _dead_end(vocab)
    con.prefetch()  # computed ahead on the engine's mask thread: the failure is kept for allowed()
    con.advance(a)
    con.prefetch()
    with pytest.raises(ValueError, match="dead end"):
        con.allowed(512)


def test_eos_before_the_output_is_complete_raises(vocab):
    from llmsys.engine.grammar import GrammarConstraint, GrammarSpec

    con = GrammarConstraint(vocab, GrammarSpec("regex", "[0-9]{4}"), budget=20)
    con.allowed(512)
    with pytest.raises(ValueError, match="before it was complete"):
        con.advance(2)


def test_the_engine_ends_a_dead_end_request_with_finish_reason_error(vocab):
    from llmsys import LLM, SamplingParams

    llm = LLM(str(STORIES_HF), dtype="float32", progress=False)
    con, a = _dead_end(vocab)
    con.advance(a)
    rid = llm.core.add_request(llm.encode("Once upon a time"), SamplingParams(max_tokens=20, temperature=0),
                               constraint=con)
    final = None
    for _ in range(50):
        for ch in llm.core.step():
            assert ch.request_id == rid and ch.token_ids == []  # nothing is emitted from a dead end
            if ch.finished:
                final = ch
        if final is not None:
            break
    assert final is not None and final.finish_reason == "error" and final.error_code == "constraint_failed"
    assert "dead end" in final.error and "\n" not in final.error


# -- through a real server, both APIs, streamed or not ----------------------------------------


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    need_shared(STORIES_HF)
    import torch

    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    torch.set_num_threads(2)
    state = ServerState(ServerSettings())
    state.attach(LLM(str(_chat_model(tmp_path_factory.mktemp("m"))), dtype="float32"), NAME)
    s = start_server_thread(state)
    yield s
    s.stop()


def _response_format(kind: str, source: str) -> dict:
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(source)}}
    if kind == "regex":
        return {"type": "regex", "regex": source}
    return {"type": "grammar", "grammar": source, "syntax": kind}


class _Counting:
    """An openai client (2 retries allowed, as by default) that counts the HTTP requests it sends."""

    def __init__(self, srv):
        self.sent = 0
        http = httpx.Client(event_hooks={"request": [self._count]}, timeout=60)
        self.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=2, http_client=http)

    def _count(self, request):
        self.sent += 1


@pytest.mark.parametrize("kind,source,says", IMPOSSIBLE, ids=IDS)
def test_openai_client_gets_400_without_retrying(srv, kind, source, says):
    c = _Counting(srv)
    fmt = _response_format(kind, source)
    calls = [
        lambda s: c.client.completions.create(model=NAME, prompt="Once", stream=s, extra_body={"response_format": fmt}),
        lambda s: c.client.chat.completions.create(model=NAME, messages=MSGS, stream=s,
                                                   extra_body={"response_format": fmt}),
    ]
    for call in calls:
        for stream in (False, True):
            before = c.sent
            with pytest.raises(openai.BadRequestError) as e:
                call(stream)
            assert c.sent - before == 1  # a 400 is final: the client did not retry it
            body = e.value.body
            assert body["code"] == "invalid_grammar" and body["param"] == "response_format"
            assert says in body["message"] and "\n" not in body["message"], body["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_refusal_is_a_plain_400_before_any_event(srv, path):
    body = {"model": NAME, "stream": True, "response_format": _response_format("lark", "start: start")}
    body.update({"prompt": "Once"} if path == "/v1/completions" else {"messages": MSGS})
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        raw = r.read()
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert "never terminates" in json.loads(raw)["error"]["message"]


OLLAMA = [c for c in IMPOSSIBLE if c[0] == "json_schema"]  # Ollama's format takes "json" or a JSON schema


@pytest.mark.parametrize("kind,source,says", OLLAMA, ids=["ref-self", "min-items", "ref-required"])
def test_ollama_format_gets_400_on_generate_and_chat(srv, kind, source, says):
    for path, extra in (("/api/generate", {"prompt": "Once"}), ("/api/chat", {"messages": MSGS})):
        for stream in (False, True):
            body = {"model": NAME, "format": json.loads(source), "stream": stream, **extra}
            with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
                raw = r.read()
            assert r.status_code == 400, (path, stream, raw)
            assert not r.headers["content-type"].startswith("application/x-ndjson")
            msg = json.loads(raw)["error"]
            assert says in msg and "\n" not in msg, msg


def test_a_dead_end_through_the_server_is_not_a_normal_stop(srv, vocab):
    """The model pushed (logit_bias) into the grammar's branch that cannot end: the request fails
    with the dead end named, not a 200 whose output breaks the grammar."""
    _, a = _dead_end(vocab)
    fmt = {"type": "grammar", "grammar": 'start: "a" x | "bc"\nx: x', "syntax": "lark"}
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": MSGS, "max_tokens": 20, "logit_bias": {str(a): 100}, "response_format": fmt})
    # 422, not a 5xx: the same request would reach the same dead end, so clients must not retry it
    assert r.status_code == 422 and "dead end" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "constraint_failed"
    events = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60, json={
            "model": NAME, "messages": MSGS, "max_tokens": 20, "logit_bias": {str(a): 100}, "stream": True,
            "response_format": fmt}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    finishes = [ch["finish_reason"] for e in events for ch in e.get("choices", []) if ch.get("finish_reason")]
    assert "stop" not in finishes and any("dead end" in json.dumps(e) for e in events), events
