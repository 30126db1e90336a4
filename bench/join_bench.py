"""Joining and healing: time for N `--layers auto` daemons started together to cover the model, and
for the rest to heal a gap after killing some.

The first daemon is the bootstrap; the other N-1 start at once as soon as it listens. Times count
from the first start. "complete": every daemon sees every layer served; "even": every daemon sees
every layer served N*K/L times (when that is whole). Then the servers of the range the last daemon
took are killed (SIGKILL) and the time until every survivor sees complete coverage again is taken.
Usage: python bench/join_bench.py [--daemons 6] [--num-layers 10] [--kill]
Prints a JSON object after each phase (the last line has them all).
"""

from __future__ import annotations

import argparse
import json
import signal
import time

from meshd.cli.localmesh import Mesh


def wait_all(daemons, predicate, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    for d in daemons:
        d.wait_for(predicate, timeout=max(1.0, timeout - (time.monotonic() - t0)), what=what)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--daemons", type=int, default=6)
    ap.add_argument("--num-layers", type=int, default=10)
    ap.add_argument("--kill", action="store_true", help="then kill the servers of one range and time the heal")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # stop the daemons too
    mesh = Mesh(env={"MESHD_RECORD_TTL": "8", "MESHD_MOVE_COOLDOWN": "30"})
    out: dict = {"daemons": a.daemons, "num_layers": a.num_layers}
    try:
        args = ["--layers", "auto", "--num-layers", str(a.num_layers), "--threads", "1"]
        t0 = time.monotonic()
        first = mesh.start("d0", args)
        boot = first.wait_for(lambda s: bool(s["addrs"]), what="listening")["addrs"][0]
        daemons = [first] + [mesh.start(f"d{i}", [*args, "--bootstrap", boot]) for i in range(1, a.daemons)]
        wait_all(daemons, lambda s: s["state"] == "serving" and s["complete"], a.timeout, "complete")
        out["complete_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(out), flush=True)
        n_layers = daemons[0].status()["n_layers"]
        if a.daemons * a.num_layers % n_layers == 0:
            even = [a.daemons * a.num_layers // n_layers] * n_layers
            wait_all(daemons, lambda s: s["coverage"] == even, a.timeout, "even")
            out["even_s"] = round(time.monotonic() - t0, 1)
        status = {d.name: d.status() for d in daemons}
        out["ranges"] = sorted(tuple(s["range"]) for s in status.values())
        out["moves_while_joining"] = sum(bool(s["moved"]) for s in status.values())
        print(json.dumps(out), flush=True)
        if a.kill:
            victim = status[daemons[-1].name]["range"]
            dead = [d for d in daemons if status[d.name]["range"] == victim]
            alive = [d for d in daemons if d not in dead]
            if len(dead) < 2:
                print(json.dumps({**out, "kill": "skipped: that range has one server, nobody could heal it"}))
                return
            for d in dead:
                d.kill()
            t1 = time.monotonic()
            alive[0].wait_for(lambda s: victim in s["gaps"], timeout=60, what="gap")
            out["gap_seen_s"] = round(time.monotonic() - t1, 1)
            wait_all(alive, lambda s: s["complete"], a.timeout, "healed")
            out["killed"] = len(dead)
            out["healed_s"] = round(time.monotonic() - t1, 1)
    finally:
        mesh.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
