"""``fusionllm plan`` and ``fusionllm sim``: OP-Fence and its baselines on a
topology file or preset, without any GPU or weights."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionllm.usage import UsageError, job_from_args


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


@dataclass(frozen=True)
class Batch:
    """What one iteration of ``plan`` and ``sim`` trains: a built-in workload (None: a
    model run through its job spec) and its batch, with the defaults filled in."""

    workload: str | None
    micro_batches: int
    batch_size: int | None  # sequences per micro-batch (workloads only)
    seq_len: int | None  # tokens per sequence (workloads only)
    precision: str
    shape: str = ""  # --model-args: changes to the workload's shape

    @property
    def tokens(self) -> int:
        """Tokens per iteration (workloads only; 0 otherwise)."""
        return self.micro_batches * (self.batch_size or 0) * (self.seq_len or 0)


def batch_of(args: argparse.Namespace) -> Batch:
    """The batch the flags ask for; :class:`UsageError` for flags the model cannot take."""
    from coordinator.plan_options import DEFAULT_PRECISION, WORKLOADS
    from protocol.model.job import JobSpec

    w = WORKLOADS.get(args.model)
    if w is None:
        for flag, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
            if value is not None:
                raise UsageError(
                    f"{flag} applies to the built-in workloads ({', '.join(WORKLOADS)}); "
                    f"model '{args.model}' takes its batch from its data (--data-args)"
                )
        return Batch(None, args.micro_batches or JobSpec.micro_batches, None, None, args.precision or JobSpec.precision)
    return Batch(
        w.name,
        args.micro_batches or w.micro_batches,
        args.batch_size or w.batch_size,
        args.seq_len or w.context,
        args.precision or DEFAULT_PRECISION,
        args.model_args,
    )


def _costs(args: argparse.Namespace, batch: Batch | None = None) -> Any:
    """Per-op costs of one micro-batch of what the flags ask for."""
    from coordinator.estimator import DagCosts
    from coordinator.opdag import build_opdag
    from coordinator.workloads import WorkloadError, workload_costs
    from protocol.model.job import parse_kwargs

    batch = batch or batch_of(args)
    if batch.workload is not None:
        shape = parse_kwargs(batch.shape)
        try:
            return workload_costs(batch.workload, batch.batch_size or 1, batch.seq_len or 1, batch.precision, shape)
        except WorkloadError as exc:
            raise UsageError(f"--model {batch.workload}: {exc}") from None
    resolved = argparse.Namespace(**{**vars(args), "micro_batches": batch.micro_batches, "precision": batch.precision})
    job = job_from_args(resolved)
    model = job.checked_model()
    return DagCosts.from_opdag(build_opdag(model, job.first_micro_batch()))


def _options(args: argparse.Namespace, batch: Batch | None = None) -> Any:
    """The scheduler's options from the flags."""
    from coordinator.plan_eval import Options

    return Options(
        micro_batches=(batch or batch_of(args)).micro_batches,
        max_stages=args.max_stages,
        compression=args.compression != "none",
        lowrank=args.compression == "auto-lowrank",
        seed=args.seed,
        stages=args.stages,
    )


