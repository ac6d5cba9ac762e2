"""OP-Fence's search: stage groupings from ``coordinator.placement`` cut by
``coordinator.cutter`` in the order of their lower bound (``plan_floor``) until none
left can beat the best plan (``_best_first``), a bounded local search over peer
moves (``_peer_moves``), and a hill-climb over the boundaries (``_refine``)."""

from __future__ import annotations

import bisect
import itertools
import math

from coordinator.cutter import balanced_period, cut_for
from coordinator.estimator import DagCosts, PeerTable, Plan, boundary_positions, group_models, stage_memory
from coordinator.netmodel import Network, PeerProfile
from coordinator.placement import SMALL_SWARM, alike, groupings, moves, order_clusters, pools, set_partitions
from coordinator.plan_eval import DEFAULT_OPTIONS, Options, ScheduleError, evaluate, rank

#: up to this many peers, every grouping of peers into stages (Bell(6) = 203 of them)
TINY_SWARM = 6


#: the refinement treats positions whose prefix FLOPs differ by at most this fraction
#: of the model's count as the same split of the compute, and takes the one where
#: the fewest bytes cross (in a transformer: right after a residual add, where only
#: the residual stream crosses, not after the next LayerNorm, where its output does too)
TIE_FLOPS = 1e-3


#: and only this many positions away are tried as ties (planning time on large graphs)
TIE_REACH = 16


def opfence(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options = DEFAULT_OPTIONS) -> Plan:
    by_id = PeerTable(peers)
    clusters: dict[str, list[PeerProfile]] = {}
    for p in peers:
        clusters.setdefault(network.cluster_of.get(p.id, p.cluster), []).append(p)
    ordered = order_clusters(network, clusters)
    shapes = []
    for pool_order, pool in pools(ordered, clusters, network, options):
        pool_peers = [p for c in pool_order for p in pool[c]]
        if options.stages is not None and len(pool_peers) < options.stages and len(pool_peers) < len(peers):
            continue  # a standby pool too small for the stages asked for
        shapes += [g for k in _candidate_stages(costs, pool_peers, options) for g in groupings(pool_order, pool, k)]
    found = _best_first(costs, shapes, by_id, network, options, math.inf)
    if not found:
        raise ScheduleError("no stage count gives a valid plan for these peers and this model")
    reach = costs.num_ops if costs.num_ops <= 64 else REFINE_REACH
    if len(peers) <= TINY_SWARM and options.stages is None:
        found += _tiny_candidates(costs, peers, by_id, network, options)
    found.sort(key=rank)
    best = _peer_moves(costs, found[0], peers, by_id, network, options)
    others = _distinct(found, FINALISTS - 1) if len(peers) <= SMALL_SWARM else []
    return min((_refine(costs, f, by_id, network, options, reach=reach) for f in [best, *others]), key=rank)


def _candidate_stages(costs: DagCosts, peers: list[PeerProfile], options: Options) -> list[int]:
    limit = min(len(peers), len(boundary_positions(costs)) + 1, options.max_stages)
    if options.stages is not None:
        if options.stages > limit:
            raise ScheduleError(f"{options.stages} stages need {options.stages} peers and ops; the limit is {limit}")
        return [options.stages]
    ks = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128}
    clusters = len({p.cluster for p in peers})
    ks |= {clusters, 2 * clusters}
    return sorted(k for k in ks if 1 <= k <= limit)


#: in swarms of up to ``SMALL_SWARM`` peers, the refinement also polishes the best
#: plans of the search but one, up to this many in all (the bottleneck cut ignores
#: fill and drain, which few micro-batches or few peers make count)
FINALISTS = 6


def _distinct(plans: list[Plan], want: int) -> list[Plan]:
    """The first ``want`` plans of ``plans`` that differ in groups or cut (and from the first)."""
    out: list[Plan] = []
    for p in plans[1:]:
        if len(out) == want:
            break
        if all(p.groups != q.groups or p.cut != q.cut for q in [plans[0], *out]):
            out.append(p)
    return out


def _best_first(
    costs: DagCosts,
    shapes: list[list[list[PeerProfile]]],
    by_id: PeerTable,
    network: Network,
    options: Options,
    beat: float,
) -> list[Plan]:
    """The plans of these stage groupings (each cut by ``cut_for``), in the order of
    their ``plan_floor``, until no grouping left can beat the best valid plan found
    (or ``beat``): branch and bound. Groupings the estimator cannot tell apart are
    cut once (``alike``)."""
    keyed = {alike(groups, network): groups for groups in shapes}
    floors = sorted((plan_floor(costs, g, network, options), key) for key, g in keyed.items())
    out: list[Plan] = []
    for floor, key in floors:
        if floor >= beat or math.isinf(floor):
            break
        got = _cut_and_evaluate(costs, keyed[key], by_id, network, options)
        if got is not None:
            out.append(got)
            beat = min(beat, got.to_loss_s) if got.valid else beat
    return out


