"""Small network probes run inside test-bed hosts: TCP and UDP echo, TCP round trips, UDP loss.

Each command is bounded in time and prints one JSON line, so a test runs it in a host namespace and
reads the answer. Usage:
  python -m meshd.testing.netprobe serve ADDR PORT [--for S]      TCP + UDP echo on ADDR:PORT, for S seconds
  python -m meshd.testing.netprobe rtt ADDR PORT [--count N]      TCP connect time and N echo round trips
  python -m meshd.testing.netprobe udp ADDR PORT [--count N]      N UDP echoes: how many came back
  python -m meshd.testing.netprobe connect ADDR PORT [--timeout S] [--bind-port P]
                                                                can a TCP connection be opened?
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import time


def serve(addr: str, port: int, seconds: float) -> dict:
    """Echo TCP streams and UDP datagrams; print each new peer (address, port) as it is seen, to
    show what a NAT rewrote, and all peer addresses at the end."""
    tcp = socket.create_server((addr, port), reuse_port=False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((addr, port))
    sel = selectors.DefaultSelector()
    sel.register(tcp, selectors.EVENT_READ, "accept")
    sel.register(udp, selectors.EVENT_READ, "udp")
    print(json.dumps({"listening": [addr, port]}), flush=True)
    peers: set[str] = set()
    udp_seen: set[tuple[str, int]] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, _ in sel.select(timeout=max(0.0, min(0.5, end - time.monotonic()))):
            if key.data == "accept":
                conn, peer = tcp.accept()
                peers.add(peer[0])
                print(json.dumps({"tcp_peer": list(peer)}), flush=True)
                sel.register(conn, selectors.EVENT_READ, "conn")
            elif key.data == "udp":
                data, peer = udp.recvfrom(65536)
                peers.add(peer[0])
                if peer not in udp_seen:
                    udp_seen.add(peer)
                    print(json.dumps({"udp_peer": list(peer)}), flush=True)
                udp.sendto(data, peer)
            else:
                data = key.fileobj.recv(65536)
                if data:
                    key.fileobj.sendall(data)
                else:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
    return {"peers": sorted(peers)}


def rtt(addr: str, port: int, count: int, timeout: float = 10.0) -> dict:
    """Seconds to connect, then each round trip of a 64-byte message on that connection."""
    t0 = time.monotonic()
    s = socket.create_connection((addr, port), timeout=timeout)
    connect_s = time.monotonic() - t0
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(count):
        t = time.monotonic()
        s.sendall(b"x" * 64)
        got = 0
        while got < 64:
            chunk = s.recv(64 - got)
            if not chunk:
                raise ConnectionError("echo server closed the connection")
            got += len(chunk)
        rtts.append(time.monotonic() - t)
    s.close()
    return {"connect_s": connect_s, "rtt_s": rtts}


def udp(addr: str, port: int, count: int, gap_s: float = 0.002, linger_s: float = 1.0) -> dict:
    """Send `count` numbered datagrams `gap_s` apart after one has made it there and back (so ARP
    and NAT state exist); count the distinct echoes back within `linger_s` of the last send."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((addr, port))
    s.settimeout(0.3)
    for _ in range(50):  # warm-up: the path works at all
        s.send(b"warm")
        try:
            if s.recv(64) == b"warm":
                break
        except (socket.timeout, ConnectionRefusedError):
            continue
    else:
        return {"sent": 0, "received": 0, "error": "no echo during warm-up"}
    s.setblocking(False)
    seen: set[int] = set()

    def drain() -> None:
        while True:
            try:
                data = s.recv(64)
            except (BlockingIOError, ConnectionRefusedError):
                return
            if data != b"warm":
                seen.add(int(data))

    for i in range(count):
        s.send(b"%d" % i)
        time.sleep(gap_s)
        drain()
    end = time.monotonic() + linger_s
    while time.monotonic() < end:
        time.sleep(0.01)
        drain()
    return {"sent": count, "received": len(seen)}


def can_connect(addr: str, port: int, timeout: float, bind_port: int = 0) -> dict:
    t0 = time.monotonic()
    try:
        socket.create_connection((addr, port), timeout=timeout, source_address=("", bind_port)).close()
        return {"connected": True, "seconds": time.monotonic() - t0}
    except OSError as exc:
        return {"connected": False, "error": type(exc).__name__, "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshd.testing.netprobe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["serve", "rtt", "udp", "connect"])
    p.add_argument("addr")
    p.add_argument("port", type=int)
    p.add_argument("--for", dest="seconds", type=float, default=30.0)
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--bind-port", type=int, default=0, help="connect from this local port")
    a = p.parse_args(argv)
    if a.command == "serve":
        out = serve(a.addr, a.port, a.seconds)
    elif a.command == "rtt":
        out = rtt(a.addr, a.port, a.count)
    elif a.command == "udp":
        out = udp(a.addr, a.port, a.count)
    else:
        out = can_connect(a.addr, a.port, a.timeout, a.bind_port)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
