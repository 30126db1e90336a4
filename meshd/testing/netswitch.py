"""A userspace Ethernet switch with per-link delay and loss: the "internet" of the network test bed.

The kernel here has no `netem` qdisc, so latency and loss come from this process. It holds one TAP
device per attached host (the harness moves each TAP into its host's namespace, where it is that
host's internet interface) and relays whole Ethernet frames between them, so ARP, TCP, UDP and ICMP
all cross it alike. A frame from port A to port B waits `delay[A] + delay[B]` (each link's one-way
delay) and is dropped with the chance that either link loses it. Rules: the decisions (`MacTable`,
`DelayLine`, `Switch`) are pure and take the time and the random source from outside; the I/O loop
only moves bytes; the process ends when its stdin closes (its owner died) or on SIGTERM/SIGINT.
Usage (inside the internet namespace): python -m meshd.testing.netswitch t0=20:0.01 t1=20 ...
(TAP name = one-way delay in ms [: loss probability]); prints "ready" once every TAP exists.
"""

from __future__ import annotations

import fcntl
import heapq
import itertools
import os
import random
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MAX_QUEUED = 20_000  # frames in flight through the switch; past this a frame is dropped, as by a full router buffer


@dataclass(frozen=True)
class LinkSpec:
    """One host's link to the switch: one-way delay (seconds) and the chance a frame is lost on it."""
    delay_s: float = 0.0
    loss: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        """'20' or '20:0.05' (milliseconds, then loss probability)."""
        delay, _, loss = text.partition(":")
        spec = cls(float(delay) / 1000, float(loss or 0))
        if spec.delay_s < 0 or not 0 <= spec.loss <= 1:
            raise ValueError(f"bad link {text!r}: delay must be >= 0 ms and loss within [0, 1]")
        return spec


class MacTable:
    """A learning switch's forwarding decision: which ports a frame goes out of."""

    def __init__(self, n_ports: int) -> None:
        self.n_ports = n_ports
        self.where: dict[bytes, int] = {}

    def route(self, in_port: int, frame: bytes) -> list[int]:
        if len(frame) < 14:
            return []
        dst, src = frame[0:6], frame[6:12]
        if not src[0] & 1:  # a unicast source: learn where it lives
            self.where[src] = in_port
        out = None if dst[0] & 1 else self.where.get(dst)
        if out is None:  # broadcast, multicast or not yet learnt: flood
            return [p for p in range(self.n_ports) if p != in_port]
        return [] if out == in_port else [out]


class DelayLine:
    """Frames waiting for their due time; equal due times leave in arrival order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, bytes]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due: float, port: int, frame: bytes) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), port, frame))

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[tuple[int, bytes]]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, _, port, frame = heapq.heappop(self._heap)
            out.append((port, frame))
        return out


class Switch:
    """Frames in, (port, frame) out after each link's delay, minus the ones the links lose."""

    def __init__(self, links: list[LinkSpec], rng: random.Random | None = None, max_queued: int = MAX_QUEUED) -> None:
        self.links = links
        self.rng = rng or random.Random()
        self.table = MacTable(len(links))
        self.line = DelayLine()
        self.max_queued = max_queued
        self.lost = self.dropped = self.delivered = 0

    def receive(self, now: float, in_port: int, frame: bytes) -> None:
        src = self.links[in_port]
        for out in self.table.route(in_port, frame):
            dst = self.links[out]
            if self.rng.random() < src.loss or self.rng.random() < dst.loss:
                self.lost += 1
            elif len(self.line) >= self.max_queued:
                self.dropped += 1
            else:
                self.line.push(now + src.delay_s + dst.delay_s, out, frame)

    def due(self, now: float) -> list[tuple[int, bytes]]:
        out = self.line.pop_due(now)
        self.delivered += len(out)
        return out

    def wait_s(self, now: float, idle: float = 1.0) -> float:
        nxt = self.line.next_due()
        return idle if nxt is None else max(0.0, nxt - now)


def open_tap(name: str) -> int:
    """A non-blocking TAP device named `name` in this process's network namespace (no packet info header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def serve(fds: list[int], switch: Switch, stop_fd: int | None = None) -> None:
    """Relay frames between the TAPs until `stop_fd` reads EOF (or forever)."""
    watched = fds + ([stop_fd] if stop_fd is not None else [])
    port_of = {fd: i for i, fd in enumerate(fds)}
    while True:
        readable, _, _ = select.select(watched, [], [], switch.wait_s(time.monotonic()))
        now = time.monotonic()
        for fd in readable:
            if fd == stop_fd:
                if not os.read(fd, 4096):
                    return
                continue
            for _ in range(64):  # drain a burst before looking at the clock again
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                switch.receive(now, port_of[fd], frame)
        for port, frame in switch.due(time.monotonic()):
            try:
                os.write(fds[port], frame)
            except OSError:  # the host's interface is down or its queue full: a switch drops it
                switch.dropped += 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    seed = None
    if args and args[0].startswith("--seed="):
        seed, args = int(args[0].split("=", 1)[1]), args[1:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    names, links = [], []
    for a in args:
        name, _, spec = a.partition("=")
        names.append(name)
        links.append(LinkSpec.parse(spec or "0"))
    fds = [open_tap(n) for n in names]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    switch = Switch(links, random.Random(seed))
    print("ready", flush=True)
    try:
        serve(fds, switch, stop_fd=sys.stdin.fileno())
    except KeyboardInterrupt:
        pass
    finally:
        print(f"delivered {switch.delivered} lost {switch.lost} dropped {switch.dropped}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
