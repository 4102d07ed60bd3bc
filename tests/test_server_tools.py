"""Tool calling, structured output and the OpenAI fields the server must not ignore, driven by
the official ``openai`` client (and LangChain's ``ChatOpenAI``) against a real ``llmsys serve``.

The served model is stories260k-hf (its context stretched to 2048 positions: RoPE extends, and
the words are nonsense either way) with a Qwen2.5-style chat template (tools rendered into the
system turn, calls as ``<tool_call>`` blocks, results as ``<tool_response>``). A 260K-parameter
story model never decides to call a tool by itself, so the calls here are made deterministic the
way the issue asks: ``tool_choice`` required or named, which compiles the family's call format
with each tool's parameter schema into a grammar; the output must then parse into valid calls.
The formats of the other families (Llama 3 JSON, Mistral ``[TOOL_CALLS]``) are checked without a
server, by sampling under their grammar on the same vocabulary and parsing the text back.
"""

from __future__ import annotations

import asyncio
import json
import re
from enum import Enum
from pathlib import Path
from typing import Literal, Optional

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import STORIES_HF, need_shared
from test_server import _chat_model

jsonschema_rs = pytest.importorskip("jsonschema_rs", reason="jsonschema-rs comes with schemathesis (test extra)")

NAME = "stories-qwen"
# A Qwen2.5-style template (its structure; the tool instructions shortened to fit stories260k's
# 512-token context).
QWEN_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'Be helpful.' }}{%- endif %}"
    "{{- '\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nBe helpful.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 14}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _model(tmp: Path) -> Path:
    # a 2048-token context: tool definitions are long in a 512-token vocabulary
    return _chat_model(tmp, QWEN_STYLE, NAME, positions=2048)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    need_shared(STORIES_HF)
    import torch

    from llmsys import LLM
    from llmsys.engine.server.serve import start_server_thread
    from llmsys.engine.server.state import ServerSettings, ServerState

    torch.set_num_threads(2)
    state = ServerState(ServerSettings(model_aliases=("gpt-4o-mini",)))
    state.attach(LLM(str(_model(tmp_path_factory.mktemp("m"))), dtype="float32"), NAME)
    s = start_server_thread(state)
    yield s
    s.stop()


def _client(s, cls=openai.OpenAI):
    return cls(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(schema: dict, args: str) -> bool:
    return jsonschema_rs.is_valid(schema, json.loads(args))


# -- tool calling ------------------------------------------------------------------------


def test_named_tool_call_round_trip(srv):
    c = _client(srv)
    r = c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    [call] = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert _valid(WEATHER["function"]["parameters"], call.function.arguments), call.function.arguments
    # The result goes back as a tool message; the conversation renders (assistant tool_calls + tool turn)
    # and the model answers in text.
    follow = ASK + [ch.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r2 = c.chat.completions.create(model=NAME, messages=follow, tools=[WEATHER, TIME], tool_choice="none",
                                   temperature=0, max_tokens=12)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content
    assert r2.choices[0].finish_reason in ("stop", "length")
    # The server rendered exactly what the template makes of that conversation (arguments as an object).
    from llmsys.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(_model_dir(srv))
    rendered = tok.apply_chat_template(
        ASK + [{"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.loads(call.function.arguments)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}],
        tools=[WEATHER, TIME])
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in rendered
    assert f'"arguments": {call.function.arguments}' in rendered
    assert r2.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def _model_dir(s) -> Path:
    return Path(s.state.llm.config.model)


def test_streamed_tool_calls_reassemble_to_the_same_calls(srv):
    c = _client(srv)
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=150)
    plain = c.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        assert not d.content, d.content  # nothing outside the calls leaks out as text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" == plain.finish_reason
    got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert got == [(t.function.name, t.function.arguments) for t in plain.message.tool_calls]
    assert all(calls[i]["id"].startswith("call_") for i in calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert all(_valid(schemas[name], args) for name, args in got)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_sampled_calls_parse_and_parallel_false_gives_one(srv, seed):
    c = _client(srv)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for parallel in (True, False):
        r = c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                      parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=120)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls"
        assert all(_valid(schemas[t.function.name], t.function.arguments) for t in calls)
        if not parallel:
            assert len(calls) == 1


def test_auto_without_a_call_is_plain_content(srv):
    r = _client(srv).chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=16)
    m = r.choices[0].message
    assert m.tool_calls is None and m.content and r.choices[0].finish_reason in ("stop", "length")


def test_tool_errors_name_the_field(srv):
    c = _client(srv)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["code"] == "invalid_tools" and "nope" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=ASK, tool_choice="required")
    assert e.value.body["code"] == "invalid_tools"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="required",
                                  response_format={"type": "json_object"})
    assert e.value.body["code"] == "conflicting_parameters"


