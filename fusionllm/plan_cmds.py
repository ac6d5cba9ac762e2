"""``fusionllm plan`` and ``fusionllm sim``: OP-Fence and its baselines on a
topology file or preset, without any GPU or weights."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from fusionllm.cli import UsageError, job_from_args


def _topology(text: str) -> Any:
    from sim.presets import PRESETS, preset
    from sim.topology import TopologyError, load

    if text in PRESETS:
        return preset(text)
    if not Path(text).exists():
        raise UsageError(f"--topology '{text}': no such file and not a preset ({', '.join(PRESETS)})")
    try:
        return load(text)
    except TopologyError as exc:
        raise UsageError(f"--topology {text}: {exc}") from None


def _costs(args: argparse.Namespace) -> Any:
    from coordinator.estimator import DagCosts
    from coordinator.opdag import build_opdag

    job = job_from_args(args)
    model = job.checked_model()
    return DagCosts.from_opdag(build_opdag(model, job.first_micro_batch()))


def _options(args: argparse.Namespace) -> Any:
    from coordinator.scheduler import Options

    return Options(
        micro_batches=args.micro_batches,
        max_stages=args.max_stages,
        compression=args.compression != "none",
        min_fraction=args.min_fraction,
        seed=args.seed,
        stages=args.stages,
    )


def _plan_text(p: Any, costs: Any) -> str:
    lines = [
        f"{p.scheduler}: {len(p.groups)} stages, predicted iteration {p.iteration_s:.4g} s "
        f"(lower bound {p.lower_bound_s:.4g} s){'' if p.fits_memory else ', DOES NOT FIT MEMORY'}"
    ]
    for s, ((lo, hi), g, t) in enumerate(zip(p.ranges(costs.num_ops), p.groups, p.stage_s)):
        names = ", ".join(g[:6]) + (f" and {len(g) - 6} more" if len(g) > 6 else "")
        lines.append(
            f"  stage {s}: ops {lo}-{hi - 1} ({costs.stage_flops(lo, hi) / 1e9:.2f} GFLOP), {len(g)} peers "
            f"[{names}], {t * 1e3:.2f} ms per micro-batch, all-reduce {p.allreduce_s[s] * 1e3:.1f} ms"
        )
    for b, (pos, c, t) in enumerate(zip(p.cut, p.codecs, p.link_s)):
        lines.append(
            f"  link {b} -> {b + 1} (after op {pos - 1}, {costs.cross_bytes[pos] / 1e6:.2f} MB per micro-batch): "
            f"{c}, {t * 1e3:.2f} ms"
        )
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    from coordinator.scheduler import ScheduleError, plan

    topo = _topology(args.topology)
    costs = _costs(args)
    try:
        p = plan(args.scheduler, costs, topo.peers, topo.network, _options(args))
    except ScheduleError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"num_ops": costs.num_ops, **p.to_json(costs.num_ops)}))
    else:
        print(_plan_text(p, costs))
    return 0


def churn_events(topo: Any, iterations: int, events: int, seed: int) -> tuple[list[Any], set[str]]:
    from sim.engine import Churn

    rng = random.Random(seed)
    ids = [p.id for p in topo.peers]
    held = set(rng.sample(ids, max(1, len(ids) // 20))) if events else set()
    out = []
    for _ in range(events):
        it = rng.randrange(1, max(2, iterations))
        kind = rng.choice(["leave", "slow", "join"])
        if kind == "join":
            out.append(Churn(it, "join", rng.choice(sorted(held))))
        else:  # half of them hit a peer the plan uses at that moment
            peer = rng.choice(ids) if rng.random() < 0.5 else f"@{rng.randrange(1 << 30)}"
            out.append(Churn(it, kind, peer, rng.choice([0.25, 0.5])))
    return out, held


def cmd_sim(args: argparse.Namespace) -> int:
    from coordinator.scheduler import SCHEDULERS, ScheduleError
    from sim.engine import simulate

    names = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEDULERS]
    if bad or not names:
        raise UsageError(f"--schedulers: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(SCHEDULERS)}")
    if args.plot and not args.plot.endswith(".png"):
        raise UsageError(f"--plot {args.plot}: the plot is a .png file")
    topo = _topology(args.topology)
    costs = _costs(args)
    churn, held = churn_events(topo, args.iterations, args.churn, args.seed)
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            r = simulate(costs, topo, name, _options(args), args.iterations, churn, held_out=held, policy=args.policy)
        except ScheduleError as exc:
            raise UsageError(f"{name}: {exc}") from None
        results[name] = (r, time.perf_counter() - start)
    if args.json:
        out = {
            "topology": topo.name,
            "iterations": args.iterations,
            "policy": args.policy,
            "schedulers": {
                n: {
                    "iteration_s": r.mean_s,
                    "lower_bound_s": r.lower_bound_s,
                    "predicted_s": r.predicted_s,
                    "replans": len(r.replans),
                    "redone": r.redone,
                    "goodput": r.goodput,
                    "wall_s": round(w, 3),
                }
                for n, (r, w) in results.items()
            },
        }
        print(json.dumps(out))
    else:
        print(f"{topo.name}: {len(topo.peers)} peers, {costs.num_ops} ops, {args.iterations} iterations")
        for n, (r, w) in results.items():
            print(
                f"  {n:<8} {r.mean_s:.4g} s per iteration (predicted {r.predicted_s:.4g} s, lower bound "
                f"{r.lower_bound_s:.4g} s, {len(r.replans)} re-plans, {r.redone} iterations redone, goodput "
                f"{r.goodput:.4g} iterations/s; simulated in {w:.1f} s)"
            )
    if args.plot:
        _plot(args.plot, {n: r for n, (r, _) in results.items()}, topo.name)
    return 0


def _plot(path: str, results: dict[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(range(len(r.iteration_s)), r.iteration_s, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("simulated seconds per iteration")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
