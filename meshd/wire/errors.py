"""Every way a byte stream can fail to be meshd frames.

Rule: decoding never raises anything but a `WireError` subclass, and each subclass names one kind
of failure so a peer can answer with a precise error message (and a test can tell them apart).
"""


class WireError(Exception):
    """Base of every decoding and framing failure."""


class FrameTooLarge(WireError):
    """A length, count or size in the frame exceeds the configured `Limits`."""


class UnsupportedVersion(WireError):
    """The frame speaks a protocol version this build does not."""


class ChecksumMismatch(WireError):
    """The frame's bytes do not match its checksum: corrupted in transit."""


class TruncatedFrame(WireError):
    """The stream ended in the middle of a frame."""


class MalformedFrame(WireError):
    """The frame is complete but inconsistent: bad header, unknown type, wrong field, bad tensor."""


class ChunkOrderError(WireError):
    """Prefill chunks arrived out of order, duplicated, or with a changing total."""
