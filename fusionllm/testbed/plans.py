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

import numpy as np

from coordinator.delivered import again
from coordinator.estimator import PASSES, DagCosts, Plan, compute_s, dealt
from coordinator.netmodel import PeerProfile
from coordinator.opdag import build_opdag
from coordinator.plan_eval import Options, ScheduleError
from coordinator.scheduler import plan as schedule
from fusionllm.testbed.topo import ComputeMap, TestbedError, addresses
from protocol.model.job import JobSpec
from sim.engine import iteration_seconds
from sim.topology import Topology

#: the most a compute call's own work may be fitted at (``join --throttle-call-ms``
#: takes up to a second; a fit above this comes from stages too alike to tell apart)
MAX_CALL_S = 0.05


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
    cost added: a call's own work stands for it), with a live swarm's fixed costs as
    calibrated (``ComputeMap.overheads``): they run the real swarm, and the throttle
    idles after the optimizer's compute as after the rest."""
    return [
        replace(p, flops=compute.flops(p.id), op_overhead_s=0.0, overheads=compute.overheads(p.id)) for p in topo.peers
    ]


def optimizer_scale(
    plan: Plan, costs: DagCosts, topo: Topology, compute: ComputeMap, parts: list[dict], updates: float = 1.0
) -> float:
    """How many times the estimator's optimizer (``overheads.LIVE``'s norms and update,
    slowed by each peer's throttle) the stages' measured one took (``parts``: each
    stage's step breakdown, as ``swarm.Measured.stage_parts``, whose ``optimizer``
    leaves the hand-offs to ``handoff``; ``updates``: the share of its windows that
    hold an update: a step's update falls in the next step's window, so a run's first
    holds none); 1.0 where none was printed. On ``far-lab`` 2.1-3.3x: the 2-core
    machine's peers beside each other run the update slower than the quiet demo
    ``LIVE`` was measured on."""
    peers = {q.id: q for q in emulated_peers(topo, replace(compute, optimizer_scale=1.0))}
    got = modelled = 0.0
    for (lo, hi), group, part in zip(plan.ranges(costs.num_ops), plan.groups, parts, strict=False):
        params = costs.stage_params(lo, hi)
        slowed_part = statistics.fmean(
            peers[p].overheads.optimizer_s + params * peers[p].overheads.param_byte_s for p in group
        )
        got, modelled = got + part.get("optimizer", 0.0) / 1e3 / updates, modelled + slowed_part
    return got / modelled if got > 0 and modelled > 0 else 1.0


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


def stage_compute(
    plan: Plan, costs: DagCosts, topo: Topology, compute: ComputeMap, micro_batches: int = 0
) -> list[tuple[float, float]]:
    """Per stage, the estimator's compute per micro-batch, forward and backward, as the
    coordinator's per-stage line takes the measured one: the median over the stage's
    replicas of each one's compute per micro-batch it ran, a replica dealt none counting
    its step's compute (the norms, the sum: 0 to the estimator) whole. With
    ``micro_batches`` 0, every replica runs some. Split in two: the FLOPs' time
    (``compute_s``) and the two calls' own work (``Overheads.call_s``). (The
    coordinator's own per-stage prediction is a period with a replicated stage's
    gradient sends in it: not comparable with what its peers computed; nor is the
    group's slowest peer, where the median replica is faster, or idle.)"""
    by_id = {p.id: p for p in emulated_peers(topo, compute)}
    out = []
    for (lo, hi), group in zip(plan.ranges(costs.num_ops), plan.groups, strict=True):
        runs = dealt(micro_batches, len(group)) if micro_batches else [1] * len(group)
        each = [(compute_s(costs, lo, hi, [by_id[x]]), 2 * by_id[x].overheads.call_s) if n else (0.0, 0.0)
                for x, n in zip(group, runs)]  # fmt: skip
        out.append((statistics.median(f for f, _ in each), statistics.median(c for _, c in each)))
    return out


def compute_ratios(
    plan: Plan,
    costs: DagCosts,
    topo: Topology,
    compute: ComputeMap,
    measured_s: list[float | None],
    micro_batches: int = 0,
) -> list[float | None]:
    """Each stage's measured compute per micro-batch over the estimator's
    (``stage_compute``)."""
    out: list[float | None] = []
    for (flops_s, calls_s), got in zip(stage_compute(plan, costs, topo, compute, micro_batches), measured_s):
        est = flops_s + calls_s
        out.append(round(got / est, 3) if got and est > 0 else None)
    return out


