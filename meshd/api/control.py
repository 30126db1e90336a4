"""The local control socket, and generation requests arriving from other daemons.

Rules: the socket is created with mode 0600 (only the daemon's user may talk to it) and removed
when the daemon stops; it speaks meshd.wire frames: `StatusRequest` gets one "status" event,
`LedgerRequest` one "ledger" event (the work ledger's totals), `GenerateRequest` "text" events then
one "done" or "error". A client that goes away cancels its generation, which releases the KV on
every hop. A daemon without layer 0 forwards generation
requests to an entry it finds in the coverage map.

The server knows its daemon only through `Controls`, the few things it asks of it, and keeps the
counts it changes itself (generations running, forwarded answers not yet out): a drain reads `idle`.
"""

from __future__ import annotations

import os
import socket as stdlib_socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog
import trio

from meshd.entry.errors import GenerationError
from meshd.entry.handoff import hand_off
from meshd.wire.protocols import GEN_PROTOCOL
from meshd.core.log import get_logger
from meshd.p2p.channel import Channel, ChannelClosed
from meshd.wire import (DrainRequest, ErrorCode, GenerateRequest, LedgerRequest, StatusRequest, StreamEvent,
                        WireError)

REQUEST_TIMEOUT = 30.0
log = get_logger(__name__)


class Stage(Protocol):
    """Where the daemon stands, as far as requests care (meshd/node/lifecycle.py's `Lifecycle`)."""

    @property
    def accepts_generations(self) -> bool: ...
    @property
    def takes_new_work(self) -> bool: ...


@dataclass(frozen=True)
class Controls:
    """What the control socket asks of its daemon, and nothing more (meshd/node/daemon.py fills it in)."""

    stage: Stage
    status: Callable[[], dict]
    ledger_totals: Callable[[float | None, str | None], dict]
    drain: Callable[[str, float | None], Awaitable[None]]  # reason, timeout (None: as long as it takes)
    stop: Callable[[str], None]  # thread-safe: the daemon drains and leaves
    drain_timeout_s: float
    observe: Callable[..., Awaitable[dict]]  # counts and times one generation (meshd/api/metrics.py)
    entry: Callable[[], Any]  # the entry that runs generations here now (None: no layer 0 here)
    choose_entry: Callable[..., Any]  # where a generation this daemon cannot run is handed (policy.choose_entry)
    open_stream: Callable[..., Awaitable[Any]]


