"""`meshctl`: talk to the local meshd daemon over its Unix socket.

    meshctl [--socket PATH] status [--json]
    meshctl [--socket PATH] generate [--max-tokens N] [--temperature T] [--top-k K] [--top-p P]
            [--seed S] [--chat] [--stats] [--ignore-eos] [--no-speculate] [--verify]
            [--json-schema FILE | --grammar FILE] PROMPT
    meshctl [--socket PATH] chat [--max-tokens N] [--temperature T] [--system TEXT] [--stats]
    meshctl [--socket PATH] drain [--exit]
    meshctl [--socket PATH] ledger [--json] [--since DATE] [--peer ID]

Generated text goes to stdout and nothing else; `--stats` adds one JSON line on stderr (chat: one line
a turn, its prompt's tokens and how many of them the route held already).
`--json-schema FILE` holds the answer to JSON that validates against the schema in FILE, `--grammar FILE` to
a Lark grammar (llguidance's variant); both are checked before anything is sent.
Exit codes: 0 ok, 2 bad usage (a bad schema or grammar file too), 3 daemon not reachable, 4 no route covers the model,
5 generation failed (a hop failed, ...), 6 mesh busy (no route had room before the entry's --busy-wait).
Rule: the client is a plain blocking socket and `meshd.wire` (no trio, libp2p or torch), so it
starts at once; every request carries its own random id, which the daemons log on every hop.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket as stdlib_socket
import sys
from datetime import datetime
from pathlib import Path

from meshd.cli.render import prompt_line, render_ledger, render_status
from meshd.core.settings import default_socket, default_state_dir
from meshd.wire import Decoder, DrainRequest, GenerateRequest, LedgerRequest, StatusRequest, WireError, encode

EXIT_DOWN, EXIT_NO_ROUTE, EXIT_FAILED, EXIT_BUSY = 3, 4, 5, 6
EXIT_FOR = {"no_route": EXIT_NO_ROUTE, "busy": EXIT_BUSY}


class DaemonUnreachable(Exception):
    pass


class BadUsage(Exception):
    """The command line cannot be served as given (exit 2)."""


class DaemonSilent(Exception):
    """The daemon closed the connection or sent nothing in time."""


def socket_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("MESHD_SOCKET"):
        return Path(os.environ["MESHD_SOCKET"])
    return default_socket(Path(os.environ.get("MESHD_STATE_DIR") or default_state_dir()))


def new_request_id() -> int:
    """A random id (53 bits, so it survives any JSON) that follows the request across daemons."""
    return random.SystemRandom().getrandbits(53) or 1


class Connection:
    """One request's conversation with the daemon: frames over a blocking Unix socket."""

    def __init__(self, path: Path) -> None:
        self.sock = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
        try:
            self.sock.connect(str(path))
        except FileNotFoundError:
            raise DaemonUnreachable(f"no daemon socket at {path}: is meshd running? (start it with `meshd join`)")
        except PermissionError:
            raise DaemonUnreachable(f"permission denied on {path}: run meshctl as the daemon's user")
        except ConnectionRefusedError:
            raise DaemonUnreachable(f"nothing listens on {path}: the daemon is not running (stale socket)")
        except OSError as exc:
            raise DaemonUnreachable(f"cannot reach the daemon at {path}: {exc}")
        self.decoder, self.pending = Decoder(), []

    def send(self, msg) -> None:
        self.sock.sendall(encode(msg))

    def receive(self, timeout: float):
        self.sock.settimeout(timeout)
        while not self.pending:
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                raise DaemonSilent(f"no answer within {timeout:.0f} s") from None
            except OSError as exc:
                raise DaemonSilent(f"connection failed: {exc}") from None
            if not data:
                raise DaemonSilent("the daemon closed the connection")
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def close(self) -> None:
        self.sock.close()


def fetch_status(path: Path, timeout: float = 10.0) -> dict:
    conn = Connection(path)
    try:
        conn.send(StatusRequest(request_id=new_request_id()))
        return dict(conn.receive(timeout).stats)
    finally:
        conn.close()


