"""Structured outputs and tool calls through three real daemons (SmolLM2, native), with the official `openai`
client: every answer parses and validates, whatever the schema, greedy or seeded, streamed or whole, with a
hop killed mid-answer; a bad schema is refused with 400."""

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from meshd.cli.localmesh import Mesh, read_rest

pytestmark = pytest.mark.slow
# schemas of the kinds agents send (nested objects, enums, integer ranges, arrays, required), not written for meshd's
# grammar: the shapes of OpenAI's structured-output examples (a calendar event, a math tutor's steps, a UI tree)
EVENT = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "date": {"type": "string", "maxLength": 20},
    "participants": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 4}},
    "required": ["name", "date", "participants"], "additionalProperties": False}
STEPS = {"type": "object", "properties": {
    "steps": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "explanation": {"type": "string", "maxLength": 60}, "output": {"type": "string", "maxLength": 30}},
        "required": ["explanation", "output"], "additionalProperties": False}},
    "final_answer": {"type": "integer", "minimum": -100, "maximum": 100}},
    "required": ["steps", "final_answer"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}},
    "required": ["name", "age", "role", "address"]}
CASES = [("Alice and Bob are going to a science fair on Friday.", EVENT),
         ("How can I solve 8x + 7 = -23?", STEPS),
         ("Make up a user of a web shop.", PERSON)]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                        "required": ["tz"]}}}


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    try:
        a = m.start("a", ["--layers", "0:10", "--http", "127.0.0.1:0"])
        boot = a.wait_serving()["addrs"][0]
        for name, layers in (("b", "10:20"), ("c", "20:30")):
            m.start(name, ["--layers", layers, "--bootstrap", boot])
        a.wait_for(lambda s: s["state"] == "serving" and s["complete"], what="complete coverage")
        yield m, a
    finally:
        m.close()


def client(daemon):
    return openai.OpenAI(base_url=daemon.status()["http"][0] + "/v1", api_key="none", max_retries=0, timeout=300)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_schemas_give_answers_that_parse_and_validate_greedy_and_seeded(mesh):
    _, a = mesh
    api = client(a)
    for prompt, schema in CASES:
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}):
            out = api.chat.completions.create(model=a.status()["model"], messages=[{"role": "user", "content": prompt}],
                                              max_tokens=300, response_format=schema_format(schema), **sampling)
            choice = out.choices[0]
            assert choice.finish_reason == "stop", (prompt, sampling, choice)
            jsonschema.validate(json.loads(choice.message.content), schema)
    # a seeded constrained generation gives the same text twice
    twice = [api.chat.completions.create(model=a.status()["model"], messages=[{"role": "user", "content": CASES[2][0]}],
                                         max_tokens=200, temperature=0.9, seed=5,
                                         response_format=schema_format(PERSON)).choices[0].message.content
             for _ in range(2)]
    assert twice[0] == twice[1]
    anything = api.chat.completions.create(model=a.status()["model"], messages=[{"role": "user", "content": "List two colours."}],
                                           max_tokens=120, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_streamed_chunks_assemble_to_the_whole_answer(mesh):
    _, a = mesh
    api = client(a)
    ask = dict(model=a.status()["model"], messages=[{"role": "user", "content": CASES[0][0]}], max_tokens=200, temperature=0,
               response_format=schema_format(EVENT))
    whole = api.chat.completions.create(**ask).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in api.chat.completions.create(**ask, stream=True) if c.choices]
    assert "".join(pieces) == whole


