"""The OpenAI API's shapes, pure: request checks, stop sequences and usage; and the answers `HttpApi`
builds of a made-up generation (real daemons: tests/test_http.py)."""

import json

import pytest
import trio
from hypothesis import given, strategies as st

from meshd.api import openai
from meshd.api.http import HttpApi
from meshd.testing.fakes import FakeArtifact, FakeConfig, FakeDaemon
from meshd.wire import StreamEvent

MODEL = "m.gguf"


def parse(body, chat=True, context=2048):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return openai.parse_request(raw, chat, MODEL, context, 7)


def test_a_chat_request_becomes_a_generate_request():
    c = parse({"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi"}],
               "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "\n", "stream": True})
    r = c.request
    assert (r.request_id, r.max_tokens, r.temperature, r.top_p, r.seed) == (7, 5, 0.0, 0.5, 3)
    assert json.loads(r.messages)[1] == {"role": "user", "content": "Hi"} and c.stream and c.stop == ["\n"]
    assert parse({"prompt": "x"}, chat=False).request.prompt == "x"
    assert r.speculate and not parse({"prompt": "x", "speculate": False}, chat=False).request.speculate
    assert not r.verify and parse({"prompt": "x", "verify": True}, chat=False).request.verify
    parts = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert json.loads(parts.request.messages) == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    ([1, 2], "JSON object"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, "not served here"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "'n'"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "only text"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, "number"),
    ({"messages": [{"role": "user", "content": "x"}], "speculate": "no"}, "speculate"),
    ({"messages": [{"role": "user", "content": "x"}], "verify": 1}, "'verify' must be true or false"),
])
def test_bad_requests_are_refused_with_the_reason(body, message):
    with pytest.raises(openai.BadRequest, match=message):
        parse(body)


def test_a_stop_sequence_split_across_pieces_is_never_sent():
    s = openai.StopScanner(["STOP", "\n\n"])
    sent = s.push("Hello ST") + s.push("O") + s.push("P and more")
    assert sent == "Hello " and s.stopped and s.push("later") == "" and s.flush() == ""
    s = openai.StopScanner(["STOP"])
    assert s.push("a ST") + s.push("ART") + s.flush() == "a START" and not s.stopped


@given(st.text(max_size=40), st.lists(st.integers(0, 40), max_size=6), st.sampled_from(["ab", "\n", "xyz"]))
def test_any_split_gives_the_text_up_to_the_first_stop(text, cuts, stop):
    cuts = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    s = openai.StopScanner([stop])
    out = "".join(s.push(p) for p in pieces) + s.flush()
    assert out == text.split(stop)[0]


