"""Tool calling on a chat template with no tool format of its own (the generic format), driven
by the real clients (``openai``, LangChain's ``ChatOpenAI.bind_tools``, ``ollama``) against a
real ``llmsys serve`` of the SmolLM2-135M-Instruct GGUF (a ChatML template that knows nothing of
tools). Under ``required`` and a named choice every call must parse and its arguments must be
valid under the tool's JSON schema; under ``auto`` the model may call or answer, and either must
be well-formed; a tool result sent back must render and get a text answer. The rewriting of a
conversation into the generic format and the first-token constraint are checked without a server
on stories260k's vocabulary.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest

from conftest import SHARED, STORIES_HF, need_shared

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema comes with schemathesis (test extra)")

SMOLLM = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                   "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
RESULT = {"temperature": 18, "unit": "celsius", "sky": "sunny"}


def _valid(name: str, args: Any) -> None:
    """The arguments (JSON text or an object) are valid under the tool's schema: raises if not."""
    jsonschema.validate(json.loads(args) if isinstance(args, str) else args, SCHEMAS[name])


@pytest.fixture(scope="module")
def srv():
    need_shared(SMOLLM)
    import torch

    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    torch.set_num_threads(2)
    state = ServerState(ServerSettings())
    state.attach(LLM(str(SMOLLM), max_model_len=2048), NAME)
    s = start_server_thread(state)
    yield s
    s.stop()


def _client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _streamed(chunks) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of an OpenAI chat stream, as a client reassembles it."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish


# -- the openai client ---------------------------------------------------------------------------


def test_template_has_no_tool_format(srv):
    from llmsys.engine.server.tools import detect_format

    assert detect_format(srv.state.llm.tokenizer.chat_template_source(tools=True)) is None


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_openai_forced_calls_are_schema_valid_streamed_and_not(srv, choice):
    c = _client(srv)
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=120)
    ch = c.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert ch.message.tool_calls
    for call in ch.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call.function.name, call.function.arguments)
    if choice is NAMED:
        assert [t.function.name for t in ch.message.tool_calls] == ["get_weather"]
    content, calls, finish = _streamed(c.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and not content  # nothing outside the calls leaks out as text
    assert calls == [(t.function.name, t.function.arguments) for t in ch.message.tool_calls]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_calls_parse_and_parallel_false_gives_one(srv, seed):
    c = _client(srv)
    for parallel in (True, False):
        r = c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                      parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=120)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls"
        for t in calls:
            _valid(t.function.name, t.function.arguments)
        if not parallel:
            assert len(calls) == 1


@pytest.mark.parametrize("seed", [0, 7])
def test_auto_is_a_valid_call_or_plain_text(srv, seed):
    c = _client(srv)
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER], temperature=1.0, seed=seed, max_tokens=40)
    ch = c.chat.completions.create(**kw).choices[0]
    if ch.message.tool_calls:
        assert ch.finish_reason == "tool_calls" and not ch.message.content
        for t in ch.message.tool_calls:
            _valid(t.function.name, t.function.arguments)
    else:  # an answer: text that does not open a call (the grammar binds one that does)
        assert ch.message.content and ch.message.content.lstrip()[:1] not in ("{", "[")
        assert ch.finish_reason in ("stop", "length")
    content, calls, finish = _streamed(c.chat.completions.create(stream=True, **kw))
    assert (content, calls) == (ch.message.content or "", [(t.function.name, t.function.arguments)
                                                           for t in ch.message.tool_calls or []])
    assert finish == ch.finish_reason


