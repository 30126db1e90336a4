"""The work ledger on real daemons: a completed, a cancelled (client gone), an interrupted (entry
SIGKILLed, then restarted) and a failed (tail killed, no replica) generation, read back with
`meshctl ledger` at the entry and at the hops."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from meshd.cli.localmesh import Mesh, ctl

PROMPT = "The capital of France is"


@pytest.fixture
def mesh():
    m = Mesh()
    yield m
    m.close()


def ledger(d) -> dict:
    out = ctl(d.socket, ["ledger", "--json"], timeout=20)
    assert out.returncode == 0, f"{out.stderr}\n{d.name}'s log (exit {d.proc.poll()}):\n{d.tail(60)}"
    return json.loads(out.stdout)


def wait_ledger(d, predicate, what: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        t = ledger(d)
        if predicate(t):
            return t
        if time.monotonic() > deadline:
            raise AssertionError(f"{d.name}: timed out waiting for {what}; ledger {t}")
        time.sleep(0.3)


def start_generation(d, tokens: int = 1500) -> subprocess.Popen:
    """A long generation through `d`, returned once `d` runs it (plain decoding, and long enough that
    it is still running when the test ends it: 400 tokens with drafts had finished within the second)."""
    client = subprocess.Popen([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(d.socket), "generate",
                               "--max-tokens", str(tokens), "--ignore-eos", "--no-speculate", PROMPT],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    d.wait_for(lambda s: s["generations"] >= 1, timeout=30, what="a running generation")
    time.sleep(1.0)  # some tokens are generated
    return client


def test_ledger_records_each_outcome_at_the_entry_and_the_hops(mesh):
    d0, d1, d2 = mesh.start_chain([(0, 10), (10, 20), (20, 30)], extra=["--busy-wait", "3"])
    ids = [d.status()["peer_id"] for d in (d0, d1, d2)]

    out = ctl(d0.socket, ["generate", "--max-tokens", "12", "--ignore-eos", "--stats", "--no-speculate", PROMPT])
    assert out.returncode == 0, out.stderr
    positions = json.loads(out.stderr.strip().splitlines()[-1])["prompt_tokens"] + 12 - 1
    entry = wait_ledger(d0, lambda t: t["generations"]["completed"] == 1, "the completed generation")
    for hop, pid in ((d1, ids[1]), (d2, ids[2])):
        served = wait_ledger(hop, lambda t: t["sessions"]["completed"] == 1, "the session served")
        # what the entry credits each hop equals what the hop says it computed for the entry
        assert entry["peers"][pid]["for_us"] == served["peers"][ids[0]]["by_us"] == 10 * positions
        assert served["peers"][ids[0]]["by_us_rows"] == 1
    assert entry["unchecked"] == 1 and entry["checked"] == 0

    client = start_generation(d0)
    client.kill()  # the client goes away mid-generation (we started it: ended by its PID)
    client.wait(10)
    wait_ledger(d0, lambda t: t["generations"]["cancelled"] == 1, "the cancelled generation")

    start_generation(d0).kill()
    d0.kill()  # SIGKILL mid-generation: the row stays 'running' in the database
    d0 = mesh.start("d0", ["--layers", "0:10", "--bootstrap", d1.addr, "--busy-wait", "3"])
    d0.wait_for(lambda s: s["state"] == "serving" and s["complete"], what="the restarted entry serving")
    after = ledger(d0)
    assert after["generations"] == {"completed": 1, "cancelled": 1, "failed": 1}  # nothing lost, the kill reads failed
    assert after["peers"][ids[1]]["for_us"] > entry["peers"][ids[1]]["for_us"]  # the cancelled one's work counts

    client = start_generation(d0)
    d2.kill()  # the tail dies and no daemon serves 20:30 any more
    _, err = client.communicate(timeout=60)
    assert client.returncode != 0, err
    failed = wait_ledger(d0, lambda t: t["generations"]["failed"] == 2, "the failed generation")
    assert failed["generations"]["completed"] == 1 and failed["generations"]["cancelled"] == 1
    assert failed["peers"][ids[1]]["for_us"] > after["peers"][ids[1]]["for_us"]  # the failed one's work counts
