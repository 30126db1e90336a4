"""Structured outputs through the OpenAI API, without daemons: response_format and tools checked (bad ones
refused with 400s in OpenAI's shape), the grammars they become (a valid document is accepted and an
invalid one refused by llguidance with the SmolLM2 tokenizer), conversations with tool turns rendered in
both tool formats, generated text split into tool calls however it streams, and the answers' shapes
(real daemons: the end-to-end tests)."""

import json
from types import SimpleNamespace

import jsonschema
import llguidance
import llguidance.hf
import pytest
from hypothesis import given, strategies as st

from meshd.api import openai, structured, tools
from meshd.api.http import HttpApi
from meshd.api.structured import HERMES, PLAIN
from meshd.api.toolcalls import Arguments, CallBegun, CallSplitter, Content
from meshd.cli import ctl
from meshd.shard.artifact import open_artifact
from meshd.shard.tokenizer import encode_messages, load_tokenizer
from meshd.testing.fakes import FakeArtifact, FakeConfig, FakeDaemon
from meshd.wire import StreamEvent
from tests.test_openai_shapes import MODEL, post

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "address", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "address": {"type": "object", "required": ["city"], "additionalProperties": False,
                                     "properties": {"city": {"enum": ["Paris", "Rome"]}, "zip": {"type": "string"}}},
                         "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {  # $defs and a $ref: they must resolve inside the tool's own schema
    "name": "get_time", "parameters": {"type": "object", "$defs": {"zone": {"enum": ["UTC", "CET"]}},
                                       "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"]}}}
# a chat template in the style of Qwen2.5/Qwen3's (tools in the system turn, <tool_call> markup, results as
# <tool_response> in a user turn, an empty think block when thinking is off)
HERMES_TEMPLATE = (  # newlines after a block tag as expressions: transformers renders with trim_blocks
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\n<tools>' }}{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags."
    "<|im_end|>\\n' }}{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + c.function.arguments | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(open_artifact("smollm2"))


@pytest.fixture(scope="module")
def lltok(smollm2):
    return llguidance.hf.from_tokenizer(smollm2)


@pytest.fixture(scope="module")
def hermes_tokenizer(smollm2):
    tok = load_tokenizer(open_artifact("smollm2"))
    tok.chat_template = HERMES_TEMPLATE
    return tok


def parse(body: dict, chat: bool = True, fmt=PLAIN) -> openai.Completion:
    return openai.parse_request(json.dumps(body).encode(), chat, MODEL, 2048, 7, fmt)


def complete(smollm2, lltok, grammar: str, text: str) -> bool:
    """Whether `text`, as the model's tokens, keeps to the grammar and completes it (end-of-sequence allowed)."""
    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(smollm2.encode(text, add_special_tokens=False)) and m.consume_token(lltok.eos_token)


def call(name: str, arguments: dict, fmt=PLAIN) -> str:
    return fmt.open + json.dumps({"name": name, "arguments": arguments}) + fmt.close


# response_format


def test_a_json_schema_becomes_a_grammar_that_takes_valid_documents_only(smollm2, lltok):
    body = {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}}
    for c in (parse(body), parse(body | {"prompt": "Describe a person:"}, chat=False)):
        good = {"name": "Ada", "age": 36, "address": {"city": "Paris", "zip": "75001"}, "tags": ["x", "y"]}
        jsonschema.validate(good, PERSON)
        assert complete(smollm2, lltok, c.request.grammar, json.dumps(good))
        for bad in [good | {"age": 121}, good | {"address": {"city": "Lyon"}}, good | {"tags": []},
                    good | {"extra": 1}, {k: v for k, v in good.items() if k != "age"}]:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, PERSON)
            assert not complete(smollm2, lltok, c.request.grammar, json.dumps(bad)), bad
        assert not complete(smollm2, lltok, c.request.grammar, json.dumps(good)[:-1])  # unfinished
    assert c.request.prompt == "Describe a person:" and not c.request.tools


