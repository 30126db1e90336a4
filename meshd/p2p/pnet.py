"""A private mesh on the wire: every raw connection speaks libp2p's pnet before anything else.

Each side sends a random 24-byte nonce, then XORs everything it sends with XSalsa20(key, its
nonce); it decrypts what it reads with XSalsa20(key, the peer's nonce). This is the libp2p pnet
spec, byte for byte what go-, rust- and js-libp2p send; Noise then runs inside and still
authenticates the peer. py-libp2p 0.8.1's own pnet (`libp2p.security.pnet`) uses 8-byte nonces and
talks to no other implementation, so the swarm's `psk` stays unset and `protect_swarm` wraps the
swarm's security upgrade instead: every connection, dialled or accepted, direct, relayed (meshd's
circuits) or hole-punched, passes through it, and pnet starts there, before multistream.

Rule: a connection from a peer without the key is refused before libp2p reads a byte of it. Any
libp2p connection opens with multistream's header (`/multistream/1.0.0`), so the first 20
decrypted bytes must be that header. A peer of an open mesh sends that header in the clear (no
nonce begins so, but for 2**-160) and is refused at once, without waiting for more; one whose
bytes decrypt to anything else (another key), or that ends its connection part way through the
opening, is refused too. Each refusal closes the connection, is counted, and is logged at most
once per `LOG_EVERY_S`; a connection that ends before sending a byte is only a closed connection.
"""

from __future__ import annotations

import os
import time

from libp2p.abc import IRawConnection
from libp2p.network.connection.exceptions import RawConnError
from libp2p.transport.exceptions import SecurityUpgradeFailure

from meshd.core.log import get_logger
from meshd.p2p.swarmkey import SwarmKey
from meshd.p2p.xsalsa20 import NONCE_SIZE, XSalsa20

MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"  # varint length, then the protocol id
LOG_EVERY_S = 60.0
log = get_logger(__name__)


class NotAMember(RawConnError):
    """The peer at the other end does not hold the mesh's key."""


class Refusals:
    """Counts refused connections and decides which get a log line (pure: the clock is passed in)."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self.count = 0
        self._unlogged = 0
        self._last_line: float | None = None

    def note(self, now: float) -> int | None:
        """Count one refusal; returns how many went unlogged before it when this one gets a line,
        None when it stays quiet (a line was logged less than `every_s` ago)."""
        self.count += 1
        if self._last_line is not None and now - self._last_line < self.every_s:
            self._unlogged += 1
            return None
        self._last_line, quiet, self._unlogged = now, self._unlogged, 0
        return quiet


class Pnet:
    """A mesh's key and its refusals; `protect(conn)` wraps one raw connection."""

    def __init__(self, key: SwarmKey, every_s: float = LOG_EVERY_S) -> None:
        self.key = key
        self.refusals = Refusals(every_s)

    @property
    def fingerprint(self) -> str:
        return self.key.fingerprint

    def summary(self) -> dict:
        return {"private": True, "fingerprint": self.fingerprint, "refused": self.refusals.count}

    def protect(self, conn) -> "PnetConn":
        return conn if isinstance(conn, PnetConn) else PnetConn(conn, self.key.psk, self.refused)

    def refused(self, remote: str) -> None:
        quiet = self.refusals.note(time.monotonic())
        if quiet is not None:
            log.warning("refused a connection without the mesh's key from " + remote, remote=remote,
                        refused_total=self.refusals.count, unlogged_since_last_line=quiet)


def protect_swarm(swarm, pnet: Pnet) -> None:
    """Make every connection of `swarm` run pnet under its security upgrade (see the module doc)."""
    upgrader = swarm.upgrader
    secure = upgrader.upgrade_security

    async def upgrade_security(raw_conn, is_initiator, *args, **kwargs):
        conn = pnet.protect(raw_conn)
        try:
            return await secure(conn, is_initiator, *args, **kwargs)
        except SecurityUpgradeFailure as exc:
            if conn.refusal:  # logged once, rate-limited, by us: not as a failed upgrade by the swarm
                raise NotAMember(conn.refusal) from exc
            raise

    upgrader.upgrade_security = upgrade_security


