"""`meshctl`: talk to the local meshd daemon over its Unix socket.

    meshctl [--socket PATH] status [--json]
    meshctl [--socket PATH] generate [--max-tokens N] [--temperature T] [--top-k K] [--top-p P]
            [--seed S] [--chat] [--stats] [--ignore-eos] [--no-speculate] [--verify] PROMPT
    meshctl [--socket PATH] chat [--max-tokens N] [--temperature T] [--system TEXT]
    meshctl [--socket PATH] drain [--exit]
    meshctl [--socket PATH] ledger [--json] [--since DATE] [--peer ID]

Generated text goes to stdout and nothing else; `--stats` adds one JSON line on stderr.
Exit codes: 0 ok, 2 bad usage, 3 daemon not reachable, 4 no route covers the model,
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

from meshd.node.settings import default_socket, default_state_dir
from meshd.wire import Decoder, DrainRequest, GenerateRequest, LedgerRequest, StatusRequest, WireError, encode

EXIT_DOWN, EXIT_NO_ROUTE, EXIT_FAILED, EXIT_BUSY = 3, 4, 5, 6
EXIT_FOR = {"no_route": EXIT_NO_ROUTE, "busy": EXIT_BUSY}


class DaemonUnreachable(Exception):
    pass


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


def coverage_lines(counts: list[int]) -> list[str]:
    """The coverage map as text: one digit per layer (servers), gaps marked underneath."""
    if not counts:
        return ["coverage: unknown"]
    tens = "".join(str(i // 10) if i % 10 == 0 else " " for i in range(len(counts)))
    ones = "".join(str(i % 10) for i in range(len(counts)))
    row = "".join("." if c == 0 else (str(c) if c < 10 else "+") for c in counts)
    marks = "".join("^" if c == 0 else " " for c in counts)
    lines = [f"  layer    {tens}", f"           {ones}", f"  servers  {row}"]
    if any(c == 0 for c in counts):
        lines.append(f"  gaps     {marks}")
    return lines


def load_line(st: dict) -> str:
    """Batching and admission at a glance: queue, batch sizes, busy refusals."""
    b = st.get("batches") or {}
    mean = b.get("mean_batch")
    groups = st.get("microbatches") or []
    spread = f", generations per microbatch {'/'.join(map(str, groups))}" if groups else ""
    return (f"load      {st.get('queue', 0)} frames queued, batches of {mean if mean is not None else '-'}"
            f" on average (largest {b.get('largest_batch', 0)}, {b.get('passes', 0)} passes),"
            f" {st.get('busy_refusals', 0)} refused busy, limit {st.get('max_sessions', '-')} sessions{spread}")


def draft_line(spec: dict | None) -> str:
    """Speculation: the entry's setting, and how many draft tokens went down routes and stood."""
    if not spec:
        return "drafts    unknown"
    sent, kept = spec.get("drafted", 0), spec.get("accepted", 0)
    rate = f" ({100 * kept / sent:.0f}%)" if sent else ""
    return (f"drafts    speculate {spec.get('mode', '-')} (at most {spec.get('draft_max', '-')} a step):"
            f" {sent} sent, {kept} accepted{rate}")


def check_lines(checks: dict | None) -> list[str]:
    """Checked generations (a second route a token must agree with) and the peers excluded after one."""
    if not checks:
        return []
    lines = [f"checks    verify rate {checks.get('verify_rate', 0):g}: {checks.get('checked', 0)} checked,"
             f" {checks.get('disagreed', 0)} disagreed, {len(checks.get('excluded', []))} peers excluded"]
    lines += [f"excluded  {row['peer']} for {row['left_s']:.0f} s more (time {row['times']}): {row['reason']}"
              for row in checks.get("excluded", [])]
    return lines


def mesh_key_line(key: dict | None) -> str:
    """Whether only holders of a swarm key may connect."""
    if not key or not key.get("private"):
        return "mesh      open mesh"
    n = key.get("refused", 0)
    return (f"mesh      private mesh, key {key['fingerprint']}"
            + (f"; {n} connection{'s' * (n != 1)} without the key refused" if n else ""))


def reach_line(reach: dict | None) -> str:
    """Whether peers could dial this node back, and what they saw."""
    if not reach or reach["status"] == "unknown":
        return "reach     unknown (no peer has dialled back yet)"
    if reach["status"] == "public":
        n = len(reach["confirmed_by"])
        return f"reach     public: {n} peer{'s' * (n != 1)} dialled back {', '.join(reach['reached_at'])}"
    n = len(reach["refuted_by"])
    seen = f"; seen as {', '.join(reach['observed'])}" if reach["observed"] else ""
    return f"reach     private: {n} peer{'s' * (n != 1)} could not dial back{seen}"


