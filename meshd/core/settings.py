"""Daemon settings: command-line flags, then environment variables, then a TOML file, then defaults.

Rule: each setting is declared once, as a field of `Settings` made by `setting(...)`: its flag
(`--num-layers`), environment variable (`MESHD_NUM_LAYERS`), TOML key (`num_layers`), default and help
all come from that one declaration (`add_flags` writes `meshd join`'s flags from it; a part that keeps
a default of its own reads it with `default(name)`). Flags win over the environment, which wins over
the config file.

Why a table of dataclass fields and not pydantic-settings: its sources (MESHD_ prefix, a TOML file)
would replace only `load_settings`'s twenty lines, and not as they behave: its environment source reads
`os.environ` (tests hand in a mapping), takes a list variable as JSON by default where meshd takes `a,b`,
and validates where meshd converts with `type(default)(value)` (a TOML `threads = 2.5` or `layers = 3`).
Its command-line source writes help and flags its own way (types and defaults appended, lists as JSON),
so `meshd join --help` and the flags would change. Every flag, variable and key staying as it was weighs
more than twenty lines; the declaration, not the library, is what removes the copies.

This module sits in the bottom room (core) and imports nothing of meshd, so every room reads a declared
default from it (`default(name)`) instead of keeping a literal of its own: the wire's prefill chunk size
and encoding, a hop's session and queue limits, an entry's drafts. What the node builds from settings
(the intake's limits, the relay's, the swarm key, the process-wide kernel and wire choices) is
meshd/node/wiring.py's.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path


DEFAULT_LISTEN = ["/ip4/0.0.0.0/tcp/4690"]
DEFAULT_CONFIG = "/etc/meshd/meshd.toml"
RECIPES = ["auto", "native", "exact", "compact"]  # meshd.shard.recipe.CHOICES, without importing torch
KERNEL_ISAS = ["portable", "avx2", "avx512"]  # meshd.shard.blocks.ISAS, without importing torch
KERNEL_LAYOUTS = ["auto", "rows", "tiles"]  # meshd.shard.blocks.LAYOUTS, without importing torch
ENCODINGS = ["raw", "zstd", "auto"]  # how hidden states may travel (meshd/wire/codec.py takes them from here)


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


def setting(value, help: str, *, flag: bool = True, choices=None, const=None):
    """One setting's declaration: its default `value` and its help, `{default}` (and `{gib}`, the default in GiB)
    standing for the default in the help; `flag=False` for one set only by MESHD_* or the config file;
    `choices` as the flag offers them; `const` for a flag that takes no value and sets this one."""
    meta = {"help": help, "flag": flag, "choices": choices, "const": const}
    if isinstance(value, list):
        return field(default_factory=lambda: list(value), metadata=meta)
    return field(default=value, metadata=meta)


@dataclass
class Settings:
    bootstrap: list[str] = setting([], "multiaddr of a peer already in the mesh (repeatable)")
    model: str = setting("smollm2", "smollm2 (bundled, default), a .gguf file or an HF directory")
    layers: str = setting("auto", "auto (default), A:B, or none (a bootstrap and relay holding no layers)")
    num_layers: int = setting(0, "with --layers auto: how many layers to serve")
    memory: int = setting(0, "bytes of weights this node may hold (caps --layers auto; a fixed range that needs more"
                             " is refused)")
    listen: list[str] = setting(DEFAULT_LISTEN, "multiaddr to listen on (repeatable)")
    state_dir: str = setting("", "identity and caches (default ~/.local/share/meshd)")
    socket: str = setting("", "control socket path")
    recipe: str = setting("auto", "auto (default: native for a quantized GGUF, else exact), native, exact or compact",
                          choices=RECIPES)
    threads: int = setting(0, "threads for tensor work (default: one per core; lower it when daemons on the exact"
                              " recipe share a machine: torch's threads spin; the native kernel's take a preempted"
                              " thread's share)")
    http: str = setting("", "serve the OpenAI-compatible API and /metrics on HOST:PORT (off by default; 127.0.0.1:8080"
                            " keeps it on this machine)")
    http_token: str = setting("", "bearer token HTTP clients must send")
    http_token_file: str = setting("", "file holding the bearer token")
    record_ttl: float = setting(9.0, "seconds a published record lives; republished at half of it; a peer that dies"
                                     " leaves coverage within it + 1 s", flag=False)
    kv_budget: int = setting(1 << 30, "bytes of KV cache for all sessions (default {gib} GiB)")
    max_sessions: int = setting(64, "sessions held at once; more are refused as busy (default {default})")
    max_queue: int = setting(1024, "frames waiting for compute; more are refused as busy (default {default})")
    busy_wait: float = setting(30.0, "seconds a generation waits for room in a full mesh before failing with"
                                     " 'mesh busy' (default {default})")
    drain_timeout: float = setting(30.0, "on SIGTERM, seconds running generations get to finish before the daemon"
                                         " exits (default {default}; a second SIGTERM exits at once); after a move,"
                                         " seconds they get to finish on the old range before it is freed")
    ledger_days: float = setting(30.0, "days the work ledger (ledger.sqlite3 in the state directory) keeps one row per"
                                       " generation and session before folding them into daily totals per peer"
                                       " (default {default}; 0: keep no ledger)")
    move_cooldown: float = setting(60.0, "with --layers auto: seconds after a move to fill a gap before this daemon"
                                         " moves again (default {default})")
    gather_ms: float = setting(0.0, "milliseconds a forward pass waits for other sessions' frames before it starts,"
                                    " when some are due (default {default}: at once)")
    forwarding: int = setting(1, "1: hops pass hidden states to the next hop; 0: the entry relays every hop's output",
                              flag=False)
    microbatches: int = setting(2, "groups of generations this entry keeps in separate forward passes on every hop,"
                                   " so that a daemon has a pass to run while another group is elsewhere on the route"
                                   " (default {default}, at most one per daemon on the route; 0: one per daemon on the"
                                   " route)")
    speculate: str = setting("auto", "as an entry: send draft tokens (prompt lookup) with each step, verified in one"
                                     " pass down the route, so a trip can return several tokens; the text is the same"
                                     " (default {default}: drafts where they pay for their rows)",
                             choices=["auto", "off"])
    draft_max: int = setting(32, "as an entry: draft tokens a step carries at most (default {default}; a greedy"
                                        " generation sends as many as pay for their rows at the trip and acceptance"
                                        " measured)")
    draft: str = setting("", "as an entry: a draft model (a GGUF file, an HF directory or a bundled name) run whole on"
                             " this daemon to propose the drafts, instead of prompt lookup; it must share the model's"
                             " tokenizer (refused at start otherwise)")
    verify_rate: float = setting(0.25, "as an entry: share of generations also run on a second route of other"
                                       " daemons, a token kept only when both routes agree (default {default};"
                                       " 0: none)")
    verify_by: str = setting("prefill", "as an entry: how a checked generation is checked: prefill (default: a second"
                                        " route recomputes each finished window of tokens in one pass, comparing"
                                        " every hop's sketches) or lockstep (both routes decode every step)",
                             choices=["prefill", "lockstep"])
    verify_window: int = setting(16, "as an entry: tokens a check by prefill recomputes in one pass (default"
                                     " {default})")
    verify_release: str = setting("checked", "as an entry: when a checked generation's text goes out: checked"
                                             " (default: once its window is checked, a window's latency) or at-once"
                                             " (as it comes, with how far it is checked; a failed check retracts"
                                             " it from the first wrong token)", choices=["checked", "at-once"])
    relay: str = setting("auto", "offer circuit relay to daemons that cannot be dialled: auto (default: while this"
                                 " daemon is publicly reachable), on, off", choices=["auto", "on", "off"])
    relays: int = setting(2, "relays this daemon reserves at when it cannot be dialled (default {default}; 0: none)")
    relay_reservations: int = setting(32, "as a relay: daemons holding a reservation (default {default})")
    relay_circuits: int = setting(64, "as a relay: circuits open at once (default {default})")
    relay_circuits_per_peer: int = setting(16, "as a relay: circuits open at once from or to one daemon"
                                               " (default {default})")
    relay_circuit_mb: int = setting(1024, "as a relay: MiB one circuit carries before it is cut (default {default})")
    relay_circuit_s: float = setting(3600.0, "as a relay: seconds one circuit lasts (default {default})")
    hole_punch: int = setting(1, "1 (default): turn relayed connections into direct ones where both NATs allow it"
                                 " (DCUtR); 0: keep them relayed", choices=[0, 1])
    # what other daemons' shard streams may take here (meshd/hop/intake.py `Intake`)
    frame_budget_mb: int = setting(512, "MiB all peers' frames may occupy here at once, queued, half-received or being"
                                        " decoded; past it streams are not read (default {default})")
    peer_frame_mb: int = setting(192, "MiB one peer's frames may occupy; a larger frame is refused, more waits"
                                      " (default {default})")
    streams_per_peer: int = setting(128, "shard streams one peer may hold open (default {default})")
    frame_timeout: float = setting(30.0, "seconds a frame begun may take to arrive whole (default {default})")
    stream_idle: float = setting(300.0, "seconds a shard stream may say nothing before it is closed"
                                        " (default {default})")
    session_idle: float = setting(600.0, "seconds a session may send no frame before its KV is released"
                                         " (default {default})")
    session_idle_full: float = setting(60.0, "seconds a session may send no frame before a new session takes its KV"
                                             " when the daemon is full (default {default})")
    prefix_ttl: float = setting(600.0, "seconds the KV of an ended generation is kept unused for a later one that"
                                       " extends its tokens (a chat's next turn); kept KV is the first freed when room"
                                       " is needed; 0: keep none and reuse none (default {default})")
    peer_share: float = setting(0.75, "share of the sessions, the KV budget and the queue that one peer may hold; the"
                                      " rest stays for others (default {default})")
    cache_dir: str = setting("", "fingerprints and converted tokenizers (default ~/.cache/meshd)", flag=False)
    swarm_key: str = setting("", "a private mesh's key file (libp2p's /key/swarm/psk/1.0.0/ format, mode 0600): only"
                                 " daemons holding the same key can connect (default: an open mesh)")
    require_swarm_key: int = setting(0, "refuse to start without --swarm-key (for the systemd unit and shared"
                                        " configs)", const=1)
    kernel_isa: str = setting("", "run the block kernel on at most this instruction set (default: the best the CPU"
                                  " has; they compute the same bits)", choices=KERNEL_ISAS)
    kernel_layout: str = setting("auto", "keep weights in tiles of eight rows where that is faster (auto, the default:"
                                         " Q4_0 and Q4_1 on AVX2 and AVX-512, Q8_0 on AVX-512), every weight in the"
                                         " file's rows, or Q4_0, Q4_1 and Q8_0 in tiles everywhere (the same bits)",
                                 choices=KERNEL_LAYOUTS)
    wire_encoding: str = setting("raw", "how hidden states travel between shards: raw float32 (default),"
                                        " zstd, or auto (zstd where it saves a tenth)", choices=ENCODINGS)
    chunk_tokens: int = setting(128, "prompt tokens per prefill chunk (default {default})")

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

    @property
    def speculate_on(self) -> bool:
        if self.speculate not in ("auto", "off"):
            raise ValueError(f"--speculate must be auto or off, not {self.speculate!r}")
        if self.draft_max < 0:
            raise ValueError(f"--draft-max must be 0 or more, not {self.draft_max}")
        return self.speculate == "auto" and self.draft_max > 0

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


DECLARED: dict[str, Field] = {f.name: f for f in fields(Settings)}


def default(name: str):
    """The declared default of setting `name`, for a part that keeps one of its own when built alone."""
    f = DECLARED[name]
    return f.default_factory() if f.default is MISSING else f.default


def env_name(name: str) -> str:
    return f"MESHD_{name.upper()}"


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def help_text(name: str) -> str:
    """The setting's help, its default written in where the declaration says `{default}` or `{gib}`."""
    value = default(name)
    shown = format(value, "g") if isinstance(value, float) else str(value)
    gib = format(value / (1 << 30), "g") if isinstance(value, int) else ""
    return DECLARED[name].metadata["help"].format(default=shown, gib=gib)


