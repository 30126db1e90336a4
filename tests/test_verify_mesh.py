"""Checked generations on real daemons (SmolLM2, native lane, loopback): a lying replica of 10:20
(meshd/testing/liar.py: wrong hidden states from the 8th position on, and a claim of speed that puts
it on the first route; the hops' sketches locate the range)
never gets a wrong token to the client, is excluded within one checked generation, and later
routes avoid it; with only two servers of the lied-about range the generation fails rather than
guess; honest replicas over 200 checked steps exclude nobody; a range without a replica leaves the
generation unverified, and says so. Checked by prefill (the default, meshd/entry/windows.py) and in lockstep.
A liar that lies once in 500 positions, only after 200, is caught with every generation checked: where the
text goes out at once it is taken back from the wrong token (a `retract` event) and goes on right; where it
waits for its check no wrong token ever reaches the client. Honest replicas on the block kernel's two
instruction sets (--kernel-isa avx2 beside the CPU's best) never disagree over a long generation."""

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from meshd.cli.ctl import Connection, new_request_id
from meshd.cli.localmesh import Mesh
from meshd.testing.claims import claims_wrap
from meshd.testing.liar import liar_wrap
from meshd.wire import GenerateRequest

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
N = 16


def generate(d, *flags, tokens: int = N, prompt: str = PROMPT) -> tuple[int, str, dict, str]:
    out = subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(d.socket), "generate", "--max-tokens",
                          str(tokens), "--ignore-eos", "--stats", *flags, prompt], capture_output=True, text=True,
                         timeout=600)
    lines = out.stderr.strip().splitlines()
    stats = json.loads(lines[-1]) if out.returncode == 0 and lines else {}
    err = out.stderr if out.returncode == 0 else f"{out.stderr}\nthe entry's log:\n{d.tail(40)}"
    return out.returncode, out.stdout, stats, err


def peers_seen(d, n: int) -> None:
    d.wait_for(lambda s: s["state"] == "serving" and s["complete"] and sum(p["serving"] for p in s["peers"]) == n,
               what=f"{n} peers serving")


def local_text(tokens: int) -> str:
    """The reference: `meshd local` in one process over the same split, past end-of-text as the mesh runs are,
    on one thread as the daemons here run."""
    out = subprocess.run([sys.executable, "-m", "meshd.cli", "local", "--threads", "1", "--split", "10,20", "--ignore-eos",
                          "--max-tokens", str(tokens), PROMPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def reference():
    return {N: local_text(N), 200: local_text(200), LONG: local_text(LONG)}


LONG = 240  # a generation long enough for a liar that waits for position 205


def checked_until_disagreement(e, expected: str, tries: int = 6) -> dict:
    """Checked generations until one disagrees (each must give `expected`); its stats. Which two of
    three servers of a range a check takes is the planner's choice: the liar's claim of speed puts it
    on the first route unless its link measures slower than an honest replica's compute time, and
    two honest ones agree, so this repeats a few times."""
    for _ in range(tries):
        code, text, stats, err = generate(e, "--verify")
        assert code == 0, err
        assert text == expected
        if stats["disagreements"]:
            return stats
    peers = [(p["peer_id"][-6:], p["range"], p["throughput"], p["rtt_ms"]) for p in e.status()["peers"]]
    raise AssertionError(f"no checked generation of {tries} took the liar; the entry's peers (throughput,"
                         f" rtt ms): {peers}; the last stats: {stats}")


def test_a_liar_is_caught_excluded_and_routed_around(reference):
    m = Mesh(env={"MESHD_RECORD_TTL": "30"})
    try:
        common = ["--threads", "1"]
        e = m.start("e", ["--layers", "0:10", "--verify-rate", "0", "--http", "127.0.0.1:0", *common])
        boot = ["--bootstrap", e.wait_serving()["addrs"][0], *common]
        h1 = m.start("h1", ["--layers", "10:20", *boot])
        t = m.start("t", ["--layers", "20:30", *boot])
        liar = m.start("liar", ["--layers", "10:20", *boot], wrap=liar_wrap(scale=4.0, from_position=8))
        peers_seen(e, 3)
        liar_id = liar.wait_serving()["peer_id"]

        # two servers of 10:20 and they disagree: nobody can tell which is right, so no text at all
        code, text, _, err = generate(e, "--verify")
        assert code != 0 and "no third server" in err, err
        assert reference[N].startswith(text.rstrip("\n")) and len(text.strip()) < len(reference[N].strip())

        # a third server of 10:20 settles it: the client gets the one-process text, the liar is out
        h2 = m.start("h2", ["--layers", "10:20", *boot])
        h2.wait_serving()
        peers_seen(e, 4)
        stats = checked_until_disagreement(e, reference[N])
        assert stats["disagreements"] == 1 and stats["excluded"] == [liar_id]
        assert stats["diverged_layers"] == [[10, 20]]  # located by the hops' sketches
        assert stats["checked"] and not stats["verified"] and stats["unchecked_layers"] == [[20, 30]]
        st = e.status()
        excluded = st["checks"]["excluded"]
        assert [row["peer"] for row in excluded] == [liar_id] and "layers 10:20" in excluded[0]["reason"]
        assert st["checks"]["disagreed"] >= 1
        with urllib.request.urlopen(st["http"][0] + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert f'meshd_peer_excluded_seconds{{peer="{liar_id}"' in metrics
        listing = subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(e.socket), "status"],
                                 capture_output=True, text=True, timeout=60).stdout
        assert f"excluded  {liar_id}" in listing

        # later generations, checked or not, never route through the liar
        for flags in ((), ("--verify",)):
            code, text, stats, err = generate(e, *flags)
            assert code == 0, err
            assert text == reference[N]
            assert liar_id not in {hop[0] for hop in stats["route"]}
        assert stats["disagreements"] == 0 and stats["compared"] == N
        assert {h1.status()["peer_id"], h2.status()["peer_id"]} >= {hop[0] for hop in stats["route"][1:2]}
        assert t.wait_serving()

        # honest replicas only: 200 checked steps, no disagreement, nobody new excluded
        liar.terminate()
        code, text, stats, err = generate(e, "--verify", tokens=200)
        assert code == 0, err
        assert text == reference[200], f"{stats}\nthe entry's log:\n{e.tail(60)}"
        assert stats["compared"] == 200 and stats["disagreements"] == 0 and stats["excluded"] == []
        assert [row["peer"] for row in e.status()["checks"]["excluded"]] == [liar_id]
        ledger = json.loads(subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(e.socket), "ledger",
                                            "--json"], capture_output=True, text=True, timeout=60).stdout)
        assert ledger["checked"] >= 3
    finally:
        m.close()


