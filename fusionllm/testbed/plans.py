"""Each scheduler's plan for the testbed's peers, as this machine delivers them, and
what the estimator and the simulator predict for it; the pinned plan the coordinator
runs (``coordinator.pinned``); the one-thread FLOP/s this machine delivers on the model."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from coordinator.delivered import again
from coordinator.estimator import DagCosts, Plan, compute_s, dealt
from coordinator.netmodel import PeerProfile
from coordinator.opdag import build_opdag
from coordinator.overheads import LIVE, slowed
from coordinator.plan_eval import Options, ScheduleError
from coordinator.scheduler import plan as schedule
from fusionllm.testbed.topo import ComputeMap, TestbedError, addresses
from protocol.model.job import JobSpec
from sim.engine import iteration_seconds
from sim.topology import Topology


@dataclass(frozen=True)
class Predicted:
    scheduler: str
    plan: Plan
    estimated_s: float  # the estimator's iteration time for the plan
    simulated_s: float  # the simulator's, event by event

    def pinned(self, topo: Topology) -> dict[str, Any]:
        """The plan as ``coordinator.pinned`` reads it: hosts by their address."""
        ips = addresses(topo)
        return {
            "scheduler": self.scheduler,
            "cut": list(self.plan.cut),
            "stages": [[ips[p] for p in group] for group in self.plan.groups],
            "codecs": [str(c) for c in self.plan.codecs],
            "iteration_s": self.estimated_s,
            "stage_s": list(self.plan.stage_s),
            "edge_mbps": list(self.plan.edge_mbps),
        }

    def write(self, topo: Topology, path: Path) -> Path:
        path.write_text(json.dumps(self.pinned(topo)))
        return path


def costs_of(job: JobSpec) -> DagCosts:
    """The model's OP-DAG costs for one micro-batch, traced as the coordinator traces it."""
    return DagCosts.from_opdag(build_opdag(job.build_model(), job.first_micro_batch()))


def one_thread_flops(job: JobSpec, costs: DagCosts, seconds: float = 1.0, at_least: int = 15) -> float:
    """FLOP/s one thread of this machine delivers on the model: a micro-batch's forward
    and backward (3x the forward's FLOPs) again and again for ``seconds`` (at least
    ``at_least`` times) after a warm-up; the median pass. The fastest overstated what
    the peers deliver beside the swarm's other processes, and 15 passes of a few ms
    each read anywhere from 3 to 50 GFLOP/s on this shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, batch = job.build_model(), job.first_micro_batch()
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < at_least + 2 or time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            out = model(*batch)
            loss = out[0] if isinstance(out, tuple) else out
            (loss if loss.dim() == 0 else loss.float().mean()).backward()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 3 * costs.total_flops / statistics.median(times[2:])


def emulated_peers(topo: Topology, compute: ComputeMap) -> list[PeerProfile]:
    """The topology's peers at the FLOP/s they deliver on this machine (no per-kernel
    cost added: a measured step holds it, as for a live swarm's peers), with a live
    swarm's fixed costs (``coordinator.overheads.LIVE``): they run the real swarm, and
    the throttle idles after the optimizer's compute as after the rest (``slowed``)."""
    return [
        replace(p, flops=compute.flops(p.id), op_overhead_s=0.0, overheads=slowed(LIVE, 1 / compute.throttles[p.id]))
        for p in topo.peers
    ]


def predict_all(
    schedulers: list[str],
    costs: DagCosts,
    topo: Topology,
    compute: ComputeMap,
    micro_batches: int,
    compression: bool = False,
) -> list[Predicted]:
    """Each scheduler's plan (every peer used; with ``compression``, the codecs ``auto``
    gives its slow edges, priced) with the estimator's and the simulator's iteration
    time; TestbedError when a scheduler finds none."""
    peers = emulated_peers(topo, compute)
    by_id = {p.id: p for p in peers}
    options = Options(micro_batches=micro_batches, compression=compression, standby=False)
    out = []
    for name in schedulers:
        try:
            p = schedule(name, costs, peers, topo.network, options)
        except ScheduleError as exc:
            raise TestbedError(f"{name}: {exc}") from None
        sim_s = iteration_seconds(costs, p, by_id, topo.network, micro_batches)
        out.append(Predicted(name, p, p.iteration_s, sim_s))
    return out


