"""An entry's routes: planned from the end of its own layers, then opened, a session on this daemon and
on every hop, for one `Attempt` to drive.

Rules: every open has a deadline (OPEN_TIMEOUT). A hop that cannot open a session fails as `HopFailed`
(the caller reroutes around it); this daemon refusing fails as `GenerationError` (`busy`: the caller
waits). Each hop is told the next one, and passes its output on itself when forwarding is on; the
entry's own outputs then go to the first hop over the service's shared link. Whatever was opened is
released (the local session, a Close on every hop's stream) however the route ends, shielded from
cancellation; a route that finished its generation has every session keep the KV of its tokens, and the
next generation extending them is planned onto it (`Affinity`) and prefills only what no session holds
(`meshd/shard/prefix.py`). A hop that says it leaves has its session's KV handed over to a replica of its
layers, and the next try runs over the same hops with the replica in its place (`meshd/hop/handover.py`). The
hop service, the mesh view and the stream opener are injected, so nothing here knows the `Entry` that uses it.
"""

from __future__ import annotations

import os
import time
from contextlib import asynccontextmanager

import trio

from meshd.entry.affinity import Affinity
from meshd.entry.attempt import Attempt, LinkErrors
from meshd.entry.checks import Exclusions
from meshd.entry.errors import GenerationError, HopFailed, hop_error
from meshd.entry.microbatch import Microbatches
from meshd.entry.policy import Suspects
from meshd.entry.route import Hop, NoRoute, Route, link_latency, plan_around, replaced, route_along
from meshd.entry.state import Generation, open_session
from meshd.core.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.shard import prefix
from meshd.wire import (DEFAULT_CHUNK_TOKENS, DEFAULT_ENCODING, AcceptKV, Close, Error, ErrorCode, HandOver, Heartbeat,
                        Opened, WireError)
from meshd.wire.protocols import SHARD_PROTOCOL

OPEN_TIMEOUT = 30.0  # the longest opening a session (dial, negotiation, answer) or the link to the first hop may take
OPEN_SILENT_S = 3.0  # a hop that echoes no ping within this while it opens a session is frozen: tried no longer
HANDOVER_WAIT_S = 20.0  # the longest an entry waits for a leaving hop's KV to reach its replica
HANDOVER_ROUNDS = 3  # rounds of a hand-over: the KV so far, then what was computed meanwhile
CATCH_UP_MIN = 2 * prefix.BLOCK  # positions worth another round (fewer: the new route computes them)
log = get_logger(__name__)


class Moved:
    """A hop of the route leaves on purpose (`Leaving`): the try ends at a step boundary, and the next one goes
    over `route`, the same hops but the leaving one's replica, which holds the KV it handed over
    (`meshd/hop/handover.py`): only the positions since are computed. With `route` None the hand-over failed
    (`reason`), and the next try is planned without the leaving hop and replays. Not a failure of any hop."""

    def __init__(self, peer_id: str, route=None, positions: int = 0, reason: str = "", tried: bool = True):
        self.peer_id, self.route, self.positions, self.reason = peer_id, route, positions, reason
        self.tried = tried  # a hand-over was tried (False: replaying was as cheap, under a block computed)
        self.channels: dict = {}  # the streams of the hops that stay, each carrying its old session's Close before
        # the next try's OpenSession (so the KV it keeps is there to start from: meshd/entry/opening.py)

    def __str__(self) -> str:
        handed = f"{self.positions} positions handed over" if self.route is not None else None
        return f"hop {self.peer_id[-8:]} leaves: " + (handed or f"hand-over failed ({self.reason})")


