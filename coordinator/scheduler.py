"""The OP-Fence scheduler and its baselines: pure functions of (OP-DAG costs, peer
profiles, network, options) to a :class:`Plan` with predicted times.

OP-Fence:

1. clusters peers by the bandwidth between them (the network's clusters);
2. orders the clusters along the pipeline so consecutive clusters have the
   fastest links between them (every order for up to 7 clusters, else greedy);
3. for each pool of peers (``placement.pools``) and candidate number of stages, gives each
   cluster stages in proportion to its FLOP/s and splits its peers into that many
   balanced replica groups, so stage groups never straddle a slow link when there
   are at least as many stages as clusters (and runs of peers);
4. cuts those groupings in the order of their lower bound (``plan_floor``) until
   none left can beat the best plan (``_best_first``), each by binary search on the
   bottleneck time: each stage takes as many ops as its group computes within the
   bound, and ends at the position whose boundary tensors cross the link in time
   (compressed as far as the swarm's ``auto`` ever goes, where needed) and whose
   1F1B round trip to the next stage keeps up (``cutter._Cutter``);
5. gives each slow edge the codec the live swarm's ``auto`` would (fp16, int8, low
   rank with int4 gradients: just enough) or none, whichever reaches the loss
   sooner (``coordinator.codec_price``: each codec's measured steps factor), and
   keeps the plans that fit memory and reach the loss soonest;
6. moves peers in a bounded local search (``_peer_moves``) and polishes the best
   plan by moving boundaries (``_refine``).

The search is ``coordinator.opfence``'s (placement, cutter and the shared finishing
step in ``coordinator.placement``, ``coordinator.cutter``, ``coordinator.plan_eval``);
the baselines live in ``coordinator.baselines`` and ``coordinator.dtfm``; ``plan``
runs any of them by name.
"""

from __future__ import annotations

from coordinator import baselines, dtfm
from coordinator.estimator import DagCosts, Plan, boundary_positions
from coordinator.netmodel import Network, PeerProfile
from coordinator.opfence import opfence
from coordinator.plan_eval import DEFAULT_OPTIONS, Options, ScheduleError
from coordinator.plan_options import SCHEDULERS

#: the baselines as well equipped as OP-Fence (codecs, replicas, standby peers)
STRONG = ("bw-blind", "petals", "dtfm")


def plan(
    scheduler: str, costs: DagCosts, peers: list[PeerProfile], network: Network, options: Options = DEFAULT_OPTIONS
) -> Plan:
    """The plan of ``scheduler`` (one of SCHEDULERS)."""
    if not peers:
        raise ScheduleError("no peers to plan for")
    if scheduler == "opfence":
        return opfence(costs, peers, network, options)
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


def _baseline_stages(costs: DagCosts, peers: list[PeerProfile], options: Options) -> int:
    """Baselines get the pipeline depth bandwidth-unaware systems pick: as many
    stages as they may, one peer each where possible."""
    return min(len(peers), len(boundary_positions(costs)) + 1, options.max_stages)