def test_openai_round_trip_renders_the_result_and_answers(srv):
    from llmsys.engine.server.tools import chat_messages

    c = _client(srv)
    first = c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="required",
                                      temperature=0, max_tokens=80).choices[0]
    (call,) = first.message.tool_calls
    _valid(call.function.name, call.function.arguments)
    follow = ASK + [first.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)}]
    r = c.chat.completions.create(model=NAME, messages=follow, tools=[WEATHER], tool_choice="none", temperature=0,
                                  max_tokens=60)
    m = r.choices[0].message
    assert m.tool_calls is None and m.content and m.content.lstrip()[:1] not in ("{", "[")
    assert r.choices[0].finish_reason in ("stop", "length")
    # What the server rendered: the call as the JSON the model wrote, the result as a user turn.
    tok = srv.state.llm.tokenizer
    msgs, tools = chat_messages(tok, [
        *ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                            "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)}], [WEATHER], True)
    rendered = tok.apply_chat_template(msgs, tools=tools)
    assert tools is None and rendered.count("get_weather") >= 3  # described, called, answered
    assert '{"tool_response": {"name": "get_weather", "content": ' + json.dumps(RESULT) + "}}" in rendered
    assert f'{{"name": "get_weather", "arguments": {call.function.arguments}}}' in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_none_answers_in_text_and_errors_name_the_field(srv):
    c = _client(srv)
    r = c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0,
                                  max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.lstrip()[:1] not in ("{", "[")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["code"] == "invalid_tools" and "nope" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="required",
                                  response_format={"type": "json_object"})
    assert e.value.body["code"] == "conflicting_parameters"
    # Under auto a response_format decides the form (the answer is JSON; no call is forced).
    r = c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0,
                                  response_format={"type": "json_object"})
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# -- LangChain ------------------------------------------------------------------------------------


