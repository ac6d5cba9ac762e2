"""OP-Fence against its baselines on the three paper-like testbeds (simulated, the
same seeded simulator for all), and how fast planning and simulation are at
scale. Prints one JSON object.

Workload: GPT-2 small (124M parameters, byte vocabulary) on 1024-token sequences,
16 micro-batches of 4 sequences per iteration. ``plan_s_1000peers_1000ops``:
OP-Fence on the ``internet-1k`` preset for a synthetic 1,000-op chain;
``sim_s_10000peers_100iters``: planning plus 100 simulated iterations of
``internet-10k`` with 20 churn events (joins, leaves, slow-downs) and re-plans."""

from __future__ import annotations

import json
import random
import time

from coordinator.estimator import DagCosts
from coordinator.opdag import build_opdag
from coordinator.scheduler import SCHEDULERS, Options, opfence
from protocol.job import JobSpec
from sim.engine import Churn, simulate
from sim.presets import MIXED, preset

ITERATIONS = 10


def gpt2_costs() -> DagCosts:
    job = JobSpec(model="gpt2", data_args="ctx=1024,batch_size=64", micro_batches=16)
    return DagCosts.from_opdag(build_opdag(job.build_model(), job.first_micro_batch()))


def testbeds(costs: DagCosts) -> dict[str, dict[str, float]]:
    out = {}
    for name in MIXED:
        topo = preset(name)
        row = {}
        for s in SCHEDULERS:
            row[f"{s}_s"] = round(simulate(costs, topo, s, Options(micro_batches=16), ITERATIONS).mean_s, 4)
        best_baseline = min(row[f"{s}_s"] for s in SCHEDULERS if s != "opfence")
        row["speedup_vs_best_baseline"] = round(best_baseline / row["opfence_s"], 2)
        out[name] = row
    return out


def plan_time() -> float:
    costs = DagCosts.synthetic(1000, seed=1)
    topo = preset("internet-1k")
    start = time.perf_counter()
    opfence(costs, topo.peers, topo.network, Options(micro_batches=16))
    return time.perf_counter() - start


def sim_time() -> float:
    costs = DagCosts.synthetic(200, seed=2)
    topo = preset("internet-10k")
    rng = random.Random(0)
    ids = [p.id for p in topo.peers]
    held = set(ids[:50])
    churn = [
        Churn(rng.randrange(1, 100), kind, rng.choice(sorted(held)) if kind == "join" else rng.choice(ids[50:]), 0.5)
        for kind in (["leave"] * 7 + ["slow"] * 7 + ["join"] * 6)
    ]
    start = time.perf_counter()
    simulate(costs, topo, "opfence", Options(micro_batches=16), 100, churn, held_out=held)
    return time.perf_counter() - start


def main() -> None:
    costs = gpt2_costs()
    out = {
        "testbeds": testbeds(costs),
        "plan_s_1000peers_1000ops": round(plan_time(), 3),
        "sim_s_10000peers_100iters": round(sim_time(), 3),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
