"""A hop session's lifecycle without daemons (meshd/hop/sessions.py): whichever way a session ends (its entry
closes it, its stream ends, the KV store evicts it under pressure, it idles past its TTL, a newcomer takes its
room, its KV is handed over), nothing is left of it anywhere: the session table and its reservations, the
shard's rows, the KV store, the scheduler's queues, the due marks, the next hop's link. And every `busy` a hop
sends is built one way."""

import pytest
import trio
import trio.testing

from meshd import wire as w
from meshd.hop import handover
from meshd.hop.admission import BUSY_RETRY_S, busy
from meshd.hop.endpoint import ShardEndpoint, token_frame
from meshd.hop.intake import Intake
from meshd.hop.scheduler import Scheduler
from meshd.hop.service import ShardService
from meshd.shard import prefix
from meshd.shard.artifact import open_artifact
from meshd.shard.recipe import NATIVE
from meshd.shard.runtime import Shard
from tests import tiny_models

QT = tiny_models.gguf.GGMLQuantizationType
SID, OTHER = b"a" * 16, b"b" * 16
PROMPT = list(range(3, 23))  # 20 tokens: one whole block of prefix.BLOCK


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    model = tiny_models.tiny_llama(seed=5)
    tiny_models.quantize_linear_weights(model, QT.Q4_0)
    return open_artifact(tiny_models.write_llama_gguf(model, tmp_path_factory.mktemp("m") / "m.gguf", qtype=QT.Q4_0))


class Inline:
    """The compute thread, inline (the event loop runs every job itself)."""

    async def run(self, fn, *args):
        return fn(*args)

    def waiting(self) -> int:
        return 0


class Stream:
    """A shard stream that keeps what it is sent."""

    def __init__(self, peer: str) -> None:
        self.peer, self.sent, self.closed = peer, [], False

    async def send(self, msg) -> None:
        self.sent.append(msg)

    async def aclose(self, **_) -> None:
        self.closed = True


class Ledger:
    def __init__(self) -> None:
        self.rows = []

    def session_served(self, peer, start, end, positions, outcome, opened_at) -> None:
        self.rows.append((peer, outcome))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hop(artifact, clock: Clock, kv_budget: int = 1 << 26, max_sessions: int = 64, **kw) -> ShardService:
    """A hop serving the whole tiny model, on `clock`, its next hops reached over `Stream`s (built in trio)."""
    shard = Shard(artifact, 0, artifact.config.n_layers, NATIVE, kv_budget_bytes=kv_budget, **kw)
    shard.kv.clock = shard.kv.kept.clock = clock
    endpoint = ShardEndpoint(shard, "m", "r", max_sessions=max_sessions, idle_when_full=60)
    endpoint.ledger, endpoint.incoming.clock = Ledger(), clock
    service = ShardService(endpoint, Inline(), Scheduler())

    async def dial(peer, addrs):
        return Stream(peer)

    service.outputs.dial = dial
    return service


def open_msg(sid: bytes, max_length: int = 64, next_peer: str = "next") -> w.OpenSession:
    return w.OpenSession(request_id=1, session_id=sid, epoch=0, start=0, end=6, model_fingerprint="m",
                         recipe_fingerprint="r", max_length=max_length, next_peer=next_peer, next_addrs="/ip4/1")


async def open_from(service: ShardService, intake: Intake, home: Stream, msg: w.OpenSession) -> list:
    """Open a session as a shard stream does: admitted (reserved) at once, opened, settled."""
    refusal = intake.admission(service, home.peer, msg)
    if refusal is not None:
        return [refusal]
    try:
        return await service.open_linked(msg, home)
    finally:
        intake.opened(service, home.peer, msg)


async def prefill(service: ShardService, sid: bytes, ids: list[int] = PROMPT) -> list:
    return await service.handle(token_frame(sid, 0, 0, w.Phase.PREFILL, 0, ids))


def held(service: ShardService, key=(SID, 0)) -> dict:
    """What any owner holds for session `key` (empty: nothing)."""
    endpoint, shard = service.endpoint, service.endpoint.shard
    found = {
        "table": key in endpoint.sessions,
        "reserved": any(k == key for _, k in endpoint.sessions.reserved),
        "shard": key in shard._sessions,
        "kv": key in shard.kv.sessions(),
        "queue": key in service.scheduler._queues,
        "due": key in service.due.keys,
    }
    return {name: True for name, there in found.items() if there}


