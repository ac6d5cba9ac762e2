"""Trace time of the OP-DAG and the cost of training through 4 in-process stages
against the whole model, measured side by side. Prints one JSON object."""

from __future__ import annotations

import json
import time

from coordinator.opdag import build_opdag
from fusionllm.local import train_reference, train_staged
from protocol.job import JobSpec


def _trace_seconds(job: JobSpec, repeats: int = 3) -> float:
    model = job.build_model()
    example = job.first_micro_batch()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        build_opdag(model, example)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    default = JobSpec()
    deep = JobSpec(model_args="n_layer=24")
    trace_default = _trace_seconds(default)
    trace_deep = _trace_seconds(deep)
    job = JobSpec(steps=40)
    train_reference(JobSpec(steps=3))  # warm-up: data loading, allocator
    ref_s, st_s = [], []
    for _ in range(3):  # interleaved so that machine noise hits both alike
        ref_s.append(train_reference(job).seconds)
        st_s.append(train_staged(job, 4).seconds)
    ratio = min(ref_s) / min(st_s)  # steps/s of stages over steps/s of reference
    print(
        json.dumps(
            {
                "trace_s_default": round(trace_default, 4),
                "trace_s_24layer": round(trace_deep, 4),
                "stages4_vs_reference_steps_ratio": round(ratio, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
