"""OP-Fence against bandwidth-unaware planners given the same tools (codecs, replicas,
leaving peers out) and against an evolutionary search (``dtfm``), on the same
estimator and simulator, for real workloads; and how fast planning and simulation
are at scale. Prints one JSON object.

Per preset (``sim.presets.MIXED``) and workload (``gpt2``, ``gpt2-xl``, ``llama-7b``
at their default batch, bf16 activations, ``coordinator.workloads``), every
scheduler's plan is run event by event (``sim.engine.iteration_seconds``, no
churn) and reported as:

- ``<name>_iter_s``: simulated seconds per iteration;
- ``<name>_to_loss_s``: seconds to the loss the uncompressed run reaches, that is
  the iteration time times the plan's steps factor (its codecs' statistical
  price, ``coordinator.codec_price``);
- ``<name>_plan_s``: planning seconds (the fastest of three runs, one in
  ``--short``: this machine is noisy);

plus ``needs_gpus`` (the fewest GPUs of the preset whose memory holds the model's
weights, gradients and Adam state), ``opfence_vs_best_blind`` (the best of
``bw-blind``, ``petals``, ``even``, ``compute``, ``random`` over OP-Fence, on time to
loss), ``opfence_vs_dtfm`` (OP-Fence's time to loss over dtfm's),
``opfence_plan_vs_dtfm`` (planning seconds, same way) and ``sim_vs_estimate`` (the
simulated iteration of OP-Fence's plan over the estimator's prediction).

``plan_s_1000peers_1000ops``: OP-Fence on ``internet-1k`` for llama-7b;
``sim_s_10000peers_100iters``: planning plus 100 simulated iterations of
``internet-10k`` for llama-7b with 20 churn events (joins, leaves, slow-downs) and
re-plans.

``demo_testbed1``: the same row for the demo's model (``fusionllm demo``'s byte-level
GPT, 4 micro-batches) on ``testbed1``, and ``demo_opfence_vs_dtfm10k``.

Planning that asks before it guesses (``sim.asking.ask``, what ``sim.engine`` runs
when OP-Fence plans), on ``homes-30`` seen through ``Network.infer`` of a few seeded
probes a peer (1 and 3; seeds 0-2; ``gpt2-xl`` and ``llama-7b``): ``homes30_asking``
holds each run, the best and worst of the ratio below (``asked_vs_unasked_min``,
``_max``) and the mean CPU seconds of planning without asking and with (``plan_s``,
``ask_plan_s``); over the runs (geometric means): ``homes30_probes_asked`` (links probed
per planning, mean), ``homes30_view_error_before`` / ``_after`` (``sim.asking.view_error``
on every finalist's links: the factor the view's bandwidth is off by),
``homes30_estimate_error_before`` / ``_after`` (the chosen plan's predicted time to
the loss against its simulated one, as a factor either way, without asking and
with) and ``homes30_asked_plan_vs_unasked`` (simulated time to the loss of the plan
chosen after asking over the one chosen without).

``--short`` runs the same paths smaller, for the test suite: two-layer shapes of
the workloads on one preset (``testbed1``), dtfm with a small budget, ``internet-1k`` with 10
simulated iterations; the keys stay those of the full run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from coordinator import dtfm
from coordinator.codec_price import plan_steps_factor
from coordinator.estimator import STATE_PER_PARAM_BYTE, DagCosts, PeerTable, Plan
from coordinator.netmodel import Network
from coordinator.opdag import build_opdag
from coordinator.opfence import opfence
from coordinator.plan_eval import Options
from coordinator.scheduler import SCHEDULERS, plan
from coordinator.workloads import WORKLOADS, workload_costs
from protocol.model.job import JobSpec
from sim.asking import ask
from sim.engine import Churn, iteration_seconds, simulate
from sim.presets import MIXED, preset
from sim.topology import Topology

BLIND = ("bw-blind", "petals", "even", "compute", "random")


@dataclass(frozen=True)
class Sizes:
    presets: tuple[str, ...]
    shape: dict[str, Any]  # changes to every workload's shape
    dtfm_evaluations: int | None  # None: dtfm's own budget from the swarm's size
    patient: int  # the patient dtfm's budget (10,000 in the full run)
    ask_runs: tuple[tuple[str, int, int], ...]  # homes-30 asking: (workload, probes a peer, seed)
    sim_preset: str  # the topology of the timed simulation with churn
    sim_iterations: int
    repeats: int  # planning runs per scheduler and case (the fastest counts)


ASK_RUNS = tuple((w, n, seed) for w in ("gpt2-xl", "llama-7b") for n in (1, 3) for seed in range(3))
FULL = Sizes(MIXED, {}, None, 10_000, ASK_RUNS, "internet-10k", 100, 3)
SHORT = Sizes(("testbed1",), {"n_layer": 2}, 200, 400, (("llama-7b", 1, 0),), "internet-1k", 10, 1)


def workload(name: str, shape: dict[str, Any]) -> tuple[DagCosts, int]:
    """A workload's costs at its default batch, and its micro-batches per iteration."""
    w = WORKLOADS[name]
    return workload_costs(name, w.batch_size, w.context, "bf16", shape or None), w.micro_batches


