"""A plan pinned from outside: the emulated testbed (``fusionllm testbed run``) plans
each scheduler on the topology it built, and the coordinator runs exactly that plan
(the same cut, the same hosts per stage) instead of planning on its adverts. The plan
names hosts by the address they listen on, as peer ids are only known once the peers
start; ``FUSIONLLM_TESTBED_PLAN`` names the plan's JSON file::

    {"scheduler": "opfence", "cut": [12, 40], "stages": [["10.78.0.2"], ["10.78.0.3"]],
     "iteration_s": 0.41, "stage_s": [0.1, 0.12], "codecs": ["none", "int8"], "edge_mbps": [1000, 20]}

The codecs are the planner's (under ``--compression auto`` they run unless a measured
link is far from ``edge_mbps``: ``coordinator.codec_choice.planned_or_repicked``).

Reading the file is the only I/O here (``from_env``); the mapping is a pure function."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.assign import Assignment
from coordinator.estimator import Plan
from protocol.model.graph import Cut
from protocol.wire.codecs import Codec
from protocol.wire.messages import Advert

ENV_VAR = "FUSIONLLM_TESTBED_PLAN"


@dataclass(frozen=True)
class PinnedPlan:
    scheduler: str
    cut: tuple[int, ...]
    stages: list[list[str]]  # hosts (listen addresses) per stage, in replica order
    iteration_s: float  # the estimator's prediction for it, on the testbed's links
    stage_s: list[float]
    codecs: list[Codec] = field(default_factory=list)  # per boundary, as the planner priced them (none: uncompressed)
    edge_mbps: list[float] = field(default_factory=list)  # per boundary, the bandwidth they were priced for

    @classmethod
    def decode(cls, data: Any) -> PinnedPlan:
        """A pinned plan from its JSON value; ValueError in one line when it is not one."""
        try:
            stages = [[str(h) for h in group] for group in data["stages"]]
            cut = tuple(int(c) for c in data["cut"])
            plan = cls(
                str(data["scheduler"]),
                cut,
                stages,
                float(data["iteration_s"]),
                [float(s) for s in data.get("stage_s", [])],
                [Codec.parse(str(c)) for c in data.get("codecs", [])],
                [float(x) for x in data.get("edge_mbps", [])],
            )
        except (KeyError, TypeError, ValueError) as exc:  # CodecError is a ValueError
            raise ValueError(f"{ENV_VAR}: not a pinned plan ({type(exc).__name__}: {exc})") from None
        if not stages or any(not g for g in stages) or len(cut) != len(stages) - 1 or list(cut) != sorted(set(cut)):
            raise ValueError(f"{ENV_VAR}: {len(stages)} stages and cut {list(cut)} do not match")
        if any(len(x) not in (0, len(cut)) for x in (plan.codecs, plan.edge_mbps)):
            raise ValueError(f"{ENV_VAR}: codecs and edge_mbps need one entry per boundary ({len(cut)})")
        return plan

    def assignment(self, adverts: list[Advert]) -> Assignment:
        """The pinned plan over the peers that advertised: each host's peer is the one
        whose advert lists an address on it. ValueError names a host no peer is on."""
        by_host = hosts_of(adverts)
        missing = [h for g in self.stages for h in g if h not in by_host]
        if missing:
            raise ValueError(f"the pinned plan names hosts no peer listens on: {', '.join(missing)}")
        groups = [[by_host[h] for h in g] for g in self.stages]
        codecs = self.codecs or [Codec() for _ in self.cut]
        stage_s = self.stage_s if len(self.stage_s) == len(groups) else [math.nan] * len(groups)
        plan = Plan(self.cut, groups, codecs, self.scheduler, self.iteration_s, stage_s=stage_s)
        plan.edge_mbps = list(self.edge_mbps)
        return Assignment(cut=Cut(self.cut), stages=groups, plan=plan)


def hosts_of(adverts: list[Advert]) -> dict[str, str]:
    """host -> the peer id whose advert lists an address on it (the first such advert)."""
    out: dict[str, str] = {}
    for a in adverts:
        for maddr in a.maddrs:
            parts = str(maddr).split("/")
            for proto, value in zip(parts, parts[1:]):
                if proto in ("ip4", "ip6"):
                    out.setdefault(value, a.peer_id)
    return out


def from_env(environ: Mapping[str, str] | None = None) -> PinnedPlan | None:
    """The plan ``FUSIONLLM_TESTBED_PLAN`` names (None when unset); ValueError in one line."""
    path = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{ENV_VAR}: cannot read {path}: {exc}") from None
    return PinnedPlan.decode(data)