def bare(service: ShardService) -> None:
    """Nothing is held for any session: no record, reservation, rows, KV, queued work, due mark or link."""
    endpoint, shard = service.endpoint, service.endpoint.shard
    assert not endpoint.sessions and not endpoint.sessions.reserved
    assert not shard._sessions and not shard.kv.sessions() and shard.kv.live_bytes == 0
    assert not service.scheduler._queues and service.scheduler.queued == 0 and not service.due
    assert len(service.outputs.next_hops) == 0 and not endpoint.incoming.open


def run(main):
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_session_closed_by_its_entry_or_its_stream_leaves_nothing(artifact):
    async def main():
        service, intake, home = hop(artifact, Clock()), Intake(), Stream("entry")
        for sid in (SID, OTHER):
            (opened,) = await open_from(service, intake, home, open_msg(sid))
            assert isinstance(opened, w.Opened) and opened.forwarding
        assert service.endpoint.sessions.held_by("entry") == (2, 2 * service.endpoint.kv_need(open_msg(SID)))
        assert not service.endpoint.sessions.reserved  # settled once open
        await prefill(service, SID)
        service.expect((SID, 0))
        assert held(service) == {"table": True, "shard": True, "kv": True, "due": True}
        await service.handle(w.Close(session_id=SID, epoch=0), "entry")  # its entry closes it
        assert held(service) == {} and len(service.outputs.next_hops) == 1  # the other still uses the link
        await service.release((OTHER, 0))  # its stream ended
        bare(service)
        assert service.endpoint.ledger.rows == [("entry", "completed"), ("entry", "failed")]

    run(main)


