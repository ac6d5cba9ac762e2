"""What a finished run reports (``RunSummary``), from its final state: the traffic
across each stage boundary and the estimator's prediction next to what ran."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from coordinator.assign import Assignment, live_profile, network_from_adverts
from coordinator.breakdown import breakdown_table, run_overheads
from coordinator.delivered import for_delivered
from coordinator.estimator import DagCosts
from coordinator.opdag import OpDag
from coordinator.outcome import LinkReport, RunSummary
from coordinator.runstate import RunState
from protocol.trust.spotcheck import step_overhead
from protocol.wire.messages import Advert


def summarize(
    st: RunState,
    final: dict[str, torch.Tensor],
    seconds: float,
    adverts: dict[str, Advert],
    connections: dict[str, str],
    forwarded_bytes: int,
    micro_batches: int,
    dag: OpDag | None = None,
) -> RunSummary:
    """The summary of a run that ended in ``st`` with the trained ``final`` state; with
    the model's ``dag``, the plan is also predicted again for the compute its peers
    delivered (``delivered_step``)."""
    assert st.plan is not None
    links = {f"{src[-6:]}->{dst[-6:]}": n for src, sent in st.link_bytes.items() for dst, n in sent.items()}
    wire = traffic(st.plan, st.link_bytes, st.raw_bytes)
    reports = [LinkReport(b, str(c), st.mbps[b], w, r) for b, (c, (w, r)) in enumerate(zip(st.codecs, wire))]
    return RunSummary(
        st.losses,
        seconds,
        st.tokens,
        st.plan,
        adverts,
        links,
        final,
        reports,
        _with_breakdown(_estimate(st, adverts, micro_batches, dag), st, micro_batches),
        epochs=st.epoch + 1,
        failures=len(st.lost),
        steps_redone=st.redone,
        checkpoint_s=list(st.checkpoint_s),
        step_seconds=list(st.step_seconds),
        rebalances=list(st.rebalances),
        checks_planned=st.checks_planned,
        check_planning_s=st.check_planning_s,
        val_losses=list(st.val_losses),
        spot_checks=st.spot_checks,
        audit_wait_s=st.audit_wait_s,
        audit_share=st.audit_compute_s / max(st.train_compute_s, 1e-9),
        check_overhead=step_overhead(st.step_seconds, st.audited),
        connections={p: connections.get(p, "direct") for p in st.planned},
        forwarded_bytes=forwarded_bytes,
    )


def _estimate(st: RunState, adverts: dict[str, Advert], micro_batches: int, dag: OpDag | None) -> dict[str, Any]:
    """``estimate`` with, where it can be made, ``delivered_step_s``: ``delivered_step``."""
    est = estimate(st, micro_batches)
    if est and dag is not None and st.plan is not None and st.plan.plan is not None:
        got = delivered_step(DagCosts.from_opdag(dag), st, adverts, micro_batches)
        if got is not None:
            est["delivered_step_s"] = round(got, 5)
    return est


def delivered_step(costs: DagCosts, st: RunState, adverts: dict[str, Advert], micro_batches: int) -> float | None:
    """The run's plan predicted again (``coordinator.delivered.for_delivered``) with each
    peer at the compute it delivered (the median of its steps' compute over the
    micro-batches dealt to it) over the links as last measured, with the swarm's own
    fixed costs (``breakdown.run_overheads``); None when a peer of the
    plan's groups has no advert or compute, or when the stages no longer are those groups
    (a recovery dropped a replica without planning again: the plan names a peer gone)."""
    plan = st.plan.plan if st.plan else None
    if plan is None or st.plan is None or [list(g) for g in plan.groups] != [list(g) for g in st.plan.stages]:
        return None
    peers = [p for group in plan.groups for p in group]
    if any(p not in adverts or not st.compute.get(p) for p in peers):
        return None
    if len(st.codecs) == len(plan.cut):  # the codecs its links run
        plan = dataclasses.replace(plan, codecs=list(st.codecs))
    live = [adverts[p] for p in peers]
    own = run_overheads(st.breakdown.means_ms(), costs, plan, micro_batches)  # as the checks price the plan
    profiles = {a.peer_id: live_profile(a, own) for a in live}
    network = network_from_adverts(live, st.link_mbps)
    per_mb = per_micro_batch(st.plan, st.compute, micro_batches)
    return for_delivered(costs, plan, profiles, network, micro_batches, per_mb).iteration_s


def per_micro_batch(plan: Assignment, compute: Mapping[str, Sequence[float]], mbs: int) -> dict[str, float]:
    """Each planned peer's compute per micro-batch: the median of its (latest) steps' forward
    plus backward compute over the micro-batches dealt to it (a peer with none yet is
    left out)."""
    return {
        p: statistics.median(compute[p]) / max(len(range(r, mbs, len(group))), 1)
        for group in plan.stages
        for r, p in enumerate(group)
        if compute.get(p)
    }


def _with_breakdown(est: dict[str, Any], st: RunState, micro_batches: int) -> dict[str, Any]:
    """The estimate with the peers' step breakdown per stage (``coordinator.breakdown``) beside it."""
    if not est:
        return est
    covered = st.step_seconds[-st.breakdown.windows_per_stage() :] or st.step_seconds  # the steps the windows cover
    return {**est, "breakdown": breakdown_table(st, micro_batches), "mean_step_s": statistics.fmean(covered)}


def traffic(plan: Assignment, wire: dict[str, dict[str, int]], raw: dict[str, dict[str, int]]) -> list[tuple[int, int]]:
    """(wire, raw) bytes so far across each stage boundary, both directions, from the
    peers' cumulative per-destination counts."""
    stage_of = {p: s for s, group in enumerate(plan.stages) for p in group}
    out = [[0, 0] for _ in range(len(plan.stages) - 1)]
    for src, sent in wire.items():
        for dst, n in sent.items():
            if dst in stage_of and src in stage_of and abs(stage_of[dst] - stage_of[src]) == 1:
                b = min(stage_of[src], stage_of[dst])
                out[b][0] += n
                out[b][1] += raw.get(src, {}).get(dst, n)
    return [(w, r) for w, r in out]


def estimate(st: RunState, mbs: int) -> dict[str, Any]:
    """The estimator's predicted step and per-stage times next to the measured ones
    (medians over the steps; a stage's time per micro-batch is its peers' forward
    plus backward compute divided by the micro-batches each handled). The prediction
    is the plan's latest (``RunState.predicted``): where a rebalance check priced the
    plan again on the speeds the swarm measured, ``repriced_at_step`` says when and
    ``planned_step_s`` what the plan was predicted on the peers' start-up readings."""
    plan, predicted = st.plan, st.predicted()
    if plan is None or plan.plan is None or predicted is None or not st.step_seconds:
        return {}
    stages = []
    each = per_micro_batch(plan, st.compute, mbs)
    for s, group in enumerate(plan.stages):
        per_mb = [each[p] for p in group if p in each]
        stages.append(
            {
                "stage": s,
                "predicted_ms": round(predicted.stage_s[s] * 1e3, 3),
                "measured_ms": round(statistics.median(per_mb) * 1e3, 3) if per_mb else None,
            }
        )
    out = {
        "predicted_step_s": round(predicted.iteration_s, 5),
        "measured_step_s": round(statistics.median(st.step_seconds), 5),
        "stages": stages,
    }
    if st.repriced is not None:
        out.update(repriced_at_step=st.repriced[0], planned_step_s=round(plan.plan.iteration_s, 5))
    return out
