"""How `meshctl` shows a daemon: `status` and `ledger` as text, from the JSON the daemon answers.

Rule: pure functions of that JSON (no socket, no clock), so each line has a fast test; a field an older
daemon does not send reads as unknown, never as an error. README's "Read `meshctl status`" explains
each line.
"""

from __future__ import annotations


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
    source = spec.get("source")
    model = f", draft model {source['model']} ({source['recipe']})" if isinstance(source, dict) else ""
    return (f"drafts    speculate {spec.get('mode', '-')} (at most {spec.get('draft_max', '-')} a step{model}):"
            f" {sent} sent, {kept} accepted{rate}")


def sessions_line(st: dict) -> str:
    """Open sessions and the KV they hold (ended sessions' kept KV is the prefix line's)."""
    return f"sessions  {st['sessions']} open, {st['kv_bytes'] / 1e6:.1f} MB KV, {st['generations']} generating"


def prefix_line(st: dict) -> str:
    """Prefix reuse: ended sessions' KV kept here, and how often a new session started from it."""
    if "prefix_cache" not in st:
        return "prefix    unknown"
    cache = st["prefix_cache"]
    if cache is None:
        return "prefix    none (no layers held here)"
    hits, asked = cache.get("hits", 0), cache.get("hits", 0) + cache.get("misses", 0)
    ttl = cache.get("ttl_s")
    keeping = "TTL -" if ttl is None else f"TTL {ttl:g} s" + ("" if ttl > 0 else " (keeping off)")
    return (f"prefix    {cache.get('entries', 0)} kept ({cache.get('held_bytes', 0) / 1e6:.1f} MB,"
            f" {cache.get('held_tokens', 0):,} tokens); {hits} hit{'s' * (hits != 1)} of {asked} asked,"
            f" {cache.get('tokens_reused', 0):,} tokens reused; {cache.get('evictions', 0)} evicted; {keeping}")


def prompt_line(stats: dict) -> str:
    """A generation's prompt: its tokens, and how many of them hops held KV of already (not prefilled)."""
    cached = stats.get("cached_tokens") or 0
    return f"prompt {stats.get('prompt_tokens', 0):,} tokens" + (f" ({cached:,} reused)" if cached else "")


def handover_line(h: dict | None) -> str:
    """Hand-overs: sessions' KV this daemon sent when it left and took from others that left, and the routes
    its entry moved off a leaving hop (with the KV, or replayed where the hand-over failed)."""
    if not h:
        return "handover  unknown"
    return (f"handover  {h.get('sent', 0)} sent, {h.get('received', 0)} received ({h.get('positions', 0):,} positions),"
            f" {h.get('failed', 0)} failed, {h.get('refused', 0)} refused; routes moved {h.get('moved', 0)},"
            f" replayed {h.get('replayed', 0)}")


def check_lines(checks: dict | None) -> list[str]:
    """Checked generations (a second route a token must agree with) and the peers excluded after one."""
    if not checks:
        return []
    how = (f" by prefill, windows of {checks.get('verify_window')}, text {checks.get('verify_release')}"
           if checks.get("verify_by") == "prefill" else " in lockstep" if checks.get("verify_by") else "")
    lines = [f"checks    verify rate {checks.get('verify_rate', 0):g}{how}: {checks.get('checked', 0)} checked,"
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
             sessions_line(st), prefix_line(st), load_line(st), draft_line(st.get("speculation")),
             handover_line(st.get("handovers")), *check_lines(st.get("checks"))]
    lines += [f"moved     {st['moved']}"] if st.get("moved") else []
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


def render_ledger(totals: dict) -> str:
    """The ledger's totals as a table: per peer, the work each side did for the other."""
    if not totals.get("enabled"):
        return "no work ledger on this daemon (--ledger-days 0, or its database could not be written)"
    gens, sessions = totals["generations"], totals["sessions"]
    lines = [f"ledger      {totals.get('path')}",
             "generations " + ", ".join(f"{n} {k}" for k, n in gens.items())
             + f" ({totals['checked']} checked, {totals['unchecked']} unchecked)",
             "sessions    " + ", ".join(f"{n} {k}" for k, n in sessions.items()) + " (served for other daemons)"]
    if totals.get("windows"):  # checks by prefill: windows of tokens a second route recomputed, by verdict
        lines.insert(2, "windows     " + ", ".join(f"{n} {k}" for k, n in sorted(totals["windows"].items()))
                     + " (checked by prefill)")
    if not totals["peers"]:
        return "\n".join(lines + ["no work with other peers yet"])
    lines.append(f"{'peer':<54} {'for us (layer-tokens)':>22} {'by us (layer-tokens)':>21}")
    for peer, row in sorted(totals["peers"].items(), key=lambda kv: -(kv[1]["for_us"] + kv[1]["by_us"])):
        lines.append(f"{peer:<54} {row['for_us']:>14} in {row['for_us_rows']:>4}"
                     f" {row['by_us']:>13} in {row['by_us_rows']:>4}")
    return "\n".join(lines)
