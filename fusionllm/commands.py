"""The subcommands behind ``fusionllm``; each takes the parsed arguments and
returns the exit code. Output here is the CLI's own, so ``print`` is allowed."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from coordinator.opdag import OpDag, balanced_cut, build_opdag
from coordinator.weights import InitError, read_init, read_state
from fusionllm.local import (
    TrainResult,
    check_stages,
    save_state,
    state_error,
    train_reference,
    train_staged,
)
from fusionllm.usage import UsageError, job_from_args, parse_cut
from protocol.model.graph import Cut
from protocol.trust.text import clean

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
    # Redraw often on a terminal, rarely into a log file.
    return tqdm(
        total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 5.0
    )


def _train(args: argparse.Namespace, stages: int | None, desc: str) -> TrainResult:
    job = job_from_args(args)
    cut: Cut | None = None
    model = job.checked_model()  # fail on a bad model, data or starting weights before the progress bar shows
    if job.init:
        read_init(job.init, model)
    if job.eval_every:
        job.eval_micro_batches()
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
    if args.threads:
        torch.set_num_threads(args.threads)
    result = _train(args, None if args.reference else args.stages, "reference" if args.reference else "stages")
    what = "whole model" if args.reference else f"{result.cut.num_stages} stages (cut {result.cut.to_list()})"
    for steps_done, loss in result.val_losses:
        print(f"validation loss after step {steps_done}: {loss:.6f}")
    print(
        f"trained {what}: {len(result.losses)} steps, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
        f"{result.tokens / result.seconds:,.0f} items/s" + (f", saved {args.save}" if args.save else "")
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    job = job_from_args(args)
    model = job.checked_model()
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
    try:
        states = [read_state(path, path) for path in (args.a, args.b)]
    except InitError as exc:  # missing, unreadable, not safetensors: one line naming the file
        raise UsageError(str(exc)) from None
    err = state_error(*states)
    ok = err <= args.tol
    print(f"largest relative error {err:.3g}: " + ("equal within" if ok else "differ beyond") + f" {args.tol:g}")
    return 0 if ok else 1


def _ago(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


_clean = clean  # text from the coordinator, much of it peer-supplied


def _peer_line(p: dict[str, Any], now: float) -> str:
    stage = "-" if p["stage"] is None else str(p["stage"])
    replica = "-" if p["replica"] is None else str(p["replica"])
    return (
        f"{_clean(p['id']):<54} {_clean(p['device'])[:12]:<12} {p['flops'] / 1e9:>8.1f} "
        f"{p['up_mbps']:>7.0f}/{p['down_mbps']:<7.0f} {_clean(p['connection']):<8} "
        f"{_clean(p.get('state', '-')):<8} {stage:>5} {replica:>7} {_ago(now - p['last_seen']):>6} "
        f"{_clean(p['health'])}"
    )


def _recovery_lines(st: dict[str, Any]) -> list[str]:
    rec, ck = st.get("recovery"), st.get("checkpoint")
    lines = []
    if rec:
        lines.append(
            f"epoch {rec['epoch']}  failures {rec['failures']}  rollbacks {rec['rollbacks']}  "
            f"steps redone {rec['steps_redone']}"
        )
    if ck:
        lines.append(
            f"last checkpoint: step {ck['step']}, {ck['bytes'] / 1e6:.2f} MB in {ck['seconds']:.1f} s, "
            f"{_ago(st['now'] - ck['at'])} ago: {_clean(ck['path'])}"
        )
    elif rec:
        lines.append("last checkpoint: none yet")
    return lines


def _num(value: Any, spec: str) -> str:
    """A number of the status JSON: '-' when absent, as sent when not a number
    (non-finite values arrive as "NaN" or "Infinity")."""
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) else _clean(value)[:16]


def render_status(st: dict[str, Any]) -> str:
    """The status page as terminal text."""
    tr = st["training"]
    loss, tps = _num(tr["loss"], ".4f"), _num(tr["tokens_per_s"], ",.0f")
    if tr.get("val_loss") is not None:
        loss += f"  validation loss {_num(tr['val_loss'], '.4f')}"
    eta = "-" if tr["eta_s"] is None else _ago(tr["eta_s"])
    lines = [
        f"run {_clean(st['run_id'])}: {_clean(st['phase'])}" + (f" ({_clean(st['message'])})" if st["message"] else ""),
        f"step {tr['step']}/{tr['steps']}  loss {loss}  tokens/s {tps}  elapsed {_ago(tr['elapsed_s'])}  ETA {eta}",
        *_recovery_lines(st),
        "",
        f"{'peer':<54} {'device':<12} {'GFLOP/s':>8} {'up/down Mbit/s':>15} {'conn':<8} {'state':<8} stage replica "
        f"{'seen':>6} health",
    ]
    lines.extend(_peer_line(p, st["now"]) for p in st["peers"])
    if st["plan"]:
        lines.append("")
        for stg in st["plan"]["stages"]:
            lines.append(
                f"stage {stg['stage']}: ops {stg['first_op']}-{stg['last_op']}, {stg['flops'] / 1e6:.1f} MFLOP, "
                f"{stg['param_bytes'] / 1e6:.2f} MB of parameters"
            )
    for link in st["links"]:
        lines.append(
            f"boundary {link['boundary']} -> {link['boundary'] + 1}: {_clean(link['codec'])} at {link['mbps']} Mbit/s, "
            f"{link['wire_bytes'] / 1e6:.2f} MB on the wire for {link['raw_bytes'] / 1e6:.2f} MB, "
            f"ratio {link['ratio']}x"
        )
    if st["rejected"]:
        rejected = ", ".join(f"{_clean(k)} {v}" for k, v in sorted(st["rejected"].items()))
        lines.append("rejected messages: " + rejected)
    recent = [e for e in st["events"] if e["kind"] != "rejected"][-10:]  # rejections are counted above
    if recent:
        lines.append("")
        lines.append("recent events:")
        for e in recent:
            when = time.strftime("%H:%M:%S", time.localtime(e["t"]))
            lines.append(f"  {when} {_clean(e['kind'])}: {_clean(e['text'])}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    base = args.coordinator.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise UsageError(f"--coordinator '{args.coordinator}' is not an http:// or https:// URL")
    url = base + "/api/v1/state"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            state = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(f"fusionllm: error: {url} answered {exc.code} {exc.reason}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"fusionllm: error: cannot read the status at {url}: {reason}", file=sys.stderr)
        return 1
    print(json.dumps(state, indent=1) if args.json else render_status(state))
    return 0
