"""What the node builds from its settings (meshd/core/settings.py declares them): the limits on other
daemons' shard streams, a relay's limits, a private mesh's key, the share of generations checked, the
wire's encoding and chunk size, and the block kernel's two process-wide choices.

Rule: a bad value is refused here, by the flag's name, before anything starts. Everything else travels
as a value (the channels' encoding, the entry's and the intake's chunk size, the artifact's cache
directory). What stays process-wide and why: the block kernel's instruction set is the C extension's
own state (a process runs one kernel), and the weights' layout is the same kind of choice, read where a
weight is packed, deep in the shard's loaders; both give the same bits whatever they are.
"""

from __future__ import annotations

import os

from meshd import wire
from meshd.core.settings import Settings
from meshd.entry.checks import Checking, check_rate
from meshd.hop.intake import Intake
from meshd.p2p.budget import ByteBudget
from meshd.p2p.swarmkey import SwarmKey, SwarmKeyError, read_swarm_key
from meshd.relay.policy import RelayLimits


def configure(s: Settings) -> None:
    """Set the block kernel's two process-wide choices (its instruction set, the weights' layout); they
    read no environment themselves. The wire's encoding and chunk size are checked here too."""
    from meshd.shard import blocks  # torch comes with it: only a daemon or `meshd local` pays for it

    if s.kernel_isa:
        blocks.limit_isa(s.kernel_isa)
    if s.kernel_layout != "auto":
        blocks.set_layout(s.kernel_layout)
    wire_encoding(s)
    chunk_size(s)


def wire_encoding(s: Settings) -> str:
    """How this daemon's channels pack the tensors they send (--wire-encoding)."""
    if s.wire_encoding not in wire.ENCODINGS:
        raise ValueError(f"--wire-encoding must be raw, zstd or auto, not {s.wire_encoding!r}")
    return s.wire_encoding


def chunk_size(s: Settings) -> int:
    """Prompt tokens per prefill chunk (--chunk-tokens, at least 1)."""
    if s.chunk_tokens < 1:
        raise ValueError(f"--chunk-tokens: the prefill chunk size must be at least 1 token, not {s.chunk_tokens}")
    return s.chunk_tokens


def intake(s: Settings) -> Intake:
    """The limits on what other daemons' shard streams may take here."""
    if not 0 < s.peer_frame_mb <= s.frame_budget_mb:
        raise ValueError(f"--peer-frame-mb ({s.peer_frame_mb}) must be positive and at most"
                         f" --frame-budget-mb ({s.frame_budget_mb})")
    if not 0 < s.peer_share <= 1:
        raise ValueError(f"--peer-share must be in (0, 1], not {s.peer_share}")
    return Intake(ByteBudget(s.frame_budget_mb << 20, s.peer_frame_mb << 20), s.streams_per_peer,
                  s.frame_timeout, s.stream_idle, s.peer_share, encoding=s.wire_encoding, chunk_tokens=chunk_size(s))


def verify_share(s: Settings) -> float:
    """The share of generations this entry checks (--verify-rate, refused outside [0, 1])."""
    return check_rate(s.verify_rate)


def checking(s: Settings) -> Checking:
    """How this entry checks a generation (--verify-by, --verify-window, --verify-release; refused by name)."""
    return Checking(s.verify_by, s.verify_window, s.verify_release)


def mesh_key(s: Settings, environ=os.environ) -> SwarmKey | None:
    """The private mesh's key (None: an open mesh). Raises SwarmKeyError (a ValueError) for a key file
    that is malformed or readable by other users, and without a key when one is required."""
    if s.swarm_key:
        return read_swarm_key(s.swarm_key)
    if s.require_swarm_key or environ.get("LIBP2P_FORCE_PNET") == "1":
        raise SwarmKeyError("a swarm key is required (--require-swarm-key or LIBP2P_FORCE_PNET=1) but none is"
                            " given: set --swarm-key FILE, MESHD_SWARM_KEY or swarm_key in the config")
    return None


def relay_limits(s: Settings) -> RelayLimits:
    """What this daemon admits as a relay (--relay-*)."""
    if s.relay not in ("auto", "on", "off"):
        raise ValueError(f"--relay must be auto, on or off, not {s.relay!r}")
    return RelayLimits(reservations=s.relay_reservations, circuits=s.relay_circuits,
                       circuits_per_peer=s.relay_circuits_per_peer, circuit_bytes=s.relay_circuit_mb << 20,
                       circuit_s=s.relay_circuit_s)
