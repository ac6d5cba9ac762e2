"""The workload estimator: what a plan costs, predicted from the OP-DAG's per-op
costs, the peers' measured FLOP/s and memory, and the links' bandwidth and
latency. Pure functions of a snapshot; the scheduler, the swarm and ``sim/`` all
call the same code.

Time model of one training iteration (``M`` micro-batches), the way the live swarm
runs it (``peer.epoch``), and the same in ``sim/``:

- micro-batch ``m`` goes to replica ``m mod r`` of every stage, and from replica
  ``m mod r`` to replica ``m mod r'`` of the next one: every replica runs whole
  micro-batches (``dealt``), and every pair of peers that exchange them is a link
  of its own (exact pairs, no sampling);
- a replica's time per micro-batch: ``3 x FLOPs / its FLOP/s`` (forward plus a
  backward of twice its cost), plus a fixed cost per operator kernel (forward once,
  backward twice; ``PeerProfile.op_overhead_s``), plus, when the stage has
  replicas, sending that micro-batch's parameter gradients to every other replica
  at once, each pair on its own link: its slowest link prices it (``slowest_sends``;
  the live swarm sums them in micro-batch order: bit-exact);
- a link's time per micro-batch and direction: ``latency + wire bytes / bandwidth``;
- stages with the same number of replicas run 1F1B in lanes (replica ``i`` of every
  stage): stage ``s`` holds at most ``k - s`` micro-batches in flight, so a round
  trip from stage ``s`` to the last stage and back is hidden only if that many
  micro-batches cover it (the latency is not free); otherwise the live swarm runs
  GPipe (every micro-batch in flight: more memory, no such bound);
- iteration under 1F1B: every stage and link once for one micro-batch (fill and
  drain), plus ``rounds - 1`` times the slowest steady-state period of a stage, a
  link or a 1F1B round trip, ``rounds`` being the micro-batches of the busiest lane;
  under GPipe, micro-batch by micro-batch (``pipeline_s``): there a replica's
  backwards start once its own forwards are done, not once every stage's are, and
  a closed form that put the two phases one after the other overstated an unequal
  plan by up to 20% (``homes-7``: 0.378 s predicted, 0.316 s measured).

``lower_bound_s`` is ``3 x M x total FLOPs / total FLOP/s of all peers``: no plan
on these peers can beat perfect compute balance with free communication.

The peers, the links and the one bytes-to-seconds rule are ``coordinator.netmodel``'s;
the per-op costs of a traced model come from ``coordinator.opdag.cost_lists``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np

from coordinator import schedule_time
from coordinator.codec_price import plan_steps_factor, price
from coordinator.netmodel import Network, PeerProfile, boundary_models, rate_mbps, rounds_of
from coordinator.opdag import OpDag, cost_lists
from coordinator.overheads import boundary_ends, message_s, pass_s, replica_grads_s, step_fixed_s
from coordinator.pipeline_latency import exposed_sends, round_trips, tied_sync_s, windows
from coordinator.plan import PeerTable, Plan
from protocol.model import schedule as schedules
from protocol.model.schedule import uses_1f1b
from protocol.wire.codecs import Codec

#: Adam keeps weights, gradients and two moments: 4 bytes of state per parameter byte
#: (fp32 weights, gradients and moments: 16 bytes per parameter, as the live swarm keeps them)
STATE_PER_PARAM_BYTE = 4
#: a micro-batch's forward and backward cost this many forwards (the backward twice the forward)
PASSES = 3
#: a stage must compute at least this share of an even split of the model's FLOPs:
#: one that computes nothing only relays its inputs over one more link
MIN_STAGE_SHARE = 0.01
#: the width of what crosses a cut when a model does not say (a transformer's residual stream)
DEFAULT_COLS = 1024


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
    kernels: list[int] = field(default_factory=list)  # kernels an op launches in its forward (default: 1 each)
    float_itemsize: int = 4  # bytes per element of the floating tensors that cross cuts (2: mixed precision)
    cross_cols: list[int] = field(default_factory=list)  # columns of the widest floating matrix crossing each position
    #: weights shared by ops that may sit in different stages: (first op, last op, bytes);
    #: the stage of the last keeps a copy, and the copies' gradients are summed once an
    #: iteration (as Megatron-style pipelines keep a tied embedding)
    tied: tuple[tuple[int, int, int], ...] = ()
    _pf: list[int] = field(default_factory=list, repr=False)
    _pk: list[int] = field(default_factory=list, repr=False)
    _pp: list[int] = field(default_factory=list, repr=False)
    _pa: list[int] = field(default_factory=list, repr=False)
    _wire: dict[Any, Any] = field(default_factory=dict, repr=False, init=False, compare=False)  # what ``cached`` keeps

    def __post_init__(self) -> None:
        n = len(self.flops)
        if not (len(self.param_bytes) == len(self.act_bytes) == n and len(self.cross_bytes) == len(self.float_cross)):
            raise ValueError("per-op cost lists differ in length")
        if len(self.cross_bytes) != n:
            raise ValueError("cross_bytes needs one entry per op (entry 0 unused)")
        if not self.kernels:
            self.kernels = [1] * n
        if not self.cross_cols:
            self.cross_cols = [DEFAULT_COLS] * n
        if len(self.kernels) != n:
            raise ValueError("kernels needs one entry per op")
        self._pf, self._pp, self._pa, self._pk = (
            list(accumulate(xs, initial=0)) for xs in (self.flops, self.param_bytes, self.act_bytes, self.kernels)
        )

    @property
    def num_ops(self) -> int:
        return len(self.flops)

    @property
    def total_flops(self) -> int:
        return self._pf[-1]

    def stage_flops(self, lo: int, hi: int) -> int:
        return self._pf[hi] - self._pf[lo]

    def stage_params(self, lo: int, hi: int) -> int:
        if not self.tied:
            return self._pp[hi] - self._pp[lo]
        copies = sum(nbytes for first, last, nbytes in self.tied if lo <= last < hi and not lo <= first < hi)
        return self._pp[hi] - self._pp[lo] + copies

    def arrays_from(self, lo: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """FLOPs, kernels, parameter bytes and activation bytes of ops ``lo .. hi - 1``
        for every ``hi`` (index ``hi``), as arrays (tied copies included)."""
        if "arrays" not in self._wire:
            self._wire["arrays"] = [np.array(x, dtype=np.float64) for x in (self._pf, self._pk, self._pp, self._pa)]
        pf, pk, pp, pa = self._wire["arrays"]  # type: ignore[misc]
        params = pp - pp[lo]
        for first, last, nbytes in self.tied:
            if first < lo:  # its copy joins a stage from lo once the stage reaches past last
                params[last + 1 :] += nbytes
        return pf - pf[lo], pk - pk[lo], params, pa - pa[lo]

    def stage_acts(self, lo: int, hi: int) -> int:
        return self._pa[hi] - self._pa[lo]

    def stage_kernels(self, lo: int, hi: int) -> int:
        return self._pk[hi] - self._pk[lo]

    def min_stage_flops(self, num_stages: int) -> float:
        """The fewest FLOPs a stage of a ``num_stages``-stage plan may have (``MIN_STAGE_SHARE``)."""
        return MIN_STAGE_SHARE * self.total_flops / max(num_stages, 1)

    def wire_table(self, codec: Codec) -> list[float]:
        """Wire bytes of a cut at every position under ``codec``, the busier way
        (computed once per codec: for the few codecs a search tries everywhere)."""
        key = str(codec)
        if key not in self._wire:
            self._wire[key] = [wire_bytes(self, p, codec) for p in range(self.num_ops)]
        return self._wire[key]

    def cached(self, key: Any, make: Any) -> Any:
        """``make()``, computed once per key for these costs (what searches ask again and again)."""
        if key not in self._wire:
            self._wire[key] = make()
        return self._wire[key]

    @classmethod
    def from_opdag(cls, dag: OpDag) -> DagCosts:
        """Costs of a traced :class:`coordinator.opdag.OpDag` (``opdag.cost_lists``)."""
        lists = cost_lists(dag)
        lists["cross_cols"] = [c or DEFAULT_COLS for c in lists["cross_cols"]]
        return cls(**lists)

    @classmethod
    def synthetic(cls, num_ops: int, seed: int = 0, act_bytes: int = 1 << 20) -> DagCosts:
        """A chain of ops with random costs (for tests and benchmarks)."""
        rng = random.Random(seed)
        flops = [rng.randint(1, 100) * 10**7 for _ in range(num_ops)]
        params = [rng.choice([0, 0, rng.randint(1, 50) * 10**5]) for _ in range(num_ops)]
        cross = [0] + [rng.choice([1, 1, 2, 4]) * act_bytes for _ in range(num_ops - 1)]
        return cls(flops, params, [act_bytes] * num_ops, cross, list(cross))


def lower_bound(costs: DagCosts, peers: dict[str, PeerProfile], micro_batches: int) -> float:
    total = peers.total_flops if isinstance(peers, PeerTable) else sum(p.flops for p in peers.values())
    return PASSES * micro_batches * costs.total_flops / max(total, 1.0)


def wire_pair(costs: DagCosts, position: int, codec: Codec) -> tuple[float, float]:
    """Bytes on the wire per micro-batch forward and backward for a cut before
    ``position`` (``coordinator.codec_price``: raw values go forward only)."""
    key = ("pair", position, str(codec))
    if key not in costs._wire:
        floating = costs.float_cross[position]
        got = price(
            codec, floating, costs.cross_bytes[position] - floating, costs.cross_cols[position], costs.float_itemsize
        )
        costs._wire[key] = (got.forward_bytes, got.backward_bytes)
    return costs._wire[key]


def wire_bytes(costs: DagCosts, position: int, codec: Codec) -> float:
    """The busier way's bytes on the wire per micro-batch (the estimator's link cost)."""
    return max(wire_pair(costs, position, codec))


def stage_memory(costs: DagCosts, lo: int, hi: int, in_flight: int) -> int:
    return STATE_PER_PARAM_BYTE * costs.stage_params(lo, hi) + in_flight * costs.stage_acts(lo, hi)


def dealt(micro_batches: int, replicas: int) -> list[int]:
    """Micro-batches each replica runs: micro-batch ``m`` goes to replica ``m mod r``."""
    return [len(range(i, micro_batches, replicas)) for i in range(replicas)]


@dataclass(frozen=True)
class Replica:
    """One peer of a stage group, as the time and memory model sees it."""

    flops: float
    overhead_s: float  # per kernel
    memory: int
    runs: int  # micro-batches dealt to it
    in_flight: int  # micro-batches whose activations it holds at once
    send_latency_s: float  # per micro-batch: its gradient sends to the other replicas
    send_s_per_byte: float
    handoff_s: float = 0.0  # per pass (forward, backward): to the compute thread and back (``overheads.pass_s``)
    # per backward: encoding its gradients for the other replicas and decoding theirs (its
    # share: ``overheads.replica_messages``), fixed and per parameter byte of the stage
    grads_s: float = 0.0
    grads_s_per_byte: float = 0.0

    def seconds(self, costs: DagCosts, lo: int, hi: int, part: str = "FB") -> float:
        """One micro-batch's forward (``F``), backward (``B``) or both (``FB``), each
        handed to the compute thread and back; the backward with this replica's CPU for
        the replicas' gradient messages. Their transfer is not in it: it goes on beside
        the next micro-batch's compute (``occupied``)."""
        compute = costs.stage_flops(lo, hi) / max(self.flops, 1.0) + costs.stage_kernels(lo, hi) * self.overhead_s
        grads = self.grads_s + costs.stage_params(lo, hi) * self.grads_s_per_byte
        forward = (compute + self.handoff_s) * (part != "B")
        return forward + ((PASSES - 1) * compute + self.handoff_s + grads) * (part != "F")

    def occupied(self, costs: DagCosts, lo: int, hi: int, part: str = "FB") -> float:
        """A micro-batch's share of the replica's steady period: its compute, or its
        gradient sends' transfer where that is longer (the peer starts them after the
        backward and awaits them at the step's end: they overlap the next compute)."""
        busy = costs.stage_params(lo, hi) * self.send_s_per_byte * (part != "F")
        return max(self.seconds(costs, lo, hi, part), busy)

    def sends(self, costs: DagCosts, lo: int, hi: int) -> float:
        return self.send_latency_s + costs.stage_params(lo, hi) * self.send_s_per_byte if self.send_s_per_byte else 0.0


