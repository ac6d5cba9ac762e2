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
import statistics
from collections.abc import Collection, Mapping

from coordinator.estimator import Plan, dealt
from protocol.wire.messages import Advert


def machine_flops(
    adverts: list[Advert], busy: dict[str, float] | None = None, together: Mapping[str, Collection[str]] | None = None
) -> dict[str, float]:
    """FLOP/s of each CPU peer whose advert names its machine (``host``, ``host_cores``),
    as that machine delivers it to the peer while all of its peers work at once, or,
    with ``busy`` (peer -> the share of a step it computes, ``busy_shares``; a peer
    missing from it computes nothing: standby, or left out), as ``_asked`` counts the
    threads asked for while it computes; a machine whose threads so asked for fit its
    cores is not divided."""
    machines: dict[str, list[Advert]] = {}
    for a in adverts:
        if a.host and a.host_cores > 0 and a.device == "cpu":
            machines.setdefault(a.host, []).append(a)
    out: dict[str, float] = {}
    for peers in machines.values():
        threads = {a.peer_id: max(a.cores, 1) for a in peers}
        cores = max(a.host_cores for a in peers)
        for a in peers:
            asked = sum(threads.values()) if busy is None else _asked(a.peer_id, threads, busy, together or {})
            t = threads[a.peer_id]
            out[a.peer_id] = a.flops * min(t, cores) / t * (min(1.0, cores / asked) if asked > 0 else 1.0)
    return out


def _asked(pid: str, threads: dict[str, int], busy: dict[str, float], together: Mapping[str, Collection[str]]) -> float:
    """The threads of ``pid``'s machine asked for while ``pid`` computes (``machine_flops``):
    a stage's replicas all of theirs (they compute at the same instants), every other
    peer its own as often as it computes (a pipeline's stages take turns: on the demo's
    four one-thread stages the average fit the cores, and the prediction for the compute
    they delivered was within 8% of the step measured)."""
    with_it = together.get(pid, ())
    if not with_it:
        return sum(t * busy.get(p, 0.0) for p, t in threads.items())
    return sum(t if p == pid or p in with_it else t * busy.get(p, 0.0) for p, t in threads.items())


def shared(
    adverts: list[Advert], busy: dict[str, float] | None = None, together: Mapping[str, Collection[str]] | None = None
) -> list[Advert]:
    """``adverts`` with each CPU peer's FLOP/s divided as its machine is (``machine_flops``)."""
    flops = machine_flops(adverts, busy, together)
    return [dataclasses.replace(a, flops=flops[a.peer_id]) if a.peer_id in flops else a for a in adverts]


def lockstep(plan: Plan) -> dict[str, list[str]]:
    """Per peer of ``plan``: its stage's other replicas. They are dealt the step's
    micro-batches in turn and start each at the same instants, so on one machine they
    ask for its cores at once: on the demo, two stages of two replicas each (every peer
    busy a fifth of the step on average) computed each micro-batch at half the speed
    the same peers delivered as a pipeline."""
    return {p: [q for q in g if q != p] for g in plan.groups for p in g}


def busy_shares(plan: Plan, micro_batches: int) -> dict[str, float]:
    """Per peer of ``plan``: the share of a step it computes (the micro-batches dealt to
    it times its time per micro-batch, over the predicted step; at most 1). ``stage_s``
    is a stage's time per micro-batch of the step, its replicas sharing them: its
    busiest replica's time over all the step's micro-batches. The demo's four
    one-thread peers computed about a fifth of each step on 2 cores: they did not all
    work at once, and dividing the cores among them halved them for nothing."""
    if not plan.iteration_s or not math.isfinite(plan.iteration_s):
        return {}
    out = {}
    for group, per_mb in zip(plan.groups, plan.stage_s, strict=False):
        runs = dealt(micro_batches, len(group))
        for p, n in zip(group, runs, strict=True):  # its time per micro-batch: per_mb * micro_batches / max(runs)
            out[p] = min(1.0, n * per_mb * micro_batches / max(runs) / plan.iteration_s)
    return out


def undivided(adverts: list[Advert], busy: dict[str, float], together: Mapping[str, Collection[str]]) -> list[Advert]:
    """The inverse of ``shared`` for a plan that kept its peers as busy as ``busy`` says
    (peers missing from it computed nothing): each of its CPU peers' FLOP/s, read as what its
    machine delivered to it then (the rebalancer's measured speeds), turned back into
    its own reading, which ``shared`` divides again for the plan to be priced. On the
    demo the pipeline's four peers kept 1.3 of the 2 cores busy and delivered their
    full speed; priced undivided, two replicas of two stages (all four computing at
    once) were predicted 1.24x faster, and measured 0.82x."""
    flops = machine_flops(adverts, busy, together)
    out = []
    for a in adverts:
        f = flops.get(a.peer_id, a.flops)
        out.append(dataclasses.replace(a, flops=a.flops * a.flops / f) if a.peer_id in busy and 0 < f < a.flops else a)
    return out


def like_measured(readings: list[Advert], own: list[Advert], measured: Collection[str]) -> list[Advert]:
    """``own`` (the adverts, the ``measured`` peers' FLOP/s their own speed as the swarm
    measured it) with each unmeasured CPU peer's reading scaled as its machine's measured
    peers' readings were: times the median of their own speed over their reading
    (``readings``: the adverts as sent). A reading is one thread's speed with a core to
    itself (``peer.bench``); beside the swarm's other processes the demo's peers
    delivered about two thirds of it, and a standby peer priced on its reading beside
    measured ones would look that much faster. Peers whose machine has no measured peer
    keep their reading."""
    read = {a.peer_id: a.flops for a in readings}
    ratios: dict[str, list[float]] = {}
    for a in own:
        if a.peer_id in measured and a.host and a.device == "cpu" and read.get(a.peer_id, 0.0) > 0:
            ratios.setdefault(a.host, []).append(a.flops / read[a.peer_id])
    return [
        dataclasses.replace(a, flops=a.flops * statistics.median(ratios[a.host]))
        if a.peer_id not in measured and a.device == "cpu" and a.host in ratios
        else a
        for a in own
    ]
