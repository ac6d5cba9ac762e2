"""A seeded discrete-event simulation of a swarm training through a plan: every
micro-batch's forward and backward on every stage, every boundary transfer on
its link (one transfer at a time per direction: contention), the replicas'
all-reduce, and churn (peers join, leave or slow down), calling the real
estimator and scheduler to re-plan. The clock is simulated; nothing sleeps."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.estimator import STATE_PER_PARAM_BYTE, DagCosts, Network, PeerProfile, Plan, link_seconds, wire_bytes
from coordinator.replan import REPLAN_GAIN, accept_plan, wants_replan
from coordinator.scheduler import Options, ScheduleError, plan
from protocol import schedule as schedules
from sim.topology import Topology


@dataclass(frozen=True)
class Churn:
    """At ``iteration``: ``leave``, ``join`` (a peer of the topology kept out so far)
    or ``slow`` (its FLOP/s times ``factor``)."""

    iteration: int
    kind: str
    peer: str
    factor: float = 1.0


@dataclass
class SimResult:
    scheduler: str
    iteration_s: list[float]
    predicted_s: float
    lower_bound_s: float
    replans: list[tuple[int, str]] = field(default_factory=list)

    @property
    def mean_s(self) -> float:
        return sum(self.iteration_s) / len(self.iteration_s)


def iteration_seconds(costs: DagCosts, p: Plan, peers: dict[str, PeerProfile], network: Network, m: int,
                      schedule: str = "1f1b") -> float:  # fmt: skip
    """One iteration of ``p`` on the true ``peers`` and ``network``, event by event."""
    k = len(p.groups)
    ranges = p.ranges(costs.num_ops)
    per_mb = [
        3 * costs.stage_flops(lo, hi) / max(sum(peers[x].flops for x in g), 1.0)
        for (lo, hi), g in zip(ranges, p.groups)
    ]
    links = [network.group_link(p.groups[b], p.groups[b + 1]) for b in range(k - 1)]
    busy = [
        wire_bytes(costs, pos, c) * 8 / max(links[b].mbps * 1e6, 1.0) for b, (pos, c) in enumerate(zip(p.cut, p.codecs))
    ]
    lat = [link.latency_s for link in links]
    acts = schedules.make(schedule, k, m)
    ready_f = [[0.0] * m] + [[None] * m for _ in range(k - 1)]
    ready_b: list[list[float | None]] = [[None] * m for _ in range(k)]
    free = [0.0] * k
    fwd_free, bwd_free = [0.0] * max(k - 1, 0), [0.0] * max(k - 1, 0)
    idx = [0] * k
    done = 0
    total = sum(len(a) for a in acts)
    while done < total:
        progressed = False
        for s in range(k):
            while idx[s] < len(acts[s]):
                kind, mb = acts[s][idx[s]]
                dep = ready_f[s][mb] if kind == "F" else ready_b[s][mb]
                if dep is None:
                    break
                start = max(free[s], dep)
                end = start + per_mb[s] * (1 / 3 if kind == "F" else 2 / 3)
                free[s] = end
                idx[s] += 1
                done += 1
                progressed = True
                if kind == "F" and s < k - 1:
                    t0 = max(end, fwd_free[s])
                    fwd_free[s] = t0 + busy[s]
                    ready_f[s + 1][mb] = t0 + busy[s] + lat[s]
                elif kind == "F":
                    ready_b[s][mb] = end
                elif s > 0:
                    t0 = max(end, bwd_free[s - 1])
                    bwd_free[s - 1] = t0 + busy[s - 1]
                    ready_b[s - 1][mb] = t0 + busy[s - 1] + lat[s - 1]
        if not progressed:
            raise RuntimeError("the schedule deadlocked in simulation")
    allreduce = []
    for (lo, hi), g in zip(ranges, p.groups):
        inner = network.slowest_within(g)
        r = len(g)
        allreduce.append(0.0 if inner is None else link_seconds(2 * costs.stage_params(lo, hi) * (r - 1) / r, inner))
    return max(f + a for f, a in zip(free, allreduce))


def _move_seconds(costs: DagCosts, old: Plan | None, new: Plan, network: Network) -> float:
    """Re-planning moves each changed stage's weights and optimizer state to its new peers."""
    if old is None:
        return 0.0
    worst = 0.0
    for s, ((lo, hi), g) in enumerate(zip(new.ranges(costs.num_ops), new.groups)):
        if s < len(old.groups) and old.groups[s] == g and old.ranges(costs.num_ops)[s] == (lo, hi):
            continue
        src = old.groups[min(s, len(old.groups) - 1)]
        link = network.group_link(src, g)
        worst = max(worst, link_seconds(STATE_PER_PARAM_BYTE * costs.stage_params(lo, hi), link))
    return worst


def simulate(
    costs: DagCosts,
    topology: Topology,
    scheduler: str,
    options: Options,
    iterations: int,
    churn: list[Churn] | None = None,
    probes_per_peer: int = 3,
    replan_gain: float = REPLAN_GAIN,
    held_out: set[str] | None = None,
) -> SimResult:
    """Plan with ``scheduler`` on what peers measure (a few probes each, the rest
    inferred), run ``iterations`` on the true topology, re-plan on churn."""
    true_peers = {p.id: p for p in topology.peers if p.id not in (held_out or set())}
    reserve = {p.id: p for p in topology.peers if p.id in (held_out or set())}
    view_peers = dict(true_peers)
    probes = topology.probes(probes_per_peer, options.seed)
    view = Network.infer(list(topology.peers), probes)

    def replan() -> Plan:
        return plan(scheduler, costs, list(view_peers.values()), view, options)

    current = replan()
    result = SimResult(scheduler, [], current.iteration_s, current.lower_bound_s)
    events = sorted(churn or [], key=lambda c: c.iteration)
    last_optional = -10
    for it in range(iterations):
        forced = False
        for ev in [e for e in events if e.iteration == it]:
            if ev.kind == "leave" and ev.peer in true_peers:
                del true_peers[ev.peer], view_peers[ev.peer]
                forced |= any(ev.peer in g for g in current.groups)
            elif ev.kind == "join" and ev.peer in reserve:
                true_peers[ev.peer] = view_peers[ev.peer] = reserve.pop(ev.peer)
            elif ev.kind == "slow" and ev.peer in true_peers:
                p = true_peers[ev.peer]
                true_peers[ev.peer] = PeerProfile(p.id, p.flops * ev.factor, p.memory_bytes, p.cluster)
        penalty = 0.0
        slowed = any(
            e.iteration == it and e.kind == "slow" and any(e.peer in g for g in current.groups) for e in events
        )
        joined = any(e.iteration == it and e.kind == "join" for e in events)
        # the live coordinator's rule (coordinator.replan)
        if wants_replan(forced, slowed, joined, it, last_optional):
            last_optional = it if not forced else last_optional
            try:
                candidate = replan()
            except ScheduleError:
                candidate = current
            if accept_plan(candidate.iteration_s, current.iteration_s, forced, replan_gain):
                penalty = _move_seconds(costs, current, candidate, topology.network)
                result.replans.append((it, "a planned peer left" if forced else "a faster plan"))
                current = candidate
        t = iteration_seconds(costs, current, true_peers, topology.network, options.micro_batches)
        # what the stages measured: the view learns slowed-down peers after one iteration
        for pid, p in true_peers.items():
            if view_peers[pid].flops != p.flops:
                view_peers[pid] = p
        result.iteration_s.append(t + penalty)
    return result
