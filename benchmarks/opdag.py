"""Trace time of the OP-DAG and the cost of training through 4 in-process stages
against the whole model, measured side by side. Prints one JSON object.

``--short`` runs the same paths smaller, for the test suite: best of two traces of each
model, 4 training steps instead of 40, two interleaved rounds instead of three."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from coordinator.opdag import build_opdag
from fusionllm.local import train_reference, train_staged
from protocol.model.job import JobSpec


@dataclass(frozen=True)
class Sizes:
    traces: int  # timed traces of each model (best of)
    steps: int  # training steps of each timed run
    rounds: int  # interleaved (reference, stages) rounds (best of)
    warmup: int  # steps of the untimed warm-up run


FULL = Sizes(traces=3, steps=40, rounds=3, warmup=3)
SHORT = Sizes(traces=2, steps=4, rounds=2, warmup=1)


def _trace_seconds(job: JobSpec, repeats: int) -> float:
    model = job.build_model()
    example = job.first_micro_batch()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        build_opdag(model, example)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="a quick run of the same paths (for the test suite)")
    args = ap.parse_args()
    sizes = SHORT if args.short else FULL
    default = JobSpec()
    deep = JobSpec(model_args="n_layer=24")
    trace_default = _trace_seconds(default, sizes.traces)
    trace_deep = _trace_seconds(deep, sizes.traces)
    job = JobSpec(steps=sizes.steps)
    train_reference(JobSpec(steps=sizes.warmup))  # warm-up: data loading, allocator
    ref_s, st_s = [], []
    for _ in range(sizes.rounds):  # interleaved so that machine noise hits both alike
        ref_s.append(train_reference(job).seconds)
        st_s.append(train_staged(job, 4).seconds)
    ratio = min(ref_s) / min(st_s)  # steps/s of stages over steps/s of reference
    out: dict[str, object] = {
        "trace_s_default": round(trace_default, 4),
        "trace_s_24layer": round(trace_deep, 4),
        "stages4_vs_reference_steps_ratio": round(ratio, 4),
    }
    if args.short:
        out["short"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
