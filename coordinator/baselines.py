"""The baselines OP-Fence is measured against, on the same estimator: ``even``
(peers in the given order, equal op counts), ``compute`` (peers balanced by
FLOP/s regardless of bandwidth, ops split in proportion), ``random`` (seeded), and
``exhaustive``: the best plan over every grouping and cut, for tiny instances.

The planners as well equipped as OP-Fence (codecs by the same
rule through ``plan_eval.evaluate``, replicas, standby peers): ``bw-blind``
(everything but bandwidth awareness), ``petals`` (Petals' greedy span selection
by throughput) and ``dtfm`` (an evolutionary search over peer-to-stage
assignment in the spirit of Together's DT-FM, in ``coordinator.dtfm``). Each is a pure function
``(costs, peers, network, options) -> Plan``, deterministic given
``options.seed``, and raises ``ScheduleError`` when no plan fits memory."""

from __future__ import annotations

import bisect
import itertools
import math
import random

from coordinator.cutter import cut_for, proportional_cut
from coordinator.estimator import PASSES, DagCosts, PeerTable, Plan, boundary_positions, predict, stage_memory
from coordinator.netmodel import Network, PeerProfile
from coordinator.placement import balanced_groups
from coordinator.plan_eval import Options, ScheduleError, evaluate, rank
from protocol.wire.codecs import Codec


def _finish(
    costs: DagCosts,
    cut: tuple[int, ...],
    groups: list[list[PeerProfile]],
    name: str,
    network: Network,
    options: Options,
) -> Plan:
    ids = [[p.id for p in g] for g in groups]
    by_id = {p.id: p for g in groups for p in g}
    return predict(costs, Plan(cut, ids, [Codec()] * (len(groups) - 1), name), by_id, network, options.micro_batches)


