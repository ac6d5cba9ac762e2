"""The simulator's side of planning that asks before it guesses
(``coordinator.asking``): its probe reads the true topology (as the probes the view
was inferred from do), and each asking is reported with how far the view was from
the truth on the finalists' links before the probes and after."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.asking import Asked, Pair, plan_asking, plan_pairs
from coordinator.estimator import DagCosts, Plan
from coordinator.netmodel import LinkInfo, Network, PeerProfile
from coordinator.plan_eval import Options


@dataclass(frozen=True)
class AskReport:
    """One planning that asked: ``probed`` links probed; ``error_before`` and
    ``error_after`` the view's error (``view_error``) on every finalist's links
    before the probes and after; ``changed`` whether the plan is another than the
    one chosen without asking; ``unasked`` that plan."""

    probed: int
    error_before: float
    error_after: float
    changed: bool
    unasked: Plan


def view_error(view: Network, truth: Network, pairs: Iterable[Pair]) -> float:
    """How far ``view``'s bandwidths are from ``truth``'s on ``pairs``: the geometric
    mean of each link's factor either way (1.0: exact; 2.0: typically off by 2x); 1.0
    for no pairs."""
    logs = [abs(math.log(view.link(a, b).mbps / truth.link(a, b).mbps)) for a, b in pairs]
    return math.exp(sum(logs) / len(logs)) if logs else 1.0


def snapshot(network: Network) -> Network:
    """A copy of ``network`` that later ``learn`` calls on it leave as it is."""
    return Network(
        network.cluster_of, network.clusters, dict(network.overrides), set(network.measured), network.default
    )


def ask(
    costs: DagCosts, peers: list[PeerProfile], view: Network, truth: Network, options: Options
) -> tuple[Asked, AskReport]:
    """OP-Fence asking on ``view`` (which learns what the probes measure), the probes
    read from ``truth``; and its report."""

    def probe(a: str, b: str) -> LinkInfo:
        link = truth.link(a, b)
        return LinkInfo(link.mbps, link.latency_s, True)

    before = snapshot(view)
    asked = plan_asking(costs, peers, view, options, probe)
    pairs = set().union(*(plan_pairs(p.groups) for p in asked.seen))
    report = AskReport(
        len(asked.probed),
        view_error(before, truth, pairs),
        view_error(view, truth, pairs),
        asked.changed,
        asked.unasked,
    )
    return asked, report
