"""OP-Fence's search: stage groupings from ``coordinator.placement`` cut by
``coordinator.cutter`` in the order of their lower bound (``plan_floor``) until none
left can beat the best plan (``_best_first``), a bounded local search over peer
moves (``_peer_moves``), and a hill-climb over the boundaries (``_refine``)."""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any

from coordinator.cutter import balanced_period, cut_for
from coordinator.estimator import DagCosts, PeerTable, Plan, boundary_positions, group_models, stage_memory
from coordinator.netmodel import Network, PeerProfile, boundary_models
from coordinator.placement import alike, groupings, moves, order_clusters, pools, set_partitions
from coordinator.plan_eval import DEFAULT_OPTIONS, Options, ScheduleError, evaluate, rank
from protocol.model.schedule import uses_1f1b

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
    return finalists(costs, peers, network, options)[0]


def finalists(
    costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options = DEFAULT_OPTIONS
) -> list[Plan]:
    """OP-Fence's last few plans, best first (``opfence`` takes the first): the
    plans of every pool and grouping in the order of their lower bound
    (``_best_first``), a local search over peer moves (``_peer_moves``) from the best
    plans of the ``SEEDS`` best distinct peer sets, and the ``FINALISTS`` best of
    all that polished (``_refine``) and raced on the estimator."""
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
    memo: Memo = {}
    found = _best_first(costs, shapes, by_id, network, options, math.inf, memo)
    if not found:
        raise ScheduleError("no stage count gives a valid plan for these peers and this model")
    reach = costs.num_ops if costs.num_ops <= 64 else REFINE_REACH
    if len(peers) <= TINY_SWARM and options.stages is None:
        found += _tiny_candidates(costs, peers, by_id, network, options)
    found.sort(key=rank)
    climbed = [_peer_moves(costs, s, peers, by_id, network, options, memo) for s in _seeds(found, SEEDS)]
    race = _distinct(sorted([*climbed, *found], key=rank), FINALISTS)
    race = [f for f in race if f is race[0] or rank(f) <= (False, race[0].to_loss_s * RACE_MARGIN)]
    return sorted((_refine(costs, f, by_id, network, options, reach=reach) for f in race), key=rank)


def _seeds(plans: list[Plan], want: int) -> list[Plan]:
    """The best plan of each of the ``want`` best distinct sets of peers (``plans``
    ranked), within ``SEED_MARGIN`` of the best."""
    out, seen = [], set()
    for p in plans:
        used = frozenset(pid for g in p.groups for pid in g)
        if p.valid and p.to_loss_s > plans[0].to_loss_s * SEED_MARGIN:
            break
        if used not in seen and p.valid:
            seen.add(used)
            out.append(p)
            if len(out) == want:
                break
    return out or plans[:1]


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


#: the race: this many plans, distinct in groups or cut, are polished and compared
#: (the bottleneck cut ignores fill and drain, which few micro-batches or few peers
#: make count)
FINALISTS = 6
#: and only those within this factor of the best (polishing gains a few percent)
RACE_MARGIN = 1.1


#: the local search over peer moves starts from the best plans of this many
#: distinct sets of peers
SEEDS = 3
#: of plans within this factor of the best one
SEED_MARGIN = 1.5


def _distinct(plans: list[Plan], want: int) -> list[Plan]:
    """The first ``want`` plans of ``plans`` that differ in groups or cut."""
    out: list[Plan] = []
    for p in plans:
        if len(out) == want:
            break
        if all(p.groups != q.groups or p.cut != q.cut for q in out):
            out.append(p)
    return out


#: groupings already cut and their floors, by what the estimator sees of them (``alike``)
Memo = dict[tuple[str, Any], Any]


def _best_first(
    costs: DagCosts,
    shapes: list[list[list[PeerProfile]]],
    by_id: PeerTable,
    network: Network,
    options: Options,
    beat: float,
    memo: Memo | None = None,
    tries: int | None = None,
) -> list[Plan]:
    """The plans of these stage groupings (each cut by ``cut_for``), in the order of
    their ``plan_floor``, until no grouping left can beat the best valid plan found
    (or ``beat``): branch and bound. Groupings the estimator cannot tell apart are
    cut once (``alike``), and once per search where ``memo`` keeps them; at most
    ``tries`` new ones are cut."""
    memo = {} if memo is None else memo
    keyed = {alike(groups, network): groups for groups in shapes}
    floors = []
    for key, g in keyed.items():
        if ("floor", key) not in memo:
            memo[("floor", key)] = plan_floor(costs, g, network, options)
        floors.append((memo[("floor", key)], key))
    out: list[Plan] = []
    for floor, key in sorted(floors):
        if floor >= beat or math.isinf(floor):
            break
        if ("plan", key) not in memo:
            if tries is not None and tries <= 0:
                break
            tries = None if tries is None else tries - 1
            memo[("plan", key)] = _cut_and_evaluate(costs, keyed[key], by_id, network, options, beat)
        got = memo[("plan", key)]
        if got is not None:
            out.append(got)
            beat = min(beat, got.to_loss_s) if got.valid else beat
    return out


