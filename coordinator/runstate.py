"""The state a swarm run's phases share (:class:`RunState`), the failure they raise
(:class:`PeerLost`), and the names of optimizer state in checkpoints."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from coordinator.assign import Assignment
from coordinator.checkpoint import CheckpointInfo
from protocol.model.recipe import NO_SCALE, LossScale, Update
from protocol.wire.codecs import Codec

if TYPE_CHECKING:
    from coordinator.checkpoint import RunDir
    from coordinator.config import CoordinatorConfig
    from coordinator.swarm import Coordinator
    from protocol.model.job import JobSpec

logger = logging.getLogger(__name__)

#: the prefix of optimizer-state tensors in a stage's state (``optim/<param>/<key>``)
OPTIM_PREFIX = "optim/"
#: the optimizer state AdamW keeps per parameter
OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")


class DriverParts:
    """What the driver's parts (``coordinator.messaging``, ``coordinator.checkpointing``)
    find on the driver they are mixed into."""

    coord: Coordinator
    cfg: CoordinatorConfig
    job: JobSpec
    model: torch.nn.Module
    run_dir: RunDir
    st: RunState
    on_event: Callable[[str], None]


#: how the reason a peer was dropped begins when it is excluded for the rest of the run
#: (it sent non-finite values or a non-finite loss), rather than lost (died, stalled)
EXCLUDED = "excluded: "
#: why a peer the swarm's host banned left the run
BANNED = f"{EXCLUDED}banned by the swarm's host"


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
    """Everything the phases share. ``step`` counts committed steps."""

    epoch: int = 0
    step: int = 0
    plan: Assignment | None = None
    restore: str = "init"  # how the next dispatch sets the stages' state (messages.RESTORE_MODES)
    dispatched: bool = False  # the current epoch's assignments went out and every peer is ready
    reason: str = "first plan"  # why the current epoch started
    specs: list[list[Any]] = field(default_factory=list)
    codecs: list[Codec] = field(default_factory=list)
    mbps: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # per committed step
    step_seconds: list[float] = field(default_factory=list)
    audited: list[bool] = field(default_factory=list)  # per step_seconds: whether spot checks ran in its time
    compute: dict[str, list[float]] = field(default_factory=dict)
    link_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    raw_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)  # peer -> why it was dropped
    last_heard: dict[str, float] = field(default_factory=dict)  # monotonic seconds
    checkpoint: CheckpointInfo | None = None
    parts: dict[tuple[int, int], dict[int, dict[str, torch.Tensor]]] = field(default_factory=dict)
    writes: list[asyncio.Task[None]] = field(default_factory=list)
    checkpoint_s: list[float] = field(default_factory=list)
    trained_s: float = 0.0  # seconds of steps so far (redone ones too)
    trained_at_checkpoint: float = 0.0  # trained_s when the last checkpoint was asked for
    checkpoint_cost_s: float | None = None  # measured: asked for -> written
    asked_at: dict[int, float] = field(default_factory=dict)  # step -> when its checkpoint was asked for
    tokens: int = 0
    tokens_per_step: int = 0
    redone: int = 0
    spot_checks: int = 0  # micro-batches re-executed by a replica (coordinator.auditing)
    audit_wait_s: float = 0.0  # how long commits waited for the spot checks of the step before
    audit_compute_s: float = 0.0  # the peers' compute on spot checks (as they report it)
    train_compute_s: float = 0.0  # the peers' compute on training steps (as they report it)
    model_failures: dict[tuple[int, str], set[str]] = field(default_factory=dict)  # (step, reason) -> reporters
    speeds: dict[str, list[float]] = field(default_factory=dict)  # peer -> measured effective FLOP/s
    levels: dict[str, list[float | None]] = field(default_factory=dict)  # peer -> its speed at each check
    levels_epoch: int = -1  # the plan epoch of the last check that recorded levels
    epoch_start: int = 0  # the step the current epoch started at
    dispatch_s: float = 0.0  # how long the last dispatch took (stages set up, links measured)
    last_rebalance: int = -(10**9)  # the step of the last rebalance
    rebalance_why: str = ""
    link_mbps: dict[tuple[str, str], float] = field(default_factory=dict)  # (from, to) -> Mbit/s, last probe
    rebalance_gain: float = 1.0  # the speed-up the decided rebalance predicts (current / candidate step time)
    rebalance_doubt: float = 0.0  # what the next rebalance must gain on top of REPLAN_GAIN (replan.next_doubt)
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    before_rebalance: Assignment | None = None  # the plan the last rebalance left (a revert goes back to it)
    reverted: set[str] = field(default_factory=set)  # plans a revert undid: not proposed again
    scale: LossScale = NO_SCALE  # the loss scale of step ``step`` (fp16)
    scale_at: dict[int, LossScale] = field(default_factory=dict)  # step -> its loss scale (for a rollback)
    last_update: Update = field(default_factory=Update)  # how step ``step - 1`` was committed
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (steps done, validation loss)

    @property
    def planned(self) -> set[str]:
        return {p for group in self.plan.stages for p in group} if self.plan else set()

    def learn_links(self, sender: str, mbps: dict[str, float]) -> None:
        """Record ``sender``'s probes of its links to the next stage (a peer's own claim
        about a link it uses: finite and positive, else ignored)."""
        for to, rate in mbps.items():
            if to != sender and math.isfinite(rate) and rate > 0:
                self.link_mbps[(sender, to)] = rate


def owner(name: str) -> str:
    """The weight a checkpoint tensor belongs to (``optim/<param>/<key>`` -> ``<param>``)."""
    return name[len(OPTIM_PREFIX) :].rsplit("/", 1)[0] if name.startswith(OPTIM_PREFIX) else name
