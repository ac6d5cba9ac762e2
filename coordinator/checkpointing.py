"""The run's checkpoints: when to ask for one, taking each stage's state as it
arrives (checked against the plan), writing it to the run directory, each stage's
part of the last one for a restore, and the trained weights once the last step's
is written. It owns the checkpoint timing and the latest checkpoint written."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from coordinator import replan
from coordinator.checkpoint import CheckpointError, CheckpointInfo, RunDir
from coordinator.outcome import SwarmError
from coordinator.runstate import OPTIM_KEYS, OPTIM_PREFIX, RunState, owner
from coordinator.stages import Stages
from coordinator.status import StatusBoard
from protocol.model.graph import Cut
from protocol.net.clock import Clock
from protocol.net.tasks import log_failure
from protocol.net.transport import Inbound
from protocol.wire.codecs import finite

logger = logging.getLogger(__name__)


class Checkpoints:
    def __init__(
        self,
        st: RunState,
        stages: Stages,
        run_dir: RunDir,
        board: StatusBoard,
        every: int,
        clock: Clock,
        note_written: Callable[[int], None],
        on_event: Callable[[str], None],
    ) -> None:
        self.st = st
        self.stages = stages
        self.steps = stages.job.steps
        self.run_dir = run_dir
        self.board = board
        self.every = every
        self.clock = clock
        self.note_written = note_written  # told the step of each checkpoint before it is saved
        self.on_event = on_event
        self.latest: CheckpointInfo | None = None  # the newest checkpoint written
        self.cost_s: float | None = None  # measured: asked for -> written (clock seconds)
        self.final: dict[str, torch.Tensor] | None = None  # the trained weights, once the last step's is written
        self.final_write: asyncio.Task[None] | None = None
        self._parts: dict[tuple[int, int], dict[int, dict[str, torch.Tensor]]] = {}  # (epoch, step) -> stages'
        self._writes: list[asyncio.Task[None]] = []
        self._asked_at: dict[int, float] = {}  # step -> when its checkpoint was asked for
        self._trained_at = 0.0  # seconds of steps so far when the last checkpoint was asked for

    @property
    def pending_parts(self) -> int:
        """Checkpoints of which some stages' state arrived and not yet all."""
        return len(self._parts)

    def due(self, force: bool = False) -> bool:
        """Whether the step just committed is checkpointed (``replan.checkpoint_due``,
        or ``force``: a rebalance moves state through it); the last step always is
        (peers send it unasked)."""
        st = self.st
        if st.step >= self.steps:
            return False
        last = self.latest.step if self.latest else 0
        trained = sum(st.step_seconds)  # seconds of steps so far (redone ones too)
        due = force or replan.checkpoint_due(st.step, last, self.every, trained - self._trained_at, self.cost_s)
        if due:
            self._trained_at, self._asked_at[st.step] = trained, self.clock.now()
        return due

    def forget_parts(self) -> None:
        """A new epoch: the parts of the old one's checkpoints will not be completed."""
        self._parts.clear()
        self._asked_at.clear()

    def take_part(self, inbound: Inbound) -> None:
        """A stage's checkpoint state arrived; write the checkpoint once every stage's has."""
        st, msg = self.st, inbound.message
        assert st.plan is not None
        k = st.plan.cut.num_stages
        if msg.epoch != st.epoch or not 0 <= msg.stage < k or inbound.sender != st.plan.stages[msg.stage][0]:
            return
        values = inbound.frame.values()
        problem = self.check_part(msg.stage, msg.names, values)
        if not problem and not all(finite(v) for v in values if v.is_floating_point()):
            raise self._diverged(msg.stage, msg.step, inbound.sender)
        if problem:
            logger.warning("ignoring the checkpoint state of stage %d from %s: %s", msg.stage, inbound.sender, problem)
            return
        parts = self._parts.setdefault((msg.epoch, msg.step), {})
        parts[msg.stage] = dict(zip(msg.names, values, strict=True))
        if len(parts) == k:
            for key in [key for key in self._parts if key[1] <= msg.step]:  # older incomplete ones too
                del self._parts[key]
            stages = [parts[s] for s in range(k)]
            task = asyncio.create_task(self.write(msg.step, stages))
            task.add_done_callback(log_failure)
            self._writes.append(task)
            if msg.step >= self.steps:
                self.final_write = task

    def check_part(self, stage: int, names: list[str], values: list[Any]) -> str:
        """Why a stage's checkpoint state does not fit the plan ('' if it does): its
        weights and optimizer entries, by name and shape, and nothing else."""
        assert self.st.plan is not None
        own = self.stages.names(self.st.plan.cut)[stage]
        shapes = {n: t.shape for n, t in self.stages.model.state_dict().items()}
        if len(names) != len(values) or not all(isinstance(v, torch.Tensor) for v in values):
            return "names and tensors do not pair up"
        got = dict(zip(names, values, strict=True))
        if not own <= set(got):
            return f"missing {sorted(own - set(got))[:3]}"
        for name, t in got.items():
            weight, key = owner(name), name.rsplit("/", 1)[-1]
            if weight not in own or (name != weight and key not in OPTIM_KEYS):
                return f"'{name[:80]}' is not this stage's"
            want = shapes[weight] if name == weight or key in ("exp_avg", "exp_avg_sq") else torch.Size([])
            if t.shape != want:
                return f"'{name[:80]}' has shape {list(t.shape)}, expected {list(want)}"
        return ""

    def _diverged(self, stage: int, step: int, sender: str) -> Exception:
        """A stage's state after ``step`` steps is not finite (its inputs were: receivers
        check them): the run stops rather than save it; the last checkpoint stays."""
        last = self.latest
        kept = (
            f"the last finite checkpoint (step {last.step}) is in {last.path}" if last else "no checkpoint was written"
        )
        return SwarmError(
            f"the weights of stage {stage} (peer {sender}) are not finite after step {step}: the training diverged "
            f"(try a lower --lr, --clip-grad-norm, or fp32); nothing non-finite was saved; {kept}"
        )

    async def write(self, step: int, stages: list[dict[str, torch.Tensor]]) -> None:
        """Save the checkpoint of ``step`` (every stage's state) to the run directory."""
        st, plan = self.st, self.st.plan
        assert plan is not None
        info = {"cut": plan.cut.to_list(), "stages": plan.stages, "codecs": [str(c) for c in st.codecs]}
        self.note_written(step)  # before the save: a stop may cut it short
        t0 = time.perf_counter()  # a measurement for the report (how long saving took)
        saved = await asyncio.get_running_loop().run_in_executor(
            None, self.run_dir.save_checkpoint, step, st.epoch, stages, info
        )
        seconds = time.perf_counter() - t0
        st.checkpoint_s.append(seconds)
        asked = self._asked_at.pop(step, None)
        if asked is not None:  # what a checkpoint costs, from the commit that asked for it to written
            self.cost_s = self.clock.now() - asked
        if self.latest is None or saved.step >= self.latest.step:
            self.latest = saved
        self.board.checkpoint(step, str(saved.path), seconds, saved.nbytes)
        if step >= self.steps:
            merged: dict[str, torch.Tensor] = {}
            for part in stages:
                merged.update({n: t for n, t in part.items() if not n.startswith(OPTIM_PREFIX)})
            self.final = merged

    async def flush(self) -> None:
        """Wait for the writes under way (a failed one is said; the previous checkpoint stays)."""
        writes, self._writes = self._writes, []
        for t in writes:
            try:
                await t
            except Exception as exc:  # a failed write leaves the previous checkpoint in place
                logger.error("writing a checkpoint failed: %s", exc)
                self.on_event(f"writing a checkpoint failed: {exc}")

    def drop_after(self, step: int) -> None:
        """Checkpoints of more than ``step`` steps are not trusted: dropped from the run directory."""
        self.run_dir.drop_after(step)
        self.latest = self.run_dir.latest()

    def stage_states(self, cut: Cut) -> list[dict[str, torch.Tensor]]:
        """Each stage's part of the last checkpoint (weights and optimizer state), or of
        the starting weights before the first."""
        names = self.stages.names(cut)
        if self.latest is None:
            init = self.stages.init_state
            assert init is not None
            return [{n: t for n, t in init.items() if n in own} for own in names]
        try:
            merged = self.run_dir.load(self.latest)
        except CheckpointError as exc:
            raise SwarmError(f"cannot read the checkpoint of step {self.latest.step}: {exc}") from None
        return [{n: t for n, t in merged.items() if owner(n) in own} for own in names]

    def stop_line(self, why: str) -> str:
        """The line a run that cannot go on ends with: why, and where its last checkpoint is."""
        ckpt = self.latest
        left = f"the last checkpoint (step {ckpt.step}) is in {ckpt.path}" if ckpt else "no checkpoint was written"
        return f"the run cannot go on: {why}; {left}"
