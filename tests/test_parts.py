"""The daemon's parts know it only through the few things each asks of it (meshd/api/control.py's
`Controls`, meshd/api/http.py's `Served`, the metrics' two readings), keep the counts they change
themselves, and a move of layers is a state of the lifecycle table: pure tests with made-up values, a
real Unix socket for the control server, no daemon. The real wiring: tests/test_drain.py, test_ctl.py,
test_rebalance_mesh.py, test_handover.py."""

import json

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from meshd.api.control import ControlServer, Controls
from meshd.api.http import HttpApi, Served
from meshd.api.metrics import Metrics
from meshd.node.lifecycle import BadMove, Lifecycle, State
from meshd.p2p.channel import Channel
from meshd.wire import DrainRequest, GenerateRequest, StatusRequest


def test_a_move_of_layers_is_a_lifecycle_state_that_serves_but_does_not_move_again():
    life = Lifecycle()
    life.to(State.LOADING)
    life.to(State.SERVING)
    assert life.may_move and life.takes_new_work
    assert life.to(State.MOVING) and str(life) == "moving layers"
    assert life.takes_new_work and life.accepts_generations and not life.may_move and not life.is_leaving
    assert life.reason == ""  # a move is no drain: `meshctl status` shows no drain reason for it
    life.to(State.SERVING)
    life.to(State.MOVING)
    assert life.to(State.DRAINING, "SIGTERM")  # a stop asked during a move drains the new range
    assert not life.takes_new_work and not life.may_move
    with pytest.raises(BadMove):
        life.to(State.MOVING)  # a leaving daemon moves no layers


def controls(**over) -> Controls:
    async def observe(run, req, emit):
        return await run(req, emit)

    async def drain(reason, timeout):
        raise AssertionError("not asked for")

    def refuse(*_):
        raise AssertionError("not asked for")

    life = Lifecycle()
    life.to(State.SERVING)
    parts = dict(stage=life, status=lambda: {"state": str(life)}, ledger_totals=refuse, drain=drain, stop=refuse,
                 drain_timeout_s=30.0, observe=observe, entry=lambda: None, choose_entry=refuse, open_stream=refuse)
    return Controls(**{**parts, **over})


async def ask(path, msg, events: int = 1) -> list:
    channel = Channel.over_trio(await trio.open_unix_socket(str(path)))
    try:
        await channel.send(msg)
        return [await channel.receive(10) for _ in range(events)]
    finally:
        await channel.aclose()


async def test_the_control_server_counts_the_generations_running_and_is_idle_when_none_does(tmp_path):
    path, started, release = tmp_path / "s.sock", trio.Event(), trio.Event()

    class Entry:
        async def generate(self, req, emit):
            started.set()
            await release.wait()
            return {"tokens": 0}

    server = ControlServer(controls(entry=Entry), path)
    assert server.idle
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        nursery.start_soon(ask, path, GenerateRequest(request_id=1, prompt="hi"))
        await started.wait()
        assert server.generations == 1 and not server.idle  # what a drain waits for
        release.set()
        while not server.idle:
            await trio.sleep(0.01)
        assert server.generations == 0 and server.answering == 0
        nursery.cancel_scope.cancel()


async def test_a_drain_asked_on_the_socket_goes_to_the_daemon_s_drain_and_is_answered_with_the_status(tmp_path):
    path, asked = tmp_path / "s.sock", []

    async def drain(reason, timeout):
        asked.append((reason, timeout))

    async with trio.open_nursery() as nursery:
        await nursery.start(ControlServer(controls(drain=drain, stop=lambda why: asked.append(why)), path).serve)
        [reply] = await ask(path, DrainRequest(request_id=1))
        assert reply.kind == "status" and reply.stats == {"state": "serving"}
        assert asked == [("meshctl drain", None)]  # a plain drain waits as long as it takes
        [reply] = await ask(path, DrainRequest(request_id=2, exit=True))
        assert asked[1:] == ["meshctl drain --exit", ("meshctl drain", 30.0)]  # --exit: stop, within the timeout
        [reply] = await ask(path, StatusRequest(request_id=3))
        assert reply.stats == {"state": "serving"}
        nursery.cancel_scope.cancel()


async def test_a_daemon_not_yet_serving_refuses_generations_as_busy(tmp_path):
    path = tmp_path / "s.sock"
    async with trio.open_nursery() as nursery:
        await nursery.start(ControlServer(controls(stage=Lifecycle()), path).serve)  # still starting
        [reply] = await ask(path, GenerateRequest(request_id=1, prompt="hi"))
        assert reply.kind == "error" and reply.stats["code"] == "busy" and "starting" in reply.text
        nursery.cancel_scope.cancel()


def test_the_metrics_read_the_status_and_the_ledger_they_are_given():
    status = {"sessions": 3, "kv_bytes": 4096, "peers": [{}, {}], "gaps": [[4, 10]], "generations": 2}
    totals = {"peers": {"12D3KooWpeer": {"for_us": 5, "by_us": 7}}, "generations": {"ok": 4}, "sessions": {}}
    text = Metrics(lambda: status, lambda: totals).exposition()[0].decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert got[("meshd_sessions_open", ())] == 3 and got[("meshd_kv_bytes", ())] == 4096
    assert got[("meshd_peers_known", ())] == 2 and got[("meshd_layers_uncovered", ())] == 6
    assert got[("meshd_generations_active", ())] == 2
    assert got[("meshd_ledger_layer_tokens_total", (("direction", "by_us"), ("peer", "12D3KooWpeer")))] == 7
    assert got[("meshd_ledger_generations_total", (("outcome", "ok"),))] == 4


def served(state: str = "", gaps=()) -> Served:
    return Served(model="m.gguf", max_positions=2048, chat_template="", started_at=1_700_000_000.0,
                  status=lambda: {"model": "m.gguf", "complete": not gaps, "gaps": list(gaps), "n_layers": 30,
                                  "recipe": "native"},
                  state=lambda: state, gaps=lambda: list(gaps))


async def call(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg):
        sent.append(msg)

    await app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


async def test_the_http_api_answers_health_models_and_gaps_from_what_it_is_served():
    assert await call(HttpApi(served(), None, None), "GET", "/healthz") == (200, {"status": "ok"})
    assert await call(HttpApi(served("draining"), None, None), "GET", "/healthz") == (503, {"status": "draining"})
    code, models = await call(HttpApi(served(), None, None), "GET", "/v1/models")
    assert code == 200 and models["data"][0]["id"] == "m.gguf" and models["data"][0]["created"] == 1_700_000_000
    request = json.dumps({"model": "m.gguf", "messages": [{"role": "user", "content": "hi"}]}).encode()
    code, error = await call(HttpApi(served(gaps=[(10, 20)]), None, None), "POST", "/v1/chat/completions", request)
    assert code == 503 and "[10, 20)" in error["error"]["message"]  # no route: said before anything runs