def test_a_tail_that_lies_mid_generation_is_caught_the_same_way(reference):
    """Right hidden states, wrong tokens, from the 10th position on: the client gets the first tokens,
    a pause, then the rest of the one-process text; the lying tail is excluded."""
    m = Mesh(env={"MESHD_RECORD_TTL": "30"})
    try:
        common = ["--threads", "1"]
        e = m.start("e", ["--layers", "0:10", "--verify-rate", "0", *common])
        boot = ["--bootstrap", e.wait_serving()["addrs"][0], *common]
        m.start("m", ["--layers", "10:20", *boot])
        m.start("t1", ["--layers", "20:30", *boot])
        m.start("t2", ["--layers", "20:30", *boot])
        liar = m.start("tl", ["--layers", "20:30", *boot], wrap=liar_wrap(from_position=10))
        peers_seen(e, 4)
        liar_id = liar.wait_serving()["peer_id"]
        stats = checked_until_disagreement(e, reference[N])
        assert stats["disagreements"] == 1 and stats["excluded"] == [liar_id]
        assert stats["diverged_layers"] == [[20, 30]]
        assert stats["unchecked_layers"] == [[10, 20]] and not stats["verified"]
        code, text, stats, err = generate(e)
        assert code == 0 and text == reference[N] and liar_id not in {hop[0] for hop in stats["route"]}
    finally:
        m.close()


def events_of(d, tokens: int) -> list:
    """A generation's stream events as they came (text, verified, retract, done or error)."""
    conn = Connection(Path(d.socket))
    events = []
    try:
        conn.send(GenerateRequest(request_id=new_request_id(), prompt=PROMPT, max_tokens=tokens, ignore_eos=True))
        while not events or events[-1].kind not in ("done", "error"):
            events.append(conn.receive(600))
    finally:
        conn.close()
    return events


def text_standing(events: list) -> tuple[str, list[str]]:
    """The text as a client that applies retractions holds it, and every piece of text it was ever sent."""
    text, sent = "", []
    for e in events:
        if e.kind == "text":
            text += e.text
            sent.append(e.text)
        elif e.kind == "retract":
            text = text[:e.stats["keep_chars"]]
    return text, sent