# -- the other families' formats, on the same vocabulary -------------------------------------


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral", "generic"])
def test_each_family_grammar_output_parses_back(family):
    need_shared(STORIES_HF)
    import torch

    from llmsys.engine.grammar import GrammarConstraint, GrammarVocab
    from llmsys.engine.server.tools import ToolFormat, ToolStream
    from llmsys.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(STORIES_HF)
    vocab = GrammarVocab(tok, 512, [2])
    tools = [t["function"] for t in (WEATHER, TIME)]
    fmt = ToolFormat(family, {})
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        con = GrammarConstraint(vocab, fmt.grammar(tools, None, parallel=True), budget=200)
        out = []
        for _ in range(200):
            allowed = con.allowed(512)
            w = torch.rand(512, generator=g)
            w[~allowed] = -1
            t = int(w.argmax())
            if t == 2:
                break
            con.advance(t)
            out.append(t)
        text = tok.decode(out)
        content, calls = fmt.parse(text)
        assert calls and not content.strip(), text
        schemas = {t["name"]: t["parameters"] for t in tools}
        assert all(_valid(schemas[c.name], c.arguments) for c in calls), text
        stream, got = ToolStream(fmt), []
        for i in range(0, len(text), 3):  # streamed in pieces, the same calls
            got += stream.feed(text[i:i + 3])[1]
        got += stream.finish()[1]
        assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]


def test_format_detection_and_text_around_calls():
    from llmsys.engine.server.tools import ToolFormat, detect_format

    assert detect_format("...<tool_call>...") == "hermes"
    assert detect_format("{{ '<|python_tag|>' }}") == "llama3"
    assert detect_format("[TOOL_CALLS] {{ x }}") == "mistral"
    assert detect_format("{{ m.content }}") is None
    content, calls = ToolFormat("hermes", {}).parse('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}'
                                                    '\n</tool_call>')
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert ToolFormat("hermes", {}).parse("<tool_call>\nnot json\n</tool_call>")[1] == []
    content, calls = ToolFormat("llama3", {}).parse('<|python_tag|>{"name": "f", "parameters": {}}; '
                                                    '{"name": "g", "parameters": {"x": "}"}}')
    assert content == "" and [c.name for c in calls] == ["f", "g"]
    assert ToolFormat("llama3", {}).parse("Hello {there}")[1] == []


# -- structured output ----------------------------------------------------------------------


class Color(str, Enum):
    red = "red"
    green = "green"


class Point(BaseModel):
    x: int
    y: int


class S01(BaseModel):
    name: str


class S02(BaseModel):
    n: int = Field(ge=1, le=9)


class S03(BaseModel):
    flag: bool
    score: float = Field(ge=0.0, le=1.0)


class S04(BaseModel):
    color: Color


class S05(BaseModel):
    tags: list[str] = Field(max_length=3)


class S06(BaseModel):
    p: Point


class S07(BaseModel):
    points: list[Point] = Field(min_length=1, max_length=2)


class S08(BaseModel):
    nick: Optional[str] = None
    age: int


class S09(BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=4)


class S10(BaseModel):
    title: str = Field(max_length=12)
    year: int = Field(ge=1900, le=2100)


class S11(BaseModel):
    a: Point
    b: Optional[Point] = None


class S12(BaseModel):
    matrix: list[list[int]] = Field(max_length=2)


class S13(BaseModel):
    colors: list[Color]
    count: int


class S14(BaseModel):
    s: str = Field(pattern=r"^[a-z]{2,5}$")


