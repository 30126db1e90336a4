"""XSalsa20, the stream cipher of libp2p's private networks (pnet): Salsa20 with a 24-byte nonce.

Built on pycryptodome's Salsa20 (a maintained C implementation, already installed with py-libp2p),
which takes only 8-byte nonces, and HSalsa20 here: XSalsa20(key, n) is Salsa20 keyed with
HSalsa20(key, n[:16]) and nonced with n[16:], its block counter starting at zero (Bernstein,
"Extending the Salsa20 nonce", 2008). Neither PyNaCl (no crypto_stream or crypto_core_hsalsa20
bindings in 1.6) nor `cryptography` exposes XSalsa20 or HSalsa20. HSalsa20 runs once per
connection and direction, on 64 bytes, so plain Python costs nothing that matters; every byte of
traffic goes through the C cipher. Tested against the published vectors (tests/test_pnet.py).
"""

from __future__ import annotations

import struct

from Crypto.Cipher import Salsa20

KEY_SIZE = 32
NONCE_SIZE = 24
_SIGMA = struct.unpack("<4I", b"expand 32-byte k")
_MASK = 0xFFFFFFFF


def _rotl(v: int, c: int) -> int:
    return ((v << c) | (v >> (32 - c))) & _MASK


def _quarter(x: list[int], a: int, b: int, c: int, d: int) -> None:
    x[b] ^= _rotl((x[a] + x[d]) & _MASK, 7)
    x[c] ^= _rotl((x[b] + x[a]) & _MASK, 9)
    x[d] ^= _rotl((x[c] + x[b]) & _MASK, 13)
    x[a] ^= _rotl((x[d] + x[c]) & _MASK, 18)


def hsalsa20(key: bytes, nonce16: bytes) -> bytes:
    """The 32-byte subkey HSalsa20(key, nonce16): Salsa20's 20 rounds without the final addition,
    words 0, 5, 10, 15, 6, 7, 8, 9 of the state."""
    if len(key) != KEY_SIZE or len(nonce16) != 16:
        raise ValueError("HSalsa20 takes a 32-byte key and a 16-byte nonce")
    k, n = struct.unpack("<8I", key), struct.unpack("<4I", nonce16)
    x = [_SIGMA[0], *k[:4], _SIGMA[1], *n, _SIGMA[2], *k[4:], _SIGMA[3]]
    for _ in range(10):
        for a, b, c, d in ((0, 4, 8, 12), (5, 9, 13, 1), (10, 14, 2, 6), (15, 3, 7, 11)):  # columns
            _quarter(x, a, b, c, d)
        for a, b, c, d in ((0, 1, 2, 3), (5, 6, 7, 4), (10, 11, 8, 9), (15, 12, 13, 14)):  # rows
            _quarter(x, a, b, c, d)
    return struct.pack("<8I", *(x[i] for i in (0, 5, 10, 15, 6, 7, 8, 9)))


class XSalsa20:
    """One direction's keystream: `xor(data)` encrypts or decrypts the next len(data) bytes."""

    __slots__ = ("_cipher",)

    def __init__(self, key: bytes, nonce: bytes) -> None:
        if len(key) != KEY_SIZE or len(nonce) != NONCE_SIZE:
            raise ValueError("XSalsa20 takes a 32-byte key and a 24-byte nonce")
        self._cipher = Salsa20.new(key=hsalsa20(key, nonce[:16]), nonce=nonce[16:])

    def xor(self, data: bytes) -> bytes:
        return self._cipher.encrypt(data)
