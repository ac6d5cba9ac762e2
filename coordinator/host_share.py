"""Peers that share a machine share its cores. Each CPU peer measures its FLOP/s when
it starts, often while the others on its machine measure theirs, and a plan made on
those readings assumes each peer has its threads to itself; on the README's demo
(4 one-thread peers on 2 cores) the estimator said 110 ms a step and the swarm took
232. So a machine's compute is divided among its CPU peers, which all work at once
in a pipeline's steady state (or as often as a first plan says they compute,
``busy_shares``): each peer's reading, times the machine's cores over the threads
all of them use, when they ask for more than it has (a peer's own reading is kept:
one throttled with ``join --throttle``, or claiming less, is slower than its
neighbours for a reason). Peers that do not say their machine (an older advert, a
GPU) keep their reading."""

from __future__ import annotations

import dataclasses
import math

from coordinator.estimator import Plan
from protocol.wire.messages import Advert


def machine_flops(adverts: list[Advert], busy: dict[str, float] | None = None) -> dict[str, float]:
    """FLOP/s of each CPU peer whose advert names its machine (``host``, ``host_cores``),
    as that machine delivers it to the peer while all of its peers work at once, or,
    with ``busy`` (peer -> the share of a step it computes, ``busy_shares``), as often
    as that says: a machine whose peers' threads, each times its share, fit its cores
    is not divided."""
    machines: dict[str, list[Advert]] = {}
    for a in adverts:
        if a.host and a.host_cores > 0 and a.device == "cpu":
            machines.setdefault(a.host, []).append(a)
    out: dict[str, float] = {}
    for peers in machines.values():
        threads = [max(a.cores, 1) for a in peers]
        cores = max(a.host_cores for a in peers)
        share = min(1.0, cores / sum(t * (busy or {}).get(a.peer_id, 1.0) for a, t in zip(peers, threads)))
        for a, t in zip(peers, threads, strict=True):
            out[a.peer_id] = a.flops * min(t, cores) / t * share
    return out


def shared(adverts: list[Advert], busy: dict[str, float] | None = None) -> list[Advert]:
    """``adverts`` with each CPU peer's FLOP/s divided as its machine is (``machine_flops``)."""
    flops = machine_flops(adverts, busy)
    return [dataclasses.replace(a, flops=flops[a.peer_id]) if a.peer_id in flops else a for a in adverts]


def busy_shares(plan: Plan, micro_batches: int) -> dict[str, float]:
    """Per peer of ``plan``: the share of a step its stage computes (its micro-batches
    times the stage's time per micro-batch, over the predicted step; at most 1). The
    demo's four one-thread peers computed about a fifth of each step on 2 cores: they
    did not all work at once, and dividing the cores among them halved them for nothing."""
    if not plan.iteration_s or not math.isfinite(plan.iteration_s):
        return {}
    out = {}
    for group, per_mb in zip(plan.groups, plan.stage_s, strict=False):
        for p in group:
            out[p] = min(1.0, per_mb * micro_batches / len(group) / plan.iteration_s)
    return out
