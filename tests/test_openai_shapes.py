"""The OpenAI API's shapes, pure: request checks and stop sequences."""

import json

import pytest
from hypothesis import given, strategies as st

from meshd.api import openai

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
