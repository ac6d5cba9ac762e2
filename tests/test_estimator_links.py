"""The estimator's replica gradient sends as the swarm makes them (to every other
replica at once, each over its own link), and ``auto``'s one assignment path: the
codecs the planner priced are the ones the live swarm runs, picked again (by the same
choice) only where a measured link is far from the planner's."""

from __future__ import annotations

import pytest

from coordinator import pinned
from coordinator.codec_choice import REPICK_SHARE, auto_codec, planned_or_repicked
from coordinator.estimator import DagCosts, PeerTable, Plan, edge_rates, predict
from coordinator.netmodel import Network, PeerProfile
from protocol.wire.codecs import Codec
from sim.engine import iteration_seconds

GFLOP = 10**9
SPEC = [{"t": "tensor", "dtype": "float32", "shape": [4, 64, 64]}]


def _three_sites() -> tuple[list[PeerProfile], Network]:
    """p0 and p1 on one LAN (1 Gbit/s, 1 ms), p2 a home behind 20 Mbit/s (15 ms)."""
    peers = [PeerProfile(f"p{i}", 1e12, 1 << 40, "lan" if i < 2 else "home", 0.0) for i in range(3)]
    clusters = {("lan", "lan"): (1000.0, 1e-3), ("lan", "home"): (20.0, 15e-3), ("home", "home"): (1000.0, 1e-3)}
    return peers, Network({p.id: p.cluster for p in peers}, clusters)


def test_replica_gradients_go_to_every_replica_at_once_priced_by_the_slowest_link() -> None:
    """Three replicas, three micro-batches (one each), 8 MB of gradients: p0 sends to p1
    (1 Gbit/s) and to p2 (20 Mbit/s) at once, so its sends take the 20 Mbit/s link's
    3.2 s and 15 ms, not both links' one after the other (3.264 s + 16 ms)."""
    costs = DagCosts([GFLOP] * 4, [2 * 10**6] * 4, [0] * 4, [0] * 4, [0] * 4)
    peers, net = _three_sites()
    plan = predict(costs, Plan((), [["p0", "p1", "p2"]], []), PeerTable(peers), net, 3)
    slowest = 15e-3 + 8e6 * 8 / 20e6
    assert plan.allreduce_s == [pytest.approx(slowest)]
    assert plan.iteration_s == pytest.approx(3 * 4e-3 + slowest)
    assert iteration_seconds(costs, plan, PeerTable(peers), net, 3) == pytest.approx(plan.iteration_s)


def test_a_plan_says_the_bandwidth_per_micro_batch_its_codecs_were_priced_for() -> None:
    """A boundary from one peer to two replicas carries half the micro-batches over
    each pair: per micro-batch it moves as if twice as fast as its slowest pair."""
    costs = DagCosts([GFLOP] * 4, [0] * 4, [0] * 4, [0, 10**6, 10**6, 10**6], [0] * 4)
    peers, net = _three_sites()
    plan = predict(costs, Plan((2,), [["p0"], ["p1", "p2"]], [Codec()]), PeerTable(peers), net, 4)
    assert plan.edge_mbps == [pytest.approx(40.0)]
    assert edge_rates([["p0"], ["p2"]], net, 4) == [pytest.approx(20.0)]


def test_auto_runs_the_planners_codecs_unless_a_measured_link_is_far_off() -> None:
    """Within REPICK_SHARE of the planned bandwidth the planner's codec runs, even one
    the measured link alone would not have asked for; further off, the same choice
    (``auto_codec``) picks again for the measured link against the plan's slowest stage."""
    planned = [Codec("int8"), Codec()]
    near, far = 20.0 * (1 + REPICK_SHARE / 2), 2.0
    nbytes, stages = 4 * 4 * 64 * 64, [0.01, 0.02]
    codecs, again = planned_or_repicked(planned, [20.0, 1000.0], [near, far], [nbytes] * 2, stages, [SPEC] * 2)
    assert codecs[0] == Codec("int8") and again == [False, True]
    assert codecs[1] == auto_codec(nbytes, far, 0.02, SPEC) and codecs[1].name != "none"


