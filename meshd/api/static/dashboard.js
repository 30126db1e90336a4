// meshd's dashboard: the mesh as this daemon sees it, read from /v1/meshd/status every few seconds,
// and a chat that streams through this daemon's /v1/chat/completions. Everything is drawn here, from
// that JSON; nothing is loaded from elsewhere. With an API token, nothing of the mesh is asked for
// (or shown) until the token is given; it is kept in this tab's sessionStorage only.
"use strict";
(() => {
  const POLL_MS = 2000;
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);
  let token = sessionStorage.getItem("meshd-token") || "";
  let timer = null;
  let conversation = []; // this tab's own turns: the status never carries anybody's text
  let generating = false;

  function authHeaders(extra) {
    const h = Object.assign({}, extra || {});
    if (token) h.Authorization = "Bearer " + token;
    return h;
  }

  // ---- polling ----

  async function poll() {
    clearTimeout(timer);
    try {
      const r = await fetch("/v1/meshd/status", { headers: authHeaders(), cache: "no-store" });
      if (r.status === 401) {
        showLogin(token ? "The daemon refused that token." : "");
        return; // nothing more is asked until a token is given
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      const st = await r.json();
      showMesh();
      render(st);
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      $("updated").textContent = "daemon unreachable (" + e.message + "); retrying";
    }
    timer = setTimeout(poll, POLL_MS);
  }

  function showLogin(why) {
    clearTimeout(timer);
    for (const id of ["coverage", "node", "coverage-notes", "model", "verdict", "chat-log"]) $(id).textContent = "";
    $("recent").tBodies[0].textContent = "";
    conversation = [];
    $("mesh").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = why;
    $("updated").textContent = "token needed";
    $("token").focus();
  }

  function showMesh() {
    $("login").hidden = true;
    $("mesh").hidden = false;
  }

  function render(st) {
    $("model").textContent = `${st.model} · ${st.n_layers} layers · recipe ${st.recipe}`;
    const verdict = $("verdict");
    verdict.textContent = st.complete ? "complete" : "INCOMPLETE";
    verdict.className = st.complete ? "complete" : "incomplete";
    drawCoverage(st);
    describeNode(st);
    listRecent(st.recent_generations || []);
  }

  // ---- the coverage map ----

  function servers(st) {
    const relayed = new Set((st.relay && st.relay.relayed_peers) || []);
    const out = [];
    if (st.range && st.range[1] > st.range[0]) {
      out.push({ peer: st.peer_id, start: st.range[0], end: st.range[1], state: st.state,
                 throughput: st.throughput, rtt: null, link: "self" });
    }
    for (const p of st.peers || []) {
      if (p.range[1] <= p.range[0]) continue; // a relay or bootstrap node: no layers
      out.push({ peer: p.peer_id, start: p.range[0], end: p.range[1], state: p.serving ? "serving" : "loading",
                 throughput: p.throughput, rtt: p.rtt_ms, circuits: (p.relay_addrs || []).length,
                 link: p.excluded ? "excluded" : relayed.has(p.peer_id) ? "relayed" : "direct" });
    }
    // by first layer, this daemon first among equals (so it keeps the top lane), then by last layer
    const own = (b) => (b.link === "self" ? 0 : 1);
    return out.sort((a, b) => a.start - b.start || own(a) - own(b) || a.end - b.end || (a.peer < b.peer ? -1 : 1));
  }

  function stack(bars) {
    // replicas stacked: each bar goes in the first lane that is free where it starts
    const ends = [];
    for (const b of bars) {
      let lane = ends.findIndex((e) => e <= b.start);
      if (lane < 0) lane = ends.push(0) - 1;
      b.lane = lane;
      ends[lane] = b.end;
    }
    return Math.max(ends.length, 1);
  }

  function svgEl(name, attrs, parent, text) {
    const e = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  const LINK_WORDS = { self: "this daemon", direct: "reached directly", relayed: "reached through a relay",
                       excluded: "excluded from routes" };

  function short(peer) {
    return peer ? "…" + peer.slice(-6) : "?";
  }

  function barTitle(b) {
    const rtt = b.rtt === null || b.rtt === undefined ? "rtt ?" : `rtt ${b.rtt.toFixed(1)} ms`;
    const circuits = b.circuits ? ` (publishes ${b.circuits} relay circuit${b.circuits > 1 ? "s" : ""})` : "";
    return `${b.peer}\n${b.state} · layers ${b.start}:${b.end}\n` +
           `${Number(b.throughput || 0).toFixed(1)} layer/s · ${rtt}\n${LINK_WORDS[b.link]}${circuits}`;
  }

  function drawCoverage(st) {
    const n = st.n_layers || 1, bars = servers(st), lanes = stack(bars);
    const left = 8, width = 900, laneH = 28, top = 18, px = (width - 2 * left) / n;
    const height = top + lanes * laneH + 40;
    const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, role: "img" });
    svgEl("title", {}, svg, "coverage map: layers left to right, one bar per server");
    const axis = svgEl("g", { class: "axis" }, svg);
    for (let i = 0; i <= n; i += n > 40 ? 10 : 5) {
      const x = left + i * px;
      svgEl("line", { x1: x, x2: x, y1: top - 4, y2: top + lanes * laneH }, axis);
      svgEl("text", { x: x, y: 11, "text-anchor": "middle" }, axis, String(i));
    }
    for (const gap of st.gaps || []) drawGap(svg, gap, left, px, top, lanes * laneH);
    for (const b of bars) drawBar(svg, b, left, px, top + b.lane * laneH, laneH - 4);
    drawCounts(svg, st.coverage || [], left, px, top + lanes * laneH + 28);
    $("coverage").replaceChildren(svg);
    const relays = (st.peers || []).filter((p) => p.range[1] <= p.range[0]).map((p) => short(p.peer_id));
    $("coverage-notes").textContent = (st.gaps || []).length
      ? "uncovered: " + st.gaps.map(([a, b]) => `[${a}, ${b})`).join(", ") : "every layer is served";
    if (relays.length) $("coverage-notes").textContent += ` · relay/bootstrap nodes without layers: ${relays.join(", ")}`;
  }

  function drawBar(svg, b, left, px, y, h) {
    const g = svgEl("g", { class: `bar ${b.state} ${b.link}`, "data-peer": b.peer, "data-range": `${b.start}:${b.end}`,
                           "data-state": b.state, "data-link": b.link }, svg);
    svgEl("title", {}, g, barTitle(b));
    const x = left + b.start * px, w = (b.end - b.start) * px;
    svgEl("rect", { x: x, y: y, width: Math.max(w, 1), height: h, rx: 3 }, g);
    const label = w > 110 ? `${short(b.peer)} ${b.start}:${b.end}` : `${b.start}:${b.end}`;
    if (w > 28) svgEl("text", { x: x + 5, y: y + h / 2 + 4 }, g, label);
  }

  function drawGap(svg, [a, b], left, px, top, h) {
    const g = svgEl("g", { class: "gap", "data-range": `${a}:${b}` }, svg);
    svgEl("title", {}, g, `layers ${a}:${b}: no live daemon serves them`);
    svgEl("rect", { x: left + a * px, y: top - 2, width: (b - a) * px, height: h + 4 }, g);
    svgEl("text", { x: left + a * px + 4, y: top + h + 14 }, g, `gap ${a}:${b}`);
  }

  function drawCounts(svg, counts, left, px, y) {
    const g = svgEl("g", { class: "counts" }, svg);
    svgEl("title", {}, g, "live servers per layer");
    counts.forEach((c, i) => svgEl("text", { class: "count", x: left + (i + 0.5) * px, y: y, "text-anchor": "middle" },
                                   g, c ? String(c) : "·"));
  }

  // ---- this daemon ----

  function mb(bytes) {
    return `${((bytes || 0) / 1e6).toFixed(1)} MB`;
  }

  function nodeRows(st) {
    const b = st.batches || {}, rng = st.range;
    const layers = !rng ? "not chosen yet" : rng[0] === rng[1] ? "none (relay and bootstrap only)"
      : `${rng[0]}:${rng[1]} of ${st.n_layers}`;
    const ratio = st.file_bytes ? ` (${(st.weight_bytes / st.file_bytes).toFixed(2)}× the file)` : "";
    return [
      ["peer", st.peer_id],
      ["state", st.state + (st.drain_reason ? ` (${st.drain_reason})` : "")],
      ["layers", layers],
      ["memory", `${mb(st.weight_bytes)} weights for ${mb(st.file_bytes)} in the file${ratio}; ${mb(st.rss_bytes)} resident`],
      ["sessions", sessionsText(st)],
      ["prefix", prefixText(st)],
      ["handover", handoverText(st.handovers)],
      ["queue", `${st.queue || 0} frames waiting for a pass`],
      ["batches", b.passes ? `mean ${b.mean_batch} sessions/pass, largest ${b.largest_batch}, ${b.passes} passes`
        : "no pass yet"],
      ["busy", `${st.busy_refusals || 0} refused busy; limit ${st.max_sessions ?? "-"} sessions`],
      ["reach", reachText(st.reachability)],
      ["relays", relayText(st.relay)],
      ["uptime", `${Math.round(st.uptime_s || 0)} s`],
    ];
  }

  function sessionsText(st) {
    // open sessions' KV; ended sessions' kept KV is the prefix row's
    return `${st.sessions} open, ${mb(st.kv_bytes)} KV, ${st.generations} generating`;
  }

  function prefixText(st) {
    // KV kept of ended sessions, for a later generation that extends the same tokens (meshd/shard/prefix.py)
    if (!("prefix_cache" in st)) return "unknown";
    const p = st.prefix_cache;
    if (!p) return "none (no layers held here)";
    const n = (v) => Number(v || 0).toLocaleString("en-US");
    const hits = p.hits || 0, asked = hits + (p.misses || 0);
    const ttl = p.ttl_s === undefined || p.ttl_s === null ? "TTL -" : `TTL ${p.ttl_s} s${p.ttl_s > 0 ? "" : " (keeping off)"}`;
    return `${n(p.entries)} kept (${mb(p.held_bytes)}, ${n(p.held_tokens)} tokens); ${hits} hit${hits === 1 ? "" : "s"}` +
           ` of ${asked} asked, ${n(p.tokens_reused)} tokens reused; ${n(p.evictions)} evicted; ${ttl}`;
  }

  function handoverText(h) {
    // sessions' KV handed to a replica when a hop left on purpose (meshd/hop/handover.py)
    if (!h) return "unknown";
    const n = (v) => Number(v || 0).toLocaleString("en-US");
    return `${n(h.sent)} sent, ${n(h.received)} received (${n(h.positions)} positions), ${n(h.failed)} failed,` +
           ` ${n(h.refused)} refused; routes moved ${n(h.moved)}, replayed ${n(h.replayed)}`;
  }

  function reachText(r) {
    if (!r || r.status === "unknown") return "unknown (no peer has dialled back yet)";
    if (r.status === "public") return `public: ${r.confirmed_by.length} peer(s) dialled back ${r.reached_at.join(", ")}`;
    return `private: ${r.refuted_by.length} peer(s) could not dial back` +
           (r.observed.length ? `; seen as ${r.observed.join(", ")}` : "");
  }

  function relayText(relay) {
    if (!relay) return "-";
    const parts = [], svc = relay.service, cli = relay.client;
    if (!svc) parts.push("offers none");
    else if (!svc.on) parts.push("not offered while not publicly reachable");
    else parts.push(`offers: ${svc.reservations} reservations, ${svc.circuits} circuits open, ${mb(svc.relayed_bytes)} relayed`);
    if (cli && cli.relays && cli.relays.length) parts.push(`reserved at ${cli.relays.map((r) => short(r.peer_id)).join(", ")}`);
    parts.push(`${(relay.relayed_peers || []).length} peer(s) reached through a relay`);
    return parts.join("; ");
  }

  function describeNode(st) {
    const dl = $("node");
    dl.textContent = "";
    for (const [k, v] of nodeRows(st)) {
      const dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = k;
      dd.textContent = v;
      dd.dataset.key = k;
      dl.append(dt, dd);
    }
  }

  // ---- recent generations ----

  function listRecent(rows) {
    const body = $("recent").tBodies[0];
    body.textContent = "";
    $("recent-empty").hidden = rows.length > 0;
    for (const g of rows) {
      const tr = body.insertRow();
      const cells = [new Date(g.ended_at * 1000).toLocaleTimeString(), g.outcome, g.tokens,
                     g.ttft_s === null ? "-" : `${Math.round(g.ttft_s * 1000)} ms`,
                     g.tok_per_s === null ? "-" : g.tok_per_s.toFixed(1), null, g.reroutes];
      cells.forEach((c, i) => {
        const td = tr.insertCell();
        if (c === null) routeCell(td, g.route || []);
        else td.textContent = String(c);
      });
    }
  }

  function routeCell(td, route) {
    td.className = "route";
    td.title = route.map(([p, a, b]) => `${p} ${a}:${b}`).join("\n");
    route.forEach(([p, a, b], i) => {
      const span = document.createElement("span");
      span.textContent = (i ? " → " : "") + `${short(p)} ${a}:${b}`;
      td.append(span, " ");
    });
    if (!route.length) td.textContent = "-";
  }

  // ---- the chat ----

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    $("chat-log").appendChild(div);
    div.scrollIntoView({ block: "nearest" });
    return div;
  }

  async function readEvents(response, onData) {
    // server-sent events: "data: {...}" lines, events apart by a blank line, "data: [DONE]" last
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ") && line !== "data: [DONE]") onData(JSON.parse(line.slice(6)));
        }
      }
    }
  }

  async function errorOf(response) {
    try {
      return (await response.json()).error.message;
    } catch (e) {
      return "HTTP " + response.status;
    }
  }

  async function streamAnswer(out) {
    const body = { messages: conversation, stream: true, max_tokens: Number($("chat-max").value) || 128,
                   temperature: Number($("chat-temp").value) || 0 };
    const r = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
                                                    headers: authHeaders({ "content-type": "application/json" }) });
    if (r.status === 401) {
      showLogin("The daemon refused the token.");
      throw new Error("token refused");
    }
    if (!r.ok) throw new Error(await errorOf(r));
    let answer = "", usage = null;
    await readEvents(r, (obj) => {
      if (obj.error) throw new Error(obj.error.message);
      const delta = obj.choices && obj.choices[0] && obj.choices[0].delta;
      if (delta && delta.content) {
        answer += delta.content;
        out.textContent = answer;
      }
      if (obj.usage) usage = obj.usage;
    });
    return { answer, usage };
  }

  async function send(ev) {
    ev.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || generating) return;
    generating = true;
    $("chat-send").disabled = true;
    $("chat-status").textContent = "generating…";
    conversation.push({ role: "user", content: text });
    addMessage("user", text);
    $("chat-input").value = "";
    const out = addMessage("assistant", "");
    const t0 = performance.now();
    try {
      const { answer, usage } = await streamAnswer(out);
      conversation.push({ role: "assistant", content: answer });
      const tokens = usage ? usage.completion_tokens : "?";
      const cached = (usage && usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
      $("chat-status").textContent = `${tokens} tokens in ${((performance.now() - t0) / 1000).toFixed(1)} s` +
        (cached ? ` · ${cached} of ${usage.prompt_tokens} prompt tokens reused` : "");
    } catch (e) {
      conversation.pop();
      out.classList.add("error");
      out.textContent += (out.textContent ? "\n" : "") + "failed: " + e.message;
      $("chat-status").textContent = "";
    } finally {
      out.dataset.done = "1";
      generating = false;
      $("chat-send").disabled = false;
    }
  }

  // ---- wiring ----

  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    token = $("token").value.trim();
    sessionStorage.setItem("meshd-token", token);
    $("token").value = "";
    poll();
  });
  $("chat-form").addEventListener("submit", send);
  $("chat-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) send(ev);
  });
  $("chat-new").addEventListener("click", () => {
    conversation = [];
    $("chat-log").textContent = "";
  });
  poll();
})();