def test_a_liar_that_lies_rarely_and_late_is_caught_when_every_generation_is_checked(reference):
    """The liar claims speed and the honest servers of its range modesty (the first route takes the liar), and it
    lies at one position only, 205 (generated token 201), once in 500 past it: both entries check every
    generation (--verify-rate 1). The one whose text goes out at once takes the text back from token 201 and
    goes on with the one-process text; the one whose text waits for its check never sends a wrong token. Each
    excludes the liar, and its ledger holds the windows."""
    m = Mesh(env={"MESHD_RECORD_TTL": "30"})
    try:
        common = ["--threads", "1"]
        now = m.start("now", ["--layers", "0:10", "--verify-rate", "1", "--verify-release", "at-once", *common])
        boot = ["--bootstrap", now.wait_serving()["addrs"][0], *common]
        held = m.start("held", ["--layers", "0:10", "--verify-rate", "1", *boot])
        for name in ("h1", "h2"):  # claiming a hundredth of their speed: the first route takes the liar whatever
            m.start(name, ["--layers", "10:20", *boot], wrap=claims_wrap(0.01))  # the links measure on a loaded box
        m.start("t", ["--layers", "20:30", *boot])
        liar = m.start("liar", ["--layers", "10:20", *boot], wrap=liar_wrap(scale=4.0, from_position=205, every=500))
        liar_id = liar.wait_serving()["peer_id"]
        for e in (now, held):
            peers_seen(e, 5)

        events = events_of(now, LONG)
        assert events[-1].kind == "done", events[-1]
        stats = events[-1].stats
        text, sent = text_standing(events)
        want = reference[LONG].removesuffix("\n")  # the command line ends its text with a newline
        assert text == want, f"{stats}\nthe entry's log:\n{now.tail(60)}"
        retracts = [e for e in events if e.kind == "retract"]
        assert len(retracts) == 1 and retracts[0].stats["tokens"] == 201, retracts
        assert "".join(sent) != want  # the wrong text did go out, and was taken back
        assert [e.stats["verified_through"] for e in events if e.kind == "verified"][-1] == LONG
        assert stats["disagreements"] == 1 and stats["excluded"] == [liar_id] and stats["retracted"] >= 1
        assert stats["diverged_layers"] == [[10, 20]] and stats["checked_by"] == "prefill"
        assert stats["verified_through"] == LONG and stats["unchecked_layers"] == [[20, 30]]

        events = events_of(held, LONG)
        assert events[-1].kind == "done", events[-1]
        stats = events[-1].stats
        text, sent = text_standing(events)
        assert not [e for e in events if e.kind in ("retract", "verified")]
        assert "".join(sent) == text == want, f"{stats}\nthe entry's log:\n{held.tail(60)}"
        assert stats["disagreements"] == 1 and stats["excluded"] == [liar_id] and stats["retracted"] == 0

        ledger = json.loads(subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(held.socket),
                                            "ledger", "--json"], capture_output=True, text=True, timeout=60).stdout)
        assert ledger["windows"]["disagreed"] == 1 and ledger["windows"]["agreed"] >= LONG // 16
    finally:
        m.close()


def test_honest_replicas_on_the_two_kernel_paths_never_disagree_over_a_long_generation(reference):
    """Every range past the entry on two daemons, one of each on --kernel-isa avx2 (the other on the best the CPU
    has: AVX-512 where it has it): every generation checked, whichever two the routes take, none disagrees."""
    m = Mesh(env={"MESHD_RECORD_TTL": "30"})
    try:
        common = ["--threads", "1"]
        e = m.start("e", ["--layers", "0:10", "--verify-rate", "1", *common])
        boot = ["--bootstrap", e.wait_serving()["addrs"][0], *common]
        for name, layers, isa in (("a", "10:20", []), ("b", "10:20", ["--kernel-isa", "avx2"]),
                                  ("c", "20:30", []), ("d", "20:30", ["--kernel-isa", "avx2"])):
            m.start(name, ["--layers", layers, *isa, *boot])
        peers_seen(e, 4)
        for _ in range(2):
            code, text, stats, err = generate(e, tokens=LONG)
            assert code == 0, err
            assert text == reference[LONG]
            assert stats["verified"] and stats["compared"] == LONG and stats["disagreements"] == 0, stats
            assert stats["excluded"] == [] and stats["verified_through"] == LONG
        assert e.status()["checks"]["excluded"] == []
    finally:
        m.close()
