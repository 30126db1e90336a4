"""A lying daemon for tests: a real `meshd join` whose shard returns wrong outputs, and which claims
to be fast so that routes prefer it. Not a switch of the shipped daemon: this module patches the
shard in its own process only, then runs the ordinary command line.

A non-tail liar adds seeded noise to the hidden states it sends on (the next hop computes on them as
if they were right); a tail liar keeps its hidden states right and shifts its logits by one token
id, so its tokens are wrong.

It lies by position, not by job: at the positions p >= `--from-position` with (p - from_position) %
`--every` == 0 (defaults 0 and 1: every position from the start), and only on those positions' rows of a
job's output (a job computes positions [position, position + n); a tail's logits of one row [vocab]
are those of its last position). Each lie is seeded by its position, so a replay, or a pass of many
positions that recomputes one, lies alike. A lie can so come rarely and late.

With `--only-entry PEER_ID` it lies only in the sessions that entry opened. An entry opens its
session at every hop of its route itself, over a stream of its own (`meshd/entry/opening.py`), even
at hops whose input comes straight from the hop before: each hop's session table knows the peer that
opened it (`HopSession.requester`). Sessions of other entries, and of this daemon's own, are honest.

    python -m meshd.testing.liar [--scale S] [--from-position P] [--every N] [--only-entry PEER_ID]
        [--honest-speed] -- python -m meshd.cli join ...

`liar_wrap()` gives the prefix for `DaemonProc`/`Mesh.start(..., wrap=...)`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from meshd.testing import claims

SPEED_CLAIM = 100.0  # the liar advertises this many times its measured throughput


@dataclass(frozen=True, slots=True)
class Lies:
    """Where a liar lies: how much, at which positions, to which entry."""

    scale: float = 1.0
    from_position: int = 0
    every: int = 1
    only_entry: str = ""  # "": to every entry

    def at(self, position: int) -> bool:
        return position >= self.from_position and (position - self.from_position) % self.every == 0

    def to(self, entry: str | None) -> bool:
        """Whether it lies to the sessions `entry` opened here (None: no session open here; "": this daemon's)."""
        return not self.only_entry or entry == self.only_entry


def liar_wrap(scale: float = 1.0, from_position: int = 0, honest_speed: bool = False, every: int = 1,
              only_entry: str = "") -> list[str]:
    """The command prefix that turns a daemon started by `meshd.cli.localmesh` into a liar."""
    return [sys.executable, "-m", "meshd.testing.liar", "--scale", str(scale), "--from-position", str(from_position),
            "--every", str(every), *(["--only-entry", only_entry] if only_entry else []),
            *(["--honest-speed"] if honest_speed else []), "--"]


def lie(out, scale: float, tail: bool, position: int):
    """A wrong output in place of `out`, whose rows (along its last dimension) are the positions `position`,
    `position + 1`, ...: logits shifted by one id (tail), else hidden states whose every row gets noise of
    `scale` times its mean magnitude, seeded by its position (so a replay lies alike)."""
    import torch

    if tail:
        return torch.roll(out, 1, dims=-1)
    rows = out.reshape(-1, out.shape[-1])
    noisy = []
    for j, row in enumerate(rows):
        gen = torch.Generator().manual_seed(1000 + position + j)
        noise = torch.randn(row.shape, generator=gen, dtype=torch.float32)
        noisy.append((row.float() + scale * row.float().abs().mean() * noise).to(row.dtype))
    return torch.stack(noisy).reshape(out.shape)


def lie_at_rows(out, lies: Lies, position: int, n: int):
    """A job's result for positions [position, position + n) with a lie at the rows of the positions `lies`
    takes, the others as they were (`out` itself where it takes none). Hidden states [1, n, hidden] and a
    SCORE job's logits [n, vocab] hold a row a position; logits [vocab], the job's last position's."""
    import torch

    with torch.inference_mode():
        rows = out.reshape(-1, out.shape[-1])
        first = position + n - rows.shape[0]
        at = [j for j in range(rows.shape[0]) if lies.at(first + j)]
        if not at:
            return out
        # logits by their shape, not by `Shard.is_tail`: a session that ends before a tail's last layer gets
        # hidden states there
        tail = out.dim() < 3
        lied = rows.clone()
        for j in at:
            lied[j] = lie(rows[j], lies.scale, tail, first + j)
        return lied.reshape(out.shape)


def patch(lies: Lies, honest_speed: bool) -> None:
    """Make this process's shards lie (and, unless `honest_speed`, look fast)."""
    from meshd.hop.endpoint import ShardEndpoint
    from meshd.shard.runtime import Shard

    honest = Shard.forward_batch
    endpoint_init = ShardEndpoint.__init__

    def init(self, shard, *args, **kwargs):
        endpoint_init(self, shard, *args, **kwargs)
        # a shard's jobs name only their session's key: its endpoint's session table knows who opened it
        # (read on the compute thread, which writes it)
        shard.entry_of = lambda key: getattr(self.sessions.get(key), "requester", None)

    def forward_batch(self, jobs):
        entry_of = getattr(self, "entry_of", lambda key: None)
        return [result if isinstance(result, Exception) or not lies.to(entry_of(job[0]))
                else lie_at_rows(result, lies, job[2], job[1].shape[1])
                for job, result in zip(jobs, honest(self, jobs))]

    ShardEndpoint.__init__ = init
    Shard.forward_batch = forward_batch
    if not honest_speed:
        claims.claim_speed(SPEED_CLAIM)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m meshd.testing.liar [--scale S] [--from-position P] [--every N] [--only-entry PEER_ID]"
              " [--honest-speed] -- python -m meshd.cli join ...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="meshd.testing.liar")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--from-position", type=int, default=0)
    parser.add_argument("--every", type=int, default=1, help="lie at every Nth position from --from-position on")
    parser.add_argument("--only-entry", default="", metavar="PEER_ID", help="lie only in sessions this entry opened")
    parser.add_argument("--honest-speed", action="store_true")
    args = parser.parse_args(argv[:cut])
    if args.every < 1:
        parser.error("--every must be at least 1")
    command = argv[cut + 1:]
    if "meshd.cli" in command:  # drop "python -m meshd.cli": the command line runs in this process
        command = command[command.index("meshd.cli") + 1:]
    patch(Lies(args.scale, args.from_position, args.every, args.only_entry), args.honest_speed)
    from meshd.cli.main import main as meshd_main

    return meshd_main(command)


if __name__ == "__main__":
    sys.exit(main())
