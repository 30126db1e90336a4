"""The daemon's HTTP front door: an OpenAI-compatible API, the dashboard, health and Prometheus metrics.

Rules: served by hypercorn inside the daemon's own trio loop (no second process, no thread per
request), as a bare ASGI app; every generation goes through the same `generate` as the control
socket, so forwarding to a remote entry, rerouting and KV release behave alike; a chat answer that may
hold tool calls is split into text and calls as it streams (`meshd/api/toolcalls.py`). A client that
disconnects cancels its generation. With a token set, every route but /healthz and the dashboard's
files (which hold nothing of the mesh; `meshd/api/dashboard.py`) needs `Authorization: Bearer <token>`.
The app knows its daemon only through `Served`: the model's name and limits, and three live readings.
"""

from __future__ import annotations

import hmac
import logging
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from meshd.api import dashboard, openai, structured, toolcalls
from meshd.entry.errors import GenerationError, ended_normally
from meshd.core.log import get_logger
from meshd.wire import ErrorCode, StreamEvent

MAX_BODY = 1 << 20
log = get_logger(__name__)


class Stopped(Exception):
    """A stop sequence ended the answer: the generation is cancelled, the answer is complete."""

    ends_generation_normally = True


@dataclass(frozen=True)
class Served:
    """What the HTTP front door asks of its daemon (meshd/node/daemon.py fills it in)."""

    model: str  # the model's name, as /v1/models and answers give it
    max_positions: int
    chat_template: str  # read at start, before a daemon without layer 0 drops its tokenizer's metadata
    started_at: float  # unix time
    status: Callable[[], dict]  # what `meshctl status --json` prints
    state: Callable[[], str]  # "" while it takes new work, else where it stands (draining, ...)
    gaps: Callable[[], list]  # layer ranges no live daemon serves


