"""The record a swarm run's phases share (:class:`RunState`: the plan epoch, the
committed steps, the peers lost, and what the run reports), the failure they raise
(:class:`PeerLost`), and the names of optimizer state in checkpoints.

What one component alone needs lives in that component: the mailbox's heartbeats,
the checkpoints' timing, the rebalancer's bookkeeping, the loss scale, the spot
checks under way."""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from coordinator.assign import Assignment
from coordinator.breakdown import StepBreakdown
from coordinator.plan import Plan
from protocol.wire.codecs import Codec

logger = logging.getLogger(__name__)

#: the prefix of optimizer-state tensors in a stage's state (``optim/<param>/<key>``)
OPTIM_PREFIX = "optim/"
#: the optimizer state AdamW keeps per parameter
OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")

#: how the reason a peer was dropped begins when it is excluded for the rest of the run
#: (it sent non-finite values or a non-finite loss), rather than lost (died, stalled)
EXCLUDED = "excluded: "
#: why a peer the swarm's host banned left the run
BANNED = f"{EXCLUDED}banned by the swarm's host"
#: the steps' compute kept per peer (the summary's medians are over these): the latest
#: this many; an epoch of a million steps kept them all, 32 bytes a peer a step
COMPUTE_KEEP = 1024


class PeerLost(Exception):
    """Planned peers failed; ``lost`` maps each to why, in one line. ``rollback_to``:
    the state after that many steps is the newest that can be trusted (a spot check of
    a committed step failed or could not finish), so the run rolls back at least to it."""

    def __init__(self, lost: dict[str, str], rollback_to: int | None = None) -> None:
        super().__init__("; ".join(f"{p}: {why}" for p, why in lost.items()))
        self.lost = lost
        self.rollback_to = rollback_to


@dataclass
class RunState:
    """The run's record: its plan epoch, its committed steps (``step`` counts them), the
    peers it lost, and the figures it reports."""

    epoch: int = 0
    step: int = 0
    plan: Assignment | None = None
    restore: str = "init"  # how the next dispatch sets the stages' state (messages.RESTORE_MODES)
    dispatched: bool = False  # the current epoch's assignments went out and every peer is ready
    reason: str = "first plan"  # why the current epoch started
    epoch_start: int = 0  # the step the current epoch started at
    dispatch_s: float = 0.0  # how long the last dispatch took (stages set up, links measured)
    specs: list[list[Any]] = field(default_factory=list)
    codecs: list[Codec] = field(default_factory=list)
    mbps: list[float] = field(default_factory=list)
    link_mbps: dict[tuple[str, str], float] = field(default_factory=dict)  # (from, to) -> Mbit/s, last probe
    lost: dict[str, str] = field(default_factory=dict)  # peer -> why it was dropped
    losses: list[float] = field(default_factory=list)  # per committed step
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (steps done, validation loss)
    step_seconds: list[float] = field(default_factory=list)  # every step's, redone ones too
    audited: list[bool] = field(default_factory=list)  # per step_seconds: whether spot checks ran in its time
    compute: dict[str, collections.deque[float]] = field(default_factory=dict)  # ``record_compute``
    link_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    raw_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    checkpoint_s: list[float] = field(default_factory=list)
    tokens: int = 0
    tokens_per_step: int = 0
    redone: int = 0
    spot_checks: int = 0  # micro-batches re-executed by a replica (coordinator.auditing)
    audit_wait_s: float = 0.0  # how long commits waited for the spot checks of the step before
    audit_compute_s: float = 0.0  # the peers' compute on spot checks (as they report it)
    train_compute_s: float = 0.0  # the peers' compute on training steps (as they report it)
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    checks_planned: int = 0  # rebalance checks that planned (beside the steps)
    check_planning_s: float = 0.0  # how long they planned, in all
    breakdown: StepBreakdown = field(default_factory=StepBreakdown)  # where the peers' step time goes, per stage
    # the last rebalance check's price of the current plan on the speeds the swarm
    # measured, where the check kept it: (the step it was made at, the plan priced)
    repriced: tuple[int, Plan] | None = None

    @property
    def planned(self) -> set[str]:
        return {p for group in self.plan.stages for p in group} if self.plan else set()

    def learn_links(self, sender: str, mbps: dict[str, float]) -> None:
        """Record ``sender``'s probes of its links to the next stage and to its stage's
        replicas (a peer's own claim about a link it uses: finite and positive, else
        ignored)."""
        for to, rate in mbps.items():
            if to != sender and math.isfinite(rate) and rate > 0:
                self.link_mbps[(sender, to)] = rate

    def record_compute(self, peer: str, seconds: float) -> None:
        """A peer's compute in one step of this epoch (its latest ``COMPUTE_KEEP`` kept)."""
        if peer not in self.compute:
            self.compute[peer] = collections.deque(maxlen=COMPUTE_KEEP)
        self.compute[peer].append(seconds)

    def next_epoch(self, plan: Assignment) -> None:
        """The plan changes: a new epoch, whose stages are yet to be set up. The peers'
        compute per step starts again (each now runs other operators, or is dealt other
        micro-batches), and so does the step breakdown where the cut or a stage's replica
        count changed (a stage's number names other operators, or its peers do other work)."""
        sizes = [len(g) for g in plan.stages]
        if self.plan is None or plan.cut != self.plan.cut or sizes != [len(g) for g in self.plan.stages]:
            self.breakdown = StepBreakdown()
        self.plan, self.epoch, self.dispatched, self.repriced = plan, self.epoch + 1, False, None
        self.compute = {}

    def predicted(self) -> Plan | None:
        """The current plan's latest prediction: as the last rebalance check that kept it
        priced it on the speeds the swarm measured (``repriced``), else as planned."""
        if self.repriced is not None:
            return self.repriced[1]
        return self.plan.plan if self.plan is not None else None


def owner(name: str) -> str:
    """The weight a checkpoint tensor belongs to (``optim/<param>/<key>`` -> ``<param>``)."""
    return name[len(OPTIM_PREFIX) :].rsplit("/", 1)[0] if name.startswith(OPTIM_PREFIX) else name
