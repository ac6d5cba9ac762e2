"""The estimator against hand-computed times on small cases, and the simulator
against the estimator: latency exposure under 1F1B, the fixed cost per kernel,
replicas as the swarm runs them, exact links, tied copies, no empty stage, memory."""

from __future__ import annotations

import pytest

from coordinator.estimator import DagCosts, PeerTable, Plan, predict
from coordinator.netmodel import Network, PeerProfile
from coordinator.opfence import opfence
from coordinator.plan_eval import Options, ScheduleError
from protocol.wire.codecs import Codec
from sim.engine import iteration_seconds
from sim.topology import parse

GFLOP = 10**9


def _chain(n: int = 8, flops: int = GFLOP, cross: int = 0, params: int = 0) -> DagCosts:
    return DagCosts([flops] * n, [params] * n, [0] * n, [0] + [cross] * (n - 1), [0] * (n - 1) + [0])


def _net(peers: list[PeerProfile], mbps: float = 1e6, latency: float = 0.0) -> Network:
    return Network({p.id: "c" for p in peers}, {("c", "c"): (mbps, latency)})


def _peers(n: int, flops: float = 1e12, overhead: float = 0.0, memory: int = 1 << 40) -> list[PeerProfile]:
    return [PeerProfile(f"p{i}", flops, memory, "c", overhead) for i in range(n)]


def _both(costs: DagCosts, plan: Plan, peers: list[PeerProfile], net: Network, m: int) -> tuple[float, float]:
    table = PeerTable(peers)
    est = predict(costs, plan, table, net, m).iteration_s
    return est, iteration_seconds(costs, plan, table, net, m)


def test_fixed_cost_per_kernel_adds_to_every_micro_batch() -> None:
    """One stage of 8 ops of 1 GFLOP on a 1 TFLOP/s peer with 10 us per kernel:
    3 x (8 ms + 80 us) per micro-batch, four micro-batches."""
    costs, peers = _chain(), _peers(1, overhead=10e-6)
    est, sim = _both(costs, Plan((), [["p0"]], []), peers, _net(peers), 4)
    assert est == pytest.approx(4 * 3 * (8e-3 + 8 * 10e-6))
    assert sim == pytest.approx(est)


def test_link_latency_shows_when_1f1b_cannot_cover_it() -> None:
    """Two stages of t = 12 ms per micro-batch, a 50 ms link, 8 micro-batches: under
    1F1B two micro-batches cover a round trip (t + t + 2 x 50 ms), so the steady period
    is t + 50 ms, not t: 2t + 2 x 50 ms + 7 x (t + 50 ms) = 558 ms. (Event by event
    it is 508 ms: the fill's round trip already carried two micro-batches.)"""
    costs, peers = _chain(), _peers(2)
    plan = Plan((4,), [["p0"], ["p1"]], [Codec()])
    est, sim = _both(costs, plan, peers, _net(peers, latency=0.05), 8)
    t, lat = 12e-3, 0.05
    assert est == pytest.approx(2 * t + 2 * lat + 7 * (t + lat))
    assert sim == pytest.approx(0.508) and sim == pytest.approx(est, rel=0.1)
    fast, _ = _both(costs, plan, peers, _net(peers), 8)
    assert fast == pytest.approx(9 * t), "no latency: the textbook (M + k - 1) x t"


def test_replicas_run_whole_micro_batches_and_send_their_gradients() -> None:
    """Two replicas of one stage, four micro-batches: each runs two (24 ms each), and
    after each backward sends that micro-batch's 8 MB of gradients to the other at
    800 Mbit/s (80 ms) plus 1 ms latency. The sends of the first overlap the second's
    compute and the second's queue behind them on the link: 24 + 2 x 80 + 1 ms, where
    compute and sends in series would take 2 x (24 + 81)."""
    costs, peers = _chain(params=10**6), _peers(2)
    plan = Plan((), [["p0", "p1"]], [])
    est, sim = _both(costs, plan, peers, _net(peers, mbps=800, latency=1e-3), 4)
    assert est == pytest.approx(24e-3 + 2 * 80e-3 + 1e-3)
    assert sim == pytest.approx(est)
    assert predict(costs, plan, PeerTable(peers), _net(peers, mbps=800, latency=1e-3), 4).allreduce_s == [
        pytest.approx(81e-3)
    ]


def test_a_replicas_sends_faster_than_its_compute_hide_behind_it_but_the_last() -> None:
    """As above at 8 Gbit/s (8 ms sends, 1 ms latency): each micro-batch's sends leave
    beside the next one's compute, so the stage takes its compute plus the last sends,
    2 x 24 + 9 ms, not 2 x (24 + 9): max(compute, sends) per micro-batch, not their sum."""
    costs, peers = _chain(params=10**6), _peers(2)
    plan = Plan((), [["p0", "p1"]], [])
    est, sim = _both(costs, plan, peers, _net(peers, mbps=8000, latency=1e-3), 4)
    assert est == pytest.approx(2 * 24e-3 + 9e-3)
    assert sim == pytest.approx(est)


