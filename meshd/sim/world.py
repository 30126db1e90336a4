"""The world a simulated swarm lives in: machines, places, links, sessions, requests and the model.

Rule: every part is a documented distribution drawn from its own seeded stream (`World.rng(name)`),
so a seed gives the same world whatever else the run does, and changing how requests are drawn
does not move a node's birth. Defaults describe a public volunteer mesh: consumer boxes from 4 to
64 GB (`MACHINES`), people in the world's big cities (`CITIES`), 70% of them behind NAT, sessions
lognormal around 2 hours.

Links: a round trip is both ends' access delay (uniform 1-5 ms each: a home line) plus 7.5 ms per
1,000 km of great-circle distance (light in fibre with the detours of real paths): a few ms within a
city, ~150 ms across the world. Each measurement multiplies it by a lognormal jitter (sigma 0.1).
"""

from __future__ import annotations

import csv
import heapq
import math
import random
from dataclasses import dataclass, field

GB = 1 << 30


@dataclass(frozen=True)
class Machine:
    name: str
    share: float  # of the nodes
    memory_gb: float  # the box's RAM
    offered_gb: float  # what its operator gives the model's weights (`--num-layers` is sized to it)
    bandwidth_gbs: float  # memory bandwidth: a decode step of one layer reads its bytes once
    disk_mbs: float  # how fast it loads weights
    max_sessions: int  # sessions it admits at once


MACHINES = (
    Machine("single-board 4 GB", 0.10, 4, 1.5, 8, 150, 4),
    Machine("laptop 8 GB", 0.25, 8, 3, 30, 800, 8),
    Machine("desktop 16 GB", 0.35, 16, 8, 40, 1000, 16),
    Machine("desktop 32 GB", 0.20, 32, 20, 50, 1500, 24),
    Machine("workstation 64 GB", 0.10, 64, 44, 80, 2000, 32),
)

# (name, latitude, longitude, weight): where nodes live
CITIES = (
    ("New York", 40.7, -74.0, 8), ("San Francisco", 37.8, -122.4, 6), ("Sao Paulo", -23.5, -46.6, 5),
    ("London", 51.5, -0.1, 7), ("Berlin", 52.5, 13.4, 6), ("Moscow", 55.8, 37.6, 4), ("Lagos", 6.5, 3.4, 3),
    ("Mumbai", 19.1, 72.9, 6), ("Singapore", 1.35, 103.8, 4), ("Beijing", 39.9, 116.4, 7),
    ("Tokyo", 35.7, 139.7, 6), ("Sydney", -33.9, 151.2, 3),
)
EARTH_KM = 6371.0
MS_PER_1000KM = 7.5
ACCESS_MS = (1.0, 5.0)
JITTER_SIGMA = 0.1


