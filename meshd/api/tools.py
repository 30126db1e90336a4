"""Tool calls in: OpenAI's `tools`, `tool_choice` and tool turns checked, the conversation rendered for the
model, and the grammar its answer keeps to.

Rules: a call is the JSON object {"name": <a tool's name>, "arguments": <that tool's parameters>}, written
in the chat template's own markup where meshd knows the template's format (`structured.TOOL_FORMATS`:
Qwen2.5/Qwen3's `<tool_call>`); the entry then renders the tools, earlier calls and tool results with the
template (`GenerateRequest.tools`). Elsewhere (SmolLM2, the default model, has no tool format) the fallback:
a system message (the conversation's own, with this appended, or a new one first) lists each tool's name,
description and parameters schema and asks for a bare JSON object a call; earlier calls are rendered as
that JSON in the assistant's turn, and tool results as user turns.
tool_choice: `none`: no call (free text or the response_format; a native template still sees the tools, the
fallback lists none); `auto` (the default with tools): free text, which never begins as a call does, or
calls; `required`: one or more calls; a named function: one call of it. `parallel_tool_calls: false`
allows one call at most.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from meshd.api.structured import PLAIN, Refused, ToolFormat, check_schema, styled, validated

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
CALL_HEAD, CALL_MID, CALL_END = '{"name": "', '", "arguments": ', "}"  # a call's JSON around its arguments, as
# `call_schema` makes the model write it


class Choice(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "function"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def definition(self) -> dict:
        """The OpenAI tool definition chat templates render."""
        fn = {"name": self.name} | ({"description": self.description} if self.description else {})
        return {"type": "function", "function": fn | {"parameters": self.parameters}}


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools: which the model may call, how it writes calls, and how many."""

    tools: tuple[Tool, ...]
    choice: Choice
    fmt: ToolFormat
    parallel: bool = True
    named: str = ""  # the tool that Choice.NAMED asks for

    @property
    def may_call(self) -> bool:
        return self.choice != Choice.NONE

    @property
    def callable(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if t.name == self.named) if self.choice == Choice.NAMED else self.tools


