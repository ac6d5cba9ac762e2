"""Who serves which stage: the stage groupings OP-Fence cuts and evaluates. Clusters
in pipeline order (fast links between consecutive ones), stages apportioned to
clusters by FLOP/s and split into balanced replica groups, runs of peers, the
peer pools that leave the rest on standby, and the groupings one peer move away."""

from __future__ import annotations

import itertools
import math
from typing import Any

from coordinator.netmodel import Network, PeerProfile
from coordinator.plan_eval import Options

#: up to this many peers, OP-Fence tries every split of its peer order into stages
SMALL_SWARM = 8


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


def balanced_groups(peers: list[PeerProfile], k: int) -> list[list[PeerProfile]]:
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
            groups.extend(balanced_groups(clusters[c], n))
        return groups
    flat = [p for c in ordered for p in sorted(clusters[c], key=lambda p: (-p.flops, p.id))]
    return _contiguous_groups(flat, k)


def groupings(ordered: list[str], clusters: dict[str, list[PeerProfile]], k: int) -> list[list[list[PeerProfile]]]:
    """Candidate stage groups for ``k`` stages: stages apportioned to clusters (in
    pipeline order and reversed), and runs of the cluster-ordered peers; in small
    swarms also of all peers fastest first (the fastest peers as the first stage,
    whatever their clusters: where few micro-batches make the fill and the drain
    weigh, as under GPipe, the best plan can give a few fast peers most of the model)."""
    out = []
    flats = []
    for order in (ordered, ordered[::-1]):
        g = _stage_groups(order, clusters, k)
        if g is not None and all(g):
            out.append(g)
        flats.append([p for c in order for p in sorted(clusters[c], key=lambda p: (-p.flops, p.id))])
    if len(flats[0]) <= SMALL_SWARM:
        flats.append(sorted(flats[0], key=lambda p: (-p.flops, p.id)))
    for flat in flats:
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


def alike(groups: list[list[PeerProfile]], network: Network) -> tuple[tuple[Any, ...], ...]:
    """What the estimator sees of a grouping: each member's cluster and figures, in
    order (peer ids where single links were measured: then any two peers may differ)."""
    if network.overrides:
        return tuple(tuple(p.id for p in g) for g in groups)
    return tuple(
        tuple((network.cluster_of.get(p.id, p.cluster), p.flops, p.memory_bytes, p.op_overhead_s) for p in g)
        for g in groups
    )


def moves(
    groups: list[list[PeerProfile]], peers: list[PeerProfile], network: Network, options: Options
) -> list[list[list[PeerProfile]]]:
    """Every stage grouping one move away from ``groups`` (see ``_peer_moves``)."""
    home = {p.id: network.cluster_of.get(p.id, p.cluster) for p in peers}
    return [
        *_leave_outs(groups, home, options),
        *_reorders(groups, home),
        *_take_ins(groups, peers, home, options),
    ]


def _leave_outs(
    groups: list[list[PeerProfile]], home: dict[str, str], options: Options
) -> list[list[list[PeerProfile]]]:
    """One peer out, or every planned peer of one cluster out (with standby)."""
    keep_k = options.stages is not None
    out = []
    for s, g in enumerate(groups if options.standby else []):  # every peer plans without standby
        for i in range(len(g)):
            rest = g[:i] + g[i + 1 :]
            if rest or (not keep_k and len(groups) > 1):
                out.append(groups[:s] + ([rest] if rest else []) + groups[s + 1 :])
    planned = sorted({home[p.id] for g in groups for p in g})
    for cluster in planned if options.standby and not keep_k and len(planned) > 1 else []:
        kept = [[p for p in g if home[p.id] != cluster] for g in groups]
        out.append([g for g in kept if g])
    return out


def _reorders(groups: list[list[PeerProfile]], home: dict[str, str]) -> list[list[list[PeerProfile]]]:
    """One stage moved to the front or the back of the pipeline, one place either
    way, or to the start or the end of a run of stages of one cluster."""
    k = len(groups)
    first = [home[g[0].id] for g in groups]
    edges = {t for t in range(k) if t == 0 or first[t] != first[t - 1]}
    edges |= {t - 1 for t in edges if t} | {k - 1}
    out = []
    for s in range(k):
        rest = groups[:s] + groups[s + 1 :]
        for t in sorted(edges | {s - 1, s + 1}):
            if 0 <= t < k and t != s:
                out.append(rest[:t] + [groups[s]] + rest[t:])
    return out


def _take_ins(
    groups: list[list[PeerProfile]], peers: list[PeerProfile], home: dict[str, str], options: Options
) -> list[list[list[PeerProfile]]]:
    """A standby peer (each cluster's fastest) in: as a replica of a stage of its
    cluster, as a stage of its own after its cluster's last stage, or in place of
    a slower planned peer of its cluster (with standby)."""
    keep_k = options.stages is not None
    used = {p.id for g in groups for p in g}
    spare: dict[str, PeerProfile] = {}
    for p in fastest([p for p in peers if p.id not in used]):
        spare.setdefault(home[p.id], p)
    out = []
    for cluster, p in spare.items():
        mine = [s for s, g in enumerate(groups) if any(home[q.id] == cluster for q in g)]
        for s in mine:
            out.append(groups[:s] + [[*groups[s], p]] + groups[s + 1 :])
            out += [
                groups[:s] + [[p if q is old else q for q in groups[s]]] + groups[s + 1 :]
                for old in groups[s]
                if options.standby and home[old.id] == cluster and old.flops < p.flops
            ]
        if not keep_k and mine and len(groups) < options.max_stages:
            out.append(groups[: mine[-1] + 1] + [[p]] + groups[mine[-1] + 1 :])
    return out