def compute_s(costs: DagCosts, lo: int, hi: int, group: Iterable[PeerProfile]) -> float:
    """One micro-batch's forward and backward of ops ``lo .. hi - 1`` on the slowest
    peer of ``group``, compute only (``Replica.seconds`` without gradient sends)."""
    return max(Replica(p.flops, p.op_overhead_s, p.memory_bytes, 1, 1, 0.0, 0.0).seconds(costs, lo, hi) for p in group)


@dataclass
class GroupModel:
    """A stage group's cost as a function of its op range."""

    replicas: list[Replica]  # distinct kinds that run micro-batches
    rounds: int  # micro-batches of the busiest lane (the plan's)
    window: int = 0  # under 1F1B: micro-batches in flight (``windows``); 0 under GPipe

    def latency(self, costs: DagCosts, lo: int, hi: int, part: str = "FB") -> float:
        """One micro-batch through the stage (on its slowest replica)."""
        return max(r.seconds(costs, lo, hi, part) for r in self.replicas)

    def _rows(self) -> np.ndarray:
        """Per replica kind, a micro-batch's seconds per FLOP, per kernel, per parameter
        byte (its gradient sends' transfer, beside its compute: ``Replica.occupied``),
        fixed (the handoffs and the gradient messages' CPU; the sends' latency is in no
        period) and per parameter byte of compute (the gradient messages' CPU)."""
        rows = [
            [PASSES / max(r.flops, 1.0), PASSES * r.overhead_s, r.send_s_per_byte, 2 * r.handoff_s + r.grads_s]
            + [r.grads_s_per_byte]
            for r in self.replicas
        ]
        return np.array(rows)

    def per_unit(self) -> np.ndarray:
        """The period's most seconds per FLOP, kernel and parameter byte of the stage,
        and its fixed part, each over its replicas (``period`` is at least each of them
        times the stage's amount)."""
        runs, rows = np.array([r.runs for r in self.replicas], dtype=np.float64)[:, None], self._rows()
        rows[:, 2] = rows[:, [2, 4]].max(axis=1)  # a parameter byte's transfer, or its CPU beside the compute
        return (runs * rows[:, :4]).max(axis=0) / self.rounds

    def period(self, costs: DagCosts, lo: int, hi: int, part: str = "FB") -> float:
        """The stage's steady-state time per round of micro-batches (its busiest replica's work)."""
        return max(r.runs * r.occupied(costs, lo, hi, part) for r in self.replicas) / self.rounds

    def sends(self, costs: DagCosts, lo: int, hi: int) -> float:
        return max(r.sends(costs, lo, hi) for r in self.replicas)

    def fits(self, costs: DagCosts, lo: int, hi: int) -> bool:
        return all(stage_memory(costs, lo, hi, r.in_flight) <= r.memory for r in self.replicas)

    def reach(self, costs: DagCosts, lo: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``period``, ``fits`` and ``latency`` of ``(costs, lo, hi)`` for every ``hi``
        at once (entries below ``lo`` mean nothing): what a cut search asks most. The
        period here carries the stage's last gradient sends (``exposed_sends``) spread
        over the rounds after the first, as the iteration does: where a cut puts
        replicated parameters weighs, which the steady period alone cannot see."""
        flops, kernels, params, acts = costs.arrays_from(lo)
        rows = self._rows()
        sends = rows[:, 2:3] * params[None, :]  # beside the compute (``Replica.occupied``)
        each = rows[:, [0, 1, 3, 4]] @ np.stack([flops, kernels, np.ones_like(flops), params])  # a micro-batch's CPU
        last = (sends + np.array([[r.send_latency_s * (r.send_s_per_byte > 0)] for r in self.replicas])).max(axis=0)
        runs = np.array([r.runs for r in self.replicas], dtype=np.float64)[:, None]
        limits = np.array([[r.in_flight, r.memory] for r in self.replicas], dtype=np.float64)
        need = STATE_PER_PARAM_BYTE * params[None, :] + limits[:, :1] * acts[None, :]
        busy = (runs * np.maximum(each, sends)).max(axis=0) / self.rounds + last / max(self.rounds - 1, 1)
        return busy, (need <= limits[:, 1:]).all(axis=0), each.max(axis=0)


def group_models(groups: list[list[PeerProfile]], network: Network, micro_batches: int) -> list[GroupModel]:
    """The time and memory model of every stage group of a plan (in pipeline order);
    remembered by the network (with the peers' figures) while its links stay as they are."""
    key = (
        "groups",
        micro_batches,
        tuple((p.id, p.flops, p.memory_bytes, p.op_overhead_s, p.overheads) for g in groups for p in g),
        tuple(len(g) for g in groups),
    )
    got = network._memo.get(key)
    if got is None:
        got = _group_models(groups, network, micro_batches)
        network._remember(key, got)
    return got


def _group_models(groups: list[list[PeerProfile]], network: Network, micro_batches: int) -> list[GroupModel]:
    k, lanes = len(groups), uses_1f1b([[p.id for p in g] for g in groups])
    rounds = rounds_of([[p.id for p in g] for g in groups], micro_batches)
    window = windows(k, rounds) if lanes else [0] * k
    out = []
    for s, g in enumerate(groups):
        sums = network.slowest_sends(tuple(p.id for p in g)) if len(g) > 1 else [(0.0, 0.0)]
        kinds = {
            Replica(
                p.flops,
                p.op_overhead_s,
                p.memory_bytes,
                n,
                min(n, k - s) if lanes else n,
                lat,
                spb,
                pass_s(p.overheads),
                *replica_grads_s(p.overheads, len(g), n, micro_batches),
            )
            for p, n, (lat, spb) in zip(g, dealt(micro_batches, len(g)), sums)
            if n
        }
        out.append(GroupModel(sorted(kinds, key=repr), rounds, int(window[s])))
    return out


def predict(
    costs: DagCosts,
    plan: Plan,
    peers: dict[str, PeerProfile],
    network: Network,
    micro_batches: int,
) -> Plan:
    """Fill in ``plan``'s predicted times (and memory fit, and whether a stage is
    empty); returns it. ``stage_s`` and ``link_s`` are per micro-batch in the steady
    state; ``allreduce_s`` the replica gradient sends within ``stage_s``."""
    k, m = len(plan.groups), micro_batches
    ranges = plan.ranges(costs.num_ops)
    models = group_models([[peers[p] for p in g] for g in plan.groups], network, m)
    edges = boundary_models(plan.groups, network, m)
    rounds = rounds_of(plan.groups, m)
    wires = [wire_pair(costs, pos, c) for pos, c in zip(plan.cut, plan.codecs)]  # (forward, backward)
    stage_round = [g.period(costs, lo, hi) for g, (lo, hi) in zip(models, ranges)]
    link_round = [max(w) * e.per_byte() for e, w in zip(edges, wires)]
    sends = [g.sends(costs, lo, hi) for g, (lo, hi) in zip(models, ranges)]
    if uses_1f1b(plan.groups):
        one = [g.latency(costs, lo, hi) for g, (lo, hi) in zip(models, ranges)]
        ends = boundary_ends(plan.groups, peers)
        one_way = {
            d: [e.latency(w[d]) + message_s(*ends[b][d], w[d]) for b, (e, w) in enumerate(zip(edges, wires))]
            for d in (0, 1)
        }
        there_and_back = [f + b for f, b in zip(one_way[0], one_way[1])]
        steady = max(stage_round + link_round + round_trips(one, there_and_back, rounds))
        pipeline = sum(one) + sum(there_and_back) + (rounds - 1) * steady
        tail = exposed_sends(sends, [g.latency(costs, lo, hi, "B") for g, (lo, hi) in zip(models, ranges)], one_way[1])
    else:  # GPipe, its replicas' forwards and backwards interleaved as they run: micro-batch by micro-batch
        pipeline, tail = pipeline_s(costs, plan, peers, network, m, "gpipe"), 0.0
    plan.iteration_s = pipeline + tail + tied_sync_s(costs, plan, network) + fixed_s(costs, plan, peers)
    plan.stage_s = [t * rounds / m for t in stage_round]
    plan.link_s = [t * rounds / m for t in link_round]
    plan.edge_mbps = edge_rates(plan.groups, network, m)
    plan.allreduce_s = sends
    plan.lower_bound_s = lower_bound(costs, peers, m)
    plan.fits_memory = all(g.fits(costs, lo, hi) for g, (lo, hi) in zip(models, ranges))
    plan.empty_stage = any(costs.stage_flops(lo, hi) < costs.min_stage_flops(k) for lo, hi in ranges)
    plan.steps_factor = plan_steps_factor(plan.codecs)
    return plan


#: one number per ``DagCosts``, and per grouping of peers' figures, a pipeline's time was remembered for
_SERIALS = itertools.count()


def pipeline_s(
    costs: DagCosts, p: Plan, peers: Mapping[str, PeerProfile], network: Network, m: int, schedule: str = "1f1b"
) -> float:
    """When ``p``'s last micro-batch is done and its last gradient send has landed,
    micro-batch by micro-batch (``coordinator.schedule_time``): micro-batch ``mb`` on
    replica ``mb mod r`` of each stage, each replica running ``schedule`` over its own
    micro-batches when every stage has as many replicas (GPipe otherwise). The step's
    end (``fixed_s``) and tied weights' sync are not in it. The simulator times every
    plan so, ``predict`` a GPipe plan: on GPipe plans the two agree by construction,
    and only the testbed checks them."""
    name = schedules.effective(schedule, p.groups)
    figures = (
        "figures",
        tuple(tuple((x, peers[x].flops, peers[x].op_overhead_s, peers[x].overheads) for x in g) for g in p.groups),
    )
    if figures not in network._memo:  # one number per grouping and figures: the keys below stay small
        network._remember(figures, next(_SERIALS))
    serial = costs.cached("serial", lambda: next(_SERIALS))  # these costs, never another's
    key = ("pipeline", name, m, p.cut, tuple(p.codecs), network._memo[figures], serial)
    got = network._memo.get(key)  # remembered while the links stay as they are (a search asks again and again)
    if got is None:
        wires = [wire_pair(costs, pos, c) for pos, c in zip(p.cut, p.codecs)]
        got = schedule_time.run(p, _timings(costs, p, peers, network, m), wires, peers, network, m, name)
        network._remember(key, got)
    return got


def _timings(
    costs: DagCosts, p: Plan, peers: Mapping[str, PeerProfile], network: Network, m: int
) -> list[list[schedule_time.Timing]]:
    """Per stage, each replica's ``Timing`` (``Replica.seconds``: the estimator's stage
    time), alike replicas timed once."""
    out = []
    for (lo, hi), g in zip(p.ranges(costs.num_ops), p.groups):
        sums = network.slowest_sends(tuple(g)) if len(g) > 1 else [(0.0, 0.0)] * len(g)
        timed: dict[tuple[Any, ...], schedule_time.Timing] = {}
        stage = []
        for i, (pid, (lat, spb)) in enumerate(zip(g, sums)):
            peer, runs = peers[pid], len(range(i, m, len(g)))
            key = (peer.flops, peer.op_overhead_s, peer.overheads, runs, lat, spb)
            if key not in timed:
                grads = replica_grads_s(peer.overheads, len(g), runs, m)
                one = Replica(peer.flops, peer.op_overhead_s, 0, runs, 0, lat, spb, pass_s(peer.overheads), *grads)
                f, b = one.seconds(costs, lo, hi, "F"), one.seconds(costs, lo, hi, "B")
                timed[key] = schedule_time.Timing(f, b, costs.stage_params(lo, hi) * spb, lat * (spb > 0))
            stage.append(timed[key])
        out.append(stage)
    return out


def edge_rates(groups: list[list[str]], network: Network, micro_batches: int) -> list[float]:
    """Per boundary: its busiest pair's Mbit/s per micro-batch (``auto`` weighs it against the stages)."""
    return [rate_mbps(e.per_byte() * e.rounds / micro_batches) for e in boundary_models(groups, network, micro_batches)]


def fixed_s(costs: DagCosts, plan: Plan, peers: dict[str, PeerProfile]) -> float:
    """What a step of ``plan`` costs besides its pipeline (``overheads.step_fixed_s``):
    the slowest stage's end of step and the commit's round trip."""
    groups = [[peers[p].overheads for p in g] for g in plan.groups]
    return step_fixed_s(groups, [costs.stage_params(lo, hi) for lo, hi in plan.ranges(costs.num_ops)])


def boundary_positions(costs: DagCosts) -> list[int]:
    """Positions a cut may use (tied weights excluded); the list is shared, not to be changed."""
    return costs.cached("positions", lambda: [p for p in range(1, costs.num_ops) if p not in costs.forbidden])
