"""The work ledger: who computed what for whom, kept by each daemon in its state directory.

Rules: one SQLite database (stdlib `sqlite3`, WAL), written as the work ends. At an entry, one row per
generation (its request id, every route it took with the positions each computed, prompt and
generated tokens, outcome completed / cancelled / failed, checked or not, and each window of its tokens a
check by prefill recomputed: on whose route, and the verdict); at a hop, one row per
session it served for another daemon (that peer, the layers, the positions computed, the outcome:
closed by its entry, cancelled, or lost). Each row also credits layer-tokens (layers x positions)
to a peer, in one direction: `for_us` (the peer computed for this daemon) or `by_us` (this daemon
for the peer). Rows older than `days` roll up into daily totals per peer. A generation is written
as `running` when it starts, so one interrupted by a crash reads as `failed` at the next start.
A database that cannot be opened or written (a full disk, a read-only directory) turns the ledger
off with one warning: the daemon goes on without it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

from meshd.core.log import get_logger
from meshd.core.settings import default

log = get_logger(__name__)
DAY_S = 86400.0
OUTCOMES = ("completed", "cancelled", "failed")
SCHEMA = """
CREATE TABLE IF NOT EXISTS generations (
    id INTEGER PRIMARY KEY, request_id INTEGER, started REAL, ended REAL, prompt_tokens INTEGER,
    generated INTEGER, outcome TEXT, checked INTEGER, agreed INTEGER, reroutes INTEGER, routes TEXT);
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY, started REAL, ended REAL, peer TEXT, first_layer INTEGER, end_layer INTEGER,
    positions INTEGER, outcome TEXT);
CREATE TABLE IF NOT EXISTS work (
    id INTEGER PRIMARY KEY, at REAL, peer TEXT, direction TEXT, layer_tokens INTEGER, generation INTEGER,
    session INTEGER);
CREATE TABLE IF NOT EXISTS daily (
    day REAL, peer TEXT, direction TEXT, layer_tokens INTEGER, rows INTEGER,
    PRIMARY KEY (day, peer, direction));
CREATE TABLE IF NOT EXISTS windows (
    id INTEGER PRIMARY KEY, generation INTEGER, at REAL, first_token INTEGER, end_token INTEGER, checkers TEXT,
    verdict TEXT, layers TEXT);
