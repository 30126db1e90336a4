"""Prefix reuse across real daemons: a chat's turns start from the KV the route kept of the turn before, and
give the text of a full prefill; a hop that restarted costs a full prefill, not a wrong text; a conversation
sharing only the system prompt reuses exactly that.

Four daemons on loopback: d0, d1 and d2 serve thirds of SmolLM2 (native); d3 serves d0's third again with
`--prefix-ttl 0`, an entry that never asks for kept KV: the same turns sent there are computed whole,
over the same hops (the reference text).
"""

import json

import pytest

from meshd.cli.ctl import new_request_id, stream_answer
from meshd.shard.artifact import open_artifact
from meshd.shard.prefix import BLOCK
from meshd.shard.tokenizer import encode_messages, load_tokenizer
from meshd.cli.localmesh import Mesh
from meshd.wire import GenerateRequest

pytestmark = pytest.mark.slow
# a system prompt of a few hundred tokens (text from outside this feature: the opening of PEP 20 and PEP 8)
SYSTEM = ("You are a careful assistant for Python programmers. Follow these principles. "
          "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
          "Complex is better than complicated. Flat is better than nested. Sparse is better than dense. "
          "Readability counts. Special cases aren't special enough to break the rules. Although practicality "
          "beats purity. Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity, "
          "refuse the temptation to guess. There should be one-- and preferably only one --obvious way to do it. "
          "Although that way may not be obvious at first unless you're Dutch. Now is better than never. Although "
          "never is often better than *right* now. If the implementation is hard to explain, it's a bad idea. If "
          "the implementation is easy to explain, it may be a good idea. Namespaces are one honking great idea -- "
          "let's do more of those! One of Guido's key insights is that code is read much more often than it is "
          "written. The guidelines provided here are intended to improve the readability of code and make it "
          "consistent across the wide spectrum of Python code. A style guide is about consistency. Consistency "
          "with this style guide is important. Consistency within a project is more important. Consistency "
          "within one module or function is the most important.")
TURNS = ["What is a list comprehension?", "Show a short example.", "When should I avoid one?",
         "Thanks. Summarise in one sentence."]
TOKENS = 24


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    try:
        d0, d1, d2 = m.start_chain([(0, 10), (10, 20), (20, 30)])
        d3 = m.start("d3", ["--layers", "0:10", "--bootstrap", d0.addr, "--prefix-ttl", "0"])
        for d in (d0, d3):
            d.wait_for(lambda s: s["state"] == "serving" and s["complete"] and sum(p["serving"] for p in s["peers"]) == 3,
                       what="every daemon serving")
        yield m
    finally:
        m.close()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(open_artifact("smollm2"))


def ask(daemon, messages: list[dict]) -> tuple[str, dict]:
    req = GenerateRequest(request_id=new_request_id(), prompt="", messages=json.dumps(messages), max_tokens=TOKENS)
    with open("/dev/null", "w") as sink:
        code, stats, text = stream_answer(daemon.socket, req, 120.0, out=sink)
    assert code == 0, f"generation failed ({code})"
    return text, stats


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_chat_reuses_each_turns_kv_and_gives_the_text_of_a_full_prefill(mesh, tokenizer):
    d0, d1, d2, d3 = mesh.daemons
    conversation = [{"role": "system", "content": SYSTEM}]
    before = None
    for i, turn in enumerate(TURNS):
        conversation.append({"role": "user", "content": turn})
        text, stats = ask(d0, conversation)
        whole, whole_stats = ask(d3, conversation)
        assert text == whole, f"turn {i + 1}: reused KV changed the text"
        assert whole_stats["cached_tokens"] == 0
        ids = encode_messages(tokenizer, conversation)
        assert stats["prompt_tokens"] == len(ids) > 250
        if before is None:
            assert stats["cached_tokens"] == 0
        else:
            # the turn before's prompt and answer are a prefix of this one: at least its prompt's whole
            # blocks are reused, never the last token (the tail must compute a position)
            assert (len(before) // BLOCK) * BLOCK <= stats["cached_tokens"] <= len(ids) - 1, (i, stats)
            assert stats["cached_tokens"] % BLOCK == 0
        before = ids
        conversation.append({"role": "assistant", "content": text})
    for d in (d0, d1, d2):  # every hop of the route kept and reused
        cache = d.status()["prefix_cache"]
        assert cache["hits"] >= len(TURNS) - 1 and cache["tokens_reused"] > 0 and cache["entries"] >= 1, d.name
    assert d3.status()["prefix_cache"]["hits"] == 0


def test_a_restarted_middle_hop_costs_a_full_prefill_and_the_same_text(mesh, tokenizer):
    d0, d1, d2, d3 = mesh.daemons
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three built-in types."}]
    text, _ = ask(d0, conversation)
    conversation += [{"role": "assistant", "content": text}, {"role": "user", "content": "And three modules?"}]
    d1.kill()  # the middle hop goes down and comes back (same identity, empty KV)
    d1 = mesh.daemons[1] = mesh.start("d1", ["--layers", "10:20", "--bootstrap", d0.addr])
    d1.wait_serving()
    d0.wait_for(lambda s: s["complete"] and d1.status()["peer_id"] in {p["peer_id"] for p in s["peers"] if p["serving"]},
                what="the restarted hop serving in the entry's view")
    text, stats = ask(d0, conversation)
    whole, _ = ask(d3, conversation)
    assert text == whole and stats["cached_tokens"] == 0, stats
    text, stats = ask(d0, conversation)  # and the route has kept it again
    assert text == whole and stats["cached_tokens"] > 0, stats


def test_another_conversation_sharing_the_system_prompt_reuses_exactly_its_blocks(mesh, tokenizer):
    d0 = mesh.daemons[0]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is Python fast?"}]
    ask(d0, first)
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who designed Python?"}]
    text, stats = ask(d0, other)
    shared = common(encode_messages(tokenizer, first), encode_messages(tokenizer, other))
    assert shared > 250 and stats["cached_tokens"] == (shared // BLOCK) * BLOCK, (shared, stats)
    whole, _ = ask(mesh.daemons[3], other)
    assert text == whole