def needs_gpus(costs: DagCosts, topo: Topology) -> int:
    """The fewest of the preset's GPUs (largest memory first) that hold the training state."""
    state = STATE_PER_PARAM_BYTE * costs.stage_params(0, costs.num_ops)
    held, n = 0, 0
    for p in sorted(topo.peers, key=lambda p: -p.memory_bytes):
        if held >= state:
            break
        held, n = held + p.memory_bytes, n + 1
    return n


def run_one(name: str, costs: DagCosts, topo: Topology, options: Options, sizes: Sizes) -> dict[str, Any]:
    """A scheduler's plan, run event by event; planning seconds are the CPU seconds
    of the fastest of ``sizes.repeats`` runs (one for ``dtfm``, whose runs are long;
    the machine is shared, so CPU time, not wall time)."""
    times, extra = [], {}
    for _ in range(1 if name.startswith("dtfm") else sizes.repeats):
        start = time.process_time()
        if name.startswith("dtfm"):
            budget = sizes.patient if name == "dtfm10k" else sizes.dtfm_evaluations
            run = dtfm.dtfm_search(costs, topo.peers, topo.network, options, evaluations=budget)
            p, extra = run.plan, {"budget": run.budget, "converged": run.converged}
        else:
            p = plan(name, costs, topo.peers, topo.network, options)
        times.append(time.process_time() - start)
    planning = min(times)
    it = iteration_seconds(costs, p, PeerTable(topo.peers), topo.network, options.micro_batches)
    return {
        "iter_s": it,
        "to_loss_s": it * plan_steps_factor(p.codecs) if p.valid else math.inf,
        "plan_s": planning,
        "estimate_s": p.iteration_s,
        "stages": len(p.groups),
        "peers": sum(len(g) for g in p.groups),
        **extra,
    }


def compare(costs: DagCosts, mbs: int, topo: Topology, sizes: Sizes) -> dict[str, Any]:
    options = Options(micro_batches=mbs)
    runs = {s: run_one(s, costs, topo, options, sizes) for s in (*SCHEDULERS, "dtfm10k")}
    row: dict[str, Any] = {"needs_gpus": needs_gpus(costs, topo)}
    for s, r in runs.items():
        row.update({f"{s}_{k}": _round(v) for k, v in r.items() if k in ("iter_s", "to_loss_s", "plan_s")})
        row.update({f"{s}_{k}": v for k, v in r.items() if k in ("budget", "converged")})
    op = runs["opfence"]
    row["opfence_plan"] = f"{op['stages']} stages, {op['peers']} peers"
    row["opfence_vs_best_blind"] = _round(min(runs[s]["to_loss_s"] for s in BLIND) / op["to_loss_s"])
    row["opfence_vs_dtfm"] = _round(op["to_loss_s"] / runs["dtfm"]["to_loss_s"])
    row["opfence_plan_vs_dtfm"] = _round(op["plan_s"] / max(runs["dtfm"]["plan_s"], 1e-9))
    row["opfence_vs_dtfm10k"] = _round(op["to_loss_s"] / runs["dtfm10k"]["to_loss_s"])
    row["opfence_plan_vs_dtfm10k"] = _round(op["plan_s"] / max(runs["dtfm10k"]["plan_s"], 1e-9))
    row["sim_vs_estimate"] = _round(op["iter_s"] / op["estimate_s"])
    return row


def summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The goals over the cases that need four or more GPUs by memory (all cases'
    simulator-to-estimator range)."""
    big = [r for r in rows.values() if r["needs_gpus"] >= 4]
    ratios = [r["sim_vs_estimate"] for r in rows.values()]
    return {
        "cases_needing_4_gpus": len(big),
        "min_opfence_vs_best_blind": min((r["opfence_vs_best_blind"] for r in big), default=None),
        "max_opfence_vs_dtfm": max((r["opfence_vs_dtfm"] for r in big), default=None),
        "max_opfence_plan_vs_dtfm": max((r["opfence_plan_vs_dtfm"] for r in big), default=None),
        "max_opfence_vs_dtfm10k": max((r["opfence_vs_dtfm10k"] for r in big), default=None),
        "max_opfence_plan_vs_dtfm10k": max((r["opfence_plan_vs_dtfm10k"] for r in big), default=None),
        "sim_vs_estimate_range": [min(ratios), max(ratios)],
    }


def _round(x: float) -> float | str:
    return "inf" if math.isinf(x) else round(x, 4)


def demo_costs() -> tuple[DagCosts, int]:
    """The demo's model (the job's defaults: ``fusionllm demo`` and ``plan``'s), traced."""
    job = JobSpec()
    return DagCosts.from_opdag(build_opdag(job.checked_model(), job.first_micro_batch())), job.micro_batches


def _to_loss(costs: DagCosts, p: Plan, topo: Topology, mbs: int) -> float:
    """``p``'s simulated seconds to the loss on the true topology."""
    return iteration_seconds(costs, p, PeerTable(topo.peers), topo.network, mbs) * plan_steps_factor(p.codecs)


