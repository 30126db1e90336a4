"""A mesh of daemons behind NAT on network test hosts, for tests and benches: public bootstrap/relay
daemons without layers (pub0, pub1, ...), and one home daemon per range behind its own router."""

from __future__ import annotations

from meshd.cli.localmesh import Mesh

PORT = 4690


def start_nat_mesh(bed, mesh: Mesh, ranges, relays: int, extra=(), threads: int = 1, homes_on_any: bool = False,
                   pub_extra=()):
    """Start `relays` public daemons (`--layers none`, listening on 0.0.0.0, each bootstrapping from
    the earlier ones) and one home daemon per range (listening on its LAN address, or with
    `homes_on_any` on 0.0.0.0, the default of `meshd join`); returns (public statuses, home DaemonProcs).
    `extra` goes to the homes' command lines, `pub_extra` to the public daemons'."""
    pubs = []
    for i in range(relays):
        boot = [a for p in pubs for a in ("--bootstrap", p["addrs"][0])]
        d = mesh.start(f"pub{i}", ["--layers", "none", *boot, *pub_extra], wrap=bed.wrap(f"pub{i}"), listen=f"/ip4/0.0.0.0/tcp/{PORT}")
        pubs.append(d.wait_serving())
    boot = [a for p in pubs for a in ("--bootstrap", p["addrs"][0])]
    homes = [mesh.start(f"home{i}", ["--layers", f"{a}:{b}", "--threads", str(threads), *boot, *extra],
                        wrap=bed.wrap(f"home{i}"),
                        listen=f"/ip4/{'0.0.0.0' if homes_on_any else bed.addr(f'home{i}')}/tcp/{PORT}")
             for i, (a, b) in enumerate(ranges)]
    return pubs, homes


def covered_through_relays(relays: int, ranges: int):
    """A status predicate: serving, the coverage complete, this daemon private with `relays`
    reservations, and every other home known, serving and reached through circuit addresses."""
    def ok(s) -> bool:
        peers = [p for p in s["peers"] if p["range"][0] != p["range"][1]]
        client = (s.get("relay") or {}).get("client") or {}
        return (s["state"] == "serving" and s["complete"] and s["reachability"]["status"] == "private"
                and len(client.get("relays") or ()) == relays
                and len(peers) == ranges - 1 and all(p["serving"] and p["relay_addrs"] for p in peers))
    return ok