class S15(BaseModel):
    x: float
    y: Optional[float] = None
    z: Optional[bool] = None


class S16(BaseModel):
    user: S01
    items: list[S02] = Field(max_length=2)


class S17(BaseModel):
    ok: bool
    note: Literal["yes", "no", "maybe"]


class S18(BaseModel):
    ids: list[int] = Field(min_length=2, max_length=4)


class S19(BaseModel):
    name: str = Field(min_length=1, max_length=8)
    tags: list[Literal["a", "b"]] = Field(max_length=2)
    where: Point


class S20(BaseModel):
    deep: S06
    label: Optional[Literal["x", "y"]] = None


SCHEMAS = [S01, S02, S03, S04, S05, S06, S07, S08, S09, S10, S11, S12, S13, S14, S15, S16, S17, S18, S19, S20]


def test_parse_returns_a_valid_object_for_20_schemas(srv):
    """``client.chat.completions.parse(response_format=PydanticModel)`` (what ``beta...parse``
    became), all 20 sent at once so the constrained requests share batches."""

    async def one(ac, cls, i):
        r = await ac.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": f"Story {i}"}],
                                            response_format=cls, temperature=0.8, seed=i, max_tokens=200)
        return r.choices[0]

    async def main():
        async with _client(srv, openai.AsyncOpenAI) as ac:
            return await asyncio.gather(*[one(ac, cls, i) for i, cls in enumerate(SCHEMAS)])

    for cls, ch in zip(SCHEMAS, asyncio.run(main())):
        assert isinstance(ch.message.parsed, cls), (cls.__name__, ch.message.content)
        assert cls.model_validate_json(ch.message.content) == ch.message.parsed
        assert jsonschema_rs.is_valid(cls.model_json_schema(), json.loads(ch.message.content))


def test_regex_and_grammar_formats(srv):
    c = _client(srv)
    fmt = {"type": "regex", "regex": "[0-9]{3}-[a-z]{2,4}"}
    text = c.completions.create(model=NAME, prompt="Code:", max_tokens=20, temperature=1.0, seed=5,
                                extra_body={"response_format": fmt}).choices[0].text
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", text), text
    for grammar, syntax in (('start: "yes" | "no" | "maybe"', "lark"), ('root ::= "yes" | "no" | "maybe"', "gbnf")):
        r = c.chat.completions.create(model=NAME, messages=ASK, temperature=1.0, seed=2, extra_body={
            "response_format": {"type": "grammar", "grammar": grammar, "syntax": syntax}})
        assert r.choices[0].message.content in ("yes", "no", "maybe")


def test_unusable_schemas_are_400s(srv):
    c = _client(srv)
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
                {"type": "regex", "regex": "(unclosed"},
                {"type": "grammar", "grammar": "start: undefined_rule"}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=ASK, extra_body={"response_format": fmt})
        assert e.value.body["code"] == "invalid_grammar" and e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=ASK, extra_body={
            "response_format": {"type": "grammar", "grammar": "root ::= (", "syntax": "gbnf"}})
    assert e.value.body["code"] == "invalid_grammar" and "GBNF grammar is not valid" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=ASK, response_format={"type": "json_object"},
                                  extra_body={"min_tokens": 5})
    assert e.value.body["code"] == "conflicting_parameters" and "min_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the shortest object of this schema cannot fit 3 tokens
        c.chat.completions.create(model=NAME, messages=ASK, max_tokens=3, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": Point.model_json_schema()}})
    assert e.value.body["code"] == "invalid_grammar" and "raise max_tokens" in e.value.body["message"]


# -- every field honest ---------------------------------------------------------------------


def test_logit_bias_bans_and_forces_tokens(srv):
    from llmsys import LLM, SamplingParams

    ref = LLM(str(_model_dir(srv)), dtype="float32")  # the served one belongs to the engine thread
    prompt = "Once upon a time"

    def both(bias: dict[int, float]) -> tuple[list[int], str]:
        want = ref.generate(prompt, SamplingParams(max_tokens=12, temperature=0, logit_bias=bias))[0]
        got = _client(srv).completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                              logit_bias={str(k): v for k, v in bias.items()})
        assert got.choices[0].text == want.text
        return list(want.token_ids), want.text

    plain, text = both({})
    banned, banned_text = both({plain[0]: -100})
    assert plain[0] not in banned and banned_text != text
    forced, _ = both({300: 100})
    assert forced == [300] * 12
    with pytest.raises(openai.BadRequestError) as e:
        _client(srv).completions.create(model=NAME, prompt=prompt, logit_bias={"99999": 5})
    assert e.value.body["code"] == "invalid_logit_bias"


