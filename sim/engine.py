"""A seeded discrete-event simulation of a swarm training through a plan: every
micro-batch's forward and backward on every stage, every boundary transfer on
its link (one transfer at a time per direction: contention), the replicas'
all-reduce, and churn (peers join, leave or slow down), calling the real
estimator and scheduler to re-plan. The clock is simulated; nothing sleeps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from coordinator.estimator import (
    STATE_PER_PARAM_BYTE,
    DagCosts,
    Plan,
    fixed_s,
    pipeline_s,
    predict,
)
from coordinator.netmodel import Network, PeerProfile, link_seconds
from coordinator.pipeline_latency import tied_sync_s
from coordinator.plan_eval import Options, ScheduleError
from coordinator.plan_options import POLICIES
from coordinator.replan import JOIN_REPLAN_EVERY, checkpoint_due, rebalance, recover, wants_replan
from coordinator.scheduler import plan
from sim.asking import AskReport, ask
from sim.topology import Topology


@dataclass(frozen=True)
class Churn:
    """At ``iteration``: ``leave``, ``join`` (a peer of the topology kept out so far)
    or ``slow`` (its FLOP/s times ``factor``). ``peer`` ``@K`` names the plan's
    peer number K (modulo their count, in sorted order) at that iteration."""

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
    redone: int = 0  # iterations rolled back and done again
    first_plan: Plan | None = None  # the plan it started with
    asks: list[tuple[int, AskReport]] = field(default_factory=list)  # (iteration, report) per planning that asked

    @property
    def probes_asked(self) -> int:
        """Links probed before a plan was chosen, over the run."""
        return sum(r.probed for _, r in self.asks)

    @property
    def mean_s(self) -> float:
        return sum(self.iteration_s) / len(self.iteration_s)

    @property
    def goodput(self) -> float:
        """Iterations kept per simulated second, every pause, move and redone iteration counted."""
        return len(self.iteration_s) / max(sum(self.iteration_s), 1e-12)


def iteration_seconds(
    costs: DagCosts, p: Plan, peers: dict[str, PeerProfile], network: Network, m: int, schedule: str = "1f1b"
) -> float:
    """One iteration of ``p`` on the true ``peers`` and ``network``, event by event, the
    way the live swarm runs it (``coordinator.estimator.pipeline_s``), with the
    tied weights' sync and the step's end."""
    pipeline = pipeline_s(costs, p, peers, network, m, schedule)
    return pipeline + tied_sync_s(costs, p, network) + fixed_s(costs, p, peers)


def checkpoint_seconds(costs: DagCosts, p: Plan, network: Network, home: str) -> float:
    """Saving a checkpoint, or loading one: every stage's weights and optimizer state
    between its first peer and the coordinator's machine ``home``, all stages at once."""
    return max(
        link_seconds(STATE_PER_PARAM_BYTE * costs.stage_params(lo, hi), network.link(g[0], home))
        for (lo, hi), g in zip(p.ranges(costs.num_ops), p.groups)
    )


@dataclass
class _Change:
    forced: bool = False  # a planned peer left
    left: set[str] = field(default_factory=set)
    slowed: bool = False  # a planned peer was measured slower
    joined: bool = False

    @property
    def any(self) -> bool:
        return self.forced or self.slowed or self.joined