def test_a_session_the_kv_store_evicts_under_pressure_leaves_nothing(artifact):
    """The KV store evicts an idle session on its own, while another session's KV grows (here a hand-over's
    room, which no promise covers): the session ends through its table, as if closed."""
    clock = Clock()
    probe = Shard(artifact, 0, artifact.config.n_layers, NATIVE)
    room = probe.session_kv_bytes(64)  # one session of 64 positions

    async def main():
        async with trio.open_nursery() as nursery:
            service = hop(artifact, clock, kv_budget=room + room // 8, kv_ttl_s=10)
            intake, home = Intake(peer_share=1.0), Stream("e")
            service.nursery = nursery
            (opened,) = await open_from(service, intake, home, open_msg(SID))
            assert isinstance(opened, w.Opened), opened
            await prefill(service, SID)
            assert service.endpoint.shard.kv.used_bytes == room  # grown to its 64 positions
            clock.now = 11.0  # idle past its TTL, and nobody has asked for its room yet
            assert held(service) == {"table": True, "shard": True, "kv": True}
            chain = prefix.chain(PROMPT, prefix.root("m", "r"))
            (ok,) = await service.handle(w.AcceptKV(ticket=b"t" * 16, sender="leaving", start=0, end=6, rope_table=0,
                                                    positions=16, chain=prefix.pack(chain), model_fingerprint="m",
                                                    recipe_fingerprint="r"), "e")
            assert isinstance(ok, w.Opened)  # its room came from the idle session, evicted by the store
            await trio.testing.wait_all_tasks_blocked()
            assert held(service) == {} and len(service.outputs.next_hops) == 0
            assert service.endpoint.ledger.rows == [("e", "failed")]
            (err,) = await service.handle(token_frame(SID, 0, 1, w.Phase.DECODE, len(PROMPT), [5]))
            assert err.code == w.ErrorCode.UNKNOWN_SESSION  # its entry hears of it at its next frame
            service.endpoint.incoming.drop(service.endpoint.incoming.open[b"t" * 16])
            bare(service)

    run(main)


def test_a_session_idle_past_its_ttl_or_whose_room_a_newcomer_takes_leaves_nothing(artifact):
    clock = Clock()

    async def main():
        async with trio.open_nursery() as nursery:
            service, intake, home = hop(artifact, clock, max_sessions=1, kv_ttl_s=100), Intake(), Stream("e")
            service.nursery = nursery
            await open_from(service, intake, home, open_msg(SID))
            await prefill(service, SID)
            clock.now = 61.0  # unused past idle_when_full: a newcomer takes its room
            (opened,) = await open_from(service, intake, Stream("f"), open_msg(OTHER))
            assert isinstance(opened, w.Opened) and held(service) == {}
            assert list(service.endpoint.sessions) == [(OTHER, 0)] and len(service.outputs.next_hops) == 1
            clock.now = 200.0  # the newcomer idles past the TTL: the daemon's evict loop ends it
            assert service.endpoint.evict_expired() == [(OTHER, 0)]  # on the compute thread, not through the service
            await trio.testing.wait_all_tasks_blocked()  # the event loop's part follows at once
            bare(service)
            assert service.endpoint.ledger.rows == [("e", "failed"), ("f", "failed")]

    run(main)


class Receiver:
    """A replica's stream for a hand-over: what the leaving hop sends goes to the replica's endpoint."""

    def __init__(self, endpoint: ShardEndpoint) -> None:
        self.endpoint, self.answers, self.closed = endpoint, [], False

    async def send(self, msg) -> None:
        self.answers += self.endpoint.handle(msg, "leaving")

    async def receive(self, timeout=None):
        return self.answers.pop(0)

    async def aclose(self, **_) -> None:
        self.closed = True


def test_a_session_handed_over_leaves_nothing_on_either_hop(artifact):
    async def main():
        replica = hop(artifact, Clock())
        async with trio.open_nursery() as nursery:
            service, intake, home = hop(artifact, Clock()), Intake(), Stream("entry")
            service.nursery = nursery

            async def dial(peer, addrs):
                return Receiver(replica.endpoint) if peer == "replica" else Stream(peer)

            service.outputs.dial = dial
            await open_from(service, intake, home, open_msg(SID))
            await prefill(service, SID)
            assert await service.retire() == 1 and isinstance(home.sent[-1], w.Leaving)
            chain = prefix.chain(PROMPT, prefix.root("m", "r"))
            ticket = b"t" * 16
            (ok,) = replica.endpoint.handle(w.AcceptKV(ticket=ticket, sender="leaving", start=0, end=6, rope_table=0,
                                                       positions=16, chain=prefix.pack(chain), model_fingerprint="m",
                                                       recipe_fingerprint="r"), "entry")
            assert isinstance(ok, w.Opened)
            assert await service.handle(w.HandOver(session_id=SID, epoch=0, peer="replica", addrs="/ip4/2",
                                                   ticket=ticket, positions=16), "entry") == []
            await trio.testing.wait_all_tasks_blocked()
            (done,) = [m for m in home.sent if isinstance(m, w.HandedOver)]
            assert done.positions == 16 and service.endpoint.sessions[(SID, 0)].handed_over
            await service.handle(w.Close(session_id=SID, epoch=0), "entry")  # its entry moves to the replica
        bare(service)
        bare(replica)  # the KV it took is kept for the entry's next session there, held by no session
        assert len(replica.endpoint.shard.kv.kept) == 1 and replica.endpoint.incoming.tally.received == 1
        assert service.endpoint.ledger.rows == [("entry", "handed_over")]

    run(main)


def test_a_reservation_is_given_back_whether_the_open_succeeds_or_not(artifact):
    async def main():
        service, intake, home = hop(artifact, Clock()), Intake(), Stream("e")
        bad = w.OpenSession(request_id=1, session_id=SID, epoch=0, start=0, end=9, model_fingerprint="m",
                            recipe_fingerprint="r")
        (err,) = await open_from(service, intake, home, bad)  # layers it does not serve: refused by the endpoint
        assert err.code == w.ErrorCode.BAD_FRAME
        bare(service)

    run(main)


def test_every_busy_says_when_to_try_again_by_one_rule():
    room = busy("busy: full", 3, SID)
    assert (room.code, room.retriable, room.request_id, room.session_id) == (w.ErrorCode.BUSY, True, 3, SID)
    assert room.retry_after_s == BUSY_RETRY_S  # room for a session frees as one ends
    assert busy("queue full", drain_s=0.25).retry_after_s == 0.25  # work: when the queue ahead has drained
