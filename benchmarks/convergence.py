"""Does compressing a slow link cost accuracy, and how many more steps does it cost?
The demo's GPT is trained 300 steps by a 3-peer swarm on loopback, with the same
seed, five ways:

- uncompressed (``--compression none``): ``plain``, the reference;
- ``fp16`` and ``int8``, the first two rungs of ``auto``'s ladder. The CLI forces
  a fixed codec on every link, so these runs compress both stage boundaries, not
  just the slow one: their price is that of two compressed edges (an upper bound
  for one);
- ``--compression auto-lowrank`` (named ``auto`` in the output: it was ``auto``'s last
  rung until ``auto`` stopped at int8 for its measured loss) with the second stage
  boundary paced to a slow link of ``SLOW_MBPS`` (the first stays fast and, having
  enough bandwidth, uncompressed): slow enough that it takes its last rung, activations at low rank with
  gradients as unbiased 4-bit codes, the rank pinned to 10 (``lowrank:10/int4sr``)
  so the slow link carries at least 10x fewer bytes;
- ``--compression adatopk`` on the same slow link, the kept fraction pinned to 12%
  for the same reason.

The cut is pinned too, between transformer blocks (``block_cut``: after blocks 1
and 3 of 4), so every run compresses the same tensors, the residual stream. Left
to itself, the planner cuts where the peers' noisy adverts say: on this machine it
put the slow boundary right before the loss in some runs (the logits cross it,
where AdaTopK diverges and ``auto`` at 10 Mbit/s took int8), mid-network in others.
The demo runs through ``launch``, which lets the planner pick the peers and pins
only the cut.

A single 300-step run is chaotic: the same seed with nothing changed but fp16
rounding on one boundary moves the final loss by ~1%, a compressed run by a few
percent either way. So each seed (``--seeds N``, default 2: seeds 0, 1) runs all
five, and ``loss_ratio`` is the mean over seeds of compressed over uncompressed
validation loss (20 held-out batches) for ``auto``, the codec the swarm picks for
slow links; ``per_seed`` lists every run. ``slow_link_bytes_ratio`` is the
smallest over seeds of the slow link's tensor bytes over its bytes on the wire.

``steps_factor`` is each codec's statistical price, as the planner charges it: the
steps the compressed run needs to reach the loss the uncompressed run reached at
its last step, over the steps run (1.0: no slower; above 1: slower), the mean over
seeds (``per_seed`` has each). The curve is the *training* loss of every step (the
coordinator records it in the run directory), smoothed by a least-squares fit of
``a + b ln(step)`` over the second half of the run. Every run sees the same batches
in the same order, and the fit is linear in the losses, so the batches' differing
difficulty cancels between two runs' fits. The target is the uncompressed fit at
the last step; a compressed run that reaches it within the run is read off its
fit; one that does not is extrapolated along its fit (log-linear: each doubling of
the steps buys the same loss, a slowing that is more pessimistic than continuing
the last slope), and a factor is capped at ``MAX_STEPS_FACTOR`` (also where the fit
does not fall at all: the run stopped learning or diverged).

``--store PATH`` also writes the measured factors, with the command, date, commit
and raw numbers, as the data file the planner reads (``coordinator/codec_steps.json``).

``--short`` runs the same five swarms for the test suite: one seed (unless
``--seeds`` says otherwise), 6 steps, a 2-layer GPT of width 64 (cut after each
block; ``steps`` and the losses are then those of the short run). Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.assign import Assignment
from coordinator.checkpoint import RunDir
from coordinator.opdag import OpDag
from fusionllm.local import validation_loss
from protocol.model.graph import Cut
from protocol.model.job import JobSpec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conftest import BASE_ENV, launcher  # noqa: E402

STEPS = 300
SEEDS = 2  # five 300-step swarms per seed: about 7 minutes a seed on 2 cores
SHORT_STEPS = 6
SHORT_MODEL_ARGS = "n_layer=2,n_embd=64,n_head=4"
#: the slow link: its 133 KB per micro-batch take ~5-10x the ~50-100 ms of compute
#: that a stage of two blocks is estimated at, so auto-lowrank goes past int8 (at 10
#: Mbit/s it stopped at fp16 or int8)
SLOW_MBPS = 2.0
#: pinned so the slow link carries at least 10x fewer bytes
FRACTION = 0.12
RANK = 10
#: the largest steps factor reported: a codec that needs 10x the steps is unusable,
#: and a fit extrapolated that far says little more than that
MAX_STEPS_FACTOR = 10.0
_SLOW = ("--link-mbps", f"10000,{SLOW_MBPS:g}")
#: run name -> demo flags (spot checks re-execute work and change nothing of the math: off, for time)
RUNS = {
    "plain": ("--compression", "none"),
    "fp16": ("--compression", "fp16"),
    "int8": ("--compression", "int8"),
    "auto": ("--compression", "auto-lowrank", *_SLOW, "--rank", str(RANK)),
    "adatopk": ("--compression", "adatopk", *_SLOW, "--topk-fraction", str(FRACTION)),
}
#: the codec each compressed run prices, as ``steps_factor`` and the planner name it
PRICED = {"fp16": "fp16", "int8": "int8", "auto": "lowrank/int4sr", "adatopk": "adatopk"}


@dataclass
class Run:
    val_loss: float
    codec: str  # the slow link's
    slow_link_mb: float  # on the wire
    bytes_ratio: float  # the slow link's tensor bytes over its bytes on the wire
    cut: list[int]
    losses: list[float]  # the training loss of every step


def _demo(out: Path, job: JobSpec, flags: tuple[str, ...]) -> Run:
    """One demo run of ``job``: its validation loss, the slow link's traffic, its cut
    and its training losses."""
    ckpt, run_dir = out / "model.safetensors", out / "run"
    cmd = [LAUNCH_FLAG, "demo", "--peers", "3", "--steps", str(job.steps)]
    cmd += ["--seed", str(job.seed), "--spot-check", "0", "--run-dir", str(run_dir), "--save", str(ckpt)]
    if job.model_args:
        cmd += ["--model-args", job.model_args]
    proc = launcher().run([*cmd, *flags], module="benchmarks.convergence", env=_env(), cwd=ROOT, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"demo {' '.join(flags)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    m = re.search(r"boundary 1 \(.*?\): (\S+), ([\d.]+) MB on the wire .*? ratio ([\d.]+)x", proc.stdout)
    cut = re.search(r"^cut (\[.*?\])", proc.stdout, re.M)
    assert m and cut, proc.stdout[-3000:]
    with RunDir(run_dir) as rd:
        losses = rd.losses()
    assert len(losses) == job.steps, (len(losses), job.steps)
    loss = validation_loss(job, ckpt)
    return Run(round(loss, 4), m.group(1), float(m.group(2)), float(m.group(3)), json.loads(cut.group(1)), losses)


#: how ``_demo`` starts ``fusionllm``: this module's :func:`launch`, forked from a warm zygote
LAUNCH_FLAG = "--as-fusionllm"


def _env() -> dict[str, str]:
    return {**os.environ, **BASE_ENV}


def block_cut(dag: OpDag, stages: int) -> Cut | None:
    """A cut of the demo GPT into ``stages`` between transformer blocks (before a
    block's first layer norm, or before the final one), spread evenly over the
    blocks; None for a model without them."""
    names = [op.name for op in dag.ops]
    starts = [i for i, n in enumerate(names) if re.fullmatch(r"blocks_\d+_ln_1", n)]
    if "ln_f" not in names or len(starts) < stages - 1:
        return None
    after = [*starts[1:], names.index("ln_f")]  # after = [end of block 1, ..., end of the last]
    picks: list[int] = []
    for s in range(1, stages):
        picks.append(max(round(s * len(after) / stages), picks[-1] + 1 if picks else 1))
    return Cut(tuple(after[p - 1] for p in picks))


def launch(argv: list[str]) -> None:
    """``fusionllm`` with the coordinator's cut pinned to :func:`block_cut` (the
    planner still picks which peer serves which stage)."""
    import coordinator.planning as run
    from fusionllm.cli import main

    planned = run.assign

    def pinned(dag: OpDag, adverts: Any, num_stages: int | None = None, *args: Any, **kwargs: Any) -> Assignment:
        plan = planned(dag, adverts, num_stages, *args, **kwargs)
        cut = block_cut(dag, plan.cut.num_stages)
        return plan if cut is None else Assignment(cut, plan.stages)  # no prediction: it was for another cut

    run.assign = pinned
    sys.exit(main(argv))


def log_fit(losses: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares fit ``a + b ln(step)`` to the second half of a
    run's losses (``losses[i]`` is step ``i + 1``'s)."""
    first = len(losses) // 2
    xs = [math.log(i + 1) for i in range(first, len(losses))]
    ys = losses[first:]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def steps_factor(plain: list[float], compressed: list[float]) -> float:
    """The steps the ``compressed`` run needs (on its fit) to reach the loss of the
    ``plain`` run's fit at its last step, over the steps run; within
    [1 / ``MAX_STEPS_FACTOR``, ``MAX_STEPS_FACTOR``]."""
    steps = len(plain)
    a_p, b_p = log_fit(plain)
    a_c, b_c = log_fit(compressed)
    target = a_p + b_p * math.log(steps)
    if not all(map(math.isfinite, (target, a_c, b_c))):
        return MAX_STEPS_FACTOR
    if b_c >= 0:  # not learning: it is either there already or never gets there
        return 1.0 if a_c + b_c * math.log(steps) <= target else MAX_STEPS_FACTOR
    log_factor = (target - a_c) / b_c - math.log(steps)  # ln(steps needed / steps)
    return round(math.exp(min(max(log_factor, -math.log(MAX_STEPS_FACTOR)), math.log(MAX_STEPS_FACTOR))), 4)