def test_a_replicated_stage_over_a_slow_link_costs_the_slower_of_compute_and_sends() -> None:
    """A fast first stage, then a stage of two replicas 80 Mbit/s apart, 16 micro-batches
    (8 per replica): each micro-batch's 80 kB of gradients takes 8 ms on that link, as
    long as its backward. The sends run beside the next micro-batch's compute, so the
    stage costs its compute plus the last sends (about 8 x 12 + 9 ms), as event by
    event, not compute and sends in series (8 x (12 + 9) ms)."""
    costs = _chain(params=2 * 10**4)  # 20 kB of parameters per op
    peers = [PeerProfile("p0", 1e14, 1 << 40, "c", 0.0), *_peers(3)[1:]]
    slow = {("p1", "p2"): (80.0, 1e-3), ("p2", "p1"): (80.0, 1e-3)}
    net = Network({p.id: "c" for p in peers}, {("c", "c"): (1e6, 0.0)}, slow)
    plan = Plan((4,), [["p0"], ["p1", "p2"]], [Codec()])
    est, sim = _both(costs, plan, peers, net, 16)
    compute, sends = 3 * 4e-3, 4 * 2 * 10**4 * 8 / 80e6 + 1e-3  # stage 1, per micro-batch
    assert sim == pytest.approx(8 * compute + sends, rel=0.01)
    assert est == pytest.approx(sim, rel=0.07)  # GPipe's fill: a replica's first micro-batch counted whole
    assert est < 0.75 * 8 * (compute + sends)


def test_a_slow_replica_takes_its_whole_share() -> None:
    """Round-robin dealing: a replica at half speed runs as many micro-batches as the
    fast one, so the stage takes its time (not the FLOP/s-weighted average)."""
    costs = _chain()
    peers = [PeerProfile("fast", 1e12, 1 << 40, "c", 0.0), PeerProfile("slow", 5e11, 1 << 40, "c", 0.0)]
    est, sim = _both(costs, Plan((), [["fast", "slow"]], []), peers, _net(peers), 4)
    assert est == pytest.approx(2 * 3 * 16e-3) and sim == pytest.approx(est)


def test_links_between_big_groups_are_exact() -> None:
    """Twelve replicas a stage (more than the eight the old estimator sampled): the one
    slow pair that micro-batches cross is found."""
    costs = _chain(cross=10**6)
    peers = _peers(24)
    net = _net(peers, mbps=10_000)
    net.learn("p11", "p23", net.link("p11", "p23").__class__(8.0, 0.0, True))
    plan = Plan((4,), [[f"p{i}" for i in range(12)], [f"p{i}" for i in range(12, 24)]], [Codec()])
    p = predict(costs, plan, PeerTable(peers), net, 12)
    assert p.link_s[0] == pytest.approx(10**6 * 8 / 8e6 / 12), "one micro-batch in twelve crosses it, at 8 Mbit/s"
    assert iteration_seconds(costs, p, PeerTable(peers), net, 12) == pytest.approx(p.iteration_s, rel=0.15)


def test_tied_weights_are_copied_and_synced_across_stages() -> None:
    costs = DagCosts([GFLOP] * 8, [400] + [0] * 7, [0] * 8, [0] * 8, [0] * 8, tied=((0, 7, 400),))
    assert costs.stage_params(0, 4) == 400 and costs.stage_params(4, 8) == 400, "the head's stage keeps a copy"
    assert costs.stage_params(0, 8) == 400, "one stage: one copy"
    peers = _peers(2)
    net = _net(peers, mbps=8e-3, latency=0.0)  # 1 KB/s: the 400-byte sync takes 0.4 s
    split = predict(costs, Plan((4,), [["p0"], ["p1"]], [Codec()]), PeerTable(peers), net, 1)
    assert split.iteration_s == pytest.approx(2 * 12e-3 + 0.4)


def test_no_plan_has_a_stage_that_computes_nothing() -> None:
    """Five relay ops of 1 FLOP in front of the model: no stage of them alone."""
    costs = DagCosts([1] * 5 + [GFLOP] * 8, [0] * 13, [0] * 13, [0] + [10**6] * 12, [0] * 13)
    peers = _peers(4)
    relay = predict(costs, Plan((5,), [["p0"], ["p1"]], [Codec()]), PeerTable(peers), _net(peers), 4)
    assert relay.empty_stage and not relay.valid
    for k in (2, 3, 4):
        p = opfence(costs, peers, _net(peers, mbps=10), Options(micro_batches=4, stages=k))
        assert p.valid and min(costs.stage_flops(lo, hi) for lo, hi in p.ranges(costs.num_ops)) >= GFLOP


def test_memory_refuses_plans_that_do_not_fit() -> None:
    """16 bytes of state per parameter: 8 GB of fp32 weights need 32 GB; on 12 GB peers
    that is at least three stages, and on 4 GB peers there is no plan."""
    n = 16
    costs = DagCosts([GFLOP] * n, [2**29] * n, [0] * n, [0] + [10**6] * (n - 1), [0] * n)
    peers = _peers(4, memory=12 * 2**30)
    p = opfence(costs, peers, _net(peers), Options(micro_batches=4))
    assert p.fits_memory and len(p.groups) >= 3
    with pytest.raises(ScheduleError):
        tiny = _peers(4, memory=4 * 2**30)
        opfence(costs, tiny, _net(tiny), Options(micro_batches=4))


def test_topology_sets_the_fixed_cost_per_peer() -> None:
    topo = parse(
        {
            "peers": [
                {"id": "a", "tflops": 1, "memory_gb": 1, "op_overhead_us": 25},
                {"id": "b", "tflops": 1, "memory_gb": 1},
            ]
        }
    )
    assert topo.peers[0].op_overhead_s == pytest.approx(25e-6) and topo.peers[1].op_overhead_s == pytest.approx(10e-6)