class _Swarm:
    """One simulated run's state: the true peers, what the coordinator sees, the plan."""

    def __init__(
        self,
        costs: DagCosts,
        topology: Topology,
        scheduler: str,
        options: Options,
        held_out: set[str],
        probes_per_peer: int,
        asking: bool = True,
    ) -> None:
        self.costs, self.topology, self.scheduler, self.options = costs, topology, scheduler, options
        self.asking = asking and scheduler == "opfence"
        self.iteration = 0
        self.asks: list[tuple[int, AskReport]] = []
        self.true = {p.id: p for p in topology.peers if p.id not in held_out}
        self.reserve = {p.id: p for p in topology.peers if p.id in held_out}
        self.view = dict(self.true)
        self.network = Network.infer(list(topology.peers), topology.probes(probes_per_peer, options.seed))
        self.current = self.replan(first=True)
        self.home = _next_door(topology, self.current.groups[0][0])
        self.learned: set[str] = set()  # peers measured slower in the last iteration
        self._slowed: set[str] = set()  # peers whose speed changed since the last measure
        self._probed: Plan | None = None
        self._last: tuple[Plan, tuple[tuple[str, float], ...], float] | None = None

    def replan(self, first: bool = False) -> Plan:
        """The scheduler's plan on the view. For the ``first`` plan OP-Fence first probes
        the links that decide between its finalists (``sim.asking``), as the live
        coordinator does for its first plan (``Planner.plan_asking``); later plans, as
        the live ones, rest on what the epochs measured (``probe``). (Asking at every
        re-plan made ``rebalance.py``'s churn on 1,000 peers eight times slower, and
        was not what the live coordinator does.)"""
        peers = list(self.view.values())
        if not (self.asking and first):
            return plan(self.scheduler, self.costs, peers, self.network, self.options)
        asked, report = ask(self.costs, peers, self.network, self.topology.network, self.options)
        if report.probed:
            self.asks.append((self.iteration, report))
        return asked.plan

    def planned(self) -> set[str]:
        return {pid for g in self.current.groups for pid in g}

    def apply(self, events: list[Churn]) -> _Change:
        change = _Change(slowed=bool(self.learned & self.planned()))
        for ev in events:
            if ev.peer.startswith("@"):
                planned = sorted(self.planned() & self.true.keys())
                if not planned:
                    continue
                ev = Churn(ev.iteration, ev.kind, planned[int(ev.peer[1:]) % len(planned)], ev.factor)
            if ev.kind == "leave" and ev.peer in self.true:
                del self.true[ev.peer], self.view[ev.peer]
                change.left.add(ev.peer)
                change.forced |= ev.peer in self.planned()
            elif ev.kind == "join" and ev.peer in self.reserve:
                self.true[ev.peer] = self.view[ev.peer] = self.reserve.pop(ev.peer)
                change.joined = True
            elif ev.kind == "slow" and ev.peer in self.true:
                p = self.true[ev.peer]
                self.true[ev.peer] = replace(p, flops=p.flops * ev.factor)
                self._slowed.add(ev.peer)
        return change

    def measure(self) -> None:
        """What the stages measured: the view learns slowed-down peers after one iteration."""
        slowed, self._slowed = self._slowed, set()  # only these can differ from the view
        self.learned = {pid for pid in slowed if pid in self.true and self.view[pid].flops != self.true[pid].flops}
        self.view.update({pid: self.true[pid] for pid in self.learned})

    def probe(self, p: Plan) -> None:
        """Measure the links ``p`` sends over (its cuts and its replicas' all-reduce): the
        view learns their true bandwidth and latency, as running or probing them would."""
        if p is self._probed:
            return
        self._probed = p
        truth, pairs = self.topology.network, set()
        for a, b in zip(p.groups, p.groups[1:]):
            pairs |= {(x, y) for x in a for y in b}
        for g in p.groups:
            pairs |= {(x, y) for i, x in enumerate(g) for y in g[i + 1 :]}
        for x, y in pairs - self.network.measured:
            self.network.learn(x, y, truth.link(x, y))

    def predicted(self, p: Plan) -> float:
        """``p``'s step time on what the coordinator sees now."""
        return predict(self.costs, p.bare(), self.view, self.network, self.options.micro_batches).iteration_s

    def checkpoint_s(self, p: Plan, network: Network) -> float:
        return checkpoint_seconds(self.costs, p, network, self.home)

    def step_seconds(self) -> float:
        """One iteration on the true peers; the simulation is deterministic, so the same
        plan on the same peers takes the same time (computed once)."""
        speeds = tuple(sorted((pid, self.true[pid].flops) for pid in self.planned()))
        if self._last is None or self._last[0] is not self.current or self._last[1] != speeds:
            m = self.options.micro_batches
            self._last = (
                self.current,
                speeds,
                iteration_seconds(self.costs, self.current, self.true, self.topology.network, m),
            )
        return self._last[2]


def _next_door(topology: Topology, peer: str) -> str:
    """Where the coordinator runs: a machine in the first planned peer's cluster (another
    peer's address stands for it; the coordinator computes nothing), so checkpoints cross
    at least the cluster's own links; the peer itself in a cluster of one."""
    cluster = topology.network.cluster_of.get(peer)
    return next(
        (p.id for p in topology.peers if p.id != peer and topology.network.cluster_of.get(p.id) == cluster), peer
    )


