"""What every scheduler shares: its options, its error, how it finishes a plan
(``evaluate``: the codecs the swarm would put on the plan's links, each kept only
where it reaches the loss sooner, and the estimator's prediction) and how plans
are ranked. The planner's codec choice (``plan_codecs``) is the one codec choice
(``coordinator.codec_choice``) on the estimator's stage times and links."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.codec_choice import STRONGEST, choose_codecs
from coordinator.codec_price import matrix_spec
from coordinator.estimator import DagCosts, Plan, predict
from coordinator.netmodel import Network, PeerProfile, rounds_of
from protocol.wire.codecs import Codec


@dataclass(frozen=True)
class Options:
    micro_batches: int = 8
    max_stages: int = 32
    compression: bool = True  # slow edges may get the codec the swarm's ``auto`` would give them
    seed: int = 0
    stages: int | None = None  # force the number of stages
    standby: bool = True  # OP-Fence may leave peers out (on standby) when that is faster
    lowrank: bool = False  # with compression, as ``auto-lowrank``: low-rank activations past int8
    rank: int | None = None  # pins that low rank (``--rank``)

    @property
    def auto_mode(self) -> str:
        """The live swarm's compression mode whose codecs the plan prices."""
        return "auto-lowrank" if self.lowrank else "auto"

    def strongest(self) -> Codec:
        """The fewest bytes an edge ever sends under these options, as a codec."""
        return STRONGEST[self.auto_mode] if self.compression else Codec()


#: the options a scheduler gets when none are given
DEFAULT_OPTIONS = Options()


class ScheduleError(ValueError):
    """No plan is possible (e.g. more stages than ops or peers)."""


def plan_codecs(costs: DagCosts, plan_: Plan, options: Options) -> list[Codec]:
    """The codec ``auto`` puts on each edge slower than the slowest stage: just enough
    to keep up (none without ``options.compression``). The one codec choice
    (``codec_choice.choose_codecs``) on each edge's floating bytes (as one matrix of
    its widest columns), its busiest pair's bandwidth per micro-batch
    (``Plan.edge_mbps``) and the plan's stage times, both as ``predict`` gives them."""
    if not options.compression:
        return [Codec()] * len(plan_.cut)
    floating = [costs.float_cross[pos] for pos in plan_.cut]
    specs = [matrix_spec(f, costs.cross_cols[pos], costs.float_itemsize) for f, pos in zip(floating, plan_.cut)]
    mode, rank = options.auto_mode, options.rank
    return choose_codecs(floating, plan_.edge_mbps, plan_.stage_s, mode, edge_specs=specs, rank=rank)


def evaluate(
    costs: DagCosts,
    cut: tuple[int, ...],
    ids: list[list[str]],
    by_id: dict[str, PeerProfile],
    network: Network,
    options: Options,
    name: str = "opfence",
    revert: bool = True,
) -> Plan:
    """The plan of stage groups ``ids`` cut at ``cut``, with the codecs the swarm would
    put on its links (each kept only where it reaches the loss sooner than none: with
    ``revert``, else all or none), and its predicted times: every scheduler finishes
    its plans here."""
    m = options.micro_batches
    best = predict(costs, Plan(cut, ids, [Codec()] * len(cut), name), by_id, network, m)
    codecs = plan_codecs(costs, best, options)
    if all(c.name == "none" for c in codecs):
        return best
    squeezed = predict(costs, Plan(cut, ids, codecs, name), by_id, network, m)
    for b in [b for b, c in enumerate(codecs) if c.name != "none" and revert]:
        trial = predict(
            costs, Plan(cut, ids, [*squeezed.codecs[:b], Codec(), *squeezed.codecs[b + 1 :]], name), by_id, network, m
        )
        squeezed = trial if trial.to_loss_s < squeezed.to_loss_s else squeezed
    return squeezed if squeezed.to_loss_s < best.to_loss_s else best


def rank(p: Plan) -> tuple[bool, float]:
    """How schedulers order plans: valid ones first, then by time to the loss."""
    return (not p.valid, p.to_loss_s)


#: a stage whose replicas' gradient sends take at least this share of its time is held by them
SYNC_BOUND_SHARE = 0.5


def bottleneck(p: Plan, micro_batches: int) -> str:
    """What sets the plan's pace, in words: its slowest link, or its slowest stage and,
    where the replicas' exact averaging (their all-to-all gradient sends) takes most of
    the time a replica spends on a micro-batch, that averaging."""
    if not p.stage_s:
        return "nothing: no stage"
    s = max(range(len(p.stage_s)), key=p.stage_s.__getitem__)
    if p.link_s and max(p.link_s) > p.stage_s[s]:
        b = p.link_s.index(max(p.link_s))
        return f"link {b} -> {b + 1}, {p.link_s[b] * 1e3:.2f} ms per micro-batch"
    per_round = p.stage_s[s] * micro_batches / rounds_of(p.groups, micro_batches)  # a replica's micro-batch
    sync = p.allreduce_s[s] if s < len(p.allreduce_s) else 0.0
    if sync >= SYNC_BOUND_SHARE * per_round:
        return (
            f"stage {s}'s replica averaging: each replica's all-to-all gradient sends take {sync * 1e3:.2f} of "
            f"the {per_round * 1e3:.2f} ms it spends on a micro-batch"
        )
    return f"stage {s}, {p.stage_s[s] * 1e3:.2f} ms per micro-batch"
