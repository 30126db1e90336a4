"""What the swarm holds for a peer: its live connections and whether they run through a relay.

Rule: py-libp2p keeps a connection it has just closed (trimmed, reset, the peer gone) listed under
its peer for a while, so "connected" always means "has a connection that is not closed"; every
module asks these functions rather than reading `network.connections` itself.
"""

from __future__ import annotations

from libp2p.connection_types import ConnectionType
from libp2p.peer.id import ID

from meshd.p2p.addrs import CIRCUIT


def _pid(peer) -> ID:
    return peer if isinstance(peer, ID) else ID.from_base58(peer)


def live_connections(network, peer) -> list:
    """The swarm's connections to `peer` (an ID or its base58 form) that are not closed."""
    return [c for c in network.connections.get(_pid(peer)) or () if not c.is_closed]


def is_connected(network, peer) -> bool:
    """Does the swarm hold a live connection to `peer`?"""
    return bool(live_connections(network, peer))


def is_relayed(conn) -> bool:
    """Does this connection (swarm or muxed) run through a relay?"""
    try:
        if conn.get_connection_type() == ConnectionType.RELAYED:
            return True
    except Exception:
        pass
    try:
        return any(CIRCUIT in str(a) for a in conn.get_transport_addresses() or ())
    except Exception:
        return False


def relayed_peers(network) -> list[str]:
    """Peers the swarm reaches only through a relay (every live connection relayed), sorted."""
    out = []
    for pid in list(network.connections):
        live = live_connections(network, pid)
        if live and all(is_relayed(c) for c in live):
            out.append(pid.to_base58())
    return sorted(out)


def forget_failed_dials(network, peer) -> None:
    """Clear py-libp2p's negative cache of failed dials to `peer`: a peer restarted on its port is back
    under a fresh record, and the cache would still refuse it."""
    try:
        network.unblock_peer(_pid(peer))
    except Exception:  # an older swarm without a dial blocklist
        pass
