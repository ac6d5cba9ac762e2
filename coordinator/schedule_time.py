"""A plan's pipeline, micro-batch by micro-batch: every forward and backward on every
replica in the order its schedule runs them, every boundary transfer on its link
(one transfer at a time per direction and pair of peers), and each replica's
gradient sends to the other replicas after each backward. Its replicas' times come
from the estimator (``estimator.pipeline_s``, which remembers the answer per plan).

GPipe (every forward, then every backward, each in micro-batch order) is timed in two
sweeps, forwards from the first stage, backwards from the last, the same answer as
stepping events (a test compares them) in a fraction of the time: the planner asks
for it thousands of times. Other schedules (1F1B) step event by event."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.netmodel import transfer_s
from coordinator.overheads import message_s
from protocol.model import schedule as schedules

if TYPE_CHECKING:
    from coordinator.netmodel import Network, PeerProfile
    from coordinator.plan import Plan


@dataclass(frozen=True)
class Timing:
    """One replica's seconds: a forward, a backward, its gradient sends' time on the
    link after each backward, and their latency."""

    f: float
    b: float
    send_busy: float
    send_latency: float


@dataclass
class Lane:
    """One replica of one stage: its actions and its clock."""

    stage: int
    acts: list[tuple[str, int]]  # (F or B, global micro-batch)
    t: Timing
    idx: int = 0
    free: float = 0.0
    sending: float = 0.0  # when its link is free of the sends queued so far
    landed: float = 0.0  # when its last sends arrived

    def run(self, kind: str, ready: float) -> float:
        """Its next action, once its input is ``ready``: when it ends."""
        self.free = max(self.free, ready) + (self.t.f if kind == "F" else self.t.b)
        if kind == "B" and (self.t.send_busy or self.t.send_latency):  # its gradient sends leave in turn
            self.sending = max(self.sending, self.free) + self.t.send_busy
            self.landed = self.sending + self.t.send_latency
        return self.free


class _Links:
    """The boundaries' transfers: one at a time per direction and pair of peers."""

    def __init__(
        self, p: Plan, wires: list[tuple[float, float]], peers: Mapping[str, PeerProfile], network: Network
    ) -> None:
        self.p, self.wires, self.peers, self.network = p, wires, peers, network
        self.channel: dict[tuple[str, int, str, str], float] = {}
        self.priced: dict[tuple[str, int, str, str], tuple[float, float]] = {}  # a pair's transfer and tail, once

    def send(self, direction: str, s: int, t: int, mb: int, end: float) -> float:
        """Stage ``s`` sends micro-batch ``mb`` to stage ``t`` once done at ``end``: when it arrives."""
        groups = self.p.groups
        x, y = groups[s][mb % len(groups[s])], groups[t][mb % len(groups[t])]
        key = (direction, s, x, y)
        if key not in self.priced:
            link, nbytes = self.network.link(x, y), self.wires[min(s, t)][direction == "B"]
            tail = link.latency_s + message_s(self.peers[x].overheads, self.peers[y].overheads, nbytes)
            self.priced[key] = transfer_s(nbytes, link.mbps), tail
        busy, tail = self.priced[key]
        done = max(end, self.channel.get(key, 0.0)) + busy  # a pair is of one boundary: its key names its channel
        self.channel[key] = done
        return done + tail


def run(
    p: Plan,
    timing: list[list[Timing]],
    wires: list[tuple[float, float]],
    peers: Mapping[str, PeerProfile],
    network: Network,
    m: int,
    schedule: str,
) -> float:
    """When ``p``'s last micro-batch is done and its last gradient send has landed
    (``estimator.pipeline_s``), its replicas timed as ``timing`` says, each boundary's
    wire bytes (forward, backward) as ``wires``; ``schedule`` is the one the plan runs."""
    links = _Links(p, wires, peers, network)
    return _sweeps(p, timing, links, m) if schedule == "gpipe" else _events(p, timing, links, m, schedule)


def _sweeps(p: Plan, timing: list[list[Timing]], links: _Links, m: int) -> float:
    """GPipe: each stage's forwards in micro-batch order (the first stage's inputs
    ready at 0), then from the last stage back, each replica's backwards in
    micro-batch order once all its forwards are done."""
    k = len(p.groups)
    lanes = [[Lane(s, [], t) for t in stage] for s, stage in enumerate(timing)]
    ready = [0.0] * m
    for s in range(k):
        ends = [lanes[s][mb % len(lanes[s])].run("F", ready[mb]) for mb in range(m)]
        ready = [links.send("F", s, s + 1, mb, end) for mb, end in enumerate(ends)] if s < k - 1 else ends
    for s in reversed(range(k)):
        ends = [lanes[s][mb % len(lanes[s])].run("B", ready[mb]) for mb in range(m)]
        ready = [links.send("B", s, s - 1, mb, end) for mb, end in enumerate(ends)] if s > 0 else ends
    return max(max(lane.free, lane.landed) for stage in lanes for lane in stage)


def _events(p: Plan, timing: list[list[Timing]], links: _Links, m: int, name: str) -> float:
    """Any schedule, event by event: each replica's next action once its input is there."""
    k = len(p.groups)
    lanes = []
    for s, stage in enumerate(timing):
        for i, t in enumerate(stage):
            mine = range(i, m, len(stage))
            acts = [(kind, mine[j]) for kind, j in _order(name, k, len(mine))[s]] if mine else []
            lanes.append(Lane(s, acts, t))
    ready_f: list[dict[int, float]] = [dict.fromkeys(range(m), 0.0)] + [{} for _ in range(k - 1)]
    ready_b: list[dict[int, float]] = [{} for _ in range(k)]
    pending = [lane for lane in lanes if lane.acts]
    while pending:
        progressed = False
        for lane in pending:
            s = lane.stage
            while lane.idx < len(lane.acts):
                kind, mb = lane.acts[lane.idx]
                dep = (ready_f if kind == "F" else ready_b)[s].get(mb)
                if dep is None:
                    break
                end = lane.run(kind, dep)
                lane.idx += 1
                progressed = True
                if kind == "F" and s < k - 1:
                    ready_f[s + 1][mb] = links.send("F", s, s + 1, mb, end)
                elif kind == "F":
                    ready_b[s][mb] = end
                if kind == "B" and s > 0:
                    ready_b[s - 1][mb] = links.send("B", s, s - 1, mb, end)
        if not progressed:
            raise RuntimeError("the schedule deadlocked in simulation")
        pending = [lane for lane in pending if lane.idx < len(lane.acts)]
    return max(max(lane.free, lane.landed) for lane in lanes)


@functools.lru_cache(maxsize=256)
def _order(schedule: str, k: int, n: int) -> schedules.Schedule:
    """``schedule``'s order of forwards and backwards for ``k`` stages of ``n`` micro-batches
    (made and checked once: a plan of a thousand peers asks for it per peer)."""
    return schedules.make(schedule, k, n)
