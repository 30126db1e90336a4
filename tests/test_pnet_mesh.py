"""Private meshes of real daemons on loopback: two meshes with different keys side by side never
mix, and daemons without the key (or with another) pointed at a keyed mesh cannot join it."""

import json
import re
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd.p2p.swarmkey import write_new_swarm_key
from meshd.cli.localmesh import Mesh, ctl, local_text

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
TOKENS = 12
RANGES = [(0, 10), (10, 20), (20, 30)]
REFUSAL = "refused a connection without the mesh's key from"


def reference(tokens: int) -> str:
    return local_text(PROMPT, tokens)


def generated(daemon) -> str:
    out = ctl(daemon.socket, ["generate", "--max-tokens", str(TOKENS), PROMPT], timeout=300)
    assert out.returncode == 0, out.stderr + daemon.tail()
    return out.stdout


def established(pids: set[int]) -> list[tuple[str, str]]:
    """(local, peer) addresses of the TCP connections these processes hold."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True, timeout=30).stdout
    conns = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        parts = line.split()
        if owners & pids and len(parts) >= 4:
            conns.append((parts[2], parts[3]))
    return conns


def crossing(a: list, b: list) -> list:
    """Connections between daemons of mesh a and daemons of mesh b."""
    a_pids, b_pids = {d.proc.pid for d in a}, {d.proc.pid for d in b}
    b_local = {local for local, _ in established(b_pids)}
    return [(local, peer) for local, peer in established(a_pids) if peer in b_local]


def peer_ids(daemons) -> set[str]:
    return {d.status()["peer_id"] for d in daemons}


def test_two_meshes_with_different_keys_side_by_side_never_mix():
    ma, mb = Mesh(), Mesh()
    try:
        key_a, key_b = write_new_swarm_key(ma.root / "a.key"), write_new_swarm_key(mb.root / "b.key")
        a = ma.start_chain(RANGES, extra=["--swarm-key", key_a.path, "--threads", "1"])
        a0 = a[0].status()["addrs"][0]
        # every daemon of mesh b is pointed at mesh a's bootstrap as well as at its own
        b = mb.start_chain(RANGES, extra=["--swarm-key", key_b.path, "--threads", "1", "--bootstrap", a0])
        a[0].wait_for(lambda s: s["mesh_key"]["refused"] >= 1, timeout=30, what="a refusal")
        ids_a, ids_b = peer_ids(a), peer_ids(b)
        for d, own in [(d, ids_a) for d in a] + [(d, ids_b) for d in b]:
            st = d.status()
            assert {p["peer_id"] for p in st["peers"]} | {st["peer_id"]} == own  # nobody of the other mesh
            assert st["mesh_key"]["fingerprint"] == (key_a if own is ids_a else key_b).fingerprint
        want = reference(TOKENS)
        assert generated(a[0]) == want and generated(b[0]) == want and want.strip()
        for d, own in [(d, ids_a) for d in a] + [(d, ids_b) for d in b]:  # ...nor after generating
            assert {p["peer_id"] for p in d.status()["peers"]} | {d.status()["peer_id"]} == own
        assert crossing(a, b) == [] and crossing(b, a) == []
        assert any(REFUSAL in line for line in a[0].tail(400).splitlines())
        assert f"mesh      private mesh, key {key_a.fingerprint}" in ctl(a[0].socket, ["status"]).stdout
    finally:
        ma.close()
        mb.close()


def test_a_daemon_without_the_key_or_with_another_cannot_join_and_the_mesh_is_unaffected():
    m = Mesh()
    try:
        key = write_new_swarm_key(m.root / "swarm.key")
        other = write_new_swarm_key(m.root / "other.key")
        members = m.start_chain(RANGES, extra=["--swarm-key", key.path, "--threads", "1", "--http", "127.0.0.1:0"])
        boot = members[0].status()["addrs"][0]
        outsider = m.start("open", ["--layers", "0:10", "--threads", "1", "--bootstrap", boot])
        wrong = m.start("wrong", ["--layers", "0:10", "--threads", "1", "--bootstrap", boot, "--swarm-key", other.path])
        for d in (outsider, wrong):
            st = d.wait_serving()
            assert st["peers"] == [] and not st["complete"]
        assert outsider.status()["mesh_key"] == {"private": False}
        assert "mesh      open mesh" in ctl(outsider.socket, ["status"]).stdout
        assert wrong.status()["mesh_key"]["fingerprint"] == other.fingerprint != key.fingerprint
        st = members[0].wait_for(lambda s: s["mesh_key"]["refused"] >= 2, timeout=30, what="two refusals")
        assert any(REFUSAL in line for line in members[0].tail(400).splitlines())
        text = httpx.get(st["http"][0] + "/metrics", timeout=10).text
        samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert samples["meshd_connections_refused_without_key_total"] >= 2
        assert generated(members[0]) == reference(TOKENS)  # the keyed mesh is unaffected
        for d in members:
            assert {p["peer_id"] for p in d.status()["peers"]} | {d.status()["peer_id"]} == peer_ids(members)
        assert crossing(members, [outsider, wrong]) == []
        out = ctl(outsider.socket, ["generate", "--max-tokens", "4", PROMPT], timeout=120)
        assert out.returncode == 4 and "10" in out.stderr  # alone with 0:10, the rest of the model uncovered
        assert outsider.status()["peers"] == [] and wrong.status()["peers"] == []
        print("refusals at the bootstrap:", json.dumps(members[0].status()["mesh_key"]))
    finally:
        m.close()