def test_a_cut_answer_ends_with_length_and_a_bad_schema_is_refused(mesh):
    _, a = mesh
    api = client(a)
    cut = api.chat.completions.create(model=a.status()["model"], messages=[{"role": "user", "content": CASES[1][0]}],
                                      max_tokens=6, temperature=0, response_format=schema_format(STEPS))
    assert cut.choices[0].finish_reason == "length"
    for bad in ({"type": "objekt"}, {"type": "object", "properties": {"x": {"type": "integer", "minimum": "one"}}}):
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(model=a.status()["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                        response_format=schema_format(bad))
    with pytest.raises(openai.BadRequestError):  # tool_choice naming a tool not given
        api.chat.completions.create(model=a.status()["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                    tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


def test_tool_calls_named_required_and_auto(mesh):
    _, a = mesh
    api = client(a)
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    named = api.chat.completions.create(model=a.status()["model"], messages=ask, max_tokens=80, temperature=0, tools=[WEATHER, TIME],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = api.chat.completions.create(model=a.status()["model"], messages=ask, max_tokens=80, temperature=0, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False)
    (call,) = required.choices[0].message.tool_calls
    spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    # streamed: the delta.tool_calls pieces make the same call
    stream = api.chat.completions.create(model=a.status()["model"], messages=ask, max_tokens=80, temperature=0, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=False, stream=True)
    name, args, reasons = "", "", []
    for c in stream:
        if not c.choices:
            continue
        reasons.append(c.choices[0].finish_reason)
        for d in c.choices[0].delta.tool_calls or ():
            name += d.function.name or "" if d.function else ""
            args += d.function.arguments or "" if d.function else ""
    assert (name, json.loads(args)) == (call.function.name, json.loads(call.function.arguments))
    assert reasons[-1] == "tool_calls"
    # auto: either text or a valid call, never a broken one; the tool's result goes back in the conversation
    auto = api.chat.completions.create(model=a.status()["model"], messages=ask, max_tokens=80, temperature=0, tools=[WEATHER])
    message = auto.choices[0].message
    if message.tool_calls:
        jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    else:
        assert auto.choices[0].finish_reason in ("stop", "length") and message.content
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, light rain"}]
    answer = api.chat.completions.create(model=a.status()["model"], messages=follow, max_tokens=40, temperature=0, tools=[WEATHER])
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_a_pass_mixes_constrained_and_free_sessions(mesh):
    """Generations at once share the hops' passes: the free ones give their solo text, the constrained ones
    valid JSON, whatever they were batched with."""
    _, a = mesh
    api = client(a)
    free = dict(model=a.status()["model"], messages=[{"role": "user", "content": "Tell me about the sea."}],
                max_tokens=48, temperature=0)
    bound = dict(model=a.status()["model"], messages=[{"role": "user", "content": CASES[2][0]}], max_tokens=300,
                 temperature=0, response_format=schema_format(PERSON))
    solo = api.chat.completions.create(**free).choices[0].message.content
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda ask: api.chat.completions.create(**ask).choices[0].message.content,
                             [free, bound, free, bound]))
    assert outs[0] == outs[2] == solo
    for doc in (outs[1], outs[3]):
        jsonschema.validate(json.loads(doc), PERSON)


def test_a_hop_killed_mid_answer_keeps_it_valid(tmp_path):
    """Two servers of the middle third: the one in use is killed while a long constrained answer streams; the
    entry reroutes, the new tail's grammar is brought to where the old one was by the replay, and the answer
    parses, validates and equals the undisturbed one."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40, "maxItems": 40,
                                                         "items": {"type": "object", "properties": {
                                                             "id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                             "label": {"enum": ["red", "green", "blue"]}},
                                                             "required": ["id", "label"],
                                                             "additionalProperties": False}}},
              "required": ["items"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    m = Mesh()
    try:
        a, b1, b2, _ = m.start_chain([(0, 10), (10, 20), (10, 20), (20, 30)], env={"MESHD_RECORD_TTL": "30"})
        args = [sys.executable, "-m", "meshd.cli.ctl", "--socket", str(a.socket), "generate", "--chat", "--max-tokens",
                "900", "--no-speculate", "--stats", "--json-schema", str(path), "List forty coloured items."]
        solo = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert solo.returncode == 0, solo.stderr
        jsonschema.validate(json.loads(solo.stdout), schema)
        # a checked generation under the grammar: both routes mask, and agree
        checked = subprocess.run([*args[:-1], "--verify", args[-1]], capture_output=True, text=True, timeout=600)
        assert checked.returncode == 0, checked.stderr
        assert json.loads(checked.stderr.strip().splitlines()[-1])["checked"] and checked.stdout == solo.stdout
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = proc.stdout.read(len(solo.stdout) // 3)
        (victim,) = [d for d in (b1, b2) if d.status()["sessions"] == 1]
        victim.proc.send_signal(signal.SIGKILL)
        rest, _ = read_rest(proc.stdout)
        err = proc.stderr.read()
        assert proc.wait(120) == 0, err
        stats = json.loads(err.strip().splitlines()[-1])
        assert stats["reroutes"] >= 1 and first + rest == solo.stdout, m.tails()
        jsonschema.validate(json.loads(first + rest), schema)
    finally:
        m.close()