def test_echo_best_of_suffix_and_unserved_fields(srv):
    c = _client(srv)
    r = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, temperature=0, echo=True)
    plain = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt="Once upon a time", max_tokens=8, temperature=0, echo=True, stream=True) if ch.choices)
    assert streamed == r.choices[0].text
    assert c.completions.create(model=NAME, prompt="Hi", max_tokens=2, best_of=1).choices
    for kw, field in ((dict(best_of=3), "best_of"), (dict(suffix="The end."), "suffix"),
                      (dict(echo=True, logprobs=1), "echo"), (dict(extra_body={"store": True}), "store")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=NAME, prompt="Hi", max_tokens=2, **kw)
        assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_parameter"
    for kw, field in ((dict(functions=[{"name": "f"}]), "functions"), (dict(modalities=["audio"]), "modalities"),
                      (dict(reasoning_effort="high"), "reasoning_effort"), (dict(web_search_options={
                          "search_context_size": "low"}), "web_search_options")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=ASK, max_tokens=2, **kw)
        assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_parameter"


def test_identifiers_are_logged_not_ignored(srv, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="llmsys.server"):
        _client(srv).completions.create(model=NAME, prompt="Hi", max_tokens=2, user="alice",
                                        extra_body={"safety_identifier": "u-42"})
    assert "user='alice'" in caplog.text and "safety_identifier='u-42'" in caplog.text


def test_model_names(srv):
    c = _client(srv)
    for bad in ("gpt-4o", "stories"):
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model=bad, messages=ASK, max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and NAME in e.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model=bad, prompt="Hi", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve(bad)
    for ok in (NAME, f"{NAME}:latest", "gpt-4o-mini"):  # the name, Ollama's tag, an alias
        assert c.chat.completions.create(model=ok, messages=ASK, max_tokens=2).choices
    assert c.models.retrieve(NAME).id == NAME
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


# -- the Ollama API's tools and format -------------------------------------------------------


def test_ollama_client_tools_and_capabilities(srv):
    ollama = pytest.importorskip("ollama", reason="pip install ollama (test extra)")
    c = ollama.Client(host=srv.url)
    assert "tools" in c.show(NAME).capabilities
    # The tools reach the template: the prompt is exactly what it renders with them.
    r = httpx.post(srv.url + "/api/chat", json={"model": NAME, "messages": ASK, "tools": [WEATHER], "stream": False,
                                                "options": {"temperature": 0, "num_predict": 8}}, timeout=60).json()
    from llmsys.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(_model_dir(srv))
    rendered = tok.apply_chat_template(ASK, tools=[WEATHER])
    assert r["prompt_eval_count"] == len(tok.encode(rendered, add_special_tokens=False))
    # Through the client (which reshapes the tool's schema): a story model writes text, no call.
    msg = c.chat(NAME, messages=ASK, tools=[WEATHER], options={"temperature": 0, "num_predict": 8}).message
    assert msg.content and not msg.tool_calls


# -- LangChain ------------------------------------------------------------------------------


def test_langchain_bind_tools_and_structured_output(srv):
    lc = pytest.importorskip("langchain_openai", reason="pip install langchain-openai (test extra)")
    llm = lc.ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model=NAME, temperature=0, max_retries=0,
                        max_tokens=150)

    def get_weather(city: str, unit: Literal["c", "f"]) -> str:
        """Weather in a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    args = msg.tool_calls[0]["args"]  # LangChain's schema allows more properties; the required ones are there
    assert {"city", "unit"} <= set(args) and args["unit"] in ("c", "f")
    got = llm.with_structured_output(S09).invoke("A pet")
    assert isinstance(got, S09)