def relay_lines(relay: dict | None) -> list[str]:
    """The relay this daemon offers, the relays it reserved at, and peers it reaches only through one."""
    if not relay:
        return []
    svc, cli = relay.get("service"), relay.get("client")
    if svc is None:
        lines = ["relay     off"]
    elif not svc["on"]:
        lines = ["relay     not offered while this daemon is not publicly reachable"]
    else:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(svc["refused"].items())) or "none"
        lines = [f"relay     offered: {svc['reservations']} reservations, {svc['circuits']} circuits open"
                 f" ({svc['served']} served, {svc['relayed_bytes'] / 1e6:.1f} MB relayed); refused: {refused}"]
    if cli and cli["relays"]:
        held = ", ".join(r["peer_id"][-8:] for r in cli["relays"])
        lines.append(f"relays    reserved at {len(cli['relays'])} of {cli['want']}: {held}"
                     + (f"; {cli['lost']} lost" if cli["lost"] else ""))
        lines += [f"  circuit {a}" for a in cli["circuit_addrs"]]
    elif cli and cli["want"]:
        lines.append(f"relays    none reserved yet (want {cli['want']})")
    punch = relay.get("hole_punch")
    relayed = len(relay.get("relayed_peers") or ())
    if relayed or (punch and punch["attempts"]):
        line = f"relayed   {relayed} peer{'s' * (relayed != 1)} reached through a relay"
        if punch is None:
            line += "; hole punching off"
        elif punch["attempts"]:
            line += (f"; hole punching: {punch['upgraded']} of {punch['attempts']} attempts went direct"
                     + (f" (median {punch['median_s']:.2f} s)" if punch["median_s"] is not None else ""))
        lines.append(line)
    return lines


def render_status(st: dict) -> str:
    rng = st.get("range")
    lines = [f"peer      {st['peer_id']}", f"state     {st['state']}" + (f" ({st['drain_reason']})" if st.get("drain_reason") else ""),
             f"model     {st['model']} ({(st.get('model_fingerprint') or '')[:12]}, recipe {st['recipe']})",
             ("layers    none (bootstrap and relay only)" if rng and rng[0] == rng[1] else
              f"layers    {rng[0]}:{rng[1]} of {st['n_layers']}" if rng else "layers    (not chosen yet)"),
             f"memory    {st.get('weight_bytes', 0) / 1e6:.1f} MB weights, {st.get('rss_bytes', 0) / 1e6:.0f} MB resident"
             f" (loaded in {st.get('load_s') or 0:.2f} s)",
             f"sessions  {st['sessions']} open, {st['kv_bytes'] / 1e6:.1f} MB KV, {st['generations']} generating",
             load_line(st), draft_line(st.get("speculation")), *check_lines(st.get("checks"))] + ([f"moved     {st['moved']}"] if st.get("moved") else [])
    lines += [f"addr      {a}" for a in st["addrs"]]
    lines.append(mesh_key_line(st.get("mesh_key")))
    lines.append(reach_line(st.get("reachability")))
    lines += relay_lines(st.get("relay"))
    lines += [f"http      {h}  (dashboard, OpenAI API, /metrics)" for h in st.get("http") or []]
    lines.append(f"peers     {len(st['peers'])}")
    for p in st["peers"]:
        state = "serving" if p["serving"] else ("relay" if p["range"][0] == p["range"][1] else "loading")
        rtt = f"{p['rtt_ms']:.1f} ms" if p.get("rtt_ms") is not None else "? ms"
        lines.append(f"  {p['peer_id']}  layers {p['range'][0]:>3}:{p['range'][1]:<3} {state:8}"
                     f" {p['throughput']:>8.1f} layer/s  rtt {rtt:>8}  expires in {p['expires_in_s']:.0f}s"
                     + ("  via relay" if p.get("relay_addrs") else ""))
    gaps = st.get("gaps") or []
    verdict = "complete" if st.get("complete") else "INCOMPLETE, uncovered: " + ", ".join(f"[{a}, {b})" for a, b in gaps)
    lines.append(f"coverage  {verdict}")
    lines += coverage_lines(st.get("coverage") or [])
    return "\n".join(lines)


def stream_answer(path: Path, req: GenerateRequest, timeout: float, out=sys.stdout) -> tuple[int, dict, str]:
    """Send one request, write its text to `out` as it arrives; (exit code, stats, text)."""
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


def generate(path: Path, args) -> int:
    req = GenerateRequest(request_id=new_request_id(), prompt=args.prompt, max_tokens=args.max_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          chat=args.chat, ignore_eos=args.ignore_eos, speculate=not args.no_speculate,
                          verify=args.verify)
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
        code, _, answer = stream_answer(path, req, args.timeout)
        print()
        if code != 0:
            messages.pop()
            continue
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


def render_ledger(totals: dict) -> str:
    """The ledger's totals as a table: per peer, the work each side did for the other."""
    if not totals.get("enabled"):
        return "no work ledger on this daemon (--ledger-days 0, or its database could not be written)"
    gens, sessions = totals["generations"], totals["sessions"]
    lines = [f"ledger      {totals.get('path')}",
             "generations " + ", ".join(f"{n} {k}" for k, n in gens.items())
             + f" ({totals['checked']} checked, {totals['unchecked']} unchecked)",
             "sessions    " + ", ".join(f"{n} {k}" for k, n in sessions.items()) + " (served for other daemons)"]
    if not totals["peers"]:
        return "\n".join(lines + ["no work with other peers yet"])
    lines.append(f"{'peer':<54} {'for us (layer-tokens)':>22} {'by us (layer-tokens)':>21}")
    for peer, row in sorted(totals["peers"].items(), key=lambda kv: -(kv[1]["for_us"] + kv[1]["by_us"])):
        lines.append(f"{peer:<54} {row['for_us']:>14} in {row['for_us_rows']:>4}"
                     f" {row['by_us']:>13} in {row['by_us_rows']:>4}")
    return "\n".join(lines)


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
