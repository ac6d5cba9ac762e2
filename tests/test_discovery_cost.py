"""The discovery and control-plane cost formulas (coordinator/discovery_cost.py)."""

from __future__ import annotations

import pytest

from coordinator import discovery_cost as dc
from protocol.trust.run_records import MAX_SHARDS


def test_the_one_key_layout_matches_issue_33s_measurements_and_is_quadratic() -> None:
    """Issue 33 measured the busiest holder at 126 kB/s (20 peers) and 504 kB/s (40 peers)."""
    assert dc.one_key(20, 2.0).busiest_holder_kB_s == pytest.approx(126, rel=0.05)
    assert dc.one_key(40, 2.0).busiest_holder_kB_s == pytest.approx(504, rel=0.05)
    ns = [10, 20, 40, 80]
    loads = [dc.one_key(n, 2.0).busiest_holder_kB_s for n in ns]
    assert dc.growth_exponent(ns, loads) == pytest.approx(2.0)
    assert dc.one_key(7000, 2.0).largest_message_kB * 1e3 > dc.DAEMON_CAP_BYTES  # issue 33's cliff


def test_shards_double_as_the_swarm_grows_and_stay_within_the_rule() -> None:
    assert dc.shard_count(1) == 1 and dc.shard_count(dc.PEERS_PER_SHARD) == 1
    assert dc.shard_count(dc.PEERS_PER_SHARD + 1) == 2
    assert dc.shard_count(10_000) == 1024
    assert dc.shard_count(10**9) == dc.MAX_SHARDS == MAX_SHARDS


@pytest.mark.parametrize("n", [1000, 10_000])
def test_the_sharded_layout_meets_the_goals_at_scale(n: int) -> None:
    cost = dc.sharded(n, 2.0)
    assert cost.busiest_holder_kB_s <= 1000
    assert cost.coordinator_kB_per_poll <= 1000
    assert cost.largest_message_kB <= 1024
    ns = [10, 20, 40, 80, 1000, 10_000]
    assert dc.growth_exponent(ns, [dc.sharded(m, 2.0).busiest_holder_kB_s for m in ns]) <= 1.2


def test_the_control_plane_fits_one_core_once_step_reports_are_the_heartbeat() -> None:
    per_second_beats = dc.control_cpu(10_000, 10_000, beat_s=1.0, step_s=5.0, standby_beat_s=1.0)
    assert per_second_beats > 1.0  # today's rate: every peer every second, plus its reports
    replaced = dc.control_cpu(10_000, 8_000, beat_s=0.0, step_s=5.0, standby_beat_s=10.0)
    assert replaced <= 1.0
    assert dc.control_cpu(10, 20, 0.0, 0.0, 0.0) == 0.0


def test_sim_reports_discovery_and_control_plane_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fusionllm sim``'s output carries the formulas' figures for the simulated swarm."""
    from types import SimpleNamespace

    from fusionllm.plan_cmds import _discovery, _sim_text

    topo = SimpleNamespace(name="t", peers=[SimpleNamespace(id=f"p{i}") for i in range(10_000)])
    plan = SimpleNamespace(groups=[[f"p{i}" for i in range(100)]])
    run = SimpleNamespace(first_plan=plan, mean_s=2.0, replans=[], redone=0, goodput=0.5, probes_asked=0)
    got = _discovery(topo, {"even": (run, 0.1)})
    assert got == dc.swarm_cost(10_000, 100, 2.0, sizes=[100]) and got.shards == 1024
    args = SimpleNamespace(iterations=1)
    costs = SimpleNamespace(num_ops=3)
    run.predicted_s = run.lower_bound_s = 1.0
    monkeypatch.setattr("fusionllm.plan_cmds._sim_left_out", lambda *a: {})
    text = _sim_text(args, topo, costs, {"even": (run, 0.1)}, set())
    assert "discovery: 1024 advert shard(s)" in text and "coordinator CPU-s/s" in text