def plan_floor(costs: DagCosts, groups: list[list[PeerProfile]], network: Network, options: Options) -> float:
    """No cut of these stage groups reaches the loss sooner: the steady state alone,
    at perfect balance of the work, and never faster than a 1F1B round trip's link
    latency allows (codecs only add steps);
    infinite when their memory cannot hold the training state, however cut."""
    m = options.micro_batches
    models = group_models(groups, network, m)
    held = sum(min(r.memory for r in g.replicas) for g in models)
    in_flight = min(r.in_flight for g in models for r in g.replicas)
    if held < stage_memory(costs, 0, costs.num_ops, in_flight):
        return math.inf
    steady = balanced_period(costs, models)
    for s, (a, b) in enumerate(zip(models, models[1:])):
        if b.window:  # micro-batch 0 goes between the groups' first peers
            link = network.link(groups[s][0].id, groups[s + 1][0].id)
            steady = max(steady, 2 * link.latency_s / (a.window - b.window + 1))
    return (models[0].rounds - 1) * steady


#: rounds of OP-Fence's peer-move search (each takes the best single move, if it
#: gains at least ``MOVE_GAIN``)
MOVE_ROUNDS = 2


MOVE_GAIN = 1.005


def _peer_moves(
    costs: DagCosts, start: Plan, peers: list[PeerProfile], by_id: PeerTable, network: Network, options: Options
) -> Plan:
    """A bounded local search over who runs the stages (the pools and stage counts
    only try shapes in proportion to compute): move one stage to the front, to the
    back or one place later, take one peer out, or put in one
    standby peer (each cluster's fastest) as a stage of its own after its cluster's
    last stage, or as a replica of a stage of its cluster; every move re-cut by
    ``cut_for``. The best move per round while it gains ``MOVE_GAIN``,
    ``MOVE_ROUNDS`` at most."""
    best = start
    for _ in range(MOVE_ROUNDS):
        shapes = moves([[by_id[i] for i in g] for g in best.groups], peers, network, options)
        gain = best.to_loss_s / MOVE_GAIN if best.valid else math.inf
        top = min(_best_first(costs, shapes, by_id, network, options, gain), key=rank, default=None)
        if top is None or rank(top) >= (not best.valid, gain):
            break
        best = top
    return best


def _cut_and_evaluate(
    costs: DagCosts, groups: list[list[PeerProfile]], by_id: PeerTable, network: Network, options: Options
) -> Plan | None:
    cut = cut_for(costs, groups, network, options)
    return None if cut is None else evaluate(costs, cut, [[p.id for p in g] for g in groups], by_id, network, options)


def _tiny_candidates(
    costs: DagCosts, peers: list[PeerProfile], by_id: dict[str, PeerProfile], network: Network, options: Options
) -> list[Plan]:
    """Tiny swarms: every grouping of the peers, in every stage order (up to 24)."""
    out = []
    limit = len(boundary_positions(costs)) + 1
    for part in set_partitions(sorted(peers, key=lambda p: p.id)):
        if len(part) > limit:
            continue
        for order in itertools.islice(itertools.permutations(part), 24):
            groups = list(order)
            cut = cut_for(costs, groups, network, options)
            if cut is not None:
                out.append(evaluate(costs, cut, [[p.id for p in g] for g in groups], by_id, network, options))
    return out


#: the boundary hill-climb: rounds over every boundary, and positions tried each way
REFINE_ROUNDS = 3


REFINE_REACH = 3


def _better(a: Plan, b: Plan | None) -> bool:
    return b is None or rank(a) < rank(b)


def _refine(
    costs: DagCosts, start: Plan, by_id: dict[str, PeerProfile], network: Network, options: Options, reach: int
) -> Plan:
    """Hill-climb the boundaries on the predicted time to the loss (the bottleneck
    search ignores pipeline fill and drain): a few positions each way, and every
    position that splits the compute the same way (within ``TIE_FLOPS``), so a
    boundary can move to where fewer bytes cross. Codecs are weighed all or none per
    move, edge by edge once at the end."""
    ordered = boundary_positions(costs)
    allowed = set(ordered)
    slack = TIE_FLOPS * costs.total_flops
    best = evaluate(costs, start.cut, start.groups, by_id, network, options, revert=False)  # compared alike
    for _ in range(REFINE_ROUNDS):
        improved = False
        for b in range(len(best.cut)):
            lo = best.cut[b - 1] if b else 0
            hi = best.cut[b + 1] if b + 1 < len(best.cut) else costs.num_ops
            here = best.cut[b]
            steps = {here + x for r in range(1, reach + 1) for x in (-r, r)}
            a, z = bisect.bisect_left(ordered, here - TIE_REACH), bisect.bisect_right(ordered, here + TIE_REACH)
            near = ordered[a:z]
            ties = {q for q in near if costs.stage_flops(min(q, here), max(q, here)) <= slack}
            for pos in sorted((steps | ties) - {here}, key=lambda q: (abs(q - here), q)):
                if lo < pos < hi and pos in allowed:
                    cut = best.cut[:b] + (pos,) + best.cut[b + 1 :]
                    cand = evaluate(costs, cut, best.groups, by_id, network, options, revert=False)
                    if _better(cand, best):
                        best, improved = cand, True
        if not improved:
            break
    final = evaluate(costs, best.cut, best.groups, by_id, network, options)
    return final if rank(final) <= rank(start) else start
