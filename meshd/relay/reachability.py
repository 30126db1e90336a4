"""Is this daemon publicly reachable? Connected peers dial it back on a fresh connection.

py-libp2p 0.8.1's AutoNAT answers "reachable" wrongly: its dial-back reuses the connection the
question came on. Here the asked peer dials from a throwaway host (a new identity, so a new
connection that must cross the asker's NAT), checks the asker's identity in the Noise handshake,
and reports back. Rules, as AutoNAT's: a peer only dials addresses at the IP it sees the request
come from (never a third party: no amplification), at most `MAX_DIALS` of them, `SERVE_LIMIT` such
dials at a time; the verdict (`ReachabilityState`) is a pure function of the answers, kept for
`KEEP_S`: "public" once any peer got through, "private" when peers answered and none did,
"unknown" before any answer.
"""

from __future__ import annotations

import ipaddress
import json
import struct
import time
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from meshd.core.log import get_logger
from meshd.p2p.host import connect, full_addrs, open_host
from meshd.p2p.addrs import strip_peer, with_peer
from meshd.p2p.connections import is_relayed

DIALBACK_PROTOCOL = TProtocol("/meshd/dialback/1.0.0")
MAX_MESSAGE = 4096
MAX_DIALS = 4
DIAL_TIMEOUT = 5.0
ASK_TIMEOUT = 15.0
SERVE_LIMIT = 2
ASK_PEERS = 3  # peers asked per round
KEEP_S = 600.0  # how long an answer counts
RECHECK_S = 120.0  # a peer is asked again after this
log = get_logger(__name__)


@dataclass(frozen=True)
class DialBack:
    """One peer's answer: did it reach us, at which address, and what IP it sees us at."""
    peer_id: str
    reachable: bool
    addr: str | None
    observed: str | None
    at: float


class ReachabilityState:
    """The verdict from peers' answers (pure: the time is passed in)."""

    def __init__(self, keep_s: float = KEEP_S) -> None:
        self.keep_s = keep_s
        self.answers: dict[str, DialBack] = {}
        self.asked: dict[str, float] = {}  # when each peer was last asked, answered or not

    def record(self, answer: DialBack) -> None:
        self.answers[answer.peer_id] = answer  # a peer's newest answer replaces its older one

    def fresh(self, now: float) -> list[DialBack]:
        return [a for a in self.answers.values() if now - a.at <= self.keep_s]

    def status(self, now: float) -> str:
        fresh = self.fresh(now)
        if any(a.reachable for a in fresh):
            return "public"
        return "private" if fresh else "unknown"

    def to_ask(self, peers: list[str], now: float, recheck_s: float = RECHECK_S, most: int = ASK_PEERS) -> list[str]:
        """Peers not asked within `recheck_s` (answered or not: one that cannot answer is not pestered),
        never-asked first, then the longest unasked; at most `most`, each marked as asked now."""
        due = [p for p in peers if p not in self.asked or now - self.asked[p] >= recheck_s]
        chosen = sorted(due, key=lambda p: self.asked.get(p, float("-inf")))[:most]
        for p in chosen:
            self.asked[p] = now
        return chosen

    def summary(self, now: float) -> dict:
        fresh = self.fresh(now)
        return {"status": self.status(now),
                "confirmed_by": sorted(a.peer_id for a in fresh if a.reachable),
                "refuted_by": sorted(a.peer_id for a in fresh if not a.reachable),
                "reached_at": sorted({a.addr for a in fresh if a.addr}),
                "observed": sorted({a.observed for a in fresh if a.observed})}


def dial_candidates(addrs: list[str], observed_ip: str, most: int = MAX_DIALS) -> list[str]:
    """The asker's TCP addresses a peer may dial: those at the IP it saw the request come from (an
    unspecified 0.0.0.0/:: listen address stands for it), without /p2p/, at most `most`."""
    out = []
    for a in addrs:
        try:
            ma = multiaddr.Multiaddr(strip_peer(a))
            proto = "ip4" if "/ip4/" in str(ma) else "ip6"
            ip, port = ma.value_for_protocol(proto), ma.value_for_protocol("tcp")
        except Exception:
            continue
        if ip is None or port is None:
            continue
        if ipaddress.ip_address(ip).is_unspecified:
            ip = observed_ip
        if ip == observed_ip:
            cand = f"/{proto}/{ip}/tcp/{port}"
            if cand not in out:
                out.append(cand)
    return out[:most]


async def _send(stream, obj: dict) -> None:
    data = json.dumps(obj).encode()
    await stream.write(struct.pack(">I", len(data)) + data)


