"""The subcommands behind ``fusionllm``; each takes the parsed arguments and
returns the exit code. Output here is the CLI's own, so ``print`` is allowed."""

from __future__ import annotations

import argparse
import json
import math

from tqdm import tqdm

from coordinator.opdag import OpDag, balanced_cut, build_opdag
from fusionllm.cli import UsageError, job_from_args, parse_cut
from fusionllm.local import (
    TrainResult,
    check_stages,
    compare_checkpoints,
    save_state,
    train_reference,
    train_staged,
)
from protocol.graph import Cut

TOLERANCE = 1e-5


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"


def _cut_for(args: argparse.Namespace, dag: OpDag, stages: int) -> Cut:
    if getattr(args, "cut", None):
        cut = parse_cut(args.cut)
        dag.partition(cut)  # validates
        return cut
    if stages > dag.num_ops:
        raise UsageError(f"--stages {stages} is larger than the model's {dag.num_ops} ops")
    return balanced_cut(dag, stages)


def _bar(total: int, desc: str) -> tqdm:
    import sys

    # Redraw often on a terminal, rarely into a log file.
    return tqdm(
        total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 5.0
    )


def _train(args: argparse.Namespace, stages: int | None, desc: str) -> TrainResult:
    job = job_from_args(args)
    cut: Cut | None = None
    model = job.build_model()  # fail on a bad model or data before the progress bar shows
    example = job.first_micro_batch()
    if stages is not None:
        cut = _cut_for(args, build_opdag(model, example), stages)
    bar = _bar(job.steps, desc)

    def progress(step: int, loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update(1)

    try:
        result = train_reference(job, progress) if cut is None else train_staged(job, cut, progress)
    finally:
        bar.close()
    if args.save:
        save_state(result.model, args.save)
    return result


def cmd_train(args: argparse.Namespace) -> int:
    result = _train(args, None if args.reference else args.stages, "reference" if args.reference else "stages")
    what = "whole model" if args.reference else f"{result.cut.num_stages} stages (cut {result.cut.to_list()})"
    print(
        f"trained {what}: {len(result.losses)} steps, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
        f"{result.tokens / result.seconds:,.0f} items/s" + (f", saved {args.save}" if args.save else "")
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    job = job_from_args(args)
    model = job.build_model()
    dag = build_opdag(model, job.first_micro_batch())
    cut = _cut_for(args, dag, args.stages)
    errors = check_stages(job, cut)
    crossing = dag.boundary_bytes(cut)
    stages = dag.stage_costs(cut)
    ok = errors["max"] <= TOLERANCE
    if args.json:
        out = {
            "model": job.model,
            "num_ops": dag.num_ops,
            "total_flops": dag.total_flops,
            "total_param_bytes": dag.total_param_bytes,
            "ops": [o.__dict__ for o in dag.ops],
            "cut": cut.to_list(),
            "stages": stages,
            "boundary_bytes": crossing,
            "max_relative_error": errors["max"] if math.isfinite(errors["max"]) else None,
            "ok": ok,
        }
        print(json.dumps(out))
    else:
        print(f"{'#':>4} {'op':<28} {'target':<24} {'FLOPs':>8} {'params':>8} {'out':>8}  shape")
        starts = set(cut.boundaries)
        for o in dag.ops:
            if o.index in starts:
                print(f"{'':->4} stage {cut.stage_of_op(o.index)} " + "-" * 60)
            print(
                f"{o.index:>4} {o.name[:28]:<28} {o.target[:24]:<24} {_human(o.flops):>8} "
                f"{_human(o.param_bytes) + 'B':>8} {_human(o.out_bytes) + 'B':>8}  {o.out_shape}"
            )
        print(
            f"\n{dag.num_ops} ops, {_human(dag.total_flops)}FLOPs forward per micro-batch, "
            f"{_human(dag.total_param_bytes)}B of parameters"
        )
        for s, st in enumerate(stages):
            line = (
                f"stage {s}: ops {st['first_op']}..{st['last_op']}, {_human(st['flops'])}FLOPs, "
                f"{_human(st['param_bytes'])}B params"
            )
            if s < len(crossing):
                line += f"; sends {_human(crossing[s])}B per micro-batch to stage {s + 1}"
            print(line)
        print(
            f"check: {cut.num_stages} stages vs whole model, largest relative error "
            f"{errors['max']:.3g} (loss {errors['loss']:.3g}, gradients {errors['grad']:.3g}): "
            + ("OK" if ok else f"FAILED (> {TOLERANCE:g})")
        )
    return 0 if ok else 1


def cmd_compare(args: argparse.Namespace) -> int:
    for path in (args.a, args.b):
        try:
            open(path, "rb").close()
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    err = compare_checkpoints(args.a, args.b)
    ok = err <= args.tol
    print(f"largest relative error {err:.3g}: " + ("equal within" if ok else "differ beyond") + f" {args.tol:g}")
    return 0 if ok else 1
