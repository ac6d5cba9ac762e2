"""Building a stage on a peer: its own stage of a plan, or (to arbitrate a spot check)
another stage of the same cut, from the stage's ATen program (checked before it
runs) or, for a run whose stages are the model's code, rebuilt from the job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from peer.executor import StageExecutor
from protocol.model.graph import Cut, build_stage, partition, trace
from protocol.model.job import JobSpec, SpecError, foreign_code
from protocol.model.program import Program, ProgramError
from protocol.model.program_check import build_checked
from protocol.wire.encoding import raw_bytes
from protocol.wire.messages import Assign


class RunRefused(RuntimeError):
    """The assignment cannot be served (e.g. a malformed key or codec in it)."""


class ForeignCode(RunRefused):
    """The run's model is code this peer did not opt in to: it can never serve this run."""


@dataclass
class HeldStage:
    """The stage a peer holds across epochs: its executor, which cut and stage it is,
    and the step whose gradients are complete but not yet committed (if any)."""

    key: tuple[tuple[int, ...], int]
    ex: StageExecutor
    pending: int | None = None


@dataclass
class StageBuilder:
    """Builds the stages of one assignment's cut on this peer."""

    job: JobSpec
    a: Assign
    device: torch.device
    namespaces: tuple[str, ...]  # the operator namespaces this peer runs stage programs from
    allow_code: list[str]  # model modules this peer opted in to import
    memory_bytes: int | None  # what this peer measured free (None: unknown)
    activation_bytes: int = 0  # what its own stage's program computes per micro-batch (its dry run's count)

    @property
    def cut(self) -> Cut:
        return Cut(tuple(self.a.cut))

    @property
    def num_stages(self) -> int:
        return self.cut.num_stages

    def own_program(self, values: list[Any]) -> StageExecutor:
        """The assigned stage from its program: operators checked against this peer's
        allowed namespaces and the program run on the meta device against the plan's
        shapes before it is built (nothing of it runs on real data before both pass)."""
        s = self.a.stage
        if foreign_code(self.job.model) in self.allow_code:
            try:
                self.job.model_factory()  # the code this volunteer opted in to: its own operators register
            except SpecError as exc:
                raise RunRefused(str(exc)) from None
        try:
            module, self.activation_bytes = self.checked_program(s, values)
        except ProgramError as exc:
            raise ForeignCode(str(exc)) from None
        return StageExecutor(module, self.job.recipe(), s == self.num_stages - 1, casts_inside=True)

    def checked_program(self, s: int, values: list[Any]) -> tuple[torch.nn.Module, int]:
        """Stage ``s`` built from its program once every check passed (``build_checked``:
        operators, memory against what this peer measured free, a dry run against the
        plan's shapes); ``ProgramError`` otherwise."""
        a, k = self.a, self.num_stages
        if not a.specs or len(a.specs) != k:
            raise ProgramError("the assignment does not give the shapes to check the stage program against")
        outputs = None if s == k - 1 else a.specs[s + 1]
        prog = Program.from_payload(values)
        return build_checked(prog, a.specs[s], outputs, self.device, self.namespaces, self.memory_bytes)

    def from_job(self, s: int) -> StageExecutor:
        """Stage ``s`` of the cut, rebuilt from the job's model code."""
        module = build_stage(partition(trace(self.job.build_model()), self.cut), s).to(self.device)
        return StageExecutor(module, self.job.recipe(), s == self.num_stages - 1)

    def other(self, s: int, program: list[Any]) -> StageExecutor:
        """Another stage of this cut, to arbitrate: from its program, or (a run whose
        stages are the model's code) rebuilt from the job."""
        if self.a.program:
            module, _ = self.checked_program(s, program)
            return StageExecutor(module, self.job.recipe(), s == self.num_stages - 1, casts_inside=True)
        return self.from_job(s)

    def lending(self, ex: StageExecutor, program: list[Any], my_mbs: int) -> str:
        """What this peer is about to lend to the stage: operators, parameters, memory
        (weights, gradients and AdamW's two moments in fp32, plus the activations of
        the micro-batches 1F1B keeps in flight) and traffic per step before compression."""
        a, s, k, prog = self.a, self.a.stage, self.num_stages, Program.from_payload(program)
        ops = prog.operators()
        params = sum(p.numel() for p in ex.params)
        in_flight = min(my_mbs, k - s)
        memory = 4 * 4 * params + in_flight * self.activation_bytes
        inputs = raw_bytes(a.specs[s]) if s else 0
        outputs = raw_bytes(a.specs[s + 1]) if s < k - 1 else 0
        traffic = 2 * my_mbs * (inputs + outputs)  # values one way, their gradients back
        return (
            f"stage {s}: a program of {len(prog.graph['nodes'])} calls to {len(ops)} ATen operators, "
            f"{params / 1e6:.2f}M parameters; lending about {memory / 2**20:.0f} MiB of memory and "
            f"{traffic / 2**20:.1f} MiB of traffic per step (before compression)"
        )