def even(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options, k: int) -> Plan:
    """Peers in the given order, ``k`` runs of them; equal op counts per stage."""
    groups = [peers[i * len(peers) // k : (i + 1) * len(peers) // k] for i in range(k)]
    n = costs.num_ops
    cut = proportional_cut(DagCosts([1] * n, [0] * n, [0] * n, [0] * n, [0] * n, costs.forbidden), [1.0] * k)
    return _finish(costs, cut, groups, "even", network, options)


def compute(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options, k: int) -> Plan:
    """FLOP/s-balanced groups and a FLOP-proportional cut; bandwidth ignored."""
    groups = balanced_groups(peers, k)
    cut = proportional_cut(costs, [sum(p.flops for p in g) for g in groups])
    return _finish(costs, cut, groups, "compute", network, options)


def random_plan(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options, k: int) -> Plan:
    """Seeded random groups and cut positions."""
    rng = random.Random(options.seed)
    shuffled = list(peers)
    rng.shuffle(shuffled)
    groups = [shuffled[i * len(peers) // k : (i + 1) * len(peers) // k] for i in range(k)]
    cut = tuple(sorted(rng.sample(boundary_positions(costs), k - 1)))
    return _finish(costs, cut, groups, "random", network, options)


def _ordered_partitions(items: list[PeerProfile], k: int):  # type: ignore[no-untyped-def]
    """Every way to put all ``items`` into ``k`` non-empty, ordered groups."""
    if k == 1:
        yield [list(items)]
        return
    n = len(items)
    for labels in itertools.product(range(k), repeat=n):
        if len(set(labels)) == k:
            yield [[items[i] for i in range(n) if labels[i] == g] for g in range(k)]


def exhaustive(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options | None = None) -> Plan:
    """The best plan over every grouping of every peer into ordered stages and every
    cut (codecs by the same rule as OP-Fence). Only for tiny instances."""
    options = options or Options()
    by_id = PeerTable(peers)
    allowed = boundary_positions(costs)
    best: Plan | None = None
    for k in range(1, min(len(peers), len(allowed) + 1) + 1):
        cuts = list(itertools.combinations(allowed, k - 1))
        for groups in _ordered_partitions(peers, k):
            ids = [[p.id for p in g] for g in groups]
            for cut in cuts:
                cand = evaluate(costs, cut, ids, by_id, network, options, "exhaustive")
                if cand.valid and (best is None or rank(cand) < rank(best)):
                    best = cand
    if best is None:
        raise ScheduleError("no plan fits memory")
    return best


# ------------------------------------------------------------------ strong baselines

#: how bw-blind sees the network when it cuts: every link equal and free, so its
#: cuts balance compute and memory only (bandwidth reaches it only through the
#: estimator's score of whole candidates)
BLIND_LINK = (1e12, 0.0)
#: bw-blind may move a boundary by this share of an even stage's FLOPs to where
#: fewer bytes cross
BLIND_SLACK = 0.1


def by_speed(peers: list[PeerProfile]) -> list[PeerProfile]:
    return sorted(peers, key=lambda p: (-p.flops, p.id))


def ids_of(groups: list[list[PeerProfile]]) -> list[list[str]]:
    return [[p.id for p in g] for g in groups]


def rank_or_none(plan: Plan | None) -> tuple[bool, float]:
    """Sort key, as every scheduler ranks plans (``scheduler.rank``: valid ones
    first, then the predicted time to the loss); no plan last."""
    return (True, math.inf) if plan is None else rank(plan)


def stage_limit(costs: DagCosts, num_peers: int, options: Options) -> int:
    """The most stages a plan may have: one peer and one op each, and ``max_stages``."""
    return min(num_peers, len(boundary_positions(costs)) + 1, options.max_stages)


def stage_counts(costs: DagCosts, num_peers: int, options: Options) -> list[int]:
    """Every stage count a plan over ``num_peers`` peers may have (just the forced one)."""
    limit = stage_limit(costs, num_peers, options)
    if options.stages is not None:
        return [options.stages] if options.stages <= limit else []
    return list(range(1, limit + 1))


def grid(n: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to ``n``, and ``n``."""
    sizes = {n, 1}
    m = 2
    while m < n:
        sizes |= {m, m + m // 2}
        m *= 2
    return sorted(x for x in sizes if x <= n)


def pool_sizes(n: int, options: Options) -> list[int]:
    """How many of the fastest peers to try: the ``grid`` of ``n`` (with standby), or all."""
    return grid(n) if options.standby else [n]


def fitting(best: Plan | None, name: str, peers: list[PeerProfile], options: Options) -> Plan:
    if best is None or not best.valid:
        stages = f" in {options.stages} stages" if options.stages is not None else ""
        raise ScheduleError(f"{name}: no plan{stages} for these {len(peers)} peers fits memory (or has no empty stage)")
    return best


def bw_blind(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options) -> Plan:
    """Everything OP-Fence has except bandwidth awareness: for the fastest ``m``
    peers (m = 1, 2, 3, 4, 6, 8, ..., all) and every stage count ``k``, FLOP/s-balanced
    replica groups in the order ``balanced_groups`` makes them; the ops cut in
    proportion to the groups' FLOP/s (if that cut is not valid, the compute- and
    memory-balanced ``bottleneck_cut`` on a network whose links are all equal and
    free), each cut also tried with its boundaries moved to where the fewest bytes
    cross (``snap``: model structure, not links); the swarm's codecs. Grouping,
    stage order and cut positions never look at the network; ``m``, ``k`` and the
    snap are chosen by the estimator's prediction of the whole plan, which sees
    bandwidth only through its score, as a bandwidth-blind system tuned by trial
    runs would."""
    by_id = PeerTable(peers)
    fastest = by_speed(peers)
    blind = Network({}, {}, default=BLIND_LINK)
    best: Plan | None = None
    for m in pool_sizes(len(peers), options):
        for k in stage_counts(costs, m, options):
            cand = _blind_plan(costs, balanced_groups(fastest[:m], k), by_id, network, blind, options)
            if rank_or_none(cand) < rank_or_none(best):
                best = cand
    return fitting(best, "bw-blind", peers, options)


def _blind_plan(
    costs: DagCosts,
    groups: list[list[PeerProfile]],
    by_id: PeerTable,
    network: Network,
    blind: Network,
    options: Options,
) -> Plan | None:
    """The best plan of ``groups`` over bw-blind's cuts (None: no cut fits)."""
    ids = ids_of(groups)
    best: Plan | None = None
    for rule in ("proportional", "balanced"):
        cut = _blind_cut(rule, costs, groups, blind, options)
        if cut is None:
            continue
        for c in dict.fromkeys((cut, snap(costs, cut))):
            cand = evaluate(costs, c, ids, by_id, network, options, "bw-blind")
            if rank_or_none(cand) < rank_or_none(best):
                best = cand
        if best is not None and best.valid:
            break  # the balanced cut only where the proportional one is not valid
    return best


def _blind_cut(
    rule: str, costs: DagCosts, groups: list[list[PeerProfile]], blind: Network, options: Options
) -> tuple[int, ...] | None:
    """The cut in proportion to the groups' FLOP/s, or balanced under memory on ``blind``."""
    if rule == "balanced":
        return cut_for(costs, groups, blind, options)
    try:
        return proportional_cut(costs, [sum(p.flops for p in g) for g in groups])
    except ScheduleError:
        return None


def snap(costs: DagCosts, cut: tuple[int, ...]) -> tuple[int, ...]:
    """``cut`` with each boundary moved, within ``BLIND_SLACK`` of an even stage's
    FLOPs and between its neighbours, to the allowed position where the fewest
    bytes cross (ties: the nearest), as pipelines cut between transformer blocks."""
    width = BLIND_SLACK * costs.total_flops / (len(cut) + 1)
    out: list[int] = []
    for b, pos in enumerate(cut):
        lo, hi = out[-1] if out else 0, cut[b + 1] if b + 1 < len(cut) else costs.num_ops
        near = [pos]
        for step in (-1, 1):
            q = pos + step
            while lo < q < hi and costs.stage_flops(min(q, pos), max(q, pos)) <= width:
                if q not in costs.forbidden:
                    near.append(q)
                q += step
        out.append(min(near, key=lambda q: (costs.cross_bytes[q], abs(q - pos))))
    return tuple(out)


# ------------------------------------------------------------------ Petals


def petals(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options) -> Plan:
    """Petals' block selection (``petals/server/block_selection.py``), adapted to
    disjoint stages. There every server in turn takes as many blocks as its memory
    holds and starts them where the swarm's per-block throughput is lowest (the
    window whose sorted throughputs are smallest, the first such window on ties),
    adding its throughput there. Here peers come fastest first; the throughput of
    an op is its stage's micro-batches per second (the group's FLOP/s over 3 x the
    stage's FLOPs) and 0 where no peer serves it yet. So while ops are uncovered a
    peer opens a stage at the first uncovered op (Petals' first all-zero window)
    and takes every op its memory holds (weights, gradients, Adam state and the
    activations of the micro-batches 1F1B keeps in flight there; the stage count
    that sets those is iterated to a fixed point); once all are covered, it joins
    as a replica the stage of lowest throughput whose memory it fits (a peer that
    fits none waits on standby). The peer whose span reaches the model's end
    takes all its memory holds there, as Petals' last window ``[n - span, n)``
    does, and the stage before gives up the overlap. With ``options.stages``
    set, a stage also ends at the equal-FLOPs boundary (Petals' ``--num_blocks``).
    If the plan does not fit memory under the schedule the swarm would run
    (uneven replica counts make it GPipe, every micro-batch in flight), the
    replicas that joined last wait on standby, as few as make it fit; failing
    that, spans are sized for every micro-batch in flight. Bandwidth and the
    estimator's times play no part: Petals takes no search, only its rule."""
    limit = stage_limit(costs, len(peers), options)
    if options.stages is not None and options.stages > limit:
        raise ScheduleError(f"petals: {options.stages} stages need as many peers and ops; the limit is {limit}")
    problem = ""
    for every_micro_batch in (False, True):  # in flight as under 1F1B, then (if that does not fit) all of them
        stages = _petals_fixed_point(costs, by_speed(peers), options, limit, every_micro_batch)
        problem = _petals_problem(costs, stages, options, limit)
        if not problem:
            plan = _petals_plan(costs, stages, PeerTable(peers), network, options)
            if plan.valid:
                return plan
            problem = "its plan does not fit memory (or has a stage computing next to nothing)"
    raise ScheduleError(f"petals: {problem} ({len(peers)} peers)")


def _petals_plan(
    costs: DagCosts,
    stages: list[tuple[int, int, list[PeerProfile]]],
    by_id: PeerTable,
    network: Network,
    options: Options,
) -> Plan:
    """The plan of Petals' placement; if it does not fit memory (replicas can change
    the pipeline schedule, and with it the micro-batches in flight), the replicas
    that joined last wait on standby, as few as make it fit."""
    cut = tuple(lo for lo, _, _ in stages[1:])
    joined = sorted((-p.flops, p.id, s) for s, (_, _, g) in enumerate(stages) for p in g[1:])  # joining order
    for kept in range(len(joined), -1, -1):
        ids = [[g[0].id] for _, _, g in stages]
        for *_, pid, s in joined[:kept]:
            ids[s].append(pid)
        trial = Plan(cut, ids, [Codec()] * len(cut), "petals")
        if kept == 0 or predict(costs, trial, by_id, network, options.micro_batches).fits_memory:
            break
    return evaluate(costs, cut, ids, by_id, network, options, "petals")


def _petals_fixed_point(
    costs: DagCosts, order: list[PeerProfile], options: Options, limit: int, every_micro_batch: bool
) -> list[tuple[int, int, list[PeerProfile]]]:
    """Petals' placement with spans sized for the stage count they make: start
    from one stage (or the forced count) and recount until the spans make no more
    stages than they were sized for (more stages hold more micro-batches in flight)."""
    caps = _equal_flops_ends(costs, options.stages) if options.stages is not None else None
    guess = options.stages or 1
    m = options.micro_batches
    while True:
        in_flight = [m if every_micro_batch else max(1, min(m, guess - s)) for s in range(limit + 1)]
        stages = _petals_stages(costs, order, in_flight, caps)
        if options.stages is not None or len(stages) <= guess or len(stages) > limit:
            return stages
        guess = len(stages)


def _petals_problem(
    costs: DagCosts, stages: list[tuple[int, int, list[PeerProfile]]], options: Options, limit: int
) -> str:
    """Why Petals' placement is no plan ("" if it is one)."""
    if not stages or stages[-1][1] < costs.num_ops:
        return "the peers' memory cannot hold the model" + (f" in {options.stages} stages" if options.stages else "")
    if len(stages) > limit:
        return f"the spans that fit memory make {len(stages)} stages, more than the limit of {limit}"
    return ""


def _equal_flops_ends(costs: DagCosts, k: int) -> list[int]:
    """Where each of ``k`` equal-FLOPs stages ends (the last at the model's end)."""
    return [*proportional_cut(costs, [1.0] * k), costs.num_ops]


def _petals_stages(
    costs: DagCosts, order: list[PeerProfile], in_flight: list[int], caps: list[int] | None
) -> list[tuple[int, int, list[PeerProfile]]]:
    """Petals' placement, peer by peer, stage ``s`` holding ``in_flight[s]``
    micro-batches' activations (the last entry for any later stage) and ending by
    ``caps[s]``: (first op, end op, peers) per stage."""
    flight = in_flight + [in_flight[-1]] * len(order)
    stages: list[tuple[int, int, list[PeerProfile]]] = []
    covered = 0
    for peer in order:
        s = len(stages)
        if covered < costs.num_ops and (caps is None or s < len(caps)):
            cap = costs.num_ops if caps is None else caps[s]
            hi = _longest_span(costs, covered, cap, peer.memory_bytes, flight[s])
            if hi is not None:
                lo = covered
                if hi == costs.num_ops and caps is None and stages:  # Petals' last window: [n - span, n)
                    lo = _earliest_start(costs, stages[-1][0], covered, peer.memory_bytes, flight[s])
                    stages[-1] = (stages[-1][0], lo, stages[-1][2])
                stages.append((lo, hi, [peer]))
                covered = hi
                continue
        room = peer.memory_bytes
        fits = [i for i, (lo, hi, _) in enumerate(stages) if stage_memory(costs, lo, hi, flight[i]) <= room]
        if fits:
            i = min(fits, key=lambda i: (_throughput(costs, stages[i]), stages[i][0]))
            stages[i][2].append(peer)
    return stages


def _earliest_start(costs: DagCosts, after: int, start: int, memory: int, in_flight: int) -> int:
    """The earliest allowed position in (``after``, ``start``] from which a stage to
    the model's end still fits ``memory`` (``start`` does)."""
    allowed = boundary_positions(costs)
    starts = [*allowed[bisect.bisect_right(allowed, after) : bisect.bisect_left(allowed, start)], start]
    a, b = 0, len(starts) - 1  # starts[b:] fit
    while a < b:
        mid = (a + b) // 2
        if stage_memory(costs, starts[mid], costs.num_ops, in_flight) <= memory:
            b = mid
        else:
            a = mid + 1
    return starts[b]


def _throughput(costs: DagCosts, stage: tuple[int, int, list[PeerProfile]]) -> float:
    """Micro-batches per second a stage's group gets through its ops."""
    lo, hi, group = stage
    return sum(p.flops for p in group) / (PASSES * max(costs.stage_flops(lo, hi), 1))


def _longest_span(costs: DagCosts, lo: int, cap: int, memory: int, in_flight: int) -> int | None:
    """The furthest end (an allowed cut position or the model's end, at most ``cap``)
    of a stage starting at ``lo`` that fits ``memory``; None if not even one op fits."""
    allowed = boundary_positions(costs)
    ends = [q for q in allowed[bisect.bisect_right(allowed, lo) :] if q <= cap]
    if cap == costs.num_ops:
        ends.append(cap)
    a, b = 0, len(ends)  # ends[:a] fit, ends[b:] do not
    while a < b:
        mid = (a + b) // 2
        if stage_memory(costs, lo, ends[mid], in_flight) <= memory:
            a = mid + 1
        else:
            b = mid
    return ends[a - 1] if a else None