def test_langchain_bind_tools_and_round_trip(srv):
    lc = pytest.importorskip("langchain_openai", reason="pip install langchain-openai (test extra)")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = lc.ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model=NAME, temperature=0, max_retries=0,
                        max_tokens=100)

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
        """Get the current weather in a city."""
        return json.dumps(RESULT)

    schema = llm.bind_tools([get_weather]).kwargs["tools"][0]["function"]["parameters"]
    for choice in ("any", "get_weather"):  # LangChain's "any" is OpenAI's required
        msg = llm.bind_tools([get_weather], tool_choice=choice).invoke("What is the weather like in Paris?")
        assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and not msg.invalid_tool_calls
        jsonschema.validate(msg.tool_calls[0]["args"], schema)
    streamed = None
    for chunk in llm.bind_tools([get_weather], tool_choice="get_weather").stream("What is the weather like in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in msg.tool_calls]
    history = [HumanMessage("What is the weather like in Paris?"), msg,
               ToolMessage(get_weather(**msg.tool_calls[0]["args"]), tool_call_id=msg.tool_calls[0]["id"])]
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert not answer.tool_calls and answer.content and answer.content.lstrip()[:1] not in ("{", "[")
    # auto: a call (valid) or an answer, either well-formed
    again = llm.bind_tools([get_weather]).invoke(history)
    assert again.content or again.tool_calls
    for c in again.tool_calls:
        jsonschema.validate(c["args"], schema)


# -- the ollama client ------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_ollama_client_forced_calls_streamed_and_not(srv, choice):
    ollama = pytest.importorskip("ollama", reason="pip install ollama (test extra)")
    c = ollama.Client(host=srv.url)
    assert "tools" in c.show(NAME).capabilities
    opts = {"temperature": 0, "num_predict": 120, "tool_choice": choice}  # options.tool_choice: llmsys extension
    msg = c.chat(NAME, messages=ASK, tools=[WEATHER, TIME], options=opts).message
    assert msg.tool_calls and not msg.content
    for call in msg.tool_calls:
        _valid(call.function.name, dict(call.function.arguments))
    if choice == "get_weather":
        assert [t.function.name for t in msg.tool_calls] == ["get_weather"]
    calls, text = [], ""
    for part in c.chat(NAME, messages=ASK, tools=[WEATHER, TIME], options=opts, stream=True):
        calls += part.message.tool_calls or []
        text += part.message.content or ""
    assert not text and [(t.function.name, dict(t.function.arguments)) for t in calls] == [
        (t.function.name, dict(t.function.arguments)) for t in msg.tool_calls]


def test_ollama_client_round_trip_and_auto(srv):
    ollama = pytest.importorskip("ollama", reason="pip install ollama (test extra)")
    c = ollama.Client(host=srv.url)
    first = c.chat(NAME, messages=ASK, tools=[WEATHER],
                   options={"temperature": 0, "num_predict": 80, "tool_choice": "get_weather"}).message
    (call,) = first.tool_calls
    _valid("get_weather", dict(call.function.arguments))
    history = ASK + [first, {"role": "tool", "tool_name": "get_weather", "content": json.dumps(RESULT)}]
    answer = c.chat(NAME, messages=history, tools=[WEATHER],
                    options={"temperature": 0, "num_predict": 60, "tool_choice": "none"}).message
    assert not answer.tool_calls and answer.content and answer.content.lstrip()[:1] not in ("{", "[")
    auto = c.chat(NAME, messages=ASK, tools=[WEATHER], options={"temperature": 0, "num_predict": 40}).message
    if auto.tool_calls:  # Ollama's own behaviour (auto): a valid call or an answer
        for t in auto.tool_calls:
            _valid(t.function.name, dict(t.function.arguments))
    else:
        assert auto.content and auto.content.lstrip()[:1] not in ("{", "[")
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(NAME, messages=ASK, options={"tool_choice": "required"})
    assert e.value.status_code == 400 and "no tools" in e.value.error


# -- without a server: the rewriting, the parser, the first-token constraint -------------------------


class _Tok:
    """A tokenizer's chat-template side: a ChatML-like template, optionally one that rejects system turns."""

    def __init__(self, system: bool = True):
        from llmsys.engine.chat_template import ChatTemplate

        src = ("{% for m in messages %}{% if m.role == 'system' and not " + str(system).lower() +
               " %}{{ raise_exception('no system') }}{% endif %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}")
        self.template = ChatTemplate(src, "test")

    def chat_template_source(self, tools: bool = False) -> str:
        return self.template.source

    def apply_chat_template(self, messages, tools=None) -> str:
        return self.template.render(messages, add_generation_prompt=False, tools=tools)


def test_conversation_rewritten_into_the_generic_format():
    from llmsys.engine.server.tools import chat_messages, generic_instructions

    convo = [{"role": "system", "content": "Be brief."}, *ASK,
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                 {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}}]},
             {"role": "tool", "tool_call_id": "a", "content": json.dumps(RESULT)},
             {"role": "tool", "tool_call_id": "b", "content": "12:00"},
             {"role": "user", "content": "And?"}]
    out, tools = chat_messages(_Tok(), convo, [WEATHER, TIME], True)
    assert tools is None and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == "Be brief.\n\n" + generic_instructions([WEATHER, TIME], True)
    assert json.loads(out[2]["content"]) == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                             {"name": "get_time", "arguments": {"zone": 1}}]
    assert out[3]["content"] == ('{"tool_response": {"name": "get_weather", "content": ' + json.dumps(RESULT) + "}}\n"
                                 '{"tool_response": {"name": "get_time", "content": "12:00"}}\n\nAnd?')
    # A template that rejects system turns: the description goes first in the first user turn.
    out, _ = chat_messages(_Tok(system=False), convo[:2], [WEATHER], False)
    assert [m["role"] for m in out] == ["user"] and out[0]["content"].startswith("Be brief.\n\nYou can call")
    assert out[0]["content"].endswith(ASK[0]["content"]) and "JSON list" not in out[0]["content"]
    # No tools and no tool turns: untouched; a template with its own format: untouched.
    assert chat_messages(_Tok(), ASK, None, True) == (ASK, None)
    qwen = _Tok()
    qwen.template = type(qwen.template)("<tool_call>{{ messages }}", "test")
    assert chat_messages(qwen, convo, [WEATHER], True) == (convo, [WEATHER])


