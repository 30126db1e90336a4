"""A churn soak (real daemons on loopback, SmolLM2; meshd.testing.churn): three clients generate without pause
through one entry while the other daemons are killed and restarted from their state directories, frozen
and continued, and stopped with SIGTERM (their sessions handed over) and restarted, one at a time; no
generation fails, none differs from the calm mesh's text for its prompt, and the mesh heals. Latencies
are printed, not asserted: bench/churn_bench.py measures them against its goals on a longer soak."""

import json

import pytest

from meshd.testing.churn import FAULTS, SoakPlan, run_soak

pytestmark = pytest.mark.slow


def test_churn_leaves_no_failed_or_wrong_generation():
    res = run_soak(SoakPlan(calm_s=20, chaos_s=75, period_s=12, seed=1))
    for phase in ("calm", "chaos"):
        print(f"{phase}: {json.dumps(res[phase])}")
    print("faults: " + "; ".join(f"{f['at']:.0f} s {f['kind']} {f['target']} ({f['sessions']} sessions)"
                                 for f in res["faults"]))
    print(f"entry's warnings: {res['entry_warnings']}; healed in {res['heal_s']} s")
    assert set(res["fault_counts"]) == set(FAULTS), res["faults"]
    bad = json.dumps(res["bad"], indent=1)
    assert res["calm"]["failed"] == res["chaos"]["failed"] == 0, bad
    assert res["calm"]["wrong"] == res["chaos"]["wrong"] == 0, bad
    assert res["healed"], res["not_healed"]
