"""The `meshd` command: `meshd join` runs the daemon; `meshd local` runs a split model in-process."""

from __future__ import annotations

import argparse
import sys

from meshd.node.log import setup_logging

RECIPE_CHOICES = ["auto", "native", "exact", "compact"]  # meshd.shard.recipe.CHOICES, without importing torch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshd", description="Run a language model across machines.")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="run the daemon: join (or start) a mesh and serve layers")
    join.add_argument("--bootstrap", action="append", help="multiaddr of a peer already in the mesh (repeatable)")
    join.add_argument("--model", help="smollm2 (bundled, default), a .gguf file or an HF directory")
    join.add_argument("--layers", help="auto (default), A:B, or none (a bootstrap and relay holding no layers)")
    join.add_argument("--num-layers", type=int, help="with --layers auto: how many layers to serve")
    join.add_argument("--memory", type=int, help="bytes of weights this node may hold (caps --layers auto;"
                                                 " a fixed range that needs more is refused)")
    join.add_argument("--listen", action="append", help="multiaddr to listen on (repeatable)")
    join.add_argument("--state-dir", help="identity and caches (default ~/.local/share/meshd)")
    join.add_argument("--socket", help="control socket path")
    join.add_argument("--recipe", choices=RECIPE_CHOICES,
                      help="auto (default: native for a quantized GGUF, else exact), native, exact or compact")
    join.add_argument("--threads", type=int, help="threads for tensor work (default: one per core; lower it when"
                                                  " daemons on the exact recipe share a machine: torch's threads"
                                                  " spin; the native kernel's take a preempted thread's share)")
    join.add_argument("--http", help="serve the OpenAI-compatible API and /metrics on HOST:PORT (off by default;"
                                     " 127.0.0.1:8080 keeps it on this machine)")
    join.add_argument("--http-token", help="bearer token HTTP clients must send")
    join.add_argument("--http-token-file", help="file holding the bearer token")
    join.add_argument("--kv-budget", type=int, help="bytes of KV cache for all sessions (default 1 GiB)")
    join.add_argument("--max-sessions", type=int, help="sessions held at once; more are refused as busy (default 64)")
    join.add_argument("--max-queue", type=int, help="frames waiting for compute; more are refused as busy"
                      " (default 1024)")
    join.add_argument("--busy-wait", type=float, help="seconds a generation waits for room in a full mesh"
                      " before failing with 'mesh busy' (default 30)")
    join.add_argument("--drain-timeout", type=float, help="on SIGTERM, seconds running generations get to"
                      " finish before the daemon exits (default 30; a second SIGTERM exits at once); after a move,"
                      " seconds they get to finish on the old range before it is freed")
    join.add_argument("--ledger-days", type=float, help="days the work ledger (ledger.sqlite3 in the state directory)"
                      " keeps one row per generation and session before folding them into daily totals per peer"
                      " (default 30; 0: keep no ledger)")
    join.add_argument("--move-cooldown", type=float, help="with --layers auto: seconds after a move to fill a gap"
                      " before this daemon moves again (default 60)")
    join.add_argument("--gather-ms", type=float, help="milliseconds a forward pass waits for other sessions'"
                      " frames before it starts, when some are due (default 0: at once)")
    join.add_argument("--microbatches", type=int, help="groups of generations this entry keeps in separate forward"
                      " passes on every hop, so that a daemon has a pass to run while another group is elsewhere on"
                      " the route (default 2, at most one per daemon on the route; 0: one per daemon on the route)")
    join.add_argument("--speculate", choices=["auto", "off"], help="as an entry: send draft tokens (prompt lookup)"
                      " with each step, verified in one pass down the route, so a trip can return several tokens;"
                      " the text is the same (default auto: drafts where they pay for their rows)")
    join.add_argument("--draft-max", type=int, help="as an entry: draft tokens a step carries at most (default 32; a greedy"
                      " generation sends as many as pay for their rows at the trip and acceptance measured)")
    join.add_argument("--draft", help="as an entry: a draft model (a GGUF file, an HF directory or a bundled name)"
                      " run whole on this daemon to propose the drafts, instead of prompt lookup; it must share the"
                      " model's tokenizer (refused at start otherwise)")
    join.add_argument("--verify-rate", type=float, help="as an entry: share of generations also run on a second"
                      " route of other daemons, a token given only when both routes agree (default 0.05; 0: none)")
    join.add_argument("--relay", choices=["auto", "on", "off"], help="offer circuit relay to daemons that cannot"
                      " be dialled: auto (default: while this daemon is publicly reachable), on, off")
    join.add_argument("--relays", type=int, help="relays this daemon reserves at when it cannot be dialled (default 2;"
                      " 0: none)")
    join.add_argument("--relay-reservations", type=int, help="as a relay: daemons holding a reservation (default 32)")
    join.add_argument("--relay-circuits", type=int, help="as a relay: circuits open at once (default 64)")
    join.add_argument("--relay-circuits-per-peer", type=int, help="as a relay: circuits open at once from or to one"
                      " daemon (default 16)")
    join.add_argument("--relay-circuit-mb", type=int, help="as a relay: MiB one circuit carries before it is cut"
                      " (default 1024)")
    join.add_argument("--relay-circuit-s", type=float, help="as a relay: seconds one circuit lasts (default 3600)")
    join.add_argument("--hole-punch", type=int, choices=[0, 1], help="1 (default): turn relayed connections into"
                      " direct ones where both NATs allow it (DCUtR); 0: keep them relayed")
    join.add_argument("--frame-budget-mb", type=int, help="MiB all peers' frames may occupy here at once, queued,"
                      " half-received or being decoded; past it streams are not read (default 512)")
    join.add_argument("--peer-frame-mb", type=int, help="MiB one peer's frames may occupy; a larger frame is"
                      " refused, more waits (default 192)")
    join.add_argument("--streams-per-peer", type=int, help="shard streams one peer may hold open (default 128)")
    join.add_argument("--frame-timeout", type=float, help="seconds a frame begun may take to arrive whole"
                      " (default 30)")
    join.add_argument("--stream-idle", type=float, help="seconds a shard stream may say nothing before it is"
                      " closed (default 300)")
    join.add_argument("--session-idle", type=float, help="seconds a session may send no frame before its KV is"
                      " released (default 600)")
    join.add_argument("--session-idle-full", type=float, help="seconds a session may send no frame before a new"
                      " session takes its KV when the daemon is full (default 60)")
    join.add_argument("--prefix-ttl", type=float, help="seconds the KV of an ended generation is kept unused for"
                      " a later one that extends its tokens (a chat's next turn); kept KV is the first freed"
                      " when room is needed; 0: keep none and reuse none (default 600)")
    join.add_argument("--peer-share", type=float, help="share of the sessions, the KV budget and the queue that"
                      " one peer may hold; the rest stays for others (default 0.75)")
    join.add_argument("--swarm-key", help="a private mesh's key file (libp2p's /key/swarm/psk/1.0.0/ format, mode"
                      " 0600): only daemons holding the same key can connect (default: an open mesh)")
    join.add_argument("--require-swarm-key", action="store_const", const=1, help="refuse to start without"
                      " --swarm-key (for the systemd unit and shared configs)")
    join.add_argument("--config", help="TOML file (default /etc/meshd/meshd.toml if present)")
    key = sub.add_parser("swarm-key", help="create or inspect a private mesh's key")
    key_sub = key.add_subparsers(dest="key_command", required=True)
    key_sub.add_parser("new", help="write a fresh key (mode 0600) and print its fingerprint").add_argument("file")
    key_sub.add_parser("fingerprint", help="print the fingerprint of a key file").add_argument("file")
    demo = sub.add_parser("demo", help="start three daemons on loopback and generate through them")
    demo.add_argument("prompt", nargs="?", default="Write a haiku about distributed computing.")
    demo.add_argument("--model", default="smollm2")
    demo.add_argument("--max-tokens", type=int, default=64)
    local = sub.add_parser("local", help="run the model in this process, split into shards")
    local.add_argument("prompt")
    local.add_argument("--model", default="smollm2", help="smollm2 (bundled), a .gguf file or an HF directory")
    local.add_argument("--split", default="", help="layer boundaries between shards, e.g. 7,19")
    local.add_argument("--recipe", default="auto", choices=RECIPE_CHOICES)
    local.add_argument("--max-tokens", type=int, default=64)
    local.add_argument("--temperature", type=float, default=0.0)
    local.add_argument("--top-k", type=int, default=0)
    local.add_argument("--top-p", type=float, default=1.0)
    local.add_argument("--seed", type=int, default=0)
    local.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    local.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-text")
    local.add_argument("--stats", action="store_true", help="print timing as JSON on stderr")
    local.add_argument("--threads", type=int, default=0, help="threads for tensor work (default: one per core)")
    for cmd in (join, local):
        cmd.add_argument("--kernel-isa", choices=["portable", "avx2", "avx512"], help="run the block kernel on at most"
                         " this instruction set (default: the best the CPU has; they compute the same bits)")
        cmd.add_argument("--kernel-layout", choices=["auto", "rows", "tiles"], help="keep weights in tiles of eight"
                         " rows where that is faster (auto, the default: Q4_0 and Q4_1 on AVX2 and AVX-512, Q8_0 on"
                         " AVX-512), every weight in the file's rows, or Q4_0, Q4_1 and Q8_0 in tiles everywhere (the"
                         " same bits)")
        cmd.add_argument("--wire-encoding", choices=["raw", "zstd", "auto"], help="how hidden states travel between"
                         " shards: raw float32 (default), zstd, or auto (zstd where it saves a tenth)")
        cmd.add_argument("--chunk-tokens", type=int, help="prompt tokens per prefill chunk (default 128)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        if args.command == "join":
            from meshd.node.daemon import run_daemon
            from dataclasses import fields

            from meshd.node.settings import Settings, load_settings

            flags = {f.name: getattr(args, f.name) for f in fields(Settings) if hasattr(args, f.name)}
            return run_daemon(load_settings(flags, args.config))
        if args.command == "swarm-key":
            return swarm_key_command(args)
        if args.command == "demo":
            from meshd.cli.demo import run_demo

            return run_demo(args)
        if args.command == "local":
            from meshd.cli.local import run_local
            from meshd.node.settings import load_settings

            # the settings of the parts below (wire, cache) as a daemon here has them: flags, MESHD_*, config file
            load_settings({"wire_encoding": args.wire_encoding, "chunk_tokens": args.chunk_tokens,
                           "kernel_isa": args.kernel_isa, "kernel_layout": args.kernel_layout},
                          args.config if hasattr(args, "config") else None).configure()
            return run_local(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        print(f"meshd: error: {exc}", file=sys.stderr)
        return 2
    return 1


def swarm_key_command(args) -> int:
    from meshd.p2p.swarmkey import read_swarm_key, write_new_swarm_key

    if args.key_command == "new":
        key = write_new_swarm_key(args.file)
        print(f"wrote a new swarm key to {key.path} (mode 0600)\nfingerprint {key.fingerprint}")
        print("hand the file to every member over a channel you trust; start each daemon with"
              f" --swarm-key {key.path}", file=sys.stderr)
    else:
        print(read_swarm_key(args.file).fingerprint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
