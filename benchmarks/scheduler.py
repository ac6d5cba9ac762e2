"""OP-Fence against its baselines on the three paper-like testbeds (simulated, the
same seeded simulator for all), and how fast planning and simulation are at
scale. Prints one JSON object.

Workload: GPT-2 small (124M parameters, byte vocabulary) on 1024-token sequences,
16 micro-batches of 4 sequences per iteration. ``plan_s_1000peers_1000ops``:
OP-Fence on the ``internet-1k`` preset for a synthetic 1,000-op chain;
``sim_s_10000peers_100iters``: planning plus 100 simulated iterations of
``internet-10k`` with 20 churn events (joins, leaves, slow-downs) and re-plans.

``--short`` runs the same paths smaller, for the test suite: GPT-2 small's width
with 4 layers on 128-token sequences, 2 simulated iterations per testbed, a
300-op chain, and 20 iterations of ``internet-1k`` with the same 20 churn events;
the keys stay those of the full run."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass

from coordinator.estimator import DagCosts
from coordinator.opdag import build_opdag
from coordinator.scheduler import SCHEDULERS, Options, opfence
from protocol.job import JobSpec
from sim.engine import Churn, simulate
from sim.presets import MIXED, preset


@dataclass(frozen=True)
class Sizes:
    job: JobSpec  # the testbeds' workload
    iterations: int  # simulated iterations per testbed and scheduler
    plan_ops: int  # ops of the synthetic chain that OP-Fence plans on internet-1k
    sim_preset: str  # the topology of the timed simulation with churn
    sim_iterations: int


FULL = Sizes(
    job=JobSpec(model="gpt2", data_args="ctx=1024,batch_size=64", micro_batches=16),
    iterations=10,
    plan_ops=1000,
    sim_preset="internet-10k",
    sim_iterations=100,
)
SHORT = Sizes(
    job=JobSpec(model="gpt2", model_args="n_layer=4", data_args="ctx=128,batch_size=64", micro_batches=16),
    iterations=2,
    plan_ops=300,
    sim_preset="internet-1k",
    sim_iterations=20,
)


def gpt2_costs(job: JobSpec) -> DagCosts:
    return DagCosts.from_opdag(build_opdag(job.build_model(), job.first_micro_batch()))


def testbeds(costs: DagCosts, iterations: int) -> dict[str, dict[str, float]]:
    out = {}
    for name in MIXED:
        topo = preset(name)
        row = {}
        for s in SCHEDULERS:
            row[f"{s}_s"] = round(simulate(costs, topo, s, Options(micro_batches=16), iterations).mean_s, 4)
        best_baseline = min(row[f"{s}_s"] for s in SCHEDULERS if s != "opfence")
        row["speedup_vs_best_baseline"] = round(best_baseline / row["opfence_s"], 2)
        out[name] = row
    return out


def plan_time(num_ops: int) -> float:
    costs = DagCosts.synthetic(num_ops, seed=1)
    topo = preset("internet-1k")
    start = time.perf_counter()
    opfence(costs, topo.peers, topo.network, Options(micro_batches=16))
    return time.perf_counter() - start


def sim_time(name: str, iterations: int) -> float:
    costs = DagCosts.synthetic(200, seed=2)
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
    simulate(costs, topo, "opfence", Options(micro_batches=16), iterations, churn, held_out=held)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="a quick run of the same paths (for the test suite)")
    args = ap.parse_args()
    sizes = SHORT if args.short else FULL
    costs = gpt2_costs(sizes.job)
    out: dict[str, object] = {
        "testbeds": testbeds(costs, sizes.iterations),
        "plan_s_1000peers_1000ops": round(plan_time(sizes.plan_ops), 3),
        "sim_s_10000peers_100iters": round(sim_time(sizes.sim_preset, sizes.sim_iterations), 3),
    }
    if args.short:
        out["short"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
