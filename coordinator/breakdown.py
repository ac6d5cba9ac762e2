"""Where the swarm's step time goes, stage by stage: the parts each peer reports with
its ``StepDone`` (``protocol.wire.messages.STEP_PARTS``), kept per stage, and their
medians beside the estimator's prediction where it makes one (compute: the stage's
forward and backward; wire: its links; the step). Means, not medians: the parts of a
mean add up to the mean step, as the run's time adds up."""

from __future__ import annotations

import collections
import math
import statistics
from typing import TYPE_CHECKING, Any

from coordinator.estimator import DagCosts, Plan, wire_pair
from coordinator.overheads import LIVE, REPLICA_CALLS, STEP_CALLS, Overheads, StageFacts, fitted, replica_messages
from protocol.wire.messages import StepDone
from protocol.wire.step_parts import BREAKDOWN_V, STEP_PARTS

if TYPE_CHECKING:
    from coordinator.runstate import RunState

#: windows kept per stage (the means are over these)
KEEP = 256
#: the status board's breakdown is refreshed every this many steps (the means are not free)
BOARD_EVERY = 10
#: one report's part may be at most this many seconds (an hour: no step takes longer)
MAX_PART_S = 3600.0


def accepted(msg: StepDone) -> dict[str, float] | None:
    """A StepDone's breakdown in seconds: only the layout this code reads, only the parts
    it knows (others ignored: a newer peer's), each a finite number in [0, an hour];
    None when the peer sent none (an older peer) or another layout."""
    if msg.breakdown_v != BREAKDOWN_V or not isinstance(msg.breakdown, dict):
        return None
    out: dict[str, float] = {}
    for part in (*STEP_PARTS, "step"):
        v = msg.breakdown.get(part, 0.0)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= MAX_PART_S
        if not ok:
            return None
        out[part] = float(v)
    return out if out["step"] > 0 else None


class StepBreakdown:
    """The recent breakdowns by stage (every replica's windows)."""

    def __init__(self) -> None:
        self.windows: dict[int, collections.deque[dict[str, float]]] = {}

    def record(self, stage: int, msg: StepDone) -> None:
        parts = accepted(msg)
        if parts is not None:
            self.windows.setdefault(stage, collections.deque(maxlen=KEEP)).append(parts)

    def windows_per_stage(self) -> int:
        """The fewest windows any stage has reported (0: none yet): the coordinator's
        steps that the means cover are its last this many, whose first, before any
        peer's first StepDone, no window holds."""
        return min((len(w) for w in self.windows.values()), default=0)

    def means_ms(self) -> dict[int, dict[str, float]]:
        """Per stage, each part's mean over its windows, in ms."""
        out = {}
        for stage, windows in sorted(self.windows.items()):
            # lists, not generators: fmean counts a generator one item at a time (2.0 ms against 1.2 a table)
            out[stage] = {p: round(statistics.fmean([w[p] for w in windows]) * 1e3, 3) for p in (*STEP_PARTS, "step")}
        return out

    def table(self, stage_s: list[float], link_s: list[float], iteration_s: float, mbs: int) -> list[dict[str, Any]]:
        """Per stage: ``measured_ms`` (part -> mean ms) and ``predicted_ms`` (the
        estimator's ``compute`` = forward + backward, ``wire`` and ``step``, for ``mbs``
        micro-batches a replica; absent where the plan has no figure)."""
        rows = []
        for stage, measured in self.means_ms().items():
            predicted: dict[str, float] = {}
            if stage < len(stage_s):
                predicted["compute"] = round(stage_s[stage] * mbs * 1e3, 3)
            near = [link_s[b] for b in (stage - 1, stage) if 0 <= b < len(link_s)]
            if near:
                predicted["wire"] = round(sum(near) * mbs * 1e3, 3)
            if math.isfinite(iteration_s):
                predicted["step"] = round(iteration_s * 1e3, 3)
            rows.append({"stage": stage, "measured_ms": measured, "predicted_ms": predicted})
        return rows


def breakdown_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The summary's lines: one per stage, each part's mean ms (predicted beside it)."""
    lines = []
    for row in rows:
        m, pred = row["measured_ms"], row["predicted_ms"]
        shown = []
        for part in STEP_PARTS:
            if part == "backward" and "compute" in pred:
                shown.append(f"backward {m[part]:.1f} (forward+backward predicted {pred['compute']:.1f})")
            elif part == "wire" and "wire" in pred:
                shown.append(f"wire {m[part]:.1f} (predicted {pred['wire']:.1f})")
            elif m[part] >= 0.05:
                shown.append(f"{part} {m[part]:.1f}")
        step = f"{m['step']:.1f} ms" + (f" (predicted {pred['step']:.1f})" if "step" in pred else "")
        lines.append(f"  stage {row['stage']} step {step}: " + ", ".join(shown) + " ms")
    return lines


def breakdown_table(st: RunState, micro_batches: int) -> list[dict[str, Any]]:
    """``StepBreakdown.table`` of a run's record, with its plan's latest predictions."""
    plan = st.predicted()
    if plan is None:
        return st.breakdown.table([], [], math.inf, micro_batches)
    return st.breakdown.table(plan.stage_s, plan.link_s, plan.iteration_s, micro_batches)


def stage_facts(costs: DagCosts, plan: Plan, micro_batches: int) -> dict[int, StageFacts]:
    """What each stage of ``plan`` does in a step, on its average replica (what
    ``overheads.fitted`` reads its breakdown against): its compute calls, the messages it
    sends and receives (a micro-batch each way per neighbouring stage, and its replicas'
    gradients: ``overheads.replica_messages``), their bytes on the wire, its parameter bytes."""
    out = {}
    for s, ((lo, hi), g) in enumerate(zip(plan.ranges(costs.num_ops), plan.groups)):
        r, params = len(g), costs.stage_params(lo, hi)
        runs = micro_batches / r
        near = [sum(wire_pair(costs, plan.cut[b], plan.codecs[b])) for b in (s - 1, s) if 0 <= b < len(plan.cut)]
        grads = replica_messages(r, runs, micro_batches)  # sent and received
        calls = 2 * runs + STEP_CALLS + (REPLICA_CALLS if r > 1 else 0)
        out[s] = StageFacts(calls, 2 * runs * len(near) + grads, runs * sum(near) + grads * params, params)
    return out


def run_overheads(means_ms: dict[int, dict[str, float]], costs: DagCosts, plan: Plan, micro_batches: int) -> Overheads:
    """The swarm's own fixed costs (``overheads.fitted``) from its peers' breakdowns
    (``StepBreakdown.means_ms``, taken on the event loop) against what each stage of the
    running ``plan`` does: the commit's round trip, handing off, encoding and the
    optimizer as this machine delivers them, ``LIVE``'s figures where no stage reports
    a part. A 2-core machine shared by four peers, their daemons and the coordinator
    took 2-3x ``LIVE``'s commit (a quiet one's)."""
    return fitted(means_ms, stage_facts(costs, plan, micro_batches), LIVE)
