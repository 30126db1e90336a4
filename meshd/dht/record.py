"""Signed coverage records: who serves which layers of which model, until when.

Rules: a record is valid only if it is signed by the key of the peer it describes and has not
expired; among valid records for one peer the highest sequence number wins. These checks are
pure functions, used both by the DHT validator and by whoever builds a coverage map.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import msgpack
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID

NAMESPACE = "meshd"
MAX_RECORD_BYTES = 16 * 1024


class RecordError(ValueError):
    """A record that must not be accepted: malformed, forged, for another key, or expired."""


def record_key(peer_id: str) -> str:
    return f"/{NAMESPACE}/{peer_id}"


@dataclass(frozen=True)
class CoverageRecord:
    peer_id: str
    addrs: tuple[str, ...]
    model: str  # model fingerprint
    recipe: str  # recipe fingerprint
    start: int
    end: int
    n_layers: int
    throughput: float = 0.0  # measured layer-steps per second (decode), 0 when unknown
    free_sessions: int = 0
    load: float = 0.0
    seq: int = 0
    expires_at: float = 0.0  # unix time
    model_name: str = ""
    serving: bool = False  # False while the weights load: claims the range, takes no sessions yet
    relay_addrs: tuple[str, ...] = field(default=())  # /p2p-circuit addresses: reached through these relays
    auto_layers: int = 0  # layers this daemon would serve if it moved (`--layers auto`); 0: it stays put
    leaving: bool = False  # draining: its layers are as good as gone (a claim while loading is not)
    relay: bool = False  # offers circuit relay to daemons that cannot be dialled

    @property
    def dial_addrs(self) -> tuple[str, ...]:
        """Where to reach this peer: its direct addresses, then its circuit addresses."""
        return self.addrs + self.relay_addrs

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    def serves(self, layer: int) -> bool:
        return self.start <= layer < self.end


def sign_record(record: CoverageRecord, private_key) -> bytes:
    """The DHT value for `record`: msgpack [payload, public key, signature]."""
    payload = msgpack.packb(asdict(record), use_bin_type=True)
    return msgpack.packb([payload, private_key.get_public_key().serialize(), private_key.sign(payload)],
                         use_bin_type=True)


def open_record(value: bytes, key: str | None = None, now: float | None = None,
                allow_expired: bool = False) -> CoverageRecord:
    """Verify a DHT value and return its record, or raise `RecordError` saying why not."""
    if len(value) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        payload, pub_bytes, signature = msgpack.unpackb(value, raw=False)
        fields = msgpack.unpackb(payload, raw=False)
        fields["addrs"] = tuple(fields["addrs"])
        fields["relay_addrs"] = tuple(fields.get("relay_addrs", ()))
        record = CoverageRecord(**fields)
        pub = deserialize_public_key(pub_bytes)
    except Exception as exc:  # any decoding failure is a malformed record
        raise RecordError(f"malformed record: {exc}") from None
    if ID.from_pubkey(pub).to_base58() != record.peer_id:
        raise RecordError(f"record for {record.peer_id} is signed by another key")
    if not pub.verify(payload, signature):
        raise RecordError(f"record for {record.peer_id} has a bad signature")
    if key is not None and key != record_key(record.peer_id):
        raise RecordError(f"record for {record.peer_id} stored under the wrong key {key!r}")
    if not allow_expired and record.expired(now):
        raise RecordError(f"record for {record.peer_id} expired")
    if not (0 <= record.start < record.end <= record.n_layers or record.start == record.end == 0):  # 0:0: no layers
        raise RecordError(f"record for {record.peer_id} has a bad range [{record.start}, {record.end})")
    return record


def best_index(values: list[bytes], now: float | None = None) -> int:
    """Index of the value to keep: the valid one with the highest sequence number.

    Invalid values lose to valid ones; an expired record still beats a lower sequence number
    (so an old record cannot be replayed over a newer one), but loses to any live one.
    """
    def rank(value: bytes):
        try:
            r = open_record(value, now=now, allow_expired=True)
        except RecordError:
            return (0, -1, 0)
        return (1, r.seq, 0 if r.expired(now) else 1)

    ranks = [rank(v) for v in values]
    return max(range(len(values)), key=lambda i: ranks[i])


def republish_every(ttl_s: float) -> float:
    """How often a daemon republishes its record: at half its TTL, so one lost push costs nothing."""
    return ttl_s / 2


def needs_pull(pushed: CoverageRecord | None, now: float, ttl_s: float) -> bool:
    """Whether a peer's record must be asked for rather than read from what was pushed here: none
    was pushed, or the copy has a third of its TTL or less left."""
    return pushed is None or pushed.expires_at - now <= ttl_s / 3


def first_seq(now: float | None = None) -> int:
    """The sequence number a daemon starts from: wall-clock milliseconds, so that the records of a
    restarted daemon (same identity) beat those of its previous run, which peers keep as the highest
    sequence they saw (one publish a millisecond would be needed to catch up with the clock)."""
    return int((time.time() if now is None else now) * 1000)


def bump(record: CoverageRecord, ttl_s: float, now: float | None = None, **changes) -> CoverageRecord:
    """The next version of a record: seq + 1, a fresh expiry (from `now`, default the wall clock),
    and any changed fields."""
    return replace(record, seq=record.seq + 1, expires_at=(time.time() if now is None else now) + ttl_s, **changes)
