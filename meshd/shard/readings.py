"""What the readers of a model's shape share (config.py, gemma3_config.py, rope.py), below all three so
none imports another to get it: the refusal of an architecture meshd has no adapter for, and the
readings of values config files spell in more than one way."""

from __future__ import annotations


class UnsupportedArchitecture(ValueError):
    """The model's architecture has no meshd adapter."""


def opt_int(v) -> int | None:
    """An integer, or None where the file leaves the value out."""
    return None if v is None else int(v)


def first(v) -> int | None:
    """A value some files write as a list (`eos_token_id`): its first element."""
    if isinstance(v, list):
        return v[0] if v else None
    return v
