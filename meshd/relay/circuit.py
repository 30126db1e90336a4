"""Circuit relay v2 on the wire: a relay's hop service, and a private daemon's reserve, dial and accept.

Messages are py-libp2p's circuit v2 protobufs (`libp2p.relay.circuit_v2`), one request per hop
stream. The service is meshd's own rather than `CircuitV2Protocol(allow_hop=True)`: that one keys
open circuits by peer, so a circuit that ends tears down another circuit to the same peer (a
stranger opening and closing circuits to a daemon would cut its sessions), takes a reservation
for whichever peer the message names, and checks a circuit's duration only when data arrives.
Here every circuit has its own entry in a `RelayLedger`, a reservation is for the peer that asked,
and a circuit is cut at its deadline or byte limit whatever flows. Rules: a relay refuses hop
requests over relayed connections (no chains); a private daemon accepts relayed connections only
from relays it holds a reservation at; every read and write is bounded in time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Limit, PeerId, Reservation, StopMessage
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from meshd.core.log import get_logger
from meshd.p2p.addrs import circuit_addr, parse_circuit, with_peer
from meshd.p2p.connections import is_connected, is_relayed
from meshd.relay.policy import RelayLedger, RelayLimits

HOP_PROTOCOL = TProtocol("/libp2p/circuit/relay/0.2.0/hop")
STOP_PROTOCOL = TProtocol("/libp2p/circuit/relay/0.2.0/stop")
MESSAGE_TIMEOUT = 10.0  # one control message of the relay protocol
PUMP_CHUNK = 16 * 1024  # a Yamux frame of this fits one Noise message
log = get_logger(__name__)


class RelayRefused(ConnectionError):
    def __init__(self, status: int, what: str) -> None:
        self.status = status
        name = StatusCode(status).name if status in StatusCode._value2member_map_ else str(status)
        super().__init__(f"{what} refused by relay: {name}")


@dataclass(frozen=True)
class Reserved:
    relay_id: str
    expires_at: float  # unix time
    relay_addrs: tuple[str, ...]  # the relay's own addresses, as it reports them


def _tag_relayed(host, peer: ID, muxed, ma: multiaddr.Multiaddr) -> None:
    """Mark the swarm's connection as relayed (py-libp2p cannot tell from a stream-backed connection)."""
    for conn in host.get_network().connections.get(peer) or ():
        if conn is muxed or getattr(conn, "muxed_conn", None) is muxed:
            try:
                conn.set_transport_info([ma], ConnectionType.RELAYED)
            except Exception:
                pass


async def _status(stream, code: StatusCode, **fields) -> None:
    with trio.move_on_after(MESSAGE_TIMEOUT):
        await write_delimited_msg(stream, HopMessage(type=HopMessage.STATUS, status=int(code), **fields))


async def _end(stream, reset: bool = False) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(2.0):
        try:
            await (stream.reset() if reset else stream.close())
        except Exception:
            pass