def fit_compute(
    plan: Plan, costs: DagCosts, topo: Topology, compute: ComputeMap, measured_s: list[float | None], mb: int
) -> tuple[float, float]:
    """What one thread delivers beside the swarm's processes, from a run of ``plan``
    whose stages computed ``measured_s`` a micro-batch: (FLOP/s, a compute call's own
    work in seconds), fitted over the stages by least squares, as each stage's compute
    is its FLOPs at that speed and two calls, both stretched by its throttle (the run's
    peers stretch all of it: ``--throttle-call-ms`` 0). On ``far-lab`` 19-27 GFLOP/s
    and 0.2-0.7 ms a call: the head's stage, a seventh of the blocks' FLOPs, took a
    fifth of their time. Where the stages cannot tell the two apart (one stage, or a
    fit below zero or above ``MAX_CALL_S``): no call cost, and the FLOP/s that the
    median stage gives (``delivered_scale``)."""
    rows, got = [], []
    stages = zip(stage_compute(plan, costs, topo, compute, mb), plan.ranges(costs.num_ops), measured_s)
    for (flops_s, _), (lo, hi), m in stages:
        if m and flops_s > 0:
            stretch = flops_s * compute.base_flops / (PASSES * costs.stage_flops(lo, hi))  # 1 / its throttle
            rows.append((flops_s, 2 * stretch))
            got.append(m)
    fallback = (compute.base_flops * delivered_scale(compute_ratios(plan, costs, topo, compute, measured_s, mb)), 0.0)
    if len(rows) < 2 or len({round(a / b, 9) for a, b in rows}) < 2:
        return fallback
    (slower, call_s), *_ = np.linalg.lstsq(np.array(rows), np.array(got), rcond=None)
    sane = slower > 0 and 0 <= call_s <= MAX_CALL_S
    return (float(compute.base_flops / slower), float(call_s)) if sane else fallback


def delivered_scale(compute_ratio: list[float | None]) -> float:
    """How much faster than mapped the peers computed: one over the median of the
    stages' measured over predicted compute (``compute_ratios``; 1.0: as mapped)."""
    ratios = [r for r in compute_ratio if r]
    return 1.0 / statistics.median(ratios) if ratios else 1.0


def stage_scales(
    plan: Plan, costs: DagCosts, topo: Topology, compute: ComputeMap, measured_s: list[float | None], mb: int
) -> dict[str, float]:
    """Each peer's FLOP/s scale for the compute its stage delivered (``measured_s`` a
    micro-batch): the stage's FLOPs' time (``stage_compute``) over what the measured
    compute leaves of it besides the calls' own work; a stage with none, or no more
    than the calls, takes ``delivered_scale``'s. Per stage, as the live swarm's summary
    takes each peer's own."""
    fill = delivered_scale(compute_ratios(plan, costs, topo, compute, measured_s, mb))
    out = {}
    for group, (flops_s, calls_s), m in zip(plan.groups, stage_compute(plan, costs, topo, compute, mb), measured_s):
        out.update(dict.fromkeys(group, flops_s / (m - calls_s) if m and m > calls_s and flops_s > 0 else fill))
    return {p: out.get(p, fill) for g in plan.groups for p in g}


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
    compute the peers delivered (``coordinator.delivered.again``). The optimizer keeps
    its cost as calibrated (``ComputeMap.optimizer_scale``): it is not the stage's
    forward and backward, whose speed per FLOP the scale measures."""
    peers = {q.id: q for q in emulated_peers(topo, compute)}
    scales = scale if isinstance(scale, dict) else dict.fromkeys(peers, scale)
    plan, by_id = again(costs, p.plan, peers, topo.network, micro_batches, scales)
    return plan.iteration_s, iteration_seconds(costs, p.plan, by_id, topo.network, micro_batches)


@dataclass(frozen=True)
class Delivered:
    """A run's plan predicted again for the compute its peers delivered: the stages'
    ``compute_ratios``, ``delivered_scale`` (one for all), the estimator's and the
    simulator's time with each stage's own (``stage_scales``), and the estimator's with
    the one scale beside them."""

    ratios: list[float | None]
    scale: float
    estimated_s: float
    simulated_s: float
    estimated_one_scale_s: float


def as_delivered(
    p: Predicted, costs: DagCosts, topo: Topology, compute: ComputeMap, stage_compute_s: list[float | None], mb: int
) -> Delivered:
    """A run of ``p``'s plan, whose stages computed ``stage_compute_s`` a micro-batch,
    priced again for that compute (``Delivered``)."""
    ratios = compute_ratios(p.plan, costs, topo, compute, stage_compute_s, mb)
    scale = delivered_scale(ratios)
    est, sim = repredict(p, costs, topo, compute, mb, stage_scales(p.plan, costs, topo, compute, stage_compute_s, mb))
    one, _ = repredict(p, costs, topo, compute, mb, scale)
    return Delivered(ratios, scale, est, sim, one)
