"""How long the 1F1B schedule lets a round trip between two stages show: the
micro-batches each stage holds in flight, and the round trips that the steady period
cannot hide; and what the step's end waits for after the pipeline drains (the last
replica gradient sends, the tied weights' sync). The estimator's, kept apart from
its plan model."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from coordinator.netmodel import Network, link_seconds

if TYPE_CHECKING:
    from coordinator.estimator import DagCosts, Plan


def windows(k: int, rounds: int) -> np.ndarray:
    """Micro-batches each of ``k`` stages holds in flight under 1F1B."""
    return np.minimum(k - np.arange(k), rounds)


def round_trips(one: list[float], there_and_back: list[float], rounds: int) -> list[float]:
    """Under 1F1B stage ``s`` starts a forward only after a backward once it holds
    ``w_s = min(k - s, rounds)`` micro-batches: the round trip from stage ``s`` to a
    later stage ``t`` and back carries only ``w_s - w_t + 1`` micro-batches (two across
    one link), so its latency shows unless the steady period is at least that round
    trip divided by that count. (Counting the fill's round trip again overstates a
    latency-bound pipeline by up to about 10%; the simulator has the exact figure.)"""
    k = len(one)
    if k < 2:
        return []
    stages = np.concatenate([[0.0], np.cumsum(one)])
    links = np.concatenate([[0.0], np.cumsum(there_and_back)])
    window = windows(k, rounds)
    s, t = _pairs_after(k)
    trips = stages[t + 1] - stages[s] + links[t] - links[s]
    return [float((trips / np.maximum(1, window[s] - window[t] + 1)).max())]


@functools.lru_cache(maxsize=256)
def _pairs_after(k: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of stages ``s < t`` of ``k`` (as two index arrays)."""
    return np.triu_indices(k, 1)


def exposed_sends(sends: list[float], backward: list[float], links_back: list[float]) -> float:
    """How long a step's end waits on replicated stages' last gradient sends: stage
    ``s``'s leave after its last backward, which ends before stage 0's last by the
    backward passes of stages ``s - 1 .. 0`` (``backward``) and the backward links
    between them (``links_back[b]``: boundary ``b``, stage ``b + 1`` to ``b``); what
    the sends take beyond that shows. (Earlier micro-batches' sends overlap the next
    compute: the steady period holds them, ``Replica.occupied``.)"""
    worst, ahead = 0.0, 0.0
    for s, tail in enumerate(sends):
        worst = max(worst, tail - ahead)
        if s < len(links_back):
            ahead += backward[s] + links_back[s]
    return worst


def tied_sync_s(costs: DagCosts, plan: Plan, network: Network) -> float:
    """Summing the gradients of tied weights that sit in two stages, once an iteration
    after the pipeline drains: each stage's first peer sends its copy's to the other."""
    ranges = plan.ranges(costs.num_ops)

    def stage_of(op: int) -> int:
        return next(s for s, (lo, hi) in enumerate(ranges) if lo <= op < hi)

    out = 0.0
    for first, last, nbytes in costs.tied:
        a, b = stage_of(first), stage_of(last)
        if a != b:
            out = max(out, link_seconds(nbytes, network.link(plan.groups[a][0], plan.groups[b][0])))
    return out