CREATE INDEX IF NOT EXISTS work_at ON work (at);
CREATE INDEX IF NOT EXISTS generations_started ON generations (started);
CREATE INDEX IF NOT EXISTS sessions_started ON sessions (started);
"""


def layer_tokens(routes: list[tuple[list, int]], me: str) -> dict[str, int]:
    """Layer-tokens each other peer computed over a generation's routes: `routes` holds, per
    attempt, its hops ([peer, start, end], ...) and the positions that attempt computed."""
    out: dict[str, int] = {}
    for hops, positions in routes:
        for peer, start, end in hops:
            if peer != me:
                out[peer] = out.get(peer, 0) + (end - start) * positions
    return out


class Ledger:
    """The ledger of one daemon; every method is safe from any thread and never raises."""

    def __init__(self, path: Path | str | None, days: float = default("ledger_days"), clock=time.time) -> None:
        self.path, self.days, self.clock = path, days, clock
        self._lock = threading.Lock()
        self.db: sqlite3.Connection | None = None
        self.recovered = 0  # generations found running at open (the daemon stopped mid-way)
        if path is None:
            return
        try:
            db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=2.0)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            self.recovered = db.execute("UPDATE generations SET outcome='failed', ended=started"
                                        " WHERE outcome='running'").rowcount
            self.db = db
        except (sqlite3.Error, OSError) as exc:
            self._off("opening", exc)
            return
        self.roll_up()

    @property
    def enabled(self) -> bool:
        return self.db is not None

    def _off(self, doing: str, exc: Exception) -> None:
        log.warning("work ledger off", doing=doing, path=str(self.path), error=f"{type(exc).__name__}: {exc}")
        db, self.db = self.db, None
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:
                pass

    def _write(self, doing: str, fn):
        with self._lock:
            if self.db is None:
                return None
            try:
                self.db.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(self.db)
                except BaseException:
                    self.db.execute("ROLLBACK")
                    raise
                self.db.execute("COMMIT")
                return result
            except (sqlite3.Error, OSError) as exc:
                self._off(doing, exc)
                return None

    # ---- an entry's generations ----

    def begin_generation(self, request_id: int) -> int | None:
        """A generation starts here; the row id to end it with (None: no ledger)."""
        return self._write("recording a generation", lambda db: db.execute(
            "INSERT INTO generations (request_id, started, outcome, checked) VALUES (?, ?, 'running', 0)",
            (int(request_id), self.clock())).lastrowid)

    def end_generation(self, row: int | None, me: str, outcome: str, prompt_tokens: int, generated: int,
                       routes: list[tuple[list, int]], reroutes: int = 0, checked: bool = False,
                       agreed: bool | None = None, windows: list[dict] = ()) -> None:
        """How generation `row` ended, the layer-tokens its routes' other peers computed for us, and each
        window of its tokens a check by prefill recomputed (`Check.window`: the tokens, the check's route, the
        verdict and where the sketches parted)."""
        if row is None:
            return
        now = self.clock()

        def write(db: sqlite3.Connection) -> None:
            db.execute("UPDATE generations SET ended=?, prompt_tokens=?, generated=?, outcome=?, checked=?,"
                       " agreed=?, reroutes=?, routes=? WHERE id=?",
                       (now, prompt_tokens, generated, outcome, int(checked), None if agreed is None else int(agreed),
                        reroutes, json.dumps(routes), row))
            db.executemany("INSERT INTO work (at, peer, direction, layer_tokens, generation)"
                           " VALUES (?, ?, 'for_us', ?, ?)",
                           [(now, peer, n, row) for peer, n in layer_tokens(routes, me).items()])
            db.executemany("INSERT INTO windows (generation, at, first_token, end_token, checkers, verdict, layers)"
                           " VALUES (?, ?, ?, ?, ?, ?, ?)",
                           [(row, now, w["start"], w["end"], json.dumps(w["route"]), w["verdict"],
                             json.dumps(w["layers"]) if w["layers"] else None) for w in windows])

        self._write("recording a generation", write)

    def windows(self, generation: int | None = None) -> list[dict]:
        """The windows checked by prefill (of one generation's row, or all kept), oldest first."""
        with self._lock:
            if self.db is None:
                return []
            try:
                rows = self.db.execute("SELECT generation, at, first_token, end_token, checkers, verdict, layers"
                                       " FROM windows" + (" WHERE generation = ?" if generation is not None else "")
                                       + " ORDER BY id", (generation,) if generation is not None else ()).fetchall()
            except sqlite3.Error as exc:
                log.warning("reading the work ledger failed", error=str(exc))
                return []
        return [{"generation": g, "at": at, "start": a, "end": b, "checkers": json.loads(c), "verdict": v,
                 "layers": json.loads(layers) if layers else None} for g, at, a, b, c, v, layers in rows]

    # ---- a hop's sessions ----

    def session_served(self, peer: str, start: int, end: int, positions: int, outcome: str,
                       started: float | None = None) -> None:
        """A session this daemon served for `peer` ended."""
        now = self.clock()

        def write(db: sqlite3.Connection) -> None:
            sid = db.execute("INSERT INTO sessions (started, ended, peer, first_layer, end_layer, positions, outcome)"
                             " VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (now if started is None else started, now, peer, start, end, positions, outcome)).lastrowid
            db.execute("INSERT INTO work (at, peer, direction, layer_tokens, session) VALUES (?, ?, 'by_us', ?, ?)",
                       (now, peer, (end - start) * positions, sid))

        self._write("recording a session", write)

    # ---- upkeep and reading ----

    def roll_up(self) -> int:
        """Fold rows older than `days` into daily totals per peer; returns the work rows folded."""
        cutoff = self.clock() - self.days * DAY_S

        def write(db: sqlite3.Connection) -> int:
            db.execute("INSERT INTO daily (day, peer, direction, layer_tokens, rows)"
                       " SELECT CAST(at / ? AS INTEGER) * ?, peer, direction, SUM(layer_tokens), COUNT(*)"
                       " FROM work WHERE at < ? GROUP BY 1, 2, 3 ON CONFLICT (day, peer, direction) DO UPDATE"
                       " SET layer_tokens = layer_tokens + excluded.layer_tokens, rows = rows + excluded.rows",
                       (DAY_S, DAY_S, cutoff))
            folded = db.execute("DELETE FROM work WHERE at < ?", (cutoff,)).rowcount
            db.execute("DELETE FROM generations WHERE started < ? AND outcome != 'running'", (cutoff,))
            db.execute("DELETE FROM sessions WHERE started < ?", (cutoff,))
            db.execute("DELETE FROM windows WHERE at < ?", (cutoff,))
            return folded

        return self._write("rolling the ledger up", write) or 0

    def totals(self, since: float | None = None, peer: str | None = None) -> dict:
        """Per peer: layer-tokens it computed for us and we for it, and the rows behind them, since
        `since` (seconds since the epoch; daily totals count by their day); and this daemon's
        generations and sessions by outcome. `enabled: false` when there is no ledger."""
        out: dict = {"enabled": self.db is not None, "path": str(self.path) if self.path else None,
                     "peers": {}, "generations": dict.fromkeys(OUTCOMES, 0), "sessions": dict.fromkeys(OUTCOMES, 0),
                     "checked": 0, "unchecked": 0, "windows": {}}
        since = float(since or 0.0)
        with self._lock:
            if self.db is None:
                return out
            try:
                rows = self.db.execute(
                    "SELECT peer, direction, SUM(layer_tokens), COUNT(*) FROM work WHERE at >= ? GROUP BY 1, 2"
                    " UNION ALL SELECT peer, direction, SUM(layer_tokens), SUM(rows) FROM daily"
                    " WHERE day + ? > ? GROUP BY 1, 2", (since, DAY_S, since)).fetchall()
                gens = self.db.execute("SELECT outcome, checked, COUNT(*) FROM generations WHERE started >= ?"
                                       " AND outcome != 'running' GROUP BY 1, 2", (since,)).fetchall()
                windows = self.db.execute("SELECT verdict, COUNT(*) FROM windows WHERE at >= ? GROUP BY 1",
                                          (since,)).fetchall()
                sessions = self.db.execute("SELECT outcome, COUNT(*) FROM sessions WHERE started >= ?"
                                           + (" AND peer = ?" if peer else "") + " GROUP BY 1",
                                           (since, peer) if peer else (since,)).fetchall()
            except sqlite3.Error as exc:
                log.warning("reading the work ledger failed", error=str(exc))
                return out
        for pid, direction, n, count in rows:
            if peer and pid != peer:
                continue
            entry = out["peers"].setdefault(pid, {"for_us": 0, "by_us": 0, "for_us_rows": 0, "by_us_rows": 0})
            entry[direction] += int(n or 0)
            entry[f"{direction}_rows"] += int(count or 0)
        for outcome, checked, count in gens:
            out["generations"][outcome] = out["generations"].get(outcome, 0) + count
            out["checked" if checked else "unchecked"] += count
        out["windows"] = {verdict: count for verdict, count in windows}
        for outcome, count in sessions:
            out["sessions"][outcome] = out["sessions"].get(outcome, 0) + count
        return out

    def close(self) -> None:
        with self._lock:
            if self.db is not None:
                self.db.close()
                self.db = None
