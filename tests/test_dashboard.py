"""The dashboard's parts without a browser: the ring of recent generations, the shipped files, and
which HTTP routes need the token. Real daemons behind it: tests/test_dashboard_browser.py."""

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd.api import dashboard
from meshd.api.http import HttpApi
from meshd.api.metrics import Metrics
from meshd.api.recent import RecentGenerations
from meshd.testing.fakes import FakeDaemon
from meshd.cli.localmesh import Mesh, ctl
from meshd.wire import StreamEvent

TOKEN = "t0ken"


def test_the_ring_keeps_the_newest_generations_and_only_numbers_and_routes():
    ring = RecentGenerations(size=3)
    for i in range(5):
        ring.record({"tokens": i, "ttft_s": 0.5, "decode_tok_per_s": 12.345, "reroutes": 1,
                     "route": [["peerA", 0, 10], ["peerB", 10, 30]], "prompt": "secret", "text": "answer"})
    got = ring.entries()
    assert [g["tokens"] for g in got] == [4, 3, 2]  # newest first, the oldest fell out
    assert got[0]["route"] == [["peerA", 0, 10], ["peerB", 10, 30]] and got[0]["tok_per_s"] == 12.35
    assert "secret" not in json.dumps(got) and "answer" not in json.dumps(got)


def test_a_failed_generation_and_a_malformed_route_are_recorded_without_breaking():
    ring = RecentGenerations()
    ring.record(None, "hop_failed", ttft_s=None, seconds=1.5)
    ring.record({"tokens": 2, "route": [["p", "x", 3], "junk", ["q", 0, 30]]}, ttft_s=0.25)
    ok, failed = ring.entries()
    assert failed["outcome"] == "hop_failed" and failed["tokens"] == 0 and failed["route"] == []
    assert ok["route"] == [["q", 0, 30]] and ok["ttft_s"] == 0.25 and ok["tok_per_s"] is None


async def test_metrics_record_each_generation_through_the_front_door():
    metrics, seen = FakeDaemon().metrics, []

    async def run(req, emit):
        await emit(StreamEvent(request_id=1, kind="text", text="Hello"))
        return {"tokens": 1, "ttft_s": 0.01, "route": [["me", 0, 30]], "reroutes": 0, "rope_switched_at": 25}

    async def emit(event):
        seen.append(event.text)

    await metrics.observe_generation(run, None, emit)

    async def broken(req, emit):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await metrics.observe_generation(broken, None, emit)
    failed, ok = metrics.recent.entries()
    assert ok["route"] == [["me", 0, 30]] and ok["tokens"] == 1 and seen == ["Hello"]
    assert failed["outcome"] == "cancelled" and "Hello" not in json.dumps(metrics.recent.entries())
    assert metrics.registry.get_sample_value("meshd_rope_switches_total") == 1  # a longrope generation switched


async def test_a_text_that_brings_several_tokens_counts_a_gap_for_each():
    metrics = FakeDaemon().metrics

    async def run(req, emit):  # the second text holds tokens 2 to 4 (tokens 2 and 3 added no text)
        await emit(StreamEvent(request_id=1, kind="text", text="He", stats={"tokens": 1, "prompt_tokens": 3}))
        await emit(StreamEvent(request_id=1, kind="text", text="llo", stats={"tokens": 4}))
        await emit(StreamEvent(request_id=1, kind="text", text="!"))  # from an entry that does not say: one
        return {"tokens": 5}

    async def emit(event):
        pass

    await metrics.observe_generation(run, None, emit)
    counts = {s.name: s.value for h in (metrics.token_latency, metrics.ttft) for m in h.collect() for s in m.samples}
    assert counts["meshd_token_latency_seconds_count"] == 4 and counts["meshd_time_to_first_token_seconds_count"] == 1


def scraped_daemon(prefix_cache, handovers=None) -> FakeDaemon:
    """A daemon whose status holds what a scrape of /metrics reads (with its ledger's totals)."""
    return FakeDaemon({"sessions": 0, "kv_bytes": 4096, "peers": [], "gaps": [], "generations": 0,
                       "prefix_cache": prefix_cache, "handovers": handovers})


def scrape(metrics: Metrics) -> dict:
    text = metrics.exposition()[0].decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_metrics_show_the_prefix_cache_and_the_prompt_tokens_reused():
    cache = {"entries": 2, "held_bytes": 4096, "held_tokens": 64, "hits": 3, "misses": 1, "tokens_reused": 96,
             "evictions": 1, "ttl_s": 600.0}
    metrics = scraped_daemon(cache).metrics

    async def run(req, emit):
        return {"tokens": 4, "prompt_tokens": 40, "cached_tokens": 32}

    async def emit(event):
        pass

    await metrics.observe_generation(run, None, emit)
    got = scrape(metrics)
    assert {k: got[k] for k in ("meshd_prefix_kept_entries", "meshd_prefix_kept_bytes", "meshd_prefix_kept_tokens",
                                "meshd_prefix_hits_total", "meshd_prefix_misses_total",
                                "meshd_prefix_tokens_reused_total", "meshd_prefix_evictions_total")} == {
        "meshd_prefix_kept_entries": 2, "meshd_prefix_kept_bytes": 4096, "meshd_prefix_kept_tokens": 64,
        "meshd_prefix_hits_total": 3, "meshd_prefix_misses_total": 1, "meshd_prefix_tokens_reused_total": 96,
        "meshd_prefix_evictions_total": 1}
    assert got["meshd_prompt_tokens_total"] == 40 and got["meshd_prompt_tokens_cached_total"] == 32
    bare = scrape(scraped_daemon(None).metrics)  # a daemon without layers keeps nothing
    assert bare["meshd_prefix_kept_entries"] == 0 and bare["meshd_prefix_hits_total"] == 0