def stream_answer(path: Path, req: GenerateRequest, timeout: float, out=sys.stdout) -> tuple[int, dict, str]:
    """Send one request, write its text to `out` as it arrives; (exit code, stats, text). A checked generation
    whose text goes out at once may take some back (a `retract` event): it is said on stderr, and the text
    that stands is written again on a new line, the rest following it, so that the last one is the answer."""
    conn = Connection(path)
    text = []
    try:
        conn.send(req)
        while True:
            event = conn.receive(timeout)
            if event.kind == "text":
                out.write(event.text)
                out.flush()
                text.append(event.text)
            elif event.kind == "retract":
                kept = "".join(text)[:int(event.stats.get("keep_chars", 0))]
                print(f"\nmeshctl: {event.text} (the first {event.stats.get('tokens', 0)} generated tokens stand);"
                      " the text as it stands follows", file=sys.stderr)
                out.write("\n" + kept)
                out.flush()
                text = [kept]
            elif event.kind == "done":
                return 0, dict(event.stats), "".join(text)
            elif event.kind == "error":
                code = event.stats.get("code", "")
                print(f"meshctl: generation failed ({code}): {event.text}", file=sys.stderr)
                return EXIT_FOR.get(code, EXIT_FAILED), {}, "".join(text)
    except DaemonSilent as exc:
        print(f"meshctl: {exc} (mid-generation)", file=sys.stderr)
        return EXIT_FAILED, {}, "".join(text)
    except WireError as exc:
        print(f"meshctl: bad answer from the daemon: {exc}", file=sys.stderr)
        return EXIT_FAILED, {}, "".join(text)
    finally:
        conn.close()


def generate_request(args) -> GenerateRequest:
    """The request `meshctl generate` sends; BadUsage for a schema or grammar file that cannot be enforced."""
    return GenerateRequest(request_id=new_request_id(), prompt=args.prompt, max_tokens=args.max_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           chat=args.chat, ignore_eos=args.ignore_eos, speculate=not args.no_speculate,
                           verify=args.verify, grammar=grammar_file(args.json_schema, args.grammar))


