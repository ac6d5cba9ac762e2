"""The strong baselines (``bw-blind``, ``petals``, ``dtfm``): valid plans on seeded
random instances, their defining rules on hand-checked cases, forced stage
counts, and refusals when nothing fits memory."""

from __future__ import annotations

import random

import pytest

from coordinator.baselines import bw_blind, by_speed, compute, petals
from coordinator.dtfm import _Dtfm, dtfm
from coordinator.estimator import DagCosts, PeerTable, Plan
from coordinator.netmodel import Network, PeerProfile
from coordinator.placement import balanced_groups
from coordinator.plan_eval import Options, ScheduleError, evaluate
from coordinator.scheduler import STRONG, plan

GB = 1 << 30
#: a small search budget keeps the DT-FM tests fast
BUDGET = 150


def _instance(seed: int, num_peers: int = 7, num_ops: int = 24) -> tuple[DagCosts, list[PeerProfile], Network]:
    """Random chain costs with a few forbidden cut positions, peers of mixed speed
    and memory (some cannot hold the whole model) in three clusters."""
    rng = random.Random(seed)
    base = DagCosts.synthetic(num_ops, seed=seed)
    forbidden = frozenset(rng.sample(range(1, num_ops), 4))
    flops = [f * 1000 for f in base.flops]  # heavy enough that pipelines pay
    costs = DagCosts(flops, base.param_bytes, base.act_bytes, base.cross_bytes, base.float_cross, forbidden)
    peers = [
        PeerProfile(f"p{i}", rng.choice([10, 20, 40]) * 1e12, rng.choice([64 << 20, 256 << 20, 4 * GB]), "abc"[i % 3])
        for i in range(num_peers)
    ]
    clusters = {}
    for i, a in enumerate("abc"):
        clusters[(a, a)] = (10_000.0, 1e-4)
        for b in "abc"[i + 1 :]:
            clusters[(a, b)] = (rng.choice([10.0, 100.0, 1000.0]), rng.choice([0.01, 0.05]))
    return costs, peers, Network({p.id: p.cluster for p in peers}, clusters)


def _check_valid(
    plan: Plan, name: str, costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options
) -> None:
    """Every peer at most once, a contiguous cut at allowed positions, memory fits, and
    the predicted times are those ``plan_eval.evaluate`` gives (the swarm's codecs)."""
    members = [p for g in plan.groups for p in g]
    assert len(members) == len(set(members)) and set(members) <= {p.id for p in peers}
    assert all(plan.groups) and len(plan.cut) == len(plan.groups) - 1
    bounds = (0, *plan.cut, costs.num_ops)
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert not set(plan.cut) & costs.forbidden
    assert plan.valid and plan.scheduler == name
    again = evaluate(costs, plan.cut, plan.groups, PeerTable(peers), network, options, name)
    assert again.to_loss_s == pytest.approx(plan.to_loss_s) and again.codecs == plan.codecs


def _run(name: str, costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options) -> Plan:
    if name == "dtfm":
        return dtfm(costs, peers, network, options, evaluations=BUDGET)
    return plan(name, costs, peers, network, options)


@pytest.mark.parametrize("name", STRONG)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_returns_a_valid_plan(name: str, seed: int) -> None:
    costs, peers, network = _instance(seed)
    options = Options(micro_batches=8, seed=seed)
    _check_valid(_run(name, costs, peers, network, options), name, costs, peers, network, options)


def test_dtfm_is_deterministic_for_a_seed_and_never_worse_than_its_seed_plans() -> None:
    costs, peers, network = _instance(3, num_peers=8)
    options = Options(micro_batches=8, seed=5)
    first = dtfm(costs, peers, network, options, evaluations=BUDGET)
    second = dtfm(costs, peers, network, options, evaluations=BUDGET)
    assert (first.cut, first.groups, first.iteration_s) == (second.cut, second.groups, second.iteration_s)
    search = _Dtfm(costs, peers, network, options)
    seeded = [search.score(g) for g in search.seeds()]
    fitting = [p.to_loss_s for p in seeded if p is not None and p.valid]
    assert len(fitting) >= 5 and first.to_loss_s <= min(fitting)


def test_dtfm_predicts_exactly_its_budget_of_distinct_genomes(monkeypatch: pytest.MonkeyPatch) -> None:
    costs, peers, network = _instance(0)
    seen: set[tuple[int, ...]] = set()
    score = _Dtfm.score

    def spy(self: _Dtfm, genome: tuple[int, ...]) -> Plan | None:
        seen.add(genome)
        return score(self, genome)

    monkeypatch.setattr(_Dtfm, "score", spy)
    dtfm(costs, peers, network, Options(micro_batches=8), evaluations=BUDGET)
    assert len(seen) == BUDGET