class HttpApi:
    def __init__(self, served: Served, generate, metrics, token: str = "") -> None:
        """`generate(request, emit) -> stats` runs or forwards one generation (the control server's)."""
        self.served, self.generate, self.metrics, self.token = served, generate, metrics, token
        self.tool_format = structured.tool_format(served.chat_template)  # how the model writes tool calls

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        page = dashboard.asset(path) if method == "GET" else None
        if page is not None:
            return await self._send(send, 200, *page, dashboard.HEADERS)
        if path != "/healthz" and self.token and not self._authorized(scope):
            return await self._json(send, 401, openai.error_body("missing or wrong bearer token",
                                                                 "authentication_error", "invalid_api_key"))
        if method == "GET" and path == "/healthz":
            state = self.served.state()
            return await self._json(send, 503 if state else 200, {"status": state or "ok"})
        if method == "GET" and path == "/metrics":
            body, ctype = self.metrics.exposition()
            return await self._send(send, 200, body, ctype)
        if method == "GET" and path == "/v1/meshd/status":  # what `meshctl status --json` prints
            return await self._json(send, 200, self.served.status(), [(b"cache-control", b"no-store")])
        if method == "GET" and path == "/v1/models":
            return await self._json(send, 200, self._models())
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            return await self._complete(receive, send, chat=path.endswith("chat/completions"))
        await self._json(send, 404, openai.error_body(f"no route {method} {path}", "invalid_request_error"))

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                return hmac.compare_digest(value, b"Bearer " + self.token.encode())
        return False

    def _models(self) -> dict:
        st = self.served.status()
        return {"object": "list", "data": [{
            "id": st["model"], "object": "model", "created": int(self.served.started_at), "owned_by": "meshd",
            "meshd": {"route_complete": st["complete"], "uncovered": st["gaps"], "n_layers": st["n_layers"],
                      "recipe": st["recipe"]}}]}

    async def _complete(self, receive, send, chat: bool) -> None:
        try:
            body = await self._body(receive)
            c = openai.parse_request(body, chat, self.served.model, self.served.max_positions,
                                     secrets.randbits(53) or 1, self.tool_format)
        except openai.BadRequest as exc:
            return await self._json(send, 400, openai.error_body(str(exc), "invalid_request_error"))
        gaps = self.served.gaps()
        if gaps:
            where = ", ".join(f"[{a}, {b})" for a, b in gaps)
            return await self._json(send, 503, openai.error_body(f"no route: layers {where} are not served by any"
                                                                 " live daemon", "service_unavailable", "no_route"))
        with structlog.contextvars.bound_contextvars(request_id=c.request.request_id):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                if c.stream:
                    await self._stream(c, send)
                else:
                    await self._whole(c, send)
                nursery.cancel_scope.cancel()

    async def _watch_disconnect(self, receive, scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        log.info("http client disconnected; generation cancelled")
        scope.cancel()

    async def _run(self, c: openai.Completion, on_text, on_call=None, on_check=None) -> tuple[dict, bool,
                                                                                           list[toolcalls.Call]]:
        """Generate, passing stop-cut text to on_text and tool call events (`CallBegun`, `Arguments`) to
        on_call, and a checked generation's news to on_check: ("verified", tokens checked) and ("retract",
        characters of the text given so far that stand); returns (stats, stopped by a stop sequence, the tool
        calls)."""
        scanner = openai.StopScanner(c.stop)
        splitter = toolcalls.CallSplitter(c.tools.fmt) if c.tools is not None and c.tools.may_call else None
        stats: dict = {"tokens": 0}
        raw: list[str] = []  # the generation's text as it came (before stop sequences cut it)
        given = 0  # characters of the stop-cut text given to on_text
        out = 0  # characters the scanner has let through (after a retraction, from the text that stands)

        async def give(piece: str) -> None:
            """The scanner let `piece` through: the part the client does not hold yet goes to it; a stop found
            before the end of what it holds (after a retraction) takes the rest back."""
            nonlocal given, out
            fresh = piece[max(0, given - out):]
            out += len(piece)
            if fresh:
                given += len(fresh)
                await on_text(fresh)
            if scanner.stopped and out < given and on_check is not None:
                given = out
                await on_check("retract", out)

        async def tell(events: list) -> None:
            for e in events:
                if not isinstance(e, toolcalls.Content):
                    if on_call is not None:
                        await on_call(e)
                    continue
                await give(scanner.push(e.text))

        async def retract(keep: int) -> None:
            """A check took back the text from character `keep` on: what was given past it is taken back, and the
            text that stands goes through a new scanner (a stop sequence may begin in it), giving only what the
            client does not hold yet."""
            nonlocal scanner, given, raw, out
            if splitter is not None and splitter.calls:
                raise GenerationError(ErrorCode.HOP_FAILED, "a check took back text that was given as a tool call:"
                                      " ask again")
            raw = ["".join(raw)[:keep]]
            if keep < given and on_check is not None:
                await on_check("retract", keep)
            given, out = min(given, keep), 0
            scanner = openai.StopScanner(c.stop)
            await tell([toolcalls.Content(raw[0])])

        async def emit(event: StreamEvent) -> None:
            if event.kind == "verified":
                if on_check is not None:
                    await on_check("verified", event.stats.get("verified_through", 0))
                return
            if event.kind == "retract":
                stats["tokens"] = event.stats.get("tokens", 0)
                return await retract(int(event.stats.get("keep_chars", 0)))
            raw.append(event.text)
            stats["tokens"] = event.stats.get("tokens", stats["tokens"] + 1)  # a text may hold several tokens
            for key in ("prompt_tokens", "cached_tokens"):  # the first text's: the usage of an answer a stop
                if key in event.stats:  # sequence cut (the generation's own stats never come back then)
                    stats[key] = event.stats[key]
            await tell(splitter.push(event.text) if splitter is not None else [toolcalls.Content(event.text)])
            if scanner.stopped:
                raise Stopped

        try:
            stats = await self.generate(c.request, emit)
        except BaseException as exc:  # a stop sequence may come back wrapped in the entry's task groups
            if not ended_normally(exc):
                raise
        if splitter is not None:
            await tell(splitter.finish())
        await give(scanner.flush())
        return stats, scanner.stopped, splitter.calls if splitter is not None else []

    async def _whole(self, c: openai.Completion, send) -> None:
        parts: list[str] = []

        async def collect(piece: str) -> None:
            parts.append(piece)

        async def checked(news: str, n: int) -> None:
            if news == "retract":  # the answer keeps the first n characters of what it was given
                parts[:] = ["".join(parts)[:n]]

        try:
            stats, stopped, calls = await self._run(c, collect, on_check=checked)
        except GenerationError as exc:
            status, body = self._error(exc)
            # a full mesh: clients (the openai library among them) back off and retry on 429 + Retry-After
            retry = [(b"retry-after", b"1")] if exc.code == ErrorCode.BUSY else []
            return await self._json(send, status, body, retry)
        reason = openai.finish_reason(stopped, stats, c.request.max_tokens, called=bool(calls))
        await self._json(send, 200, openai.answer(c, "".join(parts), reason, stats, [x.whole() for x in calls]))

    async def _stream(self, c: openai.Completion, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})

        async def event(obj) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        async def call_piece(e) -> None:
            first = isinstance(e, toolcalls.CallBegun)
            delta = (openai.call_delta(e.call.index, "", e.call.id, e.call.name) if first
                     else openai.call_delta(e.call.index, e.text))
            await event(openai.chunk(c, None, calls=[delta]))

        if c.chat:  # an answer that may be tool calls has no content until text comes
            delta = {"role": "assistant", "content": None if c.tools is not None and c.tools.may_call else ""}
            await event(openai.chunk(c, "") | {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        async def checked(news: str, n: int) -> None:
            """A checked generation's news, which OpenAI's stream has no place for: how far the text is checked as
            an SSE comment (clients skip it); a retraction as an event of its own (`meshd.retract`: the characters
            of the text streamed so far that stand; the text goes on from there)."""
            if news == "verified":
                await send({"type": "http.response.body", "body": f": verified_through {n}\n\n".encode(),
                            "more_body": True})
            else:
                body = json.dumps({"keep_chars": n, "reason": "a check found the text after it wrong"})
                await send({"type": "http.response.body", "body": f"event: meshd.retract\ndata: {body}\n\n".encode(),
                            "more_body": True})

        try:
            stats, stopped, calls = await self._run(c, lambda piece: event(openai.chunk(c, piece)), call_piece,
                                                    checked)
            reason = openai.finish_reason(stopped, stats, c.request.max_tokens, called=bool(calls))
            await event(openai.chunk(c, None, reason, stats))
        except GenerationError as exc:
            status, body = self._error(exc)
            await event(body)
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _error(exc: GenerationError) -> tuple[int, dict]:
        status = openai.HTTP_STATUS.get(exc.code, 500)
        kind = {400: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(status,
                                                                                                       "server_error")
        return status, openai.error_body(str(exc), kind, str(exc.code))

    @staticmethod
    async def _body(receive) -> bytes:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > MAX_BODY:
                raise openai.BadRequest(f"the body exceeds {MAX_BODY} bytes")
            if not msg.get("more_body"):
                return body

    async def _json(self, send, status: int, obj, headers: list | None = None) -> None:
        await self._send(send, status, json.dumps(obj).encode(), "application/json", headers)

    @staticmethod
    async def _send(send, status: int, body: bytes, ctype: str, headers: list | None = None) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode()),
                                *(headers or [])]})
        await send({"type": "http.response.body", "body": body})


async def serve_http(app: HttpApi, bind: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on `bind` ("host:port") until cancelled; task_status gets the bound addresses."""
    config = Config()
    config.bind = [bind]
    config.accesslog = None
    config.errorlog = logging.getLogger("meshd.http")  # an app error reaches the daemon's log
    config.graceful_timeout = 1.0
    await serve(app, config, task_status=task_status)


def check_bind(bind: str) -> str:
    """A "host:port" to serve on; refuses what is not one."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--http wants HOST:PORT (e.g. 127.0.0.1:8080), not {bind!r}")
    return bind

