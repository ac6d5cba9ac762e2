"""Peers that share a machine share its cores: the advert says the machine (a salted
digest) and its cores, and the estimator divides the machine's compute among its CPU
peers (``coordinator.host_share``)."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.estimator import Plan
from coordinator.host_share import busy_shares, like_measured, lockstep, machine_flops, shared, undivided
from peer.machine import host_digest, machine_cores
from protocol.trust.advert_check import advert_problem
from protocol.wire.messages import Advert


def _ad(
    pid: str, gflops: float, host: str = "ab12", cores: int = 1, host_cores: int = 2, device: str = "cpu"
) -> Advert:
    return Advert(
        pid,
        ["/ip4/127.0.0.1/tcp/1"],
        device,
        gflops * 1e9,
        1 << 30,
        100.0,
        100.0,
        "2",
        4,
        0.0,
        host=host,
        cores=cores,
        host_cores=host_cores,
    )


def test_four_one_thread_peers_on_two_cores_get_half_a_thread_each() -> None:
    """The README's demo: four peers of one thread each on a 2-core machine: each
    keeps its reading (a throttled peer is slower for a reason) times 2 cores over 4 threads."""
    ads = [_ad("a", 6), _ad("b", 41), _ad("c", 20), _ad("d", 10)]
    got = machine_flops(ads)
    assert got == {
        "a": pytest.approx(3e9),
        "b": pytest.approx(20.5e9),
        "c": pytest.approx(10e9),
        "d": pytest.approx(5e9),
    }
    assert [a.flops for a in shared(ads)] == [pytest.approx(x * 1e9) for x in (3, 20.5, 10, 5)]


def test_a_machine_with_cores_enough_or_unknown_keeps_its_peers_readings() -> None:
    two = [_ad("a", 10, host_cores=8, cores=2), _ad("b", 12, host_cores=8, cores=2)]
    assert machine_flops(two) == {"a": pytest.approx(10e9), "b": pytest.approx(12e9)}  # 4 threads of 8 cores
    others = [_ad("g", 100, device="NVIDIA H200"), _ad("o", 5, host=""), _ad("z", 5, host_cores=0)]
    assert machine_flops(others) == {} and shared(others) == others
    split = [_ad("a", 10, host="aa"), _ad("b", 10, host="bb")]  # two machines, one peer each
    assert machine_flops(split) == {"a": pytest.approx(10e9), "b": pytest.approx(10e9)}


def test_the_host_digest_is_salted_by_the_run_and_bad_claims_are_refused() -> None:
    mine = host_digest("run-1", "machine-x")
    assert mine == host_digest("run-1", "machine-x") != host_digest("run-2", "machine-x")
    assert len(mine) == 16 and "machine" not in mine and len(host_digest("r")) == 16 and machine_cores() >= 1
    assert advert_problem(_ad("a", 1, host=mine)) == ""
    for bad in ({"host": "Not hex!"}, {"host": "a" * 65}, {"cores": -1}, {"host_cores": 1 << 20}):
        assert advert_problem(dataclasses.replace(_ad("a", 1), **bad)) != ""


def test_peers_that_compute_a_share_of_the_step_are_divided_as_often() -> None:
    """A first plan says each of the demo's four peers computes half of each step: four
    threads at half the time fit 2 cores, so nobody is divided; at 3/4, 3 threads ask for 2."""
    from coordinator.estimator import Plan

    ads = [_ad(p, 10) for p in "abcd"]
    plan = Plan((1, 2, 3), [["a"], ["b"], ["c"], ["d"]], [], iteration_s=0.4, stage_s=[0.05] * 4)
    busy = busy_shares(plan, 4)
    assert busy == {p: pytest.approx(0.5) for p in "abcd"}
    assert machine_flops(ads, busy) == {p: pytest.approx(10e9) for p in "abcd"}
    assert machine_flops(ads, dict.fromkeys("abcd", 0.75)) == {p: pytest.approx(10e9 * 2 / 3) for p in "abcd"}
    assert busy_shares(Plan((), [["a", "b"]], []), 4) == {}  # not predicted yet


def test_a_replicated_stage_is_busy_for_each_of_its_micro_batches() -> None:
    """``stage_s`` shares a stage's micro-batches among its replicas: each replica is
    busy its own micro-batches times ``stage_s`` times the replicas (it once counted a
    replica of two busy half as often as it was: 0.1 here)."""
    from coordinator.estimator import Plan

    plan = Plan((1,), [["a", "b"], ["c"]], [], iteration_s=0.2, stage_s=[0.01, 0.02])
    assert busy_shares(plan, 4) == {"a": pytest.approx(0.2), "b": pytest.approx(0.2), "c": pytest.approx(0.4)}
    odd = Plan((), [["a", "b"]], [], iteration_s=0.2, stage_s=[0.01])  # 3 micro-batches: 0.015 s each
    assert busy_shares(odd, 3) == {"a": pytest.approx(0.15), "b": pytest.approx(0.075)}  # dealt 2 and 1


def test_replicas_on_one_machine_ask_for_its_cores_at_once() -> None:
    """Two replicas of a stage compute at the same instants: on a 2-core machine beside
    two peers busy half the time, each asks for 2 + 2 x 0.5 threads and gets 2/3 of
    its reading, where the average (4 x 0.5 = 2) would have divided nobody."""
    ads = [_ad(p, 12) for p in "abcde"]  # e: standby, computing nothing
    busy = dict.fromkeys("abcd", 0.5)
    together = lockstep(Plan((1,), [["a", "b"], ["c"], ["d"]], []))
    assert together == {"a": ["b"], "b": ["a"], "c": [], "d": []}
    got = machine_flops(ads, busy, together)
    assert got["a"] == got["b"] == pytest.approx(8e9)
    assert got["c"] == got["d"] == pytest.approx(12e9), "a pipeline's stages take turns: the average fits"


def test_delivered_speeds_are_read_back_into_the_peers_own() -> None:
    """The rebalancer's measured speeds are what each machine delivered under the
    current plan: ``undivided`` turns them back, so ``shared`` under the same plan gives
    them again, and a peer outside the plan (standby) keeps its reading."""
    ads = [_ad(p, 9) for p in "abc"] + [_ad("s", 5)]
    busy = {"a": 1.0, "b": 1.0, "c": 0.5}  # 2.5 threads asked for on 2 cores: x0.8
    together = {"a": ["b"], "b": ["a"], "c": []}
    own = undivided(ads, busy, together)
    assert [a.flops for a in own] == [pytest.approx(x * 1e9) for x in (11.25, 11.25, 11.25, 5)]
    again = shared(own, busy, together)
    assert [a.flops for a in again[:3]] == [pytest.approx(9e9)] * 3
    alone = [_ad("a", 9), _ad("b", 9), _ad("s", 5, host="cd")]  # a standby peer alone on its machine
    assert [a.flops for a in undivided(alone, {"a": 1.0, "b": 1.0}, {})][2] == 5e9, "nothing asked: not divided"
    assert machine_flops([_ad("a", 9)], {"a": 0.0}) == {"a": 9e9}


def test_rebalance_checks_plan_within_their_share_of_the_run() -> None:
    """A check that planned for 0.2 s may plan again 10 s later (2%), not 2.5 s later,
    unless the peers or their speeds changed since: then 2 s later (10%; CI: a peer
    slowed to a twentieth waited for a check past the two periods it is given)."""
    from coordinator import replan

    same = {"a": 10.0, "b": 20.0}
    assert replan.check_affordable(10.0, 0.2, same, same) and not replan.check_affordable(2.5, 0.2, same, same)
    assert replan.check_affordable(float("inf"), 5.0, same, {}), "the first check always plans"
    slowed = {"a": 10.0, "b": 1.0}
    assert replan.check_affordable(2.5, 0.2, slowed, same), "a peer's speed changed level: 10% of the time"
    assert replan.check_affordable(2.5, 0.2, {**same, "c": 5.0}, same), "a peer joined: 10% of the time"
    assert not replan.check_affordable(1.5, 0.2, slowed, same), "but not more"
    assert not replan.check_affordable(2.5, 0.2, {"a": 14.0, "b": 11.0}, same), "under 2x: not changed"
    assert replan.check_affordable(2.5, 0.2, same, same, last_unsettled=True), "it planned on a speed half-way"


def test_a_speed_that_changed_level_over_a_window_is_seen() -> None:
    """``speed_moved``: the medians of a window's first and last measurements. CI's
    throttled peer: 21.9 GFLOP/s, then 1.7; single readings spread 4-5x do not count."""
    from coordinator import replan

    noisy = [20.0, 5.0, 25.0, 18.0, 22.0, 6.0, 30.0, 19.0, 21.0] * 2
    assert replan.speed_moved(noisy) < replan.CHANGED_SPEED
    assert replan.speed_moved([21.9] * 14 + [1.7] * 4) == pytest.approx(1.0), "4 of 9: not yet its median"
    assert replan.speed_moved([21.9] * 12 + [1.7] * 6) == pytest.approx(21.9 / 1.7), "6 of 9: its median"
    assert replan.speed_moved([21.9] * 9 + [1.7] * 9) == pytest.approx(21.9 / 1.7)
    assert replan.speed_moved([21.9] * 30 + [1.7] * 6, span=12) == pytest.approx(21.9 / 1.7), "the span's own"
    assert replan.speed_moved([21.9] * 3 + [1.7] * 3) == pytest.approx(21.9 / 1.7), "a short window: its halves"
    assert replan.speed_moved([21.9] * 2 + [1.7] * 3) == 1.0, "two against two: too few to say"
    assert replan.speed_moved([]) == 1.0 and replan.speed_moved([3.0] * 9, span=0) == 1.0


def test_an_unmeasured_peer_reads_as_its_machines_measured_peers_delivered() -> None:
    """A reading is one thread's speed with a core to itself; the demo's peers
    delivered about two thirds of it. A standby peer on the same machine is scaled
    alike (else it looks 1.5x faster than the peers it would replace); one on another
    machine, or a GPU, keeps its reading."""
    readings = [
        _ad("a", 90),
        _ad("b", 96),
        _ad("standby", 93),
        _ad("elsewhere", 93, host="cd34"),
        _ad("gpu", 500, device="cuda"),
    ]
    own = [
        dataclasses.replace(a, flops=a.flops * (0.6 if a.peer_id == "a" else 0.7)) if a.peer_id in ("a", "b") else a
        for a in readings
    ]
    out = {a.peer_id: a.flops for a in like_measured(readings, own, {"a", "b"})}
    assert out["a"] == pytest.approx(54e9) and out["b"] == pytest.approx(67.2e9)
    assert out["standby"] == pytest.approx(93e9 * 0.65)  # the median of 0.6 and 0.7
    assert out["elsewhere"] == 93e9 and out["gpu"] == 500e9