class ControlServer:
    def __init__(self, controls: Controls, path: Path) -> None:
        self.controls, self.path = controls, Path(path)
        self.generations = 0  # generations running or forwarded from here now
        self.answering = 0  # generations other daemons forwarded here whose answer is not yet out

    @property
    def idle(self) -> bool:
        """No generation runs here and every forwarded answer is out (what a drain waits for)."""
        return self.generations == 0 and self.answering == 0

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            self._remove_stale()
        sock = trio.socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        sock.listen(64)
        listener = trio.SocketListener(sock)
        try:
            task_status.started()
            await trio.serve_listeners(self._serve_client, [listener])
        finally:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _remove_stale(self) -> None:
        probe = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink()  # nobody listens: a leftover of a daemon that died
            return
        finally:
            probe.close()
        raise OSError(f"another daemon is already listening on {self.path}")

    async def _serve_client(self, stream: trio.SocketStream) -> None:
        channel = Channel.over_trio(stream)
        try:
            msg = await channel.receive(REQUEST_TIMEOUT)
            if isinstance(msg, StatusRequest):
                await channel.send(StreamEvent(request_id=msg.request_id, kind="status", stats=self.controls.status()))
            elif isinstance(msg, DrainRequest):
                await self._drain(channel, msg)
            elif isinstance(msg, LedgerRequest):
                totals = await trio.to_thread.run_sync(self.controls.ledger_totals, msg.since or None, msg.peer or None)
                await channel.send(StreamEvent(request_id=msg.request_id, kind="ledger", stats=totals))
            elif isinstance(msg, GenerateRequest):
                await self._generate_for(channel, msg, watch_client=True)
            else:
                await channel.send(error_event(0, ErrorCode.BAD_FRAME, f"unexpected {type(msg).__name__}"))
        except (ChannelClosed, trio.TooSlowError, WireError):
            pass
        except Exception as exc:  # noqa: BLE001 -- one request's bug must not take the daemon and its socket down
            await self._internal_error(channel, exc)
        finally:
            await channel.aclose()

    @staticmethod
    async def _internal_error(channel: Channel, exc: Exception) -> None:
        """A request failed in a way nothing expected: logged with its traceback, its client told."""
        log.exception("a request failed unexpectedly; the daemon serves on", error=repr(exc))
        with trio.CancelScope(shield=True):
            try:
                await channel.send(error_event(0, ErrorCode.INTERNAL, f"internal error: {exc!r}"))
            except Exception:  # noqa: BLE001 -- the client may be gone too
                pass

    async def _drain(self, channel: Channel, msg: DrainRequest) -> None:
        """Drain (and with `exit`, then stop); answers with the status once nothing runs here."""
        c = self.controls
        if not c.stage.accepts_generations:
            await channel.send(error_event(msg.request_id, ErrorCode.BUSY, f"this daemon is {c.stage}, not serving"))
            return
        if msg.exit:
            c.stop("meshctl drain --exit")
        await c.drain("meshctl drain", c.drain_timeout_s if msg.exit else None)
        await channel.send(StreamEvent(request_id=msg.request_id, kind="status", stats=c.status()))

    async def serve_remote_generate(self, stream) -> None:
        """/meshd/gen/1.0.0: another daemon forwards its client's request to this entry."""
        channel = Channel.over_libp2p(stream, str(GEN_PROTOCOL))
        self.answering += 1  # a drain waits for the answer to be out, not only computed
        try:
            msg = await channel.receive(REQUEST_TIMEOUT)
            if isinstance(msg, GenerateRequest):
                await self._generate_for(channel, msg, watch_client=True)
        except (ChannelClosed, trio.TooSlowError, WireError):
            pass
        except Exception as exc:  # noqa: BLE001 -- as for the local socket: the daemon serves on
            await self._internal_error(channel, exc)
        finally:
            with trio.CancelScope(shield=True):
                await channel.aclose()
            self.answering -= 1

    async def _generate_for(self, channel: Channel, req: GenerateRequest, watch_client: bool) -> None:
        """Run (or forward) one generation, streaming events; cancelled if the client goes away."""
        async def emit(event: StreamEvent) -> None:
            await channel.send(event)

        answered = trio.Event()  # after the last frame, the client closing is the normal end
        with structlog.contextvars.bound_contextvars(request_id=req.request_id):
            async with trio.open_nursery() as nursery:
                if watch_client:
                    nursery.start_soon(self._watch, channel, nursery.cancel_scope, answered)
                try:
                    stats = await self.generate(req, emit)
                    answered.set()
                    await channel.send(StreamEvent(request_id=req.request_id, kind="done", stats=stats))
                except GenerationError as exc:
                    answered.set()
                    await channel.send(error_event(req.request_id, exc.code, str(exc)))
                except ChannelClosed:
                    log.info("client went away; generation cancelled")
                nursery.cancel_scope.cancel()

    async def _watch(self, channel: Channel, scope: trio.CancelScope, answered: trio.Event) -> None:
        """Cancel the generation when the client's side of the stream ends before its answer."""
        try:
            while True:
                await channel.receive(1e9)
        except (ChannelClosed, WireError, trio.TooSlowError):
            if not answered.is_set():
                log.info("client disconnected; generation cancelled")
            scope.cancel()

    async def generate(self, req: GenerateRequest, emit) -> dict:
        """Run this daemon's part of one generation, or forward it to an entry; counted in metrics.
        Every front door (this socket, forwarded requests, HTTP) comes through here."""
        return await self.controls.observe(self._generate, req, emit)

    async def _generate(self, req: GenerateRequest, emit) -> dict:
        c = self.controls
        if not c.stage.accepts_generations:
            raise GenerationError(ErrorCode.BUSY, f"this daemon is {c.stage}, not serving yet")
        self.generations += 1
        try:
            entry = c.entry()
            if entry is not None and c.stage.takes_new_work:  # a draining entry passes new work on
                return await entry.generate(req, emit)
            return await hand_off(req, emit, c.choose_entry, c.open_stream)
        finally:
            self.generations -= 1


def error_event(request_id: int, code: str, message: str) -> StreamEvent:
    return StreamEvent(request_id=request_id, kind="error", text=message, stats={"code": str(code)})
