"""The workload estimator: what a plan costs, predicted from the OP-DAG's per-op
costs, the peers' measured FLOP/s and memory, and the links' bandwidth and
latency. Pure functions of a snapshot; the scheduler, the swarm and ``sim/`` all
call the same code.

Time model of one training iteration (``M`` micro-batches, 1F1B):

- stage ``s`` on peer group ``G``: per micro-batch ``3 x F_s / sum(FLOP/s of G)``
  (forward plus a backward of twice its cost; replicas share the micro-batches);
- cut edge ``s -> s+1``: per micro-batch and direction ``latency + wire bytes /
  bandwidth``, the bandwidth being the slowest pair between the two groups times
  the number of pairs that can send at once; the codec shrinks floating bytes;
- replicas of a stage all-reduce their gradients once per iteration: ``2 x
  parameter bytes x (r - 1) / r`` over the slowest link inside the group;
- iteration: every stage and link once (pipeline fill and drain) plus ``M - 1``
  times the slowest of them (the steady state), plus the slowest all-reduce.

``lower_bound_s`` is ``3 x M x total FLOPs / total FLOP/s of all peers``: no plan
on these peers can beat perfect compute balance with free communication.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol.codecs import Codec

#: Adam keeps weights, gradients and two moments: 4 bytes of state per parameter byte
STATE_PER_PARAM_BYTE = 4


@dataclass
class DagCosts:
    """Per-op costs in topological order; ``cross_bytes[p]`` is what crosses a cut
    placed before op ``p`` (1 <= p < n), ``float_cross`` its compressible part."""

    flops: list[int]
    param_bytes: list[int]
    act_bytes: list[int]
    cross_bytes: list[int]
    float_cross: list[int]
    forbidden: frozenset[int] = frozenset()
    _pf: list[int] = field(default_factory=list, repr=False)
    _pp: list[int] = field(default_factory=list, repr=False)
    _pa: list[int] = field(default_factory=list, repr=False)
    _wire: dict[str, list[float]] = field(default_factory=dict, repr=False)  # codec -> wire bytes per position

    def __post_init__(self) -> None:
        n = len(self.flops)
        if not (len(self.param_bytes) == len(self.act_bytes) == n and len(self.cross_bytes) == len(self.float_cross)):
            raise ValueError("per-op cost lists differ in length")
        if len(self.cross_bytes) != n:
            raise ValueError("cross_bytes needs one entry per op (entry 0 unused)")
        self._pf, self._pp, self._pa = _prefix(self.flops), _prefix(self.param_bytes), _prefix(self.act_bytes)

    @property
    def num_ops(self) -> int:
        return len(self.flops)

    @property
    def total_flops(self) -> int:
        return self._pf[-1]

    def stage_flops(self, lo: int, hi: int) -> int:
        return self._pf[hi] - self._pf[lo]

    def stage_params(self, lo: int, hi: int) -> int:
        return self._pp[hi] - self._pp[lo]

    def stage_acts(self, lo: int, hi: int) -> int:
        return self._pa[hi] - self._pa[lo]

    def wire_table(self, codec: Codec) -> list[float]:
        """Wire bytes of a cut at every position under ``codec`` (computed once per codec)."""
        key = str(codec)
        if key not in self._wire:
            self._wire[key] = [wire_bytes(self, p, codec) for p in range(self.num_ops)]
        return self._wire[key]

    @classmethod
    def from_opdag(cls, dag: Any) -> DagCosts:
        """Costs of a traced :class:`coordinator.opdag.OpDag`; what crosses each cut
        position comes from every value's producer and last consumer."""
        from protocol.graph import operators

        ops = list(operators(dag.gm))
        index = {n: i for i, n in enumerate(ops)}
        n = len(ops)
        diff = [0] * (n + 1)
        fdiff = [0] * (n + 1)
        for node in dag.gm.graph.nodes:
            if node.op == "placeholder":
                born = 0  # batch inputs reach stage 0 with the batch
            elif node in index:
                born = index[node] + 1
            else:
                continue
            users = [index[u] for u in node.users if u in index]
            if not users:
                continue
            last = max(users)
            if last >= born:  # crosses positions born .. last
                meta = dag.meta.get(node.name)
                nbytes = meta.nbytes if meta is not None else 0
                floating = nbytes if meta is not None and meta.dtype.startswith(("float", "bfloat")) else 0
                lo = max(born, 1)
                if last >= lo:
                    diff[lo] += nbytes
                    diff[last + 1] -= nbytes
                    fdiff[lo] += floating
                    fdiff[last + 1] -= floating
        cross, fcross, run, frun = [0] * n, [0] * n, 0, 0
        for p in range(n):
            run += diff[p]
            frun += fdiff[p]
            cross[p], fcross[p] = run, frun
        return cls(
            flops=[max(o.flops, 1) for o in dag.ops],
            param_bytes=[o.param_bytes for o in dag.ops],
            act_bytes=[o.out_bytes for o in dag.ops],
            cross_bytes=cross,
            float_cross=fcross,
            forbidden=frozenset(dag.forbidden),
        )

    @classmethod
    def synthetic(cls, num_ops: int, seed: int = 0, act_bytes: int = 1 << 20) -> DagCosts:
        """A chain of ops with random costs (for tests and benchmarks)."""
        rng = random.Random(seed)
        flops = [rng.randint(1, 100) * 10**7 for _ in range(num_ops)]
        params = [rng.choice([0, 0, rng.randint(1, 50) * 10**5]) for _ in range(num_ops)]
        cross = [0] + [rng.choice([1, 1, 2, 4]) * act_bytes for _ in range(num_ops - 1)]
        return cls(flops, params, [act_bytes] * num_ops, cross, list(cross))


