"""Stage assignment for a live swarm from its peers' adverts: OP-Fence on what the
peers measured (FLOP/s and memory; bandwidth to the coordinator stands in for the
links between peers until they measure those). A pure function of a snapshot."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from coordinator.asking import Pair, deciding_links
from coordinator.codec_choice import AUTO_MODES
from coordinator.estimator import DagCosts, Plan, predict
from coordinator.host_share import busy_shares, lockstep, shared
from coordinator.netmodel import Network, PeerProfile
from coordinator.opdag import OpDag
from coordinator.opfence import finalists
from coordinator.overheads import LIVE, NONE, Overheads
from coordinator.plan_eval import Options, ScheduleError, rank
from protocol.model.graph import Cut
from protocol.wire.messages import Advert

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    cut: Cut
    stages: list[list[str]]  # peer ids per stage, in replica order
    plan: Plan | None = field(default=None, compare=False)  # the estimator's prediction
    #: guessed links whose probes would decide between OP-Fence's finalists (``coordinator.asking``)
    deciding: list[Pair] = field(default_factory=list, compare=False)

    def stage_of(self, peer_id: str) -> tuple[int, int]:
        for s, peers in enumerate(self.stages):
            if peer_id in peers:
                return s, peers.index(peer_id)
        raise KeyError(peer_id)


#: a forwarded link (two peers behind NATs, through the coordinator): its frames cross
#: two links one after the other (``protocol.net.forward`` stores and forwards each), so
#: it is planned at this fraction of the slower of the two, and twice the latency
FORWARDED_SHARE = 0.5


def network_from_adverts(
    adverts: list[Advert], measured: dict[tuple[str, str], float] | None = None, nat: Collection[str] = ()
) -> Network:
    """Pairwise bandwidth guessed from each peer's measured up/down to the coordinator,
    except for the pairs in ``measured`` (Mbit/s from one peer to the other, probed when
    a plan epoch set its stages up). Two peers of ``nat`` (behind NATs) reach each other
    through the coordinator: that path's guess is priced as forwarded, and kept."""
    ids = [a.peer_id for a in adverts]
    overrides = {}
    forwarded = set()
    for a in adverts:
        for b in adverts:
            if a.peer_id == b.peer_id:
                continue
            path = max(min(a.up_mbps, b.down_mbps), 1e-3)
            if a.peer_id in nat and b.peer_id in nat:
                forwarded.add((a.peer_id, b.peer_id))
                overrides[(a.peer_id, b.peer_id)] = (path * FORWARDED_SHARE, 0.002)
            else:
                overrides[(a.peer_id, b.peer_id)] = (path, 0.001)
    probed = {pair: mbps for pair, mbps in (measured or {}).items() if pair in overrides and pair not in forwarded}
    for (a, b), mbps in probed.items():  # a probe of one direction stands for both, unless both were probed
        overrides[(a, b)] = (mbps, 0.001)
        if (b, a) not in probed:
            overrides[(b, a)] = (mbps, 0.001)
    typical = statistics.median(v[0] for v in overrides.values()) if overrides else 1000.0
    return Network({i: "swarm" for i in ids}, {("swarm", "swarm"): (typical, 0.001)}, overrides, set(probed))


def assign(
    dag: OpDag,
    adverts: list[Advert],
    num_stages: int | None = None,
    micro_batches: int = 4,
    standby: bool = False,
    measured: dict[tuple[str, str], float] | None = None,
    nat: Collection[str] = (),
    compression: str = "none",
    rank: int | None = None,
) -> Assignment:
    """Every advertised peer gets a stage (``num_stages`` defaults to one per peer), or,
    with ``standby``, OP-Fence may leave peers out and choose the stage count itself
    when ``num_stages`` is None. ``measured``: links probed so far; ``nat``: peers behind
    NATs (``network_from_adverts``); ``compression``: the run's mode; under ``auto`` or
    ``auto-lowrank`` the plan carries the codecs the planner priced (``rank`` pins
    ``auto-lowrank``'s low rank), and they are the ones that run
    (``coordinator.links.live_codecs``)."""
    if not adverts:
        raise ValueError("no peers to assign")
    k = num_stages or (None if standby else len(adverts))
    if k is not None and k > len(adverts):
        raise ValueError(f"{k} stages need at least {k} peers, {len(adverts)} joined")
    costs = DagCosts.from_opdag(dag)
    peers = [live_profile(a) for a in shared(adverts)]  # peers on one machine share its cores
    auto = compression in AUTO_MODES
    lowrank = compression == "auto-lowrank"
    options = Options(micro_batches, stages=k, standby=standby, compression=auto, lowrank=lowrank, rank=rank)
    network = network_from_adverts(adverts, measured, nat)
    try:
        plans = finalists(costs, peers, network, options)
        busy, together = busy_shares(plans[0], micro_batches), lockstep(plans[0])
        shares = [live_profile(a) for a in shared(adverts, busy, together)]
        if shares != peers:  # peers on one machine: planned again as that plan shares it, and alone
            plans += finalists(costs, shares, network, options)
            plans += finalists(costs, [live_profile(a) for a in adverts], network, options)
            ranked = sorted((on_own_share(costs, p, adverts, network, micro_batches) for p in plans), key=_rank)
            plans, peers = [p for p, _ in ranked], ranked[0][1]
    except ScheduleError as exc:
        raise ValueError(str(exc)) from None
    plan, deciding = plans[0], _deciding(costs, plans, peers, network, options)
    if nat:
        plan = _swapped(plan, costs, {p.id: p for p in peers}, network, micro_batches, set(nat))
    if not plan.fits_memory:
        logger.warning("the best plan may not fit the peers' free memory")
    return Assignment(cut=Cut(tuple(plan.cut)), stages=plan.groups, plan=plan, deciding=deciding)


