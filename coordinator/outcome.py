"""What a run reports: its outcome, a step's report, the summary, a link's traffic,
and the one error that ends a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from coordinator.assign import Assignment
from protocol.wire.messages import Advert


class SwarmError(RuntimeError):
    """The run cannot go on; ``str()`` says why in one line."""


@dataclass
class StepReport:
    step: int
    loss: float
    seconds: float
    tokens: int


@dataclass
class RunSummary:
    losses: list[float]
    seconds: float
    tokens: int
    assignment: Assignment
    adverts: dict[str, Advert]
    link_bytes: dict[str, int]  # "src->dst" -> bytes
    state: dict[str, torch.Tensor]
    links: list[LinkReport] = field(default_factory=list)  # per stage boundary
    estimate: dict[str, Any] = field(default_factory=dict)  # the estimator's prediction next to what ran
    epochs: int = 1
    failures: int = 0
    steps_redone: int = 0
    checkpoint_s: list[float] = field(default_factory=list)  # seconds each checkpoint write took
    step_seconds: list[float] = field(default_factory=list)
    rebalances: list[dict[str, Any]] = field(default_factory=list)  # step, why, what moved, tokens/s before
    checks_planned: int = 0  # rebalance checks that planned, beside the steps
    check_planning_s: float = 0.0  # how long they planned, in all
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (steps done, validation loss)
    spot_checks: int = 0  # micro-batches re-executed by another replica
    audit_wait_s: float = 0.0  # seconds commits waited for spot checks still under way
    audit_share: float = 0.0  # the peers' compute on spot checks over their compute on training
    check_overhead: float | None = (
        None  # what spot checks cost the median step (protocol.trust.spotcheck.step_overhead)
    )
    connections: dict[str, str] = field(default_factory=dict)  # planned peer -> direct, dial-out or forwarded
    forwarded_bytes: int = 0  # frames this coordinator passed between peers behind NATs


@dataclass
class LinkReport:
    """One stage boundary: its codec, measured bandwidth and traffic (both ways)."""

    boundary: int
    codec: str
    mbps: float
    wire_bytes: int
    raw_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(self.wire_bytes, 1)