def pools(ordered: list[str], clusters: dict[str, list[PeerProfile]], network: Network, options: Options):  # type: ignore[no-untyped-def]
    """The peer pools OP-Fence plans with: every peer, and (with ``standby``) the first
    1, 2, 4, ... clusters in pipeline order, the 1, 2, 3, ... clusters with the most
    FLOP/s and each of them alone, the fastest 1, 2, 4, ... peers of the first and of the strongest cluster,
    the fastest 1, 2, 4, ... peers of the swarm, and small groups joined by fast
    measured links (``link_pools``); the rest wait on standby (fast
    links beat more GPUs behind slow ones). Each pool once, its clusters in pipeline order."""
    seen: set[frozenset[str]] = set()
    everyone = [p for members in clusters.values() for p in members]
    linked = link_pools(everyone, network) if options.standby else []
    for pool in itertools.chain(_pool_candidates(ordered, clusters, options), linked):
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
        first = fastest(clusters[c])
        for m in _doubling(len(first)):
            yield {c: first[:m]}
    everyone = fastest([p for peers in clusters.values() for p in peers])
    home = {p.id: c for c, peers in clusters.items() for p in peers}
    for m in _doubling(len(everyone)):
        pool: dict[str, list[PeerProfile]] = {}
        for p in everyone[:m]:
            pool.setdefault(home[p.id], []).append(p)
        yield pool


#: link pools: grown from this many of the fastest measured pairs of peers, and as
#: many of the fastest pairs among the swarm's ``LINK_STRONG`` fastest peers
LINK_SEEDS = 8
LINK_STRONG = 8
#: measured pairs seed pools only when at least this many times the median measured link
LINK_FAST = 2.0
#: the sizes each link pool is grown to (peers)
LINK_SIZES = (2, 3, 4, 6, 8)


def link_pools(peers: list[PeerProfile], network: Network) -> list[dict[str, list[PeerProfile]]]:
    """Pools of peers joined by fast links, whatever their clusters: from each of the
    ``LINK_SEEDS`` fastest measured pairs (at least ``LINK_FAST`` times the median
    measured link or the link their clusters have) and of the fastest pairs among the ``LINK_STRONG`` peers of most
    FLOP/s (of two clusters: the cluster pools hold the others), grown one peer at
    a time by the fastest link from the pool to a peer outside it (measured, or to
    a strong peer), to each of ``LINK_SIZES`` peers. A pair of homes on one fibre
    is a pipeline of two no cluster pool holds."""
    by_id = {p.id: p for p in peers}
    index, measured = network.pair_links(), network.measured

    def known(a: str, b: str) -> bool:
        return (a, b) in measured or (b, a) in measured

    links = [(v[0], a, b) for a, row in index.items() for b, v in row.items() if a < b and b in by_id and known(a, b)]
    links = [x for x in links if x[1] in by_id]
    median = sorted(m for m, *_ in links)[len(links) // 2] if links else math.inf
    # fast beside the other measured links, or beside what the view says of the two
    # peers' clusters (homes-30: its four measured pairs all run at 1 Gbit/s, so none
    # was twice their median, and the 100 Mbit/s homes they join were never paired)
    fast = [x for x in links if x[0] >= LINK_FAST * min(median, network.inferred_mbps(x[1], x[2]))]
    fast.sort(key=lambda x: (-x[0], x[1], x[2]))
    strong = [p.id for p in fastest(peers)[:LINK_STRONG]]
    home = {p.id: network.cluster_of.get(p.id, p.cluster) for p in peers}
    among = [(network.link(a, b).mbps, a, b) for i, a in enumerate(strong) for b in strong[i + 1 :]]
    among = [x for x in among if home[x[1]] != home[x[2]]]
    seeds = fast[:LINK_SEEDS] + sorted(among, key=lambda x: (-x[0], x[1], x[2]))[:LINK_SEEDS]
    out = []
    for _, a, b in seeds:
        members = [a, b]
        while True:
            if len(members) in LINK_SIZES:
                pool: dict[str, list[PeerProfile]] = {}
                for pid in members:
                    pool.setdefault(home[pid], []).append(by_id[pid])
                out.append(pool)
            near = {q for m in members for q in index.get(m, {}) if q in by_id and known(m, q)} | set(strong)
            near -= set(members)
            if len(members) >= LINK_SIZES[-1] or not near:
                break
            members.append(max(sorted(near), key=lambda q: max(network.link(m, q).mbps for m in members)))
    return out


def fastest(peers: list[PeerProfile]) -> list[PeerProfile]:
    return sorted(peers, key=lambda p: (-p.flops, p.id))


def _doubling(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``."""
    out, j = [], 1
    while j < n:
        out.append(j)
        j *= 2
    return out


def set_partitions(items: list[PeerProfile]):  # type: ignore[no-untyped-def]
    """Every split of ``items`` into unordered non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