def measure(seeds: list[int], steps: int, model_args: str) -> dict[str, list[Run]]:
    """Every run of every seed, by run name."""
    runs: dict[str, list[Run]] = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            job = JobSpec(steps=steps, seed=seed, model_args=model_args)
            for name, flags in RUNS.items():
                out = Path(tmp) / f"{name}-{seed}"
                out.mkdir()
                runs[name].append(_demo(out, job, flags))
    return runs


def report(runs: dict[str, list[Run]], seeds: list[int], steps: int) -> dict[str, Any]:
    """The benchmark's JSON object."""

    def ratios(name: str) -> list[float]:
        return [round(r.val_loss / p.val_loss, 4) for r, p in zip(runs[name], runs["plain"], strict=True)]

    def mean_loss(name: str) -> float:
        return round(statistics.mean(r.val_loss for r in runs[name]), 4)

    factors = {
        codec: [steps_factor(p.losses, r.losses) for r, p in zip(runs[name], runs["plain"], strict=True)]
        for name, codec in PRICED.items()
    }
    auto, topk = ratios("auto"), ratios("adatopk")
    return {
        "steps": steps,
        "seeds": len(seeds),
        "uncompressed_val_loss": mean_loss("plain"),
        "auto_val_loss": mean_loss("auto"),
        "loss_ratio": round(statistics.mean(auto), 4),
        "loss_ratio_max": max(auto),
        "slow_link_bytes_ratio": min(r.bytes_ratio for r in runs["auto"]),
        "slow_link_codec": runs["auto"][0].codec,
        "adatopk_val_loss": mean_loss("adatopk"),
        "adatopk_loss_ratio": round(statistics.mean(topk), 4),
        "adatopk_bytes_ratio": min(r.bytes_ratio for r in runs["adatopk"]),
        "adatopk_codec": runs["adatopk"][0].codec,
        "slow_link_mbps": SLOW_MBPS,
        "steps_factor": {codec: round(statistics.mean(f), 4) for codec, f in factors.items()},
        "per_seed": [
            {
                "seed": s,
                "uncompressed": runs["plain"][i].val_loss,
                "auto": runs["auto"][i].val_loss,
                "auto_ratio": auto[i],
                "auto_cut": runs["auto"][i].cut,
                "adatopk": runs["adatopk"][i].val_loss,
                "adatopk_ratio": topk[i],
                "fp16": runs["fp16"][i].val_loss,
                "int8": runs["int8"][i].val_loss,
                "auto_slow_link_mb": runs["auto"][i].slow_link_mb,
                "uncompressed_slow_link_mb": runs["plain"][i].slow_link_mb,
                "steps_factor": {codec: f[i] for codec, f in factors.items()},
            }
            for i, s in enumerate(seeds)
        ],
    }