def parse_tool_use(body: dict, fmt: ToolFormat) -> ToolUse | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked (None: no tools)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise Refused("'tool_choice' needs 'tools'")
        return None
    if not isinstance(raw, list):
        raise Refused("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise Refused("two tools have the same name")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise Refused("'parallel_tool_calls' must be true or false")
    choice, named = _choice(choice, names)
    return ToolUse(tools, choice, fmt, parallel, named)


def _choice(raw, names: list[str]) -> tuple[Choice, str]:
    """`tool_choice`, and the tool it names (auto where it is left out)."""
    if raw is None:
        return Choice.AUTO, ""
    if raw in ("none", "auto", "required"):
        return Choice(raw), ""
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    named = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(named, str):
        raise Refused(f"'tool_choice' must be none, auto, required or {{\"type\": \"function\", \"function\":"
                      f" {{\"name\": ...}}}}, not {json.dumps(raw)}")
    if named not in names:
        raise Refused(f"'tool_choice' names {named!r}, which is not in 'tools'")
    return Choice.NAMED, named


def _tool(raw, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
        raise Refused(f"{where}: only function tools are served ({{\"type\": \"function\", \"function\": {{...}}}})")
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise Refused(f"{where}: a tool needs a 'function.name'")
    if not NAME.fullmatch(name):
        raise Refused(f"{where}: a tool's name is 1 to 64 letters, digits, '_' or '-', not {name!r}")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise Refused(f"{where}: 'function.description' must be a string")
    parameters = fn.get("parameters", NO_PARAMETERS)
    check_schema(parameters, f"{where}: 'function.parameters'")
    if parameters.get("type", "object") != "object":
        raise Refused(f"{where}: 'function.parameters' must describe an object (\"type\": \"object\")")
    return Tool(name, description, parameters)


def grammar(use: ToolUse, answer: dict | None) -> str:
    """The grammar of the answer `use` allows: calls, or (auto) the free text or `answer` JSON instead."""
    from llguidance import LLMatcher

    fmt, tools = use.fmt, use.callable
    one = " | ".join(f"call_{i}" for i in range(len(tools)))
    rules = [f"call: {_literal(fmt.open)} ({one}) {_literal(fmt.close)}"]
    rules += [f"call_{i}: %json {json.dumps(call_schema(t))}" for i, t in enumerate(tools)]
    several = use.parallel and use.choice != Choice.NAMED
    calls = f"call ({json.dumps(fmt.sep)} call)*" if several else "call"
    if use.choice != Choice.AUTO:
        start = f"start: {calls}"
    elif answer is not None:  # where calls are bare JSON too, the two merge as an anyOf would
        start = f"start: answer | {calls}\nanswer: %json {json.dumps(styled(answer))}"
    else:  # text that begins neither with whitespace nor as a call does: the first characters tell which
        start = f"start: TEXT | {calls}\nTEXT: /[^\\s](?s:.*)/ & ~/{_regex(fmt.trigger)}(?s:.*)/"
    return validated(LLMatcher.grammar_from_lark("\n".join([start, *rules]) + "\n"), "the tools")


def call_schema(tool: Tool) -> dict:
    """The JSON schema of a call of `tool`: {"name": ..., "arguments": ...}, in that order. Its parameters
    get an `$id` (unless they have one), so their own `$ref`s ("#/$defs/...") resolve inside them."""
    params = tool.parameters if "$id" in tool.parameters else {"$id": f"urn:meshd:tool:{tool.name}", **tool.parameters}
    own = tool.parameters.get("x-guidance")
    return styled({"type": "object", "properties": {"name": {"const": tool.name}, "arguments": params},
                   "required": ["name", "arguments"], "additionalProperties": False,
                   **({"x-guidance": own} if isinstance(own, dict) else {})})


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def _regex(text: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$/" else c for c in text)


def fallback_prompt(use: ToolUse) -> str:
    """The system text that offers the tools where the chat template has no tool format of its own."""
    lines = ["You can call these tools (functions):"]
    for t in use.tools:
        lines.append(f"- {t.name}: {t.description or '(no description)'}\n  parameters (JSON schema): "
                     f"{json.dumps(t.parameters)}")
    shape = '{"name": <the tool\'s name>, "arguments": <its arguments, a JSON object>}'
    if use.choice == Choice.AUTO:
        lines.append(f"To call a tool, answer with only a JSON object {shape}, one line a call. Otherwise answer"
                     " in plain text.")
    elif use.choice == Choice.REQUIRED:
        lines.append(f"Answer with tool calls only: a JSON object {shape}, one line a call.")
    else:
        lines.append(f"Answer with a call of {use.named} only: a JSON object {shape}.")
    return "\n".join(lines)


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def conversation(messages, use: ToolUse | None, fmt: ToolFormat = PLAIN) -> list[dict]:
    """The turns the entry renders with the chat template: text turns, with tool calls and results in the
    template's format where it has one (`fmt.native`), else as plain text; the fallback prompt where due."""
    if not isinstance(messages, list) or not messages:
        raise Refused("'messages' must be a non-empty list")
    names: dict[str, str] = {}  # the tool each earlier call (by id) called
    turns = [_turn(m, fmt, names) for m in messages]
    if use is not None and not fmt.native and use.may_call:
        prompt = fallback_prompt(use)
        if turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{prompt}"}
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return turns


def _turn(m, fmt: ToolFormat, names: dict[str, str]) -> dict:
    """One message as a turn for the template (`names`: the tool of each call id so far, updated)."""
    if not (isinstance(m, dict) and m.get("role") in ROLES):
        raise Refused("each message needs a 'role': system, developer, user, assistant or tool")
    role = ROLES[m["role"]]
    calls = _calls(m["tool_calls"]) if role == "assistant" and m.get("tool_calls") else []
    content = _content(m.get("content")) if m.get("content") is not None or not calls else ""
    if calls:
        names.update((c["id"], c["function"]["name"]) for c in calls)
        if fmt.native:
            return {"role": role, "content": content, "tool_calls": calls}
        return {"role": role, "content": "\n".join(filter(None, [content, *map(_plain, calls)]))}
    if role != "tool":
        return {"role": role, "content": content}
    call_id = m.get("tool_call_id") or ""
    if not isinstance(call_id, str):
        raise Refused("a tool message's 'tool_call_id' must be a string")
    name = names.get(call_id, m.get("name") if isinstance(m.get("name"), str) else "")
    if fmt.native:
        return {"role": "tool", "content": content, "tool_call_id": call_id} | ({"name": name} if name else {})
    return {"role": "user", "content": f"Result of the tool call {name}: {content}"}


def _content(content) -> str:
    """A message's text: a string, or a list of text parts ({"type": "text", "text": ...})."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise Refused("a message's 'content' must be a string or a list of text parts (only text is served)")


def _calls(calls) -> list[dict]:
    """An assistant turn's tool calls, their arguments as objects where they are JSON (as templates expect)."""
    if not isinstance(calls, list):
        raise Refused("an assistant message's 'tool_calls' must be a list")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments", ""), str)):
            raise Refused("each tool call needs 'function': {\"name\": ..., \"arguments\": \"<JSON text>\"}")
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            arguments = fn["arguments"]
        out.append({"id": str(c.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _plain(call: dict) -> str:
    """A call as the fallback writes it (what its grammar makes the model write)."""
    fn = call["function"]
    return json.dumps({"name": fn["name"], "arguments": fn["arguments"]})
