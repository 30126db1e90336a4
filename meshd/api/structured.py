"""Structured outputs for the API: `response_format` and grammar files checked and turned into the grammar
a generation keeps to (`GenerateRequest.grammar`, llguidance's JSON text), and the ways models write tool calls.

Why llguidance (PyPI `llguidance`), not xgrammar: it needs no torch of its own, compiles a grammar lazily
(microseconds a token, no automaton built up front) and takes JSON Schema, Lark and regex; the entry and the
hop that samples use the same library (`meshd/shard/grammar.py`).

Rules: a schema is checked before anything is generated, against its meta-schema (`jsonschema`) and by
llguidance, which refuses what it cannot enforce (a keyword it does not implement, such as `not`; a bad
`pattern`; an empty range): either is `Refused`, an HTTP 400. Only what needs the model's tokenizer (a
Lark grammar's `<special_token>`) is left to the entry, whose refusal is a 400 too. A schema is enforced
as written (JSON Schema's own defaults: properties not listed are allowed unless `additionalProperties` is
false), and JSON comes compact: `, ` and `: ` between items, no other whitespace, as chat templates render
tool calls (a schema's own `x-guidance` options win).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


class Refused(ValueError):
    """A response_format, grammar, tool or tool_choice that cannot be served as sent (HTTP 400)."""


def check_schema(schema, where: str) -> None:
    """Refused unless `schema` is a JSON schema (an object) that llguidance can enforce."""
    if not isinstance(schema, dict):
        raise Refused(f"{where} must be a JSON schema (a JSON object)")
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        at = "/".join(str(p) for p in exc.path)
        raise Refused(f"{where} is not a valid JSON schema: {exc.message}" + (f" (at {at})" if at else "")) from None
    except RecursionError:  # a schema nested some hundreds deep: refused, not a crash of the request
        raise Refused(f"{where} is nested too deeply") from None
    validated(schema_grammar(schema), where)


def styled(schema: dict) -> dict:
    """The schema with the compact JSON style, its own `x-guidance` options kept over it."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": JSON_STYLE | (own if isinstance(own, dict) else {})}


def schema_grammar(schema: dict) -> str:
    """The grammar of JSON text that validates against `schema` (checked with `check_schema`)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(styled(schema))


def lark_grammar(text: str, where: str = "the grammar") -> str:
    """The grammar of a Lark grammar's text (llguidance's variant), checked as far as it goes without a tokenizer."""
    from llguidance import LLMatcher

    return validated(LLMatcher.grammar_from_lark(text), where)


def validated(grammar: str, where: str) -> str:
    """`grammar`, or Refused with llguidance's reason (warnings, such as special tokens left unchecked, pass)."""
    from llguidance import LLMatcher

    try:
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as exc:  # noqa: BLE001 -- llguidance raises plain exceptions for malformed input
        raise Refused(f"{where} cannot be enforced: {exc}") from None
    if failed:
        raise Refused(f"{where} cannot be enforced: " + "; ".join(m.strip() for m in messages))
    return grammar


def answer_schema(response_format) -> dict | None:
    """The schema an answer must keep to under OpenAI's `response_format` (None: free text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise Refused("'response_format' must be an object such as {\"type\": \"json_object\"}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise Refused(f"'response_format.type' must be text, json_object or json_schema, not {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise Refused("'response_format.json_schema' must be an object with a 'schema'")
    if "schema" not in spec:
        raise Refused("'response_format.json_schema.schema' is missing")
    check_schema(spec["schema"], "'response_format.json_schema.schema'")
    return spec["schema"]


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a tool call: `open`, the JSON object {"name": ..., "arguments": {...}}, `close`;
    several calls joined by `sep`. `native`: the chat template renders the tools, the calls and their
    results itself (given `tools`); otherwise meshd's fallback prompt does (`meshd/api/tools.py`)."""

    name: str
    open: str
    close: str
    sep: str
    native: bool
    mark: str = ""  # what a chat template that writes calls this way holds

    @property
    def trigger(self) -> str:
        """What a call begins with, and free text under tool_choice auto never does."""
        return self.open.strip() or "{"


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", native=True, mark="<tool_call>")  # Qwen2.5/3
PLAIN = ToolFormat("plain", "", "", "\n", native=False)  # the fallback: a bare JSON object a line
TOOL_FORMATS = (HERMES,)  # the chat templates' formats meshd knows


def tool_format(template: str) -> ToolFormat:
    """The tool format a chat template uses, where meshd knows it; else the fallback (`PLAIN`)."""
    for fmt in TOOL_FORMATS:
        if "tools" in template and fmt.mark in template:
            return fmt
    return PLAIN


def chat_template(artifact) -> str:
    """The model's chat template as its files hold it ("" if none). A daemon without layer 0 drops a
    GGUF's tokenizer metadata once its range loads: read this before (the API reads it when it starts)."""
    template = (getattr(artifact, "metadata", None) or {}).get("tokenizer.chat_template")
    if template:
        return str(template)
    if getattr(artifact, "kind", "") != "hf":
        return ""
    path = artifact.path
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return ""
    template = config.get("chat_template") or ""
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template", "") for t in template if t.get("name") == "default"), "")
    return template if isinstance(template, str) else ""