def test_a_pinned_plan_carries_the_codecs_the_planner_priced() -> None:
    data = {"scheduler": "opfence", "cut": [9], "stages": [["10.78.0.10"], ["10.78.0.11"]], "iteration_s": 0.2}
    plan = pinned.PinnedPlan.decode(data | {"codecs": ["lowrank:8/int4sr"], "edge_mbps": [20.0]})
    assert plan.codecs == [Codec("lowrank", rank=8, grad=Codec("int4", stochastic=True))]
    assert plan.edge_mbps == [20.0]
    assert pinned.PinnedPlan.decode(data).codecs == []  # uncompressed
    for bad in ({"codecs": ["nosuch"]}, {"codecs": ["none", "none"]}, {"edge_mbps": ["fast"]}):
        with pytest.raises(ValueError, match=pinned.ENV_VAR):
            pinned.PinnedPlan.decode(data | bad)


def test_the_live_plan_under_auto_carries_the_codecs_the_planner_priced() -> None:
    """Two fast peers whose links the adverts put at 0.05 Mbit/s: with ``compression``
    (the run's ``auto``) the live plan is the planner's with its codecs, priced for
    the bandwidth it says; without, every boundary is uncompressed."""
    from coordinator.assign import assign
    from coordinator.opdag import build_opdag
    from protocol.model.job import JobSpec
    from protocol.wire.messages import Advert

    job = JobSpec(model="gpt", model_args="n_layer=2,n_embd=64,n_head=4")
    dag = build_opdag(job.build_model(), job.first_micro_batch())
    ads = [Advert(p, [], "cpu", 1e12, 1 << 30, 0.05, 0.05, "2", 1, 0.0) for p in ("a", "b")]
    auto = assign(dag, ads, num_stages=2, compression="auto")
    assert auto.plan is not None and [c.name for c in auto.plan.codecs] != ["none"]
    assert auto.plan.edge_mbps == [pytest.approx(0.05)]
    plain = assign(dag, ads, num_stages=2)
    assert plain.plan is not None and [c.name for c in plain.plan.codecs] == ["none"]
    # the live swarm runs them on links as the planner assumed, and picks again on a far faster one
    from coordinator.links import boundary_specs, live_codecs

    specs = boundary_specs(job.build_model(), auto.cut, job.first_micro_batch())
    said: list[str] = []
    for mbps, codec, how in ((0.05, auto.plan.codecs[0], "as the planner priced it"), (1e4, Codec(), "picked again")):
        measured = {"a": {"b": mbps}, "b": {"a": mbps}}
        codecs, _ = live_codecs(
            dag, auto, specs, measured, {a.peer_id: a for a in ads}, "auto", None, None, 4, said.append
        )
        assert codecs == [codec] and how in said[-1]


def test_a_pinned_rank_reaches_the_plan_and_the_links() -> None:
    """``--compression auto-lowrank --rank 3`` on links too slow for int8: the planner
    prices rank 3 and the live swarm runs it (the rank was dropped when the planner's
    codecs became the ones that run); ``auto`` keeps int8 there."""
    from coordinator.assign import assign
    from coordinator.links import boundary_specs, live_codecs
    from coordinator.opdag import build_opdag
    from protocol.model.job import JobSpec
    from protocol.wire.messages import Advert

    job = JobSpec(model="gpt", model_args="n_layer=2,n_embd=64,n_head=4")
    dag = build_opdag(job.build_model(), job.first_micro_batch())
    ads = [Advert(p, [], "cpu", 1e12, 1 << 30, 0.05, 0.05, "2", 1, 0.0) for p in ("a", "b")]
    pinned = assign(dag, ads, num_stages=2, compression="auto-lowrank", rank=3)
    assert pinned.plan is not None and pinned.plan.codecs[0].name == "lowrank" and pinned.plan.codecs[0].rank == 3
    specs = boundary_specs(job.build_model(), pinned.cut, job.first_micro_batch())
    measured = {"a": {"b": 0.05}, "b": {"a": 0.05}}
    adverts = {a.peer_id: a for a in ads}
    codecs, _ = live_codecs(dag, pinned, specs, measured, adverts, "auto-lowrank", None, 3, 4)
    assert codecs == pinned.plan.codecs
    accurate = assign(dag, ads, num_stages=2, compression="auto")
    assert accurate.plan is not None and accurate.plan.codecs == [Codec("int8")]