def store(path: Path, out: dict[str, Any], seconds: float) -> None:
    """Write the planner's data file: per codec, the measured factor (at least 1: a
    codec does not speed training up, and a factor below 1 is a run's chaos), with
    where it came from."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    data = {
        "about": "Steps-to-the-same-loss factor per codec of auto's ladder (and AdaTopK), per compressed edge; "
        "measured by benchmarks/convergence.py (its docstring says how). 'factors' is what the planner charges: "
        "the mean over seeds, at least 1.0; 'measured' is the benchmark's output as printed.",
        "factors": {codec: max(1.0, f) for codec, f in out["steps_factor"].items()},
        "pinned": {"lowrank/int4sr": f"lowrank:{RANK}/int4sr", "adatopk": f"adatopk:{FRACTION:g}"},
        "edges": "fp16 and int8 on both stage boundaries (the CLI's fixed modes), lowrank/int4sr and adatopk on the "
        f"slow one ({SLOW_MBPS:g} Mbit/s) only; the demo GPT cut between transformer blocks "
        f"{out['per_seed'][0]['auto_cut']}: every boundary carries the residual stream",
        "source": {
            "command": " ".join(["python", "benchmarks/convergence.py", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "commit": commit or None,
            "machine": "2 CPU cores, loopback swarm of 3 peers",
            "seconds": round(seconds),
            "steps": out["steps"],
            "seeds": out["seeds"],
            "loss": "training loss of every step, fit a + b ln(step) over the second half of the run",
            "max_factor": MAX_STEPS_FACTOR,
        },
        "measured": out,
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds 0..N-1 (default {SEEDS}, 1 with --short)")
    ap.add_argument("--short", action="store_true", help="a quick run of the same paths (for the test suite)")
    ap.add_argument("--store", type=Path, default=None, metavar="PATH", help="write the planner's data file here")
    args = ap.parse_args()
    seeds = list(range(args.seeds if args.seeds is not None else 1 if args.short else SEEDS))
    steps = SHORT_STEPS if args.short else STEPS
    start = time.monotonic()
    runs = measure(seeds, steps, SHORT_MODEL_ARGS if args.short else "")
    out = report(runs, seeds, steps)
    if args.short:
        out["short"] = True
    if args.store is not None:
        store(args.store, out, time.monotonic() - start)
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1:2] == [LAUNCH_FLAG]:
        launch(sys.argv[2:])
    main()
