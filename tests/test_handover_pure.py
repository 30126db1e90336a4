"""Hand-over without sockets: who may push KV, what a receiver checks, that handed-over KV computes the bits the
sender's would, the replica an entry picks, and how a generation resumes from handed-over positions. The real
daemons' hand-overs are tests/test_handover.py's."""

import pytest

from meshd import wire as w
from meshd.dht.coverage import CoverageMap
from meshd.dht.record import CoverageRecord
from meshd.entry.errors import GenerationError, HopFailed
from meshd.entry import opening
from meshd.entry.policy import MAX_UNREACHED, Retries, Suspects
from meshd.entry.route import Hop, Route, plan_around, replaced
from meshd.entry.state import Generation
from meshd.hop import handover
from meshd.hop.endpoint import ShardEndpoint, token_frame
from meshd.p2p.channel import Channel
from meshd.shard import prefix
from meshd.shard.prefix import BLOCK, chain, root

R = root("m", "r", 0)
IDS = list(range(1000, 1090))  # 90 tokens: five whole blocks


@pytest.fixture(scope="module")
def shard():
    from meshd.shard.artifact import open_artifact
    from meshd.shard.recipe import get_recipe
    from meshd.shard.runtime import Shard

    art = open_artifact("smollm2")
    return Shard(art, 0, 30, get_recipe("native", art))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def open_msg(sid: bytes, asked=()) -> w.OpenSession:
    return w.OpenSession(request_id=1, session_id=sid, epoch=0, start=0, end=30, model_fingerprint="m",
                         recipe_fingerprint="r", max_length=256, prefix=prefix.pack(list(asked)))


