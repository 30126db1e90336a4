"""Tool calls out: generated text split, as it streams, into the answer's content and its tool calls.

Rule: the grammar (`meshd/api/tools.py`) makes a call exactly `open` + {"name": "<name>", "arguments": <JSON
object>} + `close`, calls joined by `sep`, and free text never begins as a call does; so the first
characters tell text from calls, a call's name is known at its closing quote, and its arguments end where
their braces balance. Text that stops matching that shape (a model not held to the grammar) is content from
there on. Each piece of text is told once: pieces split anywhere give the same content and calls.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from meshd.api.structured import ToolFormat
from meshd.api.tools import CALL_END, CALL_HEAD, CALL_MID


@dataclass
class Call:
    """One tool call as it comes: `complete` once its arguments' braces balanced."""

    index: int
    name: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    arguments: str = ""
    complete: bool = False

    def whole(self) -> dict:
        """The call as OpenAI's message.tool_calls holds it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallBegun:
    call: Call


@dataclass(frozen=True)
class Arguments:
    call: Call
    text: str


class CallSplitter:
    """Turns the text pieces of a generation into `Content`, `CallBegun` and `Arguments` events."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt, self.calls = fmt, []
        self.head = fmt.open + CALL_HEAD  # what comes before each call's name
        self.buffer = ""  # text not told yet: what may be the start of a call, a name, or what follows arguments
        self.state = self._start
        self.depth, self.in_string, self.escaped = 0, False, False  # where the arguments' JSON is

    def push(self, piece: str) -> list:
        """The events the next piece of text completes (none while it may still be the start of a call)."""
        self.buffer += piece
        events: list = []
        while self.buffer and self.state(events):
            pass
        return events

    def finish(self) -> list:
        """What the end of the text leaves: the beginning of a call whose name never came is content (a
        generation cut short); a call's own end is not told."""
        events = [Content(self.buffer)] if self.state in (self._start, self._name) and self.buffer else []
        self.buffer = ""
        return events

    # each state takes what it can of the buffer; True: it moved on, and another state may take the rest

    def _start(self, events: list) -> bool:
        if self.buffer.startswith(self.head):
            self.state = self._name
            return True
        if not self.head.startswith(self.buffer):
            self.state = self._content
            return True
        return False  # maybe a call: wait for more

    def _content(self, events: list) -> bool:
        events.append(Content(self.buffer))
        self.buffer = ""
        return False

    def _name(self, events: list) -> bool:
        """The buffer begins with `head`: the call's name up to its closing quote, then `CALL_MID`."""
        end = self.buffer.find(CALL_MID[0], len(self.head))
        if end < 0 or len(self.buffer) < end + len(CALL_MID):
            return False
        if not self.buffer.startswith(CALL_MID, end):
            return self._astray()
        call = Call(len(self.calls), self.buffer[len(self.head):end])
        self.calls.append(call)
        events.append(CallBegun(call))
        self.buffer, self.state = self.buffer[end + len(CALL_MID):], self._arguments
        return True

    def _arguments(self, events: list) -> bool:
        call, text, closed = self.calls[-1], self.buffer, False
        for i, c in enumerate(text):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    text, closed = text[:i + 1], True
                    break
        call.arguments += text
        events.append(Arguments(call, text))
        self.buffer = self.buffer[len(text):]
        if closed:
            call.complete, self.state = True, self._after
            return True
        return False

    def _after(self, events: list) -> bool:
        """A call's arguments ended: its end, then another call or the end of the text."""
        tail = CALL_END + self.fmt.close
        more = tail + self.fmt.sep + self.head
        if self.buffer.startswith(more):
            self.buffer, self.state = self.buffer[len(tail + self.fmt.sep):], self._name
            return True
        if more.startswith(self.buffer):
            return False  # the call's end, maybe another call: wait for more (or the end of the text)
        if self.buffer.startswith(tail):
            self.buffer = self.buffer[len(tail):]
        return self._astray()

    def _astray(self) -> bool:
        """The text left the shape of a call: the rest is content."""
        self.state = self._content
        return True
