"""A daemon's side of circuit relay: the relay it offers while publicly reachable (`offer`), and the
reservations it keeps at other relays while it cannot be dialled itself (`reservations`).

Rule: the policies are `meshd/relay/`'s (what a relay admits, which relays to reserve at); this only
decides, from `--relay`, `--relays` and the reachability verdict, when each is on, and says so in
the daemon's record.
"""

from __future__ import annotations

import time

from meshd.relay.circuit import HOP_PROTOCOL, STOP_PROTOCOL, RelayService, accept_circuit
from meshd.node.wiring import relay_limits
from meshd.relay.client import RelayClient, relay_candidates


class Relaying:
    def __init__(self, settings, host, reach, mesh, dialer, on_change) -> None:
        self.settings, self.host, self.reach, self.mesh = settings, host, reach, mesh
        self.offer = RelayService(host, relay_limits(settings), enabled=self.offering,
                                  own_addrs=lambda: mesh.record.addrs)
        self.reservations = RelayClient(host, settings.relays, connect=dialer.ensure_connected,
                                        candidates=lambda: relay_candidates(mesh.known.values(), mesh.latency,
                                                                            mesh.peer_id, time.time()),
                                        active=self.needs_reservations, on_change=on_change)

    def start(self, nursery) -> None:
        """Serve the relay protocols and keep the reservations (in the daemon's nursery)."""
        if self.settings.relay != "off":
            self.host.set_stream_handler(HOP_PROTOCOL, self.offer.serve_stream)
        self.host.set_stream_handler(STOP_PROTOCOL, self._accept)
        nursery.start_soon(self.reservations.run)

    def offering(self) -> bool:
        """`--relay on`, or `auto` while this daemon is publicly reachable."""
        mode = self.settings.relay
        return mode == "on" or (mode == "auto" and self.reach.summary()["status"] == "public")

    def needs_reservations(self) -> bool:
        return self.settings.relays > 0 and self.reach.summary()["status"] == "private"

    def record_fields(self) -> dict:
        """What the daemon's record says of relaying: whether it offers a relay, and its circuit addresses."""
        return {"relay": self.offering(), "relay_addrs": self.reservations.circuit_addrs()}

    def summary(self) -> dict:
        return {"service": self.offer.summary() if self.settings.relay != "off" else None,
                "client": self.reservations.summary()}

    async def _accept(self, stream) -> None:
        await accept_circuit(self.host, stream, self.reservations.allowed)
