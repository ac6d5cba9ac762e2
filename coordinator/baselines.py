"""The baselines OP-Fence is measured against, on the same estimator: ``even``
(peers in the given order, equal op counts), ``compute`` (peers balanced by
FLOP/s regardless of bandwidth, ops split in proportion), ``random`` (seeded), and
``exhaustive``: the best plan over every grouping and cut, for tiny instances."""

from __future__ import annotations

import itertools
import random

from coordinator.estimator import DagCosts, Network, PeerProfile, PeerTable, Plan, boundary_positions, predict
from coordinator.scheduler import (
    Options,
    ScheduleError,
    _balanced_groups,
    _proportional_cut,
    choose_fractions,
)
from protocol.codecs import Codec


def _finish(costs: DagCosts, cut: tuple[int, ...], groups: list[list[PeerProfile]], name: str, network: Network,
            options: Options) -> Plan:  # fmt: skip
    ids = [[p.id for p in g] for g in groups]
    by_id = {p.id: p for g in groups for p in g}
    return predict(costs, Plan(cut, ids, [Codec()] * (len(groups) - 1), name), by_id, network, options.micro_batches)


def even(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options, k: int) -> Plan:
    """Peers in the given order, ``k`` runs of them; equal op counts per stage."""
    groups = [peers[i * len(peers) // k : (i + 1) * len(peers) // k] for i in range(k)]
    cut = _proportional_cut(DagCosts([1] * costs.num_ops, [0] * costs.num_ops, [0] * costs.num_ops,
                                     [0] * costs.num_ops, [0] * costs.num_ops, costs.forbidden), [1.0] * k)  # fmt: skip
    return _finish(costs, cut, groups, "even", network, options)


def compute(costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options, k: int) -> Plan:
    """FLOP/s-balanced groups and a FLOP-proportional cut; bandwidth ignored."""
    groups = _balanced_groups(peers, k)
    cut = _proportional_cut(costs, [sum(p.flops for p in g) for g in groups])
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
                cand = predict(costs, Plan(cut, ids, [Codec()] * (k - 1), "exhaustive"), by_id, network,
                               options.micro_batches)  # fmt: skip
                cand.codecs = choose_fractions(costs, cand, network, options)
                predict(costs, cand, by_id, network, options.micro_batches)
                if cand.fits_memory and (best is None or cand.iteration_s < best.iteration_s):
                    best = cand
    if best is None:
        raise ScheduleError("no plan fits memory")
    return best
