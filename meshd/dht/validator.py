"""The DHT validator for the `meshd` namespace: only the peer itself may write its record.

py-libp2p's default validator accepts anything and keeps the first value it saw; this one
verifies the signature against the key, ignores expired records and keeps the highest sequence.
"""

from __future__ import annotations

from libp2p.records.validator import Validator

from meshd.dht.record import RecordError, best_index, open_record


class CoverageValidator(Validator):
    def validate(self, key: str, value: bytes) -> None:
        try:
            open_record(value, key=key)
        except RecordError as exc:
            raise ValueError(str(exc)) from None

    def select(self, key: str, values: list[bytes]) -> int:
        if not values:
            raise ValueError("no values to select from")
        return best_index(values)
