"""An auto daemon's side of rebalancing: settle a fresh claim, then move when the plan says so.

Rules: the decisions are `meshd.dht.moves`'s pure plan; this module only times and applies
them. A claim (layers chosen, nothing loaded) is re-checked after a short random delay and moved
at once when it collides. A serving daemon moves only when the plan has named it with the same
target in every round for `PERSIST_ROUNDS` rounds and at least one record TTL (a starved peer can
miss a refresh and look dead for a moment) and still does after a random wait, and then not again
for `--move-cooldown` seconds (its record says it stays put meanwhile, so the others plan without
it). A move loads the new range while the old one serves, then hands it to the daemon, whose
lifecycle switches new sessions to it, announces it, and lets the old range go through the daemon's
one drain (`Placed.move_to`); with `--memory`, both ranges must fit in it for that moment, or the
daemon stays (and plans go without it until its cooldown ends).
"""

from __future__ import annotations

import random
import time
from typing import Protocol

import trio

from meshd.dht.placement import place
from meshd.dht.moves import Move, Persistence, own_move, still_named, takes_part
from meshd.dht.view import MeshView
from meshd.core.log import get_logger
from meshd.shard.footprint import MemoryRefused, weight_bytes

SETTLE_S = (0.5, 2.0)  # random wait before re-checking a fresh claim
SETTLE_ROUNDS = 6  # re-checks of a claim at most; then it is loaded as it stands
REBALANCE_PERIOD_S = 2.0
PERSIST_ROUNDS = 3  # rounds in a row the plan must name this daemon before it moves (and one record TTL)
MOVE_JITTER_S = (0.0, 2.0)
AUTO_SETTLE_S = 3.0  # how long a joining node watches the mesh before choosing its layers
log = get_logger(__name__)


async def choose_first_range(mesh: MeshView, want: int, artifact, recipe, memory: int | None) -> tuple[int, int]:
    """Coverage first: watch the mesh briefly, then take the largest gap `want` layers can fill."""
    with trio.move_on_after(AUTO_SETTLE_S):
        for _ in range(3):
            await mesh.refresh()
            await trio.sleep(0.5)
    coverage = mesh.coverage.without(mesh.peer_id)
    start, end = place(coverage, want, artifact, recipe, memory)
    log.info("layers chosen", start=start, end=end, gaps=coverage.gaps(), counts=coverage.counts())
    return start, end


class Placed(Protocol):
    """What the rebalancer needs of its daemon (`meshd/node/daemon.py` implements it)."""

    mesh: MeshView
    settings: object  # move_cooldown, memory
    lifecycle: object  # may_move
    slot: object  # the serving slot: shard.start, shard.end
    artifact: object
    recipe: object

    def fit(self, start: int, end: int) -> tuple[int, int]: ...
    async def open_range(self, start: int, end: int): ...
    async def move_to(self, slot) -> None: ...
    async def forget(self) -> None: ...


class Rebalancer:
    def __init__(self, daemon: Placed, want: int) -> None:
        self.daemon = daemon
        self.want = want  # layers this daemon serves when it chooses (its record's auto_layers)
        self.cooldown_until = 0.0  # trio time
        self.last_move: dict | None = None  # for status: from, to, when, why
        self.moving: Move | None = None

    @property
    def mesh(self):
        return self.daemon.mesh

    async def settle_claim(self) -> tuple[int, int]:
        """Re-check a published claim until no other claim collides with it; the range to load."""
        for _ in range(SETTLE_ROUNDS):
            await trio.sleep(random.uniform(*SETTLE_S))
            await self.mesh.refresh()
            move = own_move(self.mesh.coverage, self.mesh.peer_id)
            if move is None:
                break
            start, end = self.daemon.fit(*move.to)
            log.info("claim moved", layers=f"{start}:{end}", was=f"{move.start}:{move.end}", why=move.reason)
            await self.mesh.publish(start=start, end=end)
        return self.mesh.record.start, self.mesh.record.end

    async def run(self) -> None:
        """While serving: apply this daemon's line of the plan, with hysteresis (`Persistence`)."""
        persist = Persistence(PERSIST_ROUNDS, self.mesh.ttl_s)
        while True:
            await trio.sleep(REBALANCE_PERIOD_S)
            if not takes_part(self.daemon.lifecycle.may_move, trio.current_time(), self.cooldown_until):
                persist.reset()
                continue
            if self.mesh.record.auto_layers == 0:  # the cooldown is over: take part in plans again
                await self.mesh.publish(auto_layers=self.want)
            move = persist.observe(own_move(self.mesh.coverage, self.mesh.peer_id), trio.current_time())
            if move is None:
                continue
            aim = move.to
            await trio.sleep(random.uniform(*MOVE_JITTER_S))
            await self.mesh.refresh()
            move = own_move(self.mesh.coverage, self.mesh.peer_id)
            if still_named(move, aim) and self.daemon.lifecycle.may_move:
                await self.move(move)

    async def move(self, move: Move) -> None:
        """Serve `move.to` instead of this daemon's range: load it here, then the daemon switches to it."""
        d = self.daemon
        start, end = d.fit(*move.to)
        self.moving = move
        self.cooldown_until = trio.current_time() + d.settings.move_cooldown
        log.info("moving", layers=f"{start}:{end}", was=f"{move.start}:{move.end}", why=move.reason)
        try:
            now = (d.slot.shard.start, d.slot.shard.end)
            both = sum(weight_bytes(d.artifact, d.recipe, *r) for r in (now, (start, end)))
            if d.settings.memory and both > d.settings.memory:
                raise MemoryRefused(f"both ranges need {both / 1e6:.0f} MB for a moment, more than --memory allows")
            loaded = await d.open_range(start, end)
        except Exception as exc:  # no memory for a second shard, most likely: stay, and out of plans for a while
            log.warning("move failed; staying", layers=f"{start}:{end}", error=str(exc) or type(exc).__name__)
            self.moving = None
            await self.mesh.publish(auto_layers=0)  # so that another daemon is named for the gap meanwhile
            return
        if not d.lifecycle.may_move:  # it began leaving while the range loaded: the drain has the old one
            self.moving = None
            del loaded
            await d.forget()
            return
        await d.move_to(loaded)  # new sessions come to the new range; the old one's leave it through the drain
        self.last_move = {"from": [move.start, move.end], "to": [start, end], "at": time.time(),
                          "reason": move.reason}
        self.moving = None
        log.info("moved", layers=f"{start}:{end}", was=f"{move.start}:{move.end}", why=move.reason)

    def summary(self) -> str:
        """The `moved` line of `meshctl status` ("" before the first move)."""
        m = self.last_move
        if m is None:
            return f"moving {self.moving.describe()}" if self.moving else ""
        at = time.strftime("%H:%M:%S", time.localtime(m["at"]))
        return f"{m['from'][0]}:{m['from'][1]} -> {m['to'][0]}:{m['to'][1]} at {at}: {m['reason']}"
