"""The swarm key of a private mesh, in libp2p's `/key/swarm/psk/1.0.0/` file format.

A key file is three parts, the first two a line each: the header `/key/swarm/psk/1.0.0/`, an
encoding (`/base16/`, `/base64/` or `/bin/`), then the 32-byte key in that encoding (go-, rust- and
js-libp2p and IPFS read and write the same files; `/base16/` is what they write). The fingerprint
is theirs too: 16 bytes of SHAKE-128 over 64 bytes of Salsa20 keystream (nonce `finprint`), so an
operator can compare keys across implementations without showing them. Rules: a key file must be
readable by its owner only, and anything malformed is refused with a message that says what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from Crypto.Cipher import Salsa20

HEADER = b"/key/swarm/psk/1.0.0/"
ENCODINGS = (b"/base16/", b"/base64/", b"/bin/")
KEY_SIZE = 32
MAX_FILE = 4096  # a key file is ~95 bytes; anything much bigger is not one


class SwarmKeyError(ValueError):
    """A key file that cannot be used (malformed, or readable by other users)."""


@dataclass(frozen=True, repr=False)
class SwarmKey:
    psk: bytes
    path: str = ""

    def __post_init__(self) -> None:
        if len(self.psk) != KEY_SIZE:
            raise SwarmKeyError(f"a swarm key is {KEY_SIZE} bytes, not {len(self.psk)}")

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.psk)

    def __repr__(self) -> str:  # never the key itself, in a log or a traceback
        return f"SwarmKey(fingerprint={self.fingerprint!r}, path={self.path!r})"


def fingerprint(psk: bytes) -> str:
    """The key's public fingerprint (hex, 32 digits), computed as go-libp2p's pnet does."""
    stream = Salsa20.new(key=psk, nonce=b"finprint").encrypt(bytes(64))
    return hashlib.shake_128(stream).digest(16).hex()


def parse_swarm_key(data: bytes) -> bytes:
    """The 32-byte key in a key file's contents; raises SwarmKeyError naming what is wrong."""
    header, sep, rest = data.partition(b"\n")
    if header.rstrip(b"\r") != HEADER or not sep:
        raise SwarmKeyError(f"not a swarm key file: the first line must be {HEADER.decode()}")
    encoding, sep, body = rest.partition(b"\n")
    encoding = encoding.rstrip(b"\r")
    if encoding not in ENCODINGS or not sep:
        names = ", ".join(e.decode() for e in ENCODINGS)
        raise SwarmKeyError(f"the second line of a swarm key file must be one of {names}, not {encoding[:40]!r}")
    key = _decode(encoding, body)
    if len(key) != KEY_SIZE:
        raise SwarmKeyError(f"the key in a swarm key file must be {KEY_SIZE} bytes, this one is {len(key)}")
    return key


def _decode(encoding: bytes, body: bytes) -> bytes:
    if encoding == b"/bin/":
        return body[:-2] if len(body) == KEY_SIZE + 2 and body.endswith(b"\r\n") else (
            body[:-1] if len(body) == KEY_SIZE + 1 and body.endswith(b"\n") else body)
    text = body.strip()
    if not text or any(c in text for c in b" \t\r\n"):
        raise SwarmKeyError("the key of a swarm key file must be one line after the encoding")
    try:
        return binascii.unhexlify(text) if encoding == b"/base16/" else base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise SwarmKeyError(f"the key is not valid {encoding.decode().strip('/')}") from None


def format_swarm_key(psk: bytes, encoding: bytes = b"/base16/") -> bytes:
    """A key file's contents for `psk` (base16 by default, as the other implementations write it)."""
    if encoding == b"/bin/":
        body = psk
    elif encoding == b"/base64/":
        body = base64.b64encode(psk) + b"\n"
    elif encoding == b"/base16/":
        body = psk.hex().encode() + b"\n"
    else:
        raise SwarmKeyError(f"unknown encoding {encoding!r}")
    return HEADER + b"\n" + encoding + b"\n" + body


def read_swarm_key(path: str | os.PathLike) -> SwarmKey:
    """The key in the file at `path`. Refused (SwarmKeyError) when the file is readable or writable
    by anyone but its owner, is not a regular file, or is malformed."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError as exc:
        raise SwarmKeyError(f"cannot read the swarm key {p}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SwarmKeyError(f"the swarm key {p} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_mode & 0o077:
            raise SwarmKeyError(f"the swarm key {p} has mode {stat.S_IMODE(st.st_mode):04o}: other users may read"
                                f" or change it; `chmod 600 {p}`")
        data = f.read(MAX_FILE + 1)
    if len(data) > MAX_FILE:
        raise SwarmKeyError(f"the swarm key {p} is {len(data)}+ bytes: not a swarm key file")
    try:
        return SwarmKey(parse_swarm_key(data), str(p))
    except SwarmKeyError as exc:
        raise SwarmKeyError(f"the swarm key {p}: {exc}") from None


def write_new_swarm_key(path: str | os.PathLike) -> SwarmKey:
    """Write a fresh random key to `path` (mode 0600, base16); never overwrites an existing file."""
    p = Path(path)
    psk = secrets.token_bytes(KEY_SIZE)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SwarmKeyError(f"{p} exists already; a new key never replaces one (remove it first)") from None
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(format_swarm_key(psk))
    return SwarmKey(psk, str(p))
