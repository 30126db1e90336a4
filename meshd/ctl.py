"""The `meshctl` command: talks to the local daemon (arrives with the mesh daemon)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("meshctl: the mesh daemon is not part of this build yet; try `meshd local PROMPT`", file=sys.stderr)
    return 2
