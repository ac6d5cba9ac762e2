"""OP-Fence's search finds what its estimator prefers (pools of peers joined by fast
links, not only clusters), and the planner asks for the links that decide
between its finalists before it commits (``coordinator.asking``). Pure and fast."""

from __future__ import annotations

import pytest

from coordinator import opfence as opfence_module
from coordinator.asking import deciding_links, plan_asking, plan_pairs
from coordinator.assign import assign
from coordinator.dtfm import DTFM_EVALUATIONS, DTFM_MOST, budget, dtfm_search
from coordinator.estimator import DagCosts, PeerTable
from coordinator.netmodel import Network, PeerProfile
from coordinator.opdag import build_opdag
from coordinator.opfence import finalists, opfence
from coordinator.placement import link_pools
from coordinator.plan_eval import Options
from protocol.model.job import JobSpec
from protocol.wire.messages import Advert
from sim.asking import view_error
from sim.engine import Churn, iteration_seconds, simulate
from sim.topology import Topology

GB = 1 << 30
OPS = 8
FLOPS_PER_OP = 10**13
CROSS = 10_000_000  # bytes a micro-batch sends over any boundary, each way
#: 1 GB of parameters per op: 4 GB of training state, so an 18 GB peer holds 4 ops
OPTIONS = Options(micro_batches=8, compression=False)


def _model() -> DagCosts:
    """Eight equal ops; two 18 GB peers are needed to hold the training state."""
    cross = [0] + [CROSS] * (OPS - 1)  # floating point: gradients of the same size come back
    return DagCosts([FLOPS_PER_OP] * OPS, [GB] * OPS, [1 << 20] * OPS, cross, list(cross))


def _peer(pid: str, tflops: float, cluster: str) -> PeerProfile:
    return PeerProfile(pid, tflops * 1e12, 18 * GB, cluster)


def _six_peers() -> tuple[list[PeerProfile], Network]:
    """Two bandwidth clusters, a and b (20 Mbit/s inside, 5 between); a1 and b1 share
    a rack: their link was measured at 1 Gbit/s. a2 is as fast as a1 and b1, the rest
    are slow: the swarm's two fastest peers (a1, a2) sit on a 20 Mbit/s link."""
    peers = [_peer("a1", 100, "a"), _peer("a2", 100, "a"), _peer("a3", 10, "a")]
    peers += [_peer("b1", 100, "b"), _peer("b2", 10, "b"), _peer("b3", 10, "b")]
    clusters = {("a", "a"): (20.0, 0.001), ("b", "b"): (20.0, 0.001), ("a", "b"): (5.0, 0.001)}
    overrides = {("a1", "b1"): (1000.0, 0.001)}
    network = Network({p.id: p.cluster for p in peers}, clusters, overrides, measured={("a1", "b1")})
    return peers, network


def _by_hand() -> float:
    """[a1] then [b1], four ops each, under 1F1B with 8 micro-batches: a stage takes
    3 x 4e13 / 1e14 = 1.2 s a micro-batch; the link 1 ms + 80 ms each way; the steady
    state is the slower of a stage and the round trip over the two stages and back
    (two micro-batches cover it); the pipeline fills through both stages and both
    ways of the link, then runs seven more steady rounds."""
    stage = 3 * 4 * FLOPS_PER_OP / 100e12
    link = 0.001 + CROSS * 8 / 1000e6
    steady = max(stage, (2 * stage + 2 * link) / 2)
    return 2 * stage + 2 * link + 7 * steady


