"""Stage assignment from measured adverts: a pure function of a snapshot.

Peers are grouped into ``num_stages`` groups with balanced total FLOP/s (the
fastest peer first, always into the group with the least FLOP/s so far); the
DAG is cut so each stage's FLOPs follow its group's FLOP/s. Extra peers become
replicas. The bandwidth-aware OP-Fence scheduler replaces this later.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.opdag import OpDag, balanced_cut
from protocol.graph import Cut
from protocol.messages import Advert


@dataclass(frozen=True)
class Assignment:
    cut: Cut
    stages: list[list[str]]  # peer ids per stage, in replica order

    def stage_of(self, peer_id: str) -> tuple[int, int]:
        for s, peers in enumerate(self.stages):
            if peer_id in peers:
                return s, peers.index(peer_id)
        raise KeyError(peer_id)


def assign(dag: OpDag, adverts: list[Advert], num_stages: int | None = None) -> Assignment:
    """Give every advertised peer a stage; ``num_stages`` defaults to one per peer."""
    if not adverts:
        raise ValueError("no peers to assign")
    k = num_stages or len(adverts)
    if k > len(adverts):
        raise ValueError(f"{k} stages need at least {k} peers, {len(adverts)} joined")
    groups: list[list[Advert]] = [[] for _ in range(k)]
    for ad in sorted(adverts, key=lambda a: (-a.flops, a.peer_id)):
        target = min(range(k), key=lambda s: (sum(a.flops for a in groups[s]), len(groups[s]), s))
        groups[target].append(ad)
    # Stage s does FLOPs in proportion to what its replicas can do together.
    weights = [max(sum(a.flops for a in g), 1.0) for g in groups]
    cut = balanced_cut(dag, k, weights)
    return Assignment(cut=cut, stages=[[a.peer_id for a in g] for g in groups])
