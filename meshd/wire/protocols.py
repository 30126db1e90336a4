"""The libp2p protocol ids meshd speaks (plain strings: py-libp2p's `TProtocol` is a `NewType` of str).

Relays' own protocols live with them in `meshd/relay/`.
"""

SHARD_PROTOCOL = "/meshd/shard/1.0.0"  # a session's frames between an entry and a hop, or hop to hop
GEN_PROTOCOL = "/meshd/gen/1.0.0"  # a generation request handed to another entry