def _workload_json(batch: Batch, costs: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The model and its batch, for ``--json``."""
    from coordinator.workloads import MASTER_DTYPE

    info: dict[str, Any] = {
        "model": batch.workload or args.model,
        "model_args": batch.shape if batch.workload else args.model_args,
        "parameters": sum(costs.param_bytes) // MASTER_DTYPE.itemsize,
        "ops": costs.num_ops,
        "micro_batches": batch.micro_batches,
        "precision": batch.precision,
    }
    if batch.workload is None:
        return {"workload": {**info, "data": args.data or "the model's", "data_args": args.data_args}}
    more = {"batch_size": batch.batch_size, "seq_len": batch.seq_len, "tokens_per_iteration": batch.tokens}
    return {"workload": {**info, **more}}


def _model_name(batch: Batch, args: argparse.Namespace) -> str:
    """The model as the user named it, with its changed shape."""
    name, shape = (batch.workload, batch.shape) if batch.workload else (args.model, args.model_args)
    return f"{name} ({shape})" if shape else name


def _workload_text(batch: Batch, costs: Any, args: argparse.Namespace) -> str:
    """One line on the model, its workload and batch."""
    info = _workload_json(batch, costs, args)["workload"]
    name = _model_name(batch, args)
    if batch.workload is None:
        data = f"data {args.data}" if args.data else "the model's own data"
        return (
            f"{name}: {info['parameters'] / 1e6:.3g}M parameters, {costs.num_ops} ops; {data}"
            f"{f' ({args.data_args})' if args.data_args else ''}; {batch.micro_batches} micro-batches of its "
            f"batch; {batch.precision}\n"
        )
    return (
        f"{name}: {info['parameters'] / 1e9:.3g}B parameters, {costs.num_ops} ops; "
        f"{batch.micro_batches} micro-batches x {batch.batch_size} x {batch.seq_len} tokens = "
        f"{batch.tokens:,} tokens per iteration; {batch.precision} activations, fp32 weights and Adam\n"
    )


def left_out(costs: Any, p: Any, peers: list[Any], network: Any) -> dict[str, list[str]]:
    """The peers ``p`` does not use, by why: the reason's words to their ids."""
    from coordinator.estimator import stage_memory

    used = {pid for g in p.groups for pid in g}
    clusters = {network.cluster_of.get(q.id, q.cluster) for q in peers if q.id in used}
    need = min((stage_memory(costs, lo, hi, 1) for lo, hi in p.ranges(costs.num_ops)), default=0)
    out: dict[str, list[str]] = {}
    for q in peers:
        if q.id in used:
            continue
        if q.memory_bytes < need:
            why = f"too little memory: the smallest stage needs {need / 1e9:.3g} GB"
        elif network.cluster_of.get(q.id, q.cluster) not in clusters:
            why = "in a cluster the plan does not use (its links to the planned peers would slow it)"
        else:
            why = "standby: the plan is no faster with them"
        out.setdefault(why, []).append(q.id)
    return out


def _left_out_text(out: dict[str, list[str]], indent: str = "  ") -> list[str]:
    lines = []
    for why, ids in out.items():
        names = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        lines.append(f"{indent}left out {len(ids)} peer{'s' if len(ids) > 1 else ''} [{names}]: {why}")
    return lines


def _plan_text(p: Any, costs: Any, micro_batches: int) -> str:
    from coordinator.plan_eval import bottleneck

    lines = [
        f"{p.scheduler}: {len(p.groups)} stages, predicted iteration {p.iteration_s:.4g} s "
        f"(lower bound {p.lower_bound_s:.4g} s); steps factor {p.steps_factor:.3g}: {p.to_loss_s:.4g} s to the "
        f"loss per iteration uncompressed{'' if p.fits_memory else ', DOES NOT FIT MEMORY'}"
    ]
    for s, ((lo, hi), g, t) in enumerate(zip(p.ranges(costs.num_ops), p.groups, p.stage_s)):
        names = ", ".join(g[:6]) + (f" and {len(g) - 6} more" if len(g) > 6 else "")
        lines.append(
            f"  stage {s}: ops {lo}-{hi - 1} ({costs.stage_flops(lo, hi) / 1e9:.2f} GFLOP), {len(g)} peers "
            f"[{names}], {t * 1e3:.2f} ms per micro-batch, replica gradient sends {p.allreduce_s[s] * 1e3:.1f} ms"
        )
    for b, (pos, c, t) in enumerate(zip(p.cut, p.codecs, p.link_s)):
        lines.append(
            f"  link {b} -> {b + 1} (after op {pos - 1}, {costs.cross_bytes[pos] / 1e6:.2f} MB per micro-batch): "
            f"{c}, {t * 1e3:.2f} ms"
        )
    lines.append(f"  bottleneck: {bottleneck(p, micro_batches)}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    from coordinator.plan_eval import ScheduleError, bottleneck
    from coordinator.scheduler import plan

    batch = batch_of(args)
    topo = _topology(args.topology)
    costs = _costs(args, batch)
    try:
        p = plan(args.scheduler, costs, topo.peers, topo.network, _options(args, batch))
    except ScheduleError as exc:
        raise UsageError(str(exc)) from None
    out = left_out(costs, p, topo.peers, topo.network)
    if args.json:
        head = {"num_ops": costs.num_ops, "topology": topo.name, **_workload_json(batch, costs, args)}
        neck = bottleneck(p, batch.micro_batches)
        print(json.dumps({**head, **p.to_json(costs.num_ops), "bottleneck": neck, "left_out": out}))
    else:
        used = len(topo.peers) - sum(len(ids) for ids in out.values())
        where = f"on {topo.name}: {used} of its {len(topo.peers)} peers planned"
        text = _workload_text(batch, costs, args) + _plan_text(p, costs, batch.micro_batches)
        print("\n".join([text, where, *_left_out_text(out)]))
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
    from sim.plot import plot_iterations

    batch = batch_of(args)
    topo = _topology(args.topology)
    costs = _costs(args, batch)
    churn, held = churn_events(topo, args.iterations, args.churn, args.seed)
    results = _simulate_all(args, topo, costs, _options(args, batch), churn, held)
    if args.json:
        print(json.dumps(_sim_json(args, topo, costs, results, held) | _workload_json(batch, costs, args)))
    else:
        print(_workload_text(batch, costs, args) + _sim_text(args, topo, costs, results, held))
    if args.plot:
        title = (
            f"{_model_name(batch, args)} on {topo.name} ({len(topo.peers)} peers), policy {args.policy}, "
            f"{args.churn} churn events"
        )
        plot_iterations(args.plot, {n: r for n, (r, _) in results.items()}, title, churn)
    return 0


def _simulate_all(
    args: argparse.Namespace, topo: Any, costs: Any, options: Any, churn: list[Any], held: set[str]
) -> dict[str, tuple[Any, float]]:
    """Each scheduler's simulation and its wall time; a progress bar on stderr unless --json."""
    from tqdm import tqdm

    from coordinator.plan_eval import ScheduleError
    from sim.engine import simulate

    results = {}
    bar = tqdm(total=len(args.schedulers) * args.iterations, unit="it", disable=args.json, file=sys.stderr)
    try:
        for name in args.schedulers:
            bar.set_description(f"{name}: planning")

            def tick(_: int, name: str = name) -> None:
                bar.set_description(name, refresh=False)
                bar.update(1)

            start = time.perf_counter()
            try:
                r = simulate(
                    costs, topo, name, options, args.iterations, churn, held_out=held, policy=args.policy, progress=tick
                )
            except ScheduleError as exc:
                raise UsageError(f"{name}: {exc}") from None
            results[name] = (r, time.perf_counter() - start)
    finally:
        bar.close()
    return results


def _sim_left_out(costs: Any, r: Any, topo: Any, held: set[str]) -> dict[str, list[str]]:
    """Who the scheduler's first plan left out, and why (the churn's joiners: held back)."""
    if r.first_plan is None:
        return {}
    out = left_out(costs, r.first_plan, [q for q in topo.peers if q.id not in held], topo.network)
    return ({"held back to join later (--churn)": sorted(held)} if held else {}) | out


def _discovery(topo: Any, results: dict[str, tuple[Any, float]]) -> Any:
    """Discovery's and the control plane's cost for this swarm (``coordinator.discovery_cost``),
    with the first scheduler's plan and iteration time."""
    from coordinator.discovery_cost import swarm_cost

    r = next(iter(results.values()))[0]
    sizes = [len(g) for g in r.first_plan.groups] if r.first_plan is not None else None
    planned = sum(sizes) if sizes else len(topo.peers)
    replan_s = sum(r.iteration_s) / len(r.replans) if r.replans else 0.0  # simulated seconds between re-plans
    return swarm_cost(len(topo.peers), planned, r.mean_s, replan_s, sizes)


def _sim_json(
    args: argparse.Namespace, topo: Any, costs: Any, results: dict[str, tuple[Any, float]], held: set[str]
) -> dict[str, Any]:
    return {
        "discovery": _discovery(topo, results).as_dict(),
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
                "probes_asked": r.probes_asked,
                "goodput": r.goodput,
                "wall_s": round(w, 3),
                "left_out": _sim_left_out(costs, r, topo, held),
            }
            for n, (r, w) in results.items()
        },
    }