def compute_ratios(
    plan: Plan,
    costs: DagCosts,
    topo: Topology,
    compute: ComputeMap,
    measured_s: list[float | None],
    micro_batches: int = 0,
) -> list[float | None]:
    """Each stage's measured compute per micro-batch over the estimator's compute alone
    (``compute_s``: forward and backward, as mapped), both as the coordinator's
    per-stage line takes it: the median over the stage's replicas of each one's compute
    per micro-batch it ran, a replica dealt none counting its step's compute (the norms,
    the sum: 0 to the estimator) whole. With ``micro_batches`` 0, every replica runs
    some. (The coordinator's own per-stage prediction is a period with a replicated
    stage's gradient sends in it: not comparable with what its peers computed; nor is
    the group's slowest peer, where the median replica is faster, or idle.)"""
    by_id = {p.id: p for p in emulated_peers(topo, compute)}
    out: list[float | None] = []
    for (lo, hi), group, got in zip(plan.ranges(costs.num_ops), plan.groups, measured_s, strict=False):
        runs = dealt(micro_batches, len(group)) if micro_batches else [1] * len(group)
        est = statistics.median(compute_s(costs, lo, hi, [by_id[x]]) if n else 0.0 for x, n in zip(group, runs))
        out.append(round(got / est, 3) if got and est > 0 else None)
    return out


def delivered_scale(compute_ratio: list[float | None]) -> float:
    """How much faster than mapped the peers computed: one over the median of the
    stages' measured over predicted compute (``compute_ratios``; 1.0: as mapped)."""
    ratios = [r for r in compute_ratio if r]
    return 1.0 / statistics.median(ratios) if ratios else 1.0


def stage_scales(plan: Plan, compute_ratio: list[float | None]) -> dict[str, float]:
    """Each peer's FLOP/s scale for the compute its stage delivered: one over its
    stage's ratio (``compute_ratios``), a stage with none taking ``delivered_scale``'s.
    A diagnostic beside the one scale: with every stage's compute as measured, what
    is left of the estimator's error is its time model's own (on ``far-lab`` OP-Fence's
    plan -9% to -18%, dtfm's +11% to +12%: no better than one scale, whose error on
    OP-Fence's plan comes from the first stage computing faster than the second)."""
    fill = delivered_scale(compute_ratio)
    return {p: 1.0 / r if r else fill for group, r in zip(plan.groups, compute_ratio, strict=True) for p in group}


def repredict(
    p: Predicted,
    costs: DagCosts,
    topo: Topology,
    compute: ComputeMap,
    micro_batches: int,
    scale: float | dict[str, float],
) -> tuple[float, float]:
    """The estimator's and the simulator's time for ``p``'s plan with every peer's
    FLOP/s times ``scale`` (one for all, or each peer's): the prediction for the
    compute the peers delivered (``coordinator.delivered.again``; throttled peers:
    their optimizer's too)."""
    peers = {q.id: q for q in emulated_peers(topo, compute)}
    scales = scale if isinstance(scale, dict) else dict.fromkeys(peers, scale)
    plan, by_id = again(costs, p.plan, peers, topo.network, micro_batches, scales, throttled=True)
    return plan.iteration_s, iteration_seconds(costs, p.plan, by_id, topo.network, micro_batches)


@dataclass(frozen=True)
class Delivered:
    """A run's plan predicted again for the compute its peers delivered: the stages'
    ``compute_ratios``, ``delivered_scale`` (one for all), the estimator's and the
    simulator's time with that scale, and the estimator's with each stage's own
    (``stage_scales``) beside them."""

    ratios: list[float | None]
    scale: float
    estimated_s: float
    simulated_s: float
    estimated_per_stage_s: float


def as_delivered(
    p: Predicted, costs: DagCosts, topo: Topology, compute: ComputeMap, stage_compute_s: list[float | None], mb: int
) -> Delivered:
    """A run of ``p``'s plan, whose stages computed ``stage_compute_s`` a micro-batch,
    priced again for that compute (``Delivered``)."""
    ratios = compute_ratios(p.plan, costs, topo, compute, stage_compute_s, mb)
    scale = delivered_scale(ratios)
    est, sim = repredict(p, costs, topo, compute, mb, scale)
    per_stage, _ = repredict(p, costs, topo, compute, mb, stage_scales(p.plan, ratios))
    return Delivered(ratios, scale, est, sim, per_stage)
