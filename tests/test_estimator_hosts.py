"""Peers that share a machine share its cores: the advert says the machine (a salted
digest) and its cores, and the estimator divides the machine's compute among its CPU
peers (``coordinator.host_share``)."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.host_share import busy_shares, machine_flops, shared
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