def _prefix(xs: Iterable[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


@dataclass(frozen=True)
class PeerProfile:
    id: str
    flops: float  # measured FLOP/s
    memory_bytes: int
    cluster: str = ""


@dataclass(frozen=True)
class LinkInfo:
    mbps: float
    latency_s: float
    measured: bool


class Network:
    """Bandwidth and latency between peers: per cluster pair, with per-pair
    overrides; ``measured`` marks pairs somebody probed, the rest are inferred."""

    def __init__(
        self,
        cluster_of: dict[str, str],
        clusters: dict[tuple[str, str], tuple[float, float]],
        overrides: dict[tuple[str, str], tuple[float, float]] | None = None,
        measured: set[tuple[str, str]] | None = None,
        default: tuple[float, float] = (100.0, 0.05),
    ) -> None:
        self.cluster_of = cluster_of
        self.clusters = clusters
        self.overrides = overrides or {}
        self.measured = measured or set()
        self.default = default
        self._memo: dict[tuple[tuple[str, ...], tuple[str, ...]], LinkInfo] = {}

    def link(self, a: str, b: str) -> LinkInfo:
        if a == b:
            return LinkInfo(1e9, 0.0, True)
        got = self.overrides.get((a, b)) or self.overrides.get((b, a))
        if got is None:
            ca, cb = self.cluster_of.get(a, ""), self.cluster_of.get(b, "")
            got = self.clusters.get((ca, cb)) or self.clusters.get((cb, ca)) or self.default
        return LinkInfo(got[0], got[1], (a, b) in self.measured or (b, a) in self.measured)

    def group_link(self, xs: list[str], ys: list[str]) -> LinkInfo:
        """The slowest pair between two groups, times the pairs that can send at once."""
        sx, sy = tuple(_sample(xs)), tuple(_sample(ys))
        worst = self._memo.get((sx, sy))
        if worst is None:
            pairs = [self.link(x, y) for x in sx for y in sy]
            slowest = min(pairs, key=lambda link: link.mbps)
            worst = LinkInfo(slowest.mbps, max(p.latency_s for p in pairs), slowest.measured)
            self._remember((sx, sy), worst)
        return LinkInfo(worst.mbps * min(len(xs), len(ys)), worst.latency_s, worst.measured)

    def slowest_within(self, xs: list[str]) -> LinkInfo | None:
        if len(xs) < 2:
            return None
        sample = tuple(_sample(xs))
        got = self._memo.get((sample, ()))
        if got is None:
            pairs = [self.link(a, b) for i, a in enumerate(sample) for b in sample[i + 1 :]]
            got = min(pairs, key=lambda link: link.mbps)
            self._remember((sample, ()), got)
        return got

    def learn(self, a: str, b: str, link: LinkInfo) -> None:
        """Record a measured link between peers ``a`` and ``b`` (it overrides what was inferred)."""
        self.overrides[(a, b)] = (link.mbps, link.latency_s)
        self.overrides.pop((b, a), None)
        self.measured.add((a, b))
        self._memo.clear()

    def _remember(self, key: tuple[tuple[str, ...], tuple[str, ...]], value: LinkInfo) -> None:
        if len(self._memo) > 100_000:
            self._memo.clear()
        self._memo[key] = value

    @classmethod
    def infer(
        cls,
        peers: list[PeerProfile],
        probes: dict[tuple[str, str], tuple[float, float]],
        fast_ratio: float = 4.0,
    ) -> Network:
        """Fill in the matrix from a few probes per peer: peers joined by a link at
        least ``fast_ratio`` times the median probe form a cluster (unless the peers
        name their clusters); a cluster pair gets the median of its probes; pairs
        no probe connects get the median of all probes."""
        ids = [p.id for p in peers]
        median_mbps = statistics.median(m for m, _ in probes.values()) if probes else 100.0
        parent = {i: i for i in ids}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        named = {p.id: p.cluster for p in peers if p.cluster}
        if len(named) == len(ids):
            cluster_of = named
        else:
            for (a, b), (mbps, _) in probes.items():
                if a in parent and b in parent and mbps >= fast_ratio * median_mbps:
                    parent[find(a)] = find(b)
            cluster_of = {i: find(i) for i in ids}
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for (a, b), value in probes.items():
            if a in cluster_of and b in cluster_of:
                key = tuple(sorted((cluster_of[a], cluster_of[b])))
                samples.setdefault(key, []).append(value)  # type: ignore[arg-type]
        clusters = {
            k: (statistics.median(m for m, _ in v), statistics.median(lat for _, lat in v)) for k, v in samples.items()
        }
        lat = statistics.median(lt for _, lt in probes.values()) if probes else 0.05
        return cls(cluster_of, clusters, dict(probes), set(probes), default=(median_mbps, lat))


def _sample(xs: list[str], k: int = 8) -> list[str]:
    """A few members stand for a big group (deterministically)."""
    if len(xs) <= k:
        return xs
    step = len(xs) / k
    return [xs[int(i * step)] for i in range(k)]


@dataclass
class Plan:
    """Stage boundaries, the peers of each stage (replica order), the codec of each
    cut edge, and what the estimator predicts for it."""

    cut: tuple[int, ...]
    groups: list[list[str]]
    codecs: list[Codec]
    scheduler: str = ""
    iteration_s: float = math.inf
    lower_bound_s: float = 0.0
    stage_s: list[float] = field(default_factory=list)
    link_s: list[float] = field(default_factory=list)
    allreduce_s: list[float] = field(default_factory=list)
    fits_memory: bool = True

    def ranges(self, num_ops: int) -> list[tuple[int, int]]:
        bounds = (0, *self.cut, num_ops)
        return list(zip(bounds[:-1], bounds[1:]))

    def to_json(self, num_ops: int) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "iteration_s": self.iteration_s,
            "lower_bound_s": self.lower_bound_s,
            "fits_memory": self.fits_memory,
            "stages": [
                {"stage": s, "first_op": lo, "last_op": hi - 1, "peers": g, "seconds_per_micro_batch": t}
                for s, ((lo, hi), g, t) in enumerate(zip(self.ranges(num_ops), self.groups, self.stage_s))
            ],
            "links": [
                {"boundary": b, "after_op": self.cut[b] - 1, "codec": str(c), "seconds_per_micro_batch": t}
                for b, (c, t) in enumerate(zip(self.codecs, self.link_s))
            ],
            "allreduce_s": self.allreduce_s,
        }


class PeerTable(dict[str, PeerProfile]):
    """Peers by id, with their total FLOP/s summed once (do not mutate)."""

    def __init__(self, peers: Iterable[PeerProfile]) -> None:
        super().__init__((p.id, p) for p in peers)
        self.total_flops = sum(p.flops for p in self.values())


def lower_bound(costs: DagCosts, peers: dict[str, PeerProfile], micro_batches: int) -> float:
    total = peers.total_flops if isinstance(peers, PeerTable) else sum(p.flops for p in peers.values())
    return 3 * micro_batches * costs.total_flops / max(total, 1.0)


def wire_bytes(costs: DagCosts, position: int, codec: Codec) -> float:
    """Bytes on the wire per micro-batch and direction for a cut before ``position``."""
    floating = costs.float_cross[position]
    other = costs.cross_bytes[position] - floating
    if codec.name == "none" or floating == 0:
        return float(costs.cross_bytes[position])
    numel = floating // 4
    return other + codec.wire_bytes(numel, torch.float32) * (floating / max(numel * 4, 1))


def stage_seconds(costs: DagCosts, lo: int, hi: int, group: list[PeerProfile]) -> float:
    return 3 * costs.stage_flops(lo, hi) / max(sum(p.flops for p in group), 1.0)


def link_seconds(nbytes: float, link: LinkInfo) -> float:
    return link.latency_s + nbytes * 8 / max(link.mbps * 1e6, 1.0)


def stage_memory(costs: DagCosts, lo: int, hi: int, in_flight: int) -> int:
    return STATE_PER_PARAM_BYTE * costs.stage_params(lo, hi) + in_flight * costs.stage_acts(lo, hi)


def predict(
    costs: DagCosts,
    plan: Plan,
    peers: dict[str, PeerProfile],
    network: Network,
    micro_batches: int,
) -> Plan:
    """Fill in ``plan``'s predicted times (and memory fit); returns it."""
    k = len(plan.groups)
    ranges = plan.ranges(costs.num_ops)
    groups = [[peers[p] for p in g] for g in plan.groups]
    plan.stage_s = [stage_seconds(costs, lo, hi, g) for (lo, hi), g in zip(ranges, groups)]
    links = [network.group_link(plan.groups[b], plan.groups[b + 1]) for b in range(len(plan.cut))]
    plan.link_s = [link_seconds(wire_bytes(costs, pos, c), link) for pos, c, link in zip(plan.cut, plan.codecs, links)]
    plan.allreduce_s = []
    for (lo, hi), g in zip(ranges, plan.groups):
        inner = network.slowest_within(g)
        r = len(g)
        plan.allreduce_s.append(
            0.0 if inner is None else link_seconds(2 * costs.stage_params(lo, hi) * (r - 1) / r, inner)
        )
    busy = [t - link.latency_s for t, link in zip(plan.link_s, links)]
    steady = max(plan.stage_s + busy)  # latency overlaps in the steady state; bandwidth does not
    fill = sum(plan.stage_s) + 2 * sum(plan.link_s)
    plan.iteration_s = fill + (micro_batches - 1) * steady + max(plan.allreduce_s, default=0.0)
    plan.lower_bound_s = lower_bound(costs, peers, micro_batches)
    plan.fits_memory = all(
        stage_memory(costs, lo, hi, min(micro_batches, k - s)) <= min(p.memory_bytes for p in g)
        for s, ((lo, hi), g) in enumerate(zip(ranges, groups))
    )
    return plan


def boundary_positions(costs: DagCosts) -> list[int]:
    """Positions a cut may use (tied weights excluded)."""
    return [p for p in range(1, costs.num_ops) if p not in costs.forbidden]


def nearest_allowed(allowed: list[int], goal: int, lo: int, hi: int) -> int | None:
    """The allowed position closest to ``goal`` within [lo, hi]."""
    i = bisect.bisect_left(allowed, goal)
    best = None
    for j in (i - 1, i):
        if 0 <= j < len(allowed) and lo <= allowed[j] <= hi:
            if best is None or abs(allowed[j] - goal) < abs(best - goal):
                best = allowed[j]
    return best
