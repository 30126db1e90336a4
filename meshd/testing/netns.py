"""Network test hosts: an "internet", public hosts and NATed homes, as Linux network namespaces.

    internet (namespace running `netswitch`: delay and loss per link)
      |-- pub0  198.18.0.10            public host, dialable by anyone on the internet
      |-- gw0   198.18.0.100 (wan)     home router: nftables masquerade, drops unsolicited inbound
      |     `-- home0  192.168.1.2     home host: dials out through gw0, cannot be dialled
      `-- gw1 ... home1 192.168.2.2

Rules: every address lives only in namespaces made here (198.18.0.0/24 is the benchmarking range;
nothing is attached to the root namespace, no route leads out); every namespace is named
`mdtb-<owner pid>-<run id>-<host>`, so a run removes exactly what it made, also on failure or
Ctrl-C, and a later run sweeps what a killed run left (owner no longer alive). Processes started in
a host are tracked by PID and stopped at teardown. Needs root, `ip` and `nft`.
Usage: python -m meshd.testing.netns up|down|ls|run ... (see `main`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from meshd.testing.netswitch import LinkSpec

FAMILY = "mdtb"
INTERNET_NET = "198.18.0"  # /24, RFC 2544 benchmarking addresses: never routed anywhere real
PUBLIC_BASE, ROUTER_BASE = 10, 100
SWITCH_READY_S = 10.0


class TestbedUnavailable(RuntimeError):
    """This machine cannot build network namespaces (not root, or `ip`/`nft`//dev/net/tun missing)."""


def unavailable_reason() -> str | None:
    """Why a test bed cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "network test hosts need root (CI runs as root)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (scripts/setup.sh installs nftables when run as root)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (the latency switch needs TAP devices)"
    return None


@dataclass(frozen=True)
class Host:
    name: str      # pub0, gw0, home0, internet
    netns: str     # the namespace's full name
    addr: str | None  # the address other hosts reach it by (a router: its internet address)
    role: str      # "internet", "public", "router" or "home"


def _cmd(argv: list[str], timeout: float = 15.0, check: bool = True, stdin: str | None = None) -> str:
    out = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def _ip(*args: str, check: bool = True) -> str:
    return _cmd(["ip", *args], check=check)


def in_netns(netns: str, argv: list[str]) -> list[str]:
    """`argv` run inside `netns` (`ip netns exec` execs it: the process keeps the PID Popen sees)."""
    return ["ip", "netns", "exec", netns, *argv]


def list_netns(prefix: str = FAMILY + "-") -> list[str]:
    names = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def netns_pids(netns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", netns, check=False).split()]


def router_rules(nat: str) -> str:
    """nftables for a home router: masquerade out of `wan`; only answers come back in.

    nat="easy" keeps source ports where it can (Linux's default, hole punching may work);
    nat="hard" maps every connection to a random port (a symmetric NAT, hole punching fails)."""
    masq = "masquerade fully-random" if nat == "hard" else "masquerade"
    return f"""
table ip {FAMILY} {{
  chain postrouting {{ type nat hook postrouting priority srcnat; policy accept; oifname "wan" {masq}; }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname "lan" oifname "wan" accept
    iifname "wan" oifname "lan" ct state established,related accept
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "wan" ct state established,related accept
    iifname "wan" drop
  }}
}}
"""


@dataclass
class Testbed:
    prefix: str
    hosts: dict[str, Host] = field(default_factory=dict)
    links: dict[str, LinkSpec] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    switch: subprocess.Popen | None = None

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def addr(self, name: str) -> str:
        return self.hosts[name].addr

    @property
    def public(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.role == "public"]

    @property
    def homes(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.role == "home"]

    def wrap(self, name: str) -> list[str]:
        """The command prefix that runs a program inside host `name`."""
        return in_netns(self.hosts[name].netns, [])

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start `argv` inside host `name`; it is stopped (by PID) at teardown if still running."""
        proc = subprocess.Popen(self.wrap(name) + argv, **kw)
        self.procs.append(proc)
        return proc

    def run(self, name: str, argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(name) + argv, capture_output=True, text=True, timeout=timeout)

    def stop(self, proc: subprocess.Popen, timeout: float = 10.0) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def describe(self) -> str:
        lines = [f"test bed {self.prefix}"]
        for h in self.hosts.values():
            link = self.links.get(h.name)
            extra = f"  link {link.delay_s * 1000:g} ms, loss {link.loss:g}" if link else ""
            lines.append(f"  {h.name:9s} {h.role:8s} {h.addr or '-':15s} netns {h.netns}{extra}")
        return "\n".join(lines)


def _new_netns(bed: Testbed, name: str, addr: str | None, role: str) -> Host:
    host = Host(name, f"{bed.prefix}-{name}", addr, role)
    _ip("netns", "add", host.netns)
    bed.hosts[name] = host  # recorded before anything else can fail, so teardown finds it
    _ip("-n", host.netns, "link", "set", "lo", "up")
    _sysctl(host.netns, {"net/ipv6/conf/all/disable_ipv6": 1, "net/ipv6/conf/default/disable_ipv6": 1})
    return host


def _sysctl(netns: str, values: dict[str, int]) -> None:
    """Set network sysctls of one namespace (/proc/sys/net shows the writer's own namespace)."""
    script = "; ".join(f"echo {v} > /proc/sys/{k}" for k, v in values.items())
    _cmd(in_netns(netns, ["sh", "-ec", script]))


def _start_switch(bed: Testbed, ports: list[tuple[str, LinkSpec]], seed: int | None) -> None:
    specs = [f"{tap}={link.delay_s * 1000:g}:{link.loss:g}" for tap, link in ports]
    argv = [sys.executable, "-m", "meshd.testing.netswitch", *([f"--seed={seed}"] if seed is not None else []), *specs]
    # stdin stays a pipe we hold: if this process dies, the switch reads EOF and ends
    bed.switch = subprocess.Popen(in_netns(bed.hosts["internet"].netns, argv), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_child_env())
    ready, _, _ = select.select([bed.switch.stdout], [], [], SWITCH_READY_S)
    line = bed.switch.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        bed.switch.kill()
        raise RuntimeError(f"the latency switch did not start: {line!r} {bed.switch.stderr.read().decode()[-2000:]}")


def _child_env() -> dict:
    """Children import this copy of meshd, wherever it was imported from."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": here + (os.pathsep + path if path else "")}


def _attach(bed: Testbed, tap: str, host: Host, ifname: str, addr: str) -> None:
    """Move a switch port into `host` and give it its internet address."""
    _ip("-n", bed.hosts["internet"].netns, "link", "set", tap, "netns", host.netns)
    _ip("-n", host.netns, "link", "set", tap, "name", ifname)
    _ip("-n", host.netns, "addr", "add", f"{addr}/24", "dev", ifname)
    _ip("-n", host.netns, "link", "set", ifname, "up")


def build(bed: Testbed, public: int, homes: int, delay_ms: float, loss: float, nat: str,
          links: dict[str, LinkSpec] | None, seed: int | None) -> None:
    if not 1 <= public <= 80 or not 0 <= homes <= 150:
        raise ValueError("between 1 and 80 public hosts and at most 150 homes")
    default = LinkSpec(delay_ms / 1000, loss)
    _new_netns(bed, "internet", None, "internet")
    pubs = [_new_netns(bed, f"pub{i}", f"{INTERNET_NET}.{PUBLIC_BASE + i}", "public") for i in range(public)]
    gws = [_new_netns(bed, f"gw{i}", f"{INTERNET_NET}.{ROUTER_BASE + i}", "router") for i in range(homes)]
    houses = [_new_netns(bed, f"home{i}", f"192.168.{i + 1}.2", "home") for i in range(homes)]
    attached = pubs + gws  # one switch port each; a home's link is its router's
    for h in attached:
        link_name = h.name if h.role == "public" else f"home{h.name[2:]}"
        bed.links[h.name] = (links or {}).get(link_name, default)
    _start_switch(bed, [(f"t{i}", bed.links[h.name]) for i, h in enumerate(attached)], seed)
    for i, h in enumerate(pubs):
        _attach(bed, f"t{i}", h, "eth0", h.addr)
    for i, (gw, house) in enumerate(zip(gws, houses)):
        _attach(bed, f"t{len(pubs) + i}", gw, "wan", gw.addr)
        lan = f"192.168.{i + 1}"
        _ip("-n", gw.netns, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", house.netns)
        _ip("-n", gw.netns, "addr", "add", f"{lan}.1/24", "dev", "lan")
        _ip("-n", gw.netns, "link", "set", "lan", "up")
        _ip("-n", house.netns, "addr", "add", f"{house.addr}/24", "dev", "eth0")
        _ip("-n", house.netns, "link", "set", "eth0", "up")
        _ip("-n", house.netns, "route", "add", "default", "via", f"{lan}.1")  # the router is inside the bed
        _sysctl(gw.netns, {"net/ipv4/ip_forward": 1})
        _cmd(in_netns(gw.netns, ["nft", "-f", "-"]), stdin=router_rules(nat))


def destroy(prefix: str, procs: list[subprocess.Popen] = (), switch: subprocess.Popen | None = None) -> list[str]:
    """Stop what runs in the bed `prefix` and delete its namespaces; returns what could not be removed."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if switch is not None and switch.poll() is None:
        switch.stdin.close()  # the switch ends on EOF
        try:
            switch.wait(5)
        except subprocess.TimeoutExpired:
            switch.kill()
            switch.wait(5)
    names = list_netns(prefix + "-")
    for ns in names:  # whatever else still runs in our namespaces was started in them by a bed
        for pid in netns_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for ns in names:
        for _ in range(50):
            if not netns_pids(ns):
                break
            time.sleep(0.1)
        _ip("netns", "del", ns, check=False)
    return list_netns(prefix + "-")


def _owner_alive(netns: str) -> bool:
    parts = netns.split("-")
    try:
        os.kill(int(parts[1]), 0)
        return True
    except (IndexError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True


def sweep_stale() -> list[str]:
    """Remove beds whose owner process is gone (a run killed before it could clean up)."""
    prefixes = sorted({"-".join(n.split("-")[:3]) for n in list_netns() if not _owner_alive(n)})
    for p in prefixes:
        destroy(p)
    return prefixes


@contextlib.contextmanager
def open_testbed(public: int = 1, homes: int = 2, delay_ms: float = 20.0, loss: float = 0.0, nat: str = "easy",
                 links: dict[str, LinkSpec] | None = None, seed: int | None = None):
    """A built test bed; everything it made is removed when the block ends, however it ends.

    `delay_ms`/`loss` apply to every internet link (one way); `links` overrides them per public host
    or home by name ("pub0", "home1"). A frame between two hosts crosses two links."""
    reason = unavailable_reason()
    if reason:
        raise TestbedUnavailable(reason)
    if nat not in ("easy", "hard"):
        raise ValueError("nat is 'easy' or 'hard'")
    sweep_stale()
    bed = Testbed(f"{FAMILY}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    try:
        build(bed, public, homes, delay_ms, loss, nat, links, seed)
        yield bed
    finally:
        left = destroy(bed.prefix, bed.procs, bed.switch)
        if left:
            raise RuntimeError(f"test bed {bed.prefix}: could not remove {left}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshd.testing.netns", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a bed, print its hosts, keep it until Ctrl-C (or --for S)")
    up.add_argument("--public", type=int, default=1)
    up.add_argument("--homes", type=int, default=2)
    up.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay of every internet link")
    up.add_argument("--loss", type=float, default=0.0, help="chance a frame is lost on each internet link")
    up.add_argument("--nat", choices=["easy", "hard"], default="easy")
    up.add_argument("--for", dest="seconds", type=float, default=None)
    run = sub.add_parser("run", help="run a command in a host of the running bed: run home0 -- CMD ...")
    run.add_argument("host")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    run.add_argument("--bed", default=None, help="the bed's prefix when several run")
    sub.add_parser("ls", help="list beds and their namespaces")
    down = sub.add_parser("down", help="remove beds: the named prefix, or every bed whose owner is gone")
    down.add_argument("prefix", nargs="?")
    a = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"meshd.testing.netns: {reason}", file=sys.stderr)
        return 2
    if a.command == "up":
        return _up(a)
    if a.command == "ls":
        for ns in list_netns():
            print(ns, "" if _owner_alive(ns) else "(owner gone: `down` removes it)")
        return 0
    if a.command == "down":
        removed = [a.prefix] if a.prefix else sweep_stale()
        left = destroy(a.prefix) if a.prefix else []
        print("removed", " ".join(removed) or "nothing", *(["; left:", *left] if left else []))
        return 1 if left else 0
    beds = sorted({"-".join(n.split("-")[:3]) for n in list_netns()})
    if a.bed:
        beds = [b for b in beds if b == a.bed]
    if len(beds) != 1:
        print(f"run: {len(beds)} beds match ({' '.join(beds)}); name one with --bed", file=sys.stderr)
        return 2
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    os.execvp("ip", in_netns(f"{beds[0]}-{a.host}", cmd or [os.environ.get("SHELL", "/bin/sh")]))


def _up(a) -> int:
    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.monotonic()
    try:
        with open_testbed(a.public, a.homes, a.delay_ms, a.loss, a.nat) as bed:
            print(bed.describe())
            print(f"built in {time.monotonic() - t0:.2f} s; run a command in a host with:\n"
                  f"  python -m meshd.testing.netns run home0 -- CMD   (or: ip netns exec {bed.prefix}-home0 CMD)\n"
                  f"Ctrl-C removes everything.", flush=True)
            if a.seconds is None:
                while True:
                    time.sleep(3600)
            time.sleep(a.seconds)
    except KeyboardInterrupt:
        pass
    print("removed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