async def _receive(stream) -> dict:
    buf = b""
    while len(buf) < 4:
        chunk = await stream.read(4 - len(buf))
        if not chunk:
            raise EOFError("stream ended")
        buf += chunk
    (n,) = struct.unpack(">I", buf)
    if n > MAX_MESSAGE:
        raise ValueError(f"dial-back message of {n} bytes exceeds {MAX_MESSAGE}")
    buf = b""
    while len(buf) < n:
        chunk = await stream.read(n - len(buf))
        if not chunk:
            raise EOFError("stream ended")
        buf += chunk
    obj = json.loads(buf)
    if not isinstance(obj, dict):
        raise ValueError("dial-back message is not an object")
    return obj


async def dial_fresh(addrs: list[str], peer_id: str, timeout: float = DIAL_TIMEOUT, pnet=None) -> str | None:
    """Dial `peer_id` at each address from a throwaway host (a member of the private mesh `pnet`,
    when there is one); the first that answers (and proves it is that peer in the Noise handshake), or None."""
    async with open_host(create_new_key_pair(), [], pnet) as probe:
        for a in addrs:
            try:
                pid = await connect(probe, with_peer(a, peer_id), timeout=timeout)
            except Exception:
                continue
            with trio.move_on_after(timeout):
                await probe.disconnect(pid)  # leaving the host alone leaves the connection open at the peer
            return a
    return None


class Reachability:
    """The dial-back protocol on a host: answer peers' questions and ask them ours."""

    def __init__(self, host, peers=None, pnet=None) -> None:
        """`peers()` names the peers worth asking (default: every connected peer); `pnet`: the
        private mesh's key, which dial-backs carry too."""
        self.host = host
        self.pnet = pnet
        self.peers = peers or (lambda: [p.to_base58() for p in host.get_connected_peers()])
        self.state = ReachabilityState()
        self._serving = trio.Semaphore(SERVE_LIMIT)

    def summary(self) -> dict:
        return self.state.summary(time.time())

    async def serve_stream(self, stream) -> None:
        """A peer asks: dial me back. Dials only at the IP the question came from."""
        try:
            with trio.move_on_after(ASK_TIMEOUT):
                req = await _receive(stream)
                asker = stream.muxed_conn.peer_id.to_base58()
                remote = None if is_relayed(stream.muxed_conn) else stream.get_remote_address()
                observed = remote[0] if remote else None  # through a relay: we cannot tell, and say so
                if observed is None:
                    await _send(stream, {"unknown": True})
                    return
                addrs = dial_candidates([a for a in req.get("addrs", []) if isinstance(a, str)][:16],
                                        observed) if observed else []
                async with self._serving:
                    reached = await dial_fresh(addrs, asker, pnet=self.pnet) if addrs else None
                await _send(stream, {"reachable": reached is not None, "addr": reached, "observed": observed,
                                     "dialled": addrs})
        except Exception as exc:
            log.debug("dial-back request failed", error=str(exc) or type(exc).__name__)
        finally:
            await stream.close()

    async def ask(self, peer_id: str) -> DialBack | None:
        """Ask a connected peer to dial us back; None if it could not answer."""
        stream = None
        try:
            with trio.fail_after(ASK_TIMEOUT):
                stream = await self.host.new_stream(ID.from_base58(peer_id), [DIALBACK_PROTOCOL])
                await _send(stream, {"addrs": full_addrs(self.host)})
                ans = await _receive(stream)
        except Exception as exc:
            log.debug("dial-back ask failed", peer_id=peer_id, error=str(exc) or type(exc).__name__)
            return None
        finally:
            if stream is not None:
                with trio.move_on_after(1.0):
                    await stream.close()
        if ans.get("unknown"):
            return None
        addr, observed = ans.get("addr"), ans.get("observed")
        return DialBack(peer_id, bool(ans.get("reachable")), addr if isinstance(addr, str) else None,
                        observed if isinstance(observed, str) else None, time.time())

    async def run(self, period_s: float = 2.0) -> None:
        """Ask peers, a few at a time, whenever one has not been asked recently."""
        while True:
            for peer_id in self.state.to_ask(self.peers(), time.time()):
                answer = await self.ask(peer_id)
                if answer is not None:
                    before = self.state.status(time.time())
                    self.state.record(answer)
                    after = self.state.status(time.time())
                    if after != before:
                        log.info("reachability", status=after, by=peer_id, addr=answer.addr, observed=answer.observed)
            await trio.sleep(period_s)
