"""``fusionllm testbed run`` and ``down``: build the namespaces, train the same model
under each scheduler's plan on the same links, report, remove everything."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionllm.testbed import DEFAULT_MODEL_ARGS, plans, report, topo
from fusionllm.testbed import lab as labmod
from fusionllm.testbed.swarm import Measured, Swarm, SwarmSpec
from fusionllm.usage import UsageError

logger = logging.getLogger(__name__)
COORDINATOR = "coordinator"
#: steps of the short run that measures what the peers deliver before the plans run
CALIBRATION_STEPS = 6


def _links_line(t: Any) -> str:
    rates = sorted({(mbps, ms) for mbps, ms in topo.pairs(t).values()}, reverse=True)
    shown = ", ".join(f"{mbps:g} Mbit/s + {ms:g} ms" for mbps, ms in rates)
    return f"links: {shown} (htb per destination; latency added in the send path)"


def run_testbed(
    topology: str,
    schedulers: list[str],
    model: str = "gpt",
    model_args: str = DEFAULT_MODEL_ARGS,
    micro_batches: int = 4,
    steps: int = 30,
    compressions: tuple[str, ...] = ("none",),
    work: Path | None = None,
    say: Any = print,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Every scheduler's plan trained on the testbed, uncompressed (a plan several chose
    runs once), and with ``"auto"`` in ``compressions`` OP-Fence's plan priced with
    codecs; the report's JSON object. UsageError (one line) when the machine cannot
    build it or a run fails; every namespace and process made is gone when it returns
    or raises."""
    why = labmod.missing()
    if why:
        raise UsageError(f"testbed: {why} (Linux, root and iproute2 are needed)")
    t, costs, compute = _emulated(topology, model, model_args, micro_batches)
    work = work or Path(tempfile.mkdtemp(prefix="fusionllm-testbed-"))
    stale = labmod.remove_stale()
    if stale:
        say(f"removed {len(stale)} namespaces an earlier testbed left")
    hosts = {COORDINATOR: topo.COORDINATOR_IP, **topo.addresses(t)}
    lab = labmod.Lab(hosts, {pair: mbps for pair, (mbps, _) in topo.pairs(t).items()})
    job_args = ["--model", model, "--model-args", model_args, "--micro-batches", str(micro_batches), "--seed", "0"]
    bed = _Bed(t, lab, work, job_args, {h: topo.delay_table(t, h) for h in topo.addresses(t)}, timeout_s)
    runs: dict[tuple[str, str], Measured] = {}
    try:
        lab.build()
        compute = _calibrated(bed, costs, compute, schedulers[0], micro_batches, say)
        say(compute.describe(t))
        predicted = plans.predict_all(schedulers, costs, t, compute, micro_batches)
        todo = [(p, "none") for p in _distinct(predicted)]
        if "auto" in compressions and "opfence" in schedulers:  # OP-Fence's plan with the codecs it priced
            todo += [(p, "auto") for p in plans.predict_all(["opfence"], costs, t, compute, micro_batches, True)]
        for p, mode in todo:
            runs[(p.scheduler, mode)] = m = bed.run(p, mode, steps, compute)
            say(f"{p.scheduler} ({mode}): measured {m.step_s * 1e3:.1f} ms, estimated {p.estimated_s * 1e3:.1f} ms")
    finally:
        lab.close()
    out = _result(topology, t, compute, predicted, runs, costs, micro_batches)
    if ("opfence", "auto") in runs:
        out.update(_auto(runs, todo[-1][0], costs, t, compute, micro_batches))
    return out


@dataclass
class _Bed:
    """What every run on one testbed shares: the topology, the namespaces, the folder,
    the job's flags, each peer's delay table, the time limit."""

    topology: Any
    lab: labmod.Lab
    work: Path
    job_args: list[str]
    delays: dict[str, str]
    timeout_s: float

    def run(self, p: plans.Predicted, mode: str, steps: int, compute: topo.ComputeMap, name: str = "") -> Measured:
        """``p``'s plan trained for ``steps`` in ``mode``, each peer throttled as ``compute`` says."""
        folder = self.work / (name or f"{p.scheduler}-{mode}")
        folder.mkdir(parents=True, exist_ok=True)
        plan_file = p.write(self.topology, folder / "plan.json")
        args = [*self.job_args, "--steps", str(steps)]
        spec = SwarmSpec(
            args, plan_file, folder, compute.throttles, self.delays, mode, self.timeout_s, compute.call_s * 1e3
        )
        return _one_run(self.lab, spec, f"{name or p.scheduler} ({mode})")


def _calibrated(bed: _Bed, costs: Any, compute: topo.ComputeMap, scheduler: str, mb: int, say: Any) -> topo.ComputeMap:
    """The compute mapping corrected by a short run of ``scheduler``'s plan: what one
    thread delivers beside the swarm's processes and a compute call's own work
    (``plans.fit_compute``), as one thread measured alone on a shared machine is no
    guide to it (it read 3 to 50 GFLOP/s); the optimizer as the run took it
    (``plans.optimizer_scale``)."""
    (first,) = plans.predict_all([scheduler], costs, bed.topology, compute, mb)
    m = bed.run(first, "none", CALIBRATION_STEPS, compute, name="calibration")
    flops, call_s = plans.fit_compute(first.plan, costs, bed.topology, compute, m.stage_compute_s, mb)
    updates = (CALIBRATION_STEPS - 1) / CALIBRATION_STEPS  # the first step's window holds no update
    slower = plans.optimizer_scale(first.plan, costs, bed.topology, compute, m.stage_parts, updates)
    reading = f"{compute.base_flops / 1e9:.2f} GFLOP/s read alone"
    say(
        f"calibration: one thread delivered {flops / 1e9:.2f} GFLOP/s ({reading}) and {call_s * 1e3:.2f} ms a "
        f"compute call; the optimizer x{slower:.2f}"
    )
    mapped = topo.map_compute(bed.topology, flops, compute.cores)
    return dataclasses.replace(mapped, optimizer_scale=slower, call_s=call_s)


