"""The swarm as the estimator sees it: each peer's compute profile, the links
between peers (bandwidth and latency, per cluster pair with per-pair overrides),
and the one rule that turns bytes into seconds on a link (``transfer_s``) and
back (``link_bytes``). Pure; the estimator, the scheduler, the codec choice, the
live coordinator and ``sim/`` all price links with these.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from coordinator.overheads import NONE, Overheads

#: eager PyTorch's fixed cost per operator kernel on a GPU (launch and dispatch), when
#: a topology does not say (``op_overhead_us`` per peer)
OP_OVERHEAD_S = 10e-6
#: the slowest a link is ever taken to be, in bit/s: a link measured or guessed at 0
#: still moves bytes, just very slowly (no division by zero)
MIN_BITS_PER_S = 1.0


def transfer_s(nbytes: float, mbps: float) -> float:
    """Seconds ``nbytes`` take on a link of ``mbps`` Mbit/s (latency not included)."""
    return nbytes * 8 / max(mbps * 1e6, MIN_BITS_PER_S)


def link_bytes(seconds: float, mbps: float) -> float:
    """Bytes a link of ``mbps`` Mbit/s moves in ``seconds`` (the inverse of ``transfer_s``)."""
    return seconds * max(mbps, MIN_BITS_PER_S / 1e6) * 1e6 / 8


def rate_mbps(seconds_per_byte: float) -> float:
    """The Mbit/s of a link that takes ``seconds_per_byte`` per byte (``transfer_s`` of
    one byte); an instant link (0) is infinitely fast."""
    return 8 / (seconds_per_byte * 1e6) if seconds_per_byte > 0 else math.inf


@dataclass(frozen=True)
class PeerProfile:
    id: str
    flops: float  # measured FLOP/s
    memory_bytes: int
    cluster: str = ""
    op_overhead_s: float = OP_OVERHEAD_S  # fixed cost per operator kernel
    overheads: Overheads = NONE  # the live swarm's fixed costs per compute call, message and step


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
        self._memo: dict[Any, Any] = {}

    def link(self, a: str, b: str) -> LinkInfo:
        if a == b:
            return LinkInfo(1e9, 0.0, True)
        got = self.overrides.get((a, b)) or self.overrides.get((b, a))
        if got is None:
            ca, cb = self.cluster_of.get(a, ""), self.cluster_of.get(b, "")
            got = self.clusters.get((ca, cb)) or self.clusters.get((cb, ca)) or self.default
        return LinkInfo(got[0], got[1], (a, b) in self.measured or (b, a) in self.measured)

    def inferred_mbps(self, a: str, b: str) -> float:
        """The Mbit/s the view gives peers ``a`` and ``b`` by their clusters alone,
        whatever was measured between the two."""
        return self._cluster_link(self.cluster_of.get(a, ""), self.cluster_of.get(b, ""))[0]

    def _cluster_link(self, ca: str, cb: str) -> tuple[float, float]:
        return self.clusters.get((ca, cb)) or self.clusters.get((cb, ca)) or self.default

    def pair_links(self) -> dict[str, dict[str, tuple[float, float]]]:
        """The per-pair overrides indexed by each end, (Mbit/s, latency s) (built once per change)."""
        index = self._memo.get("overrides")
        if index is None:
            index = {}
            for (a, b), value in self.overrides.items():
                index.setdefault(a, {})[b] = value
                index.setdefault(b, {}).setdefault(a, value)
            self._memo["overrides"] = index
        return index

    def slowest_sends(self, group: tuple[str, ...]) -> list[tuple[float, float]]:
        """For each member of ``group``: the latency and seconds per byte of its slowest
        link to another member (each the most of its links'), what sending one message to
        every other member at once costs, each over its own link. Exact: per cluster,
        the pairs overridden on their own."""
        key = ("slowest", group)
        got = self._memo.get(key)
        if got is None:
            counts: dict[str, int] = {}
            for b in group:
                c = self.cluster_of.get(b, "")
                counts[c] = counts.get(c, 0) + 1
            members, index = set(group), self.pair_links()
            got = []
            for a in group:
                ca = self.cluster_of.get(a, "")
                own = {b: v for b, v in index.get(a, {}).items() if b in members and b != a}
                left = dict(counts)
                for b in [a, *own]:
                    left[self.cluster_of.get(b, "")] -= 1
                links = [self._cluster_link(ca, c) for c, n in left.items() if n > 0] + list(own.values())
                lat = max((latency for _, latency in links), default=0.0)
                got.append((lat, max((transfer_s(1.0, mbps) for mbps, _ in links), default=0.0)))
            self._remember(key, got)
        return got

    def pairs(self, xs: tuple[str, ...], ys: tuple[str, ...], micro_batches: int) -> list[tuple[int, float, float]]:
        """The links micro-batches cross from group ``xs`` to group ``ys`` (micro-batch
        ``m`` from ``xs[m mod |xs|]`` to ``ys[m mod |ys|]``): (micro-batches, latency,
        seconds per byte), one entry per distinct kind of pair."""
        key = ("pairs", xs, ys, micro_batches)
        got = self._memo.get(key)
        if got is None:
            count: dict[tuple[str, str], int] = {}
            for m in range(micro_batches):
                pair = (xs[m % len(xs)], ys[m % len(ys)])
                count[pair] = count.get(pair, 0) + 1
            kinds: set[tuple[int, float, float]] = set()
            for (x, y), n in count.items():
                link = self.link(x, y)
                kinds.add((n, link.latency_s, transfer_s(1.0, link.mbps)))
            got = sorted(kinds)
            self._remember(key, got)
        return got

    def learn(self, a: str, b: str, link: LinkInfo) -> None:
        """Record a measured link between peers ``a`` and ``b`` (it overrides what was inferred)."""
        self.overrides[(a, b)] = (link.mbps, link.latency_s)
        self.overrides.pop((b, a), None)
        self.measured.add((a, b))
        self._memo.clear()

    def _remember(self, key: Any, value: Any) -> None:
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


def link_seconds(nbytes: float, link: LinkInfo) -> float:
    """One message of ``nbytes`` over ``link``: its latency and its transfer."""
    return link.latency_s + transfer_s(nbytes, link.mbps)


@dataclass
class BoundaryModel:
    """A cut edge's cost as a function of the bytes a micro-batch sends over it."""

    pairs: list[tuple[int, float, float]]  # (micro-batches, latency, seconds per byte)
    rounds: int

    def latency(self, nbytes: float) -> float:
        """One micro-batch over its slowest pair, each way."""
        return max(lat + nbytes * spb for _, lat, spb in self.pairs)

    def per_byte(self) -> float:
        """Steady-state seconds per round and per byte of a micro-batch (the busiest pair)."""
        return max(n * spb for n, _, spb in self.pairs) / self.rounds


def rounds_of(groups: list[list[str]], micro_batches: int) -> int:
    """Micro-batches of the busiest lane: the pipeline's steady state repeats that often."""
    return -(-micro_batches // min(len(g) for g in groups))


def boundary_models(groups: list[list[str]], network: Network, micro_batches: int) -> list[BoundaryModel]:
    """The cost model of every cut edge of a plan's stage groups (in pipeline order)."""
    rounds = rounds_of(groups, micro_batches)
    return [BoundaryModel(network.pairs(tuple(a), tuple(b), micro_batches), rounds) for a, b in zip(groups, groups[1:])]
