"""The OP-Fence scheduler and its baselines: pure functions of (OP-DAG costs, peer
profiles, network, options) to a :class:`Plan` with predicted times.

OP-Fence:

1. clusters peers by the bandwidth between them (the network's clusters);
2. orders the clusters along the pipeline so consecutive clusters have the
   fastest links between them (every order for up to 7 clusters, else greedy);
3. for each pool of peers (``_pools``) and candidate number of stages, gives each
   cluster stages in proportion to its FLOP/s and splits its peers into that many
   balanced replica groups, so stage groups never straddle a slow link when there
   are at least as many stages as clusters (and runs of peers);
4. cuts those groupings in the order of their lower bound (``plan_floor``) until
   none left can beat the best plan (``_best_first``), each by binary search on the
   bottleneck time: each stage takes as many ops as its group computes within the
   bound, and ends at the position whose boundary tensors cross the link in time
   (compressed as far as the swarm's ``auto`` ever goes, where needed) and whose
   1F1B round trip to the next stage keeps up (``_Cutter``);
5. gives each slow edge the codec the live swarm's ``auto`` would (fp16, int8, low
   rank with int4 gradients: just enough) or none, whichever reaches the loss
   sooner (``coordinator.codec_price``: each codec's measured steps factor), and
   keeps the plans that fit memory and reach the loss soonest;
6. moves peers in a bounded local search (``_peer_moves``) and polishes the best
   plan by moving boundaries (``_refine``).

The baselines live in ``coordinator.baselines``; ``plan`` runs any of them by name.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator.codec_price import edge_price
from coordinator.estimator import (
    BoundaryModel,
    DagCosts,
    GroupModel,
    Network,
    PeerProfile,
    PeerTable,
    Plan,
    boundary_models,
    boundary_positions,
    group_models,
    nearest_allowed,
    predict,
    stage_memory,
)
from coordinator.links import MIN_RANK
from protocol.wire.codecs import Codec

SCHEDULERS = ("opfence", "bw-blind", "petals", "dtfm", "even", "compute", "random")
#: the baselines as well equipped as OP-Fence (codecs, replicas, standby peers)
STRONG = ("bw-blind", "petals", "dtfm")
#: the strongest compression the swarm's ``auto`` uses (what a cut may count on)
FLOOR = Codec("lowrank", rank=MIN_RANK, grad=Codec("int4", stochastic=True))
#: up to this many peers, OP-Fence tries every split of its peer order into stages
SMALL_SWARM = 8
#: up to this many peers, every grouping of peers into stages (Bell(6) = 203 of them)
TINY_SWARM = 6


@dataclass(frozen=True)
class Options:
    micro_batches: int = 8
    max_stages: int = 32
    compression: bool = True  # slow edges may get the codec the swarm's ``auto`` would give them
    seed: int = 0
    stages: int | None = None  # force the number of stages
    standby: bool = True  # OP-Fence may leave peers out (on standby) when that is faster


class ScheduleError(ValueError):
    """No plan is possible (e.g. more stages than ops or peers)."""


def plan(
    scheduler: str, costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options = Options()
) -> Plan:
    """The plan of ``scheduler`` (one of SCHEDULERS)."""
    if not peers:
        raise ScheduleError("no peers to plan for")
    if scheduler == "opfence":
        return opfence(costs, peers, network, options)
    from coordinator import baselines, dtfm

    strong = {"bw-blind": baselines.bw_blind, "petals": baselines.petals, "dtfm": dtfm.dtfm}
    if scheduler in strong:
        return strong[scheduler](costs, peers, network, options)

    k = options.stages or _baseline_stages(costs, peers, options)
    if scheduler == "even":
        return baselines.even(costs, peers, network, options, k)
    if scheduler == "compute":
        return baselines.compute(costs, peers, network, options, k)
    if scheduler == "random":
        return baselines.random_plan(costs, peers, network, options, k)
    raise ScheduleError(f"unknown scheduler {scheduler!r} (known: {', '.join(SCHEDULERS)})")


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


def _baseline_stages(costs: DagCosts, peers: list[PeerProfile], options: Options) -> int:
    """Baselines get the pipeline depth bandwidth-unaware systems pick: as many
    stages as they may, one peer each where possible."""
    return min(len(peers), len(boundary_positions(costs)) + 1, options.max_stages)


# ------------------------------------------------------------------ OP-Fence


def order_clusters(network: Network, clusters: dict[str, list[PeerProfile]]) -> list[str]:
    """Cluster order along the pipeline: consecutive clusters joined by fast links."""
    names = sorted(clusters, key=lambda c: (-sum(p.flops for p in clusters[c]), c))
    if len(names) <= 1:
        return names

    speeds = {(a, b): network.link(clusters[a][0].id, clusters[b][0].id).mbps for a in names for b in names}

    def bw(a: str, b: str) -> float:
        return speeds[(a, b)]

    def score(order: tuple[str, ...]) -> tuple[float, float]:
        links = [bw(a, b) for a, b in zip(order, order[1:])]
        return (min(links), sum(math.log(x) for x in links))

    if len(names) <= 7:
        return list(max(itertools.permutations(names), key=score))
    order = [names[0]]
    left = set(names[1:])
    while left:
        nxt = max(sorted(left), key=lambda c: bw(order[-1], c))
        order.append(nxt)
        left.remove(nxt)
    return order


def _apportion(weights: list[float], k: int) -> list[int]:
    """Split ``k`` stages over clusters in proportion to ``weights``, at least one each
    when ``k`` allows (largest remainders)."""
    n = len(weights)
    if k < n:
        return []
    total = sum(weights)
    quotas = [1 + (k - n) * w / total for w in weights]
    out = [int(q) for q in quotas]
    for i in sorted(range(n), key=lambda i: quotas[i] - out[i], reverse=True)[: k - sum(out)]:
        out[i] += 1
    return out


def _balanced_groups(peers: list[PeerProfile], k: int) -> list[list[PeerProfile]]:
    """``k`` groups of similar total FLOP/s (the fastest peer first into the lightest group)."""
    groups: list[list[PeerProfile]] = [[] for _ in range(k)]
    load = [0.0] * k
    for p in sorted(peers, key=lambda p: (-p.flops, p.id)):
        i = min(range(k), key=lambda i: (load[i], len(groups[i]), i))
        groups[i].append(p)
        load[i] += p.flops
    return groups


def _contiguous_groups(peers: list[PeerProfile], k: int) -> list[list[PeerProfile]]:
    """``k`` runs of consecutive peers with similar total FLOP/s."""
    total = sum(p.flops for p in peers)
    groups: list[list[PeerProfile]] = [[]]
    acc = 0.0
    for i, p in enumerate(peers):
        left_peers, left_groups = len(peers) - i, k - len(groups)
        if groups[-1] and left_groups > 0 and (acc >= total * len(groups) / k or left_peers <= left_groups):
            groups.append([])
        groups[-1].append(p)
        acc += p.flops
    return groups


def _stage_groups(ordered: list[str], clusters: dict[str, list[PeerProfile]], k: int) -> list[list[PeerProfile]] | None:
    counts = _apportion([sum(p.flops for p in clusters[c]) for c in ordered], k)
    if counts:
        groups: list[list[PeerProfile]] = []
        for c, n in zip(ordered, counts):
            if n > len(clusters[c]):
                return None
            groups.extend(_balanced_groups(clusters[c], n))
        return groups
    flat = [p for c in ordered for p in sorted(clusters[c], key=lambda p: (-p.flops, p.id))]
    return _contiguous_groups(flat, k)


def cut_for(
    costs: DagCosts, groups: list[list[PeerProfile]], network: Network, options: Options
) -> tuple[int, ...] | None:
    """The bottleneck cut (``bottleneck_cut``) for these stage groups, in pipeline order."""
    m = options.micro_batches
    ids = [[p.id for p in g] for g in groups]
    return bottleneck_cut(costs, group_models(groups, network, m), boundary_models(ids, network, m), options)


def bottleneck_cut(
    costs: DagCosts, stages: list[GroupModel], links: list[BoundaryModel], options: Options
) -> tuple[int, ...] | None:
    """Cut positions minimizing the slowest stage or link (binary search on the bound;
    each stage takes the most ops it can run within the bound and its memory, and
    ends at the furthest position whose boundary tensors cross the link in time,
    compressed as far as ``FLOOR`` where allowed; under 1F1B also where the round
    trip to the next stage and back, that stage taken at the bound, keeps up: see
    ``_Cutter``). None: nothing fits."""
    k = len(stages)
    if k == 1:
        return () if stages[0].fits(costs, 0, costs.num_ops) else None
    cutter = _Cutter(costs, stages, links, options)
    if cutter.latest is None:
        return None
    ceiling = 2 * cutter.ceiling() + 1e-9
    if cutter.attempt(ceiling) is None:
        return None  # memory
    low = high = max(balanced_period(costs, stages), ceiling * 1e-9)
    best = None
    while best is None:  # the first bound that cuts, growing from perfect balance
        high = min(high * GROWTH, ceiling)
        best = cutter.attempt(high)
        low = high if best is None else low
    for _ in range(BISECTIONS):
        mid = (low + high) / 2
        got = cutter.attempt(mid)
        if got is None:
            low = mid
        else:
            best, high = got, mid
    return best


class _Cutter:
    """One bottleneck-cut search: ``attempt(bound)`` cuts greedily within a bound.

    A 1F1B stage ``s`` holds ``w_s`` micro-batches and the next ``w_s - gap``: the
    round trip from ``s`` to ``s + 1`` and back (both stages' work and both ways of
    the link) carries ``gap + 1`` micro-batches (the estimator's ``_round_trips``),
    so with the next stage as busy, keeping up needs ``2 * latency_s + link both ways
    <= (gap + 1) * bound``. A boundary where fewer bytes cross may end a stage earlier.

    Each allowed end of a stage has the least bound its link needs there (steady
    bytes and that round trip), per wire table: uncompressed first, then ``FLOOR``."""

    def __init__(self, costs: DagCosts, stages: list[GroupModel], links: list[BoundaryModel],
                 options: Options) -> None:  # fmt: skip
        self.costs, self.stages, self.k = costs, stages, len(stages)
        self.least = costs.min_stage_flops(self.k)  # no empty stage
        self.positions = boundary_positions(costs)
        allowed = costs.cached("allowed", lambda: np.array(self.positions, dtype=np.int64))
        self.latest = costs.cached(("latest", self.k), lambda: _latest_boundaries(costs, self.positions, self.k,
                                                                                   self.least))  # fmt: skip
        plain = costs.cached("plain", lambda: np.array(costs.cross_bytes, dtype=np.float64)[allowed])
        codec = FLOOR if options.compression else Codec()
        floor = costs.cached(
            ("floor", str(codec)), lambda: np.array(costs.wire_table(codec), dtype=np.float64)[allowed]
        )
        self.allowed = allowed
        gaps = [a.window - b.window if b.window else 0 for a, b in zip(stages, stages[1:])]
        #: per stage s and table: (the bound its link's bytes need, its round trip's link part, divisor or 0)
        self.links = [[(t * link.per_byte(), _both_ways(link, t), gap + 1 if gap else 0) for t in (plain, floor)]
                      for link, gap in zip(links, gaps)]  # fmt: skip
        self.rows: dict[tuple[int, int], tuple[np.ndarray, int, list[np.ndarray]]] = {}

    def ceiling(self) -> float:
        """A bound every cut that fits memory meets."""
        n = self.costs.num_ops
        worst_link = max(float(bytes_.max()) + float(trip.max()) for per in self.links for bytes_, trip, _ in per)
        return max(st.latency(self.costs, 0, n) + st.period(self.costs, 0, n) for st in self.stages) + worst_link

    def row(self, s: int, lo: int) -> tuple[np.ndarray, int, list[np.ndarray]]:
        """Stage s's period for every end, the furthest end whose memory fits, and
        (not for the last stage) the bound each allowed end needs, per table."""
        if (s, lo) not in self.rows:
            periods, fits, latency = self.stages[s].reach(self.costs, lo)
            rest = fits[lo:]
            fit_end = lo + (len(rest) if rest.all() else int(np.argmin(rest))) - 1
            needs = []
            if s < self.k - 1:
                there = 2 * latency[self.allowed]
                needs = [np.maximum(b, (there + trip) / div) if div else b for b, trip, div in self.links[s]]
            self.rows[(s, lo)] = (periods, fit_end, needs)
        return self.rows[(s, lo)]

    def end(self, s: int, lo: int, bound: float) -> int | None:
        """Where stage s (from ``lo``) ends within the bound: the furthest allowed
        position (within its time, its memory, and room for the later stages) whose
        link keeps up, uncompressed if one does, else at ``FLOOR``."""
        periods, fit_end, needs = self.row(s, lo)
        limit = min(self.latest[s], fit_end)  # type: ignore[index]
        hi = lo + int(np.searchsorted(periods[lo : limit + 1], bound, side="right")) - 1
        a, z = bisect.bisect_right(self.positions, lo), bisect.bisect_right(self.positions, hi)
        for need in needs:
            for x, y in ((max(a, z - SCAN), z), (a, max(a, z - SCAN))):  # near the end first
                hits = np.flatnonzero(need[x:y] <= bound)
                if hits.size:
                    return self.positions[x + int(hits[-1])]
        return None

    def attempt(self, bound: float) -> tuple[int, ...] | None:
        """The greedy cut within ``bound`` (None: none fits)."""
        out: list[int] = []
        lo = 0
        for s in range(self.k - 1):
            chosen = self.end(s, lo, bound)
            if chosen is None or self.costs.stage_flops(lo, chosen) < self.least:
                return None
            out.append(chosen)
            lo = chosen
        periods, fit_end, _ = self.row(self.k - 1, lo)
        n = self.costs.num_ops
        if periods[n] > bound or fit_end < n or self.costs.stage_flops(lo, n) < self.least:
            return None
        return tuple(out)


def _both_ways(link: BoundaryModel, nbytes: np.ndarray) -> np.ndarray:
    """A micro-batch's bytes over ``link`` and back (its slowest pair), at every position."""
    return 2 * np.max([lat + nbytes * spb for _, lat, spb in link.pairs], axis=0)


def _latest_boundaries(costs: DagCosts, allowed: list[int], k: int, least: float) -> list[int] | None:
    """The furthest each of ``k - 1`` boundaries may go and still leave every later
    stage at least ``least`` FLOPs (None: ``k`` such stages do not exist)."""
    out: list[int] = []
    end = costs.num_ops
    for _ in range(k - 1):
        p = bisect.bisect_right(costs._pf, costs._pf[end] - least) - 1  # the last start that leaves enough
        i = bisect.bisect_right(allowed, min(p, end - 1)) - 1
        if i < 0:
            return None
        end = allowed[i]
        out.append(end)
    return out[::-1]


#: the cut search looks at this many positions below a stage's furthest end first
SCAN = 64
#: the bottleneck bound grows by this factor from perfect balance until a cut fits,
#: then is halved between the last two tries this many times (to a 4,000th)
GROWTH = 2.0
BISECTIONS = 12
#: the refinement treats positions whose prefix FLOPs differ by at most this fraction
#: of the model's count as the same split of the compute, and takes the one where
#: the fewest bytes cross (in a transformer: right after a residual add, where only
#: the residual stream crosses, not after the next LayerNorm, where its output does too)
TIE_FLOPS = 1e-3
#: and only this many positions away are tried as ties (planning time on large graphs)
TIE_REACH = 16


def _proportional_cut(costs: DagCosts, weights: list[float]) -> tuple[int, ...]:
    """Cut so stage FLOPs follow ``weights`` (the tied-weight rule respected)."""
    allowed = boundary_positions(costs)
    total = costs.total_flops
    out: list[int] = []
    share = 0.0
    k = len(weights)
    for s in range(k - 1):
        share += weights[s] / sum(weights)
        goal = bisect.bisect_right(costs._pf, share * total) - 1
        lo = out[-1] + 1 if out else 1
        hi = allowed[len(allowed) - (k - 1 - s)] if len(allowed) >= k - 1 - s else costs.num_ops - 1
        pos = nearest_allowed(allowed, min(max(goal, lo), hi), lo, hi)
        if pos is None:
            raise ScheduleError(f"no room for {k} stages between tied weights")
        out.append(pos)
    return tuple(out)


def choose_codecs(costs: DagCosts, plan_: Plan, network: Network, options: Options) -> list[Codec]:
    """The codec ``auto`` puts on each edge slower than the slowest stage: just enough
    to keep up (none without ``options.compression``)."""
    if not options.compression:
        return [Codec()] * len(plan_.cut)
    codecs = []
    bound = max(plan_.stage_s) if plan_.stage_s else 0.0
    m = options.micro_batches
    for pos, edge in zip(plan_.cut, boundary_models(plan_.groups, network, m)):
        mbps = 8 / max(edge.per_byte() * edge.rounds / m * 1e6, 1e-30)  # per micro-batch, as stage_s
        floating = costs.float_cross[pos]
        other = costs.cross_bytes[pos] - floating
        codecs.append(edge_price(floating, other, costs.cross_cols[pos], mbps, bound, None, costs.float_itemsize).codec)
    return codecs


def _groupings(ordered: list[str], clusters: dict[str, list[PeerProfile]], k: int) -> list[list[list[PeerProfile]]]:
    """Candidate stage groups for ``k`` stages: stages apportioned to clusters (in
    pipeline order and reversed), and runs of the cluster-ordered peers."""
    out = []
    for order in (ordered, ordered[::-1]):
        g = _stage_groups(order, clusters, k)
        if g is not None and all(g):
            out.append(g)
        flat = [p for c in order for p in sorted(clusters[c], key=lambda p: (-p.flops, p.id))]
        if k <= len(flat):
            out.append(_contiguous_groups(flat, k))
        if len(flat) <= SMALL_SWARM:  # small swarms: every run of consecutive peers
            for bounds in itertools.combinations(range(1, len(flat)), k - 1):
                edges = (0, *bounds, len(flat))
                out.append([flat[a:b] for a, b in zip(edges, edges[1:])])
    unique = []
    for g in out:
        key = [[p.id for p in grp] for grp in g]
        if all(key != [[p.id for p in grp] for grp in u] for u in unique):
            unique.append(g)
    return unique


def evaluate(costs: DagCosts, cut: tuple[int, ...], ids: list[list[str]], by_id: dict[str, PeerProfile],
             network: Network, options: Options, name: str = "opfence", revert: bool = True) -> Plan:  # fmt: skip
    """The plan of stage groups ``ids`` cut at ``cut``, with the codecs the swarm would
    put on its links (each kept only where it reaches the loss sooner than none: with
    ``revert``, else all or none), and its predicted times: every scheduler finishes
    its plans here."""
    m = options.micro_batches
    best = predict(costs, Plan(cut, ids, [Codec()] * len(cut), name), by_id, network, m)
    codecs = choose_codecs(costs, best, network, options)
    if all(c.name == "none" for c in codecs):
        return best
    squeezed = predict(costs, Plan(cut, ids, codecs, name), by_id, network, m)
    for b in [b for b, c in enumerate(codecs) if c.name != "none" and revert]:
        trial = predict(costs, Plan(cut, ids, [*squeezed.codecs[:b], Codec(), *squeezed.codecs[b + 1 :]], name),
                        by_id, network, m)  # fmt: skip
        squeezed = trial if trial.to_loss_s < squeezed.to_loss_s else squeezed
    return squeezed if squeezed.to_loss_s < best.to_loss_s else best


def _better(a: Plan, b: Plan | None) -> bool:
    return b is None or rank(a) < rank(b)


def rank(p: Plan) -> tuple[bool, float]:
    """How schedulers order plans: valid ones first, then by time to the loss."""
    return (not p.valid, p.to_loss_s)


#: the boundary hill-climb: rounds over every boundary, and positions tried each way
REFINE_ROUNDS = 3
REFINE_REACH = 3


def _refine(costs: DagCosts, start: Plan, by_id: dict[str, PeerProfile], network: Network, options: Options,
            reach: int) -> Plan:  # fmt: skip
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


def opfence(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options = Options()) -> Plan:
    by_id = PeerTable(peers)
    clusters: dict[str, list[PeerProfile]] = {}
    for p in peers:
        clusters.setdefault(network.cluster_of.get(p.id, p.cluster), []).append(p)
    ordered = order_clusters(network, clusters)
    shapes = []
    for pool_order, pool in _pools(ordered, clusters, network, options):
        pool_peers = [p for c in pool_order for p in pool[c]]
        if options.stages is not None and len(pool_peers) < options.stages and len(pool_peers) < len(peers):
            continue  # a standby pool too small for the stages asked for
        shapes += [g for k in _candidate_stages(costs, pool_peers, options) for g in _groupings(pool_order, pool, k)]
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


def _best_first(costs: DagCosts, shapes: list[list[list[PeerProfile]]], by_id: PeerTable, network: Network,
                options: Options, beat: float) -> list[Plan]:  # fmt: skip
    """The plans of these stage groupings (each cut by ``cut_for``), in the order of
    their ``plan_floor``, until no grouping left can beat the best valid plan found
    (or ``beat``): branch and bound. Groupings the estimator cannot tell apart are
    cut once (``_alike``)."""
    keyed = {_alike(groups, network): groups for groups in shapes}
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


def _alike(groups: list[list[PeerProfile]], network: Network) -> tuple[tuple[Any, ...], ...]:
    """What the estimator sees of a grouping: each member's cluster and figures, in
    order (peer ids where single links were measured: then any two peers may differ)."""
    if network.overrides:
        return tuple(tuple(p.id for p in g) for g in groups)
    return tuple(tuple((network.cluster_of.get(p.id, p.cluster), p.flops, p.memory_bytes, p.op_overhead_s)
                       for p in g) for g in groups)  # fmt: skip


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


def balanced_period(costs: DagCosts, models: list[GroupModel]) -> float:
    """No cut's slowest stage is faster: each stage's period is at least its fixed
    part, and at least its seconds per FLOP (per kernel, per parameter byte) times
    the FLOPs (kernels, bytes) it takes, which add up to the model's, so the slowest
    takes at least that total over the sum of the stages' inverse rates."""
    n = costs.num_ops
    units = np.array([st.per_unit() for st in models])
    bound = float(units[:, 3].max())
    for d, total in enumerate((costs.stage_flops(0, n), costs.stage_kernels(0, n), costs.stage_params(0, n))):
        if (units[:, d] > 0).all():
            bound = max(bound, total / float((1 / units[:, d]).sum()))
    return bound


#: rounds of OP-Fence's peer-move search (each takes the best single move, if it
#: gains at least ``MOVE_GAIN``)
MOVE_ROUNDS = 2
MOVE_GAIN = 1.005


def _peer_moves(costs: DagCosts, start: Plan, peers: list[PeerProfile], by_id: PeerTable, network: Network,
                options: Options) -> Plan:  # fmt: skip
    """A bounded local search over who runs the stages (the pools and stage counts
    only try shapes in proportion to compute): move one stage to the front, to the
    back or one place later, take one peer out, or put in one
    standby peer (each cluster's fastest) as a stage of its own after its cluster's
    last stage, or as a replica of a stage of its cluster; every move re-cut by
    ``cut_for``. The best move per round while it gains ``MOVE_GAIN``,
    ``MOVE_ROUNDS`` at most."""
    best = start
    for _ in range(MOVE_ROUNDS):
        moves = _moves([[by_id[i] for i in g] for g in best.groups], peers, network, options)
        gain = best.to_loss_s / MOVE_GAIN if best.valid else math.inf
        top = min(_best_first(costs, moves, by_id, network, options, gain), key=rank, default=None)
        if top is None or rank(top) >= (not best.valid, gain):
            break
        best = top
    return best


def _cut_and_evaluate(costs: DagCosts, groups: list[list[PeerProfile]], by_id: PeerTable, network: Network,
                      options: Options) -> Plan | None:  # fmt: skip
    cut = cut_for(costs, groups, network, options)
    return None if cut is None else evaluate(costs, cut, [[p.id for p in g] for g in groups], by_id, network, options)


def _moves(groups: list[list[PeerProfile]], peers: list[PeerProfile], network: Network,
           options: Options) -> list[list[list[PeerProfile]]]:  # fmt: skip
    """Every stage grouping one peer away from ``groups`` (see ``_peer_moves``)."""
    keep_k = options.stages is not None
    out = []
    for s, g in enumerate(groups if options.standby else []):  # every peer plans without standby
        for i in range(len(g)):
            rest = g[:i] + g[i + 1 :]
            if rest or (not keep_k and len(groups) > 1):
                out.append(groups[:s] + ([rest] if rest else []) + groups[s + 1 :])
    for s in range(len(groups)):  # stage order: a stage to the front, to the back, or one later
        rest = groups[:s] + groups[s + 1 :]
        out += [
            [groups[s], *rest],
            [*rest, groups[s]],
            groups[:s] + groups[s + 1 : s + 2] + [groups[s]] + groups[s + 2 :],
        ]
    home = {p.id: network.cluster_of.get(p.id, p.cluster) for p in peers}
    used = {p.id for g in groups for p in g}
    spare: dict[str, PeerProfile] = {}
    for p in _fastest([p for p in peers if p.id not in used]):
        spare.setdefault(home[p.id], p)
    for cluster, p in spare.items():
        mine = [s for s, g in enumerate(groups) if any(home[q.id] == cluster for q in g)]
        for s in mine:
            out.append(groups[:s] + [[*groups[s], p]] + groups[s + 1 :])
        if not keep_k and mine and len(groups) < options.max_stages:
            out.append(groups[: mine[-1] + 1] + [[p]] + groups[mine[-1] + 1 :])
    return out


def _pools(ordered: list[str], clusters: dict[str, list[PeerProfile]], network: Network, options: Options):  # type: ignore[no-untyped-def]
    """The peer pools OP-Fence plans with: every peer, and (with ``standby``) the first
    1, 2, 4, ... clusters in pipeline order, the 1, 2, 3, ... clusters with the most
    FLOP/s and each of them alone, the fastest 1, 2, 4, ... peers of the first and of the strongest cluster,
    and the fastest 1, 2, 4, ... peers of the swarm; the rest wait on standby (fast
    links beat more GPUs behind slow ones). Each pool once, its clusters in pipeline order."""
    seen: set[frozenset[str]] = set()
    for pool in _pool_candidates(ordered, clusters, options):
        key = frozenset(p.id for peers in pool.values() for p in peers)
        if key and key not in seen:
            seen.add(key)
            yield (ordered if len(pool) == len(clusters) else order_clusters(network, pool)), pool


def _pool_candidates(ordered: list[str], clusters: dict[str, list[PeerProfile]], options: Options):  # type: ignore[no-untyped-def]
    yield clusters
    if not options.standby:
        return
    strongest = sorted(clusters, key=lambda c: (-sum(p.flops for p in clusters[c]), c))
    for j in _doubling(len(ordered)):
        yield {c: clusters[c] for c in ordered[:j]}
    for j in range(1, min(len(strongest), SMALL_SWARM) + 1):
        yield {c: clusters[c] for c in strongest[:j]}
        yield {strongest[j - 1]: clusters[strongest[j - 1]]}
    for c in {ordered[0], strongest[0]}:
        first = _fastest(clusters[c])
        for m in _doubling(len(first)):
            yield {c: first[:m]}
    everyone = _fastest([p for peers in clusters.values() for p in peers])
    home = {p.id: c for c, peers in clusters.items() for p in peers}
    for m in _doubling(len(everyone)):
        pool: dict[str, list[PeerProfile]] = {}
        for p in everyone[:m]:
            pool.setdefault(home[p.id], []).append(p)
        yield pool


def _fastest(peers: list[PeerProfile]) -> list[PeerProfile]:
    return sorted(peers, key=lambda p: (-p.flops, p.id))


def _doubling(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``."""
    out, j = [], 1
    while j < n:
        out.append(j)
        j *= 2
    return out


def _set_partitions(items: list[PeerProfile]):  # type: ignore[no-untyped-def]
    """Every split of ``items`` into unordered non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def _tiny_candidates(costs: DagCosts, peers: list[PeerProfile], by_id: dict[str, PeerProfile], network: Network,
                     options: Options) -> list[Plan]:  # fmt: skip
    """Tiny swarms: every grouping of the peers, in every stage order (up to 24)."""
    out = []
    limit = len(boundary_positions(costs)) + 1
    for part in _set_partitions(sorted(peers, key=lambda p: p.id)):
        if len(part) > limit:
            continue
        for order in itertools.islice(itertools.permutations(part), 24):
            groups = list(order)
            cut = cut_for(costs, groups, network, options)
            if cut is not None:
                out.append(evaluate(costs, cut, [[p.id for p in g] for g in groups], by_id, network, options))
    return out