class PnetConn(IRawConnection):
    """A raw connection under pnet. Our nonce goes out with the first write, or before the first
    read (an implementation may wait for it before it writes); the peer's nonce and the checked
    multistream header are read on the first read."""

    def __init__(self, conn, psk: bytes, on_refused) -> None:
        self._conn, self._psk, self._on_refused = conn, psk, on_refused
        self._enc: XSalsa20 | None = None
        self._dec: XSalsa20 | None = None
        self._pending = b""  # decrypted bytes the caller has not read yet
        self._opening_seen = False  # the peer sent some of its opening
        self.refusal = ""  # why the peer was refused, once it was
        self.is_initiator = getattr(conn, "is_initiator", False)

    async def write(self, data: bytes) -> None:
        if self._enc is None:
            nonce = os.urandom(NONCE_SIZE)
            self._enc = XSalsa20(self._psk, nonce)
            await self._conn.write(nonce + self._enc.xor(data))
            return
        await self._conn.write(self._enc.xor(data))

    async def read(self, n: int | None = None) -> bytes:
        if self._dec is None:
            if self._enc is None:
                try:
                    await self.write(b"")
                except Exception:  # the peer went away; what it sent before says whether it was a member
                    pass
            await self._open_reading()
        if self._pending:
            out = self._pending if n is None else self._pending[:n]
            self._pending = self._pending[len(out):]
            return out
        data = await self._conn.read(n)
        return self._dec.xor(data) if data else b""

    async def _open_reading(self) -> None:
        head_len = len(MULTISTREAM_HEADER)
        got = await self._read_opening(head_len)
        if got[:head_len] == MULTISTREAM_HEADER:  # plain libp2p: a peer of an open mesh (a nonce never
            await self._refuse("it speaks libp2p without a key")  # begins so, but for 2**-160)
        got += await self._read_opening(NONCE_SIZE + head_len - len(got))
        dec = XSalsa20(self._psk, got[:NONCE_SIZE])
        head = dec.xor(got[NONCE_SIZE:])
        if head[:head_len] != MULTISTREAM_HEADER:
            await self._refuse("its bytes do not decrypt with the mesh's key")
        self._dec, self._pending = dec, head

    async def _read_opening(self, n: int) -> bytes:
        """At least n bytes of the peer's opening (more may come); a connection that ends first after
        sending something is refused."""
        got = b""
        while len(got) < n:
            chunk = await self._conn.read(n - len(got))
            if not chunk:
                if got or self._opening_seen:  # something, but not a member's opening
                    await self._refuse("it ended before the key's opening")
                raise RawConnError("connection closed before the pnet nonce")
            got += chunk
            self._opening_seen = True
        return got

    async def _refuse(self, why: str) -> None:
        self.refusal = f"refused a connection without the mesh's key from {self.remote_text()}: {why}"
        self._on_refused(self.remote_text())
        try:
            await self._conn.close()
        except Exception:
            pass
        raise NotAMember(self.refusal)

    def remote_text(self) -> str:
        try:
            addrs = self._conn.get_transport_addresses()
            if addrs:
                return str(addrs[0])
        except Exception:
            pass
        try:
            ip, port = self._conn.get_remote_address()
            return f"{ip}:{port}"
        except Exception:
            return "an unknown address"

    async def close(self) -> None:
        await self._conn.close()

    def get_remote_address(self):
        return self._conn.get_remote_address()

    def get_transport_addresses(self):
        return self._conn.get_transport_addresses()

    def get_connection_type(self):
        return self._conn.get_connection_type()

    def __getattr__(self, name: str):  # anything else a transport's connection offers
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._conn, name)