def test_generic_parse_stream_and_closed_schemas():
    from llmsys.engine.server.tools import ToolFormat, ToolStream, closed

    fmt = ToolFormat("generic", {})
    content, calls = fmt.parse(' {"name": "f", "arguments": {"a": 1}}')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert [c.name for c in fmt.parse('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]')[1]] == \
        ["f", "g"]
    for text in ("Paris is sunny.", '{"city": "Paris"}', '[{"name": "f"}, 3]', '{"name": "f", "arguments": {'):
        assert fmt.parse(text) == (text, [])
    s = ToolStream(fmt)
    assert s.feed(" ") == ("", []) and s.feed("Hi {") == (" Hi {", []) and s.feed("x") == ("x", [])
    s = ToolStream(fmt)
    assert s.feed('{"name": "f", ') == ("", []) and s.feed('"arguments": {}}') == ("", [])
    assert [c.name for c in s.finish()[1]] == ["f"]
    schema = {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}},
                                               "q": {"anyOf": [{"type": "object", "properties": {}}]}},
              "$defs": {"D": {"properties": {"y": {}}}}, "allOf": [{"properties": {"z": {}}}]}
    c = closed(schema)
    assert "additionalProperties" not in c  # allOf: its parts would exclude each other's keys
    assert c["properties"]["p"]["additionalProperties"] is False
    assert c["properties"]["q"]["anyOf"][0]["additionalProperties"] is False
    assert c["$defs"]["D"]["additionalProperties"] is False and "additionalProperties" not in c["allOf"][0]
    assert closed({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True
    assert schema["properties"]["p"].get("additionalProperties") is None  # the caller's schema is left alone


def _sample(con, tok, vocab_size: int, seed: int, steps: int, eos: int) -> str:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        w = torch.rand(vocab_size, generator=g)
        w[~con.allowed(vocab_size)] = -1
        t = int(w.argmax())
        if t == eos:
            break
        con.advance(t)
        out.append(t)
    return tok.decode(out)


def test_first_token_decides_call_or_text():
    need_shared(STORIES_HF)
    import torch

    from llmsys.engine.grammar import GrammarOrText, GrammarVocab
    from llmsys.engine.server.tools import ToolFormat
    from llmsys.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(STORIES_HF)
    vocab = GrammarVocab(tok, 512, [2])
    fmt = ToolFormat("generic", {})
    tools = [t["function"] for t in (WEATHER, TIME)]
    free = vocab.free_start("[{")
    first = [tok.decode([t]).lstrip() for t in torch.nonzero(free).flatten().tolist()]
    assert first and all(s and s[0] not in "{[" for s in first)
    kinds = set()
    for seed in range(12):
        spec = fmt.grammar(tools, None, parallel=True, free_text="or")
        con = GrammarOrText(vocab, spec, budget=200)
        # Half the draws start from a token that opens a call, half from a free one.
        opens = con.allowed(512) & ~free
        if seed % 2 == 0:
            assert opens.any()
        text = _sample(con, tok, 512, seed, 200, 2) if seed % 2 else None
        if text is None:  # force the call branch: its first token, then sampled under the grammar
            t0 = int(torch.nonzero(opens).flatten()[0])
            con.advance(t0)
            text = tok.decode([t0]) + _sample(con, tok, 512, seed, 199, 2)
        content, calls = fmt.parse(text)
        if calls:
            kinds.add("call")
            for c in calls:
                _valid(c.name, c.arguments)
        else:
            kinds.add("text")
            assert text.lstrip()[:1] not in ("{", "[") and text.strip()
    assert kinds == {"call", "text"}
    # "only": never a call; a grammar whose shortest call cannot fit the budget leaves the text alone.
    for spec, budget in ((fmt.grammar(tools, None, True, "only"), 200), (fmt.grammar(tools, None, True, "or"), 3)):
        con = GrammarOrText(vocab, spec, budget)
        assert torch.equal(con.allowed(512), free)
        assert _sample(con, tok, 512, 0, 30, 2).lstrip()[:1] not in ("{", "[")
