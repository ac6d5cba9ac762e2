"""The anchor ``pipeline.py`` sets the swarm against: the same training with
``torch.distributed.pipelining``, the tool a PyTorch user would reach for to run a
pipeline over processes of one machine.

One process per stage (rank), one thread each, gloo over loopback (rendezvous through
a file store in a temporary directory), ``Schedule1F1B``. Each rank builds its stage
from the demo's job exactly as the swarm's peers do (``protocol.model.graph``: the
traced model split at the swarm's cut), so the same operators run on the same
values: the same model and starting weights, batches, micro-batches, and the
recipe's AdamW and learning-rate schedule per stage. The last stage's output is the
micro-batch's loss (the model computes it), and the schedule averages the
micro-batches' gradients as the swarm does.

Not a benchmark of its own (``tests/test_benchmarks.py`` lists the ones it runs):
:func:`pipelining_run` starts the ranks (``python -m benchmarks._pipelining``,
forked from the tests' zygote) and waits for them; on a failure or past its timeout
it kills every rank still running."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fusionllm.local import job_model  # noqa: E402
from peer.executor import make_optimizer, set_lr  # noqa: E402
from protocol.model.graph import Cut, stage_modules  # noqa: E402
from protocol.model.job import JobSpec, split_batch  # noqa: E402

MODULE = "benchmarks._pipelining"  # what each rank runs
#: the longest the ranks may take, beyond their steps, before they are killed
RANK_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class PipeliningResult:
    tokens_per_s: float  # tokens over the sum of the steps' times (they tile the run), as the swarm counts
    median_step_ms: float
    steps: int
    losses: list[float]  # each step's loss, the mean over its micro-batches (as the swarm's)


def pipelining_run(cut: list[int], steps: int, timeout: float = RANK_TIMEOUT_S) -> PipeliningResult:
    """Train the default job for ``steps`` steps through ``torch.distributed.pipelining``
    on ``cut`` (the swarm's stage boundaries, one rank per stage); what it measured."""
    from tests.conftest import BASE_ENV, launcher

    world = len(cut) + 1
    env = {**os.environ, **BASE_ENV}
    with tempfile.TemporaryDirectory(prefix="fusionllm-pipelining-") as tmp:
        result = Path(tmp) / "result.json"
        common = ["--world", str(world), "--cut", ",".join(map(str, cut)), "--steps", str(steps), "--dir", tmp]
        logs = [open(Path(tmp) / f"rank{r}.log", "wb") for r in range(world)]  # noqa: SIM115 (closed below)
        ranks = []
        try:
            for r in range(world):
                args = ["--rank", str(r), *common]
                ranks.append(launcher().spawn(args, module=MODULE, env=env, cwd=ROOT, stdout=logs[r].fileno()))
            codes = _wait_all(ranks, timeout)
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
            for log in logs:
                log.close()
        if any(codes) or not result.is_file():
            tails = [(Path(tmp) / f"rank{r}.log").read_text(errors="replace")[-1500:] for r in range(world)]
            raise SystemExit(f"torch.distributed.pipelining's ranks exited {codes}:\n" + "\n".join(tails))
        data = json.loads(result.read_text())
    return PipeliningResult(data["tokens_per_s"], data["median_step_ms"], data["steps"], data["losses"])


def _wait_all(ranks: list, timeout: float) -> list[int | None]:
    """Each rank's exit code; None for one still running at the deadline, or once
    another rank failed (it would wait on its peer for ever)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [r.poll() for r in ranks]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return codes
        time.sleep(0.05)
    return [r.poll() for r in ranks]


#: what a boundary value of an integer dtype (the targets, say) crosses a cut as: torch
#: 2.11's pipelining asks every received value for gradients, which only floating
#: tensors can have. The same 8 bytes an element as int64, and exact below 2**53.
CARRIER = torch.float64


class TensorsOnly(torch.nn.Module):
    """A stage whose boundary values are all floating tensors, as pipelining requires.

    The traced model passes some Python ints between stages (a micro-batch's sizes, the
    same for every micro-batch of the job): a stage leaves them out of what it sends,
    and the next one puts them back from ``ints`` (position: value), found once by
    running the stages before it on the first micro-batch (:func:`stage_shapes`).

    Tensors of an integer dtype cross as :data:`CARRIER` and are cast back to their
    own dtype (``carried``: position among the received tensors: dtype) before the
    stage runs, so it computes on the values it would have had. Where pipelining
    marks a received carrier as needing a gradient (torch 2.11 marks them all), the
    stage ties it to what it sends on by adding ``0 * carrier.sum()`` (an exact zero)
    to its own carriers out, or else to its first floating output (the last stage's
    loss): every received value then has a gradient (zeros) to send back, as 2.11
    requires, and no value the stage computes changes."""

    def __init__(self, stage: torch.nn.Module, ints: dict[int, int], carried: dict[int, torch.dtype]) -> None:
        super().__init__()
        self.stage = stage
        self.ints = ints
        self.carried = carried

    def forward(self, *tensors: torch.Tensor) -> object:
        own = (t.detach().to(self.carried[i]) if i in self.carried else t for i, t in enumerate(tensors))
        count = len(tensors) + len(self.ints)
        out = self.stage(*(self.ints[i] if i in self.ints else next(own) for i in range(count)))
        sent = [v for v in out if not isinstance(v, int)] if isinstance(out, tuple) else [out]
        carriers = [not v.is_floating_point() for v in sent]
        sent = [v.to(CARRIER) if c else v.contiguous() for v, c in zip(sent, carriers, strict=True)]
        held = [t for i, t in enumerate(tensors) if i in self.carried and t.requires_grad]
        if held:
            zero = 0 * sum(t.sum() for t in held)
            tied = [i for i, c in enumerate(carriers) if c] or [carriers.index(False)]
            for i in tied:
                sent[i] = sent[i] + zero.to(sent[i].dtype)
        return tuple(sent) if isinstance(out, tuple) else sent[0]


@dataclass
class StageShapes:
    """What one stage takes and gives on the job's micro-batches: the Python ints
    among its inputs (position: value), the received tensors that cross as
    :data:`CARRIER` (position: own dtype), and example tensors of its inputs and
    outputs as :class:`TensorsOnly` takes and gives them (shapes, dtypes, whether they
    need gradients) for pipelining's static mode, since its inference from shapes alone
    would run the last stage's loss on empty targets."""

    ints: dict[int, int]
    carried: dict[int, torch.dtype]
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


def _tensors(values: object) -> tuple[torch.Tensor, ...]:
    vs = values if isinstance(values, tuple) else (values,)
    return tuple(v.detach().contiguous().requires_grad_(v.requires_grad) for v in vs if isinstance(v, torch.Tensor))


def stage_shapes(modules: list[torch.nn.Module], rank: int, job: JobSpec) -> StageShapes:
    """Stage ``rank``'s :class:`StageShapes`: the stages up to it, run on the job's first micro-batch.

    A carrier's example does not need a gradient (torch 2.13 then sends none for it;
    2.11 asks for one anyway, and :class:`TensorsOnly` gives zeros)."""
    batch = next(iter(job.batches()))
    if batch[0].shape[0] % job.micro_batches:
        raise SystemExit(f"a batch of {batch[0].shape[0]} does not split into {job.micro_batches} equal micro-batches")
    values: tuple[object, ...] = split_batch(batch, job.micro_batches)[0]
    for module in modules[:rank]:
        values = module(*values)
    ints = {i: v for i, v in enumerate(values) if isinstance(v, int)}
    inputs = _tensors(values)
    # the first stage takes the batch itself; the others receive what crossed the cut
    carried = {i: t.dtype for i, t in enumerate(inputs) if rank and not t.is_floating_point()}
    inputs = tuple(t.to(CARRIER) if i in carried else t for i, t in enumerate(inputs))
    out = TensorsOnly(modules[rank], ints, carried)(*inputs)
    return StageShapes(ints, carried, inputs, _tensors(out))


def _rank(rank: int, world: int, cut: list[int], steps: int, where: Path) -> None:
    """One stage's process: train ``steps`` steps; the last rank writes what it measured."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{where / 'store'}", rank=rank, world_size=world)
    try:
        job = JobSpec(steps=steps)
        recipe = job.recipe()
        _, modules = stage_modules(job_model(job), Cut(tuple(cut)))
        shapes = stage_shapes(modules, rank, job)
        module = TensorsOnly(modules[rank], shapes.ints, shapes.carried)
        stage = PipelineStage(module, rank, world, torch.device("cpu"), shapes.inputs, shapes.outputs)
        schedule = Schedule1F1B(stage, job.micro_batches, loss_fn=lambda loss, _target: loss)
        opt = make_optimizer([p for p in module.parameters() if p.requires_grad], recipe)
        last = rank == world - 1
        times: list[float] = []
        losses: list[float] = []  # the last rank's: each step's mean over its micro-batches
        tokens = 0
        dist.barrier()
        for step, batch in enumerate(itertools.islice(job.batches(), steps)):
            start = time.perf_counter()
            if rank == 0:
                schedule.step(*batch)
            elif last:  # the loss is the stage's output; the target only sets the micro-batches' count
                mb_losses: list[torch.Tensor] = []
                schedule.step(target=torch.zeros(batch[0].shape[0]), losses=mb_losses, return_outputs=False)
                losses.append(statistics.fmean(float(x) for x in mb_losses))
            else:
                schedule.step()
            set_lr(opt, recipe, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            tokens += batch[0].numel()
        dist.barrier()
        if last:
            out = {
                "tokens_per_s": tokens / sum(times),
                "median_step_ms": 1000 * statistics.median(times),
                "steps": len(times),
                "losses": losses,
            }
            (where / "result.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description="one rank of the torch.distributed.pipelining anchor")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--cut", required=True, help="the stage boundaries, comma-separated")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--dir", type=Path, required=True, help="the run's directory (file store, result)")
    args = ap.parse_args()
    _rank(args.rank, args.world, [int(x) for x in args.cut.split(",")], args.steps, args.dir)


if __name__ == "__main__":
    main()
