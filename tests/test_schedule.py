from __future__ import annotations

import pytest

from coordinator.assign import assign
from coordinator.opdag import build_opdag
from protocol.model.job import JobSpec
from protocol.model.schedule import SCHEDULES, ScheduleError, gpipe, make, one_f_one_b, render, validate
from protocol.wire.messages import Advert


@pytest.mark.parametrize("k, m", [(1, 1), (2, 4), (3, 5), (4, 4), (4, 2)])
def test_schedules_validate(k: int, m: int) -> None:
    for sched in (gpipe(k, m), one_f_one_b(k, m)):
        validate(sched, k, m)
    assert render(make("1f1b", 2, 2)) == "stage 0: F0 F1 B0 B1\nstage 1: F0 B0 F1 B1"


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_runs_backwards_in_micro_batch_order(name: str) -> None:
    """A stage adds its parameter gradients in the order of its backwards; one process
    adds them in micro-batch order, and the swarm must equal it bit for bit (gpipe's
    backwards once ran in reverse: a 1+3 plan under fp16 ended 5e-5 off the reference)."""
    for stage in make(name, 3, 5):
        assert [m for kind, m in stage if kind == "B"] == list(range(5))


def test_validator_catches_bad_schedules() -> None:
    with pytest.raises(ScheduleError, match="B0 before F0"):
        validate([[("B", 0), ("F", 0)]], 1, 1)
    with pytest.raises(ScheduleError, match="once each"):
        validate([[("F", 0), ("F", 0), ("B", 0)]], 1, 1)
    # stage 0 wants B1 first while stage 1 wants B0 first and then blocks F1: a deadlock
    bad = [[("F", 0), ("B", 1), ("F", 1), ("B", 0)], [("F", 0), ("B", 0), ("F", 1), ("B", 1)]]
    with pytest.raises(ScheduleError):
        validate(bad, 2, 2)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        make("zigzag", 2, 2)


def _ad(pid: str, gflops: float) -> Advert:
    return Advert(pid, [], "cpu", gflops * 1e9, 1 << 30, 100.0, 100.0, "2", 1, 0.0)


def test_assignment_follows_measured_flops() -> None:
    job = JobSpec(model="branchy", data="branchy")
    dag = build_opdag(job.build_model(), job.first_micro_batch())
    plan = assign(dag, [_ad("slow", 1), _ad("fast", 3)])
    assert sorted(plan.stages) == [["fast"], ["slow"]]
    costs = dag.stage_costs(plan.cut)
    fast = plan.stages.index(["fast"])
    assert costs[fast]["flops"] > costs[1 - fast]["flops"]  # the fast peer gets the bigger share
    assert plan.plan is not None and plan.plan.iteration_s > 0
    plan = assign(dag, [_ad(f"p{i}", 1 + i) for i in range(4)], num_stages=2)
    assert len(plan.stages) == 2 and sorted(p for g in plan.stages for p in g) == ["p0", "p1", "p2", "p3"]
    with pytest.raises(ValueError, match="need at least 3 peers"):
        assign(dag, [_ad("a", 1), _ad("b", 1)], num_stages=3)


def test_gpt_cuts_land_where_only_the_residual_stream_crosses() -> None:
    """Positions that split the compute the same way (a LayerNorm apart) are not all
    equal on the wire: right after a residual add only the stream crosses, one
    position later the LayerNorm's output crosses too (twice the bytes, and not
    low-rank). Over 40 seeded FLOP/s draws for 3 peers, every boundary takes the
    light one. One of these draws used to cut after blocks.3.ln_1 (264 kB)."""
    import random

    from coordinator.estimator import DagCosts

    job = JobSpec()
    dag = build_opdag(job.build_model(), job.first_micro_batch())
    costs = DagCosts.from_opdag(dag)
    stream = 4 * 64 * 128 * 4 + 4 * 64 * 8  # the residual stream and the targets
    rng = random.Random(0)
    for _ in range(40):
        ads = [
            Advert(
                f"p{i}",
                [],
                "cpu",
                rng.uniform(25e9, 45e9),
                8 << 30,
                rng.uniform(250, 500),
                rng.uniform(250, 500),
                "2",
                1,
                0.0,
            )
            for i in range(3)
        ]
        plan = assign(dag, ads)
        cut = plan.cut.to_list()
        assert [costs.cross_bytes[p] for p in cut] == [stream, stream], (cut, [a.flops for a in ads])


def test_two_peers_behind_nats_are_planned_apart_when_their_link_would_be_forwarded() -> None:
    """Three equal peers, two behind NATs, on links slow enough to matter: a forwarded
    link (through the coordinator, store and forward) is priced at half, so the plan
    puts the reachable peer between the two; the pair's guess is never replaced by a
    probe (there is no direct path to probe)."""
    from coordinator.assign import FORWARDED_SHARE, network_from_adverts

    job = JobSpec()
    dag = build_opdag(job.build_model(), job.first_micro_batch())
    ads = [Advert(p, [], "cpu", 30e9, 8 << 30, 20.0, 20.0, "2", 1, 0.0) for p in ("n1", "n2", "d")]
    net = network_from_adverts(ads, {("n1", "n2"): 500.0, ("n1", "d"): 500.0}, nat={"n1", "n2"})
    assert net.overrides[("n1", "n2")][0] == 20.0 * FORWARDED_SHARE and net.overrides[("n1", "d")][0] == 500.0
    stages = [g[0] for g in assign(dag, ads, nat={"n1", "n2"}).stages]
    assert stages.index("d") == 1, stages


def test_a_plan_as_fast_with_fewer_forwarded_links_is_preferred() -> None:
    """Where the estimator cannot tell two orders apart, the one whose NAT'd peers
    exchange fewer frames through the coordinator wins; a faster plan wins anyway,
    and one that is slower never does."""
    from coordinator.assign import _preferred, forwarded_links
    from coordinator.estimator import Plan

    nat = {"n1", "n2"}
    apart, together = [["n1"], ["d"], ["n2"]], [["n1"], ["n2"], ["d"]]
    assert forwarded_links(apart, nat) == 0 and forwarded_links(together, nat) == 1
    assert forwarded_links([["n1", "n2"], ["d"]], nat) == 1, "replicas of one stage exchange gradients"
    plan = lambda groups, s: Plan((1, 2), groups, [], iteration_s=s)  # noqa: E731
    assert _preferred(plan(apart, 1.0), plan(together, 1.0), nat)
    assert not _preferred(plan(together, 1.0), plan(apart, 1.0), nat)
    assert _preferred(plan(together, 0.9), plan(apart, 1.0), nat), "faster wins"
    assert not _preferred(plan(apart, 1.1), plan(together, 1.0), nat), "slower never wins"
