"""The live swarm's fixed costs (``coordinator.overheads``) in the estimator and the
simulator: each where the swarm spends it (a compute call per pass, a message at each
end, the end of step, the commit), the same figure in both, and a running swarm's own
figures fitted back from its peers' breakdowns."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.assign import live_profile
from coordinator.breakdown import run_overheads, stage_facts
from coordinator.estimator import DagCosts, PeerTable, Plan, predict
from coordinator.netmodel import Network, PeerProfile
from coordinator.overheads import (
    LIVE,
    NONE,
    STEP_CALLS,
    Overheads,
    StageFacts,
    fitted,
    optimizer_s,
    replica_messages,
    slowed,
)
from protocol.wire.codecs import Codec
from protocol.wire.messages import Advert
from sim.engine import iteration_seconds

GFLOP = 10**9
COSTS = Overheads(handoff_s=1e-3, message_s=0.3e-3, byte_s=2e-9, optimizer_s=0.7e-3, param_byte_s=1e-9, commit_s=9e-3)


def _chain(n: int = 8, cross: int = 1_000_000, params: int = 250_000) -> DagCosts:
    return DagCosts([GFLOP] * n, [params] * n, [0] * n, [0] + [cross] * (n - 1), [0] + [cross] * (n - 1))


def _both(plan: Plan, overheads: Overheads, m: int) -> tuple[float, float]:
    peers = PeerTable(PeerProfile(f"p{i}", 1e12, 1 << 40, "c", 0.0, overheads) for i in range(2))
    net = Network({p: "c" for p in peers}, {("c", "c"): (8000.0, 0.0)})  # 1 GB/s: 1 ms a MB
    return predict(_chain(), plan, peers, net, m).iteration_s, iteration_seconds(_chain(), plan, peers, net, m)


def test_one_stage_pays_a_handoff_per_pass_and_the_end_of_step() -> None:
    """One stage (8 GFLOP at 1 TFLOP/s: 8 ms forward, 16 backward), 4 micro-batches:
    two handoffs each, then the norms and the update (two more handoffs, 0.7 ms, 1 ms
    per MB of its 2 MB of parameters) and the commit's round trip."""
    plan = Plan((), [["p0"]], [])
    bare, _ = _both(plan, NONE, 4)
    est, sim = _both(plan, COSTS, 4)
    assert bare == pytest.approx(4 * 24e-3)
    end = STEP_CALLS * 1e-3 + 0.7e-3 + 2e-3
    assert est == pytest.approx(bare + 4 * 2 * 1e-3 + end + 9e-3)
    assert sim == pytest.approx(est)


def test_a_message_pays_both_ends_on_the_critical_path() -> None:
    """Two stages, one micro-batch: forward, 1 MB across, forward and backward, 1 MB back,
    backward. Each message costs 0.3 ms at each end and 2 ns per byte at each end."""
    plan = Plan((4,), [["p0"], ["p1"]], [Codec()])
    bare, _ = _both(plan, NONE, 1)
    est, sim = _both(plan, COSTS, 1)
    messages = 2 * (2 * 0.3e-3 + 2 * 2e-9 * 1_000_000)
    handoffs = 2 * 2 * 1e-3
    end = optimizer_s(COSTS, 1_000_000) + 9e-3  # both stages hold 1 MB of parameters
    assert est == pytest.approx(bare + messages + handoffs + end)
    assert sim == pytest.approx(est)


def test_simulator_and_estimator_agree_on_a_pipeline_with_overheads() -> None:
    """8 micro-batches through two stages: the estimator's 1F1B bound and the event-by-event
    simulation price the swarm's fixed costs alike (within 5%)."""
    est, sim = _both(Plan((4,), [["p0"], ["p1"]], [Codec()]), COSTS, 8)
    assert sim == pytest.approx(est, rel=0.05)


def _breakdown(o: Overheads, facts: StageFacts, commit_ms: float) -> dict[str, float]:
    return {
        "handoff": facts.calls * o.handoff_s * 1e3,
        "encode": (facts.messages * o.message_s + facts.wire_bytes * o.byte_s) * 1e3,
        "optimizer": (o.optimizer_s + facts.param_bytes * o.param_byte_s) * 1e3,
        "commit": commit_ms,
    }


def test_fitted_reads_the_swarms_own_figures_from_its_breakdowns() -> None:
    """Breakdowns made from known figures give them back; the commit is the least wait
    (the stage that finished last); what no stage reports keeps the prior's."""
    facts = {0: StageFacts(10, 8, 1.06e6, 2.0e6), 1: StageFacts(10, 16, 6.3e6, 0.3e6)}
    means = {0: _breakdown(COSTS, facts[0], 9.0), 1: _breakdown(COSTS, facts[1], 30.0)}
    got = fitted(means, facts, replace(COSTS, handoff_s=5e-3, byte_s=1e-9, param_byte_s=0.0, commit_s=1.0))
    assert got.handoff_s == pytest.approx(COSTS.handoff_s)
    assert got.byte_s == pytest.approx(COSTS.byte_s)
    assert got.param_byte_s == pytest.approx(COSTS.param_byte_s)
    assert got.commit_s == pytest.approx(9e-3)
    assert fitted({}, facts, LIVE) == LIVE
    assert fitted({0: {"step": 1.0}}, facts, LIVE).commit_s == LIVE.commit_s


