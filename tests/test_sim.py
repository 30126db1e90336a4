"""The swarm simulator (`meshd.sim`): a seed gives the same report; small worlds come out as worked out
by hand; the calibration cases agree with the real daemons' figures within the stated factors; and
every policy the simulator calls is one the daemon calls too (no copies)."""

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest

from meshd.dht.rebalancer import AUTO_SETTLE_S, SETTLE_S
from meshd.core.settings import Settings
from meshd.sim import calibrate as cal
from meshd.sim.__main__ import main
from meshd.sim.dht import Keyspace
from meshd.sim.run import deterministic, simulate
from meshd.sim.swarm import LOAD_FIXED_S, Swarm
from meshd.sim.world import WorldSpec, read_trace

ROOT = Path(__file__).resolve().parents[1]
SMALL = WorldSpec(nodes=60, hours=0.5, capacity=3.0, walks_per_hour=200, seed=7)


def test_the_same_seed_gives_the_same_report_and_another_seed_another():
    a, b = simulate(SMALL)[0], simulate(SMALL)[0]
    assert deterministic(a) == deterministic(b)
    c = simulate(replace(SMALL, seed=8))[0]
    assert deterministic(a) != deterministic(c)


def test_a_run_does_not_depend_on_the_process_hash_seed():
    """Two processes with different PYTHONHASHSEED (set and dict orders of strings) print the same run."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "meshd.sim", "--nodes", "60", "--hours", "0.3", "--seed", "5", "--json"]
    runs = [json.loads(subprocess.run(args, capture_output=True, text=True, check=True, cwd=ROOT,
                                      env={**os.environ, "PYTHONHASHSEED": h}).stdout) for h in ("1", "2")]
    assert deterministic(runs[0]) == deterministic(runs[1])


def test_the_command_line_prints_the_keys_the_issue_names_and_draws_a_png(capsys, tmp_path):
    png = tmp_path / "run.png"
    main(["--nodes", "40", "--hours", "0.2", "--model-layers", "20", "--capacity", "2", "--session-median-min", "60",
          "--nat-share", "0.5", "--seed", "3", "--json", "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(capsys.readouterr().out)
    for key in ("covered_1", "covered_2", "heal_s_p50", "heal_s_p99", "moves_per_node_hour", "lookup_success",
                "lookup_hops_p99", "route_over_best_p50", "route_over_best_p99", "load_max_over_mean",
                "requests_failed_share", "wall_s", "per_hour"):
        assert key in report, key
    assert report["nodes"] == 40 and report["model_layers"] == 20


def test_one_daemon_alone_serves_every_layer_after_its_start_watch_claim_and_load():
    """By hand: it listens after boot_s, watches AUTO_SETTLE_S, claims the whole model (no gap is
    anyone's), re-checks once after a SETTLE_S wait (nobody collides), loads, and serves; the view
    shows it at the next whole second."""
    case, (node,) = cal.local_mesh(1, 30, seed=1)
    t = case.until(lambda: cal.seen(case.swarm))
    load = LOAD_FIXED_S + cal.SMOLLM2.size(0, 30) / (cal.TEST_BOX.disk_mbs * 1e6)
    earliest = cal.BOOT_CPU_S + AUTO_SETTLE_S + SETTLE_S[0] + load
    assert earliest <= t <= cal.BOOT_CPU_S + AUTO_SETTLE_S + SETTLE_S[1] + load + 1.0 + cal.POLL_S
    assert node.serving == (0, 30) and case.swarm.counts == [1] * 30


def test_three_daemons_of_ten_layers_split_the_thirty_and_no_serving_one_moves():
    case, nodes = cal.local_mesh(3, 10, seed=2)
    case.until(lambda: len(nodes) == 3 and cal.seen(case.swarm))
    assert sorted(n.serving for n in nodes) == [(0, 10), (10, 20), (20, 30)]
    case.swarm.clock.run_until(case.swarm.clock.now + 120)
    assert sum(h.moves for h in case.swarm.metrics.hours) == 0


def test_a_killed_sole_server_s_layers_are_taken_over_by_a_daemon_that_had_company():
    """Four daemons of ten layers on 30: [0, 10) is served twice. Kill the server of [20, 30): its
    record lapses within a TTL, and one of the two [0, 10) daemons (the only ones that may leave
    their layers) moves there after the plan named it for PERSIST_ROUNDS rounds and a TTL."""
    case, nodes = cal.local_mesh(4, 10, seed=3)
    sw = case.swarm
    case.until(lambda: len(nodes) == 4 and cal.seen(sw))
    victim = next(n for n in nodes if n.serving == (20, 30) and sw.counts[25] == 1)
    sw.leave(victim, graceful=False)
    t0 = sw.clock.now
    case.until(lambda: not sw.view.serving().complete, limit=t0 + 60)
    t = case.until(lambda: cal.seen(sw), limit=t0 + 120) - t0
    assert sw.counts == [1] * 30
    assert sum(h.moves for h in sw.metrics.hours) == 1
    assert Settings(record_ttl=8).record_ttl * 2 <= t <= 40  # a lapse, then a TTL of persistence, then a load


def test_a_walk_in_a_full_small_keyspace_finds_every_record_in_one_hop():
    """Eight nodes, k = 20: every node's table holds every other node, and every node holds every
    record, so the first peer asked holds it."""
    keys = Keyspace(WorldSpec().rng("dht"))
    names = [f"n{i}" for i in range(8)]
    for n in names:
        keys.join(Keyspace.peer_bytes(n), 0.0, n)
    for owner in names:
        walk = keys.walk(Keyspace.peer_bytes("n0" if owner != "n0" else "n1"), f"/meshd/{owner}".encode(), 0.0, 1.0,
                         lambda a, b: 0.01)
        assert walk.ok and walk.hops == 1


def test_a_trace_file_sets_who_is_there(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("node,join_s,leave_s\na,0,100\nb,10,200\na,150,300\n")
    rows = read_trace(str(trace))
    assert rows == ((0, 0.0, 100.0), (1, 10.0, 200.0), (0, 150.0, 300.0))
    spec = replace(WorldSpec(hours=0.1, walks_per_hour=0, requests_per_entry_min=0), trace=rows)
    swarm = Swarm(spec)
    swarm.populate()
    swarm.clock.run_until(120)
    assert len(swarm.nodes) == 1  # a left at 100 s; b is there; a's second session has not begun


@pytest.mark.parametrize("case", ["join3_s", "twice12_s", "heal_s"])
def test_the_simulated_small_meshes_agree_with_the_real_daemons_within_the_stated_factor(case):
    fn = {"join3_s": cal.join3, "twice12_s": cal.twice12, "heal_s": cal.heal}[case]
    lo, hi = cal.REAL[case]
    for seed in (1, 2, 3):
        sim = fn(seed)
        assert lo / cal.FACTOR <= sim <= hi * cal.FACTOR, (case, seed, sim)


def test_the_simulated_64_node_dht_agrees_with_the_real_swarm():
    success, questions = cal.dht64()
    assert success == cal.REAL["dht64_success"][0]
    real = cal.REAL["dht64_questions"][0]
    assert real / cal.DHT_FACTOR <= questions <= real * cal.DHT_FACTOR


def imported_policies() -> dict[str, str]:
    """Every name the simulator imports from meshd outside meshd.sim, with its module."""
    out = {}
    for path in (ROOT / "meshd" / "sim").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshd.") \
                    and not node.module.startswith("meshd.sim"):
                for alias in node.names:
                    out[alias.name] = node.module
    return out


# what the simulator takes from meshd that is not a decision: constants, error and value types
NOT_POLICIES = {"AUTO_SETTLE_S", "MOVE_JITTER_S", "PERSIST_ROUNDS", "REBALANCE_PERIOD_S", "SETTLE_ROUNDS", "SETTLE_S",
                "COVERAGE_INTERVAL", "TICK_S", "GET_QUORUM", "QUERY_TIMEOUT", "UPKEEP_S", "ALPHA", "K", "BUSY_WAIT_S",
                "CoverageRecord", "Move", "GenerationError", "HopFailed", "NoRoute", "ErrorCode", "Settings",
                "record_key"}
POLICIES = {"place_span", "fit_span", "plan_moves", "Persistence", "takes_part", "still_named", "bump",
            "republish_every", "CoverageMap", "choose_relays", "relay_candidates", "RelayLedger", "Lookup",
            "key_point", "peer_point", "plan_around", "plan_route", "route_along", "link_latency", "Retries",
            "choose_entry", "Capacity", "relay_limits"}


def test_every_policy_the_simulator_calls_is_one_the_daemon_calls():
    """The simulator runs the daemon's own functions: each one it imports (but constants and types)
    is named in this list, and used by meshd code outside meshd/sim, besides its definition."""
    imported = imported_policies()
    assert set(imported) - NOT_POLICIES == POLICIES
    used: set[str] = set()  # every name and attribute meshd code outside meshd/sim refers to
    for path in (ROOT / "meshd").rglob("*.py"):
        if "sim" not in path.relative_to(ROOT).parts:
            for n in ast.walk(ast.parse(path.read_text())):
                used |= {n.id} if isinstance(n, ast.Name) else {n.attr} if isinstance(n, ast.Attribute) else set()
    for name in sorted(POLICIES):
        assert name in used, f"{name} ({imported[name]}) is called by the simulator but by no daemon code"