def _sim_text(
    args: argparse.Namespace, topo: Any, costs: Any, results: dict[str, tuple[Any, float]], held: set[str]
) -> str:
    lines = [f"{topo.name}: {len(topo.peers)} peers, {costs.num_ops} ops, {args.iterations} iterations"]
    for n, (r, w) in results.items():
        lines.append(
            f"  {n:<8} {r.mean_s:.4g} s per iteration (predicted {r.predicted_s:.4g} s, lower bound "
            f"{r.lower_bound_s:.4g} s, {len(r.replans)} re-plans, {r.redone} iterations redone, "
            f"{r.probes_asked} links probed before planning, goodput "
            f"{r.goodput:.4g} iterations/s; simulated in {w:.1f} s)"
        )
        lines.extend(_left_out_text(_sim_left_out(costs, r, topo, held), indent="    "))
    d = _discovery(topo, results)
    lines.append(
        f"  discovery: {d.shards} advert shard(s), busiest DHT node {d.busiest_holder_kB_s:.4g} kB/s "
        f"({d.holder_rpc_s:.3g} lookups/s), coordinator {d.coordinator_kB_per_poll:.4g} kB per poll, largest "
        f"DHT reply {d.largest_message_kB:.4g} kB, control plane {d.coordinator_cpu:.3g} coordinator CPU-s/s "
        f"(step reports, commits and re-plans); a re-plan sends each planned peer its neighbourhood's assignment, "
        f"the largest {d.assign_kB:.4g} kB"
        f"{'' if d.assign_sendable else ' (over the frame header cap: the plan is refused)'}, "
        f"{d.replan_cpu_s:.3g} CPU-s to seal them all"
    )
    return "\n".join(lines)
