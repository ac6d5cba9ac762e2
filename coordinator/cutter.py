"""The bottleneck cut: given stage groups in pipeline order, where to cut the OP-DAG
so the slowest stage or link is as fast as possible (binary search on the bound,
a greedy cut within each bound: ``_Cutter``), and the proportional cut the
baselines use."""

from __future__ import annotations

import bisect

import numpy as np

from coordinator.estimator import (
    DagCosts,
    GroupModel,
    boundary_positions,
    group_models,
)
from coordinator.netmodel import BoundaryModel, Network, PeerProfile, boundary_models
from coordinator.plan_eval import Options, ScheduleError


def nearest_allowed(allowed: list[int], goal: int, lo: int, hi: int) -> int | None:
    """The allowed position closest to ``goal`` within [lo, hi]."""
    i = bisect.bisect_left(allowed, goal)
    best = None
    for j in (i - 1, i):
        if 0 <= j < len(allowed) and lo <= allowed[j] <= hi:
            if best is None or abs(allowed[j] - goal) < abs(best - goal):
                best = allowed[j]
    return best


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
    compressed as far as ``Options.strongest`` where allowed; under 1F1B also where the round
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


class _Cutter:
    """One bottleneck-cut search: ``attempt(bound)`` cuts greedily within a bound.

    A 1F1B stage ``s`` holds ``w_s`` micro-batches and the next ``w_s - gap``: the
    round trip from ``s`` to ``s + 1`` and back (both stages' work and both ways of
    the link) carries ``gap + 1`` micro-batches (``pipeline_latency.round_trips``),
    so with the next stage as busy, keeping up needs ``2 * latency_s + link both ways
    <= (gap + 1) * bound``. A boundary where fewer bytes cross may end a stage earlier.

    Each allowed end of a stage has the least bound its link needs there (steady
    bytes and that round trip), per wire table: uncompressed first, then ``Options.strongest``."""

    def __init__(self, costs: DagCosts, stages: list[GroupModel], links: list[BoundaryModel], options: Options) -> None:
        self.costs, self.stages, self.k = costs, stages, len(stages)
        self.least = costs.min_stage_flops(self.k)  # no empty stage
        self.positions = boundary_positions(costs)
        allowed = costs.cached("allowed", lambda: np.array(self.positions, dtype=np.int64))
        self.latest = costs.cached(
            ("latest", self.k), lambda: _latest_boundaries(costs, self.positions, self.k, self.least)
        )
        plain = costs.cached("plain", lambda: np.array(costs.cross_bytes, dtype=np.float64)[allowed])
        codec = options.strongest()
        floor = costs.cached(
            ("floor", str(codec)), lambda: np.array(costs.wire_table(codec), dtype=np.float64)[allowed]
        )
        self.allowed = allowed
        gaps = [a.window - b.window if b.window else 0 for a, b in zip(stages, stages[1:])]
        #: per stage s and table: (the bound its link's bytes need, its round trip's link part, divisor or 0)
        self.links = [
            [(t * link.per_byte(), _both_ways(link, t), gap + 1 if gap else 0) for t in (plain, floor)]
            for link, gap in zip(links, gaps)
        ]
        self.rows: dict[tuple[int, int], tuple[np.ndarray, int, list[np.ndarray]]] = {}

    def ceiling(self) -> float:
        """A bound every cut that fits memory meets."""
        n = self.costs.num_ops
        worst_link = max(float(bytes_.max()) + float(trip.max()) for per in self.links for bytes_, trip, _ in per)
        whole = [st.reach(self.costs, 0) for st in self.stages]  # the periods as ``row`` sees them
        return max(float(latency[n] + periods[n]) for periods, _, latency in whole) + worst_link

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
        link keeps up, uncompressed if one does, else at ``Options.strongest``."""
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


def proportional_cut(costs: DagCosts, weights: list[float]) -> tuple[int, ...]:
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
