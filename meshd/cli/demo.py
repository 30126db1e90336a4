"""`meshd demo`: three daemons on loopback split SmolLM2, then a streamed generation through them.

Rule: the demo is what a newcomer runs first, so it uses only the public commands (`meshd join`,
`meshctl`) through the same process helper the tests use (`meshd.cli.localmesh`), shows what happens,
and stops every process it started, by PID, whatever happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from meshd.cli.localmesh import Mesh, ctl

SPLIT = [(0, 10), (10, 20), (20, 30)]


def say(text: str) -> None:
    print(f"\033[1m==> {text}\033[0m" if sys.stderr.isatty() else f"==> {text}", file=sys.stderr, flush=True)


def run_demo(args) -> int:
    mesh = Mesh(env={})  # the daemons' own defaults, not the tests' short record lifetimes
    try:
        say("starting daemons for layers " + ", ".join(f"{a}:{b}" for a, b in SPLIT)
            + " and waiting for the coverage map to fill")
        # three daemons share this machine: each takes its share of the cores, not all of them
        threads = max(1, (os.cpu_count() or 1) // len(SPLIT))
        entry = mesh.start_chain(SPLIT, extra=["--model", args.model, "--threads", str(threads)])[0]
        print(ctl(entry.socket, ["status"]).stdout, file=sys.stderr)
        say(f"generating through the mesh: {args.prompt!r}")
        gen = subprocess.run([sys.executable, "-m", "meshd.cli.ctl", "--socket", str(entry.socket), "generate", "--chat",
                              "--stats", "--max-tokens", str(args.max_tokens), args.prompt],
                             stderr=subprocess.PIPE, text=True, timeout=600)
        if gen.returncode != 0:
            print(gen.stderr, file=sys.stderr)
            return gen.returncode
        stats = json.loads(gen.stderr.strip().splitlines()[-1])
        say("route: " + " -> ".join(f"{peer[-8:]}[{a}:{b})" for peer, a, b in stats["route"]))
        say(f"{stats['tokens']} tokens, first after {stats['ttft_s']:.2f} s, {stats['decode_tok_per_s']} tok/s")
        return 0
    finally:
        say("stopping the daemons")
        if os.environ.get("MESHD_DEMO_KEEP"):
            for d in mesh.daemons:
                d.terminate()
            say(f"logs kept in {mesh.root}")
        else:
            mesh.close()
