"""What a finished run reports (``RunSummary``), from its final state: the traffic
across each stage boundary and the estimator's prediction next to what ran."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from coordinator.assign import Assignment
from coordinator.breakdown import breakdown_table
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
) -> RunSummary:
    """The summary of a run that ended in ``st`` with the trained ``final`` state."""
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
        _with_breakdown(estimate(st.plan, st.compute, st.step_seconds, micro_batches), st, micro_batches),
        epochs=st.epoch + 1,
        failures=len(st.lost),
        steps_redone=st.redone,
        checkpoint_s=list(st.checkpoint_s),
        step_seconds=list(st.step_seconds),
        rebalances=list(st.rebalances),
        val_losses=list(st.val_losses),
        spot_checks=st.spot_checks,
        audit_wait_s=st.audit_wait_s,
        audit_share=st.audit_compute_s / max(st.train_compute_s, 1e-9),
        check_overhead=step_overhead(st.step_seconds, st.audited),
        connections={p: connections.get(p, "direct") for p in st.planned},
        forwarded_bytes=forwarded_bytes,
    )


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


def estimate(plan: Assignment, compute: dict[str, list[float]], step_seconds: list[float], mbs: int) -> dict[str, Any]:
    """The estimator's predicted step and per-stage times next to the measured ones
    (medians over the steps; a stage's time per micro-batch is its peers' forward
    plus backward compute divided by the micro-batches each handled)."""
    if plan.plan is None or not step_seconds:
        return {}
    stages = []
    for s, group in enumerate(plan.stages):
        per_mb = [
            statistics.median(compute[p]) / max(len(range(r, mbs, len(group))), 1)
            for r, p in enumerate(group)
            if compute.get(p)
        ]
        stages.append(
            {
                "stage": s,
                "predicted_ms": round(plan.plan.stage_s[s] * 1e3, 3),
                "measured_ms": round(statistics.median(per_mb) * 1e3, 3) if per_mb else None,
            }
        )
    return {
        "predicted_step_s": round(plan.plan.iteration_s, 5),
        "measured_step_s": round(statistics.median(step_seconds), 5),
        "stages": stages,
    }
