"""The `meshd` command: `meshd join` runs the daemon; `meshd local` runs a split model in-process."""

from __future__ import annotations

import argparse
import sys

from meshd.core.log import setup_logging
from meshd.core.settings import RECIPES, add_flags, default, flags_given, load_settings

# the settings of the parts below the node (kernel, wire) that `meshd local` takes as a daemon does
LOCAL_SETTINGS = ("kernel_isa", "kernel_layout", "wire_encoding", "chunk_tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshd", description="Run a language model across machines.")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="run the daemon: join (or start) a mesh and serve layers")
    add_flags(join)  # every setting that has a flag, as declared in meshd/core/settings.py
    join.add_argument("--config", help="TOML file (default /etc/meshd/meshd.toml if present)")
    key = sub.add_parser("swarm-key", help="create or inspect a private mesh's key")
    key_sub = key.add_subparsers(dest="key_command", required=True)
    key_sub.add_parser("new", help="write a fresh key (mode 0600) and print its fingerprint").add_argument("file")
    key_sub.add_parser("fingerprint", help="print the fingerprint of a key file").add_argument("file")
    demo = sub.add_parser("demo", help="start three daemons on loopback and generate through them")
    demo.add_argument("prompt", nargs="?", default="Write a haiku about distributed computing.")
    demo.add_argument("--model", default=default("model"))
    demo.add_argument("--max-tokens", type=int, default=64)
    local = sub.add_parser("local", help="run the model in this process, split into shards")
    local.add_argument("prompt")
    local.add_argument("--model", default=default("model"), help="smollm2 (bundled), a .gguf file or an HF directory")
    local.add_argument("--split", default="", help="layer boundaries between shards, e.g. 7,19")
    local.add_argument("--recipe", default=default("recipe"), choices=RECIPES)
    local.add_argument("--max-tokens", type=int, default=64)
    local.add_argument("--temperature", type=float, default=0.0)
    local.add_argument("--top-k", type=int, default=0)
    local.add_argument("--top-p", type=float, default=1.0)
    local.add_argument("--seed", type=int, default=0)
    local.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    local.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-text")
    local.add_argument("--stats", action="store_true", help="print timing as JSON on stderr")
    local.add_argument("--threads", type=int, default=default("threads"),
                       help="threads for tensor work (default: one per core)")
    add_flags(local, LOCAL_SETTINGS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        if args.command == "join":
            from meshd.node.daemon import run_daemon

            return run_daemon(load_settings(flags_given(args), args.config))
        if args.command == "swarm-key":
            return swarm_key_command(args)
        if args.command == "demo":
            from meshd.cli.demo import run_demo

            return run_demo(args)
        if args.command == "local":
            from meshd.cli.local import run_local
            from meshd.node.wiring import configure

            # the settings of the parts below (wire, cache) as a daemon here has them: flags, MESHD_*, config file
            settings = load_settings({name: getattr(args, name) for name in LOCAL_SETTINGS},
                                     args.config if hasattr(args, "config") else None)
            configure(settings)
            return run_local(args, settings)
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