class RelayService:
    """The hop side: reservations and circuits for other daemons, within `limits`.

    `enabled()` says whether to serve at all (with `--relay auto`: only while this daemon is
    publicly reachable); `own_addrs()` gives the addresses a reservation hands out."""

    def __init__(self, host, limits: RelayLimits, enabled=lambda: True, own_addrs=None) -> None:
        self.host = host
        self.ledger = RelayLedger(limits)
        self.enabled = enabled
        self.own_addrs = own_addrs or (lambda: [])

    def summary(self) -> dict:
        return {"on": bool(self.enabled()), **self.ledger.summary(time.time())}

    async def serve_stream(self, stream) -> None:
        src = stream.muxed_conn.peer_id
        try:
            if is_relayed(stream.muxed_conn):
                await _status(stream, StatusCode.PERMISSION_DENIED)
                return
            with trio.fail_after(MESSAGE_TIMEOUT):
                msg = await read_delimited_msg(stream, HopMessage)
            if not self.enabled():
                await _status(stream, StatusCode.RESERVATION_REFUSED if msg.type == HopMessage.RESERVE
                              else StatusCode.PERMISSION_DENIED)
            elif msg.type == HopMessage.RESERVE:
                await self._reserve(stream, src)
            elif msg.type == HopMessage.CONNECT:
                await self._connect(stream, src, msg)
            else:
                await _status(stream, StatusCode.UNEXPECTED_MESSAGE)
        except Exception as exc:  # a malformed or dead peer ends its own request only
            log.debug("relay request failed", peer=src.to_base58()[-8:], error=f"{type(exc).__name__}: {exc}")
            await _end(stream, reset=True)
        else:
            await _end(stream)

    def _connected(self, peer: ID) -> bool:
        return is_connected(self.host.get_network(), peer)

    async def _reserve(self, stream, src: ID) -> None:
        for peer in list(self.ledger.reservations):  # a reservation lives only as long as its connection
            if not self._connected(ID.from_base58(peer)):
                self.ledger.drop(peer)
        got = self.ledger.reserve(src.to_base58(), time.time())
        if isinstance(got, str):
            log.info("relay reservation refused", peer=src.to_base58()[-8:], reason=got)
            await _status(stream, StatusCode.RESERVATION_REFUSED)
            return
        me = self.host.get_id().to_base58()
        addrs = [multiaddr.Multiaddr(with_peer(a, me)).to_bytes() for a in self.own_addrs()]
        lim = self.ledger.limits
        await _status(stream, StatusCode.OK, reservation=Reservation(expire=int(got), addrs=addrs),
                      limit=Limit(duration=int(lim.circuit_s), data=lim.circuit_bytes))

    async def _connect(self, stream, src: ID, msg) -> None:
        try:
            dst = ID(msg.peer.id)
        except Exception:
            await _status(stream, StatusCode.MALFORMED_MESSAGE)
            return
        if not self._connected(dst):
            self.ledger.drop(dst.to_base58())
        cid = self.ledger.open(src.to_base58(), dst.to_base58(), time.time())
        if isinstance(cid, str):
            log.info("relay circuit refused", src=src.to_base58()[-8:], dst=dst.to_base58()[-8:], reason=cid)
            await _status(stream, StatusCode.NO_RESERVATION if cid == "no reservation"
                          else StatusCode.RESOURCE_LIMIT_EXCEEDED)
            return
        lim = self.ledger.limits
        limit = Limit(duration=int(lim.circuit_s), data=lim.circuit_bytes)
        out = None
        try:
            try:
                with trio.fail_after(MESSAGE_TIMEOUT):
                    out = await self.host.new_stream(dst, [STOP_PROTOCOL])
                    await write_delimited_msg(out, StopMessage(type=StopMessage.CONNECT,
                                                               peer=PeerId(id=src.to_bytes()), limit=limit))
                    answer = await read_delimited_msg(out, StopMessage)
                if answer.type != StopMessage.STATUS or answer.status != StatusCode.OK:
                    raise ConnectionError(f"destination answered {answer.status}")
            except Exception as exc:
                log.info("relay circuit failed", dst=dst.to_base58()[-8:], error=f"{type(exc).__name__}: {exc}")
                await _status(stream, StatusCode.CONNECTION_FAILED)
                return
            await _status(stream, StatusCode.OK, limit=limit)
            with trio.move_on_after(lim.circuit_s) as deadline:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, stream, out, cid, nursery.cancel_scope)
                    nursery.start_soon(self._pump, out, stream, cid, nursery.cancel_scope)
            if deadline.cancelled_caught:
                log.info("relay circuit reached its duration limit", src=src.to_base58()[-8:], dst=dst.to_base58()[-8:])
        finally:
            self.ledger.close(cid)
            if out is not None:
                await _end(out, reset=True)
            await _end(stream, reset=True)

    async def _pump(self, src, dst, cid: int, scope: trio.CancelScope) -> None:
        """Copy one direction until it ends or the circuit is past its byte limit; then end both."""
        try:
            while True:
                data = await src.read(PUMP_CHUNK)
                if not data or not self.ledger.carry(cid, len(data)):
                    break
                # shielded: a write cancelled half-way (the other direction ending the circuit) leaves half
                # a Yamux frame in the Noise stream and kills the whole connection, every circuit on it
                # (seen: a circuit cut at its byte limit took down the relay's connection to the target)
                with trio.CancelScope(shield=True), trio.fail_after(MESSAGE_TIMEOUT * 3):
                    await dst.write(data)  # (a reader that stopped reading stalls its own circuit only)
        except Exception:
            pass
        finally:
            scope.cancel()


