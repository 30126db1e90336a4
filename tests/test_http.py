"""The OpenAI-compatible HTTP API of real daemons, used through the official `openai` package."""

import json
import select
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd.cli.localmesh import Mesh, ctl

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def mesh():
    """Three daemons; the entry serves HTTP openly, the middle one (no layer 0) behind a token."""
    m = Mesh()
    try:
        a = m.start("a", ["--layers", "0:10", "--http", "127.0.0.1:0"])
        boot = a.wait_serving()["addrs"][0]
        b = m.start("b", ["--layers", "10:20", "--bootstrap", boot, "--http", "127.0.0.1:0", "--http-token", TOKEN])
        c = m.start("c", ["--layers", "20:30", "--bootstrap", boot])
        for d in (a, b, c):
            d.wait_for(lambda s: s["state"] == "serving" and s["complete"], what="complete coverage")
        yield m, a, b, c
    finally:
        m.close()


def client(daemon, key="none"):
    return openai.OpenAI(base_url=daemon.status()["http"][0] + "/v1", api_key=key, max_retries=0, timeout=120)


def metrics(daemon) -> dict:
    text = httpx.get(daemon.status()["http"][0] + "/metrics", timeout=10).text
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_chat_completion_equals_meshctl_and_streams_the_same_text(mesh):
    m, a, b, c = mesh
    expected = ctl(a.socket, ["generate", "--chat", "--max-tokens", "24", PROMPT]).stdout[:-1]
    before = metrics(a)
    api = client(a)
    models = api.models.list().data
    assert [x.id for x in models] == [a.status()["model"]]
    whole = api.chat.completions.create(model=models[0].id, messages=[{"role": "user", "content": PROMPT}],
                                        max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens > 5
    # meshctl asked the same just before: the hops kept its KV, and reused it (in whole blocks of 16)
    assert 16 <= whole.usage.prompt_tokens_details.cached_tokens < whole.usage.prompt_tokens
    chunks = list(api.chat.completions.create(model=models[0].id, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=24, temperature=0, stream=True))
    pieces = [ch.choices[0].delta.content or "" for ch in chunks]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == expected
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens_details.cached_tokens
    after = metrics(a)
    reused = after["meshd_prompt_tokens_cached_total{}"] - before["meshd_prompt_tokens_cached_total{}"]
    assert reused == 2 * whole.usage.prompt_tokens_details.cached_tokens
    assert after["meshd_prefix_hits_total{}"] >= before["meshd_prefix_hits_total{}"] + 2  # a's own layers
    assert after["meshd_prefix_kept_entries{}"] >= 1 and after["meshd_prefix_kept_bytes{}"] > 0
    assert after["meshd_generations_finished_total{}"] >= before["meshd_generations_finished_total{}"] + 2
    assert after["meshd_tokens_generated_total{}"] > before["meshd_tokens_generated_total{}"]
    assert after["meshd_time_to_first_token_seconds_count{}"] >= 2
    assert after['meshd_stream_bytes_total{"direction": "sent", "protocol": "/meshd/shard/1.0.0"}'] > 0


def test_speculate_false_in_the_body_asks_for_plain_decoding_and_metrics_count_drafts(mesh):
    m, a, b, c = mesh
    quote = "Repeat exactly: one two three four five six seven eight nine ten.\nRepeated: one two"
    api = client(a)
    texts, drafted = [], []
    for extra in ({"speculate": False}, {}):
        before = metrics(a)
        out = api.completions.create(model=a.status()["model"], prompt=quote, max_tokens=24, temperature=0,
                                     extra_body=extra)
        after = metrics(a)
        texts.append(out.choices[0].text)
        drafted.append(after["meshd_draft_tokens_total{}"] - before["meshd_draft_tokens_total{}"])
        assert after["meshd_draft_accepted_total{}"] - before["meshd_draft_accepted_total{}"] <= drafted[-1]
    assert texts[0] == texts[1]  # the same text, with or without drafts
    assert drafted[0] == 0 and drafted[1] > 0
    r = httpx.post(a.status()["http"][0] + "/v1/completions", json={"prompt": "x", "speculate": 1}, timeout=30)
    assert r.status_code == 400 and "speculate" in r.text


def test_a_daemon_without_layer_0_serves_too_behind_its_token(mesh):
    m, a, b, c = mesh
    with pytest.raises(openai.AuthenticationError):
        client(b).completions.create(model=a.status()["model"], prompt="Water boils at", max_tokens=4)
    out = client(b, TOKEN).completions.create(model=a.status()["model"], prompt="The capital of France is",
                                              max_tokens=16, temperature=0, stop=["."])
    assert out.choices[0].text and "." not in out.choices[0].text and out.choices[0].finish_reason == "stop"
    assert httpx.get(b.status()["http"][0] + "/healthz").status_code == 200  # health needs no token


@pytest.mark.parametrize("body, message", [
    (b"{oops", "not valid JSON"),
    (json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}).encode(), "not served here"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 6}).encode(), "max_tokens"),
])
def test_bad_requests_get_400_with_a_message(mesh, body, message):
    m, a, b, c = mesh
    r = httpx.post(a.status()["http"][0] + "/v1/chat/completions", content=body, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_a_streaming_client_that_disconnects_leaves_no_kv_on_any_hop(mesh):
    m, a, b, c = mesh
    body = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", a.status()["http"][0] + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert sum(d.status()["sessions"] for d in (a, b, c)) > 0  # mid-answer: KV held on the hops
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sum(d.status()["sessions"] for d in (a, b, c)):
        time.sleep(0.2)
    assert [d.status()["sessions"] for d in (a, b, c)] == [0, 0, 0]


def test_a_request_id_follows_the_generation_into_every_hops_log(mesh):
    m, a, b, c = mesh
    out = ctl(b.socket, ["generate", "--max-tokens", "4", "--stats", "Water boils at"])  # b forwards to a
    assert out.returncode == 0, out.stderr
    rid = json.loads(out.stderr.strip().splitlines()[-1])["request_id"]
    time.sleep(1.0)  # the hops log when their session streams close
    for d in (a, b, c):
        lines = [line for line in d.log_path.read_text().splitlines() if f'"request_id": {rid}' in line]
        assert lines, f"request {rid} not in {d.name}'s log"
        assert not any("disconnected" in line for line in lines)  # the client read to the end, then closed


def test_meshctl_chat_keeps_a_conversation_and_ends_on_ctrl_d(mesh):
    m, a, b, c = mesh
    out = subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(a.socket), "chat", "--max-tokens", "12",
                          "--stats"], input="What is the capital of France?\nAnd of Italy?\n", capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("you> ") == 3  # two turns answered, then the EOF prompt
    turns = [line for line in out.stderr.splitlines() if line.startswith("[prompt ")]
    assert len(turns) == 2 and " reused), " in turns[1]  # the second turn extends the first, kept on the hops
    # the first turn is the chat-templated answer to the question alone (the native lane answers as
    # llama.cpp does on this file: "L'Étoile, la Marseillaise,"; the exact lane says Paris)
    alone = subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(a.socket), "generate", "--chat",
                            "--max-tokens", "12", "What is the capital of France?"], capture_output=True, text=True,
                           timeout=120)
    assert alone.returncode == 0 and alone.stdout.strip()
    assert out.stdout.startswith("you> " + alone.stdout.strip()), (out.stdout, alone.stdout)
    second = out.stdout.split("you> ")[2].strip()
    assert second and second != alone.stdout.strip()  # the second turn answered the second question
    # SIGINT as a terminal delivers it: a test run started in the background (bash without job control)
    # has SIGINT ignored, and a Python started with it ignored never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(a.socket), "chat"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen, deadline = "", time.monotonic() + 60  # Ctrl-C once it waits for a line (a loaded box takes
    while "Ctrl-C to leave" not in seen and time.monotonic() < deadline:  # seconds to import; 1.5 s was a guess)
        if select.select([proc.stderr], [], [], 1)[0]:
            seen += proc.stderr.readline()
    assert "Ctrl-C to leave" in seen
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err


def test_an_uncovered_layer_gets_503_naming_it(mesh):
    """Last: it stops the tail."""
    m, a, b, c = mesh
    assert c.terminate() == 0
    a.wait_for(lambda s: s["gaps"] == [[20, 30]], timeout=30, what="the gap")
    r = httpx.post(a.status()["http"][0] + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "[20, 30)" in r.json()["error"]["message"]
    assert client(a).models.list().data[0].model_extra["meshd"]["route_complete"] is False