class Routes:
    """Plans and opens the routes of the generations that start on one loaded head range: its hop
    `service` runs layers [0, `end`), `mesh` is the view routes are planned on, `open_stream` dials a
    hop. `microbatch_use` and `exclusions` belong to the caller, who reads them too."""

    def __init__(self, service, mesh, open_stream, *, end: int, model_fp: str, recipe_fp: str, forwarding: bool,
                 microbatches: int, microbatch_use: Microbatches, exclusions: Exclusions,
                 affinity: Affinity | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 encoding: str = DEFAULT_ENCODING) -> None:
        self.service, self.mesh, self.open_stream, self.end = service, mesh, open_stream, end
        self.chunk_tokens, self.encoding = chunk_tokens, encoding  # --chunk-tokens, --wire-encoding
        self.model_fp, self.recipe_fp = model_fp, recipe_fp
        self.affinity = affinity  # which route holds which prefix's KV (None: no prefix reuse)
        self.forwarding = forwarding  # ask hops to pass hidden states on themselves (else the entry relays)
        self.microbatches = microbatches  # spread generations over so many, at most one per daemon on the route
        # (0: exactly one per daemon on the route)
        self.microbatch_use, self.exclusions = microbatch_use, exclusions
        self.suspects = Suspects()  # hops that failed a generation lately: later routes avoid them a while

    def root(self, gen: Generation) -> bytes:
        """Where the hash chains of a generation's tokens start (`meshd/shard/prefix.py`)."""
        return prefix.root(self.model_fp, self.recipe_fp, gen.rope_table)

    def plan(self, failed: set[str], busy: set[str], avoid: set[str] = frozenset(), gen: Generation | None = None,
             unreachable: set[str] = frozenset(), weigh=None) -> Route:
        """A route from this entry's layers on, around the hops that failed, those that are full and
        those excluded after a check; through peers in `avoid` only where no other serves the layers.
        With `gen`, the route that kept the KV of the longest prefix of its prompt, where one did and
        all its hops may still be used (affinity: only the new tokens are computed). `weigh` scales each
        peer's cost (`route.spread_weights`: a check's route drawn at random)."""
        coverage = self.mesh.coverage.serving()
        links = link_latency(coverage.records, dict(self.mesh.latency))
        now = time.monotonic()
        excluded, suspects = self.exclusions.active(now), self.suspects.active(now)
        if gen is not None and self.affinity is not None and not avoid:
            spans, tokens = self.affinity.route_for(gen.prefix_asked(self.root(gen)))
            kept = (route_along(coverage, self.end, spans, links, set(failed) | set(busy) | excluded | suspects)
                    if spans else None)
            if kept is not None:
                log.info("routing to the hops that kept this prompt's prefix", tokens=tokens, hops=len(kept.hops))
                return kept
        try:
            route, retried = plan_around(coverage, self.end, links, self.mesh.peer_id, failed, set(busy) | excluded,
                                         set(avoid) | suspects, unreachable, weigh)
        except NoRoute as exc:
            raise GenerationError(ErrorCode.NO_ROUTE, str(exc)) from None
        if retried:
            log.info("retrying a failed hop: no other covers its layers", hops=len(route.hops))
        return route

    @asynccontextmanager
    async def open_route(self, route: Route, epoch: int, req, gen: Generation, sampling, channels: dict | None = None):
        """An `Attempt` with a session open on this daemon and on every hop of `route`, its hops'
        outputs moving (pumps, pings) while the caller drives it; every session released after. The
        sessions open on the generation's RoPE table, the long one once its sequence is past the short.
        `channels`: streams to hops of the route (by peer) to open the sessions on, where a try that ended
        left them (a hand-over's: `Moved.channels`); those not taken are closed."""
        channels = dict(channels or {})
        if gen.take_table():
            log.info("longrope: the sequence is past the short RoPE table; its sessions open on the long table"
                     " and compute it anew", positions=len(gen.prefill_ids), switch=gen.switch,
                     generated=len(gen.tokens))
        sid = os.urandom(16)
        at = Attempt(self.service, gen, sid, epoch, self.chunk_tokens)
        reuse = self.affinity is not None and gen.reuse
        asked = prefix.pack(gen.prefix_asked(self.root(gen))) if reuse else b""
        daemons = len(route.hops) + 1
        microbatch = self.microbatch_use.take(min(self.microbatches, daemons) if self.microbatches else daemons)
        try:
            async with trio.open_nursery() as nursery:
                at.opened_with(await self._open_local(sid, epoch, req, gen, sampling, microbatch, asked))
                for i, hop in enumerate(route.hops):
                    nxt = route.hops[i + 1] if i + 1 < len(route.hops) else None
                    channel, forwards, reused = await self._open_hop(hop, sid, epoch, req, gen, sampling, nxt,
                                                                     microbatch, asked, channels.pop(hop.peer_id, None))
                    at.add_hop(hop.peer_id, channel, forwards)
                    at.opened_with(reused)
                gen.started_from(at.reused or 0)
                if at.hops and self.forwarding:
                    at.linked = await self._link_first_hop(at, route.hops[0])
                for i, (peer, channel) in enumerate(at.hops):
                    nxt = at.hops[i + 1] if i + 1 < len(at.hops) else None
                    nursery.start_soon(at.pump, peer, channel, nxt)
                if at.hops:
                    nursery.start_soon(at.keepalive)
                if at.hops and reuse and gen.check is None and not gen.grammar:
                    nursery.start_soon(self._when_a_hop_leaves, at, route, gen)
                yield at
                nursery.cancel_scope.cancel()
        finally:
            self.microbatch_use.give(microbatch)
            # a route that finished its generation keeps the KV of its tokens on every hop, for a later
            # generation that extends them (a chat's next turn), and so does a route one of whose hops left,
            # handing its KV over (the next route is the same hops but its replica, and starts from it all);
            # any other end frees it
            moving = at.move is not None and at.move.route is not None
            held = gen.prefix_held(self.root(gen)) if reuse and (at.completed and gen.done or moving) else []
            if held and not moving:
                self.affinity.remember(held, route.describe())
            with trio.CancelScope(shield=True):
                await self.service.release((sid, epoch), held)
                staying = {}  # a hand-over's next try opens its sessions on the streams of the hops that stay:
                # each takes this Close (keeping its KV) before that OpenSession, which starts from the KV
                with trio.move_on_after(2.0):
                    for peer, channel in at.hops:
                        try:
                            await channel.send(Close(session_id=sid, epoch=epoch, keep=prefix.pack(held)))
                        except ChannelClosed:
                            continue
                        if moving and peer != at.move.peer_id:
                            staying[peer] = channel
                if moving:
                    at.move.channels = staying
                for peer, channel in at.hops:
                    if peer not in staying:
                        await channel.aclose()
                for channel in channels.values():  # left to this try, and not taken
                    await channel.aclose()

    async def _when_a_hop_leaves(self, at: Attempt, route: Route, gen: Generation) -> None:
        """When a hop of the route says it leaves, have its KV handed over to a replica (`meshd/hop/handover.py`)
        while the generation goes on; the try then ends at the next step boundary (`at.move`) and the next one
        runs over the same hops with the replica in its place, from the KV handed over. If the hand-over fails,
        the next try is planned without the leaving hop and replays (a hop that leaves waits for nobody)."""
        told = 0
        while True:
            while len(at.leaving) <= told:  # the hops that say they leave, each once, as they say it
                await at.left.wait()
            peer, told = at.leaving[told], told + 1
            try:
                move = await self._hand_over(at, route, peer, gen)
            except Exception as exc:  # a replica that cannot be reached or refuses: replay instead
                move = Moved(peer, reason=f"{type(exc).__name__}: {exc}")
            if move is None:  # no replica serves its layers: the generation stays, and the hop waits for it (a drain)
                log.info("a hop leaves, and no other serves its layers: staying on it", peer=peer[-8:])
                continue
            at.move = move
            log.info("a hop leaves: " + ("its KV was handed over" if move.route is not None else "replaying without it"),
                     peer=peer[-8:], positions=move.positions, reason=move.reason or None)
            return

    async def _hand_over(self, at: Attempt, route: Route, peer: str, gen: Generation) -> Moved | None:
        """Ask a replica of leaving hop `peer`'s layers to take its session's KV, and `peer` to send it there
        (None: no replica serves its layers). In rounds: the first sends the KV computed so far while the
        generation goes on; a later one (up to HANDOVER_ROUNDS) what it computed meanwhile, so that the new route
        computes at most a block and a few tokens again, however long the first round took."""
        coverage = self.mesh.coverage.serving()
        links = link_latency(coverage.records, dict(self.mesh.latency))
        new = replaced(coverage, self.end, route, peer, links, {self.mesh.peer_id} | self.exclusions.active(time.monotonic()))
        if new is None:
            return None
        if not gen.prefix_held(self.root(gen)):
            return Moved(peer, reason="under one block computed: replaying is as cheap", tried=False)
        i = next(i for i, h in enumerate(route.hops) if h.peer_id == peer)
        hop, target = route.hops[i], new.hops[i]
        kept = 0
        with trio.fail_after(OPEN_TIMEOUT):  # one stream to the replica for every round's AcceptKV
            replica = Channel.over_libp2p(await self.open_stream(target.peer_id, target.addrs, SHARD_PROTOCOL),
                                          str(SHARD_PROTOCOL), self.encoding)
        try:
            for _ in range(HANDOVER_ROUNDS):
                held = gen.prefix_held(self.root(gen))  # whole blocks of the positions every hop has computed by now
                if kept and len(held) * prefix.BLOCK - kept < CATCH_UP_MIN:
                    break
                done, reason = await self._hand_over_round(at, replica, peer, hop, target, gen, held, kept)
                if done <= 0:  # an earlier round's KV still stands at the replica: the move starts from it
                    if kept:
                        break
                    return Moved(peer, reason=reason)
                kept = done
        finally:
            with trio.CancelScope(shield=True):
                await replica.aclose()
        return Moved(peer, new, kept)

    async def _hand_over_round(self, at: Attempt, replica: Channel, peer: str, hop: Hop, target: Hop,
                               gen: Generation, held: list[bytes], start: int) -> tuple[int, str]:
        """One round of a hand-over: positions [start, len(held) blocks) from `peer` to `target` (its stream:
        `replica`), which has the first `start` kept already. The positions the replica keeps now (0: the round
        failed), and why not."""
        ticket, positions = os.urandom(16), len(held) * prefix.BLOCK
        await replica.send(AcceptKV(ticket=ticket, sender=peer, start=hop.start, end=hop.end,
                                    rope_table=gen.rope_table, positions=positions, chain=prefix.pack(held),
                                    model_fingerprint=self.model_fp, recipe_fingerprint=self.recipe_fp, held=start))
        reply = await replica.receive(OPEN_TIMEOUT)
        if not isinstance(reply, Opened):
            return 0, f"its replica refused: {getattr(reply, 'message', type(reply).__name__)}"
        at.handed.pop(peer, None)
        await at.hops[at.index(peer)][1].send(HandOver(session_id=at.sid, epoch=at.epoch, peer=target.peer_id,
                                                       addrs=" ".join(target.addrs), ticket=ticket,
                                                       positions=positions, held=start))
        done = await at.handed_over(peer, HANDOVER_WAIT_S)
        if done is None or done.ticket != ticket or done.positions <= 0:
            return 0, done.reason if done is not None else "no answer in time"
        return done.positions, ""

    def _open_msg(self, sid, epoch, start, end, req, gen: Generation, sampling, nxt=None, microbatch=0, asked=b""):
        forward = nxt is not None and self.forwarding
        # the grammar goes to the session that samples, and to the head, whose frames then carry their ids to it
        grammar = gen.grammar if start == 0 or nxt is None else ""
        return open_session(req.request_id, sid, epoch, start, end, self.model_fp, self.recipe_fp, gen.max_length,
                            sampling, next_peer=nxt.peer_id if forward else "",
                            next_addrs=" ".join(nxt.addrs) if forward else "", microbatch=microbatch,
                            rope_table=gen.rope_table, prefix_chain=asked, grammar=grammar,
                            grammar_from=len(gen.ids))

    async def _open_local(self, sid, epoch, req, gen, sampling, microbatch=0, asked=b"") -> int:
        """The session on this daemon's own layers: the prompt positions it holds already."""
        reply = await self.service.handle(self._open_msg(sid, epoch, 0, self.end, req, gen, sampling,
                                                         microbatch=microbatch, asked=asked))
        if not isinstance(reply[0], Opened):
            raise GenerationError(reply[0].code, reply[0].message)  # `busy`: waited on by generate
        return reply[0].reused

    async def _open_hop(self, hop, sid, epoch, req, gen, sampling, nxt=None, microbatch=0, asked=b"", channel=None
                        ) -> tuple[Channel, bool, int]:
        """A session on a hop (on `channel`, a stream to it already open, else a new one): its stream, whether the
        hop sends its output on to `nxt` itself, and the prompt positions it holds already."""
        try:
            with trio.fail_after(OPEN_TIMEOUT):
                if channel is None:
                    stream = await self.open_stream(hop.peer_id, hop.addrs, SHARD_PROTOCOL)
                    channel = Channel.over_libp2p(stream, str(SHARD_PROTOCOL), self.encoding)
                await channel.send(self._open_msg(sid, epoch, hop.start, hop.end, req, gen, sampling, nxt, microbatch,
                                                  asked))
                reply = await _answer_of_a_live_hop(channel, sid)
        except (trio.TooSlowError, ChannelClosed, WireError, OSError) as exc:
            raise HopFailed(hop.peer_id, f"could not open a session: {str(exc) or type(exc).__name__}",
                            opening=True) from None
        except Exception as exc:  # libp2p dial and negotiation errors
            raise HopFailed(hop.peer_id, f"could not open a session: {type(exc).__name__}: {exc}", opening=True) from None
        if isinstance(reply, Error):
            raise hop_error(hop.peer_id, reply)
        if not isinstance(reply, Opened):
            raise HopFailed(hop.peer_id, f"answered OpenSession with {type(reply).__name__}")
        if not 0 <= reply.reused <= len(asked) // prefix.HASH_BYTES * prefix.BLOCK:  # more than it was asked for
            raise HopFailed(hop.peer_id, f"claims to hold {reply.reused} positions of a prefix of {len(asked)} bytes")
        self.suspects.answered(hop.peer_id)
        return channel, reply.forwarding and nxt is not None, reply.reused

    async def _link_first_hop(self, at: Attempt, hop: Hop) -> bool:
        """Whether the entry's own outputs go to the first hop the way hops send theirs: with those of
        the other generations of the same pass, as one frame on one link (see `meshd/hop/links.py`). A
        link that breaks reports to the attempt, as an Error from the first hop (`LinkErrors`)."""
        try:
            with trio.fail_after(OPEN_TIMEOUT):
                await self.service.forward_outputs((at.sid, at.epoch), hop.peer_id, hop.addrs,
                                                   LinkErrors(at.tokens_send))
        except Exception as exc:  # the session stream still works: send on it instead
            log.info("no link to the first hop, sending on the session stream", peer=hop.peer_id[-8:],
                     error=f"{type(exc).__name__}: {exc}")
            return False
        return True


async def _answer_of_a_live_hop(channel: Channel, sid: bytes = b""):
    """A hop's answer to the OpenSession (of session `sid`) just sent: a ping goes after it, which a live hop's
    reader echoes at once however busy its compute thread is; a hop that echoes nothing within OPEN_SILENT_S is
    frozen (SIGSTOP), and fails the open (TooSlowError) rather than holding it until it thaws. A live one is given
    OPEN_TIMEOUT. What a stream carried over from an ended session still brings of it is passed over."""
    await channel.send(Heartbeat(seq=0))
    deadline, alive = trio.current_time() + OPEN_TIMEOUT, False
    while True:
        wait = deadline - trio.current_time() if alive else OPEN_SILENT_S
        msg = await channel.receive(max(0.0, wait))
        if isinstance(msg, Heartbeat):
            alive = True
        elif not sid or getattr(msg, "session_id", sid) in (sid, b""):
            return msg