@dataclass(frozen=True)
class Shape:
    """A model by its layer count and the bytes of one layer (weights as served, e.g. 4-bit)."""

    n_layers: int = 80
    layer_bytes: int = int(1.75 * GB)  # a 70B-class layer (80 of them) at 16 bits
    kv_layer_bytes: int = 8 << 20  # one session's KV per layer at 2,048 positions (8 KV heads of 128)

    def size(self, start: int, end: int) -> int:
        return (end - start) * self.layer_bytes

    def slots(self, m: Machine) -> int:
        """Layers a machine's offered memory holds (at least one: a node always serves something)."""
        return max(1, min(self.n_layers, int(m.offered_gb * GB // self.layer_bytes)))


@dataclass(frozen=True)
class WorldSpec:
    nodes: int = 1000
    hours: float = 24.0
    shape: Shape = Shape()
    capacity: float = 3.0  # layer slots of the serving nodes over the model's layer count
    session_median_min: float = 120.0
    session_sigma: float = 1.0  # lognormal shape of session lengths
    rejoin_mean_s: float = 60.0  # a node's seat is taken by a new node after this long on average
    nat_share: float = 0.7
    graceful_share: float = 0.5  # leaves that withdraw the record (SIGTERM); the rest vanish
    requests_per_entry_min: float = 0.25  # Poisson arrivals at each entry (a 70B step is seconds: a generation lasts minutes)
    gen_tokens_median: float = 200.0  # lognormal, sigma 0.8
    prompt_tokens_median: float = 400.0  # lognormal, sigma 0.8
    walks_per_hour: float = 1000.0  # sampled DHT lookups (a real swarm walks far more; see the docs)
    boot_s: float = 8.0  # process start to listening (imports, identity, host)
    seed: int = 1
    trace: tuple[tuple[int, float, float], ...] | None = None  # (seat, join s, leave s)
    machines: tuple[Machine, ...] = MACHINES

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}:{name}")

    def expected_slots(self) -> float:
        return sum(m.share * self.shape.slots(m) for m in self.machines)

    def server_seats(self) -> int:
        """Seats whose nodes serve the model with `--layers auto`: as many as `capacity` asks for
        (the others are daemons without layers: DHT nodes, relays when public, clients)."""
        return min(self.seats(), max(1, math.ceil(self.capacity * self.shape.n_layers / self.expected_slots())))

    def seats(self) -> int:
        return len({s for s, _, _ in self.trace}) if self.trace else self.nodes


@dataclass
class Place:
    x: float
    y: float
    z: float
    access_ms: float
    city: str


def draw_machine(rng: random.Random, machines=MACHINES) -> Machine:
    return rng.choices(machines, weights=[m.share for m in machines])[0]


def draw_place(rng: random.Random) -> Place:
    name, lat, lon, _ = rng.choices(CITIES, weights=[c[3] for c in CITIES])[0]
    lat, lon = math.radians(lat + rng.gauss(0, 0.3)), math.radians(lon + rng.gauss(0, 0.3))  # ~30 km around
    return Place(math.cos(lat) * math.cos(lon), math.cos(lat) * math.sin(lon), math.sin(lat),
                 rng.uniform(*ACCESS_MS), name)


def rtt_s(a: Place, b: Place) -> float:
    """The round trip between two places, without jitter, in seconds."""
    dot = max(-1.0, min(1.0, a.x * b.x + a.y * b.y + a.z * b.z))
    km = EARTH_KM * math.acos(dot)
    return (a.access_ms + b.access_ms + MS_PER_1000KM * km / 1000) / 1000


def jittered(rng: random.Random, seconds: float) -> float:
    return seconds * rng.lognormvariate(0, JITTER_SIGMA)


def session_s(rng: random.Random, spec: WorldSpec) -> float:
    return rng.lognormvariate(math.log(spec.session_median_min * 60), spec.session_sigma)


def tokens(rng: random.Random, median: float) -> int:
    return max(1, int(rng.lognormvariate(math.log(median), 0.8)))


def read_trace(path: str) -> tuple[tuple[int, float, float], ...]:
    """A trace file: CSV rows `node,join_s,leave_s` (a header row is skipped); each node id is a seat,
    each row one session of a fresh node in it."""
    rows, seats = [], {}
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row or row[0].strip().startswith("#"):
                continue
            try:
                join, leave = float(row[1]), float(row[2])
            except ValueError:
                continue  # the header
            seat = seats.setdefault(row[0].strip(), len(seats))
            rows.append((seat, join, leave))
    return tuple(sorted(rows, key=lambda r: (r[1], r[0])))


@dataclass
class Clockwork:
    """The simulation's calendar: timed events in a heap, run in time order (ties in the order
    scheduled), so a run is a pure function of its seed."""

    now: float = 0.0
    heap: list = field(default_factory=list)
    count: int = 0

    def at(self, t: float, fn, *args) -> None:
        self.count += 1
        heapq.heappush(self.heap, (t, self.count, fn, args))

    def after(self, dt: float, fn, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run_until(self, end: float) -> int:
        """Runs events up to `end`; the number run."""
        ran = 0
        while self.heap and self.heap[0][0] <= end:
            t, _, fn, args = heapq.heappop(self.heap)
            self.now = t
            fn(*args)
            ran += 1
        self.now = end
        return ran