def on_own_share(
    costs: DagCosts,
    plan: Plan,
    adverts: list[Advert],
    network: Network,
    micro_batches: int,
    overheads: Overheads = LIVE,
) -> tuple[Plan, list[PeerProfile]]:
    """``plan`` predicted with each machine's cores shared as the plan keeps them busy
    (``host_share``): its peers first all computing at once, then each as often as that
    predicts it computes, a stage's replicas at the same instants; with the peers so
    priced. A plan's price depends on the share it leaves each peer, so finalists
    planned on one plan's shares are compared each on its own."""

    def profiles(divided: list[Advert]) -> list[PeerProfile]:
        return [live_profile(a, overheads) for a in divided]

    def priced(peers: list[PeerProfile]) -> Plan:
        return predict(costs, replace(plan), {p.id: p for p in peers}, network, micro_batches)

    first = priced(profiles(shared(adverts)))
    peers = profiles(shared(adverts, busy_shares(first, micro_batches), lockstep(first)))
    return priced(peers), peers


def _rank(priced: tuple[Plan, list[PeerProfile]]) -> tuple[bool, float]:
    return rank(priced[0])


def _deciding(
    costs: DagCosts, plans: list[Plan], peers: list[PeerProfile], network: Network, options: Options
) -> list[Pair]:
    """``asking.deciding_links`` on what links change: the finalists priced without the
    swarm's fixed costs, which every plan pays alike (with them, a 4x error on a small
    model's guessed links moved its step by 4%, under ``RACE_MARGIN``, where it moved
    the pipeline by 18%)."""
    bare = [replace(p, overheads=NONE) for p in peers]
    by_id = {p.id: p for p in bare}
    again = [predict(costs, p.bare(), by_id, network, options.micro_batches) for p in plans]
    return deciding_links(costs, again, bare, network, options)


def live_profile(advert: Advert, overheads: Overheads = LIVE) -> PeerProfile:
    """A live peer as the planner sees it. Its FLOP/s are measured (a benchmark, then
    its stage's steps), and a step's time already holds each kernel's fixed cost:
    none is added (``PeerProfile.op_overhead_s`` is for topology files and presets).
    The swarm's own fixed costs (handing work to the compute thread, encoding, the
    optimizer, the commit) are ``overheads`` (``coordinator.overheads``)."""
    return PeerProfile(
        advert.peer_id, advert.flops, advert.memory_bytes, "swarm", op_overhead_s=0.0, overheads=overheads
    )


def _swapped(
    plan: Plan, costs: DagCosts, peers: dict[str, PeerProfile], network: Network, mb: int, nat: set[str]
) -> Plan:
    """``plan`` with stage groups swapped (cuts kept) while a swap is predicted faster,
    or as fast with fewer forwarded links: OP-Fence orders peers of one cluster as it
    finds them, and with peers behind NATs the order decides which links are forwarded.
    At most k^2 swaps are tried a round."""
    best = predict(costs, plan, peers, network, mb)
    better = True
    while better:
        better = False
        for i in range(len(best.groups)):
            for j in range(i + 1, len(best.groups)):
                groups = list(best.groups)
                groups[i], groups[j] = groups[j], groups[i]
                trial = predict(costs, Plan(best.cut, groups, best.codecs, best.scheduler), peers, network, mb)
                if _preferred(trial, best, nat):
                    best, better = trial, True
    return best


def _preferred(trial: Plan, best: Plan, nat: set[str]) -> bool:
    """Whether ``trial`` beats ``best``: fits no worse, and is faster, or as fast
    (within a relative 1e-9) with fewer forwarded links."""
    if trial.fits_memory < best.fits_memory or trial.iteration_s > best.iteration_s * (1 + 1e-9):
        return False
    faster = trial.iteration_s < best.iteration_s * (1 - 1e-9)
    return faster or forwarded_links(trial.groups, nat) < forwarded_links(best.groups, nat)


def forwarded_links(groups: list[list[str]], nat: Collection[str]) -> int:
    """How many pairs of peers that exchange frames (neighbouring stages, replicas of
    one) are both behind NATs, so that the coordinator forwards their frames."""
    pairs = [(a, b) for g in groups for i, a in enumerate(g) for b in g[i + 1 :]]
    pairs += [(a, b) for g, h in zip(groups, groups[1:]) for a in g for b in h]
    return sum(a in nat and b in nat for a, b in pairs)


def signature(plan: Assignment) -> str:
    """A plan as a rebalance judges it: the cut and the set of peers of each stage (the
    same replicas in another order once slipped past ``reverted``: CI saw a one-stage
    plan of three replicas undone, then proposed again with its replicas reordered)."""
    return f"{plan.cut.to_list()} {[sorted(group) for group in plan.stages]}"


def moves_text(old: Assignment, new: Assignment) -> str:
    """What a new plan changes, in words: the cut and the peers of each stage."""
    parts = []
    if old.cut != new.cut:
        parts.append(f"cut {old.cut.to_list()} -> {new.cut.to_list()}")
    old_peers = {p for g in old.stages for p in g}
    new_peers = {p for g in new.stages for p in g}
    if old_peers - new_peers:
        parts.append("to standby: " + ", ".join(sorted(old_peers - new_peers)))
    if new_peers - old_peers:
        parts.append("taken in: " + ", ".join(sorted(new_peers - old_peers)))
    if old.stages != new.stages and not parts[1:]:
        parts.append(f"peers per stage {[len(g) for g in old.stages]} -> {[len(g) for g in new.stages]}")
    return "; ".join(parts) or "peers regrouped"
