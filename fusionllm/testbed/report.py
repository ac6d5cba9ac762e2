"""The testbed's report: per scheduler the measured median iteration, the estimator's
and the simulator's for the same plan, the bytes each boundary put on the wire and the
errors; the ratios the issue's goals name. One text table, or one JSON object."""

from __future__ import annotations

import math
from typing import Any

BLIND = ("bw-blind", "petals")  # the bandwidth-blind baselines OP-Fence is measured against


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return round(a / b, 4)


def row(measured_s: float, estimated_s: float, simulated_s: float, wire: list[int], plan: list[list[str]]) -> dict:
    """One scheduler's figures; errors are relative to the measured time."""
    est_err = ratio(estimated_s - measured_s, measured_s)
    sim_err = ratio(simulated_s - measured_s, measured_s)
    return {
        "measured_s": round(measured_s, 5),
        "estimated_s": round(estimated_s, 5),
        "simulated_s": round(simulated_s, 5),
        "wire_bytes": wire,
        "estimator_error": est_err,
        "simulator_error": sim_err,
        "plan": plan,
    }


def summary(schedulers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ratios over the rows: OP-Fence against the best blind baseline and dtfm (on
    what was run), the largest estimator error, and the largest with one delivered
    scale for every peer (``estimated_one_scale_s``, where the rows have it)."""
    measured = {k: v["measured_s"] for k, v in schedulers.items()}
    blind = [measured[k] for k in BLIND if k in measured]
    errors = [abs(v["estimator_error"]) for v in schedulers.values() if v["estimator_error"] is not None]
    one = [
        abs(x)
        for v in schedulers.values()
        if "estimated_one_scale_s" in v
        and (x := ratio(v["estimated_one_scale_s"] - v["measured_s"], v["measured_s"])) is not None
    ]
    return {
        "opfence_vs_best_blind_measured": ratio(min(blind), measured.get("opfence")) if blind else None,
        "opfence_vs_dtfm_measured": ratio(measured.get("opfence"), measured.get("dtfm")),
        "estimator_error_max": round(max(errors), 4) if errors else None,
        "estimator_error_max_one_scale": round(max(one), 4) if one else None,
    }


def table(result: dict[str, Any]) -> str:
    """The report as text."""
    lines = [f"topology {result['topology']}: {result['compute']}", result["links"]]
    cols = f"{'scheduler':<10} {'measured':>9} {'estimator':>10} {'simulator':>10} {'est.err':>8} {'sim.err':>8}"
    lines.append(cols + "  wire MB per boundary; plan")
    for name, r in result["schedulers"].items():
        wire = ", ".join(f"{b / 1e6:.2f}" for b in r["wire_bytes"]) or "-"
        plan = " | ".join(",".join(g) for g in r["plan"])
        lines.append(
            f"{name:<10} {_ms(r['measured_s']):>9} {_ms(r['estimated_s']):>10} {_ms(r['simulated_s']):>10} "
            f"{_pct(r['estimator_error']):>8} {_pct(r['simulator_error']):>8}  {wire}; {plan}{_compute(r)}"
        )
    for key, value in result.items():
        if key.startswith(("opfence_vs", "estimator_error", "auto_")) and value is not None:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms"


def _compute(r: dict[str, Any]) -> str:
    """The stages' compute measured over predicted, where the run printed it."""
    ratios = [x for x in r.get("compute_ratio") or [] if x is not None]
    return f"; compute x{', x'.join(f'{x:.2f}' for x in ratios)}" if ratios else ""
