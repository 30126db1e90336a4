"""The libp2p host of a daemon: persistent Ed25519 identity, Noise only, Yamux, one connection per peer.

Rules (from py-libp2p 0.8.1's measured pitfalls): offer Noise alone (the default also accepts
plaintext); cap connections per peer at one (the default makes every connect wait ~250 ms);
keep libp2p's own loggers quiet; dial only the peers meshd asks for (py-libp2p's auto-connector
would dial every peer in the peerstore, which DHT walks fill, until it holds 150 connections). Streams are framed by `StreamChannel` (meshd.wire over a stream).
With a swarm key (a private mesh), every connection of the host runs libp2p's pnet under Noise
(`meshd/p2p/pnet.py`); a host without one speaks to open meshes only.
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519
from libp2p.identity_utils import load_identity, save_identity
from libp2p.network.config import ConnectionConfig
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from meshd.p2p.addrs import with_peer
from meshd.p2p.pnet import Pnet, protect_swarm

IDENTITY_FILE = "identity.key"


def load_or_create_identity(state_dir: Path):
    """The daemon's key pair, kept in state_dir/identity.key (mode 0600)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / IDENTITY_FILE
    if path.exists():
        return load_identity(path)
    kp = create_new_key_pair()
    save_identity(kp, path)
    os.chmod(path, 0o600)
    return kp


def make_host(key_pair, pnet: Pnet | None = None):
    """A host (not yet running); with `pnet`, a member of that private mesh only."""
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519().private_key)
    host = new_host(key_pair=key_pair, sec_opt={NOISE_PROTOCOL_ID: noise},
                    muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
                    connection_config=ConnectionConfig(max_connections_per_peer=1))
    host.get_network().auto_connector.maybe_connect = _dial_nothing
    if pnet is not None:
        protect_swarm(host.get_network(), pnet)
    return host


async def _dial_nothing() -> None:
    """Stands in for py-libp2p's auto-connect round (its watermarks cannot switch it off: the
    target is their midpoint, and a high watermark of zero prunes every connection)."""


@asynccontextmanager
async def open_host(key_pair, listen: list[str], pnet: Pnet | None = None) -> AsyncIterator:
    """A running host listening on `listen` multiaddrs (none: dial-out only), of the private mesh
    `pnet` holds the key of (None: an open mesh)."""
    host = make_host(key_pair, pnet)
    async with host.run([multiaddr.Multiaddr(a) for a in listen]):
        yield host


def full_addrs(host) -> list[str]:
    """The host's listen addresses, each ending in /p2p/<peer id>."""
    pid = host.get_id().to_base58()
    out = []
    for a in host.get_addrs():
        out.append(with_peer(str(a), pid))
    return out


def dialable_addrs(host) -> list[str]:
    """The addresses peers can dial: listen addresses, with an unspecified one (/ip4/0.0.0.0, the
    default) replaced by this machine's interface addresses at the same port (loopback only when
    there is nothing else). Published in records; a 0.0.0.0 there would send peers to themselves."""
    out = []
    for a in full_addrs(host):
        if not a.startswith("/ip4/0.0.0.0/"):
            out.append(a)
            continue
        ips = interface_ipv4s()
        outside = [ip for ip in ips if not ip.startswith("127.")]
        out += [a.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/", 1) for ip in (outside or ips)]
    return list(dict.fromkeys(out))


def interface_ipv4s() -> list[str]:
    """IPv4 addresses of this machine's interfaces that are up (Linux: SIOCGIFADDR per interface)."""
    import fcntl
    import socket
    import struct

    ips = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                ips.append(socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x8915, req)[20:24]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on this interface
                continue
    return ips


async def connect(host, addr: str, timeout: float = 10.0):
    """Dial a /.../p2p/<id> multiaddr; returns the peer id. Raises on failure or timeout."""
    info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
    with trio.fail_after(timeout):
        await host.connect(info)
    return info.peer_id
