"""The live swarm's fixed costs per step that are not compute or the wire: the one
home of their constants and formulas, for the estimator (``coordinator.estimator``)
and the simulator (``sim.engine``) alike.

A peer's step (``peer.epoch``) is its micro-batches' forwards and backwards, then the
gradient norms (and the replicas' sum), ``StepDone`` to the coordinator, waiting for
its ``Commit`` and the optimizer step; the next step starts after that. Besides the
compute and the wire, the peers' ``StepDone`` breakdowns (``protocol.wire.step_parts``)
show four costs the estimator once left out, together 30-40% of the README demo's step
on the 2-core machine:

- ``handoff``: every piece of compute (each micro-batch's forward, its backward, the
  norms, the optimizer step) is handed to the peer's compute thread and back;
- ``encode``: a message is encoded, hashed and signed by its sender and decoded and
  checked by its receiver (a fixed part and a part per byte on the wire);
- ``optimizer``: the norms and the update, a fixed part and a part per parameter byte;
- ``commit``: ``StepDone`` to ``Commit`` on the peer that finishes last (the round trip
  and the coordinator's own handling of the step).

``NONE`` (no such cost) is what simulated data-centre topologies get; ``LIVE`` is this
project's measured figure for a CPU swarm, and ``fitted`` takes a running swarm's own
from its peers' breakdowns. Pure functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.netmodel import PeerProfile

#: compute calls a peer makes per step besides its micro-batches' forwards and
#: backwards: the gradient norms and the optimizer step (``peer.epoch``)
STEP_CALLS = 2
#: one more when the stage has replicas: their gradients' sum
REPLICA_CALLS = 1


@dataclass(frozen=True)
class Overheads:
    """A peer's fixed costs (seconds): each figure applies per the unit it names."""

    handoff_s: float = 0.0  # per compute call: handing it to the compute thread and back
    message_s: float = 0.0  # per message, at each end (encode and sign, or decode and check)
    byte_s: float = 0.0  # per byte on the wire, at each end
    optimizer_s: float = 0.0  # per step: the norms and the update, their fixed part
    param_byte_s: float = 0.0  # per parameter byte of the stage: the update
    commit_s: float = 0.0  # per step: StepDone to Commit on the peer that finishes last
    # per compute call: its own fixed work (Python, the stage's graph), at the host's
    # speed whatever the device's; 0 for a live peer, whose measured compute holds it
    call_s: float = 0.0


#: no fixed cost (a simulated topology's peers; the estimator's model before these were added)
NONE = Overheads()
#: the README demo's peers on the 2-core development machine, quiet (load average 2;
#: 4 one-thread CPU peers, 4 micro-batches; the means of their StepDone breakdowns over
#: 60 steps, three runs, fitted by ``fitted``): handing off 0.52-0.70 ms a call (10 a
#: step a stage); encoding 1.8-3.5 ms for 8 messages and 1.06 MB, 5.7-6.5 ms for 16
#: and 6.3 MB (0.31 ms a message and 0.19 ms a MB at each end, an earlier run); the
#: optimizer 0.7 ms and 0.72-0.80 ms a MB of the stage's parameters; StepDone to Commit
#: on the stage that finished last (the first) 0.3-0.7 ms, its commit sent before its
#: StepDone came (``coordinator.pipeline``; 1.5-2.1 ms where it waits for it: a global
#: clip, fp16, a replicated first stage; 3.4-5.5 ms when the rest was fitted)
LIVE = Overheads(
    handoff_s=0.6e-3,
    message_s=0.31e-3,
    byte_s=0.19e-9,
    optimizer_s=0.7e-3,
    param_byte_s=0.76e-9,
    commit_s=0.5e-3,
)


def slowed(o: Overheads, factor: float) -> Overheads:
    """``o`` on a peer whose compute takes ``factor`` times as long (``join --throttle``
    idles after every compute call, the norms and the update included): the optimizer's
    parts scale; handing off, encoding and a call's own work (``join
    --throttle-call-ms``) do not."""
    return replace(o, optimizer_s=o.optimizer_s * factor, param_byte_s=o.param_byte_s * factor)


def pass_s(o: Overheads) -> float:
    """A micro-batch's forward, or its backward, handed to the compute thread and back,
    with the call's own fixed work."""
    return o.handoff_s + o.call_s


def message_s(sender: Overheads, receiver: Overheads, nbytes: float) -> float:
    """A message of ``nbytes`` on the wire: its sender's encoding and its receiver's decoding."""
    return sender.message_s + receiver.message_s + nbytes * (sender.byte_s + receiver.byte_s)


