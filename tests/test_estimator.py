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
    """Two replicas of one stage, four micro-batches: each runs two, and after each
    backward sends that micro-batch's 8 MB of gradients to the other at 800 Mbit/s
    (80 ms) plus 1 ms latency: per micro-batch 24 ms + 81 ms, two rounds."""
    costs, peers = _chain(params=10**6), _peers(2)
    plan = Plan((), [["p0", "p1"]], [])
    est, sim = _both(costs, plan, peers, _net(peers, mbps=800, latency=1e-3), 4)
    per_mb = 3 * 8e-3 + 1e-3 + 8 * 10**6 * 8 / 800e6
    assert est == pytest.approx(2 * per_mb)
    assert sim == pytest.approx(est)
    assert predict(costs, plan, PeerTable(peers), _net(peers, mbps=800, latency=1e-3), 4).allreduce_s == [
        pytest.approx(per_mb - 24e-3)
    ]


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