def grammar_file(schema_path: str | None, lark_path: str | None) -> str:
    """The grammar a --json-schema or --grammar file gives ("" for neither), checked as the HTTP API checks
    one (llguidance is imported only here: meshctl starts at once otherwise)."""
    if not schema_path and not lark_path:
        return ""
    from meshd.api import structured

    flag, path = ("--json-schema", schema_path) if schema_path else ("--grammar", lark_path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadUsage(f"{flag} {path}: cannot read it: {exc}") from None
    try:
        if lark_path:
            return structured.lark_grammar(text, f"{flag} {path}")
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise BadUsage(f"{flag} {path}: not JSON: {exc}") from None
        structured.check_schema(schema, f"{flag} {path}")
        return structured.schema_grammar(schema)
    except structured.Refused as exc:
        raise BadUsage(str(exc)) from None


def generate(path: Path, args) -> int:
    req = generate_request(args)
    code, stats, _ = stream_answer(path, req, args.timeout)
    if code == 0:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.stats:
            print(json.dumps(stats | {"request_id": req.request_id}), file=sys.stderr)
    return code


def chat(path: Path, args, read=input) -> int:
    """An interactive conversation: each answer streams, the whole conversation goes with each turn.
    Ctrl-D ends it; Ctrl-C ends it too (a generation under way is cancelled with the connection)."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    fetch_status(path)  # say at once if no daemon is there
    print("meshctl chat: Ctrl-D or Ctrl-C to leave", file=sys.stderr)
    while True:
        try:
            line = read("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        req = GenerateRequest(request_id=new_request_id(), prompt="", messages=json.dumps(messages),
                              max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        code, stats, answer = stream_answer(path, req, args.timeout)
        print()
        if code != 0:
            messages.pop()
            continue
        if args.stats:  # each turn sends the whole conversation: the turns before are reused where kept
            print(f"[{prompt_line(stats)}, {stats.get('tokens', 0):,} generated]", file=sys.stderr)
        messages.append({"role": "assistant", "content": answer})


def drain(path: Path, args) -> int:
    """Ask the daemon to drain; returns once it has (its status follows on stdout)."""
    conn = Connection(path)
    try:
        conn.send(DrainRequest(request_id=new_request_id(), exit=args.exit))
        event = conn.receive(args.timeout)
    except DaemonSilent as exc:
        if args.exit:  # the daemon stopped before it could answer
            return 0
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        conn.close()
    if event.kind == "error":
        print(f"meshctl: {event.text}", file=sys.stderr)
        return EXIT_FAILED
    st = dict(event.stats)
    print(f"drained: {st['sessions']} sessions open, state {st['state']}")
    return 0


def parse_since(text: str | None) -> float:
    """`--since`: a date (2026-12-01), a date and time (2026-12-01T14:00, local time), or seconds since the epoch."""
    if not text:
        return 0.0
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(f"--since {text!r}: a date like 2026-12-01, or seconds since the epoch"
                                         ) from None


def ledger(path: Path, args) -> int:
    conn = Connection(path)
    try:
        conn.send(LedgerRequest(request_id=new_request_id(), since=args.since, peer=args.peer or ""))
        event = conn.receive(args.timeout)
    finally:
        conn.close()
    if event.kind == "error":
        print(f"meshctl: {event.text}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(dict(event.stats)) if args.json else render_ledger(dict(event.stats)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshctl", description="Talk to the local meshd daemon.")
    p.add_argument("--socket", help="the daemon's control socket (default: as meshd chooses)")
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="this node, its peers and the coverage map")
    st.add_argument("--json", action="store_true", help="one JSON object")
    g = sub.add_parser("generate", help="stream generated text to stdout")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stats", action="store_true", help="last stderr line: JSON timing and route")
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens, past end-of-text")
    g.add_argument("--no-speculate", action="store_true", help="plain decoding: no draft tokens for this request"
                   " (the text is the same; speculation only changes how many tokens a trip returns)")
    g.add_argument("--verify", action="store_true", help="check this generation on a second route of other daemons:"
                   " a token only when both agree (--stats says verified: false where a range has no replica)")
    g.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each event")
    held = g.add_mutually_exclusive_group()
    held.add_argument("--json-schema", metavar="FILE", help="answer with JSON that validates against the JSON schema"
                      " in FILE (enforced where tokens are sampled)")
    held.add_argument("--grammar", metavar="FILE", help="answer in the language of the Lark grammar in FILE"
                      " (llguidance's Lark: %%json {...} embeds a schema)")
    dr = sub.add_parser("drain", help="stop taking sessions and wait until running generations finish")
    dr.add_argument("--exit", action="store_true", help="then stop the daemon (as SIGTERM does)")
    dr.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the drain")
    lg = sub.add_parser("ledger", help="the work this daemon and each peer did for each other")
    lg.add_argument("--json", action="store_true", help="one JSON object")
    lg.add_argument("--since", type=parse_since, default=0.0, help="only work since this date (2026-12-01)"
                    " or time (seconds since the epoch)")
    lg.add_argument("--peer", help="only this peer id")
    lg.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    c = sub.add_parser("chat", help="an interactive chat in the terminal")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--system", default="", help="a system message that opens the conversation")
    c.add_argument("--stats", action="store_true", help="after each answer, a stderr line: the prompt's tokens,"
                   " how many of them were reused (KV the route kept of the turns before), and the tokens generated")
    c.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each event")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = socket_path(args.socket)
    try:
        if args.command == "status":
            st = fetch_status(path)
            print(json.dumps(st) if args.json else render_status(st))
            return 0
        if args.command == "chat":
            return chat(path, args)
        if args.command == "drain":
            return drain(path, args)
        if args.command == "ledger":
            return ledger(path, args)
        return generate(path, args)
    except BadUsage as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return 2
    except DaemonUnreachable as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_DOWN
    except (DaemonSilent, WireError) as exc:
        print(f"meshctl: the daemon did not answer: {exc}", file=sys.stderr)
        return EXIT_DOWN
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