def plan_floor(costs: DagCosts, groups: list[list[PeerProfile]], network: Network, options: Options) -> float:
    """No cut of these stage groups reaches the loss sooner: the steady state alone,
    at perfect balance of the work, never faster than each link carries the fewest
    bytes any boundary can (``least_crossing``), and never faster than a 1F1B round
    trip's link latency allows (codecs only add steps);
    infinite when their memory cannot hold the training state, however cut."""
    m = options.micro_batches
    models = group_models(groups, network, m)
    held = sum(min(r.memory for r in g.replicas) for g in models)
    in_flight = min(r.in_flight for g in models for r in g.replicas)
    if held < stage_memory(costs, 0, costs.num_ops, in_flight):
        return math.inf
    steady = balanced_period(costs, models)
    if len(groups) > 1:
        least = least_crossing(costs, len(groups), options)
        for edge in boundary_models([[p.id for p in g] for g in groups], network, m):
            steady = max(steady, least * edge.per_byte())
    for s, (a, b) in enumerate(zip(models, models[1:])):
        if b.window:  # micro-batch 0 goes between the groups' first peers
            link = network.link(groups[s][0].id, groups[s + 1][0].id)
            steady = max(steady, 2 * link.latency_s / (a.window - b.window + 1))
    return (models[0].rounds - 1) * steady


def least_crossing(costs: DagCosts, k: int, options: Options) -> float:
    """The fewest bytes a micro-batch sends over any boundary of a ``k``-stage cut:
    the least, over positions that leave both sides a stage's least FLOPs, of what
    crosses there uncompressed or compressed as far as ``Options.strongest``."""

    def make() -> float:
        least, n = costs.min_stage_flops(k), costs.num_ops
        strong = costs.wire_table(options.strongest())
        ok = [
            min(costs.cross_bytes[p], strong[p])
            for p in boundary_positions(costs)
            if costs.stage_flops(0, p) >= least and costs.stage_flops(p, n) >= least
        ]
        return float(min(ok, default=0.0))

    return float(costs.cached(("least crossing", k, str(options.strongest())), make))


#: rounds of OP-Fence's peer-move search (each takes the best single move, if it
#: gains at least ``MOVE_GAIN``)
MOVE_ROUNDS = 6


MOVE_GAIN = 1.005
#: and cuts at most this many new groupings a round, in the order of their lower bound
MOVE_TRIES = 10**9


def _peer_moves(
    costs: DagCosts,
    start: Plan,
    peers: list[PeerProfile],
    by_id: PeerTable,
    network: Network,
    options: Options,
    memo: Memo | None = None,
) -> Plan:
    """A bounded local search over who runs the stages (the pools and stage counts
    only try shapes in proportion to compute): move one stage to any other place,
    take one peer or one cluster's planned peers out, or put in one standby peer
    (each cluster's fastest) as a stage of its own after its cluster's last stage,
    as a replica of a stage of its cluster or in place of a slower peer of its
    cluster (``placement.moves``); every move re-cut by ``cut_for``. The best move
    per round while it gains ``MOVE_GAIN``, ``MOVE_ROUNDS`` at most."""
    best, memo = start, {} if memo is None else memo
    for _ in range(MOVE_ROUNDS):
        shapes = moves([[by_id[i] for i in g] for g in best.groups], peers, network, options)
        gain = best.to_loss_s / MOVE_GAIN if best.valid else math.inf
        got = _best_first(costs, shapes, by_id, network, options, gain, memo, MOVE_TRIES)
        top = min(got, key=rank, default=None)
        if top is None or rank(top) >= (not best.valid, gain):
            break
        best = top
    return best


def _cut_and_evaluate(
    costs: DagCosts,
    groups: list[list[PeerProfile]],
    by_id: PeerTable,
    network: Network,
    options: Options,
    beat: float = math.inf,
) -> Plan | None:
    """These groups' bottleneck cut, priced; with replicas, each boundary also tried one
    position either way, unless the plan is ``SEED_MARGIN`` squared behind ``beat`` (the
    best so far): those tries gained at most 1.32x in the 1,000-peer simulation's first
    plan, so such a plan could become neither seed nor finalist, nor beat a seed
    ``SEED_MARGIN`` behind in the moves' search, which shares the memo; and trying them
    for every grouping made that simulation four times slower (9.5 predictions each)."""
    cut = cut_for(costs, groups, network, options)
    if cut is None:
        return None
    ids = [[p.id for p in g] for g in groups]
    best = evaluate(costs, cut, ids, by_id, network, options)
    if all(len(g) == 1 for g in groups) or (best.valid and best.to_loss_s > beat * SEED_MARGIN**2):
        return best
    # a replicated stage's last gradient sends show at the step's end, which the
    # bottleneck cut cannot see: each boundary one allowed position either way too
    allowed = set(boundary_positions(costs))
    for b, here in enumerate(cut):
        for pos in (here - 1, here + 1):
            moved = cut[:b] + (pos,) + cut[b + 1 :]
            if pos in allowed and all(x < y for x, y in zip((0, *moved), (*moved, costs.num_ops))):
                cand = evaluate(costs, moved, ids, by_id, network, options)
                best = cand if _better(cand, best) else best
    return best


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


def _reaches(reach: int, span: int, gpipe: bool) -> list[int]:
    """How far each way the hill-climb tries a boundary: 1 to ``reach`` positions; under
    GPipe also every power of two up to the boundary's ``span``. There the stages run
    all their forwards and then all their backwards, so the fill and the drain weigh
    as much as the slowest stage, and the best cut can lie far from the bottleneck cut
    (on ``mixed-7``, 27 of 68 operators away and 11% faster, predicted and simulated)."""
    near = list(range(1, reach + 1))
    return near + [1 << j for j in range(reach.bit_length(), span.bit_length())] if gpipe else near


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
    gpipe = not uses_1f1b(start.groups)
    best = evaluate(costs, start.cut, start.groups, by_id, network, options, revert=False)  # compared alike
    for _ in range(REFINE_ROUNDS):
        improved = False
        for b in range(len(best.cut)):
            lo = best.cut[b - 1] if b else 0
            hi = best.cut[b + 1] if b + 1 < len(best.cut) else costs.num_ops
            here = best.cut[b]
            steps = {here + x for r in _reaches(reach, hi - lo, gpipe) for x in (-r, r)}
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
