"""One hostile peer against the 10:20 daemon of a three-daemon mesh with small limits (issue 26):
each attack keeps the daemon's RSS within its bounds, its heartbeat echo under the silence
threshold (no generation through it is rerouted), an honest generation correct during the attack and
right after it, and the memory comes back once the attacker left. The numbers (RSS before/peak/after,
the longest echo, the honest times) are in `bench/hostile_bench.py`'s table; here RSS has bounds."""

import pytest

from meshd.testing.hostile_run import honest_generation, run_attack
from meshd.cli.localmesh import Mesh

pytestmark = pytest.mark.slow
MB = 1 << 20
FRAME_BUDGET, PEER_SHARE, STREAMS, FRAME_TIMEOUT = 64 * MB, 32 * MB, 8, 3.0
KV_BUDGET = 1 << 30
MARGIN = 160 * MB  # what a daemon allocates beyond frames and KV while it serves (honest work, threads, copies)
HIDDEN = 576
LIMITS = ["--threads", "1", "--frame-budget-mb", str(FRAME_BUDGET // MB), "--peer-frame-mb", str(PEER_SHARE // MB),
          "--streams-per-peer", str(STREAMS), "--frame-timeout", str(FRAME_TIMEOUT), "--kv-budget", str(KV_BUDGET)]


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    try:
        a, b, _ = m.start_chain([(0, 10), (10, 20), (20, 30)], extra=LIMITS)
        reference = honest_generation(a.socket, None)
        assert reference.ok, reference.stderr
        yield a, b, reference.text
    finally:
        m.close()


def attack(mesh, name, coro, hold_s=0.0, kv=0):
    a, b, reference = mesh
    report = run_attack(name, b.proc.pid, b.addr, a.socket, reference, coro, hold_s=hold_s)
    print(report.row())
    assert report.rss_peak <= report.rss_before + FRAME_BUDGET + kv + MARGIN, report.row()
    # its heartbeat echo stayed under the silence threshold (the figure is in the row): the entry never gave up
    # on it, during the attack or after
    after, during = a.status()["recent_generations"][:2]  # the newest first
    assert during["reroutes"] == after["reroutes"] == 0, (during, after, report.row())
    # the generation started as the attacker left completes with the reference text (its time is in
    # the row: a duration on this shared box is no assertion)
    assert report.during.ok and report.after.ok, report.row()
    # back within 10% of the baseline within 30 s (issue 26): half frames used to leave 1.10-1.14x, held
    # by py-libp2p's buffers of streams the daemon had stopped reading (now reset and dropped) and by
    # the free tops of other threads' malloc arenas (the daemon pins malloc's thresholds)
    assert report.rss_after <= 1.10 * report.rss_before, report.row()
    assert b.status()["state"] == "serving"
    return report


def test_zstd_bombs_larger_than_a_peer_s_share_are_refused_before_they_inflate(mesh):
    report = attack(mesh, "zstd bombs 62 MB", lambda p: p.zstd_bombs(20, 62 * MB, HIDDEN, 10, 20))
    assert report.answers.get("Opened") == 1 and report.answers.get("bad_frame") == 1  # refused, then closed


def test_a_burst_of_zstd_bombs_within_the_share_is_read_a_share_at_a_time(mesh):
    report = attack(mesh, "zstd bombs 16 MB", lambda p: p.zstd_bombs(20, 16 * MB, HIDDEN, 10, 20))
    assert report.answers == {"Opened": 1, "bad_frame": 20}  # each too long for one pass, refused at once


def test_half_sent_frames_are_dropped_after_the_frame_timeout(mesh):
    report = attack(mesh, "half frames", lambda p: p.half_frames(16, 8 * MB, 4 * MB), hold_s=FRAME_TIMEOUT + 2)
    assert report.answers  # the streams were taken (and later dropped: RSS came back while they were open)


def test_a_session_flood_gets_one_peer_s_share_and_honest_sessions_still_open(mesh):
    report = attack(mesh, "session flood", lambda p: p.flood_sessions(200, 10, 20), hold_s=1.0)
    per_session = 2 * 10 * 3 * 8192 * 64 * 2  # KV promised to one full-length session on 10 layers
    assert 0 < report.answers["Opened"] <= int(0.75 * KV_BUDGET) // per_session
    assert report.answers["busy"] == 200 - report.answers["Opened"]


def test_streams_past_the_cap_per_peer_are_refused(mesh):
    report = attack(mesh, "idle streams", lambda p: p.many_streams(100), hold_s=1.0)
    opened, refused = report.answers
    assert opened == STREAMS and opened + refused == 100


def test_hidden_states_of_a_wrong_dtype_are_refused(mesh):
    async def dtypes(peer):
        return [await peer.wrong_dtype(d, HIDDEN, 10, 20) for d in ("int64", "float16", "bfloat16")]

    report = attack(mesh, "wrong dtypes", dtypes)
    assert report.answers == {"bad_frame": 3}


def test_kv_offered_by_a_peer_nobody_asked_is_refused(mesh):
    """Issue 36: a peer cannot push KV nobody asked for, nor have another entry's session handed anywhere; KV
    it asks to be handed to the daemon comes only from the sender it named (and is kept for itself alone)."""
    report = attack(mesh, "KV offered", lambda p: p.offer_kv(10, 20))
    assert report.answers == {"bad_frame": 2, "HandedOver": 1, "Opened": 1}, report.row()
