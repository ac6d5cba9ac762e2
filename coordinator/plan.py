"""A plan: the stage boundaries a scheduler chose, the peers of each stage, the codec
of each cut edge, and what the estimator (``coordinator.estimator``) predicts for it;
and the peers by id that a search reads them from."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator.netmodel import PeerProfile
from protocol.wire.codecs import Codec


@dataclass
class Plan:
    """Stage boundaries, the peers of each stage (replica order), the codec of each
    cut edge, and what the estimator predicts for it."""

    cut: tuple[int, ...]
    groups: list[list[str]]
    codecs: list[Codec]
    scheduler: str = ""
    iteration_s: float = math.inf
    lower_bound_s: float = 0.0
    stage_s: list[float] = field(default_factory=list)
    link_s: list[float] = field(default_factory=list)
    allreduce_s: list[float] = field(default_factory=list)  # per micro-batch: replicas' gradient sends
    edge_mbps: list[float] = field(default_factory=list)  # per boundary: its busiest pair's Mbit/s per micro-batch
    fits_memory: bool = True
    empty_stage: bool = False  # a stage computes (almost) nothing: never chosen
    steps_factor: float = 1.0  # its codecs' statistical price (coordinator.codec_price)

    def bare(self) -> Plan:
        """The same cut, groups, codecs and scheduler, unpriced: to be predicted again."""
        return Plan(tuple(self.cut), [list(g) for g in self.groups], list(self.codecs), self.scheduler)

    @property
    def to_loss_s(self) -> float:
        """Seconds to the loss the uncompressed run reaches, per iteration it takes."""
        return self.iteration_s * self.steps_factor

    @property
    def valid(self) -> bool:
        """Whether a scheduler may choose it: it fits memory and every stage computes."""
        return self.fits_memory and not self.empty_stage

    def ranges(self, num_ops: int) -> list[tuple[int, int]]:
        bounds = (0, *self.cut, num_ops)
        return list(zip(bounds[:-1], bounds[1:]))

    def to_json(self, num_ops: int) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "iteration_s": self.iteration_s,
            "steps_factor": self.steps_factor,
            "to_loss_s": self.to_loss_s,
            "lower_bound_s": self.lower_bound_s,
            "fits_memory": self.fits_memory,
            "empty_stage": self.empty_stage,
            "stages": [
                {"stage": s, "first_op": lo, "last_op": hi - 1, "peers": g, "seconds_per_micro_batch": t}
                for s, ((lo, hi), g, t) in enumerate(zip(self.ranges(num_ops), self.groups, self.stage_s))
            ],
            "links": [
                {"boundary": b, "after_op": self.cut[b] - 1, "codec": str(c), "seconds_per_micro_batch": t}
                for b, (c, t) in enumerate(zip(self.codecs, self.link_s))
            ],
            "allreduce_s": self.allreduce_s,
        }


class PeerTable(dict[str, PeerProfile]):
    """Peers by id, with their total FLOP/s summed once (do not mutate)."""

    def __init__(self, peers: Iterable[PeerProfile]) -> None:
        super().__init__((p.id, p) for p in peers)
        self.total_flops = sum(p.flops for p in self.values())