def simulate(
    costs: DagCosts,
    topology: Topology,
    scheduler: str,
    options: Options,
    iterations: int,
    churn: list[Churn] | None = None,
    probes_per_peer: int = 3,
    held_out: set[str] | None = None,
    policy: str = "rebalance",
    progress: Callable[[int], None] | None = None,
    asking: bool = True,
) -> SimResult:
    """Plan with ``scheduler`` on what peers measure (a few probes each, the rest
    inferred), run ``iterations`` on the true topology and answer churn by ``policy``.
    Checkpoints are taken when the live coordinator would take them (``replan.checkpoint_due``),
    and their cost, moves and redone iterations are counted in the iteration times;
    ``progress`` is told each iteration done. With ``asking``, OP-Fence probes the
    links that decide between its finalists before it commits to a plan
    (``SimResult.asks``)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: choose from {', '.join(POLICIES)}")
    swarm = _Swarm(costs, topology, scheduler, options, held_out or set(), probes_per_peer, asking)
    first = swarm.current
    result = SimResult(scheduler, [], first.iteration_s, first.lower_bound_s, first_plan=first, asks=swarm.asks)
    events = sorted(churn or [], key=lambda c: c.iteration)
    since: list[float] = []  # iteration times since the last checkpoint (what a rollback redoes)
    last_optional = -JOIN_REPLAN_EVERY
    pending = _Change()  # slow-downs and joins not yet considered
    for it in range(iterations):
        swarm.iteration = it
        change = swarm.apply([e for e in events if e.iteration == it])
        pending.slowed |= change.slowed
        pending.joined |= change.joined
        penalty = 0.0
        if policy == "restart" and change.any:
            penalty = _restart(swarm, result, it, since)
        elif change.forced:
            penalty = _recover(swarm, result, it, change.left, since)
        elif policy == "rebalance" and wants_replan(pending.slowed, pending.joined, it, last_optional):
            last_optional, pending = it, _Change()
            penalty = _rebalance(swarm, result, it, iterations - it, since)
        swarm.probe(swarm.current)  # running a plan measures its links (every policy)
        t = swarm.step_seconds()
        since.append(t)
        cost = swarm.checkpoint_s(swarm.current, topology.network)
        if checkpoint_due(it + 1, it + 1 - len(since), None, sum(since), cost):
            penalty += cost
            since.clear()
        swarm.measure()
        result.iteration_s.append(t + penalty)
        if progress is not None:
            progress(it)
    return result


def _restart(swarm: _Swarm, result: SimResult, it: int, since: list[float]) -> float:
    """Back to the last checkpoint on a fresh plan: its state is loaded, the iterations since are redone."""
    try:
        swarm.current = swarm.replan()
    except ScheduleError:
        raise ScheduleError(f"iteration {it}: no plan for the peers left") from None
    result.replans.append((it, "restarted from the last checkpoint"))
    result.redone += len(since)
    # the iterations since the checkpoint are done again on the new plan, and stay after it
    since[:] = [swarm.step_seconds()] * len(since)
    return sum(since) + swarm.checkpoint_s(swarm.current, swarm.topology.network)


def _recover(swarm: _Swarm, result: SimResult, it: int, left: set[str], since: list[float]) -> float:
    """A planned peer left: the live recovery (``replan.recover``), no standby peers kept."""
    rec = recover(swarm.current.groups, left, [])
    if rec.kind == "replicas":
        assert rec.stages is not None
        swarm.current = Plan(swarm.current.cut, rec.stages, swarm.current.codecs)
        result.replans.append((it, "a planned peer left: its replicas go on"))
        return 0.0
    return _restart(swarm, result, it, since)


def _rebalance(swarm: _Swarm, result: SimResult, it: int, remaining: int, since: list[float]) -> float:
    """The live rebalancing rule: move when the gain over the remaining iterations pays
    for checkpointing the current plan's state and restoring it onto the new plan."""
    try:
        candidate = swarm.replan()
    except ScheduleError:
        return 0.0
    swarm.probe(candidate)  # links nobody measured yet are probed before a move is decided

    def move(network: Network) -> float:  # as live: the current step is checkpointed, the new plan restores it
        return swarm.checkpoint_s(swarm.current, network) + swarm.checkpoint_s(candidate, network)

    current_s, candidate_s = swarm.predicted(swarm.current), swarm.predicted(candidate)
    decision = rebalance(current_s, candidate_s, remaining, move(swarm.network))
    if not decision.go:
        return 0.0
    result.replans.append((it, decision.why))
    penalty = move(swarm.topology.network)
    swarm.current = candidate
    since.clear()  # the move checkpointed the current iteration
    return penalty