def test_the_page_loads_only_its_own_files():
    html = dashboard.asset("/")[0].decode()
    js = dashboard.asset("/dashboard.js")[0].decode()
    css = dashboard.asset("/dashboard.css")[0].decode()
    assert re.findall(r'(?:src|href)="([^"]+)"', html) == ["data:,", "/dashboard.css", "/dashboard.js"]
    assert re.findall(r'fetch\("([^"]+)"', js) == ["/v1/meshd/status", "/v1/chat/completions"]
    assert "url(" not in css and "@import" not in css
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", html + js + css)  # the SVG namespace is a name
    assert dashboard.asset("/nothing") is None and dashboard.asset("/dashboard.html") is None


def api_daemon() -> FakeDaemon:
    """What HttpApi reads of a daemon for these routes (the real one: tests/test_dashboard_browser.py)."""
    return FakeDaemon({"peer_id": "12D3KooWsecretpeer", "complete": True})


async def call(app, path, headers=()):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "GET", "path": path, "headers": list(headers)}
    await app(scope, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


async def test_the_page_is_open_but_the_status_needs_the_token():
    app = HttpApi(api_daemon().served(), generate=None, metrics=None, token=TOKEN)
    status, headers, body = await call(app, "/")
    assert status == 200 and headers[b"content-type"].startswith(b"text/html")
    assert b"connect-src 'self'" in headers[b"content-security-policy"] and b"12D3KooW" not in body
    status, _, body = await call(app, "/v1/meshd/status")
    assert status == 401 and b"12D3KooW" not in body
    status, _, body = await call(app, "/v1/meshd/status", [(b"authorization", b"Bearer wrong")])
    assert status == 401
    status, headers, body = await call(app, "/v1/meshd/status", [(b"authorization", f"Bearer {TOKEN}".encode())])
    assert status == 200 and json.loads(body) == api_daemon().status() and headers[b"cache-control"] == b"no-store"


async def test_without_a_token_the_status_is_open():
    app = HttpApi(api_daemon().served(), generate=None, metrics=None)
    status, _, body = await call(app, "/v1/meshd/status/")
    assert status == 200 and json.loads(body)["peer_id"] == "12D3KooWsecretpeer"
    status, headers, _ = await call(app, "/dashboard.js")
    assert status == 200 and headers[b"content-type"].startswith(b"text/javascript")


@pytest.mark.slow
def test_a_real_daemon_serves_the_page_and_its_status_behind_the_token():
    m = Mesh()
    try:
        d = m.start("solo", ["--layers", "0:30", "--http", "127.0.0.1:0", "--http-token", TOKEN])
        st = d.wait_serving()
        base, auth = st["http"][0], {"authorization": f"Bearer {TOKEN}"}
        page = httpx.get(base + "/", timeout=10)
        assert page.status_code == 200 and "dashboard.js" in page.text and st["peer_id"] not in page.text
        assert httpx.get(base + "/v1/meshd/status", timeout=10).status_code == 401
        prompt = "Name a colour."
        answer = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=120, json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0}).json()
        over_http = httpx.get(base + "/v1/meshd/status", headers=auth, timeout=10).json()
        printed = json.loads(ctl(d.socket, ["status", "--json"]).stdout)
        assert set(over_http) == set(printed)  # the same object as meshctl status --json
        for key in ("peer_id", "range", "model", "complete", "gaps", "coverage", "file_bytes", "recent_generations"):
            assert over_http[key] == printed[key], key
        recent = over_http["recent_generations"]
        assert len(recent) == 1 and recent[0]["route"] == [[st["peer_id"], 0, 30]] and recent[0]["ttft_s"] > 0
        text = answer["choices"][0]["message"]["content"]
        assert prompt not in json.dumps(over_http) and text not in json.dumps(over_http)
        assert over_http["weight_bytes"] <= 1.1 * over_http["file_bytes"]  # 4-bit blocks stay 4-bit
    finally:
        m.close()


def test_metrics_show_hand_overs():
    handovers = {"sent": 2, "received": 1, "failed": 1, "refused": 3, "positions": 640, "moved": 4, "replayed": 1}
    got = scrape(scraped_daemon(None, handovers).metrics)
    assert {k: got[f"meshd_handover_{k}_total"] for k in handovers} == handovers
    assert scrape(scraped_daemon(None).metrics)["meshd_handover_sent_total"] == 0
