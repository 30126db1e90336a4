"""Peer addresses as strings: a multiaddr with or without its `/p2p/<peer id>` tail.

Rule: every place that drops or adds the peer tail goes through these two functions, so an
address means the same thing to the dialler, the DHT, the relay and reachability; every place that
reads or writes a circuit address (`<relay addr>/p2p/<relay>/p2p-circuit/p2p/<peer>`) goes through
the circuit functions below.
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


def is_circuit(addr: str) -> bool:
    return CIRCUIT in addr


def circuit_addr(relay_addr: str, relay_id: str, peer_id: str) -> str:
    """The address at which `peer_id` is reached through the relay dialled at `relay_addr`."""
    return f"{strip_peer(relay_addr)}/p2p/{relay_id}{CIRCUIT}/p2p/{peer_id}"


def parse_circuit(addr: str) -> tuple[str, str, str]:
    """(relay address with /p2p/<relay>, relay id, peer id) of a circuit address; ValueError if it is not one."""
    head, sep, tail = addr.partition(CIRCUIT)
    if not sep or "/p2p/" not in head or not tail.startswith("/p2p/"):
        raise ValueError(f"not a circuit address: {addr!r}")
    relay_id = head.rsplit("/p2p/", 1)[1]
    peer_id = tail[len("/p2p/"):]
    if not relay_id or not peer_id or "/" in relay_id or "/" in peer_id:
        raise ValueError(f"not a circuit address: {addr!r}")
    return head, relay_id, peer_id


def relay_of(addr: str) -> str | None:
    """The relay a circuit address goes through, or None when it is not a well-formed one."""
    try:
        return parse_circuit(addr)[1]
    except ValueError:
        return None


def split_addrs(addrs) -> tuple[list[str], list[str]]:
    """(direct addresses, circuit addresses)."""
    direct = [a for a in addrs if not is_circuit(a)]
    return direct, [a for a in addrs if is_circuit(a)]
