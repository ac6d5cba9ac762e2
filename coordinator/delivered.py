"""A plan predicted again for the compute its peers delivered: the estimator's time
with each peer's FLOP/s replaced by what its measured compute per micro-batch shows.

The start-up readings of peers that share a machine are off what they then deliver
(2-15x by wall time; about 1.5x over since a one-thread peer reads its CPU time); the
plan's own prediction inherits that error, the prediction made again does not, so the
gap between it and the measured step is the time model's own. One
home for the live swarm's summary and the testbed (``fusionllm.testbed.plans``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from coordinator.estimator import PASSES, DagCosts, Plan, predict
from coordinator.netmodel import Network, PeerProfile


def delivered_flops(costs: DagCosts, plan: Plan, per_mb_s: Mapping[str, float]) -> dict[str, float]:
    """Each peer's FLOP/s as it delivered them: its stage's forward and backward FLOPs
    per micro-batch over its measured compute per micro-batch (``per_mb_s``; a peer
    missing there, or with no time, is left out)."""
    out = {}
    for (lo, hi), group in zip(plan.ranges(costs.num_ops), plan.groups, strict=True):
        for p in group:
            if per_mb_s.get(p, 0.0) > 0:
                out[p] = PASSES * costs.stage_flops(lo, hi) / per_mb_s[p]
    return out


def rescaled(peers: Mapping[str, PeerProfile], scale: Mapping[str, float]) -> dict[str, PeerProfile]:
    """``peers`` with each one's FLOP/s times its ``scale`` (1 where absent)."""
    return {i: replace(p, flops=p.flops * scale.get(i, 1.0)) for i, p in peers.items()}


def again(
    costs: DagCosts,
    plan: Plan,
    peers: Mapping[str, PeerProfile],
    network: Network,
    micro_batches: int,
    scale: Mapping[str, float],
) -> tuple[Plan, dict[str, PeerProfile]]:
    """``plan`` (its cut, groups and codecs) priced again by the estimator on the
    ``rescaled`` peers, and those peers (for the simulator)."""
    by_id = rescaled(peers, scale)
    return predict(costs, plan.bare(), by_id, network, micro_batches), by_id


def for_delivered(
    costs: DagCosts,
    plan: Plan,
    peers: Mapping[str, PeerProfile],
    network: Network,
    micro_batches: int,
    per_mb_s: Mapping[str, float],
) -> Plan:
    """``plan`` priced again with every peer at the FLOP/s it delivered
    (``delivered_flops``; a peer with no measured compute keeps its reading)."""
    got = delivered_flops(costs, plan, per_mb_s)
    scale = {p: f / peers[p].flops for p, f in got.items() if p in peers and peers[p].flops > 0}
    return again(costs, plan, peers, network, micro_batches, scale)[0]
