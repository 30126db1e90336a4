"""Daemon settings: command-line flags, then environment variables, then a TOML file, then defaults.

Rule: flags win over the environment, which wins over the config file. Every setting has one
name: flag `--num-layers`, environment `MESHD_NUM_LAYERS`, TOML key `num_layers`.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from meshd.entry.drafts import DRAFT_MAX

DEFAULT_LISTEN = ["/ip4/0.0.0.0/tcp/4690"]
DEFAULT_CONFIG = "/etc/meshd/meshd.toml"


def default_state_dir() -> Path:
    if os.environ.get("STATE_DIRECTORY"):  # set by systemd's StateDirectory=
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(base) / "meshd"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "meshd"


def default_socket(state_dir: Path) -> Path:
    for var in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        value = os.environ.get(var)
        if value:
            base = Path(value.split(":")[0])
            return base / "meshd.sock" if var == "RUNTIME_DIRECTORY" else base / "meshd" / "meshd.sock"
    return state_dir / "meshd.sock"


@dataclass
class Settings:
    bootstrap: list[str] = field(default_factory=list)
    model: str = "smollm2"
    layers: str = "auto"
    num_layers: int = 0
    memory: int = 0
    listen: list[str] = field(default_factory=lambda: list(DEFAULT_LISTEN))
    state_dir: str = ""
    socket: str = ""
    recipe: str = "auto"
    threads: int = 0  # torch threads for tensor work; 0: one per core
    kernel_isa: str = ""  # the block kernel's instruction set at most (portable, avx2, avx512); empty: the CPU's best
    kernel_layout: str = "auto"  # weights in tiles where they pay (auto), in the file's rows (rows) or tiles; same bits
    http: str = ""  # HOST:PORT for the OpenAI-compatible API and /metrics; off when empty
    http_token: str = ""  # bearer token the HTTP API asks for (or http_token_file)
    http_token_file: str = ""
    record_ttl: float = 9.0  # republished at half of it; a peer that dies leaves coverage within it + 1 s
    kv_budget: int = 1 << 30  # bytes of KV cache for all sessions together
    max_sessions: int = 64  # sessions this daemon holds at once; more are answered `busy`
    max_queue: int = 1024  # forward frames waiting for a pass; more are answered `busy`
    busy_wait: float = 30.0  # seconds an entry waits for room in a full mesh before "mesh busy"
    drain_timeout: float = 30.0  # seconds running generations get to finish: on SIGTERM; on a move's old range
    move_cooldown: float = 60.0  # with --layers auto: seconds after a move before this daemon moves again
    gather_ms: float = 0.0  # a pass waits this long for frames due from other sessions (0: starts at once)
    forwarding: int = 1  # 1: hops pass hidden states to the next hop; 0: the entry relays every hop's output
    microbatches: int = 2  # groups of generations an entry keeps in separate passes, at most one per daemon
    # on the route (0: exactly one per daemon on the route)
    speculate: str = "auto"  # as an entry: drafts with each step (auto) or plain decoding (off)
    draft_max: int = DRAFT_MAX  # as an entry: drafts a step carries at most
    draft: str = ""  # as an entry: a draft model (GGUF file or HF directory) run whole here; empty: prompt lookup
    verify_rate: float = 0.05  # as an entry: share of generations also run on a second route and compared (0: none)
    relay: str = "auto"  # offer circuit relay to daemons that cannot be dialled: auto (while publicly reachable), on, off
    relays: int = 2  # relays a daemon that cannot be dialled reserves at (0: none)
    relay_reservations: int = 32  # as a relay: daemons holding a reservation at once
    relay_circuits: int = 64  # as a relay: circuits open at once
    relay_circuits_per_peer: int = 16  # as a relay: circuits open at once from or to one daemon
    relay_circuit_mb: int = 1024  # as a relay: MiB one circuit carries (both ways) before it is cut
    relay_circuit_s: float = 3600.0  # as a relay: seconds one circuit lasts before it is cut
    hole_punch: int = 1  # 1: upgrade relayed connections to direct ones where the NATs allow (DCUtR); 0: never
    wire_encoding: str = "raw"  # how hidden states travel: raw float32, zstd, or auto (zstd where it saves)
    chunk_tokens: int = 128  # prompt tokens per prefill chunk
    # what other daemons' shard streams may take here (meshd/hop/stream.py `Intake`)
    frame_budget_mb: int = 512  # MiB all peers' frames may occupy at once: queued, half-received, being decoded
    peer_frame_mb: int = 192  # MiB one peer's frames may occupy (the rest is the floor for others)
    streams_per_peer: int = 128  # shard streams one peer may hold open
    frame_timeout: float = 30.0  # seconds a frame begun may take to arrive whole (half-sent frames are dropped)
    stream_idle: float = 300.0  # seconds a shard stream may say nothing before it is closed
    session_idle: float = 600.0  # seconds a session may send no frame before its KV is released
    session_idle_full: float = 60.0  # seconds unused after which a session gives its KV to a new one when full
    prefix_ttl: float = 600.0  # seconds an ended session's KV is kept unused for a generation that extends its
    # tokens (prefix reuse: meshd/shard/prefix.py); 0: none kept, no prefix reused as an entry either
    peer_share: float = 0.75  # of the sessions, the KV budget and the queue, what one peer may hold
    cache_dir: str = ""  # fingerprints and converted tokenizers (default ~/.cache/meshd)
    ledger_days: float = 30.0  # the work ledger keeps rows this long, then daily totals per peer (0: no ledger)
    swarm_key: str = ""  # a private mesh's key file (/key/swarm/psk/1.0.0/); empty: an open mesh
    require_swarm_key: int = 0  # 1: refuse to start without swarm_key (also LIBP2P_FORCE_PNET=1)

    def configure(self) -> None:
        """Hand the parts below the node their settings: they read no environment themselves."""
        from meshd import wire
        from meshd.shard.artifact import set_cache_dir

        if self.kernel_isa:
            from meshd.shard import blocks

            blocks.limit_isa(self.kernel_isa)
        if self.kernel_layout != "auto":
            from meshd.shard import blocks

            blocks.set_layout(self.kernel_layout)
        wire.set_default_encoding(self.wire_encoding)
        wire.set_chunk_tokens(self.chunk_tokens)
        set_cache_dir(self.cache_dir or default_cache_dir())

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir else default_state_dir()

    @property
    def ledger_path(self) -> Path | None:
        return self.state_path / "ledger.sqlite3" if self.ledger_days > 0 else None

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else default_socket(self.state_path)

    def bearer_token(self) -> str:
        """The HTTP API's token: --http-token, else the first line of --http-token-file, else none."""
        if self.http_token:
            return self.http_token
        if self.http_token_file:
            return Path(self.http_token_file).read_text().strip()
        return ""

    def intake(self):
        """The limits on what other daemons' shard streams may take here."""
        from meshd.hop.intake import Intake
        from meshd.p2p.budget import ByteBudget

        if not 0 < self.peer_frame_mb <= self.frame_budget_mb:
            raise ValueError(f"--peer-frame-mb ({self.peer_frame_mb}) must be positive and at most"
                             f" --frame-budget-mb ({self.frame_budget_mb})")
        if not 0 < self.peer_share <= 1:
            raise ValueError(f"--peer-share must be in (0, 1], not {self.peer_share}")
        return Intake(ByteBudget(self.frame_budget_mb << 20, self.peer_frame_mb << 20), self.streams_per_peer,
                      self.frame_timeout, self.stream_idle, self.peer_share)

    @property
    def speculate_on(self) -> bool:
        if self.speculate not in ("auto", "off"):
            raise ValueError(f"--speculate must be auto or off, not {self.speculate!r}")
        if self.draft_max < 0:
            raise ValueError(f"--draft-max must be 0 or more, not {self.draft_max}")
        return self.speculate == "auto" and self.draft_max > 0

    @property
    def verify_share(self) -> float:
        from meshd.entry.checks import check_rate

        return check_rate(self.verify_rate)

    def mesh_key(self, environ=os.environ):
        """The private mesh's key (None: an open mesh). Raises SwarmKeyError (a ValueError) for a key
        file that is malformed or readable by other users, and without a key when one is required."""
        from meshd.p2p.swarmkey import SwarmKeyError, read_swarm_key

        if self.swarm_key:
            return read_swarm_key(self.swarm_key)
        if self.require_swarm_key or environ.get("LIBP2P_FORCE_PNET") == "1":
            raise SwarmKeyError("a swarm key is required (--require-swarm-key or LIBP2P_FORCE_PNET=1) but none is"
                                " given: set --swarm-key FILE, MESHD_SWARM_KEY or swarm_key in the config")
        return None

    def relay_limits(self):
        from meshd.relay.policy import RelayLimits

        if self.relay not in ("auto", "on", "off"):
            raise ValueError(f"--relay must be auto, on or off, not {self.relay!r}")
        return RelayLimits(reservations=self.relay_reservations, circuits=self.relay_circuits,
                           circuits_per_peer=self.relay_circuits_per_peer, circuit_bytes=self.relay_circuit_mb << 20,
                           circuit_s=self.relay_circuit_s)

    def parse_layers(self, n_layers: int) -> tuple[int, int] | None:
        """(start, end) for an explicit "A:B", None for "auto", (0, 0) for "none" (relay and bootstrap only)."""
        if self.layers == "auto":
            return None
        if self.layers == "none":
            return 0, 0
        try:
            a, b = (int(x) for x in self.layers.split(":"))
        except ValueError:
            raise ValueError(f"--layers must be auto, none or A:B, not {self.layers!r}") from None
        if not 0 <= a < b <= n_layers:
            raise ValueError(f"--layers {a}:{b} is not within the model's {n_layers} layers")
        return a, b

    def layers_wanted(self, n_layers: int, bytes_per_layer: int) -> int:
        """How many layers `--layers auto` should take: --num-layers (default all), capped by
        --memory (at least one layer, so a node always serves something)."""
        want = min(self.num_layers or n_layers, n_layers)
        if self.memory:
            want = min(want, max(1, self.memory // bytes_per_layer))
        return want


def load_settings(flags: dict, config_file: str | None = None, environ=os.environ) -> Settings:
    """Merge defaults < TOML file < environment < flags (flags given as None are unset)."""
    s = Settings()
    path = config_file or environ.get("MESHD_CONFIG") or (DEFAULT_CONFIG if Path(DEFAULT_CONFIG).exists() else None)
    values: dict = {}
    if path:
        with open(path, "rb") as f:
            values.update(tomllib.load(f))
    for f_ in fields(Settings):
        env = environ.get(f"MESHD_{f_.name.upper()}")
        if env is not None:
            values[f_.name] = env.split(",") if isinstance(getattr(s, f_.name), list) else env
    values.update({k: v for k, v in flags.items() if v is not None and v != []})
    for f_ in fields(Settings):
        if f_.name in values:
            default = getattr(s, f_.name)
            value = values[f_.name]
            if isinstance(default, list) and isinstance(value, str):
                value = [value]
            setattr(s, f_.name, type(default)(value) if not isinstance(default, list) else list(value))
    unknown = set(values) - {f_.name for f_ in fields(Settings)}
    if unknown:
        raise ValueError(f"unknown settings: {sorted(unknown)}")
    return s
