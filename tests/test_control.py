"""The control socket (meshd/api/control.py) on a real Unix socket with a made-up daemon: a request
that fails in a way nothing expected is answered with an `internal` error and logged, and the
socket serves on (before, such an exception left the server's nursery and stopped the daemon)."""

import trio

from meshd.api.control import ControlServer
from meshd.p2p.channel import Channel
from meshd.testing.fakes import FakeDaemon
from meshd.wire import GenerateRequest, StatusRequest


async def buggy(req, emit):
    raise RuntimeError("a bug in one generation")


async def ask(path, msg):
    stream = await trio.open_unix_socket(str(path))
    channel = Channel.over_trio(stream)
    try:
        await channel.send(msg)
        return await channel.receive(10)
    finally:
        await channel.aclose()


async def test_an_unexpected_failure_of_one_request_is_answered_and_the_socket_serves_on(tmp_path):
    path = tmp_path / "s.sock"
    async with trio.open_nursery() as nursery:
        await nursery.start(ControlServer(FakeDaemon(generate=buggy).controls(), path).serve)
        reply = await ask(path, GenerateRequest(request_id=1, prompt="hi"))
        assert reply.kind == "error" and reply.stats["code"] == "internal" and "a bug in one generation" in reply.text
        status = await ask(path, StatusRequest(request_id=2))
        assert status.kind == "status" and status.stats == {"state": "serving"}
        assert path.exists()
        nursery.cancel_scope.cancel()
