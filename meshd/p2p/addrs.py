"""Peer addresses as strings: a multiaddr with or without its `/p2p/<peer id>` tail.

Rule: every place that drops or adds the peer tail goes through these two functions, so an
address means the same thing to the dialler, the DHT, the relay and reachability.
"""

from __future__ import annotations

PEER = "/p2p/"
CIRCUIT = "/p2p-circuit"  # a circuit address: <relay addr>/p2p/<relay>/p2p-circuit/p2p/<peer>


def strip_peer(addr: str) -> str:
    """The transport part of `addr`: everything before its first `/p2p/` (all of it when there is none).
    For a circuit address that is the relay's own transport address."""
    return addr.split(PEER)[0]


def with_peer(addr: str, peer_id: str) -> str:
    """`addr` ending in `/p2p/<peer_id>` (whatever peer tail it had is replaced)."""
    return f"{strip_peer(addr)}{PEER}{peer_id}"