def accept(ticket: bytes, positions: int = 80, sender: str = "leaving", **kw) -> w.AcceptKV:
    fields = dict(ticket=ticket, sender=sender, start=0, end=30, rope_table=0, positions=positions,
                  chain=prefix.pack(chain(IDS, R)[:positions // BLOCK]), model_fingerprint="m", recipe_fingerprint="r")
    return w.AcceptKV(**{**fields, **kw})


def prefill(ep, sid: bytes, ids: list[int], start: int = 0):
    replies = []
    spans = [(a + start, b + start) for a, b in w.chunk_spans(len(ids) - start, 32)]
    for i, (a, b) in enumerate(spans):
        replies = ep.handle(token_frame(sid, 0, 0, w.Phase.PREFILL, a, ids[a:b], i, len(spans)))
    return replies[0]


def chunks(shard, key, positions: int, step: int = 32, start: int = 0):
    for a in range(start, positions, step):
        k, v = handover.read_chunk(shard, key, a, min(positions, a + step))
        yield a, k, v


@pytest.mark.slow
def test_handed_over_kv_computes_the_bits_the_sender_s_would(shard):
    sender = ShardEndpoint(shard, "m", "r")
    receiver = ShardEndpoint(shard, "m", "r")
    (opened,) = sender.handle(open_msg(b"1" * 16), "entry")
    first = prefill(sender, b"1" * 16, IDS)
    # two rounds, as an entry runs them: the KV so far (48 positions), then what was computed meanwhile
    for ticket, held, positions in ((b"t" * 16, 0, 48), (b"u" * 16, 48, 80)):
        (ok,) = receiver.handle(accept(ticket, positions, held=held), "entry")
        assert isinstance(ok, w.Opened) and ok.session_id == ticket
        answers = []
        for a, k, v in chunks(shard, (b"1" * 16, 0), positions, start=held):
            answers += receiver.handle(w.KVChunk(ticket=ticket, position=a, tensors=(k, v)), "leaving")
        assert len(answers) == 1 and answers[0].positions == positions
    tally = receiver.incoming.tally
    assert (tally.received, tally.positions) == (1, 80)  # one session's hand-over, its positions once
    assert len(shard.kv.kept) == 1  # the second round's KV superseded the first's
    # the entry's next session on the receiver starts from the handed-over KV, and computes what the sender does
    (opened,) = receiver.handle(open_msg(b"2" * 16, chain(IDS, R)), "entry")
    assert opened.reused == 80
    resumed = prefill(receiver, b"2" * 16, IDS, start=80)
    assert (resumed.token_id, resumed.logprob) == (first.token_id, first.logprob)
    pos = len(IDS)
    for _ in range(3):
        a = sender.handle(token_frame(b"1" * 16, 0, 1, w.Phase.DECODE, pos, [first.token_id]))[0]
        b = receiver.handle(token_frame(b"2" * 16, 0, 1, w.Phase.DECODE, pos, [resumed.token_id]))[0]
        assert (a.token_id, a.logprob) == (b.token_id, b.logprob)
        first, resumed, pos = a, b, pos + 1
    # nobody else may start from it: the KV is kept for the entry that asked
    (opened,) = receiver.handle(open_msg(b"3" * 16, chain(IDS, R)), "someone else")
    assert opened.reused == 0
    for ep in (sender, receiver):
        for key in list(ep.sessions):
            ep.release(key)
    shard.kv.drop_kept()


@pytest.mark.slow
def test_kv_nobody_asked_for_or_shaped_wrong_is_refused_and_its_room_given_back(shard):
    ep = ShardEndpoint(shard, "m", "r")
    ep.incoming.clock = clock = Clock()
    ep.handle(open_msg(b"1" * 16), "entry")
    prefill(ep, b"1" * 16, IDS)
    (k, v), = [(k, v) for _, k, v in chunks(shard, (b"1" * 16, 0), 32, 32)]
    before = shard.kv.used_bytes
    # a chunk of no hand-over: refused, nothing held
    (err,) = ep.handle(w.KVChunk(ticket=b"x" * 16, position=0, tensors=(k, v)), "hostile")
    assert err.code == w.ErrorCode.BAD_FRAME and ep.incoming.tally.refused == 1 and shard.kv.used_bytes == before
    # accepted from one peer: another peer's chunks for it are refused
    assert isinstance(ep.handle(accept(b"a" * 16), "entry")[0], w.Opened)
    assert shard.kv.used_bytes > before  # its room is taken when it is accepted
    (err,) = ep.handle(w.KVChunk(ticket=b"a" * 16, position=0, tensors=(k, v)), "hostile")
    assert err.code == w.ErrorCode.BAD_FRAME
    # out of order, or of another dtype: refused, and the hand-over dropped with its room
    (err,) = ep.handle(w.KVChunk(ticket=b"a" * 16, position=16, tensors=(k, v)), "leaving")
    assert err.code == w.ErrorCode.BAD_FRAME and b"a" * 16 not in ep.incoming.open
    assert shard.kv.used_bytes == before
    assert isinstance(ep.handle(accept(b"b" * 16), "entry")[0], w.Opened)
    wrong = w.Tensor.from_torch("k", k.to_torch().float())
    (err,) = ep.handle(w.KVChunk(ticket=b"b" * 16, position=0, tensors=(wrong, v)), "leaving")
    assert err.code == w.ErrorCode.BAD_FRAME and "float32" in err.message
    assert shard.kv.used_bytes == before
    # a later round whose first positions are not kept here
    assert ep.handle(accept(b"c" * 16, 80, held=48), "entry")[0].code == w.ErrorCode.BAD_FRAME
    assert shard.kv.used_bytes == before
    # asked wrongly: no entry (a hop's own stream), a chain that does not name the positions, too many at once
    assert ep.handle(accept(b"c" * 16), "")[0].code == w.ErrorCode.BAD_FRAME
    assert ep.handle(accept(b"c" * 16, positions=72), "entry")[0].code == w.ErrorCode.BAD_FRAME
    assert ep.handle(accept(b"c" * 16, model_fingerprint="other"), "entry")[0].code == w.ErrorCode.MODEL_MISMATCH
    for i in range(handover.MAX_INCOMING_PER_PEER):
        assert isinstance(ep.handle(accept(bytes([i]) * 16), "greedy")[0], w.Opened)
    assert ep.handle(accept(b"z" * 16), "greedy")[0].code == w.ErrorCode.BAD_FRAME
    # KV that stops coming gives its room back after INCOMING_TTL_S
    clock.now += handover.INCOMING_TTL_S + 1
    ep.evict_expired()
    assert ep.incoming.open == {} and shard.kv.used_bytes == before
    ep.release((b"1" * 16, 0))


def record(peer, a, b, throughput=100.0, leaving=False):
    return CoverageRecord(peer, (f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",), "m", "r", a, b, 30, serving=True,
                          expires_at=1e12, throughput=throughput, leaving=leaving)


def test_the_replica_that_takes_a_leaving_hop_s_kv_serves_its_layers_to_the_same_end():
    route = Route((Hop("d", (), 10, 20), Hop("t", (), 20, 30)), 0.0)
    cov = CoverageMap(30, (record("d", 10, 20), record("t", 20, 30), record("slow", 10, 20, 50.0),
                           record("fast", 5, 20, 400.0), record("wide", 10, 30), record("gone", 10, 20, leaving=True)))
    new = replaced(cov, 10, route, "d", lambda peer: 0.001)
    assert new.describe() == [["fast", 10, 20], ["t", 20, 30]]  # entered mid-range, left at the same end
    assert replaced(cov, 10, route, "d", lambda peer: 0.001, {"fast"}).describe()[0][0] == "slow"
    assert replaced(cov, 10, route, "d", lambda peer: 0.001, {"fast", "slow"}) is None  # "wide" ends elsewhere
    assert replaced(cov, 10, route, "nobody", lambda peer: 0.001) is None


def test_a_generation_resumes_from_the_positions_handed_over():
    gen = Generation.start(IDS, 100, 2048)
    for t in range(40):
        gen.accept(7 + t)
    gen.begin_attempt([["e", 0, 10]])
    asked = gen.prefix_asked(R)
    assert len(asked) == (len(IDS) - 1) // BLOCK  # an ordinary route: the prompt's blocks only
    gen.resume = True
    asked = gen.prefix_asked(R)
    assert asked == gen.prefix_held(R) and len(asked) == (len(IDS) + 40 - 1) // BLOCK
    gen.started_from(len(asked) * BLOCK)  # 128 of 130 positions: the route computes from there
    assert gen.start_at == 128 and gen.reused == 0 and not gen.resume  # the client's cached prompt: kept KV only
    assert gen.work()[-1][1] == len(IDS) + 39 - 128
    gen.resume = True
    gen.started_from(10_000)  # never the last position: the tail samples after it
    assert gen.start_at == len(IDS) + 40 - 1


def test_a_hop_that_cannot_be_reached_to_open_costs_no_attempt_while_others_remain():
    r = Retries(deadline=30.0)
    for i in range(MAX_UNREACHED):
        r.after_failure(HopFailed(f"p{i}", "could not open a session: dial failed", opening=True))
    assert r.failures == 0 and r.unreached == MAX_UNREACHED and len(r.failed) == MAX_UNREACHED
    r.after_failure(HopFailed("p0", "could not open a session", opening=True))  # tried again: it counts
    assert r.failures == 1
    r.after_failure(HopFailed("x", "reset mid-stream"))
    with pytest.raises(Exception, match="more"):
        r.after_failure(HopFailed("y", "more"))
    r = Retries(deadline=30.0)
    r.left("d")  # a hop that left on purpose: planned around, no failure
    assert r.failures == 0 and r.failed == {"d"}


def test_with_every_server_of_a_range_failed_a_silent_one_is_retried_before_one_that_could_not_be_reached():
    """Seen in the churn soak: 20:30's two servers failed one generation, one silent on a loaded box (alive), the
    other killed; the plan retried the dead one (its record still stood), whose dial failure was the third
    failure. Now the dead one's re-open costs no attempt, and the next plan takes the silent one."""
    cov = CoverageMap(30, (record("b", 10, 20), record("dead", 20, 30, 900.0), record("slow", 20, 30, 50.0)))
    r = Retries(deadline=30.0)
    r.after_failure(HopFailed("slow", "silent for 1.6 s"))
    r.after_failure(HopFailed("dead", "stream closed: StreamEOF"))
    route, retried = plan_around(cov, 10, lambda p: 0.001, "e", r.failed, r.busy, unreachable=r.unreachable)
    assert retried and route.describe()[-1][0] == "dead"  # the faster one first: nothing says it is gone yet
    r.after_failure(HopFailed("dead", "could not open a session: SwarmDialAllFailedError", opening=True))
    assert r.failures == 2 and r.unreachable == {"dead"}  # its dial failure spends no attempt
    route, retried = plan_around(cov, 10, lambda p: 0.001, "e", r.failed, r.busy, unreachable=r.unreachable)
    assert retried and route.describe()[-1][0] == "slow"
    with pytest.raises(GenerationError):  # unreachable a second time: it counts, the third failure
        r.after_failure(HopFailed("dead", "could not open a session", opening=True))


def test_a_hop_that_failed_is_avoided_by_later_routes_a_while_or_until_it_answers():
    s = Suspects(hold_s=10.0)
    s.failed("frozen", now=100.0)
    assert s.active(105.0) == {"frozen"}
    assert s.active(110.0) == set()  # expired
    s.failed("frozen", now=200.0)
    s.answered("frozen")  # it opened a session again
    assert s.active(201.0) == set()


async def test_opening_on_a_frozen_hop_fails_within_the_silence_bound_and_a_live_busy_one_is_waited_for(autojump_clock):
    import trio.testing

    async def answer_open(far: Channel, ping: bool, delay: float):
        await far.receive(60)  # the OpenSession
        await far.receive(60)  # the ping
        if ping:
            await far.send(w.Heartbeat(seq=0))
        await trio.sleep(delay)
        await far.send(w.Opened(request_id=1, session_id=b"s" * 16, epoch=0))

    for ping, delay in ((True, 20.0), (False, 20.0)):
        a, b = trio.testing.memory_stream_pair()
        near, far = Channel.over_trio(a), Channel.over_trio(b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_open, far, ping, delay)
            await near.send(w.OpenSession(request_id=1, session_id=b"s" * 16, epoch=0, start=10, end=20,
                                          model_fingerprint="m", recipe_fingerprint="r"))
            t0 = trio.current_time()
            if ping:  # alive (it echoes), its compute thread busy: its answer is waited for
                assert isinstance(await opening._answer_of_a_live_hop(near), w.Opened)
            else:  # frozen: given up after OPEN_SILENT_S, not when it thaws
                with pytest.raises(trio.TooSlowError):
                    await opening._answer_of_a_live_hop(near)
                assert trio.current_time() - t0 == pytest.approx(opening.OPEN_SILENT_S)
                nursery.cancel_scope.cancel()
