"""A daemon that advertises another throughput than its own, for tests: a real `meshd join` whose records
claim `--factor` times what it measures, so that a test can decide which of several replicas an entry
prefers (a route, a hand-over's receiver) whatever the link latencies on a loaded machine. Not a switch of
the shipped daemon: this module patches its own process only, then runs the ordinary command line.

    python -m meshd.testing.claims --factor 0.001 -- python -m meshd.cli join ...
"""

from __future__ import annotations

import argparse
import sys


def claims_wrap(factor: float) -> list[str]:
    """The command prefix that makes a daemon started by `meshd.cli.localmesh` claim `factor` times its speed."""
    return [sys.executable, "-m", "meshd.testing.claims", "--factor", str(factor), "--"]


def claim_speed(factor: float) -> None:
    """Advertise `factor` times the measured throughput: at start (the slot's measurement) and in every live
    record (never more than the claim where it is below 1, never less where it is above)."""
    from meshd.node import daemon, slot

    measured = slot.measure_throughput
    slot.measure_throughput = lambda shard: factor * measured(shard)
    live = daemon.Daemon.live_fields

    def live_fields(self) -> dict:
        fields = live(self)
        if fields.get("throughput"):
            claim = self.slot.throughput if self.slot else factor  # the slot's measurement, already claimed
            fields["throughput"] = max(fields["throughput"], claim) if factor >= 1 else min(fields["throughput"], claim)
        return fields

    daemon.Daemon.live_fields = live_fields


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m meshd.testing.claims --factor F -- python -m meshd.cli join ...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="meshd.testing.claims")
    parser.add_argument("--factor", type=float, required=True)
    factor = parser.parse_args(argv[:cut]).factor
    command = argv[cut + 1:]
    if "meshd.cli" in command:  # drop "python -m meshd.cli": the command line runs in this process
        command = command[command.index("meshd.cli") + 1:]
    claim_speed(factor)
    from meshd.cli.main import main as meshd_main

    return meshd_main(command)


if __name__ == "__main__":
    sys.exit(main())
