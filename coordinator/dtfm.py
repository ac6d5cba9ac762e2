"""DT-FM as a baseline: an evolutionary search over peer-to-stage assignment in the
spirit of Together's DT-FM (Yuan et al. 2022), scored by the same estimator and
codecs as OP-Fence (``plan_eval.evaluate``), with a budget of distinct plans that
grows with the swarm (``budget``; or a time budget) and a seed. ``dtfm_search``
also says how long the search ran and whether it converged."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.baselines import (
    by_speed,
    fitting,
    grid,
    ids_of,
    pool_sizes,
    rank_or_none,
    snap,
    stage_counts,
    stage_limit,
)
from coordinator.cutter import cut_for, proportional_cut
from coordinator.estimator import DagCosts, PeerTable, Plan, boundary_positions
from coordinator.netmodel import Network, PeerProfile
from coordinator.placement import balanced_groups
from coordinator.plan_eval import Options, ScheduleError, evaluate

#: DT-FM's budget of distinct plans predicted per search: this many per unit its
#: genes place (``budget``), at least ``DTFM_EVALUATIONS`` and at most ``DTFM_MOST``
DTFM_PER_UNIT = 400
DTFM_EVALUATIONS = 2000
DTFM_MOST = 25_600
#: a search has converged when its best plan was found in the first this share of it
DTFM_CONVERGED = 0.5
#: DT-FM's genome has at most about this many genes: bigger swarms are searched as
#: units of similar-FLOP/s peers of one cluster that always move together
DTFM_UNITS = 64
#: and in those, each cluster's this many fastest peers are genes of their own
DTFM_SINGLES = 8
#: DT-FM's seed plans are also drawn from each of this many clusters of most FLOP/s
DTFM_CLUSTERS = 8
DTFM_POPULATION = 32
DTFM_ELITE = 4  # the best genomes carried unchanged into the next generation
DTFM_TOURNAMENT = 3  # genomes drawn per parent choice
DTFM_CROSSOVER = 0.7  # chance a child mixes two parents (else a copy of one)
DTFM_RETRIES = 8  # further mutations of a child that is no new genome
STANDBY = -1  # DT-FM's gene for a peer left out
DTFM_REACH = 3  # the final polish moves a boundary by up to this many positions
DTFM_POLISH_ROUNDS = 10  # and stops after this many rounds over the boundaries


Genome = tuple[int, ...]  # per unit: its stage index, or STANDBY


class _Dtfm:
    """The state of one DT-FM search: the units its genes place, the stage count
    range, a cache of predicted plans by genome, and the best plan so far."""

    def __init__(self, costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options) -> None:
        self.costs, self.network, self.options = costs, network, options
        self.by_id = PeerTable(peers)
        self.units = _units(peers, network, options.stages or 0)
        self.max_k = options.stages or stage_limit(costs, len(self.units), options)
        self.cache: dict[Genome, Plan | None] = {}
        self.best: Plan | None = None
        self.best_at = 0  # distinct genomes predicted when the best was found

    def score(self, genome: Genome) -> Plan | None:
        """The predicted plan of ``genome`` (the best of its ``bottleneck_cut``, its
        FLOP/s-proportional cut and that one ``snap``-ped); None if it has no stage
        or no cut."""
        if genome in self.cache:
            return self.cache[genome]
        groups = [[p for u, g in enumerate(genome) if g == s for p in self.units[u]] for s in range(max(genome) + 1)]
        plan = self._plan(groups) if groups else None
        self.cache[genome] = plan
        if plan is not None and rank_or_none(plan) < rank_or_none(self.best):
            self.best, self.best_at = plan, len(self.cache)
        return plan

    def _plan(self, groups: list[list[PeerProfile]]) -> Plan | None:
        ids = ids_of(groups)
        cuts = [cut_for(self.costs, groups, self.network, self.options)]
        try:
            even = proportional_cut(self.costs, [sum(p.flops for p in g) for g in groups])
            cuts += [even, snap(self.costs, even)]
        except ScheduleError:
            pass
        plans = [
            evaluate(self.costs, c, ids, self.by_id, self.network, self.options, "dtfm") for c in cuts if c is not None
        ]
        return min(plans, key=rank_or_none, default=None)

    def seeds(self) -> list[Genome]:
        """Simple plans to start from: the fastest 1, 2, 3, 4, 6, ... units (all of
        them included) FLOP/s-balanced into 1, 2, 3, 4, 6, ... stages, over the whole swarm
        and (with standby) within each of the ``DTFM_CLUSTERS`` clusters of most
        FLOP/s; and all units, cluster after cluster, in every count of runs of
        similar FLOP/s (stages that straddle as few clusters as they can), as DT-FM
        first groups devices by bandwidth."""
        profiles = [PeerProfile(str(u), sum(p.flops for p in unit), 0) for u, unit in enumerate(self.units)]
        pace = [(-profiles[u].flops / len(unit), len(unit), u) for u, unit in enumerate(self.units)]
        fastest = [profiles[u] for *_, u in sorted(pace)]
        home = [self.network.cluster_of.get(unit[0].id, unit[0].cluster) for unit in self.units]
        names = sorted(set(home), key=lambda c: (-sum(p.flops for h, p in zip(home, profiles) if h == c), c))
        by_cluster = [[q for q in fastest if home[int(q.id)] == c] for c in names]
        pools = [fastest] + (by_cluster[:DTFM_CLUSTERS] if self.options.standby else [])
        out = []
        for pool in pools:
            for m in pool_sizes(len(pool), self.options):
                for k in _stage_grid(self.options.stages, min(m, self.max_k)):
                    out.append(self._genome(balanced_groups(pool[:m], k)))
        in_order = [q for pool in by_cluster for q in pool]
        out += [self._genome(_runs(in_order, k)) for k in stage_counts(self.costs, len(in_order), self.options)]
        return list(dict.fromkeys(out))

    def _genome(self, groups: list[list[PeerProfile]]) -> Genome:
        """The genome placing unit-profile groups (ids are unit indices) as stages in order."""
        genes = [STANDBY] * len(self.units)
        for s, group in enumerate(groups):
            for unit in group:
                genes[int(unit.id)] = s
        return tuple(genes)

    def normal(self, genes: list[int], rng: random.Random) -> Genome | None:
        """Stage indices renumbered 0, 1, ... in order; with forced stages, empty
        ones refilled from standby units or from stages of several units."""
        if self.options.stages is None:
            used = sorted({g for g in genes if g != STANDBY})
            rename = {g: i for i, g in enumerate(used)}
            return tuple(rename.get(g, STANDBY) for g in genes)
        for s in range(self.options.stages):
            if s not in genes:
                counts = {g: genes.count(g) for g in set(genes)}
                donors = [u for u, g in enumerate(genes) if g == STANDBY or counts[g] > 1]
                if not donors:
                    return None
                genes[rng.choice(donors)] = s
        return tuple(genes)


def _units(peers: list[PeerProfile], network: Network, stages: int) -> list[list[PeerProfile]]:
    """What DT-FM's genes place: every peer alone in swarms of up to ``DTFM_UNITS``
    peers (or forced ``stages``); in bigger ones, each cluster's ``DTFM_SINGLES``
    fastest peers alone and the rest, fastest first, in runs of 2, 4, 8, ... peers
    (at most ``n / DTFM_UNITS``): the fast peers of a cluster can form a pipeline
    of their own, and the rest move in blocks."""
    most = max(DTFM_UNITS, stages)
    if len(peers) <= most:
        return [[p] for p in by_speed(peers)]
    cap = math.ceil(len(peers) / most)
    out = []
    for members in _clusters(peers, network).values():
        out.extend([p] for p in members[:DTFM_SINGLES])
        i, size = DTFM_SINGLES, 2
        while i < len(members):
            out.append(members[i : i + size])
            i += size
            size = min(cap, 2 * size)
    return out


def _clusters(peers: list[PeerProfile], network: Network) -> dict[str, list[PeerProfile]]:
    """Peers by cluster, fastest first, the clusters by name."""
    out: dict[str, list[PeerProfile]] = {}
    for p in by_speed(peers):
        out.setdefault(network.cluster_of.get(p.id, p.cluster), []).append(p)
    return dict(sorted(out.items()))


def _runs(items: list[PeerProfile], k: int) -> list[list[PeerProfile]]:
    """``items`` in order, split into ``k`` non-empty runs of similar total FLOP/s."""
    total = sum(p.flops for p in items)
    runs: list[list[PeerProfile]] = [[]]
    acc = 0.0
    for i, p in enumerate(items):
        due = total * len(runs) / k  # where the current run should end
        if runs[-1] and len(runs) < k and (acc + p.flops / 2 > due or len(items) - i <= k - len(runs)):
            runs.append([])
        runs[-1].append(p)
        acc += p.flops
    return runs


def _stage_grid(forced: int | None, top: int) -> list[int]:
    """Stage counts for seed plans: the ``grid`` up to ``top`` (or only the forced count)."""
    if forced is not None:
        return [forced] if forced <= top else []
    return grid(top)


def budget(peers: list[PeerProfile], network: Network, options: Options) -> int:
    """Distinct plans a search predicts by default: ``DTFM_PER_UNIT`` per unit its
    genes place, within ``DTFM_EVALUATIONS`` and ``DTFM_MOST`` (a bigger swarm has
    more to search; 2,000 plans left a 30-peer search at its seed plans)."""
    units = len(_units(peers, network, options.stages or 0))
    return min(max(DTFM_PER_UNIT * units, DTFM_EVALUATIONS), DTFM_MOST)


@dataclass(frozen=True)
class DtfmRun:
    """One search: its plan, its budget, the distinct plans it predicted, and how
    many it had predicted when it found the best one."""

    plan: Plan
    budget: int
    evaluations: int
    best_at: int

    @property
    def converged(self) -> bool:
        """The best plan came in the first ``DTFM_CONVERGED`` of the search."""
        return self.best_at <= DTFM_CONVERGED * self.evaluations


def dtfm(
    costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options, evaluations: int | None = None
) -> Plan:
    """``dtfm_search``'s plan (the budget from the swarm's size unless ``evaluations``)."""
    return dtfm_search(costs, peers, network, options, evaluations).plan


def dtfm_search(
    costs: DagCosts,
    peers: list[PeerProfile],
    network: Network,
    options: Options,
    evaluations: int | None = None,
    seconds: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> DtfmRun:
    """A genetic search over peer-to-stage assignments, as Together's DT-FM (Yuan
    et al. 2022) searches device placements, scored by this project's estimator
    (``plan_eval.evaluate`` and ``scheduler.rank``: the predicted time to the loss
    with the swarm's codecs) instead of DT-FM's communication cost model. A genome gives each unit (a peer;
    in swarms over ``DTFM_UNITS`` peers, a run of similar peers of one cluster) a
    stage index or standby; stages keep their index order and are cut by
    ``bottleneck_cut`` (as OP-Fence cuts) and in proportion to FLOP/s (as is and
    ``snap``-ped), the best cut counting. The population starts from the simple
    plans of ``seeds`` (the fastest m units FLOP/s-balanced into k stages; per
    cluster; all units in cluster-pure runs) and random genomes; each generation keeps the
    ``DTFM_ELITE`` best and breeds the rest from tournament-chosen parents by
    uniform crossover and mutations (move a unit to another or a new stage, swap
    two units, toggle standby, swap two stages). It stops after ``evaluations``
    distinct genomes are predicted (``budget`` by default), or once ``seconds`` of
    ``clock`` have passed, takes the best valid plan, and polishes its
    boundaries (``_polish``, at most ``DTFM_POLISH_ROUNDS x boundaries x 2 x
    DTFM_REACH`` predictions more); ``options.seed`` seeds it."""
    if options.stages is not None and options.stages > stage_limit(costs, len(peers), options):
        raise ScheduleError(f"dtfm: {options.stages} stages need more peers or ops than there are")
    limit = evaluations if evaluations is not None else budget(peers, network, options)
    deadline = math.inf if seconds is None else clock() + seconds
    search = _Dtfm(costs, peers, network, options)
    rng = random.Random(options.seed)
    population = [g for g in search.seeds() if search.score(g) is not None]
    population = sorted(population, key=lambda g: rank_or_none(search.cache[g]))[:DTFM_POPULATION]
    while len(population) < DTFM_POPULATION and len(search.cache) < limit:
        genome = search.normal([_random_gene(rng, search.max_k, options) for _ in search.units], rng)
        if genome is not None:
            search.score(genome)
            population.append(genome)
    for _ in range(limit * 4 // DTFM_POPULATION):  # generations, bounded where few genomes are new
        if len(search.cache) >= limit or not population or clock() >= deadline:
            break
        population = _generation(search, population, rng, limit)
    best = fitting(search.best, "dtfm", peers, options)
    return DtfmRun(_polish(search, best), limit, len(search.cache), search.best_at)


def _polish(search: _Dtfm, plan: Plan) -> Plan:
    """``plan``'s boundaries hill-climbed on ``scheduler.rank``, up to
    ``DTFM_REACH`` positions a move, for at most ``DTFM_POLISH_ROUNDS`` rounds
    (the cuts a genome gets ignore pipeline fill and drain)."""
    costs, allowed = search.costs, set(boundary_positions(search.costs))
    best = plan
    for _ in range(DTFM_POLISH_ROUNDS):
        start = best
        for b in range(len(best.cut)):
            lo, hi = (best.cut[b - 1] if b else 0), (best.cut[b + 1] if b + 1 < len(best.cut) else costs.num_ops)
            for pos in sorted({best.cut[b] + d for d in range(-DTFM_REACH, DTFM_REACH + 1)} & allowed):
                if lo < pos < hi and pos != best.cut[b]:
                    cut = (*best.cut[:b], pos, *best.cut[b + 1 :])
                    cand = evaluate(costs, cut, best.groups, search.by_id, search.network, search.options, "dtfm")
                    if rank_or_none(cand) < rank_or_none(best):
                        best = cand
        if best is start:
            break
    return best


def _random_gene(rng: random.Random, max_k: int, options: Options) -> int:
    if options.standby and rng.random() < 0.25:
        return STANDBY
    return rng.randrange(max_k)


def _generation(search: _Dtfm, population: list[Genome], rng: random.Random, evaluations: int) -> list[Genome]:
    """The elite plus children bred from tournament-chosen parents (fewer once
    ``evaluations`` genomes have been predicted)."""
    ranked = sorted(population, key=lambda g: rank_or_none(search.cache[g]))
    nxt = ranked[:DTFM_ELITE]
    while len(nxt) < DTFM_POPULATION:
        a = min(rng.sample(ranked, min(DTFM_TOURNAMENT, len(ranked))), key=ranked.index)
        b = min(rng.sample(ranked, min(DTFM_TOURNAMENT, len(ranked))), key=ranked.index)
        genes = [x if rng.random() < 0.5 else y for x, y in zip(a, b)] if rng.random() < DTFM_CROSSOVER else list(a)
        child = _novel_child(search, genes, rng)
        if child is not None:
            search.score(child)
            nxt.append(child)
        if len(search.cache) >= evaluations:
            break
    return nxt


def _novel_child(search: _Dtfm, genes: list[int], rng: random.Random) -> Genome | None:
    """``genes`` mutated (1 + an exponential number of moves), and mutated further
    while that gives a genome already predicted, up to ``DTFM_RETRIES`` times (the
    budget buys distinct plans, and the population keeps its diversity)."""
    child = None
    for attempt in range(DTFM_RETRIES):
        for _ in range(1 + int(rng.expovariate(1.0)) if attempt == 0 else 1):
            _mutate(genes, rng, search.max_k, search.options)
        child = search.normal(list(genes), rng)
        if child is not None and child not in search.cache:
            return child
    return child


def _mutate(genes: list[int], rng: random.Random, max_k: int, options: Options) -> None:
    """One of DT-FM's moves, in place: move a unit, swap two units, toggle
    standby, or swap two stages (their order in the pipeline)."""
    u = rng.randrange(len(genes))
    kind = rng.randrange(4)
    if kind == 0:
        genes[u] = rng.randrange(max_k if options.stages else min(max_k, max(genes) + 2))
    elif kind == 1:
        v = rng.randrange(len(genes))
        genes[u], genes[v] = genes[v], genes[u]
    elif kind == 2 and options.standby:
        genes[u] = rng.randrange(max(genes) + 1 or 1) if genes[u] == STANDBY else STANDBY
    else:
        s, t = rng.randrange(max_k), rng.randrange(max_k)
        genes[:] = [t if g == s else s if g == t else g for g in genes]
