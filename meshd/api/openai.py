"""The OpenAI API's shapes, without I/O: requests checked into `GenerateRequest`s, answers built.

Rules: a request is refused (`BadRequest`, HTTP 400 with the OpenAI error shape) before anything is
generated when it is malformed, names another model, asks for more tokens than the context holds, or
uses a parameter outside its range; stop sequences are cut here (`StopScanner`), so no client ever
sees a stop string or a piece of one.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

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


def parse_request(raw: bytes, chat: bool, model: str, context: int, request_id: int) -> Completion:
    """A /v1/chat/completions (chat) or /v1/completions body, checked against this mesh's model."""
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
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        turns = []
        for m in messages:
            if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")):
                raise BadRequest("each message needs a 'role': system, user or assistant")
            turns.append({"role": m["role"], "content": _content(m.get("content"))})
        text = {"prompt": "", "messages": json.dumps(turns)}
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("'prompt' must be a non-empty string")
        text = {"prompt": prompt}
    req = GenerateRequest(request_id=request_id, **text, **params)
    return Completion(req, chat, bool(body.get("stream", False)), stop, model)


def _content(content) -> str:
    """A message's text: a string, or a list of text parts ({"type": "text", "text": ...})."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest("a message's 'content' must be a string or a list of text parts (only text is served)")


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


def finish_reason(stopped: bool, tokens: int, max_tokens: int) -> str:
    return "stop" if stopped or tokens < max_tokens else "length"


def usage(stats: dict) -> dict:
    """OpenAI's usage: `cached_tokens` are the prompt tokens not prefilled (the route's hops held their KV)."""
    p, c = int(stats.get("prompt_tokens", 0)), int(stats.get("tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_tokens") or 0)}}


def answer(c: Completion, text: str, reason: str, stats: dict) -> dict:
    """The whole (non-streamed) answer."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason} if c.chat
              else {"index": 0, "text": text, "finish_reason": reason})
    return {"id": c.id, "object": "chat.completion" if c.chat else "text_completion", "created": c.created,
            "model": c.model, "choices": [choice], "usage": usage(stats)}


def chunk(c: Completion, text: str | None, reason: str | None = None, stats: dict | None = None) -> dict:
    """One streamed piece; the last carries the finish reason and the usage."""
    if c.chat:
        delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason}
    out = {"id": c.id, "object": "chat.completion.chunk" if c.chat else "text_completion", "created": c.created,
           "model": c.model, "choices": [choice]}
    if stats is not None:
        out["usage"] = usage(stats)
    return out


def error_body(message: str, kind: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
