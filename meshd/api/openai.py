"""The OpenAI API's shapes, without I/O: requests checked into `GenerateRequest`s, answers built.

Rules: a request is refused (`BadRequest`, HTTP 400 with the OpenAI error shape) before anything is
generated when it is malformed, names another model, asks for more tokens than the context holds, uses
a parameter outside its range, or asks for a structured answer that cannot be enforced (a bad schema, a
bad tool or tool_choice: `meshd/api/structured.py`, `meshd/api/tools.py`); stop sequences are cut here
(`StopScanner`) from the answer's text (not from tool calls), so no client ever sees a stop string or a
piece of one. An answer cut short by max_tokens ends with finish_reason "length", never "stop" or
"tool_calls": its JSON or call may be unfinished.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from meshd.api import structured, tools
from meshd.api.structured import PLAIN, ToolFormat
from meshd.api.tools import ToolUse
from meshd.wire import ErrorCode, GenerateRequest

MAX_STOP = 4
HTTP_STATUS = {ErrorCode.BAD_FRAME: 400, ErrorCode.BUSY: 429, ErrorCode.NO_ROUTE: 503}


class BadRequest(ValueError):
    """The request cannot be served as sent (HTTP 400)."""


@dataclass
class Completion:
    """One request, checked: what to generate and how to answer."""

    request: GenerateRequest
    chat: bool
    stream: bool
    stop: list[str]
    model: str
    tools: ToolUse | None = None  # a chat request's tools (their calls are split off the text: toolcalls.py)
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, key: str, default, lo, hi, kind=float):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise BadRequest(f"'{key}' must be a number")
    if not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be within [{lo}, {hi}], not {value}")
    return kind(value)


def parse_request(raw: bytes, chat: bool, model: str, context: int, request_id: int,
                  tool_format: ToolFormat = PLAIN) -> Completion:
    """A /v1/chat/completions (chat) or /v1/completions body, checked against this mesh's model (whose chat
    template writes tool calls as `tool_format` says)."""
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    asked = body.get("model") or model
    if asked != model:
        raise BadRequest(f"model {asked!r} is not served here; this mesh serves {model!r}")
    if _number(body, "n", 1, 1, 1, int) != 1:
        raise BadRequest("'n' must be 1")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a string or a list of up to {MAX_STOP} non-empty strings")
    params = dict(max_tokens=_number(body, "max_tokens", 256, 1, context, int),
                  temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                  top_p=_number(body, "top_p", 1.0, 0.0, 1.0), seed=_number(body, "seed", 0, 0, 2 ** 63 - 1, int))
    if "max_completion_tokens" in body:
        params["max_tokens"] = _number(body, "max_completion_tokens", 256, 1, context, int)
    if params["top_p"] == 0.0:
        raise BadRequest("'top_p' must be above 0")
    speculate = body.get("speculate", True)  # meshd's own field: false asks for plain decoding
    if not isinstance(speculate, bool):
        raise BadRequest("'speculate' must be true or false")
    params["speculate"] = speculate
    verify = body.get("verify", False)  # meshd's own field: true checks this generation on a second route
    if not isinstance(verify, bool):
        raise BadRequest("'verify' must be true or false")
    params["verify"] = verify
    try:
        text, use = _text(body, chat, tool_format)
        answer = structured.answer_schema(body.get("response_format"))
        grammar = (tools.grammar(use, answer) if use is not None and use.may_call
                   else structured.schema_grammar(answer) if answer is not None else "")
    except structured.Refused as exc:
        raise BadRequest(str(exc)) from None
    req = GenerateRequest(request_id=request_id, **text, **params, grammar=grammar)
    return Completion(req, chat, bool(body.get("stream", False)), stop, model, use)


def _text(body: dict, chat: bool, fmt: ToolFormat) -> tuple[dict, ToolUse | None]:
    """The request's prompt or conversation (GenerateRequest fields), and its tools."""
    if not chat:
        if body.get("tools") or body.get("tool_choice"):
            raise structured.Refused("'tools' and 'tool_choice' are served on /v1/chat/completions")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise structured.Refused("'prompt' must be a non-empty string")
        return {"prompt": prompt}, None
    use = tools.parse_tool_use(body, fmt)
    turns = tools.conversation(body.get("messages"), use, fmt)
    shown = json.dumps([t.definition() for t in use.tools]) if use is not None and fmt.native else ""
    return {"prompt": "", "messages": json.dumps(turns), "tools": shown}, use


class StopScanner:
    """Cuts generated text at the first stop sequence; holds back what could begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.pending, self.stopped = stops, "", False

    def push(self, piece: str) -> str:
        """Text that is safe to send now; after a stop sequence, nothing more."""
        if self.stopped:
            return ""
        self.pending += piece
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, out, self.pending = True, self.pending[:cut], ""
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


def finish_reason(stopped: bool, stats: dict, max_tokens: int, called: bool = False) -> str:
    """"length" where max_tokens ended the answer (the entry's `finish` says so where it tells; else all
    tokens were used), "tool_calls" where it ended after tool calls, else "stop"."""
    if stopped:
        return "stop"
    ended = stats.get("finish")
    if ended == "length" or (ended is None and int(stats.get("tokens", 0)) >= max_tokens):
        return "length"
    return "tool_calls" if called else "stop"


def usage(stats: dict) -> dict:
    """OpenAI's usage: `cached_tokens` are the prompt tokens not prefilled (the route's hops held their KV)."""
    p, c = int(stats.get("prompt_tokens", 0)), int(stats.get("tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_tokens") or 0)}}


def answer(c: Completion, text: str, reason: str, stats: dict, calls: list[dict] | None = None) -> dict:
    """The whole (non-streamed) answer; with `calls`, its content is null where no text came with them."""
    message = ({"role": "assistant", "content": text or None, "tool_calls": calls} if calls
               else {"role": "assistant", "content": text})
    choice = ({"index": 0, "message": message, "finish_reason": reason} if c.chat
              else {"index": 0, "text": text, "finish_reason": reason})
    return {"id": c.id, "object": "chat.completion" if c.chat else "text_completion", "created": c.created,
            "model": c.model, "choices": [choice], "usage": usage(stats)}


def chunk(c: Completion, text: str | None, reason: str | None = None, stats: dict | None = None,
          calls: list[dict] | None = None) -> dict:
    """One streamed piece (`calls`: pieces of tool calls, as `call_delta` makes them); the last carries the
    finish reason and the usage."""
    if c.chat:
        delta = ({} if text is None else {"content": text}) | ({"tool_calls": calls} if calls else {})
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason}
    out = {"id": c.id, "object": "chat.completion.chunk" if c.chat else "text_completion", "created": c.created,
           "model": c.model, "choices": [choice]}
    if stats is not None:
        out["usage"] = usage(stats)
    return out


def call_delta(index: int, arguments: str, id: str = "", name: str = "") -> dict:
    """A streamed piece of tool call `index`: its first names it (id, type, name), the others add arguments."""
    if id:
        return {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"index": index, "function": {"arguments": arguments}}


def error_body(message: str, kind: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