def slowest(overheads: Iterable[Overheads]) -> Overheads:
    """Each figure's largest over ``overheads`` (a group's slowest peer, part by part)."""
    got = list(overheads)
    if all(o is got[0] for o in got) or len(set(got)) == 1:  # peers share one figure (most often one object)
        return got[0]
    return Overheads(*(max(getattr(o, f) for o in got) for f in Overheads.__dataclass_fields__))


def boundary_ends(groups: list[list[str]], peers: Mapping[str, PeerProfile]) -> list[tuple[tuple[Overheads, ...], ...]]:
    """Per boundary, its (sender, receiver) overheads forward and backward, each its
    group's slowest (``slowest``): what ``overheads.message_s`` prices a message by."""
    worst = [slowest(peers[p].overheads for p in g) for g in groups]
    return [((a, b), (b, a)) for a, b in zip(worst, worst[1:])]


def replica_messages(replicas: int, runs: float, micro_batches: int) -> float:
    """The replicas' gradient messages a replica that runs ``runs`` of a step's
    ``micro_batches`` encodes or decodes: its own micro-batches' to every other replica,
    and theirs to it (``peer.epoch``)."""
    return runs * (replicas - 1) + micro_batches - runs if replicas > 1 else 0.0


def replica_grads_s(o: Overheads, replicas: int, runs: int, micro_batches: int) -> tuple[float, float]:
    """A replica's CPU for the replicas' gradient messages (``replica_messages``), per
    micro-batch it runs: (fixed seconds, seconds per parameter byte of its stage)."""
    each = replica_messages(replicas, runs, micro_batches) / max(runs, 1)
    return each * o.message_s, each * o.byte_s


def optimizer_s(o: Overheads, param_bytes: float, replicas: int = 1) -> float:
    """A stage's end of step on one of its peers: the norms, its replicas' sum (when it
    has replicas) and the update, each handed to the compute thread."""
    calls = STEP_CALLS + (REPLICA_CALLS if replicas > 1 else 0)
    return calls * (o.handoff_s + o.call_s) + o.optimizer_s + param_bytes * o.param_byte_s


def step_fixed_s(groups: Sequence[Sequence[Overheads]], stage_params: Sequence[float]) -> float:
    """What a step costs besides its pipeline: the slowest stage's end of step
    (``optimizer_s``) and the commit's round trip (the slowest peer's ``commit_s``)."""
    ends = [max(optimizer_s(o, p, len(g)) for o in g) for g, p in zip(groups, stage_params, strict=True) if g]
    commit = max((o.commit_s for g in groups for o in g), default=0.0)
    return max(ends, default=0.0) + commit


@dataclass(frozen=True)
class StageFacts:
    """What a stage did in a step, for ``fitted``: its compute calls (micro-batches
    times two, plus ``STEP_CALLS``), the messages it sent and received, their bytes on
    the wire, its parameter bytes."""

    calls: float
    messages: float
    wire_bytes: float
    param_bytes: float


def fitted(means_ms: Mapping[int, Mapping[str, float]], facts: Mapping[int, StageFacts], prior: Overheads) -> Overheads:
    """A running swarm's own overheads from its peers' breakdowns (per stage, each part's
    mean ms per step, ``coordinator.breakdown.StepBreakdown.means_ms``) and what each
    stage did (``facts``): the handoff per call, the encoding per byte beyond ``prior``'s
    per-message part, the optimizer beyond ``prior``'s fixed part, the least commit wait
    (the stage that finished last: the others also wait for it). Parts no stage reports
    keep ``prior``'s figure."""
    stages = [s for s in means_ms if s in facts]
    if not stages:
        return prior

    def rate(part: str, amount: Iterable[float], fixed: Iterable[float], old: float) -> float:
        total, spent = 0.0, 0.0
        for s, a, f in zip(stages, amount, fixed, strict=True):
            total, spent = total + a, spent + max(means_ms[s].get(part, 0.0) / 1e3 - f, 0.0)
        return spent / total if total > 0 else old

    handoff = rate("handoff", (facts[s].calls for s in stages), (0.0 for _ in stages), prior.handoff_s)
    byte = rate(
        "encode",
        (facts[s].wire_bytes for s in stages),  # its end of every message it sent or received
        (facts[s].messages * prior.message_s for s in stages),
        prior.byte_s,
    )
    param = rate(
        "optimizer", (facts[s].param_bytes for s in stages), (prior.optimizer_s for _ in stages), prior.param_byte_s
    )
    commit = min(means_ms[s].get("commit", prior.commit_s * 1e3) for s in stages) / 1e3
    return Overheads(handoff, prior.message_s, byte, prior.optimizer_s, param, commit, prior.call_s)
