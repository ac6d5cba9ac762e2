"""What the rebalancer (``coordinator.rebalancing``) keeps between steps: the record of
what it measured and decided, a check's decision to move, and what a check's worker
thread priced."""

from __future__ import annotations

import dataclasses
import math

from coordinator.assign import Assignment
from coordinator.estimator import Plan


@dataclasses.dataclass
class RebalanceRecord:
    """What the rebalancer measured and decided so far."""

    speeds: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # peer -> measured FLOP/s
    levels: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)  # peer -> speed at each check
    levels_epoch: int = -1  # the plan epoch of the last check that recorded levels
    last_rebalance: int = -(10**9)  # the step of the last rebalance
    before_tokens_per_s: float | None = None  # the decided rebalance's tokens/s before it (its check's)
    why: str = ""  # why the decided rebalance moves
    gain: float = 1.0  # the speed-up the decided rebalance predicts (current / candidate step time)
    doubt: float = 0.0  # what the next rebalance must gain on top of REPLAN_GAIN (replan.next_doubt)
    before: Assignment | None = None  # the plan the last rebalance left (a revert goes back to it)
    moved_gain: float = 1.0  # the speed-up the last move was decided on (both plans priced bare)
    # plans a revert undid, each with the speed-up it was undone with: proposed again only
    # when predicted to gain far more (``replan.still_banned``)
    reverted: dict[str, float] = dataclasses.field(default_factory=dict)
    checked_at: float = -math.inf  # when the last check that planned began (clock seconds)
    check_cost_s: float = 0.0  # how long it planned (``replan.check_affordable``)
    checked_speeds: dict[str, float] = dataclasses.field(default_factory=dict)  # the speeds it planned on
    checked_unsettled: bool = False  # a speed still moving then, or its price newly off (``replan.mispriced``)
    checked_plan: str = ""  # the plan its speeds were measured on (``assign.signature``)
    price_error: float | None = None  # its ``replan.price_error``
    moved_speeds: dict[str, float] = dataclasses.field(default_factory=dict)  # those the last move planned on
    moved_plan: str = ""  # the plan they were measured on


@dataclasses.dataclass(frozen=True)
class Decided:
    """A check's decision to move, collected at a later step (dropped if the swarm changed
    since): the plan, the step and plan epoch it was checked at, why it moves, the
    speed-up it must deliver (fixed costs included), the speed-up it was decided on (both
    plans priced bare) and the tokens/s before it (up to the check's step)."""

    candidate: Assignment
    step: int
    epoch: int
    why: str
    gain: float
    moved_gain: float
    tokens_per_s: float


@dataclasses.dataclass(frozen=True)
class Priced:
    """What a check's worker thread found: OP-Fence's plan on the measured speeds, the
    current plan priced on them with the fixed costs and the codecs it runs (``current``)
    and, where the candidate is another plan, both priced without the fixed costs
    (``bare``: current, candidate) and the candidate with them (``candidate_s``)."""

    candidate: Assignment
    bare: tuple[float, float] | None = None
    current: Plan | None = None  # the current plan priced with the fixed costs
    candidate_s: float = 0.0  # the candidate's step seconds with the same fixed costs

    @property
    def current_s(self) -> float:
        """The current plan's predicted step seconds (0 where it was not priced)."""
        return self.current.iteration_s if self.current is not None else 0.0