@pytest.mark.parametrize("every_grouping", [True, False])
def test_the_best_plan_is_a_pair_from_two_clusters_on_a_fast_link(
    every_grouping: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    peers, network = _six_peers()
    if not every_grouping:  # without the tiny swarms' every grouping, the pools must hold the pair
        monkeypatch.setattr(opfence_module, "TINY_SWARM", 0)
    got = opfence(_model(), peers, network, OPTIONS)
    assert sorted(got.groups) == [["a1"], ["b1"]], got.groups
    assert got.to_loss_s == pytest.approx(_by_hand(), rel=0.01)


def test_link_pools_hold_the_pair_no_cluster_holds() -> None:
    peers, network = _six_peers()
    pools = [sorted(p.id for members in pool.values() for p in members) for pool in link_pools(peers, network)]
    assert ["a1", "b1"] in pools
    assert all(len(p) >= 2 for p in pools)


def test_a_pair_as_fast_as_every_other_measured_pair_still_seeds_a_pool() -> None:
    """Twelve homes at 100 Mbit/s; the only measured pairs, r-s and t-u, both run at
    1 Gbit/s, and none of them is among the strongest peers. Neither pair is twice the
    median measured link (the two are the median), yet each is ten times what the view
    says of its homes: homes-30's GPT-2 XL plan missed its 2.4x faster pair this way."""
    peers = [_peer(f"h{i}", 100, f"h{i}") for i in range(8)]
    peers += [_peer(pid, 50, pid) for pid in ("r", "s", "t", "u")]
    fast = {("r", "s"): (1000.0, 0.001), ("t", "u"): (1000.0, 0.001)}
    network = Network({p.id: p.cluster for p in peers}, {}, fast, measured=set(fast), default=(100.0, 0.001))
    pools = [sorted(p.id for members in pool.values() for p in members) for pool in link_pools(peers, network)]
    assert ["r", "s"] in pools and ["t", "u"] in pools


def _four_homes() -> tuple[list[PeerProfile], Network, Network]:
    """Four homes, each its own cluster. The view knows no link and takes every one at
    100 Mbit/s; in truth every link is 10 Mbit/s but r-s (1 Gbit/s). p and q compute
    a little faster, so the view ranks [p][q] first: in truth it is the slowest pair."""
    peers = [_peer("p", 100, "p"), _peer("q", 100, "q"), _peer("r", 90, "r"), _peer("s", 90, "s")]
    cluster_of = {p.id: p.id for p in peers}
    view = Network(cluster_of, {}, default=(100.0, 0.001))
    truth_links = {(a.id, b.id): (10.0, 0.001) for i, a in enumerate(peers) for b in peers[i + 1 :]}
    truth_links[("r", "s")] = (1000.0, 0.001)
    truth = Network(cluster_of, {}, truth_links, measured=set(truth_links), default=(10.0, 0.001))
    return peers, view, truth


def test_the_probes_the_planner_asks_for_make_it_pick_the_faster_pair() -> None:
    peers, view, truth = _four_homes()
    costs, by_id = _model(), PeerTable(peers)
    guessed = finalists(costs, peers, view, OPTIONS)
    assert {pid for g in guessed[0].groups for pid in g} == {"p", "q"}, guessed[0].groups
    ask = deciding_links(costs, guessed, peers, view, OPTIONS)
    assert ("p", "q") in ask and len(ask) <= 16

    asked = plan_asking(costs, peers, view, OPTIONS, truth.link)
    assert {pid for g in asked.plan.groups for pid in g} == {"r", "s"}, asked.plan.groups
    assert asked.changed and asked.unasked.groups == guessed[0].groups
    assert asked.probed and len(asked.probed) <= 3 * 16
    true_s = [iteration_seconds(costs, p, by_id, truth, OPTIONS.micro_batches) for p in (guessed[0], asked.plan)]
    assert true_s[1] < true_s[0] / 5


def test_no_link_is_asked_when_the_leader_wins_however_wrong_the_view() -> None:
    peers, _, truth = _four_homes()
    costs = _model()
    plans = finalists(costs, peers, truth, OPTIONS)  # every link measured
    assert deciding_links(costs, plans, peers, truth, OPTIONS) == []


def test_a_lone_finalist_on_guessed_links_has_them_asked() -> None:
    """With no contender left in the race, the leader's own guessed links are asked:
    4x slower, it would fall out of the race, so a plan the race dropped could win."""
    peers, view, _ = _four_homes()
    costs = _model()
    leader = finalists(costs, peers, view, OPTIONS)[:1]
    assert deciding_links(costs, leader, peers, view, OPTIONS) == sorted(plan_pairs(leader[0].groups))


def _seven_homes() -> Topology:
    """Seven homes, each its own cluster, 100 Mbit/s between any two but p-q (10 Mbit/s).
    p and q compute a little faster than r, s, t, u, v (seven: more than a tiny swarm,
    whose every grouping OP-Fence would try, slowly)."""
    peers = [_peer("p", 100, "p"), _peer("q", 100, "q")] + [_peer(h, 90, h) for h in "rstuv"]
    truth = Network({p.id: p.id for p in peers}, {}, {("p", "q"): (10.0, 0.001)}, default=(100.0, 0.001))
    return Topology(peers, truth, "seven-homes")


def test_the_simulator_asks_before_it_commits_and_picks_the_faster_pair() -> None:
    """One probe a peer (seed 5) leaves p-q unprobed: the view takes it at the probes'
    median, 100 Mbit/s, and ranks [p][q] first. Asking probes it and plans [p][r]."""
    topo, options = _seven_homes(), Options(micro_batches=8, compression=False, seed=5)
    assert not {("p", "q"), ("q", "p")} & set(topo.probes(1, 5))
    blind = simulate(_model(), topo, "opfence", options, 1, probes_per_peer=1, asking=False)
    asked = simulate(_model(), topo, "opfence", options, 1, probes_per_peer=1)
    assert blind.first_plan is not None and blind.first_plan.groups == [["p"], ["q"]]
    assert asked.first_plan is not None and sorted(asked.first_plan.groups) == [["p"], ["r"]]
    assert asked.iteration_s[0] < blind.iteration_s[0] / 4
    [(iteration, report)] = asked.asks
    assert iteration == 0 and report.changed and report.unasked.groups == [["p"], ["q"]]
    assert 0 < report.probed == asked.probes_asked <= 16
    assert report.error_before > 1.3 and report.error_after == 1.0


def test_the_simulator_asks_for_its_first_plan_only_as_the_live_coordinator_does() -> None:
    """Churn re-plans (a planned peer leaves, then one slows down) rest on what the
    running plans measured, as the live coordinator's recoveries and rebalances do:
    the only asking is the first plan's."""
    topo, options = _seven_homes(), Options(micro_batches=8, compression=False, seed=5)
    churn = [Churn(2, "leave", "p"), Churn(4, "slow", "r", 0.25)]
    run = simulate(_model(), topo, "opfence", options, 6, churn, probes_per_peer=1)
    assert [it for it, _ in run.replans if it in (2, 4)], run.replans
    assert [it for it, _ in run.asks] == [0], run.asks


def test_the_live_plan_names_the_guessed_links_that_decide() -> None:
    """``assign`` (the live coordinator's planning) names the guessed link its plan
    rests on, and none once that link was measured."""
    job = JobSpec(model="branchy", data="branchy")
    dag = build_opdag(job.build_model(), job.first_micro_batch())
    ads = [Advert(p, [], "cpu", 1e10, 1 << 30, 1.0, 1.0, "2", 1, 0.0) for p in ("p0", "p1")]
    assert assign(dag, ads, num_stages=2).deciding == [("p0", "p1")]
    assert assign(dag, ads, num_stages=2, measured={("p1", "p0"): 1.0}).deciding == []


def test_view_error_is_the_typical_factor_either_way() -> None:
    truth = Network({}, {}, {("a", "b"): (100.0, 0.0), ("a", "c"): (100.0, 0.0)}, default=(100.0, 0.0))
    view = Network({}, {}, {("a", "b"): (400.0, 0.0), ("a", "c"): (25.0, 0.0)}, default=(100.0, 0.0))
    assert view_error(view, truth, [("a", "b"), ("a", "c")]) == pytest.approx(4.0)
    assert view_error(view, truth, [("b", "c")]) == view_error(view, truth, []) == 1.0


def test_plan_pairs_are_neighbouring_stages_and_replicas() -> None:
    assert plan_pairs([["a", "b"], ["c"], ["d"]]) == {("a", "b"), ("a", "c"), ("b", "c"), ("c", "d")}


def test_dtfm_budget_grows_with_the_swarm_and_says_whether_it_converged() -> None:
    costs = DagCosts.synthetic(12, seed=1)
    small = [PeerProfile(f"p{i}", (10 + i) * 1e12, 80 * GB, "c") for i in range(4)]
    big = [PeerProfile(f"p{i}", (10 + i % 5) * 1e12, 80 * GB, f"c{i % 3}") for i in range(40)]
    network = Network({p.id: p.cluster for p in big}, {}, default=(1000.0, 0.001))
    assert budget(small, network, OPTIONS) == DTFM_EVALUATIONS
    assert DTFM_EVALUATIONS < budget(big, network, OPTIONS) <= DTFM_MOST
    run = dtfm_search(costs, small, network, OPTIONS, evaluations=300)
    assert run.budget == 300 and run.evaluations <= 300 and 0 < run.best_at <= run.evaluations
    assert run.converged == (run.best_at <= run.evaluations / 2)


def test_dtfm_stops_at_its_time_budget() -> None:
    ticks = iter(range(1000))
    costs = DagCosts.synthetic(12, seed=1)
    peers = [PeerProfile(f"p{i}", (10 + i) * 1e12, 80 * GB, "c") for i in range(8)]
    network = Network({p.id: "c" for p in peers}, {}, default=(1000.0, 0.001))
    run = dtfm_search(costs, peers, network, OPTIONS, evaluations=5000, seconds=3, clock=lambda: next(ticks))
    assert run.evaluations < 5000 and run.plan.valid