async def reserve(host, relay_id: str, timeout: float = MESSAGE_TIMEOUT) -> Reserved:
    """Ask a connected relay for a reservation (or to refresh ours); raises RelayRefused or on failure."""
    stream = await host.new_stream(ID.from_base58(relay_id), [HOP_PROTOCOL])
    try:
        with trio.fail_after(timeout):
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
            resp = await read_delimited_msg(stream, HopMessage)
        if resp.type != HopMessage.STATUS or resp.status != StatusCode.OK:
            raise RelayRefused(resp.status, "reservation")
        addrs = []
        for raw in resp.reservation.addrs:
            try:
                addrs.append(str(multiaddr.Multiaddr(raw)))
            except Exception:
                continue
        return Reserved(relay_id, float(resp.reservation.expire), tuple(addrs))
    finally:
        await _end(stream)


async def dial_circuit(host, addr: str, timeout: float = MESSAGE_TIMEOUT) -> None:
    """Connect to the peer at circuit address `addr` through its relay, which must be connected;
    the relayed connection joins the swarm like any other (streams to the peer then use it)."""
    _, relay_id, peer_id = parse_circuit(addr)
    dst = ID.from_base58(peer_id)
    stream = await host.new_stream(ID.from_base58(relay_id), [HOP_PROTOCOL])
    try:
        with trio.fail_after(timeout):
            await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT, peer=PeerId(id=dst.to_bytes())))
            resp = await read_delimited_msg(stream, HopMessage)
        if resp.type != HopMessage.STATUS or resp.status != StatusCode.OK:
            raise RelayRefused(resp.status, "circuit")
        ma = multiaddr.Multiaddr(addr)
        raw = RawConnection(stream=stream, initiator=True, connection_type=ConnectionType.RELAYED, addresses=[ma])
        with trio.fail_after(timeout):
            conn = await host.get_network().upgrade_outbound_raw_conn(raw, dst)
        _tag_relayed(host, dst, conn, ma)
    except BaseException:
        await _end(stream, reset=True)
        raise


async def accept_circuit(host, stream, allowed) -> bool:
    """The stop side: a relay brings a connection from another peer. Accepted only from relays in
    `allowed()` (ours); the stream becomes a connection of the swarm. True when accepted."""
    relay = stream.muxed_conn.peer_id
    try:
        with trio.fail_after(MESSAGE_TIMEOUT):
            msg = await read_delimited_msg(stream, StopMessage)
            if relay.to_base58() not in allowed():
                await write_delimited_msg(stream, StopMessage(type=StopMessage.STATUS,
                                                              status=int(StatusCode.PERMISSION_DENIED)))
                await _end(stream)
                return False
            if msg.type != StopMessage.CONNECT:
                raise ValueError("expected CONNECT")
            src = ID(msg.peer.id)
            await write_delimited_msg(stream, StopMessage(type=StopMessage.STATUS, status=int(StatusCode.OK)))
        ma = multiaddr.Multiaddr(circuit_addr("", relay.to_base58(), src.to_base58()))
        raw = RawConnection(stream=stream, initiator=False, connection_type=ConnectionType.RELAYED, addresses=[ma])
        with trio.fail_after(MESSAGE_TIMEOUT):
            muxed = await host.upgrade_inbound_connection(raw, ma)
        _tag_relayed(host, src, muxed, ma)
        return True
    except Exception as exc:
        log.debug("relayed connection not accepted", relay=relay.to_base58()[-8:], error=f"{type(exc).__name__}: {exc}")
        await _end(stream, reset=True)
        return False