def test_json_object_takes_any_object_and_text_asks_for_nothing(smollm2, lltok):
    g = parse({"messages": USER, "response_format": {"type": "json_object"}}).request.grammar
    assert complete(smollm2, lltok, g, '{"a": [1, {"b": null}], "c": "d"}')
    assert not complete(smollm2, lltok, g, "[1, 2]") and not complete(smollm2, lltok, g, "Sure, here it is")
    assert parse({"messages": USER, "response_format": {"type": "text"}}).request.grammar == ""
    assert parse({"messages": USER}).request.grammar == ""


@pytest.mark.parametrize("response_format, message", [
    ("json", "'response_format' must be an object"),
    ({"type": "yaml"}, "'response_format.type' must be text, json_object or json_schema"),
    ({"type": "json_schema"}, "'response_format.json_schema' must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema' is missing"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be a JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": 5}}}, "not a valid JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"required": "name"}}}, "not a valid JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}, "not a valid JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}, r"Unimplemented keys: \[\"not\"\]"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}}, "is not a 'regex'"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(?=a)b"}}}, "cannot be enforced"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "Unsatisfiable"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/missing"}}}, "cannot be enforced"),
])
def test_a_response_format_that_cannot_be_enforced_is_refused_with_the_reason(response_format, message):
    with pytest.raises(openai.BadRequest, match=message):
        parse({"messages": USER, "response_format": response_format})


# tools and tool_choice


@pytest.mark.parametrize("extra, message", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "needs a 'function.name'"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "needs a 'function.name'"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "letters, digits"),
    ({"tools": [{"type": "code_interpreter"}]}, "only function tools"),
    ({"tools": {"type": "function"}}, "'tools' must be a list"),
    ({"tools": [WEATHER, WEATHER]}, "same name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "names 'get_time', which is not in 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "'tool_choice' must be"),
    ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]},
     r"tools\[0\]: 'function.parameters' is not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "must describe an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]}, "cannot be enforced"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
     "each tool call needs"),
    ({"messages": [{"role": "tool", "content": "12", "tool_call_id": 5}]}, "'tool_call_id' must be a string"),
])
def test_bad_tools_and_tool_choices_are_refused_with_the_reason(extra, message):
    with pytest.raises(openai.BadRequest, match=message):
        parse({"messages": USER} | extra)


def test_tools_are_refused_on_plain_completions():
    with pytest.raises(openai.BadRequest, match="served on /v1/chat/completions"):
        parse({"prompt": "x", "tools": [WEATHER]}, chat=False)


