"""The work ledger (meshd/node/ledger.py): pure tests on a real SQLite file, plus the entry's
accounting of routes (Generation.work) and outcomes (outcome_of), and meshctl's rendering."""

from __future__ import annotations

import argparse
import sqlite3

import pytest
import trio

from meshd.cli.ctl import parse_since
from meshd.cli.render import render_ledger
from meshd.entry.errors import GenerationError, HopFailed, outcome_of
from meshd.entry.state import Generation
from meshd.node.ledger import DAY_S, Ledger, layer_tokens

ME, A, B = "me", "peer-a", "peer-b"


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_generations_and_sessions_credit_layer_tokens_each_way(tmp_path):
    led = Ledger(tmp_path / "l.sqlite3")
    row = led.begin_generation(7)
    routes = [([[ME, 0, 10], [A, 10, 20], [B, 20, 30]], 40)]
    led.end_generation(row, ME, "completed", 20, 21, routes)
    led.session_served(A, 0, 5, 12, "completed")
    t = led.totals()
    assert t["enabled"] and t["generations"]["completed"] == 1 and t["unchecked"] == 1
    assert t["peers"][A] == {"for_us": 400, "by_us": 60, "for_us_rows": 1, "by_us_rows": 1}
    assert t["peers"][B]["for_us"] == 400 and t["peers"][B]["by_us"] == 0
    assert ME not in t["peers"]
    assert t["sessions"] == {"completed": 1, "cancelled": 0, "failed": 0}
    assert led.totals(peer=B)["peers"].keys() == {B}


def test_a_generation_left_running_reads_as_failed_after_a_restart(tmp_path):
    path = tmp_path / "l.sqlite3"
    first = Ledger(path)
    first.begin_generation(1)  # the process dies here: no end, no close
    done = first.begin_generation(2)
    first.end_generation(done, ME, "cancelled", 5, 2, [([[ME, 0, 30]], 6)])
    again = Ledger(path)
    assert again.recovered == 1
    assert again.totals()["generations"] == {"completed": 0, "cancelled": 1, "failed": 1}


def test_old_rows_roll_up_into_daily_totals_that_still_count(tmp_path):
    clock = Clock()
    led = Ledger(tmp_path / "l.sqlite3", days=30, clock=clock)
    led.session_served(A, 10, 20, 5, "completed")  # 50 layer-tokens, 40 days ago once the clock moves
    clock.t += 40 * DAY_S
    led.session_served(A, 10, 20, 1, "failed")
    assert led.roll_up() == 1
    rows = led.db.execute("SELECT COUNT(*) FROM work").fetchone()[0]
    daily = led.db.execute("SELECT layer_tokens, rows FROM daily").fetchall()
    assert rows == 1 and daily == [(50, 1)]
    assert led.totals()["peers"][A] == {"for_us": 0, "by_us": 60, "for_us_rows": 0, "by_us_rows": 2}
    assert led.totals(since=clock.t - DAY_S)["peers"][A]["by_us"] == 10  # the old day is before `since`
    assert led.roll_up() == 0


def test_a_database_that_cannot_be_opened_turns_the_ledger_off(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    led = Ledger(tmp_path / "file" / "l.sqlite3")
    assert not led.enabled
    assert led.begin_generation(1) is None
    led.end_generation(None, ME, "completed", 1, 1, [])
    led.session_served(A, 0, 1, 1, "completed")
    assert led.totals()["enabled"] is False and led.roll_up() == 0
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"\x00not sqlite at all" * 512)
    assert not Ledger(garbage).enabled


def test_a_full_disk_turns_the_ledger_off_without_raising(tmp_path):
    led = Ledger(tmp_path / "l.sqlite3")
    pages = led.db.execute("PRAGMA page_count").fetchone()[0]
    led.db.execute(f"PRAGMA max_page_count={pages + 1}")  # the file may not grow: as a full disk
    for i in range(2000):
        led.session_served(f"peer-{i:04d}" + "x" * 200, 0, 1, i, "completed")
        if not led.enabled:
            break
    assert not led.enabled and led.totals()["enabled"] is False
    assert sqlite3.connect(tmp_path / "l.sqlite3").execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_generation_work_counts_each_route_up_to_the_next():
    gen = Generation.start([1, 2, 3, 4], 10, 100)
    gen.begin_attempt([[ME, 0, 10], [A, 10, 30]])
    for t in (5, 6, 7):
        gen.accept(t)
    gen.begin_attempt([[ME, 0, 10], [B, 10, 30]])  # a reroute after three tokens: B replays them
    for t in (8, 9):
        gen.accept(t)
    work = gen.work()
    assert work == [([[ME, 0, 10], [A, 10, 30]], 7), ([[ME, 0, 10], [B, 10, 30]], 8)]
    assert layer_tokens(work, ME) == {A: 140, B: 160}


class Stop(Exception):
    ends_generation_normally = True


def test_outcomes():
    assert outcome_of(None) == "completed"
    assert outcome_of(Stop()) == "completed"
    assert outcome_of(BaseExceptionGroup("g", [Stop()])) == "completed"
    assert outcome_of(trio.BrokenResourceError()) == "cancelled"
    assert outcome_of(GenerationError("no_route", "no route")) == "failed"
    assert outcome_of(ExceptionGroup("g", [HopFailed("p" * 10, "gone")])) == "failed"


def test_meshctl_reads_dates_and_renders_totals(tmp_path):
    assert parse_since("") == 0.0 and parse_since("12.5") == 12.5
    assert parse_since("2026-12-01") > parse_since("2026-11-30T23:00")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_since("yesterday")
    led = Ledger(tmp_path / "l.sqlite3")
    led.session_served(A, 0, 2, 3, "completed")
    text = render_ledger(led.totals())
    assert A in text and "1 completed" in text and " 6 in    1" in text
    assert "no work ledger" in render_ledger(Ledger(None).totals())
