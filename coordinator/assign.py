"""Stage assignment for a live swarm from its peers' adverts: OP-Fence on what the
peers measured (FLOP/s and memory; bandwidth to the coordinator stands in for the
links between peers until they measure those). A pure function of a snapshot."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from coordinator.estimator import DagCosts, Network, PeerProfile, Plan
from coordinator.opdag import OpDag
from coordinator.scheduler import Options, ScheduleError, opfence
from protocol.graph import Cut
from protocol.messages import Advert

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    cut: Cut
    stages: list[list[str]]  # peer ids per stage, in replica order
    plan: Plan | None = field(default=None, compare=False)  # the estimator's prediction

    def stage_of(self, peer_id: str) -> tuple[int, int]:
        for s, peers in enumerate(self.stages):
            if peer_id in peers:
                return s, peers.index(peer_id)
        raise KeyError(peer_id)


def network_from_adverts(adverts: list[Advert], measured: dict[tuple[str, str], float] | None = None) -> Network:
    """Pairwise bandwidth guessed from each peer's measured up/down to the coordinator,
    except for the pairs in ``measured`` (Mbit/s from one peer to the other, probed when
    a plan epoch set its stages up)."""
    ids = [a.peer_id for a in adverts]
    overrides = {
        (a.peer_id, b.peer_id): (max(min(a.up_mbps, b.down_mbps), 1e-3), 0.001)
        for a in adverts
        for b in adverts
        if a.peer_id != b.peer_id
    }
    probed = {pair: mbps for pair, mbps in (measured or {}).items() if pair in overrides}
    for (a, b), mbps in probed.items():  # a probe of one direction stands for both, unless both were probed
        overrides[(a, b)] = (mbps, 0.001)
        if (b, a) not in probed:
            overrides[(b, a)] = (mbps, 0.001)
    typical = statistics.median(v[0] for v in overrides.values()) if overrides else 1000.0
    return Network({i: "swarm" for i in ids}, {("swarm", "swarm"): (typical, 0.001)}, overrides, set(probed))


def assign(
    dag: OpDag,
    adverts: list[Advert],
    num_stages: int | None = None,
    micro_batches: int = 4,
    standby: bool = False,
    measured: dict[tuple[str, str], float] | None = None,
) -> Assignment:
    """Every advertised peer gets a stage (``num_stages`` defaults to one per peer), or,
    with ``standby``, OP-Fence may leave peers out and choose the stage count itself
    when ``num_stages`` is None. ``measured``: links probed so far (``network_from_adverts``)."""
    if not adverts:
        raise ValueError("no peers to assign")
    k = num_stages or (None if standby else len(adverts))
    if k is not None and k > len(adverts):
        raise ValueError(f"{k} stages need at least {k} peers, {len(adverts)} joined")
    costs = DagCosts.from_opdag(dag)
    peers = [PeerProfile(a.peer_id, a.flops, a.memory_bytes, "swarm") for a in adverts]
    options = Options(micro_batches=micro_batches, stages=k, standby=standby, compression=False)
    try:
        plan = opfence(costs, peers, network_from_adverts(adverts, measured), options)
    except ScheduleError as exc:
        raise ValueError(str(exc)) from None
    if not plan.fits_memory:
        logger.warning("the best plan may not fit the peers' free memory")
    return Assignment(cut=Cut(tuple(plan.cut)), stages=plan.groups, plan=plan)
