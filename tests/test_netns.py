"""The network test bed on real namespaces: built and removed whole, NAT one way only, latency and
loss as configured. Needs root, `ip` and `nft` (CI has them; scripts/setup.sh installs nftables)."""

import json
import os
import select
import subprocess
import sys
import time

import pytest

from meshd.testing.netns import (LinkSpec, in_netns, list_netns, netns_pids, open_testbed, sweep_stale,
                                 unavailable_reason)

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
PORT = 5000
DELAY_MS, HOME0_MS = 10, 25
HOME1_LOSS = 0.2


def read_json(proc: subprocess.Popen, timeout: float = 10.0) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no line from the probe in time"
    return json.loads(proc.stdout.readline())


def drain(proc: subprocess.Popen) -> None:
    """Skip the lines a probe printed so far (earlier tests' peers)."""
    while select.select([proc.stdout], [], [], 0.2)[0]:
        proc.stdout.readline()


def probe(bed, host: str, *args: str, timeout: float = 60.0) -> dict:
    out = bed.run(host, [sys.executable, "-m", "meshd.testing.netprobe", *args], timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def echo_server(bed, host: str) -> subprocess.Popen:
    proc = bed.popen(host, [sys.executable, "-m", "meshd.testing.netprobe", "serve", bed.addr(host), str(PORT),
                            "--for", "120"], stdout=subprocess.PIPE, text=True)
    assert read_json(proc)["listening"] == [bed.addr(host), PORT]
    return proc


def root_links() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0] for line in
            subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout.splitlines()}


@pytest.fixture(scope="module")
def bed():
    """home0's link is slower than the rest; home1's loses a fifth of its frames."""
    with open_testbed(public=1, homes=3, delay_ms=DELAY_MS,
                      links={"home0": LinkSpec(HOME0_MS / 1000), "home1": LinkSpec(DELAY_MS / 1000, HOME1_LOSS)}) as b:
        b.servers = {h: echo_server(b, h) for h in ("pub0", "home0")}
        yield b


def test_a_bed_is_built_and_removed_without_leftovers():
    links_before = root_links()
    t0 = time.monotonic()
    with open_testbed(public=2, homes=2, delay_ms=5) as b:
        built_s = time.monotonic() - t0
        names = list_netns(b.prefix + "-")
        assert names == sorted(f"{b.prefix}-{h}" for h in
                               ("internet", "pub0", "pub1", "gw0", "gw1", "home0", "home1"))
        assert root_links() == links_before  # nothing was attached to the real host's network
        sleeper = b.popen("home1", ["sleep", "60"])
        switch = b.switch
        assert netns_pids(f"{b.prefix}-internet") == [switch.pid]
        t1 = time.monotonic()
    print(f"built in {built_s:.2f} s, removed in {time.monotonic() - t1:.2f} s")
    assert list_netns(b.prefix + "-") == []
    assert sleeper.poll() is not None and switch.poll() is not None
    assert root_links() == links_before


def test_a_failing_block_still_removes_everything():
    with pytest.raises(ZeroDivisionError):
        with open_testbed(public=1, homes=1) as b:
            sleeper = b.popen("home0", ["sleep", "60"])
            1 / 0
    assert list_netns(b.prefix + "-") == [] and sleeper.poll() is not None


