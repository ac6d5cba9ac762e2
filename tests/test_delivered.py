"""The plan predicted again for the compute its peers delivered (``coordinator.delivered``):
the live summary's second ``estimator:`` line, and the testbed's re-prediction, share it."""

from __future__ import annotations

from coordinator.assign import Assignment, live_profile, network_from_adverts
from coordinator.delivered import delivered_flops, for_delivered
from coordinator.estimator import PASSES, DagCosts, Plan, predict
from coordinator.outcome import RunSummary
from coordinator.runstate import RunState
from coordinator.summary import delivered_step, estimate, per_micro_batch
from fusionllm.swarm_cmds import _summary
from protocol.model.graph import Cut
from protocol.wire.codecs import Codec
from protocol.wire.messages import Advert

COSTS = DagCosts.synthetic(12, seed=3)
MB = 4


def _advert(name: str, gflops: float) -> Advert:
    return Advert(name, [], "cpu", gflops * 1e9, 1 << 34, 500.0, 500.0, "2", 1, 0.0)


def _state(adverts: dict[str, Advert], slow: dict[str, float]) -> RunState:
    """A run on a 3-stage plan (the middle one replicated) whose peers' compute per
    step is what their adverts predict, times ``slow``."""
    peers = {a.peer_id: live_profile(a) for a in adverts.values()}
    network = network_from_adverts(list(adverts.values()))
    plan = predict(COSTS, Plan((4, 8), [["a"], ["b", "c"], ["d"]], [Codec(), Codec()]), peers, network, MB)
    st = RunState(plan=Assignment(Cut((4, 8)), plan.groups, plan))
    for (lo, hi), group in zip(plan.ranges(COSTS.num_ops), plan.groups, strict=True):
        for r, p in enumerate(group):
            runs = len(range(r, MB, len(group)))
            st.compute[p] = [PASSES * COSTS.stage_flops(lo, hi) / peers[p].flops * runs * slow.get(p, 1.0)] * 3
    st.step_seconds = [0.5, 0.4, 0.6]
    return st


ADVERTS = {n: _advert(n, g) for n, g in (("a", 20), ("b", 10), ("c", 10), ("d", 30))}


def test_peers_that_deliver_their_reading_get_the_plans_own_prediction() -> None:
    st = _state(ADVERTS, {})
    assert st.plan is not None and st.plan.plan is not None
    flops = delivered_flops(COSTS, st.plan.plan, per_micro_batch(st.plan, st.compute, MB))
    assert all(abs(flops[n] / a.flops - 1) < 1e-9 for n, a in ADVERTS.items())
    got = delivered_step(COSTS, st, ADVERTS, MB)
    assert got is not None and abs(got / st.plan.plan.iteration_s - 1) < 1e-9


def test_a_peer_that_computed_slower_than_its_reading_slows_the_prediction_made_again() -> None:
    even = delivered_step(COSTS, _state(ADVERTS, {}), ADVERTS, MB)
    slow = delivered_step(COSTS, _state(ADVERTS, {"d": 8.0}), ADVERTS, MB)
    assert even is not None and slow is not None and slow > 1.5 * even
    st = _state(ADVERTS, {"d": 8.0})
    assert st.plan is not None and st.plan.plan is not None
    peers = {a.peer_id: live_profile(a) for a in ADVERTS.values()}
    per_mb = per_micro_batch(st.plan, st.compute, MB)
    again = for_delivered(COSTS, st.plan.plan, peers, network_from_adverts(list(ADVERTS.values())), MB, per_mb)
    assert again.iteration_s == slow  # one function: the summary's figure is the shared re-prediction


def test_no_prediction_made_again_while_a_planned_peer_has_no_compute() -> None:
    st = _state(ADVERTS, {})
    del st.compute["c"]
    assert delivered_step(COSTS, st, ADVERTS, MB) is None


def test_no_prediction_made_again_once_a_recovery_dropped_a_planned_replica() -> None:
    """A recovery that drops a lost replica keeps the planner's plan: its groups still
    name the peer, whose advert is gone. Every run that lost a replica ended with a
    KeyError traceback in the summary (CI: the pinning, elastic and hostile tests)."""
    st = _state(ADVERTS, {})
    assert st.plan is not None
    st.plan = Assignment(st.plan.cut, [["a"], ["b"], ["d"]], st.plan.plan)
    adverts = {n: a for n, a in ADVERTS.items() if n != "c"}
    del st.compute["c"]
    assert delivered_step(COSTS, st, adverts, MB) is None


def _printed(estimate: dict[str, object]) -> list[str]:
    summary = RunSummary([3.0, 2.0], 10.0, 100, Assignment(Cut(()), []), {}, {}, {}, estimate=estimate)
    return [line for line in _summary(summary, None).splitlines() if line.startswith("estimator:")]


def test_the_demo_summary_prints_the_prediction_for_the_delivered_compute_beside_the_plans() -> None:
    est = {"predicted_step_s": 0.0972, "measured_step_s": 0.1041, "stages": [], "delivered_step_s": 0.1013}
    lines = _printed(est)
    assert lines[0].startswith("estimator: predicted 97.2 ms per step, measured 104.1 ms (median)")
    assert (
        lines[1]
        == "estimator: for the compute the peers delivered, predicted 101.3 ms per step, measured 104.1 ms (-3%)"
    )
    del est["delivered_step_s"]
    assert len(_printed(est)) == 1


def test_a_rebalance_checks_price_of_the_kept_plan_is_the_prediction_printed() -> None:
    """A rebalance check that keeps the plan prices it on the speeds the swarm measured
    (``RunState.repriced``): the summary's prediction and its stages are that price,
    said so beside the start-up one; a new plan epoch forgets it (its own plan's)."""
    st = _state(ADVERTS, {})
    assert st.plan is not None and st.plan.plan is not None
    planned = st.plan.plan
    assert estimate(st, MB)["predicted_step_s"] == round(planned.iteration_s, 5)
    slower = {n: _advert(n, a.flops / 2e9) for n, a in ADVERTS.items()}  # every peer half its reading
    again = predict(
        COSTS,
        planned.bare(),
        {a.peer_id: live_profile(a) for a in slower.values()},
        network_from_adverts(list(slower.values())),
        MB,
    )
    st.repriced = (25, again)
    est = estimate(st, MB)
    assert est["predicted_step_s"] == round(again.iteration_s, 5) > round(planned.iteration_s, 5)
    assert [s["predicted_ms"] for s in est["stages"]] == [round(x * 1e3, 3) for x in again.stage_s]
    assert est["repriced_at_step"] == 25 and est["planned_step_s"] == round(planned.iteration_s, 5)
    lines = _printed(est)
    assert lines[1].startswith("estimator: that prediction is the plan's price at step 25 on the speeds and fixed")
    assert lines[1].endswith(f"it was {est['planned_step_s'] * 1e3:.1f} ms")  # the estimate's, as printed
    st.next_epoch(st.plan)
    assert st.repriced is None and estimate(st, MB)["predicted_step_s"] == round(planned.iteration_s, 5)