@pytest.mark.parametrize("fmt", [PLAIN, HERMES], ids=["fallback", "hermes"])
def test_required_and_named_tool_choices_take_only_valid_calls(smollm2, lltok, fmt):
    g = parse({"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required"}, fmt=fmt).request.grammar
    paris, utc = call("get_weather", {"city": "Paris", "unit": "celsius"}, fmt), call("get_time", {"zone": "UTC"}, fmt)
    assert complete(smollm2, lltok, g, paris) and complete(smollm2, lltok, g, utc)
    assert complete(smollm2, lltok, g, paris + fmt.sep + utc)  # parallel calls
    for bad in [call("get_weather", {"unit": "celsius"}, fmt), call("get_weather", {"city": "Paris", "x": 1}, fmt),
                call("get_time", {"zone": "PST"}, fmt), call("get_date", {}, fmt), "It is sunny.", paris + " ok"]:
        assert not complete(smollm2, lltok, g, bad), bad
    one = parse({"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
                fmt=fmt).request.grammar
    assert complete(smollm2, lltok, one, paris) and not complete(smollm2, lltok, one, paris + fmt.sep + utc)
    named = parse({"messages": USER, "tools": [WEATHER, TIME],
                   "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, fmt=fmt).request.grammar
    assert complete(smollm2, lltok, named, utc) and not complete(smollm2, lltok, named, paris)


@pytest.mark.parametrize("fmt", [PLAIN, HERMES], ids=["fallback", "hermes"])
def test_auto_takes_text_or_valid_calls_and_none_takes_text(smollm2, lltok, fmt):
    c = parse({"messages": USER, "tools": [WEATHER]}, fmt=fmt)
    assert c.tools.choice == tools.Choice.AUTO
    assert complete(smollm2, lltok, c.request.grammar, "It is sunny in Paris.")
    assert complete(smollm2, lltok, c.request.grammar, call("get_weather", {"city": "Paris"}, fmt))
    assert not complete(smollm2, lltok, c.request.grammar, call("get_weather", {"town": "Paris"}, fmt))
    assert not complete(smollm2, lltok, c.request.grammar, fmt.trigger + " is how a call begins")
    assert not complete(smollm2, lltok, c.request.grammar, "")  # an answer, not nothing
    none = parse({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}, fmt=fmt)
    assert none.request.grammar == "" and not none.tools.may_call
    answer = parse({"messages": USER, "tools": [WEATHER], "response_format": {"type": "json_object"}}, fmt=fmt)
    assert complete(smollm2, lltok, answer.request.grammar, '{"sky": "blue"}')
    assert complete(smollm2, lltok, answer.request.grammar, call("get_weather", {"city": "Paris"}, fmt))
    assert not complete(smollm2, lltok, answer.request.grammar, "It is sunny.")


# conversations


def test_the_fallback_lists_the_tools_in_the_system_turn_and_renders_tool_turns_as_text(smollm2):
    convo = [{"role": "system", "content": "Be brief."}, *USER,
             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    c = parse({"messages": convo, "tools": [WEATHER, TIME]})
    turns = json.loads(c.request.messages)
    assert c.request.tools == "" and [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert "get_weather: The weather in a city" in turns[0]["content"] and '"zone"' in turns[0]["content"]
    assert turns[2]["content"] == '{"name": "get_weather", "arguments": {"city": "Paris"}}'  # as the grammar writes it
    assert turns[3]["content"] == "Result of the tool call get_weather: sunny, 21 C"
    text = smollm2.decode(encode_messages(smollm2, turns, None, constrained=True))
    assert "You can call these tools" in text and text.endswith("<|im_start|>assistant\n")
    first = json.loads(parse({"messages": USER, "tools": [WEATHER]}).request.messages)[0]
    assert first["role"] == "system" and "Otherwise answer in plain text" in first["content"]  # a new system turn
    assert json.loads(parse({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}).request.messages) == USER


def test_a_template_with_a_tool_format_renders_the_tools_calls_and_results_itself(hermes_tokenizer):
    assert structured.tool_format(HERMES_TEMPLATE) is HERMES
    convo = [*USER, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    c = parse({"messages": convo, "tools": [WEATHER], "tool_choice": "required"}, fmt=HERMES)
    turns = json.loads(c.request.messages)
    assert turns[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert turns[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    assert json.loads(c.request.tools) == [WEATHER]
    text = hermes_tokenizer.decode(encode_messages(hermes_tokenizer, turns, json.loads(c.request.tools),
                                                   constrained=True))
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # a grammar: no thinking first
    assert not hermes_tokenizer.decode(encode_messages(hermes_tokenizer, USER)).endswith("</think>\n\n")
    # tool_choice none: a native template still sees the tools
    assert parse({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}, fmt=HERMES).request.tools


def test_the_tool_format_comes_from_the_models_chat_template(tmp_path):
    assert structured.tool_format(structured.chat_template(open_artifact("smollm2"))) is PLAIN  # a GGUF's metadata
    assert structured.chat_template(None) == structured.chat_template(SimpleNamespace()) == ""  # made-up daemons
    assert structured.tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is PLAIN
    hf = SimpleNamespace(kind="hf", path=tmp_path, metadata={})  # a Hugging Face directory's files
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": HERMES_TEMPLATE}]}))
    assert structured.tool_format(structured.chat_template(hf)) is HERMES
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert structured.chat_template(hf) == "{{ messages }}"


# generated text split into calls


def split(fmt, pieces: list[str]) -> tuple[str, list[dict], list]:
    s = CallSplitter(fmt)
    events = [e for p in pieces for e in s.push(p)] + s.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    streamed = {}
    for e in events:
        if isinstance(e, CallBegun):
            streamed[e.call.index] = [e.call.name, ""]
        elif isinstance(e, Arguments):
            streamed[e.call.index][1] += e.text
    assert [[c.name, c.arguments] for c in s.calls] == [streamed[i] for i in range(len(s.calls))]
    return content, [{"name": c.name, "arguments": c.arguments, "complete": c.complete} for c in s.calls], events


TWO_CALLS = {fmt.name: call("get_weather", {"city": "Rome {or} \"Paris\"\\"}, fmt) + fmt.sep
             + call("get_time", {"zone": "UTC", "n": [1, {"a": "}"}]}, fmt) for fmt in (PLAIN, HERMES)}


@given(st.sampled_from([PLAIN, HERMES]), st.lists(st.integers(0, 200), max_size=12))
def test_calls_split_anywhere_give_the_same_calls(fmt, cuts):
    text = TWO_CALLS[fmt.name]
    cuts = sorted({min(c, len(text)) for c in cuts})
    content, calls, _ = split(fmt, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"]), c["complete"]) for c in calls] == [
        ("get_weather", {"city": 'Rome {or} "Paris"\\'}, True), ("get_time", {"zone": "UTC", "n": [1, {"a": "}"}]}, True)]


@given(st.sampled_from(["It is sunny.", "<tool", "<b>bold</b> text", "{\"a\": 1}", "{", "{\"name\": \"x\", 3}"]),
       st.lists(st.integers(0, 20), max_size=5))
def test_text_that_is_not_a_call_is_content_however_it_is_split(text, cuts):
    cuts = sorted({min(c, len(text)) for c in cuts})
    for fmt in (PLAIN, HERMES):
        content, calls, _ = split(fmt, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
        assert (content, calls) == (text, [])


def test_a_call_cut_short_is_told_as_far_as_it_came():
    content, calls, _ = split(HERMES, ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'])
    assert content == "" and calls == [{"name": "get_weather", "arguments": '{"city": "Pa', "complete": False}]
    assert split(HERMES, ['<tool_call>\n{"name": "get_we'])[:2] == ('<tool_call>\n{"name": "get_we', [])


# answers


def made_up_generate(text: str, tokens: int, finish: str | None = None, seen: list | None = None):
    """A generation whose text comes three characters a piece, as the entry's texts do."""
    async def generate(req, emit):
        if seen is not None:
            seen.append(req)
        for i in range(0, len(text), 3):
            await emit(StreamEvent(request_id=req.request_id, kind="text", text=text[i:i + 3],
                                   stats={"tokens": min(tokens, i // 3 + 1)} | ({"prompt_tokens": 30} if i == 0 else {})))
        return {"tokens": tokens, "prompt_tokens": 30} | ({"finish": finish} if finish else {})
    return generate


def app_for(generate, template: str = "") -> HttpApi:
    artifact = FakeArtifact(name=MODEL, config=FakeConfig(max_positions=2048),
                            metadata={"tokenizer.chat_template": template})
    return HttpApi(FakeDaemon(artifact=artifact).served(), generate, metrics=None)


def assembled(chunks: list[dict]) -> dict:
    """The message a client assembles of streamed chunks."""
    content, calls = None, {}
    for ch in chunks[:-1]:
        delta = ch["choices"][0]["delta"]
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for d in delta.get("tool_calls", []):
            if "id" in d:
                calls[d["index"]] = {"id": d["id"], "type": d["type"], "function": dict(d["function"])}
            else:
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    message = {"role": "assistant", "content": content}
    return message | ({"tool_calls": [calls[i] for i in sorted(calls)]} if calls else {})


@pytest.mark.parametrize("template, fmt", [("", PLAIN), (HERMES_TEMPLATE, HERMES)], ids=["fallback", "hermes"])
async def test_tool_calls_are_answered_as_openai_does_whole_and_streamed(smollm2, lltok, template, fmt):
    text = call("get_weather", {"city": "Paris"}, fmt) + fmt.sep + call("get_time", {"zone": "CET"}, fmt)
    seen = []
    app = app_for(made_up_generate(text, tokens=30, seen=seen), template)
    body = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 64}
    whole = (await post(app, body))[0]
    assert complete(smollm2, lltok, seen[0].grammar, text)  # the text keeps to the request's grammar
    assert bool(seen[0].tools) == fmt.native
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    got = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") for c in got) and got[0]["id"] != got[1]["id"]
    chunks = await post(app, body | {"stream": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-1]["usage"]["completion_tokens"] == 30
    pieces = [d for ch in chunks[1:-1] for d in ch["choices"][0]["delta"]["tool_calls"]]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""} and len(pieces) > 4
    streamed = assembled(chunks)
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in got]
    assert streamed["content"] is None


async def test_auto_answers_text_as_content_and_a_cut_call_ends_with_length():
    app = app_for(made_up_generate("It is sunny in Paris.", tokens=6))
    body = {"messages": USER, "tools": [WEATHER], "stop": [" in"]}
    whole = (await post(app, body))[0]["choices"][0]
    assert whole == {"index": 0, "message": {"role": "assistant", "content": "It is sunny"}, "finish_reason": "stop"}
    streamed = await post(app, body | {"stream": True})
    assert assembled(streamed)["content"] == "It is sunny" and streamed[-1]["choices"][0]["finish_reason"] == "stop"
    cut = call("get_weather", {"city": "Paris"})[:-6]
    for finish in (None, "length"):  # all max_tokens used, or the entry says so
        app = app_for(made_up_generate(cut, tokens=8, finish=finish))
        whole = (await post(app, body | {"max_tokens": 8}))[0]["choices"][0]
        assert whole["finish_reason"] == "length"
        assert whole["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
        chunks = await post(app, body | {"max_tokens": 8, "stream": True})
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert assembled(chunks)["tool_calls"][0]["function"] == whole["message"]["tool_calls"][0]["function"]


async def test_a_json_answer_cut_by_max_tokens_ends_with_length_never_stop():
    body = {"messages": USER, "response_format": {"type": "json_object"}, "max_tokens": 5}
    whole = (await post(app_for(made_up_generate('{"sky": "bl', tokens=5)), body))[0]["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] == '{"sky": "bl'
    whole = (await post(app_for(made_up_generate('{"sky": "blue"}', tokens=5, finish="stop")), body))[0]
    assert whole["choices"][0]["finish_reason"] == "stop"  # the entry says end-of-sequence ended it


async def test_a_bad_schema_or_tool_choice_gets_a_400_in_openais_shape():
    app = app_for(made_up_generate("x", tokens=1))
    bad = [{"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
           {"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}]
    for body in bad:
        sent = []

        async def receive():
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        async def send(msg):
            sent.append(msg)

        await app({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive, send)
        assert sent[0]["status"] == 400
        error = json.loads(sent[1]["body"])["error"]
        assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}


# meshctl


def test_meshctl_sends_a_schema_or_grammar_file_and_refuses_a_bad_one(tmp_path, smollm2, lltok, capsys):
    schema, lark, bad = tmp_path / "s.json", tmp_path / "g.lark", tmp_path / "bad.json"
    schema.write_text(json.dumps(PERSON))
    lark.write_text('start: "yes" | "no" | answer\nanswer: %json {"type": "object"}\n')
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"not": {}}}}))
    args = ctl.build_parser().parse_args(["generate", "--json-schema", str(schema), "Describe a person:"])
    g = ctl.generate_request(args).grammar
    person = {"name": "Ada", "age": 3, "address": {"city": "Rome"}, "tags": ["a"]}
    assert complete(smollm2, lltok, g, json.dumps(person))
    g = ctl.generate_request(ctl.build_parser().parse_args(["generate", "--grammar", str(lark), "Yes?"])).grammar
    assert complete(smollm2, lltok, g, "no") and not complete(smollm2, lltok, g, "maybe")
    sock = str(tmp_path / "none.sock")
    for flag, path, message in [("--json-schema", bad, "cannot be enforced"), ("--json-schema", lark, "not JSON"),
                                ("--grammar", bad, "cannot be enforced"),
                                ("--json-schema", tmp_path / "x", "cannot read")]:
        assert ctl.main(["--socket", sock, "generate", flag, str(path), "hi"]) == 2
        assert message in capsys.readouterr().err
    # a good file: the request goes out, to no daemon
    assert ctl.main(["--socket", sock, "generate", "--json-schema", str(schema), "hi"]) == ctl.EXIT_DOWN


def test_a_schema_nested_past_the_checkers_recursion_is_refused_not_a_crash():
    deep: dict = {"type": "object"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(structured.Refused, match="nested too deeply"):
        structured.check_schema(deep, "'schema'")