def test_leftovers_of_a_killed_run_are_swept():
    dead = subprocess.Popen(["true"])
    dead.wait()  # its PID now names an owner that is gone
    ns = f"mdtb-{dead.pid}-0dead0-home0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    orphan = subprocess.Popen(in_netns(ns, ["sleep", "60"]))
    try:
        deadline = time.monotonic() + 5
        while netns_pids(ns) != [orphan.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"mdtb-{dead.pid}-0dead0" in sweep_stale()
        assert ns not in list_netns() and orphan.wait(5) is not None
    finally:
        if orphan.poll() is None:
            orphan.kill()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_no_namespace_has_a_route_out(bed):
    """Only checked through routing tables: nothing is sent to an address outside the bed."""
    outside = "192.0.2.1"  # TEST-NET-1
    for name, host in bed.hosts.items():
        route = subprocess.run(["ip", "-n", host.netns, "route", "get", outside], capture_output=True, text=True)
        if host.role == "home":  # its default route is its own router, which has none
            assert f"via 192.168.{int(name[4:]) + 1}.1" in route.stdout
            gw = bed.host(f"gw{name[4:]}").netns
            assert subprocess.run(["ip", "-n", gw, "route", "get", outside], capture_output=True).returncode != 0
        else:
            assert route.returncode != 0, (name, route.stdout)


def test_a_home_dials_out_through_its_router_and_cannot_be_dialled(bed):
    drain(bed.servers["pub0"])
    out = probe(bed, "home0", "connect", bed.addr("pub0"), str(PORT))
    assert out["connected"], out
    assert read_json(bed.servers["pub0"])["tcp_peer"][0] == bed.addr("gw0")  # masqueraded
    # the internet has no route to a home ...
    out = probe(bed, "pub0", "connect", bed.addr("home0"), str(PORT))
    assert not out["connected"] and out["error"] == "OSError", out
    # ... and a peer that makes one through the router is dropped there, though home0 listens
    subprocess.run(["ip", "-n", bed.host("pub0").netns, "route", "add", "192.168.1.0/24", "via", bed.addr("gw0")],
                   check=True)
    try:
        out = probe(bed, "pub0", "connect", bed.addr("home0"), str(PORT), "--timeout", "1.5")
        assert not out["connected"] and out["error"] == "TimeoutError", out
    finally:
        subprocess.run(["ip", "-n", bed.host("pub0").netns, "route", "del", "192.168.1.0/24"], check=True)
    # nor can another home reach it
    out = probe(bed, "home2", "connect", bed.addr("home0"), str(PORT), "--timeout", "1.5")
    assert not out["connected"], out


def test_round_trips_take_at_least_the_configured_delay(bed):
    for home, one_way_ms in (("home0", HOME0_MS + DELAY_MS), ("home2", DELAY_MS + DELAY_MS)):
        out = probe(bed, home, "rtt", bed.addr("pub0"), str(PORT), "--count", "10")
        best = min(out["rtt_s"]) * 1000
        print(f"{home}: configured RTT {2 * one_way_ms} ms, measured min {best:.1f} ms, "
              f"median {sorted(out['rtt_s'])[5] * 1000:.1f} ms, connect {out['connect_s'] * 1000:.1f} ms")
        # a floor the switch keeps however loaded the box (that it adds each link's delay once and no more:
        # tests/test_netswitch.py, on made-up times)
        assert best >= 2 * one_way_ms
        assert out["connect_s"] * 1000 >= 2 * one_way_ms  # the SYN and its answer crossed the switch too


def test_a_lossy_link_loses_about_its_share(bed):
    lossy = probe(bed, "home1", "udp", bed.addr("pub0"), str(PORT), "--count", "400")
    clean = probe(bed, "home2", "udp", bed.addr("pub0"), str(PORT), "--count", "400")
    rate = lossy["received"] / lossy["sent"]
    print(f"echo survival on a {HOME1_LOSS} loss link (crossed twice): {rate:.3f} (expected {(1 - HOME1_LOSS) ** 2})")
    assert 0.50 < rate < 0.78  # (1 - 0.2)^2 = 0.64, about six standard deviations either side
    assert clean["received"] == clean["sent"] == 400


@pytest.mark.parametrize("nat,kept", [("easy", True), ("hard", False)])
def test_easy_nat_keeps_the_source_port_and_hard_nat_does_not(nat, kept):
    with open_testbed(public=1, homes=1, delay_ms=1, nat=nat) as b:
        server = echo_server(b, "pub0")
        assert probe(b, "home0", "connect", b.addr("pub0"), str(PORT), "--bind-port", "40000")["connected"]
        addr, port = read_json(server)["tcp_peer"]
        assert addr == b.addr("gw0") and (port == 40000) == kept


def test_the_command_line_builds_and_removes_a_bed(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "meshd.testing.netns", "up", "--homes", "1", "--for", "30"],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        first = proc.stdout.readline()
        assert first.startswith("test bed mdtb-"), first
        prefix = first.split()[2]
        while "Ctrl-C" not in proc.stdout.readline():
            pass
        ran = subprocess.run([sys.executable, "-m", "meshd.testing.netns", "run", "--bed", prefix, "home0", "--",
                              "ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True, env=env,
                             timeout=30)
        assert "192.168.1.2/24" in ran.stdout, ran.stderr
        proc.terminate()  # SIGTERM: the bed comes down
        assert proc.wait(30) == 0
        assert list_netns(prefix + "-") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