def ask_run(name: str, probes: int, seed: int, shape: dict[str, Any]) -> dict[str, Any]:
    """OP-Fence on ``homes-30`` as ``probes`` seeded probes a peer show it, without
    asking and with (``sim.asking.ask``); each plan simulated on the truth."""
    costs, mbs = workload(name, shape)
    topo, options = preset("homes-30"), Options(micro_batches=mbs, seed=seed)
    view = Network.infer(topo.peers, topo.probes(probes, seed))
    start = time.process_time()
    opfence(costs, topo.peers, view, options)
    plain_s = time.process_time() - start
    start = time.process_time()
    asked, report = ask(costs, topo.peers, view, topo.network, options)
    ask_s = time.process_time() - start
    unasked_s, asked_s = _to_loss(costs, report.unasked, topo, mbs), _to_loss(costs, asked.plan, topo, mbs)
    return {
        "workload": name,
        "probes_a_peer": probes,
        "seed": seed,
        "probed": report.probed,
        "view_error_before": round(report.error_before, 4),
        "view_error_after": round(report.error_after, 4),
        "unasked_predicted_s": round(report.unasked.to_loss_s, 3),
        "unasked_s": round(unasked_s, 3),
        "asked_predicted_s": round(asked.plan.to_loss_s, 3),
        "asked_s": round(asked_s, 3),
        "changed": report.changed,
        "plan_s": round(plain_s, 3),
        "ask_plan_s": round(ask_s, 3),
    }


def _factor(a: float, b: float) -> float:
    """How far apart ``a`` and ``b`` are, as a factor either way."""
    return max(a / b, b / a)


def _geomean(xs: list[float]) -> float:
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 4)


def asking_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``homes30_*`` figures over ``runs`` (``ask_run``'s)."""
    ratios = [r["asked_s"] / r["unasked_s"] for r in runs]
    return {
        "homes30_asking": {
            "runs": runs,
            "asked_vs_unasked_min": round(min(ratios), 4),
            "asked_vs_unasked_max": round(max(ratios), 4),
            "plan_s": round(sum(r["plan_s"] for r in runs) / len(runs), 3),
            "ask_plan_s": round(sum(r["ask_plan_s"] for r in runs) / len(runs), 3),
        },
        "homes30_probes_asked": round(sum(r["probed"] for r in runs) / len(runs), 2),
        "homes30_view_error_before": _geomean([r["view_error_before"] for r in runs]),
        "homes30_view_error_after": _geomean([r["view_error_after"] for r in runs]),
        "homes30_estimate_error_before": _geomean([_factor(r["unasked_predicted_s"], r["unasked_s"]) for r in runs]),
        "homes30_estimate_error_after": _geomean([_factor(r["asked_predicted_s"], r["asked_s"]) for r in runs]),
        "homes30_asked_plan_vs_unasked": _geomean(ratios),
    }


def plan_time(shape: dict[str, Any]) -> float:
    costs, mbs = workload("llama-7b", shape)
    topo = preset("internet-1k")
    start = time.perf_counter()
    opfence(costs, topo.peers, topo.network, Options(micro_batches=mbs))
    return time.perf_counter() - start


def sim_time(name: str, iterations: int, shape: dict[str, Any]) -> float:
    costs, mbs = workload("llama-7b", shape)
    topo = preset(name)
    rng = random.Random(0)
    ids = [p.id for p in topo.peers]
    held = set(ids[:50])
    churn = [
        Churn(
            rng.randrange(1, iterations),
            kind,
            rng.choice(sorted(held)) if kind == "join" else rng.choice(ids[50:]),
            0.5,
        )
        for kind in (["leave"] * 7 + ["slow"] * 7 + ["join"] * 6)
    ]
    start = time.perf_counter()
    simulate(costs, topo, "opfence", Options(micro_batches=mbs), iterations, churn, held_out=held)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="a quick run of the same paths (for the test suite)")
    args = ap.parse_args()
    sizes = SHORT if args.short else FULL
    loads = {name: workload(name, sizes.shape) for name in WORKLOADS}
    rows = {
        f"{p}/{w}": compare(costs, mbs, preset(p), sizes) for p in sizes.presets for w, (costs, mbs) in loads.items()
    }
    demo_costs_, demo_mbs = demo_costs()
    demo = compare(demo_costs_, demo_mbs, preset("testbed1"), sizes)
    out: dict[str, object] = {
        "cases": rows,
        **summary(rows),
        "demo_testbed1": demo,
        "demo_opfence_vs_dtfm10k": demo["opfence_vs_dtfm10k"],
        **asking_summary([ask_run(w, n, seed, sizes.shape) for w, n, seed in sizes.ask_runs]),
        "plan_s_1000peers_1000ops": round(plan_time(sizes.shape), 3),
        "sim_s_10000peers_100iters": round(sim_time(sizes.sim_preset, sizes.sim_iterations, sizes.shape), 3),
    }
    if args.short:
        out["short"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
