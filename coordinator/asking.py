"""Planning that asks before it guesses: when OP-Fence's finalists differ by less
than what the links the planner only inferred could be wrong by, name the links
that would decide between them (``deciding_links``, pure), have them probed, and
plan again on what the probes measured (``plan_asking``). The live coordinator
and ``sim/`` pass their own probe: the simulator's reads the true topology."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.estimator import DagCosts, PeerTable, Plan, predict
from coordinator.netmodel import LinkInfo, Network, PeerProfile
from coordinator.opfence import RACE_MARGIN, finalists
from coordinator.plan_eval import Options, rank

logger = logging.getLogger(__name__)

#: how far a link the planner only inferred (a cluster's median, a guess from
#: adverts) may be from what a probe would measure, as a factor either way:
#: ``Network.infer`` calls a link 4x the median probe a cluster's own
VIEW_ERROR = 4.0
#: the most links one planning asks for, per round
ASK_MOST = 16
#: rounds of asking and planning again
ASK_ROUNDS = 3

Pair = tuple[str, str]
Probe = Callable[[str, str], LinkInfo]


def plan_pairs(groups: list[list[str]]) -> set[Pair]:
    """The pairs of peers a plan sends over: neighbouring stages, replicas of one stage
    (each pair once, its ends in sorted order)."""
    pairs = {(a, b) for g, h in zip(groups, groups[1:]) for a in g for b in h}
    pairs |= {(a, b) for g in groups for i, a in enumerate(g) for b in g[i + 1 :]}
    return {(min(a, b), max(a, b)) for a, b in pairs if a != b}


def _guessed(network: Network, groups: list[list[str]]) -> set[Pair]:
    """The plan's pairs nobody measured."""
    return {(a, b) for a, b in plan_pairs(groups) if not network.link(a, b).measured}


def _scaled(network: Network, pairs: set[Pair], factor: float) -> Network:
    """``network`` with the bandwidth of ``pairs`` times ``factor`` (a what-if copy)."""
    overrides = dict(network.overrides)
    for a, b in pairs:
        link = network.link(a, b)
        overrides.pop((b, a), None)
        overrides[(a, b)] = (link.mbps * factor, link.latency_s)
    return Network(network.cluster_of, network.clusters, overrides, set(network.measured), network.default)


def _time(costs: DagCosts, p: Plan, by_id: PeerTable, network: Network, options: Options) -> float:
    return predict(costs, p.bare(), by_id, network, options.micro_batches).to_loss_s


def deciding_links(
    costs: DagCosts,
    plans: list[Plan],
    peers: list[PeerProfile],
    network: Network,
    options: Options,
    error: float = VIEW_ERROR,
    most: int = ASK_MOST,
) -> list[Pair]:
    """The links whose probes would decide between the leader (``plans[0]``) and the
    plans that could beat it. A finalist could when, its inferred links ``error``
    times faster, it beats the leader with the leader's inferred links ``error`` times
    slower; and any plan could when the leader, its inferred links ``error`` times
    slower, falls out of the finalists' race (``RACE_MARGIN``): then its own inferred
    links are asked first. Then the inferred links that only one of the leader and
    a contender uses (they set the two apart), then the rest, at most ``most``.
    Empty when the leader wins however wrong the view is."""
    if not plans or not plans[0].valid:
        return []
    by_id = PeerTable(peers)
    leader = plans[0]
    mine = _guessed(network, leader.groups)
    worst = _time(costs, leader, by_id, _scaled(network, mine, 1 / error), options) if mine else leader.to_loss_s
    deciding: list[Pair] = sorted(mine) if worst > leader.to_loss_s * RACE_MARGIN else []
    shared: list[Pair] = []
    for p in plans[1:]:
        theirs = _guessed(network, p.groups)
        if not p.valid or not (mine | theirs):
            continue
        best = _time(costs, p, by_id, _scaled(network, theirs, error), options) if theirs else p.to_loss_s
        if best < worst:
            deciding += sorted(mine ^ theirs)
            shared += sorted(mine & theirs)
    return list(dict.fromkeys(deciding + shared))[:most]


@dataclass(frozen=True)
class Asked:
    """A plan chosen after asking: the plan, the links probed for it (in order), the
    plan it would have been without asking (``unasked``: the first planning's best)
    and every round's finalists (``seen``, the first round's first)."""

    plan: Plan
    probed: list[Pair]
    unasked: Plan
    seen: list[Plan]

    @property
    def changed(self) -> bool:
        """Whether asking chose other stage groups than the first planning."""
        return self.plan.groups != self.unasked.groups


def plan_asking(
    costs: DagCosts,
    peers: list[PeerProfile],
    network: Network,
    options: Options,
    probe: Probe,
    rounds: int = ASK_ROUNDS,
) -> Asked:
    """OP-Fence's finalists; while ``deciding_links`` names links (``rounds`` at most),
    probe them (``network`` learns what ``probe`` measures) and plan again on what was
    learnt. The best of every round's finalists, each predicted again on every link
    learnt (a finalist of an earlier round may win once its links are known)."""
    probed: list[Pair] = []
    plans = finalists(costs, peers, network, options)
    seen = list(plans)
    for _ in range(rounds):
        ask = [pair for pair in deciding_links(costs, plans, peers, network, options) if pair not in probed]
        if not ask:
            break
        for a, b in ask:
            network.learn(a, b, probe(a, b))
        probed += ask
        logger.info("probed %d links that decide between the finalists", len(ask))
        plans = finalists(costs, peers, network, options)
        seen += plans
    if not probed:
        return Asked(plans[0], [], plans[0], seen)
    by_id = PeerTable(peers)
    again = [predict(costs, p.bare(), by_id, network, options.micro_batches) for p in seen]
    return Asked(min(again, key=rank), probed, seen[0], seen)
