"""A daemon that dies taking a hand-over, for tests: a real `meshd join` that claims to be fast and exits (as a
crash would, no goodbye) when the first chunk of KV another hop hands over to it arrives. Not a switch of the shipped daemon:
this module patches its own process only, then runs the ordinary command line.

    python -m meshd.testing.dying -- python -m meshd.cli join ...
"""

from __future__ import annotations

import os
import sys

CRASH_CODE = 9


def dying_wrap() -> list[str]:
    """The command prefix that makes a daemon started by `meshd.cli.localmesh` die on a hand-over's KV."""
    return [sys.executable, "-m", "meshd.testing.dying", "--"]


def patch() -> None:
    """Die on the first KV chunk; and look fast (as `meshd.testing.liar` does), so that an entry choosing where a
    leaving hop's KV goes chooses this daemon."""
    from meshd.hop.handover import Incoming
    from meshd.testing import claims, liar

    def chunk(self, msg, sender):
        os._exit(CRASH_CODE)

    Incoming.chunk = chunk
    claims.claim_speed(liar.SPEED_CLAIM)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m meshd.testing.dying -- python -m meshd.cli join ...", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1:]
    if "meshd.cli" in command:  # drop "python -m meshd.cli": the command line runs in this process
        command = command[command.index("meshd.cli") + 1:]
    patch()
    from meshd.cli.main import main as meshd_main

    return meshd_main(command)


if __name__ == "__main__":
    sys.exit(main())