def test_dtfm_finds_plans_its_seeds_miss() -> None:
    """On some of a few seeded swarms the search beats every one of its seed plans."""
    gains = []
    for seed in range(5):
        costs, peers, network = _instance(seed)
        options = Options(micro_batches=8)
        search = _Dtfm(costs, peers, network, options)
        seeded = min(p.to_loss_s for p in map(search.score, search.seeds()) if p is not None and p.valid)
        gains.append(seeded / dtfm(costs, peers, network, options, evaluations=BUDGET).to_loss_s)
    assert min(gains) >= 1.0 and max(gains) > 1.01


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_bw_blind_is_not_worse_than_compute_and_groups_blindly(seed: int) -> None:
    """bw-blind tries compute's own plan (every peer, k balanced groups) with codecs,
    so it is never slower; and its groups are FLOP/s-balanced groups of the fastest
    peers, whatever the links."""
    costs, peers, network = _instance(seed, num_peers=8)
    options = Options(micro_batches=8)
    plan = bw_blind(costs, peers, network, options)
    for k in (1, 2, 4, 8):
        other = compute(costs, peers, network, options, k)
        if other.valid:
            assert plan.to_loss_s <= other.to_loss_s * (1 + 1e-9)
    m, k = sum(len(g) for g in plan.groups), len(plan.groups)
    assert plan.groups == [[p.id for p in g] for g in balanced_groups(by_speed(peers)[:m], k)]


def test_petals_puts_each_peer_where_throughput_is_lowest() -> None:
    """Four equal ops; each peer's memory holds two. Fastest first: a (40 TFLOP/s)
    opens [0, 2) and b (30) opens [2, 4): 6.7 and 5 micro-batches/s; c (20) joins the
    slower stage (b's: 8.3 then), and d (10) the now slower first stage."""
    costs = DagCosts([10**12] * 4, [GB] * 4, [1 << 20] * 4, [0, 1024, 1024, 1024], [0, 1024, 1024, 1024])
    peers = [PeerProfile(pid, tf * 1e12, 9 * GB, "x") for pid, tf in [("c", 20), ("a", 40), ("d", 10), ("b", 30)]]
    network = Network({p.id: "x" for p in peers}, {("x", "x"): (10_000.0, 1e-4)})
    plan = petals(costs, peers, network, Options(micro_batches=4))
    assert plan.cut == (2,) and plan.groups == [["a", "d"], ["b", "c"]]


def test_petals_spans_follow_memory() -> None:
    """A peer takes as many ops as its memory holds: a big one the whole model (and
    every other peer becomes its replica), small ones a pipeline of spans; the span
    that reaches the end is whole, and its neighbour gives up the overlap."""
    costs = DagCosts([10**12] * 6, [GB] * 6, [1 << 20] * 6, [0, *[1024] * 5], [0, *[1024] * 5])
    network = Network({}, {}, default=(10_000.0, 1e-4))
    big = [PeerProfile("big", 40e12, 40 * GB), PeerProfile("small", 10e12, 9 * GB)]
    assert petals(costs, big, network, Options(micro_batches=4)).groups == [["big"]]
    small = [PeerProfile(f"s{i}", 10e12, 9 * GB) for i in range(3)]
    plan = petals(costs, small, network, Options(micro_batches=4))
    assert plan.cut == (2, 4) and [len(g) for g in plan.groups] == [1, 1, 1]
    five = DagCosts([10**12] * 5, [GB] * 5, [1 << 20] * 5, [0, *[1024] * 4], [0, *[1024] * 4])
    plan = petals(five, small, network, Options(micro_batches=4))
    assert plan.cut == (2, 3), "the last peer takes the window [3, 5), as Petals' last server would"


def test_petals_leaves_the_last_replica_out_when_it_breaks_memory() -> None:
    """Each stage fits its two ops with 1F1B's micro-batches in flight, not with all
    eight. Four peers make even replica pairs (1F1B); with three, c's joining would
    leave the stages uneven, so the swarm would run GPipe: c waits on standby."""
    costs = DagCosts([10**12] * 4, [GB] * 4, [GB] * 4, [0, 1024, 1024, 1024], [0, 1024, 1024, 1024])
    speeds = {"a": 40, "b": 30, "c": 20, "d": 10}
    peers = [PeerProfile(pid, tf * 1e12, 13 * GB, "x") for pid, tf in speeds.items()]
    network = Network({p.id: "x" for p in peers}, {("x", "x"): (10_000.0, 1e-4)})
    assert petals(costs, peers, network, Options(micro_batches=8)).groups == [["a", "d"], ["b", "c"]]
    assert petals(costs, peers[:3], network, Options(micro_batches=8)).groups == [["a"], ["b"]]


@pytest.mark.parametrize("name", STRONG)
def test_forced_stages_are_honoured(name: str) -> None:
    costs, peers, network = _instance(1, num_peers=8)
    big = [PeerProfile(p.id, p.flops, 4 * GB, p.cluster) for p in peers]  # every plan of 3 stages fits
    for stages in (1, 3):
        options = Options(micro_batches=8, stages=stages)
        plan = _run(name, costs, big, network, options)
        assert len(plan.groups) == stages
        _check_valid(plan, name, costs, big, network, options)


@pytest.mark.parametrize("name", STRONG)
def test_schedule_error_when_nothing_fits_memory(name: str) -> None:
    costs = DagCosts([10**12] * 6, [GB] * 6, [1 << 20] * 6, [0, *[1024] * 5], [0, *[1024] * 5])
    peers = [PeerProfile(f"p{i}", 10e12, 2 * GB) for i in range(3)]  # one op needs 4 GiB of state
    network = Network({}, {}, default=(1000.0, 0.01))
    with pytest.raises(ScheduleError, match=name):
        _run(name, costs, peers, network, Options(micro_batches=4))
    with pytest.raises(ScheduleError):  # more stages than peers
        _run(name, costs, peers, network, Options(micro_batches=4, stages=4))
