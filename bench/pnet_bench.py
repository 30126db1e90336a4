"""What a private mesh's key costs: libp2p pnet (XSalsa20 under Noise) against an open mesh, side by side.

  cipher   XSalsa20 alone, 64 KiB at a time (MB/s)
  connect  a fresh connection between two hosts on loopback in one process: TCP, pnet, Noise,
           Yamux (median ms over --connects)
  bulk     one stream carrying --bulk-mb MiB from one host to the other (MB/s, median of --runs)
  decode   two three-daemon meshes (0:10, 10:20, 20:30) on loopback, one keyed and one open, running
           at the same time; --runs generations of --tokens greedy tokens on each, alternating
           (median decode tok/s and time to first token)
Usage: python bench/pnet_bench.py [--connects 30] [--bulk-mb 32] [--runs 3] [--tokens 64] [--no-mesh].
Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol

from meshd.p2p.host import connect, full_addrs, open_host
from meshd.p2p.pnet import Pnet
from meshd.p2p.swarmkey import SwarmKey, write_new_swarm_key
from meshd.p2p.xsalsa20 import XSalsa20
from meshd.cli.localmesh import Mesh, ctl

SINK = TProtocol("/meshd-bench/sink/1.0.0")
RANGES = [(0, 10), (10, 20), (20, 30)]
PROMPT = "The capital of France is"
CHUNK = 64 * 1024


def cipher_mb_s(total_mb: int = 256) -> float:
    cipher, block = XSalsa20(os.urandom(32), os.urandom(24)), os.urandom(CHUNK)
    t0 = time.perf_counter()
    for _ in range(total_mb * 1024 * 1024 // CHUNK):
        cipher.xor(block)
    return total_mb * 1.048576 / (time.perf_counter() - t0)


async def _sink(stream) -> None:
    """Reads the 8-byte length, then that many bytes, and answers one byte."""
    try:
        head = b""
        while len(head) < 8:
            head += await stream.read(8 - len(head))
        left = int.from_bytes(head, "big")
        while left > 0:
            left -= len(await stream.read(min(CHUNK, left)))
        await stream.write(b"k")
    finally:
        await stream.close()


async def host_figures(pnet: Pnet | None, connects: int, bulk_mb: int, runs: int) -> dict:
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], pnet) as server:
        server.set_stream_handler(SINK, _sink)
        addr = full_addrs(server)[0]
        setup = []
        for _ in range(connects):
            async with open_host(create_new_key_pair(), [], pnet) as client:
                t0 = time.perf_counter()
                await connect(client, addr)
                setup.append((time.perf_counter() - t0) * 1000)
                await client.disconnect(server.get_id())
        rates = []
        async with open_host(create_new_key_pair(), [], pnet) as client:
            await connect(client, addr)
            block = os.urandom(CHUNK)
            for _ in range(runs):
                stream = await client.new_stream(server.get_id(), [SINK])
                t0 = time.perf_counter()
                await stream.write((bulk_mb * 16 * CHUNK).to_bytes(8, "big"))
                for _ in range(bulk_mb * 16):
                    await stream.write(block)
                with trio.fail_after(120):  # the sink answers once it has read everything
                    assert await stream.read(1) == b"k"
                await stream.close()
                rates.append(bulk_mb * 1.048576 / (time.perf_counter() - t0))
    return {"connect_ms": round(statistics.median(setup), 2), "bulk_mb_s": round(statistics.median(rates), 1)}


def decode_figures(runs: int, tokens: int) -> dict:
    keyed, open_ = Mesh(), Mesh()
    try:
        key = write_new_swarm_key(keyed.root / "swarm.key")
        chains = {"keyed": keyed.start_chain(RANGES, extra=["--swarm-key", key.path, "--threads", "1"]),
                  "open": open_.start_chain(RANGES, extra=["--threads", "1"])}
        got: dict[str, list[dict]] = {"keyed": [], "open": []}
        for _ in range(runs):
            for name, chain in chains.items():
                out = ctl(chain[0].socket, ["generate", "--max-tokens", str(tokens), "--ignore-eos", "--stats", PROMPT],
                          timeout=600)
                if out.returncode != 0:
                    raise RuntimeError(f"{name}: {out.stderr}")
                got[name].append(json.loads(out.stderr.strip().splitlines()[-1]))
        return {name: {"decode_tok_per_s": round(statistics.median(s["decode_tok_per_s"] for s in stats), 1),
                       "ttft_s": round(statistics.median(s["ttft_s"] for s in stats), 3)}
                for name, stats in got.items()}
    finally:
        keyed.close()
        open_.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connects", type=int, default=30)
    ap.add_argument("--bulk-mb", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-mesh", action="store_true", help="skip the three-daemon decode figures")
    args = ap.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # hang-ups of the throwaway hosts are no news
    out: dict = {"cpu": "avx2", "cipher_mb_s": round(cipher_mb_s(), 1)}
    pnet = Pnet(SwarmKey(os.urandom(32)))
    for name, p in (("open", None), ("keyed", pnet), ("open_again", None), ("keyed_again", pnet)):
        out[name] = trio.run(host_figures, p, args.connects, args.bulk_mb, args.runs)
    for name in ("open", "keyed"):  # the two rounds of each, interleaved: the median of both
        a, b = out.pop(name), out.pop(name + "_again")
        out[name] = {k: round(statistics.median([a[k], b[k]]), 2) for k in a}
    if not args.no_mesh:
        for name, figures in decode_figures(args.runs, args.tokens).items():
            out[name].update(figures)
    ratio = {k: round(out["keyed"][k] / out["open"][k], 3) for k in out["open"] if out["open"][k]}
    out["keyed_over_open"] = ratio
    print(f"pnet cost, loopback, CPU: avx2; XSalsa20 alone {out['cipher_mb_s']} MB/s")
    print(f"{'':8} {'connect ms':>10} {'bulk MB/s':>10} {'decode tok/s':>12} {'ttft s':>7}")
    for name in ("open", "keyed"):
        r = out[name]
        print(f"{name:8} {r['connect_ms']:>10} {r['bulk_mb_s']:>10} {r.get('decode_tok_per_s', '-'):>12}"
              f" {r.get('ttft_s', '-'):>7}")
    print(f"{'ratio':8} {ratio.get('connect_ms', '-'):>10} {ratio.get('bulk_mb_s', '-'):>10}"
          f" {ratio.get('decode_tok_per_s', '-'):>12} {ratio.get('ttft_s', '-'):>7}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
