"""A lying daemon for tests: a real `meshd join` whose shard returns wrong outputs, and which claims
to be fast so that routes prefer it. Not a switch of the shipped daemon: this module patches the
shard in its own process only, then runs the ordinary command line.

A non-tail liar adds seeded noise to the hidden states it sends on (the next hop computes on them as
if they were right); a tail liar keeps its hidden states right and shifts its logits by one token
id, so its tokens are wrong. It lies only at positions >= `--from-position` (0: from the start),
which puts a lie mid-generation.

    python -m meshd.testing.liar [--scale S] [--from-position P] [--honest-speed] -- python -m meshd.cli join ...

`liar_wrap()` gives the prefix for `DaemonProc`/`Mesh.start(..., wrap=...)`.
"""

from __future__ import annotations

import argparse
import sys

from meshd.testing import claims

SPEED_CLAIM = 100.0  # the liar advertises this many times its measured throughput


def liar_wrap(scale: float = 1.0, from_position: int = 0, honest_speed: bool = False) -> list[str]:
    """The command prefix that turns a daemon started by `meshd.cli.localmesh` into a liar."""
    return [sys.executable, "-m", "meshd.testing.liar", "--scale", str(scale), "--from-position", str(from_position),
            *(["--honest-speed"] if honest_speed else []), "--"]


def lie(out, scale: float, tail: bool, position: int):
    """A wrong output in place of `out`: logits shifted by one id (tail), else hidden states plus
    noise of `scale` times their mean magnitude (seeded by the position, so a replay lies alike)."""
    import torch

    if tail:
        return torch.roll(out, 1, dims=-1)
    gen = torch.Generator().manual_seed(1000 + position)
    noise = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.dtype)
    return out + scale * out.abs().mean() * noise


def patch(scale: float, from_position: int, honest_speed: bool) -> None:
    """Make this process's shards lie (and, unless `honest_speed`, look fast)."""
    from meshd.shard.runtime import Shard

    honest = Shard.forward_batch

    def forward_batch(self, jobs):
        results = honest(self, jobs)
        out = []
        for job, result in zip(jobs, results):
            position = job[2]
            lies = not isinstance(result, Exception) and position + job[1].shape[1] > from_position
            out.append(lie(result, scale, self.is_tail, position) if lies else result)
        return out

    Shard.forward_batch = forward_batch
    if not honest_speed:
        claims.claim_speed(SPEED_CLAIM)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m meshd.testing.liar [--scale S] [--from-position P] -- python -m meshd.cli join ...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="meshd.testing.liar")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--from-position", type=int, default=0)
    parser.add_argument("--honest-speed", action="store_true")
    args = parser.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if "meshd.cli" in command:  # drop "python -m meshd.cli": the command line runs in this process
        command = command[command.index("meshd.cli") + 1:]
    patch(args.scale, args.from_position, args.honest_speed)
    from meshd.cli.main import main as meshd_main

    return meshd_main(command)


if __name__ == "__main__":
    sys.exit(main())