def add_flags(parser: argparse.ArgumentParser, names=None) -> None:
    """Add the flags of the declared settings (all that have one, or `names`) to `parser`; a flag not
    given parses as None (a list flag as None too), so that `load_settings` sees it unset."""
    for name in names or [n for n, f in DECLARED.items() if f.metadata["flag"]]:
        meta, value = DECLARED[name].metadata, default(name)
        kwargs: dict = {"help": help_text(name)}
        if isinstance(value, list):
            kwargs["action"] = "append"
        elif meta["const"] is not None:
            kwargs.update(action="store_const", const=meta["const"])
        elif isinstance(value, (int, float)):
            kwargs["type"] = type(value)
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        parser.add_argument(flag_name(name), **kwargs)


def flags_given(args: argparse.Namespace) -> dict:
    """The settings' values as parsed from the command line (None where a flag was not given)."""
    return {name: getattr(args, name) for name in DECLARED if hasattr(args, name)}


def load_settings(flags: dict, config_file: str | None = None, environ=os.environ) -> Settings:
    """Merge defaults < TOML file < environment < flags (flags given as None are unset)."""
    s = Settings()
    path = config_file or environ.get("MESHD_CONFIG") or (DEFAULT_CONFIG if Path(DEFAULT_CONFIG).exists() else None)
    values: dict = {}
    if path:
        with open(path, "rb") as f:
            values.update(tomllib.load(f))
    for name in DECLARED:
        env = environ.get(env_name(name))
        if env is not None:
            values[name] = env.split(",") if isinstance(getattr(s, name), list) else env
    values.update({k: v for k, v in flags.items() if v is not None and v != []})
    for name in DECLARED:
        if name in values:
            default_ = getattr(s, name)
            value = values[name]
            if isinstance(default_, list) and isinstance(value, str):
                value = [value]
            setattr(s, name, type(default_)(value) if not isinstance(default_, list) else list(value))
    unknown = set(values) - set(DECLARED)
    if unknown:
        raise ValueError(f"unknown settings: {sorted(unknown)}")
    return s