def test_usage_says_how_many_prompt_tokens_were_cached():
    got = openai.usage({"prompt_tokens": 2931, "cached_tokens": 2912, "tokens": 10})
    assert got == {"prompt_tokens": 2931, "completion_tokens": 10, "total_tokens": 2941,
                   "prompt_tokens_details": {"cached_tokens": 2912}}
    assert openai.usage({"prompt_tokens": 5, "tokens": 1})["prompt_tokens_details"] == {"cached_tokens": 0}  # older
    c = parse({"messages": [{"role": "user", "content": "Hi"}]})
    stats = {"prompt_tokens": 6, "cached_tokens": 4, "tokens": 2}
    assert openai.answer(c, "ab", "stop", stats)["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert openai.chunk(c, None, "stop", stats)["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def made_up_generate(stats: dict):
    """A generation of "Hello world" in two texts, the first telling the prompt's tokens, as an entry's does."""
    async def generate(req, emit):
        await emit(StreamEvent(request_id=req.request_id, kind="text", text="Hello",
                               stats={"tokens": 1, "prompt_tokens": 40, "cached_tokens": 32}))
        await emit(StreamEvent(request_id=req.request_id, kind="text", text=" world", stats={"tokens": 2}))
        return stats
    return generate


async def post(app, body: dict) -> list[dict]:
    """The JSON objects of the answer: the whole one, or each streamed event's."""
    sent, asked = [], False

    async def receive():
        nonlocal asked
        if asked:
            await trio.sleep_forever()  # the client stays to the end
        asked = True
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(msg):
        sent.append(msg)

    await app({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive, send)
    raw = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    if not body.get("stream"):
        return [json.loads(raw)]
    return [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", [[], [" wor"]])
async def test_the_usage_tells_the_cached_prompt_tokens_whole_streamed_or_cut_at_a_stop(stream, stop):
    daemon = FakeDaemon(artifact=FakeArtifact(name=MODEL, config=FakeConfig(max_positions=2048)))
    done = {"tokens": 2, "prompt_tokens": 40, "cached_tokens": 32, "route": []}  # the entry's own stats
    app = HttpApi(daemon.served(), made_up_generate(done), metrics=None)
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": stream, "stop": stop, "max_tokens": 8}
    usage = (await post(app, body))[-1]["usage"]  # cut at a stop, the first text's figures make it
    assert usage["prompt_tokens"] == 40 and usage["prompt_tokens_details"] == {"cached_tokens": 32}


def retracting_generate():
    """A checked generation whose text goes out at once: "Hello wrld", a check takes back " wrld" (the first 5
    characters stand), then " world" follows, with how far it is checked along the way."""
    async def generate(req, emit):
        rid = req.request_id
        await emit(StreamEvent(request_id=rid, kind="text", text="Hello", stats={"tokens": 1, "prompt_tokens": 4}))
        await emit(StreamEvent(request_id=rid, kind="verified", stats={"verified_through": 1}))
        await emit(StreamEvent(request_id=rid, kind="text", text=" wr", stats={"tokens": 2}))
        await emit(StreamEvent(request_id=rid, kind="text", text="ld", stats={"tokens": 3}))
        await emit(StreamEvent(request_id=rid, kind="retract", text="a check found generated token 1 wrong",
                               stats={"tokens": 1, "keep_chars": 5}))
        await emit(StreamEvent(request_id=rid, kind="text", text=" world", stats={"tokens": 2}))
        await emit(StreamEvent(request_id=rid, kind="verified", stats={"verified_through": 2}))
        return {"tokens": 2, "prompt_tokens": 4, "route": []}
    return generate


async def raw_answer(app, body: dict) -> str:
    sent, asked = [], False

    async def receive():
        nonlocal asked
        if asked:
            await trio.sleep_forever()
        asked = True
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(msg):
        sent.append(msg)

    await app({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive, send)
    return b"".join(m.get("body", b"") for m in sent[1:]).decode()


async def test_text_a_check_takes_back_is_left_out_of_an_answer_and_retracted_in_a_stream():
    daemon = FakeDaemon(artifact=FakeArtifact(name=MODEL, config=FakeConfig(max_positions=2048)))
    app = HttpApi(daemon.served(), retracting_generate(), metrics=None)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    whole = json.loads(await raw_answer(app, body))
    assert whole["choices"][0]["message"]["content"] == "Hello world" and whole["usage"]["completion_tokens"] == 2
    raw = await raw_answer(app, body | {"stream": True})
    events = raw.split("\n\n")
    retract = [e for e in events if e.startswith("event: meshd.retract")]
    assert len(retract) == 1 and json.loads(retract[0].split("data: ", 1)[1])["keep_chars"] == 5
    assert ": verified_through 1" in events and ": verified_through 2" in events  # comments: clients skip them
    pieces = []
    for e in events:
        if e.startswith("data: {"):
            delta = json.loads(e[6:])["choices"][0]["delta"]
            pieces.append(delta.get("content") or "")
        elif e.startswith("event: meshd.retract"):
            pieces = ["".join(pieces)[:json.loads(e.split("data: ", 1)[1])["keep_chars"]]]
    assert "".join(pieces) == "Hello world"  # a client applying the retraction holds the text as it stands


@pytest.mark.parametrize("stop, text", [(["orld"], "Hello w"), (["lo wo"], "Hel"), (["rld"], "Hello w")])
async def test_a_stop_sequence_is_found_in_the_text_as_it_stands_after_a_retraction(stop, text):
    """Also where the text that stands begins it ("lo wo": "lo" given before the retraction). One that the text
    taken back holds ("rld" in "Hello wrld") ends the answer there: the text goes out at once, the stop with it."""
    daemon = FakeDaemon(artifact=FakeArtifact(name=MODEL, config=FakeConfig(max_positions=2048)))
    app = HttpApi(daemon.served(), retracting_generate(), metrics=None)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stop": stop}
    whole = json.loads(await raw_answer(app, body))
    assert whole["choices"][0]["message"]["content"] == text and whole["choices"][0]["finish_reason"] == "stop"
    raw = await raw_answer(app, body | {"stream": True})
    pieces = []
    for e in raw.split("\n\n"):
        if e.startswith("data: {"):
            pieces.append(json.loads(e[6:])["choices"][0]["delta"].get("content") or "")
        elif e.startswith("event: meshd.retract"):
            pieces = ["".join(pieces)[:json.loads(e.split("data: ", 1)[1])["keep_chars"]]]
    assert "".join(pieces) == text