def test_live_peers_carry_the_live_swarms_figures() -> None:
    ad = Advert("p", [], "cpu", 1e10, 1 << 30, 100.0, 100.0, "2", 1, 60.0)
    assert live_profile(ad).overheads == LIVE
    assert PeerProfile("q", 1e10, 1 << 30).overheads == NONE


def test_a_throttled_peer_pays_its_slow_down_on_the_optimizer_only() -> None:
    """``join --throttle`` idles after every compute call: the norms and the update take
    ``factor`` times as long; handing off, encoding and the commit do not."""
    got = slowed(COSTS, 10.0)
    assert optimizer_s(got, 1e6) == pytest.approx(STEP_CALLS * 1e-3 + 10 * (0.7e-3 + 1e-3))
    assert (got.handoff_s, got.message_s, got.byte_s, got.commit_s) == (1e-3, 0.3e-3, 2e-9, 9e-3)


def test_stage_facts_count_what_each_stage_does_in_a_step() -> None:
    """Two stages of 4 ops (1 MB of parameters each, 1 MB across the cut each way), the
    second with two replicas, 4 micro-batches: the first makes 8 + 2 calls and exchanges
    8 messages of 1 MB; each replica of the second runs 2 micro-batches (4 + 3 calls),
    exchanges 4 messages with the first stage and 2 + 2 gradient messages of 1 MB."""
    plan = Plan((4,), [["p0"], ["p1", "p2"]], [Codec()])
    facts = stage_facts(_chain(), plan, 4)
    assert facts[0] == StageFacts(10, 8, 8e6, 1e6)
    assert facts[1] == StageFacts(7, 8, 8e6, 1e6)


def test_fitted_on_stage_facts_reads_back_the_figures_a_swarm_ran_with() -> None:
    """Breakdowns made from ``COSTS`` and what ``stage_facts`` says each stage did give
    ``COSTS`` back: the rebalancer plans on these (``Rebalancer.overheads``)."""
    facts = stage_facts(_chain(), Plan((4,), [["p0"], ["p1", "p2"]], [Codec()]), 4)
    means = {s: _breakdown(COSTS, f, 9.0 + s) for s, f in facts.items()}
    got = fitted(means, facts, replace(COSTS, handoff_s=0.0, byte_s=0.0, param_byte_s=0.0))
    assert (got.handoff_s, got.byte_s, got.param_byte_s, got.commit_s) == pytest.approx(
        (COSTS.handoff_s, COSTS.byte_s, COSTS.param_byte_s, COSTS.commit_s)
    )


def test_replicas_pay_for_encoding_and_decoding_each_others_gradients() -> None:
    """One stage of two replicas, a micro-batch each: each encodes its 2 MB of parameter
    gradients for the other and decodes the other's (0.3 ms and 2 ns a byte each, at its
    end): 8.6 ms of CPU in its backward, which the estimator once left out (it chose a
    plan 22% slower for the replicated demo)."""
    plan = Plan((), [["p0", "p1"]], [])
    free = replace(COSTS, message_s=0.0, byte_s=0.0)
    est, sim = _both(plan, COSTS, 2)
    before, _ = _both(plan, free, 2)
    assert replica_messages(2, 1, 2) == 2 and replica_messages(3, 2, 4) == 6 and replica_messages(1, 4, 4) == 0
    assert est == pytest.approx(before + 2 * (0.3e-3 + 2e-9 * 2_000_000))
    assert sim == pytest.approx(est)


def test_a_running_swarm_is_priced_with_its_own_fixed_costs() -> None:
    """The rebalance check's price of the running plan (the summary's prediction) and the
    delivered line take the fixed costs the peers' breakdowns show (``run_overheads``):
    a commit of 12 ms on the stage that finished last, where ``LIVE`` says 4.3; a run
    with no breakdown yet keeps ``LIVE``."""
    plan = Plan((4,), [["p0"], ["p1", "p2"]], [Codec()])
    facts = stage_facts(_chain(), plan, 4)
    own = replace(LIVE, handoff_s=0.3e-3, commit_s=12e-3)
    means = {s: _breakdown(own, f, 12.0 + 20.0 * s) for s, f in facts.items()}
    got = run_overheads(means, _chain(), plan, 4)
    assert (got.handoff_s, got.commit_s) == pytest.approx((0.3e-3, 12e-3))
    assert run_overheads({}, _chain(), plan, 4) == LIVE
    net = Network(dict.fromkeys(("p0", "p1", "p2"), "c"), {("c", "c"): (8000.0, 0.0)})

    def step_s(o: Overheads) -> float:
        peers = PeerTable(PeerProfile(p, 1e12, 1 << 40, "c", 0.0, o) for p in ("p0", "p1", "p2"))
        return predict(_chain(), plan, peers, net, 4).iteration_s

    assert step_s(got) - step_s(replace(got, commit_s=LIVE.commit_s)) == pytest.approx(12e-3 - LIVE.commit_s)