def _emulated(topology: str, model: str, model_args: str, micro_batches: int) -> tuple[Any, Any, topo.ComputeMap]:
    """The topology, the model's costs, and the topology's FLOP/s mapped onto this machine."""
    from protocol.model.job import JobSpec

    t = topo.load_topology(topology)
    job = JobSpec(model=model, model_args=model_args, micro_batches=micro_batches)
    costs = plans.costs_of(job)
    return t, costs, topo.map_compute(t, plans.one_thread_flops(job, costs), os.cpu_count() or 1)


def _distinct(predicted: list[plans.Predicted]) -> list[plans.Predicted]:
    """The plans to run: a plan another scheduler also chose runs once."""
    seen: dict[Any, plans.Predicted] = {}
    for p in predicted:
        seen.setdefault(_key(p), p)
    return list(seen.values())


def _key(p: plans.Predicted) -> Any:
    return (tuple(p.plan.cut), tuple(tuple(g) for g in p.plan.groups))


def _one_run(lab: labmod.Lab, spec: SwarmSpec, what: str) -> Measured:
    """One swarm to its end; its processes are gone when this returns or raises."""
    swarm = Swarm(lab, COORDINATOR, spec)
    try:
        return swarm.run()
    except RuntimeError as exc:
        raise UsageError(f"testbed: {what} failed: {exc} (logs in {spec.work})") from None
    finally:
        swarm.stop()


def _result(
    topology: str, t: Any, compute: topo.ComputeMap, predicted: list[plans.Predicted], runs: dict, costs: Any, mb: int
) -> dict:
    """The report: each scheduler's row, its prediction made again for the compute its
    stages' peers delivered (``plans.as_delivered``; with one scale for all, and as
    mapped, beside it), the ratios."""
    rows = {}
    ran = {_key(p): p.scheduler for p in predicted if (p.scheduler, "none") in runs}
    for p in predicted:
        m = runs[(ran[_key(p)], "none")]
        d = plans.as_delivered(p, costs, t, compute, m.stage_compute_s, mb)
        rows[p.scheduler] = report.row(m.step_s, d.estimated_s, d.simulated_s, m.wire_bytes, p.plan.groups)
        rows[p.scheduler].update(codecs=m.codecs, final_loss=m.final_loss, compute_ratio=d.ratios)
        rows[p.scheduler].update(delivered_compute=round(d.scale, 3), estimated_mapped_s=round(p.estimated_s, 5))
        rows[p.scheduler].update(estimated_one_scale_s=round(d.estimated_one_scale_s, 5))
        rows[p.scheduler].update(simulated_mapped_s=round(p.simulated_s, 5))
        if ran[_key(p)] != p.scheduler:
            rows[p.scheduler]["same_plan_as"] = ran[_key(p)]
    out: dict[str, Any] = {
        "topology": topology,
        "peers": len(t.peers),
        "compute": compute.describe(t),
        "cores_used": round(compute.cores_used, 3),
        "links": _links_line(t),
        "schedulers": rows,
        **report.summary(rows),
        "auto_vs_none_measured": None,
        "auto_loss_ratio": None,
    }
    return out


def _auto(
    runs: dict, planned: plans.Predicted, costs: Any, t: Any, compute: topo.ComputeMap, mb: int
) -> dict[str, Any]:
    """OP-Fence's plan priced with ``auto``'s codecs against its uncompressed one: the
    time ratio (uncompressed over compressed), the loss ratio (compressed over not),
    the estimator's time for it as mapped and for the compute its peers delivered (as
    the schedulers' rows have it), the codecs the planner priced beside those the live
    swarm chose on its links."""
    auto, none = runs[("opfence", "auto")], runs[("opfence", "none")]
    est = plans.as_delivered(planned, costs, t, compute, auto.stage_compute_s, mb).estimated_s
    return {
        "auto_vs_none_measured": report.ratio(none.step_s, auto.step_s),
        "auto_loss_ratio": report.ratio(auto.final_loss, none.final_loss),
        "auto_measured_s": round(auto.step_s, 5),
        "auto_estimated_mapped_s": round(planned.estimated_s, 5),
        "auto_estimated_s": round(est, 5),
        "auto_estimator_error": report.ratio(est - auto.step_s, auto.step_s),
        "auto_codecs_planned": [str(c) for c in planned.plan.codecs],
        "auto_codecs_live": auto.codecs,
        "auto_plan": planned.plan.groups,
    }


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the finally blocks: processes and namespaces go


def cmd_testbed(args: argparse.Namespace) -> int:
    if args.testbed_command == "down":
        if labmod.missing(()):
            raise UsageError(f"testbed down: {labmod.missing(())}")
        gone = labmod.down()
        print(f"removed {len(gone)} testbed namespaces (their veths and qdiscs with them)")
        return 0
    from fusionllm.reaper import start_reaper

    start_reaper()  # kill -9 of this command: the watchdog ends the swarm's processes
    signal.signal(signal.SIGTERM, _terminate)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else print
    try:
        result = _run_from(args, say)
    except topo.TestbedError as exc:
        raise UsageError(f"testbed: {exc}") from None
    print(json.dumps(result) if args.json else report.table(result))
    return 0


def _run_from(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    return run_testbed(
        args.topology,
        args.schedulers,
        args.model,
        args.model_args,
        args.micro_batches,
        args.steps,
        ("none", args.compression),
        Path(args.work) if args.work else None,
        say=say,
    )
